//! `libpossum_criu_plugin.so`: possum's plugin for CRIU 4.x.
//!
//! A live CUDA process is checkpointed by the plugin itself at `PAUSE_DEVICES` and brought back
//! after the dump or at restore ([`live`]), so plain `criu dump|restore --libdir` (a container
//! engine) checkpoints a GPU job. Below, the other half.
//!
//! Jobs are process trees: a DataLoader worker forked from a CUDA process inherits its NVIDIA
//! device mappings (`/dev/nvidia*`, `/dev/nvidiactl`, `/dev/nvidia-uvm`) and open descriptors of
//! those devices, without having a CUDA context of its own, and CRIU cannot dump a
//! character-device mapping or descriptor that no plugin claims (`handle_device_vma plugin
//! failed`, `Can't handle non-regular mapping`). This plugin claims them:
//!
//! - `PAUSE_DEVICES` (once per process, before CRIU freezes it): the process's NVIDIA mappings
//!   and descriptors are listed from `/proc`; a process with none is not the plugin's business
//!   ("not mine", `-ENOTSUP`). One with some is asked about: if the NVIDIA driver says it has no
//!   CUDA context (`cuCheckpointProcessGetState` fails for it, through possum-cuda's
//!   `DriverCheckpoint`), its mappings and descriptors will be claimed; a running CUDA context is
//!   checkpointed ([`live`]); otherwise (a context another checkpoint holds, no libcuda, no
//!   answer, a private mapping) the dump is refused with one line naming the pid and the devices.
//! - `HANDLE_DEVICE_VMA` / `DUMP_EXT_FILE`: the NVIDIA mappings and descriptors of the processes
//!   accepted at pause time are claimed, one log line each, and noted in the plugin's own file in
//!   the images ([`record`]). CRIU dumps no contents of a shared device mapping.
//! - `UPDATE_VMA_MAP` / `RESTORE_EXT_FILE` (restore, in the restored process): each claimed
//!   mapping is mapped, at its address with its protection, from an empty sealed memfd (offset 0)
//!   that the plugin hands to CRIU, so touching it raises `SIGBUS`; each claimed descriptor
//!   becomes a descriptor of such a memfd, named `possum-placeholder:/dev/...`.
//!
//! Anything else gets "not mine" (`-ENOTSUP`, what CRIU's `run_plugins` treats as "no plugin
//! handles it"), so CRIU behaves as without the plugin for processes without NVIDIA mappings.
//!
//! All `unsafe` (the C ABI, ptrace) is in [`ffi`]; the decisions are safe functions here.
#![deny(unsafe_code)]

pub mod config;
pub mod ffi;
pub mod live;
mod log;
pub mod maps;
pub mod record;
mod restore_thread;
mod stage;

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use maps::{MapEntry, Run};
use possum_control::EnvConfig;
use possum_cuda::checkpoint::{own_context, OwnContext, ProcessState};

/// The character-device major number registered to NVIDIA (`/dev/nvidia0..N`, `/dev/nvidiactl`;
/// Linux's `Documentation/admin-guide/devices.txt`). `nvidia-uvm` and `nvidia-caps` get dynamic
/// majors, so those are recognised by path.
pub const NVIDIA_MAJOR: u32 = 195;

/// Test only: a device path the plugin treats like an NVIDIA device, without asking the NVIDIA
/// driver about the process (a CPU machine has no NVIDIA device to test with).
pub use config::TEST_DEVICE_ENV;
pub use log::LOG_PREFIX;

/// The prefix of the name of every placeholder memfd (`/proc/PID/fd` shows
/// `/memfd:possum-placeholder:/dev/nvidiactl (deleted)`).
pub const PLACEHOLDER_PREFIX: &str = "possum-placeholder:";

/// Which of the plugin's devices a file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// An NVIDIA device node.
    Nvidia,
    /// The test stand-in named by [`TEST_DEVICE_ENV`].
    StandIn,
}

/// Recognises the devices the plugin claims.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Devices {
    /// The test stand-in ([`TEST_DEVICE_ENV`]), if any.
    pub stand_in: Option<PathBuf>,
}

impl Devices {
    /// NVIDIA devices, plus the stand-in named by [`TEST_DEVICE_ENV`] if set.
    pub fn from_env() -> Devices {
        Devices {
            stand_in: config::Config::from_env().test_device,
        }
    }

