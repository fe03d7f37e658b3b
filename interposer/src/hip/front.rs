//! The HIP front end's state and decisions, in safe code: the engine over the job's HIP runtime
//! (`HipDevice`), the allocations it serves, the kernels whose argument layouts the code objects
//! give, and the hook each operation of the job runs before it is enqueued. `entry.rs` (the
//! exported functions) calls down into this with plain values, through `through.rs`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock};
use possum_analyzer::amdgpu::{self, AmdgpuKernel};
use possum_analyzer::dag::{BufRef, Dag, KernelRef};
use possum_engine::device::DevPtr;
use possum_engine::{Access, Buffer, Engine, EngineConfig, EngineError};
use possum_hip::result::{HipStream, Runtime};
use possum_hip::HipDevice;
use serde_json::{json, Value};

use crate::base::config;
use crate::base::log::log;

/// The device the front end serves: HIP's first. Allocations the job makes on another device
/// are its own (unmanaged), and a checkpoint refuses a job with such memory.
pub const DEVICE: usize = 0;

/// The front end, made at the job's first HIP call that needs it.
pub struct Front {
    /// The engine over the job's runtime, device [`DEVICE`].
    pub engine: Engine<HipDevice>,
    rt: Arc<Runtime>,
    /// The job's streams the engine orders copies against, by `hipStream_t`.
    streams: RwLock<HashMap<usize, HipStream>>,
    /// Kernels by launch handle (`hipFunction_t`, or a host stub of `__hipRegisterFunction`).
    kernels: RwLock<HashMap<usize, Arc<Kernel>>>,
    /// The kernels of each code object loaded (`hipModule_t`, or the handle of a registered
    /// fat binary); empty when its code object could not be read.
    modules: Mutex<HashMap<usize, Arc<Vec<AmdgpuKernel>>>>,
    /// The job's device memory possum does not serve, by address: (bytes, how it was made).
    unmanaged: Mutex<BTreeMap<u64, (u64, &'static str)>>,
    /// The memory handles possum answered `hipMemCreate` with, by value.
    tokens: Mutex<HashMap<u64, Token>>,
    /// The number of the next handle in [`Front::tokens`].
    next_token: AtomicU64,
    /// The kernel/buffer DAG of the job's operations (what a checkpoint saves first), recorded
    /// by its own thread: the job's operations only send to it (`None`: `POSSUM_DAG=0`).
    dag: Arc<Mutex<Dag>>,
    dag_tx: Option<crossbeam_channel::Sender<DagRecord>>,
    pub counters: Counters,
}

/// The top 16 bits of every memory handle possum hands out for `hipMemCreate`.
pub const TOKEN_TAG: u64 = 0xb055 << 48;
const TAG_MASK: u64 = 0xffff << 48;
/// The engine group of the pieces the job maps itself: a tensor may span pieces, so an
/// operation that touches one is taken to touch all.
const VMM_GROUP: u64 = 1;

/// The memory of a handle possum answered `hipMemCreate` with: none is made until it is
/// mapped, as an engine buffer at the job's address.
#[derive(Debug)]
struct Token {
    size: u64,
    /// Where it is mapped.
    mapped: Option<u64>,
    /// Mapped once already (its contents went with its unmap).
    used: bool,
    /// `hipMemRelease`d while mapped: forgotten at its unmap.
    released: bool,
}

/// Why a call on a handle possum made is refused.
#[derive(Debug, PartialEq, Eq)]
pub enum TokenError {
    /// The call is not one possum can serve on such memory (said in the log).
    NotSupported(String),
    /// The job's arguments are wrong.
    Invalid,
}

/// What an operation is, for the DAG.
#[derive(Debug, Clone)]
pub enum Kind {
    /// A copy.
    Copy,
    /// A memset.
    Memset,
    /// A launch of a kernel: its launch handle and what it is.
    Kernel(usize, Arc<Kernel>),
}

/// A kernel whose layout its code object gave, prepared once for its launches.
#[derive(Debug)]
pub struct Kernel {
    /// What the code object says of it.
    pub code: AmdgpuKernel,
    /// Its explicit arguments' (offset, size) in the kernarg segment, in order.
    pub args: Vec<(usize, usize)>,
    /// The bytes of the kernarg segment a launch supplies.
    pub explicit_size: usize,
    /// The kernarg offsets of its pointer words.
    slots: Vec<usize>,
}

impl Kernel {
    fn new(code: AmdgpuKernel) -> Kernel {
        Kernel {
            args: code
                .explicit_args()
                .map(|a| (a.offset as usize, a.size as usize))
                .collect(),
            explicit_size: code.explicit_size() as usize,
            slots: (code.layout().pointer_slots().iter())
                .map(|s| s.offset as usize)
                .collect(),
            code,
        }
    }
}

/// An operation for the DAG's thread to record.
pub struct DagRecord {
    kind: Kind,
    stream: u64,
    reads: Vec<BufRef>,
    /// `None`: its buffers are unknown (it breaks the chain of dependencies).
    writes: Option<Vec<BufRef>>,
}

fn buf_ref(b: &Buffer) -> BufRef {
    BufRef {
        id: b.id(),
        va: b.va().0,
        size: b.size(),
        managed: false,
    }
}

/// Starts the thread that records the job's operations in `dag`; its channel (`None`: the
/// thread could not start, and nothing is recorded).
fn record_on_a_thread(dag: Arc<Mutex<Dag>>) -> Option<crossbeam_channel::Sender<DagRecord>> {
    let (tx, rx) = crossbeam_channel::unbounded::<DagRecord>();
    std::thread::Builder::new()
        .name("possum-hip-dag".into())
        .spawn(move || {
            for r in rx {
                let mut dag = dag.lock();
                let Some(writes) = r.writes else {
                    dag.record_gap();
                    continue;
                };
                let kernel = match &r.kind {
                    Kind::Copy => KernelRef::MEMCPY,
                    Kind::Memset => KernelRef::MEMSET,
                    Kind::Kernel(handle, k) => KernelRef {
                        handle: *handle as u64,
                        name: Some(&k.code.name),
                        opaque: false,
                    },
                };
                dag.record_launch(&kernel, r.stream, &r.reads, &writes);
            }
        })
        .ok()?;
    Some(tx)
}

/// What the front end saw.
#[derive(Default)]
pub struct Counters {
    pub served_allocs: AtomicU64,
    pub served_frees: AtomicU64,
    pub launches: AtomicU64,
    /// Launches of a kernel without a known layout (taken to write every buffer).
    pub opaque_launches: AtomicU64,
    pub graph_launches: AtomicU64,
    pub copies: AtomicU64,
    pub memsets: AtomicU64,
    /// Operations whose hook failed: they ran unchecked (a checkpoint open is undone).
    pub faults: AtomicU64,
}

static FRONT: OnceLock<Result<Front, FrontError>> = OnceLock::new();

/// Why the front end could not be made.
#[derive(Debug, thiserror::Error)]
pub enum FrontError {
    /// No HIP runtime library was found.
    #[error("the HIP runtime's library was not found")]
    NoRuntime,
    /// The device could not be opened.
    #[error(transparent)]
    Open(#[from] possum_hip::OpenError),
    /// The engine could not be made over it.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// The front end, made on first use over the runtime at `runtime()`'s path, `made()` run once it
/// is; `None` (said once in the log) when it cannot be made: the job's calls then pass through,
/// unserved.
pub fn front(runtime: impl FnOnce() -> Option<PathBuf>, made: fn()) -> Option<&'static Front> {
    FRONT
        .get_or_init(|| {
            let front = runtime()
                .ok_or(FrontError::NoRuntime)
                .and_then(|p| Front::new(&p));
            match &front {
                Ok(f) => {
                    log(&format!(
                        "HIP front end: device {DEVICE} ({}) of {}",
                        f.engine.device().device_name(),
                        f.rt.path().display()
                    ));
                    made();
                }
                Err(e) => log(&format!("HIP front end off: {e}; the job's HIP calls pass")),
            }
            front
        })
        .as_ref()
        .ok()
}

/// The front end if it was made.
pub fn made() -> Option<&'static Front> {
    FRONT.get().and_then(|r| r.as_ref().ok())
}

impl Front {
    fn new(runtime: &Path) -> Result<Front, FrontError> {
        let dev = HipDevice::open(runtime, DEVICE)?;
        let rt = dev.runtime().clone();
        let tuning = &config::get().tuning;
        let chunk = (tuning.chunk_mib as usize) << 20;
        let cfg = EngineConfig {
            chunk_size: chunk,
            staging_buffers: ((tuning.staging_mib << 20) / chunk as u64).max(2) as usize,
            writer_threads: tuning.writers(),
            held_writer_threads: tuning.held_writers(),
            restore_threads: tuning.restorers,
            background_nice: tuning.background_nice,
            ..EngineConfig::default()
        };
        let engine = Engine::new(Arc::new(dev), cfg)?;
        let dag = Arc::new(Mutex::new(Dag::new(tuning.dag_window)));
        let dag_tx = tuning
            .dag
            .then(|| record_on_a_thread(dag.clone()))
            .flatten();
        Ok(Front {
            engine,
            rt,
            streams: RwLock::default(),
            kernels: RwLock::default(),
            modules: Mutex::default(),
            unmanaged: Mutex::default(),
            tokens: Mutex::default(),
            next_token: AtomicU64::new(1),
            dag,
            dag_tx,
            counters: Counters::default(),
        })
    }

