//! `possum checkpoint` and `possum restore`: a live GPU process to an image directory and back.
//!
//! ```text
//! checkpoint (engine possum)                      job
//!   Checkpoint{tmp/gpu} ────────────────────────▶ T0; buffers copied while it runs; images committed
//!   Release ────────────────────────────────────▶ GPU operations held; buffers' memory dropped
//!   driver lock + checkpoint (the residue)        (contexts, memory possum does not manage)
//!   CRIU dump (the tree stays, frozen by the above)
//!   possum.json written, tmp renamed to DIR
//!   --leave-running: driver restore + unlock, Resume{DIR/gpu} ▶ runs on; buffers back on demand
//!   otherwise: the job is killed
//! restore
//!   CRIU restore ─ driver restore + unlock ─ Resume{DIR/gpu} ▶ runs; buffers back on demand
//! ```
//! `--engine driver` is the baseline: the same without possum's steps (the driver copies every
//! buffer while the job is locked).
//!
//! Nothing is ever left half-done: a `possum checkpoint-guard` process watches the checkpoint
//! through a pipe and, if the checkpoint fails or `possum` dies (even by SIGKILL), undoes what was
//! done (driver restore, unlock, resume, the temporary directory removed), so the job runs on and
//! no image appears under DIR's name. CRIU always dumps with `--leave-running`; the job is killed
//! only after the image is complete under its final name.

use std::fs;
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use possum_control::{ControlError, Request};
use possum_criu::{Criu, DumpOptions, RestoreOptions};
use possum_cuda::checkpoint::{DriverCheckpoint, ProcessState};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The image's own description, `DIR/possum.json`.
pub const MANIFEST: &str = "possum.json";
/// Format version of `possum.json`.
pub const MANIFEST_VERSION: u32 = 1;
/// How long the driver lock may wait for the job's submitted work.
const LOCK_TIMEOUT_MS: u32 = 30_000;
/// How long possum waits for the job's answers (a checkpoint of many GiB takes a while).
const JOB_TIMEOUT: Duration = Duration::from_secs(3600);

/// Which engine takes the GPU side.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// possum: buffers pre-copied while the job runs; the job held for what it wrote since, the
    /// driver's residue and CRIU; buffers back on demand.
    Possum,
    /// The baseline: CRIU + NVIDIA's driver checkpoint, nothing of possum's.
    Driver,
}

#[derive(Args, Debug)]
pub struct CheckpointArgs {
    /// The process to checkpoint (the root of its tree).
    pub pid: i32,
    /// Image directory (must not exist or be empty, unless --force).
    #[arg(short = 'D', long = "images-dir", value_name = "DIR")]
    pub dir: PathBuf,
    /// Let the job run on after the checkpoint (default: it is killed once the image is complete).
    #[arg(long)]
    pub leave_running: bool,
    /// possum, or the baseline `driver` (CRIU + NVIDIA's driver checkpoint only).
    #[arg(long, value_enum, default_value = "possum")]
    pub engine: EngineKind,
    /// Only possum's GPU side, without the process (no driver checkpoint, no CRIU): the buffers
    /// are saved, released and brought back on demand while the job runs on. A diagnostic of the
    /// engine on a live job; the image cannot be restored.
    #[arg(long, conflicts_with = "engine")]
    pub gpu_only: bool,
    /// Replace an existing image at DIR (the old one is removed only once the new one is complete).
    #[arg(long)]
    pub force: bool,
    /// Print the figures as JSON.
    #[arg(long)]
    pub json: bool,
    /// Directory of the job's control socket (default: $POSSUM_SOCKET_DIR, else /tmp/possum).
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// Image directory written by `possum checkpoint`.
    #[arg(short = 'D', long = "images-dir", value_name = "DIR")]
    pub dir: PathBuf,
    /// Print the figures as JSON.
    #[arg(long)]
    pub json: bool,
    /// Directory of the job's control socket (default: the one it had when checkpointed).
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
    /// Restore onto this GPU (its index as nvidia-smi numbers it) instead of the one the job ran
    /// on: the driver's restore maps the old GPU's UUID to this one's. A single-GPU job, image of
    /// `--engine driver`.
    #[arg(long, value_name = "GPU")]
    pub device: Option<u32>,
}

