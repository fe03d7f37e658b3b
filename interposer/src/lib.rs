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

mod ab;
mod alloc;
pub mod cbid;
mod collective;
mod config;
mod control;
mod cudart;
mod cupti;
mod dag;
mod decode;
mod drvalloc;
mod elfsym;
pub mod entry;
mod gate;
mod hip;
mod hook_state;
mod hooks;
mod imports;
mod load;
mod log;
mod mode;
mod nccl;
mod park;
mod park_sys;
mod pools;
mod ranges;
mod runtime;
mod session;
pub mod stats;
mod sys;
mod thread_state;
mod validate;
mod vmm;
pub mod writers;

pub use config::Hooks;
pub use load::InitializeInjection;

use std::sync::Once;

use log::log;
use stats::Setup;

/// Where CUPTI is looked for when `POSSUM_CUPTI` is not set, in order.
pub const DEFAULT_CUPTI: &[&str] = &[
    "libcupti.so.13",
    "libcupti.so",
    // PyTorch's CUDA 13 wheels (the GPU machine's venv); jobs find it through torch's RPATH, which
    // does not apply to this library's dlopen.
    "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcupti.so.13",
    "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so",
];

static INIT: Once = Once::new();

/// Sets the interposer up: loads CUPTI, subscribes, enables the callbacks, registers the
/// statistics writer. Runs once per process, whichever entry point calls it first; never panics
/// out (the entry points catch), never prints unless `POSSUM_VERBOSE=1`.
pub fn init() {
    INIT.call_once(|| {
        // The control socket starts with possum's state (the job's first use of CUDA), which
        // sits below the socket's handlers: it calls up through this.
        runtime::on_created(start_control);
        let setup = set_up();
        cupti::set_setup(setup);
        if runtime::state_if_created().is_some() {
            start_control();
        }
    });
}

/// Starts the control socket, its `Status` answered with [`stats_json`].
fn start_control() {
    control::start(stats_json);
}

fn set_up() -> Setup {
    // First: the entry points' wrappers must know their mode before anything below calls the
    // driver (CUPTI's loading does), or they would run this set-up again.
    let cfg = config::get();
    let (mut hooks, mut bad) = (cfg.user.hooks, cfg.user.hooks_error.clone());
    if hooks == Hooks::Entry && !entry::interposing() {
        // Not in the global scope (CUDA_INJECTION64_PATH alone): the job never gets the
        // wrappers, so nothing could be held at the op gate. A checkpoint parks threads instead.
        hooks = Hooks::Off;
        bad = Some(
            "not preloaded (LD_PRELOAD): the driver's entry points cannot be wrapped; hooks off"
                .into(),
        );
    }
    mode::set_mode(match hooks {
        Hooks::Entry => mode::Mode::Hooks,
        Hooks::Cupti => mode::Mode::Count,
        Hooks::Off => mode::Mode::Off,
    });
    log::set_verbose(cfg.user.verbose);
    if let Some(e) = bad {
        log(&e);
    }
    if !load::register_at_exit() {
        log("atexit failed; POSSUM_STATS and POSSUM_TRACE will not be written");
    }

    match hooks {
        Hooks::Entry => {
            log("hooks: the driver's entry points (CUPTI not loaded)");
            ab::start_if_asked();
            return Setup {
                hooks,
                error: Some("CUPTI not loaded (POSSUM_HOOKS=entry)".into()),
                ..Setup::default()
            };
        }
        Hooks::Off => {
            log("hooks off: launches will not be seen; a checkpoint parks the job's threads");
            return Setup {
                hooks,
                error: Some("CUPTI not loaded (POSSUM_HOOKS=off)".into()),
                ..Setup::default()
            };
        }
        Hooks::Cupti => {}
    }
    let candidates: Vec<String> = match &cfg.user.cupti {
        Some(p) => vec![p.clone()],
        None => DEFAULT_CUPTI.iter().map(|s| s.to_string()).collect(),
    };
    let (cupti, path) = match sys::Cupti::load(&candidates) {
        Ok(c) => c,
        Err(why) => {
            log(&format!(
                "CUPTI not found ({why}); launches will not be seen"
            ));
            return Setup {
                hooks,
                error: Some(format!("CUPTI not found: {why}")),
                ..Setup::default()
            };
        }
    };
    let (sub, failed) = cupti.attach(cupti::enabled_callbacks());
    if let Err(why) = sub {
        log(&format!(
            "CUPTI at {path} loaded but {why}; launches will not be seen"
        ));
        return Setup {
            hooks,
            cupti_path: Some(path),
            error: Some(why),
            ..Setup::default()
        };
    }
    let enabled = cupti::enabled_callbacks().count() - failed.len();
    let error = (!failed.is_empty()).then(|| format!("not enabled: {}", failed.join(", ")));
    log(&format!(
        "CUPTI at {path}: {enabled} of {} driver callbacks enabled{}",
        cbid::CALLBACKS.len(),
        error
            .as_deref()
            .map(|e| format!("; {e}"))
            .unwrap_or_default()
    ));
    ab::start_if_asked();
    Setup {
        hooks,
        cupti: true,
        cupti_path: Some(path),
        error,
        enabled,
    }
}

/// The statistics so far, as one JSON object (keys in the crate documentation). Before [`init`]
/// has run, `"cupti"` is false and `"cupti_error"` says so.
pub fn stats_json() -> serde_json::Value {
    let not_set_up = Setup {
        error: Some("not initialised".into()),
        ..Setup::default()
    };
    let mut v = stats::to_json(std::process::id(), cupti::setup().unwrap_or(&not_set_up));
    v["entry"] = entry::stats_json();
    if let Some(st) = runtime::state_if_created() {
        v["possum"] = st.stats_json();
        v["possum"]["session"] = session::status_json();
        v["possum"]["vmm"] = vmm::stats_json();
        v["possum"]["imports"] = imports::stats_json();
        v["possum"]["pools"] = pools::stats_json();
    }
    v
}

/// Total calls seen by every enabled callback.
fn calls_seen() -> u64 {
    cbid::Kind::ALL.iter().map(|&k| stats::total(k)).sum()
}

/// The `atexit` handler's body (`load.rs`): removes the control socket, writes `POSSUM_TRACE` and
/// `POSSUM_STATS` (see the crate documentation).
fn write_stats_at_exit() {
    control::stop();
    if let Some(st) = runtime::state_if_created() {
        if let Some(path) = config::get().user.trace.clone() {
            let mut trace = st.trace_json();
            let dot = trace
                .as_object_mut()
                .and_then(|o| o.remove("dot"))
                .and_then(|d| d.as_str().map(str::to_owned))
                .unwrap_or_default();
            let mut dot_path = path.clone().into_os_string();
            dot_path.push(".dot");
            write_atomically(&path, trace.to_string().as_bytes());
            write_atomically(std::path::Path::new(&dot_path), dot.as_bytes());
        }
    }
    let Some(path) = &config::get().user.stats else {
        return;
    };
    let pid = std::process::id();
    let path = path.replace("%p", &pid.to_string());
    if calls_seen() == 0 && std::path::Path::new(&path).exists() {
        return;
    }
    let mut json = stats_json().to_string();
    json.push('\n');
    write_atomically(std::path::Path::new(&path), json.as_bytes());
}

/// Writes beside the target and renames, so a reader never sees half a file.
fn write_atomically(path: &std::path::Path, bytes: &[u8]) {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}", std::process::id()));
    let ok = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = ok {
        let _ = std::fs::remove_file(&tmp);
        log(&format!("cannot write {}: {e}", path.display()));
    }
}