    /// An engine buffer of `size` bytes for the job (`hipMalloc`, `hipMallocAsync`,
    /// `hipMallocFromPoolAsync`), its address; `None` when the engine cannot make one.
    pub fn alloc(&self, size: u64, what: &str) -> Option<u64> {
        let made = {
            let _g = crate::ops::gate::admit_engine(&self.engine);
            self.engine.alloc(size)
        };
        match made {
            Ok(b) => {
                self.counters.served_allocs.fetch_add(1, Ordering::Relaxed);
                Some(b.va().0)
            }
            Err(e) => {
                log(&format!("{what} of {size} bytes not served: {e}"));
                None
            }
        }
    }

    /// Whether `ptr` is the start of an engine buffer.
    pub fn serves(&self, ptr: u64) -> bool {
        self.engine
            .lookup(DevPtr(ptr))
            .is_some_and(|b| b.va().0 == ptr)
    }

    /// Frees the engine buffer at `ptr`, the work queued on it done (the caller waited).
    pub fn free(&self, ptr: u64) -> Result<(), EngineError> {
        crate::ops::gate::wait_if_paused();
        self.engine.free(DevPtr(ptr))?;
        self.counters.served_frees.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Records device memory of the job's own at `va` (not served by possum).
    pub fn note_unmanaged(&self, va: u64, bytes: u64, how: &'static str) {
        self.unmanaged.lock().insert(va, (bytes, how));
    }

    /// Forgets the job's own memory at `va`; whether it was recorded.
    pub fn forget_unmanaged(&self, va: u64) -> bool {
        self.unmanaged.lock().remove(&va).is_some()
    }

    /// The starts of the job's own mappings inside `[va, va + size)`.
    pub fn unmanaged_in(&self, va: u64, size: u64) -> Vec<u64> {
        self.unmanaged
            .lock()
            .range(va..va.saturating_add(size))
            .map(|(&a, _)| a)
            .collect()
    }

    /// The job's own device memory now: (allocations, bytes) of each kind.
    pub fn unmanaged(&self) -> BTreeMap<&'static str, (u64, u64)> {
        let mut out: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
        for (bytes, kind) in self.unmanaged.lock().values() {
            let e = out.entry(kind).or_default();
            e.0 += 1;
            e.1 += bytes;
        }
        out
    }

