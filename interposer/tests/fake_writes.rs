//! The driver's less common writing functions, each through a checkpoint session on the fake GPU
//! (`tests/fake/fake_writes_job.c`, which calls them by name: possum's wrappers under
//! `LD_PRELOAD`): a write made after the pre-copy and before T0 (the release) is marked, so it is
//! in the image; the same function called while the job is paused is held in possum's wrapper
//! until the resume, so what it writes after T0 is not in the image (and never touches a released
//! buffer). A peer copy into a second device's buffer is marked on that device's engine and is in
//! that device's image.

use std::path::{Path, PathBuf};
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use possum_control::{request, Request};
use possum_engine::image::Image;
use possum_engine::store::ChunkSource;
use serde_json::Value;

mod common;
use common::{build_fake_gpu_linked, fake_job_command, fresh_dir, libpossum, Piped};

/// Bound on every wait for something that should happen: generous, as only a bug makes it expire.
const WAIT: Duration = Duration::from_secs(10);
/// How long a paused job is watched for an answer it must not give.
const STILL: Duration = Duration::from_millis(200);

/// The u32 word a function leaves for the value `v` (< 256) it was given.
type Word = fn(u32) -> u32;

/// The functions the job writes through on device 0, and the u32 word each leaves at X.
const OPS: &[(&str, Word)] = &[
    ("cuMemcpyPeer", same),
    ("cuMemcpyPeerAsync", same),
    ("cuMemcpy2D_v2", same),
    ("cuMemcpy3D_v2", same),
    ("cuMemcpy3DPeer", same),
    ("cuMemcpy3DPeerAsync", same),
    ("cuMemcpyAtoD_v2", same),
    ("cuMemcpyWithAttributesAsync", same),
    ("cuMemcpyBatchAsync_v2", same),
    ("cuMemsetD2D8_v2", bytes),
    ("cuMemsetD2D16_v2", halves),
    ("cuMemsetD2D32_v2", same),
    ("cuMemsetD2D8Async", bytes),
    ("cuMemsetD2D16Async", halves),
    ("cuMemsetD2D32Async", same),
    ("cuStreamWriteValue32", same),
    ("cuStreamWriteValue32_v2", same),
    ("cuStreamWriteValue64", same),
    ("cuStreamWriteValue64_v2", same),
    ("cuStreamBatchMemOp", same),
    ("cuStreamBatchMemOp_v2", same),
    ("cuLaunch", same),
    ("cuLaunchGrid", same),
    ("cuLaunchGridAsync", same),
    ("cuLaunchCooperativeKernelMultiDevice", same),
];

fn same(v: u32) -> u32 {
    v
}
fn bytes(v: u32) -> u32 {
    0x0101_0101 * v
}
fn halves(v: u32) -> u32 {
    0x0001_0001 * v
}

/// The job: its stdin, its stdout lines, its stderr file; killed when dropped.
struct Job {
    p: Piped,
    /// X and Y on device 0, Z on device 1 (0 without it).
    x: u64,
    z: u64,
}

impl Job {
    fn start(dir: &Path, devices: u32) -> Job {
        Job::start_with(dir, devices, &[])
    }

    /// [`Job::start`] with `env` set for the job too.
    fn start_with(dir: &Path, devices: u32, env: &[(&str, &str)]) -> Job {
        let stderr = dir.join(format!("job-{devices}.stderr"));
        let lib = libpossum();
        let mut cmd = fake_job_command(dir, "fake_writes_job", Some(&lib));
        cmd.envs(env.iter().copied());
        cmd.env("FAKE_CUDA_DEVICES", devices.to_string())
            .env("POSSUM_SOCKET_DIR", dir.join("sockets"))
            .env("POSSUM_VERBOSE", "1");
        let mut job = Job {
            p: Piped::spawn(&mut cmd, stderr),
            x: 0,
            z: 0,
        };
        let ready = job.next();
        let words: Vec<u64> = ready
            .strip_prefix("ready ")
            .unwrap_or_else(|| panic!("{ready:?}; stderr:\n{}", job.log()))
            .split(' ')
            .map(|w| u64::from_str_radix(w, 16).unwrap())
            .collect();
        job.x = words[0];
        job.z = words[2];
        job
    }

    /// The control of the job, whose sockets are in `dir`.
    fn ctl(&self, dir: &Path) -> Ctl {
        Ctl {
            pid: self.p.child.id(),
            sockets: dir.join("sockets"),
        }
    }

