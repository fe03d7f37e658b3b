//! The processes around a dump or restore: is the target alive, and waiting for a restored one.
//!
//! CRIU restores a tree *detached*: in swrk mode the restored root is first a child of the
//! `criu swrk` worker, which exits once the restore is done. The root is then reparented to the
//! nearest ancestor that is a child subreaper, or to init. To `waitpid` a restored process,
//! either call [`set_child_subreaper`] once before restoring (the root is reparented to this
//! process when the worker exits; [`crate::Criu::restore`] returns after that), or restore with
//! [`crate::RestoreOptions::restore_sibling`] (CRIU creates the root with `CLONE_PARENT`, so it
//! is this process's child from the start). Then [`wait_for_exit`] reaps it.

use std::fmt;
use std::io;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::CriuError;

/// How a waited-for process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessExit {
    /// It exited with this status.
    Exited(i32),
    /// It was killed by this signal.
    Signaled(i32),
}

impl ProcessExit {
    /// True for `Exited(0)`.
    pub fn success(self) -> bool {
        self == ProcessExit::Exited(0)
    }
}

impl fmt::Display for ProcessExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ProcessExit::Exited(code) => write!(f, "exited with status {code}"),
            ProcessExit::Signaled(sig) => match nix::sys::signal::Signal::try_from(sig) {
                Ok(s) => write!(f, "killed by {s}"),
                Err(_) => write!(f, "killed by signal {sig}"),
            },
        }
    }
}

/// Makes this process a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`): orphaned descendants,
/// such as a tree restored by CRIU once its `criu swrk` worker exits, are reparented to this
/// process instead of init, so it can wait for them. It applies to the whole process and lasts
/// until it exits; orphans it adopts must then be reaped by it.
pub fn set_child_subreaper() -> Result<(), CriuError> {
    nix::sys::prctl::set_child_subreaper(true).map_err(|e| CriuError::Io {
        what: "prctl(PR_SET_CHILD_SUBREAPER)".into(),
        source: e.into(),
    })
}

/// Waits for the child (or adopted orphan) `pid` to exit and reaps it. With a timeout, polls
/// every few milliseconds and gives up after it with [`CriuError::WaitTimeout`] (the process is
/// left running). Fails with [`CriuError::NotAChild`] when `pid` is not this process's child.
pub fn wait_for_exit(pid: i32, timeout: Option<Duration>) -> Result<ProcessExit, CriuError> {
    let deadline = timeout.map(|t| (Instant::now() + t, t));
    let flags = deadline.map(|_| WaitPidFlag::WNOHANG);
    loop {
        match waitpid(Pid::from_raw(pid), flags) {
            Ok(WaitStatus::Exited(_, code)) => return Ok(ProcessExit::Exited(code)),
            Ok(WaitStatus::Signaled(_, sig, _)) => return Ok(ProcessExit::Signaled(sig as i32)),
            Ok(WaitStatus::StillAlive) => {
                if let Some((end, timeout)) = deadline {
                    if Instant::now() >= end {
                        return Err(CriuError::WaitTimeout { pid, timeout });
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(_) | Err(Errno::EINTR) => {}
            Err(Errno::ECHILD) => return Err(CriuError::NotAChild { pid }),
            Err(e) => {
                return Err(CriuError::Io {
                    what: format!("waitpid({pid})"),
                    source: e.into(),
                })
            }
        }
    }
}

/// Frees the memory of a process being killed (SIGKILL sent, `pidfd` its pidfd) now, in this
/// thread, beside the process's own exit (`process_mrelease(2)`, Linux 5.15): the two unmap its
/// address space together, so a job of a few GB ends in about half the time, and its PIDs are
/// free sooner for a restore on this host. An error where the kernel lacks the call, or the
/// process is not dying (`EINVAL`) or has already ended; the caller then just waits.
pub fn release_memory_of_killed(pidfd: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: process_mrelease takes a pidfd and a flags word (0) by value, reads and writes no
    // memory of this process, and `pidfd` is borrowed, so open for the call.
    let r = unsafe { libc::syscall(libc::SYS_process_mrelease, pidfd.as_raw_fd(), 0u32) };
    match r {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// The resident memory of the tree rooted at `pid` (it and its descendants), in bytes; what
/// cannot be read counts as nothing.
pub fn tree_resident_bytes(pid: i32) -> u64 {
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|p| u64::try_from(p).ok())
        .unwrap_or(4096);
    let pages: u64 = tree_of(pid)
        .into_iter()
        .map(|p| {
            std::fs::read_to_string(format!("/proc/{p}/statm"))
                .ok()
                .and_then(|s| s.split_whitespace().nth(1)?.parse().ok())
                .unwrap_or(0u64)
        })
        .sum();
    pages.saturating_mul(page)
}

/// `pid` and every process below it (each thread's children, from /proc), each once.
pub(crate) fn tree_of(pid: i32) -> Vec<i32> {
    let mut todo = vec![pid];
    let mut seen = Vec::new();
    while let Some(p) = todo.pop() {
        if !seen.contains(&p) {
            seen.push(p);
            todo.extend(children_of(p));
        }
    }
    seen
}

/// The children of every thread of `pid` (none when it is gone).
pub(crate) fn children_of(pid: i32) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut children = Vec::new();
    for task in tasks.flatten() {
        let Ok(list) = std::fs::read_to_string(task.path().join("children")) else {
            continue;
        };
        children.extend(
            list.split_whitespace()
                .filter_map(|c| c.parse::<i32>().ok()),
        );
    }
    children
}

/// SIGSTOPs `pid` and every process below it (each thread's children, from /proc), for a
/// tree CRIU holds frozen: the signal waits until CRIU lets each go, which then stops at once.
pub(crate) fn stop_tree(pid: i32) {
    for p in tree_of(pid).into_iter().filter(|&p| p > 1) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p),
            nix::sys::signal::Signal::SIGSTOP,
        );
    }
}

