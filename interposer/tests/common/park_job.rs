//! `tests/fake/fake_park_job.c` driven from a test: a multi-threaded job without CUPTI whose
//! worker computes steps in device memory (fake GPU), printing `s <n>` after each, while its main
//! thread answers commands on stdin. Shared by the interposer's `fake_park.rs` and the CLI's
//! `possum/tests/held.rs`.

use std::path::{Path, PathBuf};
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use possum_control::{request, Request};
use serde_json::Value;

use super::{fake_job_command, Piped};

/// Bound on every wait for something that should happen.
pub const WAIT: Duration = Duration::from_secs(20);
/// u32 words per buffer (fake_park_job.c).
pub const N: usize = 1 << 18;

/// A running fake_park_job, killed when dropped.
pub struct ParkJob {
    p: Piped,
    /// Its process id.
    pub pid: u32,
    /// Its control socket's directory.
    pub sockets: PathBuf,
}

impl ParkJob {
    /// Starts `dir/fake_park_job` with `lib` preloaded and its hooks off (`POSSUM_HOOKS=off`: the
    /// job's work does not go through the driver, so a checkpoint must park its threads), plus
    /// `env`; waits for `ready`. Its stderr goes to `dir/<name>.stderr`.
    pub fn start(dir: &Path, name: &str, lib: &Path, env: &[(&str, &str)]) -> ParkJob {
        let stderr = dir.join(format!("{name}.stderr"));
        let sockets = dir.join("sockets");
        let mut cmd = fake_job_command(dir, "fake_park_job", Some(lib));
        cmd.env("POSSUM_HOOKS", "off")
            .env("POSSUM_SOCKET_DIR", &sockets)
            .env("POSSUM_VERBOSE", "1")
            .envs(env.iter().copied());
        let p = Piped::spawn(&mut cmd, stderr);
        let pid = p.child.id();
        let mut job = ParkJob { p, pid, sockets };
        assert_eq!(job.answer(), "ready", "{}", job.log());
        job
    }

    /// The job's stderr so far.
    pub fn log(&self) -> String {
        self.p.log()
    }

    /// The next line that is not a worker's step line.
    pub fn answer(&mut self) -> String {
        let t = Instant::now();
        loop {
            match self.p.lines.recv_timeout(WAIT.saturating_sub(t.elapsed())) {
                Ok(l) if l.starts_with("s ") => continue,
                Ok(l) => return l,
                Err(e) => panic!("no answer from the job ({e:?}); stderr:\n{}", self.log()),
            }
        }
    }

    /// Sends `cmd` and returns its answer.
    pub fn run(&mut self, cmd: &str) -> String {
        self.p.send(cmd);
        self.answer()
    }

    /// Whether `n` more step lines come within [`WAIT`] (the job runs).
    pub fn progresses(&mut self, n: usize) -> bool {
        let t = Instant::now();
        let mut seen = 0;
        while seen < n {
            match self.p.lines.recv_timeout(WAIT.saturating_sub(t.elapsed())) {
                Ok(l) if l.starts_with("s ") => seen += 1,
                Ok(l) => panic!("unexpected {l:?}"),
                Err(_) => return false,
            }
        }
        true
    }

    /// Waits for `n` more step lines; fails the test if they do not come.
    pub fn steps(&mut self, n: usize) {
        assert!(
            self.progresses(n),
            "the job made no progress; stderr:\n{}",
            self.log()
        );
    }

    /// Asserts that no thread of the job prints anything for `d`, and that it is alive.
    pub fn assert_still(&mut self, d: Duration) {
        match self.p.lines.recv_timeout(d) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(l) => panic!("the held job printed {l:?}: a thread was not parked"),
            Err(RecvTimeoutError::Disconnected) => {
                panic!("the job died; stderr:\n{}", self.log())
            }
        }
        assert!(self.p.child.try_wait().unwrap().is_none(), "{}", self.log());
    }

    /// Asks libpossum in the job; fails the test on an error.
    pub fn ask(&self, req: &Request) -> Value {
        request(self.pid, &self.sockets, req, WAIT)
            .unwrap_or_else(|e| panic!("{req:?} failed: {e}; stderr:\n{}", self.log()))
    }

    /// Drains the step lines printed before the hold: those that come until none has for
    /// 250 ms (the test's reader of the job's pipe may pass them on late). Fails the test if
    /// they keep coming for [`WAIT`]: a thread was not parked.
    pub fn drain(&self) {
        let t = Instant::now();
        loop {
            match self.p.lines.recv_timeout(Duration::from_millis(250)) {
                Ok(l) if t.elapsed() > WAIT => {
                    panic!("the held job still prints ({l:?}): a thread was not parked")
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    }

    /// Stops the worker, dumps the buffers into `dir` and compares them with the model of as
    /// many steps; then the job exits.
    pub fn check_final(&mut self, dir: &Path) {
        let stopped = self.run("stop");
        let steps: u32 = stopped
            .strip_prefix("stopped ")
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{stopped}"));
        let path = dir.join("dump.bin");
        assert_eq!(self.run(&format!("dump {}", path.display())), "dumped");
        let got = std::fs::read(&path).unwrap();
        let want = model(steps);
        assert!(
            got == want,
            "after {steps} steps the buffers differ from the model (first at byte {:?})",
            got.iter().zip(&want).position(|(g, w)| g != w)
        );
        assert_eq!(self.run("exit"), "bye");
    }
}

/// A and B after `steps` steps, as fake_park_job.c computes them.
pub fn model(steps: u32) -> Vec<u8> {
    let a: Vec<u32> = (0..N).map(|i| (7 * i + 1) as u32).collect();
    let mut b: Vec<u32> = (0..N).map(|i| (i as u32) ^ 0x5a5a_5a5a).collect();
    for s in 1..=steps {
        for (y, x) in b.iter_mut().zip(&a) {
            *y = y.wrapping_mul(2_654_435_761).wrapping_add(x ^ s);
        }
    }
    a.iter().chain(&b).flat_map(|w| w.to_le_bytes()).collect()
}
