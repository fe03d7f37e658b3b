//! possum's temporary directories (the demos' images and files): all under one place of the
//! user's, `$TMPDIR/possum-scratch-UID/` (mode 0700, checked like a socket directory: a real
//! directory of the user's, nobody else's access), each named after the process that made it
//! (`PID-START-N`, START the process's start time, so that a PID used again is not taken for
//! it). A [`Scratch`] is removed when dropped; one whose process is gone (killed, even by
//! SIGKILL) is removed by the next possum that makes one: nothing accumulates.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result};

/// A temporary directory of this process, removed (with what is in it) when dropped.
#[derive(Debug)]
pub struct Scratch {
    path: PathBuf,
}

impl Scratch {
    /// A new directory under [`base`], after the stale ones there are removed.
    pub fn new() -> Result<Scratch> {
        let base = base();
        let uid = nix::unistd::geteuid().as_raw();
        possum_control::prepare_dir(&base, &[uid])
            .with_context(|| format!("possum's scratch directory {}", base.display()))?;
        sweep(&base);
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let me = std::process::id();
        let start = start_time(me).context("reading this process's start time")?;
        let path = base.join(format!(
            "{me}-{start}-{}",
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Scratch { path })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// `$TMPDIR/possum-scratch-UID`.
pub fn base() -> PathBuf {
    let uid = nix::unistd::geteuid().as_raw();
    std::env::temp_dir().join(format!("possum-scratch-{uid}"))
}

/// Process `pid`'s start time (clock ticks after boot, `/proc/PID/stat`'s 22nd field), `None`
/// when there is no such process.
fn start_time(pid: u32) -> Option<u64> {
    let stat = possum_control::proc_text(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything: count from after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the directory name `name` (`PID-START-N`) is of a process that is gone; `false` for
/// a name of another form (left alone).
fn is_stale(name: &str) -> bool {
    let mut parts = name.splitn(3, '-');
    let (Some(pid), Some(start), Some(_)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
        return false;
    };
    start_time(pid) != Some(start)
}

/// Removes the directories under `base` whose process is gone.
fn sweep(base: &Path) {
    let Ok(entries) = fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && is_stale(&e.file_name().to_string_lossy()) {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_of_gone_processes_are_stale_and_swept() {
        let me = std::process::id();
        let start = start_time(me).unwrap();
        assert!(!is_stale(&format!("{me}-{start}-0")));
        // The same PID started at another time: another process.
        assert!(is_stale(&format!("{me}-{}-0", start + 1)));
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        let gone = dead.id();
        dead.wait().unwrap();
        assert!(is_stale(&format!("{gone}-1-0")));
        assert!(!is_stale("not-ours"));
        assert!(!is_stale("12"));

        let tmp = tempfile::tempdir().unwrap();
        let live = tmp.path().join(format!("{me}-{start}-0"));
        let stale = tmp.path().join(format!("{gone}-1-3"));
        let other = tmp.path().join("other");
        for d in [&live, &stale, &other] {
            fs::create_dir(d).unwrap();
            fs::write(d.join("f"), b"x").unwrap();
        }
        sweep(tmp.path());
        assert!(live.is_dir() && other.is_dir());
        assert!(!stale.exists());
    }
}
