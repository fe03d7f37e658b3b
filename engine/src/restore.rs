//! On-demand restore: the job runs again before its buffers are back.
//!
//! `begin` checks that the image matches the job's released buffers (same ids, addresses, sizes),
//! installs the session and returns. Background restorer threads walk the buffers in prefetch order
//! (the order the job first touched them after the checkpoint's T0): the first thread to reach a
//! buffer maps new physical memory at its old address, then every restorer takes its chunks one at a
//! time and copies them in through the staging pool (chunk integrity is checked as it is read), so
//! the buffers come back in rank order, each at the speed of all restorers together. Before an
//! operation that touches (reads or writes) a buffer not yet back, the hook asks for exactly that
//! buffer: it becomes *urgent*, every restorer takes its next chunk from it before anything else,
//! the hook's own thread copies chunks of it too (through the high-priority stream), and the hook
//! returns once its last chunk is on the device.
//!
//! A restore may be *staged* ([`Staged`]): the device's memory owner (a keeper) has created the
//! buffers' memory and is loading the image into it itself, started before the job existed (while
//! CRIU restored the process). A staged buffer is then not copied here: the first thread to reach
//! it maps the owner's memory at its address ([`Device::expect_kept`], then
//! [`Device::reattach`]) and waits for the owner to report its contents loaded; a hook that needs
//! it asks the owner for it at once (the owner loads it next). A buffer the owner could not load
//! (a failed read, the owner gone), or whose memory cannot be mapped, is copied in from the image
//! here as any other: staging changes where the bytes are copied, never what the job sees.
//!
//! Restore always completes: the last restorer finalises the session whether or not anyone waits.
//! A buffer that cannot be restored (corrupt chunk, device too small) fails the operations that touch
//! it with an error naming it, and leaves it released.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::device::{Device, DeviceError, HostBuffer, Transfer};
use crate::error::EngineError;
use crate::registry::{Buffer, Residency};
use crate::session::{BlockedTime, JobWaits, SessionHandle, WaitedOn};
use crate::shared::{background_thread, Access, Counters, Inner, Phase, PhaseSession};
use crate::staging::StagingPool;
use crate::store::ChunkSource;

/// Memory the device's owner prepared for a restore, and loads the image into itself.
pub trait Staged: Send + Sync {
    /// The owner's memory prepared for buffer `buffer`: its id, the epoch to take it back with,
    /// and its size (`None`: not staged).
    fn memory_of(&self, buffer: u64) -> Option<StagedMemory>;
    /// Blocks until the owner has loaded `buffer`'s contents into its memory (asking it to load
    /// that buffer next). An error: the owner did not load it (the engine copies it itself).
    fn wait_loaded(&self, buffer: u64) -> Result<(), String>;
    /// The restore is over: memory staged and not taken may be freed.
    fn finished(&self);
}

/// One buffer's memory in a [`Staged`] restore.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedMemory {
    /// The owner's id of the memory.
    pub id: u64,
    /// The epoch it is taken back with.
    pub epoch: u64,
    /// Its size in bytes (the buffer's mapped size).
    pub size: u64,
}

/// How many chunk copies one thread keeps in flight.
const DEPTH: usize = 2;

enum RsState {
    Pending,
    /// Mapped; its chunks are being copied in (by any thread).
    Busy,
    Restored,
    Failed(String),
    /// The job freed it before it was restored.
    Freed,
}

struct RsSlot {
    buf: Buffer,
    chunks: Vec<(u64, u64)>,
    state: Mutex<RsState>,
    cv: Condvar,
    /// Restored (a lock-free check for the hook).
    done: AtomicBool,
    /// Mapped: its chunks may be claimed.
    mapped: AtomicBool,
    /// The next chunk to claim.
    next_chunk: AtomicUsize,
    /// Chunks claimed but not yet on the device, plus the not yet claimed ones.
    left: AtomicUsize,
    /// The first chunk error, if any.
    error: Mutex<Option<EngineError>>,
    /// A hook asked for it (it counts as restored on demand).
    wanted: AtomicBool,
    /// Its memory is the owner's and the owner's load of it is not settled yet ([`Staged`]):
    /// cleared by exactly one thread, once it is loaded or falls back to being copied here.
    staged: AtomicBool,
    /// A restorer waits for the owner to load it.
    awaited: AtomicBool,
}

