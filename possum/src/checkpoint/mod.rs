//! `possum checkpoint` and `possum restore`: a live GPU process to an image directory and back.
//!
//! ```text
//! checkpoint (engine possum)                      job (libpossum.so)
//!   checkpoint{tmp/gpu} ────────────────────────▶ pre-copy of every buffer while it runs
//!   release ────────────────────────────────────▶ T0: GPU operations held; what was written since
//!                                                 copied, images committed, buffers' memory dropped
//!   driver lock + checkpoint (the residue)        (contexts, memory possum does not manage)
//!   CRIU dump (--leave-running; the job stays held)
//!   possum.json written, tmp renamed to DIR
//!   --leave-running: driver restore + unlock, resume{DIR/gpu} ▶ runs on; buffers back on demand
//!   otherwise: the job is killed
//! restore
//!   CRIU restore ─ driver restore + unlock ─ resume{DIR/gpu} ▶ runs; buffers back on demand
//! ```
//! The job's GPU operations are held at possum's op gate, in its wrappers of the CUDA driver's
//! entry points (`hooks_live` in the job's status). A job run with hooks off (POSSUM_HOOKS=off)
//! is held by parking its threads instead: no pre-copy, every buffer copied while held and back
//! before it runs on. `--engine driver` is the baseline: the same without possum's steps (the
//! driver copies every buffer while the job is locked). `--gpu-only` is possum's steps alone.
//!
//! Nothing is ever left half-done: a `possum checkpoint-guard` process ([`guard`]) is told each
//! step before it is taken and, if the checkpoint fails or `possum` dies (even by SIGKILL), undoes
//! what was done, so the job runs on and no image appears under DIR's name. The image directory
//! and its `possum.json` are in [`image`]; the restore in [`restore`].

mod guard;
mod held;
mod image;
mod restore;
mod stage;
mod tree;

pub use guard::{guard, GuardArgs};
pub use restore::{restore, RestoreArgs};

use std::fs;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use possum_control::{ControlError, Request};
use possum_criu::{Criu, DumpOptions};
use possum_cuda::checkpoint::{DriverCheckpoint, ProcessState};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use guard::{Guard, Step};
use image::{
    child_gpu_dir, dir_bytes, manifest_text, occupied, smi, sync_tree, HeldMemory, KeeperOfJob,
    Manifest, MANIFEST, MANIFEST_VERSION,
};

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
    /// When the job is killed (no --leave-running) and its GPU memory is a keeper's (`possum
    /// run`'s default): the keeper keeps the job's GPU buffers on the GPU this many seconds after
    /// it is gone, so that `possum restore` on this host maps them instead of copying them back
    /// from the image (the image is complete either way). The keeper frees them sooner if a
    /// live job needs the memory. 0: freed with the job.
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    pub keep_on_gpu: u64,
    /// With --leave-running, when the job's GPU memory is a keeper's: device memory the save of
    /// its buffers may use for copies made on the GPU (MiB). Buffers that fit are copied there
    /// before the job runs on (1.5 TB/s) and saved from those copies; the rest are saved from the
    /// job's memory, each copied first when the job is about to write it. Default: the job's
    /// `POSSUM_SHADOW_MIB`, else three quarters of the GPU's free memory beyond 4 GiB.
    #[arg(long, value_name = "MIB")]
    pub shadow_budget: Option<u64>,
    /// Print the figures as JSON.
    #[arg(long)]
    pub json: bool,
    /// Directory of the job's control socket (default: $POSSUM_SOCKET_DIR, else /tmp/possum).
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
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

