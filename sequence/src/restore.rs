//! The restore sequence: [`restore`] and its phases (see the crate's documentation).

use std::fs;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use possum_control::reply::ResumeReply;
use possum_control::Reply;
use possum_criu::restore::PreparedRestore;
use possum_criu::{Criu, CriuError, RestoreOptions};
use possum_cuda::checkpoint::{DriverCheckpoint, DriverCkptError};
use serde::Serialize;

use crate::config::Environment;
use crate::figures::{timed, RestoreFigures};
use crate::gpu_runtimes::GpuRuntime;
use crate::image::{
    open_image, plan_gpus, smi, Image, ImageError, JobOwner, KeeperOfJob, KeptBuffers, NetworkLock,
    UuidPairs,
};
use crate::job::{self, To};
use crate::places::{PlaceError, Places};
use crate::process::{
    boot_ticks_now, ending, pid_taken, wait_pids_free, PidTaken, Process, SignalError,
};
use crate::stage::{self, StageReport, Staging};
use crate::{Engine, Observer, ResumeError};

/// What to restore, and how (`possum restore`'s flags, with the environment).
#[derive(Debug, Clone)]
pub struct RestoreParams {
    /// The image directory.
    pub dir: PathBuf,
    /// The job's control socket directory (default: the one it had when checkpointed).
    pub socket_dir: Option<PathBuf>,
    /// The image was received from a migration's source, which proved it holds the migration's
    /// key and named the job's socket directory in it: without `socket_dir`, that directory (if
    /// absolute) is taken as possum's, as if it were given (the restored job's socket comes back
    /// there). Otherwise only the restoring possum's own socket directories are.
    pub socket_dir_from_source: bool,
    /// Restore onto this GPU (nvidia-smi's index) instead of the one the job ran on.
    pub device: Option<u32>,
    /// The possum executable (started as a keeper).
    pub possum_exe: PathBuf,
    /// What the environment says.
    pub env: Environment,
    /// `--hmac-key`: the image must be authenticated under this key ([`crate::auth`]), checked
    /// before anything else of it is read.
    pub hmac_key: Option<crate::auth::HmacKey>,
    /// The image is the one a migration just received, restored before it is synced
    /// ([`crate::wire::Durability::Later`]): its [`crate::wire::UNSYNCED`] does not refuse it.
    pub received_unsynced: bool,
    /// The job's GPU images a migration's destination loaded ahead ([`crate::prestage`]): the
    /// stages build on them.
    pub prestaged: Vec<crate::prestage::Prestaged>,
    /// A migration's post-copy: pieces of the GPU images still to come ([`crate::postcopy`]).
    /// Each GPU image's stage waits for those of its own; without a stage of every GPU image,
    /// the job is resumed only once all came.
    pub post_copy: Option<std::sync::Arc<crate::postcopy::PostCopy>>,
}

/// A restore made: what the command prints.
#[derive(Debug, Serialize)]
pub struct RestoreReport {
    /// The job.
    pub pid: i32,
    /// Who took the GPU side at the checkpoint.
    pub engine: Engine,
    /// The GPU runtime the job ran on (absent: CUDA).
    #[serde(skip_serializing_if = "GpuRuntime::is_cuda")]
    pub runtime: GpuRuntime,
    /// The image directory.
    pub dir: PathBuf,
    /// The figures.
    pub figures: RestoreFigures,
    /// Directories of the tree's unix sockets made again.
    pub recreated_socket_dirs: Vec<PathBuf>,
    /// A keeper started for the restored job (its directory).
    pub keeper_started: Option<PathBuf>,
    /// The job's standard descriptors given this command's.
    pub stdio_from_restore: Vec<i32>,
    /// Those given `/dev/null`.
    pub stdio_discarded: Vec<i32>,
    /// The keeper still held the job's buffers: mapped again, nothing copied.
    pub gpu_from_keeper: bool,
    /// The keeper's stages of the GPU images.
    pub staged: Vec<StageReport>,
    /// Buffers copied GPU to GPU from the job's old GPU (`--device`).
    pub peer_buffers: u64,
    /// Why nothing was staged.
    pub stage_skipped: Option<String>,
    /// Buffers of the stages the restored processes took.
    pub staged_buffers_mapped: u64,
    /// The root's answer to the resume.
    pub resume_report: Option<Reply<ResumeReply>>,
    /// The established TCP connections the image holds were restored closed (`--tcp-close`).
    pub tcp_closed: bool,
    /// The image has possum's GPU images (engine possum).
    #[serde(skip)]
    pub has_gpu: bool,
    /// The directory of the restored job's control socket.
    #[serde(skip)]
    pub socket_dir: PathBuf,
}

/// Restores the job of the image `p.dir` names, in phases: open, prepare, stage, CRIU's
/// restore, keeper, driver and resume, report. A failure after CRIU's restore kills the
/// restored process; the image is never changed. `obs` is told what the user should know.
pub fn restore(p: &RestoreParams, obs: &mut dyn Observer) -> Result<RestoreReport, RestoreError> {
    restore_confirmed(p, obs, &mut |_| Ok(()))
}

/// [`restore`], the job held after CRIU's restore until `confirm(pid)` says it may run: its GPU
/// work has not run yet then (its GPU side is not restored, its possum not resumed: its threads
/// wait at their next GPU call). A refusal (`Err`:
/// why) kills the restored process, the image intact ([`RestoreError::NotConfirmed`]). A
/// migration's destination asks its source here, so that the job never runs at both ends.
pub fn restore_confirmed(
    p: &RestoreParams,
    obs: &mut dyn Observer,
    confirm: &mut dyn FnMut(i32) -> Result<(), String>,
) -> Result<RestoreReport, RestoreError> {
    let opened = open(p)?;
    let took = opened.took;
    let mut report = restore_opened(p, opened, obs, confirm)?;
    report.figures.prepare += took;
    report.figures.total += took;
    Ok(report)
}

