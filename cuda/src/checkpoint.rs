//! The driver's checkpoint of *another* process: NVIDIA's `cuCheckpointProcess*` API, as used by
//! possum's CLI (the caller) on a job (the target, named by its pid).
//!
//! The calls, all made by the caller with the target's pid:
//!
//! - `cuCheckpointProcessGetState`: the target's state ([`ProcessState`]).
//! - `cuCheckpointProcessGetRestoreThreadId`: the thread id of the CUDA restore thread inside the
//!   target (cuda.h says no more; CRIU's CUDA plugin asks for it before it freezes the target).
//! - `cuCheckpointProcessLock`: blocks further CUDA API calls of the target and waits for the work
//!   it already submitted to complete. The process must be RUNNING. With a timeout that expires,
//!   the target is left RUNNING and the call fails: cuda.h does not say with which result (it lists
//!   `CUDA_ERROR_NOT_READY` among the lock's results); driver 580 returns `CUDA_ERROR_NOT_READY`
//!   (600) at the timeout, which [`DriverCheckpoint::lock`] reports as
//!   [`DriverCkptError::LockTimeout`].
//! - `cuCheckpointProcessCheckpoint`: copies the target's device memory into its host memory and
//!   releases its GPU(s) (memory, contexts, device handles). The process must be LOCKED.
//! - `cuCheckpointProcessRestore`: reacquires the GPU(s) and copies the memory back, optionally onto
//!   other GPUs of the same chip type (UUID pairs). The process must be CHECKPOINTED.
//! - `cuCheckpointProcessUnlock`: lets the target's CUDA calls proceed. The process must be LOCKED.
//!
//! So the target goes RUNNING → (lock) LOCKED → (checkpoint) CHECKPOINTED → (restore) LOCKED →
//! (unlock) RUNNING. A call made in the wrong state fails (`CUDA_ERROR_ILLEGAL_STATE`, 401, by
//! cuda.h's list of results). cuda.h does not say what a pid without CUDA gives. Seen with driver
//! 580.159.04 (H100): a live process that never initialised CUDA cannot be locked, nor its state
//! read: `CUDA_ERROR_NOT_INITIALIZED` (3, "initialization error"), as users of the API also report;
//! a pid with no process gives `CUDA_ERROR_OPERATING_SYSTEM` (304).
//!
//! The functions are not in cudarc 0.19's bindings, so this module loads libcuda itself (with
//! `dlopen`, through libloading): the library named by `POSSUM_LIBCUDA` if set, else
//! `libcuda.so.1`. They need NVIDIA driver 570 or newer (CUDA 12.8, where the driver API gained
//! them; driver 550 had only the `cuda-checkpoint` utility); remapping GPUs on restore needs CUDA
//! 13.0's restore arguments (driver 580). The argument structs are declared here as in CUDA 13.0's
//! `cuda.h`, with their sizes checked at compile time, and always passed zeroed except for the
//! fields set on purpose.
//!
//! Every call has a deadline: it runs on a thread of its own while the caller waits at most
//! that long for its answer ([`DriverCkptError::DeadlineExceeded`] after it). The driver gives
//! no way to cancel a call, so one past its deadline is left to finish (or hang) on its thread,
//! and the process the call was about is in whatever state the driver leaves it; the caller
//! decides what to do (possum's checkpoint undoes what it did and reports the phase). The
//! state, restore-thread and unlock queries have [`SHORT_DEADLINE`] (see
//! [`DriverCheckpoint::with_short_deadline`]); a lock has its own timeout plus that; the
//! checkpoint and restore, which move the process's GPU memory, have the deadline the caller
//! gives, sized by that memory.
//!
//! This is the third module of this crate with `unsafe` code. Every function here is safe to call:
//! the function pointers are resolved with the types cuda.h gives them and stay valid because the
//! library is never unloaded; every pointer passed is to a local (or a slice) that outlives the
//! call.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, CStr};
use std::fmt;
use std::mem::{offset_of, size_of, ManuallyDrop};
use std::ptr;
use std::sync::mpsc;
use std::time::Duration;