    /// Tells the job to exit, waits for its goodbye, and removes `dir`.
    fn exit(mut self, dir: &Path) {
        self.send("exit");
        self.expect("bye");
        let _ = std::fs::remove_dir_all(dir);
    }

    fn log(&self) -> String {
        self.p.log()
    }

    fn send(&mut self, cmd: &str) {
        self.p.send(cmd);
    }

    fn next(&mut self) -> String {
        self.p.next(WAIT)
    }

    fn expect(&mut self, want: &str) {
        self.p.expect(want, WAIT);
    }

    /// Asserts that the job answers nothing for [`STILL`] (it is held).
    fn assert_silent(&self) {
        match self.p.lines.recv_timeout(STILL) {
            Err(RecvTimeoutError::Timeout) => {}
            other => panic!(
                "the paused job answered ({other:?}): its call was not held; stderr:\n{}",
                self.log()
            ),
        }
    }
}

struct Ctl {
    pid: u32,
    sockets: PathBuf,
}

impl Ctl {
    fn ok(&self, req: &Request) -> Value {
        request(self.pid, &self.sockets, req, WAIT).unwrap_or_else(|e| panic!("{req:?}: {e}"))
    }

    /// Polls the status until every engine is idle again after a resume.
    fn wait_restored(&self) {
        let t = Instant::now();
        loop {
            let v = self.ok(&Request::Status);
            let engines = v["possum"]["engines"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if !engines.is_empty() && engines.iter().all(|e| e["engine"]["phase"] == "idle") {
                return;
            }
            assert!(t.elapsed() < WAIT, "restore not done: {v}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn hook_errors(&self) -> u64 {
        self.ok(&Request::Status)["possum"]["counters"]["hook_errors"]
            .as_u64()
            .unwrap()
    }
}

/// The u32 word at `va` in the image `dir` (the buffer that holds it).
fn image_word(dir: &Path, va: u64) -> u32 {
    let img = Image::open(dir).unwrap();
    img.verify().unwrap();
    let b = img
        .buffers()
        .into_iter()
        .find(|b| b.va <= va && va < b.va + b.size)
        .unwrap_or_else(|| panic!("no buffer at {va:#x} in {}", dir.display()));
    let off = va - b.va;
    let (c_off, c_len) = img
        .chunks(b.id)
        .into_iter()
        .find(|&(o, l)| o <= off && off < o + l)
        .unwrap();
    let mut data = vec![0u8; c_len as usize];
    img.read_chunk(b.id, c_off, &mut data).unwrap();
    let i = (off - c_off) as usize;
    u32::from_le_bytes(data[i..i + 4].try_into().unwrap())
}

fn setup(name: &str) -> Option<PathBuf> {
    let dir = fresh_dir(&format!("fakewrites-{name}"));
    let built = build_fake_gpu_linked(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")),
        &dir,
        "tests/fake/fake_writes_job.c",
        "fake_writes_job",
        &["-l:libcuda.so.1"],
    );
    built.then_some(dir)
}

/// One session around `op NAME`: checkpoint (the pre-copy), the write of 1 (marked: it must be in
/// the image), release (T0), the write of 2 sent while paused (held: no answer), resume (it goes
/// on). Checks the image of device `device` holds `want(1)` at `va`; returns the release's reply.
fn session(
    job: &mut Job,
    ctl: &Ctl,
    images: &Path,
    name: &str,
    device: u32,
    va: u64,
    want: u32,
) -> Value {
    let r = ctl.ok(&Request::Checkpoint {
        dir: images.to_str().unwrap().to_string(),
        parent: None,
    });
    assert_eq!(r["hooks"], true, "{r}");
    job.send(&format!("op {name} 1"));
    job.expect(&format!("did {name}"));
    let released = ctl.ok(&Request::Release);
    job.send(&format!("op {name} 2"));
    job.assert_silent();
    let got = image_word(&images.join(format!("gpu-{device}")), va);
    assert_eq!(
        got,
        want,
        "{name}: the image holds {got:#x} at {va:#x}, not the write made before T0 ({want:#x}); \
         the pre-copy saw the previous value, a write after T0 would be {:#x}",
        want * 2
    );
    ctl.ok(&Request::Resume {
        dir: Some(images.to_str().unwrap().to_string()),
    });
    job.expect(&format!("did {name}"));
    ctl.wait_restored();
    released
}

/// Every newly wrapped writing function on one device: marked before T0, held after it.
#[test]
fn writes_through_each_function_are_marked_and_held() {
    let Some(dir) = setup("one") else { return };
    let mut job = Job::start(&dir, 1);
    let ctl = job.ctl(&dir);
    let x = job.x;
    for (i, (name, want)) in OPS.iter().enumerate() {
        let images = dir.join(format!("images-{i}"));
        session(&mut job, &ctl, &images, name, 0, x, want(1));
    }
    assert_eq!(ctl.hook_errors(), 0);
    let v = ctl.ok(&Request::Status);
    // Each function called twice, counted once each time (the held call too).
    assert_eq!(v["memsets"]["cuMemsetD2D8_v2"], 2, "{v}");
    assert_eq!(v["memsets"]["cuStreamWriteValue64_v2"], 2, "{v}");
    assert_eq!(v["copies"]["cuMemcpy3DPeer"], 2, "{v}");
    assert_eq!(v["launches"]["cuLaunchGridAsync"], 2, "{v}");
    job.exit(&dir);
}

/// A peer copy from device 0's buffer into device 1's, issued from device 0's context: the write
/// lands on device 1's buffer, is marked by device 1's engine and is in device 1's image; while
/// paused it is held.
#[test]
fn a_peer_copy_is_marked_on_the_destinations_device() {
    let Some(dir) = setup("two") else { return };
    let (mut job, ctl) = two_devices(&dir, &[]);
    let (x, z) = (job.x, job.z);
    for (i, name) in ["cuMemcpyPeer1", "cuMemcpyPeerAsync1"].iter().enumerate() {
        let images = dir.join(format!("images-{i}"));
        session(&mut job, &ctl, &images, name, 1, z, 1);
        // Device 0's image holds the source's buffers; X is untouched by the copy.
        assert_eq!(image_word(&images.join("gpu-0"), x), 0);
    }
    // A launch on several devices, whose buffers possum does not know: every device's engine
    // takes it as writing all its buffers (Z too, on device 1, though this one writes X only).
    let images = dir.join("images-multi");
    let r = session(
        &mut job,
        &ctl,
        &images,
        "cuLaunchCooperativeKernelMultiDevice",
        0,
        x,
        1,
    );
    assert_every_buffer_marked(&r);
    assert_eq!(ctl.hook_errors(), 0);
    job.exit(&dir);
}

/// Asserts that the session `r` marked every buffer of both devices: X and Y on device 0, Z on
/// device 1.
fn assert_every_buffer_marked(r: &Value) {
    let fin = r["final"].as_array().unwrap();
    let on = |d: u64| fin.iter().find(|f| f["device"] == d).unwrap()["buffers"].clone();
    assert_eq!(on(0), 2, "X and Y marked on device 0: {r}");
    assert_eq!(on(1), 1, "Z marked on device 1: {r}");
}

/// The engines of a two-device job (X on device 0, Z on device 1), and its control.
fn two_devices(dir: &Path, env: &[(&str, &str)]) -> (Job, Ctl) {
    let job = Job::start_with(dir, 2, env);
    assert_ne!(job.z, 0, "no buffer on device 1");
    let ctl = job.ctl(dir);
    let v = ctl.ok(&Request::Status);
    assert_eq!(
        v["possum"]["engines"].as_array().map(Vec::len),
        Some(2),
        "{v}"
    );
    (job, ctl)
}

/// A peer copy into device 0's X queued on a stream of device 1's just before T0 (the fake
/// driver runs it only when that stream or device is synchronized, as a GPU that has not got to
/// it yet): T0 waits for the work every device queued before the pause, so device 0's image
/// holds what the copy wrote, not X as it was before.
#[test]
fn a_copy_queued_on_another_device_before_t0_is_in_the_image() {
    let Some(dir) = setup("queued") else { return };
    let (mut job, ctl) = two_devices(&dir, &[("FAKE_CUDA_QUEUE", "1")]);
    let x = job.x;
    for round in 0..2 {
        let images = dir.join(format!("images-{round}"));
        let r = session(&mut job, &ctl, &images, "queued", 0, x, 1);
        let fin = r["final"].as_array().unwrap();
        let on0 = fin.iter().find(|f| f["device"] == 0).unwrap();
        assert!(on0["buffers"].as_u64().unwrap() >= 1, "X marked: {r}");
        // Device 1's image holds Z as filled before the copy.
        assert_eq!(image_word(&images.join("gpu-1"), job.z), 1);
    }
    assert_eq!(ctl.hook_errors(), 0);
    job.exit(&dir);
}

/// A legacy launch from device 1's context (its arguments unknown to possum: opaque) that
/// writes device 0's X: every device's engine takes it as writing all its buffers, so X is in
/// device 0's image as written before T0; while paused it is held.
#[test]
fn an_opaque_launch_on_another_device_marks_every_device() {
    let Some(dir) = setup("opaque1") else { return };
    let (mut job, ctl) = two_devices(&dir, &[]);
    let x = job.x;
    let images = dir.join("images");
    let r = session(&mut job, &ctl, &images, "cuLaunch1", 0, x, 1);
    assert_every_buffer_marked(&r);
    assert_eq!(ctl.hook_errors(), 0);
    job.exit(&dir);
}

/// One held session (the job's threads parked for the whole copy) around `op next V`: the write
/// of `v` before T0 is in the image, that of `v + 1` sent while paused is held until the resume.
fn held_session(job: &mut Job, ctl: &Ctl, images: &Path, v: u32, hooks: bool) {
    let dir = images.to_str().unwrap().to_string();
    let r = ctl.ok(&Request::Checkpoint {
        dir: dir.clone(),
        parent: None,
    });
    assert_eq!(r["hooks"], hooks, "{r}");
    job.send(&format!("op next {v}"));
    job.expect("did next");
    let released = ctl.ok(&Request::Release);
    assert_eq!(released["held"], "threads parked", "{released}");
    job.send(&format!("op next {}", v + 1));
    job.assert_silent();
    let got = image_word(&images.join("gpu-0"), job.x);
    assert_eq!(
        got, v,
        "the image holds {got:#x}, not the write made before T0"
    );
    let resume = Request::Resume { dir: Some(dir) };
    if let Err(e) = request(ctl.pid, &ctl.sockets, &resume, WAIT) {
        panic!("{resume:?}: {e}; the job's stderr:\n{}", job.log());
    }
    job.expect("did next");
    ctl.wait_restored();
}

/// A function that writes device memory, handed out by `cuGetProcAddress` in a form possum
/// cannot match to a wrapper (the fake driver's unexported answer for a later version): possum
/// no longer trusts its hooks to see every write. A checkpoint begun before the job took it
/// drops its pre-copy and copies every buffer with the job's threads held; a later one holds
/// them from the start. Either way the image holds what the function wrote before T0.
#[test]
fn a_writer_handed_out_unwrapped_makes_checkpoints_hold_the_job() {
    let Some(dir) = setup("unwrapped") else {
        return;
    };
    let mut job = Job::start(&dir, 1);
    let ctl = job.ctl(&dir);
    held_session(&mut job, &ctl, &dir.join("images-0"), 1, true);
    let v = ctl.ok(&Request::Status);
    let named = v["entry"]["unwrapped_writers"].as_array().cloned();
    assert!(
        named.is_some_and(
            |n| n.len() == 1 && n[0].as_str().is_some_and(|s| s.starts_with("cuMemsetD32 "))
        ),
        "{v}"
    );
    held_session(&mut job, &ctl, &dir.join("images-1"), 3, false);
    assert_eq!(ctl.hook_errors(), 0);
    job.exit(&dir);
}

/// A held checkpoint (the job's threads parked for the whole copy, here because the job took a
/// writing function unwrapped) of a two-device job: the copy waits for the work every device
/// queued, so a peer copy into device 0's X queued on a stream of device 1's before T0 is in
/// device 0's image.
#[test]
fn a_held_copy_waits_for_every_devices_queued_work() {
    let Some(dir) = setup("heldqueued") else {
        return;
    };
    let (mut job, ctl) = two_devices(&dir, &[("FAKE_CUDA_QUEUE", "1")]);
    job.send("op next 5");
    job.expect("did next");
    let images = dir.join("images");
    let d = images.to_str().unwrap().to_string();
    let r = ctl.ok(&Request::Checkpoint {
        dir: d.clone(),
        parent: None,
    });
    assert_eq!(r["hooks"], false, "{r}");
    job.send("op queued 1");
    job.expect("did queued");
    let released = ctl.ok(&Request::Release);
    assert_eq!(released["held"], "threads parked", "{released}");
    assert_eq!(image_word(&images.join("gpu-0"), job.x), 1, "{released}");
    assert_eq!(image_word(&images.join("gpu-1"), job.z), 1, "{released}");
    let resume = Request::Resume { dir: Some(d) };
    if let Err(e) = request(ctl.pid, &ctl.sockets, &resume, WAIT) {
        panic!("{resume:?}: {e}; the job's stderr:\n{}", job.log());
    }
    ctl.wait_restored();
    job.exit(&dir);
}
