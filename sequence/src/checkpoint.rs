//! The checkpoint sequence: [`checkpoint`] and its phases (see the crate's documentation).

use std::fs;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use possum_control::reply::{CheckpointReply, DeviceCopy, ReleaseReply, ResumeReply, SavedReply};
use possum_control::{Reply, Request};

use crate::wire::Written;
use possum_criu::dump::PreparedDump;
use possum_criu::{Criu, CriuError, Deadline, DumpOptions};
use possum_cuda::checkpoint::DriverCkptError;
use serde::Serialize;
use serde_json::Value;

use crate::config::HostmemSplit;
use crate::figures::{
    longest_waits, timed, CheckpointFigures, HostmemFigures, PrecopyRound, WAITED_ON_TOP,
};
use crate::gpu_runtimes::GpuRuntime;
use crate::guard::{Guard, GuardPlan, HandOff, Step};
use crate::held::HeldHandles;
use crate::image::{
    child_gpu_dir, dir_bytes, gpu_memory_bytes, manifest_text, sync_tree, write_marker, HeldMemory,
    Manifest, MANIFEST_VERSION,
};
use crate::job::{self, ask_within, To};
use crate::process::kill_job;
use crate::ranks::JobRanks;
use crate::tcp::{self, QuietConnections};
use crate::temps::{self, TempLock};
use crate::{Engine, Observer};

/// How long the driver lock may wait for the job's submitted work.
const LOCK_TIMEOUT_MS: u32 = 30_000;
/// How long a checkpoint waits for a kept checkpoint's buffers to be saved.
const SAVE_TIMEOUT: Duration = Duration::from_secs(3600);

/// A checkpoint made: what the command prints.
#[derive(Debug, Clone, Serialize)]
pub struct CheckpointReport {
    /// The job.
    pub pid: i32,
    /// The other CUDA processes of its tree.
    pub cuda_children: Vec<i32>,
    /// Those with possum loaded.
    pub possum_children: Vec<i32>,
    /// Who took the GPU side.
    pub engine: Engine,
    /// The GPU runtime the job was taken on (absent: CUDA).
    #[serde(skip_serializing_if = "GpuRuntime::is_cuda")]
    pub runtime: GpuRuntime,
    /// The image directory.
    pub dir: PathBuf,
    /// Whether the job runs on.
    pub leave_running: bool,
    /// The job's hook mode (`entry`, `cupti`, `off`).
    pub hooks: Option<String>,
    /// How the job was held, in words.
    pub hold: String,
    /// The figures.
    pub figures: CheckpointFigures,
    /// The root's answer to the pre-copy.
    pub engine_report: Option<Reply<CheckpointReply>>,
    /// The root's answer to the release.
    pub release_report: Option<Reply<ReleaseReply>>,
    /// Processes whose checkpoint was kept (buffers saved after the job ran again).
    pub kept: Vec<i32>,
    /// Their saves.
    pub saved_report: Option<Vec<SavedOf>>,
    /// The root's answer to the resume.
    pub resume_report: Option<Reply<ResumeReply>>,
    /// A kept hold: what became of the keeper's memory handles (opaque).
    pub keeper_handles: Value,
    /// The job's threads were parked (hooks off): every buffer was copied while held.
    #[serde(skip)]
    pub parked: bool,
    /// A job killed after a dump of its established TCP connections: those put in repair mode
    /// before the kill, so that their peers were not told ([`crate::tcp`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_quiet: Option<QuietConnections>,
    /// Checkpoints taken again because the one before was proven wrong by its fingerprints (the
    /// job wrote a buffer no launch was predicted to write before it was saved): none committed.
    pub mismatch_retries: u32,
}

/// How many times a checkpoint proven wrong by its fingerprints is taken again (the job's
/// read-only speculation is taken back after the first, so a second is not expected).
pub const MISMATCH_RETRIES: u32 = 2;

/// The save of process `pid`'s kept buffers.
#[derive(Debug, Clone, Serialize)]
pub struct SavedOf {
    /// The process.
    pub pid: i32,
    /// Its answer to `Saved`.
    pub report: Reply<SavedReply>,
}

impl CheckpointReport {
    /// The buffers and bytes the release copied while the job was held.
    pub fn copied_at_release(&self) -> (u64, u64) {
        self.release_report
            .as_ref()
            .map_or((0, 0), |r| r.body.copied())
    }

    /// Whether the job's checkpoint was kept (its buffers saved after it ran again).
    pub fn kept_any(&self) -> bool {
        !self.kept.is_empty()
    }
}

/// Checkpoints the job `p` names into `p.dir`, in phases: plan, pre-copy, cut, freeze, dump
/// (with the job held), then the save of a kept checkpoint, the split of host memory, commit,
/// resume-or-kill and report. A failure after the plan is undone by the guard. `obs` is told how
/// the copy goes, and what the user should know.
pub fn checkpoint(
    p: &CheckpointParams,
    obs: &mut dyn Observer,
) -> Result<CheckpointReport, CheckpointError> {
    let mut retries = 0;
    loop {
        match checkpoint_once(p, obs) {
            Err(e) if e.is_mismatch() && retries < MISMATCH_RETRIES => {
                retries += 1;
                obs.note(&format!(
                    "{e}; the job runs on and the checkpoint is taken again (read-only \
                     speculation taken back)"
                ));
            }
            Ok(mut r) => {
                r.mismatch_retries = retries;
                return Ok(r);
            }
            Err(e) => return Err(e),
        }
    }
}

/// One try of [`checkpoint`].
fn checkpoint_once(
    p: &CheckpointParams,
    obs: &mut dyn Observer,
) -> Result<CheckpointReport, CheckpointError> {
    let t_all = Instant::now();
    let mut run = hold_and_commit(p, obs, false)?;
    if let Err(source) = run.resume_or_kill() {
        run.guard.undo();
        let dir = p.dir.clone();
        return Err(CheckpointError::Resume { dir, source });
    }
    Ok(run.report(t_all)?)
}

