//! CRIU driven over its RPC interface: possum's CPU side of a checkpoint.
//!
//! Each call starts one `criu swrk` worker (CRIU's RPC server on an inherited socket), sends it
//! one request built from the [`rpc`] messages, reads the answer and waits for the worker to
//! exit. There is no long-lived CRIU service and no `libcriu`.
//!
//! ```no_run
//! use possum_criu::{set_child_subreaper, wait_for_exit, Criu, Deadline, DumpOptions, RestoreOptions};
//! use std::time::Duration;
//! # fn main() -> Result<(), possum_criu::CriuError> {
//! let criu = Criu::locate()?;
//! let dump = criu.dump(&DumpOptions {
//!     leave_running: true,
//!     ..DumpOptions::new(1234, "/var/tmp/ckpt")
//! })?;
//! println!("dumped in {:?}, {} bytes", dump.time, dump.image_bytes);
//!
//! set_child_subreaper()?; // so that the restored tree becomes our child
//! let restored = criu.restore(&RestoreOptions {
//!     // 1 minute, plus 10 s per GiB of images (the default is `Deadline::RESTORE`).
//!     deadline: Deadline { base: Duration::from_secs(60), per_gib: Duration::from_secs(10) },
//!     ..RestoreOptions::new("/var/tmp/ckpt")
//! })?;
//! let exit = wait_for_exit(restored.pid, None)?;
//! # Ok(()) }
//! ```
//!
//! # Installing CRIU
//!
//! possum needs CRIU 4.x: Debian 12's criu 3.17 fails on recent kernels (6.18:
//! `vdso: Unexpected rt vDSO area bounds`). `scripts/install-criu.sh` (as root, non-interactive,
//! idempotent; CI runs it) downloads Debian 13's criu and the libraries it needs with a private
//! apt configuration, unpacks them into `/opt/possum-criu` (`--prefix` or `POSSUM_CRIU_PREFIX`
//! to change) and writes the wrapper `/opt/possum-criu/bin/criu`, which runs criu through the
//! prefix's own glibc loader when the host's glibc is older than 2.38, and with the prefix's
//! libraries on `LD_LIBRARY_PATH` otherwise. For a host without network (the GPU machine):
//! `install-criu.sh --download-only DIR` here, carry `DIR` and the script over, then
//! `install-criu.sh --from-debs DIR` there. The prefix is relocatable.
//!
//! [`Criu::locate`] looks for the binary in this order: the `POSSUM_CRIU` environment variable,
//! `/opt/possum-criu/bin/criu`, then `criu` on `PATH`.
//!
//! # Requirements and behaviour
//!
//! - Dump and restore need root (CAP_SYS_ADMIN and friends); `criu check` too.
//! - A process is dumped without `shell_job` only if it has no controlling terminal and leads
//!   its own session (e.g. it called `setsid`), with stdio on files, pipes or `/dev/null`.
//! - A restore needs the dumped PIDs to be free: wait for (and reap) the original first.
//! - `criu restore` logs `rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted`
//!   on the machines measured so far and succeeds anyway.
//! - The restored tree is detached from the worker; see [`set_child_subreaper`],
//!   [`RestoreOptions::restore_sibling`] and [`wait_for_exit`] to wait for it.
//! - Every request has a deadline ([`Deadline`]; [`DumpOptions::deadline`],
//!   [`RestoreOptions::deadline`]). Past it the worker and every task under it (for a restore,
//!   the tasks it has created and not handed over yet) are killed, and the call fails with
//!   [`CriuError::DeadlineExceeded`], naming the request, the deadline and the images. When this
//!   process dies during a restore, the worker is killed and so are the tasks it was restoring
//!   (CRIU does not kill them when it dies: a guard process between this one and the worker
//!   does), except with [`RestoreOptions::restore_sibling`], where the worker dies with its
//!   parent (`PR_SET_PDEATHSIG`) and the half-restored tasks are left behind. A dump is left to
//!   finish (CRIU stopped midway may leave the dumped tree stopped), until its deadline.
//! - The install script's wrapper is fine in swrk mode: it `exec`s, so the worker keeps its PID
//!   and inherited socket, and CRIU does not re-execute itself (`/proc/self/exe`, which is the
//!   loader when the wrapper runs criu through the Debian suite's `ld.so`) to dump or restore. The only
//!   program a dump was seen to run is `sh -c "iptables -n -w -L"` (a kernel feature probe).
//!
//! Host feature checks for `possum doctor` are in [`doctor`].
#![warn(missing_docs)]

pub mod config;
pub mod doctor;
pub mod dump;
mod error;
#[doc(hidden)]
pub mod fuzz;
mod guard;
pub mod hostmem;
pub mod images;
pub mod kdat;
mod mapped;
pub mod no_uring;
mod page_server;
mod process;
pub mod relay;
pub mod restore;
pub mod rpc;
pub mod stats;
mod swrk;

use std::fmt;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use possum_control::EnvConfig;

pub use error::CriuError;
pub use process::{
    release_memory_of_killed, set_child_subreaper, tree_resident_bytes, wait_for_exit, ProcessExit,
};

pub use rpc::NetworkLockMethod;
use rpc::{CriuOpts, CriuReq, CriuResp, ReqType};

