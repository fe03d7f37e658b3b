//! `possum checkpoint` on its default path (engine possum, no flag) of a job whose GPU work
//! reaches possum through the driver's entry points (POSSUM_HOOKS unset), end to end on the fake
//! GPU stack of the interposer's tests, with real CRIU: the checkpoint holds the job at the op
//! gate after a pre-copy, takes the fake driver's checkpoint and CRIU's dump, leaves the job
//! running, and the job goes on with exactly the data of a run without possum; then the job is
//! killed, `possum restore` brings it back from the image (CRIU, the driver's restore, possum's
//! resume with buffers back on demand) and the restored process does the same steps again, ends
//! with the same data and exits cleanly.
//!
//! The job (`interposer/tests/fake/fake_session_job.c`, FAKE_VIA=entry) reads its commands from a
//! FIFO (`FAKE_CMDS`) and answers into a file opened O_APPEND: CRIU reopens both by path at the
//! restore, where pipes to this test would come back connected to nothing. The fake driver's
//! checkpoint state is the job's own (`FAKE_CKPT_IN_PROCESS=1` in possum's environment), as the
//! real driver's is, so the restored job is CHECKPOINTED for `possum restore`'s driver restore.
//!
//! Needs root and CRIU: without either it prints `SKIPPED: ...` on stderr and passes; with
//! `POSSUM_REQUIRE_CRIU=1` (as CI sets) it fails instead.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "support/criu_cli.rs"]
mod support;
use support::cli::{
    checkpoint_killed_after, possum_checkpointing_in as possum, start_keeper, start_keeper_with,
    KeeperProcess,
};
use support::session_job::Job;
use support::{common, plugin_dir, run_ok, say, session_job_setup as setup, text, WAIT};

use serde_json::{json, Value};

/// Binds `$dir` and `$lib` of `$setup` (a [`setup`]) for a test, its temporary directory kept
/// to the test's end; returns from the test where it is skipped.
macro_rules! set_up {
    (let ($dir:ident, $lib:ident) = $setup:expr) => {
        let Some((tmp, $lib)) = $setup else {
            return;
        };
        let $dir = tmp.path();
    };
    (let $bound:pat = $setup:expr) => {
        let Some($bound) = $setup else {
            return;
        };
    };
}

/// The reference run: the job without possum, through step 5 and the commands after the
/// checkpoint, to its end: the buffers to expect.
fn reference_run(dir: &Path) -> [Vec<u8>; 2] {
    reference_run_with(dir, &[])
}

/// [`reference_run`] of the job started with `env` added.
fn reference_run_with(dir: &Path, env: &[(&str, &str)]) -> [Vec<u8>; 2] {
    let mut reference = job_at_step_5(dir, "reference", None, env);
    let want = reference.after_checkpoint(dir, "reference");
    reference.run("exit", "bye");
    want
}

/// The job (under `lib` if given, with `env` added), ready, after its first 5 steps.
fn job_at_step_5(dir: &Path, name: &str, lib: Option<&Path>, env: &[(&str, &str)]) -> Job {
    let mut job = Job::spawn(dir, name, lib, env);
    job.expect("ready");
    job.run("step 5", "done 5");
    job
}

/// The reference run ([`reference_run`]), then the job under libpossum.so (`lib`) at step 5,
/// ready to be checkpointed.
fn reference_then_job(dir: &Path, lib: &Path) -> ([Vec<u8>; 2], Job) {
    (
        reference_run(dir),
        job_at_step_5(dir, "job", Some(lib), &[]),
    )
}

/// [`reference_then_job`], the reference and the job started with `env` added.
fn reference_then_job_with(dir: &Path, lib: &Path, env: &[(&str, &str)]) -> ([Vec<u8>; 2], Job) {
    (
        reference_run_with(dir, env),
        job_at_step_5(dir, "job", Some(lib), env),
    )
}

/// The commands after the checkpoint run by `job` (named `tag`), which must give exactly the
/// reference's buffers `want` (`what` says which run it is).
fn goes_on_like(job: &mut Job, dir: &Path, tag: &str, want: &[Vec<u8>; 2], what: &str) {
    let got = job.after_checkpoint(dir, tag);
    same(
        &got[0],
        &want[0],
        &format!("{what}, after step 9 and the malloc"),
    );
    same(&got[1], &want[1], &format!("{what}, after step 12"));
}

/// [`goes_on_like`], then the job exits when asked.
fn goes_on_then_exits(job: &mut Job, dir: &Path, tag: &str, want: &[Vec<u8>; 2], what: &str) {
    goes_on_like(job, dir, tag, want, what);
    job.run("exit", "bye");
}

/// The restored `job` goes on like the reference (`want`), its three buffers back from possum's
/// image (CRIU's has none: they were released before the dump), and exits cleanly.
fn restored_goes_on(job: &mut Job, dir: &Path, want: &[Vec<u8>; 2]) {
    restored_goes_on_before_exit(job, dir, want);
    finish_restored(job);
}

/// [`restored_goes_on`] up to the job's exit.
fn restored_goes_on_before_exit(job: &mut Job, dir: &Path, want: &[Vec<u8>; 2]) {
    goes_on_like(job, dir, "restored", want, "restored");
    let back = restored_buffers(job.pid as u32, &dir.join("sockets"));
    assert_eq!(back["buffers"], 3, "{back}");
    // Once every buffer is back: how long the job waited for them, and on which.
    assert!(back["job_waited_ms"].as_f64().is_some(), "{back}");
    assert!(back["waited_on"].as_array().is_some(), "{back}");
}

/// The restored `job` exits cleanly when asked.
fn finish_restored(job: &mut Job) {
    job.run("exit", "bye");
    let exit = possum_criu::wait_for_exit(job.pid, Some(WAIT)).unwrap();
    job.pid = 0;
    assert!(
        exit.success(),
        "restored job: {exit}; stderr:\n{}",
        job.log()
    );
}

fn same(got: &[u8], want: &[u8], what: &str) {
    assert!(
        got == want,
        "{what}: the buffers differ from the run without possum ({} vs {} bytes, first at byte \
         {:?})",
        got.len(),
        want.len(),
        got.iter().zip(want).position(|(g, w)| g != w)
    );
}