/// A checkpoint committed with its job still held (a migration's: the image is sent before the
/// job is let go): [`HeldCheckpoint::resume`] lets it run on, [`HeldCheckpoint::kill`] ends it.
/// The guard still watches: if this process dies meanwhile, the job runs on.
pub struct HeldCheckpoint<'a> {
    run: Run<'a>,
    t_all: Instant,
}

impl std::fmt::Debug for HeldCheckpoint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HeldCheckpoint({})", self.run.params().dir.display())
    }
}

impl<'a> HeldCheckpoint<'a> {
    /// The image, complete.
    pub fn dir(&self) -> &Path {
        &self.run.params().dir
    }

    /// What the cut's copy wrote into the image's data files since the last pre-copy round
    /// (as the job's library said it): what a migration sends again of the files it sent ahead.
    pub fn written_at_cut(&self) -> Written {
        self.run.written.clone()
    }

    /// Lets the job run on (the driver's restore and unlock, possum's resume): what
    /// `leave_running` does after the commit.
    pub fn resume(mut self) -> Result<CheckpointReport, CheckpointError> {
        self.run.continue_stopped();
        if let Err(source) = self.run.resume_or_kill() {
            let dir = self.run.params().dir.clone();
            self.run.guard.undo();
            return Err(CheckpointError::Resume { dir, source });
        }
        Ok(self.run.report(self.t_all)?)
    }

    /// Kills the job, held as it is; the image stays.
    pub fn kill(self) -> Result<CheckpointReport, CheckpointError> {
        self.kill_only()?.report()
    }

    /// Kills the job, held as it is, and writes nothing into the image: its figures are
    /// written with [`KilledCheckpoint::report`] (a migration sends the image meanwhile).
    pub fn kill_only(mut self) -> Result<KilledCheckpoint<'a>, CheckpointError> {
        // From here until the destination runs the job, a `possum` that ends has the guard
        // restore it here from its image.
        self.run.guard.step(Step::Migrating);
        if let Err(e) = self.run.kill() {
            let dir = self.run.params().dir.clone();
            self.run.guard.undo();
            return Err(CheckpointError::Resume {
                dir,
                source: e.into(),
            });
        }
        Ok(KilledCheckpoint {
            run: Some(self.run),
            t_all: self.t_all,
        })
    }
}

/// A [`HeldCheckpoint`] whose job was killed, its report not written yet. Dropped unreported,
/// it tells the guard that nothing is left to do (whoever dropped it sees to the job).
pub struct KilledCheckpoint<'a> {
    run: Option<Run<'a>>,
    t_all: Instant,
}

impl std::fmt::Debug for KilledCheckpoint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dir = self.run.as_ref().map(|r| r.params().dir.display());
        write!(f, "KilledCheckpoint({dir:?})")
    }
}

impl Drop for KilledCheckpoint<'_> {
    fn drop(&mut self) {
        if let Some(run) = &mut self.run {
            run.guard.step(Step::Done);
        }
    }
}

impl KilledCheckpoint<'_> {
    /// The image made durable and its figures written into its `possum.json`: the report.
    pub fn report(self) -> Result<CheckpointReport, CheckpointError> {
        self.report_handing_off().map(|(r, _)| r)
    }

    /// [`KilledCheckpoint::report`], and the guard, which restores the job here from its image
    /// should this process end before [`HandOff::handing_off`] (or the [`HandOff`] is dropped).
    pub fn report_handing_off(mut self) -> Result<(CheckpointReport, HandOff), CheckpointError> {
        let run = self.run.take().expect("reported once");
        let (mut report, guard) = run.report_guarded(self.t_all, true)?;
        report.leave_running = false;
        Ok((report, HandOff::new(guard)))
    }

    /// The guard alone, no report written (the image was not sent: this process restores the
    /// job here, [`HandOff::restoring_here`]).
    pub fn into_hand_off(mut self) -> HandOff {
        let run = self.run.take().expect("taken once");
        HandOff::new(Some(run.guard))
    }
}

/// Checkpoints the job `p` names into `p.dir` as [`checkpoint`] does with `leave_running`, up to
/// the commit, and leaves it held there. No checkpoint is kept (the buffers are all saved while
/// the job is held), so that the image is the job as it is when it is let go.
pub fn checkpoint_held<'a>(
    p: &'a CheckpointParams,
    obs: &mut dyn Observer,
) -> Result<HeldCheckpoint<'a>, CheckpointError> {
    let t_all = Instant::now();
    if !p.leave_running || p.gpu_only {
        return Err(PlanError::NotHeldWhole { pid: p.pid }.into());
    }
    let run = hold_and_commit(p, obs, true)?;
    Ok(HeldCheckpoint { run, t_all })
}

/// Adds what `copies` say they wrote into the images' data files (a copy that does not say:
/// nothing, its files read again whole by a migration).
fn add_written(w: &mut Written, copies: &[DeviceCopy]) {
    for f in copies.iter().flat_map(|c| c.written.iter().flatten()) {
        w.add((f.dev, f.ino), f.ranges.iter().map(|&[at, len]| (at, len)));
    }
}

