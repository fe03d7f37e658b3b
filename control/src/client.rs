//! The client side: one request, one reply.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::{process_uid, secure_dir, socket_path, DirError, Reply, Request};

/// Why a request to a job failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// `/proc/<pid>` does not exist.
    #[error("no process with pid {0}")]
    NoProcess(u32),
    /// The process exists but has no control socket.
    #[error(
        "process {pid} does not have possum loaded: no control socket at {}; start the job with `possum run JOB` or LD_PRELOAD=/path/to/libpossum.so (its socket appears at its first CUDA call)",
        path.display()
    )]
    NotLoaded {
        /// The process.
        pid: u32,
        /// Where its socket would be.
        path: PathBuf,
    },
    /// The process has libpossum.so loaded but no control socket yet: the socket appears at the
    /// job's first CUDA call, and it has made none.
    #[error(
        "process {pid} runs with possum but has not used the GPU yet: its control socket {} appears at its first CUDA call; ask again once the job has started using CUDA",
        path.display()
    )]
    NotStarted {
        /// The process.
        pid: u32,
        /// Where its socket will be.
        path: PathBuf,
    },
    /// The socket file exists but nobody accepts connections on it.
    #[error(
        "control socket {} of process {pid} refuses connections: it is stale (left by an exited process that had this pid, or possum's server in the job has stopped)",
        path.display()
    )]
    Stale {
        /// The process.
        pid: u32,
        /// The socket file.
        path: PathBuf,
    },
    /// No complete reply within the timeout.
    #[error("process {pid} did not answer within {} s", timeout.as_secs_f64())]
    Timeout {
        /// The process.
        pid: u32,
        /// The time allowed.
        timeout: Duration,
    },
    /// Another I/O failure on the socket.
    #[error("control socket {}", path.display())]
    Io {
        /// The socket.
        path: PathBuf,
        /// What failed.
        #[source]
        source: io::Error,
    },
    /// The socket directory breaks the rule ([`crate::secure_dir`]): the socket in it is not
    /// asked.
    #[error(transparent)]
    Dir(#[from] DirError),
    /// The socket is served by another process than the one asked.
    #[error(
        "the socket at {} is served by {}, not by {pid}: refused",
        path.display(),
        peer_name(*peer)
    )]
    WrongProcess {
        /// The process asked.
        pid: u32,
        /// The socket.
        path: PathBuf,
        /// The process that listens on it (0: one this process cannot name).
        peer: i32,
    },
    /// The socket is served by the process asked, but as another user than the process's.
    #[error(
        "the socket at {} is served as uid {peer_uid}, but process {pid} runs as uid {job_uid}: refused",
        path.display()
    )]
    WrongUser {
        /// The process asked.
        pid: u32,
        /// The socket.
        path: PathBuf,
        /// The user the socket's server listened as.
        peer_uid: u32,
        /// The process's effective uid.
        job_uid: u32,
    },
    /// The reply was not one line of JSON.
    #[error("bad reply on the control socket: {0}")]
    Protocol(String),
    /// The job answered `{"error": ...}`.
    #[error("possum in the job answered with an error: {0}")]
    Remote(String),
    /// The job's libpossum.so speaks another version of the control protocol.
    #[error(
        "the job's libpossum.so speaks control protocol {}, this possum speaks {}: use the possum \
         the job was started with (`possum run`), or start the job again under this one",
        job.map_or_else(|| "none (an older possum)".to_string(), |v| v.to_string()),
        crate::PROTOCOL
    )]
    Version {
        /// The job's version (`None`: its replies carry none).
        job: Option<u64>,
    },
}

/// The process `SO_PEERCRED` names, in words.
fn peer_name(peer: i32) -> String {
    match peer {
        0 => "a process outside this pid namespace".to_string(),
        q => format!("process {q}"),
    }
}

/// Sends `req` to process `pid`'s control socket in `dir` and returns its reply.
///
/// `timeout` bounds the whole exchange after connecting. A reply `{"error": ...}` becomes
/// [`ControlError::Remote`]. A process without a socket is [`ControlError::NotStarted`] if it has
/// libpossum.so loaded, else [`ControlError::NotLoaded`]. Nothing is sent unless `dir` passes
/// [`crate::secure_dir`] for the job's user or this process's ([`ControlError::Dir`]) and the
/// socket is served by process `pid` as the job's user or root
/// ([`ControlError::WrongProcess`], [`ControlError::WrongUser`]).
pub fn request(
    pid: u32,
    dir: &Path,
    req: &Request,
    timeout: Duration,
) -> Result<Value, ControlError> {
    if !Path::new("/proc").join(pid.to_string()).exists() {
        return Err(ControlError::NoProcess(pid));
    }
    match request_at(pid, &socket_path(dir, pid), req, timeout, None) {
        Err(ControlError::NotLoaded { pid, path }) if has_possum_mapped(pid) => {
            Err(ControlError::NotStarted { pid, path })
        }
        r => r,
    }
}

