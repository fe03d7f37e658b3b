//! possum's HIP backend, and a simulated HIP runtime to test it on machines without an AMD GPU.
//!
//! The backend is [`HipDevice`], the engine's `Device` trait over the HIP runtime API, in three
//! layers as cudarc's are: [`sys`] (HIP's C types, and the entry points looked up in a runtime
//! loaded from a path with `libloading`: `libamdhip64.so.6` or `.so.7` on a machine with ROCm,
//! the simulated runtime in tests), [`result`] (each call wrapped to return a `DeviceResult`,
//! and RAII types for streams, events, pinned host memory and physical memory) and [`device`]
//! (safe code: the tables of reservations and mappings, and the trait). Only `sys` and `result`
//! have `unsafe` code.
//!
//! The rest is what the backend and possum's HIP front end are tested against, as
//! `cuda/testdata/fake-libcuda.c` is for the CUDA one:
//!
//! - `testdata/fake-libamdhip64.c`: the runtime, a C library exporting a subset of the HIP
//!   runtime API (HIP's names, signatures and error codes) over host memory at addresses it
//!   chooses in a fixed arena, so that they are the same in every run. Its head comment says what
//!   it simulates and what it does not.
//! - `testdata/include/hip/hip_runtime_api.h`: the declarations of that subset (no ROCm needed).
//! - `testdata/sim-kernels.cl` and `testdata/sim-kernels-gfx942.hsaco`: the kernels the runtime
//!   knows, as a real AMDGPU code object (code object v5) that programs load; the runtime runs
//!   its own C version of each.
//! - `testdata/hip-sim-job.c`: a HIP program (streams, pools, a captured graph, virtual memory
//!   management, several threads at once) that prints a digest of what it reads back after each
//!   step.
//!
//! This crate builds them with the system C compiler (`cc`) into a directory of the caller's;
//! [`result::SimProbe`] reads what the simulated runtime counts for tests (copies queued at each
//! stream priority).

#![deny(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use thiserror::Error;

pub mod device;
pub mod result;
pub mod sys;

pub use device::{HipDevice, OpenError};
pub use sys::LoadError;

/// The shared object name the runtime is built under (that of ROCm 6's runtime).
pub const RUNTIME_SONAME: &str = "libamdhip64.so.6";

/// Why building the simulation failed.
#[derive(Debug, Error)]
pub enum BuildError {
    /// The C compiler could not be started.
    #[error("cannot run the C compiler `cc`: {0}")]
    NoCompiler(#[source] std::io::Error),
    /// The C compiler ran and failed.
    #[error("cc failed to build {what} ({status}): {stderr}")]
    Compile {
        /// What was being built.
        what: String,
        /// The compiler's exit status.
        status: std::process::ExitStatus,
        /// Its error output.
        stderr: String,
    },
}

/// This crate's `testdata` directory.
pub fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata")
}

/// The code object with the kernels the simulated runtime can run (`sim-kernels.cl` built for
/// gfx942).
pub fn kernels_code_object() -> PathBuf {
    testdata().join("sim-kernels-gfx942.hsaco")
}

fn cc(what: &str, args: &[&str]) -> Result<(), BuildError> {
    let out = Command::new("cc")
        .args(args)
        .output()
        .map_err(BuildError::NoCompiler)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(BuildError::Compile {
            what: what.to_string(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Builds the simulated runtime into `dir` as [`RUNTIME_SONAME`], and returns its path. Like the
/// real runtime it is linked `-Bsymbolic`: the functions it hands out (hipGetProcAddress) and its
/// calls of its own are its own, whatever a preloaded library exports.
pub fn build_runtime(dir: &Path) -> Result<PathBuf, BuildError> {
    let out = dir.join(RUNTIME_SONAME);
    let soname = format!("-Wl,-soname,{RUNTIME_SONAME}");
    cc(
        "the simulated HIP runtime",
        &[
            "-O1",
            "-shared",
            "-fPIC",
            "-Wl,-Bsymbolic",
            &soname,
            "-o",
            &path_str(&out),
            &path_str(&testdata().join("fake-libamdhip64.c")),
            "-lpthread",
        ],
    )?;
    Ok(out)
}

/// Builds `testdata/hip-sim-job.c` into `dir` as `hip-sim-job`, linked against the runtime that
/// [`build_runtime`] put in the same `dir` (found there at run time through an rpath), and
/// returns its path.
pub fn build_job(dir: &Path) -> Result<PathBuf, BuildError> {
    build_program(dir, "hip-sim-job")
}

/// Builds `testdata/hip-session-job.c` into `dir` as `hip-session-job`, as [`build_job`]: a
/// HIP program that steps until killed, for checkpoints of a running job.
pub fn build_session_job(dir: &Path) -> Result<PathBuf, BuildError> {
    build_program(dir, "hip-session-job")
}

/// The `step N DIGEST` lines of `hip-session-job`'s output, as (N, DIGEST), in order.
pub fn session_job_steps(output: &str) -> Vec<(u32, String)> {
    output
        .lines()
        .filter_map(|l| {
            let mut w = l.split(' ');
            (w.next() == Some("step")).then_some(())?;
            Some((w.next()?.parse().ok()?, w.next()?.to_string()))
        })
        .collect()
}

/// Builds `testdata/NAME.c` into `dir` as `NAME`, linked against the runtime in `dir`.
fn build_program(dir: &Path, name: &str) -> Result<PathBuf, BuildError> {
    let out = dir.join(name);
    let include = format!("-I{}", path_str(&testdata().join("include")));
    let lib_dir = format!("-L{}", path_str(dir));
    let rpath = format!("-Wl,-rpath,{}", path_str(dir));
    let lib = format!("-l:{RUNTIME_SONAME}");
    cc(
        &format!("the HIP program {name}"),
        &[
            "-O1",
            &include,
            "-o",
            &path_str(&out),
            &path_str(&testdata().join(format!("{name}.c"))),
            &lib_dir,
            &lib,
            &rpath,
            "-lpthread",
        ],
    )?;
    Ok(out)
}
