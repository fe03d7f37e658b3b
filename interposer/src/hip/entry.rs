//! The HIP runtime's entry points, exported so that `LD_PRELOAD` puts them in front of
//! libamdhip64's: one of the crate's modules with `unsafe` code.
//!
//! A HIP program reaches its runtime by name (linked with `-lamdhip64`), by `dlsym` on a handle
//! (answered here through `crate::cuda::entry`'s `dlsym`, see [`wrapper`]) and through
//! `hipGetProcAddress`, whose answers are swapped for these wrappers. Each wrapper reads its
//! arguments into plain values and hands them to the safe [`super::front`]; the runtime's own
//! function, found with `dlsym(RTLD_NEXT)`, does the work. The runtime's internal calls never
//! come here (it is linked `-Bsymbolic`, as ROCm's is).
#![allow(unsafe_code)]
#![allow(non_snake_case, non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::Ordering;

use super::front::{Front, Kind};
use super::through::{
    bytes, copy_through, count, launch_through, real, the_front, Dim3, HipError, REAL_hipMalloc,
    INVALID_VALUE, NOT_SUPPORTED, OUT_OF_MEMORY, SUCCESS,
};

/// "HIPF": the magic of the wrapper around a program's device code.
const FATBIN_MAGIC: u32 = 0x4849_5046;
/// The most bytes a code object or bundle is read as (a longer one is not read).
const MAX_IMAGE: usize = 1 << 30;

slot!(REAL_hipFree);
slot!(REAL_hipMallocAsync);
slot!(REAL_hipMallocFromPoolAsync);
slot!(REAL_hipFreeAsync);
slot!(REAL_hipMallocManaged);
slot!(REAL_hipMemMap);
slot!(REAL_hipMemCreate);
slot!(REAL_hipMemRelease);
slot!(REAL_hipMemUnmap);
slot!(REAL_hipDeviceSynchronize);
slot!(REAL_hipStreamSynchronize);
slot!(REAL_hipStreamDestroy);
slot!(REAL_hipGetDevice);
slot!(REAL_hipMemcpy);
slot!(REAL_hipMemcpyAsync);
slot!(REAL_hipMemset);
slot!(REAL_hipMemsetAsync);
slot!(REAL_hipModuleLoadData);
slot!(REAL_hipModuleUnload);
slot!(REAL_hipModuleGetFunction);
slot!(REAL_hipModuleLaunchKernel);
slot!(REAL_hipLaunchKernel);
slot!(REAL_hipGraphLaunch);
slot!(REAL_hipRegisterFatBinary);
slot!(REAL_hipRegisterFunction);
slot!(REAL_hipUnregisterFatBinary);
slot!(REAL_hipGetProcAddress);

type MallocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> HipError;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> HipError;
type MallocAsyncFn = unsafe extern "C" fn(*mut *mut c_void, usize, *mut c_void) -> HipError;
type MallocPoolFn =
    unsafe extern "C" fn(*mut *mut c_void, usize, *mut c_void, *mut c_void) -> HipError;
type FreeAsyncFn = unsafe extern "C" fn(*mut c_void, *mut c_void) -> HipError;
type MallocManagedFn = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> HipError;
type MemMapFn = unsafe extern "C" fn(*mut c_void, usize, usize, u64, u64) -> HipError;
type MemCreateFn = unsafe extern "C" fn(*mut u64, usize, *const c_void, u64) -> HipError;
type MemReleaseFn = unsafe extern "C" fn(u64) -> HipError;
type MemUnmapFn = unsafe extern "C" fn(*mut c_void, usize) -> HipError;
type VoidFn = unsafe extern "C" fn() -> HipError;
type StreamFn = unsafe extern "C" fn(*mut c_void) -> HipError;
type GetDeviceFn = unsafe extern "C" fn(*mut c_int) -> HipError;
type MemcpyFn = unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> HipError;
type MemcpyAsyncFn =
    unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, *mut c_void) -> HipError;
