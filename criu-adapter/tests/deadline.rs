//! CRIU runs that would not end: a restore from damaged images is killed at its deadline, with
//! the tasks it had restored, and the worker dies with the process that started it.
//!
//! These need root and CRIU, like `roundtrip.rs`: without them a test says `SKIPPED` and passes,
//! unless `POSSUM_REQUIRE_CRIU=1`. They run one at a time.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use possum_criu::{set_child_subreaper, Criu, CriuError, Deadline, DumpOptions, RestoreOptions};

#[path = "support/criu.rs"]
mod criu_support;
#[path = "support/testee.rs"]
#[allow(dead_code)]
mod testee;
use criu_support::{criu_or_skip, say};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Set in the environment of this test binary run again as the process that restores and is
/// killed: the images directory to restore from.
const HELPER_ENV: &str = "POSSUM_CRIU_TEST_RESTORE_HELPER";

/// How long the checks below wait for something that should happen at once.
const SETTLE: Duration = Duration::from_secs(20);

/// Dumps a running `criu-testee` (killing it) into `dir/images`, then cuts its pages image to
/// nothing: CRIU's restore of it never ends (the restored task spins, CRIU waits for it).
/// Returns the images directory and the dumped PID.
fn damaged_images(criu: &Criu, dir: &Path) -> (PathBuf, i32) {
    let args = ["--threads", "2", "--steps", "4000", "--step-ms", "50"];
    let testee::Testee {
        mut child,
        pid,
        ready,
        ..
    } = testee::start(env!("CARGO_BIN_EXE_criu-testee"), dir, "testee", &[], &args);
    until(SETTLE, "the testee to be ready", || ready.exists());
    let images = dir.join("images");
    criu.dump(&DumpOptions::new(pid, &images)).unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "CRIU kills a dumped tree: {status}");
    let pages: Vec<PathBuf> = std::fs::read_dir(&images)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("pages-"))
        })
        .collect();
    assert!(!pages.is_empty(), "no pages image in {}", images.display());
    for p in &pages {
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_len(0)
            .unwrap();
    }
    (images, pid)
}

fn until(timeout: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < end, "waited {timeout:?} for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The fields of `/proc/PID/stat` after the command's name, the state first; `None` when there
/// is no such process.
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, fields) = stat.rsplit_once(')')?;
    Some(fields.split_whitespace().map(String::from).collect())
}

/// The state letter of `pid` (`R`, `S`, `Z`...), `None` when there is no such process.
fn state(pid: i32) -> Option<char> {
    stat_fields(pid)?.first()?.chars().next()
}

fn parent(pid: i32) -> Option<i32> {
    stat_fields(pid)?.get(1)?.parse().ok()
}

/// The children of `pid` (of all its threads).
fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
    {
        let list =
            std::fs::read_to_string(task.unwrap().path().join("children")).unwrap_or_default();
        out.extend(list.split_whitespace().map(|c| c.parse::<i32>().unwrap()));
    }
    out
}

/// The descendants of `pid`, parents first.
fn descendants(pid: i32) -> Vec<i32> {
    let mut out = children(pid);
    let mut i = 0;
    while i < out.len() {
        let more = children(out[i]);
        out.extend(more);
        i += 1;
    }
    out
}

/// Whether `pid` is gone, reaping it first if it is a zombie child of ours.
fn gone(pid: i32) -> bool {
    if parent(pid) == Some(std::process::id() as i32) {
        let _ = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
    }
    state(pid).is_none()
}

/// This process's children that are still alive (zombies count as gone).
fn live_children() -> Vec<i32> {
    children(std::process::id() as i32)
        .into_iter()
        .filter(|&c| state(c).is_some_and(|s| s != 'Z'))
        .collect()
}

