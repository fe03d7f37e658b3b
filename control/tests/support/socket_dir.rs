//! For the tests of the socket directory's rule and of who serves a socket (this crate's and the
//! CLI's, which include this file with `#[path]`): a private directory, permission changes, and
//! a process that serves nothing.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// Sets the permission bits of `path` to `mode`.
pub fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A private directory `sock` in a new temporary directory.
pub fn private_dir() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sock");
    std::fs::create_dir(&dir).unwrap();
    chmod(&dir, 0o700);
    (tmp, dir)
}

/// `sleep 60`, killed when dropped.
pub struct Sleeper(Child);

impl Sleeper {
    /// Starts one.
    pub fn start() -> Sleeper {
        Sleeper::start_as(None)
    }

    /// Starts one as the user (and group) `uid` if given (which needs root).
    pub fn start_as(uid: Option<u32>) -> Sleeper {
        let mut cmd = Command::new("sleep");
        cmd.arg("60").stdin(Stdio::null());
        if let Some(uid) = uid {
            use std::os::unix::process::CommandExt;
            cmd.uid(uid).gid(uid);
        }
        Sleeper(cmd.spawn().unwrap())
    }

    /// Its PID.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
