//! The CUPTI driver-API callbacks possum enables, and what each one means to it.
//!
//! The numbers are `CUpti_driver_api_trace_cbid` values from CUPTI's `cupti_driver_cbid.h` for
//! CUDA 13.0, taken from cudarc 0.19.10's bindgen output of that header (`src/cupti/sys/mod.rs`,
//! the `CUpti_driver_api_trace_cbid_enum` under `feature = "cuda-13000"`, whose
//! `CUPTI_DRIVER_TRACE_CBID_SIZE` is 807). `cuLaunchKernel = 307` and `cuLaunchKernelEx = 652` /
//! `_ptsz = 653` were cross-checked against an independent copy of the header. CUPTI keeps the
//! numbers of existing functions stable across releases and only appends new ones.
//!
//! Only these callbacks are enabled: enabling every driver callback made a launch-bound job 23%
//! slower (`shared/FINDINGS.md`).

/// What a driver call is, for the statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A kernel launch (`cuLaunchKernel` and relatives).
    Launch,
    /// A CUDA graph launch.
    Graph,
    /// A memory copy.
    Copy,
    /// A memset.
    Memset,
    /// Device memory allocation, freeing or mapping.
    Alloc,
    /// Stream creation and destruction.
    Stream,
    /// Stream capture and graph instantiation.
    Capture,
    /// Driver entry points looked up (`cuGetProcAddress`).
    Entry,
}

impl Kind {
    /// Every kind, in the order the statistics list them.
    pub const ALL: [Kind; 8] = [
        Kind::Launch,
        Kind::Graph,
        Kind::Copy,
        Kind::Memset,
        Kind::Alloc,
        Kind::Stream,
        Kind::Capture,
        Kind::Entry,
    ];

    /// The key of this kind's object in the statistics JSON.
    pub fn key(self) -> &'static str {
        match self {
            Kind::Launch => "launches",
            Kind::Graph => "graphs",
            Kind::Copy => "copies",
            Kind::Memset => "memsets",
            Kind::Alloc => "allocs",
            Kind::Stream => "streams",
            Kind::Capture => "captures",
            Kind::Entry => "entry_points",
        }
    }
}

/// Where a call's stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamAt {
    /// In 8-byte word `n` of the params struct.
    Word(usize),
    /// In the `CUlaunchConfig` that word `n` points at (its `hStream`, at byte 32).
    Config(usize),
    /// The legacy default stream (a synchronous call).
    Legacy,
    /// The calling thread's per-thread default stream (a synchronous `_ptds` call).
    PerThread,
    /// As `Word`, in a `_ptsz` call: there a null stream is the calling thread's per-thread
    /// default stream, not the legacy one.
    WordPt(usize),
    /// As `Config`, in a `_ptsz` call.
    ConfigPt(usize),
}

/// Where an operation of [`Shape::Write`] writes (and reads), as words of its params struct.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteAt {
    /// `bytes` (a word) at the address in word `ptr` (`cuMemcpyAtoD_v2`: an array's bytes).
    Span {
        /// Word of the destination address.
        ptr: usize,
        /// Word of the byte count.
        bytes: usize,
    },
    /// A value of `size` bytes at the address in word `ptr` (`cuStreamWriteValue32/64`).
    Value {
        /// Word of the destination address.
        ptr: usize,
        /// The value's size in bytes.
        size: u64,
    },
    /// A pitched 2D memset (`cuMemsetD2D*`: `dst, pitch, value, width, height`): `height` rows
    /// of `width` elements of `elem` bytes, `pitch` bytes apart.
    Pitched {
        /// Element size in bytes.
        elem: u64,
    },
    /// A `CUDA_MEMCPY2D` descriptor at word 0: its device destination's pitched range written,
    /// its device source's read.
    Copy2D,
    /// A `CUDA_MEMCPY3D` or `CUDA_MEMCPY3D_PEER` descriptor (the same words) at word 0.
    Copy3D,
    /// `cuMemcpyBatchAsync*(dsts, srcs, sizes, count, ...)`: `count` copies, each of `sizes[i]`
    /// bytes from `srcs[i]` to `dsts[i]` (either may be a host address).
    CopyBatch,
    /// `cuStreamBatchMemOp*(stream, count, paramArray, flags)`: each write-value operation's
    /// value; an operation of a kind possum does not know makes the call opaque.
    BatchMemOp,
}

