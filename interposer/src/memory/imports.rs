//! Memory another process of the job shared with this one, served: NCCL's ranks on one host
//! export their buffers (`cuMemExportToShareableHandle`, a POSIX fd) and each imports its peers'
//! (`cuMemImportFromShareableHandle`) and maps them (`cuMemMap`). NVIDIA's driver checkpoint
//! cannot restore a process holding imported memory, so possum holds none at its lock: the
//! imports are released at the checkpoint's release and imported again at its resume.
//!
//! An fd the keeper handed out (`vmm::export` of memory possum serves in the exporting process)
//! is known to the keeper again (`identify`): its import answers the job with a handle of
//! possum's (an *import token*, [`IMPORT_TAG`](crate::memory::tables::IMPORT_TAG) in its top
//! bits) that stays valid across checkpoints, and its `cuMemMap` maps the keeper's memory at the job's address
//! ([`PeerMapping`]). At the release ([`detach`]) each mapping is unmapped and its handle
//! released; at the resume ([`attach`]) the keeper gives a new fd of the same allocation
//! (`peer_share`, which names the owner and the keeper's instance, so a keeper started anew
//! never hands out other memory under an old number) and it is mapped at the same address again.
//! The exporting process keeps its shared memory with the keeper across the checkpoint
//! (`session/release.rs`), so the peer finds the same bytes.
//!
//! Left to the driver (and refused at a checkpoint, by `possum checkpoint`'s plan): an fd the
//! keeper does not know (memory of a process possum does not serve, another handle type), and
//! imports without a keeper. A token is mapped whole, once at a time.

use std::ffi::c_int;
use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use possum_cuda::share::PeerMapping;
use possum_keeper::Keeper;

use crate::base::log::log;
use crate::cuda::cbid::{INVALID_VALUE, NOT_SUPPORTED, SUCCESS};
use crate::memory::tables::{memory, Import, ImportTable, Mapped, PROP_LEN};
use crate::process::runtime::{state, Reentry};

/// Whether `handle` is an import token.
pub fn is_import(handle: u64) -> bool {
    table().handles.is_ours(handle)
}

/// The import tokens and their figures.
fn table() -> &'static ImportTable {
    &memory().imports
}

/// `cuMemImportFromShareableHandle` of POSIX fd `fd`: `Some(token)` for one a keeper of this
/// job handed out; `None` for anything else (the driver's import).
pub fn import(fd: BorrowedFd<'_>) -> Option<u64> {
    let st = state();
    let dir = crate::base::config::get().user.keeper.as_ref()?;
    if !st.cfg.tuning.serve_vmm || !st.managing() {
        return None;
    }
    let (keeper_device, keeper, found) = possum_keeper::sockets_in(dir)
        .into_iter()
        .enumerate()
        .find_map(|(device, s)| {
            let found = Keeper::connect(&s)
                .and_then(|mut k| k.identify(fd))
                .ok()??;
            Some((device, s, found))
        })?;
    let _r = Reentry::enter();
    let ordinal = possum_cuda::introspect::current_device().unwrap_or(0);
    let token = table().handles.add(Import {
        found,
        keeper,
        keeper_device,
        ordinal,
        mapped: None,
        refs: 1,
    });
    table().imported.fetch_add(1, Ordering::Relaxed);
    Some(token)
}

/// Why memory another process shared with this one could not be let go of or had again.
#[derive(Debug, thiserror::Error)]
pub enum ImportsError {
    /// Its keeper could not hand it out again.
    #[error(
        "the memory process {owner} shared with this one (allocation {id} of keeper {}) is not \
         to be had: {source} (a job whose processes map each other's memory comes back only \
         while the keeper that held it at the checkpoint still does; restored from an image, \
         its memory is made anew)",
        keeper.display()
    )]
    NotToBeHad {
        /// The process that shared it.
        owner: i32,
        /// The keeper's allocation.
        id: u64,
        /// The keeper's socket.
        keeper: PathBuf,
        /// What the keeper said.
        source: possum_keeper::KeeperError,
    },
    /// The driver could not map it again.
    #[error("mapping the memory process {owner} shared with this one at {va:#x}: {source}")]
    Map {
        /// The process that shared it.
        owner: i32,
        /// Where.
        va: u64,
        /// The driver's error.
        source: possum_engine::device::DeviceError,
    },
    /// The driver could not unmap it.
    #[error(
        "releasing the memory process {owner} shared with this one (mapped at {va:#x}): {source}"
    )]
    Unmap {
        /// The process that shared it.
        owner: i32,
        /// Where.
        va: u64,
        /// The driver's error.
        source: possum_engine::device::DeviceError,
    },
}

/// The allocation's memory mapped at `va`: a new fd from its keeper, imported and mapped.
fn map_peer(t: &Import, va: u64) -> Result<PeerMapping, ImportsError> {
    let fd = Keeper::connect(&t.keeper)
        .and_then(|mut k| k.peer_share(&t.found))
        .map_err(|source| ImportsError::NotToBeHad {
            owner: t.found.owner,
            id: t.found.id,
            keeper: t.keeper.clone(),
            source,
        })?;
    use std::os::fd::AsFd;
    PeerMapping::map(t.ordinal, fd.as_fd(), t.found.size, va).map_err(|source| ImportsError::Map {
        owner: t.found.owner,
        va,
        source,
    })
}

