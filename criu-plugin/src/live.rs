//! CUDA processes the plugin checkpoints itself, so that plain `criu dump --libdir DIR` (and a
//! container engine driving CRIU) can checkpoint a GPU job without `possum checkpoint`.
//!
//! ```text
//! PAUSE_DEVICES(pid), the process still running     possum loaded in it (its control socket):
//!   checkpoint{IMAGES/possum-gpu-PID} ─────────────▶ pre-copy while it runs
//!   release ───────────────────────────────────────▶ T0: operations held, rest copied, released
//!   driver lock + checkpoint (the residue; without possum: every buffer)
//!   record "cuda PID ..." in possum-criu-plugin.txt
//! CRIU dumps the process (no NVIDIA mapping is left in it)
//! exit(DUMP) when the job runs on (--leave-running, or the dump failed), the process stopped:
//!   driver restore + unlock (its restore thread let run for it) ─ resume{dir} sent, answered
//!   once CRIU lets the job go
//! RESUME_DEVICES_LATE(pid) at `criu restore`, the process stopped:
//!   driver restore + unlock (likewise) ─ resume{IMAGES/possum-gpu-PID} sent
//! ```
//!
//! The job's GPU operations stay held (possum's op gate, or the driver's lock) until the resume
//! is answered, so nothing runs on a GPU state that is not back. A process the driver already
//! reports checkpointed (what `possum checkpoint` does before it runs CRIU) is left alone: the
//! CLI restores it. A job that does not see CRIU's images directory at its path (a container)
//! gets the directory itself with each request ([`PossumPart`]). The decisions are safe
//! functions over a [`Driver`] (NVIDIA's `cuCheckpointProcess*`, loaded in [`crate::ffi`]) and a
//! [`JobSocket`]. The requests to the job are the checkpoint sequence's own per-process steps
//! ([`possum_sequence::job::precopy`], [`cut`](possum_sequence::job::cut),
//! [`resume`](possum_sequence::job::resume), [`resume_sent`](possum_sequence::job::resume_sent)),
//! the ones `possum checkpoint` runs, with typed replies.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use possum_control::{ControlError, EnvConfig};
use possum_cuda::checkpoint::{DriverCheckpoint, DriverCkptError};
use possum_sequence::job::{self, JobError, To};

use crate::log::LOG_PREFIX;

/// The directory of a process's GPU image, under CRIU's images directory.
pub fn gpu_dir_name(pid: i32) -> String {
    format!("possum-gpu-{pid}")
}

/// How long the driver's lock may wait for the job's submitted GPU work.
pub const LOCK_TIMEOUT_MS: u32 = 30_000;

/// NVIDIA's checkpoint API for other processes (`cuCheckpointProcess*`), as the plugin uses it:
/// possum-cuda's [`DriverCheckpoint`], or a test's stand-in.
pub trait Driver {
    /// `cuCheckpointProcessLock` with a timeout.
    fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), DriverCkptError>;
    /// `cuCheckpointProcessCheckpoint`.
    fn checkpoint(&self, pid: i32) -> Result<(), DriverCkptError>;
    /// `cuCheckpointProcessRestore` (onto the same GPUs).
    fn restore(&self, pid: i32) -> Result<(), DriverCkptError>;
    /// `cuCheckpointProcessUnlock`.
    fn unlock(&self, pid: i32) -> Result<(), DriverCkptError>;
}

/// The plugin's own deadline for the driver's checkpoint and restore: none. The plugin runs in
/// CRIU, and CRIU's run is what has the deadline (possum's CRIU adapter kills the worker, the
/// plugin's calls with it, at the dump's or restore's deadline, sized by the job's memory); the
/// calls that move no memory keep possum-cuda's short deadline.
const MOVING_CALLS_DEADLINE: std::time::Duration = std::time::Duration::MAX;

impl Driver for DriverCheckpoint {
    fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), DriverCkptError> {
        DriverCheckpoint::lock(self, pid, timeout_ms)
    }
    fn checkpoint(&self, pid: i32) -> Result<(), DriverCkptError> {
        DriverCheckpoint::checkpoint(self, pid, MOVING_CALLS_DEADLINE)
    }
    fn restore(&self, pid: i32) -> Result<(), DriverCkptError> {
        DriverCheckpoint::restore(self, pid, &[], MOVING_CALLS_DEADLINE)
    }
    fn unlock(&self, pid: i32) -> Result<(), DriverCkptError> {
        DriverCheckpoint::unlock(self, pid)
    }
}

