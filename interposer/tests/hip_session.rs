//! The HIP front end on the simulated HIP runtime (`possum-hip`): a HIP program
//! (`hip/testdata/hip-session-job.c`: three streams, pool and stream-ordered allocations, a
//! captured graph, launches by module and by registered stub) runs under libpossum.so, which
//! serves its allocations (the pieces it maps into a range of its own too) and sees its
//! operations; the test sends it `Checkpoint` (a pre-copy while it runs on), `Release` (held,
//! its buffers copied and their memory released) and `Resume` (its buffers back from the image), and checks that every step it computes, before,
//! during and after, is bit for bit that of a run never checkpointed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use possum_control::{request, Request};
use serde_json::Value;

mod common;
use common::libpossum;

/// Bound on every wait for something that should happen.
const WAIT: Duration = Duration::from_secs(30);

/// The simulated runtime and the job built into `dir`; `None` (said) without a C compiler.
fn build(dir: &Path) -> Option<PathBuf> {
    match possum_hip::build_runtime(dir).and_then(|_| possum_hip::build_session_job(dir)) {
        Ok(job) => Some(job),
        Err(possum_hip::BuildError::NoCompiler(e)) => {
            eprintln!("SKIPPED: no C compiler for the simulated HIP runtime ({e}) [hip_session]");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// The job running `steps` steps (unbounded: `None`), its stdout into `out`.
fn start(job: &Path, code: &Path, steps: Option<u32>, preload: bool, out: &Path) -> Child {
    start_with(job, code, steps, preload, out, &[])
}

/// [`start`] with `env` added to the job's environment.
fn start_with(
    job: &Path,
    code: &Path,
    steps: Option<u32>,
    preload: bool,
    out: &Path,
    env: &[(&str, &str)],
) -> Child {
    let dir = out.parent().unwrap();
    let mut cmd = Command::new(job);
    cmd.envs(env.iter().copied());
    cmd.arg(code);
    if let Some(n) = steps {
        cmd.arg(n.to_string());
    }
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("POSSUM_") || k.starts_with("FAKE_") || k == "LD_PRELOAD" {
            cmd.env_remove(k);
        }
    }
    if preload {
        cmd.env("LD_PRELOAD", libpossum())
            .env("POSSUM_SOCKET_DIR", dir.join("sockets"))
            .env("POSSUM_VERBOSE", "1");
    }
    cmd.stdin(Stdio::null())
        .stdout(std::fs::File::create(out).unwrap())
        .stderr(std::fs::File::create(out.with_extension("stderr")).unwrap())
        .current_dir(dir)
        .spawn()
        .unwrap()
}

/// The `step N DIGEST` lines in `out`, as (N, DIGEST), in order.
fn steps(out: &Path) -> Vec<(u32, String)> {
    possum_hip::session_job_steps(&std::fs::read_to_string(out).unwrap_or_default())
}

/// Waits until the job has printed step `n` (or more); its last step.
fn wait_step(out: &Path, n: u32, job: &mut Child) -> u32 {
    let t = Instant::now();
    loop {
        if let Some(&(last, _)) = steps(out).last() {
            if last >= n {
                return last;
            }
        }
        if let Ok(Some(st)) = job.try_wait() {
            panic!(
                "the job ended ({st}) before step {n}: {}",
                std::fs::read_to_string(out.with_extension("stderr")).unwrap_or_default()
            );
        }
        assert!(t.elapsed() < WAIT, "no step {n} in {WAIT:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn ask(job: &Child, dir: &Path, req: &Request) -> Value {
    request(job.id(), &dir.join("sockets"), req, WAIT).unwrap_or_else(|e| panic!("{req:?}: {e}"))
}

#[test]
fn a_hip_job_is_checkpointed_while_it_runs_released_and_resumed_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(status) = session(tmp.path(), &possum_hip::kernels_code_object()) else {
        return;
    };
    assert_eq!(
        status["possum"]["hip"]["opaque_launches"], 0,
        "every kernel's layout is known: {status}"
    );
    // The DAG saw the kernels and every buffer they and the copies touched.
    let dag = &status["possum"]["dag"];
    assert!(dag["buffers"].as_u64().unwrap() >= 5, "{status}");
    assert!(dag["kernels"].as_u64().unwrap() >= 3, "{status}");
}

/// A code object whose metadata possum cannot read (the runtime runs its kernels all the same):
/// said in the job's log, its kernels' launches taken to write every buffer, and the
/// checkpoint as exact.
#[test]
fn kernels_of_a_code_object_possum_cannot_read_are_taken_to_write_everything() {
    let tmp = tempfile::tempdir().unwrap();
    let mut code = std::fs::read(possum_hip::kernels_code_object()).unwrap();
    let at = code
        .windows(14)
        .position(|w| w == b"amdhsa.kernels")
        .expect("the metadata's kernel list");
    code[at + 13] = b'X';
    let bad = tmp.path().join("unreadable.hsaco");
    std::fs::write(&bad, code).unwrap();
    let Some(status) = session(tmp.path(), &bad) else {
        return;
    };
    assert!(
        status["possum"]["hip"]["opaque_launches"].as_u64().unwrap() > 0,
        "{status}"
    );
    let log = std::fs::read_to_string(tmp.path().join("job.stderr")).unwrap();
    assert!(
        log.contains("cannot be read") && log.contains("taken to write every buffer"),
        "{log}"
    );
}

/// Runs the job on code object `code` under libpossum.so in `dir` through a pre-copy, a
/// release and a resume, and checks every step against a run never checkpointed; the job's
/// status before the checkpoint (`None`: skipped, no C compiler).
fn session(dir: &Path, code: &Path) -> Option<Value> {
    let exe = build(dir)?;
    let out = dir.join("job.out");
    let mut job = start(&exe, code, None, true, &out);
    struct Kill<'a>(&'a mut Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    wait_step(&out, 5, &mut job);

    let first = ask(&job, dir, &Request::Status);
    assert_eq!(first["runtime"], "hip", "{first}");
    let hip = &first["possum"]["hip"];
    assert!(hip["served_allocs"].as_u64().unwrap() >= 3, "{first}");
    assert!(hip["graph_launches"].as_u64().unwrap() >= 1, "{first}");
    assert_eq!(first["possum"]["unmanaged"]["allocations"], 0, "{first}");

    // The pre-copy: the job runs on while its buffers are copied.
    let img = dir.join("img");
    let before = steps(&out).len();
    let ck = ask(
        &job,
        dir,
        &Request::Checkpoint {
            dir: img.display().to_string(),
            parent: None,
        },
    );
    assert!(ck.get("error").is_none(), "{ck}");
    assert!(
        ck["precopy"][0]["buffers"].as_u64().unwrap() >= 3,
        "x, y and z: {ck}"
    );
    let at = wait_step(&out, steps(&out).last().unwrap().0 + 3, &mut job);
    assert!(
        steps(&out).len() > before,
        "the job stepped on after the pre-copy"
    );

    // The release: held, its buffers saved and their memory released.
    let rel = ask(&job, dir, &Request::Release);
    assert!(rel.get("error").is_none(), "{rel}");
    // x, y and z, and the step's pool block or scratch buffer if it was held inside a step.
    assert!(rel["released_bytes"].as_u64().unwrap() >= 3 << 20, "{rel}");
    assert!(
        rel["final"][0]["image_buffers"].as_u64().unwrap() >= 3,
        "{rel}"
    );
    let held_at = steps(&out).last().unwrap().0;
    assert!(held_at >= at);
    let status = ask(&job, dir, &Request::Status);
    let engine = &status["possum"]["engines"][0]["engine"];
    assert_eq!(engine["resident_bytes"], 0, "{status}");
    assert_eq!(engine["phase"], "released", "{status}");
    std::thread::sleep(Duration::from_millis(100));
    let still = steps(&out).last().unwrap().0;
    assert!(
        still <= held_at + 1,
        "a held job finishes at most the step it was in: {held_at} then {still}"
    );

    // The resume: its buffers come back from the image and it goes on.
    let res = ask(
        &job,
        dir,
        &Request::Resume {
            dir: Some(img.display().to_string()),
        },
    );
    assert!(res.get("error").is_none(), "{res}");
    assert_eq!(res["restoring"][0], 0, "{res}");
    let last = wait_step(&out, still + 20, &mut job);
    drop(Kill(&mut job));

    // Every step, before, during and after, as in a run never checkpointed.
    let seen = steps(&out);
    let ref_out = dir.join("ref.out");
    let mut reference = start(&exe, code, Some(last), false, &ref_out);
    assert!(reference.wait().unwrap().success());
    let want = steps(&ref_out);
    assert_eq!(want.len(), last as usize);
    for (n, digest) in &seen {
        assert_eq!(
            digest,
            &want[*n as usize - 1].1,
            "step {n} differs (held at {held_at})"
        );
    }
    assert!(
        seen.len() >= last as usize - 1,
        "{} of {last} steps",
        seen.len()
    );
    Some(first)
}

/// The simulated runtime's broad test program (`hip-sim-job.c`: threads, pools, a captured
/// graph, virtual memory remapped, device switching) computes the same under libpossum.so as
/// without it; only the addresses it was given differ (the engine's), and so whether a pool
/// block freed and allocated again came back at the same address. Its pieces are mapped
/// again after their unmap, which possum cannot serve: with `POSSUM_SERVE_VMM=0` they are the
/// runtime's.
#[test]
fn the_simulator_program_computes_the_same_under_possum() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let Some(_) = build(dir) else { return };
    let exe = possum_hip::build_job(dir).unwrap();
    let run = |preload: bool| {
        let mut cmd = Command::new(&exe);
        cmd.arg(possum_hip::kernels_code_object())
            .env_remove("LD_PRELOAD")
            .env("POSSUM_SOCKET_DIR", dir.join("sockets"))
            .env("POSSUM_SERVE_VMM", "0");
        if preload {
            cmd.env("LD_PRELOAD", libpossum());
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let mut lines: Vec<String> = text
            .lines()
            .map(|l| match l.strip_prefix("pool ") {
                Some(rest) => format!("pool {}", rest.split_once(' ').map_or(rest, |r| r.1)),
                None => l.to_string(),
            })
            .collect();
        let addresses = lines.pop().unwrap();
        (lines, addresses)
    };
    let (plain, plain_at) = run(false);
    let (under, under_at) = run(true);
    assert!(plain.len() > 5, "{plain:?}");
    assert_eq!(plain, under);
    assert_ne!(plain_at, under_at, "possum served its allocations");
}

/// A job holding managed memory, or memory it allocated through HSA below HIP (neither of
/// which possum saves): a checkpoint is refused, naming it, before anything is done, and the
/// job runs on.
#[test]
fn a_hip_job_with_memory_possum_does_not_serve_is_refused_and_runs_on() {
    for (var, kind) in [
        ("HIP_JOB_MANAGED", "hipMallocManaged"),
        ("HIP_JOB_HSA", "hsa_amd_memory_pool_allocate"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let Some(exe) = build(dir) else { return };
        let out = dir.join("job.out");
        let code = possum_hip::kernels_code_object();
        let mut job = start_with(&exe, &code, None, true, &out, &[(var, "1")]);
        wait_step(&out, 3, &mut job);
        let img = dir.join("img");
        let r = request(
            job.id(),
            &dir.join("sockets"),
            &Request::Checkpoint {
                dir: img.display().to_string(),
                parent: None,
            },
            WAIT,
        );
        let e = r.unwrap_err().to_string();
        assert!(e.contains(kind) && e.contains("nothing was done"), "{e}");
        assert!(!img.exists(), "no image");
        let at = steps(&out).last().unwrap().0;
        wait_step(&out, at + 5, &mut job);
        let _ = job.kill();
        let _ = job.wait();
    }
}
