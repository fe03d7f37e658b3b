//! The protocol itself: its version, where a job's socket is, the requests and the error reply.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The version of the requests and replies between `possum` and a job's libpossum.so, raised
/// whenever either changes in a way the other side could misread. Every reply carries it
/// (`"protocol"`, added by [`Server`](crate::Server)); a client refuses a reply of another version, or of none
/// (a library older than the versioned protocol), naming both, before it reads anything else
/// ([`ControlError::Version`](crate::ControlError::Version)).
pub const PROTOCOL: u64 = 1;

/// The environment variable naming the socket directory.
pub const SOCKET_DIR_ENV: &str = "POSSUM_SOCKET_DIR";

/// The socket directory when `$POSSUM_SOCKET_DIR` is unset or empty.
pub const DEFAULT_SOCKET_DIR: &str = "/tmp/possum";

/// The longest request line the server reads, newline excluded.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// `$POSSUM_SOCKET_DIR` if set and non-empty, else `/tmp/possum`.
pub fn socket_dir() -> PathBuf {
    match std::env::var_os(SOCKET_DIR_ENV) {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(DEFAULT_SOCKET_DIR),
    }
}

/// The control socket of process `pid`: `dir/possum-<pid>.sock`.
pub fn socket_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("possum-{pid}.sock"))
}

/// What the client asks, sent as `{"cmd": "<name>", ...fields}`.
///
/// To add a request, add a variant: a unit variant for a bare command, a struct variant for one
/// with arguments (its fields sit beside `cmd`). The enum is deliberately not `#[non_exhaustive]`,
/// so the compiler points at every handler that must answer the new command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Request {
    /// Is anyone there? Any non-error reply means yes.
    Ping,
    /// What possum manages in the job.
    Status,
    /// The kernel/buffer DAG and per-kernel statistics (JSON; DOT in a `"dot"` string field).
    Trace,
    /// Save every managed buffer as it is at one instant (T0) while the job runs on: one engine
    /// image per device at `dir/gpu-<ordinal>`. Answers when the images are committed.
    Checkpoint {
        /// Directory of the images (created; must not hold them already).
        dir: String,
        /// An earlier image directory of this job (as `dir` was for it): the chunks it holds
        /// unchanged are referenced from there instead of copied (absent: none).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent: Option<String>,
    },
    /// Another pre-copy round into the images `Checkpoint` opened, the job running: the buffers
    /// written since the previous round copied again (answered like `Checkpoint`: each device's
    /// bytes, and the buffers written again meanwhile). An error if no pre-copied checkpoint is
    /// open (a kept one, or one whose job is held whole).
    PrecopyRound,
    /// Hold every GPU operation of the job and drop its buffers' physical memory (addresses kept).
    /// Answers when nothing of the job runs on the GPU any more; the connection is closed first.
    Release,
    /// For the next copy into a checkpoint's images only (the first pre-copy round a
    /// `Checkpoint` makes, or the final copy of a `Release` or `ReleaseKeeping`): each chunk it
    /// writes into a data file of the images is also recorded, once its bytes are there, in the
    /// file `path`
    /// (created if need be, appended to), as the engine's `JournalRecord`s: a migration sends
    /// those bytes while the copy goes on. Answers at once
    /// ([`reply::JournalReply`](crate::reply::JournalReply)).
    JournalWrites {
        /// The journal: a file of its own, not one of the images' files.
        path: String,
    },
    /// `Release` for a checkpoint after which the job is killed: the same T0, final copy and
    /// commit; then each engine whose buffer memory is a keeper's detaches its buffers instead
    /// of freeing them, the memory kept by the keeper `hold_secs` after the job is gone, so that
    /// a restore of the image on this host maps it instead of copying (others release).
    ReleaseKeeping {
        /// How long the keeper keeps the memory once the job is gone.
        hold_secs: u64,
    },
    /// Detach CUPTI from the job (`attach: false`) or attach it again (diagnostics: whether NVIDIA's
    /// driver checkpoint accepts the process without CUPTI).
    Cupti {
        /// Attach (true) or detach (false).
        attach: bool,
    },
    /// Bring the buffers back from the images under `dir` (on demand: an operation waits only for
    /// the buffers it touches) and let the job's operations run again. `dir` may be absent only
    /// when nothing is released.
    Resume {
        /// The directory given to `Checkpoint`.
        dir: Option<String>,
    },
    /// Like `Checkpoint`, for a checkpoint after which the job runs on: where the job's buffer
    /// memory is kept by a keeper, nothing is copied before the release (the reply says
    /// `"kept": true`): `Release` then only detaches the buffers (their memory stays on the
    /// GPU), and `ResumeAndSave` saves them as they were at the release while the job runs on.
    /// Where it is not kept, this is `Checkpoint` (`"kept": false`).
    CheckpointKept {
        /// Directory of the images.
        dir: String,
        /// As `Checkpoint`'s (for a kept checkpoint, used by `ResumeAndSave`'s save).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent: Option<String>,
    },
    /// `Resume`, and for a kept checkpoint: start saving the buffers, as they were at the
    /// release, into the images under `dir` while the job runs (`Saved` waits for it).
    ResumeAndSave {
        /// The directory given to `CheckpointKept`.
        dir: String,
        /// Device memory the save may use for shadow copies, MiB (`possum checkpoint
        /// --shadow-budget`); absent: the job's default (`POSSUM_SHADOW_MIB`, else three
        /// quarters of what is free beyond 4 GiB).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shadow_mib: Option<u64>,
        /// As `Checkpoint`'s: the earlier image the save references unchanged chunks from.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent: Option<String>,
    },
    /// Waits until the saving `ResumeAndSave` started is done and its images committed; answers
    /// its figures (an error if it failed, or if none was started).
    Saved,
    /// For a cut across the ranks of a job: hold the job's collective launches (NCCL's kernels)
    /// numbered `at` and after, counted from the job's first (absent: from the next one). A
    /// launch held waits before it is admitted, so it holds nothing a `Release` waits for. The
    /// barrier lifts itself after `lease_ms` unless the job's operations are paused by then
    /// (a `Release` came); a `Resume` or `CollectiveLift` lifts it. Answers at once
    /// ([`reply::CollectiveReply`](crate::reply::CollectiveReply)); an error if `at` is below what the job launched already.
    CollectiveHold {
        /// The first collective launch held (absent: the next one).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        at: Option<u64>,
        /// How long the barrier holds without a `Release`, ms.
        lease_ms: u64,
    },
    /// Waits until the job has launched `at` collectives, at most `timeout_ms`; answers the
    /// counts either way ([`reply::CollectiveReply`](crate::reply::CollectiveReply): `launched` below `at` is a timeout).
    CollectiveWait {
        /// The number of collective launches waited for.
        at: u64,
        /// How long to wait, ms.
        timeout_ms: u64,
    },
    /// Lifts the collective barrier, if any: the held launches go on.
    CollectiveLift,
}

