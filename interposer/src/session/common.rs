//! What the steps of a checkpoint session share: the one-step-at-a-time rule ([`Busy`]), the
//! images (naming, making, committing), the checks that undo a checkpoint (faults of the write
//! path, writing functions taken unwrapped), the pause lifted, the fences of T0, and the
//! session's status. The CUDA steps (`checkpoint`, `release`, `resume`, `save`) and the HIP
//! front end's (`hip::session`) use them.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use possum_engine::image::{ImageSummary, ImageWriter, WriterOptions};
use serde::Serialize;

use crate::base::config;
use crate::base::log::log;
use crate::cuda::cupti::{cupti_attached, hooks_live};
use crate::ops::{gate, park};
use crate::process::runtime::{state_if_created, DevEngine};
use crate::session::error::{SessionError, SyncError};
use crate::session::replies::{ms, to_json};
use crate::session::state::{session, Last, RestoreFigures, Saving};

/// Marks a session step as running; refuses a second one.
#[derive(Debug)]
pub(crate) struct Busy;

impl Busy {
    pub(crate) fn take(what: &'static str) -> Result<Busy, SessionError> {
        let mut b = session().busy.lock();
        if let Some(other) = *b {
            return Err(SessionError::Busy(other));
        }
        *b = Some(what);
        Ok(Busy)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        *session().busy.lock() = None;
    }
}

/// Every engine made so far.
pub(crate) fn engines() -> Vec<Arc<DevEngine>> {
    state_if_created()
        .map(|st| st.engines())
        .unwrap_or_default()
}

/// The engine of device `ordinal`, among `engines`.
pub(crate) fn engine_of(engines: &[Arc<DevEngine>], ordinal: usize) -> Option<&Arc<DevEngine>> {
    engines.iter().find(|e| e.ordinal == ordinal)
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
) -> Result<Arc<ImageWriter>, SessionError> {
    // A data file per writer thread of the final copy (the most writers an image has): on
    // tmpfs, writes to one file are serialized (its inode lock), so fewer files than writers
    // caps the copy (measured: 4 files, 12 writers, 9.5 GB/s).
    let opts = WriterOptions {
        fsync: false,
        data_files: config::get().tuning.held_writers(),
        write_piece: config::get().tuning.write_piece,
        parent: parent
            .map(|p| engine_image_dir(p, ordinal))
            .filter(|p| p.is_dir()),
        ..WriterOptions::default()
    };
    ImageWriter::create(&engine_image_dir(dir, ordinal), opts)
        .map(Arc::new)
        .map_err(|source| SessionError::NewImage {
            device: ordinal,
            source,
        })
}

/// A new image of each engine's device under `dir` (the images of an attempt before, if any,
/// are dropped unfinished: their temporary directories go).
pub(crate) fn new_writers(
    engines: &[Arc<DevEngine>],
    dir: &Path,
    parent: Option<&Path>,
) -> Result<Vec<(usize, Arc<ImageWriter>)>, SessionError> {
    engines
        .iter()
        .map(|e| Ok((e.ordinal, new_writer(dir, e.ordinal, parent)?)))
        .collect()
}

/// Commits device `ordinal`'s image (its writer no longer shared with a copy).
pub(crate) fn commit(
    ordinal: usize,
    writer: Arc<ImageWriter>,
) -> Result<ImageSummary, SessionError> {
    Arc::into_inner(writer)
        .ok_or(SessionError::WriterShared(ordinal))?
        .commit()
        .map_err(|source| SessionError::Commit {
            device: ordinal,
            source,
        })
}

/// Faults of the write path from now to the commit undo the checkpoint that opens now.
pub(crate) fn open_faults() {
    session()
        .faults
        .at_open
        .store(gate::faults().0, Ordering::SeqCst);
}

/// Whether the write path saw no fault since the checkpoint in progress began: an error or a
/// panic in a hook let an operation run whose written buffers may not have been saved (or marked
/// written), so the image might not be T0's. With one, the checkpoint fails closed: its images
/// are not committed, the job runs on.
pub(crate) fn no_faults_since_open() -> Result<(), SessionError> {
    let (n, last) = gate::faults();
    let since = n.saturating_sub(session().faults.at_open.load(Ordering::SeqCst));
    if since == 0 {
        return Ok(());
    }
    Err(SessionError::FaultsSinceOpen {
        since,
        last: last.unwrap_or_default(),
    })
}

