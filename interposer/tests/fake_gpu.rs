//! libpossum.so end to end on a fake GPU: the fake driver (`cuda/testdata/fake-libcuda.c`, device
//! memory in host memory), a fake libcudart and a fake CUPTI whose callbacks a test job fires
//! around host code that does what its "kernels" would (`tests/fake/fake_job.c`). No GPU needed;
//! it checks possum's logic (allocations served by the engine, launches resolved, validation,
//! the DAG, the statistics), not CUDA's.

use std::process::Command;

mod common;
use common::{build_fake_gpu, libpossum};

#[test]
fn a_job_on_a_fake_gpu() {
    let dir = std::env::temp_dir().join(format!("possum-fakegpu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    if !build_fake_gpu(&dir, "tests/fake/fake_job.c", "fake_job") {
        return;
    }
    let stats = dir.join("stats.json");
    let trace = dir.join("trace.json");
    let mut cmd = Command::new(dir.join("fake_job"));
    for v in [
        "POSSUM_STATS",
        "POSSUM_TRACE",
        "POSSUM_VALIDATE",
        "POSSUM_MANAGE",
        "POSSUM_DAG",
        "LD_PRELOAD",
    ] {
        cmd.env_remove(v);
    }
    let out = cmd
        .env("LD_PRELOAD", libpossum())
        .env("LD_LIBRARY_PATH", &dir)
        .env("POSSUM_CUPTI", dir.join("libfakecupti.so"))
        .env("FAKE_CUPTI_NO_AUTOFIRE", "1")
        .env("POSSUM_STATS", &stats)
        .env("POSSUM_TRACE", &trace)
        .env("POSSUM_SOCKET_DIR", dir.join("sockets"))
        .env("POSSUM_VERBOSE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n", "{stderr}");
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("device 0: allocations are served by the engine"),
        "{stderr}"
    );
    assert!(
        stderr.contains("kernel bump_table is opaque from now on"),
        "{stderr}"
    );

    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
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

    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let kernel = |name: &str| {
        t["kernels"]
            .as_array()
            .unwrap()
            .iter()
            .find(|k| k["name"] == name)
            .unwrap_or_else(|| panic!("{name} not in {t}"))
            .clone()
    };
    // axpy's x (slot 0) was unchanged by both validated launches: speculated read-only; y not.
    let axpy = kernel("axpy");
    assert_eq!(axpy["launches"], 3);
    assert_eq!(axpy["validated"], 2);
    assert_eq!(axpy["readonly_slots"], 1, "{axpy}");
    assert_eq!(axpy["opaque"], false);
    // scale's pointers live inside a by-value struct: 3 words, 2 of them pointers, not opaque.
    let scale = kernel("scale");
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
