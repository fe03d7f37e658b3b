//! Asking a job's possum (its control socket), with what the user should do when it cannot.

use std::os::fd::BorrowedFd;
use std::path::Path;
use std::time::{Duration, Instant};

use possum_control::reply::{CheckpointReply, JournalReply, ReleaseReply, ResumeReply};
use possum_control::{ControlError, Reply, Request};
use serde::de::DeserializeOwned;

/// How long possum waits for the job's answers (a checkpoint of many GiB takes a while).
pub const JOB_TIMEOUT: Duration = Duration::from_secs(3600);

/// A request to a job that failed, with what to do about it. The control error is part of the
/// message (not a separate source): it already names the process and, for one without possum,
/// how to start it with possum.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The process has no possum.
    #[error("{0}; or checkpoint it without possum with `--engine driver`")]
    NotLoaded(ControlError),
    /// Its possum has not started (no CUDA call yet).
    #[error("{0}")]
    NotStarted(ControlError),
    /// Its socket is stale.
    #[error(
        "{error}; possum does not answer in process {pid}: checkpoint it without possum with \
         `--engine driver`"
    )]
    Stale {
        /// The process.
        pid: i32,
        /// What the control client said.
        error: ControlError,
    },
    /// The process is gone.
    #[error("{0}")]
    NoProcess(ControlError),
    /// Anything else (an error the job answered, a timeout, a reply of the wrong shape).
    #[error("process {pid}: {error}")]
    Failed {
        /// The process.
        pid: i32,
        /// What the control client said.
        error: ControlError,
    },
}

impl JobError {
    /// The error of a request to process `pid`.
    pub fn of(pid: i32, e: ControlError) -> JobError {
        match e {
            e @ ControlError::NotLoaded { .. } => JobError::NotLoaded(e),
            e @ ControlError::NotStarted { .. } => JobError::NotStarted(e),
            e @ ControlError::Stale { .. } => JobError::Stale { pid, error: e },
            e @ ControlError::NoProcess(_) => JobError::NoProcess(e),
            error => JobError::Failed { pid, error },
        }
    }

    /// The process has no possum (or none started): a process of a job's tree that possum
    /// leaves to the driver.
    pub fn is_without_possum(&self) -> bool {
        matches!(self, JobError::NotLoaded(_) | JobError::NotStarted(_))
    }

    /// What the control client said, without what this error adds for the CLI's user (the
    /// CRIU plugin names the step and the process itself).
    pub fn into_control(self) -> ControlError {
        match self {
            JobError::NotLoaded(e) | JobError::NotStarted(e) | JobError::NoProcess(e) => e,
            JobError::Stale { error, .. } | JobError::Failed { error, .. } => error,
        }
    }
}

/// Asks process `pid` (socket directory `sockets`) with [`JOB_TIMEOUT`]; its reply as `R`.
pub fn ask<R: DeserializeOwned>(
    pid: i32,
    sockets: &Path,
    req: &Request,
) -> Result<Reply<R>, JobError> {
    ask_within(pid, sockets, req, JOB_TIMEOUT)
}

/// [`ask`] within `timeout`.
pub fn ask_within<R: DeserializeOwned>(
    pid: i32,
    sockets: &Path,
    req: &Request,
    timeout: Duration,
) -> Result<Reply<R>, JobError> {
    possum_control::request_reply(pid as u32, sockets, req, timeout)
        .map_err(|e| JobError::of(pid, e))
}

/// How a request reaches a job's possum.
#[derive(Debug, Clone, Copy)]
pub enum To<'a> {
    /// Its socket in this socket directory (the CLI's).
    Sockets(&'a Path),
    /// The socket at this path (reached through `/proc/PID/root` by the CRIU plugin), with a
    /// directory passed along when `dir` is set: the request's `dir` is then relative to it.
    Socket {
        /// The socket.
        path: &'a Path,
        /// The directory passed with the request (`SCM_RIGHTS`).
        dir: Option<BorrowedFd<'a>>,
    },
}

/// Asks process `pid` through `to` with [`JOB_TIMEOUT`]; its reply as `R`.
pub fn ask_to<R: DeserializeOwned>(
    pid: i32,
    to: To<'_>,
    req: &Request,
) -> Result<Reply<R>, JobError> {
    match to {
        To::Sockets(sockets) => ask(pid, sockets, req),
        To::Socket { path, dir } => {
            possum_control::request_at(pid as u32, path, req, JOB_TIMEOUT, dir)
                .and_then(Reply::parse)
                .map_err(|e| JobError::of(pid, e))
        }
    }
}

/// Sends `req` to process `pid` through `to` without waiting for its answer.
pub fn send_to(pid: i32, to: To<'_>, req: &Request) -> Result<(), JobError> {
    let (path, dir) = match to {
        To::Sockets(sockets) => (possum_control::socket_path(sockets, pid as u32), None),
        To::Socket { path, dir } => (path.to_path_buf(), dir),
    };
    possum_control::send_only(pid as u32, &path, req, dir).map_err(|e| JobError::of(pid, e))
}

