//! The format's version, its magic bytes and the limits a reader and a writer hold to.

/// The format major version this build writes and the only one it reads.
pub const FORMAT_MAJOR: u32 = 1;
/// The format minor version this build writes (it reads any minor version of [`FORMAT_MAJOR`]).
pub const FORMAT_MINOR: u32 = 1;
/// The magic bytes that open `manifest.pb`.
pub const MANIFEST_MAGIC: [u8; 8] = *b"POSSUMIM";
/// The name of the manifest file inside an image directory.
pub const MANIFEST_FILE: &str = "manifest.pb";
/// The name of an unfinished image's draft manifest: what its data files held after the last
/// pre-copy round ([`ImageWriter::write_draft`](super::ImageWriter::write_draft)), the manifest's
/// format; removed at commit.
pub const DRAFT_FILE: &str = "draft.pb";
/// The largest manifest payload accepted, in bytes (256 MiB); larger is refused before allocating.
pub const MAX_MANIFEST_LEN: u64 = 256 << 20;
/// The largest chunk accepted, in bytes (1 GiB), by the writer and the reader.
pub const MAX_CHUNK_LEN: u64 = 1 << 30;
/// The largest number of data files an image may have.
pub const MAX_DATA_FILES: usize = 4096;
