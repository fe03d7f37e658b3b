//! libpossum.so preloaded into programs that never use CUDA (no GPU or CUPTI needed): they must
//! run exactly as without it, whichever way possum hooks (`POSSUM_HOOKS`: the driver's entry
//! points by default, CUPTI, or nothing).

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Command, Output};

mod common;
use common::{cc, fresh_dir, libpossum, read_json};

/// A CUPTI that cannot exist, so the result does not depend on this machine having one.
const NO_CUPTI: &str = "/nonexistent/libcupti.so";

/// `argv` with the environment cleared of possum's variables, then `POSSUM_CUPTI` set to `cupti`
/// and, with `preload`, libpossum.so preloaded.
fn command(argv: &[&str], preload: bool, cupti: &OsStr) -> Command {
    let mut cmd = Command::new(argv[0]);
    cmd.args(&argv[1..]);
    for v in [
        "POSSUM_STATS",
        "POSSUM_VERBOSE",
        "POSSUM_CUPTI",
        "POSSUM_HOOKS",
        "LD_PRELOAD",
    ] {
        cmd.env_remove(v);
    }
    if preload {
        cmd.env("LD_PRELOAD", libpossum());
    }
    cmd.env("POSSUM_CUPTI", cupti);
    cmd
}

/// Runs `argv` with the environment cleared of possum's variables, plus `env`.
fn run(argv: &[&str], preload: bool, env: &[(&str, &str)]) -> Output {
    command(argv, preload, NO_CUPTI.as_ref())
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// The `POSSUM_HOOKS` settings: the default (entry), CUPTI, off.
const HOOKS: [&[(&str, &str)]; 3] = [
    &[],
    &[("POSSUM_HOOKS", "cupti")],
    &[("POSSUM_HOOKS", "off")],
];

fn assert_unchanged(argv: &[&str]) {
    let plain = run(argv, false, &[]);
    for hooks in HOOKS {
        let preloaded = run(argv, true, hooks);
        assert_eq!(
            plain.status.code(),
            preloaded.status.code(),
            "{argv:?} {hooks:?}"
        );
        assert_eq!(plain.stdout, preloaded.stdout, "{argv:?} {hooks:?}");
        assert_eq!(plain.stderr, preloaded.stderr, "{argv:?} {hooks:?}");
    }
}

#[test]
fn programs_run_unchanged() {
    assert_unchanged(&["/bin/true"]);
    assert_unchanged(&["/bin/false"]);
    assert_unchanged(&["sh", "-c", "echo hi; echo err >&2; exit 3"]);
    if Command::new("python3").arg("-c").arg("0").output().is_ok() {
        assert_unchanged(&["python3", "-c", "print(1)"]);
    }
}

#[test]
fn verbose_prints_one_line() {
    let verbose = |hooks: &[(&str, &str)]| -> String {
        let out = run(&["sh", "-c", "echo hi"], true, hooks);
        assert!(out.status.success());
        assert_eq!(out.stdout, b"hi\n");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.lines().count(), 1, "{err}");
        err
    };
    let err = verbose(&[("POSSUM_VERBOSE", "1")]);
    assert_eq!(
        err, "possum: hooks: the driver's entry points (CUPTI not loaded)\n",
        "{err}"
    );
    let err = verbose(&[("POSSUM_VERBOSE", "1"), ("POSSUM_HOOKS", "cupti")]);
    assert!(err.starts_with("possum: CUPTI not found ("), "{err}");
    assert!(
        err.trim_end().ends_with("launches will not be seen"),
        "{err}"
    );
    let err = verbose(&[("POSSUM_VERBOSE", "1"), ("POSSUM_HOOKS", "off")]);
    assert!(err.starts_with("possum: hooks off"), "{err}");
    assert!(err.contains("launches will not be seen"), "{err}");
}

/// Runs `argv` preloaded and returns its process id (`%p` in `POSSUM_STATS`).
fn spawn_pid(argv: &[&str], env: &[(&str, &str)]) -> u32 {
    let mut child = command(argv, true, NO_CUPTI.as_ref())
        .envs(env.iter().copied())
        .spawn()
        .unwrap();
    let pid = child.id();
    assert!(child.wait().unwrap().success());
    pid
}

/// Asserts that the statistics `v` say why CUPTI is not in use, `what` among it.
fn assert_cupti_error(v: &serde_json::Value, what: &str) {
    let why = v["cupti_error"].as_str().unwrap();
    assert!(why.contains(what), "{why}");
}

/// Asserts the totals in the statistics `v`: `launches` kernel launches, `graph_launches` graph
/// launches and `functions` distinct functions launched.
fn assert_totals(v: &serde_json::Value, launches: u64, graph_launches: u64, functions: u64) {
    assert_eq!(v["total_launches"], launches, "{v}");
    assert_eq!(v["graph_launches"], graph_launches, "{v}");
    assert_eq!(v["distinct_functions"], functions, "{v}");
}

