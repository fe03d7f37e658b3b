//! The checkpoint's plan: checks that the job can be checkpointed and finds what its checkpoint
//! involves (its hooks, its GPU runtime, the process side, the CUDA processes of its tree, its
//! keeper), changing nothing.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use possum_control::reply::StatusReply;
use possum_control::Request;
use possum_criu::Criu;
use possum_cuda::checkpoint::{DriverCheckpoint, DriverCkptError, ProcessState};

use super::error::{HipRefusal, PlanError};
use super::params::CheckpointParams;
use super::refusals::{refuse_driver_over_keeper, refuse_peers_outside, refuse_unsupported_memory};
use crate::gpu_runtimes::{GpuRuntime, GpuRuntimes};
use crate::image::{occupied, smi, GpuUse, JobOwner, KeeperOfJob};
use crate::job::{ask, ask_within, JobError};
use crate::process::{alive, lock_pid};
use crate::temps;
use crate::{tree, Engine};

/// How long the probe's lock may wait for the job's GPU work (a refusal is immediate).
const PROBE_LOCK_MS: u32 = 2_000;
/// The driver's `CUDA_ERROR_NOT_SUPPORTED`: its checkpoint refuses the process.
pub(super) const CUDA_ERROR_NOT_SUPPORTED: i32 = 801;

/// How possum sees a job's GPU operations, from its status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct JobHooks {
    /// possum sees its operations now (entry points or CUPTI): pre-copy, hold at the op gate,
    /// on-demand restore. Otherwise a checkpoint parks its threads.
    pub(super) live: bool,
    /// CUPTI's callbacks are subscribed (NVIDIA's driver then refuses the checkpoint).
    pub(super) cupti: bool,
    /// `entry`, `cupti` or `off` (POSSUM_HOOKS); none from libraries older than the entry points.
    pub(super) mode: Option<String>,
}

impl JobHooks {
    fn of(status: &StatusReply) -> JobHooks {
        let session = status.possum.as_ref().and_then(|p| p.session.as_ref());
        let cupti = session.is_some_and(|s| s.cupti_attached);
        JobHooks {
            // Libraries older than the entry points' hooks had only CUPTI's.
            live: session.and_then(|s| s.hooks_live).unwrap_or(cupti),
            cupti,
            mode: status.hooks.clone(),
        }
    }

    /// What saw the job's operations, in words.
    pub(super) fn seen_by(&self) -> &'static str {
        match self.mode.as_deref() {
            Some("entry") => "the driver's entry points",
            _ if self.cupti => "CUPTI callbacks",
            Some("cupti") => "CUPTI callbacks",
            _ => "possum's hooks",
        }
    }
}

/// What the plan found: everything the later phases need, asked before anything changes.
pub(super) struct Plan<'a> {
    pub(super) p: &'a CheckpointParams,
    /// possum's view of the job's hooks (engine possum).
    pub(super) hooks: Option<JobHooks>,
    /// The GPU runtime the job runs on ([`job_runtime`]).
    pub(super) runtime: GpuRuntime,
    /// The process side (none for `--gpu-only`).
    pub(super) side: Option<ProcessSide>,
    /// The other CUDA processes of the tree (none without the driver), and the processes of
    /// the tree with possum loaded.
    pub(super) children: Vec<i32>,
    pub(super) possum_children: Vec<i32>,
    /// The bytes of the job's managed buffers (for the progress bar).
    pub(super) managed: u64,
    /// The job's keeper, if its buffer memory is a keeper's.
    pub(super) keeper: Option<KeeperOfJob>,
    pub(super) shell_job: bool,
    pub(super) socket_dirs: Vec<PathBuf>,
    pub(super) stdio_pipes: Vec<(i32, String)>,
    pub(super) gpu_memory: Vec<GpuUse>,
    /// Whom the job runs as.
    pub(super) owner: Option<JobOwner>,
    /// One checkpoint of the process at a time.
    pub(super) _lock: nix::fcntl::Flock<fs::File>,
}

