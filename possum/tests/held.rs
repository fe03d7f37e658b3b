//! `possum checkpoint --gpu-only` of a job without CUPTI (held by parking its threads), through
//! the real CLI, the real libpossum.so and the fake GPU stack of the interposer's tests: the
//! checkpoint completes and the job goes on with exactly the data it would have had; and killing
//! `possum checkpoint` at any moment leaves the job running (the guard resumes it if it was held)
//! and no partial image under DIR's name.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

#[path = "../../interposer/tests/common/mod.rs"]
#[allow(dead_code)]
mod common;

const WAIT: Duration = Duration::from_secs(20);
const N: usize = 1 << 18;

/// libpossum.so as `cargo test --workspace` builds it beside this test's executable.
fn libpossum() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    [deps, deps.parent()?]
        .iter()
        .map(|d| d.join("libpossum.so"))
        .find(|p| p.exists())
}

struct Job {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    sockets: PathBuf,
}

impl Job {
    fn start(dir: &Path, lib: &Path) -> Job {
        let sockets = dir.join("sockets");
        let mut cmd = common::fake_job_command(dir, "fake_park_job", Some(lib));
        cmd.env("POSSUM_CUPTI", "off")
            .env("POSSUM_SOCKET_DIR", &sockets)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("job.stderr")).unwrap());
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let lines = common::lines_of(child.stdout.take().unwrap());
        let mut job = Job {
            child,
            stdin,
            lines,
            sockets,
        };
        assert_eq!(job.answer(), "ready");
        job
    }

    /// The next line that is not a step line.
    fn answer(&mut self) -> String {
        let t = Instant::now();
        loop {
            match self.lines.recv_timeout(WAIT.saturating_sub(t.elapsed())) {
                Ok(l) if l.starts_with("s ") => continue,
                Ok(l) => return l,
                Err(e) => panic!("no answer from the job: {e:?}"),
            }
        }
    }

    /// Waits for `n` more step lines: the job is running.
    fn progresses(&mut self, n: usize) -> bool {
        let t = Instant::now();
        let mut seen = 0;
        while seen < n {
            match self.lines.recv_timeout(WAIT.saturating_sub(t.elapsed())) {
                Ok(l) if l.starts_with("s ") => seen += 1,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
        true
    }

    fn run(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        self.answer()
    }

    /// Stops the worker and checks the buffers against the model of as many steps.
    fn check_final(&mut self, dir: &Path) {
        let stopped = self.run("stop");
        let steps: u32 = stopped
            .strip_prefix("stopped ")
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{stopped}"));
        let path = dir.join("dump.bin");
        assert_eq!(self.run(&format!("dump {}", path.display())), "dumped");
        let a: Vec<u32> = (0..N).map(|i| (7 * i + 1) as u32).collect();
        let mut b: Vec<u32> = (0..N).map(|i| (i as u32) ^ 0x5a5a_5a5a).collect();
        for s in 1..=steps {
            for (y, x) in b.iter_mut().zip(&a) {
                *y = y.wrapping_mul(2_654_435_761).wrapping_add(x ^ s);
            }
        }
        let want: Vec<u8> = a.iter().chain(&b).flat_map(|w| w.to_le_bytes()).collect();
        assert!(
            std::fs::read(&path).unwrap() == want,
            "after {steps} steps the buffers differ"
        );
        assert_eq!(self.run("exit"), "bye");
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn checkpoint(job: &Job, img: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_possum"));
    c.args([
        "checkpoint",
        &job.child.id().to_string(),
        "--gpu-only",
        "--json",
        "-D",
    ])
    .arg(img)
    .arg("--socket-dir")
    .arg(&job.sockets);
    c
}

#[test]
fn a_held_job_is_checkpointed_and_survives_possum_being_killed_at_any_moment() {
    let Some(lib) = libpossum() else {
        // Past the harness's capture, so the skip shows.
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: libpossum.so not built (cargo test --workspace builds it)"
        );
        return;
    };
    let dir = std::env::temp_dir().join(format!("possum-held-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let interposer = Path::new(env!("CARGO_MANIFEST_DIR")).join("../interposer");
    if !common::build_fake_gpu_from(
        &interposer,
        &dir,
        "tests/fake/fake_park_job.c",
        "fake_park_job",
    ) {
        return;
    }
    let mut job = Job::start(&dir, &lib);
    assert!(job.progresses(10));

    // A whole checkpoint: the image is named, the figures say how the job was held.
    let img = dir.join("img");
    let out = checkpoint(&job, &img).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    assert!(
        v["hold"]
            .as_str()
            .unwrap_or("")
            .starts_with("threads parked"),
        "{v}"
    );
    assert_eq!(v["release_report"]["parked"]["threads"], 2, "{v}");
    assert!(img.join("possum.json").is_file() && img.join("gpu/gpu-0").is_dir());
    assert!(
        job.progresses(10),
        "the job did not go on after the checkpoint"
    );

    // possum killed at various moments: the job always goes on, and DIR is either absent or a
    // complete image.
    for (i, delay_ms) in [0u64, 2, 5, 10, 14, 18, 22, 26, 30, 40, 60]
        .into_iter()
        .enumerate()
    {
        let img = dir.join(format!("img-{i}"));
        let mut c = checkpoint(&job, &img)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        let _ = c.kill();
        let _ = c.wait();
        assert!(
            job.progresses(20),
            "killed after {delay_ms} ms: the job stays held"
        );
        assert!(
            !img.exists() || img.join("possum.json").is_file(),
            "killed after {delay_ms} ms: an incomplete image under DIR's name"
        );
        eprintln!(
            "killed after {delay_ms} ms: {}",
            if img.exists() {
                "image complete"
            } else {
                "no image"
            }
        );
    }
    // Whatever happened, the data is exactly what the job computed.
    job.check_final(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}
