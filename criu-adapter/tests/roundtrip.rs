//! Real CRIU round trips of `criu-testee` through the swrk RPC interface.
//!
//! These need root and CRIU (`scripts/install-criu.sh`). Without either, a test prints
//! `SKIPPED: ...` on stderr (past the test harness's capture) and passes; with
//! `POSSUM_REQUIRE_CRIU=1` (as CI sets) it fails instead. The tests run one at a time: a restore
//! needs the dumped PID to be free, and the fewer processes start meanwhile the better.

use std::path::Path;
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use possum_criu::{
    set_child_subreaper, wait_for_exit, Criu, CriuError, DumpOptions, RestoreOptions,
};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The CRIU to run test `test` with, and the lock that runs the tests one at a time; `None`
/// when the test is skipped.
fn serial_criu(test: &str) -> Option<(MutexGuard<'static, ()>, Criu)> {
    let serial = serial();
    criu_or_skip(test).map(|criu| (serial, criu))
}

#[path = "support/criu.rs"]
mod criu_support;
use criu_support::{criu_or_skip, say};

#[path = "support/testee.rs"]
mod testee;
use testee::{wait_for_file, Testee};

fn start_testee(dir: &Path, name: &str) -> Testee {
    let args = [
        "--threads",
        "3",
        "--steps",
        "40",
        "--step-ms",
        "50",
        "--kib",
        "2048",
    ];
    testee::start(env!("CARGO_BIN_EXE_criu-testee"), dir, name, &[], &args)
}

const TIMEOUT: Duration = Duration::from_secs(60);

/// An uninterrupted reference run and the testee `name`, both started in `dir`; the testee
/// ready (stepping) when this returns.
fn reference_and_testee(dir: &Path, name: &str) -> (Testee, Testee) {
    let reference = start_testee(dir, "reference");
    let testee = start_testee(dir, name);
    wait_for_file(&testee.ready, TIMEOUT);
    (reference, testee)
}

/// Asserts that the restored process `pid` ends well, the testee's output then the
/// uninterrupted run's.
fn finishes_like_reference(pid: i32, testee: &Testee, reference: &mut Testee) {
    let exit = wait_for_exit(pid, Some(TIMEOUT)).unwrap();
    assert!(exit.success(), "restored testee {exit}");
    let resumed = std::fs::read_to_string(&testee.out).unwrap();
    assert_eq!(resumed, reference_result(reference));
}

/// A test of a CRIU call made ready ahead of its request ([`made_ready_test`]).
struct MadeReadyTest {
    _serial: MutexGuard<'static, ()>,
    criu: Criu,
    tmp: tempfile::TempDir,
    reference: Testee,
    testee: Testee,
}

/// Test `test`'s start: CRIU, the tests serialized (`None`: skipped), this process a subreaper
/// (a worker ended or a tree restored is reaped here), a temporary directory, and in it a
/// reference run and the testee `name`, stepping.
fn made_ready_test(test: &str, name: &str) -> Option<MadeReadyTest> {
    let (_serial, criu) = serial_criu(test)?;
    set_child_subreaper().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (reference, testee) = reference_and_testee(tmp.path(), name);
    Some(MadeReadyTest {
        _serial,
        criu,
        tmp,
        reference,
        testee,
    })
}

/// The uninterrupted run's result: `reference` waited for, ended well, its output.
fn reference_result(reference: &mut Testee) -> String {
    let status = reference.child.wait().unwrap();
    assert!(status.success(), "reference testee: {status}");
    wait_for_file(&reference.out, TIMEOUT)
}

#[test]
fn version_and_check_over_rpc() {
    let Some((_serial, criu)) = serial_criu("version_and_check_over_rpc") else {
        return;
    };
    let v = criu.version().unwrap();
    say(&format!("criu {v} at {}", criu.binary().display()));
    assert!(
        v.major >= 4,
        "CRIU {v} is too old for kernel 6.x; use scripts/install-criu.sh"
    );
    criu.check().unwrap();
}

