//! The job's CUDA objects as the interposer needs to see them: kernels' parameter layouts and
//! names, the current device, stream capture, graphs' nodes, synchronous reads of device memory.
//!
//! One of the three modules of this crate with `unsafe` code (with `driver` and `checkpoint`).
//! Like `driver`, every function here is safe to call: handles the job passed to the driver
//! (functions, kernels, streams, graphs) are only handed back to the driver, which validates them
//! and returns an error for a bad one; out-pointers are locals of the right type; enums the driver
//! writes are read as raw `u32`s, so a value newer than these bindings is never an invalid Rust
//! enum.
//!
//! These run on the job's threads (inside CUPTI callbacks): they allocate only what they return
//! and never take possum's locks.
#![allow(unsafe_code)]

use std::ffi::{c_char, CStr};
use std::ptr;

use cudarc::driver::sys::{self, CUresult};
use possum_engine::device::{DeviceError, DeviceResult};

use crate::driver::{check, check_async, describe, load};

fn ensure_loaded() -> DeviceResult<()> {
    load().map_err(|message| DeviceError::Backend {
        call: "dlopen(libcuda)",
        code: -1,
        message,
    })
}

/// A kernel's parameters as (offset, size) in bytes, in parameter order.
pub type Layout = Vec<(u32, u32)>;

/// Asks `get(index, &offset, &size)` for parameters 0, 1, ... until the driver says there are no
/// more. `Err` carries the driver's code for parameter 0.
fn walk_params(
    mut get: impl FnMut(usize, &mut usize, &mut usize) -> CUresult,
) -> Result<Layout, CUresult> {
    let mut out = Vec::new();
    for i in 0.. {
        let (mut off, mut size) = (0usize, 0usize);
        let r = get(i, &mut off, &mut size);
        if r != CUresult::CUDA_SUCCESS {
            if i == 0 {
                return Err(r);
            }
            break;
        }
        let (Ok(o), Ok(s)) = (u32::try_from(off), u32::try_from(size)) else {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        };
        out.push((o, s));
        if i >= 4096 {
            break;
        }
    }
    Ok(out)
}

/// The parameter layout of the kernel whose handle a launch passed as its `CUfunction`: a
/// `CUfunction` (`cuFuncGetParamInfo`) or a library kernel's `CUkernel` (`cuKernelGetParamInfo`),
/// tried in that order. A kernel without parameters answers "invalid value" for parameter 0 to
/// both; that is told apart from a handle neither call knows by asking the handle's name.
/// `Err` names both calls' answers.
pub fn param_layout(handle: u64) -> Result<Layout, String> {
    ensure_loaded().map_err(|e| e.to_string())?;
    let f = handle as usize as sys::CUfunction;
    // SAFETY: the library is loaded; `f` is a handle the job passed to a launch, only handed back
    // to the driver (which checks it); the out-pointers are locals.
    let e1 = match walk_params(|i, o, s| unsafe { sys::cuFuncGetParamInfo(f, i, o, s) }) {
        Ok(l) => return Ok(l),
        Err(e) => e,
    };
    let k = handle as usize as sys::CUkernel;
    // SAFETY: as above, for the `CUkernel` reading of the handle.
    let e2 = match walk_params(|i, o, s| unsafe { sys::cuKernelGetParamInfo(k, i, o, s) }) {
        Ok(l) => return Ok(l),
        Err(e) => e,
    };
    let invalid = CUresult::CUDA_ERROR_INVALID_VALUE;
    if (e1 == invalid || e2 == invalid) && kernel_name(handle).is_some() {
        return Ok(Vec::new());
    }
    Err(format!(
        "cuFuncGetParamInfo: {}; cuKernelGetParamInfo: {}",
        describe(e1),
        describe(e2)
    ))
}

