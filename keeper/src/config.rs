//! The keeper's configuration: every `POSSUM_*` environment variable it reads, typed, read here
//! and nowhere else.
//!
//! A keeper started by `possum run` inherits the job's environment. Unset, empty or unparsable
//! values mean the default. The settings are read where they take effect (the spare when a
//! server starts, the stage knobs once per stage), so a test may change them between stages.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use possum_control::EnvConfig;

/// The directory of the keeper's spare image memory (with [`SPARE_MIB_ENV`]).
pub const SPARE_DIR_ENV: &str = "POSSUM_KEEPER_SPARE_DIR";
/// The size of the spare, MiB (with [`SPARE_DIR_ENV`]; 0 or unset: no spare).
pub const SPARE_MIB_ENV: &str = "POSSUM_KEEPER_SPARE_MIB";
/// How much of a spare is registered at a time, MiB.
pub const SPARE_STEP_MIB_ENV: &str = "POSSUM_KEEPER_SPARE_STEP_MIB";
/// Threads copying into a spare.
pub const SPARE_THREADS_ENV: &str = "POSSUM_KEEPER_SPARE_THREADS";
/// Loader threads of one stage.
pub const STAGE_THREADS_ENV: &str = "POSSUM_KEEPER_STAGE_THREADS";
/// Threads reading a large buffer's chunks at once, for its loader.
pub const STAGE_READERS_ENV: &str = "POSSUM_KEEPER_STAGE_READERS";
/// Test hook: each buffer of a stage waits this long (ms) before it loads.
pub const STAGE_DELAY_MS_ENV: &str = "POSSUM_KEEPER_STAGE_DELAY_MS";
/// Test hook: the buffer at this position of a stage's load order fails to load.
pub const STAGE_FAIL_ENV: &str = "POSSUM_KEEPER_STAGE_FAIL";
/// Test hook: a stage loads nothing until this many waits for its buffers are pending at once.
pub const STAGE_HOLD_WAITERS_ENV: &str = "POSSUM_KEEPER_STAGE_HOLD_WAITERS";
/// `0`: a stage built on another takes only the buffers that one loaded whole, not the chunks
/// it loaded of a buffer it was still loading.
pub const STAGE_PARTIAL_ENV: &str = "POSSUM_KEEPER_STAGE_PARTIAL";

/// Default of [`Config::spare_step_bytes`]: 1 GiB.
const SPARE_STEP_MIB: u64 = 1024;
/// Default of [`Config::spare_threads`] (the copy engine and the checksums overlap).
const SPARE_THREADS: usize = 16;
/// At most this many spare threads.
const SPARE_THREADS_MAX: usize = 64;
/// Default of [`Config::stage_threads`].
const STAGE_THREADS: usize = 8;
/// [`Config::stage_readers`] at most.
const STAGE_READERS_MAX: usize = 32;

/// Default of [`Config::stage_readers`] (8 on a 16-core machine was no faster: docs/decisions.md,
/// decision 31).
const STAGE_READERS: usize = 4;

/// The keeper's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Spare image memory to keep: its directory and size in bytes (both variables set, the size
    /// above 0).
    pub spare: Option<(PathBuf, u64)>,
    /// Bytes of a spare registered at a time (default 1 GiB).
    pub spare_step_bytes: u64,
    /// Threads copying into a spare (default 16, at most 64).
    pub spare_threads: usize,
    /// Loader threads of one stage (default 8).
    pub stage_threads: usize,
    /// Threads reading a large buffer's chunks at once (one loader's; default 4, at most 32):
    /// one reads a page-cache file at a few GB/s, the copies to the GPU go at tens.
    pub stage_readers: usize,
    /// Test hook: how long each buffer of a stage waits before it loads (default none).
    pub stage_delay: Duration,
    /// Test hook: the position in load order of a buffer whose load fails on purpose.
    pub stage_fail: Option<usize>,
    /// Test hook: how many waits must be pending at once before a stage loads anything (default
    /// 0: it loads from the start).
    pub stage_hold_waiters: usize,
    /// A stage built on another (a prestage, or a stage ahead) takes the chunks that one loaded
    /// of a buffer it had not loaded whole when it was taken (default true; `0`: only the
    /// buffers it loaded whole, the others' chunks loaded again).
    pub stage_partial: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config::from_lookup(|_| None)
    }
}

