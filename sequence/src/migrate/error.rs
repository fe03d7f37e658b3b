//! What a failed migration says: the phase that failed and what became of the job (part of
//! [`super`]).

use std::io;
use std::path::{Path, PathBuf};

use crate::checkpoint::{CheckpointError, CheckpointParams};
use crate::wire::{self, HandoffError, WireError};

/// What became of the job when a migration failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobAt {
    /// It runs on at the source (it was let go, or restored there from the local image).
    Source,
    /// The destination was told to let it run, and then went silent: it runs there if the go
    /// arrived; otherwise the destination killed its copy before it ran. The source's image is
    /// kept, not restored.
    Unknown {
        /// The local image.
        image: PathBuf,
        /// The job's socket directory, for its restore, when it is not possum's by default.
        socket_dir: Option<PathBuf>,
    },
    /// Post-copy: the destination went silent once it ran the job, its pieces all sent: it
    /// runs there if they all came (otherwise the destination killed it). The source's image is
    /// kept, not restored.
    PostCopyUnknown {
        /// The local image.
        image: PathBuf,
        /// The job's socket directory, for its restore, when it is not possum's by default.
        socket_dir: Option<PathBuf>,
    },
    /// Neither end runs it: its image is kept at the source.
    Lost {
        /// The local image.
        image: PathBuf,
        /// The job's socket directory, for its restore, when it is not possum's by default.
        socket_dir: Option<PathBuf>,
        /// Why it could not be brought back.
        why: String,
    },
}

impl JobAt {
    /// The job is not brought back at the source (`why`), whose checkpoint `c` kept its image.
    pub(super) fn lost(c: &CheckpointParams, why: String) -> JobAt {
        JobAt::Lost {
            image: c.dir.clone(),
            socket_dir: restore_socket_dir(c),
            why,
        }
    }
}

/// The socket directory a restore of the image `c` kept must be given: the one the checkpoint
/// reached the job in, unless it is possum's by default.
pub(super) fn restore_socket_dir(c: &CheckpointParams) -> Option<PathBuf> {
    let by_default = std::path::absolute(possum_control::socket_dir()).ok();
    let used = std::path::absolute(&c.sockets).unwrap_or_else(|_| c.sockets.clone());
    (by_default.as_ref() != Some(&used)).then_some(used)
}

/// `possum restore` of `image`, with `--socket-dir` if it needs one.
fn restore_command(image: &Path, socket_dir: Option<&Path>) -> String {
    match socket_dir {
        Some(d) => format!(
            "possum restore -D {} --socket-dir {}",
            image.display(),
            d.display()
        ),
        None => format!("possum restore -D {}", image.display()),
    }
}

impl std::fmt::Display for JobAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobAt::Source => f.write_str("the job runs on at the source"),
            JobAt::Unknown { image, socket_dir } => write!(
                f,
                "the destination was told to let the job run and then went silent: the job runs \
                 there if that reached it (otherwise the destination killed its copy before it \
                 ran); it is not restored here, to never run twice: its image is kept, and `{}` \
                 restores it once the destination is known not to run it",
                restore_command(image, socket_dir.as_deref())
            ),
            JobAt::PostCopyUnknown { image, socket_dir } => write!(
                f,
                "the job runs at the destination if every piece of its post-copy came there \
                 (otherwise the destination killed it); it is not restored here, to never run \
                 twice: its image is kept, and `{}` restores it once the destination is known \
                 not to run it",
                restore_command(image, socket_dir.as_deref())
            ),
            JobAt::Lost {
                image,
                socket_dir,
                why,
            } => write!(
                f,
                "the job could not be brought back at the source ({why}): its image is kept, \
                 `{}` restores it",
                restore_command(image, socket_dir.as_deref())
            ),
        }
    }
}

/// A migration that failed, by the phase that failed, with what became of the job.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// The checkpoint at the source (its guard let the job run on).
    #[error("migration failed at the checkpoint; the job runs on at the source")]
    Checkpoint(#[source] Box<CheckpointError>),
    /// The connection to the destination.
    #[error("migration failed connecting to {to}; {job}")]
    Connect {
        /// The destination.
        to: String,
        /// What became of the job.
        job: JobAt,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The handshake or the transfer (a wrong key, a receiver's abort, a full disk there).
    #[error("migration failed sending the image to {to}; {job}")]
    Send {
        /// The destination.
        to: String,
        /// What became of the job.
        job: JobAt,
        /// Why.
        #[source]
        source: Box<WireError>,
    },
    /// Killing the held job at the source once the destination had the image.
    #[error("migration failed killing the job at the source; {job}")]
    Kill {
        /// What became of the job.
        job: JobAt,
        /// Why.
        #[source]
        source: Box<CheckpointError>,
    },
    /// `Released`, or the destination's `Outcome` (not in time, a dropped connection).
    #[error("migration failed waiting for the destination's restore; {job}")]
    Handoff {
        /// What became of the job.
        job: JobAt,
        /// Why.
        #[source]
        source: HandoffError,
    },
    /// The pieces left for post-copy could not all be sent after the job ran at the
    /// destination (which kills its copy once it waited [`POST_COPY_LEASE`] for them).
    #[error("migration failed sending the post-copy after the job ran at the destination; {job}")]
    PostCopy {
        /// What became of the job.
        job: JobAt,
        /// Why.
        #[source]
        source: Box<wire::SendError>,
    },
    /// The destination went silent once the job ran there, its post-copy sent.
    #[error("migration failed: the destination went silent during the post-copy ({why}); {job}")]
    PostCopySilent {
        /// What became of the job.
        job: JobAt,
        /// What was heard, or not.
        why: String,
    },
    /// Post-copy was asked of a session of one stream.
    #[error(
        "--post-copy needs two streams or more (--streams {streams} was given); nothing was done"
    )]
    PostCopyStreams {
        /// The streams asked.
        streams: u32,
    },
    /// The destination could not restore the job.
    #[error("migration failed: the destination could not restore the job ({reason}); {job}")]
    RemoteRestore {
        /// Why, as the destination said.
        reason: String,
        /// What became of the job.
        job: JobAt,
    },
}

impl MigrateError {
    /// What became of the job.
    pub fn job(&self) -> JobAt {
        match self {
            MigrateError::Checkpoint(_) | MigrateError::PostCopyStreams { .. } => JobAt::Source,
            MigrateError::Connect { job, .. }
            | MigrateError::Send { job, .. }
            | MigrateError::Kill { job, .. }
            | MigrateError::Handoff { job, .. }
            | MigrateError::PostCopy { job, .. }
            | MigrateError::PostCopySilent { job, .. }
            | MigrateError::RemoteRestore { job, .. } => job.clone(),
        }
    }
}
