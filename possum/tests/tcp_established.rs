//! `possum checkpoint --tcp-established` with real CRIU, without a GPU: a job of two processes
//! (this test binary started again, see [`tcp_job`]) that pass a counter back and forth over
//! an established loopback TCP connection, as torchrun's agent and ranks talk over TCPStore.
//! Without the flag the checkpoint is refused, naming it, and the job runs on; with it the job
//! is dumped and killed, and `possum restore` (not told anything) brings both processes back
//! with their connection, over which the counter goes on.
//!
//! The job is checkpointed with the driver engine (it has no libpossum) against the fake driver.
//! Needs root, CRIU and a C compiler (for the fake driver): without them it prints
//! `SKIPPED: ...` on stderr and passes; with `POSSUM_REQUIRE_CRIU=1` (as CI sets) a missing
//! CRIU, or a kernel without TCP repair, fails it instead. A CRIU older than the kernel that
//! cannot dump TCP sockets (CRIU 4.1 and older on Linux 6.16 and later; 4.2 can) skips the dump
//! with the connection and the restore, whatever the variable says, once the refusal without
//! the flag is checked: that is CRIU's limit, not the host's setup.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[path = "support/criu_cli.rs"]
mod support;
use support::cli::possum_checkpointing_in as possum;
use support::self_job::{alive, kernel, own_session, reap, KillOnDrop, PASSCRED_REFUSED};
use support::{criu_or_skip, run_ok, say, text, WAIT};

use serde_json::Value;

/// Set in the job's environment: its role (`server` or `client`).
const ROLE: &str = "POSSUM_TEST_TCP_JOB";
/// The server's record: `client PID`, then each counter value it received, one a line, or
/// `broken: WHY` when the connection failed.
const OUT: &str = "POSSUM_TEST_TCP_OUT";
/// The client's: the server's port.
const PORT: &str = "POSSUM_TEST_TCP_PORT";

/// The job's processes, when this binary is started as one of them (a no-op otherwise). The
/// server listens on a loopback port, starts the client, accepts its connection and sends it
/// a counter; the client sends back one more; the server records what it got and sends one
/// more again, every 20 ms, until the connection fails.
#[test]
fn tcp_job() {
    match std::env::var(ROLE).as_deref() {
        Ok("server") => server(Path::new(&std::env::var(OUT).unwrap())),
        Ok("client") => client(std::env::var(PORT).unwrap().parse().unwrap()),
        _ => {}
    }
}

fn record(out: &Path, line: &str) {
    // Opened for each line: a restored job opens it again by its path.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(out)
        .unwrap();
    writeln!(f, "{line}").unwrap();
}

