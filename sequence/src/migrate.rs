//! Migration of a job to another host: `possum migrate PID --to HOST:PORT` on the source
//! ([`migrate`]), `possum receive --listen ADDR:PORT -D DIR` on the destination
//! ([`receive_handshake`], [`receive_in_session`]), over the authenticated transfer of
//! [`crate::wire`], its bytes spread over several streams. What the checkpoint's pre-copy
//! writes is sent ahead while the job runs; only the rest while it is held.
//!
//! ```text
//! source ([`migrate`])                              destination ([`receive_in_session`])
//!   checkpoint  the job held, its image committed into LOCAL_DIR (the job is not let go);
//!               after its pre-copy, the job running ([`crate::Observer::precopied`]):
//!     connect   TCP to HOST:PORT, handshake; --streams - 1 more connections join it
//!     ahead     the temporary directory as it is, then Cut ─────────▶ set aside under DIR
//!   send        LOCAL_DIR, files that begin with one sent ahead as a reference and the bytes
//!               after it (at most --max-rate) ──────────────────────▶ DIR/NAME, named only complete: Committed
//!   kill        the held job killed, and its PIDs waited free (its processes ended and
//!               reaped): a destination on this host restores under them; LOCAL_DIR kept
//!   hand-off    Released ──────────────────────────▶ restore DIR/NAME (`possum restore`'s sequence),
//!                                                     the job held after CRIU's restore
//!               ◀───────────── Outcome: Restored (pid), or RestoreFailed (why)
//!   go          Released again ────────────────────▶ the job's GPU side restored, it runs
//!               ◀───────────── Outcome: Running (pid), or RestoreFailed (why)
//!   synced      ◀───────────── Outcome: Synced           the image synced to disk, the job
//!                                                     running (received unsynced)
//!   end         Running: LOCAL_DIR removed once Synced came (kept, said, if it did not).
//!               Otherwise the job is restored here from LOCAL_DIR, unless the go may have
//!               arrived (below).
//! ```
//!
//! Without a pre-copy (engine driver) the connection comes after the commit, and the whole image
//! is sent held.
//!
//! What becomes of the job, by the phase that failed ([`MigrateError`]):
//! - the checkpoint: the checkpoint's guard lets it run on, as `possum checkpoint` does;
//! - before the kill (connect, handshake, the send ahead or the send, a receiver's abort or a full
//!   disk there): it is let go at the source and runs on (a failure while sending ahead is
//!   acted on once the checkpoint is committed); the receiver removed what it had of the image;
//! - after the kill (no answer within the deadline, a dropped connection, RestoreFailed, for
//!   whatever reason): it is restored at the source from LOCAL_DIR, which is kept, once its PIDs
//!   are free, with the socket directory its checkpoint used (the job's socket comes back there).
//!
//! The job's control socket comes back, at either end, in the directory it was in: CRIU binds it
//! at the same path. The source names that directory in the image (`--socket-dir`, made
//! absolute); the destination takes it as possum's for the restore unless its own
//! `--socket-dir` says otherwise (the image is authenticated under the migration's key).
//!
//! The destination restores only after `Released`, which the source sends only once its job is
//! gone, and lets the restored job run only after the go, which the source sends only once the
//! destination said it holds it restored: the job never runs at both ends. Without the go in
//! time the destination kills its copy before it ran (its image is kept, said). A connection
//! lost after the go was sent leaves the source not knowing whether the destination runs the job
//! ([`JobAt::Unknown`]): it does not restore its own, and keeps its image, for the operator to
//! restore only if the destination does not run it. Nothing is lost, and nothing runs twice.
//!
//! Every wait has a deadline ([`Deadlines`]): the connection, each read or write of the transfer,
//! the source's kill and its PIDs freed, and the destination's restore.

use std::fs;
use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::auth::HmacKey;
use crate::checkpoint::{checkpoint_held, CheckpointParams};
mod copying;
mod deadlines;
mod dumping;
mod error;
mod first_round;
mod held_send;
mod post_copy;
mod receive;
mod report;
mod source;
use crate::wire::{
    self, await_outcome, send_released, Connection, DirSender, FrameError, HandoffError, Outcome,
    Paced, Pacer, Totals, WireError, Written,
};
use crate::{MigrateStep, Observer};
pub use deadlines::Deadlines;
use error::restore_socket_dir;
pub use error::{JobAt, MigrateError};
use held_send::{paced, HeldSend, HeldSent};
pub use post_copy::{PostCopyReport, POST_COPY_LEASE};
pub use receive::{
    receive_handshake, receive_in_session, ReceiveError, ReceiveParams, ReceiveTimings, Received,
};
pub use report::{HostAhead, MigrateReport, MigrateTimings};
pub use source::restore_after_migration;
use source::{let_go, send_killing, AtSource, Fallback};

/// What to migrate, and where (`possum migrate`'s flags).
#[derive(Debug, Clone)]
pub struct MigrateParams {
    /// The checkpoint at the source: its `dir` is the local image (which must not exist),
    /// `leave_running` set (the job is held until the hand-off), not `gpu_only`.
    pub checkpoint: CheckpointParams,
    /// The destination, `HOST:PORT`.
    pub to: String,
    /// The secret both hosts hold.
    pub key: HmacKey,
    /// The deadlines.
    pub deadlines: Deadlines,
    /// The most bytes a second the image is sent at, all streams together (none: as fast as
    /// the network goes).
    pub max_rate: Option<u64>,
    /// The streams (TCP connections) the image is sent over at once (1 to
    /// [`wire::MAX_STREAMS`]).
    pub streams: u32,
    /// Post-copy ([`crate::postcopy`]): the pieces of the GPU images the job wrote after the
    /// last pre-copy round are sent after the destination has the rest, while it restores the
    /// job and the job runs there. Needs two streams or more.
    pub post_copy: bool,
}

