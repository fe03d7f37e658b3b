//! `libpossum_criu_plugin.so`: possum's plugin for CRIU 4.x.
//!
//! Jobs are process trees: a DataLoader worker forked from a CUDA process inherits its NVIDIA
//! device mappings (`/dev/nvidia*`, `/dev/nvidiactl`, `/dev/nvidia-uvm`), and CRIU cannot dump a
//! character-device mapping that no plugin claims (`handle_device_vma plugin failed`). This
//! plugin is the place where possum will claim them. Today it is the foundation:
//!
//! - CRIU loads it (`criu dump|restore --libdir DIR`, DIR holding this `.so`) through the
//!   `CR_PLUGIN_DESC` descriptor ([`ffi`]); `init`/`exit` log through CRIU's log.
//! - For anything that is not an NVIDIA device it answers "not mine" (`-ENOTSUP`, what CRIU's
//!   `run_plugins` treats as "no plugin handles it"), so it never gets in the way of processes
//!   without NVIDIA mappings: CRIU behaves as if the plugin were not there.
//! - For an NVIDIA mapping or open NVIDIA device file it refuses, clearly and logged, naming the
//!   pid(s) and the device. TODO(issue 15): dump inherited NVIDIA mappings of a process without a
//!   CUDA context as reservations restored inaccessible, and run possum's checkpoint sequence for
//!   processes with one.
//!
//! All `unsafe` (the C ABI) is in [`ffi`]; the decisions are safe functions here.
#![deny(unsafe_code)]

pub mod ffi;

use std::path::{Path, PathBuf};

/// The prefix of every line this plugin logs.
pub const LOG_PREFIX: &str = "possum-criu-plugin:";

/// The character-device major number registered to NVIDIA (`/dev/nvidia0..N`, `/dev/nvidiactl`;
/// Linux's `Documentation/admin-guide/devices.txt`). `nvidia-uvm` and `nvidia-caps` get dynamic
/// majors, so those are recognised by path.
pub const NVIDIA_MAJOR: u32 = 195;

/// What the plugin does with a device mapping or an external file CRIU asks it about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not an NVIDIA device: "not mine" (`-ENOTSUP`), CRIU goes on as without the plugin.
    NotMine,
    /// An NVIDIA device: refused for now (TODO(issue 15): handle it), with the message to log.
    RefuseNvidia(String),
}

/// Whether `path` names an NVIDIA device node (`/dev/nvidia0`, `/dev/nvidiactl`,
/// `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools`, `/dev/nvidia-caps/...`).
pub fn is_nvidia_path(path: &Path) -> bool {
    path.to_str().is_some_and(|s| s.starts_with("/dev/nvidia"))
}

/// Whether a file is an NVIDIA device: by its path, or (a character device) by its major number.
pub fn is_nvidia(path: Option<&Path>, char_device_major: Option<u32>) -> bool {
    path.is_some_and(is_nvidia_path) || char_device_major == Some(NVIDIA_MAJOR)
}

/// The verdict on a device mapping (CRIU's `HANDLE_DEVICE_VMA`) or an external file
/// (`DUMP_EXT_FILE`) whose file is `path` (as `/proc/self/fd` names it), a character device of
/// major `char_device_major` when it is one. `what` says which hook asks; `pids` are the dumped
/// processes found using the file.
pub fn verdict(
    what: &str,
    path: Option<&Path>,
    char_device_major: Option<u32>,
    pids: impl FnOnce() -> Vec<i32>,
) -> Verdict {
    if !is_nvidia(path, char_device_major) {
        return Verdict::NotMine;
    }
    let name = path.map_or_else(
        || format!("a device of major {NVIDIA_MAJOR}"),
        |p| p.display().to_string(),
    );
    let pids = pids();
    let who = if pids.is_empty() {
        "a dumped process (pid not found)".to_string()
    } else {
        let list: Vec<String> = pids.iter().map(i32::to_string).collect();
        format!("pid {}", list.join(", pid "))
    };
    Verdict::RefuseNvidia(format!(
        "{LOG_PREFIX} refusing {what} of NVIDIA device {name} in {who}: NVIDIA mappings are not \
         handled yet (TODO issue 15: dump inherited mappings of a process without a CUDA context \
         as inaccessible reservations, checkpoint CUDA processes with possum)"
    ))
}

/// The processes this process traces (CRIU seizes the tree it dumps with ptrace) that map or
/// have open `path`. Best effort, for the refusal message only.
pub fn traced_pids_using(path: &Path) -> Vec<i32> {
    let me = std::process::id().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<i32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let proc = PathBuf::from(format!("/proc/{pid}"));
            let traced = std::fs::read_to_string(proc.join("status")).is_ok_and(|s| {
                s.lines()
                    .any(|l| l.strip_prefix("TracerPid:").map(str::trim) == Some(me.as_str()))
            });
            traced && uses(&proc, path)
        })
        .collect();
    pids.sort_unstable();
    pids
}

fn uses(proc: &Path, path: &Path) -> bool {
    let Some(p) = path.to_str() else {
        return false;
    };
    let mapped = std::fs::read_to_string(proc.join("maps"))
        .is_ok_and(|m| m.lines().any(|l| l.split_whitespace().nth(5) == Some(p)));
    mapped
        || std::fs::read_dir(proc.join("fd")).is_ok_and(|fds| {
            fds.filter_map(Result::ok)
                .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == path))
        })
}

/// The name of CRIU's plugin stage (`CR_PLUGIN_STAGE__*`).
pub fn stage_name(stage: i32) -> &'static str {
    match stage {
        ffi::CR_PLUGIN_STAGE_DUMP => "dump",
        ffi::CR_PLUGIN_STAGE_PRE_DUMP => "pre-dump",
        ffi::CR_PLUGIN_STAGE_RESTORE => "restore",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvidia_devices_are_recognised_by_path_or_major() {
        for p in [
            "/dev/nvidia0",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
            "/dev/nvidia-caps/nvidia-cap1",
        ] {
            assert!(is_nvidia(Some(Path::new(p)), None), "{p}");
        }
        assert!(is_nvidia(Some(Path::new("/dev/whatever")), Some(195)));
        for p in [
            "/dev/zero",
            "/dev/dri/renderD128",
            "/dev/kfd",
            "/tmp/nvidia0",
        ] {
            assert!(!is_nvidia(Some(Path::new(p)), Some(1)), "{p}");
        }
        assert!(!is_nvidia(None, None));
    }

    #[test]
    fn other_files_are_not_mine_and_nvidia_is_refused_naming_pid_and_device() {
        let v = verdict(
            "a mapping",
            Some(Path::new("/dev/dri/card0")),
            Some(226),
            || panic!("pids are looked up only for a refusal"),
        );
        assert_eq!(v, Verdict::NotMine);
        let Verdict::RefuseNvidia(msg) = verdict(
            "a mapping",
            Some(Path::new("/dev/nvidia-uvm")),
            Some(511),
            || vec![42, 43],
        ) else {
            panic!("not refused");
        };
        assert!(msg.starts_with(LOG_PREFIX), "{msg}");
        assert!(msg.contains("/dev/nvidia-uvm"), "{msg}");
        assert!(msg.contains("pid 42, pid 43"), "{msg}");
        assert!(msg.contains("TODO"), "{msg}");
    }

    #[test]
    fn hooks_say_not_mine_for_a_regular_char_device() {
        let null = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(ffi::handle_device_vma_for_test(&null), -libc::ENOTSUP);
        assert_eq!(ffi::dump_ext_file_for_test(&null), -libc::ENOTSUP);
    }
}
