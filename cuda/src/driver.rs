//! The unsafe layer over the driver for the backend (the other modules with `unsafe` code are
//! `introspect`, the job's own objects for the interposer, `checkpoint`, the driver's
//! checkpoint of another process, and `share`, memory shared between processes).
//!
//! Thin wrappers over the CUDA driver API as cudarc's `sys` layer exposes it (loaded with `dlopen` at
//! run time, so nothing of CUDA is needed to build), plus RAII types for the driver objects possum
//! owns. Rules this module keeps:
//!
//! - Every driver call goes through [`check`] (or [`check_async`]), so every failure becomes a
//!   [`DeviceError`] that names the call and carries the driver's code and description.
//! - Every function and method here is safe to call, with one exception ([`CudaStream::borrow_raw`],
//!   an `unsafe fn` whose contract the caller keeps). Their soundness does not depend on callers.
//! - Device addresses are not host memory. A wrong device address makes the driver refuse the call or
//!   the GPU fault (the context then reports a sticky error); it never corrupts host memory. The layer
//!   above validates addresses against its own tables before it gets here.
//! - Host memory the device reads or writes asynchronously belongs to a [`CudaPending`] until the copy
//!   is known to be complete; if that can't be established, the memory is leaked rather than freed.
//! - Driver calls need a current context. Methods of the layer above bind the device's context first
//!   ([`Context::bind`]); destructors here bind it themselves.
//!
//! Before any other function here, [`load`] must have succeeded: cudarc's loader panics on a missing
//! library or symbol, and [`load`] is what checks both without panicking.
#![allow(unsafe_code)]

use std::ffi::{c_void, CStr};
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use possum_engine::backend::{
    self, backend_error, check_call, CopyEvent, CopyStream, Pinned, PinnedAlloc,
};
use possum_engine::device::{DeviceError, DeviceResult, HostBuffer};

pub use sys::{CUcontext, CUdevice, CUresult, CUstream};

/// Every driver entry point this crate calls. [`load`] looks each up once, so that a driver too old
/// for one is an error here instead of a panic inside cudarc's loader later.
const SYMBOLS: &[&str] = &[
    "cuGetErrorString",
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetUuid_v2",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxGetStreamPriorityRange",
    "cuCtxSynchronize",
    "cuMemGetInfo_v2",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemGetAddressRange_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuStreamCreateWithPriority",
    "cuStreamGetPriority",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD8Async",
    // share.rs
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemcpyHtoD_v2",
    // introspect.rs
    "cuFuncGetParamInfo",
    "cuKernelGetParamInfo",
    "cuFuncGetName",
    "cuKernelGetName",
    "cuCtxGetDevice",
    "cuStreamIsCapturing",
    "cuMemcpyDtoH_v2",
    "cuGraphGetNodes",
    "cuGraphNodeGetType",
    "cuGraphKernelNodeGetParams_v2",
    "cuGraphMemsetNodeGetParams",
];

static LOADED: OnceLock<Result<(), String>> = OnceLock::new();

/// Loads libcuda (once per process) and checks it has every entry point this crate calls.
///
/// `Err` says why the driver can't be used: no library, or one lacking a symbol.
pub fn load() -> Result<(), String> {
    LOADED
        .get_or_init(|| {
            // SAFETY: only dlopens the candidate names cudarc knows for libcuda and closes them again;
            // libcuda's initialisers have no preconditions.
            if !unsafe { sys::is_culib_present() } {
                return Err(
                    "libcuda.so.1 not found by dlopen (is the NVIDIA driver installed, \
                     and its directory on LD_LIBRARY_PATH or in ld.so.conf?)"
                        .to_string(),
                );
            }
            // SAFETY: `culib` panics only when no candidate loads, and one just did.
            let lib = unsafe { sys::culib() };
            for name in SYMBOLS {
                // SAFETY: looks the symbol up without calling it; the pointer is dropped at once.
                if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
                    return Err(format!("libcuda has no {name} (driver too old?)"));
                }
            }
            Ok(())
        })
        .clone()
}

fn loaded() -> bool {
    matches!(LOADED.get(), Some(Ok(())))
}

