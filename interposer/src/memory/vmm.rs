//! The virtual-memory calls a job makes to build its own growable address ranges, served by the
//! engine (by default; `POSSUM_SERVE_VMM=0` turns it off): PyTorch's expandable
//! segments reserve a range (`cuMemAddressReserve`, left to the driver), then per piece make
//! memory (`cuMemCreate`), map it (`cuMemMap`) and allow access (`cuMemSetAccess`, left to the
//! driver: the range is mapped), and later unmap (`cuMemUnmap`) and release (`cuMemRelease`) it.
//!
//! Served, `cuMemCreate` makes no memory: it hands the job a *token*, a handle value of
//! possum's ([`TOKEN_TAG`](crate::memory::tables::TOKEN_TAG) in its top bits). `cuMemMap` of a
//! token maps an engine buffer at the job's address ([`possum_engine::Engine::alloc_at`]): VA-stable and releasable like a
//! `cudaMalloc` the engine serves, its memory from the keeper when there is one, so the driver's
//! checkpoint finds none of it. The job's handle value stays valid across checkpoints because it
//! is not the driver's. Every piece of a device is in one engine group ([`GROUP`]): a tensor
//! may span pieces, so an operation that touches one is taken to touch all.
//!
//! Tokens are answered for by `cuMemRelease`, `cuMemRetainAllocationHandle` (of an address in a
//! piece) and `cuMemGetAllocationPropertiesFromHandle`. Not served (passed to the driver as
//! before): memory that is not plain device memory, or that asks for other handle types than a
//! POSIX fd, or compression (`possum status` counts them, with the first one's properties).
//! GPUDirect RDMA may be asked for: the engine's memory is RDMA capable where the device
//! supports it. `cuMemExportToShareableHandle` of a mapped token (CUDA IPC, e.g. NCCL's buffers
//! shared with its peers) hands out a POSIX fd of its memory from the keeper ([`export`]).
//! Refused (`CUDA_ERROR_NOT_SUPPORTED`, said in the log): a token mapped in part, at an offset,
//! twice, or again after its unmap (its contents would have to outlive the mapping), and an
//! export without a keeper (said on stderr).

use std::ffi::{c_int, c_uint};
use std::sync::atomic::{AtomicBool, Ordering};

use possum_engine::device::{DevPtr, Device};
use possum_engine::EngineError;

use crate::cuda::cbid::{INVALID_VALUE, NOT_SUPPORTED, OUT_OF_MEMORY, SUCCESS};
use crate::memory::tables::{memory, Token, VmmTable};
use crate::process::runtime::{state, Reentry};

/// The engine group of every piece (one per device's engine).
pub const GROUP: u64 = 1;

pub use crate::memory::tables::PROP_LEN;

/// Whether `handle` is one of possum's tokens.
pub fn is_token(handle: u64) -> bool {
    table().tokens.is_ours(handle)
}

/// The tokens and their figures.
fn table() -> &'static VmmTable {
    &memory().vmm
}

/// The device memory `cuMemCreate` was asked for, as far as serving it goes.
#[derive(Debug, Clone, Copy)]
pub struct Ask {
    /// `CUmemAllocationProp::location.id` of a device location.
    pub ordinal: usize,
    /// The whole `CUmemAllocationProp`.
    pub prop: [u8; PROP_LEN],
    /// Plain pinned device memory, at most a POSIX fd asked for as handle type, no compression
    /// or usage flags (RDMA capable or not), and `flags` 0: what the engine's memory is.
    pub plain: bool,
}

/// `cuMemCreate` of `size` bytes: `Some(Ok(token))` served, `Some(Err(code))` answered with an
/// error, `None` left to the driver.
pub fn create(size: u64, ask: Ask) -> Option<Result<u64, c_int>> {
    let st = state();
    if !st.cfg.tuning.serve_vmm || size == 0 || !st.managing() {
        return None;
    }
    if !ask.plain {
        let mut left = table().left.lock();
        left.0 += 1;
        left.1.get_or_insert(ask.prop);
        return None;
    }
    let _r = Reentry::enter();
    let eng = st.engine_or_create(ask.ordinal, || SUCCESS).ok()?;
    let dev = eng.engine.device();
    if size % dev.granularity() != 0 {
        return None; // the driver says what is wrong
    }
    // The memory is made at the map; an allocation that cannot fit fails here, as the driver's
    // would (a job frees its cache and tries again on this answer, not on a failed map).
    if let Ok((free, _)) = dev.memory_info() {
        if free < size {
            return Some(Err(OUT_OF_MEMORY));
        }
    }
    let token = table().tokens.add(Token {
        ordinal: ask.ordinal,
        size,
        mapped: None,
        used: false,
        prop: ask.prop,
        refs: 1,
        shared: false,
    });
    table().created.fetch_add(1, Ordering::Relaxed);
    Some(Ok(token))
}

