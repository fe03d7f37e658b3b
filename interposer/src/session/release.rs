//! `Release`: the job paused (T0), what is left of its buffers copied and committed, then every
//! engine's buffers let go of, for the driver's checkpoint and CRIU.
//!
//! Three ways, by the open checkpoint's [`Phase`] and whether the hooks can be trusted now:
//! the pause at the op gate after a pre-copy ([`release_paused`]: only what was written since is
//! copied), the job's threads parked for the whole copy ([`release_held`]: the hooks see nothing,
//! or the job took writing functions unwrapped), and a kept checkpoint's detach
//! ([`release_kept`]: nothing copied, the memory left with the keeper).

use std::fs::{File, OpenOptions};
use std::sync::Arc;
use std::time::Instant;

use possum_control::reply::{DeviceCopy, HeldEpoch, HoldAttempt, JournalReply, ReleaseReply};
use possum_engine::device::Device;
use possum_engine::image::ImageWriter;
use possum_engine::store::{ChunkSink, ShadowSaver};
use serde_json::Value;

use crate::base::config;
use crate::base::log::log;
use crate::cuda::cupti::{cupti_detach, hooks_live};
use crate::ops::{gate, park};
use crate::process::runtime::{state_if_created, DevEngine};
use crate::session::common::{
    after_mismatch, commit, engine_of, engines, fence_all_devices, free_staging, ms_since,
    new_writers, no_faults_since_open, no_unwrapped_writer_since, note_last, paused, stop_tracking,
    sync_error, sync_unmanaged_devices, trim_contexts, unpause_job, Busy,
};
use crate::session::error::{SessionError, HOLD_ATTEMPTS};
use crate::session::replies::{ms, pipeline, reply, to_json, with_prints, written, Beating};
use crate::session::spare::SpareSaver;
use crate::session::state::{session, Images, Phase, Target};

/// How long the keeper holds the memory of a job that shares some with other processes after a
/// checkpoint released it, should the job be gone: a job held for a migration, killed once the
/// destination has its image (a failure there restores it here within that time; after a
/// success the memory is freed then). A job to be killed by its checkpoint is held as long as
/// `possum checkpoint` asks.
const SHARED_HOLD_SECS: u64 = 60;

/// `Release`: pause the job's GPU operations, then release every engine's buffers.
/// `ReleaseKeeping{hold_secs}` (`keep`): a keeper's buffers are detached instead, held for a
/// restore on this host once the job is gone (see [`release_engines`]).
pub fn release(keep: Option<u64>) -> Value {
    reply(release_inner(keep))
}

/// `JournalWrites{path}`: the next copy into a checkpoint's images (its first pre-copy round,
/// or a release's final copy) records each chunk it writes in `path`.
pub fn journal_next(path: String) -> Value {
    *session().journal.lock() = Some(path.clone().into());
    to_json(&JournalReply { journal: path })
}

/// The journal `JournalWrites` asked for, opened to append (taken: for this copy only). One
/// that cannot be opened is said and left out: it only lets a migration send earlier.
pub(crate) fn take_journal() -> Option<File> {
    let path = session().journal.lock().take()?;
    let opened = OpenOptions::new().create(true).append(true).open(&path);
    opened
        .inspect_err(|e| log(&format!("the final copy's journal {}: {e}", path.display())))
        .ok()
}

