//! The image directory of a process checkpoint: `possum.json` ([`Manifest`]), CRIU's images and
//! possum's GPU images; what it records of the GPUs the job used (from nvidia-smi), and the
//! checks a restore makes of them.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::gpu_runtimes::GpuRuntime;
use crate::Engine;

/// The image's own description, `DIR/possum.json`.
pub const MANIFEST: &str = "possum.json";
/// Where [`MANIFEST`] is written before it is renamed into place.
const MANIFEST_TMP: &str = ".possum.json.tmp";
/// Format version of `possum.json`.
pub const MANIFEST_VERSION: u32 = 1;

/// `DIR/possum.json`.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct Manifest {
    /// [`MANIFEST_VERSION`].
    pub possum_image: u32,
    pub engine: Engine,
    /// The GPU runtime the job ran on: `hip` for a HIP job (no NVIDIA driver took part, and a
    /// restore calls none); absent for CUDA, as in images written before HIP jobs were
    /// checkpointed. A reader that does not know the field drops it, and then finds the image's
    /// `check` wrong: it refuses the image rather than restore it as CUDA's.
    #[serde(default, skip_serializing_if = "GpuRuntime::is_cuda")]
    pub runtime: GpuRuntime,
    pub pid: i32,
    pub shell_job: bool,
    pub socket_dir: PathBuf,
    /// Seconds since the epoch.
    pub created: u64,
    /// Subdirectories: CRIU's images (none for a `--gpu-only` image), and possum's GPU images
    /// (engine possum).
    pub criu_dir: Option<String>,
    pub gpu_dir: Option<String>,
    /// The GPU memory the job used when checkpointed, per GPU (from nvidia-smi; empty when it
    /// could not be asked): a restore refuses a GPU with less free memory.
    #[serde(default)]
    pub gpu_memory: Vec<GpuUse>,
    /// The other CUDA processes of the job's tree (descendants of `pid`), checkpointed by the
    /// driver with it: a restore restores and unlocks each after CRIU's restore.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cuda_children: Vec<i32>,
    /// Those of `cuda_children` with possum loaded: their buffers were saved and released by
    /// possum like the root's, each into `gpu-PID/`; a restore resumes each from it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub possum_children: Vec<i32>,
    /// The directories the tree's unix sockets were bound in: a restore creates those missing
    /// (CRIU binds the sockets there again).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub socket_dirs: Vec<PathBuf>,
    /// The root's standard descriptors that were pipes to a process outside the tree: (fd,
    /// `pipe:[INODE]`). A restore gives the job its own descriptor of that number instead.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stdio_pipes: Vec<(i32, String)>,
    /// The keeper the job's buffer memory came from (its `POSSUM_KEEPER`), and the job's
    /// `CUDA_VISIBLE_DEVICES`: a restore starts a keeper there if none answers, seeing the
    /// devices the job sees, so that the restored job keeps its memory in one again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keeper: Option<KeeperOfJob>,
    /// The buffers' memory left on the GPU with the keeper for this image's restore (a job
    /// killed with `--keep-on-gpu`): per process and device, the epoch it is kept under. A
    /// restore onto another GPU copies that memory there only while it is still this
    /// checkpoint's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<HeldMemory>,
    /// The user and group the job ran as (effective ids): a restore makes the job's missing
    /// socket directories theirs. None in images of older versions (then they are made as
    /// the restoring user's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<JobOwner>,
    /// The tree's established TCP connections were dumped (`--tcp-established`), the network
    /// locked this way: a restore restores them, locking it the same way. None when they were
    /// not (a tree holding one could not be dumped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_established: Option<NetworkLock>,
    /// The checkpoint's figures.
    pub figures: Value,
    /// CRC32C (hex) of the rest of the description, serialized compactly ([`manifest_text`]):
    /// a change that leaves valid JSON is caught too. Every image possum writes has it; a
    /// restore refuses a description without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<String>,
}

/// How CRIU keeps packets away from the established TCP connections it dumps and restores
/// ([`Manifest::tcp_established`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkLock {
    /// No lock: the connections are put in TCP repair mode, which keeps them from sending;
    /// nothing stops a peer outside the tree from sending to them. Enough for connections
    /// between the tree's own processes (both ends are frozen and dumped together), and
    /// needs nothing installed.
    #[default]
    Skip,
    /// iptables rules drop the connections' packets (the iptables programs must be installed).
    Iptables,
    /// An nftables table drops them (the kernel must have nf_tables).
    Nftables,
}

impl From<NetworkLock> for possum_criu::NetworkLockMethod {
    fn from(l: NetworkLock) -> Self {
        match l {
            NetworkLock::Skip => possum_criu::NetworkLockMethod::Skip,
            NetworkLock::Iptables => possum_criu::NetworkLockMethod::Iptables,
            NetworkLock::Nftables => possum_criu::NetworkLockMethod::Nftables,
        }
    }
}

/// Whom a job ran as ([`Manifest::owner`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobOwner {
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

impl JobOwner {
    /// Process `pid`'s effective ids (`/proc/PID/status`), `None` if they cannot be read.
    pub fn of_process(pid: i32) -> Option<JobOwner> {
        let status = possum_control::proc_text(format!("/proc/{pid}/status")).ok()?;
        let effective = |key: &str| {
            (status.lines())
                .find_map(|l| l.strip_prefix(key))
                .and_then(|ids| ids.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        };
        Some(JobOwner {
            uid: effective("Uid:")?,
            gid: effective("Gid:")?,
        })
    }
}

/// Memory a keeper holds for a restore ([`Manifest::held`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldMemory {
    /// The process.
    pub pid: i32,
    /// Its device ordinal (its image `gpu-N`).
    pub device: usize,
    /// The epoch the keeper holds it under.
    pub epoch: u64,
}

