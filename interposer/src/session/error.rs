//! Why a session step failed: one enum for the steps of a checkpoint session (`checkpoint`,
//! `release`, `resume`, `saved`), each message what the control client prints.

use std::path::PathBuf;

use possum_engine::device::DeviceError;
use possum_engine::image::ImageError;
use possum_engine::EngineError;

use crate::cuda::cupti_sys::CuptiError;
use crate::memory::imports::ImportsError;
use crate::ops::park::ParkError;

/// How many times a held release tries before giving up (each attempt ended by the watchdog).
pub const HOLD_ATTEMPTS: u32 = 3;

/// Why a session step failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Another step runs.
    #[error("possum is busy in this job ({0}); one checkpoint at a time")]
    Busy(&'static str),
    /// A request's image directory is relative.
    #[error(
        "image directory {} is not absolute (a directory passed with the request makes it \
         relative to that one)",
        .0.display()
    )]
    NotAbsolute(PathBuf),
    /// The last kept checkpoint is still being saved.
    #[error(
        "the last checkpoint's buffers are still being saved; try again when `possum \
         checkpoint` has returned"
    )]
    StillSaving,
    /// The A/B test switches the hooks off and on.
    #[error(
        "POSSUM_AB_MS is set: possum's callbacks are switched off and on for an A/B test of \
         their cost, so launches go unseen; no checkpoint of this job"
    )]
    AbTest,
    /// A checkpoint while the job is paused.
    #[error("the job is paused (released): resume it before a new checkpoint")]
    Paused,
    /// A release while the job is paused.
    #[error("the job is already paused (released)")]
    AlreadyPaused,
    /// A pre-copy round without a pre-copied checkpoint.
    #[error(
        "no pre-copied checkpoint open: send checkpoint first (a kept checkpoint, or one whose \
         job is held for the whole copy, takes no rounds)"
    )]
    NoPrecopy,
    /// A release without a checkpoint of every device.
    #[error("no checkpoint in progress for every device: send checkpoint first")]
    NotEveryDevice,
    /// A release without a checkpoint.
    #[error("no checkpoint in progress: send checkpoint first")]
    NoCheckpoint,
    /// The image directory could not be made.
    #[error("{}: {source}", path.display())]
    Dir {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A device's image could not be made.
    #[error("device {device}: {source}")]
    NewImage {
        /// The device.
        device: usize,
        /// Why.
        source: ImageError,
    },
    /// A device's image could not be committed.
    #[error("device {device}: commit: {source}")]
    Commit {
        /// The device.
        device: usize,
        /// Why.
        source: ImageError,
    },
    /// A device's image was still shared with a copy at its commit.
    #[error("device {0}: image writer still shared")]
    WriterShared(usize),
    /// A device's engine failed a step (`what`: the step).
    #[error("device {device}: {what}{source}")]
    Engine {
        /// The device.
        device: usize,
        /// The step, with its separator (`"pre-copy: "`; empty where the error says it).
        what: &'static str,
        /// Why.
        source: EngineError,
    },
    /// A device's queued work could not be waited for.
    #[error("device {device}: waiting for {what}: {source}")]
    Sync {
        /// The device.
        device: usize,
        /// Whose work (`"its queued work"`, `"the job's GPU work"`).
        what: &'static str,
        /// Why.
        source: SyncError,
    },
    /// The write path saw a fault since the checkpoint began.
    #[error(
        "checkpoint undone: {since} fault(s) on the write path since it began (the last: \
         {last}); its image might not hold the buffers as they were at T0, so none is written \
         and the job runs on"
    )]
    FaultsSinceOpen {
        /// How many.
        since: u64,
        /// The last one's description.
        last: String,
    },
    /// The job took writing functions unwrapped while the checkpoint was made.
    #[error(
        "checkpoint undone: while it was being made the job took {} without possum's wrapper, \
         which possum may not see write; send checkpoint again (it holds the job's threads for \
         the whole copy)",
        .0.join(", ")
    )]
    UnwrappedWhileMade(Vec<String>),
    /// The job took writing functions unwrapped since a kept checkpoint began.
    #[error(
        "checkpoint undone: since it began the job took {} without possum's wrapper, so possum \
         may not see what it writes; send checkpoint again (it holds the job's threads for the \
         whole copy)",
        .0.join(", ")
    )]
    UnwrappedSinceKept(Vec<String>),
    /// The job shared memory with other processes since a kept checkpoint began.
    #[error(
        "checkpoint undone: since it began the job shared {0} pieces of its memory with other \
         processes (cuMemExportToShareableHandle), whose writes there possum does not see; send \
         checkpoint again (it copies that memory while the job is held)"
    )]
    SharedSinceKept(usize),
    /// The job's threads could not be parked.
    #[error(transparent)]
    Park(#[from] ParkError),
    /// Every hold of the job's threads was ended by the watchdog.
    #[error(
        "cannot hold the job: {HOLD_ATTEMPTS} attempts ended by the watchdog (a thread of the \
         job stayed inside a CUDA call holding a lock possum's copy needs); the job runs on"
    )]
    Watchdog,
    /// Memory other processes shared could not be let go of.
    #[error(transparent)]
    ImportsReleased(ImportsError),
    /// Memory other processes shared could not be mapped again: the job stays paused.
    #[error("{0}; the job stays paused so that it computes nothing wrong")]
    ImportsKeptPaused(ImportsError),
    /// CUPTI could not be detached.
    #[error("detaching CUPTI: {0}")]
    DetachCupti(CuptiError),
    /// A released device's resume names no image directory.
    #[error("device {0}: buffers are released; resume needs the image directory")]
    NeedsImage(usize),
    /// A kept device's memory is gone and no image holds it.
    #[error(
        "device {device}: the GPU buffers of this job were left with its keeper during the \
         checkpoint, and the keeper no longer has them (it ended, or was killed), while no image \
         holds them ({source}): the job's GPU state is lost; it stays paused so that it computes \
         nothing wrong (end it, and restore it from an earlier image)"
    )]
    KeptMemoryLost {
        /// The device.
        device: usize,
        /// Why its image could not be opened.
        source: ImageError,
    },
    /// A released device's image could not be opened.
    #[error("device {device}: cannot open its image: {source}")]
    OpenImage {
        /// The device.
        device: usize,
        /// Why.
        source: ImageError,
    },
    /// `Saved` without a save.
    #[error("no save was started in this job")]
    NoSave,
    /// The save failed (its reason, as logged when it did).
    #[error("{0}")]
    SaveFailed(String),
    /// A front end refused the step (its reason).
    #[error("{0}")]
    Refused(String),
}

/// Why a device's queued work could not be waited for.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// Its engine's device.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Its primary context (a device possum does not manage).
    #[error(transparent)]
    Context(#[from] DeviceError),
}
