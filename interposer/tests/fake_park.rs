//! A checkpoint of a job whose GPU work possum does not see (`POSSUM_HOOKS=off`), on the fake
//! GPU: the release must park every thread of the job (`tests/fake/fake_park_job.c`: a worker
//! computing steps in device memory, the main thread reading commands), copy every buffer, and
//! release them; the resume must bring them back and let the threads go on. A worker left running
//! would touch the released (unmapped) buffers and crash the job; a worker parked at the wrong
//! moment would give data that differs from the model. The watchdog is tested with a thread
//! holding the fake driver's internal lock while parked.

use std::path::{Path, PathBuf};
use std::time::Duration;

use possum_control::{request, Request};

mod common;
use common::park_job::{ParkJob, N, WAIT};
use common::{fake_gpu_dir, libpossum};

/// The park job with this build's libpossum.so and `env`, started in a fresh directory: the
/// directory and the job; `None` (the test skips) without a C compiler.
fn setup(name: &str, env: &[(&str, &str)]) -> Option<(PathBuf, ParkJob)> {
    let dir = fake_gpu_dir(&format!("park-{name}"), "fake_park_job")?;
    let job = ParkJob::start(&dir, name, &libpossum(), env);
    Some((dir, job))
}

/// `Release` of `job`, which must succeed.
fn release(job: &ParkJob) -> serde_json::Value {
    let r = job.ask(&Request::Release);
    assert!(r.get("error").is_none(), "{r}");
    r
}

/// `Checkpoint` of `job` into `images`.
fn checkpoint(job: &ParkJob, images: &Path) -> serde_json::Value {
    job.ask(&Request::Checkpoint {
        dir: dir_str(images),
        parent: None,
    })
}

/// [`setup`] with `var=value` set, 5 steps, a thread that blocks every signal (`masked`), then a
/// checkpoint into `images` in the directory: the directory, the job and the images.
fn masked_then_checkpoint(
    name: &str,
    var: &str,
    value: &str,
) -> Option<(PathBuf, ParkJob, PathBuf)> {
    let (dir, mut job) = setup(name, &[(var, value)])?;
    job.steps(5);
    assert_eq!(job.run("masked"), "masking");
    let images = dir.join("images");
    checkpoint(&job, &images);
    Some((dir, job, images))
}

fn dir_str(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// The held job makes no progress (step lines already in the pipe were printed before the hold);
/// then the resume from `images`, more steps, and the final buffers against the model.
fn still_then_resume(job: &mut ParkJob, dir: &Path, images: &Path) {
    job.drain();
    job.assert_still(Duration::from_millis(300));
    job.ask(&Request::Resume {
        dir: Some(dir_str(images)),
    });
    job.steps(10);
    job.check_final(dir);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_job_without_cupti_is_held_by_parking_its_threads() {
    let Some((dir, mut job)) = setup("hold", &[]) else {
        return;
    };
    job.steps(20);
    let st = job.ask(&Request::Status);
    assert_eq!(st["possum"]["session"]["cupti_attached"], false, "{st}");
    assert_eq!(st["possum"]["session"]["hooks_live"], false, "{st}");
    assert_eq!(st["hooks"], "off", "{st}");
    assert_eq!(st["possum"]["engines"][0]["engine"]["buffers"], 2, "{st}");

    let images = dir.join("images");
    let r = checkpoint(&job, &images);
    assert_eq!(r["hooks"], false, "{r}");
    job.steps(5);
    let r = release(&job);
    assert_eq!(r["held"], "threads parked", "{r}");
    // The main thread (in fgets) and the worker; not possum's threads, not the test's.
    assert_eq!(r["parked"]["threads"], 2, "{r}");
    assert_eq!(r["final"][0]["buffers"], 2, "{r}");
    assert_eq!(r["final"][0]["bytes"], 2 * 4 * N as u64, "{r}");
    assert!(
        r["released_bytes"].as_u64().unwrap() >= 2 * 4 * N as u64,
        "{r}"
    );
    assert_eq!(r["attempts"], serde_json::json!([]), "{r}");
    assert!(images.join("gpu-0").join("manifest.pb").is_file());
    // Step lines already in the pipe were printed before the hold.
    job.drain();
    job.assert_still(Duration::from_millis(400));
    let st = job.ask(&Request::Status);
    assert_eq!(st["possum"]["session"]["paused"], true, "{st}");
    assert_eq!(st["possum"]["session"]["threads_parked"], 2, "{st}");
    assert_eq!(
        st["possum"]["engines"][0]["engine"]["phase"], "released",
        "{st}"
    );

    let r = job.ask(&Request::Resume {
        dir: Some(dir_str(&images)),
    });
    assert_eq!(r["restoring"], serde_json::json!([0]), "{r}");
    assert_eq!(r["on_demand"], false, "{r}");
    let st = job.ask(&Request::Status);
    assert_eq!(st["possum"]["session"]["paused"], false, "{st}");
    job.steps(20);
    job.check_final(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_watchdog_ends_a_hold_that_blocks_the_copy_and_the_next_attempt_succeeds() {
    let Some((dir, mut job)) = setup("watchdog", &[("POSSUM_PARK_WATCHDOG_MS", "200")]) else {
        return;
    };
    job.steps(5);
    let images = dir.join("images");
    checkpoint(&job, &images);
    // A thread holds the driver's lock (for 600 ms) and is parked with it: the first attempt's
    // device synchronisation waits for that lock until the watchdog ends the hold.
    assert_eq!(job.run("hold 600"), "holding");
    let r = release(&job);
    let attempts = r["attempts"].as_array().cloned().unwrap_or_default();
    assert!(
        !attempts.is_empty(),
        "no attempt was ended by the watchdog: {r}"
    );
    assert!(
        attempts.iter().all(|a| a["ended_by_watchdog"] == true),
        "{r}"
    );
    assert_eq!(r["final"][0]["bytes"], 2 * 4 * N as u64, "{r}");
    // The committed image is the last attempt's, and the job is held again.
    still_then_resume(&mut job, &dir, &images);
}

#[test]
fn a_thread_that_cannot_be_parked_fails_the_release_and_the_job_runs_on() {
    // A thread that blocks every signal cannot be parked.
    let Some((dir, mut job, images)) =
        masked_then_checkpoint("refuse", "POSSUM_PARK_TIMEOUT_MS", "300")
    else {
        return;
    };
    let e = request(job.pid, &job.sockets, &Request::Release, WAIT).unwrap_err();
    assert!(
        e.to_string().contains("block the parking signal")
            && e.to_string().contains("(masked)")
            && e.to_string().contains("POSSUM_PARK_SKIP"),
        "{e}"
    );
    // Nothing released, nothing held, no image: the job goes on.
    let st = job.ask(&Request::Status);
    assert_eq!(st["possum"]["session"]["paused"], false, "{st}");
    assert_eq!(
        st["possum"]["engines"][0]["engine"]["phase"], "idle",
        "{st}"
    );
    assert!(!images.join("gpu-0").exists());
    job.steps(10);
    job.check_final(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_thread_named_in_possum_park_skip_is_left_running() {
    let Some((dir, mut job, images)) = masked_then_checkpoint("skip", "POSSUM_PARK_SKIP", "mask")
    else {
        return;
    };
    let r = release(&job);
    // The main thread and the worker; the masked thread runs on.
    assert_eq!(r["parked"]["threads"], 2, "{r}");
    still_then_resume(&mut job, &dir, &images);
}