/// Why a live checkpoint at `PAUSE_DEVICES` failed, with what undoing the steps before it came
/// to.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// possum's pre-copy in the job failed (nothing to undo).
    #[error("possum's pre-copy in process {pid}: {source}")]
    Precopy {
        /// The process.
        pid: i32,
        /// The control client's error.
        source: Box<ControlError>,
    },
    /// possum's release in the job failed.
    #[error("possum's release in process {pid}: {source}{undo}")]
    Release {
        /// The process.
        pid: i32,
        /// The control client's error.
        source: Box<ControlError>,
        /// possum resumed.
        undo: Undo,
    },
    /// The driver's lock failed.
    #[error("NVIDIA's driver could not lock process {pid} ({source}){undo}")]
    Lock {
        /// The process.
        pid: i32,
        /// The driver's error.
        source: Box<DriverCkptError>,
        /// possum resumed.
        undo: Undo,
    },
    /// The driver's checkpoint failed.
    #[error("NVIDIA's driver checkpoint of process {pid} failed ({source}){undo}")]
    Checkpoint {
        /// The process.
        pid: i32,
        /// The driver's error.
        source: Box<DriverCkptError>,
        /// The driver unlocked and possum resumed.
        undo: Undo,
    },
}

/// What undoing a failed checkpoint came to; shown after its error.
#[derive(Debug)]
pub enum Undo {
    /// Undone: the job runs on.
    Done,
    /// possum's resume in the job failed.
    Resume(Box<ControlError>),
    /// The driver's unlock failed.
    Unlock(Box<DriverCkptError>),
}

impl Undo {
    /// The undo that resumed possum in the job.
    fn resumed(r: Result<(), ControlError>) -> Undo {
        match r {
            Ok(()) => Undo::Done,
            Err(e) => Undo::Resume(Box::new(e)),
        }
    }
}

impl std::fmt::Display for Undo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let failed = match self {
            Undo::Done => return f.write_str("; undone, the job runs on"),
            Undo::Resume(e) => format!("resuming possum: {e}"),
            Undo::Unlock(e) => format!("unlocking it: {e}"),
        };
        write!(
            f,
            "; undoing it failed too ({failed}): the job may stay paused"
        )
    }
}

/// Why bringing a checkpointed process back failed.
#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    /// The driver's restore.
    #[error("NVIDIA's driver restore of process {pid}: {source}")]
    DriverRestore {
        /// The process.
        pid: i32,
        /// The driver's error.
        source: DriverCkptError,
    },
    /// The driver's unlock.
    #[error("NVIDIA's driver unlock of process {pid}: {source}")]
    DriverUnlock {
        /// The process.
        pid: i32,
        /// The driver's error.
        source: DriverCkptError,
    },
    /// Letting the process's CUDA restore thread run, or stopping it again.
    #[error(transparent)]
    RestoreThread(#[from] crate::restore_thread::RestoreThreadError),
    /// possum's resume could not be sent: the job's GPU operations stay held.
    #[error(
        "process {pid} is back in the driver, but possum's resume could not be sent ({source}): \
         its GPU operations stay held; send it with `possum resume {pid} {}`",
        dir.display()
    )]
    NotSent {
        /// The process.
        pid: i32,
        /// Its GPU image directory.
        dir: PathBuf,
        /// The control client's error.
        source: ControlError,
    },
}

/// A job that does not see CRIU's images directory at its path.
#[derive(Debug, thiserror::Error)]
pub enum JobSeesError {
    /// The images directory itself cannot be read.
    #[error("{}: {source}", dir.display())]
    Ours {
        /// The images directory.
        dir: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The job sees another directory there, or none.
    #[error(
        "process {pid} does not see CRIU's images directory {} at that path (another mount \
         namespace: a container); possum in the job writes its GPU buffers there itself, so \
         mount the images directory into the job's namespace at the same path",
        dir.display()
    )]
    Theirs {
        /// The process.
        pid: i32,
        /// The images directory.
        dir: PathBuf,
    },
}

/// A job's possum control socket, as the plugin reaches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSocket {
    /// The process (as CRIU knows it).
    pub pid: i32,
    /// The socket, through `/proc/PID/root` (the job may be in another mount namespace) and
    /// named by the job's own pid (it may be in another pid namespace).
    pub path: PathBuf,
}