/// [`request`], its reply read as `R` ([`Reply::parse`]), the job's JSON kept beside it.
pub fn request_reply<R: DeserializeOwned>(
    pid: u32,
    dir: &Path,
    req: &Request,
    timeout: Duration,
) -> Result<Reply<R>, ControlError> {
    Reply::parse(request(pid, dir, req, timeout)?)
}

/// [`request`], its reply read as `R`.
pub fn request_typed<R: DeserializeOwned>(
    pid: u32,
    dir: &Path,
    req: &Request,
    timeout: Duration,
) -> Result<R, ControlError> {
    request_reply(pid, dir, req, timeout).map(|r| r.body)
}

/// The file name of the library that serves the control socket in a job.
pub const LIBRARY_FILE: &str = "libpossum.so";

/// Whether process `pid` has [`LIBRARY_FILE`] mapped (`/proc/PID/maps`), also one whose file was
/// replaced or removed since it was loaded (the kernel then adds ` (deleted)` to its path).
pub fn has_possum_mapped(pid: u32) -> bool {
    crate::procfs::read_maps(pid).is_some_and(|maps| {
        maps.lines().any(|l| {
            l.rsplit('/').next().is_some_and(|file| {
                let file = file.trim_end();
                file.strip_suffix(" (deleted)").unwrap_or(file) == LIBRARY_FILE
            })
        })
    })
}

/// Connects to process `pid`'s control socket at `path` (which may be reached through
/// `/proc/PID/root` for a job in another mount namespace, or named by the job's own pid in
/// another pid namespace), and makes sure that process `pid` serves it.
///
/// Before connecting, the socket's directory must pass [`secure_dir`], belonging to the job's
/// user or to this process's. After, the listening socket's credentials (`SO_PEERCRED`, taken
/// when the server listened: the process, not the thread, so a job's server thread is its pid)
/// must name process `pid` (as this process's pid namespace names it), and the job's uid or
/// root.
fn connect(pid: u32, path: &Path) -> Result<UnixStream, ControlError> {
    let job_uid = process_uid(pid).map_err(|_| ControlError::NoProcess(pid))?;
    let me = nix::unistd::geteuid().as_raw();
    let owners: Vec<u32> = if me == job_uid {
        vec![job_uid]
    } else {
        vec![job_uid, me]
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        match secure_dir(dir, &owners) {
            Ok(_) => {}
            // No socket there: nothing to trust or to refuse (one that cannot be looked at,
            // in another user's directory, is refused with the directory).
            Err(e) if e.is_missing() || is_not_found(path.symlink_metadata()) => {
                return Err(ControlError::NotLoaded {
                    pid,
                    path: path.to_path_buf(),
                })
            }
            Err(e) => return Err(e.into()),
        }
    }
    let stream = connect_path(pid, path)?;
    check_peer(pid, job_uid, path, &stream)?;
    Ok(stream)
}

fn is_not_found<T>(r: io::Result<T>) -> bool {
    matches!(r, Err(e) if e.kind() == io::ErrorKind::NotFound)
}