/// The process side of a checkpoint: CRIU's dump, and for a CUDA job NVIDIA's driver
/// checkpoint, which locks and checkpoints the tree's CUDA processes before CRIU dumps them and
/// restores and unlocks them after.
///
/// A HIP job (served by possum) has no driver here: possum's engine has saved and released its
/// GPU buffers at the cut, and CRIU dumps the rest. On the simulated HIP runtime that is all;
/// on an AMD GPU the process also has `/dev/kfd` open, which CRIU dumps only with its amdgpu
/// plugin in its plugin directory. possum does not look for that plugin: CRIU's own error
/// says it is missing.
pub(super) struct ProcessSide {
    pub(super) criu: Criu,
    /// NVIDIA's driver checkpoint (a CUDA job's; none for a HIP job).
    pub(super) driver: Option<DriverCheckpoint>,
}

impl Plan<'_> {
    /// NVIDIA's driver checkpoint, when it takes part (a CUDA job, not `--gpu-only`).
    pub(super) fn driver(&self) -> Option<&DriverCheckpoint> {
        self.side.as_ref().and_then(|s| s.driver.as_ref())
    }
}

/// The GPU runtime the job is checkpointed on, decided from the runtime libraries process `pid`
/// maps and (engine possum) what its possum says, `status` (none: engine driver, or a process
/// with HIP loaded and no possum). The one place that decides whether NVIDIA's driver takes
/// part: a CUDA job's checkpoint has it, a HIP job's has none. A job is taken on HIP when its
/// possum says it serves it there (`runtime: hip`) and it does not map `libcuda`; a process
/// mapping `libamdhip64` that possum does not serve on HIP is refused.
pub(super) fn job_runtime(
    pid: i32,
    mapped: GpuRuntimes,
    engine: Engine,
    status: Option<&StatusReply>,
) -> Result<GpuRuntime, PlanError> {
    let served_hip = status.is_some_and(StatusReply::is_hip);
    let refuse = |why| Err(PlanError::Hip { pid, why });
    match (mapped.hip || served_hip, engine, status) {
        (false, _, _) => Ok(GpuRuntime::Cuda),
        _ if mapped.cuda => refuse(HipRefusal::Mixed),
        (true, Engine::Driver, _) => refuse(HipRefusal::DriverEngine),
        (true, Engine::Possum, None) => refuse(HipRefusal::WithoutPossum),
        (true, Engine::Possum, Some(_)) if !served_hip => refuse(HipRefusal::NotServed),
        (true, Engine::Possum, Some(_)) => Ok(GpuRuntime::Hip),
    }
}

/// `pid`'s session id, as seen from here: 0 when its session leader is outside this PID
/// namespace; `None` when it cannot be read.
fn session_of(pid: i32) -> Option<i32> {
    nix::unistd::getsid(Some(nix::unistd::Pid::from_raw(pid)))
        .ok()
        .map(|s| s.as_raw())
}