use libloading::Library;
use possum_control::EnvConfig;

/// `CUresult` (a C enum, `int`-sized), kept as a raw number: values newer than these bindings are
/// never an invalid Rust enum.
type CuResult = c_int;

const CUDA_SUCCESS: CuResult = 0;
/// What a lock whose timeout expires returns (driver 580).
const CUDA_ERROR_NOT_READY: CuResult = 600;

/// `CUcheckpointLockArgs` (cuda.h, CUDA 12.8 to 13.0).
#[repr(C)]
struct LockArgs {
    /// Milliseconds to try to lock for; 0 is no timeout.
    timeout_ms: c_uint,
    /// Must be zero.
    reserved0: c_uint,
    /// Must be zeroed.
    reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs` (cuda.h, CUDA 12.8 to 13.0): reserved only.
#[repr(C)]
struct CheckpointArgs {
    reserved: [u64; 8],
}

/// `CUcheckpointGpuPair` (cuda.h, CUDA 13.0): two `CUuuid`s (`char bytes[16]` each).
#[repr(C)]
#[derive(Clone, Copy)]
struct GpuPair {
    old_uuid: [u8; 16],
    new_uuid: [u8; 16],
}

/// `CUcheckpointRestoreArgs` (cuda.h, CUDA 13.0):
/// `{ CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount;
///    char reserved[52 - sizeof(CUcheckpointGpuPair *)]; cuuint64_t reserved1; }`.
/// In CUDA 12.8 the same 64 bytes were `cuuint64_t reserved[8]`, so zeroed arguments mean "no
/// remapping" for both.
#[repr(C)]
struct RestoreArgs {
    gpu_pairs: *mut GpuPair,
    gpu_pairs_count: c_uint,
    reserved: [u8; 52 - size_of::<*mut GpuPair>()],
    reserved1: u64,
}

/// `CUcheckpointUnlockArgs` (cuda.h, CUDA 12.8 to 13.0): reserved only.
#[repr(C)]
struct UnlockArgs {
    reserved: [u64; 8],
}

// The sizes cuda.h implies: 4 + 4 + 7 * 8; 8 * 8; 2 * 16; 8 + 4 + 44 + 8 (on 64-bit); 8 * 8.
const _: () = assert!(size_of::<LockArgs>() == 64);
const _: () = assert!(size_of::<CheckpointArgs>() == 64);
const _: () = assert!(size_of::<GpuPair>() == 32);
const _: () = assert!(size_of::<RestoreArgs>() == 64);
const _: () = assert!(offset_of!(RestoreArgs, gpu_pairs_count) == 8);
const _: () = assert!(offset_of!(RestoreArgs, reserved1) == 56);
const _: () = assert!(size_of::<UnlockArgs>() == 64);

type InitFn = unsafe extern "C" fn(c_uint) -> CuResult;
type GetErrorStringFn = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;
type LockFn = unsafe extern "C" fn(c_int, *mut LockArgs) -> CuResult;
type CheckpointFn = unsafe extern "C" fn(c_int, *mut CheckpointArgs) -> CuResult;
type RestoreFn = unsafe extern "C" fn(c_int, *mut RestoreArgs) -> CuResult;
type UnlockFn = unsafe extern "C" fn(c_int, *mut UnlockArgs) -> CuResult;
/// `CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)`; the enum is read as an
/// `int`.
type GetStateFn = unsafe extern "C" fn(c_int, *mut c_int) -> CuResult;
type GetRestoreThreadIdFn = unsafe extern "C" fn(c_int, *mut c_int) -> CuResult;

pub use crate::config::LIBCUDA_ENV;

/// The deadline of the calls that move no memory (`cuCheckpointProcessGetState`,
/// `cuCheckpointProcessGetRestoreThreadId`, `cuCheckpointProcessUnlock`), and what a lock gets
/// beyond its own timeout.
pub const SHORT_DEADLINE: Duration = Duration::from_secs(60);

/// A process's state as the driver's checkpoint API sees it (`CUprocessState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    /// `CU_PROCESS_STATE_RUNNING` (0): CUDA calls proceed.
    Running,
    /// `CU_PROCESS_STATE_LOCKED` (1): CUDA calls block; submitted work has completed.
    Locked,
    /// `CU_PROCESS_STATE_CHECKPOINTED` (2): device memory is in host memory, the GPU released.
    Checkpointed,
    /// `CU_PROCESS_STATE_FAILED` (3): an uncorrectable error during checkpoint or restore.
    Failed,
    /// A value CUDA 13.0's cuda.h does not define (newer drivers add transitional states).
    Other(i32),
}

impl ProcessState {
    fn from_raw(v: c_int) -> ProcessState {
        match v {
            0 => ProcessState::Running,
            1 => ProcessState::Locked,
            2 => ProcessState::Checkpointed,
            3 => ProcessState::Failed,
            other => ProcessState::Other(other),
        }
    }
}

impl fmt::Display for ProcessState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProcessState::Running => f.write_str("running"),
            ProcessState::Locked => f.write_str("locked"),
            ProcessState::Checkpointed => f.write_str("checkpointed"),
            ProcessState::Failed => f.write_str("failed"),
            ProcessState::Other(v) => write!(f, "unknown state {v}"),
        }
    }
}

