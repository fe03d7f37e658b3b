//! Host features that CPU-side checkpoint/restore depends on, for `possum doctor`.
//!
//! Each check says what it found and how it knows: the kernel's config file when one is readable
//! (`/boot/config-<release>`), otherwise a probe of the running kernel. GPU checks live elsewhere.

use std::fmt;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::{Criu, CriuVersion};

/// Whether a feature is there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// Present and usable.
    Yes,
    /// Absent.
    No,
    /// Could not be told (not checked, or the check itself failed).
    Unknown,
}

/// One check's result and the evidence for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Feature {
    /// The verdict.
    pub support: Support,
    /// How it was decided, or why it could not be.
    pub detail: String,
}

impl Feature {
    fn new(support: Support, detail: impl Into<String>) -> Self {
        Self {
            support,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = match self.support {
            Support::Yes => "yes",
            Support::No => "NO",
            Support::Unknown => "unknown",
        };
        write!(f, "{verdict}: {}", self.detail)
    }
}

/// What the host offers to CRIU.
#[derive(Debug, Clone)]
pub struct HostReport {
    /// The running kernel's release (`uname -r`).
    pub kernel: String,
    /// The CRIU binary found, or why none was.
    pub criu_binary: Result<PathBuf, String>,
    /// CRIU's version, or why it could not be asked.
    pub criu_version: Result<CriuVersion, String>,
    /// The result of `criu check`.
    pub criu_check: Feature,
    /// Whether this CRIU can dump TCP sockets on this kernel ([`tcp_sockets`]).
    pub tcp_sockets: Feature,
    /// Whether CRIU finds its probe of the kernel cached ([`crate::kdat`]), made if need be.
    pub kdat_cache: Feature,
    /// CONFIG_CHECKPOINT_RESTORE, which CRIU cannot do without.
    pub checkpoint_restore: Feature,
    /// userfaultfd (CONFIG_USERFAULTFD): lazy restore of memory.
    pub userfaultfd: Feature,
    /// Soft-dirty page tracking (CONFIG_MEM_SOFT_DIRTY): incremental dumps (`--track-mem`).
    pub soft_dirty: Feature,
}

impl HostReport {
    /// True when CRIU can dump and restore here: it was found, answers, passes `criu check`,
    /// and the kernel has CONFIG_CHECKPOINT_RESTORE.
    pub fn can_checkpoint(&self) -> bool {
        self.criu_version.is_ok()
            && self.criu_check.support == Support::Yes
            && self.checkpoint_restore.support != Support::No
    }
}

impl fmt::Display for HostReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:<20} {}", "kernel", self.kernel)?;
        match (&self.criu_binary, &self.criu_version) {
            (Ok(bin), Ok(v)) => writeln!(f, "{:<20} {v} ({})", "criu", bin.display())?,
            (Ok(bin), Err(e)) => {
                writeln!(f, "{:<20} {} does not answer: {e}", "criu", bin.display())?
            }
            (Err(e), _) => writeln!(f, "{:<20} NOT FOUND: {e}", "criu")?,
        }
        writeln!(f, "{:<20} {}", "criu check", self.criu_check)?;
        writeln!(f, "{:<20} {}", "tcp sockets", self.tcp_sockets)?;
        writeln!(f, "{:<20} {}", "kernel probe cache", self.kdat_cache)?;
        writeln!(
            f,
            "{:<20} {}",
            "checkpoint/restore", self.checkpoint_restore
        )?;
        writeln!(f, "{:<20} {}", "userfaultfd", self.userfaultfd)?;
        write!(f, "{:<20} {}", "soft-dirty", self.soft_dirty)
    }
}

