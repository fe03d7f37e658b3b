//! The threads that split, draft and fill work on, and a process's PID in its namespace (part
//! of [`super`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use possum_control::EnvConfig;

use super::index::HostMemError;

/// The unit of work of one `process_vm_writev` call.
pub(super) const FILL_CHUNK: u64 = 8 << 20;

/// `f` over every piece (a [`Piece`], or another unit of work), from up to `threads` threads taking them in order, each with its own
/// scratch from `scratch`; after a failure no piece is started, and the first error is returned.
/// The threads used.
pub(super) fn on_threads<T: Sync, S>(
    pieces: &[T],
    threads: usize,
    scratch: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, &T) -> Result<(), HostMemError> + Sync,
) -> Result<usize, HostMemError> {
    let threads = threads.clamp(1, pieces.len().max(1));
    let next = AtomicUsize::new(0);
    let first_error = std::sync::Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut scratch = scratch();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(p) = pieces.get(i) else { break };
                    if let Err(e) = f(&mut scratch, p) {
                        next.store(pieces.len(), Ordering::Relaxed);
                        first_error
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(e);
                        break;
                    }
                }
            });
        }
    });
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(threads),
    }
}

/// The PID `pid` has in its innermost PID namespace (the PID it had in the dumped tree when
/// CRIU restored it into a new namespace), from `/proc/PID/status`'s `NSpid`.
pub fn namespace_pid(pid: i32) -> Option<u32> {
    let s = possum_control::proc_text(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|p| p.parse().ok())
}

/// Threads for [`fill`](super::fill): `POSSUM_HOSTMEM_THREADS`, else the CPUs available, at
/// most 16.
pub fn default_threads() -> usize {
    crate::config::Config::from_env().hostmem_threads()
}