/// What the driver's answers about a process say of its own CUDA context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnContext {
    /// It has none; why (the driver's code, or a restore thread that is not its own).
    None(String),
    /// It has one, in this state.
    Present(ProcessState),
}

/// Interprets the driver's answers about `pid`: `state` is `cuCheckpointProcessGetState`'s (the
/// state, or the failing `CUresult`); `restore_tid` is `cuCheckpointProcessGetRestoreThreadId`'s
/// when asked. A failing state query means no CUDA context (driver 580 answers
/// `CUDA_ERROR_NOT_INITIALIZED`, 3, for a process that never initialised CUDA). A state with a
/// restore thread that `thread_exists` says is not in the process is a forked copy of a CUDA
/// process's memory (a DataLoader worker), not a context: `fork` copies no thread.
pub fn own_context(
    state: Result<ProcessState, i32>,
    restore_tid: Option<Result<i32, i32>>,
    thread_exists: impl FnOnce(i32) -> bool,
) -> OwnContext {
    match (state, restore_tid) {
        (Err(code), _) => OwnContext::None(format!(
            "the driver reports none (cuCheckpointProcessGetState: CUresult {code})"
        )),
        (Ok(s), Some(Ok(tid))) if !thread_exists(tid) => OwnContext::None(format!(
            "the driver reports state {s}, but its CUDA restore thread {tid} is not in the \
             process (a forked copy)"
        )),
        (Ok(s), _) => OwnContext::Present(s),
    }
}

