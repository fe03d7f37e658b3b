//! The hooks' per-thread data ([`HookState`], part of [`crate::ops::thread_state`]): the operation
//! between its entry and exit callbacks, the kernels' memo entries and scratch space. What the
//! hooks do with them is in `hooks.rs`.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::time::Duration;

// Keys are handles: the fast hash.
use rustc_hash::FxHashMap as HashMap;

use possum_analyzer::dag::BufRef;
use possum_analyzer::kernel::KernelModel;
use possum_cuda::CudaDevice;
use possum_engine::{Access, Buffer, OpGuard};

use crate::memory::ranges::Ranges;
#[cfg(doc)]
use crate::{memory::ranges::WordHash, process::dag::DagMsg};

/// What an entry callback leaves for the exit callback besides its own device's guard (rarely
/// anything: [`HookState::more`] says when).
#[derive(Default)]
pub struct Pending {
    /// Guards of the other devices whose buffers the operation writes or reads.
    pub others: Vec<OpGuard<'static, CudaDevice>>,
    /// The exit side of the launch's validation, if it is validated.
    pub validation: Option<Box<dyn FnOnce()>>,
    /// For a timed launch: the entry side's time, to which the exit side's is added.
    pub timed: Option<Duration>,
}

impl Pending {
    pub const EMPTY: Pending = Pending {
        others: Vec::new(),
        validation: None,
        timed: None,
    };
}

/// An operation's buffers: managed ones of its device for the hook (deduplicated, a buffer both
/// read and written only in `writes`), managed ones of other devices (`foreign`: a peer copy, a
/// kernel writing another GPU's memory), and every known allocation for the DAG.
#[derive(Default)]
pub struct BufferSets {
    pub reads: Vec<Buffer>,
    pub writes: Vec<Buffer>,
    pub foreign: Vec<Foreign>,
    pub dag_reads: Vec<BufRef>,
    pub dag_writes: Vec<BufRef>,
}

/// A managed buffer of another device than the operation's own, which it reads or writes: it is
/// hooked by that device's engine (where its dirty mark and copy-before-write are).
#[derive(Clone)]
pub struct Foreign {
    pub dev: usize,
    pub buf: Buffer,
    pub write: bool,
}

impl BufferSets {
    pub const EMPTY: BufferSets = BufferSets {
        reads: Vec::new(),
        writes: Vec::new(),
        foreign: Vec::new(),
        dag_reads: Vec::new(),
        dag_writes: Vec::new(),
    };

    pub fn clear(&mut self) {
        self.reads.clear();
        self.writes.clear();
        self.foreign.clear();
        self.dag_reads.clear();
        self.dag_writes.clear();
    }

    /// Records `br` for the DAG as written (`write`) or read, once.
    pub fn add_dag(&mut self, br: BufRef, write: bool) {
        let list = if write {
            &mut self.dag_writes
        } else {
            &mut self.dag_reads
        };
        if !list.iter().any(|x| x.id == br.id) {
            list.push(br);
        }
    }

    pub fn access(&self) -> Access<'_> {
        Access::Known {
            reads: &self.reads,
            writes: &self.writes,
        }
    }
}

/// Per-thread scratch space, reused so the launch path does not allocate.
#[derive(Default)]
pub struct Scratch {
    pub words: Vec<u64>,
    pub sets: BufferSets,
    /// The allocation snapshot and the generation it is current for (taken again only when the
    /// generation moves: no lock per launch).
    pub ranges: Option<(u64, Arc<Ranges>)>,
}

impl Scratch {
    pub const EMPTY: Scratch = Scratch {
        words: Vec::new(),
        sets: BufferSets::EMPTY,
        ranges: None,
    };
}

/// The hooks' part of a thread's state ([`crate::ops::thread_state::ThreadState`]), each item
/// borrowed on its own.
pub struct HookState {
    /// The guard of the operation's own device that its entry callback left for its exit
    /// callback (the gate is left when it is dropped).
    pub guard: Cell<Option<OpGuard<'static, CudaDevice>>>,
    /// Whether `pending` holds anything.
    pub more: Cell<bool>,
    /// The rest of what an operation's entry callback left for its exit callback.
    pub pending: RefCell<Pending>,
    /// Scratch space.
    pub scratch: RefCell<Scratch>,
    /// Per kernel handle: its model and the last few distinct (words → buffer sets) of its
    /// launches (made at the thread's first launch).
    pub memo: RefCell<Option<HashMap<u64, Ways>>>,
    /// What the operation being hooked is, for `POSSUM_DEBUG_DIRTY` (set only when it is on).
    pub label: RefCell<String>,
}