/// `cuMemMap(va, size, offset, handle, flags)` of an import token. `None`: not one.
pub fn map(va: u64, size: u64, offset: u64, handle: u64, flags: u64) -> Option<c_int> {
    if !is_import(handle) {
        return None;
    }
    // Not while a checkpoint has the imports released.
    crate::ops::gate::wait_if_paused();
    let _r = Reentry::enter();
    let mut imports = table().handles.lock();
    let Some(t) = imports.get_mut(&handle) else {
        return Some(INVALID_VALUE);
    };
    if offset != 0 || size != t.found.size || flags != 0 || t.mapped.is_some() {
        log(&format!(
            "cuMemMap of imported handle {handle:#x} ({} bytes) at {va:#x}, {size} bytes at \
             offset {offset}: not supported (mapped whole, once at a time)",
            t.found.size
        ));
        return Some(NOT_SUPPORTED);
    }
    match map_peer(t, va) {
        Ok(m) => {
            t.mapped = Some(Mapped {
                va,
                mapping: Some(m),
            });
            Some(SUCCESS)
        }
        Err(e) => {
            log(&format!("cuMemMap of imported handle {handle:#x}: {e}"));
            Some(INVALID_VALUE)
        }
    }
}

/// `cuMemUnmap(va, size)` of an imported allocation's whole mapping. `None`: none at `va`.
pub fn unmap(va: u64, size: u64) -> Option<c_int> {
    let mut imports = table().handles.lock();
    let (&handle, t) = imports
        .iter_mut()
        .find(|(_, t)| t.mapped.as_ref().is_some_and(|p| p.va == va))?;
    if size != t.found.size {
        return Some(INVALID_VALUE);
    }
    drop(imports);
    crate::ops::gate::wait_if_paused();
    let _r = Reentry::enter();
    let mut imports = table().handles.lock();
    let t = imports.get_mut(&handle)?;
    let Some(mapped) = t.mapped.take() else {
        return Some(INVALID_VALUE);
    };
    let r = match mapped.mapping.map(PeerMapping::unmap) {
        Some(Err(e)) => {
            log(&format!("cuMemUnmap({va:#x}) of imported memory: {e}"));
            INVALID_VALUE
        }
        _ => SUCCESS,
    };
    if t.refs == 0 {
        imports.remove(&handle);
    }
    Some(r)
}

/// `cuMemRelease` of an import token: one reference dropped; at the last, forgotten once it is
/// unmapped. `None`: not one.
pub fn release(handle: u64) -> Option<c_int> {
    if !is_import(handle) {
        return None;
    }
    Some(if table().handles.release(handle) {
        SUCCESS
    } else {
        INVALID_VALUE
    })
}

/// `cuMemRetainAllocationHandle(addr)` of an address in an imported mapping: its token, one
/// more reference. `None`: no such mapping there.
pub fn retain(addr: u64) -> Option<u64> {
    table().handles.retain(|t| {
        t.mapped
            .as_ref()
            .is_some_and(|p| addr >= p.va && addr - p.va < t.found.size)
    })
}

/// `cuMemGetAllocationPropertiesFromHandle` of an import token: pinned device memory on the
/// keeper's device, shareable as a POSIX fd. `None`: not one.
pub fn props(handle: u64) -> Option<Result<[u8; PROP_LEN], c_int>> {
    if !is_import(handle) {
        return None;
    }
    let Some(device) = table().handles.lock().get(&handle).map(|t| t.keeper_device) else {
        return Some(Err(INVALID_VALUE));
    };
    let device = device as u32;
    let mut p = [0u8; PROP_LEN];
    // type PINNED, requestedHandleTypes POSIX_FILE_DESCRIPTOR, location DEVICE and its id.
    for (at, v) in [(0, 1u32), (4, 1), (8, 1), (12, device)] {
        p[at..at + 4].copy_from_slice(&v.to_ne_bytes());
    }
    Some(Ok(p))
}

/// At a checkpoint's release (the job held): every imported mapping unmapped and its handle
/// released, so that the driver's checkpoint finds no imported memory. Each is mapped again by
/// [`attach`]. The number released; on an error, those released so far stay so (the resume
/// maps them again).
pub fn detach() -> Result<u64, ImportsError> {
    let _r = Reentry::enter();
    let mut imports = table().handles.lock();
    let mut n = 0;
    for t in imports.values_mut() {
        let Some(p) = t.mapped.as_mut() else {
            continue;
        };
        if let Some(mapping) = p.mapping.take() {
            mapping.unmap().map_err(|source| ImportsError::Unmap {
                owner: t.found.owner,
                va: p.va,
                source,
            })?;
            n += 1;
        }
    }
    table().detaches.fetch_add(n, Ordering::Relaxed);
    Ok(n)
}

/// At the resume: every mapping [`detach`] released, mapped again at its address. The number
/// mapped; an error names the memory that could not be had (its keeper gone, or its owner's
/// memory made anew by a restore from an image).
pub fn attach() -> Result<u64, ImportsError> {
    let _r = Reentry::enter();
    let mut imports = table().handles.lock();
    let mut n = 0;
    for t in imports.values_mut() {
        let Some(va) = t
            .mapped
            .as_ref()
            .filter(|p| p.mapping.is_none())
            .map(|p| p.va)
        else {
            continue;
        };
        let m = map_peer(t, va)?;
        if let Some(p) = t.mapped.as_mut() {
            p.mapping = Some(m);
        }
        n += 1;
    }
    Ok(n)
}

/// For `possum status`: imports served, mapped now, and released by checkpoints.
pub fn stats_json() -> serde_json::Value {
    let (live, mapped) = table().handles.count(|t| t.mapped.is_some());
    serde_json::json!({
        "imported": table().imported.load(Ordering::Relaxed),
        "live": live,
        "mapped_now": mapped,
        "released_at_checkpoints": table().detaches.load(Ordering::Relaxed),
    })
}