/// Why a driver checkpoint call could not be made or failed.
#[derive(Debug, thiserror::Error)]
pub enum DriverCkptError {
    /// The driver library could not be loaded, or is not a CUDA driver (lacks `cuInit` or
    /// `cuGetErrorString`).
    #[error("cannot load the CUDA driver library {lib}: {reason}")]
    Load {
        /// The name or path given to `dlopen`.
        lib: String,
        /// Why, with `dlerror`'s text.
        reason: String,
    },
    /// `cuInit(0)` failed (e.g. `CUDA_ERROR_NO_DEVICE`, 100, on a machine without a GPU).
    #[error("cuInit(0) failed in {lib}: {text} ({})", code_label(*.code))]
    Init {
        /// The name or path given to `dlopen`.
        lib: String,
        /// The `CUresult`.
        code: i32,
        /// `cuGetErrorString`'s text for it.
        text: String,
    },
    /// The driver lacks the checkpoint API.
    #[error(
        "the CUDA driver has no {symbol}: the checkpoint API needs NVIDIA driver 570 or newer \
         (CUDA 12.8)"
    )]
    Unsupported {
        /// The first missing entry point.
        symbol: &'static str,
    },
    /// A lock with a timeout did not get the target locked in time (`CUDA_ERROR_NOT_READY`, 600:
    /// not said by cuda.h, which only lists it among the lock's results, but what driver 580 gives;
    /// see the module's documentation). The target is still RUNNING.
    #[error(
        "cuCheckpointProcessLock for pid {pid} timed out after {timeout_ms} ms \
         (CUDA_ERROR_NOT_READY, CUresult 600); the process is still running"
    )]
    LockTimeout {
        /// The target process.
        pid: i32,
        /// The timeout given to the lock.
        timeout_ms: u32,
    },
    /// A call did not return within its deadline. It is left running on a thread of its own
    /// (the driver cannot cancel it); the process is in whatever state the driver leaves it.
    #[error(
        "{call} for pid {pid} did not return within {}: possum stopped waiting for the driver",
        seconds(*after)
    )]
    DeadlineExceeded {
        /// The driver entry point, e.g. `cuCheckpointProcessCheckpoint`.
        call: &'static str,
        /// The target process.
        pid: i32,
        /// The deadline that passed.
        after: Duration,
    },
    /// No thread could be started to make a call.
    #[error("{call} for pid {pid}: cannot start a thread for the call: {reason}")]
    Thread {
        /// The driver entry point.
        call: &'static str,
        /// The target process.
        pid: i32,
        /// Why.
        reason: String,
    },
    /// A checkpoint call failed.
    #[error("{call} for pid {pid} failed: {text} ({})", code_label(*.code))]
    Call {
        /// The driver entry point, e.g. `cuCheckpointProcessLock`.
        call: &'static str,
        /// The target process.
        pid: i32,
        /// The `CUresult`.
        code: i32,
        /// `cuGetErrorString`'s text for it.
        text: String,
    },
}

impl DriverCkptError {
    /// The driver's `CUresult`, for [`Init`](Self::Init), [`LockTimeout`](Self::LockTimeout) and
    /// [`Call`](Self::Call).
    pub fn code(&self) -> Option<i32> {
        match self {
            DriverCkptError::Init { code, .. } | DriverCkptError::Call { code, .. } => Some(*code),
            DriverCkptError::LockTimeout { .. } => Some(CUDA_ERROR_NOT_READY),
            DriverCkptError::Load { .. }
            | DriverCkptError::Unsupported { .. }
            | DriverCkptError::DeadlineExceeded { .. }
            | DriverCkptError::Thread { .. } => None,
        }
    }
}

/// `d` in seconds, as a person reads it (`1.5 s`, `120 s`).
fn seconds(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0} s")
    } else {
        format!("{s:.3} s")
    }
}

/// The cuda.h name of the results these calls are documented or known to give, with the number.
fn code_label(code: i32) -> String {
    let name = match code {
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        100 => "CUDA_ERROR_NO_DEVICE",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        401 => "CUDA_ERROR_ILLEGAL_STATE",
        600 => "CUDA_ERROR_NOT_READY",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        909 => "CUDA_ERROR_TIMEOUT",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return format!("CUresult {code}"),
    };
    format!("{name}, CUresult {code}")
}

/// The driver's checkpoint API, loaded. Cheap to share between threads (`Send + Sync`); every
/// method may be called from any thread.
pub struct DriverCheckpoint {
    /// Never unloaded: after `cuInit` the driver's state (and threads) must outlive every handle,
    /// and the function pointers below point into it.
    _lib: ManuallyDrop<Library>,
    lib_name: String,
    get_error_string: GetErrorStringFn,
    lock: LockFn,
    checkpoint: CheckpointFn,
    restore: RestoreFn,
    unlock: UnlockFn,
    get_state: GetStateFn,
    get_restore_thread_id: GetRestoreThreadIdFn,
    /// The deadline of the calls that move no memory ([`SHORT_DEADLINE`] unless set).
    short: Duration,
}