fn release_inner(keep: Option<u64>) -> Result<ReleaseReply, SessionError> {
    let journal = take_journal();
    let _b = Busy::take("release")?;
    if paused() {
        return Err(SessionError::AlreadyPaused);
    }
    let t = Instant::now();
    let phase = std::mem::take(&mut *session().phase.lock());
    let engines = engines();
    // Writing driver functions the job took without possum's wrapper: its hooks may have missed
    // writes, so its threads are held for the whole copy (never a pre-copy trusted to them).
    let unwrapped = gate::unwrapped_writers();
    let (images, precopied) = match phase {
        Phase::Kept(target) | Phase::KeptReleased(target) => {
            if !unwrapped.is_empty() {
                stop_tracking(&engines);
                return Err(SessionError::UnwrappedSinceKept(unwrapped));
            }
            return release_kept(target, &engines, t);
        }
        Phase::PreCopied(images) => (images, true),
        Phase::ToHold(images) => (images, false),
        Phase::Idle => (Images::default(), false),
    };
    if engines
        .iter()
        .any(|e| !images.writers.iter().any(|(o, _)| *o == e.ordinal))
    {
        return Err(SessionError::NotEveryDevice);
    }
    if !hooks_live() || !unwrapped.is_empty() {
        let images = drop_precopy(images, precopied, &engines, &unwrapped)?;
        return release_held(images, engines, t);
    }
    release_paused(images, &engines, unwrapped.len(), (keep, journal), t)
}

/// The images a held release copies into: new ones where the open ones hold a pre-copy that
/// trusted the hooks (dropped unfinished: their temporary directories go).
fn drop_precopy(
    images: Images,
    precopied: bool,
    engines: &[Arc<DevEngine>],
    unwrapped: &[String],
) -> Result<Images, SessionError> {
    if !precopied {
        return Ok(images);
    }
    log(&format!(
        "release with the job's threads held for the whole copy: since the checkpoint began it \
         took {} without possum's wrapper (the pre-copy is dropped)",
        unwrapped.join(", ")
    ));
    let Target { dir, parent } = images.target;
    let writers = new_writers(engines, &dir, parent.as_deref())?;
    Ok(Images {
        target: Target { dir, parent },
        writers,
    })
}

/// `Release` trusting the hooks: T0 is the pause at the op gate; the buffers written since the
/// pre-copy go into the same images, which are committed, then every engine's buffers are
/// released (or, with `keep`, detached: see [`release_engines`]). `unwrapped_known`: the writing
/// functions the job had taken unwrapped as the release began.
fn release_paused(
    images: Images,
    engines: &[Arc<DevEngine>],
    unwrapped_known: usize,
    (keep, journal): (Option<u64>, Option<File>),
    t: Instant,
) -> Result<ReleaseReply, SessionError> {
    gate::set_paused(true);
    // T0: the job is paused. A failure here leaves every buffer in place: unpause before
    // answering.
    let finals = final_copy(images, engines, unwrapped_known, journal.as_ref())
        .inspect_err(|_| unpause_job())?;
    let copied = ms(t.elapsed());
    let released = release_engines(engines, true, keep)?;
    let tt = Instant::now();
    let trimmed = trim_contexts(engines);
    let trim_ms = ms_since(tt);
    // NVIDIA's driver checkpoint refuses a process with CUPTI attached. The job's threads that
    // wait in a callback stay there (paused) until the resume.
    let td = Instant::now();
    if config::get().diag.detach.is_some() {
        cupti_detach().map_err(SessionError::DetachCupti)?;
    }
    let v = ReleaseReply {
        finals,
        final_copy_ms: Some(copied),
        released_bytes: released.bytes,
        staging_freed_bytes: Some(released.staging_freed),
        context_trimmed_bytes: Some(trimmed),
        buffers_released_ms: Some(ms(released.buffers_time)),
        staging_freed_ms: Some(ms(released.staging_time)),
        context_trimmed_ms: trim_ms,
        held_for_restore: held_for_restore(engines),
        held_epochs: held_epochs(engines),
        devices: released.devices,
        imports_released: Some(released.imports),
        detach_ms: ms_since(td),
        ms: ms_since(t),
        ..ReleaseReply::default()
    };
    note_last(|l| l.release = Some(v.clone()));
    Ok(v)
}

