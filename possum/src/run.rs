//! `possum run`: start a job with libpossum.so preloaded and pass its exit status through.

use std::ffi::{OsStr, OsString};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use crate::config::{Config, KEEPER_ENV};
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::unistd::Pid;
use possum_control::EnvConfig;

const LIB_NAME: &str = "libpossum.so";

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Write the job's kernel/buffer trace at exit: JSON to FILE and DOT to FILE.dot (sets
    /// POSSUM_TRACE; libpossum.so writes them).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// libpossum.so to preload (default: $POSSUM_LIB, else next to the possum executable, else
    /// ../lib/ relative to it).
    #[arg(long, value_name = "PATH")]
    pub lib: Option<PathBuf>,
    /// Directory of the job's control socket (sets POSSUM_SOCKET_DIR; default $POSSUM_SOCKET_DIR,
    /// else /tmp/possum).
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
    /// Diagnostic: see the job's GPU operations through CUPTI's callbacks instead of the
    /// driver's entry points (sets POSSUM_HOOKS=cupti); the entry points then only count what
    /// they see, a cross-check of their coverage. NVIDIA's driver refuses to checkpoint a process
    /// CUPTI has subscribed in, so such a job can only be checkpointed with `possum checkpoint
    /// --gpu-only` or `--engine driver`.
    #[arg(long, conflicts_with = "hooks")]
    pub cupti: bool,
    /// How possum sees the job's GPU operations (sets POSSUM_HOOKS): `off` hooks nothing, so a
    /// checkpoint parks the job's threads and copies every buffer while they are parked (kept for
    /// measuring that fallback).
    #[arg(long, value_enum, value_name = "MODE", hide = true)]
    pub hooks: Option<Hooks>,
    /// Removed (possum no longer uses CUPTI by default); kept only to say so (`crate::parse`).
    #[arg(long, hide = true)]
    pub no_cupti: bool,
    /// Do not keep the job's GPU buffer memory in a keeper. By default `possum run` starts one
    /// for the job (ended with it; or uses the one $POSSUM_KEEPER names), so that a checkpoint
    /// that leaves the job running holds it only for the driver's checkpoint and CRIU, its
    /// buffers left on the GPU, and saves them while it runs on. The keeper's own CUDA context
    /// takes about 0.5 GiB of GPU memory.
    #[arg(long)]
    pub no_keeper: bool,
    /// The default (a keeper for the job); kept so that scripts that ask for it still run.
    #[arg(long, hide = true, conflicts_with = "no_keeper")]
    pub keeper: bool,
    /// Let the job use io_uring. By default `io_uring_setup` fails in the job with ENOSYS (a
    /// seccomp filter, inherited by its children), as on a kernel without io_uring, so that
    /// libuv (under torch's TCPStore: torchrun's agent and every rank) and others use epoll:
    /// CRIU cannot checkpoint an io_uring instance.
    #[arg(long)]
    pub allow_io_uring: bool,
    /// Print the job's pid and control socket on stderr.
    #[arg(short, long)]
    pub verbose: bool,
    /// The job: a command and its arguments.
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    pub cmd: Vec<OsString>,
}

/// Why `--no-cupti` is refused.
pub const NO_CUPTI_GONE: &str = "`--no-cupti` is gone: `possum run JOB` no longer loads CUPTI \
     (possum sees the job's GPU operations by wrapping the driver's entry points, and NVIDIA's \
     driver checkpoints such a job in full); run it without the flag";

/// The job's hook mode (libpossum.so reads it; unset: `entry`).
const HOOKS_ENV: &str = "POSSUM_HOOKS";

/// How libpossum.so sees the job's GPU operations (`POSSUM_HOOKS`).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hooks {
    /// The driver's entry points, wrapped (the default).
    Entry,
    /// CUPTI's callbacks (diagnostic; NVIDIA's driver then refuses to checkpoint the job).
    Cupti,
    /// Nothing hooked: allocations served, a checkpoint parks the job's threads.
    Off,
}