/// Opens a connection to `to` within `deadline`, its reads and writes bounded by `io`.
fn connect(to: &str, deadline: Duration, io: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the name resolves to no address");
    for addr in to.to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, deadline) {
            Ok(s) => {
                wire::set_timeouts(&s, io)?;
                return Ok(s);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// The connection to the destination and its transfer, once begun.
struct Link {
    stream: TcpStream,
    sender: DirSender,
}

impl Link {
    /// Connects to `p.to` and shakes hands, then opens the session's other streams, each a
    /// connection of its own that joins it; all of them paced by `pacer`.
    fn open(p: &MigrateParams, pacer: Option<&Arc<Pacer>>) -> Result<Link, Early> {
        let mut stream =
            connect(&p.to, p.deadlines.connect, p.deadlines.io).map_err(Early::Connect)?;
        let open = |_| -> io::Result<Box<dyn Connection>> {
            let s = connect(&p.to, p.deadlines.connect, p.deadlines.io)?;
            Ok(match pacer {
                Some(pacer) => Box::new(Paced::new(s, pacer.clone())),
                None => Box::new(s),
            })
        };
        let mut sender = paced(pacer, &mut stream, |mut s| {
            DirSender::start_streams(&mut s, &p.key, p.streams, open)
        })
        .map_err(|e| Early::Send(Box::new(e)))?;
        sender.slice_first_round(p.checkpoint.env.first_round_slice);
        Ok(Link { stream, sender })
    }

    /// The link the send ahead made (or why it failed); without a pre-copy (engine driver, or
    /// nothing to copy), one made now, the observer told.
    fn made_or_open(
        ahead: Option<Result<Link, Early>>,
        p: &MigrateParams,
        pacer: Option<&Arc<Pacer>>,
        obs: &mut dyn Observer,
    ) -> Result<Link, Early> {
        if let Some(made) = ahead {
            return made;
        }
        let link = Link::open(p, pacer)?;
        let sent = link.sender.sent_counter();
        obs.migrating(MigrateStep::Connected { sent });
        Ok(link)
    }
}

/// Why the connection, its handshake or the send ahead failed (before the final send).
enum Early {
    Connect(io::Error),
    Send(Box<WireError>),
}

impl Early {
    /// The migration's error: the held job let go at the source.
    fn let_go(
        self,
        held: crate::HeldCheckpoint<'_>,
        p: &MigrateParams,
        obs: &mut dyn Observer,
    ) -> MigrateError {
        let job = let_go(held, &p.checkpoint, obs);
        let to = p.to.clone();
        match self {
            Early::Connect(source) => MigrateError::Connect { to, job, source },
            Early::Send(source) => MigrateError::Send { to, job, source },
        }
    }
}

/// CRIU's dump and its restore of the job's processes, bytes a second each (1.7 and 1.5 GB/s
/// measured on the H200 machine, for a PyTorch process of 1.1 GB): the slower, for an estimate.
const CRIU_BYTES_PER_S: f64 = 1.5e9;
/// What a hold costs besides the copies and CRIU: the driver's checkpoint and restore of the
/// job's contexts, and possum's steps around them (about 0.5 s on the H200 machine).
const HOLD_FIXED: Duration = Duration::from_millis(500);
/// The GPU's copy of what is written while the job is held, bytes a second.
const FINAL_COPY_BYTES_PER_S: f64 = 20e9;

/// The downtime expected were the job held now: `held_bytes` of its buffers to copy and send
/// (what the last pre-copy round wrote), its processes' memory (`process_bytes`) dumped, sent
/// and restored, at `send_rate` bytes a second. An estimate for a progress line, from rates
/// measured on one machine; `possum migrate` reports the downtime it measures.
pub fn estimated_downtime(held_bytes: u64, process_bytes: u64, send_rate: f64) -> Option<Duration> {
    if !(send_rate.is_finite() && send_rate > 0.0) {
        return None;
    }
    let (held, process) = (held_bytes as f64, process_bytes as f64);
    let secs = held / FINAL_COPY_BYTES_PER_S
        + (held + process) / send_rate
        + 2.0 * process / CRIU_BYTES_PER_S;
    Some(HOLD_FIXED + Duration::from_secs_f64(secs))
}

/// The resident memory of `pid` and its descendants, in bytes (what CRIU dumps of them, about).
fn tree_rss(pid: i32) -> u64 {
    crate::tree::with_descendants(pid)
        .into_iter()
        .filter_map(|p| fs::read_to_string(format!("/proc/{p}/status")).ok())
        .filter_map(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib << 10)
        })
        .sum()
}

