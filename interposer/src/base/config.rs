//! The interposer's settings: every `POSSUM_*` variable it reads, parsed once into one typed
//! [`Config`].
//!
//! Owns [`Config`] (grouped by kind: [`User`] settings, [`Tuning`], [`Diagnostics`]), the enums of
//! the variables with named values ([`Hooks`], [`ResolveMode`], [`Detach`]) and the process's one
//! copy ([`get`]), built from the environment the first time anything asks (the library's set-up,
//! at load) and never read again: a restored process (CRIU) has the environment it was dumped
//! with, so the variables read later (the park, restore and save settings) would give the same
//! answer. Nothing else in the crate reads the environment.
//!
//! A value that cannot be parsed leaves the default; for the tuning numbers and modes
//! (`POSSUM_VALIDATE`, `POSSUM_RESOLVE`, the sizes and thread counts) also a line in
//! [`Config::warnings`] (the statistics' `possum.config.warnings`), for `POSSUM_HOOKS` in
//! [`User::hooks_error`] (said on stderr by the set-up).

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use possum_analyzer::dag::DEFAULT_WINDOW;
use possum_analyzer::kernel::ValidationConfig;

/// How possum sees the job's GPU operations (`POSSUM_HOOKS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Hooks {
    /// The driver's entry points, wrapped (`entry`, the default): what a full checkpoint needs.
    #[default]
    Entry,
    /// CUPTI's callbacks (`cupti`, diagnostics): NVIDIA's driver 580 then refuses to checkpoint
    /// the process; the entry points only count what they see, as a cross-check.
    Cupti,
    /// Nothing hooked (`off`): allocations are still served; a checkpoint holds the job by
    /// parking its threads.
    Off,
}

impl Hooks {
    /// From `POSSUM_HOOKS`'s value (`entry`, `cupti`, `off`/`0`; `None`, unset or not UTF-8:
    /// `entry`).
    fn parse(v: Option<&str>) -> Result<Hooks, SettingError> {
        match v {
            None | Some("") | Some("entry") => Ok(Hooks::Entry),
            Some("cupti") => Ok(Hooks::Cupti),
            Some("off") | Some("0") => Ok(Hooks::Off),
            Some(other) => Err(SettingError::Hooks(other.to_string())),
        }
    }

    /// Its name in the statistics.
    pub fn name(self) -> &'static str {
        match self {
            Hooks::Entry => "entry",
            Hooks::Cupti => "cupti",
            Hooks::Off => "off",
        }
    }
}

/// Which operations have their buffers resolved (the launch path's main cost, measured at 2.5
/// to 2.9 µs a launch on the H100 for GPT-2 small). The engine needs them only while it is
/// tracking (a checkpoint open through its restore): those are always resolved. Outside that
/// time, resolution feeds only the DAG and the statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResolveMode {
    /// Every operation (`always`).
    Always,
    /// While the engine tracks, and otherwise `window` consecutive launches in every `period`
    /// (`sample` or `sample:W/P`; P a power of two): the DAG and statistics see recent runs of
    /// launches at a fraction of the cost.
    Sampled {
        /// Launches resolved in a row.
        window: u64,
        /// Launches from one window's start to the next's.
        period: u64,
    },
    /// Only while the engine tracks (`sessions`).
    Sessions,
}

impl Default for ResolveMode {
    fn default() -> Self {
        // 1 in 32: a window of 4096 launches holds a few training steps of GPT-2 small.
        ResolveMode::Sampled {
            window: 4096,
            period: 1 << 17,
        }
    }
}

/// Why a setting's value was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingError {
    /// `POSSUM_HOOKS` is none of its values.
    #[error("POSSUM_HOOKS={0} is not one of entry, cupti, off; using entry")]
    Hooks(String),
    /// `POSSUM_RESOLVE` is none of its forms.
    #[error("expected always, sessions, sample or sample:W/P (W launches in every P)")]
    ResolveForm,
    /// `POSSUM_RESOLVE=sample:` without its `/`.
    #[error("sample:W/P needs a '/'")]
    ResolveSlash,
    /// A number that is not one.
    #[error("{0:?} is not a number")]
    NotANumber(String),
    /// `POSSUM_RESOLVE=sample:W/P` out of its bounds.
    #[error("sample:{window}/{period}: P must be a power of two and 0 < W <= P")]
    ResolveSample {
        /// W.
        window: u64,
        /// P.
        period: u64,
    },
}

