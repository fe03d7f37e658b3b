//! `cudaMalloc` / `cudaFree` served by the engine: each allocation is a VA-stable, releasable
//! buffer (a reservation with physical memory mapped under it), so a checkpoint can drop and
//! re-create its memory at the same address. Anything possum does not serve goes to libcudart.

use std::sync::atomic::Ordering;

use possum_cuda::introspect;
use possum_engine::device::DevPtr;
use possum_engine::EngineError;

use crate::process::runtime::{state, Reentry, State};

/// What `cudaMalloc` should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Malloc {
    /// Served by the engine at this address.
    Managed(u64),
    /// The device has no room: `cudaErrorMemoryAllocation`.
    OutOfMemory,
    /// Pass the call to libcudart.
    Fallback,
}

/// What `cudaFree` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freed {
    /// An engine buffer, freed.
    Done,
    /// An engine buffer that could not be freed (`cudaErrorInvalidValue`).
    Failed,
    /// Not possum's: pass the call to libcudart.
    NotManaged,
}

/// Serves `cudaMalloc(size)` on the runtime's current device (`device()`); `init` initialises
/// the runtime's context (`cudaFree(NULL)`) before the first engine is made.
pub fn malloc(
    size: u64,
    device: impl FnOnce() -> Option<usize>,
    init: impl FnOnce() -> i32,
) -> Malloc {
    let st = state();
    let m = serve(st, size, device, init);
    if m == Malloc::Fallback {
        st.counters.fallback_allocs.fetch_add(1, Ordering::Relaxed);
    }
    m
}

fn serve(
    st: &State,
    size: u64,
    device: impl FnOnce() -> Option<usize>,
    init: impl FnOnce() -> i32,
) -> Malloc {
    if size == 0 || !st.managing() {
        return Malloc::Fallback;
    }
    let _r = Reentry::enter();
    let Some(ordinal) = device() else {
        return Malloc::Fallback;
    };
    let Ok(eng) = st.engine_or_create(ordinal, init) else {
        return Malloc::Fallback;
    };
    // Not while a checkpoint holds the job, nor across its T0 (`gate::admit`).
    let made = {
        let _g = crate::ops::gate::admit(&eng);
        eng.engine.alloc(size)
    };
    match made {
        Ok(b) => {
            st.counters.managed_allocs.fetch_add(1, Ordering::Relaxed);
            st.allocations_changed(true);
            Malloc::Managed(b.va().0)
        }
        Err(EngineError::Device(e)) if possum_cuda::is_out_of_memory(&e) => Malloc::OutOfMemory,
        Err(e) => {
            crate::base::log::log(&format!(
                "engine allocation of {size} bytes failed ({e}); using libcudart"
            ));
            Malloc::Fallback
        }
    }
}

/// Serves `cudaFree(ptr)` for engine buffers: waits for the device (as `cudaFree` does), then
/// unmaps and frees the reservation.
pub fn free(ptr: u64) -> Freed {
    let st = state();
    crate::ops::gate::wait_if_paused();
    // A block of a stream-ordered allocation possum serves (`pools.rs`).
    if crate::memory::pools::is_served(ptr) {
        let _r = Reentry::enter();
        if let Err(e) = introspect::ctx_synchronize() {
            crate::base::log::log(&format!("cudaFree({ptr:#x}): {e}"));
            return Freed::Failed;
        }
        return match crate::memory::pools::free_now(ptr) {
            Some(0) => Freed::Done,
            _ => Freed::Failed,
        };
    }
    let Some((eng, id)) = st.engines().into_iter().find_map(|e| {
        let b = e.engine.lookup(DevPtr(ptr)).filter(|b| b.va().0 == ptr)?;
        Some((e, b.id()))
    }) else {
        return Freed::NotManaged;
    };
    let _r = Reentry::enter();
    if let Err(e) = introspect::ctx_synchronize() {
        crate::base::log::log(&format!("cudaFree({ptr:#x}): {e}"));
        return Freed::Failed;
    }
    match eng.engine.free(DevPtr(ptr)) {
        Ok(()) => {
            st.allocations_changed(false);
            st.counters.managed_frees.fetch_add(1, Ordering::Relaxed);
            st.to_dag(crate::process::dag::DagMsg::Free(id));
            Freed::Done
        }
        Err(e) => {
            crate::base::log::log(&format!("cudaFree({ptr:#x}): {e}"));
            Freed::Failed
        }
    }
}
