//! A job of two ranks doing collectives (`interposer/tests/fake/fake_ranks_job.c` on the fake
//! GPU: each rank's collective waits inside the driver until its peer launches the same one, as an
//! NCCL kernel waits on the GPU) checkpointed with `possum checkpoint --gpu-only --leave-running`
//! of the launcher: the ranks are first brought to one collective boundary, so the cut never
//! deadlocks, both ranks' images stand at the same collective, and the job's output equals an
//! uninterrupted run's. A rank that cannot reach the boundary, or dies during the cut, fails the
//! checkpoint naming it, and every rank runs on with no barrier left.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

#[path = "support/cli.rs"]
#[allow(dead_code)]
mod cli;
use cli::{possum_in as possum, text};

#[path = "../../criu-adapter/tests/support/criu.rs"]
mod criu_support;

#[path = "../../interposer/tests/common/mod.rs"]
#[allow(dead_code)]
mod common;

const MARKER: u32 = 0xc011_ec71;

fn setup(test: &str) -> Option<(tempfile::TempDir, PathBuf)> {
    let Some(lib) = common::find_libpossum() else {
        eprintln!("{test}: SKIPPED: libpossum.so not built (cargo test --workspace builds it)");
        return None;
    };
    let tmp = tempfile::Builder::new()
        .prefix("possum-ranks-")
        .tempdir()
        .unwrap();
    let interposer = Path::new(env!("CARGO_MANIFEST_DIR")).join("../interposer");
    // The job linked against a stand-in NCCL (its communicator calls), as PyTorch links NCCL.
    let nccl = tmp.path().join("libnccl.so.2");
    let built = common::cc(&[
        "-O1",
        "-shared",
        "-fPIC",
        "-Wl,-soname,libnccl.so.2",
        "-o",
        nccl.to_str().unwrap(),
        interposer.join("tests/fake/fake_nccl.c").to_str().unwrap(),
    ]);
    (built
        && common::build_fake_gpu_linked(
            &interposer,
            tmp.path(),
            "tests/fake/fake_ranks_job.c",
            "fake_ranks_job",
            &["-l:libnccl.so.2"],
        ))
    .then_some((tmp, lib))
}

/// The launcher and its two ranks.
struct Ranks {
    child: Child,
    ranks: [i32; 2],
    /// Each rank's start time (`/proc/PID/stat`), so that a PID taken since by another process
    /// (another test's, restored by CRIU with it) is never killed for it.
    started: [Option<u64>; 2],
}

/// Process `pid`'s start time, in clock ticks after boot.
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for (r, started) in self.ranks.into_iter().zip(self.started) {
            if started.is_some() && start_time(r) == started {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(r),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &Path, lib: Option<&Path>, log: &str, env: &[(&str, &str)]) -> Ranks {
    // The launcher's output goes to a file, which a CRIU restore of the job opens again.
    let out = dir.join(format!("{log}.out"));
    let mut cmd = common::fake_job_command(dir, "fake_ranks_job", lib);
    cmd.env("FAKE_RANKS_SHM", dir.join(format!("{log}.shm")))
        .env("FAKE_RANKS_LOG", dir.join(log))
        .env("POSSUM_SOCKET_DIR", dir.join("sockets"))
        .envs(env.iter().copied())
        .stdout(std::fs::File::create(&out).unwrap())
        // A file of its own (a CRIU restore opens it again), not the test's output.
        .stderr(std::fs::File::create(dir.join(format!("{log}.stderr"))).unwrap());
    // A session of its own: CRIU dumps a job only if it leads its session (under a
    // container's PID namespace the test's own session leader is outside it).
    // SAFETY: setsid is async-signal-safe and touches no memory of this process.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            nix::unistd::setsid().map(|_| ()).map_err(Into::into)
        });
    }
    let child = cmd.spawn().unwrap();
    let t = Instant::now();
    let pids: Vec<i32> = loop {
        let first = lines(&out).into_iter().next().unwrap_or_default();
        if let Some(p) = first.strip_prefix("ranks ") {
            break p.split_whitespace().map(|p| p.parse().unwrap()).collect();
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no ranks line");
        std::thread::sleep(Duration::from_millis(5));
    };
    Ranks {
        child,
        ranks: [pids[0], pids[1]],
        started: [start_time(pids[0]), start_time(pids[1])],
    }
}

