//! Checkpoint sessions inside the job, driven by `possum checkpoint` / `possum restore` over the
//! control socket (`Checkpoint`, `Release`, `Resume`); this file opens one (`Checkpoint`,
//! `PrecopyRound`), `release.rs`, `resume.rs` and `save.rs` hold the steps that follow.
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
//!
//! The session's phases ([`crate::session::state::Phase`]) are the state these steps move
//! through; each step's failure is a [`SessionError`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use possum_control::reply::{CheckpointReply, DeviceCopy};
use possum_engine::image::ImageWriter;
use possum_engine::store::ChunkSink;
use serde_json::Value;

use crate::base::log::log;
use crate::cuda::cupti::hooks_live;
use crate::ops::gate;
use crate::process::ab;
use crate::process::runtime::DevEngine;
use crate::session::common::{
    absolute, engine_of, engines, ms_since, new_writer, note_last, open_faults, paused,
    stop_tracking, Busy,
};
use crate::session::error::SessionError;
use crate::session::replies::{reply, round_copy, written};
use crate::session::state::{session, Images, Last, Phase, Saving, Target};

/// `Checkpoint{dir}`: every engine's buffers at one T0 each, copied while the job runs.
/// `CheckpointKept{dir}` (`keep`): nothing copied now where every engine's memory is kept by a
/// keeper (see `release.rs`).
pub fn checkpoint(dir: &str, keep: bool, parent: Option<&str>) -> Value {
    if let Err(e) =
        absolute(Path::new(dir)).and_then(|()| parent.map_or(Ok(()), |p| absolute(Path::new(p))))
    {
        return reply::<CheckpointReply, _>(Err(e));
    }
    let target = Target {
        dir: PathBuf::from(dir),
        parent: parent.map(PathBuf::from),
    };
    reply(checkpoint_inner(target, keep).inspect_err(|_| stop_tracking(&engines())))
}

/// How a checkpoint is made, decided as it opens.
#[derive(Debug, Clone, Copy, PartialEq)]
enum How {
    /// Pre-copied while the job runs, trusting the hooks.
    PreCopy,
    /// Everything copied at the release, the job's threads parked.
    Hold,
    /// Nothing copied: the keeper keeps the memory, saved after the job runs again.
    Kept,
}

fn checkpoint_inner(target: Target, keep: bool) -> Result<CheckpointReply, SessionError> {
    let _b = Busy::take("checkpoint")?;
    refuse_checkpoint()?;
    // A checkpoint whose `possum` went away before its release: its images are abandoned.
    *session().phase.lock() = Phase::Idle;
    open_faults();
    let t = Instant::now();
    std::fs::create_dir_all(&target.dir).map_err(|source| SessionError::Dir {
        path: target.dir.clone(),
        source,
    })?;
    let all = engines();
    let how = decide(&all, keep);
    let (phase, precopy) = match how {
        // A kept checkpoint's images are made at the save, after CRIU's dump: an image file
        // open during the dump would be in CRIU's image, to be reopened at its restore.
        How::Kept => (Phase::Kept(target), Vec::new()),
        How::Hold => {
            let writers = all
                .iter()
                .map(|e| {
                    Ok((
                        e.ordinal,
                        new_writer(&target.dir, e.ordinal, target.parent.as_deref())?,
                    ))
                })
                .collect::<Result<_, SessionError>>()?;
            (Phase::ToHold(Images { target, writers }), Vec::new())
        }
        How::PreCopy => {
            let (images, precopy) = first_round(&all, target)?;
            (Phase::PreCopied(images), precopy)
        }
    };
    *session().phase.lock() = phase;
    let v = CheckpointReply {
        precopy,
        hooks: Some(how != How::Hold),
        kept: how == How::Kept,
        ms: ms_since(t),
    };
    *session().last.lock() = Some(Last {
        checkpoint: Some(v.clone()),
        ..Last::default()
    });
    Ok(v)
}

/// Why no checkpoint can begin now, if one cannot.
fn refuse_checkpoint() -> Result<(), SessionError> {
    if matches!(*session().saving.lock(), Saving::Running) {
        return Err(SessionError::StillSaving);
    }
    if ab::running() {
        return Err(SessionError::AbTest);
    }
    if paused() {
        return Err(SessionError::Paused);
    }
    Ok(())
}

