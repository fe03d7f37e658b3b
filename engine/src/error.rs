//! The engine's errors.

use crate::device::{DevPtr, DeviceError};
use crate::image::ImageError;

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The device failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// Reading or writing the image failed.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// An address that is not a managed buffer's start.
    #[error("no managed buffer starts at {0}")]
    UnknownBuffer(DevPtr),
    /// Another operation is in progress.
    #[error("cannot {wanted}: a {current} is in progress")]
    Busy {
        /// What was asked for.
        wanted: &'static str,
        /// What is going on.
        current: &'static str,
    },
    /// An operation touched a released buffer while no restore was running.
    #[error("buffer {id} at {va} was released and no restore is in progress")]
    Released {
        /// The buffer.
        id: u64,
        /// Its address.
        va: DevPtr,
    },
    /// The image does not fit this job's buffers.
    #[error("image does not match this job: buffer {id}: {why}")]
    ImageMismatch {
        /// The image's buffer id.
        id: u64,
        /// What does not match.
        why: String,
    },
    /// A buffer could not be restored.
    #[error("restoring buffer {id} ({size} bytes at {va}) failed: {source}")]
    RestoreBuffer {
        /// The buffer.
        id: u64,
        /// Its address.
        va: DevPtr,
        /// Its size.
        size: u64,
        /// Why.
        source: Box<EngineError>,
    },
    /// A checkpoint or restore failed earlier; this is its first error.
    #[error("{0}")]
    Failed(String),
    /// A chunk the checkpoint copied is not the chunk at T0 (its fingerprint differs): the job
    /// wrote it before it was saved, unforeseen (a write set speculated wrongly). The image is
    /// not to be committed; a new checkpoint, with the writes made strict, is.
    #[error(
        "checkpoint not committed: {chunks} chunk(s) changed before they were saved, the first \
         at offset {offset} of buffer {buffer} (an unforeseen write; take the checkpoint again)"
    )]
    Mismatch {
        /// The first such chunk's buffer.
        buffer: u64,
        /// Its offset.
        offset: u64,
        /// How many chunks did not match.
        chunks: u64,
    },
}

/// Words every [`EngineError::Mismatch`] says, so that a caller that gets the error as text (over
/// a control socket) knows it for one.
pub const MISMATCH_TEXT: &str = "changed before they were saved";
