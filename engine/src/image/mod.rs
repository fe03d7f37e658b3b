//! The on-disk image format. The full description is in `docs/image-format.md`; this is a summary.
//!
//! # Layout
//!
//! An image is a **directory**:
//!
//! ```text
//! <image>/
//!   manifest.pb     framed protobuf: buffers, chunks, metadata, data file names and lengths
//!   data-000.bin    chunk bytes, appended by the writer's lanes (one file per lane)
//!   data-001.bin
//!   ...
//! ```
//!
//! `manifest.pb` is framed like this (all integers little endian):
//!
//! ```text
//! offset  size  field
//! ------  ----  -----------------------------------------------------
//!      0     8  magic "POSSUMIM"
//!      8     4  u32 format major version
//!     12     4  u32 format minor version
//!     16     8  u64 payload length N (at most 256 MiB)
//!     24     N  payload: the protobuf `Manifest` message
//!   24+N     4  u32 CRC32C of bytes 0 .. 24+N (header and payload)
//! ```
//!
//! The file is exactly `28 + N` bytes long.
//!
//! # Fingerprints and parent images (format 1.1)
//!
//! Each chunk record (`Chunk`) carries the chunk's [`Fingerprint`](crate::fingerprint) as two
//! optional `fixed64` fields, `fp_lo` (tag 7) and `fp_hi` (tag 8): both or neither (chunks of a
//! 1.0 image have none). [`ImageWriter`] records the one given to
//! [`write_chunk_fp`](crate::store::ChunkSink::write_chunk_fp) or computes it in `write_chunk`;
//! [`Image`] returns it through [`ChunkSource::fingerprint`](crate::store::ChunkSource) and
//! [`Image::verify`] checks it.
//!
//! An image written with [`WriterOptions::parent`] may hold chunks by reference to an earlier
//! image's data files ([`reuse_chunk`](crate::store::ChunkSink::reuse_chunk)): the manifest lists
//! those images (`Manifest.parents`, tag 8: a path relative to the image's directory, `..`
//! components then plain names, and the CRC32C that ends the parent's `manifest.pb`), and a data
//! file names one of them (`DataFile.parent`, tag 3); its name stays a plain name, resolved in
//! that image's directory. A chunk the parent held by reference points at the original file.
//! [`Image::open`] opens a parent's file only if the parent's manifest is the recorded one, valid,
//! and lists it. An image is never written over its parent (refused by
//! [`ImageWriter::create`]).
//!
//! # Writing
//!
//! [`ImageWriter`] writes into a temporary sibling directory (`.<name>.tmp-<pid>-<nonce>`), and
//! [`ImageWriter::commit`] writes the manifest, fsyncs everything, and renames the temporary
//! directory to the final name. A crash therefore never leaves a half-written image under the final
//! name. A chunk written again at the same (buffer, offset) supersedes the earlier one: the manifest
//! records only the latest, and the superseded bytes stay in the data file as unreferenced garbage
//! (they cost disk space, nothing else).
//!
//! # Reading
//!
//! [`Image::open`] checks everything that is cheap to check (framing, version, checksum of the
//! manifest, parent images present and unchanged, data files present and long enough, exact chunk
//! coverage of every buffer); [`Image::read_chunk`](crate::store::ChunkSource::read_chunk) checks
//! each chunk's CRC32C as it is read; [`Image::verify`] reads and checks every chunk (CRC32C and
//! fingerprint).
//!
//! # Versioning
//!
//! A reader accepts its own major version with any minor version (minor versions only add fields
//! that older readers may ignore) and refuses any other major version. 1.0 had no fingerprints
//! and no parents; a 1.0 reader refuses a 1.1 image with parents (it finds the parents' files
//! missing or listed twice in the image's own directory) rather than misreading it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::SystemTime;

use crate::fingerprint::Fingerprint;
use crate::store::BufferRecord;

#[doc(hidden)]
pub mod fuzz;
mod manifest;
mod reader;
mod writer;

#[cfg(test)]
mod tests;

pub use manifest::{check_coverage, check_manifest, CoverageError};
pub use reader::Image;
pub use writer::{ImageWriter, WriterOptions, DEFAULT_WRITE_PIECE};

/// The format major version this build writes and the only one it reads.
pub const FORMAT_MAJOR: u32 = 1;
/// The format minor version this build writes (it reads any minor version of [`FORMAT_MAJOR`]).
pub const FORMAT_MINOR: u32 = 1;
/// The magic bytes that open `manifest.pb`.
pub const MANIFEST_MAGIC: [u8; 8] = *b"POSSUMIM";
/// The name of the manifest file inside an image directory.
pub const MANIFEST_FILE: &str = "manifest.pb";
/// The largest manifest payload accepted, in bytes (256 MiB); larger is refused before allocating.
pub const MAX_MANIFEST_LEN: u64 = 256 << 20;
/// The largest chunk accepted, in bytes (1 GiB), by the writer and the reader.
pub const MAX_CHUNK_LEN: u64 = 1 << 30;
/// The largest number of data files an image may have.
pub const MAX_DATA_FILES: usize = 4096;

/// What an image holds, in brief.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageSummary {
    /// The format version the image was written with, as (major, minor).
    pub version: (u32, u32),
    /// When the image was created (as recorded by its writer).
    pub created: SystemTime,
    /// The buffers, sorted by id.
    pub buffers: Vec<BufferRecord>,
    /// The sum of the buffers' sizes, in bytes.
    pub total_bytes: u64,
    /// The number of chunks (superseded chunks not counted).
    pub chunks: u64,
    /// The sum of the lengths of the image's own data files, garbage included (the parent
    /// images' files it refers to are not counted).
    pub data_file_bytes: u64,
    /// The bytes of the chunks held by reference to a parent image's data files (format 1.1;
    /// 0 for an image without parents). Buffers' bytes: `total_bytes` = `reused_bytes` + the
    /// bytes of the chunks in the image's own files.
    pub reused_bytes: u64,
    /// The parent images it refers to, relative to its directory, as recorded.
    pub parents: Vec<PathBuf>,
    /// The metadata key/value pairs.
    pub meta: BTreeMap<String, String>,
}

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
    /// The parent image given to the writer ([`WriterOptions::parent`]) cannot be opened.
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