/// (a) Dump mid-run leaving it running; the original finishes; the restored copy (after the
/// original exited, so its PID is free) finishes with the same result.
#[test]
fn dump_leave_running_then_restore_gives_the_same_result() {
    let Some((_serial, criu)) =
        serial_criu("dump_leave_running_then_restore_gives_the_same_result")
    else {
        return;
    };
    let t0 = Instant::now();
    // The restored tree is detached from criu; as a subreaper we adopt it and can reap it.
    set_child_subreaper().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mut testee = start_testee(tmp.path(), "a");
    wait_for_file(&testee.ready, TIMEOUT);

    let images = tmp.path().join("images");
    let dump = criu
        .dump(&DumpOptions {
            leave_running: true,
            ..DumpOptions::new(testee.pid, &images)
        })
        .unwrap();
    assert!(
        !testee.out.exists(),
        "the testee finished before it was dumped: make it run longer"
    );
    assert!(dump.image_bytes > 3 * 2048 * 1024, "{dump:?}");
    // CRIU's own account: the testee's memory was written, and fits in the images.
    let stats = dump.stats.expect("CRIU's stats-dump");
    assert!(
        stats.memory_bytes > 2048 * 1024 && stats.memory_bytes <= dump.image_bytes,
        "{stats:?}"
    );
    assert!(stats.frozen >= stats.memdump, "{stats:?}");

    let status = testee.child.wait().unwrap();
    assert!(status.success(), "original testee: {status}");
    let original = std::fs::read_to_string(&testee.out).unwrap();
    std::fs::remove_file(&testee.out).unwrap();

    let restored = criu.restore(&RestoreOptions::new(&images)).unwrap();
    assert_eq!(restored.pid, testee.pid, "CRIU restores the dumped PID");
    let stats = restored.stats.expect("CRIU's stats-restore");
    assert!(stats.restore >= stats.forking, "{stats:?}");
    let exit = wait_for_exit(restored.pid, Some(TIMEOUT)).unwrap();
    assert!(exit.success(), "restored testee {exit}");
    let again = std::fs::read_to_string(&testee.out).unwrap();
    assert_eq!(again, original);
    say(&format!(
        "leave-running round trip: dump {:?} ({} MiB), restore {:?}, whole test {:?}; result {}",
        dump.time,
        dump.image_bytes >> 20,
        restored.time,
        t0.elapsed(),
        original.trim()
    ));
}

/// (b) Dump mid-run, killing it; the restored copy (a child of ours through `restore_sibling`)
/// finishes with the result of an uninterrupted run.
#[test]
fn dump_kill_then_restore_matches_an_uninterrupted_run() {
    let Some((_serial, criu)) = serial_criu("dump_kill_then_restore_matches_an_uninterrupted_run")
    else {
        return;
    };
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let (mut reference, mut testee) = reference_and_testee(tmp.path(), "b");

    let images = tmp.path().join("images");
    let dump = criu.dump(&DumpOptions::new(testee.pid, &images)).unwrap();
    let status = testee.child.wait().unwrap();
    assert!(!status.success(), "CRIU kills a dumped tree: {status}");
    assert!(
        !testee.out.exists(),
        "the testee finished before it was dumped"
    );

    let restored = criu
        .restore(&RestoreOptions {
            restore_sibling: true,
            ..RestoreOptions::new(&images)
        })
        .unwrap();
    assert_eq!(restored.pid, testee.pid);
    finishes_like_reference(restored.pid, &testee, &mut reference);
    say(&format!(
        "kill round trip: dump {:?} ({} MiB), restore {:?}, whole test {:?}",
        dump.time,
        dump.image_bytes >> 20,
        restored.time,
        t0.elapsed()
    ));
}

/// (c) Dumping a PID with no process behind it fails before CRIU runs, naming the PID.
#[test]
fn dumping_a_dead_pid_names_the_pid() {
    let _serial = serial();
    // The liveness check comes first, so this needs neither root nor an installed CRIU.
    let criu = Criu::locate().unwrap_or_else(|_| Criu::with_binary("/nonexistent/criu"));
    let mut child = Command::new("true").spawn().unwrap();
    let pid = i32::try_from(child.id()).unwrap();
    child.wait().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let err = criu
        .dump(&DumpOptions::new(pid, tmp.path().join("images")))
        .unwrap_err();
    assert!(
        matches!(err, CriuError::NoSuchProcess { pid: p } if p == pid),
        "{err:?}"
    );
    assert_eq!(err.to_string(), format!("process {pid} does not exist"));
}

/// A failing restore reports CRIU's error and the end of its log.
#[test]
fn restore_from_an_empty_directory_reports_the_log() {
    let Some((_serial, criu)) = serial_criu("restore_from_an_empty_directory_reports_the_log")
    else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let err = criu.restore(&RestoreOptions::new(tmp.path())).unwrap_err();
    say(&format!("restore from an empty directory: {err}"));
    match &err {
        CriuError::Failed {
            op, log, log_tail, ..
        } => {
            assert_eq!(*op, "restore");
            assert_eq!(
                log.as_deref(),
                Some(tmp.path().join("restore.log").as_path())
            );
            assert!(!log_tail.is_empty(), "{err}");
        }
        other => panic!("unexpected {other:?}"),
    }
}

