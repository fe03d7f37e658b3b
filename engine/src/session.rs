//! What checkpoint and restore sessions share: the handle a caller waits on, and the account of
//! time the job's threads spent blocked in the hook, and the account of what the job waited for.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::EngineError;
use crate::registry::Buffer;

/// How many buffers a report names among those the job waited on (the longest waits).
pub const WAITED_ON_TOP: usize = 8;

/// A checkpoint or restore under way, finishing on its own thread.
#[derive(Debug)]
pub struct SessionHandle<R> {
    join: JoinHandle<Result<R, EngineError>>,
    what: &'static str,
}

impl<R> SessionHandle<R> {
    pub(crate) fn new(join: JoinHandle<Result<R, EngineError>>, what: &'static str) -> Self {
        SessionHandle { join, what }
    }

    /// Waits until the session has finished and returns its report or its first error.
    pub fn wait(self) -> Result<R, EngineError> {
        let what = self.what;
        self.join
            .join()
            .unwrap_or_else(|_| Err(EngineError::Failed(format!("{what} thread panicked"))))
    }

    /// Whether the session has finished.
    pub fn is_finished(&self) -> bool {
        self.join.is_finished()
    }
}

/// Hook calls that blocked the job's thread: how many, for how long in all, the longest.
#[derive(Debug, Default)]
pub(crate) struct BlockedTime {
    count: AtomicU64,
    ns: AtomicU64,
    max_ns: AtomicU64,
}

impl BlockedTime {
    pub(crate) fn record(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.ns.fetch_add(ns, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// (count, total, longest).
    pub(crate) fn totals(&self) -> (u64, Duration, Duration) {
        (
            self.count.load(Ordering::Relaxed),
            Duration::from_nanos(self.ns.load(Ordering::Relaxed)),
            Duration::from_nanos(self.max_ns.load(Ordering::Relaxed)),
        )
    }
}

/// A buffer the job waited on during a session, and for how long in all.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WaitedOn {
    /// The buffer's id.
    pub id: u64,
    /// Its device address.
    pub va: u64,
    /// Its size in bytes.
    pub size: u64,
    /// The time the job waited on it.
    pub waited: Duration,
}

/// The time the job waited on possum during a session, buffer by buffer. Recorded only on the
/// paths that made the job wait.
#[derive(Debug, Default)]
pub(crate) struct JobWaits {
    total_ns: AtomicU64,
    by_buffer: Mutex<HashMap<u64, WaitedOn>>,
}

impl JobWaits {
    /// The job waited `d` on `buf`.
    pub(crate) fn record(&self, buf: &Buffer, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.total_ns.fetch_add(ns, Ordering::Relaxed);
        let mut m = self.by_buffer.lock();
        let w = m.entry(buf.id()).or_insert_with(|| WaitedOn {
            id: buf.id(),
            va: buf.va().0,
            size: buf.size(),
            waited: Duration::ZERO,
        });
        w.waited += d;
    }

    /// The total wait, and the buffers waited on longest (at most [`WAITED_ON_TOP`]), longest
    /// first.
    pub(crate) fn report(&self) -> (Duration, Vec<WaitedOn>) {
        let mut v: Vec<WaitedOn> = self.by_buffer.lock().values().cloned().collect();
        v.sort_unstable_by(|a, b| b.waited.cmp(&a.waited).then(a.id.cmp(&b.id)));
        v.truncate(WAITED_ON_TOP);
        (
            Duration::from_nanos(self.total_ns.load(Ordering::Relaxed)),
            v,
        )
    }
}
