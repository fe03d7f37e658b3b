//! Which GPU runtimes a process has loaded, from the files it maps (`/proc/PID/maps`): NVIDIA's
//! driver library `libcuda`, which possum checkpoints, and AMD's HIP runtime `libamdhip64`,
//! which it does not yet.

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
        std::fs::read_to_string(format!("/proc/{pid}/maps"))
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

    #[test]
    fn the_runtimes_are_found_by_file_name() {
        let maps = "\
7f0000000000-7f0000001000 r--p 00000000 08:01 12 /opt/rocm-6.2.0/lib/libamdhip64.so.6.2.60200
7f0000002000-7f0000003000 r-xp 00000000 08:01 13 /usr/lib/x86_64-linux-gnu/libcudart.so.12
7f0000004000-7f0000005000 rw-p 00000000 00:00 0 [heap]
";
        assert_eq!(
            GpuRuntimes::in_maps(maps),
            GpuRuntimes {
                cuda: false,
                hip: true
            }
        );
        let maps = "\
7f0000000000-7f0000001000 r--p 00000000 08:01 12 /usr/lib/libcuda.so.570.86.15 (deleted)
7f0000002000-7f0000003000 r--p 00000000 08:01 14 /tmp/x/libamdhip64.so
";
        assert_eq!(
            GpuRuntimes::in_maps(maps),
            GpuRuntimes {
                cuda: true,
                hip: true
            }
        );
        // Names that only begin like them are other libraries.
        let maps = "\
7f0000000000-7f0000001000 r--p 00000000 08:01 12 /usr/lib/libcudadebugger.so.1
7f0000002000-7f0000003000 r--p 00000000 08:01 14 /usr/lib/libamdhip64_extra.so
7f0000004000-7f0000005000 r--p 00000000 08:01 15 /usr/lib/libamdhip64.sox
";
        assert_eq!(GpuRuntimes::in_maps(maps), GpuRuntimes::default());
    }
}