/// What a restore reads and finds before it acts on the host ([`open`]): the image, CRIU,
/// NVIDIA's driver and nvidia-smi's answer to come. A migration's destination makes it while
/// its source kills the job.
pub struct Opened {
    img: Image,
    tools: Tools,
    /// How long opening took.
    took: Duration,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (f.debug_struct("Opened"))
            .field("criu", &self.img.criu)
            .field("took", &self.took)
            .finish_non_exhaustive()
    }
}

/// nvidia-smi's answer to come: each GPU's index, UUID and free MiB ([`ask_gpus`]).
type GpusAsked = JoinHandle<Option<Vec<(u32, String, u64)>>>;

/// CRIU, NVIDIA's driver checkpoint and nvidia-smi's answer (for a CUDA job's image with GPU
/// memory), as the prepare phase takes them.
struct Tools {
    criu: Result<Criu, CriuError>,
    drv: Option<Result<DriverCheckpoint, DriverCkptError>>,
    gpus: Option<GpusAsked>,
    /// The job's standard descriptors, planned.
    stdio: std::io::Result<StdioPlan>,
    /// CRIU's restore made ready with that plan (none where CRIU or the plan is missing, or
    /// its worker did not start: the restore then starts one).
    worker: Option<PreparedRestore>,
}

/// Opens the image `p.dir` names for a restore, acting on nothing of the job's: authenticated
/// first under `--hmac-key`, read, CRIU found (its cache of the kernel's features primed) and its
/// restore's worker started, waiting ([`possum_criu::restore::PreparedRestore`]; the job's
/// standard descriptors planned for it), NVIDIA's driver loaded, nvidia-smi asked on a thread
/// (its answer is taken by the prepare phase).
pub fn open(p: &RestoreParams) -> Result<Opened, RestoreError> {
    let t = Instant::now();
    if let Some(key) = &p.hmac_key {
        if !p.dir.exists() {
            return Err(ImageError::NoDirectory { dir: p.dir.clone() }.into());
        }
        crate::auth::verify(&p.dir, key)?;
    }
    let img = match p.received_unsynced {
        true => crate::image::open_received_image(&p.dir)?,
        false => open_image(&p.dir)?,
    };
    let m = &img.manifest;
    let nvidia = m.runtime.has_nvidia_driver();
    let gpus = (nvidia && !m.gpu_memory.is_empty()).then(|| ask_gpus(m.keeper.as_ref(), &p.env));
    let criu = Criu::locate();
    // (Where its cache was made before, a few small reads: CRIU then skips its probe.)
    if let Ok(c) = &criu {
        let _ = c.prime_kdat();
    }
    let drv = nvidia.then(|| (p.env.driver_deadlines).load(&p.env.libcuda));
    let stdio = StdioPlan::new(&m.stdio_pipes);
    let worker = match (&criu, &stdio) {
        (Ok(c), Ok(plan)) => c.prepare_restore(&criu_options(&img.criu, plan)).ok(),
        _ => None,
    };
    Ok(Opened {
        img,
        tools: Tools {
            criu,
            drv,
            gpus,
            stdio,
            worker,
        },
        took: t.elapsed(),
    })
}

/// CRIU's options for the restore of the images in `criu`, the job's standard descriptors as
/// `stdio` plans (the rest is set by the prepare phase).
fn criu_options(criu: &Path, stdio: &StdioPlan) -> RestoreOptions {
    let mut opts = RestoreOptions::new(criu);
    opts.inherit_fds = stdio.inherit.clone();
    opts
}

