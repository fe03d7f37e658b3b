//! Shared mappings of a whole file, read-only or writable: the one `unsafe` of
//! [`crate::hostmem`].

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// `len` bytes of a file mapped `PROT_READ`, `MAP_SHARED` (its page cache, no copy).
#[derive(Debug)]
pub struct MappedFile {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is read-only and owned by this value; reading it from several threads is
// reading shared immutable memory.
unsafe impl Send for MappedFile {}
// SAFETY: as above.
unsafe impl Sync for MappedFile {}

impl MappedFile {
    /// Maps the first `len` bytes of `file` (which must have at least that many: reading past a
    /// file's end through a mapping raises `SIGBUS`, so callers check the size first).
    pub fn map(file: &File, len: u64) -> io::Result<MappedFile> {
        MappedFile::map_prot(file, len, libc::PROT_READ)
    }

    /// [`MappedFile::map`] with protection `prot`.
    fn map_prot(file: &File, len: u64, prot: libc::c_int) -> io::Result<MappedFile> {
        let len = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        if len == 0 {
            return Ok(MappedFile {
                ptr: std::ptr::null_mut(),
                len: 0,
            });
        }
        // SAFETY: a fresh mapping chosen by the kernel (no address given), of a descriptor we
        // hold open for the call; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(MappedFile { ptr, len })
    }

    /// The mapped bytes. The file must not shrink while they are read (possum's image files
    /// are not changed once written).
    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` is a live mapping of `len` readable bytes until `drop`, which needs
        // `&mut self`, so it outlives the returned borrow.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.len) }
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: unmapping exactly the mapping `map` made; no borrow of it outlives `self`.
            unsafe { libc::munmap(self.ptr, self.len) };
        }
    }
}

/// `len` bytes of a file mapped `PROT_READ | PROT_WRITE`, `MAP_SHARED`: writes go straight into
/// its page cache. On tmpfs, writers of one file through `write(2)` take its lock one at a time;
/// through a mapping, each only faults its own pages in.
#[derive(Debug)]
pub struct MappedFileMut(MappedFile);

impl MappedFileMut {
    /// Maps the first `len` bytes of `file`, opened for reading and writing and at least that
    /// long (`set_len` first).
    pub fn map(file: &File, len: u64) -> io::Result<MappedFileMut> {
        MappedFile::map_prot(file, len, libc::PROT_READ | libc::PROT_WRITE).map(MappedFileMut)
    }

    /// The mapped bytes, to write. The file must not shrink while they are used.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if self.0.len == 0 {
            return &mut [];
        }
        // SAFETY: `ptr` is a live mapping of `len` readable and writable bytes until `drop`,
        // and `&mut self` makes this the only borrow of it.
        unsafe { std::slice::from_raw_parts_mut(self.0.ptr.cast::<u8>(), self.0.len) }
    }
}

/// A [`MappedFileMut`] filled from descriptors by several threads at once, each its own range:
/// the kernel copies into the mapping (`read(2)`), so no Rust reference to the bytes exists
/// while they are written, and a fault the file cannot back (past its end, or the filesystem
/// full) is an error of that `read`, never a `SIGBUS`.
#[derive(Debug)]
pub struct SharedFill(MappedFileMut);

impl SharedFill {
    /// Maps `len` bytes of `file`, opened for reading and writing. The file may be shorter: a
    /// range is filled only once the file reaches past it.
    pub fn map(file: &File, len: u64) -> io::Result<SharedFill> {
        MappedFileMut::map(file, len).map(SharedFill)
    }

    /// The mapping's length.
    pub fn len(&self) -> u64 {
        self.0 .0.len as u64
    }

    /// Reads exactly `len` bytes from `from` into the mapping at `at`. Callers give each
    /// thread ranges no other thread fills, and read the file only once the fills are over.
    pub fn read_into(&self, from: BorrowedFd<'_>, at: u64, len: usize) -> io::Result<()> {
        let in_bounds = at
            .checked_add(len as u64)
            .is_some_and(|end| end <= self.len());
        if !in_bounds {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{len} bytes at {at} lie past the mapping's {} bytes",
                    self.len()
                ),
            ));
        }
        let mut done = 0;
        while done < len {
            // SAFETY: `at + len` is within the live mapping (checked above; it lives until
            // `drop`, which needs the value this borrows), so the kernel writes only mapped
            // bytes; no Rust reference to them exists while it does.
            let n = unsafe {
                libc::read(
                    from.as_raw_fd(),
                    self.0 .0.ptr.cast::<u8>().add(at as usize + done).cast(),
                    len - done,
                )
            };
            match n {
                n if n > 0 => done += n as usize,
                0 => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }
}