pub use config::{CRIU_ENV, PLUGIN_DIR_ENV};

/// Where `scripts/install-criu.sh` puts its wrapper by default.
pub const DEFAULT_CRIU: &str = "/opt/possum-criu/bin/criu";

/// How many lines of CRIU's log an error carries.
const LOG_TAIL_LINES: usize = 25;

/// A CRIU binary to drive.
#[derive(Debug, Clone)]
pub struct Criu {
    binary: PathBuf,
    plugin_dir: Option<PathBuf>,
}

/// The file name of possum's CRIU plugin.
pub const PLUGIN_FILE: &str = "libpossum_criu_plugin.so";

/// The directory beside the running executable where possum looks for its CRIU plugin.
pub const PLUGIN_SUBDIR: &str = "criu-plugins";

/// The plugin directory CRIU is given: `env` (the value of [`PLUGIN_DIR_ENV`]) when set (none
/// when empty), else `<exe's directory>/criu-plugins` when `has_plugin` says it holds
/// [`PLUGIN_FILE`].
pub fn resolve_plugin_dir(
    env: Option<std::ffi::OsString>,
    exe: Option<&Path>,
    has_plugin: impl Fn(&Path) -> bool,
) -> Option<PathBuf> {
    if let Some(v) = env {
        return (!v.is_empty()).then(|| PathBuf::from(v));
    }
    let dir = exe?.parent()?.join(PLUGIN_SUBDIR);
    has_plugin(&dir.join(PLUGIN_FILE)).then_some(dir)
}

/// [`resolve_plugin_dir`] for this process; failing that, the plugin built beside the executable
/// (`cargo build` puts `libpossum_criu_plugin.so` next to `possum`, in a directory CRIU must not
/// load whole: libpossum.so is there too) copied into a directory of its own ([`stage_plugin`]).
pub fn default_plugin_dir() -> Option<PathBuf> {
    let env = config::Config::from_env()
        .plugin_dir
        .map(|d| d.map(PathBuf::into_os_string).unwrap_or_default());
    let exe = std::env::current_exe().ok();
    if let Some(dir) = resolve_plugin_dir(env.clone(), exe.as_deref(), |p| p.is_file()) {
        return Some(dir);
    }
    if env.is_some() {
        return None;
    }
    let beside = exe?.parent()?.join(PLUGIN_FILE);
    let own = std::env::temp_dir().join(format!("possum-criu-plugins-{}", nix::unistd::geteuid()));
    stage_plugin(&beside, &own).ok()
}

/// Copies the plugin `file` into `dir` (created, only the plugin in it), unless the copy there is
/// already of the same size and not older; returns `dir`.
pub fn stage_plugin(file: &Path, dir: &Path) -> std::io::Result<PathBuf> {
    let src = std::fs::metadata(file)?;
    if !src.is_file() {
        return Err(std::io::Error::other(format!(
            "{} is not a file",
            file.display()
        )));
    }
    std::fs::create_dir_all(dir)?;
    let dst = dir.join(PLUGIN_FILE);
    let fresh = std::fs::metadata(&dst).is_ok_and(|d| {
        d.len() == src.len() && matches!((d.modified(), src.modified()), (Ok(a), Ok(b)) if a >= b)
    });
    if !fresh {
        remove_stale_copies(dir);
        // Through a temporary name: a concurrent CRIU never loads a half-written plugin.
        let tmp = dir.join(format!(".{PLUGIN_FILE}.{}", std::process::id()));
        let copied = std::fs::copy(file, &tmp).and_then(|_| std::fs::rename(&tmp, &dst));
        if copied.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        copied?;
    }
    Ok(dir.to_path_buf())
}

/// Removes the temporary copies [`stage_plugin`] left in `dir` when the process making them
/// was killed mid-copy (their names end in the copier's pid; a live copier's is kept).
fn remove_stale_copies(dir: &Path) {
    let prefix = format!(".{PLUGIN_FILE}.");
    possum_control::remove_files_of_gone_processes(
        dir,
        |name| name.strip_prefix(&prefix)?.parse().ok(),
        |pid| !Path::new(&format!("/proc/{pid}")).exists(),
    );
}

/// How long a CRIU dump or restore may take before its worker (and whatever it started) is
/// killed: `base`, plus `per_gib` for each GiB of memory to move (a dump: the resident memory of
/// the tree; a restore: the size of the images).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    /// The time allowed whatever the size.
    pub base: Duration,
    /// The time allowed per GiB (2^30 bytes), prorated.
    pub per_gib: Duration,
}

impl Deadline {
    /// A dump's default: 2 minutes, plus 30 s per GiB of resident memory (CRIU writes its
    /// pages at several hundred MiB/s to local storage; this leaves room for a slow disk).
    pub const DUMP: Deadline = Deadline {
        base: Duration::from_secs(120),
        per_gib: Duration::from_secs(30),
    };
    /// A restore's default: 2 minutes, plus 30 s per GiB of images.
    pub const RESTORE: Deadline = Deadline {
        base: Duration::from_secs(120),
        per_gib: Duration::from_secs(30),
    };
    /// The deadline of the requests without images: [`Criu::version`], [`Criu::check`].
    pub const QUERY: Duration = Duration::from_secs(60);

