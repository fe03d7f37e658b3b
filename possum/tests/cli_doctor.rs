//! `possum doctor` end to end: one line per check, and exit code 1 when a checkpoint cannot work.

use std::path::Path;
use std::process::{Command, Output};

#[path = "support/cli.rs"]
#[allow(dead_code)]
mod cli;
use cli::fake_libcuda_or_skip;

fn doctor(envs: &[(&str, &Path)], json: bool) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_possum"));
    cmd.arg("doctor");
    if json {
        cmd.arg("--json");
    }
    // No device for the driver, on any machine.
    cmd.env("CUDA_VISIBLE_DEVICES", "");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The line of check `name`: its verdict and detail.
fn line<'a>(out: &'a str, name: &str) -> (&'a str, &'a str) {
    let l = out
        .lines()
        .find(|l| l.starts_with(&format!("{name:<20} ")))
        .unwrap_or_else(|| panic!("no `{name}` line in:\n{out}"));
    let rest = l[20..].trim_start();
    let (verdict, why) = rest.split_once(' ').unwrap_or((rest, ""));
    (verdict, why.trim())
}

#[test]
fn without_a_gpu_or_driver_doctor_fails_and_says_why() {
    let out = doctor(
        &[("POSSUM_LIBCUDA", Path::new("/nonexistent/libcuda.so.1"))],
        false,
    );
    let s = text(&out);
    assert_eq!(out.status.code(), Some(1), "{s}");
    let (verdict, why) = line(&s, "gpu");
    assert_eq!(verdict, "FAIL", "{s}");
    assert!(why.contains("no GPU"), "{s}");
    let (verdict, why) = line(&s, "driver checkpoint");
    assert_eq!(verdict, "FAIL", "{s}");
    assert!(why.contains("/nonexistent/libcuda.so.1"), "{s}");
    for name in [
        "privileges",
        "criu",
        "criu check",
        "kernel",
        "checkpoint/restore",
        "criu plugin",
        "libpossum.so",
        "huge pages",
        "gpu runtimes",
    ] {
        let (verdict, _) = line(&s, name);
        assert!(["ok", "warn", "FAIL"].contains(&verdict), "{name}: {s}");
    }
    assert!(
        s.contains("a checkpoint cannot work on this machine"),
        "{s}"
    );
}

#[test]
fn the_fake_driver_has_the_checkpoint_api_and_libpossum_is_found() {
    let Some((tmp, lib)) = fake_libcuda_or_skip() else {
        return;
    };
    let libpossum = tmp.path().join("libpossum.so");
    std::fs::write(&libpossum, b"").unwrap();
    let out = doctor(
        &[("POSSUM_LIBCUDA", &lib), ("POSSUM_LIB", &libpossum)],
        false,
    );
    let s = text(&out);
    let (verdict, why) = line(&s, "driver checkpoint");
    assert_eq!(verdict, "ok", "{s}");
    assert!(
        why.contains("cuCheckpointProcess*") && why.contains(&lib.display().to_string()),
        "{s}"
    );
    let (verdict, why) = line(&s, "libpossum.so");
    assert_eq!(verdict, "ok", "{s}");
    assert_eq!(why, libpossum.display().to_string(), "{s}");
    // The configured libcuda is the one the runtimes check names.
    let (verdict, why) = line(&s, "gpu runtimes");
    assert_eq!(verdict, "ok", "{s}");
    assert!(
        why.starts_with(&format!("libcuda {};", lib.display())),
        "{s}"
    );
    // Still no GPU: a checkpoint cannot work.
    assert_eq!(line(&s, "gpu").0, "FAIL", "{s}");
    assert_eq!(out.status.code(), Some(1), "{s}");
}

#[test]
fn a_hip_runtime_on_the_library_path_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let hip = tmp.path().join("libamdhip64.so");
    std::fs::write(&hip, b"").unwrap();
    let out = doctor(
        &[
            ("POSSUM_LIBCUDA", Path::new("/nonexistent/libcuda.so.1")),
            ("LD_LIBRARY_PATH", tmp.path()),
        ],
        false,
    );
    let s = text(&out);
    let (verdict, why) = line(&s, "gpu runtimes");
    assert_eq!(verdict, "warn", "{s}");
    assert_eq!(
        why,
        format!(
            "libcuda not found (/nonexistent/libcuda.so.1); libamdhip64 {} (possum's HIP front \
             end is tested on a simulated runtime, not on AMD hardware)",
            hip.display()
        ),
        "{s}"
    );
}

#[test]
fn json_lists_every_check() {
    let out = doctor(
        &[("POSSUM_LIBCUDA", Path::new("/nonexistent/libcuda.so.1"))],
        true,
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["ok"], false, "{j}");
    let checks = j["checks"].as_array().unwrap();
    let gpu = checks.iter().find(|c| c["name"] == "gpu").unwrap();
    assert_eq!(gpu["verdict"], "fail", "{j}");
    assert!(checks
        .iter()
        .all(|c| ["ok", "warn", "fail"].contains(&c["verdict"].as_str().unwrap())));
}
