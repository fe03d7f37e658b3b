//! Stream-ordered allocation served by the engine (by default; `POSSUM_SERVE_POOLS=0` turns it
//! off): `cuMemAllocAsync` and `cuMemFreeAsync` (and their `_ptsz` forms), what
//! `cudaMallocAsync` / `cudaFreeAsync` and PyTorch's `backend:cudaMallocAsync` use. Without it
//! that memory is the driver's pool's, which NVIDIA's checkpoint copies while the job is held.
//!
//! Served, an allocation is carved out of a *slab*, an engine buffer of [`SLAB`] bytes (VA-stable,
//! releasable, the keeper's memory when there is one), or is an engine buffer of its own from
//! half a slab up. An allocation lies inside one buffer, so the hooks resolve a pointer into it
//! to that buffer. A free is stream-ordered: an event is recorded on the freeing stream; the
//! block serves the next allocation of its size on that same stream at once (stream order, as
//! in the driver's pool), and any other once the event has completed (checked at the next
//! allocations and frees); a free on a stream being captured into a graph leaves the block unused for good (a graph's free
//! runs when the graph does), said once in the log. An allocation on a capturing stream is the
//! driver's (a graph allocation node). `cuMemFree_v2` / `cudaFree` of a block frees it at once
//! (the caller synchronised). Empty slabs beyond [`SPARE_SLABS`] go back to the engine.
//!
//! Not served: `cuMemAllocFromPoolAsync` (a pool of the job's own, whose properties possum does
//! not copy), and the pool calls themselves (`cuMemPoolTrimTo`, attributes), which go to the
//! driver's pools, then empty.

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};

use possum_engine::device::{DevPtr, Device};
use possum_engine::EngineError;

use crate::cuda::cbid::{OUT_OF_MEMORY, SUCCESS};
use crate::memory::tables::{memory, pool_of, Block, DevicePool, Pending, Slab};
use crate::process::runtime::{state, DevEngine, Reentry};

/// Bytes of a slab.
pub const SLAB: u64 = 32 << 20;
/// Allocations are this aligned (the driver's pools give at least 256).
const ALIGN: u64 = 512;
/// Empty slabs kept for the next allocations, per device.
const SPARE_SLABS: usize = 2;

impl Slab {
    /// An empty slab of `size` bytes.
    fn new(size: u64) -> Slab {
        Slab {
            free: BTreeMap::from([(0, size)]),
            used: 0,
        }
    }

    /// `len` bytes from the first free range that holds them: their offset.
    fn take(&mut self, len: u64) -> Option<u64> {
        let (off, avail) = self
            .free
            .iter()
            .find(|(_, &l)| l >= len)
            .map(|(&o, &l)| (o, l))?;
        self.free.remove(&off);
        if avail > len {
            self.free.insert(off + len, avail - len);
        }
        self.used += len;
        Some(off)
    }

    /// `len` bytes at `off` free again, joined with the free ranges on either side.
    fn put(&mut self, off: u64, len: u64) {
        let (mut start, mut total) = (off, len);
        if let Some((&o, &l)) = self.free.range(..off).next_back() {
            if o + l == off {
                self.free.remove(&o);
                start = o;
                total += l;
            }
        }
        if let Some(l) = self.free.remove(&(off + len)) {
            total += l;
        }
        self.free.insert(start, total);
        self.used -= len;
    }
}

/// `cuMemAllocAsync(size, stream)` on device `ordinal`: `Some(Ok(ptr))` served, `Some(Err(code))`
/// answered with an error, `None` the driver's. `stream` is the raw handle as the engine names
/// streams (the per-thread default stream already mapped).
pub fn alloc(ordinal: usize, size: u64, stream: u64) -> Option<Result<u64, c_int>> {
    let st = state();
    if !st.cfg.tuning.serve_pools || size == 0 || !st.managing() {
        return None;
    }
    if possum_cuda::introspect::is_capturing(stream).unwrap_or(true) {
        return None;
    }
    // A paused job frees nothing (its buffers may be released, and in its image).
    crate::ops::gate::wait_if_paused();
    let _r = Reentry::enter();
    let eng = st.engine_or_create(ordinal, || SUCCESS).ok()?;
    let len = size.checked_next_multiple_of(ALIGN)?;
    {
        let mut pools = memory().pools.lock();
        let pool = pool_of(&mut pools, ordinal);
        // A block of this size freed on this same stream serves at once, as the driver's pool
        // does: the stream orders the new use after the free. Not on the per-thread default
        // stream, whose handle names another stream in each thread. (No engine buffer is made:
        // this needs no admission.)
        let same = (stream != crate::cuda::decode::STREAM_PER_THREAD)
            .then(|| {
                pool.pending
                    .iter()
                    .position(|p| p.stream == stream && p.block.len == len)
            })
            .flatten();
        if let Some(i) = same {
            let p = pool.pending.remove(i);
            pool.live.insert(p.ptr, p.block);
            memory().pools.served.fetch_add(1, Ordering::Relaxed);
            memory().pools.reused.fetch_add(1, Ordering::Relaxed);
            return Some(Ok(p.ptr));
        }
        // Then blocks whose free has completed: freeing their buffers enters the engine's gate,
        // which the admission below must not hold yet.
        reclaim(&eng, pool);
    }
    // Not while a checkpoint holds the job, nor across its T0 (`gate::admit`): a slab made
    // after T0 would be released without being in the image.
    let _g = crate::ops::gate::admit(&eng);
    let mut pools = memory().pools.lock();
    let pool = pool_of(&mut pools, ordinal);
    let made = if len >= SLAB / 2 {
        new_buffer(&eng, len).map(|va| {
            (
                va,
                Block {
                    buffer: va,
                    len,
                    own: true,
                },
            )
        })
    } else {
        carve(&eng, pool, len)
    };
    match made {
        Ok((ptr, block)) => {
            pool.live.insert(ptr, block);
            memory().pools.served.fetch_add(1, Ordering::Relaxed);
            Some(Ok(ptr))
        }
        Err(EngineError::Device(e)) if possum_cuda::is_out_of_memory(&e) => {
            Some(Err(OUT_OF_MEMORY))
        }
        Err(e) => {
            crate::base::log::log(&format!(
                "cuMemAllocAsync of {size} bytes: {e}; the driver's pool serves it"
            ));
            None
        }
    }
}

