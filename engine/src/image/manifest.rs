//! The manifest: its protobuf messages (hand-written `prost` derives, no build script), its framing
//! in `manifest.pb`, and the checks every manifest must pass before anything trusts it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io::{ErrorKind, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prost::Message;

use super::{
    CoverageError, ImageError, ImageSummary, DRAFT_FILE, FORMAT_MAJOR, MANIFEST_FILE,
    MANIFEST_MAGIC, MAX_CHUNK_LEN, MAX_DATA_FILES, MAX_MANIFEST_LEN,
};
use crate::fingerprint::Fingerprint;
use crate::store::BufferRecord;

/// Bytes before the payload: magic, major, minor, payload length.
pub(crate) const HEADER_LEN: u64 = 24;
/// Bytes after the payload: the CRC32C.
pub(crate) const TRAILER_LEN: u64 = 4;

/// The whole manifest (protobuf message `possum.image.Manifest`).
#[derive(Clone, PartialEq, Message)]
pub(crate) struct Manifest {
    /// Format major version (repeats the frame header's; the two must agree).
    #[prost(uint32, tag = "1")]
    pub major: u32,
    /// Format minor version (repeats the frame header's; the two must agree).
    #[prost(uint32, tag = "2")]
    pub minor: u32,
    /// Creation time, nanoseconds since the Unix epoch.
    #[prost(uint64, tag = "3")]
    pub created_unix_nanos: u64,
    /// Metadata set with `ChunkSink::set_meta`.
    #[prost(btree_map = "string, string", tag = "4")]
    pub meta: BTreeMap<String, String>,
    /// The buffers.
    #[prost(message, repeated, tag = "5")]
    pub buffers: Vec<BufferMsg>,
    /// The live chunks (superseded ones are not listed).
    #[prost(message, repeated, tag = "6")]
    pub chunks: Vec<ChunkMsg>,
    /// The data files; a chunk names its file by index in this list.
    #[prost(message, repeated, tag = "7")]
    pub files: Vec<DataFileMsg>,
    /// The earlier images whose data files hold chunks of this one (format 1.1); a data file
    /// names its image by index in this list (`DataFileMsg::parent`).
    #[prost(message, repeated, tag = "8")]
    pub parents: Vec<ParentMsg>,
}

/// One buffer (message `Buffer`).
#[derive(Clone, PartialEq, Message)]
pub(crate) struct BufferMsg {
    /// The engine's buffer id.
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// Device virtual address.
    #[prost(uint64, tag = "2")]
    pub va: u64,
    /// Size in bytes.
    #[prost(uint64, tag = "3")]
    pub size: u64,
    /// Rank in the predicted order of first use after restore.
    #[prost(uint32, tag = "4")]
    pub prefetch_rank: u32,
}

/// One chunk (message `Chunk`).
#[derive(Clone, PartialEq, Message)]
pub(crate) struct ChunkMsg {
    /// The buffer it belongs to.
    #[prost(uint64, tag = "1")]
    pub buffer: u64,
    /// Its offset in the buffer.
    #[prost(uint64, tag = "2")]
    pub offset: u64,
    /// Its length in bytes.
    #[prost(uint64, tag = "3")]
    pub len: u64,
    /// Index of its data file in `Manifest::files`.
    #[prost(uint32, tag = "4")]
    pub file: u32,
    /// Where its bytes start in that file.
    #[prost(uint64, tag = "5")]
    pub file_offset: u64,
    /// CRC32C (Castagnoli) of its bytes.
    #[prost(fixed32, tag = "6")]
    pub crc32c: u32,
    /// Its fingerprint's first word ([`Fingerprint`]`.0[0]`), format 1.1; with `fp_hi`, or
    /// neither (a chunk of a 1.0 image, or one recorded without).
    #[prost(fixed64, optional, tag = "7")]
    pub fp_lo: Option<u64>,
    /// Its fingerprint's second word ([`Fingerprint`]`.0[1]`), format 1.1.
    #[prost(fixed64, optional, tag = "8")]
    pub fp_hi: Option<u64>,
}