impl RunArgs {
    /// The value `possum run` gives POSSUM_HOOKS, if any (none: the job's environment decides,
    /// and unset means the entry points).
    fn hooks_env(&self) -> Option<&'static str> {
        let h = if self.cupti {
            Some(Hooks::Cupti)
        } else {
            self.hooks
        };
        h.map(|h| match h {
            Hooks::Entry => "entry",
            Hooks::Cupti => "cupti",
            Hooks::Off => "off",
        })
    }
}

/// libuv's switch for io_uring (`0`: epoll and a thread pool, which CRIU can dump).
const UV_IO_URING_ENV: &str = "UV_USE_IO_URING";

/// NCCL's settings a job gets unless it set them: NVLS (NVLink SHARP multicast objects, which
/// keep NVIDIA's driver checkpoint from completing) off, and NCCL's host memory from
/// `cuMemCreate` off (memory on the host that possum does not serve: shared between ranks it
/// would be the driver's imported memory, which the driver cannot restore; the SHM transport
/// then uses shared memory files, which CRIU dumps).
const NCCL_DEFAULTS: [(&str, &str); 2] =
    [("NCCL_NVLS_ENABLE", "0"), ("NCCL_CUMEM_HOST_ENABLE", "0")];

/// Runs the job; returns its exit code (128 + signal when a signal killed it).
pub fn run(a: &RunArgs) -> Result<u8> {
    let exe = std::env::current_exe().context("cannot find the possum executable")?;
    let config = Config::from_env();
    let lib = find_lib(a.lib.as_deref(), config.lib.clone(), &exe)?;
    let lib = std::fs::canonicalize(&lib).with_context(|| format!("{}", lib.display()))?;
    let preload = ld_preload(&lib, std::env::var_os("LD_PRELOAD"))?;

    if a.hooks == Some(Hooks::Off) && a.trace.is_some() {
        bail!("--trace needs the job's launches, which `--hooks off` does not see");
    }
    let (prog, args) = a.cmd.split_first().context("no command given")?;
    let mut cmd = Command::new(prog);
    cmd.args(args).env("LD_PRELOAD", &preload);
    let socket_dir = match &a.socket_dir {
        Some(d) => {
            let d = std::path::absolute(d).with_context(|| format!("{}", d.display()))?;
            cmd.env(possum_control::SOCKET_DIR_ENV, &d);
            d
        }
        None => possum_control::socket_dir(),
    };
    if let Some(h) = a.hooks_env() {
        cmd.env(HOOKS_ENV, h);
    }
    // CRIU cannot dump an io_uring instance, and libuv (under torch's TCPStore, which torchrun's
    // agent and every rank use) makes one when the kernel has io_uring: off unless the user
    // chose otherwise. libuv 1.50 and later ignore the variable for the ring it always makes:
    // io_uring_setup itself fails in the job.
    if !a.allow_io_uring {
        if std::env::var_os(UV_IO_URING_ENV).is_none() {
            cmd.env(UV_IO_URING_ENV, "0");
        }
        possum_criu::no_uring::keep_off_io_uring(&mut cmd);
    }
    for (k, v) in NCCL_DEFAULTS {
        if std::env::var_os(k).is_none() {
            cmd.env(k, v);
        }
    }
    if let Some(t) = &a.trace {
        let t = std::path::absolute(t).with_context(|| format!("{}", t.display()))?;
        cmd.env("POSSUM_TRACE", t);
    }

    // A keeper already serving (a long-lived one named by $POSSUM_KEEPER) is the job's as it
    // inherits the variable; else one is started for the job.
    let serving = config.keeper.is_some();
    // Said once the job has started (a job that cannot start gets only that error).
    let mut keeper_note = None;
    let keeper = if a.no_keeper {
        cmd.env_remove(KEEPER_ENV);
        None
    } else if serving {
        None
    } else {
        match start_keeper(&socket_dir) {
            Ok(k) => {
                cmd.env(KEEPER_ENV, &k.dir);
                Some(k)
            }
            Err(e) => {
                keeper_note = Some(keeper_note_for(&e));
                None
            }
        }
    };
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot execute `{}`", prog.to_string_lossy()))?;
    if let Some(n) = keeper_note {
        eprintln!("{n}");
    }
    if a.verbose {
        eprintln!(
            "possum: job pid {}, control socket {}",
            child.id(),
            possum_control::socket_path(&socket_dir, child.id()).display()
        );
    }
    forward_signals(child.id());
    let status = child.wait().context("waiting for the job")?;
    drop(keeper);
    Ok(exit_code(status))
}

