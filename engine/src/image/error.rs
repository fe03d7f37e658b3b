//! What can be wrong with an image, or with writing one.

use std::path::PathBuf;

use super::format::FORMAT_MAJOR;
#[cfg(doc)]
use super::format::{MAX_CHUNK_LEN, MAX_MANIFEST_LEN};
use crate::fingerprint::Fingerprint;

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
    /// The directory has no manifest.
    #[error("image {image}: manifest.pb missing: not a possum image or an incomplete one")]
    ManifestMissing {
        /// The image directory.
        image: PathBuf,
    },
    /// The manifest does not start with the magic bytes.
    #[error("image {image}: manifest.pb does not start with \"POSSUMIM\" (found {found:02x?}): not a possum image")]
    BadMagic {
        /// The image directory.
        image: PathBuf,
        /// The bytes found instead.
        found: Vec<u8>,
    },
    /// The image was written in a format major version this build cannot read.
    #[error(
        "image {image}: format version {major}.{minor} not supported (this possum reads {}.x)",
        FORMAT_MAJOR
    )]
    UnsupportedVersion {
        /// The image directory.
        image: PathBuf,
        /// The image's major version.
        major: u32,
        /// The image's minor version.
        minor: u32,
    },
    /// The manifest's header announces a payload larger than [`MAX_MANIFEST_LEN`].
    #[error("image {image}: manifest.pb claims a {len}-byte manifest, more than the {max}-byte limit: corrupt")]
    ManifestTooLarge {
        /// The image directory.
        image: PathBuf,
        /// The length announced.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The manifest file is shorter than its header says.
    #[error("image {image}: manifest.pb truncated: {actual} bytes, expected {expected}")]
    ManifestTruncated {
        /// The image directory.
        image: PathBuf,
        /// The length the file should have.
        expected: u64,
        /// The length it has.
        actual: u64,
    },
    /// The manifest file is longer than its header says.
    #[error(
        "image {image}: manifest.pb has {actual} bytes, expected {expected}: trailing garbage"
    )]
    ManifestTrailingBytes {
        /// The image directory.
        image: PathBuf,
        /// The length the file should have.
        expected: u64,
        /// The length it has.
        actual: u64,
    },
    /// The manifest's checksum does not match its contents.
    #[error("image {image}: manifest.pb: checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    ManifestChecksum {
        /// The image directory.
        image: PathBuf,
        /// The checksum stored in the file.
        stored: u32,
        /// The checksum of the bytes read.
        computed: u32,
    },
    /// The manifest's payload is not a valid `Manifest` message.
    #[error("image {image}: manifest.pb: cannot decode the manifest: {source}")]
    ManifestDecode {
        /// The image directory.
        image: PathBuf,
        /// The decoder's complaint.
        source: prost::DecodeError,
    },
    /// The manifest contradicts itself (header and payload versions differ, a name is invalid, ...).
    #[error("image {image}: manifest.pb: {problem}")]
    ManifestInvalid {
        /// The image directory.
        image: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// Two buffers share an id.
    #[error("image {image}: buffer {buffer} declared twice")]
    DuplicateBuffer {
        /// The image directory.
        image: PathBuf,
        /// The buffer id.
        buffer: u64,
    },
    /// A chunk refers to a buffer the manifest does not declare.
    #[error("image {image}: chunk at offset {offset} refers to undeclared buffer {buffer}")]
    ChunkUnknownBuffer {
        /// The image directory.
        image: PathBuf,
        /// The buffer id.
        buffer: u64,
        /// The chunk's offset.
        offset: u64,
    },
    /// A chunk refers to a data file the manifest does not list.
    #[error("image {image}: chunk of buffer {buffer} at offset {offset} refers to data file #{file}, which is not listed")]
    ChunkUnknownFile {
        /// The image directory.
        image: PathBuf,
        /// The buffer id.
        buffer: u64,
        /// The chunk's offset.
        offset: u64,
        /// The data file index.
        file: u32,
    },
    /// A chunk is empty or larger than [`MAX_CHUNK_LEN`].
    #[error("image {image}: chunk of buffer {buffer} at offset {offset} has length {len} (must be 1 ..= {max})")]
    ChunkBadLength {
        /// The image directory (the final directory when writing).
        image: PathBuf,
        /// The buffer id.
        buffer: u64,
        /// The chunk's offset.
        offset: u64,
        /// The chunk's length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A chunk's bytes lie (partly) past the declared length of its data file.
    #[error("image {image}: {file}: chunk of buffer {buffer} at offset {offset} lies at file bytes {file_offset}+{len}, past the file's declared length {file_len}")]
    ChunkOutsideFile {
        /// The image directory.
        image: PathBuf,
        /// The data file's name.
        file: String,
        /// The buffer id.
        buffer: u64,
        /// The chunk's offset.
        offset: u64,
        /// Where the chunk starts in the file.
        file_offset: u64,
        /// The chunk's length.
        len: u64,
        /// The file's declared length.
        file_len: u64,
    },
    /// A buffer's chunks do not cover it exactly.
    #[error("image {image}: buffer {buffer}: {problem}")]
    BadCoverage {
        /// The image directory (the final directory when writing).
        image: PathBuf,
        /// The buffer id.
        buffer: u64,
        /// What is wrong, with the offset.
        problem: CoverageError,
    },
    /// A data file listed in the manifest is not there.
    #[error("image {image}: {file} missing")]
    DataFileMissing {
        /// The image directory.
        image: PathBuf,
        /// The data file's name.
        file: String,
    },
    /// A data file is shorter than the manifest says.
    #[error("image {image}: {file} truncated: {actual} bytes, expected at least {expected}")]
    DataFileTruncated {
        /// The image directory.
        image: PathBuf,
        /// The data file's name.
        file: String,
        /// The length the manifest records.
        expected: u64,
        /// The length the file has.
        actual: u64,
    },
    /// A chunk's bytes do not match its checksum.
    #[error("image {image}: {file}: checksum mismatch in buffer {buffer} at offset {offset}")]
    ChecksumMismatch {
        /// The image directory.
        image: PathBuf,
        /// The data file's name.
        file: String,
        /// The buffer id.
        buffer: u64,
        /// The chunk's offset in the buffer.
        offset: u64,
    },
    /// A chunk's bytes do not match its recorded fingerprint (the CRC matched: the fingerprint
    /// recorded is not that of the bytes saved).
    #[error("image {image}: {file}: fingerprint mismatch in buffer {buffer} at offset {offset}: recorded {recorded}, bytes have {computed}")]
    FingerprintMismatch {
        /// The image directory.
        image: PathBuf,
        /// The data file's name.
        file: String,
        /// The buffer id.
        buffer: u64,
        /// The chunk's offset in the buffer.
        offset: u64,
        /// The fingerprint the manifest records.
        recorded: Fingerprint,
        /// The fingerprint of the bytes read.
        computed: Fingerprint,
    },
    /// A parent image whose data files hold chunks of this image is not there.
    #[error(
        "image {image} refers to chunks of parent image {parent}, which is missing: {problem}"
    )]
    ParentMissing {
        /// The image directory.
        image: PathBuf,
        /// The parent image's directory, as the image locates it.
        parent: PathBuf,
        /// What is missing.
        problem: String,
    },
    /// A parent image whose data files hold chunks of this image is not the one it referred
    /// to when written (replaced, rewritten, truncated, corrupt).
    #[error(
        "image {image} refers to chunks of parent image {parent}, which has changed: {problem}"
    )]
    ParentChanged {
        /// The image directory.
        image: PathBuf,
        /// The parent image's directory, as the image locates it.
        parent: PathBuf,
        /// What differs.
        problem: String,
    },
    /// The parent image given to the writer ([`WriterOptions::parent`](super::WriterOptions::parent)) cannot be opened.
    #[error("image {image}: cannot use parent image {parent}: {source}")]
    ParentUnusable {
        /// The image being written (its final directory).
        image: PathBuf,
        /// The parent image's directory, as given.
        parent: PathBuf,
        /// Why.
        #[source]
        source: Box<ImageError>,
    },
    /// The image would be written over its parent image (or a directory holding it, or one of
    /// the parent's own parents), whose files it refers to.
    #[error("image {image} cannot be written over its parent image {parent}: its chunks would refer to the image it replaces (write it under another name)")]
    ParentIsTarget {
        /// The image being written (its final directory).
        image: PathBuf,
        /// The parent (or earlier) image inside it.
        parent: PathBuf,
    },
    /// The final directory exists and is not empty, and replacing it was not asked for.
    #[error("image {image} already exists and is not empty (pass force to replace it)")]
    AlreadyExists {
        /// The final directory.
        image: PathBuf,
    },
    /// A commit of an image a write into which failed, or wrote a chunk other than the one
    /// expected (its fingerprint not the job's at T0): its data files may hold bytes no record
    /// describes.
    #[error(
        "image {image}: not committed: a chunk written into it failed or was not the job's at          the checkpoint"
    )]
    Spoiled {
        /// The final directory.
        image: PathBuf,
    },
}