/// How possum reads a call's `cu<name>_params` struct. Every field named here is one 8-byte word
/// of the struct (pointers, handles, `size_t`, and small integers padded to 8 bytes), numbered
/// from 0; the layouts are cupti_driver_cbid.h's (CUDA 13.0) as cudarc 0.19.10 binds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// A kernel launch: the function handle, the stream, `void **kernelParams`, `void **extra`.
    Launch {
        /// Word of `CUfunction f`.
        func: usize,
        /// The stream.
        stream: StreamAt,
        /// Word of `void **kernelParams`.
        params: usize,
        /// Word of `void **extra`, if the call has one.
        extra: Option<usize>,
    },
    /// `cuGraphLaunch(hGraphExec, hStream)`: the stream (word 1).
    GraphLaunch {
        /// The stream.
        stream: StreamAt,
    },
    /// A copy of `bytes` (a word) from `src` to `dst` (words; either may be a host address).
    Copy {
        /// Word of the destination address.
        dst: usize,
        /// Word of the source address.
        src: usize,
        /// Word of the byte count.
        bytes: usize,
        /// The stream.
        stream: StreamAt,
    },
    /// A memset of `count` (a word) elements of `elem` bytes at `dst` (a word).
    Memset {
        /// Word of the destination.
        dst: usize,
        /// Word of the element count.
        count: usize,
        /// Element size in bytes.
        elem: u64,
        /// The stream.
        stream: StreamAt,
    },
    /// An operation that writes device memory where its params say ([`WriteAt`]; a host or
    /// array destination resolves to nothing) and reads what its source says, if anything.
    Write {
        /// Where the written (and read) ranges are.
        at: WriteAt,
        /// The stream.
        stream: StreamAt,
    },
    /// An operation on a stream whose buffers possum does not decode (batched 3D copies,
    /// decompression, legacy and multi-device launches): treated as touching every buffer.
    OpaqueOp {
        /// The stream.
        stream: StreamAt,
    },
    /// An allocation: on exit, `*(word out)` is the address and word `bytes` the size.
    Alloc {
        /// Word of `CUdeviceptr *dptr`.
        out: usize,
        /// Word of the size.
        bytes: usize,
    },
    /// `cuMemAllocPitch_v2(dptr*, pPitch*, WidthInBytes, Height, ElementSizeBytes)`.
    AllocPitch,
    /// `cuMemMap(ptr, size, offset, handle, flags)`: a range of the job's own VMM mappings.
    Map,
    /// A free of the allocation at word `ptr`.
    Free {
        /// Word of the address.
        ptr: usize,
    },
    /// `cuMemUnmap(ptr, size)`.
    Unmap,
    /// `cuMemImportFromShareableHandle(handle*, osHandle, type)`: a handle of memory another
    /// process shared (NCCL's peer buffers): its mappings are the driver's to checkpoint.
    Import,
    /// `cuMemRelease(handle)` of a handle of the driver's.
    Release,
    /// `cuStreamDestroy(hStream)`.
    StreamDestroy,
    /// `cuStreamBeginCapture(hStream, ...)`.
    CaptureBegin,
    /// `cuStreamEndCapture(hStream, phGraph)`.
    CaptureEnd,
    /// `cuGraphInstantiate*(phGraphExec, hGraph, ...)`.
    GraphInstantiate,
    /// `cuGraphExecDestroy(hGraphExec)`.
    GraphExecDestroy,
    /// A call that changes an instantiated graph's nodes (word 0 is the `CUgraphExec`).
    GraphExecChanged,
    /// `cuGetProcAddress*(symbol, pfn, cudaVersion, ...)`: allocation entry points are swapped
    /// for possum's on exit (`drvalloc`).
    ProcAddress,
    /// Counted only.
    Count,
}

impl Shape {
    /// Whether the call enqueues work the engine's hook sees (a launch, graph launch, copy or
    /// memset): it waits while the job is paused, is hooked on entry, and its guard is dropped on
    /// exit.
    pub const fn is_operation(self) -> bool {
        matches!(
            self,
            Shape::Launch { .. }
                | Shape::GraphLaunch { .. }
                | Shape::Copy { .. }
                | Shape::Memset { .. }
                | Shape::Write { .. }
                | Shape::OpaqueOp { .. }
        )
    }
}

/// One enabled callback.
#[derive(Debug, Clone, Copy)]
pub struct Callback {
    /// The driver function's name, as in `CUPTI_DRIVER_TRACE_CBID_<name>`.
    pub name: &'static str,
    /// Its `CUpti_driver_api_trace_cbid` value.
    pub id: u32,
    /// What it is, for the statistics.
    pub kind: Kind,
    /// How its parameters are read.
    pub shape: Shape,
}