impl Request {
    /// The image directory the request names, if any (`checkpoint`, `resume`).
    pub fn dir_mut(&mut self) -> Option<&mut String> {
        match self {
            Request::Checkpoint { dir, .. }
            | Request::CheckpointKept { dir, .. }
            | Request::ResumeAndSave { dir, .. }
            | Request::Resume { dir: Some(dir) } => Some(dir),
            _ => None,
        }
    }
}

/// The error reply `{"error": msg}`.
pub fn error_reply(msg: impl Into<String>) -> serde_json::Value {
    serde_json::json!({ "error": msg.into() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_tagged_by_cmd() {
        assert_eq!(
            serde_json::to_string(&Request::Trace).unwrap(),
            r#"{"cmd":"trace"}"#
        );
        let r: Request = serde_json::from_str(r#"{"cmd":"status"}"#).unwrap();
        assert_eq!(r, Request::Status);
        assert!(serde_json::from_str::<Request>(r#"{"cmd":"frobnicate"}"#).is_err());
        let r: Request = serde_json::from_str(r#"{"cmd":"checkpoint","dir":"/x"}"#).unwrap();
        assert_eq!(
            r,
            Request::Checkpoint {
                dir: "/x".into(),
                parent: None
            }
        );
        assert_eq!(
            serde_json::to_string(&Request::Resume { dir: None }).unwrap(),
            r#"{"cmd":"resume","dir":null}"#
        );
        // A shadow budget is optional: a request without one (an older possum) still parses.
        let r: Request = serde_json::from_str(r#"{"cmd":"resume_and_save","dir":"/x"}"#).unwrap();
        let plain = Request::ResumeAndSave {
            dir: "/x".into(),
            shadow_mib: None,
            parent: None,
        };
        assert_eq!(r, plain);
        assert_eq!(
            serde_json::to_string(&plain).unwrap(),
            r#"{"cmd":"resume_and_save","dir":"/x"}"#
        );
        let budget = Request::ResumeAndSave {
            dir: "/x".into(),
            shadow_mib: Some(0),
            parent: None,
        };
        let text = serde_json::to_string(&budget).unwrap();
        assert_eq!(serde_json::from_str::<Request>(&text).unwrap(), budget);
    }

    #[test]
    fn socket_path_names_the_pid() {
        assert_eq!(
            socket_path(Path::new("/x"), 42),
            PathBuf::from("/x/possum-42.sock")
        );
    }
}
