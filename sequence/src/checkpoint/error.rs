//! The checkpoint's errors: one enum per phase (part of [`super`]).

use std::path::PathBuf;

use possum_criu::CriuError;
use possum_cuda::checkpoint::{DriverCkptError, ProcessState};

use crate::job::JobError;
use crate::process::LockError;
use crate::tree;

/// What to do when NVIDIA's driver refuses to lock a job because CUPTI is subscribed in it.
const CUPTI_REFUSED: &str = "NVIDIA's driver checkpoint (this driver) refuses any process CUPTI \
     has subscribed in, and this job runs with CUPTI (`possum run --cupti`, POSSUM_HOOKS=cupti: a \
     diagnostic): start it with `possum run JOB` (without --cupti) for a full possum checkpoint, \
     or use --engine driver (or --gpu-only for possum's GPU side)";

/// `b` bytes in GiB, for a message.
fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// A checkpoint that failed, by the phase that failed and with what became of the job.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Nothing was done.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// While the job was held; the guard let it run on.
    #[error("checkpoint of process {pid} failed; the job runs on, no image was written")]
    Held {
        /// The job.
        pid: i32,
        /// What failed.
        #[source]
        source: HoldError,
    },
    /// A kept checkpoint, once the job ran again.
    #[error("checkpoint failed after the job was held; the job runs on, no image was written")]
    KeptSave(#[source] ResumeError),
    /// Naming the image.
    #[error("naming the image {} failed; the job runs on", dir.display())]
    Commit {
        /// The image directory.
        dir: PathBuf,
        /// What failed.
        #[source]
        source: CommitError,
    },
    /// Letting the job run on (or killing it) once the image was complete.
    #[error(
        "the image is complete, but the job could not be resumed: if it is still paused, end it \
         and bring it back with `possum restore -D {}`",
        dir.display()
    )]
    Resume {
        /// The image directory.
        dir: PathBuf,
        /// What failed.
        #[source]
        source: ResumeError,
    },
    /// The image could not be made durable.
    #[error(transparent)]
    Report(#[from] ReportError),
}

impl CheckpointError {
    /// Whether the checkpoint failed because its image was proven wrong by its fingerprints
    /// (the job wrote a buffer before it was saved, unforeseen): the job ran on, and a new
    /// checkpoint is expected to succeed. Read from the error's words, which cross the control
    /// socket as text ([`possum_engine::MISMATCH_TEXT`]).
    pub fn is_mismatch(&self) -> bool {
        let mut e: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(err) = e {
            if err.to_string().contains(possum_engine::MISMATCH_TEXT) {
                return true;
            }
            e = err.source();
        }
        false
    }
}

