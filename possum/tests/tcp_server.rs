//! A server under possum with real CRIU, without a GPU: a job (this test binary started again,
//! see [`server_job`]) listening on a loopback TCP port, a UDP port and a unix socket, serving a
//! deterministic request/answer protocol ([`answer`]); its client is this test, outside the
//! job's tree, holding connections open across each operation and opening new ones, every answer
//! checked against the protocol's (none lost, none repeated: each answer depends on every request
//! before it on its connection).
//!
//! - a unix stream connection from outside the tree: the checkpoint is refused, saying so, and
//!   the job runs on;
//! - `possum checkpoint --leave-running --tcp-established`: the server answers on the held
//!   connection all along, and on new ones opened while it runs and after; a connection that
//!   waited in a listener's queue through the dump is accepted afterwards;
//! - `possum checkpoint --tcp-established` (the job killed), then `possum restore`: the held TCP
//!   connection goes on where it was, and new ones are accepted;
//! - `possum migrate --tcp-established` over loopback to a `possum receive` on this host: the
//!   same at the destination;
//! - `possum restore --tcp-close`: the held connection comes back closed (the client's next
//!   request gets a reset), and the server accepts new ones; where the connection's address is
//!   not the host's (another host, played by a network namespace whose address goes away), the
//!   restore without it fails, naming it.
//!
//! (The refusal of a checkpoint without `--tcp-established`, naming it, is tcp_established.rs's.)
//! The job is checkpointed with the driver engine (it has no libpossum) against the fake driver.
//! Needs root, CRIU and a C compiler: without them it prints `SKIPPED: ...` on stderr and passes;
//! with `POSSUM_REQUIRE_CRIU=1` (as CI sets) a missing CRIU fails it instead. A CRIU that cannot
//! dump TCP sockets on this kernel (4.1 and older on Linux 6.16 and later) skips it, whatever the
//! variable says: that is CRIU's limit, not the host's setup.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "support/criu_cli.rs"]
mod support;
use support::cli::possum_checkpointing_in as possum;
use support::receiver::Receiver;
use support::self_job::{alive, job_command, own_session, PASSCRED_REFUSED};
use support::{criu_or_skip, say, text, WAIT};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;

/// Set in the job's environment: the directory it writes its ports into and binds its unix
/// socket in.
const ROLE: &str = "POSSUM_TEST_SERVER_DIR";
/// Set in the job's environment: the address it listens on (default 127.0.0.1).
const ADDR: &str = "POSSUM_TEST_SERVER_ADDR";
/// The job's ports, `TCP UDP QUEUE`, written (renamed into place) once it listens.
const PORTS: &str = "ports";
/// The job's unix socket, in its directory.
const SOCK: &str = "server.sock";
/// A UDP request that has the server start accepting on its queue listener (answered as any).
const TAKE_QUEUE: u64 = u64::MAX;

/// The protocol: a connection's state is 0 at first; each request is a u64 (8 bytes, little
/// endian), and its answer the connection's next state, `answer(state, request)`. A datagram is
/// a request on a state of 0.
fn answer(state: u64, request: u64) -> u64 {
    (state ^ request)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(29)
        .wrapping_add(1)
}

/// The job, when this binary is started as it (a no-op otherwise): a server of [`answer`] on a
/// TCP listener and a UDP socket at its address ([`ADDR`]) and a unix listener, each connection
/// served by a thread of its own. It has a second TCP listener, the queue, where connections wait until a datagram
/// [`TAKE_QUEUE`] has it accept them.
#[test]
fn server_job() {
    if let Ok(dir) = std::env::var(ROLE) {
        serve(Path::new(&dir));
    }
}

