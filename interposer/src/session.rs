//! Checkpoint sessions inside the job, driven by `possum checkpoint` / `possum restore` over the
//! control socket (`Checkpoint`, `Release`, `Resume`).
//!
//! ```text
//! Checkpoint{dir} ─ every engine: a pre-copy round into an image at dir/gpu-N, while the job
//!                   runs (every buffer; the ones written meanwhile are marked dirty)
//! Release         ─ PAUSE: the job's next GPU operation (launch, copy, memset, cudaMalloc/Free)
//!                   waits; T0 is now: every engine copies its dirty buffers into the same image,
//!                   commits it and releases its buffers
//!   ... the CLI: driver lock + checkpoint, CRIU dump (maybe a kill; then a CRIU restore) ...
//! Resume{dir}     ─ every engine: on-demand restore from dir/gpu-N installed ─ UNPAUSE
//! ```
//!
//! Why T0 is the pause and not the start of the checkpoint: CRIU dumps the CPU side while the job
//! is paused, so the GPU image must hold the buffers as they are then. The bulk is copied before
//! (pre-copy, the job running); only what the job wrote since is copied during the pause.
//!
//! Invariant: while paused, no thread of the job is between a hook and its enqueue (the engine's
//! gate waits for those at release), and none enters one (the pause is checked first), so the
//! job never touches a released buffer. The pause waits in the CUDA call's entry callback, before
//! the driver did anything for that call.

pub(crate) use crate::replies::{ms, reply, round_copy, to_json, waited_on, with_prints, Beating};
pub(crate) use crate::spare::SpareSaver;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};
use possum_control::reply::{
    CheckpointReply, DeviceCopy, DeviceMoved, HeldEpoch, HoldAttempt, ReleaseReply, ResumeReply,
    SavedReply, StageTaken,
};
use possum_engine::image::{Image, ImageWriter, WriterOptions};
use possum_engine::store::ChunkSink;
use serde_json::{json, Value};

use crate::config;
use crate::cupti::{cupti_attached, cupti_detach, hooks_live};
use crate::log::log;
use crate::runtime::{state_if_created, DevEngine};
use crate::{ab, gate, park};

/// One session at a time (a second `possum checkpoint` is refused).
static BUSY: Mutex<Option<&'static str>> = Mutex::new(None);
/// The last session's figures, for `possum status`.
static LAST: Mutex<Value> = Mutex::new(Value::Null);
/// The write path's fault count ([`gate::faults`]) when the checkpoint in progress began: one
/// more at its commit and the checkpoint is undone ([`no_faults_since_open`]).
static FAULTS_AT_OPEN: AtomicU64 = AtomicU64::new(0);
/// The checkpoint in progress: from `Checkpoint` (pre-copy) to `Release` (the dirty rest, commit).
static OPEN: Mutex<Option<Open>> = Mutex::new(None);

/// Images being written, one per device, under `dir` (a held release may start them again).
struct Open {
    dir: PathBuf,
    /// The earlier image whose unchanged chunks the images reference (`--parent`).
    parent: Option<PathBuf>,
    writers: Vec<(usize, Arc<ImageWriter>)>,
    /// A kept checkpoint: the buffers' memory stays with the keeper at the release (detached,
    /// nothing copied); `ResumeAndSave` saves them after the job runs again.
    kept: bool,
    /// The images hold a pre-copy (made trusting the hooks to mark what the job writes next).
    precopied: bool,
}

/// Saving a kept checkpoint's buffers while the job runs (`ResumeAndSave` to `Saved`).
#[derive(Debug, Clone)]
enum Saving {
    Idle,
    Running,
    Done(SavedReply),
    Failed(String),
}

static SAVING: Mutex<Saving> = Mutex::new(Saving::Idle);
static SAVED_CV: Condvar = Condvar::new();

fn set_saving(s: Saving) {
    *SAVING.lock() = s;
    SAVED_CV.notify_all();
}
/// How long the keeper holds the memory of a job that shares some with other processes after a
/// checkpoint released it, should the job be gone: a job held for a migration, killed once the
/// destination has its image (a failure there restores it here within that time; after a
/// success the memory is freed then). A job to be killed by its checkpoint is held as long as
/// `possum checkpoint` asks.
const SHARED_HOLD_SECS: u64 = 60;
/// How many times a held release tries before giving up (each attempt ended by the watchdog).
const HOLD_ATTEMPTS: u32 = 3;

/// Lets the job go on, however it was paused (in its CUDA calls, or its threads parked).
fn unpause_job() {
    untrim_contexts();
    // What other processes shared with this one, mapped again where a release let it go (a
    // resume does it first, to report a failure; here after a failed release).
    if let Err(e) = crate::imports::attach() {
        log(&format!("after the checkpoint: {e}"));
    }
    gate::set_paused(false);
    if park::held() {
        park::unpark_all();
    }
    // A cut across ranks held the collective launches too.
    crate::collective::lift();
}

/// Whether the job is paused now.
pub fn paused() -> bool {
    gate::is_paused() || park::held()
}

/// The session's state for `possum status`.
pub fn status_json() -> Value {
    let (waits, wait_ns) = gate::waits();
    let (faults, last_fault) = gate::faults();
    json!({
        "paused": paused(),
        "threads_parked": park::held().then(|| crate::park_sys::parked().len()),
        "cupti_attached": cupti_attached(),
        "hooks_live": hooks_live(),
        "busy": *BUSY.lock(),
        "pause_waits": waits,
        "pause_wait_ms": wait_ns as f64 / 1e6,
        "write_path_faults": faults,
        "unwrapped_writers": gate::unwrapped_writers(),
        "last_fault": last_fault,
        "saving": match &*SAVING.lock() {
            Saving::Idle => Value::Null,
            Saving::Running => json!("running"),
            Saving::Done(_) => json!("done"),
            Saving::Failed(e) => json!({"failed": e}),
        },
        "last": LAST.lock().clone(),
        "collectives": to_json(&crate::collective::counts()),
    })
}

/// Marks a session step as running; refuses a second one.
pub(crate) struct Busy;

impl Busy {
    pub(crate) fn take(what: &'static str) -> Result<Busy, String> {
        let mut b = BUSY.lock();
        if let Some(other) = *b {
            return Err(format!(
                "possum is busy in this job ({other}); one checkpoint at a time"
            ));
        }
        *b = Some(what);
        Ok(Busy)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        *BUSY.lock() = None;
    }
}

fn engines() -> Vec<Arc<DevEngine>> {
    state_if_created()
        .map(|st| st.engines())
        .unwrap_or_default()
}

/// The image directory of device `ordinal` under `dir`.
pub(crate) fn engine_image_dir(dir: &Path, ordinal: usize) -> PathBuf {
    dir.join(format!("gpu-{ordinal}"))
}

