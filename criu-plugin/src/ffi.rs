//! The C ABI CRIU 4.x loads: the `CR_PLUGIN_DESC` descriptor, the hook functions, and CRIU's
//! log. All of this crate's `unsafe` is here.
//!
//! Layout read from CRIU's `criu/include/criu-plugin.h` and loader from `criu/plugin.c` /
//! `criu/include/plugin.h` (checkpoint-restore/criu); the values this plugin declares
//! (`version`, `max_hooks`) are the ones CRIU 4.1.1 (Debian trixie's 4.1.1-1, what
//! `scripts/install-criu.sh` installs) accepts, see [`CRIU_PLUGIN_VERSION`] and
//! [`CR_PLUGIN_HOOK_MAX`].
//!
//! CRIU's loader (`cr_lib_load`): `dlopen(path, RTLD_LAZY)` every `*.so` in `--libdir` (or
//! `$CRIU_LIBS_DIR`, else `/usr/lib/criu/`), `dlsym(h, "CR_PLUGIN_DESC")`, reject the plugin
//! ("Corrupted plugin") when `version > CRIU_PLUGIN_VERSION` or `max_hooks > CR_PLUGIN_HOOK__MAX`,
//! call `init(stage)` (non-zero fails the whole dump/restore), then chain every non-null
//! `hooks[i]` for `i < max_hooks`. `run_plugins(HOOK, ...)` starts from `-ENOTSUP`, calls each
//! chained plugin's hook in load order, goes on to the next plugin while a hook returns
//! `-ENOTSUP` and stops at the first other value, which it returns: `-ENOTSUP` is "not mine".
//! At the end CRIU calls `exit(stage, ret)` and `dlclose`s the plugin.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::os::fd::{AsRawFd as _, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::{stage_name, verdict, Verdict, LOG_PREFIX};

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
/// `int (int id, bool *retry_needed)`
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
/// int *plugin_fd)`
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

/// `CR_PLUGIN_STAGE__DUMP`
pub const CR_PLUGIN_STAGE_DUMP: c_int = 0;
/// `CR_PLUGIN_STAGE__PRE_DUMP`
pub const CR_PLUGIN_STAGE_PRE_DUMP: c_int = 1;
/// `CR_PLUGIN_STAGE__RESTORE`
pub const CR_PLUGIN_STAGE_RESTORE: c_int = 2;

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
    h[CR_PLUGIN_HOOK_HANDLE_DEVICE_VMA] = handle_device_vma as *const c_void;
    h
}

/// CRIU's log levels (`criu-log.h`: `LOG_MSG 0`, `LOG_ERROR 1`, `LOG_WARN 2`, `LOG_INFO 3`,
/// `LOG_DEBUG 4`).
const LOG_ERROR: c_uint = 1;
const LOG_INFO: c_uint = 3;

/// `void print_on_level(unsigned int loglevel, const char *format, ...)`, exported by the criu
/// binary (`criu-log.h`); what plugins' `pr_info`/`pr_err` call.
type PrintOnLevel = unsafe extern "C" fn(c_uint, *const c_char, ...);

/// CRIU's `print_on_level`, looked up in the process (it is not linked against: the plugin
/// must also load, e.g. in its own tests, where there is no criu).
fn criu_print() -> Option<PrintOnLevel> {
    static PRINT: OnceLock<Option<PrintOnLevel>> = OnceLock::new();
    *PRINT.get_or_init(|| {
        // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads.
        let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"print_on_level".as_ptr()) };
        if sym.is_null() {
            None
        } else {
            // SAFETY: the criu binary's `print_on_level` has this signature (criu-log.h).
            Some(unsafe { std::mem::transmute::<*mut c_void, PrintOnLevel>(sym) })
        }
    })
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

extern "C" fn plugin_init(stage: c_int) -> c_int {
    guard("init", -1, || {
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

extern "C" fn plugin_exit(stage: c_int, ret: c_int) {
    guard("exit", (), || {
        log(
            LOG_INFO,
            &format!("{LOG_PREFIX} exit (stage {}, ret {ret})", stage_name(stage)),
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

fn decide(what: &str, fd: RawFd, major: Option<u32>) -> c_int {
    let path = fd_path(fd);
    let v = verdict(what, path.as_deref(), major, || {
        path.as_deref()
            .map(crate::traced_pids_using)
            .unwrap_or_default()
    });
    match v {
        Verdict::NotMine => -libc::ENOTSUP,
        Verdict::RefuseNvidia(msg) => {
            log(LOG_ERROR, &msg);
            -libc::ENODEV
        }
    }
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
        decide("a mapping", fd, major)
    })
}

/// `CR_PLUGIN_HOOK__DUMP_EXT_FILE`: `int (int fd, int id)`.
extern "C" fn dump_ext_file(fd: c_int, _id: c_int) -> c_int {
    guard("dump_ext_file", -libc::EFAULT, || {
        let major = nix::sys::stat::fstat(fd)
            .ok()
            .and_then(|s| char_major(s.st_mode, s.st_rdev));
        decide("an open file", fd, major)
    })
}

/// Calls the `HANDLE_DEVICE_VMA` hook on `file` as CRIU would (unit tests).
#[doc(hidden)]
pub fn handle_device_vma_for_test(file: &std::fs::File) -> c_int {
    let st = nix::sys::stat::fstat(file.as_raw_fd()).expect("fstat");
    // SAFETY: `st` is a valid `struct stat` for the duration of the call.
    unsafe { handle_device_vma(file.as_raw_fd(), &st) }
}

/// Calls the `DUMP_EXT_FILE` hook on `file` as CRIU would (unit tests).
#[doc(hidden)]
pub fn dump_ext_file_for_test(file: &std::fs::File) -> c_int {
    dump_ext_file(file.as_raw_fd(), 0)
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
                CR_PLUGIN_HOOK_HANDLE_DEVICE_VMA
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
}