impl HeldMemory {
    /// The entries of a job's `release` reply (`held_epochs`) for process `pid`.
    pub fn from_release(pid: i32, reply: &possum_control::reply::ReleaseReply) -> Vec<HeldMemory> {
        (reply.held_epochs.iter())
            .map(|h| HeldMemory {
                pid,
                device: h.device,
                epoch: h.epoch,
            })
            .collect()
    }
}

/// Where a job's keeper was ([`Manifest::keeper`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeeperOfJob {
    /// Its socket directory.
    pub dir: PathBuf,
    /// The job's `CUDA_VISIBLE_DEVICES`, if set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_visible_devices: Option<String>,
}

impl KeeperOfJob {
    /// Starts a keeper (`exe keeper`, `exe` the possum executable) in its directory for the job
    /// `pid` (ending when the job does), seeing the devices the job sees, and returns it once it
    /// listens ([`crate::process::start_keeper`]).
    pub fn start_keeper(&self, exe: &Path, pid: i32) -> Result<std::process::Child> {
        crate::process::start_keeper(exe, &self.dir, pid, |cmd| {
            match &self.cuda_visible_devices {
                Some(v) => cmd.env("CUDA_VISIBLE_DEVICES", v),
                None => cmd.env_remove("CUDA_VISIBLE_DEVICES"),
            };
        })
    }

    /// A keeper for the restore of job `pid` in its directory: `None` if one answers there
    /// already, else one started ([`Self::start_keeper`]), again if its process took a PID of
    /// `avoid` (PIDs CRIU is about to restore).
    pub fn ensure_keeper(
        &self,
        exe: &Path,
        pid: i32,
        avoid: &[i32],
    ) -> Result<Option<std::process::Child>> {
        if possum_keeper::Keeper::connect(&possum_keeper::socket_of(&self.dir, 0)).is_ok() {
            return Ok(None);
        }
        let mut child = self.start_keeper(exe, pid)?;
        if avoid.contains(&(child.id() as i32)) {
            let _ = child.kill();
            let _ = child.wait();
            child = self.start_keeper(exe, pid)?;
        }
        Ok(Some(child))
    }
}

/// The check of `m` ([`Manifest::check`] ignored).
fn manifest_check(m: &Manifest) -> serde_json::Result<String> {
    let bare = Manifest {
        check: None,
        ..m.clone()
    };
    Ok(format!(
        "{:08x}",
        crc32c::crc32c(serde_json::to_string(&bare)?.as_bytes())
    ))
}

/// `possum.json`'s text for `m`, with its check.
pub fn manifest_text(m: &Manifest) -> serde_json::Result<String> {
    let checked = Manifest {
        check: Some(manifest_check(m)?),
        ..m.clone()
    };
    serde_json::to_string_pretty(&checked)
}

/// The largest `possum.json` read (its lists are bounded far below this).
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;
/// At most this many processes in each list of a job's tree.
pub const MAX_PROCESSES: usize = 4096;
/// At most this many GPUs.
pub const MAX_GPUS: usize = 64;
/// At most this many directories of the tree's sockets.
pub const MAX_SOCKET_DIRS: usize = 1024;
/// At most this many MiB of GPU memory per GPU (1 PiB).
pub const MAX_GPU_MIB: u64 = 1 << 30;
/// The longest string field (a GPU UUID, `CUDA_VISIBLE_DEVICES`, a pipe's name).
pub const MAX_TEXT: usize = 4096;

/// What in a `possum.json` a restore must not act on ([`Manifest::validate`]).
#[derive(Debug, thiserror::Error)]
pub enum InvalidManifest {
    /// A path inside the image that is absolute.
    #[error("{field} is {value:?}: a path inside the image must be relative")]
    Absolute {
        /// The field.
        field: String,
        /// Its value.
        value: String,
    },
    /// A path inside the image with `..` (or `.`, or empty).
    #[error("{field} is {value:?}: a path inside the image is plain names, without `..` or `.`")]
    NotPlain {
        /// The field.
        field: String,
        /// Its value.
        value: String,
    },
    /// A path inside the image that resolves (through a symbolic link) to somewhere else.
    #[error("{field} ({}) leads outside the image, to {}", path.display(), resolved.display())]
    Outside {
        /// The field.
        field: String,
        /// The path in the image.
        path: PathBuf,
        /// Where it leads.
        resolved: PathBuf,
    },
    /// A host path (a socket or keeper directory) that is relative or not normalized.
    #[error("{field} is {}: a directory of the host must be an absolute path without `..` or `.`", value.display())]
    HostPath {
        /// The field.
        field: String,
        /// Its value.
        value: PathBuf,
    },
    /// A PID that names no single ordinary process (≤ 1: a group, init, every process).
    #[error("{field} is {pid}: a process of a job has a PID greater than 1")]
    Pid {
        /// The field.
        field: String,
        /// Its value.
        pid: i32,
    },
    /// possum's own PID or its parent's.
    #[error("{field} is {pid}: that is this possum process or its parent")]
    OwnPid {
        /// The field.
        field: String,
        /// Its value.
        pid: i32,
    },
    /// A list longer than any job has.
    #[error("{field} has {n} entries: at most {max}")]
    TooMany {
        /// The field.
        field: &'static str,
        /// Its length.
        n: usize,
        /// The bound.
        max: usize,
    },
    /// A number or string larger than any possum writes.
    #[error("{field} is too large ({value}; at most {max})")]
    TooLarge {
        /// The field.
        field: String,
        /// Its value (a string's length).
        value: u64,
        /// The bound.
        max: u64,
    },
    /// A standard descriptor that is not one.
    #[error("stdio_pipes names descriptor {0}: only the standard descriptors 0, 1 and 2 are")]
    NotStdio(i32),
    /// NVIDIA's driver state in the image of a job that had no NVIDIA driver.
    #[error(
        "{field} is set, but the image is of a HIP job (runtime hip), which NVIDIA's driver had \
         no part in"
    )]
    DriverStateOfHip {
        /// The field.
        field: &'static str,
    },
}