    /// A handle for `hipMemCreate` of `size` bytes, no memory made yet: mapped, it becomes an
    /// engine buffer. `None` when its size is not a multiple of the engine's granularity (the
    /// runtime refuses such a size too).
    pub fn create_token(&self, size: u64) -> Option<u64> {
        use possum_engine::device::Device;
        let g = self.engine.device().granularity();
        if size == 0 || size % g != 0 {
            return None;
        }
        let t = TOKEN_TAG | self.next_token.fetch_add(1, Ordering::Relaxed);
        self.tokens.lock().insert(
            t,
            Token {
                size,
                mapped: None,
                used: false,
                released: false,
            },
        );
        Some(t)
    }

    /// Whether `handle` is one of possum's.
    pub fn is_token(&self, handle: u64) -> bool {
        handle & TAG_MASK == TOKEN_TAG && self.tokens.lock().contains_key(&handle)
    }

    /// `hipMemMap(va, size, offset, token)`: an engine buffer at `va`, in the job's own
    /// reservation. Only the whole of a token, once.
    pub fn map_token(&self, token: u64, va: u64, size: u64, offset: u64) -> Result<(), TokenError> {
        let mut tokens = self.tokens.lock();
        let t = tokens.get_mut(&token).ok_or(TokenError::Invalid)?;
        let refuse = |why: &str| {
            let m = format!(
                "hipMemMap of {size} bytes at {va:#x} (offset {offset}) of memory possum serves: \
                 {why}; not supported"
            );
            log(&m);
            TokenError::NotSupported(m)
        };
        if offset != 0 || size != t.size {
            return Err(refuse("only the whole of it can be mapped"));
        }
        if t.mapped.is_some() {
            return Err(refuse("it is mapped already"));
        }
        if t.used {
            return Err(refuse("its contents went with its last unmap"));
        }
        let made = {
            let _g = crate::ops::gate::admit_engine(&self.engine);
            self.engine.alloc_at(DevPtr(va), size, VMM_GROUP)
        };
        made.map_err(|e| refuse(&e.to_string()))?;
        t.mapped = Some(va);
        self.counters.served_allocs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// `hipMemRelease(token)`: forgotten now, or at its unmap if it is mapped.
    pub fn release_token(&self, token: u64) -> Result<(), TokenError> {
        let mut tokens = self.tokens.lock();
        let t = tokens.get_mut(&token).ok_or(TokenError::Invalid)?;
        if t.mapped.is_some() {
            t.released = true;
        } else {
            tokens.remove(&token);
        }
        Ok(())
    }

    /// The starts of the engine buffers of tokens mapped inside `[va, va + size)`.
    pub fn tokens_mapped_in(&self, va: u64, size: u64) -> Vec<u64> {
        let end = va.saturating_add(size);
        self.tokens
            .lock()
            .values()
            .filter_map(|t| t.mapped)
            .filter(|&m| m >= va && m < end)
            .collect()
    }

    /// Unmaps the token mapped at `va` (the work queued on it done): its engine buffer freed.
    pub fn unmap_token(&self, va: u64) -> Result<(), EngineError> {
        self.free(va)?;
        let mut tokens = self.tokens.lock();
        let Some(&k) = tokens
            .iter()
            .find(|(_, t)| t.mapped == Some(va))
            .map(|(k, _)| k)
        else {
            return Ok(());
        };
        let t = tokens.get_mut(&k).expect("just found");
        t.mapped = None;
        t.used = true;
        if t.released {
            tokens.remove(&k);
        }
        Ok(())
    }

    /// The engine's wrapper of the job's stream `raw`.
    pub fn stream(&self, raw: usize) -> HipStream {
        if let Some(s) = self.streams.read().get(&raw) {
            return s.clone();
        }
        self.streams
            .write()
            .entry(raw)
            .or_insert_with(|| HipStream::of_job(&self.rt, raw))
            .clone()
    }

    /// Forgets the job's stream `raw` (it destroys it).
    pub fn forget_stream(&self, raw: usize) {
        self.streams.write().remove(&raw);
    }

    /// Reads the code object `image` of module (or fat binary) `handle`: its kernels' argument
    /// layouts. One that cannot be read is said in the log; its kernels are then taken to
    /// write every buffer.
    pub fn note_module(&self, handle: usize, image: &[u8]) {
        let kernels = match amdgpu::image_kernels(image) {
            Ok(k) => k,
            Err(e) => {
                log(&format!(
                    "code object {handle:#x} ({} bytes) cannot be read: {e}; launches of its \
                     kernels are taken to write every buffer",
                    image.len()
                ));
                Vec::new()
            }
        };
        self.modules.lock().insert(handle, Arc::new(kernels));
    }

    /// Forgets module `handle` (unloaded).
    pub fn forget_module(&self, handle: usize) {
        self.modules.lock().remove(&handle);
    }

    /// Notes that launches of `launch` (a function handle or a host stub) run kernel `name` of
    /// module `module`.
    pub fn note_kernel(&self, launch: usize, module: usize, name: &str) {
        let found = self.modules.lock().get(&module).and_then(|ks| {
            ks.iter()
                .find(|k| k.name == name || k.symbol == name || k.symbol == format!("{name}.kd"))
                .cloned()
        });
        match found {
            Some(k) => {
                self.kernels
                    .write()
                    .insert(launch, Arc::new(Kernel::new(k)));
            }
            None => {
                self.kernels.write().remove(&launch);
            }
        }
    }

    /// The kernel launches of `launch` run, if its layout is known.
    pub fn kernel(&self, launch: usize) -> Option<Arc<Kernel>> {
        self.kernels.read().get(&launch).cloned()
    }

    /// The engine buffers that the words at `kernel`'s pointer slots in `kernarg` (its explicit
    /// arguments as laid out for the device) point into: those the launch may write.
    pub fn buffers_of_kernarg(&self, kernel: &Kernel, kernarg: &[u8]) -> Vec<Buffer> {
        let mut out: Vec<Buffer> = Vec::new();
        for &at in &kernel.slots {
            let Some(word) = kernarg.get(at..at + 8) else {
                continue;
            };
            let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            if let Some(b) = self.engine.lookup(DevPtr(w)) {
                if !out.iter().any(|o| o.id() == b.id()) {
                    out.push(b);
                }
            }
        }
        out
    }

    /// The engine buffers `[ptr, ptr + len)` touches.
    pub fn buffers_of_range(&self, ptr: u64, len: u64) -> Vec<Buffer> {
        let mut out: Vec<Buffer> = Vec::new();
        let mut at = ptr;
        let end = ptr.saturating_add(len.max(1));
        while at < end {
            let Some(b) = self.engine.lookup(DevPtr(at)) else {
                break;
            };
            at = b.va().0 + b.size().max(1);
            out.push(b);
        }
        out
    }

    /// The hook: runs `op` (the job's operation of `kind`, enqueued on stream `stream`) once the
    /// engine has what it needs before it — during a checkpoint the buffers it may write saved
    /// first, during an on-demand restore those it touches back — and never while a checkpoint
    /// holds the job. `writes` are the buffers it may write (`None`: unknown, every buffer),
    /// `reads` those it only reads.
    pub fn before_op<R>(
        &self,
        kind: Kind,
        stream: usize,
        reads: &[Buffer],
        writes: Option<&[Buffer]>,
        op: impl FnOnce() -> R,
    ) -> R {
        if let Some(tx) = &self.dag_tx {
            let refs = |bs: &[Buffer]| bs.iter().map(buf_ref).collect();
            let _ = tx.send(DagRecord {
                kind,
                stream: stream as u64,
                reads: refs(reads),
                writes: writes.map(refs),
            });
        }
        let guard = crate::ops::gate::admit_engine(&self.engine);
        if guard.tracking() {
            let access = match writes {
                Some(writes) => Access::Known { reads, writes },
                None => Access::Opaque,
            };
            if let Err(e) = guard.check(&self.stream(stream), access) {
                self.counters.faults.fetch_add(1, Ordering::Relaxed);
                crate::ops::gate::note_fault(&format!("HIP operation on stream {stream:#x}: {e}"));
            }
        }
        let r = op();
        drop(guard);
        r
    }

    /// The buffers' ids in the order the job is predicted to write them next (the DAG's).
    pub fn predicted_writes(&self) -> Vec<u64> {
        self.dag.lock().predicted_writes()
    }

    /// `possum status`'s view of the front end.
    pub fn stats_json(&self) -> Value {
        let unmanaged = self.unmanaged();
        let dag = {
            let d = self.dag.lock();
            json!({"kernels": d.kernel_count(), "buffers": d.buffer_count(),
                   "prefetch_order": d.buffer_first_use()})
        };
        let c = &self.counters;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        json!({
            "engines": [{
                "device": DEVICE,
                "name": self.engine.device().device_name(),
                "streams": self.streams.read().len(),
                "engine": self.engine.stats(),
            }],
            "unmanaged": {
                "allocations": unmanaged.values().map(|u| u.0).sum::<u64>(),
                "bytes": unmanaged.values().map(|u| u.1).sum::<u64>(),
                "by_kind": unmanaged.iter()
                    .map(|(k, (n, b))| (k.to_string(), json!({"allocations": n, "bytes": b})))
                    .collect::<serde_json::Map<_, _>>(),
            },
            "kernels": self.kernels.read().len(),
            "dag": dag,
            "hip": {
                "runtime": self.rt.path().display().to_string(),
                "served_allocs": n(&c.served_allocs), "served_frees": n(&c.served_frees),
                "launches": n(&c.launches), "opaque_launches": n(&c.opaque_launches),
                "graph_launches": n(&c.graph_launches), "copies": n(&c.copies),
                "memsets": n(&c.memsets), "faults": n(&c.faults),
            },
        })
    }
}