/// How the checkpoint opening now is made. Without hooks nothing marks buffers dirty: no
/// pre-copy, everything is copied at the release with the job's threads parked. So too when the
/// job took a driver function that writes device memory without possum's wrapper: the hooks may
/// miss its writes. Kept (`keep`): every engine's buffer memory is the keeper's, and the hooks
/// see the operations that write buffers (the save runs while the job does); not with memory
/// shared with another process: its writes there are not seen here, so that memory is copied
/// while every process is held, not saved after the job runs on.
fn decide(all: &[Arc<DevEngine>], keep: bool) -> How {
    let unwrapped = gate::unwrapped_writers();
    let hooks = hooks_live() && unwrapped.is_empty();
    if hooks_live() && !hooks {
        log(&format!(
            "checkpoint with the job's threads held for the whole copy: it took {} without \
             possum's wrapper",
            unwrapped.join(", ")
        ));
    }
    let shared = crate::memory::vmm::shared_pieces();
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
    match (kept, hooks) {
        (true, _) => How::Kept,
        (false, true) => How::PreCopy,
        (false, false) => How::Hold,
    }
}

/// A new image per engine under `target`, each filled with a first pre-copy round of every
/// buffer (not only those written since the last round: that round, of an earlier checkpoint,
/// went into another image).
fn first_round(
    all: &[Arc<DevEngine>],
    target: Target,
) -> Result<(Images, Vec<possum_control::reply::DeviceCopy>), SessionError> {
    let mut out = Vec::new();
    let mut writers = Vec::new();
    // (Each writer records into the journal while it copies: it is one file, appended to.)
    let journal = crate::session::release::take_journal();
    for e in all {
        let writer = new_writer(&target.dir, e.ordinal, target.parent.as_deref())?;
        e.engine.mark_all_dirty();
        writer.journal_to(journal.as_ref().and_then(|j| j.try_clone().ok()));
        let sink: Arc<dyn ChunkSink> = writer.clone();
        let r = e.engine.precopy_round(sink);
        writer.journal_to(None);
        let r = r.map_err(|source| SessionError::Engine {
            device: e.ordinal,
            what: "pre-copy: ",
            source,
        })?;
        draft(&writer);
        out.push(DeviceCopy {
            written: written(&writer),
            ..round_copy(e.ordinal, &r)
        });
        writers.push((e.ordinal, writer));
    }
    Ok((Images { target, writers }, out))
}

/// The image's draft manifest after a round, for a migration's destination to load ahead
/// (`ImageWriter::write_draft`). Without it the destination loads the image once it is whole:
/// a failure is said and is no reason to fail the checkpoint.
fn draft(writer: &ImageWriter) {
    if let Err(e) = writer.write_draft() {
        log(&format!("no draft manifest after the pre-copy round: {e}"));
    }
}

/// `PrecopyRound`: another pre-copy round into the images the open checkpoint writes, the job
/// running; what each device copied (buffers written since the last round).
pub fn precopy_round() -> Value {
    reply(precopy_round_inner())
}

fn precopy_round_inner() -> Result<CheckpointReply, SessionError> {
    let _b = Busy::take("pre-copy round")?;
    let t = Instant::now();
    let phase = session().phase.lock();
    let Phase::PreCopied(images) = &*phase else {
        return Err(SessionError::NoPrecopy);
    };
    let engines = engines();
    let mut out = Vec::new();
    for (ordinal, writer) in &images.writers {
        let Some(e) = engine_of(&engines, *ordinal) else {
            continue;
        };
        let sink: Arc<dyn ChunkSink> = writer.clone();
        let r = e
            .engine
            .precopy_round(sink)
            .map_err(|source| SessionError::Engine {
                device: *ordinal,
                what: "pre-copy round: ",
                source,
            })?;
        draft(writer);
        out.push(DeviceCopy {
            written: written(writer),
            ..round_copy(*ordinal, &r)
        });
    }
    Ok(CheckpointReply {
        precopy: out,
        hooks: Some(true),
        kept: false,
        ms: ms_since(t),
    })
}

/// Sets the checkpoint's figures in the last session's (the HIP front end's checkpoint).
pub(crate) fn note_checkpoint(v: &CheckpointReply) {
    note_last(|l| l.checkpoint = Some(v.clone()));
}