impl Manifest {
    /// The job's GPU memory at its checkpoint, all its GPUs together (nvidia-smi's count, as
    /// `gpu_memory` records it; 0 when nvidia-smi said nothing), saturating.
    pub fn gpu_memory_bytes(&self) -> u64 {
        gpu_memory_bytes(&self.gpu_memory)
    }

    /// Checks everything a restore acts on before it acts on any of it: the paths inside the
    /// image (`criu_dir`, `gpu_dir`, each `gpu-PID/` of `possum_children`, the `gpu-N/` images
    /// in them) are plain relative names that stay inside `dir` once symbolic links are
    /// resolved; the host directories (`socket_dir`, `socket_dirs`, `keeper.dir`) are absolute
    /// and normalized (where a restore may act in them is its own rule); every PID is > 1 and
    /// neither possum's nor its parent's; lists, sizes and strings are bounded.
    pub fn validate(&self, dir: &Path) -> Result<(), InvalidManifest> {
        self.validate_bounds()?;
        self.validate_runtime()?;
        let me = std::process::id() as i32;
        let parent = nix::unistd::getppid().as_raw();
        let pids = std::iter::once(("pid".to_string(), self.pid))
            .chain(
                self.cuda_children
                    .iter()
                    .map(|&p| ("cuda_children".into(), p)),
            )
            .chain(
                self.possum_children
                    .iter()
                    .map(|&p| ("possum_children".into(), p)),
            )
            .chain(self.held.iter().map(|h| ("held.pid".into(), h.pid)));
        for (field, pid) in pids {
            if pid <= 1 {
                return Err(InvalidManifest::Pid { field, pid });
            }
            if pid == me || pid == parent {
                return Err(InvalidManifest::OwnPid { field, pid });
            }
        }
        // `socket_dir` may be relative (as `--socket-dir` was given): it is used for nothing
        // destructive unless it is one of possum's socket directories.
        if !is_host_path(&self.socket_dir) && !is_plain_relative(&self.socket_dir) {
            return Err(InvalidManifest::HostPath {
                field: "socket_dir".into(),
                value: self.socket_dir.clone(),
            });
        }
        let host = (self.socket_dirs.iter().map(|d| ("socket_dirs", d)))
            .chain(self.keeper.iter().map(|k| ("keeper.dir", &k.dir)));
        for (field, d) in host {
            if !is_host_path(d) {
                return Err(InvalidManifest::HostPath {
                    field: field.into(),
                    value: d.clone(),
                });
            }
        }
        let root = dir.canonicalize().map_err(|_| InvalidManifest::Outside {
            field: "the image directory".into(),
            path: dir.to_path_buf(),
            resolved: PathBuf::new(),
        })?;
        let mut gpu_dirs = Vec::new();
        if let Some(c) = &self.criu_dir {
            inside(&root, dir, "criu_dir", c)?;
        }
        if let Some(g) = &self.gpu_dir {
            gpu_dirs.push(("gpu_dir".to_string(), inside(&root, dir, "gpu_dir", g)?));
        }
        for &c in &self.possum_children {
            let field = format!("possum_children ({})", child_gpu_dir(c));
            gpu_dirs.push((
                field.clone(),
                inside(&root, dir, &field, &child_gpu_dir(c))?,
            ));
        }
        // Each device's image in them too (the engine then opens only plain names in it).
        for (field, g) in gpu_dirs {
            let Ok(rd) = fs::read_dir(&g) else { continue };
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                inside(&root, &g, &format!("{field}/{name}"), &name)?;
            }
        }
        Ok(())
    }

    /// A HIP job's image names nothing of NVIDIA's driver: no CUDA processes for it to restore,
    /// no GPU memory counted by nvidia-smi.
    fn validate_runtime(&self) -> Result<(), InvalidManifest> {
        if self.runtime.has_nvidia_driver() {
            return Ok(());
        }
        let driver_state = [
            ("cuda_children", self.cuda_children.is_empty()),
            ("gpu_memory", self.gpu_memory.is_empty()),
        ];
        match driver_state.into_iter().find(|(_, empty)| !empty) {
            Some((field, _)) => Err(InvalidManifest::DriverStateOfHip { field }),
            None => Ok(()),
        }
    }

    /// The bounds on lists, numbers and strings.
    fn validate_bounds(&self) -> Result<(), InvalidManifest> {
        let lists = [
            ("cuda_children", self.cuda_children.len(), MAX_PROCESSES),
            ("possum_children", self.possum_children.len(), MAX_PROCESSES),
            ("gpu_memory", self.gpu_memory.len(), MAX_GPUS),
            ("held", self.held.len(), MAX_PROCESSES * MAX_GPUS),
            ("socket_dirs", self.socket_dirs.len(), MAX_SOCKET_DIRS),
            ("stdio_pipes", self.stdio_pipes.len(), 3),
        ];
        for (field, n, max) in lists {
            if n > max {
                return Err(InvalidManifest::TooMany { field, n, max });
            }
        }
        let too_large = |field: &str, value: u64, max: u64| {
            (value > max).then(|| InvalidManifest::TooLarge {
                field: field.to_string(),
                value,
                max,
            })
        };
        let text = |field: &str, t: &str| too_large(field, t.len() as u64, MAX_TEXT as u64);
        for g in &self.gpu_memory {
            if let Some(e) = too_large("gpu_memory.mib", g.mib, MAX_GPU_MIB)
                .or_else(|| text("gpu_memory.uuid", &g.uuid))
            {
                return Err(e);
            }
        }
        for h in &self.held {
            if let Some(e) = too_large("held.device", h.device as u64, MAX_GPUS as u64 - 1) {
                return Err(e);
            }
        }
        for (fd, key) in &self.stdio_pipes {
            if !(0..=2).contains(fd) {
                return Err(InvalidManifest::NotStdio(*fd));
            }
            if let Some(e) = text("stdio_pipes", key) {
                return Err(e);
            }
        }
        let strings = (self.keeper.iter())
            .filter_map(|k| k.cuda_visible_devices.as_deref())
            .map(|v| ("keeper.cuda_visible_devices", v))
            .chain(self.criu_dir.as_deref().map(|c| ("criu_dir", c)))
            .chain(self.gpu_dir.as_deref().map(|g| ("gpu_dir", g)));
        for (field, v) in strings {
            if let Some(e) = text(field, v) {
                return Err(e);
            }
        }
        let paths = std::iter::once(&self.socket_dir)
            .chain(&self.socket_dirs)
            .chain(self.keeper.iter().map(|k| &k.dir));
        for p in paths {
            if let Some(e) = too_large("a directory", p.as_os_str().len() as u64, MAX_TEXT as u64) {
                return Err(e);
            }
        }
        Ok(())
    }
}

