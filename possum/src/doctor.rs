//! `possum doctor`: whether a checkpoint can work on this machine, check by check.
//!
//! Each check ends `ok`, `warn` (a checkpoint works, but slower or with less) or `FAIL` (a
//! checkpoint cannot work here), with the evidence or what to do. The exit code is 1 when any
//! check FAILs.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use possum_control::EnvConfig;
use possum_criu::doctor::{Feature, HostReport, Support};
use serde::Serialize;

use crate::config::Config;

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Print the checks as one JSON object (`{"ok": BOOL, "checks": [{"name", "verdict",
    /// "detail"}]}`) instead of one line each.
    #[arg(long)]
    pub json: bool,
}

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// What a checkpoint needs is there.
    Ok,
    /// A checkpoint works without it, slower or with less.
    Warn,
    /// A checkpoint cannot work here.
    Fail,
}

impl Verdict {
    fn label(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
        }
    }
}

/// One check: what was checked, the verdict, and the evidence or what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub verdict: Verdict,
    pub detail: String,
}

fn check(name: &'static str, verdict: Verdict, detail: impl Into<String>) -> Check {
    Check {
        name,
        verdict,
        detail: detail.into(),
    }
}

/// The report of every check.
#[derive(Debug, Serialize)]
struct Report {
    /// True when nothing FAILs.
    ok: bool,
    checks: Vec<Check>,
}

pub fn run(a: &DoctorArgs) -> Result<bool> {
    let checks = checks(&Config::from_env());
    let ok = checks.iter().all(|c| c.verdict != Verdict::Fail);
    if a.json {
        println!("{}", serde_json::to_string(&Report { ok, checks })?);
    } else {
        for c in &checks {
            println!("{:<20} {:<5} {}", c.name, c.verdict.label(), c.detail);
        }
        if !ok {
            println!("possum doctor: a checkpoint cannot work on this machine (see FAIL above)");
        }
    }
    Ok(ok)
}

/// Every check, in order.
fn checks(config: &Config) -> Vec<Check> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let host = possum_criu::doctor::host_report();
    let mut v = vec![privileges(
        nix::unistd::geteuid().is_root(),
        &read("/proc/self/status"),
    )];
    v.extend(criu_checks(&host));
    let dirs = library_dirs(&std::env::var("LD_LIBRARY_PATH").unwrap_or_default());
    v.push(runtimes(
        &config.cuda.libcuda,
        find_library(&config.cuda.libcuda, &dirs),
        HIP_RUNTIME_NAMES
            .iter()
            .find_map(|n| find_library(Path::new(n), &dirs)),
    ));
    v.push(gpu(possum_cuda::probe()));
    v.push(driver_checkpoint(
        &config.cuda.libcuda.display().to_string(),
        possum_cuda::checkpoint::DriverCheckpoint::load().map(|_| ()),
        &read("/proc/driver/nvidia/version"),
    ));
    v.push(criu_plugin());
    v.push(libpossum(config));
    let (fast, text) = huge_pages(
        &read("/sys/kernel/mm/transparent_hugepage/enabled"),
        &read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        &read("/proc/mounts"),
    );
    v.push(check(
        "huge pages",
        if fast { Verdict::Ok } else { Verdict::Warn },
        text,
    ));
    v
}

/// CAP_SYS_ADMIN and CAP_CHECKPOINT_RESTORE, as bit numbers of a capability set.
const CAP_SYS_ADMIN: u32 = 21;
const CAP_CHECKPOINT_RESTORE: u32 = 40;

/// Root, or the capabilities CRIU and NVIDIA's driver checkpoint need, from `status` (the text
/// of `/proc/self/status`, whose `CapEff:` line is the effective set in hex).
fn privileges(root: bool, status: &str) -> Check {
    const NAME: &str = "privileges";
    if root {
        return check(NAME, Verdict::Ok, "root");
    }
    let caps = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
        .unwrap_or(0);
    let has = |bit: u32| caps & (1u64 << bit) != 0;
    if has(CAP_SYS_ADMIN) {
        check(NAME, Verdict::Ok, "not root, but CAP_SYS_ADMIN")
    } else if has(CAP_CHECKPOINT_RESTORE) {
        check(NAME, Verdict::Ok, "not root, but CAP_CHECKPOINT_RESTORE")
    } else {
        check(
            NAME,
            Verdict::Fail,
            "not root, and neither CAP_SYS_ADMIN nor CAP_CHECKPOINT_RESTORE: CRIU cannot dump or \
             restore a process (run possum as root)",
        )
    }
}