impl ChunkMsg {
    /// The chunk's fingerprint, if it has one (both words recorded).
    pub fn fingerprint(&self) -> Option<Fingerprint> {
        match (self.fp_lo, self.fp_hi) {
            (Some(lo), Some(hi)) => Some(Fingerprint([lo, hi])),
            _ => None,
        }
    }

    /// Records `fp` (or none) as the chunk's fingerprint.
    pub fn set_fingerprint(&mut self, fp: Option<Fingerprint>) {
        self.fp_lo = fp.map(|f| f.0[0]);
        self.fp_hi = fp.map(|f| f.0[1]);
    }
}

/// One data file (message `DataFile`).
#[derive(Clone, PartialEq, Message)]
pub(crate) struct DataFileMsg {
    /// File name inside the image directory.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Its length when the image was committed (the file may not be shorter).
    #[prost(uint64, tag = "2")]
    pub len: u64,
    /// Absent: the file is in this image's directory. Set (format 1.1): the file is a data file
    /// of the earlier image `Manifest::parents[parent]`, named `name` there.
    #[prost(uint32, optional, tag = "3")]
    pub parent: Option<u32>,
}

/// An earlier image whose data files hold chunks of this one (message `Parent`).
#[derive(Clone, PartialEq, Message)]
pub(crate) struct ParentMsg {
    /// Where it is, relative to this image's directory: one or more `..`, then plain names
    /// ([`valid_parent_path`]).
    #[prost(string, tag = "1")]
    pub path: String,
    /// The CRC32C stored at the end of its `manifest.pb` (the last 4 bytes) when this image was
    /// written: a parent whose manifest has another one has changed since.
    #[prost(fixed32, tag = "2")]
    pub manifest_crc32c: u32,
    /// Its creation time (its manifest's `created_unix_nanos`), for messages.
    #[prost(uint64, tag = "3")]
    pub created_unix_nanos: u64,
}

impl From<&BufferMsg> for BufferRecord {
    fn from(b: &BufferMsg) -> Self {
        BufferRecord {
            id: b.id,
            va: b.va,
            size: b.size,
            prefetch_rank: b.prefetch_rank,
        }
    }
}

impl From<&BufferRecord> for BufferMsg {
    fn from(b: &BufferRecord) -> Self {
        BufferMsg {
            id: b.id,
            va: b.va,
            size: b.size,
            prefetch_rank: b.prefetch_rank,
        }
    }
}

/// Nanoseconds since the Unix epoch (0 before it, saturating far after it).
pub(crate) fn to_unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The inverse of [`to_unix_nanos`].
pub(crate) fn from_unix_nanos(n: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(n)
}

/// `manifest.pb`'s bytes for `m`, with `major`/`minor` in the frame header.
pub(crate) fn encode_framed(m: &Manifest, major: u32, minor: u32) -> Vec<u8> {
    frame(&m.encode_to_vec(), major, minor)
}