    /// `limit`, whatever the size.
    pub const fn fixed(limit: Duration) -> Deadline {
        Deadline {
            base: limit,
            per_gib: Duration::ZERO,
        }
    }

    /// The time allowed for `bytes` of memory.
    pub fn for_bytes(&self, bytes: u64) -> Duration {
        let gib = bytes as f64 / (1u64 << 30) as f64;
        let extra =
            Duration::try_from_secs_f64(self.per_gib.as_secs_f64() * gib).unwrap_or(Duration::MAX);
        self.base.saturating_add(extra)
    }
}

/// CRIU's log verbosity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum LogLevel {
    /// Errors only.
    Error = 1,
    /// Errors and warnings.
    Warn = 2,
    /// Plus progress messages (a few hundred lines for a small process).
    #[default]
    Info = 3,
    /// Everything (large logs; slows big dumps down).
    Debug = 4,
}

/// What to dump and how.
#[derive(Debug, Clone)]
pub struct DumpOptions {
    /// The root of the process tree to dump.
    pub pid: i32,
    /// Where the images go (created if missing).
    pub images_dir: PathBuf,
    /// Let the tree run on after the dump (default: CRIU kills it).
    pub leave_running: bool,
    /// With `leave_running`: leave the tree stopped (SIGSTOP, sent to each process while CRIU
    /// still holds it frozen, at its `post-dump` notification), so that nothing it does after
    /// the dump happens: for a tree to be killed, or restored elsewhere, once the image is
    /// safe. SIGCONT lets it run on.
    pub leave_stopped: bool,
    /// The tree is a shell job: it shares the caller's session or has a controlling terminal.
    pub shell_job: bool,
    /// Dump established TCP connections.
    pub tcp_established: bool,
    /// Dump a listening TCP socket whose queue holds connections not yet accepted, leaving them
    /// out of the image (CRIU's `--skip-in-flight`; otherwise CRIU refuses the dump). A tree
    /// left running accepts them afterwards; a restored one has them no more.
    pub tcp_skip_in_flight: bool,
    /// How CRIU locks the network of those connections (`None`: CRIU's default, iptables
    /// unless it was built otherwise).
    pub network_lock: Option<NetworkLockMethod>,
    /// Allow connections to unix sockets outside the tree.
    pub ext_unix_sk: bool,
    /// Dump file locks.
    pub file_locks: bool,
    /// Allow open-but-unlinked files to be linked back to be dumped.
    pub link_remap: bool,
    /// Resources outside the tree, in `criu --external` syntax (e.g. `dev[MAJOR/MINOR]:name`).
    pub external: Vec<String>,
    /// How long CRIU waits for the tree to freeze (CRIU's default when `None`), whole seconds.
    pub freeze_timeout: Option<Duration>,
    /// The log file's name inside `images_dir` (no `/`).
    pub log_file: String,
    /// The log's verbosity.
    pub log_level: LogLevel,
    /// Who writes the pages of the tree's private anonymous memory into the images.
    pub pages: PagesBy,
    /// With [`PagesBy::Relay`]: where the files being written are told, for a reader of them
    /// during the dump (their sizes say nothing until it ends).
    pub relay_watch: Option<std::sync::Arc<relay::RelayWatch>>,
    /// How long the dump may take ([`Deadline::DUMP`] by default), scaled by the resident
    /// memory of the tree. Past it CRIU is killed; the tree is left as CRIU leaves it (it may
    /// have been stopped or have CRIU's parasite code in it: it may not run on).
    pub deadline: Deadline,
}

impl DumpOptions {
    /// Options to dump the tree rooted at `pid` into `images_dir`, everything else off.
    pub fn new(pid: i32, images_dir: impl Into<PathBuf>) -> Self {
        Self {
            pid,
            images_dir: images_dir.into(),
            leave_running: false,
            leave_stopped: false,
            shell_job: false,
            tcp_established: false,
            tcp_skip_in_flight: false,
            network_lock: None,
            ext_unix_sk: false,
            file_locks: false,
            link_remap: false,
            external: Vec::new(),
            freeze_timeout: None,
            log_file: "dump.log".into(),
            log_level: LogLevel::default(),
            pages: PagesBy::default(),
            relay_watch: None,
            deadline: Deadline::DUMP,
        }
    }
}

/// Who writes the pages of a dumped tree's private anonymous memory (heap, arenas, the driver's
/// checkpoint residue: nearly all of a PyTorch job's) into the images. The images are the same
/// either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PagesBy {
    /// CRIU, as it dumps, from one thread.
    #[default]
    Criu,
    /// CRIU into pipes at the pages files' names, which take references to the frozen tree's
    /// pages rather than copies; possum copies them into the files from several threads as
    /// CRIU goes on ([`relay`]), done by CRIU's `post-dump` notification. Where the images'
    /// filesystem cannot allocate ahead, CRIU writes them as with [`PagesBy::Criu`].
    Relay,
    /// possum, from several threads, after CRIU's `--lazy-pages` dump left them in the frozen
    /// tree ([`hostmem::lazy`]), at CRIU's `post-dump` notification. CRIU's page server then
    /// runs on a socket pair possum hands it (never a TCP port), closed at once. Measured no
    /// shorter in all: CRIU's lazy dump still moves every page into its pipes.
    Possum,
}

