//! The socket directory as the command line and the checkpoint's lock use it: a lock name that
//! is a symbolic link creates nothing where it points, a directory that breaks the rule is
//! refused, and `possum status` refuses a socket served by another process than the job.

use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use possum_control::{socket_path, DirError};
use possum_sequence::process::{lock_pid, LockError};

#[path = "../../control/tests/support/socket_dir.rs"]
mod support;
use support::{chmod, private_dir, Sleeper};

fn me() -> i32 {
    std::process::id() as i32
}

fn possum() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_possum"));
    c.env_remove("POSSUM_SOCKET_DIR").env_remove("LD_PRELOAD");
    c
}

fn show(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}stderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn lock_name(dir: &Path, pid: i32) -> PathBuf {
    dir.join(format!("possum-{pid}.lock"))
}

/// [`lock_pid`] once the lock this test let go of is free, tried again while it is busy (up to
/// 10 s): a child another test forks meanwhile holds a copy of its descriptor until its exec.
fn lock_again(dir: &Path, pid: i32) -> nix::fcntl::Flock<std::fs::File> {
    let t = std::time::Instant::now();
    loop {
        match lock_pid(dir, pid) {
            Err(LockError::Busy { .. }) if t.elapsed() < std::time::Duration::from_secs(10) => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            r => return r.unwrap(),
        }
    }
}

#[test]
fn a_lock_name_that_is_a_symbolic_link_creates_and_touches_nothing() {
    let (tmp, dir) = private_dir();
    let outside = tmp.path().join("outside");
    std::fs::create_dir(&outside).unwrap();

    // To a file that does not exist (as /etc/nologin): it is not created.
    let victim = outside.join("nologin");
    std::os::unix::fs::symlink(&victim, lock_name(&dir, me())).unwrap();
    let e = lock_pid(&dir, me()).unwrap_err();
    assert!(
        matches!(&e, LockError::Dir(DirError::FileIo { path, source })
            if path == &lock_name(&dir, me())
                && source.raw_os_error() == Some(nix::libc::ELOOP)),
        "{e:?}"
    );
    assert!(
        victim.symlink_metadata().is_err(),
        "the link's target was made"
    );

    // To a file that exists: neither its content nor its times change.
    std::fs::remove_file(lock_name(&dir, me())).unwrap();
    let kept = outside.join("kept");
    std::fs::write(&kept, b"keep").unwrap();
    let before = std::fs::metadata(&kept).unwrap();
    std::os::unix::fs::symlink(&kept, lock_name(&dir, me())).unwrap();
    assert!(lock_pid(&dir, me()).is_err());
    let after = std::fs::metadata(&kept).unwrap();
    assert_eq!(std::fs::read(&kept).unwrap(), b"keep");
    assert_eq!(
        (before.mtime(), before.mtime_nsec(), before.ctime_nsec()),
        (after.mtime(), after.mtime_nsec(), after.ctime_nsec())
    );
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
}

#[test]
fn a_lock_with_another_link_is_refused() {
    let (tmp, dir) = private_dir();
    let elsewhere = tmp.path().join("elsewhere");
    std::fs::write(&elsewhere, b"").unwrap();
    std::fs::hard_link(&elsewhere, lock_name(&dir, me())).unwrap();
    let e = lock_pid(&dir, me()).unwrap_err();
    assert!(
        matches!(&e, LockError::Dir(DirError::NotPrivate { what, .. }) if what.contains("2 links")),
        "{e:?}"
    );
    assert!(e.to_string().contains("refused"), "{e}");
}

#[test]
fn the_lock_is_made_in_a_private_directory_only() {
    let tmp = tempfile::tempdir().unwrap();
    // Missing: made, private.
    let dir = tmp.path().join("new");
    let lock = lock_pid(&dir, me()).unwrap();
    assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
    let meta = std::fs::symlink_metadata(lock_name(&dir, me())).unwrap();
    assert!(meta.is_file());
    assert_eq!(meta.mode() & 0o777, 0o600);
    // Held: a second checkpoint of the process is refused.
    assert!(matches!(lock_pid(&dir, me()), Err(LockError::Busy { .. })));
    drop(lock);
    // Again, the file being there.
    drop(lock_again(&dir, me()));

    // A symbolic link to it: refused.
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&dir, &link).unwrap();
    let e = lock_pid(&link, me()).unwrap_err();
    assert!(
        matches!(e, LockError::Dir(DirError::Symlink { .. })),
        "{e:?}"
    );

    // This user's, open to others: made private (as the job's server makes it).
    chmod(&dir, 0o755);
    drop(lock_again(&dir, me()));
    assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);

    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: a lock directory of another user needs root to chown it");
        return;
    }
    std::os::unix::fs::chown(&dir, Some(65534), None).unwrap();
    let e = lock_pid(&dir, me()).unwrap_err();
    assert!(
        matches!(e, LockError::Dir(DirError::Owner { owner: 65534, .. })),
        "{e:?}"
    );
}

#[test]
fn possum_status_refuses_a_socket_served_by_another_process() {
    let (_tmp, dir) = private_dir();
    let job = Sleeper::start();
    let pid = job.pid();
    let path = socket_path(&dir, pid);
    let _squatter = UnixListener::bind(&path).unwrap();
    let out = possum()
        .args(["status", &pid.to_string(), "--json", "--socket-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", show(&out));
    let want = format!(
        "the socket at {} is served by process {}, not by {pid}: refused",
        path.display(),
        me()
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&want),
        "{}",
        show(&out)
    );
    assert!(out.stdout.is_empty(), "{}", show(&out));

    // A directory open to others: the error says how to fix it.
    chmod(&dir, 0o755);
    let out = possum()
        .args(["status", &pid.to_string(), "--socket-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("chmod 700 {}", dir.display())),
        "{}",
        show(&out)
    );
}

#[test]
fn a_lock_directory_made_by_root_for_another_users_job_is_that_users() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: a job of another user needs root to start it");
        return;
    }
    let job = Sleeper::start_as(Some(65534));
    let pid = job.pid() as i32;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sockets");
    let lock = lock_pid(&dir, pid).unwrap();
    // The job's, private: the job may serve its socket there.
    let meta = std::fs::symlink_metadata(&dir).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o777), (65534, 0o700));
    assert!(possum_control::secure_dir(&dir, &[65534]).is_ok());
    // The lock is root's, in it.
    let meta = std::fs::symlink_metadata(lock_name(&dir, pid)).unwrap();
    assert_eq!((meta.uid(), meta.is_file()), (0, true));
    drop(lock);
    drop(lock_again(&dir, pid));
}