impl HookState {
    /// Nothing kept yet.
    pub const fn new() -> HookState {
        HookState {
            guard: Cell::new(None),
            more: Cell::new(false),
            pending: RefCell::new(Pending::EMPTY),
            scratch: RefCell::new(Scratch::EMPTY),
            memo: RefCell::new(None),
            label: RefCell::new(String::new()),
        }
    }

    /// Takes what it holds, leaving it empty (an item borrowed now is left as it is).
    pub fn take(&self) -> HookState {
        fn out<T: Default>(c: &RefCell<T>) -> RefCell<T> {
            let v = c.try_borrow_mut().map(|mut v| std::mem::take(&mut *v));
            RefCell::new(v.unwrap_or_default())
        }
        HookState {
            guard: Cell::new(self.guard.take()),
            more: Cell::new(self.more.replace(false)),
            pending: out(&self.pending),
            scratch: out(&self.scratch),
            memo: out(&self.memo),
            label: out(&self.label),
        }
    }
}

/// A kernel's buffer sets as its last launch on this thread resolved them: reused while the
/// launch's words, the allocations and the kernel's speculation are all unchanged (a training
/// loop launches the same kernels on the same buffers step after step).
///
/// An entry whose resolution needed discovery is never reused (its `generation` is `u64::MAX`),
/// so a reused entry always named only allocations possum knew.
#[derive(Default)]
pub struct Memo {
    pub generation: u64,
    pub version: u64,
    /// [`WordHash`] of the launch's canonical words.
    pub hash: u128,
    pub unmanaged: bool,
    pub sets: BufferSets,
    /// Id of `sets`' DAG lists ([`DagMsg::Define`]d when the entry is filled; 0: none), which
    /// every launch matching this entry sends.
    pub dag: u64,
}

impl Memo {
    /// Whether this entry holds the buffer sets of a launch whose canonical words hash to
    /// `hash` now.
    pub fn matches(&self, generation: u64, version: u64, hash: u128) -> bool {
        self.hash == hash && self.generation == generation && self.version == version
    }
}

/// Memo entries kept per kernel and thread (replaced round-robin, their buffers reused, so a miss
/// allocates nothing once the entries exist; found through a key index, so their number costs
/// nothing per launch). A training step launches one kernel on many buffer sets (an elementwise
/// kernel on most tensors of every layer): 8 gave GPT-2 small 8% hits and 32 gave 17% (measured).
pub const MEMO_WAYS: usize = 256;

/// A kernel's model and memo entries on one thread: the launch path's one lookup per launch.
#[derive(Default)]
pub struct Ways {
    pub model: Option<Arc<KernelModel>>,
    pub memo: MemoSet,
}

/// A kernel's memo entries on one thread.
#[derive(Default)]
pub struct MemoSet {
    pub entries: Vec<Memo>,
    /// Entry of each key (the latest one made with it).
    pub index: HashMap<u64, usize>,
    /// The entry the last launch used. It and the one after it are tried first: a step
    /// launches a kernel on the same buffer sets in the same order, and entries are made in
    /// that order.
    pub last: usize,
    pub next: usize,
}

impl MemoSet {
    /// The entry matching `hash`, if any.
    pub fn find(&self, generation: u64, version: u64, hash: u128) -> Option<usize> {
        let n = self.entries.len();
        if n == 0 {
            return None;
        }
        let likely = [self.last % n, (self.last + 1) % n];
        likely
            .into_iter()
            .chain(self.index.get(&(hash as u64)).copied())
            .find(|&i| self.entries[i].matches(generation, version, hash))
    }

    /// An entry to (re)fill for a launch with `hash` that matched none.
    pub fn victim(&mut self, hash: u128) -> usize {
        let i = if self.entries.len() < MEMO_WAYS {
            self.entries.push(Memo::default());
            self.entries.len() - 1
        } else {
            let i = self.next % MEMO_WAYS;
            self.next = self.next.wrapping_add(1);
            let old = self.entries[i].hash as u64;
            if self.index.get(&old) == Some(&i) {
                self.index.remove(&old);
            }
            i
        };
        self.entries[i].hash = hash;
        self.index.insert(hash as u64, i);
        i
    }
}