impl Callback {
    /// For launches: the word of the `CUfunction f` field.
    pub const fn function_field(&self) -> Option<usize> {
        match self.shape {
            Shape::Launch { func, .. } => Some(func),
            _ => None,
        }
    }
}

const fn cb(name: &'static str, id: u32, kind: Kind, shape: Shape) -> Callback {
    Callback {
        name,
        id,
        kind,
        shape,
    }
}

const fn launch(name: &'static str, id: u32, stream: StreamAt, extra: bool) -> Callback {
    // cuLaunchKernel / cuLaunchCooperativeKernel: f, grid x y z, block x y z, sharedMemBytes (four
    // words of 32-bit pairs), hStream (word 5), kernelParams (6), extra (7, cuLaunchKernel only).
    // cuLaunchKernelEx: config (0), f (1), kernelParams (2), extra (3).
    let shape = match stream {
        StreamAt::Config(_) | StreamAt::ConfigPt(_) => Shape::Launch {
            func: 1,
            stream,
            params: 2,
            extra: Some(3),
        },
        _ => Shape::Launch {
            func: 0,
            stream,
            params: 6,
            extra: if extra { Some(7) } else { None },
        },
    };
    cb(name, id, Kind::Launch, shape)
}

const fn copy(
    name: &'static str,
    id: u32,
    dst: usize,
    src: usize,
    bytes: usize,
    stream: StreamAt,
) -> Callback {
    cb(
        name,
        id,
        Kind::Copy,
        Shape::Copy {
            dst,
            src,
            bytes,
            stream,
        },
    )
}

const fn memset(name: &'static str, id: u32, elem: u64, stream: StreamAt) -> Callback {
    cb(
        name,
        id,
        Kind::Memset,
        Shape::Memset {
            dst: 0,
            count: 2,
            elem,
            stream,
        },
    )
}

const fn write(name: &'static str, id: u32, kind: Kind, at: WriteAt, stream: StreamAt) -> Callback {
    cb(name, id, kind, Shape::Write { at, stream })
}

const fn opaque(name: &'static str, id: u32, kind: Kind, stream: StreamAt) -> Callback {
    cb(name, id, kind, Shape::OpaqueOp { stream })
}

const fn opaque_copy(name: &'static str, id: u32, stream: StreamAt) -> Callback {
    cb(name, id, Kind::Copy, Shape::OpaqueOp { stream })
}

/// `cuLaunchCooperativeKernelMultiDevice`: a launch on several devices at once.
pub const MULTI_DEVICE_LAUNCH: u32 = 480;

/// Upper bound (exclusive) on the ids in [`CALLBACKS`]; sizes the counter array.
pub const ID_LIMIT: usize = 1024;

/// The driver's `CUresult` codes possum's served calls answer with (`CUDA_SUCCESS`,
/// `CUDA_ERROR_INVALID_VALUE`, `CUDA_ERROR_OUT_OF_MEMORY`, `CUDA_ERROR_NOT_SUPPORTED`): the
/// allocation entry points of `drvalloc.rs`, `vmm.rs` and `pools.rs`.
pub(crate) const SUCCESS: std::ffi::c_int = 0;
pub(crate) const INVALID_VALUE: std::ffi::c_int = 1;
pub(crate) const OUT_OF_MEMORY: std::ffi::c_int = 2;
pub(crate) const NOT_SUPPORTED: std::ffi::c_int = 801;

use StreamAt::{Config, ConfigPt, Legacy, PerThread, Word, WordPt};
use WriteAt::{BatchMemOp, Copy2D, Copy3D, CopyBatch, Pitched, Span, Value};