    /// What `path` (as `/proc` names it), a character device of major `char_device_major` when it
    /// is one, is to the plugin: `None` when it is not one of its devices.
    pub fn kind(&self, path: Option<&Path>, char_device_major: Option<u32>) -> Option<DeviceKind> {
        if path.is_some_and(is_nvidia_path) || char_device_major == Some(NVIDIA_MAJOR) {
            Some(DeviceKind::Nvidia)
        } else if path.is_some() && path == self.stand_in.as_deref() {
            Some(DeviceKind::StandIn)
        } else {
            None
        }
    }

    /// [`kind`](Self::kind) of a path from `/proc/PID/maps` or an image.
    pub fn kind_of(&self, path: &str) -> Option<DeviceKind> {
        self.kind(Some(Path::new(path)), None)
    }
}

/// Whether `path` names an NVIDIA device node (`/dev/nvidia0`, `/dev/nvidiactl`,
/// `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools`, `/dev/nvidia-caps/...`).
pub fn is_nvidia_path(path: &Path) -> bool {
    path.to_str().is_some_and(|s| s.starts_with("/dev/nvidia"))
}

/// Where the plugin looks for NVIDIA's driver library, in order: `$POSSUM_LIBCUDA` alone when
/// set; else `libcuda.so.1` (the loader's search), then `libcuda.so.1` in each directory of
/// `$LD_LIBRARY_PATH` and in the usual driver directories. The explicit paths matter when criu
/// runs through another loader (`scripts/install-criu.sh`'s wrapper passes `--library-path`,
/// which replaces `LD_LIBRARY_PATH` in the loader's search).
pub fn libcuda_candidates(
    possum_libcuda: Option<std::ffi::OsString>,
    ld_library_path: Option<std::ffi::OsString>,
) -> Vec<PathBuf> {
    if let Some(v) = possum_libcuda.filter(|v| !v.is_empty()) {
        return vec![PathBuf::from(v)];
    }
    let mut out = vec![PathBuf::from("libcuda.so.1")];
    let dirs = ld_library_path
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    for d in dirs.into_iter().chain(
        [
            "/usr/local/nvidia/lib64",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
        ]
        .map(PathBuf::from),
    ) {
        let c = d.join("libcuda.so.1");
        if d.is_absolute() && !out.contains(&c) {
            out.push(c);
        }
    }
    out
}

/// What the NVIDIA driver says about a process's CUDA context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaContext {
    /// It has none; why the plugin believes so.
    None(String),
    /// It has one, in this checkpoint state (`running`, `locked`, `checkpointed`, ...).
    Present(String),
    /// The plugin could not ask (no libcuda, `cuInit` failed, no answer in time).
    Unknown(String),
}

/// The driver's answers about a process as the plugin's [`CudaContext`] (possum-cuda's
/// [`own_context`], the one reading of them possum's CLI uses too).
pub fn interpret_driver(
    state: Result<ProcessState, i32>,
    restore_tid: Option<Result<i32, i32>>,
    thread_exists: impl FnOnce(i32) -> bool,
) -> CudaContext {
    CudaContext::from(own_context(state, restore_tid, thread_exists))
}

impl From<OwnContext> for CudaContext {
    fn from(c: OwnContext) -> CudaContext {
        match c {
            OwnContext::None(why) => CudaContext::None(why),
            OwnContext::Present(s) => CudaContext::Present(s.to_string()),
        }
    }
}

/// A process's mappings and open descriptors of the plugin's devices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// The process.
    pub pid: i32,
    /// Its mappings of the devices, grouped as CRIU asks about them.
    pub runs: Vec<Run>,
    /// The devices it has open (one entry per descriptor).
    pub files: Vec<PathBuf>,
}

impl Usage {
    /// Reads `/proc/PID/maps` and `/proc/PID/fd` (best effort: what cannot be read is not there).
    pub fn scan(pid: i32, devices: &Devices) -> Usage {
        let maps = u32::try_from(pid)
            .ok()
            .and_then(possum_control::read_maps)
            .unwrap_or_default();
        Usage::from_parts(pid, &maps::parse(&maps), maps::open_files(pid), devices)
    }

    /// The usage in `maps` (all the process's mappings) and `open` (its descriptors' targets).
    pub fn from_parts(pid: i32, maps: &[MapEntry], open: Vec<PathBuf>, devices: &Devices) -> Usage {
        Usage {
            pid,
            runs: maps::runs(maps, |p| devices.kind_of(p).is_some()),
            files: open
                .into_iter()
                .filter(|f| devices.kind(Some(f), None).is_some())
                .collect(),
        }
    }

