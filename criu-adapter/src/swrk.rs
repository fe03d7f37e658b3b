//! One `criu swrk` worker: the process, its socket, one request and its answer.
//!
//! `criu swrk <fd>` serves CRIU's RPC protocol on the already-connected `SOCK_SEQPACKET` socket it
//! inherits as descriptor `<fd>`: one `criu_req` per packet in, one `criu_resp` per packet out. It
//! serves one request (CRIU only keeps the socket open for a few read-only request types) and
//! exits. The socket pair is created close-on-exec; only the worker's end is made inheritable,
//! in the forked child just before `exec`, so no other process spawned meanwhile (by another
//! thread) gets a copy. Descriptors named in requests (`images_dir_fd`) need not be inherited:
//! CRIU opens them as `/proc/<peer>/fd/<n>`, the peer being the process that created the socket
//! pair (this one), so they only have to stay open here until the answer arrives.
//!
//! The worker's stdout and stderr go to an unlinked temporary file, read back for error messages
//! (a loader that cannot find a library, a crash) when the worker ends without answering.
//!
//! Every wait on the worker has a deadline. The worker gets `SIGKILL` when its parent ends
//! (`PR_SET_PDEATHSIG`). Its parent is a [guard](crate::guard) that kills whatever it leaves
//! behind when this process dies, except when the restored root is to be the worker's sibling
//! (`rst_sibling`): the guard would then be its parent, so the worker is this process's child
//! and dies with the thread that started it. Past a deadline,
//! [`Worker::kill_tree`] stops the worker and every task under it (those a restore has created
//! and not yet handed over, helpers it runs), walking `/proc/<pid>/task/<tid>/children` until no
//! new task turns up, then kills them all: CRIU blocks every catchable signal, and a task it has
//! half restored does not end when CRIU does (it waits, or spins, for a stage that never comes).

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, FdFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, Signal};
use nix::sys::socket::{
    recv, send, shutdown, socketpair, AddressFamily, MsgFlags, Shutdown, SockFlag, SockType,
};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use prost::Message;

use crate::process::{children_of, parent_of};
use crate::rpc::{CriuReq, CriuResp, ReqType};
use crate::CriuError;

/// How much of the worker's output an error message carries.
const OUTPUT_TAIL_BYTES: u64 = 4096;

/// The longest single sleep while waiting for the worker (it is woken early by an answer).
const POLL_SLICE: Duration = Duration::from_millis(200);

/// How long, after killing them, the tasks of [`Worker::kill_tree`] that are this process's
/// children are waited for (a task in uninterruptible sleep dies only when it wakes).
const REAP_WAIT: Duration = Duration::from_secs(5);

/// How often a worker is looked at while it is waited for to exit.
const EXIT_POLL: Duration = Duration::from_millis(1);

/// How long a worker made ready and never asked is given to end once its socket is shut.
const UNASKED_EXIT: Duration = Duration::from_secs(2);

/// How long a worker that closed its socket is given to exit.
const EXIT_WAIT: Duration = Duration::from_secs(10);

/// At most this many passes over the tree when stopping it (each pass stops what the last found).
const STOP_PASSES: usize = 1000;

/// What becomes of the worker when this process dies during a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnOwnerDeath {
    /// Killed at once with its parent (`PR_SET_PDEATHSIG`), without a guard: what it was
    /// restoring is left behind.
    DiesWithParent,
    /// Killed at once by its guard, with the tasks under it.
    KilledAtOnce,
    /// Left to finish until the deadline (a dump: CRIU killed midway may leave the tree stopped
    /// or with its parasite in it), then killed by its guard, with the tasks under it.
    FinishesBy(Instant),
}

/// A running `criu swrk`.
#[derive(Debug)]
pub(crate) struct Worker {
    child: Child,
    sock: OwnedFd,
    output: File,
    op: &'static str,
    /// Whether `child` is the worker's guard rather than the worker.
    guarded: bool,
}