/// The `possum doctor` report of this host; with CRIU installed it must be able to checkpoint.
#[test]
fn host_report_describes_this_host() {
    let Some((_serial, _criu)) = serial_criu("host_report_describes_this_host") else {
        return;
    };
    let report = possum_criu::doctor::host_report();
    say(&format!("host report:\n{report}"));
    assert!(report.can_checkpoint(), "{report}");
}

/// A process's memory in a dump: its PID, its pagemap's runs (address, bytes, flags) and its
/// pages file.
type Pages = (u32, Vec<(u64, u64, u32)>, Vec<u8>);

/// The memory of every process of the dump in `images`.
fn pages_of(images: &Path) -> Vec<Pages> {
    use possum_criu::images::{self, image_path, Pagemap, PstreeEntry, PSTREE_MAGIC};
    let tree: Vec<PstreeEntry> =
        images::read_messages(&images.join("pstree.img"), PSTREE_MAGIC).unwrap();
    tree.iter()
        .map(|t| {
            let pm = Pagemap::read(&image_path(images, "pagemap", t.pid)).unwrap();
            let runs = pm
                .entries
                .iter()
                .map(|e| (e.vaddr, e.len(), e.effective_flags()))
                .collect();
            let pages = std::fs::read(image_path(images, "pages", pm.head.pages_id)).unwrap();
            (t.pid, runs, pages)
        })
        .collect()
}

/// (d) A dump whose pages possum reads (CRIU's lazy dump, completed at its post-dump
/// notification) writes the same images as CRIU's own of the same stopped process, every run
/// present and every page equal but the few CRIU's parasite touches; the tree is left stopped
/// as asked, and restored from those images it finishes with the result of an uninterrupted
/// run.
#[test]
fn a_dump_whose_pages_possum_reads_equals_criu_s_own() {
    dump_equals_criu_s_own(
        "a_dump_whose_pages_possum_reads_equals_criu_s_own",
        possum_criu::PagesBy::Possum,
    );
}

/// A dump whose pages CRIU writes into pipes at the pages files' names, copied into the files
/// by possum's relay, writes the same images as CRIU's own, leaves no pipe nor file of the
/// relay behind, and restores to an uninterrupted run's result.
#[test]
fn a_dump_whose_pages_possum_relays_equals_criu_s_own() {
    dump_equals_criu_s_own(
        "a_dump_whose_pages_possum_relays_equals_criu_s_own",
        possum_criu::PagesBy::Relay,
    );
}

/// A relayed dump whose images' filesystem is too small for the pages fails with the relay's
/// error, naming the pages file; CRIU is not left blocked on its pipe, the process runs on to
/// an uninterrupted run's result, and no pipe is left where the images were.
#[test]
fn a_relayed_dump_on_a_full_filesystem_fails_and_the_process_runs_on() {
    let test = "a_relayed_dump_on_a_full_filesystem_fails_and_the_process_runs_on";
    let Some((_serial, criu)) = serial_criu(test) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let small = tmp.path().join("small");
    std::fs::create_dir(&small).unwrap();
    // 2 MiB: CRIU's other images fit, the testee's 6 MiB of pages do not.
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m", "possum-test-small"])
        .arg(&small)
        .status();
    if !mounted.is_ok_and(|s| s.success()) {
        say(&format!("{test}: SKIPPED (no tmpfs could be mounted here)"));
        return;
    }
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
        }
    }
    let _unmount = Unmount(small.clone());
    let (mut reference, mut testee) = reference_and_testee(tmp.path(), "d");
    let images = small.join("images");
    let failed = criu
        .dump(&DumpOptions {
            leave_running: true,
            pages: possum_criu::PagesBy::Relay,
            ..DumpOptions::new(testee.pid, &images)
        })
        .unwrap_err();
    let text = failed.to_string();
    assert!(
        matches!(failed, possum_criu::CriuError::PagesRelay { .. }),
        "{text}"
    );
    assert!(text.contains("pages-1.img"), "{text}");
    use std::os::unix::fs::FileTypeExt;
    for entry in std::fs::read_dir(&images).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        assert!(!entry.file_type().unwrap().is_fifo(), "{name}: a pipe left");
    }
    let status = testee.child.wait().unwrap();
    assert!(status.success(), "testee: {status}");
    assert_eq!(
        std::fs::read_to_string(&testee.out).unwrap(),
        reference_result(&mut reference)
    );
    say(&format!("{test}: {text}"));
}

