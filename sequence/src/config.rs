//! The sequences' parameters from the environment, read in one place ([`Environment::read`]).

use possum_criu::LogLevel;

/// Whether a checkpoint takes the bulk of the job's private memory out of CRIU's images
/// (`POSSUM_HOSTMEM_SPLIT`), for possum's CRIU plugin to write back in parallel at restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostmemSplit {
    /// Unless a job left running without a keeper is still held (it would lengthen its stall).
    #[default]
    On,
    /// `0`: never.
    Off,
    /// `always`: also while a job left running without a keeper is held.
    Always,
}

/// What the checkpoint and restore sequences take from the environment. Variables read by the
/// crates below them are not here: `POSSUM_CRIU` and `POSSUM_CRIU_PLUGIN_DIR` (possum-criu's
/// `Criu::locate`), `POSSUM_SOCKET_DIR` (possum-control's `socket_dir`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Environment {
    /// `POSSUM_HOSTMEM_SPLIT`: `0` off, `always`, else on.
    pub hostmem_split: HostmemSplit,
    /// `POSSUM_KEEPER_REVIVE` (on unless `0`): during a kept hold, fds of the memory the job
    /// detached are held, and a new keeper takes it over should the job's die.
    pub keeper_revive: bool,
    /// `POSSUM_RESTORE_STAGE` (on unless `0`): the keeper loads the GPU images while CRIU
    /// restores the process.
    pub restore_stage: bool,
    /// `POSSUM_CRIU_LOG_LEVEL` (1 errors .. 4 everything), for a diagnosis.
    pub criu_log_level: Option<LogLevel>,
    /// `POSSUM_NVIDIA_SMI`, else `nvidia-smi` on PATH.
    pub nvidia_smi: String,
    /// `POSSUM_LIBCUDA`, else `libcuda.so.1`: the driver whose checkpoint API is used.
    pub libcuda: String,
}

impl Environment {
    /// The values of this process's environment.
    pub fn read() -> Environment {
        Environment::from_vars(|name| std::env::var(name).ok())
    }

    /// The values `var` gives (a variable's value, or `None` if unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Environment {
        let off = |name: &str| var(name).is_some_and(|v| v.trim() == "0");
        Environment {
            hostmem_split: match var("POSSUM_HOSTMEM_SPLIT").as_deref() {
                Some("0") => HostmemSplit::Off,
                Some("always") => HostmemSplit::Always,
                _ => HostmemSplit::On,
            },
            keeper_revive: var("POSSUM_KEEPER_REVIVE").as_deref() != Some("0"),
            restore_stage: !off("POSSUM_RESTORE_STAGE"),
            criu_log_level: match var("POSSUM_CRIU_LOG_LEVEL").as_deref().map(str::trim) {
                Some("1") => Some(LogLevel::Error),
                Some("2") => Some(LogLevel::Warn),
                Some("3") => Some(LogLevel::Info),
                Some("4") => Some(LogLevel::Debug),
                _ => None,
            },
            nvidia_smi: var("POSSUM_NVIDIA_SMI").unwrap_or_else(|| "nvidia-smi".into()),
            libcuda: var(possum_cuda::checkpoint::LIBCUDA_ENV)
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "libcuda.so.1".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_is_read_with_its_defaults() {
        let none = Environment::from_vars(|_| None);
        assert_eq!(none.hostmem_split, HostmemSplit::On);
        assert!(none.keeper_revive && none.restore_stage);
        assert_eq!(none.criu_log_level, None);
        assert_eq!(none.nvidia_smi, "nvidia-smi");
        assert_eq!(none.libcuda, "libcuda.so.1");
        let set = Environment::from_vars(|n| {
            Some(
                match n {
                    "POSSUM_HOSTMEM_SPLIT" => "always",
                    "POSSUM_CRIU_LOG_LEVEL" => " 4",
                    "POSSUM_LIBCUDA" => "",
                    _ => "0",
                }
                .to_string(),
            )
        });
        assert_eq!(set.hostmem_split, HostmemSplit::Always);
        assert!(!set.keeper_revive && !set.restore_stage);
        assert_eq!(set.criu_log_level, Some(LogLevel::Debug));
        assert_eq!(set.nvidia_smi, "0");
        assert_eq!(set.libcuda, "libcuda.so.1");
    }
}