/// A new image of device `ordinal` under `dir` (referencing the unchanged chunks of the same
/// device's image under `parent`, where there is one). No fsync: the commit happens while the
/// job is paused; `possum checkpoint` makes the whole image durable once the job runs again.
pub(crate) fn new_writer(
    dir: &Path,
    ordinal: usize,
    parent: Option<&Path>,
) -> Result<Arc<ImageWriter>, String> {
    // A data file per writer thread: on tmpfs, writes to one file are serialized (its inode
    // lock), so fewer files than writers caps the copy (measured: 4 files, 12 writers, 9.5 GB/s).
    let opts = WriterOptions {
        fsync: false,
        data_files: config::get().tuning.writers(),
        write_piece: config::get().tuning.write_piece,
        parent: parent
            .map(|p| engine_image_dir(p, ordinal))
            .filter(|p| p.is_dir()),
        ..WriterOptions::default()
    };
    ImageWriter::create(&engine_image_dir(dir, ordinal), opts)
        .map(Arc::new)
        .map_err(|e| format!("device {ordinal}: {e}"))
}

/// Faults of the write path from now to the commit undo the checkpoint that opens now.
pub(crate) fn open_faults() {
    FAULTS_AT_OPEN.store(gate::faults().0, Ordering::SeqCst);
}

/// Whether the write path saw no fault since the checkpoint in progress began: an error or a
/// panic in a hook let an operation run whose written buffers may not have been saved (or marked
/// written), so the image might not be T0's. With one, the checkpoint fails closed: its images
/// are not committed, the job runs on.
pub(crate) fn no_faults_since_open() -> Result<(), String> {
    let (n, last) = gate::faults();
    let since = n.saturating_sub(FAULTS_AT_OPEN.load(Ordering::SeqCst));
    if since == 0 {
        return Ok(());
    }
    Err(format!(
        "checkpoint undone: {since} fault(s) on the write path since it began (the last: {}); \
         its image might not hold the buffers as they were at T0, so none is written and the \
         job runs on",
        last.unwrap_or_default()
    ))
}

/// Whether the job took no writing driver function without possum's wrapper beyond the
/// `known` it had taken when a checkpoint trusting the hooks fixed its T0 (it is paused only at
/// the wrapped calls: one taken since may have written while its buffers were copied). With one,
/// the checkpoint is undone.
fn no_unwrapped_writer_since(known: usize) -> Result<(), String> {
    let now = gate::unwrapped_writers();
    if now.len() <= known {
        return Ok(());
    }
    Err(format!(
        "checkpoint undone: while it was being made the job took {} without possum's wrapper, \
         which possum may not see write; send checkpoint again (it holds the job's threads for \
         the whole copy)",
        now[known..].join(", ")
    ))
}

/// Commits device `ordinal`'s image (its writer no longer shared with a copy).
pub(crate) fn commit(
    ordinal: usize,
    writer: Arc<ImageWriter>,
) -> Result<possum_engine::image::ImageSummary, String> {
    Arc::into_inner(writer)
        .ok_or_else(|| format!("device {ordinal}: image writer still shared"))
        .and_then(|w| {
            w.commit()
                .map_err(|e| format!("device {ordinal}: commit: {e}"))
        })
}

/// After a checkpoint failed because the job wrote a buffer no launch was predicted to write
/// (an image proven wrong by its fingerprints): every read-only speculation is taken back, so
/// that the checkpoint taken again counts every buffer a kernel names as written.
pub(crate) fn after_mismatch(e: &possum_engine::EngineError) {
    if !matches!(e, possum_engine::EngineError::Mismatch { .. }) {
        return;
    }
    let revoked = crate::runtime::state_if_created()
        .map(|st| st.kernels().iter().filter(|k| k.revoke_readonly()).count())
        .unwrap_or(0);
    log(&format!(
        "{e}: read-only speculation taken back from {revoked} kernel(s)"
    ));
}

/// Sets `key` of the last session's figures to `v`.
pub(crate) fn note_last(key: &str, v: Value) {
    let mut last = LAST.lock();
    if !last.is_object() {
        *last = json!({});
    }
    last[key] = v;
}

/// `Checkpoint{dir}`: every engine's buffers at one T0 each, copied while the job runs.
/// `CheckpointKept{dir}` (`keep`): nothing copied now where every engine's memory is kept by a
/// keeper (see [`release_kept`]).
pub fn checkpoint(dir: &str, keep: bool, parent: Option<&str>) -> Value {
    if let Err(e) =
        absolute(Path::new(dir)).and_then(|()| parent.map_or(Ok(()), |p| absolute(Path::new(p))))
    {
        return reply::<CheckpointReply>(Err(e));
    }
    let parent = parent.map(PathBuf::from);
    reply(checkpoint_inner(Path::new(dir), keep, parent).inspect_err(|_| stop_tracking(&engines())))
}

/// A request's image directory must be absolute: a relative one would be the job's working
/// directory's business (a client that meant it relative to a directory it passed, talking to a
/// library too old to take one, would have the job write its images there).
pub(crate) fn absolute(dir: &Path) -> Result<(), String> {
    if dir.is_absolute() {
        Ok(())
    } else {
        Err(format!(
            "image directory {} is not absolute (a directory passed with the request makes \
             it relative to that one)",
            dir.display()
        ))
    }
}

/// Ends the engines' tracking (their session is over: restored, or failed with every buffer in
/// place), so the job's operations are resolved only in sampling windows again. An engine with
/// a session still running keeps tracking.
fn stop_tracking(engines: &[Arc<DevEngine>]) {
    for e in engines {
        if let Err(err) = e.engine.stop_tracking() {
            log(&format!("device {}: tracking stays on: {err}", e.ordinal));
        }
    }
}