impl RsSlot {
    fn new(buf: Buffer, chunks: Vec<(u64, u64)>) -> Self {
        let n = chunks.len();
        RsSlot {
            buf,
            chunks,
            state: Mutex::new(RsState::Pending),
            cv: Condvar::new(),
            done: AtomicBool::new(false),
            mapped: AtomicBool::new(false),
            next_chunk: AtomicUsize::new(0),
            left: AtomicUsize::new(n),
            error: Mutex::new(None),
            wanted: AtomicBool::new(false),
            staged: AtomicBool::new(false),
            awaited: AtomicBool::new(false),
        }
    }

    /// Claims the next chunk to copy, if the buffer is mapped and one is left.
    fn claim(&self) -> Option<usize> {
        if !self.mapped.load(Ordering::Acquire) {
            return None;
        }
        let c = self.next_chunk.fetch_add(1, Ordering::Relaxed);
        (c < self.chunks.len()).then_some(c)
    }

    fn error_for(&self, e: EngineError) -> EngineError {
        EngineError::RestoreBuffer {
            id: self.buf.id(),
            va: self.buf.va(),
            size: self.buf.size(),
            source: Box::new(e),
        }
    }
}

/// What a restore did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RestoreReport {
    /// Buffers restored.
    pub buffers: usize,
    /// Bytes restored.
    pub bytes: u64,
    /// From `restore` until every buffer was back.
    pub elapsed: Duration,
    /// Buffers restored on demand, because an operation needed them before the prefetcher got there.
    pub on_demand: u64,
    /// Buffers restored by the background prefetcher.
    pub prefetched: u64,
    /// Chunks of buffers wanted on demand that the restorer threads copied (helping the hook).
    pub helped_chunks: u64,
    /// Hook calls that blocked the job's thread.
    pub hook_blocked: u64,
    /// Their total time.
    pub hook_blocked_total: Duration,
    /// The longest one.
    pub hook_blocked_max: Duration,
    /// Buffers whose memory the owner prepared and loaded ([`Staged`]): mapped, nothing copied
    /// here.
    pub staged: u64,
    /// Staged buffers copied in here after all (the owner did not load them, or their memory
    /// could not be mapped).
    pub staged_fallback: u64,
    /// The time the job's threads waited in the hook for buffers not yet back (or still being
    /// copied in when freed).
    pub job_waited: Duration,
    /// The buffers the job waited on longest (at most [`crate::WAITED_ON_TOP`]), longest first.
    pub waited_on: Vec<WaitedOn>,
    /// Bytes checked on the device after loading against the fingerprints the image recorded.
    pub verified_bytes: u64,
}

/// A restore under way.
pub type RestoreHandle = SessionHandle<RestoreReport>;

pub(crate) struct RestoreSession<D: Device> {
    dev: Arc<D>,
    pool: Arc<StagingPool<D>>,
    source: Arc<dyn ChunkSource>,
    staged: Option<Arc<dyn Staged>>,
    staged_done: AtomicU64,
    staged_fallback: AtomicU64,
    slots: Vec<RsSlot>,
    index: HashMap<u64, usize>,
    order: Vec<usize>,
    /// The prefetch frontier: the position in `order` of the first buffer that may still have
    /// chunks to claim.
    next: AtomicUsize,
    /// Buffers hooks wait for, served before the frontier.
    urgent: Mutex<Vec<usize>>,
    /// Wakes a restorer sleeping out `prefetch_delay` when a buffer becomes urgent.
    urgent_cv: Condvar,
    helped: AtomicU64,
    prio: D::Stream,
    /// Where loaded buffers are fingerprinted (`None`: the device cannot).
    verify: Mutex<Option<D::Stream>>,
    verified: AtomicU64,
    error: Mutex<Option<String>>,
    bytes: AtomicU64,
    on_demand: AtomicU64,
    prefetched: AtomicU64,
    blocked: BlockedTime,
    waits: JobWaits,
    counters: Arc<Counters>,
    started: Instant,
    /// Test hook: the prefetcher waits this long before starting each buffer of the frontier
    /// (urgent buffers are served at once).
    prefetch_delay: Duration,
}

/// What a worker does next.
enum Next {
    /// Copy chunk `.1` of slot `.0`.
    Chunk(usize, usize),
    /// Wait for the owner to load staged slot `.0`.
    Await(usize),
    /// Wait for the copies in flight first.
    Drain,
    /// Nothing left for this worker.
    Done,
}

