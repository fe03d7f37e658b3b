//! The driver's entry points, wrapped: how possum sees every launch, copy, memset, graph launch
//! and allocation of the job without CUPTI. One of the crate's modules with `unsafe` code (with
//! `sys`, `load`, `exit`, `decode`, `cudart`, `drvalloc`, `elfsym` and `park_sys`).
//!
//! A job reaches the driver three ways, and each hands it possum's wrapper instead of the
//! driver's function:
//!
//! - **exported symbols**: a program linked against libcuda binds `cuLaunchKernel` (and every
//!   other name in [`ENTRIES`]) to the first definition in the global scope, this library's under
//!   `LD_PRELOAD`; `dlsym(RTLD_DEFAULT, ..)` finds the same;
//! - **`dlsym` or `dlvsym` on a handle** (libcudart, cuBLAS, Triton `dlopen` libcuda): this
//!   library defines both; when a lookup on an explicit handle returns a driver function possum
//!   wraps, the caller gets the wrapper. possum's own lookups (cudarc, libloading) get the driver's function:
//!   the caller's address is compared with this library's. `RTLD_DEFAULT` and `RTLD_NEXT` go
//!   straight to glibc's `dlsym` with the caller's own return address (their meaning depends
//!   on who asks);
//! - **`cuGetProcAddress`/`_v2`** (libcudart and PyTorch's driver table, for every version and
//!   flag): the pointer the driver returns is looked up among the driver's own exports of the
//!   names in [`ENTRIES`], and swapped for the wrapper of the very function it is: the
//!   per-thread-stream (`_ptsz`/`_ptds`) variant for a per-thread lookup, and the wrapper of
//!   `cuGetProcAddress` itself when libcudart asks for "cuGetProcAddress". A pointer that is not
//!   one of them is handed out unchanged (counted by name: `possum status` shows it); if its
//!   name is one of a function that writes device memory ([`crate::cuda::writers::needs_wrapper`]),
//!   possum no longer trusts its hooks to see every write, and checkpoints hold the job's
//!   threads for their whole copy.
//!
//! Each wrapper lays its arguments out as the `cu<name>_params` struct CUPTI would have passed
//! (the arguments in order, C layout) and calls the same [`crate::ops::hooks::on_call`] on entry and on
//! exit around the driver's function, so the hook (op gate, resolution while tracking,
//! validation, DAG) is the one CUPTI's callbacks ran. With `POSSUM_HOOKS=cupti` CUPTI's callbacks
//! feed the hooks instead and the wrappers only count what they see (a cross-check of coverage);
//! with `POSSUM_HOOKS=off` they do nothing but call the driver.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;

use serde_json::{json, Value};

use crate::cuda::decode::RawCall;
use crate::process::setup::EntryPoints;

/// `CUresult`.
type CuResult = c_int;
/// `CUDA_ERROR_NOT_INITIALIZED`: a wrapper whose driver function cannot be found (no libcuda).
const NOT_INITIALIZED: CuResult = 3;

pub use crate::base::mode::{set_mode, Mode};

/// What the set-up needs of this module, which sits above it: handed by whoever runs it.
pub const SET_UP: EntryPoints = EntryPoints {
    interposing,
    stats_json,
};

/// What the wrappers do now, running the set-up ([`crate::process::setup::init`]) first if it has not
/// run.
pub fn mode() -> Mode {
    match crate::base::mode::current() {
        Some(m) => m,
        None => {
            crate::process::setup::init(SET_UP);
            crate::base::mode::after_set_up()
        }
    }
}

/// Calls seen by the wrappers in [`Mode::Count`], per callback id (CUPTI counts the rest).
static SEEN: [AtomicU64; crate::cuda::cbid::ID_LIMIT] =
    [const { AtomicU64::new(0) }; crate::cuda::cbid::ID_LIMIT];
/// Lookups answered with a wrapper: by `dlsym` or `dlvsym` on a handle, by `cuGetProcAddress`.
static SWAPPED_DLSYM: AtomicU64 = AtomicU64::new(0);
static SWAPPED_PROC: AtomicU64 = AtomicU64::new(0);
/// `cuGetProcAddress` answers that are no function possum wraps (most of the driver's API).
static PASSED_PROC: AtomicU64 = AtomicU64::new(0);
/// Names looked up through `cuGetProcAddress` whose answer possum hands out unchanged although a
/// function of that name family is wrapped (a version or variant possum does not know).
static UNMATCHED: parking_lot::Mutex<Vec<(String, u64, u64)>> = parking_lot::Mutex::new(Vec::new());

/// One wrapped driver function.
#[derive(Debug)]
pub struct Entry {
    /// Its exported name, NUL-terminated.
    name: &'static str,
    /// Its CUPTI callback id: the hooks' key for its shape ([`crate::cuda::cbid::shape`]).
    pub cbid: u32,
    /// possum's wrapper.
    ours: *const (),
    /// The driver's function (0 until known).
    real: &'static AtomicUsize,
}

// SAFETY: `ours` is the address of a function of this library, immutable and valid for its life.
unsafe impl Sync for Entry {}

impl Entry {
    /// The exported name.
    pub fn name(&self) -> &'static str {
        self.name.trim_end_matches('\0')
    }
}

/// The wrapper's body: hooks on entry and exit around `call` (the driver's function), as CUPTI's
/// callbacks would run them, with `params` as the call's params struct.
#[inline(always)]
fn through<P>(cbid: u32, params: &P, call: impl FnOnce() -> CuResult) -> CuResult {
    match mode() {
        Mode::Off => {
            started();
            call()
        }
        Mode::Count => {
            started();
            if let Some(c) = SEEN.get(cbid as usize) {
                c.fetch_add(1, Ordering::Relaxed);
            }
            call()
        }
        Mode::Hooks => {
            let pp = ptr::from_ref(params).cast::<c_void>();
            // The hooks find an operation's engine by the thread's context; a process that sees
            // one device has one answer, so it does not ask the driver each time.
            let ctx = if crate::cuda::cbid::shape(cbid).is_operation() && !single_device() {
                current_context()
            } else {
                0
            };
            // SAFETY: `params` is the `cu<name>_params` layout of callback `cbid` (the macro
            // below declares it from the function's own arguments, in order), alive for both
            // uses; `ret` is null on entry.
            let raw = unsafe { RawCall::new(pp, ptr::null()) };
            let _ = catch_unwind(AssertUnwindSafe(|| {
                crate::ops::hooks::on_call(true, cbid, ctx, &raw)
            }));
            let r = call();
            // SAFETY: as above; `r` outlives the exit call.
            let raw = unsafe { RawCall::new(pp, ptr::from_ref(&r).cast()) };
            let _ = catch_unwind(AssertUnwindSafe(|| {
                crate::ops::hooks::on_call(false, cbid, ctx, &raw)
            }));
            r
        }
    }
}