/// The driver's name and description of `r`: "CUDA_ERROR_OUT_OF_MEMORY: out of memory".
pub fn describe(r: CUresult) -> String {
    let name = format!("{r:?}");
    if !loaded() {
        return name;
    }
    let mut s: *const std::ffi::c_char = ptr::null();
    // SAFETY: the library is loaded (checked above) and `s` is a valid out-pointer.
    let ok = unsafe { sys::cuGetErrorString(r, &mut s) };
    if ok != CUresult::CUDA_SUCCESS || s.is_null() {
        return name;
    }
    // SAFETY: on success the driver points `s` at a static NUL-terminated string.
    let text = unsafe { CStr::from_ptr(s) }.to_string_lossy();
    format!("{name}: {text}")
}

/// `Ok` for `CUDA_SUCCESS`, else a [`DeviceError::Backend`] naming `call`.
pub fn check(call: &'static str, r: CUresult) -> DeviceResult<()> {
    check_call(call, r == CUresult::CUDA_SUCCESS, r as i64, || describe(r))
}

/// The answer of a `cu*Query` call `call`: done, not ready yet, or failed.
fn ready(call: &'static str, r: CUresult) -> DeviceResult<bool> {
    if r == CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check_async(call, r).map(|()| true)
}

/// Like [`check`], for calls that wait for earlier asynchronous work: their errors are that work's,
/// so they become [`DeviceError::StreamFailed`].
pub fn check_async(call: &'static str, r: CUresult) -> DeviceResult<()> {
    backend::as_stream_failure(check(call, r))
}

/// Whether `e` is the driver saying it is out of memory.
pub fn is_out_of_memory(e: &DeviceError) -> bool {
    matches!(e, DeviceError::Backend { code, .. } if *code == CUresult::CUDA_ERROR_OUT_OF_MEMORY as i64)
}

macro_rules! call {
    ($f:ident ( $($arg:expr),* $(,)? )) => {{
        // SAFETY: the library is loaded (every path here starts at `load`), and the arguments are
        // plain values or out-pointers to locals of the right type, as the driver API documents.
        check(stringify!($f), unsafe { sys::$f($($arg),*) })
    }};
}

/// `cuInit(0)`.
pub fn init() -> DeviceResult<()> {
    load().map_err(|message| DeviceError::Backend {
        call: "dlopen(libcuda)",
        code: -1,
        message,
    })?;
    call!(cuInit(0))
}

/// The driver's CUDA version, e.g. 13000.
pub fn driver_version() -> DeviceResult<i32> {
    let mut v = 0;
    call!(cuDriverGetVersion(&mut v))?;
    Ok(v)
}

/// How many devices the driver sees.
pub fn device_count() -> DeviceResult<usize> {
    let mut n = 0;
    call!(cuDeviceGetCount(&mut n))?;
    Ok(n.max(0) as usize)
}

/// The device handle for `ordinal`.
pub fn device_get(ordinal: usize) -> DeviceResult<CUdevice> {
    let ordinal = i32::try_from(ordinal).map_err(|_| DeviceError::Backend {
        call: "cuDeviceGet",
        code: CUresult::CUDA_ERROR_INVALID_DEVICE as i64,
        message: format!("device ordinal {ordinal} out of range"),
    })?;
    let mut dev: CUdevice = 0;
    call!(cuDeviceGet(&mut dev, ordinal))?;
    Ok(dev)
}

/// The device's marketing name.
pub fn device_name(dev: CUdevice) -> DeviceResult<String> {
    let mut buf = [0 as std::ffi::c_char; 256];
    call!(cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev))?;
    // The driver NUL-terminates within `len`; the last byte is forced to NUL all the same.
    buf[buf.len() - 1] = 0;
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The device's UUID (`cuDeviceGetUuid_v2`): the same in every process, whatever each one's
/// `CUDA_VISIBLE_DEVICES` makes its ordinal.
pub fn device_uuid(dev: CUdevice) -> DeviceResult<[u8; 16]> {
    let mut u = sys::CUuuid {
        bytes: [0 as std::ffi::c_char; 16],
    };
    call!(cuDeviceGetUuid_v2(&mut u, dev))?;
    Ok(u.bytes.map(|b| b as u8))
}

/// A retained primary context: the one the CUDA runtime (and so PyTorch) uses on the same device, so
/// memory, streams and events made through it are usable by the job and the other way round.
#[derive(Debug)]
pub struct Context {
    dev: CUdevice,
    raw: CUcontext,
}

// SAFETY: a CUcontext is a handle the driver lets any thread use (and make current); this type only
// reads the handle and releases its reference once, on drop.
unsafe impl Send for Context {}
// SAFETY: as above; no method mutates the handle.
unsafe impl Sync for Context {}

