//! Holding a job at the CPU level: every thread of the job but possum's own (and the CUDA
//! driver's) is parked in a signal handler, so that possum can copy and release the buffers of a
//! job whose GPU operations it does not see (CUPTI off: NVIDIA's driver checkpoint refuses a
//! process CUPTI has subscribed in, docs/decisions.md 17).
//!
//! ```text
//! park_all   hold on; tgkill(SIGRT) each thread; wait until all of them are in the handler
//!            (threads born meanwhile get the signal too); a thread that does not come in time
//!            fails the park (named in the error) and everything goes on
//! Watchdog   a thread parked inside the CUDA driver, or inside possum's own allocator, may hold a
//!            lock possum's copy then waits for: if the copy makes no progress ([`beat`]) for a
//!            while, the watchdog ends the hold (the lock is released, the copy finishes) and the
//!            caller throws that attempt away and tries again
//! unpark_all hold off; every parked thread goes on where it was interrupted
//! ```
//!
//! Invariant: while [`held`], no thread of the job runs user code, so the job neither queues GPU
//! work nor touches a buffer. Threads whose name starts with one of [`SKIP`] are not parked:
//! possum's (`possum-*`) and the CUDA driver's (`cuda-EvtHandlr`, `cuda0000...`), which possum's own
//! calls may need; they do not run the job's code.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::ops::park_sys;
use crate::session::state::session;

/// Name prefixes of threads that are never parked (`POSSUM_PARK_SKIP` adds more, comma-separated):
/// possum's, the CUDA driver's, and jemalloc's background purger (it blocks every signal, and
/// only returns memory to the kernel).
pub const SKIP: &[&str] = &["possum-", "cuda", "jemalloc_bg_thd"];

/// Records progress of the work done while the job is held (the watchdog's heartbeat).
pub fn beat() {
    session().beat.fetch_add(1, Ordering::Relaxed);
}

/// Whether threads are held now.
pub fn held() -> bool {
    park_sys::holding()
}

/// How long threads get to park (`POSSUM_PARK_TIMEOUT_MS`, default 2000).
pub fn park_timeout() -> Duration {
    crate::base::config::get().tuning.park_timeout
}

/// How long held work may go without progress (`POSSUM_PARK_WATCHDOG_MS`, default 1000: the
/// copy beats once per chunk, so a second without one is a stall, not a slow copy).
pub fn watchdog_limit() -> Duration {
    crate::base::config::get().tuning.park_watchdog
}

/// The threads of this process: (id, name).
fn tasks() -> Vec<(i32, String)> {
    let Ok(rd) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    rd.filter_map(|e| {
        let e = e.ok()?;
        let tid: i32 = e.file_name().to_str()?.parse().ok()?;
        let comm = possum_control::proc_text(e.path().join("comm")).unwrap_or_default();
        Some((tid, comm.trim_end().to_string()))
    })
    .collect()
}

/// Whether thread `tid` blocks signal `sig` (its `SigBlk` in /proc).
fn blocks(tid: i32, sig: i32) -> bool {
    let Ok(s) = possum_control::proc_text(format!("/proc/self/task/{tid}/status")) else {
        return false;
    };
    s.lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .is_some_and(|m| (1..=64).contains(&sig) && m & (1u64 << (sig - 1)) != 0)
}

fn skip_prefixes() -> Vec<String> {
    let mut v: Vec<String> = SKIP.iter().map(|s| s.to_string()).collect();
    v.extend(crate::base::config::get().tuning.park_skip.iter().cloned());
    v
}

/// Why the job's threads could not be parked.
#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    /// No signal to park them with.
    #[error("cannot hold the job: {0}")]
    NoSignal(park_sys::SignalError),
    /// A thread could not be signalled.
    #[error("cannot signal thread {tid} ({comm}): {source}")]
    Signal {
        /// The thread.
        tid: i32,
        /// Its name.
        comm: String,
        /// Why.
        source: std::io::Error,
    },
    /// Threads block the parking signal.
    #[error(
        "cannot hold the job: thread(s) {} block the parking signal ({sig}); if they never \
         touch the GPU, name them in POSSUM_PARK_SKIP (name prefixes, comma-separated) to leave \
         them running",
        threads.join(", ")
    )]
    Masked {
        /// The threads, "tid (name)".
        threads: Vec<String>,
        /// The signal.
        sig: i32,
    },
    /// Threads did not park in time.
    #[error(
        "cannot hold the job: thread(s) {} did not stop within {ms} ms (stuck in the kernel?); \
         POSSUM_PARK_TIMEOUT_MS sets the wait",
        threads.join(", ")
    )]
    Timeout {
        /// The threads, "tid (name)".
        threads: Vec<String>,
        /// The wait.
        ms: u128,
    },
}