/// The phases up to the commit (the guard told of it); `held`: no kept checkpoint.
fn hold_and_commit<'a>(
    p: &'a CheckpointParams,
    obs: &mut dyn Observer,
    held: bool,
) -> Result<Run<'a>, CheckpointError> {
    let plan = plan(p)?;
    let mut run = Run::start(plan, obs)?;
    run.no_kept = held;
    let held = (|| -> Result<(), HoldError> {
        run.hold_ranks(obs)?;
        run.precopy(obs)?;
        if run.by_possum() {
            obs.precopied(&run.tmp, &run.written);
            run.more_rounds(obs)?;
            if run.ranks_held_since.is_none() {
                obs.ready_to_cut();
            }
        }
        // CRIU's worker and the relay's pipes made ready beside the cut and the driver.
        let ready = run.ready_dump();
        run.cut(obs)?;
        let by_possum = run.by_possum();
        if by_possum {
            let gpu: Vec<String> = (run.possum_processes(&run.tmp).into_iter())
                .filter(|(_, d)| d.is_dir())
                .filter_map(|(_, d)| Some(d.file_name()?.to_str()?.to_string()))
                .collect();
            obs.held(&run.tmp, &gpu, &run.written);
        }
        run.freeze()?;
        run.dump(obs, ready)?;
        if by_possum {
            run.figures.held_send_wait = obs.dumped();
        }
        Ok(())
    })();
    if let Err(source) = held {
        run.guard.undo();
        return Err(CheckpointError::Held { pid: p.pid, source });
    }
    if let Err(e) = run.save_kept() {
        run.guard.undo();
        return Err(CheckpointError::KeptSave(e));
    }
    run.split_host_memory(obs);
    // Drafts of the job's memory a migration sent ahead and the split did not take.
    let _ = fs::remove_dir_all(run.tmp.join(possum_criu::hostmem::ahead::AHEAD_DIR));
    if let Err(source) = run.commit() {
        run.guard.undo();
        let dir = p.dir.clone();
        return Err(CheckpointError::Commit { dir, source });
    }
    run.guard.step(Step::Committed);
    Ok(run)
}

mod error;
pub use error::*;
mod params;
pub use params::CheckpointParams;
mod plan;
use plan::{plan, temp_sibling, Plan, ProcessSide, CUDA_ERROR_NOT_SUPPORTED};

/// A checkpoint under way: the plan, its guard, and what each phase found.
struct Run<'a> {
    plan: Plan<'a>,
    /// The image's temporary directory (named `p.dir` at the commit).
    tmp: PathBuf,
    /// possum's lock on it (the guard takes its own: see [`temps`]).
    _lock: TempLock,
    guard: Guard,
    figures: CheckpointFigures,
    engine_report: Option<Reply<CheckpointReply>>,
    release_report: Option<Reply<ReleaseReply>>,
    resume_report: Option<Reply<ResumeReply>>,
    saved_report: Option<Vec<SavedOf>>,
    /// Processes whose checkpoint is kept (their buffers saved after the resume).
    kept: Vec<i32>,
    /// What the keeper holds for the restore, by epoch (a job killed with its memory kept).
    held_memory: Vec<HeldMemory>,
    /// During a kept hold: fds of the memory the job detached, in case its keeper dies.
    held_thread: Option<JoinHandle<HeldHandles>>,
    /// When the ranks' collective launches were first held ([`Run::hold_ranks`]).
    ranks_held_since: Option<Instant>,
    handles: Option<HeldHandles>,
    keeper_handles: Value,
    /// CRIU's dump was made into `tmp/criu`.
    dumped: bool,
    /// The image's description, once committed.
    manifest: Option<Manifest>,
    criu_bytes: u64,
    gpu_bytes: u64,
    /// No checkpoint kept: every buffer saved while the job is held ([`checkpoint_held`]).
    no_kept: bool,
    /// The dump left the job's tree stopped ([`Run::dump`]).
    stopped: bool,
    /// Every process pre-copied trusting its hooks, none kept: more rounds may follow.
    rounds_possible: bool,
    /// The job's TCP connections put in repair mode before its kill ([`Run::kill`]).
    tcp_quiet: Option<QuietConnections>,
    /// What the last copy (a pre-copy round, or the cut's) wrote into the images' data files,
    /// as the job's library said it.
    written: Written,
}

impl<'a> Run<'a> {
    /// Makes the temporary image directory and starts the guard.
    fn start(plan: Plan<'a>, obs: &mut dyn Observer) -> Result<Run<'a>, PlanError> {
        let p = plan.p;
        let tmp = temp_sibling(&p.dir)?;
        let _ = fs::remove_dir_all(&tmp);
        let temp_dir_error = |source| PlanError::TempDir {
            dir: tmp.clone(),
            source,
        };
        fs::create_dir_all(&tmp).map_err(temp_dir_error)?;
        let lock = TempLock::take(&tmp).map_err(temp_dir_error)?;
        if let (Some(parent), Some(name)) = (tmp.parent(), p.dir.file_name()) {
            for old in temps::sweep(parent, &name.to_string_lossy(), &tmp) {
                obs.note(&format!(
                    "removed {}: a checkpoint's temporary directory that nothing uses any more \
                     (its possum and guard are gone)",
                    old.display()
                ));
            }
        }
        let guard_plan = GuardPlan {
            pid: p.pid,
            children: plan.children.clone(),
            possum_children: plan.possum_children.clone(),
            tmp: tmp.clone(),
            final_dir: p.dir.clone(),
            socket_dir: p.sockets.clone(),
            libcuda: p.env.libcuda.clone(),
            driver_deadlines: p.env.driver_deadlines,
            gpu_bytes: gpu_memory_bytes(&plan.gpu_memory),
        };
        let guard = Guard::start(&p.possum_exe, &guard_plan).map_err(PlanError::Guard)?;
        Ok(Run {
            plan,
            tmp,
            _lock: lock,
            guard,
            figures: CheckpointFigures::default(),
            engine_report: None,
            release_report: None,
            resume_report: None,
            saved_report: None,
            kept: Vec::new(),
            held_memory: Vec::new(),
            held_thread: None,
            ranks_held_since: None,
            handles: None,
            keeper_handles: Value::Null,
            dumped: false,
            manifest: None,
            criu_bytes: 0,
            gpu_bytes: 0,
            no_kept: false,
            stopped: false,
            rounds_possible: true,
            tcp_quiet: None,
            written: Written::new(),
        })
    }

    fn params(&self) -> &'a CheckpointParams {
        self.plan.p
    }

    /// possum takes the GPU side.
    fn by_possum(&self) -> bool {
        self.params().engine == Engine::Possum
    }