/// Whether process `pid` exists and is not a zombie.
pub(crate) fn alive(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// SIGKILLs process `pid` and waits (bounded) until it is gone.
fn kill_job(pid: i32) -> Result<()> {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let t = Instant::now();
    while alive(pid) && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
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

/// Maps a control error to what the user should do (the control error already names the
/// process, and for one without possum says how to start it with possum).
fn job_error(pid: i32, e: ControlError) -> anyhow::Error {
    match e {
        ControlError::NotLoaded { .. } => {
            anyhow!("{e}; or checkpoint it without possum with `--engine driver`")
        }
        ControlError::Stale { .. } => anyhow!(
            "{e}; possum does not answer in process {pid}: checkpoint it without possum with \
             `--engine driver`"
        ),
        ControlError::NoProcess(_) => anyhow!("{e}"),
        other => anyhow!("process {pid}: {other}"),
    }
}

fn ask(pid: i32, dir: &Path, req: &Request) -> Result<Value> {
    possum_control::request(pid as u32, dir, req, JOB_TIMEOUT).map_err(|e| job_error(pid, e))
}

/// Which of `children` have possum loaded: a control socket in `sockets` that answers. One with
/// managed memory is refused, as the root is; one whose socket does not answer is an error.
fn possum_in(children: &[i32], sockets: &Path) -> Result<Vec<i32>> {
    let mut out = Vec::new();
    for &c in children {
        match possum_control::request(c as u32, sockets, &Request::Status, Duration::from_secs(30))
        {
            Ok(status) => {
                refuse_managed(c, &status, false)
                    .map_err(|e| e.context(format!("process {c} of the job's tree")))?;
                out.push(c);
            }
            Err(ControlError::NotLoaded { .. }) => {}
            Err(e) => return Err(job_error(c, e).context(format!("process {c} of the job's tree"))),
        }
    }
    Ok(out)
}

/// Resumes possum in each of `children` from its GPU images under `dir`, timed as `resume`.
fn resume_children(
    children: &[i32],
    dir: &Path,
    sockets: &Path,
    clock: &mut Clock,
) -> Result<Vec<Value>> {
    let mut replies = Vec::with_capacity(children.len());
    for &c in children {
        let req = Request::Resume {
            dir: Some(dir.join(child_gpu_dir(c)).display().to_string()),
        };
        replies.push(
            clock
                .time("resume", || ask(c, sockets, &req))
                .map_err(|e| e.context(format!("process {c} of the job's tree")))?,
        );
    }
    Ok(replies)
}

/// A kept checkpoint after the CRIU dump: the driver restores and unlocks the tree, every
/// possum process resumes from its GPU images under `tmp` (the kept ones attach their buffers
/// and start saving them as of the hold, with `shadow_budget` MiB of device memory if given),
/// then waits until the saves are committed. (resume report of the root, saved reports.)
#[allow(clippy::too_many_arguments)]
fn resume_and_save(
    side: &Option<(Criu, DriverCheckpoint)>,
    pid: i32,
    children: &[i32],
    possum_children: &[i32],
    kept: &[i32],
    shadow_budget: Option<u64>,
    tmp: &Path,
    sockets: &Path,
    clock: &mut Clock,
    guard: &mut Guard,
    before_resume: impl FnOnce(&mut Clock) -> Result<()>,
) -> Result<(Value, Value)> {
    if let Some((_, drv)) = side {
        driver_restore_and_unlock(drv, pid, children, clock)?;
        guard.step(Step::Unlocked);
    }
    // With the tree running again in the driver (a new CUDA process, a keeper, is not started
    // while one is checkpointed), before any buffer is attached again.
    before_resume(clock)?;
    let mut root_report = Value::Null;
    for &p in std::iter::once(&pid).chain(possum_children) {
        let gpu = if p == pid {
            tmp.join("gpu")
        } else {
            tmp.join(child_gpu_dir(p))
        };
        let dir = gpu.display().to_string();
        let req = if kept.contains(&p) {
            Request::ResumeAndSave {
                dir,
                shadow_mib: shadow_budget,
            }
        } else {
            Request::Resume { dir: Some(dir) }
        };
        let r = clock
            .time("resume", || ask(p, sockets, &req))
            .map_err(|e| e.context(format!("resuming process {p}")))?;
        if p == pid {
            root_report = r;
        }
    }
    guard.step(Step::Resumed);
    let mut saved = Vec::new();
    for &p in kept {
        let r = clock
            .time("saved", || {
                possum_control::request(p as u32, sockets, &Request::Saved, SAVE_TIMEOUT)
                    .map_err(|e| job_error(p, e))
            })
            .map_err(|e| e.context(format!("saving the GPU buffers of process {p}")))?;
        saved.push(json!({"pid": p, "report": r}));
    }
    Ok((root_report, Value::Array(saved)))
}

/// CRIU's dump of the held job, again (up to [`DUMP_TRIES`] times, [`DUMP_RETRY_WAIT`] apart)
/// when it failed only because the job's control socket had a client connected at that moment
/// (CRIU cannot dump one end of a stream connection whose other end is outside the tree): a
/// `possum status` from elsewhere, or a client of an earlier checkpoint that died, whose
/// exchange the job's control thread (not held) ends meanwhile. A failed dump leaves the tree
/// as it was, still held.
fn dump_retrying_transient(
    criu: &possum_criu::Criu,
    opts: &DumpOptions,
    pid: i32,
) -> Result<possum_criu::DumpReport> {
    // The control socket's file name, as CRIU's log names it.
    let sock = possum_control::socket_path(Path::new(""), pid as u32)
        .display()
        .to_string();
    let mut tries = 0;
    loop {
        tries += 1;
        match criu.dump(opts) {
            Ok(d) => return Ok(d),
            Err(e) => {
                let m = e.to_string();
                let transient =
                    m.contains("Can't dump half of stream unix connection") && m.contains(&sock);
                if !transient || tries >= DUMP_TRIES {
                    return Err(e.into());
                }
                eprintln!(
                    "possum: CRIU's dump of process {pid} met a client connected to its control \
                     socket; dumping again in {} ms",
                    DUMP_RETRY_WAIT.as_millis()
                );
                std::thread::sleep(DUMP_RETRY_WAIT);
            }
        }
    }
}

/// [`possum_criu::hostmem::split`] of CRIU's images in `criu_dir`, timed as `hostmem_split`; off
/// with `POSSUM_HOSTMEM_SPLIT=0` or without possum's CRIU plugin (which writes it back). A failure leaves the images whole (CRIU restores them itself)
/// and is said on stderr. What was moved, as JSON.
fn split_host_memory(criu: &possum_criu::Criu, criu_dir: &Path, clock: &mut Clock) -> Value {
    use possum_criu::hostmem;
    if std::env::var("POSSUM_HOSTMEM_SPLIT").as_deref() == Ok("0") {
        return json!({"off": "POSSUM_HOSTMEM_SPLIT=0"});
    }
    // Only possum's CRIU plugin writes split memory back: no plugin here, no split.
    if !criu.has_possum_plugin() {
        return json!({"off": "no CRIU plugin"});
    }
    let r = clock.time("hostmem_split", || {
        Ok(hostmem::split(criu_dir, &hostmem::SplitOptions::default())?)
    });
    match r {
        Ok(rep) => json!({
            "moved_bytes": rep.moved_bytes(),
            "kept_bytes": rep.split.iter().map(|t| t.kept_bytes).sum::<u64>(),
            "processes": rep.split.iter().map(|t| t.pid).collect::<Vec<_>>(),
            "left": rep.left.iter().map(|(p, why)| json!({"pid": p, "why": why})).collect::<Vec<_>>(),
        }),
        Err(e) => {
            let e = format!("{e:#}");
            eprintln!(
                "possum: CRIU restores the job's memory itself (splitting its images failed: {e})"
            );
            json!({"error": e})
        }
    }
}

/// Dumps tried when the job's control socket had a client connected ([`dump_retrying_transient`]).
const DUMP_TRIES: u32 = 3;
const DUMP_RETRY_WAIT: Duration = Duration::from_millis(200);

/// The driver's restore, then unlock, of the job and the other CUDA processes of its tree, on
/// the same GPUs; timed as `driver_restore` and `driver_unlock`.
fn driver_restore_and_unlock(
    drv: &DriverCheckpoint,
    pid: i32,
    children: &[i32],
    clock: &mut Clock,
) -> Result<()> {
    clock.time("driver_restore", || {
        for &p in std::iter::once(&pid).chain(children) {
            drv.restore(p, &[])?;
        }
        Ok(())
    })?;
    clock.time("driver_unlock", || {
        for &p in std::iter::once(&pid).chain(children) {
            drv.unlock(p)?;
        }
        Ok(())
    })
}

/// The job's `POSSUM_KEEPER` and `CUDA_VISIBLE_DEVICES`, from its environment.
fn keeper_of(pid: i32) -> Option<KeeperOfJob> {
    let env = fs::read(format!("/proc/{pid}/environ")).ok()?;
    let var = |name: &str| {
        env.split(|&b| b == 0).find_map(|kv| {
            kv.strip_prefix(name.as_bytes())
                .and_then(|r| r.strip_prefix(b"="))
                .map(|v| String::from_utf8_lossy(v).into_owned())
        })
    };
    let dir = var(possum_keeper::KEEPER_ENV).filter(|d| !d.is_empty())?;
    Some(KeeperOfJob {
        dir: PathBuf::from(dir),
        cuda_visible_devices: var("CUDA_VISIBLE_DEVICES"),
    })
}

/// How long `possum checkpoint` waits for a kept checkpoint's buffers to be saved.
const SAVE_TIMEOUT: Duration = Duration::from_secs(3600);

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
    // Until told to stop, or the sender is dropped (a disconnected channel ends the bar too).
    while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
        stop.recv_timeout(Duration::from_millis(200))
    {
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

/// [`progress_bar`] on its own thread (when `show`), ended by [`ProgressBar::finish`] or by being
/// dropped.
struct ProgressBar(Option<(std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>)>);

impl ProgressBar {
    fn start(show: bool, total: u64, watch: PathBuf) -> ProgressBar {
        ProgressBar(show.then(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            (
                tx,
                std::thread::spawn(move || progress_bar(total, watch, rx)),
            )
        }))
    }

    fn finish(&mut self) {
        if let Some((tx, thread)) = self.0.take() {
            drop(tx);
            let _ = thread.join();
        }
    }
}

impl Drop for ProgressBar {
    fn drop(&mut self) {
        self.finish();
    }
}

/// What to do when NVIDIA's driver refuses to lock a job because CUPTI is subscribed in it.
const CUPTI_REFUSED: &str = "NVIDIA's driver checkpoint (this driver) refuses any process CUPTI \
     has subscribed in, and this job runs with CUPTI (`possum run --cupti`, POSSUM_HOOKS=cupti: a \
     diagnostic): start it with `possum run JOB` (without --cupti) for a full possum checkpoint, \
     or use --engine driver (or --gpu-only for possum's GPU side)";

/// How possum sees a job's GPU operations, from its status.
#[derive(Debug, Clone, PartialEq, Eq)]
struct JobHooks {
    /// possum sees its operations now (entry points or CUPTI): pre-copy, hold at the op gate,
    /// on-demand restore. Otherwise a checkpoint parks its threads.
    live: bool,
    /// CUPTI's callbacks are subscribed (NVIDIA's driver then refuses the checkpoint).
    cupti: bool,
    /// `entry`, `cupti` or `off` (POSSUM_HOOKS); none from libraries older than the entry points.
    mode: Option<String>,
}

impl JobHooks {
    fn of(status: &Value) -> JobHooks {
        let session = &status["possum"]["session"];
        let cupti = session["cupti_attached"] == json!(true);
        JobHooks {
            // Libraries older than the entry points' hooks had only CUPTI's.
            live: session["hooks_live"].as_bool().unwrap_or(cupti),
            cupti,
            mode: status["hooks"].as_str().map(str::to_string),
        }
    }

    /// What saw the job's operations, in words.
    fn seen_by(&self) -> &'static str {
        match self.mode.as_deref() {
            Some("entry") => "the driver's entry points",
            _ if self.cupti => "CUPTI callbacks",
            Some("cupti") => "CUPTI callbacks",
            _ => "possum's hooks",
        }
    }
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Refuses a job with managed (unified) memory, before anything is done: NVIDIA's driver
/// checkpoint does not support it, and possum's engine does not save it.
fn refuse_managed(pid: i32, status: &Value, gpu_only: bool) -> Result<()> {
    let m = &status["possum"]["unmanaged"]["by_kind"]["cuMemAllocManaged"];
    if m.is_null() || m["allocations"].as_u64() == Some(0) {
        return Ok(());
    }
    let what = format!(
        "process {pid} has managed memory (cuMemAllocManaged: {} allocations, {})",
        m["allocations"].as_u64().unwrap_or(0),
        gib(m["bytes"].as_u64().unwrap_or(0))
    );
    if gpu_only {
        bail!(
            "{what}: possum's engine does not save managed memory, so --gpu-only cannot save \
             this job's GPU state (nor can NVIDIA's driver checkpoint, which does not support \
             managed memory); nothing was done"
        )
    }
    bail!(
        "{what}: NVIDIA's driver checkpoint does not support managed (unified) memory, and \
         possum's engine does not save it, so this job cannot be checkpointed; nothing was done"
    )
}

/// The buffers and bytes the release copied (over every device), from the job's answer.
fn copied_at_release(report: &Value) -> (u64, u64) {
    report["final"]
        .as_array()
        .into_iter()
        .flatten()
        .fold((0, 0), |(n, b), f| {
            (
                n + f["buffers"].as_u64().unwrap_or(0),
                b + f["bytes"].as_u64().unwrap_or(0),
            )
        })
}

/// How long the probe's lock may wait for the job's GPU work (a refusal is immediate).
const PROBE_LOCK_MS: u32 = 2_000;

/// Asks NVIDIA's driver to lock `pid` and unlocks it at once: the driver says only at the lock
/// that it refuses a process CUPTI has subscribed in, and a full checkpoint of a CUPTI job would
/// otherwise pause it, copy and release its buffers and bring them back for nothing. A refusal
/// is an error naming what to do instead; a lock that cannot be had now (a timeout) is left for
/// the checkpoint's own lock to report.
fn probe_driver_lock(drv: &DriverCheckpoint, pid: i32) -> Result<()> {
    match drv.lock(pid, PROBE_LOCK_MS) {
        Ok(()) => drv
            .unlock(pid)
            .with_context(|| format!("unlocking process {pid} after probing the driver's lock")),
        Err(e) if e.to_string().contains("NOT_SUPPORTED") => {
            Err(anyhow::Error::new(e).context(CUPTI_REFUSED))
        }
        Err(_) => Ok(()),
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
    if let Some(s) = &status {
        refuse_managed(pid, s, a.gpu_only)?;
    }
    // The process side: CRIU and the driver checkpoint (not needed for --gpu-only).
    let side = if a.gpu_only {
        None
    } else {
        let criu = Criu::locate().context("CRIU is needed for the CPU side")?;
        let drv = DriverCheckpoint::load().context("NVIDIA's driver checkpoint is needed")?;
        Some((criu, drv))
    };
    // With its hooks live (the driver's entry points, or CUPTI's callbacks), possum holds the
    // job's operations at its op gate after a pre-copy; without them it parks the job's threads
    // instead and copies every buffer while they are parked (docs/decisions.md 17).
    let hooks = status.as_ref().map(JobHooks::of);
    let held = hooks.as_ref().is_some_and(|h| !h.live);
    // NVIDIA's driver refuses to lock a process CUPTI has subscribed in.
    let cupti = hooks.as_ref().is_some_and(|h| h.cupti);
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
        if a.engine == EngineKind::Possum && cupti {
            probe_driver_lock(drv, pid)?;
        }
    }
    // The other CUDA processes of the job's tree: locked and checkpointed by the driver with the
    // root (one T0 for all, before CRIU dumps any), restored and unlocked with it.
    let children = match &side {
        Some((_, drv)) => tree::cuda_descendants(drv, pid)?,
        None => Vec::new(),
    };
    // Those with possum loaded (a control socket in the same directory): their buffers are
    // saved and released by possum like the root's.
    let possum_children = match a.engine {
        EngineKind::Possum => possum_in(&children, &sockets)?,
        EngineKind::Driver => Vec::new(),
    };
    let managed: u64 = status
        .as_ref()
        .and_then(|s| s["possum"]["engines"].as_array())
        .map(|es| {
            es.iter()
                .filter_map(|e| e["engine"]["bytes"].as_u64())
                .sum()
        })
        .unwrap_or(0);
    let (socket_dirs, stdio_pipes) = {
        let mut tree = tree::descendants(pid);
        tree.push(pid);
        (
            tree::socket_dirs(&tree),
            tree::external_stdio_pipes(pid, &tree),
        )
    };
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
        children: children.clone(),
        possum_children: possum_children.clone(),
        tmp: tmp.clone(),
        final_dir: a.dir.clone(),
        socket_dir: sockets.clone(),
    })?;
    let mut clock = Clock::default();
    let mut engine_report = Value::Null;
    let mut release_report = Value::Null;
    // What the keeper holds for the restore, by epoch (a job killed with its memory kept).
    let mut held_memory: Vec<HeldMemory> = Vec::new();
    let mut resume_report = Value::Null;
    let mut saved_report = Value::Null;
    // Processes whose checkpoint is kept (their buffers saved after the resume).
    let mut kept: Vec<i32> = Vec::new();
    // Where the job's keeper is, if its buffer memory is a keeper's (for the restore).
    let keeper_of_job = status
        .as_ref()
        .filter(|s| {
            s["possum"]["engines"]
                .as_array()
                .is_some_and(|es| es.iter().any(|e| e["keeper"].is_object()))
        })
        .and_then(|_| keeper_of(pid));
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
        cuda_children: children.clone(),
        possum_children: possum_children.clone(),
        socket_dirs: socket_dirs.clone(),
        stdio_pipes: stdio_pipes.clone(),
        keeper: keeper_of_job.clone(),
        held: Vec::new(),
        figures: Value::Null,
        check: None,
    };
    // During a kept hold: fds of the memory the job detached, in case its keeper dies meanwhile.
    let mut held_thread: Option<std::thread::JoinHandle<held::HeldHandles>> = None;
    let r = (|| -> Result<(Manifest, u64, u64)> {
        if a.engine == EngineKind::Possum {
            let gpu = tmp.join("gpu");
            // The bar follows the copy: the pre-copy, or (a held job) the release.
            let show = !a.json && std::io::stderr().is_terminal();
            let mut bar = ProgressBar::start(show, managed, gpu.clone());
            // A job left running whose buffer memory a keeper holds: nothing copied before the
            // hold, its buffers saved after it runs again (`kept`).
            let snapshot = |dir: PathBuf| {
                let dir = dir.display().to_string();
                if a.leave_running && !a.gpu_only {
                    Request::CheckpointKept { dir }
                } else {
                    Request::Checkpoint { dir }
                }
            };
            engine_report = clock.time("engine_snapshot", || {
                ask(pid, &sockets, &snapshot(gpu.clone()))
            })?;
            if engine_report["kept"] == json!(true) {
                kept.push(pid);
            }
            for &c in &possum_children {
                let r = clock.time("engine_snapshot", || {
                    ask(c, &sockets, &snapshot(tmp.join(child_gpu_dir(c))))
                })?;
                if r["kept"] == json!(true) {
                    kept.push(c);
                }
            }
            if !held {
                bar.finish();
            }
            guard.step(Step::Releasing);
            // A job to be killed whose memory a keeper holds: its buffers stay on the GPU with
            // the keeper for a restore here (the image is committed before the release).
            let release = if !a.leave_running && !a.gpu_only && keeper_of_job.is_some() {
                Request::ReleaseKeeping {
                    hold_secs: a.keep_on_gpu,
                }
            } else {
                Request::Release
            };
            release_report = clock.time("release", || ask(pid, &sockets, &release))?;
            held_memory = HeldMemory::from_release(pid, &release_report);
            for &c in &possum_children {
                let r = clock
                    .time("release", || ask(c, &sockets, &release))
                    .map_err(|e| e.context(format!("process {c} of the job's tree")))?;
                held_memory.extend(HeldMemory::from_release(c, &r));
            }
            bar.finish();
            // Taken while the driver and CRIU work (a few ms), not before them. On unless
            // `POSSUM_KEEPER_REVIVE=0`.
            let revive = std::env::var_os("POSSUM_KEEPER_REVIVE").is_none_or(|v| v != "0");
            if let (true, false, Some(k)) = (revive, kept.is_empty(), &keeper_of_job) {
                let (dir, pids) = (k.dir.clone(), kept.clone());
                held_thread = Some(std::thread::spawn(move || {
                    held::HeldHandles::collect(&dir, &pids)
                }));
            }
        }
        let Some((criu, drv)) = &side else {
            let gpu_bytes = dir_bytes(&tmp.join("gpu"));
            return Ok((manifest(None), 0, gpu_bytes));
        };
        guard.step(Step::Locking);
        clock
            .time("driver_lock", || Ok(drv.lock(pid, LOCK_TIMEOUT_MS)?))
            .map_err(|e| {
                if cupti && e.to_string().contains("NOT_SUPPORTED") {
                    e.context(CUPTI_REFUSED)
                } else {
                    e
                }
            })?;
        for &c in &children {
            clock
                .time("driver_lock", || Ok(drv.lock(c, LOCK_TIMEOUT_MS)?))
                .map_err(|e| e.context(format!("locking process {c} of the job's tree")))?;
        }
        clock.time("driver_checkpoint", || {
            drv.checkpoint(pid)?;
            for &c in &children {
                drv.checkpoint(c)
                    .map_err(|e| anyhow::anyhow!("process {c} of the job's tree: {e}"))?;
            }
            Ok(())
        })?;
        let criu_dir = tmp.join("criu");
        let mut opts = DumpOptions::new(pid, &criu_dir);
        opts.leave_running = true;
        opts.shell_job = shell_job;
        opts.ext_unix_sk = true;
        let dump = clock.time("criu_dump", || dump_retrying_transient(criu, &opts, pid))?;
        let gpu_bytes = dir_bytes(&tmp.join("gpu"));
        Ok((manifest(Some("criu".into())), dump.image_bytes, gpu_bytes))
    })();
    let (mut manifest, criu_bytes, gpu_bytes) = match r {
        Ok((mut m, c, g)) => {
            m.held = std::mem::take(&mut held_memory);
            (m, c, g)
        }
        Err(e) => {
            guard.undo();
            return Err(e.context(format!(
                "checkpoint of process {pid} failed; the job runs on, no image was written"
            )));
        }
    };
    // A kept checkpoint's GPU images are complete only once saved, after the job runs again:
    // it resumes from the temporary directory first, and the image is named after the save.
    let kept_any = !kept.is_empty();
    let handles = held_thread.take().and_then(|t| t.join().ok());
    let mut keeper_handles = Value::Null;
    if kept_any {
        // A keeper that died during the hold: a new one takes the memory over from our fds.
        let revive = |clock: &mut Clock| -> Result<()> {
            if let (Some(h), Some(k)) = (&handles, &keeper_of_job) {
                keeper_handles = clock.time("keeper_check", || Ok(h.revive(k, pid)))?;
            }
            Ok(())
        };
        let after = resume_and_save(
            &side,
            pid,
            &children,
            &possum_children,
            &kept,
            a.shadow_budget,
            &tmp,
            &sockets,
            &mut clock,
            &mut guard,
            revive,
        );
        match after {
            Ok((resumed, saved)) => {
                resume_report = resumed;
                saved_report = saved;
            }
            Err(e) => {
                guard.undo();
                return Err(e.context(
                    "checkpoint failed after the job was held; the job runs on, no image was written",
                ));
            }
        }
    }
    // The bulk of the job's private memory out of CRIU's images, for possum's plugin to write
    // back in parallel at restore (`possum_criu::hostmem`). Not while a job left running without
    // a keeper is still held (it would lengthen its stall) unless `POSSUM_HOSTMEM_SPLIT=always`;
    // not for the driver engine (the baseline stays plain CRIU).
    let mut hostmem = Value::Null;
    if let (EngineKind::Possum, Some((criu, _))) = (a.engine, &side) {
        let always = std::env::var("POSSUM_HOSTMEM_SPLIT").as_deref() == Ok("always");
        if kept_any || !a.leave_running || always {
            hostmem = split_host_memory(criu, &tmp.join("criu"), &mut clock);
        }
    }
    // The image is complete: name it.
    let commit = clock.time("commit", || {
        // The figures are added once known (below); the image is complete without them.
        fs::write(tmp.join(MANIFEST), manifest_text(&manifest)?)?;
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
    guard.step(Step::Committed);
    let after = (|| -> Result<()> {
        if kept_any {
            return Ok(());
        }
        if a.leave_running || a.gpu_only {
            if let Some((_, drv)) = &side {
                driver_restore_and_unlock(drv, pid, &children, &mut clock)?;
                guard.step(Step::Unlocked);
            }
            if a.engine == EngineKind::Possum {
                let req = Request::Resume {
                    dir: Some(a.dir.join("gpu").display().to_string()),
                };
                resume_report = clock.time("resume", || ask(pid, &sockets, &req))?;
                resume_children(&possum_children, &a.dir, &sockets, &mut clock)?;
                guard.step(Step::Resumed);
            }
        } else {
            clock.time("kill", || kill_job(pid))?;
        }
        Ok(())
    })();
    if let Err(e) = after {
        guard.undo();
        return Err(e.context(format!(
            "the image is complete, but the job could not be resumed: if it is still paused, \
             end it and bring it back with `possum restore -D {}`",
            a.dir.display()
        )));
    }
    guard.done();
    // Durable only now, with the job running again: nothing was fsynced while it was paused.
    clock.time("sync", || sync_tree(&a.dir))?;

    let stall_engine = clock.get("release") + clock.get("keeper_check") + clock.get("resume");
    let stall_driver = clock.get("driver_lock")
        + clock.get("driver_checkpoint")
        + clock.get("driver_restore")
        + clock.get("driver_unlock");
    // A split while a job left running without a keeper is still held is part of its stall.
    let split_in_hold = if !kept_any && a.leave_running {
        clock.get("hostmem_split")
    } else {
        Duration::ZERO
    };
    let stall_criu = clock.get("criu_dump") + split_in_hold;
    let mut fig = clock.json();
    fig.insert("total_ms".into(), json!(ms(t_all.elapsed())));
    // A kept checkpoint names its image after the job runs again: not part of the stall.
    let stall_commit = if kept_any {
        Duration::ZERO
    } else {
        clock.get("commit")
    };
    fig.insert(
        "stall_ms".into(),
        json!(ms(stall_engine + stall_driver + stall_criu + stall_commit)),
    );
    fig.insert(
        "stall_breakdown_ms".into(),
        json!({"engine": ms(stall_engine), "driver": ms(stall_driver), "criu": ms(stall_criu),
               "commit": ms(stall_commit)}),
    );
    fig.insert("hostmem".into(), hostmem);
    fig.insert("image_bytes".into(), json!(criu_bytes + gpu_bytes));
    fig.insert("criu_image_bytes".into(), json!(criu_bytes));
    fig.insert("gpu_image_bytes".into(), json!(gpu_bytes));
    let (copied, copied_bytes) = copied_at_release(&release_report);
    let hold = match (a.engine, &hooks) {
        (EngineKind::Driver, _) | (_, None) => "driver lock".to_string(),
        (EngineKind::Possum, Some(_)) if kept_any => {
            "op gate: buffers left on the GPU with the keeper while held (nothing copied), \
             saved as of the hold while the job ran on"
                .to_string()
        }
        (EngineKind::Possum, Some(h)) if !h.live => {
            "threads parked (hooks off): every buffer copied while held".to_string()
        }
        (EngineKind::Possum, Some(h)) => format!(
            "op gate ({}): pre-copy while the job ran, then {copied} buffers written since \
             copied while held",
            h.seen_by()
        ),
    };
    let out = json!({
        "pid": pid, "cuda_children": children, "possum_children": possum_children,
        "engine": a.engine, "dir": a.dir,
        "leave_running": a.leave_running,
        "hooks": hooks.as_ref().and_then(|h| h.mode.clone()),
        "hold": hold,
        "figures": fig, "engine_report": engine_report, "release_report": release_report,
        "kept": kept, "saved_report": saved_report, "resume_report": resume_report,
        "keeper_handles": keeper_handles,
    });
    // Held until the job has its memory again (and the save is committed).
    drop(handles);
    // The figures also go into the image (best effort: the image is already complete).
    manifest.figures = out.clone();
    if let Ok(text) = manifest_text(&manifest) {
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
        if kept_any {
            println!(
                "  GPU buffers stayed on the GPU with the keeper while held; saved while the job \
                 ran on ({:.0} ms after it resumed)",
                f("saved_ms")
            );
        } else if a.engine == EngineKind::Possum && held {
            println!(
                "  hooks off: the job's threads were parked, and every GPU buffer ({copied}, {}) \
                 was copied while they were",
                gib(copied_bytes)
            );
        } else if a.engine == EngineKind::Possum {
            println!(
                "  GPU buffers pre-copied while the job ran ({:.0} ms); held at possum's op gate: \
                 {copied} buffers ({}) written since the pre-copy copied while held",
                f("engine_snapshot_ms"),
                gib(copied_bytes)
            );
        }
        if resume_report["on_demand"] == json!(true) {
            println!("  the job runs on; its GPU buffers come back on demand");
        }
        if release_report["held_for_restore"]
            .as_array()
            .is_some_and(|d| !d.is_empty())
        {
            println!(
                "  its GPU buffers stay on the GPU with its keeper for {} s: `possum restore` on \
                 this host maps them again instead of copying them from the image",
                a.keep_on_gpu
            );
        }
    }
    Ok(true)
}

/// Arguments of `possum resume`.
#[derive(Args, Debug)]
pub struct ResumeArgs {
    /// The job.
    pub pid: i32,
    /// possum's GPU image of the job (`IMAGES/possum-gpu-PID` after a `criu dump` with possum's
    /// plugin).
    pub gpu_dir: PathBuf,
    /// Directory of the job's control socket (default: $POSSUM_SOCKET_DIR, else /tmp/possum).
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
}

/// `possum resume PID GPU_DIR`: the job's buffers back on demand from GPU_DIR, its GPU
/// operations let go.
pub fn resume(a: &ResumeArgs) -> Result<bool> {
    let dir = socket_dir_of(a.socket_dir.as_ref());
    let gpu = fs::canonicalize(&a.gpu_dir)
        .with_context(|| format!("the GPU image {}", a.gpu_dir.display()))?;
    let req = Request::Resume {
        dir: Some(gpu.display().to_string()),
    };
    ask(a.pid, &dir, &req)?;
    println!(
        "possum: process {} runs on; its GPU buffers come back from {}",
        a.pid,
        gpu.display()
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The bar ends when its sender is dropped (it used to spin forever then, so a checkpoint run
    /// on a terminal never finished).
    #[test]
    fn the_progress_bar_ends_when_its_sender_is_dropped() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            progress_bar(1 << 20, std::env::temp_dir(), rx);
            let _ = done_tx.send(());
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(tx);
        assert!(
            done_rx.recv_timeout(Duration::from_secs(5)).is_ok(),
            "the progress bar did not stop"
        );
    }
}