/// The job's threads parked: how many, their names, the signal, and how long it took.
#[derive(Debug, Clone, Serialize)]
pub struct Parked {
    /// How many.
    pub threads: usize,
    /// Their names, sorted.
    pub names: Vec<String>,
    /// The signal that parked them.
    pub signal: i32,
    /// Milliseconds.
    pub ms: f64,
}

/// Parks every thread of the job (not the caller, not [`SKIP`]'s) and returns once all of them
/// are parked. On failure nothing stays parked.
pub fn park_all(timeout: Duration) -> Result<Parked, ParkError> {
    let preferred = crate::base::config::get().tuning.park_signal;
    let sig = park_sys::signal(preferred).map_err(ParkError::NoSignal)?;
    park_sys::hold();
    signal_until_parked(sig, timeout).inspect_err(|_| unpark_all())
}

/// With the hold on: signals every thread to park (again for threads born meanwhile) until all of
/// them are parked, or one cannot be.
fn signal_until_parked(sig: i32, timeout: Duration) -> Result<Parked, ParkError> {
    let me = park_sys::gettid();
    let skip = skip_prefixes();
    let t = Instant::now();
    let mut signaled: HashMap<i32, String> = HashMap::new();
    loop {
        let live = tasks();
        let mut sent = false;
        let mut masked = Vec::new();
        for (tid, comm) in &live {
            if *tid == me
                || signaled.contains_key(tid)
                || skip.iter().any(|p| comm.starts_with(p.as_str()))
            {
                continue;
            }
            if blocks(*tid, sig) {
                masked.push(format!("{tid} ({comm})"));
                continue;
            }
            match park_sys::tgkill(*tid, sig) {
                Ok(()) => {
                    signaled.insert(*tid, comm.clone());
                    sent = true;
                }
                Err(libc::ESRCH) => {}
                Err(e) => {
                    return Err(ParkError::Signal {
                        tid: *tid,
                        comm: comm.clone(),
                        source: std::io::Error::from_raw_os_error(e),
                    });
                }
            }
        }
        if !masked.is_empty() {
            return Err(ParkError::Masked {
                threads: masked,
                sig,
            });
        }
        let parked: HashSet<i32> = park_sys::parked().into_iter().collect();
        let live: HashSet<i32> = live.iter().map(|(t, _)| *t).collect();
        let pending: Vec<String> = signaled
            .iter()
            .filter(|(t, _)| live.contains(t) && !parked.contains(t))
            .map(|(t, c)| format!("{t} ({c})"))
            .collect();
        if pending.is_empty() && !sent {
            let mut names: Vec<String> = signaled
                .iter()
                .filter(|(t, _)| parked.contains(t))
                .map(|(_, c)| c.clone())
                .collect();
            names.sort();
            return Ok(Parked {
                threads: names.len(),
                names,
                signal: sig,
                ms: t.elapsed().as_secs_f64() * 1e3,
            });
        }
        if t.elapsed() > timeout {
            return Err(ParkError::Timeout {
                threads: pending,
                ms: timeout.as_millis(),
            });
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Lets every parked thread go on, and waits (a little) until they have left the handler, so a
/// new hold does not count them twice.
pub fn unpark_all() {
    park_sys::unhold();
    let t = Instant::now();
    while park_sys::inside() > 0 && t.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Ends the hold if the held work stops making progress (see the module doc).
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    /// Answers whether it ended the hold.
    thread: Option<std::thread::JoinHandle<bool>>,
}

impl Watchdog {
    /// Starts watching [`beat`]: no beat for `limit` ends the hold.
    pub fn start(limit: Duration) -> Watchdog {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("possum-watchdog".into())
            .spawn(move || {
                let mut last = session().beat.load(Ordering::Relaxed);
                let mut since = Instant::now();
                while !s.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(10));
                    let now = session().beat.load(Ordering::Relaxed);
                    if now != last {
                        last = now;
                        since = Instant::now();
                    } else if since.elapsed() > limit {
                        crate::base::log::log(&format!(
                            "no progress for {} ms with the job held: ending the hold",
                            limit.as_millis()
                        ));
                        unpark_all();
                        return true;
                    }
                }
                false
            })
            .ok();
        Watchdog { stop, thread }
    }

    /// Stops watching; whether it ended the hold.
    pub fn stop(mut self) -> bool {
        self.stop.store(true, Ordering::Release);
        self.thread
            .take()
            .is_some_and(|t| t.join().unwrap_or(false))
    }
}