/// `fd` at a number above 2, which a descriptor the worker inherits needs (the spawn replaces
/// stdin, stdout and stderr): itself, or a close-on-exec duplicate (`try_clone` takes the
/// lowest free number from 3).
pub(crate) fn above_stdio(fd: OwnedFd, what: &'static str) -> Result<OwnedFd, CriuError> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    fd.try_clone()
        .map_err(|source| CriuError::Socket { what, source })
}

impl Worker {
    /// Starts `binary swrk <fd>` for the request `op` (named in errors), loading the plugins in
    /// `plugin_dir` (as `CRIU_LIBS_DIR`) when given.
    pub(crate) fn spawn(
        binary: &Path,
        op: &'static str,
        plugin_dir: Option<&Path>,
        inherit: &[RawFd],
        on_owner_death: OnOwnerDeath,
    ) -> Result<Self, CriuError> {
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| CriuError::Socket {
            what: "socketpair",
            source: e.into(),
        })?;
        let theirs = above_stdio(theirs, "dup")?;
        let output = capture_file()?;
        let io_err = |e| CriuError::Io {
            what: "duplicating the criu output file".into(),
            source: e,
        };
        let theirs_fd: RawFd = theirs.as_raw_fd();
        let parent = nix::unistd::getpid();
        let mut cmd = Command::new(binary);
        cmd.arg("swrk")
            .arg(theirs_fd.to_string())
            .stdin(Stdio::null())
            .stdout(output.try_clone().map_err(io_err)?)
            .stderr(output.try_clone().map_err(io_err)?);
        if let Some(dir) = plugin_dir {
            cmd.env("CRIU_LIBS_DIR", dir);
        }
        // The descriptors the worker inherits: its socket, and those a restore hands the tree
        // (`inherit_fd`, numbered above 2 by the caller). Copied before the fork.
        let mut keep: Vec<RawFd> = vec![theirs_fd];
        keep.extend(inherit.iter().copied().filter(|&fd| fd > 2));
        // SAFETY: the closure runs in the forked child before exec. It only calls fcntl(2),
        // prctl(2) and getppid(2), which are async-signal-safe, through nix's thin wrappers (no
        // allocation, no locks; `keep` was allocated before the fork and is only read, and the
        // errors are made from raw numbers), on descriptor numbers that are open in the child
        // (they were open here, close-on-exec only, when we forked), and `guard::split`, which
        // is meant for exactly this place.
        unsafe {
            cmd.pre_exec(move || {
                for &fd in &keep {
                    fcntl(fd, FcntlArg::F_SETFD(FdFlag::empty())).map_err(io::Error::from)?;
                }
                let parent = match on_owner_death {
                    OnOwnerDeath::DiesWithParent => parent,
                    OnOwnerDeath::KilledAtOnce => crate::guard::split(parent, None)?,
                    OnOwnerDeath::FinishesBy(end) => crate::guard::split(parent, Some(end))?,
                };
                // Die with the parent; if it is already gone, do not start.
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(io::Error::from)?;
                if nix::unistd::getppid() != parent {
                    return Err(io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|source| CriuError::Spawn {
            binary: binary.to_owned(),
            source,
        })?;
        drop(theirs);
        tracing::debug!(pid = child.id(), binary = %binary.display(), op, ?plugin_dir, "started criu swrk");
        Ok(Self {
            child,
            sock: ours,
            output,
            op,
            guarded: on_owner_death != OnOwnerDeath::DiesWithParent,
        })
    }

    /// The PID of the worker, or of its guard.
    pub(crate) fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap_or(i32::MAX)
    }

    /// Sends `req` and returns CRIU's answer, or `None` when none came by `deadline`. `NOTIFY`
    /// messages (action scripts) are told to `on_notify`, then answered with its verdict
    /// (`false`: the script failed).
    pub(crate) fn request(
        &mut self,
        req: &CriuReq,
        deadline: Instant,
        mut on_notify: impl FnMut(&crate::rpc::Notify) -> bool,
    ) -> Result<Option<CriuResp>, CriuError> {
        self.send(req)?;
        loop {
            if !self.readable_by(deadline)? {
                return Ok(None);
            }
            let resp = self.recv()?;
            if resp.r#type == ReqType::Notify as i32 {
                tracing::debug!(notify = ?resp.notify, "criu notification");
                let success = resp.notify.as_ref().is_none_or(&mut on_notify);
                self.send(&CriuReq {
                    r#type: ReqType::Notify as i32,
                    notify_success: Some(success),
                    ..Default::default()
                })?;
                continue;
            }
            return Ok(Some(resp));
        }
    }

    /// Waits for the worker to exit, or `None` when it still runs at `deadline`.
    pub(crate) fn finish(&mut self, deadline: Instant) -> Result<Option<ExitStatus>, CriuError> {
        // Shutting our end first lets a worker still waiting for a request exit.
        let _ = shutdown(self.sock.as_raw_fd(), Shutdown::Both);
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Ok(Some(status)),
                Ok(None) => {}
                Err(source) => {
                    return Err(CriuError::Io {
                        what: format!("waiting for criu swrk (pid {})", self.child.id()),
                        source,
                    })
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            // (Fine slices: a worker that answered exits within milliseconds, and the job
            // waits for it.)
            std::thread::sleep((deadline - now).min(EXIT_POLL));
        }
    }

    /// Stops the worker and every task under it, plus those of `adopted` that are children of
    /// this process (a restored root CRIU created as the worker's sibling), kills them all, and
    /// reaps the worker and whichever of them are this process's children. Returns how many
    /// tasks besides the worker (and its guard) were killed.
    pub(crate) fn kill_tree(&mut self, adopted: &[i32]) -> usize {
        let worker = self.pid();
        let me = std::process::id() as i32;
        // A stopped task neither forks nor reaps: its children stay put (alive, or zombies whose
        // PIDs cannot be reused) while they are read and stopped in turn.
        let _ = kill(Pid::from_raw(worker), Signal::SIGSTOP);
        let mut tasks: Vec<i32> = adopted
            .iter()
            .copied()
            .filter(|&p| p > 0 && p != worker && parent_of(p) == Some(me))
            .collect();
        for &p in &tasks {
            let _ = kill(Pid::from_raw(p), Signal::SIGSTOP);
        }
        // Under a guard, the worker is the guard's child.
        let mut not_counted = 0;
        for pass in 0..STOP_PASSES {
            let mut new = Vec::new();
            for parent in std::iter::once(worker).chain(tasks.iter().copied()) {
                for c in children_of(parent) {
                    if c != worker && !tasks.contains(&c) && !new.contains(&c) {
                        let _ = kill(Pid::from_raw(c), Signal::SIGSTOP);
                        new.push(c);
                    }
                }
            }
            if pass == 0 && self.guarded {
                not_counted = new
                    .iter()
                    .filter(|&&c| parent_of(c) == Some(worker))
                    .count();
            }
            if new.is_empty() {
                break;
            }
            tasks.extend(new);
        }
        for &p in &tasks {
            let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The worker's end has reparented its children: those adopted by this process (a child
        // subreaper) are reaped here.
        let end = Instant::now() + REAP_WAIT;
        for &p in &tasks {
            reap(p, end);
        }
        tracing::warn!(
            worker,
            ?tasks,
            op = self.op,
            "killed criu swrk and the tasks under it"
        );
        tasks.len().saturating_sub(not_counted)
    }

    /// Ends a worker made ready and never asked: its socket shut, it ends by itself (and its
    /// guard with it), reaped; killed with what is under it if not within [`UNASKED_EXIT`].
    pub(crate) fn end_unasked(mut self) {
        if !matches!(self.finish(Instant::now() + UNASKED_EXIT), Ok(Some(_))) {
            self.kill_tree(&[]);
        }
    }

    /// Kills and reaps the worker alone.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the socket has something to read (an answer, or the worker's end closing) by
    /// `deadline`.
    fn readable_by(&self, deadline: Instant) -> Result<bool, CriuError> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            // Whole milliseconds, rounded up so as not to wake just short of the deadline.
            let slice = (left + Duration::from_micros(999)).min(POLL_SLICE);
            let ms = u16::try_from(slice.as_millis()).unwrap_or(u16::MAX);
            let mut fds = [PollFd::new(
                std::os::fd::AsFd::as_fd(&self.sock),
                PollFlags::POLLIN,
            )];
            match poll(&mut fds, PollTimeout::from(ms)) {
                Ok(0) | Err(Errno::EINTR) => {}
                Ok(_) => return Ok(true),
                Err(e) => {
                    return Err(CriuError::Socket {
                        what: "poll",
                        source: e.into(),
                    })
                }
            }
        }
    }

