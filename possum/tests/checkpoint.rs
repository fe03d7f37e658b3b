//! `possum checkpoint` / `possum restore` / the guard, without a GPU: the refusals, the image
//! naming, and the undo path, against a control server in this test process standing in for a
//! job's libpossum.so. (The real thing runs on the GPU machine: scripts/gpu-ckpt.sh.)

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};

use possum_control::{Request, Server};
use serde_json::{json, Value};

#[path = "support/cli.rs"]
#[allow(dead_code)]
mod cli;
use cli::{fake_libcuda_or_skip, free_pid, sealed, text};

#[path = "../../criu-adapter/tests/support/criu.rs"]
mod criu_support;

fn possum() -> Command {
    Command::new(env!("CARGO_BIN_EXE_possum"))
}

fn me() -> String {
    std::process::id().to_string()
}

/// `possum checkpoint` of this process (standing in for a job) with `flags`, its control socket
/// in `sockets`, into `img`.
fn checkpoint_me(sockets: &Path, img: &Path, flags: &[&str]) -> Command {
    let mut c = possum();
    c.args(["checkpoint", &me()])
        .args(flags)
        .arg("--socket-dir")
        .arg(sockets)
        .arg("-D")
        .arg(img);
    c
}

/// A stand-in for the job's side: records every request; `Checkpoint` writes a file into the
/// directory it is given, as the engine's image writer would.
struct FakeJob {
    _server: Server,
    seen: Arc<Mutex<Vec<Request>>>,
    sockets: PathBuf,
}

impl FakeJob {
    /// The `cmd` of every request the job was sent, in order.
    fn commands(&self) -> Vec<serde_json::Value> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|r| serde_json::to_value(r).unwrap()["cmd"].clone())
            .collect()
    }
}

fn fake_job(dir: &Path, release_fails: bool) -> FakeJob {
    // A library older than the entry points' hooks: no `hooks_live`, CUPTI's callbacks.
    let status = json!({
        "possum": {"engines": [{"engine": {"bytes": 4096}}],
                   "session": {"cupti_attached": true, "last": {"restore": {}}}}
    });
    fake_job_answering(dir, release_fails, status)
}

/// [`fake_job`] whose `status` answer is `status`.
fn fake_job_answering(dir: &Path, release_fails: bool, status: Value) -> FakeJob {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sockets = dir.join("sockets");
    let log = Arc::clone(&seen);
    let server = Server::start(
        &sockets,
        Arc::new(move |req: Request| {
            log.lock().unwrap().push(req.clone());
            match req {
                Request::Status => status.clone(),
                Request::Checkpoint { dir, .. } => {
                    let d = Path::new(&dir).join("gpu-0");
                    std::fs::create_dir_all(&d).unwrap();
                    std::fs::write(d.join("data-000.bin"), vec![7u8; 4096]).unwrap();
                    json!({"precopy": [], "ms": 1.0})
                }
                Request::Release if release_fails => json!({"error": "device 0: release failed"}),
                Request::Release => json!({"released_bytes": 4096,
                    "final": [{"device": 0, "buffers": 1, "bytes": 4096}]}),
                Request::Resume { .. } => json!({"restoring": [0]}),
                _ => json!({}),
            }
        }),
    )
    .unwrap();
    FakeJob {
        _server: server,
        seen,
        sockets,
    }
}

/// Runs `possum checkpoint-guard` for this process against `job`, with `steps` on its stdin.
fn run_guard(job: &FakeJob, tmp: &Path, final_dir: &Path, steps: &str) -> Output {
    use std::io::Write;
    let mut c = possum()
        .args(["checkpoint-guard", "--pid", &me(), "--tmp"])
        .arg(tmp)
        .arg("--final-dir")
        .arg(final_dir)
        .arg("--socket-dir")
        .arg(&job.sockets)
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(steps.as_bytes()).unwrap();
    c.wait_with_output().unwrap()
}

fn leftovers(parent: &Path) -> Vec<String> {
    std::fs::read_dir(parent)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("possum-tmp"))
        .collect()
}

#[test]
fn checkpoint_refuses_a_dead_process() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Command::new("true").spawn().unwrap();
    c.wait().unwrap();
    let img = tmp.path().join("img");
    let out = possum()
        .args(["checkpoint", &c.id().to_string(), "-D"])
        .arg(&img)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("no process"), "{}", text(&out));
    assert!(!img.exists());
}

