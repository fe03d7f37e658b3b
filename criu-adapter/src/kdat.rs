//! CRIU's cache of what it probed of the running kernel (`/run/criu.kdat`).
//!
//! At every dump and restore CRIU probes the kernel first (its "kerndat": 20-50 ms on the
//! machines measured, most of it making a network namespace and a veth pair to test netlink),
//! unless it finds its cache, `/run/criu.kdat`. It writes that cache only where `/run` is a
//! tmpfs, so that a reboot, maybe into another kernel, clears it. It reads the cache wherever
//! it lies, checking only its size and magic.
//!
//! Where `/run` is not a tmpfs (some VMs and containers), [`prime`] has CRIU probe once, in a
//! mount namespace of its own whose `/run` is a tmpfs, and writes what CRIU cached there to
//! `/run/criu.kdat`, beside a stamp (`/run/criu.kdat.possum`) naming the boot and the CRIU
//! binary it was made with. A cache whose stamp names another boot or another CRIU, or that has
//! no stamp, is removed and made again before CRIU runs: it is never older than the kernel.
//!
//! The only `unsafe` here is the forked child's preparation before it runs the probe (a new
//! mount namespace, `/run` a tmpfs in it): async-signal-safe calls only.

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Where CRIU reads its cache (its build's `KDAT_RUNDIR`, `/run` in Debian's and upstream's).
pub const CACHE: &str = "/run/criu.kdat";

/// The stamp beside a cache possum made: the boot and the CRIU it is valid for.
pub const STAMP: &str = "/run/criu.kdat.possum";

/// The most bytes a cache may have (CRIU's is under 1 KiB).
const MAX_CACHE: usize = 64 << 10;

/// What [`prime`] found or did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Primed {
    /// `/run` is a tmpfs: CRIU keeps its cache itself.
    RunIsTmpfs,
    /// The cache was there, made in this boot with this CRIU.
    Fresh,
    /// It was made now.
    Made,
    /// Not made: `POSSUM_CRIU_KDAT=0`.
    Off,
}

/// Why the cache could not be made (CRIU then probes the kernel at each run, as it would).
#[derive(Debug, thiserror::Error)]
pub enum KdatError {
    /// A file could not be read, written or removed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// The probe could not run, or gave no cache.
    #[error("CRIU's probe of the kernel ({}) {why}", binary.display())]
    Probe {
        /// The CRIU binary.
        binary: PathBuf,
        /// What went wrong.
        why: String,
    },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> KdatError {
    let path = path.to_path_buf();
    move |source| KdatError::Io { what, path, source }
}

/// What the stamp says of a cache made in this boot with `binary`: the boot's id, the binary's
/// path, length and modification time.
fn stamp_for(binary: &Path) -> Result<String, KdatError> {
    let boot_path = Path::new("/proc/sys/kernel/random/boot_id");
    let boot = fs::read_to_string(boot_path).map_err(io_err("reading", boot_path))?;
    let m = fs::metadata(binary).map_err(io_err("reading", binary))?;
    Ok(format!(
        "boot {}\ncriu {}\nsize {} mtime {}.{}\n",
        boot.trim(),
        binary.display(),
        m.len(),
        m.mtime(),
        m.mtime_nsec()
    ))
}

/// Whether `dir` is on a tmpfs.
fn on_tmpfs(dir: &Path) -> bool {
    nix::sys::statfs::statfs(dir)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
}

/// Makes sure CRIU (`binary`) finds its cache of the kernel's features, where `/run` is not a
/// tmpfs (see the module's documentation). Cheap when the cache is there: a few small reads.
pub fn prime(binary: &Path) -> Result<Primed, KdatError> {
    use possum_control::EnvConfig;
    if crate::config::Config::from_env().no_kdat {
        return Ok(Primed::Off);
    }
    prime_at(
        binary,
        Path::new(CACHE),
        Path::new(STAMP),
        on_tmpfs(Path::new("/run")),
    )
}

/// [`prime`] with its files at `cache` and `stamp`; `tmpfs`: whether their directory is one.
fn prime_at(binary: &Path, cache: &Path, stamp: &Path, tmpfs: bool) -> Result<Primed, KdatError> {
    if tmpfs {
        return Ok(Primed::RunIsTmpfs);
    }
    let want = stamp_for(binary)?;
    let stamped = fs::read_to_string(stamp).ok();
    if cache.is_file() && stamped.as_deref() == Some(want.as_str()) {
        return Ok(Primed::Fresh);
    }
    // Another boot's, another CRIU's, or one no stamp vouches for: never read by CRIU again.
    for f in [cache, stamp] {
        match fs::remove_file(f) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("removing", f)(e)),
        }
    }
    let bytes = probe(binary)?;
    let dir = cache.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(".criu.kdat.possum-{}", std::process::id()));
    fs::write(&tmp, &bytes).map_err(io_err("writing", &tmp))?;
    fs::rename(&tmp, cache).map_err(io_err("naming", cache))?;
    fs::write(stamp, want).map_err(io_err("writing", stamp))?;
    Ok(Primed::Made)
}