    /// The job's threads are parked (hooks off): its buffers are copied at the cut.
    fn parked(&self) -> bool {
        self.plan.hooks.as_ref().is_some_and(|h| !h.live)
    }

    /// Every process whose buffers possum checkpoints, the root first, each with its GPU
    /// images' directory under `dir`.
    /// Where process `pid`'s GPU images are in the parent image, if one was given and has them.
    fn parent_of(&self, pid: i32) -> Option<String> {
        let parent = self.params().parent.as_deref()?;
        self.possum_processes(parent)
            .into_iter()
            .find(|(p, dir)| *p == pid && dir.is_dir())
            .map(|(_, dir)| dir.display().to_string())
    }

    fn possum_processes(&self, dir: &Path) -> Vec<(i32, PathBuf)> {
        let root = (self.params().pid, dir.join("gpu"));
        let children = self.plan.possum_children.iter();
        std::iter::once(root)
            .chain(children.map(|&c| (c, dir.join(child_gpu_dir(c)))))
            .collect()
    }

    /// Ranks: a tree of several processes with possum whose NCCL ranks first stand at one
    /// collective boundary ([`crate::ranks`]), their collective launches held there until they
    /// resume. Before the pre-copy: a rank waiting on a peer's collective (in a copy that waits
    /// for it, say) would keep its pre-copy from starting; at the boundary, every collective
    /// launched is joined. The job's other work goes on until it needs a held collective.
    fn hold_ranks(&mut self, obs: &mut dyn Observer) -> Result<(), CutError> {
        if !self.by_possum() || self.plan.possum_children.is_empty() {
            return Ok(());
        }
        let p = self.params();
        self.guard.step(Step::Cutting);
        let pids: Vec<i32> = self
            .possum_processes(&self.tmp)
            .into_iter()
            .map(|(pid, _)| pid)
            .collect();
        let t = Instant::now();
        if let Some(cut) = crate::ranks::cut(&pids, &JobRanks(&p.sockets), p.env.cut_deadline)? {
            self.ranks_held_since = Some(t);
            obs.note(&format!(
                "ranks {:?} stand at collective {} (they had launched {:?}; {:.0} ms)",
                cut.ranks,
                cut.target,
                cut.reached,
                cut.waited.as_secs_f64() * 1e3
            ));
        }
        Ok(())
    }

    /// Pre-copy: every buffer copied into the image while the job runs (a job left running
    /// whose memory a keeper holds: nothing copied now, `kept`). Engine possum only.
    fn precopy(&mut self, obs: &mut dyn Observer) -> Result<(), PrecopyError> {
        if !self.by_possum() {
            return Ok(());
        }
        let p = self.params();
        if self.no_kept {
            // Held for a migration: where its destination can load the images ahead.
            let (keeper, gpu_memory) = (self.plan.keeper.clone(), self.plan.gpu_memory.clone());
            let hint = crate::prestage::AheadHint { keeper, gpu_memory };
            crate::prestage::write_hint(&self.tmp, &hint, obs);
        }
        obs.copying(self.plan.managed, &self.tmp.join("gpu"));
        // (In the temporary directory, as the cut's; gone once the round is over.)
        let journal = self.tmp.join(job::FIRST_ROUND_JOURNAL);
        let journal = obs.first_round(&self.tmp, &journal).then_some(journal);
        let t = Instant::now();
        let mut first = PrecopyRound::default();
        self.written = Written::new();
        for (pid, gpu) in self.possum_processes(&self.tmp) {
            let dir = gpu.display().to_string();
            let kept = p.leave_running && !p.gpu_only && !self.no_kept;
            let parent = self.parent_of(pid);
            let journal = journal.as_deref().filter(|_| pid == p.pid);
            let r = timed(&mut self.figures.engine_snapshot, || {
                let to = To::Sockets(&p.sockets);
                job::precopy_journaled(pid, to, (dir, kept, parent), journal)
            })?;
            if r.body.kept {
                self.kept.push(pid);
            }
            // Rounds only where every process pre-copied, trusting its hooks.
            self.rounds_possible &= r.body.hooks == Some(true) && !r.body.kept;
            first.add(&r.body.precopy);
            add_written(&mut self.written, &r.body.precopy);
            if pid == p.pid {
                self.engine_report = Some(r);
            }
        }
        first.took = t.elapsed();
        self.figures.precopy_rounds.push(first);
        if !self.parked() {
            obs.copied();
        }
        Ok(())
    }

    /// More pre-copy rounds after the first, the job running (at most `precopy_rounds` in
    /// all, a CUDA job whose every process pre-copied trusting its hooks): each copies what was
    /// written since the one before into the same images, and is told to `obs` (a migration
    /// sends it ahead). They stop once a round copies nothing, or no less than the one before:
    /// the rest is copied at the cut.
    fn more_rounds(&mut self, obs: &mut dyn Observer) -> Result<(), PrecopyError> {
        let p = self.params();
        if p.precopy_rounds <= 1 || !self.rounds_possible || self.plan.runtime == GpuRuntime::Hip {
            return Ok(());
        }
        let mut last = self.figures.precopy_rounds.first().map_or(0, |r| r.bytes);
        for n in 2..=p.precopy_rounds {
            let t = Instant::now();
            let mut round = PrecopyRound::default();
            self.written = Written::new();
            for (pid, _) in self.possum_processes(&self.tmp) {
                let r = timed(&mut self.figures.engine_snapshot, || {
                    job::precopy_round(pid, To::Sockets(&p.sockets))
                })?;
                round.add(&r.body.precopy);
                add_written(&mut self.written, &r.body.precopy);
            }
            round.took = t.elapsed();
            self.figures.precopy_rounds.push(round);
            obs.note(&format!(
                "pre-copy round {n}: {} bytes written since the round before, copied in {:.0} ms",
                round.bytes,
                round.took.as_secs_f64() * 1e3
            ));
            obs.precopied(&self.tmp, &self.written);
            if round.bytes == 0 || round.bytes >= last {
                break;
            }
            last = round.bytes;
        }
        Ok(())
    }

