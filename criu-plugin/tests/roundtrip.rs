//! CRIU loads `libpossum_criu_plugin.so` and dumps and restores a process tree (a parent and its
//! child) with it, and the plugin stays out of the way of processes without NVIDIA mappings.
//!
//! Needs root and CRIU (`scripts/install-criu.sh`). Without either the test prints
//! `SKIPPED: ...` on stderr (past the test harness's capture) and passes; with
//! `POSSUM_REQUIRE_CRIU=1` (as CI sets) it fails instead. CRIU runs as the plain binary here
//! (`criu dump|restore --libdir DIR`), as a container engine would run it.
//!
//! A CPU machine has no NVIDIA device, so the second test has the plugin treat another character
//! device that CRIU cannot dump itself like an NVIDIA one (`POSSUM_CRIU_PLUGIN_TEST_DEVICE`): a
//! descriptor of it held by the child is claimed and restored as a placeholder memfd. No such
//! device can be mapped on these machines, so the mapping half (`HANDLE_DEVICE_VMA`,
//! `UPDATE_VMA_MAP`) is covered by the unit tests and the GPU trials (`scripts/gpu-tree.sh`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
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

#[path = "../../criu-adapter/tests/support/testee.rs"]
mod testee;
use testee::{wait_for_file, Testee as Tree};

fn start_tree(dir: &Path, name: &str, hold: Option<&Path>) -> Tree {
    start_tree_kib(dir, name, hold, 1024)
}

fn start_tree_kib(dir: &Path, name: &str, hold: Option<&Path>, kib: usize) -> Tree {
    let hold: Vec<&std::ffi::OsStr> = match hold {
        Some(dev) => vec!["--hold".as_ref(), dev.as_os_str()],
        None => Vec::new(),
    };
    let kib = kib.to_string();
    let args = ["--steps", "40", "--step-ms", "50", "--kib", &kib];
    testee::start(env!("CARGO_BIN_EXE_plugin-testee"), dir, name, &hold, &args)
}

/// Runs criu with `args` (and the environment `env`); whether it succeeded.
fn criu_try(criu: &Criu, args: &[&std::ffi::OsStr], env: &[(&str, &Path)]) -> bool {
    let mut cmd = Command::new(criu.binary());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.args(args)
        .stdin(Stdio::null())
        .status()
        .expect("run criu")
        .success()
}

/// Runs criu with `args`; panics with the end of `log` when it fails.
fn criu_run(criu: &Criu, args: &[&std::ffi::OsStr], log: &Path) {
    criu_run_env(criu, args, &[], log);
}

/// Runs criu with `args` and the environment `env`; panics with the end of `log` when it fails.
fn criu_run_env(criu: &Criu, args: &[&std::ffi::OsStr], env: &[(&str, &Path)], log: &Path) {
    if !criu_try(criu, args, env) {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(40).collect::<Vec<_>>();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        panic!("criu {args:?} failed\n{}", tail.join("\n"));
    }
}

/// `criu dump -t PID -D IMAGES --libdir LIBDIR`, its log `dump.log` at level 4.
fn dump_args(pid: i32, images: &Path, libdir: &Path) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> =
        vec!["dump".into(), "-t".into(), pid.to_string().into()];
    args.extend(["-D".into(), images.into(), "--libdir".into(), libdir.into()]);
    args.extend(["-o", "dump.log", "-v4"].map(Into::into));
    args
}

/// `args` borrowed, as [`criu_run`] and [`criu_try`] take them.
fn os_strs(args: &[std::ffi::OsString]) -> Vec<&std::ffi::OsStr> {
    args.iter().map(|s| s.as_os_str()).collect()
}

/// A directory under `dir` holding this build's plugin alone (CRIU loads every `*.so` there).
fn plugin_libdir(dir: &Path) -> PathBuf {
    let libdir = dir.join("plugins");
    std::fs::create_dir(&libdir).unwrap();
    std::fs::copy(plugin(), libdir.join("libpossum_criu_plugin.so")).unwrap();
    libdir
}

