//! `possum checkpoint` and `possum restore` of a HIP (AMD GPU) job that possum serves, without
//! NVIDIA's driver: the job is a python3 process that maps a file named `libamdhip64.so.6` (as
//! the dynamic loader maps AMD's HIP runtime) and answers possum's control socket as
//! libpossum.so does, its status saying `runtime: hip`. possum sends it the pre-copy, the
//! release and the resume as it does a CUDA job, writes an image whose `possum.json` says
//! `runtime: hip`, and neither loads a driver (POSSUM_LIBCUDA names no file) nor asks
//! nvidia-smi (POSSUM_NVIDIA_SMI names a program that records being run).
//!
//! `--gpu-only` needs nothing else; the whole checkpoint (CRIU's dump, the job killed) and its
//! restore need root and CRIU: without them that test prints `SKIPPED: ...` on stderr and
//! passes (with `POSSUM_REQUIRE_CRIU=1`, as CI sets, it fails instead).

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "support/cli.rs"]
#[allow(dead_code)]
mod cli;
use cli::{run_ok, text};

#[path = "../../criu-adapter/tests/support/criu.rs"]
mod criu_support;
use criu_support::criu_or_skip;

/// Bound on every wait for something that should happen.
const WAIT: Duration = Duration::from_secs(30);

/// The job: maps `LIB`, serves `SOCKETS/possum-PID.sock` one request at a time (a line of JSON
/// in, a line out, as libpossum.so does), and appends each request to `LOG` (opened for each
/// line: a restored job opens it again by its path). A checkpoint's GPU images are copies of
/// `TEMPLATE` (an engine image with no buffers). Its status names `RUNTIME` (`-`: none). Every
/// reply carries the control protocol's version `PROTOCOL`, as libpossum.so's do.
const JOB: &str = r#"
import json, mmap, os, shutil, socket, sys
sockets, lib, template, log, served_on = sys.argv[1:6]
PROTOCOL = int(sys.argv[6])
with open(lib, 'rb') as f:
    runtime = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
pid = os.getpid()
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(os.path.join(sockets, 'possum-%d.sock' % pid))
server.listen(8)
status = {'pid': pid, 'hooks': 'entry',
          'possum': {'engines': [{'engine': {'bytes': 0}}],
                     'session': {'hooks_live': True, 'last': {'restore': {}}}}}
if served_on != '-':
    status['runtime'] = served_on
while True:
    conn, _ = server.accept()
    line = b''
    while not line.endswith(b'\n'):
        chunk = conn.recv(65536)
        if not chunk:
            break
        line += chunk
    req = json.loads(line)
    with open(log, 'a') as out:
        out.write(json.dumps(req) + '\n')
    cmd = req.get('cmd')
    if cmd == 'status':
        reply = status
    elif cmd == 'checkpoint':
        shutil.copytree(template, os.path.join(req['dir'], 'gpu-0'))
        reply = {'precopy': [], 'ms': 1.0}
    elif cmd == 'release':
        reply = {'released_bytes': 0, 'final': [{'device': 0, 'buffers': 0, 'bytes': 0}]}
    elif cmd == 'resume':
        reply = {'restoring': []}
    else:
        reply = {}
    reply = dict(reply, protocol=PROTOCOL)
    conn.sendall((json.dumps(reply) + '\n').encode())
    conn.close()
"#;

/// The job's place: its socket directory, runtime file, image template and request log.
struct Stand {
    dir: PathBuf,
    sockets: PathBuf,
    log: PathBuf,
    /// Written by the fake nvidia-smi when it is run.
    smi_ran: PathBuf,
}

impl Stand {
    fn new(dir: &Path) -> Stand {
        let sockets = dir.join("sockets");
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&sockets)
            .unwrap();
        std::fs::write(dir.join("libamdhip64.so.6"), [0u8; 4096]).unwrap();
        // An engine image with no buffers: what a job with nothing on its GPU writes.
        let template = dir.join("template");
        possum_engine::image::ImageWriter::create(&template, Default::default())
            .unwrap()
            .commit()
            .unwrap();
        let smi_ran = dir.join("nvidia-smi-ran");
        let smi = dir.join("nvidia-smi");
        std::fs::write(
            &smi,
            format!(
                "#!/bin/sh\necho \"$@\" >> '{}'\nexit 1\n",
                smi_ran.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
        Stand {
            dir: dir.to_path_buf(),
            sockets,
            log: dir.join("requests.log"),
            smi_ran,
        }
    }

    /// possum as the job's: its socket directory, no NVIDIA driver, a recording nvidia-smi.
    fn possum(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_possum"));
        c.env("POSSUM_SOCKET_DIR", &self.sockets)
            .env("POSSUM_LIBCUDA", self.dir.join("no-such-dir/libcuda.so.1"))
            .env("POSSUM_NVIDIA_SMI", self.dir.join("nvidia-smi"))
            .env_remove("LD_PRELOAD");
        c
    }

    /// The job, leading a session of its own (CRIU dumps it without --shell-job), once it
    /// listens.
    fn start(&self) -> Job {
        self.start_served_on("hip")
    }

    /// [`Stand::start`], its status naming `runtime` (`-`: none, as a CUDA job's).
    fn start_served_on(&self, runtime: &str) -> Job {
        let mut cmd = Command::new("python3");
        cmd.args(["-c", JOB])
            .arg(&self.sockets)
            .arg(self.dir.join("libamdhip64.so.6"))
            .arg(self.dir.join("template"))
            .arg(&self.log)
            .arg(runtime)
            .arg(possum_control::PROTOCOL.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: setsid is async-signal-safe and touches no memory of this process.
        unsafe {
            cmd.pre_exec(|| nix::unistd::setsid().map(|_| ()).map_err(Into::into));
        }
        let child = cmd.spawn().expect("python3");
        let pid = child.id() as i32;
        let socket = self.sockets.join(format!("possum-{pid}.sock"));
        let t = Instant::now();
        while !socket.exists() {
            assert!(t.elapsed() < WAIT, "the job did not listen on {socket:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Job {
            child: Some(child),
            pid,
        }
    }

    /// The `cmd` of each request the job was sent, in order.
    fn commands(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                v["cmd"].as_str().unwrap().to_string()
            })
            .collect()
    }

    /// The requests of command `cmd` the job was sent.
    fn requests(&self, cmd: &str) -> Vec<Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|v| v["cmd"] == cmd)
            .collect()
    }

    fn nvidia_smi_ran(&self) -> Option<String> {
        std::fs::read_to_string(&self.smi_ran).ok()
    }
}