/// Files in `dir` (recursively) whose name ends with `suffix`.
fn count_files(dir: &Path, suffix: &str) -> usize {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| {
                    let p = e.path();
                    if p.is_dir() {
                        count_files(&p, suffix)
                    } else {
                        usize::from(p.to_string_lossy().ends_with(suffix))
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

/// The figures of the restore of the job's buffers from possum's image (`possum.session.last
/// .restore` of its status), once it has finished.
fn restored_buffers(pid: u32, sockets: &Path) -> Value {
    let t = Instant::now();
    loop {
        let v = possum_control::request(pid, sockets, &possum_control::Request::Status, WAIT)
            .unwrap_or_else(|e| panic!("status of the restored job: {e}"));
        let r = &v["possum"]["session"]["last"]["restore"];
        if r.get("ms").is_some() || r.get("error").is_some() {
            assert!(r.get("error").is_none(), "restore failed: {r}");
            return r.clone();
        }
        assert!(t.elapsed() < WAIT, "the restore did not finish: {v}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn an_entry_point_job_is_checkpointed_left_running_and_restored_bit_exact() {
    let t0 = Instant::now();
    set_up!(let (dir, lib) = setup("entry_checkpoint", "possum-entry-ckpt-"));

    let (want, mut job) = reference_then_job(dir, &lib);

    // The default path: no engine flag; the job stays running.
    let img = dir.join("img");
    let t = Instant::now();
    let v = checkpoint_left_running(dir, job.pid, &img, &job);
    let checkpoint_time = t.elapsed();
    assert_eq!(v["engine"], "possum", "{v}");
    assert_eq!(v["hooks"], "entry", "{v}");
    assert_eq!(v["leave_running"], true, "{v}");
    let hold = v["hold"].as_str().unwrap_or("");
    assert!(
        hold.starts_with("op gate (the driver's entry points)"),
        "{v}"
    );
    assert!(v["figures"]["criu_dump_ms"].as_f64().is_some(), "{v}");
    // CRIU's dump was made ready beside the cut and the driver's checkpoint.
    assert!(v["figures"]["criu_ready_ms"].as_f64().is_some(), "{v}");
    // Its buffers come back on demand after it runs again: what it waits on them is not known
    // when the command returns, and the stall is the hold.
    assert_eq!(v["figures"]["job_waited_ms"], Value::Null, "{v}");
    assert_eq!(v["figures"]["stall_ms"], v["figures"]["hold_ms"], "{v}");
    // The image: possum's manifest, the GPU image, CRIU's.
    assert!(img.join("possum.json").is_file());
    assert!(img.join("gpu/gpu-0").is_dir());
    assert!(count_files(&img.join("gpu"), ".bin") > 0, "no GPU data");
    for f in ["inventory.img", "pstree.img"] {
        assert!(img.join("criu").join(f).is_file(), "no CRIU {f}");
    }
    assert!(
        v["release_report"]["released_bytes"].as_u64().unwrap_or(0) > 0,
        "the buffers were not released before the dump: {v}"
    );
    // The context's stack reserve was lowered for the driver's checkpoint (the fake driver's
    // 1 KiB per thread is 64 MiB); the fake's kernels fail while it is 0, so the job going on
    // below shows it was set back before its next launch, here and after the restore.
    assert_eq!(
        v["release_report"]["context_trimmed_bytes"],
        64 << 20,
        "the context was not trimmed: {v}"
    );
    assert!(
        v["figures"]["gpu_image_bytes"].as_u64().unwrap_or(0) >= 2 << 20,
        "{v}"
    );
    // `possum inspect` reads it back: the job, its GPU image, every chunk checked.
    let out = run_ok(
        possum(dir)
            .args(["inspect", "--verify", "--json", "-D"])
            .arg(&img),
    );
    let i: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(i["pid"], job.pid, "{i}");
    assert_eq!(i["gpu"][0]["device"], 0, "{i}");
    assert_eq!(i["gpu"][0]["verified"], "ok", "{i}");
    assert_eq!(i["gpu"][0]["format"], "1.1", "{i}");
    assert!(i["gpu"][0]["bytes"].as_u64().unwrap_or(0) >= 2 << 20, "{i}");
    assert_eq!(
        i["gpu"][0]["fingerprinted_chunks"], i["gpu"][0]["chunks"],
        "{i}"
    );
    // A directory that is no image is named as such.
    let out = possum(dir)
        .args(["inspect", "-D"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is not a possum image"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Left running: it goes on with exactly the reference's data.
    goes_on_like(&mut job, dir, "left", &want, "left running");

    // Killed, then restored from the image: it goes on from step 5 as the reference did.
    let pid = job.pid;
    kill_job(&mut job);
    // The directory of the job's bound sockets (libpossum's control socket) is gone, as after a
    // job that cleaned up or on another machine: the restore makes it again for CRIU.
    let sockets = dir.join("sockets");
    std::fs::remove_dir_all(&sockets).unwrap();
    let t = Instant::now();
    let r = json_of(
        possum(dir).args(["restore", "--json", "-D"]).arg(&img),
        &job,
    );
    let restore_time = t.elapsed();
    assert_eq!(r["pid"], pid, "{r}");
    // Its buffers come back on demand as it runs: its waits on them are not known yet.
    assert_eq!(r["figures"]["job_waited_ms"], Value::Null, "{r}");
    assert_eq!(
        r["recreated_socket_dirs"],
        serde_json::json!([sockets]),
        "{r}"
    );
    restored_goes_on(&mut job, dir, &want);
    say(&format!(
        "entry_checkpoint: checkpoint {checkpoint_time:?} (stall {} ms, hold: {hold}), restore \
         {restore_time:?}, whole test {:?}",
        v["figures"]["stall_ms"],
        t0.elapsed()
    ));
}

/// A driver whose `cuCheckpointProcessCheckpoint` never returns (the fake's `FAKE_CKPT_HANG`):
/// `possum checkpoint --leave-running` stops waiting at the driver's deadline (shortened here
/// with `POSSUM_DRIVER_DEADLINE_MS`), fails naming the phase, the call and the pid, leaves no
/// image, and the job runs on with exactly the reference's data (the guard unlocked it in the
/// driver and resumed its buffers).
#[test]
fn a_hung_driver_checkpoint_fails_at_its_deadline_and_the_job_runs_on() {
    set_up!(let (dir, lib) = setup("entry_hung_driver", "possum-entry-hung-"));
    let (want, mut job) = reference_then_job(dir, &lib);
    let img = dir.join("img");
    // `possum checkpoint --leave-running` with `call` hanging, the deadline `ms`: what it said.
    let hung = |call: &str, ms: &str| {
        let out = checkpoint_cmd(dir, job.pid, &img, &["--leave-running"])
            .env("FAKE_CKPT_HANG", call)
            .env("POSSUM_DRIVER_DEADLINE_MS", ms)
            .output()
            .unwrap();
        let said = text(&out);
        assert!(!out.status.success(), "{said}");
        said
    };
    let said = hung("cuCheckpointProcessCheckpoint", "1000");
    for want in [
        "the job runs on, no image was written".to_string(),
        "the freeze (the driver's lock and checkpoint of the job's tree)".to_string(),
        format!(
            "cuCheckpointProcessCheckpoint for pid {} did not return within 1 s",
            job.pid
        ),
    ] {
        assert!(said.contains(&want), "no {want:?} in:\n{said}");
    }
    assert!(!img.exists(), "an image was left: {said}");
    let left: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("possum-tmp"))
        .collect();
    assert!(left.is_empty(), "temporary images left: {left:?}");
    // A state query that hangs stops the plan, before anything is done.
    let said = hung("cuCheckpointProcessGetState", "500");
    assert!(
        said.contains("the plan: the driver did not answer in time")
            && said.contains("cuCheckpointProcessGetState for pid"),
        "{said}"
    );
    assert!(!img.exists(), "an image was left: {said}");
    let after = "after a hung driver checkpoint";
    goes_on_then_exits(&mut job, dir, "left", &want, after);
}

/// A job that maps its own virtual memory piece by piece (PyTorch's expandable segments:
/// cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess), its buffer B spanning two
/// pieces, with `POSSUM_SERVE_VMM=1`: the pieces are engine buffers at the job's addresses
/// (its status counts them), released for the checkpoint and back after it, and the job goes
/// on bit-exact left running and restored; at its end it unmaps and releases them (possum's
/// handles) and frees its range.
#[test]
fn a_job_s_own_virtual_memory_is_served_and_checkpointed_bit_exact() {
    set_up!(let (dir, lib) = setup("entry_vmm", "possum-entry-vmm-"));
    let env = [("FAKE_VMM", "1"), ("POSSUM_SERVE_VMM", "1")];
    let want = reference_run_with(dir, &env);
    let mut job_env = env.to_vec();
    // No keeper: the export of a piece is refused (the memory is the job's own).
    job_env.push(("FAKE_VMM_HANDLE_CHECKS", "refused"));
    let mut job = job_at_step_5(dir, "job", Some(&lib), &job_env);
    let st = job_status(&job, dir);
    let vmm = &st["possum"]["vmm"];
    assert_eq!(vmm["pieces_mapped_now"], 2, "{st}");
    assert_eq!(vmm["handles_live"], 2, "{st}");
    assert_eq!(vmm["left_to_driver"], 0, "{st}");
    // The refused export (FAKE_VMM_HANDLE_CHECKS) is said on stderr, verbose or not, with the way out.
    assert!(
        job.log()
            .contains("run this job with POSSUM_SERVE_VMM=0 to leave such memory to the driver"),
        "{}",
        job.log()
    );
    // A and C (cudaMalloc) and B's two pieces.
    assert_eq!(st["possum"]["engines"][0]["engine"]["buffers"], 4, "{st}");
    assert_eq!(st["possum"]["unmanaged"]["allocations"], 0, "{st}");

    let img = dir.join("img");
    left_running_after_releasing(dir, &mut job, &img, &want, 4 << 20);

    // At its end, possum's handles unmapped and released and the range freed ("bye" only if
    // all succeeded).
    killed_restored_goes_on(dir, &mut job, &img, &want, 4);
}

/// `job`'s `possum status` (libpossum's own answer).
fn job_status(job: &Job, dir: &Path) -> Value {
    possum_control::request(
        job.pid as u32,
        &dir.join("sockets"),
        &possum_control::Request::Status,
        WAIT,
    )
    .unwrap()
}

/// `possum checkpoint --leave-running` of `job` into `img`, which released at least `bytes` of
/// its buffers; the job then goes on like the reference (`want`).
fn left_running_after_releasing(
    dir: &Path,
    job: &mut Job,
    img: &Path,
    want: &[Vec<u8>; 2],
    bytes: u64,
) {
    let v = checkpoint_left_running(dir, job.pid, img, job);
    let released = v["release_report"]["released_bytes"].as_u64().unwrap_or(0);
    assert!(
        released >= bytes,
        "{released} bytes released, not {bytes}: {v}"
    );
    goes_on_like(job, dir, "left", want, "left running");
}

/// `job` killed, restored from `img`: it goes on like the reference (`want`), `buffers` of its
/// buffers back from the image, and exits cleanly.
fn killed_restored_goes_on(
    dir: &Path,
    job: &mut Job,
    img: &Path,
    want: &[Vec<u8>; 2],
    buffers: u64,
) {
    kill_job(job);
    let r = restore_json(dir, img, job);
    assert_eq!(r["pid"], job.pid, "{r}");
    goes_on_like(job, dir, "restored", want, "restored");
    let back = restored_buffers(job.pid as u32, &dir.join("sockets"));
    assert_eq!(back["buffers"], buffers, "{back}");
    finish_restored(job);
}

/// The job of the keeper tests, at step 5: B the job's own virtual memory (`FAKE_VMM`), served
/// by possum from a keeper of its own, `more` added to its environment; with the reference run's
/// buffers.
struct VmmKeeperJob {
    tmp: tempfile::TempDir,
    _keeper: KeeperProcess,
    keeper_dir: PathBuf,
    want: [Vec<u8>; 2],
    job: Job,
}

fn vmm_keeper_job(test: &str, prefix: &str, more: &[(&str, &str)]) -> Option<VmmKeeperJob> {
    let (tmp, lib) = setup(test, prefix)?;
    let dir = tmp.path();
    let (keeper, keeper_dir) = start_keeper(dir);
    let mut env = vec![
        ("FAKE_VMM", "1"),
        ("POSSUM_SERVE_VMM", "1"),
        ("POSSUM_KEEPER", keeper_dir.to_str().unwrap()),
    ];
    env.extend_from_slice(more);
    let want = reference_run_with(dir, &env[..1]);
    let job = job_at_step_5(dir, "job", Some(&lib), &env);
    Some(VmmKeeperJob {
        job,
        want,
        keeper_dir,
        _keeper: keeper,
        tmp,
    })
}

/// The same job with a keeper (`possum run`'s default): B's pieces are the keeper's memory, kept
/// on the GPU through a kept `--leave-running` checkpoint (nothing copied while held; saved with
/// `--shadow-budget 0`, by copy-on-write) and through a checkpoint-and-kill whose restore maps
/// them again at the job's addresses (zero-copy); bit-exact both times, and the kept image too.
#[test]
fn a_job_s_own_virtual_memory_stays_with_the_keeper() {
    // Bound in this order, dropped in the other: the job, then the keeper, then the directory.
    set_up!(let VmmKeeperJob { tmp, _keeper, keeper_dir, want, mut job } =
        vmm_keeper_job("entry_vmm_keeper", "possum-entry-vmm-k-", &[]));
    let dir = tmp.path();
    let mut k = possum_keeper::Keeper::connect(&keeper_dir.join("keeper-0.sock")).unwrap();
    let before = k.stats().unwrap().clients[&job.pid].bytes;
    assert!(
        before >= 6 << 20,
        "A, C and B's two pieces in the keeper: {before}"
    );

    // No shadow budget: the save copies each buffer ahead of the job's writes instead (a write
    // through one piece of B copies both first).
    let img = dir.join("img-kept");
    let v = json_of(
        &mut checkpoint_cmd(
            dir,
            job.pid,
            &img,
            &["--leave-running", "--shadow-budget", "0"],
        ),
        &job,
    );
    assert_eq!(v["kept"], serde_json::json!([job.pid]), "{v}");
    assert_eq!(v["release_report"]["kept_bytes"], before, "{v}");
    let saved = &v["saved_report"][0]["report"]["saved"][0];
    assert_eq!(saved["snapshot_shadows"], 0, "{v}");
    assert_eq!(saved["buffers"], 4, "{v}");
    stall_is_hold_and_waits(&v);
    goes_on_like(&mut job, dir, "kept", &want, "kept, left running");

    let img2 = dir.join("img-killed");
    checkpoint_and_kill_holding(dir, &mut job, &img2, &[], json!([0]));
    restored_from(dir, &img2, &job, true);
    // The killed job had run the commands after the first checkpoint: its restored self ends
    // as the reference did after them.
    let end = job.dump(&dir.join("killed-end.bin"));
    same(&end, &want[1], "restored from the keeper's memory");
    finish_restored(&mut job);

    // The kept image, saved while the job ran on: the state at its T0 (step 5), from the image
    // (the keeper's memory of it was taken back long since).
    let r = restored_from(dir, &img, &job, false);
    job.pid = r["pid"].as_i64().unwrap() as i32;
    goes_on_like(
        &mut job,
        dir,
        "kept-restored",
        &want,
        "the kept image restored",
    );
    finish_restored(&mut job);
}

/// The same job exporting a piece of its memory (`cuMemExportToShareableHandle`: an fd of it
/// from the keeper, checked in the job), which another process may write without its hooks
/// seeing it: its `--leave-running` checkpoint is not kept (its save would run while others may
/// write) but copies what was written since the pre-copy, the shared piece included, while the
/// job is held, and its memory stays with the keeper through the driver's checkpoint, to be
/// mapped again at the same addresses (the allocation a peer imported is still the same);
/// bit-exact, and so is the image restored.
#[test]
fn a_job_sharing_its_memory_is_copied_while_held_not_kept() {
    let more = [("FAKE_VMM_HANDLE_CHECKS", "shared")];
    // Bound in this order, dropped in the other: the job, then the keeper, then the directory.
    set_up!(let VmmKeeperJob { tmp, _keeper, want, mut job, .. } =
        vmm_keeper_job("entry_vmm_shared", "possum-entry-vmm-s-", &more));
    let dir = tmp.path();
    let st = job_status(&job, dir);
    assert_eq!(st["possum"]["vmm"]["handles_shared"], 1, "{st}");
    assert_eq!(st["possum"]["vmm"]["pieces_shared_now"], 1, "{st}");
    let img = dir.join("img");
    let v = checkpoint_left_running(dir, job.pid, &img, &job);
    assert_eq!(v["kept"], serde_json::json!([]), "{v}");
    // The shared piece copied again while held, though its own hooks saw no write to it.
    let finals = &v["release_report"]["final"][0];
    assert!(finals["buffers"].as_u64().unwrap() >= 1, "{v}");
    holds_for_restore(&v, json!([0]));
    assert_eq!(
        v["resume_report"]["attached"],
        serde_json::json!([0]),
        "{v}"
    );
    goes_on_like(&mut job, dir, "shared", &want, "sharing, left running");
    // The image holds the job at step 5.
    job.run("exit", "bye");
    let _ = possum_criu::wait_for_exit(job.pid, Some(WAIT));
    let r = restore_json(dir, &img, &job);
    job.pid = r["pid"].as_i64().unwrap() as i32;
    goes_on_like(
        &mut job,
        dir,
        "shared-restored",
        &want,
        "the image restored",
    );
    finish_restored(&mut job);
}

/// A kept checkpoint (nothing copied before the release: the save runs after it, the job going
/// on) of a job that shares a piece of its memory once the checkpoint began: that save would not
/// see what another process writes there, so the release is refused with the reason and the
/// checkpoint undone (the job not held, nothing tracked); the job goes on bit-exact.
#[test]
fn a_job_sharing_its_memory_after_a_kept_checkpoint_began_is_not_released() {
    // Bound in this order, dropped in the other: the job, then the keeper, then the directory.
    set_up!(let VmmKeeperJob { tmp, _keeper, want, mut job, .. } =
        vmm_keeper_job("entry_vmm_shared_late", "possum-entry-vmm-l-", &[]));
    let dir = tmp.path();
    let (pid, sockets) = (job.pid as u32, dir.join("sockets"));
    let img = dir.join("img");
    let ask = |req: &possum_control::Request| possum_control::request(pid, &sockets, req, WAIT);
    let v = ask(&possum_control::Request::CheckpointKept {
        dir: img.to_str().unwrap().into(),
        parent: None,
    })
    .unwrap();
    assert_eq!(v["kept"], true, "{v}");
    job.run("share", "shared");
    let err = ask(&possum_control::Request::Release)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("shared 1 pieces of its memory") && err.contains("checkpoint undone"),
        "{err}"
    );
    let st = job_status(&job, dir);
    assert_eq!(st["possum"]["session"]["paused"], false, "{st}");
    assert_eq!(st["possum"]["vmm"]["pieces_shared_now"], 1, "{st}");
    assert_eq!(
        st["possum"]["engines"][0]["engine"]["tracking"], false,
        "{st}"
    );
    goes_on_then_exits(
        &mut job,
        dir,
        "shared-late",
        &want,
        "its kept release refused",
    );
}

/// A job whose C and D are stream-ordered allocations (cuMemAllocAsync: cudaMallocAsync), with
/// `POSSUM_SERVE_POOLS=1`: they are carved out of an engine buffer (a slab; its status counts
/// them), a block freed in stream order (cuMemFreeAsync) is reused, and the job goes on
/// bit-exact left running and restored, then frees them in stream order at its end.
#[test]
fn a_job_s_stream_ordered_allocations_are_served_and_checkpointed_bit_exact() {
    set_up!(let (dir, lib) = setup("entry_pools", "possum-entry-pools-"));
    let env = [("FAKE_ASYNC", "1"), ("POSSUM_SERVE_POOLS", "1")];
    let (want, mut job) = reference_then_job_with(dir, &lib, &env);
    let st = job_status(&job, dir);
    let pools = &st["possum"]["pools"];
    assert_eq!(pools["serving"], true, "{st}");
    assert_eq!(pools["slabs"], 1, "{st}");
    assert_eq!(pools["blocks_live"], 1, "C: {st}");
    // A and B (cudaMalloc) and the slab C is in.
    assert_eq!(st["possum"]["engines"][0]["engine"]["buffers"], 3, "{st}");
    assert_eq!(st["possum"]["unmanaged"]["allocations"], 0, "{st}");

    let img = dir.join("img");
    left_running_after_releasing(dir, &mut job, &img, &want, 32 << 20);
    // D's block in the same slab; the block freed before it reused or pending, none leaked.
    let st = job_status(&job, dir);
    let pools = &st["possum"]["pools"];
    assert_eq!(pools["slabs"], 1, "{st}");
    assert_eq!(pools["blocks_live"], 2, "C and D: {st}");
    assert_eq!(
        pools["allocations_served"], 3,
        "C, the freed block, D: {st}"
    );
    // D, the size of the block freed before it on the same stream, took that block at once.
    assert_eq!(pools["reused_on_their_stream"], 1, "{st}");

    killed_restored_goes_on(dir, &mut job, &img, &want, 3);
}

/// A job with a thread that allocates and frees stream-ordered memory all the time (a block of
/// 16 MiB, a buffer of possum's own each time, and a small one from a slab), as GPT-2 with
/// cudaMallocAsync does: `possum checkpoint` with no flags, left running, then killed and
/// restored, bit-exact both times. Its frees race every step of the checkpoint: the pre-copy
/// rounds starting (on the H100 a round once copied a buffer freed under it), the hold (a buffer
/// freed after T0 is in the image but not in the job: the restore skips it), and the pause (a
/// thread past it must not allocate before the resume).
#[test]
fn a_job_freeing_all_the_time_is_checkpointed_and_restored_bit_exact() {
    set_up!(let (dir, lib) = setup("entry_churn", "possum-entry-churn-"));
    let env = [("FAKE_ASYNC", "1"), ("FAKE_CHURN", "1")];
    let (want, mut job) = reference_then_job_with(dir, &lib, &env);
    let img = dir.join("img-left");
    let v = checkpoint_left_running(dir, job.pid, &img, &job);
    let served = job_status(&job, dir)["possum"]["pools"]["allocations_served"]
        .as_u64()
        .unwrap_or(0);
    assert!(served > 100, "the churn ran: {served} served; {v}");
    goes_on_like(&mut job, dir, "left", &want, "left running");

    // The same job again (its buffers at step 5 are the reference's at step 5 once more).
    let mut job = {
        job.run("exit", "bye");
        job_at_step_5(dir, "job2", Some(&lib), &env)
    };
    let img2 = dir.join("img-kill");
    checkpoint_left_running(dir, job.pid, &img2, &job);
    kill_job(&mut job);
    let r = restore_json(dir, &img2, &job);
    assert_eq!(r["pid"], job.pid, "{r}");
    goes_on_like(&mut job, dir, "restored", &want, "restored");
    finish_restored(&mut job);
}

/// [`a_job_freeing_all_the_time_is_checkpointed_and_restored_bit_exact`] with a keeper
/// (`possum run`'s default): a kept checkpoint (its buffers drained while the job frees and
/// allocates on), then a checkpoint-and-kill restored from the keeper's memory; bit-exact both
/// times.
#[test]
fn a_job_freeing_all_the_time_is_kept_and_restored_from_its_keeper_bit_exact() {
    set_up!(let (dir, lib) = setup("entry_churn_keeper", "possum-entry-churn-k-"));
    let (_keeper, keeper_dir) = start_keeper(dir);
    let env = [
        ("FAKE_ASYNC", "1"),
        ("FAKE_CHURN", "1"),
        ("POSSUM_KEEPER", keeper_dir.to_str().unwrap()),
    ];
    let want = reference_run_with(dir, &env[..2]);
    let mut job = job_at_step_5(dir, "job", Some(&lib), &env);
    let v = checkpoint_left_running(dir, job.pid, &dir.join("img-kept"), &job);
    assert_eq!(v["kept"], serde_json::json!([job.pid]), "{v}");
    stall_is_hold_and_waits(&v);
    goes_on_like(&mut job, dir, "kept", &want, "kept, left running");

    let mut job = {
        job.run("exit", "bye");
        job_at_step_5(dir, "job2", Some(&lib), &env)
    };
    let img = dir.join("img-killed");
    checkpoint_and_kill_holding(dir, &mut job, &img, &[], json!([0]));
    restored_from(dir, &img, &job, true);
    goes_on_like(&mut job, dir, "restored", &want, "restored from the keeper");
    finish_restored(&mut job);
}

/// A job whose stderr is a pipe to a process outside it (`possum run job 2>&1 | tee log`): CRIU
/// would restore that pipe with nobody reading it. The restored job writes to `possum
/// restore`'s own stderr instead (CRIU's inherit_fd), or to /dev/null when that is a pipe too,
/// and goes on bit-exact.
#[test]
fn a_restored_job_whose_stderr_was_a_pipe_writes_to_the_restore_s() {
    set_up!(let (dir, lib) = setup("stdio_pipe", "possum-stdio-pipe-"));
    let want = reference_run(dir);
    let (rd, wr) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    let mut cmd = common::fake_job_command(dir, "fake_session_job", Some(&lib));
    cmd.env("FAKE_VIA", "entry");
    let mut job = Job::spawn_cmd_to(dir, "job", cmd, Some(Stdio::from(wr)));
    // The job's first stderr, read here (this process is outside the job's tree).
    let first = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut File::from(rd), &mut s);
        s
    });
    job.expect("ready");
    job.run("step 5", "done 5");
    let img = dir.join("img");
    let v = json_of(&mut checkpoint_cmd(dir, job.pid, &img, &[]), &job);
    let mut child = job.child.take().unwrap();
    child.wait().unwrap();
    assert!(
        first.join().unwrap().contains("possum:"),
        "the job logged nothing before"
    );
    let m: Value =
        serde_json::from_str(&std::fs::read_to_string(img.join("possum.json")).unwrap()).unwrap();
    assert_eq!(m["stdio_pipes"][0][0], 2, "{m}\n{v}");
    assert!(
        m["stdio_pipes"][0][1]
            .as_str()
            .is_some_and(|k| k.starts_with("pipe:[")),
        "{m}"
    );
    // Restored by a command whose stderr is itself a pipe (a script capturing it): the job's
    // gets /dev/null instead (the script would otherwise wait for the job's end); it runs on.
    let (rd2, wr2) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    let out = run_ok(
        possum(dir)
            .args(["restore", "--json", "-D"])
            .arg(&img)
            .stdout(Stdio::piped())
            .stderr(Stdio::from(wr2)),
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["stdio_discarded"], serde_json::json!([2]), "{r}");
    assert_eq!(r["stdio_from_restore"], serde_json::json!([]), "{r}");
    job.pid = r["pid"].as_i64().unwrap() as i32;
    let mut got = String::new();
    let _ = std::io::Read::read_to_string(&mut File::from(rd2), &mut got);
    assert!(!got.contains("possum: restore done"), "{got}");
    job.run("step 1", "done 6");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(job.pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    possum_criu::wait_for_exit(job.pid, Some(WAIT)).unwrap();

    // Restored again, by a command whose stderr is a file (a terminal would do the same): the
    // job's stderr is that file, and it goes on bit-exact.
    let log = dir.join("restore.stderr");
    let out = run_ok(
        possum(dir)
            .args(["restore", "--json", "-D"])
            .arg(&img)
            .stdout(Stdio::piped())
            .stderr(File::create(&log).unwrap()),
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["stdio_from_restore"], serde_json::json!([2]), "{r}");
    job.pid = r["pid"].as_i64().unwrap() as i32;
    restored_goes_on(&mut job, dir, &want);
    let later = std::fs::read_to_string(&log).unwrap();
    assert!(
        later.contains("possum: "),
        "the restored job's stderr did not reach the restore's: {later:?}"
    );
}

/// `possum checkpoint PID --json -D IMG --socket-dir DIR/sockets`, with `extra` flags.
/// A kept checkpoint's figures: the time the job waited on the saves (each device's
/// `job_waited_ms`, known once saved) counted in the stall, with the hold.
fn stall_is_hold_and_waits(v: &Value) {
    let f = &v["figures"];
    let ms = |x: &Value| {
        x.as_f64()
            .unwrap_or_else(|| panic!("not a number: {x} in {v}"))
    };
    let saves: f64 = v["saved_report"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["report"]["saved"].as_array().unwrap())
        .map(|d| ms(&d["job_waited_ms"]))
        .sum();
    let waited = ms(&f["job_waited_ms"]);
    assert!((waited - saves).abs() < 0.01, "{v}");
    assert!(
        (ms(&f["stall_ms"]) - (ms(&f["hold_ms"]) + waited)).abs() < 0.01,
        "{v}"
    );
    assert!(f["waited_on"].is_array(), "{v}");
}

fn checkpoint_cmd(dir: &Path, pid: i32, img: &Path, extra: &[&str]) -> Command {
    let mut c = possum(dir);
    c.args(["checkpoint", &pid.to_string(), "--json"])
        .args(extra)
        .arg("-D")
        .arg(img)
        .arg("--socket-dir")
        .arg(dir.join("sockets"));
    c
}

/// `possum checkpoint --leave-running --json` of `pid` into `img`: its JSON.
fn checkpoint_left_running(dir: &Path, pid: i32, img: &Path, job: &Job) -> Value {
    json_of(
        &mut checkpoint_cmd(dir, pid, img, &["--leave-running"]),
        job,
    )
}

/// `possum restore --json -D IMG` (the fake driver on LD_LIBRARY_PATH, for a keeper it starts),
/// which must succeed: its JSON.
fn restore_json(dir: &Path, img: &Path, job: &Job) -> Value {
    json_of(
        possum(dir)
            .args(["restore", "--json", "-D"])
            .arg(img)
            .env("LD_LIBRARY_PATH", dir),
        job,
    )
}

/// [`restore_json`] with possum's CRIU plugin from `libdir` (what a split image needs).
fn restore_json_plugin(dir: &Path, img: &Path, job: &Job, libdir: &Path) -> Value {
    json_of(
        possum(dir)
            .args(["restore", "--json", "-D"])
            .arg(img)
            .env("LD_LIBRARY_PATH", dir)
            .env("POSSUM_CRIU_PLUGIN_DIR", libdir),
        job,
    )
}

/// Runs a `possum ... --json` command, which must succeed (else: its output and `job`'s stderr),
/// and returns its JSON.
fn json_of(cmd: &mut Command, job: &Job) -> Value {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}\njob's stderr:\n{}",
        text(&out),
        job.log()
    );
    serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim())
        .unwrap_or_else(|e| panic!("{e}: {}", text(&out)))
}

