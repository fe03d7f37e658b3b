//! The driver's allocation entry points, served by the engine like `cudaMalloc`:
//! `cuMemAlloc_v2`, `cuMemAllocPitch_v2`, `cuMemFree_v2`. One of the crate's modules with `unsafe`
//! code (with `sys`, `decode`, `cudart` and `park_sys`).
//!
//! Two ways in, for the two ways a job reaches the driver:
//! - exported symbols: a program linked against libcuda resolves `cuMemAlloc_v2` to the first
//!   definition in the global scope, this library's under `LD_PRELOAD`;
//! - `cuGetProcAddress` (what libcudart, PyTorch's driver API table and CUDA 12+ code use): on the
//!   exit of its CUPTI callback, possum swaps the function pointer the driver handed out for one
//!   of these (the driver's own is kept as the fallback). `dlsym` on a handle of libcuda is not
//!   seen: such allocations stay *tracked* (unmanaged), as before.
//!
//! Anything possum does not serve (allocations off, no current context, a failure) goes to the
//! driver's own function.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::alloc::{self, Freed, Malloc};

/// `CUDA_SUCCESS`, `CUDA_ERROR_INVALID_VALUE`, `CUDA_ERROR_OUT_OF_MEMORY`,
/// `CUDA_ERROR_NOT_INITIALIZED`.
const SUCCESS: c_int = 0;
const INVALID_VALUE: c_int = 1;
const OUT_OF_MEMORY: c_int = 2;
const NOT_INITIALIZED: c_int = 3;
/// Row pitch alignment of `cuMemAllocPitch` served here: a multiple of every GPU's texture pitch
/// alignment (`CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT`, 32 to 512).
const PITCH_ALIGN: usize = 512;

type AllocFn = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type PitchFn = unsafe extern "C" fn(*mut u64, *mut usize, usize, usize, c_uint) -> c_int;
type FreeFn = unsafe extern "C" fn(u64) -> c_int;

/// The driver's own functions (0 = not known yet): from `cuGetProcAddress`, else `dlsym(RTLD_NEXT)`.
static REAL_ALLOC: AtomicUsize = AtomicUsize::new(0);
static REAL_PITCH: AtomicUsize = AtomicUsize::new(0);
static REAL_FREE: AtomicUsize = AtomicUsize::new(0);
fn real(slot: &AtomicUsize, name: &CStr) -> usize {
    let p = slot.load(Ordering::Acquire);
    if p != 0 {
        return p;
    }
    // SAFETY: `dlsym`/`dlopen` with NUL-terminated names; RTLD_NEXT finds the definition after
    // this library's (libcuda's, when it is in the global scope), never this one; otherwise the
    // loaded libcuda is asked directly (RTLD_NOLOAD never loads anything).
    let p = unsafe {
        let mut p = libc::dlsym(libc::RTLD_NEXT, name.as_ptr());
        if p.is_null() {
            let h = libc::dlopen(
                c"libcuda.so.1".as_ptr(),
                libc::RTLD_LAZY | libc::RTLD_NOLOAD,
            );
            if !h.is_null() {
                p = libc::dlsym(h, name.as_ptr());
                libc::dlclose(h);
            }
        }
        p
    } as usize;
    if p != 0 {
        let _ = slot.compare_exchange(0, p, Ordering::AcqRel, Ordering::Acquire);
    }
    slot.load(Ordering::Acquire)
}

fn device() -> Option<usize> {
    possum_cuda::introspect::current_device().ok()
}

