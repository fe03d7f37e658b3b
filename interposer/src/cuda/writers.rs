//! Which driver functions may write device memory, by name, and those of them possum leaves
//! unwrapped with the reason. `tests/write_functions.rs` checks every CUDA 13.0 driver function
//! against them (each writing one wrapped or listed here); at run time a driver function that
//! writes and is neither reaches the job unwrapped only through a `cuGetProcAddress` answer
//! possum cannot match to a wrapper ([`needs_wrapper`]), and possum then no longer trusts its
//! hooks to see every write (see `session/release.rs`).

/// Name prefixes of the functions that may write device memory (or change what an operation
/// writes); a name also counts when it is a graph's `*SetParams`.
pub const WRITING: &[&str] = &[
    "cuMemcpy",
    "cuMemset",
    "cuLaunch",
    "cuStreamWriteValue",
    "cuStreamWaitValue",
    "cuStreamBatchMemOp",
    "cuGraphLaunch",
    "cuGraphUpload",
    "cuGraphExecUpdate",
    "cuGraphicsMap",
    "cuGraphicsUnmap",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemFree",
    "cuMemAlloc",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemPrefetch",
    "cuMemDiscard",
    "cuMemAdvise",
    "cuMemBatchDecompress",
    "cuMemHostRegister",
    "cuMemImportFromShareableHandle",
    "cuMemPoolImportPointer",
    "cuIpcOpenMemHandle",
    "cuImportExternalMemory",
    "cuExternalMemory",
    "cuSignalExternalSemaphores",
    "cuWaitExternalSemaphores",
    "cuDevicePrimaryCtxReset",
    "cuCtxResetPersistingL2Cache",
];

const ARRAY: &str =
    "a CUDA array is not linear device memory: possum neither serves nor images arrays";
const GRAPH: &str = "changes a graph, not an instantiated one: what it writes is resolved when the graph is instantiated (cuGraphInstantiate*, wrapped) and launched (cuGraphLaunch, wrapped)";
const MANAGED: &str = "acts on managed (unified) memory only, which possum does not serve or image";

/// The writing-looking functions possum does not wrap, and why.
pub const NOT_WRAPPED: &[(&str, &str)] = &[
    ("cuMemcpyAtoH_v2", "writes host memory, from a CUDA array"),
    ("cuMemcpyAtoHAsync_v2", "writes host memory, from a CUDA array"),
    ("cuMemcpyDtoA_v2", ARRAY),
    ("cuMemcpyHtoA_v2", ARRAY),
    ("cuMemcpyHtoAAsync_v2", ARRAY),
    ("cuMemcpyAtoA_v2", ARRAY),
    ("cuLaunchHostFunc", "runs a host function in stream order: the driver writes no device memory (what the function does through the driver is seen there)"),
    ("cuStreamWaitValue32_v2", "reads a value (waits for it), writes nothing"),
    ("cuStreamWaitValue64_v2", "reads a value (waits for it), writes nothing"),
    ("cuGraphUpload", "uploads an instantiated graph: its work runs at cuGraphLaunch (wrapped)"),
    ("cuMemPrefetchAsync_v2", "migrates managed memory: contents unchanged"),
    ("cuMemPrefetchBatchAsync", "migrates managed memory: contents unchanged"),
    ("cuMemAdvise_v2", "a hint on managed memory: contents unchanged"),
    ("cuMemDiscardBatchAsync", MANAGED),
    ("cuMemDiscardAndPrefetchBatchAsync", MANAGED),
    ("cuMemAllocHost_v2", "host memory"),
    ("cuMemFreeHost", "host memory"),
    ("cuMemHostRegister_v2", "pins host memory"),
    ("cuGraphicsMapResources", "maps a graphics API's resources: memory possum does not serve"),
    ("cuGraphicsUnmapResources", "unmaps a graphics API's resources: memory possum does not serve"),
    ("cuImportExternalMemory", "imports another API's memory: not possum's, not in its image"),
    ("cuExternalMemoryGetMappedBuffer", "maps imported external memory: not possum's, not in its image"),
    ("cuExternalMemoryGetMappedMipmappedArray", ARRAY),
    ("cuSignalExternalSemaphoresAsync", "signals semaphores: no device memory"),
    ("cuWaitExternalSemaphoresAsync", "waits on semaphores: no device memory"),
    ("cuIpcOpenMemHandle_v2", "maps another process's allocation: not this job's, not in its image"),
    ("cuMemPoolImportPointer", "another process's pool allocation: not this job's, not in its image"),
    ("cuMemMapArrayAsync", ARRAY),
    ("cuDevicePrimaryCtxReset_v2", "ends the device's context and every allocation in it: nothing is written"),
    ("cuCtxResetPersistingL2Cache", "resets cache state, not memory contents"),
    ("cuGraphMemcpyNodeSetParams", GRAPH),
    ("cuGraphMemsetNodeSetParams", GRAPH),
    ("cuGraphKernelNodeSetParams_v2", GRAPH),
    ("cuGraphBatchMemOpNodeSetParams", GRAPH),
    ("cuGraphHostNodeSetParams", GRAPH),
    ("cuGraphNodeSetParams", GRAPH),
    ("cuGraphExternalSemaphoresSignalNodeSetParams", GRAPH),
    ("cuGraphExternalSemaphoresWaitNodeSetParams", GRAPH),
    ("cuGraphExecHostNodeSetParams", "an instantiated graph's host node: no device write"),
    ("cuGraphExecExternalSemaphoresSignalNodeSetParams", "an instantiated graph's semaphore node: no device memory"),
    ("cuGraphExecExternalSemaphoresWaitNodeSetParams", "an instantiated graph's semaphore node: no device memory"),
];

/// Whether the driver function `name` may write device memory (or change what an operation
/// writes), by its name.
pub fn writes(name: &str) -> bool {
    WRITING.iter().any(|p| name.starts_with(p))
        || (name.starts_with("cuGraph") && name.ends_with("SetParams"))
        || (name.starts_with("cuGraph") && name.contains("SetParams_"))
}

/// Whether a driver function named `name` must reach the job only through one of possum's
/// wrappers: it may write device memory ([`writes`]) and is not one [`NOT_WRAPPED`] says needs
/// none. `name` as exported or as `cuGetProcAddress` takes it (without its `_v2`, `_v3`, ... and
/// per-thread `_ptsz` / `_ptds` suffixes).
pub fn needs_wrapper(name: &str) -> bool {
    let base = name.trim_end_matches("_ptsz").trim_end_matches("_ptds");
    writes(base)
        && !NOT_WRAPPED.iter().any(|(n, _)| {
            *n == base
                || n.strip_prefix(base)
                    .is_some_and(|rest| rest.starts_with("_v"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writers_need_a_wrapper_unless_listed() {
        for n in [
            "cuMemsetD32",
            "cuMemsetD32_v2",
            "cuMemcpy3DPeerAsync",
            "cuLaunchKernel",
            "cuLaunchKernel_ptsz",
            "cuGraphLaunch",
            "cuMemcpyFutureThing",
        ] {
            assert!(needs_wrapper(n), "{n}");
        }
        for n in [
            "cuCtxSynchronize",
            "cuDeviceGetName",
            "cuMemcpyAtoH",
            "cuMemcpyAtoH_v2",
            "cuMemcpyAtoHAsync",
            "cuLaunchHostFunc",
            "cuLaunchHostFunc_ptsz",
            "cuGraphMemcpyNodeSetParams",
        ] {
            assert!(!needs_wrapper(n), "{n}");
        }
    }
}
