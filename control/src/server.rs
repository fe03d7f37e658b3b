//! The server side: one thread, `possum-control`, answering one connection at a time.

use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use serde_json::Value;

use crate::{error_reply, prepare_dir, socket_path, DirError, Request, MAX_REQUEST_BYTES};

/// Answers one request. It runs on the `possum-control` thread; a panic in it is caught and
/// answered with `{"error": "internal: handler panicked"}`.
pub type Handler = Arc<dyn Fn(Request) -> Value + Send + Sync>;

/// How long the server waits for a client to send its request, and to take the reply.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// A running control server: the socket file and the thread that answers on it.
///
/// Dropping it (or [`Server::shutdown`]) removes the socket file and stops the thread.
#[derive(Debug)]
pub struct Server {
    path: PathBuf,
    /// (device, inode) of the socket file this server bound, so that it never removes another's.
    file_id: (u64, u64),
    stop: Arc<AtomicBool>,
}

impl Server {
    /// Serves `socket_path(dir, std::process::id())`.
    ///
    /// `dir` must belong to this process's (effective) user ([`prepare_dir`]): it is created
    /// (mode 0700) if it is missing and tightened to 0700 if it lets others in; one that is a
    /// symbolic link, not a directory or another user's is refused (`PermissionDenied`, a
    /// [`DirError`] inside). A socket file already at the path is removed only if it is a
    /// socket of this user on which nobody answers; if someone does, this fails with
    /// `AddrInUse`, and anything else there with `AlreadyExists`.
    ///
    /// Connections from other users than this process's and root are answered with an error
    /// and counted ([`refused_connections`]); the handler never sees them.
    pub fn start(dir: &Path, handler: Handler) -> io::Result<Server> {
        let me = nix::unistd::geteuid().as_raw();
        prepare_dir(dir, &[me]).map_err(dir_error)?;
        let path = socket_path(dir, std::process::id());
        remove_if_stale(&path, me)?;
        // `bind` makes a new file: it never follows or reuses what is at the path.
        let listener = UnixListener::bind(&path)?;
        let meta = fs::symlink_metadata(&path)?;
        let stop = Arc::new(AtomicBool::new(false));
        let spawned = thread::Builder::new().name("possum-control".into()).spawn({
            let stop = Arc::clone(&stop);
            move || serve(listener, handler, stop, me)
        });
        if let Err(e) = spawned {
            let _ = fs::remove_file(&path);
            return Err(e);
        }
        Ok(Server {
            path,
            file_id: (meta.dev(), meta.ino()),
            stop,
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the socket file and tells the thread to stop. Idempotent.
    ///
    /// It does not wait for the thread: the thread finishes the exchange it is in (at most the
    /// handler's time plus the I/O timeouts), then exits.
    pub fn shutdown(&mut self) {
        if self.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the thread from `accept`; it sees `stop` and exits, closing the listener.
        let _ = UnixStream::connect(&self.path);
        if let Ok(m) = fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == self.file_id {
                let _ = fs::remove_file(&self.path);
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Removes this process's socket file in `dir`, if there is one: for an `atexit` hook, where the
/// [`Server`] may never be dropped.
pub fn remove_socket_of_this_process(dir: &Path) -> io::Result<()> {
    let path = socket_path(dir, std::process::id());
    match fs::symlink_metadata(&path) {
        Ok(m) if m.file_type().is_socket() => match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        },
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// A directory refused by the rule, as `start`'s error.
fn dir_error(e: DirError) -> io::Error {
    let kind = match &e {
        DirError::Io { source, .. } | DirError::FileIo { source, .. } => source.kind(),
        _ => io::ErrorKind::PermissionDenied,
    };
    io::Error::new(kind, e)
}

/// Removes a socket file of uid `me` at `path` on which nobody answers; anything else there is
/// left, and refused.
fn remove_if_stale(path: &Path, me: u32) -> io::Result<()> {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_socket() || meta.uid() != me {
        let what = if meta.file_type().is_socket() {
            format!("a socket of uid {}", meta.uid())
        } else if meta.file_type().is_symlink() {
            "a symbolic link".to_string()
        } else {
            "not a socket".to_string()
        };
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "{} is {what}, not a stale socket of uid {me}: refused (remove it)",
                path.display()
            ),
        ));
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("{}: another server answers there", path.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => fs::remove_file(path),
        Err(e) => Err(e),
    }
}

/// Connections refused because of their user, by every server of this process.
static REFUSED: AtomicU64 = AtomicU64::new(0);

/// How many connections the control servers of this process refused because their client
/// was neither this process's user nor root.
pub fn refused_connections() -> u64 {
    REFUSED.load(Ordering::Relaxed)
}

/// Why a client is refused: `None` if it is of uid `me` or root (`SO_PEERCRED`: its
/// credentials when it connected).
fn refusal(stream: &UnixStream, me: u32) -> Option<String> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    match getsockopt(stream, PeerCredentials) {
        Ok(c) if c.uid() == me || c.uid() == 0 => None,
        Ok(c) => Some(format!(
            "refused: this job answers only uid {me} and root, not uid {}",
            c.uid()
        )),
        Err(e) => Some(format!(
            "refused: the client's credentials are unknown ({e})"
        )),
    }
}

fn serve(listener: UnixListener, handler: Handler, stop: Arc<AtomicBool>, me: u32) {
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        match accepted {
            // A failed exchange concerns that client only.
            Ok((stream, _)) => {
                let refused = refusal(&stream, me);
                if refused.is_some() {
                    REFUSED.fetch_add(1, Ordering::Relaxed);
                }
                let _ = exchange(&stream, &handler, refused);
                drop(stream);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // Out of descriptors, say: don't spin.
            Err(_) => thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// How many directories passed with requests stay open (the newest ones).
const PASSED_DIRS_KEPT: usize = 4;

/// Directories passed with requests ([`crate::request_at`]'s `dir`), newest last: the handler
/// reaches them through `/proc/self/fd/N`, so each stays open until [`PASSED_DIRS_KEPT`] newer
/// ones have come (a checkpoint's images are written, and read back on demand, after the
/// request that named them is answered).
static PASSED_DIRS: std::sync::Mutex<std::collections::VecDeque<OwnedFd>> =
    std::sync::Mutex::new(std::collections::VecDeque::new());

/// A request that came with a directory descriptor names its directory relative to it: its
/// `dir` becomes `/proc/self/fd/N/dir` (`N` the descriptor this process received, kept open).
fn rebase(mut req: Request, passed: Option<OwnedFd>) -> Request {
    let Some(fd) = passed else {
        return req;
    };
    let base = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let mut kept = PASSED_DIRS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    kept.push_back(fd);
    while kept.len() > PASSED_DIRS_KEPT {
        kept.pop_front();
    }
    if let Some(dir) = req.dir_mut() {
        *dir = format!("{base}/{}", dir.trim_start_matches('/'));
    }
    req
}

/// Reads one request line, answers it with one reply line, and shuts the write side. A
/// `refused` client's request is read (so that the client gets the answer rather than a reset
/// connection) and answered with the refusal.
/// `reply` with the protocol's version ([`crate::PROTOCOL`]): every reply carries it.
fn with_protocol(mut reply: Value) -> Value {
    if let Value::Object(m) = &mut reply {
        m.insert("protocol".into(), Value::from(crate::PROTOCOL));
    }
    reply
}

fn exchange(stream: &UnixStream, handler: &Handler, refused: Option<String>) -> io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut passed = None;
    let read = read_line(stream, &mut passed);
    let reply = match (refused, read) {
        (Some(why), _) => error_reply(why),
        (None, read) => answer_read(read, passed, handler)?,
    };
    let reply = with_protocol(reply);
    let mut out = serde_json::to_vec(&reply)
        .unwrap_or_else(|_| br#"{"error":"internal: reply not serialisable"}"#.to_vec());
    out.push(b'\n');
    let mut w = stream;
    // No shutdown: the client sees the end of the reply when the descriptor is closed (by the
    // caller, right after), so once it has read to the end the job holds no connection to it.
    w.write_all(&out)
}

/// The reply to what `read_line` read; an error other than a timeout ends the exchange.
fn answer_read(
    read: io::Result<Option<Vec<u8>>>,
    passed: Option<OwnedFd>,
    handler: &Handler,
) -> io::Result<Value> {
    Ok(match read {
        Ok(Some(line)) => answer(&line, passed, handler),
        Ok(None) => error_reply(format!(
            "request longer than {MAX_REQUEST_BYTES} bytes refused"
        )),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            error_reply(format!("no request line within {} s", IO_TIMEOUT.as_secs()))
        }
        Err(e) => return Err(e),
    })
}

/// The request line without its newline (a final line without one is accepted), or `None` when
/// it is longer than `MAX_REQUEST_BYTES`. A descriptor sent with the line's first bytes
/// (`SCM_RIGHTS`) lands in `passed` (only one is taken; any more are closed).
#[allow(unsafe_code)]
fn read_line(stream: &UnixStream, passed: &mut Option<OwnedFd>) -> io::Result<Option<Vec<u8>>> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut line = vec![0u8; 4096];
    let mut cmsg = nix::cmsg_space!([RawFd; 1]);
    let n = loop {
        let mut iov = [io::IoSliceMut::new(&mut line)];
        match recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(msg) => {
                for c in msg.cmsgs().into_iter().flatten() {
                    if let ControlMessageOwned::ScmRights(fds) = c {
                        for fd in fds {
                            // SAFETY: the kernel just installed `fd` in this process for us
                            // (SCM_RIGHTS); nothing else owns it.
                            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                            if passed.is_none() {
                                *passed = Some(owned);
                            }
                        }
                    }
                }
                break msg.bytes;
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    line.truncate(n);
    if !line.contains(&b'\n') && n > 0 {
        let limit = u64::try_from(MAX_REQUEST_BYTES + 1 - n.min(MAX_REQUEST_BYTES)).unwrap_or(0);
        let mut r = BufReader::new(stream.take(limit));
        r.read_until(b'\n', &mut line)?;
    }
    if let Some(end) = line.iter().position(|&b| b == b'\n') {
        line.truncate(end + 1);
    }
    if line.last() == Some(&b'\n') {
        line.pop();
    } else if line.len() > MAX_REQUEST_BYTES {
        return Ok(None);
    }
    Ok(Some(line))
}

fn answer(line: &[u8], passed: Option<OwnedFd>, handler: &Handler) -> Value {
    let req = match serde_json::from_slice::<Request>(line) {
        Ok(r) => rebase(r, passed),
        Err(e) => return error_reply(format!("bad request: {e}")),
    };
    catch_unwind(AssertUnwindSafe(|| handler(req)))
        .unwrap_or_else(|_| error_reply("internal: handler panicked"))
}
