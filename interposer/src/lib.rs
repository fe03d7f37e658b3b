//! libpossum.so, the only possum code that runs inside the job.
//!
//! It sees the job's kernel launches, graph launches, copies, memsets, allocations and stream
//! creations by wrapping the CUDA driver's entry points (`entry`: the functions in
//! [`entry::ENTRIES`], one per callback of [`cbid::CALLBACKS`]), and counts them and the distinct
//! kernels launched; serves the job's `cudaMalloc`/`cudaFree` (`cudart`, `alloc`) and the driver's
//! `cuMemAlloc_v2`/`cuMemAllocPitch_v2`/`cuMemFree_v2` (`drvalloc`) from the engine, and when
//! (unless turned off) the job's own virtual-memory mappings (`vmm`, `POSSUM_SERVE_VMM`) and
//! stream-ordered allocations (`pools`, `POSSUM_SERVE_POOLS`); resolves each
//! operation's buffers and calls the engine's hook before it (`hooks`); and answers the control
//! socket, checkpoint sessions included (`control`, `session`). ARCHITECTURE.md ("interposer")
//! has the design.
//!
//! The entry points are wrapped rather than hooked through CUPTI because NVIDIA's driver 580
//! refuses to checkpoint any process in which CUPTI has subscribed (docs/decisions.md 17 and 21).
//! A job reaches the driver by name (a program linked with `-lcuda`), by `dlsym` on a handle of
//! libcuda (libcudart, cuBLAS, Triton) and through `cuGetProcAddress` (libcudart's and PyTorch's
//! driver tables); this library answers all three with its wrappers. Each wrapper lays its
//! arguments out as the `cu<name>_params` struct CUPTI would have passed and runs the same hooks
//! on entry and exit around the driver's function. CUPTI's callbacks can still feed the hooks
//! instead (`POSSUM_HOOKS=cupti`, a diagnostic): only the callbacks in [`cbid::CALLBACKS`] are
//! enabled then.
//!
//! # Loading it
//!
//! - `LD_PRELOAD=/path/libpossum.so` (what `possum run` does): an ELF constructor runs the set-up
//!   ([`init`]: it reads the environment, checks that the library interposes `dlsym`, registers
//!   the exit handler and, with `POSSUM_HOOKS=cupti` only, loads CUPTI). The library's definitions come first in the global
//!   scope: its exported driver names (the wrappers), `cudaMalloc`/`cudaFree`, and `dlsym`, a
//!   naked x86-64 function that passes `RTLD_DEFAULT` and `RTLD_NEXT` to glibc's with the
//!   caller's own return address and answers a lookup on an explicit handle with the wrapper of
//!   a wrapped driver function (possum's own lookups excepted: they get the driver's).
//! - `CUDA_INJECTION64_PATH=/path/libpossum.so`: libcuda loads it during `cuInit` and calls
//!   `InitializeInjection`, which runs the same set-up. Loaded only this way the library is not in
//!   the global scope, so its wrappers are never handed out: the set-up sees it
//!   ([`entry::interposing`]) and turns the entry mode into `off` (a checkpoint parks the job's
//!   threads). Use it with `POSSUM_HOOKS=cupti`, or together with `LD_PRELOAD` (set-up runs
//!   once).
//!
//! # Environment
//!
//! - `POSSUM_HOOKS` ([`Hooks`]): `entry` (default, also when unset) runs the hooks in the
//!   wrappers (`off` instead where the library does not interpose: not preloaded, or not
//!   x86-64); `cupti` loads CUPTI and lets its callbacks run them, the wrappers only counting
//!   (NVIDIA's driver 580 then refuses to checkpoint the process); `off` (or `0`) makes the
//!   wrappers call the driver and nothing else (allocations are still served; a checkpoint parks
//!   the job's threads). Lookups are answered with wrappers in every mode.
//! - `POSSUM_CUPTI`: with `POSSUM_HOOKS=cupti`, the CUPTI library to load (a path or a `dlopen`
//!   name). When set, only it is tried. Otherwise [`DEFAULT_CUPTI`] is tried in order.
//! - `POSSUM_STATS`: a file to write the statistics to (JSON, see [`stats_json`]) when the process
//!   calls `exit()`. `%p` in it becomes the process id. Children inherit the variable; so that a
//!   child that never used CUDA (a shell, a compiler) does not overwrite its parent's file, a
//!   process that saw no call at all leaves an existing file alone.
//! - `POSSUM_VERBOSE=1`: one line on stderr saying what set-up did (which hooks; CUPTI loaded or
//!   not found, callbacks enabled), and a few more (control socket, engine, kernels made opaque).
//!   Without it the library prints nothing, ever.
//!
//! The others (`POSSUM_MANAGE`, `POSSUM_VALIDATE`, `POSSUM_TRACE`, `POSSUM_LIBCUDA`,
//! `POSSUM_DETACH`, ...) are listed in the crate's README.
//!
//! With `POSSUM_HOOKS=cupti`, if CUPTI cannot be loaded or subscribed to, nothing feeds the hooks
//! (the wrappers only count): the job runs, a checkpoint parks it as with `off`, and the
//! statistics say `"cupti":false` with the reason in `"cupti_error"`.
//!
//! # Statistics
//!
//! `{"pid", "hooks", "cupti", "cupti_path", "cupti_error", "enabled_callbacks",
//! "launches": {name: n}, "graphs": {..}, "copies": {..}, "memsets": {..}, "allocs": {..},
//! "streams": {..}, "captures": {..}, "entry_points": {..}, "graph_launches",
//! "distinct_functions", "total_launches", "entry": {..}, "possum": {..}}`, where `hooks` is the
//! mode (`entry`, `cupti`, `off`), each object of calls has one entry per function of that kind
//! in [`cbid::CALLBACKS`], `total_launches` counts kernel launches (not graph launches) and
//! `distinct_functions` counts distinct `CUfunction` handles passed to kernel launches (library
//! kernels pass `CUkernel` handles there; each counts once too). Calls are counted on entry by
//! whoever feeds the hooks (the wrappers, or CUPTI's callbacks), whether or not they then
//! succeed; with `off`, none; possum's own calls are not counted. `entry` is what the wrappers
//! saw: `mode`, `wrapped` (how many functions), `swapped_dlsym` and `swapped_proc_address`
//! (lookups answered with a wrapper), `passed_proc_address` (`cuGetProcAddress` answers that are
//! no wrapped function, handed out unchanged), `unmatched` (`[{"symbol", "version", "flags"}]`:
//! such answers to a lookup of a wrapped family's name) and `seen_beside_cupti` (with
//! `POSSUM_HOOKS=cupti`, calls per function the wrappers counted, to compare with CUPTI's).
//! `possum` (once possum's state exists: the job's first driver call through a wrapper, or its
//! first `cudaMalloc`) has the engines, allocations, kernels, counters and the checkpoint session.
#![warn(missing_docs)]
#![deny(unsafe_code)]

mod base;
mod cuda;
mod hip;
mod memory;
mod ops;
mod process;
mod session;

pub use base::config::Hooks;
pub use cuda::{cbid, entry, writers};
pub use process::load::InitializeInjection;
pub use process::setup::DEFAULT_CUPTI;
pub use process::stats;

/// Sets the interposer up: loads CUPTI, subscribes, enables the callbacks, registers the
/// statistics writer. Runs once per process, whichever entry point calls it first; never panics
/// out (the entry points catch), never prints unless `POSSUM_VERBOSE=1`.
pub fn init() {
    process::setup::init(cuda::entry::SET_UP);
}

/// The statistics so far, as one JSON object (keys in the crate documentation). Before [`init`]
/// has run, `"cupti"` is false and `"cupti_error"` says so.
pub fn stats_json() -> serde_json::Value {
    process::setup::hand(cuda::entry::SET_UP);
    process::setup::stats_json()
}
