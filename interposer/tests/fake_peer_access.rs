//! A job's memory served by possum is reachable from every peer device, as the driver's
//! `cuMemAlloc` memory is once peer access is enabled: on the fake driver with two devices, a
//! `cuMemAlloc_v2` on either device and a piece of the job's own virtual memory (served by
//! possum: `vmm.rs`) are mapped with access for both devices; with one device, for it alone
//! (`fake_access_mask` of the fake driver, bit d: device d).

use std::path::Path;

mod common;
use common::{build_fake_gpu, fake_job_command, libpossum};

/// The job's output with `devices` fake devices, with possum preloaded or without.
fn run(dir: &Path, devices: usize, possum: bool) -> String {
    let lib = libpossum();
    let mut cmd = fake_job_command(dir, "fake_peer_job", possum.then_some(lib.as_path()));
    cmd.env("FAKE_CUDA_DEVICES", devices.to_string())
        .env("POSSUM_CUPTI", dir.join("libfakecupti.so"))
        .env("FAKE_CUPTI_NO_AUTOFIRE", "1")
        .env("POSSUM_SOCKET_DIR", dir.join("sockets"));
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn served_memory_is_reachable_from_every_peer_device() {
    let dir = std::env::temp_dir().join(format!("possum-fake-peer-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    if !build_fake_gpu(&dir, "tests/fake/fake_peer_job.c", "fake_peer_job") {
        return;
    }
    // Without possum: the driver's cuMemAlloc memory is no mapping of the fake's (mask 0), and
    // the piece has the access the job gave it (device 0).
    assert_eq!(
        run(&dir, 2, false),
        "alloc on 0 mask 0\nalloc on 1 mask 0\npiece mask 1\ndone\n"
    );
    // Under possum, every mapping is reachable from both devices; the job's own cuMemSetAccess
    // (device 0) takes nothing away.
    assert_eq!(
        run(&dir, 2, true),
        "alloc on 0 mask 3\nalloc on 1 mask 3\npiece mask 3\ndone\n"
    );
    assert_eq!(
        run(&dir, 1, true),
        "alloc on 0 mask 1\npiece mask 1\ndone\n"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
