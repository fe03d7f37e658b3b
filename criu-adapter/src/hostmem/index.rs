//! The index of a process's moved pages (`possum-hostmem-PID.idx`, docs/image-format.md), the
//! names of its files, and what can go wrong with them (part of [`super`]).

use std::io;
use std::path::{Path, PathBuf};

use crate::images::{ImageError, PAGE_SIZE};

/// Index magic and versions: 1, one data file; 2, the data in parts ([`Index::part_bytes`]);
/// 3, the data in files of their own lengths, one after another ([`Index::more`]).
const INDEX_MAGIC: &[u8; 8] = b"PSMHOST1";
const INDEX_VERSION: u32 = 1;
const INDEX_VERSION_PARTS: u32 = 2;
const INDEX_VERSION_FILES: u32 = 3;

/// What can go wrong splitting an image or filling a process.
#[derive(Debug, thiserror::Error)]
pub enum HostMemError {
    /// A CRIU image could not be read or is malformed.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// possum's index of moved pages is corrupt or does not match its data file.
    #[error("{}: {detail}", path.display())]
    Index {
        /// The index.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// Writing into the restored process failed.
    #[error(
        "writing {len} bytes at {addr:#x} into restored process {pid}: {detail} \
         (its memory is incomplete)"
    )]
    Fill {
        /// The process.
        pid: i32,
        /// Where.
        addr: u64,
        /// How much.
        len: u64,
        /// Why.
        detail: String,
    },
}

pub(super) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> HostMemError + '_ {
    move |source| HostMemError::Io {
        path: path.into(),
        source,
    }
}

/// One run of moved bytes: `len` bytes at `vaddr` in the process are at `offset` in the data file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// Address in the process.
    pub vaddr: u64,
    /// Offset in the data file.
    pub offset: u64,
    /// Length (whole pages).
    pub len: u64,
}

/// `possum-hostmem-PID.idx`: where a process's moved pages are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Index {
    /// The data file's name, in the same directory.
    pub data_file: String,
    /// The data's length: the data file's size when split (with [`Index::more`], all of the
    /// files').
    pub data_len: u64,
    /// 0: the data is the one file `data_file`. Otherwise it is stored in parts of this many
    /// bytes (the last shorter), `data_file.0`, `data_file.1`, ...: each can be written by a
    /// thread of its own (a filesystem serializes the writes into one file), which a migration's
    /// receiver does. The runs' offsets are in the data as a whole.
    pub part_bytes: u64,
    /// Files that follow `data_file` in the data, each with its length (none: the data is
    /// `data_file`, or its parts); `data_file` then holds the first `data_len` less theirs.
    pub more: Vec<(String, u64)>,
    /// The runs, in address order.
    pub ranges: Vec<Range>,
}

impl Index {
    /// Total bytes moved (saturating: a corrupt index's runs may add up past `u64::MAX`).
    pub fn bytes(&self) -> u64 {
        self.ranges
            .iter()
            .fold(0u64, |sum, r| sum.saturating_add(r.len))
    }

    /// The data's files, each with its length, in order: `data_file` alone, its parts, or it
    /// and the files after it.
    pub fn files(&self) -> Vec<(String, u64)> {
        if !self.more.is_empty() {
            let rest: u64 = self.more.iter().map(|(_, l)| l).sum();
            let first = (self.data_file.clone(), self.data_len.saturating_sub(rest));
            return std::iter::once(first).chain(self.more.clone()).collect();
        }
        if self.part_bytes == 0 {
            return vec![(self.data_file.clone(), self.data_len)];
        }
        let n = self.data_len.div_ceil(self.part_bytes);
        (0..n)
            .map(|k| {
                let len = (self.data_len - k * self.part_bytes).min(self.part_bytes);
                (format!("{}.{k}", self.data_file), len)
            })
            .collect()
    }