/// Makes possum's state (and so the control socket) at the job's first driver call through a
/// wrapper, whatever the mode: a job that never calls `cudaMalloc` (expandable segments, stream-
/// ordered pools) is still one `possum checkpoint` can talk to. (In [`Mode::Hooks`] the hooks
/// make it.)
#[inline(always)]
fn started() {
    static DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !DONE.load(Ordering::Relaxed) {
        let _ = catch_unwind(crate::process::runtime::state);
        DONE.store(true, Ordering::Relaxed);
    }
}

/// The driver's function of `slot` (named `name`, NUL-terminated), found on first use if no
/// lookup has told it yet; 0 if libcuda is not loaded.
fn real(slot: &AtomicUsize, name: &'static str) -> usize {
    let p = slot.load(Ordering::Acquire);
    if p != 0 {
        return p;
    }
    let p = driver_symbol(name);
    if p != 0 && p != own(name) {
        let _ = slot.compare_exchange(0, p, Ordering::AcqRel, Ordering::Acquire);
    }
    slot.load(Ordering::Acquire)
}

/// This library's wrapper named `name`, if any (so that a lookup that found it is never taken
/// for the driver's).
fn own(name: &str) -> usize {
    ENTRIES
        .iter()
        .find(|e| e.name == name)
        .map_or(0, |e| e.ours as usize)
}

/// The loaded libcuda's `name` (NUL-terminated), or 0.
fn driver_symbol(name: &'static str) -> usize {
    let h = driver_handle();
    if h == 0 {
        return 0;
    }
    // SAFETY: `h` is a handle dlopen returned and that is never closed; `name` is NUL-terminated.
    unsafe { real_dlsym()(h as *mut c_void, name.as_ptr().cast()) as usize }
}

/// A handle of the loaded libcuda (kept open once found), or 0 while none is loaded.
fn driver_handle() -> usize {
    static HANDLE: AtomicUsize = AtomicUsize::new(0);
    let h = HANDLE.load(Ordering::Acquire);
    if h != 0 {
        return h;
    }
    let name = crate::base::config::get().user.libcuda.as_str();
    let Ok(cname) = std::ffi::CString::new(name) else {
        return 0;
    };
    // SAFETY: RTLD_NOLOAD never loads anything: it returns the already-loaded libcuda (its
    // reference count raised, so it stays; the handle is kept for the life of the process).
    let h = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) } as usize;
    if h != 0
        && HANDLE
            .compare_exchange(0, h, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
    {
        // SAFETY: a second handle of the same library, not used.
        unsafe { libc::dlclose(h as *mut c_void) };
    }
    HANDLE.load(Ordering::Acquire)
}

/// Whether the driver sees exactly one device (asked until the driver answers, then kept).
fn single_device() -> bool {
    // 0: not known yet, 1: one device, 2: several.
    static ONE: AtomicU8 = AtomicU8::new(0);
    match ONE.load(Ordering::Relaxed) {
        1 => return true,
        2 => return false,
        _ => {}
    }
    let f = driver_symbol("cuDeviceGetCount\0");
    if f == 0 {
        return false;
    }
    let mut n: c_int = 0;
    // SAFETY: the driver's `CUresult cuDeviceGetCount(int *count)`; `n` is a valid out-pointer.
    let r = unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(*mut c_int) -> CuResult>(f)(&mut n)
    };
    if r != 0 {
        return false; // before cuInit: ask again next time
    }
    ONE.store(if n == 1 { 1 } else { 2 }, Ordering::Relaxed);
    n == 1
}

/// The calling thread's current context (the hooks' key for its device), or 0.
fn current_context() -> u64 {
    static GET: AtomicUsize = AtomicUsize::new(0);
    let mut f = GET.load(Ordering::Relaxed);
    if f == 0 {
        f = driver_symbol("cuCtxGetCurrent\0");
        GET.store(f, Ordering::Relaxed);
    }
    if f == 0 {
        return 0;
    }
    let mut ctx: u64 = 0;
    // SAFETY: the driver's `CUresult cuCtxGetCurrent(CUcontext *pctx)`; `ctx` is a valid
    // out-pointer.
    let r = unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(*mut u64) -> CuResult>(f)(&mut ctx)
    };
    if r == 0 {
        ctx
    } else {
        0
    }
}

// ---------------------------------------------------------------------------------------------
// dlsym

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// glibc's `dlsym` (0 until first needed).
static POSSUM_REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// glibc's `dlsym`, found with `dlvsym(RTLD_NEXT, ..)` (this library's own definition is the
/// first in the global scope).
extern "C" fn possum_find_dlsym() -> usize {
    found_once(&POSSUM_REAL_DLSYM, || {
        [c"GLIBC_2.34", c"GLIBC_2.2.5"].iter().find_map(|v| {
            // SAFETY: dlvsym with NUL-terminated strings; RTLD_NEXT searches the objects after
            // this one, so the answer is libc's (or libdl's) `dlsym`, never this library's.
            let p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), v.as_ptr()) };
            (!p.is_null()).then_some(p as usize)
        })
    })
}

/// `slot`'s function, found by `find` and kept on first success (0: not found).
fn found_once(slot: &AtomicUsize, find: impl FnOnce() -> Option<usize>) -> usize {
    let p = slot.load(Ordering::Acquire);
    if p != 0 {
        return p;
    }
    let p = find().unwrap_or(0);
    if p != 0 {
        slot.store(p, Ordering::Release);
    }
    p
}

