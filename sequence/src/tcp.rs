//! The tree's connected TCP sockets at the kill that follows a dump that took them
//! (`--tcp-established`): each is put in TCP repair mode first ([`quiet_connections`]), through
//! a duplicate of its descriptor (pidfd_getfd(2)), so that its close at the kill sends nothing,
//! neither FIN nor reset. Its peer is not told that the job is gone, and once the job is
//! restored the connection goes on from where CRIU dumped it. Without this, a peer outside the
//! tree would see the connection closed at the kill, and the restored end would be stale.
//! (CRIU does the same when it kills a tree it dumped; possum kills the tree itself, after the
//! image is complete.)
//!
//! A peer that has not yet acknowledged the last data the job sent it still owes a packet: its
//! delayed ACK (up to 200 ms on Linux, 40 ms on loopback), which a host whose socket is closed
//! answers with a reset. So before the kill [`Quieted::await_acks`] waits, at most [`ACK_WAIT`],
//! until every peer outside the tree has acknowledged all the job sent (the socket's send
//! queue, as `/proc/PID/net/tcp` shows it, empty); a socket in repair mode still takes in the
//! peers' ACKs.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::net::sockopt;
use rustix::net::{AddressFamily, SocketType};
use rustix::process::{pidfd_getfd, pidfd_open, Pid, PidfdFlags, PidfdGetfdFlags};
use serde::Serialize;

use crate::tree::socket_inode;

/// The longest the kill waits for the peers to acknowledge what the job sent them: a Linux
/// peer's delayed ACK comes within 200 ms (`TCP_DELACK_MAX`), and the wait ends as soon as all
/// are in.
pub const ACK_WAIT: Duration = Duration::from_millis(250);

/// How often [`Quieted::await_acks`] looks at the send queues.
const ACK_POLL: Duration = Duration::from_millis(1);

/// What [`quiet_connections`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct QuietConnections {
    /// Connected TCP sockets put in repair mode: closed silently at the kill.
    pub sockets: usize,
    /// What could not be done, each said with why: those connections are closed at their
    /// peers when the job is killed.
    pub failed: Vec<String>,
    /// How long the kill waited for the peers to acknowledge what the job had sent them.
    pub acks_waited_ms: u64,
    /// The connections whose peer had still not acknowledged all the job sent when the wait
    /// ended (`LOCAL -> REMOTE: N bytes`): a packet from that peer before the restore is
    /// answered with a reset, which closes the connection at the peer.
    pub unacknowledged: Vec<String>,
}

/// A socket put in repair mode: a descriptor of it, and where its send queue is seen.
#[derive(Debug)]
struct Held {
    fd: OwnedFd,
    /// A process of the job holding it: its `/proc/PID/net` is the socket's network namespace.
    pid: i32,
    inode: u64,
}

/// The sockets [`quiet_connections`] put in repair mode, held (a descriptor of each) until the
/// kill is done, or undone.
#[derive(Debug)]
pub struct Quieted {
    /// What was done.
    pub report: QuietConnections,
    held: Vec<Held>,
}

impl Quieted {
    /// The kill did not happen: each socket out of repair mode again, the job's connections
    /// working as before.
    pub fn undo(self) {
        for h in &self.held {
            let _ = set_repair(&h.fd, false);
        }
    }

    /// Waits until each held socket's peer has acknowledged all the job sent on it, or `limit`
    /// passed; the time waited and the connections still unacknowledged go into the report.
    pub fn await_acks(&mut self, limit: Duration) {
        let t = Instant::now();
        let (queued, unread) = loop {
            let (queued, unread) = self.unacknowledged();
            // (A queue that cannot be read now will not be read later.)
            if queued.is_empty() || t.elapsed() >= limit {
                break (queued, unread);
            }
            std::thread::sleep(ACK_POLL);
        };
        self.report.acks_waited_ms = t.elapsed().as_millis() as u64;
        self.report.unacknowledged = queued.into_iter().chain(unread).collect();
    }

