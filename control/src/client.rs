//! The client side: one request, one reply.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::{process_uid, secure_dir, socket_path, ControlError, Reply, Request};

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