#[test]
fn stats_file_is_written() {
    // Statistics are written by an `atexit` handler: programs that leave through `exit()` (like
    // `true` and Python), not ones that call `_exit()` (like dash).
    let dir = fresh_dir("preload");
    let file = dir.join("stats-%p.json");
    let pid = spawn_pid(
        &["/bin/true"],
        &[
            ("POSSUM_STATS", file.to_str().unwrap()),
            ("POSSUM_HOOKS", "cupti"),
        ],
    );
    let path = dir.join(format!("stats-{pid}.json"));
    let v = read_json(&path);
    assert_eq!(v["pid"], pid);
    assert_eq!(v["hooks"], "cupti");
    assert_eq!(v["entry"]["mode"], "cupti");
    assert_eq!(v["cupti"], false);
    assert_cupti_error(&v, "/nonexistent/libcupti.so");
    assert_totals(&v, 0, 0, 0);
    assert_eq!(v["launches"]["cuLaunchKernel"], 0);
    assert_eq!(v["copies"]["cuMemcpyAsync"], 0);
    assert_eq!(v["allocs"]["cuMemAlloc_v2"], 0);
    // Nothing else is left in the directory (the temporary file was renamed).
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);

    // Without `%p`: written when absent ...
    let fixed = dir.join("stats.json");
    spawn_pid(&["/bin/true"], &[("POSSUM_STATS", fixed.to_str().unwrap())]);
    let v = read_json(&fixed);
    assert_eq!(v["cupti"], false);
    // (By default possum hooks the driver's entry points: no CUPTI, no driver call seen.)
    assert_eq!(v["hooks"], "entry");
    assert_eq!(v["entry"]["mode"], "entry");
    assert_eq!(v["entry"]["swapped_dlsym"], 0);
    assert_eq!(v["total_launches"], 0);
    // ... but a later process that saw no CUDA call leaves an existing file alone.
    std::fs::write(&fixed, "keep").unwrap();
    spawn_pid(&["/bin/true"], &[("POSSUM_STATS", fixed.to_str().unwrap())]);
    assert_eq!(std::fs::read_to_string(&fixed).unwrap(), "keep");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn exports_injection_entry_point() {
    // The symbol libcuda looks up for CUDA_INJECTION64_PATH.
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(libpossum())
        .output();
    let Ok(out) = out else {
        eprintln!("nm not available; skipped");
        return;
    };
    let syms = String::from_utf8_lossy(&out.stdout);
    assert!(
        syms.lines().any(|l| l.ends_with(" InitializeInjection")),
        "{syms}"
    );
}

/// Builds `tests/fake/fake_cupti.c` into `dir`; `None` (test skipped) without a C compiler.
fn fake_cupti(dir: &std::path::Path) -> Option<PathBuf> {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fake/fake_cupti.c");
    let so = dir.join("libfakecupti.so");
    let ok = cc(&[
        "-shared",
        "-fPIC",
        "-O1",
        "-o",
        so.to_str().unwrap(),
        src.to_str().unwrap(),
    ]);
    if !ok {
        eprintln!("no C compiler; skipped");
        return None;
    }
    Some(so)
}

#[test]
fn counts_callbacks_of_a_fake_cupti() {
    let dir = fresh_dir("fake");
    let Some(fake) = fake_cupti(&dir) else {
        return;
    };
    let stats = dir.join("stats.json");
    let out = command(&["/bin/true"], true, fake.as_os_str())
        .env("POSSUM_STATS", &stats)
        .env("POSSUM_HOOKS", "cupti")
        .env("POSSUM_VERBOSE", "1")
        .output()
        .unwrap();
    assert!(out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    // The set-up line, and the control socket (started at the first CUDA call).
    assert_eq!(err.lines().count(), 2, "{err}");
    assert!(err.contains("possum: control socket "), "{err}");
    let n = possum::cbid::CALLBACKS.len();
    assert!(
        err.contains(&format!(
            "{} of {n} driver callbacks enabled; not enabled: cuMemcpyBatchAsync_v2_ptsz",
            n - 1
        )),
        "{err}"
    );

    let v = read_json(&stats);
    assert_eq!(v["cupti"], true, "{v}");
    assert_eq!(v["cupti_path"], fake.to_str().unwrap());
    assert_eq!(v["enabled_callbacks"], n - 1);
    assert_cupti_error(
        &v,
        "cuMemcpyBatchAsync_v2_ptsz (797): CUPTI_ERROR_INVALID_PARAMETER",
    );
    let l = &v["launches"];
    assert_eq!(l["cuLaunchKernel"], 3, "{v}");
    assert_eq!(l["cuLaunchKernel_ptsz"], 1);
    assert_eq!(l["cuLaunchKernelEx"], 1);
    assert_eq!(l["cuLaunchKernelEx_ptsz"], 1);
    assert_eq!(l["cuLaunchCooperativeKernel"], 0);
    // 6 launches; 1 of a graph; 3 functions: 0x1000 and 0x2000 from cuLaunchKernel, 0x3000 (the
    // second field) from cuLaunchKernelEx.
    assert_totals(&v, 6, 1, 3);
    assert_eq!(v["graphs"]["cuGraphLaunch"], 1);
    assert_eq!(v["copies"]["cuMemcpyAsync"], 1);
    assert_eq!(v["allocs"]["cuMemAlloc_v2"], 1);
    assert_eq!(v["memsets"]["cuMemsetD8Async"], 0);
    // The hooks saw them too: no libcuda here, so every kernel is opaque (no parameter layout),
    // and the graph, never seen instantiated, is launched as opaque.
    let c = &v["possum"]["counters"];
    assert_eq!(c["launches"], 6, "{v}");
    assert_eq!(c["launches_opaque"], 6, "{v}");
    assert_eq!(c["graph_launches"], 1, "{v}");
    assert_eq!(c["graph_launches_opaque"], 1, "{v}");
    // The instantiated graph whose nodes could not be read is listed with why.
    let g = &v["possum"]["opaque_graphs"];
    assert_eq!(g.as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(g[0]["exec"], "0x6000", "{v}");
    assert!(
        g[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("cannot read its nodes")),
        "{v}"
    );
    assert_eq!(c["copies"], 1, "{v}");
    assert_eq!(v["possum"]["kernels"], 3, "{v}");
    std::fs::remove_dir_all(&dir).unwrap();
}