    /// Cut (T0): the job's GPU operations held (at the op gate, or its threads parked), what
    /// was written since the pre-copy copied, the images committed and the buffers' memory
    /// released (a job to be killed whose memory a keeper holds: left with the keeper).
    fn cut(&mut self, obs: &mut dyn Observer) -> Result<(), CutError> {
        if !self.by_possum() {
            return Ok(());
        }
        let p = self.params();
        if let Some(t) = self.ranks_held_since {
            self.figures.ranks_cut = Some(t.elapsed());
        }
        self.guard.step(Step::Releasing);
        let keeping = (!p.leave_running && !p.gpu_only && self.plan.keeper.is_some())
            .then_some(p.keep_on_gpu);
        // (In the temporary directory, where the job may write; gone once the cut is over.)
        let journal = self.tmp.join(job::FINAL_COPY_JOURNAL);
        let journal = obs.cutting(&self.tmp, &journal).then_some(journal);
        let r = timed(&mut self.figures.release, || {
            job::cut(
                p.pid,
                To::Sockets(&p.sockets),
                (keeping, journal.as_deref()),
            )
        })?;
        self.written = Written::new();
        add_written(&mut self.written, &r.body.finals);
        self.held_memory = HeldMemory::from_release(p.pid, &r.body);
        self.release_report = Some(r);
        for &c in &self.plan.possum_children {
            let r = timed(&mut self.figures.release, || {
                job::cut(c, To::Sockets(&p.sockets), (keeping, None))
            })
            .map_err(|source| CutError::Child { pid: c, source })?;
            add_written(&mut self.written, &r.body.finals);
            self.held_memory
                .extend(HeldMemory::from_release(c, &r.body));
        }
        obs.copied();
        // Taken while the driver and CRIU work (a few ms), not before them.
        if let (true, false, Some(k)) =
            (p.env.keeper_revive, self.kept.is_empty(), &self.plan.keeper)
        {
            let (dir, pids) = (k.dir.clone(), self.kept.clone());
            self.held_thread = Some(std::thread::spawn(move || {
                HeldHandles::collect(&dir, &pids)
            }));
        }
        Ok(())
    }

    /// Freeze: the driver locks every CUDA process of the tree and checkpoints what possum does
    /// not manage (contexts, other memory). Not for `--gpu-only`, nor for a HIP job (no driver).
    fn freeze(&mut self) -> Result<(), FreezeError> {
        let Some(drv) = self.plan.driver() else {
            return Ok(());
        };
        let pid = self.params().pid;
        let cupti = self.by_possum() && self.plan.hooks.as_ref().is_some_and(|h| h.cupti);
        self.guard.step(Step::Locking);
        timed(&mut self.figures.driver_lock, || {
            drv.lock(pid, LOCK_TIMEOUT_MS)
        })
        .map_err(|e| {
            if cupti && e.code() == Some(CUDA_ERROR_NOT_SUPPORTED) {
                FreezeError::CuptiRefused(e)
            } else {
                e.into()
            }
        })?;
        for &c in &self.plan.children {
            timed(&mut self.figures.driver_lock, || {
                drv.lock(c, LOCK_TIMEOUT_MS)
            })
            .map_err(|source| FreezeError::LockChild { pid: c, source }.deadline_first())?;
        }
        let limit = self.driver_limit(|d| d.checkpoint);
        timed(&mut self.figures.driver_checkpoint, || {
            drv.checkpoint(pid, limit)?;
            for &c in &self.plan.children {
                drv.checkpoint(c, limit).map_err(|error| {
                    FreezeError::CheckpointChild { pid: c, error }.deadline_first()
                })?;
            }
            Ok(())
        })
    }

    /// Dump: CRIU dumps the held tree (`--leave-running`: it stays held, for the phases after).
    /// A job that is not to run on here at once (killed after the commit, or held for a
    /// migration) is left stopped too (SIGSTOP while CRIU holds it frozen): what its CPU threads
    /// would do after the dump without a GPU operation (write a log, say) would be done again
    /// where the image is restored. It is killed stopped, or continued before it runs on (the
    /// guard continues it before it undoes anything).
    fn dump(&mut self, obs: &mut dyn Observer, ready: ReadyDump) -> Result<(), CriuError> {
        if let Some((criu, opts)) = self.dump_options() {
            let p = self.params();
            if opts.leave_stopped {
                self.guard.step(Step::Stopped);
            }
            let ready = ready.take();
            self.figures.criu_ready = ready.as_ref().map(PreparedDump::took);
            self.guard.step(Step::Dumping);
            let dump = timed(&mut self.figures.criu_dump, || {
                dump_retrying_transient(&criu, &opts, ready, p.pid, obs)
            });
            self.guard.step(Step::Dumped);
            let dump = dump?;
            self.stopped = dump.stopped;
            self.criu_bytes = dump.image_bytes;
            self.figures.criu_dump_stats = dump.stats.map(Into::into);
            self.figures.criu_pages_read = dump.pages_read.as_ref().map(|r| r.time);
            self.figures.criu_pages_read_bytes = dump.pages_read.as_ref().map(|r| r.bytes());
            self.figures.criu_pages_relayed = dump.pages_relayed.as_ref().map(|r| r.time);
            self.figures.criu_pages_relayed_bytes = dump.pages_relayed.as_ref().map(|r| r.bytes());
            self.figures.criu_post_dump_at = dump.post_dump_at;
            self.dumped = true;
        }
        self.gpu_bytes = dir_bytes(&self.tmp.join("gpu"));
        Ok(())
    }

    /// CRIU's dump made ready on a thread ([`possum_criu::Criu::prepare_dump`]: its worker
    /// started, the relay's pipes made), while the cut and the driver's checkpoint run. Only
    /// for possum's engine: the driver route's CRIU runs as CRIU alone would.
    fn ready_dump(&self) -> ReadyDump {
        let made = self.by_possum().then(|| self.dump_options()).flatten();
        ReadyDump(made.and_then(|(criu, opts)| {
            (std::thread::Builder::new().name("possum-criu-ready".into()))
                .spawn(move || criu.prepare_dump(opts))
                .ok()
        }))
    }