/// [`restore_confirmed`] of an image already [`open`]ed: its time is not in the figures'
/// `prepare_ms` and `total_ms` (a migration's destination opens it while its source kills the
/// job), but in `open_ms`.
pub fn restore_opened(
    p: &RestoreParams,
    opened: Opened,
    obs: &mut dyn Observer,
    confirm: &mut dyn FnMut(i32) -> Result<(), String>,
) -> Result<RestoreReport, RestoreError> {
    let t_all = Instant::now();
    let Opened {
        img,
        mut tools,
        took,
    } = opened;
    let m = &img.manifest;
    let ids = tree_ids(&img.criu, m.pid);
    // A worker made ready under a PID the job needs (another host's numbers) ends first.
    if (tools.worker.as_ref()).is_some_and(|w| w.pids().iter().any(|p| ids.contains(p))) {
        tools.worker = None;
    }
    check_pids_free(&ids)?;
    let mut ready = prepare(p, &img, tools, obs)?;
    let mut figures = RestoreFigures {
        open: Some(took),
        prepare: t_all.elapsed(),
        ..RestoreFigures::default()
    };
    let (mut staging, stage_skipped) = begin_staging(p, &img, &ready, &mut figures);
    let job = criu_restore(&mut ready, m.pid, &mut staging, &mut figures)?;
    // A job whose buffer memory was a keeper's gets one again where it looks for it, before it
    // resumes (the keeper sees the job's CUDA_VISIBLE_DEVICES; a job moved by `--device` finds
    // the socket serving its new GPU by UUID). Started after CRIU's restore, so that it cannot
    // take the job's PID (unless the staging started it before).
    let keeper_started = match (&m.keeper, &staging) {
        (_, Some(s)) if s.started_keeper() => Some(s.keeper_dir().to_path_buf()),
        (Some(k), _) => timed(&mut figures.keeper, || start_keeper_for(p, k, m.pid)),
        _ => None,
    };
    if let Err(why) = confirm(job.pid()) {
        let _ = job.kill_tree();
        if let Some(s) = staging {
            s.abandon();
        }
        return Err(RestoreError::NotConfirmed { pid: m.pid, why });
    }
    if let Err(why) = post_copy_ready(p, &mut staging, obs) {
        let _ = job.kill_tree();
        if let Some(s) = staging {
            s.abandon();
        }
        return Err(RestoreError::PostCopy { pid: m.pid, why });
    }
    let resumed = match resume(p, &img, &ready, &mut figures) {
        Ok(r) => r,
        Err(source) => {
            // A half-restored job is of no use to anyone: it must not linger, locked. Killed
            // through the pidfd of the process CRIU restored, verified after its restore, with
            // every process below it.
            let _ = job.kill_tree();
            if let Some(s) = staging {
                s.abandon();
            }
            return Err(RestoreError::Resume { pid: m.pid, source });
        }
    };
    let mut report = RestoreReport {
        pid: job.pid(),
        engine: m.engine,
        runtime: m.runtime,
        dir: p.dir.clone(),
        figures,
        recreated_socket_dirs: ready.recreated,
        keeper_started,
        stdio_from_restore: ready.stdio.from_restore,
        stdio_discarded: ready.stdio.discarded,
        gpu_from_keeper: false,
        staged: Vec::new(),
        peer_buffers: 0,
        stage_skipped,
        staged_buffers_mapped: 0,
        resume_report: None,
        tcp_closed: ready.opts.tcp_close,
        has_gpu: img.gpu.is_some(),
        socket_dir: ready.sockets.clone(),
    };
    report.account(resumed, staging, &img.criu.join(&ready.opts.log_file));
    report.figures.total = t_all.elapsed();
    Ok(report)
}

/// A post-copy's pieces still to come ([`RestoreParams::post_copy`]): fine if every GPU image's
/// stage waits for those of its own; otherwise waits until all came (the job's own restore
/// reads the image), and fails if they will not.
fn post_copy_ready(
    p: &RestoreParams,
    staging: &mut Option<Staging>,
    obs: &mut dyn Observer,
) -> Result<(), String> {
    let Some(pc) = &p.post_copy else {
        return Ok(());
    };
    if staging.as_mut().is_some_and(|s| s.all_staged()) {
        return pc.failed().map_or(Ok(()), Err);
    }
    obs.note(
        "post-copy: the job's GPU images are not all staged by a keeper here, so the job \
         runs only once every piece of them came",
    );
    pc.wait()
}

/// How long the restored job `pid` (its control socket in `socket_dir`) waited for buffers not
/// yet back after it ran again, once they are all back: its own account (`possum status`'s
/// `session.last.restore`, the longest of its devices'). `None` when it did not say within
/// `limit` (its buffers still coming back, or it ended), or restored nothing on demand.
pub fn waited_after_resume(pid: i32, socket_dir: &Path, limit: Duration) -> Option<Duration> {
    job_waited_of(&job::finished_restore(pid, socket_dir, limit)?)
}

/// `job_waited_ms` of a restore's figures as the job gives them: one device's object, or a list
/// of them (the longest).
fn job_waited_of(v: &serde_json::Value) -> Option<Duration> {
    let ms = |v: &serde_json::Value| v.get("job_waited_ms").and_then(serde_json::Value::as_f64);
    let longest = match v {
        serde_json::Value::Array(all) => all.iter().filter_map(ms).reduce(f64::max),
        one => ms(one),
    }?;
    Some(Duration::from_secs_f64(longest.max(0.0) / 1e3))
}

/// How long a restore waits for the parent of the job's ended process to reap it (a parent
/// that waits for its children does at once).
const UNREAPED_GRACE: Duration = Duration::from_secs(2);

/// How long a restore waits for a process of the job's that is still ending: one killed a
/// moment ago (a checkpoint that killed the job, a `kill -9`) holds its PID until the kernel has
/// torn it down, which for a process with a GPU context takes a while.
const ENDING_GRACE: Duration = Duration::from_secs(10);

