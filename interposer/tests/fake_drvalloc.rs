//! Driver-API allocations served by the engine (`src/cuda/drvalloc.rs`), on the fake driver:
//! `cuMemAlloc_v2`, `cuMemAllocPitch_v2` and `cuMemFree_v2` called through the global scope (a
//! program linked against libcuda) and `cuMemAlloc`/`cuMemFree` looked up with
//! `cuGetProcAddress_v2` (as libcudart does: possum's wrapper of the lookup swaps the driver's
//! answer for possum's function, whatever `POSSUM_HOOKS` says). With possum managing allocations
//! they are engine buffers; with `POSSUM_MANAGE=0` they are the driver's (the lookup still hands
//! out possum's wrappers, which pass the calls on).

use std::path::Path;

mod common;
use common::{fake_gpu_dir, fake_job_command, libpossum, read_json, stdout_of};

/// The job's output without possum, and with it (`hooks`: `POSSUM_HOOKS`; `manage`: whether
/// possum serves allocations), with its statistics.
fn run(dir: &Path, hooks: Option<&str>, manage: bool) -> (String, serde_json::Value) {
    let stats = dir.join(format!("stats-{hooks:?}-{manage}.json"));
    let lib = libpossum();
    let mut cmd = fake_job_command(dir, "fake_drvalloc_job", Some(&lib));
    cmd.env("POSSUM_CUPTI", dir.join("libfakecupti.so"))
        .env("FAKE_CUPTI_NO_AUTOFIRE", "1")
        .env("POSSUM_SOCKET_DIR", dir.join("sockets"))
        .env("POSSUM_STATS", &stats);
    if let Some(h) = hooks {
        cmd.env("POSSUM_HOOKS", h);
    }
    if !manage {
        cmd.env("POSSUM_MANAGE", "0");
    }
    let text = stdout_of(&mut cmd);
    (text, read_json(&stats))
}

#[test]
fn driver_allocations_are_engine_buffers_both_ways_in() {
    let Some(dir) = fake_gpu_dir("drvalloc", "fake_drvalloc_job") else {
        return;
    };
    let plain = fake_job_command(&dir, "fake_drvalloc_job", None)
        .output()
        .unwrap();
    let plain = String::from_utf8_lossy(&plain.stdout).into_owned();
    // Rows of 1000 bytes padded to 1024 (possum's 512-byte pitch alignment; the fake driver's
    // own is 1024 too, so the counters below tell who served it). The lookups give the functions
    // of the global scope: the driver's own without possum.
    assert_eq!(plain, "pitch 1024\nswapped 1\ndistinct 1\ndone\n");

    for hooks in [None, Some("cupti"), Some("off")] {
        let (out, stats) = run(&dir, hooks, true);
        assert_eq!(
            out, plain,
            "POSSUM_HOOKS={hooks:?}: the lookup kept the driver's pointer?"
        );
        let c = &stats["possum"]["counters"];
        assert_eq!(c["managed_allocs"], 3, "{hooks:?}: {stats}");
        assert_eq!(c["managed_frees"], 3, "{hooks:?}: {stats}");
        let e = &stats["entry"];
        // cuGetProcAddress_v2 itself (dlsym on the driver's handle), then both lookups.
        assert_eq!(e["swapped_dlsym"], 1, "{hooks:?}: {stats}");
        assert_eq!(e["swapped_proc_address"], 2, "{hooks:?}: {stats}");
        assert_eq!(e["unmatched"], serde_json::json!([]), "{hooks:?}: {stats}");
        // Counted by the hooks in the wrappers by default, by the wrappers beside CUPTI with
        // POSSUM_HOOKS=cupti (the fake CUPTI fires nothing here), not at all when off.
        let (lookups, beside) = match hooks {
            None => (2, 0),
            Some("cupti") => (0, 2),
            _ => (0, 0),
        };
        assert_eq!(
            stats["entry_points"]["cuGetProcAddress_v2"], lookups,
            "{hooks:?}: {stats}"
        );
        assert_eq!(
            e["seen_beside_cupti"]["cuGetProcAddress_v2"]
                .as_u64()
                .unwrap_or(0),
            beside,
            "{hooks:?}: {stats}"
        );
        assert_eq!(
            stats["possum"]["engines"][0]["engine"]["buffers"], 0,
            "{hooks:?}: {stats}"
        );
    }

    let (out, stats) = run(&dir, None, false);
    assert_eq!(out, plain);
    let managed = &stats["possum"]["counters"]["managed_allocs"];
    assert!(managed.is_null() || *managed == 0, "{stats}");
    // The driver's allocations, seen by the wrappers' hooks (and forgotten when freed).
    assert_eq!(stats["allocs"]["cuMemAlloc_v2"], 2, "{stats}");
    assert_eq!(stats["allocs"]["cuMemAllocPitch_v2"], 1, "{stats}");
    assert_eq!(stats["allocs"]["cuMemFree_v2"], 3, "{stats}");
    assert_eq!(stats["entry"]["swapped_proc_address"], 2, "{stats}");
    let _ = std::fs::remove_dir_all(&dir);
}