fn checkpoint_inner(
    dir: &Path,
    keep: bool,
    parent: Option<PathBuf>,
) -> Result<CheckpointReply, String> {
    let _b = Busy::take("checkpoint")?;
    if matches!(*SAVING.lock(), Saving::Running) {
        return Err(
            "the last checkpoint's buffers are still being saved; try again when \
                    `possum checkpoint` has returned"
                .into(),
        );
    }
    if ab::running() {
        return Err(
            "POSSUM_AB_MS is set: possum's callbacks are switched off and on for an A/B \
                    test of their cost, so launches go unseen; no checkpoint of this job"
                .into(),
        );
    }
    if paused() {
        return Err("the job is paused (released): resume it before a new checkpoint".into());
    }
    // A checkpoint whose `possum` went away before its release: its images are abandoned.
    *OPEN.lock() = None;
    open_faults();
    let t = Instant::now();
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::new();
    let mut open = Vec::new();
    // Without hooks nothing marks buffers dirty: no pre-copy, everything is copied at the release
    // with the job's threads parked (`release_held`). So too when the job took a driver function
    // that writes device memory without possum's wrapper: the hooks may miss its writes.
    let unwrapped = gate::unwrapped_writers();
    let hooks = hooks_live() && unwrapped.is_empty();
    if hooks_live() && !hooks {
        log(&format!(
            "checkpoint with the job's threads held for the whole copy: it took {} without \
             possum's wrapper",
            unwrapped.join(", ")
        ));
    }
    let all = engines();
    // Kept: every engine's buffer memory is the keeper's, and the hooks see the operations
    // that write buffers (the save runs while the job does).
    // Not with memory shared with another process: its writes there are not seen here, so
    // that memory is copied while every process is held, not saved after the job runs on.
    let shared = crate::vmm::shared_pieces();
    let kept = keep
        && hooks
        && shared.is_empty()
        && !all.is_empty()
        && all.iter().all(|e| {
            use possum_engine::device::Device;
            e.engine.device().keeps_memory()
        });
    if keep && !kept && !shared.is_empty() {
        log(&format!(
            "checkpoint copied while the job is held, not kept: {} pieces of its memory are \
             shared with other processes",
            shared.len()
        ));
    }
    for e in all {
        // A kept checkpoint's images are made at the save, after CRIU's dump: an image file
        // open during the dump would be in CRIU's image, to be reopened at its restore.
        if kept {
            continue;
        }
        let writer = new_writer(dir, e.ordinal, parent.as_deref())?;
        if !hooks {
            open.push((e.ordinal, writer));
            continue;
        }
        // A new image: every buffer goes in, not only those written since the last round (that
        // round, of an earlier checkpoint, went into another image).
        e.engine.mark_all_dirty();
        let sink: Arc<dyn ChunkSink> = writer.clone();
        let r = e
            .engine
            .precopy_round(sink)
            .map_err(|err| format!("device {}: pre-copy: {err}", e.ordinal))?;
        out.push(round_copy(e.ordinal, &r));
        open.push((e.ordinal, writer));
    }
    *OPEN.lock() = Some(Open {
        dir: dir.to_path_buf(),
        parent,
        writers: open,
        kept,
        precopied: hooks && !kept,
    });
    let v = CheckpointReply {
        precopy: out,
        hooks: Some(hooks),
        kept,
        ms: Some(ms(t.elapsed())),
    };
    *LAST.lock() = json!({"checkpoint": to_json(&v)});
    Ok(v)
}

/// `PrecopyRound`: another pre-copy round into the images the open checkpoint writes, the job
/// running; what each device copied (buffers written since the last round).
pub fn precopy_round() -> Value {
    reply(precopy_round_inner())
}

fn precopy_round_inner() -> Result<CheckpointReply, String> {
    let _b = Busy::take("pre-copy round")?;
    let t = Instant::now();
    let open = OPEN.lock();
    let Some(o) = open.as_ref().filter(|o| o.precopied && !o.kept) else {
        return Err(
            "no pre-copied checkpoint open: send checkpoint first (a kept checkpoint, \
                    or one whose job is held for the whole copy, takes no rounds)"
                .into(),
        );
    };
    let engines = engines();
    let mut out = Vec::new();
    for (ordinal, writer) in &o.writers {
        let Some(e) = engines.iter().find(|e| e.ordinal == *ordinal) else {
            continue;
        };
        let sink: Arc<dyn ChunkSink> = writer.clone();
        let r = e
            .engine
            .precopy_round(sink)
            .map_err(|err| format!("device {ordinal}: pre-copy round: {err}"))?;
        out.push(round_copy(*ordinal, &r));
    }
    Ok(CheckpointReply {
        precopy: out,
        hooks: Some(true),
        kept: false,
        ms: Some(ms(t.elapsed())),
    })
}

/// T0's cross-device fence, with the job paused: waits for every operation of the job let in
/// before the pause to be enqueued (on every engine's gate), then for everything queued on
/// every device the job used to be done. A stream of one device may write another's buffers (a
/// peer copy, a kernel through peer access), which that device's own T0 fence (events on its
/// own job streams) does not order: after this, no work queued before the pause is left on any
/// device, so every engine's T0 that follows sees all of it. A process on one device needs none
/// (its engine's own fence covers its streams): nothing is waited for then.
fn fence_all_devices(engines: &[Arc<DevEngine>]) -> Result<(), String> {
    let used = state_if_created()
        .map(|st| st.devices_used())
        .unwrap_or_default();
    if used.len() <= 1 && engines.len() <= 1 {
        return Ok(());
    }
    for e in engines {
        e.engine.wait_ops_enqueued();
    }
    for e in engines {
        e.engine
            .synchronize_device()
            .map_err(|err| format!("device {}: waiting for its queued work: {err}", e.ordinal))?;
    }
    // A device the job used without possum managing memory there: its primary context.
    for d in used
        .into_iter()
        .filter(|d| !engines.iter().any(|e| e.ordinal == *d))
    {
        sync_primary_context(d)
            .map_err(|err| format!("device {d}: waiting for its queued work: {err}"))?;
    }
    Ok(())
}

/// Waits for everything queued in device `ordinal`'s primary context.
fn sync_primary_context(ordinal: usize) -> Result<(), String> {
    let _r = crate::runtime::Reentry::enter();
    possum_cuda::introspect::primary_ctx_synchronize(ordinal).map_err(|e| e.to_string())
}

/// `Release`: pause the job's GPU operations, then release every engine's buffers.
/// `ReleaseKeeping{hold_secs}` (`keep`): a keeper's buffers are detached instead, held for a
/// restore on this host once the job is gone (see [`release_engines`]).
pub fn release(keep: Option<u64>) -> Value {
    reply(release_inner(keep))
}

