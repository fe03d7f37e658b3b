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

mod error;
mod format;
#[doc(hidden)]
pub mod fuzz;
mod manifest;
mod reader;
mod summary;
mod writer;

#[cfg(test)]
mod tests;

pub use error::{CoverageError, ImageError};
pub use format::{
    DRAFT_FILE, FORMAT_MAJOR, FORMAT_MINOR, MANIFEST_FILE, MANIFEST_MAGIC, MAX_CHUNK_LEN,
    MAX_DATA_FILES, MAX_MANIFEST_LEN,
};
pub use manifest::{check_coverage, check_manifest};
pub use reader::{ChunkPlace, Image};
pub use summary::ImageSummary;
pub use writer::{
    merged_ranges, unfinished_image_name, FileWrites, ImageWriter, JournalRecord, WriterOptions,
    DEFAULT_WRITE_PIECE,
};
