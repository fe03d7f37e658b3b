//! What the callbacks saw: a counter per callback id and the set of distinct launched functions.
//!
//! The launch path ([`record`]) takes no lock and allocates nothing, except when a thread sees a
//! function handle that its small cache does not hold: then it takes the global set's read lock
//! to look the handle up, and its write lock only to insert a handle seen for the first time.

use std::cell::Cell;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;

use parking_lot::RwLock;
use serde_json::{json, Map, Value};

use crate::cuda::cbid::{Kind, CALLBACKS, ID_LIMIT};

/// Calls seen, per callback id.
static COUNTS: [AtomicU64; ID_LIMIT] = [const { AtomicU64::new(0) }; ID_LIMIT];

/// Every distinct function handle seen by a launch callback.
static FUNCTIONS: LazyLock<RwLock<HashSet<usize>>> = LazyLock::new(|| RwLock::new(HashSet::new()));

const CACHE_SLOTS: usize = 64;

thread_local! {
    /// Function handles this thread already put into [`FUNCTIONS`], direct-mapped by a hash of the
    /// handle. A const initialiser with no destructor: no allocation, no TLS destructor to register.
    static SEEN: [Cell<usize>; CACHE_SLOTS] = const { [const { Cell::new(0) }; CACHE_SLOTS] };
}

/// Records one call of callback `id`.
pub fn record(id: u32) {
    if let Some(c) = COUNTS.get(id as usize) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// Records that function handle `f` was launched (the launch path calls this on a thread's first
/// launch of `f`, and for captured launches; 0 is no function).
pub fn note_function(f: usize) {
    if f == 0 {
        return;
    }
    let slot = ((f >> 4) ^ (f >> 12)) % CACHE_SLOTS;
    // `try_with` fails only while the thread's TLS is being torn down; then skip the cache.
    let cached = SEEN
        .try_with(|seen| {
            if seen[slot].get() == f {
                true
            } else {
                seen[slot].set(f);
                false
            }
        })
        .unwrap_or(false);
    if !cached && !FUNCTIONS.read().contains(&f) {
        FUNCTIONS.write().insert(f);
    }
}

/// Calls seen of callback `id` so far.
pub fn count(id: u32) -> u64 {
    COUNTS
        .get(id as usize)
        .map_or(0, |c| c.load(Ordering::Relaxed))
}

/// Distinct function handles launched so far.
pub fn distinct_functions() -> u64 {
    FUNCTIONS.read().len() as u64
}

/// Calls seen so far of every callback of `kind`.
pub fn total(kind: Kind) -> u64 {
    CALLBACKS
        .iter()
        .filter(|c| c.kind == kind)
        .map(|c| count(c.id))
        .sum()
}

/// How the interposer's set-up went, for the statistics.
#[derive(Debug, Clone, Default)]
pub struct Setup {
    /// How possum sees the job's operations.
    pub hooks: crate::base::config::Hooks,
    /// Whether CUPTI was loaded and the subscription made.
    pub cupti: bool,
    /// The CUPTI library that was loaded.
    pub cupti_path: Option<String>,
    /// Why CUPTI is not in use, or which callbacks could not be enabled.
    pub error: Option<String>,
    /// How many callbacks were enabled.
    pub enabled: usize,
}

/// The statistics as one JSON object (see the crate documentation for its keys).
pub fn to_json(pid: u32, setup: &Setup) -> Value {
    let mut v = json!({
        "pid": pid,
        "hooks": setup.hooks.name(),
        "cupti": setup.cupti,
        "cupti_path": setup.cupti_path,
        "cupti_error": setup.error,
        "enabled_callbacks": setup.enabled,
        "graph_launches": total(Kind::Graph),
        "distinct_functions": distinct_functions(),
        "total_launches": total(Kind::Launch),
    });
    for kind in Kind::ALL {
        let counts: Map<String, Value> = CALLBACKS
            .iter()
            .filter(|c| c.kind == kind)
            .map(|c| (c.name.to_string(), count(c.id).into()))
            .collect();
        v[kind.key()] = counts.into();
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    // The counters are process-wide, so these tests only ever add and compare differences, using
    // ids no other unit test records.

    #[test]
    fn counts_and_distinct_functions() {
        let before = count(653);
        let d0 = distinct_functions();
        let fs = [0x7000_1000usize, 0x7000_2000, 0x7000_1000, 0x7000_1000];
        for f in fs {
            record(653);
            note_function(f);
        }
        record(653);
        note_function(0); // a null handle is counted as a call but not as a function
        assert_eq!(count(653) - before, 5);
        assert_eq!(distinct_functions() - d0, 2);
        // Another thread sees the same handles: its cache misses, the global set does not grow.
        std::thread::spawn(move || {
            for f in fs {
                record(653);
                note_function(f);
            }
        })
        .join()
        .unwrap();
        assert_eq!(distinct_functions() - d0, 2);
        assert_eq!(count(653) - before, 9);
    }

    #[test]
    fn out_of_range_ids_are_ignored() {
        record(ID_LIMIT as u32 + 5);
        assert_eq!(count(ID_LIMIT as u32 + 5), 0);
    }

    #[test]
    fn json_is_valid_and_complete() {
        record(514);
        let setup = Setup {
            hooks: crate::base::config::Hooks::Entry,
            cupti: false,
            cupti_path: None,
            error: Some("not \"found\"\n".into()),
            enabled: 0,
        };
        let v = to_json(42, &setup);
        assert_eq!(v["pid"], 42);
        assert_eq!(v["cupti"], false);
        assert_eq!(v["cupti_error"], "not \"found\"\n");
        assert!(v["graph_launches"].as_u64().unwrap() >= 1);
        for c in CALLBACKS {
            assert!(v[c.kind.key()][c.name].is_u64(), "{}", c.name);
        }
        assert!(v["total_launches"].is_u64());
        assert!(v["distinct_functions"].is_u64());
    }
}
