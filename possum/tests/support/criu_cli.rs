//! What the CLI's tests with real CRIU share: the possum executable ([`cli`]), CRIU or a skip
//! ([`criu_support`]), the interposer's test support ([`common`]), the jobs they checkpoint
//! ([`session_job`], [`self_job`]) and the bound on every wait ([`WAIT`]). Each test file takes
//! what it needs.

#![allow(dead_code, unused_imports)]

use std::path::{Path, PathBuf};
use std::time::Duration;

#[path = "cli.rs"]
pub mod cli;
#[path = "../../../interposer/tests/common/mod.rs"]
pub mod common;
#[path = "../../../criu-adapter/tests/support/criu.rs"]
pub mod criu_support;
#[path = "receiver.rs"]
pub mod receiver;
#[path = "self_job.rs"]
pub mod self_job;
#[path = "session_job.rs"]
pub mod session_job;

pub use cli::{run_ok, text};
pub use criu_support::{criu_or_skip, say};

/// Bound on every wait for something that should happen.
pub const WAIT: Duration = Duration::from_secs(30);

/// What a test of a session job needs: CRIU, libpossum.so, the fake driver and the job built into
/// a temporary directory named `prefix...` (returned with libpossum's path); `None` (said why) to
/// skip. A restored job is detached from CRIU and from `possum restore`: this process becomes a
/// subreaper that adopts it, so it can be reaped and its exit status checked.
pub fn session_job_setup(test: &str, prefix: &str) -> Option<(tempfile::TempDir, PathBuf)> {
    criu_or_skip(test)?;
    let Some(lib) = common::find_libpossum() else {
        say(&format!(
            "{test}: SKIPPED: libpossum.so not built (cargo test --workspace builds it)"
        ));
        return None;
    };
    possum_criu::set_child_subreaper().unwrap();
    let tmp = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    let interposer = Path::new(env!("CARGO_MANIFEST_DIR")).join("../interposer");
    common::build_fake_gpu_from(
        &interposer,
        tmp.path(),
        "tests/fake/fake_session_job.c",
        "fake_session_job",
    )
    .then_some((tmp, lib))
}

/// The plugin cargo built for this run (`cargo test` builds the workspace's cdylib into
/// `<target>/<profile>/deps/` beside this test's executable; `cargo build` copies it up a
/// level), alone in a directory of its own (CRIU loads every `.so` of `--libdir`).
pub fn plugin_dir(dir: &Path) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    let built = [deps, deps.parent()?]
        .iter()
        .map(|d| d.join(possum_criu::PLUGIN_FILE))
        .find(|p| p.is_file())?;
    let libdir = dir.join("plugins");
    std::fs::create_dir_all(&libdir).unwrap();
    std::fs::copy(&built, libdir.join(possum_criu::PLUGIN_FILE)).unwrap();
    Some(libdir)
}
