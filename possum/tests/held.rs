//! `possum checkpoint --gpu-only` of a job without CUPTI (held by parking its threads), through
//! the real CLI, the real libpossum.so and the fake GPU stack of the interposer's tests: the
//! checkpoint completes and the job goes on with exactly the data it would have had; and killing
//! `possum checkpoint` at any moment leaves the job running (the guard resumes it if it was held)
//! and no partial image under DIR's name.

use std::io::Write;
use std::path::Path;
use std::process::Command;

#[path = "support/cli.rs"]
#[allow(dead_code)]
mod cli;
#[path = "../../interposer/tests/common/mod.rs"]
#[allow(dead_code)]
mod common;
use cli::checkpoint_killed_after;
use common::park_job::ParkJob;

fn checkpoint(job: &ParkJob, img: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_possum"));
    c.args([
        "checkpoint",
        &job.pid.to_string(),
        "--gpu-only",
        "--json",
        "-D",
    ])
    .arg(img)
    .arg("--socket-dir")
    .arg(&job.sockets);
    c
}

#[test]
fn a_held_job_is_checkpointed_and_survives_possum_being_killed_at_any_moment() {
    let Some(lib) = common::find_libpossum() else {
        // Past the harness's capture, so the skip shows.
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: libpossum.so not built (cargo test --workspace builds it)"
        );
        return;
    };
    let dir = std::env::temp_dir().join(format!("possum-held-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let interposer = Path::new(env!("CARGO_MANIFEST_DIR")).join("../interposer");
    if !common::build_fake_gpu_from(
        &interposer,
        &dir,
        "tests/fake/fake_park_job.c",
        "fake_park_job",
    ) {
        return;
    }
    let mut job = ParkJob::start(&dir, "job", &lib, &[]);
    assert!(job.progresses(10));

    // A whole checkpoint: the image is named, the figures say how the job was held.
    let img = dir.join("img");
    let out = checkpoint(&job, &img).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    assert!(
        v["hold"]
            .as_str()
            .unwrap_or("")
            .starts_with("threads parked"),
        "{v}"
    );
    assert_eq!(v["release_report"]["parked"]["threads"], 2, "{v}");
    assert!(img.join("possum.json").is_file() && img.join("gpu/gpu-0").is_dir());
    assert!(
        job.progresses(10),
        "the job did not go on after the checkpoint"
    );

    // possum killed at various moments: the job always goes on, and DIR is either absent or a
    // complete image.
    for (i, delay_ms) in [0u64, 2, 5, 10, 14, 18, 22, 26, 30, 40, 60]
        .into_iter()
        .enumerate()
    {
        let img = dir.join(format!("img-{i}"));
        let imaged = checkpoint_killed_after(&mut checkpoint(&job, &img), &img, delay_ms);
        assert!(
            job.progresses(20),
            "killed after {delay_ms} ms: the job stays held"
        );
        eprintln!(
            "killed after {delay_ms} ms: {}",
            if imaged { "image complete" } else { "no image" }
        );
    }
    // Whatever happened, the data is exactly what the job computed.
    job.check_final(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}
