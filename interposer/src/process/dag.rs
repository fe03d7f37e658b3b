//! What the launch path tells the `possum-dag` thread, which records the DAG off the launch path:
//! the messages ([`DagMsg`]) and the buffer sets they share ([`DagSets`]).
//!
//! Plain data: the state (`runtime.rs`) queues the messages and runs the thread; the hooks, the
//! validation and the allocators make them.

use std::sync::Arc;

use possum_analyzer::dag::BufRef;

/// The buffers of an operation as the DAG records them: built once per distinct operation and
/// shared (a launch repeating its kernel's last buffer sets sends the same `Arc`, not a copy).
#[derive(Debug, Default)]
pub struct DagSets {
    /// Buffers read.
    pub reads: Vec<BufRef>,
    /// Buffers written.
    pub writes: Vec<BufRef>,
}

impl DagSets {
    /// The sets from two lists.
    pub fn new(reads: &[BufRef], writes: &[BufRef]) -> Arc<DagSets> {
        Arc::new(DagSets {
            reads: reads.to_vec(),
            writes: writes.to_vec(),
        })
    }
}

/// What the `possum-dag` thread records. Launches queue these in a per-thread batch (no
/// allocation, no shared cache line per launch); a full batch goes to the thread in one send.
#[derive(Debug)]
pub enum DagMsg {
    /// A launch.
    Launch {
        /// What ran.
        op: DagOp,
        /// On which stream.
        stream: u64,
        /// Its buffers.
        sets: SetsRef,
    },
    /// The buffer sets of a launch-path memo entry, under `id` until [`DagMsg::Forget`]: the
    /// entry's launches then send only the id (no reference count touched by two threads per
    /// launch).
    Define {
        /// The id (`State::next_dag_id`).
        id: u64,
        /// The sets.
        sets: Arc<DagSets>,
    },
    /// A memo entry's sets are no longer used.
    Forget(u64),
    /// A managed buffer was freed.
    Free(u64),
    /// A kernel became opaque.
    Opaque(u64),
    /// Operations went unresolved since the last record ([`crate::base::config::ResolveMode`]): no dependency spans
    /// the gap.
    Gap,
}

/// The buffers of a [`DagMsg::Launch`].
#[derive(Debug)]
pub enum SetsRef {
    /// Those [`DagMsg::Define`]d under this id.
    Memo(u64),
    /// These (an operation seen once: a copy, a graph node).
    Once(Arc<DagSets>),
}

/// The operation of a [`DagMsg::Launch`].
#[derive(Debug, Clone, Copy)]
pub enum DagOp {
    /// A kernel, by handle (its name and state are looked up when recorded).
    Kernel(u64),
    /// A copy.
    Memcpy,
    /// A memset.
    Memset,
}
