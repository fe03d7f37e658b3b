//! A concurrent checkpoint: the image equals the buffers' contents at T0 while the job keeps going.
//!
//! # How T0 is kept
//! `begin` closes the op gate (no operation is between hook and stream), records a fence event on
//! every job stream and makes the engine's copy streams wait for those fences, then reopens the
//! gate. From then on:
//! * The background copier takes buffers one by one and copies each, in chunks through the staging
//!   pool, on a copy stream (so after everything the job enqueued before T0).
//! * Before an operation that *writes* a buffer not yet saved, the hook saves it first (soft
//!   copy-on-write): a device-to-device copy into a *shadow* while the shadow budget allows (the job
//!   then waits only for that fast copy, and the copier later saves the shadow), otherwise a priority
//!   device-to-host copy on the high-priority stream. The job's stream waits for the copy's event;
//!   the job's thread blocks only while another thread is in the middle of claiming the same buffer
//!   or when all staging buffers are in flight.
//! * Reads never wait: they do not change what T0 saw.
//!
//! Writer threads wait for each chunk's copy and hand it to the sink, then recycle the staging buffer:
//! the host memory in flight is bounded by the pool, whatever the image size.
//!
//! A failure (device or sink) abandons the checkpoint, never the job: waiting operations are released
//! and [`CheckpointHandle::wait`] reports the first error.
//!
//! The same machinery runs a pre-copy round ([`CopyMode::Precopy`]): buffers written since the
//! previous round are copied with no copy-on-write (the round is not an image by itself), and
//! [`CopyMode::CowDirty`] finishes a series of rounds with a consistent T0 for the dirty remainder.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};
use parking_lot::{Condvar, Mutex, RwLock};

use crate::device::{DevPtr, Device, DeviceError, HostBuffer, Transfer};
use crate::error::EngineError;
use crate::fingerprint::Fingerprint;
use crate::pipeline::{Pipeline, PipelineClock, Stage};
use crate::registry::Buffer;
use crate::session::{BlockedTime, JobWaits, SessionHandle, WaitedOn};
use crate::shared::{background_thread, Access, Counters, Inner, Phase, PhaseSession, SentPrints};
use crate::staging::StagingPool;
use crate::store::{BufferRecord, ChunkSink, ShadowSaver};

/// Threads handing shadows to the [`ShadowSaver`] at once (its copies of one queue behind
/// another's: no gap while one's last piece is copied).
const SHADOW_SAVERS: usize = 3;
/// As many for a copy holding the job, which hands it every buffer it copies: a job's many
/// small buffers (a caching allocator's segments) each a request of a few pieces, enough of
/// them at once to keep the saver's copies going.
const HELD_SAVERS: usize = 8;

/// Which buffers a session takes, and whether writes must wait for them.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum CopyMode {
    /// Every buffer, consistent at T0.
    Cow,
    /// Buffers written since the last pre-copy round, consistent at T0.
    CowDirty,
    /// Buffers written since the last round, no consistency.
    Precopy,
}

enum CkState<D: Device> {
    Pending,
    /// Someone is enqueueing its copy.
    Busy,
    /// Copied to a shadow; the job may write it once `ready` completes; the copier saves the shadow.
    Shadowed {
        shadow: DevPtr,
        ready: D::Event,
    },
    /// Its device-to-host copies are enqueued; `0` completes when they have read it.
    Saved(D::Event),
    /// The checkpoint failed; nothing to wait for.
    Abandoned,
}

struct CkSlot<D: Device> {
    buf: Buffer,
    /// The offsets of the chunks to copy (`None`: every chunk): those whose fingerprint differs
    /// from what the sink holds.
    chunks: Option<Vec<u64>>,
    /// The buffer's fingerprints at T0, one per chunk, where the device gave them: every copy of
    /// a chunk must match its own, or the checkpoint fails ([`EngineError::Mismatch`]).
    t0: Option<Arc<[Fingerprint]>>,
    state: Mutex<CkState<D>>,
    cv: Condvar,
    /// Known safe to write: its copy event has completed.
    safe: AtomicBool,
    first_touch: AtomicU32,
}

struct WriteJob<D: Device> {
    id: u64,
    off: u64,
    len: u64,
    /// The chunk's fingerprint at T0, which the copy's must equal.
    expect: Option<Fingerprint>,
    pending: D::Pending,
}

struct Shared<D: Device> {
    /// Taken (dropped) when the session ends, so the caller can commit the sink after `wait`.
    sink: RwLock<Option<Arc<dyn ChunkSink>>>,
    pool: Arc<StagingPool<D>>,
    outstanding: Mutex<usize>,
    out_cv: Condvar,
    error: Mutex<Option<String>>,
    failed: AtomicBool,
    bytes: AtomicU64,
    /// What the sink holds of each chunk (the engine's, shared by the sessions of one sink).
    sent: Arc<Mutex<SentPrints>>,
    chunk: u64,
    /// The first chunk whose copy did not match its fingerprint at T0, and how many did not.
    mismatch: Mutex<Option<Mismatch>>,
    mismatches: AtomicU64,
    /// Where the copy's time goes.
    clock: PipelineClock,
}

/// A chunk whose copy differs from the chunk at T0.
#[derive(Clone, Copy, Debug)]
struct Mismatch {
    buffer: u64,
    offset: u64,
    t0: Fingerprint,
    copied: Fingerprint,
}

impl<D: Device> Shared<D> {
    fn fail(&self, e: impl std::fmt::Display) {
        let mut g = self.error.lock();
        if g.is_none() {
            *g = Some(e.to_string());
        }
        self.failed.store(true, Ordering::Release);
    }

    /// Records that the sink holds chunk `off` of buffer `id` with fingerprint `fp`.
    fn note_sent(&self, id: u64, off: u64, fp: Fingerprint) {
        note_sent(&mut self.sent.lock(), id, off, self.chunk, fp);
    }

    /// A chunk's copy whose fingerprint is not its T0 one: the checkpoint fails, never commits.
    fn mismatched(&self, m: Mismatch) {
        self.mismatches.fetch_add(1, Ordering::Relaxed);
        self.mismatch.lock().get_or_insert(m);
        self.fail(format!(
            "buffer {} changed before it was saved: the copy of its chunk at offset {} has \
             fingerprint {}, not {} as at T0",
            m.buffer, m.offset, m.copied, m.t0
        ));
    }