type MemsetFn = unsafe extern "C" fn(*mut c_void, c_int, usize) -> HipError;
type MemsetAsyncFn = unsafe extern "C" fn(*mut c_void, c_int, usize, *mut c_void) -> HipError;
type ModuleLoadDataFn = unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> HipError;
type PtrFn = unsafe extern "C" fn(*mut c_void) -> HipError;
type GetFunctionFn = unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> HipError;
type ModuleLaunchFn = unsafe extern "C" fn(
    *mut c_void,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> HipError;
type LaunchFn = unsafe extern "C" fn(
    *const c_void,
    Dim3,
    Dim3,
    *mut *mut c_void,
    usize,
    *mut c_void,
) -> HipError;
type GraphLaunchFn = unsafe extern "C" fn(*mut c_void, *mut c_void) -> HipError;
type RegisterFatBinaryFn = unsafe extern "C" fn(*const c_void) -> *mut *mut c_void;
type RegisterFunctionFn = unsafe extern "C" fn(
    *mut *mut c_void,
    *const c_void,
    *mut c_char,
    *const c_char,
    c_uint,
    *mut c_void,
    *mut c_void,
    *mut Dim3,
    *mut Dim3,
    *mut c_int,
);
type UnregisterFatBinaryFn = unsafe extern "C" fn(*mut *mut c_void);
type GetProcAddressFn =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> HipError;

/// The job's current HIP device.
fn current_device() -> Option<usize> {
    let mut d: c_int = -1;
    let r = call_real!(REAL_hipGetDevice, c"hipGetDevice", GetDeviceFn, &mut d);
    (r == SUCCESS).then(|| usize::try_from(d).ok()).flatten()
}

/// Serves an allocation of `size` bytes from the engine when the job's device is the one it
/// serves; `None` to pass the call to the runtime.
fn serve(size: usize, what: &str) -> Option<Result<u64, HipError>> {
    if size == 0 {
        return None;
    }
    let f = the_front()?;
    if current_device() != Some(super::front::DEVICE) {
        return None;
    }
    Some(f.alloc(size as u64, what).ok_or(OUT_OF_MEMORY))
}

/// Stores `va` at `ptr`.
///
/// # Safety
/// `ptr` is the caller's out-pointer (valid, or null).
unsafe fn hand_out(ptr: *mut *mut c_void, r: Result<u64, HipError>) -> HipError {
    match r {
        Ok(va) => {
            // SAFETY: the caller's valid out-pointer (checked non-null by the callers).
            unsafe { *ptr = va as *mut c_void };
            SUCCESS
        }
        Err(e) => e,
    }
}

/// Records memory the runtime made for the job (the call succeeded) as unmanaged.
fn note_own(r: HipError, ptr: *mut *mut c_void, size: usize, how: &'static str) -> HipError {
    if r == SUCCESS && !ptr.is_null() {
        if let Some(f) = the_front() {
            // SAFETY: the runtime filled the caller's valid out-pointer.
            let va = unsafe { *ptr } as u64;
            f.note_unmanaged(va, size as u64, how);
        }
    }
    r
}

/// `hipError_t hipMalloc(void** ptr, size_t size)`.
#[no_mangle]
pub unsafe extern "C" fn hipMalloc(ptr: *mut *mut c_void, size: usize) -> HipError {
    if ptr.is_null() {
        return INVALID_VALUE;
    }
    match serve(size, "hipMalloc") {
        // SAFETY: `ptr` is the caller's, non-null.
        Some(r) => unsafe { hand_out(ptr, r) },
        None => note_own(
            call_real!(REAL_hipMalloc, c"hipMalloc", MallocFn, ptr, size),
            ptr,
            size,
            "hipMalloc",
        ),
    }
}

/// `hipError_t hipMallocAsync(void** ptr, size_t size, hipStream_t stream)`: served at once
/// (an engine buffer is ready when made, before the stream's work).
#[no_mangle]
pub unsafe extern "C" fn hipMallocAsync(
    ptr: *mut *mut c_void,
    size: usize,
    stream: *mut c_void,
) -> HipError {
    if ptr.is_null() {
        return INVALID_VALUE;
    }
    match serve(size, "hipMallocAsync") {
        // SAFETY: `ptr` is the caller's, non-null.
        Some(r) => unsafe { hand_out(ptr, r) },
        None => note_own(
            call_real!(
                REAL_hipMallocAsync,
                c"hipMallocAsync",
                MallocAsyncFn,
                ptr,
                size,
                stream
            ),
            ptr,
            size,
            "hipMallocAsync",
        ),
    }
}

/// `hipError_t hipMallocFromPoolAsync(void** ptr, size_t size, hipMemPool_t pool,
/// hipStream_t stream)`: served as [`hipMallocAsync`] (the pool's own memory is not used).
#[no_mangle]
pub unsafe extern "C" fn hipMallocFromPoolAsync(
    ptr: *mut *mut c_void,
    size: usize,
    pool: *mut c_void,
    stream: *mut c_void,
) -> HipError {
    if ptr.is_null() || pool.is_null() {
        return INVALID_VALUE;
    }
    match serve(size, "hipMallocFromPoolAsync") {
        // SAFETY: `ptr` is the caller's, non-null.
        Some(r) => unsafe { hand_out(ptr, r) },
        None => note_own(
            call_real!(
                REAL_hipMallocFromPoolAsync,
                c"hipMallocFromPoolAsync",
                MallocPoolFn,
                ptr,
                size,
                pool,
                stream
            ),
            ptr,
            size,
            "hipMallocFromPoolAsync",
        ),
    }
}

/// Frees engine buffer `ptr` once `wait` (the runtime's wait for the work queued before the
/// free) returned; `None` when `ptr` is not possum's.
fn free_served(ptr: *mut c_void, wait: impl FnOnce() -> HipError) -> Option<HipError> {
    let f = super::front::made()?;
    if !f.serves(ptr as u64) {
        return None;
    }
    let r = wait();
    if r != SUCCESS {
        return Some(r);
    }
    Some(match f.free(ptr as u64) {
        Ok(()) => SUCCESS,
        Err(e) => {
            crate::base::log::log(&format!("freeing {ptr:p}: {e}"));
            INVALID_VALUE
        }
    })
}

/// `hipError_t hipFree(void* ptr)`: waits for the device, as the runtime's does.
#[no_mangle]
pub unsafe extern "C" fn hipFree(ptr: *mut c_void) -> HipError {
    if let Some(r) = free_served(ptr, || {
        call_real!(REAL_hipDeviceSynchronize, c"hipDeviceSynchronize", VoidFn,)
    }) {
        return r;
    }
    if let Some(f) = super::front::made() {
        f.forget_unmanaged(ptr as u64);
    }
    call_real!(REAL_hipFree, c"hipFree", FreeFn, ptr)
}

/// `hipError_t hipFreeAsync(void* ptr, hipStream_t stream)`: an engine buffer is freed once
/// the stream's work queued so far is done.
#[no_mangle]
pub unsafe extern "C" fn hipFreeAsync(ptr: *mut c_void, stream: *mut c_void) -> HipError {
    if let Some(r) = free_served(ptr, || {
        call_real!(
            REAL_hipStreamSynchronize,
            c"hipStreamSynchronize",
            StreamFn,
            stream
        )
    }) {
        return r;
    }
    if let Some(f) = super::front::made() {
        f.forget_unmanaged(ptr as u64);
    }
    call_real!(REAL_hipFreeAsync, c"hipFreeAsync", FreeAsyncFn, ptr, stream)
}

/// `hipError_t hipMallocManaged(void** ptr, size_t size, unsigned flags)`: the runtime's,
/// recorded as unmanaged (a checkpoint refuses the job: possum does not save managed memory).
#[no_mangle]
pub unsafe extern "C" fn hipMallocManaged(
    ptr: *mut *mut c_void,
    size: usize,
    flags: c_uint,
) -> HipError {
    note_own(
        call_real!(
            REAL_hipMallocManaged,
            c"hipMallocManaged",
            MallocManagedFn,
            ptr,
            size,
            flags
        ),
        ptr,
        size,
        "hipMallocManaged",
    )
}

/// `hipMemAllocationProp` (hip_runtime_api.h): its type, requested handle type and location at
/// 0, 4 and 8..16, its allocation flags (compression, GPUDirect RDMA, usage) at 24..28.
const PROP_LEN: usize = 32;
const PINNED: u32 = 1;
const LOCATION_DEVICE: u32 = 1;

/// Whether possum serves a `hipMemCreate` of properties `prop` (flags 0): plain device memory
/// on the device it serves, no shareable handle asked for, no compression.
///
/// # Safety
/// `prop` is null or points to a `hipMemAllocationProp`.
unsafe fn servable(prop: *const c_void, flags: u64) -> bool {
    if prop.is_null() || flags != 0 || !config_serves_vmm() {
        return false;
    }
    // SAFETY: the caller's promise: PROP_LEN bytes.
    let p = unsafe { bytes(prop, PROP_LEN) };
    let u32_at = |o: usize| u32::from_le_bytes(p[o..o + 4].try_into().expect("4"));
    u32_at(0) == PINNED
        && u32_at(4) == 0
        && u32_at(8) == LOCATION_DEVICE
        && u32_at(12) as usize == super::front::DEVICE
        && p[24] == 0
}

fn config_serves_vmm() -> bool {
    crate::base::config::get().tuning.serve_vmm
}

/// `hipError_t hipMemCreate(handle* h, size_t size, const hipMemAllocationProp* prop,
/// unsigned long long flags)`: plain device memory is answered with a handle of possum's
/// (no memory made until it is mapped, then an engine buffer); other memory is the runtime's.
#[no_mangle]
pub unsafe extern "C" fn hipMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const c_void,
    flags: u64,
) -> HipError {
    if handle.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: `prop` is the caller's, as the call's contract has it.
    if unsafe { servable(prop, flags) } {
        if let Some(f) = the_front() {
            return match f.create_token(size as u64) {
                Some(t) => {
                    // SAFETY: the caller's valid out-pointer.
                    unsafe { *handle = t };
                    SUCCESS
                }
                None => INVALID_VALUE,
            };
        }
    }
    call_real!(
        REAL_hipMemCreate,
        c"hipMemCreate",
        MemCreateFn,
        handle,
        size,
        prop,
        flags
    )
}