impl ImageError {
    /// An [`ImageError::Io`] for `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ImageError::Io {
            path: path.into(),
            source,
        }
    }
}

/// Why a buffer's chunks do not cover it exactly (see [`check_coverage`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CoverageError {
    /// No chunk holds the bytes `start .. end`.
    #[error("no chunk holds bytes {start}..{end}")]
    Gap {
        /// First byte not covered.
        start: u64,
        /// One past the last byte not covered.
        end: u64,
    },
    /// The chunk at `offset` starts before the previous one (in offset order) ends at `prev_end`.
    #[error("chunk at offset {offset} overlaps the previous chunk, which ends at {prev_end}")]
    Overlap {
        /// The offending chunk's offset.
        offset: u64,
        /// Where the previous chunk ends.
        prev_end: u64,
    },
    /// The chunk at `offset` ends past the buffer's end.
    #[error("chunk at offset {offset} with length {len} ends past the buffer's end {size}")]
    PastEnd {
        /// The chunk's offset.
        offset: u64,
        /// The chunk's length.
        len: u64,
        /// The buffer's size.
        size: u64,
    },
    /// The chunk at `offset` has length zero.
    #[error("chunk at offset {offset} is empty")]
    Empty {
        /// The chunk's offset.
        offset: u64,
    },
}
