//! The interposer's state inside the job: one engine per device (created at the first managed
//! allocation), the allocations possum does not manage, the kernel models, the job's streams and
//! instantiated graphs, the DAG, and the counters the statistics report.
//!
//! Locks on the launch path are read locks, except the DAG's mutex (held for the few
//! microseconds of one record; `POSSUM_DAG=0` turns recording off) and first sightings (a new
//! kernel, stream or context), which take a write lock once.

use std::cell::RefCell;
// Keys are handles and ids: the fast hash.
use rustc_hash::FxHashMap as HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock};
use possum_analyzer::dag::{Dag, KernelRef};
use possum_analyzer::intervals::IntervalMap;
use possum_analyzer::kernel::KernelModel;
use possum_analyzer::layout::{Param, ParamLayout};
use possum_cuda::introspect::{self, GraphNode};
use possum_cuda::{CudaDevice, CudaStream, PinnedBuf};
use possum_engine::device::{DevPtr, DeviceError};
use possum_engine::fingerprint::Fingerprint;
use possum_engine::registry::Residency;
use possum_engine::{Engine, EngineConfig};
use serde_json::{json, Value};

use crate::base::config::Config;
use crate::memory::ranges::{Ranges, Resolved};
use crate::ops::thread_state::ThreadState;
use crate::process::dag::{DagMsg, DagOp, DagSets, SetsRef};

/// The socket of device `ordinal`'s keeper, if `POSSUM_KEEPER` names a keeper's directory.
pub fn keeper_socket(ordinal: usize) -> Option<std::path::PathBuf> {
    let dir = crate::base::config::get().user.keeper.as_deref()?;
    Some(possum_keeper::socket_of(dir, ordinal))
}

/// The keeper of device `ordinal`'s memory, if `POSSUM_KEEPER` names a keeper's directory
/// (`possum run` sets it unless `--no-keeper`). One that cannot be reached is logged and the job goes on without it.
fn keeper_of(ordinal: usize) -> Option<Arc<possum_keeper::KeeperMemory>> {
    let path = keeper_socket(ordinal)?;
    match possum_keeper::KeeperMemory::connect(&path) {
        Ok(k) => {
            crate::base::log::log(&format!(
                "device {ordinal}: buffer memory kept by the keeper at {}",
                path.display()
            ));
            Some(Arc::new(k))
        }
        Err(e) => {
            crate::base::log::log(&format!(
                "device {ordinal}: no keeper ({e}); buffer memory is the job's own, so a \
                 checkpoint copies it while the job is held"
            ));
            None
        }
    }
}

/// A device's engine and the job streams it knows.
#[derive(Debug)]
pub struct DevEngine {
    /// The device ordinal.
    pub ordinal: usize,
    /// The engine.
    pub engine: Engine<CudaDevice>,
    streams: RwLock<HashMap<u64, CudaStream>>,
    /// Bumped whenever a stream is forgotten: a thread's cached stream ([`Self::with_stream`]) is
    /// good while this is unchanged.
    streams_epoch: AtomicU64,
    /// Validation's reads: a pinned bounce buffer and a stream of possum's, made at the first
    /// validation ([`crate::ops::validate`]).
    pub validation_io: Mutex<Option<(PinnedBuf, CudaStream)>>,
    /// possum's stream that waits for the work the job left on the streams it destroyed
    /// ([`Self::retire_stream`]), made at the first such destruction.
    retired: Mutex<Option<CudaStream>>,
    /// The keeper the engine's buffer memory comes from (the device's owner), if any.
    pub keeper: Option<Arc<possum_keeper::KeeperMemory>>,
}

impl DevEngine {
    /// The engine's wrapper of the job's stream `raw`, registering it (for T0 fences) on first
    /// sight. The per-thread default stream is not registered: a fence recorded on it from
    /// another thread would land on that thread's own per-thread stream.
    pub fn stream(&self, raw: u64) -> CudaStream {
        if let Some(s) = self.streams.read().get(&raw) {
            return s.clone();
        }
        // Possum's own driver calls, if wrapping the stream makes any.
        let _r = Reentry::enter();
        let mut w = self.streams.write();
        w.entry(raw)
            .or_insert_with(|| {
                let s = crate::cuda::decode::job_stream(self.engine.device(), raw);
                if raw != crate::cuda::decode::STREAM_PER_THREAD {
                    self.engine.register_stream(s.clone());
                }
                s
            })
            .clone()
    }

    /// Calls `f` with the engine's wrapper of the job's stream `raw` ([`Self::stream`]), from the
    /// one-entry cache of the calling thread (whose state is `t`) when it is the stream of its
    /// last operation (the launch path's way: no lock, no reference count).
    #[inline]
    pub fn with_stream<R>(&self, t: &ThreadState, raw: u64, f: impl FnOnce(&CudaStream) -> R) -> R {
        let key = (
            self.ordinal,
            raw,
            self.streams_epoch.load(Ordering::Acquire),
        );
        // Borrowed already only if `f` of an outer call operates on streams: then uncached.
        let Ok(mut c) = t.stream.try_borrow_mut() else {
            return f(&self.stream(raw));
        };
        if c.is_none() || t.stream_key.get() != key {
            *c = Some(self.stream(raw));
            t.stream_key.set(key);
        }
        f(c.as_ref().expect("just filled"))
    }

    /// Registers the job's stream `raw` ([`Self::stream`]) unless it is the last one the calling
    /// thread (whose state is `t`) operated on: then it is registered already.
    #[inline]
    pub fn note_stream(&self, t: &ThreadState, raw: u64) {
        let key = (
            self.ordinal,
            raw,
            self.streams_epoch.load(Ordering::Acquire),
        );
        if t.stream_key.get() != key {
            self.note_stream_slow(t, raw);
        }
    }

    #[cold]
    #[inline(never)]
    fn note_stream_slow(&self, t: &ThreadState, raw: u64) {
        self.with_stream(t, raw, |_| ());
    }