#[test]
fn checkpoint_refuses_an_occupied_directory_and_keeps_it() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img");
    std::fs::create_dir_all(&img).unwrap();
    std::fs::write(img.join("old"), "old image").unwrap();
    let out = possum()
        .args(["checkpoint", &me(), "--engine", "driver", "-D"])
        .arg(&img)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--force"), "{}", text(&out));
    assert_eq!(
        std::fs::read_to_string(img.join("old")).unwrap(),
        "old image"
    );
}

#[test]
fn checkpoint_of_a_job_without_possum_suggests_the_driver_engine() {
    let tmp = tempfile::tempdir().unwrap();
    let out = checkpoint_me(tmp.path(), &tmp.path().join("img"), &[])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let t = text(&out);
    assert!(t.contains("--engine driver"), "{t}");
    // Said once, with what to do.
    assert_eq!(t.matches("does not have possum loaded").count(), 1, "{t}");
    assert!(
        t.contains("`possum run JOB`") && t.contains("LD_PRELOAD="),
        "{t}"
    );
}

/// A job with CUPTI attached, and a driver that refuses to lock such a process (driver 580): the
/// full checkpoint is refused before the job is asked for anything but its status (no pause, no
/// copy, no release), with what to do instead, and no image.
#[test]
fn a_cupti_job_the_driver_refuses_is_refused_before_anything_is_done() {
    let Some((tmp, lib)) = fake_libcuda_or_skip() else {
        return;
    };
    let job = fake_job(tmp.path(), false);
    let img = tmp.path().join("img");
    let out = checkpoint_me(&job.sockets, &img, &[])
        .env("POSSUM_LIBCUDA", &lib)
        // Never run: the refusal comes first.
        .env("POSSUM_CRIU", "/bin/true")
        .env("FAKE_CKPT_LOCK_UNSUPPORTED", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("without --cupti") && text(&out).contains("NOT_SUPPORTED"),
        "{}",
        text(&out)
    );
    let cmds = job.commands();
    assert_eq!(cmds, [json!("status")]);
    assert!(!img.exists());
    assert!(
        leftovers(tmp.path()).is_empty(),
        "{:?}",
        leftovers(tmp.path())
    );
}

/// A job with managed memory is refused before it is asked for anything but its status, with or
/// without --gpu-only: neither NVIDIA's driver checkpoint nor possum's engine can save it.
#[test]
fn a_job_with_managed_memory_is_refused_before_anything_is_done() {
    let tmp = tempfile::tempdir().unwrap();
    let status = json!({"hooks": "entry", "possum": {
        "engines": [{"engine": {"bytes": 4096}}],
        "unmanaged": {"allocations": 2, "bytes": 3u64 << 20, "by_kind": {
            "cuMemAllocManaged": {"allocations": 1, "bytes": 1u64 << 20},
            "cuMemMap": {"allocations": 1, "bytes": 2u64 << 20}}},
        "session": {"cupti_attached": false, "hooks_live": true}}});
    let job = fake_job_answering(tmp.path(), false, status);
    for gpu_only in [false, true] {
        let img = tmp.path().join("img");
        let flags: &[&str] = if gpu_only { &["--gpu-only"] } else { &[] };
        let mut c = checkpoint_me(&job.sockets, &img, flags);
        // Never run: the refusal comes first.
        c.env("POSSUM_CRIU", "/nonexistent/criu")
            .env("POSSUM_LIBCUDA", "/nonexistent/libcuda.so.1");
        let out = c.output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        let t = text(&out);
        assert!(
            t.contains("managed memory") && t.contains("cuMemAllocManaged: 1 allocations"),
            "{t}"
        );
        assert!(t.contains("nothing was done"), "{t}");
        assert_eq!(t.contains("--gpu-only cannot"), gpu_only, "{t}");
        assert!(!img.exists());
    }
    let cmds = job.commands();
    assert_eq!(cmds, [json!("status"), json!("status")]);
}