#[test]
fn a_restore_from_a_cut_pages_image_is_killed_at_its_deadline_with_what_it_restored() {
    let _serial = serial();
    let Some(criu) = criu_or_skip(
        "a_restore_from_a_cut_pages_image_is_killed_at_its_deadline_with_what_it_restored",
    ) else {
        return;
    };
    // Whatever is orphaned comes to this process, where it can be seen (and reaped).
    set_child_subreaper().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (images, pid) = damaged_images(&criu, tmp.path());
    assert!(live_children().is_empty(), "{:?}", live_children());
    for sibling in [false, true] {
        let opts = RestoreOptions {
            restore_sibling: sibling,
            deadline: Deadline::fixed(Duration::from_secs(5)),
            ..RestoreOptions::new(&images)
        };
        let err = criu.restore(&opts).unwrap_err();
        say(&format!("restore_sibling={sibling}: {err}"));
        match &err {
            CriuError::DeadlineExceeded {
                op,
                deadline,
                images_dir,
                killed,
                ..
            } => {
                assert_eq!(*op, "restore");
                assert_eq!(*deadline, Duration::from_secs(5));
                assert_eq!(images_dir.as_deref(), Some(images.as_path()));
                assert!(*killed >= 1, "the half-restored task was not found: {err}");
            }
            other => panic!("unexpected {other:?}"),
        }
        let text = err.to_string();
        assert!(
            text.starts_with(&format!(
                "criu restore did not finish within 5 s (deadline), images in {}; it and the",
                images.display()
            )),
            "{text}"
        );
        assert!(text.contains("it had restored were killed"), "{text}");
        // Nothing is left: neither the worker (our child) nor the restored task.
        until(SETTLE, "the restored task to go", || gone(pid));
        until(SETTLE, "the criu worker to go", || {
            live_children().is_empty()
        });
    }
}

/// Run as a separate process by the test below, which kills it mid-restore.
#[test]
fn restore_helper() {
    let Some(images) = std::env::var_os(HELPER_ENV) else {
        return;
    };
    let criu = Criu::locate().unwrap();
    let r = criu.restore(&RestoreOptions::new(PathBuf::from(images)));
    panic!("the restore was meant to hang until this process was killed: {r:?}");
}

/// A process that starts a restore and is killed (`SIGKILL`; `SIGINT` to its process group, as
/// a terminal's ^C) leaves nothing behind: neither the criu worker nor the task it was restoring.
#[test]
fn the_criu_worker_dies_with_the_process_that_started_it() {
    let _serial = serial();
    let Some(criu) = criu_or_skip("the_criu_worker_dies_with_the_process_that_started_it") else {
        return;
    };
    set_child_subreaper().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (images, pid) = damaged_images(&criu, tmp.path());
    for signal in [Signal::SIGKILL, Signal::SIGINT] {
        killed_mid_restore(&images, pid, signal);
    }
}

fn killed_mid_restore(images: &Path, pid: i32, signal: Signal) {
    let mut helper = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "restore_helper",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HELPER_ENV, images)
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let helper_pid = helper.id() as i32;
    // Under the helper: the guard, under it the worker, under that the task it restores (with
    // the dumped PID).
    let mut started = Vec::new();
    until(SETTLE, "the helper's restore to be under way", || {
        started = descendants(helper_pid);
        started.contains(&pid)
    });
    assert!(started.len() >= 3, "{started:?}");
    match signal {
        Signal::SIGKILL => kill(Pid::from_raw(helper_pid), signal).unwrap(),
        _ => kill(Pid::from_raw(-helper_pid), signal).unwrap(),
    }
    let status = helper.wait().unwrap();
    say(&format!("helper killed by {signal}: {status}"));
    // Nothing the helper started outlives it (what is orphaned comes here to be reaped).
    for p in started {
        until(
            SETTLE,
            &format!("process {p} to die with the helper"),
            || gone(p),
        );
    }
    assert!(live_children().is_empty(), "{:?}", live_children());
    assert!(matches!(
        waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)),
        Ok(WaitStatus::StillAlive) | Err(nix::errno::Errno::ECHILD)
    ));
}
