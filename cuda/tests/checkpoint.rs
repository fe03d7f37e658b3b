//! Tests of `possum_cuda::checkpoint` (the driver's checkpoint of another process).
//!
//! - Against `testdata/fake-libcuda.c` (built here with `cc`; without a C compiler each test prints
//!   "SKIPPED: ..." and returns): the state machine, the errors, the library choice by
//!   `POSSUM_LIBCUDA`; `testdata/fake-libcuda-nockpt.c` is a driver without the API.
//! - Against the real driver, where there is a GPU (else "SKIPPED: ..."; with
//!   `POSSUM_REQUIRE_GPU=1` a failure): a child process of this test binary maps device memory and
//!   is locked, checkpointed, restored and unlocked, then checks its memory.
//!
//! Some tests run this binary again as a child, selecting one `helper_*` test with `--exact` and
//! its mode with `POSSUM_CKPT_HELPER`; without that variable the helpers do nothing.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use possum_cuda::checkpoint::{DriverCheckpoint, DriverCkptError, ProcessState};
use possum_cuda::{probe, CudaDevice};
use possum_engine::device::{Device, HostBuffer, StreamPriority, Transfer};

const HELPER_ENV: &str = "POSSUM_CKPT_HELPER";

/// The deadline of the checkpoints and restores that are not about deadlines.
const LONG: Duration = Duration::from_secs(120);

/// Says on the terminal, past the harness's capture, that `test` was skipped and why.
fn skipped(test: &str, why: &str) {
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why} [{test}]");
}

/// The fakes, built once per run: (with the checkpoint API, without it). `None` without a C
/// compiler.
fn fakes() -> Option<&'static (PathBuf, PathBuf)> {
    static FAKES: OnceLock<Option<(PathBuf, PathBuf)>> = OnceLock::new();
    FAKES
        .get_or_init(|| {
            let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata");
            let dir = std::env::temp_dir().join(format!("possum-ckpt-fake-{}", std::process::id()));
            std::fs::create_dir_all(&dir).ok()?;
            let build = |src: &str, out: &str| {
                let out = dir.join(out);
                let ok = Command::new("cc")
                    .args(["-O1", "-shared", "-fPIC", "-Wl,-Bsymbolic", "-o"])
                    .arg(&out)
                    .arg(here.join(src))
                    .status()
                    .is_ok_and(|s| s.success());
                ok.then_some(out)
            };
            Some((
                build("fake-libcuda.c", "libcuda-fake.so")?,
                build("fake-libcuda-nockpt.c", "libcuda-fake-nockpt.so")?,
            ))
        })
        .as_ref()
}

/// The fakes' paths (as [`fakes`]); `None` (said on stderr) without a C compiler.
fn fakes_or_skip(test: &str) -> Option<&'static (PathBuf, PathBuf)> {
    let f = fakes();
    if f.is_none() {
        skipped(test, "no C compiler to build testdata/fake-libcuda*.c");
    }
    f
}

/// The fake driver with the checkpoint API, loaded; `None` (said on stderr) without a C compiler.
fn fake_or_skip(test: &str) -> Option<DriverCheckpoint> {
    let (full, _) = fakes_or_skip(test)?;
    Some(DriverCheckpoint::load_from(full.to_str().unwrap()).expect("the fake driver loads"))
}

/// A live process that never uses CUDA, killed on drop.
struct Sleeper(Child);