fn release_inner(keep: Option<u64>) -> Result<ReleaseReply, String> {
    let _b = Busy::take("release")?;
    if paused() {
        return Err("the job is already paused (released)".into());
    }
    let t = Instant::now();
    let Open {
        dir,
        parent,
        writers: mut open,
        kept,
        precopied,
    } = OPEN.lock().take().unwrap_or(Open {
        dir: PathBuf::new(),
        parent: None,
        writers: Vec::new(),
        kept: false,
        precopied: false,
    });
    let engines = engines();
    // Writing driver functions the job took without possum's wrapper: its hooks may have missed
    // writes, so its threads are held for the whole copy (never a pre-copy trusted to them).
    let unwrapped = gate::unwrapped_writers();
    if kept {
        if !unwrapped.is_empty() {
            stop_tracking(&engines);
            return Err(format!(
                "checkpoint undone: since it began the job took {} without possum's wrapper, so \
                 possum may not see what it writes; send checkpoint again (it holds the job's \
                 threads for the whole copy)",
                unwrapped.join(", ")
            ));
        }
        return release_kept(dir, parent, &engines, t);
    }
    if engines
        .iter()
        .any(|e| !open.iter().any(|(o, _)| *o == e.ordinal))
    {
        return Err("no checkpoint in progress for every device: send checkpoint first".into());
    }
    if !hooks_live() || !unwrapped.is_empty() {
        if precopied {
            log(&format!(
                "release with the job's threads held for the whole copy: since the checkpoint \
                 began it took {} without possum's wrapper (the pre-copy is dropped)",
                unwrapped.join(", ")
            ));
            // The images with the pre-copy are dropped unfinished (their temporary directories
            // go); every buffer goes into new ones.
            open = engines
                .iter()
                .map(|e| Ok((e.ordinal, new_writer(&dir, e.ordinal, parent.as_deref())?)))
                .collect::<Result<_, String>>()?;
        }
        return release_held(&dir, parent.as_deref(), open, engines, t);
    }
    gate::set_paused(true);
    // T0: the job is paused. The buffers written since the pre-copy go into the same images.
    // A failure here leaves every buffer in place: unpause before answering.
    let unpause = |m: String| {
        unpause_job();
        m
    };
    // What any device queued before the pause is done before any engine fixes its T0.
    fence_all_devices(&engines).map_err(unpause)?;
    // Memory shared with other processes: written by them unseen, so copied again now.
    for (ordinal, va) in crate::vmm::shared_pieces() {
        if let Some(e) = engines.iter().find(|e| e.ordinal == ordinal) {
            e.engine.mark_written(possum_engine::device::DevPtr(va));
        }
    }
    let mut finals = Vec::new();
    for (ordinal, writer) in open {
        let Some(e) = engines.iter().find(|e| e.ordinal == ordinal) else {
            continue;
        };
        let sink: Arc<dyn ChunkSink> = writer.clone();
        // The job is held: T0 may wait for the device, which it must when the job used a
        // per-thread default stream (its work there cannot be fenced from this thread).
        e.engine.set_device_fence(per_thread_ops() > 0);
        let r = e
            .engine
            .checkpoint(sink, true) // only what was written since the pre-copy
            .and_then(|h| h.wait())
            .inspect_err(after_mismatch);
        e.engine.set_device_fence(false);
        let r = r.map_err(|err| unpause(format!("device {ordinal}: final copy: {err}")))?;
        no_faults_since_open()
            .and_then(|()| no_unwrapped_writer_since(unwrapped.len()))
            .map_err(|e| {
                stop_tracking(&engines);
                unpause(e)
            })?;
        let summary = commit(ordinal, writer).map_err(unpause)?;
        finals.push(DeviceCopy {
            device: ordinal,
            buffers: r.buffers as u64,
            bytes: r.bytes,
            ms: Some(ms(r.elapsed)),
            image_bytes: Some(summary.data_file_bytes),
            image_buffers: Some(summary.buffers.len() as u64),
            ..with_prints(DeviceCopy::default(), &possum_engine::Prints::of(&r))
        });
    }
    let copied = ms(t.elapsed());
    let released = release_engines(&engines, true, keep)?;
    let trimmed = trim_contexts(&engines);
    // Devices whose buffers stay on the GPU with the keeper for a restore (not freed).
    let held: Vec<usize> = engines
        .iter()
        .filter(|e| e.engine.phase() == "detached")
        .map(|e| e.ordinal)
        .collect();
    // The epochs the keeper holds them under: a restore onto another GPU copies that memory
    // only if it is still this checkpoint's (`possum.json` records them).
    let held_epochs: Vec<HeldEpoch> = engines
        .iter()
        .filter_map(|e| {
            let epoch = e.engine.device().detached_epoch()?;
            Some(HeldEpoch {
                device: e.ordinal,
                epoch,
            })
        })
        .collect();
    // NVIDIA's driver checkpoint refuses a process with CUPTI attached. The job's threads that
    // wait in a callback stay there (paused) until the resume.
    let td = Instant::now();
    if config::get().diag.detach.is_some() {
        cupti_detach().map_err(|e| format!("detaching CUPTI: {e}"))?;
    }
    let v = ReleaseReply {
        finals,
        final_copy_ms: Some(copied),
        released_bytes: released.bytes,
        staging_freed_bytes: Some(released.staging_freed),
        context_trimmed_bytes: Some(trimmed),
        held_for_restore: held,
        held_epochs,
        devices: released.devices,
        imports_released: Some(released.imports),
        detach_ms: Some(ms(td.elapsed())),
        ms: Some(ms(t.elapsed())),
        ..ReleaseReply::default()
    };
    note_last("release", to_json(&v));
    Ok(v)
}

/// `Release` of a kept checkpoint: pause the job's GPU operations (T0) and detach every
/// engine's buffers, their memory left with the keeper, contents as at T0; nothing is copied.
/// The checkpoint stays open for `ResumeAndSave` (its images are made then). On a failure every
/// buffer is attached again and the job goes on.
fn release_kept(
    dir: PathBuf,
    parent: Option<PathBuf>,
    engines: &[Arc<DevEngine>],
    t: Instant,
) -> Result<ReleaseReply, String> {
    // Memory shared with another process since the checkpoint began: its save, after the job
    // runs on, would not see that process's writes.
    let shared = crate::vmm::shared_pieces().len();
    if shared > 0 {
        stop_tracking(engines);
        return Err(format!(
            "checkpoint undone: since it began the job shared {shared} pieces of its memory with \
             other processes (cuMemExportToShareableHandle), whose writes there possum does not \
             see; send checkpoint again (it copies that memory while the job is held)"
        ));
    }
    gate::set_paused(true);
    // What any device queued before the pause is done before any engine detaches its buffers.
    if let Err(err) = fence_all_devices(engines) {
        stop_tracking(engines);
        unpause_job();
        return Err(err);
    }
    let mut bytes = 0u64;
    let mut done: Vec<&Arc<DevEngine>> = Vec::new();
    // On a failure every buffer detached so far is attached again, and the job goes on.
    let undo = |done: &[&Arc<DevEngine>], err: String| {
        for d in done {
            if let Err(again) = d.engine.reattach() {
                log(&format!("device {}: reattach: {again}", d.ordinal));
            }
        }
        stop_tracking(engines);
        unpause_job();
        err
    };
    for e in engines {
        match e.engine.detach() {
            Ok(b) => {
                bytes += b;
                done.push(e);
            }
            Err(err) => return Err(undo(&done, format!("device {}: detach: {err}", e.ordinal))),
        }
    }
    let imports_released = crate::imports::detach().map_err(|err| undo(&done, err))?;
    let detached_ms = ms(t.elapsed());
    let staging_freed: u64 = if config::get().tuning.staging_park {
        engines.iter().map(|e| free_staging(e)).sum()
    } else {
        0
    };
    let trimmed = trim_contexts(engines);
    *OPEN.lock() = Some(Open {
        dir,
        parent,
        writers: Vec::new(),
        kept: true,
        precopied: false,
    });
    let v = ReleaseReply {
        kept_bytes: Some(bytes),
        imports_released: Some(imports_released),
        detach_ms: Some(detached_ms),
        final_copy_ms: Some(0.0),
        released_bytes: 0,
        staging_freed_bytes: Some(staging_freed),
        context_trimmed_bytes: Some(trimmed),
        devices: engines.iter().map(|e| e.ordinal).collect(),
        ms: Some(ms(t.elapsed())),
        ..ReleaseReply::default()
    };
    note_last("release", to_json(&v));
    Ok(v)
}

