//! possum-cuda's configuration: every `POSSUM_*` environment variable it reads, typed, read here
//! and nowhere else.
//!
//! Read where it takes effect (each [`crate::checkpoint::DriverCheckpoint::load`] reads it
//! anew). Unset or empty values mean the default.

use std::ffi::OsString;
use std::path::PathBuf;

use possum_control::{path_var, EnvConfig};

/// The driver library to load for the checkpoint API instead of `libcuda.so.1`.
pub const LIBCUDA_ENV: &str = "POSSUM_LIBCUDA";
/// `1`: a test or self-check that finds no CUDA device fails instead of skipping.
pub const REQUIRE_GPU_ENV: &str = "POSSUM_REQUIRE_GPU";

/// The driver library loaded by default (a `dlopen` name).
pub const DEFAULT_LIBCUDA: &str = "libcuda.so.1";

/// possum-cuda's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The driver library for the checkpoint API (a `dlopen` name or a path; default
    /// `libcuda.so.1`).
    pub libcuda: PathBuf,
    /// Whether a missing CUDA device is a failure rather than a skip (`POSSUM_REQUIRE_GPU=1`).
    pub require_gpu: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config::from_lookup(|_| None)
    }
}

impl EnvConfig for Config {
    fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Config {
        Config {
            libcuda: path_var(&get, LIBCUDA_ENV).unwrap_or_else(|| PathBuf::from(DEFAULT_LIBCUDA)),
            require_gpu: get(REQUIRE_GPU_ENV).is_some_and(|v| v == "1"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_values() {
        let c = Config::from_vars(&[]);
        assert_eq!(c.libcuda, PathBuf::from("libcuda.so.1"));
        assert!(!c.require_gpu);
        assert_eq!(c, Config::default());
        let c = Config::from_vars(&[(LIBCUDA_ENV, "/x/libcuda.so"), (REQUIRE_GPU_ENV, "1")]);
        assert_eq!(c.libcuda, PathBuf::from("/x/libcuda.so"));
        assert!(c.require_gpu);
    }

    #[test]
    fn bad_values_mean_the_default() {
        let c = Config::from_vars(&[(LIBCUDA_ENV, ""), (REQUIRE_GPU_ENV, "yes")]);
        assert_eq!(c, Config::default());
    }
}
