//! NCCL reached from a library loaded into a local scope, as PyTorch reaches it: Python loads
//! libtorch_cuda.so with `dlopen(RTLD_LOCAL)`, and libnccl.so.2, which it links, comes with it
//! into that scope, outside the global one. The library's calls of NCCL's communicator functions
//! bind to libpossum.so's exports (the preloaded library is in the global scope, searched first),
//! whose wrappers must then find NCCL's own functions there too; `dlsym(RTLD_NEXT)` alone does
//! not, and every NCCL init failed with `ncclInternalError`. On the fake GPU with the stand-in
//! NCCL (`tests/fake/fake_nccl.c`) and `tests/fake/fake_nccl_local_{lib,job}.c`.

use std::path::{Path, PathBuf};

mod common;
use common::{build_fake_gpu, cc, fake_job_command, fresh_dir, libpossum, read_json};

/// What the job prints, with possum or without: the buffer made, the communicator joined, of 1
/// rank.
const WANT: &str = "malloc 0 init 0 count 1\n";

fn setup() -> Option<PathBuf> {
    let dir = fresh_dir("ncclocal");
    if !build_fake_gpu(
        &dir,
        "tests/fake/fake_nccl_local_job.c",
        "fake_nccl_local_job",
    ) {
        return None;
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let d = dir.to_str().unwrap();
    let src = |p: &str| here.join(p).to_str().unwrap().to_string();
    let ok = cc(&[
        "-O1",
        "-shared",
        "-fPIC",
        "-Wl,-soname,libnccl.so.2",
        "-o",
        &format!("{d}/libnccl.so.2"),
        &src("tests/fake/fake_nccl.c"),
    ]) && cc(&[
        "-O1",
        "-shared",
        "-fPIC",
        "-o",
        &format!("{d}/libfaketorch.so"),
        &src("tests/fake/fake_nccl_local_lib.c"),
        &format!("-L{d}"),
        "-l:libnccl.so.2",
        "-l:libcudart.so.13",
        &format!("-Wl,-rpath,{d}"),
    ]);
    assert!(
        ok,
        "building the stand-in NCCL and the library that links it"
    );
    Some(dir)
}

/// Runs `cmd`, which must print [`WANT`] (`why` says what it means if not) and exit 0.
fn run_wanted(cmd: &mut std::process::Command, why: &str) {
    let out = cmd.output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        WANT,
        "{why}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn nccl_linked_by_a_library_in_a_local_scope_initialises_under_possum() {
    let Some(dir) = setup() else { return };
    run_wanted(
        &mut fake_job_command(&dir, "fake_nccl_local_job", None),
        "the job does not do what the test thinks",
    );

    let stats = dir.join("stats.json");
    run_wanted(
        fake_job_command(&dir, "fake_nccl_local_job", Some(&libpossum()))
            .env("POSSUM_STATS", &stats)
            .env("POSSUM_SOCKET_DIR", dir.join("sockets")),
        "under possum (init 3 is ncclInternalError: the wrapper found no NCCL)",
    );
    // possum noted the communicator its wrapper let through: one, of one rank, held here.
    let v = read_json(&stats);
    let comms = &v["possum"]["session"]["collectives"]["communicators"];
    assert_eq!(comms.as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(comms[0]["nranks"], 1, "{v}");
    assert_eq!(comms[0]["ranks_here"], 1, "{v}");
}