/// The (mangled) name of a launch's function handle, as a `CUfunction` or else a `CUkernel`.
pub fn kernel_name(handle: u64) -> Option<String> {
    ensure_loaded().ok()?;
    let mut s: *const c_char = ptr::null();
    // SAFETY: the library is loaded; the handle is only handed back to the driver; `s` is a local.
    let mut r = unsafe { sys::cuFuncGetName(&mut s, handle as usize as sys::CUfunction) };
    if r != CUresult::CUDA_SUCCESS || s.is_null() {
        // SAFETY: as above, for the `CUkernel` reading.
        r = unsafe { sys::cuKernelGetName(&mut s, handle as usize as sys::CUkernel) };
    }
    if r != CUresult::CUDA_SUCCESS || s.is_null() {
        return None;
    }
    // SAFETY: on success the driver points `s` at a NUL-terminated string it owns for as long as
    // the function's module is loaded; it is copied at once.
    Some(unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
}

/// The ordinal of the device of the calling thread's current context.
pub fn current_device() -> DeviceResult<usize> {
    ensure_loaded()?;
    let mut d: sys::CUdevice = 0;
    // SAFETY: the library is loaded; `d` is a local.
    check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut d) })?;
    usize::try_from(d).map_err(|_| DeviceError::Backend {
        call: "cuCtxGetDevice",
        code: -1,
        message: format!("negative device {d}"),
    })
}

/// The allocation (start, size) the driver knows `addr` to be inside, in the calling thread's
/// current context: any `cuMemAlloc*`, pool or mapped VMM range, whoever made it. `None` if the
/// driver knows none (the value is then not a device address of this context).
pub fn allocation_of(addr: u64) -> Option<(u64, u64)> {
    ensure_loaded().ok()?;
    crate::driver::address_range(addr).ok()
}

/// Whether `stream` (a raw handle of the job's) is being captured into a graph now.
pub fn is_capturing(stream: u64) -> DeviceResult<bool> {
    ensure_loaded()?;
    let mut status: u32 = 0;
    // SAFETY: the library is loaded; the stream handle is only handed back to the driver;
    // `CUstreamCaptureStatus` is a C enum (32 bits), read here as a raw `u32`.
    let r = unsafe {
        sys::cuStreamIsCapturing(
            stream as usize as sys::CUstream,
            (&mut status as *mut u32).cast(),
        )
    };
    check("cuStreamIsCapturing", r)?;
    Ok(status != 0)
}

/// Blocks until everything queued in the calling thread's current context has completed.
pub fn ctx_synchronize() -> DeviceResult<()> {
    ensure_loaded()?;
    // SAFETY: the library is loaded; no arguments.
    check_async("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// Blocks until everything queued in device `ordinal`'s primary context has completed (that
/// context is then current on the calling thread).
pub fn primary_ctx_synchronize(ordinal: usize) -> DeviceResult<()> {
    ensure_loaded()?;
    let ctx = crate::driver::Context::retain_primary(crate::driver::device_get(ordinal)?)?;
    ctx.synchronize()
}

/// Copies `dst.len()` bytes of device memory at `src` into `dst`, synchronously (the copy is
/// complete when this returns; it is ordered after the legacy default stream's work).
pub fn read_device(src: u64, dst: &mut [u8]) -> DeviceResult<()> {
    ensure_loaded()?;
    if dst.is_empty() {
        return Ok(());
    }
    // SAFETY: `dst` is valid for `dst.len()` bytes of writes and the copy is synchronous, so the
    // driver is done with it when the call returns. A bad device address is refused by the driver.
    check("cuMemcpyDtoH_v2", unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
    })
}

/// One node of a CUDA graph, as far as possum cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GraphNode {
    /// A kernel node: the handle it launches and each parameter's bytes (per the kernel's layout;
    /// `None` if the layout is unknown).
    Kernel {
        /// The `CUfunction` (or `CUkernel`) handle.
        handle: u64,
        /// The parameters' bytes, in parameter order.
        params: Option<Vec<Vec<u8>>>,
    },
    /// A memset node writing `bytes` bytes from `dst` (rows of `width` elements, `height` rows).
    Memset {
        /// First address written.
        dst: u64,
        /// Extent written (pitch × (height − 1) + width × element size).
        bytes: u64,
    },
    /// Any other node type (`CUgraphNodeType` value): copies, child graphs, host nodes...
    Other(u32),
}