fn serve(dir: &Path) -> ! {
    let addr = std::env::var(ADDR).unwrap_or_else(|_| "127.0.0.1".into());
    let tcp = TcpListener::bind((addr.as_str(), 0)).unwrap();
    let queue = TcpListener::bind((addr.as_str(), 0)).unwrap();
    let udp = UdpSocket::bind((addr.as_str(), 0)).unwrap();
    let unix = UnixListener::bind(dir.join(SOCK)).unwrap();
    let port = |a: std::io::Result<std::net::SocketAddr>| a.unwrap().port();
    let ports = format!(
        "{} {} {}",
        port(tcp.local_addr()),
        port(udp.local_addr()),
        port(queue.local_addr())
    );
    std::fs::write(dir.join("ports.tmp"), ports).unwrap();
    std::fs::rename(dir.join("ports.tmp"), dir.join(PORTS)).unwrap();
    std::thread::spawn(move || accept_all(tcp.incoming()));
    std::thread::spawn(move || accept_all(unix.incoming()));
    let mut queue = Some(queue);
    let mut b = [0u8; 8];
    loop {
        let (n, from) = udp.recv_from(&mut b).expect("a datagram");
        if n != b.len() {
            continue;
        }
        let request = u64::from_le_bytes(b);
        if request == TAKE_QUEUE {
            if let Some(q) = queue.take() {
                std::thread::spawn(move || accept_all(q.incoming()));
            }
        }
        udp.send_to(&answer(0, request).to_le_bytes(), from)
            .expect("an answer sent");
    }
}

fn accept_all<S: Read + Write + Send + 'static>(
    incoming: impl Iterator<Item = std::io::Result<S>>,
) {
    for c in incoming {
        let mut c = c.expect("a connection accepted");
        std::thread::spawn(move || {
            let (mut state, mut b) = (0, [0u8; 8]);
            while c.read_exact(&mut b).is_ok() {
                state = answer(state, u64::from_le_bytes(b));
                if c.write_all(&state.to_le_bytes()).is_err() {
                    return;
                }
            }
        });
    }
}

/// A stream the client's end of which can be shut for writing.
trait Stream: Read + Write {
    fn shutdown_write(&self) -> std::io::Result<()>;
}

impl Stream for TcpStream {
    fn shutdown_write(&self) -> std::io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

impl Stream for UnixStream {
    fn shutdown_write(&self) -> std::io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

/// A connection of the client's, and what the server's next answer on it must be.
struct Conn<S> {
    s: S,
    what: String,
    state: u64,
    asked: u64,
}

impl<S: Stream> Conn<S> {
    fn new(s: S, what: impl Into<String>) -> Conn<S> {
        Conn {
            s,
            what: what.into(),
            state: 0,
            asked: 0,
        }
    }

    /// One request, its answer checked; `Err` says what went wrong.
    fn ask(&mut self) -> Result<(), String> {
        let n = self.asked + 1;
        let request = n.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0x5eed;
        let what = &self.what;
        (self.s.write_all(&request.to_le_bytes()))
            .map_err(|e| format!("{what}: request {n} could not be sent: {e}"))?;
        let mut b = [0u8; 8];
        (self.s.read_exact(&mut b))
            .map_err(|e| format!("{what}: no answer to request {n}: {e}"))?;
        let (got, want) = (u64::from_le_bytes(b), answer(self.state, request));
        if got != want {
            return Err(format!(
                "{what}: the answer to request {n} is {got:#x}, the protocol's {want:#x}"
            ));
        }
        self.state = want;
        self.asked = n;
        Ok(())
    }

    /// `n` requests, each answered right.
    fn ask_n(&mut self, n: u64) {
        for _ in 0..n {
            self.ask().unwrap_or_else(|e| panic!("{e}"));
        }
    }

    /// Closes the connection, once the server has closed its end: nothing of it is left in
    /// the server for a checkpoint to see.
    fn finish(mut self) -> Result<(), String> {
        let what = &self.what;
        (self.s.shutdown_write()).map_err(|e| format!("{what}: not shut: {e}"))?;
        let mut b = [0u8; 8];
        match self.s.read(&mut b) {
            Ok(0) => Ok(()),
            Ok(_) => Err(format!("{what}: more than its answers")),
            Err(e) => Err(format!("{what}: not closed by the server: {e}")),
        }
    }
}

/// The job, started by [`Server::start`]; killed when dropped.
struct Server {
    dir: PathBuf,
    pid: i32,
    tcp: u16,
    udp: u16,
    queue: u16,
    /// The thread that reaps the process started, as soon as it ends (a checkpoint or a
    /// migration kills it, and its PID must be free for CRIU's restore).
    reaper: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.pid), Signal::SIGKILL);
        match self.reaper.take() {
            Some(r) => {
                let _ = r.join();
            }
            // A restored copy: this process's (a subreaper's) to reap.
            None => {
                let _ = possum_criu::wait_for_exit(self.pid, Some(WAIT));
            }
        }
    }
}