/// Refuses a connection whose listener is not process `pid` running as `job_uid` (or root).
fn check_peer(
    pid: u32,
    job_uid: u32,
    path: &Path,
    stream: &UnixStream,
) -> Result<(), ControlError> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let cred = getsockopt(stream, PeerCredentials).map_err(|e| ControlError::Io {
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    if u32::try_from(cred.pid()).ok() != Some(pid) {
        return Err(ControlError::WrongProcess {
            pid,
            path: path.to_path_buf(),
            peer: cred.pid(),
        });
    }
    if cred.uid() != job_uid && cred.uid() != 0 {
        return Err(ControlError::WrongUser {
            pid,
            path: path.to_path_buf(),
            peer_uid: cred.uid(),
            job_uid,
        });
    }
    Ok(())
}

fn connect_path(pid: u32, path: &Path) -> Result<UnixStream, ControlError> {
    match UnixStream::connect(path) {
        Ok(s) => Ok(s),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(ControlError::NotLoaded {
            pid,
            path: path.to_path_buf(),
        }),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Err(ControlError::Stale {
            pid,
            path: path.to_path_buf(),
        }),
        Err(source) => Err(ControlError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The request's line, newline included.
fn request_line(req: &Request) -> Result<Vec<u8>, ControlError> {
    let mut line = serde_json::to_vec(req).map_err(|e| ControlError::Protocol(e.to_string()))?;
    line.push(b'\n');
    Ok(line)
}

/// Writes `line` on `stream`, the directory `dir` (if any) passed with its first bytes
/// (`SCM_RIGHTS`).
fn send_line(
    stream: &UnixStream,
    line: &[u8],
    dir: Option<std::os::fd::BorrowedFd<'_>>,
) -> io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    use std::os::fd::AsRawFd;
    let Some(dir) = dir else {
        return (&*stream).write_all(line);
    };
    let fds = [dir.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    let iov = [io::IoSlice::new(line)];
    let n = loop {
        match sendmsg::<()>(
            stream.as_raw_fd(),
            &iov,
            &cmsg,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => break n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    (&*stream).write_all(&line[n..])
}

/// Sends `req` to the control socket at `path` without waiting for the reply: for a job that
/// cannot answer now (stopped by CRIU, which resumes it only after the caller is done) and
/// answers once it runs again. The connection is closed at once; the job's server reads the
/// request already queued on it and discards its reply. `dir` as for [`request_at`]; the socket
/// is checked as [`request_at`] checks it.
pub fn send_only(
    pid: u32,
    path: &Path,
    req: &Request,
    dir: Option<std::os::fd::BorrowedFd<'_>>,
) -> Result<(), ControlError> {
    let stream = connect(pid, path)?;
    let line = request_line(req)?;
    // A Unix socket's buffer takes a request line without the job reading it.
    stream
        .set_write_timeout(Some(Duration::from_secs(5)))
        .and_then(|()| send_line(&stream, &line, dir))
        .map_err(|source| ControlError::Io {
            path: path.to_path_buf(),
            source,
        })
}

/// [`request`] to the control socket at `path` of process `pid`: the socket's directory and
/// server are checked as [`request`] checks them (the server must be process `pid`, as this
/// process's pid namespace names it).
/// With `dir`, that directory is passed along (`SCM_RIGHTS`): the request's `dir` is relative to
/// it, and the job reaches it even where its path does not exist for the job (another mount
/// namespace).
pub fn request_at(
    pid: u32,
    path: &Path,
    req: &Request,
    timeout: Duration,
    dir: Option<std::os::fd::BorrowedFd<'_>>,
) -> Result<Value, ControlError> {
    let stream = connect(pid, path)?;
    let fail = |source: io::Error| match source.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            ControlError::Timeout { pid, timeout }
        }
        _ => ControlError::Io {
            path: path.to_path_buf(),
            source,
        },
    };
    let deadline = Instant::now() + timeout;

    let line = request_line(req)?;
    if timeout.is_zero() {
        return Err(ControlError::Timeout { pid, timeout });
    }
    stream.set_write_timeout(Some(timeout)).map_err(fail)?;
    send_line(&stream, &line, dir).map_err(fail)?;

    let mut reply = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ControlError::Timeout { pid, timeout });
        }
        stream.set_read_timeout(Some(left)).map_err(fail)?;
        match (&stream).read(&mut chunk) {
            Ok(0) => break,
            // Read to the end: the server closes its end after the reply, so when this returns the
            // job holds no connection to us (a process checkpointer must not find one).
            Ok(n) => reply.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(fail(e)),
        }
    }
    parse_reply(&reply)
}

fn parse_reply(reply: &[u8]) -> Result<Value, ControlError> {
    let line = reply.split(|&b| b == b'\n').next().unwrap_or_default();
    if line.iter().all(u8::is_ascii_whitespace) {
        return Err(ControlError::Protocol(
            "the job closed the connection without answering".into(),
        ));
    }
    let v: Value = serde_json::from_slice(line)
        .map_err(|e| ControlError::Protocol(format!("reply is not JSON: {e}")))?;
    match v.get("protocol").map(Value::as_u64) {
        Some(Some(crate::PROTOCOL)) => {}
        other => {
            return Err(ControlError::Version {
                job: other.flatten(),
            })
        }
    }
    match v.get("error") {
        Some(Value::String(m)) => Err(ControlError::Remote(m.clone())),
        Some(other) => Err(ControlError::Remote(other.to_string())),
        None => Ok(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_parsed() {
        assert_eq!(parse_reply(b"{\"a\":1,\"protocol\":1}\n").unwrap()["a"], 1);
        assert!(matches!(
            parse_reply(b"{\"error\":\"no\",\"protocol\":1}\n"),
            Err(ControlError::Remote(m)) if m == "no"
        ));
        // Another version, or none (an older library), is refused before anything else is read.
        let other = parse_reply(b"{\"error\":\"no\",\"protocol\":7}\n").unwrap_err();
        assert!(matches!(other, ControlError::Version { job: Some(7) }));
        assert!(other.to_string().contains("protocol 7"), "{other}");
        let none = parse_reply(b"{\"a\":1}\n").unwrap_err();
        assert!(matches!(none, ControlError::Version { job: None }));
        assert!(none.to_string().contains("an older possum"), "{none}");
        assert!(matches!(parse_reply(b""), Err(ControlError::Protocol(_))));
        assert!(matches!(
            parse_reply(b"{oops\n"),
            Err(ControlError::Protocol(_))
        ));
    }
}
