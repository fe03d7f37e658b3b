//! libpossum.so end to end on a fake GPU: the fake driver (`cuda/testdata/fake-libcuda.c`, device
//! memory in host memory), a fake libcudart and a fake CUPTI whose callbacks a test job fires
//! around host code that does what its "kernels" would (`tests/fake/fake_job.c`). No GPU needed;
//! it checks possum's logic (allocations served by the engine, launches resolved, validation,
//! the DAG, the statistics), not CUDA's. The job's launches reach possum through CUPTI's callbacks
//! (`POSSUM_HOOKS=cupti`); `fake_entry.rs` has a job that goes through the driver's entry points.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

mod common;
use common::{libpossum, read_json};

/// `dir/fake_job` under libpossum on the fake GPU built in `dir`, writing `dir/stats.json` and
/// `dir/trace.json`, with the default validation settings unless the caller sets
/// `POSSUM_VALIDATE`.
fn fake_job(dir: &Path) -> Command {
    let mut cmd = Command::new(dir.join("fake_job"));
    for v in [
        "POSSUM_STATS",
        "POSSUM_TRACE",
        "POSSUM_VALIDATE",
        "POSSUM_MANAGE",
        "POSSUM_DAG",
        "POSSUM_RESOLVE",
        "LD_PRELOAD",
    ] {
        cmd.env_remove(v);
    }
    // The job fires the fake CUPTI's callbacks around its "kernels": possum listens to CUPTI.
    cmd.env("LD_PRELOAD", libpossum())
        .env("LD_LIBRARY_PATH", dir)
        .env("POSSUM_HOOKS", "cupti")
        .env("POSSUM_CUPTI", dir.join("libfakecupti.so"))
        .env("FAKE_CUPTI_NO_AUTOFIRE", "1")
        .env("POSSUM_STATS", dir.join("stats.json"))
        .env("POSSUM_TRACE", dir.join("trace.json"))
        .env("POSSUM_SOCKET_DIR", dir.join("sockets"))
        .env("POSSUM_VERBOSE", "1");
    cmd
}

/// A fresh directory `possum-NAME-<pid>` with the fake GPU stack and `fake_job` built in it;
/// `None` (the test skips, said on stderr) without a C compiler.
fn fake_gpu_dir(name: &str) -> Option<std::path::PathBuf> {
    common::fake_gpu_dir(name, "fake_job")
}

/// `fake_job ARGS` in `dir` with the variables `env`, which must say ok and exit 0: its stderr.
fn run_ok<S: AsRef<std::ffi::OsStr>>(dir: &Path, args: &[S], env: &[(&str, &str)]) -> String {
    let out = fake_job(dir)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n", "{stderr}");
    assert!(out.status.success(), "{stderr}");
    stderr
}

/// `fake_job MODE` in a fresh directory `possum-NAME-<pid>` with the first 4 launches of each
/// kernel validated and read-only speculation after 2 (fingerprints on), which must have
/// validated `validations` launches and made no kernel opaque: the directory, the statistics
/// and the trace; `None` without a C compiler.
fn run_validated(
    name: &str,
    mode: &str,
    validations: u64,
) -> Option<(std::path::PathBuf, Value, Value)> {
    let dir = fake_gpu_dir(name)?;
    run_ok(
        &dir,
        &[mode],
        &[
            ("POSSUM_VALIDATE", "first=4,readonly_after=2"),
            ("FAKE_CUDA_FINGERPRINT", "1"),
        ],
    );
    let v = read_json(&dir.join("stats.json"));
    let c = &v["possum"]["counters"];
    assert_eq!(c["validations"], validations, "{v}");
    assert_eq!(c["kernels_made_opaque"], 0, "{v}");
    let t = read_json(&dir.join("trace.json"));
    Some((dir, v, t))
}

/// Kernel `name` of the trace `t`, which must have been validated `validated` times, not be
/// opaque, and have `readonly_slots` slots speculated read-only.
fn assert_validated(t: &Value, name: &str, validated: u64, readonly_slots: u64) -> Value {
    let k = kernel(t, name);
    assert_eq!(k["validated"], validated, "{name}: {k}");
    assert_eq!(k["opaque"], false, "{name}: {k}");
    assert_eq!(k["readonly_slots"], readonly_slots, "{name}: {k}");
    k
}

/// `fake_job bench ITERS` in `dir` with the variables `env`: its statistics.
fn bench(dir: &Path, iters: usize, env: &[(&str, &str)]) -> Value {
    run_ok(dir, &["bench", &iters.to_string()], env);
    read_json(&dir.join("stats.json"))
}