/// The body of a lookup shim (`dlsym`, `dlvsym`): with `real` (glibc's function, 0 until
/// `find` finds it; the three argument registers either shim takes are saved around that call,
/// and their three pushes realign the stack for it), RTLD_DEFAULT (0) and RTLD_NEXT (-1) go to
/// glibc's by a tail jump, and any other handle to `ours` with the caller's return address in
/// register `caller` (the argument after the shim's own).
#[cfg(target_arch = "x86_64")]
macro_rules! lookup_shim {
    ($real:ident, $find:ident, $ours:ident, $caller:literal) => {
        std::arch::naked_asm!(
            "mov rax, qword ptr [rip + {real}]",
            "test rax, rax",
            "jnz 2f",
            "push rdi",
            "push rsi",
            "push rdx",
            "call {find}",
            "pop rdx",
            "pop rsi",
            "pop rdi",
            "test rax, rax",
            "jz 3f",
            "2:",
            "test rdi, rdi",
            "jz 4f",
            "cmp rdi, -1",
            "je 4f",
            concat!("mov ", $caller, ", qword ptr [rsp]"),
            "jmp {ours}",
            "4:",
            "jmp rax",
            "3:",
            "xor eax, eax",
            "ret",
            real = sym $real,
            find = sym $find,
            ours = sym $ours,
        )
    };
}

/// Whether this library interposes the process's `dlsym` (and so its exported driver names):
/// it was preloaded, ahead of libc in the global scope. Loaded only through
/// `CUDA_INJECTION64_PATH` (a `dlopen` by libcuda, after the job's libraries took their driver
/// pointers), it is not, and its wrappers are never handed out.
pub fn interposing() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // The main program's handle searches the global scope (RTLD_DEFAULT from here would
        // search this library's own local scope too, and find its `dlsym` even when local).
        // SAFETY: dlopen(NULL) returns the main program's handle (never loads anything); glibc's
        // dlsym with a NUL-terminated name.
        let found = unsafe {
            let main = libc::dlopen(ptr::null(), libc::RTLD_LAZY);
            if main.is_null() {
                return false;
            }
            real_dlsym()(main, c"dlsym".as_ptr())
        } as usize;
        // Compared by object, not address: this library's own references to its exported
        // `dlsym` go through the global scope too, so its address here is whatever won there.
        found != 0 && from_this_library(found)
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// glibc's function `name` (`dlsym` or `dlvsym`), found by `find`, as its type `F`.
///
/// # Safety
/// `F` is the C signature of glibc's `name`.
unsafe fn glibc_lookup<F: Copy>(find: extern "C" fn() -> usize, name: &str) -> F {
    let p = find();
    assert!(p != 0, "possum: glibc's {name} not found");
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<usize>()) };
    // SAFETY: `p` is glibc's `name`, a function of type `F` (the caller's promise), and `F`, a
    // function pointer, has the size of `usize`.
    unsafe { std::mem::transmute_copy::<usize, F>(&p) }
}

fn real_dlsym() -> DlsymFn {
    // SAFETY: `DlsymFn` is glibc's `dlsym`'s signature.
    unsafe { glibc_lookup(possum_find_dlsym, "dlsym") }
}

/// `void *dlsym(void *handle, const char *symbol)`. RTLD_DEFAULT (0) and RTLD_NEXT (-1) are
/// passed to glibc's by a tail jump, so that glibc sees the caller's own return address (the
/// meaning of both depends on the caller's object). Any other handle goes to `possum_dlsym` with
/// the caller's address as a third argument.
///
/// # Safety
/// As glibc's `dlsym`.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(_handle: *mut c_void, _symbol: *const c_char) -> *mut c_void {
    lookup_shim!(POSSUM_REAL_DLSYM, possum_find_dlsym, possum_dlsym, "rdx")
}

/// `dlsym` on an explicit handle, called from the `dlsym` above with the caller's address.
extern "C" fn possum_dlsym(handle: *mut c_void, name: *const c_char, caller: usize) -> *mut c_void {
    // SAFETY: glibc's dlsym with the caller's arguments.
    let p = unsafe { real_dlsym()(handle, name) };
    // SAFETY: `name` is the caller's symbol name (dlsym's contract); `p` is the answer to it.
    unsafe { handed_out(p, name, caller) }
}

/// What a lookup on an explicit handle hands the job for `name`, whose driver answer is `p`:
/// possum's wrapper for a driver function possum wraps, unless `caller` (a return address) is
/// in this library (possum's own lookups get the driver's function); else `p`.
///
/// # Safety
/// `name` is null or NUL-terminated.
unsafe fn handed_out(p: *mut c_void, name: *const c_char, caller: usize) -> *mut c_void {
    if p.is_null() || name.is_null() {
        return p;
    }
    // SAFETY: `name` is the caller's NUL-terminated symbol name (dlsym's contract).
    let bytes = unsafe { CStr::from_ptr(name) }.to_bytes();
    // The name first: most lookups (Python's module initialisers, ...) stop here, before the
    // loader is asked who called.
    if bytes.starts_with(b"hip") || bytes.starts_with(b"nccl") {
        let ours = match bytes.starts_with(b"hip") {
            true => crate::hip::entry::wrapper(bytes),
            false => crate::cuda::nccl::wrapper(bytes),
        };
        return match ours {
            Some(w) if !from_this_library(caller) && !std::ptr::eq(p.cast_const().cast(), w) => {
                SWAPPED_DLSYM.fetch_add(1, Ordering::Relaxed);
                w.cast_mut().cast()
            }
            _ => p,
        };
    }
    if !bytes.starts_with(b"cu") || from_this_library(caller) {
        return p;
    }
    let Some(e) = ENTRIES
        .iter()
        .find(|e| e.name.as_bytes().strip_suffix(b"\0") == Some(bytes))
    else {
        return p;
    };
    if std::ptr::eq(p.cast_const().cast::<()>(), e.ours) {
        return p;
    }
    let _ = e
        .real
        .compare_exchange(0, p as usize, Ordering::AcqRel, Ordering::Acquire);
    SWAPPED_DLSYM.fetch_add(1, Ordering::Relaxed);
    e.ours.cast_mut().cast()
}

// ---------------------------------------------------------------------------------------------
// dlvsym

type DlvsymFn = unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char) -> *mut c_void;

/// glibc's `dlvsym` (0 until first needed).
static POSSUM_REAL_DLVSYM: AtomicUsize = AtomicUsize::new(0);