impl fmt::Debug for DriverCheckpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DriverCheckpoint")
            .field("lib", &self.lib_name)
            .field("short_deadline", &self.short)
            .finish_non_exhaustive()
    }
}

/// Looks `name` up in `lib` as a `T`, copied out of the symbol.
///
/// # Safety
/// `T` must be the function pointer type of `name`'s C declaration, and the pointer must not be
/// called after `lib` is unloaded.
unsafe fn symbol<T: Copy>(lib: &Library, name: &str) -> Option<T> {
    // SAFETY: the caller guarantees `T` is the symbol's type and keeps the library loaded.
    unsafe { lib.get::<T>(name).ok().map(|s| *s) }
}

impl DriverCheckpoint {
    /// Loads the driver named by `POSSUM_LIBCUDA`, else `libcuda.so.1`, checks it has the
    /// checkpoint API and runs `cuInit(0)`. See [`load_from`](Self::load_from).
    pub fn load() -> Result<DriverCheckpoint, DriverCkptError> {
        let lib = crate::config::Config::from_env().libcuda;
        DriverCheckpoint::load_from(&lib.to_string_lossy())
    }

    /// Loads the driver `lib` (a `dlopen` name or a path; kept loaded for the life of the process),
    /// checks it has `cuInit`, `cuGetErrorString` ([`DriverCkptError::Load`] if not) and the six
    /// checkpoint calls ([`DriverCkptError::Unsupported`] if not), then runs `cuInit(0)`
    /// ([`DriverCkptError::Init`] if it fails).
    pub fn load_from(lib: &str) -> Result<DriverCheckpoint, DriverCkptError> {
        let load_err = |reason: String| DriverCkptError::Load {
            lib: lib.to_string(),
            reason,
        };
        // SAFETY: loading libcuda runs its initialisers, which have no preconditions (it is loaded
        // into arbitrary processes by the CUDA runtime and by tools).
        let library = unsafe { Library::new(lib) }.map_err(|e| load_err(crate::error_chain(&e)))?;
        // The types below are those of CUDA 13.0's cuda.h: `CUresult cuInit(unsigned int)`,
        // `CUresult cuGetErrorString(CUresult, const char **)`,
        // `CUresult cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock}(int pid, CU...Args *)`
        // with the structs declared above, and `CUresult cuCheckpointProcessGetState(int,
        // CUprocessState *)` / `cuCheckpointProcessGetRestoreThreadId(int, int *)`. The library is
        // stored beside the pointers and never unloaded.
        // SAFETY: `InitFn` is cuInit's type (above); the library outlives the pointer.
        let init: InitFn = unsafe { symbol(&library, "cuInit") }
            .ok_or_else(|| load_err("no cuInit: not a CUDA driver library".into()))?;
        // SAFETY: `GetErrorStringFn` is cuGetErrorString's type (above); the library outlives it.
        let get_error_string: GetErrorStringFn = unsafe { symbol(&library, "cuGetErrorString") }
            .ok_or_else(|| load_err("no cuGetErrorString: not a CUDA driver library".into()))?;
        macro_rules! checkpoint_symbol {
            ($name:literal) => {
                // SAFETY: each use names the type of `$name`'s declaration (above); the library
                // outlives the pointer.
                unsafe { symbol(&library, $name) }
                    .ok_or(DriverCkptError::Unsupported { symbol: $name })?
            };
        }
        let lock: LockFn = checkpoint_symbol!("cuCheckpointProcessLock");
        let checkpoint: CheckpointFn = checkpoint_symbol!("cuCheckpointProcessCheckpoint");
        let restore: RestoreFn = checkpoint_symbol!("cuCheckpointProcessRestore");
        let unlock: UnlockFn = checkpoint_symbol!("cuCheckpointProcessUnlock");
        let get_state: GetStateFn = checkpoint_symbol!("cuCheckpointProcessGetState");
        let get_restore_thread_id: GetRestoreThreadIdFn =
            checkpoint_symbol!("cuCheckpointProcessGetRestoreThreadId");
        let this = DriverCheckpoint {
            _lib: ManuallyDrop::new(library),
            lib_name: lib.to_string(),
            get_error_string,
            lock,
            checkpoint,
            restore,
            unlock,
            get_state,
            get_restore_thread_id,
            short: SHORT_DEADLINE,
        };
        // SAFETY: `cuInit` takes flags by value (0 is the only valid value) and may be called any
        // number of times.
        let r = unsafe { init(0) };
        if r != CUDA_SUCCESS {
            return Err(DriverCkptError::Init {
                lib: lib.to_string(),
                code: r,
                text: this.error_text(r),
            });
        }
        Ok(this)
    }

