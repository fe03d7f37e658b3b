//! Physical device memory that can be shared between processes (the keeper's): created
//! exportable as a POSIX file descriptor, exported, imported in another process, mapped at an
//! address the caller reserved, and released. Unsafe module, like `driver`: every driver call goes
//! through `check`, and every type here releases what it owns on drop.
//!
//! - [`ShareDevice`]: a device's primary context, opened with [`ShareDevice::open`].
//! - [`SharedMem`]: a physical allocation handle, made by [`ShareDevice::create`] (exportable,
//!   `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`) or [`ShareDevice::import`]
//!   (`cuMemImportFromShareableHandle`); [`SharedMem::export`] gives a new fd for it
//!   (`cuMemExportToShareableHandle`). Dropped: `cuMemRelease` (the memory lives on while another
//!   handle or a mapping refers to it, in this process or another).
//! - [`Reservation`] and [`Mapped`]: an address range (`cuMemAddressReserve`) and a handle mapped
//!   in it with read/write access for the device and its peer devices; a mapping borrows its
//!   reservation, so it is always unmapped before the range is freed.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;
use possum_engine::device::{DeviceError, DeviceResult};

use crate::driver::{self, check, Context};

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

fn invalid(call: &'static str, message: String) -> DeviceError {
    DeviceError::Backend {
        call,
        code: sys::CUresult::CUDA_ERROR_INVALID_VALUE as i64,
        message,
    }
}

fn to_usize(call: &'static str, n: u64) -> DeviceResult<usize> {
    usize::try_from(n).map_err(|_| invalid(call, format!("size {n} does not fit in usize")))
}

macro_rules! call {
    ($f:ident ( $($arg:expr),* $(,)? )) => {{
        // SAFETY: the library is loaded (a `ShareDevice` exists only after `driver::init`), the
        // context is current (each caller binds it first), and the arguments are plain values or
        // out-pointers to locals of the right type, as the driver API documents.
        check(stringify!($f), unsafe { sys::$f($($arg),*) })
    }};
}

/// A device's primary context, for shareable memory.
#[derive(Debug, Clone)]
pub struct ShareDevice {
    ctx: Arc<Context>,
    granularity: u64,
}