/// Whether `p` is absolute and normalized: `/` and plain names, no `..` or `.`.
fn is_host_path(p: &Path) -> bool {
    use std::path::Component;
    let mut c = p.components();
    c.next() == Some(Component::RootDir) && c.all(|c| matches!(c, Component::Normal(_)))
}

/// Whether `p` is plain names (no `/` at the start, no `..` or `.`).
fn is_plain_relative(p: &Path) -> bool {
    use std::path::Component;
    p.components().next().is_some() && p.components().all(|c| matches!(c, Component::Normal(_)))
}

/// `dir/value` for the image's field `field`: `value` plain relative names, and (if it exists)
/// resolving inside `root` (the image directory, resolved).
fn inside(root: &Path, dir: &Path, field: &str, value: &str) -> Result<PathBuf, InvalidManifest> {
    use std::path::Component;
    let rel = Path::new(value);
    if rel.is_absolute() {
        return Err(InvalidManifest::Absolute {
            field: field.into(),
            value: value.into(),
        });
    }
    if value.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(InvalidManifest::NotPlain {
            field: field.into(),
            value: value.into(),
        });
    }
    let path = dir.join(rel);
    if fs::symlink_metadata(&path).is_err() {
        // Nothing there: what needs it says it is missing.
        return Ok(path);
    }
    match path.canonicalize() {
        Ok(resolved) if resolved.starts_with(root) => Ok(path),
        resolved => Err(InvalidManifest::Outside {
            field: field.into(),
            resolved: resolved
                .or_else(|_| fs::read_link(&path))
                .unwrap_or_default(),
            path,
        }),
    }
}

/// Why a bounded read failed.
enum Bounded {
    Io(std::io::Error),
    Large(u64),
}

/// The bytes of `path`, refused past [`MAX_MANIFEST_BYTES`] (before anything is allocated for
/// them).
fn read_bounded(path: &Path) -> Result<Vec<u8>, Bounded> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    // Non-blocking: a FIFO in its place must not hang the restore.
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(Bounded::Io)?;
    if !f.metadata().map_err(Bounded::Io)?.is_file() {
        return Err(Bounded::Io(std::io::Error::other("not a regular file")));
    }
    let mut bytes = Vec::new();
    f.take(MAX_MANIFEST_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(Bounded::Io)?;
    if bytes.len() as u64 > MAX_MANIFEST_BYTES {
        let len = fs::metadata(path).map_or(bytes.len() as u64, |m| m.len());
        return Err(Bounded::Large(len));
    }
    Ok(bytes)
}

/// GPU memory used by a process on one GPU.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct GpuUse {
    /// The GPU's UUID, as nvidia-smi prints it (`GPU-...`).
    pub uuid: String,
    /// MiB.
    pub mib: u64,
}

