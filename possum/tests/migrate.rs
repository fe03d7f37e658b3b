//! `possum migrate` to a `possum receive` over loopback, on the fake GPU stack of the
//! interposer's tests with real CRIU (source and destination on this one host): the job moves and
//! goes on with exactly the data of a run without possum; a wrong key, a receiver killed during
//! the transfer, a restore that fails at the destination and a destination gone after the
//! source's kill each leave the job running at the source, with exactly that data too, as does
//! the network failing (every connection cut) while the job runs or while it is held, after
//! which the receiver serves the next migration; `possum migrate` killed while it restores the
//! job at the source has its guard see to the job. A
//! destination silent after the source's go has the source keep its image unrestored; a source
//! silent before the go has the destination kill its held copy before it ran: the job never
//! runs twice, and restored from the image kept, it goes on exactly. A job whose control socket
//! is in a directory of its own (not possum's at either end) runs on at the destination, or, the
//! destination failing, at the source; with `--engine driver`, its parent slow to reap it, the
//! source waits for its PID to be free and it runs on at the destination. A job whose memory is a
//! keeper's has its GPU image loaded ahead at the destination, from the first round sent ahead,
//! and the restore's stage takes that memory; with `POSSUM_HELD_SPARE=1` its final copy goes
//! into the keeper's spare image memory. With `POSSUM_HOSTMEM_AHEAD=1`, the job's private
//! memory goes ahead with the rounds and only what changed of it at the cut.
//!
//! The job (`interposer/tests/fake/fake_session_job.c`, FAKE_VIA=entry) is the one of
//! entry_checkpoint.rs: commanded through a FIFO, answering into a file opened O_APPEND, which
//! CRIU reopens by path at a restore (here or "there": the same host).
//!
//! Needs root and CRIU: without either it prints `SKIPPED: ...` on stderr and passes; with
//! `POSSUM_REQUIRE_CRIU=1` (as CI sets) it fails instead.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

#[path = "support/criu_cli.rs"]
mod support;
use support::cli::possum_checkpointing_in as possum;
use support::receiver::Receiver;
use support::session_job::Job;
use support::{plugin_dir, run_ok, say, text, WAIT};

use serde_json::Value;

/// The job at step 5, its process reaped as soon as it ends (a migration kills it, and its PID
/// must be free for CRIU's restore); killed when dropped if it still runs. Its logging thread
/// writes `dir/NAME.ticks` ([`ticks_once_each`]).
fn start_job(dir: &Path, name: &str, lib: Option<&Path>) -> Job {
    start_job_reaped(dir, name, lib, Duration::ZERO)
}

/// [`start_job`], its process reaped `late` after it ended (until then its PID stays taken, as
/// a parent busy elsewhere leaves it).
fn start_job_reaped(dir: &Path, name: &str, lib: Option<&Path>, late: Duration) -> Job {
    start_job_with(dir, name, lib, late, &[])
}

/// [`start_job_reaped`], `env` added to the job's environment.
fn start_job_with(
    dir: &Path,
    name: &str,
    lib: Option<&Path>,
    late: Duration,
    env: &[(&str, &str)],
) -> Job {
    let ticks = dir.join(format!("{name}.ticks"));
    let mut all = vec![("FAKE_TICKS", ticks.to_str().unwrap())];
    all.extend_from_slice(env);
    let mut job = Job::spawn(dir, name, lib, &all);
    job.expect("ready");
    if late.is_zero() {
        job.reap_in_background();
    } else {
        let mut child = job.child.take().unwrap();
        let pid = nix::unistd::Pid::from_raw(job.pid);
        std::thread::spawn(move || {
            use nix::sys::wait::{waitid, Id, WaitPidFlag};
            // Its end seen, not reaped (WNOWAIT): a zombie holding its PID.
            let _ = waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT);
            std::thread::sleep(late);
            child.wait()
        });
    }
    job.run("step 5", "done 5");
    job
}

/// The commands after the migration (steps 6 to 12, a cudaMalloc, two dumps), then the job's
/// exit, which must be clean: the buffers after each dump.
fn finish(job: &mut Job, dir: &Path, tag: &str) -> [Vec<u8>; 2] {
    let buffers = job.after_checkpoint(dir, tag);
    job.run("exit", "bye");
    // A restored job is this process's (a subreaper's) to reap; the original is reaped by its
    // waiting thread.
    let _ = possum_criu::wait_for_exit(job.pid, Some(WAIT));
    job.pid = 0;
    buffers
}

/// Binds `$dir`, `$want` and `$job` of `$setup` (a [`setup_job`]) for a test, its temporary
/// directory kept to the test's end; returns from the test where it is skipped.
macro_rules! set_up {
    (let ($dir:ident, $want:ident, $job:pat) = $setup:expr) => {
        let Some((tmp, $want, $job)) = $setup else {
            return;
        };
        let $dir = tmp.path();
    };
}

/// CRIU, libpossum.so, the fake driver and the job built into a temporary directory, the
/// reference run's buffers and the job under libpossum at step 5; `None` (said why) to skip.
fn setup(test: &str) -> Option<(tempfile::TempDir, [Vec<u8>; 2], Job)> {
    setup_job(test, true, Duration::ZERO)
}

/// [`setup`], the job under libpossum or not (`under_possum`), reaped `late` after its end
/// ([`start_job_reaped`]).
fn setup_job(
    test: &str,
    under_possum: bool,
    late: Duration,
) -> Option<(tempfile::TempDir, [Vec<u8>; 2], Job)> {
    let (tmp, lib) = support::session_job_setup(test, "possum-migrate-")?;
    let dir = tmp.path();
    let want = finish(&mut start_job(dir, "reference", None), dir, "reference");
    let job = start_job_reaped(dir, "job", under_possum.then_some(lib.as_path()), late);
    for (name, byte) in [("key", 1u8), ("other-key", 2)] {
        std::fs::write(dir.join(name), [byte; 32]).unwrap();
    }
    std::fs::create_dir(dir.join("received")).unwrap();
    Some((tmp, want, job))
}

/// A migration that succeeded at both ends (each failure says what both said): `possum
/// migrate --json`'s figures and the receiver's.
fn migrated(out: &Output, receiver: Receiver, job: &Job) -> (Value, Value) {
    let (v, r, _) = migrated_logged(out, receiver, job);
    (v, r)
}