/// With the job paused: fences every device, then copies into each image what its device's
/// buffers got written since the pre-copy, and commits it.
fn final_copy(
    images: Images,
    engines: &[Arc<DevEngine>],
    unwrapped_known: usize,
    journal: Option<&File>,
) -> Result<Vec<DeviceCopy>, SessionError> {
    // What any device queued before the pause is done before any engine fixes its T0.
    let tf = Instant::now();
    fence_all_devices(engines)?;
    let fenced = ms(tf.elapsed());
    // Memory shared with other processes: written by them unseen, so copied again now.
    for (ordinal, va) in crate::memory::vmm::shared_pieces() {
        if let Some(e) = engine_of(engines, ordinal) {
            e.engine.mark_written(possum_engine::device::DevPtr(va));
        }
    }
    let mut finals = Vec::new();
    for (ordinal, writer) in images.writers {
        let Some(e) = engine_of(engines, ordinal) else {
            continue;
        };
        // (Each writer records into the journal while it copies: it is one file, appended to.)
        writer.journal_to(journal.and_then(|j| j.try_clone().ok()));
        let copy = final_copy_of(e, writer, engines, unwrapped_known)?;
        finals.push(DeviceCopy {
            sync_ms: Some(fenced),
            ..copy
        });
    }
    Ok(finals)
}

/// Device `e`'s final copy into `writer` (only what was written since the pre-copy), checked
/// against the faults and unwrapped writers since the checkpoint began, and committed.
fn final_copy_of(
    e: &DevEngine,
    writer: Arc<ImageWriter>,
    engines: &[Arc<DevEngine>],
    unwrapped_known: usize,
) -> Result<DeviceCopy, SessionError> {
    let sink: Arc<dyn ChunkSink> = writer.clone();
    // The job is held: T0 may wait for the device, which it must when the job used a
    // per-thread default stream (its work there cannot be fenced from this thread).
    e.engine.set_device_fence(per_thread_ops() > 0);
    let spare = SpareSaver::borrow_held(e, &writer);
    let saver = spare.clone().map(|s| s as Arc<dyn ShadowSaver>);
    let r = e
        .engine
        .checkpoint_held_with(sink, true, saver)
        .and_then(|h| h.wait())
        .inspect_err(after_mismatch);
    if let Some(s) = spare {
        s.end();
    }
    e.engine.set_device_fence(false);
    let r = r.map_err(|source| SessionError::Engine {
        device: e.ordinal,
        what: "final copy: ",
        source,
    })?;
    no_faults_since_open()
        .and_then(|()| no_unwrapped_writer_since(unwrapped_known))
        .inspect_err(|_| stop_tracking(engines))?;
    let written = written(&writer);
    writer.journal_to(None);
    let tc = Instant::now();
    let summary = commit(e.ordinal, writer)?;
    let commit_ms = Some(ms(tc.elapsed()));
    Ok(DeviceCopy {
        device: e.ordinal,
        buffers: r.buffers as u64,
        bytes: r.bytes,
        ms: Some(ms(r.elapsed)),
        image_bytes: Some(summary.data_file_bytes),
        image_buffers: Some(summary.buffers.len() as u64),
        written,
        pipeline: Some(pipeline(&r.pipeline)),
        shadows_saved_by_keeper: Some(r.shadows_saved_elsewhere),
        commit_ms,
        ..with_prints(DeviceCopy::default(), &possum_engine::Prints::of(&r))
    })
}

/// Devices whose buffers stay on the GPU with the keeper for a restore (not freed).
fn held_for_restore(engines: &[Arc<DevEngine>]) -> Vec<usize> {
    engines
        .iter()
        .filter(|e| e.engine.phase() == "detached")
        .map(|e| e.ordinal)
        .collect()
}

/// The epochs the keeper holds them under: a restore onto another GPU copies that memory only
/// if it is still this checkpoint's (`possum.json` records them).
fn held_epochs(engines: &[Arc<DevEngine>]) -> Vec<HeldEpoch> {
    engines
        .iter()
        .filter_map(|e| {
            let epoch = e.engine.device().detached_epoch()?;
            Some(HeldEpoch {
                device: e.ordinal,
                epoch,
            })
        })
        .collect()
}