/// The socket in keeper directory `dir` serving device `device` of a job that used the GPUs
/// `gpus` (`possum.json`'s `gpu_memory`), on the GPU it ran on: for a single-GPU job the one
/// serving that GPU's UUID (a job moved by an earlier `--device` restore keeps an ordinal the
/// keeper numbers otherwise), else `keeper-<device>.sock`.
pub(crate) fn keeper_socket(gpus: &[GpuUse], dir: &Path, device: usize) -> PathBuf {
    let by_uuid = match gpus {
        [one] => uuid_bytes(&one.uuid)
            .ok()
            .and_then(|u| possum_keeper::keeper_for_device(dir, &possum_keeper::uuid_hex(&u))),
        _ => None,
    };
    by_uuid.unwrap_or_else(|| possum_keeper::socket_of(dir, device))
}

/// The GPU memory of `uses`, all the GPUs together, in bytes (saturating).
pub fn gpu_memory_bytes(uses: &[GpuUse]) -> u64 {
    (uses.iter()).fold(0u64, |a, g| a.saturating_add(g.mib.saturating_mul(1 << 20)))
}

/// What nvidia-smi (`bin`: [`Environment::nvidia_smi`](crate::Environment::nvidia_smi)) says
/// about GPU memory.
pub mod smi {
    use super::GpuUse;
    use std::process::{Command, Output, Stdio};
    use std::time::Duration;

    /// How long nvidia-smi may take to answer (it can hang on a GPU in a bad state): then it
    /// is killed and taken as not answering.
    pub const TIMEOUT: Duration = Duration::from_secs(30);

    /// `bin args`' output, if it ends within `limit` (else it is killed: `None`).
    pub(crate) fn output_within(bin: &str, args: &[&str], limit: Duration) -> Option<Output> {
        let child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).ok()?);
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        std::thread::spawn(move || {
            let _ = tx.send(child.wait_with_output());
        });
        match rx.recv_timeout(limit) {
            Ok(out) => out.ok(),
            Err(_) => {
                // Not reaped yet (its thread reaps it once it ends): the PID is still its own.
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
                None
            }
        }
    }

    fn query(bin: &str, args: &[&str]) -> Option<Vec<Vec<String>>> {
        let out = output_within(bin, args, TIMEOUT)?;
        if !out.status.success() {
            return None;
        }
        Some(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| l.split(',').map(|f| f.trim().to_string()).collect())
                .collect(),
        )
    }

    /// The memory `pid` uses on each GPU; None when nvidia-smi cannot be asked.
    pub fn process_usage(bin: &str, pid: i32) -> Option<Vec<GpuUse>> {
        let rows = query(
            bin,
            &[
                "--query-compute-apps=pid,gpu_uuid,used_memory",
                "--format=csv,noheader,nounits",
            ],
        )?;
        Some(
            rows.iter()
                .filter(|r| r.len() >= 3 && r[0] == pid.to_string())
                .filter_map(|r| {
                    Some(GpuUse {
                        uuid: r[1].clone(),
                        mib: r[2].parse().ok()?,
                    })
                })
                .collect(),
        )
    }

    /// The GPUs here: (index, UUID, free MiB); None when nvidia-smi cannot be asked.
    pub fn gpus(bin: &str) -> Option<Vec<(u32, String, u64)>> {
        let rows = query(
            bin,
            &[
                "--query-gpu=index,uuid,memory.free",
                "--format=csv,noheader,nounits",
            ],
        )?;
        Some(
            rows.iter()
                .filter(|r| r.len() >= 3)
                .filter_map(|r| Some((r[0].parse().ok()?, r[1].clone(), r[2].parse().ok()?)))
                .collect(),
        )
    }
}

/// The driver's GPU remapping for a restore: (the UUID the job saw, the GPU's it gets).
pub type UuidPairs = Vec<([u8; 16], [u8; 16])>;

/// Why the GPUs cannot take the restored job ([`plan_gpus`]).
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// `--device` for an image that does not record the job's GPU.
    #[error(
        "the image does not record which GPU the job used (nvidia-smi was not available when it \
         was checkpointed): --device cannot be honoured"
    )]
    NotRecorded,
    /// `--device` without nvidia-smi.
    #[error("--device needs nvidia-smi, which cannot be asked here")]
    NoSmi,
    /// Too little free memory for the job's own memory and more.
    #[error(
        "GPU {uuid} has too little memory: {free} MiB free, the job needs {} MiB there ({own} MiB \
         of its own, {extra} MiB of {what})",
        own + extra
    )]
    TooLittleFor {
        /// The GPU.
        uuid: String,
        /// Its free MiB.
        free: u64,
        /// The job's own MiB.
        own: u64,
        /// MiB more.
        extra: u64,
        /// Of what.
        what: &'static str,
    },
    /// Too little free memory for what the job used.
    #[error("GPU {uuid} has too little memory: {free} MiB free, the job used {own} MiB")]
    TooLittle {
        /// The GPU.
        uuid: String,
        /// Its free MiB.
        free: u64,
        /// The job's MiB.
        own: u64,
    },
    /// The job's GPU is elsewhere.
    #[error("the GPU the job ran on ({uuid}) is not on this machine: choose one with --device")]
    NotHere {
        /// The GPU.
        uuid: String,
    },
    /// `--device` for a job of several GPUs.
    #[error("the job used {0} GPUs; --device moves a job that used one")]
    SeveralGpus(usize),
    /// `--device` names no GPU here.
    #[error("there is no GPU {0} here")]
    NoSuchGpu(u32),
    /// nvidia-smi's answer holds something that is not a GPU UUID.
    #[error(transparent)]
    Uuid(#[from] NotAUuid),
}