/// [`migrated`], with the receiver's log (for a later assertion's message).
fn migrated_logged(out: &Output, receiver: Receiver, job: &Job) -> (Value, Value, String) {
    let log = receiver.log.clone();
    let (status, received) = receiver.finish();
    let log = log.lock().unwrap().clone();
    assert!(
        out.status.success(),
        "{}\nreceiver:\n{log}\njob:\n{}",
        text(out),
        job.log()
    );
    assert!(status.success(), "{received}\n{log}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let r: Value = serde_json::from_str(received.trim()).unwrap();
    (v, r, log)
}

/// `possum migrate` of `job` to `to`, paced at 1 MB/s (the image is some MiB: slow enough to
/// be interrupted where a test wants), started with its output piped.
fn slow_migrate(dir: &Path, job: &Job, to: &str) -> std::process::Child {
    slow_migrate_with(dir, job, to, &[])
}

/// [`slow_migrate`] with `env` added.
fn slow_migrate_with(dir: &Path, job: &Job, to: &str, env: &[(&str, &str)]) -> std::process::Child {
    migrate_cmd(dir, job, to, "key")
        .args(["--max-rate", "1000000"])
        .envs(env.iter().copied())
        // (The job's private memory not sent ahead: the fake GPU's buffers are the job's own
        // memory, which would go ahead as its private memory for minutes at this rate.)
        .env("POSSUM_HOSTMEM_AHEAD", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn migrate_cmd(dir: &Path, job: &Job, to: &str, key: &str) -> Command {
    let mut c = possum(dir);
    c.args(["migrate", &job.pid.to_string(), "--json", "--to", to])
        .arg("--key-file")
        .arg(dir.join(key))
        .arg("-D")
        .arg(dir.join("local"))
        .arg("--socket-dir")
        .arg(dir.join("sockets"));
    c
}

/// `possum migrate` of `job` to `receiver` under `dir/key`, with `args` and `env` added: its
/// output.
fn migrate_to(
    dir: &Path,
    job: &Job,
    receiver: &Receiver,
    args: &[&str],
    env: &[(&str, &Path)],
) -> Output {
    migrate_cmd(dir, job, &receiver.addr, "key")
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// A `possum receive` whose CRIU (`dir/no-criu-here`) is missing, `env` added: it cannot
/// restore.
fn receiver_without_criu(dir: &Path, env: &[(&str, &str)]) -> Receiver {
    let missing = dir.join("no-criu-here");
    let mut env = env.to_vec();
    env.push(("POSSUM_CRIU", missing.to_str().unwrap()));
    Receiver::start(dir, "key", &env)
}

/// A migration to [`receiver_without_criu`]: the source says the destination could not restore
/// the job, naming the CRIU it lacked, and the receiver fails.
fn not_restored_there(out: &Output, receiver: Receiver) {
    failed_at(out, "the destination could not restore the job");
    assert!(text(out).contains("no-criu-here"), "{}", text(out));
    let (status, _) = receiver.finish();
    assert!(!status.success());
}

/// The names in `dir`.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A failed `possum migrate`: exit 2, its error naming `phase`, the job running at the source.
fn failed_at(out: &Output, phase: &str) {
    let t = text(out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    assert!(t.contains(phase), "no {phase:?} in:\n{t}");
    assert!(t.contains("the job runs on at the source"), "{t}");
}

/// The job's logging thread wrote each of its lines once, wherever it ran: nothing the source
/// did after the dump that the destination's restore did again.
fn ticks_once_each(dir: &Path) {
    let text = std::fs::read_to_string(dir.join("job.ticks")).unwrap();
    let mut seen = std::collections::BTreeMap::<&str, usize>::new();
    for l in text.lines() {
        *seen.entry(l).or_default() += 1;
    }
    let again: Vec<_> = seen.iter().filter(|(_, &n)| n > 1).collect();
    assert!(
        again.is_empty(),
        "lines written twice (after the dump at the source, and at the destination): {again:?}"
    );
    assert!(seen.len() > 10, "the logging thread ran: {}", seen.len());
}

/// The job, wherever it runs now, goes on with exactly the reference's buffers.
fn goes_on_like(job: &mut Job, dir: &Path, want: &[Vec<u8>; 2], what: &str) {
    let got = finish(job, dir, "job");
    assert!(got[0] == want[0], "{what}: the buffers after step 9 differ");
    assert!(
        got[1] == want[1],
        "{what}: the buffers after step 12 differ"
    );
}

#[test]
fn a_job_migrated_over_loopback_runs_on_at_the_destination_bit_exact() {
    set_up!(let (dir, want, mut job) = setup("migrate_loopback"));
    // possum's CRIU plugin at both ends (`cargo test` leaves it where `possum` does not look).
    let Some(libdir) = plugin_dir(dir) else {
        panic!("libpossum_criu_plugin.so is not built beside possum (cargo test --workspace)");
    };
    let receiver = Receiver::start(
        dir,
        "key",
        &[("POSSUM_CRIU_PLUGIN_DIR", libdir.to_str().unwrap())],
    );
    // Four streams, paced together (well above what the test sends in its time); the job's
    // private memory sent ahead too, and written into CRIU's images by possum.
    let paced = ["--streams", "4", "--max-rate", "2GB/s"];
    let out = migrate_to(
        dir,
        &job,
        &receiver,
        &paced,
        &[
            ("POSSUM_CRIU_PLUGIN_DIR", libdir.as_path()),
            ("POSSUM_HOSTMEM_AHEAD", Path::new("1")),
            ("POSSUM_DUMP_PAGES", Path::new("possum")),
        ],
    );
    assert!(out.status.success(), "{}\njob:\n{}", text(&out), job.log());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let (status, received) = receiver.finish();
    assert!(status.success(), "{received}");
    let r: Value = serde_json::from_str(received.trim()).unwrap();

    // The same host: CRIU gave the job its PID again.
    assert_eq!(v["pid"], job.pid, "{v}");
    assert_eq!(v["remote_pid"], job.pid, "{v}");
    assert_eq!(r["pid"], job.pid, "{r}");
    assert_eq!((&v["files"], &v["bytes"]), (&r["files"], &r["bytes"]));
    assert!(v["bytes"].as_u64().unwrap() > 2 << 20, "{v}");
    // What the pre-copy wrote went ahead, the job running; only the rest while it was held.
    let (before, held) = (
        v["bytes_before_hold"].as_u64().unwrap(),
        v["bytes_while_held"].as_u64().unwrap(),
    );
    assert!(before > 0, "{v}");
    assert!(held < v["bytes"].as_u64().unwrap(), "{v}");
    // Pre-copy rounds (at most 4 by default): the second found nothing written since the first
    // (the job waits for its next command), and they stopped there.
    assert_eq!(v["rounds"], 2, "{v}");
    let rounds = &v["checkpoint"]["figures"]["precopy_rounds"];
    assert!(rounds[0]["bytes"].as_u64().unwrap() > 2 << 20, "{v}");
    assert_eq!(rounds[1]["bytes"], 0, "{v}");
    let t = &v["timings"];
    let downtime = t["downtime_ms"].as_f64().unwrap();
    assert!(
        downtime >= t["send_ms"].as_f64().unwrap() + t["remote_restore_ms"].as_f64().unwrap(),
        "{v}"
    );
    assert_eq!(r["source_told"], true, "{r}");
    // The local image is gone once the destination's was on its disk; the received one stays
    // (the buffers come back from it).
    assert!(t["synced_there_ms"].as_f64().is_some(), "{v}");
    assert!(v.get("image_kept").is_none(), "{v}");
    assert!(!dir.join("local").exists());
    let received = PathBuf::from(r["dir"].as_str().unwrap());
    assert!(received.join("possum.json").is_file(), "{r}");
    assert_eq!(names(&dir.join("received")).len(), 1);
    // Synced once the job ran there: its unsynced mark gone.
    assert!(r["timings"]["sync_ms"].as_f64().is_some(), "{r}");
    // The job's own account of its wait for buffers after it ran there, counted in the downtime.
    let waited = r["timings"]["waited_after_resume_ms"].as_f64();
    assert!(waited.is_some(), "{r}");
    assert_eq!(t["waited_after_resume_ms"].as_f64(), waited, "{v}");
    assert!(!received.join(".possum-unsynced").exists(), "{r}");
    // The files sent ahead: only what the cut's copy wrote was hashed again (the job's library
    // said which ranges), the rest taken as sent.
    assert!(t["send_hashing_ms"].as_f64().is_some(), "{v}");
    // The job's private memory left CRIU's images while it was held, and the destination's
    // restore wrote it back through possum's plugin, every byte.
    let moved = &v["checkpoint"]["figures"]["hostmem"]["moved_bytes"];
    assert!(moved.as_u64().unwrap_or(0) > 0, "not split: {v}");
    assert_eq!(&r["restore"]["hostmem_fill_bytes"], moved, "{r}");
    // That memory went ahead with the pre-copy rounds, drafted while the job ran; at the cut
    // it was compared with the draft, which is its data file: most of it was there already (the job
    // waits for its next command), and only the rest went while it was held.
    let ahead = &v["host_memory_ahead"];
    assert!(ahead["rounds"].as_u64().unwrap() >= 1, "{v}");
    assert!(ahead["written_bytes"].as_u64().unwrap() > 0, "{v}");
    let hostmem = &v["checkpoint"]["figures"]["hostmem"];
    let pid = job.pid;
    assert_eq!(
        hostmem["sent_ahead"][0],
        format!("possum-hostmem-{pid}.pages"),
        "{v}"
    );
    let reused = hostmem["ahead_reused_bytes"].as_u64().unwrap();
    assert!(reused > moved.as_u64().unwrap() / 2, "{v}");
    let criu = received.join("criu");
    assert!(criu.join(format!("possum-hostmem-{pid}.pages")).is_file());
    assert!(!criu.join(format!("possum-hostmem-{pid}.pages.0")).exists());
    assert!(
        !received.join("hostmem-ahead").exists(),
        "{:?}",
        names(&received)
    );
    // CRIU's own account of both ends; the job's memory written by possum after CRIU's lazy
    // dump (`POSSUM_DUMP_PAGES=possum`), CRIU's stats counting only the pages it wrote itself.
    let figures = &v["checkpoint"]["figures"];
    let read = figures["criu_pages_read_bytes"].as_u64().unwrap_or(0);
    assert!(read >= moved.as_u64().unwrap(), "{v}");
    assert!(figures["criu_pages_read_ms"].as_f64().is_some(), "{v}");
    let dumped = &figures["criu_dump_stats"];
    assert!(dumped["frozen_ms"].as_f64().is_some(), "{v}");
    // CRIU's dump was made ready while the job was cut and the driver worked; the destination
    // opened the image while the source killed the job.
    assert!(figures["criu_ready_ms"].as_f64().is_some(), "{v}");
    assert!(r["restore"]["open_ms"].as_f64().is_some(), "{r}");
    // CRIU's restore worker was made ready there too, and taken by the restore.
    assert!(r["restore"]["criu_ready_ms"].as_f64().is_some(), "{r}");
    assert!(
        r["restore"]["criu_restore_stats"]["restore_ms"]
            .as_f64()
            .is_some(),
        "{r}"
    );

    goes_on_like(&mut job, dir, &want, "migrated");
    ticks_once_each(dir);
    say(&format!(
        "migrate_loopback: {t}; {before} bytes sent ahead, {held} while held, of {}; of the \
         job's memory {reused} of {moved} bytes sent ahead (drafts: {ahead})",
        v["bytes"]
    ));
}

/// A job whose buffers are a keeper's (`possum run`'s default), a `possum receive` for it on
/// this host with possum's CRIU plugin, and what the job's buffers must be at its end.
struct KeptJob {
    tmp: tempfile::TempDir,
    want: [Vec<u8>; 2],
    job: Job,
    /// Kept running while this is.
    _keeper: support::cli::KeeperProcess,
    keeper_dir: PathBuf,
    libdir: PathBuf,
    receiver: Receiver,
}

fn kept_job(test: &str) -> Option<KeptJob> {
    kept_job_with(test, &[])
}

/// [`kept_job`], `env` added to the job's environment (and the reference run's, and the
/// receiver's).
fn kept_job_with(test: &str, env: &[(&str, &str)]) -> Option<KeptJob> {
    kept_job_keeping(test, env, |_| Vec::new())
}

/// [`kept_job_with`], the keeper's environment given `keeper_env(dir)` (the test's directory).
fn kept_job_keeping(
    test: &str,
    env: &[(&str, &str)],
    keeper_env: impl FnOnce(&Path) -> Vec<(&'static str, String)>,
) -> Option<KeptJob> {
    let (tmp, lib) = support::session_job_setup(test, "possum-migrate-")?;
    let dir = tmp.path();
    let mut reference = start_job_with(dir, "reference", None, Duration::ZERO, env);
    let want = finish(&mut reference, dir, "reference");
    let keeper_env = keeper_env(dir);
    let keeper_env: Vec<(&str, &str)> = keeper_env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (keeper, keeper_dir) = support::cli::start_keeper_with(dir, &keeper_env);
    let mut all = vec![("POSSUM_KEEPER", keeper_dir.to_str().unwrap())];
    all.extend_from_slice(env);
    let job = start_job_with(dir, "job", Some(&lib), Duration::ZERO, &all);
    std::fs::write(dir.join("key"), [1u8; 32]).unwrap();
    std::fs::create_dir(dir.join("received")).unwrap();
    let libdir = plugin_dir(dir).expect("libpossum_criu_plugin.so beside possum");
    // (The receiver gets `env` too: its own variables among them.)
    let mut receiver_env = vec![("POSSUM_CRIU_PLUGIN_DIR", libdir.to_str().unwrap())];
    receiver_env.extend_from_slice(env);
    let receiver = Receiver::start(dir, "key", &receiver_env);
    Some(KeptJob {
        tmp,
        want,
        job,
        _keeper: keeper,
        keeper_dir,
        libdir,
        receiver,
    })
}

/// `possum migrate` of a [`kept_job`] to its receiver, possum's CRIU plugin found, with the
/// variables `vars` set.
fn migrate_kept_with(t: &KeptJob, vars: &[(&str, &str)]) -> Output {
    let mut env = vec![("POSSUM_CRIU_PLUGIN_DIR", t.libdir.as_path())];
    env.extend(vars.iter().map(|(n, v)| (*n, Path::new(*v))));
    migrate_to(t.tmp.path(), &t.job, &t.receiver, &[], &env)
}

/// A job whose buffers are a keeper's (`possum run`'s default), migrated over loopback: the
/// destination has the keeper load the job's GPU image from the first round sent ahead (its
/// draft), while the job still runs at the source; the restore's stage builds on that memory
/// (through the stage ahead of the finished image), loading only the chunks that changed; the
/// job goes on bit-exact, and nothing of the prestage is left in the keeper.
#[test]
fn the_destination_loads_the_gpu_image_sent_ahead_before_the_restore() {
    let Some(mut t) = kept_job("migrate_prestage") else {
        return;
    };
    let dir = t.tmp.path();
    // The job's private memory not sent ahead (the default): it goes at the cut, in parts.
    // The first round sent once copied, in parts of 1 MiB of each file: the destination loads
    // it as it comes.
    let out = migrate_kept_with(
        &t,
        &[
            ("POSSUM_MIGRATE_SLICE_MIB", "1"),
            ("POSSUM_MIGRATE_FIRST_ROUND_WHILE_COPYING", "0"),
        ],
    );
    let (v, r) = migrated(&out, t.receiver, &t.job);
    assert_eq!(r["pid"], t.job.pid, "{r}");
    // In parts, which the receiver writes at once: CRIU's pages file is not among them.
    assert_eq!(v["host_memory_ahead"]["rounds"], 0, "{v}");
    let criu = PathBuf::from(r["dir"].as_str().unwrap()).join("criu");
    let pid = t.job.pid;
    assert!(
        criu.join(format!("possum-hostmem-{pid}.pages.0")).is_file(),
        "{:?}",
        names(&criu)
    );
    assert!(!criu.join(format!("possum-hostmem-{pid}.pages")).exists());

    // Loaded ahead: one prestage of the job's image, made at the keeper serving its GPU.
    let pre = r["prestaged"].as_array().expect("prestaged");
    assert_eq!(pre.len(), 1, "{r}");
    assert_eq!(pre[0]["image"], "gpu/gpu-0", "{r}");
    assert!(pre[0]["error"].is_null(), "{r}");
    let id = pre[0]["stage"].as_u64().expect("a prestage id");
    assert!(pre[0]["bytes"].as_u64().unwrap() > 2 << 20, "{r}");
    // Made at the first part, its data files not all there yet; all came before the cut.
    assert!(pre[0]["arriving"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(pre[0]["pending"], 0, "{r}");
    // The restore's stage built on it: what the job wrote after the first round (nothing
    // here: it waits for its next command) is all that could differ.
    let staged = r["staged"].as_array().expect("staged");
    assert_eq!(staged.len(), 1, "{r}");
    assert_eq!(staged[0]["base"], id, "{r}");
    assert!(staged[0]["error"].is_null(), "{r}");
    let reused = staged[0]["reused_bytes"].as_u64().unwrap();
    assert!(reused > 0, "nothing taken from the prestage: {r}");
    assert!(reused <= staged[0]["bytes"].as_u64().unwrap(), "{r}");
    assert!(v["bytes_before_hold"].as_u64().unwrap() > 0, "{v}");
    // The source held the job only once the destination said what it had loaded: here all of
    // it (a few MiB), before the limit. (A loader that stalls ends the wait early; then the
    // destination still had some to load.)
    let loaded = &v["loaded_ahead"];
    let left = loaded["left"].as_u64().expect("loaded_ahead.left");
    match loaded["end"].as_str() {
        Some("loaded") => {
            assert_eq!(left, 0, "{v}");
            let bytes = pre[0]["bytes"].as_u64().unwrap();
            assert!(loaded["loaded"].as_u64().unwrap() >= bytes, "{v}\n{r}");
        }
        Some("stalled") => assert!(left > 0, "{v}"),
        _ => panic!("the destination was asked and loads ahead: {v}"),
    }
    assert!(loaded["waited_ms"].as_f64().unwrap() < 5000.0, "{v}");

    goes_on_like(&mut t.job, dir, &t.want, "migrated, its image loaded ahead");
    // The keeper holds no stage, and no memory of the prestage's nor of the stage ahead built
    // on it once the final set came (the default: `stage` names that one).
    let mut k = possum_keeper::Keeper::connect(&t.keeper_dir.join("keeper-0.sock")).unwrap();
    let stats = k.stats().unwrap();
    assert!(stats.stages.iter().all(|s| !s.draft), "{stats:?}");
    let ended: Vec<_> = stats.stages_ended.iter().filter(|s| s.draft).collect();
    assert_eq!(
        ended.len(),
        2,
        "the prestage and the stage ahead: {stats:?}"
    );
    assert!(
        pre[0]["ahead"]["prestage"]
            .as_u64()
            .is_some_and(|p| p != id),
        "{r}"
    );
    say(&format!(
        "migrate_prestage: {reused} of {} bytes in memory before the restore; the source's \
         wait: {loaded}",
        staged[0]["bytes"]
    ));
}

/// The destination stages the job's GPU image ahead of its restore (the default): once the
/// final set brought it whole, a stage of it built
/// on the prestage of the first round; the restore's stage builds on that one; the job goes on
/// bit-exact, and the keeper holds nothing of either.
#[test]
fn the_destination_stages_the_finished_image_ahead_of_the_restore() {
    let Some(mut t) = kept_job_with("migrate_stage_ahead", &[]) else {
        return;
    };
    let dir = t.tmp.path();
    // (The source not waiting for the destination's loads: the stage ahead builds on what
    // the prestage had loaded when the final set came.)
    let out = migrate_kept_with(
        &t,
        &[
            ("POSSUM_MIGRATE_SLICE_MIB", "1"),
            ("POSSUM_MIGRATE_LOAD_WAIT_MS", "0"),
        ],
    );
    let (v, r) = migrated(&out, t.receiver, &t.job);
    assert!(v["loaded_ahead"].is_null(), "not asked: {v}");
    let pre = r["prestaged"].as_array().expect("prestaged");
    assert_eq!(pre.len(), 1, "{r}");
    let ahead = &pre[0]["ahead"];
    assert!(ahead["error"].is_null(), "{r}");
    let (first, staged_ahead) = (ahead["prestage"].as_u64(), pre[0]["stage"].as_u64());
    assert!(
        first.is_some() && staged_ahead.is_some() && first != staged_ahead,
        "{r}"
    );
    let staged = r["staged"].as_array().expect("staged");
    assert_eq!(staged[0]["base"].as_u64(), staged_ahead, "{r}");
    assert!(staged[0]["error"].is_null(), "{r}");
    assert!(staged[0]["reused_bytes"].as_u64().unwrap() > 0, "{r}");
    goes_on_like(&mut t.job, dir, &t.want, "migrated, its image staged ahead");
    let mut k = possum_keeper::Keeper::connect(&t.keeper_dir.join("keeper-0.sock")).unwrap();
    let stats = k.stats().unwrap();
    assert!(stats.stages.iter().all(|s| !s.draft), "{stats:?}");
    let ended: Vec<_> = stats.stages_ended.iter().filter(|s| s.draft).collect();
    assert_eq!(
        ended.len(),
        2,
        "the prestage and the stage ahead: {stats:?}"
    );
}

/// A job with 512 MiB of private memory and 8 MiB in a memfd, migrated in parts of 1 MiB:
/// while CRIU dumps it, the parts of its pages file already written go to the destination (the
/// final set claims them once the split renamed the file), not those of the memfd's pages file,
/// which CRIU writes first; the destination has every part, the job goes on bit-exact (its
/// memory checked at its exit) and nothing else is left in its image.
#[test]
fn the_job_s_memory_goes_to_the_destination_while_criu_dumps_it() {
    // CRIU writing the pages as it dumps (possum writes them after, in no order).
    memory_goes_while_criu_dumps("migrate_criu_parts", "criu");
}

/// The same with CRIU's write relayed (`POSSUM_DUMP_PAGES=relay`): the pages file is filled by
/// several threads at once, and only its parts the relay says are whole go while CRIU dumps.
#[test]
fn the_job_s_memory_relayed_goes_to_the_destination_while_criu_dumps_it() {
    memory_goes_while_criu_dumps("migrate_relay_parts", "relay");
}

fn memory_goes_while_criu_dumps(name: &str, pages: &str) {
    let env = [("FAKE_HEAP_MIB", "512"), ("FAKE_MEMFD_MIB", "8")];
    let Some(mut t) = kept_job_with(name, &env) else {
        return;
    };
    let dir = t.tmp.path();
    let out = migrate_kept_with(
        &t,
        &[
            ("POSSUM_MIGRATE_PART_MIB", "1"),
            ("POSSUM_DUMP_PAGES", pages),
        ],
    );
    let (v, r) = migrated(&out, t.receiver, &t.job);
    assert_eq!((&v["files"], &v["bytes"]), (&r["files"], &r["bytes"]));
    let criu_early = v["criu_bytes_while_dumping"].as_u64().unwrap();
    // More than the memfd's pages file holds: the job's own.
    assert!(
        criu_early > 9 << 20,
        "too little of CRIU's pages while it dumped: {v}"
    );
    assert!(
        criu_early <= v["bytes_while_dumping"].as_u64().unwrap(),
        "{v}"
    );
    let criu = PathBuf::from(r["dir"].as_str().unwrap()).join("criu");
    let pid = t.job.pid;
    let moved = v["checkpoint"]["figures"]["hostmem"]["moved_bytes"]
        .as_u64()
        .unwrap();
    assert!(moved >= 512 << 20, "{v}");
    let parts: Vec<String> = (names(&criu).into_iter())
        .filter(|n| n.starts_with(&format!("possum-hostmem-{pid}.pages.")))
        .collect();
    assert!(parts.len() as u64 >= moved >> 20, "{parts:?}");
    assert!(!criu.join(format!("possum-hostmem-{pid}.pages")).exists());
    let relayed = v["checkpoint"]["figures"]["criu_pages_relayed_bytes"].as_u64();
    match pages {
        "relay" => assert!(relayed.unwrap_or(0) >= moved, "{v}"),
        _ => assert_eq!(relayed, None, "{v}"),
    }
    goes_on_like(
        &mut t.job,
        dir,
        &t.want,
        "migrated, its memory sent while CRIU dumped",
    );
    say(&format!(
        "{name}: {criu_early} of {moved} bytes of the job's memory sent while CRIU dumped"
    ));
}

/// A job whose thread rewrites 64 MiB of its GPU memory whole, launch after launch (as a
/// training job its state), migrated: the chunks its first pre-copy round writes go to the
/// destination as the round completes them (`rounds_while_first_round`), the destination's
/// keeper loading the images from the draft sent once the round is over; the chunks its final
/// copy writes go as the copy completes them, in rounds before the `Cut`
/// (`rounds_while_copying`), the rest after; the job goes on bit-exact, and at its exit that
/// memory holds one launch's words whole (an image mixing two launches' chunks fails the job: a
/// chunk taken as sent by a round that did not read it, the images renamed at their commit
/// meanwhile, did).
#[test]
fn the_chunks_the_first_round_and_the_final_copy_write_go_while_they_run() {
    // (Its launches not validated: each would read the 64 MiB on both sides, too slow here.)
    // The destination's keeper told of the chunks written again (not the default).
    let env = [
        ("FAKE_WRITER_MIB", "64"),
        ("POSSUM_VALIDATE", "off"),
        ("POSSUM_MIGRATE_LOAD_REWRITTEN", "1"),
    ];
    let Some(mut t) = kept_job_with("migrate_while_copying", &env) else {
        return;
    };
    let dir = t.tmp.path();
    let out = migrate_kept_with(
        &t,
        &[
            ("POSSUM_MIGRATE_SEND_WHILE_COPYING", "1"),
            ("POSSUM_MIGRATE_FIRST_ROUND_WHILE_COPYING", "1"),
        ],
    );
    let (v, r, log) = migrated_logged(&out, t.receiver, &t.job);
    assert_eq!((&v["files"], &v["bytes"]), (&r["files"], &r["bytes"]));
    let copying = v["bytes_while_copying"].as_u64().unwrap();
    let rounds = v["rounds_while_copying"].as_u64().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // (What a round sends is what changed since the last round ahead: little where the job's
    // thread did not run meanwhile.)
    assert!(rounds >= 1, "no round while copying: {v}\n{stderr}");
    assert!(stderr.contains(&format!("in {rounds} rounds")), "{stderr}");
    let held = v["bytes_while_held"].as_u64().unwrap();
    assert!(copying <= held, "{v}");
    // (The round copies more than 64 MiB; a round of its chunks goes once 32 MiB completed.)
    let first = v["bytes_while_first_round"].as_u64().unwrap();
    let first_rounds = v["rounds_while_first_round"].as_u64().unwrap();
    assert!(first_rounds >= 1 && first > 0, "{v}\n{stderr}");
    assert!(first <= v["bytes_before_hold"].as_u64().unwrap(), "{v}");
    assert!(
        stderr.contains("sent while the first pre-copy round ran"),
        "{stderr}"
    );
    // The draft went once the round was over, and the keeper there loaded the images from it.
    let pre = r["prestaged"].as_array().expect("prestaged");
    assert!(
        pre[0]["error"].is_null() && pre[0]["stage"].is_u64(),
        "{r}\nreceiver:\n{log}\nsource:\n{stderr}"
    );
    assert_eq!(r["staged"][0]["base"], pre[0]["stage"], "{r}");
    // The keeper there was told of the chunks the later rounds wrote again.
    let named = pre[0]["rewritten"].as_u64().unwrap_or(0);
    assert!(named > 0, "no chunk named written again: {r}");
    goes_on_like(
        &mut t.job,
        dir,
        &t.want,
        "migrated, its first round and final copy sent as they ran",
    );
    let mut k = possum_keeper::Keeper::connect(&t.keeper_dir.join("keeper-0.sock")).unwrap();
    let stats = k.stats().unwrap();
    let again: u64 = (stats.stages_ended.iter()).map(|s| s.reloaded_bytes).sum();
    say(&format!(
        "migrate_while_copying: {first} bytes sent ahead while the first round ran \
         ({first_rounds} rounds); {copying} of {held} bytes sent while held went during the \
         final copy; {named} chunks named written again, {again} bytes loaded again"
    ));
}

/// With `POSSUM_HELD_SPARE=1` and a keeper keeping spare image memory on the image's
/// filesystem, the held job's final copy hands the chunks it copies (the half of a 64 MiB buffer
/// its writer thread rewrites all the time, the other half unchanged since the last round, by
/// fingerprints) to the keeper, which copies them into its spare, one of the image's data files
/// from then on; the migration sends them as the journal names them, while the copy runs, and
/// the job goes on at the destination bit-exact (the rewritten half one launch's words whole,
/// the other as it was filled).
#[test]
fn a_held_job_s_final_copy_goes_into_the_keeper_s_spare() {
    let env = [
        ("FAKE_WRITER_MIB", "64"),
        ("FAKE_WRITER_HALF", "1"),
        ("FAKE_CUDA_FINGERPRINT", "1"),
        ("POSSUM_VALIDATE", "off"),
        ("POSSUM_HELD_SPARE", "1"),
    ];
    let keeper_env = |dir: &Path| {
        let spares = dir.join("spares");
        std::fs::create_dir(&spares).unwrap();
        vec![
            ("POSSUM_KEEPER_SPARE_DIR", spares.display().to_string()),
            ("POSSUM_KEEPER_SPARE_MIB", "160".to_string()),
        ]
    };
    let Some(mut t) = kept_job_keeping("migrate_held_spare", &env, keeper_env) else {
        return;
    };
    let dir = t.tmp.path();
    let socket = t.keeper_dir.join("keeper-0.sock");
    let since = Instant::now();
    while !possum_keeper::Keeper::connect(&socket)
        .and_then(|mut k| k.stats())
        .is_ok_and(|st| st.spare.is_some_and(|sp| sp.ready))
    {
        assert!(since.elapsed() < WAIT, "the keeper made no spare");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = migrate_kept_with(&t, &[]);
    let (v, _) = migrated(&out, t.receiver, &t.job);
    let finals = &v["checkpoint"]["release_report"]["final"];
    let by_keeper = finals[0]["shadows_saved_by_keeper"].as_u64().unwrap_or(0);
    assert!(by_keeper >= 1, "no buffer went into the spare: {finals}");
    // Only the half of W its writer rewrites changed since the last round: those chunks alone
    // went into the spare (with the chunks the copy takes of a buffer given to the keeper).
    let copied = finals[0]["bytes"].as_u64().unwrap_or(0);
    assert!(copied > 0 && copied < 64 << 20, "W copied whole: {finals}");
    // Where the release's time went besides the copy: the devices' fence, the commit.
    assert!(
        finals[0]["sync_ms"].is_f64() && finals[0]["commit_ms"].is_f64(),
        "{finals}"
    );
    // The spare's chunks went in a round while the copy ran, as the journal named them (a
    // spare's chunks not journaled: no round). What it sent depends on whether it listed the
    // spare before the images' commit renamed it (if not, the final set sends it).
    let rounds = v["rounds_while_copying"].as_u64().unwrap_or(0);
    assert!(rounds >= 1, "no round while copying: {v}");
    let copying = v["bytes_while_copying"].as_u64().unwrap_or(0);
    goes_on_like(
        &mut t.job,
        dir,
        &t.want,
        "migrated, its final copy in the keeper's spare",
    );
    say(&format!(
        "migrate_held_spare: {by_keeper} buffers ({copied} bytes) into the spare; {copying} \
         bytes sent while the copy ran, in {rounds} rounds"
    ));
}

/// The network fails while the first round arrives in parts and the destination's keeper loads
/// it as it comes: the job runs on at the source bit-exact, and the keeper holds nothing of the
/// load ahead (its loaders, waiting for bytes that will not come, are ended with it).
#[test]
fn a_connection_cut_while_the_first_round_arrives_ends_the_load_ahead() {
    let Some(mut t) = kept_job("migrate_cut_slices") else {
        return;
    };
    let dir = t.tmp.path();
    let plugin = [("POSSUM_CRIU_PLUGIN_DIR", t.libdir.to_str().unwrap())];
    let relay = Relay::start(&t.receiver.addr);
    // 1 MB/s, the round sent once copied, in parts of 1 MiB of each file: seconds between the
    // parts.
    let migrate = migrate_cmd(dir, &t.job, &relay.addr, "key")
        .args(["--max-rate", "1000000"])
        .env("POSSUM_HOSTMEM_AHEAD", "0")
        .env("POSSUM_MIGRATE_SLICE_MIB", "1")
        .env("POSSUM_MIGRATE_FIRST_ROUND_WHILE_COPYING", "0")
        .envs(plugin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut k = possum_keeper::Keeper::connect(&t.keeper_dir.join("keeper-0.sock")).unwrap();
    let since = Instant::now();
    let pre = loop {
        let stats = k.stats().unwrap();
        if let Some(s) = stats.stages.iter().find(|s| s.draft) {
            break s.clone();
        }
        assert!(since.elapsed() < WAIT, "no load ahead began: {stats:?}");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(
        pre.pending_pieces > 0,
        "the round came whole first: {pre:?}"
    );
    assert!(!is_stopped(t.job.pid), "held before the cut was wanted");
    relay.cut();
    let out = migrate.wait_with_output().unwrap();
    failed_at(&out, "sending the image");
    let got = t.receiver.output();
    assert!(!got.status.success(), "{}", text(&got));
    // The load ahead ended, its memory freed: no stage left, the prestage among those ended.
    let since = Instant::now();
    loop {
        let stats = k.stats().unwrap();
        let ended = stats.stages_ended.iter().any(|s| s.stage == pre.stage);
        if stats.stages.is_empty() && ended && stats.held == possum_keeper::Usage::default() {
            break;
        }
        assert!(since.elapsed() < WAIT, "the load ahead was left: {stats:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(names(&dir.join("received")).is_empty());
    goes_on_like(&mut t.job, dir, &t.want, "run on at the source after a cut");
}

/// The network fails while the first pre-copy round goes as it is copied (a job whose thread
/// rewrites 64 MiB, `POSSUM_MIGRATE_FIRST_ROUND_WHILE_COPYING=1`, paced at 1 MB/s): `possum
/// migrate` says the send failed, the job runs on at the source bit-exact, and the keeper
/// there holds nothing (no draft came: no load ahead began).
#[test]
fn a_connection_cut_while_the_first_round_goes_as_it_is_copied_leaves_the_job_running() {
    let env = [("FAKE_WRITER_MIB", "64"), ("POSSUM_VALIDATE", "off")];
    let Some(mut t) = kept_job_with("migrate_cut_first_round", &env) else {
        return;
    };
    let dir = t.tmp.path();
    let relay = Relay::start(&t.receiver.addr);
    let migrate = migrate_cmd(dir, &t.job, &relay.addr, "key")
        .args(["--max-rate", "1000000"])
        .env("POSSUM_MIGRATE_FIRST_ROUND_WHILE_COPYING", "1")
        .env("POSSUM_CRIU_PLUGIN_DIR", &t.libdir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A round of the chunks the first round completed is on its way (32 MiB: half a minute).
    relay.carried(256 << 10);
    assert!(!is_stopped(t.job.pid), "held before the cut was wanted");
    relay.cut();
    let out = migrate.wait_with_output().unwrap();
    failed_at(&out, "sending the image");
    let got = t.receiver.output();
    assert!(!got.status.success(), "{}", text(&got));
    let mut k = possum_keeper::Keeper::connect(&t.keeper_dir.join("keeper-0.sock")).unwrap();
    let stats = k.stats().unwrap();
    assert!(stats.stages.is_empty(), "{stats:?}");
    assert!(!stats.stages_ended.iter().any(|s| s.draft), "{stats:?}");
    assert!(names(&dir.join("received")).is_empty());
    goes_on_like(
        &mut t.job,
        dir,
        &t.want,
        "run on at the source after a cut in its first round",
    );
}

#[test]
fn a_wrong_key_is_refused_and_the_job_runs_on_at_the_source() {
    set_up!(let (dir, want, mut job) = setup("migrate_wrong_key"));
    let receiver = Receiver::start(dir, "key", &[]);
    let out = (migrate_cmd(dir, &job, &receiver.addr, "other-key").output()).unwrap();
    failed_at(&out, "sending the image");
    // The receiver said so and waits on: a connection that does not prove it holds the secret
    // cannot end it (anyone could send one).
    let log = receiver.said("was refused");
    assert!(log.contains("127.0.0.1"), "{log}");
    let mut receiver = receiver;
    assert!(
        receiver.child.try_wait().unwrap().is_none(),
        "it ended: {log}"
    );
    receiver.kill();
    assert_eq!(names(&dir.join("received")), Vec::<String>::new());
    goes_on_like(&mut job, dir, &want, "refused");
}

#[test]
fn a_receiver_killed_during_the_transfer_leaves_the_job_running_at_the_source() {
    set_up!(let (dir, want, mut job) = setup("migrate_receiver_killed"));
    let receiver = Receiver::start(dir, "key", &[]);
    let migrate = slow_migrate(dir, &job, &receiver.addr);
    let received = dir.join("received");
    let t = Instant::now();
    while !names(&received).iter().any(|n| n.contains(".receiving-")) {
        assert!(t.elapsed() < WAIT, "the transfer did not begin");
        std::thread::sleep(Duration::from_millis(5));
    }
    receiver.kill();
    let out = migrate.wait_with_output().unwrap();
    failed_at(&out, "sending the image");
    // Nothing was named at the destination: only the dead receiver's temporary directory.
    assert!(
        names(&received).iter().all(|n| n.contains(".receiving-")),
        "{:?}",
        names(&received)
    );
    goes_on_like(&mut job, dir, &want, "left at the source");
}

/// `possum migrate` killed while it sends the image, the job held and stopped since its dump:
/// its guard continues the job and lets it run on at the source, bit-exact; the destination
/// names nothing.
#[test]
fn possum_migrate_killed_while_the_job_is_held_leaves_it_running_at_the_source() {
    set_up!(let (dir, want, mut job) = setup("migrate_source_killed"));
    let receiver = Receiver::start(dir, "key", &[]);
    let mut migrate = slow_migrate(dir, &job, &receiver.addr);
    wait_stopped(job.pid);
    migrate.kill().unwrap();
    migrate.wait().unwrap();
    let (status, _) = receiver.finish();
    assert!(!status.success());
    assert!(
        names(&dir.join("received")).is_empty(),
        "{:?}",
        names(&dir.join("received"))
    );
    goes_on_like(&mut job, dir, &want, "its migration killed");
}

#[test]
fn a_restore_failing_at_the_destination_restores_the_job_at_the_source() {
    set_up!(let (dir, want, mut job) = setup("migrate_restore_fails"));
    // The destination cannot restore: its CRIU is missing.
    let receiver = receiver_without_criu(dir, &[]);
    let out = migrate_to(dir, &job, &receiver, &[], &[]);
    not_restored_there(&out, receiver);
    // The destination removed what it received; the source keeps its image.
    assert_eq!(names(&dir.join("received")), Vec::<String>::new());
    assert!(dir.join("local/possum.json").is_file());
    goes_on_like(&mut job, dir, &want, "restored at the source");
}

/// A destination that takes the image and the source's `Released`, then drops the connection
/// without an answer (as one that died in its restore): the source restores the job itself.
#[test]
fn a_destination_gone_after_the_kill_has_the_job_restored_at_the_source() {
    set_up!(let (dir, want, mut job) = setup("migrate_destination_gone"));
    // With possum's CRIU plugin: the image's private memory is split out (in one file here:
    // only its sending cuts it into parts), which the source's own restore writes back.
    let Some(libdir) = plugin_dir(dir) else {
        panic!("libpossum_criu_plugin.so is not built beside possum (cargo test --workspace)");
    };
    let (addr, destination) = fake_destination(dir, |_, _| {});
    let out = migrate_cmd(dir, &job, &addr, "key")
        .env("POSSUM_CRIU_PLUGIN_DIR", &libdir)
        .output()
        .unwrap();
    destination.join().unwrap();
    let data = format!("local/criu/possum-hostmem-{}.pages", job.pid);
    assert!(
        dir.join(&data).is_file() && !dir.join(format!("{data}.0")).exists(),
        "{:?}",
        names(&dir.join("local/criu"))
    );
    failed_at(&out, "waiting for the destination's restore");
    assert!(
        text(&out).contains("restoring the job at the source"),
        "{}",
        text(&out)
    );
    assert!(dir.join("local/possum.json").is_file());
    goes_on_like(&mut job, dir, &want, "restored at the source");
}

/// `possum migrate` killed while it restores the job at the source itself (its destination
/// gone after the kill), at once and later into that restore: its guard, told of the restore,
/// leaves the job running where that restore got it there, and otherwise restores it; either
/// way the job runs once, and goes on bit-exact.
#[test]
fn possum_migrate_killed_while_it_restores_the_job_at_the_source_leaves_it_to_its_guard() {
    use std::io::BufRead;
    for (n, delay) in [0u64, 150, 400].into_iter().enumerate() {
        set_up!(let (dir, want, mut job) = setup(&format!("migrate_killed_restoring_{n}")));
        let Some(libdir) = plugin_dir(dir) else {
            panic!("libpossum_criu_plugin.so is not built beside possum (cargo test --workspace)");
        };
        let (addr, destination) = fake_destination(dir, |_, _| {});
        let mut migrate = migrate_cmd(dir, &job, &addr, "key")
            .env("POSSUM_CRIU_PLUGIN_DIR", &libdir)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let err = std::io::BufReader::new(migrate.stderr.take().unwrap());
        let (said, restoring) = std::sync::mpsc::channel();
        let lines = std::thread::spawn(move || {
            let mut all = String::new();
            for line in err.lines().map_while(Result::ok) {
                if line.contains("restoring the job at the source") {
                    let _ = said.send(());
                }
                all.push_str(&line);
                all.push('\n');
            }
            all
        });
        restoring
            .recv_timeout(WAIT)
            .expect("possum migrate did not begin its restore at the source");
        std::thread::sleep(Duration::from_millis(delay));
        migrate.kill().unwrap();
        migrate.wait().unwrap();
        let said = lines.join().unwrap();
        destination.join().unwrap();
        assert!(
            alive_for_a_second(job.pid, WAIT),
            "killed {delay} ms into its restore: the job is not running\n{said}"
        );
        goes_on_like(
            &mut job,
            dir,
            &want,
            &format!("killed {delay} ms into its restore"),
        );
    }
}

/// Whether process `pid` is alive for a second on end within `limit` (a restore that got it
/// running, not one being undone).
fn alive_for_a_second(pid: i32, limit: Duration) -> bool {
    let t = Instant::now();
    let mut since: Option<Instant> = None;
    while t.elapsed() < limit {
        match (alive(pid), since) {
            (true, Some(s)) if s.elapsed() >= Duration::from_secs(1) => return true,
            (true, None) => since = Some(Instant::now()),
            (false, _) => since = None,
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// A destination by hand on a loopback port (its address, and its thread): it takes the image
/// (over as many streams as the source opens) and the source's `Released` under the key `key`,
/// then does `then` and drops the connection.
fn fake_destination(
    dir: &Path,
    then: impl FnOnce(&mut std::net::TcpStream, &mut possum_sequence::wire::Session) + Send + 'static,
) -> (String, std::thread::JoinHandle<()>) {
    use possum_sequence::auth::HmacKey;
    use possum_sequence::wire::{self, Accepted};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let dest = dir.join("received/job");
    let thread = std::thread::spawn(move || {
        let key = HmacKey::from_bytes(vec![1; 32]).unwrap();
        let sessions = wire::Sessions::new(WAIT);
        let accept = |listener: &std::net::TcpListener| {
            let (mut s, _) = listener.accept().unwrap();
            wire::set_timeouts(&s, WAIT).unwrap();
            let accepted = wire::accept_handshake(&mut s, &key, &sessions).unwrap();
            (s, accepted)
        };
        let (mut s, Accepted::Session(session)) = accept(&listener) else {
            panic!("the source's first connection did not begin a session")
        };
        // Its other streams join it.
        for _ in 1..session.streams() {
            let (lane, Accepted::Stream(joined)) = accept(&listener) else {
                panic!("a second session")
            };
            assert!(joined.join(lane));
        }
        let (_, mut session) = wire::receive_dir_in_session(&mut s, session, &dest).unwrap();
        wire::await_released(&mut s, &mut session).unwrap();
        then(&mut s, &mut session);
    });
    (addr, thread)
}

/// A [`fake_destination`] that holds the job restored (says `Restored` as `pid`), takes the
/// source's go, then says `after_go` if any and drops the connection.
fn destination_holding(
    dir: &Path,
    pid: i32,
    after_go: Option<possum_sequence::wire::Outcome>,
) -> (String, std::thread::JoinHandle<()>) {
    use possum_sequence::wire::{self, Outcome};
    fake_destination(dir, move |s, session| {
        wire::send_outcome(s, session, &Outcome::Restored { pid }).unwrap();
        wire::await_released(s, session).unwrap();
        if let Some(o) = after_go {
            wire::send_outcome(s, session, &o).unwrap();
        }
    })
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| !s.contains(") Z ") && !s.contains(") X "))
}

/// `possum migrate` killed once the job was killed and its image sent, before the destination
/// was told to run it: the checkpoint's guard restores the job at the source from its image,
/// and it goes on bit-exact.
#[test]
fn possum_migrate_killed_before_the_go_has_its_guard_restore_the_job_at_the_source() {
    set_up!(let (dir, want, mut job) = setup("migrate_killed_before_go"));
    let Some(libdir) = plugin_dir(dir) else {
        panic!("libpossum_criu_plugin.so is not built beside possum (cargo test --workspace)");
    };
    let (released, told) = std::sync::mpsc::channel();
    let (killed, hold) = std::sync::mpsc::channel::<()>();
    // The image and `Released` came: the source waits for the destination's outcome, which
    // comes only once the source is gone.
    let (addr, destination) = fake_destination(dir, move |_, _| {
        released.send(()).unwrap();
        let _ = hold.recv_timeout(WAIT);
    });
    let mut migrate = migrate_cmd(dir, &job, &addr, "key")
        .env("POSSUM_CRIU_PLUGIN_DIR", &libdir)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    told.recv_timeout(WAIT).expect("the source's Released");
    assert!(!alive(job.pid), "the job was killed before the hand-off");
    migrate.kill().unwrap();
    migrate.wait().unwrap();
    killed.send(()).unwrap();
    destination.join().unwrap();
    let t = Instant::now();
    while !alive(job.pid) && t.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(alive(job.pid), "the guard did not restore the job");
    goes_on_like(&mut job, dir, &want, "restored by the guard");
}

/// A destination that holds the job restored, takes the source's go, and goes silent (as one
/// that died after letting the job run): the source does not restore its own (the job may run
/// there), keeps its image and says so; restored from it by the operator, the job goes on
/// exactly.
#[test]
fn a_destination_silent_after_the_go_has_the_source_keep_its_image_unrestored() {
    set_up!(let (dir, want, mut job) = setup("migrate_silent_after_go"));
    // The go, then silence.
    let (addr, destination) = destination_holding(dir, job.pid, None);
    let out = migrate_cmd(dir, &job, &addr, "key").output().unwrap();
    destination.join().unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    assert!(
        t.contains("went silent") && t.contains("not restored here"),
        "{t}"
    );
    assert!(!t.contains("the job runs on at the source"), "{t}");
    assert!(dir.join("local/possum.json").is_file());
    std::thread::sleep(Duration::from_millis(200));
    assert!(!alive(job.pid), "the source did not bring its job back");
    run_ok(possum(dir).args(["restore", "-D"]).arg(dir.join("local")));
    goes_on_like(&mut job, dir, &want, "restored by the operator");
}

/// A destination that lets the job run and says so, but never that the image it restored it
/// from is on its disk (as one that died while syncing it): the migration succeeds, and the
/// source keeps its image and says where; restored from it, the job goes on exactly.
#[test]
fn a_destination_that_never_says_its_image_is_on_disk_has_the_source_keep_its_own() {
    set_up!(let (dir, want, mut job) = setup("migrate_never_synced"));
    let running = possum_sequence::wire::Outcome::Running { pid: job.pid };
    let (addr, destination) = destination_holding(dir, job.pid, Some(running));
    let out = migrate_cmd(dir, &job, &addr, "key").output().unwrap();
    destination.join().unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("did not say that the image"), "{t}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let kept = PathBuf::from(v["image_kept"].as_str().unwrap());
    assert_eq!(kept, dir.join("local"), "{v}");
    assert!(kept.join("possum.json").is_file());
    std::thread::sleep(Duration::from_millis(200));
    assert!(!alive(job.pid), "killed at the source");
    run_ok(possum(dir).args(["restore", "-D"]).arg(&kept));
    goes_on_like(&mut job, dir, &want, "restored from the image kept");
}

/// A source that hears the job is restored and held at the destination, and goes silent
/// without the go (as one killed then): the destination kills its copy before it ran and keeps
/// the image, saying so; restored from it, the job goes on exactly.
#[test]
fn a_job_the_source_does_not_let_run_is_killed_at_the_destination_before_it_ran() {
    use possum_sequence::auth::HmacKey;
    use possum_sequence::wire::{self, Outcome};
    set_up!(let (dir, want, mut job) = setup("migrate_no_go"));
    let receiver = Receiver::start_timeout(dir, "key", &[], 3);
    // The source's side by hand: the job's image, the job killed, the image sent and released.
    let img = dir.join("img");
    run_ok(
        possum(dir)
            .args(["checkpoint", &job.pid.to_string(), "-D"])
            .arg(&img)
            .arg("--socket-dir")
            .arg(dir.join("sockets")),
    );
    let t = Instant::now();
    while alive(job.pid) {
        assert!(t.elapsed() < WAIT, "the job was not killed");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut s = std::net::TcpStream::connect(&receiver.addr).unwrap();
    wire::set_timeouts(&s, WAIT).unwrap();
    let key = HmacKey::from_bytes(vec![1; 32]).unwrap();
    let (_, mut session) = wire::send_dir_session(&mut s, &key, &img).unwrap();
    wire::send_released(&mut s, &mut session).unwrap();
    let held = wire::await_outcome(&mut s, &mut session).unwrap();
    assert_eq!(held, Outcome::Restored { pid: job.pid });
    let log = receiver.log.clone();
    let (status, _) = receiver.finish();
    drop(s);
    assert!(!status.success());
    let log = log.lock().unwrap().clone();
    assert!(
        log.contains("did not let it run") && log.contains("killed before it ran"),
        "{log}"
    );
    // Killed (this process, a subreaper, reaps it).
    possum_criu::wait_for_exit(job.pid, Some(WAIT)).unwrap();
    let received = names(&dir.join("received"));
    assert_eq!(received.len(), 1, "{received:?}");
    let kept = dir.join("received").join(&received[0]);
    assert!(kept.join("possum.json").is_file());
    run_ok(possum(dir).args(["restore", "-D"]).arg(&kept));
    goes_on_like(&mut job, dir, &want, "restored from the kept image");
}

/// possum's own socket directory at both ends (`POSSUM_SOCKET_DIR` of `possum migrate` and
/// `possum receive`), which is not the job's (`dir/sockets`, given to `possum migrate` only).
fn possums_own_sockets(dir: &Path) -> PathBuf {
    let own = dir.join("possums-own-sockets");
    std::fs::create_dir_all(&own).unwrap();
    std::fs::set_permissions(&own, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    own
}

/// A job whose control socket is in a directory of its own (`possum run --socket-dir`), not
/// possum's at either end: the destination restores it with its socket where it was (the
/// directory the source named), and it runs on there exactly.
#[test]
fn a_job_with_a_socket_directory_of_its_own_runs_on_at_the_destination() {
    set_up!(let (dir, want, mut job) = setup("migrate_socket_dir"));
    let own = possums_own_sockets(dir);
    let receiver = Receiver::start(dir, "key", &[("POSSUM_SOCKET_DIR", own.to_str().unwrap())]);
    let out = migrate_to(dir, &job, &receiver, &[], &[("POSSUM_SOCKET_DIR", &own)]);
    let (v, r) = migrated(&out, receiver, &job);
    assert_eq!(v["remote_pid"], job.pid, "{v}");
    assert_eq!(r["pid"], job.pid, "{r}");
    // The restored job's possum answers on its socket where it had it.
    run_ok(
        possum(dir)
            .args(["status", &job.pid.to_string(), "--json", "--socket-dir"])
            .arg(dir.join("sockets")),
    );
    assert!(!own.join(format!("possum-{}.sock", job.pid)).exists());
    assert!(!dir.join("local").exists());
    goes_on_like(
        &mut job,
        dir,
        &want,
        "migrated with its own socket directory",
    );
    ticks_once_each(dir);
}

/// The same job, a destination that cannot restore it: the source restores it from its image
/// with the socket directory its checkpoint used, and it runs on there exactly.
#[test]
fn a_job_with_a_socket_directory_of_its_own_is_restored_at_the_source_when_the_destination_fails() {
    set_up!(let (dir, want, mut job) = setup("migrate_socket_dir_fallback"));
    let own = possums_own_sockets(dir);
    let receiver = receiver_without_criu(dir, &[("POSSUM_SOCKET_DIR", own.to_str().unwrap())]);
    let out = migrate_to(dir, &job, &receiver, &[], &[("POSSUM_SOCKET_DIR", &own)]);
    not_restored_there(&out, receiver);
    assert!(dir.join("local/possum.json").is_file());
    goes_on_like(&mut job, dir, &want, "restored at the source");
    ticks_once_each(dir);
}

/// `--engine driver` (CRIU and the driver's checkpoint only; the job without libpossum), both
/// ends on this host, the job's parent slow to reap it: its PID is free before the destination
/// restores it under that PID, and it runs on there exactly.
#[test]
fn a_driver_engine_job_migrated_on_one_host_runs_on_at_the_destination() {
    let late = Duration::from_secs(2);
    set_up!(let (dir, want, mut job) = setup_job("migrate_driver_engine", false, late));
    let receiver = Receiver::start(dir, "key", &[]);
    let out = migrate_to(dir, &job, &receiver, &["--engine", "driver"], &[]);
    let (v, _) = migrated(&out, receiver, &job);
    assert_eq!(v["remote_pid"], job.pid, "{v}");
    assert_eq!(v["checkpoint"]["engine"], "driver", "{v}");
    // Nothing pre-copied: the whole image crossed while the job was held.
    assert_eq!(v["bytes_before_hold"], 0, "{v}");
    // The kill waited for the job's parent to reap it (2 s after its end).
    let kill_ms = v["timings"]["kill_ms"].as_f64().unwrap();
    assert!(kill_ms >= 1500.0, "{v}");
    goes_on_like(&mut job, dir, &want, "migrated by the driver engine");
    ticks_once_each(dir);
}

/// A job whose buffers are its keeper's memory (`possum run`'s default), migrated with
/// `--engine driver`: refused before anything is done (the driver's restore of such a process
/// fails, so the job would be left with no way back), saying what to do instead; the job runs on
/// at the source, bit-exact.
#[test]
fn a_keeper_s_job_is_refused_the_driver_engine_and_runs_on() {
    let Some(mut t) = kept_job("migrate_driver_keeper") else {
        return;
    };
    let dir = t.tmp.path();
    let out = migrate_to(dir, &t.job, &t.receiver, &["--engine", "driver"], &[]);
    let text = text(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("CUDA_ERROR_NOT_SUPPORTED"), "{text}");
    assert!(text.contains("--no-keeper"), "{text}");
    assert!(text.contains("nothing was done"), "{text}");
    goes_on_like(&mut t.job, dir, &t.want, "refused the driver's engine");
}

/// 100 connections to `possum receive` that never say anything (more than it handshakes at
/// once) and 100 that send garbage, all opened before the migration and held open through it, do
/// not hold it up: it connects within a second, the job runs on at the destination, bit-exact,
/// and the receiver says what it refused. (One
/// connection at a time, the first idle one would have held the receiver for its whole
/// timeout, and the migration's own handshake would have failed meanwhile.)
#[test]
fn idle_and_garbage_connections_do_not_hold_up_a_migration() {
    use std::io::Write as _;
    set_up!(let (dir, want, mut job) = setup("migrate_idle"));
    let receiver = Receiver::start_timeout(dir, "key", &[], 60);
    let idle: Vec<std::net::TcpStream> = (0..100)
        .map(|_| std::net::TcpStream::connect(&receiver.addr).unwrap())
        .collect();
    let garbage: Vec<std::net::TcpStream> = (0..100)
        .map(|_| {
            let mut g = std::net::TcpStream::connect(&receiver.addr).unwrap();
            let _ = g.write_all(&[0x5a; 4096]);
            g
        })
        .collect();
    let log = receiver.log.clone();
    let out = migrate_to(dir, &job, &receiver, &["--timeout", "5"], &[]);
    let (v, r) = migrated(&out, receiver, &job);
    assert_eq!(v["remote_pid"], job.pid, "{v}");
    assert_eq!(r["pid"], job.pid, "{r}");
    // Its connection and handshake were not held up behind the others: a receiver taking
    // connections one at a time would have made it wait out their handshake deadline (10 s
    // each, or --timeout's 5 s) first.
    let connect = v["timings"]["connect_ms"].as_f64().unwrap();
    assert!(connect < 1000.0, "connected in {connect} ms: {v}");
    let log = log.lock().unwrap().clone();
    assert!(
        log.contains("was refused"),
        "the garbage connections: {log}"
    );
    assert!(
        log.contains("connections were in their handshake"),
        "100 idle connections: {log}"
    );
    drop((idle, garbage));
    goes_on_like(&mut job, dir, &want, "migrated past idle connections");
    ticks_once_each(dir);
}

/// A TCP relay from a loopback port to `to`, each connection of a migration through it: `cut`
/// shuts every connection it carries, both ways, as a failed network does, both ends still
/// running. `bytes` counts what it carried from the source.
struct Relay {
    addr: String,
    bytes: std::sync::Arc<std::sync::atomic::AtomicU64>,
    conns: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
    /// Set: the source's bytes on every connection but the first stop (a stalled network).
    stalled: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    fn start(to: &str) -> Relay {
        use std::io::{Read, Write};
        use std::net::{Shutdown, TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let relay = Relay {
            addr,
            bytes: Default::default(),
            conns: Default::default(),
            stalled: Default::default(),
        };
        let (to, bytes, conns) = (to.to_string(), relay.bytes.clone(), relay.conns.clone());
        let stalled = relay.stalled.clone();
        std::thread::spawn(move || {
            for (k, from) in listener.incoming().map_while(Result::ok).enumerate() {
                let Ok(onward) = TcpStream::connect(&to) else {
                    continue;
                };
                let stall = (k > 0).then(|| stalled.clone());
                let pump = |mut a: TcpStream, mut b: TcpStream, count: Option<_>| {
                    let stall = count.is_some().then(|| stall.clone()).flatten();
                    move || {
                        let mut buf = vec![0u8; 64 << 10];
                        while let Ok(n @ 1..) = a.read(&mut buf) {
                            while stall
                                .as_ref()
                                .is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed))
                            {
                                std::thread::sleep(Duration::from_millis(10));
                            }
                            if b.write_all(&buf[..n]).is_err() {
                                break;
                            }
                            if let Some(c) = &count {
                                let c: &std::sync::Arc<std::sync::atomic::AtomicU64> = c;
                                c.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                        let _ = a.shutdown(Shutdown::Both);
                        let _ = b.shutdown(Shutdown::Both);
                    }
                };
                let mut held = conns.lock().unwrap();
                held.extend([from.try_clone().unwrap(), onward.try_clone().unwrap()]);
                let (f2, o2) = (from.try_clone().unwrap(), onward.try_clone().unwrap());
                std::thread::spawn(pump(from, onward, Some(bytes.clone())));
                std::thread::spawn(pump(o2, f2, None));
            }
        });
        relay
    }

    /// Waits until it carried more than `n` bytes from the source.
    fn carried(&self, n: u64) {
        let t = Instant::now();
        while self.bytes.load(std::sync::atomic::Ordering::Relaxed) <= n {
            assert!(t.elapsed() < WAIT, "the relay did not carry {n} bytes");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The source's bytes stop on every connection but the first: a stream that carries the
    /// image's pieces stalls, the hand-off goes on.
    fn stall_streams(&self) {
        self.stalled
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The source's bytes go on again on every connection.
    fn resume_streams(&self) {
        self.stalled
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// Every connection shut, both ways.
    fn cut(&self) {
        for c in self.conns.lock().unwrap().iter() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Whether process `pid` is stopped (held after its dump).
fn is_stopped(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('T'))
    })
}

/// Waits until process `pid` is stopped after its dump.
fn wait_stopped(pid: i32) {
    let t = Instant::now();
    while !is_stopped(pid) {
        assert!(t.elapsed() < WAIT, "the job was not stopped after its dump");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// When [`a_connection_cut`] cuts the connection.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// While the job runs and its pre-copy is sent ahead.
    Ahead,
    /// Once the job is held for the rest of the image, not killed while it is sent.
    Held,
    /// Once the job, held, was killed while the rest of its image is sent (the default).
    Killed,
}

/// The network fails during a migration (`when`): the job runs on at the source (let go, or
/// restored there from its image if it was killed beside the send), the receiver removes what
/// it got and serves the next migration, which moves the job bit-exact.
fn a_connection_cut(test: &str, when: Cut) {
    set_up!(let (dir, want, mut job) = setup(test));
    let receiver = Receiver::serving(dir, "key");
    let relay = Relay::start(&receiver.addr);
    let env: &[(&str, &str)] = match when {
        Cut::Held => &[("POSSUM_MIGRATE_KILL_WHILE_SENDING", "0")],
        Cut::Ahead | Cut::Killed => &[],
    };
    let migrate = slow_migrate_with(dir, &job, &relay.addr, env);
    relay.carried(256 << 10);
    match when {
        Cut::Ahead => assert!(!is_stopped(job.pid), "held before the cut was wanted"),
        Cut::Held => wait_stopped(job.pid),
        Cut::Killed => {
            let t = Instant::now();
            while alive(job.pid) {
                assert!(t.elapsed() < WAIT, "the job was not killed beside the send");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
    relay.cut();
    let out = migrate.wait_with_output().unwrap();
    failed_at(&out, "sending the image");
    let restored = text(&out).contains("restoring the job at the source");
    assert_eq!(restored, when == Cut::Killed, "{}", text(&out));
    // The receiver said why, removed its partial copy, and serves on.
    receiver.said("a migration from 127.0.0.1");
    let received = dir.join("received");
    let t = Instant::now();
    while !names(&received).is_empty() {
        assert!(
            t.elapsed() < WAIT,
            "left at the destination: {:?}",
            names(&received)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The job still answers at the source, with its buffers as they were, then moves for good.
    assert!(!is_stopped(job.pid), "left held");
    if when == Cut::Killed {
        // (Restored here, it is this process's child: a second migration would need it reaped.)
        goes_on_like(&mut job, dir, &want, "restored at the source");
        receiver.kill();
        return;
    }
    let _ = job.dump(&dir.join("between.bin"));
    let again = possum(dir)
        .args([
            "migrate",
            &job.pid.to_string(),
            "--json",
            "--to",
            &receiver.addr,
        ])
        .arg("--key-file")
        .arg(dir.join("key"))
        .arg("-D")
        .arg(dir.join("local-again"))
        .arg("--socket-dir")
        .arg(dir.join("sockets"))
        .output()
        .unwrap();
    assert!(again.status.success(), "{}", text(&again));
    let v: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(v["remote_pid"], job.pid, "{v}");
    assert_eq!(names(&received).len(), 1, "{:?}", names(&received));
    goes_on_like(&mut job, dir, &want, "migrated after a cut");
    receiver.kill();
}

#[test]
fn a_connection_cut_while_the_job_runs_leaves_it_at_the_source_and_the_receiver_serving() {
    a_connection_cut("migrate_cut_ahead", Cut::Ahead);
}

#[test]
fn a_connection_cut_while_the_job_is_held_lets_it_run_on_at_the_source() {
    a_connection_cut("migrate_cut_held", Cut::Held);
}

#[test]
fn a_connection_cut_after_the_kill_beside_the_send_restores_the_job_at_the_source() {
    a_connection_cut("migrate_cut_killed", Cut::Killed);
}

/// A job whose buffers are a keeper's, a receiver (`possum receive`, CRIU's plugin for it), a
/// relay between them, and `possum migrate --post-copy --stop-now` of the job through it, paced
/// at 1 MB/s; the job writes its buffers once its round is being sent ahead, so that the cut
/// finds pieces of its GPU image changed. The job, the reference's buffers (one step further
/// too), the receiver, the relay and the migration running; `None` to skip.
fn post_copy_setup(test: &str) -> Option<PostCopyRun> {
    let (tmp, lib) = support::session_job_setup(test, "possum-migrate-")?;
    let dir = tmp.path();
    let mut reference = start_job(dir, "reference", None);
    reference.run("step 1", "done 6");
    let want = finish_from_6(&mut reference, dir, "reference");
    let (keeper, keeper_dir) = support::cli::start_keeper(dir);
    let env = [("POSSUM_KEEPER", keeper_dir.to_str().unwrap())];
    let mut job = start_job_with(dir, "job", Some(&lib), Duration::ZERO, &env);
    std::fs::write(dir.join("key"), [1u8; 32]).unwrap();
    std::fs::create_dir(dir.join("received")).unwrap();
    let libdir = plugin_dir(dir).expect("libpossum_criu_plugin.so beside possum");
    let plugin = [("POSSUM_CRIU_PLUGIN_DIR", libdir.to_str().unwrap())];
    let receiver = Receiver::start(dir, "key", &plugin);
    let relay = Relay::start(&receiver.addr);
    let migrate = migrate_cmd(dir, &job, &relay.addr, "key")
        .args(["--post-copy", "--stop-now", "--streams", "2"])
        .args(["--max-rate", "1000000"])
        .env("POSSUM_HOSTMEM_AHEAD", "0")
        .env("POSSUM_CRIU_PLUGIN_DIR", &libdir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Its round is being sent ahead: the job writes its buffers again.
    relay.carried(256 << 10);
    assert!(!is_stopped(job.pid), "held before its step");
    job.run("step 1", "done 6");
    Some(PostCopyRun {
        tmp,
        want,
        job,
        receiver,
        relay,
        migrate,
        _keeper: keeper,
    })
}

/// A post-copy migration under way ([`post_copy_setup`]).
struct PostCopyRun {
    tmp: tempfile::TempDir,
    /// The reference's buffers.
    want: [Vec<u8>; 2],
    job: Job,
    receiver: Receiver,
    relay: Relay,
    /// `possum migrate`.
    migrate: std::process::Child,
    _keeper: support::cli::KeeperProcess,
}

/// Post-copy (`--post-copy`): the pieces of the job's GPU image it wrote after its round are
/// left out of what is sent while it is held (the rest of its GPU image goes while the driver
/// and CRIU work, as without post-copy), sent once the destination has the rest, and the
/// destination's stage loads the buffers they hold once they came. The job goes on bit-exact
/// at the destination, and both ends count the pieces.
#[test]
fn a_job_migrated_with_post_copy_runs_on_at_the_destination_bit_exact() {
    let Some(PostCopyRun {
        tmp,
        want,
        mut job,
        receiver,
        relay: _relay,
        migrate,
        _keeper,
    }) = post_copy_setup("migrate_post_copy")
    else {
        return;
    };
    let dir = tmp.path();
    let out = migrate.wait_with_output().unwrap();
    let (v, r) = migrated(&out, receiver, &job);
    let pieces = v["post_copy"]["pieces"].as_u64().expect("post-copy pieces");
    assert!(pieces > 0, "{v}");
    assert_eq!(r["post_copy"]["pieces"], pieces, "{r}");
    let later = v["post_copy"]["bytes"].as_u64().unwrap();
    assert!(
        v["bytes_while_held"].as_u64().unwrap() + later <= v["bytes"].as_u64().unwrap(),
        "{v}"
    );
    // The GPU images (what of them is not left for later) and CRIU's pages went while the
    // driver and CRIU worked, as without post-copy.
    assert!(v["bytes_while_dumping"].as_u64().unwrap() > 0, "{v}");
    let staged = r["staged"].as_array().expect("staged");
    assert!(staged[0]["error"].is_null(), "{r}");
    let received = PathBuf::from(r["dir"].as_str().unwrap());
    assert!(!received.join(".possum-post-copy").exists());
    let got = finish_from_6(&mut job, dir, "job");
    assert!(got == want, "migrated with post-copy: the buffers differ");
    say(&format!(
        "migrate_post_copy: {pieces} pieces, {later} bytes after the transfer; {} while held",
        v["bytes_while_held"]
    ));
}

/// Post-copy, the job running at the destination before its pieces came (the streams that
/// carry them stall a while): its next step waits for the buffers it touches, the destination
/// asks the source for their pieces (`Demand`), which go first once the streams flow again; the
/// job goes on bit-exact.
#[test]
fn a_job_waiting_for_post_copy_pieces_has_them_asked_for_and_goes_on_bit_exact() {
    let Some(PostCopyRun {
        tmp,
        want,
        mut job,
        receiver,
        relay,
        migrate,
        _keeper,
    }) = post_copy_setup("migrate_post_copy_demand")
    else {
        return;
    };
    let dir = tmp.path();
    stall_once_restored_there(&job, &relay, &dir.join("received"));
    // Its next step waits for its buffers, whose pieces are asked for meanwhile.
    let (tx, rx) = std::sync::mpsc::channel();
    let stepping = std::thread::spawn(move || {
        job.run("step 3", "done 9");
        let _ = tx.send(());
        job
    });
    assert!(
        rx.recv_timeout(Duration::from_secs(2)).is_err(),
        "the step ran before its buffers' pieces came"
    );
    relay.resume_streams();
    let mut job = stepping.join().unwrap();
    let out = migrate.wait_with_output().unwrap();
    let (v, r) = migrated(&out, receiver, &job);
    assert!(v["post_copy"]["demanded"].as_u64().unwrap() > 0, "{v}");
    assert!(r["post_copy"]["demanded"].as_u64().unwrap() > 0, "{r}");
    let got = finish_from_9(&mut job, dir, "job");
    assert!(
        got == want,
        "migrated, its pieces asked for: the buffers differ"
    );
}

/// Post-copy, the receiver killed while the job runs at the destination without its pieces:
/// the job there is killed with it (no process is left that could bring its buffers). The
/// source restores its own once the destination's lease has passed if its send failed; if its
/// send ended (the network took every piece), it cannot know whether they all came, and keeps
/// its image unrestored, saying so. Either way the job goes on bit-exact at the source.
#[test]
fn a_receiver_killed_during_post_copy_takes_the_job_there_with_it() {
    let Some(PostCopyRun {
        tmp,
        want,
        mut job,
        receiver,
        relay,
        migrate,
        _keeper,
    }) = post_copy_setup("migrate_post_copy_receiver_killed")
    else {
        return;
    };
    let dir = tmp.path();
    stall_once_restored_there(&job, &relay, &dir.join("received"));
    let reaper = reaped_once_killed_there(job.pid);
    // Let it run there (the hand-off is not on the stalled streams), then the receiver goes.
    std::thread::sleep(Duration::from_secs(3));
    receiver.kill();
    assert!(
        reaper.join().unwrap(),
        "the job at the destination outlived its receiver"
    );
    let out = migrate.wait_with_output().unwrap();
    let t = text(&out);
    if t.contains("went silent during the post-copy") {
        // Its pieces were all sent (the network took them), no word came: the source cannot
        // know whether they all came there, and keeps its image unrestored.
        assert_eq!(out.status.code(), Some(2), "{t}");
        assert!(t.contains("not restored here"), "{t}");
        assert!(!alive(job.pid), "the source brought its job back");
        let libdir = plugin_dir(dir).expect("libpossum_criu_plugin.so beside possum");
        run_ok(
            possum(dir)
                .args(["restore", "-D"])
                .arg(dir.join("local"))
                .env("POSSUM_CRIU_PLUGIN_DIR", libdir),
        );
    } else {
        // Its send failed: restored at the source once the lease passed.
        failed_at(&out, "post-copy");
    }
    let got = finish_from_6(&mut job, dir, "job");
    assert!(
        got == want,
        "brought back after its receiver died: the buffers differ"
    );
}

/// Post-copy, the network failing once the job was killed at the source (the streams that
/// carry the pieces stall): the destination restores the job and lets it run, waits for its
/// pieces, kills it once none came for the lease and says why; the source restores its own, and
/// the job goes on there bit-exact.
#[test]
fn a_post_copy_stalled_after_the_job_ran_there_has_it_restored_at_the_source() {
    let Some(PostCopyRun {
        tmp,
        want,
        mut job,
        receiver,
        relay,
        migrate,
        _keeper,
    }) = post_copy_setup("migrate_post_copy_cut")
    else {
        return;
    };
    let dir = tmp.path();
    stall_once_restored_there(&job, &relay, &dir.join("received"));
    let reaper = reaped_once_killed_there(job.pid);
    let out = migrate.wait_with_output().unwrap();
    assert!(
        reaper.join().unwrap(),
        "the job killed at the destination was not reaped"
    );
    failed_at(&out, "post-copy");
    // The receiver failed, and removed the incomplete image.
    let (status, log) = receiver.finish();
    assert!(!status.success(), "{log}");
    assert_eq!(names(&dir.join("received")), Vec::<String>::new());
    let got = finish_from_6(&mut job, dir, "job");
    assert!(
        got == want,
        "restored at the source after a post-copy cut: the buffers differ"
    );
}

/// [`finish`] of a job one step further (at step 6): steps to 9, a cudaMalloc, a dump, steps to
/// 12, a dump, its end.
fn finish_from_6(job: &mut Job, dir: &Path, tag: &str) -> [Vec<u8>; 2] {
    job.run("step 3", "done 9");
    finish_from_9(job, dir, tag)
}

/// [`finish_from_6`] of a job at step 9.
fn finish_from_9(job: &mut Job, dir: &Path, tag: &str) -> [Vec<u8>; 2] {
    job.run("malloc", "malloced");
    let mid = job.dump(&dir.join(format!("{tag}-mid.bin")));
    job.run("step 3", "done 12");
    let end = job.dump(&dir.join(format!("{tag}-end.bin")));
    job.run("exit", "bye");
    let _ = possum_criu::wait_for_exit(job.pid, Some(WAIT));
    job.pid = 0;
    [mid, end]
}

/// Waits until `job` was killed at the source and the destination named its image under
/// `received` (the final set whole: the kill goes on beside its send), then stalls the pieces'
/// streams of `relay`, then waits until the job is restored at the destination (the same PID,
/// on this host).
fn stall_once_restored_there(job: &Job, relay: &Relay, received: &Path) {
    let t = Instant::now();
    while alive(job.pid) || !names(received).iter().any(|n| !n.contains(".receiving-")) {
        assert!(
            t.elapsed() < WAIT,
            "the job was not killed at the source, or its image not named there"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    relay.stall_streams();
    while !alive(job.pid) {
        assert!(
            t.elapsed() < WAIT,
            "the job was not restored at the destination"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Reaps the job restored at the destination as `pid` once it is killed there (this process, a
/// subreaper, is its parent once CRIU leaves it): whether it was, within the post-copy's lease
/// and [`WAIT`].
fn reaped_once_killed_there(pid: i32) -> std::thread::JoinHandle<bool> {
    std::thread::spawn(move || {
        let t = Instant::now();
        let limit = WAIT + possum_sequence::migrate::POST_COPY_LEASE;
        while possum_criu::wait_for_exit(pid, Some(limit)).is_err() {
            if t.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    })
}