    /// No mapping and no descriptor of the devices.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty() && self.files.is_empty()
    }

    /// Whether any of them is an NVIDIA device (not only the test stand-in).
    pub fn has_nvidia(&self, devices: &Devices) -> bool {
        self.runs
            .iter()
            .map(|r| r.path.as_str())
            .chain(self.files.iter().filter_map(|f| f.to_str()))
            .any(|p| devices.kind_of(p) == Some(DeviceKind::Nvidia))
    }

    /// `/dev/nvidia-uvm (3 mappings), /dev/nvidiactl (1 mapping, 2 descriptors)`.
    pub fn summary(&self) -> String {
        let mut per: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
        for r in &self.runs {
            per.entry(r.path.as_str()).or_default().0 += r.entries.len();
        }
        for f in &self.files {
            per.entry(f.to_str().unwrap_or("?")).or_default().1 += 1;
        }
        let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
        per.iter()
            .map(|(p, &(m, d))| {
                let parts: Vec<String> = [(m, "mapping"), (d, "descriptor")]
                    .iter()
                    .filter(|(n, _)| *n > 0)
                    .map(|&(n, w)| plural(n, w))
                    .collect();
                format!("{p} ({})", parts.join(", "))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The plugin's decision about a process at `PAUSE_DEVICES`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PauseDecision {
    /// No mapping or descriptor of the plugin's devices, and no CUDA context of its own to
    /// checkpoint.
    NotMine,
    /// Its device mappings and descriptors will be claimed; why that is safe.
    Claim(String),
    /// A running CUDA process: the plugin checkpoints it ([`live::checkpoint`]) before CRIU
    /// dumps it.
    Checkpoint,
    /// The dump must fail: the line to log.
    Refuse(String),
}

/// Decides about the process of `usage` in CRIU's `stage`. `possum_loaded`: the process has a
/// possum control socket (a CUDA process without NVIDIA device files exists only on the test
/// driver). `probe` asks the NVIDIA driver about its CUDA context; it is called only when the
/// process uses an NVIDIA device or has possum loaded.
pub fn decide_pause(
    usage: &Usage,
    devices: &Devices,
    possum_loaded: bool,
    stage: i32,
    probe: impl FnOnce() -> CudaContext,
) -> PauseDecision {
    if usage.is_empty() && !possum_loaded {
        return PauseDecision::NotMine;
    }
    let pid = usage.pid;
    if let Some((run, e)) = usage
        .runs
        .iter()
        .find_map(|r| r.entries.iter().find(|e| !e.shared()).map(|e| (r, e)))
    {
        return PauseDecision::Refuse(format!(
            "{LOG_PREFIX} refusing pid {pid}: its mapping {} of {} is private, and CRIU would \
             dump its pages; the plugin only handles shared device mappings",
            e.range(),
            run.path
        ));
    }
    if !usage.is_empty() && !usage.has_nvidia(devices) {
        return PauseDecision::Claim("the test stand-in device (no CUDA context check)".into());
    }
    let uses = if usage.is_empty() {
        "no NVIDIA device file".to_string()
    } else {
        usage.summary()
    };
    match probe() {
        CudaContext::None(_) if usage.is_empty() => PauseDecision::NotMine,
        CudaContext::None(why) => PauseDecision::Claim(format!("no CUDA context: {why}")),
        CudaContext::Present(state) if state == "running" => {
            if stage == ffi::CR_PLUGIN_STAGE_PRE_DUMP {
                PauseDecision::Refuse(format!(
                    "{LOG_PREFIX} refusing pid {pid}: it has a running CUDA context, and CRIU's \
                     pre-dump cannot include GPU state; dump it with `criu dump` (the plugin \
                     checkpoints its GPU state then)"
                ))
            } else {
                PauseDecision::Checkpoint
            }
        }
        // Checkpointed before CRIU was run (`possum checkpoint`, NVIDIA's cuda-checkpoint): its
        // GPU state is not in the process any more, and whoever did it brings it back.
        CudaContext::Present(state) if state == "checkpointed" && usage.is_empty() => {
            PauseDecision::NotMine
        }
        CudaContext::Present(state) => PauseDecision::Refuse(format!(
            "{LOG_PREFIX} refusing pid {pid}: its CUDA context is {state} in NVIDIA's driver \
             (another checkpoint holds it, or left it so) and it uses {uses}; let that \
             checkpoint finish (`possum status {pid}`), then dump again"
        )),
        CudaContext::Unknown(_) if usage.is_empty() => PauseDecision::NotMine,
        CudaContext::Unknown(why) => PauseDecision::Refuse(format!(
            "{LOG_PREFIX} refusing pid {pid}: it uses {uses}, and the plugin cannot tell whether \
             it has a CUDA context: {why}"
        )),
    }
}

/// What the plugin accepted at pause time about one process.
#[derive(Debug, Clone, Default)]
struct Accepted {
    runs: VecDeque<Run>,
    files: Vec<PathBuf>,
    why: String,
}

/// The answer to a claim of a mapping or descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Claimed: the lines to log and the records to write.
    Claimed {
        /// One line per mapping or descriptor.
        lines: Vec<String>,
        /// What to note in the images.
        records: Vec<record::Record>,
    },
    /// Refused: the line to log.
    Refused(String),
}

/// The plugin's state during one dump (CRIU dumps the processes of a tree one after another,
/// in one thread).
#[derive(Debug, Default)]
pub struct DumpState {
    accepted: BTreeMap<i32, Accepted>,
    /// Mappings claimed so far.
    pub vmas: usize,
    /// Descriptors claimed so far.
    pub files: usize,
}

impl DumpState {
    /// An empty state.
    pub const fn new() -> DumpState {
        DumpState {
            accepted: BTreeMap::new(),
            vmas: 0,
            files: 0,
        }
    }

    /// Notes the decision taken about `usage`'s process.
    pub fn paused(&mut self, usage: Usage, decision: &PauseDecision) {
        if let PauseDecision::Claim(why) = decision {
            self.accepted.insert(
                usage.pid,
                Accepted {
                    runs: usage.runs.into(),
                    files: usage.files,
                    why: why.clone(),
                },
            );
        }
    }

    /// CRIU asks about a mapping of the device `path` (one of the plugin's) in `pid`, when known.
    pub fn claim_vma(&mut self, path: &str, pid: Option<i32>) -> Claim {
        let pid = match pid {
            Some(p) => p,
            // Whoever was accepted with a run of this device not yet claimed.
            None => match self
                .accepted
                .iter()
                .find(|(_, a)| a.runs.iter().any(|r| r.path == path))
            {
                Some((&p, _)) => p,
                None => {
                    return Claim::Refused(format!(
                        "{LOG_PREFIX} refusing a mapping of {path}: its process was not assessed \
                         when CRIU paused the tree (PAUSE_DEVICES)"
                    ))
                }
            },
        };
        let Some(acc) = self.accepted.get_mut(&pid) else {
            return Claim::Refused(format!(
                "{LOG_PREFIX} refusing pid {pid}'s mapping of {path}: the process was not \
                 assessed when CRIU paused it (PAUSE_DEVICES), or was refused then"
            ));
        };
        // CRIU asks once per run, in address order: the next run of this device is this one.
        let run = loop {
            match acc.runs.pop_front() {
                Some(r) if r.path == path => break Some(r),
                Some(_) => continue,
                None => break None,
            }
        };
        let why = &acc.why;
        let Some(run) = run else {
            self.vmas += 1;
            return Claim::Claimed {
                lines: vec![format!(
                    "{LOG_PREFIX} pid {pid}: claimed a mapping of {path} (range not seen at \
                     pause), restored as an inaccessible placeholder; {why}"
                )],
                records: Vec::new(),
            };
        };
        self.vmas += run.entries.len();
        let lines = run
            .entries
            .iter()
            .map(|e| {
                format!(
                    "{LOG_PREFIX} pid {pid}: claimed mapping {} of {path}, restored as an \
                     inaccessible placeholder; {why}",
                    e.range()
                )
            })
            .collect();
        let records = run
            .entries
            .iter()
            .map(|e| record::Record::Vma {
                pid,
                start: e.start,
                end: e.end,
                perms: e.perms.clone(),
                path: path.to_string(),
            })
            .collect();
        Claim::Claimed { lines, records }
    }

    /// CRIU asks about an open descriptor of the device `path` (one of the plugin's), which it
    /// numbers `id` in its images.
    pub fn claim_file(&mut self, path: &Path, id: u32) -> Claim {
        let pids: Vec<String> = self
            .accepted
            .iter()
            .filter(|(_, a)| a.files.iter().any(|f| f == path))
            .map(|(p, _)| p.to_string())
            .collect();
        let shown = path.display();
        if pids.is_empty() {
            return Claim::Refused(format!(
                "{LOG_PREFIX} refusing an open {shown} (id {id:#x}): no process holding it was \
                 accepted when CRIU paused the tree (PAUSE_DEVICES)"
            ));
        }
        let Some(path_str) = path.to_str() else {
            return Claim::Refused(format!(
                "{LOG_PREFIX} refusing an open {shown}: not a UTF-8 path"
            ));
        };
        self.files += 1;
        Claim::Claimed {
            lines: vec![format!(
                "{LOG_PREFIX} pid {}: claimed open file {shown} (id {id:#x}), restored as a \
                 placeholder memfd",
                pids.join(", pid ")
            )],
            records: vec![record::Record::File {
                id,
                path: path_str.to_string(),
            }],
        }
    }
}

/// The plugin's state in this process (CRIU's dump process, or a restored process).
pub static STATE: Mutex<DumpState> = Mutex::new(DumpState::new());

/// Whether a mapping of `path` met at restore (`UPDATE_VMA_MAP`) is one the plugin claimed:
/// one of its devices, or a mapping its records name.
pub fn restore_claims_vma(path: &str, devices: &Devices, records: &record::Records) -> bool {
    devices.kind_of(path).is_some() || records.has_vma_of(path)
}

/// The memfd name of a placeholder for `path` (memfd names are at most 249 bytes).
pub fn placeholder_name(path: &str) -> String {
    let mut name = format!("{PLACEHOLDER_PREFIX}{path}");
    if name.len() > 240 {
        let mut cut = 240;
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        name.truncate(cut);
    }
    name
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

    const DUMP: i32 = ffi::CR_PLUGIN_STAGE_DUMP;

    fn nv() -> Devices {
        Devices::default()
    }

    #[test]
    fn nvidia_devices_are_recognised_by_path_or_major() {
        let d = nv();
        for p in [
            "/dev/nvidia0",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
            "/dev/nvidia-caps/nvidia-cap1",
        ] {
            assert_eq!(d.kind(Some(Path::new(p)), None), Some(DeviceKind::Nvidia));
        }
        assert_eq!(
            d.kind(Some(Path::new("/dev/whatever")), Some(195)),
            Some(DeviceKind::Nvidia)
        );
        for p in [
            "/dev/zero",
            "/dev/dri/renderD128",
            "/dev/kfd",
            "/tmp/nvidia0",
        ] {
            assert_eq!(d.kind(Some(Path::new(p)), Some(1)), None, "{p}");
        }
        assert_eq!(d.kind(None, None), None);
        let t = Devices {
            stand_in: Some("/dev/hwrng".into()),
        };
        assert_eq!(t.kind_of("/dev/hwrng"), Some(DeviceKind::StandIn));
        assert_eq!(nv().kind_of("/dev/hwrng"), None);
    }

    fn worker_maps() -> Vec<MapEntry> {
        maps::parse(
            "\
200400000-200600000 rw-s 00000000 00:05 1032 /dev/nvidia-uvm
200600000-200800000 rw-s 00000000 00:05 1032 /dev/nvidia-uvm
7f0000000000-7f0000001000 rw-s 00000000 00:05 1030 /dev/nvidiactl
7f1000000000-7f1000021000 r-xp 00000000 fe:00 4242 /usr/lib/libc.so.6
",
        )
    }

    fn worker_usage() -> Usage {
        Usage::from_parts(
            42,
            &worker_maps(),
            vec![
                "/dev/null".into(),
                "/dev/nvidiactl".into(),
                "/dev/nvidia0".into(),
            ],
            &nv(),
        )
    }

    #[test]
    fn a_process_without_nvidia_use_is_not_mine_and_the_driver_is_not_asked() {
        let u = Usage::from_parts(
            7,
            &maps::parse("1000-2000 r-xp 00000000 fe:00 1 /usr/bin/python3\n"),
            vec!["/dev/null".into()],
            &nv(),
        );
        assert!(u.is_empty());
        let d = decide_pause(&u, &nv(), false, DUMP, || panic!("asked the driver"));
        assert_eq!(d, PauseDecision::NotMine);
        // With possum loaded (its socket), the driver is asked: a running context is
        // checkpointed, none or one already checkpointed is not the plugin's business.
        for (probe, want) in [
            (
                CudaContext::Present("running".into()),
                PauseDecision::Checkpoint,
            ),
            (
                CudaContext::Present("checkpointed".into()),
                PauseDecision::NotMine,
            ),
            (
                CudaContext::None("CUresult 3".into()),
                PauseDecision::NotMine,
            ),
            (
                CudaContext::Unknown("no libcuda".into()),
                PauseDecision::NotMine,
            ),
        ] {
            assert_eq!(decide_pause(&u, &nv(), true, DUMP, || probe), want);
        }
    }

    #[test]
    fn a_worker_without_a_cuda_context_is_claimed() {
        let u = worker_usage();
        assert_eq!(
            u.summary(),
            "/dev/nvidia-uvm (2 mappings), /dev/nvidia0 (1 descriptor), \
             /dev/nvidiactl (1 mapping, 1 descriptor)"
        );
        let d = decide_pause(&u, &nv(), false, DUMP, || {
            interpret_driver(Err(3), None, |_| unreachable!())
        });
        let PauseDecision::Claim(why) = d else {
            panic!("{d:?}")
        };
        assert!(why.contains("CUresult 3"), "{why}");
    }

    #[test]
    fn a_running_cuda_process_is_checkpointed_and_others_refused_naming_pid_and_devices() {
        let u = worker_usage();
        let d = decide_pause(&u, &nv(), false, DUMP, || {
            CudaContext::Present("running".into())
        });
        assert_eq!(d, PauseDecision::Checkpoint);
        for (probe, stage, want) in [
            (
                CudaContext::Present("running".into()),
                ffi::CR_PLUGIN_STAGE_PRE_DUMP,
                "pre-dump",
            ),
            (CudaContext::Present("locked".into()), DUMP, "is locked"),
            (
                CudaContext::Present("checkpointed".into()),
                DUMP,
                "is checkpointed",
            ),
            (
                CudaContext::Unknown("no libcuda.so.1".into()),
                DUMP,
                "no libcuda.so.1",
            ),
        ] {
            let PauseDecision::Refuse(msg) = decide_pause(&u, &nv(), true, stage, || probe) else {
                panic!("not refused: {want}")
            };
            assert!(msg.starts_with(LOG_PREFIX), "{msg}");
            assert!(msg.contains("pid 42"), "{msg}");
            assert!(msg.contains(want), "{msg}");
            if !msg.contains("pre-dump") {
                assert!(msg.contains("/dev/nvidia-uvm (2 mappings)"), "{msg}");
            }
        }
    }

    #[test]
    fn a_private_device_mapping_is_refused() {
        let m = maps::parse("200400000-200600000 rw-p 00000000 00:05 1032 /dev/nvidia-uvm\n");
        let u = Usage::from_parts(5, &m, Vec::new(), &nv());
        let PauseDecision::Refuse(msg) = decide_pause(&u, &nv(), false, DUMP, || unreachable!())
        else {
            panic!("not refused")
        };
        assert!(msg.contains("pid 5") && msg.contains("private"), "{msg}");
    }

    #[test]
    fn the_stand_in_alone_is_claimed_without_asking_the_driver() {
        let t = Devices {
            stand_in: Some("/dev/hwrng".into()),
        };
        let u = Usage::from_parts(9, &[], vec!["/dev/hwrng".into()], &t);
        assert!(!u.has_nvidia(&t));
        let d = decide_pause(&u, &t, false, DUMP, || panic!("asked the driver"));
        assert!(matches!(d, PauseDecision::Claim(_)), "{d:?}");
    }

    #[test]
    fn libcuda_is_looked_for_where_the_driver_puts_it() {
        assert_eq!(
            libcuda_candidates(Some("/x/libcuda.so".into()), Some("/a".into())),
            [PathBuf::from("/x/libcuda.so")]
        );
        let c = libcuda_candidates(Some("".into()), Some("/a:rel:/usr/lib64".into()));
        assert_eq!(c[0], PathBuf::from("libcuda.so.1"));
        assert_eq!(c[1], PathBuf::from("/a/libcuda.so.1"));
        assert_eq!(c[2], PathBuf::from("/usr/lib64/libcuda.so.1"));
        assert!(c.contains(&PathBuf::from("/usr/local/nvidia/lib64/libcuda.so.1")));
        assert_eq!(
            c.iter()
                .filter(|p| p.ends_with("lib64/libcuda.so.1"))
                .count(),
            2,
            "no duplicates: {c:?}"
        );
    }

    #[test]
    fn the_driver_answers_are_interpreted() {
        assert!(matches!(
            interpret_driver(Err(3), None, |_| true),
            CudaContext::None(_)
        ));
        assert_eq!(
            interpret_driver(Ok(ProcessState::Running), Some(Ok(77)), |t| t == 77),
            CudaContext::Present("running".into())
        );
        assert_eq!(
            interpret_driver(Ok(ProcessState::Checkpointed), None, |_| true),
            CudaContext::Present("checkpointed".into())
        );
        let CudaContext::None(why) =
            interpret_driver(Ok(ProcessState::Running), Some(Ok(77)), |_| false)
        else {
            panic!("a forked copy taken for a context")
        };
        assert!(why.contains("restore thread 77"), "{why}");
        assert_eq!(
            interpret_driver(Ok(ProcessState::Locked), Some(Err(3)), |_| false),
            CudaContext::Present("locked".into())
        );
    }

    #[test]
    fn claims_follow_the_runs_accepted_at_pause_and_refuse_the_rest() {
        let mut s = DumpState::new();
        let u = worker_usage();
        let d = PauseDecision::Claim("no CUDA context: test".into());
        s.paused(u, &d);
        // Refused processes are not accepted.
        s.paused(
            Usage::from_parts(43, &worker_maps(), Vec::new(), &nv()),
            &PauseDecision::Refuse("x".into()),
        );

        let Claim::Claimed { lines, records } = s.claim_vma("/dev/nvidia-uvm", Some(42)) else {
            panic!("not claimed")
        };
        assert_eq!(lines.len(), 2);
        assert!(lines[0].contains("pid 42"), "{}", lines[0]);
        assert!(
            lines[0].contains("0x200400000-0x200600000 rw-s"),
            "{}",
            lines[0]
        );
        assert!(lines[1].contains("0x200600000-0x200800000"), "{}", lines[1]);
        assert_eq!(records.len(), 2);
        // Without the pid: found by the device.
        let Claim::Claimed { lines, .. } = s.claim_vma("/dev/nvidiactl", None) else {
            panic!("not claimed")
        };
        assert!(lines[0].contains("pid 42") && lines[0].contains("0x7f0000000000"));
        assert_eq!(s.vmas, 3);
        // A run not seen at pause, in an accepted process: still claimed.
        assert!(matches!(
            s.claim_vma("/dev/nvidia-uvm", Some(42)),
            Claim::Claimed { .. }
        ));
        // Not accepted, or unknown.
        let Claim::Refused(msg) = s.claim_vma("/dev/nvidia-uvm", Some(43)) else {
            panic!("claimed for a refused process")
        };
        assert!(msg.contains("pid 43"), "{msg}");
        assert!(matches!(
            s.claim_vma("/dev/nvidia0", None),
            Claim::Refused(_)
        ));

        let Claim::Claimed { lines, records } = s.claim_file(Path::new("/dev/nvidiactl"), 0x1b)
        else {
            panic!("not claimed")
        };
        assert!(lines[0].contains("pid 42") && lines[0].contains("id 0x1b"));
        assert_eq!(
            records,
            [record::Record::File {
                id: 0x1b,
                path: "/dev/nvidiactl".into()
            }]
        );
        assert!(matches!(
            s.claim_file(Path::new("/dev/nvidia-uvm"), 3),
            Claim::Refused(_)
        ));
        assert_eq!(s.files, 1);
    }

    #[test]
    fn restore_recognises_its_mappings_and_names_placeholders() {
        let recs = record::Records::parse("vma 1 0x1000-0x2000 rw-s /dev/hwrng\n");
        assert!(restore_claims_vma("/dev/nvidia0", &nv(), &recs));
        assert!(restore_claims_vma("/dev/hwrng", &nv(), &recs));
        assert!(!restore_claims_vma(
            "/usr/lib/libc.so.6",
            &nv(),
            &record::Records::default()
        ));
        assert_eq!(
            placeholder_name("/dev/nvidiactl"),
            "possum-placeholder:/dev/nvidiactl"
        );
        assert_eq!(placeholder_name(&"x".repeat(400)).len(), 240);
    }
}
