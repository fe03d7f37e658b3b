//! `possum restore`'s staging: before CRIU restores the job, the keeper that
//! served its buffers' memory is asked to load the job's GPU images into new GPU memory
//! (`possum_keeper`'s `stage`), so that the loading overlaps CRIU's and the driver's restore, and
//! the restored job maps its buffers at once and waits only for those still loading.
//!
//! Nothing is staged (the restored job copies from the image as before) when it is turned off
//! (`POSSUM_RESTORE_STAGE=0`), when the job had no keeper, and when the keeper still holds the
//! job's memory on the GPU it is restored on (a job killed on this host: mapped again, nothing
//! loaded). A keeper that must be started for it is started before CRIU's restore: should CRIU
//! then fail (the keeper's process could hold a PID the job needs), the keeper is stopped and
//! CRIU tried once more, as without staging.
//!
//! With `--device` (another GPU of this host) the stage is asked of the keeper's socket that
//! serves the target GPU (found by UUID: the job keeps its device ordinal, the keeper numbers
//! GPUs its own way), and where the job's old GPU still holds its memory (killed with
//! `--keep-on-gpu`, under the epoch `possum.json` recorded), the stage copies each buffer from
//! there, GPU to GPU, instead of reading the image.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use serde::Serialize;

use crate::image::{Image, Manifest};
use crate::postcopy::PostCopy;
use possum_keeper::{uuid_hex, PeerSource, PendingPiece};

/// How long a stage's memory is kept for a process that does not exist yet (CRIU restoring it).
const HOLD_SECS: u64 = 120;

/// One image's stage, as `possum restore --json` reports it.
#[derive(Debug, Clone, Serialize)]
pub struct StageReport {
    pub pid: i32,
    pub device: usize,
    pub image: PathBuf,
    /// The keeper socket asked (the one serving the GPU the job is restored on).
    pub socket: Option<PathBuf>,
    /// The keeper socket of the job's old GPU it copies from (`--device`), if any.
    pub from: Option<String>,
    /// Buffers copied GPU to GPU from there (the rest are read from the image).
    pub peer_buffers: u64,
    /// Why buffers that were to be copied GPU to GPU are read from the image instead (the
    /// keeper's first few reasons).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peer_misses: Vec<String>,
    /// The keeper's stage id.
    pub stage: Option<u64>,
    pub buffers: u64,
    pub bytes: u64,
    /// The prestage it was built on (a migration's destination loaded the image ahead), and the
    /// bytes it found in memory there: not loaded again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base: Option<u64>,
    /// Why the prestage could not be built on (the image was staged without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base_error: Option<String>,
    pub reused_bytes: u64,
    /// How long the keeper took to take the request (open the image, create the memory); the
    /// loads go on after it.
    pub request_ms: f64,
    /// Why it was not staged.
    pub error: Option<String>,
    /// Staged, but the restored process did not take it (ended, its memory freed).
    pub unused: bool,
}

/// Stages being set up while CRIU restores the job.
pub(crate) struct Staging {
    dir: PathBuf,
    started: Option<Child>,
    /// The stage requests, on a thread of their own until they are waited for ...
    thread: Option<JoinHandle<Vec<StageReport>>>,
    /// ... and their reports then.
    reports: Vec<StageReport>,
}

/// Where to stage: the keeper's directory, and for `--device` the move (the job's GPU's UUID,
/// the target's).
pub(crate) struct Plan {
    dir: PathBuf,
    moved: Option<([u8; 16], [u8; 16])>,
}

/// Whether, and where, to stage (`moved`: `--device` maps the job's GPU to another, as the
/// driver's restore is told; `held`: the job's keeper still holds its memory, [`keeper_holds`];
/// `on`: [`Environment::restore_stage`](crate::Environment::restore_stage)), or why not.
pub(crate) fn plan(
    m: &Manifest,
    gpu: Option<&Path>,
    moved: Option<([u8; 16], [u8; 16])>,
    held: bool,
    on: bool,
) -> Result<Plan, String> {
    if !on {
        return Err("off (POSSUM_RESTORE_STAGE=0)".into());
    }
    if gpu.is_none() {
        return Err("the image has no GPU buffers of possum's".into());
    }
    let Some(k) = &m.keeper else {
        return Err("the job had no keeper".into());
    };
    if moved.is_none() && held {
        return Err("the keeper still holds the job's memory".into());
    }
    Ok(Plan {
        dir: k.dir.clone(),
        moved,
    })
}