#[test]
fn a_tree_of_two_cuda_processes_is_checkpointed_and_restored_together() {
    set_up!(let (dir, lib) = setup("entry_checkpoint tree", "possum-tree-ckpt-"));
    // The job starts a second CUDA process (its own context in the fake driver, libpossum.so
    // loaded in it too, a buffer E it bumps and writes out on SIGUSR1).
    let child_dump = dir.join("child-e.bin");
    let mut job = Job::spawn(
        dir,
        "tree",
        Some(&lib),
        &[
            ("FAKE_CHILD", "1"),
            ("FAKE_CHILD_DUMP", child_dump.to_str().unwrap()),
        ],
    );
    let line = job.next();
    let child: i32 = line
        .strip_prefix("child ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no child line: {line:?}"));
    job.expect("ready");
    job.run("step 3", "done 3");
    assert_eq!(
        child_e(child, &child_dump, &job),
        expected_e(1),
        "child, before"
    );

    // A checkpoint that fails after both processes' buffers were released (the driver refuses
    // the lock): the guard resumes both, the child's buffer comes back, no image is left.
    let out = possum(dir)
        .env("FAKE_CKPT_LOCK_UNSUPPORTED", "1")
        .args([
            "checkpoint",
            &job.pid.to_string(),
            "--leave-running",
            "--json",
        ])
        .arg("-D")
        .arg(dir.join("img0"))
        .arg("--socket-dir")
        .arg(dir.join("sockets"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("the job runs on"), "{}", text(&out));
    assert!(!dir.join("img0").exists());
    assert_eq!(
        child_e(child, &child_dump, &job),
        expected_e(2),
        "child, after a failed checkpoint"
    );

    let v = checkpoint_left_running(dir, job.pid, &dir.join("img1"), &job);
    assert_eq!(v["cuda_children"], serde_json::json!([child]), "{v}");
    // possum's engine in the child too: its buffer was saved into the image, released, and is
    // back on demand in the child left running.
    assert_eq!(v["possum_children"], serde_json::json!([child]), "{v}");
    let child_img = dir.join("img1").join(format!("gpu-{child}"));
    assert!(
        count_files(&child_img, ".bin") > 0,
        "no GPU data of the child in {}",
        child_img.display()
    );
    assert_eq!(
        child_e(child, &child_dump, &job),
        expected_e(3),
        "child, left running"
    );
    // Both are running again in the driver: a second checkpoint of the tree is accepted (one left
    // locked or checkpointed would be refused, named).
    job.run("step 2", "done 5");
    let v = checkpoint_left_running(dir, job.pid, &dir.join("img2"), &job);
    assert_eq!(v["cuda_children"], serde_json::json!([child]), "{v}");
    assert_eq!(
        child_e(child, &child_dump, &job),
        expected_e(4),
        "child, left running"
    );
    job.run("step 1", "done 6");

    // Both killed, the tree restored from the second image: the parent goes on from step 5, the
    // child is back (CRIU restores it under its pid) and running in the driver again.
    let pid = job.pid;
    let mut parent = job.child.take().unwrap();
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child),
        nix::sys::signal::Signal::SIGKILL,
    );
    parent.kill().unwrap();
    parent.wait().unwrap();
    let _ = possum_criu::wait_for_exit(child, Some(WAIT));
    json_of(
        possum(dir)
            .args(["restore", "--json", "-D"])
            .arg(dir.join("img2")),
        &job,
    );
    assert!(
        std::path::Path::new(&format!("/proc/{child}")).exists(),
        "the child was not restored"
    );
    // The restored child's buffer is the one of the second image (two bumps), back from
    // possum's image of the child.
    assert_eq!(
        child_e(child, &child_dump, &job),
        expected_e(4),
        "child, restored"
    );
    // The restored answers: from the image's step 5 on.
    job.seen = std::fs::read_to_string(&job.out)
        .unwrap_or_default()
        .lines()
        .count();
    job.run("step 1", "done 6");
    let v = checkpoint_left_running(dir, pid, &dir.join("img3"), &job);
    assert_eq!(v["cuda_children"], serde_json::json!([child]), "{v}");
    job.run("exit", "bye");
    let exit = possum_criu::wait_for_exit(pid, Some(WAIT)).unwrap();
    job.pid = 0;
    assert!(
        exit.success(),
        "restored job: {exit}; stderr:\n{}",
        job.log()
    );
}

