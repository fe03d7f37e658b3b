//! The driver's allocation entry points, served by the engine like `cudaMalloc`:
//! `cuMemAlloc_v2`, `cuMemAllocPitch_v2`, `cuMemFree_v2`; unless `POSSUM_SERVE_VMM=0`, the
//! job's own virtual-memory mappings (`cuMemCreate`, `cuMemMap`, `cuMemUnmap`, `cuMemRelease`,
//! `cuMemRetainAllocationHandle`, `cuMemGetAllocationPropertiesFromHandle`,
//! `cuMemExportToShareableHandle` of possum's handles: `vmm.rs`); unless `POSSUM_SERVE_POOLS=0`,
//! stream-ordered allocations (`cuMemAllocAsync`, `cuMemFreeAsync` and their `_ptsz` forms:
//! `pools.rs`). Their wrappers (`entry`, which hands
//! them out for every way a job reaches the driver) ask these first; `None` sends the call on to
//! the driver (allocations off, no current context, a failure), where the hooks track it as an
//! allocation possum does not manage. One of the crate's modules with `unsafe` code.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_uint};

use crate::memory::alloc::{self, Freed, Malloc};

use crate::cuda::cbid::{INVALID_VALUE, OUT_OF_MEMORY, SUCCESS};

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
    // `alloc::free` also frees the stream-ordered blocks possum serves (`pools.rs`).
    match std::panic::catch_unwind(|| alloc::free(ptr)).unwrap_or(Freed::Failed) {
        Freed::Done => Some(SUCCESS),
        Freed::Failed => Some(INVALID_VALUE),
        Freed::NotManaged => None,
    }
}

/// `cuMemCreate(handle, size, prop, flags)`: a token of possum's for plain device memory
/// (`vmm.rs`); `None`: the driver's.
///
/// # Safety
/// As `cuMemCreate`: `handle` is null or valid for a write, `prop` null or a valid
/// `CUmemAllocationProp` (32 bytes in CUDA 12 and 13).
pub unsafe fn serve_create(
    handle: *mut u64,
    size: usize,
    prop: *const u8,
    flags: u64,
) -> Option<c_int> {
    if handle.is_null() || prop.is_null() {
        return None;
    }
    // SAFETY: a valid CUmemAllocationProp by the caller's contract: 32 bytes.
    let p = unsafe { std::slice::from_raw_parts(prop, 32) };
    let word = |o: usize| u32::from_ne_bytes([p[o], p[o + 1], p[o + 2], p[o + 3]]);
    // type PINNED (1); requestedHandleTypes NONE (0) or POSIX_FILE_DESCRIPTOR (1); location
    // DEVICE (1) and its id; win32HandleMetaData null; allocFlags: compressionType 0,
    // gpuDirectRDMACapable 0 or 1 (PyTorch asks for it where the device supports it, and the
    // engine's memory has it there: possum-cuda's `device_alloc_prop`), usage 0.
    let plain = word(0) == 1
        && word(4) <= 1
        && word(8) == 1
        && p[16..24].iter().all(|&b| b == 0)
        && p[24] == 0
        && p[25] <= 1
        && p[26..28].iter().all(|&b| b == 0)
        && flags == 0;
    let mut whole = [0u8; crate::memory::vmm::PROP_LEN];
    whole.copy_from_slice(p);
    let ask = crate::memory::vmm::Ask {
        ordinal: word(12) as usize,
        prop: whole,
        plain,
    };
    match std::panic::catch_unwind(|| crate::memory::vmm::create(size as u64, ask)).ok()?? {
        Ok(token) => {
            // SAFETY: non-null and valid by the caller's contract.
            unsafe { handle.write(token) };
            Some(SUCCESS)
        }
        Err(code) => Some(code),
    }
}

