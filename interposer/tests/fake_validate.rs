//! Writes that validation could miss, during a checkpoint on the fake GPU: the job
//! (`tests/fake/fake_validate_job.c`) writes one element at a fixed offset of a 64 MiB buffer, an
//! overflow flag on some launches only, a buffer through a pointer table from a kernel no
//! validation checked, and launches on a stream it then destroys. Each case runs the job twice
//! with the same commands, once without possum (the reference) and once with a checkpoint
//! (pre-copy, the writes, release) and a resume from its image in between: the resumed job's
//! buffers came from the image, so they equal the reference's only if the image held every
//! buffer as it was at T0 (the release).

use std::path::{Path, PathBuf};
use std::time::Duration;

use possum_control::{request, ControlError, Request};
use serde_json::Value;

mod common;
use common::{cc, fake_gpu_dir, fake_job_command, libpossum, Piped};

/// Bound on every wait for a reply or an answer of the job: only a bug makes it expire (whole
/// 64 MiB buffers are checksummed on each validated launch, in a debug build).
const WAIT: Duration = Duration::from_secs(120);
/// The job's buffers, as fake_validate_job.c allocates them.
const BIG: u64 = 64 << 20;
const SMALL: u64 = 4 << 10;

struct Job(Piped);

impl Job {
    fn start(dir: &Path, name: &str, possum: bool, env: &[(&str, &str)]) -> Job {
        let stderr = dir.join(format!("{name}.stderr"));
        let lib = possum.then(libpossum);
        let mut cmd = fake_job_command(dir, "fake_validate_job", lib.as_deref());
        cmd.env("POSSUM_SOCKET_DIR", dir.join("sockets"))
            .env("POSSUM_VERBOSE", "1")
            .envs(env.iter().copied());
        let job = Job(Piped::spawn(&mut cmd, stderr));
        job.expect("ready");
        job
    }

    fn log(&self) -> String {
        self.0.log()
    }

    fn expect(&self, want: &str) {
        self.0.expect(want, WAIT);
    }

    /// Sends `cmd` and returns its answer.
    fn run(&mut self, cmd: &str) -> String {
        self.0.send(cmd);
        self.0.next(WAIT)
    }

    fn dump(&mut self, path: &Path) -> Vec<u8> {
        assert_eq!(self.run(&format!("dump {}", path.display())), "dumped");
        std::fs::read(path).unwrap()
    }

    fn ask(&self, dir: &Path, req: &Request) -> Value {
        request(self.0.child.id(), &dir.join("sockets"), req, WAIT)
            .unwrap_or_else(|e| panic!("{req:?}: {e}; stderr:\n{}", self.log()))
    }

    /// The job's error message for `req`, which must be refused.
    fn refused(&self, dir: &Path, req: &Request) -> String {
        match request(self.0.child.id(), &dir.join("sockets"), req, WAIT) {
            Err(ControlError::Remote(m)) => m,
            other => panic!("{req:?} should have failed, got {other:?}"),
        }
    }
}

/// What a case's checkpoint showed.
struct Outcome {
    /// The release's reply.
    release: Value,
    /// The status's `possum` object at the end.
    possum: Value,
    /// The job's stderr under possum (`POSSUM_VERBOSE=1`).
    log: String,
}

/// Runs `before`, a checkpoint into a new image, `during` (after its pre-copy), the release,
/// a resume from the image and `after`, under libpossum with `env`; then the same commands
/// without possum. The two runs' buffers must be equal. (A command in `after` that overwrites what
/// one in `during` wrote would hide a stale image: the cases leave those writes alone.)
fn case(
    name: &str,
    env: &[(&str, &str)],
    before: &[&str],
    during: &[&str],
    after: &[&str],
) -> Option<Outcome> {
    let dir = fake_gpu_dir(&format!("fakevalidate-{name}"), "fake_validate_job")?;
    let all: Vec<&str> = before.iter().chain(during).chain(after).copied().collect();
    let mut reference = Job::start(&dir, "reference", false, &[]);
    for cmd in &all {
        assert!(reference.run(cmd).starts_with("done"), "{cmd}");
    }
    let want = reference.dump(&dir.join("reference.bin"));
    drop(reference);

    let mut job = Job::start(&dir, "possum", true, env);
    for cmd in before {
        assert!(job.run(cmd).starts_with("done"), "{cmd}: {}", job.log());
    }
    let images = dir.join("images");
    let images_s = images.to_str().unwrap().to_string();
    let r = job.ask(
        &dir,
        &Request::Checkpoint {
            dir: images_s.clone(),
            parent: None,
        },
    );
    assert_eq!(r["precopy"][0]["buffers"], 4, "{r}");
    for cmd in during {
        assert!(job.run(cmd).starts_with("done"), "{cmd}: {}", job.log());
    }
    let release = job.ask(&dir, &Request::Release);
    assert!(
        images.join("gpu-0").join("manifest.pb").is_file(),
        "{release}"
    );
    let r = job.ask(
        &dir,
        &Request::Resume {
            dir: Some(images_s),
        },
    );
    assert_eq!(r["restoring"], serde_json::json!([0]), "{r}");
    for cmd in after {
        assert!(job.run(cmd).starts_with("done"), "{cmd}: {}", job.log());
    }
    let got = job.dump(&dir.join("possum.bin"));
    let status = job.ask(&dir, &Request::Status);
    let possum = status["possum"].clone();
    assert_eq!(possum["session"]["write_path_faults"], 0, "{status}");
    assert_eq!(got.len(), want.len());
    // T holds Y's address, which differs between the runs: X, Y and F are compared.
    let n = (2 * BIG + SMALL) as usize;
    if let Some(i) = got[..n].iter().zip(&want[..n]).position(|(g, w)| g != w) {
        panic!(
            "{name}: the job resumed from the image differs from the reference at byte {i} \
             (buffer {}): the image was not the buffers at T0; release {release}; stderr:\n{}",
            ["X", "Y", "F"][match i as u64 {
                i if i < BIG => 0,
                i if i < 2 * BIG => 1,
                _ => 2,
            }],
            job.log()
        );
    }
    let log = job.log();
    drop(job);
    let _ = std::fs::remove_dir_all(&dir);
    Some(Outcome {
        release,
        possum,
        log,
    })
}