/// A job whose hooks are live through the entry points, CUPTI not attached: the checkpoint
/// pre-copies and holds it at the op gate, and says so.
#[test]
fn a_job_with_live_entry_hooks_is_held_at_the_op_gate() {
    let tmp = tempfile::tempdir().unwrap();
    let status = json!({"hooks": "entry", "possum": {
        "engines": [{"engine": {"bytes": 4096}}],
        "unmanaged": {"allocations": 1, "bytes": 1u64 << 20, "by_kind": {
            "cuMemMap": {"allocations": 1, "bytes": 1u64 << 20}}},
        "session": {"cupti_attached": false, "hooks_live": true}}});
    let job = fake_job_answering(tmp.path(), false, status);
    let img = tmp.path().join("img");
    let run = |json: bool| {
        let flags: &[&str] = if json {
            &["--gpu-only", "--force", "--json"]
        } else {
            &["--gpu-only", "--force"]
        };
        checkpoint_me(&job.sockets, &img, flags).output().unwrap()
    };
    let out = run(true);
    assert!(out.status.success(), "{}", text(&out));
    let j: Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(j["hooks"], "entry", "{j}");
    let hold = j["hold"].as_str().unwrap();
    assert!(
        hold.starts_with("op gate (the driver's entry points)") && hold.contains("1 buffers"),
        "{j}"
    );
    let out = run(false);
    assert!(out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("held at possum's op gate: 1 buffers (0.00 GiB) written since the pre-copy"),
        "{t}"
    );
    assert!(!t.contains("CUPTI"), "{t}");
}

#[test]
fn gpu_only_checkpoint_names_the_image_only_when_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let job = fake_job(tmp.path(), false);
    let img = tmp.path().join("img");
    // What a checkpoint into the same DIR left when it and its guard were killed: removed.
    let mut gone = Command::new("true").spawn().unwrap();
    gone.wait().unwrap();
    let stale = tmp.path().join(format!(".img.possum-tmp-{}", gone.id()));
    std::fs::create_dir_all(stale.join("gpu")).unwrap();
    let out = checkpoint_me(&job.sockets, &img, &["--gpu-only", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let j: Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    for k in [
        "engine_snapshot_ms",
        "release_ms",
        "resume_ms",
        "stall_ms",
        "total_ms",
    ] {
        assert!(j["figures"][k].as_f64().is_some(), "{k} in {j}");
    }
    assert_eq!(j["figures"]["gpu_image_bytes"], 4096, "{j}");
    // The image is under its final name, with its description; no temporary directory is left.
    let m: Value =
        serde_json::from_str(&std::fs::read_to_string(img.join("possum.json")).unwrap()).unwrap();
    assert_eq!(m["gpu_dir"], "gpu");
    assert!(m["criu_dir"].is_null());
    assert!(img.join("gpu/gpu-0/data-000.bin").is_file());
    assert!(
        !img.join(".possum-lock").exists(),
        "the lock stays out of the image"
    );
    assert!(
        text(&out).contains(&format!("removed {}", stale.display())),
        "{}",
        text(&out)
    );
    assert!(
        leftovers(tmp.path()).is_empty(),
        "{:?}",
        leftovers(tmp.path())
    );
    // The job was asked in order, and resumed from the final name.
    let seen = job.seen.lock().unwrap().clone();
    let cmds = job.commands();
    assert_eq!(
        cmds,
        [
            json!("status"),
            json!("checkpoint"),
            json!("release"),
            json!("resume")
        ]
    );
    assert_eq!(
        seen[3],
        Request::Resume {
            dir: Some(img.join("gpu").display().to_string())
        }
    );
    // Such an image has no process to restore.
    let out = possum().args(["restore", "-D"]).arg(&img).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("only GPU buffers"), "{}", text(&out));
    // possum.json carries a check: a change that leaves valid JSON is corruption too.
    assert!(m["check"].is_string(), "{m}");
    let mut changed = m.clone();
    changed["pid"] = json!(m["pid"].as_i64().unwrap() + 1);
    std::fs::write(img.join("possum.json"), changed.to_string()).unwrap();
    let out = possum().args(["restore", "-D"]).arg(&img).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("is corrupt") && text(&out).contains("check"),
        "{}",
        text(&out)
    );
}

/// `--hmac-key`: the complete image gets its possum.hmac under the key, which authenticates
/// it; a key that is not one refuses the checkpoint before anything is done.
#[test]
fn a_checkpoint_with_a_key_authenticates_its_image() {
    let tmp = tempfile::tempdir().unwrap();
    let job = fake_job(tmp.path(), false);
    let img = tmp.path().join("img");
    let key = tmp.path().join("key");
    std::fs::write(&key, "too short").unwrap();
    let checkpoint = || {
        checkpoint_me(&job.sockets, &img, &["--gpu-only"])
            .arg("--hmac-key")
            .arg(&key)
            .output()
            .unwrap()
    };
    let out = checkpoint();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("holds 9 bytes"), "{}", text(&out));
    assert!(!img.exists() && job.seen.lock().unwrap().is_empty());
    std::fs::write(&key, [5u8; 48]).unwrap();
    let out = checkpoint();
    assert!(out.status.success(), "{}", text(&out));
    let k = possum_sequence::auth::HmacKey::read(&key).unwrap();
    possum_sequence::auth::verify(&img, &k).unwrap();
    std::fs::write(img.join("gpu/extra"), "x").unwrap();
    assert!(possum_sequence::auth::verify(&img, &k).is_err());
}

