//! `dlvsym` (a versioned lookup) on the driver's handle under `LD_PRELOAD`: for a driver function
//! possum wraps the job gets the wrapper, as with `dlsym`, so what it does through it is seen;
//! other names, `RTLD_DEFAULT` and possum's own lookups get glibc's answers
//! (`tests/fake/fake_dlvsym_job.c`, on the fake driver).

use std::path::{Path, PathBuf};

use serde_json::Value;

mod common;
use common::{
    build_fake_gpu_linked, cc, fake_job_command, fresh_dir, libpossum, read_json, stdout_of,
};

/// What the job prints, with possum or without.
const WANT: &str = "wrapped 1\npassed 1\ndefault 1\nvalue 7\n";

fn setup() -> Option<PathBuf> {
    let dir = fresh_dir("fakedlvsym");
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    if !build_fake_gpu_linked(
        here,
        &dir,
        "tests/fake/fake_dlvsym_job.c",
        "fake_dlvsym_job",
        &["-l:libcuda.so.1"],
    ) {
        return None;
    }
    // The fake driver again, its functions under a version node (FAKE_CUDA): a versioned lookup
    // (the job's dlvsym with that version) finds them.
    let map = dir.join("libcuda.map");
    std::fs::write(&map, "FAKE_CUDA { global: *; };\n").unwrap();
    let ok = cc(&[
        "-O1",
        "-shared",
        "-fPIC",
        "-Wl,-Bsymbolic",
        &format!("-Wl,--version-script={}", map.display()),
        "-o",
        dir.join("libcuda.so.1").to_str().unwrap(),
        here.join("../cuda/testdata/fake-libcuda.c")
            .to_str()
            .unwrap(),
    ]);
    assert!(ok, "building the versioned fake driver");
    Some(dir)
}

/// The job's stdout (it must exit 0), with libpossum preloaded when `possum`, and its
/// statistics then.
fn run(dir: &Path, possum: bool) -> (String, Option<Value>) {
    let stats = dir.join("stats.json");
    let _ = std::fs::remove_file(&stats);
    let lib = possum.then(libpossum);
    let mut cmd = fake_job_command(dir, "fake_dlvsym_job", lib.as_deref());
    cmd.env("POSSUM_STATS", &stats)
        .env("POSSUM_SOCKET_DIR", dir.join("sockets"));
    let text = stdout_of(&mut cmd);
    (text, possum.then(|| read_json(&stats)))
}

#[test]
fn dlvsym_on_the_drivers_handle_hands_out_the_wrapper() {
    let Some(dir) = setup() else { return };
    let (plain, _) = run(&dir, false);
    assert_eq!(plain, WANT, "the job does not do what the test thinks");
    let (out, stats) = run(&dir, true);
    assert_eq!(out, WANT, "under possum");
    let stats = stats.unwrap();
    // The memset through the function dlvsym returned was seen by possum's hooks.
    assert_eq!(stats["memsets"]["cuMemsetD32_v2"], 1, "{stats}");
    assert_eq!(stats["entry"]["swapped_dlsym"], 1, "{stats}");
    assert_eq!(stats["possum"]["counters"]["memsets"], 1, "{stats}");
    let _ = std::fs::remove_dir_all(&dir);
}