/// Who is copying.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Worker {
    /// A background restorer.
    Restorer,
    /// A hook helping with the one buffer it waits for.
    Hook(usize),
}

/// The image does not match the job's buffer `id`, and why.
fn mismatch(id: u64, why: String) -> EngineError {
    EngineError::ImageMismatch { id, why }
}

/// Whether `chunks` (offset, length) cover buffer `id` of `size` bytes exactly, one after the
/// other from its start.
fn check_coverage(id: u64, size: u64, chunks: &[(u64, u64)]) -> Result<(), EngineError> {
    let mut expect = 0;
    for &(off, len) in chunks {
        if off != expect {
            return Err(mismatch(
                id,
                format!("chunks do not cover the buffer at offset {expect}"),
            ));
        }
        expect = off + len;
    }
    if expect != size {
        return Err(mismatch(
            id,
            format!("chunks cover {expect} of {size} bytes"),
        ));
    }
    Ok(())
}

impl<D: Device> RestoreSession<D> {
    pub(crate) fn begin(
        inner: &Arc<Inner<D>>,
        source: Arc<dyn ChunkSource>,
        staged: Option<Arc<dyn Staged>>,
    ) -> Result<RestoreHandle, EngineError> {
        let slots = Self::match_image(inner, source.as_ref())?;
        // The image matches: the owner's prepared memory becomes each staged buffer's.
        if let Some(st) = &staged {
            Self::expect_staged(inner, st.as_ref(), &slots);
        }
        let session = Self::new(inner, source, staged, slots);
        inner.gate.close();
        inner.set_phase(Phase::Restore(Arc::<Self>::clone(&session)));
        inner.gate.open();
        Self::spawn(inner, session)
    }

    /// A slot for each buffer of the image, in prefetch order, once the image is found to match
    /// the job's buffers: every buffer it holds is the job's (or one the job freed since it was
    /// saved), at the same address and size and covered by its chunks exactly, and every
    /// buffer the job released is in it.
    fn match_image(inner: &Inner<D>, source: &dyn ChunkSource) -> Result<Vec<RsSlot>, EngineError> {
        let mut recs = source.buffers();
        recs.sort_unstable_by_key(|r| (r.prefetch_rank, r.id));
        let mut slots = Vec::with_capacity(recs.len());
        let reg = inner.reg.read();
        let freed = inner.freed_since_tracking.lock().clone();
        for r in &recs {
            let Some(buf) = reg.get(r.id).cloned() else {
                // Saved, then freed by the job while the checkpoint was being made (after its
                // copy, or after T0 by a thread already past the pause): nothing of the job
                // refers to it any more.
                if freed.contains(&r.id) {
                    continue;
                }
                return Err(mismatch(r.id, "the job has no such buffer".into()));
            };
            if buf.va().0 != r.va || buf.size() != r.size {
                return Err(mismatch(
                    r.id,
                    format!(
                        "image has {} bytes at {:#x}, the job {} bytes at {}",
                        r.size,
                        r.va,
                        buf.size(),
                        buf.va()
                    ),
                ));
            }
            let chunks = source.chunks(r.id);
            check_coverage(r.id, r.size, &chunks)?;
            slots.push(RsSlot::new(buf, chunks));
        }
        let in_image: std::collections::HashSet<u64> = recs.iter().map(|r| r.id).collect();
        let missing = reg
            .iter()
            .find(|b| b.residency() == Residency::Released && !in_image.contains(&b.id()));
        match missing {
            Some(b) => Err(mismatch(
                b.id(),
                format!(
                    "the job's released buffer at {} is not in the image",
                    b.va()
                ),
            )),
            None => Ok(slots),
        }
    }

    /// Marks each slot whose memory the owner prepared (`staged`), and the device agrees to
    /// take as its kept memory, staged.
    fn expect_staged(inner: &Inner<D>, staged: &dyn Staged, slots: &[RsSlot]) {
        for slot in slots {
            let b = &slot.buf;
            let ok = staged.memory_of(b.id()).is_some_and(|m| {
                m.size == b.mapped_size()
                    && inner.dev.expect_kept(b.va(), m.size, m.id, m.epoch).is_ok()
            });
            slot.staged.store(ok, Ordering::Relaxed);
        }
    }