#[test]
fn a_failed_release_is_undone_and_leaves_no_image() {
    let tmp = tempfile::tempdir().unwrap();
    let job = fake_job(tmp.path(), true);
    let img = tmp.path().join("img");
    let out = checkpoint_me(&job.sockets, &img, &["--gpu-only"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("release failed") && t.contains("job runs on"),
        "{t}"
    );
    assert!(!img.exists());
    assert!(
        leftovers(tmp.path()).is_empty(),
        "{:?}",
        leftovers(tmp.path())
    );
    // The guard told the job to resume (from the temporary images it then removed).
    let seen = job.seen.lock().unwrap().clone();
    assert!(
        seen.iter()
            .any(|r| matches!(r, Request::Resume { dir: Some(d) } if d.contains("possum-tmp"))),
        "{seen:?}"
    );
}

#[test]
fn the_guard_does_nothing_after_done_and_undoes_otherwise() {
    let tmp = tempfile::tempdir().unwrap();
    let job = fake_job(tmp.path(), false);
    let run = |steps: &str| {
        let t = tmp.path().join(".img.possum-tmp-1");
        std::fs::create_dir_all(t.join("gpu")).unwrap();
        let out = run_guard(&job, &t, &tmp.path().join("img"), steps);
        (out, t.exists())
    };
    let (out, tmp_left) = run("releasing\nlocking\ndone\n");
    assert!(out.status.success(), "{}", text(&out));
    assert!(tmp_left, "done: nothing is undone");
    assert!(job.seen.lock().unwrap().is_empty());
    let (out, tmp_left) = run("releasing\n");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(!tmp_left, "undone: the temporary images are removed");
    assert!(text(&out).contains("resumed"), "{}", text(&out));
    assert!(job
        .seen
        .lock()
        .unwrap()
        .iter()
        .any(|r| matches!(r, Request::Resume { .. })));
}

#[test]
fn restore_names_what_is_wrong_with_an_image() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img");
    let restore = |img: &Path| possum().args(["restore", "-D"]).arg(img).output().unwrap();
    // What the restore of `img` says, refused (exit status 2).
    let refused = |img: &Path| {
        let out = restore(img);
        let t = text(&out);
        assert_eq!(out.status.code(), Some(2), "{t}");
        t
    };
    let t = refused(&img);
    assert!(
        t.contains(&format!(
            "there is no image at {}: the directory does not exist",
            img.display()
        )),
        "{t}"
    );
    std::fs::create_dir_all(img.join("criu")).unwrap();
    // Everything but the commit marker (a checkpoint that did not finish): refused.
    let unfinished = tmp.path().join("unfinished");
    for f in [
        "criu/inventory.img",
        "criu/pstree.img",
        "gpu/gpu-0/manifest.json",
    ] {
        std::fs::create_dir_all(unfinished.join(f).parent().unwrap()).unwrap();
        std::fs::write(unfinished.join(f), b"x").unwrap();
    }
    for dir in [&img, &unfinished] {
        let t = refused(dir);
        assert!(
            t.contains(&format!(
                "incomplete image: the checkpoint did not finish ({} has no possum.json",
                dir.display()
            )),
            "{t}"
        );
    }
    // Random bytes: corrupt, not missing; the file and the parse error are named.
    std::fs::write(
        img.join("possum.json"),
        [0x8fu8, 0xff, 0x00, 0x13, 0x37, 0xc3],
    )
    .unwrap();
    let t = refused(&img);
    assert!(
        t.contains(&format!(
            "{} is corrupt: not a possum image's description: ",
            img.join("possum.json").display()
        )) && t.contains("line 1"),
        "{t}"
    );
    assert!(!t.contains("no possum.json"), "{t}");
    std::fs::write(img.join("possum.json"), "{\"possum_image\": 1, \"engi").unwrap();
    let out = restore(&img);
    assert!(text(&out).contains("is corrupt"), "{}", text(&out));
    let m = json!({"possum_image": 1, "engine": "driver", "pid": free_pid(), "shell_job": false,
                   "socket_dir": "/tmp", "created": 0, "criu_dir": "criu", "gpu_dir": null,
                   "figures": null});
    // Without its check, a description is refused whatever it says.
    std::fs::write(img.join("possum.json"), m.to_string()).unwrap();
    let t = refused(&img);
    assert!(t.contains("has no check"), "{t}");
    std::fs::write(img.join("possum.json"), sealed(&m)).unwrap();
    let out = restore(&img);
    assert!(text(&out).contains("partial"), "{}", text(&out));
    let mut m2 = m.clone();
    m2["possum_image"] = json!(99);
    std::fs::write(img.join("possum.json"), m2.to_string()).unwrap();
    let out = restore(&img);
    assert!(text(&out).contains("image format 99"), "{}", text(&out));
}