    /// The job is destroying its stream `raw`; work queued on it still runs. A T0 after this must
    /// wait for that work as it would have while the stream lived: an event recorded on the
    /// stream now is waited for by possum's retirement stream (registered as a job stream, so
    /// every T0 fences it), and only then is the stream forgotten. If the event cannot be had,
    /// the stream is synchronised instead; if that fails too, the error is returned (the caller
    /// fails the checkpoint open now, if any) and the stream is still forgotten (it is going).
    pub fn retire_stream(&self, raw: u64) -> Result<(), RetireError> {
        use possum_engine::device::{Device, StreamPriority};
        if !self.streams.read().contains_key(&raw) {
            // Never used by a hooked operation: nothing of the job's to fence.
            self.forget_stream(raw);
            return Ok(());
        }
        let _r = Reentry::enter();
        let dev = self.engine.device();
        let job = self.stream(raw);
        let fenced = (|| -> Result<(), DeviceError> {
            let mut retired = self.retired.lock();
            if retired.is_none() {
                let s = dev.create_stream(StreamPriority::Normal)?;
                self.engine.register_stream(s.clone());
                *retired = Some(s);
            }
            let ev = dev.record_event(&job)?;
            let retired = retired.as_ref().expect("just made");
            dev.wait_event(retired, &ev)
        })();
        let r = fenced.or_else(|fence| {
            dev.synchronize(&job)
                .map_err(|sync| RetireError { fence, sync })
        });
        if let Some(st) = state_if_created() {
            st.counters.streams_retired.fetch_add(1, Ordering::Relaxed);
        }
        self.forget_stream(raw);
        r
    }

    /// Forgets the job's stream `raw` (it is being destroyed).
    pub fn forget_stream(&self, raw: u64) {
        self.streams_epoch.fetch_add(1, Ordering::AcqRel);
        if self.streams.write().remove(&raw).is_some() {
            self.engine
                .unregister_streams(|s| s.raw() as usize as u64 == raw);
        }
    }
}

/// An allocation possum does not manage (the driver's checkpoint covers it).
#[derive(Debug, Clone, Copy)]
pub struct Unmanaged {
    /// Which call made it.
    pub kind: &'static str,
}

/// A graph node, as captured when its graph was instantiated.
#[derive(Debug)]
pub enum SnapNode {
    /// A kernel node: its model and the words of its pointer slots.
    Kernel {
        /// The kernel's model.
        model: Arc<KernelModel>,
        /// The slots' words (as `model.slots()`).
        words: Vec<u64>,
    },
    /// A memset node.
    Memset {
        /// Destination.
        dst: u64,
    },
}

/// An instantiated graph as possum knows it.
#[derive(Debug)]
pub struct GraphSnap {
    /// Its nodes (kernels and memsets).
    pub nodes: Vec<SnapNode>,
    /// Why its launches are treated as touching every buffer, if they are.
    pub opaque: Option<String>,
}

