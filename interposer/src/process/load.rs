//! How the library starts in a process: the entry points the loader and the CUDA driver call.
//! One of the crate's modules with `unsafe` code (with `sys`, `entry`, `exit`, `decode`, `cudart`,
//! `drvalloc` and `park_sys`).
//!
//! - the ELF constructor (for `LD_PRELOAD`) and `InitializeInjection` (for
//!   `CUDA_INJECTION64_PATH`) run the set-up, [`crate::process::setup::init`], handing it what it needs of
//!   the wrappers ([`crate::cuda::entry::SET_UP`]);
//! - the set-up registers the `atexit` handler (`exit.rs`), which writes the statistics and the
//!   trace (`setup::write_stats_at_exit`).
//!
//! Each wraps the safe code in `catch_unwind`: a panic must never cross into C. The top of the
//! crate's layers: nothing names it but the crate root's re-export.
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
    let _ = catch_unwind(set_up);
}

/// The `CUDA_INJECTION64_PATH` entry point: libcuda loads the library named there during `cuInit`
/// and calls this. Returns 1 (success) whatever happens: possum must never fail the job's `cuInit`.
#[no_mangle]
pub extern "C" fn InitializeInjection() -> c_int {
    let _ = catch_unwind(set_up);
    1
}

/// The set-up, handed the wrappers' functions.
fn set_up() {
    crate::process::setup::init(crate::cuda::entry::SET_UP);
}