/// Every PID and thread ID of the image's tree, the root `root` first: CRIU restores each under
/// its old number (CRIU's `pstree.img`; the root alone when that cannot be read, which CRIU's
/// restore then reports itself).
fn tree_ids(criu: &Path, root: i32) -> Vec<i32> {
    let entries = possum_criu::images::read_messages::<possum_criu::images::PstreeEntry>(
        &criu.join("pstree.img"),
        possum_criu::images::PSTREE_MAGIC,
    )
    .unwrap_or_default();
    let mut ids = vec![root];
    for e in entries {
        for id in std::iter::once(e.pid).chain(e.threads) {
            if let Ok(id) = i32::try_from(id) {
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
    }
    ids
}

/// The job's PIDs and thread IDs `ids` are free for CRIU's restore: no process holds one, or
/// the one that does is ending and has ended within [`ENDING_GRACE`], and is reaped within
/// [`UNREAPED_GRACE`]. A process that runs (not ending) is refused at once.
fn check_pids_free(ids: &[i32]) -> Result<(), RestoreError> {
    let t = Instant::now();
    loop {
        let live = ids
            .iter()
            .copied()
            .find(|&id| matches!(pid_taken(id), Some(PidTaken::Live { .. })));
        match live {
            None => break,
            Some(id) if ending(id) && t.elapsed() < ENDING_GRACE => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Some(id) => return Err(RestoreError::Running { pid: id }),
        }
    }
    wait_pids_free(ids, UNREAPED_GRACE).map_err(|e| match e {
        PidTaken::Live { pid } => RestoreError::Running { pid },
        PidTaken::Unreaped { pid, parent } => RestoreError::Unreaped { pid, parent },
    })
}

/// A restore that failed, by the phase that failed.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The image is not one to restore.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// `--hmac-key`: the image is not authenticated under the key.
    #[error(transparent)]
    Auth(#[from] crate::auth::AuthError),
    /// One of its PIDs (or thread IDs) is taken.
    #[error(
        "process {pid} is running: CRIU restores the job under its old PIDs and thread IDs, which \
         must be free (kill the original first, or restore on another machine)"
    )]
    Running {
        /// The job's PID.
        pid: i32,
    },
    /// Its PID is held by a process that ended and that its parent has not reaped.
    #[error(
        "process {pid} has ended, but its parent (process {parent}) has not reaped it within \
         {} s: CRIU restores the job under PID {pid}, which stays taken until the parent does \
         (restore once it has)",
        UNREAPED_GRACE.as_secs()
    )]
    Unreaped {
        /// The job's PID.
        pid: i32,
        /// The parent that holds it.
        parent: i32,
    },
    /// What the restore needs is missing, or the GPUs cannot take the job.
    #[error(transparent)]
    Prepare(#[from] PrepareError),
    /// CRIU's restore.
    #[error(transparent)]
    Criu(#[from] CriuError),
    /// CRIU's restore, failed binding an established TCP connection of the image back to its
    /// address: not this host's, or taken.
    #[error(
        "an established TCP connection of the job could not be bound back to its address, \
         which is not this host's or is taken (a restore or a migration onto another host): \
         restore with --tcp-close (possum receive: POSSUM_RESTORE_TCP_CLOSE=1) to bring the \
         job's established connections back closed"
    )]
    TcpNotHere(#[source] CriuError),
    /// The process CRIU reports as restored is not one possum can verify as the restored job:
    /// it is left alone (never signalled).
    #[error("CRIU's restore reported process {pid}, which is not verified as the restored job")]
    NotRestored {
        /// The PID CRIU reported.
        pid: i32,
        /// Why.
        #[source]
        source: SignalError,
    },
    /// CRIU's restore, twice.
    #[error("CRIU's restore failed twice (first with a keeper started for staging: {first})")]
    CriuTwice {
        /// The first failure.
        first: String,
        /// The second.
        #[source]
        source: Box<CriuError>,
    },
    /// The restore was not confirmed ([`restore_confirmed`]): the restored process was killed
    /// before it ran.
    #[error(
        "process {pid} was restored but not let run ({why}); it was killed before it ran, the \
         image is intact"
    )]
    NotConfirmed {
        /// The job.
        pid: i32,
        /// Why.
        why: String,
    },
    /// A migration's post-copy failed before the job ran: the restored process was killed.
    #[error(
        "process {pid} was restored, but the pieces of its GPU images sent after the transfer \
         did not all come ({why}); it was killed before it ran"
    )]
    PostCopy {
        /// The job.
        pid: i32,
        /// Why.
        why: String,
    },
    /// The GPU side: the restored process was killed.
    #[error(
        "restore of process {pid} failed; the restored process was killed, the image is intact"
    )]
    Resume {
        /// The job.
        pid: i32,
        /// What failed.
        #[source]
        source: ResumeError,
    },
}

