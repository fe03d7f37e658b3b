//! Why a request to a job failed.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use crate::dir::DirError;
use crate::protocol::PROTOCOL;

/// Why a request to a job failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// `/proc/<pid>` does not exist.
    #[error("no process with pid {0}")]
    NoProcess(u32),
    /// The process exists but has no control socket.
    #[error(
        "process {pid} does not have possum loaded: no control socket at {}; start the job with `possum run JOB` or LD_PRELOAD=/path/to/libpossum.so (its socket appears at its first CUDA call)",
        path.display()
    )]
    NotLoaded {
        /// The process.
        pid: u32,
        /// Where its socket would be.
        path: PathBuf,
    },
    /// The process has libpossum.so loaded but no control socket yet: the socket appears at the
    /// job's first CUDA call, and it has made none.
    #[error(
        "process {pid} runs with possum but has not used the GPU yet: its control socket {} appears at its first CUDA call; ask again once the job has started using CUDA",
        path.display()
    )]
    NotStarted {
        /// The process.
        pid: u32,
        /// Where its socket will be.
        path: PathBuf,
    },
    /// The socket file exists but nobody accepts connections on it.
    #[error(
        "control socket {} of process {pid} refuses connections: it is stale (left by an exited process that had this pid, or possum's server in the job has stopped)",
        path.display()
    )]
    Stale {
        /// The process.
        pid: u32,
        /// The socket file.
        path: PathBuf,
    },
    /// No complete reply within the timeout.
    #[error("process {pid} did not answer within {} s", timeout.as_secs_f64())]
    Timeout {
        /// The process.
        pid: u32,
        /// The time allowed.
        timeout: Duration,
    },
    /// Another I/O failure on the socket.
    #[error("control socket {}", path.display())]
    Io {
        /// The socket.
        path: PathBuf,
        /// What failed.
        #[source]
        source: io::Error,
    },
    /// The socket directory breaks the rule ([`crate::secure_dir`]): the socket in it is not
    /// asked.
    #[error(transparent)]
    Dir(#[from] DirError),
    /// The socket is served by another process than the one asked.
    #[error(
        "the socket at {} is served by {}, not by {pid}: refused",
        path.display(),
        peer_name(*peer)
    )]
    WrongProcess {
        /// The process asked.
        pid: u32,
        /// The socket.
        path: PathBuf,
        /// The process that listens on it (0: one this process cannot name).
        peer: i32,
    },
    /// The socket is served by the process asked, but as another user than the process's.
    #[error(
        "the socket at {} is served as uid {peer_uid}, but process {pid} runs as uid {job_uid}: refused",
        path.display()
    )]
    WrongUser {
        /// The process asked.
        pid: u32,
        /// The socket.
        path: PathBuf,
        /// The user the socket's server listened as.
        peer_uid: u32,
        /// The process's effective uid.
        job_uid: u32,
    },
    /// The reply was not one line of JSON.
    #[error("bad reply on the control socket: {0}")]
    Protocol(String),
    /// The job answered `{"error": ...}`.
    #[error("possum in the job answered with an error: {0}")]
    Remote(String),
    /// The job's libpossum.so speaks another version of the control protocol.
    #[error(
        "the job's libpossum.so speaks control protocol {}, this possum speaks {}: use the possum \
         the job was started with (`possum run`), or start the job again under this one",
        job.map_or_else(|| "none (an older possum)".to_string(), |v| v.to_string()),
        PROTOCOL
    )]
    Version {
        /// The job's version (`None`: its replies carry none).
        job: Option<u64>,
    },
}

/// The process `SO_PEERCRED` names, in words.
fn peer_name(peer: i32) -> String {
    match peer {
        0 => "a process outside this pid namespace".to_string(),
        q => format!("process {q}"),
    }
}