/// Whether the job took no writing driver function without possum's wrapper beyond the
/// `known` it had taken when a checkpoint trusting the hooks fixed its T0 (it is paused only at
/// the wrapped calls: one taken since may have written while its buffers were copied). With one,
/// the checkpoint is undone.
pub(crate) fn no_unwrapped_writer_since(known: usize) -> Result<(), SessionError> {
    let now = gate::unwrapped_writers();
    if now.len() <= known {
        return Ok(());
    }
    Err(SessionError::UnwrappedWhileMade(now[known..].to_vec()))
}

/// After a checkpoint failed because the job wrote a buffer no launch was predicted to write
/// (an image proven wrong by its fingerprints): every read-only speculation is taken back, so
/// that the checkpoint taken again counts every buffer a kernel names as written.
pub(crate) fn after_mismatch(e: &possum_engine::EngineError) {
    if !matches!(e, possum_engine::EngineError::Mismatch { .. }) {
        return;
    }
    let revoked = state_if_created()
        .map(|st| st.kernels().iter().filter(|k| k.revoke_readonly()).count())
        .unwrap_or(0);
    log(&format!(
        "{e}: read-only speculation taken back from {revoked} kernel(s)"
    ));
}

/// Notes the end of device `device`'s restore, waited for in the background: `done`'s figures,
/// or those of its failure (said in the log); logged and kept as the last session's.
pub(crate) fn note_restore_done(
    device: usize,
    done: Result<RestoreFigures, impl std::fmt::Display>,
) {
    let v = done.unwrap_or_else(|e| {
        log(&format!("restore of device {device} failed: {e}"));
        RestoreFigures {
            device,
            error: Some(e.to_string()),
            ..RestoreFigures::default()
        }
    });
    log(&format!("restore done: {}", to_json(&v)));
    note_last(|l| l.restore = Some(v));
}

/// Changes the last session's figures (made empty first if there are none).
pub(crate) fn note_last(f: impl FnOnce(&mut Last)) {
    f(session().last.lock().get_or_insert_with(Last::default));
}

/// Sets what the save of a kept checkpoint is doing, and wakes whoever waits for its end.
pub(crate) fn set_saving(s: Saving) {
    *session().saving.lock() = s;
    session().save_changed.notify_all();
}

/// A request's image directory must be absolute: a relative one would be the job's working
/// directory's business (a client that meant it relative to a directory it passed, talking to a
/// library too old to take one, would have the job write its images there).
pub(crate) fn absolute(dir: &Path) -> Result<(), SessionError> {
    if dir.is_absolute() {
        Ok(())
    } else {
        Err(SessionError::NotAbsolute(dir.to_path_buf()))
    }
}

/// Ends the engines' tracking (their session is over: restored, or failed with every buffer in
/// place), so the job's operations are resolved only in sampling windows again. An engine with
/// a session still running keeps tracking.
pub(crate) fn stop_tracking(engines: &[Arc<DevEngine>]) {
    for e in engines {
        if let Err(err) = e.engine.stop_tracking() {
            log(&format!("device {}: tracking stays on: {err}", e.ordinal));
        }
    }
}

/// Lets the job go on, however it was paused (in its CUDA calls, or its threads parked).
pub(crate) fn unpause_job() {
    untrim_contexts();
    // What other processes shared with this one, mapped again where a release let it go (a
    // resume does it first, to report a failure; here after a failed release).
    if let Err(e) = crate::memory::imports::attach() {
        log(&format!("after the checkpoint: {e}"));
    }
    gate::set_paused(false);
    if park::held() {
        park::unpark_all();
    }
    // A cut across ranks held the collective launches too.
    crate::ops::collective::lift();
}

/// Whether the job is paused now.
pub fn paused() -> bool {
    gate::is_paused() || park::held()
}

/// The session's state, as `possum status` shows it.
#[derive(Debug, Serialize)]
struct SessionStatus {
    paused: bool,
    threads_parked: Option<usize>,
    cupti_attached: bool,
    hooks_live: bool,
    busy: Option<&'static str>,
    pause_waits: u64,
    pause_wait_ms: f64,
    write_path_faults: u64,
    unwrapped_writers: Vec<String>,
    last_fault: Option<String>,
    saving: Option<SavingStatus>,
    last: Option<Last>,
    collectives: possum_control::reply::CollectiveReply,
}