/// The job's process; killed (by its PID, ours) when dropped.
struct Job {
    child: Option<Child>,
    pid: i32,
}

impl Job {
    fn alive(&self) -> bool {
        // A zombie of ours is gone for this purpose.
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).is_ok_and(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, r)| !r.starts_with('Z'))
        })
    }

    /// Waits for our child to end (killed by the checkpoint), reaping it so its PID is free.
    fn reap(&mut self) {
        if let Some(mut c) = self.child.take() {
            let t = Instant::now();
            while c.try_wait().unwrap().is_none() {
                assert!(t.elapsed() < WAIT, "the job was not killed");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if self.alive() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }
}

fn manifest(img: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(img.join("possum.json")).unwrap()).unwrap()
}

/// What every HIP job's image says: runtime hip, nothing of NVIDIA's driver or nvidia-smi.
fn assert_hip_image(v: &Value) {
    assert_eq!(v["runtime"], "hip", "{v}");
    assert_eq!(v["engine"], "possum", "{v}");
    assert_eq!(v["gpu_dir"], "gpu", "{v}");
    assert!(v.get("cuda_children").is_none(), "{v}");
    assert_eq!(v["gpu_memory"], serde_json::json!([]), "{v}");
}

#[test]
fn gpu_only_checkpoint_of_a_hip_job_needs_no_nvidia_driver() {
    let tmp = tempfile::tempdir().unwrap();
    let stand = Stand::new(tmp.path());
    let job = stand.start();
    let img = tmp.path().join("img");
    let out = run_ok(
        stand
            .possum()
            .args([
                "checkpoint",
                &job.pid.to_string(),
                "--gpu-only",
                "--json",
                "-D",
            ])
            .arg(&img),
    );
    assert_eq!(
        stand.commands(),
        ["status", "checkpoint", "release", "resume"],
        "{}",
        text(&out)
    );
    let resume = &stand.requests("resume")[0];
    assert_eq!(
        resume["dir"],
        img.join("gpu").display().to_string(),
        "resumed from the named image"
    );
    assert!(job.alive(), "--gpu-only leaves the job running");
    let v = manifest(&img);
    assert_hip_image(&v);
    assert!(v["criu_dir"].is_null(), "{v}");
    assert!(
        possum_engine::image::Image::open(&img.join("gpu/gpu-0")).is_ok(),
        "the job's GPU image is in the image"
    );
    assert_eq!(stand.nvidia_smi_ran(), None, "nvidia-smi was not asked");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["runtime"], "hip", "{report}");
    assert_eq!(report["cuda_children"], serde_json::json!([]), "{report}");
}

#[test]
fn a_hip_job_is_checkpointed_with_criu_and_restored_without_nvidia_driver() {
    if criu_or_skip("hip_checkpoint").is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let stand = Stand::new(tmp.path());
    let mut job = stand.start();
    let img = tmp.path().join("img");
    let out = run_ok(
        stand
            .possum()
            .args(["checkpoint", &job.pid.to_string(), "--json", "-D"])
            .arg(&img),
    );
    assert_eq!(
        stand.commands(),
        ["status", "checkpoint", "release"],
        "{}",
        text(&out)
    );
    job.reap();
    assert!(!job.alive(), "the job is killed once its image is complete");
    let v = manifest(&img);
    assert_hip_image(&v);
    assert_eq!(v["criu_dir"], "criu", "{v}");
    assert!(img.join("criu/inventory.img").is_file());

    let out = run_ok(stand.possum().args(["restore", "--json", "-D"]).arg(&img));
    assert!(
        job.alive(),
        "the job runs again under its PID: {}",
        text(&out)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["runtime"], "hip", "{report}");
    let resumes = stand.requests("resume");
    assert_eq!(resumes.len(), 1, "{}", text(&out));
    assert_eq!(resumes[0]["dir"], img.join("gpu").display().to_string());
    // The restored job answers on its control socket again.
    run_ok(stand.possum().args(["status", &job.pid.to_string()]));
    assert_eq!(stand.commands().last().map(String::as_str), Some("status"));
    assert_eq!(stand.nvidia_smi_ran(), None, "nvidia-smi was not asked");
}

#[test]
fn a_hip_job_whose_possum_does_not_serve_it_on_hip_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let stand = Stand::new(tmp.path());
    let job = stand.start_served_on("-");
    let img = tmp.path().join("img");
    for extra in [&[][..], &["--gpu-only"]] {
        let out = stand
            .possum()
            .args(["checkpoint", &job.pid.to_string(), "-D"])
            .arg(&img)
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        let t = text(&out);
        assert!(
            t.contains("whose possum does not serve it on HIP")
                && t.contains("CRIU's amdgpu plugin")
                && t.contains("nothing was done"),
            "{t}"
        );
    }
    assert_eq!(stand.commands(), ["status", "status"], "only asked");
    assert!(job.alive());
    assert!(!img.exists());
}