/// The statistics of kernel `name` in the trace `t`.
fn kernel(t: &Value, name: &str) -> Value {
    t["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["name"] == name)
        .unwrap_or_else(|| panic!("{name} not in {t}"))
        .clone()
}

#[test]
fn a_job_on_a_fake_gpu() {
    let Some(dir) = fake_gpu_dir("fakegpu") else {
        return;
    };
    let stats = dir.join("stats.json");
    let trace = dir.join("trace.json");
    // Read-only speculation is opt-in (`readonly_after`): on here, to see it earned.
    // Read-only speculation needs images proven by fingerprints: the fake driver's kernel on.
    let stderr = run_ok::<&str>(
        &dir,
        &[],
        &[
            ("POSSUM_VALIDATE", "readonly_after=2"),
            ("FAKE_CUDA_FINGERPRINT", "1"),
        ],
    );
    assert!(
        stderr.contains("device 0: allocations are served by the engine"),
        "{stderr}"
    );
    assert!(
        stderr.contains("kernel bump_table is opaque from now on"),
        "{stderr}"
    );
    // Validation read through its pinned buffer (queued copies), not one copy at a time.
    assert!(!stderr.contains("one copy at a time"), "{stderr}");

    let v = read_json(&stats);
    let p = &v["possum"];
    let c = &p["counters"];
    // Four cudaMalloc calls served by the engine, four cudaFree calls of its buffers.
    assert_eq!(c["managed_allocs"], 4, "{v}");
    assert_eq!(c["managed_frees"], 4, "{v}");
    assert_eq!(c["fallback_allocs"], 0, "{v}");
    assert_eq!(c["launches"], 8, "{v}");
    assert_eq!(c["launches_hooked"], 8, "{v}");
    assert_eq!(c["copies"], 1, "{v}");
    // The first two launches of each kernel are validated; bump_table's first validation makes it
    // opaque, so its later launches are not validated.
    assert_eq!(c["validations"], 5, "{v}");
    assert_eq!(c["kernels_made_opaque"], 1, "{v}");
    assert_eq!(c["launches_opaque"], 2, "{v}");
    assert_eq!(c["hook_errors"], 0, "{v}");
    let opaque = p["opaque_kernels"].as_array().unwrap();
    assert_eq!(opaque.len(), 1, "{v}");
    assert_eq!(opaque[0]["name"], "bump_table");
    let why = opaque[0]["reason"].as_str().unwrap();
    assert!(
        why.contains("wrote buffer(s) it was not passed") || why.contains("device pointers"),
        "{why}"
    );
    assert_eq!(p["engines"][0]["engine"]["buffers"], 0, "{v}");

    let t = read_json(&trace);
    // axpy's x (slot 0) was unchanged by both validated launches: speculated read-only; y not.
    let axpy = kernel(&t, "axpy");
    assert_eq!(axpy["launches"], 3);
    assert_eq!(axpy["validated"], 2);
    assert_eq!(axpy["readonly_slots"], 1, "{axpy}");
    assert_eq!(axpy["opaque"], false);
    // scale's pointers live inside a by-value struct: 3 words, 2 of them pointers, not opaque.
    let scale = kernel(&t, "scale");
    assert_eq!(scale["slots"], 3, "{scale}");
    assert_eq!(scale["opaque"], false, "{scale}");
    // The DAG: axpy reads one buffer and writes another; scale writes z; the copy is there.
    let dag = &t["dag"];
    let edges = dag["edges"].as_array().unwrap();
    let kinds_of = |k: &str| -> Vec<String> {
        let id = dag["kernels"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == k)
            .unwrap()["handle"]
            .clone();
        edges
            .iter()
            .filter(|e| e["kernel"] == id)
            .map(|e| e["kind"].as_str().unwrap_or("?").to_lowercase())
            .collect()
    };
    let axpy_edges = kinds_of("axpy");
    assert!(
        axpy_edges.iter().any(|k| k == "read") && axpy_edges.iter().any(|k| k == "write"),
        "{dag}"
    );
    assert!(!kinds_of("memcpy").is_empty(), "{dag}");
    assert!(dag["buffers"].as_array().unwrap().len() >= 4, "{dag}");
    let dot = std::fs::read_to_string(dir.join("trace.json.dot")).unwrap();
    assert!(dot.starts_with("digraph") && dot.contains("axpy"), "{dot}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A reduction whose input and output share one allocation (one segment of PyTorch's caching
/// allocator) changes that allocation at every launch; its input slot is judged by a window at its
/// own address, so it earns read-only, while its output slot stays read-write. (Judged by the
/// allocation alone, both were read-write for good: a frozen 32 GiB of state was copied again at
/// every checkpoint's pause on the H100.)
#[test]
fn a_slot_sharing_an_allocation_is_judged_by_its_own_window() {
    let Some((dir, _, t)) = run_validated("fakegpu-shared", "shared", 8) else {
        return;
    };
    for name in ["reduce_shared", "reduce_small"] {
        assert_validated(&t, name, 4, 1);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A kernel that writes the bytes that were there (zeros over zeros, 0xff over 0xff) looks
/// unchanged to validation; it must not earn read-only speculation from that, or a later launch
/// that does change data would not count as a write. A kernel that only reads a buffer of varied
/// contents still earns it.
#[test]
fn writes_of_a_constant_earn_no_readonly() {
    // Validations: 4 per kernel, and launch 4 of each fill again: its slot has no verdict (a
    // constant fill gives none), so its kernel is rechecked at powers of two (POSSUM_VALIDATE
    // recheck).
    let Some((dir, v, t)) = run_validated("fakegpu-fill", "fill", 14) else {
        return;
    };
    let c = &v["possum"]["counters"];
    assert_eq!(c["launches_hooked"], 18, "{v}");
    assert_eq!(c["validation_errors"], 0, "{v}");
    assert_eq!(c["hook_errors"], 0, "{v}");

    // No read-only slot from constant fills.
    for name in ["fill_zero", "fill_ff"] {
        let k = assert_validated(&t, name, 5, 0);
        assert_eq!(k["launches"], 6, "{k}");
    }
    let sum_read = kernel(&t, "sum_read");
    assert_eq!(sum_read["validated"], 4, "{sum_read}");
    assert_eq!(sum_read["readonly_slots"], 1, "{sum_read}");

    // Every launch of the fills counts as a write of their buffer, the two unvalidated launches
    // of fill_zero that changed it included; sum_read writes until it earns read-only after its
    // second validated launch, then reads.
    let dag = &t["dag"];
    let edges_of = |name: &str| -> Vec<(String, u64)> {
        let id = dag["kernels"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == name)
            .unwrap_or_else(|| panic!("{name} not in {dag}"))["handle"]
            .clone();
        let mut e: Vec<(String, u64)> = dag["edges"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["kernel"] == id)
            .map(|e| {
                (
                    e["kind"].as_str().unwrap().to_string(),
                    e["count"].as_u64().unwrap(),
                )
            })
            .collect();
        e.sort();
        e
    };
    assert_eq!(edges_of("fill_zero"), [("write".to_string(), 6)], "{dag}");
    assert_eq!(edges_of("fill_ff"), [("write".to_string(), 6)], "{dag}");
    assert_eq!(
        edges_of("sum_read"),
        [("read".to_string(), 4), ("write".to_string(), 2)],
        "{dag}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The per-kernel memo of resolved buffer sets must serve a training loop's launches: a kernel
/// launched on 24 buffer sets in turn (once per layer), with non-pointer words (a step count)
/// changing every launch. Only each (kernel, set)'s first launch may resolve its words.
#[test]
fn the_memo_serves_many_buffer_sets_and_changing_scalars() {
    let Some(dir) = fake_gpu_dir("fakememo") else {
        return;
    };
    let sets = 24;
    let iters = 10 * sets;
    let v = bench(
        &dir,
        iters,
        &[
            ("FAKE_JOB_SETS", &sets.to_string()),
            ("FAKE_JOB_MISS", "1"),
            ("POSSUM_RESOLVE", "always"),
        ],
    );
    let c = &v["possum"]["counters"];
    let launches = c["launches"].as_u64().unwrap();
    let hits = c["memo_hits"].as_u64().unwrap();
    assert_eq!(launches, 4 * iters as u64, "{v}");
    // 4 kernels x 24 sets resolved once each; the validated launches (2 per kernel, and the
    // rechecks of kernels with a slot still without a verdict) resolve too. One kernel has a
    // single pointer: its sets differ in one word only.
    let validations = c["validations"].as_u64().unwrap();
    let misses_allowed = 4 * sets as u64 + validations;
    assert!(
        hits >= launches - misses_allowed,
        "memo hits {hits} of {launches} launches: {c}"
    );
    assert_eq!(c["launches_identified"], launches, "{v}");
    // Per kernel: the one-pointer kernel resolved each of its sets once (and its validated
    // launches: the first 2, then the rechecks while its slot has no verdict), no more.
    let t = read_json(&dir.join("trace.json"));
    let fill = kernel(&t, "fill_like");
    assert_eq!(fill["launches"], iters as u64, "{fill}");
    assert!(
        fill["resolved"].as_u64().unwrap() <= sets as u64 + fill["validated"].as_u64().unwrap(),
        "{fill}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A kernel the driver cannot describe gets its parameter layout from the `.nv.info` of the
/// module it was loaded with (CUPTI's module-loaded callback; a real sm_90 cubin here), so its
/// launches are resolved like any other's; an image that is no cubin is skipped and counted.
#[test]
fn a_layout_the_driver_cannot_give_comes_from_the_module() {
    let Some(dir) = fake_gpu_dir("fakemodule") else {
        return;
    };
    let cubin = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../analyzer/tests/data/params_sm90.cubin"
    );
    run_ok(&dir, &["module", cubin], &[("POSSUM_RESOLVE", "always")]);
    let v = read_json(&dir.join("stats.json"));
    let c = &v["possum"]["counters"];
    assert_eq!(c["modules_parsed"], 1, "{c}");
    assert_eq!(c["modules_unparsed"], 1, "{c}");
    assert_eq!(c["layouts_from_cubin"], 1, "{c}");
    assert_eq!(c["launches"], 3, "{c}");
    assert_eq!(c["launches_identified"], 3, "{c}");
    assert_eq!(c["launches_opaque"], 0, "{c}");
    let t = read_json(&dir.join("trace.json"));
    let k1 = kernel(&t, "_Z2k1iPf1ScS_");
    assert_eq!(k1["opaque"], false, "{k1}");
    // Pointer-sized words at 8, 16, 24, 32 and 48 (cuobjdump's layout of k1).
    assert_eq!(k1["slots"], 5, "{k1}");

    // Launched once before its module is loaded: opaque then (no layout yet), replaced by a
    // model with the layout once the module arrives.
    run_ok(
        &dir,
        &["module", cubin, "late"],
        &[("POSSUM_RESOLVE", "always")],
    );
    let c = &read_json(&dir.join("stats.json"))["possum"]["counters"];
    assert_eq!(c["layouts_from_cubin"], 1, "{c}");
    assert_eq!(c["launches"], 4, "{c}");
    assert_eq!(c["launches_opaque"], 1, "{c}");
    assert_eq!(c["launches_identified"], 3, "{c}");
    let k1 = kernel(&read_json(&dir.join("trace.json")), "_Z2k1iPf1ScS_");
    assert_eq!(k1["opaque"], false, "{k1}");
    assert_eq!(k1["launches"], 4, "{k1}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `POSSUM_RESOLVE=sample:W/P`: outside a checkpoint only W launches in every P are looked at
/// (and the validated ones); those are all identified, and the DAG's window holds only launches
/// since the last gap.
#[test]
fn sampling_resolves_runs_of_launches() {
    let Some(dir) = fake_gpu_dir("fakesample") else {
        return;
    };
    let iters = 200;
    let v = bench(
        &dir,
        iters,
        &[("FAKE_JOB_SETS", "4"), ("POSSUM_RESOLVE", "sample:16/128")],
    );
    let c = &v["possum"]["counters"];
    let n = |k: &str| c[k].as_u64().unwrap();
    let launches = n("launches");
    assert_eq!(launches, 4 * iters as u64, "{v}");
    // Launches 0-15, 128-143, ...: 16 in every 128; validated ones may fall outside.
    let windows = launches.div_ceil(128) * 16;
    let examined = n("launches_examined");
    assert!(
        (windows..=windows + n("validations")).contains(&examined),
        "{examined} examined, {windows} in windows: {c}"
    );
    assert_eq!(n("launches_identified"), examined, "{c}");
    let t = read_json(&dir.join("trace.json"));
    let window = t["dag"]["window"]["launches"].as_array().unwrap().len();
    assert!(
        (1..=16).contains(&window),
        "{window}: {}",
        t["dag"]["window"]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `POSSUM_AB_MS`: CUPTI detached and attached again every few milliseconds, each switch logged;
/// launches of the off intervals go unseen, the others are handled.
#[test]
fn the_ab_test_switches_the_hooks_off_and_on() {
    let Some(dir) = fake_gpu_dir("fakeab") else {
        return;
    };
    let log = dir.join("ab.jsonl");
    let _ = std::fs::remove_file(&log);
    // Long enough for several switches at 20 ms on a slow machine.
    let iters: u64 = 400_000;
    let stderr = run_ok(
        &dir,
        &["bench", &iters.to_string()],
        &[
            ("POSSUM_AB_MS", "20"),
            ("POSSUM_AB_LOG", log.to_str().unwrap()),
        ],
    );
    let lines: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(lines.len() >= 2, "switches: {lines:?} {stderr}");
    for (i, l) in lines.iter().enumerate() {
        // Starts attached: the first switch turns the hooks off, the next on again, ...
        assert_eq!(l["on"], i % 2 == 1, "{lines:?}");
        assert!(l["error"].is_null(), "{lines:?}");
    }
    let v = read_json(&dir.join("stats.json"));
    let launches = v["possum"]["counters"]["launches"].as_u64().unwrap();
    assert!(
        launches > 0 && launches < 4 * iters,
        "launches seen {launches} of {}: the off intervals' must go unseen",
        4 * iters
    );
    let _ = std::fs::remove_dir_all(&dir);
}
