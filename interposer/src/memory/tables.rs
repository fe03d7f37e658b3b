//! The memory tables possum keeps for the job, owned by one [`Memory`] reached through
//! [`memory`]: the handles it answered the job's virtual-memory calls with (its own
//! `cuMemCreate` tokens, `vmm`, and the imports of memory other processes shared, `imports`),
//! and the stream-ordered pools it serves (`pools`), with their figures for `possum status`.
//!
//! The types are here and their behaviour in the modules that act on them, so that the one
//! value needs none of them: a leaf of the crate's layers (it names no other module). The value
//! is a `static` built at compile time, like the session's: the driver's entry points reach it
//! without an owner to hand it to them. None of it is on a launch's path.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{MappedMutexGuard, Mutex, MutexGuard};
use possum_cuda::share::PeerMapping;
use possum_cuda::CudaEvent;
use possum_keeper::Identified;

/// The job's memory as possum serves it (see the module doc).
#[derive(Debug)]
pub struct Memory {
    /// The job's own virtual-memory pieces (`vmm`).
    pub vmm: VmmTable,
    /// Memory other processes shared with this one (`imports`).
    pub imports: ImportTable,
    /// The stream-ordered pools (`pools`).
    pub pools: PoolTable,
}

static MEMORY: Memory = Memory {
    vmm: VmmTable {
        tokens: Handles::new(TOKEN_TAG),
        created: AtomicU64::new(0),
        mapped: AtomicU64::new(0),
        shared: AtomicU64::new(0),
        left: Mutex::new((0, None)),
    },
    imports: ImportTable {
        handles: Handles::new(IMPORT_TAG),
        imported: AtomicU64::new(0),
        detaches: AtomicU64::new(0),
    },
    pools: PoolTable {
        devices: Mutex::new(None),
        served: AtomicU64::new(0),
        reused: AtomicU64::new(0),
    },
};

/// The job's memory tables: the one global through which the driver's entry points and the
/// session's steps reach them.
#[inline]
pub fn memory() -> &'static Memory {
    &MEMORY
}

/// The top 16 bits of every token possum answers `cuMemCreate` with.
pub const TOKEN_TAG: u64 = 0xb055 << 48;
/// The top 16 bits of every import token.
pub const IMPORT_TAG: u64 = 0xb056 << 48;
const TAG_MASK: u64 = 0xffff << 48;

/// Bytes of a `CUmemAllocationProp` (CUDA 12 and 13).
pub const PROP_LEN: usize = 32;

/// Handles possum answered the job with, by value: each its tag in the top bits and a number
/// below.
#[derive(Debug)]
pub struct Handles<T> {
    tag: u64,
    next: AtomicU64,
    live: Mutex<Option<HashMap<u64, T>>>,
}

/// What a handle stands for, as far as its references go.
pub trait Referenced {
    /// References: the call that made the handle, and each `cuMemRetainAllocationHandle`; each
    /// `cuMemRelease` drops one.
    fn refs(&mut self) -> &mut u32;
    /// Whether it stays after its last reference is dropped (until it is unmapped).
    fn stays(&self) -> bool;
}

impl<T: Referenced> Handles<T> {
    const fn new(tag: u64) -> Self {
        Handles {
            tag,
            next: AtomicU64::new(1),
            live: Mutex::new(None),
        }
    }

    /// Whether `handle` is one of this table's.
    pub fn is_ours(&self, handle: u64) -> bool {
        handle & TAG_MASK == self.tag
    }

    /// A new handle for `value`.
    pub fn add(&self, value: T) -> u64 {
        let handle = self.tag | self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(handle, value);
        handle
    }

    /// The live handles, locked.
    pub fn lock(&self) -> MappedMutexGuard<'_, HashMap<u64, T>> {
        MutexGuard::map(self.live.lock(), |m| m.get_or_insert_with(HashMap::new))
    }

    /// `cuMemRelease(handle)`: one reference dropped; at the last, forgotten unless it
    /// [`stays`](Referenced::stays). `false`: no such live handle.
    pub fn release(&self, handle: u64) -> bool {
        let mut live = self.lock();
        let Some(t) = live.get_mut(&handle) else {
            return false;
        };
        if *t.refs() == 0 {
            return false;
        }
        *t.refs() -= 1;
        if *t.refs() == 0 && !t.stays() {
            live.remove(&handle);
        }
        true
    }

    /// `cuMemRetainAllocationHandle`: the handle of the first `found`, one more reference taken.
    pub fn retain(&self, found: impl Fn(&T) -> bool) -> Option<u64> {
        let mut live = self.lock();
        let (&handle, t) = live.iter_mut().find(|(_, t)| found(t))?;
        *t.refs() += 1;
        Some(handle)
    }

    /// For `possum status`: (live handles, those `mapped`).
    pub fn count(&self, mapped: impl Fn(&T) -> bool) -> (usize, usize) {
        let live = self.lock();
        (live.len(), live.values().filter(|t| mapped(t)).count())
    }
}