    /// CRIU and the options of its dump of the held tree ([`Run::dump`]); none without a CPU
    /// side.
    fn dump_options(&self) -> Option<(Criu, DumpOptions)> {
        let ProcessSide { criu, .. } = self.plan.side.as_ref()?;
        let p = self.params();
        let mut opts = DumpOptions::new(p.pid, self.tmp.join("criu"));
        opts.leave_running = true;
        opts.leave_stopped = !p.leave_running || self.no_kept;
        opts.shell_job = self.plan.shell_job;
        opts.ext_unix_sk = true;
        if let Some(l) = p.env.criu_log_level {
            opts.log_level = l;
        }
        // (Not for the driver engine: the baseline stays plain CRIU.)
        if self.by_possum() {
            opts.pages = p.env.dump_pages;
            opts.relay_watch = Some(p.relay_watch.clone());
        }
        // A server's listener may hold connections not accepted yet: they stay out of the
        // image (a job left running accepts them after; a restored one has them no more)
        // rather than failing the dump.
        opts.tcp_skip_in_flight = true;
        if let Some(lock) = p.tcp_established {
            opts.tcp_established = true;
            opts.network_lock = Some(lock.into());
        }
        Some((criu.clone(), opts))
    }

    /// Continues the tree the dump left stopped (SIGCONT), before it runs on. A process that
    /// cannot be signalled has ended (its pidfd says so) or is not the job's.
    fn continue_stopped(&mut self) {
        if std::mem::take(&mut self.stopped) {
            let _ = crate::process::continue_tree(self.params().pid);
        }
    }

    /// Save of a kept checkpoint: its GPU images are complete only once saved, after the job
    /// runs again. The driver restores and unlocks the tree, a keeper that died during the hold
    /// is revived, every possum process resumes from its images under the temporary directory
    /// (the kept ones saving their buffers as of the hold), and the saves are waited for.
    fn save_kept(&mut self) -> Result<(), ResumeError> {
        self.handles = self.held_thread.take().and_then(|t| t.join().ok());
        if self.kept.is_empty() {
            return Ok(());
        }
        let p = self.params();
        self.driver_restore_and_unlock()?;
        // With the tree running again in the driver (a new CUDA process, a keeper, is not
        // started while one is checkpointed), before any buffer is attached again.
        if let (Some(h), Some(k)) = (&self.handles, &self.plan.keeper) {
            self.keeper_handles = timed(&mut self.figures.keeper_check, || {
                h.revive(k, &p.possum_exe, p.pid)
            });
        }
        for (pid, gpu) in self.possum_processes(&self.tmp) {
            let dir = gpu.display().to_string();
            let save = (self.kept.contains(&pid)).then(|| (p.shadow_budget, self.parent_of(pid)));
            let r = timed(&mut self.figures.resumed.resume, || {
                job::resume(pid, To::Sockets(&p.sockets), dir, save)
            })
            .map_err(|source| ResumeError::Process { pid, source })?;
            if pid == p.pid {
                self.resume_report = Some(r);
            }
        }
        self.guard.step(Step::Resumed);
        let mut saved = Vec::new();
        for &pid in &self.kept {
            let report = timed(&mut self.figures.saved, || {
                ask_within::<SavedReply>(pid, &p.sockets, &Request::Saved, SAVE_TIMEOUT)
            })
            .map_err(|source| ResumeError::Save { pid, source })?;
            saved.push(SavedOf { pid, report });
        }
        self.saved_report = Some(saved);
        Ok(())
    }

    /// Split: the bulk of the job's private memory out of CRIU's images, for possum's plugin to
    /// write back in parallel at restore (`possum_criu::hostmem`). Not while a job left running
    /// without a keeper is still held (it would lengthen its stall) unless
    /// `POSSUM_HOSTMEM_SPLIT=always` or it is held for a migration (whose destination restores
    /// it); not for the driver engine (the baseline stays plain CRIU).
    /// A failure leaves the images whole (CRIU restores them itself) and is said on stderr.
    fn split_host_memory(&mut self, obs: &mut dyn Observer) {
        use possum_criu::hostmem;
        let p = self.params();
        let (Some(ProcessSide { criu, .. }), true) = (&self.plan.side, self.by_possum()) else {
            return;
        };
        let always = p.env.hostmem_split == HostmemSplit::Always;
        // A job held for a migration waits for its image to be sent anyway: the split's few
        // milliseconds spare the destination CRIU's one-thread fill of that memory.
        if self.kept.is_empty() && p.leave_running && !self.no_kept && !always {
            return;
        }
        if p.env.hostmem_split == HostmemSplit::Off {
            self.figures.hostmem = Some(HostmemFigures::Off {
                off: "POSSUM_HOSTMEM_SPLIT=0",
            });
            return;
        }
        // Only possum's CRIU plugin writes split memory back: no plugin here, no split.
        if !criu.has_possum_plugin() {
            self.figures.hostmem = Some(HostmemFigures::Off {
                off: "no CRIU plugin",
            });
            return;
        }
        let criu_dir = self.tmp.join("criu");
        // CRIU's pages file becomes the data file as it is (renamed), or the draft a migration
        // sent ahead does, with a tail of what it lacked: a migration sends the first in parts,
        // which the receiver writes all at once, the second as the file sent ahead.
        let ahead = self.tmp.join(hostmem::ahead::AHEAD_DIR);
        let opts = hostmem::SplitOptions {
            ahead: ahead.is_dir().then_some(ahead),
            ..hostmem::SplitOptions::default()
        };
        let r = timed(&mut self.figures.hostmem_split, || {
            hostmem::split(&criu_dir, &opts)
        });
        self.figures.hostmem = Some(match r {
            Ok(rep) => {
                // A draft sent ahead is the data file as it was sent: nothing of it is read again.
                for f in rep.split.iter().filter_map(|t| t.rebased.as_ref()) {
                    self.written.add(f.inode, []);
                }
                HostmemFigures::of_split(&rep)
            }
            Err(e) => {
                let e = format!("{:#}", anyhow::Error::from(e));
                obs.note(&format!(
                    "CRIU restores the job's memory itself (splitting its images failed: {e})"
                ));
                HostmemFigures::Failed { error: e }
            }
        });
    }

