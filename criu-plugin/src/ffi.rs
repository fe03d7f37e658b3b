//! The C ABI CRIU 4.x loads: the `CR_PLUGIN_DESC` descriptor, the hook functions, and CRIU's
//! log. All of this crate's `unsafe` is here.
//!
//! Layout read from CRIU's `criu/include/criu-plugin.h` and loader from `criu/plugin.c` /
//! `criu/include/plugin.h` (checkpoint-restore/criu); the values this plugin declares
//! (`version`, `max_hooks`) are the ones CRIU 4.1.1 accepts, and CRIU 4.2 (Debian's 4.2.1-1,
//! what `scripts/install-criu.sh` installs; plugin interface 0.3.0, 17 hooks) accepts them too:
//! see [`CRIU_PLUGIN_VERSION`] and [`CR_PLUGIN_HOOK_MAX`].
//!
//! CRIU's loader (`cr_lib_load`): `dlopen(path, RTLD_LAZY)` every `*.so` in `--libdir` (or
//! `$CRIU_LIBS_DIR`, else `/usr/lib/criu/`), `dlsym(h, "CR_PLUGIN_DESC")`, reject the plugin
//! ("Corrupted plugin") when `version > CRIU_PLUGIN_VERSION` or `max_hooks > CR_PLUGIN_HOOK__MAX`,
//! call `init(stage)` (non-zero fails the whole dump/restore), then chain every non-null
//! `hooks[i]` for `i < max_hooks`. `run_plugins(HOOK, ...)` starts from `-ENOTSUP`, calls each
//! chained plugin's hook in load order, goes on to the next plugin while a hook returns
//! `-ENOTSUP` and stops at the first other value, which it returns: `-ENOTSUP` is "not mine".
//! At the end CRIU calls `exit(stage, ret)` and `dlclose`s the plugin.
//!
//! Where CRIU 4.1.1 calls the hooks this plugin sets (`criu/seize.c`, `criu/proc_parse.c`,
//! `criu/files-ext.c`, `criu/files-reg.c`):
//!
//! - `PAUSE_DEVICES(pid)`: while seizing the tree, once per process, just before CRIU interrupts
//!   it (the root first, then each child as it is found); a result other than 0 or `-ENOTSUP`
//!   fails the dump. (Then `CHECKPOINT_DEVICES(pid)` once per process, which this plugin does not
//!   set.)
//! - `HANDLE_DEVICE_VMA(fd, stat)`: while parsing a process's `/proc/PID/smaps`, for a mapping of
//!   a file that is neither regular nor `/dev/zero`, unless the mapping right before it is of the
//!   same file (it then borrows that one's verdict); `fd` is an `O_PATH` descriptor of the file
//!   opened through `/proc/PID/map_files`. 0 claims it: CRIU marks the VMA `VMA_EXT_PLUGIN` and
//!   dumps it as a file mapping (a `reg-file` entry naming the device, a fresh id for every
//!   mapping, since `fd_id_generate_special` does not share ids of mapped devices) without its
//!   contents when it is shared.
//! - `DUMP_EXT_FILE(fd, id)`: for an open descriptor CRIU cannot dump itself (a character device
//!   of an unknown major lands in `dump_unsupp_fd`); 0 claims it as external file `id`.
//! - `RESTORE_EXT_FILE(id)`: in the restored process, while its descriptors are restored; returns
//!   the descriptor.
//! - `UPDATE_VMA_MAP(path, addr, old_pgoff, &new_pgoff, &plugin_fd)`: in the restored process,
//!   when it opens the file of a `VMA_EXT_PLUGIN` mapping (`open_filemap`), before the restorer
//!   maps it: a `plugin_fd >= 0` is used instead of opening `path` (and closed by the restorer
//!   once mapped), a return of 1 replaces the offset with `new_pgoff`. The restorer then maps it
//!   `MAP_FIXED` with the dumped protection and flags: the plugin API lets a plugin choose the
//!   file and the offset, not the protection.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::fs::File;
use std::io::{Read as _, Write as _};
use std::os::fd::{AsRawFd as _, FromRawFd as _, IntoRawFd as _, OwnedFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{mpsc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use nix::fcntl::{fcntl, FcntlArg, OFlag, SealFlag};
use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use nix::sys::stat::Mode;
use possum_control::EnvConfig;

use crate::live::{self, JobSocket, Live};
use crate::record::{Record, Records, RECORD_FILE};
pub use crate::restore_thread::RestoreThreadError;
use crate::{
    decide_pause, libcuda_candidates, maps, placeholder_name, restore_claims_vma, stage_name,
    Claim, CudaContext, Devices, PauseDecision, Usage, LOG_PREFIX, STATE,
};
use possum_cuda::checkpoint::{DriverCheckpoint, DriverCkptError};

/// `CRIU_PLUGIN_GEN_VERSION(a, b, c)`: `((a) << 16) + ((b) << 8) + (c)`.
pub const fn criu_plugin_gen_version(a: c_uint, b: c_uint, c: c_uint) -> c_uint {
    (a << 16) + (b << 8) + c
}

/// The plugin interface version this plugin declares: `CRIU_PLUGIN_VERSION` of CRIU 4.1
/// (`CRIU_PLUGIN_VERSION_MAJOR 0`, `_MINOR 2`, `_SUBLEVEL 0`). CRIU rejects a plugin whose version
/// is greater than its own, and accepts older ones (down to `CRIU_PLUGIN_VERSION_OLD`, 0.1.0,
/// the pre-descriptor plugins).
pub const CRIU_PLUGIN_VERSION: c_uint = criu_plugin_gen_version(0, 2, 0);

// The hook points: `enum { CR_PLUGIN_HOOK__DUMP_UNIX_SK = 0, ... CR_PLUGIN_HOOK__MAX }`, the
// indices into `cr_plugin_desc_t::hooks`, with the `DECLARE_PLUGIN_HOOK_ARGS` signatures.
/// `int (int fd, int id)`
pub const CR_PLUGIN_HOOK_DUMP_UNIX_SK: usize = 0;
/// `int (int id)`
pub const CR_PLUGIN_HOOK_RESTORE_UNIX_SK: usize = 1;
/// `int (int fd, int id)`: an fd of a type CRIU cannot dump itself (`dump_unsupp_fd`).
pub const CR_PLUGIN_HOOK_DUMP_EXT_FILE: usize = 2;
/// `int (int id)` in CRIU 4.1.1 (newer CRIU adds a `bool *retry_needed`, which this plugin never
/// sets): returns the restored descriptor.
pub const CR_PLUGIN_HOOK_RESTORE_EXT_FILE: usize = 3;
/// `int (char *mountpoint, int id)`
pub const CR_PLUGIN_HOOK_DUMP_EXT_MOUNT: usize = 4;
/// `int (int id, char *mountpoint, char *old_root, int *is_file)`
pub const CR_PLUGIN_HOOK_RESTORE_EXT_MOUNT: usize = 5;
/// `int (int index, int type, char *kind)`
pub const CR_PLUGIN_HOOK_DUMP_EXT_LINK: usize = 6;
/// `int (int fd, const struct stat *stat)`: a mapping of a character device CRIU does not
/// know (`handle_vma_plugin` in `proc_parse.c`); `fd` is the mapped file, opened through
/// `/proc/PID/map_files`.
pub const CR_PLUGIN_HOOK_HANDLE_DEVICE_VMA: usize = 7;
/// `int (const char *path, const uint64_t addr, const uint64_t old_pgoff, uint64_t *new_pgoff,
/// int *plugin_fd)`: the file of a claimed mapping, at restore.
pub const CR_PLUGIN_HOOK_UPDATE_VMA_MAP: usize = 8;
/// `int (int pid)`
pub const CR_PLUGIN_HOOK_RESUME_DEVICES_LATE: usize = 9;
/// `int (int pid)`
pub const CR_PLUGIN_HOOK_PAUSE_DEVICES: usize = 10;
/// `int (int pid)`
pub const CR_PLUGIN_HOOK_CHECKPOINT_DEVICES: usize = 11;
/// `CR_PLUGIN_HOOK__MAX` of CRIU 4.1.1: the length of the `hooks` array and this plugin's
/// `max_hooks`. CRIU 4.1.1 says so itself: a probe plugin declaring 255 hooks was rejected with
/// "Plugin probe has 255 assigned while max 12 supported" (and one declaring version 0xffffff
/// with "... while max 200 supported"), and its built-in list of pre-descriptor hook names ends
/// at `cr_plugin_checkpoint_devices`. Newer CRIU sources append hooks after these
/// (`POST_FORKING = 12`, `RESTORE_INIT`, `DUMP_DEVICES_LATE`, `UPDATE_INETSK`, `DUMP_FINISH`)
/// without renumbering, and accept a plugin declaring fewer, so this layout also loads there.
pub const CR_PLUGIN_HOOK_MAX: usize = 12;

pub use crate::stage::{CR_PLUGIN_STAGE_DUMP, CR_PLUGIN_STAGE_PRE_DUMP, CR_PLUGIN_STAGE_RESTORE};

/// `cr_plugin_desc_t`:
///
/// ```c
/// typedef struct {
///     const char *name;
///     int (*init)(int stage);
///     void (*exit)(int stage, int ret);
///     unsigned int version;
///     unsigned int max_hooks;
///     void *hooks[CR_PLUGIN_HOOK__MAX];
/// } cr_plugin_desc_t;
/// ```
#[repr(C)]
#[derive(Debug)]
pub struct CrPluginDesc {
    /// `const char *name`
    pub name: *const c_char,
    /// `int (*init)(int stage)`: non-zero fails the dump/restore.
    pub init: Option<extern "C" fn(c_int) -> c_int>,
    /// `void (*exit)(int stage, int ret)`: `ret` is 0 when the dump/restore succeeded.
    pub exit: Option<extern "C" fn(c_int, c_int)>,
    /// `unsigned int version`
    pub version: c_uint,
    /// `unsigned int max_hooks`
    pub max_hooks: c_uint,
    /// `void *hooks[CR_PLUGIN_HOOK__MAX]`, indexed by the `CR_PLUGIN_HOOK__*` enum.
    pub hooks: [*const c_void; CR_PLUGIN_HOOK_MAX],
}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(
        size_of::<*const c_void>() == 8,
        "written for LP64 (x86_64, aarch64)"
    );
    assert!(offset_of!(CrPluginDesc, name) == 0);
    assert!(offset_of!(CrPluginDesc, init) == 8);
    assert!(offset_of!(CrPluginDesc, exit) == 16);
    assert!(offset_of!(CrPluginDesc, version) == 24);
    assert!(offset_of!(CrPluginDesc, max_hooks) == 28);
    assert!(offset_of!(CrPluginDesc, hooks) == 32);
    assert!(size_of::<CrPluginDesc>() == 32 + 8 * CR_PLUGIN_HOOK_MAX);
    assert!(size_of::<Option<extern "C" fn(c_int) -> c_int>>() == 8);
};

/// [`CrPluginDesc`] as a `static`: it holds raw pointers, which are not `Sync`.
#[repr(transparent)]
#[derive(Debug)]
pub struct Descriptor(pub CrPluginDesc);

// SAFETY: the descriptor is never written after it is built at compile time (CRIU only reads
// it), and every pointer in it is to static data (a C string literal) or to a function.
unsafe impl Sync for Descriptor {}

/// The symbol CRIU's loader looks up (`dlsym(h, "CR_PLUGIN_DESC")`).
#[no_mangle]
pub static CR_PLUGIN_DESC: Descriptor = Descriptor(CrPluginDesc {
    name: c"possum".as_ptr(),
    init: Some(plugin_init),
    exit: Some(plugin_exit),
    version: CRIU_PLUGIN_VERSION,
    max_hooks: CR_PLUGIN_HOOK_MAX as c_uint,
    hooks: hooks(),
});

const fn hooks() -> [*const c_void; CR_PLUGIN_HOOK_MAX] {
    let mut h = [std::ptr::null(); CR_PLUGIN_HOOK_MAX];
    h[CR_PLUGIN_HOOK_DUMP_EXT_FILE] = dump_ext_file as *const c_void;
    h[CR_PLUGIN_HOOK_RESTORE_EXT_FILE] = restore_ext_file as *const c_void;
    h[CR_PLUGIN_HOOK_HANDLE_DEVICE_VMA] = handle_device_vma as *const c_void;
    h[CR_PLUGIN_HOOK_UPDATE_VMA_MAP] = update_vma_map as *const c_void;
    h[CR_PLUGIN_HOOK_PAUSE_DEVICES] = pause_devices as *const c_void;
    h[CR_PLUGIN_HOOK_RESUME_DEVICES_LATE] = resume_devices_late as *const c_void;
    h
}

/// CRIU's log levels (`criu-log.h`: `LOG_MSG 0`, `LOG_ERROR 1`, `LOG_WARN 2`, `LOG_INFO 3`,
/// `LOG_DEBUG 4`).
const LOG_ERROR: c_uint = 1;
const LOG_INFO: c_uint = 3;

/// `void print_on_level(unsigned int loglevel, const char *format, ...)`, exported by the criu
/// binary (`criu-log.h`); what plugins' `pr_info`/`pr_err` call.
type PrintOnLevel = unsafe extern "C" fn(c_uint, *const c_char, ...);

/// `int criu_get_image_dir(void)`, exported by the criu binary (`criu-plugin.h`): the images
/// directory's descriptor, in the dump process and in restored processes alike.
type GetImageDir = unsafe extern "C" fn() -> c_int;

/// A symbol of the criu binary, looked up in the process (it is not linked against: the plugin
/// must also load where there is no criu, e.g. in its own tests).
fn criu_symbol(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads.
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!sym.is_null()).then_some(sym)
}