    fn send(&mut self, req: &CriuReq) -> Result<(), CriuError> {
        let bytes = req.encode_to_vec();
        loop {
            match send(self.sock.as_raw_fd(), &bytes, MsgFlags::MSG_NOSIGNAL) {
                Ok(_) => return Ok(()),
                Err(Errno::EINTR) => continue,
                Err(Errno::EPIPE | Errno::ECONNRESET) => return Err(self.died()),
                Err(e) => {
                    return Err(CriuError::Socket {
                        what: "send",
                        source: e.into(),
                    })
                }
            }
        }
    }

    fn recv(&mut self) -> Result<CriuResp, CriuError> {
        let fd = self.sock.as_raw_fd();
        // With MSG_TRUNC a SOCK_SEQPACKET recv returns the packet's full length.
        let len = retry(|| recv(fd, &mut [], MsgFlags::MSG_PEEK | MsgFlags::MSG_TRUNC))
            .map_err(|e| self.recv_error(e))?;
        if len == 0 {
            return Err(self.died());
        }
        let mut buf = vec![0u8; len];
        let got =
            retry(|| recv(fd, &mut buf, MsgFlags::empty())).map_err(|e| self.recv_error(e))?;
        CriuResp::decode(&buf[..got]).map_err(|e| CriuError::Protocol {
            op: self.op,
            detail: format!("cannot decode criu_resp ({got} bytes): {e}"),
        })
    }