    /// The image's description (its figures are added at the report).
    fn manifest(&mut self) -> Manifest {
        let p = self.params();
        Manifest {
            possum_image: MANIFEST_VERSION,
            engine: p.engine,
            runtime: self.plan.runtime,
            pid: p.pid,
            shell_job: self.plan.shell_job,
            socket_dir: p.sockets.clone(),
            created: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            criu_dir: self.dumped.then(|| "criu".into()),
            gpu_dir: (p.engine == Engine::Possum).then(|| "gpu".into()),
            gpu_memory: self.plan.gpu_memory.clone(),
            cuda_children: self.plan.children.clone(),
            possum_children: self.plan.possum_children.clone(),
            socket_dirs: self.plan.socket_dirs.clone(),
            stdio_pipes: self.plan.stdio_pipes.clone(),
            keeper: self.plan.keeper.clone(),
            held: std::mem::take(&mut self.held_memory),
            owner: self.plan.owner,
            tcp_established: p.tcp_established.filter(|_| self.dumped),
            figures: Value::Null,
            check: None,
        }
    }

    /// The job is still held, to be resumed after the commit (left running, not a kept
    /// checkpoint, which resumed before).
    fn held_until_resume(&self) -> bool {
        let p = self.params();
        (p.leave_running || p.gpu_only) && self.kept.is_empty()
    }

    /// Commit: the image's files made durable, then `possum.json`, the commit marker, written
    /// atomically ([`write_marker`]) and the image named (`--force`: the old one removed only
    /// now). Fails if DIR appeared meanwhile and is not empty: nothing is overwritten. While a
    /// job left running is still held, the files are made durable by the report instead (the
    /// job's stall would include it), which writes the marker again after them.
    fn commit(&mut self) -> Result<(), CommitError> {
        let sync_first = !self.held_until_resume();
        let manifest = self.manifest();
        let manifest = self.manifest.insert(manifest);
        let (tmp, dir, force) = (&self.tmp, &self.plan.p.dir, self.plan.p.force);
        timed(&mut self.figures.commit, || {
            if sync_first {
                sync_tree(tmp).map_err(CommitError::Sync)?;
            }
            write_marker(tmp, &manifest_text(manifest)?)?;
            if force && dir.exists() {
                let old = tmp.with_extension("old");
                fs::rename(dir, &old)?;
                fs::rename(tmp, dir)?;
                let _ = fs::remove_dir_all(&old);
            } else {
                let _ = fs::remove_dir(dir);
                fs::rename(tmp, dir)?;
            }
            // The lock file was the temporary directory's, not the image's.
            let _ = fs::remove_file(dir.join(temps::LOCK_FILE));
            // The new name made durable (best effort: the image is named now, whatever this
            // says).
            let parent = dir.parent().filter(|p| !p.as_os_str().is_empty());
            let _ = fs::File::open(parent.unwrap_or(Path::new("."))).and_then(|d| d.sync_all());
            Ok(())
        })
    }

    /// Kills the job's tree. Its established TCP connections, when the dump took them, are put
    /// in repair mode first, and their peers' acknowledgements of what the job sent awaited:
    /// their peers are not told, and the connections go on once the job is restored.
    fn kill(&mut self) -> nix::Result<()> {
        let p = self.params();
        let t = Instant::now();
        let quieted = (self.dumped && p.tcp_established.is_some()).then(|| {
            let mut q = tcp::quiet_connections(p.pid);
            q.await_acks(tcp::ACK_WAIT);
            q
        });
        let killed = kill_job(p.pid);
        self.figures.kill = Some(t.elapsed());
        match quieted {
            // The job runs on (the guard undoes the checkpoint): its connections too.
            Some(q) if killed.is_err() => q.undo(),
            Some(q) => self.tcp_quiet = Some(q.report),
            None => {}
        }
        killed
    }

    /// Resume or kill: with `--leave-running` (or `--gpu-only`) the driver restores and unlocks
    /// the tree and possum resumes each process from the named image, its buffers back on
    /// demand; otherwise the job is killed. A kept checkpoint has resumed already.
    fn resume_or_kill(&mut self) -> Result<(), ResumeError> {
        let p = self.params();
        if !self.kept.is_empty() {
            return Ok(());
        }
        if !p.leave_running && !p.gpu_only {
            return self.kill().map_err(Into::into);
        }
        self.driver_restore_and_unlock()?;
        if !self.by_possum() {
            return Ok(());
        }
        for (pid, gpu) in self.possum_processes(&p.dir) {
            let dir = gpu.display().to_string();
            let r = timed(&mut self.figures.resumed.resume, || {
                job::resume(pid, To::Sockets(&p.sockets), dir, None)
            });
            match r {
                Ok(r) if pid == p.pid => self.resume_report = Some(r),
                Ok(_) => {}
                Err(e) if pid == p.pid => return Err(e.into()),
                Err(source) => return Err(ResumeError::Child { pid, source }),
            }
        }
        self.guard.step(Step::Resumed);
        Ok(())
    }

    /// The deadline of a driver call that moves the job's GPU memory (`which` of the
    /// environment's [`DriverDeadlines`](crate::DriverDeadlines)), sized by what nvidia-smi saw
    /// the job use at the plan.
    fn driver_limit(&self, which: impl Fn(&crate::DriverDeadlines) -> Deadline) -> Duration {
        let bytes = gpu_memory_bytes(&self.plan.gpu_memory);
        which(&self.params().env.driver_deadlines).for_bytes(bytes)
    }