/// The nodes of the job's graph `graph`. Kernel parameters are copied out of the graph, so the
/// result stays valid after the graph changes or is destroyed.
pub fn graph_nodes(graph: u64) -> DeviceResult<Vec<GraphNode>> {
    ensure_loaded()?;
    let g = graph as usize as sys::CUgraph;
    let mut n = 0usize;
    // SAFETY: null `nodes` asks for the count only; `n` is a local.
    check("cuGraphGetNodes", unsafe {
        sys::cuGraphGetNodes(g, ptr::null_mut(), &mut n)
    })?;
    let mut nodes: Vec<sys::CUgraphNode> = vec![ptr::null_mut(); n];
    // SAFETY: `nodes` has room for `n` handles; the driver writes at most `n` and updates `n`.
    check("cuGraphGetNodes", unsafe {
        sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n)
    })?;
    nodes.truncate(n);
    let mut out = Vec::with_capacity(n);
    for node in nodes {
        let mut ty: u32 = 0;
        // SAFETY: `node` came from the driver for this graph; the enum is read as a raw `u32`.
        check("cuGraphNodeGetType", unsafe {
            sys::cuGraphNodeGetType(node, (&mut ty as *mut u32).cast())
        })?;
        out.push(match ty {
            0 => kernel_node(node)?,
            2 => memset_node(node)?,
            other => GraphNode::Other(other),
        });
    }
    Ok(out)
}

fn kernel_node(node: sys::CUgraphNode) -> DeviceResult<GraphNode> {
    // SAFETY: an all-zero CUDA_KERNEL_NODE_PARAMS (pointers null, numbers 0) is a valid value.
    let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: `node` is a kernel node of a live graph; `p` is a local of the type the call fills.
    check("cuGraphKernelNodeGetParams_v2", unsafe {
        sys::cuGraphKernelNodeGetParams_v2(node, &mut p)
    })?;
    let handle = if p.func.is_null() {
        p.kern as usize as u64
    } else {
        p.func as usize as u64
    };
    let params = match (param_layout(handle), p.kernelParams.is_null()) {
        (Ok(layout), false) => Some(
            layout
                .iter()
                .enumerate()
                .map(|(i, &(_, size))| {
                    // SAFETY: `kernelParams` has one pointer per parameter of the kernel (the
                    // layout's length), each to that parameter's `size` bytes, owned by the graph
                    // node while the graph lives; the bytes are copied at once.
                    unsafe {
                        let arg = *p.kernelParams.add(i);
                        if arg.is_null() {
                            Vec::new()
                        } else {
                            std::slice::from_raw_parts(arg.cast::<u8>(), size as usize).to_vec()
                        }
                    }
                })
                .collect(),
        ),
        _ => None,
    };
    Ok(GraphNode::Kernel { handle, params })
}

fn memset_node(node: sys::CUgraphNode) -> DeviceResult<GraphNode> {
    // SAFETY: an all-zero CUDA_MEMSET_NODE_PARAMS is a valid value.
    let mut p: sys::CUDA_MEMSET_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: `node` is a memset node of a live graph; `p` is a local of the type the call fills.
    check("cuGraphMemsetNodeGetParams", unsafe {
        sys::cuGraphMemsetNodeGetParams(node, &mut p)
    })?;
    let row = p.width as u64 * u64::from(p.elementSize);
    let bytes = if p.height <= 1 {
        row
    } else {
        p.pitch as u64 * (p.height as u64 - 1) + row
    };
    Ok(GraphNode::Memset { dst: p.dst, bytes })
}
