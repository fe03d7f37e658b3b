//! The on-disk image format. See docs/image-format.md.
//!
//! (Being written: see `ImageWriter` / `Image` in this module once it lands.)

use std::path::PathBuf;

/// Everything that can be wrong with an image, or with writing one.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A chunk for a buffer that was never declared.
    #[error("chunk for unknown buffer {buffer}")]
    UnknownBuffer {
        /// The buffer id.
        buffer: u64,
    },
    /// A chunk that does not fit inside its buffer.
    #[error(
        "chunk of buffer {buffer} at offset {offset} with length {len} lies outside the buffer"
    )]
    ChunkOutOfRange {
        /// The buffer id.
        buffer: u64,
        /// The chunk's offset.
        offset: u64,
        /// The chunk's length.
        len: u64,
    },
    /// No chunk at the place asked for.
    #[error("no chunk of buffer {buffer} at offset {offset}")]
    MissingChunk {
        /// The buffer id.
        buffer: u64,
        /// The offset asked for.
        offset: u64,
    },
    /// An I/O error on a file of the image.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}