impl PagesBy {
    /// The fewest threads the relay copies on by default: with fewer, its copies compete with
    /// CRIU's own thread, and CRIU's write was measured shorter (2 cores).
    pub const RELAY_MIN_THREADS: usize = 4;

    /// possum's choice for a dump whose pages may be copied on `threads` threads: the relay
    /// with [`PagesBy::RELAY_MIN_THREADS`] or more, else CRIU's own write.
    pub fn for_threads(threads: usize) -> PagesBy {
        match threads >= PagesBy::RELAY_MIN_THREADS {
            true => PagesBy::Relay,
            false => PagesBy::Criu,
        }
    }
}

/// What to restore and how.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// The images to restore from.
    pub images_dir: PathBuf,
    /// The tree was dumped as a shell job.
    pub shell_job: bool,
    /// Restore established TCP connections.
    pub tcp_established: bool,
    /// Restore the image's established TCP connections closed instead (CRIU's `--tcp-close`):
    /// each such socket comes back unconnected and shut down, and its peer, which is not told,
    /// gets a reset at its next packet. For connections that cannot come back (their address
    /// is not this host's, or their peer has moved on).
    pub tcp_close: bool,
    /// How CRIU locks the network of those connections: the dump's method (`None`: CRIU's
    /// default).
    pub network_lock: Option<NetworkLockMethod>,
    /// Allow connections to unix sockets outside the tree.
    pub ext_unix_sk: bool,
    /// Restore file locks.
    pub file_locks: bool,
    /// Create the restored root as a sibling of the criu worker, i.e. as a child of this process
    /// (CRIU's `rst_sibling`), so it can be waited for without [`set_child_subreaper`].
    pub restore_sibling: bool,
    /// Resources outside the tree, in `criu --external` syntax.
    pub external: Vec<String>,
    /// The log file's name inside `images_dir` (no `/`).
    pub log_file: String,
    /// The log's verbosity.
    pub log_level: LogLevel,
    /// Files of the image replaced by descriptors of this process (CRIU's `--inherit-fd`): (the
    /// image's name for it, e.g. `pipe:[12345]`, a descriptor here). The worker inherits each
    /// for the restore; they stay this process's.
    pub inherit_fds: Vec<(String, std::os::fd::RawFd)>,
    /// How long the restore may take ([`Deadline::RESTORE`] by default), scaled by the size of
    /// the images. Past it CRIU and the tasks it has restored are killed.
    pub deadline: Deadline,
}

impl RestoreOptions {
    /// Options to restore from `images_dir`, everything else off.
    pub fn new(images_dir: impl Into<PathBuf>) -> Self {
        Self {
            images_dir: images_dir.into(),
            shell_job: false,
            tcp_established: false,
            tcp_close: false,
            network_lock: None,
            ext_unix_sk: false,
            file_locks: false,
            restore_sibling: false,
            external: Vec::new(),
            log_file: "restore.log".into(),
            log_level: LogLevel::default(),
            inherit_fds: Vec::new(),
            deadline: Deadline::RESTORE,
        }
    }
}

/// The outcome of a dump.
#[derive(Debug, Clone)]
pub struct DumpReport {
    /// The images directory.
    pub images_dir: PathBuf,
    /// CRIU's log of the dump.
    pub log: PathBuf,
    /// Wall time of the whole call: starting the worker, the dump, the worker's exit.
    pub time: Duration,
    /// Total size of the files in `images_dir` after the dump.
    pub image_bytes: u64,
    /// The tree was left stopped ([`DumpOptions::leave_stopped`]).
    pub stopped: bool,
    /// CRIU's own account of the dump (`None` when it left none or it could not be read).
    pub stats: Option<stats::DumpStats>,
    /// possum's read of the pages, with [`PagesBy::Possum`].
    pub pages_read: Option<hostmem::lazy::LazyReport>,
    /// possum's copy of the pages CRIU wrote into its pipes, with [`PagesBy::Relay`].
    pub pages_relayed: Option<relay::RelayReport>,
    /// When CRIU's `post-dump` notification came, from the call's start (the tree frozen and
    /// its images written, but for the pages possum reads then): where the notification was
    /// asked for ([`DumpOptions::leave_stopped`], [`PagesBy::Possum`], [`PagesBy::Relay`]).
    pub post_dump_at: Option<Duration>,
}

/// The outcome of a restore.
#[derive(Debug, Clone)]
pub struct RestoreReport {
    /// The PID of the restored tree's root (the PID it had when dumped).
    pub pid: i32,
    /// CRIU's log of the restore.
    pub log: PathBuf,
    /// Wall time from the request (from the worker's start unless it was made ready,
    /// [`restore::PreparedRestore`]): the restore, the worker's exit.
    pub time: Duration,
    /// CRIU's own account of the restore (`None` when it left none or it could not be read).
    pub stats: Option<stats::RestoreStats>,
}

/// CRIU's version, as its `VERSION` request answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CriuVersion {
    /// Major version (4 in 4.1.1).
    pub major: i32,
    /// Minor version.
    pub minor: i32,
    /// Sublevel, when the build has one.
    pub sublevel: Option<i32>,
    /// Extra version number, when the build has one.
    pub extra: Option<i32>,
    /// The git commit it was built from, when known.
    pub gitid: Option<String>,
    /// The release's name, when known.
    pub name: Option<String>,
}