impl EnvConfig for Config {
    fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Config {
        let num = |k: &str| -> Option<u64> { get(k)?.to_str()?.trim().parse().ok() };
        let positive = |k: &str| num(k).filter(|&n| n > 0);
        let spare = get(SPARE_DIR_ENV)
            .filter(|d| !d.is_empty())
            .zip(positive(SPARE_MIB_ENV))
            .map(|(dir, mib)| (PathBuf::from(dir), mib << 20));
        let count = |k: &str| positive(k).and_then(|n| usize::try_from(n).ok());
        Config {
            spare,
            spare_step_bytes: positive(SPARE_STEP_MIB_ENV).unwrap_or(SPARE_STEP_MIB) << 20,
            spare_threads: count(SPARE_THREADS_ENV)
                .unwrap_or(SPARE_THREADS)
                .min(SPARE_THREADS_MAX),
            stage_threads: count(STAGE_THREADS_ENV).unwrap_or(STAGE_THREADS),
            stage_readers: count(STAGE_READERS_ENV)
                .unwrap_or(STAGE_READERS)
                .min(STAGE_READERS_MAX),
            stage_delay: Duration::from_millis(num(STAGE_DELAY_MS_ENV).unwrap_or(0)),
            stage_fail: num(STAGE_FAIL_ENV).and_then(|n| usize::try_from(n).ok()),
            stage_hold_waiters: count(STAGE_HOLD_WAITERS_ENV).unwrap_or(0),
            stage_partial: get(STAGE_PARTIAL_ENV)
                .is_none_or(|v| v.to_str().map(str::trim) != Some("0")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let c = Config::from_vars(&[]);
        assert_eq!(c.spare, None);
        assert_eq!(c.spare_step_bytes, 1 << 30);
        assert_eq!(c.spare_threads, 16);
        assert_eq!(c.stage_threads, 8);
        assert_eq!(c.stage_readers, 4);
        assert_eq!(c.stage_delay, Duration::ZERO);
        assert_eq!(c.stage_fail, None);
        assert_eq!(c.stage_hold_waiters, 0);
        assert!(c.stage_partial);
        assert_eq!(c, Config::default());
        assert!(!Config::from_vars(&[(STAGE_PARTIAL_ENV, "0")]).stage_partial);
    }

    #[test]
    fn values_are_read() {
        let c = Config::from_vars(&[
            (SPARE_DIR_ENV, "/dev/shm/s"),
            (SPARE_MIB_ENV, " 64 "),
            (SPARE_STEP_MIB_ENV, "4"),
            (SPARE_THREADS_ENV, "500"),
            (STAGE_THREADS_ENV, "2"),
            (STAGE_READERS_ENV, "12"),
            (STAGE_DELAY_MS_ENV, "30"),
            (STAGE_FAIL_ENV, "0"),
            (STAGE_HOLD_WAITERS_ENV, "2"),
        ]);
        assert_eq!(c.spare, Some((PathBuf::from("/dev/shm/s"), 64 << 20)));
        assert_eq!(c.spare_step_bytes, 4 << 20);
        assert_eq!(c.spare_threads, 64, "capped");
        assert_eq!(c.stage_threads, 2);
        assert_eq!(c.stage_readers, 12);
        assert_eq!(
            Config::from_vars(&[(STAGE_READERS_ENV, "99")]).stage_readers,
            32,
            "capped"
        );
        assert_eq!(c.stage_delay, Duration::from_millis(30));
        assert_eq!(c.stage_fail, Some(0));
        assert_eq!(c.stage_hold_waiters, 2);
    }

    #[test]
    fn bad_values_mean_the_default() {
        let c = Config::from_vars(&[
            (SPARE_DIR_ENV, "/s"),
            (SPARE_MIB_ENV, "lots"),
            (SPARE_STEP_MIB_ENV, "0"),
            (SPARE_THREADS_ENV, "-1"),
            (STAGE_THREADS_ENV, "0"),
            (STAGE_READERS_ENV, "0"),
            (STAGE_DELAY_MS_ENV, "soon"),
            (STAGE_FAIL_ENV, "x"),
            (STAGE_HOLD_WAITERS_ENV, "-2"),
        ]);
        assert_eq!(c, Config::default());
        // A spare needs both its directory and a size above 0.
        assert_eq!(Config::from_vars(&[(SPARE_MIB_ENV, "8")]).spare, None);
        assert_eq!(
            Config::from_vars(&[(SPARE_DIR_ENV, ""), (SPARE_MIB_ENV, "8")]).spare,
            None
        );
        assert_eq!(
            Config::from_vars(&[(SPARE_DIR_ENV, "/s"), (SPARE_MIB_ENV, "0")]).spare,
            None
        );
    }
}