/// The parent of `pid`, from `/proc/<pid>/stat`.
pub(crate) fn parent_of(pid: i32) -> Option<i32> {
    let stat = possum_control::proc_text(format!("/proc/{pid}/stat")).ok()?;
    // After the parenthesised command name (which may hold anything): state, then parent.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Fails unless `pid` names a live (non-zombie) process: CRIU's own error for a missing process
/// is a line deep in its log.
pub(crate) fn check_alive(pid: i32) -> Result<(), CriuError> {
    if pid <= 0 {
        return Err(CriuError::InvalidOptions(format!(
            "pid {pid}: the process to dump must be given by a positive PID"
        )));
    }
    let path = format!("/proc/{pid}/stat");
    let stat = match possum_control::proc_text(&path) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(CriuError::NoSuchProcess { pid })
        }
        // ESRCH: the process vanished between open and read.
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
            return Err(CriuError::NoSuchProcess { pid })
        }
        Err(source) => {
            return Err(CriuError::Io {
                what: format!("reading {path}"),
                source,
            })
        }
    };
    // The state follows the command name, which is parenthesised and may hold anything.
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next());
    match state {
        Some("Z") => Err(CriuError::Zombie { pid }),
        Some("X") | Some("x") => Err(CriuError::NoSuchProcess { pid }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive() {
        check_alive(std::process::id() as i32).unwrap();
    }

    /// The memory of a process that is not being killed is never freed: the call is refused
    /// (`EINVAL`) and the process runs on. Once it is killed, the call is taken (or finds it
    /// gone already) and the process ends.
    #[test]
    fn only_a_killed_process_has_its_memory_released() {
        use std::os::fd::{AsFd, FromRawFd, OwnedFd};
        let mut child = std::process::Command::new("sleep")
            .arg("100")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        // SAFETY: pidfd_open takes a PID and flags by value; the descriptor it returns is owned
        // here alone.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0u32) };
        assert!(raw >= 0, "pidfd_open: {}", io::Error::last_os_error());
        // SAFETY: `raw` is a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
        match release_memory_of_killed(fd.as_fd()) {
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                eprintln!("SKIPPED: this kernel has no process_mrelease");
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}"),
            Ok(()) => panic!("the memory of a live process was released"),
        }
        check_alive(pid).unwrap();
        nix::sys::signal::kill(Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
        match release_memory_of_killed(fd.as_fd()) {
            Ok(()) => {}
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ESRCH), "{e}"),
        }
        assert!(!child.wait().unwrap().success());
    }

    /// A process whose name is not UTF-8 (run through a link so named: the kernel names a process
    /// after the file it was run as, cut at 15 bytes) is alive, and its parent is found.
    #[test]
    fn a_process_whose_name_is_not_utf8_is_alive() {
        use std::os::unix::ffi::OsStrExt as _;
        let tmp = tempfile::tempdir().unwrap();
        let exe = tmp
            .path()
            .join(std::ffi::OsStr::from_bytes(b"sleep \xe6\x97"));
        // A link, not a copy: a file just written may still be open in a child another test
        // forks meanwhile (ETXTBSY).
        std::os::unix::fs::symlink("/bin/sleep", &exe).unwrap();
        let mut child = std::process::Command::new(&exe).arg("5").spawn().unwrap();
        let pid = child.id() as i32;
        let stat = std::fs::read(format!("/proc/{pid}/stat")).unwrap();
        let alive = check_alive(pid);
        let parent = parent_of(pid);
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(String::from_utf8(stat).is_err(), "the name is UTF-8");
        alive.unwrap();
        assert_eq!(parent, Some(std::process::id() as i32));
    }

    #[test]
    fn a_reaped_child_does_not_exist_and_an_unreaped_one_is_a_zombie() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        // Wait until it has exited without reaping it.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match check_alive(pid) {
                Err(CriuError::Zombie { pid: p }) => {
                    assert_eq!(p, pid);
                    break;
                }
                Ok(()) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                other => panic!("unexpected {other:?}"),
            }
        }
        child.wait().unwrap();
        match check_alive(pid) {
            Err(CriuError::NoSuchProcess { pid: p }) => assert_eq!(p, pid),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    #[allow(clippy::zombie_processes)] // wait_for_exit reaps it.
    fn wait_for_exit_reports_status_and_rejects_strangers() {
        let child = std::process::Command::new("sh")
            .args(["-c", "exit 7"])
            .spawn()
            .unwrap();
        let exit = wait_for_exit(child.id() as i32, Some(Duration::from_secs(10))).unwrap();
        assert_eq!(exit, ProcessExit::Exited(7));
        assert!(!exit.success());
        assert_eq!(exit.to_string(), "exited with status 7");
        // PID 1 is never our child.
        assert!(matches!(
            wait_for_exit(1, None),
            Err(CriuError::NotAChild { pid: 1 })
        ));
    }

    #[test]
    fn this_process_has_resident_memory() {
        let bytes = tree_resident_bytes(std::process::id() as i32);
        assert!(bytes >= 4096, "{bytes}");
        assert_eq!(tree_resident_bytes(i32::MAX), 0);
    }

    #[test]
    fn non_positive_pid_is_rejected() {
        assert!(matches!(check_alive(0), Err(CriuError::InvalidOptions(_))));
    }
}