    /// `cuGetErrorString`'s text for `r`, or a fallback when the driver knows no text for it.
    fn error_text(&self, r: CuResult) -> String {
        let mut s: *const c_char = ptr::null();
        // SAFETY: `s` is a valid out-pointer; the function accepts any value of `r` (an unknown
        // one gives CUDA_ERROR_INVALID_VALUE).
        let ok = unsafe { (self.get_error_string)(r, &mut s) };
        if ok != CUDA_SUCCESS || s.is_null() {
            return "(no description from the driver)".to_string();
        }
        // SAFETY: on success the driver points `s` at a static NUL-terminated string.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }

    /// The deadline of the calls that move no memory, `limit` instead of [`SHORT_DEADLINE`].
    pub fn with_short_deadline(mut self, limit: Duration) -> DriverCheckpoint {
        self.short = limit;
        self
    }

    /// The deadline of the calls that move no memory.
    pub fn short_deadline(&self) -> Duration {
        self.short
    }

    fn check(&self, call: &'static str, pid: i32, r: CuResult) -> Result<(), DriverCkptError> {
        if r == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(DriverCkptError::Call {
                call,
                pid,
                code: r,
                text: self.error_text(r),
            })
        }
    }

    /// Runs `f` (one driver call) on a thread of its own and waits at most `limit` for what it
    /// returns. Past `limit` the thread is left to finish on its own: the driver has no way to
    /// cancel a call.
    fn bounded<T: Send + 'static>(
        call: &'static str,
        pid: i32,
        limit: Duration,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, DriverCkptError> {
        let (tx, rx) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("possum-driver-call".into())
            .spawn(move || {
                // The caller may have stopped waiting: then nobody wants the answer.
                let _ = tx.send(f());
            })
            .map_err(|e| DriverCkptError::Thread {
                call,
                pid,
                reason: e.to_string(),
            })?;
        match rx.recv_timeout(limit) {
            Ok(v) => Ok(v),
            Err(mpsc::RecvTimeoutError::Timeout) => Err(DriverCkptError::DeadlineExceeded {
                call,
                pid,
                after: limit,
            }),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(DriverCkptError::Thread {
                call,
                pid,
                reason: "the call's thread ended without an answer".into(),
            }),
        }
    }

    /// The target's state (`cuCheckpointProcessGetState`), within the short deadline.
    pub fn state(&self, pid: i32) -> Result<ProcessState, DriverCkptError> {
        const CALL: &str = "cuCheckpointProcessGetState";
        let get_state = self.get_state;
        let (r, v) = Self::bounded(CALL, pid, self.short, move || {
            let mut v: c_int = 0;
            // SAFETY: `v` is a valid out-pointer to an `int`-sized local that outlives the call;
            // the function pointer stays valid (the library is never unloaded).
            let r = unsafe { get_state(pid, &mut v) };
            (r, v)
        })?;
        self.check(CALL, pid, r)?;
        Ok(ProcessState::from_raw(v))
    }

