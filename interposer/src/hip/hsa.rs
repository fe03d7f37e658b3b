//! HSA's allocation entry points, below HIP: `hsa_amd_memory_pool_allocate` and
//! `hsa_amd_memory_pool_free`. One of the crate's modules with `unsafe` code.
//!
//! The HIP runtime itself allocates through them (every `hipMalloc` of its own, possum's engine
//! buffers included), so a call is recorded only when it comes from elsewhere: the job's own
//! code, or a library of its, allocating device memory below HIP. Such memory is not served:
//! it is recorded as unmanaged, and a checkpoint refuses the job while it holds any. The
//! caller is told apart by its return address, which a naked shim passes on.
#![allow(unsafe_code)]

use std::ffi::c_void;

use super::through::real;

slot!(REAL_ALLOCATE);
slot!(REAL_FREE);

/// `HSA_STATUS_SUCCESS`, and `HSA_STATUS_ERROR` (answered when HSA has no such function).
const HSA_SUCCESS: u32 = 0;
const HSA_ERROR: u32 = 0x1000;

type AllocateFn = unsafe extern "C" fn(u64, usize, u32, *mut *mut c_void) -> u32;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> u32;

/// The libraries whose HSA allocations are the runtime's own.
const RUNTIME_LIBRARIES: &[&str] = &["libamdhip64", "libhsa-runtime64", "libpossum"];

/// Whether code at `addr` is in the HIP runtime, HSA's runtime or possum.
fn from_runtime(addr: usize) -> bool {
    crate::base::elfsym::object_file(addr).is_some_and(|path| {
        let file = path.rsplit('/').next().unwrap_or(&path);
        RUNTIME_LIBRARIES.iter().any(|l| file.starts_with(l))
    })
}

/// `hsa_status_t hsa_amd_memory_pool_allocate(hsa_amd_memory_pool_t pool, size_t size,
/// uint32_t flags, void** ptr)`: HSA's, then recorded when the caller is not the runtime.
///
/// # Safety
/// As HSA's.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn hsa_amd_memory_pool_allocate(
    _pool: u64,
    _size: usize,
    _flags: u32,
    _ptr: *mut *mut c_void,
) -> u32 {
    // The caller's return address as a fifth argument; the inner function returns to it.
    std::arch::naked_asm!(
        "mov r8, qword ptr [rsp]",
        "jmp {inner}",
        inner = sym possum_hsa_allocate,
    )
}

extern "C" fn possum_hsa_allocate(
    pool: u64,
    size: usize,
    flags: u32,
    ptr: *mut *mut c_void,
    caller: usize,
) -> u32 {
    let p = real(&REAL_ALLOCATE, c"hsa_amd_memory_pool_allocate");
    if p == 0 {
        return HSA_ERROR;
    }
    // SAFETY: HSA's function of this name and signature, with the caller's arguments.
    let r = unsafe { std::mem::transmute::<usize, AllocateFn>(p)(pool, size, flags, ptr) };
    if r == HSA_SUCCESS && !ptr.is_null() && !from_runtime(caller) {
        if let Some(f) = super::front::made() {
            // SAFETY: HSA filled the caller's valid out-pointer.
            let va = unsafe { *ptr } as u64;
            f.note_unmanaged(va, size as u64, "hsa_amd_memory_pool_allocate");
        }
    }
    r
}

/// `hsa_status_t hsa_amd_memory_pool_free(void* ptr)`.
///
/// # Safety
/// As HSA's.
#[no_mangle]
pub unsafe extern "C" fn hsa_amd_memory_pool_free(ptr: *mut c_void) -> u32 {
    if let Some(f) = super::front::made() {
        f.forget_unmanaged(ptr as u64);
    }
    let p = real(&REAL_FREE, c"hsa_amd_memory_pool_free");
    if p == 0 {
        return HSA_ERROR;
    }
    // SAFETY: HSA's function of this name and signature, with the caller's argument.
    unsafe { std::mem::transmute::<usize, FreeFn>(p)(ptr) }
}