/// Plan: checks that the job can be checkpointed and finds what its checkpoint involves (its
/// hooks, the process side, the CUDA processes of its tree, its keeper). Nothing is changed.
/// `--parent`: a committed image, and not the one being written.
fn check_parent(parent: &Path, dir: &Path) -> Result<(), PlanError> {
    let same = match (fs::canonicalize(parent), fs::canonicalize(dir)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same {
        return Err(PlanError::Parent {
            dir: parent.to_path_buf(),
            why: "it is the image directory being written (the new image refers to its \
                  parent's files: write it beside, in another directory)",
        });
    }
    if !parent.join(crate::image::MANIFEST).is_file() {
        return Err(PlanError::Parent {
            dir: parent.to_path_buf(),
            why: "not a committed possum image (no possum.json)",
        });
    }
    Ok(())
}

pub(super) fn plan(p: &CheckpointParams) -> Result<Plan<'_>, PlanError> {
    let pid = p.pid;
    if pid <= 0 || !alive(pid) {
        return Err(PlanError::NoProcess { pid });
    }
    let mapped = GpuRuntimes::of(pid);
    // A process mixing CUDA and HIP, or a HIP job under the driver's engine, is refused before
    // its possum is asked anything (the decision needs no status).
    if mapped.hip && (mapped.cuda || p.engine == Engine::Driver) {
        job_runtime(pid, mapped, p.engine, None)?;
    }
    if let Some(parent) = &p.parent {
        check_parent(parent, &p.dir)?;
    }
    if occupied(&p.dir) && !p.force {
        return Err(PlanError::Occupied { dir: p.dir.clone() });
    }
    let status = match p.engine {
        Engine::Possum => match ask::<StatusReply>(pid, &p.sockets, &Request::Status) {
            Ok(s) => Some(s.body),
            // A HIP process without possum: refused as such below.
            Err(e) if mapped.hip && e.is_without_possum() => None,
            Err(e) => return Err(e.into()),
        },
        Engine::Driver => {
            refuse_driver_over_keeper(pid, &p.sockets)?;
            None
        }
    };
    let runtime = job_runtime(pid, mapped, p.engine, status.as_ref())?;
    if let Some(s) = &status {
        refuse_unsupported_memory(pid, s, p.gpu_only)?;
    }
    let side = if p.gpu_only {
        None
    } else {
        let criu = Criu::locate().map_err(PlanError::NoCriu)?;
        // Before the hold: CRIU's probe of the kernel then comes from its cache (a failure
        // only costs the probe at each run; `possum doctor` says why).
        let _ = criu.prime_kdat();
        let driver = if runtime.has_nvidia_driver() {
            let drv = (p.env.driver_deadlines).load(&p.env.libcuda);
            Some(drv.map_err(PlanError::NoDriver)?)
        } else {
            None
        };
        Some(ProcessSide { criu, driver })
    };
    let driver = side.as_ref().and_then(|s| s.driver.as_ref());
    // With its hooks live (the driver's entry points, or CUPTI's callbacks), possum holds the
    // job's operations at its op gate after a pre-copy; without them it parks the job's threads
    // instead and copies every buffer while they are parked.
    let hooks = status.as_ref().map(JobHooks::of);
    let lock = lock_pid(&p.sockets, pid)?;
    if let Some(drv) = driver {
        check_driver_state(p, drv, hooks.as_ref().is_some_and(|h| h.cupti))?;
    }
    // The other CUDA processes of the job's tree: locked and checkpointed by the driver with the
    // root (one T0 for all, before CRIU dumps any), restored and unlocked with it.
    let children = match driver {
        Some(drv) => tree::cuda_descendants(drv, pid).map_err(PlanError::Tree)?,
        None => Vec::new(),
    };
    // Those with possum loaded (a control socket in the same directory): their buffers are
    // saved and released by possum like the root's.
    // Without a driver to ask (`--gpu-only`, a HIP job), every descendant is looked at.
    let child_statuses = match (p.engine, driver) {
        (Engine::Possum, Some(_)) => possum_in(&children, &p.sockets, p.gpu_only)?,
        (Engine::Possum, None) => possum_in(&tree::descendants(pid), &p.sockets, p.gpu_only)?,
        (Engine::Driver, _) => Vec::new(),
    };
    let statuses: Vec<(i32, &StatusReply)> = status
        .iter()
        .map(|s| (pid, s))
        .chain(child_statuses.iter().map(|(c, s)| (*c, s)))
        .collect();
    refuse_peers_outside(&statuses)?;
    // CRIU's own refusal, after the GPU side's: a job it cannot dump in any session is told so
    // first.
    let sid = session_of(pid);
    if side.is_some() && sid == Some(0) {
        return Err(PlanError::SessionOutside { pid });
    }
    let possum_children: Vec<i32> = child_statuses.iter().map(|(c, _)| *c).collect();
    let engines = status
        .iter()
        .flat_map(|s| s.possum.iter())
        .flat_map(|p| &p.engines);
    let managed = engines.clone().filter_map(|e| e.engine.bytes).sum();
    let has_keeper = engines.clone().any(|e| e.keeper.is_some());
    let mut tree = tree::descendants(pid);
    tree.push(pid);
    Ok(Plan {
        p,
        hooks,
        runtime,
        side,
        children,
        possum_children,
        managed,
        keeper: has_keeper.then(|| keeper_of(pid)).flatten(),
        shell_job: sid.is_some_and(|sid| sid != pid),
        socket_dirs: tree::socket_dirs(&tree),
        stdio_pipes: tree::external_stdio_pipes(pid, &tree),
        // What the job uses on the GPU now, for the restore's check (nvidia-smi's: a CUDA
        // job's only).
        gpu_memory: match runtime {
            GpuRuntime::Cuda => smi::process_usage(&p.env.nvidia_smi, pid).unwrap_or_default(),
            GpuRuntime::Hip => Vec::new(),
        },
        owner: JobOwner::of_process(pid),
        _lock: lock,
    })
}

