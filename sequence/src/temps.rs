//! A checkpoint's temporary image directory (`.NAME.possum-tmp-PID`, beside DIR): who may still
//! use it, and removing those nobody can.
//!
//! possum and its guard each hold a shared lock on a file in it ([`TempLock`]), so it is in use
//! while either lives (the guard may still resume the job from the directory after possum
//! died). A later checkpoint into the same DIR removes each sibling temporary directory whose
//! maker is gone and whose lock nobody holds ([`sweep`]): what is left after possum and its
//! guard were both killed, or the machine went down.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation};

use crate::process;

/// The lock file's name in a temporary directory.
pub(crate) const LOCK_FILE: &str = ".possum-lock";

/// The name of DIR's temporary sibling made by process `pid`.
pub(crate) fn temp_name(dir_name: &str, pid: u32) -> String {
    format!("{}{pid}", prefix(dir_name))
}

fn prefix(dir_name: &str) -> String {
    format!(".{dir_name}.possum-tmp-")
}

/// The shared lock on a temporary directory, held while it lives.
#[derive(Debug)]
pub(crate) struct TempLock {
    /// Holds the lock until dropped.
    _file: File,
}

impl TempLock {
    /// Creates the lock file in `tmp` (not through a symlink) and takes its shared lock.
    pub(crate) fn take(tmp: &Path) -> io::Result<TempLock> {
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(tmp.join(LOCK_FILE))?;
        flock(&f, FlockOperation::LockShared)?;
        Ok(TempLock { _file: f })
    }
}

/// Removes the temporary siblings of `dir` (in `parent`, named `dir_name`) that nobody uses: made
/// by a process that is gone, and whose lock nobody holds (or that has none: its maker died
/// before taking it, so no guard was started). `own` is left alone. Returns what was removed.
pub(crate) fn sweep(parent: &Path, dir_name: &str, own: &Path) -> Vec<PathBuf> {
    let prefix = prefix(dir_name);
    let Ok(entries) = fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(&prefix) else {
            continue;
        };
        let Ok(pid) = pid.parse::<i32>() else {
            continue;
        };
        let path = e.path();
        // A directory itself, never a symlink to one.
        let is_dir = fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
        if !is_dir || path == own || process::alive(pid) || in_use(&path) {
            continue;
        }
        if fs::remove_dir_all(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

/// Whether someone holds the lock of temporary directory `tmp`.
pub(crate) fn in_use(tmp: &Path) -> bool {
    let f = match OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(tmp.join(LOCK_FILE))
    {
        Ok(f) => f,
        Err(e) => return e.kind() != io::ErrorKind::NotFound,
    };
    flock(&f, FlockOperation::NonBlockingLockExclusive).is_err()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A pid no process has, nor will have: above the kernel's `pid_max`, a new one each call.
    /// (A pid a process had a moment ago may be taken again by the time a test looks at it:
    /// the tests' children go through a `pid_max` of 32768 quickly.)
    pub(crate) fn dead_pid() -> i32 {
        static NEXT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(1);
        let pid_max = fs::read_to_string("/proc/sys/kernel/pid_max")
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .unwrap_or(1 << 22);
        pid_max + NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    #[test]
    fn only_temporary_directories_nobody_uses_are_removed() {
        let root = tempfile::tempdir().unwrap();
        let parent = root.path();
        let dead = dead_pid();
        let mk = |name: String| {
            let p = parent.join(name);
            fs::create_dir(&p).unwrap();
            fs::write(p.join("data"), b"x").unwrap();
            p
        };
        // Left by a dead checkpoint with no lock holder: removed.
        let stale = mk(temp_name("img", dead as u32));
        TempLock::take(&stale).unwrap(); // dropped at once: nobody holds it
                                         // Made by a dead process but still locked (its guard lives): kept.
        let guarded = mk(format!("{}{}", prefix("img"), dead_pid()));
        let held = TempLock::take(&guarded).unwrap();
        // Without a lock file, maker dead: removed.
        let unlocked = mk(format!("{}{}", prefix("img"), dead_pid()));
        // A live maker: kept, whatever its lock.
        let live = mk(temp_name("img", std::process::id()));
        // Another image's temporary directory, the image itself, and a symlink: kept.
        let other = mk(temp_name("other", dead as u32));
        let image = mk("img".to_string());
        let target = mk("elsewhere".to_string());
        let link = parent.join(format!("{}{}", prefix("img"), dead_pid()));
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let own = parent.join(temp_name("img", 1));

        let mut want = vec![stale.clone(), unlocked.clone()];
        want.sort();
        assert_eq!(swept(parent, &own, &want), want);
        for kept in [&guarded, &live, &other, &image, &target] {
            assert!(kept.join("data").exists(), "{} kept", kept.display());
        }
        assert!(fs::symlink_metadata(&link).is_ok(), "the symlink is left");
        drop(held);
        assert_eq!(
            swept(parent, &own, std::slice::from_ref(&guarded)),
            vec![guarded]
        );
    }

    /// What [`sweep`] of `img`'s siblings in `parent` removed, sorted, swept again until that is
    /// `want` (sorted) or 10 s passed (a lock let go of may be held a moment longer: see
    /// [`within_10s`]).
    fn swept(parent: &Path, own: &Path, want: &[PathBuf]) -> Vec<PathBuf> {
        let mut removed = Vec::new();
        within_10s(|| {
            removed.extend(sweep(parent, "img", own));
            removed.sort();
            removed == want
        });
        removed
    }

    /// Calls `done` every 10 ms until it says so or 10 s passed: whether it did. A lock let go
    /// of stays held a moment by a child that another test forked meanwhile (its copy of the
    /// descriptor lives until its exec closes it).
    fn within_10s(mut done: impl FnMut() -> bool) -> bool {
        let t = std::time::Instant::now();
        while !done() {
            if t.elapsed() > std::time::Duration::from_secs(10) {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        true
    }

    #[test]
    fn a_directory_is_in_use_while_any_holder_keeps_its_lock() {
        let root = tempfile::tempdir().unwrap();
        let tmp = root.path().join(temp_name("img", 2));
        fs::create_dir(&tmp).unwrap();
        assert!(!in_use(&tmp), "no lock file: nobody");
        let possum = TempLock::take(&tmp).unwrap();
        let guard = TempLock::take(&tmp).unwrap();
        assert!(in_use(&tmp));
        drop(possum);
        assert!(in_use(&tmp), "the guard still holds it");
        drop(guard);
        assert!(let_go(&tmp));
    }

    /// Whether `tmp`'s lock is free, looked at again until it is or 10 s passed (see
    /// [`within_10s`]).
    pub(crate) fn let_go(tmp: &Path) -> bool {
        within_10s(|| !in_use(tmp))
    }
}