impl ShareDevice {
    /// Loads the driver, initialises it and retains device `ordinal`'s primary context.
    pub fn open(ordinal: usize) -> DeviceResult<ShareDevice> {
        driver::init()?;
        let dev = driver::device_get(ordinal)?;
        let ctx = Context::retain_primary(dev)?;
        ctx.bind()?;
        let prop = alloc_prop(dev);
        let mut g = 0usize;
        call!(cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
        ))?;
        Ok(ShareDevice {
            ctx,
            granularity: (g as u64).max(1),
        })
    }

    /// The minimum allocation granularity of exportable memory: sizes and addresses are multiples.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// (free, total) bytes of the device, as the driver says.
    pub fn mem_info(&self) -> DeviceResult<(u64, u64)> {
        self.ctx.bind()?;
        driver::mem_get_info()
    }

    /// The device's UUID (the same in every process whatever its ordinal there).
    pub fn uuid(&self) -> DeviceResult<[u8; 16]> {
        driver::device_uuid(self.ctx.device())
    }

    /// Creates `size` bytes (a multiple of [`granularity`](Self::granularity)) of physical memory
    /// exportable as a POSIX fd.
    pub fn create(&self, size: u64) -> DeviceResult<SharedMem> {
        self.check_size("cuMemCreate", size)?;
        self.ctx.bind()?;
        let handle = driver::mem_create(&alloc_prop(self.ctx.device()), size)?;
        Ok(self.shared(handle, size))
    }

    /// Imports `fd` like [`ShareDevice::import`] and keeps it: the driver refuses to export an
    /// imported handle again (`cuMemExportToShareableHandle` answers CUDA_ERROR_INVALID_VALUE on
    /// the H100, driver 580), so [`SharedMem::export`] of adopted memory hands out duplicates of
    /// this fd instead, which import as the same memory.
    pub fn adopt(&self, fd: OwnedFd, size: u64) -> DeviceResult<SharedMem> {
        let mut mem = self.import(fd.as_fd(), size)?;
        mem.source = Some(fd);
        Ok(mem)
    }

    /// Imports memory another process (or this one) exported as `fd`; `size` is its size, as the
    /// exporter said. The fd stays the caller's (the driver takes its own reference).
    pub fn import(&self, fd: BorrowedFd<'_>, size: u64) -> DeviceResult<SharedMem> {
        self.check_size("cuMemImportFromShareableHandle", size)?;
        self.ctx.bind()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // For POSIX_FILE_DESCRIPTOR the driver takes the fd itself in the pointer argument.
        let os_handle = fd.as_raw_fd() as isize as *mut c_void;
        call!(cuMemImportFromShareableHandle(
            &mut handle,
            os_handle,
            POSIX_FD
        ))?;
        Ok(self.shared(handle, size))
    }

    /// `handle`, `size` bytes, as memory of this device's context.
    fn shared(&self, handle: sys::CUmemGenericAllocationHandle, size: u64) -> SharedMem {
        SharedMem {
            handle,
            size,
            ctx: self.ctx.clone(),
            source: None,
        }
    }

    /// Pinned host memory for copies into memory mapped here (the keeper loading an image).
    pub fn pinned(&self, len: usize) -> DeviceResult<driver::PinnedBuf> {
        self.ctx.bind()?;
        driver::pinned(&self.ctx, len)
    }

    /// A stream of this context's, for such copies.
    pub fn stream(&self) -> DeviceResult<driver::CudaStream> {
        self.ctx.bind()?;
        driver::CudaStream::create(&self.ctx, 0)
    }

    /// Reserves `size` bytes of device address space (a multiple of the granularity).
    pub fn reserve(&self, size: u64) -> DeviceResult<Reservation> {
        self.check_size("cuMemAddressReserve", size)?;
        self.ctx.bind()?;
        let va = driver::address_reserve(size, self.granularity)?;
        Ok(Reservation {
            va,
            size,
            ctx: self.ctx.clone(),
        })
    }

    fn check_size(&self, call: &'static str, size: u64) -> DeviceResult<()> {
        if size == 0 || size % self.granularity != 0 {
            return Err(invalid(
                call,
                format!(
                    "size {size} is not a positive multiple of the granularity {}",
                    self.granularity
                ),
            ));
        }
        Ok(())
    }
}

/// Device memory on `dev`, pinned, exportable as a POSIX fd.
fn alloc_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    driver::device_alloc_prop_with(dev, POSIX_FD)
}

/// A handle on shareable physical memory; `cuMemRelease` on drop.
pub struct SharedMem {
    handle: sys::CUmemGenericAllocationHandle,
    size: u64,
    ctx: Arc<Context>,
    /// The fd it was adopted from ([`ShareDevice::adopt`]), which `export` duplicates.
    source: Option<OwnedFd>,
}

driver::debug_hex_and_size!(SharedMem, handle);