/// Every callback possum enables. `_ptsz` / `_ptds` are the per-thread-default-stream variants.
pub const CALLBACKS: &[Callback] = &[
    launch("cuLaunchKernel", 307, Word(5), true),
    launch("cuLaunchKernel_ptsz", 442, WordPt(5), true),
    launch("cuLaunchKernelEx", 652, Config(0), true),
    launch("cuLaunchKernelEx_ptsz", 653, ConfigPt(0), true),
    launch("cuLaunchCooperativeKernel", 477, Word(5), false),
    launch("cuLaunchCooperativeKernel_ptsz", 478, WordPt(5), false),
    cb(
        "cuGraphLaunch",
        514,
        Kind::Graph,
        Shape::GraphLaunch { stream: Word(1) },
    ),
    cb(
        "cuGraphLaunch_ptsz",
        515,
        Kind::Graph,
        Shape::GraphLaunch { stream: WordPt(1) },
    ),
    copy("cuMemcpy", 305, 0, 1, 2, Legacy),
    copy("cuMemcpy_ptds", 408, 0, 1, 2, PerThread),
    copy("cuMemcpyAsync", 306, 0, 1, 2, Word(3)),
    copy("cuMemcpyAsync_ptsz", 418, 0, 1, 2, WordPt(3)),
    copy("cuMemcpyHtoD_v2", 276, 0, 1, 2, Legacy),
    copy("cuMemcpyHtoD_v2_ptds", 397, 0, 1, 2, PerThread),
    copy("cuMemcpyHtoDAsync_v2", 277, 0, 1, 2, Word(3)),
    copy("cuMemcpyHtoDAsync_v2_ptsz", 421, 0, 1, 2, WordPt(3)),
    copy("cuMemcpyDtoH_v2", 278, 0, 1, 2, Legacy),
    copy("cuMemcpyDtoH_v2_ptds", 398, 0, 1, 2, PerThread),
    copy("cuMemcpyDtoHAsync_v2", 279, 0, 1, 2, Word(3)),
    copy("cuMemcpyDtoHAsync_v2_ptsz", 422, 0, 1, 2, WordPt(3)),
    copy("cuMemcpyDtoD_v2", 280, 0, 1, 2, Legacy),
    copy("cuMemcpyDtoD_v2_ptds", 399, 0, 1, 2, PerThread),
    copy("cuMemcpyDtoDAsync_v2", 281, 0, 1, 2, Word(3)),
    copy("cuMemcpyDtoDAsync_v2_ptsz", 423, 0, 1, 2, WordPt(3)),
    // (dstDevice, dstContext, srcDevice, srcContext, ByteCount, hStream)
    copy("cuMemcpyPeerAsync", 319, 0, 2, 4, Word(5)),
    copy("cuMemcpyPeerAsync_ptsz", 426, 0, 2, 4, WordPt(5)),
    // (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, hStream)
    write("cuMemcpyBatchAsync", 776, Kind::Copy, CopyBatch, Word(8)),
    write(
        "cuMemcpyBatchAsync_ptsz",
        777,
        Kind::Copy,
        CopyBatch,
        WordPt(8),
    ),
    // (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, hStream)
    write("cuMemcpyBatchAsync_v2", 796, Kind::Copy, CopyBatch, Word(7)),
    write(
        "cuMemcpyBatchAsync_v2_ptsz",
        797,
        Kind::Copy,
        CopyBatch,
        WordPt(7),
    ),
    // (const CUDA_MEMCPY2D/3D/3D_PEER *pCopy[, hStream])
    write("cuMemcpy2D_v2", 287, Kind::Copy, Copy2D, Legacy),
    write("cuMemcpy2D_v2_ptds", 405, Kind::Copy, Copy2D, PerThread),
    write("cuMemcpy2DUnaligned_v2", 288, Kind::Copy, Copy2D, Legacy),
    write(
        "cuMemcpy2DUnaligned_v2_ptds",
        406,
        Kind::Copy,
        Copy2D,
        PerThread,
    ),
    write("cuMemcpy2DAsync_v2", 289, Kind::Copy, Copy2D, Word(1)),
    write(
        "cuMemcpy2DAsync_v2_ptsz",
        424,
        Kind::Copy,
        Copy2D,
        WordPt(1),
    ),
    write("cuMemcpy3D_v2", 290, Kind::Copy, Copy3D, Legacy),
    write("cuMemcpy3D_v2_ptds", 407, Kind::Copy, Copy3D, PerThread),
    write("cuMemcpy3DAsync_v2", 291, Kind::Copy, Copy3D, Word(1)),
    write(
        "cuMemcpy3DAsync_v2_ptsz",
        425,
        Kind::Copy,
        Copy3D,
        WordPt(1),
    ),
    write("cuMemcpy3DPeer", 320, Kind::Copy, Copy3D, Legacy),
    write("cuMemcpy3DPeer_ptds", 410, Kind::Copy, Copy3D, PerThread),
    write("cuMemcpy3DPeerAsync", 321, Kind::Copy, Copy3D, Word(1)),
    write(
        "cuMemcpy3DPeerAsync_ptsz",
        427,
        Kind::Copy,
        Copy3D,
        WordPt(1),
    ),
    // (dstDevice, dstContext, srcDevice, srcContext, ByteCount)
    copy("cuMemcpyPeer", 318, 0, 2, 4, Legacy),
    copy("cuMemcpyPeer_ptds", 409, 0, 2, 4, PerThread),
    // (dst, src, size, attr, hStream): CUDA 13.2, whose ids CUPTI appended after 13.0's.
    copy("cuMemcpyWithAttributesAsync", 837, 0, 1, 2, Word(4)),
    copy("cuMemcpyWithAttributesAsync_ptsz", 838, 0, 1, 2, WordPt(4)),
    // (dstDevice, srcArray, srcOffset, ByteCount)
    write(
        "cuMemcpyAtoD_v2",
        284,
        Kind::Copy,
        Span { ptr: 0, bytes: 3 },
        Legacy,
    ),
    write(
        "cuMemcpyAtoD_v2_ptds",
        401,
        Kind::Copy,
        Span { ptr: 0, bytes: 3 },
        PerThread,
    ),
    // (numOps, opList, [failIdx,] flags, hStream): operands of several kinds, not decoded.
    opaque_copy("cuMemcpy3DBatchAsync", 778, Word(4)),
    opaque_copy("cuMemcpy3DBatchAsync_ptsz", 779, WordPt(4)),
    opaque_copy("cuMemcpy3DBatchAsync_v2", 798, Word(3)),
    opaque_copy("cuMemcpy3DBatchAsync_v2_ptsz", 799, WordPt(3)),
    // (op, flags, hStream): CUDA 13.2.
    opaque_copy("cuMemcpy3DWithAttributesAsync", 839, Word(2)),
    opaque_copy("cuMemcpy3DWithAttributesAsync_ptsz", 840, WordPt(2)),
    // (paramsArray, count, flags, errorIndex, hStream): decompression into device memory.
    opaque_copy("cuMemBatchDecompressAsync", 761, Word(4)),
    opaque_copy("cuMemBatchDecompressAsync_ptsz", 762, WordPt(4)),
    // (dstDevice, dstPitch, value, Width, Height[, hStream])
    write(
        "cuMemsetD2D8_v2",
        252,
        Kind::Memset,
        Pitched { elem: 1 },
        Legacy,
    ),
    write(
        "cuMemsetD2D8_v2_ptds",
        414,
        Kind::Memset,
        Pitched { elem: 1 },
        PerThread,
    ),
    write(
        "cuMemsetD2D16_v2",
        253,
        Kind::Memset,
        Pitched { elem: 2 },
        Legacy,
    ),
    write(
        "cuMemsetD2D16_v2_ptds",
        415,
        Kind::Memset,
        Pitched { elem: 2 },
        PerThread,
    ),
    write(
        "cuMemsetD2D32_v2",
        254,
        Kind::Memset,
        Pitched { elem: 4 },
        Legacy,
    ),
    write(
        "cuMemsetD2D32_v2_ptds",
        416,
        Kind::Memset,
        Pitched { elem: 4 },
        PerThread,
    ),
    write(
        "cuMemsetD2D8Async",
        222,
        Kind::Memset,
        Pitched { elem: 1 },
        Word(5),
    ),
    write(
        "cuMemsetD2D8Async_ptsz",
        431,
        Kind::Memset,
        Pitched { elem: 1 },
        WordPt(5),
    ),
    write(
        "cuMemsetD2D16Async",
        224,
        Kind::Memset,
        Pitched { elem: 2 },
        Word(5),
    ),
    write(
        "cuMemsetD2D16Async_ptsz",
        432,
        Kind::Memset,
        Pitched { elem: 2 },
        WordPt(5),
    ),
    write(
        "cuMemsetD2D32Async",
        226,
        Kind::Memset,
        Pitched { elem: 4 },
        Word(5),
    ),
    write(
        "cuMemsetD2D32Async_ptsz",
        433,
        Kind::Memset,
        Pitched { elem: 4 },
        WordPt(5),
    ),
    // (stream, addr, value, flags); `_v2` is what cuda.h names them since CUDA 11.7.
    write(
        "cuStreamWriteValue32",
        460,
        Kind::Memset,
        Value { ptr: 1, size: 4 },
        Word(0),
    ),
    write(
        "cuStreamWriteValue32_ptsz",
        461,
        Kind::Memset,
        Value { ptr: 1, size: 4 },
        WordPt(0),
    ),
    write(
        "cuStreamWriteValue64",
        475,
        Kind::Memset,
        Value { ptr: 1, size: 8 },
        Word(0),
    ),
    write(
        "cuStreamWriteValue64_ptsz",
        476,
        Kind::Memset,
        Value { ptr: 1, size: 8 },
        WordPt(0),
    ),
    write(
        "cuStreamWriteValue32_v2",
        663,
        Kind::Memset,
        Value { ptr: 1, size: 4 },
        Word(0),
    ),
    write(
        "cuStreamWriteValue32_v2_ptsz",
        664,
        Kind::Memset,
        Value { ptr: 1, size: 4 },
        WordPt(0),
    ),
    write(
        "cuStreamWriteValue64_v2",
        665,
        Kind::Memset,
        Value { ptr: 1, size: 8 },
        Word(0),
    ),
    write(
        "cuStreamWriteValue64_v2_ptsz",
        666,
        Kind::Memset,
        Value { ptr: 1, size: 8 },
        WordPt(0),
    ),
    // (stream, count, paramArray, flags)
    write("cuStreamBatchMemOp", 462, Kind::Memset, BatchMemOp, Word(0)),
    write(
        "cuStreamBatchMemOp_ptsz",
        463,
        Kind::Memset,
        BatchMemOp,
        WordPt(0),
    ),
    write(
        "cuStreamBatchMemOp_v2",
        667,
        Kind::Memset,
        BatchMemOp,
        Word(0),
    ),
    write(
        "cuStreamBatchMemOp_v2_ptsz",
        668,
        Kind::Memset,
        BatchMemOp,
        WordPt(0),
    ),
    // Legacy launches (`cuLaunch(f)`, `cuLaunchGrid(f, w, h)`, `cuLaunchGridAsync(f, w, h,
    // hStream)`, the two ints sharing word 1): their arguments were set by `cuParamSet*`, which possum does not see: opaque.
    opaque("cuLaunch", 115, Kind::Launch, Legacy),
    opaque("cuLaunchGrid", 116, Kind::Launch, Legacy),
    opaque("cuLaunchGridAsync", 117, Kind::Launch, Word(2)),
    // (launchParamsList, numDevices, flags): a kernel on each of several devices and streams.
    opaque(
        "cuLaunchCooperativeKernelMultiDevice",
        480,
        Kind::Launch,
        Legacy,
    ),
    memset("cuMemsetD8_v2", 249, 1, Legacy),
    memset("cuMemsetD8_v2_ptds", 411, 1, PerThread),
    memset("cuMemsetD16_v2", 250, 2, Legacy),
    memset("cuMemsetD16_v2_ptds", 412, 2, PerThread),
    memset("cuMemsetD32_v2", 251, 4, Legacy),
    memset("cuMemsetD32_v2_ptds", 413, 4, PerThread),
    memset("cuMemsetD8Async", 216, 1, Word(3)),
    memset("cuMemsetD8Async_ptsz", 428, 1, WordPt(3)),
    memset("cuMemsetD16Async", 218, 2, Word(3)),
    memset("cuMemsetD16Async_ptsz", 429, 2, WordPt(3)),
    memset("cuMemsetD32Async", 220, 4, Word(3)),
    memset("cuMemsetD32Async_ptsz", 430, 4, WordPt(3)),
    cb(
        "cuMemAlloc_v2",
        243,
        Kind::Alloc,
        Shape::Alloc { out: 0, bytes: 1 },
    ),
    cb("cuMemAllocPitch_v2", 244, Kind::Alloc, Shape::AllocPitch),
    cb("cuMemFree_v2", 245, Kind::Alloc, Shape::Free { ptr: 0 }),
    cb("cuGetProcAddress", 626, Kind::Entry, Shape::ProcAddress),
    cb("cuGetProcAddress_v2", 677, Kind::Entry, Shape::ProcAddress),
    cb(
        "cuMemAllocManaged",
        371,
        Kind::Alloc,
        Shape::Alloc { out: 0, bytes: 1 },
    ),
    cb(
        "cuMemAllocAsync",
        598,
        Kind::Alloc,
        Shape::Alloc { out: 0, bytes: 1 },
    ),
    cb(
        "cuMemAllocAsync_ptsz",
        599,
        Kind::Alloc,
        Shape::Alloc { out: 0, bytes: 1 },
    ),
    cb("cuMemFreeAsync", 600, Kind::Alloc, Shape::Free { ptr: 0 }),
    cb(
        "cuMemFreeAsync_ptsz",
        601,
        Kind::Alloc,
        Shape::Free { ptr: 0 },
    ),
    cb(
        "cuMemAllocFromPoolAsync",
        611,
        Kind::Alloc,
        Shape::Alloc { out: 0, bytes: 1 },
    ),
    cb(
        "cuMemAllocFromPoolAsync_ptsz",
        612,
        Kind::Alloc,
        Shape::Alloc { out: 0, bytes: 1 },
    ),
    cb("cuMemCreate", 549, Kind::Alloc, Shape::Count),
    cb("cuMemRelease", 550, Kind::Alloc, Shape::Release),
    cb("cuMemMap", 551, Kind::Alloc, Shape::Map),
    cb("cuMemUnmap", 552, Kind::Alloc, Shape::Unmap),
    cb(
        "cuMemExportToShareableHandle",
        554,
        Kind::Alloc,
        Shape::Count,
    ),
    cb(
        "cuMemImportFromShareableHandle",
        555,
        Kind::Alloc,
        Shape::Import,
    ),
    cb(
        "cuMemGetAllocationPropertiesFromHandle",
        557,
        Kind::Alloc,
        Shape::Count,
    ),
    cb(
        "cuMemRetainAllocationHandle",
        565,
        Kind::Alloc,
        Shape::Count,
    ),
    cb("cuStreamCreate", 124, Kind::Stream, Shape::Count),
    cb(
        "cuStreamCreateWithPriority",
        367,
        Kind::Stream,
        Shape::Count,
    ),
    cb(
        "cuStreamDestroy_v2",
        326,
        Kind::Stream,
        Shape::StreamDestroy,
    ),
    cb(
        "cuStreamBeginCapture",
        495,
        Kind::Capture,
        Shape::CaptureBegin,
    ),
    cb(
        "cuStreamBeginCapture_ptsz",
        496,
        Kind::Capture,
        Shape::CaptureBegin,
    ),
    cb(
        "cuStreamBeginCapture_v2",
        539,
        Kind::Capture,
        Shape::CaptureBegin,
    ),
    cb(
        "cuStreamBeginCapture_v2_ptsz",
        540,
        Kind::Capture,
        Shape::CaptureBegin,
    ),
    cb("cuStreamEndCapture", 497, Kind::Capture, Shape::CaptureEnd),
    cb(
        "cuStreamEndCapture_ptsz",
        498,
        Kind::Capture,
        Shape::CaptureEnd,
    ),
    // The legacy export CUDA 10's lookups get (version < 11000): same arguments as `_v2`.
    cb(
        "cuGraphInstantiate",
        513,
        Kind::Capture,
        Shape::GraphInstantiate,
    ),
    cb(
        "cuGraphInstantiate_v2",
        578,
        Kind::Capture,
        Shape::GraphInstantiate,
    ),
    cb(
        "cuGraphInstantiateWithFlags",
        643,
        Kind::Capture,
        Shape::GraphInstantiate,
    ),
    cb(
        "cuGraphInstantiateWithParams",
        656,
        Kind::Capture,
        Shape::GraphInstantiate,
    ),
    cb(
        "cuGraphInstantiateWithParams_ptsz",
        657,
        Kind::Capture,
        Shape::GraphInstantiate,
    ),
    cb(
        "cuGraphExecDestroy",
        516,
        Kind::Capture,
        Shape::GraphExecDestroy,
    ),
    cb(
        "cuGraphExecKernelNodeSetParams",
        538,
        Kind::Capture,
        Shape::GraphExecChanged,
    ),
    cb(
        "cuGraphExecKernelNodeSetParams_v2",
        692,
        Kind::Capture,
        Shape::GraphExecChanged,
    ),
    cb(
        "cuGraphExecUpdate",
        561,
        Kind::Capture,
        Shape::GraphExecChanged,
    ),
    cb(
        "cuGraphExecUpdate_v2",
        696,
        Kind::Capture,
        Shape::GraphExecChanged,
    ),
    cb(
        "cuGraphExecNodeSetParams",
        714,
        Kind::Capture,
        Shape::GraphExecChanged,
    ),
    // A changed memset, copy or memory-operation node: the graph's next launch is opaque (its
    // snapshot is forgotten) until possum knows its nodes again.
    cb(
        "cuGraphExecMemsetNodeSetParams",
        563,
        Kind::Capture,
        Shape::GraphExecChanged,
    ),
    cb(
        "cuGraphExecMemcpyNodeSetParams",
        562,
        Kind::Capture,
        Shape::GraphExecChanged,
    ),
    cb(
        "cuGraphExecBatchMemOpNodeSetParams",
        672,
        Kind::Capture,
        Shape::GraphExecChanged,
    ),
    cb(
        "cuGraphExecChildGraphNodeSetParams",
        586,
        Kind::Capture,
        Shape::GraphExecChanged,
    ),
];