/// Token `handle`'s device and where it is mapped now, if it is a live token.
fn placed(handle: u64) -> Option<(usize, Option<u64>)> {
    table()
        .tokens
        .lock()
        .get(&handle)
        .map(|t| (t.ordinal, t.mapped))
}

/// `cuMemMap(va, size, offset, handle, flags)` of a token: an engine buffer at `va`. `None`: not
/// a token (the driver's).
pub fn map(va: u64, size: u64, offset: u64, handle: u64, flags: u64) -> Option<c_int> {
    if !is_token(handle) {
        return None;
    }
    let st = state();
    let _r = Reentry::enter();
    let Some(eng) = placed(handle).and_then(|(o, _)| st.engine(o)) else {
        return Some(INVALID_VALUE);
    };
    // Not while a checkpoint holds the job, nor across its T0 (`gate::admit`).
    let _g = crate::ops::gate::admit(&eng);
    let mut tokens = table().tokens.lock();
    let Some(t) = tokens.get_mut(&handle) else {
        return Some(INVALID_VALUE);
    };
    if offset != 0 || size != t.size || flags != 0 || t.mapped.is_some() || t.used {
        crate::base::log::log(&format!(
            "cuMemMap of possum's handle {handle:#x} ({} bytes) at {va:#x}, {size} bytes at \
             offset {offset}: not supported (a handle is mapped once, whole; mapped before: {})",
            t.size, t.used
        ));
        return Some(NOT_SUPPORTED);
    }
    match eng.engine.alloc_at(DevPtr(va), size, GROUP) {
        Ok(_) => {
            t.mapped = Some(va);
            t.used = true;
            drop(tokens);
            table().mapped.fetch_add(1, Ordering::Relaxed);
            st.counters.managed_allocs.fetch_add(1, Ordering::Relaxed);
            st.allocations_changed(true);
            Some(SUCCESS)
        }
        Err(EngineError::Device(e)) if possum_cuda::is_out_of_memory(&e) => Some(OUT_OF_MEMORY),
        Err(e) => {
            crate::base::log::log(&format!(
                "cuMemMap of possum's handle {handle:#x} at {va:#x}: {e}"
            ));
            Some(INVALID_VALUE)
        }
    }
}

/// `cuMemUnmap(va, size)` of a range of pieces possum mapped: each one's buffer freed, contents
/// and all (the driver's handle would keep them; a token is not mapped again, see [`map`]).
/// `None`: no piece of possum's there (the driver's).
pub fn unmap(va: u64, size: u64) -> Option<c_int> {
    let st = state();
    if !st.cfg.tuning.serve_vmm {
        return None;
    }
    let end = va.checked_add(size)?;
    let pieces_in = || {
        st.engines().into_iter().find_map(|e| {
            let pieces: Vec<_> = e
                .engine
                .buffers()
                .into_iter()
                .filter(|b| b.group() == Some(GROUP))
                .filter(|b| b.va().0 < end && b.va().0 + b.mapped_size() > va)
                .collect();
            (!pieces.is_empty()).then_some((e, pieces))
        })
    };
    pieces_in()?;
    // Not while a checkpoint holds the job (its buffers may be released then).
    crate::ops::gate::wait_if_paused();
    let (eng, pieces) = pieces_in()?;
    // The pieces must tile the range exactly, as the driver's mappings must.
    let mut at = va;
    let mut sorted = pieces.clone();
    sorted.sort_by_key(|b| b.va().0);
    for b in &sorted {
        if b.va().0 != at {
            break;
        }
        at += b.mapped_size();
    }
    if at != end {
        crate::base::log::log(&format!(
            "cuMemUnmap({va:#x}, {size}): not whole mappings of possum's ({} there)",
            pieces.len()
        ));
        return Some(INVALID_VALUE);
    }
    let _r = Reentry::enter();
    for b in &sorted {
        if let Err(e) = eng.engine.free(b.va()) {
            crate::base::log::log(&format!("cuMemUnmap({va:#x}, {size}): {e}"));
            return Some(INVALID_VALUE);
        }
        st.to_dag(crate::process::dag::DagMsg::Free(b.id()));
        st.counters.managed_frees.fetch_add(1, Ordering::Relaxed);
    }
    for t in table().tokens.lock().values_mut() {
        if t.mapped.is_some_and(|a| a >= va && a < end) {
            t.mapped = None;
        }
    }
    st.allocations_changed(false);
    Some(SUCCESS)
}

/// `cuMemRelease(handle)` of a token: one reference dropped; at the last, forgotten (a piece
/// still mapped stays until its unmap). `None`: not a token.
pub fn release(handle: u64) -> Option<c_int> {
    if !is_token(handle) {
        return None;
    }
    Some(if table().tokens.release(handle) {
        SUCCESS
    } else {
        INVALID_VALUE
    })
}