/// Runs `binary check` in a mount namespace of its own whose `/run` is an empty tmpfs, and
/// returns the cache CRIU left there.
fn probe(binary: &Path) -> Result<Vec<u8>, KdatError> {
    let fail = |why: String| KdatError::Probe {
        binary: binary.to_path_buf(),
        why,
    };
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg("\"$0\" check >/dev/null 2>&1; cat /run/criu.kdat")
        .arg(binary)
        .stdin(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: runs in the forked child before `exec`, and makes only system calls (unshare,
    // mount), which are async-signal-safe; it touches no memory but its own stack.
    unsafe {
        cmd.pre_exec(|| {
            use nix::mount::{mount, MsFlags};
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).map_err(io::Error::from)?;
            // Nothing mounted here reaches the host's namespace.
            mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                None::<&str>,
            )
            .map_err(io::Error::from)?;
            mount(
                Some("possum-kdat"),
                "/run",
                Some("tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                Some("size=1m,mode=0755"),
            )
            .map_err(io::Error::from)
        });
    }
    let out = cmd
        .output()
        .map_err(|e| fail(format!("could not run: {e}")))?;
    if out.stdout.is_empty() || out.stdout.len() > MAX_CACHE {
        return Err(fail(format!(
            "left no cache of its own ({} bytes)",
            out.stdout.len()
        )));
    }
    Ok(out.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An executable shell script `criu` in `dir` with `body`.
    fn script(dir: &Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let bin = dir.join("criu");
        fs::write(&bin, format!("#!/bin/sh\n{body}")).unwrap();
        fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
        bin
    }

    /// A stand-in for CRIU: `check` writes a cache into `/run` of its namespace, as CRIU does
    /// on a tmpfs; it counts its runs in `runs`.
    fn fake_criu(dir: &Path) -> PathBuf {
        let runs = dir.join("runs").display().to_string();
        script(
            dir,
            &format!("echo run >> {runs}\n[ \"$1\" = check ] && printf 'KDAT' > /run/criu.kdat\n"),
        )
    }

    /// The test's files, and whether it can run (a mount namespace needs root).
    fn setup() -> Option<(tempfile::TempDir, PathBuf, PathBuf)> {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: a mount namespace needs root");
            return None;
        }
        let tmp = tempfile::tempdir().unwrap();
        let (cache, stamp) = (
            tmp.path().join("criu.kdat"),
            tmp.path().join("criu.kdat.possum"),
        );
        Some((tmp, cache, stamp))
    }

    fn runs(dir: &Path) -> usize {
        fs::read_to_string(dir.join("runs")).map_or(0, |s| s.lines().count())
    }

    /// The cache is made once (CRIU run once, in a namespace of its own: the host's `/run`
    /// untouched), kept while its stamp holds, and made again when the stamp names another
    /// CRIU; a cache without a stamp is never trusted. Where `/run` is a tmpfs nothing is done.
    #[test]
    fn the_cache_is_made_once_per_boot_and_criu_and_never_trusted_unstamped() {
        let Some((tmp, cache, stamp)) = setup() else {
            return;
        };
        let d = tmp.path();
        let bin = fake_criu(d);
        assert_eq!(
            prime_at(&bin, &cache, &stamp, true).unwrap(),
            Primed::RunIsTmpfs
        );
        assert_eq!(runs(d), 0);
        match prime_at(&bin, &cache, &stamp, false) {
            Err(e) if e.to_string().contains("could not run") => {
                eprintln!("SKIPPED: no mount namespace here ({e})");
                return;
            }
            made => assert_eq!(made.unwrap(), Primed::Made),
        }
        assert_eq!(fs::read(&cache).unwrap(), b"KDAT");
        // (The probe's `/run` was its own: the host's is untouched.)
        assert_ne!(
            fs::read("/run/criu.kdat").ok().as_deref(),
            Some(&b"KDAT"[..])
        );
        assert_eq!(runs(d), 1);
        assert_eq!(
            prime_at(&bin, &cache, &stamp, false).unwrap(),
            Primed::Fresh
        );
        assert_eq!(runs(d), 1, "a fresh cache is not made again");
        // Another CRIU (the binary changed): made again.
        fs::write(d.join("runs"), "run\n").unwrap();
        let mut s = fs::read_to_string(&bin).unwrap();
        s.push_str("# another build\n");
        fs::write(&bin, s).unwrap();
        assert_eq!(prime_at(&bin, &cache, &stamp, false).unwrap(), Primed::Made);
        assert_eq!(runs(d), 2);
        // A cache no stamp vouches for (another boot's would have another stamp): replaced.
        fs::remove_file(&stamp).unwrap();
        fs::write(&cache, b"STALE").unwrap();
        assert_eq!(prime_at(&bin, &cache, &stamp, false).unwrap(), Primed::Made);
        assert_eq!(fs::read(&cache).unwrap(), b"KDAT");
    }

    /// A CRIU that leaves no cache: the error says so, and nothing is left behind.
    #[test]
    fn a_probe_that_leaves_no_cache_is_an_error_and_leaves_nothing() {
        let Some((tmp, cache, stamp)) = setup() else {
            return;
        };
        let bin = script(tmp.path(), "exit 1\n");
        let e = prime_at(&bin, &cache, &stamp, false)
            .unwrap_err()
            .to_string();
        if e.contains("could not run") {
            eprintln!("SKIPPED: no mount namespace here ({e})");
            return;
        }
        assert!(e.contains("left no cache"), "{e}");
        assert!(!cache.exists() && !stamp.exists());
    }
}