impl Context {
    /// Retains `dev`'s primary context (creating it if no one has yet).
    pub fn retain_primary(dev: CUdevice) -> DeviceResult<Arc<Context>> {
        let mut raw: CUcontext = ptr::null_mut();
        call!(cuDevicePrimaryCtxRetain(&mut raw, dev))?;
        Ok(Arc::new(Context { dev, raw }))
    }

    /// Makes this context current on the calling thread, if it is not already. Costs one
    /// thread-local read in the driver when it already is.
    pub fn bind(&self) -> DeviceResult<()> {
        let mut cur: CUcontext = ptr::null_mut();
        call!(cuCtxGetCurrent(&mut cur))?;
        if cur != self.raw {
            call!(cuCtxSetCurrent(self.raw))?;
        }
        Ok(())
    }

    /// The raw handle, for interop (e.g. comparing with the job's context). Still owned by `self`.
    pub fn raw(&self) -> CUcontext {
        self.raw
    }

    /// The device this context is on.
    pub fn device(&self) -> CUdevice {
        self.dev
    }

    /// Blocks until all work queued in the context (by anyone, the job included) has completed.
    pub fn synchronize(&self) -> DeviceResult<()> {
        self.bind()?;
        // SAFETY: the library is loaded and the context is current.
        check_async("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// The per-thread stack size the context reserves local memory for (`CU_LIMIT_STACK_SIZE`),
    /// bytes.
    pub fn stack_limit(&self) -> DeviceResult<usize> {
        self.bind()?;
        let mut v = 0usize;
        call!(cuCtxGetLimit(&mut v, sys::CUlimit::CU_LIMIT_STACK_SIZE))?;
        Ok(v)
    }

    /// Sets the per-thread stack size (`cuCtxSetLimit(CU_LIMIT_STACK_SIZE)`): the driver waits for
    /// the context's work and reallocates its local memory for every thread the device can run
    /// (on an H100, 1 KiB per thread is 264 MiB), the larger the more.
    pub fn set_stack_limit(&self, bytes: usize) -> DeviceResult<()> {
        self.bind()?;
        call!(cuCtxSetLimit(sys::CUlimit::CU_LIMIT_STACK_SIZE, bytes))
    }

    /// (least, greatest) stream priority. Greatest is numerically the smallest.
    pub fn stream_priority_range(&self) -> DeviceResult<(i32, i32)> {
        self.bind()?;
        let (mut least, mut greatest) = (0, 0);
        call!(cuCtxGetStreamPriorityRange(&mut least, &mut greatest))?;
        Ok((least, greatest))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // Dropping our reference: the context lives on while the runtime (the job) holds its own.
        let _ = call!(cuDevicePrimaryCtxRelease_v2(self.dev));
    }
}

/// (free, total) device memory of the current context's device, in bytes.
pub fn mem_get_info() -> DeviceResult<(u64, u64)> {
    let (mut free, mut total) = (0usize, 0usize);
    call!(cuMemGetInfo_v2(&mut free, &mut total))?;
    Ok((free as u64, total as u64))
}

fn device_location(dev: CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev,
    }
}

/// The other devices of the process that can reach memory on `dev` (`cuDeviceCanAccessPeer`),
/// asked once per device; an error read as no.
fn peers_of(dev: CUdevice) -> Vec<CUdevice> {
    static ASKED: std::sync::Mutex<Vec<(CUdevice, Vec<CUdevice>)>> =
        std::sync::Mutex::new(Vec::new());
    let mut asked = ASKED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, peers)) = asked.iter().find(|(d, _)| *d == dev) {
        return peers.clone();
    }
    let count = device_count().unwrap_or(0);
    let peers: Vec<CUdevice> = (0..count)
        .filter_map(|ordinal| device_get(ordinal).ok())
        .filter(|&d| d != dev)
        .filter(|&d| {
            let mut can = 0;
            call!(cuDeviceCanAccessPeer(&mut can, d, dev)).is_ok() && can != 0
        })
        .collect();
    asked.push((dev, peers.clone()));
    peers
}

/// Read/write access for memory on `dev`: `dev` itself first, then every peer device that can
/// reach it ([`peers_of`]), as `cudaMalloc`'s memory is reachable once peer access is enabled.
fn access_descs(dev: CUdevice) -> Vec<sys::CUmemAccessDesc> {
    std::iter::once(dev)
        .chain(peers_of(dev))
        .map(|d| sys::CUmemAccessDesc {
            location: device_location(d),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        })
        .collect()
}

