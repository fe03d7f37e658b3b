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
//! Restore always completes: the last restorer finalises the session whether or not anyone waits.
//! A buffer that cannot be restored (corrupt chunk, device too small) fails the operations that touch
//! it with an error naming it, and leaves it released.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::device::{Device, DeviceError, HostBuffer, Transfer};
use crate::engine::{Access, Counters, EngineError, Inner, Phase};
use crate::registry::{Buffer, Residency};
use crate::session::{BlockedTime, SessionHandle};
use crate::staging::StagingPool;
use crate::store::ChunkSource;

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
}

/// A restore under way.
pub type RestoreHandle = SessionHandle<RestoreReport>;

pub(crate) struct RestoreSession<D: Device> {
    dev: Arc<D>,
    pool: Arc<StagingPool<D>>,
    source: Arc<dyn ChunkSource>,
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
    error: Mutex<Option<String>>,
    bytes: AtomicU64,
    on_demand: AtomicU64,
    prefetched: AtomicU64,
    blocked: BlockedTime,
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

impl<D: Device> RestoreSession<D> {
    pub(crate) fn begin(
        inner: &Arc<Inner<D>>,
        source: Arc<dyn ChunkSource>,
    ) -> Result<RestoreHandle, EngineError> {
        let mut recs = source.buffers();
        recs.sort_unstable_by_key(|r| (r.prefetch_rank, r.id));
        let mut slots = Vec::with_capacity(recs.len());
        {
            let reg = inner.reg.read();
            let freed = inner.freed_since_tracking.lock().clone();
            for r in &recs {
                let Some(buf) = reg.get(r.id).cloned() else {
                    // Saved, then freed by the job while the checkpoint was being made (after
                    // its copy, or after T0 by a thread already past the pause): nothing of the
                    // job refers to it any more.
                    if freed.contains(&r.id) {
                        continue;
                    }
                    return Err(EngineError::ImageMismatch {
                        id: r.id,
                        why: "the job has no such buffer".into(),
                    });
                };
                if buf.va().0 != r.va || buf.size() != r.size {
                    return Err(EngineError::ImageMismatch {
                        id: r.id,
                        why: format!(
                            "image has {} bytes at {:#x}, the job {} bytes at {}",
                            r.size,
                            r.va,
                            buf.size(),
                            buf.va()
                        ),
                    });
                }
                let chunks = source.chunks(r.id);
                let mut expect = 0;
                for &(off, len) in &chunks {
                    if off != expect {
                        return Err(EngineError::ImageMismatch {
                            id: r.id,
                            why: format!("chunks do not cover the buffer at offset {expect}"),
                        });
                    }
                    expect = off + len;
                }
                if expect != r.size {
                    return Err(EngineError::ImageMismatch {
                        id: r.id,
                        why: format!("chunks cover {expect} of {} bytes", r.size),
                    });
                }
                slots.push(RsSlot::new(buf, chunks));
            }
            let in_image: std::collections::HashSet<u64> = recs.iter().map(|r| r.id).collect();
            let missing = reg
                .iter()
                .find(|b| b.residency() == Residency::Released && !in_image.contains(&b.id()))
                .cloned();
            if let Some(b) = missing {
                return Err(EngineError::ImageMismatch {
                    id: b.id(),
                    why: format!(
                        "the job's released buffer at {} is not in the image",
                        b.va()
                    ),
                });
            }
        }
        let index = slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.buf.id(), i))
            .collect();
        let order = (0..slots.len()).collect();
        let session = Arc::new(RestoreSession {
            dev: Arc::clone(&inner.dev),
            pool: Arc::clone(&inner.pool),
            source,
            slots,
            index,
            order,
            next: AtomicUsize::new(0),
            urgent: Mutex::new(Vec::new()),
            urgent_cv: Condvar::new(),
            helped: AtomicU64::new(0),
            prio: inner.prio.clone(),
            error: Mutex::new(None),
            bytes: AtomicU64::new(0),
            on_demand: AtomicU64::new(0),
            prefetched: AtomicU64::new(0),
            blocked: BlockedTime::default(),
            counters: Arc::clone(&inner.counters),
            started: Instant::now(),
            prefetch_delay: inner.cfg.prefetch_delay,
        });
        inner.gate.close();
        inner.set_phase(Phase::Restore(Arc::clone(&session)));
        inner.gate.open();

        let mut workers = Vec::new();
        for t in 0..inner.cfg.restore_threads.max(1) {
            let s = Arc::clone(&session);
            let stream = inner.copy_streams[t % inner.copy_streams.len()].clone();
            workers.push(
                std::thread::Builder::new()
                    .name(format!("possum-restorer-{t}"))
                    .spawn(move || s.prefetch(&stream))
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
        if let Err(e) = self.dev.map(b.va(), b.mapped_size()) {
            let e = slot.error_for(e.into());
            self.fail(&e);
            *st = RsState::Failed(e.to_string());
            drop(st);
            slot.cv.notify_all();
            return false;
        }
        *st = RsState::Busy;
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
        let err = slot.error.lock().take();
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
            blocked |= self.want(i)?;
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
        let mut st = slot.state.lock();
        loop {
            match &*st {
                RsState::Busy => slot.cv.wait(&mut st),
                RsState::Pending => {
                    // Never restore a buffer that is being freed.
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
        if let Some(e) = self.error.lock().clone() {
            return Err(EngineError::Failed(format!("restore failed: {e}")));
        }
        let (hook_blocked, hook_blocked_total, hook_blocked_max) = self.blocked.totals();
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
        })
    }
}
