//! `possum migrate` and `possum receive`: the command line of possum-sequence's migration
//! (`possum_sequence::migrate`, whose documentation describes the phases): clap's arguments to
//! its parameters, and what is printed.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use possum_sequence::auth::HmacKey;
use possum_sequence::figures::ms;
use possum_sequence::migrate::{
    self, Deadlines, MigrateParams, MigrateReport, ReceiveParams, Received,
};
use possum_sequence::wire::{self, Accepted, Sessions};
use possum_sequence::{CheckpointParams, Environment, RestoreParams};

use crate::checkpoint::{EngineKind, Notes, TcpArgs};
use crate::progress::MigrateLine;
use std::io::IsTerminal;

/// Arguments of `possum migrate`.
#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// The process to migrate (the root of its tree).
    pub pid: i32,
    /// The destination: a `possum receive` listening there.
    #[arg(long, value_name = "HOST:PORT")]
    pub to: String,
    /// The secret shared with the destination (a file of 32 bytes or more): each end proves it
    /// holds it, and every frame of the transfer is authenticated under it.
    #[arg(long, value_name = "FILE")]
    pub key_file: PathBuf,
    /// Where the job's image is written here first (must not exist; default: a new directory
    /// under the temporary directory). Removed once the job runs at the destination and its
    /// image there is on disk; kept if the job runs on here, whose buffers come back from it.
    #[arg(short = 'D', long = "images-dir", value_name = "LOCAL_DIR")]
    pub dir: Option<PathBuf>,
    /// possum, or the baseline `driver` (CRIU + NVIDIA's driver checkpoint only).
    #[arg(long, value_enum, default_value = "possum")]
    pub engine: EngineKind,
    /// Seconds each read or write of the transfer may wait for the destination (and the
    /// connection, at most 10 of them).
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub timeout: u64,
    /// Seconds the destination's restore may take before the job is restored here instead.
    #[arg(long, value_name = "SECS", default_value_t = 300)]
    pub restore_timeout: u64,
    /// Send at most RATE, all streams together
    ///
    /// Send the image at most this fast, all streams together: a
    /// number and a unit of bytes (B, kB, MB, GB, KiB, MiB, GiB) or
    /// of bits (kbit, Mbit, Gbit), with or without /s: e.g. 500MB/s
    /// or 10Gbit. Default: as fast as the network goes.
    #[arg(long, value_name = "RATE", value_parser = parse_max_rate, verbatim_doc_comment)]
    pub max_rate: Option<u64>,
    /// Send over N authenticated connections at once
    ///
    /// Send the image over N TCP connections at once (1 to 64), each
    /// authenticated on its own, the files' bytes spread over them.
    /// Default: one per core, at most 8 (at least 2 with --post-copy).
    #[arg(
        long,
        value_name = "N",
        value_parser = clap::value_parser!(u32).range(1..=64),
        verbatim_doc_comment
    )]
    pub streams: Option<u32>,
    /// At most N pre-copy rounds while the job runs, each sent ahead: the first copies every
    /// buffer, each next one what the job wrote since the one before; they stop once a round
    /// copies nothing or no less than the one before, and the job is held for the rest
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_rounds: u32,
    /// One pre-copy round only: the job is held right after it (--max-rounds 1)
    #[arg(long, conflicts_with = "max_rounds")]
    pub stop_now: bool,
    /// Let the job run at the destination before the pieces of its GPU buffers it wrote since
    /// the last round are there: they are sent after the rest, in the order the job needs
    /// them, and it waits only for those it touches (needs --streams 2 or more)
    #[arg(long)]
    pub post_copy: bool,
    /// Established TCP connections.
    #[command(flatten)]
    pub tcp: TcpArgs,
    /// Print the figures as JSON.
    #[arg(long)]
    pub json: bool,
    /// Directory of the job's control socket (default: $POSSUM_SOCKET_DIR, else /tmp/possum):
    /// named in the image, the job's socket comes back there at the destination, and here if it
    /// is restored here.
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
}