/// Gives `[va, va + size)`, memory on `dev` just mapped, read/write access for `dev` and its peer
/// devices ([`access_descs`]). Where the driver refuses the peers, `dev` alone gets access, as
/// without them: a host whose peers can't be granted still maps memory.
pub(crate) fn set_access(va: u64, size: usize, dev: CUdevice) -> DeviceResult<()> {
    let descs = access_descs(dev);
    let set = |count: usize| {
        // SAFETY: the library is loaded (every path here starts at `load`); the driver reads
        // `count` descriptors from `descs`, which holds at least that many (`dev`'s is first)
        // and outlives the call. A wrong `va` is refused by the driver, not host memory.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(va, size, descs.as_ptr(), count)
        })
    };
    if descs.len() > 1 && set(descs.len()).is_ok() {
        return Ok(());
    }
    set(1)
}

/// Whether `dev` supports GPUDirect RDMA on memory made with `cuMemCreate`
/// (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`); asked once per device, an
/// error read as no.
fn rdma_capable(dev: CUdevice) -> bool {
    static ASKED: std::sync::Mutex<Vec<(CUdevice, bool)>> = std::sync::Mutex::new(Vec::new());
    let mut asked = ASKED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, yes)) = asked.iter().find(|(d, _)| *d == dev) {
        return yes;
    }
    let mut v = 0;
    let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED;
    let yes = call!(cuDeviceGetAttribute(&mut v, attr, dev)).is_ok() && v != 0;
    asked.push((dev, yes));
    yes
}

/// Properties of plain device memory on `dev`: pinned (not migratable), no shareable handle,
/// GPUDirect RDMA capable where the device can be (as `cudaMalloc`'s memory is, and as PyTorch's
/// expandable segments ask for theirs).
fn device_alloc_prop(dev: CUdevice) -> sys::CUmemAllocationProp {
    device_alloc_prop_with(dev, sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE)
}

/// As [`device_alloc_prop`], exportable as `handles` (`share.rs`: a POSIX fd).
pub(crate) fn device_alloc_prop_with(
    dev: CUdevice,
    handles: sys::CUmemAllocationHandleType,
) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handles,
        location: device_location(dev),
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: u8::from(rdma_capable(dev)),
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// `cuMemGetAllocationGranularity` for plain device memory on `dev`: the minimum, or the
/// recommended one.
pub fn alloc_granularity(dev: CUdevice, recommended: bool) -> DeviceResult<u64> {
    let prop = device_alloc_prop(dev);
    let option = if recommended {
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    } else {
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
    };
    let mut g = 0usize;
    call!(cuMemGetAllocationGranularity(&mut g, &prop, option))?;
    Ok(g as u64)
}

fn to_usize(call: &'static str, n: u64) -> DeviceResult<usize> {
    backend::usize_arg(call, n, CUresult::CUDA_ERROR_INVALID_VALUE as i64)
}

/// Reserves `size` bytes of device virtual address space aligned to `align`.
pub fn address_reserve(size: u64, align: u64) -> DeviceResult<u64> {
    let size = to_usize("cuMemAddressReserve", size)?;
    let align = to_usize("cuMemAddressReserve", align)?;
    let mut va: sys::CUdeviceptr = 0;
    call!(cuMemAddressReserve(&mut va, size, align, 0, 0))?;
    Ok(va)
}

/// Frees a reservation made by [`address_reserve`]. Nothing may be mapped in it.
pub fn address_free(va: u64, size: u64) -> DeviceResult<()> {
    call!(cuMemAddressFree(va, to_usize("cuMemAddressFree", size)?))
}

/// Physical device memory (`cuMemCreate`), released on drop. Mapping it somewhere takes a reference
/// in the driver, so dropping this while mapped only drops possum's handle.
pub struct PhysMem {
    handle: sys::CUmemGenericAllocationHandle,
    size: u64,
    /// Set once `release` has handed the handle back, so that drop does not again.
    released: bool,
    ctx: Arc<Context>,
}

/// Implements `Debug` for a driver object `$ty` as its name, its field `$field` in hex, and its
/// field `size`.
macro_rules! debug_hex_and_size {
    ($ty:ident, $field:ident) => {
        impl std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($ty))
                    .field(stringify!($field), &format_args!("{:#x}", self.$field))
                    .field("size", &self.size)
                    .finish()
            }
        }
    };
}
pub(crate) use debug_hex_and_size;