impl Server {
    /// The server in its own session, its fake driver loaded, once it listens on `addr`.
    fn start(dir: &Path, addr: &str) -> Server {
        let stderr = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(dir.join("server.stderr"))
            .unwrap();
        let mut cmd = job_command("server_job", ROLE, dir);
        // The fake driver in the job keeps its checkpoint state there, as the real driver's
        // is, so that the restore (another possum process) finds it. Its stderr is a file,
        // which CRIU reopens at a restore.
        cmd.env("LD_PRELOAD", dir.join("libcuda.so.1"))
            .env(ADDR, addr)
            .stderr(stderr);
        let mut child = own_session(&mut cmd).spawn().unwrap();
        let pid = child.id() as i32;
        let reaper = Some(std::thread::spawn(move || {
            let _ = child.wait();
        }));
        let t = Instant::now();
        let ports = loop {
            if let Ok(p) = std::fs::read_to_string(dir.join(PORTS)) {
                break p;
            }
            assert!(t.elapsed() < WAIT, "the server did not listen");
            std::thread::sleep(Duration::from_millis(10));
        };
        let p: Vec<u16> = ports.split(' ').map(|p| p.parse().unwrap()).collect();
        Server {
            dir: dir.to_path_buf(),
            pid,
            tcp: p[0],
            udp: p[1],
            queue: p[2],
            reaper,
        }
    }

    fn connect(&self, what: &str) -> Conn<TcpStream> {
        Conn::new(tcp_to(self.tcp), format!("TCP connection {what}"))
    }

    fn connect_unix(&self, what: &str) -> Conn<UnixStream> {
        let s = UnixStream::connect(self.dir.join(SOCK)).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        Conn::new(s, format!("unix connection {what}"))
    }

    /// One datagram's answer (`request`), checked.
    fn ask_udp(&self, request: u64, what: &str) {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.send_to(&request.to_le_bytes(), ("127.0.0.1", self.udp))
            .unwrap();
        let mut b = [0u8; 8];
        let n = (s.recv(&mut b)).unwrap_or_else(|e| panic!("UDP {what}: no answer: {e}"));
        assert_eq!(n, 8, "UDP {what}");
        assert_eq!(u64::from_le_bytes(b), answer(0, request), "UDP {what}");
    }

    /// New TCP and unix connections are accepted and answered, then closed, and datagrams
    /// answered.
    fn answers_new_clients(&self, what: &str) {
        let mut c = self.connect(&format!("new {what}"));
        c.ask_n(3);
        c.finish().unwrap_or_else(|e| panic!("{e}"));
        let mut c = self.connect_unix(&format!("new {what}"));
        c.ask_n(3);
        c.finish().unwrap_or_else(|e| panic!("{e}"));
        for r in [1, 2, 3] {
            self.ask_udp(r, what);
        }
    }

    /// `possum checkpoint --engine driver PID -D img ARGS`.
    fn checkpoint(&self, img: &Path, args: &[&str]) -> Output {
        possum(&self.dir)
            .args([
                "checkpoint",
                "--engine",
                "driver",
                &self.pid.to_string(),
                "-D",
            ])
            .arg(img)
            .args(args)
            .output()
            .unwrap()
    }

    /// [`Self::checkpoint`], or `None` where it failed for this CRIU's inability to dump TCP
    /// sockets on this kernel ([`criu_cannot_dump_tcp`]: the test `test` is skipped).
    fn checkpoint_tcp(&self, img: &Path, args: &[&str], test: &str) -> Option<Output> {
        let out = self.checkpoint(img, args);
        (!criu_cannot_dump_tcp(&out, self, test)).then_some(out)
    }

    /// Waits for the end of the process started, which a checkpoint or a migration killed.
    fn killed(&mut self) {
        self.reaper.take().unwrap().join().unwrap();
    }

    /// `possum restore -D img ARGS`, which must succeed; the job runs again.
    fn restore(&self, img: &Path, args: &[&str]) -> String {
        let out = possum(&self.dir)
            .args(["restore", "-D"])
            .arg(img)
            .args(args)
            .output()
            .unwrap();
        let said = text(&out);
        assert!(out.status.success(), "{said}\n{}", self.log(img));
        assert!(alive(self.pid), "{said}");
        said
    }

