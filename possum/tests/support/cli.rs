//! The possum executable as the CLI tests on the fake GPU stack run it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `possum` for the fake GPU stack built into `dir`: the jobs' socket directory `dir/sockets`
/// is possum's too (a restore removes a stale socket only there), the fake driver is
/// `dir/libcuda.so.1`, and no LD_PRELOAD is inherited.
pub fn possum_in(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_possum"));
    c.env("POSSUM_SOCKET_DIR", dir.join("sockets"))
        .env("POSSUM_LIBCUDA", dir.join("libcuda.so.1"))
        .env_remove("LD_PRELOAD");
    c
}

/// [`possum_in`], with the fake driver's checkpoint state kept in the job's own process, as the
/// real driver's is.
pub fn possum_checkpointing_in(dir: &Path) -> Command {
    let mut c = possum_in(dir);
    c.env("FAKE_CKPT_IN_PROCESS", "1");
    c
}

/// A command's stdout, then its stderr.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The fake driver (cuda/testdata/fake-libcuda.c), built into `dir` as `libcuda.so.1`; `None`
/// without a C compiler.
pub fn fake_libcuda(dir: &Path) -> Option<PathBuf> {
    let lib = dir.join("libcuda.so.1");
    Command::new("cc")
        .args(["-O1", "-shared", "-fPIC", "-Wl,-Bsymbolic", "-o"])
        .arg(&lib)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../cuda/testdata/fake-libcuda.c"
        ))
        .status()
        .is_ok_and(|s| s.success())
        .then_some(lib)
}
