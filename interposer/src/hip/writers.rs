//! The HIP runtime's other functions that write device memory: launches beside
//! `hipLaunchKernel` and `hipModuleLaunchKernel`, the driver-style and pitched copies and memsets,
//! and peer copies. Each runs through the same hook as the common ones (`entry.rs`): its
//! destination range written, or, for a launch, its kernel's pointer arguments. One of the
//! crate's modules with `unsafe` code.
#![allow(unsafe_code)]
#![allow(non_snake_case, non_upper_case_globals)]

use std::ffi::{c_int, c_uint, c_void};

use super::through::{copy_through, count, launch_through, real, Dim3, HipError, NOT_SUPPORTED};

slot!(REAL_hipLaunchCooperativeKernel);
slot!(REAL_hipExtLaunchKernel);
slot!(REAL_hipExtModuleLaunchKernel);
slot!(REAL_hipMemcpyHtoD);
slot!(REAL_hipMemcpyDtoD);
slot!(REAL_hipMemcpyHtoDAsync);
slot!(REAL_hipMemcpyDtoDAsync);
slot!(REAL_hipMemsetD8);
slot!(REAL_hipMemsetD16);
slot!(REAL_hipMemsetD32);
slot!(REAL_hipMemsetD8Async);
slot!(REAL_hipMemsetD16Async);
slot!(REAL_hipMemsetD32Async);
slot!(REAL_hipMemcpy2D);
slot!(REAL_hipMemcpy2DAsync);
slot!(REAL_hipMemset2D);
slot!(REAL_hipMemset2DAsync);
slot!(REAL_hipMemcpyPeer);
slot!(REAL_hipMemcpyPeerAsync);

type P = *mut c_void;
type CooperativeFn = unsafe extern "C" fn(*const c_void, Dim3, Dim3, *mut P, c_uint, P) -> HipError;
type ExtLaunchFn =
    unsafe extern "C" fn(*const c_void, Dim3, Dim3, *mut P, usize, P, P, P, c_int) -> HipError;
type ExtModuleLaunchFn = unsafe extern "C" fn(
    P,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    usize,
    P,
    *mut P,
    *mut P,
    P,
    P,
    u32,
) -> HipError;
type CopyFn = unsafe extern "C" fn(u64, u64, usize) -> HipError;
type CopyAsyncFn = unsafe extern "C" fn(u64, u64, usize, P) -> HipError;
type SetFn<T> = unsafe extern "C" fn(u64, T, usize) -> HipError;
type SetAsyncFn<T> = unsafe extern "C" fn(u64, T, usize, P) -> HipError;
type Copy2DFn =
    unsafe extern "C" fn(P, usize, *const c_void, usize, usize, usize, c_int) -> HipError;
type Copy2DAsyncFn =
    unsafe extern "C" fn(P, usize, *const c_void, usize, usize, usize, c_int, P) -> HipError;
type Set2DFn = unsafe extern "C" fn(P, usize, c_int, usize, usize) -> HipError;
type Set2DAsyncFn = unsafe extern "C" fn(P, usize, c_int, usize, usize, P) -> HipError;
type PeerFn = unsafe extern "C" fn(P, c_int, *const c_void, c_int, usize) -> HipError;
type PeerAsyncFn = unsafe extern "C" fn(P, c_int, *const c_void, c_int, usize, P) -> HipError;

/// The bytes a pitched range of `height` rows of `width` bytes, `pitch` apart, spans.
fn pitched(pitch: usize, width: usize, height: usize) -> usize {
    match height {
        0 => 0,
        h => pitch.saturating_mul(h - 1).saturating_add(width),
    }
}

/// `hipLaunchCooperativeKernel(stub, grid, block, args, shared, stream)`.
#[no_mangle]
pub unsafe extern "C" fn hipLaunchCooperativeKernel(
    stub: *const c_void,
    grid: Dim3,
    block: Dim3,
    args: *mut P,
    shared: c_uint,
    stream: P,
) -> HipError {
    // SAFETY: the launch's own arguments.
    unsafe {
        launch_stub!(
            REAL_hipLaunchCooperativeKernel, c"hipLaunchCooperativeKernel", CooperativeFn,
            stub, stream, args;
            stub, grid, block, args, shared, stream
        )
    }
}