/// `DIR/possum.json`.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct Manifest {
    /// [`MANIFEST_VERSION`].
    pub possum_image: u32,
    pub engine: EngineKind,
    pub pid: i32,
    pub shell_job: bool,
    pub socket_dir: PathBuf,
    /// Seconds since the epoch.
    pub created: u64,
    /// Subdirectories: CRIU's images (none for a `--gpu-only` image), and possum's GPU images
    /// (engine possum).
    pub criu_dir: Option<String>,
    pub gpu_dir: Option<String>,
    /// The GPU memory the job used when checkpointed, per GPU (from nvidia-smi; empty when it
    /// could not be asked): a restore refuses a GPU with less free memory.
    #[serde(default)]
    pub gpu_memory: Vec<GpuUse>,
    /// The checkpoint's figures.
    pub figures: Value,
}

/// GPU memory used by a process on one GPU.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct GpuUse {
    /// The GPU's UUID, as nvidia-smi prints it (`GPU-...`).
    pub uuid: String,
    /// MiB.
    pub mib: u64,
}

/// What nvidia-smi (`$POSSUM_NVIDIA_SMI`, else `nvidia-smi` on PATH) says about GPU memory.
mod smi {
    use super::GpuUse;
    use std::process::Command;

    fn query(args: &[&str]) -> Option<Vec<Vec<String>>> {
        let bin = std::env::var("POSSUM_NVIDIA_SMI").unwrap_or_else(|_| "nvidia-smi".into());
        let out = Command::new(bin).args(args).output().ok()?;
        if !out.status.success() {
            return None;
        }
        Some(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| l.split(',').map(|f| f.trim().to_string()).collect())
                .collect(),
        )
    }

    /// The memory `pid` uses on each GPU; None when nvidia-smi cannot be asked.
    pub fn process_usage(pid: i32) -> Option<Vec<GpuUse>> {
        let rows = query(&[
            "--query-compute-apps=pid,gpu_uuid,used_memory",
            "--format=csv,noheader,nounits",
        ])?;
        Some(
            rows.iter()
                .filter(|r| r.len() >= 3 && r[0] == pid.to_string())
                .filter_map(|r| {
                    Some(GpuUse {
                        uuid: r[1].clone(),
                        mib: r[2].parse().ok()?,
                    })
                })
                .collect(),
        )
    }

    /// The GPUs here: (index, UUID, free MiB); None when nvidia-smi cannot be asked.
    pub fn gpus() -> Option<Vec<(u32, String, u64)>> {
        let rows = query(&[
            "--query-gpu=index,uuid,memory.free",
            "--format=csv,noheader,nounits",
        ])?;
        Some(
            rows.iter()
                .filter(|r| r.len() >= 3)
                .filter_map(|r| Some((r[0].parse().ok()?, r[1].clone(), r[2].parse().ok()?)))
                .collect(),
        )
    }
}

/// The 16 bytes of a GPU UUID as nvidia-smi prints it (`GPU-8a9c1d2e-...`).
fn uuid_bytes(s: &str) -> Result<[u8; 16]> {
    let hex: String = s
        .trim_start_matches("GPU-")
        .chars()
        .filter(|c| *c != '-')
        .collect();
    let mut out = [0u8; 16];
    if hex.len() != 32 || !hex.is_ascii() {
        bail!("not a GPU UUID: {s}");
    }
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
            .map_err(|_| anyhow!("not a GPU UUID: {s}"))?;
    }
    Ok(out)
}