impl SharedMem {
    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// A new POSIX fd for this memory (`cuMemExportToShareableHandle`), to pass to another
    /// process (SCM_RIGHTS), which imports it with [`ShareDevice::import`].
    pub fn export(&self) -> DeviceResult<OwnedFd> {
        if let Some(fd) = &self.source {
            return fd.try_clone().map_err(|e| {
                invalid(
                    "cuMemExportToShareableHandle",
                    format!("duplicating the adopted fd: {e}"),
                )
            });
        }
        self.ctx.bind()?;
        let mut fd: std::ffi::c_int = -1;
        call!(cuMemExportToShareableHandle(
            (&mut fd as *mut std::ffi::c_int).cast(),
            self.handle,
            POSIX_FD,
            0
        ))?;
        if fd < 0 {
            return Err(invalid(
                "cuMemExportToShareableHandle",
                format!("the driver answered fd {fd}"),
            ));
        }
        // SAFETY: on success the driver hands the caller a new open descriptor, owned by no one
        // else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Maps all of it at `offset` in `res` with read/write access for the device and its peer
    /// devices. On failure nothing stays mapped.
    pub fn map<'r>(&self, res: &'r Reservation, offset: u64) -> DeviceResult<Mapped<'r>> {
        let end = offset.checked_add(self.size);
        if !matches!(end, Some(e) if e <= res.size) {
            return Err(invalid(
                "cuMemMap",
                format!(
                    "{} bytes at offset {offset} do not fit the {}-byte reservation",
                    self.size, res.size
                ),
            ));
        }
        self.ctx.bind()?;
        let va = res.va + offset;
        let size = to_usize("cuMemMap", self.size)?;
        call!(cuMemMap(va, size, 0, self.handle, 0))?;
        if let Err(e) = driver::set_access(va, size, self.ctx.device()) {
            let _ = driver::unmap(va, self.size);
            return Err(e);
        }
        Ok(Mapped {
            va,
            size: self.size,
            ctx: self.ctx.clone(),
            _res: res,
        })
    }
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            let _ = call!(cuMemRelease(self.handle));
        }
    }
}

/// A reserved device address range; freed on drop (its mappings, which borrow it, are gone by
/// then).
pub struct Reservation {
    va: u64,
    size: u64,
    ctx: Arc<Context>,
}

driver::debug_hex_and_size!(Reservation, va);

impl Reservation {
    /// The range's first device address.
    pub fn va(&self) -> u64 {
        self.va
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            let _ = driver::address_free(self.va, self.size);
        }
    }
}

/// Memory mapped in a [`Reservation`]; unmapped on drop.
pub struct Mapped<'r> {
    va: u64,
    size: u64,
    ctx: Arc<Context>,
    _res: &'r Reservation,
}

impl fmt::Debug for Mapped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mapped")
            .field("va", &format_args!("{:#x}", self.va))
            .field("size", &self.size)
            .finish()
    }
}

impl Mapped<'_> {
    /// The mapping's device address.
    pub fn va(&self) -> u64 {
        self.va
    }

    fn range(&self, call: &'static str, offset: u64, len: usize) -> DeviceResult<u64> {
        span(call, self.va, self.size, offset, len)
    }

    /// Copies `data` to the device at `offset` (synchronous, `cuMemcpyHtoD_v2`).
    pub fn write(&self, offset: u64, data: &[u8]) -> DeviceResult<()> {
        let dst = self.range("cuMemcpyHtoD_v2", offset, data.len())?;
        self.ctx.bind()?;
        call!(cuMemcpyHtoD_v2(dst, data.as_ptr().cast(), data.len()))
    }

    /// Copies `out.len()` bytes from the device at `offset` (synchronous, `cuMemcpyDtoH_v2`).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> DeviceResult<()> {
        let src = self.range("cuMemcpyDtoH_v2", offset, out.len())?;
        self.ctx.bind()?;
        call!(cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src, out.len()))
    }
}

impl Drop for Mapped<'_> {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            let _ = driver::unmap(self.va, self.size);
        }
    }
}

/// The device address of `len` bytes at `offset` of a mapping of `size` bytes at `va`.
fn span(call: &'static str, va: u64, size: u64, offset: u64, len: usize) -> DeviceResult<u64> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= size => Ok(va + offset),
        _ => Err(invalid(
            call,
            format!("{len} bytes at offset {offset} outside the {size}-byte mapping"),
        )),
    }
}

/// Memory mapped at an address range of its own (reserved for it): unmapped, then the range
/// freed, on drop. Unlike [`Mapped`] it borrows nothing, so other threads may hold it.
pub struct OwnedMapping {
    /// Mapped from its start; freed after the unmap (fields drop after `drop` ran).
    res: Reservation,
    size: u64,
}

impl fmt::Debug for OwnedMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedMapping")
            .field("va", &format_args!("{:#x}", self.res.va))
            .field("size", &self.size)
            .finish()
    }
}