    /// The file's bytes: magic, version, data file name and size (and, in parts, the part's
    /// size; with more files, their number, and each one's name and length), the runs, CRC32C
    /// of it all.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(48 + self.data_file.len() + 24 * self.ranges.len());
        out.extend_from_slice(INDEX_MAGIC);
        let version = match (self.more.is_empty(), self.part_bytes) {
            (false, _) => INDEX_VERSION_FILES,
            (true, 0) => INDEX_VERSION,
            (true, _) => INDEX_VERSION_PARTS,
        };
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&(self.data_file.len() as u32).to_le_bytes());
        out.extend_from_slice(self.data_file.as_bytes());
        out.extend_from_slice(&self.data_len.to_le_bytes());
        if version == INDEX_VERSION_PARTS {
            out.extend_from_slice(&self.part_bytes.to_le_bytes());
        }
        if version == INDEX_VERSION_FILES {
            out.extend_from_slice(&(self.more.len() as u32).to_le_bytes());
            for (name, len) in &self.more {
                out.extend_from_slice(&(name.len() as u32).to_le_bytes());
                out.extend_from_slice(name.as_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
        }
        out.extend_from_slice(&(self.ranges.len() as u64).to_le_bytes());
        for r in &self.ranges {
            for v in [r.vaddr, r.offset, r.len] {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Parses and checks an index read from `path`.
    pub fn decode(bytes: &[u8], path: &Path) -> Result<Index, HostMemError> {
        let bad = |detail: &str| HostMemError::Index {
            path: path.into(),
            detail: detail.into(),
        };
        if bytes.len() < INDEX_MAGIC.len() + 4 || &bytes[..8] != INDEX_MAGIC {
            return Err(bad("not a possum host-memory index"));
        }
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        let crc = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
        if crc32c::crc32c(body) != crc {
            return Err(bad("checksum mismatch (the index is corrupt)"));
        }
        let mut at = 8;
        let mut take = |n: usize| -> Result<&[u8], HostMemError> {
            let s = body.get(at..at + n).ok_or_else(|| bad("cut short"))?;
            at += n;
            Ok(s)
        };
        let u32_at = |s: &[u8]| u32::from_le_bytes(s.try_into().expect("4 bytes"));
        let u64_at = |s: &[u8]| u64::from_le_bytes(s.try_into().expect("8 bytes"));
        let version = u32_at(take(4)?);
        if ![INDEX_VERSION, INDEX_VERSION_PARTS, INDEX_VERSION_FILES].contains(&version) {
            return Err(bad(&format!(
                "version {version}; this possum reads versions {INDEX_VERSION} to \
                 {INDEX_VERSION_FILES}"
            )));
        }
        let plain = |raw: &[u8]| -> Result<String, HostMemError> {
            let n =
                String::from_utf8(raw.to_vec()).map_err(|_| bad("data file name is not UTF-8"))?;
            if n.is_empty() || n == "." || n == ".." || n.contains(['/', '\0']) {
                return Err(bad("data file name is not a plain file name"));
            }
            Ok(n)
        };
        let name_len = u32_at(take(4)?) as usize;
        let data_file = plain(take(name_len)?)?;
        let data_len = u64_at(take(8)?);
        let part_bytes = if version == INDEX_VERSION_PARTS {
            let p = u64_at(take(8)?);
            // Parts of whole pages, no more of them than a directory holds.
            if p == 0 || !p.is_multiple_of(PAGE_SIZE) || data_len.div_ceil(p) > MAX_PARTS {
                return Err(bad(&format!(
                    "parts of {p} bytes: not whole pages, or more than {MAX_PARTS} of them"
                )));
            }
            p
        } else {
            0
        };
        let mut more = Vec::new();
        if version == INDEX_VERSION_FILES {
            let n = u32_at(take(4)?);
            if n == 0 || u64::from(n) >= MAX_PARTS {
                return Err(bad(&format!("{n} more data files: none, or too many")));
            }
            let mut rest = 0u64;
            for _ in 0..n {
                let name_len = u32_at(take(4)?) as usize;
                let f = plain(take(name_len)?)?;
                let len = u64_at(take(8)?);
                rest = rest
                    .checked_add(len)
                    .filter(|&r| r <= data_len)
                    .ok_or_else(|| {
                        bad(&format!(
                            "the data files add up to more than its {data_len} bytes"
                        ))
                    })?;
                more.push((f, len));
            }
        }
        let count = u64_at(take(8)?);
        let mut ranges = Vec::new();
        // The runs are disjoint pieces of the data file, so together they are no longer than it:
        // this bounds the work a fill plans (and `bytes`) whatever the index says.
        let mut total = 0u64;
        for _ in 0..count {
            let r = Range {
                vaddr: u64_at(take(8)?),
                offset: u64_at(take(8)?),
                len: u64_at(take(8)?),
            };
            if r.offset.checked_add(r.len).is_none_or(|end| end > data_len)
                || r.vaddr.checked_add(r.len).is_none()
                || !r.vaddr.is_multiple_of(PAGE_SIZE)
                || !r.len.is_multiple_of(PAGE_SIZE)
            {
                return Err(bad(&format!(
                    "run {r:?} outside the data file or the address space, or unaligned"
                )));
            }
            total = match total.checked_add(r.len) {
                Some(t) if t <= data_len => t,
                _ => {
                    return Err(bad(&format!(
                        "runs add up to more than the data file's {data_len} bytes"
                    )))
                }
            };
            ranges.push(r);
        }
        if at != body.len() {
            return Err(bad("trailing bytes"));
        }
        Ok(Index {
            data_file,
            data_len,
            part_bytes,
            more,
            ranges,
        })
    }
}

/// The most parts a data file may have (a 1 TiB process in 64 MiB parts).
pub(super) const MAX_PARTS: u64 = 1 << 14;

/// The size of the parts a data file of `len` bytes is sent in, `wanted` where that makes no
/// more than [`MAX_PARTS`] of them (a reader refuses more), else the least size, in MiB, that
/// does; never under a page.
pub fn part_bytes_for(len: u64, wanted: u64) -> u64 {
    let least = len.div_ceil(MAX_PARTS).next_multiple_of(1 << 20);
    wanted.max(least).next_multiple_of(PAGE_SIZE)
}

/// `DIR/possum-hostmem-PID.idx`.
pub fn index_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("possum-hostmem-{pid}.idx"))
}

/// The name of the data file of `pid`'s moved pages (`pid` as CRIU's process tree names it).
pub fn data_name(pid: u32) -> String {
    format!("possum-hostmem-{pid}.pages")
}
