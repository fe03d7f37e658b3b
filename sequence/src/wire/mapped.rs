//! A received file written through a shared mapping of it (part of [`super`]): the streams of a
//! session write their chunks of one file at once, where `pwrite`s into one file would be
//! taken one at a time (the file systems lock a file for each buffered write).
//!
//! Only files this receive created (or took over, moved into its own temporary directory) are
//! mapped: a private directory (mode 0700) of a file of mode 0600 that no one else shortens
//! meanwhile, so that no page of the mapping goes past the file's end. Each write's pages are
//! populated first (`MADV_POPULATE_WRITE`), so that a full disk is an error of that write and
//! not a `SIGBUS`; where the kernel cannot (before Linux 5.14), the write goes through
//! `pwrite` instead. Writes are to ranges no other write has claimed (the receive refuses a
//! chunk that overlaps another before it is written).

#![allow(unsafe_code)]

use std::fs;
use std::io;
use std::os::unix::fs::FileExt;

use rustix::mm::{Advice, MapFlags, ProtFlags};

/// A file of `len` bytes, mapped shared and writable.
pub(super) struct Mapped {
    ptr: *mut u8,
    len: usize,
}

impl std::fmt::Debug for Mapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mapped({} bytes)", self.len)
    }
}

// SAFETY: the mapping is memory of its own, owned by this value until it is dropped; threads
// write disjoint ranges of it (the module's doc), and nothing reads it through this value.
unsafe impl Send for Mapped {}
// SAFETY: as for Send: concurrent writes go to disjoint ranges.
unsafe impl Sync for Mapped {}

impl Mapped {
    /// `file` (already `len` bytes long, and not to be shortened while mapped), mapped for
    /// writing; none where it is empty or cannot be mapped (its writes then go through
    /// `pwrite`).
    pub(super) fn new(file: &fs::File, len: u64) -> Option<Mapped> {
        let len = usize::try_from(len).ok().filter(|l| *l > 0)?;
        // SAFETY: a new mapping at an address the kernel chooses, of a file this receive owns
        // and does not shorten while it is mapped; it aliases no Rust object.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                file,
                0,
            )
        }
        .ok()?;
        Some(Mapped {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Writes `data` at `offset` of `file` (whose mapping this is), a range inside it that no
    /// other write has claimed: its pages populated, then the bytes copied in.
    pub(super) fn write(&self, file: &fs::File, offset: u64, data: &[u8]) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(io::Error::other)?;
        let end = start
            .checked_add(data.len())
            .filter(|e| *e <= self.len)
            .ok_or_else(|| io::Error::other("a write past the end of the mapping"))?;
        if data.is_empty() {
            return Ok(());
        }
        let page = rustix::param::page_size();
        let first = start / page * page;
        // SAFETY: [first, end) lies within the mapping (first <= start, end <= len).
        let populated = unsafe {
            rustix::mm::madvise(
                self.ptr.add(first).cast(),
                end - first,
                Advice::LinuxPopulateWrite,
            )
        };
        match populated {
            Ok(()) => {}
            // A kernel without MADV_POPULATE_WRITE: the same bytes through the file.
            Err(rustix::io::Errno::INVAL) => return file.write_all_at(data, offset),
            Err(e) => return Err(e.into()),
        }
        // SAFETY: [start, end) is within the mapping, its pages populated; no other thread
        // writes this range (claimed by this write), and `data` is not in the mapping.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(start), data.len()) };
        Ok(())
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of `len` bytes, unmapped once; nothing refers to
        // it after this value.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}