/// A string that is not a GPU UUID.
#[derive(Debug, thiserror::Error)]
#[error("not a GPU UUID: {0}")]
pub struct NotAUuid(pub String);

/// The 16 bytes of a GPU UUID as nvidia-smi prints it (`GPU-8a9c1d2e-...`).
pub(crate) fn uuid_bytes(s: &str) -> Result<[u8; 16], NotAUuid> {
    let hex: String = s
        .trim_start_matches("GPU-")
        .chars()
        .filter(|c| *c != '-')
        .collect();
    let mut out = [0u8; 16];
    if hex.len() != 32 || !hex.is_ascii() {
        return Err(NotAUuid(s.to_string()));
    }
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| NotAUuid(s.to_string()))?;
    }
    Ok(out)
}

/// The buffers of a job whose memory was its keeper's, for the room checks of a restore.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KeptBuffers {
    /// Their MiB (0 for a job without a keeper: nvidia-smi counted them as the job's).
    pub mib: u64,
    /// The keeper still holds them (mapped again on the job's own GPU, nothing made).
    pub held: bool,
}

/// Checks the GPUs the restore will use (the job's own, or `--device`) for free memory, and
/// returns the driver's UUID remapping (empty: the same GPUs). `kept`: the job's buffers that
/// another process (its keeper) held, which nvidia-smi did not count as the job's: a move to
/// another GPU needs room for them there too, and so does a single-GPU job's own GPU unless the
/// keeper still holds them. `gpus`: nvidia-smi's answer ([`smi::gpus`]), asked only if needed.
pub(crate) fn plan_gpus(
    m: &Manifest,
    device: Option<u32>,
    kept: KeptBuffers,
    gpus: impl FnOnce() -> Option<Vec<(u32, String, u64)>>,
    obs: &mut dyn crate::Observer,
) -> Result<UuidPairs, GpuError> {
    if m.gpu_memory.is_empty() {
        if device.is_some() {
            return Err(GpuError::NotRecorded);
        }
        return Ok(Vec::new());
    }
    let Some(gpus) = gpus() else {
        if device.is_some() {
            return Err(GpuError::NoSmi);
        }
        obs.note("nvidia-smi cannot be asked: free GPU memory not checked");
        return Ok(Vec::new());
    };
    // Room on GPU `uuid` for the job's own `own` MiB and `extra` MiB more (`what`).
    let room = |uuid: &str, free: u64, own: u64, extra: u64, what: &'static str| {
        let uuid = uuid.to_string();
        if extra > 0 && free < own + extra {
            return Err(GpuError::TooLittleFor {
                uuid,
                free,
                own,
                extra,
                what,
            });
        }
        if free < own {
            return Err(GpuError::TooLittle { uuid, free, own });
        }
        Ok(())
    };
    // On its own GPU, a single-GPU job's buffers that its keeper no longer holds are made again
    // there (nvidia-smi counted them as the keeper's, not in the job's MiB).
    let again = if m.gpu_memory.len() == 1 && !kept.held {
        kept.mib
    } else {
        0
    };
    let own_gpu = |uuid: &str, free: u64, used: u64| {
        room(
            uuid,
            free,
            used,
            again,
            "buffers its keeper no longer holds, made again",
        )
    };
    let Some(d) = device else {
        for u in &m.gpu_memory {
            let Some((_, _, free)) = gpus.iter().find(|(_, id, _)| *id == u.uuid) else {
                let uuid = u.uuid.clone();
                return Err(GpuError::NotHere { uuid });
            };
            own_gpu(&u.uuid, *free, u.mib)?;
        }
        return Ok(Vec::new());
    };
    let [used] = m.gpu_memory.as_slice() else {
        return Err(GpuError::SeveralGpus(m.gpu_memory.len()));
    };
    let Some((_, target, free)) = gpus.iter().find(|(i, _, _)| *i == d) else {
        return Err(GpuError::NoSuchGpu(d));
    };
    if *target == used.uuid {
        own_gpu(target, *free, used.mib)?;
        return Ok(Vec::new());
    }
    room(target, *free, used.mib, kept.mib, "buffers its keeper held")?;
    // NVIDIA's restore wants every GPU the process saw mapped (one pair per GPU; a single pair on
    // a two-GPU machine is CUDA_ERROR_INVALID_VALUE, measured on 2 H200s): the job's GPU and the
    // target swap places, every other GPU of this machine maps to itself. A GPU the image names
    // that is not here (another machine) maps to the target alone.
    let mut pairs = vec![(uuid_bytes(&used.uuid)?, uuid_bytes(target)?)];
    if gpus.iter().any(|(_, id, _)| *id == used.uuid) {
        pairs.push((uuid_bytes(target)?, uuid_bytes(&used.uuid)?));
        for (_, id, _) in gpus
            .iter()
            .filter(|(_, id, _)| *id != used.uuid && id != target)
        {
            pairs.push((uuid_bytes(id)?, uuid_bytes(id)?));
        }
    }
    Ok(pairs)
}

/// Whether `path` exists as anything but an empty directory.
pub(crate) fn occupied(path: &Path) -> bool {
    match fs::read_dir(path) {
        Ok(mut d) => d.next().is_some(),
        Err(e) => e.kind() != std::io::ErrorKind::NotFound,
    }
}

