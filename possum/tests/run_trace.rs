//! `possum run`, `possum trace` and `possum status` end to end.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, OnceLock};

use possum_control::{error_reply, socket_path, Request, Server};
use serde_json::json;

fn possum() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_possum"));
    for v in [
        "POSSUM_LIB",
        "POSSUM_SOCKET_DIR",
        "POSSUM_TRACE",
        "POSSUM_STATS",
        "POSSUM_VERBOSE",
        "LD_PRELOAD",
    ] {
        c.env_remove(v);
    }
    // A CUPTI that cannot exist, so that the preloaded library does nothing on any machine.
    c.env("POSSUM_CUPTI", "/nonexistent/libcupti.so");
    c
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn show(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}stderr:\n{}",
        o.status,
        text(&o.stdout),
        text(&o.stderr)
    )
}

/// The libpossum.so of this build: `cargo test --workspace` builds it into this target directory
/// (`deps/` under `cargo test`, the profile directory under `cargo build`); when only this crate
/// was built, build it here.
fn libpossum() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let profile = Path::new(env!("CARGO_BIN_EXE_possum")).parent().unwrap();
        let find = || {
            [profile.join("deps"), profile.to_path_buf()]
                .iter()
                .map(|d| d.join("libpossum.so"))
                .find(|p| p.is_file())
        };
        if let Some(p) = find() {
            return p;
        }
        let mut cargo = Command::new(option_env!("CARGO").unwrap_or("cargo"));
        cargo
            .args(["build", "-p", "possum-interposer", "--target-dir"])
            .arg(profile.parent().unwrap())
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if profile.file_name().is_some_and(|n| n == "release") {
            cargo.arg("--release");
        }
        let out = cargo.output().expect("cannot run cargo");
        assert!(
            out.status.success(),
            "libpossum.so is not built and `cargo build -p possum-interposer` failed:\n{}",
            text(&out.stderr)
        );
        find().expect("libpossum.so still missing after `cargo build -p possum-interposer`")
    })
}

/// `possum run --lib <libpossum> --socket-dir <dir> -- argv...`
fn run_job(dir: &Path, argv: &[&str]) -> Command {
    let mut c = possum();
    c.arg("run")
        .arg("--lib")
        .arg(libpossum())
        .arg("--socket-dir")
        .arg(dir)
        .arg("--")
        .args(argv);
    c
}

