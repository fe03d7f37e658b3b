//! [`Image`]: opens, checks and reads an image directory.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::manifest::{self, read_framed, summarize, ChunkMsg};
use super::{ImageError, ImageSummary, MAX_CHUNK_LEN};
use crate::store::{BufferRecord, ChunkSource};

/// How many bytes [`Image::verify`] reads at a time.
const VERIFY_BLOCK: u64 = 8 << 20;

/// A data file, opened once and shared by all readers (positioned reads need no lock).
#[derive(Debug)]
struct DataFile {
    name: String,
    path: PathBuf,
    file: File,
}

/// The piece of a chunk read (and checksummed) at once by [`Image`]'s `read_chunk`.
const READ_PIECE: usize = 1 << 20;

/// An image opened for restore. Implements [`ChunkSource`]; several threads may read at once.
///
/// [`Image::open`] has already checked everything that is cheap to check; each chunk's checksum is
/// checked as it is read.
#[derive(Debug)]
pub struct Image {
    dir: PathBuf,
    buffers: BTreeMap<u64, BufferRecord>,
    /// Each buffer's chunks, sorted by offset.
    chunks: HashMap<u64, Vec<ChunkMsg>>,
    files: Vec<DataFile>,
    summary: ImageSummary,
}

impl Image {
    /// Opens the image directory `dir` and checks, in order: that `manifest.pb` exists, its magic,
    /// its major version (other majors are refused, newer minors accepted), its payload length
    /// (absurd lengths refused before allocating), its exact file length, its CRC32C, that it
    /// decodes, that it is consistent (header and payload versions agree, data file names are plain,
    /// buffer ids unique, every chunk names a declared buffer and a listed file, is 1 byte to 1 GiB
    /// long and lies within its file's recorded length, and every buffer is covered exactly by its
    /// chunks), and finally that every data file exists and is at least as long as recorded.
    /// The first problem found is returned, naming the file, buffer and offset concerned.
    pub fn open(dir: &Path) -> Result<Image, ImageError> {
        fs::metadata(dir).map_err(|e| ImageError::io(dir, e))?;
        let (major, minor, manifest) = read_framed(dir)?;
        let index = manifest::check(dir, major, minor, &manifest)?;

        let mut files = Vec::with_capacity(manifest.files.len());
        for f in &manifest.files {
            let path = dir.join(&f.name);
            let file = match File::open(&path) {
                Ok(file) => file,
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    return Err(ImageError::DataFileMissing {
                        image: dir.to_path_buf(),
                        file: f.name.clone(),
                    })
                }
                Err(e) => return Err(ImageError::io(path, e)),
            };
            let actual = file.metadata().map_err(|e| ImageError::io(&path, e))?.len();
            if actual < f.len {
                return Err(ImageError::DataFileTruncated {
                    image: dir.to_path_buf(),
                    file: f.name.clone(),
                    expected: f.len,
                    actual,
                });
            }
            files.push(DataFile {
                name: f.name.clone(),
                path,
                file,
            });
        }

        let summary = summarize(&manifest, &index);
        Ok(Image {
            dir: dir.to_path_buf(),
            buffers: index.buffers,
            chunks: index.chunks,
            files,
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

    /// Reads every chunk and checks its CRC32C, in buffer id then offset order, a few MiB at a
    /// time. Returns the first mismatch ([`ImageError::ChecksumMismatch`]) or I/O error.
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
                let mut crc = 0u32;
                let mut done = 0u64;
                while done < c.len {
                    let n = (c.len - done).min(VERIFY_BLOCK) as usize;
                    let buf = &mut block[..n];
                    f.file
                        .read_exact_at(buf, c.file_offset + done)
                        .map_err(|e| ImageError::io(&f.path, e))?;
                    crc = crc32c::crc32c_append(crc, buf);
                    done += n as u64;
                }
                if crc != c.crc32c {
                    return Err(self.mismatch(f, c));
                }
            }
        }
        Ok(())
    }

    fn mismatch(&self, f: &DataFile, c: &ChunkMsg) -> ImageError {
        ImageError::ChecksumMismatch {
            image: self.dir.clone(),
            file: f.name.clone(),
            buffer: c.buffer,
            offset: c.offset,
        }
    }
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
        if !self.buffers.contains_key(&buffer) {
            return Err(ImageError::UnknownBuffer { buffer });
        }
        let cs = self
            .chunks
            .get(&buffer)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let i = cs
            .binary_search_by_key(&offset, |c| c.offset)
            .map_err(|_| ImageError::MissingChunk { buffer, offset })?;
        let c = &cs[i];
        let len = dst.len() as u64;
        if len != c.len || len > MAX_CHUNK_LEN {
            return Err(ImageError::ChunkOutOfRange {
                buffer,
                offset,
                len,
            });
        }
        let f = &self.files[c.file as usize];
        // Read and checked a piece at a time, so that the checksum reads each piece from the
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
        if crc != c.crc32c {
            return Err(self.mismatch(f, c));
        }
        Ok(())
    }

    fn meta(&self, key: &str) -> Option<String> {
        self.summary.meta.get(key).cloned()
    }
}