/// Releases every engine's buffers (the job paused). On a failure the job stays
/// paused if some engine was released (only its image can bring it back: the caller resumes).
/// With `park_staging`, each engine's staging memory is freed too (only with the job held at the op
/// gate: its threads are outside the driver; parked threads may hold a driver lock that freeing
/// pinned memory needs). With `keep` (the job is to be
/// killed, its images committed): an engine whose memory is a keeper's detaches its buffers
/// instead, their memory held `keep` seconds after the job is gone (a restore of the image on
/// this host takes it back instead of copying); a resume before then attaches them again.
/// Last, the memory other processes shared with this one is let go of ([`crate::imports`]),
/// mapped again at the resume.
fn release_engines(
    engines: &[Arc<DevEngine>],
    park_staging: bool,
    keep: Option<u64>,
) -> Result<Released, String> {
    use possum_engine::device::Device;
    let mut bytes = 0u64;
    let mut staging_freed = 0u64;
    let mut done = Vec::new();
    let park = park_staging && config::get().tuning.staging_park;
    // Memory shared with other processes stays with the keeper (its peers map the same
    // allocation again at the resume), whether or not the job is to be killed.
    let keep =
        keep.or_else(|| (!crate::vmm::shared_pieces().is_empty()).then_some(SHARED_HOLD_SECS));
    for e in engines {
        let r = match keep {
            Some(secs) if secs > 0 && e.engine.device().keeps_memory() => {
                e.engine.detach_holding(secs).or_else(|err| {
                    // Not kept after all: freed, as without a keeper (the image has them).
                    log(&format!(
                        "device {}: detaching for the restore failed ({err}); released",
                        e.ordinal
                    ));
                    e.engine.release()
                })
            }
            _ => e.engine.release(),
        };
        match r {
            Ok(b) => {
                bytes += b;
                done.push(e.ordinal);
                if park {
                    staging_freed += free_staging(e);
                }
            }
            Err(err) => {
                // Released engines stay released: only their images can bring them back, so
                // the job stays paused and the caller resumes it from the images.
                let msg = format!("device {}: release failed: {err}", e.ordinal);
                if done.is_empty() {
                    unpause_job();
                    stop_tracking(engines);
                }
                return Err(msg);
            }
        }
    }
    Ok(Released {
        bytes,
        devices: done,
        staging_freed,
        imports: crate::imports::detach()?,
    })
}

/// What [`release_engines`] let go of.
struct Released {
    /// Bytes of the buffers released or detached.
    bytes: u64,
    /// Their devices.
    devices: Vec<usize>,
    /// Bytes of pinned staging memory freed.
    staging_freed: u64,
    /// Mappings of memory other processes shared with this one, released.
    imports: u64,
}

/// Trims every engine's context for the driver's checkpoint ([`Device::trim_context`]); only
/// with the job held at the op gate (no launch can come until [`unpause_job`] sets it back) and
/// `POSSUM_TRIM_CONTEXT` on. Best effort: a failure leaves that context as it was. Bytes freed.
///
/// [`Device::trim_context`]: possum_engine::device::Device::trim_context
fn trim_contexts(engines: &[Arc<DevEngine>]) -> u64 {
    use possum_engine::device::Device;
    if !config::get().tuning.trim_context {
        return 0;
    }
    let mut freed = 0;
    for e in engines {
        match e.engine.device().trim_context() {
            Ok(b) => freed += b,
            Err(err) => log(&format!(
                "device {}: trimming its context: {err}",
                e.ordinal
            )),
        }
    }
    freed
}

/// Sets back what [`trim_contexts`] lowered, before the job launches again. A failure is logged:
/// the driver grows the stack again as a kernel needs it.
fn untrim_contexts() {
    use possum_engine::device::Device;
    for e in engines() {
        if let Err(err) = e.engine.device().untrim_context() {
            log(&format!(
                "device {}: setting its context back: {err}",
                e.ordinal
            ));
        }
    }
}

/// Frees `e`'s pinned staging, which would be in CRIU's image (and restored page by page); it is
/// allocated again as the next copies need it. The bytes freed.
fn free_staging(e: &DevEngine) -> u64 {
    e.engine
        .park_staging(std::time::Duration::from_secs(5))
        .unwrap_or(0)
}

/// `Release` of a job whose GPU operations possum does not see (CUPTI off): its threads are
/// parked ([`park`]), the devices drained, every buffer copied, the images committed and the
/// buffers released; the threads stay parked until `Resume`. If the watchdog ends the hold (a
/// parked thread held a lock the copy needed), that attempt's images are thrown away and the
/// hold is tried again.
fn release_held(
    dir: &Path,
    parent: Option<&Path>,
    mut open: Vec<(usize, Arc<ImageWriter>)>,
    engines: Vec<Arc<DevEngine>>,
    t: Instant,
) -> Result<ReleaseReply, String> {
    let mut attempts = Vec::new();
    let mut finals = None;
    let mut parked = Value::Null;
    for attempt in 1..=HOLD_ATTEMPTS {
        if attempt > 1 {
            // The last attempt's images are dropped unfinished (their temporary directories go).
            open = engines
                .iter()
                .map(|e| Ok((e.ordinal, new_writer(dir, e.ordinal, parent)?)))
                .collect::<Result<_, String>>()?;
            std::thread::sleep(std::time::Duration::from_millis(20 * u64::from(attempt)));
        }
        parked = park::park_all(park::park_timeout())?;
        // T0: no thread of the job runs.
        let tc = Instant::now();
        let dog = park::Watchdog::start(park::watchdog_limit());
        let copied = copy_all(&engines, &open);
        let fired = dog.stop();
        if fired {
            attempts.push(HoldAttempt {
                attempt,
                ended_by_watchdog: true,
                ms: Some(ms(tc.elapsed())),
            });
            continue;
        }
        finals = Some(copied.inspect_err(|_| unpause_job())?);
        break;
    }
    // Every attempt ended by the watchdog: it has already let the job go on.
    let mut finals = finals.ok_or_else(|| {
        format!(
            "cannot hold the job: {HOLD_ATTEMPTS} attempts ended by the watchdog (a thread of \
             the job stayed inside a CUDA call holding a lock possum's copy needs); the job runs on"
        )
    })?;
    // Committed only now, with the threads still parked: an attempt the watchdog ended left
    // nothing under the images' names.
    no_faults_since_open().inspect_err(|_| {
        stop_tracking(&engines);
        unpause_job();
    })?;
    for ((ordinal, writer), f) in open.into_iter().zip(finals.iter_mut()) {
        let summary = commit(ordinal, writer).inspect_err(|_| unpause_job())?;
        f.image_bytes = Some(summary.data_file_bytes);
        f.image_buffers = Some(summary.buffers.len() as u64);
    }
    let copied = ms(t.elapsed());
    let released = release_engines(&engines, false, None)?;
    let v = ReleaseReply {
        imports_released: Some(released.imports),
        finals,
        final_copy_ms: Some(copied),
        released_bytes: released.bytes,
        staging_freed_bytes: Some(released.staging_freed),
        devices: released.devices,
        held: Some("threads parked".into()),
        parked: Some(parked),
        attempts: Some(attempts),
        ms: Some(ms(t.elapsed())),
        ..ReleaseReply::default()
    };
    note_last("release", to_json(&v));
    Ok(v)
}

