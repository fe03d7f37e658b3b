//! A whole checkpoint session through the control socket, on the fake GPU (see `fake_gpu.rs`):
//! a job (`tests/fake/fake_session_job.c`) that keeps buffers allocated through cudaMalloc (served
//! by the engine) and modifies them step by step, driven one command at a time on its stdin, while
//! the test sends `Checkpoint`, `Release` and `Resume` to libpossum in it. Checks the replies, the
//! image's appearance, that the paused job makes no progress and touches nothing, that its buffers
//! are released, that it goes on after the resume with exactly the data of a run that was never
//! checkpointed, and that refused requests leave the job as it was. The job's work reaches possum
//! either through the driver's entry points (`FAKE_VIA=entry`: its launches and copies are calls
//! of the fake driver, possum's wrappers of them run the hooks; no CUPTI) or through the fake
//! CUPTI's callbacks (`POSSUM_HOOKS=cupti`).

use std::path::{Path, PathBuf};
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use possum_control::{request, ControlError, Request};
use serde_json::Value;

mod common;
use common::{build_fake_gpu, fake_job_command, libpossum, Piped};

/// Bound on every wait for something that should happen (a reply, a job's answer): generous, as
/// only a bug makes it expire.
const WAIT: Duration = Duration::from_secs(10);
/// How long a paused job is watched for progress it must not make.
const STILL: Duration = Duration::from_millis(300);

/// The job's buffers (bytes), as fake_session_job.c allocates them.
const A: u64 = 1 << 20;
const B: u64 = 1 << 20;
const C: u64 = 1 << 18;
const D: u64 = 1 << 16;
/// The fake driver's allocation granularity: what each buffer maps.
const GRANULE: u64 = 2 << 20;

/// A running job (see [`Piped`]).
struct Job(Piped);

/// How the job's work reaches possum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// The driver's entry points (possum's default hooks).
    Entry,
    /// The fake CUPTI's callbacks, fired by the job (`POSSUM_HOOKS=cupti`).
    Cupti,
}

impl Job {
    fn start(dir: &Path, name: &str, possum: bool, resolve: &str, via: Via) -> Job {
        let stderr = dir.join(format!("{name}.stderr"));
        let lib = possum.then(libpossum);
        let mut cmd = fake_job_command(dir, "fake_session_job", lib.as_deref());
        match via {
            Via::Entry => cmd.env("FAKE_VIA", "entry"),
            Via::Cupti => cmd
                .env("POSSUM_HOOKS", "cupti")
                .env("POSSUM_CUPTI", dir.join("libfakecupti.so"))
                .env("FAKE_CUPTI_NO_AUTOFIRE", "1"),
        };
        // Read-only speculation on (it needs images proven by fingerprints: the fake driver's
        // kernel): A, only read by the job's steps, is then not taken as written, and the
        // release copies only what the steps write.
        cmd.env("POSSUM_SOCKET_DIR", dir.join("sockets"))
            .env("POSSUM_VERBOSE", "1")
            .env("POSSUM_VALIDATE", "readonly_after=2")
            .env("FAKE_CUDA_FINGERPRINT", "1")
            .env("POSSUM_RESOLVE", resolve);
        let mut job = Job(Piped::spawn(&mut cmd, stderr));
        job.expect("ready");
        job
    }

    fn pid(&self) -> u32 {
        self.0.child.id()
    }

    fn log(&self) -> String {
        self.0.log()
    }

    fn send(&mut self, cmd: &str) {
        self.0.send(cmd);
    }

    /// The job's next answer, which must be `want`, within [`WAIT`].
    fn expect(&mut self, want: &str) {
        self.0.expect(want, WAIT);
    }

    /// Sends `cmd` and waits for its answer `want`.
    fn run(&mut self, cmd: &str, want: &str) {
        self.send(cmd);
        self.expect(want);
    }

