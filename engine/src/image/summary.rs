//! What an image holds, in brief: what [`Image::summary`](super::Image::summary) and a
//! finished writer report.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::SystemTime;

use crate::store::BufferRecord;

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