    /// Process `pid`'s own CUDA context, as the driver reports it ([`own_context`], the restore
    /// thread looked up in `/proc/PID/task`).
    pub fn own_context_of(&self, pid: i32) -> OwnContext {
        let code = |e: DriverCkptError| e.code().unwrap_or(-1);
        let state = self.state(pid).map_err(code);
        let tid = state
            .is_ok()
            .then(|| self.restore_thread_id(pid).map_err(code));
        own_context(state, tid, |t| {
            std::path::Path::new(&format!("/proc/{pid}/task/{t}")).exists()
        })
    }

    /// The thread id of the target's CUDA restore thread
    /// (`cuCheckpointProcessGetRestoreThreadId`), within the short deadline.
    pub fn restore_thread_id(&self, pid: i32) -> Result<i32, DriverCkptError> {
        const CALL: &str = "cuCheckpointProcessGetRestoreThreadId";
        let get = self.get_restore_thread_id;
        let (r, tid) = Self::bounded(CALL, pid, self.short, move || {
            let mut tid: c_int = 0;
            // SAFETY: `tid` is a valid out-pointer to a local `int` that outlives the call; the
            // function pointer stays valid (the library is never unloaded).
            let r = unsafe { get(pid, &mut tid) };
            (r, tid)
        })?;
        self.check(CALL, pid, r)?;
        Ok(tid)
    }

