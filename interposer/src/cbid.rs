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
    /// Stream creation.
    Stream,
}

impl Kind {
    /// Every kind, in the order the statistics list them.
    pub const ALL: [Kind; 6] = [
        Kind::Launch,
        Kind::Graph,
        Kind::Copy,
        Kind::Memset,
        Kind::Alloc,
        Kind::Stream,
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
        }
    }
}

/// One enabled callback.
#[derive(Debug, Clone, Copy)]
pub struct Callback {
    /// The driver function's name, as in `CUPTI_DRIVER_TRACE_CBID_<name>`.
    pub name: &'static str,
    /// Its `CUpti_driver_api_trace_cbid` value.
    pub id: u32,
    /// What it is.
    pub kind: Kind,
    /// For launches: the index of the `CUfunction f` field in the call's `cu<name>_params` struct
    /// (each field is pointer-sized there: `f` first for `cuLaunchKernel` and
    /// `cuLaunchCooperativeKernel`, after `const CUlaunchConfig *config` for `cuLaunchKernelEx`).
    pub function_field: Option<usize>,
}

const fn cb(name: &'static str, id: u32, kind: Kind) -> Callback {
    Callback {
        name,
        id,
        kind,
        function_field: None,
    }
}

const fn launch(name: &'static str, id: u32, function_field: usize) -> Callback {
    Callback {
        name,
        id,
        kind: Kind::Launch,
        function_field: Some(function_field),
    }
}

/// Upper bound (exclusive) on the ids in [`CALLBACKS`]; sizes the counter array.
pub const ID_LIMIT: usize = 1024;

/// Every callback possum enables. `_ptsz` / `_ptds` are the per-thread-default-stream variants.
pub const CALLBACKS: &[Callback] = &[
    launch("cuLaunchKernel", 307, 0),
    launch("cuLaunchKernel_ptsz", 442, 0),
    launch("cuLaunchKernelEx", 652, 1),
    launch("cuLaunchKernelEx_ptsz", 653, 1),
    launch("cuLaunchCooperativeKernel", 477, 0),
    launch("cuLaunchCooperativeKernel_ptsz", 478, 0),
    cb("cuGraphLaunch", 514, Kind::Graph),
    cb("cuGraphLaunch_ptsz", 515, Kind::Graph),
    cb("cuMemcpy", 305, Kind::Copy),
    cb("cuMemcpy_ptds", 408, Kind::Copy),
    cb("cuMemcpyAsync", 306, Kind::Copy),
    cb("cuMemcpyAsync_ptsz", 418, Kind::Copy),
    cb("cuMemcpyHtoD_v2", 276, Kind::Copy),
    cb("cuMemcpyHtoD_v2_ptds", 397, Kind::Copy),
    cb("cuMemcpyHtoDAsync_v2", 277, Kind::Copy),
    cb("cuMemcpyHtoDAsync_v2_ptsz", 421, Kind::Copy),
    cb("cuMemcpyDtoH_v2", 278, Kind::Copy),
    cb("cuMemcpyDtoH_v2_ptds", 398, Kind::Copy),
    cb("cuMemcpyDtoHAsync_v2", 279, Kind::Copy),
    cb("cuMemcpyDtoHAsync_v2_ptsz", 422, Kind::Copy),
    cb("cuMemcpyDtoD_v2", 280, Kind::Copy),
    cb("cuMemcpyDtoD_v2_ptds", 399, Kind::Copy),
    cb("cuMemcpyDtoDAsync_v2", 281, Kind::Copy),
    cb("cuMemcpyDtoDAsync_v2_ptsz", 423, Kind::Copy),
    cb("cuMemcpyPeerAsync", 319, Kind::Copy),
    cb("cuMemcpyPeerAsync_ptsz", 426, Kind::Copy),
    cb("cuMemcpyBatchAsync", 776, Kind::Copy),
    cb("cuMemcpyBatchAsync_ptsz", 777, Kind::Copy),
    cb("cuMemcpyBatchAsync_v2", 796, Kind::Copy),
    cb("cuMemcpyBatchAsync_v2_ptsz", 797, Kind::Copy),
    cb("cuMemsetD8_v2", 249, Kind::Memset),
    cb("cuMemsetD8_v2_ptds", 411, Kind::Memset),
    cb("cuMemsetD32_v2", 251, Kind::Memset),
    cb("cuMemsetD32_v2_ptds", 413, Kind::Memset),
    cb("cuMemsetD8Async", 216, Kind::Memset),
    cb("cuMemsetD8Async_ptsz", 428, Kind::Memset),
    cb("cuMemsetD16Async", 218, Kind::Memset),
    cb("cuMemsetD16Async_ptsz", 429, Kind::Memset),
    cb("cuMemsetD32Async", 220, Kind::Memset),
    cb("cuMemsetD32Async_ptsz", 430, Kind::Memset),
    cb("cuMemAlloc_v2", 243, Kind::Alloc),
    cb("cuMemFree_v2", 245, Kind::Alloc),
    cb("cuMemAllocManaged", 371, Kind::Alloc),
    cb("cuMemAllocAsync", 598, Kind::Alloc),
    cb("cuMemAllocAsync_ptsz", 599, Kind::Alloc),
    cb("cuMemFreeAsync", 600, Kind::Alloc),
    cb("cuMemFreeAsync_ptsz", 601, Kind::Alloc),
    cb("cuMemAllocFromPoolAsync", 611, Kind::Alloc),
    cb("cuMemAllocFromPoolAsync_ptsz", 612, Kind::Alloc),
    cb("cuMemCreate", 549, Kind::Alloc),
    cb("cuMemRelease", 550, Kind::Alloc),
    cb("cuMemMap", 551, Kind::Alloc),
    cb("cuMemUnmap", 552, Kind::Alloc),
    cb("cuStreamCreate", 124, Kind::Stream),
    cb("cuStreamCreateWithPriority", 367, Kind::Stream),
];

// Every id indexes the counter array (checked at compile time).
const _: () = {
    let mut i = 0;
    while i < CALLBACKS.len() {
        assert!((CALLBACKS[i].id as usize) < ID_LIMIT);
        i += 1;
    }
};

/// The index of the `CUfunction` field in the params struct of callback `id`, if it is a launch.
///
/// Called on every callback, so it is a `match` the compiler turns into a jump table, not a search.
pub fn function_field(id: u32) -> Option<usize> {
    match id {
        307 | 442 | 477 | 478 => Some(0),
        652 | 653 => Some(1),
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
        // CUPTI_DRIVER_TRACE_CBID_SIZE for CUDA 13.0 is 807.
        assert!(CALLBACKS.iter().all(|c| c.id > 0 && c.id < 807));
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
    }

    #[test]
    fn function_field_matches_table() {
        for c in CALLBACKS {
            assert_eq!(function_field(c.id), c.function_field, "{}", c.name);
            assert_eq!(
                c.function_field.is_some(),
                c.kind == Kind::Launch,
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
                assert_eq!(b.function_field, c.function_field, "{}", c.name);
            }
        }
        assert_eq!(function_field(514), None);
        assert_eq!(lookup(652).unwrap().name, "cuLaunchKernelEx");
        assert!(lookup(1).is_none());
    }
}