/// The CRIU binary and version (4.x or later), `criu check`, and the kernel features CRIU uses.
fn criu_checks(host: &HostReport) -> Vec<Check> {
    let criu = match (&host.criu_binary, &host.criu_version) {
        (Ok(bin), Ok(v)) if v.major >= 4 => {
            check("criu", Verdict::Ok, format!("{v} ({})", bin.display()))
        }
        (Ok(bin), Ok(v)) => check(
            "criu",
            Verdict::Fail,
            format!(
                "{v} ({}): possum needs CRIU 4.x or later (scripts/install-criu.sh, or point \
                 POSSUM_CRIU at one)",
                bin.display()
            ),
        ),
        (Ok(bin), Err(e)) => check(
            "criu",
            Verdict::Fail,
            format!("{} does not answer: {e}", bin.display()),
        ),
        (Err(e), _) => check("criu", Verdict::Fail, format!("not found: {e}")),
    };
    let feature = |name: &'static str, f: &Feature, missing: Verdict| {
        let verdict = match f.support {
            Support::Yes => Verdict::Ok,
            Support::No => missing,
            Support::Unknown => Verdict::Warn,
        };
        check(name, verdict, f.detail.clone())
    };
    vec![
        criu,
        feature("criu check", &host.criu_check, Verdict::Fail),
        feature("tcp sockets", &host.tcp_sockets, Verdict::Fail),
        feature("kernel probe cache", &host.kdat_cache, Verdict::Warn),
        check("kernel", Verdict::Ok, host.kernel.clone()),
        feature(
            "checkpoint/restore",
            &host.checkpoint_restore,
            Verdict::Fail,
        ),
        feature("userfaultfd", &host.userfaultfd, Verdict::Warn),
        feature("soft-dirty", &host.soft_dirty, Verdict::Warn),
    ]
}

/// The names AMD's HIP runtime library goes by, in the order they are looked for.
const HIP_RUNTIME_NAMES: &[&str] = &["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"];

/// The directories a library's file name is looked for in: `ld_library_path`'s (the value of
/// `LD_LIBRARY_PATH`), ROCm's, then the system's.
fn library_dirs(ld_library_path: &str) -> Vec<PathBuf> {
    ld_library_path
        .split(':')
        .filter(|d| !d.is_empty())
        .chain([
            "/opt/rocm/lib",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/lib/x86_64-linux-gnu",
            "/lib64",
        ])
        .map(PathBuf::from)
        .collect()
}

/// `lib` when it is a path (has a `/`) naming a file; else the first file of that name in `dirs`.
fn find_library(lib: &Path, dirs: &[PathBuf]) -> Option<PathBuf> {
    if lib.to_string_lossy().contains('/') {
        return lib.is_file().then(|| lib.to_path_buf());
    }
    dirs.iter().map(|d| d.join(lib)).find(|p| p.is_file())
}

/// The GPU runtimes found: NVIDIA's driver library `libcuda` (as configured), and AMD's HIP
/// runtime, whose front end is tested on a simulated runtime only.
fn runtimes(libcuda: &Path, cuda: Option<PathBuf>, hip: Option<PathBuf>) -> Check {
    let cuda_text = match &cuda {
        Some(p) => format!("libcuda {}", p.display()),
        None => format!("libcuda not found ({})", libcuda.display()),
    };
    let hip_text = match hip {
        Some(p) => format!(
            "libamdhip64 {} (possum's HIP front end is tested on a simulated runtime, not on AMD \
             hardware)",
            p.display()
        ),
        None => "libamdhip64 not found".to_string(),
    };
    check(
        "gpu runtimes",
        if cuda.is_some() {
            Verdict::Ok
        } else {
            Verdict::Warn
        },
        format!("{cuda_text}; {hip_text}"),
    )
}

/// A CUDA device, as the driver reports it.
fn gpu(probe: Result<possum_cuda::DriverInfo, String>) -> Check {
    match probe {
        Ok(info) => check(
            "gpu",
            Verdict::Ok,
            format!(
                "{} device(s), driver CUDA {}.{}",
                info.device_count,
                info.driver_version / 1000,
                info.driver_version % 1000 / 10
            ),
        ),
        Err(why) => check(
            "gpu",
            Verdict::Fail,
            format!("no GPU: {why} (possum checkpoints CUDA processes on an NVIDIA GPU)"),
        ),
    }
}