/// With the job held: drains every device (all of them first: a stream of one may write
/// another's buffers), then copies every buffer into its image (not committed). One entry per
/// device.
fn copy_all(
    engines: &[Arc<DevEngine>],
    open: &[(usize, Arc<ImageWriter>)],
) -> Result<Vec<DeviceCopy>, String> {
    let mut synced = Vec::new();
    for (ordinal, _) in open {
        let Some(e) = engines.iter().find(|e| e.ordinal == *ordinal) else {
            continue;
        };
        let ts = Instant::now();
        e.engine
            .synchronize_device()
            .map_err(|err| format!("device {ordinal}: waiting for the job's GPU work: {err}"))?;
        park::beat();
        synced.push((*ordinal, ms(ts.elapsed())));
    }
    let used = state_if_created()
        .map(|st| st.devices_used())
        .unwrap_or_default();
    for d in used
        .into_iter()
        .filter(|d| !engines.iter().any(|e| e.ordinal == *d))
    {
        sync_primary_context(d)
            .map_err(|err| format!("device {d}: waiting for the job's GPU work: {err}"))?;
        park::beat();
    }
    let mut out = Vec::new();
    for (ordinal, writer) in open {
        let Some(e) = engines.iter().find(|e| e.ordinal == *ordinal) else {
            continue;
        };
        let sync_ms = synced
            .iter()
            .find(|(o, _)| o == ordinal)
            .map_or(0.0, |s| s.1);
        let sink: Arc<dyn ChunkSink> = Arc::new(Beating(writer.clone()));
        let r = e
            .engine
            .checkpoint(sink, false)
            .and_then(|h| h.wait())
            .inspect_err(after_mismatch)
            .map_err(|err| format!("device {ordinal}: copy: {err}"))?;
        park::beat();
        out.push(DeviceCopy {
            device: *ordinal,
            buffers: r.buffers as u64,
            bytes: r.bytes,
            ms: Some(ms(r.elapsed)),
            sync_ms: Some(sync_ms),
            ..with_prints(DeviceCopy::default(), &possum_engine::Prints::of(&r))
        });
    }
    Ok(out)
}

/// `Resume{dir}`: attach each detached engine's buffers again, install each released engine's
/// on-demand restore from `dir`, then unpause. `ResumeAndSave{dir, shadow_mib}` (`save` is
/// `Some(shadow_mib)`): for a kept checkpoint into `dir`, also start saving the buffers as they
/// were at the release, while the job runs ([`saved`] waits for it), with that shadow budget
/// (MiB; `None`: [`shadow_budget`]'s).
/// How a kept checkpoint is saved (`ResumeAndSave`): the shadow budget in MiB (`None`: the
/// job's default) and the earlier image whose unchanged chunks it references.
pub type Save = (Option<u64>, Option<PathBuf>);

pub fn resume(dir: Option<&str>, save: Option<Save>) -> Value {
    reply(resume_inner(dir.map(Path::new), save))
}