/// [`CALLBACKS`]' shapes indexed by id ([`Shape::Count`] for ids not in the table): the callback
/// finds a call's shape with one array read.
pub static SHAPES: [Shape; ID_LIMIT] = {
    let mut t = [Shape::Count; ID_LIMIT];
    let mut i = 0;
    while i < CALLBACKS.len() {
        t[CALLBACKS[i].id as usize] = CALLBACKS[i].shape;
        i += 1;
    }
    t
};

/// The shape of callback `id`.
pub fn shape(id: u32) -> Shape {
    SHAPES.get(id as usize).copied().unwrap_or(Shape::Count)
}

// Every id indexes the counter array (checked at compile time).
const _: () = {
    let mut i = 0;
    while i < CALLBACKS.len() {
        assert!((CALLBACKS[i].id as usize) < ID_LIMIT);
        i += 1;
    }
};

/// The index of the `CUfunction` field in the params struct of callback `id`, if it is a launch.
pub fn function_field(id: u32) -> Option<usize> {
    match shape(id) {
        Shape::Launch { func, .. } => Some(func),
        _ => None,
    }
}

/// The entry of `id` in [`CALLBACKS`].
pub fn lookup(id: u32) -> Option<&'static Callback> {
    CALLBACKS.iter().find(|c| c.id == id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn ids_and_names_are_unique_and_in_range() {
        let ids: HashSet<u32> = CALLBACKS.iter().map(|c| c.id).collect();
        let names: HashSet<&str> = CALLBACKS.iter().map(|c| c.name).collect();
        assert_eq!(ids.len(), CALLBACKS.len());
        assert_eq!(names.len(), CALLBACKS.len());
        // CUPTI_DRIVER_TRACE_CBID_SIZE for CUDA 13.0 is 807; the `WithAttributes` copies are
        // CUDA 13.2's (its size: 846).
        assert!(CALLBACKS.iter().all(|c| c.id > 0 && c.id < 846));
    }

    #[test]
    fn known_ids() {
        let id = |n: &str| CALLBACKS.iter().find(|c| c.name == n).unwrap().id;
        assert_eq!(id("cuLaunchKernel"), 307);
        assert_eq!(id("cuLaunchKernel_ptsz"), 442);
        assert_eq!(id("cuLaunchKernelEx"), 652);
        assert_eq!(id("cuLaunchKernelEx_ptsz"), 653);
        assert_eq!(id("cuGraphLaunch"), 514);
        assert_eq!(id("cuMemcpyAsync"), 306);
        assert_eq!(id("cuMemAlloc_v2"), 243);
        assert_eq!(id("cuMemCreate"), 549);
        assert_eq!(id("cuStreamCreateWithPriority"), 367);
        assert_eq!(
            id("cuLaunchCooperativeKernelMultiDevice"),
            MULTI_DEVICE_LAUNCH
        );
    }

    #[test]
    fn function_field_matches_table() {
        for c in CALLBACKS {
            assert_eq!(function_field(c.id), c.function_field(), "{}", c.name);
            // Launches whose arguments possum cannot read (legacy, multi-device) are opaque.
            assert_eq!(
                c.function_field().is_some(),
                c.kind == Kind::Launch && !matches!(c.shape, Shape::OpaqueOp { .. }),
                "{}",
                c.name
            );
            // The variants with a stream suffix share their base function's kind.
            if let Some(base) = c
                .name
                .strip_suffix("_ptsz")
                .or(c.name.strip_suffix("_ptds"))
            {
                let b = CALLBACKS.iter().find(|x| x.name == base).unwrap();
                assert_eq!(b.kind, c.kind, "{}", c.name);
                assert_eq!(b.function_field(), c.function_field(), "{}", c.name);
            }
        }
        assert_eq!(function_field(514), None);
        assert_eq!(lookup(652).unwrap().name, "cuLaunchKernelEx");
        assert!(lookup(1).is_none());
    }
}