macro_rules! counters {
    ($($name:ident: $doc:literal),* $(,)?) => {
        /// Counters the statistics report (`repr(C)`: in this order, the launch path's first).
        #[derive(Debug, Default)]
        #[repr(C)]
        pub struct Counters { $(#[doc = $doc] pub $name: AtomicU64,)* }
        impl Counters {
            fn to_json(&self) -> Value {
                let mut m = serde_json::Map::new();
                $(m.insert(stringify!($name).into(), self.$name.load(Ordering::Relaxed).into());)*
                Value::Object(m)
            }
        }
    };
}

counters! {
    launches: "Kernel launches analysed (not counting captured ones).",
    launches_hooked: "Launches admitted by a device engine (possum manages allocations on their device).",
    launches_examined: "Launches whose buffers were looked at (memo or resolution): all with POSSUM_RESOLVE=always; else those while a checkpoint was open, in sampling windows, and validated ones. The launches_identified share is of these.",
    launches_identified: "Launches of non-opaque kernels that named no allocation unknown to possum (unknown ones are looked for on validated launches only).",
    validated_launches_identified: "Validated launches of non-opaque kernels whose every parameter word the driver knows as a device address was in an allocation possum tracked.",
    launches_unmanaged: "Launches that touched an allocation possum does not manage.",
    launches_opaque: "Launches of opaque kernels (never-validated kernels while a checkpoint was open included).",
    launches_unvalidated: "Launches, while a checkpoint was open, of kernels no validation had checked yet (first seen then, validation off or failed): treated as touching every buffer.",
    pointer_words: "Parameter words that named an allocation.",
    captured_launches: "Launches (and copies, memsets) captured into a graph rather than run.",
    graph_launches: "Graph launches.",
    graph_nodes_expanded: "Kernel and memset nodes of launched graphs, each counted per launch.",
    graph_launches_opaque: "Graph launches treated as touching every buffer.",
    copies: "Copies hooked.",
    memsets: "Memsets hooked.",
    opaque_ops: "Copies possum does not decode (2D/3D/batched), treated as touching every buffer.",
    per_thread_stream_ops: "Operations on the per-thread default stream.",
    validations: "Validated launches.",
    validation_ns: "Time spent validating (both sides of each launch).",
    validation_errors: "Validations abandoned because a read failed.",
    validation_sync_ns: "Of validation_ns: waiting for the device before each side.",
    validation_fingerprint_ns: "Of validation_ns: buffers fingerprinted on the device.",
    validation_fingerprint_bytes: "Bytes fingerprinted on the device by validations.",
    validation_host_ns: "Of validation_ns: buffers and windows read to the host.",
    validation_host_bytes: "Bytes read to the host by validations.",
    kernels_made_opaque: "Kernels a validation made opaque.",
    managed_allocs: "cudaMalloc (and cuMemAlloc_v2, cuMemAllocPitch_v2, cuMemMap of possum's handles) calls served by the engine.",
    managed_frees: "cudaFree (and cuMemFree_v2) calls of engine buffers.",
    fallback_allocs: "Allocation calls passed to libcudart or the driver.",
    unmanaged_allocs: "Allocations possum does not manage (seen through CUPTI, or found by the driver).",
    discovered_allocs: "Allocations no hook saw, found by asking the driver about a parameter word (validated launches).",
    launches_discovered: "Validated launches that named an allocation no hook saw (found by the driver then).",
    hook_errors: "Hook calls the engine refused (the operation ran anyway; a checkpoint open then is not committed).",
    streams_retired: "Job streams destroyed: the work queued on each is fenced by a stream of possum's that waits for it.",
    memo_hits: "Launches whose buffer sets came from an earlier launch of the kernel with the same words.",
    timed_launches: "Launches whose time in possum's callbacks (entry and exit) was measured (1 in 16).",
    timed_launch_ns: "Time those launches spent in possum's callbacks (validation excluded).",
    dag_dropped: "DAG records dropped because the DAG thread was behind.",
    modules_parsed: "Loaded modules whose .nv.info parameter layouts were read.",
    modules_unparsed: "Loaded modules whose image is not a cubin possum reads (skipped).",
    layouts_from_cubin: "Kernels whose parameter layout came from a module's .nv.info (the driver gave none).",
}

/// The process-wide state. `repr(C)`, aligned: what every launch touches (`captures`, `dag_gap`,
/// the first counters) comes first, on one cache line.
#[derive(Debug)]
#[repr(C, align(64))]
pub struct State {
    /// Streams being captured now (anywhere in the process).
    pub captures: AtomicU64,
    /// Operations went unresolved since the last DAG launch record ([`State::note_unresolved`]).
    dag_gap: AtomicBool,
    /// Counters.
    pub counters: Counters,
    /// The settings: a copy of [`crate::base::config::get`]'s, inline, so that the launch path reads
    /// them from the state's own lines.
    pub cfg: Config,
    /// Per device ordinal, its engine once made (never removed: the launch path reads it without
    /// a lock or a reference count). Made under `engines_made`.
    engines: Box<[OnceLock<Arc<DevEngine>>]>,
    engines_made: Mutex<()>,
    /// Every engine made so far proves its images by content (and there is one): read-only
    /// speculation may be earned ([`State::validation`]).
    proven: AtomicBool,
    /// Device ordinals (below 64) the job's operations ran on, whether possum manages memory
    /// there or not: a checkpoint's T0 waits for the work queued on each
    /// ([`State::devices_used`]). Set where a thread's context is resolved anew (not per
    /// operation).
    devices_used: AtomicU64,
    managing_off: Mutex<Option<String>>,
    managing_disabled: AtomicBool,
    unmanaged: RwLock<IntervalMap<Unmanaged>>,
    /// Live handles of memory another process shared (`cuMemImportFromShareableHandle`).
    imported: parking_lot::Mutex<std::collections::HashSet<u64>>,
    kernels: RwLock<HashMap<u64, Arc<KernelModel>>>,
    /// Parameter layouts from the `.nv.info` of loaded modules, by kernel (mangled) name: the
    /// fallback where the driver gives none.
    cubin_layouts: RwLock<std::collections::HashMap<String, ParamLayout>>,
    graphs: RwLock<HashMap<u64, Arc<GraphSnap>>>,
    /// The DAG. Launches reach it through `dag_tx` and the `possum-dag` thread, off the launch
    /// path.
    dag: Mutex<DagSide>,
    /// Ids of memo entries' DAG sets ([`DagMsg::Define`]).
    dag_ids: AtomicU64,
    dag_tx: Option<crossbeam_channel::Sender<Vec<DagMsg>>>,
    dag_rx: crossbeam_channel::Receiver<Vec<DagMsg>>,
    /// Emptied batches, back from the DAG thread for the launch path to refill: a batch is
    /// allocated (and its pages faulted in) once, not per send.
    dag_pool: (
        crossbeam_channel::Sender<Vec<DagMsg>>,
        crossbeam_channel::Receiver<Vec<DagMsg>>,
    ),
    /// Bumped whenever the set of allocations changes: buffer sets cached per kernel
    /// (`hooks`) are stale when it differs.
    generation: AtomicU64,
    /// The snapshot launches resolve against, and whether it is out of date.
    ranges: RwLock<Arc<Ranges>>,
    ranges_stale: AtomicBool,
    /// 2 MiB pages of pointer-like words the driver said are no allocation (cleared whenever an
    /// allocation appears), so each is asked about once.
    not_device: RwLock<std::collections::HashSet<u64>>,
    /// What validations learned and keep (`ops::validate`).
    pub validation_memo: ValidationMemo,
}

/// A destroyed stream's work could not be fenced: neither waited for on possum's retirement
/// stream nor synchronised.
#[derive(Debug, thiserror::Error)]
#[error("{fence}; synchronising it: {sync}")]
pub struct RetireError {
    /// Why the fence failed.
    pub fence: DeviceError,
    /// Why the synchronisation failed.
    pub sync: DeviceError,
}

/// Why a device's engine could not be had.
#[derive(Debug, thiserror::Error)]
pub enum EngineStartError {
    /// Possum stopped serving allocations, for this reason.
    #[error("{0}")]
    ManagingOff(String),
    /// A device beyond those possum manages.
    #[error("device {0}: possum manages devices 0 to {max} only", max = MAX_DEVICES - 1)]
    Unmanaged(usize),
    /// The CUDA runtime's initialisation failed with this error.
    #[error("the CUDA runtime failed to initialise (error {0})")]
    Init(i32),
    /// The device could not be opened.
    #[error(transparent)]
    Device(DeviceError),
    /// The engine could not be made over it.
    #[error(transparent)]
    Engine(possum_engine::EngineError),
}

/// What validations learn once and keep (`ops::validate` acts on it).
#[derive(Debug, Default)]
pub struct ValidationMemo {
    /// Set once the device is found unable to fingerprint at all (`Unsupported`: a driver
    /// without the kernel's entry points): whole buffers are read to the host from then on.
    pub no_device_fingerprints: AtomicBool,
    /// The fingerprints of `len` bytes of value `b`, by `(b, len)`, the latest kept.
    pub uniform: Mutex<Vec<((u8, u64), Fingerprint)>>,
}

static STATE: OnceLock<State> = OnceLock::new();

/// Kernel layouts kept from loaded modules at most (a layout is a few dozen bytes).
pub const MAX_CUBIN_LAYOUTS: usize = 1 << 18;

/// Device ordinals possum can manage (0 to this minus one).
pub const MAX_DEVICES: usize = 64;

/// The state, if anything has needed it yet.
pub fn state_if_created() -> Option<&'static State> {
    STATE.get()
}

/// What runs once the state is made: the control socket's start (registered by the set-up, which
/// sits above the socket's handlers).
static ON_CREATED: OnceLock<fn()> = OnceLock::new();

/// Runs `f` whenever the state's creation is asked for (the first callers; it must be idempotent).
pub fn on_created(f: fn()) {
    let _ = ON_CREATED.set(f);
}

/// The state, created on first use (which also runs [`on_created`]'s function: the control
/// socket).
pub fn state() -> &'static State {
    if let Some(s) = STATE.get() {
        return s;
    }
    let s = STATE.get_or_init(|| {
        let cfg = crate::base::config::get().clone();
        let window = cfg.tuning.dag_window;
        let (tx, rx) = crossbeam_channel::bounded(DAG_QUEUE);
        let dag_tx = cfg.tuning.dag.then_some(tx);
        State {
            dag_tx,
            dag_rx: rx,
            dag_pool: crossbeam_channel::bounded(DAG_POOL),
            generation: AtomicU64::new(0),
            cfg,
            engines: (0..MAX_DEVICES).map(|_| OnceLock::new()).collect(),
            engines_made: Mutex::new(()),
            proven: AtomicBool::new(false),
            devices_used: AtomicU64::new(0),
            managing_off: Mutex::new(None),
            managing_disabled: AtomicBool::new(false),
            unmanaged: RwLock::new(IntervalMap::new()),
            imported: parking_lot::Mutex::new(std::collections::HashSet::new()),
            kernels: RwLock::new(HashMap::default()),
            cubin_layouts: RwLock::new(std::collections::HashMap::new()),
            graphs: RwLock::new(HashMap::default()),
            captures: AtomicU64::new(0),
            dag: Mutex::new(DagSide {
                dag: Dag::new(window),
                sets: HashMap::default(),
            }),
            dag_ids: AtomicU64::new(1),
            dag_gap: AtomicBool::new(false),
            counters: Counters::default(),
            ranges: RwLock::new(Arc::new(Ranges::default())),
            ranges_stale: AtomicBool::new(false),
            not_device: RwLock::new(std::collections::HashSet::new()),
            validation_memo: ValidationMemo::default(),
        }
    });
    static DAG_THREAD: std::sync::Once = std::sync::Once::new();
    if s.dag_tx.is_some() {
        DAG_THREAD.call_once(|| {
            let rx = s.dag_rx.clone();
            let _ = std::thread::Builder::new()
                .name("possum-dag".into())
                .spawn(move || loop {
                    // Polls rather than blocking in `recv`: a sender then never has to wake this
                    // thread (a futex call per launch on the job's launch path).
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    if rx.is_empty() {
                        continue;
                    }
                    s.apply_batches(&mut s.dag.lock(), rx.try_iter().take(DAG_QUEUE));
                });
        });
    }
    if let Some(f) = ON_CREATED.get() {
        f();
    }
    s
}