/// `Release` of a kept checkpoint: pause the job's GPU operations (T0) and detach every
/// engine's buffers, their memory left with the keeper, contents as at T0; nothing is copied.
/// The checkpoint stays open for `ResumeAndSave` (its images are made then). On a failure every
/// buffer is attached again and the job goes on.
fn release_kept(
    target: Target,
    engines: &[Arc<DevEngine>],
    t: Instant,
) -> Result<ReleaseReply, SessionError> {
    // Memory shared with another process since the checkpoint began: its save, after the job
    // runs on, would not see that process's writes.
    let shared = crate::memory::vmm::shared_pieces().len();
    if shared > 0 {
        stop_tracking(engines);
        return Err(SessionError::SharedSinceKept(shared));
    }
    gate::set_paused(true);
    // What any device queued before the pause is done before any engine detaches its buffers.
    if let Err(err) = fence_all_devices(engines) {
        stop_tracking(engines);
        unpause_job();
        return Err(err);
    }
    let (bytes, imports_released) = detach_all(engines)?;
    let detached_ms = ms(t.elapsed());
    let staging_freed: u64 = if config::get().tuning.staging_park {
        engines.iter().map(|e| free_staging(e)).sum()
    } else {
        0
    };
    let trimmed = trim_contexts(engines);
    *session().phase.lock() = Phase::KeptReleased(target);
    let v = ReleaseReply {
        kept_bytes: Some(bytes),
        imports_released: Some(imports_released),
        detach_ms: Some(detached_ms),
        final_copy_ms: Some(0.0),
        released_bytes: 0,
        staging_freed_bytes: Some(staging_freed),
        context_trimmed_bytes: Some(trimmed),
        devices: engines.iter().map(|e| e.ordinal).collect(),
        ms: ms_since(t),
        ..ReleaseReply::default()
    };
    note_last(|l| l.release = Some(v.clone()));
    Ok(v)
}

/// Detaches every engine's buffers, then lets go of the memory other processes shared with this
/// one: the bytes detached and the imports released. On a failure every buffer detached so far
/// is attached again, and the job goes on.
fn detach_all(engines: &[Arc<DevEngine>]) -> Result<(u64, u64), SessionError> {
    let mut bytes = 0u64;
    let mut done: Vec<&Arc<DevEngine>> = Vec::new();
    let undo = |done: &[&Arc<DevEngine>], err: SessionError| {
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
            Err(source) => {
                let err = SessionError::Engine {
                    device: e.ordinal,
                    what: "detach: ",
                    source,
                };
                return Err(undo(&done, err));
            }
        }
    }
    let imports = crate::memory::imports::detach()
        .map_err(|err| undo(&done, SessionError::ImportsReleased(err)))?;
    Ok((bytes, imports))
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
    /// The time letting go of the buffers and of those mappings.
    buffers_time: std::time::Duration,
    /// The time freeing the staging memory.
    staging_time: std::time::Duration,
}

/// Releases every engine's buffers (the job paused). On a failure the job stays
/// paused if some engine was released (only its image can bring it back: the caller resumes).
/// With `park_staging`, each engine's staging memory is freed too (only with the job held at the op
/// gate: its threads are outside the driver; parked threads may hold a driver lock that freeing
/// pinned memory needs). With `keep` (the job is to be
/// killed, its images committed): an engine whose memory is a keeper's detaches its buffers
/// instead, their memory held `keep` seconds after the job is gone (a restore of the image on
/// this host takes it back instead of copying); a resume before then attaches them again.
/// Last, the memory other processes shared with this one is let go of
/// ([`crate::memory::imports`]), mapped again at the resume.
fn release_engines(
    engines: &[Arc<DevEngine>],
    park_staging: bool,
    keep: Option<u64>,
) -> Result<Released, SessionError> {
    let mut bytes = 0u64;
    let mut staging_freed = 0u64;
    let mut done = Vec::new();
    let park = park_staging && config::get().tuning.staging_park;
    // Memory shared with other processes stays with the keeper (its peers map the same
    // allocation again at the resume), whether or not the job is to be killed.
    let keep = keep
        .or_else(|| (!crate::memory::vmm::shared_pieces().is_empty()).then_some(SHARED_HOLD_SECS));
    let (mut buffers_time, mut staging_time) = Default::default();
    for e in engines {
        let (one, buffers, staging) = release_freeing_staging(e, keep, park);
        buffers_time += buffers;
        if let Some((freed, took)) = staging {
            staging_freed += freed;
            staging_time += took;
        }
        match one {
            Ok(b) => {
                bytes += b;
                done.push(e.ordinal);
            }
            Err(source) => {
                // Released engines stay released: only their images can bring them back, so
                // the job stays paused and the caller resumes it from the images.
                if done.is_empty() {
                    unpause_job();
                    stop_tracking(engines);
                }
                return Err(SessionError::Engine {
                    device: e.ordinal,
                    what: "release failed: ",
                    source,
                });
            }
        }
    }
    let t = Instant::now();
    let imports = crate::memory::imports::detach().map_err(SessionError::ImportsReleased)?;
    buffers_time += t.elapsed();
    Ok(Released {
        bytes,
        devices: done,
        staging_freed,
        imports,
        buffers_time,
        staging_time,
    })
}