/// Runs every check, with the CRIU that [`Criu::locate`] finds.
pub fn host_report() -> HostReport {
    let criu = Criu::locate();
    let criu_binary = criu
        .as_ref()
        .map(|c| c.binary().to_owned())
        .map_err(|e| e.to_string());
    let criu_version = match &criu {
        Ok(c) => c.version().map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let criu_check = match &criu {
        Err(_) => Feature::new(Support::Unknown, "no criu to run"),
        Ok(_) if !nix::unistd::geteuid().is_root() => {
            Feature::new(Support::Unknown, "not run: criu check needs root")
        }
        Ok(c) => match c.check() {
            Ok(()) => Feature::new(Support::Yes, "criu check passed"),
            Err(e) => Feature::new(Support::No, e.to_string()),
        },
    };
    let tcp_sockets = tcp_sockets(criu_version.as_ref().ok(), kernel_version());
    let kdat_cache = match &criu {
        Err(_) => Feature::new(Support::Unknown, "no criu to run"),
        Ok(_) if !nix::unistd::geteuid().is_root() => {
            Feature::new(Support::Unknown, "not made: it needs root")
        }
        Ok(c) => kdat_cache(c.prime_kdat()),
    };
    HostReport {
        kernel: kernel_release(),
        criu_binary,
        criu_version,
        criu_check,
        tcp_sockets,
        kdat_cache,
        checkpoint_restore: checkpoint_restore(),
        userfaultfd: userfaultfd(),
        soft_dirty: soft_dirty(),
    }
}

/// What [`crate::kdat::prime`] found or did, as a check.
pub fn kdat_cache(primed: Result<crate::kdat::Primed, crate::kdat::KdatError>) -> Feature {
    use crate::kdat::{Primed, CACHE};
    match primed {
        Ok(Primed::RunIsTmpfs) => Feature::new(Support::Yes, "/run is a tmpfs: CRIU keeps it"),
        Ok(Primed::Fresh) => Feature::new(Support::Yes, format!("{CACHE}, made in this boot")),
        Ok(Primed::Made) => Feature::new(Support::Yes, format!("{CACHE}, made now")),
        Ok(Primed::Off) => Feature::new(
            Support::Unknown,
            "not made (POSSUM_CRIU_KDAT=0): unless /run is a tmpfs, CRIU probes the kernel at \
             every dump and restore",
        ),
        Err(e) => Feature::new(
            Support::No,
            format!("{e}: CRIU probes the kernel at every dump and restore (20-50 ms each)"),
        ),
    }
}

/// The first kernel on which CRIU needs [`TCP_CRIU`] to dump a TCP socket: Linux 6.16 no longer
/// answers `getsockopt(SO_PASSCRED)` on one, which CRIU 4.1 and older ask for every socket
/// ("Can't get 1:16 opt"), so they refuse every job with a listening or connected TCP socket.
pub const TCP_KERNEL: (u32, u32) = (6, 16);
/// The first CRIU that dumps TCP sockets on [`TCP_KERNEL`] and later.
pub const TCP_CRIU: (i32, i32) = (4, 2);

/// Whether CRIU `criu` (None: none found) can dump TCP sockets on kernel `kernel` (major,
/// minor; None: unknown). Decided by the versions: the failure is certain, and a probe would
/// need a dump.
pub fn tcp_sockets(criu: Option<&CriuVersion>, kernel: Option<(u32, u32)>) -> Feature {
    let Some(v) = criu else {
        return Feature::new(Support::Unknown, "no criu to ask");
    };
    let new_criu = (v.major, v.minor) >= TCP_CRIU;
    match kernel {
        _ if new_criu => Feature::new(
            Support::Yes,
            format!("CRIU {v} dumps TCP sockets on any kernel"),
        ),
        Some(k) if k < TCP_KERNEL => Feature::new(
            Support::Yes,
            format!(
                "CRIU {v} dumps TCP sockets on Linux {}.{} (not on {}.{} or later, which need \
                 CRIU {}.{})",
                k.0, k.1, TCP_KERNEL.0, TCP_KERNEL.1, TCP_CRIU.0, TCP_CRIU.1
            ),
        ),
        Some(k) => Feature::new(
            Support::No,
            format!(
                "CRIU {v} cannot dump TCP sockets on Linux {}.{} (a job with a listening or \
                 connected TCP socket is refused: servers, torchrun): install CRIU {}.{} or \
                 later with scripts/install-criu.sh, or point POSSUM_CRIU at one",
                k.0, k.1, TCP_CRIU.0, TCP_CRIU.1
            ),
        ),
        None => Feature::new(
            Support::Unknown,
            format!(
                "CRIU {v} cannot dump TCP sockets on Linux {}.{} or later, and the kernel's \
                 version is unknown",
                TCP_KERNEL.0, TCP_KERNEL.1
            ),
        ),
    }
}

/// The running kernel's release, e.g. `6.18.44`.
pub fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

/// CONFIG_CHECKPOINT_RESTORE: from the kernel config, else from the `kernel.ns_last_pid` sysctl,
/// which only such kernels have.
pub fn checkpoint_restore() -> Feature {
    if let Some(f) = from_config("CONFIG_CHECKPOINT_RESTORE") {
        return f;
    }
    if Path::new("/proc/sys/kernel/ns_last_pid").exists() {
        Feature::new(Support::Yes, "/proc/sys/kernel/ns_last_pid exists")
    } else {
        Feature::new(
            Support::No,
            "no /proc/sys/kernel/ns_last_pid: the kernel lacks CONFIG_CHECKPOINT_RESTORE",
        )
    }
}

/// userfaultfd: from the kernel config, else from the `vm.unprivileged_userfaultfd` sysctl
/// (kernels since 5.2 have it exactly when CONFIG_USERFAULTFD is set) or `/dev/userfaultfd`.
pub fn userfaultfd() -> Feature {
    if let Some(f) = from_config("CONFIG_USERFAULTFD") {
        return f;
    }
    let sysctl = Path::new("/proc/sys/vm/unprivileged_userfaultfd");
    if let Ok(v) = std::fs::read_to_string(sysctl) {
        return Feature::new(Support::Yes, format!("{} = {}", sysctl.display(), v.trim()));
    }
    if Path::new("/dev/userfaultfd").exists() {
        return Feature::new(Support::Yes, "/dev/userfaultfd exists");
    }
    match kernel_version() {
        Some(v) if v >= (5, 2) => Feature::new(
            Support::No,
            "no vm.unprivileged_userfaultfd sysctl: the kernel lacks CONFIG_USERFAULTFD",
        ),
        _ => Feature::new(
            Support::Unknown,
            "no vm.unprivileged_userfaultfd sysctl, but this kernel may predate it",
        ),
    }
}

/// Soft-dirty tracking: from the kernel config, else by experiment: clear the soft-dirty bits
/// (`echo 4 > /proc/self/clear_refs`), write to a page, and read its pagemap entry; bit 55 is
/// set after the write only if the kernel tracks soft-dirty pages. (Clears this process's
/// soft-dirty bits, which nothing else in possum's own process uses.)
pub fn soft_dirty() -> Feature {
    if let Some(f) = from_config("CONFIG_MEM_SOFT_DIRTY") {
        return f;
    }
    match probe_soft_dirty() {
        Ok(true) => Feature::new(
            Support::Yes,
            "a page written after clear_refs=4 has the soft-dirty bit (55) in /proc/self/pagemap",
        ),
        Ok(false) => Feature::new(
            Support::No,
            "a page written after clear_refs=4 has no soft-dirty bit (55) in /proc/self/pagemap: \
             CRIU cannot track dirty memory (no incremental pre-dump/--track-mem)",
        ),
        Err(e) => Feature::new(Support::Unknown, format!("probe failed: {e}")),
    }
}

const PAGEMAP_SOFT_DIRTY: u64 = 1 << 55;
const PAGEMAP_PRESENT: u64 = 1 << 63;

fn probe_soft_dirty() -> Result<bool, String> {
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|p| usize::try_from(p).ok())
        .ok_or("cannot read the page size")?;
    let mut buf = vec![0u8; 3 * page];
    let base = buf.as_ptr() as usize;
    let offset = base.next_multiple_of(page) - base;
    let addr = base + offset;
    buf[offset] = 1; // Fault the page in before clearing.
    std::hint::black_box(&buf);

    OpenOptions::new()
        .write(true)
        .open("/proc/self/clear_refs")
        .and_then(|mut f| f.write_all(b"4"))
        .map_err(|e| format!("writing 4 to /proc/self/clear_refs: {e}"))?;
    buf[offset] = 2;
    std::hint::black_box(&buf);

    let pagemap = std::fs::File::open("/proc/self/pagemap")
        .map_err(|e| format!("/proc/self/pagemap: {e}"))?;
    let mut entry = [0u8; 8];
    let at = u64::try_from(addr / page * 8).map_err(|e| e.to_string())?;
    pagemap
        .read_exact_at(&mut entry, at)
        .map_err(|e| format!("reading /proc/self/pagemap: {e}"))?;
    let entry = u64::from_ne_bytes(entry);
    std::hint::black_box(&buf);
    if entry & PAGEMAP_PRESENT == 0 {
        return Err("the probe page is not present in /proc/self/pagemap".into());
    }
    Ok(entry & PAGEMAP_SOFT_DIRTY != 0)
}

