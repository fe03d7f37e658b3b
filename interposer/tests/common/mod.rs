//! Shared by the interposer's integration tests.

#[allow(dead_code)] // not every test drives the park job
pub mod park_job;

use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::Duration;

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

/// An empty directory `possum-<name>-<pid>` under the temporary directory (emptied first where
/// a run before left it).
#[allow(dead_code)]
pub fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("possum-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// [`fresh_dir`] with the fake GPU stack and the job `tests/fake/<job>.c` built into it as
/// `job`; `None` (the caller skips the test, said on stderr) without a C compiler.
#[allow(dead_code)]
pub fn fake_gpu_dir(name: &str, job: &str) -> Option<PathBuf> {
    let dir = fresh_dir(name);
    build_fake_gpu(&dir, &format!("tests/fake/{job}.c"), job).then_some(dir)
}

/// The stdout of `cmd`, which must exit 0 (the test fails with its stdout and stderr if not).
#[allow(dead_code)]
pub fn stdout_of(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// A child process killed (and reaped) when dropped, so that a failed assertion leaves no job
/// behind.
#[allow(dead_code)]
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for Killed {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Killed {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

/// A job started by [`Piped::spawn`]: its stdin (until closed), the lines of its stdout as they
/// come, its stderr in a file; killed when dropped, so that a failed assertion leaves no job
/// behind (a paused one would never exit).
#[allow(dead_code)]
pub struct Piped {
    /// The job.
    pub child: Killed,
    /// Its stdin; `None` once closed.
    pub stdin: Option<ChildStdin>,
    /// The lines of its stdout.
    pub lines: Receiver<String>,
    /// The file its stderr goes to.
    pub stderr: PathBuf,
}

#[allow(dead_code)]
impl Piped {
    /// Spawns `cmd` with its stdin and stdout piped and its stderr written to the file `stderr`.
    pub fn spawn(cmd: &mut Command, stderr: PathBuf) -> Piped {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap());
        let mut child = Killed(cmd.spawn().unwrap());
        let stdin = child.stdin.take();
        let lines = lines_of(child.stdout.take().unwrap());
        Piped {
            child,
            stdin,
            lines,
            stderr,
        }
    }

    /// The job's stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Writes the line `cmd` to the job's stdin.
    pub fn send(&mut self, cmd: &str) {
        use std::io::Write;
        let stdin = self.stdin.as_mut().expect("stdin closed");
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
    }

    /// The job's next line within `wait`; the test fails (with the job's stderr) without one.
    pub fn next(&self, wait: Duration) -> String {
        self.lines.recv_timeout(wait).unwrap_or_else(|e| {
            panic!(
                "no answer from the job within {wait:?} ({e:?}); stderr:\n{}",
                self.log()
            )
        })
    }

    /// The job's next line, which must be `want`, within `wait`.
    pub fn expect(&self, want: &str, wait: Duration) {
        match self.lines.recv_timeout(wait) {
            Ok(line) => assert_eq!(line, want, "job's stderr:\n{}", self.log()),
            Err(e) => panic!(
                "no answer {want:?} from the job within {wait:?} ({e:?}); stderr:\n{}",
                self.log()
            ),
        }
    }
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