/// Arguments of `possum receive`.
#[derive(Args, Debug)]
pub struct ReceiveArgs {
    /// The address to listen on (port 0: any free port, printed).
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: String,
    /// The secret shared with the sources (a file of 32 bytes or more).
    #[arg(long, value_name = "FILE")]
    pub key_file: PathBuf,
    /// The directory images are received into, each as a new directory `job-MILLIS` in it,
    /// kept while the restored job runs (its buffers come back from it).
    #[arg(short = 'D', long = "images-dir", value_name = "DIR")]
    pub dir: PathBuf,
    /// Receive every migration that comes, several at once, until killed (default: the first
    /// that authenticates, then exit).
    #[arg(long)]
    pub serve: bool,
    /// Seconds each read or write of a transfer may wait for the source, and the source may
    /// take to let its job go once the image arrived.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub timeout: u64,
    /// Print each migration's figures as JSON (one line each).
    #[arg(long)]
    pub json: bool,
    /// Directory of the restored job's control socket (default: the one it had at the source,
    /// which the source names).
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
}

fn deadlines(timeout: u64, restore: Option<u64>) -> Deadlines {
    let d = Deadlines::default();
    let io = Duration::from_secs(timeout.max(1));
    Deadlines {
        connect: d.connect.min(io),
        io,
        handshake: d.handshake.min(io),
        release: io,
        restore: restore.map_or(d.restore, |s| Duration::from_secs(s.max(1))),
        kill: d.kill,
    }
}

/// `--max-rate`'s value: bytes a second.
fn parse_max_rate(text: &str) -> Result<u64, String> {
    wire::parse_rate(text).map_err(|e| e.to_string())
}

/// `--streams`'s default: one per core, at most 8.
fn default_streams() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8) as u32)
}

fn read_key(path: &std::path::Path) -> Result<HmacKey> {
    HmacKey::read(path).with_context(|| format!("the key file {}", path.display()))
}

/// A new local image directory under the temporary directory.
fn local_dir(pid: i32) -> PathBuf {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    std::env::temp_dir().join(format!("possum-migrate-{pid}-{stamp}"))
}

