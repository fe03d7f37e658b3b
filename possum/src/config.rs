//! The command line's configuration: the `POSSUM_*` environment variables that `run`, `keeper`
//! and `doctor` read, typed, read here. (The checkpoint and restore commands read theirs in
//! their own module; the libraries each read their own.)

use std::ffi::OsString;
use std::path::PathBuf;

use possum_control::{path_var, EnvConfig};

pub use possum_keeper::KEEPER_ENV;

/// The libpossum.so that `possum run` preloads when `--lib` is not given.
pub const LIB_ENV: &str = "POSSUM_LIB";

/// The command line's settings.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Config {
    /// `POSSUM_LIB` (unset or empty: looked for beside the possum executable).
    pub lib: Option<PathBuf>,
    /// `POSSUM_KEEPER`: a keeper already serving, whose directory a job inherits (unset or empty:
    /// `possum run` starts one for its job).
    pub keeper: Option<PathBuf>,
    /// The CUDA driver settings (`POSSUM_LIBCUDA`), for `doctor`.
    pub cuda: possum_cuda::config::Config,
}

impl EnvConfig for Config {
    fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Config {
        Config {
            lib: path_var(&get, LIB_ENV),
            keeper: path_var(&get, KEEPER_ENV),
            cuda: possum_cuda::config::Config::from_lookup(&get),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_values() {
        let c = Config::from_vars(&[]);
        assert_eq!(c, Config::default());
        assert_eq!(c.cuda.libcuda, PathBuf::from("libcuda.so.1"));
        let c = Config::from_vars(&[
            ("POSSUM_LIB", "/l/libpossum.so"),
            ("POSSUM_KEEPER", "/tmp/possum/k"),
            ("POSSUM_LIBCUDA", "/f/libcuda.so.1"),
        ]);
        assert_eq!(c.lib, Some(PathBuf::from("/l/libpossum.so")));
        assert_eq!(c.keeper, Some(PathBuf::from("/tmp/possum/k")));
        assert_eq!(c.cuda.libcuda, PathBuf::from("/f/libcuda.so.1"));
    }

    #[test]
    fn empty_values_mean_unset() {
        let c = Config::from_vars(&[("POSSUM_LIB", ""), ("POSSUM_KEEPER", "")]);
        assert_eq!(c, Config::default());
    }
}