fn dump_equals_criu_s_own(test: &str, pages: possum_criu::PagesBy) {
    let Some((_serial, criu)) = serial_criu(test) else {
        return;
    };
    use possum_criu::PagesBy;
    let tmp = tempfile::tempdir().unwrap();
    let (mut reference, mut testee) = reference_and_testee(tmp.path(), "d");
    // Stopped, its memory does not change between the two dumps; killed should the test fail.
    let pid = nix::unistd::Pid::from_raw(testee.pid);
    struct KillOnDrop(nix::unistd::Pid);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGKILL);
        }
    }
    let killed = KillOnDrop(pid);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let by_criu = tmp.path().join("by-criu");
    criu.dump(&DumpOptions {
        leave_running: true,
        ..DumpOptions::new(testee.pid, &by_criu)
    })
    .unwrap();
    let by_possum = tmp.path().join("by-possum");
    let dump = criu
        .dump(&DumpOptions {
            leave_running: true,
            leave_stopped: true,
            pages,
            ..DumpOptions::new(testee.pid, &by_possum)
        })
        .unwrap();
    assert!(dump.stopped);
    let log = std::fs::read_to_string(&dump.log).unwrap();
    match pages {
        PagesBy::Possum => {
            assert!(
                log.contains("Reusing ps socket"),
                "CRIU served on possum's socket pair"
            );
            assert!(
                !log.contains("Accepted connection"),
                "no TCP connection was served"
            );
        }
        PagesBy::Relay => {
            let relayed = dump.pages_relayed.as_ref().expect("the pages were relayed");
            assert_eq!(
                relayed
                    .files
                    .iter()
                    .map(|(f, _)| f.as_str())
                    .collect::<Vec<_>>(),
                ["pages-1.img"],
                "the one process's pages file, through its pipe"
            );
            let len = std::fs::metadata(by_possum.join("pages-1.img"))
                .unwrap()
                .len();
            assert_eq!(relayed.bytes(), len, "the file cut to what was relayed");
        }
        PagesBy::Criu => unreachable!("compared with itself"),
    }
    for entry in std::fs::read_dir(&by_possum).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        assert!(entry.file_type().unwrap().is_file(), "{name}: a plain file");
        assert!(
            !name.starts_with(".relay-"),
            "{name}: the relay's left over"
        );
    }
    // A stopped process still changes a few bytes under each dump (CRIU's parasite runs on
    // each thread, whose stack it touches; two dumps by CRIU differ so too): all pages equal but
    // a few. A read from the wrong place would leave nearly every lazy page different.
    let (a, b) = (pages_of(&by_criu), pages_of(&by_possum));
    assert_eq!(a.len(), b.len());
    let mut bytes = 0;
    for ((pa, ra, da), (pb, rb, db)) in a.iter().zip(&b) {
        assert_eq!(pa, pb);
        assert_eq!(ra, rb, "process {pa}: the same runs, all present");
        assert_eq!(da.len(), db.len());
        let pages = da.len() / 4096;
        let differ: Vec<usize> = (0..pages)
            .filter(|&i| da[i * 4096..(i + 1) * 4096] != db[i * 4096..(i + 1) * 4096])
            .collect();
        assert!(
            differ.len() <= 4,
            "process {pa}: pages {differ:?} of {pages} differ from CRIU's"
        );
        bytes += db.len();
    }
    assert!(bytes > 2048 * 1024, "the testee's 2 MiB are in the pages");
    let mut leftovers: Vec<_> = std::fs::read_dir(&by_possum)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("possum-tmp"))
        .collect();
    leftovers.sort();
    assert_eq!(leftovers, Vec::<String>::new());

    drop(killed);
    let _ = testee.child.wait();
    let restored = criu
        .restore(&RestoreOptions {
            restore_sibling: true,
            ..RestoreOptions::new(&by_possum)
        })
        .unwrap();
    // Dumped stopped twice over: CRIU restores it stopped.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(restored.pid),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();
    finishes_like_reference(restored.pid, &testee, &mut reference);
    say(&format!(
        "{pages:?} dump: {:?}, {} KiB of pages",
        dump.time,
        bytes >> 10
    ));
}

/// This process's children (every thread's), from /proc.
fn my_children() -> Vec<i32> {
    let mut all = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let text = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        all.extend(
            text.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok()),
        );
    }
    all.sort_unstable();
    all
}