    /// The driver's restore, then unlock, of the job and the other CUDA processes of its tree,
    /// on the same GPUs (none for `--gpu-only` or a HIP job).
    fn driver_restore_and_unlock(&mut self) -> Result<(), DriverCkptError> {
        let Some(drv) = self.plan.driver() else {
            return Ok(());
        };
        let tree: Vec<i32> = std::iter::once(self.params().pid)
            .chain(self.plan.children.iter().copied())
            .collect();
        let limit = self.driver_limit(|d| d.restore);
        timed(&mut self.figures.resumed.driver_restore, || {
            tree.iter().try_for_each(|&p| drv.restore(p, &[], limit))
        })?;
        timed(&mut self.figures.resumed.driver_unlock, || {
            tree.iter().try_for_each(|&p| drv.unlock(p))
        })?;
        self.guard.step(Step::Unlocked);
        Ok(())
    }

    /// The time the job waited on possum after it ran again, and on which buffers: a kept
    /// checkpoint's saves (known once saved); none for a job not left running or one whose
    /// buffers were all back when it ran again; not known while they come back on demand.
    fn account_job_waited(
        f: &mut CheckpointFigures,
        saved: Option<&[SavedOf]>,
        resume: Option<&Reply<ResumeReply>>,
        leave_running: bool,
    ) {
        if let Some(saved) = saved {
            let copies = saved.iter().flat_map(|s| &s.report.body.saved);
            let ms: f64 = copies.clone().filter_map(|c| c.job_waited_ms).sum();
            let all = copies.flat_map(|c| c.waited_on.iter().flatten().cloned());
            f.waited_on = longest_waits(all.collect(), WAITED_ON_TOP);
            f.job_waited = Some(Duration::from_secs_f64(ms.max(0.0) / 1e3));
            return;
        }
        let on_demand =
            resume.is_some_and(|r| r.body.on_demand == Some(true) && !r.body.restoring.is_empty());
        f.job_waited = (!leave_running || !on_demand).then_some(Duration::ZERO);
    }

    /// Report: the guard let go, the image made durable (nothing was fsynced while the job was
    /// held), the figures accounted and written into the image too (best effort: the image is
    /// already complete).
    fn report(self, t_all: Instant) -> Result<CheckpointReport, ReportError> {
        self.report_guarded(t_all, false).map(|(r, _)| r)
    }

    /// [`Run::report`], the guard kept watching (`keep`: a migration's, until the destination
    /// runs the job) and handed back; told it is done if the report fails.
    fn report_guarded(
        mut self,
        t_all: Instant,
        keep: bool,
    ) -> Result<(CheckpointReport, Option<Guard>), ReportError> {
        let p = self.params();
        let hold = self.hold_in_words();
        let parked = self.parked();
        let mut guard = Some(self.guard);
        if let Some(g) = guard.take_if(|_| !keep) {
            g.done();
        }
        if let Err(e) = timed(&mut self.figures.sync, || sync_tree(&p.dir)) {
            if let Some(g) = guard {
                g.done();
            }
            return Err(ReportError::Sync(e));
        }
        let kept = !self.kept.is_empty();
        self.figures.total = t_all.elapsed();
        Self::account_job_waited(
            &mut self.figures,
            self.saved_report.as_deref(),
            self.resume_report.as_ref(),
            p.leave_running,
        );
        // A job held to the commit (a migration's) was held through the split too.
        let split_in_hold = !kept && (p.leave_running || self.no_kept);
        self.figures.account_stall(kept, split_in_hold);
        self.figures.criu_image_bytes = self.criu_bytes;
        self.figures.gpu_image_bytes = self.gpu_bytes;
        self.figures.image_bytes = self.criu_bytes + self.gpu_bytes;
        let manifest = self.manifest.take();
        let report = CheckpointReport {
            pid: p.pid,
            cuda_children: self.plan.children,
            possum_children: self.plan.possum_children,
            engine: p.engine,
            runtime: self.plan.runtime,
            dir: p.dir.clone(),
            leave_running: p.leave_running,
            hooks: self.plan.hooks.and_then(|h| h.mode),
            hold,
            figures: self.figures,
            engine_report: self.engine_report,
            release_report: self.release_report,
            kept: self.kept,
            saved_report: self.saved_report,
            resume_report: self.resume_report,
            keeper_handles: self.keeper_handles,
            parked,
            tcp_quiet: self.tcp_quiet,
            mismatch_retries: 0,
        };
        // Held until the job has its memory again (and the save is committed).
        drop(self.handles);
        if let Some(mut manifest) = manifest {
            manifest.figures = serde_json::to_value(&report).unwrap_or_default();
            if let Ok(text) = manifest_text(&manifest) {
                let _ = write_marker(&p.dir, &text);
            }
        }
        Ok((report, guard))
    }

    /// How the job was held, in words.
    fn hold_in_words(&self) -> String {
        let copied = self
            .release_report
            .as_ref()
            .map_or(0, |r| r.body.copied().0);
        match (self.params().engine, &self.plan.hooks) {
            (Engine::Driver, _) | (_, None) => "driver lock".to_string(),
            (Engine::Possum, Some(_)) if !self.kept.is_empty() => {
                "op gate: buffers left on the GPU with the keeper while held (nothing copied), \
                 saved as of the hold while the job ran on"
                    .to_string()
            }
            (Engine::Possum, Some(h)) if !h.live => {
                "threads parked (hooks off): every buffer copied while held".to_string()
            }
            (Engine::Possum, Some(h)) => format!(
                "op gate ({}): pre-copy while the job ran, then {copied} buffers written since \
                 copied while held",
                h.seen_by()
            ),
        }
    }
}

mod dump;
use dump::{dump_retrying_transient, ReadyDump};
mod refusals;

#[cfg(test)]
mod tests;
