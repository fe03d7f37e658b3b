//! The subset of CRIU's `images/rpc.proto` (proto2) that possum speaks, written out by hand.
//!
//! Field numbers and types follow rpc.proto as shipped by CRIU 4.x. Only what possum sends or reads
//! is declared; prost skips unknown fields when decoding, so newer CRIUs that answer with more
//! fields are fine. Optional proto2 fields are `Option`s: `None` is not sent, and CRIU then keeps
//! its own default. `required` fields are always encoded.

/// `criu_req_type`: what a request asks for (and what a response answers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum ReqType {
    /// No request; CRIU answers a request it could not parse with this type.
    Empty = 0,
    /// Dump a process tree.
    Dump = 1,
    /// Restore a process tree.
    Restore = 2,
    /// Check that the kernel supports what CRIU needs.
    Check = 3,
    /// Pre-dump (memory only, iterative migration).
    PreDump = 4,
    /// Start a page server.
    PageServer = 5,
    /// A notification from CRIU (action scripts), answered by the client.
    Notify = 6,
    /// Dump the CPU info.
    CpuinfoDump = 7,
    /// Check the CPU info against an image.
    CpuinfoCheck = 8,
    /// Ask which optional features the kernel and CRIU support.
    FeatureCheck = 9,
    /// Ask CRIU's version.
    Version = 10,
    /// Wait for a child of the service.
    WaitPid = 11,
    /// Start a page server as a child.
    PageServerChld = 12,
}

/// `criu_network_lock_method`: how CRIU keeps packets away from the TCP connections it dumps
/// or restores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum NetworkLockMethod {
    /// Rules added with `iptables-restore` (the iptables programs must be installed).
    Iptables = 1,
    /// A table added through libnftables (the kernel must have nf_tables).
    Nftables = 2,
    /// No lock: the connections are only put in TCP repair mode.
    Skip = 3,
}

/// `criu_cg_mode`: how CRIU treats cgroups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum CgMode {
    /// Do not dump or restore cgroups.
    Ignore = 0,
    /// Dump cgroup membership but restore nothing.
    CgNone = 1,
    /// Restore properties only.
    Props = 2,
    /// Restore cgroups without overwriting existing properties (CRIU's default).
    Soft = 3,
    /// Restore everything.
    Full = 4,
    /// Restore everything and fail if something differs.
    Strict = 5,
    /// CRIU's default mode.
    Default = 6,
}

/// `inherit_fd`: on restore, use the client's descriptor `fd` for the file named `key`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InheritFd {
    /// The image's name for the file (e.g. `pipe:[12345]`).
    #[prost(string, required, tag = "1")]
    pub key: String,
    /// The descriptor, as numbered in the criu process.
    #[prost(int32, required, tag = "2")]
    pub fd: i32,
}

