//! Which GPU runtimes a process has loaded, from the files it maps (`/proc/PID/maps`): NVIDIA's
//! driver library `libcuda` and AMD's HIP runtime `libamdhip64`; and the runtime a checkpoint
//! takes a job on ([`GpuRuntime`]), which its image records.

use serde::{Deserialize, Serialize};

/// The GPU runtime a job is checkpointed on, as its image records it (`possum.json`'s
/// `runtime`; absent: CUDA). It decides whether NVIDIA's driver takes part: its checkpoint
/// (lock, checkpoint, restore, unlock) for a CUDA job, nothing of it for a HIP job, whose GPU
/// state possum's engine saves alone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuRuntime {
    /// NVIDIA's CUDA: the driver's checkpoint takes part (unless `--gpu-only`).
    #[default]
    Cuda,
    /// AMD's HIP, served by possum (`runtime: hip` in the job's status): no NVIDIA driver.
    Hip,
}

impl GpuRuntime {
    /// Whether NVIDIA's driver checkpoint takes part in the job's checkpoint and restore.
    pub fn has_nvidia_driver(self) -> bool {
        self == GpuRuntime::Cuda
    }

    /// CUDA, the default (for `skip_serializing_if`: an image of a CUDA job says nothing).
    pub fn is_cuda(&self) -> bool {
        *self == GpuRuntime::Cuda
    }

    /// Its name in `possum.json` and in messages.
    pub fn name(self) -> &'static str {
        match self {
            GpuRuntime::Cuda => "cuda",
            GpuRuntime::Hip => "hip",
        }
    }
}

/// The GPU runtime libraries a process maps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuRuntimes {
    /// `libcuda.so*` (NVIDIA's driver library).
    pub cuda: bool,
    /// `libamdhip64.so*` (AMD's HIP runtime).
    pub hip: bool,
}

impl GpuRuntimes {
    /// What process `pid` maps; nothing when its maps cannot be read (a process gone, or one
    /// this process may not look at: the checks after the plan's first say so).
    pub fn of(pid: i32) -> GpuRuntimes {
        u32::try_from(pid)
            .ok()
            .and_then(possum_control::read_maps)
            .map(|maps| GpuRuntimes::in_maps(&maps))
            .unwrap_or_default()
    }

    /// What the lines of a `/proc/PID/maps` name; a file removed or replaced since it was mapped
    /// (` (deleted)` after its path) counts.
    pub fn in_maps(maps: &str) -> GpuRuntimes {
        let mut found = GpuRuntimes::default();
        for line in maps.lines() {
            let Some((_, file)) = line.rsplit_once('/') else {
                continue;
            };
            let file = file.trim_end();
            let file = file.strip_suffix(" (deleted)").unwrap_or(file);
            found.cuda |= is_library(file, "libcuda");
            found.hip |= is_library(file, "libamdhip64");
        }
        found
    }
}

/// Whether `file` is library `stem`: `stem.so`, or that with a version (`stem.so.6.2.41134`).
fn is_library(file: &str, stem: &str) -> bool {
    file.strip_prefix(stem)
        .and_then(|rest| rest.strip_prefix(".so"))
        .is_some_and(|v| v.is_empty() || v.starts_with('.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What [`GpuRuntimes::in_maps`] finds in `maps`: (CUDA, HIP).
    fn found(maps: &str) -> (bool, bool) {
        let r = GpuRuntimes::in_maps(maps);
        (r.cuda, r.hip)
    }

    #[test]
    fn the_runtimes_are_found_by_file_name() {
        let maps = "\
7f0000000000-7f0000001000 r--p 00000000 08:01 12 /opt/rocm-6.2.0/lib/libamdhip64.so.6.2.60200
7f0000002000-7f0000003000 r-xp 00000000 08:01 13 /usr/lib/x86_64-linux-gnu/libcudart.so.12
7f0000004000-7f0000005000 rw-p 00000000 00:00 0 [heap]
";
        assert_eq!(found(maps), (false, true));
        let maps = "\
7f0000000000-7f0000001000 r--p 00000000 08:01 12 /usr/lib/libcuda.so.570.86.15 (deleted)
7f0000002000-7f0000003000 r--p 00000000 08:01 14 /tmp/x/libamdhip64.so
";
        assert_eq!(found(maps), (true, true));
        // Names that only begin like them are other libraries.
        let maps = "\
7f0000000000-7f0000001000 r--p 00000000 08:01 12 /usr/lib/libcudadebugger.so.1
7f0000002000-7f0000003000 r--p 00000000 08:01 14 /usr/lib/libamdhip64_extra.so
7f0000004000-7f0000005000 r--p 00000000 08:01 15 /usr/lib/libamdhip64.sox
";
        assert_eq!(found(maps), (false, false));
    }
}
