//! possum's few stderr lines (`POSSUM_VERBOSE=1`).
//!
//! Owns the switch the set-up turns on: until then, and without the variable, the library never
//! prints.

use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};

static VERBOSE: AtomicBool = AtomicBool::new(false);

/// Turns the lines on or off (the set-up, from `POSSUM_VERBOSE`).
pub fn set_verbose(on: bool) {
    VERBOSE.store(on, Ordering::Relaxed);
}

/// One line on stderr, only with `POSSUM_VERBOSE=1`. Write errors are ignored.
pub fn log(msg: &str) {
    if VERBOSE.load(Ordering::Relaxed) {
        let _ = writeln!(std::io::stderr(), "possum: {msg}");
    }
}