fn resume_inner(dir: Option<&Path>, save: Option<Save>) -> Result<ResumeReply, String> {
    if let Some(d) = dir {
        absolute(d)?;
    }
    let _b = Busy::take("resume")?;
    let t = Instant::now();
    // A process restored onto another GPU (`possum restore --device`): its buffers' memory
    // comes from the keeper's socket serving that GPU from now on; what the old GPU's keeper
    // still holds of them is let go, and they come back from that socket's stage or the image.
    let moved = follow_moves();
    // Detached buffers first: their memory is on the GPU, kept by the keeper.
    // Where the keeper no longer has them (a job restored from its image after the original
    // ran on and took them back, or the keeper gone), they come back from the image instead.
    let mut attached = Vec::new();
    let mut from_image = Vec::new();
    for e in engines() {
        if e.engine.phase() != "detached" {
            continue;
        }
        match e.engine.reattach() {
            Ok(_) => attached.push(e.ordinal),
            Err(err) => {
                log(&format!(
                    "device {}: the keeper no longer has its buffers ({err}); they come back \
                     from the image",
                    e.ordinal
                ));
                e.engine.drop_detached().map_err(|err| {
                    format!("device {}: dropping its detached buffers: {err}", e.ordinal)
                })?;
                from_image.push(e.ordinal);
            }
        }
    }
    let attach_ms = ms(t.elapsed());
    let open = OPEN.lock().take();
    let saving = match (save, open) {
        (None, _) => Vec::new(),
        (Some((shadow_mib, parent)), Some(o)) if o.kept && Some(o.dir.as_path()) == dir => {
            start_save(&o.dir, shadow_mib, parent.or(o.parent).as_deref())
        }
        (Some(_), _) => {
            let why = format!(
                "no kept checkpoint into {} to save",
                dir.map(|d| d.display().to_string()).unwrap_or_default()
            );
            set_saving(Saving::Failed(why.clone()));
            log(&why);
            Vec::new()
        }
    };
    // Without hooks no operation waits for its buffers: they are all back before this answers.
    // So too when the job took a writing driver function without possum's wrapper: what it
    // writes through it would not wait for its buffer.
    let hooks = hooks_live() && gate::unwrapped_writers().is_empty();
    let mut out = Vec::new();
    let mut staged = Vec::new();
    for e in engines() {
        if e.engine.phase() != "released" {
            continue;
        }
        let Some(dir) = dir else {
            return Err(format!(
                "device {}: buffers are released; resume needs the image directory",
                e.ordinal
            ));
        };
        let path = engine_image_dir(dir, e.ordinal);
        let img = Image::open(&path).map_err(|err| {
            if from_image.contains(&e.ordinal) {
                // Kept, lost by the keeper, and not saved anywhere.
                format!(
                    "device {}: the GPU buffers of this job were left with its keeper during \
                     the checkpoint, and the keeper no longer has them (it ended, or was \
                     killed), while no image holds them ({err}): the job's GPU state is lost; \
                     it stays paused so that it computes nothing wrong (end it, and restore it \
                     from an earlier image)",
                    e.ordinal
                )
            } else {
                format!("device {}: cannot open its image: {err}", e.ordinal)
            }
        })?;
        let img = Arc::new(img);
        let h = match staged_restore(&e, &path) {
            Some(stage) => {
                staged.push(StageTaken {
                    device: e.ordinal,
                    stage: stage.id(),
                    buffers: stage.buffers() as u64,
                });
                e.engine.restore_staged(img, Arc::new(stage))
            }
            None => e.engine.restore(img),
        }
        .map_err(|err| format!("device {}: {err}", e.ordinal))?;
        let ordinal = e.ordinal;
        if !hooks {
            let r = h
                .wait()
                .map_err(|err| format!("device {ordinal}: restore: {err}"))?;
            stop_tracking(std::slice::from_ref(&e));
            note_last(
                "restore",
                json!({"device": ordinal, "buffers": r.buffers, "bytes": r.bytes,
                       "ms": ms(r.elapsed), "on_demand": false, "staged": r.staged,
                       "staged_fallback": r.staged_fallback,
                       "job_waited_ms": ms(r.job_waited),
                       "waited_on": waited_on(ordinal, &r.waited_on)}),
            );
            out.push(ordinal);
            continue;
        }
        // Nobody has to wait for the restore; its figures are kept for `possum status`.
        let _ = std::thread::Builder::new()
            .name("possum-restore-wait".into())
            .spawn(move || {
                let v = match h.wait() {
                    Ok(r) => {
                        stop_tracking(std::slice::from_ref(&e));
                        json!({
                        "device": ordinal, "buffers": r.buffers, "bytes": r.bytes,
                        "ms": ms(r.elapsed), "on_demand": r.on_demand, "prefetched": r.prefetched,
                        "helped_chunks": r.helped_chunks, "hook_blocked": r.hook_blocked, "hook_blocked_ms": ms(r.hook_blocked_total),
                        "staged": r.staged, "staged_fallback": r.staged_fallback,
                        "job_waited_ms": ms(r.job_waited),
                        "waited_on": waited_on(ordinal, &r.waited_on),
                        })
                    }
                    Err(err) => {
                        log(&format!("restore of device {ordinal} failed: {err}"));
                        json!({"device": ordinal, "error": err.to_string()})
                    }
                };
                log(&format!("restore done: {v}"));
                note_last("restore", v);
            });
        out.push(ordinal);
    }
    let saving_devices: Vec<usize> = saving.iter().map(|(o, ..)| *o).collect();
    // Memory other processes shared with this one, mapped again before the job goes on; without
    // it the job stays paused (its kernels would fault on those addresses).
    let imports_attached = crate::imports::attach()
        .map_err(|e| format!("{e}; the job stays paused so that it computes nothing wrong"))?;
    unpause_job();
    if !saving.is_empty() {
        let _ = std::thread::Builder::new()
            .name("possum-save-wait".into())
            .spawn(move || finish_save(saving));
    }
    Ok(ResumeReply {
        restoring: out,
        on_demand: Some(hooks),
        attached,
        kept_memory_gone: from_image,
        staged,
        moved,
        attach_ms: Some(attach_ms),
        imports_attached: Some(imports_attached),
        saving: saving_devices,
        ms: Some(ms(t.elapsed())),
    })
}

/// The keeper's stage of this process's restore from `image` (device `e`'s image directory),
/// when `possum restore` had the keeper load it while CRIU restored the process: the buffers'
/// memory is then the keeper's, loaded there, and the restore maps it instead of copying.
/// `None` (the restore copies everything from the image) without a keeper serving the device's
/// memory, or without such a stage.
fn staged_restore(e: &DevEngine, image: &Path) -> Option<possum_keeper::KeeperStage> {
    // A diagnostic: the job copies from its image as if nothing were staged.
    if !config::get().diag.use_stage {
        return None;
    }
    if !e.engine.device().has_usable_owner() {
        return None;
    }
    let stage = e
        .keeper
        .as_ref()?
        .staged(image)
        .map_err(|err| {
            log(&format!(
                "device {}: the keeper's stage of {} is not usable ({err}); the buffers come \
                 from the image",
                e.ordinal,
                image.display()
            ))
        })
        .ok()??;
    log(&format!(
        "device {}: {} buffers staged by the keeper (stage {}): mapped, waited for while they load",
        e.ordinal,
        stage.buffers(),
        stage.id()
    ));
    Some(stage)
}

/// Every engine whose device is another GPU than it was opened on (NVIDIA's restore mapped it
/// elsewhere): its detached buffers are dropped (their memory on the old GPU let go: the
/// keeper there frees it once nothing maps it, a stage copying it from there included), its
/// keeper follows it to the socket serving the new GPU (or its new memory is its own), and
/// its buffers are restored from the image like released ones. The moves, for the reply.
fn follow_moves() -> Vec<DeviceMoved> {
    let mut out = Vec::new();
    for e in engines() {
        let dev = e.engine.device();
        let Some(uuid) = dev.moved() else {
            continue;
        };
        let dropped = e.engine.phase() == "detached";
        if dropped {
            if let Err(err) = e.engine.drop_detached() {
                log(&format!(
                    "device {}: dropping the buffers kept on the old GPU: {err}",
                    e.ordinal
                ));
            }
        }
        let socket = e.keeper.as_ref().and_then(|k| k.follow_device(&uuid));
        dev.follow_move(uuid, socket.is_some());
        log(&format!(
            "device {}: restored onto GPU {}; its keeper: {}",
            e.ordinal,
            possum_keeper::uuid_hex(&uuid),
            socket
                .as_ref()
                .map_or("none serves it".to_string(), |s| s.display().to_string())
        ));
        out.push(DeviceMoved {
            device: e.ordinal,
            uuid: possum_keeper::uuid_hex(&uuid),
            keeper: socket.map(|s| s.to_string_lossy().into_owned()),
            kept_dropped: dropped,
        });
    }
    out
}

type Saves = Vec<(
    usize,
    Arc<ImageWriter>,
    possum_engine::checkpoint::CheckpointHandle,
    Option<Arc<SpareSaver>>,
)>;