/// A stand-in for nvidia-smi answering the two queries possum makes.
const A: &str = "GPU-aaaaaaaa-0000-1111-2222-333333333333";
const B: &str = "GPU-bbbbbbbb-0000-1111-2222-333333333333";

fn fake_smi(dir: &Path, free_mib: u64) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join("nvidia-smi");
    std::fs::write(
        &p,
        format!(
            "#!/bin/sh\ncase \"$1\" in\n  --query-gpu=*) echo '0, {A}, {free_mib}'; echo '1, {B}, 80000';;\n  --query-compute-apps=*) echo '1, {A}, 9000';;\nesac\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

#[test]
fn restore_refuses_a_gpu_with_too_little_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img");
    std::fs::create_dir_all(img.join("criu")).unwrap();
    std::fs::write(img.join("criu/inventory.img"), "x").unwrap();
    // A pid that is free: a reaped child's.
    let mut c = Command::new("true").spawn().unwrap();
    c.wait().unwrap();
    let m = |uuid: &str| {
        sealed(
            &json!({"possum_image": 1, "engine": "driver", "pid": c.id(), "shell_job": false,
                   "socket_dir": "/tmp", "created": 0, "criu_dir": "criu", "gpu_dir": null,
                   "gpu_memory": [{"uuid": uuid, "mib": 9000}], "figures": null}),
        )
    };
    let restore_on = |smi: &Path, device: Option<&str>| {
        let mut c = possum();
        c.args(["restore", "-D"])
            .arg(&img)
            .env("POSSUM_NVIDIA_SMI", smi)
            .env("POSSUM_CRIU", "/nonexistent/criu");
        if let Some(d) = device {
            c.args(["--device", d]);
        }
        // possum runs the fake nvidia-smi just written: another test's child may still hold its
        // write descriptor across a fork for a moment (ETXTBSY, which possum reports as "cannot be
        // asked"); the fake is written before the first run, so wait until it is executable.
        wait_executable(smi);
        c.output().unwrap()
    };
    let restore = |smi: &Path| restore_on(smi, None);
    std::fs::write(img.join("possum.json"), m(A)).unwrap();
    let out = restore(&fake_smi(tmp.path(), 8000));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("too little memory") && t.contains("8000 MiB free") && t.contains("9000 MiB"),
        "{t}"
    );
    // Enough memory: the check passes, and the restore goes on to the next requirement.
    let out = restore(&fake_smi(tmp.path(), 20000));
    assert!(text(&out).contains("CRIU"), "{}", text(&out));
    // --device: the other GPU has room (the plan passes, CRIU is next); a GPU that is not there.
    let smi = fake_smi(tmp.path(), 8000);
    let out = restore_on(&smi, Some("1"));
    assert!(text(&out).contains("CRIU"), "{}", text(&out));
    let out = restore_on(&smi, Some("0"));
    assert!(text(&out).contains("too little memory"), "{}", text(&out));
    let out = restore_on(&smi, Some("7"));
    assert!(text(&out).contains("no GPU 7"), "{}", text(&out));
    // The GPU the job ran on is not here: the message points at --device.
    std::fs::write(
        img.join("possum.json"),
        m("GPU-cccccccc-0000-1111-2222-333333333333"),
    )
    .unwrap();
    let out = restore(&fake_smi(tmp.path(), 20000));
    let t = text(&out);
    assert!(
        t.contains("is not on this machine") && t.contains("--device"),
        "{t}"
    );
    // A job whose 8 MiB of buffers were its keeper's, which no longer holds them (no keeper
    // answers): on its own GPU they are made again, so it needs room for them beside its own
    // 9000 MiB, refused by name before anything is done.
    cli::one_buffer_gpu_image(&img.join("gpu/gpu-0"), 8 << 20);
    let mut kept: Value = serde_json::from_str(&m(A)).unwrap();
    kept["engine"] = json!("possum");
    kept["gpu_dir"] = json!("gpu");
    kept["keeper"] = json!({"dir": tmp.path().join("no-keeper")});
    std::fs::write(img.join("possum.json"), sealed(&kept)).unwrap();
    let out = restore(&fake_smi(tmp.path(), 9005));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("9005 MiB free")
            && t.contains("needs 9008 MiB")
            && t.contains("8 MiB of buffers its keeper no longer holds"),
        "{t}"
    );
    let out = restore(&fake_smi(tmp.path(), 9010));
    assert!(text(&out).contains("CRIU"), "{}", text(&out));
}