impl Sleeper {
    fn spawn() -> Sleeper {
        Sleeper(
            Command::new("sleep")
                .arg("60")
                .spawn()
                .expect("spawn sleep"),
        )
    }
    fn pid(&self) -> i32 {
        self.0.id() as i32
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The pid of a process that has exited and been reaped.
fn dead_pid() -> i32 {
    let mut c = Command::new("true").spawn().expect("spawn true");
    let pid = c.id() as i32;
    c.wait().unwrap();
    pid
}

fn assert_call_error(
    r: Result<impl std::fmt::Debug, DriverCkptError>,
    want_call: &str,
    want_pid: i32,
) -> DriverCkptError {
    let e = r.expect_err("the call should fail");
    match &e {
        DriverCkptError::Call { call, pid, .. } => {
            assert_eq!(*call, want_call, "{e}");
            assert_eq!(*pid, want_pid, "{e}");
        }
        other => panic!("expected a Call error from {want_call}, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains(want_call), "{msg}");
    assert!(msg.contains(&format!("pid {want_pid}")), "{msg}");
    e
}

#[test]
fn fake_full_cycle_on_own_pid() {
    let Some(ck) = fake_or_skip("fake_full_cycle_on_own_pid") else {
        return;
    };
    // The only test that uses this process's pid: the fake's table is shared by the tests.
    let pid = std::process::id() as i32;
    assert_eq!(ck.state(pid).unwrap(), ProcessState::Running);
    assert_eq!(ck.restore_thread_id(pid).unwrap(), pid);
    let pairs = [([1u8; 16], [2u8; 16])];
    for remap in [&[][..], &pairs[..]] {
        ck.lock(pid, 0).unwrap();
        assert_eq!(ck.state(pid).unwrap(), ProcessState::Locked);
        ck.checkpoint(pid, LONG).unwrap();
        assert_eq!(ck.state(pid).unwrap(), ProcessState::Checkpointed);
        ck.restore(pid, remap, LONG).unwrap();
        assert_eq!(ck.state(pid).unwrap(), ProcessState::Locked);
        ck.unlock(pid).unwrap();
        assert_eq!(ck.state(pid).unwrap(), ProcessState::Running);
    }
    assert!(format!("{ck:?}").contains("libcuda-fake.so"));
}

#[test]
fn fake_errors_name_the_call_and_pid() {
    let Some(ck) = fake_or_skip("fake_errors_name_the_call_and_pid") else {
        return;
    };
    let target = Sleeper::spawn();
    let pid = target.pid();
    let e = assert_call_error(
        ck.checkpoint(pid, LONG),
        "cuCheckpointProcessCheckpoint",
        pid,
    );
    assert_eq!(e.code(), Some(401));
    ck.lock(pid, 1000).unwrap();
    let e = assert_call_error(ck.lock(pid, 1000), "cuCheckpointProcessLock", pid);
    assert_eq!(e.code(), Some(401));
    assert!(e.to_string().contains("CUDA_ERROR_ILLEGAL_STATE"), "{e}");
    assert!(e.to_string().contains("illegal state (fake)"), "{e}");
    assert_call_error(
        ck.restore(pid, &[], LONG),
        "cuCheckpointProcessRestore",
        pid,
    );
    ck.unlock(pid).unwrap();
    // The fake times out a lock with a 1 ms timeout, as the real driver does: NOT_READY.
    let e = ck.lock(pid, 1).unwrap_err();
    assert!(
        matches!(e, DriverCkptError::LockTimeout { pid: p, timeout_ms: 1 } if p == pid),
        "{e:?}"
    );
    assert_eq!(e.code(), Some(600));
    assert!(
        e.to_string().contains(&format!("pid {pid} timed out")),
        "{e}"
    );
    assert_eq!(ck.state(pid).unwrap(), ProcessState::Running);
    ck.lock(pid, 0).unwrap();
    assert_eq!(
        ck.state(pid).unwrap(),
        ProcessState::Locked,
        "failed calls change nothing"
    );
    ck.unlock(pid).unwrap();
    assert_call_error(ck.unlock(pid), "cuCheckpointProcessUnlock", pid);
}

#[test]
fn fake_dead_pid_is_an_error() {
    let Some(ck) = fake_or_skip("fake_dead_pid_is_an_error") else {
        return;
    };
    let pid = dead_pid();
    let e = assert_call_error(ck.state(pid), "cuCheckpointProcessGetState", pid);
    assert_eq!(e.code(), Some(1));
    assert_call_error(ck.lock(pid, 0), "cuCheckpointProcessLock", pid);
    assert_call_error(
        ck.restore_thread_id(pid),
        "cuCheckpointProcessGetRestoreThreadId",
        pid,
    );
}

#[test]
fn fake_driver_without_the_api_is_unsupported() {
    let Some((_, nockpt)) = fakes_or_skip("fake_driver_without_the_api_is_unsupported") else {
        return;
    };
    let e = DriverCheckpoint::load_from(nockpt.to_str().unwrap()).unwrap_err();
    assert!(
        matches!(
            e,
            DriverCkptError::Unsupported {
                symbol: "cuCheckpointProcessLock"
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("driver 570 or newer"), "{e}");
}

/// This test binary, to run its `helper` test alone in `mode`.
fn helper_command(helper: &str, mode: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", helper, "--nocapture", "--test-threads=1"])
        .env(HELPER_ENV, mode);
    cmd
}

/// Runs this test binary's `helper` test alone, in `mode`, with `envs`; returns its stdout.
fn run_helper(helper: &str, mode: &str, envs: &[(&str, &str)]) -> String {
    let out = helper_command(helper, mode)
        .envs(envs.iter().copied())
        .output()
        .expect("run the test binary as a helper");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "helper {helper} ({mode}) failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn fake_library_is_chosen_by_env() {
    let Some((full, _)) = fakes_or_skip("fake_library_is_chosen_by_env") else {
        return;
    };
    let lib = full.to_str().unwrap();
    let out = run_helper("helper_load_from_env", "env", &[("POSSUM_LIBCUDA", lib)]);
    assert!(out.contains("HELPER loaded"), "{out}");
    let out = run_helper(
        "helper_load_from_env",
        "nodev",
        &[("POSSUM_LIBCUDA", lib), ("FAKE_CUDA_NODEV", "1")],
    );
    assert!(out.contains("HELPER init failed"), "{out}");
}

/// Child side of `fake_library_is_chosen_by_env`: `DriverCheckpoint::load()` with the environment
/// the parent set.
#[test]
fn helper_load_from_env() {
    match std::env::var(HELPER_ENV).as_deref() {
        Ok("env") => {
            let ck = DriverCheckpoint::load().expect("load the library POSSUM_LIBCUDA names");
            assert!(format!("{ck:?}").contains("libcuda-fake.so"), "{ck:?}");
            let pid = std::process::id() as i32;
            assert_eq!(ck.state(pid).unwrap(), ProcessState::Running);
            println!("HELPER loaded");
        }
        Ok("nodev") => {
            let e = DriverCheckpoint::load().unwrap_err();
            assert!(
                matches!(e, DriverCkptError::Init { code: 100, .. }),
                "{e:?}"
            );
            assert!(e.to_string().contains("cuInit(0) failed"), "{e}");
            assert!(e.to_string().contains("no CUDA-capable device"), "{e}");
            println!("HELPER init failed: {e}");
        }
        _ => {}
    }
}

#[test]
fn fake_a_hung_call_is_cut_off_at_its_deadline() {
    let Some((full, _)) = fakes_or_skip("fake_a_hung_call_is_cut_off_at_its_deadline") else {
        return;
    };
    let lib = full.to_str().unwrap();
    let hang = [
        ("POSSUM_LIBCUDA", lib),
        (
            "FAKE_CKPT_HANG",
            "cuCheckpointProcessCheckpoint,cuCheckpointProcessGetState",
        ),
    ];
    let out = run_helper("helper_hung_driver", "hang", &hang);
    assert!(out.contains("HELPER cut off"), "{out}");
}

/// Child side of `fake_a_hung_call_is_cut_off_at_its_deadline`: the fake's checkpoint and state
/// query hang (`FAKE_CKPT_HANG`); each call returns at its deadline with an error that names it,
/// the pid and the deadline, and the calls that do not hang go on working.
#[test]
fn helper_hung_driver() {
    if std::env::var(HELPER_ENV).as_deref() != Ok("hang") {
        return;
    }
    let ck = DriverCheckpoint::load()
        .expect("load the fake")
        .with_short_deadline(Duration::from_millis(300));
    assert_eq!(ck.short_deadline(), Duration::from_millis(300));
    let target = Sleeper::spawn();
    let pid = target.pid();
    ck.lock(pid, 0).unwrap();
    let limit = Duration::from_millis(200);
    let e = ck.checkpoint(pid, limit).unwrap_err();
    match &e {
        DriverCkptError::DeadlineExceeded {
            call,
            pid: p,
            after,
        } => {
            assert_eq!(*call, "cuCheckpointProcessCheckpoint");
            assert_eq!(*p, pid);
            assert_eq!(*after, limit);
        }
        other => panic!("expected DeadlineExceeded, got {other:?}"),
    }
    assert_eq!(e.code(), None);
    let msg = e.to_string();
    assert!(
        msg.contains(&format!(
            "cuCheckpointProcessCheckpoint for pid {pid} did not return within 0.200 s"
        )),
        "{msg}"
    );
    let e = ck.state(pid).unwrap_err();
    assert!(
        matches!(
            e,
            DriverCkptError::DeadlineExceeded {
                call: "cuCheckpointProcessGetState",
                after,
                ..
            } if after == Duration::from_millis(300)
        ),
        "{e:?}"
    );
    // The hung checkpoint changed nothing: the process is still locked, and unlocks.
    ck.unlock(pid).unwrap();
    assert_call_error(ck.unlock(pid), "cuCheckpointProcessUnlock", pid);
    println!("HELPER cut off: {msg}");
}

/// The real driver and a device, or `None` (said on stderr) without them.
fn real_or_skip(test: &str) -> Option<DriverCheckpoint> {
    let require = std::env::var("POSSUM_REQUIRE_GPU").is_ok_and(|v| v == "1");
    if let Err(why) = probe() {
        assert!(!require, "POSSUM_REQUIRE_GPU=1 but no CUDA device: {why}");
        skipped(test, &format!("no CUDA device ({why})"));
        return None;
    }
    match DriverCheckpoint::load() {
        Ok(ck) => Some(ck),
        Err(e @ DriverCkptError::Unsupported { .. }) => {
            assert!(!require, "POSSUM_REQUIRE_GPU=1 but {e}");
            skipped(test, &e.to_string());
            None
        }
        Err(e) => panic!("a device was probed but the checkpoint API could not be loaded: {e}"),
    }
}

/// A CUDA child (this binary's `helper_cuda_child`), talked to by lines on its stdin and stdout.
struct CudaChild {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl CudaChild {
    fn spawn() -> CudaChild {
        let mut child = helper_command("helper_cuda_child", "cuda_child")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the CUDA child");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        CudaChild {
            child,
            stdin,
            stdout,
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Reads the child's stdout up to a line `want`.
    fn expect(&mut self, want: &str) {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "the CUDA child exited before saying {want}");
            // `ends_with`: libtest may have written "test helper_cuda_child ... " before it.
            if line.trim_end().ends_with(want) {
                return;
            }
        }
    }

    fn say(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
    }
}

impl Drop for CudaChild {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

#[test]
fn real_driver_checkpoints_a_cuda_child() {
    let test = "real_driver_checkpoints_a_cuda_child";
    let Some(ck) = real_or_skip(test) else {
        return;
    };
    let note = |s: String| {
        let _ = writeln!(std::io::stderr(), "NOTE [{test}]: {s}");
    };

    // A live process that never used CUDA, and a dead one: errors that name the call and pid.
    let plain = Sleeper::spawn();
    let e = assert_call_error(
        ck.lock(plain.pid(), 2000),
        "cuCheckpointProcessLock",
        plain.pid(),
    );
    note(format!("lock of a process without CUDA: {e}"));
    match ck.state(plain.pid()) {
        Ok(s) => note(format!("state of a process without CUDA: {s}")),
        Err(e) => note(format!("state of a process without CUDA: {e}")),
    }
    drop(plain);
    let dead = dead_pid();
    let e = assert_call_error(ck.state(dead), "cuCheckpointProcessGetState", dead);
    note(format!("state of a dead pid: {e}"));

    // The full cycle on a CUDA process, whose device memory must survive it.
    let mut child = CudaChild::spawn();
    child.expect("READY");
    let pid = child.pid();
    note(format!("CUDA child {pid} ready"));
    assert_eq!(ck.state(pid).unwrap(), ProcessState::Running);
    note("CUDA child running".into());
    let tid = ck.restore_thread_id(pid).unwrap();
    assert!(tid > 0, "restore thread id {tid}");
    note(format!("pid {pid}, restore thread {tid}"));
    let t = std::time::Instant::now();
    ck.lock(pid, 10_000).unwrap();
    assert_eq!(ck.state(pid).unwrap(), ProcessState::Locked);
    ck.checkpoint(pid, LONG).unwrap();
    assert_eq!(ck.state(pid).unwrap(), ProcessState::Checkpointed);
    assert_call_error(
        ck.checkpoint(pid, LONG),
        "cuCheckpointProcessCheckpoint",
        pid,
    );
    ck.restore(pid, &[], LONG).unwrap();
    assert_eq!(ck.state(pid).unwrap(), ProcessState::Locked);
    ck.unlock(pid).unwrap();
    assert_eq!(ck.state(pid).unwrap(), ProcessState::Running);
    note(format!(
        "lock+checkpoint+restore+unlock of 256 MiB: {:?}",
        t.elapsed()
    ));
    child.say("check");
    child.expect("VERIFIED");

    // A lock with a short timeout while the child waits on about a second of queued work: it
    // times out (CUDA_ERROR_NOT_READY with driver 580) and the child stays RUNNING.
    child.say("busy");
    child.expect("BUSY");
    let t = std::time::Instant::now();
    match ck.lock(pid, 50) {
        Err(e) => {
            note(format!(
                "lock with 50 ms timeout on a busy process, after {:?}: {e}",
                t.elapsed()
            ));
            assert!(
                matches!(e, DriverCkptError::LockTimeout { timeout_ms: 50, .. }),
                "{e:?}"
            );
            assert_eq!(ck.state(pid).unwrap(), ProcessState::Running);
        }
        Ok(()) => {
            // The work finished within the timeout after all: nothing to check.
            note(format!(
                "lock with 50 ms timeout on a busy process succeeded after {:?}",
                t.elapsed()
            ));
            ck.unlock(pid).unwrap();
        }
    }
    child.expect("IDLE");
    child.say("exit");
    child.expect("DONE");
}

/// Child side of `real_driver_checkpoints_a_cuda_child`: maps 256 MiB, fills it, says READY, then
/// obeys lines on stdin: `check` (verify the fill; VERIFIED), `busy` (queue seconds of memsets,
/// BUSY, wait for them, IDLE), `exit` (DONE).
#[test]
fn helper_cuda_child() {
    if std::env::var(HELPER_ENV).as_deref() != Ok("cuda_child") {
        return;
    }
    const FILL: u8 = 0x5a;
    // Written and flushed directly: the parent waits for each line (stdout to a pipe is not
    // flushed at each newline).
    let say = |s: &str| {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{s}").unwrap();
        out.flush().unwrap();
    };
    let dev = CudaDevice::new(0).expect("open device 0");
    let len = 256u64 << 20;
    let va = dev.reserve(len).unwrap();
    dev.map(va, len).unwrap();
    let s = dev.create_stream(StreamPriority::Normal).unwrap();
    dev.memset_d8(&s, va, FILL, len).unwrap();
    dev.synchronize(&s).unwrap();
    say("READY");
    for line in std::io::stdin().lock().lines() {
        match line.unwrap().trim() {
            "check" => {
                let host = dev.alloc_host(len as usize).unwrap();
                let host = dev.copy_d2h(&s, va, host, len).unwrap().wait().unwrap();
                let bad = host.as_slice().iter().position(|&b| b != FILL);
                assert_eq!(bad, None, "device memory changed across the checkpoint");
                say("VERIFIED");
            }
            "busy" => {
                // 8000 x 256 MiB = 2 TiB of memset: about a second on an H100.
                for _ in 0..8000 {
                    dev.memset_d8(&s, va, FILL, len).unwrap();
                }
                say("BUSY");
                dev.synchronize(&s).unwrap();
                say("IDLE");
            }
            "exit" => break,
            other => panic!("unknown command {other:?}"),
        }
    }
    dev.unmap(va, len).unwrap();
    dev.unreserve(va, len).unwrap();
    say("DONE");
}
