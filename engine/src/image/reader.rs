//! [`Image`]: opens, checks and reads an image directory.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::manifest::{self, read_framed_crc, summarize, ChunkMsg, ParentMsg};
use super::{ImageError, ImageSummary, DRAFT_FILE, MANIFEST_FILE, MAX_CHUNK_LEN};
use crate::fingerprint::{self, Fingerprint};
use crate::store::{BufferRecord, ChunkSource};

/// How many bytes [`Image::verify`] reads at a time.
const VERIFY_BLOCK: u64 = 8 << 20;

/// A data file, opened once and shared by all readers (positioned reads need no lock).
#[derive(Debug)]
pub(super) struct DataFile {
    /// Its name as recorded (a plain name in its image's directory).
    pub(super) name: String,
    /// How errors name it: `name`, after its parent image's path for a parent's file.
    pub(super) shown: String,
    pub(super) path: PathBuf,
    file: File,
    /// The parent image (index into [`Image::parents`]) whose file it is; `None`: this image's.
    pub(super) parent: Option<usize>,
    /// Its length as recorded.
    pub(super) len: u64,
}

/// An earlier image whose data files hold chunks of this one.
#[derive(Debug)]
pub(super) struct ParentImage {
    /// Its directory: this image's joined with `path`.
    pub(super) dir: PathBuf,
    /// The CRC32C at the end of its `manifest.pb` (checked to be its manifest's now).
    pub(super) manifest_crc32c: u32,
    /// Its creation time as recorded, ns since the Unix epoch.
    pub(super) created_unix_nanos: u64,
}

/// The piece of a chunk read (and checksummed) at once by [`Image`]'s `read_chunk`.
const READ_PIECE: usize = 1 << 20;

/// Where a chunk lies and what it holds, as an image's manifest records it
/// ([`Image::chunk_place`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkPlace<'a> {
    /// Its data file, as [`Image::chunk_location`] names it.
    pub file: &'a str,
    /// Its offset in that file.
    pub at: u64,
    /// Its length.
    pub len: u64,
    /// Its bytes' CRC32C.
    pub crc32c: u32,
}

/// An image opened for restore. Implements [`ChunkSource`]; several threads may read at once.
///
/// [`Image::open`] has already checked everything that is cheap to check; each chunk's checksum is
/// checked as it is read.
#[derive(Debug)]
pub struct Image {
    dir: PathBuf,
    buffers: BTreeMap<u64, BufferRecord>,
    /// Each buffer's chunks, sorted by offset.
    pub(super) chunks: HashMap<u64, Vec<ChunkMsg>>,
    pub(super) files: Vec<DataFile>,
    pub(super) parents: Vec<ParentImage>,
    /// The CRC32C at the end of this image's `manifest.pb`.
    pub(super) manifest_crc32c: u32,
    /// Its creation time as recorded, ns since the Unix epoch.
    pub(super) created_unix_nanos: u64,
    summary: ImageSummary,
}

/// Opens `path`, a data file listed with length `len`, and checks it is at least that long.
/// `missing` and `truncated` make the errors.
fn open_data_file(
    path: &Path,
    len: u64,
    missing: impl FnOnce() -> ImageError,
    truncated: impl FnOnce(u64) -> ImageError,
) -> Result<File, ImageError> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == ErrorKind::NotFound => return Err(missing()),
        Err(e) => return Err(ImageError::io(path, e)),
    };
    let actual = file.metadata().map_err(|e| ImageError::io(path, e))?.len();
    if actual < len {
        return Err(truncated(actual));
    }
    Ok(file)
}

/// Whether [`Image::open_as`] checks that the image's own data files are as long as recorded.
#[derive(Debug, Clone, Copy)]
enum Lengths {
    Checked,
    Arriving,
}

impl Image {
    /// Opens the image directory `dir` and checks, in order: that `manifest.pb` exists, its magic,
    /// its major version (other majors are refused, newer minors accepted), its payload length
    /// (absurd lengths refused before allocating), its exact file length, its CRC32C, that it
    /// decodes, that it is consistent (header and payload versions agree, data file names are plain,
    /// parent image paths are `..` then plain names, buffer ids unique, every chunk names a
    /// declared buffer and a listed file, is 1 byte to 1 GiB long, lies within its file's
    /// recorded length and has both words of its fingerprint or neither, and every buffer is
    /// covered exactly by its chunks); then that every parent image the manifest lists is there
    /// and unchanged (its `manifest.pb` ends in the CRC32C recorded and passes the same checks,
    /// and lists each data file this image takes from it, at least as long as recorded:
    /// [`ImageError::ParentMissing`], [`ImageError::ParentChanged`]); and finally that every data
    /// file exists and is at least as long as recorded. The first problem found is returned,
    /// naming the file, buffer and offset concerned.
    pub fn open(dir: &Path) -> Result<Image, ImageError> {
        Image::open_as(dir, MANIFEST_FILE, Lengths::Checked)
    }

