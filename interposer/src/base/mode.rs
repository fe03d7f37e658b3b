//! What the entry points' wrappers do with a call now ([`Mode`]).
//!
//! Owns the one atomic the wrappers read on every call. The set-up sets it first (before anything
//! calls the driver); the A/B test switches it. Until the set-up has run it reads 0, which
//! [`current`] reports as `None`: the wrappers (`entry::mode`) then run the set-up first.

use std::sync::atomic::{AtomicU8, Ordering};

/// How the wrappers behave (see [`Mode`]); 0 until the set-up has run.
static MODE: AtomicU8 = AtomicU8::new(0);

/// What the wrappers do with a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// The hooks run in the wrappers (the default).
    Hooks = 1,
    /// CUPTI's callbacks run the hooks; the wrappers count calls only.
    Count = 2,
    /// The wrappers call the driver and nothing else (`POSSUM_HOOKS=off`, or an A/B test's off
    /// interval).
    Off = 3,
}

/// Sets what the wrappers do from now on.
pub fn set_mode(m: Mode) {
    MODE.store(m as u8, Ordering::Release);
}

/// What the wrappers do now; `None` before the set-up.
#[inline(always)]
pub fn current() -> Option<Mode> {
    match MODE.load(Ordering::Acquire) {
        0 => None,
        2 => Some(Mode::Count),
        3 => Some(Mode::Off),
        _ => Some(Mode::Hooks),
    }
}

/// What the wrappers do now, the set-up done (a value that cannot be there reads as the default).
pub fn after_set_up() -> Mode {
    current().unwrap_or(Mode::Hooks)
}