impl ResolveMode {
    /// Parses `POSSUM_RESOLVE`'s value.
    pub fn parse(s: &str) -> Result<ResolveMode, SettingError> {
        match s {
            "always" => Ok(ResolveMode::Always),
            "sessions" => Ok(ResolveMode::Sessions),
            "sample" => Ok(ResolveMode::default()),
            _ => {
                let spec = s.strip_prefix("sample:").ok_or(SettingError::ResolveForm)?;
                let (w, p) = spec.split_once('/').ok_or(SettingError::ResolveSlash)?;
                let num = |x: &str| {
                    x.trim()
                        .parse::<u64>()
                        .map_err(|_| SettingError::NotANumber(x.to_string()))
                };
                let (window, period) = (num(w)?, num(p)?);
                if !period.is_power_of_two() || window == 0 || window > period {
                    return Err(SettingError::ResolveSample { window, period });
                }
                Ok(ResolveMode::Sampled { window, period })
            }
        }
    }

    /// Whether the launch with process-wide index `n` is in a sampling window (the engine's
    /// tracking aside).
    #[inline]
    pub fn sampled(self, n: u64) -> bool {
        match self {
            ResolveMode::Always => true,
            ResolveMode::Sampled { window, period } => n & (period - 1) < window,
            ResolveMode::Sessions => false,
        }
    }
}

/// How CUPTI is detached (`POSSUM_DETACH`, with `POSSUM_HOOKS=cupti`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detach {
    /// `cuptiUnsubscribe` (any value but the two below, the empty one included).
    Unsubscribe,
    /// `cuptiUnsubscribe` and `cuptiFinalize` (`finalize`).
    Finalize,
    /// Not at all (`none`).
    Never,
}

/// The A/B test of the hooks' cost (`POSSUM_AB_MS` and `POSSUM_AB_LOG`, both set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbTest {
    /// How long each interval lasts (`POSSUM_AB_MS`, above 0).
    pub every: Duration,
    /// The file each switch is appended to (`POSSUM_AB_LOG`).
    pub log: String,
}

/// What a user of the job sets (`possum run` sets most of them).
#[derive(Debug, Clone)]
pub struct User {
    /// How possum sees the job's operations (`POSSUM_HOOKS`; a bad value: `entry`).
    pub hooks: Hooks,
    /// Why `POSSUM_HOOKS` was not understood, if it was not.
    pub hooks_error: Option<String>,
    /// The CUPTI library to load, the only one tried (`POSSUM_CUPTI`, with `POSSUM_HOOKS=cupti`;
    /// empty, `off` and `1` count as unset).
    pub cupti: Option<String>,
    /// The driver library the wrappers call, found already loaded (`POSSUM_LIBCUDA`, default
    /// `libcuda.so.1`).
    pub libcuda: String,
    /// Where the statistics go at `exit()` (`POSSUM_STATS`; `%p` becomes the pid).
    pub stats: Option<String>,
    /// Where the trace goes at `exit()` (`POSSUM_TRACE`; the DOT beside it, `.dot` appended).
    pub trace: Option<PathBuf>,
    /// A few stderr lines (`POSSUM_VERBOSE=1`).
    pub verbose: bool,
    /// The keeper's socket directory (`POSSUM_KEEPER`).
    pub keeper: Option<PathBuf>,
    /// The control socket's directory (`POSSUM_SOCKET_DIR`, default `/tmp/possum`).
    pub socket_dir: PathBuf,
    /// Serve a control socket (`POSSUM_CONTROL`; `0` turns it off).
    pub control: bool,
    /// Serve `cudaMalloc` from the engine (`POSSUM_MANAGE`, default on).
    pub manage: bool,
}