debug_hex_and_size!(PhysMem, handle);

/// `cuMemCreate` of `size` bytes with `prop`, on the current context.
pub(crate) fn mem_create(
    prop: &sys::CUmemAllocationProp,
    size: u64,
) -> DeviceResult<sys::CUmemGenericAllocationHandle> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    call!(cuMemCreate(
        &mut handle,
        to_usize("cuMemCreate", size)?,
        prop,
        0
    ))?;
    Ok(handle)
}

impl PhysMem {
    /// Creates `size` bytes of physical memory on the context's device.
    pub fn create(ctx: &Arc<Context>, size: u64) -> DeviceResult<PhysMem> {
        let handle = mem_create(&device_alloc_prop(ctx.dev), size)?;
        Ok(PhysMem::owning(handle, size, ctx))
    }

    /// The value owning `handle` (released on drop).
    fn owning(handle: sys::CUmemGenericAllocationHandle, size: u64, ctx: &Arc<Context>) -> Self {
        PhysMem {
            handle,
            size,
            released: false,
            ctx: ctx.clone(),
        }
    }

    /// Imports `size` bytes of memory another process created and exported as the POSIX file
    /// descriptor `fd` (`cuMemImportFromShareableHandle`; a keeper's). The fd stays the caller's:
    /// the driver takes its own reference to the memory.
    pub fn import(
        ctx: &Arc<Context>,
        fd: std::os::fd::BorrowedFd<'_>,
        size: u64,
    ) -> DeviceResult<PhysMem> {
        use std::os::fd::AsRawFd;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // For POSIX_FILE_DESCRIPTOR the driver takes the fd itself in the pointer argument.
        let os_handle = fd.as_raw_fd() as isize as *mut c_void;
        call!(cuMemImportFromShareableHandle(
            &mut handle,
            os_handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        ))?;
        Ok(PhysMem::owning(handle, size, ctx))
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Maps all of it at `va` (inside a reservation) and gives the context's device and its peer
    /// devices read/write access ([`set_access`]). On failure nothing stays mapped.
    pub fn map_at(&self, va: u64) -> DeviceResult<()> {
        let size = to_usize("cuMemMap", self.size)?;
        call!(cuMemMap(va, size, 0, self.handle, 0))?;
        if let Err(e) = set_access(va, size, self.ctx.dev) {
            let _ = unmap(va, self.size);
            return Err(e);
        }
        Ok(())
    }

    /// Releases the handle, reporting the driver's answer (dropping does the same, silently).
    pub fn release(mut self) -> DeviceResult<()> {
        self.ctx.bind()?;
        self.released = true;
        call!(cuMemRelease(self.handle))
    }
}

impl Drop for PhysMem {
    fn drop(&mut self) {
        if !self.released && self.ctx.bind().is_ok() {
            let _ = call!(cuMemRelease(self.handle));
        }
    }
}

/// Unmaps `[va, va + size)`. The device must have no work in flight on it (that would fault the
/// context, not corrupt host memory).
pub fn unmap(va: u64, size: u64) -> DeviceResult<()> {
    call!(cuMemUnmap(va, to_usize("cuMemUnmap", size)?))
}

/// The driver's (base, size) of the allocation or mapping containing `va`.
pub fn address_range(va: u64) -> DeviceResult<(u64, u64)> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    call!(cuMemGetAddressRange_v2(&mut base, &mut size, va))?;
    Ok((base, size as u64))
}

/// Where [`PinnedBuf`]s come from: `cuMemHostAlloc(PORTABLE)` in a context, so the memory is
/// usable for asynchronous copies by every context.
#[derive(Debug, Clone)]
pub struct PinnedHost(Arc<Context>);

