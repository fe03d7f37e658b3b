//! A checkpoint of a HIP job, as the control socket's requests drive it: the same protocol as a
//! CUDA job's (`crate::session::checkpoint`, whose image naming, commit, fault accounting and one-at-a-time
//! rule it shares), over the front end's one engine.
//!
//! - `Checkpoint`: a pre-copy while the job runs, every buffer into a new image; the hooks mark
//!   what the job writes meanwhile. (`CheckpointKept` is the same: a HIP job has no keeper to
//!   hold its memory, so nothing is kept.)
//! - `Release`: the job's HIP operations paused at the op gate, the device waited for (T0), what
//!   was written since the pre-copy copied, the image committed, the buffers' memory released
//!   (their addresses stay reserved).
//! - `Resume{dir}`: the buffers mapped again at their addresses and brought back from the image,
//!   on demand: the job goes on at once, an operation on a buffer not yet back waiting for it.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use possum_control::reply::{CheckpointReply, DeviceCopy, ReleaseReply, ResumeReply};
use possum_control::Request;
use possum_engine::image::Image;
use possum_engine::store::ChunkSink;
use serde_json::{json, Value};

use super::front::{made, Front, DEVICE};
use crate::base::log::log;
use crate::ops::gate;
use crate::session::common::{self, Busy};
use crate::session::error::SessionError;
use crate::session::replies::{ms, reply, round_copy};
use crate::session::state::{session, Images, OnDemand, Phase, RestoreFigures, Target};

/// `Status` for a HIP job: the CUDA status's shape, `possum` being the front end's.
pub fn status_json() -> Value {
    let mut v = json!({
        "pid": std::process::id(),
        "hooks": "entry",
        "runtime": possum_control::reply::RUNTIME_HIP,
    });
    if let Some(f) = made() {
        v["possum"] = f.stats_json();
        v["possum"]["session"] = common::status_json();
    }
    v
}

/// The front end's answer to a session request; `None` for a request it leaves to the rest.
pub fn handle(req: &Request) -> Option<Value> {
    let f = made()?;
    let session = matches!(
        req,
        Request::Checkpoint { .. }
            | Request::CheckpointKept { .. }
            | Request::Release
            | Request::ReleaseKeeping { .. }
            | Request::Resume { .. }
            | Request::ResumeAndSave { .. }
    );
    if session && crate::process::runtime::state_if_created().is_some() {
        return Some(possum_control::error_reply(
            "this process uses both CUDA and HIP: possum checkpoints a process on one GPU \
             runtime only; nothing was done",
        ));
    }
    Some(match req {
        Request::Checkpoint { dir, .. } | Request::CheckpointKept { dir, .. } => {
            reply(checkpoint(f, Path::new(dir)))
        }
        Request::Release | Request::ReleaseKeeping { .. } => reply(release(f)),
        Request::Resume { dir } => reply(resume(f, dir.as_deref().map(Path::new))),
        Request::ResumeAndSave { .. } => possum_control::error_reply(
            "no kept checkpoint to save: a HIP job's buffers are copied at the release",
        ),
        _ => return None,
    })
}

/// Why a checkpoint cannot save the job: device memory possum does not serve.
fn refuse_unmanaged(f: &Front) -> Result<(), SessionError> {
    let unmanaged = f.unmanaged();
    if unmanaged.is_empty() {
        return Ok(());
    }
    let kinds: Vec<String> = unmanaged
        .iter()
        .map(|(k, (n, b))| format!("{k}: {n} allocation(s), {b} bytes"))
        .collect();
    Err(SessionError::Refused(format!(
        "the job has HIP device memory possum does not serve ({}): possum saves only the \
         buffers it serves (hipMalloc, hipMallocAsync and pools on device {DEVICE}); nothing \
         was done",
        kinds.join("; ")
    )))
}

fn checkpoint(f: &Front, dir: &Path) -> Result<CheckpointReply, SessionError> {
    common::absolute(dir)?;
    let _b = Busy::take("checkpoint")?;
    if gate::is_paused() {
        return Err(SessionError::Paused);
    }
    refuse_unmanaged(f)?;
    common::open_faults();
    let t = Instant::now();
    std::fs::create_dir_all(dir).map_err(|source| SessionError::Dir {
        path: dir.to_path_buf(),
        source,
    })?;
    let writer = common::new_writer(dir, DEVICE, None)?;
    f.engine.mark_all_dirty();
    // What the job will write soonest is saved first (the DAG's prediction), so that its
    // writes during the pre-copy find their buffers saved already.
    f.engine.set_save_order(f.predicted_writes());
    let sink: Arc<dyn ChunkSink> = writer.clone();
    let r = f
        .engine
        .precopy_round(sink)
        .map_err(|source| SessionError::Engine {
            device: DEVICE,
            what: "pre-copy: ",
            source,
        })?;
    *session().phase.lock() = Phase::PreCopied(Images {
        target: Target {
            dir: dir.to_path_buf(),
            parent: None,
        },
        writers: vec![(DEVICE, writer)],
    });
    let v = CheckpointReply {
        precopy: vec![round_copy(DEVICE, &r)],
        hooks: Some(true),
        kept: false,
        ms: Some(ms(t.elapsed())),
    };
    crate::session::checkpoint::note_checkpoint(&v);
    Ok(v)
}