/// Sizes, thread counts and switches of possum's own work.
#[derive(Debug, Clone)]
pub struct Tuning {
    /// Validation of speculations (`POSSUM_VALIDATE`, e.g. `first=2,every=0`; `off`).
    pub validation: ValidationConfig,
    /// The same with `strict` added (no read-only speculation, sampled reads unless `sample`
    /// was given): what validation uses while the job's engines cannot prove their images by
    /// fingerprints ([`crate::process::runtime::State::validation`]).
    pub validation_strict: ValidationConfig,
    /// Pinned staging per device engine, MiB (`POSSUM_STAGING_MIB`, default 256, at least 16).
    pub staging_mib: u64,
    /// Prove every image by content and copy only the chunks that changed, by fingerprints on
    /// the device (`POSSUM_FINGERPRINTS`, default on; off: the hooks' write sets alone decide
    /// what is copied, and nothing checks an image against the job at T0).
    pub fingerprints: bool,
    /// The unit of the engine's copies and of its images' chunks, MiB (`POSSUM_CHUNK_MIB`,
    /// default 8, 1 to 64).
    pub chunk_mib: u64,
    /// Free the staging memory when the job's buffers are released for the driver's checkpoint
    /// and CRIU, so the CRIU image does not carry it; it is allocated again as the restore needs
    /// it (`POSSUM_STAGING_PARK`, default on).
    pub staging_park: bool,
    /// Lower the context's stack reserve (`CU_LIMIT_STACK_SIZE`, 264 MiB of local memory on an
    /// H100 at its default 1 KiB) while the job is held for the driver's checkpoint, which copies
    /// it to host memory for CRIU to dump and restore; set back before the job launches again
    /// (`POSSUM_TRIM_CONTEXT`, default on).
    pub trim_context: bool,
    /// Serve the job's own virtual-memory mappings (`cuMemCreate` + `cuMemMap`: PyTorch's
    /// expandable segments) with engine buffers (`POSSUM_SERVE_VMM`, default on; `vmm.rs`).
    pub serve_vmm: bool,
    /// Serve stream-ordered allocations (`cuMemAllocAsync`: `cudaMallocAsync`, PyTorch's
    /// `backend:cudaMallocAsync`) from engine buffers (`POSSUM_SERVE_POOLS`, default on;
    /// `pools.rs`).
    pub serve_pools: bool,
    /// Threads writing a checkpoint's chunks to its image, per device engine (`POSSUM_WRITERS`,
    /// 1 to 64): what bounds the copy while the job is held, for a fast GPU and a slow sink.
    /// `None`: the default, [`Tuning::writers`].
    pub writers_set: Option<usize>,
    /// Threads writing a final copy, the job held meanwhile, per device engine
    /// (`POSSUM_HELD_WRITERS`, 1 to 64). `None`: the default, [`Tuning::held_writers`].
    pub held_writers_set: Option<usize>,
    /// Bytes a writer checksums and writes at a time (`POSSUM_WRITE_PIECE_KIB`, default 2048:
    /// one huge page of a huge-page tmpfs, which a write then fills whole).
    pub write_piece: usize,
    /// Threads restoring buffers from an image, per device engine (`POSSUM_RESTORERS`, default 6).
    pub restorers: usize,
    /// The nice value of the engine's background threads (copier, writers, restorers), so that
    /// the job's own threads get the CPUs first while a save or restore runs beside it
    /// (`POSSUM_BACKGROUND_NICE`, 0 to 19, default 10; 0: the job's own).
    pub background_nice: i32,
    /// Record the DAG (`POSSUM_DAG`, default on).
    pub dag: bool,
    /// Launches kept in the DAG's window (`POSSUM_DAG_WINDOW`).
    pub dag_window: usize,
    /// Which operations have their buffers resolved (`POSSUM_RESOLVE`).
    pub resolve: ResolveMode,
    /// Device memory a kept checkpoint's save may use for shadows, MiB (`POSSUM_SHADOW_MIB`;
    /// `None`: three quarters of the device's free memory beyond 4 GiB).
    pub shadow_mib: Option<u64>,
    /// How long the job's threads get to park at a held release (`POSSUM_PARK_TIMEOUT_MS`,
    /// default 2000).
    pub park_timeout: Duration,
    /// How long held work may go without progress (`POSSUM_PARK_WATCHDOG_MS`, default 1000: the
    /// copy beats once per chunk, so a second without one is a stall, not a slow copy).
    pub park_watchdog: Duration,
    /// The real-time signal that parks threads (`POSSUM_PARK_SIGNAL`; `None`: the first unused
    /// from `SIGRTMIN+6`).
    pub park_signal: Option<i32>,
    /// More thread-name prefixes never parked (`POSSUM_PARK_SKIP`, comma-separated).
    pub park_skip: Vec<String>,
}

impl Tuning {
    /// Writer threads per device engine: `POSSUM_WRITERS`, else the machine's cores, 2 to 6
    /// (asked the first time, never at load).
    pub fn writers(&self) -> usize {
        self.writers_set.unwrap_or_else(|| {
            // Measured on the H100 (kept checkpoints of 8 and 24 GiB saved into a huge-page
            // tmpfs while an MLP copying a 64 MiB batch every step runs on): 6 writers drain at
            // 15-17 GB/s and the job's steps during the save take 1.13-1.16x their normal
            // time; 16 writers drain at 22-29 GB/s, and the steps take 1.7-2.0x: the writes
            // take the host's memory bandwidth from the job.
            cores().clamp(2, 6)
        })
    }

    /// Writer threads of a final copy, while the job is held: `POSSUM_HELD_WRITERS`, else the
    /// machine's cores, 2 to 16, and never fewer than [`Tuning::writers`]. Nothing of the job
    /// runs beside that copy, so it may take the host's memory bandwidth; and an image has a
    /// data file per one of these (on tmpfs, writes into one file are serialized).
    pub fn held_writers(&self) -> usize {
        (self.held_writers_set)
            .unwrap_or_else(|| cores().clamp(2, 16))
            .max(self.writers())
    }
}

