//! `possum run`'s keeper directory: private while the job runs, gone once `possum run` is; the
//! job's environment.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

/// `possum run` of a job that prints its keeper directory's mode (when it has one), with its
/// control sockets under `sockets`; returns (exit status, stdout, stderr).
fn run_job(sockets: &std::path::Path, envs: &[(&str, &str)]) -> (i32, String, String) {
    let tmp = tempfile::tempdir().unwrap();
    // Any file will do: the loader says it cannot preload it and the job runs on.
    let lib = tmp.path().join("libpossum.so");
    std::fs::write(&lib, b"").unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_possum"));
    cmd.args(["run", "--lib"])
        .arg(&lib)
        .arg("--socket-dir")
        .arg(sockets)
        .args([
            "sh",
            "-c",
            r#"if [ -n "$POSSUM_KEEPER" ]; then stat -c 'mode %a' "$POSSUM_KEEPER"; fi; exit 3"#,
        ])
        .env_remove("POSSUM_KEEPER");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn keeper_dirs(sockets: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(sockets)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("keeper-"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_keeper_that_cannot_start_leaves_no_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let sockets = tmp.path().join("sockets");
    // No device for the driver: the keeper cannot start, on any machine.
    let (code, stdout, stderr) = run_job(&sockets, &[("CUDA_VISIBLE_DEVICES", "")]);
    assert_eq!(code, 3, "{stdout}{stderr}");
    assert!(stderr.contains("the job runs without a keeper"), "{stderr}");
    assert!(!stdout.contains("mode"), "{stdout}");
    assert_eq!(keeper_dirs(&sockets), Vec::<String>::new());
}

#[test]
fn a_keeper_directory_is_private_and_removed_at_exit() {
    let tmp = tempfile::tempdir().unwrap();
    let sockets = tmp.path().join("sockets");
    let (code, stdout, stderr) = run_job(&sockets, &[]);
    assert_eq!(code, 3, "{stdout}{stderr}");
    if stderr.contains("the job runs without a keeper") {
        // No GPU here: nothing is left behind either.
        assert!(!stdout.contains("mode"), "{stdout}");
    } else {
        assert!(stdout.contains("mode 700"), "{stdout}{stderr}");
    }
    assert_eq!(keeper_dirs(&sockets), Vec::<String>::new());
    // The socket directory itself (made for the keeper) is private too.
    if let Ok(m) = std::fs::metadata(&sockets) {
        assert_eq!(m.permissions().mode() & 0o777, 0o700);
    }
}

/// `possum run` of `sh -c SCRIPT` (libpossum.so a stand-in, no keeper) with `envs` added; its
/// stdout.
fn run_script(script: &str, envs: &[(&str, &str)]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let lib = tmp.path().join("libpossum.so");
    std::fs::write(&lib, b"").unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_possum"));
    cmd.args(["run", "--no-keeper", "--lib"])
        .arg(&lib)
        .arg("--socket-dir")
        .arg(tmp.path().join("sockets"))
        .args(["sh", "-c", script])
        .env_remove("UV_USE_IO_URING")
        .env_remove("NCCL_NVLS_ENABLE")
        .env_remove("NCCL_CUMEM_HOST_ENABLE");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `io_uring_setup` in the job answers ENOSYS (the seccomp filter `possum run` installs), in its
/// children too, unless `--allow-io-uring`.
#[test]
fn io_uring_setup_fails_in_the_job_unless_allowed() {
    if Command::new("python3").arg("-V").output().is_err() {
        eprintln!("SKIPPED: no python3 to call io_uring_setup");
        return;
    }
    // io_uring_setup(1, NULL): ENOSYS (38) under the filter; EFAULT (14) on a kernel that has
    // io_uring (EPERM or ENOSYS where it is turned off or absent).
    let probe = "python3 -c 'import ctypes; l = ctypes.CDLL(None, use_errno=True); \
                 r = l.syscall(425, 1, None); print(r, ctypes.get_errno())'";
    let in_job = run_script(&format!("{probe}; sh -c \"{probe}\""), &[]);
    assert_eq!(
        in_job.lines().collect::<Vec<_>>(),
        ["-1 38", "-1 38"],
        "{in_job}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let lib = tmp.path().join("libpossum.so");
    std::fs::write(&lib, b"").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_possum"))
        .args(["run", "--no-keeper", "--allow-io-uring", "--lib"])
        .arg(&lib)
        .arg("--socket-dir")
        .arg(tmp.path().join("sockets"))
        .args(["sh", "-c", probe])
        .output()
        .unwrap();
    let bare = Command::new("sh").args(["-c", probe]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&bare.stdout),
        "--allow-io-uring: the job's io_uring_setup is the kernel's"
    );
}

#[test]
fn the_job_runs_without_io_uring_in_libuv_unless_the_user_chose() {
    let script = r#"echo "uring=${UV_USE_IO_URING-unset}""#;
    assert_eq!(run_script(script, &[]).trim(), "uring=0");
    assert_eq!(
        run_script(script, &[("UV_USE_IO_URING", "1")]).trim(),
        "uring=1"
    );
}

/// NCCL's NVLS and its host memory from `cuMemCreate` are off in the job (neither can be
/// checkpointed by NVIDIA's driver as possum runs it), unless the user set them.
#[test]
fn the_job_runs_without_nccl_s_nvls_and_cumem_host_memory_unless_the_user_chose() {
    let script = r#"echo "${NCCL_NVLS_ENABLE-unset} ${NCCL_CUMEM_HOST_ENABLE-unset}""#;
    assert_eq!(run_script(script, &[]).trim(), "0 0");
    assert_eq!(
        run_script(
            script,
            &[("NCCL_NVLS_ENABLE", "1"), ("NCCL_CUMEM_HOST_ENABLE", "1")]
        )
        .trim(),
        "1 1"
    );
}

#[path = "../../interposer/tests/common/mod.rs"]
#[allow(dead_code)]
mod common;

/// `possum run`'s keeper with spare image memory (on the fake GPU stack): it makes its spare,
/// and says so on `possum run`'s stderr. The keeper's stderr was a pipe whose reader `possum
/// run` dropped once the keeper was up, so that its first note (the spare made) failed to print
/// and no spare was ever ready.
#[test]
fn possum_run_s_keeper_makes_its_spare_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let interposer = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../interposer");
    if !common::build_fake_gpu_from(
        &interposer,
        dir,
        "tests/fake/fake_session_job.c",
        "fake_session_job",
    ) {
        return;
    }
    let (sockets, spares, stop) = (dir.join("sockets"), dir.join("spares"), dir.join("stop"));
    std::fs::create_dir(&spares).unwrap();
    let lib = dir.join("stand-in.so");
    std::fs::write(&lib, b"").unwrap();
    let wait_for_stop = format!("while [ ! -e '{}' ]; do sleep 0.05; done", stop.display());
    let run = Command::new(env!("CARGO_BIN_EXE_possum"))
        .args(["run", "--lib"])
        .arg(&lib)
        .arg("--socket-dir")
        .arg(&sockets)
        .args(["sh", "-c", &wait_for_stop])
        .env("POSSUM_LIBCUDA", dir.join("libcuda.so.1"))
        .env("LD_LIBRARY_PATH", dir)
        .env("POSSUM_KEEPER_SPARE_DIR", &spares)
        .env("POSSUM_KEEPER_SPARE_MIB", "8")
        .env_remove("POSSUM_KEEPER")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let socket = sockets
        .join(format!("keeper-{}", run.id()))
        .join("keeper-0.sock");
    let since = std::time::Instant::now();
    let ready = loop {
        let ready = possum_keeper::Keeper::connect(&socket)
            .and_then(|mut k| k.stats())
            .is_ok_and(|st| st.spare.is_some_and(|sp| sp.ready));
        if ready || since.elapsed() > std::time::Duration::from_secs(60) {
            break ready;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    std::fs::write(&stop, b"").unwrap();
    let out = run.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(ready, "the keeper made no spare: {stderr}");
    assert!(
        stderr.contains("possum keeper: spare image memory ready"),
        "{stderr}"
    );
}