    /// Hands one copied chunk to the sink, after checking it against its fingerprint at T0.
    /// (The sink computes the fingerprint as it writes: the bytes are read once.)
    fn write_one(&self, id: u64, off: u64, expect: Option<Fingerprint>, data: &[u8]) {
        let sink = self.sink.read();
        let Some(sink) = sink.as_ref() else {
            return;
        };
        match sink.write_chunk_proving(id, off, data, expect) {
            Ok(Ok(fp)) => {
                self.bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
                self.note_sent(id, off, fp);
            }
            Ok(Err(copied)) => self.mismatched(Mismatch {
                buffer: id,
                offset: off,
                t0: expect.unwrap_or(copied),
                copied,
            }),
            Err(e) => self.fail(e),
        }
    }

    fn writer(self: Arc<Self>, rx: Receiver<WriteJob<D>>) {
        for job in rx {
            match self.clock.time(Stage::CopyWait, || job.pending.wait()) {
                Ok(buf) => {
                    if !self.failed.load(Ordering::Acquire) {
                        let len = usize::try_from(job.len).expect("chunk fits in memory");
                        self.clock.time(Stage::Sink, || {
                            self.write_one(job.id, job.off, job.expect, &buf.as_slice()[..len])
                        });
                    }
                    self.pool.put(buf);
                }
                Err(e) => {
                    self.fail(e);
                    // The staging buffer went down with the copy: the pool may replace it.
                    self.pool.lost();
                }
            }
            let mut n = self.outstanding.lock();
            *n -= 1;
            if *n == 0 {
                self.out_cv.notify_all();
            }
        }
    }
}

/// Records in `sent` that chunk `off` (of `chunk` bytes) of buffer `id` is held with
/// fingerprint `fp`.
fn note_sent(sent: &mut SentPrints, id: u64, off: u64, chunk: u64, fp: Fingerprint) {
    let i = usize::try_from(off / chunk).expect("chunk index fits");
    let v = sent.entry(id).or_default();
    if v.len() <= i {
        v.resize(i + 1, None);
    }
    v[i] = Some(fp);
}

/// The fingerprints of `bufs`, taken on the engine's first copy stream (after what is queued
/// there: at T0, the fences). `None` where the engine does not fingerprint, or the device says
/// it cannot (then never again).
fn fingerprints<D: Device>(
    inner: &Inner<D>,
    bufs: &[Buffer],
) -> Result<Option<Prints>, EngineError> {
    if !inner.fingerprints.load(Ordering::Acquire) {
        return Ok(None);
    }
    let chunk = inner.pool.chunk() as u64;
    let stream = &inner.copy_streams[0];
    let mut out = HashMap::with_capacity(bufs.len());
    for b in bufs {
        match inner.dev.fingerprint(stream, b.va(), b.size(), chunk) {
            Ok(p) => {
                out.insert(b.id(), Arc::from(p));
            }
            Err(DeviceError::Unsupported(why)) => {
                tracing::info!("no fingerprints on {}: {why}", inner.dev.name());
                inner.fingerprints.store(false, Ordering::Release);
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Some(out))
}

/// What a session's copy runs beside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Beside {
    /// The running job (a pre-copy round, a concurrent checkpoint).
    Job,
    /// Nothing of the job: it is held until the copy is over (a final copy).
    Nothing,
    /// The job, which runs on once a snapshot is made (a kept save).
    JobAfterSnapshot,
}

/// The threads a session runs: how many write chunks into its sink, and their nice value (and
/// the copier's).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Threads {
    writers: usize,
    nice: i32,
    /// Nothing of the job runs beside the copy: its buffers themselves, which nothing writes
    /// meanwhile, may go to a [`ShadowSaver`] whole, as shadows do.
    held: bool,
}

impl Threads {
    /// Beside the job: `writer_threads`, reniced to `background_nice`. Beside nothing of it:
    /// `held_writer_threads` where set, at the job's own priority.
    fn of(cfg: &crate::config::EngineConfig, beside: Beside) -> Threads {
        if beside != Beside::Nothing {
            return Threads {
                writers: cfg.writer_threads.max(1),
                nice: cfg.background_nice,
                held: false,
            };
        }
        let writers = match cfg.held_writer_threads {
            0 => cfg.writer_threads,
            n => n,
        };
        Threads {
            writers: writers.max(1),
            nice: 0,
            held: true,
        }
    }
}

/// What a session copies of one buffer, by fingerprints.
struct Plan {
    /// Offsets of the chunks to copy; empty: nothing.
    copy: Vec<u64>,
    /// Bytes found equal to what the sink holds.
    proven: u64,
    /// Bytes the sink took by reference to an earlier image.
    reused: u64,
}

/// Decides, chunk by chunk, what of buffer `b` (whose chunks' fingerprints are `prints`) a
/// session copies into `sink`: a chunk the sink holds with the same fingerprint stays, one an
/// earlier image holds is referenced ([`ChunkSink::reuse_chunk`]), the rest are copied.
fn plan_buffer(
    b: &Buffer,
    prints: &[Fingerprint],
    chunk: u64,
    sent: &mut SentPrints,
    sink: &dyn ChunkSink,
) -> Result<Plan, EngineError> {
    let mut plan = Plan {
        copy: Vec::new(),
        proven: 0,
        reused: 0,
    };
    for (i, fp) in prints.iter().enumerate() {
        let off = i as u64 * chunk;
        let len = chunk.min(b.size() - off);
        let held = sent.get(&b.id()).and_then(|v| v.get(i).copied().flatten());
        if held == Some(*fp) {
            plan.proven += len;
        } else if sink.reuse_chunk(b.id(), off, len, *fp)? {
            note_sent(sent, b.id(), off, chunk, *fp);
            plan.reused += len;
        } else {
            plan.copy.push(off);
        }
    }
    Ok(plan)
}