    /// The held sockets whose send queue is not empty, each said as `LOCAL -> REMOTE: N bytes`,
    /// and those whose queue could not be read, said so. A connection whose other end is held
    /// too is left out: both ends are the job's, closed together, and restored together.
    fn unacknowledged(&self) -> (Vec<String>, Vec<String>) {
        let mut tables: BTreeMap<i32, std::io::Result<BTreeMap<u64, TcpEntry>>> = BTreeMap::new();
        let mut entries = Vec::new();
        let mut unread = Vec::new();
        for h in &self.held {
            let table = tables.entry(h.pid).or_insert_with(|| tcp_table(h.pid));
            match table {
                // Not listed: closed since.
                Ok(t) => entries.extend(t.get(&h.inode).cloned()),
                Err(e) => unread.push(format!(
                    "socket {} of process {}: its send queue could not be read: {e}",
                    h.inode, h.pid
                )),
            }
        }
        let ends: BTreeSet<(&str, &str)> = (entries.iter())
            .map(|e| (e.local.as_str(), e.remote.as_str()))
            .collect();
        let queued = (entries.iter())
            .filter(|e| e.unacknowledged > 0)
            .filter(|e| !ends.contains(&(e.remote.as_str(), e.local.as_str())))
            .map(|e| format!("{} -> {}: {} bytes", e.local, e.remote, e.unacknowledged))
            .collect();
        (queued, unread)
    }
}

/// A connection as `/proc/PID/net/tcp{,6}` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TcpEntry {
    local: String,
    remote: String,
    /// The bytes the job wrote that the peer has not acknowledged (`tx_queue`).
    unacknowledged: u64,
}