/// With the job still paused (its buffers as at the release): starts every engine's checkpoint
/// into a new image under `dir`, a concurrent one: every buffer the shadow budget allows is
/// copied device to device now, before the job runs (its image is then the state at T0 whatever
/// the job writes, seen by the hooks or not), the rest by copy-on-write ahead of the job's writes.
fn start_save(dir: &Path, shadow_mib: Option<u64>, parent: Option<&Path>) -> Saves {
    set_saving(Saving::Running);
    let engines = engines();
    let mut started = Vec::new();
    // What the job will write soonest is saved first (the DAG's prediction).
    let order = crate::runtime::state_if_created()
        .map(|st| st.predicted_writes())
        .unwrap_or_default();
    for e in &engines {
        let ordinal = e.ordinal;
        e.engine
            .set_shadow_budget(shadow_mib.map_or_else(|| shadow_budget(e), |m| m << 20));
        e.engine.set_save_order(order.clone());
        let chunk = config::get().tuning.chunk_mib << 20;
        let begun = new_writer(dir, ordinal, parent).and_then(|writer| {
            let sink: Arc<dyn ChunkSink> = writer.clone();
            let spare = SpareSaver::borrow(e, &writer, chunk);
            let saver = spare
                .clone()
                .map(|s| s as Arc<dyn possum_engine::store::ShadowSaver>);
            // On an error the spare is given back as it is dropped.
            e.engine
                .checkpoint_snapshot_with(sink, saver)
                .map(|h| (writer, h, spare))
                .map_err(|err| err.to_string())
        });
        match begun {
            Ok((writer, h, spare)) => started.push((ordinal, writer, h, spare)),
            Err(err) => {
                // The others run to their end (their images are thrown away).
                let why = format!("device {ordinal}: saving: {err}");
                log(&why);
                // Each spare is given back as it is dropped, after its save has ended.
                for (_, _, h, _spare) in started.drain(..) {
                    let _ = h.wait();
                }
                stop_tracking(&engines);
                set_saving(Saving::Failed(why));
                return Vec::new();
            }
        }
    }
    started
}

/// Device memory a save may use for shadow copies (first the snapshot of every buffer at T0,
/// then copy-on-write): `POSSUM_SHADOW_MIB` if set, else three quarters of what is free on the
/// device beyond 4 GiB (room left for the job's own allocations meanwhile).
fn shadow_budget(e: &DevEngine) -> u64 {
    use possum_engine::device::Device;
    if let Some(mib) = config::get().tuning.shadow_mib {
        return mib << 20;
    }
    let free = e.engine.device().memory_info().map_or(0, |(free, _)| free);
    free.saturating_sub(4 << 30) / 4 * 3
}

/// Waits for the saves, commits their images, and says so to [`saved`].
fn finish_save(saves: Saves) {
    let t = Instant::now();
    let mut out = Vec::new();
    let mut failed = None;
    for (ordinal, writer, h, spare) in saves {
        let r = h.wait().inspect_err(after_mismatch);
        // The keeper lets go of the spare (unmapped) before the image cuts and renames it.
        if let Some(s) = spare {
            s.end();
        }
        let r = r
            .map_err(|e| format!("device {ordinal}: saving: {e}"))
            .and_then(|r| no_faults_since_open().map(|()| r))
            // A kept checkpoint is released only while the job took no writing function
            // unwrapped: one taken since may have written a buffer before it was saved.
            .and_then(|r| no_unwrapped_writer_since(0).map(|()| r));
        match r {
            Ok(r) => match commit(ordinal, writer) {
                Ok(summary) => out.push(DeviceCopy {
                    device: ordinal,
                    buffers: r.buffers as u64,
                    bytes: r.bytes,
                    ms: Some(ms(r.elapsed)),
                    cow_priority: Some(r.cow_priority),
                    cow_shadow: Some(r.cow_shadow),
                    shadow_peak: Some(r.shadow_peak),
                    snapshot_shadows: Some(r.snapshot_shadows),
                    shadows_saved_by_keeper: Some(r.shadows_saved_elsewhere),
                    image_bytes: Some(summary.data_file_bytes),
                    gb_per_s: Some(r.bytes as f64 / r.elapsed.as_secs_f64().max(1e-9) / 1e9),
                    job_waited_ms: Some(ms(r.job_waited)),
                    waited_on: Some(waited_on(ordinal, &r.waited_on)),
                    ..with_prints(DeviceCopy::default(), &possum_engine::Prints::of(&r))
                }),
                Err(e) => failed = failed.or(Some(e)),
            },
            Err(e) => failed = failed.or(Some(e)),
        }
    }
    stop_tracking(&engines());
    match failed {
        Some(why) => {
            log(&format!("saving the kept checkpoint failed: {why}"));
            set_saving(Saving::Failed(why));
        }
        None => {
            let v = SavedReply {
                saved: out,
                ms: Some(ms(t.elapsed())),
            };
            note_last("saved", to_json(&v));
            set_saving(Saving::Done(v));
        }
    }
}

/// `Saved`: waits until the save `ResumeAndSave` started is over; its figures, or why it failed.
pub fn saved() -> Value {
    let mut g = SAVING.lock();
    while matches!(*g, Saving::Running) {
        SAVED_CV.wait(&mut g);
    }
    reply(match &*g {
        Saving::Done(v) => Ok(v.clone()),
        Saving::Failed(e) => Err(e.clone()),
        Saving::Idle | Saving::Running => Err("no save was started in this job".into()),
    })
}

/// Operations the job enqueued on a per-thread default stream so far.
fn per_thread_ops() -> u64 {
    state_if_created().map_or(0, |st| {
        st.counters
            .per_thread_stream_ops
            .load(std::sync::atomic::Ordering::Relaxed)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fault of the write path between a checkpoint's start and its commit undoes it: the
    /// release and the save check [`no_faults_since_open`] before they commit an image.
    #[test]
    fn a_fault_after_the_checkpoint_began_undoes_it() {
        gate::note_fault("before the checkpoint");
        // What `checkpoint_inner` does as it opens a checkpoint.
        FAULTS_AT_OPEN.store(gate::faults().0, Ordering::SeqCst);
        assert_eq!(no_faults_since_open(), Ok(()), "an older fault counts not");
        gate::note_fault("hook: the engine refused a write");
        let e = no_faults_since_open().unwrap_err();
        assert!(e.contains("checkpoint undone"), "{e}");
        assert!(e.contains("1 fault(s)"), "{e}");
        assert!(e.contains("the engine refused a write"), "{e}");
        let v = status_json();
        assert!(v["write_path_faults"].as_u64().unwrap() >= 2, "{v}");
        assert_eq!(v["last_fault"], "hook: the engine refused a write", "{v}");
    }
}
