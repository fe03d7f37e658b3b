//! What the engine shares with its checkpoint and restore sessions: the state behind an
//! [`Engine`](crate::Engine), the phase it is in, and what the hook asks of a session.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::config::EngineConfig;
use crate::device::Device;
use crate::error::EngineError;
use crate::fingerprint::Fingerprint;
use crate::gate::Gate;
use crate::registry::{Buffer, Registry};
use crate::session::BlockedTime;
use crate::staging::StagingPool;

/// Gives the calling thread the nice value `nice` (nothing for 0). A failure (a nice value the
/// process may not take) leaves the thread as it was: the work is the same, only scheduled
/// differently.
pub(crate) fn background_thread(nice: i32) {
    if nice != 0 {
        let tid = rustix::thread::gettid();
        if let Err(e) = rustix::process::setpriority_process(Some(tid), nice) {
            tracing::debug!("background thread keeps its nice value ({nice} refused: {e})");
        }
    }
}

/// Operations' buffer sets as the hook receives them.
#[derive(Clone, Copy, Debug)]
pub enum Access<'a> {
    /// The buffers read and written are known (a buffer both read and written is in `writes`).
    Known {
        /// Buffers read.
        reads: &'a [Buffer],
        /// Buffers written.
        writes: &'a [Buffer],
    },
    /// Unknown: treated as reading and writing every buffer.
    Opaque,
}

/// Counters, read with [`Engine::stats`](crate::Engine::stats).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub hook_calls: AtomicU64,
    pub blocked: BlockedTime,
    pub stream_waits: AtomicU64,
}

/// What the engine's hook asks of the session in progress (a checkpoint's or a restore's).
pub(crate) trait PhaseSession<D: Device>: Send + Sync {
    /// The hook during this session.
    fn before_op(&self, stream: &D::Stream, access: Access<'_>) -> Result<(), EngineError>;
    /// Called before buffer `buf` is freed, while this session may still need its bytes.
    fn settle_before_free(&self, buf: &Buffer) -> Result<(), EngineError>;
}

/// What the engine is doing; a session's phase holds the session, which the hook consults.
pub(crate) enum Phase<D: Device> {
    Idle,
    Checkpoint(Arc<dyn PhaseSession<D>>),
    Released,
    /// Every buffer detached: its memory kept, contents intact, by the device's owner.
    Detached,
    Restore(Arc<dyn PhaseSession<D>>),
}

impl<D: Device> Phase<D> {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::Checkpoint(_) => "checkpoint",
            Phase::Released => "released",
            Phase::Detached => "detached",
            Phase::Restore(_) => "restore",
        }
    }
}

impl<D: Device> Clone for Phase<D> {
    fn clone(&self) -> Self {
        match self {
            Phase::Idle => Phase::Idle,
            Phase::Checkpoint(s) => Phase::Checkpoint(Arc::clone(s)),
            Phase::Released => Phase::Released,
            Phase::Detached => Phase::Detached,
            Phase::Restore(s) => Phase::Restore(Arc::clone(s)),
        }
    }
}

/// `repr(C)`, aligned: what every operation touches (the gate, `active`, `tracking`) comes first,
/// on one cache line.
#[repr(C, align(64))]
pub(crate) struct Inner<D: Device> {
    pub gate: Gate,
    /// `phase` is not Idle: the only thing the hook reads when nothing is going on.
    pub active: AtomicBool,
    /// Operations' buffer sets are needed (see the protocol in the engine module's doc).
    pub tracking: AtomicBool,
    /// T0 also waits for the whole device ([`Engine::set_device_fence`](crate::Engine::set_device_fence)).
    pub device_fence: AtomicBool,
    /// Shadow memory a checkpoint may use ([`Engine::set_shadow_budget`](crate::Engine::set_shadow_budget); starts as the config's).
    pub shadow_budget: AtomicU64,
    pub dev: Arc<D>,
    pub cfg: EngineConfig,
    pub reg: RwLock<Registry>,
    pub job_streams: RwLock<Vec<D::Stream>>,
    pub phase: RwLock<Phase<D>>,
    /// Buffers the job freed while a checkpoint was being made (tracking on): its image may hold
    /// them (copied before the free, as of T0), and the job no longer has them. A restore skips
    /// them. Cleared when tracking stops (the restore is done) or starts again.
    pub freed_since_tracking: parking_lot::Mutex<std::collections::HashSet<u64>>,
    /// Buffer ids in the order the job is predicted to write them ([`Engine::set_save_order`](crate::Engine::set_save_order)).
    pub save_order: parking_lot::Mutex<Vec<u64>>,
    pub pool: Arc<StagingPool<D>>,
    pub copy_streams: Vec<D::Stream>,
    pub prio: D::Stream,
    pub counters: Arc<Counters>,
    /// What the current series of sessions (one sink: pre-copy rounds and their final copy)
    /// holds of each buffer: the fingerprint of the bytes last written of each chunk, by buffer
    /// id. Forgotten with [`Engine::mark_all_dirty`](crate::Engine::mark_all_dirty) (a new sink) and by a session over every
    /// buffer (a new image).
    pub sent: Arc<parking_lot::Mutex<SentPrints>>,
    /// Whether the device fingerprints (the config asks for it and the device has not said
    /// it cannot).
    pub fingerprints: AtomicBool,
}

/// The fingerprints of what a sink holds, by buffer id, one per chunk (`None`: not sent).
pub(crate) type SentPrints = std::collections::HashMap<u64, Vec<Option<Fingerprint>>>;

impl<D: Device> Inner<D> {
    pub(crate) fn set_phase(&self, p: Phase<D>) {
        let mut g = self.phase.write();
        self.active
            .store(!matches!(p, Phase::Idle), Ordering::Release);
        *g = p;
    }

    /// Fences every job stream now and makes the engine's own streams wait for the fences.
    /// Called with the gate closed.
    pub(crate) fn fence_job_streams(&self) -> Result<(), EngineError> {
        if self.device_fence.load(Ordering::SeqCst) {
            // Work on streams the engine cannot fence from this thread (a thread's per-thread
            // default stream) is done before T0: the caller holds the job, nothing new comes.
            self.dev.synchronize_device()?;
        }
        let streams = self.job_streams.read();
        for s in streams.iter() {
            let ev = self.dev.record_event(s)?;
            for own in self.copy_streams.iter().chain(std::iter::once(&self.prio)) {
                self.dev.wait_event(own, &ev)?;
            }
        }
        Ok(())
    }
}