/// Pre-copy of one process: its possum copies every buffer into `dir` while the job runs
/// (`kept`: a job left running whose memory a keeper holds copies nothing now), referencing the
/// chunks `parent` (an earlier image's directory for this process) holds unchanged.
pub fn precopy(
    pid: i32,
    to: To<'_>,
    dir: String,
    kept: bool,
    parent: Option<String>,
) -> Result<Reply<CheckpointReply>, JobError> {
    let req = if kept {
        Request::CheckpointKept { dir, parent }
    } else {
        Request::Checkpoint { dir, parent }
    };
    ask_to(pid, to, &req)
}

/// [`precopy`], its copy first asked to record each chunk it writes in `journal` where given
/// ([`journal_next`]), which is removed once the round is over.
pub fn precopy_journaled(
    pid: i32,
    to: To<'_>,
    (dir, kept, parent): (String, bool, Option<String>),
    journal: Option<&Path>,
) -> Result<Reply<CheckpointReply>, JobError> {
    journaled(pid, to, journal, || precopy(pid, to, dir, kept, parent))
}

/// `copy` (a request whose copy writes into the images), the job first asked to record each
/// chunk it writes in `journal` where given ([`journal_next`]), which is removed after.
fn journaled<T>(pid: i32, to: To<'_>, journal: Option<&Path>, copy: impl FnOnce() -> T) -> T {
    if let Some(j) = journal {
        journal_next(pid, to, j);
    }
    let r = copy();
    if let Some(j) = journal {
        let _ = std::fs::remove_file(j);
    }
    r
}

/// Another pre-copy round of one process, the job running: what it wrote since the round before
/// copied into the images its checkpoint opened.
pub fn precopy_round(pid: i32, to: To<'_>) -> Result<Reply<CheckpointReply>, JobError> {
    ask_to(pid, to, &Request::PrecopyRound)
}

/// The file in a checkpoint's temporary directory where the job's final copy records the chunks
/// it writes, while it copies, for an observer that reads it (`Observer::cutting`).
pub const FINAL_COPY_JOURNAL: &str = ".final-copy.journal";

/// The same for the first pre-copy round's copy (`Observer::first_round`).
pub const FIRST_ROUND_JOURNAL: &str = ".first-round.journal";

/// Cut of one process (T0): its GPU operations held, what was written since the pre-copy
/// copied and the buffers' memory released (`keeping`: left with the keeper, which holds it
/// that many seconds once the job is gone). With `journal`, the final copy first asked to
/// record each chunk it completes in that file (a job that cannot is cut all the same: its
/// chunks are then sent after the copy), which is removed once the cut is over.
pub fn cut(
    pid: i32,
    to: To<'_>,
    (keeping, journal): (Option<u64>, Option<&Path>),
) -> Result<Reply<ReleaseReply>, JobError> {
    let req = match keeping {
        Some(hold_secs) => Request::ReleaseKeeping { hold_secs },
        None => Request::Release,
    };
    journaled(pid, to, journal, || ask_to(pid, to, &req))
}

/// Asks process `pid` to record each chunk its next copy into its images writes in `journal`
/// (`JournalWrites`). A job that cannot is copied all the same: its chunks are then sent after
/// the copy, so its answer is no matter.
pub fn journal_next(pid: i32, to: To<'_>, journal: &Path) {
    let path = journal.to_string_lossy().into_owned();
    let _ = ask_to::<JournalReply>(pid, to, &Request::JournalWrites { path });
}

/// How a kept checkpoint is saved once its job runs again: the shadow budget (MiB; `None`: the
/// job's default) and the earlier image whose unchanged chunks it references.
pub type Save = (Option<u64>, Option<String>);

/// Resume of one process: its buffers back from `dir` and its GPU operations let run
/// (`save`: a kept checkpoint saved while the job runs on).
pub fn resume(
    pid: i32,
    to: To<'_>,
    dir: String,
    save: Option<Save>,
) -> Result<Reply<ResumeReply>, JobError> {
    ask_to(pid, to, &resume_request(dir, save))
}

/// [`resume`] sent without waiting for the answer: for a job that cannot answer now (stopped
/// by CRIU, which lets it run only after the sender is done) and answers once it runs.
pub fn resume_sent(pid: i32, to: To<'_>, dir: String) -> Result<(), JobError> {
    send_to(pid, to, &resume_request(dir, None))
}

fn resume_request(dir: String, save: Option<Save>) -> Request {
    match save {
        Some((shadow_mib, parent)) => Request::ResumeAndSave {
            dir,
            shadow_mib,
            parent,
        },
        None => Request::Resume { dir: Some(dir) },
    }
}

