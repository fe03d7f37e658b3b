//! On-demand restore: the job runs again before its buffers are back.
//!
//! `begin` checks that the image matches the job's released buffers (same ids, addresses, sizes),
//! installs the session and returns. Background restorer threads walk the buffers in prefetch order
//! (the order the job first touched them after the checkpoint's T0), each mapping new physical memory
//! at the buffer's old address and copying the chunks in through the staging pool (chunk integrity is
//! checked as it is read). Before an operation that touches (reads or writes) a buffer not yet back,
//! the hook restores exactly that buffer on the calling thread through the high-priority stream, or
//! waits for the restorer already doing it, and makes the operation's stream wait for it.
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

enum RsState<D: Device> {
    Pending,
    Busy,
    Restored(D::Event),
    Failed(String),
    /// The job freed it before it was restored.
    Freed,
}

struct RsSlot<D: Device> {
    buf: Buffer,
    chunks: Vec<(u64, u64)>,
    state: Mutex<RsState<D>>,
    cv: Condvar,
    /// Its restore event has completed.
    done: AtomicBool,
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
    slots: Vec<RsSlot<D>>,
    index: HashMap<u64, usize>,
    order: Vec<usize>,
    next: AtomicUsize,
    prio: D::Stream,
    error: Mutex<Option<String>>,
    bytes: AtomicU64,
    on_demand: AtomicU64,
    prefetched: AtomicU64,
    blocked: BlockedTime,
    counters: Arc<Counters>,
    started: Instant,
    /// Test hook: the prefetcher waits this long before each buffer.
    prefetch_delay: Duration,
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
            for r in &recs {
                let buf = reg
                    .get(r.id)
                    .cloned()
                    .ok_or_else(|| EngineError::ImageMismatch {
                        id: r.id,
                        why: "the job has no such buffer".into(),
                    })?;
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
                slots.push(RsSlot {
                    buf,
                    chunks,
                    state: Mutex::new(RsState::Pending),
                    cv: Condvar::new(),
                    done: AtomicBool::new(false),
                });
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

    /// Maps the buffer's memory again and copies its chunks in; returns an event for the copies.
    fn restore_slot(&self, slot: &RsSlot<D>, stream: &D::Stream) -> Result<D::Event, EngineError> {
        let b = &slot.buf;
        let wrap = |e: EngineError| EngineError::RestoreBuffer {
            id: b.id(),
            va: b.va(),
            size: b.size(),
            source: Box::new(e),
        };
        self.dev
            .map(b.va(), b.mapped_size())
            .map_err(|e| wrap(e.into()))?;
        let r = self.copy_in(slot, stream);
        match r {
            Ok(ev) => {
                b.set_residency(Residency::Mapped);
                self.bytes.fetch_add(b.size(), Ordering::Relaxed);
                Ok(ev)
            }
            Err(e) => {
                let _ = self.dev.unmap(b.va(), b.mapped_size());
                Err(wrap(e))
            }
        }
    }

    fn copy_in(&self, slot: &RsSlot<D>, stream: &D::Stream) -> Result<D::Event, EngineError> {
        let b = &slot.buf;
        let mut inflight: VecDeque<D::Pending> = VecDeque::with_capacity(DEPTH + 1);
        let mut result = Ok(());
        for &(off, len) in &slot.chunks {
            let ulen =
                usize::try_from(len).map_err(|_| EngineError::Failed("chunk too large".into()))?;
            // Reuse this thread's oldest copy's buffer when at depth or when the pool is empty:
            // waiting on the pool while holding buffers in flight could deadlock restorers.
            let pooled = if inflight.len() >= DEPTH || ulen > self.pool.chunk() {
                None
            } else {
                self.pool.try_get()
            };
            let mut hb = match (pooled, inflight.pop_front()) {
                (Some(hb), oldest) => {
                    if let Some(p) = oldest {
                        inflight.push_front(p);
                    }
                    hb
                }
                (None, Some(p)) => match p.wait() {
                    Ok(hb) if hb.len() >= ulen => hb,
                    Ok(hb) => {
                        self.recycle(hb);
                        self.take_buf(ulen)?
                    }
                    Err(e) => {
                        result = Err(e.into());
                        break;
                    }
                },
                (None, None) => self.take_buf(ulen)?,
            };
            if let Err(e) = self
                .source
                .read_chunk(b.id(), off, &mut hb.as_mut_slice()[..ulen])
            {
                self.recycle(hb);
                result = Err(e.into());
                break;
            }
            match self.dev.copy_h2d(stream, hb, b.va().add(off), len) {
                Ok(p) => inflight.push_back(p),
                Err(e) => {
                    result = Err(e.into());
                    break;
                }
            }
        }
        let ev = match result {
            Ok(()) => self.dev.record_event(stream).map_err(EngineError::from),
            Err(e) => Err(e),
        };
        for p in inflight {
            match p.wait() {
                Ok(hb) => self.recycle(hb),
                Err(e) => {
                    // The staging buffer went with the failed copy: keep the pool at its size.
                    if let Ok(nb) = self.dev.alloc_host(self.pool.chunk()) {
                        self.pool.put(nb);
                    }
                    return Err(e.into());
                }
            }
        }
        ev
    }

    /// A staging buffer of at least `len` bytes: from the pool, or a one-off for an image written
    /// with larger chunks than this engine's.
    fn take_buf(&self, len: usize) -> Result<D::HostBuf, DeviceError> {
        if len <= self.pool.chunk() {
            Ok(self.pool.get())
        } else {
            self.dev.alloc_host(len)
        }
    }

    /// Claims slot `i` for this thread, or returns its state if someone else has it.
    fn ensure(
        &self,
        i: usize,
        stream: &D::Stream,
        on_demand: bool,
    ) -> (Result<Option<D::Event>, EngineError>, bool) {
        let slot = &self.slots[i];
        let mut blocked = false;
        {
            let mut st = slot.state.lock();
            loop {
                match &*st {
                    RsState::Restored(ev) => return (Ok(Some(ev.clone())), blocked),
                    RsState::Failed(e) => {
                        return (
                            Err(EngineError::RestoreBuffer {
                                id: slot.buf.id(),
                                va: slot.buf.va(),
                                size: slot.buf.size(),
                                source: Box::new(EngineError::Failed(e.clone())),
                            }),
                            blocked,
                        )
                    }
                    RsState::Freed => return (Ok(None), blocked),
                    RsState::Busy if on_demand => {
                        blocked = true;
                        slot.cv.wait(&mut st);
                    }
                    RsState::Busy => return (Ok(None), false),
                    RsState::Pending => {
                        *st = RsState::Busy;
                        break;
                    }
                }
            }
        }
        let r = self.restore_slot(slot, stream);
        let (state, out) = match r {
            Ok(ev) => {
                if on_demand {
                    self.on_demand.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.prefetched.fetch_add(1, Ordering::Relaxed);
                }
                (RsState::Restored(ev.clone()), Ok(Some(ev)))
            }
            Err(e) => {
                self.fail(&e);
                (RsState::Failed(e.to_string()), Err(e))
            }
        };
        *slot.state.lock() = state;
        slot.cv.notify_all();
        (out, true)
    }

    /// A background restorer: takes buffers in prefetch order until none is left.
    fn prefetch(&self, stream: &D::Stream) {
        loop {
            let k = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(&i) = self.order.get(k) else { return };
            if !self.prefetch_delay.is_zero() {
                std::thread::sleep(self.prefetch_delay);
            }
            // Errors are recorded in the slot and the session; go on with the other buffers.
            let _ = self.ensure(i, stream, false);
        }
    }

    /// The hook during this session.
    pub(crate) fn before_op(
        &self,
        stream: &D::Stream,
        access: Access<'_>,
    ) -> Result<(), EngineError> {
        let t = Instant::now();
        let mut blocked = false;
        let mut visit = |b: &Buffer| -> Result<(), EngineError> {
            let Some(&i) = self.index.get(&b.id()) else {
                return Ok(());
            };
            let slot = &self.slots[i];
            if slot.done.load(Ordering::Acquire) {
                return Ok(());
            }
            let (r, bl) = self.ensure(i, &self.prio, true);
            blocked |= bl;
            if let Some(ev) = r? {
                if self.dev.event_query(&ev)? {
                    slot.done.store(true, Ordering::Release);
                } else {
                    self.dev.wait_event(stream, &ev)?;
                    self.counters.stream_waits.fetch_add(1, Ordering::Relaxed);
                }
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
        let mut st = slot.state.lock();
        loop {
            match &*st {
                RsState::Busy => slot.cv.wait(&mut st),
                RsState::Restored(ev) => return Ok(self.dev.event_synchronize(ev)?),
                RsState::Pending => {
                    // Never restore a buffer that is being freed.
                    *st = RsState::Freed;
                    return Ok(());
                }
                RsState::Failed(_) | RsState::Freed => return Ok(()),
            }
        }
    }

    /// After the prefetchers are done: waits for buffers restored on demand and for every copy.
    fn finish(&self) -> Result<RestoreReport, EngineError> {
        for slot in &self.slots {
            let ev = {
                let mut st = slot.state.lock();
                while matches!(*st, RsState::Busy | RsState::Pending) {
                    slot.cv.wait(&mut st);
                }
                match &*st {
                    RsState::Restored(ev) => Some(ev.clone()),
                    _ => None,
                }
            };
            if let Some(ev) = ev {
                if let Err(e) = self.dev.event_synchronize(&ev) {
                    self.fail(&e.into());
                }
                slot.done.store(true, Ordering::Release);
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
            hook_blocked,
            hook_blocked_total,
            hook_blocked_max,
        })
    }
}