/// One element written at a fixed offset of a 64 MiB buffer (40 MiB in: outside every window a
/// sampled validation read) by a kernel validated twice, read-only speculation asked for, on a
/// driver that refuses the fingerprint kernel (no `FAKE_CUDA_FINGERPRINT`): without fingerprints
/// no image could be proven, so no slot is speculated read-only; every buffer a kernel names
/// counts as written, and the release copies X (only read), Y (written after the pre-copy) and
/// F (the flag, written on some steps), as a strict run does.
#[test]
fn without_fingerprints_nothing_is_speculated_read_only() {
    let Some(o) = case(
        "fixed",
        &[("POSSUM_VALIDATE", "readonly_after=2")],
        &["step 3"],
        &["step 1"],
        &[],
    ) else {
        return;
    };
    assert_eq!(o.release["final"][0]["buffers"], 3, "{}", o.release);
    assert_eq!(o.possum["counters"]["validation_errors"], 0, "{}", o.possum);
    assert!(o.log.contains("no read-only speculation"), "{}", o.log);
}

/// One element written at a fixed offset of a 64 MiB buffer (40 MiB in: outside every window a
/// sampled validation read) by a kernel validated twice, with read-only speculation on and the
/// fingerprint kernel (`FAKE_CUDA_FINGERPRINT`: the fake driver runs it on the CPU): X and Y are
/// fingerprinted whole on the device, which sees the write, so the slot stays read-write, the
/// write after the pre-copy marks the buffer written and the release copies it.
#[test]
fn whole_buffers_are_fingerprinted_on_the_device() {
    let Some(o) = case(
        "fixed-device",
        &[
            ("POSSUM_VALIDATE", "readonly_after=2"),
            ("FAKE_CUDA_FINGERPRINT", "1"),
        ],
        &["step 3"],
        &["step 1"],
        &[],
    ) else {
        return;
    };
    fixed_offset_verdicts(&o);
    // At most Y: an engine that proves parts of it unchanged by their fingerprints copies less.
    assert!(
        o.release["final"][0]["bytes"].as_u64().unwrap() <= BIG,
        "{}",
        o.release
    );
    assert!(!o.log.contains(HOST_INSTEAD), "{}", o.log);
}

/// The verdicts of [`a_single_element_written_at_a_fixed_offset_is_seen`].
fn fixed_offset_verdicts(o: &Outcome) {
    // Y (poke's output) was written after the pre-copy (step 4). X earned read-only; so did F
    // (flag wrote it at step 3 only, not on its validated steps 1 and 2: the residual risk of
    // read-only speculation, which is why it is opt-in; no step during the checkpoint writes F).
    assert_eq!(o.release["final"][0]["buffers"], 1, "{}", o.release);
    assert_eq!(o.possum["counters"]["validations"], 4, "{}", o.possum);
    assert_eq!(o.possum["counters"]["validation_errors"], 0, "{}", o.possum);
}

/// What possum logs when the device cannot fingerprint whole buffers (validate.rs).
const HOST_INSTEAD: &str = "validation reads whole buffers to the host";

/// A kernel that writes its flag only on some launches (step 3 of every 4), validated on launches
/// that did not write it: with the default settings no slot is ever read-only, so the write during
/// the checkpoint marks the flag's buffer written.
#[test]
fn a_write_on_some_launches_only_is_a_write() {
    let Some(o) = case("flag", &[], &["step 2"], &["step 1"], &["step 2"]) else {
        return;
    };
    let fin = &o.release["final"][0];
    // Every buffer a slot named counts as written: X, Y and F.
    assert_eq!(fin["buffers"], 3, "{}", o.release);
    assert_eq!(fin["bytes"], 2 * BIG + SMALL, "{}", o.release);
}