/// CRIU's `print_on_level`.
fn criu_print() -> Option<PrintOnLevel> {
    static PRINT: OnceLock<Option<PrintOnLevel>> = OnceLock::new();
    *PRINT.get_or_init(|| {
        // SAFETY: the criu binary's `print_on_level` has this signature (criu-log.h).
        criu_symbol(c"print_on_level")
            .map(|s| unsafe { std::mem::transmute::<*mut c_void, PrintOnLevel>(s) })
    })
}

/// The images directory, borrowed from CRIU (`None` outside criu).
fn image_dir() -> Option<RawFd> {
    // SAFETY: the criu binary's `criu_get_image_dir` has this signature (criu-plugin.h).
    let get = criu_symbol(c"criu_get_image_dir")
        .map(|s| unsafe { std::mem::transmute::<*mut c_void, GetImageDir>(s) })?;
    // SAFETY: it takes no argument and returns a descriptor number (or -1).
    let fd = unsafe { get() };
    (fd >= 0).then_some(fd)
}

/// Why the plugin could not use CRIU's images directory.
#[derive(Debug, thiserror::Error)]
pub enum ImagesError {
    /// Outside criu, or CRIU gave none.
    #[error("no CRIU images directory (criu_get_image_dir)")]
    Missing,
    /// A file in it could not be opened.
    #[error("{name} in the images directory: {source}")]
    Open {
        /// The file.
        name: String,
        /// Why.
        source: nix::errno::Errno,
    },
    /// Its descriptor's path could not be read.
    #[error("the images directory's path: {0}")]
    Path(#[source] std::io::Error),
    /// The plugin's records could not be written.
    #[error("writing {RECORD_FILE}: {0}")]
    WriteRecords(#[source] std::io::Error),
}

/// Opens `name` in the images directory (`openat`).
fn open_in_image_dir(name: &str, flags: OFlag) -> Result<File, ImagesError> {
    let dir = image_dir().ok_or(ImagesError::Missing)?;
    let fd = nix::fcntl::openat(
        Some(dir),
        name,
        flags | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )
    .map_err(|source| ImagesError::Open {
        name: name.to_string(),
        source,
    })?;
    // SAFETY: openat just returned this descriptor, owned by nobody else.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Logs one line (which starts with [`LOG_PREFIX`]) to CRIU's log, or to stderr outside criu.
fn log(level: c_uint, line: &str) {
    match (criu_print(), CString::new(format!("{line}\n"))) {
        (Some(print), Ok(line)) => {
            // SAFETY: "%s" with one NUL-terminated string argument, as print_on_level expects.
            unsafe { print(level, c"%s".as_ptr(), line.as_ptr()) }
        }
        _ => eprintln!("{line}"),
    }
}

/// Runs `f`, turning a panic into `on_panic` (logged): nothing unwinds into CRIU.
fn guard<T>(what: &str, on_panic: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        log(
            LOG_ERROR,
            &format!("{LOG_PREFIX} internal error (panic) in {what}"),
        );
        on_panic
    })
}

/// The stage CRIU loaded the plugin for (`init`).
static STAGE: AtomicI32 = AtomicI32::new(-1);
/// Whether this dump has written its records yet (the first write truncates the file).
static RECORDS_STARTED: AtomicBool = AtomicBool::new(false);

/// `void set_compel_interrupt_only_mode(void)`, exported by the criu binary (CRIU 4.0 and newer,
/// `seize.c`): with `--freeze-cgroup`, CRIU then stops the tree's tasks one by one with ptrace
/// instead of freezing the cgroup first, so that `PAUSE_DEVICES` of every process runs while it
/// still runs (possum's release needs the job's control thread) and a CUDA restore thread can
/// be let run on its own while its process is stopped. NVIDIA's CRIU plugin sets it likewise.
type SetInterruptOnly = unsafe extern "C" fn();

/// Sets [`SetInterruptOnly`] when CRIU has it.
fn set_interrupt_only_mode() -> bool {
    let Some(sym) = criu_symbol(c"set_compel_interrupt_only_mode") else {
        return false;
    };
    // SAFETY: the criu binary's function has this signature; it only sets a flag.
    unsafe { std::mem::transmute::<*mut c_void, SetInterruptOnly>(sym)() };
    true
}

extern "C" fn plugin_init(stage: c_int) -> c_int {
    guard("init", -1, || {
        STAGE.store(stage, Ordering::Relaxed);
        // Only on a machine with NVIDIA GPUs: elsewhere CRIU freezes as it always does.
        if stage == CR_PLUGIN_STAGE_DUMP
            && Path::new("/proc/driver/nvidia/gpus").is_dir()
            && set_interrupt_only_mode()
        {
            log(
                LOG_INFO,
                &format!(
                    "{LOG_PREFIX} CRIU stops the tree's tasks one by one (interrupt-only mode)"
                ),
            );
        }
        if stage == CR_PLUGIN_STAGE_RESTORE {
            claim_inventory_entry();
        }
        log(
            LOG_INFO,
            &format!(
                "{LOG_PREFIX} init (stage {}, plugin {})",
                stage_name(stage),
                env!("CARGO_PKG_VERSION")
            ),
        );
        0
    })
}

/// `bool check_and_remove_inventory_plugin(const char *name, size_t n)`, exported by CRIU 4.x
/// (`image.h`).
type CheckInventoryPlugin = unsafe extern "C" fn(*const c_char, usize) -> bool;

/// Takes possum off the list of plugins the images require (CRIU 4.x fails a restore whose
/// inventory names a plugin no loaded plugin claimed: `Missing required plugin: possum`).
/// `possum checkpoint` puts it there when it moves memory out of CRIU's images
/// (`possum_criu::hostmem`), which only this plugin writes back.
fn claim_inventory_entry() {
    let Some(sym) = criu_symbol(c"check_and_remove_inventory_plugin") else {
        return; // a CRIU without required plugins
    };
    // SAFETY: CRIU 4.x's `check_and_remove_inventory_plugin` has this signature (image.h).
    let check = unsafe { std::mem::transmute::<*mut c_void, CheckInventoryPlugin>(sym) };
    let name = CR_PLUGIN_DESC.0.name;
    // SAFETY: `name` is our descriptor's NUL-terminated static name; CRIU compares `n` bytes.
    let listed = unsafe { check(name, CStr::from_ptr(name).to_bytes().len()) };
    if listed {
        log(
            LOG_INFO,
            &format!("{LOG_PREFIX} the images require this plugin (possum's host memory)"),
        );
    }
}

extern "C" fn plugin_exit(stage: c_int, ret: c_int) {
    guard("exit", (), || {
        if stage == CR_PLUGIN_STAGE_DUMP {
            resume_after_dump(ret);
        }
        let s = STATE.lock().unwrap_or_else(PoisonError::into_inner);
        let claimed = if stage == CR_PLUGIN_STAGE_RESTORE {
            String::new()
        } else {
            format!(", claimed {} mappings and {} open files", s.vmas, s.files)
        };
        log(
            LOG_INFO,
            &format!(
                "{LOG_PREFIX} exit (stage {}, ret {ret}{claimed})",
                stage_name(stage)
            ),
        );
    })
}

/// The file `fd` refers to, as `/proc/self/fd` names it.
fn fd_path(fd: RawFd) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()
}