/// The checkpoint's observer during a migration: once the pre-copy is over, the job still
/// running, it connects to the destination and sends what the pre-copy wrote ahead.
struct SendAhead<'a> {
    p: &'a MigrateParams,
    pacer: Option<&'a Arc<Pacer>>,
    obs: &'a mut dyn Observer,
    link: Option<Result<Link, Early>>,
    connect: Duration,
    ahead: Duration,
    sent: Totals,
    /// The pre-copy rounds sent ahead.
    rounds: usize,
    /// The job's private memory drafted for the rounds.
    host_ahead: HostAhead,
    /// The GPU images being sent while the driver and CRIU work ([`Observer::held`]), the link
    /// back once they are.
    held_send: Option<std::thread::JoinHandle<HeldSend>>,
    /// What that sent, and how long it took.
    held_sent: Option<HeldSent>,
    /// While the final copy runs, the send begun then ([`Observer::cutting`]) is waiting for
    /// what follows it ([`Observer::held`]); dropped, it ends.
    copying: Option<std::sync::mpsc::Sender<held_send::What>>,
    /// Set when CRIU's dump is over (or failed): that send ends.
    dump_over: Arc<AtomicBool>,
    /// Set when CRIU dumps again: what that send sent of its pages file is stale.
    dump_again: Arc<AtomicBool>,
    /// The send while the first pre-copy round runs ([`Observer::first_round`]).
    first_round: Option<first_round::FirstRound>,
    /// Its bytes and rounds, for the report.
    first_sent: (Totals, u32),
    /// What the destination had loaded of what was sent ahead when the cut came
    /// ([`Observer::ready_to_cut`]).
    loaded_ahead: Option<wire::LoadedAhead>,
}

impl SendAhead<'_> {
    /// The job's private memory drafted into the image's `hostmem-ahead` directory, to be sent
    /// with the round (`possum_criu::hostmem::ahead`), with `POSSUM_HOSTMEM_AHEAD=1` and the
    /// split on: `written` with what the drafts were written in. A failure leaves the
    /// memory to be sent whole at the cut, and is said.
    fn draft_host_memory(&mut self, dir: &Path, written: &Written) -> Written {
        use possum_criu::hostmem::{self, ahead};
        let mut written = written.clone();
        let env = &self.p.checkpoint.env;
        if !env.hostmem_ahead || env.hostmem_split == crate::config::HostmemSplit::Off {
            return written;
        }
        let pids = crate::tree::with_descendants(self.p.checkpoint.pid);
        let into = dir.join(ahead::AHEAD_DIR);
        match ahead::draft(&into, &pids, hostmem::default_threads()) {
            Ok(r) => {
                self.host_ahead.rounds += 1;
                self.host_ahead.time += r.time;
                self.host_ahead.written_bytes += r.written_bytes;
                for (inode, pieces) in r.written {
                    written.add(inode, pieces);
                }
                for (pid, why) in r.left {
                    self.obs
                        .note(&format!("process {pid}'s memory is not sent ahead: {why}"));
                }
            }
            Err(e) => {
                let _ = fs::remove_dir_all(&into);
                self.obs.note(&format!(
                    "the job's memory is not sent ahead (it goes at the cut): {e}"
                ));
            }
        }
        written
    }
}

impl SendAhead<'_> {
    /// The send begun while the job is held, ended: the link back, or why it failed (acted on
    /// once the checkpoint is committed, as a failed round is).
    fn end_held_send(&mut self) {
        self.copying = None;
        self.dump_over.store(true, Ordering::Release);
        let Some(sending) = self.held_send.take() else {
            return;
        };
        let link = match sending
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
        {
            Ok((stream, sender, sent)) => {
                for note in sent.iter().flat_map(HeldSent::notes) {
                    self.obs.note(&note);
                }
                self.held_sent = sent;
                Ok(Link { stream, sender })
            }
            Err(e) => Err(Early::Send(Box::new(e))),
        };
        self.link = Some(link);
    }
}

impl SendAhead<'_> {
    /// The connection to the destination, made now, the observer told.
    fn connect_link(&mut self) -> Result<Link, Early> {
        let t = Instant::now();
        let link = Link::made_or_open(None, self.p, self.pacer, &mut *self.obs);
        self.connect = t.elapsed();
        link
    }

    /// The send while the first round ran, ended (the round is over, or the checkpoint
    /// failed): the link back, what it sent counted as sent ahead; or why it failed. What it
    /// sent, if it sent at all.
    fn end_first_round(&mut self) -> Option<copying::Copied> {
        let sending = self.first_round.take()?;
        let mut sent = None;
        self.link = Some(match sending.end() {
            Ok((stream, sender, copied)) => {
                self.sent.files += copied.sent.files;
                self.sent.bytes += copied.sent.bytes;
                self.obs.note(&format!(
                    "sent while the first pre-copy round ran: {:.1} MiB in {} rounds",
                    copied.sent.bytes as f64 / f64::from(1u32 << 20),
                    copied.rounds
                ));
                self.first_sent = (copied.sent, copied.rounds);
                sent = Some(copied);
                Ok(Link { stream, sender })
            }
            Err(e) => Err(Early::Send(Box::new(e))),
        });
        sent
    }
}

/// The source stops waiting for the destination's loads once they have not moved for this
/// long ...
const LOAD_STALLED: Duration = Duration::from_millis(500);
/// ... and asks how far they came this often.
const LOAD_POLL: Duration = Duration::from_millis(20);

