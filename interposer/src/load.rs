//! How the library starts and ends in a process: the entry points the loader and the CUDA driver
//! call. One of the crate's modules with `unsafe` code (with `sys`, `entry`, `decode`, `cudart`,
//! `drvalloc` and `park_sys`).
//!
//! - the ELF constructor (for `LD_PRELOAD`) and `InitializeInjection` (for
//!   `CUDA_INJECTION64_PATH`) run the set-up, [`crate::init`];
//! - the `atexit` handler writes the statistics and the trace ([`crate::write_stats_at_exit`]).
//!
//! Each wraps the safe code in `catch_unwind`: a panic must never cross into C.
#![allow(unsafe_code)]

use std::ffi::c_int;
use std::panic::catch_unwind;

/// The `LD_PRELOAD` entry point: the dynamic loader runs every `.init_array` entry when the
/// library is loaded. Left out of unit-test builds, so that tests see only what they record.
#[cfg(all(target_os = "linux", not(test)))]
#[used]
#[link_section = ".init_array"]
static INIT_ARRAY: extern "C" fn() = constructor;

#[cfg(all(target_os = "linux", not(test)))]
extern "C" fn constructor() {
    let _ = catch_unwind(crate::init);
}

/// The `CUDA_INJECTION64_PATH` entry point: libcuda loads the library named there during `cuInit`
/// and calls this. Returns 1 (success) whatever happens: possum must never fail the job's `cuInit`.
#[no_mangle]
pub extern "C" fn InitializeInjection() -> c_int {
    let _ = catch_unwind(crate::init);
    1
}

extern "C" fn at_exit() {
    let _ = catch_unwind(crate::write_stats_at_exit);
}

/// Registers the statistics writer to run at `exit()`. `false` if `atexit` refused.
pub fn register_at_exit() -> bool {
    // SAFETY: `at_exit` is a plain `extern "C" fn()` that never unwinds. glibc's `atexit` records
    // the calling shared object, so the handler also runs (and is dropped) if this library is ever
    // unloaded, before its code goes away.
    unsafe { libc::atexit(at_exit) == 0 }
}