/// glibc's `dlvsym`. This library defines `dlsym` and `dlvsym` both, ahead of libc in the
/// global scope, so neither can find the other's original: it is read from the dynamic symbol
/// tables of the loaded objects ([`crate::base::elfsym`]), the first object other than this library
/// that defines `dlvsym` (libc.so.6; libdl.so.2 before glibc 2.34).
extern "C" fn possum_find_dlvsym() -> usize {
    found_once(&POSSUM_REAL_DLVSYM, || {
        let this = possum_find_dlvsym as *const () as usize;
        Some(crate::base::elfsym::first_definition(c"dlvsym", this))
    })
}

fn real_dlvsym() -> DlvsymFn {
    // SAFETY: `DlvsymFn` is glibc's `dlvsym`'s signature.
    unsafe { glibc_lookup(possum_find_dlvsym, "dlvsym") }
}

/// `void *dlvsym(void *handle, const char *symbol, const char *version)`: as [`dlsym`], for a
/// lookup of a given version. RTLD_DEFAULT (0) and RTLD_NEXT (-1) go to glibc's by a tail jump
/// (this library's own `dlvsym(RTLD_NEXT, "dlsym", ..)` included: glibc then searches the
/// objects after this one); any other handle goes to `possum_dlvsym` with the caller's address
/// as a fourth argument, which hands out possum's wrapper for a driver function it wraps.
///
/// # Safety
/// As glibc's `dlvsym`.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlvsym(
    _handle: *mut c_void,
    _symbol: *const c_char,
    _version: *const c_char,
) -> *mut c_void {
    lookup_shim!(POSSUM_REAL_DLVSYM, possum_find_dlvsym, possum_dlvsym, "rcx")
}

/// `dlvsym` on an explicit handle, called from the `dlvsym` above with the caller's address.
extern "C" fn possum_dlvsym(
    handle: *mut c_void,
    name: *const c_char,
    version: *const c_char,
    caller: usize,
) -> *mut c_void {
    // SAFETY: glibc's dlvsym with the caller's arguments.
    let p = unsafe { real_dlvsym()(handle, name, version) };
    // SAFETY: `name` is the caller's symbol name (dlvsym's contract); `p` is the answer to it.
    unsafe { handed_out(p, name, caller) }
}

/// Whether `addr` (a return address) is in this library's code.
fn from_this_library(addr: usize) -> bool {
    static BASE: AtomicUsize = AtomicUsize::new(0);
    let base_of = |a: *const c_void| -> usize {
        // SAFETY: `Dl_info` is plain data (pointers and integers): all zeroes is a valid value.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a valid out-parameter; dladdr only reads the loader's tables.
        if unsafe { libc::dladdr(a, &mut info) } == 0 {
            return 0;
        }
        info.dli_fbase as usize
    };
    let mut base = BASE.load(Ordering::Relaxed);
    if base == 0 {
        base = base_of(possum_find_dlsym as *const c_void);
        BASE.store(base, Ordering::Relaxed);
    }
    base != 0 && base_of(addr as *const c_void) == base
}

// ---------------------------------------------------------------------------------------------
// cuGetProcAddress

/// The wrapper of every driver function whose address is `p`, if `p` is one possum wraps.
fn wrapper_of(p: usize) -> Option<&'static Entry> {
    static MAP: OnceLock<Vec<(usize, usize)>> = OnceLock::new();
    let map = MAP.get_or_init(|| {
        // Every wrapped function's driver address, from the loaded libcuda's exports.
        let mut v: Vec<(usize, usize)> = ENTRIES
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let r = real(e.real, e.name);
                (r != 0).then_some((r, i))
            })
            .collect();
        v.sort_unstable();
        v
    });
    let i = map.binary_search_by_key(&p, |x| x.0).ok()?;
    ENTRIES.get(map[i].1)
}

/// A `cuGetProcAddress*` answer: `*pfn` is swapped for possum's wrapper of the same function.
///
/// # Safety
/// `symbol` is null or NUL-terminated, `pfn` null or the call's out-pointer, just written.
unsafe fn swap_proc(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) {
    if pfn.is_null() {
        return;
    }
    // SAFETY: the caller's out-pointer, valid (the contract).
    let p = unsafe { pfn.read() } as usize;
    if p == 0 {
        return;
    }
    if let Some(e) = wrapper_of(p) {
        // SAFETY: as above; the wrapper has the signature of the function it replaces.
        unsafe { pfn.write(e.ours.cast_mut().cast()) };
        SWAPPED_PROC.fetch_add(1, Ordering::Relaxed);
        return;
    }
    if ENTRIES.iter().any(|e| e.ours as usize == p) {
        return;
    }
    PASSED_PROC.fetch_add(1, Ordering::Relaxed);
    if symbol.is_null() {
        return;
    }
    // SAFETY: NUL-terminated (the contract).
    let name = unsafe { CStr::from_ptr(symbol) }.to_string_lossy();
    // A function that may write device memory, handed out without a wrapper: the hooks will not
    // see what it writes.
    if crate::cuda::writers::needs_wrapper(&name) {
        crate::ops::gate::note_unwrapped_writer(format!(
            "{name} (cuGetProcAddress version {version}, flags {flags:#x})"
        ));
    }
    let prefix = format!("{name}_");
    if ENTRIES
        .iter()
        .any(|e| e.name() == name || e.name().starts_with(&prefix))
    {
        let mut u = UNMATCHED.lock();
        if u.len() < 64
            && !u
                .iter()
                .any(|x| x.0 == name && x.1 == version as u64 && x.2 == flags)
        {
            u.push((name.into_owned(), version as u64, flags));
        }
    }
}

type GpaFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CuResult;
type Gpa2Fn =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CuResult;

mod proc_v1 {
    pub static REAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
}
mod proc_v2 {
    pub static REAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
}