fn lines(p: &Path) -> Vec<String> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Each rank's log (`job.R`) has `steps` lines, those of the reference run (`ref.R`).
fn same_as_reference(dir: &Path, steps: usize) {
    for r in 0..2 {
        let (got, want) = (
            lines(&dir.join(format!("job.{r}"))),
            lines(&dir.join(format!("ref.{r}"))),
        );
        assert_eq!(got.len(), steps, "rank {r}");
        assert!(
            got == want,
            "rank {r}: the output differs from the run without possum"
        );
    }
}

fn wait_lines(p: &Path, n: usize) {
    let t = Instant::now();
    while lines(p).len() < n {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{} stalled",
            p.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The job with rank 1 stopped in host work before the collective of step 30 (rank 0 goes on
/// into that collective and waits there for it), once rank 1 is there.
fn stalled_job(dir: &Path, lib: &Path) -> Ranks {
    let env = [
        ("FAKE_STEPS", "1000"),
        ("FAKE_STEP_US", "1000"),
        ("FAKE_STALL_RANK", "1"),
        ("FAKE_STALL_AT", "30"),
    ];
    let job = start(dir, Some(lib), "job", &env);
    wait_lines(&dir.join("job.1"), 30);
    job
}

/// `possum checkpoint --gpu-only --leave-running` of `launcher` into `dir/img`, started, with a
/// cut deadline of `deadline_ms`.
fn spawn_checkpoint(dir: &Path, launcher: u32, img: &str, deadline_ms: &str) -> Child {
    possum(dir)
        .env("POSSUM_CUT_DEADLINE_MS", deadline_ms)
        .args(["checkpoint", &launcher.to_string()])
        .args(["--gpu-only", "--leave-running", "-D"])
        .arg(dir.join(img))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Rank `pid`'s collective barrier (`possum status`): null when none is up.
fn barrier(dir: &Path, pid: i32) -> serde_json::Value {
    let s = possum(dir)
        .args(["status", &pid.to_string(), "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&s.stdout).trim()).unwrap();
    v["possum"]["session"]["collectives"]["barrier"].clone()
}

/// Waits (30 s at most, else fails saying `otherwise`) until rank `pid` has a barrier up, or
/// with `up` false none.
fn barrier_becomes(dir: &Path, pid: i32, up: bool, otherwise: &str) {
    let t = Instant::now();
    while barrier(dir, pid).is_null() == up {
        assert!(t.elapsed() < Duration::from_secs(30), "{otherwise}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every (rank, collectives) the rank's buffer W records in the GPU images under `img`: the
/// buffer starts with the marker, its rank and the collectives it ran.
fn collectives_in_image(img: &Path) -> Vec<(u32, u32)> {
    let mut found = Vec::new();
    let mut stack = vec![img.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "bin") {
                let b = std::fs::read(&p).unwrap();
                let w = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
                let mut i = 0;
                while i + 12 <= b.len() {
                    if w(i) == MARKER && w(i + 4) < 2 {
                        found.push((w(i + 4), w(i + 8)));
                    }
                    i += 4;
                }
            }
        }
    }
    found.sort_unstable();
    found
}

#[test]
fn ranks_are_cut_at_one_collective_boundary_and_run_on_bit_exact() {
    let Some((tmp, lib)) = setup("ranks cut") else {
        return;
    };
    let dir = tmp.path();
    // (Long enough that a slow machine's three checkpoints all come before its end.)
    let steps = "1000";
    let env = [("FAKE_STEPS", steps), ("FAKE_STEP_US", "2000")];
    // The reference: the same job without possum.
    let mut reference = start(dir, None, "ref", &env);
    assert!(reference.child.wait().unwrap().success());

    let mut job = start(dir, Some(&lib), "job", &env);
    let launcher = job.child.id() as i32;
    for (n, at) in [(1, 20), (2, 90), (3, 160)] {
        wait_lines(&dir.join("job.0"), at);
        let img = dir.join(format!("img{n}"));
        let out = possum(dir)
            .args(["checkpoint", &launcher.to_string()])
            .args(["--gpu-only", "--leave-running", "--json", "-D"])
            .arg(&img)
            .output()
            .unwrap();
        assert!(out.status.success(), "checkpoint {n}: {}", text(&out));
        let v: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
        assert!(
            v["figures"]["ranks_cut_ms"].is_number(),
            "checkpoint {n}: no cut across ranks: {v}"
        );
        // Both ranks' buffers in the image, at the same collective.
        let found = collectives_in_image(&img);
        assert_eq!(found.len(), 2, "checkpoint {n}: {found:?}");
        assert_eq!(found[0].0, 0);
        assert_eq!(found[1].0, 1);
        assert_eq!(
            found[0].1, found[1].1,
            "checkpoint {n}: the ranks' images stand at different collectives: {found:?}"
        );
    }
    assert!(job.child.wait().unwrap().success());
    same_as_reference(dir, 1000);
}

#[test]
fn a_rank_that_never_reaches_the_boundary_or_dies_fails_the_cut_naming_it() {
    let Some((tmp, lib)) = setup("ranks stall") else {
        return;
    };
    let dir = tmp.path();
    let job = stalled_job(dir, &lib);
    let launcher = job.child.id();
    let out = spawn_checkpoint(dir, launcher, "img-behind", "1500")
        .wait_with_output()
        .unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains(&format!("rank {} launched 30 of the 31", job.ranks[1])),
        "{t}"
    );
    assert!(t.contains("the job runs on"), "{t}");
    assert!(!dir.join("img-behind").exists());
    // No barrier left in either rank.
    for r in job.ranks {
        assert!(barrier(dir, r).is_null(), "rank {r}");
    }

    // The stalled rank killed while possum waits for it: the checkpoint fails at once, naming it.
    let pending = spawn_checkpoint(dir, launcher, "img-dead", "60000");
    // (Once possum waits in the cut: the barrier is up in rank 0.)
    barrier_becomes(dir, job.ranks[0], true, "no barrier went up");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(job.ranks[1]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let out = pending.wait_with_output().unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(t.contains(&format!("rank {}", job.ranks[1])), "{t}");
    assert!(!dir.join("img-dead").exists());
}

#[test]
fn a_rank_that_maps_imported_memory_is_refused_before_anything_is_held() {
    let Some((tmp, lib)) = setup("ranks imported") else {
        return;
    };
    let dir = tmp.path();
    // Rank 0 maps memory through a shareable handle, as NCCL maps its peers' buffers (the
    // driver's own, POSSUM_SERVE_VMM=0, with no keeper to export possum's).
    let env = [
        ("FAKE_STEPS", "200"),
        ("FAKE_STEP_US", "2000"),
        ("FAKE_IMPORT", "1"),
        ("POSSUM_SERVE_VMM", "0"),
    ];
    let mut job = start(dir, Some(&lib), "job", &env);
    let launcher = job.child.id() as i32;
    wait_lines(&dir.join("job.0"), 20);
    let out = possum(dir)
        .args(["checkpoint", &launcher.to_string(), "--leave-running", "-D"])
        .arg(dir.join("img"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains(&format!(
            "process {} maps memory another process shared with it (1 mappings",
            job.ranks[0]
        )),
        "{t}"
    );
    assert!(t.contains("nothing was done"), "{t}");
    assert!(!dir.join("img").exists());
    // Nothing was held: both ranks run to their end.
    assert!(job.child.wait().unwrap().success());
    assert_eq!(lines(&dir.join("job.0")).len(), 200);
    assert_eq!(lines(&dir.join("job.1")).len(), 200);
}

#[test]
fn possum_killed_during_the_cut_leaves_no_barrier_behind() {
    let Some((tmp, lib)) = setup("ranks guard") else {
        return;
    };
    let dir = tmp.path();
    // Rank 1 never reaches the boundary: possum waits in the cut until it is killed.
    let job = stalled_job(dir, &lib);
    let mut ckpt = spawn_checkpoint(dir, job.child.id(), "img", "60000");
    // The barrier is up in rank 0 (at the boundary rank 1 never reaches) ...
    barrier_becomes(dir, job.ranks[0], true, "no barrier went up");
    // ... until possum dies: its guard lifts it.
    ckpt.kill().unwrap();
    ckpt.wait().unwrap();
    barrier_becomes(dir, job.ranks[0], false, "the barrier outlived possum");
    assert!(!dir.join("img").exists());
}

/// Ranks in an NCCL communicator one of whose ranks is not in the job's tree (as on another
/// host): the checkpoint is refused before anything is held, naming the ranks and the count,
/// and the job runs on to its end; with every rank in the tree, the same job is checkpointed.
#[test]
fn a_communicator_with_a_rank_outside_the_tree_is_refused_before_anything_is_held() {
    let Some((tmp, lib)) = setup("ranks peer outside") else {
        return;
    };
    let dir = tmp.path();
    let env = [
        ("FAKE_STEPS", "200"),
        ("FAKE_STEP_US", "2000"),
        ("FAKE_NCCL_NRANKS", "3"),
    ];
    let mut job = start(dir, Some(&lib), "outside", &env);
    let launcher = job.child.id() as i32;
    wait_lines(&dir.join("outside.0"), 20);
    let out = possum(dir)
        .args(["checkpoint", &launcher.to_string()])
        .args(["--gpu-only", "--leave-running", "-D"])
        .arg(dir.join("img-outside"))
        .output()
        .unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    let mut ranks = job.ranks;
    ranks.sort_unstable();
    assert!(
        t.contains(&format!(
            "processes {}, {} of the job have ranks",
            ranks[0], ranks[1]
        )) && t.contains("NCCL communicator of 3 ranks")
            && t.contains("only 2 are in the job's tree")
            && t.contains("nothing was done"),
        "{t}"
    );
    assert!(!dir.join("img-outside").exists());
    for r in job.ranks {
        assert!(barrier(dir, r).is_null(), "rank {r}");
    }
    assert!(job.child.wait().unwrap().success(), "the job ran on");

    // Every rank in the tree: checkpointed.
    let env = [
        ("FAKE_STEPS", "200"),
        ("FAKE_STEP_US", "2000"),
        ("FAKE_NCCL_NRANKS", "2"),
    ];
    let mut job = start(dir, Some(&lib), "inside", &env);
    let launcher = job.child.id() as i32;
    wait_lines(&dir.join("inside.0"), 20);
    let out = possum(dir)
        .args(["checkpoint", &launcher.to_string()])
        .args(["--gpu-only", "--leave-running", "-D"])
        .arg(dir.join("img-inside"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(job.child.wait().unwrap().success());
}

/// `possum status PID --json` of a rank.
fn status_of(dir: &Path, pid: i32) -> serde_json::Value {
    let s = possum(dir)
        .args(["status", &pid.to_string(), "--json"])
        .output()
        .unwrap();
    serde_json::from_str(String::from_utf8_lossy(&s.stdout).trim()).unwrap()
}

/// [`setup`] for a test that runs CRIU (skipped without it, unless required), this process a
/// subreaper: the ranks, orphaned by the launcher's kill and restored by CRIU apart from this
/// process, are its to reap.
fn setup_criu(test: &str) -> Option<(tempfile::TempDir, PathBuf)> {
    let found = setup(test)?;
    criu_support::criu_or_skip(test)?;
    possum_criu::set_child_subreaper().unwrap();
    Some(found)
}

/// Held by a test while it checkpoints and restores with CRIU: one at a time in this file, so
/// that no test's processes or CRIU's come and go during another's dump or restore.
static CRIU_TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn criu_turn() -> std::sync::MutexGuard<'static, ()> {
    CRIU_TURN.lock().unwrap_or_else(|p| p.into_inner())
}

/// The job whose ranks share memory (`FAKE_PEER_SHARE`), `steps` steps of `step_us`, served
/// from a keeper started for it, once rank 1 has logged 20 steps: the keeper and the job.
fn peer_job(dir: &Path, lib: &Path, steps: &str, step_us: &str) -> (cli::KeeperProcess, Ranks) {
    let (keeper, keeper_dir) = cli::start_keeper(dir);
    let env = [
        ("FAKE_STEPS", steps),
        ("FAKE_STEP_US", step_us),
        ("FAKE_PEER_SHARE", "1"),
        ("POSSUM_KEEPER", keeper_dir.to_str().unwrap()),
    ];
    let job = start(dir, Some(lib), "job", &env);
    wait_lines(&dir.join("job.1"), 20);
    (keeper, job)
}

/// `possum checkpoint` of the job (CRIU and the fake driver), `args` added, which must succeed:
/// its stdout.
fn checkpoint_ranks(dir: &Path, job: &Ranks, img: &Path, args: &[&str]) -> String {
    let out = cli::possum_checkpointing_in(dir)
        .args(["checkpoint", &job.child.id().to_string()])
        .args(args)
        .arg("-D")
        .arg(img)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The job killed by its checkpoint: the launcher and both ranks reaped.
fn reaped(job: &mut Ranks) {
    assert!(!job.child.wait().unwrap().success(), "killed");
    for r in job.ranks {
        reap(r);
    }
}

/// `possum restore -D img`, `args` added.
fn restore_ranks(dir: &Path, img: &Path, args: &[&str]) -> std::process::Output {
    cli::possum_checkpointing_in(dir)
        .arg("restore")
        .args(args)
        .arg("-D")
        .arg(img)
        .env("LD_LIBRARY_PATH", dir)
        .output()
        .unwrap()
}

/// Two ranks that map each other's memory as NCCL's ranks on one host do (rank 0's memory
/// exported, its fd passed to rank 1 over a Unix socket, imported and mapped there), their
/// memory served from a keeper: `possum checkpoint --leave-running`, CRIU and the driver
/// included, releases rank 1's mapping before the driver's lock (the fake driver, like
/// NVIDIA's, cannot restore a process holding imported memory) and maps the same memory again
/// at the resume. Rank 1's running value kept in that memory, and both ranks' output, equal an
/// uninterrupted run's.
#[test]
fn ranks_mapping_each_other_s_memory_are_checkpointed_and_run_on_bit_exact() {
    let Some((tmp, lib)) = setup_criu("ranks peer memory") else {
        return;
    };
    let _turn = criu_turn();
    let dir = tmp.path();
    // (Long enough that a slow machine's checkpoint, CRIU's dump included, comes before its
    // end.)
    let env = [
        ("FAKE_STEPS", "1000"),
        ("FAKE_STEP_US", "2000"),
        ("FAKE_PEER_SHARE", "1"),
    ];
    let mut reference = start(dir, None, "ref", &env);
    assert!(reference.child.wait().unwrap().success());
    assert_eq!(lines(&dir.join("ref.1")).len(), 1000);

    let (_keeper, mut job) = peer_job(dir, &lib, env[0].1, env[1].1);
    let before = status_of(dir, job.ranks[1]);
    assert_eq!(before["possum"]["imports"]["mapped_now"], 1, "{before}");
    checkpoint_ranks(dir, &job, &dir.join("img"), &["--leave-running"]);
    let done = lines(&dir.join("job.1")).len();
    assert!(done < 1000, "the checkpoint came after the job's end");

    // Released for the driver's lock, and mapped again.
    let after = status_of(dir, job.ranks[1]);
    let imports = &after["possum"]["imports"];
    assert_eq!(imports["released_at_checkpoints"], 1, "{after}");
    assert_eq!(imports["mapped_now"], 1, "{after}");
    let exporter = status_of(dir, job.ranks[0]);
    assert_eq!(
        exporter["possum"]["vmm"]["pieces_shared_now"], 1,
        "{exporter}"
    );
    assert!(job.child.wait().unwrap().success());
    same_as_reference(dir, 1000);
}

/// The same job killed by its checkpoint and restored by `possum restore`: the exporting rank's
/// memory waits with the keeper, the importing rank maps it again at its resume, and the job
/// finishes as an uninterrupted run does.
#[test]
fn ranks_mapping_each_other_s_memory_are_killed_and_restored_bit_exact() {
    let Some((tmp, lib)) = setup_criu("ranks peer memory restored") else {
        return;
    };
    let _turn = criu_turn();
    let dir = tmp.path();
    // (Long enough that a slow machine's checkpoint, CRIU's dump included, comes before its
    // end.)
    let env = [
        ("FAKE_STEPS", "600"),
        ("FAKE_STEP_US", "3000"),
        ("FAKE_PEER_SHARE", "1"),
    ];
    let mut reference = start(dir, None, "ref", &env);
    assert!(reference.child.wait().unwrap().success());

    let (_keeper, mut job) = peer_job(dir, &lib, env[0].1, env[1].1);
    let img = dir.join("img");
    let v = checkpoint_ranks(dir, &job, &img, &["--json"]);
    reaped(&mut job);
    let at = lines(&dir.join("job.1")).len();
    assert!(at < 600, "the checkpoint came after the job's end: {v}");

    let out = restore_ranks(dir, &img, &["--json"]);
    assert!(
        out.status.success(),
        "{}\nCRIU's errors:\n{}",
        text(&out),
        criu_errors(&img)
    );
    let r: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    assert_eq!(r["gpu_from_keeper"], true, "{r}");
    let t = Instant::now();
    while !lines(&dir.join("job.out")).iter().any(|l| l == "done") {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the restored job did not finish: {:?}",
            lines(&dir.join("job.out"))
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    same_as_reference(dir, 600);
}

/// The lines of CRIU's restore logs under `img` that say what went wrong, for a failure's
/// message (its last lines are often only the teardown).
fn criu_errors(img: &Path) -> String {
    let Ok(entries) = std::fs::read_dir(img.join("criu")) else {
        return String::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("restore"))
        .flat_map(|e| {
            std::fs::read_to_string(e.path())
                .unwrap_or_default()
                .lines()
                .filter(|l| {
                    ["Error", "Warn", "fail", "plugin", "killed", "exited"]
                        .iter()
                        .any(|w| l.contains(w))
                })
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Reaps `pid` (adopted by this subreaper) once it has exited.
fn reap(pid: i32) {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    let t = Instant::now();
    loop {
        match waitpid(nix::unistd::Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => {}
            Ok(_) => return,
            Err(_) if !Path::new(&format!("/proc/{pid}")).exists() => return,
            Err(_) => {}
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "process {pid} lives on: {:?}",
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The same job killed by its checkpoint, its keeper gone too: the exporting rank's memory is
/// made anew from the image, so the memory the importing rank mapped cannot be had again; the
/// restore fails naming it, and the image stays.
#[test]
fn ranks_mapping_each_other_s_memory_whose_keeper_is_gone_are_not_restored_half() {
    let Some((tmp, lib)) = setup_criu("ranks peer memory keeper gone") else {
        return;
    };
    let _turn = criu_turn();
    let dir = tmp.path();
    let (keeper, mut job) = peer_job(dir, &lib, "600", "3000");
    let img = dir.join("img");
    checkpoint_ranks(dir, &job, &img, &[]);
    reaped(&mut job);
    drop(keeper);
    let out = restore_ranks(dir, &img, &[]);
    assert!(!out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains(&format!(
            "the memory process {} shared with this one",
            job.ranks[0]
        )) && t.contains("the image is intact"),
        "{t}\nCRIU's errors:\n{}",
        criu_errors(&img)
    );
    // Nothing of the job runs; the image stays, for a restore elsewhere.
    for r in job.ranks {
        reap(r);
    }
    assert!(img.join("possum.json").is_file());
}