    /// Blocks further CUDA calls of `pid` and waits for its submitted work; `timeout_ms` 0 = no
    /// timeout. RUNNING → LOCKED; on a timeout the target stays RUNNING and this is
    /// [`DriverCkptError::LockTimeout`]. possum waits for the call `timeout_ms` plus the short
    /// deadline.
    pub fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), DriverCkptError> {
        const CALL: &str = "cuCheckpointProcessLock";
        let lock = self.lock;
        let limit = self
            .short
            .saturating_add(Duration::from_millis(u64::from(timeout_ms)));
        let r = Self::bounded(CALL, pid, limit, move || {
            let mut args = LockArgs {
                timeout_ms,
                reserved0: 0,
                reserved1: [0; 7],
            };
            // SAFETY: `args` is a valid, fully initialised `CUcheckpointLockArgs` that outlives
            // the call; the function pointer stays valid (the library is never unloaded).
            unsafe { lock(pid, &mut args) }
        })?;
        if r == CUDA_ERROR_NOT_READY && timeout_ms > 0 {
            return Err(DriverCkptError::LockTimeout { pid, timeout_ms });
        }
        self.check(CALL, pid, r)
    }

    /// Device memory of `pid` to (its) host memory, its GPU released. LOCKED → CHECKPOINTED.
    /// possum waits for the call at most `limit` (size it by the process's GPU memory).
    pub fn checkpoint(&self, pid: i32, limit: Duration) -> Result<(), DriverCkptError> {
        const CALL: &str = "cuCheckpointProcessCheckpoint";
        let checkpoint = self.checkpoint;
        let r = Self::bounded(CALL, pid, limit, move || {
            let mut args = CheckpointArgs { reserved: [0; 8] };
            // SAFETY: `args` is a valid, zeroed `CUcheckpointCheckpointArgs` that outlives the
            // call; the function pointer stays valid (the library is never unloaded).
            unsafe { checkpoint(pid, &mut args) }
        })?;
        self.check(CALL, pid, r)
    }

    /// Back onto the GPU(s). CHECKPOINTED → LOCKED. possum waits for the call at most `limit`
    /// (size it by the process's GPU memory).
    ///
    /// `gpu_pairs` remaps GPUs, as (old UUID, new UUID) pairs (`CUcheckpointRestoreArgs::gpuPairs`,
    /// CUDA 13.0; the new GPU must be of the same chip type and have enough memory); empty means
    /// each GPU is restored onto itself. A driver older than CUDA 13.0 (580) has no such field and
    /// is expected to refuse non-empty pairs.
    pub fn restore(
        &self,
        pid: i32,
        gpu_pairs: &[([u8; 16], [u8; 16])],
        limit: Duration,
    ) -> Result<(), DriverCkptError> {
        const CALL: &str = "cuCheckpointProcessRestore";
        let mut pairs: Vec<GpuPair> = gpu_pairs
            .iter()
            .map(|&(old_uuid, new_uuid)| GpuPair { old_uuid, new_uuid })
            .collect();
        let count = c_uint::try_from(pairs.len()).map_err(|_| DriverCkptError::Call {
            call: CALL,
            pid,
            code: 1,
            text: format!("{} GPU pairs do not fit in an unsigned int", pairs.len()),
        })?;
        let restore = self.restore;
        let r = Self::bounded(CALL, pid, limit, move || {
            let mut args = RestoreArgs {
                gpu_pairs: if pairs.is_empty() {
                    ptr::null_mut()
                } else {
                    pairs.as_mut_ptr()
                },
                gpu_pairs_count: count,
                reserved: [0; 52 - size_of::<*mut GpuPair>()],
                reserved1: 0,
            };
            // SAFETY: `args` is a valid `CUcheckpointRestoreArgs`, zeroed but for the pairs,
            // which point at `count` initialised `CUcheckpointGpuPair`s in `pairs`; both are
            // owned by this closure and outlive the call; the function pointer stays valid (the
            // library is never unloaded).
            unsafe { restore(pid, &mut args) }
        })?;
        self.check(CALL, pid, r)
    }

    /// Lets `pid`'s CUDA calls proceed. LOCKED → RUNNING. Within the short deadline.
    pub fn unlock(&self, pid: i32) -> Result<(), DriverCkptError> {
        const CALL: &str = "cuCheckpointProcessUnlock";
        let unlock = self.unlock;
        let r = Self::bounded(CALL, pid, self.short, move || {
            let mut args = UnlockArgs { reserved: [0; 8] };
            // SAFETY: `args` is a valid, zeroed `CUcheckpointUnlockArgs` that outlives the call;
            // the function pointer stays valid (the library is never unloaded).
            unsafe { unlock(pid, &mut args) }
        })?;
        self.check(CALL, pid, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_and_codes_are_named() {
        assert_eq!(ProcessState::from_raw(0), ProcessState::Running);
        assert_eq!(ProcessState::from_raw(2), ProcessState::Checkpointed);
        assert_eq!(ProcessState::from_raw(5), ProcessState::Other(5));
        assert_eq!(ProcessState::Locked.to_string(), "locked");
        let e = DriverCkptError::Call {
            call: "cuCheckpointProcessLock",
            pid: 42,
            code: 401,
            text: "illegal state".into(),
        };
        assert_eq!(
            e.to_string(),
            "cuCheckpointProcessLock for pid 42 failed: illegal state \
             (CUDA_ERROR_ILLEGAL_STATE, CUresult 401)"
        );
        assert_eq!(e.code(), Some(401));
    }

    #[test]
    fn a_deadline_names_the_call_the_pid_and_the_time() {
        let e = DriverCkptError::DeadlineExceeded {
            call: "cuCheckpointProcessRestore",
            pid: 7,
            after: Duration::from_secs(150),
        };
        assert_eq!(
            e.to_string(),
            "cuCheckpointProcessRestore for pid 7 did not return within 150 s: possum stopped \
             waiting for the driver"
        );
        assert_eq!(e.code(), None);
        assert_eq!(seconds(Duration::from_millis(1500)), "1.500 s");
    }

    #[test]
    fn a_missing_library_is_a_load_error() {
        match DriverCheckpoint::load_from("/nonexistent/libcuda.so.1") {
            Err(DriverCkptError::Load { lib, reason }) => {
                assert_eq!(lib, "/nonexistent/libcuda.so.1");
                assert!(reason.contains("No such file"), "{reason}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