/// A thread count set by variable `name` (1 to 64); `None`, with a warning for one that is not
/// a number, where the default (the machine's cores, `default`) applies.
fn thread_count(
    env: &Env<'_>,
    name: &str,
    default: &str,
    warnings: &mut Vec<String>,
) -> Option<usize> {
    match env.var(name).map(|s| s.parse::<u64>().map_err(|_| s)) {
        None => None,
        Some(Ok(n)) => Some(n.clamp(1, 64) as usize),
        Some(Err(s)) => {
            warnings.push(format!(
                "{name}={s} is not a number; using the machine's cores ({default})"
            ));
            None
        }
    }
}

/// The machine's cores (asked the first time, never at load).
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(4, |n| n.get()))
}

/// Diagnostics and test hooks: none of them is needed to run or checkpoint a job.
#[derive(Debug, Clone)]
pub struct Diagnostics {
    /// With `POSSUM_HOOKS=cupti`: the only callbacks enabled, by driver function name
    /// (`POSSUM_CALLBACKS`, comma-separated; `none` matches none).
    pub callbacks: Option<Vec<String>>,
    /// Whether `release` detaches CUPTI, and how `possum cupti PID` does (`POSSUM_DETACH`; set to
    /// anything: `release` detaches; `None`: it does not, and a detach unsubscribes).
    pub detach: Option<Detach>,
    /// The A/B test of the hooks' cost (`POSSUM_AB_MS`, `POSSUM_AB_LOG`).
    pub ab: Option<AbTest>,
    /// Log each buffer first marked written while tracking (`POSSUM_DEBUG_DIRTY=1`).
    pub debug_dirty: bool,
    /// Kernels' parameter layouts from loaded modules' `.nv.info` only, never from the driver
    /// (`POSSUM_LAYOUTS=cubin`; tests the fallback on a real job).
    pub layouts_from_cubin_only: bool,
    /// Use a stage the keeper prepared for a restore (`POSSUM_STAGED`; `0`: copy from the image).
    pub use_stage: bool,
    /// Borrow the keeper's spare for a kept checkpoint's save (`POSSUM_SPARE_DRAIN`; `0`: never).
    pub spare_drain: bool,
    /// Borrow it too for the copy made while the job is held (`POSSUM_HELD_SPARE=1`): the
    /// buffers it copies whole go into it at the copy engine's speed, not through the staging.
    pub held_spare: bool,
}

/// Every setting of the interposer.
#[derive(Debug, Clone)]
pub struct Config {
    /// What a user of the job sets.
    pub user: User,
    /// Sizes and threads of possum's own work.
    pub tuning: Tuning,
    /// Diagnostics and test hooks.
    pub diag: Diagnostics,
    /// Problems with the tuning variables (reported in the statistics).
    pub warnings: Vec<String>,
}

/// The value of a boolean variable: unset or empty gives `default`; `0`, `off`, `false`, `no`
/// false; anything else true.
fn flag(v: Option<&str>, default: bool) -> bool {
    match v {
        None => default,
        Some("0" | "off" | "false" | "no") => false,
        Some(_) => true,
    }
}

/// The environment as [`Config::from_env`] reads it: `lookup`, and the ways a variable is read.
struct Env<'a> {
    lookup: &'a dyn Fn(&str) -> Option<OsString>,
}

impl Env<'_> {
    /// `std::env::var(k).ok()`: set and UTF-8.
    fn text(&self, k: &str) -> Option<String> {
        (self.lookup)(k).and_then(|v| v.into_string().ok())
    }

    /// The tuning variables' reading: set, UTF-8 and not empty.
    fn var(&self, k: &str) -> Option<String> {
        self.text(k).filter(|v| !v.is_empty())
    }

    /// Set and not empty, whatever its bytes.
    fn os_nonempty(&self, k: &str) -> Option<OsString> {
        (self.lookup)(k).filter(|v| !v.is_empty())
    }

    /// Set to exactly `1`.
    fn is_one(&self, k: &str) -> bool {
        (self.lookup)(k).is_some_and(|v| v == OsStr::new("1"))
    }

    /// Set to `0`, spaces around it allowed.
    fn is_zero_trimmed(&self, k: &str) -> bool {
        self.text(k).is_some_and(|v| v.trim() == "0")
    }

    /// A number, or `default` and a warning.
    fn num(&self, k: &str, default: u64, warnings: &mut Vec<String>) -> u64 {
        match self.var(k) {
            None => default,
            Some(s) => s.parse().unwrap_or_else(|_| {
                warnings.push(format!("{k}={s} is not a number; using {default}"));
                default
            }),
        }
    }

    /// A number of milliseconds, or `default` (unset or not a number).
    fn ms(&self, k: &str, default: u64) -> Duration {
        Duration::from_millis(self.text(k).and_then(|v| v.parse().ok()).unwrap_or(default))
    }
}