/// Batches queued for the DAG before further ones are dropped (and counted).
const DAG_QUEUE: usize = 1 << 10;

/// Emptied batches kept for reuse.
const DAG_POOL: usize = 64;

/// Records a thread batches before sending them to the DAG thread. The DAG can lag behind a
/// thread by this many launches (a trace flushes the asking thread's batch only).
const DAG_BATCH: usize = 256;

/// A thread's unsent DAG records; sent when full and when the thread exits.
struct DagBatch(Vec<DagMsg>);

impl Drop for DagBatch {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            if let Some(st) = state_if_created() {
                st.send_dag(std::mem::take(&mut self.0));
            }
        }
    }
}

thread_local! {
    static DAG_BATCH_TLS: RefCell<DagBatch> = const { RefCell::new(DagBatch(Vec::new())) };
}

/// Sends the calling thread's unsent DAG records.
pub fn flush_dag() {
    let b = DAG_BATCH_TLS
        .try_with(|b| std::mem::take(&mut b.borrow_mut().0))
        .unwrap_or_default();
    if let (false, Some(st)) = (b.is_empty(), state_if_created()) {
        st.send_dag(b);
    }
}

/// What the `possum-dag` thread holds: the DAG and the memo entries' sets by id.
#[derive(Debug)]
pub struct DagSide {
    dag: Dag,
    sets: HashMap<u64, Arc<DagSets>>,
}

fn apply(st: &State, side: &mut DagSide, m: DagMsg) {
    let dag = &mut side.dag;
    match m {
        DagMsg::Launch { op, stream, sets } => {
            let sets = match sets {
                SetsRef::Once(s) => s,
                // Unknown when its definition was in a dropped batch (counted there).
                SetsRef::Memo(id) => match side.sets.get(&id) {
                    Some(s) => s.clone(),
                    None => return,
                },
            };
            // A kernel the DAG knows needs no look-up (its opaqueness comes as `Opaque`).
            let model = match op {
                DagOp::Kernel(h) if !dag.knows_kernel(h) => st.kernels.read().get(&h).cloned(),
                _ => None,
            };
            let k = match (&op, &model) {
                (DagOp::Kernel(h), m) => KernelRef {
                    handle: *h,
                    name: m.as_ref().and_then(|m| m.name()),
                    opaque: m.as_ref().is_some_and(|m| m.is_opaque()),
                },
                (DagOp::Memcpy, _) => KernelRef::MEMCPY,
                (DagOp::Memset, _) => KernelRef::MEMSET,
            };
            dag.record_launch(&k, stream, &sets.reads, &sets.writes);
        }
        DagMsg::Define { id, sets } => {
            side.sets.insert(id, sets);
        }
        DagMsg::Forget(id) => {
            side.sets.remove(&id);
        }
        DagMsg::Free(id) => dag.record_free(id),
        DagMsg::Opaque(h) => dag.set_kernel_opaque(h),
        DagMsg::Gap => dag.record_gap(),
    }
}