/// `criu_opts`: the options of a dump, restore or check request.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CriuOpts {
    /// The images directory, as a descriptor number *of the client*: CRIU opens
    /// `/proc/<client pid>/fd/<images_dir_fd>`, the client's PID being the socket's peer.
    #[prost(int32, required, tag = "1")]
    pub images_dir_fd: i32,
    /// The root of the tree to dump (on dump; unset dumps the client itself).
    #[prost(int32, optional, tag = "2")]
    pub pid: Option<i32>,
    /// Let the tree run on after the dump instead of killing it.
    #[prost(bool, optional, tag = "3")]
    pub leave_running: Option<bool>,
    /// Allow connections to unix sockets outside the tree.
    #[prost(bool, optional, tag = "4")]
    pub ext_unix_sk: Option<bool>,
    /// Dump and restore established TCP connections.
    #[prost(bool, optional, tag = "5")]
    pub tcp_established: Option<bool>,
    /// Allow devices to be dumped as paths when their names are missing.
    #[prost(bool, optional, tag = "6")]
    pub evasive_devices: Option<bool>,
    /// The tree is a shell job (it has a controlling terminal or is in the client's session).
    #[prost(bool, optional, tag = "7")]
    pub shell_job: Option<bool>,
    /// Dump and restore file locks.
    #[prost(bool, optional, tag = "8")]
    pub file_locks: Option<bool>,
    /// 0 (messages) to 4 (debug).
    #[prost(int32, optional, tag = "9", default = "2")]
    pub log_level: Option<i32>,
    /// The log file's name inside the work directory (the images directory by default).
    #[prost(string, optional, tag = "10")]
    pub log_file: Option<String>,
    /// Let CRIU send `NOTIFY` messages for its action scripts.
    #[prost(bool, optional, tag = "12")]
    pub notify_scripts: Option<bool>,
    /// The root directory of the restored tree.
    #[prost(string, optional, tag = "13")]
    pub root: Option<String>,
    /// The parent images directory, relative to the images directory (incremental dumps).
    #[prost(string, optional, tag = "14")]
    pub parent_img: Option<String>,
    /// Track memory changes (soft-dirty) for incremental dumps.
    #[prost(bool, optional, tag = "15")]
    pub track_mem: Option<bool>,
    /// Punch holes in the parent images for pages that are dumped again.
    #[prost(bool, optional, tag = "16")]
    pub auto_dedup: Option<bool>,
    /// The work directory (logs, stats), as a client descriptor number like `images_dir_fd`.
    #[prost(int32, optional, tag = "17")]
    pub work_dir_fd: Option<i32>,
    /// Allow linking unlinked-but-open files back into the file system to dump them.
    #[prost(bool, optional, tag = "18")]
    pub link_remap: Option<bool>,
    /// Resolve inotify paths by scanning the file system.
    #[prost(bool, optional, tag = "21")]
    pub force_irmap: Option<bool>,
    /// A command CRIU `exec`s once the restore succeeded (swrk only).
    #[prost(string, repeated, tag = "22")]
    pub exec_cmd: Vec<String>,
    /// Restore the root task as a sibling of criu, i.e. as a child of the client (swrk only).
    #[prost(bool, optional, tag = "26")]
    pub rst_sibling: Option<bool>,
    /// Descriptors of the client to use in place of files named in the image (swrk only).
    #[prost(message, repeated, tag = "27")]
    pub inherit_fd: Vec<InheritFd>,
    /// Cgroup handling.
    #[prost(enumeration = "CgMode", optional, tag = "34")]
    pub manage_cgroups_mode: Option<i32>,
    /// The largest unlinked file CRIU copies into the image, in bytes.
    #[prost(uint32, optional, tag = "35")]
    pub ghost_limit: Option<u32>,
    /// Resources outside the tree, in `criu --external` syntax.
    #[prost(string, repeated, tag = "37")]
    pub external: Vec<String>,
    /// How long to wait for the tree to freeze, in seconds.
    #[prost(uint32, optional, tag = "45")]
    pub timeout: Option<u32>,
    /// Skip TCP connections still being established.
    #[prost(bool, optional, tag = "46")]
    pub tcp_skip_in_flight: Option<bool>,
    /// Do not fail when a sysctl cannot be restored.
    #[prost(bool, optional, tag = "47")]
    pub weak_sysctls: Option<bool>,
    /// Dump: leave the pages of private anonymous mappings in the frozen tree, to be served by
    /// the page server once the dump is over (its pagemap marks them `PE_LAZY`).
    #[prost(bool, optional, tag = "48")]
    pub lazy_pages: Option<bool>,
    /// An extra CRIU configuration file that overrides these options.
    #[prost(string, optional, tag = "51")]
    pub config_file: Option<String>,
    /// Close established TCP connections on restore instead of restoring them.
    #[prost(bool, optional, tag = "52")]
    pub tcp_close: Option<bool>,
    /// How the network of established TCP connections is locked while they are dumped and
    /// restored (unset: the one CRIU was built with, iptables unless built otherwise).
    #[prost(enumeration = "NetworkLockMethod", optional, tag = "64")]
    pub network_lock: Option<i32>,
}

/// `criu_dump_resp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DumpResp {
    /// True when the client dumped itself and is now the restored copy.
    #[prost(bool, optional, tag = "1")]
    pub restored: Option<bool>,
}

/// `criu_restore_resp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RestoreResp {
    /// The PID of the restored tree's root.
    #[prost(int32, required, tag = "1")]
    pub pid: i32,
}

/// `criu_notify`: an action-script notification.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Notify {
    /// The script's name (e.g. `post-restore`).
    #[prost(string, optional, tag = "1")]
    pub script: Option<String>,
    /// The restored root's PID, for restore notifications.
    #[prost(int32, optional, tag = "2")]
    pub pid: Option<i32>,
}

/// `criu_features`: optional features, asked for and answered with `FEATURE_CHECK`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Features {
    /// Memory tracking (soft-dirty) for incremental dumps.
    #[prost(bool, optional, tag = "1")]
    pub mem_track: Option<bool>,
    /// Lazy restore of pages through userfaultfd.
    #[prost(bool, optional, tag = "2")]
    pub lazy_pages: Option<bool>,
}

/// `criu_req`: one request.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CriuReq {
    /// What is asked for.
    #[prost(enumeration = "ReqType", required, tag = "1")]
    pub r#type: i32,
    /// Options of dump, restore and check requests.
    #[prost(message, optional, tag = "2")]
    pub opts: Option<CriuOpts>,
    /// The answer to a `NOTIFY`: whether the client's script succeeded.
    #[prost(bool, optional, tag = "3")]
    pub notify_success: Option<bool>,
    /// Keep the connection open for more requests (only some request types).
    #[prost(bool, optional, tag = "4")]
    pub keep_open: Option<bool>,
    /// The features a `FEATURE_CHECK` asks about.
    #[prost(message, optional, tag = "5")]
    pub features: Option<Features>,
    /// The PID a `WAIT_PID` waits for.
    #[prost(uint32, optional, tag = "6")]
    pub pid: Option<u32>,
}