/// A dump made ready ahead (its worker started and waiting, the relay's pipes made) and
/// dropped unrun ends its worker and leaves no pipe, the process untouched; one made ready and
/// run later dumps the process as it is then, and that dump restores to an uninterrupted run's
/// result.
#[test]
fn a_dump_made_ready_runs_later_or_is_dropped_leaving_nothing() {
    let test = "a_dump_made_ready_runs_later_or_is_dropped_leaving_nothing";
    let Some(mut t) = made_ready_test(test, "d") else {
        return;
    };
    use possum_criu::PagesBy;
    use std::os::unix::fs::FileTypeExt;
    let opts = |dir: &Path| DumpOptions {
        leave_running: true,
        pages: PagesBy::Relay,
        ..DumpOptions::new(t.testee.pid, dir)
    };
    let fifos = |dir: &Path| -> Vec<String> {
        (std::fs::read_dir(dir).unwrap().flatten())
            .filter(|e| e.file_type().unwrap().is_fifo())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    };

    let dropped = t.tmp.path().join("dropped");
    let ready = t.criu.prepare_dump(opts(&dropped)).unwrap();
    let worker = ready.worker_pid().expect("a worker");
    assert!(my_children().contains(&worker), "its worker waits");
    assert!(fifos(&dropped).contains(&"pages-1.img".to_string()));
    drop(ready);
    assert!(
        !my_children().contains(&worker),
        "its worker ended and was reaped"
    );
    assert!(!Path::new(&format!("/proc/{worker}")).exists());
    assert_eq!(fifos(&dropped), Vec::<String>::new(), "no pipe left");

    let images = t.tmp.path().join("images");
    let ready = t.criu.prepare_dump(opts(&images)).unwrap();
    let worker = ready.worker_pid().expect("a worker");
    // The testee steps on meanwhile: the dump is of it as it is when run.
    std::thread::sleep(Duration::from_millis(150));
    let dump = ready.run().unwrap();
    assert!(dump.pages_relayed.is_some(), "{dump:?}");
    assert_eq!(fifos(&images), Vec::<String>::new());
    assert!(!my_children().contains(&worker), "its worker exited");
    let status = t.testee.child.wait().unwrap();
    assert!(status.success(), "original testee: {status}");
    std::fs::remove_file(&t.testee.out).unwrap();
    let restored = t.criu.restore(&RestoreOptions::new(&images)).unwrap();
    finishes_like_reference(restored.pid, &t.testee, &mut t.reference);
    say(&format!(
        "{test}: dumped in {:?} once made ready",
        dump.time
    ));
}

/// A restore made ready ahead (its worker and the worker's guard started, waiting) and dropped
/// unrun ends both; one run with other inherited descriptors than it was made ready with is
/// refused, restoring nothing; one made ready and run later restores the killed dump to an
/// uninterrupted run's result.
#[test]
fn a_restore_made_ready_runs_later_or_is_dropped_leaving_nothing() {
    let test = "a_restore_made_ready_runs_later_or_is_dropped_leaving_nothing";
    let Some(mut t) = made_ready_test(test, "r") else {
        return;
    };
    let images = t.tmp.path().join("images");
    t.criu
        .dump(&DumpOptions::new(t.testee.pid, &images))
        .unwrap();
    assert!(
        !t.testee.child.wait().unwrap().success(),
        "killed by its dump"
    );
    let opts = RestoreOptions::new(&images);

    let ready = t.criu.prepare_restore(&opts).unwrap();
    let pids = ready.pids();
    assert_eq!(pids.len(), 2, "a guard and its worker: {pids:?}");
    assert!(my_children().contains(&pids[0]), "its guard waits");
    drop(ready);
    for p in &pids {
        assert!(!Path::new(&format!("/proc/{p}")).exists(), "{p} lives on");
    }

    let ready = t.criu.prepare_restore(&opts).unwrap();
    let other = RestoreOptions {
        inherit_fds: vec![("pipe:[1]".into(), 1)],
        ..RestoreOptions::new(&images)
    };
    let e = ready.run(&other).unwrap_err();
    assert!(e.to_string().contains("made ready for other"), "{e}");
    assert!(!Path::new(&format!("/proc/{}", t.testee.pid)).exists());

    let ready = t.criu.prepare_restore(&opts).unwrap();
    std::thread::sleep(Duration::from_millis(150));
    let restored = ready.run(&opts).unwrap();
    assert_eq!(restored.pid, t.testee.pid);
    finishes_like_reference(restored.pid, &t.testee, &mut t.reference);
    say(&format!(
        "{test}: restored in {:?} once made ready",
        restored.time
    ));
}