/// Marks the calling thread as inside possum until dropped.
#[derive(Debug)]
pub struct Reentry(bool);

impl Reentry {
    /// Enters (nesting is fine).
    pub fn enter() -> Reentry {
        Reentry(crate::ops::thread_state::flags(|t| {
            t.in_possum.replace(true)
        }))
    }
}

impl Drop for Reentry {
    fn drop(&mut self) {
        crate::ops::thread_state::flags(|t| t.in_possum.set(self.0));
    }
}

impl State {
    /// The engine of device `ordinal`, if possum manages allocations there.
    pub fn engine(&self, ordinal: usize) -> Option<Arc<DevEngine>> {
        self.engine_ref(ordinal).cloned()
    }

    /// [`Self::engine`] borrowed: no lock, no reference count (the launch path's way).
    pub fn engine_ref(&self, ordinal: usize) -> Option<&Arc<DevEngine>> {
        self.engines.get(ordinal).and_then(OnceLock::get)
    }

    /// Every engine made, borrowed (nothing allocated).
    pub fn engine_refs(&self) -> impl Iterator<Item = &Arc<DevEngine>> {
        self.engines.iter().filter_map(OnceLock::get)
    }

    /// How validation runs and what it may conclude: the configured `POSSUM_VALIDATE` where every
    /// engine proves its images by content, else the same made strict (no read-only
    /// speculation: without the proof a wrong one would reach an image).
    pub fn validation(&self) -> &possum_analyzer::kernel::ValidationConfig {
        if self.proven.load(Ordering::Acquire) {
            &self.cfg.tuning.validation
        } else {
            &self.cfg.tuning.validation_strict
        }
    }

    /// Every engine.
    pub fn engines(&self) -> Vec<Arc<DevEngine>> {
        self.engines
            .iter()
            .filter_map(OnceLock::get)
            .cloned()
            .collect()
    }

    /// The engine of device `ordinal`, created if needed (`init` first initialises the runtime's
    /// context there). `Err` says why possum cannot manage allocations (then it stops trying).
    pub fn engine_or_create(
        &self,
        ordinal: usize,
        init: impl FnOnce() -> i32,
    ) -> Result<Arc<DevEngine>, EngineStartError> {
        if let Some(e) = self.engine(ordinal) {
            return Ok(e);
        }
        if self.managing_disabled.load(Ordering::Relaxed) {
            let why = self.managing_off.lock().clone().unwrap_or_default();
            return Err(EngineStartError::ManagingOff(why));
        }
        let Some(cell) = self.engines.get(ordinal) else {
            return Err(EngineStartError::Unmanaged(ordinal));
        };
        let _made = self.engines_made.lock();
        if let Some(e) = cell.get() {
            return Ok(e.clone());
        }
        let made = (|| {
            let r = init();
            if r != 0 {
                return Err(EngineStartError::Init(r));
            }
            let dev = CudaDevice::new(ordinal).map_err(EngineStartError::Device)?;
            let keeper = keeper_of(ordinal);
            let dev = match &keeper {
                Some(k) => dev.with_owner(k.clone()),
                None => dev,
            };
            let chunk = (self.cfg.tuning.chunk_mib as usize) << 20;
            let cfg = EngineConfig {
                chunk_size: chunk,
                staging_buffers: ((self.cfg.tuning.staging_mib << 20) / chunk as u64) as usize,
                writer_threads: self.cfg.tuning.writers(),
                held_writer_threads: self.cfg.tuning.held_writers(),
                restore_threads: self.cfg.tuning.restorers,
                background_nice: self.cfg.tuning.background_nice,
                fingerprints: self.cfg.tuning.fingerprints,
                ..EngineConfig::default()
            };
            Engine::new(Arc::new(dev), cfg)
                .map(|e| (e, keeper))
                .map_err(EngineStartError::Engine)
        })();
        match made {
            Ok((engine, keeper)) => {
                let de = Arc::new(DevEngine {
                    ordinal,
                    engine,
                    streams: RwLock::new(HashMap::default()),
                    streams_epoch: AtomicU64::new(0),
                    validation_io: Mutex::new(None),
                    retired: Mutex::new(None),
                    keeper,
                });
                let _ = cell.set(de.clone());
                crate::base::log::log(&format!(
                    "device {ordinal}: allocations are served by the engine"
                ));
                let proven = self.engines().iter().all(|e| e.engine.proves_by_content());
                if !proven && self.cfg.tuning.validation.readonly_after > 0 {
                    crate::base::log::log(&format!(
                        "device {ordinal}: no fingerprints, so no read-only speculation (its \
                         images could not be proven)"
                    ));
                }
                self.proven.store(proven, Ordering::Release);
                Ok(de)
            }
            Err(why) => {
                self.disable_managing(format!("device {ordinal}: {why}"));
                Err(why)
            }
        }
    }

    /// Stops serving allocations from the engine, for `why` (logged once).
    pub fn disable_managing(&self, why: String) {
        crate::base::log::log(&format!(
            "allocations are left to libcudart from now on: {why}"
        ));
        *self.managing_off.lock() = Some(why);
        self.managing_disabled.store(true, Ordering::Relaxed);
    }

    /// Whether `cudaMalloc` should be tried on the engine.
    pub fn managing(&self) -> bool {
        self.cfg.user.manage && !self.managing_disabled.load(Ordering::Relaxed)
    }

