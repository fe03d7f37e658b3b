//! possum without CUPTI: the driver's entry points wrapped (`src/cuda/entry.rs`), on the fake driver
//! (`cuda/testdata/fake-libcuda.c`, where kernels run on the host). The job
//! (`tests/fake/fake_entry_job.c`) reaches the driver the three ways a real one does: linked
//! against libcuda, `dlsym` on the driver's handle, and `cuGetProcAddress_v2` (its self-lookup,
//! per-thread variants, the `_v2` names, and the CUDA 11.3 `cuGetProcAddress`); then allocates
//! without cudaMalloc (stream-ordered, the expandable-segments VMM sequence, managed memory).
//!
//! Checked: every call counted under its driver name, exactly; every lookup answered with
//! possum's wrapper; the allocations possum serves (`cuMemAlloc_v2`, however reached) and those
//! it tracks as unmanaged; and the job's results, which are the same without possum, with its
//! hooks off (nothing counted) and with CUPTI feeding the hooks (the wrappers only counting).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

mod common;
use common::{build_fake_gpu_linked, fake_job_command, fresh_dir, libpossum, read_json, stdout_of};

/// u32 words per buffer (fake_entry_job.c).
const N: u64 = 1 << 16;

/// The calls the job makes through wrapped entry points: (statistics group, name, count).
/// Every other name of these groups is 0.
const CALLS: &[(&str, &str, u64)] = &[
    // direct 3 + dlsym 1 + async 1 + managed 1; per-thread (through cuGetProcAddress) 2.
    ("launches", "cuLaunchKernel", 6),
    ("launches", "cuLaunchKernel_ptsz", 2),
    ("launches", "cuLaunchKernelEx", 2),
    ("launches", "cuLaunchCooperativeKernel", 1),
    ("graphs", "cuGraphLaunch", 1),
    ("copies", "cuMemcpyHtoD_v2", 1),
    ("copies", "cuMemcpyHtoD_v2_ptds", 1),
    ("copies", "cuMemcpyHtoDAsync_v2", 1),
    ("copies", "cuMemcpyDtoH_v2", 3),
    ("copies", "cuMemcpyDtoH_v2_ptds", 1),
    ("copies", "cuMemcpyDtoHAsync_v2", 1),
    ("copies", "cuMemcpyDtoD_v2", 1),
    ("copies", "cuMemcpyAsync", 1),
    ("memsets", "cuMemsetD8_v2", 1),
    ("memsets", "cuMemsetD32_v2", 1),
    ("memsets", "cuMemsetD32Async", 1),
    // Two by name, two through cuGetProcAddress: all served by possum's engine.
    ("allocs", "cuMemAlloc_v2", 4),
    ("allocs", "cuMemFree_v2", 4),
    ("allocs", "cuMemAllocAsync", 2),
    ("allocs", "cuMemFreeAsync", 1),
    ("allocs", "cuMemCreate", 1),
    ("allocs", "cuMemMap", 1),
    ("allocs", "cuMemAllocManaged", 1),
    ("streams", "cuStreamCreate", 1),
    // The self-lookup, 7 names and one unknown through the function it returned; the v1 form's
    // two lookups.
    ("entry_points", "cuGetProcAddress_v2", 9),
    ("entry_points", "cuGetProcAddress", 2),
];

/// Calls possum answers itself (engine buffers): they never reach the driver, so CUPTI would not
/// see them, and the wrappers do not count them beside it. The stream-ordered and VMM ones are
/// served by default (`POSSUM_SERVE_POOLS`, `POSSUM_SERVE_VMM`).
const SERVED: &[&str] = &[
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuMemCreate",
    "cuMemMap",
];

/// Kernel launches among [`CALLS`].
const LAUNCHES: u64 = 11;

