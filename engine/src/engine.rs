//! The engine: managed buffers, the hook point, and the phases (checkpoint, pre-copy, release,
//! restore) that the hook consults.
//!
//! # Protocol
//! * The job's buffers are allocated through [`Engine::alloc`]: a VA reservation with physical
//!   memory mapped under it, so the memory can later be dropped and re-created at the same address.
//! * Before each operation of the job (kernel, copy, memset), the caller resolves the buffers it
//!   reads and writes and calls [`Engine::before_op`] with the operation's stream. The returned
//!   [`OpGuard`] is dropped once the operation is enqueued. The hook may enqueue waits on that
//!   stream (the operation then waits on the device, not the host) or block the calling thread.
//! * Resolving an operation's buffers costs the launch path most of its time, and the engine
//!   needs them only from a session's first pre-copy round until its restore is done: while the
//!   engine is *tracking* ([`OpGuard::tracking`]). A caller may split the hook: [`Engine::enter_op`],
//!   then resolve and [`OpGuard::check`] only if the guard says so. Tracking starts with any
//!   session (every buffer is then marked written: writes while it was off went unrecorded) and
//!   ends with [`Engine::stop_tracking`]. The flag is read inside the op gate and set before the
//!   session closes the gate, so every operation after a session's T0 is checked.
//! * [`Engine::checkpoint`] fixes T0 and returns at once; see [`crate::checkpoint`].
//! * [`Engine::precopy_round`] sends what was written since the previous round.
//! * [`Engine::release`] drops the physical memory of every buffer (the job must be quiet).
//! * [`Engine::restore`] starts an on-demand restore; see [`crate::restore`].

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use crate::checkpoint::{Beside, CheckpointHandle, CkptSession, CopyMode};
use crate::config::EngineConfig;
use crate::device::{DevPtr, Device, DeviceError, StreamPriority};
use crate::error::EngineError;
use crate::gate::Gate;
use crate::registry::{Buffer, Registry, Residency};
use crate::restore::{RestoreHandle, RestoreSession, Staged};
use crate::shared::{Access, Counters, Inner, Phase};
use crate::staging::StagingPool;
use crate::store::{ChunkSink, ChunkSource};

/// Threads mapping detached buffers again in [`Engine::reattach`].
const REATTACH_THREADS: usize = 8;

/// A snapshot of the engine's counters.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Stats {
    /// Managed buffers.
    pub buffers: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Bytes with physical memory now.
    pub resident_bytes: u64,
    /// Buffers marked written since the last pre-copy round (what a final dirty round would take).
    pub dirty_buffers: usize,
    /// Their bytes.
    pub dirty_bytes: u64,
    /// Hook calls.
    pub hook_calls: u64,
    /// Hook calls that blocked the job's thread.
    pub hook_blocked: u64,
    /// Total time the job's threads were blocked in the hook.
    pub hook_blocked_ns: u64,
    /// Longest single block.
    pub hook_blocked_max_ns: u64,
    /// Waits enqueued on the job's streams.
    pub stream_waits: u64,
    /// The current phase.
    pub phase: &'static str,
    /// Whether operations' buffers are needed (a session's pre-copy through its restore).
    pub tracking: bool,
}
/// Held while an operation goes from the hook to its stream; drop it once the operation is enqueued.
#[must_use = "drop the guard after the operation is enqueued"]
pub struct OpGuard<'a, D: Device> {
    inner: &'a Inner<D>,
}

impl<D: Device> std::fmt::Debug for OpGuard<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OpGuard")
    }
}