/// NVIDIA's driver library and its checkpoint API (`cuCheckpointProcess*`), as `load` found
/// them; `version` is `/proc/driver/nvidia/version` (empty when there is no NVIDIA kernel
/// module).
fn driver_checkpoint(
    lib: &str,
    load: Result<(), possum_cuda::checkpoint::DriverCkptError>,
    version: &str,
) -> Check {
    const NAME: &str = "driver checkpoint";
    let module = version
        .lines()
        .next()
        .and_then(|l| l.split("Kernel Module").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .map(|v| format!(", NVIDIA kernel module {v}"))
        .unwrap_or_default();
    match load {
        Ok(()) => check(
            NAME,
            Verdict::Ok,
            format!("cuCheckpointProcess* in {lib}{module}"),
        ),
        Err(e) => check(
            NAME,
            Verdict::Fail,
            format!(
                "{e}{module}: NVIDIA's driver checkpoint (driver 570 or later) is needed \
                 (POSSUM_LIBCUDA names another libcuda)"
            ),
        ),
    }
}

/// possum's CRIU plugin, where `possum checkpoint` and `restore` look for it.
fn criu_plugin() -> Check {
    const NAME: &str = "criu plugin";
    let file = possum_criu::default_plugin_dir()
        .map(|d| d.join(possum_criu::PLUGIN_FILE))
        .filter(|f| f.is_file());
    match file {
        Some(f) => check(NAME, Verdict::Ok, f.display().to_string()),
        None => check(
            NAME,
            Verdict::Warn,
            format!(
                "{} not found (POSSUM_CRIU_PLUGIN_DIR, else criu-plugins/ or the build beside the \
                 possum executable): CRIU then restores a job's memory itself, slower, and a job \
                 with worker processes that use the GPU cannot be checkpointed; build it with \
                 `cargo build --release -p possum-criu-plugin`",
                possum_criu::PLUGIN_FILE
            ),
        ),
    }
}

/// libpossum.so, where `possum run` looks for it.
fn libpossum(config: &Config) -> Check {
    let found = std::env::current_exe()
        .map_err(anyhow::Error::from)
        .and_then(|exe| crate::run::find_lib(None, config.lib.clone(), &exe));
    match found {
        Ok(p) => check("libpossum.so", Verdict::Ok, p.display().to_string()),
        Err(e) => check("libpossum.so", Verdict::Fail, format!("{e:#}")),
    }
}

/// The selected `[mode]` of a transparent-huge-page setting, if there is one.
fn selected(setting: &str) -> Option<&str> {
    let start = setting.find('[')? + 1;
    let end = start + setting[start..].find(']')?;
    Some(&setting[start..end])
}

/// What the machine's huge-page settings mean for checkpoints, and whether they are the fast ones:
/// `enabled` and `shmem` are `/sys/kernel/mm/transparent_hugepage/{enabled,shmem_enabled}`,
/// `mounts` is `/proc/mounts`. An image written to a tmpfs with 2 MiB pages drains faster (on an
/// H100 machine 42.6 GB/s from 16 threads against 31 for 4 KiB pages; eval/results/README.md).
/// CRIU restores a process's memory before it applies the process's `madvise` bits, so unless THP
/// is `always` it faults the memory in 4 KiB at a time (a 1.1 GB job: CRIU's restore 0.42-0.51 s
/// with `always`, 0.65-0.72 s with `madvise`). possum's CRIU plugin writes most of a `possum
/// checkpoint` image's memory back itself, so this matters for what it does not write back.
fn huge_pages(enabled: &str, shmem: &str, mounts: &str) -> (bool, String) {
    let thp = selected(enabled).unwrap_or("unknown");
    let shm = selected(shmem).unwrap_or("unknown");
    let devshm_huge = mounts.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 3
            && f[1] == "/dev/shm"
            && f[3]
                .split(',')
                .any(|o| o.starts_with("huge=") && o != "huge=never")
    });
    let hint = if devshm_huge || matches!(shm, "always" | "force") {
        "tmpfs images get 2 MiB pages"
    } else {
        "for images in memory, a tmpfs mounted with huge=always drains faster \
         (mount -t tmpfs -o huge=always,size=... none DIR)"
    };
    let restore_hint = if thp == "always" {
        ""
    } else {
        "; CRIU restores a job's memory faster with transparent huge pages `always` \
         (echo always > /sys/kernel/mm/transparent_hugepage/enabled): what possum's CRIU \
         plugin does not write back itself (`--engine driver` images, memory a forked worker \
         shares)"
    };
    let text = format!(
        "transparent {thp}, shmem {shm}, /dev/shm huge: {}; {hint}{restore_hint}",
        if devshm_huge { "yes" } else { "no" }
    );
    (
        restore_hint.is_empty() && (devshm_huge || matches!(shm, "always" | "force")),
        text,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libraries_are_found_by_path_or_name() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        std::fs::write(b.join("libamdhip64.so.6"), b"").unwrap();
        std::fs::write(a.join("libcuda.so.1"), b"").unwrap();
        let dirs = library_dirs(&format!("{}::{}", a.display(), b.display()));
        assert_eq!(dirs[..2], [a.clone(), b.clone()]);
        assert!(dirs.contains(&PathBuf::from("/opt/rocm/lib")));
        assert_eq!(
            find_library(Path::new("libamdhip64.so.6"), &dirs),
            Some(b.join("libamdhip64.so.6"))
        );
        assert_eq!(
            find_library(Path::new("libamdhip64.so.5"), &dirs[..2]),
            None
        );
        // A path is taken as it is, never looked up.
        let cuda = a.join("libcuda.so.1");
        assert_eq!(find_library(&cuda, &[]), Some(cuda.clone()));
        assert_eq!(find_library(&b.join("libcuda.so.1"), &dirs), None);
    }

    #[test]
    fn runtimes_say_which_were_found() {
        let lib = Path::new("libcuda.so.1");
        let c = runtimes(lib, Some("/x/libcuda.so.1".into()), None);
        assert_eq!(c.verdict, Verdict::Ok);
        assert_eq!(c.detail, "libcuda /x/libcuda.so.1; libamdhip64 not found");
        let c = runtimes(lib, None, Some("/opt/rocm/lib/libamdhip64.so".into()));
        assert_eq!(c.verdict, Verdict::Warn);
        assert_eq!(
            c.detail,
            "libcuda not found (libcuda.so.1); libamdhip64 /opt/rocm/lib/libamdhip64.so \
             (possum's HIP front end is tested on a simulated runtime, not on AMD hardware)"
        );
    }

    #[test]
    fn privileges_are_root_or_a_capability() {
        assert_eq!(privileges(true, "").verdict, Verdict::Ok);
        let status = |caps: u64| format!("Name:\tpossum\nCapEff:\t{caps:016x}\n");
        assert_eq!(privileges(false, &status(0)).verdict, Verdict::Fail);
        assert!(privileges(false, &status(0))
            .detail
            .contains("run possum as root"));
        let admin = privileges(false, &status(1 << 21));
        assert_eq!(admin.verdict, Verdict::Ok);
        assert!(admin.detail.contains("CAP_SYS_ADMIN"), "{admin:?}");
        let cr = privileges(false, &status(1 << 40));
        assert_eq!(cr.verdict, Verdict::Ok);
        assert!(cr.detail.contains("CAP_CHECKPOINT_RESTORE"), "{cr:?}");
        assert_eq!(privileges(false, "CapEff: zz").verdict, Verdict::Fail);
    }

    #[test]
    fn the_driver_version_comes_from_the_kernel_module() {
        let version = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 \
                       07:09:00 UTC 2025\nGCC version: gcc 12\n";
        let c = driver_checkpoint("libcuda.so.1", Ok(()), version);
        assert_eq!(c.verdict, Verdict::Ok);
        assert_eq!(
            c.detail,
            "cuCheckpointProcess* in libcuda.so.1, NVIDIA kernel module 580.65.06"
        );
        let e = possum_cuda::checkpoint::DriverCkptError::Unsupported {
            symbol: "cuCheckpointProcessLock",
        };
        let c = driver_checkpoint("libcuda.so.1", Err(e), "");
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(c.detail.contains("cuCheckpointProcessLock"), "{c:?}");
        assert_eq!(
            gpu(Err("the driver sees no device".into())).verdict,
            Verdict::Fail
        );
    }

    #[test]
    fn huge_pages_are_read_from_the_kernel_settings_and_mounts() {
        let plain = "tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0\n";
        let (fast, s) = huge_pages(
            "always [madvise] never\n",
            "always within_size advise [never] deny force\n",
            plain,
        );
        assert!(
            s.starts_with("transparent madvise, shmem never, /dev/shm huge: no;"),
            "{s}"
        );
        assert!(s.contains("mounted with huge=always drains faster"), "{s}");
        assert!(s.contains("restores a job's memory faster"), "{s}");
        assert!(!fast);
        let huge = "tmpfs /dev/shm tmpfs rw,nosuid,nodev,huge=always 0 0\n";
        let (fast, s) = huge_pages("[always] madvise never", "", huge);
        assert!(fast);
        assert!(
            s.starts_with("transparent always, shmem unknown, /dev/shm huge: yes;"),
            "{s}"
        );
        assert!(s.ends_with("tmpfs images get 2 MiB pages"), "{s}");
    }
}