/// [`release_one`], and with `park` `e`'s staging freed beside it ([`free_staging`]: the
/// final copy is over, and the release needs no staging; each is the driver's work on the host,
/// unmapping and unpinning, so that the one need not wait for the other). The release's result
/// and time, and the staging's bytes freed and time, if it was freed. (A failed release leaves
/// the staging freed: it is allocated again as the next copies need it.)
fn release_freeing_staging(e: &DevEngine, keep: Option<u64>, park: bool) -> ReleasedOne {
    std::thread::scope(|s| {
        let beside = park.then(|| {
            std::thread::Builder::new()
                .name("possum-free-staging".into())
                .spawn_scoped(s, || free_staging_timed(e))
        });
        let t = Instant::now();
        let one = release_one(e, keep);
        let buffers = t.elapsed();
        let staging = match beside {
            Some(Ok(h)) => h.join().ok(),
            // No thread to free it beside: freed after.
            Some(Err(_)) => Some(free_staging_timed(e)),
            None => None,
        };
        (one, buffers, staging)
    })
}

/// [`free_staging`]: the bytes freed, and the time it took.
fn free_staging_timed(e: &DevEngine) -> (u64, std::time::Duration) {
    let t = Instant::now();
    (free_staging(e), t.elapsed())
}

/// What [`release_freeing_staging`] gives: the release's result and time, and the staging's
/// bytes freed and time.
type ReleasedOne = (
    Result<u64, possum_engine::EngineError>,
    std::time::Duration,
    Option<(u64, std::time::Duration)>,
);

/// Releases `e`'s buffers, or with `keep` seconds and a keeper's memory detaches them (freed
/// where that fails, as without a keeper: the image has them). The bytes.
fn release_one(e: &DevEngine, keep: Option<u64>) -> Result<u64, possum_engine::EngineError> {
    match keep {
        Some(secs) if secs > 0 && e.engine.device().keeps_memory() => {
            e.engine.detach_holding(secs).or_else(|err| {
                log(&format!(
                    "device {}: detaching for the restore failed ({err}); released",
                    e.ordinal
                ));
                e.engine.release()
            })
        }
        _ => e.engine.release(),
    }
}