/// The checkpoint in progress: its image's writer.
fn take_open() -> Result<Arc<possum_engine::image::ImageWriter>, SessionError> {
    match std::mem::take(&mut *session().phase.lock()) {
        Phase::PreCopied(Images { mut writers, .. }) if writers.len() == 1 => {
            Ok(writers.remove(0).1)
        }
        _ => Err(SessionError::NoCheckpoint),
    }
}

fn release(f: &Front) -> Result<ReleaseReply, SessionError> {
    let _b = Busy::take("release")?;
    if gate::is_paused() {
        return Err(SessionError::AlreadyPaused);
    }
    let writer = take_open()?;
    let t = Instant::now();
    gate::set_paused(true);
    let unpause = |m: SessionError| {
        gate::set_paused(false);
        m
    };
    // T0: no operation of the job between its hook and its enqueue, then the device idle.
    f.engine.wait_ops_enqueued();
    f.engine.set_device_fence(true);
    let sink: Arc<dyn ChunkSink> = writer.clone();
    let r = f.engine.checkpoint_held(sink, true).and_then(|h| h.wait());
    f.engine.set_device_fence(false);
    let r = r.map_err(|source| {
        unpause(SessionError::Engine {
            device: DEVICE,
            what: "final copy: ",
            source,
        })
    })?;
    common::no_faults_since_open().map_err(|e| {
        let _ = f.engine.stop_tracking();
        unpause(e)
    })?;
    let summary = common::commit(DEVICE, writer).map_err(unpause)?;
    let copied = ms(t.elapsed());
    let released = f.engine.release().map_err(|source| {
        unpause(SessionError::Engine {
            device: DEVICE,
            what: "release: ",
            source,
        })
    })?;
    let v = ReleaseReply {
        finals: vec![DeviceCopy {
            device: DEVICE,
            buffers: r.buffers as u64,
            bytes: r.bytes,
            ms: Some(ms(r.elapsed)),
            image_bytes: Some(summary.data_file_bytes),
            image_buffers: Some(summary.buffers.len() as u64),
            ..DeviceCopy::default()
        }],
        final_copy_ms: Some(copied),
        released_bytes: released,
        devices: vec![DEVICE],
        ms: Some(ms(t.elapsed())),
        ..ReleaseReply::default()
    };
    common::note_last(|l| l.release = Some(v.clone()));
    Ok(v)
}

fn resume(f: &'static Front, dir: Option<&Path>) -> Result<ResumeReply, SessionError> {
    if let Some(d) = dir {
        common::absolute(d)?;
    }
    let _b = Busy::take("resume")?;
    let t = Instant::now();
    // A checkpoint abandoned before its release: its image is dropped unfinished.
    *session().phase.lock() = Phase::Idle;
    let mut restoring = Vec::new();
    if f.engine.phase() == "released" {
        let dir = dir.ok_or(SessionError::NeedsImage(DEVICE))?;
        let path = common::engine_image_dir(dir, DEVICE);
        let img = Image::open(&path).map_err(|source| SessionError::OpenImage {
            device: DEVICE,
            source,
        })?;
        let h = f
            .engine
            .restore(Arc::new(img))
            .map_err(|source| SessionError::Engine {
                device: DEVICE,
                what: "",
                source,
            })?;
        restoring.push(DEVICE);
        // Nobody waits for the restore; its figures are kept for `possum status`.
        let _ = std::thread::Builder::new()
            .name("possum-restore-wait".into())
            .spawn(move || {
                let done = h.wait().map(|r| {
                    if let Err(e) = f.engine.stop_tracking() {
                        log(&format!("device {DEVICE}: tracking stays on: {e}"));
                    }
                    RestoreFigures {
                        device: DEVICE,
                        buffers: Some(r.buffers),
                        bytes: Some(r.bytes),
                        ms: Some(ms(r.elapsed)),
                        on_demand: Some(OnDemand::Buffers(r.on_demand)),
                        job_waited_ms: Some(ms(r.job_waited)),
                        ..RestoreFigures::default()
                    }
                });
                common::note_restore_done(DEVICE, done);
            });
    } else if let Err(e) = f.engine.stop_tracking() {
        log(&format!("device {DEVICE}: tracking stays on: {e}"));
    }
    gate::set_paused(false);
    Ok(ResumeReply {
        restoring,
        on_demand: Some(true),
        ms: Some(ms(t.elapsed())),
        ..ResumeReply::default()
    })
}