/// `criu restore` (detached) of `images` with the plugins of `libdir`; returns its log.
fn restore_with_plugin(criu: &Criu, images: &Path, libdir: &Path) -> String {
    let log = images.join("restore.log");
    criu_run(
        criu,
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
        &log,
    );
    std::fs::read_to_string(&log).unwrap()
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
    let libdir = plugin_libdir(tmp.path());

    let mut reference = start_tree(tmp.path(), "reference", None);
    let mut tree = start_tree(tmp.path(), "dumped", None);
    let child_pid: i32 = wait_for_file(&tree.ready, TIMEOUT).trim().parse().unwrap();

    let images = tmp.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let dump_log = images.join("dump.log");
    let args = dump_args(tree.pid, &images, &libdir);
    criu_run(&criu, &os_strs(&args), &dump_log);
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
    assert!(dump.contains(
        "possum-criu-plugin: exit (stage dump, ret 0, claimed 0 mappings and 0 open files)"
    ));
    assert!(
        dump.contains("Plugin \"possum\" (version 512 hooks 12)"),
        "CRIU did not describe the loaded plugin"
    );
    assert!(!dump.contains("refusing"), "the plugin refused something");

    let restore = restore_with_plugin(&criu, &images, &libdir);
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

/// A character device of the misc major (10) that CRIU has no driver for (it knows only tun and
/// autofs there), so that a descriptor of it goes to the plugins (`dump_unsupp_fd`), and that
/// opens read-only here without side effects worth the name.
fn stand_in_device() -> Option<PathBuf> {
    use std::os::unix::fs::FileTypeExt as _;
    ["/dev/hwrng", "/dev/btrfs-control", "/dev/cpu_dma_latency"]
        .iter()
        .map(PathBuf::from)
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.file_type().is_char_device())
                && std::fs::File::open(p).is_ok()
        })
}