/// The bytes the files under `path` hold: each file's length, or what it occupies when that is
/// less (a data file's holes before chunks aligned to 2 MiB are not image bytes; a small file on
/// a huge-page tmpfs occupies a whole 2 MiB page, but holds only its length).
pub fn dir_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = fs::read_dir(path) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e
                .metadata()
                .map(|m| m.len().min(m.blocks().saturating_mul(512)))
                .unwrap_or(0),
            Err(_) => 0,
        })
        .sum()
}

/// Writes `text` as `dir/possum.json`, the image's commit marker, atomically: into a temporary
/// file of `dir`, fsynced, renamed over `possum.json`, `dir` fsynced. A reader finds the old
/// marker or the new one, whole, never a part.
pub(crate) fn write_marker(dir: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = dir.join(MANIFEST_TMP);
    let mut f = fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    drop(f);
    fs::rename(&tmp, dir.join(MANIFEST))?;
    fs::File::open(dir)?.sync_all()
}

/// fsyncs every file and directory under `dir`.
pub(crate) fn sync_tree(dir: &Path) -> Result<()> {
    for e in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e?;
        if e.file_type()?.is_dir() {
            sync_tree(&e.path())?;
        } else {
            fs::File::open(e.path())?.sync_all()?;
        }
    }
    fs::File::open(dir)?.sync_all()?;
    Ok(())
}

/// A checked image directory: its description and where its parts are.
#[derive(Debug)]
pub struct Image {
    /// The image directory.
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// CRIU's images.
    pub criu: PathBuf,
    /// possum's GPU images (engine possum).
    pub gpu: Option<PathBuf>,
}

/// What is wrong with an image directory ([`open_image`]).
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The directory does not exist.
    #[error("there is no image at {}: the directory does not exist", dir.display())]
    NoDirectory {
        /// The directory.
        dir: PathBuf,
    },
    /// It has no `possum.json`, the commit marker a checkpoint writes last (a checkpoint that
    /// did not finish, or not an image).
    #[error(
        "incomplete image: the checkpoint did not finish ({} has no {MANIFEST}, which a \
         checkpoint writes last, once everything else is written)",
        dir.display()
    )]
    NoManifest {
        /// The directory.
        dir: PathBuf,
    },
    /// `possum.json` could not be read.
    #[error("reading {}", path.display())]
    ManifestIo {
        /// `DIR/possum.json`.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `possum.json` is not a possum image's description.
    #[error("{} is corrupt: not a possum image's description", path.display())]
    Unreadable {
        /// `DIR/possum.json`.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// `possum.json` is larger than any possum writes.
    #[error("{} is corrupt: {len} bytes (a possum image's description is at most {MAX_MANIFEST_BYTES})", path.display())]
    TooLarge {
        /// `DIR/possum.json`.
        path: PathBuf,
        /// Its length.
        len: u64,
    },
    /// `possum.json` has no check: it cannot be told from an edited one.
    #[error(
        "{} has no check (`check`): every image possum writes has one, so this description is \
         corrupt, edited or not possum's, and is refused",
        path.display()
    )]
    NoCheck {
        /// `DIR/possum.json`.
        path: PathBuf,
    },
    /// `possum.json` names something a restore must not act on.
    #[error("{} is refused: {why}", path.display())]
    Invalid {
        /// `DIR/possum.json`.
        path: PathBuf,
        /// What is wrong.
        why: InvalidManifest,
    },
    /// `possum.json` was changed after it was written.
    #[error(
        "{} is corrupt: its content does not match its check (changed after it was written)",
        path.display()
    )]
    CheckMismatch {
        /// `DIR/possum.json`.
        path: PathBuf,
    },
    /// Another format version.
    #[error("{}: image format {version} (this possum reads {MANIFEST_VERSION})", path.display())]
    Version {
        /// `DIR/possum.json`.
        path: PathBuf,
        /// The image's version.
        version: u32,
    },
    /// A migration's image received here and not yet synced: its files may be incomplete
    /// had the host stopped meanwhile.
    #[error(
        "{} was received from a migration and never synced to disk (it still holds {}): had this \
         host stopped before `possum receive` synced it, its files may be incomplete, so it is \
         refused; if the host did not stop, remove that file and restore it again",
        dir.display(),
        crate::wire::UNSYNCED
    )]
    Unsynced {
        /// The directory.
        dir: PathBuf,
    },
    /// A migration's image received by post-copy whose pieces left for later did not all come.
    #[error(
        "{} was received from a migration by post-copy, and pieces of its GPU images never came \
         (it still holds {}): it is incomplete and refused; the source kept the complete image",
        dir.display(),
        crate::wire::POST_COPY
    )]
    PostCopy {
        /// The directory.
        dir: PathBuf,
    },
    /// A `--gpu-only` image.
    #[error(
        "{} holds only GPU buffers (written with --gpu-only): there is no process to restore",
        dir.display()
    )]
    GpuOnly {
        /// The directory.
        dir: PathBuf,
    },
    /// CRIU's part is missing.
    #[error("{}: CRIU's images are missing or partial (no inventory.img)", criu.display())]
    CriuPartial {
        /// CRIU's images.
        criu: PathBuf,
    },
    /// possum's GPU images are missing.
    #[error("{}: no GPU image", gpu.display())]
    NoGpuImage {
        /// The GPU images' directory.
        gpu: PathBuf,
    },
    /// A GPU image does not open.
    #[error(transparent)]
    GpuImage(anyhow::Error),
}