/// `cuGetProcAddress` (CUDA 11.3's form): the driver's answer, with possum's wrapper in place of
/// a function possum wraps.
///
/// # Safety
/// As the driver's.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CuResult {
    #[repr(C)]
    #[allow(dead_code)]
    struct Params(*const c_char, *mut *mut c_void, c_int, u64);
    let f = real(&proc_v1::REAL, "cuGetProcAddress\0");
    if f == 0 {
        return NOT_INITIALIZED;
    }
    // SAFETY: the driver's function of that name and signature.
    let f = unsafe { std::mem::transmute::<usize, GpaFn>(f) };
    let p = Params(symbol, pfn, version, flags);
    // SAFETY: the caller's arguments.
    let r = through(626, &p, || unsafe { f(symbol, pfn, version, flags) });
    if r == 0 {
        // SAFETY: the call succeeded: `*pfn` is the answer.
        unsafe { swap_proc(symbol, pfn, version, flags) };
    }
    r
}

/// `cuGetProcAddress_v2` (CUDA 12's, what `cuGetProcAddress` means in cuda.h since): as
/// [`cuGetProcAddress`].
///
/// # Safety
/// As the driver's.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CuResult {
    #[repr(C)]
    #[allow(dead_code)]
    struct Params(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int);
    let f = real(&proc_v2::REAL, "cuGetProcAddress_v2\0");
    if f == 0 {
        return NOT_INITIALIZED;
    }
    // SAFETY: the driver's function of that name and signature.
    let f = unsafe { std::mem::transmute::<usize, Gpa2Fn>(f) };
    let p = Params(symbol, pfn, version, flags, status);
    // SAFETY: the caller's arguments.
    let r = through(677, &p, || unsafe {
        f(symbol, pfn, version, flags, status)
    });
    if r == 0 {
        // SAFETY: the call succeeded: `*pfn` is the answer.
        unsafe { swap_proc(symbol, pfn, version, flags) };
    }
    r
}

// ---------------------------------------------------------------------------------------------
// Pointer queries (`[query ptr]` in the table below: no CUPTI callback of possum's, cbid 0)

/// Before a query about device pointer `ptr`: the buffer it is in must be mapped (see
/// [`crate::ops::hooks::pointer_query`]).
fn before_query(ptr: u64) {
    if mode() != Mode::Hooks {
        return;
    }
    let ctx = if single_device() {
        0
    } else {
        current_context()
    };
    let _ = catch_unwind(AssertUnwindSafe(|| {
        crate::ops::hooks::pointer_query(ctx, ptr)
    }));
}

// ---------------------------------------------------------------------------------------------
// The wrapped functions

/// The first step of a wrapper whose call possum may answer itself (`[serve f]`):
/// `crate::cuda::drvalloc::f(args)` answers with `Some(result)`, or `None` to let the driver do it.
macro_rules! maybe_serve {
    ([] $cbid:literal; $($a:ident),*) => {};
    ([$serve:ident] $cbid:literal; $($a:ident),*) => {
        // SAFETY: the caller's own arguments, under the driver function's contract.
        if let Some(r) = unsafe { crate::cuda::drvalloc::$serve($($a),*) } {
            if mode() == Mode::Hooks {
                crate::process::stats::record($cbid);
            }
            return r;
        }
    };
}

/// The rest of a wrapper, once it has the driver's function `f`: the hooks around it, or for a
/// pointer query (`[query ptr]`) the buffer `ptr` is in brought back first and no hook.
macro_rules! call_through {
    ([] $f:ident; $cbid:literal; $($a:ident : $t:ty),*) => {{
        #[repr(C)]
        #[allow(dead_code)]
        struct Params { $($a: $t),* }
        let p = Params { $($a),* };
        // SAFETY: the caller's own arguments, to the function they were meant for.
        through($cbid, &p, || unsafe { $f($($a),*) })
    }};
    ([$q:ident] $f:ident; $cbid:literal; $($a:ident : $t:ty),*) => {{
        before_query($q);
        // SAFETY: the caller's own arguments, to the function they were meant for.
        unsafe { $f($($a),*) }
    }};
}

/// Declares each wrapped driver function: an exported wrapper of its exact C signature, the slot
/// of the driver's own function, and its row in [`ENTRIES`]. `serve` names a function that may
/// answer the call itself (allocations served by the engine): it returns `Some(result)` to do so.
macro_rules! entry_points {
    ($( $name:ident = $cbid:literal $([serve $serve:ident])? $([query $q:ident])? ( $($a:ident : $t:ty),* ); )*) => {
        $(
            #[allow(non_snake_case)]
            mod $name {
                pub static REAL: std::sync::atomic::AtomicUsize =
                    std::sync::atomic::AtomicUsize::new(0);
            }

            #[doc = concat!("`", stringify!($name), "`, hooked (see the module documentation).")]
            ///
            /// # Safety
            /// As the driver's function of that name.
            #[allow(non_snake_case)]
            #[no_mangle]
            pub unsafe extern "C" fn $name($($a: $t),*) -> CuResult {
                maybe_serve!([$($serve)?] $cbid; $($a),*);
                let f = real(&$name::REAL, concat!(stringify!($name), "\0"));
                if f == 0 {
                    return NOT_INITIALIZED;
                }
                // SAFETY: `f` is the driver's function of this name, whose signature this one
                // copies.
                let f = unsafe {
                    std::mem::transmute::<usize, unsafe extern "C" fn($($t),*) -> CuResult>(f)
                };
                call_through!([$($q)?] f; $cbid; $($a : $t),*)
            }
        )*

        /// Every wrapped driver function: `cuGetProcAddress` and `_v2`, then the table below
        /// (the pointer queries with `cbid` 0: not a callback of possum's).
        pub static ENTRIES: &[Entry] = &[
            Entry {
                name: "cuGetProcAddress\0",
                cbid: 626,
                ours: cuGetProcAddress as GpaFn as *const (),
                real: &proc_v1::REAL,
            },
            Entry {
                name: "cuGetProcAddress_v2\0",
                cbid: 677,
                ours: cuGetProcAddress_v2 as Gpa2Fn as *const (),
                real: &proc_v2::REAL,
            },
            $(
                Entry {
                    name: concat!(stringify!($name), "\0"),
                    cbid: $cbid,
                    ours: $name as unsafe extern "C" fn($($t),*) -> CuResult as *const (),
                    real: &$name::REAL,
                },
            )*
        ];
    };
}

// Argument types as in cuda.h (CUDA 13.0), by size: handles, pointers, CUdeviceptr and size_t
// are 8 bytes (u64/usize), `unsigned int` and enums 4 (c_uint), `int` c_int, and the memset
// values their own width. Struct layouts follow (a u32 pair shares a word), as CUPTI's do.
type P = u64;
type U = c_uint;
type Z = usize;