/// The exit of `cuGetProcAddress(symbol, pfn, cudaVersion, ...)` that succeeded: if `symbol` is
/// one of the allocation entry points in its `_v2` form, keep the driver's pointer and hand out
/// this library's instead. Whether it did.
pub fn offer(symbol: u64, pfn: u64, version: u64) -> bool {
    if symbol == 0 || pfn == 0 {
        return false;
    }
    // SAFETY: during the callback, `symbol` is the caller's NUL-terminated symbol name and `pfn`
    // its out-pointer, which the driver has just written (the call succeeded).
    let (name, out) = unsafe {
        (
            CStr::from_ptr(symbol as usize as *const std::ffi::c_char),
            pfn as usize as *mut *mut c_void,
        )
    };
    // The unsuffixed names mean the _v2 functions from CUDA 3.2 (version 3020) on.
    let v2 = version >= 3020;
    let (slot, ours): (&AtomicUsize, usize) = match name.to_bytes() {
        b"cuMemAlloc" if v2 => (&REAL_ALLOC, cuMemAlloc_v2 as AllocFn as usize),
        b"cuMemAlloc_v2" => (&REAL_ALLOC, cuMemAlloc_v2 as AllocFn as usize),
        b"cuMemAllocPitch" if v2 => (&REAL_PITCH, cuMemAllocPitch_v2 as PitchFn as usize),
        b"cuMemAllocPitch_v2" => (&REAL_PITCH, cuMemAllocPitch_v2 as PitchFn as usize),
        b"cuMemFree" if v2 => (&REAL_FREE, cuMemFree_v2 as FreeFn as usize),
        b"cuMemFree_v2" => (&REAL_FREE, cuMemFree_v2 as FreeFn as usize),
        _ => return false,
    };
    // SAFETY: `out` is valid for reads and writes (above).
    let theirs = unsafe { out.read() } as usize;
    if theirs == 0 || theirs == ours {
        return false;
    }
    let _ = slot.compare_exchange(0, theirs, Ordering::AcqRel, Ordering::Acquire);
    // SAFETY: as above; the caller gets a function of the same signature.
    unsafe { out.write(ours as *mut c_void) };
    true
}

/// `cuMemAlloc_v2`: an engine buffer on the current context's device, else the driver's.
///
/// # Safety
/// As `cuMemAlloc_v2`: `dptr` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> c_int {
    if dptr.is_null() {
        return INVALID_VALUE;
    }
    let outcome = std::panic::catch_unwind(|| alloc::malloc(bytes as u64, device, || SUCCESS))
        .unwrap_or(Malloc::Fallback);
    match outcome {
        Malloc::Managed(va) => {
            // SAFETY: non-null and valid by the caller's contract.
            unsafe { dptr.write(va) };
            SUCCESS
        }
        Malloc::OutOfMemory => OUT_OF_MEMORY,
        Malloc::Fallback => match real(&REAL_ALLOC, c"cuMemAlloc_v2") {
            0 => NOT_INITIALIZED,
            // SAFETY: the driver's cuMemAlloc_v2 (same signature), the caller's arguments.
            f => unsafe { std::mem::transmute::<usize, AllocFn>(f)(dptr, bytes) },
        },
    }
}

/// `cuMemAllocPitch_v2`: rows of `width` bytes padded to a multiple of 512, `height` of them, as
/// one engine buffer; else the driver's.
///
/// # Safety
/// As `cuMemAllocPitch_v2`: `dptr` and `pitch` are null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut u64,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: c_uint,
) -> c_int {
    if dptr.is_null() || pitch.is_null() || width == 0 || height == 0 || ![4, 8, 16].contains(&elem)
    {
        return INVALID_VALUE;
    }
    let p = width.div_ceil(PITCH_ALIGN) * PITCH_ALIGN;
    let outcome = match p.checked_mul(height) {
        Some(total) => std::panic::catch_unwind(|| alloc::malloc(total as u64, device, || SUCCESS))
            .unwrap_or(Malloc::Fallback),
        None => return INVALID_VALUE,
    };
    match outcome {
        Malloc::Managed(va) => {
            // SAFETY: non-null and valid by the caller's contract.
            unsafe {
                dptr.write(va);
                pitch.write(p);
            }
            SUCCESS
        }
        Malloc::OutOfMemory => OUT_OF_MEMORY,
        Malloc::Fallback => match real(&REAL_PITCH, c"cuMemAllocPitch_v2") {
            0 => NOT_INITIALIZED,
            // SAFETY: the driver's cuMemAllocPitch_v2 (same signature), the caller's arguments.
            f => unsafe {
                std::mem::transmute::<usize, PitchFn>(f)(dptr, pitch, width, height, elem)
            },
        },
    }
}

/// `cuMemFree_v2`: frees an engine buffer (after the device is idle, as `cuMemFree` does), or
/// passes anything else to the driver.
///
/// # Safety
/// As `cuMemFree_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(ptr: u64) -> c_int {
    let outcome = if ptr == 0 {
        Freed::NotManaged
    } else {
        std::panic::catch_unwind(|| alloc::free(ptr)).unwrap_or(Freed::Failed)
    };
    match outcome {
        Freed::Done => SUCCESS,
        Freed::Failed => INVALID_VALUE,
        Freed::NotManaged => match real(&REAL_FREE, c"cuMemFree_v2") {
            0 => NOT_INITIALIZED,
            // SAFETY: the driver's cuMemFree_v2 (same signature), the caller's argument.
            f => unsafe { std::mem::transmute::<usize, FreeFn>(f)(ptr) },
        },
    }
}