/// `payload` framed: header with `major`/`minor` and its length, then the payload, then the
/// CRC32C of both.
pub(crate) fn frame(payload: &[u8], major: u32, minor: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + (HEADER_LEN + TRAILER_LEN) as usize);
    out.extend_from_slice(&MANIFEST_MAGIC);
    out.extend_from_slice(&major.to_le_bytes());
    out.extend_from_slice(&minor.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(payload);
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Reads and checks the framing of `<image>/manifest.pb`, returning the header's (major, minor)
/// and the decoded manifest. Checks, in order: presence, magic, major version, payload length cap,
/// file length, checksum, decoding. Nothing is allocated for the payload before its length is
/// known to be at most [`MAX_MANIFEST_LEN`] and to match the file's.
#[cfg(test)]
pub(crate) fn read_framed(image: &Path) -> Result<(u32, u32, Manifest), ImageError> {
    read_framed_crc(image).map(|(major, minor, m, _)| (major, minor, m))
}

/// [`read_framed`], also returning the CRC32C stored at the end of the file (which identifies
/// this manifest: [`ParentMsg::manifest_crc32c`]).
pub(crate) fn read_framed_crc(image: &Path) -> Result<(u32, u32, Manifest, u32), ImageError> {
    read_framed_crc_of(image, MANIFEST_FILE)
}

/// [`read_framed_crc`] of the manifest-format file `name` of the image (its manifest or its
/// draft).
pub(crate) fn read_framed_crc_of(
    image: &Path,
    name: &str,
) -> Result<(u32, u32, Manifest, u32), ImageError> {
    let path = image.join(name);
    let mut file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            return Err(ImageError::ManifestMissing {
                image: image.to_path_buf(),
            })
        }
        Err(e) => return Err(ImageError::io(path, e)),
    };
    let actual = file.metadata().map_err(|e| ImageError::io(&path, e))?.len();
    let mut header = [0u8; HEADER_LEN as usize];
    let have = read_up_to(&mut file, &mut header).map_err(|e| ImageError::io(&path, e))?;
    let (major, minor, len) = check_header(image, &header[..have], actual)?;
    // `len` is at most MAX_MANIFEST_LEN, so this allocation is bounded.
    let mut rest = vec![0u8; (len + TRAILER_LEN) as usize];
    file.read_exact(&mut rest)
        .map_err(|e| ImageError::io(&path, e))?;
    let m = check_payload(image, &header, &rest)?;
    let crc = u32::from_le_bytes(rest[len as usize..].try_into().expect("4 bytes"));
    Ok((major, minor, m, crc))
}

/// [`read_framed`] on the bytes of a `manifest.pb` already in memory (`image` names the image in
/// errors only).
pub(crate) fn decode_framed(
    image: &Path,
    bytes: &[u8],
) -> Result<(u32, u32, Manifest), ImageError> {
    let header = &bytes[..bytes.len().min(HEADER_LEN as usize)];
    let (major, minor, _) = check_header(image, header, bytes.len() as u64)?;
    // `check_header` made sure that `bytes` is exactly header, payload and trailer.
    let m = check_payload(image, header, &bytes[header.len()..])?;
    Ok((major, minor, m))
}

/// Checks the frame header (`header`: the file's first bytes, up to [`HEADER_LEN`]) against the
/// file's length `actual`: magic, major version, payload length cap, exact file length. Returns
/// (major, minor, payload length).
fn check_header(image: &Path, header: &[u8], actual: u64) -> Result<(u32, u32, u64), ImageError> {
    let min_len = HEADER_LEN + TRAILER_LEN;
    let truncated = |expected: u64| ImageError::ManifestTruncated {
        image: image.to_path_buf(),
        expected,
        actual,
    };
    let Some(magic) = header.get(..MANIFEST_MAGIC.len()) else {
        return Err(truncated(min_len));
    };
    if magic != MANIFEST_MAGIC {
        return Err(ImageError::BadMagic {
            image: image.to_path_buf(),
            found: magic.to_vec(),
        });
    }
    let Ok(header) = <&[u8; HEADER_LEN as usize]>::try_from(header) else {
        return Err(truncated(min_len));
    };
    let [.., m0, m1, m2, m3, n0, n1, n2, n3, l0, l1, l2, l3, l4, l5, l6, l7] = *header;
    let major = u32::from_le_bytes([m0, m1, m2, m3]);
    let minor = u32::from_le_bytes([n0, n1, n2, n3]);
    if major != FORMAT_MAJOR {
        return Err(ImageError::UnsupportedVersion {
            image: image.to_path_buf(),
            major,
            minor,
        });
    }
    let len = u64::from_le_bytes([l0, l1, l2, l3, l4, l5, l6, l7]);
    if len > MAX_MANIFEST_LEN {
        return Err(ImageError::ManifestTooLarge {
            image: image.to_path_buf(),
            len,
            max: MAX_MANIFEST_LEN,
        });
    }
    let expected = min_len + len;
    if actual < expected {
        return Err(truncated(expected));
    }
    if actual > expected {
        return Err(ImageError::ManifestTrailingBytes {
            image: image.to_path_buf(),
            expected,
            actual,
        });
    }
    Ok((major, minor, len))
}

