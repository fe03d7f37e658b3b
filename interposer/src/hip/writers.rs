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

/// Defines a driver-style copy `$name(dst, src, n)` and its stream-ordered `$async`; the source
/// is read from a device buffer when `$from_device`.
macro_rules! copies {
    ($name:ident, $slot:ident, $cname:literal, $async:ident, $aslot:ident, $acname:literal,
     $from_device:expr) => {
        #[doc = concat!("`", stringify!($name), "(dst, src, n)`.")]
        #[no_mangle]
        pub unsafe extern "C" fn $name(dst: u64, src: u64, n: usize) -> HipError {
            count(|f| &f.counters.copies);
            let from = if $from_device { src } else { 0 };
            copy_through(0, dst, from, n, || {
                call_real!($slot, $cname, CopyFn, dst, src, n)
            })
        }

        #[doc = concat!("`", stringify!($async), "(dst, src, n, stream)`.")]
        #[no_mangle]
        pub unsafe extern "C" fn $async(dst: u64, src: u64, n: usize, stream: P) -> HipError {
            count(|f| &f.counters.copies);
            let from = if $from_device { src } else { 0 };
            copy_through(stream as usize, dst, from, n, || {
                call_real!($aslot, $acname, CopyAsyncFn, dst, src, n, stream)
            })
        }
    };
}

copies!(
    hipMemcpyHtoD,
    REAL_hipMemcpyHtoD,
    c"hipMemcpyHtoD",
    hipMemcpyHtoDAsync,
    REAL_hipMemcpyHtoDAsync,
    c"hipMemcpyHtoDAsync",
    false
);
copies!(
    hipMemcpyDtoD,
    REAL_hipMemcpyDtoD,
    c"hipMemcpyDtoD",
    hipMemcpyDtoDAsync,
    REAL_hipMemcpyDtoDAsync,
    c"hipMemcpyDtoDAsync",
    true
);

/// Defines a memset of `count` elements of type `$t` at `dst`, `$name(dst, value, count)`, and
/// its stream-ordered `$async`.
macro_rules! memsets {
    ($name:ident, $slot:ident, $cname:literal, $async:ident, $aslot:ident, $acname:literal,
     $t:ty) => {
        #[doc = concat!("`", stringify!($name), "(dst, value, count)`.")]
        #[no_mangle]
        pub unsafe extern "C" fn $name(dst: u64, value: $t, n: usize) -> HipError {
            count(|f| &f.counters.memsets);
            let bytes = n.saturating_mul(std::mem::size_of::<$t>());
            copy_through(0, dst, 0, bytes, || {
                call_real!($slot, $cname, SetFn<$t>, dst, value, n)
            })
        }

        #[doc = concat!("`", stringify!($async), "(dst, value, count, stream)`.")]
        #[no_mangle]
        pub unsafe extern "C" fn $async(dst: u64, value: $t, n: usize, stream: P) -> HipError {
            count(|f| &f.counters.memsets);
            let bytes = n.saturating_mul(std::mem::size_of::<$t>());
            copy_through(stream as usize, dst, 0, bytes, || {
                call_real!($aslot, $acname, SetAsyncFn<$t>, dst, value, n, stream)
            })
        }
    };
}

memsets!(
    hipMemsetD8,
    REAL_hipMemsetD8,
    c"hipMemsetD8",
    hipMemsetD8Async,
    REAL_hipMemsetD8Async,
    c"hipMemsetD8Async",
    u8
);
memsets!(
    hipMemsetD16,
    REAL_hipMemsetD16,
    c"hipMemsetD16",
    hipMemsetD16Async,
    REAL_hipMemsetD16Async,
    c"hipMemsetD16Async",
    u16
);
memsets!(
    hipMemsetD32,
    REAL_hipMemsetD32,
    c"hipMemsetD32",
    hipMemsetD32Async,
    REAL_hipMemsetD32Async,
    c"hipMemsetD32Async",
    c_int
);