    fn recv_error(&mut self, e: Errno) -> CriuError {
        if e == Errno::ECONNRESET {
            self.died()
        } else {
            CriuError::Socket {
                what: "recv",
                source: e.into(),
            }
        }
    }

    /// The error for a worker that closed its socket without answering: waits for it to exit
    /// and collects its output.
    fn died(&mut self) -> CriuError {
        // It closed its socket: it is exiting, or ends in a moment.
        let status = match self.finish(Instant::now() + EXIT_WAIT) {
            Ok(Some(s)) => s.to_string(),
            Ok(None) => {
                self.kill_tree(&[]);
                format!("it closed its socket but still ran {EXIT_WAIT:?} later; killed")
            }
            Err(e) => e.to_string(),
        };
        CriuError::WorkerDied {
            op: self.op,
            status,
            output: read_tail(&mut self.output),
        }
    }
}

/// Reaps `pid` if it is (or becomes, before `end`) a zombie child of this process.
fn reap(pid: i32, end: Instant) {
    loop {
        match waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(Errno::EINTR) => {
                if Instant::now() >= end {
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            // Exited, killed, or not this process's child.
            _ => return,
        }
    }
}

fn retry<T>(mut f: impl FnMut() -> nix::Result<T>) -> nix::Result<T> {
    loop {
        match f() {
            Err(Errno::EINTR) => continue,
            r => return r,
        }
    }
}

/// An unlinked file in the temporary directory for the worker's output.
fn capture_file() -> Result<File, CriuError> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "possum-criu-swrk.{}.{}.out",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|source| CriuError::Io {
            what: format!("creating {}", path.display()),
            source,
        })?;
    let _ = std::fs::remove_file(&path);
    Ok(file)
}

/// The last few KiB of `file`, lossily decoded; empty when unreadable.
pub(crate) fn read_tail(file: &mut File) -> String {
    let Ok(len) = file.seek(SeekFrom::End(0)) else {
        return String::new();
    };
    let start = len.saturating_sub(OUTPUT_TAIL_BYTES);
    if file.seek(SeekFrom::Start(start)).is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    let _ = file.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    if start > 0 {
        // Drop the partial first line.
        match text.find('\n') {
            Some(i) => text[i + 1..].to_string(),
            None => text.into_owned(),
        }
    } else {
        text.into_owned()
    }
}