#[cfg(test)]
impl CriuVersion {
    /// `major.minor.sublevel`, nothing else known: the tests' versions.
    pub(crate) fn plain(major: i32, minor: i32, sublevel: i32) -> CriuVersion {
        CriuVersion {
            major,
            minor,
            sublevel: Some(sublevel),
            extra: None,
            gitid: None,
            name: None,
        }
    }
}

impl fmt::Display for CriuVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)?;
        if let Some(s) = self.sublevel {
            write!(f, ".{s}")?;
        }
        if let Some(e) = self.extra {
            write!(f, ".{e}")?;
        }
        if let Some(g) = &self.gitid {
            write!(f, " ({g})")?;
        }
        Ok(())
    }
}

impl Criu {
    /// Finds the CRIU binary: `$POSSUM_CRIU` (which must then be executable), then
    /// [`DEFAULT_CRIU`], then `criu` on `PATH`.
    pub fn locate() -> Result<Self, CriuError> {
        if let Some(path) = config::Config::from_env().criu {
            return if is_executable(&path) {
                Ok(Self::with_binary(path))
            } else {
                Err(CriuError::BadBinary { path })
            };
        }
        let mut searched = vec![PathBuf::from(DEFAULT_CRIU)];
        if is_executable(Path::new(DEFAULT_CRIU)) {
            return Ok(Self::with_binary(DEFAULT_CRIU));
        }
        for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
            let candidate = dir.join("criu");
            if is_executable(&candidate) {
                return Ok(Self::with_binary(candidate));
            }
            searched.push(candidate);
        }
        Err(CriuError::NotFound { searched })
    }

    /// Makes sure this CRIU finds its cache of the kernel's features at each run
    /// ([`kdat::prime`]: where `/run` is not a tmpfs, CRIU does not keep one, and probes the
    /// kernel at every dump and restore).
    pub fn prime_kdat(&self) -> Result<kdat::Primed, kdat::KdatError> {
        kdat::prime(&self.binary)
    }

    /// Uses `binary` (the wrapper or criu itself) without checking it, with the plugin directory
    /// of [`default_plugin_dir`].
    pub fn with_binary(binary: impl Into<PathBuf>) -> Self {
        Self {
            binary: binary.into(),
            plugin_dir: default_plugin_dir(),
        }
    }

    /// Uses `dir` as CRIU's plugin directory (`None`: CRIU's own default).
    #[must_use]
    pub fn with_plugin_dir(mut self, dir: Option<PathBuf>) -> Self {
        self.plugin_dir = dir;
        self
    }

    /// The directory of plugins CRIU loads for every request (CRIU loads every `*.so` in it):
    /// `$POSSUM_CRIU_PLUGIN_DIR` (none if empty), else `criu-plugins/` beside the running
    /// executable if it holds `libpossum_criu_plugin.so`, else none (CRIU then loads
    /// `$CRIU_LIBS_DIR`, else `/usr/lib/criu/`). CRIU's RPC has no `libdir` option, so the
    /// worker gets it as `CRIU_LIBS_DIR`, which CRIU reads when no `libdir` is set.
    pub fn plugin_dir(&self) -> Option<&Path> {
        self.plugin_dir.as_deref()
    }

    /// Whether CRIU gets possum's plugin ([`PLUGIN_FILE`] in [`Criu::plugin_dir`]): only it
    /// restores images [`hostmem::split`] split.
    pub fn has_possum_plugin(&self) -> bool {
        self.plugin_dir()
            .is_some_and(|d| d.join(PLUGIN_FILE).is_file())
    }

    /// The binary run for each request.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// Asks CRIU its version.
    pub fn version(&self) -> Result<CriuVersion, CriuError> {
        let resp = self.call("version", request(ReqType::Version, None), None, None)?;
        let v = resp.version.ok_or_else(|| CriuError::Protocol {
            op: "version",
            detail: "no version in the answer".into(),
        })?;
        Ok(CriuVersion {
            major: v.major_number,
            minor: v.minor_number,
            sublevel: v.sublevel,
            extra: v.extra,
            gitid: v.gitid,
            name: v.name,
        })
    }

    /// Runs `criu check`: whether the kernel has what CRIU needs for dump and restore. Needs
    /// root. On failure the error carries the end of CRIU's log, which is kept in a directory
    /// under the temporary directory (removed on success).
    pub fn check(&self) -> Result<(), CriuError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "possum-criu-check.{}.{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let images = open_images_dir(&dir, true)?;
        let opts = CriuOpts {
            images_dir_fd: images.as_raw_fd(),
            log_file: Some("check.log".into()),
            log_level: Some(LogLevel::Info as i32),
            ..Default::default()
        };
        let log = dir.join("check.log");
        self.call(
            "check",
            request(ReqType::Check, Some(opts)),
            Some(&log),
            None,
        )?;
        drop(images);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// One request on a fresh worker: spawn, ask, wait for the worker's exit, check the answer,
    /// all within [`Deadline::QUERY`].
    fn call(
        &self,
        op: &'static str,
        req: CriuReq,
        log: Option<&Path>,
        images_dir: Option<&Path>,
    ) -> Result<CriuResp, CriuError> {
        let scope = Scope {
            limit: Deadline::QUERY,
            images_dir,
            adopted: &[],
            on_notify: None,
        };
        let deadline = Instant::now() + scope.limit;
        let worker = self.spawn_worker(op, &[], swrk::OnOwnerDeath::KilledAtOnce)?;
        Self::answer(worker, op, req, log, deadline, scope)
    }

    /// A worker for the request `op`, inheriting `inherit` (descriptors above 2), waiting for
    /// the request; what becomes of it should this process die meanwhile: `on_owner_death`.
    fn spawn_worker(
        &self,
        op: &'static str,
        inherit: &[std::os::fd::RawFd],
        on_owner_death: swrk::OnOwnerDeath,
    ) -> Result<swrk::Worker, CriuError> {
        swrk::Worker::spawn(
            &self.binary,
            op,
            self.plugin_dir.as_deref(),
            inherit,
            on_owner_death,
        )
    }

    /// Sends `req` to `worker`, waits for its answer and its exit by `deadline` (past it, the
    /// worker and what is under it are killed: [`Scope::missed`]), and checks the answer.
    fn answer(
        mut worker: swrk::Worker,
        op: &'static str,
        req: CriuReq,
        log: Option<&Path>,
        deadline: Instant,
        mut scope: Scope<'_>,
    ) -> Result<CriuResp, CriuError> {
        let mut on_notify = scope.on_notify.take();
        let answer =
            match worker.request(&req, deadline, |n| on_notify.as_mut().is_none_or(|f| f(n))) {
                Ok(Some(resp)) => Ok(resp),
                Ok(None) => {
                    let killed = worker.kill_tree(scope.adopted);
                    return Err(scope.missed(op, killed, log));
                }
                Err(e) => Err(e),
            };
        let status = match (worker.finish(deadline), &answer) {
            (Ok(Some(status)), _) => status.to_string(),
            // It answered and does not exit: what it restored is handed over as at its exit.
            (Ok(None), Ok(_)) => {
                worker.kill();
                "killed after answering".to_string()
            }
            (Ok(None), Err(_)) => {
                worker.kill_tree(scope.adopted);
                "killed".to_string()
            }
            (Err(e), _) => {
                worker.kill_tree(scope.adopted);
                answer?;
                return Err(e);
            }
        };
        let resp = answer?;
        tracing::debug!(op, %status, success = resp.success, "criu swrk finished");
        if !resp.success {
            let log_tail = log.map(log_tail).unwrap_or_default();
            let message = if resp.r#type == ReqType::Empty as i32 && resp.cr_errmsg.is_none() {
                Some("criu rejected the request".to_string())
            } else {
                first_real_error(resp.cr_errmsg, &log_tail)
            };
            return Err(CriuError::Failed {
                op,
                errno: resp.cr_errno,
                message,
                log: log.map(Path::to_path_buf),
                log_tail,
            });
        }
        if resp.r#type != req.r#type {
            return Err(CriuError::Protocol {
                op,
                detail: format!(
                    "answer of type {} to a request of type {}",
                    resp.r#type, req.r#type
                ),
            });
        }
        Ok(resp)
    }
}

