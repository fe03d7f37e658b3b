//! `Resume{dir}` and `ResumeAndSave{dir, shadow_mib, parent}`: every engine's buffers brought
//! back (detached ones attached again, released ones restored from the image, on demand where
//! the hooks can be trusted), a kept checkpoint's save started where asked for, then the job let
//! go on.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use possum_control::reply::{DeviceMoved, ResumeReply, StageTaken};
use possum_engine::image::Image;
use possum_engine::restore::RestoreHandle;
use serde_json::Value;

use crate::base::config;
use crate::base::log::log;
use crate::cuda::cupti::hooks_live;
use crate::ops::gate;
use crate::process::runtime::DevEngine;
use crate::session::common::{
    absolute, engine_image_dir, engines, ms_since, note_last, note_restore_done, set_saving,
    stop_tracking, unpause_job, Busy,
};
use crate::session::error::SessionError;
use crate::session::replies::{ms, reply, restore_figures};
use crate::session::save::{finish_save, start_save, Saves};
use crate::session::state::{session, Saving};

/// How a kept checkpoint is saved (`ResumeAndSave`): the shadow budget in MiB (`None`: the
/// job's default) and the earlier image whose unchanged chunks it references.
pub type Save = (Option<u64>, Option<PathBuf>);

/// `Resume{dir}`: attach each detached engine's buffers again, install each released engine's
/// on-demand restore from `dir`, then unpause. `ResumeAndSave{dir, shadow_mib}` (`save` is
/// `Some(shadow_mib)`): for a kept checkpoint into `dir`, also start saving the buffers as they
/// were at the release, while the job runs (`saved` waits for it), with that shadow budget
/// (MiB; `None`: the job's default).
pub fn resume(dir: Option<&str>, save: Option<Save>) -> Value {
    reply(resume_inner(dir.map(Path::new), save))
}

fn resume_inner(dir: Option<&Path>, save: Option<Save>) -> Result<ResumeReply, SessionError> {
    if let Some(d) = dir {
        absolute(d)?;
    }
    let _b = Busy::take("resume")?;
    let t = Instant::now();
    // A process restored onto another GPU (`possum restore --device`): its buffers' memory
    // comes from the keeper's socket serving that GPU from now on; what the old GPU's keeper
    // still holds of them is let go, and they come back from that socket's stage or the image.
    let moved = follow_moves();
    let (attached, from_image) = reattach_all()?;
    let attach_ms = ms(t.elapsed());
    let saves = begin_save(dir, save);
    let on_demand = restores_on_demand();
    let (restoring, staged) = restore_released(dir, &from_image, on_demand)?;
    let saving: Vec<usize> = saves.iter().map(|(o, ..)| *o).collect();
    // Memory other processes shared with this one, mapped again before the job goes on; without
    // it the job stays paused (its kernels would fault on those addresses).
    let imports_attached =
        crate::memory::imports::attach().map_err(SessionError::ImportsKeptPaused)?;
    unpause_job();
    if !saves.is_empty() {
        let _ = std::thread::Builder::new()
            .name("possum-save-wait".into())
            .spawn(move || finish_save(saves));
    }
    Ok(ResumeReply {
        restoring,
        on_demand: Some(on_demand),
        attached,
        kept_memory_gone: from_image,
        staged,
        moved,
        attach_ms: Some(attach_ms),
        imports_attached: Some(imports_attached),
        saving,
        ms: ms_since(t),
    })
}

/// Detached buffers first: their memory is on the GPU, kept by the keeper. Where the keeper no
/// longer has them (a job restored from its image after the original ran on and took them
/// back, or the keeper gone), they come back from the image instead. The devices attached, and
/// those whose buffers come from the image.
fn reattach_all() -> Result<(Vec<usize>, Vec<usize>), SessionError> {
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
                e.engine
                    .drop_detached()
                    .map_err(|source| SessionError::Engine {
                        device: e.ordinal,
                        what: "dropping its detached buffers: ",
                        source,
                    })?;
                from_image.push(e.ordinal);
            }
        }
    }
    Ok((attached, from_image))
}