impl<D: Device> OpGuard<'_, D> {
    /// Whether the engine needs this operation's buffer sets ([`OpGuard::check`]). Read inside the
    /// gate: if false, no session can fix its T0 before the operation is enqueued.
    pub fn tracking(&self) -> bool {
        self.inner.tracking.load(Ordering::SeqCst)
    }

    /// The hook proper for the operation this guard admitted: marks what it writes, and, while a
    /// session runs, makes it wait for what it touches (or fails it, for a released buffer).
    pub fn check(&self, stream: &D::Stream, access: Access<'_>) -> Result<(), EngineError> {
        let inner = self.inner;
        inner.counters.hook_calls.fetch_add(1, Ordering::Relaxed);
        // A member of a group stands for the whole group (see `Engine::alloc_at`).
        let grouped;
        let access = match access {
            Access::Known { reads, writes }
                if reads.iter().chain(writes).any(|b| b.group().is_some()) =>
            {
                grouped = with_groups(&inner.reg.read(), reads, writes);
                Access::Known {
                    reads: &grouped.0,
                    writes: &grouped.1,
                }
            }
            a => a,
        };
        match access {
            Access::Known { writes, .. } => writes.iter().for_each(Buffer::mark_dirty),
            Access::Opaque => inner.reg.read().iter().for_each(Buffer::mark_dirty),
        }
        if !inner.active.load(Ordering::Acquire) {
            return Ok(());
        }
        let phase = inner.phase.read().clone();
        match phase {
            Phase::Idle => {}
            Phase::Checkpoint(s) => s.before_op(stream, access)?,
            Phase::Restore(s) => s.before_op(stream, access)?,
            Phase::Released | Phase::Detached => {
                let reg;
                let all: Vec<Buffer>;
                let touched: &[Buffer] = match access {
                    Access::Known { reads, writes } => {
                        all = reads.iter().chain(writes).cloned().collect();
                        &all
                    }
                    Access::Opaque => {
                        reg = inner.reg.read();
                        all = reg.iter().cloned().collect();
                        &all
                    }
                };
                if let Some(b) = touched.iter().find(|b| b.residency() != Residency::Mapped) {
                    return Err(EngineError::Released {
                        id: b.id(),
                        va: b.va(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// `reads` and `writes` with every member of their buffers' groups: (reads, writes), a buffer
/// written not also among the reads.
fn with_groups(reg: &Registry, reads: &[Buffer], writes: &[Buffer]) -> (Vec<Buffer>, Vec<Buffer>) {
    let widen = |set: &[Buffer]| {
        let mut out: Vec<Buffer> = Vec::with_capacity(set.len());
        let mut seen = std::collections::HashSet::new();
        for b in set {
            let members = match b.group() {
                Some(g) => reg.group(g),
                None => std::slice::from_ref(b),
            };
            for m in members {
                if seen.insert(m.id()) {
                    out.push(m.clone());
                }
            }
        }
        out
    };
    let w = widen(writes);
    let written: std::collections::HashSet<u64> = w.iter().map(Buffer::id).collect();
    let r = widen(reads)
        .into_iter()
        .filter(|b| !written.contains(&b.id()))
        .collect();
    (r, w)
}

impl<D: Device> Drop for OpGuard<'_, D> {
    fn drop(&mut self) {
        self.inner.gate.leave();
    }
}

/// The engine. Cheap to clone (a handle).
pub struct Engine<D: Device> {
    inner: Arc<Inner<D>>,
}

impl<D: Device> Clone for Engine<D> {
    fn clone(&self) -> Self {
        Engine {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<D: Device> std::fmt::Debug for Engine<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("device", &self.inner.dev.name())
            .finish()
    }
}

impl<D: Device> Engine<D> {
    /// An engine over `dev`. Allocates its staging buffers and streams.
    pub fn new(dev: Arc<D>, cfg: EngineConfig) -> Result<Self, EngineError> {
        let pool = Arc::new(StagingPool::new(
            Arc::clone(&dev),
            cfg.chunk_size,
            cfg.staging_buffers.max(2),
        )?);
        let copy_streams = (0..cfg.copy_streams.max(1))
            .map(|_| dev.create_stream(StreamPriority::Normal))
            .collect::<Result<Vec<_>, _>>()?;
        let prio = dev.create_stream(StreamPriority::High)?;
        let shadow_budget = cfg.shadow_budget;
        let fingerprints = cfg.fingerprints
            && dev
                .fingerprint_ready()
                .inspect_err(|why| tracing::info!("{}: no fingerprints: {why}", dev.name()))
                .is_ok();
        Ok(Engine {
            inner: Arc::new(Inner {
                dev,
                cfg,
                reg: RwLock::new(Registry::default()),
                job_streams: RwLock::new(Vec::new()),
                phase: RwLock::new(Phase::Idle),
                freed_since_tracking: Default::default(),
                save_order: Default::default(),
                active: AtomicBool::new(false),
                tracking: AtomicBool::new(false),
                device_fence: AtomicBool::new(false),
                shadow_budget: AtomicU64::new(shadow_budget),
                gate: Gate::default(),
                pool,
                copy_streams,
                prio,
                counters: Arc::new(Counters::default()),
                sent: Default::default(),
                fingerprints: AtomicBool::new(fingerprints),
            }),
        })
    }

    /// Whether this engine proves its images by content (fingerprints on, and the device can
    /// take them): only then may the hooks speculate that a kernel does not write a buffer it
    /// names, since only then does a wrong speculation fail an image instead of corrupting it.
    pub fn proves_by_content(&self) -> bool {
        self.inner.fingerprints.load(Ordering::Acquire)
    }

    /// The device.
    pub fn device(&self) -> &Arc<D> {
        &self.inner.dev
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.cfg
    }

    /// Tells the engine about a stream the job issues work on (needed to fix T0 on it).
    pub fn register_stream(&self, s: D::Stream) {
        self.inner.job_streams.write().push(s);
    }

    /// Forgets the job streams for which `same` is true (streams the job is destroying), so that
    /// no later checkpoint records a fence on them. Returns how many were forgotten.
    pub fn unregister_streams(&self, same: impl Fn(&D::Stream) -> bool) -> usize {
        let mut streams = self.inner.job_streams.write();
        let before = streams.len();
        streams.retain(|s| !same(s));
        before - streams.len()
    }

    /// Allocates a managed, releasable buffer of `size` bytes.
    pub fn alloc(&self, size: u64) -> Result<Buffer, EngineError> {
        let mapped = self.granular(size);
        let va = self.inner.dev.reserve(mapped)?;
        self.map_reserved(va, size, mapped, None)
    }

    /// `size` rounded up to the device's mapping granularity (at least one granule).
    fn granular(&self, size: u64) -> u64 {
        let g = self.inner.dev.granularity();
        size.max(1).div_ceil(g) * g
    }

    /// Maps memory in the reservation `[va, va + mapped)` and registers it as a buffer of `size`
    /// bytes (a member of `group` if given); on a failure the reservation is given back.
    fn map_reserved(
        &self,
        va: DevPtr,
        size: u64,
        mapped: u64,
        group: Option<u64>,
    ) -> Result<Buffer, EngineError> {
        if let Err(e) = self.inner.dev.map(va, mapped) {
            let _ = self.inner.dev.unreserve(va, mapped);
            return Err(e.into());
        }
        Ok(self.inner.reg.write().insert_in(va, size, mapped, group))
    }

    /// Maps a managed, releasable buffer of `size` bytes at `va`, inside an address range the job
    /// reserved itself (its `cuMemAddressReserve`), which stays the job's: freeing the buffer
    /// unmaps it and leaves the range reserved. The buffer is a member of `group`: an operation
    /// that touches one member is taken to touch them all (the job maps such a range piece by
    /// piece, and its data may span pieces).
    pub fn alloc_at(&self, va: DevPtr, size: u64, group: u64) -> Result<Buffer, EngineError> {
        let mapped = self.granular(size);
        self.inner.dev.adopt_reservation(va, mapped)?;
        self.map_reserved(va, size, mapped, Some(group))
    }

    /// Frees the buffer starting at `va`. During a checkpoint, its contents are saved first.
    ///
    /// The free is inside the op gate from the phase it reads to the unmap: a session fixing T0
    /// (which closes the gate) then either picks the buffer before the free starts, and the free
    /// waits for its copy, or after it is gone. The caller must not be inside the gate itself
    /// (the interposer frees before any hook admits the call).
    pub fn free(&self, va: DevPtr) -> Result<(), EngineError> {
        let _gate = self.enter_op();
        let buf = self
            .inner
            .reg
            .read()
            .lookup(va)
            .filter(|b| b.va() == va)
            .cloned();
        let buf = buf.ok_or(EngineError::UnknownBuffer(va))?;
        let phase = self.inner.phase.read().clone();
        match phase {
            Phase::Checkpoint(s) => s.settle_before_free(&buf)?,
            Phase::Restore(s) => s.settle_before_free(&buf)?,
            Phase::Idle | Phase::Released | Phase::Detached => {}
        }
        // Every phase but idle is a session's, which tracks from its start.
        if self.tracking() {
            self.inner.freed_since_tracking.lock().insert(buf.id());
        }
        self.inner.reg.write().remove(va);
        match buf.residency() {
            Residency::Mapped => self.inner.dev.unmap(va, buf.mapped_size())?,
            // Its memory is kept elsewhere: mapped again only to be freed there.
            Residency::Detached => {
                self.inner.dev.reattach(va, buf.mapped_size())?;
                self.inner.dev.unmap(va, buf.mapped_size())?;
            }
            Residency::Released => {}
        }
        self.inner.dev.unreserve(va, buf.mapped_size())?;
        Ok(())
    }

    /// Whether a checkpoint, pre-copy round, release or restore is in progress (buffers may be
    /// released or being copied): one atomic load, for the launch path.
    pub fn session_active(&self) -> bool {
        self.inner.active.load(Ordering::Acquire)
    }

    /// The managed buffer containing `ptr`, if any.
    pub fn lookup(&self, ptr: DevPtr) -> Option<Buffer> {
        self.inner.reg.read().lookup(ptr).cloned()
    }

    /// All managed buffers, by address.
    pub fn buffers(&self) -> Vec<Buffer> {
        self.inner.reg.read().iter().cloned().collect()
    }

    /// The hook: call before enqueueing an operation of the job on `stream`; drop the guard after.
    /// Checks `access` whether or not the engine is tracking (see [`Engine::enter_op`]).
    pub fn before_op(
        &self,
        stream: &D::Stream,
        access: Access<'_>,
    ) -> Result<OpGuard<'_, D>, EngineError> {
        let guard = self.enter_op();
        guard.check(stream, access)?;
        Ok(guard)
    }

    /// The hook's first half: admits an operation (a session fixing T0 waits until it is
    /// enqueued). If [`OpGuard::tracking`], call [`OpGuard::check`] with its buffers; drop the
    /// guard once it is enqueued.
    pub fn enter_op(&self) -> OpGuard<'_, D> {
        self.inner.gate.enter();
        OpGuard { inner: &self.inner }
    }

    /// Waits until no operation admitted by [`Engine::enter_op`] is between its hook and its
    /// enqueue (the gate is closed for that wait, then opened). For a caller that holds the job
    /// from entering new operations: afterwards everything the job's hooks let in is on a stream.
    /// The caller must not be inside the gate itself.
    pub fn wait_ops_enqueued(&self) {
        self.inner.gate.close();
        self.inner.gate.open();
    }

    /// Whether operations' buffer sets are needed now (a session started and
    /// [`Engine::stop_tracking`] was not called since).
    pub fn tracking(&self) -> bool {
        self.inner.tracking.load(Ordering::SeqCst)
    }

    /// Starts tracking if it was off: then every buffer is marked written, since writes while it
    /// was off went unrecorded. Called before a session closes the gate.
    fn start_tracking(&self) {
        if !self.inner.tracking.swap(true, Ordering::SeqCst) {
            self.inner.freed_since_tracking.lock().clear();
            self.mark_all_dirty();
        }
    }

    /// Ends tracking (the session's restore is done, or its images were abandoned): operations
    /// need not be resolved for the engine until the next session. Refused while a session is
    /// in progress or buffers are released.
    pub fn stop_tracking(&self) -> Result<(), EngineError> {
        let p = self.inner.phase.read();
        match &*p {
            Phase::Idle => {
                self.inner.tracking.store(false, Ordering::SeqCst);
                self.inner.freed_since_tracking.lock().clear();
                Ok(())
            }
            other => Err(EngineError::Busy {
                wanted: "stop tracking",
                current: other.name(),
            }),
        }
    }

    fn start_session(&self, wanted: &'static str) -> Result<(), EngineError> {
        let p = self.inner.phase.read();
        match &*p {
            Phase::Idle => {
                self.start_tracking();
                Ok(())
            }
            other => Err(EngineError::Busy {
                wanted,
                current: other.name(),
            }),
        }
    }

    /// Begins a concurrent checkpoint into `sink`: fixes T0 now and returns while the background
    /// copier runs. With `only_dirty`, only buffers written since the last pre-copy round are taken
    /// (the sink already holds the others from earlier rounds).
    pub fn checkpoint(
        &self,
        sink: Arc<dyn ChunkSink>,
        only_dirty: bool,
    ) -> Result<CheckpointHandle, EngineError> {
        self.checkpoint_beside(sink, only_dirty, Beside::Job, None)
    }

    /// [`Engine::checkpoint`] for a caller that holds the job until the copy is over (a final
    /// copy: nothing of the job runs beside it): written by `held_writer_threads`, at the job's
    /// priority.
    pub fn checkpoint_held(
        &self,
        sink: Arc<dyn ChunkSink>,
        only_dirty: bool,
    ) -> Result<CheckpointHandle, EngineError> {
        self.checkpoint_held_with(sink, only_dirty, None)
    }

    /// [`Engine::checkpoint_held`] that hands each buffer it copies to `saver` (the keeper's
    /// spare image memory in possum), as a snapshot's shadows go: nothing writes the buffers
    /// while the job is held. A buffer of which only some chunks changed (by fingerprints) goes
    /// as those chunks ([`crate::store::ShadowSaver::save_chunks`]); what the saver refuses goes
    /// through the staging; every chunk saved must match its fingerprint at T0.
    pub fn checkpoint_held_with(
        &self,
        sink: Arc<dyn ChunkSink>,
        only_dirty: bool,
        saver: Option<Arc<dyn crate::store::ShadowSaver>>,
    ) -> Result<CheckpointHandle, EngineError> {
        self.checkpoint_beside(sink, only_dirty, Beside::Nothing, saver)
    }

    fn checkpoint_beside(
        &self,
        sink: Arc<dyn ChunkSink>,
        only_dirty: bool,
        beside: Beside,
        saver: Option<Arc<dyn crate::store::ShadowSaver>>,
    ) -> Result<CheckpointHandle, EngineError> {
        self.start_session("checkpoint")?;
        let mode = if only_dirty {
            CopyMode::CowDirty
        } else {
            CopyMode::Cow
        };
        CkptSession::begin(&self.inner, sink, mode, beside, saver)
    }

    /// [`Engine::checkpoint`] of every buffer that also copies, before it returns (the copies
    /// done), every buffer into a device-side shadow while the shadow budget
    /// ([`Engine::set_shadow_budget`]) allows:
    /// those buffers are saved as of T0 whatever the job does next, seen by the hooks or not
    /// (the rest by copy-on-write as usual). For a caller that holds the job until this returns
    /// (a kept checkpoint's save: the job is still paused).
    pub fn checkpoint_snapshot(
        &self,
        sink: Arc<dyn ChunkSink>,
    ) -> Result<CheckpointHandle, EngineError> {
        self.checkpoint_snapshot_with(sink, None)
    }

    /// [`Engine::checkpoint_snapshot`] whose shadows are saved by `saver` when given (the
    /// keeper's spare image memory), each through the staging should that fail.
    pub fn checkpoint_snapshot_with(
        &self,
        sink: Arc<dyn ChunkSink>,
        saver: Option<Arc<dyn crate::store::ShadowSaver>>,
    ) -> Result<CheckpointHandle, EngineError> {
        self.start_session("checkpoint")?;
        CkptSession::begin(
            &self.inner,
            sink,
            CopyMode::Cow,
            Beside::JobAfterSnapshot,
            saver,
        )
    }

    /// Marks the buffer holding `ptr` as written (someone the hooks do not see writes it: another
    /// process it is shared with), so that the next round or final copy takes it. `false`: no
    /// buffer there.
    pub fn mark_written(&self, ptr: DevPtr) -> bool {
        self.lookup(ptr).inspect(Buffer::mark_dirty).is_some()
    }

    /// Marks every buffer as written, so that the next pre-copy round (or `checkpoint(sink, true)`)
    /// takes all of them: needed before the first round into a new sink, since the dirty marks
    /// only say what changed since the last round, whichever sink that one went to. The
    /// fingerprints of what earlier rounds sent are forgotten too.
    pub fn mark_all_dirty(&self) {
        self.inner.reg.read().iter().for_each(Buffer::mark_dirty);
        self.inner.sent.lock().clear();
    }

    /// One pre-copy round: copies every buffer written since the previous round (all of them the
    /// first time) while the job runs, and returns when they are in the sink. Not a consistent image
    /// by itself: finish with `checkpoint(sink, true)`.
    pub fn precopy_round(&self, sink: Arc<dyn ChunkSink>) -> Result<RoundReport, EngineError> {
        self.start_session("pre-copy round")?;
        let h = CkptSession::begin(&self.inner, sink, CopyMode::Precopy, Beside::Job, None)?;
        let r = h.wait()?;
        let dirty_after = self
            .inner
            .reg
            .read()
            .iter()
            .filter(|b| b.is_dirty())
            .count();
        Ok(RoundReport {
            buffers: r.buffers,
            bytes: r.bytes,
            elapsed: r.elapsed,
            dirty_after,
            prints: Prints::of(&r),
            pipeline: r.pipeline,
        })
    }

    /// With `on`, the next checkpoints' T0 also waits for everything enqueued on the device, not
    /// only on the job streams the engine fences with events. For a caller that holds the job at
    /// T0 (nothing new is enqueued while it waits) whose job used streams an event recorded from
    /// another thread cannot fence: a thread's per-thread default stream (`CU_STREAM_PER_THREAD`).
    pub fn set_device_fence(&self, on: bool) {
        self.inner.device_fence.store(on, Ordering::SeqCst);
    }

    /// Sets the device memory the next checkpoints may use for shadow copies (copy-on-write by a
    /// device-to-device copy); 0 disables shadows.
    pub fn set_shadow_budget(&self, bytes: u64) {
        self.inner.shadow_budget.store(bytes, Ordering::SeqCst);
    }

    /// The order in which the job is predicted to write its buffers (ids, soonest first; from the
    /// analyzer's DAG): the next checkpoints copy those buffers first, in that order, and the
    /// others after them, so that a write the job makes soon finds its buffer saved already
    /// rather than waiting for a copy-on-write. Ids of no buffer are ignored.
    pub fn set_save_order(&self, ids: Vec<u64>) {
        *self.inner.save_order.lock() = ids;
    }

    /// The shadow budget the next checkpoints get ([`Engine::set_shadow_budget`]).
    pub fn shadow_budget(&self) -> u64 {
        self.inner.shadow_budget.load(Ordering::SeqCst)
    }

    /// Waits until the device is idle: the job's streams possum knows, then everything queued on
    /// the device by anyone. For a job whose operations possum does not see (no hooks), held at
    /// the CPU level: what it had queued must be done before its buffers are copied.
    pub fn synchronize_device(&self) -> Result<(), EngineError> {
        for s in self.inner.job_streams.read().iter() {
            self.inner.dev.synchronize(s)?;
        }
        self.inner.dev.synchronize_device()?;
        Ok(())
    }

    /// Drops the physical memory of every buffer, keeping addresses. The job must not be issuing
    /// operations; everything already enqueued on its streams is waited for. Returns bytes released.
    pub fn release(&self) -> Result<u64, EngineError> {
        self.start_session("release")?;
        self.inner.gate.close();
        let r = (|| {
            for s in self.inner.job_streams.read().iter() {
                self.inner.dev.synchronize(s)?;
            }
            let mut bytes = 0;
            for b in self.inner.reg.read().iter() {
                if b.residency() == Residency::Mapped {
                    self.inner.dev.unmap(b.va(), b.mapped_size())?;
                    b.set_residency(Residency::Released);
                    bytes += b.mapped_size();
                }
            }
            Ok(bytes)
        })();
        if r.is_ok() {
            self.inner.set_phase(Phase::Released);
            // Nothing of the memory's owner for a process dump to find.
            self.inner.dev.disconnect();
        }
        self.inner.gate.open();
        r
    }

    /// Detaches every buffer: unmapped in this process, its memory (contents intact) kept by the
    /// device's owner, a keeper ([`Device::keeps_memory`]), so that NVIDIA's driver checkpoint of
    /// the process has no buffer to copy. Waits for everything queued on the device first; the
    /// job must not be issuing operations (an operation touching a detached buffer fails). On a
    /// failure the buffers detached so far are attached again. Returns the bytes detached.
    pub fn detach(&self) -> Result<u64, EngineError> {
        self.detach_holding(0)
    }

    /// [`Engine::detach`], the memory kept `hold_secs` after this process is gone, for a restore
    /// of its image on this host ([`Device::begin_detach`]): a job checkpointed and then killed.
    pub fn detach_holding(&self, hold_secs: u64) -> Result<u64, EngineError> {
        if !self.inner.dev.keeps_memory() {
            return Err(DeviceError::Unsupported(
                "detach: the device's memory is this process's own",
            )
            .into());
        }
        self.start_session("detach")?;
        self.inner.gate.close();
        let r = (|| {
            self.synchronize_device()?;
            self.inner.dev.begin_detach(hold_secs);
            let mut bytes = 0;
            let reg = self.inner.reg.read();
            for b in reg.iter() {
                if b.residency() != Residency::Mapped {
                    continue;
                }
                if let Err(e) = self.inner.dev.detach(b.va(), b.mapped_size()) {
                    for d in reg.iter().filter(|d| d.residency() == Residency::Detached) {
                        if self.inner.dev.reattach(d.va(), d.mapped_size()).is_ok() {
                            d.set_residency(Residency::Mapped);
                        }
                    }
                    return Err(e.into());
                }
                b.set_residency(Residency::Detached);
                bytes += b.mapped_size();
            }
            Ok(bytes)
        })();
        if r.is_ok() {
            self.inner.set_phase(Phase::Detached);
            self.inner.dev.disconnect();
        }
        self.inner.gate.open();
        r
    }

    /// Maps every detached buffer again, contents as they were at [`Engine::detach`], and ends
    /// the detached phase. A failure leaves the rest detached (call it again). Returns the bytes
    /// attached.
    pub fn reattach(&self) -> Result<u64, EngineError> {
        self.expect_detached("reattach (buffers must be detached first)")?;
        let todo: Vec<Buffer> = self
            .inner
            .reg
            .read()
            .iter()
            .filter(|b| b.residency() == Residency::Detached)
            .cloned()
            .collect();
        // Each buffer's memory is asked of its owner and mapped again, independently of the
        // others: a few at a time (one after another, 16 buffers of 2 GiB took 104 ms on the
        // H100, while the job waited). The first failure stops the rest; those done stay mapped.
        let next = AtomicUsize::new(0);
        let failed: parking_lot::Mutex<Option<DeviceError>> = parking_lot::Mutex::new(None);
        let bytes = AtomicU64::new(0);
        let work = || loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(b) = todo.get(i) else { break };
            if failed.lock().is_some() {
                break;
            }
            match self.inner.dev.reattach(b.va(), b.mapped_size()) {
                Ok(()) => {
                    b.set_residency(Residency::Mapped);
                    bytes.fetch_add(b.mapped_size(), Ordering::Relaxed);
                }
                Err(e) => {
                    failed.lock().get_or_insert(e);
                }
            }
        };
        std::thread::scope(|s| {
            for _ in 1..todo.len().min(REATTACH_THREADS) {
                s.spawn(work);
            }
            work();
        });
        if let Some(e) = failed.into_inner() {
            return Err(e.into());
        }
        self.inner.set_phase(Phase::Idle);
        Ok(bytes.into_inner())
    }

    /// Frees the staging buffers (pinned host memory) once every one is back, waiting at most
    /// `timeout`; they are allocated again when copies need them. For a released job about to be
    /// dumped by CRIU: its image then does not carry them. Returns the bytes freed, `None` if a
    /// buffer was still out (nothing freed).
    pub fn park_staging(&self, timeout: Duration) -> Option<u64> {
        self.inner.pool.park(timeout)
    }

    /// Starts restoring released buffers from `source`: returns at once; operations that touch a
    /// buffer not yet back wait for exactly that buffer, the rest stream in in prefetch order.
    pub fn restore(&self, source: Arc<dyn ChunkSource>) -> Result<RestoreHandle, EngineError> {
        self.expect_released()?;
        RestoreSession::begin(&self.inner, source, None)
    }

    /// [`Engine::restore`] where the device's memory owner has prepared the buffers' memory and
    /// loads `source` into it itself ([`Staged`]): a staged buffer is mapped and waited for,
    /// not copied; one the owner does not load is copied from `source` as without staging.
    pub fn restore_staged(
        &self,
        source: Arc<dyn ChunkSource>,
        staged: Arc<dyn Staged>,
    ) -> Result<RestoreHandle, EngineError> {
        self.expect_released()?;
        RestoreSession::begin(&self.inner, source, Some(staged))
    }

    /// Gives up on the memory detached buffers had kept (the keeper no longer has it, or a
    /// restored job comes back from its image instead): every buffer becomes released, as after
    /// [`Engine::release`], for [`Engine::restore`] from an image. Buffers attached again
    /// meanwhile are released too. Only in the detached phase.
    pub fn drop_detached(&self) -> Result<(), EngineError> {
        self.expect_detached("drop detached buffers (they must be detached)")?;
        for b in self.inner.reg.read().iter() {
            match b.residency() {
                // The keeper may have lost it already: nothing more to free.
                Residency::Detached => {
                    let _ = self.inner.dev.forget(b.va(), b.mapped_size());
                }
                Residency::Mapped => self.inner.dev.unmap(b.va(), b.mapped_size())?,
                Residency::Released => {}
            }
            b.set_residency(Residency::Released);
        }
        self.inner.set_phase(Phase::Released);
        Ok(())
    }

    /// `Busy` unless every buffer is released (a restore's precondition).
    fn expect_released(&self) -> Result<(), EngineError> {
        let p = self.inner.phase.read();
        match &*p {
            Phase::Released => Ok(()),
            other => Err(EngineError::Busy {
                wanted: "restore (buffers must be released first)",
                current: other.name(),
            }),
        }
    }

    /// `Busy` (asking for `wanted`) unless every buffer is detached.
    fn expect_detached(&self, wanted: &'static str) -> Result<(), EngineError> {
        let p = self.inner.phase.read();
        match &*p {
            Phase::Detached => Ok(()),
            other => Err(EngineError::Busy {
                wanted,
                current: other.name(),
            }),
        }
    }

    /// The phase's name, as [`Stats::phase`] has it, without counting anything.
    pub fn phase(&self) -> &'static str {
        self.inner.phase.read().name()
    }

    /// Current counters.
    pub fn stats(&self) -> Stats {
        let reg = self.inner.reg.read();
        let c = &self.inner.counters;
        let (hook_blocked, total, max) = c.blocked.totals();
        Stats {
            buffers: reg.len(),
            bytes: reg.iter().map(Buffer::size).sum(),
            resident_bytes: reg
                .iter()
                .filter(|b| b.residency() == Residency::Mapped)
                .map(Buffer::mapped_size)
                .sum(),
            dirty_buffers: reg.iter().filter(|b| b.is_dirty()).count(),
            dirty_bytes: reg.iter().filter(|b| b.is_dirty()).map(Buffer::size).sum(),
            hook_calls: c.hook_calls.load(Ordering::Relaxed),
            hook_blocked,
            hook_blocked_ns: u64::try_from(total.as_nanos()).unwrap_or(u64::MAX),
            hook_blocked_max_ns: u64::try_from(max.as_nanos()).unwrap_or(u64::MAX),
            stream_waits: c.stream_waits.load(Ordering::Relaxed),
            phase: self.phase(),
            tracking: self.tracking(),
        }
    }
}

/// What a pre-copy round did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RoundReport {
    /// Buffers sent.
    pub buffers: usize,
    /// Bytes sent.
    pub bytes: u64,
    /// How long it took.
    pub elapsed: Duration,
    /// Buffers written again while the round ran (to send next round).
    pub dirty_after: usize,
    /// What the fingerprints decided.
    pub prints: Prints,
    /// Where its time went.
    pub pipeline: crate::Pipeline,
}

/// What a session's fingerprints decided (all zero without them).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Prints {
    /// Bytes fingerprinted on the device.
    pub fingerprinted_bytes: u64,
    /// How long that took.
    pub time: Duration,
    /// Bytes not copied: the sink held them already, proven equal.
    pub proven_bytes: u64,
    /// Bytes not copied: an earlier image holds them, referenced.
    pub reused_bytes: u64,
}

impl Prints {
    /// The figures of a checkpoint's report.
    pub fn of(r: &crate::CheckpointReport) -> Prints {
        Prints {
            fingerprinted_bytes: r.fingerprinted_bytes,
            time: r.fingerprint_time,
            proven_bytes: r.proven_bytes,
            reused_bytes: r.reused_bytes,
        }
    }
}