/// The plan failed: nothing was done.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The process is gone.
    #[error("no process {pid} (is it still running?)")]
    NoProcess {
        /// The process.
        pid: i32,
    },
    /// The process runs on AMD GPUs (it has AMD's HIP runtime loaded) in a way possum does not
    /// checkpoint: without possum serving it, with `--engine driver`, or mixed with CUDA.
    #[error("process {pid} {}; nothing was done", why.in_words(*pid))]
    Hip {
        /// The process.
        pid: i32,
        /// Why it is refused.
        why: HipRefusal,
    },
    /// A checkpoint left held (a migration's) asked to kill the job or to leave out the CPU side.
    #[error(
        "a checkpoint of process {pid} left held for a migration saves the whole process and \
         leaves it running until told otherwise: not with --gpu-only, nor killing it; nothing \
         was done"
    )]
    NotHeldWhole {
        /// The process.
        pid: i32,
    },
    /// `--parent` names the image being written (with `--force`, it would be removed while
    /// the new image refers to it), or is not an image possum wrote.
    #[error("--parent {}: {why}; nothing was done", dir.display())]
    Parent {
        /// The parent.
        dir: PathBuf,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The process's session leader is outside its PID namespace (getsid answers 0), which
    /// CRIU cannot dump, with `--shell-job` or without.
    #[error(
        "process {pid}'s session leader is outside its PID namespace (a job started in a \
         container without a session of its own), which CRIU cannot dump; start the job in a \
         session of its own (`setsid possum run ...`), or checkpoint it with --gpu-only; nothing \
         was done"
    )]
    SessionOutside {
        /// The process.
        pid: i32,
    },
    /// An NCCL communicator has ranks outside the job's tree.
    #[error(
        "process{} {} of the job {} rank{} in an NCCL communicator of {nranks} ranks (id {id}), \
         of which only {found} are in the job's tree: the others (on another host?) cannot be \
         cut with it, so nothing was done; possum checkpoints a multi-process job whose ranks are \
         all in one process tree on this host",
        if pids.len() == 1 { "" } else { "es" },
        pids.iter().map(i32::to_string).collect::<Vec<_>>().join(", "),
        if pids.len() == 1 { "has a" } else { "have" },
        if *found == 1 { "" } else { "s" }
    )]
    PeersOutside {
        /// The communicator's id (as `possum status` shows it).
        id: String,
        /// Its ranks in all.
        nranks: u32,
        /// Those in the tree.
        found: u32,
        /// The tree's processes with ranks in it.
        pids: Vec<i32>,
    },
    /// The image directory holds something.
    #[error(
        "{} exists and is not empty: choose another directory, or --force to replace it (the \
         old image is removed only once the new one is complete)",
        dir.display()
    )]
    Occupied {
        /// The directory.
        dir: PathBuf,
    },
    /// The job's possum did not answer.
    #[error(transparent)]
    Job(#[from] JobError),
    /// The job has managed memory.
    #[error(
        "process {pid} has managed memory (cuMemAllocManaged: {allocations} allocations, {}): \
         {}",
        gib(*bytes),
        if *gpu_only {
            "possum's engine does not save managed memory, so --gpu-only cannot save this job's \
             GPU state (nor can NVIDIA's driver checkpoint, which does not support managed \
             memory); nothing was done"
        } else {
            "NVIDIA's driver checkpoint does not support managed (unified) memory, and possum's \
             engine does not save it, so this job cannot be checkpointed; nothing was done"
        }
    )]
    Managed {
        /// The process.
        pid: i32,
        /// Its managed allocations.
        allocations: u64,
        /// Their bytes.
        bytes: u64,
        /// `--gpu-only` was asked.
        gpu_only: bool,
    },
    /// `--engine driver` for a job whose buffers are a keeper's memory, imported into it.
    #[error(
        "process {pid}'s GPU buffers are memory possum's keeper shares with it (`possum run`'s \
         default): NVIDIA's driver checkpoint takes such a process but cannot restore it (its \
         restore fails with CUDA_ERROR_NOT_SUPPORTED), here or anywhere, so `--engine driver` \
         would leave the job with no way back; nothing was done. Use possum's engine (the \
         default), or start the job with `possum run --no-keeper` to checkpoint it with the \
         driver's"
    )]
    DriverKeeper {
        /// The process.
        pid: i32,
    },
    /// A process maps memory another process shared with it (NCCL's peer buffers) that
    /// possum's keeper does not hold.
    #[error(
        "process {pid} maps memory another process shared with it ({mappings} mappings, {}: the \
         peer buffers of NCCL's ranks, say) that possum's keeper does not hold (the other \
         process runs without possum's memory, POSSUM_SERVE_VMM=0, or without a keeper); \
         NVIDIA's driver checkpoint cannot take such a process back (its restore fails and \
         leaves the job stuck), so nothing was done; run every process of the job under \
         `possum run` (which serves their memory from its keeper), or use `--gpu-only`, which \
         saves the job's GPU buffers without the driver's checkpoint",
        gib(*bytes)
    )]
    Imported {
        /// The process.
        pid: i32,
        /// Its mappings of imported memory.
        mappings: u64,
        /// Their bytes.
        bytes: u64,
    },
    /// A process of the job's tree cannot be checkpointed.
    #[error("process {pid} of the job's tree")]
    Child {
        /// The process.
        pid: i32,
        /// Why.
        #[source]
        source: Box<PlanError>,
    },
    /// No CRIU.
    #[error("CRIU is needed for the CPU side")]
    NoCriu(#[source] CriuError),
    /// No driver checkpoint.
    #[error("NVIDIA's driver checkpoint is needed")]
    NoDriver(#[source] DriverCkptError),
    /// A driver call of the plan did not return within its deadline.
    #[error("the plan: the driver did not answer in time")]
    Driver(#[source] DriverCkptError),
    /// Another checkpoint of the process runs.
    #[error(transparent)]
    Lock(#[from] LockError),
    /// The driver holds the process in another state.
    #[error(
        "process {pid} is {state} in the CUDA driver: another checkpoint holds it, or it was left \
         so by one (see `possum status {pid}`)"
    )]
    NotRunning {
        /// The process.
        pid: i32,
        /// Its state.
        state: ProcessState,
    },
    /// The driver does not know the process.
    #[error("process {pid}: {error} (does it use CUDA?)")]
    NotCuda {
        /// The process.
        pid: i32,
        /// The driver's answer.
        error: DriverCkptError,
    },
    /// The driver refuses a process CUPTI has subscribed in.
    #[error("{CUPTI_REFUSED}")]
    CuptiRefused(#[source] DriverCkptError),
    /// The probe's unlock failed.
    #[error("unlocking process {pid} after probing the driver's lock")]
    ProbeUnlock {
        /// The process.
        pid: i32,
        /// The driver's answer.
        #[source]
        source: DriverCkptError,
    },
    /// A process of the job's tree is held by another checkpoint.
    #[error(transparent)]
    Tree(#[from] tree::TreeError),
    /// The image directory's name has no last component.
    #[error("{}: not a directory name", dir.display())]
    NotADirectoryName {
        /// The directory.
        dir: PathBuf,
    },
    /// The temporary directory could not be made.
    #[error("creating {}", dir.display())]
    TempDir {
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The guard did not start.
    #[error("starting the checkpoint guard")]
    Guard(#[source] std::io::Error),
}

/// What failed while the job was held (pre-copy, cut, freeze, dump).
#[derive(Debug, thiserror::Error)]
pub enum HoldError {
    /// The pre-copy.
    #[error(transparent)]
    Precopy(#[from] PrecopyError),
    /// The cut.
    #[error(transparent)]
    Cut(#[from] CutError),
    /// The freeze.
    #[error("the freeze (the driver's lock and checkpoint of the job's tree)")]
    Freeze(#[from] FreezeError),
    /// CRIU's dump.
    #[error(transparent)]
    Dump(CriuError),
    /// CRIU's dump, refused because the tree holds an established TCP connection and was not
    /// asked to dump those.
    #[error(
        "the job's tree holds an established TCP connection (e.g. torchrun's TCPStore between \
         its agent and ranks): checkpoint it with --tcp-established"
    )]
    TcpEstablished(#[source] CriuError),
    /// CRIU's dump, failed on a TCP socket: this CRIU cannot dump one on this kernel.
    #[error(
        "this CRIU cannot dump the job's TCP sockets on this kernel (Linux 6.16 and later \
         answer SO_PASSCRED only on unix and netlink sockets): a CRIU with its fix for that \
         is needed (CRIU 4.1 and older lack it)"
    )]
    CriuTooOldForTcp(#[source] CriuError),
    /// CRIU's dump, refused because the tree holds a unix stream connection to a process
    /// outside it.
    #[error(
        "the job's tree holds a unix stream connection to a process outside it (a client \
         connected to its unix socket, say): CRIU cannot dump one end of such a connection; \
         checkpoint it once that client has closed the connection"
    )]
    UnixStreamOutside(#[source] CriuError),
}

impl From<CriuError> for HoldError {
    fn from(e: CriuError) -> Self {
        if e.is_established_tcp_refused() {
            HoldError::TcpEstablished(e)
        } else if e.is_inet_passcred_refused() {
            HoldError::CriuTooOldForTcp(e)
        } else if e.is_external_unix_stream() {
            HoldError::UnixStreamOutside(e)
        } else {
            HoldError::Dump(e)
        }
    }
}

/// The pre-copy failed.
#[derive(Debug, thiserror::Error)]
pub enum PrecopyError {
    /// A process's possum refused or failed it.
    #[error(transparent)]
    Job(#[from] JobError),
}

/// The cut (hold, final copy, release) failed.
#[derive(Debug, thiserror::Error)]
pub enum CutError {
    /// The root's possum refused or failed it.
    #[error(transparent)]
    Job(#[from] JobError),
    /// Another process's.
    #[error("process {pid} of the job's tree")]
    Child {
        /// The process.
        pid: i32,
        /// Why.
        #[source]
        source: JobError,
    },
    /// The ranks of a multi-process job found no common collective boundary.
    #[error(transparent)]
    Ranks(#[from] crate::ranks::RanksError),
}

/// The freeze (the driver's lock and checkpoint) failed.
#[derive(Debug, thiserror::Error)]
pub enum FreezeError {
    /// The driver refused the root.
    #[error(transparent)]
    Driver(DriverCkptError),
    /// A driver call did not return within its deadline (the root's or another process's).
    #[error("the driver did not answer in time")]
    Deadline(#[source] DriverCkptError),
    /// The driver refuses a process CUPTI has subscribed in.
    #[error("{CUPTI_REFUSED}")]
    CuptiRefused(#[source] DriverCkptError),
    /// The driver did not lock another process.
    #[error("locking process {pid} of the job's tree")]
    LockChild {
        /// The process.
        pid: i32,
        /// The driver's answer.
        #[source]
        source: DriverCkptError,
    },
    /// The driver did not checkpoint another process.
    #[error("process {pid} of the job's tree: {error}")]
    CheckpointChild {
        /// The process.
        pid: i32,
        /// The driver's answer.
        error: DriverCkptError,
    },
}

impl From<DriverCkptError> for FreezeError {
    /// [`FreezeError::Deadline`] for a call past its deadline, else [`FreezeError::Driver`].
    fn from(e: DriverCkptError) -> FreezeError {
        match e {
            DriverCkptError::DeadlineExceeded { .. } => FreezeError::Deadline(e),
            e => FreezeError::Driver(e),
        }
    }
}

impl FreezeError {
    /// A call past its deadline of another process of the tree is the freeze's deadline too.
    pub(super) fn deadline_first(self) -> FreezeError {
        match self {
            FreezeError::LockChild { source: e, .. }
            | FreezeError::CheckpointChild { error: e, .. }
                if matches!(e, DriverCkptError::DeadlineExceeded { .. }) =>
            {
                FreezeError::Deadline(e)
            }
            other => other,
        }
    }
}

impl From<DriverCkptError> for ResumeError {
    /// [`ResumeError::DriverDeadline`] for a call past its deadline, else
    /// [`ResumeError::Driver`].
    fn from(e: DriverCkptError) -> ResumeError {
        match e {
            DriverCkptError::DeadlineExceeded { .. } => ResumeError::DriverDeadline(e),
            e => ResumeError::Driver(e),
        }
    }
}

/// The job could not run on (or be killed).
#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    /// The driver's restore or unlock.
    #[error(transparent)]
    Driver(DriverCkptError),
    /// The driver's restore or unlock did not return within its deadline.
    #[error(
        "the driver's restore and unlock of the job's tree: the driver did not answer in time"
    )]
    DriverDeadline(#[source] DriverCkptError),
    /// The driver's restore of another process of the tree.
    #[error("process {pid} of the job's tree: {error}")]
    DriverChild {
        /// The process.
        pid: i32,
        /// The driver's answer.
        error: DriverCkptError,
    },
    /// The root's possum did not resume.
    #[error(transparent)]
    Job(#[from] JobError),
    /// A process's possum did not resume.
    #[error("resuming process {pid}")]
    Process {
        /// The process.
        pid: i32,
        /// Why.
        #[source]
        source: JobError,
    },
    /// Another process's possum did not resume.
    #[error("process {pid} of the job's tree")]
    Child {
        /// The process.
        pid: i32,
        /// Why.
        #[source]
        source: JobError,
    },
    /// A kept checkpoint's save failed.
    #[error("saving the GPU buffers of process {pid}")]
    Save {
        /// The process.
        pid: i32,
        /// Why.
        #[source]
        source: JobError,
    },
    /// The job could not be killed.
    #[error(transparent)]
    Kill(#[from] nix::Error),
}

/// Naming the image failed.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    /// Making the image's files durable before its marker.
    #[error("making the image durable")]
    Sync(#[source] anyhow::Error),
    /// Writing `possum.json` or renaming.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// `possum.json` could not be made.
    #[error(transparent)]
    Manifest(#[from] serde_json::Error),
}

/// The report failed: the image could not be made durable.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// fsync.
    #[error(transparent)]
    Sync(anyhow::Error),
}

/// Why a process with AMD's HIP runtime loaded is refused ([`PlanError::Hip`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HipRefusal {
    /// It has NVIDIA's libcuda loaded too (or its possum serves it on HIP while it does).
    Mixed,
    /// possum is not loaded in it (no control socket answers).
    WithoutPossum,
    /// possum is loaded, but its status does not say it serves the job on HIP.
    NotServed,
    /// `--engine driver`: NVIDIA's driver checkpoint, which a HIP job has no part in.
    DriverEngine,
}

impl HipRefusal {
    /// The refusal of process `pid`, in words, with what checkpoints such a process.
    fn in_words(self, pid: i32) -> String {
        let plugin = "CRIU's amdgpu plugin (CRIU built with it, amdgpu_plugin.so in its plugin \
                      directory)";
        let commands = format!(
            "`criu dump --tree {pid} --images-dir DIR --shell-job`, then `criu restore \
             --images-dir DIR --shell-job`"
        );
        let hip = "is a HIP (AMD GPU) job (it has AMD's HIP runtime libamdhip64 loaded)";
        match self {
            HipRefusal::Mixed => "mixes CUDA and HIP (it has both NVIDIA's libcuda and AMD's HIP \
                 runtime libamdhip64 loaded): possum does not checkpoint a process mixing both"
                .to_string(),
            HipRefusal::WithoutPossum => format!(
                "{hip} without possum loaded: possum checkpoints a HIP job only when it serves \
                 the job's HIP runtime; {plugin} checkpoints it: {commands}"
            ),
            HipRefusal::NotServed => format!(
                "{hip} whose possum does not serve it on HIP (its status names no `hip` \
                 runtime): possum cannot save its GPU state; {plugin} checkpoints it: {commands}"
            ),
            HipRefusal::DriverEngine => format!(
                "{hip}: --engine driver is NVIDIA's driver checkpoint, which has no part in a \
                 HIP job; checkpoint it with possum's engine (the default) when possum serves \
                 it, or with {plugin}: {commands}"
            ),
        }
    }
}