#[test]
fn the_guard_puts_an_old_image_back_and_spots_an_untold_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let job = fake_job(tmp.path(), false);
    let t = tmp.path().join(".img.possum-tmp-7");
    let fin = tmp.path().join("img");
    let guard = |steps: &str| run_guard(&job, &t, &fin, steps);
    // --force had moved the old image aside when possum died: it comes back under its name.
    std::fs::create_dir_all(t.join("gpu")).unwrap();
    std::fs::create_dir_all(t.with_extension("old")).unwrap();
    std::fs::write(t.with_extension("old").join("possum.json"), "old").unwrap();
    let out = guard("releasing\n");
    assert!(text(&out).contains("old image is back"), "{}", text(&out));
    assert_eq!(
        std::fs::read_to_string(fin.join("possum.json")).unwrap(),
        "old"
    );
    assert!(!t.exists() && !t.with_extension("old").exists());
    // The new image was named but the guard was not told: it resumes from the named image and
    // keeps it.
    std::fs::write(fin.join("possum.json"), "new").unwrap();
    job.seen.lock().unwrap().clear();
    guard("releasing\n");
    assert_eq!(
        std::fs::read_to_string(fin.join("possum.json")).unwrap(),
        "new"
    );
    let seen = job.seen.lock().unwrap().clone();
    assert!(
        seen.iter()
            .any(|r| matches!(r, Request::Resume { dir: Some(d) }
            if d == &fin.join("gpu").display().to_string())),
        "{seen:?}"
    );
}

/// Waits (bounded) until `path` can be executed (not ETXTBSY).
fn wait_executable(path: &Path) {
    for _ in 0..100 {
        match Command::new(path).arg("--probe").output() {
            Err(e) if e.raw_os_error() == Some(26) => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            _ => return,
        }
    }
}

/// A job whose session leader is outside its PID namespace (started under `unshare --pid`
/// without a session of its own, as a job in a container can be), checkpointed by a possum in
/// that namespace: refused before anything is done, naming the cause and what to do, and the
/// job runs on. (CRIU cannot dump such a process, with `--shell-job` or without.)
#[test]
fn a_job_whose_session_leader_is_outside_its_pid_namespace_is_refused() {
    if criu_support::criu_or_skip("session_outside").is_none() {
        return;
    }
    let unshare = |args: &[&str]| {
        Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc"])
            .args(args)
            .output()
    };
    if !unshare(&["true"]).is_ok_and(|o| o.status.success()) {
        eprintln!(
            "SKIPPED: session_outside: `unshare --pid --fork --mount-proc` does not work here"
        );
        return;
    }
    let Some((tmp, lib)) = fake_libcuda_or_skip() else {
        return;
    };
    let img = tmp.path().join("img");
    // In the new namespace `sh` is its first process, still in the test's session (whose
    // leader is outside): so is the job it starts.
    let script = r#"sleep 60 & job=$!
"$0" checkpoint --engine driver "$job" -D "$1"; echo "rc=$?"
kill -0 "$job" && echo "job alive"; kill "$job""#;
    let out = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "sh", "-c", script])
        .arg(env!("CARGO_BIN_EXE_possum"))
        .arg(&img)
        .env("POSSUM_LIBCUDA", &lib)
        .env("POSSUM_SOCKET_DIR", tmp.path().join("sockets"))
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    let t = text(&out);
    assert!(t.contains("rc=2"), "{t}");
    assert!(
        t.contains("session leader is outside its PID namespace") && t.contains("setsid"),
        "{t}"
    );
    assert!(
        t.contains("nothing was done") && t.contains("job alive"),
        "{t}"
    );
    assert!(!img.exists(), "{t}");
}
