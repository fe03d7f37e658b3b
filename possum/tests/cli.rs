//! The possum binary end to end.

use std::process::Command;

fn possum() -> Command {
    Command::new(env!("CARGO_BIN_EXE_possum"))
}

fn last_json(stdout: &[u8]) -> serde_json::Value {
    let s = String::from_utf8_lossy(stdout);
    let line = s
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON line in:\n{s}"));
    serde_json::from_str(line).unwrap()
}

/// Runs `cmd`, which must succeed (its output is the failure's message), and gives the last JSON
/// line it printed.
fn succeeds_with_json(cmd: &mut Command) -> serde_json::Value {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    last_json(&out.stdout)
}

#[test]
fn demo_is_bit_exact_and_reports_its_figures() {
    let j =
        succeeds_with_json(possum().args(["demo", "--mib", "24", "--steps", "10", "--at", "3"]));
    assert_eq!(j["bitexact"], true, "{j}");
    assert_eq!(j["backend"], "host");
    assert_eq!(j["bytes"], 24 << 20);
    for k in [
        "stall_ms",
        "checkpoint_ms",
        "restore_ms",
        "restore_first_step_ms",
    ] {
        assert!(j[k].as_f64().is_some_and(|v| v >= 0.0), "{k} in {j}");
    }
    assert_eq!(
        j["on_demand"].as_u64().unwrap() + j["prefetched"].as_u64().unwrap(),
        j["buffers"].as_u64().unwrap()
    );
}

#[test]
fn demo_with_shadows_is_bit_exact() {
    let j = succeeds_with_json(possum().args([
        "demo",
        "--mib",
        "16",
        "--steps",
        "8",
        "--at",
        "2",
        "--shadow-mib",
        "8",
    ]));
    assert_eq!(j["bitexact"], true);
}

#[test]
fn demo_refuses_an_existing_image_directory() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("precious"), "keep me").unwrap();
    let out = possum()
        .args(["demo", "--mib", "8", "--steps", "4", "--at", "1", "-D"])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("possum: error:") && err.contains(&tmp.path().display().to_string()),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("precious")).unwrap(),
        "keep me"
    );
}