/// `hipError_t hipMemRelease(handle h)`.
#[no_mangle]
pub unsafe extern "C" fn hipMemRelease(handle: u64) -> HipError {
    if let Some(f) = super::front::made().filter(|f| f.is_token(handle)) {
        return token_result(f.release_token(handle));
    }
    call_real!(REAL_hipMemRelease, c"hipMemRelease", MemReleaseFn, handle)
}

fn token_result(r: Result<(), super::front::TokenError>) -> HipError {
    match r {
        Ok(()) => SUCCESS,
        Err(super::front::TokenError::NotSupported(_)) => NOT_SUPPORTED,
        Err(super::front::TokenError::Invalid) => INVALID_VALUE,
    }
}

/// `hipError_t hipMemMap(void* ptr, size_t size, size_t offset, handle, flags)`: a handle of
/// possum's becomes an engine buffer at `ptr`; the job's own mapping is recorded as unmanaged.
#[no_mangle]
pub unsafe extern "C" fn hipMemMap(
    ptr: *mut c_void,
    size: usize,
    offset: usize,
    handle: u64,
    flags: u64,
) -> HipError {
    if let Some(f) = super::front::made().filter(|f| f.is_token(handle)) {
        if flags != 0 {
            return INVALID_VALUE;
        }
        return token_result(f.map_token(handle, ptr as u64, size as u64, offset as u64));
    }
    let r = call_real!(
        REAL_hipMemMap,
        c"hipMemMap",
        MemMapFn,
        ptr,
        size,
        offset,
        handle,
        flags
    );
    if r == SUCCESS {
        if let Some(f) = the_front() {
            f.note_unmanaged(ptr as u64, size as u64, "hipMemMap");
        }
    }
    r
}