impl Observer for SendAhead<'_> {
    /// The rounds sent ahead: unless `POSSUM_MIGRATE_LOAD_WAIT_MS=0`, the job runs on until the
    /// destination loaded into GPU memory the GPU images sent ahead (or they stall, or the
    /// wait's limit passes), so that the restore there finds them loaded. A failure is acted on
    /// once the checkpoint is committed, as a failed round is.
    fn ready_to_cut(&mut self) {
        let limit = self.p.checkpoint.env.load_wait;
        if limit.is_zero() || self.rounds == 0 {
            return;
        }
        let Some(Ok(link)) = self.link.as_mut() else {
            return;
        };
        self.obs.migrating(MigrateStep::Loading { limit });
        let wait = wire::LoadWait {
            limit,
            stalled: LOAD_STALLED,
            poll: LOAD_POLL,
        };
        match link.sender.await_loaded(&mut link.stream, wait) {
            Ok(l) => {
                if l.end != wire::LoadWaitEnd::Nothing {
                    self.obs.note(&format!(
                        "the destination loaded {:.2} GB of what was sent ahead before the cut \
                         ({:.2} GB left; {:.0} ms waited, {:?})",
                        l.loaded as f64 / 1e9,
                        l.left as f64 / 1e9,
                        l.waited.as_secs_f64() * 1e3,
                        l.end
                    ));
                }
                self.loaded_ahead = Some(l);
            }
            Err(e) => self.link = Some(Err(Early::Send(Box::new(e)))),
        }
    }
    /// The first pre-copy round begins: with `POSSUM_MIGRATE_FIRST_ROUND_WHILE_COPYING=1`, the
    /// connection is made now, and the chunks the round completes go as it runs.
    fn first_round(&mut self, dir: &Path, journal: &Path) -> bool {
        if !self.p.checkpoint.env.first_round_while_copying || self.link.is_some() {
            return false;
        }
        match self.connect_link() {
            Ok(l) => {
                self.first_round = Some(first_round::spawn(
                    (l.stream, l.sender),
                    copying::Copying::growing(dir, journal),
                    self.pacer.cloned(),
                ));
                true
            }
            Err(e) => {
                self.link = Some(Err(e));
                false
            }
        }
    }
    /// The final copy begins: unless `POSSUM_MIGRATE_SEND_WHILE_COPYING=0` (or where
    /// [`Observer::held`] would send nothing while held), the send that `held` starts is
    /// started now, and sends the chunks the copy completes as it runs.
    fn cutting(&mut self, dir: &Path, journal: &Path) -> bool {
        let env = &self.p.checkpoint.env;
        if !env.send_while_held || !env.send_while_copying || self.p.post_copy {
            return false;
        }
        let link = match self.link.take() {
            Some(Ok(link)) => link,
            other => {
                self.link = other;
                return false;
            }
        };
        let (tell, next) = std::sync::mpsc::channel();
        self.copying = Some(tell);
        self.held_send = Some(held_send::spawn_copying(
            (link.stream, link.sender),
            copying::Copying::new(dir, journal),
            self.pacer.cloned(),
            (self.dump_over.clone(), self.dump_again.clone()),
            next,
        ));
        true
    }
    /// The job held, its GPU images complete: the `Cut` and they, the final set's first part,
    /// go to the destination on a thread while the driver and CRIU work (of the files sent
    /// ahead, only what the cut wrote since the last round; with post-copy, not even that: it
    /// goes after the job runs at the destination, and only what the cut appended goes now),
    /// unless `POSSUM_MIGRATE_SEND_WHILE_HELD=0`.
    fn held(&mut self, dir: &Path, gpu: &[String], written: &Written) {
        // (Dropped unused, the send begun at the copy ends there.)
        let copying = self.copying.take();
        if !self.p.checkpoint.env.send_while_held || gpu.is_empty() {
            return;
        }
        let env = &self.p.checkpoint.env;
        // (Not where the job's memory was drafted ahead: the split makes its data file of the
        // draft, not of CRIU's pages file.)
        // (Nor where possum writes the pages file itself, after CRIU's dump, in no order; where
        // it relays CRIU's write, only as the relay tells how far the file is whole.)
        use possum_criu::PagesBy;
        let split = env.hostmem_split != crate::config::HostmemSplit::Off && !env.hostmem_ahead;
        let relayed = env.dump_pages == PagesBy::Relay;
        let watch = relayed.then(|| self.p.checkpoint.relay_watch.clone());
        let follow = (env.stream_criu && split && env.dump_pages != PagesBy::Possum)
            .then(|| dumping::Follow::job(self.p.checkpoint.pid, env.hostmem_part_bytes, watch))
            .flatten();
        let what = held_send::What {
            dir: dir.to_path_buf(),
            gpu: gpu.to_vec(),
            written: written.clone(),
            follow,
        };
        if let Some(tell) = copying {
            // (A send that failed meanwhile is gone: its error comes at the join.)
            let _ = tell.send(what);
            return;
        }
        let mut link = match self.link.take() {
            Some(Ok(link)) => link,
            // (A round that failed keeps its error, acted on once the checkpoint is committed.)
            other => {
                self.link = other;
                return;
            }
        };
        if self.p.post_copy {
            link.sender.post_copy(gpu.to_vec());
        }
        self.held_send = Some(held_send::spawn(
            (link.stream, link.sender),
            what,
            self.pacer.cloned(),
            (self.dump_over.clone(), self.dump_again.clone()),
        ));
    }
    fn dumped(&mut self) -> Option<Duration> {
        let t = Instant::now();
        let sending = self.held_send.is_some();
        self.end_held_send();
        sending.then(|| t.elapsed())
    }
    fn dumping_again(&mut self) {
        self.dump_again.store(true, Ordering::Release);
    }
    fn copying(&mut self, total: u64, dir: &Path) {
        self.obs.copying(total, dir);
    }
    fn copied(&mut self) {
        self.obs.copied();
    }
    fn note(&mut self, what: &str) {
        self.obs.note(what);
    }
    fn migrating(&mut self, step: MigrateStep) {
        self.obs.migrating(step);
    }
    /// After each pre-copy round: the connection made at the first, and what the round wrote
    /// sent ahead (after the first, only what the files gained, and the pieces the round
    /// `written` in them). A failure ends the rounds' sending; it is acted on once the
    /// checkpoint is committed.
    fn precopied(&mut self, dir: &Path, written: &Written) {
        let first = self.end_first_round();
        let link = match self.link.take() {
            None => self.connect_link(),
            Some(link) => link,
        };
        let t = Instant::now();
        let written = self.draft_host_memory(dir, written);
        let link = link.and_then(|mut l| {
            let Link { stream, sender } = &mut l;
            let sent = paced(self.pacer, stream, |s| match &first {
                Some(copied) => first_round::after(sender, s, dir, (written.clone(), copied)),
                None => {
                    sender.told(written.clone());
                    sender.send_ahead(&mut &mut *s, dir)
                }
            })
            .map_err(|e| Early::Send(Box::new(e)))?;
            self.sent.files += sent.files;
            self.sent.bytes += sent.bytes;
            let took = t.elapsed().as_secs_f64();
            self.obs.note(&format!(
                "sent ahead, the job running: {} files, {:.1} MiB in {:.0} ms ({:.0} MB/s)",
                sent.files,
                sent.bytes as f64 / f64::from(1u32 << 20),
                took * 1e3,
                sent.bytes as f64 / took.max(1e-6) / 1e6
            ));
            self.rounds += 1;
            let rate = self.sent.bytes as f64 / (self.ahead + t.elapsed()).as_secs_f64();
            let process = tree_rss(self.p.checkpoint.pid);
            self.obs.migrating(MigrateStep::Round {
                round: self.rounds,
                bytes: written.bytes(),
                estimate: estimated_downtime(written.bytes(), process, rate),
            });
            Ok(l)
        });
        self.ahead += t.elapsed();
        self.link = Some(link);
    }
}

