//! Lines with file descriptors attached (SCM_RIGHTS) over a Unix stream socket, and whether two
//! descriptors are one open file. The crate's only `unsafe`: taking ownership of the descriptors
//! `recvmsg` received, which the kernel has just installed in this process for the caller alone,
//! and `kcmp`.
#![allow(unsafe_code)]

use std::io::{self, IoSlice, IoSliceMut, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

/// Writes `bytes` (one whole line) with `fd` attached to its first byte.
pub(crate) fn send(
    mut stream: &UnixStream,
    bytes: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    let Some(fd) = fd else {
        return stream.write_all(bytes);
    };
    let fds = [fd.as_raw_fd()];
    let cmsgs = [ControlMessage::ScmRights(&fds)];
    let n = loop {
        match sendmsg::<()>(
            stream.as_raw_fd(),
            &[IoSlice::new(bytes)],
            &cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => break n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    stream.write_all(&bytes[n..])
}

/// Reads one line (without its newline) and the descriptors that came with it. `pending` holds
/// bytes read past a line, for the next call. `Ok(None)` at end of stream. With a `deadline`,
/// an error of kind [`io::ErrorKind::TimedOut`] once it has passed without a whole line (the
/// stream's read timeout is set to what is left before each read); without one, the stream's
/// read timeout is left as it is.
pub(crate) fn recv_line(
    stream: &UnixStream,
    pending: &mut Vec<u8>,
    fds: &mut Vec<OwnedFd>,
    max: usize,
    deadline: Option<Instant>,
) -> io::Result<Option<String>> {
    let timed_out = || io::Error::new(io::ErrorKind::TimedOut, "no whole line in time");
    loop {
        if let Some(pos) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=pos).take(pos).collect();
            return String::from_utf8(line)
                .map(Some)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e));
        }
        if pending.len() > max {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("line longer than {max} bytes"),
            ));
        }
        if let Some(end) = deadline {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timed_out());
            }
            stream.set_read_timeout(Some(left))?;
        }
        let mut chunk = [0u8; 4096];
        let mut space = nix::cmsg_space!([RawFd; 8]);
        let mut iov = [IoSliceMut::new(&mut chunk)];
        let msg = match recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(m) => m,
            Err(nix::errno::Errno::EINTR) => continue,
            // SO_RCVTIMEO passed.
            Err(nix::errno::Errno::EAGAIN) if deadline.is_some() => return Err(timed_out()),
            Err(e) => return Err(e.into()),
        };
        let n = msg.bytes;
        for c in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                for r in raw {
                    // SAFETY: SCM_RIGHTS descriptors are new ones the kernel installed in this
                    // process for this message; nothing else knows them, so ownership is ours.
                    fds.push(unsafe { OwnedFd::from_raw_fd(r) });
                }
            }
        }
        if n == 0 {
            return if pending.is_empty() {
                Ok(None)
            } else {
                Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a line",
                ))
            };
        }
        pending.extend_from_slice(&chunk[..n]);
    }
}

/// Whether `a` and `b` are the same open file description (`kcmp(KCMP_FILE)` on this process):
/// an fd passed to another process (SCM_RIGHTS) and back is the one it was. `false` where the
/// kernel cannot say (no `kcmp`: CONFIG_KCMP off, or refused).
pub(crate) fn same_file(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> bool {
    const KCMP_FILE: nix::libc::c_long = 0;
    let pid = nix::libc::c_long::from(std::process::id() as i32);
    // SAFETY: kcmp reads no memory of ours: it compares two descriptors of this process, both
    // open for the call's length (borrowed).
    let r = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_kcmp,
            pid,
            pid,
            KCMP_FILE,
            nix::libc::c_long::from(a.as_raw_fd()),
            nix::libc::c_long::from(b.as_raw_fd()),
        )
    };
    r == 0
}
