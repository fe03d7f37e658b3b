//! The set-up, the statistics and what is written at exit: what the ELF constructor and
//! `InitializeInjection` (`load.rs`) and the wrappers' first call (`entry.rs`) run, once.
//!
//! Below the entry points that run it: what it needs of them (whether the library interposes
//! `dlsym`, what the wrappers saw) they hand it ([`EntryPoints`]); the `atexit` handler
//! (`exit.rs`) is handed [`write_stats_at_exit`] and the control socket the statistics. The crate
//! documentation (`lib.rs`) describes the environment and the statistics.

use std::sync::{Once, OnceLock};

use serde_json::Value;

use crate::base::config::{self, Hooks};
use crate::base::log::{self, log};
use crate::process::stats::{self, Setup};
use crate::{
    base::mode, cuda::cbid, cuda::cupti, cuda::cupti_sys, memory::imports, memory::pools,
    memory::vmm, process::ab, process::exit, process::runtime, session::common, session::control,
};

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

/// What the set-up and the statistics need of the driver's entry points (`entry.rs`), which sit
/// above them: handed by their callers (`entry::SET_UP`).
#[derive(Debug, Clone, Copy)]
pub struct EntryPoints {
    /// Whether this library interposes the process's `dlsym` (`entry::interposing`).
    pub interposing: fn() -> bool,
    /// What the wrappers saw, for the statistics (`entry::stats_json`).
    pub stats_json: fn() -> Value,
}

/// The entry points' functions, once handed ([`hand`]).
static ENTRY_POINTS: OnceLock<EntryPoints> = OnceLock::new();

/// Takes what the statistics need of the entry points (the first handed stays).
pub fn hand(entry: EntryPoints) {
    let _ = ENTRY_POINTS.set(entry);
}

/// Sets the interposer up: loads CUPTI, subscribes, enables the callbacks, registers the
/// statistics writer. Runs once per process, whichever entry point calls it first; never panics
/// out (the entry points catch), never prints unless `POSSUM_VERBOSE=1`.
pub fn init(entry: EntryPoints) {
    hand(entry);
    INIT.call_once(|| {
        // The control socket starts with possum's state (the job's first use of CUDA), which
        // sits below the socket's handlers: it calls up through this.
        runtime::on_created(start_control);
        let setup = set_up(&entry);
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

/// The set-up's steps: the wrappers' mode, the log, the exit handler, then CUPTI if asked for.
fn set_up(entry: &EntryPoints) -> Setup {
    // First: the entry points' wrappers must know their mode before anything below calls the
    // driver (CUPTI's loading does), or they would run this set-up again.
    let cfg = config::get();
    let (mut hooks, mut bad) = (cfg.user.hooks, cfg.user.hooks_error.clone());
    if hooks == Hooks::Entry && !(entry.interposing)() {
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
    if !exit::register_at_exit(write_stats_at_exit) {
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
    let (cupti, path) = match cupti_sys::Cupti::load(&candidates) {
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
            error: Some(why.to_string()),
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
/// has run, `"cupti"` is false and `"cupti_error"` says so; `"entry"` is there once the entry
/// points' functions were handed ([`hand`]).
pub fn stats_json() -> Value {
    let not_set_up = Setup {
        error: Some("not initialised".into()),
        ..Setup::default()
    };
    let mut v = stats::to_json(std::process::id(), cupti::setup().unwrap_or(&not_set_up));
    if let Some(entry) = ENTRY_POINTS.get() {
        v["entry"] = (entry.stats_json)();
    }
    if let Some(st) = runtime::state_if_created() {
        v["possum"] = st.stats_json();
        v["possum"]["session"] = common::status_json();
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

/// The `atexit` handler's body (`exit.rs`): removes the control socket, writes `POSSUM_TRACE` and
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