/// A keeper started for one job; ended (and its directory removed) when dropped.
struct KeeperChild {
    child: std::process::Child,
    dir: PathBuf,
}

impl Drop for KeeperChild {
    fn drop(&mut self) {
        // A job killed by `possum checkpoint` may have left its GPU buffers with the keeper for
        // a restore on this host (`--keep-on-gpu`), or a migration's destination on this host
        // be loading its image into it: the keeper then stays, and ends by itself once that
        // memory is freed or the restored job is gone.
        if crate::keeper::holds_for_restore(&self.dir) {
            return;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts a keeper for the job, at `SOCKET_DIR/keeper-<possum's pid>` (mode 0700), ending when
/// possum does (or when dropped). A keeper that does not start leaves no directory behind.
fn start_keeper(socket_dir: &Path) -> Result<KeeperChild> {
    let dir = socket_dir.join(format!("keeper-{}", std::process::id()));
    crate::keeper::create_private_dir(&dir)?;
    let exe = std::env::current_exe().context("cannot find the possum executable")?;
    match possum_sequence::process::start_keeper(&exe, &dir, std::process::id() as i32, |_| {}) {
        Ok(child) => Ok(KeeperChild { child, dir }),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            Err(e)
        }
    }
}

/// `--lib`, else `$POSSUM_LIB` (each used as given: not found is an error), else libpossum.so
/// beside `exe`, else `../lib/libpossum.so` relative to `exe`'s directory.
pub(crate) fn find_lib(
    explicit: Option<&Path>,
    env: Option<PathBuf>,
    exe: &Path,
) -> Result<PathBuf> {
    let (tried, why) = if let Some(p) = explicit {
        (vec![p.to_path_buf()], "--lib")
    } else if let Some(p) = env {
        (vec![p], "$POSSUM_LIB")
    } else {
        let dir = exe.parent().unwrap_or(Path::new("."));
        (
            vec![
                dir.join(LIB_NAME),
                dir.join("..").join("lib").join(LIB_NAME),
            ],
            "beside the possum executable",
        )
    };
    if let Some(p) = tried.iter().find(|p| p.is_file()) {
        return Ok(p.clone());
    }
    let list: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
    bail!(
        "libpossum.so not found ({why}): looked at {}; build it with `cargo build --release -p possum-interposer` or pass --lib PATH",
        list.join(", ")
    )
}

/// `lib` in front of an existing LD_PRELOAD.
fn ld_preload(lib: &Path, existing: Option<OsString>) -> Result<OsString> {
    let s = lib.as_os_str();
    if s.as_encoded_bytes()
        .iter()
        .any(|b| *b == b':' || b.is_ascii_whitespace())
    {
        bail!(
            "{}: LD_PRELOAD cannot carry a path with ':' or white space",
            lib.display()
        );
    }
    let mut v = s.to_os_string();
    if let Some(e) = existing.filter(|e| !e.is_empty()) {
        v.push(OsStr::new(":"));
        v.push(e);
    }
    Ok(v)
}

/// From here on, possum survives the terminal's SIGINT, SIGQUIT and SIGHUP (the job gets them
/// itself: it is in the same foreground process group) and passes a SIGTERM on to the job, so
/// that it always reports the job's own exit status.
fn forward_signals(child: u32) {
    let mut set = SigSet::empty();
    for s in [
        Signal::SIGINT,
        Signal::SIGQUIT,
        Signal::SIGHUP,
        Signal::SIGTERM,
    ] {
        set.add(s);
    }
    // The job was spawned before this, so it keeps the default mask. Threads spawned below
    // inherit this one; possum has no others.
    if set.thread_block().is_err() {
        return;
    }
    let Ok(pid) = i32::try_from(child) else {
        return;
    };
    let _ = std::thread::Builder::new()
        .name("possum-signals".into())
        .spawn(move || loop {
            if let Ok(Signal::SIGTERM) = set.wait() {
                let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
            }
        });
}

fn exit_code(s: ExitStatus) -> u8 {
    match (s.code(), s.signal()) {
        (Some(c), _) => u8::try_from(c & 0xff).unwrap_or(1),
        (None, Some(sig)) => u8::try_from((128 + sig) & 0xff).unwrap_or(1),
        (None, None) => 1,
    }
}

/// The one line said when the job's keeper could not start: why, in plain words (the driver
/// missing, on a machine without a GPU, is the common case), and the flag that avoids it.
fn keeper_note_for(e: &anyhow::Error) -> String {
    let cause = e.root_cause().to_string();
    let why = if cause.contains("libcuda") && cause.contains("not found") {
        "no NVIDIA driver here (libcuda.so.1 not found)".to_string()
    } else {
        // The innermost error, without the advice in parentheses that follows it.
        cause
            .split(" (")
            .next()
            .unwrap_or(&cause)
            .trim()
            .to_string()
    };
    format!(
        "possum: the job runs without a keeper, which could not start: {why}; --no-keeper starts \
         none and says nothing"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keeper's failure said in one line: the missing driver in plain words, another cause
    /// without its advice, and the flag each time.
    #[test]
    fn the_keeper_note_is_one_plain_line_with_its_flag() {
        let e = anyhow::anyhow!(
            "libcuda.so.1 not found by dlopen (is the NVIDIA driver installed, and its directory \
             on LD_LIBRARY_PATH or in ld.so.conf?) (code -1)"
        )
        .context("no CUDA device for a keeper")
        .context("it did not start");
        let n = keeper_note_for(&e);
        assert!(
            n.contains("no NVIDIA driver here (libcuda.so.1 not found)"),
            "{n}"
        );
        assert!(n.contains("--no-keeper"), "{n}");
        assert!(!n.contains("LD_LIBRARY_PATH") && !n.contains('\n'), "{n}");
        let n = keeper_note_for(&anyhow::anyhow!(
            "the keeper did not listen within 30 s (see its log)"
        ));
        assert!(
            n.contains("could not start: the keeper did not listen within 30 s;"),
            "{n}"
        );
    }

    #[test]
    fn lib_lookup_order() {
        let tmp = tempfile::tempdir().unwrap();
        let bin = tmp.path().join("bin");
        let lib = tmp.path().join("lib");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(&lib).unwrap();
        let exe = bin.join("possum");

        let e = find_lib(None, None, &exe).unwrap_err().to_string();
        assert!(e.contains(&bin.join(LIB_NAME).display().to_string()), "{e}");
        assert!(e.contains("../lib/libpossum.so"), "{e}");
        assert!(
            e.contains("cargo build --release -p possum-interposer"),
            "{e}"
        );

        std::fs::write(lib.join(LIB_NAME), b"").unwrap();
        let found = find_lib(None, None, &exe).unwrap();
        assert_eq!(found, bin.join("..").join("lib").join(LIB_NAME));
        std::fs::write(bin.join(LIB_NAME), b"").unwrap();
        assert_eq!(find_lib(None, None, &exe).unwrap(), bin.join(LIB_NAME));

        let other = tmp.path().join("other.so");
        let e = find_lib(None, Some(other.clone()), &exe).unwrap_err();
        assert!(e.to_string().contains("$POSSUM_LIB"), "{e}");
        std::fs::write(&other, b"").unwrap();
        assert_eq!(find_lib(None, Some(other.clone()), &exe).unwrap(), other);
        let e = find_lib(Some(Path::new("/nope.so")), Some(other), &exe).unwrap_err();
        assert!(e.to_string().contains("/nope.so"), "{e}");
    }

    #[test]
    fn ld_preload_is_prepended() {
        let lib = Path::new("/a/libpossum.so");
        assert_eq!(ld_preload(lib, None).unwrap(), "/a/libpossum.so");
        assert_eq!(ld_preload(lib, Some("".into())).unwrap(), "/a/libpossum.so");
        assert_eq!(
            ld_preload(lib, Some("/b/x.so".into())).unwrap(),
            "/a/libpossum.so:/b/x.so"
        );
        assert!(ld_preload(Path::new("/a b/libpossum.so"), None).is_err());
    }

    #[test]
    fn exit_codes() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(15)), 143);
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
    }
}