/// The TCP sockets of `pid`'s network namespace, by inode.
fn tcp_table(pid: i32) -> std::io::Result<BTreeMap<u64, TcpEntry>> {
    let mut table = BTreeMap::new();
    for name in ["tcp", "tcp6"] {
        match fs::read_to_string(format!("/proc/{pid}/net/{name}")) {
            Ok(text) => table.extend(text.lines().skip(1).filter_map(parse_tcp_line)),
            // No IPv6 in this kernel.
            Err(e) if name == "tcp6" && e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(table)
}

/// One line of `/proc/net/tcp{,6}`: `sl local remote st tx_queue:rx_queue tr:when retrnsmt uid
/// timeout inode ...`, addresses as hex words in host order, ports as hex.
fn parse_tcp_line(line: &str) -> Option<(u64, TcpEntry)> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let (local, remote) = (parse_endpoint(f.get(1)?)?, parse_endpoint(f.get(2)?)?);
    let tx = f.get(4)?.split(':').next()?;
    let entry = TcpEntry {
        local,
        remote,
        unacknowledged: u64::from_str_radix(tx, 16).ok()?,
    };
    Some((f.get(9)?.parse().ok()?, entry))
}

/// `ADDR:PORT` of `/proc/net/tcp{,6}` as `a.b.c.d:port` or `[v6]:port`.
fn parse_endpoint(s: &str) -> Option<String> {
    let (addr, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    // Each 32-bit word is printed as a number in the host's byte order.
    let mut bytes = Vec::with_capacity(16);
    for i in (0..addr.len()).step_by(8) {
        let word = u32::from_str_radix(addr.get(i..i + 8)?, 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    match bytes.len() {
        4 => Some(format!(
            "{}:{port}",
            Ipv4Addr::from(<[u8; 4]>::try_from(bytes).ok()?)
        )),
        16 => {
            let a = Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?);
            Some(format!("[{a}]:{port}"))
        }
        _ => None,
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
                done.held.push(Held {
                    fd: sock,
                    pid,
                    inode: ino,
                });
            }
            Err(e) => done.report.failed.push(format!(
                "process {pid}, descriptor {fd}: TCP repair mode: {e}"
            )),
        }
    }
    Ok(())
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

    /// `first` and `more` as [`quiet_connections`] holds them (a duplicate of each descriptor),
    /// this process their owner.
    fn held(first: &TcpStream, more: &[&TcpStream]) -> Quieted {
        use std::os::fd::AsRawFd;
        let one = |s: &TcpStream| {
            let link = fs::read_link(format!("/proc/self/fd/{}", s.as_raw_fd())).unwrap();
            Held {
                fd: OwnedFd::from(s.try_clone().unwrap()),
                pid: std::process::id() as i32,
                inode: socket_inode(&link).unwrap(),
            }
        };
        Quieted {
            report: QuietConnections::default(),
            held: std::iter::once(first)
                .chain(more.iter().copied())
                .map(one)
                .collect(),
        }
    }

    #[test]
    fn proc_net_tcp_lines_are_read_as_connections_and_their_unacknowledged_bytes() {
        let v4 =
            "   3: 0100007F:1F90 0200007F:C350 01 0000002A:00000000 01:00000014 00000000     0 \
                  0 98765 1 0000000000000000 20 4 30 10 -1";
        let (inode, e) = parse_tcp_line(v4).unwrap();
        assert_eq!(inode, 98765);
        assert_eq!(e.local, "127.0.0.1:8080");
        assert_eq!(e.remote, "127.0.0.2:50000");
        assert_eq!(e.unacknowledged, 42);
        let v6 =
            "   0: 00000000000000000000000001000000:0016 0000000000000000FFFF00000100007F:D431 \
                  01 00000000:00000000 00:00000000 00000000     0        0 4321 1";
        let (inode, e) = parse_tcp_line(v6).unwrap();
        assert_eq!(inode, 4321);
        assert_eq!(e.local, "[::1]:22");
        assert_eq!(e.remote, "[::ffff:127.0.0.1]:54321");
        assert_eq!(e.unacknowledged, 0);
        // The header, and lines cut short.
        assert_eq!(
            parse_tcp_line("  sl  local_address rem_address   st tx_queue rx_queue"),
            None
        );
        assert_eq!(parse_tcp_line(&v4[..40]), None);
    }

    /// What the job sent and its peer took in is acknowledged, the socket in repair mode or
    /// not; what a peer that does not read leaves queued is named once the wait ends.
    #[test]
    fn the_kill_waits_for_the_peers_acknowledgements_and_names_what_is_left() {
        use std::io::{ErrorKind, Read, Write};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        server.write_all(b"answer").unwrap();
        // As the kill has it: the socket in repair mode (when this test may), then the peer
        // reads and owes its ACK.
        let repair = set_repair(&server, true).is_ok();
        let mut b = [0u8; 6];
        client.read_exact(&mut b).unwrap();
        let mut q = held(&server, &[]);
        q.await_acks(ACK_WAIT);
        assert_eq!(
            q.report.unacknowledged,
            Vec::<String>::new(),
            "repair mode: {repair}"
        );
        if repair {
            q.undo();
        }

        // A peer that reads nothing: the job's writes fill its window, and stay queued.
        let other = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut stuck, _) = listener.accept().unwrap();
        stuck.set_nonblocking(true).unwrap();
        let chunk = vec![7u8; 1 << 16];
        loop {
            match stuck.write(&chunk) {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        let mut q = held(&server, &[&stuck]);
        q.await_acks(Duration::from_millis(20));
        let left = &q.report.unacknowledged;
        assert_eq!(left.len(), 1, "{left:?}");
        let (at, to) = (stuck.local_addr().unwrap(), other.local_addr().unwrap());
        assert!(left[0].starts_with(&format!("{at} -> {to}: ")), "{left:?}");
        assert!(q.report.acks_waited_ms >= 20, "{:?}", q.report);

        // Both ends the job's: nothing to wait for, however full.
        let mut q = held(&stuck, &[&other]);
        q.await_acks(ACK_WAIT);
        assert_eq!(q.report.unacknowledged, Vec::<String>::new());

        // A queue that cannot be read (its process gone) is said, and not waited for.
        let mut q = held(&server, &[]);
        q.held[0].pid = i32::MAX;
        q.await_acks(Duration::from_secs(600));
        let left = &q.report.unacknowledged;
        assert_eq!(left.len(), 1, "{left:?}");
        assert!(left[0].contains("could not be read"), "{left:?}");
        assert!(q.report.acks_waited_ms < 600_000, "{:?}", q.report);
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
        held(&client, &[]).undo();
        client.write_all(b"y").unwrap();
        let mut b = [0u8; 1];
        server.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"y");
    }
}