/// A new engine buffer of `len` bytes (a slab, or a block's own), counted as a managed
/// allocation: its address.
fn new_buffer(eng: &DevEngine, len: u64) -> Result<u64, EngineError> {
    let va = eng.engine.alloc(len)?.va().0;
    let st = state();
    st.counters.managed_allocs.fetch_add(1, Ordering::Relaxed);
    st.allocations_changed(true);
    Ok(va)
}

/// Frees engine buffer `va` (a slab, or a block's own), counted as a managed free: whether it
/// went (`what` names it in the log otherwise).
fn drop_buffer(eng: &DevEngine, va: u64, what: &str) -> bool {
    if let Err(e) = eng.engine.free(DevPtr(va)) {
        crate::base::log::log(&format!("freeing {what} at {va:#x}: {e}"));
        return false;
    }
    let st = state();
    st.counters.managed_frees.fetch_add(1, Ordering::Relaxed);
    st.allocations_changed(false);
    true
}

/// `len` bytes from a slab with room, or from a new one: (address, block).
fn carve(eng: &DevEngine, pool: &mut DevicePool, len: u64) -> Result<(u64, Block), EngineError> {
    let fit = pool
        .slabs
        .iter_mut()
        .find_map(|(&va, s)| s.take(len).map(|off| (va, off)));
    let (slab_va, off) = match fit {
        Some(f) => f,
        None => {
            let va = new_buffer(eng, SLAB)?;
            let mut s = Slab::new(SLAB);
            let off = s
                .take(len)
                .expect("an empty slab holds less than half of it");
            pool.slabs.insert(va, s);
            (va, off)
        }
    };
    Ok((
        slab_va + off,
        Block {
            buffer: slab_va,
            len,
            own: false,
        },
    ))
}

/// Blocks whose free has completed go back to their slabs (or their buffers to the engine),
/// the oldest first, asking the driver about at most [`RECLAIM_QUERIES`] events per allocation.
fn reclaim(eng: &DevEngine, pool: &mut DevicePool) {
    reclaim_some(eng, pool, RECLAIM_QUERIES);
}

/// [`reclaim`], asking about at most `queries` events.
fn reclaim_some(eng: &DevEngine, pool: &mut DevicePool, queries: usize) {
    let dev = eng.engine.device();
    let mut i = 0;
    let mut asked = 0;
    while i < pool.pending.len() && asked < queries {
        asked += 1;
        if dev.event_query(&pool.pending[i].event).unwrap_or(false) {
            let p = pool.pending.remove(i);
            give_back(eng, pool, p.ptr, p.block);
        } else {
            i += 1;
        }
    }
}

/// Events [`reclaim`] asks about per allocation.
const RECLAIM_QUERIES: usize = 64;

/// `block` at `ptr` free again.
fn give_back(eng: &DevEngine, pool: &mut DevicePool, ptr: u64, block: Block) {
    if block.own {
        drop_buffer(eng, block.buffer, "a stream-ordered block");
        return;
    }
    let Some(s) = pool.slabs.get_mut(&block.buffer) else {
        return;
    };
    s.put(ptr - block.buffer, block.len);
    let empty: Vec<u64> = pool
        .slabs
        .iter()
        .filter(|(_, s)| s.used == 0)
        .map(|(&va, _)| va)
        .collect();
    for va in empty.into_iter().skip(SPARE_SLABS) {
        if drop_buffer(eng, va, "an empty slab") {
            pool.slabs.remove(&va);
        }
    }
}

/// Whether stream-ordered allocations are served (`POSSUM_SERVE_POOLS`, on by default).
pub fn serving() -> bool {
    state().cfg.tuning.serve_pools
}