/// Reads and checks `DIR/possum.json` and what it names: its format version, its check (which
/// it must have) and [`Manifest::validate`], before anything it names is used. A migration's
/// image not synced yet ([`crate::wire::UNSYNCED`]), or whose post-copy did not end
/// ([`crate::wire::POST_COPY`]), is refused.
pub fn open_image(dir: &Path) -> Result<Image, ImageError> {
    if fs::symlink_metadata(dir.join(crate::wire::POST_COPY)).is_ok() {
        return Err(ImageError::PostCopy {
            dir: dir.to_path_buf(),
        });
    }
    if fs::symlink_metadata(dir.join(crate::wire::UNSYNCED)).is_ok() {
        return Err(ImageError::Unsynced {
            dir: dir.to_path_buf(),
        });
    }
    open_received_image(dir)
}

/// [`open_image`] of an image a migration received and is restoring now, before it syncs it.
pub(crate) fn open_received_image(dir: &Path) -> Result<Image, ImageError> {
    if !dir.exists() {
        return Err(ImageError::NoDirectory {
            dir: dir.to_path_buf(),
        });
    }
    let path = dir.join(MANIFEST);
    let bytes = read_bounded(&path).map_err(|e| match e {
        Bounded::Io(e) if e.kind() == std::io::ErrorKind::NotFound => ImageError::NoManifest {
            dir: dir.to_path_buf(),
        },
        Bounded::Io(source) => ImageError::ManifestIo {
            path: path.clone(),
            source,
        },
        Bounded::Large(len) => ImageError::TooLarge {
            path: path.clone(),
            len,
        },
    })?;
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|source| ImageError::Unreadable {
        path: path.clone(),
        source,
    })?;
    if m.possum_image != MANIFEST_VERSION {
        return Err(ImageError::Version {
            path,
            version: m.possum_image,
        });
    }
    let Some(check) = &m.check else {
        return Err(ImageError::NoCheck { path });
    };
    let unreadable = |source| ImageError::Unreadable {
        path: path.clone(),
        source,
    };
    if *check != manifest_check(&m).map_err(unreadable)? {
        return Err(ImageError::CheckMismatch { path });
    }
    let Some(criu_dir) = &m.criu_dir else {
        return Err(ImageError::GpuOnly {
            dir: dir.to_path_buf(),
        });
    };
    if let Err(why) = m.validate(dir) {
        return Err(ImageError::Invalid { path, why });
    }
    let criu = dir.join(criu_dir);
    if !criu.join("inventory.img").is_file() {
        return Err(ImageError::CriuPartial { criu });
    }
    let gpu = m.gpu_dir.as_ref().map(|g| dir.join(g));
    if let Some(gpu) = &gpu {
        // The root's may be empty only in a tree with other possum processes: the root is then
        // a launcher that holds no buffer itself (torchrun's agent).
        if check_gpu_images(gpu).map_err(ImageError::GpuImage)? == 0 && m.possum_children.is_empty()
        {
            return Err(ImageError::NoGpuImage { gpu: gpu.clone() });
        }
    }
    // A child's may be empty: a process that had no buffer yet.
    for &c in &m.possum_children {
        check_gpu_images(&dir.join(child_gpu_dir(c))).map_err(ImageError::GpuImage)?;
    }
    Ok(Image {
        dir: dir.to_path_buf(),
        manifest: m,
        criu,
        gpu,
    })
}

impl Image {
    /// Its engine images: (pid, device ordinal, directory), for the job's root (`gpu/gpu-N`)
    /// and each of its possum processes (`gpu-PID/gpu-N`), sorted.
    pub fn gpu_images(&self) -> Vec<(i32, usize, PathBuf)> {
        let Some(gpu) = &self.gpu else {
            return Vec::new();
        };
        let roots = std::iter::once((self.manifest.pid, gpu.clone())).chain(
            self.manifest
                .possum_children
                .iter()
                .map(|&c| (c, self.dir.join(child_gpu_dir(c)))),
        );
        let mut out = Vec::new();
        for (pid, root) in roots {
            let Ok(entries) = fs::read_dir(&root) else {
                continue;
            };
            for e in entries.flatten() {
                let name = e.file_name();
                let Some(n) = name
                    .to_str()
                    .and_then(|n| n.strip_prefix("gpu-"))
                    .and_then(|n| n.parse::<usize>().ok())
                else {
                    continue;
                };
                out.push((pid, n, e.path()));
            }
        }
        out.sort();
        out
    }

    /// The bytes of the buffers in its engine images (every process's), in MiB rounded up.
    pub fn buffer_mib(&self) -> Result<u64> {
        use possum_engine::store::ChunkSource;
        let mut bytes = 0u64;
        for (_, _, path) in self.gpu_images() {
            let img = possum_engine::image::Image::open(&path)?;
            bytes += img.buffers().iter().map(|b| b.size).sum::<u64>();
        }
        Ok(bytes.div_ceil(1 << 20))
    }
}

/// The directory of child `pid`'s GPU images in an image directory.
pub fn child_gpu_dir(pid: i32) -> String {
    format!("gpu-{pid}")
}

/// Opens every engine image under `gpu` (one per device): how many there are.
fn check_gpu_images(gpu: &Path) -> Result<usize> {
    let mut n = 0;
    for e in fs::read_dir(gpu).with_context(|| format!("{}: GPU images missing", gpu.display()))? {
        let e = e?;
        possum_engine::image::Image::open(&e.path())
            .with_context(|| format!("GPU image {}", e.path().display()))?;
        n += 1;
    }
    Ok(n)
}

#[cfg(test)]
mod tests;
