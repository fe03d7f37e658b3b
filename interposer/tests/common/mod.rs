//! Shared by the interposer's integration tests.

#[allow(dead_code)] // not every test drives the park job
pub mod park_job;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The cdylib cargo built for this test run. `cargo test` builds it into `<target>/<profile>/deps/`
/// beside the test's executable (only `cargo build` copies it up to `<target>/<profile>/`, where
/// it may be stale), so look there first.
pub fn libpossum() -> PathBuf {
    find_libpossum().expect("libpossum.so not built")
}

/// [`libpossum`], or `None` where it was not built (a test of another crate run alone).
#[allow(dead_code)]
pub fn find_libpossum() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    [deps, deps.parent()?]
        .iter()
        .map(|d| d.join("libpossum.so"))
        .find(|p| p.exists())
}

/// The JSON object in the file at `path`.
#[allow(dead_code)] // not every test reads one
pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Runs `cc` with `args`; whether it succeeded.
pub fn cc(args: &[&str]) -> bool {
    Command::new("cc")
        .args(args)
        .status()
        .is_ok_and(|s| s.success())
}

/// Builds the fake GPU stack into `dir`: the fake driver (`libcuda.so.1`), runtime
/// (`libcudart.so.13`) and CUPTI (`libfakecupti.so`), and the job `job_src` (relative to the
/// crate) as `dir/job_name`, linked against the fake runtime. `false` (the caller skips the test,
/// said on stderr) without a C compiler.
#[allow(dead_code)] // not every test uses the fake GPU
pub fn build_fake_gpu(dir: &Path, job_src: &str, job_name: &str) -> bool {
    build_fake_gpu_from(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")),
        dir,
        job_src,
        job_name,
    )
}

/// [`build_fake_gpu`] with the interposer crate's directory given (for another crate's tests
/// that include this module by path).
#[allow(dead_code)]
pub fn build_fake_gpu_from(here: &Path, dir: &Path, job_src: &str, job_name: &str) -> bool {
    build_fake_gpu_linked(here, dir, job_src, job_name, &[])
}

/// [`build_fake_gpu_from`] with `link` added to the job's link line (`-l:libcuda.so.1` for a job
/// that calls the driver by name, as a program linked against libcuda does).
#[allow(dead_code)]
pub fn build_fake_gpu_linked(
    here: &Path,
    dir: &Path,
    job_src: &str,
    job_name: &str,
    link: &[&str],
) -> bool {
    let d = dir.to_str().unwrap();
    let src = |p: &str| here.join(p).to_str().unwrap().to_string();
    let lib_dir = format!("-L{d}");
    let rpath = format!("-Wl,-rpath,{d}");
    let job = format!("{d}/{job_name}");
    let job_src = src(job_src);
    let mut job_args = vec!["-O1", "-o", &job, &job_src, &lib_dir, "-l:libcudart.so.13"];
    job_args.extend_from_slice(link);
    job_args.extend([rpath.as_str(), "-ldl"]);
    // The fake driver is linked as the real one is (-Bsymbolic): the functions its
    // cuGetProcAddress hands out, and its calls of its own, are its own even where libpossum.so
    // exports the same names.
    let ok = cc(&[
        "-O1",
        "-shared",
        "-fPIC",
        "-Wl,-Bsymbolic",
        "-o",
        &format!("{d}/libcuda.so.1"),
        &src("../cuda/testdata/fake-libcuda.c"),
    ]) && cc(&[
        "-O1",
        "-shared",
        "-fPIC",
        "-Wl,-soname,libcudart.so.13",
        "-o",
        &format!("{d}/libcudart.so.13"),
        &src("tests/fake/fake_cudart.c"),
        &format!("-L{d}"),
        "-l:libcuda.so.1",
    ]) && cc(&[
        "-O1",
        "-shared",
        "-fPIC",
        "-o",
        &format!("{d}/libfakecupti.so"),
        &src("tests/fake/fake_cupti.c"),
    ]) && cc(&job_args);
    if !ok {
        eprintln!("SKIPPED: no C compiler to build the fake GPU stack [{job_name}]");
    }
    ok
}

/// The command for a fake-GPU job `exe` built into `dir`: none of this process's `POSSUM_*`,
/// `FAKE_*`, `LD_PRELOAD` or `CUDA_INJECTION64_PATH`; the fake libraries in `dir` first; `lib`
/// (libpossum.so) preloaded when given.
#[allow(dead_code)]
pub fn fake_job_command(dir: &Path, exe: &str, lib: Option<&Path>) -> Command {
    let mut cmd = Command::new(dir.join(exe));
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("POSSUM_") || k.starts_with("FAKE_") || k == "LD_PRELOAD" {
            cmd.env_remove(k);
        }
    }
    cmd.env_remove("CUDA_INJECTION64_PATH")
        .env("LD_LIBRARY_PATH", dir);
    if let Some(lib) = lib {
        cmd.env("LD_PRELOAD", lib);
    }
    cmd
}

/// The lines of a child's stdout as they come, read by a thread.
#[allow(dead_code)]
pub fn lines_of(stdout: std::process::ChildStdout) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}