/// `criu` (the binary `possum checkpoint` would use) run as a container engine would, with
/// possum's plugin (`libdir`) and the fake driver's environment, on the images in `images`.
struct PlainCriu<'a> {
    dir: &'a Path,
    images: PathBuf,
    libdir: PathBuf,
    /// Have the plugin pass the images directory to the job (POSSUM_CRIU_PLUGIN_PASS_DIR).
    pass_dir: bool,
}

impl PlainCriu<'_> {
    /// Runs `criu ARGS --libdir LIBDIR -D IMAGES -v4 -o LOG`, which must succeed (else: the end
    /// of its log and `job`'s stderr); returns its log.
    fn run(&self, args: &[&str], log: &str, job: &Job) -> String {
        let criu = possum_criu::Criu::locate().unwrap();
        let out = Command::new(criu.binary())
            .args(args)
            .arg("--libdir")
            .arg(&self.libdir)
            .arg("-D")
            .arg(&self.images)
            .args(["-v4", "-o", log])
            .env(
                "POSSUM_CRIU_PLUGIN_PASS_DIR",
                if self.pass_dir { "1" } else { "0" },
            )
            .env("POSSUM_LIBCUDA", self.dir.join("libcuda.so.1"))
            .env("FAKE_CKPT_IN_PROCESS", "1")
            .env_remove("LD_PRELOAD")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let text = std::fs::read_to_string(self.images.join(log)).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        assert!(
            out.status.success(),
            "criu {args:?} failed: {}\n{}\njob's stderr:\n{}",
            self::text(&out),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
            job.log()
        );
        text
    }
}

/// The fake job's child's buffer E after its `k`th SIGUSR1 (each bumps it: E[i] += i * n + 1 for
/// n = 1..k), as the bytes it writes.
fn expected_e(k: u32) -> Vec<u8> {
    (0..1u32 << 16)
        .flat_map(|i| {
            let mut e = 0xe000_0000u32.wrapping_add(3u32.wrapping_mul(i));
            for n in 1..=k {
                e = e.wrapping_add(i.wrapping_mul(n)).wrapping_add(1);
            }
            e.to_le_bytes()
        })
        .collect()
}

/// Has the fake job's child bump and write out its buffer E (SIGUSR1), and returns it.
fn child_e(child: i32, path: &Path, job: &Job) -> Vec<u8> {
    // Not before the child takes the signal (it would end it).
    let ready = path.with_extension("bin.ready");
    let t = Instant::now();
    while !ready.exists() {
        assert!(t.elapsed() < WAIT, "the child never got ready");
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = std::fs::remove_file(path);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child),
        nix::sys::signal::Signal::SIGUSR1,
    )
    .unwrap();
    let t = Instant::now();
    loop {
        if let Ok(b) = std::fs::read(path) {
            return b;
        }
        assert!(
            t.elapsed() < WAIT,
            "the child did not write its buffer; job's stderr:\n{}",
            job.log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Plain `criu dump --libdir` (what a container engine runs) of a possum job, left
/// running, then `criu restore --libdir`, with no `possum` command: the plugin releases possum's
/// buffers into the images (possum-gpu-PID), takes the driver's checkpoint, brings the job back
/// at the end of the dump, and at the restore. Both go on bit-exact.
#[test]
fn plain_criu_with_the_plugin_checkpoints_and_restores_a_possum_job() {
    plain_criu_round_trip(false);
}

/// The same with the images directory passed to the job with each request, as for a job in a
/// container, which does not see CRIU's images directory at its path.
#[test]
fn plain_criu_passes_the_images_directory_to_a_job_that_cannot_see_it() {
    plain_criu_round_trip(true);
}

fn plain_criu_round_trip(pass_dir: bool) {
    set_up!(let (dir, lib) = setup("entry_checkpoint plain criu", "possum-plain-criu-"));
    let Some(libdir) = plugin_dir(dir) else {
        panic!("libpossum_criu_plugin.so is not built beside possum (cargo test --workspace)");
    };
    let (want, mut job) = reference_then_job(dir, &lib);
    let pid = job.pid;
    let images = dir.join("images");
    std::fs::create_dir(&images).unwrap();
    let criu = PlainCriu {
        dir,
        images: images.clone(),
        libdir,
        pass_dir,
    };
    let log = criu.run(&["dump", "-t", &pid.to_string(), "-R"], "dump.log", &job);
    assert!(
        log.contains(&format!("pid {pid}: checkpointed its CUDA context")),
        "{log}"
    );
    assert!(log.contains("possum's resume from"), "{log}");
    assert_eq!(
        log.contains("the images directory passed to the job"),
        pass_dir,
        "{log}"
    );
    // The fake driver's restore thread is the job's main thread, stopped by CRIU: let run for
    // the driver's restore, stopped again for CRIU.
    assert!(log.contains("restore thread"), "{log}");
    let records = std::fs::read_to_string(images.join("possum-criu-plugin.txt")).unwrap();
    assert!(
        records.contains(&format!("cuda {pid} possum possum-gpu-{pid}")),
        "{records}"
    );
    let gpu = images.join(format!("possum-gpu-{pid}"));
    assert!(
        count_files(&gpu, ".bin") > 0,
        "no GPU data in {}: the images directory holds {:?}; job's stderr:\n{}",
        gpu.display(),
        std::fs::read_dir(&images)
            .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
            .unwrap_or_default(),
        job.log()
    );

    // Left running: the plugin's resume reached it once CRIU let it go.
    goes_on_like(&mut job, dir, "left", &want, "left running");

    // Killed, then `criu restore --libdir`: the plugin restores the driver's state and resumes
    // possum from the images.
    kill_job(&mut job);
    let log = criu.run(&["restore", "--restore-detached"], "restore.log", &job);
    assert!(
        log.contains(&format!("pid {pid}: driver restored and unlocked")),
        "{log}"
    );
    assert!(log.contains("restore thread"), "{log}");
    if std::env::var_os("POSSUM_TEST_SHOW_LOG").is_some() {
        say(&log);
    }
    restored_goes_on(&mut job, dir, &want);
}

/// `possum run`'s default path: the job's buffer memory is a keeper's (`possum
/// keeper --dir`, `POSSUM_KEEPER`), so `possum checkpoint --leave-running` holds the job without
/// copying anything (its buffers detached, left with the keeper through the driver's checkpoint
/// and CRIU's dump), resumes it, and saves the buffers as they were at the hold while it runs on.
/// The job goes on bit-exact, its memory the keeper's again. Killed, its keeper ended too, and
/// restored from that image: `possum restore` starts a keeper where the job looks for one, and
/// the restored job goes on bit-exact (so the image is the state at the hold) with its memory
/// in that keeper.
#[test]
fn a_job_whose_memory_a_keeper_holds_is_saved_after_it_runs_again() {
    set_up!(let (dir, lib) = setup("keeper_checkpoint", "possum-keeper-ckpt-"));
    let (keeper, keeper_dir) = start_keeper(dir);
    let keeper_sock = keeper_dir.join("keeper-0.sock");

    let want = reference_run(dir);
    let keeper_env = keeper_dir.to_str().unwrap();
    let mut job = Job::spawn(dir, "job", Some(&lib), &[("POSSUM_KEEPER", keeper_env)]);
    job.expect("ready");
    job.run("step 5", "done 5");
    let held = |k: &mut possum_keeper::Keeper, pid: i32| {
        k.stats().unwrap().clients.get(&pid).map_or(0, |u| u.bytes)
    };
    let mut k = possum_keeper::Keeper::connect(&keeper_sock).unwrap();
    let before = held(&mut k, job.pid);
    assert!(
        before >= 3 * (2 << 20),
        "the keeper holds {before} bytes of the job's"
    );
    // `possum status` says so.
    let st = status_text(dir, &job);
    assert!(
        st.contains(&format!("memory kept by keeper {}", keeper_sock.display()))
            && st.contains("3 of the engine's mappings there, 0 its own"),
        "{st}"
    );

    let img = dir.join("img");
    let v = checkpoint_left_running(dir, job.pid, &img, &job);
    assert_eq!(v["kept"], serde_json::json!([job.pid]), "{v}");
    let rel = &v["release_report"];
    assert_eq!(rel["released_bytes"], 0, "{v}");
    assert_eq!(rel["kept_bytes"], before, "{v}");
    assert_eq!(rel["context_trimmed_bytes"], 64 << 20, "{v}");
    assert!(v["hold"].as_str().unwrap_or("").contains("keeper"), "{v}");
    let saved = &v["saved_report"][0]["report"]["saved"][0];
    assert_eq!(saved["buffers"], 3, "{v}");
    // Every buffer copied into a shadow at the hold, before the job ran on.
    assert_eq!(saved["snapshot_shadows"], 3, "{v}");
    assert!(img.join("gpu/gpu-0").is_dir());
    assert!(count_files(&img.join("gpu"), ".bin") > 0, "no GPU data");
    // The job holds its memory from the keeper again, the same amount.
    assert_eq!(held(&mut k, job.pid), before);
    assert_eq!(k.stats().unwrap().retained.allocations, 0);

    goes_on_like(&mut job, dir, "left", &want, "left running");

    kill_job(&mut job);
    std::fs::remove_dir_all(dir.join("sockets")).unwrap();
    // The keeper ended with the job (as `possum run`'s does): the restore starts one where the
    // job looks for it, and the restored job's memory is that keeper's.
    drop(k);
    drop(keeper);
    let r = restore_json(dir, &img, &job);
    assert_eq!(r["pid"], job.pid, "{r}");
    assert_eq!(r["keeper_started"], serde_json::json!(keeper_dir), "{r}");
    let mut k = possum_keeper::Keeper::connect(&keeper_sock).unwrap();
    restored_goes_on_before_exit(&mut job, dir, &want);
    // Its buffers, and the one its `malloc` command added (a 2 MiB granule).
    assert_eq!(
        held(&mut k, job.pid),
        before + (2 << 20),
        "the restored job's memory is the new keeper's"
    );
    finish_restored(&mut job);
}

/// A kept checkpoint whose keeper keeps spare image memory (`POSSUM_KEEPER_SPARE_*`): the
/// snapshot's shadows are copied by the keeper into its spare, which becomes one of
/// the image's data files (cut to what it holds), none through the staging; the keeper makes
/// another spare; the job goes on bit-exact, and killed, it is restored from that image
/// bit-exact (so the keeper's copies and checksums are the state at the hold).
#[test]
fn a_kept_checkpoint_s_shadows_go_through_the_keeper_s_spare_memory() {
    set_up!(let (dir, lib) = setup("keeper_spare", "possum-keeper-spare-"));
    let spares = dir.join("spares");
    std::fs::create_dir(&spares).unwrap();
    let (keeper, keeper_dir) = start_keeper_with(
        dir,
        &[
            ("POSSUM_KEEPER_SPARE_DIR", spares.to_str().unwrap()),
            ("POSSUM_KEEPER_SPARE_MIB", "64"),
        ],
    );
    let spare_ready = || {
        let t = Instant::now();
        loop {
            let st = possum_keeper::Keeper::connect(&keeper_dir.join("keeper-0.sock"))
                .and_then(|mut k| k.stats())
                .unwrap();
            let sp = st.spare.expect("the keeper says what spare it keeps");
            if sp.ready {
                assert_eq!((sp.bytes, sp.lent), (64 << 20, 0), "{sp:?}");
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "no spare made: {sp:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    spare_ready();
    let want = reference_run(dir);
    let keeper_env = keeper_dir.to_str().unwrap();
    let mut job = Job::spawn(dir, "job", Some(&lib), &[("POSSUM_KEEPER", keeper_env)]);
    job.expect("ready");
    job.run("step 5", "done 5");
    // `possum status` says what spare the job's keeper keeps.
    let st = status_text(dir, &job);
    assert!(
        st.contains("spare image memory of that keeper")
            && st.contains("64 MiB in")
            && st.contains("(ready)"),
        "{st}"
    );
    let img = dir.join("img");
    let v = checkpoint_left_running(dir, job.pid, &img, &job);
    let saved = &v["saved_report"][0]["report"]["saved"][0];
    assert_eq!(saved["snapshot_shadows"], 3, "{v}");
    assert_eq!(saved["shadows_saved_by_keeper"], 3, "{v}");
    // The lanes, and the spare renamed in after them, cut to its 3 buffers (each on a 2 MiB
    // boundary): far less than the 64 MiB it was.
    let gpu = img.join("gpu/gpu-0");
    let mut sizes: Vec<(String, u64)> = std::fs::read_dir(&gpu)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".bin"))
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                e.metadata().unwrap().len(),
            )
        })
        .collect();
    sizes.sort();
    let (_, spare_len) = sizes.last().unwrap().clone();
    assert!(spare_len > 0 && spare_len <= 6 << 20, "{sizes:?}");
    // Another spare is made for the next checkpoint.
    spare_ready();
    goes_on_like(&mut job, dir, "left", &want, "left running");
    kill_job(&mut job);
    std::fs::remove_dir_all(dir.join("sockets")).unwrap();
    drop(keeper);
    let r = restore_json(dir, &img, &job);
    assert_eq!(r["pid"], job.pid, "{r}");
    restored_goes_on_before_exit(&mut job, dir, &want);
    finish_restored(&mut job);
}