/// What a checkpoint did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CheckpointReport {
    /// Buffers in the image.
    pub buffers: usize,
    /// Bytes written to the sink.
    pub bytes: u64,
    /// From T0 until every byte was copied off the device (the device memory could be released).
    pub captured: Duration,
    /// From T0 until every byte was in the sink.
    pub elapsed: Duration,
    /// Buffers saved early by a priority device-to-host copy because the job was about to write them.
    pub cow_priority: u64,
    /// Buffers copied first because the job was predicted to write them soon
    /// ([`crate::Engine::set_save_order`]).
    pub predicted_first: u64,
    /// Buffers saved early by a shadow device-to-device copy (those of the snapshot at T0
    /// included).
    pub cow_shadow: u64,
    /// Of those, the buffers copied into shadows at T0 ([`crate::Engine::checkpoint_snapshot`]),
    /// before the job ran on.
    pub snapshot_shadows: u64,
    /// Peak shadow memory in use.
    pub shadow_peak: u64,
    /// Of the shadows, those saved by the [`ShadowSaver`] (the keeper's spare image memory).
    pub shadows_saved_elsewhere: u64,
    /// Hook calls that blocked the job's thread during this checkpoint.
    pub hook_blocked: u64,
    /// Their total time.
    pub hook_blocked_total: Duration,
    /// The longest one.
    pub hook_blocked_max: Duration,
    /// Waits enqueued on the job's streams.
    pub stream_waits: u64,
    /// The time the job waited on this checkpoint after T0: its threads blocked in the hook
    /// (copy-on-write, a free of a buffer not yet read), plus, for each wait enqueued on one of
    /// its streams, the time from the enqueue until the copy it waits for was seen complete.
    pub job_waited: Duration,
    /// The buffers the job waited on longest (at most [`crate::WAITED_ON_TOP`]), longest first.
    pub waited_on: Vec<WaitedOn>,
    /// Bytes fingerprinted on the device (at T0, or at a pre-copy round's start); 0 where the
    /// device has no fingerprints or they are off.
    pub fingerprinted_bytes: u64,
    /// How long that took.
    pub fingerprint_time: Duration,
    /// Bytes not copied because the sink already held them, proven equal by fingerprint.
    pub proven_bytes: u64,
    /// Bytes not copied because an earlier image holds them (a parent), proven equal by
    /// fingerprint and referenced.
    pub reused_bytes: u64,
    /// Chunks whose copy did not match their fingerprint at T0 (the checkpoint then fails with
    /// [`EngineError::Mismatch`]).
    pub mismatches: u64,
    /// Where the copy's time went: the staging, the device's copies, the sink.
    pub pipeline: Pipeline,
}

/// A wait enqueued on a job's stream: the slot, when, and the event the stream waits for.
type StreamWait<D> = (usize, Instant, <D as Device>::Event);

/// A checkpoint under way.
pub type CheckpointHandle = SessionHandle<CheckpointReport>;

pub(crate) struct CkptSession<D: Device> {
    dev: Arc<D>,
    mode: CopyMode,
    slots: Vec<CkSlot<D>>,
    index: HashMap<u64, usize>,
    shared: Arc<Shared<D>>,
    writer_tx: Mutex<Option<Sender<WriteJob<D>>>>,
    writers: Mutex<Vec<JoinHandle<()>>>,
    /// How many there were.
    writer_count: usize,
    prio: D::Stream,
    copy_streams: Vec<D::Stream>,
    shadow_budget: u64,
    shadow_used: AtomicU64,
    shadow_peak: AtomicU64,
    shadows: Mutex<Vec<(DevPtr, u64)>>,
    touch_seq: AtomicU32,
    cow_priority: AtomicU64,
    predicted_first: u64,
    /// The buffers the job is predicted to write soonest.
    predicted: std::collections::HashSet<u64>,
    /// The copier takes the predicted writes last, not first: a kept save proven by content
    /// leaves them to copy-on-write, whose shadow the job waits a device-to-device copy for,
    /// rather than for a device-to-host copy the copier has begun.
    predicted_last: AtomicBool,
    cow_shadow: AtomicU64,
    snapshot_shadows: AtomicU64,
    blocked: BlockedTime,
    stream_waits: AtomicU64,
    /// What the job waited on.
    waits: JobWaits,
    /// Waits enqueued on the job's streams, to the thread that times them (until the copies are
    /// all complete).
    stream_wait_tx: Mutex<Option<Sender<StreamWait<D>>>>,
    stream_wait_rx: Mutex<Option<Receiver<StreamWait<D>>>>,
    counters: Arc<Counters>,
    started: Instant,
    /// Saves shadows without the staging, when given (and, `held`, whole buffers).
    shadow_saver: Option<Arc<dyn ShadowSaver>>,
    saved_elsewhere: AtomicU64,
    /// Nothing of the job runs beside the copy ([`Threads`]).
    held: bool,
    /// What the fingerprints decided (see [`CheckpointReport`]).
    prints: PrintTally,
}

/// What the fingerprints of a session's buffers decided.
#[derive(Default)]
struct PrintTally {
    fingerprinted: u64,
    time: Duration,
    proven: u64,
    reused: u64,
}

/// Fingerprints by buffer id, one per chunk.
type Prints = HashMap<u64, Arc<[Fingerprint]>>;

impl<D: Device> CkptSession<D> {
    /// A session copying `mode`'s buffers into `sink`, `beside` what: its threads
    /// ([`Threads::of`]), and a kept save's snapshot (see below).
    pub(crate) fn begin(
        inner: &Arc<Inner<D>>,
        sink: Arc<dyn ChunkSink>,
        mode: CopyMode,
        beside: Beside,
        shadow_saver: Option<Arc<dyn ShadowSaver>>,
    ) -> Result<CheckpointHandle, EngineError> {
        let threads = Threads::of(&inner.cfg, beside);
        // A pre-copy round fixes no T0: its fingerprints are taken before the gate closes, the
        // job's work going on beside them.
        let early = match mode {
            CopyMode::Precopy => {
                // The registry stays read-locked while the device reads the buffers: a free
                // (which removes its buffer under the write lock before unmapping it) waits.
                let reg = inner.reg.read();
                let bufs: Vec<Buffer> = reg.iter().cloned().collect();
                let p = fingerprints(inner, &bufs)?;
                drop(reg);
                Some(p)
            }
            CopyMode::Cow | CopyMode::CowDirty => None,
        };
        inner.gate.close();
        let r = Self::fix_t0(inner, sink, (mode, threads), shadow_saver, early);
        inner.gate.open();
        let session = r?;
        // A kept save's image must hold T0 whatever the job does next. Without fingerprints
        // every buffer is copied into a shadow while the job is held. With them every copy is
        // checked against T0 (a write the hooks miss fails the checkpoint instead of reaching
        // its image), so nothing is copied while held: a write the hooks see is met by
        // copy-on-write, and the buffers predicted to be written are copied last, so that the
        // job's write finds them untouched by the copier and waits only for a shadow.
        if beside == Beside::JobAfterSnapshot {
            if session.proven_by_content() {
                session.predicted_last.store(true, Ordering::Release);
            } else {
                session.snapshot_into_shadows();
            }
        }
        let inner = Arc::clone(inner);
        let nice = threads.nice;
        let join = std::thread::Builder::new()
            .name("possum-copier".into())
            .spawn(move || {
                background_thread(nice);
                let r = session.run();
                inner.set_phase(Phase::Idle);
                r
            })
            .map_err(|e| EngineError::Failed(format!("cannot start the copier thread: {e}")))?;
        Ok(SessionHandle::new(join, "checkpoint"))
    }

