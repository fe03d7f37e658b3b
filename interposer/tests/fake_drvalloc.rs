//! Driver-API allocations served by the engine (`src/drvalloc.rs`), on the fake driver and CUPTI:
//! `cuMemAlloc_v2`, `cuMemAllocPitch_v2` and `cuMemFree_v2` called through the global scope (a
//! program linked against libcuda) and `cuMemAlloc` looked up with `cuGetProcAddress_v2` (as
//! libcudart does). With possum managing allocations they are engine buffers; with
//! `POSSUM_MANAGE=0` they are the driver's, and the lookup is left alone.

use std::path::Path;

mod common;
use common::{build_fake_gpu, fake_job_command, libpossum, read_json};

fn run(dir: &Path, manage: bool) -> (String, serde_json::Value) {
    let stats = dir.join(format!("stats-{manage}.json"));
    let lib = libpossum();
    let mut cmd = fake_job_command(dir, "fake_drvalloc_job", Some(&lib));
    cmd.env("POSSUM_CUPTI", dir.join("libfakecupti.so"))
        .env("FAKE_CUPTI_NO_AUTOFIRE", "1")
        .env("POSSUM_SOCKET_DIR", dir.join("sockets"))
        .env("POSSUM_STATS", &stats);
    if !manage {
        cmd.env("POSSUM_MANAGE", "0");
    }
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (text, read_json(&stats))
}

#[test]
fn driver_allocations_are_engine_buffers_both_ways_in() {
    let dir = std::env::temp_dir().join(format!("possum-drvalloc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    if !build_fake_gpu(&dir, "tests/fake/fake_drvalloc_job.c", "fake_drvalloc_job") {
        return;
    }

    let (out, stats) = run(&dir, true);
    // Rows of 1000 bytes padded to 1024 (possum's 512-byte pitch alignment; the fake driver's
    // own would be 1024 too, so the counters below tell who served it).
    assert!(out.contains("pitch 1024\n"), "{out}");
    assert!(
        out.contains("swapped 1\n"),
        "the lookup kept the driver's pointer: {out}"
    );
    assert!(
        out.contains("distinct 1\n") && out.contains("done\n"),
        "{out}"
    );
    let c = &stats["possum"]["counters"];
    assert_eq!(c["managed_allocs"], 3, "{stats}");
    assert_eq!(c["managed_frees"], 3, "{stats}");
    assert_eq!(c["entry_points_swapped"], 1, "{stats}");
    assert_eq!(stats["entry_points"]["cuGetProcAddress_v2"], 1, "{stats}");
    assert_eq!(
        stats["possum"]["engines"][0]["engine"]["buffers"], 0,
        "{stats}"
    );

    let (out, stats) = run(&dir, false);
    assert!(out.contains("swapped 0\n"), "{out}");
    assert!(
        out.contains("distinct 1\n") && out.contains("done\n"),
        "{out}"
    );
    let managed = &stats["possum"]["counters"]["managed_allocs"];
    assert!(managed.is_null() || *managed == 0, "{stats}");
    let _ = std::fs::remove_dir_all(&dir);
}
