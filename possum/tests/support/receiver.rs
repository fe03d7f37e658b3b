//! `possum receive` as the CLI's migration tests start it: one migration into `DIR/received`,
//! on a loopback port of its choosing; included by criu_cli.rs.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use super::cli::possum_checkpointing_in as possum;
use super::{say, WAIT};

/// A `possum receive` of one migration into `dir/received`, with `key`, and the address it
/// listens on.
pub struct Receiver {
    pub child: Child,
    pub addr: String,
    /// Its stderr after the first line, as it comes.
    pub log: std::sync::Arc<std::sync::Mutex<String>>,
    /// The thread reading it, done at its end.
    echo: std::thread::JoinHandle<()>,
}

impl Receiver {
    pub fn start(dir: &Path, key: &str, env: &[(&str, &str)]) -> Receiver {
        Receiver::start_timeout(dir, key, env, 20)
    }

    /// [`Receiver::start`] with `--timeout SECS` (each wait of the exchange).
    pub fn start_timeout(dir: &Path, key: &str, env: &[(&str, &str)], secs: u32) -> Receiver {
        Receiver::start_with(dir, key, &[], env, secs)
    }

    /// `possum receive --serve`: one migration after another, until killed.
    pub fn serving(dir: &Path, key: &str) -> Receiver {
        Receiver::start_with(dir, key, &["--serve"], &[], 20)
    }

    fn start_with(
        dir: &Path,
        key: &str,
        args: &[&str],
        env: &[(&str, &str)],
        secs: u32,
    ) -> Receiver {
        let mut child = possum(dir)
            .args(["receive", "--json", "--listen", "127.0.0.1:0", "--timeout"])
            .arg(secs.to_string())
            .args(args)
            .arg("--key-file")
            .arg(dir.join(key))
            .arg("-D")
            .arg(dir.join("received"))
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        stderr.read_line(&mut line).unwrap();
        let addr = line
            .trim()
            .strip_prefix("possum: receiving on ")
            .unwrap_or_else(|| panic!("possum receive said {line:?}"))
            .to_string();
        // The rest of its stderr, echoed and kept (and never blocking it).
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let kept = log.clone();
        let echo = std::thread::spawn(move || {
            for l in stderr.lines().map_while(Result::ok) {
                say(&format!("possum receive: {l}"));
                kept.lock().unwrap().push_str(&format!("{l}\n"));
            }
        });
        Receiver {
            child,
            addr,
            log,
            echo,
        }
    }

    /// Its stderr so far, once it has said `what` (within [`WAIT`]).
    pub fn said(&self, what: &str) -> String {
        let t = Instant::now();
        loop {
            let log = self.log.lock().unwrap().clone();
            if log.contains(what) {
                return log;
            }
            assert!(
                t.elapsed() < WAIT,
                "possum receive did not say {what:?}: {log}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its exit and stdout (its stderr all in `log` then).
    pub fn finish(self) -> (ExitStatus, String) {
        let out = self.output();
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    /// Kills it, and waits for its end.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        let _ = self.finish();
    }

    /// Its exit, stdout, and stderr after the first line (all of `log`).
    pub fn output(self) -> Output {
        let mut out = self.child.wait_with_output().unwrap();
        let _ = self.echo.join();
        out.stderr = self.log.lock().unwrap().clone().into_bytes();
        out
    }
}