/// What the job prints: each phase's checksum computed here from the job's definition (the
/// u64 sum of base + i * step + a * x(i), u32 arithmetic, x(i) = 7i + 1), every lookup "1".
fn expected_output() -> String {
    let sum = |base: u32, step: u32, a: u32| -> u64 {
        (0..N as u32)
            .map(|i| {
                let x = 7u32.wrapping_mul(i).wrapping_add(1);
                u64::from(
                    base.wrapping_add(i.wrapping_mul(step))
                        .wrapping_add(a.wrapping_mul(x)),
                )
            })
            .sum()
    };
    // Each lookup's line: the name looked up, and 1 (it was found).
    let found = |names: &[&str]| -> String { names.iter().map(|l| format!("{l} 1\n")).collect() };
    let mut out = format!("direct ok {}\n", sum(5, 0, 7));
    out += &found(&[
        "dlsym cuLaunchKernel",
        "dlsym cuLaunchCooperativeKernel",
        "dlsym cuMemcpyDtoH_v2",
    ]);
    out += &format!("dlsym ok {}\n", sum(1000, 1, 2));
    out += &found(&[
        "dlsym cuGetProcAddress_v2",
        "gpa cuGetProcAddress",
        "gpa cuLaunchKernel per-thread",
        "gpa cuLaunchKernel",
        "gpa cuMemAlloc",
        "gpa cuMemFree",
        "gpa cuMemcpyHtoD per-thread",
        "gpa cuMemcpyDtoH per-thread",
        "gpa cuCtxSynchronize",
    ]);
    // CUDA_ERROR_NOT_FOUND, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, the pointer cleared.
    out += "gpa cuNoSuchFunction 500 1 1\n";
    out += &found(&[
        "dlsym cuGetProcAddress",
        "gpa1 cuGetProcAddress",
        "gpa1 cuMemsetD32",
    ]);
    out += &format!("gpa ok {}\n", sum(100, 1, 3));
    out += &format!("async ok {}\n", sum(9, 0, 1));
    out += &format!("vmm ok {}\n", sum(0, 0, 4));
    out += &format!("managed ok {}\n", sum(50, 2, 2));
    out + "graph 0\ndone\n"
}

/// A fresh directory with the fake GPU and the job (linked against the fake libcuda) built in
/// it; `None` (the test skips, said on stderr) without a C compiler.
fn setup(name: &str) -> Option<PathBuf> {
    let dir = fresh_dir(&format!("entry-{name}"));
    build_fake_gpu_linked(
        Path::new(env!("CARGO_MANIFEST_DIR")),
        &dir,
        "tests/fake/fake_entry_job.c",
        "fake_entry_job",
        &["-l:libcuda.so.1"],
    )
    .then_some(dir)
}

/// The job's stdout (it must exit 0), with libpossum preloaded and `env` when `possum`, and its
/// statistics then.
fn run(dir: &Path, possum: bool, env: &[(&str, &str)]) -> (String, Option<Value>) {
    let stats = dir.join("stats.json");
    let _ = std::fs::remove_file(&stats);
    let lib = possum.then(libpossum);
    let mut cmd = fake_job_command(dir, "fake_entry_job", lib.as_deref());
    cmd.env("POSSUM_STATS", &stats)
        .env("POSSUM_SOCKET_DIR", dir.join("sockets"))
        .envs(env.iter().copied());
    let text = stdout_of(&mut cmd);
    (text, possum.then(|| read_json(&stats)))
}

/// The job under possum with `env`: its output must be the one computed here, which is also what
/// it prints without possum. Returns the statistics.
fn run_checked(dir: &Path, env: &[(&str, &str)]) -> Value {
    let want = expected_output();
    let (plain, _) = run(dir, false, &[]);
    assert_eq!(plain, want, "the job does not compute what the test thinks");
    let (out, stats) = run(dir, true, env);
    assert_eq!(out, want, "{env:?}: the job's output changed under possum");
    stats.unwrap()
}

/// The count of `name` in the statistics' group `group` expected when the calls are counted.
fn expected(group: &str, name: &str) -> u64 {
    CALLS
        .iter()
        .find(|c| c.0 == group && c.1 == name)
        .map_or(0, |c| c.2)
}

/// Asserts every per-name count of the groups of [`CALLS`]: as expected with `counted`, else 0.
fn assert_counts(stats: &Value, counted: bool) {
    for group in [
        "launches",
        "graphs",
        "copies",
        "memsets",
        "allocs",
        "streams",
        "entry_points",
    ] {
        let names = stats[group]
            .as_object()
            .unwrap_or_else(|| panic!("no {group}: {stats}"));
        for (name, n) in names {
            let want = if counted { expected(group, name) } else { 0 };
            assert_eq!(n, want, "{group}.{name}: {stats}");
        }
    }
    let total = if counted { LAUNCHES } else { 0 };
    assert_eq!(stats["total_launches"], total, "{stats}");
}