impl PinnedAlloc for PinnedHost {
    fn alloc_pinned(&self, len: usize) -> DeviceResult<&'static mut [u8]> {
        let mut p: *mut c_void = ptr::null_mut();
        call!(cuMemHostAlloc(&mut p, len, sys::CU_MEMHOSTALLOC_PORTABLE))?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| {
            backend_error(
                "cuMemHostAlloc",
                CUresult::CUDA_ERROR_OUT_OF_MEMORY as i64,
                "driver returned a null pointer".to_string(),
            )
        })?;
        // SAFETY: the driver just allocated `len` writable bytes at `ptr`, which nothing else
        // uses, and frees them only in `free_pinned`, which takes them back from the one
        // `PinnedBuf` they are handed to; zeroed first, they are initialised.
        unsafe {
            ptr::write_bytes(ptr.as_ptr(), 0, len);
            Ok(std::slice::from_raw_parts_mut(ptr.as_ptr(), len))
        }
    }

    fn free_pinned(&self, mem: Pinned) {
        if self.0.bind().is_ok() {
            let _ = call!(cuMemFreeHost(mem.into_ptr().cast()));
        }
    }
}

/// Pinned (page-locked) host memory from `cuMemHostAlloc(PORTABLE)` ([`PinnedHost`]): usable
/// for asynchronous copies by every context. Zeroed when allocated; freed on drop.
pub type PinnedBuf = backend::PinnedBuf<PinnedHost>;

/// Allocates `len` bytes of pinned, zeroed host memory in `ctx`.
pub fn pinned(ctx: &Arc<Context>, len: usize) -> DeviceResult<PinnedBuf> {
    PinnedBuf::alloc(PinnedHost(ctx.clone()), len)
}

struct StreamInner {
    raw: CUstream,
    /// Whether possum created the stream and destroys it on drop.
    owned: bool,
    ctx: Arc<Context>,
}

// SAFETY: a CUstream is a handle the driver lets every thread of the process use concurrently.
unsafe impl Send for StreamInner {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for StreamInner {}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if self.owned && self.ctx.bind().is_ok() {
            // The driver lets work already queued finish before destroying the stream.
            let _ = call!(cuStreamDestroy_v2(self.raw));
        }
    }
}

/// A CUDA stream: cheap to clone (shared). An owned stream (made by
/// [`CudaDevice::create_stream`](crate::CudaDevice)) is destroyed when the last clone is dropped; a
/// borrowed one (the job's, see [`CudaStream::borrow_raw`]) is never destroyed by possum.
#[derive(Clone)]
pub struct CudaStream(Arc<StreamInner>);

impl fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaStream")
            .field("raw", &self.0.raw)
            .field("owned", &self.0.owned)
            .finish()
    }
}

impl CudaStream {
    /// Creates a non-blocking stream (it does not synchronise with the legacy default stream) with
    /// the given driver priority.
    pub fn create(ctx: &Arc<Context>, priority: i32) -> DeviceResult<CudaStream> {
        let mut raw: CUstream = ptr::null_mut();
        call!(cuStreamCreateWithPriority(
            &mut raw,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            priority
        ))?;
        Ok(CudaStream(Arc::new(StreamInner {
            raw,
            owned: true,
            ctx: ctx.clone(),
        })))
    }

    /// The legacy default stream (handle 0) of `ctx`: always valid, never destroyed. Work on it
    /// waits for, and is waited for by, all blocking streams of the context.
    pub fn legacy(ctx: &Arc<Context>) -> CudaStream {
        CudaStream(Arc::new(StreamInner {
            raw: ptr::null_mut(),
            owned: false,
            ctx: ctx.clone(),
        }))
    }

    /// Wraps a stream possum did not create (one of the job's, seen by the interposer), without
    /// taking ownership: dropping the wrapper never destroys it.
    ///
    /// # Safety
    /// `raw` must be 0 (the legacy default stream) or a stream of `ctx` that stays valid (not
    /// destroyed by its owner) for as long as the returned value or any clone of it, or any
    /// [`CudaPending`] made on it, is alive. The driver does not reliably detect a destroyed handle.
    pub unsafe fn borrow_raw(ctx: &Arc<Context>, raw: CUstream) -> CudaStream {
        CudaStream(Arc::new(StreamInner {
            raw,
            owned: false,
            ctx: ctx.clone(),
        }))
    }

    /// The raw handle (still owned as before).
    pub fn raw(&self) -> CUstream {
        self.0.raw
    }

    /// Whether possum owns (and will destroy) the stream.
    pub fn is_owned(&self) -> bool {
        self.0.owned
    }

    /// The stream's driver priority (smaller is more urgent).
    pub fn priority(&self) -> DeviceResult<i32> {
        let mut p = 0;
        call!(cuStreamGetPriority(self.0.raw, &mut p))?;
        Ok(p)
    }