impl Staging {
    /// Asks the keeper in `keeper_dir` (started here if none answers) to stage every GPU image
    /// of the job's, on a thread of its own: returns at once.
    pub(crate) fn begin(
        img: &Image,
        plan: Plan,
        exe: &Path,
        prestaged: &[crate::prestage::Prestaged],
        post_copy: Option<Arc<PostCopy>>,
    ) -> anyhow::Result<Staging> {
        let m = &img.manifest;
        let Plan {
            dir: keeper_dir,
            moved,
        } = plan;
        let tree: Vec<i32> = std::iter::once(m.pid)
            .chain(m.cuda_children.iter().copied())
            .chain(m.possum_children.iter().copied())
            .collect();
        // A keeper in a PID of the job's tree would make CRIU's restore fail: it is avoided.
        let k = m.keeper.as_ref().expect("plan checked it");
        let started = k.ensure_keeper(exe, m.pid, &tree)?;
        let todo = img.gpu_images();
        let kdir = keeper_dir.clone();
        let m = m.clone();
        let (dir, prestaged) = (img.dir.clone(), prestaged.to_vec());
        let thread = std::thread::Builder::new()
            .name("possum-stage".into())
            .spawn(move || {
                todo.into_iter()
                    .map(|(pid, device, image)| {
                        let (socket, from) = stage_target(&m, &kdir, moved, pid, device);
                        let base = socket
                            .as_ref()
                            .ok()
                            .and_then(|s| crate::prestage::base_for(&prestaged, &dir, &image, s));
                        // Post-copy: the pieces of it still to come, and then each as it comes.
                        let rel = crate::postcopy::relative(&dir, &image).unwrap_or_default();
                        let pending = (post_copy.as_ref())
                            .map(|pc| pc.pending_in(&rel))
                            .unwrap_or_default();
                        let rep = stage_one(socket, from, base, pending, (pid, device), image);
                        if let (Some(pc), Some(id), Some(sock)) =
                            (&post_copy, rep.stage, &rep.socket)
                        {
                            pc.told_by(&rel, sock, id);
                        }
                        rep
                    })
                    .collect()
            })?;
        Ok(Staging {
            dir: keeper_dir,
            started,
            thread: Some(thread),
            reports: Vec::new(),
        })
    }

    /// Waits for the stage requests (the loads go on in the keeper): whether every GPU image
    /// of the job was staged.
    pub(crate) fn all_staged(&mut self) -> bool {
        self.requests().iter().all(|r| r.stage.is_some())
    }

    /// The stage requests' reports, once they are answered.
    fn requests(&mut self) -> &mut Vec<StageReport> {
        if let Some(t) = self.thread.take() {
            self.reports = t.join().unwrap_or_default();
        }
        &mut self.reports
    }

    /// Whether a keeper was started for the staging.
    pub(crate) fn started_keeper(&self) -> bool {
        self.started.is_some()
    }

    /// The keeper's directory.
    pub(crate) fn keeper_dir(&self) -> &Path {
        &self.dir
    }

    /// Waits for the stage requests (the loads go on in the keeper) and ends the stages that
    /// are not in `used` (no restored process took them): their memory is freed.
    pub(crate) fn finish_keeping(self, used: &[u64]) -> Vec<StageReport> {
        self.end_unused(used).0
    }