/// `criu_resp`: one response.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CriuResp {
    /// The request type answered (`EMPTY` when CRIU rejected the request).
    #[prost(enumeration = "ReqType", required, tag = "1")]
    pub r#type: i32,
    /// Whether the request succeeded.
    #[prost(bool, required, tag = "2")]
    pub success: bool,
    /// The answer to a dump.
    #[prost(message, optional, tag = "3")]
    pub dump: Option<DumpResp>,
    /// The answer to a restore.
    #[prost(message, optional, tag = "4")]
    pub restore: Option<RestoreResp>,
    /// A notification (type `NOTIFY`).
    #[prost(message, optional, tag = "5")]
    pub notify: Option<Notify>,
    /// CRIU's error number, when it has one.
    #[prost(int32, optional, tag = "7")]
    pub cr_errno: Option<i32>,
    /// The answer to a `FEATURE_CHECK`.
    #[prost(message, optional, tag = "8")]
    pub features: Option<Features>,
    /// The first error CRIU logged.
    #[prost(string, optional, tag = "9")]
    pub cr_errmsg: Option<String>,
    /// The answer to a `VERSION` request.
    #[prost(message, optional, tag = "10")]
    pub version: Option<Version>,
    /// The wait status of a `WAIT_PID`.
    #[prost(int32, optional, tag = "11")]
    pub status: Option<i32>,
}

/// `criu_version`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Version {
    /// Major version.
    #[prost(int32, required, tag = "1")]
    pub major_number: i32,
    /// Minor version.
    #[prost(int32, required, tag = "2")]
    pub minor_number: i32,
    /// The git commit CRIU was built from, when known.
    #[prost(string, optional, tag = "3")]
    pub gitid: Option<String>,
    /// Sublevel (the 1 of 4.1.1).
    #[prost(int32, optional, tag = "4")]
    pub sublevel: Option<i32>,
    /// Extra version number.
    #[prost(int32, optional, tag = "5")]
    pub extra: Option<i32>,
    /// The release's name.
    #[prost(string, optional, tag = "6")]
    pub name: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn version_request_is_two_bytes() {
        let req = CriuReq {
            r#type: ReqType::Version as i32,
            ..Default::default()
        };
        // Field 1, varint (key 0x08), value 10.
        assert_eq!(req.encode_to_vec(), [0x08, 0x0a]);
    }

    #[test]
    fn dump_request_encodes_required_and_set_fields_only() {
        let req = CriuReq {
            r#type: ReqType::Dump as i32,
            opts: Some(CriuOpts {
                images_dir_fd: 5,
                pid: Some(1234),
                leave_running: Some(true),
                log_file: Some("d.log".into()),
                rst_sibling: Some(true),
                ..Default::default()
            }),
            ..Default::default()
        };
        let expected: Vec<u8> = [
            &[0x08, 0x01][..],                           // type = DUMP
            &[0x12, 17],                                 // opts, 17 bytes
            &[0x08, 0x05],                               // images_dir_fd = 5
            &[0x10, 0xd2, 0x09],                         // pid = 1234
            &[0x18, 0x01],                               // leave_running = true
            &[0x52, 0x05, b'd', b'.', b'l', b'o', b'g'], // log_file (field 10, LEN)
            &[0xd0, 0x01, 0x01],                         // rst_sibling (field 26, varint) = true
        ]
        .concat();
        assert_eq!(req.encode_to_vec(), expected);
    }

    #[test]
    fn the_network_lock_method_is_field_64() {
        let opts = CriuOpts {
            images_dir_fd: 5,
            tcp_established: Some(true),
            network_lock: Some(NetworkLockMethod::Skip as i32),
            ..Default::default()
        };
        let expected: Vec<u8> = [
            &[0x08, 0x05][..],   // images_dir_fd = 5
            &[0x28, 0x01],       // tcp_established (field 5) = true
            &[0x80, 0x04, 0x03], // network_lock (field 64, varint) = SKIP
        ]
        .concat();
        assert_eq!(opts.encode_to_vec(), expected);
    }

    #[test]
    fn decodes_a_restore_response_and_skips_unknown_fields() {
        let bytes: Vec<u8> = [
            &[0x08, 0x02][..],               // type = RESTORE
            &[0x10, 0x01],                   // success = true
            &[0x22, 0x03, 0x08, 0xb9, 0x60], // restore { pid = 12345 }
            &[0xf8, 0x07, 0x01],             // field 127 (unknown to us), varint
        ]
        .concat();
        let resp = CriuResp::decode(&bytes[..]).unwrap();
        assert_eq!(resp.r#type(), ReqType::Restore);
        assert!(resp.success);
        assert_eq!(resp.restore.unwrap().pid, 12345);
    }

    #[test]
    fn decodes_a_failure_with_errno_and_message() {
        let mut bytes = vec![0x08, 0x01, 0x10, 0x00, 0x38, 0x03, 0x4a, 0x04];
        bytes.extend_from_slice(b"oops");
        let resp = CriuResp::decode(&bytes[..]).unwrap();
        assert!(!resp.success);
        assert_eq!(resp.cr_errno, Some(3));
        assert_eq!(resp.cr_errmsg.as_deref(), Some("oops"));
    }

    #[test]
    fn version_round_trips() {
        let v = Version {
            major_number: 4,
            minor_number: 1,
            sublevel: Some(1),
            ..Default::default()
        };
        assert_eq!(Version::decode(&v.encode_to_vec()[..]).unwrap(), v);
    }
}