#[test]
fn run_passes_the_exit_status_through() {
    let tmp = tempfile::tempdir().unwrap();
    let out = run_job(tmp.path(), &["sh", "-c", "exit 3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", show(&out));
    let out = run_job(tmp.path(), &["true"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let out = run_job(tmp.path(), &["sh", "-c", "kill -TERM $$"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(128 + 15), "{}", show(&out));
}

#[test]
fn run_preloads_libpossum_and_sets_the_environment() {
    let tmp = tempfile::tempdir().unwrap();
    let sockets = tmp.path().join("sockets");
    let lib = std::fs::canonicalize(libpossum()).unwrap();
    let out = run_job(
        &sockets,
        &[
            "sh",
            "-c",
            r#"echo "$LD_PRELOAD"; echo "$POSSUM_SOCKET_DIR"; echo "$POSSUM_TRACE""#,
        ],
    )
    .current_dir(tmp.path())
    .arg("--trace")
    .arg("t.json")
    .output()
    .unwrap();
    // `--trace` after CMD belongs to the job: sh ignores its extra arguments.
    assert!(out.status.success(), "{}", show(&out));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], lib.to_str().unwrap(), "{}", show(&out));
    assert!(lines[0].ends_with("/libpossum.so"));
    assert_eq!(lines[1], sockets.to_str().unwrap());
    assert_eq!(lines[2], "");

    // An existing LD_PRELOAD stays, after libpossum.so; --trace FILE becomes absolute. (The
    // dynamic loader warns about the missing library on stderr and goes on.)
    let extra = tmp.path().join("libextra.so");
    let out = possum()
        .current_dir(tmp.path())
        .env("LD_PRELOAD", &extra)
        .arg("run")
        .arg("--lib")
        .arg(libpossum())
        .args(["--trace", "t.json", "--", "sh", "-c"])
        .arg(r#"echo "$LD_PRELOAD"; echo "$POSSUM_TRACE""#)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines[0],
        format!("{}:{}", lib.display(), extra.display()),
        "{}",
        show(&out)
    );
    assert_eq!(lines[1], tmp.path().join("t.json").to_str().unwrap());
}

#[test]
fn run_verbose_names_pid_and_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = run_job(tmp.path(), &["sh", "-c", "echo $$"]);
    let out = c.arg("-v").output().unwrap();
    // `-v` after `--` is the job's; put it before.
    let out2 = {
        let mut c = possum();
        c.arg("run")
            .arg("-v")
            .arg("--lib")
            .arg(libpossum())
            .arg("--socket-dir")
            .arg(tmp.path())
            .args(["--", "sh", "-c", "echo $$"]);
        c.output().unwrap()
    };
    assert!(out.status.success(), "{}", show(&out));
    assert!(
        !text(&out.stderr).contains("possum: job pid"),
        "{}",
        show(&out)
    );
    assert!(out2.status.success(), "{}", show(&out2));
    let pid: u32 = text(&out2.stdout).trim().parse().unwrap();
    let want = format!(
        "possum: job pid {pid}, control socket {}\n",
        socket_path(tmp.path(), pid).display()
    );
    assert!(text(&out2.stderr).contains(&want), "{}", show(&out2));
}

#[test]
fn run_without_the_library_names_where_it_looked() {
    let tmp = tempfile::tempdir().unwrap();
    let out = possum()
        .args(["run", "--lib", "/nonexistent/libpossum.so", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(text(&out.stderr).contains("/nonexistent/libpossum.so"));

    // A possum with no library beside it.
    let bin = tmp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let exe = bin.join("possum");
    std::fs::copy(env!("CARGO_BIN_EXE_possum"), &exe).unwrap();
    // Another test's child may still hold the copy's write descriptor across its fork for a
    // moment (ETXTBSY): retry.
    let out = retry_busy(|| {
        Command::new(&exe)
            .env_remove("POSSUM_LIB")
            .args(["run", "--", "true"])
            .output()
    });
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    let err = text(&out.stderr);
    assert!(
        err.contains(&bin.join("libpossum.so").display().to_string()),
        "{err}"
    );
    assert!(
        err.contains(&bin.join("../lib/libpossum.so").display().to_string()),
        "{err}"
    );
    assert!(
        err.contains("cargo build --release -p possum-interposer") && err.contains("--lib"),
        "{err}"
    );

    // $POSSUM_LIB is the next choice.
    let out = Command::new(&exe)
        .env("POSSUM_LIB", libpossum())
        .env("POSSUM_CUPTI", "/nonexistent/libcupti.so")
        .args(["run", "--socket-dir"])
        .arg(tmp.path())
        .args(["--", "sh", "-c", "exit 5"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(5), "{}", show(&out));
}

#[test]
fn run_of_a_missing_command_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let out = run_job(tmp.path(), &["/nonexistent/command", "x"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    let err = text(&out.stderr);
    assert!(
        err.starts_with("possum: error: cannot execute `/nonexistent/command`"),
        "{err}"
    );
}

#[test]
fn trace_of_a_process_without_possum() {
    let tmp = tempfile::tempdir().unwrap();
    let me = std::process::id();
    let out = possum()
        .args(["trace", &me.to_string(), "--socket-dir"])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    let want = format!(
        "possum: error: process {me} does not have possum loaded: no control socket at {}; start the job with `possum run JOB` or LD_PRELOAD=/path/to/libpossum.so (its socket appears at its first CUDA call)\n",
        socket_path(tmp.path(), me).display()
    );
    assert_eq!(text(&out.stderr), want);

    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let out = possum()
        .args(["trace", &dead.to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(
        text(&out.stderr).contains(&format!("no process with pid {dead}")),
        "{}",
        show(&out)
    );
}

#[test]
fn trace_and_status_ask_the_job() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sockets");
    let _server = Server::start(
        &dir,
        Arc::new(|req| match req {
            Request::Trace => json!({"kernels": [], "dot": "digraph{}"}),
            Request::Status => json!({"phase": "idle", "buffers": 2}),
            Request::Ping => json!({}),
            Request::Checkpoint { .. }
            | Request::PrecopyRound
            | Request::Release
            | Request::JournalWrites { .. }
            | Request::ReleaseKeeping { .. }
            | Request::Resume { .. }
            | Request::Cupti { .. }
            | Request::CheckpointKept { .. }
            | Request::ResumeAndSave { .. }
            | Request::Saved
            | Request::CollectiveHold { .. }
            | Request::CollectiveWait { .. }
            | Request::CollectiveLift => json!({"error": "not in this test"}),
        }),
    )
    .unwrap();
    let me = std::process::id().to_string();
    let (json_out, dot_out) = (tmp.path().join("out.json"), tmp.path().join("out.dot"));
    let out = possum()
        .args(["trace", &me, "--socket-dir"])
        .arg(&dir)
        .arg("-o")
        .arg(&json_out)
        .arg("--dot")
        .arg(&dot_out)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    assert!(out.stdout.is_empty(), "{}", show(&out));
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_out).unwrap()).unwrap();
    assert_eq!(
        j,
        json!({"kernels": [], "dot": "digraph{}", "protocol": possum_control::PROTOCOL})
    );
    assert_eq!(std::fs::read_to_string(&dot_out).unwrap(), "digraph{}");

    // To stdout, through $POSSUM_SOCKET_DIR.
    let out = possum()
        .env("POSSUM_SOCKET_DIR", &dir)
        .args(["trace", &me])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["kernels"], json!([]));

    let out = possum()
        .args(["status", &me, "--socket-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let s = text(&out.stdout);
    assert!(s.contains(&format!("process {me}")), "{s}");
    assert!(s.contains("  phase               idle\n"), "{s}");
    let out = possum()
        .args(["status", &me, "--json", "--socket-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["buffers"], 2, "{}", show(&out));
}

#[test]
fn trace_reports_the_jobs_error() {
    let tmp = tempfile::tempdir().unwrap();
    let _server = Server::start(tmp.path(), Arc::new(|_| error_reply("no analyzer yet"))).unwrap();
    let out = possum()
        .args(["trace", &std::process::id().to_string(), "--socket-dir"])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(
        text(&out.stderr).contains("no analyzer yet"),
        "{}",
        show(&out)
    );

    // --dot on a trace without a DOT graph fails before writing anything.
    let tmp2 = tempfile::tempdir().unwrap();
    let _s2 = Server::start(tmp2.path(), Arc::new(|_| json!({"kernels": []}))).unwrap();
    let out = possum()
        .args(["trace", &std::process::id().to_string(), "--socket-dir"])
        .arg(tmp2.path())
        .arg("--dot")
        .arg(tmp2.path().join("x.dot"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(out.stdout.is_empty());
    assert!(text(&out.stderr).contains("no DOT graph"), "{}", show(&out));
}

/// Runs `f` again while it fails with ETXTBSY (an executable just written, whose write descriptor
/// a concurrently forked child still holds).
fn retry_busy(f: impl Fn() -> std::io::Result<std::process::Output>) -> std::process::Output {
    for _ in 0..100 {
        match f() {
            Err(e) if e.raw_os_error() == Some(26) => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            r => return r.unwrap(),
        }
    }
    f().unwrap()
}

/// A job started with `possum run` that has made no CUDA call has no control socket yet: a
/// checkpoint and a status say it runs with possum but has not used the GPU (not that possum is
/// not loaded), and what to do.
#[test]
fn a_job_that_has_not_used_the_gpu_yet_is_told_apart_from_one_without_possum() {
    use std::io::BufRead;
    let tmp = tempfile::tempdir().unwrap();
    let mut job = run_job(tmp.path(), &["sh", "-c", "echo $$; exec sleep 60"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(job.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let pid: u32 = line.trim().parse().unwrap();
    // The shell printed its pid before its exec: the job is `sleep` with possum mapped (the
    // shell's mapping goes with the exec).
    let ready = || {
        std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep")
            && possum_control::has_possum_mapped(pid)
    };
    let t = std::time::Instant::now();
    while !ready() && t.elapsed().as_secs() < 10 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let checkpoint = possum()
        .args(["checkpoint", &pid.to_string(), "--socket-dir"])
        .arg(tmp.path())
        .arg("-D")
        .arg(tmp.path().join("img"))
        .output()
        .unwrap();
    let status = possum()
        .args(["status", &pid.to_string(), "--socket-dir"])
        .arg(tmp.path())
        .output()
        .unwrap();
    let _ = Command::new("kill").arg(pid.to_string()).status();
    let _ = job.wait();
    for out in [&checkpoint, &status] {
        assert_eq!(out.status.code(), Some(2), "{}", show(out));
        let err = text(&out.stderr);
        assert!(
            err.contains(&format!(
                "process {pid} runs with possum but has not used the GPU yet"
            )) && err.contains("ask again once the job has started using CUDA"),
            "{err}"
        );
        assert!(!err.contains("does not have possum loaded"), "{err}");
    }
    assert!(!tmp.path().join("img").exists());
}