/// `cuMemMap` of a token of possum's; `None`: the driver's.
///
/// # Safety
/// As `cuMemMap` (no pointer is read).
pub unsafe fn serve_map(
    va: u64,
    size: usize,
    offset: usize,
    handle: u64,
    flags: u64,
) -> Option<c_int> {
    if crate::memory::imports::is_import(handle) {
        return std::panic::catch_unwind(|| {
            crate::memory::imports::map(va, size as u64, offset as u64, handle, flags)
        })
        .unwrap_or(Some(INVALID_VALUE));
    }
    if !crate::memory::vmm::is_token(handle) {
        return None;
    }
    std::panic::catch_unwind(|| {
        crate::memory::vmm::map(va, size as u64, offset as u64, handle, flags)
    })
    .unwrap_or(Some(INVALID_VALUE))
}

/// `cuMemUnmap` of pieces possum mapped; `None`: the driver's.
///
/// # Safety
/// As `cuMemUnmap` (no pointer is read).
pub unsafe fn serve_unmap(va: u64, size: usize) -> Option<c_int> {
    std::panic::catch_unwind(|| {
        crate::memory::vmm::unmap(va, size as u64)
            .or_else(|| crate::memory::imports::unmap(va, size as u64))
    })
    .unwrap_or(Some(INVALID_VALUE))
}

/// `cuMemRelease` of a token of possum's; `None`: the driver's.
///
/// # Safety
/// As `cuMemRelease` (no pointer is read).
pub unsafe fn serve_release(handle: u64) -> Option<c_int> {
    if crate::memory::imports::is_import(handle) {
        return crate::memory::imports::release(handle);
    }
    if !crate::memory::vmm::is_token(handle) {
        return None;
    }
    std::panic::catch_unwind(|| crate::memory::vmm::release(handle)).unwrap_or(Some(INVALID_VALUE))
}

/// `cuMemExportToShareableHandle` of a token of possum's: a POSIX fd of its memory, from the
/// keeper that owns it (`vmm::export`); `None`: the driver's.
///
/// # Safety
/// As `cuMemExportToShareableHandle`: `out` is null or valid for writing the handle (an `int`
/// for a POSIX fd).
pub unsafe fn serve_export(out: u64, handle: u64, kind: c_uint, flags: u64) -> Option<c_int> {
    // As the driver answers for an imported handle: not exported again.
    if crate::memory::imports::is_import(handle) {
        return Some(INVALID_VALUE);
    }
    let r = std::panic::catch_unwind(|| crate::memory::vmm::export(handle, kind, flags))
        .unwrap_or(Some(Err(INVALID_VALUE)))?;
    Some(match r {
        Ok(fd) if out != 0 => {
            // SAFETY: non-null, valid for an int by the caller's contract (POSIX fd handles).
            unsafe { (out as usize as *mut c_int).write(fd) };
            SUCCESS
        }
        Ok(fd) => {
            // Nowhere to put it: not the caller's, so closed here.
            // SAFETY: `fd` was just made for this call and nobody else has it.
            drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
            INVALID_VALUE
        }
        Err(code) => code,
    })
}

/// `cuMemGetAllocationPropertiesFromHandle` of a token of possum's; `None`: the driver's.
///
/// # Safety
/// As that function: `prop` is null or valid for writing a `CUmemAllocationProp` (32 bytes).
pub unsafe fn serve_props(prop: *mut u8, handle: u64) -> Option<c_int> {
    match crate::memory::vmm::props(handle).or_else(|| crate::memory::imports::props(handle))? {
        Ok(_) if prop.is_null() => Some(INVALID_VALUE),
        Ok(p) => {
            // SAFETY: non-null, valid for 32 bytes by the caller's contract.
            unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), prop, p.len()) };
            Some(SUCCESS)
        }
        Err(code) => Some(code),
    }
}

/// `cuMemRetainAllocationHandle` of an address in a piece possum mapped; `None`: the driver's.
///
/// # Safety
/// As that function: `handle` is null or valid for a write.
pub unsafe fn serve_retain(handle: *mut u64, addr: u64) -> Option<c_int> {
    if handle.is_null() {
        return None;
    }
    let found = std::panic::catch_unwind(|| {
        crate::memory::vmm::retain(addr).or_else(|| crate::memory::imports::retain(addr).map(Ok))
    });
    match found.ok()?? {
        Ok(token) => {
            // SAFETY: non-null and valid by the caller's contract.
            unsafe { handle.write(token) };
            Some(SUCCESS)
        }
        Err(code) => Some(code),
    }
}

