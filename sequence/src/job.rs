//! Asking a job's possum (its control socket), with what the user should do when it cannot.

use std::path::Path;
use std::time::Duration;

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// Each control error says what to do once, and a process that has possum but no socket yet
    /// is not told to use the driver engine.
    #[test]
    fn job_errors_say_what_to_do() {
        let path = PathBuf::from("/s/possum-7.sock");
        let e = JobError::of(
            7,
            ControlError::NotLoaded {
                pid: 7,
                path: path.clone(),
            },
        );
        assert!(e.is_without_possum());
        let t = e.to_string();
        assert_eq!(t.matches("does not have possum loaded").count(), 1, "{t}");
        assert!(
            t.ends_with("or checkpoint it without possum with `--engine driver`"),
            "{t}"
        );
        let e = JobError::of(
            7,
            ControlError::NotStarted {
                pid: 7,
                path: path.clone(),
            },
        );
        assert!(e.is_without_possum());
        let t = e.to_string();
        assert!(
            t.contains("has not used the GPU yet") && !t.contains("--engine"),
            "{t}"
        );
        let e = JobError::of(7, ControlError::Stale { pid: 7, path });
        assert!(!e.is_without_possum());
        assert!(e
            .to_string()
            .contains("possum does not answer in process 7"));
        let e = JobError::of(7, ControlError::Remote("busy".into()));
        assert_eq!(
            e.to_string(),
            "process 7: possum in the job answered with an error: busy"
        );
        // The control error is part of the message, not a source printed again after it.
        assert!(std::error::Error::source(&e).is_none());
    }
}
