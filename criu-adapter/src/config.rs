//! possum-criu's configuration: every `POSSUM_*` environment variable it reads, typed, read here
//! and nowhere else.
//!
//! Read where it takes effect (each [`crate::Criu::locate`], each plugin lookup, each fill), so
//! that a process may change its environment between them.

use std::ffi::OsString;
use std::path::PathBuf;

use possum_control::{path_var, EnvConfig};

/// The CRIU binary to use.
pub const CRIU_ENV: &str = "POSSUM_CRIU";
/// The directory of CRIU plugins to load (possum's `libpossum_criu_plugin.so`); an empty value
/// loads none.
pub const PLUGIN_DIR_ENV: &str = "POSSUM_CRIU_PLUGIN_DIR";
/// Threads writing a restored job's private memory back.
pub const HOSTMEM_THREADS_ENV: &str = "POSSUM_HOSTMEM_THREADS";
/// `0`: CRIU's cache of its probe of the kernel is not made where CRIU does not keep one.
pub const KDAT_ENV: &str = "POSSUM_CRIU_KDAT";

/// At most this many fill threads by default.
const HOSTMEM_THREADS_MAX: usize = 16;

/// possum-criu's settings.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Config {
    /// The CRIU binary named by `POSSUM_CRIU` (unset or empty: looked for).
    pub criu: Option<PathBuf>,
    /// `POSSUM_CRIU_PLUGIN_DIR` as given: `None` when unset (possum's plugin is looked for),
    /// `Some(None)` when empty (no plugin), else the directory.
    pub plugin_dir: Option<Option<PathBuf>>,
    /// Fill threads asked for by `POSSUM_HOSTMEM_THREADS` (above 0; unset or bad: the CPUs).
    pub hostmem_threads: Option<usize>,
    /// `POSSUM_CRIU_KDAT=0`: CRIU's cache of the kernel's features is not made
    /// ([`crate::kdat`]).
    pub no_kdat: bool,
}

impl EnvConfig for Config {
    fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Config {
        Config {
            criu: path_var(&get, CRIU_ENV),
            plugin_dir: get(PLUGIN_DIR_ENV).map(|v| (!v.is_empty()).then(|| PathBuf::from(v))),
            hostmem_threads: get(HOSTMEM_THREADS_ENV)
                .and_then(|v| v.to_str()?.trim().parse().ok())
                .filter(|&n: &usize| n > 0),
            no_kdat: get(KDAT_ENV).is_some_and(|v| v.to_str().map(str::trim) == Some("0")),
        }
    }
}

impl Config {
    /// Fill threads: `POSSUM_HOSTMEM_THREADS`, else the CPUs available, at most 16.
    pub fn hostmem_threads(&self) -> usize {
        self.hostmem_threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(4)
                .min(HOSTMEM_THREADS_MAX)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_set_is_the_default() {
        let c = Config::from_lookup(|_| None);
        assert_eq!(c.criu, None);
        assert_eq!(c, Config::default());
        assert_eq!(c.plugin_dir, None);
        let n = c.hostmem_threads();
        assert!((1..=16).contains(&n), "{n}");
    }

    #[test]
    fn values_are_read() {
        let c = Config::from_vars(&[
            (CRIU_ENV, "/opt/criu"),
            (PLUGIN_DIR_ENV, "/p"),
            (HOSTMEM_THREADS_ENV, " 40 "),
            (KDAT_ENV, "0"),
        ]);
        assert!(c.no_kdat);
        assert_eq!(c.criu, Some(PathBuf::from("/opt/criu")));
        assert_eq!(c.plugin_dir, Some(Some(PathBuf::from("/p"))));
        assert_eq!(c.hostmem_threads(), 40, "asked for: not capped");
        // Empty: no plugin at all (not the default lookup).
        assert_eq!(
            Config::from_vars(&[(PLUGIN_DIR_ENV, "")]).plugin_dir,
            Some(None)
        );
    }

    #[test]
    fn bad_values_mean_the_default() {
        let c = Config::from_vars(&[(CRIU_ENV, ""), (HOSTMEM_THREADS_ENV, "0")]);
        assert_eq!(c, Config::default());
        assert_eq!(
            Config::from_vars(&[(HOSTMEM_THREADS_ENV, "many")]).hostmem_threads,
            None
        );
    }
}