/// `Release` of a job whose GPU operations possum does not see (CUPTI off): its threads are
/// parked ([`park`]), the devices drained, every buffer copied, the images committed and the
/// buffers released; the threads stay parked until `Resume`. If the watchdog ends the hold (a
/// parked thread held a lock the copy needed), that attempt's images are thrown away and the
/// hold is tried again.
fn release_held(
    mut images: Images,
    engines: Vec<Arc<DevEngine>>,
    t: Instant,
) -> Result<ReleaseReply, SessionError> {
    let mut attempts = Vec::new();
    let mut held = None;
    for attempt in 1..=HOLD_ATTEMPTS {
        if attempt > 1 {
            // The last attempt's images are dropped unfinished (their temporary directories go).
            let Target { dir, parent } = &images.target;
            images.writers = new_writers(&engines, dir, parent.as_deref())?;
            std::thread::sleep(std::time::Duration::from_millis(20 * u64::from(attempt)));
        }
        let parked = park::park_all(park::park_timeout())?;
        // T0: no thread of the job runs.
        let tc = Instant::now();
        let dog = park::Watchdog::start(park::watchdog_limit());
        let copied = copy_all(&engines, &images.writers);
        if dog.stop() {
            attempts.push(HoldAttempt {
                attempt,
                ended_by_watchdog: true,
                ms: ms_since(tc),
            });
            continue;
        }
        held = Some((copied.inspect_err(|_| unpause_job())?, parked));
        break;
    }
    // Every attempt ended by the watchdog: it has already let the job go on.
    let (mut finals, parked) = held.ok_or(SessionError::Watchdog)?;
    commit_held(images.writers, &mut finals, &engines)?;
    let copied = ms(t.elapsed());
    let released = release_engines(&engines, false, None)?;
    let v = ReleaseReply {
        imports_released: Some(released.imports),
        finals,
        final_copy_ms: Some(copied),
        released_bytes: released.bytes,
        staging_freed_bytes: Some(released.staging_freed),
        buffers_released_ms: Some(ms(released.buffers_time)),
        staging_freed_ms: Some(ms(released.staging_time)),
        devices: released.devices,
        held: Some("threads parked".into()),
        parked: Some(to_json(&parked)),
        attempts: Some(attempts),
        ms: ms_since(t),
        ..ReleaseReply::default()
    };
    note_last(|l| l.release = Some(v.clone()));
    Ok(v)
}

/// Commits a held copy's images, with the threads still parked: an attempt the watchdog ended
/// left nothing under the images' names. Each device's figures get its image's.
fn commit_held(
    writers: Vec<(usize, Arc<ImageWriter>)>,
    finals: &mut [DeviceCopy],
    engines: &[Arc<DevEngine>],
) -> Result<(), SessionError> {
    no_faults_since_open().inspect_err(|_| {
        stop_tracking(engines);
        unpause_job();
    })?;
    for ((ordinal, writer), f) in writers.into_iter().zip(finals.iter_mut()) {
        let tc = Instant::now();
        let summary = commit(ordinal, writer).inspect_err(|_| unpause_job())?;
        f.commit_ms = Some(ms(tc.elapsed()));
        f.image_bytes = Some(summary.data_file_bytes);
        f.image_buffers = Some(summary.buffers.len() as u64);
    }
    Ok(())
}

/// With the job held: drains every device (all of them first: a stream of one may write
/// another's buffers), then copies every buffer into its image (not committed). One entry per
/// device.
fn copy_all(
    engines: &[Arc<DevEngine>],
    open: &[(usize, Arc<ImageWriter>)],
) -> Result<Vec<DeviceCopy>, SessionError> {
    let mut synced = Vec::new();
    for (ordinal, _) in open {
        let Some(e) = engine_of(engines, *ordinal) else {
            continue;
        };
        let ts = Instant::now();
        e.engine
            .synchronize_device()
            .map_err(|err| sync_error(*ordinal, "the job's GPU work", err))?;
        park::beat();
        synced.push((*ordinal, ms(ts.elapsed())));
    }
    sync_unmanaged_devices(engines, "the job's GPU work")?;
    let mut out = Vec::new();
    for (ordinal, writer) in open {
        let Some(e) = engine_of(engines, *ordinal) else {
            continue;
        };
        let sync_ms = synced
            .iter()
            .find(|(o, _)| o == ordinal)
            .map_or(0.0, |s| s.1);
        let sink: Arc<dyn ChunkSink> = Arc::new(Beating(writer.clone()));
        let r = e
            .engine
            .checkpoint_held(sink, false)
            .and_then(|h| h.wait())
            .inspect_err(after_mismatch)
            .map_err(|source| SessionError::Engine {
                device: *ordinal,
                what: "copy: ",
                source,
            })?;
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

/// Operations the job enqueued on a per-thread default stream so far.
fn per_thread_ops() -> u64 {
    state_if_created().map_or(0, |st| {
        st.counters
            .per_thread_stream_ops
            .load(std::sync::atomic::Ordering::Relaxed)
    })
}
