//! CRIU loads `libpossum_criu_plugin.so` and dumps and restores a process tree (a parent and its
//! child) with it, and the plugin stays out of the way of processes without NVIDIA mappings.
//!
//! Needs root and CRIU (`scripts/install-criu.sh`). Without either the test prints
//! `SKIPPED: ...` on stderr (past the test harness's capture) and passes; with
//! `POSSUM_REQUIRE_CRIU=1` (as CI sets) it fails instead. CRIU runs as the plain binary here
//! (`criu dump|restore --libdir DIR`): possum-criu's RPC options have no `libdir`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use possum_criu::{set_child_subreaper, wait_for_exit, Criu};

#[path = "../../criu-adapter/tests/support/criu.rs"]
mod criu_support;
use criu_support::{criu_or_skip, say};

/// The plugin cargo built for this test run: `cargo test` builds the cdylib into
/// `<target>/<profile>/deps/` beside the test's executable (only `cargo build` copies it up to
/// `<target>/<profile>/`, where it may be stale), so look there first.
fn plugin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps, deps.parent().unwrap()]
        .iter()
        .map(|d| d.join("libpossum_criu_plugin.so"))
        .find(|p| p.exists())
        .expect("libpossum_criu_plugin.so not built")
}

struct Tree {
    child: Child,
    pid: i32,
    out: PathBuf,
    ready: PathBuf,
}

fn start_tree(dir: &Path, name: &str) -> Tree {
    let out = dir.join(format!("{name}.out"));
    let ready = dir.join(format!("{name}.ready"));
    let child = Command::new(env!("CARGO_BIN_EXE_plugin-testee"))
        .arg(&out)
        .args(["--steps", "40", "--step-ms", "50", "--kib", "1024"])
        .arg("--ready")
        .arg(&ready)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start plugin-testee");
    let pid = i32::try_from(child.id()).unwrap();
    Tree {
        child,
        pid,
        out,
        ready,
    }
}

fn wait_for_file(path: &Path, timeout: Duration) -> String {
    let end = Instant::now() + timeout;
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if !s.is_empty() {
                return s;
            }
        }
        assert!(
            Instant::now() < end,
            "{} did not appear within {timeout:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs criu with `args`; panics with the end of `log` when it fails.
fn criu_run(criu: &Criu, args: &[&std::ffi::OsStr], log: &Path) {
    let status = Command::new(criu.binary())
        .args(args)
        .stdin(Stdio::null())
        .status()
        .expect("run criu");
    if !status.success() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(40).collect::<Vec<_>>();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        panic!("criu {args:?}: {status}\n{}", tail.join("\n"));
    }
}

const TIMEOUT: Duration = Duration::from_secs(60);

#[test]
fn criu_loads_the_plugin_and_round_trips_a_process_tree() {
    let Some(criu) = criu_or_skip("criu_loads_the_plugin_and_round_trips_a_process_tree") else {
        return;
    };
    let t0 = Instant::now();
    // The restored tree is detached from criu; as a subreaper we adopt it and can reap it.
    set_child_subreaper().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // The plugin alone in its directory: CRIU loads every *.so in --libdir.
    let libdir = tmp.path().join("plugins");
    std::fs::create_dir(&libdir).unwrap();
    std::fs::copy(plugin(), libdir.join("libpossum_criu_plugin.so")).unwrap();

    let mut reference = start_tree(tmp.path(), "reference");
    let mut tree = start_tree(tmp.path(), "dumped");
    let child_pid: i32 = wait_for_file(&tree.ready, TIMEOUT).trim().parse().unwrap();

    let images = tmp.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let dump_log = images.join("dump.log");
    let pid = tree.pid.to_string();
    criu_run(
        &criu,
        &[
            "dump".as_ref(),
            "-t".as_ref(),
            pid.as_ref(),
            "-D".as_ref(),
            images.as_os_str(),
            "--libdir".as_ref(),
            libdir.as_os_str(),
            "-o".as_ref(),
            "dump.log".as_ref(),
            "-v4".as_ref(),
        ],
        &dump_log,
    );
    let status = tree.child.wait().unwrap();
    assert!(!status.success(), "CRIU kills a dumped tree: {status}");
    // The killed child was reparented to us (a subreaper): reap it, or its zombie holds the PID
    // the restore needs.
    let child_exit = wait_for_exit(child_pid, Some(TIMEOUT)).unwrap();
    assert!(
        !child_exit.success(),
        "CRIU kills the dumped child: {child_exit}"
    );
    assert!(
        !tree.out.exists(),
        "the tree finished before it was dumped: make it run longer"
    );
    let dump = std::fs::read_to_string(&dump_log).unwrap();
    assert!(
        dump.contains("possum-criu-plugin: init (stage dump"),
        "the plugin's init line is not in the dump log:\n{dump}"
    );
    assert!(dump.contains("possum-criu-plugin: exit (stage dump, ret 0)"));
    assert!(
        dump.contains("Plugin \"possum\" (version 512 hooks 12)"),
        "CRIU did not describe the loaded plugin"
    );
    assert!(!dump.contains("refusing"), "the plugin refused something");

    let restore_log = images.join("restore.log");
    criu_run(
        &criu,
        &[
            "restore".as_ref(),
            "-D".as_ref(),
            images.as_os_str(),
            "--libdir".as_ref(),
            libdir.as_os_str(),
            "-o".as_ref(),
            "restore.log".as_ref(),
            "-v4".as_ref(),
            "--restore-detached".as_ref(),
        ],
        &restore_log,
    );
    let restore = std::fs::read_to_string(&restore_log).unwrap();
    assert!(
        restore.contains("possum-criu-plugin: init (stage restore"),
        "the plugin's init line is not in the restore log:\n{restore}"
    );
    assert!(restore.contains("possum-criu-plugin: exit (stage restore, ret 0)"));
    // The whole tree is back: the child runs under its dumped PID as the parent's child.
    let stat = std::fs::read_to_string(format!("/proc/{child_pid}/stat"))
        .expect("the restored child is not running");
    let ppid: i32 = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(ppid, tree.pid, "the restored child's parent");

    let exit = wait_for_exit(tree.pid, Some(TIMEOUT)).unwrap();
    assert!(exit.success(), "restored tree {exit}");
    let resumed = std::fs::read_to_string(&tree.out).unwrap();
    let status = reference.child.wait().unwrap();
    assert!(status.success(), "reference tree: {status}");
    let expected = std::fs::read_to_string(&reference.out).unwrap();
    assert_eq!(resumed, expected);
    assert!(reference.ready.exists());
    say(&format!(
        "plugin round trip of a 2-process tree (parent {}, child {child_pid}): whole test {:?}; \
         result {}",
        tree.pid,
        t0.elapsed(),
        resumed.trim()
    ));
}