    /// Asserts that the job answers nothing for `d` (it is blocked).
    fn assert_silent(&self, d: Duration) {
        match self.0.lines.recv_timeout(d) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(line) => panic!(
                "the paused job answered {line:?}: it was not blocked; stderr:\n{}",
                self.log()
            ),
            Err(RecvTimeoutError::Disconnected) => {
                panic!("the job closed its stdout; stderr:\n{}", self.log())
            }
        }
    }

    /// Sends `exit`, expects `bye` and a clean exit within [`WAIT`].
    fn finish(mut self) {
        self.run("exit", "bye");
        drop(self.0.stdin.take());
        let t = Instant::now();
        loop {
            if let Some(status) = self.0.child.try_wait().unwrap() {
                assert!(status.success(), "{status}; stderr:\n{}", self.log());
                return;
            }
            assert!(
                t.elapsed() < WAIT,
                "the job did not exit; stderr:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The temporary directory of the test, removed when dropped (kept if the test failed, for a
/// look at the job's stderr and the images).
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The session's requests, to one job.
struct Ctl {
    pid: u32,
    sockets: PathBuf,
}

impl Ctl {
    fn ask(&self, req: &Request) -> Result<Value, ControlError> {
        request(self.pid, &self.sockets, req, WAIT)
    }

    fn ok(&self, req: &Request) -> Value {
        self.ask(req)
            .unwrap_or_else(|e| panic!("{req:?} failed: {e}"))
    }

    /// The job's error message for `req`, which must be refused.
    fn refused(&self, req: &Request) -> String {
        match self.ask(req) {
            Err(ControlError::Remote(m)) => m,
            other => panic!("{req:?} should have been refused, got {other:?}"),
        }
    }

    /// `possum.session` and `possum.engines[0].engine` and `possum.counters` of the status.
    fn status(&self) -> (Value, Value, Value) {
        let v = self.ok(&Request::Status);
        let p = &v["possum"];
        assert_eq!(p["engines"].as_array().map(Vec::len), Some(1), "{v}");
        (
            p["session"].clone(),
            p["engines"][0]["engine"].clone(),
            p["counters"].clone(),
        )
    }

    /// Polls the status until the restore has finished (the engine idle again, its figures in
    /// `session.last.restore`); returns those figures.
    fn wait_restored(&self) -> Value {
        let t = Instant::now();
        loop {
            let (session, engine, _) = self.status();
            let r = &session["last"]["restore"];
            if engine["phase"] == "idle" && r.is_object() {
                assert!(r.get("error").is_none(), "restore failed: {r}");
                return r.clone();
            }
            assert!(t.elapsed() < WAIT, "restore not done: {session} {engine}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn dir_str(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// Names in `dir` that are an image's temporary directory (`.gpu-0.tmp-...`).
fn temp_images(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".gpu-0.tmp-"))
        .collect()
}

/// The job's commands around the sessions, in order: the reference run sends the same ones.
const STEPS_BEFORE: &str = "step 5"; // steps 1-5
const STEPS_PRECOPY: &str = "step 2"; // steps 6-7, after the pre-copy: B and C (6 % 3 == 0) dirty
const STEP_PAUSED: &str = "step 1"; // step 8, sent while paused
const STEPS_AFTER: &str = "step 4"; // steps 9-12
const STEPS_END: &str = "step 3"; // steps 13-15

/// What the job's dump must hold after [`STEPS_END`], computed here from the job's definition.
fn model() -> Vec<u8> {
    let a: Vec<u32> = (0..A / 4).map(|i| (7 * i + 1) as u32).collect();
    let mut b: Vec<u32> = (0..B / 4).map(|i| (i as u32) ^ 0x5a5a_5a5a).collect();
    let mut c = vec![0u32; (C / 4) as usize];
    let d: Vec<u32> = (0..D / 4).map(|i| 0xd000_0000 + i as u32).collect();
    for s in 1..=15u32 {
        for (y, x) in b.iter_mut().zip(&a) {
            *y = y.wrapping_mul(2_654_435_761).wrapping_add(x ^ s);
        }
        if s % 3 == 0 {
            for (i, z) in c.iter_mut().enumerate() {
                *z = z.wrapping_add((i as u32).wrapping_mul(s).wrapping_add(1));
            }
        }
    }
    [a, b, c, d]
        .iter()
        .flatten()
        .flat_map(|w| w.to_le_bytes())
        .collect()
}

/// The first offset at which `got` and `want` differ, for the failure message.
fn first_difference(got: &[u8], want: &[u8]) -> String {
    match got.iter().zip(want).position(|(g, w)| g != w) {
        Some(i) => format!(
            "first difference at byte {i} (buffer {}), {} vs {} bytes",
            ["A", "B", "C", "D"][match i as u64 {
                x if x < A => 0,
                x if x < A + B => 1,
                x if x < A + B + C => 2,
                _ => 3,
            }],
            got.len(),
            want.len()
        ),
        None => format!("lengths {} vs {}", got.len(), want.len()),
    }
}

/// One test per row: `name: resolve, via` runs [`session_test`] with `POSSUM_RESOLVE=resolve`
/// and the job's work reaching possum through `via`.
macro_rules! session_tests {
    ($($(#[$doc:meta])* $name:ident: $resolve:literal, $via:ident;)*) => {
        $(
            $(#[$doc])*
            #[test]
            fn $name() {
                session_test($resolve, Via::$via);
            }
        )*
    };
}

session_tests! {
    /// The job's launches and copies through the driver's entry points: the pause blocks its
    /// next launch in possum's wrapper of `cuLaunchKernel`.
    a_session_on_a_fake_gpu: "always", Entry;
    /// The same session with operations resolved only while the engine tracks (`sessions`):
    /// before the first checkpoint nothing is looked at, from the pre-copy to the restore
    /// everything is, and once restored nothing again; the image and the data are the same.
    a_session_resolving_only_while_tracking: "sessions", Entry;
    /// The session with the job's work seen through CUPTI's callbacks (`POSSUM_HOOKS=cupti`).
    a_session_seen_through_cupti: "always", Cupti;
    /// Through CUPTI, resolving only while tracking.
    a_session_seen_through_cupti_resolving_only_while_tracking: "sessions", Cupti;
}

/// Launches whose buffers were looked at, not counting validated ones (those always are), and
/// whether the engine tracks.
fn examined(ctl: &Ctl) -> (u64, bool) {
    let (_, engine, counters) = ctl.status();
    let n = |k: &str| counters[k].as_u64().unwrap();
    (
        n("launches_examined") - n("validations"),
        engine["tracking"].as_bool().unwrap(),
    )
}

/// The session test with `POSSUM_RESOLVE=resolve`, the job's work reaching possum `via`.
fn session_test(resolve: &str, via: Via) {
    let only_tracking = resolve == "sessions";
    let t_start = Instant::now();
    let tmp = TempDir(std::env::temp_dir().join(format!(
        "possum-fakesession-{resolve}-{via:?}-{}",
        std::process::id()
    )));
    let dir = tmp.0.clone();
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    if !build_fake_gpu(&dir, "tests/fake/fake_session_job.c", "fake_session_job") {
        return;
    }
    let images = dir.join("images");
    let images2 = dir.join("images2");
    let sockets = dir.join("sockets");

    // The reference: the same commands without possum (the fake runtime's own allocations).
    let reference = dir.join("reference.bin");
    {
        let mut job = Job::start(&dir, "reference", false, resolve, via);
        for (cmd, want) in [
            (STEPS_BEFORE, "done 5"),
            (STEPS_PRECOPY, "done 7"),
            (STEP_PAUSED, "done 8"),
            (STEPS_AFTER, "done 12"),
            ("malloc", "malloced"),
            (STEPS_END, "done 15"),
        ] {
            job.run(cmd, want);
        }
        job.run(&format!("dump {}", reference.display()), "dumped");
        job.finish();
    }
    let reference = std::fs::read(&reference).unwrap();
    let want = model();
    assert!(
        reference == want,
        "the job does not compute what the test thinks: {}",
        first_difference(&reference, &want)
    );

    let mut job = Job::start(&dir, "session", true, resolve, via);
    let ctl = Ctl {
        pid: job.pid(),
        sockets,
    };
    let (session, engine, counters) = ctl.status();
    assert_eq!(session["cupti_attached"], via == Via::Cupti, "{session}");
    assert_eq!(session["hooks_live"], true, "{session}");
    let v = ctl.ok(&Request::Status);
    if via == Via::Entry {
        // cuLaunchKernel and cuGetProcAddress_v2 by dlsym, cuMemcpyHtoD and cuMemcpyDtoH by
        // cuGetProcAddress: possum's wrappers; the three fills went through one.
        assert_eq!(v["entry"]["swapped_dlsym"], 2, "{v}");
        assert_eq!(v["entry"]["swapped_proc_address"], 2, "{v}");
        assert_eq!(v["copies"]["cuMemcpyHtoD_v2"], 3, "{v}");
    } else {
        assert_eq!(
            v["entry"]["seen_beside_cupti"],
            serde_json::json!({}),
            "{v}"
        );
    }
    assert_eq!(session["paused"], false, "{session}");
    assert_eq!(engine["buffers"], 3, "{engine}");
    assert_eq!(engine["phase"], "idle", "{engine}");
    assert_eq!(counters["managed_allocs"], 3, "{counters}");
    assert_eq!(counters["copies"], 3, "{counters}");

    // A release or a pre-copy round with no checkpoint before it: refused, and the job is not
    // left paused.
    let m = ctl.refused(&Request::PrecopyRound);
    assert!(m.contains("send checkpoint first"), "{m}");
    let m = ctl.refused(&Request::Release);
    assert!(m.contains("send checkpoint first"), "{m}");
    let (session, engine, _) = ctl.status();
    assert_eq!(session["paused"], false, "{session}");
    assert!(session["busy"].is_null(), "{session}");
    assert_eq!(engine["phase"], "idle", "{engine}");
    job.run(STEPS_BEFORE, "done 5");
    let (before, tracking) = examined(&ctl);
    assert!(!tracking, "tracking before any checkpoint");
    if only_tracking {
        assert_eq!(before, 0, "launches looked at while not tracking");
    } else {
        assert!(before >= 3, "{before}");
    }
    // A resume with nothing released is harmless: nothing to restore, nothing paused.
    let r = ctl.ok(&Request::Resume { dir: None });
    assert_eq!(r["restoring"], serde_json::json!([]), "{r}");

    // Checkpoint: a pre-copy round of every buffer (all new, so all dirty) while the job waits
    // for its next command; nothing is written meanwhile.
    let r = ctl.ok(&Request::Checkpoint {
        dir: dir_str(&images),
        parent: None,
    });
    assert_eq!(r["hooks"], true, "{r}");
    let pre = &r["precopy"];
    assert_eq!(pre.as_array().map(Vec::len), Some(1), "{r}");
    assert_eq!(pre[0]["device"], 0, "{r}");
    assert_eq!(pre[0]["buffers"], 3, "{r}");
    assert_eq!(pre[0]["bytes"], A + B + C, "{r}");
    assert_eq!(pre[0]["dirty_after"], 0, "{r}");
    // The image is written in a temporary directory; it is committed at the release only.
    assert!(!images.join("gpu-0").exists());
    assert_eq!(temp_images(&images).len(), 1, "{:?}", temp_images(&images));
    let (session, engine, _) = ctl.status();
    assert_eq!(session["paused"], false, "{session}");
    assert!(session["last"]["checkpoint"].is_object(), "{session}");
    assert_eq!(engine["phase"], "idle", "{engine}");

    // The job goes on: it writes B (both steps) and C (step 6) after the pre-copy, not A.
    let (at_precopy, tracking) = examined(&ctl);
    assert!(
        tracking,
        "a checkpoint is open but the engine does not track"
    );
    job.run(STEPS_PRECOPY, "done 7");
    let (n, _) = examined(&ctl);
    assert!(
        n >= at_precopy + 2,
        "launches after the pre-copy not looked at: {n}"
    );
    // Status tells what a release would take now.
    let (_, engine, _) = ctl.status();
    assert_eq!(engine["dirty_buffers"], 2, "{engine}");
    assert_eq!(engine["dirty_bytes"], B + C, "{engine}");
    // One variant takes a second pre-copy round (a migration's): B and C, the job running; a
    // third finds nothing written, and the release then copies nothing.
    let rounds = via == Via::Entry && !only_tracking;
    if rounds {
        let r = ctl.ok(&Request::PrecopyRound);
        assert_eq!(r["precopy"][0]["buffers"], 2, "{r}");
        assert_eq!(r["precopy"][0]["bytes"], B + C, "{r}");
        assert_eq!(r["precopy"][0]["dirty_after"], 0, "{r}");
        let r = ctl.ok(&Request::PrecopyRound);
        assert_eq!(r["precopy"][0]["buffers"], 0, "{r}");
        assert_eq!(ctl.status().1["dirty_bytes"], 0);
    }

    // Release: paused, the dirty buffers copied, the image committed, the buffers released.
    let r = ctl.ok(&Request::Release);
    let fin = &r["final"];
    assert_eq!(fin.as_array().map(Vec::len), Some(1), "{r}");
    let (bufs, bytes) = if rounds { (0, 0) } else { (2, B + C) };
    assert_eq!(
        fin[0]["buffers"], bufs,
        "only B and C were written since the pre-copy: {r}"
    );
    assert_eq!(fin[0]["bytes"], bytes, "{r}");
    assert_eq!(fin[0]["image_buffers"], 3, "{r}");
    assert_eq!(r["released_bytes"], 3 * GRANULE, "{r}");
    assert_eq!(r["devices"], serde_json::json!([0]), "{r}");
    // The pinned staging is freed for CRIU's dump (the restore below allocates it again).
    assert!(
        r["staging_freed_bytes"].as_u64().unwrap_or(0) > 0,
        "staging not freed: {r}"
    );
    assert!(images.join("gpu-0").join("manifest.pb").is_file());
    assert!(
        temp_images(&images).is_empty(),
        "{:?}",
        temp_images(&images)
    );
    let img = possum_engine::image::Image::open(&images.join("gpu-0")).unwrap();
    img.verify().unwrap();
    assert_eq!(img.summary().buffers.len(), 3);
    assert_eq!(img.summary().total_bytes, A + B + C);

    let (session, engine, counters) = ctl.status();
    assert_eq!(session["paused"], true, "{session}");
    assert!(session["busy"].is_null(), "{session}");
    assert_eq!(engine["phase"], "released", "{engine}");
    assert_eq!(engine["resident_bytes"], 0, "{engine}");
    assert_eq!(engine["buffers"], 3, "{engine}");

    // A launch while paused blocks before possum (or the "kernel") touches anything: the step
    // does not happen, possum does not even count the launch.
    job.send(STEP_PAUSED);
    job.assert_silent(STILL);
    let (session, engine, counters2) = ctl.status();
    assert_eq!(session["paused"], true, "{session}");
    assert_eq!(engine["phase"], "released", "{engine}");
    assert_eq!(counters2["launches"], counters["launches"], "{counters2}");
    assert_eq!(session["pause_waits"], 0, "{session}");

    // Refused while paused, each leaving the job paused and released.
    let m = ctl.refused(&Request::Release);
    assert!(m.contains("already paused"), "{m}");
    let m = ctl.refused(&Request::Resume { dir: None });
    assert!(m.contains("image directory"), "{m}");
    let m = ctl.refused(&Request::Checkpoint {
        dir: dir_str(&images2),
        parent: None,
    });
    assert!(m.contains("paused"), "{m}");
    let nowhere = dir.join("no-such-images");
    let m = ctl.refused(&Request::Resume {
        dir: Some(dir_str(&nowhere)),
    });
    assert!(
        m.contains("device 0") && m.contains(&dir_str(&nowhere.join("gpu-0"))),
        "{m}"
    );
    let (session, engine, _) = ctl.status();
    assert_eq!(session["paused"], true, "{session}");
    assert!(session["busy"].is_null(), "{session}");
    assert_eq!(engine["phase"], "released", "{engine}");
    assert_eq!(engine["resident_bytes"], 0, "{engine}");
    job.assert_silent(Duration::from_millis(50));

    // Resume: the blocked step goes on (its buffers restored on demand or by the prefetcher).
    let r = ctl.ok(&Request::Resume {
        dir: Some(dir_str(&images)),
    });
    assert_eq!(r["restoring"], serde_json::json!([0]), "{r}");
    assert_eq!(r["on_demand"], true, "{r}");
    job.expect("done 8");
    let restored = ctl.wait_restored();
    assert_eq!(restored["buffers"], 3, "{restored}");
    // Restored: the session is over, tracking ends.
    let (done_at, tracking) = examined(&ctl);
    assert!(!tracking, "still tracking after the restore");
    assert_eq!(restored["bytes"], A + B + C, "{restored}");
    let (session, engine, _) = ctl.status();
    assert_eq!(session["paused"], false, "{session}");
    assert_eq!(session["pause_waits"], 1, "{session}");
    // (Counted from when the job's thread reached the gate, which a loaded machine may delay:
    // that it stayed there through the pause is what `assert_silent` showed.)
    assert!(
        session["pause_wait_ms"].as_f64().unwrap() > 0.0,
        "{session}"
    );
    assert_eq!(engine["resident_bytes"], 3 * GRANULE, "{engine}");

    // A second session, into another directory (the first one's image is there to stay): this
    // time a cudaMalloc is what waits for the resume.
    job.run(STEPS_AFTER, "done 12");
    let (n, _) = examined(&ctl);
    if only_tracking {
        assert_eq!(n, done_at, "launches looked at after the restore");
    } else {
        assert!(n >= done_at + 4, "{n} {done_at}");
    }
    let m = ctl.refused(&Request::Checkpoint {
        dir: dir_str(&images),
        parent: None,
    });
    assert!(m.contains("gpu-0"), "an image already there: {m}");
    assert_eq!(ctl.status().0["paused"], false);
    let r = ctl.ok(&Request::Checkpoint {
        dir: dir_str(&images2),
        parent: None,
    });
    // A new image gets every buffer, not only those written since the last pre-copy round (B
    // and C; that round went into the first image): without A this image could not be resumed.
    assert_eq!(r["precopy"][0]["buffers"], 3, "{r}");
    assert_eq!(r["precopy"][0]["bytes"], A + B + C, "{r}");
    let r = ctl.ok(&Request::Release);
    assert_eq!(
        r["final"][0]["buffers"], 0,
        "nothing was written since the pre-copy: {r}"
    );
    assert_eq!(r["final"][0]["image_buffers"], 3, "{r}");
    let (_, engine, counters) = ctl.status();
    assert_eq!(engine["phase"], "released", "{engine}");
    job.send("malloc");
    job.assert_silent(STILL);
    let (session, engine, counters2) = ctl.status();
    assert_eq!(session["paused"], true, "{session}");
    assert_eq!(
        engine["buffers"], 3,
        "the paused cudaMalloc allocated: {engine}"
    );
    assert_eq!(counters2["managed_allocs"], counters["managed_allocs"]);
    let r = ctl.ok(&Request::Resume {
        dir: Some(dir_str(&images2)),
    });
    assert_eq!(r["restoring"], serde_json::json!([0]), "{r}");
    job.expect("malloced");
    job.run(STEPS_END, "done 15");
    ctl.wait_restored();
    let (session, engine, counters) = ctl.status();
    assert_eq!(session["paused"], false, "{session}");
    assert_eq!(session["pause_waits"], 2, "{session}");
    assert_eq!(engine["buffers"], 4, "{engine}");
    assert_eq!(engine["resident_bytes"], 4 * GRANULE, "{engine}");
    assert_eq!(counters["managed_allocs"], 4, "{counters}");
    assert_eq!(counters["hook_errors"], 0, "{counters}");
    // Steps 1-15: 15 mixes and 5 bumps, each launch counted once (the one that waited too).
    let v = ctl.ok(&Request::Status);
    assert_eq!(v["launches"]["cuLaunchKernel"], 20, "{v}");
    assert_eq!(v["total_launches"], 20, "{v}");

    // The data: bit for bit what the run without possum computed.
    let dump = dir.join("session.bin");
    job.run(&format!("dump {}", dump.display()), "dumped");
    let got = std::fs::read(&dump).unwrap();
    assert!(
        got == reference,
        "the checkpointed job's buffers differ from the uninterrupted run's: {}",
        first_difference(&got, &reference)
    );
    let log = job.log();
    job.finish();
    assert!(!log.contains("failed"), "{log}");
    eprintln!(
        "fake session test took {:.2} s",
        t_start.elapsed().as_secs_f64()
    );
}