/// Migrates the job `p.checkpoint` names to the `possum receive` at `p.to`, in phases: checkpoint
/// (held; what its pre-copy wrote sent ahead while the job runs), send (the rest, held), kill,
/// hand-off. `obs` is told how the checkpoint and the restores go.
pub fn migrate(p: &MigrateParams, obs: &mut dyn Observer) -> Result<MigrateReport, MigrateError> {
    let t_all = Instant::now();
    if p.post_copy && p.streams < 2 {
        return Err(MigrateError::PostCopyStreams { streams: p.streams });
    }
    // One bucket for every stream, all through the migration.
    let pacer = p.max_rate.map(|rate| Arc::new(Pacer::new(rate)));
    let (held, ahead) = checkpoint_sending_ahead(p, pacer.as_ref(), obs)?;
    let mut timings = MigrateTimings {
        checkpoint: t_all.elapsed(),
        ahead: ahead.took,
        ..MigrateTimings::default()
    };
    let committed_at = Instant::now();

    let t = Instant::now();
    let link = match Link::made_or_open(ahead.link, p, pacer.as_ref(), obs) {
        Ok(l) => l,
        Err(early) => return Err(early.let_go(held, p, obs)),
    };
    obs.migrating(MigrateStep::Held);
    timings.connect = ahead.connect + t.elapsed();

    let Link {
        mut stream,
        mut sender,
    } = link;
    let parts = p.checkpoint.env.hostmem_part_bytes;
    let held_sent = ahead.held_sent;
    rest_of_the_image(&mut sender, &held, held_sent.as_ref(), parts, &mut timings);
    let local = held.dir().to_path_buf();
    let gpu_dirs = post_copy::left_for_later(p.post_copy, &local, &mut sender);
    let sent_counter = sender.sent_counter();
    let pids = crate::tree::with_descendants(p.checkpoint.pid);
    let here = Fallback::new(&p.checkpoint, &pids, p.deadlines.kill);
    let (sending, source, mut times) =
        send_killing(p.checkpoint.env.kill_while_sending, held, &here, || {
            paced(pacer.as_ref(), &mut stream, |mut s| {
                sender.finish_post_copy(&mut s, &local)
            })
        });
    timings.send = times.send;
    let (sent, mut session, later) = match sending {
        Ok(s) => s,
        Err(e) => {
            drop(stream);
            return Err(match source {
                AtSource::Held(held) => Early::Send(Box::new(e)).let_go(*held, p, obs),
                AtSource::Killed(k) => k.send_failed(e, &here, &p.to, obs),
            });
        }
    };
    timings.send_hashing = sent.hashing;
    timings.send_committing = sent.committing;
    // Post-copy: what was left goes now, on the other streams, while the hand-off goes on.
    let later = later.map(|l| post_copy::start_sending(l, &local, &gpu_dirs, sent_counter));

    let (report, guard) = source.report(&here, (&mut stream, &mut session), &mut times, obs)?;
    (timings.kill, timings.kill_after_send) = (times.kill, times.kill_after_send);

    // After the kill, a failure restores the job here.
    obs.migrating(MigrateStep::Restoring);
    let t = Instant::now();
    let outcome = hand_off(&mut stream, &mut session, p, (&here, guard), obs)?;
    timings.remote_restore = t.elapsed();
    let remote_pid = running_at_destination(outcome, &here, obs)?;
    timings.downtime = report.figures.hold + committed_at.elapsed();

    // The local image goes only once the destination's is on its disk.
    let t = Instant::now();
    let synced = await_synced(
        &mut stream,
        &mut session,
        p.deadlines.restore,
        later.as_ref().map(|l| &*l.urgent),
    );
    timings.synced_there = t.elapsed();
    let post_copy = match later {
        None => None,
        Some(sending) => post_copy_sent(sending, &synced, &here, obs)?,
    };
    if let Ok(Some(waited)) = synced {
        timings.waited_after_resume = Some(waited);
        timings.downtime += waited;
    }
    drop(stream);
    timings.total = t_all.elapsed();
    let image_kept = local_image_after(&synced, &p.checkpoint.dir, obs);
    // (Nothing sent while held but the rest of the image: none of these.)
    let early = held_sent.unwrap_or_default();
    Ok(MigrateReport {
        pid: p.checkpoint.pid,
        to: p.to.clone(),
        remote_pid,
        files: sent.totals.files,
        bytes: sent.totals.bytes,
        bytes_before_hold: ahead.sent.bytes,
        rounds: report.figures.precopy_rounds.len(),
        bytes_while_first_round: ahead.first_sent.0.bytes,
        rounds_while_first_round: ahead.first_sent.1,
        bytes_while_held: sent.sent_bytes + early.dumping_bytes() + early.copying.bytes,
        bytes_while_dumping: early.dumping_bytes(),
        criu_bytes_while_dumping: early.criu.bytes,
        bytes_while_copying: early.copying.bytes,
        rounds_while_copying: early.copying_rounds,
        timings,
        host_memory_ahead: ahead.host_ahead,
        loaded_ahead: ahead.loaded_ahead,
        image_kept,
        post_copy,
        checkpoint: report,
    })
}