/// The major number of `st_rdev` (glibc's `gnu_dev_major`) when `st_mode` is a character device.
fn char_major(mode: libc::mode_t, rdev: libc::dev_t) -> Option<u32> {
    let is_chr = mode & libc::S_IFMT == libc::S_IFCHR;
    #[allow(clippy::cast_possible_truncation)]
    let major = (((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff)) as u32;
    is_chr.then_some(major)
}

/// How long the plugin waits for the NVIDIA driver's answer about one process (the first
/// question includes loading libcuda and `cuInit`).
const PROBE_TIMEOUT: Duration = Duration::from_secs(20);

/// possum-cuda's binding of the driver's checkpoint API, from the first of
/// [`libcuda_candidates`] that loads (`cuInit(0)` run), once, never unloaded.
fn libcuda() -> Result<&'static DriverCheckpoint, &'static LibcudaError> {
    static CUDA: OnceLock<Result<DriverCheckpoint, LibcudaError>> = OnceLock::new();
    CUDA.get_or_init(|| {
        let candidates = libcuda_candidates(
            crate::config::Config::from_env()
                .libcuda
                .map(std::path::PathBuf::into_os_string),
            std::env::var_os("LD_LIBRARY_PATH"),
        );
        let mut errors = Vec::new();
        for name in &candidates {
            match DriverCheckpoint::load_from(&name.to_string_lossy()) {
                Ok(d) => return Ok(d),
                // Not there: the next candidate. Anything else (no checkpoint API, `cuInit`
                // failing) is the answer.
                Err(e @ DriverCkptError::Load { .. }) => errors.push(e.to_string()),
                Err(e) => return Err(LibcudaError::Driver(e)),
            }
        }
        Err(LibcudaError::NotLoaded {
            tried: errors.join("; "),
        })
    })
    .as_ref()
}

/// Why NVIDIA's checkpoint API is not there for the plugin.
#[derive(Debug, thiserror::Error)]
pub enum LibcudaError {
    /// No candidate library loaded.
    #[error("cannot load NVIDIA's libcuda.so.1 (set POSSUM_LIBCUDA): {tried}")]
    NotLoaded {
        /// Each candidate's failure, `; `-separated.
        tried: String,
    },
    /// A library loaded, but its checkpoint API is missing or `cuInit` failed.
    #[error(transparent)]
    Driver(DriverCkptError),
}

/// Why a hook could not checkpoint or bring back a CUDA process.
#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    /// CRIU's images directory.
    #[error(transparent)]
    Images(#[from] ImagesError),
    /// NVIDIA's checkpoint API.
    #[error(transparent)]
    Libcuda(#[from] &'static LibcudaError),
    /// The checkpoint's steps.
    #[error(transparent)]
    Checkpoint(#[from] live::CheckpointError),
    /// Bringing the process back.
    #[error(transparent)]
    Resume(#[from] live::ResumeError),
    /// A restored process possum was loaded in has no control socket.
    #[error("the restored process has no possum control socket")]
    NoSocket,
}

/// What the NVIDIA driver says about `pid`'s CUDA context.
fn ask_driver(pid: i32) -> CudaContext {
    match libcuda() {
        Ok(cuda) => cuda.own_context_of(pid).into(),
        Err(e) => CudaContext::Unknown(e.to_string()),
    }
}

/// [`ask_driver`] on a thread of its own, given up after [`PROBE_TIMEOUT`].
fn probe_cuda_context(pid: i32) -> CudaContext {
    let (tx, rx) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("possum-cu-probe".into())
        .spawn(move || {
            let _ = tx.send(ask_driver(pid));
        });
    if let Err(e) = spawned {
        return CudaContext::Unknown(format!("cannot start a thread to ask the driver: {e}"));
    }
    rx.recv_timeout(PROBE_TIMEOUT).unwrap_or_else(|_| {
        CudaContext::Unknown(format!(
            "the NVIDIA driver did not answer cuCheckpointProcessGetState within {PROBE_TIMEOUT:?}"
        ))
    })
}

/// `CR_PLUGIN_HOOK__PAUSE_DEVICES`: `int (int pid)`.
extern "C" fn pause_devices(pid: c_int) -> c_int {
    guard("pause_devices", -libc::EFAULT, || {
        let devices = Devices::from_env();
        let usage = Usage::scan(pid, &devices);
        let socket = JobSocket::find(pid);
        let stage = STAGE.load(Ordering::Relaxed);
        let decision = decide_pause(&usage, &devices, socket.is_some(), stage, || {
            probe_cuda_context(pid)
        });
        let ret = match &decision {
            PauseDecision::NotMine => -libc::ENOTSUP,
            PauseDecision::Claim(why) => {
                log(
                    LOG_INFO,
                    &format!(
                        "{LOG_PREFIX} pid {pid}: uses {}; claiming them ({why})",
                        usage.summary()
                    ),
                );
                // Other plugins may still want the process: not "handled".
                -libc::ENOTSUP
            }
            PauseDecision::Checkpoint => checkpoint_live(pid, socket),
            PauseDecision::Refuse(msg) => {
                log(LOG_ERROR, msg);
                -libc::EPERM
            }
        };
        STATE
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .paused(usage, &decision);
        ret
    })
}

/// The CUDA processes this dump checkpointed, to bring back at its end when the tree runs on.
static LIVE: Mutex<Vec<Live>> = Mutex::new(Vec::new());

/// CRIU's images directory, as a path (the job writes and reads its GPU image there).
fn image_dir_path() -> Result<PathBuf, ImagesError> {
    let fd = image_dir().ok_or(ImagesError::Missing)?;
    std::fs::read_link(format!("/proc/self/fd/{fd}")).map_err(ImagesError::Path)
}

/// [`live::checkpoint`] of `pid`, with CRIU's freezing timer stopped meanwhile (a pre-copy of
/// many GiB would outlast `--timeout`, whose alarm ends CRIU without undoing anything): 0, or a
/// negative errno after logging why.
fn checkpoint_live(pid: i32, socket: Option<JobSocket>) -> c_int {
    let t = std::time::Instant::now();
    let r = (|| -> Result<Live, LiveError> {
        let images = image_dir_path()?;
        let cuda = libcuda()?;
        let left = nix::unistd::alarm::cancel();
        let r = live::checkpoint(pid, &images, socket, cuda);
        if let Some(secs) = left {
            nix::unistd::alarm::set(secs);
        }
        Ok(r?)
    })();
    match r {
        Ok(l) => {
            log(
                LOG_INFO,
                &format!(
                    "{LOG_PREFIX} pid {pid}: checkpointed its CUDA context in {:.0} ms: {}",
                    t.elapsed().as_secs_f64() * 1e3,
                    l.describe()
                ),
            );
            let gpu_dir = l
                .possum
                .as_ref()
                .and_then(|p| p.dir.file_name())
                .map(|n| n.to_string_lossy().into_owned());
            LIVE.lock().unwrap_or_else(PoisonError::into_inner).push(l);
            match write_records(&[Record::Cuda { pid, gpu_dir }]) {
                Ok(()) => 0,
                Err(e) => {
                    log(LOG_ERROR, &format!("{LOG_PREFIX} {e}"));
                    -libc::EIO
                }
            }
        }
        Err(e) => {
            log(
                LOG_ERROR,
                &format!("{LOG_PREFIX} cannot checkpoint pid {pid}'s CUDA context: {e}"),
            );
            -libc::EPERM
        }
    }
}

/// At the end of a dump: the processes this plugin checkpointed are brought back when the tree
/// runs on (the dump failed, or `--leave-running`; from CRIU's RPC the plugin cannot tell, and
/// brings them back: a tree CRIU then kills loses nothing by it).
fn resume_after_dump(ret: c_int) {
    let lives = std::mem::take(&mut *LIVE.lock().unwrap_or_else(PoisonError::into_inner));
    if lives.is_empty() {
        return;
    }
    let cmdline = std::fs::read("/proc/self/cmdline").unwrap_or_default();
    if ret == 0 && live::leave_running_from_cmdline(&cmdline) == Some(false) {
        log(
            LOG_INFO,
            &format!(
                "{LOG_PREFIX} {} CUDA process(es) left checkpointed: CRIU ends the tree",
                lives.len()
            ),
        );
        return;
    }
    for l in &lives {
        resume_stopped(l);
    }
}

/// [`live::resume`] of a process CRIU holds stopped: its CUDA restore thread is let run for the
/// driver's calls. 0, or -1 after logging why.
fn resume_stopped(l: &Live) -> c_int {
    let r = (|| -> Result<String, LiveError> {
        let cuda = libcuda()?;
        let tid = cuda.restore_thread_id(l.pid).unwrap_or(l.pid);
        Ok(live::resume(l, cuda, &mut |f| with_thread_running(tid, f))?)
    })();
    match r {
        Ok(line) => {
            log(LOG_INFO, &line);
            0
        }
        Err(e) => {
            log(
                LOG_ERROR,
                &format!("{LOG_PREFIX} bringing back pid {}: {e}", l.pid),
            );
            -1
        }
    }
}

/// `CR_PLUGIN_HOOK__RESUME_DEVICES_LATE`: `int (int pid)`, in `criu restore`'s main process,
/// with the restored tree still stopped: brings back a CUDA process the plugin checkpointed.
extern "C" fn resume_devices_late(pid: c_int) -> c_int {
    guard("resume_devices_late", -libc::EFAULT, || {
        if let Err(e) = fill_host_memory(pid) {
            return e;
        }
        let records = restore_records();
        let Some(gpu_dir) = records.cuda(pid) else {
            return -libc::ENOTSUP;
        };
        let possum = match gpu_dir {
            None => None,
            Some(name) => {
                let found = (|| -> Result<live::PossumPart, LiveError> {
                    let images = image_dir_path()?;
                    let socket = JobSocket::find(pid).ok_or(LiveError::NoSocket)?;
                    Ok(live::PossumPart::new(socket, images.join(name)))
                })();
                match found {
                    Ok(p) => Some(p),
                    Err(e) => {
                        log(
                            LOG_ERROR,
                            &format!("{LOG_PREFIX} cannot bring back pid {pid}: {e}"),
                        );
                        return -1;
                    }
                }
            }
        };
        resume_stopped(&Live {
            pid,
            possum,
            steps: live::Steps::default(),
        })
    })
}

/// Writes back the memory `possum checkpoint` took out of CRIU's images of `pid`
/// (`possum_criu::hostmem`), while CRIU holds the process stopped, from several threads. A
/// process whose memory cannot be written back is killed: it must not run with memory missing.
fn fill_host_memory(pid: c_int) -> Result<(), c_int> {
    use possum_criu::hostmem;
    let images = image_dir_path().map_err(|e| {
        log(
            LOG_ERROR,
            &format!("{LOG_PREFIX} pid {pid}: cannot look for possum's host memory: {e}"),
        );
        -1
    })?;
    let image_pid = hostmem::namespace_pid(pid).unwrap_or(pid as u32);
    match hostmem::fill(&images, image_pid, pid, hostmem::default_threads()) {
        Ok(None) => Ok(()),
        Ok(Some(r)) => {
            log(LOG_INFO, &format!("{LOG_PREFIX} {}", r.log_line(pid)));
            Ok(())
        }
        Err(e) => {
            log(
                LOG_ERROR,
                &format!(
                    "{} pid {pid}: cannot restore the memory possum keeps beside CRIU's \
                     images: {e}; killing the process so that it does not run with memory \
                     missing",
                    possum_criu::PLUGIN_ERROR
                ),
            );
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            Err(-1)
        }
    }
}

/// Runs `f` while thread `tid`, stopped by CRIU (this process traces it), runs: NVIDIA's driver
/// restores a process through its own CUDA restore thread. The thread runs with every signal
/// but `SIGTRAP` blocked and no ptrace options, and is stopped again afterwards with CRIU's
/// options and its signal mask back. A thread this process does not trace (`ESRCH`) runs
/// already: `f` is just called.
fn with_thread_running(
    tid: i32,
    f: &mut dyn FnMut() -> Result<(), live::ResumeError>,
) -> Result<(), live::ResumeError> {
    use nix::errno::Errno;
    use nix::sys::ptrace;
    use nix::unistd::Pid;
    let pid = Pid::from_raw(tid);
    let sigmask = |req: libc::c_uint, mask: &mut u64| -> Result<(), Errno> {
        // SAFETY: PTRACE_{GET,SET}SIGMASK take the size of the kernel's sigset (8 bytes) as
        // `addr` and a pointer to one as `data`; `mask` is valid for reads and writes.
        let r = unsafe {
            libc::ptrace(
                req,
                tid,
                std::mem::size_of::<u64>(),
                std::ptr::from_mut(mask),
            )
        };
        Errno::result(r).map(drop)
    };
    let mut saved = 0u64;
    match sigmask(libc::PTRACE_GETSIGMASK, &mut saved) {
        Ok(()) => {}
        Err(Errno::ESRCH) => return f(),
        Err(source) => return Err(RestoreThreadError::Sigmask { tid, source }.into()),
    }
    let step = |what: &'static str, r: Result<(), Errno>| {
        r.map_err(|source| RestoreThreadError::LetRun { tid, what, source })
    };
    let mut block = !(1u64 << (libc::SIGTRAP - 1));
    step(
        "blocking its signals",
        sigmask(libc::PTRACE_SETSIGMASK, &mut block),
    )?;
    step(
        "clearing ptrace options",
        ptrace::setoptions(pid, ptrace::Options::empty()),
    )?;
    step("continuing it", ptrace::cont(pid, None))?;
    log(
        LOG_INFO,
        &format!("{LOG_PREFIX} CUDA's restore thread {tid} runs while CRIU holds its process"),
    );
    let out = f();
    // Stopped again, as CRIU left it.
    let stopped = ptrace::interrupt(pid).and_then(|()| loop {
        match nix::sys::wait::waitpid(pid, Some(nix::sys::wait::WaitPidFlag::__WALL))? {
            nix::sys::wait::WaitStatus::Exited(..) | nix::sys::wait::WaitStatus::Signaled(..) => {
                break Err(Errno::ESRCH)
            }
            nix::sys::wait::WaitStatus::Stopped(..)
            | nix::sys::wait::WaitStatus::PtraceEvent(..)
            | nix::sys::wait::WaitStatus::PtraceSyscall(..) => break Ok(()),
            _ => continue,
        }
    });
    let back = stopped
        .and_then(|()| {
            ptrace::setoptions(
                pid,
                ptrace::Options::from_bits_truncate(libc::PTRACE_O_SUSPEND_SECCOMP)
                    | ptrace::Options::PTRACE_O_TRACESYSGOOD,
            )
        })
        .and_then(|()| sigmask(libc::PTRACE_SETSIGMASK, &mut saved));
    let back = back.map_err(|source| RestoreThreadError::StopAgain { tid, source }.into());
    out.and(back)
}

/// Appends `records` to the images' [`RECORD_FILE`] (truncated by the first write of a dump).
fn write_records(records: &[crate::record::Record]) -> Result<(), ImagesError> {
    if records.is_empty() || STAGE.load(Ordering::Relaxed) != CR_PLUGIN_STAGE_DUMP {
        return Ok(());
    }
    let first = !RECORDS_STARTED.swap(true, Ordering::Relaxed);
    let mut flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_APPEND;
    if first {
        flags |= OFlag::O_TRUNC;
    }
    let mut f = open_in_image_dir(RECORD_FILE, flags)?;
    let mut text = String::new();
    if first {
        text.push_str(
            "# possum-criu-plugin: claimed NVIDIA mappings and files (criu-plugin/README.md)\n",
        );
    }
    for r in records {
        text.push_str(&format!("{r}\n"));
    }
    f.write_all(text.as_bytes())
        .map_err(ImagesError::WriteRecords)
}

/// Logs a claim's lines and writes its records: 0, or a negative errno.
fn finish(claim: Claim) -> c_int {
    match claim {
        Claim::Claimed { lines, records } => {
            for l in &lines {
                log(LOG_INFO, l);
            }
            match write_records(&records) {
                Ok(()) => 0,
                Err(e) => {
                    log(LOG_ERROR, &format!("{LOG_PREFIX} {e}"));
                    -libc::EIO
                }
            }
        }
        Claim::Refused(msg) => {
            log(LOG_ERROR, &msg);
            -libc::EPERM
        }
    }
}

/// The targets of this process's descriptors.
fn own_links() -> Vec<PathBuf> {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .collect()
        })
        .unwrap_or_default()
}

/// `CR_PLUGIN_HOOK__HANDLE_DEVICE_VMA`: `int (int fd, const struct stat *stat)`.
///
/// # Safety
///
/// `stat` is null or points to a valid `struct stat` (CRIU passes the mapped file's).
unsafe extern "C" fn handle_device_vma(fd: c_int, stat: *const libc::stat) -> c_int {
    // SAFETY: per the contract, `stat` is null or valid for reads for this call.
    let st = unsafe { stat.as_ref() };
    let major = st.and_then(|s| char_major(s.st_mode, s.st_rdev));
    guard("handle_device_vma", -libc::EFAULT, || {
        let path = fd_path(fd);
        if Devices::from_env().kind(path.as_deref(), major).is_none() {
            return -libc::ENOTSUP;
        }
        let Some(path) = path.as_deref().and_then(Path::to_str) else {
            log(
                LOG_ERROR,
                &format!("{LOG_PREFIX} refusing a mapping of an NVIDIA device without a path"),
            );
            return -libc::EPERM;
        };
        let links = own_links();
        let pid = maps::pid_parsing_maps(links.iter().map(PathBuf::as_path));
        let claim = STATE
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .claim_vma(path, pid);
        finish(claim)
    })
}

/// `CR_PLUGIN_HOOK__DUMP_EXT_FILE`: `int (int fd, int id)`.
extern "C" fn dump_ext_file(fd: c_int, id: c_int) -> c_int {
    guard("dump_ext_file", -libc::EFAULT, || {
        let major = nix::sys::stat::fstat(fd)
            .ok()
            .and_then(|s| char_major(s.st_mode, s.st_rdev));
        let path = fd_path(fd);
        if Devices::from_env().kind(path.as_deref(), major).is_none() {
            return -libc::ENOTSUP;
        }
        let Some(path) = path else {
            return -libc::ENOTSUP;
        };
        #[allow(clippy::cast_sign_loss)]
        let claim = STATE
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .claim_file(&path, id as u32);
        finish(claim)
    })
}

/// The records of the dump being restored (empty when there are none).
fn restore_records() -> Records {
    let Ok(mut f) = open_in_image_dir(RECORD_FILE, OFlag::O_RDONLY) else {
        return Records::default();
    };
    let mut text = String::new();
    let _ = f.read_to_string(&mut text);
    Records::parse(&text)
}

/// An empty memfd named after `path` whose size is sealed at 0: a mapping of it raises `SIGBUS`
/// on any access; reading it gives end of file.
pub fn placeholder(path: &str, cloexec: bool) -> Result<OwnedFd, PlaceholderError> {
    let name = CString::new(placeholder_name(path)).map_err(PlaceholderError::Name)?;
    let mut flags = MemFdCreateFlag::MFD_ALLOW_SEALING;
    if cloexec {
        flags |= MemFdCreateFlag::MFD_CLOEXEC;
    }
    let fd = memfd_create(&name, flags).map_err(PlaceholderError::Create)?;
    fcntl(
        fd.as_raw_fd(),
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_SEAL,
        ),
    )
    .map_err(PlaceholderError::Seal)?;
    Ok(fd)
}

