//! The `atexit` handler: runs the function the set-up registers (the statistics and the trace,
//! `setup::write_stats_at_exit`) when the process calls `exit()`. One of the crate's modules with
//! `unsafe` code.
//!
//! A leaf: the set-up hands it the function to run, so it names nothing above it. The handler
//! wraps that function in `catch_unwind`: a panic must never cross into C.
#![allow(unsafe_code)]

use std::panic::catch_unwind;
use std::sync::OnceLock;

/// What runs at `exit()` (the first function registered).
static HANDLER: OnceLock<fn()> = OnceLock::new();

/// The handler glibc calls at `exit()`: runs [`HANDLER`].
extern "C" fn at_exit() {
    if let Some(&handler) = HANDLER.get() {
        let _ = catch_unwind(handler);
    }
}

/// Registers `handler` to run at `exit()`. `false` if `atexit` refused.
pub fn register_at_exit(handler: fn()) -> bool {
    let _ = HANDLER.set(handler);
    // SAFETY: `at_exit` is a plain `extern "C" fn()` that never unwinds. glibc's `atexit` records
    // the calling shared object, so the handler also runs (and is dropped) if this library is ever
    // unloaded, before its code goes away.
    unsafe { libc::atexit(at_exit) == 0 }
}