/// `(major, minor)` of the running kernel.
pub fn kernel_version() -> Option<(u32, u32)> {
    let release = kernel_release();
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// The setting of `option` in `/boot/config-<release>`, when that file is readable.
fn from_config(option: &str) -> Option<Feature> {
    let path = PathBuf::from(format!("/boot/config-{}", kernel_release()));
    let config = std::fs::read_to_string(&path).ok()?;
    Some(config_feature(&config, option, &path))
}

fn config_feature(config: &str, option: &str, path: &Path) -> Feature {
    let set = config.lines().find_map(|line| {
        line.strip_prefix(option)
            .and_then(|rest| rest.strip_prefix('='))
            .map(str::to_owned)
    });
    match set.as_deref() {
        Some("y") | Some("m") => Feature::new(
            Support::Yes,
            format!("{option}={} in {}", set.unwrap_or_default(), path.display()),
        ),
        _ => Feature::new(
            Support::No,
            format!("{option} is not set in {}", path.display()),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_lines_are_read_exactly() {
        let cfg = "CONFIG_USERFAULTFD=y\n# CONFIG_MEM_SOFT_DIRTY is not set\nCONFIG_CHECKPOINT_RESTORE_X=y\n";
        let p = Path::new("/boot/config-x");
        assert_eq!(
            config_feature(cfg, "CONFIG_USERFAULTFD", p).support,
            Support::Yes
        );
        assert_eq!(
            config_feature(cfg, "CONFIG_MEM_SOFT_DIRTY", p).support,
            Support::No
        );
        assert_eq!(
            config_feature(cfg, "CONFIG_CHECKPOINT_RESTORE", p).support,
            Support::No
        );
    }

    #[test]
    fn probes_give_an_answer() {
        // The verdicts depend on the host; each probe must at least explain itself.
        for f in [checkpoint_restore(), userfaultfd(), soft_dirty()] {
            assert!(!f.detail.is_empty());
        }
        assert!(kernel_version().is_some(), "{}", kernel_release());
    }

    #[test]
    fn report_displays_every_line() {
        let report = HostReport {
            kernel: "6.18.0".into(),
            criu_binary: Ok("/opt/possum-criu/bin/criu".into()),
            criu_version: Ok(version(4, 1)),
            criu_check: Feature::new(Support::Yes, "criu check passed"),
            tcp_sockets: Feature::new(Support::No, "w"),
            kdat_cache: kdat_cache(Ok(crate::kdat::Primed::Made)),
            checkpoint_restore: Feature::new(Support::Yes, "x"),
            userfaultfd: Feature::new(Support::Yes, "y"),
            soft_dirty: Feature::new(Support::No, "z"),
        };
        let s = report.to_string();
        assert!(
            s.contains("criu                 4.1.1 (/opt/possum-criu/bin/criu)"),
            "{s}"
        );
        assert!(s.contains("soft-dirty           NO: z"), "{s}");
        assert!(s.contains("tcp sockets          NO: w"), "{s}");
        assert!(
            s.contains("kernel probe cache   yes: /run/criu.kdat, made now"),
            "{s}"
        );
        assert!(report.can_checkpoint());
    }

    fn version(major: i32, minor: i32) -> CriuVersion {
        CriuVersion::plain(major, minor, 1)
    }

    #[test]
    fn tcp_sockets_need_criu_4_2_from_linux_6_16() {
        let old = version(4, 1);
        let new = version(4, 2);
        let no = tcp_sockets(Some(&old), Some((6, 18)));
        assert_eq!(no.support, Support::No, "{no}");
        assert!(no.detail.contains("install CRIU 4.2"), "{no}");
        assert!(no.detail.contains("scripts/install-criu.sh"), "{no}");
        assert_eq!(tcp_sockets(Some(&old), Some((6, 16))).support, Support::No);
        assert_eq!(tcp_sockets(Some(&old), Some((6, 15))).support, Support::Yes);
        assert_eq!(tcp_sockets(Some(&old), Some((5, 19))).support, Support::Yes);
        assert_eq!(tcp_sockets(Some(&new), Some((6, 18))).support, Support::Yes);
        assert_eq!(
            tcp_sockets(Some(&version(5, 0)), Some((7, 1))).support,
            Support::Yes
        );
        assert_eq!(tcp_sockets(Some(&old), None).support, Support::Unknown);
        assert_eq!(tcp_sockets(None, Some((6, 18))).support, Support::Unknown);
    }
}