impl ShareDevice {
    /// Maps all of `mem` at a new address range (read/write for the device).
    pub fn map_owned(&self, mem: &SharedMem) -> DeviceResult<OwnedMapping> {
        let res = self.reserve(mem.size())?;
        // The mapping is undone by the returned value's drop instead of this `Mapped`'s (which
        // borrows `res`, moved into it).
        std::mem::forget(mem.map(&res, 0)?);
        Ok(OwnedMapping {
            res,
            size: mem.size(),
        })
    }
}

impl OwnedMapping {
    fn range(&self, call: &'static str, offset: u64, len: usize) -> DeviceResult<u64> {
        span(call, self.res.va, self.size, offset, len)
    }
}

impl Drop for OwnedMapping {
    fn drop(&mut self) {
        if self.res.ctx.bind().is_ok() {
            let _ = driver::unmap(self.res.va, self.size);
        }
    }
}

/// A file mapped shared, its pages faulted in for writing and registered with CUDA (page-locked: the copy
/// engine writes them directly, at full speed), for image memory prepared ahead of a drain (the
/// keeper's spare). Registered a step at a time (each `cuMemHostRegister` of a few GiB holds the
/// driver for long: other processes' memory calls on the GPU wait meanwhile), so a copy that
/// crosses a step is split there. Unregistered and unmapped on drop; the file itself stays.
/// Fills of overlapping ranges at once are refused.
pub struct RegisteredFile {
    ptr: *mut u8,
    len: usize,
    /// Bytes per registration (the last may be shorter).
    step: usize,
    /// Bytes registered from the start (all of `len` once made).
    registered: usize,
    ctx: Arc<Context>,
    /// The ranges being filled now.
    busy: parking_lot::Mutex<Vec<(usize, usize)>>,
}

// SAFETY: `ptr` is a shared mapping this value owns until drop; the bytes are only touched by
// `fill`, whose ranges are claimed exclusively in `busy` first.
unsafe impl Send for RegisteredFile {}
// SAFETY: as above.
unsafe impl Sync for RegisteredFile {}

impl fmt::Debug for RegisteredFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredFile")
            .field("len", &self.len)
            .field("step", &self.step)
            .finish()
    }
}

impl ShareDevice {
    /// Maps the first `len` bytes of `file` (which must be at least that long) shared, faults
    /// them in and registers them with CUDA, `step` bytes at a time (rounded up to whole 2 MiB),
    /// calling `before_step` before each (it may wait, e.g. while a checkpoint holds the GPU).
    pub fn register_file(
        &self,
        file: &std::fs::File,
        len: u64,
        step: u64,
        mut before_step: impl FnMut(),
    ) -> DeviceResult<RegisteredFile> {
        let len = to_usize("mmap", len)?;
        if len == 0 {
            return Err(invalid("mmap", "an empty file".into()));
        }
        let step = to_usize("mmap", step.max(1).next_multiple_of(2 << 20))?;
        // SAFETY: a fresh shared mapping of an open file, at an address the kernel picks.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(invalid(
                "mmap",
                format!("{len} bytes: {}", std::io::Error::last_os_error()),
            ));
        }
        // From here on, a failure drops it: what was registered is unregistered, then unmapped.
        let mut reg = RegisteredFile {
            ptr: ptr.cast(),
            len,
            step,
            registered: 0,
            ctx: Arc::clone(&self.ctx),
            busy: parking_lot::Mutex::new(Vec::new()),
        };
        while reg.registered < len {
            before_step();
            let n = step.min(len - reg.registered);
            // SAFETY: inside the mapping just made.
            let at = unsafe { reg.ptr.add(reg.registered) };
            // Its pages allocated (and zeroed) now, for writing, as a drain will: registration
            // then finds them present. A kernel without MADV_POPULATE_WRITE (before 5.14)
            // leaves that to the registration.
            // SAFETY: `n` bytes of the mapping, not used by anything else yet.
            unsafe { libc::madvise(at.cast(), n, libc::MADV_POPULATE_WRITE) };
            self.ctx.bind()?;
            call!(cuMemHostRegister_v2(at.cast(), n, 0))?;
            reg.registered += n;
        }
        Ok(reg)
    }
}

