//! The guard between this process and a `criu swrk` worker: it outlives this process just long
//! enough to kill what CRIU leaves behind.
//!
//! A task CRIU has half restored does not end when CRIU does: it waits, or spins, for a stage
//! that never comes. `PR_SET_PDEATHSIG` kills the worker with this process, not its tasks, and a
//! restored tree soon leaves the worker's process group (CRIU gives it its dumped session and
//! group). So the worker is started under a guard: a fork of the child that `Command` made,
//! which is a child subreaper (the worker's orphans come to it) and runs no Rust beyond the
//! async-signal-safe calls below. The guard waits for the worker; when the worker exits it exits
//! with the same status, and the tree the worker restored goes on up to this process (a
//! subreaper) or init, as it would from the worker. When this process dies first (the guard's
//! parent changes), the guard kills the worker (a dump's at its deadline only: CRIU stopped
//! midway may leave the dumped tree stopped or with its parasite code in it, so it is left to
//! finish) and then every task that comes to it, until it has no children left. It ignores the signals that end a job (`SIGINT`, `SIGTERM`, ...): they end
//! this process, and the guard cleans up after it. `SIGKILL` ends the guard, and the worker with
//! it (`PR_SET_PDEATHSIG`), but not what the worker was restoring.
//!
//! This is the crate's only code that runs between `fork` and `exec`; every call here is one
//! system call through `libc` or nix's thin wrappers, with no allocation and no locks.

use std::io;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{getpid, getppid, ForkResult, Pid};

/// How often the guard looks at its parent and the worker.
const TICK: Duration = Duration::from_millis(5);

/// Descriptors closed one by one where close_range(2) is missing.
const FALLBACK_CLOSE_FDS: i32 = 4096;

/// At most this many rounds of killing what comes to the guard.
const CLEANUP_ROUNDS: usize = 2000;

/// Called in the child `Command` forked, before `exec`: forks the worker, which returns (with
/// the guard's PID, its parent) to go on to `exec` CRIU; the guard never returns. `owner` is the
/// process whose death the guard watches for; once it is dead, the worker is left to finish
/// until `grace` (when given) before it is killed.
///
/// # Safety
///
/// Only in a child between `fork` and `exec` (it forks again and ends the calling process).
pub(crate) unsafe fn split(owner: Pid, grace: Option<Instant>) -> io::Result<Pid> {
    let guard = getpid();
    // Orphans of the worker (the tasks it was restoring) come to the guard.
    nix::sys::prctl::set_child_subreaper(true).map_err(io::Error::from)?;
    // SAFETY: the caller is a single-threaded child between fork and exec; both sides of this
    // fork go on with async-signal-safe calls only.
    match unsafe { nix::unistd::fork() }.map_err(io::Error::from)? {
        ForkResult::Child => Ok(guard),
        ForkResult::Parent { child } => watch(owner, child, grace),
    }
}

/// The guard's life: relay the worker's end, or clean up after the owner's.
fn watch(owner: Pid, worker: Pid, grace: Option<Instant>) -> ! {
    // The guard keeps no descriptor: the worker's socket must close when the worker ends.
    // SAFETY: close_range(2) and close(2) only close this process's descriptors, none of which
    // the guard uses again.
    unsafe {
        if libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) != 0 {
            // Kernels before 5.9.
            for fd in 0..FALLBACK_CLOSE_FDS {
                libc::close(fd);
            }
        }
    }
    // Signals meant for this process's job (a terminal's ^C, a service manager's SIGTERM) end
    // this process; the guard outlives it to clean up, then exits. Set here, after the worker's
    // fork, so that CRIU keeps the dispositions it had.
    for sig in [
        libc::SIGINT,
        libc::SIGQUIT,
        libc::SIGHUP,
        libc::SIGTERM,
        libc::SIGTSTP,
    ] {
        // SAFETY: signal(2) setting a disposition of this process to "ignore".
        unsafe { libc::signal(sig, libc::SIG_IGN) };
    }
    loop {
        match waitpid(worker, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, code)) => exit(code),
            Ok(WaitStatus::Signaled(_, sig, _)) => die_by(sig),
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => exit(127),
        }
        // Instant::now is clock_gettime(2), async-signal-safe.
        if getppid() != owner && !matches!(grace, Some(end) if Instant::now() < end) {
            let _ = kill(worker, Signal::SIGKILL);
            kill_children();
            exit(128 + libc::SIGKILL);
        }
        sleep(TICK);
    }
}

/// Kills the guard's children until none is left: the worker's orphans, then theirs.
fn kill_children() {
    let mut pids = [0i32; 256];
    for _ in 0..CLEANUP_ROUNDS {
        let n = children(&mut pids);
        for &p in &pids[..n] {
            let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
        }
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => break,
                Err(Errno::ECHILD) => {
                    if n == 0 {
                        return;
                    }
                    break;
                }
                Ok(_) | Err(_) => {}
            }
        }
        sleep(TICK);
    }
}

/// The guard's children, from `/proc/thread-self/children` (the guard has one thread), into
/// `out`; returns how many (at most `out.len()`: the rest are found next round).
fn children(out: &mut [i32]) -> usize {
    const PATH: &std::ffi::CStr = c"/proc/thread-self/children";
    // SAFETY: open(2) of a NUL-terminated constant path.
    let fd = unsafe { libc::open(PATH.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return 0;
    }
    let mut n = 0;
    let mut cur: Option<i32> = None;
    let mut buf = [0u8; 512];
    loop {
        // SAFETY: read(2) into a stack buffer of the length given.
        let got = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if got <= 0 {
            break;
        }
        for &b in &buf[..got as usize] {
            if b.is_ascii_digit() {
                cur = Some(cur.unwrap_or(0).saturating_mul(10) + i32::from(b - b'0'));
            } else if let Some(p) = cur.take() {
                if n < out.len() {
                    out[n] = p;
                    n += 1;
                }
            }
        }
    }
    if let Some(p) = cur {
        if n < out.len() {
            out[n] = p;
            n += 1;
        }
    }
    // SAFETY: closes the descriptor opened above.
    unsafe { libc::close(fd) };
    n
}

/// Ends the guard the way the worker ended: by the same signal.
fn die_by(sig: Signal) -> ! {
    // SAFETY: signal(2), sigprocmask(2) and kill(2) on this process; the default action of
    // `sig` ends it, else it exits below.
    unsafe {
        libc::signal(sig as i32, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig as i32);
        libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
    }
    let _ = kill(getpid(), sig);
    exit(128 + sig as i32)
}

fn exit(code: i32) -> ! {
    // SAFETY: _exit(2) ends this process without running anything of the parent's.
    unsafe { libc::_exit(code) }
}

fn sleep(d: Duration) {
    let ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: libc::c_long::try_from(d.as_nanos()).unwrap_or(1_000_000),
    };
    // SAFETY: nanosleep(2) with a valid request and no remainder.
    unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
}