/// What a request may kill and how long it has.
struct Scope<'a> {
    /// The time allowed, from the worker's start to its exit.
    limit: Duration,
    /// The images directory, named in errors.
    images_dir: Option<&'a Path>,
    /// PIDs the request creates outside the worker's tree (children of this process).
    adopted: &'a [i32],
    /// Told each action-script notification, before it is acknowledged.
    /// Its answer is the script's success: `false` fails the request.
    on_notify: Option<&'a mut dyn FnMut(&rpc::Notify) -> bool>,
}

impl Scope<'_> {
    /// The error for a request that did not finish in time.
    fn missed(&self, op: &'static str, killed: usize, log: Option<&Path>) -> CriuError {
        CriuError::DeadlineExceeded {
            op,
            deadline: self.limit,
            images_dir: self.images_dir.map(Path::to_path_buf),
            killed,
            log: log.map(Path::to_path_buf),
            log_tail: log.map(log_tail).unwrap_or_default(),
        }
    }
}

fn request(kind: ReqType, opts: Option<CriuOpts>) -> CriuReq {
    CriuReq {
        r#type: kind as i32,
        opts,
        ..Default::default()
    }
}

fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

fn check_log_name(name: &str) -> Result<(), CriuError> {
    if name.is_empty() || name.contains('/') {
        return Err(CriuError::InvalidOptions(format!(
            "log file {name:?}: CRIU wants a plain file name, written inside the images directory"
        )));
    }
    Ok(())
}

