//! A test program started in the background for CRIU to dump (this crate's `criu-testee`, the
//! CRIU plugin's `plugin-testee`), shared by their CRIU tests, which include this file by path.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A testee running: its process, and the files it writes.
pub struct Testee {
    /// The process.
    pub child: Child,
    /// Its pid.
    pub pid: i32,
    /// Where it writes its result when it finishes.
    pub out: PathBuf,
    /// Where it says it is ready to be dumped.
    pub ready: PathBuf,
}

/// Starts `exe [before...] OUT [args...] --ready READY`, stdio on `/dev/null`, where OUT is
/// `dir/NAME.out` and READY `dir/NAME.ready`.
pub fn start(exe: &str, dir: &Path, name: &str, before: &[&OsStr], args: &[&str]) -> Testee {
    let out = dir.join(format!("{name}.out"));
    let ready = dir.join(format!("{name}.ready"));
    let child = Command::new(exe)
        .args(before)
        .arg(&out)
        .args(args)
        .arg("--ready")
        .arg(&ready)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {exe}: {e}"));
    let pid = i32::try_from(child.id()).unwrap();
    Testee {
        child,
        pid,
        out,
        ready,
    }
}

/// The text of `path` once it is there and not empty; fails the test after `timeout`.
pub fn wait_for_file(path: &Path, timeout: Duration) -> String {
    let end = Instant::now() + timeout;
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if !s.is_empty() {
                return s;
            }
        }
        assert!(
            Instant::now() < end,
            "{} did not appear within {timeout:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