/// Checks the GPUs the restore will use (the job's own, or `--device`) for free memory, and
/// returns the driver's UUID remapping (empty: the same GPUs).
fn plan_gpus(m: &Manifest, device: Option<u32>) -> Result<Vec<([u8; 16], [u8; 16])>> {
    if m.gpu_memory.is_empty() {
        if device.is_some() {
            bail!(
                "the image does not record which GPU the job used (nvidia-smi was not available \
                 when it was checkpointed): --device cannot be honoured"
            );
        }
        return Ok(Vec::new());
    }
    let Some(gpus) = smi::gpus() else {
        if device.is_some() {
            bail!("--device needs nvidia-smi, which cannot be asked here");
        }
        eprintln!("possum: nvidia-smi cannot be asked: free GPU memory not checked");
        return Ok(Vec::new());
    };
    let room = |uuid: &str, free: u64, need: u64| -> Result<()> {
        if free < need {
            bail!("GPU {uuid} has too little memory: {free} MiB free, the job used {need} MiB");
        }
        Ok(())
    };
    let Some(d) = device else {
        for u in &m.gpu_memory {
            let Some((_, _, free)) = gpus.iter().find(|(_, id, _)| *id == u.uuid) else {
                bail!(
                    "the GPU the job ran on ({}) is not on this machine: choose one with --device",
                    u.uuid
                );
            };
            room(&u.uuid, *free, u.mib)?;
        }
        return Ok(Vec::new());
    };
    if m.gpu_dir.is_some() {
        bail!(
            "a possum image cannot be restored on another GPU yet (images of --engine driver can)"
        );
    }
    let [used] = m.gpu_memory.as_slice() else {
        bail!(
            "the job used {} GPUs; --device moves a job that used one",
            m.gpu_memory.len()
        );
    };
    let Some((_, target, free)) = gpus.iter().find(|(i, _, _)| *i == d) else {
        bail!("there is no GPU {d} here");
    };
    room(target, *free, used.mib)?;
    if *target == used.uuid {
        return Ok(Vec::new());
    }
    Ok(vec![(uuid_bytes(&used.uuid)?, uuid_bytes(target)?)])
}

/// Milliseconds, for the figures.
fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Times each step; its JSON is the figures.
#[derive(Default)]
struct Clock {
    steps: Vec<(&'static str, Duration)>,
}

impl Clock {
    fn time<T>(&mut self, name: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let r = f();
        self.steps.push((name, t.elapsed()));
        r
    }
    fn get(&self, name: &str) -> Duration {
        self.steps
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, d)| *d)
            .sum()
    }
    fn json(&self) -> serde_json::Map<String, Value> {
        self.steps
            .iter()
            .map(|(n, d)| (format!("{n}_ms"), json!(ms(*d))))
            .collect()
    }
}

fn alive(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Whether `path` exists as anything but an empty directory.
fn occupied(path: &Path) -> bool {
    match fs::read_dir(path) {
        Ok(mut d) => d.next().is_some(),
        Err(e) => e.kind() != std::io::ErrorKind::NotFound,
    }
}

fn dir_bytes(path: &Path) -> u64 {
    let Ok(rd) = fs::read_dir(path) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e.metadata().map(|m| m.len()).unwrap_or(0),
            Err(_) => 0,
        })
        .sum()
}

/// fsyncs every file and directory under `dir`.
fn sync_tree(dir: &Path) -> Result<()> {
    for e in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e?;
        if e.file_type()?.is_dir() {
            sync_tree(&e.path())?;
        } else {
            fs::File::open(e.path())?.sync_all()?;
        }
    }
    fs::File::open(dir)?.sync_all()?;
    Ok(())
}

fn socket_dir_of(a: Option<&PathBuf>) -> PathBuf {
    a.cloned().unwrap_or_else(possum_control::socket_dir)
}

/// Holds `possum-<pid>.lock` in the socket directory: one checkpoint of a process at a time.
fn lock_pid(dir: &Path, pid: i32) -> Result<nix::fcntl::Flock<fs::File>> {
    use nix::fcntl::{Flock, FlockArg};
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("possum-{pid}.lock"));
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    Flock::lock(f, FlockArg::LockExclusiveNonblock).map_err(|_| {
        anyhow!(
            "a checkpoint of process {pid} is already running (lock {})",
            path.display()
        )
    })
}

/// The guard process's end: each completed step is reported to it.
struct Guard {
    child: Child,
    pipe: Option<ChildStdin>,
}

impl Guard {
    fn start(a: &GuardArgs) -> Result<Guard> {
        let exe = std::env::current_exe().context("finding possum's own binary")?;
        let mut cmd = Command::new(exe);
        cmd.arg("checkpoint-guard")
            .arg("--pid")
            .arg(a.pid.to_string())
            .arg("--tmp")
            .arg(&a.tmp)
            .arg("--final-dir")
            .arg(&a.final_dir)
            .arg("--socket-dir")
            .arg(&a.socket_dir)
            .stdin(Stdio::piped());
        // Its own process group: a Ctrl-C at the terminal stops possum, not the guard.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = cmd.spawn().context("starting the checkpoint guard")?;
        let pipe = child.stdin.take();
        Ok(Guard { child, pipe })
    }

    fn step(&mut self, what: &str) {
        if let Some(p) = self.pipe.as_mut() {
            let _ = writeln!(p, "{what}");
            let _ = p.flush();
        }
    }

