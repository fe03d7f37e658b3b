//! The checkpoint and restore of a GPU process as a sequence of named phases, shared by the
//! `possum` command line, the CRIU plugin and migration.
//!
//! ```text
//! checkpoint (engine possum)                      job (libpossum.so)
//!   plan         status, tree, driver state ─────▶ (nothing changes)
//!   pre-copy     checkpoint{tmp/gpu} ────────────▶ every buffer copied while it runs
//!   cut          release ────────────────────────▶ T0: GPU operations held; what was written
//!                                                  since copied, images committed, memory dropped
//!   freeze       driver lock + checkpoint (the residue: contexts, memory possum does not manage)
//!   save         CRIU dump (the job stays held); a kept checkpoint resumes the job and saves its
//!                buffers as of T0; host memory split out of CRIU's images
//!   commit       possum.json written, tmp renamed to DIR
//!   resume/kill  --leave-running: driver restore + unlock, resume{DIR/gpu} ▶ runs on, buffers
//!                back on demand; otherwise the job is killed
//!   report       the guard let go, the image fsynced, the figures
//! restore
//!   open ─ prepare (GPUs, CRIU, sockets) ─ stage (keeper loads the images) ─ CRIU restore ─
//!   keeper ─ driver restore + unlock ─ resume{DIR/gpu} ▶ runs; buffers back on demand ─ report
//! ```
//!
//! What each phase guarantees, and the ordering rules:
//! - **plan** ([`checkpoint::checkpoint`]'s first step) changes nothing: a job that cannot be
//!   checkpointed (managed memory, CUPTI under NVIDIA's driver, held by another checkpoint) is
//!   refused before it is paused. It holds `possum-PID.lock`: one checkpoint of a process at a
//!   time.
//! - From the **cut** on, a guard process ([`guard`]) is told each step before it is taken and,
//!   if the checkpoint fails or its caller dies (even by SIGKILL), undoes what was done: the job
//!   runs on and no image appears under DIR's name.
//! - The **freeze** locks every CUDA process of the tree before any is checkpointed (one T0),
//!   and CRIU dumps only after the driver has checkpointed them all.
//! - The image is written under a temporary sibling of DIR and named only at the **commit**,
//!   complete; nothing is fsynced while the job is held (the **report** does it after).
//! - A kept checkpoint (a job left running whose memory a keeper holds) copies nothing while
//!   held: its buffers are saved after the job runs again, and the image is named after that.
//! - A restore starts nothing before its checks (the image, untrusted: `possum.json`'s check
//!   and what it names, [`image::Manifest::validate`]; the host paths it names, [`places`];
//!   the GPUs' room, CRIU's plugin); a failure after CRIU's restore kills the restored process
//!   through a pidfd verified to be it ([`process::Process::restored`]), never by a PID read
//!   from a file; the image is never changed.
//! - A HIP job served by possum (its status says `runtime: hip`) goes through the same phases
//!   without NVIDIA's driver: no freeze, no driver restore or unlock, at the checkpoint or the
//!   restore; its image says `runtime: hip` ([`gpu_runtimes::GpuRuntime`]). Which runtime a
//!   checkpoint takes a job on is decided once, at the plan.
//!
//! Each phase has its error type (`PlanError`, `HoldError` of the pre-copy, cut, freeze and
//! dump, `ResumeError`, `CommitError`, ...), each message naming what failed; the figures are
//! [`figures::CheckpointFigures`] and [`figures::RestoreFigures`]; the parameters
//! [`CheckpointParams`] and [`RestoreParams`], with the environment read once
//! ([`Environment::read`]).

#![forbid(unsafe_code)]

pub mod auth;
pub mod checkpoint;
pub mod config;
mod engine;
pub mod figures;
#[doc(hidden)]
pub mod fuzz;
pub mod gpu_runtimes;
pub mod guard;
mod held;
pub mod image;
pub mod job;
pub mod migrate;
mod observer;
pub mod places;
pub mod postcopy;
pub mod prestage;
pub mod process;
pub mod ranks;
pub mod restore;
mod stage;
pub mod tcp;
mod temps;
pub mod tree;
pub mod wire;

pub use checkpoint::{
    checkpoint, checkpoint_held, CheckpointError, CheckpointParams, CheckpointReport,
    HeldCheckpoint, KilledCheckpoint, ResumeError,
};
pub use config::{DriverDeadlines, Environment, HostmemSplit};
pub use engine::Engine;
pub use observer::{MigrateStep, Observer, Quiet};
pub use restore::{restore, restore_confirmed, RestoreError, RestoreParams, RestoreReport};
pub use stage::StageReport;