/// `cuMemRetainAllocationHandle(addr)`: the token mapped at the piece holding `addr`, one more
/// reference taken. `None`: no piece of possum's there (the driver's).
pub fn retain(addr: u64) -> Option<Result<u64, c_int>> {
    let st = state();
    if !st.cfg.tuning.serve_vmm {
        return None;
    }
    let piece = st.engines().into_iter().find_map(|e| {
        e.engine
            .lookup(DevPtr(addr))
            .filter(|b| b.group() == Some(GROUP))
            .map(|b| b.va().0)
    })?;
    // `None`: its token released while it stays mapped: the driver would still answer;
    // possum cannot give a handle for it.
    Some(
        table()
            .tokens
            .retain(|t| t.mapped == Some(piece))
            .ok_or(INVALID_VALUE),
    )
}

/// `cuMemGetAllocationPropertiesFromHandle` of a token: the properties it was made with.
/// `None`: not a token.
pub fn props(handle: u64) -> Option<Result<[u8; PROP_LEN], c_int>> {
    if !is_token(handle) {
        return None;
    }
    Some(
        table()
            .tokens
            .lock()
            .get(&handle)
            .map(|t| t.prop)
            .ok_or(INVALID_VALUE),
    )
}

/// `cuMemExportToShareableHandle(handle, kind, flags)` of a token: for a piece mapped now whose
/// memory is a keeper's (`possum run`'s default), a new POSIX fd of that memory from the keeper
/// (`kind` 1, `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`), for the job to hand to another process
/// (NCCL shares its buffers with its peers on one host so). The memory stays the same across
/// possum's checkpoints left running (kept with the keeper while the job is held); a restore
/// from an image makes it anew, and what another process imported before is not it. Refused
/// (`CUDA_ERROR_NOT_SUPPORTED`, said once on stderr): a token not mapped, memory of the job's
/// own (no keeper), another handle type. `None`: not a token.
pub fn export(handle: u64, kind: c_uint, flags: u64) -> Option<Result<c_int, c_int>> {
    if !is_token(handle) {
        return None;
    }
    let st = state();
    let _r = Reentry::enter();
    let Some((ordinal, mapped)) = placed(handle) else {
        return Some(Err(INVALID_VALUE));
    };
    let why = match (kind, flags, mapped, st.engine(ordinal)) {
        (1, 0, Some(va), Some(eng)) => match eng.engine.device().share(DevPtr(va)) {
            Ok(fd) => {
                table().shared.fetch_add(1, Ordering::Relaxed);
                if let Some(t) = table().tokens.lock().get_mut(&handle) {
                    t.shared = true;
                }
                return Some(Ok(std::os::fd::IntoRawFd::into_raw_fd(fd)));
            }
            Err(e) => e.to_string(),
        },
        (1, 0, None, _) => "the handle is not mapped".to_string(),
        (1, _, _, _) => format!("flags {flags:#x}"),
        _ => format!("handle type {kind} (possum hands out POSIX fds only)"),
    };
    // Said once whether or not POSSUM_VERBOSE is set: the job's own error (NCCL's, say) would
    // not say why.
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "possum: cuMemExportToShareableHandle of possum's handle {handle:#x}: not supported \
             ({why}); run this job with POSSUM_SERVE_VMM=0 to leave such memory to the driver"
        );
    }
    Some(Err(NOT_SUPPORTED))
}

/// The pieces mapped now whose handles were exported, by (device, address): another process
/// may write them without this one seeing it, so a checkpoint copies them with every process
/// held, and keeps their memory with the keeper across it, for the peers that mapped it to map
/// it again (`imports.rs`).
pub fn shared_pieces() -> Vec<(usize, u64)> {
    table()
        .tokens
        .lock()
        .values()
        .filter(|t| t.shared)
        .filter_map(|t| Some((t.ordinal, t.mapped?)))
        .collect()
}

/// For `possum status`: tokens made and live, pieces mapped now and ever.
pub fn stats_json() -> serde_json::Value {
    let vmm = table();
    let (live, mapped_now) = vmm.tokens.count(|t| t.mapped.is_some());
    let left = *vmm.left.lock();
    serde_json::json!({
        "serving": state().cfg.tuning.serve_vmm,
        "handles_made": vmm.created.load(Ordering::Relaxed),
        "handles_live": live,
        "pieces_mapped_now": mapped_now,
        "pieces_mapped": vmm.mapped.load(Ordering::Relaxed),
        "handles_shared": vmm.shared.load(Ordering::Relaxed),
        "pieces_shared_now": shared_pieces().len(),
        "left_to_driver": left.0,
        "left_to_driver_first_prop": left.1.map(|p| p.iter().map(|b| format!("{b:02x}")).collect::<String>()),
    })
}