    /// Gives up: every stage is ended (its memory freed), and a keeper started for it stopped.
    pub(crate) fn abandon(self) {
        if let (_, Some(mut c)) = self.end_unused(&[]) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the stage requests and ends every stage not in `used` (marked `unused`); the
    /// reports, and the keeper started for the staging.
    fn end_unused(mut self, used: &[u64]) -> (Vec<StageReport>, Option<Child>) {
        let mut reports = std::mem::take(self.requests());
        for r in &mut reports {
            let (Some(id), Some(sock)) = (r.stage.filter(|id| !used.contains(id)), &r.socket)
            else {
                continue;
            };
            if let Ok(mut k) = possum_keeper::Keeper::connect(sock) {
                let _ = k.stage_end(id);
            }
            r.unused = true;
        }
        (reports, self.started)
    }
}

/// Where device `device`'s image of process `pid` is staged: the keeper socket in `dir` (for a
/// move, the one serving the target GPU), and for a move the memory it copies from.
fn stage_target(
    m: &Manifest,
    dir: &Path,
    moved: Option<([u8; 16], [u8; 16])>,
    pid: i32,
    device: usize,
) -> (Result<PathBuf, String>, Option<PeerSource>) {
    let Some((old, new)) = moved else {
        return (Ok(job_socket(m, dir, device)), None);
    };
    let epoch = m
        .held
        .iter()
        .find(|h| h.pid == pid && h.device == device)
        .map(|h| h.epoch);
    (target_socket(dir, &new), peer_of(dir, &old, device, epoch))
}

/// Has each keeper socket in `dir` free now the memory of processes that are gone (a keeper
/// that does not answer is left alone: the room check then says what is short).
pub(crate) fn reap(dir: &Path) {
    for s in possum_keeper::sockets_in(dir) {
        let _ = possum_keeper::Keeper::connect(&s).and_then(|mut k| k.reap());
    }
}

/// Whether the job's keeper still holds memory of the job (device 0's socket: a job killed on
/// this host with `--keep-on-gpu`, within its hold): a restore on its own GPU maps it again.
pub(crate) fn keeper_holds(m: &Manifest) -> bool {
    let Some(k) = &m.keeper else {
        return false;
    };
    possum_keeper::Keeper::connect(&job_socket(m, &k.dir, 0))
        .and_then(|mut keeper| keeper.retained(m.pid))
        .is_ok_and(|r| !r.is_empty())
}

/// The socket in keeper directory `dir` serving device `device` of the job on the GPU it ran on:
/// for a single-GPU job the one serving that GPU's UUID (a job moved by an earlier `--device`
/// restore keeps an ordinal the keeper numbers otherwise), else `keeper-<device>.sock`.
fn job_socket(m: &Manifest, dir: &Path, device: usize) -> PathBuf {
    crate::image::keeper_socket(&m.gpu_memory, dir, device)
}

/// The socket in `dir` serving the GPU with UUID `uuid` (the one the job is restored on).
fn target_socket(dir: &Path, uuid: &[u8; 16]) -> Result<PathBuf, String> {
    possum_keeper::keeper_for_device(dir, &uuid_hex(uuid)).ok_or_else(|| {
        format!(
            "no socket of the keeper in {} serves GPU {} (it sees the job's \
             CUDA_VISIBLE_DEVICES)",
            dir.display(),
            uuid_hex(uuid)
        )
    })
}

/// Where the stage of device `device`'s image copies from: the keeper socket of the job's old
/// GPU (UUID `old`; else `keeper-<device>.sock`), if `possum.json` recorded the epoch its
/// memory was kept under (`epoch`); the keeper there copies only what it still holds of it.
fn peer_of(dir: &Path, old: &[u8; 16], device: usize, epoch: Option<u64>) -> Option<PeerSource> {
    let epoch = epoch?;
    let socket = possum_keeper::keeper_for_device(dir, &uuid_hex(old))
        .unwrap_or_else(|| possum_keeper::socket_of(dir, device));
    Some(PeerSource {
        socket: socket.display().to_string(),
        epoch,
    })
}

fn stage_one(
    socket: Result<PathBuf, String>,
    from: Option<PeerSource>,
    base: Option<u64>,
    pending: Vec<PendingPiece>,
    (pid, device): (i32, usize),
    image: PathBuf,
) -> StageReport {
    let t = Instant::now();
    let ask = |base| {
        socket.clone().and_then(|s| {
            possum_keeper::Keeper::connect(&s)
                .and_then(|mut k| {
                    k.stage(pid, &image, HOLD_SECS, from.clone(), base, pending.clone())
                })
                .map_err(|e| e.to_string())
        })
    };
    // A prestage gone (its keeper ended since) is no reason not to stage.
    let (r, base, base_error) = match ask(base) {
        Err(e) if base.is_some() => (ask(None), None, Some(e)),
        r => (r, base, None),
    };
    let mut rep = StageReport {
        pid,
        device,
        image,
        socket: socket.ok(),
        from: from.map(|f| f.socket),
        peer_buffers: 0,
        peer_misses: Vec::new(),
        stage: None,
        buffers: 0,
        bytes: 0,
        base,
        base_error,
        reused_bytes: 0,
        request_ms: t.elapsed().as_secs_f64() * 1e3,
        error: None,
        unused: false,
    };
    match r {
        Ok(info) => {
            rep.stage = Some(info.stage);
            rep.buffers = info.buffers;
            rep.bytes = info.bytes;
            rep.peer_buffers = info.peer;
            rep.peer_misses = info.peer_misses;
            rep.reused_bytes = info.reused_bytes;
        }
        Err(e) => rep.error = Some(e),
    }
    rep
}