entry_points! {
    cuPointerGetAttribute = 0 [query ptr] (data: P, attr: U, ptr: P);
    cuPointerGetAttributes = 0 [query ptr] (n: U, attrs: P, data: P, ptr: P);
    cuMemGetAddressRange_v2 = 0 [query ptr] (base: P, size: P, ptr: P);
    cuLaunchKernel = 307 (f: P, gx: U, gy: U, gz: U, bx: U, by: U, bz: U, shmem: U, s: P, params: P, extra: P);
    cuLaunchKernel_ptsz = 442 (f: P, gx: U, gy: U, gz: U, bx: U, by: U, bz: U, shmem: U, s: P, params: P, extra: P);
    cuLaunchKernelEx = 652 (config: P, f: P, params: P, extra: P);
    cuLaunchKernelEx_ptsz = 653 (config: P, f: P, params: P, extra: P);
    cuLaunchCooperativeKernel = 477 (f: P, gx: U, gy: U, gz: U, bx: U, by: U, bz: U, shmem: U, s: P, params: P);
    cuLaunchCooperativeKernel_ptsz = 478 (f: P, gx: U, gy: U, gz: U, bx: U, by: U, bz: U, shmem: U, s: P, params: P);
    cuGraphLaunch = 514 (exec: P, s: P);
    cuGraphLaunch_ptsz = 515 (exec: P, s: P);
    cuMemcpy = 305 (dst: P, src: P, n: Z);
    cuMemcpy_ptds = 408 (dst: P, src: P, n: Z);
    cuMemcpyAsync = 306 (dst: P, src: P, n: Z, s: P);
    cuMemcpyAsync_ptsz = 418 (dst: P, src: P, n: Z, s: P);
    cuMemcpyHtoD_v2 = 276 (dst: P, src: P, n: Z);
    cuMemcpyHtoD_v2_ptds = 397 (dst: P, src: P, n: Z);
    cuMemcpyHtoDAsync_v2 = 277 (dst: P, src: P, n: Z, s: P);
    cuMemcpyHtoDAsync_v2_ptsz = 421 (dst: P, src: P, n: Z, s: P);
    cuMemcpyDtoH_v2 = 278 (dst: P, src: P, n: Z);
    cuMemcpyDtoH_v2_ptds = 398 (dst: P, src: P, n: Z);
    cuMemcpyDtoHAsync_v2 = 279 (dst: P, src: P, n: Z, s: P);
    cuMemcpyDtoHAsync_v2_ptsz = 422 (dst: P, src: P, n: Z, s: P);
    cuMemcpyDtoD_v2 = 280 (dst: P, src: P, n: Z);
    cuMemcpyDtoD_v2_ptds = 399 (dst: P, src: P, n: Z);
    cuMemcpyDtoDAsync_v2 = 281 (dst: P, src: P, n: Z, s: P);
    cuMemcpyDtoDAsync_v2_ptsz = 423 (dst: P, src: P, n: Z, s: P);
    cuMemcpyPeerAsync = 319 (dst: P, dctx: P, src: P, sctx: P, n: Z, s: P);
    cuMemcpyPeerAsync_ptsz = 426 (dst: P, dctx: P, src: P, sctx: P, n: Z, s: P);
    cuMemcpyBatchAsync = 776 (dsts: P, srcs: P, sizes: P, count: Z, attrs: P, idxs: P, nattrs: Z, fail: P, s: P);
    cuMemcpyBatchAsync_ptsz = 777 (dsts: P, srcs: P, sizes: P, count: Z, attrs: P, idxs: P, nattrs: Z, fail: P, s: P);
    cuMemcpyBatchAsync_v2 = 796 (dsts: P, srcs: P, sizes: P, count: Z, attrs: P, idxs: P, nattrs: Z, s: P);
    cuMemcpyBatchAsync_v2_ptsz = 797 (dsts: P, srcs: P, sizes: P, count: Z, attrs: P, idxs: P, nattrs: Z, s: P);
    cuMemcpy2D_v2 = 287 (copy: P);
    cuMemcpy2D_v2_ptds = 405 (copy: P);
    cuMemcpy2DUnaligned_v2 = 288 (copy: P);
    cuMemcpy2DUnaligned_v2_ptds = 406 (copy: P);
    cuMemcpy2DAsync_v2 = 289 (copy: P, s: P);
    cuMemcpy2DAsync_v2_ptsz = 424 (copy: P, s: P);
    cuMemcpy3D_v2 = 290 (copy: P);
    cuMemcpy3D_v2_ptds = 407 (copy: P);
    cuMemcpy3DAsync_v2 = 291 (copy: P, s: P);
    cuMemcpy3DAsync_v2_ptsz = 425 (copy: P, s: P);
    cuMemcpy3DPeer = 320 (copy: P);
    cuMemcpy3DPeer_ptds = 410 (copy: P);
    cuMemcpy3DPeerAsync = 321 (copy: P, s: P);
    cuMemcpy3DPeerAsync_ptsz = 427 (copy: P, s: P);
    cuMemcpyPeer = 318 (dst: P, dctx: P, src: P, sctx: P, n: Z);
    cuMemcpyPeer_ptds = 409 (dst: P, dctx: P, src: P, sctx: P, n: Z);
    cuMemcpyWithAttributesAsync = 837 (dst: P, src: P, n: Z, attr: P, s: P);
    cuMemcpyWithAttributesAsync_ptsz = 838 (dst: P, src: P, n: Z, attr: P, s: P);
    cuMemcpyAtoD_v2 = 284 (dst: P, array: P, offset: Z, n: Z);
    cuMemcpyAtoD_v2_ptds = 401 (dst: P, array: P, offset: Z, n: Z);
    cuMemcpy3DBatchAsync = 778 (count: Z, ops: P, fail: P, flags: u64, s: P);
    cuMemcpy3DBatchAsync_ptsz = 779 (count: Z, ops: P, fail: P, flags: u64, s: P);
    cuMemcpy3DBatchAsync_v2 = 798 (count: Z, ops: P, flags: u64, s: P);
    cuMemcpy3DBatchAsync_v2_ptsz = 799 (count: Z, ops: P, flags: u64, s: P);
    cuMemcpy3DWithAttributesAsync = 839 (op: P, flags: u64, s: P);
    cuMemcpy3DWithAttributesAsync_ptsz = 840 (op: P, flags: u64, s: P);
    cuMemBatchDecompressAsync = 761 (params: P, count: Z, flags: U, fail: P, s: P);
    cuMemBatchDecompressAsync_ptsz = 762 (params: P, count: Z, flags: U, fail: P, s: P);
    cuMemsetD2D8_v2 = 252 (dst: P, pitch: Z, v: u8, w: Z, h: Z);
    cuMemsetD2D8_v2_ptds = 414 (dst: P, pitch: Z, v: u8, w: Z, h: Z);
    cuMemsetD2D16_v2 = 253 (dst: P, pitch: Z, v: u16, w: Z, h: Z);
    cuMemsetD2D16_v2_ptds = 415 (dst: P, pitch: Z, v: u16, w: Z, h: Z);
    cuMemsetD2D32_v2 = 254 (dst: P, pitch: Z, v: U, w: Z, h: Z);
    cuMemsetD2D32_v2_ptds = 416 (dst: P, pitch: Z, v: U, w: Z, h: Z);
    cuMemsetD2D8Async = 222 (dst: P, pitch: Z, v: u8, w: Z, h: Z, s: P);
    cuMemsetD2D8Async_ptsz = 431 (dst: P, pitch: Z, v: u8, w: Z, h: Z, s: P);
    cuMemsetD2D16Async = 224 (dst: P, pitch: Z, v: u16, w: Z, h: Z, s: P);
    cuMemsetD2D16Async_ptsz = 432 (dst: P, pitch: Z, v: u16, w: Z, h: Z, s: P);
    cuMemsetD2D32Async = 226 (dst: P, pitch: Z, v: U, w: Z, h: Z, s: P);
    cuMemsetD2D32Async_ptsz = 433 (dst: P, pitch: Z, v: U, w: Z, h: Z, s: P);
    cuStreamWriteValue32 = 460 (s: P, addr: P, v: U, flags: U);
    cuStreamWriteValue32_ptsz = 461 (s: P, addr: P, v: U, flags: U);
    cuStreamWriteValue64 = 475 (s: P, addr: P, v: u64, flags: U);
    cuStreamWriteValue64_ptsz = 476 (s: P, addr: P, v: u64, flags: U);
    cuStreamWriteValue32_v2 = 663 (s: P, addr: P, v: U, flags: U);
    cuStreamWriteValue32_v2_ptsz = 664 (s: P, addr: P, v: U, flags: U);
    cuStreamWriteValue64_v2 = 665 (s: P, addr: P, v: u64, flags: U);
    cuStreamWriteValue64_v2_ptsz = 666 (s: P, addr: P, v: u64, flags: U);
    cuStreamBatchMemOp = 462 (s: P, count: U, ops: P, flags: U);
    cuStreamBatchMemOp_ptsz = 463 (s: P, count: U, ops: P, flags: U);
    cuStreamBatchMemOp_v2 = 667 (s: P, count: U, ops: P, flags: U);
    cuStreamBatchMemOp_v2_ptsz = 668 (s: P, count: U, ops: P, flags: U);
    cuLaunch = 115 (f: P);
    cuLaunchGrid = 116 (f: P, w: c_int, h: c_int);
    cuLaunchGridAsync = 117 (f: P, w: c_int, h: c_int, s: P);
    cuLaunchCooperativeKernelMultiDevice = 480 (list: P, n: U, flags: U);
    cuMemsetD8_v2 = 249 (dst: P, v: u8, n: Z);
    cuMemsetD8_v2_ptds = 411 (dst: P, v: u8, n: Z);
    cuMemsetD16_v2 = 250 (dst: P, v: u16, n: Z);
    cuMemsetD16_v2_ptds = 412 (dst: P, v: u16, n: Z);
    cuMemsetD32_v2 = 251 (dst: P, v: U, n: Z);
    cuMemsetD32_v2_ptds = 413 (dst: P, v: U, n: Z);
    cuMemsetD8Async = 216 (dst: P, v: u8, n: Z, s: P);
    cuMemsetD8Async_ptsz = 428 (dst: P, v: u8, n: Z, s: P);
    cuMemsetD16Async = 218 (dst: P, v: u16, n: Z, s: P);
    cuMemsetD16Async_ptsz = 429 (dst: P, v: u16, n: Z, s: P);
    cuMemsetD32Async = 220 (dst: P, v: U, n: Z, s: P);
    cuMemsetD32Async_ptsz = 430 (dst: P, v: U, n: Z, s: P);
    cuMemAlloc_v2 = 243 [serve serve_alloc] (dptr: *mut u64, bytes: Z);
    cuMemAllocPitch_v2 = 244 [serve serve_pitch] (dptr: *mut u64, pitch: *mut Z, w: Z, h: Z, elem: U);
    cuMemFree_v2 = 245 [serve serve_free] (dptr: u64);
    cuMemAllocManaged = 371 (dptr: P, bytes: Z, flags: U);
    cuMemAllocAsync = 598 [serve serve_alloc_async] (dptr: *mut u64, bytes: Z, s: P);
    cuMemAllocAsync_ptsz = 599 [serve serve_alloc_async_ptsz] (dptr: *mut u64, bytes: Z, s: P);
    cuMemFreeAsync = 600 [serve serve_free_async] (dptr: P, s: P);
    cuMemFreeAsync_ptsz = 601 [serve serve_free_async_ptsz] (dptr: P, s: P);
    cuMemAllocFromPoolAsync = 611 (dptr: P, bytes: Z, pool: P, s: P);
    cuMemAllocFromPoolAsync_ptsz = 612 (dptr: P, bytes: Z, pool: P, s: P);
    cuMemCreate = 549 [serve serve_create] (handle: *mut u64, size: Z, prop: *const u8, flags: u64);
    cuMemRelease = 550 [serve serve_release] (handle: P);
    cuMemMap = 551 [serve serve_map] (va: P, size: Z, offset: Z, handle: P, flags: u64);
    cuMemUnmap = 552 [serve serve_unmap] (va: P, size: Z);
    cuMemExportToShareableHandle = 554 [serve serve_export] (out: P, handle: P, kind: U, flags: u64);
    cuMemImportFromShareableHandle = 555 [serve serve_import] (handle: *mut u64, os: P, kind: U);
    cuMemGetAllocationPropertiesFromHandle = 557 [serve serve_props] (prop: *mut u8, handle: P);
    cuMemRetainAllocationHandle = 565 [serve serve_retain] (handle: *mut u64, addr: P);
    cuStreamCreate = 124 (s: P, flags: U);
    cuStreamCreateWithPriority = 367 (s: P, flags: U, prio: c_int);
    cuStreamDestroy_v2 = 326 (s: P);
    cuStreamBeginCapture = 495 (s: P);
    cuStreamBeginCapture_ptsz = 496 (s: P);
    cuStreamBeginCapture_v2 = 539 (s: P, capture_mode: U);
    cuStreamBeginCapture_v2_ptsz = 540 (s: P, capture_mode: U);
    cuStreamEndCapture = 497 (s: P, graph: P);
    cuStreamEndCapture_ptsz = 498 (s: P, graph: P);
    cuGraphInstantiate = 513 (exec: P, graph: P, err_node: P, log: P, log_size: Z);
    cuGraphInstantiate_v2 = 578 (exec: P, graph: P, err_node: P, log: P, log_size: Z);
    cuGraphInstantiateWithFlags = 643 (exec: P, graph: P, flags: u64);
    cuGraphInstantiateWithParams = 656 (exec: P, graph: P, params: P);
    cuGraphInstantiateWithParams_ptsz = 657 (exec: P, graph: P, params: P);
    cuGraphExecDestroy = 516 (exec: P);
    cuGraphExecKernelNodeSetParams = 538 (exec: P, node: P, params: P);
    cuGraphExecKernelNodeSetParams_v2 = 692 (exec: P, node: P, params: P);
    cuGraphExecUpdate = 561 (exec: P, graph: P, err_node: P, result: P);
    cuGraphExecUpdate_v2 = 696 (exec: P, graph: P, info: P);
    cuGraphExecNodeSetParams = 714 (exec: P, node: P, params: P);
    cuGraphExecMemsetNodeSetParams = 563 (exec: P, node: P, params: P, ctx: P);
    cuGraphExecMemcpyNodeSetParams = 562 (exec: P, node: P, params: P, ctx: P);
    cuGraphExecBatchMemOpNodeSetParams = 672 (exec: P, node: P, params: P);
    cuGraphExecChildGraphNodeSetParams = 586 (exec: P, node: P, child: P);
}