    /// Success: the guard has nothing to undo.
    fn done(mut self) {
        self.step("done");
        self.pipe = None;
        let _ = self.child.wait();
    }

    /// Failure: the guard undoes what was done; returns when it has.
    fn undo(mut self) {
        self.pipe = None;
        let _ = self.child.wait();
    }
}

/// Arguments of the hidden `possum checkpoint-guard`.
#[derive(Args, Debug, Clone)]
pub struct GuardArgs {
    #[arg(long)]
    pub pid: i32,
    #[arg(long)]
    pub tmp: PathBuf,
    #[arg(long)]
    pub final_dir: PathBuf,
    #[arg(long)]
    pub socket_dir: PathBuf,
}

/// The guard: reads the steps done from stdin; at end of input without `done`, undoes them.
pub fn guard(a: &GuardArgs) -> Result<bool> {
    let mut seen: Vec<String> = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        seen.push(line.trim().to_string());
    }
    let has = |s: &str| seen.iter().any(|x| x == s);
    if has("done") {
        return Ok(true);
    }
    let say = |m: &str| eprintln!("possum: undoing the checkpoint of process {}: {m}", a.pid);
    // Killed between the rename and telling the guard: the image is named all the same.
    let committed = has("committed") || (!a.tmp.exists() && a.final_dir.join(MANIFEST).is_file());
    let resume = || {
        if has("releasing") && !has("resumed") {
            let dir = if committed { &a.final_dir } else { &a.tmp };
            let req = Request::Resume {
                dir: Some(dir.join("gpu").display().to_string()),
            };
            match possum_control::request(a.pid as u32, &a.socket_dir, &req, JOB_TIMEOUT) {
                Ok(_) => say("job resumed"),
                Err(e) => say(&format!("resume failed: {e}")),
            }
        }
    };
    // Steps are announced before they are taken, so a `possum` killed inside a driver call
    // still gets it undone: the driver's own state says what is left to do.
    if has("locking") && !has("unlocked") {
        match DriverCheckpoint::load() {
            Ok(drv) => undo_driver(&drv, a.pid, &say),
            Err(e) => say(&format!("cannot load the driver: {e}")),
        }
    }
    resume();
    // --force moves the old image aside just before naming the new one.
    let old = a.tmp.with_extension("old");
    if old.exists() {
        if committed {
            let _ = fs::remove_dir_all(&old);
        } else if !a.final_dir.exists() && fs::rename(&old, &a.final_dir).is_ok() {
            say("the old image is back under its name");
        }
    }
    if !committed {
        // The GPU images may still be read on demand by the resumed job: keep them until it has
        // them all, then remove the directory.
        if has("releasing") && !has("resumed") {
            wait_restored(a);
        }
        let _ = fs::remove_dir_all(&a.tmp);
    }
    Ok(false)
}

