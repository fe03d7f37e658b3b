//! The job's process: whether it lives, killing it, one checkpoint of it at a time, and the
//! helper processes possum starts beside it (a keeper).

use std::fs;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Whether process `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    pid > 0 && stat_of(pid).is_some_and(|s| s.state != 'Z')
}

/// What `/proc/PID/stat` says of a process: its state, its parent and when it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcStat {
    /// The state letter (`R`, `S`, `Z`, ...).
    state: char,
    /// Its parent's PID.
    ppid: i32,
    /// The kernel's `PF_*` flags.
    flags: u64,
    /// When it started, in clock ticks since boot.
    start_ticks: u64,
}

/// `PF_EXITING`: the process is being torn down.
const PF_EXITING: u64 = 0x4;

/// `/proc/PID/stat` of process `pid`, if it exists.
fn stat_of(pid: i32) -> Option<ProcStat> {
    let s = possum_control::proc_text(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything: fields are counted
    // after its last `)`. Field 3 is the state, 4 the parent, 9 the flags, 22 the start time.
    let (_, rest) = s.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(ProcStat {
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        flags: fields.get(6)?.parse().ok()?,
        start_ticks: fields.get(19)?.parse().ok()?,
    })
}

/// A process that holds a PID a restore needs free (CRIU restores a job under its old PIDs).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PidTaken {
    /// A process that has not ended (running, or still exiting).
    #[error("process {pid} has not ended")]
    Live {
        /// The PID.
        pid: i32,
    },
    /// A process that has ended and that its parent has not reaped: its PID stays taken until
    /// its parent waits for it.
    #[error(
        "process {pid} has ended, but its parent (process {parent}) has not reaped it, and its \
         PID stays taken until the parent does"
    )]
    Unreaped {
        /// The PID.
        pid: i32,
        /// Its parent.
        parent: i32,
    },
}

/// What holds PID `pid`, if a process does.
pub fn pid_taken(pid: i32) -> Option<PidTaken> {
    let s = stat_of(pid)?;
    Some(match s.state {
        'Z' => PidTaken::Unreaped {
            pid,
            parent: s.ppid,
        },
        _ => PidTaken::Live { pid },
    })
}

/// Whether process (or thread) `pid` is ending: killed, and not yet torn down by the kernel.
pub fn ending(pid: i32) -> bool {
    stat_of(pid).is_some_and(|s| s.state != 'Z' && s.flags & PF_EXITING != 0)
}

/// Waits until no process holds any of `pids` (a killed job's: each ended, and reaped by its
/// parent), at most `deadline`. What still holds one then.
pub fn wait_pids_free(pids: &[i32], deadline: Duration) -> Result<(), PidTaken> {
    let t = Instant::now();
    loop {
        let Some(taken) = pids.iter().find_map(|&p| pid_taken(p)) else {
            return Ok(());
        };
        if t.elapsed() >= deadline {
            return Err(taken);
        }
        // (Fine slices: a migration's destination waits for these PIDs, the job held.)
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The boot-time clock now, in the clock ticks `/proc/PID/stat` counts start times in.
pub fn boot_ticks_now() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    let hz = rustix::param::clock_ticks_per_second();
    let ns = (t.tv_sec as u128) * 1_000_000_000 + t.tv_nsec as u128;
    (ns * hz as u128 / 1_000_000_000) as u64
}

/// Why a process is not one possum may signal.
#[derive(Debug, thiserror::Error)]
pub enum SignalError {
    /// PIDs 0, 1 and negative ones name a group, init or every process.
    #[error("refusing to signal process {0}: not a single ordinary process")]
    NotAProcess(i32),
    /// possum itself or its parent.
    #[error("refusing to signal process {0}: possum's own process or its parent")]
    Possum(i32),
    /// No such process (any more).
    #[error("process {pid} cannot be opened")]
    Open {
        /// The process.
        pid: i32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Another PID than the job's (CRIU restores a job under its old PID).
    #[error(
        "process {pid} is not the job's PID {job}: it is not the restored job, and is left alone"
    )]
    NotTheJob {
        /// The process.
        pid: i32,
        /// The job's PID.
        job: i32,
    },
    /// It started before the moment given: not the process that was meant.
    #[error(
        "process {pid} started before the restore began (at tick {started}, the restore at \
         {since}): it is not the restored process, and is left alone"
    )]
    Older {
        /// The process.
        pid: i32,
        /// Its start, in clock ticks since boot.
        started: u64,
        /// The moment it had to start after.
        since: u64,
    },
    /// The signal could not be sent.
    #[error("signalling process {pid}")]
    Send {
        /// The process.
        pid: i32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A process held by a pidfd: a signal sent through it reaches that process or none (never
/// another that took its PID since).
#[derive(Debug)]
pub struct Process {
    pid: i32,
    fd: std::os::fd::OwnedFd,
}

impl Process {
    /// Opens process `pid`: a single ordinary process (PID > 1), neither possum nor its parent.
    pub fn open(pid: i32) -> Result<Process, SignalError> {
        if pid <= 1 {
            return Err(SignalError::NotAProcess(pid));
        }
        let me = std::process::id() as i32;
        let parent = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
        if pid == me || pid == parent {
            return Err(SignalError::Possum(pid));
        }
        let raw = rustix::process::Pid::from_raw(pid).ok_or(SignalError::NotAProcess(pid))?;
        let fd = rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()).map_err(
            |e| SignalError::Open {
                pid,
                source: e.into(),
            },
        )?;
        Ok(Process { pid, fd })
    }

    /// Opens the process CRIU reports as restored, `pid`, and verifies that it is the job
    /// `job`: the same PID (CRIU restores a job under its old one), started at or after `since`
    /// (clock ticks since boot, [`boot_ticks_now`] taken before CRIU's restore began), which a
    /// process that held the PID before cannot have. Read after the pidfd is open, so that the
    /// process checked is the one held (or, if it has ended since, the pidfd reaches nothing).
    pub fn restored(pid: i32, job: i32, since: u64) -> Result<Process, SignalError> {
        if pid != job {
            return Err(SignalError::NotTheJob { pid, job });
        }
        let p = Process::open(pid)?;
        let stat = stat_of(pid).ok_or_else(|| SignalError::Open {
            pid,
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        })?;
        if stat.start_ticks < since {
            return Err(SignalError::Older {
                pid,
                started: stat.start_ticks,
                since,
            });
        }
        Ok(p)
    }

    /// Its PID.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// [`kill`](Self::kill)s it and every process below it (each through a pidfd, all opened
    /// before the first signal, so that none is mistaken for a process that took a freed PID):
    /// a job's ranks or workers must not outlive it. One that ended meanwhile is passed over.
    /// All are signalled before any is waited for, and their memory is freed together
    /// ([`kill_together`]).
    pub fn kill_tree(&self) -> Result<(), SignalError> {
        let below: Vec<Process> = crate::tree::descendants(self.pid)
            .into_iter()
            .filter_map(|c| Process::open(c).ok())
            .collect();
        let all: Vec<&Process> = std::iter::once(self).chain(&below).collect();
        kill_together(&all)
    }

    /// Sends it SIGCONT through its pidfd (a process stopped after its dump runs on); one that
    /// ended is passed over.
    pub fn cont(&self) -> Result<(), SignalError> {
        match rustix::process::pidfd_send_signal(&self.fd, rustix::process::Signal::CONT) {
            Ok(()) | Err(rustix::io::Errno::SRCH) => Ok(()),
            Err(e) => Err(SignalError::Send {
                pid: self.pid,
                source: e.into(),
            }),
        }
    }

    /// SIGKILLs it through its pidfd and waits (bounded) until it has ended, its memory freed
    /// beside its exit ([`kill_together`]).
    pub fn kill(&self) -> Result<(), SignalError> {
        kill_together(&[self])
    }

    /// Sends it SIGKILL: whether it is dying now (false: it had ended already).
    fn send_kill(&self) -> Result<bool, SignalError> {
        match rustix::process::pidfd_send_signal(&self.fd, rustix::process::Signal::KILL) {
            Ok(()) => Ok(true),
            Err(rustix::io::Errno::SRCH) => Ok(false),
            Err(e) => Err(SignalError::Send {
                pid: self.pid,
                source: e.into(),
            }),
        }
    }

    /// Waits until it has ended, at most until `deadline` (a pidfd reads ready then).
    fn wait_ended(&self, deadline: Instant) {
        use rustix::event::{poll, PollFd, PollFlags};
        while Instant::now() < deadline {
            let mut fds = [PollFd::new(&self.fd, PollFlags::IN)];
            let ms = rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: 100_000_000,
            };
            match poll(&mut fds, Some(&ms)) {
                Ok(n) if n > 0 => return,
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(_) => return,
            }
        }
    }
}

/// SIGKILLs `procs` (the first before any other: if it cannot be signalled, none is), frees the
/// memory of each while it exits (one thread each, [`possum_criu::release_memory_of_killed`]:
/// a process's exit unmaps its memory alone, which for a job of a few GB is most of its kill),
/// and waits (bounded, 10 s in all) until every one signalled has ended. The first error
/// signalling one, after the others were signalled and waited for.
fn kill_together(procs: &[&Process]) -> Result<(), SignalError> {
    let Some((first, rest)) = procs.split_first() else {
        return Ok(());
    };
    let mut dying = Vec::with_capacity(procs.len());
    if first.send_kill()? {
        dying.push(*first);
    }
    let mut failed = None;
    for p in rest {
        match p.send_kill() {
            Ok(true) => dying.push(*p),
            Ok(false) => {}
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
    }
    let release = |p: &Process| {
        let _ = possum_criu::release_memory_of_killed(p.fd.as_fd());
    };
    if let Some((last, others)) = dying.split_last() {
        std::thread::scope(|sc| {
            for p in others {
                sc.spawn(move || release(p));
            }
            release(last);
        });
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for p in &dying {
        p.wait_ended(deadline);
    }
    failed.map_or(Ok(()), Err)
}

/// SIGKILLs process `pid` and every process below it ([`Process::kill_tree`]; never a PID of 1
/// or less, nor possum or its parent), and waits (bounded) until they are gone: a job's ranks
/// or workers must not outlive it, held by its checkpoint.
pub fn kill_job(pid: i32) -> nix::Result<()> {
    let errno = |e: SignalError| match e {
        SignalError::Open { source, .. } | SignalError::Send { source, .. } => {
            nix::errno::Errno::from_raw(source.raw_os_error().unwrap_or(nix::libc::ESRCH))
        }
        _ => nix::errno::Errno::EPERM,
    };
    Process::open(pid)
        .and_then(|p| p.kill_tree())
        .map_err(errno)
}

/// Continues (SIGCONT) process `pid` and every process below it, each through a pidfd: a tree
/// its dump left stopped runs on.
pub fn continue_tree(pid: i32) -> Result<(), SignalError> {
    crate::tree::with_descendants(pid)
        .into_iter()
        .filter_map(|p| Process::open(p).ok())
        .try_for_each(|p| p.cont())
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
        Ok(line) if line.trim() == "ready" => {
            forward_lines(err);
            return Ok(child);
        }
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

/// Passes what a started keeper says on its stderr (`possum keeper: ...`: its spare image
/// memory made or not, memory it freed) on to this process's, on a thread of its own, for as
/// long as both run: the keeper's notes reach whoever runs `possum`, and its stderr is never a
/// pipe no one reads.
fn forward_lines(from: std::process::ChildStderr) {
    use std::io::{BufRead, Write};
    let forward = move || {
        for line in std::io::BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            let _ = writeln!(std::io::stderr(), "{line}");
        }
    };
    // (Without the thread the pipe is closed: the keeper's own writes never fail it.)
    let _ = std::thread::Builder::new()
        .name("possum-keeper-stderr".into())
        .spawn(forward);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `pid` has ended (gone, or a zombie no one reaped yet).
    fn ended(pid: i32) -> bool {
        stat_of(pid).is_none_or(|s| s.state == 'Z')
    }

    #[test]
    fn a_job_killed_takes_every_process_below_it_along() {
        let mut job = std::process::Command::new("sh")
            .args(["-c", "sleep 300 & (sleep 300 & wait) & wait"])
            .spawn()
            .unwrap();
        let root = job.id() as i32;
        let t = Instant::now();
        let below = loop {
            let d = crate::tree::descendants(root);
            // Two sleeps and the subshell.
            if d.len() >= 3 {
                break d;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "{d:?}");
            std::thread::sleep(Duration::from_millis(10));
        };
        kill_job(root).unwrap();
        let _ = job.wait();
        for p in below {
            assert!(ended(p), "process {p} below the job lives on");
        }
    }

    #[test]
    fn no_group_init_or_possum_is_ever_opened_for_a_signal() {
        let me = std::process::id() as i32;
        let parent = nix::unistd::getppid().as_raw();
        for pid in [i32::MIN, -1, 0, 1] {
            assert!(
                matches!(Process::open(pid), Err(SignalError::NotAProcess(p)) if p == pid),
                "{pid}"
            );
            assert!(kill_job(pid).is_err(), "{pid}");
        }
        for pid in [me, parent] {
            assert!(matches!(Process::open(pid), Err(SignalError::Possum(_))));
        }
    }

    /// A killed child's PID stays taken until it is reaped, and is said so, naming its parent;
    /// it is free once reaped.
    #[test]
    fn a_pid_is_free_only_once_its_process_is_reaped() {
        let mut child = Command::new("sleep").arg("100").spawn().unwrap();
        let pid = child.id() as i32;
        let me = std::process::id() as i32;
        assert_eq!(pid_taken(pid), Some(PidTaken::Live { pid }));
        assert_eq!(
            wait_pids_free(&[pid], Duration::from_millis(20)),
            Err(PidTaken::Live { pid })
        );
        child.kill().unwrap();
        let t = Instant::now();
        while pid_taken(pid) == Some(PidTaken::Live { pid }) {
            assert!(t.elapsed() < Duration::from_secs(10), "not killed");
            std::thread::sleep(Duration::from_millis(5));
        }
        let unreaped = PidTaken::Unreaped { pid, parent: me };
        assert_eq!(pid_taken(pid), Some(unreaped.clone()));
        let e = wait_pids_free(&[pid], Duration::from_millis(50)).unwrap_err();
        assert_eq!(e, unreaped);
        assert!(
            e.to_string()
                .contains(&format!("its parent (process {me}) has not reaped it")),
            "{e}"
        );
        // Reaped while waited for: free.
        let reaper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            child.wait()
        });
        wait_pids_free(&[pid], Duration::from_secs(10)).unwrap();
        assert_eq!(pid_taken(pid), None);
        reaper.join().unwrap().unwrap();
    }

    /// A process that started before the restore began is not taken for the restored one (and
    /// is not signalled); one started after is, and is killed through its pidfd.
    #[test]
    fn only_a_process_started_after_the_mark_is_taken_for_the_restored_one() {
        let mut before = Command::new("sleep").arg("100").spawn().unwrap();
        // At least one clock tick (10 ms at 100 Hz) between its start and the mark.
        std::thread::sleep(Duration::from_millis(50));
        let since = boot_ticks_now();
        let b = before.id() as i32;
        let e = Process::restored(b, b, since).unwrap_err();
        assert!(matches!(e, SignalError::Older { .. }), "{e:?}");
        assert!(before.try_wait().unwrap().is_none(), "left alone");
        let mut after = Command::new("sleep").arg("100").spawn().unwrap();
        let a = after.id() as i32;
        let e = Process::restored(a, b, since).unwrap_err();
        assert!(matches!(e, SignalError::NotTheJob { .. }), "{e:?}");
        let p = Process::restored(a, a, since).unwrap();
        assert_eq!(p.pid(), after.id() as i32);
        p.kill().unwrap();
        let status = after.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(9));
        assert!(before.try_wait().unwrap().is_none(), "the other still runs");
        before.kill().unwrap();
        before.wait().unwrap();
    }
}