    /// CRIU's restore log of `img` and the server's stderr, for a failure's message.
    fn log(&self, img: &Path) -> String {
        let read = |p: PathBuf| std::fs::read_to_string(p).unwrap_or_default();
        format!(
            "CRIU's restore log:\n{}\nthe server's stderr:\n{}",
            read(img.join("criu/restore.log")),
            read(self.dir.join("server.stderr"))
        )
    }
}

fn tcp_to(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s
}

/// A server on loopback in a temporary directory with the fake driver, this process the
/// subreaper of its restored copies, and a TCP connection to it held open, asked 5 times;
/// `None` (said why) to skip.
fn setup(test: &str) -> Option<(tempfile::TempDir, Server, Conn<TcpStream>)> {
    let (tmp, server) = setup_on(test, "127.0.0.1")?;
    let mut held = server.connect("held open");
    held.ask_n(5);
    Some((tmp, server, held))
}

/// [`setup`], the server listening on `addr`.
fn setup_on(test: &str, addr: &str) -> Option<(tempfile::TempDir, Server)> {
    criu_or_skip(test)?;
    let tmp = tempfile::Builder::new()
        .prefix("possum-server-")
        .tempdir()
        .unwrap();
    if !support::self_job::fake_driver(tmp.path(), test) {
        return None;
    }
    possum_criu::set_child_subreaper().unwrap();
    let server = Server::start(tmp.path(), addr);
    Some((tmp, server))
}

/// Whether a checkpoint's failure is this CRIU's inability to dump TCP sockets on this kernel
/// (said, for the test `test`, which is then skipped), after checking that the job runs on.
fn criu_cannot_dump_tcp(out: &Output, server: &Server, test: &str) -> bool {
    let said = text(out);
    if out.status.success() || !said.contains(PASSCRED_REFUSED) {
        return false;
    }
    assert!(
        said.contains("this CRIU cannot dump the job's TCP sockets"),
        "{said}"
    );
    server.answers_new_clients("after the failed checkpoint");
    say(&format!(
        "{test}: SKIPPED: this CRIU cannot dump a TCP socket on this kernel (Linux {}: \
         SO_PASSCRED is refused on inet sockets); the job ran on",
        support::self_job::kernel()
    ));
    true
}

/// The image's `possum.json`.
fn manifest(img: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(img.join("possum.json")).unwrap()).unwrap()
}

