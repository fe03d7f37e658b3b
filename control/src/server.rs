//! The server side: one thread, `possum-control`, answering one connection at a time.

use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use serde_json::Value;

use crate::{error_reply, socket_path, Request, MAX_REQUEST_BYTES};

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
    /// Creates `dir` (mode 0700) if it is missing. A socket file already at the path is removed
    /// only if nobody answers on it; if someone does, this fails with `AddrInUse`.
    pub fn start(dir: &Path, handler: Handler) -> io::Result<Server> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let path = socket_path(dir, std::process::id());
        remove_if_stale(&path)?;
        let listener = UnixListener::bind(&path)?;
        let meta = fs::symlink_metadata(&path)?;
        let stop = Arc::new(AtomicBool::new(false));
        let spawned = thread::Builder::new().name("possum-control".into()).spawn({
            let stop = Arc::clone(&stop);
            move || serve(listener, handler, stop)
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

/// Removes a socket file at `path` on which nobody answers.
fn remove_if_stale(path: &Path) -> io::Result<()> {
    if let Err(e) = fs::symlink_metadata(path) {
        return match e.kind() {
            io::ErrorKind::NotFound => Ok(()),
            _ => Err(e),
        };
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

fn serve(listener: UnixListener, handler: Handler, stop: Arc<AtomicBool>) {
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        match accepted {
            // A failed exchange concerns that client only.
            Ok((stream, _)) => {
                let _ = exchange(&stream, &handler);
                drop(stream);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // Out of descriptors, say: don't spin.
            Err(_) => thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Reads one request line, answers it with one reply line, and shuts the write side.
fn exchange(stream: &UnixStream, handler: &Handler) -> io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let reply = match read_line(stream) {
        Ok(Some(line)) => answer(&line, handler),
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
    };
    let mut out = serde_json::to_vec(&reply)
        .unwrap_or_else(|_| br#"{"error":"internal: reply not serialisable"}"#.to_vec());
    out.push(b'\n');
    let mut w = stream;
    // No shutdown: the client sees the end of the reply when the descriptor is closed (by the
    // caller, right after), so once it has read to the end the job holds no connection to it.
    w.write_all(&out)
}

/// The request line without its newline (a final line without one is accepted), or `None` when
/// it is longer than `MAX_REQUEST_BYTES`.
fn read_line(stream: &UnixStream) -> io::Result<Option<Vec<u8>>> {
    let limit = u64::try_from(MAX_REQUEST_BYTES).unwrap_or(u64::MAX) + 1;
    let mut r = BufReader::new(stream.take(limit));
    let mut line = Vec::new();
    r.read_until(b'\n', &mut line)?;
    if line.last() == Some(&b'\n') {
        line.pop();
    } else if line.len() > MAX_REQUEST_BYTES {
        return Ok(None);
    }
    Ok(Some(line))
}

fn answer(line: &[u8], handler: &Handler) -> Value {
    let req = match serde_json::from_slice::<Request>(line) {
        Ok(r) => r,
        Err(e) => return error_reply(format!("bad request: {e}")),
    };
    catch_unwind(AssertUnwindSafe(|| handler(req)))
        .unwrap_or_else(|_| error_reply("internal: handler panicked"))
}