/// Readies `sender` for the rest of the image `held` committed: the pieces the cut wrote,
/// unless the GPU images went while the driver and CRIU worked (`held_sent`: then they go on
/// from there unchanged, and `timings` get that send's time); the job's private memory split
/// out of CRIU's images, in parts the receiver writes at once. The bytes sent while CRIU worked.
fn rest_of_the_image(
    sender: &mut DirSender,
    held: &crate::HeldCheckpoint<'_>,
    held_sent: Option<&HeldSent>,
    part_bytes: u64,
    timings: &mut MigrateTimings,
) {
    match held_sent {
        None => sender.told(held.written_at_cut()),
        Some(sent) => timings.held_send = sent.took,
    }
    let criu = held.dir().join("criu");
    // (A draft sent ahead that became one goes as the file sent ahead: the wire sees to it.)
    for name in possum_criu::hostmem::whole_data_files(&criu).unwrap_or_default() {
        // (No more parts than a reader takes: larger ones for a larger file.)
        let len = fs::metadata(criu.join(&name)).map_or(0, |m| m.len());
        let part = possum_criu::hostmem::part_bytes_for(len, part_bytes);
        sender.send_in_parts(format!("criu/{name}"), part);
    }
}

/// The post-copy's send, the job running at the destination, once the destination answered
/// (`synced`, `await_synced`): what it sent. A destination that said its post-copy failed has
/// killed its copy: the job is restored here. A send that failed here leaves the destination
/// without its pieces, which kills its copy once it waited [`POST_COPY_LEASE`]: past that, the
/// job is restored here. Otherwise (the send ended, the destination silent) the job's place is
/// unknown: the local image is kept, and that is the error.
fn post_copy_sent(
    sending: post_copy::Sending,
    synced: &Result<Option<Duration>, Unsynced>,
    here: &Fallback<'_>,
    obs: &mut dyn Observer,
) -> Result<Option<PostCopyReport>, MigrateError> {
    if let Err(Unsynced::Refused(why)) = synced {
        obs.note(&format!(
            "the destination's post-copy failed ({why}); it killed its copy: restoring the job \
             here"
        ));
        let job = here.restore(obs);
        let source = wire::SendError::Rejected {
            reason: why.clone(),
        };
        return Err(MigrateError::PostCopy {
            job,
            source: Box::new(source),
        });
    }
    // (Its streams' writes are bounded by their timeouts.)
    let sent = sending.thread.join();
    if synced.is_ok() {
        // The destination has every piece: whatever this end's send said after, it runs there.
        return Ok(sent.ok().and_then(Result::ok));
    }
    let source = match sent {
        Ok(Ok(_)) => {
            let why = match synced {
                Err(why) => why.to_string(),
                Ok(_) => String::new(),
            };
            let job = JobAt::PostCopyUnknown {
                image: here.c.dir.clone(),
                socket_dir: restore_socket_dir(here.c),
            };
            return Err(MigrateError::PostCopySilent { job, why });
        }
        Ok(Err(e)) => e,
        Err(_) => wire::SendError::NoLaterStream,
    };
    let wait = POST_COPY_LEASE + post_copy::LEASE_MARGIN;
    obs.note(&format!(
        "the post-copy failed after the job ran at the destination ({}); the destination \
             kills its copy without its buffers: restoring the job here in {} s",
        possum_cuda::error_chain(&source),
        wait.as_secs()
    ));
    std::thread::sleep(wait);
    let job = here.restore(obs);
    Err(MigrateError::PostCopy {
        job,
        source: Box::new(source),
    })
}