    /// The buffers a session in `mode` considers: every one where fingerprints decide (they
    /// see what changed whatever the hooks saw), else those written since the last round where
    /// the mode takes only those.
    fn candidates(inner: &Inner<D>, mode: CopyMode) -> Result<Vec<Buffer>, EngineError> {
        let reg = inner.reg.read();
        if let Some(b) = reg
            .iter()
            .find(|b| b.residency() == crate::registry::Residency::Released)
        {
            return Err(EngineError::Released {
                id: b.id(),
                va: b.va(),
            });
        }
        let by_prints = inner.fingerprints.load(Ordering::Acquire);
        Ok(match mode {
            CopyMode::Cow => reg.iter().cloned().collect(),
            CopyMode::CowDirty | CopyMode::Precopy => reg
                .iter()
                // Every mark is taken, whether or not it decides.
                .filter(|b| b.take_dirty() || by_prints)
                .cloned()
                .collect(),
        })
    }

    /// With the gate closed: picks the buffers, fences the job's streams, fingerprints the
    /// buffers at T0 and plans what to copy, installs the session.
    fn fix_t0(
        inner: &Arc<Inner<D>>,
        sink: Arc<dyn ChunkSink>,
        (mode, threads): (CopyMode, Threads),
        shadow_saver: Option<Arc<dyn ShadowSaver>>,
        early: Option<Option<Prints>>,
    ) -> Result<Arc<Self>, EngineError> {
        let mut bufs = Self::candidates(inner, mode)?;
        // The buffers the job will write soonest are copied first (the copier takes them in
        // this order); the rest keep the registry's order.
        let predicted = {
            let order = inner.save_order.lock();
            let rank: HashMap<u64, usize> =
                order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
            bufs.sort_by_key(|b| rank.get(&b.id()).copied().unwrap_or(usize::MAX));
            bufs.iter()
                .filter(|b| rank.contains_key(&b.id()))
                .map(Buffer::id)
                .collect::<std::collections::HashSet<u64>>()
        };
        for b in &bufs {
            sink.add_buffer(BufferRecord {
                id: b.id(),
                va: b.va().0,
                size: b.size(),
                prefetch_rank: u32::MAX,
            })?;
        }
        inner.fence_job_streams()?;
        let t = Instant::now();
        let prints = match early {
            Some(p) => p,
            // T0: the copy stream waits for the fences, and nothing new reaches a job stream
            // while the gate is closed.
            None => fingerprints(inner, &bufs)?,
        };
        let mut tally = PrintTally {
            time: if prints.is_some() {
                t.elapsed()
            } else {
                Duration::ZERO
            },
            ..PrintTally::default()
        };
        let planned = Self::plan(inner, &bufs, prints.as_ref(), mode, &*sink, &mut tally)?;
        let slots: Vec<CkSlot<D>> = bufs
            .into_iter()
            .zip(planned)
            .filter_map(|(buf, (chunks, t0))| {
                let nothing = chunks.as_ref().is_some_and(Vec::is_empty);
                (!nothing).then(|| CkSlot {
                    buf,
                    chunks,
                    t0,
                    state: Mutex::new(CkState::Pending),
                    cv: Condvar::new(),
                    safe: AtomicBool::new(false),
                    first_touch: AtomicU32::new(u32::MAX),
                })
            })
            .collect();
        let session = Self::install(
            inner,
            sink,
            (mode, threads),
            slots,
            predicted,
            tally,
            shadow_saver,
        )?;
        inner.set_phase(Phase::Checkpoint(Arc::<Self>::clone(&session)));
        Ok(session)
    }