    /// Blocks until all work queued so far has completed. On a stream possum made, through an
    /// event recorded at its end, which blocks the thread rather than spinning
    /// ([`CudaEvent::record`]); on the job's own streams (which may be capturing a graph, where
    /// a recorded event would become part of it), and if no event can be made, on the stream
    /// itself.
    pub fn synchronize(&self) -> DeviceResult<()> {
        if self.0.owned {
            if let Ok(ev) = CudaEvent::record(self) {
                return ev.synchronize();
            }
        }
        // SAFETY: the stream handle is valid (owned, 0, or valid by `borrow_raw`'s contract).
        check_async("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.0.raw)
        })
    }

    /// Whether all work queued so far has completed (without blocking).
    pub fn query(&self) -> DeviceResult<bool> {
        // SAFETY: the stream handle is valid (owned, 0, or valid by `borrow_raw`'s contract).
        let r = unsafe { sys::cuStreamQuery(self.0.raw) };
        ready("cuStreamQuery", r)
    }

    /// Makes the device wait, in this stream, for `event`.
    pub fn wait_event(&self, event: &CudaEvent) -> DeviceResult<()> {
        call!(cuStreamWaitEvent(self.0.raw, event.0.raw, 0))
    }

    /// Queues `len` bytes of `value` at device address `dst`.
    pub fn memset_d8(&self, dst: u64, value: u8, len: u64) -> DeviceResult<()> {
        call!(cuMemsetD8Async(
            dst,
            value,
            to_usize("cuMemsetD8Async", len)?,
            self.0.raw
        ))
    }

    /// Queues a device-to-device copy of `len` bytes.
    pub fn copy_d2d(&self, src: u64, dst: u64, len: u64) -> DeviceResult<()> {
        call!(cuMemcpyDtoDAsync_v2(
            dst,
            src,
            to_usize("cuMemcpyDtoDAsync_v2", len)?,
            self.0.raw
        ))
    }

    /// Queues a copy of `len` bytes from device `src` into the start of `dst`.
    pub fn copy_d2h(&self, src: u64, dst: PinnedBuf, len: usize) -> DeviceResult<CudaPending> {
        CudaPending::start(self, dst, len, |host| {
            // SAFETY: `host` is valid for its length of writes. The buffer it is in is moved into
            // the returned `CudaPending`, which keeps it alive, unread and unwritten by safe code,
            // until an event recorded after this copy (or the stream) says it is complete.
            let r = unsafe {
                sys::cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), src, host.len(), self.0.raw)
            };
            check("cuMemcpyDtoHAsync_v2", r)
        })
    }

    /// Copies each `(src, len)` of `ranges` from the device into `dst`, one after the other from
    /// its start, and waits for them: many small reads for the cost of one wait (a validation
    /// reads thousands of sampled windows). On a failed copy, waits for those queued before
    /// it and returns the error.
    pub fn gather_d2h(&self, ranges: &[(u64, usize)], dst: &mut PinnedBuf) -> DeviceResult<()> {
        let total: usize = ranges.iter().map(|r| r.1).sum();
        if total > dst.len() {
            return Err(DeviceError::HostBufferTooSmall {
                need: total as u64,
                have: dst.len() as u64,
            });
        }
        let base = dst.as_mut_slice().as_mut_ptr();
        let mut off = 0;
        let mut failed = None;
        for &(src, len) in ranges {
            if len == 0 {
                continue;
            }
            // SAFETY: `off + len <= total <= dst.len()`, so the destination is inside `dst`, which
            // is borrowed mutably for this call; the call waits for every queued copy before it
            // returns, so the driver never writes into `dst` after the borrow ends.
            let r =
                unsafe { sys::cuMemcpyDtoHAsync_v2(base.add(off).cast(), src, len, self.0.raw) };
            if let Err(e) = check("cuMemcpyDtoHAsync_v2", r) {
                failed = Some(e);
                break;
            }
            off += len;
        }
        let waited = self.synchronize();
        match failed {
            Some(e) => Err(e),
            None => waited,
        }
    }

    /// Queues a copy of the first `len` bytes of `src` to device `dst`.
    pub fn copy_h2d(&self, src: PinnedBuf, dst: u64, len: usize) -> DeviceResult<CudaPending> {
        CudaPending::start(self, src, len, |host| {
            // SAFETY: `host` is valid for its length of reads; the buffer it is in is moved into
            // the returned `CudaPending`, which keeps it alive and unwritten until the copy is
            // complete.
            let r = unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst, host.as_ptr().cast(), host.len(), self.0.raw)
            };
            check("cuMemcpyHtoDAsync_v2", r)
        })
    }
}

