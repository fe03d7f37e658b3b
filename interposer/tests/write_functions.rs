//! Every CUDA 13.0 driver function whose name says it may write device memory (copies, memsets,
//! launches, stream memory operations, graph launches and node changes, mappings, frees, imports,
//! ...) is either wrapped by libpossum (`entry::ENTRIES`: held at the op gate during a
//! checkpoint's pause and its destination marked written) or listed in [`NOT_WRAPPED`] with the
//! reason it needs no wrapper (both in `src/cuda/writers.rs`, which the library also asks about the
//! functions `cuGetProcAddress` hands out). A driver function that appears unclassified fails
//! the test, which prints the list.
//!
//! The driver's functions are `tests/data/cuda13-driver-functions.txt`, made from cudarc 0.19.10's
//! bindings of cuda.h for CUDA 13.0 (`src/driver/sys/mod.rs`); where cargo's registry holds that
//! file, the list is checked against it.

use std::collections::BTreeSet;
use std::path::PathBuf;

use possum::entry::ENTRIES;
use possum::writers::{writes, NOT_WRAPPED};

fn data_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/cuda13-driver-functions.txt")
}

/// The driver's functions, from the checked-in list.
fn driver_functions() -> BTreeSet<String> {
    std::fs::read_to_string(data_file())
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(str::to_string)
        .collect()
}

fn wrapped() -> BTreeSet<&'static str> {
    ENTRIES.iter().map(|e| e.name()).collect()
}

#[test]
fn every_writing_driver_function_is_wrapped_or_says_why_not() {
    let wrapped = wrapped();
    let driver = driver_functions();
    assert!(driver.len() > 400, "{} functions", driver.len());
    let reasons: BTreeSet<&str> = NOT_WRAPPED.iter().map(|x| x.0).collect();
    assert_eq!(
        reasons.len(),
        NOT_WRAPPED.len(),
        "a name twice in NOT_WRAPPED"
    );
    let writing: Vec<&String> = driver.iter().filter(|n| writes(n)).collect();
    let unclassified: Vec<&&String> = writing
        .iter()
        .filter(|n| !wrapped.contains(n.as_str()) && !reasons.contains(n.as_str()))
        .collect();
    let mut table = String::new();
    for n in &writing {
        let why = if wrapped.contains(n.as_str()) {
            "wrapped"
        } else {
            NOT_WRAPPED
                .iter()
                .find(|x| x.0 == n.as_str())
                .map_or("UNCLASSIFIED", |x| x.1)
        };
        table.push_str(&format!("  {n}: {why}\n"));
    }
    println!("{} writing functions:\n{table}", writing.len());
    assert!(
        unclassified.is_empty(),
        "driver functions that may write device memory, neither wrapped nor listed in NOT_WRAPPED \
         with a reason: {unclassified:?}\n{table}"
    );
    // No stale entry: each reason is for a writing driver function possum does not wrap.
    for (n, _) in NOT_WRAPPED {
        assert!(driver.contains(*n), "{n}: not a CUDA 13.0 driver function");
        assert!(
            writes(n),
            "{n}: not a writing name (drop it from NOT_WRAPPED)"
        );
        assert!(
            !wrapped.contains(n),
            "{n}: wrapped, yet listed in NOT_WRAPPED"
        );
    }
    // The functions this test is about are among them.
    for n in [
        "cuMemcpyPeer",
        "cuMemcpyPeerAsync",
        "cuMemcpy3DPeer",
        "cuMemcpy3DPeerAsync",
        "cuMemcpyAtoD_v2",
        "cuMemcpy3DBatchAsync_v2",
        "cuMemsetD2D8_v2",
        "cuMemsetD2D32Async",
        "cuStreamWriteValue32_v2",
        "cuStreamWriteValue64_v2",
        "cuStreamBatchMemOp_v2",
        "cuLaunch",
        "cuLaunchGrid",
        "cuLaunchGridAsync",
        "cuLaunchCooperativeKernelMultiDevice",
        "cuGraphExecMemsetNodeSetParams",
    ] {
        assert!(
            writing.iter().any(|w| w.as_str() == n),
            "{n} not classified"
        );
        assert!(wrapped.contains(n), "{n} not wrapped");
    }
}

/// Each wrapped function's per-thread-stream variants that the driver exports are wrapped too.
#[test]
fn wrapped_functions_have_their_per_thread_variants() {
    let wrapped = wrapped();
    for n in &wrapped {
        let base = n.trim_end_matches("_ptsz").trim_end_matches("_ptds");
        assert!(
            wrapped.contains(base),
            "{n} wrapped without its base function {base}"
        );
    }
    for n in [
        "cuMemcpyPeer_ptds",
        "cuMemcpy3DPeer_ptds",
        "cuMemcpy3DPeerAsync_ptsz",
        "cuMemsetD2D16_v2_ptds",
        "cuMemsetD2D8Async_ptsz",
        "cuStreamWriteValue32_v2_ptsz",
        "cuStreamBatchMemOp_v2_ptsz",
    ] {
        assert!(wrapped.contains(n), "{n}");
    }
}

/// The checked-in list is cudarc's CUDA 13.0 bindings' functions (checked where the registry
/// holds cudarc 0.19.10's sources).
#[test]
fn the_list_is_cudarcs_cuda_13_0_bindings() {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    let Some(src) = home
        .map(|h| h.join("registry/src"))
        .and_then(|d| std::fs::read_dir(d).ok())
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("cudarc-0.19.10/src/driver/sys/mod.rs"))
        .find(|p| p.exists())
    else {
        eprintln!("cudarc 0.19.10's sources not in the registry: list not checked");
        return;
    };
    let text = std::fs::read_to_string(src).unwrap();
    let mut names = BTreeSet::new();
    let mut prev = "";
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("pub unsafe fn cu") {
            let name = format!("cu{}", rest.split('(').next().unwrap());
            if !prev.starts_with("#[cfg") || prev.contains("\"cuda-13000\"") {
                names.insert(name);
            }
        }
        prev = line;
    }
    assert_eq!(
        names,
        driver_functions(),
        "regenerate {}",
        data_file().display()
    );
}