/// `possum migrate`.
pub fn migrate(a: &MigrateArgs) -> Result<bool> {
    // Read before anything is done: a key that is not one refuses the migration.
    let key = read_key(&a.key_file)?;
    // Absolute: the image names it for the destination, whose working directory is another.
    let sockets = a
        .socket_dir
        .clone()
        .unwrap_or_else(possum_control::socket_dir);
    let sockets = std::path::absolute(&sockets)
        .with_context(|| format!("the socket directory {}", sockets.display()))?;
    let params = MigrateParams {
        checkpoint: CheckpointParams {
            pid: a.pid,
            dir: a.dir.clone().unwrap_or_else(|| local_dir(a.pid)),
            leave_running: true,
            engine: a.engine.into(),
            gpu_only: false,
            force: false,
            parent: None,
            keep_on_gpu: 0,
            shadow_budget: None,
            tcp_established: a.tcp.lock(),
            precopy_rounds: if a.stop_now { 1 } else { a.max_rounds },
            sockets,
            possum_exe: std::env::current_exe().context("finding possum's own binary")?,
            env: Environment::read(),
            relay_watch: Default::default(),
        },
        to: a.to.clone(),
        key,
        deadlines: deadlines(a.timeout, Some(a.restore_timeout)),
        max_rate: a.max_rate,
        streams: a
            .streams
            .unwrap_or_else(|| default_streams().max(if a.post_copy { 2 } else { 1 })),
        post_copy: a.post_copy,
    };
    let mut line = MigrateLine::new(!a.json && std::io::stderr().is_terminal());
    let report = migrate::migrate(&params, &mut line);
    drop(line);
    let report = report?;
    if a.json {
        println!("{}", serde_json::to_value(&report)?);
    } else {
        print_migrate(&report);
    }
    Ok(true)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// What `possum migrate` prints without --json.
fn print_migrate(r: &MigrateReport) {
    let t = &r.timings;
    println!(
        "possum: process {} migrated to {}, where it runs as process {}: {} files, {:.1} MiB",
        r.pid,
        r.to,
        r.remote_pid,
        r.files,
        mib(r.bytes)
    );
    println!(
        "  {:.1} MiB sent ahead while the job ran ({:.0} ms), {:.1} MiB while it was held",
        mib(r.bytes_before_hold),
        ms(t.ahead),
        mib(r.bytes_while_held)
    );
    let rounds: Vec<String> = (r.checkpoint.figures.precopy_rounds.iter())
        .map(|p| format!("{:.1}", mib(p.bytes)))
        .collect();
    if !rounds.is_empty() {
        println!(
            "  {} pre-copy rounds while it ran: {} MiB copied",
            rounds.len(),
            rounds.join(", ")
        );
    }
    if let Some(l) = r.loaded_ahead.filter(|l| l.loaded + l.left > 0) {
        println!(
            "  the destination had loaded {:.1} of {:.1} MiB ahead when the job was held \
             (waited {:.0} ms for it, the job running)",
            mib(l.loaded),
            mib(l.loaded + l.left),
            ms(l.waited)
        );
    }
    println!(
        "  downtime {:.0} ms (the checkpoint's hold {:.0}, send {:.0} of which hashing again \
         {:.0} and the destination's commit {:.0}, kill {:.0} after it (of {:.0}), restore there \
         {:.0}, the job's wait there for its buffers {}); total {:.0} ms",
        ms(t.downtime),
        ms(r.checkpoint.figures.hold),
        ms(t.send),
        ms(t.send_hashing),
        ms(t.send_committing),
        ms(t.kill_after_send),
        ms(t.kill),
        ms(t.remote_restore),
        t.waited_after_resume
            .map_or("not said".to_string(), |w| format!("{:.0}", ms(w))),
        ms(t.total)
    );
    let finals = r
        .checkpoint
        .release_report
        .as_ref()
        .map(|rel| &rel.body.finals);
    if let Some(line) = finals.and_then(|f| held_copy_line(f)) {
        println!("{line}");
    }
    if let Some(q) = &r.checkpoint.tcp_quiet {
        crate::checkpoint::tcp_warnings(q);
    }
    if let Some(pc) = &r.post_copy {
        println!(
            "  post-copy: {:.1} MiB in {} pieces sent after the transfer, the job restored \
             there meanwhile ({:.0} ms)",
            mib(pc.bytes),
            pc.pieces,
            ms(pc.took)
        );
    }
}

/// The copy made while the job was held, per device (`finals`, the job's own account), and
/// where its time went: `None` where it copied nothing.
fn held_copy_line(finals: &[possum_control::reply::DeviceCopy]) -> Option<String> {
    let each: Vec<String> = finals
        .iter()
        .filter(|f| f.bytes > 0)
        .map(|f| {
            let mut s = format!(
                "device {}: {:.1} MiB in {:.0} ms",
                f.device,
                mib(f.bytes),
                f.ms.unwrap_or(0.0)
            );
            if let Some(p) = f.pipeline {
                s += &format!(
                    " ({} writers: {:.0} ms waiting for the GPU's copies, {:.0} ms writing, \
                     {:.0} ms waiting for staging, summed)",
                    p.writers, p.copy_wait_ms, p.sink_ms, p.staging_wait_ms
                );
            }
            if let Some(n) = f.shadows_saved_by_keeper.filter(|&n| n > 0) {
                s += &format!(", {n} buffers copied into the keeper's spare");
            }
            s
        })
        .collect();
    (!each.is_empty()).then(|| format!("  copied while held: {}", each.join("; ")))
}

/// What `possum receive` prints for a job received, without --json.
fn print_received(r: &Received) {
    let t = &r.timings;
    println!(
        "possum: process {} restored from {} ({} files, {:.1} MiB received in {:.0} ms, restored \
         in {:.0} ms, synced to disk after in {:.0} ms){}",
        r.pid,
        r.dir.display(),
        r.files,
        mib(r.bytes),
        ms(t.receive),
        ms(t.restore),
        ms(t.sync),
        if r.source_told {
            ""
        } else {
            "; the source was not told that it runs here: it keeps its image, unrestored"
        }
    );
}

/// `possum receive`.
pub fn receive(a: &ReceiveArgs) -> Result<bool> {
    let key = read_key(&a.key_file)?;
    std::fs::create_dir_all(&a.dir)
        .with_context(|| format!("the images directory {}", a.dir.display()))?;
    let params = ReceiveParams {
        dir: a.dir.clone(),
        key,
        deadlines: deadlines(a.timeout, None),
        restore: RestoreParams {
            dir: PathBuf::new(),
            socket_dir: a.socket_dir.clone(),
            socket_dir_from_source: true,
            device: None,
            possum_exe: std::env::current_exe().context("finding possum's own binary")?,
            env: Environment::read(),
            hmac_key: None,
            received_unsynced: false,
            prestaged: Vec::new(),
            post_copy: None,
        },
        // The streams of a migration join within the handshake's deadline.
        sessions: Sessions::new(deadlines(a.timeout, None).handshake),
    };
    let listener =
        TcpListener::bind(&a.listen).with_context(|| format!("listening on {}", a.listen))?;
    // Before any image comes: the restores' CRIU then finds its probe of the kernel cached.
    if let Ok(criu) = possum_criu::Criu::locate() {
        if let Err(e) = criu.prime_kdat() {
            eprintln!("possum: {e}: each restore's CRIU probes the kernel again");
        }
    }
    eprintln!(
        "possum: receiving on {}",
        listener.local_addr().context("the address listened on")?
    );
    let events = accept_concurrently(listener, Arc::new(params), a.serve);
    let mut refusals = Refusals::default();
    loop {
        match events.recv().context("the receiver's threads ended")? {
            Event::Refused(why) => refusals.say(&why),
            Event::Full(why) => eprintln!("possum: {why}"),
            Event::Received(peer, got) => {
                let got = (*got).with_context(|| format!("a migration from {peer}"));
                match got {
                    Ok(r) if a.json => println!("{}", serde_json::to_value(&r)?),
                    Ok(r) => print_received(&r),
                    Err(e) if a.serve => eprintln!("possum: error: {e:#}"),
                    Err(e) => return Err(e),
                }
                if !a.serve {
                    return Ok(true);
                }
            }
        }
    }
}

/// Refused connections said on stderr, at most [`Refusals::PER_MINUTE`] a minute: a flood of
/// connections is a few lines and a count, not a flood of lines.
#[derive(Debug, Default)]
struct Refusals {
    /// When this minute began, how many were said in it, and how many not.
    minute: Option<Instant>,
    said: usize,
    unsaid: usize,
}

impl Refusals {
    const PER_MINUTE: usize = 10;

    fn say(&mut self, why: &str) {
        if self
            .minute
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(60))
        {
            if self.unsaid > 0 {
                eprintln!(
                    "possum: {} more connections were refused in the minute before",
                    self.unsaid
                );
            }
            *self = Refusals {
                minute: Some(Instant::now()),
                said: 0,
                unsaid: 0,
            };
        }
        if self.said < Self::PER_MINUTE {
            self.said += 1;
            eprintln!("possum: {why}");
        } else {
            self.unsaid += 1;
        }
    }
}