/// The restore cannot start: nothing was done.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// No CRIU.
    #[error("CRIU is needed for the CPU side")]
    NoCriu(#[source] CriuError),
    /// No driver checkpoint.
    #[error("NVIDIA's driver checkpoint is needed")]
    NoDriver(#[source] DriverCkptError),
    /// `--device` for the image of a HIP job.
    #[error(
        "--device moves a job to another NVIDIA GPU (nvidia-smi's index, NVIDIA's driver \
         restore); {} is of a HIP job, which is restored on the GPUs it had",
        dir.display()
    )]
    DeviceForHip {
        /// The image directory.
        dir: PathBuf,
    },
    /// The GPUs (free memory, `--device`).
    #[error(transparent)]
    Gpus(#[from] crate::image::GpuError),
    /// The image's GPU images could not be read.
    #[error(transparent)]
    Buffers(anyhow::Error),
    /// Memory only possum's CRIU plugin restores, and no plugin.
    #[error(
        "{} holds memory only possum's CRIU plugin restores, and no plugin was found \
         (POSSUM_CRIU_PLUGIN_DIR, or criu-plugins/{} beside the possum executable)",
        criu_dir.display(),
        possum_criu::PLUGIN_FILE
    )]
    NoPlugin {
        /// CRIU's images.
        criu_dir: PathBuf,
    },
    /// CRIU's images could not be read.
    #[error(transparent)]
    Split(#[from] possum_criu::hostmem::HostMemError),
    /// A host path the image names, which the restore does not act on (a stale socket that is
    /// not one, a directory outside possum's places).
    #[error(transparent)]
    Place(#[from] PlaceError),
    /// A file CRIU writes in the image's CRIU directory is not a plain file of the image.
    #[error(
        "{} is {kind}: CRIU writes it during the restore, and it must be absent or a plain file \
         of the image",
        path.display()
    )]
    CriuOutput {
        /// The file.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// `/dev/null` could not be opened.
    #[error("opening /dev/null for the job's standard descriptors")]
    DevNull(#[source] std::io::Error),
}

/// What the prepare phase made ready.
struct Ready {
    criu: Criu,
    /// NVIDIA's driver checkpoint (a CUDA job's image; none for a HIP job's).
    drv: Option<DriverCheckpoint>,
    /// The driver's GPU remapping (`--device`; empty: the same GPUs).
    pairs: UuidPairs,
    kept: KeptBuffers,
    sockets: PathBuf,
    recreated: Vec<PathBuf>,
    stdio: StdioPlan,
    opts: RestoreOptions,
    /// CRIU's worker made ready for `opts` ([`open`]), taken by the restore.
    worker: Option<PreparedRestore>,
}

/// Prepare: the host paths the image names checked ([`HostPlan`]: nothing is done on the host
/// for an image that names a place possum must not act on), CRIU and the driver found, the GPUs
/// checked for room (nvidia-smi answers while the rest is made ready; its verdict still comes
/// before anything is started), the job's old control sockets removed, the directories of its
/// tree's sockets made again, and its standard descriptors planned. Nothing of the job is
/// started. A HIP job's image needs neither NVIDIA's driver nor nvidia-smi.
fn prepare(
    p: &RestoreParams,
    img: &Image,
    tools: Tools,
    obs: &mut dyn Observer,
) -> Result<Ready, PrepareError> {
    let m = &img.manifest;
    let nvidia = m.runtime.has_nvidia_driver();
    if !nvidia && p.device.is_some() {
        return Err(PrepareError::DeviceForHip { dir: p.dir.clone() });
    }
    // The host directories the image names are used only where possum's own are allowed.
    let host = HostPlan::check(p, img)?;
    let Tools {
        criu,
        drv,
        gpus,
        stdio,
        worker,
    } = tools;
    // Buffers a keeper held are not the job's in nvidia-smi's count: a move needs room for them,
    // and so does a restore on the job's own GPU unless the keeper still holds them there.
    let kept = if m.keeper.is_some() {
        KeptBuffers {
            mib: img.buffer_mib().map_err(PrepareError::Buffers)?,
            held: stage::keeper_holds(m),
        }
    } else {
        KeptBuffers::default()
    };
    let criu = criu.map_err(PrepareError::NoCriu);
    let drv = drv.map(|d| d.map_err(PrepareError::NoDriver));
    let pairs = if nvidia {
        let smi = || gpus.and_then(|t| t.join().ok()).flatten();
        plan_gpus(m, p.device, kept, smi, obs).map_err(PrepareError::Gpus)?
    } else {
        UuidPairs::new()
    };
    let (criu, drv) = (criu?, drv.transpose()?);
    refuse_split_without_plugin(&img.criu, &criu)?;
    // The killed job's socket files are still there; the restored job listens on them again.
    for s in host.stale {
        s.remove()?;
    }
    let recreated = recreate_socket_dirs(&host.places, &host.missing_dirs, m.owner)?;
    let stdio = stdio.map_err(PrepareError::DevNull)?;
    let mut opts = criu_options(&img.criu, &stdio);
    opts.log_file = host.criu_log;
    opts.shell_job = m.shell_job;
    opts.ext_unix_sk = true;
    restore_tcp(&mut opts, m.tcp_established, p.env.tcp_close);
    if let Some(l) = p.env.criu_log_level {
        opts.log_level = l;
    }
    Ok(Ready {
        criu,
        drv,
        pairs,
        kept,
        sockets: host.sockets,
        recreated,
        stdio,
        opts,
        worker,
    })
}

/// CRIU restores the established TCP connections the image's dump took (`dumped`, the lock
/// method it used), locking the network the same way; or, `close` (`--tcp-close`), restores
/// them closed: each socket unconnected and shut down, its peer reset at its next packet.
fn restore_tcp(opts: &mut RestoreOptions, dumped: Option<NetworkLock>, close: bool) {
    match dumped {
        Some(_) if close => opts.tcp_close = true,
        Some(lock) => {
            opts.tcp_established = true;
            opts.network_lock = Some(lock.into());
        }
        None => {}
    }
}

/// Makes the missing directories of the tree's sockets again (mode 0700, with their missing
/// parents), each the job's (`owner`, from the image) as the job had made it: the restored job
/// binds its sockets there as its own user. Those made.
fn recreate_socket_dirs(
    places: &Places,
    missing: &[PathBuf],
    owner: Option<JobOwner>,
) -> Result<Vec<PathBuf>, PlaceError> {
    let owner = owner.map(|o| (o.uid, o.gid));
    let mut made = Vec::new();
    for d in missing {
        if places.create_dir_for(SOCKETS_DIR, d, owner)? {
            made.push(d.clone());
        }
    }
    Ok(made)
}

/// Memory `possum checkpoint` took out of CRIU's images is written back only by possum's CRIU
/// plugin, and CRIU checks that a required plugin is loaded only when it loads plugins at all.
fn refuse_split_without_plugin(criu_dir: &Path, criu: &Criu) -> Result<(), PrepareError> {
    if !criu.has_possum_plugin() && possum_criu::hostmem::is_split(criu_dir)? {
        return Err(PrepareError::NoPlugin {
            criu_dir: criu_dir.to_path_buf(),
        });
    }
    Ok(())
}

/// nvidia-smi's GPUs, asked on a thread (tens of ms). The job's keeper first frees the memory of
/// processes that are gone (the job's, killed a moment ago, is otherwise freed within the
/// keeper's periodic check, and nvidia-smi would count it as taken).
fn ask_gpus(keeper: Option<&KeeperOfJob>, env: &Environment) -> GpusAsked {
    let keeper_dir = keeper.map(|k| k.dir.clone());
    let smi_bin = env.nvidia_smi.clone();
    std::thread::spawn(move || {
        if let Some(dir) = keeper_dir {
            stage::reap(&dir);
        }
        smi::gpus(&smi_bin)
    })
}

/// The statistics file CRIU writes in its images directory at the end of a restore.
const CRIU_STATS: &str = "stats-restore";

/// CRIU (as root) creates or truncates its log and statistics in the image's CRIU directory,
/// following links: each must be absent, or a regular file with no other name (a link, or a
/// hard link to a file elsewhere, would have CRIU write over that file).
fn refuse_criu_output_link(path: &Path) -> Result<(), PrepareError> {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = fs::symlink_metadata(path) else {
        return Ok(());
    };
    let kind = if meta.file_type().is_symlink() {
        "a symbolic link"
    } else if !meta.file_type().is_file() {
        "not a regular file"
    } else if meta.nlink() > 1 {
        "a file with other names (hard links)"
    } else {
        return Ok(());
    };
    Err(PrepareError::CriuOutput {
        path: path.to_path_buf(),
        kind,
    })
}

/// What a restore does on the host for the image, checked before anything is done: the host
/// directories `possum.json` names are acted on only as [`Places`] allows.
struct HostPlan {
    places: Places,
    /// The job's control socket directory (`--socket-dir`, else the one recorded).
    sockets: PathBuf,
    /// The stale control sockets of the job's possum processes, to remove.
    stale: Vec<crate::places::StaleSocket>,
    /// The directories of the tree's sockets that are missing, to make (CRIU binds the tree's
    /// unix sockets at their paths again: a job that ended, or another machine, may not have
    /// them).
    missing_dirs: Vec<PathBuf>,
    /// CRIU's log's name in the image's CRIU directory.
    criu_log: String,
}

/// What the directories of the tree's sockets are, in messages.
const SOCKETS_DIR: &str = "the directory of the job's sockets";

impl HostPlan {
    fn check(p: &RestoreParams, img: &Image) -> Result<HostPlan, PrepareError> {
        let m = &img.manifest;
        // The job's socket directory as given, or as a migration's source named it.
        let given = p.socket_dir.clone().or_else(|| {
            let named = &m.socket_dir;
            (p.socket_dir_from_source && named.is_absolute()).then(|| named.clone())
        });
        let places = Places::of_environment(given.as_deref());
        if let Some(k) = &m.keeper {
            places.check_dir("the keeper's directory", &k.dir)?;
        }
        let sockets = given.unwrap_or_else(|| m.socket_dir.clone());
        let mut stale = Vec::new();
        if img.gpu.is_some() {
            for pid in std::iter::once(&m.pid).chain(&m.possum_children) {
                stale.extend(places.stale_socket(&sockets, *pid)?);
            }
        }
        let missing_dirs: Vec<PathBuf> = (m.socket_dirs.iter())
            .filter(|d| !d.exists())
            .cloned()
            .collect();
        for d in &missing_dirs {
            places.check_dir(SOCKETS_DIR, d)?;
        }
        let criu_log = format!("restore-{}.log", std::process::id());
        for name in [criu_log.as_str(), CRIU_STATS] {
            refuse_criu_output_link(&img.criu.join(name))?;
        }
        Ok(HostPlan {
            places,
            sockets,
            stale,
            missing_dirs,
            criu_log,
        })
    }
}

/// Stage: the keeper loads the GPU images while CRIU restores the process. The staging, or why
/// there is none.
fn begin_staging(
    p: &RestoreParams,
    img: &Image,
    ready: &Ready,
    figures: &mut RestoreFigures,
) -> (Option<Staging>, Option<String>) {
    // `--device`: the job's GPU moves to another (the driver's first pair; none for its own).
    let moved = ready.pairs.first().copied();
    let on = p.env.restore_stage;
    match stage::plan(
        &img.manifest,
        img.gpu.as_deref(),
        moved,
        ready.kept.held,
        on,
    ) {
        Ok(plan) => match timed(&mut figures.stage_begin, || {
            Staging::begin(img, plan, &p.possum_exe, &p.prestaged, p.post_copy.clone())
        }) {
            Ok(s) => (Some(s), None),
            Err(e) => (None, Some(format!("the keeper could not be asked: {e:#}"))),
        },
        Err(why) => (None, Some(why)),
    }
}

/// CRIU's restore of the process tree. A keeper started for the staging may hold a PID of the
/// job's: without it, once more. The restored root, held by a pidfd once verified to be the
/// process CRIU restored as the job `job` ([`Process::restored`]): every signal of the restore
/// goes through it.
fn criu_restore(
    ready: &mut Ready,
    job: i32,
    staging: &mut Option<Staging>,
    figures: &mut RestoreFigures,
) -> Result<Process, RestoreError> {
    let since = boot_ticks_now();
    let worker = ready.worker.take();
    figures.criu_ready = worker.as_ref().map(PreparedRestore::took);
    let report = match timed(&mut figures.criu_restore, || match worker {
        Some(w) => w.run(&ready.opts),
        None => ready.criu.restore(&ready.opts),
    }) {
        Ok(r) => r,
        Err(e) => match staging.take() {
            Some(s) if s.started_keeper() => {
                s.abandon();
                let first = format!("{:#}", anyhow::Error::from(e));
                timed(&mut figures.criu_restore_again, || {
                    ready.criu.restore(&ready.opts)
                })
                .map_err(|source| RestoreError::CriuTwice {
                    first,
                    source: Box::new(source),
                })?
            }
            Some(s) => {
                s.abandon();
                return Err(criu_failed(e));
            }
            None => return Err(criu_failed(e)),
        },
    };
    figures.criu_restore_stats = report.stats.map(Into::into);
    Process::restored(report.pid, job, since).map_err(|source| RestoreError::NotRestored {
        pid: report.pid,
        source,
    })
}

/// CRIU's restore failed: why, in the user's terms where possum knows them.
fn criu_failed(e: CriuError) -> RestoreError {
    if e.is_tcp_bind_back_refused() {
        RestoreError::TcpNotHere(e)
    } else {
        RestoreError::Criu(e)
    }
}

/// Starts a keeper where the restored job `pid` looks for its keeper, unless one answers there:
/// seeing the job's `CUDA_VISIBLE_DEVICES`, ending when the job does, left running when possum
/// exits. Its directory once it listens; `None` if none was needed or it did not start (the job
/// then uses memory of its own, and says so in `possum status`).
fn start_keeper_for(p: &RestoreParams, k: &KeeperOfJob, pid: i32) -> Option<PathBuf> {
    k.ensure_keeper(&p.possum_exe, pid, &[])
        .ok()
        .flatten()
        .map(|_| k.dir.clone())
}

/// The restored tree's GPU side: the driver restores (onto the GPUs of `--device`) and unlocks
/// each CUDA process (a CUDA job's; a HIP job has no driver to call), and possum resumes each of
/// its processes from the GPU images, their buffers back on demand. The answers of the root,
/// then of the others.
fn resume(
    p: &RestoreParams,
    img: &Image,
    ready: &Ready,
    figures: &mut RestoreFigures,
) -> Result<Vec<Reply<ResumeReply>>, ResumeError> {
    let m = &img.manifest;
    if let Some(drv) = &ready.drv {
        // The job's GPU memory at its checkpoint (nvidia-smi's, all of its GPUs): what the
        // driver moves back, for its deadline.
        let limit = (p.env.driver_deadlines.restore).for_bytes(m.gpu_memory_bytes());
        timed(&mut figures.resumed.driver_restore, || {
            drv.restore(m.pid, &ready.pairs, limit)?;
            for &c in &m.cuda_children {
                drv.restore(c, &ready.pairs, limit)
                    .map_err(|error| ResumeError::DriverChild { pid: c, error })?;
            }
            Ok::<_, ResumeError>(())
        })?;
        timed(&mut figures.resumed.driver_unlock, || {
            std::iter::once(&m.pid)
                .chain(&m.cuda_children)
                .try_for_each(|&pid| drv.unlock(pid))
        })?;
    }
    let Some(gpu) = &img.gpu else {
        return Ok(Vec::new());
    };
    let mut replies = Vec::new();
    let processes = std::iter::once((m.pid, gpu.clone())).chain(
        (m.possum_children.iter()).map(|&c| (c, p.dir.join(crate::image::child_gpu_dir(c)))),
    );
    for (pid, dir) in processes {
        let dir = dir.display().to_string();
        let r = timed(&mut figures.resumed.resume, || {
            job::resume(pid, To::Sockets(&ready.sockets), dir, None)
        });
        match r {
            Ok(r) => replies.push(r),
            Err(e) if pid == m.pid => return Err(e.into()),
            Err(source) => return Err(ResumeError::Child { pid, source }),
        }
    }
    Ok(replies)
}

impl RestoreReport {
    /// Report: the stages the restored processes took, from their resume answers (those none
    /// took, a device without the keeper's memory, ..., are ended now: their memory would
    /// otherwise stay retained for a live process), and what possum's CRIU plugin wrote back
    /// (from CRIU's log `log`).
    fn account(&mut self, resumed: Vec<Reply<ResumeReply>>, staging: Option<Staging>, log: &Path) {
        let taken: Vec<_> = resumed.iter().flat_map(|r| &r.body.staged).collect();
        let used: Vec<u64> = taken.iter().map(|s| s.stage).collect();
        self.staged_buffers_mapped = taken.iter().map(|s| s.buffers).sum();
        self.staged = staging.map(|s| s.finish_keeping(&used)).unwrap_or_default();
        // Buffers copied GPU to GPU from the job's old GPU (`--device`) into the stages it took.
        self.peer_buffers = (self.staged.iter())
            .filter(|s| !s.unused)
            .map(|s| s.peer_buffers)
            .sum();
        let fills = fs::read_to_string(log)
            .map(|log| possum_criu::hostmem::fills_in_log(&log))
            .unwrap_or_default();
        if !fills.is_empty() {
            self.figures.hostmem_fill_ms = Some(fills.iter().map(|f| f.2).sum());
            self.figures.hostmem_fill_bytes = Some(fills.iter().map(|f| f.1).sum());
        }
        // Buffers coming back on demand as the job runs: its waits for them are not known yet.
        let on_demand = resumed
            .iter()
            .any(|r| r.body.on_demand == Some(true) && !r.body.restoring.is_empty());
        self.figures.job_waited = (!on_demand).then_some(Duration::ZERO);
        self.resume_report = resumed.into_iter().next();
        // Buffers the keeper still held (a job killed on this host): mapped again, nothing copied.
        self.gpu_from_keeper = self
            .resume_report
            .as_ref()
            .is_some_and(|r| !r.body.attached.is_empty());
    }
}

/// What a restored job's standard descriptors that were pipes to outside its tree become: this
/// command's descriptor of the same number (a terminal, a file: where the user runs the restore),
/// or `/dev/null` when that is itself a pipe or closed (a script capturing this command's output
/// would otherwise wait for the job to end, and `--json` would mix the job's output into it).
#[derive(Debug)]
struct StdioPlan {
    /// CRIU's `inherit_fd`: (the pipe's name in the image, a descriptor here).
    inherit: Vec<(String, std::os::fd::RawFd)>,
    /// The job's descriptors given this command's.
    from_restore: Vec<i32>,
    /// The job's descriptors given `/dev/null`.
    discarded: Vec<i32>,
    /// The `/dev/null`s, open until CRIU has restored the job.
    _null: Vec<fs::File>,
}

impl StdioPlan {
    fn new(pipes: &[(i32, String)]) -> std::io::Result<StdioPlan> {
        use std::os::fd::AsRawFd;
        let mut plan = StdioPlan {
            inherit: Vec::new(),
            from_restore: Vec::new(),
            discarded: Vec::new(),
            _null: Vec::new(),
        };
        for (fd, key) in pipes {
            let ours = fs::read_link(format!("/proc/self/fd/{fd}")).ok();
            let usable = ours
                .as_ref()
                .and_then(|t| t.to_str())
                .is_some_and(|t| !t.starts_with("pipe:["));
            if usable {
                plan.inherit.push((key.clone(), *fd));
                plan.from_restore.push(*fd);
            } else {
                let null = fs::OpenOptions::new()
                    .read(*fd == 0)
                    .write(*fd != 0)
                    .open("/dev/null")?;
                plan.inherit.push((key.clone(), null.as_raw_fd()));
                plan.discarded.push(*fd);
                plan._null.push(null);
            }
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_s_wait_after_resume_is_read_from_its_restore_figures() {
        let one = serde_json::json!({"device": 0, "job_waited_ms": 412.5});
        assert_eq!(job_waited_of(&one), Some(Duration::from_micros(412_500)));
        let two = serde_json::json!([{"job_waited_ms": 3.0}, {"job_waited_ms": 40.0}, {}]);
        assert_eq!(job_waited_of(&two), Some(Duration::from_millis(40)));
        assert_eq!(job_waited_of(&serde_json::json!({"device": 0})), None);
    }

    #[test]
    fn the_restore_takes_the_dumps_tcp_connections_and_lock() {
        let mut opts = RestoreOptions::new("/img/criu");
        restore_tcp(&mut opts, None, true);
        assert!(!opts.tcp_established && !opts.tcp_close);
        assert_eq!(opts.network_lock, None);
        restore_tcp(&mut opts, Some(NetworkLock::Iptables), false);
        assert!(opts.tcp_established && !opts.tcp_close);
        assert_eq!(
            opts.network_lock,
            Some(possum_criu::NetworkLockMethod::Iptables)
        );
        // Closed: nothing of them is restored, nothing locked.
        let mut opts = RestoreOptions::new("/img/criu");
        restore_tcp(&mut opts, Some(NetworkLock::Iptables), true);
        assert!(opts.tcp_close && !opts.tcp_established);
        assert_eq!(opts.network_lock, None);
    }

    /// A missing socket directory of an image whose job ran as uid 65534 is made again as
    /// that user's, mode 0700, its missing parent too; without an owner it is the restoring
    /// user's.
    #[test]
    fn a_missing_socket_directory_is_made_again_as_the_job_s() {
        use std::os::unix::fs::MetadataExt;
        let tmp = tempfile::tempdir().unwrap();
        let places = Places::new(Vec::new(), vec![tmp.path().to_path_buf()]);
        let parent = tmp.path().join("run");
        let dir = parent.join("sockets");
        let nobody = JobOwner {
            uid: 65534,
            gid: 65534,
        };
        let made = recreate_socket_dirs(&places, std::slice::from_ref(&dir), Some(nobody)).unwrap();
        assert_eq!(made, vec![dir.clone()]);
        for d in [&dir, &parent] {
            let meta = fs::metadata(d).unwrap();
            if nix::unistd::geteuid().is_root() {
                assert_eq!((meta.uid(), meta.gid()), (65534, 65534), "{}", d.display());
            }
            assert_eq!(meta.mode() & 0o777, 0o700, "{}", d.display());
        }
        // There now: left as it is.
        let again =
            recreate_socket_dirs(&places, std::slice::from_ref(&dir), Some(nobody)).unwrap();
        assert!(again.is_empty());
        let mine = tmp.path().join("mine");
        recreate_socket_dirs(&places, std::slice::from_ref(&mine), None).unwrap();
        assert_eq!(
            fs::metadata(&mine).unwrap().uid(),
            nix::unistd::geteuid().as_raw()
        );
    }

    #[test]
    fn a_split_image_is_refused_without_possums_plugin() {
        let tmp = tempfile::tempdir().unwrap();
        let criu_dir = tmp.path().join("criu");
        fs::create_dir(&criu_dir).unwrap();
        let plugins = tmp.path().join("plugins");
        fs::create_dir(&plugins).unwrap();
        let none = Criu::with_binary("/bin/true").with_plugin_dir(None);
        let empty = none.clone().with_plugin_dir(Some(plugins.clone()));
        // Not split: no plugin needed.
        refuse_split_without_plugin(&criu_dir, &none).unwrap();
        fs::write(criu_dir.join("possum-hostmem-42.idx"), b"x").unwrap();
        for criu in [&none, &empty] {
            let e = refuse_split_without_plugin(&criu_dir, criu)
                .unwrap_err()
                .to_string();
            assert!(e.contains("only possum's CRIU plugin restores"), "{e}");
        }
        fs::write(plugins.join(possum_criu::PLUGIN_FILE), b"").unwrap();
        refuse_split_without_plugin(&criu_dir, &empty).unwrap();
    }
}
