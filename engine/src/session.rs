//! What checkpoint and restore sessions share: the handle a caller waits on, and the account of
//! time the job's threads spent blocked in the hook.

use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::engine::EngineError;

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