/// The local image `dir` once the job runs at the destination: removed if the destination said
/// its own is on its disk (`synced`), else kept, said, and returned.
fn local_image_after(
    synced: &Result<Option<Duration>, Unsynced>,
    dir: &Path,
    obs: &mut dyn Observer,
) -> Option<PathBuf> {
    match synced {
        Ok(_) => {
            let _ = fs::remove_dir_all(dir);
            None
        }
        Err(why) => {
            obs.note(&format!(
                "the job runs at the destination, but it did not say that the image it was \
                 restored from is on its disk ({why}): this end's stays at {}, to remove once \
                 the job there has another",
                dir.display()
            ));
            Some(dir.to_path_buf())
        }
    }
}

/// What the checkpoint's observer did before the commit: the link it opened (or why it
/// failed), and the times and totals of what it sent ahead.
struct Ahead {
    link: Option<Result<Link, Early>>,
    connect: Duration,
    took: Duration,
    sent: Totals,
    host_ahead: HostAhead,
    /// What was sent while the driver and CRIU worked, and how long it took.
    held_sent: Option<HeldSent>,
    /// What was sent while the first pre-copy round ran, in so many rounds.
    first_sent: (Totals, u32),
    /// What the destination had loaded ahead when the cut came.
    loaded_ahead: Option<wire::LoadedAhead>,
}

/// The checkpoint up to its commit with the job held, its pre-copy sent ahead through
/// [`SendAhead`]. A failed checkpoint aborts the transfer begun.
fn checkpoint_sending_ahead<'p>(
    p: &'p MigrateParams,
    pacer: Option<&Arc<Pacer>>,
    obs: &mut dyn Observer,
) -> Result<(crate::HeldCheckpoint<'p>, Ahead), MigrateError> {
    let mut ahead = SendAhead {
        p,
        pacer,
        obs,
        link: None,
        connect: Duration::ZERO,
        ahead: Duration::ZERO,
        sent: Totals::default(),
        rounds: 0,
        host_ahead: HostAhead::default(),
        held_send: None,
        held_sent: None,
        copying: None,
        dump_over: Arc::default(),
        dump_again: Arc::default(),
        first_round: None,
        first_sent: (Totals::default(), 0),
        loaded_ahead: None,
    };
    let checkpointed = checkpoint_held(&p.checkpoint, &mut ahead);
    // (A checkpoint that failed in its first round, or after the hold began, did not say the
    // round or the dump was over.)
    let _ = ahead.end_first_round();
    ahead.end_held_send();
    let SendAhead {
        link,
        connect,
        ahead: took,
        sent,
        host_ahead,
        held_sent,
        first_sent,
        loaded_ahead,
        ..
    } = ahead;
    match checkpointed {
        Ok(held) => Ok((
            held,
            Ahead {
                link,
                connect,
                took,
                sent,
                host_ahead,
                held_sent,
                first_sent,
                loaded_ahead,
            },
        )),
        Err(e) => {
            if let Some(Ok(mut l)) = link {
                l.sender
                    .abort(&mut l.stream, "the source's checkpoint failed");
            }
            Err(MigrateError::Checkpoint(Box::new(e)))
        }
    }
}

/// The hand-off: `Released`, the destination's `Outcome`, and once it holds the job restored,
/// the go and its last `Outcome`. A destination silent after the go leaves the job's place
/// unknown: that is the error here (the job is not restored at the source); any other failure
/// is the returned outcome's. From now until the go, `guard` (kept by `here`) restores the job
/// here should this process end, as it does should it end while `here` restores it.
fn hand_off(
    stream: &mut TcpStream,
    session: &mut wire::Session,
    p: &MigrateParams,
    (here, guard): (&Fallback<'_>, crate::guard::HandOff),
    obs: &mut dyn Observer,
) -> Result<Result<Outcome, HandoffError>, MigrateError> {
    here.watched_by(guard);
    let outcome = send_released(stream, session)
        .map_err(HandoffError::from)
        .and_then(|()| {
            stream
                .set_read_timeout(Some(p.deadlines.restore))
                .map_err(|source| FrameError::Io {
                    what: "waiting for",
                    source,
                })?;
            await_outcome(stream, session)
        });
    // The destination holds the job restored: let it run there, and hear that it does.
    if !matches!(outcome, Ok(Outcome::Restored { .. })) {
        return Ok(outcome);
    }
    // The go: the job is the destination's from now (not restored here by the guard).
    here.handing_off();
    if let Err(e) = send_released(stream, session) {
        // Not sent: the destination kills its copy without the go.
        return Ok(Err(HandoffError::from(e)));
    }
    match await_outcome(stream, session) {
        Ok(Outcome::Restored { .. }) => Ok(Err(HandoffError::Unexpected {
            got: "Outcome Restored",
            want: "Outcome Running",
        })),
        Ok(o) => Ok(Ok(o)),
        Err(source) => {
            let image = p.checkpoint.dir.clone();
            obs.note(&format!(
                "the destination went silent after the go; the job is not restored here \
                 (its image stays at {})",
                image.display()
            ));
            let socket_dir = restore_socket_dir(&p.checkpoint);
            Err(MigrateError::Handoff {
                job: JobAt::Unknown { image, socket_dir },
                source,
            })
        }
    }
}

/// Waits at most `deadline` for the destination's `Outcome` `Synced`: the image it restored the
/// job from is on its disk. With it, the job's wait after it ran there, as the job counted it;
/// why not, in words. Meanwhile each post-copy piece the destination asks for (`Demand`) is
/// asked of `urgent`: it goes next.
fn await_synced(
    stream: &mut TcpStream,
    session: &mut wire::Session,
    deadline: Duration,
    urgent: Option<&wire::Urgent>,
) -> Result<Option<Duration>, Unsynced> {
    stream
        .set_read_timeout(Some(deadline))
        .map_err(|e| Unsynced::Silent(e.to_string()))?;
    // Post-copy: the pieces the destination's job waits for go next.
    let mut ask = |piece: u64| {
        if let (Some(u), Ok(piece)) = (urgent, usize::try_from(piece)) {
            u.ask(piece);
        }
    };
    let demands: Option<&mut dyn FnMut(u64)> = urgent.is_some().then_some(&mut ask);
    match wire::await_outcome_or_demands(stream, session, demands) {
        Ok(Outcome::Synced { waited, .. }) => Ok(waited),
        Ok(other) => Err(Unsynced::Silent(format!("it answered {other:?}"))),
        Err(HandoffError::Aborted { reason }) => Err(Unsynced::Refused(reason)),
        Err(e) if e.is_timeout() => Err(Unsynced::Silent(format!(
            "no word within {} s",
            deadline.as_secs()
        ))),
        Err(e) => Err(Unsynced::Silent(possum_cuda::error_chain(&e))),
    }
}

/// Why the destination did not say its image is on its disk ([`await_synced`]).
#[derive(Debug)]
enum Unsynced {
    /// It said why not (`Abort`): its post-copy failed, and it killed its copy of the job.
    Refused(String),
    /// No word, or not the one due.
    Silent(String),
}

impl std::fmt::Display for Unsynced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unsynced::Refused(why) => write!(f, "it gave up: {why}"),
            Unsynced::Silent(why) => f.write_str(why),
        }
    }
}

