//! The tree's connected TCP sockets at the kill that follows a dump that took them
//! (`--tcp-established`): each is put in TCP repair mode first ([`quiet_connections`]), through
//! a duplicate of its descriptor (pidfd_getfd(2)), so that its close at the kill sends nothing,
//! neither FIN nor reset. Its peer is not told that the job is gone, and once the job is
//! restored the connection goes on from where CRIU dumped it. Without this, a peer outside the
//! tree would see the connection closed at the kill, and the restored end would be stale.
//! (CRIU does the same when it kills a tree it dumped; possum kills the tree itself, after the
//! image is complete.)

use std::collections::BTreeSet;
use std::fs;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use rustix::net::sockopt;
use rustix::net::{AddressFamily, SocketType};
use rustix::process::{pidfd_getfd, pidfd_open, Pid, PidfdFlags, PidfdGetfdFlags};
use serde::Serialize;

/// What [`quiet_connections`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct QuietConnections {
    /// Connected TCP sockets put in repair mode: closed silently at the kill.
    pub sockets: usize,
    /// What could not be done, each said with why: those connections are closed at their
    /// peers when the job is killed.
    pub failed: Vec<String>,
}

/// The sockets [`quiet_connections`] put in repair mode, held (a descriptor of each) until the
/// kill is done, or undone.
#[derive(Debug)]
pub struct Quieted {
    /// What was done.
    pub report: QuietConnections,
    held: Vec<OwnedFd>,
}

impl Quieted {
    /// The kill did not happen: each socket out of repair mode again, the job's connections
    /// working as before.
    pub fn undo(self) {
        for fd in &self.held {
            let _ = set_repair(fd, false);
        }
    }
}

/// Puts every connected TCP socket of the tree under `root` in repair mode (the tree stopped,
/// about to be killed). Needs CAP_NET_ADMIN (repair mode) and the right to trace the tree's
/// processes (pidfd_getfd). Nothing else of the sockets changes.
pub fn quiet_connections(root: i32) -> Quieted {
    let mut done = Quieted {
        report: QuietConnections::default(),
        held: Vec::new(),
    };
    let mut seen = BTreeSet::new();
    for pid in crate::tree::with_descendants(root) {
        if let Err(e) = quiet_process(pid, &mut seen, &mut done) {
            done.report.failed.push(format!("process {pid}: {e}"));
        }
    }
    done
}

/// Sets or clears TCP repair mode on `fd`.
fn set_repair(fd: impl AsFd, on: bool) -> nix::Result<()> {
    nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::TcpRepair, &u32::from(on))
}

/// [`quiet_connections`] for the descriptors of process `pid`; `seen`: the sockets' inodes
/// already taken (processes may share descriptors).
fn quiet_process(pid: i32, seen: &mut BTreeSet<u64>, done: &mut Quieted) -> std::io::Result<()> {
    let Some(raw) = Pid::from_raw(pid) else {
        return Ok(());
    };
    let pidfd = match pidfd_open(raw, PidfdFlags::empty()) {
        Ok(fd) => fd,
        // Gone already: its descriptors are closed.
        Err(rustix::io::Errno::SRCH) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    for entry in fs::read_dir(format!("/proc/{pid}/fd"))? {
        let entry = entry?;
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let Some(ino) = fs::read_link(entry.path())
            .ok()
            .and_then(|t| socket_inode(&t))
        else {
            continue;
        };
        if !seen.insert(ino) {
            continue;
        }
        let sock: OwnedFd = match pidfd_getfd(&pidfd, fd, PidfdGetfdFlags::empty()) {
            Ok(s) => s,
            // Closed since it was listed.
            Err(rustix::io::Errno::BADF) => continue,
            Err(e) => {
                let why = format!("process {pid}, descriptor {fd}: {e}");
                done.report.failed.push(why);
                continue;
            }
        };
        if !connected_tcp(&sock) {
            continue;
        }
        match set_repair(&sock, true) {
            Ok(()) => {
                done.report.sockets += 1;
                done.held.push(sock);
            }
            Err(e) => done.report.failed.push(format!(
                "process {pid}, descriptor {fd}: TCP repair mode: {e}"
            )),
        }
    }
    Ok(())
}

/// The inode of a descriptor's target, if it is a socket (`socket:[INODE]`).
fn socket_inode(target: &Path) -> Option<u64> {
    let t = target.to_str()?;
    t.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
}

/// A TCP socket (over IPv4 or IPv6) that does not listen.
fn connected_tcp(fd: impl AsFd) -> bool {
    let fd = fd.as_fd();
    matches!(
        sockopt::socket_domain(fd),
        Ok(AddressFamily::INET | AddressFamily::INET6)
    ) && sockopt::socket_type(fd) == Ok(SocketType::STREAM)
        && sockopt::socket_protocol(fd) == Ok(Some(rustix::net::ipproto::TCP))
        && sockopt::socket_acceptconn(fd) == Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream, UdpSocket};
    use std::os::unix::net::UnixStream;

    #[test]
    fn only_a_descriptor_of_a_socket_names_its_inode() {
        assert_eq!(socket_inode(Path::new("socket:[123]")), Some(123));
        assert_eq!(socket_inode(Path::new("pipe:[123]")), None);
        assert_eq!(socket_inode(Path::new("/tmp/socket:[1]")), None);
        assert_eq!(socket_inode(Path::new("socket:[x]")), None);
    }

    #[test]
    fn only_tcp_sockets_that_do_not_listen_are_taken() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        assert!(!connected_tcp(&listener));
        assert!(connected_tcp(&client) && connected_tcp(&server));
        assert!(!connected_tcp(UdpSocket::bind("127.0.0.1:0").unwrap()));
        let (a, _) = UnixStream::pair().unwrap();
        assert!(!connected_tcp(&a));
        assert!(!connected_tcp(fs::File::open("/proc/self/stat").unwrap()));
    }

    /// In repair mode a socket sends nothing (a write is refused); out of it again, it works as
    /// before. Needs CAP_NET_ADMIN: skipped (said) without it.
    #[test]
    fn a_socket_in_repair_mode_sends_nothing_until_it_is_let_out() {
        use std::io::{Read, Write};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        if let Err(e) = set_repair(&client, true) {
            assert_eq!(e, nix::errno::Errno::EPERM);
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: TCP repair mode needs CAP_NET_ADMIN"
            );
            return;
        }
        assert!(client.write(b"x").is_err(), "a write in repair mode");
        let quieted = Quieted {
            report: QuietConnections::default(),
            held: vec![OwnedFd::from(client.try_clone().unwrap())],
        };
        quieted.undo();
        client.write_all(b"y").unwrap();
        let mut b = [0u8; 1];
        server.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"y");
    }
}
