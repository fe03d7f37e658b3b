//! Shared by the interposer's integration tests.

use std::path::PathBuf;

/// The cdylib cargo built for this test run. `cargo test` builds it into `<target>/<profile>/deps/`
/// beside the test's executable (only `cargo build` copies it up to `<target>/<profile>/`, where
/// it may be stale), so look there first.
pub fn libpossum() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps, deps.parent().unwrap()]
        .iter()
        .map(|d| d.join("libpossum.so"))
        .find(|p| p.exists())
        .expect("libpossum.so not built")
}