/// Faults around a kept checkpoint: `possum checkpoint --leave-running` of a job whose
/// memory a keeper holds, killed at moments spread over the whole checkpoint (before the hold,
/// with the buffers detached and the driver's and CRIU's steps running, while the buffers are
/// saved): the job always goes on, and DIR is absent or a complete image. Then the keeper itself
/// is killed: the job goes on on the memory it had mapped, and its next checkpoint copies
/// instead. At the end the job's data are exactly those of a run without possum.
#[test]
fn a_kept_checkpoint_survives_possum_or_the_keeper_being_killed() {
    set_up!(let (dir, lib) = setup("keeper_faults", "possum-keeper-faults-"));
    let (keeper, keeper_dir) = start_keeper(dir);
    let delays = [0u64, 30, 60, 100, 150, 200, 250, 300, 400, 500, 700];
    let steps_between = 5 + delays.len() + 1;
    let mut reference = Job::start(dir, "reference", None);
    reference.run(
        &format!("step {steps_between}"),
        &format!("done {steps_between}"),
    );
    reference.run("step 3", &format!("done {}", steps_between + 3));
    let want = reference.dump(&dir.join("reference-faults.bin"));
    reference.run("exit", "bye");

    let mut job = keeper_job(dir, &lib, &keeper_dir);
    let mut done = 5;
    let mut outcomes = Vec::new();
    for (i, delay_ms) in delays.into_iter().enumerate() {
        let img = dir.join(format!("img-{i}"));
        let mut c = checkpoint_cmd(dir, job.pid, &img, &["--leave-running"]);
        let imaged = checkpoint_killed_after(&mut c, &img, delay_ms);
        // Its CRIU, if it had started one, runs on (orphaned, adopted by this process): the next
        // checkpoint's CRIU could not attach to the job while it does.
        wait_for_orphaned_criu();
        done += 1;
        // The job answers: it was resumed (by the guard, if possum died while it was held).
        job.run("step 1", &format!("done {done}"));
        outcomes.push(format!(
            "{delay_ms} ms: {}",
            if imaged { "image" } else { "none" }
        ));
    }
    say(&format!(
        "keeper_faults: possum killed after {}",
        outcomes.join(", ")
    ));

    // The keeper killed while the job runs: it goes on, and a checkpoint copies its buffers.
    drop(keeper);
    done += 1;
    job.run("step 1", &format!("done {done}"));
    assert_eq!(done, steps_between);
    let img = dir.join("img-after-keeper");
    let v = checkpoint_left_running(dir, job.pid, &img, &job);
    assert_eq!(v["kept"], serde_json::json!([]), "{v}");
    assert!(
        v["release_report"]["released_bytes"].as_u64().unwrap_or(0) > 0,
        "{v}"
    );
    job.run("step 3", &format!("done {}", steps_between + 3));
    let got = job.dump(&dir.join("job-faults.bin"));
    same(
        &got,
        &want,
        "after the faults and a checkpoint without the keeper",
    );
}

/// Waits (at most [`WAIT`]) until no CRIU this process adopted runs: one a killed `possum`
/// started goes on attached to its job until it is done.
fn wait_for_orphaned_criu() {
    let me = std::process::id();
    let t = Instant::now();
    loop {
        let live = orphaned_criu(me);
        if live.is_empty() {
            return;
        }
        assert!(
            t.elapsed() < WAIT,
            "CRIU left by a killed possum still runs after {WAIT:?}: {live:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The live (not zombie) processes named `criu*` whose parent is `parent`.
fn orphaned_criu(parent: u32) -> Vec<u32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // `PID (COMM) STATE PPID ...`; COMM may hold spaces and parentheses.
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                return false;
            };
            let comm = &stat[open + 1..close];
            let mut rest = stat[close + 1..].split_whitespace();
            let state = rest.next().unwrap_or("Z");
            let ppid = rest.next().and_then(|p| p.parse::<u32>().ok());
            comm.starts_with("criu") && state != "Z" && ppid == Some(parent)
        })
        .collect()
}

/// A keeper whose device 0 is not the job's (another `CUDA_VISIBLE_DEVICES`; here the fake
/// driver's UUIDs differ): the job does not use its memory (it would be another GPU's), says so in
/// `possum status`, and its checkpoint copies; the job goes on bit-exact.
#[test]
fn a_keeper_on_another_gpu_is_not_used() {
    set_up!(let (dir, lib) = setup("keeper_other_gpu", "possum-keeper-other-"));
    let (_keeper, keeper_dir) = start_keeper_with(dir, &[("FAKE_UUID_SALT", "x")]);
    let (want, _) = {
        let mut reference = Job::start(dir, "reference", None);
        reference.run("step 5", "done 5");
        let want = reference.after_checkpoint(dir, "reference");
        reference.run("exit", "bye");
        (want, ())
    };
    let mut job = keeper_job(dir, &lib, &keeper_dir);
    let st = status_text(dir, &job);
    assert!(
        st.contains("keeper not used: the keeper's memory is on another GPU"),
        "{st}"
    );
    let mut k = possum_keeper::Keeper::connect(&keeper_dir.join("keeper-0.sock")).unwrap();
    assert_eq!(
        k.stats().unwrap().total.allocations,
        0,
        "the job's memory is its own"
    );
    let v = checkpoint_left_running(dir, job.pid, &dir.join("img"), &job);
    assert_eq!(v["kept"], serde_json::json!([]), "{v}");
    goes_on_like(&mut job, dir, "left", &want, "left running");
}

/// fake_session_job under libpossum.so (`lib`) with its memory from the keeper at `keeper_dir`,
/// at step 5.
fn keeper_job(dir: &Path, lib: &Path, keeper_dir: &Path) -> Job {
    keeper_job_with(dir, lib, keeper_dir, &[])
}

/// [`keeper_job`] with `more` added to the job's environment.
fn keeper_job_with(dir: &Path, lib: &Path, keeper_dir: &Path, more: &[(&str, &str)]) -> Job {
    let mut env = vec![("POSSUM_KEEPER", keeper_dir.to_str().unwrap())];
    env.extend_from_slice(more);
    job_at_step_5(dir, "job", Some(lib), &env)
}

/// The keeper killed while a kept checkpoint holds the job (its buffers detached: only the
/// keeper has them, no image yet): the resume fails with an error that says the job's GPU state
/// is lost, and the job stays paused rather than compute on with memory that is gone.
#[test]
fn a_keeper_lost_during_a_kept_hold_is_said_and_the_job_stays_paused() {
    set_up!(let (dir, lib) = setup("keeper_lost_in_hold", "possum-keeper-lost-"));
    let (keeper, keeper_dir) = start_keeper(dir);
    let job = keeper_job(dir, &lib, &keeper_dir);
    let sockets = dir.join("sockets");
    let ask = |req: &possum_control::Request| {
        possum_control::request(job.pid as u32, &sockets, req, WAIT)
    };
    let gpu = dir.join("img-gpu").display().to_string();
    let r = ask(&possum_control::Request::CheckpointKept {
        dir: gpu.clone(),
        parent: None,
    })
    .unwrap();
    assert_eq!(r["kept"], true, "{r}");
    ask(&possum_control::Request::Release).unwrap();
    drop(keeper);
    let err = ask(&possum_control::Request::ResumeAndSave {
        dir: gpu,
        shadow_mib: None,
        parent: None,
    })
    .unwrap_err();
    assert!(err.to_string().contains("GPU state is lost"), "{err}");
    let st = ask(&possum_control::Request::Status).unwrap();
    assert_eq!(st["possum"]["session"]["paused"], true, "{st}");
}

/// `possum checkpoint` (no --leave-running) of `job` into `img`, with `extra` flags: its JSON,
/// once the job it killed is reaped (its pid free for a restore).
fn checkpoint_and_kill(dir: &Path, job: &mut Job, img: &Path, extra: &[&str]) -> Value {
    killing_checkpoint(&mut checkpoint_cmd(dir, job.pid, img, extra), job)
}