/// `hipMemcpy2D(dst, dpitch, src, spitch, width, height, kind)`.
#[no_mangle]
pub unsafe extern "C" fn hipMemcpy2D(
    dst: P,
    dpitch: usize,
    src: *const c_void,
    spitch: usize,
    width: usize,
    height: usize,
    kind: c_int,
) -> HipError {
    count(|f| &f.counters.copies);
    let (d, s) = (
        pitched(dpitch, width, height),
        pitched(spitch, width, height),
    );
    copy_through2(0, dst as u64, d, src as u64, s, || {
        call_real!(
            REAL_hipMemcpy2D,
            c"hipMemcpy2D",
            Copy2DFn,
            dst,
            dpitch,
            src,
            spitch,
            width,
            height,
            kind
        )
    })
}

/// `hipMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream)`.
#[no_mangle]
pub unsafe extern "C" fn hipMemcpy2DAsync(
    dst: P,
    dpitch: usize,
    src: *const c_void,
    spitch: usize,
    width: usize,
    height: usize,
    kind: c_int,
    stream: P,
) -> HipError {
    count(|f| &f.counters.copies);
    let (d, s) = (
        pitched(dpitch, width, height),
        pitched(spitch, width, height),
    );
    copy_through2(stream as usize, dst as u64, d, src as u64, s, || {
        call_real!(
            REAL_hipMemcpy2DAsync,
            c"hipMemcpy2DAsync",
            Copy2DAsyncFn,
            dst,
            dpitch,
            src,
            spitch,
            width,
            height,
            kind,
            stream
        )
    })
}

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

/// `hipMemset2D(dst, pitch, value, width, height)`.
#[no_mangle]
pub unsafe extern "C" fn hipMemset2D(
    dst: P,
    pitch: usize,
    value: c_int,
    width: usize,
    height: usize,
) -> HipError {
    count(|f| &f.counters.memsets);
    copy_through(0, dst as u64, 0, pitched(pitch, width, height), || {
        call_real!(
            REAL_hipMemset2D,
            c"hipMemset2D",
            Set2DFn,
            dst,
            pitch,
            value,
            width,
            height
        )
    })
}

/// `hipMemset2DAsync(dst, pitch, value, width, height, stream)`.
#[no_mangle]
pub unsafe extern "C" fn hipMemset2DAsync(
    dst: P,
    pitch: usize,
    value: c_int,
    width: usize,
    height: usize,
    stream: P,
) -> HipError {
    count(|f| &f.counters.memsets);
    let len = pitched(pitch, width, height);
    copy_through(stream as usize, dst as u64, 0, len, || {
        call_real!(
            REAL_hipMemset2DAsync,
            c"hipMemset2DAsync",
            Set2DAsyncFn,
            dst,
            pitch,
            value,
            width,
            height,
            stream
        )
    })
}

/// `hipMemcpyPeer(dst, dst_device, src, src_device, n)`.
#[no_mangle]
pub unsafe extern "C" fn hipMemcpyPeer(
    dst: P,
    dst_device: c_int,
    src: *const c_void,
    src_device: c_int,
    n: usize,
) -> HipError {
    count(|f| &f.counters.copies);
    copy_through(0, dst as u64, src as u64, n, || {
        call_real!(
            REAL_hipMemcpyPeer,
            c"hipMemcpyPeer",
            PeerFn,
            dst,
            dst_device,
            src,
            src_device,
            n
        )
    })
}

/// `hipMemcpyPeerAsync(dst, dst_device, src, src_device, n, stream)`.
#[no_mangle]
pub unsafe extern "C" fn hipMemcpyPeerAsync(
    dst: P,
    dst_device: c_int,
    src: *const c_void,
    src_device: c_int,
    n: usize,
    stream: P,
) -> HipError {
    count(|f| &f.counters.copies);
    copy_through(stream as usize, dst as u64, src as u64, n, || {
        call_real!(
            REAL_hipMemcpyPeerAsync,
            c"hipMemcpyPeerAsync",
            PeerAsyncFn,
            dst,
            dst_device,
            src,
            src_device,
            n,
            stream
        )
    })
}

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