/// Asserts what possum left to the driver: the allocations the job kept to the end by kind
/// (`by_kind`), `allocs` allocations in all, and `launches` kernels launched on them.
fn assert_unmanaged(stats: &Value, by_kind: Value, allocs: u64, launches: u64) {
    let p = &stats["possum"];
    assert_eq!(p["unmanaged"]["by_kind"], by_kind, "{stats}");
    assert_eq!(p["counters"]["unmanaged_allocs"], allocs, "{stats}");
    assert_eq!(p["counters"]["launches_unmanaged"], launches, "{stats}");
}

/// What every mode shares: the lookups answered with possum's wrappers (the pointer swap works
/// whatever the hooks), allocations served by the engine: the four `cuMemAlloc_v2` (freed), and
/// unless `POSSUM_SERVE_POOLS=0` / `POSSUM_SERVE_VMM=0` the two `cuMemAllocAsync` (from one slab)
/// and the VMM piece.
fn assert_swapped_and_served(stats: &Value) {
    assert_swapped_and_served_with(stats, true);
}

fn assert_swapped_and_served_with(stats: &Value, allocators_served: bool) {
    let e = &stats["entry"];
    // cuLaunchKernel, cuLaunchCooperativeKernel, cuMemcpyDtoH_v2, cuGetProcAddress_v2,
    // cuGetProcAddress.
    assert_eq!(e["swapped_dlsym"], 5, "{stats}");
    // The self-lookup, 6 wrapped names, the v1 self-lookup and cuMemsetD32.
    assert_eq!(e["swapped_proc_address"], 9, "{stats}");
    // cuCtxSynchronize, not wrapped (the unknown name failed: nothing to hand out).
    assert_eq!(e["passed_proc_address"], 1, "{stats}");
    assert_eq!(e["unmatched"], json!([]), "{stats}");
    let p = &stats["possum"];
    let c = &p["counters"];
    assert_eq!(
        c["managed_allocs"],
        if allocators_served { 6 } else { 4 },
        "{stats}"
    );
    assert_eq!(c["managed_frees"], 4, "{stats}");
    assert_eq!(c["fallback_allocs"], 0, "{stats}");
    // The pools' slab and the VMM piece.
    let buffers = if allocators_served { 2 } else { 0 };
    assert_eq!(p["engines"][0]["engine"]["buffers"], buffers, "{stats}");
    assert_eq!(p["pools"]["serving"], allocators_served, "{stats}");
    assert_eq!(p["vmm"]["serving"], allocators_served, "{stats}");
    if allocators_served {
        assert_eq!(p["pools"]["allocations_served"], 2, "{stats}");
        assert_eq!(p["pools"]["blocks_live"], 1, "{stats}");
        assert_eq!(p["vmm"]["pieces_mapped_now"], 1, "{stats}");
        assert_eq!(p["vmm"]["left_to_driver"], 0, "{stats}");
    }
}