/// Why a placeholder memfd could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlaceholderError {
    /// The name has a NUL byte.
    #[error("the placeholder's name: {0}")]
    Name(#[source] std::ffi::NulError),
    /// `memfd_create` failed.
    #[error("memfd_create: {0}")]
    Create(#[source] nix::errno::Errno),
    /// Its size could not be sealed.
    #[error("sealing the placeholder: {0}")]
    Seal(#[source] nix::errno::Errno),
}

/// `CR_PLUGIN_HOOK__RESTORE_EXT_FILE`: `int (int id)`, in the restored process.
extern "C" fn restore_ext_file(id: c_int) -> c_int {
    guard("restore_ext_file", -libc::EFAULT, || {
        #[allow(clippy::cast_sign_loss)]
        let id = id as u32;
        let records = restore_records();
        let Some(path) = records.file(id) else {
            return -libc::ENOTSUP;
        };
        // The descriptor's own flags (close-on-exec) are CRIU's to restore.
        match placeholder(path, false) {
            Ok(fd) => {
                let fd = fd.into_raw_fd();
                log(
                    LOG_INFO,
                    &format!(
                        "{LOG_PREFIX} pid {}: open file {path} (id {id:#x}) restored as a \
                         placeholder memfd (fd {fd})",
                        std::process::id()
                    ),
                );
                fd
            }
            Err(e) => {
                log(LOG_ERROR, &format!("{LOG_PREFIX} restoring {path}: {e}"));
                -libc::EIO
            }
        }
    })
}

/// `CR_PLUGIN_HOOK__UPDATE_VMA_MAP`, in the restored process.
///
/// # Safety
///
/// `path` is a NUL-terminated string; `new_pgoff` and `plugin_fd` are valid for writes (CRIU
/// passes its locals' addresses).
unsafe extern "C" fn update_vma_map(
    path: *const c_char,
    addr: u64,
    _old_pgoff: u64,
    new_pgoff: *mut u64,
    plugin_fd: *mut c_int,
) -> c_int {
    if path.is_null() || new_pgoff.is_null() || plugin_fd.is_null() {
        return -libc::ENOTSUP;
    }
    // SAFETY: per the contract, `path` is a valid C string for this call.
    let path = unsafe { CStr::from_ptr(path) }
        .to_string_lossy()
        .into_owned();
    let answer = guard("update_vma_map", Err(-libc::EFAULT), || {
        if !restore_claims_vma(&path, &Devices::from_env(), &restore_records()) {
            return Err(-libc::ENOTSUP);
        }
        match placeholder(&path, true) {
            Ok(fd) => {
                let fd = fd.into_raw_fd();
                log(
                    LOG_INFO,
                    &format!(
                        "{LOG_PREFIX} pid {}: mapping at {addr:#x} of {path} restored from an \
                         empty memfd (fd {fd}): inaccessible, SIGBUS on access",
                        std::process::id()
                    ),
                );
                Ok(fd)
            }
            Err(e) => {
                log(
                    LOG_ERROR,
                    &format!("{LOG_PREFIX} restoring a mapping of {path}: {e}"),
                );
                Err(-libc::EIO)
            }
        }
    });
    match answer {
        Ok(fd) => {
            // SAFETY: per the contract, both pointers are valid for writes.
            unsafe {
                *new_pgoff = 0;
                *plugin_fd = fd;
            }
            // 1: "offset updated" (`open_filemap` then maps at `new_pgoff`).
            1
        }
        Err(e) => e,
    }
}

/// Calls the `HANDLE_DEVICE_VMA` hook on `file` as CRIU would (unit tests).
#[doc(hidden)]
pub fn handle_device_vma_for_test(file: &File) -> c_int {
    let st = nix::sys::stat::fstat(file.as_raw_fd()).expect("fstat");
    // SAFETY: `st` is a valid `struct stat` for the duration of the call.
    unsafe { handle_device_vma(file.as_raw_fd(), &st) }
}

/// Calls the `DUMP_EXT_FILE` hook on `file` as CRIU would (unit tests).
#[doc(hidden)]
pub fn dump_ext_file_for_test(file: &File) -> c_int {
    dump_ext_file(file.as_raw_fd(), 0)
}

/// Calls the `UPDATE_VMA_MAP` hook as CRIU would: `(result, new_pgoff, plugin_fd)` (unit tests).
#[doc(hidden)]
pub fn update_vma_map_for_test(path: &CStr, addr: u64, old_pgoff: u64) -> (c_int, u64, c_int) {
    let mut pgoff = old_pgoff;
    let mut fd: c_int = -1;
    // SAFETY: `path` is a C string; both out-pointers are to locals that outlive the call.
    let r = unsafe { update_vma_map(path.as_ptr(), addr, old_pgoff, &mut pgoff, &mut fd) };
    (r, pgoff, fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_declares_what_criu_4_1_accepts() {
        let d = &CR_PLUGIN_DESC.0;
        assert_eq!(d.version, 0x000200);
        assert_eq!(d.max_hooks, 12);
        let set: Vec<usize> = (0..CR_PLUGIN_HOOK_MAX)
            .filter(|&i| !d.hooks[i].is_null())
            .collect();
        assert_eq!(
            set,
            [
                CR_PLUGIN_HOOK_DUMP_EXT_FILE,
                CR_PLUGIN_HOOK_RESTORE_EXT_FILE,
                CR_PLUGIN_HOOK_HANDLE_DEVICE_VMA,
                CR_PLUGIN_HOOK_UPDATE_VMA_MAP,
                CR_PLUGIN_HOOK_RESUME_DEVICES_LATE,
                CR_PLUGIN_HOOK_PAUSE_DEVICES,
            ]
        );
        assert_eq!(plugin_init(CR_PLUGIN_STAGE_DUMP), 0);
        plugin_exit(CR_PLUGIN_STAGE_DUMP, 0);
    }

    #[test]
    fn char_major_decodes_glibc_dev_t() {
        assert_eq!(char_major(libc::S_IFCHR, (195 << 8) | 255), Some(195));
        assert_eq!(char_major(libc::S_IFCHR, (511u64 << 8) | 1), Some(511));
        assert_eq!(char_major(libc::S_IFREG, 195 << 8), None);
    }

    #[test]
    fn hooks_say_not_mine_for_other_files_and_processes() {
        let null = File::open("/dev/null").unwrap();
        assert_eq!(handle_device_vma_for_test(&null), -libc::ENOTSUP);
        assert_eq!(dump_ext_file_for_test(&null), -libc::ENOTSUP);
        let (r, pgoff, fd) = update_vma_map_for_test(c"/usr/lib/libc.so.6", 0x1000, 7);
        assert_eq!((r, pgoff, fd), (-libc::ENOTSUP, 7, -1));
        assert_eq!(restore_ext_file(12), -libc::ENOTSUP);
        // This test process maps no NVIDIA device.
        let me = i32::try_from(std::process::id()).unwrap();
        assert_eq!(pause_devices(me), -libc::ENOTSUP);
    }

    /// A claimed mapping is restored from an empty sealed memfd at offset 0: it maps (with a
    /// write permission too, as the restorer maps shared device mappings `rw-s`), and touching it
    /// raises SIGBUS.
    #[test]
    fn a_claimed_mapping_is_restored_as_a_sigbus_placeholder() {
        let (r, pgoff, fd) =
            update_vma_map_for_test(c"/dev/nvidia-uvm", 0x2_0060_0000, 0x2_0060_0000);
        assert_eq!((r, pgoff), (1, 0));
        assert!(fd >= 0);
        // SAFETY: the hook just created this descriptor and handed it over.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let link = fd_path(fd.as_raw_fd()).unwrap();
        assert!(
            link.to_str()
                .unwrap()
                .starts_with("/memfd:possum-placeholder:/dev/nvidia-uvm"),
            "{link:?}"
        );
        // The size is sealed at 0.
        assert!(nix::unistd::ftruncate(&fd, 4096).is_err());
        let len = 2 * 4096;
        // SAFETY: a fresh shared mapping of our own memfd, unmapped below; nothing else uses it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: fork in a test: the child only reads the mapping (which kills it) or _exits.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: reading our own mapping; the access is what raises SIGBUS.
            let v = unsafe { std::ptr::read_volatile(p.cast::<u8>()) };
            // SAFETY: _exit is async-signal-safe.
            unsafe { libc::_exit(i32::from(v) + 100) };
        }
        assert!(child > 0);
        let mut status = 0;
        // SAFETY: waiting for our own child into a local.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(libc::WIFSIGNALED(status), "status {status:#x}");
        assert_eq!(libc::WTERMSIG(status), libc::SIGBUS);
        // SAFETY: unmapping the mapping made above.
        assert_eq!(unsafe { libc::munmap(p, len) }, 0);
    }

    #[test]
    fn a_placeholder_descriptor_reads_as_empty() {
        let fd = placeholder("/dev/nvidiactl", false).unwrap();
        let mut f = File::from(fd);
        let mut buf = Vec::new();
        assert_eq!(f.read_to_end(&mut buf).unwrap(), 0);
        assert!(f.write_all(b"x").is_err(), "the size is sealed at 0");
    }
}