/// The driver must see the job running (not held by another checkpoint); a job with CUPTI is
/// probed first: the driver says only at the lock that it refuses such a process, and a full
/// checkpoint would otherwise pause it, copy and release its buffers and bring them back for
/// nothing. A lock that cannot be had now (a timeout) is left for the freeze to report.
fn check_driver_state(
    p: &CheckpointParams,
    drv: &DriverCheckpoint,
    cupti: bool,
) -> Result<(), PlanError> {
    let pid = p.pid;
    match drv.state(pid) {
        Ok(ProcessState::Running) => {}
        Ok(state) => return Err(PlanError::NotRunning { pid, state }),
        Err(e @ DriverCkptError::DeadlineExceeded { .. }) => return Err(PlanError::Driver(e)),
        Err(error) => return Err(PlanError::NotCuda { pid, error }),
    }
    if p.engine != Engine::Possum || !cupti {
        return Ok(());
    }
    match drv.lock(pid, PROBE_LOCK_MS) {
        Ok(()) => drv
            .unlock(pid)
            .map_err(|source| PlanError::ProbeUnlock { pid, source }),
        Err(e) if e.code() == Some(CUDA_ERROR_NOT_SUPPORTED) => Err(PlanError::CuptiRefused(e)),
        Err(_) => Ok(()),
    }
}

/// Which of `children` have possum loaded: a control socket in `sockets` that answers. One with
/// managed memory is refused, as the root is; one whose socket does not answer is an error.
pub(super) fn possum_in(
    children: &[i32],
    sockets: &Path,
    gpu_only: bool,
) -> Result<Vec<(i32, StatusReply)>, PlanError> {
    let child = |pid, e: PlanError| PlanError::Child {
        pid,
        source: Box::new(e),
    };
    let mut out = Vec::new();
    for &c in children {
        let timeout = Duration::from_secs(30);
        match ask_within::<StatusReply>(c, sockets, &Request::Status, timeout) {
            Ok(status) => {
                refuse_unsupported_memory(c, &status.body, gpu_only).map_err(|e| child(c, e))?;
                out.push((c, status.body));
            }
            Err(e) if e.is_without_possum() => {}
            // It exited since the tree was listed: no part of the job now.
            Err(JobError::NoProcess(_)) => {}
            Err(e) => return Err(child(c, e.into())),
        }
    }
    Ok(out)
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

/// The temporary sibling of `dir` a checkpoint is written under.
pub(super) fn temp_sibling(dir: &Path) -> Result<PathBuf, PlanError> {
    let name = dir
        .file_name()
        .ok_or_else(|| PlanError::NotADirectoryName {
            dir: dir.to_path_buf(),
        })?
        .to_string_lossy()
        .into_owned();
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty());
    let parent = parent.unwrap_or(Path::new("."));
    fs::create_dir_all(parent).map_err(|source| PlanError::TempDir {
        dir: parent.to_path_buf(),
        source,
    })?;
    Ok(parent.join(temps::temp_name(&name, std::process::id())))
}
