//! NCCL's communicator entry points, exported so that `LD_PRELOAD` puts them in front of
//! libnccl's: one of the crate's modules with `unsafe` code.
//!
//! possum does not change what they do: it notes each communicator the process gets a rank in,
//! with the number of ranks it has in all and an id every one of its ranks shares, whichever
//! process it is in ([`crate::ops::collective::note_communicator`]). A checkpoint's plan compares them
//! with the job's tree: a communicator with ranks outside it (another host) cannot be cut with it,
//! and is refused before anything is held. The real functions are found with
//! `dlsym(RTLD_NEXT)`. A program that reaches NCCL through `dlsym` on a handle of its gets these
//! too (`entry.rs`).
#![allow(unsafe_code)]
#![allow(non_snake_case)]

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::ops::collective::{communicator_id, forget_communicator, note_communicator};

/// `ncclResult_t`: `ncclSuccess`, `ncclInProgress` (a non-blocking init under way), and
/// `ncclInternalError` (answered when NCCL has no such function).
type NcclResult = c_int;
const SUCCESS: NcclResult = 0;
const IN_PROGRESS: NcclResult = 7;
const INTERNAL_ERROR: NcclResult = 3;
/// `NCCL_SPLIT_NOCOLOR`: the rank takes no part in the split.
const NO_COLOR: c_int = -1;

/// `ncclUniqueId`: 128 opaque bytes, the same at every rank of a communicator, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    internal: [u8; 128],
}

type Comm = *mut c_void;
type InitRankFn = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> NcclResult;
type InitRankConfigFn =
    unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut c_void) -> NcclResult;
type InitAllFn = unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> NcclResult;
type SplitFn = unsafe extern "C" fn(Comm, c_int, c_int, *mut Comm, *mut c_void) -> NcclResult;
type CommFn = unsafe extern "C" fn(Comm) -> NcclResult;
type CountFn = unsafe extern "C" fn(Comm, *mut c_int) -> NcclResult;

static INIT_RANK: AtomicUsize = AtomicUsize::new(0);
static INIT_RANK_CONFIG: AtomicUsize = AtomicUsize::new(0);
static INIT_ALL: AtomicUsize = AtomicUsize::new(0);
static SPLIT: AtomicUsize = AtomicUsize::new(0);
static DESTROY: AtomicUsize = AtomicUsize::new(0);
static ABORT: AtomicUsize = AtomicUsize::new(0);
static COUNT: AtomicUsize = AtomicUsize::new(0);

/// NCCL's function `name`, looked up once into `slot` (0: NCCL has none).
use crate::base::elfsym::next_definition as real;

/// Calls NCCL's function `$name` (kept in `$slot`) of type `$ty` with the arguments; the caller
/// returns `ncclInternalError` where NCCL has no such function.
macro_rules! call_nccl {
    ($slot:expr, $name:expr, $ty:ty, $($arg:expr),*) => {{
        let p = real(&$slot, $name);
        if p == 0 {
            return INTERNAL_ERROR;
        }
        // SAFETY: NCCL's function `$name`, whose C signature is `$ty`, with the caller's
        // arguments.
        unsafe { std::mem::transmute::<usize, $ty>(p)($($arg),*) }
    }};
}

/// A hash of `bytes`, the same in every process: a communicator's id.
fn id_of(bytes: &[u8]) -> u64 {
    possum_analyzer::kernel::checksum(bytes)
}

/// Notes the communicator `*comm` made by an init that returned `r`.
///
/// # Safety
/// `comm` is the init's out-pointer.
unsafe fn noted(r: NcclResult, comm: *mut Comm, id: u64, nranks: c_int) -> NcclResult {
    if (r == SUCCESS || r == IN_PROGRESS) && !comm.is_null() {
        // SAFETY: the init filled the caller's out-pointer.
        let c = unsafe { *comm } as usize;
        if c != 0 {
            note_communicator(c, id, u32::try_from(nranks).unwrap_or(0));
        }
    }
    r
}

/// `ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank)`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut Comm,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
) -> NcclResult {
    let r = call_nccl!(
        INIT_RANK,
        c"ncclCommInitRank",
        InitRankFn,
        comm,
        nranks,
        id,
        rank
    );
    // SAFETY: `comm` is the caller's out-pointer, filled by NCCL.
    unsafe { noted(r, comm, id_of(&id.internal), nranks) }
}