impl JobSocket {
    /// The socket of `pid` if it has one: in the job's `POSSUM_SOCKET_DIR` (from its
    /// environment at exec), else this process's, else `/tmp/possum`.
    pub fn find(pid: i32) -> Option<JobSocket> {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let status = possum_control::proc_text(format!("/proc/{pid}/status")).unwrap_or_default();
        let dir = socket_dir_in(&environ).unwrap_or_else(possum_control::socket_dir);
        let ns_pid = innermost_pid(&status).unwrap_or(pid);
        let path = proc_root(pid, &possum_control::socket_path(&dir, ns_pid as u32));
        path.exists().then_some(JobSocket { pid, path })
    }

    /// How the sequence's steps reach this socket (no directory passed).
    fn to(&self) -> To<'_> {
        To::Socket {
            path: &self.path,
            dir: None,
        }
    }
}

/// possum's part of a CUDA process the plugin checkpointed: its socket and its GPU image
/// directory, which the job reaches by path or, where that path does not exist for it (a job in
/// another mount namespace: a container), through the images directory's descriptor passed with
/// each request ([`To::Socket`]'s `dir`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PossumPart {
    /// The job's control socket.
    pub socket: JobSocket,
    /// The GPU image directory, as CRIU sees it (`IMAGES/possum-gpu-PID`).
    pub dir: PathBuf,
    /// Whether requests pass the images directory rather than name the path.
    pub pass_dir: bool,
}

/// Set (to 1) in CRIU's environment, the plugin passes the images directory to the job even
/// where the job sees its path (how the CPU tests exercise what a container needs).
pub use crate::config::PASS_DIR_ENV;

impl PossumPart {
    /// The part for `dir`, deciding how the job reaches it.
    pub fn new(socket: JobSocket, dir: PathBuf) -> PossumPart {
        let forced = crate::config::Config::from_env().force_pass_dir;
        // The images directory, which exists (the GPU image directory is made by the job).
        let images = dir.parent().unwrap_or(Path::new("/"));
        let pass_dir = forced || job_sees(socket.pid, images).is_err();
        PossumPart {
            socket,
            dir,
            pass_dir,
        }
    }

    /// Runs `step`, one of the sequence's per-process requests, for this job with `dir` as
    /// the job reaches it; the control client's error when it fails.
    fn step<T>(
        &self,
        step: impl FnOnce(i32, To<'_>, String) -> Result<T, JobError>,
    ) -> Result<T, ControlError> {
        use std::os::fd::AsFd;
        // Passed: the images directory itself, the request's `dir` relative to it.
        let images = match (self.pass_dir, self.dir.parent()) {
            (true, Some(parent)) => {
                Some(
                    std::fs::File::open(parent).map_err(|source| ControlError::Io {
                        path: parent.to_path_buf(),
                        source,
                    })?,
                )
            }
            _ => None,
        };
        let dir = match (&images, self.dir.file_name()) {
            (Some(_), Some(name)) => name.to_string_lossy().into_owned(),
            _ => self.dir.display().to_string(),
        };
        let to = To::Socket {
            path: &self.socket.path,
            dir: images.as_ref().map(AsFd::as_fd),
        };
        step(self.socket.pid, to, dir).map_err(JobError::into_control)
    }
}

/// `POSSUM_SOCKET_DIR` in a `/proc/PID/environ` (NUL-separated), when set and not empty.
pub fn socket_dir_in(environ: &[u8]) -> Option<PathBuf> {
    environ
        .split(|&b| b == 0)
        .filter_map(|kv| kv.strip_prefix(b"POSSUM_SOCKET_DIR="))
        .rfind(|v| !v.is_empty())
        .map(|v| PathBuf::from(String::from_utf8_lossy(v).into_owned()))
}

/// The process's pid in its own pid namespace: the last of `NSpid:` in `/proc/PID/status`.
pub fn innermost_pid(status: &str) -> Option<i32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// `path` as process `pid` sees it (through `/proc/PID/root`).
pub fn proc_root(pid: i32, path: &Path) -> PathBuf {
    let rel = path.strip_prefix("/").unwrap_or(path);
    Path::new(&format!("/proc/{pid}/root")).join(rel)
}

/// A CUDA process the plugin has checkpointed (or is restoring), with what it needs to resume.
#[derive(Debug, Clone, PartialEq)]
pub struct Live {
    /// The process.
    pub pid: i32,
    /// possum's part, when possum is loaded in it: its socket and its GPU image directory (the
    /// same path for the job and for CRIU).
    pub possum: Option<PossumPart>,
    /// The checkpoint's steps and their milliseconds, in order.
    pub steps: Steps,
}

/// Steps and their milliseconds, in order: the figures in the plugin's log lines.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Steps(pub Vec<(&'static str, f64)>);

impl Steps {
    /// Runs `f` as step `name`, timed.
    pub fn time<T>(&mut self, name: &'static str, f: impl FnOnce() -> T) -> T {
        let t = std::time::Instant::now();
        let r = f();
        self.0.push((name, t.elapsed().as_secs_f64() * 1e3));
        r
    }

