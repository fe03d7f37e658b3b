//! A fake_session_job (`interposer/tests/fake/fake_session_job.c`, FAKE_VIA=entry) commanded
//! through a FIFO and answering into a file opened O_APPEND: CRIU reopens both by path at a
//! restore, where pipes to the test would come back connected to nothing. Shared by the CLI's
//! tests that checkpoint, restore or migrate it; included by criu_cli.rs,
//! which provides `common` and `WAIT`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::common;
use super::WAIT;

/// fake_session_job, in a session of its own (CRIU dumps it without --shell-job), commanded
/// through a FIFO, answering into a file. Killed when dropped if it is still our child.
pub struct Job {
    pub child: Option<Child>,
    pub pid: i32,
    /// The FIFO's write end (opened read-write: never blocks, never sees the job's end).
    pub cmds: File,
    pub out: PathBuf,
    pub stderr: PathBuf,
    /// Answers read so far.
    pub seen: usize,
}

impl Job {
    pub fn start(dir: &Path, name: &str, lib: Option<&Path>) -> Job {
        let mut job = Job::spawn(dir, name, lib, &[]);
        job.expect("ready");
        job
    }

    /// The job started with `env` added, before its first answer.
    pub fn spawn(dir: &Path, name: &str, lib: Option<&Path>, env: &[(&str, &str)]) -> Job {
        let mut cmd = common::fake_job_command(dir, "fake_session_job", lib);
        cmd.envs(env.iter().copied());
        Job::spawn_cmd(dir, name, cmd)
    }

    /// The job run by `cmd` (the job itself, or a command that starts it), before its first
    /// answer; `pid` is `cmd`'s process.
    pub fn spawn_cmd(dir: &Path, name: &str, cmd: Command) -> Job {
        Job::spawn_cmd_to(dir, name, cmd, None)
    }

    /// [`Job::spawn_cmd`] with its stderr on `stderr` instead of the file `log` reads.
    pub fn spawn_cmd_to(dir: &Path, name: &str, mut cmd: Command, stderr_to: Option<Stdio>) -> Job {
        let fifo = dir.join(format!("{name}.cmds"));
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let cmds = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&fifo)
            .unwrap();
        let out = dir.join(format!("{name}.out"));
        let stderr = dir.join(format!("{name}.stderr"));
        // O_WRONLY|O_APPEND: CRIU checks no size for such a file at the restore (it grows).
        let append = |p: &Path| {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .unwrap()
        };
        cmd.env("FAKE_VIA", "entry")
            .env("FAKE_CMDS", &fifo)
            .env("POSSUM_SOCKET_DIR", dir.join("sockets"))
            .env("POSSUM_VERBOSE", "1")
            .stdin(Stdio::null())
            .stdout(append(&out))
            .stderr(match stderr_to {
                Some(to) => to,
                None => append(&stderr).into(),
            });
        // SAFETY: setsid is async-signal-safe and touches no memory of this process.
        unsafe {
            cmd.pre_exec(|| nix::unistd::setsid().map(|_| ()).map_err(Into::into));
        }
        let child = cmd.spawn().unwrap();
        let pid = child.id() as i32;
        Job {
            child: Some(child),
            pid,
            cmds,
            out,
            stderr,
            seen: 0,
        }
    }

    /// The job's next answer, whatever it is, within [`WAIT`].
    pub fn next(&mut self) -> String {
        let t = Instant::now();
        loop {
            let text = std::fs::read_to_string(&self.out).unwrap_or_default();
            if let Some(l) = text
                .split_inclusive('\n')
                .nth(self.seen)
                .filter(|l| l.ends_with('\n'))
            {
                self.seen += 1;
                return l.trim_end().to_string();
            }
            assert!(t.elapsed() < WAIT, "no answer from the job within {WAIT:?}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// The job's next answer, which must be `want`, within [`WAIT`].
    pub fn expect(&mut self, want: &str) {
        let t = Instant::now();
        loop {
            let text = std::fs::read_to_string(&self.out).unwrap_or_default();
            // Complete lines only.
            let lines: Vec<&str> = text.split_inclusive('\n').collect();
            if let Some(l) = lines.get(self.seen).filter(|l| l.ends_with('\n')) {
                assert_eq!(l.trim_end(), want, "job's stderr:\n{}", self.log());
                self.seen += 1;
                return;
            }
            assert!(
                t.elapsed() < WAIT,
                "no answer {want:?} from the job within {WAIT:?}; its answers:\n{text}\nstderr:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Sends `cmd` and waits for its answer `want`.
    pub fn run(&mut self, cmd: &str, want: &str) {
        writeln!(self.cmds, "{cmd}").unwrap();
        self.expect(want);
    }

    /// Has the job write its buffers to `path` and returns them.
    pub fn dump(&mut self, path: &Path) -> Vec<u8> {
        self.run(&format!("dump {}", path.display()), "dumped");
        std::fs::read(path).unwrap()
    }

    /// The commands after a checkpoint or a migration (steps 6 to 12, a cudaMalloc, two dumps
    /// into `dir/TAG-mid.bin` and `dir/TAG-end.bin`), the same for the reference and the job
    /// checkpointed: the buffers after each dump.
    pub fn after_checkpoint(&mut self, dir: &Path, tag: &str) -> [Vec<u8>; 2] {
        self.run("step 4", "done 9");
        self.run("malloc", "malloced");
        let mid = self.dump(&dir.join(format!("{tag}-mid.bin")));
        self.run("step 3", "done 12");
        let end = self.dump(&dir.join(format!("{tag}-end.bin")));
        [mid, end]
    }

    /// Leaves the job's process to a thread that reaps it as soon as it ends, so that its pid is
    /// free at once (a migration's CRIU restore needs it); dropped, the job is then killed by pid.
    pub fn reap_in_background(&mut self) {
        if let Some(mut child) = self.child.take() {
            std::thread::spawn(move || child.wait());
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        } else if self.pid > 0 {
            // A restored job (adopted: this process is a subreaper) that did not exit.
            let pid = nix::unistd::Pid::from_raw(self.pid);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = possum_criu::wait_for_exit(self.pid, Some(WAIT));
        }
    }
}