    fn new(
        inner: &Inner<D>,
        source: Arc<dyn ChunkSource>,
        staged: Option<Arc<dyn Staged>>,
        slots: Vec<RsSlot>,
    ) -> Arc<Self> {
        let index = slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.buf.id(), i))
            .collect();
        let order = (0..slots.len()).collect();
        let verify = inner
            .dev
            .create_stream(crate::device::StreamPriority::Normal)
            .ok();
        Arc::new(RestoreSession {
            dev: Arc::clone(&inner.dev),
            pool: Arc::clone(&inner.pool),
            source,
            staged,
            staged_done: AtomicU64::new(0),
            staged_fallback: AtomicU64::new(0),
            slots,
            index,
            order,
            next: AtomicUsize::new(0),
            urgent: Mutex::new(Vec::new()),
            urgent_cv: Condvar::new(),
            helped: AtomicU64::new(0),
            prio: inner.prio.clone(),
            verify: Mutex::new(verify),
            verified: AtomicU64::new(0),
            error: Mutex::new(None),
            bytes: AtomicU64::new(0),
            on_demand: AtomicU64::new(0),
            prefetched: AtomicU64::new(0),
            blocked: BlockedTime::default(),
            waits: JobWaits::default(),
            counters: Arc::clone(&inner.counters),
            started: Instant::now(),
            prefetch_delay: inner.cfg.prefetch_delay,
        })
    }

    /// Starts the restorer threads, and the `possum-restore` thread that waits for them, ends
    /// the session and sets the phase back (to idle, or to released if a buffer failed).
    fn spawn(inner: &Arc<Inner<D>>, session: Arc<Self>) -> Result<RestoreHandle, EngineError> {
        let mut workers = Vec::new();
        let nice = inner.cfg.background_nice;
        for t in 0..inner.cfg.restore_threads.max(1) {
            let s = Arc::clone(&session);
            let stream = inner.copy_streams[t % inner.copy_streams.len()].clone();
            workers.push(
                std::thread::Builder::new()
                    .name(format!("possum-restorer-{t}"))
                    .spawn(move || {
                        background_thread(nice);
                        s.prefetch(&stream)
                    })
                    .map_err(|e| {
                        EngineError::Failed(format!("cannot start a restorer thread: {e}"))
                    })?,
            );
        }
        let inner = Arc::clone(inner);
        let join = std::thread::Builder::new()
            .name("possum-restore".into())
            .spawn(move || {
                for w in workers {
                    let _ = w.join();
                }
                let r = session.finish();
                inner.set_phase(if r.is_ok() {
                    Phase::Idle
                } else {
                    Phase::Released
                });
                r
            })
            .map_err(|e| EngineError::Failed(format!("cannot start the restore thread: {e}")))?;
        Ok(SessionHandle::new(join, "restore"))
    }

    fn fail(&self, e: &EngineError) {
        let mut g = self.error.lock();
        if g.is_none() {
            *g = Some(e.to_string());
        }
    }

    fn recycle(&self, b: D::HostBuf) {
        if b.len() == self.pool.chunk() {
            self.pool.put(b);
        }
    }

    /// A staging buffer of at least `len` bytes: from the pool, or a one-off for an image written
    /// with larger chunks than this engine's.
    fn take_buf(&self, len: usize) -> Result<D::HostBuf, DeviceError> {
        if len <= self.pool.chunk() {
            self.pool.get()
        } else {
            self.dev.alloc_host(len)
        }
    }

    /// Starts slot `i` if it is pending: maps its memory (under its lock, so no chunk is claimed
    /// before). Returns whether it is now being copied in.
    fn start(&self, i: usize) -> bool {
        let slot = &self.slots[i];
        let mut st = slot.state.lock();
        match &*st {
            RsState::Busy => return true,
            RsState::Pending => {}
            _ => return false,
        }
        let b = &slot.buf;
        let mapped = if slot.staged.load(Ordering::Acquire) {
            // The owner's memory, loaded (or being loaded) by the owner. If it cannot be mapped,
            // new memory is, and the buffer is copied in here.
            self.dev.reattach(b.va(), b.mapped_size()).or_else(|_| {
                let _ = self.dev.forget(b.va(), b.mapped_size());
                slot.staged.store(false, Ordering::Release);
                self.staged_fallback.fetch_add(1, Ordering::Relaxed);
                self.dev.map(b.va(), b.mapped_size())
            })
        } else {
            self.dev.map(b.va(), b.mapped_size())
        };
        if let Err(e) = mapped {
            let e = slot.error_for(e.into());
            self.fail(&e);
            *st = RsState::Failed(e.to_string());
            drop(st);
            slot.cv.notify_all();
            return false;
        }
        *st = RsState::Busy;
        if slot.staged.load(Ordering::Acquire) {
            // Its chunks are not claimed: the owner loads them ([`Self::settle_staged`]).
            return true;
        }
        slot.mapped.store(true, Ordering::Release);
        if slot.chunks.is_empty() {
            drop(st);
            self.complete(i);
        }
        true
    }

    /// The last chunk of slot `i` is on the device (or failed): the slot is restored, or failed
    /// and released again.
    fn complete(&self, i: usize) {
        let slot = &self.slots[i];
        let b = &slot.buf;
        let err = slot
            .error
            .lock()
            .take()
            .map_or_else(|| self.verify_loaded(slot).err(), Some);
        let state = match err {
            None => {
                b.set_residency(Residency::Mapped);
                self.bytes.fetch_add(b.size(), Ordering::Relaxed);
                if slot.wanted.load(Ordering::Relaxed) {
                    self.on_demand.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.prefetched.fetch_add(1, Ordering::Relaxed);
                }
                slot.done.store(true, Ordering::Release);
                RsState::Restored
            }
            Some(e) => {
                let _ = self.dev.unmap(b.va(), b.mapped_size());
                let e = slot.error_for(e);
                self.fail(&e);
                RsState::Failed(e.to_string())
            }
        };
        *slot.state.lock() = state;
        slot.cv.notify_all();
        // A restorer sleeping out the prefetch delay on this slot moves on (it checks the slot's
        // state under the same lock before sleeping: no wake-up is lost).
        drop(self.urgent.lock());
        self.urgent_cv.notify_all();
    }

    /// Checks a loaded buffer on the device: each chunk for which the source recorded a
    /// fingerprint must have it (a chunk changed on disk, or loaded wrong, is refused, named).
    /// Chunks of ranges a fingerprint cannot take (not 16-byte aligned) are not checked.
    fn verify_loaded(&self, slot: &RsSlot) -> Result<(), EngineError> {
        let b = &slot.buf;
        let want: Vec<(u64, u64, crate::fingerprint::Fingerprint)> = slot
            .chunks
            .iter()
            .filter_map(|&(off, len)| Some((off, len, self.source.fingerprint(b.id(), off)?)))
            .collect();
        if want.is_empty() {
            return Ok(());
        }
        let guard = self.verify.lock();
        let Some(stream) = guard.as_ref() else {
            return Ok(());
        };
        // One call for a buffer of equal chunks (the usual image), else one per chunk.
        let first = want[0].1;
        let uniform = want.len() == slot.chunks.len()
            && want.iter().enumerate().all(|(i, &(off, len, _))| {
                off == i as u64 * first && (len == first || i + 1 == want.len())
            });
        let got: Vec<crate::fingerprint::Fingerprint> = if uniform {
            match self.dev.fingerprint(stream, b.va(), b.size(), first) {
                Ok(v) => v,
                Err(DeviceError::Unsupported(_) | DeviceError::InvalidAddress { .. }) => {
                    return Ok(())
                }
                Err(e) => return Err(e.into()),
            }
        } else {
            let mut v = Vec::with_capacity(want.len());
            for &(off, len, _) in &want {
                match self
                    .dev
                    .fingerprint(stream, b.va().add(off), len, len.next_multiple_of(16))
                {
                    Ok(p) => v.extend(p),
                    Err(DeviceError::Unsupported(_) | DeviceError::InvalidAddress { .. }) => {
                        return Ok(())
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            v
        };
        for (&(off, len, fp), now) in want.iter().zip(&got) {
            if *now != fp {
                return Err(EngineError::Failed(format!(
                    "the chunk at offset {off} ({len} bytes) has fingerprint {now} on the device \
                     after loading, not {fp} as the image recorded: refused"
                )));
            }
        }
        self.verified
            .fetch_add(want.iter().map(|w| w.1).sum(), Ordering::Relaxed);
        Ok(())
    }

    /// One chunk of slot `i` is done with (copied, or failed with `err`).
    fn chunk_done(&self, i: usize, err: Option<EngineError>) {
        let slot = &self.slots[i];
        if let Some(e) = err {
            slot.error.lock().get_or_insert(e);
        }
        if slot.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.complete(i);
        }
    }

    /// The owner's load of staged slot `i` is over (`r`): the slot is restored, or falls back to
    /// being copied in here (its chunks claimable, first among the restorers' work). Only the
    /// first call for a slot counts.
    fn settle_staged(&self, i: usize, r: Result<(), String>) {
        let slot = &self.slots[i];
        if !slot.staged.swap(false, Ordering::AcqRel) {
            return;
        }
        match r {
            Ok(()) => {
                self.staged_done.fetch_add(1, Ordering::Relaxed);
                slot.left.store(0, Ordering::Release);
                self.complete(i);
            }
            Err(_) => {
                self.staged_fallback.fetch_add(1, Ordering::Relaxed);
                slot.mapped.store(true, Ordering::Release);
                if slot.chunks.is_empty() {
                    self.complete(i);
                    return;
                }
                {
                    let mut urgent = self.urgent.lock();
                    if !urgent.contains(&i) {
                        urgent.push(i);
                    }
                }
                self.urgent_cv.notify_all();
            }
        }
    }

    /// Waits for the owner to load staged slot `i` and settles it.
    fn await_staged(&self, i: usize) {
        let r = match &self.staged {
            Some(st) => st.wait_loaded(self.slots[i].buf.id()),
            None => Err("not a staged restore".into()),
        };
        self.settle_staged(i, r);
    }

    /// At the frontier's slot `i`: if it is staged and no restorer waits for it yet, this one
    /// maps it and waits (once it has no copy in flight).
    fn staged_next(&self, i: usize, idle: bool) -> Option<Next> {
        let slot = &self.slots[i];
        if !slot.staged.load(Ordering::Acquire) || slot.awaited.load(Ordering::Acquire) {
            return None;
        }
        if !idle {
            return Some(Next::Drain);
        }
        if slot.awaited.swap(true, Ordering::AcqRel) || !self.start(i) {
            return None;
        }
        slot.staged
            .load(Ordering::Acquire)
            .then_some(Next::Await(i))
    }

    /// The next chunk a worker copies: for a hook, of its own buffer; for a restorer, of an urgent
    /// buffer first, else of the frontier (starting buffers in prefetch order). `idle`: the worker
    /// has no copy in flight (only then may it sleep out the prefetch delay: a copy in flight
    /// finishes its buffer only when its worker waits for it).
    fn next_chunk(&self, who: Worker, idle: bool) -> Next {
        if let Worker::Hook(i) = who {
            return match self.slots[i].claim() {
                Some(c) => Next::Chunk(i, c),
                None => Next::Done,
            };
        }
        loop {
            {
                let mut urgent = self.urgent.lock();
                while let Some(&i) = urgent.first() {
                    if let Some(c) = self.slots[i].claim() {
                        self.helped.fetch_add(1, Ordering::Relaxed);
                        return Next::Chunk(i, c);
                    }
                    urgent.remove(0);
                }
            }
            let k = self.next.load(Ordering::Acquire);
            let Some(&i) = self.order.get(k) else {
                return Next::Done;
            };
            if let Some(n) = self.staged_next(i, idle) {
                return n;
            }
            if let Some(c) = self.slots[i].claim() {
                return Next::Chunk(i, c);
            }
            let pending = |s: &RsSlot| matches!(*s.state.lock(), RsState::Pending);
            if pending(&self.slots[i]) {
                if !self.prefetch_delay.is_zero() {
                    if !idle {
                        return Next::Drain;
                    }
                    // Sleep out the delay unless a buffer becomes urgent (or this one is taken
                    // meanwhile); other wake-ups sleep on.
                    let deadline = Instant::now() + self.prefetch_delay;
                    let mut urgent = self.urgent.lock();
                    while urgent.is_empty()
                        && pending(&self.slots[i])
                        && !self.urgent_cv.wait_until(&mut urgent, deadline).timed_out()
                    {
                    }
                    if !urgent.is_empty() || !pending(&self.slots[i]) {
                        continue;
                    }
                }
                if self.start(i) {
                    continue;
                }
            }
            // Started meanwhile by another thread (mapped under the lock `pending` waited for)?
            if let Some(c) = self.slots[i].claim() {
                return Next::Chunk(i, c);
            }
            // Every chunk of it is claimed (or it is done, failed or freed): move the frontier on.
            let _ = self
                .next
                .compare_exchange(k, k + 1, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Copies chunks until `who` has none left to take, keeping `DEPTH` copies in flight.
    fn copy_chunks(&self, stream: &D::Stream, who: Worker) {
        let mut inflight: VecDeque<(usize, D::Pending)> = VecDeque::with_capacity(DEPTH + 1);
        loop {
            let (i, c) = match self.next_chunk(who, inflight.is_empty()) {
                Next::Chunk(i, c) => (i, c),
                Next::Drain => {
                    self.drain(&mut inflight);
                    continue;
                }
                Next::Await(i) => {
                    self.await_staged(i);
                    continue;
                }
                Next::Done => break,
            };
            let slot = &self.slots[i];
            let (off, len) = slot.chunks[c];
            let Ok(ulen) = usize::try_from(len) else {
                self.chunk_done(i, Some(EngineError::Failed("chunk too large".into())));
                continue;
            };
            // Reuse this thread's oldest copy's buffer when at depth or when the pool is empty:
            // waiting on the pool while holding buffers in flight could deadlock restorers.
            let pooled = if inflight.len() >= DEPTH || ulen > self.pool.chunk() {
                None
            } else {
                self.pool.try_get()
            };
            let hb = match pooled {
                Some(hb) => Ok(hb),
                None => match inflight.pop_front() {
                    Some((j, p)) => match p.wait() {
                        Ok(hb) => {
                            self.chunk_done(j, None);
                            if hb.len() >= ulen {
                                Ok(hb)
                            } else {
                                self.recycle(hb);
                                self.take_buf(ulen)
                            }
                        }
                        Err(e) => {
                            self.chunk_done(j, Some(e.into()));
                            self.replace_lost_buffer();
                            self.take_buf(ulen)
                        }
                    },
                    None => self.take_buf(ulen),
                },
            };
            let mut hb = match hb {
                Ok(hb) => hb,
                Err(e) => {
                    self.chunk_done(i, Some(e.into()));
                    continue;
                }
            };
            if let Err(e) =
                self.source
                    .read_chunk(slot.buf.id(), off, &mut hb.as_mut_slice()[..ulen])
            {
                self.recycle(hb);
                self.chunk_done(i, Some(e.into()));
                continue;
            }
            match self.dev.copy_h2d(stream, hb, slot.buf.va().add(off), len) {
                Ok(p) => inflight.push_back((i, p)),
                Err(e) => {
                    self.replace_lost_buffer();
                    self.chunk_done(i, Some(e.into()));
                }
            }
        }
        self.drain(&mut inflight);
    }

    /// Waits for every copy in flight.
    fn drain(&self, inflight: &mut VecDeque<(usize, D::Pending)>) {
        for (j, p) in inflight.drain(..) {
            match p.wait() {
                Ok(hb) => {
                    self.recycle(hb);
                    self.chunk_done(j, None);
                }
                Err(e) => {
                    self.replace_lost_buffer();
                    self.chunk_done(j, Some(e.into()));
                }
            }
        }
    }

    /// A staging buffer went with a failed copy: the pool may replace it.
    fn replace_lost_buffer(&self) {
        self.pool.lost();
    }

    /// A background restorer: copies chunks until every buffer is started and claimed.
    fn prefetch(&self, stream: &D::Stream) {
        self.copy_chunks(stream, Worker::Restorer);
    }

    /// Brings slot `i` back for a hook: makes it urgent, copies chunks of it on this thread too,
    /// and waits until it is restored. Returns whether the thread was held up.
    fn want(&self, i: usize) -> Result<bool, EngineError> {
        let slot = &self.slots[i];
        if slot.done.load(Ordering::Acquire) {
            return Ok(false);
        }
        slot.wanted.store(true, Ordering::Relaxed);
        // Staged: the owner is asked for this buffer now (whoever else waits for it).
        if slot.staged.load(Ordering::Acquire)
            && self.start(i)
            && slot.staged.load(Ordering::Acquire)
        {
            self.await_staged(i);
        }
        if self.start(i) {
            {
                let mut urgent = self.urgent.lock();
                if !urgent.contains(&i) {
                    urgent.push(i);
                }
            }
            self.urgent_cv.notify_all();
            self.copy_chunks(&self.prio, Worker::Hook(i));
        }
        let mut st = slot.state.lock();
        loop {
            match &*st {
                RsState::Busy | RsState::Pending => slot.cv.wait(&mut st),
                RsState::Restored | RsState::Freed => return Ok(true),
                RsState::Failed(e) => {
                    return Err(slot.error_for(EngineError::Failed(e.clone())));
                }
            }
        }
    }

    /// The hook during this session.
    pub(crate) fn before_op(
        &self,
        _stream: &D::Stream,
        access: Access<'_>,
    ) -> Result<(), EngineError> {
        let t = Instant::now();
        let mut blocked = false;
        let mut visit = |b: &Buffer| -> Result<(), EngineError> {
            let Some(&i) = self.index.get(&b.id()) else {
                return Ok(());
            };
            let t_buf = Instant::now();
            if self.want(i)? {
                blocked = true;
                self.waits.record(&self.slots[i].buf, t_buf.elapsed());
            }
            Ok(())
        };
        let r = match access {
            Access::Known { reads, writes } => reads.iter().chain(writes).try_for_each(&mut visit),
            Access::Opaque => self.slots.iter().try_for_each(|s| visit(&s.buf)),
        };
        if blocked {
            let d = t.elapsed();
            self.blocked.record(d);
            self.counters.blocked.record(d);
        }
        r
    }

    /// Before the job frees `buf`: nothing may still be copying into it.
    pub(crate) fn settle_before_free(&self, buf: &Buffer) -> Result<(), EngineError> {
        let Some(&i) = self.index.get(&buf.id()) else {
            return Ok(());
        };
        let slot = &self.slots[i];
        let t = Instant::now();
        let mut st = slot.state.lock();
        loop {
            match &*st {
                RsState::Busy => {
                    slot.cv.wait(&mut st);
                    if !matches!(*st, RsState::Busy) {
                        self.waits.record(&slot.buf, t.elapsed());
                    }
                }
                RsState::Pending => {
                    // Never restore a buffer that is being freed; memory the owner prepared
                    // for it goes back.
                    if slot.staged.load(Ordering::Acquire) {
                        let _ = self.dev.forget(slot.buf.va(), slot.buf.mapped_size());
                    }
                    *st = RsState::Freed;
                    drop(st);
                    slot.cv.notify_all();
                    return Ok(());
                }
                RsState::Restored | RsState::Failed(_) | RsState::Freed => return Ok(()),
            }
        }
    }

    /// After the prefetchers are done: waits for buffers still being copied in by hooks.
    fn finish(&self) -> Result<RestoreReport, EngineError> {
        for slot in &self.slots {
            let mut st = slot.state.lock();
            while matches!(*st, RsState::Busy | RsState::Pending) {
                slot.cv.wait(&mut st);
            }
        }
        if let Some(st) = &self.staged {
            st.finished();
        }
        if let Some(e) = self.error.lock().clone() {
            return Err(EngineError::Failed(format!("restore failed: {e}")));
        }
        let (hook_blocked, hook_blocked_total, hook_blocked_max) = self.blocked.totals();
        let (job_waited, waited_on) = self.waits.report();
        Ok(RestoreReport {
            buffers: self.slots.len(),
            bytes: self.bytes.load(Ordering::Relaxed),
            elapsed: self.started.elapsed(),
            on_demand: self.on_demand.load(Ordering::Relaxed),
            prefetched: self.prefetched.load(Ordering::Relaxed),
            helped_chunks: self.helped.load(Ordering::Relaxed),
            hook_blocked,
            hook_blocked_total,
            hook_blocked_max,
            staged: self.staged_done.load(Ordering::Relaxed),
            staged_fallback: self.staged_fallback.load(Ordering::Relaxed),
            job_waited,
            waited_on,
            verified_bytes: self.verified.load(Ordering::Relaxed),
        })
    }
}

impl<D: Device> PhaseSession<D> for RestoreSession<D> {
    fn before_op(&self, stream: &D::Stream, access: Access<'_>) -> Result<(), EngineError> {
        RestoreSession::before_op(self, stream, access)
    }

    fn settle_before_free(&self, buf: &Buffer) -> Result<(), EngineError> {
        RestoreSession::settle_before_free(self, buf)
    }
}