/// `hipError_t hipMemUnmap(void* ptr, size_t size)`: the engine buffers of possum's handles
/// mapped in the range are freed once the device's work is done; the rest is the runtime's.
#[no_mangle]
pub unsafe extern "C" fn hipMemUnmap(ptr: *mut c_void, size: usize) -> HipError {
    let served = super::front::made()
        .map(|f| (f, f.tokens_mapped_in(ptr as u64, size as u64)))
        .filter(|(_, v)| !v.is_empty());
    if let Some((f, pieces)) = served {
        let r = call_real!(REAL_hipDeviceSynchronize, c"hipDeviceSynchronize", VoidFn,);
        if r != SUCCESS {
            return r;
        }
        for va in pieces {
            if let Err(e) = f.unmap_token(va) {
                crate::base::log::log(&format!("hipMemUnmap at {va:#x}: {e}"));
                return INVALID_VALUE;
            }
        }
        // The job's own mappings in the range, if any, are the runtime's to unmap.
        let own: Vec<u64> = f.unmanaged_in(ptr as u64, size as u64);
        if own.is_empty() {
            return SUCCESS;
        }
    }
    let r = call_real!(REAL_hipMemUnmap, c"hipMemUnmap", MemUnmapFn, ptr, size);
    if r == SUCCESS {
        if let Some(f) = super::front::made() {
            for va in f.unmanaged_in(ptr as u64, size as u64) {
                f.forget_unmanaged(va);
            }
        }
    }
    r
}