/// What the entry points saw, for the statistics.
pub fn stats_json() -> Value {
    let seen: serde_json::Map<String, Value> = ENTRIES
        .iter()
        .filter_map(|e| {
            let n = SEEN.get(e.cbid as usize)?.load(Ordering::Relaxed);
            (n > 0).then(|| (e.name().to_string(), n.into()))
        })
        .collect();
    let unmatched: Vec<Value> = UNMATCHED
        .lock()
        .iter()
        .map(|(n, v, f)| json!({"symbol": n, "version": v, "flags": f}))
        .collect();
    json!({
        "mode": match mode() { Mode::Hooks => "entry", Mode::Count => "cupti", Mode::Off => "off" },
        "wrapped": ENTRIES.len(),
        "swapped_dlsym": SWAPPED_DLSYM.load(Ordering::Relaxed),
        "swapped_proc_address": SWAPPED_PROC.load(Ordering::Relaxed),
        "passed_proc_address": PASSED_PROC.load(Ordering::Relaxed),
        "unmatched": unmatched,
        "unwrapped_writers": crate::ops::gate::unwrapped_writers(),
        "seen_beside_cupti": seen,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_entry_is_a_known_callback_with_one_name() {
        let mut names = HashSet::new();
        for e in ENTRIES {
            assert!(names.insert(e.name()), "{} twice", e.name());
            if e.cbid == 0 {
                continue; // wrapped by hand, no callback
            }
            let cb = crate::cuda::cbid::lookup(e.cbid)
                .unwrap_or_else(|| panic!("{}: cbid {} not in cbid::CALLBACKS", e.name(), e.cbid));
            assert_eq!(cb.name, e.name(), "cbid {}", e.cbid);
            assert!(e.name.ends_with('\0'));
        }
    }

    #[test]
    fn every_callback_has_a_wrapper() {
        for c in crate::cuda::cbid::CALLBACKS {
            assert!(
                ENTRIES.iter().any(|e| e.cbid == c.id),
                "{} ({}) is hooked by CUPTI but not wrapped",
                c.name,
                c.id
            );
        }
    }

    #[test]
    fn params_structs_have_cuptis_layout() {
        // cuLaunchKernel_params: f, six u32 dims + shmem packed in pairs (words 1-4), hStream at
        // word 5, kernelParams 6, extra 7 (cbid::launch); memset: the value's word, then N at 2.
        #[repr(C)]
        struct L(P, U, U, U, U, U, U, U, P, P, P);
        assert_eq!(std::mem::offset_of!(L, 8), 5 * 8);
        assert_eq!(std::mem::offset_of!(L, 9), 6 * 8);
        assert_eq!(std::mem::offset_of!(L, 10), 7 * 8);
        #[repr(C)]
        struct M(P, u8, Z, P);
        assert_eq!(std::mem::offset_of!(M, 2), 2 * 8);
        assert_eq!(std::mem::offset_of!(M, 3), 3 * 8);
        #[repr(C)]
        struct Peer(P, P, P, P, Z, P);
        assert_eq!(std::mem::offset_of!(Peer, 5), 5 * 8);
    }

    #[test]
    fn own_wrappers_are_found_by_name() {
        assert_eq!(
            own("cuLaunchKernel\0"),
            cuLaunchKernel as *const () as usize
        );
        assert_eq!(own("cuNothing\0"), 0);
        // The pointer queries are in the table (handed out by dlsym and cuGetProcAddress too).
        for q in [
            "cuPointerGetAttribute\0",
            "cuPointerGetAttributes\0",
            "cuMemGetAddressRange_v2\0",
        ] {
            assert_ne!(own(q), 0, "{q}");
        }
    }
}