/// A save running, done, or failed (`None`: none was started).
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum SavingStatus {
    /// `"running"` or `"done"`.
    Now(&'static str),
    /// `{"failed": why}`.
    Failed {
        /// Why.
        failed: String,
    },
}

/// The session's state for `possum status`.
pub fn status_json() -> serde_json::Value {
    let (waits, wait_ns) = gate::waits();
    let (faults, last_fault) = gate::faults();
    let saving = match &*session().saving.lock() {
        Saving::Idle => None,
        Saving::Running => Some(SavingStatus::Now("running")),
        Saving::Done(_) => Some(SavingStatus::Now("done")),
        Saving::Failed(e) => Some(SavingStatus::Failed { failed: e.clone() }),
    };
    to_json(&SessionStatus {
        paused: paused(),
        threads_parked: park::held().then(|| crate::ops::park_sys::parked().len()),
        cupti_attached: cupti_attached(),
        hooks_live: hooks_live(),
        busy: *session().busy.lock(),
        pause_waits: waits,
        pause_wait_ms: wait_ns as f64 / 1e6,
        write_path_faults: faults,
        unwrapped_writers: gate::unwrapped_writers(),
        last_fault,
        saving,
        last: session().last.lock().clone(),
        collectives: crate::ops::collective::counts(),
    })
}

/// T0's cross-device fence, with the job paused: waits for every operation of the job let in
/// before the pause to be enqueued (on every engine's gate), then for everything queued on
/// every device the job used to be done. A stream of one device may write another's buffers (a
/// peer copy, a kernel through peer access), which that device's own T0 fence (events on its
/// own job streams) does not order: after this, no work queued before the pause is left on any
/// device, so every engine's T0 that follows sees all of it. A process on one device needs none
/// (its engine's own fence covers its streams): nothing is waited for then.
pub(crate) fn fence_all_devices(engines: &[Arc<DevEngine>]) -> Result<(), SessionError> {
    let used = devices_used();
    if used.len() <= 1 && engines.len() <= 1 {
        return Ok(());
    }
    for e in engines {
        e.engine.wait_ops_enqueued();
    }
    for e in engines {
        e.engine
            .synchronize_device()
            .map_err(|err| sync_error(e.ordinal, "its queued work", err))?;
    }
    sync_unmanaged_devices(engines, "its queued work")
}

/// Waits for everything queued on each device the job used without an engine of possum's
/// there (its primary context); `what` names that work in an error.
pub(crate) fn sync_unmanaged_devices(
    engines: &[Arc<DevEngine>],
    what: &'static str,
) -> Result<(), SessionError> {
    for d in devices_used()
        .into_iter()
        .filter(|d| engine_of(engines, *d).is_none())
    {
        let _r = crate::process::runtime::Reentry::enter();
        possum_cuda::introspect::primary_ctx_synchronize(d)
            .map_err(|err| sync_error(d, what, err))?;
        park::beat();
    }
    Ok(())
}

/// Device `device`'s `what` could not be waited for.
pub(crate) fn sync_error(
    device: usize,
    what: &'static str,
    e: impl Into<SyncError>,
) -> SessionError {
    SessionError::Sync {
        device,
        what,
        source: e.into(),
    }
}

/// The devices the job's operations ran on.
fn devices_used() -> Vec<usize> {
    state_if_created()
        .map(|st| st.devices_used())
        .unwrap_or_default()
}

/// Trims every engine's context for the driver's checkpoint ([`Device::trim_context`]); only
/// with the job held at the op gate (no launch can come until [`unpause_job`] sets it back) and
/// `POSSUM_TRIM_CONTEXT` on. Best effort: a failure leaves that context as it was. Bytes freed.
///
/// [`Device::trim_context`]: possum_engine::device::Device::trim_context
pub(crate) fn trim_contexts(engines: &[Arc<DevEngine>]) -> u64 {
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
pub(crate) fn free_staging(e: &DevEngine) -> u64 {
    e.engine
        .park_staging(std::time::Duration::from_secs(5))
        .unwrap_or(0)
}

/// The milliseconds since `t`.
pub(crate) fn ms_since(t: std::time::Instant) -> Option<f64> {
    Some(ms(t.elapsed()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fault of the write path between a checkpoint's start and its commit undoes it: the
    /// release and the save check [`no_faults_since_open`] before they commit an image.
    #[test]
    fn a_fault_after_the_checkpoint_began_undoes_it() {
        gate::note_fault("before the checkpoint");
        // What a checkpoint does as it opens.
        open_faults();
        assert!(no_faults_since_open().is_ok(), "an older fault counts not");
        gate::note_fault("hook: the engine refused a write");
        let e = no_faults_since_open().unwrap_err().to_string();
        assert!(e.contains("checkpoint undone"), "{e}");
        assert!(e.contains("1 fault(s)"), "{e}");
        assert!(e.contains("the engine refused a write"), "{e}");
        let v = status_json();
        assert!(v["write_path_faults"].as_u64().unwrap() >= 2, "{v}");
        assert_eq!(v["last_fault"], "hook: the engine refused a write", "{v}");
    }
}