/// `hipError_t hipStreamDestroy(hipStream_t stream)`.
#[no_mangle]
pub unsafe extern "C" fn hipStreamDestroy(stream: *mut c_void) -> HipError {
    if let Some(f) = super::front::made() {
        f.forget_stream(stream as usize);
    }
    call_real!(REAL_hipStreamDestroy, c"hipStreamDestroy", StreamFn, stream)
}

/// `hipError_t hipMemcpy(void* dst, const void* src, size_t n, hipMemcpyKind kind)`.
#[no_mangle]
pub unsafe extern "C" fn hipMemcpy(
    dst: *mut c_void,
    src: *const c_void,
    n: usize,
    kind: c_int,
) -> HipError {
    count(|f| &f.counters.copies);
    copy_through(0, dst as u64, src as u64, n, || {
        call_real!(REAL_hipMemcpy, c"hipMemcpy", MemcpyFn, dst, src, n, kind)
    })
}

/// `hipError_t hipMemcpyAsync(void* dst, const void* src, size_t n, hipMemcpyKind kind,
/// hipStream_t stream)`.
#[no_mangle]
pub unsafe extern "C" fn hipMemcpyAsync(
    dst: *mut c_void,
    src: *const c_void,
    n: usize,
    kind: c_int,
    stream: *mut c_void,
) -> HipError {
    count(|f| &f.counters.copies);
    copy_through(stream as usize, dst as u64, src as u64, n, || {
        call_real!(
            REAL_hipMemcpyAsync,
            c"hipMemcpyAsync",
            MemcpyAsyncFn,
            dst,
            src,
            n,
            kind,
            stream
        )
    })
}

/// `hipError_t hipMemset(void* dst, int value, size_t n)`.
#[no_mangle]
pub unsafe extern "C" fn hipMemset(dst: *mut c_void, value: c_int, n: usize) -> HipError {
    count(|f| &f.counters.memsets);
    copy_through(0, dst as u64, 0, n, || {
        call_real!(REAL_hipMemset, c"hipMemset", MemsetFn, dst, value, n)
    })
}