/// By default the hooks run in the wrappers: every call counted under the name the job reached,
/// the launches hooked and resolved, the allocations possum does not serve tracked by kind.
#[test]
fn every_way_to_the_driver_is_seen_through_the_entry_points() {
    let Some(dir) = setup("hooks") else { return };
    let stats = run_checked(&dir, &[]);
    assert_eq!(stats["hooks"], "entry", "{stats}");
    assert_eq!(stats["cupti"], false, "{stats}");
    assert_eq!(stats["entry"]["mode"], "entry", "{stats}");
    assert_eq!(stats["entry"]["seen_beside_cupti"], json!({}), "{stats}");
    assert_counts(&stats, true);
    assert_swapped_and_served(&stats);

    let p = &stats["possum"];
    let c = &p["counters"];
    assert_eq!(c["launches"], LAUNCHES, "{stats}");
    assert_eq!(c["launches_hooked"], LAUNCHES, "{stats}");
    assert_eq!(c["launches_identified"], LAUNCHES, "{stats}");
    assert_eq!(c["launches_opaque"], 0, "{stats}");
    assert_eq!(c["kernels_made_opaque"], 0, "{stats}");
    assert_eq!(c["copies"], 10, "{stats}");
    assert_eq!(c["memsets"], 3, "{stats}");
    assert_eq!(c["graph_launches"], 1, "{stats}");
    assert_eq!(c["hook_errors"], 0, "{stats}");
    assert_eq!(c["validation_errors"], 0, "{stats}");
    // iota and axpy.
    assert_eq!(stats["distinct_functions"], 2, "{stats}");
    assert_eq!(p["session"]["hooks_live"], true, "{stats}");
    assert_eq!(p["session"]["cupti_attached"], false, "{stats}");
    // What possum does not serve: the managed memory, and a kernel on it.
    assert_unmanaged(
        &stats,
        json!({"cuMemAllocManaged": {"allocations": 1, "bytes": N * 4}}),
        1,
        1,
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `POSSUM_SERVE_POOLS=0` and `POSSUM_SERVE_VMM=0` the stream-ordered and VMM allocations
/// stay the driver's, and possum tracks them by kind (as it does managed memory always).
#[test]
fn allocations_left_to_the_driver_are_tracked_by_kind() {
    let Some(dir) = setup("unserved") else { return };
    let stats = run_checked(
        &dir,
        &[("POSSUM_SERVE_POOLS", "0"), ("POSSUM_SERVE_VMM", "0")],
    );
    assert_counts(&stats, true);
    assert_swapped_and_served_with(&stats, false);
    // The allocations the job kept to the end: one of each kind possum does not serve (the
    // other cuMemAllocAsync was freed, and forgotten); 4 allocations in all; the kernels on
    // them: the async one, the VMM one and the managed one.
    let kb = N * 4;
    assert_unmanaged(
        &stats,
        json!({
            "cuMemAllocAsync": {"allocations": 1, "bytes": kb},
            "cuMemMap": {"allocations": 1, "bytes": 2 << 20},
            "cuMemAllocManaged": {"allocations": 1, "bytes": kb},
        }),
        4,
        3,
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `POSSUM_HOOKS=off`: the wrappers call the driver and nothing else (nothing counted, nothing
/// tracked), and the job computes the same; lookups still get possum's wrappers, and
/// `cuMemAlloc_v2` is still served.
#[test]
fn with_the_hooks_off_nothing_is_counted_and_the_results_are_the_same() {
    let Some(dir) = setup("off") else { return };
    let stats = run_checked(&dir, &[("POSSUM_HOOKS", "off")]);
    assert_eq!(stats["hooks"], "off", "{stats}");
    assert_eq!(stats["entry"]["mode"], "off", "{stats}");
    assert_eq!(stats["entry"]["seen_beside_cupti"], json!({}), "{stats}");
    assert_counts(&stats, false);
    assert_swapped_and_served(&stats);
    let p = &stats["possum"];
    assert_eq!(p["counters"]["launches"], 0, "{stats}");
    assert_eq!(p["unmanaged"]["allocations"], 0, "{stats}");
    assert_eq!(p["session"]["hooks_live"], false, "{stats}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `POSSUM_HOOKS=cupti` (the fake CUPTI, which fires nothing here): CUPTI's callbacks would feed
/// the hooks; the wrappers count what they see beside it, by name, so a run tells whether CUPTI
/// and the wrappers saw the same calls.
#[test]
fn beside_cupti_the_wrappers_count_what_they_see() {
    let Some(dir) = setup("cupti") else { return };
    let cupti = dir.join("libfakecupti.so");
    let stats = run_checked(
        &dir,
        &[
            ("POSSUM_HOOKS", "cupti"),
            ("POSSUM_CUPTI", cupti.to_str().unwrap()),
            ("FAKE_CUPTI_NO_AUTOFIRE", "1"),
        ],
    );
    assert_eq!(stats["hooks"], "cupti", "{stats}");
    assert_eq!(stats["cupti"], true, "{stats}");
    assert_eq!(stats["entry"]["mode"], "cupti", "{stats}");
    // CUPTI fired no callback: the hooks counted nothing.
    assert_counts(&stats, false);
    assert_swapped_and_served(&stats);
    let want: serde_json::Map<String, Value> = CALLS
        .iter()
        .filter(|c| !SERVED.contains(&c.1))
        .map(|c| (c.1.to_string(), c.2.into()))
        .collect();
    assert_eq!(
        stats["entry"]["seen_beside_cupti"],
        Value::Object(want),
        "{stats}"
    );
    assert_eq!(stats["possum"]["session"]["hooks_live"], true, "{stats}");
    let _ = std::fs::remove_dir_all(&dir);
}