/// The job's own virtual-memory pieces possum serves, and their figures.
#[derive(Debug)]
pub struct VmmTable {
    /// The tokens possum answered `cuMemCreate` with.
    pub tokens: Handles<Token>,
    /// Tokens made.
    pub created: AtomicU64,
    /// Pieces mapped.
    pub mapped: AtomicU64,
    /// Handles exported (`cuMemExportToShareableHandle`) through the keeper.
    pub shared: AtomicU64,
    /// `cuMemCreate`s left to the driver while serving, and the first one's properties (so that
    /// `possum status` says why a job's pieces are the driver's).
    pub left: Mutex<(u64, Option<[u8; PROP_LEN]>)>,
}

/// A token's memory: its size, device, and where it is mapped.
#[derive(Debug)]
pub struct Token {
    /// The device.
    pub ordinal: usize,
    /// Bytes.
    pub size: u64,
    /// Where it is mapped now.
    pub mapped: Option<u64>,
    /// Mapped once already (its contents went with the unmap).
    pub used: bool,
    /// The job's `CUmemAllocationProp`, for `cuMemGetAllocationPropertiesFromHandle`.
    pub prop: [u8; PROP_LEN],
    /// References (see [`Referenced::refs`]).
    pub refs: u32,
    /// Exported (`cuMemExportToShareableHandle`): another process may write it, unseen here.
    pub shared: bool,
}

impl Referenced for Token {
    fn refs(&mut self) -> &mut u32 {
        &mut self.refs
    }

    /// Forgotten at its last reference, mapped or not (a piece still mapped stays until its
    /// unmap).
    fn stays(&self) -> bool {
        false
    }
}

/// Memory other processes shared with this one, and its figures.
#[derive(Debug)]
pub struct ImportTable {
    /// The import tokens possum answered `cuMemImportFromShareableHandle` with.
    pub handles: Handles<Import>,
    /// Imports served.
    pub imported: AtomicU64,
    /// Mappings released by checkpoints.
    pub detaches: AtomicU64,
}

/// One imported allocation, as the job's handle stands for it.
#[derive(Debug)]
pub struct Import {
    /// The allocation, as its keeper named it.
    pub found: Identified,
    /// That keeper's socket.
    pub keeper: PathBuf,
    /// That keeper's device (the memory's).
    pub keeper_device: usize,
    /// The job's device when it imported it (whose context maps it).
    pub ordinal: usize,
    /// Where it is mapped, if it is.
    pub mapped: Option<Mapped>,
    /// References (see [`Referenced::refs`]).
    pub refs: u32,
}

impl Referenced for Import {
    fn refs(&mut self) -> &mut u32 {
        &mut self.refs
    }

    /// Forgotten once it is unmapped too.
    fn stays(&self) -> bool {
        self.mapped.is_some()
    }
}

/// Where an import is mapped.
#[derive(Debug)]
pub struct Mapped {
    /// The job's address.
    pub va: u64,
    /// `None` while a checkpoint has it released.
    pub mapping: Option<PeerMapping>,
}

/// The stream-ordered pools possum serves, and their figures.
#[derive(Debug)]
pub struct PoolTable {
    /// Each device's pool, by ordinal.
    pub devices: Mutex<Option<HashMap<usize, DevicePool>>>,
    /// Allocations served.
    pub served: AtomicU64,
    /// Allocations served by a block freed on their stream (no wait, no new memory).
    pub reused: AtomicU64,
}

/// A served block: where it is and what holds it.
#[derive(Debug, Clone, Copy)]
pub struct Block {
    /// Its slab's address, or its own buffer's (`own`).
    pub buffer: u64,
    /// Bytes.
    pub len: u64,
    /// An engine buffer of its own.
    pub own: bool,
}

/// A slab: its free ranges (offset -> length) and the bytes in use.
#[derive(Debug)]
pub struct Slab {
    /// Free ranges, offset -> length.
    pub free: BTreeMap<u64, u64>,
    /// Bytes in use.
    pub used: u64,
}

/// One device's served memory.
#[derive(Debug, Default)]
pub struct DevicePool {
    /// The slabs, by address.
    pub slabs: BTreeMap<u64, Slab>,
    /// The blocks in use, by address.
    pub live: HashMap<u64, Block>,
    /// Freed in stream order, reusable once the event completed, or at once by an allocation
    /// of the same size on the stream it was freed on ([`Pending`]).
    pub pending: Vec<Pending>,
    /// Bytes freed on a capturing stream: never reused.
    pub lost: u64,
}

/// A block freed in stream order (`cuMemFreeAsync`): where, and on which stream.
#[derive(Debug)]
pub struct Pending {
    /// Recorded on the freeing stream.
    pub event: CudaEvent,
    /// The block's address.
    pub ptr: u64,
    /// The block.
    pub block: Block,
    /// The freeing stream.
    pub stream: u64,
}

impl PoolTable {
    /// The pools, locked; `ordinal`'s made on first use through [`pool_of`].
    pub fn lock(&self) -> MappedMutexGuard<'_, HashMap<usize, DevicePool>> {
        MutexGuard::map(self.devices.lock(), |m| m.get_or_insert_with(HashMap::new))
    }
}

/// `ordinal`'s pool in `pools`, made on first use.
pub fn pool_of(pools: &mut HashMap<usize, DevicePool>, ordinal: usize) -> &mut DevicePool {
    pools.entry(ordinal).or_default()
}