/// A kernel first launched while the checkpoint is open, that writes Y through a pointer table
/// it is passed, with no validation to check it (`first=0`, as for a kernel first seen while a
/// checkpoint copies): it counts as touching every buffer, so Y is in the release's copy.
#[test]
fn a_kernel_no_validation_checked_touches_every_buffer() {
    let Some(o) = case(
        "late",
        &[("POSSUM_VALIDATE", "first=0")],
        &["step 1"],
        &["late 1"],
        &[],
    ) else {
        return;
    };
    let fin = &o.release["final"][0];
    assert_eq!(fin["buffers"], 4, "every buffer: {}", o.release);
    let c = &o.possum["counters"];
    assert!(c["launches_unvalidated"].as_u64().unwrap() >= 1, "{c}");
    assert_eq!(c["validations"], 0, "{c}");
}

/// Work launched on a stream the job then destroys: the stream is retired (fenced by possum's
/// retirement stream) rather than forgotten, and the write is in the release's copy.
#[test]
fn a_destroyed_stream_is_fenced() {
    let Some(o) = case(
        "stream",
        &[],
        &["step 1"],
        &["stream"],
        &["stream", "step 1"],
    ) else {
        return;
    };
    let fin = &o.release["final"][0];
    assert_eq!(fin["buffers"], 2, "X and Y: {}", o.release);
    let c = &o.possum["counters"];
    assert_eq!(c["streams_retired"], 2, "{c}");
    assert_eq!(c["hook_errors"], 0, "{c}");
}

/// possum's fence of a stream the job destroys fails (the driver's event record and stream
/// synchronisation fail then: `tests/fake/fake_failing_libcuda.c`): a fault of the write path
/// during the checkpoint, which the release undoes instead of committing an image that might
/// not be T0's. The job runs on, and the next checkpoint (no fault since it began) is whole.
#[test]
fn a_fault_on_the_write_path_undoes_the_checkpoint() {
    let Some(dir) = fake_gpu_dir("fakevalidate-fault", "fake_validate_job") else {
        return;
    };
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let shim = here.join("tests/fake/fake_failing_libcuda.c");
    assert!(cc(&[
        "-O1",
        "-shared",
        "-fPIC",
        "-Wl,-Bsymbolic",
        "-o",
        dir.join("libcuda.so.1").to_str().unwrap(),
        shim.to_str().unwrap(),
    ]));
    let cmds = ["step 1", "doomed", "step 1", "step 1"];
    let mut reference = Job::start(&dir, "reference", false, &[]);
    for cmd in cmds {
        assert!(reference.run(cmd).starts_with("done"), "{cmd}");
    }
    let want = reference.dump(&dir.join("reference.bin"));
    drop(reference);

    let mut job = Job::start(&dir, "possum", true, &[]);
    assert_eq!(job.run(cmds[0]), "done 1");
    let images = dir.join("images");
    let r = job.ask(
        &dir,
        &Request::Checkpoint {
            dir: images.to_str().unwrap().into(),
            parent: None,
        },
    );
    assert_eq!(r["precopy"][0]["buffers"], 4, "{r}");
    assert_eq!(job.run(cmds[1]), "done 2");
    let m = job.refused(&dir, &Request::Release);
    assert!(
        m.contains("checkpoint undone") && m.contains("destroying stream"),
        "{m}"
    );
    assert!(!images.join("gpu-0").exists(), "an image was committed");
    let st = job.ask(&dir, &Request::Status);
    let session = &st["possum"]["session"];
    assert_eq!(session["paused"], false, "{session}");
    assert_eq!(session["write_path_faults"], 1, "{session}");
    assert_eq!(
        st["possum"]["engines"][0]["engine"]["tracking"], false,
        "{st}"
    );
    // The job runs on; a new checkpoint saw no fault: committed, and resumed from, whole.
    assert_eq!(job.run(cmds[2]), "done 3");
    let images2 = dir.join("images2");
    let images2_s = images2.to_str().unwrap().to_string();
    job.ask(
        &dir,
        &Request::Checkpoint {
            dir: images2_s.clone(),
            parent: None,
        },
    );
    assert_eq!(job.run(cmds[3]), "done 4");
    job.ask(&dir, &Request::Release);
    assert!(images2.join("gpu-0").join("manifest.pb").is_file());
    job.ask(
        &dir,
        &Request::Resume {
            dir: Some(images2_s),
        },
    );
    let got = job.dump(&dir.join("possum.bin"));
    let n = (2 * BIG + SMALL) as usize;
    assert!(
        got[..n] == want[..n],
        "the resumed job differs from the reference"
    );
    drop(job);
    let _ = std::fs::remove_dir_all(&dir);
}