impl RegisteredFile {
    /// Its length.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether it is empty (never: `register_file` refuses that).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `len` bytes of `src` from `src_offset` into the file at `at` (into the registered
    /// pages, on `stream`, waited for; several threads, each with a stream of its own, keep the
    /// copy engine busy), then hands the bytes to `check` (a checksum) while the range is still
    /// this call's.
    pub fn fill<R>(
        &self,
        stream: &driver::CudaStream,
        at: u64,
        src: &OwnedMapping,
        src_offset: u64,
        len: usize,
        check: impl FnOnce(&[u8]) -> R,
    ) -> DeviceResult<R> {
        let start = to_usize("cuMemcpyDtoH_v2", at)?;
        let end = match start.checked_add(len) {
            Some(end) if end <= self.len && len > 0 => end,
            _ => {
                return Err(invalid(
                    "cuMemcpyDtoH_v2",
                    format!("{len} bytes at {at} outside the {}-byte file", self.len),
                ))
            }
        };
        let s = src.range("cuMemcpyDtoH_v2", src_offset, len)?;
        {
            let mut busy = self.busy.lock();
            if busy.iter().any(|&(a, b)| start < b && a < end) {
                return Err(invalid(
                    "cuMemcpyDtoH_v2",
                    format!("bytes {start}..{end} of the file are being filled already"),
                ));
            }
            busy.push((start, end));
        }
        let r = (|| {
            self.ctx.bind()?;
            // One copy per registration the range touches.
            let mut pos = start;
            while pos < end {
                let piece_end = end.min((pos / self.step + 1) * self.step);
                // SAFETY: `pos..piece_end` lies inside the mapping (checked) and is this call's
                // alone (claimed in `busy`); the destination is registered, the source a live
                // mapping.
                let dst = unsafe { self.ptr.add(pos) };
                call!(cuMemcpyDtoHAsync_v2(
                    dst.cast(),
                    s + (pos - start) as u64,
                    piece_end - pos,
                    stream.raw()
                ))?;
                pos = piece_end;
            }
            stream.synchronize()?;
            // SAFETY: as above; the copies have completed, nothing else writes there.
            let bytes = unsafe { std::slice::from_raw_parts(self.ptr.add(start), len) };
            Ok(check(bytes))
        })();
        self.busy.lock().retain(|&r| r != (start, end));
        r
    }
}

impl Drop for RegisteredFile {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            for off in (0..self.registered).step_by(self.step) {
                // SAFETY: each registration's start, inside the mapping.
                let p = unsafe { self.ptr.add(off) };
                let _ = call!(cuMemHostUnregister(p.cast()));
            }
        }
        // SAFETY: the mapping this value made; no fill is running (they borrow `self`).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Memory another process shared with this one (an fd it exported), imported and mapped at an
/// address of the caller's own reservation, with read/write access for the caller's device and
/// its peers: NCCL maps its peers' buffers so. Dropped, the handle is released and the mapping
/// stays (the driver keeps the memory while it is mapped); [`PeerMapping::unmap`] ends both.
#[derive(Debug)]
pub struct PeerMapping {
    mem: driver::PhysMem,
    va: u64,
}

impl PeerMapping {
    /// Imports the `size` bytes `fd` shares in device `ordinal`'s primary context (the
    /// caller's, made current on this thread as the CUDA runtime has it) and maps them at `va`.
    /// On failure nothing stays mapped or imported. The fd stays the caller's.
    pub fn map(ordinal: usize, fd: BorrowedFd<'_>, size: u64, va: u64) -> DeviceResult<Self> {
        driver::init()?;
        let ctx = Context::retain_primary(driver::device_get(ordinal)?)?;
        ctx.bind()?;
        let mem = driver::PhysMem::import(&ctx, fd, size)?;
        mem.map_at(va)?;
        Ok(PeerMapping { mem, va })
    }

    /// Unmaps it and releases the handle (the memory stays its owner's).
    pub fn unmap(self) -> DeviceResult<()> {
        driver::unmap(self.va, self.mem.size())?;
        self.mem.release()
    }
}