/// `possum status` of `job`, as it prints it.
fn status_text(dir: &Path, job: &Job) -> String {
    let out = possum(dir)
        .args(["status", &job.pid.to_string(), "--socket-dir"])
        .arg(dir.join("sockets"))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Kills `job`'s process (this process's child) and reaps it.
fn kill_job(job: &mut Job) {
    let mut child = job.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
}

/// [`checkpoint_and_kill`], which must leave `held` (the indices of the GPUs whose memory a
/// keeper holds for the restore).
fn checkpoint_and_kill_holding(
    dir: &Path,
    job: &mut Job,
    img: &Path,
    extra: &[&str],
    held: Value,
) -> Value {
    let v = checkpoint_and_kill(dir, job, img, extra);
    holds_for_restore(&v, held);
    v
}

/// Asserts that the checkpoint whose `--json` is `v` left `held` (the indices of the GPUs
/// whose memory a keeper holds for the restore).
fn holds_for_restore(v: &Value, held: Value) {
    assert_eq!(v["release_report"]["held_for_restore"], held, "{v}");
}

/// `possum restore` of `job` from `img`, its GPU memory mapped from the keeper's or not
/// (`from_keeper`): its `--json`.
fn restored_from(dir: &Path, img: &Path, job: &Job, from_keeper: bool) -> Value {
    let r = restore_json(dir, img, job);
    assert_eq!(r["gpu_from_keeper"], from_keeper, "{r}");
    r
}

/// [`checkpoint_and_kill`] by the checkpoint command `cmd`.
fn killing_checkpoint(cmd: &mut Command, job: &mut Job) -> Value {
    let v = json_of(cmd, job);
    match job.child.take() {
        Some(mut c) => {
            c.wait().unwrap();
        }
        None => {
            possum_criu::wait_for_exit(job.pid, Some(WAIT)).unwrap();
        }
    }
    v
}

/// Checkpoint and kill of a job whose memory a keeper holds: the image is
/// complete, and the keeper keeps the job's buffers on the GPU after it is gone, so that its
/// restore on this host maps them instead of copying (zero-copy). That memory is taken back
/// only by a job holding that checkpoint's state: a restore of an older image comes back from
/// its image, and leaves the later checkpoint's memory alone. Both restored jobs compute exactly
/// what a run without possum does. The job's private memory goes through possum's CRIU plugin
/// (`possum_criu::hostmem`), not CRIU's restorer.
#[test]
fn a_job_killed_by_its_checkpoint_is_restored_from_the_memory_its_keeper_held() {
    set_up!(let (dir, lib) = setup("keeper_kill_restore", "possum-keeper-kill-"));
    let want = reference_run(dir);
    let (_keeper, keeper_dir) = start_keeper(dir);
    let keeper_sock = keeper_dir.join("keeper-0.sock");
    let mut job = keeper_job(dir, &lib, &keeper_dir);
    let mut k = possum_keeper::Keeper::connect(&keeper_sock).unwrap();
    let before = k.stats().unwrap().clients[&job.pid].bytes;

    // Killed: the image is complete, and the keeper holds the buffers for a restore. With
    // possum's CRIU plugin (`cargo test` leaves it in deps/, where `possum` does not look).
    let Some(libdir) = plugin_dir(dir) else {
        panic!("libpossum_criu_plugin.so is not built beside possum (cargo test --workspace)");
    };
    let img1 = dir.join("img1");
    let v = killing_checkpoint(
        checkpoint_cmd(dir, job.pid, &img1, &[]).env("POSSUM_CRIU_PLUGIN_DIR", &libdir),
        &mut job,
    );
    holds_for_restore(&v, json!([0]));
    assert!(
        count_files(&img1.join("gpu"), ".bin") > 0,
        "no GPU data in the image"
    );
    let s = k.stats().unwrap();
    assert_eq!(s.held.bytes, before, "held for the restore: {s:?}");
    let r = restore_json_plugin(dir, &img1, &job, &libdir);
    // The job's private memory left CRIU's images and came back through possum's CRIU plugin.
    let moved = v["figures"]["hostmem"]["moved_bytes"].as_u64().unwrap_or(0);
    assert!(moved > 0, "not split: {}", v["figures"]["hostmem"]);
    assert_eq!(r["figures"]["hostmem_fill_bytes"], moved, "{r}");
    assert_eq!(r["gpu_from_keeper"], true, "{r}");
    assert_eq!(
        r["resume_report"]["attached"],
        serde_json::json!([0]),
        "{r}"
    );
    assert_eq!(r["keeper_started"], Value::Null, "the keeper answered: {r}");
    let s = k.stats().unwrap();
    assert_eq!(s.retained.bytes, 0, "taken back: {s:?}");
    assert_eq!(s.clients[&job.pid].bytes, before, "{s:?}");
    goes_on_like(
        &mut job,
        dir,
        "zero-copy",
        &want,
        "restored from the keeper's memory",
    );

    // At its end, checkpointed and killed again (its memory held with a new epoch), then the
    // *first* image restored: its buffers must come from that image, not from the later memory
    // (which would not compute what the reference did).
    let img2 = dir.join("img2");
    checkpoint_and_kill_holding(dir, &mut job, &img2, &[], json!([0]));
    let later = k.stats().unwrap().held.bytes;
    assert_eq!(
        later,
        before + (2 << 20),
        "with the buffer its malloc added"
    );
    let r = restore_json_plugin(dir, &img1, &job, &libdir);
    assert_eq!(r["gpu_from_keeper"], false, "an older image: {r}");
    assert_eq!(
        r["resume_report"]["kept_memory_gone"],
        serde_json::json!([0]),
        "{r}"
    );
    let s = k.stats().unwrap();
    assert_eq!(
        s.retained.bytes, later,
        "the later checkpoint's memory is still held: {s:?}"
    );
    goes_on_like(
        &mut job,
        dir,
        "restored",
        &want,
        "restored from the older image",
    );

    // `--keep-on-gpu 0`: freed with the job, and the restore copies from the image.
    let img3 = dir.join("img3");
    checkpoint_and_kill_holding(dir, &mut job, &img3, &["--keep-on-gpu", "0"], json!([]));
    restored_from(dir, &img3, &job, false);
    finish_restored(&mut job);
}

