//! The job's process: whether it lives, killing it, one checkpoint of it at a time, and the
//! helper processes possum starts beside it (a keeper).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Whether process `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// SIGKILLs process `pid` and waits (bounded) until it is gone.
pub fn kill_job(pid: i32) -> nix::Result<()> {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let t = Instant::now();
    while alive(pid) && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Why the lock of a process's checkpoint could not be had.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// The process's user could not be read.
    #[error("the user of process {pid}")]
    Owner {
        /// The process.
        pid: i32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The socket directory, or the lock file in it, is refused or could not be made.
    #[error(transparent)]
    Dir(#[from] possum_control::DirError),
    /// Another checkpoint holds it.
    #[error("a checkpoint of process {pid} is already running (lock {})", path.display())]
    Busy {
        /// The process.
        pid: i32,
        /// The lock file.
        path: PathBuf,
    },
}

/// Holds `possum-<pid>.lock` in the socket directory: one checkpoint of a process at a time.
///
/// The directory must pass `possum_control::prepare_dir` for the job's user or this process's
/// (created for the job's user when missing); the lock file is opened there without following
/// a symbolic link and must be a regular file of one of them with one link.
pub fn lock_pid(dir: &Path, pid: i32) -> Result<nix::fcntl::Flock<fs::File>, LockError> {
    use nix::fcntl::{Flock, FlockArg};
    let job = possum_control::process_uid(pid as u32)
        .map_err(|source| LockError::Owner { pid, source })?;
    let me = nix::unistd::geteuid().as_raw();
    let owners = if job == me { vec![job] } else { vec![job, me] };
    let name = format!("possum-{pid}.lock");
    let f = possum_control::prepare_dir(dir, &owners)?.open_private_file(&name)?;
    Flock::lock(f, FlockArg::LockExclusiveNonblock).map_err(|_| LockError::Busy {
        pid,
        path: dir.join(name),
    })
}

/// How long a caller of [`start_keeper`] waits for the keeper to listen.
const KEEPER_START_TIMEOUT: Duration = Duration::from_secs(30);

/// Starts `EXE keeper --dir DIR --while-alive PID` (`exe`: the possum executable; `configure`
/// may set its environment) in its own process group, so that a Ctrl-C at a terminal reaches a
/// job and not the memory kept for it, and returns it once it listens. If it ends instead, its
/// message is the error. Its output is not read afterwards (it writes nothing while it serves).
pub fn start_keeper(
    exe: &Path,
    dir: &Path,
    while_alive: i32,
    configure: impl FnOnce(&mut Command),
) -> Result<Child> {
    use std::io::{BufRead, Read};
    let mut cmd = Command::new(exe);
    cmd.arg("keeper")
        .arg("--dir")
        .arg(dir)
        .arg("--while-alive")
        .arg(while_alive.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    configure(&mut cmd);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().context("starting `possum keeper`")?;
    let out = child.stdout.take().context("the keeper's stdout")?;
    let mut err = child.stderr.take().context("the keeper's stderr")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::BufReader::new(out).read_line(&mut line);
        let _ = tx.send(line);
    });
    let failed = match rx.recv_timeout(KEEPER_START_TIMEOUT) {
        Ok(line) if line.trim() == "ready" => return Ok(child),
        Ok(_) => {
            let mut why = String::new();
            let _ = err.read_to_string(&mut why);
            format!(
                "it did not start: {}",
                why.trim().trim_start_matches("possum: error: ")
            )
        }
        Err(_) => format!("it did not listen within {KEEPER_START_TIMEOUT:?}"),
    };
    let _ = child.kill();
    let _ = child.wait();
    bail!(failed)
}