impl CopyStream for CudaStream {
    type Event = CudaEvent;

    fn record(&self) -> DeviceResult<CudaEvent> {
        CudaEvent::record(self)
    }

    fn synchronize(&self) -> DeviceResult<()> {
        CudaStream::synchronize(self)
    }

    fn query(&self) -> DeviceResult<bool> {
        CudaStream::query(self)
    }
}

#[derive(Debug)]
struct EventInner {
    raw: sys::CUevent,
    ctx: Arc<Context>,
}

// SAFETY: a CUevent is a handle the driver lets every thread of the process use concurrently.
unsafe impl Send for EventInner {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for EventInner {}

impl Drop for EventInner {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // Destroying an event whose recorded work is still pending is allowed: the driver
            // releases it once that work completes.
            let _ = call!(cuEventDestroy_v2(self.raw));
        }
    }
}

/// A CUDA event (created with `DISABLE_TIMING`), recorded once at creation. Cheap to clone.
#[derive(Clone, Debug)]
pub struct CudaEvent(Arc<EventInner>);

impl CudaEvent {
    /// Creates an event and records it at the current end of `stream`.
    ///
    /// The event blocks a thread that synchronizes on it (`CU_EVENT_BLOCKING_SYNC`) instead of
    /// spinning, whatever the context's scheduling flags: possum's background threads wait on
    /// many copies at once, and spinning they would take CPUs from the job's own threads.
    pub fn record(stream: &CudaStream) -> DeviceResult<CudaEvent> {
        let ctx = &stream.0.ctx;
        let mut raw: sys::CUevent = ptr::null_mut();
        call!(cuEventCreate(
            &mut raw,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
                | sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
        ))?;
        let ev = CudaEvent(Arc::new(EventInner {
            raw,
            ctx: ctx.clone(),
        }));
        call!(cuEventRecord(raw, stream.0.raw))?;
        Ok(ev)
    }

    /// The raw handle (still owned by `self`).
    pub fn raw(&self) -> sys::CUevent {
        self.0.raw
    }

    /// Blocks until the work before the event has completed.
    pub fn synchronize(&self) -> DeviceResult<()> {
        // SAFETY: the event handle is owned by `self` and valid.
        check_async("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.0.raw)
        })
    }

    /// Whether the work before the event has completed.
    pub fn query(&self) -> DeviceResult<bool> {
        // SAFETY: the event handle is owned by `self` and valid.
        let r = unsafe { sys::cuEventQuery(self.0.raw) };
        ready("cuEventQuery", r)
    }
}

impl CopyEvent for CudaEvent {
    fn synchronize(&self) -> DeviceResult<()> {
        CudaEvent::synchronize(self)
    }

    fn query(&self) -> DeviceResult<bool> {
        CudaEvent::query(self)
    }
}

/// An asynchronous copy between a [`PinnedBuf`] and the device on a [`CudaStream`]
/// ([`backend::Pending`]): owns the buffer until the copy is complete.
pub type CudaPending = backend::Pending<CudaStream, PinnedBuf>;

// ---------------------------------------------------------------------------------------------
// The fingerprint kernel: `driver/fingerprint.rs`.

pub(crate) mod fingerprint;

// The job's own streams, wrapped by `CudaDevice::wrap_stream`: `driver/job_stream.rs`.
mod job_stream;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_names_the_call_and_code() {
        assert!(check("cuInit", CUresult::CUDA_SUCCESS).is_ok());
        let e = check("cuMemCreate", CUresult::CUDA_ERROR_OUT_OF_MEMORY).unwrap_err();
        assert!(is_out_of_memory(&e));
        match e {
            DeviceError::Backend {
                call,
                code,
                message,
            } => {
                assert_eq!(call, "cuMemCreate");
                assert_eq!(code, 2);
                assert!(message.starts_with("CUDA_ERROR_OUT_OF_MEMORY"), "{message}");
            }
            other => panic!("unexpected {other:?}"),
        }
        let e = check_async("cuEventSynchronize", CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        assert!(
            matches!(e, Err(DeviceError::StreamFailed(m)) if m.contains("CUDA_ERROR_ILLEGAL_ADDRESS") && m.contains("700"))
        );
    }
}