/// The targets of `pid`'s descriptors.
fn fd_links(pid: i32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .map(|l| l.display().to_string())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn the_plugin_claims_a_device_descriptor_and_restores_a_placeholder() {
    let test = "the_plugin_claims_a_device_descriptor_and_restores_a_placeholder";
    let Some(criu) = criu_or_skip(test) else {
        return;
    };
    let Some(dev) = stand_in_device() else {
        say(&format!(
            "{test}: SKIPPED: no stand-in character device here"
        ));
        return;
    };
    set_child_subreaper().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let libdir = plugin_libdir(tmp.path());

    let mut reference = start_tree(tmp.path(), "reference", Some(&dev));
    let mut tree = start_tree(tmp.path(), "dumped", Some(&dev));
    let child_pid: i32 = wait_for_file(&tree.ready, TIMEOUT).trim().parse().unwrap();
    let dev_s = dev.display().to_string();
    assert!(
        fd_links(child_pid).contains(&dev_s),
        "the child holds {dev_s}"
    );
    let dump_args = |images: &Path| dump_args(tree.pid, images, &libdir);

    // Without the stand-in, the plugin says "not mine" and CRIU cannot dump the descriptor: the
    // dump fails and the tree runs on.
    let refused = tmp.path().join("refused");
    std::fs::create_dir(&refused).unwrap();
    let args = dump_args(&refused);
    let args = os_strs(&args);
    assert!(
        !criu_try(&criu, &args, &[]),
        "CRIU dumped {dev_s} without the plugin claiming it"
    );
    let log = std::fs::read_to_string(refused.join("dump.log")).unwrap();
    assert!(log.contains("Can't dump file"), "{log}");
    assert!(tree.child.try_wait().unwrap().is_none(), "the tree died");

    let images = tmp.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let args = dump_args(&images);
    let args = os_strs(&args);
    criu_run_env(
        &criu,
        &args,
        &[("POSSUM_CRIU_PLUGIN_TEST_DEVICE", dev.as_path())],
        &images.join("dump.log"),
    );
    tree.child.wait().unwrap();
    wait_for_exit(child_pid, Some(TIMEOUT)).unwrap();
    assert!(!tree.out.exists(), "the tree finished before it was dumped");
    let dump = std::fs::read_to_string(images.join("dump.log")).unwrap();
    let claimed = format!("possum-criu-plugin: pid {child_pid}: claimed open file {dev_s}");
    assert!(
        dump.contains(&claimed),
        "no '{claimed}' in the dump log:\n{dump}"
    );
    assert!(
        dump.contains("claimed 0 mappings and 1 open files"),
        "{dump}"
    );
    let records = std::fs::read_to_string(images.join("possum-criu-plugin.txt")).unwrap();
    assert!(records.contains(&format!(" {dev_s}\n")), "{records}");

    // The restore needs no environment: the plugin's records say which file is its own.
    let restore = restore_with_plugin(&criu, &images, &libdir);
    assert!(
        restore.contains(&format!("open file {dev_s}")) && restore.contains("placeholder memfd"),
        "{restore}"
    );
    let links = fd_links(child_pid);
    let placeholder = format!("/memfd:possum-placeholder:{dev_s} (deleted)");
    assert!(
        links.contains(&placeholder),
        "the restored child's descriptors: {links:?}"
    );
    assert!(!links.contains(&dev_s), "{links:?}");

    let exit = wait_for_exit(tree.pid, Some(TIMEOUT)).unwrap();
    assert!(exit.success(), "restored tree {exit}");
    let resumed = std::fs::read_to_string(&tree.out).unwrap();
    assert!(reference.child.wait().unwrap().success());
    assert_eq!(resumed, std::fs::read_to_string(&reference.out).unwrap());
    say(&format!(
        "plugin stand-in round trip: {dev_s} held by child {child_pid} restored as {placeholder}"
    ));
}

/// CRIU loading this build's plugin from a directory of its own in a new temporary directory
/// (over CRIU's RPC, as `possum checkpoint` / `possum restore` drive it), this process the
/// subreaper of the trees it restores; `None` (said why) to skip the test `test`.
fn criu_with_plugin_or_skip(test: &str) -> Option<(Criu, tempfile::TempDir)> {
    let criu = criu_or_skip(test)?;
    set_child_subreaper().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let criu = criu.with_plugin_dir(Some(plugin_libdir(tmp.path())));
    Some((criu, tmp))
}

/// possum's own CRIU driver (`possum-criu`, CRIU's RPC, which has no `libdir` option) loads the
/// plugin from its plugin directory (`POSSUM_CRIU_PLUGIN_DIR`, or `criu-plugins/` beside the
/// executable), as `possum checkpoint` / `possum restore` do.
#[test]
fn possum_criu_loads_the_plugin_from_its_plugin_dir() {
    use possum_criu::{DumpOptions, RestoreOptions};
    let test = "possum_criu_loads_the_plugin_from_its_plugin_dir";
    let Some((criu, tmp)) = criu_with_plugin_or_skip(test) else {
        return;
    };

    let mut tree = start_tree(tmp.path(), "dumped", None);
    let child_pid: i32 = wait_for_file(&tree.ready, TIMEOUT).trim().parse().unwrap();
    let images = tmp.path().join("images");
    let dump = criu
        .dump(&DumpOptions {
            log_level: possum_criu::LogLevel::Debug,
            ..DumpOptions::new(tree.pid, &images)
        })
        .unwrap();
    tree.child.wait().unwrap();
    wait_for_exit(child_pid, Some(TIMEOUT)).unwrap();
    let log = std::fs::read_to_string(&dump.log).unwrap();
    assert!(
        log.contains("possum-criu-plugin: init (stage dump"),
        "the plugin was not loaded:\n{log}"
    );
    assert!(log.contains("claimed 0 mappings and 0 open files"), "{log}");
    let restored = criu
        .restore(&RestoreOptions {
            log_level: possum_criu::LogLevel::Debug,
            ..RestoreOptions::new(&images)
        })
        .unwrap();
    let log = std::fs::read_to_string(&restored.log).unwrap();
    assert!(
        log.contains("possum-criu-plugin: init (stage restore"),
        "{log}"
    );
    let exit = wait_for_exit(restored.pid, Some(TIMEOUT)).unwrap();
    assert!(exit.success(), "restored tree {exit}");
    assert!(std::fs::read_to_string(&tree.out).is_ok());
}

/// `possum_criu::hostmem`: the bulk of each process's private memory taken out of CRIU's images
/// after the dump and written back by the plugin at restore (`RESUME_DEVICES_LATE`, the tree
/// still stopped), from several threads. The restored tree's results equal an uninterrupted
/// run's; with the moved data missing, the restore fails and nothing of the tree runs on.
#[test]
fn memory_split_out_of_criu_images_is_written_back_by_the_plugin() {
    use possum_criu::hostmem;
    use possum_criu::{DumpOptions, RestoreOptions};
    let test = "memory_split_out_of_criu_images_is_written_back_by_the_plugin";
    let Some((criu, tmp)) = criu_with_plugin_or_skip(test) else {
        return;
    };
    const KIB: usize = 32 << 10;

    let mut reference = start_tree_kib(tmp.path(), "reference", None, KIB);
    let mut tree = start_tree_kib(tmp.path(), "dumped", None, KIB);
    let child_pid: i32 = wait_for_file(&tree.ready, TIMEOUT).trim().parse().unwrap();
    let images = tmp.path().join("images");
    criu.dump(&DumpOptions::new(tree.pid, &images)).unwrap();
    tree.child.wait().unwrap();
    wait_for_exit(child_pid, Some(TIMEOUT)).unwrap();

    let report = hostmem::split(&images, &hostmem::SplitOptions::default()).unwrap();
    let pids: Vec<u32> = report.split.iter().map(|t| t.pid).collect();
    assert!(
        pids.contains(&(tree.pid as u32)) && pids.contains(&(child_pid as u32)),
        "both processes should be split: {report:?}"
    );
    for t in &report.split {
        assert!(t.moved_bytes >= (KIB as u64) << 10, "{t:?}");
        assert!(images
            .join(format!("possum-hostmem-{}.pages", t.pid))
            .is_file());
    }
    // Without possum's plugin CRIU refuses the images (the split named it required), when it
    // loads plugins at all (with no plugin directory CRIU checks nothing: `possum restore`
    // refuses such a restore itself).
    let empty = tmp.path().join("no-plugins");
    std::fs::create_dir(&empty).unwrap();
    let bare = criu.clone().with_plugin_dir(Some(empty));
    let e = bare
        .restore(&RestoreOptions::new(&images))
        .expect_err("a split image restored without possum's plugin");
    assert!(
        e.to_string().contains("Missing required plugin: possum"),
        "{e}"
    );
    // Without the moved data the restore fails, and no process of the tree runs on.
    let data = images.join(format!("possum-hostmem-{child_pid}.pages"));
    let aside = tmp.path().join("aside.pages");
    std::fs::rename(&data, &aside).unwrap();
    let failed = criu.restore(&RestoreOptions::new(&images));
    for p in [tree.pid, child_pid] {
        let _ = wait_for_exit(p, Some(TIMEOUT));
    }
    let log = std::fs::read_to_string(images.join("restore.log")).unwrap_or_default();
    assert!(
        log.contains("cannot restore the memory possum keeps"),
        "the plugin should say why:\n{log}"
    );
    match failed {
        Err(e) => {
            assert!(
                e.to_string().contains("Error (possum-criu-plugin): pid"),
                "the plugin's error first: {e}"
            );
            say(&format!("{test}: without the data: {e}"));
        }
        Ok(r) => {
            // CRIU ignores the hook's error; the process it restored was killed before it ran.
            assert!(
                wait_for_exit(r.pid, Some(TIMEOUT)).map_or(true, |e| !e.success()),
                "the restored tree ran without its memory"
            );
        }
    }
    assert!(!tree.out.exists(), "the tree ran on without its memory");

    std::fs::rename(&aside, &data).unwrap();
    let restored = criu.restore(&RestoreOptions::new(&images)).unwrap();
    let log = std::fs::read_to_string(&restored.log).unwrap();
    let filled = log.matches("host memory filled").count();
    assert_eq!(filled, 2, "both processes filled by the plugin:\n{log}");
    let exit = wait_for_exit(restored.pid, Some(TIMEOUT)).unwrap();
    assert!(exit.success(), "restored tree {exit}");
    assert!(reference.child.wait().unwrap().success());
    assert_eq!(
        std::fs::read_to_string(&tree.out).unwrap(),
        std::fs::read_to_string(&reference.out).unwrap()
    );
    say(&format!(
        "{test}: {} MiB moved out of CRIU's images, restored by the plugin",
        report.moved_bytes() >> 20
    ));
}
