//! Where a copy's time goes: the staging pool, the device's copies, the sink.
//!
//! A checkpoint or pre-copy round moves each chunk through three stages: the copier takes a
//! staging buffer (and waits when every one is in flight), the device copies the chunk into it,
//! and a writer thread waits for that copy and hands the bytes to the sink (which checksums and
//! writes them). [`PipelineClock`] sums the time spent waiting or working at each stage, across
//! threads; [`Pipeline`] is what a report says of it. With `writers` threads over `elapsed`,
//! `sink / writers` near `elapsed` says the writers were the bound; `copy_wait / writers` near it,
//! the device; `staging_wait` near it, the pool (the writers gave buffers back too slowly).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A copy's time at each stage, summed over its threads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Pipeline {
    /// Writer threads.
    pub writers: usize,
    /// Time the copier (or a hook's priority copy) waited for a free staging buffer.
    pub staging_wait: Duration,
    /// Time writers waited for the device's copy of their chunk.
    pub copy_wait: Duration,
    /// Time writers spent handing chunks to the sink (checksum and write).
    pub sink: Duration,
}

/// The running sums behind a [`Pipeline`], added to from any thread.
#[derive(Debug, Default)]
pub(crate) struct PipelineClock {
    staging_wait: AtomicU64,
    copy_wait: AtomicU64,
    sink: AtomicU64,
}

/// A stage of [`PipelineClock`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum Stage {
    StagingWait,
    CopyWait,
    Sink,
}

impl PipelineClock {
    /// Runs `f`, adding its time to `stage`.
    pub(crate) fn time<T>(&self, stage: Stage, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let sum = match stage {
            Stage::StagingWait => &self.staging_wait,
            Stage::CopyWait => &self.copy_wait,
            Stage::Sink => &self.sink,
        };
        sum.fetch_add(ns, Ordering::Relaxed);
        out
    }

    /// What the sums say, for a copy with `writers` writer threads.
    pub(crate) fn report(&self, writers: usize) -> Pipeline {
        let d = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
        Pipeline {
            writers,
            staging_wait: d(&self.staging_wait),
            copy_wait: d(&self.copy_wait),
            sink: d(&self.sink),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stage_sums_its_own_time_across_threads() {
        let c = PipelineClock::default();
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| c.time(Stage::Sink, || std::thread::sleep(Duration::from_millis(5))));
            }
        });
        let v = c.time(Stage::CopyWait, || 7);
        assert_eq!(v, 7, "the closure's value is handed back");
        let p = c.report(3);
        assert_eq!(p.writers, 3);
        assert!(
            p.sink >= Duration::from_millis(15),
            "three threads' 5 ms: {p:?}"
        );
        assert!(p.copy_wait < p.sink);
        assert_eq!(
            p.staging_wait,
            Duration::ZERO,
            "a stage never timed stays at zero"
        );
    }
}