/// Brings process `pid` back to RUNNING in the driver from wherever a checkpoint left it.
fn undo_driver(drv: &DriverCheckpoint, pid: i32, say: &dyn Fn(&str)) {
    for _ in 0..20 {
        let r = match drv.state(pid) {
            Ok(ProcessState::Running) => return,
            Ok(ProcessState::Checkpointed) => drv.restore(pid, &[]).map(|()| "driver restore done"),
            Ok(ProcessState::Locked) => drv.unlock(pid).map(|()| "driver unlock done"),
            Ok(other) => {
                say(&format!(
                    "the driver reports the process {other}; left as it is"
                ));
                return;
            }
            Err(e) => {
                say(&format!("driver state: {e}"));
                return;
            }
        };
        match r {
            Ok(m) => say(m),
            Err(e) => {
                say(&format!("{e}"));
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// Waits (bounded) until the job's on-demand restore has finished reading its images.
fn wait_restored(a: &GuardArgs) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(600) && alive(a.pid) {
        match possum_control::request(
            a.pid as u32,
            &a.socket_dir,
            &Request::Status,
            Duration::from_secs(10),
        ) {
            Ok(v) if !v["possum"]["session"]["last"]["restore"].is_null() => return,
            Ok(_) => {}
            Err(_) => return,
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Maps a control error to what the user should do.
fn job_error(pid: i32, e: ControlError) -> anyhow::Error {
    match e {
        ControlError::NotLoaded { .. } | ControlError::Stale { .. } => anyhow!(
            "process {pid} does not have possum loaded ({e}); start it with `possum run`, or \
             checkpoint it with `--engine driver`"
        ),
        other => anyhow!("process {pid}: {other}"),
    }
}

fn ask(pid: i32, dir: &Path, req: &Request) -> Result<Value> {
    possum_control::request(pid as u32, dir, req, JOB_TIMEOUT).map_err(|e| job_error(pid, e))
}

/// The temporary sibling of `dir` a checkpoint is written under.
fn temp_sibling(dir: &Path) -> Result<PathBuf> {
    let name = dir
        .file_name()
        .ok_or_else(|| anyhow!("{}: not a directory name", dir.display()))?
        .to_string_lossy()
        .into_owned();
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty());
    let parent = parent.unwrap_or(Path::new("."));
    fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    Ok(parent.join(format!(".{name}.possum-tmp-{}", std::process::id())))
}

fn progress_bar(total: u64, watch: PathBuf, stop: std::sync::mpsc::Receiver<()>) {
    let t = Instant::now();
    let mut shown = false;
    while stop.recv_timeout(Duration::from_millis(200)).is_err() {
        if t.elapsed() < Duration::from_millis(500) {
            continue;
        }
        let done = dir_bytes(&watch).min(total.max(1));
        let frac = done as f64 / total.max(1) as f64;
        let width = 30;
        let filled = (frac * width as f64) as usize;
        eprint!(
            "\r  GPU buffers [{}{}] {:5.1}% {:.2}/{:.2} GiB {:.1} s",
            "#".repeat(filled),
            " ".repeat(width - filled),
            100.0 * frac,
            done as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64,
            t.elapsed().as_secs_f64()
        );
        shown = true;
    }
    if shown {
        eprintln!();
    }
}

pub fn checkpoint(a: &CheckpointArgs) -> Result<bool> {
    let t_all = Instant::now();
    let pid = a.pid;
    if pid <= 0 || !alive(pid) {
        bail!("no process {pid} (is it still running?)");
    }
    if occupied(&a.dir) && !a.force {
        bail!(
            "{} exists and is not empty: choose another directory, or --force to replace it \
             (the old image is removed only once the new one is complete)",
            a.dir.display()
        );
    }
    let sockets = socket_dir_of(a.socket_dir.as_ref());
    let status = match a.engine {
        EngineKind::Possum => Some(ask(pid, &sockets, &Request::Status)?),
        EngineKind::Driver => None,
    };
    // The process side: CRIU and the driver checkpoint (not needed for --gpu-only).
    let side = if a.gpu_only {
        None
    } else {
        let criu = Criu::locate().context("CRIU is needed for the CPU side")?;
        let drv = DriverCheckpoint::load().context("NVIDIA's driver checkpoint is needed")?;
        Some((criu, drv))
    };
    let _lock = lock_pid(&sockets, pid)?;
    if let Some((_, drv)) = &side {
        match drv.state(pid) {
            Ok(ProcessState::Running) => {}
            Ok(other) => bail!(
                "process {pid} is {other} in the CUDA driver: another checkpoint holds it, or it \
                 was left so by one (see `possum status {pid}`)"
            ),
            Err(e) => bail!("process {pid}: {e} (does it use CUDA?)"),
        }
    }
    let managed: u64 = status
        .as_ref()
        .and_then(|s| s["possum"]["engines"].as_array())
        .map(|es| {
            es.iter()
                .filter_map(|e| e["engine"]["bytes"].as_u64())
                .sum()
        })
        .unwrap_or(0);
    // possum holds the job's operations in its CUPTI callbacks; without them it cannot (and
    // once the driver has locked the job, possum's own CUDA calls in it block too).
    if let Some(s) = &status {
        if s["possum"]["session"]["cupti_attached"] != json!(true) {
            bail!(
                "possum does not see process {pid}'s GPU operations (CUPTI is off or failed: {}), \
                 so it cannot hold them while it saves the buffers; use --engine driver",
                s["cupti_error"]
            );
        }
    }
    let shell_job = nix::unistd::getsid(Some(nix::unistd::Pid::from_raw(pid)))
        .map(|sid| sid.as_raw() != pid)
        .unwrap_or(false);

    // What the job uses on the GPU now, for the restore's check (asked before anything changes).
    let gpu_memory = smi::process_usage(pid).unwrap_or_default();
    let tmp = temp_sibling(&a.dir)?;
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut guard = Guard::start(&GuardArgs {
        pid,
        tmp: tmp.clone(),
        final_dir: a.dir.clone(),
        socket_dir: sockets.clone(),
    })?;
    let mut clock = Clock::default();
    let mut engine_report = Value::Null;
    let mut release_report = Value::Null;
    let manifest = |criu_dir: Option<String>| Manifest {
        possum_image: MANIFEST_VERSION,
        engine: a.engine,
        pid,
        shell_job,
        socket_dir: sockets.clone(),
        created: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        criu_dir,
        gpu_dir: (a.engine == EngineKind::Possum).then(|| "gpu".into()),
        gpu_memory: gpu_memory.clone(),
        figures: Value::Null,
    };
    let r = (|| -> Result<(Manifest, u64, u64)> {
        if a.engine == EngineKind::Possum {
            let gpu = tmp.join("gpu");
            let (tx, rx) = std::sync::mpsc::channel();
            let bar = (!a.json && std::io::stderr().is_terminal()).then(|| {
                let g = gpu.clone();
                std::thread::spawn(move || progress_bar(managed, g, rx))
            });
            let req = Request::Checkpoint {
                dir: gpu.display().to_string(),
            };
            engine_report = clock.time("engine_snapshot", || ask(pid, &sockets, &req))?;
            drop(tx);
            if let Some(b) = bar {
                let _ = b.join();
            }
            guard.step("releasing");
            release_report = clock.time("release", || ask(pid, &sockets, &Request::Release))?;
        }
        let Some((criu, drv)) = &side else {
            let gpu_bytes = dir_bytes(&tmp.join("gpu"));
            return Ok((manifest(None), 0, gpu_bytes));
        };
        guard.step("locking");
        clock
            .time("driver_lock", || Ok(drv.lock(pid, LOCK_TIMEOUT_MS)?))
            .map_err(|e| {
                if a.engine == EngineKind::Possum && e.to_string().contains("NOT_SUPPORTED") {
                    e.context(
                        "NVIDIA's driver checkpoint (this driver) refuses any process CUPTI has \
                         subscribed in, and possum needs CUPTI: a full possum checkpoint cannot \
                         run here; use --engine driver (or --gpu-only for possum's GPU side)",
                    )
                } else {
                    e
                }
            })?;
        clock.time("driver_checkpoint", || Ok(drv.checkpoint(pid)?))?;
        let criu_dir = tmp.join("criu");
        let mut opts = DumpOptions::new(pid, &criu_dir);
        opts.leave_running = true;
        opts.shell_job = shell_job;
        opts.ext_unix_sk = true;
        let dump = clock.time("criu_dump", || Ok(criu.dump(&opts)?))?;
        let gpu_bytes = dir_bytes(&tmp.join("gpu"));
        Ok((manifest(Some("criu".into())), dump.image_bytes, gpu_bytes))
    })();
    let (mut manifest, criu_bytes, gpu_bytes) = match r {
        Ok(x) => x,
        Err(e) => {
            guard.undo();
            return Err(e.context(format!(
                "checkpoint of process {pid} failed; the job runs on, no image was written"
            )));
        }
    };
    // The image is complete: name it.
    let commit = clock.time("commit", || {
        manifest.figures = json!({"engine_report": engine_report});
        let text = serde_json::to_string_pretty(&manifest)?;
        fs::write(tmp.join(MANIFEST), text)?;
        fs::File::open(&tmp)?.sync_all()?;
        if a.force && a.dir.exists() {
            let old = tmp.with_extension("old");
            fs::rename(&a.dir, &old)?;
            fs::rename(&tmp, &a.dir)?;
            let _ = fs::remove_dir_all(&old);
        } else {
            // Fails if DIR appeared meanwhile and is not empty: nothing is overwritten.
            let _ = fs::remove_dir(&a.dir);
            fs::rename(&tmp, &a.dir)?;
        }
        Ok(())
    });
    if let Err(e) = commit {
        guard.undo();
        return Err(e.context(format!(
            "naming the image {} failed; the job runs on",
            a.dir.display()
        )));
    }
    guard.step("committed");
    let after = (|| -> Result<()> {
        if a.leave_running || a.gpu_only {
            if let Some((_, drv)) = &side {
                clock.time("driver_restore", || Ok(drv.restore(pid, &[])?))?;
                clock.time("driver_unlock", || Ok(drv.unlock(pid)?))?;
                guard.step("unlocked");
            }
            if a.engine == EngineKind::Possum {
                let req = Request::Resume {
                    dir: Some(a.dir.join("gpu").display().to_string()),
                };
                clock.time("resume", || ask(pid, &sockets, &req))?;
                guard.step("resumed");
            }
        } else {
            clock.time("kill", || {
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                )?;
                let t = Instant::now();
                while alive(pid) && t.elapsed() < Duration::from_secs(10) {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(())
            })?;
        }
        Ok(())
    })();
    if let Err(e) = after {
        guard.undo();
        return Err(e.context("the image is complete, but the job could not be resumed"));
    }
    guard.done();
    // Durable only now, with the job running again: nothing was fsynced while it was paused.
    clock.time("sync", || sync_tree(&a.dir))?;

    let stall_engine = clock.get("release") + clock.get("resume");
    let stall_driver = clock.get("driver_lock")
        + clock.get("driver_checkpoint")
        + clock.get("driver_restore")
        + clock.get("driver_unlock");
    let stall_criu = clock.get("criu_dump");
    let mut fig = clock.json();
    fig.insert("total_ms".into(), json!(ms(t_all.elapsed())));
    fig.insert(
        "stall_ms".into(),
        json!(ms(stall_engine
            + stall_driver
            + stall_criu
            + clock.get("commit"))),
    );
    fig.insert(
        "stall_breakdown_ms".into(),
        json!({"engine": ms(stall_engine), "driver": ms(stall_driver), "criu": ms(stall_criu),
               "commit": ms(clock.get("commit"))}),
    );
    fig.insert("image_bytes".into(), json!(criu_bytes + gpu_bytes));
    fig.insert("criu_image_bytes".into(), json!(criu_bytes));
    fig.insert("gpu_image_bytes".into(), json!(gpu_bytes));
    let out = json!({
        "pid": pid, "engine": a.engine, "dir": a.dir, "leave_running": a.leave_running,
        "figures": fig, "engine_report": engine_report, "release_report": release_report,
    });
    // The figures also go into the image (best effort: the image is already complete).
    manifest.figures = out.clone();
    if let Ok(text) = serde_json::to_string_pretty(&manifest) {
        let _ = fs::write(a.dir.join(MANIFEST), text);
    }
    if a.json {
        println!("{out}");
    } else {
        let f = |k: &str| fig.get(k).and_then(Value::as_f64).unwrap_or(0.0);
        println!(
            "possum: process {pid} checkpointed to {} ({:?} engine{}): {:.2} GiB image",
            a.dir.display(),
            a.engine,
            if a.leave_running {
                ", still running"
            } else {
                ", then killed"
            },
            (criu_bytes + gpu_bytes) as f64 / (1u64 << 30) as f64
        );
        println!(
            "  job paused {:.0} ms (engine {:.0}, driver {:.0}, CRIU {:.0}, commit {:.0}); total {:.0} ms",
            f("stall_ms"),
            ms(stall_engine),
            ms(stall_driver),
            ms(stall_criu),
            f("commit_ms"),
            f("total_ms")
        );
        if a.engine == EngineKind::Possum {
            println!(
                "  GPU buffers saved while the job ran: {:.0} ms",
                f("engine_snapshot_ms")
            );
        }
    }
    Ok(true)
}

/// Arguments of the hidden `possum cupti` (diagnostics).
#[derive(Args, Debug)]
pub struct CuptiArgs {
    pub pid: i32,
    /// Attach again (default: detach).
    #[arg(long)]
    pub attach: bool,
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
}

/// `possum cupti PID [--attach]`: detaches CUPTI from a job (or attaches it again).
pub fn cupti(a: &CuptiArgs) -> Result<bool> {
    let dir = socket_dir_of(a.socket_dir.as_ref());
    let v = ask(a.pid, &dir, &Request::Cupti { attach: a.attach })?;
    println!("{v}");
    Ok(true)
}

/// Reads and checks `DIR/possum.json` and what it names.
pub fn open_image(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let text = fs::read_to_string(&path).with_context(|| {
        format!(
            "{} is not a complete possum image (no {MANIFEST})",
            dir.display()
        )
    })?;
    let m: Manifest =
        serde_json::from_str(&text).with_context(|| format!("{} is corrupt", path.display()))?;
    if m.possum_image != MANIFEST_VERSION {
        bail!(
            "{}: image format {} (this possum reads {MANIFEST_VERSION})",
            path.display(),
            m.possum_image
        );
    }
    let Some(criu_dir) = &m.criu_dir else {
        bail!(
            "{} holds only GPU buffers (written with --gpu-only): there is no process to restore",
            dir.display()
        );
    };
    let criu = dir.join(criu_dir);
    if !criu.join("inventory.img").is_file() {
        bail!(
            "{}: CRIU's images are missing or partial (no inventory.img)",
            criu.display()
        );
    }
    if let Some(g) = &m.gpu_dir {
        let gpu = dir.join(g);
        let mut n = 0;
        for e in
            fs::read_dir(&gpu).with_context(|| format!("{}: GPU images missing", gpu.display()))?
        {
            let e = e?;
            possum_engine::image::Image::open(&e.path())
                .with_context(|| format!("GPU image {}", e.path().display()))?;
            n += 1;
        }
        if n == 0 {
            bail!("{}: no GPU image", gpu.display());
        }
    }
    Ok(m)
}

pub fn restore(a: &RestoreArgs) -> Result<bool> {
    let t_all = Instant::now();
    let m = open_image(&a.dir)?;
    let pid = m.pid;
    if alive(pid) {
        bail!(
            "process {pid} is running: CRIU restores the job under its old PID, which must be \
             free (kill the original first, or restore on another machine)"
        );
    }
    let pairs = plan_gpus(&m, a.device)?;
    let criu = Criu::locate().context("CRIU is needed for the CPU side")?;
    let drv = DriverCheckpoint::load().context("NVIDIA's driver checkpoint is needed")?;
    let sockets = a.socket_dir.clone().unwrap_or_else(|| m.socket_dir.clone());
    if m.engine == EngineKind::Possum {
        // The killed job's socket file is still there; the restored job listens on it again.
        let _ = fs::remove_file(possum_control::socket_path(&sockets, pid as u32));
    }
    let mut clock = Clock::default();
    let mut opts = RestoreOptions::new(a.dir.join(m.criu_dir.as_deref().unwrap_or("criu")));
    opts.shell_job = m.shell_job;
    opts.ext_unix_sk = true;
    opts.log_file = format!("restore-{}.log", std::process::id());
    clock.time("criu_restore", || Ok(criu.restore(&opts)?))?;
    let r = (|| -> Result<()> {
        clock.time("driver_restore", || Ok(drv.restore(pid, &pairs)?))?;
        clock.time("driver_unlock", || Ok(drv.unlock(pid)?))?;
        if let Some(g) = &m.gpu_dir {
            let req = Request::Resume {
                dir: Some(a.dir.join(g).display().to_string()),
            };
            clock.time("resume", || ask(pid, &sockets, &req))?;
        }
        Ok(())
    })();
    if let Err(e) = r {
        // A half-restored job is of no use to anyone: it must not linger, locked.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        return Err(e.context(format!(
            "restore of process {pid} failed; the restored process was killed, the image is intact"
        )));
    }
    let mut fig = clock.json();
    fig.insert("total_ms".into(), json!(ms(t_all.elapsed())));
    let out = json!({"pid": pid, "engine": m.engine, "dir": a.dir, "figures": fig});
    if a.json {
        println!("{out}");
    } else {
        println!(
            "possum: process {pid} restored from {} ({:?} engine) in {:.0} ms (CRIU {:.0}, driver {:.0}, resume {:.0}){}",
            a.dir.display(),
            m.engine,
            ms(t_all.elapsed()),
            ms(clock.get("criu_restore")),
            ms(clock.get("driver_restore") + clock.get("driver_unlock")),
            ms(clock.get("resume")),
            if m.gpu_dir.is_some() {
                "; GPU buffers come back on demand"
            } else {
                ""
            }
        );
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_uuids_are_parsed() {
        let b = uuid_bytes("GPU-8a9c1d2e-0011-2233-4455-66778899aabb").unwrap();
        assert_eq!(b[0], 0x8a);
        assert_eq!(b[15], 0xbb);
        assert!(uuid_bytes("GPU-8a9c").is_err());
        assert!(uuid_bytes("GPU-zz9c1d2e-0011-2233-4455-66778899aabb").is_err());
    }
}
