//! The unsafe layer under [`crate::ops::park`]: a real-time signal whose handler parks the thread it
//! lands on until told to go on, and the few system calls around it (`gettid`, `tgkill`, `futex`).
//!
//! The handler does only async-signal-safe things: atomics, `futex(2)`, and it saves and restores
//! `errno`. It parks only while [`HOLD`] is set; a signal arriving after the hold ended (or one
//! sent by someone else) returns at once. While parked, the thread's id is in [`SLOTS`], so the
//! controlling thread knows exactly which threads are held.
//!
//! Everything here is safe to call.
#![allow(unsafe_code)]

use std::ffi::c_int;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// 1 while threads are to stay parked: the futex word they wait on.
static HOLD: AtomicU32 = AtomicU32::new(0);
/// How many threads are inside the handler now (parked or on their way out).
static INSIDE: AtomicUsize = AtomicUsize::new(0);
/// The ids of the parked threads (0 = free slot).
const SLOT_COUNT: usize = 4096;
static SLOTS: [AtomicI32; SLOT_COUNT] = [const { AtomicI32::new(0) }; SLOT_COUNT];
/// The installed signal, or the reason none could be.
static SIGNAL: OnceLock<Result<c_int, SignalError>> = OnceLock::new();

/// Why no signal could be had to park the job's threads with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SignalError {
    /// Its handler could not be installed.
    #[error("sigaction({sig}): {source}")]
    Install {
        /// The signal.
        sig: c_int,
        /// Why.
        source: std::sync::Arc<std::io::Error>,
    },
    /// The signal asked for is not a real-time one.
    #[error("signal {sig} is not a real-time signal ({lo}..={hi})")]
    NotRealTime {
        /// The signal asked for.
        sig: c_int,
        /// `SIGRTMIN`.
        lo: c_int,
        /// `SIGRTMAX`.
        hi: c_int,
    },
    /// Every real-time signal has a handler already.
    #[error("every real-time signal is in use")]
    AllInUse,
}

/// The calling thread's kernel id.
pub fn gettid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// Sends `sig` to thread `tid` of this process. `Err(errno)` on failure (`ESRCH`: gone).
pub fn tgkill(tid: i32, sig: c_int) -> Result<(), i32> {
    // SAFETY: plain system call with integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), tid, sig) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }
}

fn futex_wait(word: &AtomicU32, expected: u32) {
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call; no timeout; a
    // spurious or interrupted return is handled by the caller's loop.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: as above; wakes every waiter.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        );
    }
}

extern "C" fn on_signal(_sig: c_int, _info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    if HOLD.load(Ordering::Acquire) == 0 {
        return;
    }
    // SAFETY: __errno_location returns this thread's errno slot; saved and restored around the
    // system calls below so the interrupted code sees its own value.
    let errno = unsafe { *libc::__errno_location() };
    INSIDE.fetch_add(1, Ordering::AcqRel);
    let tid = gettid();
    let slot = SLOTS.iter().find(|s| {
        s.compare_exchange(0, tid, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    });
    while HOLD.load(Ordering::Acquire) != 0 {
        futex_wait(&HOLD, 1);
    }
    if let Some(s) = slot {
        s.store(0, Ordering::Release);
    }
    INSIDE.fetch_sub(1, Ordering::AcqRel);
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// The current disposition of `sig`: whether it is the default (or ignored), i.e. unused.
fn unused(sig: c_int) -> bool {
    // SAFETY: a zeroed sigaction is a valid out-parameter; a null new action only queries.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut old) == 0
            && (old.sa_sigaction == libc::SIG_DFL || old.sa_sigaction == libc::SIG_IGN)
    }
}

fn install_on(sig: c_int) -> Result<c_int, SignalError> {
    // SAFETY: the handler is an `extern "C"` function with the SA_SIGINFO signature; the mask is
    // initialised by sigemptyset before use.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        let handler: extern "C" fn(c_int, *mut libc::siginfo_t, *mut libc::c_void) = on_signal;
        sa.sa_sigaction = handler as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
            return Err(SignalError::Install {
                sig,
                source: std::sync::Arc::new(std::io::Error::last_os_error()),
            });
        }
    }
    Ok(sig)
}

/// Installs the handler (once) and returns its signal: `preferred` if given, else the first
/// real-time signal from SIGRTMIN+6 on that nobody handles.
pub fn signal(preferred: Option<c_int>) -> Result<c_int, SignalError> {
    SIGNAL
        .get_or_init(|| {
            let (lo, hi) = (libc::SIGRTMIN(), libc::SIGRTMAX());
            match preferred {
                Some(s) if (lo..=hi).contains(&s) => install_on(s),
                Some(sig) => Err(SignalError::NotRealTime { sig, lo, hi }),
                None => ((lo + 6)..=(hi - 2))
                    .find(|&s| unused(s))
                    .ok_or(SignalError::AllInUse)
                    .and_then(install_on),
            }
        })
        .clone()
}

/// Starts holding: threads that get the signal from now on park.
pub fn hold() {
    HOLD.store(1, Ordering::Release);
}

/// Ends the hold: every parked thread goes on.
pub fn unhold() {
    HOLD.store(0, Ordering::Release);
    futex_wake_all(&HOLD);
}

/// Whether a hold is on.
pub fn holding() -> bool {
    HOLD.load(Ordering::Acquire) != 0
}

/// The ids of the threads parked now.
pub fn parked() -> Vec<i32> {
    SLOTS
        .iter()
        .map(|s| s.load(Ordering::Acquire))
        .filter(|&t| t != 0)
        .collect()
}

/// How many threads are still inside the handler (parked, or leaving after [`unhold`]).
pub fn inside() -> usize {
    INSIDE.load(Ordering::Acquire)
}