/// `hipExtLaunchKernel(stub, grid, block, args, shared, stream, start, stop, flags)`.
#[no_mangle]
pub unsafe extern "C" fn hipExtLaunchKernel(
    stub: *const c_void,
    grid: Dim3,
    block: Dim3,
    args: *mut P,
    shared: usize,
    stream: P,
    start: P,
    stop: P,
    flags: c_int,
) -> HipError {
    // SAFETY: the launch's own arguments.
    unsafe {
        launch_stub!(
            REAL_hipExtLaunchKernel, c"hipExtLaunchKernel", ExtLaunchFn, stub, stream, args;
            stub, grid, block, args, shared, stream, start, stop, flags
        )
    }
}

/// `hipExtModuleLaunchKernel(f, global x/y/z, local x/y/z, shared, stream, params, extra,
/// start, stop, flags)`.
#[no_mangle]
pub unsafe extern "C" fn hipExtModuleLaunchKernel(
    f: P,
    gx: u32,
    gy: u32,
    gz: u32,
    lx: u32,
    ly: u32,
    lz: u32,
    shared: usize,
    stream: P,
    params: *mut P,
    extra: *mut P,
    start: P,
    stop: P,
    flags: u32,
) -> HipError {
    // SAFETY: the launch's own arguments.
    unsafe {
        launch_through(f as usize, stream as usize, params, extra, || {
            call_real!(
                REAL_hipExtModuleLaunchKernel,
                c"hipExtModuleLaunchKernel",
                ExtModuleLaunchFn,
                f,
                gx,
                gy,
                gz,
                lx,
                ly,
                lz,
                shared,
                stream,
                params,
                extra,
                start,
                stop,
                flags
            )
        })
    }
}

/// Defines `$name(args)` and its stream-ordered `$async(args, stream)`, each counted in
/// `counters.$counter` and run through the hook by `$through` ([`copy_through`] or
/// [`copy_through2`]), called with the stream, the arguments given here, and the call.
macro_rules! sync_and_async {
    ($counter:ident, ($($arg:ident: $t:ty),*), $through:ident($($range:expr),*);
     $name:ident, $slot:ident, $cname:literal, $fn:ty;
     $async:ident, $aslot:ident, $acname:literal, $afn:ty) => {
        #[doc = concat!("`", stringify!($name), "(", stringify!($($arg),*), ")`.")]
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $t),*) -> HipError {
            count(|f| &f.counters.$counter);
            $through(0, $($range,)* || call_real!($slot, $cname, $fn, $($arg),*))
        }

        #[doc = concat!("`", stringify!($async), "(", stringify!($($arg),*), ", stream)`.")]
        #[no_mangle]
        pub unsafe extern "C" fn $async($($arg: $t,)* stream: P) -> HipError {
            count(|f| &f.counters.$counter);
            $through(stream as usize, $($range,)* || {
                call_real!($aslot, $acname, $afn, $($arg,)* stream)
            })
        }
    };
}

// The driver-style copies: the source is a device buffer only for a device-to-device copy.
sync_and_async!(copies, (dst: u64, src: u64, n: usize), copy_through(dst, 0, n);
    hipMemcpyHtoD, REAL_hipMemcpyHtoD, c"hipMemcpyHtoD", CopyFn;
    hipMemcpyHtoDAsync, REAL_hipMemcpyHtoDAsync, c"hipMemcpyHtoDAsync", CopyAsyncFn);
sync_and_async!(copies, (dst: u64, src: u64, n: usize), copy_through(dst, src, n);
    hipMemcpyDtoD, REAL_hipMemcpyDtoD, c"hipMemcpyDtoD", CopyFn;
    hipMemcpyDtoDAsync, REAL_hipMemcpyDtoDAsync, c"hipMemcpyDtoDAsync", CopyAsyncFn);