/// `ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
/// ncclConfig_t* config)`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut Comm,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    config: *mut c_void,
) -> NcclResult {
    let r = call_nccl!(
        INIT_RANK_CONFIG,
        c"ncclCommInitRankConfig",
        InitRankConfigFn,
        comm,
        nranks,
        id,
        rank,
        config
    );
    // SAFETY: `comm` is the caller's out-pointer, filled by NCCL.
    unsafe { noted(r, comm, id_of(&id.internal), nranks) }
}

/// `ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist)`: every rank in
/// this process.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut Comm,
    ndev: c_int,
    devlist: *const c_int,
) -> NcclResult {
    let r = call_nccl!(
        INIT_ALL,
        c"ncclCommInitAll",
        InitAllFn,
        comms,
        ndev,
        devlist
    );
    if r == SUCCESS && !comms.is_null() {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let id = id_of(&[&std::process::id().to_le_bytes()[..], &n.to_le_bytes()].concat());
        for i in 0..usize::try_from(ndev).unwrap_or(0) {
            // SAFETY: NCCL filled `ndev` handles at `comms`.
            let c = unsafe { *comms.add(i) } as usize;
            if c != 0 {
                note_communicator(c, id, u32::try_from(ndev).unwrap_or(0));
            }
        }
    }
    r
}

/// `ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
/// ncclConfig_t* config)`: the new communicator's ranks share the parent's id and the colour.
#[no_mangle]
pub unsafe extern "C" fn ncclCommSplit(
    comm: Comm,
    color: c_int,
    key: c_int,
    newcomm: *mut Comm,
    config: *mut c_void,
) -> NcclResult {
    let r = call_nccl!(
        SPLIT,
        c"ncclCommSplit",
        SplitFn,
        comm,
        color,
        key,
        newcomm,
        config
    );
    let parent = communicator_id(comm as usize);
    let count = real(&COUNT, c"ncclCommCount");
    if let (SUCCESS, Some(parent), false, false, true) =
        (r, parent, newcomm.is_null(), color == NO_COLOR, count != 0)
    {
        // SAFETY: NCCL filled `newcomm` (null for a rank that takes no part).
        let c = unsafe { *newcomm };
        let mut n: c_int = 0;
        // SAFETY: NCCL's ncclCommCount on the communicator it just made; `n` is an out-pointer.
        if !c.is_null() && unsafe { std::mem::transmute::<usize, CountFn>(count)(c, &mut n) } == 0 {
            let id = id_of(&[&parent.to_le_bytes()[..], &color.to_le_bytes()].concat());
            note_communicator(c as usize, id, u32::try_from(n).unwrap_or(0));
        }
    }
    r
}

/// `ncclResult_t ncclCommDestroy(ncclComm_t comm)`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: Comm) -> NcclResult {
    end_communicator(&DESTROY, c"ncclCommDestroy", comm)
}

/// `ncclResult_t ncclCommAbort(ncclComm_t comm)`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: Comm) -> NcclResult {
    end_communicator(&ABORT, c"ncclCommAbort", comm)
}

/// Forgets `comm` and passes it to NCCL's function `name` (kept in `slot`), one that ends a
/// communicator (`ncclCommDestroy`, `ncclCommAbort`).
fn end_communicator(slot: &AtomicUsize, name: &std::ffi::CStr, comm: Comm) -> NcclResult {
    forget_communicator(comm as usize);
    call_nccl!(slot, name, CommFn, comm)
}

/// The wrapper of NCCL function `name`, if possum wraps it.
pub fn wrapper(name: &[u8]) -> Option<*const ()> {
    Some(match name {
        b"ncclCommInitRank" => ncclCommInitRank as *const (),
        b"ncclCommInitRankConfig" => ncclCommInitRankConfig as *const (),
        b"ncclCommInitAll" => ncclCommInitAll as *const (),
        b"ncclCommSplit" => ncclCommSplit as *const (),
        b"ncclCommDestroy" => ncclCommDestroy as *const (),
        b"ncclCommAbort" => ncclCommAbort as *const (),
        _ => return None,
    })
}
