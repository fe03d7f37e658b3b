//! A job made of this test binary started again, running one `#[test]` that does the job's work
//! when a variable of its environment says so (and nothing otherwise), for the CLI tests that
//! checkpoint such a job with real CRIU and the fake driver: its start, its processes' life and
//! end, and what CRIU cannot do with TCP sockets on this kernel. Included by criu_cli.rs, which
//! provides `cli`, `criu_support` and `WAIT`.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::criu_support::say;
use super::{cli, WAIT};

/// What CRIU logs when the kernel refuses it a TCP socket's SO_PASSCRED (level 1, option 16):
/// Linux 6.16 and later answer SO_PASSCRED only on unix and netlink sockets, and CRIU releases
/// without their fix for it (4.1 and older) fail on any TCP socket there.
pub const PASSCRED_REFUSED: &str = "Can't get 1:16 opt: Operation not supported";

/// The running kernel's release.
pub fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// This test binary, running only the test `test` with `var` set to `value`, its standard
/// descriptors on /dev/null (a restored job has no pipes to this test).
pub fn job_command(test: &str, var: &str, value: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(var, value)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

/// `cmd` started in a session of its own, which its children share: CRIU dumps a tree without
/// --shell-job only if its root leads its session (under a container's PID namespace the
/// test's own session leader is outside it).
pub fn own_session(cmd: &mut Command) -> &mut Command {
    // SAFETY: setsid is async-signal-safe and touches no memory of this process.
    unsafe {
        cmd.pre_exec(|| nix::unistd::setsid().map(|_| ()).map_err(Into::into));
    }
    cmd
}

/// Process `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

/// Reaps `pid` (a child, or adopted by this subreaper) once it has exited.
pub fn reap(pid: i32) {
    let t = Instant::now();
    loop {
        match waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => {}
            Ok(_) => return,
            Err(_) if !Path::new(&format!("/proc/{pid}")).exists() => return,
            Err(_) => {}
        }
        assert!(t.elapsed() < WAIT, "process {pid} was not reaped");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Kills what is left of the job (`pids`) when the test ends, passed or not.
pub struct KillOnDrop(pub Vec<i32>, pub Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for &p in &self.0 {
            let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
        }
        if let Some(c) = &mut self.1 {
            let _ = c.wait();
        }
        for &p in &self.0 {
            let _ = waitpid(Pid::from_raw(p), Some(WaitPidFlag::WNOHANG));
        }
    }
}

/// Builds the fake driver into `dir`; false (said why, for the test `test`) when there is no C
/// compiler.
pub fn fake_driver(dir: &Path, test: &str) -> bool {
    let ok = cli::fake_libcuda(dir).is_some();
    if !ok {
        say(&format!(
            "{test}: SKIPPED: no C compiler to build the fake driver"
        ));
    }
    ok
}