// The memsets of `n` elements of 1, 2 and 4 bytes at `dst`.
sync_and_async!(memsets, (dst: u64, value: u8, n: usize), copy_through(dst, 0, n);
    hipMemsetD8, REAL_hipMemsetD8, c"hipMemsetD8", SetFn<u8>;
    hipMemsetD8Async, REAL_hipMemsetD8Async, c"hipMemsetD8Async", SetAsyncFn<u8>);
sync_and_async!(memsets, (dst: u64, value: u16, n: usize),
    copy_through(dst, 0, n.saturating_mul(std::mem::size_of::<u16>()));
    hipMemsetD16, REAL_hipMemsetD16, c"hipMemsetD16", SetFn<u16>;
    hipMemsetD16Async, REAL_hipMemsetD16Async, c"hipMemsetD16Async", SetAsyncFn<u16>);
sync_and_async!(memsets, (dst: u64, value: c_int, n: usize),
    copy_through(dst, 0, n.saturating_mul(std::mem::size_of::<c_int>()));
    hipMemsetD32, REAL_hipMemsetD32, c"hipMemsetD32", SetFn<c_int>;
    hipMemsetD32Async, REAL_hipMemsetD32Async, c"hipMemsetD32Async", SetAsyncFn<c_int>);

// The pitched copy: `height` rows of `width` bytes, `dpitch` apart at `dst` and `spitch` apart
// at `src`.
sync_and_async!(copies,
    (dst: P, dpitch: usize, src: *const c_void, spitch: usize, width: usize, height: usize, kind: c_int),
    copy_through2(dst as u64, pitched(dpitch, width, height), src as u64, pitched(spitch, width, height));
    hipMemcpy2D, REAL_hipMemcpy2D, c"hipMemcpy2D", Copy2DFn;
    hipMemcpy2DAsync, REAL_hipMemcpy2DAsync, c"hipMemcpy2DAsync", Copy2DAsyncFn);

/// [`copy_through`] with the source's extent apart from the destination's.
fn copy_through2(
    stream: usize,
    dst: u64,
    dst_len: usize,
    src: u64,
    src_len: usize,
    op: impl FnOnce() -> HipError,
) -> HipError {
    let Some(f) = super::front::made() else {
        return op();
    };
    let writes = f.buffers_of_range(dst, dst_len as u64);
    let reads = f.buffers_of_range(src, src_len as u64);
    f.before_op(super::front::Kind::Copy, stream, &reads, Some(&writes), op)
}

// The pitched memset: `height` rows of `width` bytes, `pitch` apart.
sync_and_async!(memsets, (dst: P, pitch: usize, value: c_int, width: usize, height: usize),
    copy_through(dst as u64, 0, pitched(pitch, width, height));
    hipMemset2D, REAL_hipMemset2D, c"hipMemset2D", Set2DFn;
    hipMemset2DAsync, REAL_hipMemset2DAsync, c"hipMemset2DAsync", Set2DAsyncFn);

// The copies between devices.
sync_and_async!(copies, (dst: P, dst_device: c_int, src: *const c_void, src_device: c_int, n: usize),
    copy_through(dst as u64, src as u64, n);
    hipMemcpyPeer, REAL_hipMemcpyPeer, c"hipMemcpyPeer", PeerFn;
    hipMemcpyPeerAsync, REAL_hipMemcpyPeerAsync, c"hipMemcpyPeerAsync", PeerAsyncFn);

/// The wrapper of `name` among these functions, if it is one.
pub fn wrapper(name: &[u8]) -> Option<*const ()> {
    wrapper_of!(
        name;
        hipLaunchCooperativeKernel,
        hipExtLaunchKernel,
        hipExtModuleLaunchKernel,
        hipMemcpyHtoD,
        hipMemcpyHtoDAsync,
        hipMemcpyDtoD,
        hipMemcpyDtoDAsync,
        hipMemsetD8,
        hipMemsetD8Async,
        hipMemsetD16,
        hipMemsetD16Async,
        hipMemsetD32,
        hipMemsetD32Async,
        hipMemcpy2D,
        hipMemcpy2DAsync,
        hipMemset2D,
        hipMemset2DAsync,
        hipMemcpyPeer,
        hipMemcpyPeerAsync
    )
}
