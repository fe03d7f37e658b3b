//! A deterministic two-process tree to checkpoint in the plugin's CRIU round-trip test.
//!
//! ```text
//! plugin-testee OUT [--steps N] [--step-ms MS] [--kib KIB] [--ready FILE] [--hold DEV]
//! ```
//!
//! Leaves the caller's session (`setsid`) and starts a child (itself, `--child`) with stdio on
//! `/dev/null`. Parent and child each run a hash chain over their own KIB KiB buffer (default
//! 1024) for N steps (default 40), sleeping MS milliseconds (default 50) after each. Once both
//! have done 2 steps the parent writes the child's PID to FILE. The child writes its digest to
//! `OUT.child`; the parent waits for the child, then writes `parent=P child=C` to OUT (through a
//! temporary file and a rename). The result depends only on the parameters. With `--hold DEV`
//! the child opens DEV read-only and keeps it open to the end (never using it), as a DataLoader
//! worker keeps the NVIDIA descriptors it inherited.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

#[derive(Default)]
struct Params {
    out: PathBuf,
    steps: u64,
    step_ms: u64,
    kib: usize,
    ready: Option<PathBuf>,
    hold: Option<PathBuf>,
    child: bool,
}

/// Why the testee stopped.
#[derive(Debug, thiserror::Error)]
enum TesteeError {
    /// Its command line.
    #[error("{0}")]
    Usage(String),
    /// A number on its command line.
    #[error("{text}: {source}")]
    Number {
        /// The argument.
        text: String,
        /// Why.
        source: std::num::ParseIntError,
    },
    /// `--kib` does not fit in memory.
    #[error("--kib: {0}")]
    TooLarge(#[source] std::num::TryFromIntError),
    /// A file.
    #[error("{}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The child process.
    #[error("{what} the child: {source}")]
    Child {
        /// What was done.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// The child process failed.
    #[error("child: {0}")]
    ChildFailed(std::process::ExitStatus),
}

fn file_error(path: &Path) -> impl FnOnce(std::io::Error) -> TesteeError + '_ {
    move |source| TesteeError::File {
        path: path.to_path_buf(),
        source,
    }
}

fn parse() -> Result<Params, TesteeError> {
    let mut args = std::env::args().skip(1);
    let mut p = Params {
        steps: 40,
        step_ms: 50,
        kib: 1024,
        ..Params::default()
    };
    let mut out = None;
    while let Some(a) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .ok_or_else(|| TesteeError::Usage(format!("{name} needs a value")))
        };
        match a.as_str() {
            "--steps" => p.steps = num(&value("--steps")?)?,
            "--step-ms" => p.step_ms = num(&value("--step-ms")?)?,
            "--kib" => {
                p.kib = usize::try_from(num(&value("--kib")?)?).map_err(TesteeError::TooLarge)?
            }
            "--ready" => p.ready = Some(value("--ready")?.into()),
            "--hold" => p.hold = Some(value("--hold")?.into()),
            "--child" => p.child = true,
            s if s.starts_with("--") => {
                return Err(TesteeError::Usage(format!("unknown option {s}")))
            }
            s if out.is_none() => out = Some(PathBuf::from(s)),
            s => return Err(TesteeError::Usage(format!("unexpected argument {s}"))),
        }
    }
    p.out = out.ok_or_else(|| {
        TesteeError::Usage(
            "usage: plugin-testee OUT [--steps N] [--step-ms MS] [--kib KIB] [--ready FILE] \
             [--hold DEV]"
                .into(),
        )
    })?;
    if p.kib == 0 {
        return Err(TesteeError::Usage("--kib must be positive".into()));
    }
    Ok(p)
}

fn num(s: &str) -> Result<u64, TesteeError> {
    s.parse().map_err(|source| TesteeError::Number {
        text: s.to_string(),
        source,
    })
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Runs the hash chain; `on_step(done)` after each step.
fn compute(p: &Params, seed: u64, mut on_step: impl FnMut(u64)) -> u64 {
    let mut buf: Vec<u64> = (0..p.kib as u64 * 128).map(|i| mix(seed ^ i)).collect();
    let mut state = seed;
    for step in 0..p.steps {
        for w in buf.iter_mut() {
            state = mix(state ^ *w);
            *w = state.rotate_left(17) ^ step;
        }
        on_step(step + 1);
        std::thread::sleep(Duration::from_millis(p.step_ms));
    }
    buf.iter().fold(state, |acc, &w| mix(acc ^ w))
}

fn write_atomically(path: &Path, text: &str) -> Result<(), TesteeError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(file_error(&tmp))?;
    std::fs::rename(&tmp, path).map_err(file_error(path))
}

fn child_out(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_owned();
    s.push(".child");
    PathBuf::from(s)
}

fn run(p: Params) -> Result<(), TesteeError> {
    if p.child {
        let _held = match &p.hold {
            Some(dev) => Some(std::fs::File::open(dev).map_err(file_error(dev))?),
            None => None,
        };
        let digest = compute(&p, 2, |done| {
            if done == 2 {
                // The parent waits for this before saying the tree is ready.
                let _ = std::fs::write(p.out.with_extension("child-ready"), "");
            }
        });
        return write_atomically(&p.out, &format!("{digest:016x}\n"));
    }
    // Fails only when already a session leader, which is as good.
    let _ = nix::unistd::setsid();
    let child_out = child_out(&p.out);
    let exe = std::env::current_exe().map_err(|source| TesteeError::Child {
        what: "find the executable of",
        source,
    })?;
    let mut cmd = Command::new(exe);
    if let Some(dev) = &p.hold {
        cmd.arg("--hold").arg(dev);
    }
    let mut child = cmd
        .arg(&child_out)
        .args(["--child", "--steps", &p.steps.to_string()])
        .args(["--step-ms", &p.step_ms.to_string()])
        .args(["--kib", &p.kib.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|source| TesteeError::Child {
            what: "start",
            source,
        })?;
    let child_ready = child_out.with_extension("child-ready");
    let mut said_ready = false;
    let digest = compute(&p, 1, |done| {
        if !said_ready && done >= 2 && child_ready.exists() {
            if let Some(ready) = &p.ready {
                let _ = std::fs::write(ready, child.id().to_string());
            }
            said_ready = true;
        }
    });
    let status = child.wait().map_err(|source| TesteeError::Child {
        what: "wait for",
        source,
    })?;
    if !status.success() {
        return Err(TesteeError::ChildFailed(status));
    }
    let c = std::fs::read_to_string(&child_out).map_err(file_error(&child_out))?;
    write_atomically(
        &p.out,
        &format!("parent={digest:016x} child={}\n", c.trim()),
    )
}

fn main() -> ExitCode {
    match parse().and_then(run) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("plugin-testee: {e}");
            ExitCode::FAILURE
        }
    }
}
