//! The CRIU plugin's configuration: every `POSSUM_*` environment variable it reads (in criu's
//! environment), typed, read here and nowhere else.
//!
//! Read where it takes effect (criu loads the plugin anew for each dump or restore).

use std::ffi::OsString;
use std::path::PathBuf;

use possum_control::{path_var, EnvConfig};

/// NVIDIA's driver library to load instead of looking for `libcuda.so.1`.
pub const LIBCUDA_ENV: &str = "POSSUM_LIBCUDA";
/// Test only: a device path the plugin treats like an NVIDIA device.
pub const TEST_DEVICE_ENV: &str = "POSSUM_CRIU_PLUGIN_TEST_DEVICE";
/// Test only: `1` passes the images directory to the job even where it sees its path.
pub const PASS_DIR_ENV: &str = "POSSUM_CRIU_PLUGIN_PASS_DIR";

/// The plugin's settings.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Config {
    /// The driver library `POSSUM_LIBCUDA` names (unset or empty: looked for).
    pub libcuda: Option<PathBuf>,
    /// Test only: the stand-in for an NVIDIA device (unset or empty: none).
    pub test_device: Option<PathBuf>,
    /// Test only: always pass the images directory (`POSSUM_CRIU_PLUGIN_PASS_DIR=1`).
    pub force_pass_dir: bool,
}

impl EnvConfig for Config {
    fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Config {
        Config {
            libcuda: path_var(&get, LIBCUDA_ENV),
            test_device: path_var(&get, TEST_DEVICE_ENV),
            force_pass_dir: get(PASS_DIR_ENV).is_some_and(|v| v == "1"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_values() {
        assert_eq!(Config::from_vars(&[]), Config::default());
        let c = Config::from_vars(&[
            (LIBCUDA_ENV, "/l/libcuda.so.1"),
            (TEST_DEVICE_ENV, "/tmp/dev"),
            (PASS_DIR_ENV, "1"),
        ]);
        assert_eq!(c.libcuda, Some(PathBuf::from("/l/libcuda.so.1")));
        assert_eq!(c.test_device, Some(PathBuf::from("/tmp/dev")));
        assert!(c.force_pass_dir);
    }

    #[test]
    fn bad_values_mean_the_default() {
        let c = Config::from_vars(&[
            (LIBCUDA_ENV, ""),
            (TEST_DEVICE_ENV, ""),
            (PASS_DIR_ENV, "yes"),
        ]);
        assert_eq!(c, Config::default());
    }
}
