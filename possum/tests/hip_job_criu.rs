//! A HIP job checkpointed and restored through CRIU by `possum checkpoint` and `possum restore`,
//! on the simulated HIP runtime (`possum-hip`; no AMD GPU): `hip-session-job.c` (three
//! streams, pool and stream-ordered allocations, a captured graph, a range of its own virtual
//! memory) runs under libpossum.so and steps until killed. Checkpointed while it runs (the
//! pre-copy concurrent with its steps), killed, and restored, it goes on; left running, it goes
//! on. Every step it computes, before and after, is bit for bit that of a run never
//! checkpointed. Needs root, CRIU and a C compiler (else SKIPPED on stderr).

use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "support/criu_cli.rs"]
mod support;
use support::cli::possum_in as possum;
use support::{common, criu_or_skip, run_ok, say, WAIT};

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag};
use nix::unistd::Pid;
use serde_json::Value;

/// The simulated runtime and the job, built into `dir`; `None` (said) without a C compiler.
fn build(dir: &Path) -> Option<PathBuf> {
    match possum_hip::build_runtime(dir).and_then(|_| possum_hip::build_session_job(dir)) {
        Ok(job) => Some(job),
        Err(possum_hip::BuildError::NoCompiler(e)) => {
            say(&format!("hip_checkpoint: SKIPPED: no C compiler ({e})"));
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// The `step N DIGEST` lines of `out`, as (N, DIGEST).
fn steps(out: &Path) -> Vec<(u32, String)> {
    possum_hip::session_job_steps(&std::fs::read_to_string(out).unwrap_or_default())
}

/// Waits until `out` has step `n` or later; the last step.
fn wait_step(out: &Path, n: u32, what: &str) -> u32 {
    let t = Instant::now();
    loop {
        if let Some(&(last, _)) = steps(out).last() {
            if last >= n {
                return last;
            }
        }
        assert!(
            t.elapsed() < WAIT,
            "{what}: no step {n} in {WAIT:?}; its log:\n{}",
            std::fs::read_to_string(out.with_extension("stderr")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The job, under libpossum.so, in a session of its own (CRIU dumps it without --shell-job),
/// its output appended to `out` (CRIU reopens the file by path at a restore).
fn start(job: &Path, dir: &Path, out: &Path) -> Child {
    let append = |p: PathBuf| {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .unwrap()
    };
    let mut cmd = Command::new(job);
    cmd.arg(possum_hip::kernels_code_object())
        .env_remove("LD_PRELOAD")
        .env("LD_PRELOAD", common::libpossum())
        .env("POSSUM_SOCKET_DIR", dir.join("sockets"))
        .env("POSSUM_VERBOSE", "1")
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(append(out.to_path_buf()))
        .stderr(append(out.with_extension("stderr")));
    // SAFETY: setsid is async-signal-safe and touches no memory of this process.
    unsafe {
        cmd.pre_exec(|| nix::unistd::setsid().map(|_| ()).map_err(Into::into));
    }
    cmd.spawn().unwrap()
}

/// Checks every step of `out` against a run of `steps` steps never checkpointed.
fn bit_exact(job: &Path, dir: &Path, out: &Path) {
    let seen = steps(out);
    let last = seen.last().unwrap().0;
    let reference = Command::new(job)
        .arg(possum_hip::kernels_code_object())
        .arg(last.to_string())
        .env_remove("LD_PRELOAD")
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(reference.status.success());
    let ref_out = dir.join("reference.out");
    std::fs::write(&ref_out, &reference.stdout).unwrap();
    let want = steps(&ref_out);
    assert_eq!(want.len(), last as usize);
    for (n, digest) in &seen {
        assert_eq!(digest, &want[*n as usize - 1].1, "step {n} differs");
    }
}

/// Kills the job's process when the test ends, passed or not.
struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.0), Signal::SIGKILL);
        let _ = waitpid(Pid::from_raw(self.0), Some(WaitPidFlag::WNOHANG));
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.metadata().map_or(0, |m| m.len()))
        .sum()
}

/// The job built and running under possum past its fifth step, in a new directory: the
/// directory, the job's executable, its output file and its process. `None` (said) to skip.
fn running_job() -> Option<(tempfile::TempDir, PathBuf, PathBuf, Child)> {
    criu_or_skip("hip_checkpoint")?;
    let tmp = tempfile::Builder::new()
        .prefix("possum-hip-")
        .tempdir()
        .unwrap();
    let exe = build(tmp.path())?;
    // A restored job is adopted here, to be reaped.
    possum_criu::set_child_subreaper().unwrap();
    let out = tmp.path().join("job.out");
    let child = start(&exe, tmp.path(), &out);
    wait_step(&out, 5, "the job");
    Some((tmp, exe, out, child))
}

fn manifest(img: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(img.join("possum.json")).unwrap()).unwrap()
}

/// A [`running_job`] checkpointed by `possum checkpoint FLAGS PID -D DIR/img`, its process
/// killed when this is dropped.
struct Checkpointed {
    _kill: KillOnDrop,
    child: Child,
    pid: i32,
    exe: PathBuf,
    out: PathBuf,
    img: PathBuf,
    tmp: tempfile::TempDir,
}

fn checkpointed(flags: &[&str]) -> Option<Checkpointed> {
    let (tmp, exe, out, child) = running_job()?;
    let pid = child.id() as i32;
    let kill = KillOnDrop(pid);
    let img = tmp.path().join("img");
    run_ok(
        possum(tmp.path())
            .arg("checkpoint")
            .args(flags)
            .args([&pid.to_string(), "-D"])
            .arg(&img),
    );
    Some(Checkpointed {
        _kill: kill,
        child,
        pid,
        exe,
        out,
        img,
        tmp,
    })
}

#[test]
fn a_hip_job_is_checkpointed_killed_and_restored_bit_exact_through_criu() {
    let Some(mut job) = checkpointed(&[]) else {
        return;
    };
    let dir = job.tmp.path();
    job.child.wait().unwrap();
    let m = manifest(&job.img);
    assert_eq!(m["runtime"], "hip", "{m}");
    // The buffers (X, Y, Z and W: 4 MiB) are in possum's image, not left to CRIU's.
    let gpu = job.img.join("gpu").join("gpu-0");
    assert!(dir_bytes(&gpu) >= 4 << 20, "{}", gpu.display());
    let killed_at = steps(&job.out).last().unwrap().0;

    run_ok(possum(dir).args(["restore", "-D"]).arg(&job.img));
    wait_step(&job.out, killed_at + 20, "the restored job");
    let _ = kill(Pid::from_raw(job.pid), Signal::SIGKILL);
    possum_criu::wait_for_exit(job.pid, Some(WAIT)).unwrap();
    bit_exact(&job.exe, dir, &job.out);
}

#[test]
fn a_hip_job_left_running_goes_on_bit_exact() {
    let Some(mut job) = checkpointed(&["--leave-running"]) else {
        return;
    };
    let dir = job.tmp.path();
    assert!(job.child.try_wait().unwrap().is_none(), "the job runs on");
    let at = steps(&job.out).last().unwrap().0;
    wait_step(&job.out, at + 20, "the job after its checkpoint");
    let _ = job.child.kill();
    let _ = job.child.wait();
    bit_exact(&job.exe, dir, &job.out);
}