#[test]
fn demo_refuses_a_checkpoint_after_the_last_step() {
    let out = possum()
        .args(["demo", "--steps", "4", "--at", "9"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--at 9"));
}

fn criu_usable() -> bool {
    let required = std::env::var("POSSUM_REQUIRE_CRIU").is_ok_and(|v| v == "1");
    let why = if !nix::unistd::Uid::effective().is_root() {
        Some("the CRIU demo needs root".to_string())
    } else {
        possum_criu::Criu::locate()
            .err()
            .map(|e| format!("criu not installed (run scripts/install-criu.sh): {e}"))
    };
    match why {
        None => true,
        Some(w) if required => panic!("POSSUM_REQUIRE_CRIU=1 but {w}"),
        Some(w) => {
            // Straight to stderr: the test harness captures eprintln!.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "demo_criu: SKIPPED: {w}");
            false
        }
    }
}

#[test]
fn demo_criu_round_trip_is_bit_exact() {
    if !criu_usable() {
        return;
    }
    let j = succeeds_with_json(possum().args([
        "demo", "--criu", "--mib", "16", "--steps", "12", "--at", "4",
    ]));
    assert_eq!(j["bitexact"], true, "{j}");
    assert_eq!(j["mode"], "criu");
}

/// `possum demo --migrate`: the job's buffers pre-copied in rounds while it runs (the demo job
/// writes only some of its buffers each step, so every round after the first sends less than the
/// first), then the cut and the restore at the loopback destination; its output is that of an
/// uninterrupted run, and its figures add up.
#[test]
fn demo_migrate_precopies_in_rounds_and_is_bit_exact() {
    if !criu_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    let j = succeeds_with_json(
        possum()
            .args([
                "demo",
                "--migrate",
                "--mib",
                "16",
                "--steps",
                "12",
                "--at",
                "3",
                "--json",
                "-D",
            ])
            .arg(&work),
    );
    assert_eq!(j["mode"], "migrate", "{j}");
    assert_eq!(j["bitexact"], true, "{j}");
    let rounds: Vec<u64> = j["rounds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["bytes"].as_u64().unwrap())
        .collect();
    assert!(
        (2..=4).contains(&rounds.len()),
        "rounds {rounds:?} (at most --max-rounds' default 4)"
    );
    // Round 1 is the whole job; the later ones only what a step wrote.
    assert_eq!(rounds[0], j["bytes"].as_u64().unwrap(), "{j}");
    assert!(rounds[1..].iter().all(|&b| b < rounds[0]), "{rounds:?}");
    // Every round but the last shrank (a round that does not ends the pre-copy).
    assert!(
        rounds[..rounds.len() - 1].windows(2).all(|w| w[1] < w[0]),
        "{rounds:?}"
    );
    let last = j["last"]["bytes"].as_u64().unwrap();
    let precopy = j["precopy_wire_bytes"].as_u64().unwrap();
    assert_eq!(precopy, rounds.iter().sum::<u64>() + last, "{j}");
    let criu_bytes = j["criu_image_bytes"].as_u64().unwrap();
    assert!(criu_bytes > 0, "{j}");
    assert_eq!(j["sent_bytes"].as_u64().unwrap(), precopy + criu_bytes);
    let downtime = j["downtime_ms"].as_f64().unwrap();
    let total = j["total_ms"].as_f64().unwrap();
    assert!(downtime > 0.0 && downtime < total, "{j}");
    // The fresh key it authenticated with, readable by its owner only.
    use std::os::unix::fs::PermissionsExt;
    let key = std::fs::metadata(work.join("migrate.key")).unwrap();
    assert_eq!((key.len(), key.permissions().mode() & 0o777), (32, 0o600));
    // The destination's engine image and CRIU's image, as received.
    assert!(work.join("destination/engine-image").is_dir());
    assert!(work.join("destination/criu-images").is_dir());
}

#[test]
fn demo_migrate_flags_need_migrate() {
    for flags in [
        &["--max-rounds", "2"][..],
        &["--json"],
        &["--criu", "--migrate"],
    ] {
        let out = possum().arg("demo").args(flags).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {out:?}");
    }
}

/// `possum demo --criu` killed with SIGKILL mid-run leaves its scratch directory (its images
/// and files) behind; the next possum that makes one removes it: nothing accumulates under
/// `$TMPDIR/possum-scratch-UID`, and nothing else is left under `$TMPDIR`.
#[test]
fn a_demo_killed_mid_run_leaves_nothing_after_the_next_run() {
    if !criu_usable() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let uid = nix::unistd::geteuid().as_raw();
    let scratch = tmp.path().join(format!("possum-scratch-{uid}"));
    let mut killed = possum()
        .args([
            "demo", "--criu", "--mib", "8", "--steps", "60", "--at", "50",
        ])
        .env("TMPDIR", tmp.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Its scratch directory, once its child runs there.
    let t = std::time::Instant::now();
    let dir = loop {
        let found = std::fs::read_dir(&scratch)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .find(|d| d.join("leave.progress").exists());
        if let Some(d) = found {
            break d;
        }
        assert!(
            t.elapsed() < std::time::Duration::from_secs(120),
            "no scratch directory with a running demo child under {}",
            scratch.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let children = std::fs::read_to_string(format!(
        "/proc/{pid}/task/{pid}/children",
        pid = killed.id()
    ))
    .unwrap_or_default();
    killed.kill().unwrap();
    killed.wait().unwrap();
    for c in children.split_whitespace() {
        let pid = nix::unistd::Pid::from_raw(c.parse().unwrap());
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
    }
    assert!(
        dir.is_dir(),
        "SIGKILL leaves the directory: {}",
        dir.display()
    );
    let out = possum()
        .args(["demo", "--mib", "8", "--steps", "4", "--at", "1"])
        .env("TMPDIR", tmp.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(!dir.exists(), "{} was not swept", dir.display());
    let left: Vec<_> = std::fs::read_dir(&scratch)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(
        left.is_empty(),
        "left under {}: {left:?}",
        scratch.display()
    );
    // Under $TMPDIR itself: the scratch place, and the copy of possum's CRIU plugin CRIU
    // loads (one, of a fixed name, made again by each run).
    let mut top: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    top.retain(|n| n != &format!("possum-criu-plugins-{uid}"));
    assert_eq!(top, vec![format!("possum-scratch-{uid}")]);
}

#[test]
fn doctor_reports_criu_kernel_and_gpu() {
    let out = possum().arg("doctor").output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    for k in ["kernel", "criu", "userfaultfd", "soft-dirty", "gpu"] {
        assert!(s.lines().any(|l| l.starts_with(k)), "no {k} line in:\n{s}");
    }
}

/// The demos that run CRIU say first, and only that, that they need root, when run by another
/// user (as root the test runs them as `nobody` through setpriv).
#[test]
fn the_criu_demos_say_first_that_they_need_root() {
    let root = nix::unistd::geteuid().is_root();
    for (flag, name) in [
        ("--criu", "possum demo --criu"),
        ("--migrate", "possum demo --migrate"),
    ] {
        let out = if root {
            let Ok(out) = Command::new("setpriv")
                .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
                .arg(env!("CARGO_BIN_EXE_possum"))
                .args(["demo", flag])
                .output()
            else {
                eprintln!("SKIPPED: no setpriv to run the demo as another user");
                return;
            };
            out
        } else {
            possum().args(["demo", flag]).output().unwrap()
        };
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&format!("{name} runs CRIU"))
                && stderr.contains("run it as root (e.g. with sudo)"),
            "{stderr}"
        );
        assert!(
            out.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

/// `possum migrate --max-rate` and `--streams` refuse what is not a rate or a stream count,
/// saying why, before anything is done; a rate in any of its units is taken.
#[test]
fn migrate_refuses_a_rate_or_a_stream_count_that_is_not_one_saying_why() {
    let migrate = |flag: &str, value: &str| {
        let out = possum()
            .args(["migrate", "1", "--to", "127.0.0.1:9", "--key-file"])
            .arg("/nonexistent/possum-key")
            .args([flag, value])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for (flag, value, says) in [
        ("--max-rate", "fast", "is not a rate"),
        ("--max-rate", "", "is not a rate"),
        (
            "--max-rate",
            "10Mb",
            "could be bits or bytes: write Mbit or MB",
        ),
        ("--max-rate", "5 furlongs", "unknown unit"),
        ("--max-rate", "0", "at least 1 byte a second"),
        ("--streams", "0", "1..=64"),
        ("--streams", "65", "1..=64"),
        ("--streams", "many", "invalid digit"),
    ] {
        let (code, err) = migrate(flag, value);
        assert_eq!(code, Some(2), "{flag} {value:?}: {err}");
        assert!(
            err.contains(flag) && err.contains(says),
            "{flag} {value:?}: {err}"
        );
    }
    // Taken: the migration goes on to read its key, which is not there.
    for rate in ["500MB/s", "10Gbit", "1.5GiB/s", "250000000"] {
        let (code, err) = migrate("--max-rate", rate);
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("the key file"), "{rate}: {err}");
    }
}