    /// The session over `slots`: its writer threads started, installed as the engine's phase.
    fn install(
        inner: &Arc<Inner<D>>,
        sink: Arc<dyn ChunkSink>,
        (mode, threads): (CopyMode, Threads),
        slots: Vec<CkSlot<D>>,
        predicted: std::collections::HashSet<u64>,
        tally: PrintTally,
        shadow_saver: Option<Arc<dyn ShadowSaver>>,
    ) -> Result<Arc<Self>, EngineError> {
        let chunk = inner.pool.chunk() as u64;
        let (writer_tx, writer_rx) = unbounded();
        let (stream_wait_tx, stream_wait_rx) = unbounded();
        let shared = Arc::new(Shared {
            sink: RwLock::new(Some(sink)),
            pool: Arc::clone(&inner.pool),
            outstanding: Mutex::new(0),
            out_cv: Condvar::new(),
            error: Mutex::new(None),
            failed: AtomicBool::new(false),
            bytes: AtomicU64::new(0),
            sent: Arc::clone(&inner.sent),
            chunk,
            mismatch: Mutex::new(None),
            mismatches: AtomicU64::new(0),
            clock: PipelineClock::default(),
        });
        let mut writers = Vec::new();
        let nice = threads.nice;
        for i in 0..threads.writers {
            let (s, rx) = (Arc::clone(&shared), writer_rx.clone());
            writers.push(
                std::thread::Builder::new()
                    .name(format!("possum-writer-{i}"))
                    .spawn(move || {
                        background_thread(nice);
                        s.writer(rx)
                    })
                    .map_err(|e| {
                        EngineError::Failed(format!("cannot start a writer thread: {e}"))
                    })?,
            );
        }
        let index = slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.buf.id(), i))
            .collect();
        let session = Arc::new(CkptSession {
            dev: Arc::clone(&inner.dev),
            mode,
            slots,
            index,
            shared,
            writer_tx: Mutex::new(Some(writer_tx)),
            writer_count: writers.len(),
            writers: Mutex::new(writers),
            prio: inner.prio.clone(),
            copy_streams: inner.copy_streams.clone(),
            shadow_budget: if mode == CopyMode::Precopy {
                0
            } else {
                inner.shadow_budget.load(Ordering::SeqCst)
            },
            shadow_used: AtomicU64::new(0),
            shadow_peak: AtomicU64::new(0),
            shadows: Mutex::new(Vec::new()),
            touch_seq: AtomicU32::new(0),
            cow_priority: AtomicU64::new(0),
            predicted_first: predicted.len() as u64,
            predicted,
            predicted_last: AtomicBool::new(false),
            cow_shadow: AtomicU64::new(0),
            snapshot_shadows: AtomicU64::new(0),
            blocked: BlockedTime::default(),
            stream_waits: AtomicU64::new(0),
            waits: JobWaits::default(),
            stream_wait_tx: Mutex::new(Some(stream_wait_tx)),
            stream_wait_rx: Mutex::new(Some(stream_wait_rx)),
            counters: Arc::clone(&inner.counters),
            started: Instant::now(),
            shadow_saver,
            saved_elsewhere: AtomicU64::new(0),
            held: threads.held,
            prints: tally,
        });
        inner.set_phase(Phase::Checkpoint(Arc::<Self>::clone(&session)));
        Ok(session)
    }

    /// For each buffer: the chunks to copy (`None`: all of them, no fingerprints) and, in a
    /// mode that fixes a T0, its fingerprints then, which every copy must match.
    #[allow(clippy::type_complexity)]
    fn plan(
        inner: &Inner<D>,
        bufs: &[Buffer],
        prints: Option<&Prints>,
        mode: CopyMode,
        sink: &dyn ChunkSink,
        tally: &mut PrintTally,
    ) -> Result<Vec<(Option<Vec<u64>>, Option<Arc<[Fingerprint]>>)>, EngineError> {
        let Some(prints) = prints else {
            return Ok(bufs.iter().map(|_| (None, None)).collect());
        };
        let chunk = inner.pool.chunk() as u64;
        let mut sent = inner.sent.lock();
        if mode == CopyMode::Cow {
            // A session over every buffer starts an image: the sink holds nothing yet.
            sent.clear();
        }
        // Buffers freed since: their entries go.
        let live: std::collections::HashSet<u64> =
            inner.reg.read().iter().map(Buffer::id).collect();
        sent.retain(|id, _| live.contains(id));
        let mut out = Vec::with_capacity(bufs.len());
        for b in bufs {
            let Some(p) = prints.get(&b.id()) else {
                // Allocated after a pre-copy round's fingerprints: copied whole.
                out.push((None, None));
                continue;
            };
            tally.fingerprinted += b.size();
            let plan = plan_buffer(b, p, chunk, &mut sent, sink)?;
            tally.proven += plan.proven;
            tally.reused += plan.reused;
            let t0 = (mode != CopyMode::Precopy).then(|| Arc::clone(p));
            out.push((Some(plan.copy), t0));
        }
        Ok(out)
    }

    /// How many of the slots (the first ones: the order puts them first) hold buffers the job is
    /// predicted to write soonest ([`crate::Engine::set_save_order`]).
    fn predicted_slots(&self) -> usize {
        self.slots
            .iter()
            .take_while(|s| self.predicted.contains(&s.buf.id()))
            .count()
    }

    /// The order in which the copier takes the slots: theirs, or the predicted writes (which
    /// lead it) moved to the end ([`CkptSession::predicted_last`]).
    fn copy_order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.slots.len()).collect();
        if self.predicted_last.load(Ordering::Acquire) {
            order.rotate_left(self.predicted_slots());
        }
        order
    }

    /// Whether every copy this session makes is checked against fingerprints at T0.
    fn proven_by_content(&self) -> bool {
        self.slots.iter().all(|s| s.t0.is_some())
    }

    fn failed(&self) -> bool {
        self.shared.failed.load(Ordering::Acquire)
    }

    /// Enqueues device-to-host copies of slot `i`'s chunks to copy, read at `src` (the buffer,
    /// or its shadow); returns an event that completes once they have read the device memory.
    fn enqueue_chunks(
        &self,
        i: usize,
        src: DevPtr,
        stream: &D::Stream,
    ) -> Result<D::Event, EngineError> {
        let slot = &self.slots[i];
        let (id, size) = (slot.buf.id(), slot.buf.size());
        let chunk = self.shared.pool.chunk() as u64;
        let all: Vec<u64>;
        let offsets = match &slot.chunks {
            Some(c) => c.as_slice(),
            None => {
                all = (0..size.div_ceil(chunk)).map(|c| c * chunk).collect();
                &all
            }
        };
        for &off in offsets {
            let len = chunk.min(size - off);
            let expect = slot
                .t0
                .as_ref()
                .and_then(|p| p.get(usize::try_from(off / chunk).ok()?).copied());
            let hb = (self.shared.clock).time(Stage::StagingWait, || self.shared.pool.get())?;
            let pending = self.dev.copy_d2h(stream, src.add(off), hb, len)?;
            *self.shared.outstanding.lock() += 1;
            let sent = match self.writer_tx.lock().as_ref() {
                Some(tx) => tx
                    .send(WriteJob {
                        id,
                        off,
                        len,
                        expect,
                        pending,
                    })
                    .is_ok(),
                None => false,
            };
            if !sent {
                *self.shared.outstanding.lock() -= 1;
                return Err(EngineError::Failed(
                    "the checkpoint has already ended".into(),
                ));
            }
        }
        Ok(self.dev.record_event(stream)?)
    }

    fn settle(&self, slot: &CkSlot<D>, state: CkState<D>) {
        *slot.state.lock() = state;
        slot.cv.notify_all();
    }

    /// Makes slot `i` safe to overwrite; returns the event to wait for, and whether this blocked.
    fn make_safe(&self, i: usize) -> (Option<D::Event>, bool) {
        let slot = &self.slots[i];
        let mut blocked = false;
        {
            let mut st = slot.state.lock();
            loop {
                match &*st {
                    CkState::Saved(ev) | CkState::Shadowed { ready: ev, .. } => {
                        return (Some(ev.clone()), blocked)
                    }
                    CkState::Abandoned => return (None, blocked),
                    CkState::Busy => {
                        blocked = true;
                        slot.cv.wait(&mut st);
                    }
                    CkState::Pending => {
                        *st = CkState::Busy;
                        break;
                    }
                }
            }
        }
        match self.save_now(i) {
            Ok(state) => {
                let ev = match &state {
                    CkState::Saved(ev) | CkState::Shadowed { ready: ev, .. } => Some(ev.clone()),
                    _ => None,
                };
                self.settle(slot, state);
                (ev, true)
            }
            Err(e) => {
                self.shared.fail(e);
                self.settle(slot, CkState::Abandoned);
                (None, true)
            }
        }
    }

    /// Saves a claimed slot ahead of the copier: into a shadow if the budget allows, else by a
    /// priority device-to-host copy.
    fn save_now(&self, i: usize) -> Result<CkState<D>, EngineError> {
        let slot = &self.slots[i];
        if let Some(shadowed) = self.shadow(slot)? {
            return Ok(shadowed);
        }
        let ev = self.enqueue_chunks(i, slot.buf.va(), &self.prio)?;
        self.cow_priority.fetch_add(1, Ordering::Relaxed);
        Ok(CkState::Saved(ev))
    }

    /// Copies every buffer not saved yet into a shadow while the budget allows, in the slots'
    /// order (device to device, on the priority stream, after the T0 fences), and waits for the
    /// copies: the image then holds those buffers as of T0 whatever the job does next, whether or
    /// not the hooks see its writes (an unseen write is not ordered after a copy still queued,
    /// hence the wait). For a caller that still holds the job (its operations cannot race this).
    fn snapshot_into_shadows(&self) {
        self.enqueue_snapshot();
        if let Err(e) = self.dev.synchronize(&self.prio) {
            self.shared.fail(EngineError::from(e));
        }
    }

    fn enqueue_snapshot(&self) {
        for slot in &self.slots {
            {
                let mut st = slot.state.lock();
                if !matches!(*st, CkState::Pending) {
                    continue;
                }
                *st = CkState::Busy;
            }
            match self.shadow(slot) {
                Ok(Some(shadowed)) => {
                    self.snapshot_shadows.fetch_add(1, Ordering::Relaxed);
                    self.settle(slot, shadowed);
                }
                // Over the budget: this one and the rest are left to copy-on-write.
                Ok(None) => {
                    self.settle(slot, CkState::Pending);
                    break;
                }
                Err(e) => {
                    self.shared.fail(e);
                    self.settle(slot, CkState::Abandoned);
                    return;
                }
            }
        }
    }

    /// Copies a claimed slot's buffer into a new shadow (device to device, on the priority
    /// stream), if the shadow budget allows and the shadow can be made: its `Shadowed` state.
    fn shadow(&self, slot: &CkSlot<D>) -> Result<Option<CkState<D>>, EngineError> {
        let mapped = slot.buf.mapped_size();
        if self.shadow_budget == 0 {
            return Ok(None);
        }
        let used = self.shadow_used.fetch_add(mapped, Ordering::AcqRel) + mapped;
        let shadow = (used <= self.shadow_budget)
            .then(|| self.alloc_shadow(mapped))
            .flatten();
        let Some(shadow) = shadow else {
            self.shadow_used.fetch_sub(mapped, Ordering::AcqRel);
            return Ok(None);
        };
        self.shadow_peak.fetch_max(used, Ordering::Relaxed);
        self.dev
            .copy_d2d(&self.prio, slot.buf.va(), shadow, slot.buf.size())?;
        let ready = self.dev.record_event(&self.prio)?;
        self.cow_shadow.fetch_add(1, Ordering::Relaxed);
        Ok(Some(CkState::Shadowed { shadow, ready }))
    }

    /// Whether the buffers this copy takes go to the [`ShadowSaver`] themselves: a copy holding
    /// the job (nothing writes them meanwhile), each whole or the chunks of it that changed.
    fn held_to_saver(&self) -> bool {
        self.held && self.shadow_saver.is_some()
    }

    /// Saves slot `i`'s shadow (made ready by `ready`): through the [`ShadowSaver`] if there is
    /// one and it takes it, else through the staging on `stream`.
    fn save_shadow(&self, i: usize, shadow: DevPtr, ready: &D::Event, stream: &D::Stream) {
        if self.save_elsewhere(i, shadow, ready, stream) {
            return;
        }
        let r = self
            .dev
            .wait_event(stream, ready)
            .map_err(EngineError::from)
            .and_then(|()| self.enqueue_chunks(i, shadow, stream));
        if let Err(e) = r {
            self.shared.fail(e);
        }
    }

    /// Saves slot `i`'s shadow through the [`ShadowSaver`], if there is one, once its copy
    /// (`ready`) has completed: whether it did. A failure is logged and leaves the shadow to the
    /// staging. A shadow is a whole buffer; held, the buffer itself goes, of which only the
    /// chunks that changed are saved where the others stay as the sink holds them
    /// ([`ShadowSaver::save_chunks`]). With fingerprints at T0, the shadow (which nobody writes)
    /// is fingerprinted on `stream` and the chunks saved must match them, as a copy through the
    /// staging must.
    fn save_elsewhere(
        &self,
        i: usize,
        shadow: DevPtr,
        ready: &D::Event,
        stream: &D::Stream,
    ) -> bool {
        let Some(saver) = &self.shadow_saver else {
            return false;
        };
        let slot = &self.slots[i];
        let (id, size) = (slot.buf.id(), slot.buf.size());
        let chunk = self.shared.pool.chunk() as u64;
        let some = (slot.chunks.as_deref()).filter(|c| (c.len() as u64) < size.div_ceil(chunk));
        if some.is_some() && !self.held {
            return false;
        }
        let r = self
            .dev
            .event_synchronize(ready)
            .map_err(|e| e.to_string())
            .and_then(|()| match some {
                Some(offsets) => saver.save_chunks(id, shadow, size, (offsets, chunk)),
                None => saver.save(id, shadow, size),
            });
        match r {
            Ok(()) => {
                let all: Vec<u64>;
                let offsets = match some {
                    Some(o) => o,
                    None => {
                        all = (0..size.div_ceil(chunk)).map(|c| c * chunk).collect();
                        &all
                    }
                };
                if let Some(t0) = &slot.t0 {
                    match self.dev.fingerprint(stream, shadow, size, chunk) {
                        Ok(now) => {
                            let at = |off: u64| usize::try_from(off / chunk).ok();
                            let bad = (offsets.iter().copied()).find(|&off| {
                                at(off).and_then(|c| now.get(c)) != at(off).and_then(|c| t0.get(c))
                            });
                            if let Some(off) = bad {
                                let c = at(off).unwrap_or(0);
                                self.shared.mismatched(Mismatch {
                                    buffer: id,
                                    offset: off,
                                    t0: t0.get(c).copied().unwrap_or_default(),
                                    copied: now.get(c).copied().unwrap_or_default(),
                                });
                                return true;
                            }
                            let mut sent = self.shared.sent.lock();
                            for &off in offsets {
                                if let Some(fp) = at(off).and_then(|c| now.get(c)) {
                                    note_sent(&mut sent, id, off, chunk, *fp);
                                }
                            }
                        }
                        Err(e) => {
                            self.shared.fail(e);
                            return true;
                        }
                    }
                }
                let bytes: u64 = offsets.iter().map(|&off| chunk.min(size - off)).sum();
                self.shared.bytes.fetch_add(bytes, Ordering::Relaxed);
                self.saved_elsewhere.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(e) => {
                tracing::warn!("buffer {id}'s shadow saved through the staging instead: {e}");
                false
            }
        }
    }

    fn alloc_shadow(&self, mapped: u64) -> Option<DevPtr> {
        let va = self.dev.reserve(mapped).ok()?;
        if self.dev.map(va, mapped).is_err() {
            let _ = self.dev.unreserve(va, mapped);
            return None;
        }
        self.shadows.lock().push((va, mapped));
        Some(va)
    }

    /// The hook during this session.
    pub(crate) fn before_op(
        &self,
        stream: &D::Stream,
        access: Access<'_>,
    ) -> Result<(), EngineError> {
        if self.failed() {
            return Ok(());
        }
        if self.mode == CopyMode::Precopy {
            // No copy-on-write (nothing is fixed at a T0); only the order of first touches, for
            // the prefetch ranks: a held final round sees no operation at all.
            let mut note = |b: &Buffer| self.note_touch(b);
            match access {
                Access::Known { reads, writes } => reads.iter().chain(writes).for_each(&mut note),
                Access::Opaque => {}
            }
            return Ok(());
        }
        let t = Instant::now();
        let mut blocked = false;
        let mut visit = |b: &Buffer, write: bool| -> Result<(), EngineError> {
            let Some(&i) = self.index.get(&b.id()) else {
                return Ok(());
            };
            let slot = &self.slots[i];
            self.note_touch(b);
            if !write || slot.safe.load(Ordering::Acquire) {
                return Ok(());
            }
            let t_buf = Instant::now();
            let (ev, b) = self.make_safe(i);
            if b {
                blocked = true;
                self.waits.record(&slot.buf, t_buf.elapsed());
            }
            if let Some(ev) = ev {
                // Without the query's answer or the stream's wait, the job's write may run
                // before the buffer's copy has read it: the checkpoint fails (closed).
                let ordered = self.dev.event_query(&ev).and_then(|done| {
                    if done {
                        slot.safe.store(true, Ordering::Release);
                        return Ok(());
                    }
                    self.dev.wait_event(stream, &ev)?;
                    if let Some(tx) = self.stream_wait_tx.lock().as_ref() {
                        let _ = tx.send((i, Instant::now(), ev.clone()));
                    }
                    self.stream_waits.fetch_add(1, Ordering::Relaxed);
                    self.counters.stream_waits.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                });
                if let Err(e) = ordered {
                    let e = EngineError::from(e);
                    self.shared.fail(&e);
                    return Err(e);
                }
            }
            Ok(())
        };
        match access {
            Access::Known { reads, writes } => {
                reads.iter().try_for_each(|b| visit(b, false))?;
                writes.iter().try_for_each(|b| visit(b, true))?;
            }
            Access::Opaque => self.slots.iter().try_for_each(|s| visit(&s.buf, true))?,
        }
        if blocked {
            let d = t.elapsed();
            self.blocked.record(d);
            self.counters.blocked.record(d);
        }
        Ok(())
    }

    /// Notes the job's first touch of `b` in this session (for the prefetch ranks).
    fn note_touch(&self, b: &Buffer) {
        let Some(&i) = self.index.get(&b.id()) else {
            return;
        };
        let slot = &self.slots[i];
        if slot.first_touch.load(Ordering::Relaxed) == u32::MAX {
            let seq = self.touch_seq.fetch_add(1, Ordering::Relaxed);
            let _ = slot.first_touch.compare_exchange(
                u32::MAX,
                seq,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// Before the job frees `buf`: its T0 contents must have been read.
    pub(crate) fn settle_before_free(&self, buf: &Buffer) -> Result<(), EngineError> {
        let Some(&i) = self.index.get(&buf.id()) else {
            return Ok(());
        };
        let t = Instant::now();
        let (ev, mut waited) = self.make_safe(i);
        if let Some(ev) = ev {
            if !self.dev.event_query(&ev)? {
                self.dev.event_synchronize(&ev)?;
                waited = true;
            }
        }
        if waited {
            self.waits.record(&self.slots[i].buf, t.elapsed());
        }
        Ok(())
    }

    /// Times the waits enqueued on the job's streams: each from its enqueue until its copy is
    /// seen complete from here (in the order they were enqueued).
    fn time_stream_waits(&self, rx: Receiver<StreamWait<D>>) {
        for (i, since, ev) in rx {
            if self.dev.event_synchronize(&ev).is_ok() {
                self.waits.record(&self.slots[i].buf, since.elapsed());
            }
        }
    }

    /// The copier: saves every slot nobody saved yet, then waits for the writers.
    fn run(&self) -> Result<CheckpointReport, EngineError> {
        let rx = self.stream_wait_rx.lock().take();
        let captured = std::thread::scope(|scope| {
            if let Some(rx) = rx {
                scope.spawn(move || self.time_stream_waits(rx));
            }
            self.copy_all()
        });
        self.finish(captured)
    }

    /// Enqueues the copy of every slot nobody saved yet and waits until the device memory is
    /// captured: how long that took since T0. No wait is enqueued on a job's stream after it.
    fn copy_all(&self) -> Duration {
        let n = self.copy_streams.len();
        std::thread::scope(|scope| {
            // Shadows the saver takes are handed to a few threads, so that the saver always has
            // the next one queued behind the one it is copying (each waits for its copy).
            let (to_savers, savers_rx) = unbounded::<(usize, DevPtr, D::Event)>();
            if self.shadow_saver.is_some() {
                let savers = if self.held {
                    HELD_SAVERS
                } else {
                    SHADOW_SAVERS
                };
                for _ in 0..savers {
                    let rx = savers_rx.clone();
                    scope.spawn(move || {
                        for (i, shadow, ready) in rx {
                            self.save_shadow(i, shadow, &ready, &self.copy_streams[i % n]);
                            // Held, what the saver gets is the buffer itself (there are no
                            // shadows): its copy is over.
                            if self.held {
                                self.settle(&self.slots[i], CkState::Saved(ready));
                            }
                        }
                    });
                }
            }
            drop(savers_rx);
            // First the buffers the job may still have to wait for (not in a shadow), in
            // `copy_order` (the predicted writes first, or last where copy-on-write meets
            // them); then the shadows, which the job never
            // waits for. A saver's shadows go to it at once: it copies them on its own
            // streams into its own memory, beside the staging.
            let mut shadowed = Vec::new();
            let saver = self.shadow_saver.is_some();
            for i in self.copy_order() {
                let slot = &self.slots[i];
                if self.failed() {
                    break;
                }
                let stream = &self.copy_streams[i % n];
                let copy = {
                    let mut st = slot.state.lock();
                    // A hook may be saving it right now, perhaps into a shadow that still has to
                    // reach the image: wait for it to settle, then look again.
                    while matches!(*st, CkState::Busy) {
                        slot.cv.wait(&mut st);
                    }
                    match &*st {
                        CkState::Pending => {
                            *st = CkState::Busy;
                            true
                        }
                        CkState::Shadowed { shadow, ready, .. } if saver => {
                            if let Err(e) = to_savers.send((i, *shadow, ready.clone())) {
                                shadowed.push(e.into_inner());
                            }
                            false
                        }
                        CkState::Shadowed { shadow, ready, .. } => {
                            shadowed.push((i, *shadow, ready.clone()));
                            false
                        }
                        _ => false,
                    }
                };
                // Held, the buffer itself goes to the saver (the chunks to take of it), as a
                // shadow would, once the job's work before T0 is done (the copy streams wait for
                // it).
                if copy && self.held_to_saver() {
                    let ready = self.dev.record_event(stream);
                    if let Ok(Ok(())) = ready.map(|r| to_savers.send((i, slot.buf.va(), r))) {
                        continue;
                    }
                }
                if copy {
                    match self.enqueue_chunks(i, slot.buf.va(), stream) {
                        Ok(ev) => self.settle(slot, CkState::Saved(ev)),
                        Err(e) => {
                            self.shared.fail(e);
                            self.settle(slot, CkState::Abandoned);
                        }
                    }
                }
            }
            for (i, shadow, ready) in shadowed {
                if self.failed() {
                    break;
                }
                // Without a saver no thread receives: saved here, through the staging.
                if let Err(e) = to_savers.send((i, shadow, ready)) {
                    let (i, shadow, ready) = e.into_inner();
                    self.save_shadow(i, shadow, &ready, &self.copy_streams[i % n]);
                }
            }
        });
        // Every copy is enqueued: once the engine's streams drain, the device memory is captured.
        for s in self.copy_streams.iter().chain(std::iter::once(&self.prio)) {
            if let Err(e) = self.dev.synchronize(s) {
                self.shared.fail(e);
            }
        }
        // Every copy has completed: a job's stream has nothing left to wait for.
        self.stream_wait_tx.lock().take();
        self.started.elapsed()
    }

    /// Waits for the writers and reports.
    fn finish(&self, captured: Duration) -> Result<CheckpointReport, EngineError> {
        if self.failed() {
            for slot in &self.slots {
                let mut st = slot.state.lock();
                if matches!(*st, CkState::Pending) {
                    *st = CkState::Abandoned;
                    slot.cv.notify_all();
                }
            }
        }
        {
            let mut n = self.shared.outstanding.lock();
            while *n > 0 {
                self.shared.out_cv.wait(&mut n);
            }
        }
        for (va, mapped) in self.shadows.lock().drain(..) {
            let unmapped = self
                .dev
                .unmap(va, mapped)
                .and_then(|()| self.dev.unreserve(va, mapped));
            if let Err(e) = unmapped {
                self.shared.fail(e);
            }
        }
        // Every round ranks what it saw touched (a pre-copy round too: a held final round sees
        // nothing, and its image keeps these ranks).
        if !self.failed() {
            if let Err(e) = self.record_prefetch_order() {
                self.shared.fail(e);
            }
        }
        // Done with the sink: stop the writers and let go of it, so that once `wait` returns the
        // caller holds the only reference (and can commit an image).
        self.writer_tx.lock().take();
        for w in self.writers.lock().drain(..) {
            let _ = w.join();
        }
        self.shared.sink.write().take();
        if let Some(m) = *self.shared.mismatch.lock() {
            return Err(EngineError::Mismatch {
                buffer: m.buffer,
                offset: m.offset,
                chunks: self.shared.mismatches.load(Ordering::Relaxed),
            });
        }
        if let Some(e) = self.shared.error.lock().clone() {
            return Err(EngineError::Failed(format!("checkpoint failed: {e}")));
        }
        let (hook_blocked, hook_blocked_total, hook_blocked_max) = self.blocked.totals();
        let (job_waited, waited_on) = self.waits.report();
        Ok(CheckpointReport {
            buffers: self.slots.len(),
            bytes: self.shared.bytes.load(Ordering::Relaxed),
            captured,
            elapsed: self.started.elapsed(),
            cow_priority: self.cow_priority.load(Ordering::Relaxed),
            predicted_first: self.predicted_first,
            cow_shadow: self.cow_shadow.load(Ordering::Relaxed),
            snapshot_shadows: self.snapshot_shadows.load(Ordering::Relaxed),
            shadow_peak: self.shadow_peak.load(Ordering::Relaxed),
            shadows_saved_elsewhere: self.saved_elsewhere.load(Ordering::Relaxed),
            hook_blocked,
            hook_blocked_total,
            hook_blocked_max,
            stream_waits: self.stream_waits.load(Ordering::Relaxed),
            job_waited,
            waited_on,
            fingerprinted_bytes: self.prints.fingerprinted,
            fingerprint_time: self.prints.time,
            proven_bytes: self.prints.proven,
            reused_bytes: self.prints.reused,
            mismatches: self.shared.mismatches.load(Ordering::Relaxed),
            pipeline: self.shared.clock.report(self.writer_count),
        })
    }

    /// Ranks buffers by the order the job first touched them after T0: the best guess of the order
    /// a restored job will need them in.
    /// A round that saw no operation (the final copy of a held job) ranks nothing: the ranks an
    /// earlier round of the same image recorded stand (buffers are declared again with
    /// `u32::MAX`, which keeps a rank already recorded: [`ChunkSink::add_buffer`]).
    fn record_prefetch_order(&self) -> Result<(), EngineError> {
        if self.touch_seq.load(Ordering::Relaxed) == 0 {
            return Ok(());
        }
        let mut order: Vec<(u32, u64, &Buffer)> = self
            .slots
            .iter()
            .map(|s| (s.first_touch.load(Ordering::Relaxed), s.buf.id(), &s.buf))
            .collect();
        order.sort_unstable_by_key(|&(t, id, _)| (t, id));
        let sink = self.shared.sink.read();
        let Some(sink) = sink.as_ref() else {
            return Ok(());
        };
        for (rank, (_, _, b)) in order.into_iter().enumerate() {
            sink.add_buffer(BufferRecord {
                id: b.id(),
                va: b.va().0,
                size: b.size(),
                prefetch_rank: u32::try_from(rank).unwrap_or(u32::MAX),
            })?;
        }
        Ok(())
    }
}

impl<D: Device> PhaseSession<D> for CkptSession<D> {
    fn before_op(&self, stream: &D::Stream, access: Access<'_>) -> Result<(), EngineError> {
        CkptSession::before_op(self, stream, access)
    }

    fn settle_before_free(&self, buf: &Buffer) -> Result<(), EngineError> {
        CkptSession::settle_before_free(self, buf)
    }
}
