//! The driver's allocation entry points, served by the engine like `cudaMalloc`:
//! `cuMemAlloc_v2`, `cuMemAllocPitch_v2`, `cuMemFree_v2`. Their wrappers (`entry`, which hands
//! them out for every way a job reaches the driver) ask these first; `None` sends the call on to
//! the driver (allocations off, no current context, a failure), where the hooks track it as an
//! allocation possum does not manage. One of the crate's modules with `unsafe` code.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_uint};

use crate::alloc::{self, Freed, Malloc};

/// `CUDA_SUCCESS`, `CUDA_ERROR_INVALID_VALUE`, `CUDA_ERROR_OUT_OF_MEMORY`.
const SUCCESS: c_int = 0;
const INVALID_VALUE: c_int = 1;
const OUT_OF_MEMORY: c_int = 2;
/// Row pitch alignment of `cuMemAllocPitch` served here: a multiple of every GPU's texture pitch
/// alignment (`CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT`, 32 to 512).
const PITCH_ALIGN: usize = 512;

fn device() -> Option<usize> {
    possum_cuda::introspect::current_device().ok()
}

/// `cuMemAlloc_v2`: an engine buffer on the current context's device; `None`: the driver's.
///
/// # Safety
/// As `cuMemAlloc_v2`: `dptr` is null or valid for a write.
pub unsafe fn serve_alloc(dptr: *mut u64, bytes: usize) -> Option<c_int> {
    if dptr.is_null() {
        return Some(INVALID_VALUE);
    }
    let outcome = std::panic::catch_unwind(|| alloc::malloc(bytes as u64, device, || SUCCESS))
        .unwrap_or(Malloc::Fallback);
    match outcome {
        Malloc::Managed(va) => {
            // SAFETY: non-null and valid by the caller's contract.
            unsafe { dptr.write(va) };
            Some(SUCCESS)
        }
        Malloc::OutOfMemory => Some(OUT_OF_MEMORY),
        Malloc::Fallback => None,
    }
}

/// `cuMemAllocPitch_v2`: rows of `width` bytes padded to a multiple of 512, `height` of them, as
/// one engine buffer; `None`: the driver's.
///
/// # Safety
/// As `cuMemAllocPitch_v2`: `dptr` and `pitch` are null or valid for writes.
pub unsafe fn serve_pitch(
    dptr: *mut u64,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: c_uint,
) -> Option<c_int> {
    if dptr.is_null() || pitch.is_null() || width == 0 || height == 0 || ![4, 8, 16].contains(&elem)
    {
        return Some(INVALID_VALUE);
    }
    let p = width.div_ceil(PITCH_ALIGN) * PITCH_ALIGN;
    let total = p.checked_mul(height)?;
    let outcome = std::panic::catch_unwind(|| alloc::malloc(total as u64, device, || SUCCESS))
        .unwrap_or(Malloc::Fallback);
    match outcome {
        Malloc::Managed(va) => {
            // SAFETY: non-null and valid by the caller's contract.
            unsafe {
                dptr.write(va);
                pitch.write(p);
            }
            Some(SUCCESS)
        }
        Malloc::OutOfMemory => Some(OUT_OF_MEMORY),
        Malloc::Fallback => None,
    }
}

/// `cuMemFree_v2`: frees an engine buffer (after the device is idle, as `cuMemFree` does);
/// `None`: not possum's, the driver's.
///
/// # Safety
/// As `cuMemFree_v2`.
pub unsafe fn serve_free(ptr: u64) -> Option<c_int> {
    if ptr == 0 {
        return None;
    }
    match std::panic::catch_unwind(|| alloc::free(ptr)).unwrap_or(Freed::Failed) {
        Freed::Done => Some(SUCCESS),
        Freed::Failed => Some(INVALID_VALUE),
        Freed::NotManaged => None,
    }
}