fn server(out: &Path) -> ! {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut client = job_command(ROLE, "client")
        .env(PORT, port.to_string())
        .spawn()
        .unwrap();
    record(out, &format!("client {}", client.id()));
    let (mut conn, _) = listener.accept().unwrap();
    drop(listener);
    let mut n: u64 = 0;
    let broken = loop {
        let step = conn.write_all(&n.to_le_bytes()).and_then(|()| {
            let mut b = [0u8; 8];
            conn.read_exact(&mut b).map(|()| u64::from_le_bytes(b))
        });
        match step {
            Ok(got) if got == n + 1 => {
                record(out, &got.to_string());
                n = got + 1;
            }
            Ok(got) => break format!("sent {n}, got {got}"),
            Err(e) => break e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    record(out, &format!("broken: {broken}"));
    let _ = client.kill();
    let _ = client.wait();
    std::process::exit(1);
}

fn client(port: u16) -> ! {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut b = [0u8; 8];
    while conn.read_exact(&mut b).is_ok() {
        let n = u64::from_le_bytes(b) + 1;
        if conn.write_all(&n.to_le_bytes()).is_err() {
            break;
        }
    }
    std::process::exit(1);
}

/// This test binary, running only [`tcp_job`] as `role`, its standard descriptors on
/// /dev/null (a restored job has no pipes to this test).
fn job_command(var: &str, role: &str) -> Command {
    support::self_job::job_command("tcp_job", var, role)
}

/// The server's record.
struct Record(PathBuf);

impl Record {
    fn lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.0)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// The client's PID, once the server has started it.
    fn client(&self) -> i32 {
        let t = Instant::now();
        loop {
            if let Some(p) = self.lines().iter().find_map(|l| l.strip_prefix("client ")) {
                return p.parse().unwrap();
            }
            assert!(t.elapsed() < WAIT, "the job did not start its client");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The highest counter recorded; fails on a broken connection.
    fn counter(&self) -> u64 {
        let lines = self.lines();
        if let Some(b) = lines.iter().find(|l| l.starts_with("broken")) {
            panic!(
                "the job's connection failed: {b}; its record:\n{}",
                lines.join("\n")
            );
        }
        lines
            .iter()
            .filter_map(|l| l.parse::<u64>().ok())
            .max()
            .unwrap_or(0)
    }

    /// Waits until the counter is past `n`.
    fn past(&self, n: u64, what: &str) -> u64 {
        let t = Instant::now();
        loop {
            let c = self.counter();
            if c > n {
                return c;
            }
            assert!(
                t.elapsed() < WAIT,
                "{what}: the counter stays at {c}, not past {n}; the record:\n{}",
                self.lines().join("\n")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn a_job_talking_over_tcp_is_checkpointed_with_its_connection_and_restored() {
    if criu_or_skip("tcp_established").is_none() {
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("possum-tcp-")
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    if !support::self_job::fake_driver(dir, "tcp_established") {
        return;
    }
    // The client is adopted here when the server dies, to be reaped before its PID is
    // restored.
    possum_criu::set_child_subreaper().unwrap();
    let rec = Record(dir.join("record"));
    let mut server = job_command(ROLE, "server");
    // The fake driver in the job's processes keeps their checkpoint state there, as the real
    // driver's is, so that the restore (another possum process) finds it.
    server
        .env(OUT, &rec.0)
        .env("LD_PRELOAD", dir.join("libcuda.so.1"));
    // A session of its own, which its client shares.
    let server = own_session(&mut server).spawn().unwrap();
    let pid = server.id() as i32;
    let mut job = KillOnDrop(vec![pid], Some(server));
    let client = rec.client();
    job.0.push(client);
    let before = rec.past(5, "the job");

    // Without the flag: refused, naming it; the job runs on, its connection intact.
    let img = dir.join("img");
    let out = possum(dir)
        .args(["checkpoint", "--engine", "driver", &pid.to_string(), "-D"])
        .arg(&img)
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    let said = text(&out);
    assert!(
        said.contains("established TCP connection") && said.contains("--tcp-established"),
        "{said}"
    );
    assert!(alive(pid) && alive(client), "{said}");
    let refused_at = rec.past(before + 5, "the job after the refused checkpoint");
    // Seen to step once more first: the job steps every 20 ms, and the dump below may freeze it
    // sooner than that.
    rec.past(refused_at, "the job before its dump");

    // With it: dumped, then killed.
    let out = possum(dir)
        .args(["checkpoint", "--engine", "driver", "--tcp-established"])
        .arg(pid.to_string())
        .arg("-D")
        .arg(&img)
        .output()
        .unwrap();
    let said = text(&out);
    if !out.status.success() && said.contains(PASSCRED_REFUSED) {
        // Linux 6.16 and later answer SO_PASSCRED only on unix and netlink sockets; CRIU
        // releases without their fix for it (4.1 and older) fail on any TCP socket there.
        assert!(
            said.contains("this CRIU cannot dump the job's TCP sockets"),
            "{said}"
        );
        assert!(alive(pid) && alive(client), "{said}");
        rec.past(refused_at + 5, "the job after the failed checkpoint");
        say(&format!(
            "tcp_established: SKIPPED the dump with the connection: this CRIU cannot dump a TCP \
             socket on this kernel (Linux {}: SO_PASSCRED is refused on inet sockets); the \
             refusal without --tcp-established was checked, and the job ran on after both",
            kernel()
        ));
        return;
    }
    if !out.status.success()
        && (said.contains("TCP_REPAIR") || said.contains("repair mode"))
        && std::env::var("POSSUM_REQUIRE_CRIU").as_deref() != Ok("1")
    {
        say(&format!(
            "tcp_established: SKIPPED: CRIU cannot put TCP sockets in repair mode here:\n{said}"
        ));
        return;
    }
    assert!(out.status.success(), "{said}");
    job.1.take().unwrap().wait().unwrap();
    reap(client);
    assert!(!alive(pid) && !alive(client));
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(img.join("possum.json")).unwrap()).unwrap();
    assert_eq!(manifest["tcp_established"], "skip", "{manifest}");
    let killed_at = rec.counter();
    assert!(killed_at > refused_at, "{killed_at} <= {refused_at}");

    // The restore is not told: the image says so.
    let out = run_ok(possum(dir).args(["restore", "-D"]).arg(&img));
    assert!(alive(pid) && alive(client), "{}", text(&out));
    rec.past(killed_at + 10, "the restored job");
    let record = rec.lines();
    let restore_log = std::fs::read_to_string(img.join("criu/restore.log")).unwrap_or_default();
    assert!(
        !record.iter().any(|l| l.starts_with("broken")),
        "{}\n{restore_log}",
        record.join("\n")
    );
}

#[test]
fn network_lock_is_refused_without_tcp_established() {
    let out = Command::new(env!("CARGO_BIN_EXE_possum"))
        .args([
            "checkpoint",
            "1",
            "-D",
            "/nonexistent/img",
            "--network-lock",
        ])
        .arg("iptables")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let said = text(&out);
    assert!(said.contains("--tcp-established"), "{said}");
}