/// The engine's name for a stream handle given to a call: for a `_ptsz` function, 0 is the
/// calling thread's per-thread default stream (`decode::per_thread_if_null`, as the hooks name it).
fn stream_of(raw: u64, ptsz: bool) -> u64 {
    if ptsz {
        crate::cuda::decode::per_thread_if_null(raw)
    } else {
        raw
    }
}

/// `cuMemAllocAsync` (`_ptsz`: `ptsz`) served from the engine (`pools.rs`); `None`: the driver's.
///
/// # Safety
/// As `cuMemAllocAsync`: `dptr` is null or valid for a write.
unsafe fn alloc_async(dptr: *mut u64, bytes: usize, stream: u64, ptsz: bool) -> Option<c_int> {
    if dptr.is_null() || !crate::memory::pools::serving() {
        return None;
    }
    let ordinal = device()?;
    let s = stream_of(stream, ptsz);
    match std::panic::catch_unwind(|| crate::memory::pools::alloc(ordinal, bytes as u64, s))
        .ok()??
    {
        Ok(ptr) => {
            // SAFETY: non-null and valid by the caller's contract.
            unsafe { dptr.write(ptr) };
            Some(SUCCESS)
        }
        Err(code) => Some(code),
    }
}

/// `cuMemAllocAsync`; see [`alloc_async`].
///
/// # Safety
/// As `cuMemAllocAsync`.
pub unsafe fn serve_alloc_async(dptr: *mut u64, bytes: usize, stream: u64) -> Option<c_int> {
    // SAFETY: the caller's contract.
    unsafe { alloc_async(dptr, bytes, stream, false) }
}

/// `cuMemAllocAsync_ptsz`; see [`alloc_async`].
///
/// # Safety
/// As `cuMemAllocAsync_ptsz`.
pub unsafe fn serve_alloc_async_ptsz(dptr: *mut u64, bytes: usize, stream: u64) -> Option<c_int> {
    // SAFETY: the caller's contract.
    unsafe { alloc_async(dptr, bytes, stream, true) }
}

/// `cuMemFreeAsync` of a block possum serves; `None`: the driver's.
///
/// # Safety
/// As `cuMemFreeAsync` (no pointer is read).
pub unsafe fn serve_free_async(ptr: u64, stream: u64) -> Option<c_int> {
    std::panic::catch_unwind(|| crate::memory::pools::free_async(ptr, stream_of(stream, false)))
        .unwrap_or(Some(INVALID_VALUE))
}

/// `cuMemFreeAsync_ptsz` of a block possum serves; `None`: the driver's.
///
/// # Safety
/// As `cuMemFreeAsync_ptsz` (no pointer is read).
pub unsafe fn serve_free_async_ptsz(ptr: u64, stream: u64) -> Option<c_int> {
    std::panic::catch_unwind(|| crate::memory::pools::free_async(ptr, stream_of(stream, true)))
        .unwrap_or(Some(INVALID_VALUE))
}

/// `cuMemImportFromShareableHandle(handle, os, kind)` of a POSIX fd a keeper of this job handed
/// out: an import token of possum's (`imports.rs`); `None`: the driver's.
///
/// # Safety
/// As `cuMemImportFromShareableHandle`: `handle` is null or valid for a write; for `kind` 1
/// (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`) `os` is the caller's fd, open for the call.
pub unsafe fn serve_import(handle: *mut u64, os: u64, kind: c_uint) -> Option<c_int> {
    let raw = i32::try_from(os).ok().filter(|fd| *fd >= 0)?;
    if handle.is_null() || kind != 1 {
        return None;
    }
    // SAFETY: the caller's fd, open for this call by the contract above; only borrowed.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) };
    let token = std::panic::catch_unwind(|| crate::memory::imports::import(fd)).ok()??;
    // SAFETY: non-null and valid by the caller's contract.
    unsafe { handle.write(token) };
    Some(SUCCESS)
}