/// Ends the open checkpoint; with `save`, starts saving it when it is a kept one into `dir`
/// (else the save is marked failed, for `Saved` to say why).
fn begin_save(dir: Option<&Path>, save: Option<Save>) -> Saves {
    let phase = std::mem::take(&mut *session().phase.lock());
    let Some((shadow_mib, parent)) = save else {
        return Vec::new();
    };
    if let Some(target) = dir.and_then(|d| phase.kept_into(d)) {
        let parent = parent.or_else(|| target.parent.clone());
        return start_save(&target.dir, shadow_mib, parent.as_deref());
    }
    let why = format!(
        "no kept checkpoint into {} to save",
        dir.map(|d| d.display().to_string()).unwrap_or_default()
    );
    set_saving(Saving::Failed(why.clone()));
    log(&why);
    Vec::new()
}

/// Without hooks no operation waits for its buffers: they are all back before the resume
/// answers. So too when the job took a writing driver function without possum's wrapper: what
/// it writes through it would not wait for its buffer.
fn restores_on_demand() -> bool {
    hooks_live() && gate::unwrapped_writers().is_empty()
}

/// Starts each released engine's restore from its image under `dir` (`from_image`: the devices
/// whose kept memory was lost), waited for here unless it is `on_demand`. The devices
/// restoring, and the keeper's stages taken.
fn restore_released(
    dir: Option<&Path>,
    from_image: &[usize],
    on_demand: bool,
) -> Result<(Vec<usize>, Vec<StageTaken>), SessionError> {
    let mut out = Vec::new();
    let mut staged = Vec::new();
    for e in engines() {
        if e.engine.phase() != "released" {
            continue;
        }
        let dir = dir.ok_or(SessionError::NeedsImage(e.ordinal))?;
        let h = start_restore(&e, dir, from_image, &mut staged)?;
        if on_demand {
            // Nobody has to wait for the restore; its figures are kept for `possum status`.
            wait_in_background(e.clone(), h);
        } else {
            let r = h.wait().map_err(|source| SessionError::Engine {
                device: e.ordinal,
                what: "restore: ",
                source,
            })?;
            stop_tracking(std::slice::from_ref(&e));
            let mut v = restore_figures(e.ordinal, &r, false);
            v.on_demand = Some(crate::session::state::OnDemand::Before(false));
            note_last(|l| l.restore = Some(v));
        }
        out.push(e.ordinal);
    }
    Ok((out, staged))
}

/// Opens device `e`'s image under `dir` and starts its restore, from the keeper's stage where
/// there is one (noted in `staged`).
fn start_restore(
    e: &Arc<DevEngine>,
    dir: &Path,
    from_image: &[usize],
    staged: &mut Vec<StageTaken>,
) -> Result<RestoreHandle, SessionError> {
    let path = engine_image_dir(dir, e.ordinal);
    let img = Image::open(&path).map_err(|source| {
        if from_image.contains(&e.ordinal) {
            // Kept, lost by the keeper, and not saved anywhere.
            SessionError::KeptMemoryLost {
                device: e.ordinal,
                source,
            }
        } else {
            SessionError::OpenImage {
                device: e.ordinal,
                source,
            }
        }
    })?;
    let img = Arc::new(img);
    match staged_restore(e, &path) {
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
    .map_err(|source| SessionError::Engine {
        device: e.ordinal,
        what: "",
        source,
    })
}

/// Waits for `e`'s restore on a thread of its own, then ends its tracking and keeps its figures
/// for `possum status`.
fn wait_in_background(e: Arc<DevEngine>, h: RestoreHandle) {
    let ordinal = e.ordinal;
    let _ = std::thread::Builder::new()
        .name("possum-restore-wait".into())
        .spawn(move || {
            let done = h.wait().map(|r| {
                stop_tracking(std::slice::from_ref(&e));
                restore_figures(ordinal, &r, true)
            });
            note_restore_done(ordinal, done);
        });
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