    /// Notes that allocations changed (`added`: one appeared, else one went away).
    pub fn allocations_changed(&self, added: bool) {
        if added {
            self.not_device.write().clear();
        }
        // Stale first, then the new generation: a thread that sees the new generation then sees
        // the snapshot stale (or already rebuilt with the change), so a snapshot it caches under
        // that generation (the launch path does) has the change.
        self.ranges_stale.store(true, Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The allocation generation (see the field).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// A fresh id for a memo entry's DAG sets.
    pub fn next_dag_id(&self) -> u64 {
        self.dag_ids.fetch_add(1, Ordering::Relaxed)
    }

    /// Queues `m` for the DAG: in the calling thread's batch, sent when full (dropped, and
    /// counted, if the DAG thread is far behind).
    pub fn to_dag(&self, m: DagMsg) {
        if self.dag_tx.is_none() {
            return;
        }
        if matches!(m, DagMsg::Launch { .. })
            && self.dag_gap.load(Ordering::Relaxed)
            && self.dag_gap.swap(false, Ordering::Relaxed)
        {
            self.push_dag(DagMsg::Gap);
        }
        self.push_dag(m);
    }

    /// Notes an operation that was not resolved (the DAG's next launch record follows a gap).
    /// A load per call, a store only at a sampling window's end.
    #[inline]
    pub fn note_unresolved(&self) {
        if !self.dag_gap.load(Ordering::Relaxed) {
            self.dag_gap.store(true, Ordering::Relaxed);
        }
    }

    /// Whether an operation on a device whose engine is `tracking` (false without an engine)
    /// has its buffers resolved now, between launches (copies, memsets, graph launches: the
    /// sampling window of the last launch).
    #[inline]
    pub fn resolve_now(&self, tracking: bool) -> bool {
        tracking
            || self.cfg.tuning.resolve.sampled(
                self.counters
                    .launches
                    .load(Ordering::Relaxed)
                    .wrapping_sub(1),
            )
    }

    fn push_dag(&self, m: DagMsg) {
        let full = DAG_BATCH_TLS
            .try_with(|b| {
                let mut b = b.borrow_mut();
                if b.0.capacity() == 0 {
                    b.0.reserve_exact(DAG_BATCH);
                }
                b.0.push(m);
                (b.0.len() >= DAG_BATCH).then(|| {
                    let fresh = self
                        .dag_pool
                        .1
                        .try_recv()
                        .unwrap_or_else(|_| Vec::with_capacity(DAG_BATCH));
                    std::mem::replace(&mut b.0, fresh)
                })
            })
            .ok()
            .flatten();
        if let Some(batch) = full {
            self.send_dag(batch);
        }
    }

    fn send_dag(&self, batch: Vec<DagMsg>) {
        if let Some(tx) = &self.dag_tx {
            let n = batch.len() as u64;
            if tx.try_send(batch).is_err() {
                self.counters.dag_dropped.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// Records queued batches into `dag` (the DAG's lock held).
    fn apply_batches(&self, dag: &mut DagSide, batches: impl Iterator<Item = Vec<DagMsg>>) {
        for mut batch in batches {
            for m in batch.drain(..) {
                apply(self, dag, m);
            }
            // Back for reuse (dropped when the pool is full).
            let _ = self.dag_pool.0.try_send(batch);
        }
    }

    /// The current snapshot of every known allocation (rebuilt here if allocations changed).
    pub fn ranges(&self) -> Arc<Ranges> {
        if self.ranges_stale.load(Ordering::Acquire) {
            // Rebuilt under the write lock, so no thread resolves against the old snapshot once
            // the change is noted.
            let mut w = self.ranges.write();
            if !self.ranges_stale.swap(false, Ordering::AcqRel) {
                return w.clone();
            }
            let mut v: Vec<(u64, u64, Resolved)> = Vec::new();
            for e in self.engines() {
                for b in e.engine.buffers() {
                    v.push((
                        b.va().0,
                        b.va().0 + b.size().max(1),
                        Resolved::Managed(b, e.ordinal),
                    ));
                }
            }
            for (s, l, _) in self.unmanaged.read().iter() {
                v.push((s, s + l, Resolved::Unmanaged(s, l)));
            }
            *w = Arc::new(Ranges::new(v));
            return w.clone();
        }
        self.ranges.read().clone()
    }

    /// Resolves `w`, which no known allocation contains but lies near one ([`Ranges::near`]), by
    /// asking the driver: an allocation the
    /// hooks did not see (a library's own, a module's globals...) is then tracked as unmanaged.
    /// `true` if `w` turned out to be a device address.
    pub fn discover(&self, w: u64) -> bool {
        if self.not_device.read().contains(&(w >> 21)) {
            return false;
        }
        // A buffer allocated since the caller's snapshot is not an unknown allocation.
        if self
            .engines()
            .iter()
            .any(|e| e.engine.lookup(DevPtr(w)).is_some())
        {
            return true;
        }
        let _r = Reentry::enter();
        match introspect::allocation_of(w) {
            Some((start, len)) if len > 0 => {
                self.add_unmanaged(start, len, "found by the driver");
                self.counters
                    .discovered_allocs
                    .fetch_add(1, Ordering::Relaxed);
                true
            }
            _ => {
                let mut nd = self.not_device.write();
                if nd.len() < 1 << 16 {
                    nd.insert(w >> 21);
                }
                false
            }
        }
    }

    /// The device of the calling thread's current context `ctx` (cached in its state `t`).
    #[inline]
    pub fn device_of(&self, t: &ThreadState, ctx: u64) -> Option<usize> {
        let (c, d) = t.ctx_device.get();
        if c == ctx {
            return Some(d);
        }
        self.device_of_slow(t, ctx)
    }

    #[cold]
    fn device_of_slow(&self, t: &ThreadState, ctx: u64) -> Option<usize> {
        let d = introspect::current_device().ok()?;
        t.ctx_device.set((ctx, d));
        self.note_device_used(d);
        Some(d)
    }

    /// Notes that the job's operations run on device `ordinal` ([`State::devices_used`]).
    pub fn note_device_used(&self, ordinal: usize) {
        if let Some(bit) = 1u64.checked_shl(ordinal as u32) {
            if self.devices_used.load(Ordering::Relaxed) & bit == 0 {
                self.devices_used.fetch_or(bit, Ordering::SeqCst);
            }
        }
    }

    /// The devices the job's operations ran on (noted as threads' contexts were resolved), and
    /// every device possum has an engine for: those whose queued work a checkpoint's T0 waits
    /// for.
    pub fn devices_used(&self) -> Vec<usize> {
        let bits = self.devices_used.load(Ordering::SeqCst);
        let mut out: Vec<usize> = (0..64).filter(|d| bits & (1u64 << d) != 0).collect();
        for e in self.engines() {
            if !out.contains(&e.ordinal) {
                out.push(e.ordinal);
            }
        }
        out.sort_unstable();
        out
    }

    /// Records an allocation possum does not manage.
    pub fn add_unmanaged(&self, va: u64, len: u64, kind: &'static str) {
        if va == 0 || len == 0 {
            return;
        }
        self.unmanaged.write().insert(va, len, Unmanaged { kind });
        self.allocations_changed(true);
        self.counters
            .unmanaged_allocs
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Notes that handle `h` was imported from another process (`live`), or released.
    pub fn note_imported(&self, h: u64, live: bool) {
        let mut i = self.imported.lock();
        if live {
            i.insert(h);
        } else {
            i.remove(&h);
        }
    }

    /// Whether handle `h` is one imported from another process.
    pub fn is_imported(&self, h: u64) -> bool {
        self.imported.lock().contains(&h)
    }

    /// Forgets the unmanaged allocation starting at `va`.
    pub fn remove_unmanaged(&self, va: u64) {
        if self.unmanaged.write().remove(va).is_some() {
            self.allocations_changed(false);
        }
    }

    /// Unmanaged ranges now: (start, len).
    pub fn unmanaged_ranges(&self) -> Vec<(u64, u64)> {
        self.unmanaged
            .read()
            .iter()
            .map(|(s, l, _)| (s, l))
            .collect()
    }

    /// The model of kernel `handle`, made on first sight (layout and name asked of the driver).
    /// Takes the models' read lock: the launch path keeps the result per thread (`hooks`).
    pub fn kernel(&self, handle: u64) -> Arc<KernelModel> {
        if let Some(m) = self.kernels.read().get(&handle) {
            return m.clone();
        }
        let _r = Reentry::enter();
        let name = introspect::kernel_name(handle);
        let layout = if self.cfg.diag.layouts_from_cubin_only {
            Err("not asked (POSSUM_LAYOUTS=cubin)".to_string())
        } else {
            introspect::param_layout(handle)
        };
        let from_cubin = || {
            let l = self.cubin_layouts.read().get(name.as_deref()?).cloned()?;
            self.counters
                .layouts_from_cubin
                .fetch_add(1, Ordering::Relaxed);
            Some(l)
        };
        let m = match layout {
            Ok(l) => KernelModel::new(
                handle,
                name,
                Some(ParamLayout::new(
                    l.into_iter()
                        .map(|(offset, size)| Param { offset, size })
                        .collect(),
                )),
            ),
            Err(e) => match from_cubin() {
                Some(l) => KernelModel::new(handle, name, Some(l)),
                None => KernelModel::without_layout(
                    handle,
                    name,
                    format!("no parameter layout: {e}; none in a loaded module's .nv.info"),
                ),
            },
        };
        self.kernels
            .write()
            .entry(handle)
            .or_insert_with(|| Arc::new(m))
            .clone()
    }

    /// Keeps the parameter layouts of the kernels in a loaded module's image (an ELF cubin;
    /// anything else is counted and skipped). Bounded: past [`MAX_CUBIN_LAYOUTS`] kernels, more
    /// are not kept.
    pub fn note_module(&self, image: &[u8]) {
        let c = &self.counters;
        let Ok(layouts) = possum_analyzer::param_layouts(image) else {
            c.modules_unparsed.fetch_add(1, Ordering::Relaxed);
            return;
        };
        c.modules_parsed.fetch_add(1, Ordering::Relaxed);
        {
            let mut m = self.cubin_layouts.write();
            for (name, l) in &layouts {
                if m.len() >= MAX_CUBIN_LAYOUTS {
                    break;
                }
                m.entry(name.clone()).or_insert_with(|| l.clone());
            }
        }
        // A kernel launched before its module was loaded (lazy loading loads it inside that
        // first launch, after possum's entry callback) and that the driver could not describe:
        // its model is replaced by one with the layout (threads holding the old one move on at
        // their next launch of it: `KernelModel::successor`).
        let stale: Vec<Arc<KernelModel>> = self
            .kernels
            .read()
            .values()
            .filter(|k| !k.has_layout() && k.name().is_some_and(|n| layouts.contains_key(n)))
            .cloned()
            .collect();
        if stale.is_empty() {
            return;
        }
        let mut kernels = self.kernels.write();
        for old in stale {
            let l = layouts[old.name().expect("filtered on its name")].clone();
            if let Some(new) = old.replace_with_layout(l) {
                kernels.insert(old.handle(), new);
                c.layouts_from_cubin.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Every kernel model.
    pub fn kernels(&self) -> Vec<Arc<KernelModel>> {
        self.kernels.read().values().cloned().collect()
    }

    /// Snapshots the graph `graph` instantiated as `exec`.
    pub fn instantiate_graph(&self, exec: u64, graph: u64) {
        let _r = Reentry::enter();
        let snap = match introspect::graph_nodes(graph) {
            Err(e) => GraphSnap {
                nodes: Vec::new(),
                opaque: Some(format!("cannot read its nodes: {e}")),
            },
            Ok(nodes) => {
                let mut out = Vec::new();
                let mut opaque = None;
                for n in nodes {
                    match n {
                        GraphNode::Kernel { handle, params } => {
                            let model = self.kernel(handle);
                            let words = match params {
                                Some(p) => slot_words(&model, &p),
                                None => {
                                    opaque.get_or_insert_with(|| {
                                        "a kernel node whose parameters are unknown".to_string()
                                    });
                                    Vec::new()
                                }
                            };
                            out.push(SnapNode::Kernel { model, words });
                        }
                        GraphNode::Memset { dst, .. } => out.push(SnapNode::Memset { dst }),
                        // Empty, host, event record and event wait nodes touch no device memory;
                        // memory allocation and free nodes (a graph's own pool, as torch's
                        // cudaMallocAsync backend captures them) touch none of possum's buffers.
                        GraphNode::Other(3 | 5 | 6 | 7 | 10 | 11) => {}
                        GraphNode::Other(t) => {
                            opaque.get_or_insert_with(|| format!("a node of type {t}"));
                        }
                    }
                }
                GraphSnap { nodes: out, opaque }
            }
        };
        self.graphs.write().insert(exec, Arc::new(snap));
    }

    /// The snapshot of `exec`, if possum saw it instantiated and unchanged since.
    pub fn graph(&self, exec: u64) -> Option<Arc<GraphSnap>> {
        self.graphs.read().get(&exec).cloned()
    }

    /// Forgets `exec` (destroyed, or its nodes changed: later launches are opaque).
    pub fn forget_graph(&self, exec: u64) {
        self.graphs.write().remove(&exec);
    }

    /// Every managed buffer of `eng` and every unmanaged range, as (key, start, len), for
    /// validation. Released buffers are left out (they cannot be read).
    pub fn validation_targets(&self, eng: Option<&DevEngine>) -> Vec<(u64, u64, u64)> {
        let mut v: Vec<(u64, u64, u64)> = eng
            .map(|e| {
                e.engine
                    .buffers()
                    .into_iter()
                    .filter(|b| b.residency() == Residency::Mapped)
                    .map(|b| (b.id(), b.va().0, b.size()))
                    .collect()
            })
            .unwrap_or_default();
        v.extend(
            self.unmanaged_ranges()
                .into_iter()
                .map(|(s, l)| (s | 1 << 63, s, l)),
        );
        v
    }

    /// The statistics possum adds to the CUPTI counts.
    pub fn stats_json(&self) -> Value {
        let engines: Vec<Value> = self
            .engines()
            .iter()
            .map(|e| {
                let keeper = e.engine.device().owner_status().map(|(k, owned, own)| {
                    json!({"name": k.name, "reachable": k.reachable, "allocations": k.allocations,
                           "bytes": k.bytes, "retained_bytes": k.retained_bytes,
                           "spare": k.spare, "mappings_kept": owned, "mappings_own": own})
                });
                json!({"device": e.ordinal, "name": e.engine.device().device_name(),
                       "streams": e.streams.read().len(), "engine": e.engine.stats(),
                       "keeper": keeper})
            })
            .collect();
        let kernels = self.kernels.read();
        let opaque: Vec<Value> = kernels
            .values()
            .filter(|k| k.is_opaque())
            .map(|k| json!({"name": k.name(), "reason": k.opaque_reason()}))
            .collect();
        // Instantiated graphs possum treats as opaque (every launch of them writes everything),
        // with why: the reason was kept but never shown.
        let opaque_graphs: Vec<Value> = self
            .graphs
            .read()
            .iter()
            .filter_map(|(exec, g)| {
                g.opaque
                    .as_ref()
                    .map(|r| json!({"exec": format!("{exec:#x}"), "reason": r}))
            })
            .take(16)
            .collect();
        let unmanaged = self.unmanaged.read();
        let mut by_kind: HashMap<&str, (u64, u64)> = HashMap::default();
        for (_, l, u) in unmanaged.iter() {
            let e = by_kind.entry(u.kind).or_default();
            e.0 += 1;
            e.1 += l;
        }
        json!({
            "managing": self.managing(),
            "managing_off": *self.managing_off.lock(),
            "config": {"validation": format!("{:?}", self.cfg.tuning.validation), "staging_mib": self.cfg.tuning.staging_mib, "chunk_mib": self.cfg.tuning.chunk_mib, "staging_park": self.cfg.tuning.staging_park, "trim_context": self.cfg.tuning.trim_context, "serve_vmm": self.cfg.tuning.serve_vmm, "serve_pools": self.cfg.tuning.serve_pools, "writers": self.cfg.tuning.writers(), "held_writers": self.cfg.tuning.held_writers(), "restorers": self.cfg.tuning.restorers,
                       "dag": self.cfg.tuning.dag, "warnings": &self.cfg.warnings},
            "engines": engines,
            "unmanaged": {"allocations": unmanaged.len(), "bytes": unmanaged.total_bytes(),
                          "by_kind": by_kind.iter().map(|(k, (n, b))| (k.to_string(), json!({"allocations": n, "bytes": b}))).collect::<serde_json::Map<_, _>>()},
            "kernels": kernels.len(),
            "opaque_kernels": opaque,
            "opaque_graphs": opaque_graphs,
            "counters": self.counters.to_json(),
        })
    }

    /// Buffer ids in the order the job is predicted to write them next (the DAG's window,
    /// [`possum_analyzer::dag::Dag::predicted_writes`]): a checkpoint saves them first.
    pub fn predicted_writes(&self) -> Vec<u64> {
        flush_dag();
        let mut side = self.dag.lock();
        self.apply_batches(&mut side, self.dag_rx.try_iter());
        side.dag.predicted_writes()
    }

    /// The trace: statistics, per-kernel statistics, the DAG (JSON) and its DOT text.
    pub fn trace_json(&self) -> Value {
        let mut kernels: Vec<_> = self.kernels().iter().map(|k| k.stats()).collect();
        kernels.sort_by_key(|k| std::cmp::Reverse(k.launches));
        flush_dag();
        let mut side = self.dag.lock();
        self.apply_batches(&mut side, self.dag_rx.try_iter());
        let dag = &side.dag;
        json!({
            "stats": self.stats_json(),
            "kernels": kernels,
            "dag": dag.to_json(),
            "prefetch_order": dag.buffer_first_use(),
            "dot": dag.to_dot(),
        })
    }
}

/// The words of `model`'s pointer slots in a graph node's copied parameters.
fn slot_words(model: &KernelModel, params: &[Vec<u8>]) -> Vec<u64> {
    model
        .slots()
        .iter()
        .map(|s| {
            let off = 8 * usize::from(s.word);
            params
                .get(usize::from(s.param))
                .and_then(|p| p.get(off..off + 8))
                .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
        })
        .collect()
}