/// Whether `ptr` is a block possum serves (live).
pub fn is_served(ptr: u64) -> bool {
    find(ptr).is_some()
}

/// The device of a served `ptr`, if it is one.
fn find(ptr: u64) -> Option<usize> {
    memory()
        .pools
        .lock()
        .iter()
        .find(|(_, p)| p.live.contains_key(&ptr))
        .map(|(&o, _)| o)
}

/// `cuMemFreeAsync(ptr, stream)` of a served block: reusable once `stream` reaches this point.
/// `None`: not served here (the driver's).
pub fn free_async(ptr: u64, stream: u64) -> Option<c_int> {
    let ordinal = find(ptr)?;
    let st = state();
    let eng = st.engine(ordinal)?;
    // A paused job does nothing on the GPU (the driver may hold its lock meanwhile).
    crate::ops::gate::wait_if_paused();
    let _r = Reentry::enter();
    let event = if possum_cuda::introspect::is_capturing(stream).unwrap_or(true) {
        static SAID: AtomicBool = AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            crate::base::log::log(
                "cuMemFreeAsync of a block possum serves on a stream being captured into a graph: \
                 the block is not reused (a graph's free runs when the graph does)",
            );
        }
        None
    } else {
        let s = eng.stream(stream);
        match eng.engine.device().record_event(&s) {
            Ok(ev) => Some(ev),
            Err(e) => {
                crate::base::log::log(&format!(
                    "cuMemFreeAsync({ptr:#x}): no event ({e}); waiting for the stream"
                ));
                let _ = eng.engine.device().synchronize(&s);
                return free_now(ptr);
            }
        }
    };
    let mut pools = memory().pools.lock();
    let pool = pools.get_mut(&ordinal)?;
    let block = pool.live.remove(&ptr)?;
    // A few of the oldest frees back first, so that a job freeing faster than it allocates does
    // not pile them up (GPT-2 small had 446 waiting at one moment); this one stays pending, for
    // the next allocation of its size on its stream.
    reclaim_some(&eng, pool, FREE_RECLAIM_QUERIES);
    match event {
        Some(event) => pool.pending.push(Pending {
            event,
            ptr,
            block,
            stream,
        }),
        None => pool.lost += block.len,
    }
    Some(SUCCESS)
}

/// Events a `cuMemFreeAsync` asks about.
const FREE_RECLAIM_QUERIES: usize = 4;

/// `cuMemFree_v2` / `cudaFree` of a served block (the caller has synchronised): free at once.
/// `None`: not served here.
pub fn free_now(ptr: u64) -> Option<c_int> {
    let ordinal = find(ptr)?;
    let eng = state().engine(ordinal)?;
    let _r = Reentry::enter();
    let mut pools = memory().pools.lock();
    let pool = pools.get_mut(&ordinal)?;
    let block = pool.live.remove(&ptr)?;
    give_back(&eng, pool, ptr, block);
    Some(SUCCESS)
}

/// For `possum status`: what is served now.
pub fn stats_json() -> serde_json::Value {
    let pools = memory().pools.lock();
    let (slabs, live, pending, bytes, lost) =
        pools
            .values()
            .fold((0, 0, 0, 0u64, 0u64), |(s, l, p, b, x), d| {
                (
                    s + d.slabs.len(),
                    l + d.live.len(),
                    p + d.pending.len(),
                    b + d.live.values().map(|x| x.len).sum::<u64>(),
                    x + d.lost,
                )
            });
    serde_json::json!({
        "serving": state().cfg.tuning.serve_pools,
        "allocations_served": memory().pools.served.load(Ordering::Relaxed),
        "reused_on_their_stream": memory().pools.reused.load(Ordering::Relaxed),
        "slabs": slabs,
        "blocks_live": live,
        "blocks_pending_free": pending,
        "bytes_live": bytes,
        "bytes_lost_to_captures": lost,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// First fit, and freed ranges joined with their neighbours, so a slab emptied piece by piece
    /// in any order is one free range again.
    #[test]
    fn a_slab_hands_out_first_fit_and_joins_what_is_freed() {
        let mut s = Slab::new(4096);
        let a = s.take(1024).unwrap();
        let b = s.take(1024).unwrap();
        let c = s.take(1024).unwrap();
        assert_eq!((a, b, c), (0, 1024, 2048));
        assert_eq!(s.used, 3072);
        assert_eq!(s.take(2048), None, "1024 bytes left");
        s.put(b, 1024);
        assert_eq!(s.take(512), Some(1024), "the first range that fits");
        s.put(1024, 512);
        s.put(a, 1024);
        assert_eq!(
            s.free.get(&0),
            Some(&2048),
            "joined on both sides: {:?}",
            s.free
        );
        s.put(c, 1024);
        assert_eq!(s.free.len(), 1, "{:?}", s.free);
        assert_eq!(s.free.get(&0), Some(&4096));
        assert_eq!(s.used, 0);
    }
}