/// The figures of process `pid`'s restore once it has finished reading its images (`possum
/// status`'s `session.last.restore`), asked until then, at most `limit`; `None` if it did not
/// say by then or stopped answering (it ended).
pub(crate) fn finished_restore(
    pid: i32,
    socket_dir: &Path,
    limit: Duration,
) -> Option<serde_json::Value> {
    let t = Instant::now();
    while t.elapsed() < limit {
        let status = possum_control::request_typed::<possum_control::reply::StatusReply>(
            u32::try_from(pid).ok()?,
            socket_dir,
            &possum_control::Request::Status,
            limit
                .saturating_sub(t.elapsed())
                .clamp(Duration::from_millis(100), Duration::from_secs(10)),
        )
        .ok()?;
        let last = status
            .possum
            .and_then(|p| p.session)
            .and_then(|s| s.last.restore);
        if last.is_some() {
            return last;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::sync::{Arc, Mutex};

    /// Each step sends its request, through the socket directory or at the socket's path, and
    /// reads the job's reply as its type; a job's error keeps the control client's text.
    #[test]
    fn the_per_process_steps_send_their_requests() {
        let tmp = tempfile::tempdir().unwrap();
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = Arc::clone(&seen);
        let handler = move |req: Request| {
            log.lock().unwrap().push(format!("{req:?}"));
            match req {
                Request::Release => serde_json::json!({"error": "release refused"}),
                Request::Checkpoint { .. } => serde_json::json!({"kept": false}),
                _ => serde_json::json!({}),
            }
        };
        let _server = possum_control::Server::start(tmp.path(), Arc::new(handler)).unwrap();
        let me = std::process::id() as i32;
        let path = possum_control::socket_path(tmp.path(), me as u32);
        let at = To::Socket {
            path: &path,
            dir: None,
        };
        let by_dir = To::Sockets(tmp.path());

        assert!(
            !precopy(me, at, "/i/gpu".into(), false, None)
                .unwrap()
                .body
                .kept
        );
        precopy(me, by_dir, "/i/gpu".into(), true, Some("/p/gpu".into())).unwrap();
        let e = cut(me, by_dir, (None, None)).unwrap_err();
        assert!(matches!(e, JobError::Failed { .. }), "{e}");
        assert_eq!(
            e.into_control().to_string(),
            "possum in the job answered with an error: release refused"
        );
        cut(me, at, (Some(30), None)).unwrap();
        resume(me, by_dir, "/i/gpu".into(), Some((Some(64), None))).unwrap();
        resume(me, at, "/i/gpu".into(), None).unwrap();
        resume_sent(me, by_dir, "/i/gpu".into()).unwrap();
        let t = std::time::Instant::now();
        while seen.lock().unwrap().len() < 7 {
            assert!(t.elapsed() < Duration::from_secs(10), "no resume arrived");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            *seen.lock().unwrap(),
            [
                "Checkpoint { dir: \"/i/gpu\", parent: None }",
                "CheckpointKept { dir: \"/i/gpu\", parent: Some(\"/p/gpu\") }",
                "Release",
                "ReleaseKeeping { hold_secs: 30 }",
                "ResumeAndSave { dir: \"/i/gpu\", shadow_mib: Some(64), parent: None }",
                "Resume { dir: Some(\"/i/gpu\") }",
                "Resume { dir: Some(\"/i/gpu\") }",
            ]
        );
    }

    /// Each control error says what to do once, and a process that has possum but no socket yet
    /// is not told to use the driver engine.
    #[test]
    fn job_errors_say_what_to_do() {
        let path = PathBuf::from("/s/possum-7.sock");
        // Whether the error of process 7 is that it is without possum, and what it says.
        let of = |e: ControlError| {
            let e = JobError::of(7, e);
            (e.is_without_possum(), e.to_string())
        };
        let (without, t) = of(ControlError::NotLoaded {
            pid: 7,
            path: path.clone(),
        });
        assert!(without);
        assert_eq!(t.matches("does not have possum loaded").count(), 1, "{t}");
        assert!(
            t.ends_with("or checkpoint it without possum with `--engine driver`"),
            "{t}"
        );
        let (without, t) = of(ControlError::NotStarted {
            pid: 7,
            path: path.clone(),
        });
        assert!(without);
        assert!(
            t.contains("has not used the GPU yet") && !t.contains("--engine"),
            "{t}"
        );
        let (without, t) = of(ControlError::Stale { pid: 7, path });
        assert!(!without);
        assert!(t.contains("possum does not answer in process 7"), "{t}");
        let e = JobError::of(7, ControlError::Remote("busy".into()));
        assert_eq!(
            e.to_string(),
            "process 7: possum in the job answered with an error: busy"
        );
        // The control error is part of the message, not a source printed again after it.
        assert!(std::error::Error::source(&e).is_none());
    }
}