    /// `pre-copy 12 ms, release 3 ms, ...`.
    pub fn line(&self) -> String {
        self.0
            .iter()
            .map(|(n, ms)| format!("{n} {ms:.0} ms"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Live {
    /// One line for the log: what was done, with each step's time (the job is held from the
    /// release on, or from the driver's lock without possum).
    pub fn describe(&self) -> String {
        let what = match &self.possum {
            Some(p) => format!(
                "possum's buffers saved to {}{} and released, then NVIDIA's driver checkpoint",
                p.dir.display(),
                if p.pass_dir {
                    " (the images directory passed to the job)"
                } else {
                    ""
                }
            ),
            None => "NVIDIA's driver checkpoint (possum is not loaded in it)".into(),
        };
        format!("{what} ({})", self.steps.line())
    }
}

/// Whether the job `pid` sees `dir` (CRIU's view) as the same directory: the job writes and
/// reads its GPU image there itself, by path when it does, else through a passed descriptor
/// ([`PossumPart`]).
pub fn job_sees(pid: i32, dir: &Path) -> Result<(), JobSeesError> {
    let ours = std::fs::metadata(dir).map_err(|source| JobSeesError::Ours {
        dir: dir.to_path_buf(),
        source,
    })?;
    let theirs = std::fs::metadata(proc_root(pid, dir));
    match theirs {
        Ok(m) if (m.dev(), m.ino()) == (ours.dev(), ours.ino()) => Ok(()),
        _ => Err(JobSeesError::Theirs {
            pid,
            dir: dir.to_path_buf(),
        }),
    }
}

/// The sequence at `PAUSE_DEVICES` for a running CUDA process: possum's pre-copy and release
/// when possum is loaded (its GPU image under `images`), then the driver's lock and checkpoint.
/// On a failure, what was done is undone (the job runs on) and the error names the step.
pub fn checkpoint(
    pid: i32,
    images: &Path,
    socket: Option<JobSocket>,
    driver: &dyn Driver,
) -> Result<Live, CheckpointError> {
    let mut steps = Steps::default();
    let possum = match socket {
        Some(s) => Some(release_possum(pid, images, s, &mut steps)?),
        None => None,
    };
    let undo_possum = |possum: &Option<PossumPart>| match possum {
        Some(p) => Undo::resumed(resume_now(p)),
        None => Undo::Done,
    };
    if let Err(source) = steps.time("driver lock", || driver.lock(pid, LOCK_TIMEOUT_MS)) {
        return Err(CheckpointError::Lock {
            pid,
            source: Box::new(source),
            undo: undo_possum(&possum),
        });
    }
    if let Err(source) = steps.time("driver checkpoint", || driver.checkpoint(pid)) {
        let undo = match driver.unlock(pid) {
            Ok(()) => undo_possum(&possum),
            Err(e) => Undo::Unlock(Box::new(e)),
        };
        return Err(CheckpointError::Checkpoint {
            pid,
            source: Box::new(source),
            undo,
        });
    }
    Ok(Live { pid, possum, steps })
}

/// possum's pre-copy and release in the job (its GPU image under `images`), timed into
/// `steps`; a failed release resumes possum.
fn release_possum(
    pid: i32,
    images: &Path,
    socket: JobSocket,
    steps: &mut Steps,
) -> Result<PossumPart, CheckpointError> {
    let part = PossumPart::new(socket, images.join(gpu_dir_name(pid)));
    steps
        .time("pre-copy", || {
            part.step(|pid, to, dir| job::precopy(pid, to, dir, false, None))
        })
        .map_err(|source| CheckpointError::Precopy {
            pid,
            source: Box::new(source),
        })?;
    let release = steps.time("release", || {
        job::cut(pid, part.socket.to(), (None, None)).map_err(JobError::into_control)
    });
    if let Err(source) = release {
        let undo = Undo::resumed(resume_now(&part));
        return Err(CheckpointError::Release {
            pid,
            source: Box::new(source),
            undo,
        });
    }
    Ok(part)
}

/// Resumes possum in a job that runs (a failed checkpoint's undo), waiting for its answer.
fn resume_now(p: &PossumPart) -> Result<(), ControlError> {
    p.step(|pid, to, dir| job::resume(pid, to, dir, None))
        .map(|_| ())
}

/// A driver step to run while the process's CUDA restore thread runs.
pub type Step<'a> = &'a mut dyn FnMut() -> Result<(), ResumeError>;

/// Runs a [`Step`] with the restore thread let run (CRIU holds the process stopped).
pub type WithRestoreThread<'a> = &'a mut dyn FnMut(Step<'_>) -> Result<(), ResumeError>;

/// Brings a checkpointed process back: the driver's restore and unlock, run by
/// `with_restore_thread` (which lets the process's CUDA restore thread run meanwhile: CRIU holds
/// the process stopped), then possum's resume sent to the job, which answers it once CRIU lets
/// it go (naming its GPU image directory by path, or relative to the images directory passed
/// with the request, [`PossumPart`]).
pub fn resume(
    live: &Live,
    driver: &dyn Driver,
    with_restore_thread: WithRestoreThread<'_>,
) -> Result<String, ResumeError> {
    let pid = live.pid;
    let mut steps = Steps::default();
    with_restore_thread(&mut || {
        steps
            .time("driver restore", || driver.restore(pid))
            .map_err(|source| ResumeError::DriverRestore { pid, source })?;
        steps
            .time("driver unlock", || driver.unlock(pid))
            .map_err(|source| ResumeError::DriverUnlock { pid, source })
    })?;
    let took = steps.line();
    match &live.possum {
        Some(p) => {
            p.step(job::resume_sent)
                .map_err(|source| ResumeError::NotSent {
                    pid,
                    dir: p.dir.clone(),
                    source,
                })?;
            Ok(format!(
                "{LOG_PREFIX} pid {pid}: driver restored and unlocked ({took}); possum's resume \
                 from {}{} sent (answered once CRIU lets the process run)",
                p.dir.display(),
                if p.pass_dir { " (passed)" } else { "" }
            ))
        }
        None => Ok(format!(
            "{LOG_PREFIX} pid {pid}: driver restored and unlocked ({took})"
        )),
    }
}

/// Whether CRIU's command line (`/proc/self/cmdline`, NUL-separated) asks the dumped tree to
/// run on after the dump: `Some(true)` for `dump ... -R`/`--leave-running`, `Some(false)` for a
/// `dump` without it, `None` when CRIU serves requests (`swrk`, `service`: the options came over
/// RPC, which the plugin cannot see).
pub fn leave_running_from_cmdline(cmdline: &[u8]) -> Option<bool> {
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    if !args.iter().any(|a| *a == b"dump") {
        return None;
    }
    Some(args.iter().any(|a| {
        *a == b"--leave-running"
            || (a.len() > 1 && a[0] == b'-' && a[1] != b'-' && a[1..].contains(&b'R'))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use possum_control::Request;
    use std::cell::RefCell;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// A driver that logs its calls and fails the ones named in `fail`.
    #[derive(Default)]
    struct Mock {
        calls: RefCell<Vec<String>>,
        fail: Vec<&'static str>,
    }

    impl Mock {
        fn call(&self, what: &'static str, pid: i32) -> Result<(), DriverCkptError> {
            self.calls.borrow_mut().push(format!("{what} {pid}"));
            if self.fail.contains(&what) {
                Err(DriverCkptError::Call {
                    call: what,
                    pid,
                    code: 999,
                    text: "mock failure".into(),
                })
            } else {
                Ok(())
            }
        }
    }

    impl Driver for Mock {
        fn lock(&self, pid: i32, _: u32) -> Result<(), DriverCkptError> {
            self.call("lock", pid)
        }
        fn checkpoint(&self, pid: i32) -> Result<(), DriverCkptError> {
            self.call("checkpoint", pid)
        }
        fn restore(&self, pid: i32) -> Result<(), DriverCkptError> {
            self.call("restore", pid)
        }
        fn unlock(&self, pid: i32) -> Result<(), DriverCkptError> {
            self.call("unlock", pid)
        }
    }

    /// A possum control server in this process that logs the commands it gets; `fail` makes
    /// the one of that name answer an error.
    fn job(
        dir: &Path,
        fail: Option<&'static str>,
    ) -> (possum_control::Server, Arc<Mutex<Vec<String>>>) {
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = Arc::clone(&seen);
        let handler = move |req: Request| {
            let name = match &req {
                Request::Checkpoint { .. } => "checkpoint",
                Request::Release => "release",
                Request::Resume { .. } => "resume",
                _ => "other",
            };
            log.lock().unwrap().push(format!("{req:?}"));
            if fail == Some(name) {
                serde_json::json!({"error": format!("{name} refused")})
            } else {
                serde_json::json!({})
            }
        };
        (
            possum_control::Server::start(dir, Arc::new(handler)).unwrap(),
            seen,
        )
    }

    /// A new temporary directory with its `images` directory made.
    fn with_images() -> (tempfile::TempDir, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let images = tmp.path().join("images");
        std::fs::create_dir(&images).unwrap();
        (tmp, images)
    }

    fn me() -> i32 {
        std::process::id() as i32
    }

    fn socket(dir: &Path) -> JobSocket {
        JobSocket {
            pid: me(),
            path: possum_control::socket_path(dir, me() as u32),
        }
    }

    #[test]
    fn a_possum_job_is_released_before_the_driver_locks_and_checkpoints_it() {
        let (tmp, images) = with_images();
        let (_server, seen) = job(&tmp.path().join("s"), None);
        let d = Mock::default();
        let live = checkpoint(me(), &images, Some(socket(&tmp.path().join("s"))), &d).unwrap();
        let gpu = images.join(gpu_dir_name(me()));
        assert_eq!(live.possum.as_ref().map(|p| &p.dir), Some(&gpu));
        assert_eq!(live.possum.as_ref().map(|p| p.pass_dir), Some(false));
        assert_eq!(
            *seen.lock().unwrap(),
            [
                format!(
                    "Checkpoint {{ dir: {:?}, parent: None }}",
                    gpu.display().to_string()
                ),
                "Release".to_string()
            ]
        );
        assert_eq!(
            *d.calls.borrow(),
            [format!("lock {}", me()), format!("checkpoint {}", me())]
        );
        let names: Vec<&str> = live.steps.0.iter().map(|s| s.0).collect();
        assert_eq!(
            names,
            ["pre-copy", "release", "driver lock", "driver checkpoint"]
        );
        assert!(live.describe().contains("release "), "{}", live.describe());

        // Back: the driver first (with the restore thread running), then possum's resume.
        let mut ran = 0;
        let line = resume(&live, &d, &mut |f| {
            ran += 1;
            f()
        })
        .unwrap();
        assert_eq!(ran, 1);
        assert!(line.contains("resume from"), "{line}");
        assert_eq!(
            d.calls.borrow()[2..],
            [format!("restore {}", me()), format!("unlock {}", me())]
        );
        let t = std::time::Instant::now();
        while seen.lock().unwrap().len() < 3 {
            assert!(t.elapsed() < Duration::from_secs(10), "no resume arrived");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            seen.lock().unwrap()[2].starts_with("Resume"),
            "{:?}",
            seen.lock().unwrap()
        );
    }

    #[test]
    fn a_failed_step_is_undone_and_named() {
        let (tmp, images) = with_images();
        // The failure of a checkpoint with `d` of the job serving in `sock`.
        let fails = |sock: &str, d: &Mock| {
            checkpoint(me(), &images, Some(socket(&tmp.path().join(sock))), d)
                .unwrap_err()
                .to_string()
        };
        // The driver's checkpoint fails: the job is unlocked and possum resumed.
        let (_server, seen) = job(&tmp.path().join("s"), None);
        let d = Mock {
            fail: vec!["checkpoint"],
            ..Mock::default()
        };
        let e = fails("s", &d);
        assert!(
            e.contains("driver checkpoint") && e.contains("undone"),
            "{e}"
        );
        assert_eq!(
            d.calls.borrow().last().unwrap(),
            &format!("unlock {}", me())
        );
        assert!(seen.lock().unwrap().last().unwrap().starts_with("Resume"));
        drop(_server);

        // The release fails: possum is resumed, the driver never touched.
        let (_server, seen) = job(&tmp.path().join("s2"), Some("release"));
        let d = Mock::default();
        let e = fails("s2", &d);
        assert!(
            e.contains("release") && e.contains("release refused"),
            "{e}"
        );
        assert!(d.calls.borrow().is_empty());
        assert!(seen.lock().unwrap().last().unwrap().starts_with("Resume"));

        // Without possum: the lock fails, nothing else is tried.
        let d = Mock {
            fail: vec!["lock"],
            ..Mock::default()
        };
        let e = checkpoint(me(), &images, None, &d).unwrap_err().to_string();
        assert!(
            e.contains("could not lock") && e.contains("CUresult 999"),
            "{e}"
        );
        assert_eq!(d.calls.borrow().len(), 1);
    }

    /// A job that does not see the images directory's path gets the directory itself with each
    /// request, and the request's `dir` relative to it.
    #[test]
    fn the_images_directory_is_passed_where_the_job_cannot_see_it() {
        let (tmp, images) = with_images();
        let (_server, seen) = job(&tmp.path().join("s"), None);
        let part = PossumPart {
            socket: socket(&tmp.path().join("s")),
            dir: images.join("possum-gpu-9"),
            pass_dir: true,
        };
        resume_now(&part).unwrap();
        let got = seen.lock().unwrap().clone();
        assert!(
            got[0].starts_with("Resume { dir: Some(\"/proc/self/fd/")
                && got[0].ends_with("/possum-gpu-9\") }"),
            "{got:?}"
        );
        assert!(Live {
            pid: 9,
            possum: Some(part),
            steps: Steps::default()
        }
        .describe()
        .contains("passed to the job"));
    }

    #[test]
    fn an_images_directory_that_cannot_be_opened_fails_before_the_driver_is_touched() {
        let tmp = tempfile::tempdir().unwrap();
        let (_server, seen) = job(&tmp.path().join("s"), None);
        let d = Mock::default();
        let e = checkpoint(
            me(),
            &tmp.path().join("missing"),
            Some(socket(&tmp.path().join("s"))),
            &d,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("missing"), "{e}");
        assert!(d.calls.borrow().is_empty());
        assert!(
            seen.lock().unwrap().is_empty(),
            "{:?}",
            seen.lock().unwrap()
        );
    }

    #[test]
    fn the_socket_is_found_from_the_jobs_environment_and_namespace() {
        assert_eq!(
            socket_dir_in(b"A=1\0POSSUM_SOCKET_DIR=/run/x\0B=2\0"),
            Some(PathBuf::from("/run/x"))
        );
        assert_eq!(socket_dir_in(b"POSSUM_SOCKET_DIR=\0"), None);
        assert_eq!(socket_dir_in(b""), None);
        assert_eq!(innermost_pid("Name:\tx\nNSpid:\t4242\t7\n"), Some(7));
        assert_eq!(innermost_pid("Name:\tx\n"), None);
        assert_eq!(
            proc_root(5, Path::new("/tmp/possum/possum-7.sock")),
            PathBuf::from("/proc/5/root/tmp/possum/possum-7.sock")
        );
        // This process has no socket in a fresh directory: none found.
        assert_eq!(
            JobSocket::find(me()).filter(|s| s.path.starts_with("/nonexistent")),
            None
        );
    }

    #[test]
    fn leave_running_is_read_from_criu_s_command_line() {
        let cases = [
            ("criu dump -t 5 -D d -R", Some(true)),
            ("criu dump -t 5 --leave-running", Some(true)),
            ("criu dump -vR -t 5", Some(true)),
            ("criu dump -t 5 -D d", Some(false)),
            ("criu dump --root /R", Some(false)),
            ("criu swrk 3", None),
        ];
        for (cmdline, want) in cases {
            let nul = cmdline.replace(' ', "\0").into_bytes();
            assert_eq!(leave_running_from_cmdline(&nul), want, "{cmdline}");
        }
    }
}