/// `hipError_t hipMemsetAsync(void* dst, int value, size_t n, hipStream_t stream)`.
#[no_mangle]
pub unsafe extern "C" fn hipMemsetAsync(
    dst: *mut c_void,
    value: c_int,
    n: usize,
    stream: *mut c_void,
) -> HipError {
    count(|f| &f.counters.memsets);
    copy_through(stream as usize, dst as u64, 0, n, || {
        call_real!(
            REAL_hipMemsetAsync,
            c"hipMemsetAsync",
            MemsetAsyncFn,
            dst,
            value,
            n,
            stream
        )
    })
}

/// The length of the code object or clang offload bundle at `p` (from its headers); `None`
/// when it is neither.
///
/// # Safety
/// `p` points to a code object or an offload bundle (the runtime's contract for the images
/// it is given), at least its headers readable.
unsafe fn image_len(p: *const c_void) -> Option<usize> {
    if p.is_null() {
        return None;
    }
    // SAFETY: an image starts with at least 24 readable bytes (an ELF header is 64, a bundle's
    // magic 24).
    let head = unsafe { bytes(p, 24) };
    if head.starts_with(b"\x7fELF") {
        // SAFETY: an ELF file's header is 64 bytes.
        let h = unsafe { bytes(p, 64) };
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().expect("8"));
        let u16_at = |o: usize| u64::from(u16::from_le_bytes([h[o], h[o + 1]]));
        let sh_end = u64_at(40) + u16_at(58) * u16_at(60);
        let ph_end = u64_at(32) + u16_at(54) * u16_at(56);
        let end = usize::try_from(sh_end.max(ph_end)).ok()?;
        return (64..=MAX_IMAGE).contains(&end).then_some(end);
    }
    if head != possum_analyzer::amdgpu::BUNDLE_MAGIC {
        return None;
    }
    // SAFETY: a bundle's header: its magic, then the number of entries.
    let n = u64::from_le_bytes(unsafe { bytes(p, 32) }[24..32].try_into().expect("8"));
    let mut at = 32usize;
    let mut end = at;
    for _ in 0..n.min(1024) {
        // SAFETY: each entry's header (offset, size, id length) follows the last one's id.
        let e = unsafe { bytes(p.cast::<u8>().add(at).cast(), 24) };
        let word = |i: usize| u64::from_le_bytes(e[i * 8..i * 8 + 8].try_into().expect("8"));
        let (off, size, id_len) = (word(0), word(1), word(2));
        end = end.max(usize::try_from(off.checked_add(size)?).ok()?);
        at = at
            .checked_add(24)?
            .checked_add(usize::try_from(id_len).ok()?)?;
        if at > MAX_IMAGE {
            return None;
        }
    }
    let end = end.max(at);
    (end <= MAX_IMAGE).then_some(end)
}

/// Reads the code objects of the image at `p` (a code object, or an offload bundle of them)
/// into the front end's module `handle`.
///
/// # Safety
/// As [`image_len`].
unsafe fn note_image(f: &Front, handle: usize, p: *const c_void) {
    // SAFETY: the caller's promise.
    match unsafe { image_len(p) } {
        // SAFETY: `image_len` found the image to be `len` bytes long.
        Some(len) => f.note_module(handle, unsafe { bytes(p, len) }),
        None => f.note_module(handle, &[]),
    }
}

/// `hipError_t hipModuleLoadData(hipModule_t* module, const void* image)`.
#[no_mangle]
pub unsafe extern "C" fn hipModuleLoadData(
    module: *mut *mut c_void,
    image: *const c_void,
) -> HipError {
    let r = call_real!(
        REAL_hipModuleLoadData,
        c"hipModuleLoadData",
        ModuleLoadDataFn,
        module,
        image
    );
    if r == SUCCESS {
        if let Some(f) = the_front() {
            // SAFETY: the runtime accepted `image` as a code object and filled `module`.
            unsafe { note_image(f, *module as usize, image) };
        }
    }
    r
}

/// `hipError_t hipModuleUnload(hipModule_t module)`.
#[no_mangle]
pub unsafe extern "C" fn hipModuleUnload(module: *mut c_void) -> HipError {
    if let Some(f) = super::front::made() {
        f.forget_module(module as usize);
    }
    call_real!(REAL_hipModuleUnload, c"hipModuleUnload", PtrFn, module)
}