    /// Opens an unfinished image by its draft manifest ([`DRAFT_FILE`]): the chunks its data
    /// files held after its last pre-copy round, checked as [`Image::open`] checks a manifest.
    /// A later round or the commit may have written over some of those bytes: each chunk read
    /// is checked against its CRC32C, and a chunk that changed fails to read.
    pub fn open_draft(dir: &Path) -> Result<Image, ImageError> {
        Image::open_as(dir, DRAFT_FILE, Lengths::Checked)
    }

    /// [`Image::open_draft`] of an image whose data files are still arriving (a migration's
    /// first round, received in parts): each of its own data files must exist, but may be
    /// shorter than recorded. A chunk read before its bytes are there fails its CRC32C check
    /// (or its read), as a chunk written over does.
    pub fn open_draft_arriving(dir: &Path) -> Result<Image, ImageError> {
        Image::open_as(dir, DRAFT_FILE, Lengths::Arriving)
    }

    fn open_as(dir: &Path, manifest_file: &str, lengths: Lengths) -> Result<Image, ImageError> {
        fs::metadata(dir).map_err(|e| ImageError::io(dir, e))?;
        let (major, minor, manifest, manifest_crc32c) =
            manifest::read_framed_crc_of(dir, manifest_file)?;
        let index = manifest::check(dir, major, minor, &manifest)?;

        let mut parents = Vec::with_capacity(manifest.parents.len());
        // Each parent's own data files (name -> recorded length).
        let mut their_files = Vec::with_capacity(manifest.parents.len());
        for p in &manifest.parents {
            let pdir = dir.join(&p.path);
            their_files.push(check_parent(dir, &pdir, p)?);
            parents.push(ParentImage {
                dir: pdir,
                manifest_crc32c: p.manifest_crc32c,
                created_unix_nanos: p.created_unix_nanos,
            });
        }

        let mut files = Vec::with_capacity(manifest.files.len());
        for f in &manifest.files {
            let parent = f.parent.map(|p| p as usize);
            let shown = manifest::shown_name(&manifest, f);
            let (path, file) = match parent {
                None => {
                    let path = dir.join(&f.name);
                    let at_least = match lengths {
                        Lengths::Checked => f.len,
                        Lengths::Arriving => 0,
                    };
                    let file = open_data_file(
                        &path,
                        at_least,
                        || ImageError::DataFileMissing {
                            image: dir.to_path_buf(),
                            file: f.name.clone(),
                        },
                        |actual| ImageError::DataFileTruncated {
                            image: dir.to_path_buf(),
                            file: f.name.clone(),
                            expected: f.len,
                            actual,
                        },
                    )?;
                    (path, file)
                }
                Some(p) => {
                    let pdir = &parents[p].dir;
                    let changed = |problem: String| ImageError::ParentChanged {
                        image: dir.to_path_buf(),
                        parent: pdir.clone(),
                        problem,
                    };
                    match their_files[p].get(&f.name) {
                        None => {
                            return Err(changed(format!(
                                "its manifest does not list a data file {:?}",
                                f.name
                            )))
                        }
                        Some(&listed) if listed < f.len => {
                            return Err(changed(format!(
                                "its manifest lists {} with {listed} bytes, this image expects at least {}",
                                f.name, f.len
                            )))
                        }
                        Some(_) => {}
                    }
                    let path = pdir.join(&f.name);
                    let file = open_data_file(
                        &path,
                        f.len,
                        || changed(format!("{} missing", f.name)),
                        |actual| {
                            changed(format!(
                                "{} truncated: {actual} bytes, expected at least {}",
                                f.name, f.len
                            ))
                        },
                    )?;
                    (path, file)
                }
            };
            files.push(DataFile {
                name: f.name.clone(),
                shown,
                path,
                file,
                parent,
                len: f.len,
            });
        }

        let summary = summarize(&manifest, &index);
        Ok(Image {
            dir: dir.to_path_buf(),
            buffers: index.buffers,
            chunks: index.chunks,
            files,
            parents,
            manifest_crc32c,
            created_unix_nanos: manifest.created_unix_nanos,
            summary,
        })
    }

    /// The image directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The format version the image was written with, as (major, minor).
    pub fn version(&self) -> (u32, u32) {
        self.summary.version
    }

    /// What the image holds: buffers, total bytes, metadata, ...
    pub fn summary(&self) -> &ImageSummary {
        &self.summary
    }