impl Config {
    /// Reads every variable through `lookup` (`std::env::var_os` in the library; a map in tests).
    pub fn from_env(lookup: impl Fn(&str) -> Option<OsString>) -> Config {
        let env = Env { lookup: &lookup };
        let mut warnings = Vec::new();
        let tuning = Tuning::from_env(&env, &mut warnings);
        let user = User::from_env(&env);
        let diag = Diagnostics::from_env(&env);
        Config {
            user,
            tuning,
            diag,
            warnings,
        }
    }
}

impl Tuning {
    /// The tuning variables, a warning in `warnings` for each that cannot be read.
    fn from_env(env: &Env<'_>, warnings: &mut Vec<String>) -> Tuning {
        let given = env.var("POSSUM_VALIDATE");
        let validation = match &given {
            None => ValidationConfig::default(),
            Some(s) => ValidationConfig::from_env_str(s).unwrap_or_else(|e| {
                warnings.push(format!("POSSUM_VALIDATE: {e}; using the default"));
                ValidationConfig::default()
            }),
        };
        let validation_strict = given
            .as_deref()
            .and_then(|s| ValidationConfig::from_env_str(&format!("{s},strict")).ok())
            .unwrap_or_else(|| ValidationConfig::from_env_str("strict").expect("strict parses"));
        // Measured on the H100 (8 GiB, image in tmpfs): 2 writers, 2 restorers, 32 MiB: 2.2 s
        // copy + 1.7 s restore while held; 6, 6, 256 MiB: 1.0 s + 0.8 s.
        let staging_mib = env.num("POSSUM_STAGING_MIB", 256, warnings).max(16);
        let chunk_mib = env.num("POSSUM_CHUNK_MIB", 8, warnings).clamp(1, 64);
        // The default needs the machine's cores, asked only when used ([`Tuning::writers`]).
        let writers_set = thread_count(env, "POSSUM_WRITERS", "2 to 6", warnings);
        let held_writers_set = thread_count(env, "POSSUM_HELD_WRITERS", "2 to 16", warnings);
        let write_piece = env
            .num(
                "POSSUM_WRITE_PIECE_KIB",
                (possum_engine::image::DEFAULT_WRITE_PIECE >> 10) as u64,
                warnings,
            )
            .clamp(4, 64 << 10) as usize
            * 1024;
        let restorers = env.num("POSSUM_RESTORERS", 6, warnings).clamp(1, 64) as usize;
        let background_nice = env.num("POSSUM_BACKGROUND_NICE", 10, warnings).min(19) as i32;
        let dag_window = env.num("POSSUM_DAG_WINDOW", DEFAULT_WINDOW as u64, warnings) as usize;
        let resolve = match env.var("POSSUM_RESOLVE") {
            None => ResolveMode::default(),
            Some(v) => ResolveMode::parse(&v).unwrap_or_else(|e| {
                warnings.push(format!("POSSUM_RESOLVE={v}: {e}; using the default"));
                ResolveMode::default()
            }),
        };
        Tuning {
            validation,
            validation_strict,
            staging_mib,
            fingerprints: flag(env.var("POSSUM_FINGERPRINTS").as_deref(), true),
            chunk_mib,
            staging_park: flag(env.var("POSSUM_STAGING_PARK").as_deref(), true),
            trim_context: flag(env.var("POSSUM_TRIM_CONTEXT").as_deref(), true),
            serve_vmm: flag(env.var("POSSUM_SERVE_VMM").as_deref(), true),
            serve_pools: flag(env.var("POSSUM_SERVE_POOLS").as_deref(), true),
            writers_set,
            held_writers_set,
            write_piece,
            restorers,
            background_nice,
            dag: flag(env.var("POSSUM_DAG").as_deref(), true),
            dag_window,
            resolve,
            shadow_mib: env.text("POSSUM_SHADOW_MIB").and_then(|v| v.parse().ok()),
            park_timeout: env.ms("POSSUM_PARK_TIMEOUT_MS", 2000),
            park_watchdog: env.ms("POSSUM_PARK_WATCHDOG_MS", 1000),
            park_signal: env.text("POSSUM_PARK_SIGNAL").and_then(|v| v.parse().ok()),
            park_skip: env
                .text("POSSUM_PARK_SKIP")
                .map(|more| {
                    more.split(',')
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default(),
        }
    }
}

impl User {
    /// What a user of the job sets.
    fn from_env(env: &Env<'_>) -> User {
        let (hooks, hooks_error) = match Hooks::parse(env.text("POSSUM_HOOKS").as_deref()) {
            Ok(h) => (h, None),
            Err(e) => (Hooks::Entry, Some(e.to_string())),
        };
        User {
            hooks,
            hooks_error,
            cupti: env
                .text("POSSUM_CUPTI")
                .filter(|p| !p.is_empty() && p != "off" && p != "1"),
            libcuda: env
                .text("POSSUM_LIBCUDA")
                .unwrap_or_else(|| "libcuda.so.1".into()),
            stats: env.text("POSSUM_STATS").filter(|p| !p.is_empty()),
            trace: env.os_nonempty("POSSUM_TRACE").map(PathBuf::from),
            verbose: env.is_one("POSSUM_VERBOSE"),
            keeper: env
                .os_nonempty(possum_keeper::KEEPER_ENV)
                .map(PathBuf::from),
            socket_dir: env.os_nonempty(possum_control::SOCKET_DIR_ENV).map_or_else(
                || PathBuf::from(possum_control::DEFAULT_SOCKET_DIR),
                PathBuf::from,
            ),
            control: (env.lookup)("POSSUM_CONTROL").is_none_or(|v| v != OsStr::new("0")),
            manage: flag(env.var("POSSUM_MANAGE").as_deref(), true),
        }
    }
}

impl Diagnostics {
    /// The diagnostics and test hooks.
    fn from_env(env: &Env<'_>) -> Diagnostics {
        let ab_every = env
            .text("POSSUM_AB_MS")
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&ms| ms > 0);
        let ab_log = env.text("POSSUM_AB_LOG").filter(|p| !p.is_empty());
        Diagnostics {
            callbacks: env
                .text("POSSUM_CALLBACKS")
                .filter(|v| !v.is_empty())
                .map(|v| v.split(',').map(str::to_string).collect()),
            detach: (env.lookup)("POSSUM_DETACH").map(|v| match v.to_str() {
                Some("finalize") => Detach::Finalize,
                Some("none") => Detach::Never,
                _ => Detach::Unsubscribe,
            }),
            ab: ab_every.zip(ab_log).map(|(ms, log)| AbTest {
                every: Duration::from_millis(ms),
                log,
            }),
            debug_dirty: env.is_one("POSSUM_DEBUG_DIRTY"),
            layouts_from_cubin_only: env.var("POSSUM_LAYOUTS").as_deref() == Some("cubin"),
            use_stage: !env.is_zero_trimmed("POSSUM_STAGED"),
            spare_drain: !env.is_zero_trimmed("POSSUM_SPARE_DRAIN"),
            held_spare: env.is_one("POSSUM_HELD_SPARE"),
        }
    }
}

static CONFIG: OnceLock<Config> = OnceLock::new();

/// The process's settings, read from the environment on the first call.
pub fn get() -> &'static Config {
    CONFIG.get_or_init(|| Config::from_env(|k| std::env::var_os(k)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(vars: &[(&str, &str)]) -> Config {
        let vars: Vec<(String, OsString)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        Config::from_env(|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn defaults_when_nothing_is_set() {
        let c = config(&[]);
        assert_eq!(c.user.hooks, Hooks::Entry);
        assert_eq!(c.user.hooks_error, None);
        assert_eq!(c.user.cupti, None);
        assert_eq!(c.user.libcuda, "libcuda.so.1");
        assert_eq!(c.user.stats, None);
        assert_eq!(c.user.trace, None);
        assert!(!c.user.verbose);
        assert_eq!(c.user.keeper, None);
        assert_eq!(c.user.socket_dir, PathBuf::from("/tmp/possum"));
        assert!(c.user.control);
        assert!(c.user.manage);

        let t = &c.tuning;
        assert_eq!(t.validation, ValidationConfig::default());
        assert_eq!((t.staging_mib, t.chunk_mib), (256, 8));
        assert!(t.staging_park && t.trim_context && t.serve_vmm && t.serve_pools && t.dag);
        assert_eq!((t.writers_set, t.held_writers_set), (None, None));
        assert!((2..=6).contains(&t.writers()));
        assert!((2..=16).contains(&t.held_writers()));
        assert!(t.held_writers() >= t.writers());
        assert_eq!(t.write_piece, possum_engine::image::DEFAULT_WRITE_PIECE);
        assert_eq!(t.restorers, 6);
        assert_eq!(t.background_nice, 10);
        assert_eq!(t.dag_window, DEFAULT_WINDOW);
        assert_eq!(t.resolve, ResolveMode::default());
        assert_eq!(t.shadow_mib, None);
        assert_eq!(t.park_timeout, Duration::from_millis(2000));
        assert_eq!(t.park_watchdog, Duration::from_millis(1000));
        assert_eq!(t.park_signal, None);
        assert!(t.park_skip.is_empty());

        let d = &c.diag;
        assert_eq!(d.callbacks, None);
        assert_eq!(d.detach, None);
        assert_eq!(d.ab, None);
        assert!(!d.debug_dirty && !d.layouts_from_cubin_only);
        assert!(d.use_stage && d.spare_drain && !d.held_spare);
        assert!(c.warnings.is_empty());
    }

    #[test]
    fn values_are_parsed() {
        let c = config(&[
            ("POSSUM_HOOKS", "0"),
            ("POSSUM_CUPTI", "/x/libcupti.so"),
            ("POSSUM_LIBCUDA", "libfake.so"),
            ("POSSUM_STATS", "/s/%p.json"),
            ("POSSUM_TRACE", "/t/trace.json"),
            ("POSSUM_VERBOSE", "1"),
            ("POSSUM_KEEPER", "/k"),
            ("POSSUM_SOCKET_DIR", "/sock"),
            ("POSSUM_CONTROL", "0"),
            ("POSSUM_MANAGE", "off"),
            ("POSSUM_VALIDATE", "off"),
            ("POSSUM_STAGING_MIB", "4"),
            ("POSSUM_CHUNK_MIB", "100"),
            ("POSSUM_STAGING_PARK", "no"),
            ("POSSUM_TRIM_CONTEXT", "false"),
            ("POSSUM_SERVE_VMM", "0"),
            ("POSSUM_SERVE_POOLS", "0"),
            ("POSSUM_WRITERS", "100"),
            ("POSSUM_HELD_WRITERS", "3"),
            ("POSSUM_WRITE_PIECE_KIB", "1"),
            ("POSSUM_RESTORERS", "3"),
            ("POSSUM_BACKGROUND_NICE", "40"),
            ("POSSUM_DAG", "0"),
            ("POSSUM_DAG_WINDOW", "16"),
            ("POSSUM_RESOLVE", "sample:2/8"),
            ("POSSUM_SHADOW_MIB", "512"),
            ("POSSUM_PARK_TIMEOUT_MS", "300"),
            ("POSSUM_PARK_WATCHDOG_MS", "200"),
            ("POSSUM_PARK_SIGNAL", "40"),
            ("POSSUM_PARK_SKIP", "mask,,pt_"),
            ("POSSUM_CALLBACKS", "cuLaunchKernel,cuMemcpy"),
            ("POSSUM_DETACH", "finalize"),
            ("POSSUM_AB_MS", "50"),
            ("POSSUM_AB_LOG", "/ab.jsonl"),
            ("POSSUM_DEBUG_DIRTY", "1"),
            ("POSSUM_LAYOUTS", "cubin"),
            ("POSSUM_STAGED", " 0 "),
            ("POSSUM_SPARE_DRAIN", "0"),
            ("POSSUM_HELD_SPARE", "1"),
        ]);
        let u = &c.user;
        assert_eq!(u.hooks, Hooks::Off);
        assert_eq!(u.cupti.as_deref(), Some("/x/libcupti.so"));
        assert_eq!(u.libcuda, "libfake.so");
        assert_eq!(u.stats.as_deref(), Some("/s/%p.json"));
        assert_eq!(u.trace, Some(PathBuf::from("/t/trace.json")));
        assert!(u.verbose);
        assert_eq!(u.keeper, Some(PathBuf::from("/k")));
        assert_eq!(u.socket_dir, PathBuf::from("/sock"));
        assert!(!u.control && !u.manage);

        let t = &c.tuning;
        assert_eq!(t.validation.first_launches, 0);
        assert_eq!((t.staging_mib, t.chunk_mib), (16, 64), "clamped");
        assert!(!t.staging_park && !t.trim_context && !t.serve_vmm && !t.serve_pools && !t.dag);
        assert_eq!((t.writers_set, t.writers()), (Some(64), 64));
        assert_eq!(
            (t.held_writers_set, t.held_writers()),
            (Some(3), 64),
            "never fewer than the pre-copy's writers"
        );
        assert_eq!(t.write_piece, 4 * 1024);
        assert_eq!(t.restorers, 3);
        assert_eq!(t.background_nice, 19, "clamped");
        assert_eq!(t.dag_window, 16);
        assert_eq!(
            t.resolve,
            ResolveMode::Sampled {
                window: 2,
                period: 8
            }
        );
        assert_eq!(t.shadow_mib, Some(512));
        assert_eq!(t.park_timeout, Duration::from_millis(300));
        assert_eq!(t.park_watchdog, Duration::from_millis(200));
        assert_eq!(t.park_signal, Some(40));
        assert_eq!(t.park_skip, ["mask", "pt_"]);

        let d = &c.diag;
        assert_eq!(
            d.callbacks.as_deref(),
            Some(&["cuLaunchKernel".to_string(), "cuMemcpy".to_string()][..])
        );
        assert_eq!(d.detach, Some(Detach::Finalize));
        assert_eq!(
            d.ab,
            Some(AbTest {
                every: Duration::from_millis(50),
                log: "/ab.jsonl".into()
            })
        );
        assert!(d.debug_dirty && d.layouts_from_cubin_only);
        assert!(!d.use_stage && !d.spare_drain && d.held_spare);
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    }

    #[test]
    fn bad_values_leave_the_defaults() {
        let c = config(&[
            ("POSSUM_HOOKS", "sometimes"),
            ("POSSUM_VALIDATE", "first=x"),
            ("POSSUM_STAGING_MIB", "lots"),
            ("POSSUM_WRITERS", "many"),
            ("POSSUM_HELD_WRITERS", "all"),
            ("POSSUM_RESOLVE", "sample:3/6"),
            ("POSSUM_PARK_TIMEOUT_MS", "soon"),
            ("POSSUM_PARK_SIGNAL", "USR1"),
            ("POSSUM_SHADOW_MIB", "-1"),
            ("POSSUM_AB_MS", "0"),
            ("POSSUM_AB_LOG", "/ab.jsonl"),
        ]);
        assert_eq!(c.user.hooks, Hooks::Entry);
        assert!(c.user.hooks_error.as_deref().unwrap().contains("sometimes"));
        assert_eq!(c.tuning.validation, ValidationConfig::default());
        assert_eq!(c.tuning.staging_mib, 256);
        assert_eq!(c.tuning.writers_set, None);
        assert_eq!(c.tuning.resolve, ResolveMode::default());
        assert_eq!(c.tuning.park_timeout, Duration::from_millis(2000));
        assert_eq!(c.tuning.park_signal, None);
        assert_eq!(c.tuning.shadow_mib, None);
        assert_eq!(c.diag.ab, None, "a period of 0 is no A/B test");
        let w = c.warnings.join("\n");
        for name in [
            "POSSUM_VALIDATE",
            "POSSUM_STAGING_MIB=lots",
            "POSSUM_WRITERS=many",
            "POSSUM_HELD_WRITERS=all",
            "POSSUM_RESOLVE",
        ] {
            assert!(w.contains(name), "{name} not in {w}");
        }
        assert_eq!(c.tuning.held_writers_set, None);
        assert_eq!(c.warnings.len(), 5);
        assert!(
            w.starts_with("POSSUM_VALIDATE"),
            "in the order the statistics always had"
        );
    }

    #[test]
    fn empty_and_special_values() {
        // Empty counts as unset for most; `POSSUM_DETACH` set at all makes release detach;
        // `POSSUM_CUPTI=off` or `1` is no path; an empty `POSSUM_LIBCUDA` stays empty.
        let c = config(&[
            ("POSSUM_HOOKS", ""),
            ("POSSUM_CUPTI", "off"),
            ("POSSUM_LIBCUDA", ""),
            ("POSSUM_STATS", ""),
            ("POSSUM_TRACE", ""),
            ("POSSUM_VERBOSE", "yes"),
            ("POSSUM_SOCKET_DIR", ""),
            ("POSSUM_CONTROL", "1"),
            ("POSSUM_MANAGE", ""),
            ("POSSUM_DETACH", ""),
            ("POSSUM_CALLBACKS", "none"),
            ("POSSUM_STAGED", "1"),
        ]);
        assert_eq!(c.user.hooks, Hooks::Entry);
        assert_eq!(c.user.hooks_error, None);
        assert_eq!(c.user.cupti, None);
        assert_eq!(c.user.libcuda, "");
        assert_eq!((c.user.stats.as_ref(), c.user.trace.as_ref()), (None, None));
        assert!(!c.user.verbose);
        assert_eq!(c.user.socket_dir, PathBuf::from("/tmp/possum"));
        assert!(c.user.control && c.user.manage);
        assert_eq!(c.diag.detach, Some(Detach::Unsubscribe));
        assert_eq!(c.diag.callbacks.as_deref(), Some(&["none".to_string()][..]));
        assert!(c.diag.use_stage);
        assert_eq!(
            config(&[("POSSUM_DETACH", "none")]).diag.detach,
            Some(Detach::Never)
        );
        assert_eq!(config(&[("POSSUM_CUPTI", "1")]).user.cupti, None);
        assert_eq!(
            config(&[("POSSUM_HOOKS", "cupti")]).user.hooks,
            Hooks::Cupti
        );
    }

    #[test]
    fn resolve_modes_parse_and_sample() {
        assert_eq!(ResolveMode::parse("always"), Ok(ResolveMode::Always));
        assert_eq!(ResolveMode::parse("sessions"), Ok(ResolveMode::Sessions));
        assert_eq!(ResolveMode::parse("sample"), Ok(ResolveMode::default()));
        let m = ResolveMode::parse("sample:2/8").unwrap();
        let hits: Vec<u64> = (0..20).filter(|&n| m.sampled(n)).collect();
        assert_eq!(hits, vec![0, 1, 8, 9, 16, 17]);
        assert!((0..100).all(|n| ResolveMode::Always.sampled(n)));
        assert!(!(0..100).any(|n| ResolveMode::Sessions.sampled(n)));
        for bad in [
            "sample:3/6",
            "sample:0/8",
            "sample:9/8",
            "sample:x/8",
            "sample:8",
            "often",
        ] {
            assert!(ResolveMode::parse(bad).is_err(), "{bad}");
        }
    }
}