/// `hipError_t hipModuleGetFunction(hipFunction_t* f, hipModule_t module, const char* name)`.
#[no_mangle]
pub unsafe extern "C" fn hipModuleGetFunction(
    function: *mut *mut c_void,
    module: *mut c_void,
    name: *const c_char,
) -> HipError {
    let r = call_real!(
        REAL_hipModuleGetFunction,
        c"hipModuleGetFunction",
        GetFunctionFn,
        function,
        module,
        name
    );
    if r == SUCCESS && !name.is_null() {
        if let Some(f) = the_front() {
            // SAFETY: the runtime found the NUL-terminated `name` and filled `function`.
            let (handle, name) = unsafe { (*function as usize, CStr::from_ptr(name)) };
            f.note_kernel(handle, module as usize, &name.to_string_lossy());
        }
    }
    r
}

/// `hipError_t hipModuleLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params,
/// extra)`.
#[no_mangle]
pub unsafe extern "C" fn hipModuleLaunchKernel(
    function: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> HipError {
    // SAFETY: the launch's own arguments.
    unsafe {
        launch_through(function as usize, stream as usize, params, extra, || {
            call_real!(
                REAL_hipModuleLaunchKernel,
                c"hipModuleLaunchKernel",
                ModuleLaunchFn,
                function,
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                shared,
                stream,
                params,
                extra
            )
        })
    }
}

/// `hipError_t hipLaunchKernel(const void* stub, dim3 grid, dim3 block, void** args,
/// size_t shared, hipStream_t stream)`.
#[no_mangle]
pub unsafe extern "C" fn hipLaunchKernel(
    stub: *const c_void,
    grid: Dim3,
    block: Dim3,
    args: *mut *mut c_void,
    shared: usize,
    stream: *mut c_void,
) -> HipError {
    // SAFETY: the launch's own arguments.
    unsafe {
        launch_stub!(
            REAL_hipLaunchKernel, c"hipLaunchKernel", LaunchFn, stub, stream, args;
            stub, grid, block, args, shared, stream
        )
    }
}

/// `hipError_t hipGraphLaunch(hipGraphExec_t exec, hipStream_t stream)`: taken to write every
/// buffer (the graph's nodes are not read).
#[no_mangle]
pub unsafe extern "C" fn hipGraphLaunch(exec: *mut c_void, stream: *mut c_void) -> HipError {
    let op = || {
        call_real!(
            REAL_hipGraphLaunch,
            c"hipGraphLaunch",
            GraphLaunchFn,
            exec,
            stream
        )
    };
    let Some(f) = the_front() else {
        return op();
    };
    f.counters.graph_launches.fetch_add(1, Ordering::Relaxed);
    f.before_op(Kind::Copy, stream as usize, &[], None, op)
}

/// `void** __hipRegisterFatBinary(const void* wrapper)`: the program's device code, read for
/// its kernels' layouts.
#[no_mangle]
pub unsafe extern "C" fn __hipRegisterFatBinary(wrapper: *const c_void) -> *mut *mut c_void {
    let p = real(&REAL_hipRegisterFatBinary, c"__hipRegisterFatBinary");
    if p == 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: the runtime's function of this name and signature, with the caller's argument.
    let modules = unsafe { std::mem::transmute::<usize, RegisterFatBinaryFn>(p)(wrapper) };
    if !modules.is_null() && !wrapper.is_null() {
        if let Some(f) = the_front() {
            // SAFETY: the wrapper the runtime accepted: magic, version, then the image.
            let (magic, image) = unsafe {
                (
                    *wrapper.cast::<u32>(),
                    *wrapper.cast::<u8>().add(8).cast::<*const c_void>(),
                )
            };
            if magic == FATBIN_MAGIC {
                // SAFETY: the runtime read the image as one.
                unsafe { note_image(f, modules as usize, image) };
            }
        }
    }
    modules
}

/// `void __hipRegisterFunction(void** modules, const void* stub, char* device_function,
/// const char* device_name, ...)`: launches of `stub` run kernel `device_name`.
#[no_mangle]
pub unsafe extern "C" fn __hipRegisterFunction(
    modules: *mut *mut c_void,
    stub: *const c_void,
    device_function: *mut c_char,
    device_name: *const c_char,
    thread_limit: c_uint,
    tid: *mut c_void,
    bid: *mut c_void,
    block_dim: *mut Dim3,
    grid_dim: *mut Dim3,
    w_size: *mut c_int,
) {
    let p = real(&REAL_hipRegisterFunction, c"__hipRegisterFunction");
    if p != 0 {
        // SAFETY: the runtime's function of this name and signature, with the caller's
        // arguments.
        unsafe {
            std::mem::transmute::<usize, RegisterFunctionFn>(p)(
                modules,
                stub,
                device_function,
                device_name,
                thread_limit,
                tid,
                bid,
                block_dim,
                grid_dim,
                w_size,
            )
        };
    }
    if !device_name.is_null() {
        if let Some(f) = the_front() {
            // SAFETY: a NUL-terminated kernel name (the registration's contract).
            let name = unsafe { CStr::from_ptr(device_name) }.to_string_lossy();
            f.note_kernel(stub as usize, modules as usize, &name);
        }
    }
}

/// `void __hipUnregisterFatBinary(void** modules)`.
#[no_mangle]
pub unsafe extern "C" fn __hipUnregisterFatBinary(modules: *mut *mut c_void) {
    if let Some(f) = super::front::made() {
        f.forget_module(modules as usize);
    }
    let p = real(&REAL_hipUnregisterFatBinary, c"__hipUnregisterFatBinary");
    if p != 0 {
        // SAFETY: the runtime's function of this name and signature.
        unsafe { std::mem::transmute::<usize, UnregisterFatBinaryFn>(p)(modules) };
    }
}

/// The wrapper of HIP function `name`, if possum wraps it: what a lookup of it (`dlsym` on a
/// handle, `hipGetProcAddress`) hands the job instead of the runtime's.
pub fn wrapper(name: &[u8]) -> Option<*const ()> {
    wrapper_of!(
        name;
        hipMalloc,
        hipMallocAsync,
        hipMallocFromPoolAsync,
        hipFree,
        hipFreeAsync,
        hipMallocManaged,
        hipMemCreate,
        hipMemRelease,
        hipMemMap,
        hipMemUnmap,
        hipStreamDestroy,
        hipMemcpy,
        hipMemcpyAsync,
        hipMemset,
        hipMemsetAsync,
        hipModuleLoadData,
        hipModuleUnload,
        hipModuleGetFunction,
        hipModuleLaunchKernel,
        hipLaunchKernel,
        hipGraphLaunch,
        hipGetProcAddress
    )
    .or_else(|| super::writers::wrapper(name))
}

/// `hipError_t hipGetProcAddress(const char* symbol, void** pfn, int version, uint64_t flags,
/// hipDriverProcAddressQueryResult* status)`: a function possum wraps is answered with its
/// wrapper.
#[no_mangle]
pub unsafe extern "C" fn hipGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> HipError {
    let r = call_real!(
        REAL_hipGetProcAddress,
        c"hipGetProcAddress",
        GetProcAddressFn,
        symbol,
        pfn,
        version,
        flags,
        status
    );
    if r == SUCCESS && !symbol.is_null() && !pfn.is_null() {
        // SAFETY: a NUL-terminated name (the call's contract), answered into `pfn`.
        let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
        // SAFETY: `pfn` is the caller's valid out-pointer, filled by the runtime.
        let answered = !unsafe { *pfn }.is_null();
        if let (Some(w), true) = (wrapper(name), answered) {
            // SAFETY: the caller's valid out-pointer.
            unsafe { *pfn = w.cast_mut().cast() };
        }
    }
    r
}