    /// Reads every chunk and checks its CRC32C and, where it has one, its fingerprint, in buffer
    /// id then offset order, a few MiB at a time. Returns the first mismatch
    /// ([`ImageError::ChecksumMismatch`], [`ImageError::FingerprintMismatch`]) or I/O error.
    pub fn verify(&self) -> Result<(), ImageError> {
        let largest = self
            .chunks
            .values()
            .flatten()
            .map(|c| c.len)
            .max()
            .unwrap_or(0);
        let mut block = vec![0u8; largest.min(VERIFY_BLOCK) as usize];
        for id in self.buffers.keys() {
            for c in self.chunks.get(id).map(Vec::as_slice).unwrap_or_default() {
                let f = &self.files[c.file as usize];
                let recorded = c.fingerprint();
                let mut crc = 0u32;
                let (mut lo, mut hi) = (0u64, 0u64);
                let mut done = 0u64;
                while done < c.len {
                    let n = (c.len - done).min(VERIFY_BLOCK) as usize;
                    let buf = &mut block[..n];
                    f.file
                        .read_exact_at(buf, c.file_offset + done)
                        .map_err(|e| ImageError::io(&f.path, e))?;
                    crc = crc32c::crc32c_append(crc, buf);
                    if recorded.is_some() {
                        // VERIFY_BLOCK is a multiple of 8: the pieces' sums add up.
                        let (l, h) = fingerprint::sums(buf, done / 8);
                        lo = lo.wrapping_add(l);
                        hi = hi.wrapping_add(h);
                    }
                    done += n as u64;
                }
                if crc != c.crc32c {
                    return Err(self.mismatch(f, c));
                }
                if let Some(recorded) = recorded {
                    let computed = Fingerprint::from_sums(lo, hi, c.len);
                    if computed != recorded {
                        return Err(ImageError::FingerprintMismatch {
                            image: self.dir.clone(),
                            file: f.shown.clone(),
                            buffer: c.buffer,
                            offset: c.offset,
                            recorded,
                            computed,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether this image and `other` hold the same bytes for `buffer` at `offset`: each has a
    /// chunk there of the same length, CRC32C and fingerprint (a chunk without a fingerprint is
    /// never called the same: a CRC32C alone does not prove it).
    pub fn same_chunk(&self, other: &Image, buffer: u64, offset: u64) -> bool {
        match (self.chunk(buffer, offset), other.chunk(buffer, offset)) {
            (Some(a), Some(b)) => {
                a.len == b.len
                    && a.crc32c == b.crc32c
                    && a.fingerprint().is_some()
                    && a.fingerprint() == b.fingerprint()
            }
            _ => false,
        }
    }

    /// The image's own data files (not its parents'), as [`Image::chunk_location`] names them,
    /// with the lengths its manifest records.
    pub fn own_data_files(&self) -> Vec<(&str, u64)> {
        (self.files.iter())
            .filter(|f| f.parent.is_none())
            .map(|f| (f.shown.as_str(), f.len))
            .collect()
    }

    /// Where the chunk of `buffer` at `offset` lies: its data file's path relative to the image
    /// directory (the file's name, after its parent image's path for a parent's file, as errors
    /// name it) and the chunk's offset in that file; `None` if there is no such chunk.
    pub fn chunk_location(&self, buffer: u64, offset: u64) -> Option<(&str, u64)> {
        let c = self.chunk(buffer, offset)?;
        let f = self.files.get(c.file as usize)?;
        Some((f.shown.as_str(), c.file_offset))
    }

    /// The chunk of `buffer` at `offset` as the manifest records it: where it lies
    /// ([`Image::chunk_location`]), its length and its CRC32C; `None` if there is no such chunk.
    pub fn chunk_place(&self, buffer: u64, offset: u64) -> Option<ChunkPlace<'_>> {
        let c = self.chunk(buffer, offset)?;
        let f = self.files.get(c.file as usize)?;
        Some(ChunkPlace {
            file: f.shown.as_str(),
            at: c.file_offset,
            len: c.len,
            crc32c: c.crc32c,
        })
    }

    /// Reads the chunk of `buffer` at `offset` from where the manifest says it lies, as its file
    /// holds it now, without checking it: its CRC32C, for the caller to compare. A reader of
    /// files still being written (a migration's destination, loading chunks as they are sent
    /// again) vouches for what it read by that sum. `dst` must be exactly the chunk's length.
    pub fn read_chunk_as_is(
        &self,
        buffer: u64,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<u32, ImageError> {
        self.read_unchecked(buffer, offset, dst).map(|(crc, _)| crc)
    }

    /// [`Image::read_chunk_as_is`], with the chunk's record.
    fn read_unchecked(
        &self,
        buffer: u64,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(u32, &ChunkMsg), ImageError> {
        if !self.buffers.contains_key(&buffer) {
            return Err(ImageError::UnknownBuffer { buffer });
        }
        let c = self
            .chunk(buffer, offset)
            .ok_or(ImageError::MissingChunk { buffer, offset })?;
        let len = dst.len() as u64;
        if len != c.len || len > MAX_CHUNK_LEN {
            return Err(ImageError::ChunkOutOfRange {
                buffer,
                offset,
                len,
            });
        }
        let f = &self.files[c.file as usize];
        // Read and summed a piece at a time, so that the checksum reads each piece from the
        // cache the read just left it in (one pass over host memory fewer: a restore's reads
        // are bound by memory bandwidth on the GPU machine, as its writes are).
        let mut crc = 0u32;
        let mut at = c.file_offset;
        for piece in dst.chunks_mut(READ_PIECE) {
            f.file
                .read_exact_at(piece, at)
                .map_err(|e| ImageError::io(&f.path, e))?;
            crc = crc32c::crc32c_append(crc, piece);
            at += piece.len() as u64;
        }
        Ok((crc, c))
    }

    fn chunk(&self, buffer: u64, offset: u64) -> Option<&ChunkMsg> {
        let cs = self.chunks.get(&buffer)?;
        let i = cs.binary_search_by_key(&offset, |c| c.offset).ok()?;
        Some(&cs[i])
    }

    fn mismatch(&self, f: &DataFile, c: &ChunkMsg) -> ImageError {
        ImageError::ChecksumMismatch {
            image: self.dir.clone(),
            file: f.shown.clone(),
            buffer: c.buffer,
            offset: c.offset,
        }
    }
}

/// Checks the parent image at `pdir` (`p` of image `dir`'s manifest): there, its manifest the
/// one recorded and valid. Returns its own data files (name -> recorded length).
fn check_parent(
    dir: &Path,
    pdir: &Path,
    p: &ParentMsg,
) -> Result<HashMap<String, u64>, ImageError> {
    let missing = |problem: String| ImageError::ParentMissing {
        image: dir.to_path_buf(),
        parent: pdir.to_path_buf(),
        problem,
    };
    let changed = |problem: String| ImageError::ParentChanged {
        image: dir.to_path_buf(),
        parent: pdir.to_path_buf(),
        problem,
    };
    match fs::metadata(pdir) {
        Ok(md) if md.is_dir() => {}
        Ok(_) => return Err(changed("not a directory".into())),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            return Err(missing("no such directory".into()))
        }
        Err(e) => return Err(ImageError::io(pdir, e)),
    }
    let (major, minor, m, crc) = match read_framed_crc(pdir) {
        Ok(r) => r,
        Err(ImageError::ManifestMissing { .. }) => {
            return Err(missing(format!("it has no {MANIFEST_FILE}")))
        }
        Err(e) => return Err(changed(e.to_string())),
    };
    if crc != p.manifest_crc32c {
        return Err(changed(format!(
            "its {MANIFEST_FILE} ends in checksum {crc:#010x}, not {:#010x} as when this image was written (created {} ns after the epoch, it is now {} ns)",
            p.manifest_crc32c, p.created_unix_nanos, m.created_unix_nanos
        )));
    }
    manifest::check(pdir, major, minor, &m).map_err(|e| changed(e.to_string()))?;
    Ok(m.files
        .iter()
        .filter(|f| f.parent.is_none())
        .map(|f| (f.name.clone(), f.len))
        .collect())
}

impl ChunkSource for Image {
    fn buffers(&self) -> Vec<BufferRecord> {
        self.buffers.values().cloned().collect()
    }

    fn chunks(&self, buffer: u64) -> Vec<(u64, u64)> {
        self.chunks
            .get(&buffer)
            .map(|cs| cs.iter().map(|c| (c.offset, c.len)).collect())
            .unwrap_or_default()
    }

    /// Reads the chunk with a positioned read and checks its CRC32C. `dst` must be exactly the
    /// chunk's length ([`ImageError::ChunkOutOfRange`] otherwise).
    fn read_chunk(&self, buffer: u64, offset: u64, dst: &mut [u8]) -> Result<(), ImageError> {
        let (crc, c) = self.read_unchecked(buffer, offset, dst)?;
        if crc != c.crc32c {
            return Err(self.mismatch(&self.files[c.file as usize], c));
        }
        Ok(())
    }

    fn meta(&self, key: &str) -> Option<String> {
        self.summary.meta.get(key).cloned()
    }

    /// The fingerprint the manifest records for the chunk (none for a chunk of a 1.0 image).
    fn fingerprint(&self, buffer: u64, offset: u64) -> Option<Fingerprint> {
        self.chunk(buffer, offset)?.fingerprint()
    }
}
