//! The CUDA runtime's allocation entry points, exported so that `LD_PRELOAD` puts them in front
//! of libcudart's: `cudaMalloc` and `cudaFree`. One of the crate's modules with `unsafe` code.
//!
//! A job that links libcudart dynamically (PyTorch does, through libtorch_cuda's RPATH) resolves
//! `cudaMalloc` to the first definition in the global scope, which is this library's. The wrappers
//! hand the request to the safe [`crate::memory::alloc`], which serves it as an engine buffer (VA-stable,
//! releasable) or says to fall back to the real function, found with `dlsym(RTLD_NEXT)` or, when
//! libcudart was loaded into a local scope, through `dlopen(RTLD_NOLOAD)` of its soname.
//! libcudart's own internal calls, and a job that links it statically, never reach here: their
//! allocations are seen by CUPTI and tracked as unmanaged.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void, CStr};
use std::sync::OnceLock;

use crate::memory::alloc::{self, Freed, Malloc};

/// `cudaSuccess`, `cudaErrorInvalidValue`, `cudaErrorMemoryAllocation`,
/// `cudaErrorInitializationError`.
const SUCCESS: c_int = 0;
const INVALID_VALUE: c_int = 1;
const MEMORY_ALLOCATION: c_int = 2;
const INITIALIZATION_ERROR: c_int = 3;

type MallocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type GetDeviceFn = unsafe extern "C" fn(*mut c_int) -> c_int;

/// The real libcudart functions.
struct Real {
    malloc: Option<MallocFn>,
    free: Option<FreeFn>,
    get_device: Option<GetDeviceFn>,
}

/// Sonames tried with `RTLD_NOLOAD` when `RTLD_NEXT` finds nothing.
const CUDART_SONAMES: &[&CStr] = &[c"libcudart.so.13", c"libcudart.so.12", c"libcudart.so"];

fn real() -> &'static Real {
    static REAL: OnceLock<Real> = OnceLock::new();
    REAL.get_or_init(|| {
        // SAFETY: `dlsym`/`dlopen` with NUL-terminated names; RTLD_NOLOAD never loads anything.
        // The pointers found are libcudart's exported functions with the C signatures declared
        // above (cuda_runtime_api.h), and libcudart is never unloaded while a job runs.
        unsafe {
            let find = |name: &CStr| -> *mut c_void {
                let p = libc::dlsym(libc::RTLD_NEXT, name.as_ptr());
                if !p.is_null() {
                    return p;
                }
                for so in CUDART_SONAMES {
                    let h = libc::dlopen(so.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
                    if !h.is_null() {
                        let p = libc::dlsym(h, name.as_ptr());
                        libc::dlclose(h);
                        if !p.is_null() {
                            return p;
                        }
                    }
                }
                std::ptr::null_mut()
            };
            let m = find(c"cudaMalloc");
            let f = find(c"cudaFree");
            let g = find(c"cudaGetDevice");
            Real {
                malloc: (!m.is_null()).then(|| std::mem::transmute::<*mut c_void, MallocFn>(m)),
                free: (!f.is_null()).then(|| std::mem::transmute::<*mut c_void, FreeFn>(f)),
                get_device: (!g.is_null())
                    .then(|| std::mem::transmute::<*mut c_void, GetDeviceFn>(g)),
            }
        }
    })
}

/// The runtime's current device of the calling thread (`cudaGetDevice`).
fn current_device() -> Option<usize> {
    let g = real().get_device?;
    let mut d: c_int = 0;
    // SAFETY: `d` is a valid out-pointer.
    let r = unsafe { g(&mut d) };
    (r == SUCCESS).then(|| usize::try_from(d).ok()).flatten()
}

/// Initialises the runtime's context on the current device (`cudaFree(NULL)`), as the runtime
/// does lazily before its first allocation. Returns the runtime's error code.
fn runtime_init() -> c_int {
    match real().free {
        // SAFETY: `cudaFree(NULL)` is documented to do nothing but initialise.
        Some(f) => unsafe { f(std::ptr::null_mut()) },
        None => INITIALIZATION_ERROR,
    }
}

/// `cudaMalloc`: an engine buffer when possum manages allocations, else libcudart's.
///
/// # Safety
/// As `cudaMalloc`: `dev_ptr` is null or valid for a pointer write.
#[no_mangle]
pub unsafe extern "C" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: usize) -> c_int {
    if dev_ptr.is_null() {
        return INVALID_VALUE;
    }
    let outcome =
        std::panic::catch_unwind(|| alloc::malloc(size as u64, current_device, runtime_init))
            .unwrap_or(Malloc::Fallback);
    match outcome {
        Malloc::Managed(va) => {
            // SAFETY: `dev_ptr` is non-null and, by the caller's contract, valid for writes.
            unsafe { dev_ptr.write(va as usize as *mut c_void) };
            SUCCESS
        }
        Malloc::OutOfMemory => MEMORY_ALLOCATION,
        Malloc::Fallback => match real().malloc {
            // SAFETY: the caller's arguments, passed on unchanged.
            Some(m) => unsafe { m(dev_ptr, size) },
            None => INITIALIZATION_ERROR,
        },
    }
}

/// `cudaFree`: frees an engine buffer (after waiting for the device, as `cudaFree` does), or
/// passes anything else to libcudart.
///
/// # Safety
/// As `cudaFree`.
#[no_mangle]
pub unsafe extern "C" fn cudaFree(ptr: *mut c_void) -> c_int {
    let outcome = if ptr.is_null() {
        Freed::NotManaged
    } else {
        std::panic::catch_unwind(|| alloc::free(ptr as usize as u64)).unwrap_or(Freed::Failed)
    };
    match outcome {
        Freed::Done => SUCCESS,
        Freed::Failed => INVALID_VALUE,
        Freed::NotManaged => match real().free {
            // SAFETY: the caller's argument, passed on unchanged.
            Some(f) => unsafe { f(ptr) },
            None => INITIALIZATION_ERROR,
        },
    }
}