/// The job's pid at the destination when the hand-off says it runs there; otherwise it is
/// restored here, and the error says why.
fn running_at_destination(
    outcome: Result<Outcome, HandoffError>,
    here: &Fallback<'_>,
    obs: &mut dyn Observer,
) -> Result<i32, MigrateError> {
    match outcome {
        Ok(Outcome::Running { pid }) => Ok(pid),
        // (Answered with the go in the hand-off, or an error.) Synced comes only after Running.
        Ok(o @ (Outcome::Restored { .. } | Outcome::Synced { .. })) => {
            let job = here.restore(obs);
            let got = match o {
                Outcome::Restored { .. } => "Outcome Restored",
                _ => "Outcome Synced",
            };
            let source = HandoffError::Unexpected {
                got,
                want: "Outcome Running",
            };
            Err(MigrateError::Handoff { job, source })
        }
        Ok(Outcome::RestoreFailed { reason }) => {
            let job = here.restore(obs);
            Err(MigrateError::RemoteRestore { reason, job })
        }
        Err(source) => {
            let job = here.restore(obs);
            Err(MigrateError::Handoff { job, source })
        }
    }
}

#[cfg(test)]
mod estimate_tests {
    use super::*;

    /// Post-copy over a session of one stream is refused before anything is done: the job
    /// (a PID that does not exist here) is not even looked at.
    #[test]
    fn post_copy_over_one_stream_is_refused_before_anything_is_done() {
        let dir = tempfile::tempdir().unwrap();
        let p = MigrateParams {
            checkpoint: CheckpointParams {
                pid: i32::MAX,
                dir: dir.path().join("local"),
                leave_running: true,
                engine: crate::Engine::Possum,
                gpu_only: false,
                force: false,
                parent: None,
                keep_on_gpu: 0,
                shadow_budget: None,
                tcp_established: None,
                precopy_rounds: 4,
                sockets: dir.path().to_path_buf(),
                possum_exe: "possum".into(),
                relay_watch: Default::default(),
                env: crate::Environment::read(),
            },
            to: "127.0.0.1:9".into(),
            key: HmacKey::from_bytes(vec![1; 32]).unwrap(),
            deadlines: Deadlines::default(),
            max_rate: None,
            streams: 1,
            post_copy: true,
        };
        let e = migrate(&p, &mut crate::Quiet).unwrap_err();
        assert!(
            matches!(e, MigrateError::PostCopyStreams { streams: 1 }),
            "{e}"
        );
        assert_eq!(e.job(), JobAt::Source);
        assert!(!p.checkpoint.dir.exists(), "nothing was written");
    }

    #[test]
    fn the_estimate_grows_with_what_is_left_to_send_and_the_process() {
        assert_eq!(estimated_downtime(1, 1, 0.0), None, "no rate yet");
        let none = estimated_downtime(0, 0, 1e9).unwrap();
        assert_eq!(none, HOLD_FIXED);
        // 1 GB written, 1 GB of process, at 1 GB/s: 0.05 + 2 + 2 / 1.5 s beyond the fixed part.
        let e = estimated_downtime(1_000_000_000, 1_000_000_000, 1e9).unwrap();
        let want = HOLD_FIXED.as_secs_f64() + 0.05 + 2.0 + 2.0 / 1.5;
        assert!((e.as_secs_f64() - want).abs() < 1e-6, "{e:?}");
    }
}
