//! What every HIP wrapper shares (`entry.rs`, `writers.rs`, `hsa.rs`): the runtime's error codes
//! and functions, the front end found on first use, and the hook a copy, memset or launch runs
//! through before the runtime's function. One of the crate's modules with `unsafe` code.
//!
//! Below the wrappers: it names none of them. Making the front end starts the control socket,
//! whose session requests go to `session.rs` ([`crate::session::control::set_front_end`]).
#![allow(unsafe_code)]
#![allow(non_upper_case_globals)]

use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use super::front::{front, made, Front, Kernel, Kind};

pub(super) type HipError = c_int;
pub(super) const SUCCESS: HipError = 0;
pub(super) const INVALID_VALUE: HipError = 1;
pub(super) const OUT_OF_MEMORY: HipError = 2;
pub(super) const NOT_SUPPORTED: HipError = 801;

/// `HIP_LAUNCH_PARAM_BUFFER_POINTER`, `_SIZE`, `_END`.
const PARAM_BUFFER_POINTER: usize = 1;
const PARAM_BUFFER_SIZE: usize = 2;
const PARAM_END: usize = 3;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Dim3 {
    x: u32,
    y: u32,
    z: u32,
}

/// The runtime's function `name`, looked up once into `slot` (0: the runtime has none).
pub(super) use crate::base::elfsym::next_definition as real;

slot!(pub(super) REAL_hipMalloc);

/// The runtime's library: the file defining its `hipMalloc`.
fn runtime_path() -> Option<PathBuf> {
    let p = real(&REAL_hipMalloc, c"hipMalloc");
    (p != 0)
        .then(|| crate::base::elfsym::object_file(p))
        .flatten()
        .map(PathBuf::from)
}

/// The front end, made (and the control socket started) at the first call that needs it.
pub(super) fn the_front() -> Option<&'static Front> {
    front(runtime_path, started)
}

/// Starts the control socket once the front end is made: its session requests handed to the
/// HIP session first, `Status` answered with the HIP job's status.
fn started() {
    crate::session::control::set_front_end(super::session::handle);
    crate::session::control::start(super::session::status_json);
}

/// Runs `op` on `stream` through the hook, the buffers of `[dst, dst+n)` written and of
/// `[src, src+n)` read (`src` 0: none).
pub(super) fn copy_through(
    stream: usize,
    dst: u64,
    src: u64,
    n: usize,
    op: impl FnOnce() -> HipError,
) -> HipError {
    let kind = match src {
        0 => Kind::Memset,
        _ => Kind::Copy,
    };
    let Some(f) = the_front() else {
        return op();
    };
    let writes = f.buffers_of_range(dst, n as u64);
    let reads = if src == 0 {
        Vec::new()
    } else {
        f.buffers_of_range(src, n as u64)
    };
    f.before_op(kind, stream, &reads, Some(&writes), op)
}

/// Counts an operation in the counter `which` picks.
pub(super) fn count(which: impl FnOnce(&Front) -> &std::sync::atomic::AtomicU64) {
    if let Some(f) = made() {
        which(f).fetch_add(1, Ordering::Relaxed);
    }
}

/// The bytes at `p`, `len` of them.
///
/// # Safety
/// `p` points to at least `len` readable bytes.
pub(super) unsafe fn bytes<'a>(p: *const c_void, len: usize) -> &'a [u8] {
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) }
}

/// The kernarg bytes a launch of `kernel` passes through `params` (one pointer per explicit
/// argument) or `extra` (a buffer), laid out as the device sees them; `None` if neither is
/// readable.
///
/// # Safety
/// `params` and `extra` are the launch's, as the runtime's contract has them.
unsafe fn kernarg(
    kernel: &Kernel,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Option<Vec<u8>> {
    let size = kernel.explicit_size;
    let mut out = vec![0u8; size];
    if !params.is_null() {
        for (i, &(o, n)) in kernel.args.iter().enumerate() {
            // SAFETY: `params` has one pointer per explicit argument, each to `n` bytes.
            let p = unsafe { *params.add(i) };
            if p.is_null() {
                return None;
            }
            // SAFETY: as above.
            out[o..o + n].copy_from_slice(unsafe { bytes(p, n) });
        }
        return Some(out);
    }
    if extra.is_null() {
        return None;
    }
    let (mut buf, mut len) = (std::ptr::null::<c_void>(), 0usize);
    let mut i = 0;
    loop {
        // SAFETY: `extra` is a list of (key, value) pairs ended by PARAM_END.
        let key = unsafe { *extra.add(i) } as usize;
        match key {
            PARAM_END => break,
            // SAFETY: a key has its value after it.
            PARAM_BUFFER_POINTER => buf = unsafe { *extra.add(i + 1) },
            // SAFETY: the value of the size key points to a size_t.
            PARAM_BUFFER_SIZE => len = unsafe { *(*extra.add(i + 1)).cast::<usize>() },
            _ => return None,
        }
        i += 2;
        if i > 64 {
            return None;
        }
    }
    if buf.is_null() || len < size {
        return None;
    }
    // SAFETY: the buffer holds `len` >= `size` bytes.
    out.copy_from_slice(unsafe { bytes(buf, size) });
    Some(out)
}

/// Runs the launch `op` of `handle` (a function or host stub) on `stream` through the hook.
///
/// # Safety
/// As [`kernarg`].
pub(super) unsafe fn launch_through(
    handle: usize,
    stream: usize,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    op: impl FnOnce() -> HipError,
) -> HipError {
    let Some(f) = the_front() else {
        return op();
    };
    f.counters.launches.fetch_add(1, Ordering::Relaxed);
    let kernel = f.kernel(handle);
    // SAFETY: the caller's promise.
    let writes = kernel
        .as_ref()
        .and_then(|k| Some(f.buffers_of_kernarg(k, &unsafe { kernarg(k, params, extra) }?)));
    if writes.is_none() {
        f.counters.opaque_launches.fetch_add(1, Ordering::Relaxed);
    }
    let kind = match &kernel {
        Some(k) => Kind::Kernel(handle, k.clone()),
        None => Kind::Copy,
    };
    f.before_op(kind, stream, &[], writes.as_deref(), op)
}
