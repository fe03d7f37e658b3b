//! A job's memory served by possum is reachable from every peer device, as the driver's
//! `cuMemAlloc` memory is once peer access is enabled: on the fake driver with two devices, a
//! `cuMemAlloc_v2` on either device and a piece of the job's own virtual memory (served by
//! possum: `vmm.rs`) are mapped with access for both devices; with one device, for it alone
//! (`fake_access_mask` of the fake driver, bit d: device d). A checkpoint that releases the
//! memory and the restore after it map it again with the same access.

use std::io::Write;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use possum_control::{request, Request};

mod common;
use common::{fake_gpu_dir, fake_job_command, libpossum, lines_of, stdout_of, Killed};

/// Bound on every wait for something that should happen: generous, as only a bug makes it expire.
const WAIT: Duration = Duration::from_secs(10);

/// The job's report with two devices (see `fake_peer_job.c`) when every mapping is reachable
/// from both.
const BOTH: [&str; 3] = ["alloc on 0 mask 3", "alloc on 1 mask 3", "piece mask 3"];

/// The job's output with `devices` fake devices, with possum preloaded or without.
fn run(dir: &Path, devices: usize, possum: bool) -> String {
    let lib = libpossum();
    let mut cmd = fake_job_command(dir, "fake_peer_job", possum.then_some(lib.as_path()));
    cmd.env("FAKE_CUDA_DEVICES", devices.to_string())
        .env("POSSUM_CUPTI", dir.join("libfakecupti.so"))
        .env("FAKE_CUPTI_NO_AUTOFIRE", "1")
        .env("POSSUM_SOCKET_DIR", dir.join("sockets"));
    stdout_of(&mut cmd)
}

#[test]
fn served_memory_is_reachable_from_every_peer_device() {
    let Some(dir) = fake_gpu_dir("fake-peer", "fake_peer_job") else {
        return;
    };
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

#[test]
fn restored_memory_is_reachable_from_every_peer_device() {
    let Some(dir) = fake_gpu_dir("fake-peer-restore", "fake_peer_job") else {
        return;
    };
    let lib = libpossum();
    let sockets = dir.join("sockets");
    let images = dir.join("images").to_str().unwrap().to_string();
    let mut cmd = fake_job_command(&dir, "fake_peer_job", Some(&lib));
    cmd.env("FAKE_CUDA_DEVICES", "2")
        .env("POSSUM_CUPTI", dir.join("libfakecupti.so"))
        .env("FAKE_CUPTI_NO_AUTOFIRE", "1")
        .env("POSSUM_SOCKET_DIR", &sockets)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut child = Killed(cmd.spawn().unwrap());
    let mut stdin = child.0.stdin.take().unwrap();
    let lines = lines_of(child.0.stdout.take().unwrap());
    let report = |when: &str| {
        for want in BOTH {
            let line = lines
                .recv_timeout(WAIT)
                .unwrap_or_else(|e| panic!("{when}: no {want:?} from the job ({e:?})"));
            assert_eq!(line, want, "{when}");
        }
    };
    report("mapped");

    let ask = |req: &Request| {
        request(child.0.id(), &sockets, req, WAIT).unwrap_or_else(|e| panic!("{req:?}: {e}"))
    };
    ask(&Request::Checkpoint {
        dir: images.clone(),
        parent: None,
    });
    let r = ask(&Request::Release);
    assert_eq!(r["devices"], serde_json::json!([0, 1]), "{r}");
    // Two buffers and the piece, unmapped: the restore maps them again.
    assert_eq!(r["released_bytes"], 3 * (2 << 20), "{r}");
    let r = ask(&Request::Resume {
        dir: Some(images.clone()),
    });
    assert_eq!(r["restoring"], serde_json::json!([0, 1]), "{r}");
    // Every buffer restored (on demand or by the prefetcher): each engine idle again.
    let t = Instant::now();
    loop {
        let v = ask(&Request::Status);
        let engines = v["possum"]["engines"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let restored = v["possum"]["session"]["last"]["restore"].is_object();
        if restored && engines.len() == 2 && engines.iter().all(|e| e["engine"]["phase"] == "idle")
        {
            break;
        }
        assert!(t.elapsed() < WAIT, "restore not done: {v}");
        std::thread::sleep(Duration::from_millis(5));
    }
    writeln!(stdin, "again").unwrap();
    stdin.flush().unwrap();
    report("restored");
    drop(stdin);
    assert_eq!(lines.recv_timeout(WAIT).as_deref(), Ok("done"));
    assert!(child.0.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}