/// Opens (creating it first if asked) the images directory; the descriptor is what CRIU gets.
fn open_images_dir(dir: &Path, create: bool) -> Result<File, CriuError> {
    let err = |source| CriuError::ImagesDir {
        path: dir.to_owned(),
        source,
    };
    if create {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let file = File::open(dir).map_err(err)?;
    if !file.metadata().map_err(err)?.is_dir() {
        return Err(err(std::io::Error::from_raw_os_error(libc::ENOTDIR)));
    }
    Ok(file)
}

/// The last lines of a CRIU log; empty when unreadable.
fn log_tail(log: &Path) -> String {
    let Ok(mut file) = File::open(log) else {
        return String::new();
    };
    let text = swrk::read_tail(&mut file);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

/// How possum's CRIU plugin starts a line about an error that fails CRIU's run (the plugin's
/// other lines start `possum-criu-plugin:`).
pub const PLUGIN_ERROR: &str = "Error (possum-criu-plugin):";

/// Errors CRIU logs and then carries on regardless: `criu restore` logs this one on the machines
/// measured so far, as its first error, and succeeds.
const BENIGN_ERRORS: &[&str] = &["Can't setup RLIMIT_NOFILE for self"];

/// CRIU's `cr_errmsg` is the first error it logged. When that one is benign, the first other
/// `Error (...)` line of the log's tail says more.
fn first_real_error(errmsg: Option<String>, log_tail: &str) -> Option<String> {
    // possum's plugin failing is the cause of what CRIU reports after it.
    if let Some(l) = log_tail
        .lines()
        .find_map(|l| l.find(PLUGIN_ERROR).map(|i| &l[i..]))
    {
        return Some(l.to_owned());
    }
    let benign = |m: &str| BENIGN_ERRORS.iter().any(|b| m.contains(b));
    match errmsg {
        Some(m) if !benign(&m) => Some(m),
        other => log_tail
            .lines()
            .filter_map(|l| l.find("Error (").map(|i| &l[i..]))
            .find(|l| !benign(l))
            .map(str::to_owned)
            .or(other),
    }
}

/// CRIU's account, or `None` with a warning when it could not be read: it only informs.
fn read_stats<T>(stats: Result<Option<T>, images::ImageError>) -> Option<T> {
    stats.unwrap_or_else(|e| {
        tracing::warn!("CRIU's statistics: {e}");
        None
    })
}
/// Total size of the regular files directly in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugins_error_is_the_cause() {
        let tail = "(00.10) possum-criu-plugin: pid 7: host memory filled: 1 bytes\n\
                    (00.11) Error (possum-criu-plugin): pid 8: cannot restore the memory\n\
                    (00.12) Error (criu/cr-restore.c:1916): Unable to detach 8: No such process\n";
        let errmsg = Some("Error (criu/cr-restore.c:1916): Unable to detach 8".into());
        assert_eq!(
            first_real_error(errmsg, tail).as_deref(),
            Some("Error (possum-criu-plugin): pid 8: cannot restore the memory")
        );
    }

    #[test]
    fn a_benign_first_error_gives_way_to_the_next_one() {
        let tail = "(00.03) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: \
                    Operation not permitted\n(00.04) No inventory.img image\n\
                    (00.05) Error (criu/protobuf.c:72): Unexpected EOF on (empty-image)\n";
        let first =
            Some("Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self".into());
        assert_eq!(
            first_real_error(first.clone(), tail).as_deref(),
            Some("Error (criu/protobuf.c:72): Unexpected EOF on (empty-image)")
        );
        assert_eq!(first_real_error(first.clone(), ""), first);
        assert_eq!(
            first_real_error(Some("Can't seize 7".into()), tail).as_deref(),
            Some("Can't seize 7")
        );
    }

    #[test]
    fn version_display() {
        assert_eq!(CriuVersion::plain(4, 1, 1).to_string(), "4.1.1");
    }

    #[test]
    fn log_names_with_slashes_are_rejected() {
        let criu = Criu::with_binary("/nonexistent/criu");
        let opts = DumpOptions {
            log_file: "sub/dump.log".into(),
            ..DumpOptions::new(std::process::id() as i32, "/nonexistent")
        };
        assert!(matches!(
            criu.dump(&opts),
            Err(CriuError::InvalidOptions(_))
        ));
    }

    #[test]
    fn a_missing_binary_is_a_spawn_error() {
        let criu = Criu::with_binary("/nonexistent/criu");
        match criu.version() {
            Err(CriuError::Spawn { binary, .. }) => {
                assert_eq!(binary, Path::new("/nonexistent/criu"))
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn a_worker_that_exits_without_answering_is_reported_with_its_output() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("criu");
        std::fs::write(&fake, "#!/bin/sh\necho \"no luck: $*\" >&2\nexit 3\n").unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        match Criu::with_binary(&fake).version() {
            Err(CriuError::WorkerDied { op, status, output }) => {
                assert_eq!(op, "version");
                assert!(status.contains('3'), "{status}");
                assert!(output.starts_with("no luck: swrk "), "{output}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn the_plugin_dir_comes_from_the_environment_or_beside_the_executable() {
        let exe = Path::new("/opt/possum/bin/possum");
        let beside = Path::new("/opt/possum/bin/criu-plugins");
        let yes = |p: &Path| p == beside.join(PLUGIN_FILE);
        let no = |_: &Path| false;
        assert_eq!(
            resolve_plugin_dir(Some("/x/plugins".into()), Some(exe), no),
            Some(PathBuf::from("/x/plugins"))
        );
        // An empty value loads no plugin, even with one beside the executable.
        assert_eq!(resolve_plugin_dir(Some("".into()), Some(exe), yes), None);
        assert_eq!(
            resolve_plugin_dir(None, Some(exe), yes),
            Some(beside.to_path_buf())
        );
        assert_eq!(resolve_plugin_dir(None, Some(exe), no), None);
        assert_eq!(resolve_plugin_dir(None, None, yes), None);
    }

    #[test]
    fn a_plugin_beside_the_executable_is_staged_into_a_directory_of_its_own() {
        let tmp = tempfile::tempdir().unwrap();
        let built = tmp.path().join("release");
        std::fs::create_dir_all(&built).unwrap();
        std::fs::write(built.join(PLUGIN_FILE), b"plugin v1").unwrap();
        std::fs::write(built.join("libpossum.so"), b"not a plugin").unwrap();
        let own = tmp.path().join("plugins");
        assert_eq!(stage_plugin(&built.join(PLUGIN_FILE), &own).unwrap(), own);
        let names: Vec<_> = std::fs::read_dir(&own)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(PLUGIN_FILE)]);
        assert_eq!(std::fs::read(own.join(PLUGIN_FILE)).unwrap(), b"plugin v1");
        // A rebuilt plugin (another size) replaces the copy.
        std::fs::write(built.join(PLUGIN_FILE), b"plugin v2, longer").unwrap();
        stage_plugin(&built.join(PLUGIN_FILE), &own).unwrap();
        assert_eq!(
            std::fs::read(own.join(PLUGIN_FILE)).unwrap(),
            b"plugin v2, longer"
        );
        assert!(stage_plugin(&built.join("missing.so"), &own).is_err());
        // A copy left by a copier that died (no such pid) goes at the next copy.
        let dead = own.join(format!(".{PLUGIN_FILE}.{}", u32::MAX - 1));
        std::fs::write(&dead, b"half").unwrap();
        std::fs::write(built.join(PLUGIN_FILE), b"plugin v3, longer still").unwrap();
        stage_plugin(&built.join(PLUGIN_FILE), &own).unwrap();
        assert!(!dead.exists());
        assert_eq!(
            std::fs::read(own.join(PLUGIN_FILE)).unwrap(),
            b"plugin v3, longer still"
        );
    }

    #[test]
    fn deadlines_grow_with_the_size() {
        let d = Deadline {
            base: Duration::from_secs(10),
            per_gib: Duration::from_secs(4),
        };
        assert_eq!(d.for_bytes(0), Duration::from_secs(10));
        assert_eq!(d.for_bytes(3 << 29), Duration::from_secs(16));
        assert_eq!(d.for_bytes(u64::MAX), Duration::from_secs(10 + (4 << 34)));
        let fixed = Deadline::fixed(Duration::from_secs(3));
        assert_eq!(fixed.for_bytes(1 << 40), Duration::from_secs(3));
        assert_eq!(DumpOptions::new(1, "/i").deadline, Deadline::DUMP);
        assert_eq!(RestoreOptions::new("/i").deadline, Deadline::RESTORE);
    }

    /// A worker that never answers is killed at the deadline, with what it started, and the
    /// error says so. (No CRIU needed: the worker is a script.)
    #[test]
    fn a_worker_that_never_answers_is_killed_at_the_deadline_with_its_children() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("criu");
        let child_file = dir.path().join("child");
        std::fs::write(
            &fake,
            format!(
                "#!/bin/sh\nsleep 1000 &\necho $! > {}.tmp\nmv {0}.tmp {0}\nwait\n",
                child_file.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let images = dir.path().join("images");
        let opts = DumpOptions {
            deadline: Deadline::fixed(Duration::from_secs(2)),
            ..DumpOptions::new(std::process::id() as i32, &images)
        };
        let criu = Criu::with_binary(&fake).with_plugin_dir(None);
        let err = criu.dump(&opts).unwrap_err();
        assert!(
            matches!(
                err,
                CriuError::DeadlineExceeded {
                    op: "dump",
                    killed: 1,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(
            err.to_string().starts_with(&format!(
                "criu dump did not finish within 2 s (deadline), images in {}; it and the 1 task \
                 it had started were killed",
                images.display()
            )),
            "{err}"
        );
        let sleeper: i32 = std::fs::read_to_string(&child_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // Killed; reparented to init (or a subreaper) and reaped there.
        let end = Instant::now() + Duration::from_secs(20);
        while process::parent_of(sleeper).is_some()
            && !possum_control::proc_text(format!("/proc/{sleeper}/stat"))
                .unwrap_or_default()
                .contains(") Z ")
        {
            assert!(
                Instant::now() < end,
                "sleep {sleeper} outlived the deadline"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn the_worker_gets_the_plugin_dir_as_criu_libs_dir() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("criu");
        std::fs::write(
            &fake,
            "#!/bin/sh\necho \"libs=${CRIU_LIBS_DIR:-unset}\" >&2\nexit 3\n",
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let criu = Criu::with_binary(&fake).with_plugin_dir(Some("/some/plugins".into()));
        assert_eq!(criu.plugin_dir(), Some(Path::new("/some/plugins")));
        match criu.version() {
            Err(CriuError::WorkerDied { output, .. }) => {
                assert!(output.starts_with("libs=/some/plugins"), "{output}")
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
