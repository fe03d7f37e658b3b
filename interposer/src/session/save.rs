//! Saving a kept checkpoint while the job runs again (`ResumeAndSave`, then `Saved`): every
//! engine's buffers as they were at the release, snapshotted into shadows device to device
//! where the budget allows and copied-on-write ahead of the job's writes otherwise, into new
//! images committed once every save is done.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use possum_control::reply::{DeviceCopy, SavedReply};
use possum_engine::image::ImageWriter;
use possum_engine::store::ChunkSink;
use serde_json::Value;

use crate::base::config;
use crate::base::log::log;
use crate::process::runtime::DevEngine;
use crate::session::common::{
    after_mismatch, commit, engines, ms_since, new_writer, no_faults_since_open,
    no_unwrapped_writer_since, note_last, set_saving, stop_tracking,
};
use crate::session::error::SessionError;
use crate::session::replies::{ms, pipeline, reply, waited_on, with_prints};
use crate::session::spare::SpareSaver;
use crate::session::state::{session, Saving};

/// The saves started: per device, its image, its checkpoint and the keeper's spare memory it
/// borrowed, if any.
pub(crate) type Saves = Vec<(
    usize,
    Arc<ImageWriter>,
    possum_engine::checkpoint::CheckpointHandle,
    Option<Arc<SpareSaver>>,
)>;

/// With the job still paused (its buffers as at the release): starts every engine's checkpoint
/// into a new image under `dir`, a concurrent one: every buffer the shadow budget allows is
/// copied device to device now, before the job runs (its image is then the state at T0 whatever
/// the job writes, seen by the hooks or not), the rest by copy-on-write ahead of the job's writes.
pub(crate) fn start_save(dir: &Path, shadow_mib: Option<u64>, parent: Option<&Path>) -> Saves {
    set_saving(Saving::Running);
    let engines = engines();
    let mut started = Vec::new();
    // What the job will write soonest is saved first (the DAG's prediction).
    let order = crate::process::runtime::state_if_created()
        .map(|st| st.predicted_writes())
        .unwrap_or_default();
    for e in &engines {
        let ordinal = e.ordinal;
        e.engine
            .set_shadow_budget(shadow_mib.map_or_else(|| shadow_budget(e), |m| m << 20));
        e.engine.set_save_order(order.clone());
        let begun = new_writer(dir, ordinal, parent)
            .map_err(|err| err.to_string())
            .and_then(|writer| {
                let sink: Arc<dyn ChunkSink> = writer.clone();
                let spare = SpareSaver::borrow(e, &writer);
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
pub(crate) fn finish_save(saves: Saves) {
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
            .and_then(|r| {
                no_faults_since_open()
                    .map(|()| r)
                    .map_err(|e| e.to_string())
            })
            // A kept checkpoint is released only while the job took no writing function
            // unwrapped: one taken since may have written a buffer before it was saved.
            .and_then(|r| {
                no_unwrapped_writer_since(0)
                    .map(|()| r)
                    .map_err(|e| e.to_string())
            });
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
                    pipeline: Some(pipeline(&r.pipeline)),
                    ..with_prints(DeviceCopy::default(), &possum_engine::Prints::of(&r))
                }),
                Err(e) => failed = failed.or(Some(e.to_string())),
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
                ms: ms_since(t),
            };
            note_last(|l| l.saved = Some(v.clone()));
            set_saving(Saving::Done(v));
        }
    }
}

/// `Saved`: waits until the save `ResumeAndSave` started is over; its figures, or why it failed.
pub fn saved() -> Value {
    let s = session();
    let mut g = s.saving.lock();
    while matches!(*g, Saving::Running) {
        s.save_changed.wait(&mut g);
    }
    reply(match &*g {
        Saving::Done(v) => Ok(v.clone()),
        Saving::Failed(e) => Err(SessionError::SaveFailed(e.clone())),
        Saving::Idle | Saving::Running => Err(SessionError::NoSave),
    })
}