/// Checks the CRC32C of `header` and `rest` (payload then the 4-byte trailer; [`check_header`]
/// passed) and decodes the payload.
fn check_payload(image: &Path, header: &[u8], rest: &[u8]) -> Result<Manifest, ImageError> {
    let Some(split) = rest.len().checked_sub(TRAILER_LEN as usize) else {
        return Err(ImageError::ManifestTruncated {
            image: image.to_path_buf(),
            expected: HEADER_LEN + TRAILER_LEN,
            actual: (header.len() + rest.len()) as u64,
        });
    };
    let (payload, trailer) = rest.split_at(split);
    let stored = u32::from_le_bytes(trailer.try_into().expect("4 bytes"));
    let computed = crc32c::crc32c_append(crc32c::crc32c(header), payload);
    if stored != computed {
        return Err(ImageError::ManifestChecksum {
            image: image.to_path_buf(),
            stored,
            computed,
        });
    }
    Manifest::decode(payload).map_err(|source| ImageError::ManifestDecode {
        image: image.to_path_buf(),
        source,
    })
}

/// Reads until `buf` is full or the file ends; returns how many bytes were read.
fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut have = 0;
    while have < buf.len() {
        match file.read(&mut buf[have..]) {
            Ok(0) => break,
            Ok(n) => have += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(have)
}

/// Checks that `chunks`, given as (offset, len) **sorted by offset**, cover `0 .. size` exactly:
/// no gap, no overlap, nothing past the end, no empty chunk. Chunks out of order are reported as
/// overlapping. All arithmetic is on `u64` and overflow-checked, so sizes past 4 GiB (or near
/// `u64::MAX`) are handled. A buffer of size 0 is covered by no chunks.
pub fn check_coverage(size: u64, chunks: &[(u64, u64)]) -> Result<(), CoverageError> {
    let mut pos = 0u64;
    for &(offset, len) in chunks {
        if len == 0 {
            return Err(CoverageError::Empty { offset });
        }
        if offset < pos {
            return Err(CoverageError::Overlap {
                offset,
                prev_end: pos,
            });
        }
        if offset > pos {
            return Err(CoverageError::Gap {
                start: pos,
                end: offset.min(size),
            });
        }
        match offset.checked_add(len) {
            Some(end) if end <= size => pos = end,
            _ => return Err(CoverageError::PastEnd { offset, len, size }),
        }
    }
    if pos < size {
        return Err(CoverageError::Gap {
            start: pos,
            end: size,
        });
    }
    Ok(())
}

/// Whether `name` may name a data file: a plain name of `[A-Za-z0-9_.-]`, not starting with a dot,
/// not the manifest's name, at most 255 bytes. Anything else (a path, `..`) is refused so that a
/// manifest can never make the reader open a file outside the image directory.
fn valid_data_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name != MANIFEST_FILE
        && name != DRAFT_FILE
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// The longest [`ParentMsg::path`] accepted, in bytes.
pub(crate) const MAX_PARENT_PATH: usize = 4096;

/// Whether `path` may locate a parent image relative to the image's directory: one or more `..`
/// components, then plain components (not empty, not `.` or `..`, at most 255 bytes, no NUL),
/// separated by single `/`; not absolute; at most [`MAX_PARENT_PATH`] bytes. What the reader
/// opens there is only a data file of a valid possum image whose manifest is the one recorded
/// (see [`super::Image::open`]).
pub(crate) fn valid_parent_path(path: &str) -> bool {
    if path.is_empty() || path.len() > MAX_PARENT_PATH {
        return false;
    }
    let (mut ups, mut names) = (0usize, 0usize);
    for c in path.split('/') {
        if c == ".." {
            if names > 0 {
                return false;
            }
            ups += 1;
        } else if c.is_empty() || c == "." || c.len() > 255 || c.contains('\0') {
            return false;
        } else {
            names += 1;
        }
    }
    ups > 0
}

/// How a data file is named in messages: its name, after its parent image's path if it has one.
pub(crate) fn shown_name(m: &Manifest, f: &DataFileMsg) -> String {
    match f.parent.and_then(|p| m.parents.get(p as usize)) {
        Some(p) => format!("{}/{}", p.path, f.name),
        None => f.name.clone(),
    }
}

/// A manifest that passed [`validate`], arranged for lookups.
#[derive(Debug)]
pub(crate) struct Index {
    /// The buffers by id.
    pub buffers: BTreeMap<u64, BufferRecord>,
    /// Each buffer's chunks, sorted by offset (buffers of size 0 have no entry).
    pub chunks: HashMap<u64, Vec<ChunkMsg>>,
}

/// Checks a manifest's internal consistency (not the data files on disk): data file names and count,
/// unique buffer ids, each chunk's buffer, file, length and file range, and each buffer's exact
/// coverage. Problems are reported in manifest order, the first one found.
pub(crate) fn validate(image: &Path, m: &Manifest) -> Result<Index, ImageError> {
    validate_files(image, m)?;
    let buffers = index_buffers(image, m)?;
    let mut chunks: HashMap<u64, Vec<ChunkMsg>> = HashMap::new();
    for c in &m.chunks {
        validate_chunk(image, m, &buffers, c)?;
        chunks.entry(c.buffer).or_default().push(c.clone());
    }
    sort_and_check_coverage(image, &buffers, &mut chunks)?;
    Ok(Index { buffers, chunks })
}

/// [`ImageError::ManifestInvalid`] of the manifest of `image`.
fn invalid_manifest(image: &Path, problem: String) -> ImageError {
    ImageError::ManifestInvalid {
        image: image.to_path_buf(),
        problem,
    }
}

/// The parent images and data files a manifest lists: within the limits, valid paths and names,
/// each listed once, each data file's parent listed.
fn validate_files(image: &Path, m: &Manifest) -> Result<(), ImageError> {
    let invalid = |problem: String| invalid_manifest(image, problem);
    if m.files.len() > MAX_DATA_FILES {
        return Err(invalid(format!(
            "{} data files listed, more than the limit of {MAX_DATA_FILES}",
            m.files.len()
        )));
    }
    if m.parents.len() > MAX_DATA_FILES {
        return Err(invalid(format!(
            "{} parent images listed, more than the limit of {MAX_DATA_FILES}",
            m.parents.len()
        )));
    }
    let mut paths = BTreeSet::new();
    for p in &m.parents {
        if !valid_parent_path(&p.path) {
            return Err(invalid(format!("invalid parent image path {:?}", p.path)));
        }
        if !paths.insert(p.path.as_str()) {
            return Err(invalid(format!("parent image {:?} listed twice", p.path)));
        }
    }
    let mut names = BTreeSet::new();
    for f in &m.files {
        if !valid_data_file_name(&f.name) {
            return Err(invalid(format!("invalid data file name {:?}", f.name)));
        }
        if let Some(p) = f.parent.filter(|&p| p as usize >= m.parents.len()) {
            return Err(invalid(format!(
                "data file {:?} belongs to parent image #{p}, which is not listed",
                f.name
            )));
        }
        if !names.insert((f.parent, f.name.as_str())) {
            return Err(invalid(format!(
                "data file {:?} listed twice",
                shown_name(m, f)
            )));
        }
    }
    Ok(())
}

/// The manifest's buffers by id, each id listed once.
fn index_buffers(image: &Path, m: &Manifest) -> Result<BTreeMap<u64, BufferRecord>, ImageError> {
    let mut buffers = BTreeMap::new();
    for b in &m.buffers {
        if buffers.insert(b.id, BufferRecord::from(b)).is_some() {
            return Err(ImageError::DuplicateBuffer {
                image: image.to_path_buf(),
                buffer: b.id,
            });
        }
    }
    Ok(buffers)
}

/// One chunk: of a listed buffer, of a valid length, in a listed data file and inside it, with
/// both words of its fingerprint or neither.
fn validate_chunk(
    image: &Path,
    m: &Manifest,
    buffers: &BTreeMap<u64, BufferRecord>,
    c: &ChunkMsg,
) -> Result<(), ImageError> {
    let image = image.to_path_buf();
    let (buffer, offset) = (c.buffer, c.offset);
    if !buffers.contains_key(&buffer) {
        return Err(ImageError::ChunkUnknownBuffer {
            image,
            buffer,
            offset,
        });
    }
    if c.len == 0 || c.len > MAX_CHUNK_LEN {
        let (len, max) = (c.len, MAX_CHUNK_LEN);
        return Err(ImageError::ChunkBadLength {
            image,
            buffer,
            offset,
            len,
            max,
        });
    }
    let Some(file) = m.files.get(c.file as usize) else {
        let file = c.file;
        return Err(ImageError::ChunkUnknownFile {
            image,
            buffer,
            offset,
            file,
        });
    };
    let inside = matches!(c.file_offset.checked_add(c.len), Some(end) if end <= file.len);
    if !inside {
        return Err(ImageError::ChunkOutsideFile {
            image,
            file: shown_name(m, file),
            buffer,
            offset,
            file_offset: c.file_offset,
            len: c.len,
            file_len: file.len,
        });
    }
    if c.fp_lo.is_some() != c.fp_hi.is_some() {
        return Err(invalid_manifest(
            &image,
            format!(
                "chunk of buffer {buffer} at offset {offset} has only one word of its fingerprint"
            ),
        ));
    }
    Ok(())
}

/// Sorts each buffer's chunks by offset and checks they cover it exactly.
fn sort_and_check_coverage(
    image: &Path,
    buffers: &BTreeMap<u64, BufferRecord>,
    chunks: &mut HashMap<u64, Vec<ChunkMsg>>,
) -> Result<(), ImageError> {
    let mut spans = Vec::new();
    for (&id, rec) in buffers {
        let list = chunks
            .get_mut(&id)
            .map(|v| v.as_mut_slice())
            .unwrap_or_default();
        list.sort_by_key(|c| c.offset);
        spans.clear();
        spans.extend(list.iter().map(|c| (c.offset, c.len)));
        check_coverage(rec.size, &spans).map_err(|problem| ImageError::BadCoverage {
            image: image.to_path_buf(),
            buffer: id,
            problem,
        })?;
    }
    Ok(())
}

/// Checks a decoded manifest whose frame header said `major`.`minor`: the payload repeats the
/// same version, and [`validate`] passes.
pub(crate) fn check(
    image: &Path,
    major: u32,
    minor: u32,
    m: &Manifest,
) -> Result<Index, ImageError> {
    if (m.major, m.minor) != (major, minor) {
        return Err(ImageError::ManifestInvalid {
            image: image.to_path_buf(),
            problem: format!(
                "the header says format {major}.{minor} but the manifest says {}.{}",
                m.major, m.minor
            ),
        });
    }
    validate(image, m)
}

/// Decodes and checks the bytes of a `manifest.pb` as [`Image::open`](super::Image::open) does
/// (framing, version, checksum, decoding, consistency), without looking at any data file. `image`
/// names the image in errors only.
pub fn check_manifest(image: &Path, bytes: &[u8]) -> Result<ImageSummary, ImageError> {
    let (major, minor, m) = decode_framed(image, bytes)?;
    let index = check(image, major, minor, &m)?;
    Ok(summarize(&m, &index))
}

/// The summary of a validated manifest.
pub(crate) fn summarize(m: &Manifest, idx: &Index) -> ImageSummary {
    ImageSummary {
        version: (m.major, m.minor),
        created: from_unix_nanos(m.created_unix_nanos),
        buffers: idx.buffers.values().cloned().collect(),
        total_bytes: idx
            .buffers
            .values()
            .fold(0u64, |a, b| a.saturating_add(b.size)),
        chunks: m.chunks.len() as u64,
        data_file_bytes: m
            .files
            .iter()
            .filter(|f| f.parent.is_none())
            .fold(0u64, |a, f| a.saturating_add(f.len)),
        reused_bytes: m
            .chunks
            .iter()
            .filter(|c| {
                m.files
                    .get(c.file as usize)
                    .is_some_and(|f| f.parent.is_some())
            })
            .fold(0u64, |a, c| a.saturating_add(c.len)),
        parents: m.parents.iter().map(|p| PathBuf::from(&p.path)).collect(),
        meta: m.meta.clone(),
    }
}