/// At most this many connections in their handshake at once: with one more, the one that has
/// waited longest is closed. A migration's handshake takes milliseconds, so idle or hostile
/// connections, however many, cannot keep it out.
const MAX_HANDSHAKES: usize = 16;

/// What the receiver's threads tell its main thread.
enum Event {
    /// A connection closed before it proved it holds the secret (said on stderr).
    Refused(String),
    /// The handshakes were full and the oldest was closed (said at most once a minute).
    Full(String),
    /// A migration that authenticated, and how it ended.
    Received(SocketAddr, Box<Result<Received, migrate::ReceiveError>>),
}

/// The connections in their handshake, oldest first: an id and a handle to close it by.
type Handshaking = Arc<Mutex<VecDeque<(u64, TcpStream)>>>;

/// Accepts connections on `listener` in a thread of its own, each handled in a thread of its
/// own: its handshake within the handshake deadline (at most [`MAX_HANDSHAKES`] at once), then,
/// authenticated, its migration. Without `serve`, the first connection that authenticates is
/// the one migration received; later ones are closed. Nothing one connection does delays
/// another's.
fn accept_concurrently(
    listener: TcpListener,
    params: Arc<ReceiveParams>,
    serve: bool,
) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel();
    let handshaking: Handshaking = Arc::default();
    let taken = Arc::new(AtomicBool::new(false));
    std::thread::spawn(move || {
        // Said at most once a minute: a flood of connections is one line, not a flood of lines.
        let mut said_full: Option<Instant> = None;
        for id in 0u64.. {
            let (stream, peer) = match listener.accept() {
                Ok(c) => c,
                // Out of descriptors, say: the connections in hand go on; try again shortly.
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            let Ok(handle) = stream.try_clone() else {
                continue;
            };
            let evicted = {
                let mut h = handshaking.lock().unwrap_or_else(PoisonError::into_inner);
                let oldest = (h.len() >= MAX_HANDSHAKES).then(|| h.pop_front()).flatten();
                h.push_back((id, handle));
                oldest
            };
            if let Some((_, oldest)) = evicted {
                // Its handshake's next read fails: its thread says so and ends.
                let _ = oldest.shutdown(std::net::Shutdown::Both);
                if said_full.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    said_full = Some(Instant::now());
                    let why = format!(
                        "{MAX_HANDSHAKES} connections were in their handshake: the one that had \
                         waited longest was closed for one from {peer} (said once a minute)"
                    );
                    if tx.send(Event::Full(why)).is_err() {
                        return;
                    }
                }
            }
            let (tx, handshaking, taken, params) = (
                tx.clone(),
                handshaking.clone(),
                taken.clone(),
                params.clone(),
            );
            std::thread::spawn(move || {
                let mut stream = stream;
                let t = Instant::now();
                let session = migrate::receive_handshake(&mut stream, &params);
                handshaking
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .retain(|(i, _)| *i != id);
                let session = match session {
                    Ok(Accepted::Session(s)) => s,
                    // Another stream of a migration under way: its receive takes it.
                    Ok(Accepted::Stream(joined)) => {
                        if !joined.join(stream) {
                            let why = format!(
                                "a connection from {peer} was refused: the migration it joins \
                                 is over"
                            );
                            let _ = tx.send(Event::Refused(why));
                        }
                        return;
                    }
                    Err(e) => {
                        let why = format!(
                            "a connection from {peer} was refused: {}",
                            possum_cuda::error_chain(&e)
                        );
                        let _ = tx.send(Event::Refused(why));
                        return;
                    }
                };
                if !serve && taken.swap(true, Ordering::AcqRel) {
                    let why = format!(
                        "a migration from {peer} was refused: this receiver takes one, and has it"
                    );
                    let _ = tx.send(Event::Refused(why));
                    return;
                }
                let got = migrate::receive_in_session(&mut stream, session, t, &params, &mut Notes);
                let _ = tx.send(Event::Received(peer, Box::new(got)));
            });
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;
    use possum_control::reply::{CopyPipeline, DeviceCopy};

    /// The held copy's line names each device that copied, with where its time went and what
    /// went into the keeper's spare; a copy of nothing says nothing.
    #[test]
    fn the_held_copy_is_said_per_device_with_where_its_time_went() {
        let copy = |device, bytes, spare| DeviceCopy {
            device,
            bytes,
            ms: Some(912.4),
            pipeline: Some(CopyPipeline {
                writers: 16,
                staging_wait_ms: 3.0,
                copy_wait_ms: 120.0,
                sink_ms: 13_800.0,
            }),
            shadows_saved_by_keeper: spare,
            ..DeviceCopy::default()
        };
        assert_eq!(held_copy_line(&[]), None);
        assert_eq!(held_copy_line(&[copy(0, 0, None)]), None);
        let line = held_copy_line(&[copy(0, 8 << 30, Some(0)), copy(1, 1 << 20, Some(2))]).unwrap();
        assert_eq!(
            line,
            "  copied while held: device 0: 8192.0 MiB in 912 ms (16 writers: 120 ms waiting for \
             the GPU's copies, 13800 ms writing, 3 ms waiting for staging, summed); device 1: 1.0 \
             MiB in 912 ms (16 writers: 120 ms waiting for the GPU's copies, 13800 ms writing, 3 \
             ms waiting for staging, summed), 2 buffers copied into the keeper's spare"
        );
    }
}