/// Requests on `conn` on a thread, one after the other, and every eighth a new connection to
/// `port` asked twice and closed, until `stop`: the connection back and how many requests were
/// answered on it, or the first error.
fn keep_asking(
    mut conn: Conn<TcpStream>,
    port: u16,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Result<(Conn<TcpStream>, u64), String>> {
    std::thread::spawn(move || {
        let mut n = 0;
        while !stop.load(Ordering::Relaxed) {
            conn.ask()?;
            n += 1;
            if n % 8 == 0 {
                let mut new = Conn::new(tcp_to(port), format!("new TCP connection {n}"));
                new.ask()?;
                new.ask()?;
                new.finish()?;
            }
        }
        Ok((conn, n))
    })
}

#[test]
fn a_server_answers_through_a_kept_checkpoint_and_on_its_connection_after_a_restore() {
    let test = "tcp_server";
    let Some((tmp, mut server, held)) = setup(test) else {
        return;
    };
    let dir = tmp.path();
    // A connection the server has not accepted yet: it waits in the queue listener's backlog.
    let mut queued = Conn::new(tcp_to(server.queue), "TCP connection in a listener's queue");
    server.answers_new_clients("before any checkpoint");

    // A unix stream connection from outside the tree: refused, said so; the job runs on.
    let mut held_unix = server.connect_unix("held open");
    held_unix.ask_n(5);
    let kept = dir.join("kept");
    let Some(out) = server.checkpoint_tcp(&kept, &["--leave-running", "--tcp-established"], test)
    else {
        return;
    };
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("unix stream connection to a process outside it"),
        "{}",
        text(&out)
    );
    assert!(alive(server.pid) && !kept.exists());
    held_unix.ask_n(5);
    held_unix.finish().unwrap();

    // Left running: the held connection is asked all along, and new ones opened; the server
    // answers throughout and after, on the held connection and new ones.
    let stop = Arc::new(AtomicBool::new(false));
    let asking = keep_asking(held, server.tcp, stop.clone());
    let out = server.checkpoint(&kept, &["--leave-running", "--tcp-established"]);
    stop.store(true, Ordering::Relaxed);
    let (mut held, during) = asking.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
    assert!(out.status.success(), "{}", text(&out));
    assert!(alive(server.pid));
    assert_eq!(manifest(&kept)["tcp_established"], "skip");
    held.ask_n(5);
    server.answers_new_clients("after the kept checkpoint");
    // The connection that waited in the queue through the dump is taken now.
    server.ask_udp(TAKE_QUEUE, "taking the queue");
    queued.ask_n(3);
    queued.finish().unwrap();

    // Killed, then restored on this host: the held TCP connection goes on where it was. It was
    // closed in repair mode at the kill, its peer (this test) not told: the only connection
    // the server had. This test's ACK of the last answer, delayed, came before the kill.
    let img = dir.join("img");
    let out = server.checkpoint(&img, &["--tcp-established", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    closed_quietly(&v["tcp_quiet"], &v);
    server.killed();
    assert!(!alive(server.pid));
    let restored = server.restore(&img, &[]);
    held.ask_n(5);
    server.answers_new_clients("after the restore");
    say(&format!(
        "{test}: {} requests answered on the held connection ({during} while the kept checkpoint \
         ran); {}",
        held.asked,
        restored.trim()
    ));
}

/// A report's `tcp_quiet` (of `report`): the server's one connection closed in repair mode at
/// the kill, everything the server had sent it acknowledged by then.
fn closed_quietly(quiet: &Value, report: &Value) {
    assert_eq!(quiet["sockets"], 1, "{report}");
    assert_eq!(quiet["failed"], serde_json::json!([]), "{report}");
    assert_eq!(quiet["unacknowledged"], serde_json::json!([]), "{report}");
}

/// `possum migrate` of the server to a `possum receive` on this host, with `args`.
fn migrate(server: &Server, args: &[&str]) -> (Output, Output) {
    let dir = &server.dir;
    std::fs::create_dir_all(dir.join("received")).unwrap();
    let mut receiver = Receiver::start(dir, "key", &[]);
    let addr = receiver.addr.clone();
    let out = possum(dir)
        .args([
            "migrate",
            &server.pid.to_string(),
            "--engine",
            "driver",
            "--json",
        ])
        .args(["--to", &addr, "--key-file"])
        .arg(dir.join("key"))
        .arg("-D")
        .arg(dir.join("local"))
        .args(args)
        .output()
        .unwrap();
    if !out.status.success() {
        // A migration refused before it connected leaves the receiver waiting.
        let _ = receiver.child.kill();
    }
    let received = receiver.output();
    (out, received)
}

#[test]
fn a_migrated_server_answers_at_the_destination_on_its_connection() {
    let test = "tcp_server_migrate";
    let Some((tmp, mut server, mut held)) = setup(test) else {
        return;
    };
    let dir = tmp.path();
    std::fs::write(dir.join("key"), [7u8; 32]).unwrap();
    let (out, received) = migrate(&server, &["--tcp-established"]);
    if criu_cannot_dump_tcp(&out, &server, test) {
        return;
    }
    assert!(
        out.status.success(),
        "{}\nthe receiver: {}",
        text(&out),
        text(&received)
    );
    assert!(received.status.success(), "{}", text(&received));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    closed_quietly(&v["checkpoint"]["tcp_quiet"], &v);
    let r: Value = serde_json::from_slice(&received.stdout).unwrap();
    server.killed();
    // Restored at the destination (this host) under its PID: the held connection goes on.
    assert_eq!(r["pid"], server.pid, "{r}");
    assert!(alive(server.pid), "{}", text(&out));
    held.ask_n(5);
    server.answers_new_clients("at the destination");
}

/// The client's next request on `conn`, whose server end came back closed: answered by a reset.
fn reset(conn: &mut Conn<TcpStream>) {
    // The request may be taken by the client's kernel before the reset comes.
    let _ = conn.s.write_all(&1u64.to_le_bytes());
    let mut b = [0u8; 8];
    let got = conn.s.read(&mut b);
    assert!(
        matches!(&got, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "{}: {got:?}, not a reset",
        conn.what
    );
}

#[test]
fn restored_with_tcp_close_its_connections_come_back_closed() {
    let test = "tcp_server_close";
    let Some((tmp, mut server, mut held)) = setup(test) else {
        return;
    };
    let dir = tmp.path();
    let img = dir.join("img");
    let Some(out) = server.checkpoint_tcp(&img, &["--tcp-established"], test) else {
        return;
    };
    assert!(out.status.success(), "{}", text(&out));
    server.killed();
    let said = server.restore(&img, &["--tcp-close", "--json"]);
    let r: Value = serde_json::from_str(said.lines().next().unwrap()).unwrap();
    assert_eq!(r["tcp_closed"], true, "{r}");
    reset(&mut held);
    server.answers_new_clients("after a restore with --tcp-close");
}

/// Set in the environment of this binary started again in a network namespace of its own, to
/// run [`another_host`].
const NETNS: &str = "POSSUM_TEST_SERVER_NETNS";
/// The address the held connection goes to, there: the server's host's, gone at the restore.
const HOST_ADDR: &str = "10.77.0.1";

/// A restore where the address of the job's connections is not the host's, as on another host:
/// without --tcp-close it fails, naming the flag; with it the job runs, its connection closed
/// (a reset to its peer), new connections accepted. In a network namespace of its own (run by
/// `unshare --net`), where the address can come and go.
#[test]
fn restored_where_its_address_is_not_the_connections_come_back_closed() {
    let test = "tcp_server_elsewhere";
    if std::env::var(NETNS).is_ok() {
        another_host(test);
        return;
    }
    if criu_or_skip(test).is_none() {
        return;
    }
    let unshared = std::process::Command::new("unshare")
        .args(["--net", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "restored_where_its_address_is_not_the_connections_come_back_closed",
        ])
        .args(["--nocapture", "--test-threads=1"])
        .env(NETNS, "1")
        .output();
    let out = match unshared {
        Ok(o) => o,
        Err(e) => {
            say(&format!("{test}: SKIPPED: unshare could not be run: {e}"));
            return;
        }
    };
    let said = text(&out);
    for l in said.lines().filter(|l| l.contains(test)) {
        say(l);
    }
    assert!(
        out.status.success(),
        "in its own network namespace:\n{said}"
    );
    assert!(said.contains("1 passed"), "{said}");
}

/// `ip ARGS`, which must succeed.
fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "ip {args:?}: {}", text(&out));
}

/// [`restored_where_its_address_is_not_the_connections_come_back_closed`], in its namespace.
fn another_host(test: &str) {
    let host = format!("{HOST_ADDR}/32");
    ip(&["link", "set", "lo", "up"]);
    ip(&["addr", "add", &host, "dev", "lo"]);
    let Some((tmp, mut server)) = setup_on(test, "0.0.0.0") else {
        return;
    };
    let dir = tmp.path();
    let s = TcpStream::connect((HOST_ADDR, server.tcp)).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut held = Conn::new(s, format!("TCP connection to {HOST_ADDR}, held open"));
    held.ask_n(5);
    let img = dir.join("img");
    let Some(out) = server.checkpoint_tcp(&img, &["--tcp-established"], test) else {
        return;
    };
    assert!(out.status.success(), "{}", text(&out));
    server.killed();

    // The host's address is gone: the connection cannot be bound back.
    ip(&["addr", "del", &host, "dev", "lo"]);
    let out = possum(dir)
        .args(["restore", "-D"])
        .arg(&img)
        .output()
        .unwrap();
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("could not be bound back") && said.contains("--tcp-close"),
        "{said}"
    );
    // What CRIU had restored of it is gone: reaped here (this process is the subreaper).
    support::self_job::reap(server.pid);

    let said = server.restore(&img, &["--tcp-close"]);
    assert!(said.contains("restored closed"), "{said}");
    // The peer reaches the host again: its next request is answered by a reset.
    ip(&["addr", "add", &host, "dev", "lo"]);
    reset(&mut held);
    server.answers_new_clients("after a restore elsewhere with --tcp-close");
}
