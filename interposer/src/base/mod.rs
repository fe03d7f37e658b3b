//! The leaves every other module may use: the settings read from the environment once
//! (`config`), the `POSSUM_VERBOSE` lines (`log`), what the wrappers do now (`mode`) and the
//! symbol lookups in the loaded objects (`elfsym`), and [`add_elapsed_ns`] for the counters
//! that sum time. None of them names another module of the crate but these.

pub(crate) mod config;
pub(crate) mod elfsym;
pub(crate) mod log;
pub(crate) mod mode;

/// Adds the nanoseconds since `since` to `counter` (saturating at `u64::MAX`).
pub(crate) fn add_elapsed_ns(counter: &std::sync::atomic::AtomicU64, since: std::time::Instant) {
    counter.fetch_add(
        u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX),
        std::sync::atomic::Ordering::Relaxed,
    );
}