/// A keeper started for a process (`--while-alive PID`, as `possum run` and `possum restore`
/// start one) outlives it while it holds a killed job's buffers for a restore, serves the
/// restored job, and ends (its sockets and directory gone) once that job is gone too.
#[test]
fn a_keeper_holding_memory_for_a_restore_outlives_the_process_it_was_started_for() {
    set_up!(let (dir, lib) = setup("keeper_outlives", "possum-keeper-outlives-"));
    let mut sleeper = Command::new("sleep").arg("600").spawn().unwrap();
    let alive = sleeper.id().to_string();
    let (keeper, keeper_dir) =
        support::cli::start_keeper_args(dir, &[], &["--while-alive", &alive]);
    let mut job = keeper_job(dir, &lib, &keeper_dir);
    let img = dir.join("img");
    checkpoint_and_kill(dir, &mut job, &img, &[]);
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    // Two of its checks (every second) and an orphan sweep later, it still serves.
    std::thread::sleep(Duration::from_secs(3));
    let mut kp = keeper;
    assert!(kp.0.try_wait().unwrap().is_none(), "the keeper ended");
    let sock = keeper_dir.join("keeper-0.sock");
    let held = possum_keeper::Keeper::connect(&sock)
        .unwrap()
        .stats()
        .unwrap()
        .held;
    assert!(held.bytes > 0, "{held:?}");
    restored_from(dir, &img, &job, true);
    job.run("step 1", "done 6");
    finish_restored(&mut job);
    // The restored job gone, its memory is freed (an orphan sweep) and the keeper ends.
    let t = Instant::now();
    let status = loop {
        if let Some(s) = kp.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < WAIT,
            "the keeper did not end: it holds {:?}",
            possum_keeper::Keeper::connect(&sock).and_then(|mut k| k.stats())
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    assert!(!keeper_dir.exists(), "its directory is removed");
}

/// The keeper killed while a kept `possum checkpoint --leave-running` holds the job (its buffers
/// detached: the keeper was the only process with a handle to them): `possum checkpoint` held fds
/// of that memory, starts a new keeper in the same directory, hands it the memory, and the job
/// attaches its buffers from there and computes exactly as a run without possum.
#[test]
fn a_keeper_killed_during_a_kept_hold_is_replaced_and_nothing_is_lost() {
    set_up!(let (dir, lib) = setup("keeper_killed_in_hold", "possum-keeper-revive-"));
    let (keeper, keeper_dir) = start_keeper(dir);
    let want = reference_run(dir);
    let mut job = keeper_job(dir, &lib, &keeper_dir);
    let sockets = dir.join("sockets");
    let img = dir.join("img");
    let ck = checkpoint_cmd(dir, job.pid, &img, &["--leave-running"])
        // The driver's checkpoint takes 1.5 s: time to kill the keeper while the job is held.
        .env("FAKE_CKPT_DELAY_MS", "1500")
        .env("LD_LIBRARY_PATH", dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    loop {
        let st = possum_control::request(
            job.pid as u32,
            &sockets,
            &possum_control::Request::Status,
            WAIT,
        )
        .unwrap();
        if st["possum"]["session"]["paused"] == true {
            break;
        }
        assert!(t.elapsed() < WAIT, "the job was never held: {st}");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Its fds taken (a few ms after the release), the keeper dies with the buffers detached.
    let memfds = || {
        let fds = std::fs::read_dir(format!("/proc/{}/fd", ck.id()))
            .into_iter()
            .flatten();
        (fds.flatten())
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .filter(|l| l.to_string_lossy().starts_with("/memfd:fakegpu"))
            .count()
    };
    while memfds() < 3 {
        assert!(
            t.elapsed() < WAIT,
            "possum took none of the keeper's memory"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(keeper);
    let out = ck.wait_with_output().unwrap();
    assert!(out.status.success(), "{}\n{}", text(&out), job.log());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let kh = &v["keeper_handles"];
    assert_eq!(kh["keeper_restarted"], true, "{v}");
    assert_eq!(kh["adopted"], kh["handles_held"], "{v}");
    assert!(kh["handles_held"].as_u64().unwrap_or(0) >= 3, "{v}");
    assert!(img.join("possum.json").is_file(), "the image is complete");
    goes_on_like(
        &mut job,
        dir,
        "revived",
        &want,
        "left running, its keeper replaced",
    );
    // The new keeper serves the job where the old one did.
    let s = possum_keeper::Keeper::connect(&keeper_dir.join("keeper-0.sock"))
        .unwrap()
        .stats()
        .unwrap();
    assert!(
        s.clients.get(&job.pid).is_some_and(|u| u.allocations >= 4),
        "{s:?}"
    );
}

/// `possum run` (its keeper started by it) of a job that `possum checkpoint` then kills: `possum
/// run` ends with the job, its keeper stays because it holds the job's buffers for a restore,
/// `possum restore` finds it (starting none) and the restored job maps them from it; once the
/// restored job is gone, the keeper ends and its directory goes.
#[test]
fn possum_runs_keeper_stays_for_a_killed_job_and_serves_its_restore() {
    set_up!(let (dir, lib) = setup("run_keeper_kill", "possum-run-keeper-"));
    let sockets = dir.join("sockets");
    let mut cmd = possum(dir);
    cmd.args(["run", "--lib"])
        .arg(&lib)
        .arg("--socket-dir")
        .arg(&sockets)
        .arg("--")
        .arg(dir.join("fake_session_job"))
        .env("LD_LIBRARY_PATH", dir)
        .env_remove("POSSUM_KEEPER");
    let mut job = Job::spawn_cmd(dir, "job", cmd);
    job.expect("ready");
    // The job is `possum run`'s child beside its keeper.
    let run = job.pid;
    let children = std::fs::read_to_string(format!("/proc/{run}/task/{run}/children")).unwrap();
    job.pid = children
        .split_whitespace()
        .filter_map(|p| p.parse::<i32>().ok())
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.contains("fake_session_job"))
        })
        .expect("the job among possum run's children");
    job.run("step 5", "done 5");
    let keeper_dir = sockets.join(format!("keeper-{run}"));
    let sock = keeper_dir.join("keeper-0.sock");
    let before = possum_keeper::Keeper::connect(&sock)
        .unwrap()
        .stats()
        .unwrap()
        .clients[&job.pid]
        .bytes;

    let img = dir.join("img");
    // Waits for `possum run` too: it ends with the job.
    checkpoint_and_kill_holding(dir, &mut job, &img, &[], json!([0]));
    let held = possum_keeper::Keeper::connect(&sock)
        .expect("the keeper outlives possum run")
        .stats()
        .unwrap()
        .held;
    assert_eq!(held.bytes, before, "{held:?}");
    let r = restored_from(dir, &img, &job, true);
    assert_eq!(r["keeper_started"], Value::Null, "{r}");
    job.run("step 1", "done 6");
    finish_restored(&mut job);
    let t = Instant::now();
    while keeper_dir.exists() {
        assert!(
            t.elapsed() < WAIT,
            "the keeper did not end after the restored job"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(possum_keeper::Keeper::connect(&sock).is_err());
}

/// A job checkpointed and killed whose keeper did not hold its memory (`--keep-on-gpu 0`),
/// restored from its image: `possum restore` has the keeper load the image
/// into new memory while CRIU restores the process, and the restored job maps that memory and
/// waits only for buffers still loading. The keeper here loads nothing until two waits are
/// pending at once (the job restores with one restorer thread, so the second is an operation's:
/// the job meets a buffer still loading however long CRIU's restore took), then loads slowly
/// (one loader) and fails one buffer on purpose: the job copies the failed one from the image
/// itself, and computes exactly what a run without possum does. The stage is gone afterwards,
/// nothing retained. With `POSSUM_RESTORE_STAGE=0` nothing is staged.
#[test]
fn a_job_restored_from_its_image_maps_memory_its_keeper_loaded_meanwhile() {
    set_up!(let (dir, lib) = setup("keeper_stage_restore", "possum-keeper-stage-"));
    let (_keeper, keeper_dir) = start_keeper_with(
        dir,
        &[
            ("POSSUM_KEEPER_STAGE_DELAY_MS", "200"),
            ("POSSUM_KEEPER_STAGE_THREADS", "1"),
            ("POSSUM_KEEPER_STAGE_FAIL", "1"),
            ("POSSUM_KEEPER_STAGE_HOLD_WAITERS", "2"),
        ],
    );
    let keeper_sock = keeper_dir.join("keeper-0.sock");
    let want = reference_run(dir);
    let mut job = keeper_job_with(dir, &lib, &keeper_dir, &[("POSSUM_RESTORERS", "1")]);
    let img = dir.join("img");
    checkpoint_and_kill(dir, &mut job, &img, &["--keep-on-gpu", "0"]);
    let r = restored_from(dir, &img, &job, false);
    assert_eq!(r["stage_skipped"], Value::Null, "{r}");
    let staged = &r["staged"][0];
    assert_eq!(staged["error"], Value::Null, "{r}");
    assert_eq!(staged["buffers"], 3, "{r}");
    assert_eq!(r["staged_buffers_mapped"], 3, "{r}");
    goes_on_like(
        &mut job,
        dir,
        "staged",
        &want,
        "restored from memory its keeper loaded",
    );
    let back = restored_buffers(job.pid as u32, &dir.join("sockets"));
    assert_eq!(back["buffers"], 3, "{back}");
    assert_eq!(back["staged"], 2, "{back}");
    assert_eq!(back["staged_fallback"], 1, "{back}");
    assert!(
        back["hook_blocked"].as_u64().unwrap_or(0) > 0,
        "the job waited for a buffer still loading: {back}"
    );
    let mut k = possum_keeper::Keeper::connect(&keeper_sock).unwrap();
    let s = k.stats().unwrap();
    assert!(s.stages.is_empty(), "the restore ended its stage: {s:?}");
    assert_eq!(s.retained.allocations, 0, "{s:?}");
    // The three restored, and the one its malloc after step 9 added.
    assert_eq!(s.clients[&job.pid].allocations, 4, "{s:?}");

    // Turned off: the restore copies from the image.
    let img2 = dir.join("img2");
    checkpoint_and_kill(dir, &mut job, &img2, &["--keep-on-gpu", "0"]);
    let r = json_of(
        possum(dir)
            .args(["restore", "--json", "-D"])
            .arg(&img2)
            .env("LD_LIBRARY_PATH", dir)
            .env("POSSUM_RESTORE_STAGE", "0"),
        &job,
    );
    assert!(
        r["stage_skipped"]
            .as_str()
            .is_some_and(|s| s.contains("off")),
        "{r}"
    );
    assert_eq!(r["staged_buffers_mapped"], 0, "{r}");
    let back = restored_buffers(job.pid as u32, &dir.join("sockets"));
    assert_eq!(back["staged"], 0, "{back}");
    finish_restored(&mut job);
}

/// The keeper SIGKILLed while it loads a restored job's image (for the
/// staging): the job has already mapped what the keeper loaded and holds the memory of every
/// buffer it took; what the keeper had not loaded it copies from the image itself, and it
/// computes exactly what a run without possum does.
#[test]
fn a_keeper_killed_while_it_loads_a_restore_loses_nothing() {
    set_up!(let (dir, lib) = setup("keeper_stage_killed", "possum-keeper-stage-killed-"));
    let (keeper, keeper_dir) = start_keeper_with(
        dir,
        &[
            ("POSSUM_KEEPER_STAGE_DELAY_MS", "1500"),
            ("POSSUM_KEEPER_STAGE_THREADS", "1"),
        ],
    );
    let want = reference_run(dir);
    let mut job = keeper_job(dir, &lib, &keeper_dir);
    let img = dir.join("img");
    checkpoint_and_kill(dir, &mut job, &img, &["--keep-on-gpu", "0"]);
    let r = restore_json(dir, &img, &job);
    assert_eq!(r["staged_buffers_mapped"], 3, "{r}");
    // One buffer loads every 1.5 s: the keeper dies with some still waiting.
    drop(keeper);
    let back = restored_buffers(job.pid as u32, &dir.join("sockets"));
    assert_eq!(back["buffers"], 3, "{back}");
    assert!(
        back["staged_fallback"].as_u64().unwrap_or(0) >= 1,
        "buffers the dead keeper had not loaded came from the image: {back}"
    );
    goes_on_like(
        &mut job,
        dir,
        "staged-killed",
        &want,
        "restored while its keeper died loading",
    );
    finish_restored(&mut job);
}

/// A stage the restored job does not take (here the job is told not to: `POSSUM_STAGED=0`, a
/// diagnostic) is ended by `possum restore` once the job has resumed: no memory stays retained
/// in the keeper for the live job, and the job comes back from its image.
#[test]
fn a_stage_the_restored_job_does_not_take_is_freed() {
    set_up!(let (dir, lib) = setup("keeper_stage_unused", "possum-keeper-stage-unused-"));
    let (_keeper, keeper_dir) = start_keeper(dir);
    let want = reference_run(dir);
    let mut job = keeper_job_with(dir, &lib, &keeper_dir, &[("POSSUM_STAGED", "0")]);
    let img = dir.join("img");
    checkpoint_and_kill(dir, &mut job, &img, &["--keep-on-gpu", "0"]);
    let r = restore_json(dir, &img, &job);
    assert_eq!(r["staged"][0]["buffers"], 3, "{r}");
    assert_eq!(r["staged"][0]["unused"], true, "{r}");
    assert_eq!(r["staged_buffers_mapped"], 0, "{r}");
    let mut k = possum_keeper::Keeper::connect(&keeper_dir.join("keeper-0.sock")).unwrap();
    let s = k.stats().unwrap();
    assert_eq!(s.retained.allocations, 0, "{s:?}");
    assert!(s.stages.is_empty(), "{s:?}");
    goes_on_like(
        &mut job,
        dir,
        "unused-stage",
        &want,
        "restored from its image, the stage unused",
    );
    let back = restored_buffers(job.pid as u32, &dir.join("sockets"));
    assert_eq!(back["staged"], 0, "{back}");
    finish_restored(&mut job);
}

/// The fake driver's GPUs of `FAKE_CUDA_DEVICES=2` as nvidia-smi names them (device 0's UUID is
/// bytes f0..ff, device 1's 00..0f).
const FAKE_GPU0: &str = "GPU-f0f1f2f3-f4f5-f6f7-f8f9-fafbfcfdfeff";
const FAKE_GPU1: &str = "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f";

/// A stand-in for nvidia-smi (`POSSUM_NVIDIA_SMI`) on the fake driver's two GPUs: GPU 0 with
/// room for any job, GPU 1 with the MiB free that `DIR/smi-free1` says (70000 unless a test
/// writes less), and as its compute apps the lines of `DIR/smi-apps` (written by the test once
/// it knows the job's pid: the script itself is never rewritten while it may be run).
fn two_gpu_smi(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join("nvidia-smi");
    let apps = dir.join("smi-apps");
    let free1 = dir.join("smi-free1");
    std::fs::write(&apps, "").unwrap();
    std::fs::write(&free1, "70000").unwrap();
    std::fs::write(
        &p,
        format!(
            "#!/bin/sh\ncase \"$1\" in\n  --query-gpu=*) echo '0, {FAKE_GPU0}, 70000'; echo \"1, \
             {FAKE_GPU1}, $(cat '{}')\";;\n  --query-compute-apps=*) cat '{}';;\nesac\n",
            free1.display(),
            apps.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    // Another test's child may hold the script's write descriptor across a fork for a moment
    // (ETXTBSY): wait until it runs.
    for _ in 0..100 {
        match Command::new(&p).arg("--probe").output() {
            Err(e) if e.raw_os_error() == Some(26) => std::thread::sleep(Duration::from_millis(20)),
            _ => break,
        }
    }
    p
}

/// A job on the first of two fake GPUs, checkpointed and killed with its memory held by its
/// keeper (`possum keeper`, a socket per GPU), ready for `possum restore --device 1`.
struct KilledOnGpu0 {
    tmp: tempfile::TempDir,
    _keeper: KeeperProcess,
    keeper_dir: PathBuf,
    smi: PathBuf,
    want: [Vec<u8>; 2],
    job: Job,
    img: PathBuf,
}

const TWO_GPUS: (&str, &str) = ("FAKE_CUDA_DEVICES", "2");

fn killed_on_gpu_0(test: &str, prefix: &str, keeper_env: &[(&str, &str)]) -> Option<KilledOnGpu0> {
    let (tmp, lib) = setup(test, prefix)?;
    let dir = tmp.path();
    let env: Vec<(&str, &str)> = std::iter::once(TWO_GPUS)
        .chain(keeper_env.iter().copied())
        .collect();
    let (keeper, keeper_dir) = start_keeper_with(dir, &env);
    assert!(
        keeper_dir.join("keeper-1.sock").exists(),
        "the keeper serves both GPUs"
    );
    let smi = two_gpu_smi(dir);
    let want = reference_run_with(dir, &[TWO_GPUS]);
    let mut job = job_at_step_5(
        dir,
        "job",
        Some(&lib),
        &[("POSSUM_KEEPER", keeper_dir.to_str().unwrap()), TWO_GPUS],
    );
    std::fs::write(
        dir.join("smi-apps"),
        format!("{}, {FAKE_GPU0}, 300\n", job.pid),
    )
    .unwrap();
    let img = dir.join("img");
    let v = killing_checkpoint(
        checkpoint_cmd(dir, job.pid, &img, &[]).env("POSSUM_NVIDIA_SMI", &smi),
        &mut job,
    );
    holds_for_restore(&v, json!([0]));
    let held = possum_keeper::Keeper::connect(&keeper_dir.join("keeper-0.sock"))
        .unwrap()
        .retained(job.pid)
        .unwrap();
    assert_eq!(held.len(), 3, "GPU 0's keeper holds the job's buffers");
    Some(KilledOnGpu0 {
        tmp,
        _keeper: keeper,
        keeper_dir,
        smi,
        want,
        job,
        img,
    })
}

impl KilledOnGpu0 {
    /// `possum restore --json -D IMG --device 1`, with `env` added: its JSON.
    fn restore_on_gpu_1(&self, env: &[(&str, &str)]) -> Value {
        let dir = self.tmp.path();
        json_of(
            possum(dir)
                .args(["restore", "--json", "--device", "1", "-D"])
                .arg(&self.img)
                .env("LD_LIBRARY_PATH", dir)
                .env("POSSUM_NVIDIA_SMI", &self.smi)
                .env(TWO_GPUS.0, TWO_GPUS.1)
                .envs(env.iter().copied()),
            &self.job,
        )
    }

    /// The keeper of GPU `n`.
    fn keeper(&self, n: usize) -> possum_keeper::Keeper {
        possum_keeper::Keeper::connect(&self.keeper_dir.join(format!("keeper-{n}.sock"))).unwrap()
    }

    /// The restored job followed its device to GPU 1: the memory GPU 0's keeper held for it is
    /// let go, and its resume says so.
    fn moved_to_gpu_1(&self, r: &Value) {
        let moved = &r["resume_report"]["moved"][0];
        assert_eq!(moved["kept_dropped"], true, "{r}");
        assert!(
            moved["keeper"]
                .as_str()
                .is_some_and(|s| s.ends_with("keeper-1.sock")),
            "{r}"
        );
        let mut k0 = self.keeper(0);
        assert_eq!(
            k0.retained(self.job.pid).unwrap(),
            Vec::new(),
            "GPU 0's memory of the job is let go"
        );
        let s = k0.stats().unwrap();
        assert!(
            s.clients.get(&self.job.pid).is_none_or(|u| u.bytes == 0),
            "{s:?}"
        );
        assert_eq!(s.held.bytes, 0, "{s:?}");
    }

    /// [`Self::moved_to_gpu_1`] and [`Self::goes_on_on_gpu_1`] after a restore (`r`) whose job
    /// took the stage of its 3 buffers, `peer` of them copied from GPU 0 and none failed: the
    /// stage as GPU 1's keeper ended it.
    fn moved_and_staged(&mut self, r: &Value, peer: u64) -> possum_keeper::StageStats {
        self.moved_to_gpu_1(r);
        let back = self.goes_on_on_gpu_1();
        assert_eq!(back["staged"], 3, "{back}");
        let st = self.keeper(1).stats().unwrap();
        let ended = st
            .stages_ended
            .last()
            .expect("the stage, ended by the job")
            .clone();
        assert_eq!(
            (ended.peer_copied, ended.ready, ended.failed),
            (peer, 3, 0),
            "{peer} copied from GPU 0: {st:?}"
        );
        ended
    }

    /// The restored job goes on exactly as the reference, its buffers (and its later malloc's)
    /// from GPU 1's keeper, and exits cleanly.
    fn goes_on_on_gpu_1(&mut self) -> Value {
        let dir = self.tmp.path().to_path_buf();
        restored_goes_on_before_exit(&mut self.job, &dir, &self.want);
        let back = restored_buffers(self.job.pid as u32, &dir.join("sockets"));
        let s = self.keeper(1).stats().unwrap();
        assert!(s.stages.is_empty(), "{s:?}");
        assert_eq!(s.retained.allocations, 0, "{s:?}");
        // The three restored, and the one its malloc after step 9 added.
        assert_eq!(s.clients[&self.job.pid].allocations, 4, "{s:?}");
        finish_restored(&mut self.job);
        back
    }
}

/// `possum restore --device 1` of a job killed by its checkpoint on GPU 0 while its keeper holds
/// its buffers there: the keeper's socket serving GPU 1 stages the image from
/// GPU 0's memory, copying each buffer GPU to GPU; the driver's restore maps the job's device to
/// GPU 1 (the fake driver's remapping), the job follows it to that socket, takes the stage and
/// lets GPU 0's memory go, and computes exactly what a run without possum does.
#[test]
fn a_job_restored_onto_another_gpu_gets_its_kept_memory_copied_gpu_to_gpu() {
    let Some(mut t) = killed_on_gpu_0("keeper_peer_restore", "possum-keeper-peer-", &[]) else {
        return;
    };
    let r = t.restore_on_gpu_1(&[]);
    assert_eq!(r["stage_skipped"], Value::Null, "{r}");
    let staged = &r["staged"][0];
    assert_eq!(staged["error"], Value::Null, "{r}");
    assert_eq!(staged["buffers"], 3, "{r}");
    assert_eq!(staged["peer_buffers"], 3, "every buffer from GPU 0: {r}");
    assert_eq!(r["peer_buffers"], 3, "{r}");
    assert_eq!(r["staged_buffers_mapped"], 3, "{r}");
    assert!(
        staged["socket"]
            .as_str()
            .is_some_and(|s| s.ends_with("keeper-1.sock")),
        "{r}"
    );
    assert!(
        staged["from"]
            .as_str()
            .is_some_and(|s| s.ends_with("keeper-0.sock")),
        "{r}"
    );
    let ended = t.moved_and_staged(&r, 3);
    assert!(ended.peer_bytes > 0 && ended.done_ms.is_some(), "{ended:?}");
}

/// A moved job one of whose kept buffers GPU 0's keeper no longer holds (freed before the
/// restore): the other two are copied GPU to GPU, that one is read from the image, and the
/// restore says which and why (the keeper's reason, in the stage's `peer_misses`); the job goes
/// on exactly as the reference.
#[test]
fn a_moved_job_s_buffer_gone_from_its_old_gpu_is_read_from_the_image_and_said_why() {
    let Some(mut t) = killed_on_gpu_0("keeper_peer_miss", "possum-keeper-peer-miss-", &[]) else {
        return;
    };
    let mut k0 = t.keeper(0);
    let held = k0.retained(t.job.pid).unwrap();
    assert_eq!(held.len(), 3, "{held:?}");
    let gone = &held[1];
    k0.release_retained(gone.id).unwrap();
    let r = t.restore_on_gpu_1(&[]);
    let staged = &r["staged"][0];
    assert_eq!(staged["error"], Value::Null, "{r}");
    assert_eq!(
        (&staged["buffers"], &staged["peer_buffers"]),
        (&Value::from(3), &Value::from(2)),
        "{r}"
    );
    let misses = staged["peer_misses"].as_array().expect("the reason given");
    assert_eq!(misses.len(), 1, "{r}");
    let why = misses[0].as_str().unwrap();
    let va = format!("{:#x}", gone.va.expect("retained with its address"));
    assert!(
        why.contains(&va) && why.contains("nothing of process") && why.contains("retained there"),
        "{why}"
    );
    assert_eq!(r["staged_buffers_mapped"], 3, "{r}");
    t.moved_and_staged(&r, 2);
}

/// [`a_job_restored_onto_another_gpu_gets_its_kept_memory_copied_gpu_to_gpu`] with staging off
/// (`POSSUM_RESTORE_STAGE=0`): the job, moved to GPU 1, lets GPU 0's memory go and copies its
/// buffers from the image into memory of GPU 1's keeper.
#[test]
fn a_job_restored_onto_another_gpu_without_staging_comes_back_from_its_image() {
    let Some(mut t) = killed_on_gpu_0("keeper_peer_unstaged", "possum-keeper-peer-off-", &[])
    else {
        return;
    };
    let r = t.restore_on_gpu_1(&[("POSSUM_RESTORE_STAGE", "0")]);
    assert!(
        r["stage_skipped"]
            .as_str()
            .is_some_and(|s| s.contains("off")),
        "{r}"
    );
    assert_eq!(r["peer_buffers"], 0, "{r}");
    assert_eq!(r["staged_buffers_mapped"], 0, "{r}");
    t.moved_to_gpu_1(&r);
    let back = t.goes_on_on_gpu_1();
    assert_eq!(back["staged"], 0, "{back}");
}

/// The keeper SIGKILLed while it copies a moved job's buffers GPU to GPU: its
/// memory on both GPUs goes with it, yet nothing is lost: the restored job, already mapping the
/// buffers the stage made, copies those the keeper had not loaded from its image (complete for
/// a killed job) and goes on bit-exact.
#[test]
fn a_keeper_killed_while_it_copies_a_moved_job_loses_nothing() {
    let Some(mut t) = killed_on_gpu_0(
        "keeper_peer_killed",
        "possum-keeper-peer-killed-",
        &[
            ("POSSUM_KEEPER_STAGE_DELAY_MS", "1500"),
            ("POSSUM_KEEPER_STAGE_THREADS", "1"),
        ],
    ) else {
        return;
    };
    let r = t.restore_on_gpu_1(&[]);
    assert_eq!(r["peer_buffers"], 3, "{r}");
    assert_eq!(r["staged_buffers_mapped"], 3, "{r}");
    // One buffer is copied every 1.5 s: the keeper dies with some still waiting.
    drop(t._keeper);
    let dir = t.tmp.path().to_path_buf();
    let back = restored_buffers(t.job.pid as u32, &dir.join("sockets"));
    assert_eq!(back["buffers"], 3, "{back}");
    assert!(
        back["staged_fallback"].as_u64().unwrap_or(0) >= 1,
        "buffers the dead keeper had not copied came from the image: {back}"
    );
    restored_goes_on_before_exit(&mut t.job, &dir, &t.want);
    finish_restored(&mut t.job);
}

/// `possum restore --device 1` onto a GPU with room for the job's own memory (what nvidia-smi
/// counted as the job's) but not for the buffers its keeper held: refused before anything is
/// done, naming both; the image and the memory the keeper holds on GPU 0 are left as they were,
/// and the job is then restored on its own GPU from that memory.
#[test]
fn a_move_to_a_gpu_without_room_for_the_kept_buffers_is_refused() {
    let Some(mut t) = killed_on_gpu_0("keeper_peer_no_room", "possum-keeper-peer-room-", &[])
    else {
        return;
    };
    let dir = t.tmp.path().to_path_buf();
    // The job counted 300 MiB; its buffers (in the keeper) need more than 1 MiB beyond that.
    std::fs::write(dir.join("smi-free1"), "301").unwrap();
    let out = possum(&dir)
        .args(["restore", "--json", "--device", "1", "-D"])
        .arg(&t.img)
        .env("LD_LIBRARY_PATH", &dir)
        .env("POSSUM_NVIDIA_SMI", &t.smi)
        .env(TWO_GPUS.0, TWO_GPUS.1)
        .output()
        .unwrap();
    let msg = text(&out);
    assert!(!out.status.success(), "{msg}");
    assert!(
        msg.contains("too little memory") && msg.contains("buffers its keeper held"),
        "{msg}"
    );
    let held = t.keeper(0).retained(t.job.pid).unwrap();
    assert_eq!(
        held.len(),
        3,
        "GPU 0 still holds the job's buffers: {held:?}"
    );
    let r = restore_json(&dir, &t.img, &t.job);
    assert_eq!(r["gpu_from_keeper"], true, "{r}");
    goes_on_like(
        &mut t.job,
        &dir,
        "no-room",
        &t.want,
        "restored on its own GPU after the refused move",
    );
    finish_restored(&mut t.job);
}

/// A job moved to GPU 1 by `possum restore --device 1`, then checkpointed and killed there
/// (its memory held by the keeper's socket for GPU 1, which its process now uses under its old
/// ordinal 0), is restored on GPU 1 without `--device` from that memory: mapped again, nothing
/// staged (the keeper's socket is found by the GPU's UUID, not by the job's ordinal, which
/// would name GPU 0's socket and load the whole image there for nothing).
#[test]
fn a_moved_job_checkpointed_again_is_restored_from_the_new_gpu_s_memory() {
    let Some(mut t) = killed_on_gpu_0("keeper_peer_again", "possum-keeper-peer-again-", &[]) else {
        return;
    };
    let r = t.restore_on_gpu_1(&[]);
    assert_eq!(r["peer_buffers"], 3, "{r}");
    t.moved_to_gpu_1(&r);
    let dir = t.tmp.path().to_path_buf();
    std::fs::write(
        dir.join("smi-apps"),
        format!("{}, {FAKE_GPU1}, 300\n", t.job.pid),
    )
    .unwrap();
    let img2 = dir.join("img2");
    let v = killing_checkpoint(
        checkpoint_cmd(&dir, t.job.pid, &img2, &[]).env("POSSUM_NVIDIA_SMI", &t.smi),
        &mut t.job,
    );
    holds_for_restore(&v, json!([0]));
    assert_eq!(t.keeper(1).retained(t.job.pid).unwrap().len(), 3);
    let r = json_of(
        possum(&dir)
            .args(["restore", "--json", "-D"])
            .arg(&img2)
            .env("LD_LIBRARY_PATH", &dir)
            .env("POSSUM_NVIDIA_SMI", &t.smi)
            .env(TWO_GPUS.0, TWO_GPUS.1),
        &t.job,
    );
    assert_eq!(r["gpu_from_keeper"], true, "{r}");
    assert_eq!(r["staged"], serde_json::json!([]), "nothing staged: {r}");
    assert!(
        r["stage_skipped"]
            .as_str()
            .is_some_and(|s| s.contains("still holds")),
        "{r}"
    );
    assert_eq!(r["resume_report"]["moved"], serde_json::json!([]), "{r}");
    goes_on_like(
        &mut t.job,
        &dir,
        "moved-again",
        &t.want,
        "moved, checkpointed again and restored on GPU 1",
    );
    finish_restored(&mut t.job);
}
