//! A migration's destination loading the job's GPU images before they are whole: once the
//! first part of the first pre-copy round sent ahead is received (the job still running at the
//! source), the keeper that serves the job's GPU there is asked to `prestage` each image by its
//! draft manifest (the chunks the round wrote, `draft.pb`), so that the memory is loaded while
//! the rest of the round, the source's later rounds, its hold and its final send go on. The
//! round comes in parts, each the next slice of every data file
//! (`wire::DirSender::slice_first_round`): the prestage is told how much of each file is
//! there (`present`), and after each part how far the files have come (`stage_grown`); the
//! keeper loads each chunk once its bytes are there. The restore's stage of the finished
//! image then builds on it (`base`): each buffer keeps that memory, and only the chunks that
//! differ between the draft and the image (by length, CRC32C and fingerprint) are loaded. A
//! chunk the draft has without a fingerprint, one the prestage had not loaded when the stage
//! took it, a prestage that failed or was not made: loaded from the image as without it. With
//! `POSSUM_MIGRATE_LOAD_REWRITTEN=1` the keeper is also told, after each part, which bytes of
//! the data files it brought again (`stage_rewritten`), and loads those chunks again as they
//! come.
//!
//! The source writes what the destination needs to find that keeper before the image has a
//! `possum.json` ([`AHEAD_FILE`]: the job's keeper directory and GPUs, as `possum.json` will
//! say them), in the checkpoint's directory before its pre-copy; it is sent ahead with it.
//! Only a keeper already serving the GPU is asked (none is started for it: a keeper started
//! before CRIU's restore must not take a PID of the job's tree, which only the finished image
//! says); without one, the restore stages the image as it always does.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::image::{GpuUse, KeeperOfJob};

/// The file in a migration's checkpoint directory that says where its GPU images can be loaded
/// ahead.
pub(crate) const AHEAD_FILE: &str = "possum-ahead.json";

/// How long a prestage's memory is kept if no stage takes it and nobody ends it.
const HOLD_SECS: u64 = 120;

/// [`AHEAD_FILE`]'s content.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct AheadHint {
    /// The job's keeper (its socket directory), as `possum.json`'s `keeper`.
    pub keeper: Option<KeeperOfJob>,
    /// The GPUs it uses, as `possum.json`'s `gpu_memory`.
    pub gpu_memory: Vec<GpuUse>,
}

/// Writes [`AHEAD_FILE`] into the checkpoint's temporary directory `tmp`; one that cannot be
/// written is said to `obs` (the destination then loads the images once they are whole).
pub(crate) fn write_hint(tmp: &Path, hint: &AheadHint, obs: &mut dyn crate::Observer) {
    let written = serde_json::to_vec(hint)
        .map_err(io::Error::other)
        .and_then(|text| fs::write(tmp.join(AHEAD_FILE), text));
    if let Err(e) = written {
        obs.note(&format!(
            "the destination loads the GPU images once they are whole ({AHEAD_FILE}: {e})"
        ));
    }
}

/// One GPU image loaded ahead, as `possum receive --json` reports it.
#[derive(Debug, Clone, Serialize)]
pub struct Prestaged {
    /// The image, relative to the checkpoint directory (`gpu/gpu-0`).
    pub image: PathBuf,
    /// The keeper socket asked.
    pub socket: PathBuf,
    /// The keeper's prestage id.
    pub stage: Option<u64>,
    /// Buffers, and their bytes, it loads.
    pub buffers: u64,
    pub bytes: u64,
    /// How long the keeper took to take the request (its memory made); the loads go on after.
    pub request_ms: f64,
    /// Pieces of its data files ([`possum_keeper::ARRIVING_PIECE`] bytes each) that were not
    /// there yet when it was made: the first round arrives in parts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arriving: Option<u64>,
    /// Of them, those it still waited for when last told how far the files came (0 once all
    /// came).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pending: Option<u64>,
    /// Why it was not made.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Its chunks named written again, to be loaded again (counted once each time named), as
    /// the parts sent ahead after it brought their bytes anew (unless
    /// `POSSUM_MIGRATE_LOAD_REWRITTEN=0`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rewritten: Option<u64>,
    /// The stage ahead of the whole image built on it, once the final set brought the image
    /// (unless `POSSUM_MIGRATE_STAGE_AHEAD=0`): `stage` names it from then on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ahead: Option<StagedAhead>,
}

/// A stage ahead of a whole image ([`Prestaged::ahead`]).
#[derive(Debug, Clone, Serialize)]
pub struct StagedAhead {
    /// The prestage it was built on.
    pub prestage: u64,
    /// Bytes it took from that prestage's memory.
    pub reused_bytes: u64,
    /// How long the keeper took to take the request.
    pub request_ms: f64,
    /// Why it was not made (the restore then stages the image without a base).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The loads ahead of one migration's destination: begun once, at the first part sent ahead
/// that holds drafts, then told how far the images' data files came at each part after.
#[derive(Default)]
pub(crate) struct Prestages {
    begun: bool,
    /// The unfinished image directories loaded ahead ...
    images: Vec<PathBuf>,
    /// ... and the finished images' paths, relative to the received directory.
    finished: Vec<PathBuf>,
    /// Whether each keeper is told what the parts after the first brought
    /// ([`Prestages::told_rewritten`]) ...
    rewrites: bool,
    /// ... and each image's data files' lengths as last told.
    told: Vec<Lengths>,
    /// To the thread: each image's data files' lengths, at each part whole; then the final
    /// set's directory, once it holds them finished.
    grown: Option<mpsc::Sender<Told>>,
    thread: Option<JoinHandle<Vec<Prestaged>>>,
    /// Whether the images are staged ahead once finished ([`Prestages::staging_ahead`]) ...
    stage_ahead: bool,
    /// ... and whether the thread was asked to.
    staged_ahead: bool,
}

/// What the thread is told.
enum Told {
    /// Each image's data files' lengths, a part sent ahead whole ...
    Grown(Vec<Lengths>),
    /// ... and what the part brought of them, per image.
    Rewritten(Vec<Vec<possum_keeper::PendingPiece>>),
    /// How far the loads came: the bytes loaded and those still loading, summed over the
    /// prestages ([`Prestages::loaded`]).
    Progress(mpsc::SyncSender<(u64, u64)>),
    /// The received directory, now holding the images finished: each staged ahead, then the
    /// sender told (the directory is renamed once the transfer is over: the keepers must have
    /// opened the images by then).
    Finished(PathBuf, mpsc::SyncSender<()>),
}

/// How long a part of the final set waits for the keepers to take the stages ahead of the
/// images it finished (the transfer's rename waits with it; a stage ahead not taken by then
/// may fail, and the restore stages those images without a base).
const STAGED_AHEAD_WAIT: Duration = Duration::from_secs(20);

/// How long [`Prestages::loaded`] waits for the keepers' answer.
const PROGRESS_WAIT: Duration = Duration::from_secs(2);

/// The lengths of the files of an unfinished image directory, by name.
type Lengths = BTreeMap<String, u64>;

/// The name of the file `path` if it lies directly in `dir` (both relative to one directory).
fn file_in<'a>(dir: &Path, path: &'a str) -> Option<&'a str> {
    let p = Path::new(path);
    (p.parent() == Some(dir)).then(|| p.file_name()?.to_str())?
}

/// The lengths of the regular files directly in `dir`: a GPU image's data files (and its draft)
/// as they have come. The first round sent ahead comes in parts, each file's bytes from its
/// start ([`crate::wire::DirSender::slice_first_round`]): read when a part is whole, a file's
/// length is what of it came.
fn lengths(dir: &Path) -> Lengths {
    let Ok(entries) = fs::read_dir(dir) else {
        return Lengths::new();
    };
    (entries.flatten())
        .filter_map(|e| {
            let m = e.metadata().ok().filter(fs::Metadata::is_file)?;
            Some((e.file_name().into_string().ok()?, m.len()))
        })
        .collect()
}

impl Prestages {
    /// Loads ahead that, with `ahead`, stage each image ahead once the final set brought it
    /// finished (unless `POSSUM_MIGRATE_STAGE_AHEAD=0`): the keeper's `stage` of the whole image,
    /// built on its prestage, while the source's CRIU still dumps; the restore's stage then
    /// builds on that.
    pub(crate) fn staging_ahead(ahead: bool) -> Prestages {
        Prestages {
            stage_ahead: ahead,
            ..Prestages::default()
        }
    }

    /// Loads ahead whose keepers are told (`on`) the byte ranges of the images' data files that
    /// each part after the first brought: the keeper loads the chunks written again as they
    /// come (`possum_keeper::Keeper::stage_rewritten`).
    pub(crate) fn told_rewritten(mut self, on: bool) -> Prestages {
        self.rewrites = on;
        self
    }

    /// What `brought` (a part's, under the received directory) brought of each image's data
    /// files (those under `rel_dirs`, one per image), as its keeper names them; with `below`
    /// (each image's data files' lengths before the part), only the ranges that begin below
    /// their file's length: bytes written again, not the first of a file still arriving.
    /// `None` if nothing.
    fn rewritten(
        rel_dirs: &[PathBuf],
        brought: &crate::wire::Brought,
        below: Option<&[Lengths]>,
    ) -> Option<Vec<Vec<possum_keeper::PendingPiece>>> {
        let mut any = false;
        let per_image = (rel_dirs.iter().enumerate())
            .map(|(k, dir)| {
                let mut pieces = Vec::new();
                for (path, ranges) in brought {
                    let Some(name) = file_in(dir, path) else {
                        continue;
                    };
                    let had = below.map(|b| b.get(k).and_then(|l| l.get(name)).map_or(0, |&n| n));
                    let again = (ranges.iter()).filter(|&&(at, _)| had.is_none_or(|had| at < had));
                    pieces.extend(again.map(|&(offset, len)| possum_keeper::PendingPiece {
                        file: name.to_string(),
                        offset,
                        len,
                    }));
                }
                any |= !pieces.is_empty();
                pieces
            })
            .collect();
        any.then_some(per_image)
    }

    /// Tells the thread `told`; a thread gone is told nothing more.
    fn tell(&mut self, told: Told) {
        if let Some(tx) = &self.grown {
            if tx.send(told).is_err() {
                self.grown = None;
            }
        }
    }

    /// A part of the final set is whole in `dir`: once it holds every image loaded ahead
    /// finished (its manifest there), each is staged ahead, where that was asked, once; until
    /// then, what it brought of them is told.
    fn final_part(&mut self, dir: &Path, brought: &crate::wire::Brought) {
        if self.grown.is_none() || !self.stage_ahead || self.staged_ahead {
            return;
        }
        let manifest = possum_engine::image::MANIFEST_FILE;
        if !(self.finished.iter()).all(|rel| dir.join(rel).join(manifest).is_file()) {
            let again = (self.rewrites).then(|| Self::rewritten(&self.finished, brought, None));
            if let Some(pieces) = again.flatten() {
                self.tell(Told::Rewritten(pieces));
            }
            return;
        }
        self.staged_ahead = true;
        let (done, staged) = mpsc::sync_channel(1);
        self.tell(Told::Finished(dir.to_path_buf(), done));
        let _ = staged.recv_timeout(STAGED_AHEAD_WAIT);
    }

    /// Called with the directory what is sent ahead is received in, each time a part of it is
    /// whole: the first time it holds [`AHEAD_FILE`] and GPU images with drafts, asks the keeper
    /// serving each image's GPU to load it, on a thread of its own.
    /// Each later time, tells each keeper how far its image's data files have come (the
    /// lengths read now: the next part resizes them before its bytes come), and what the part
    /// brought of them.
    pub(crate) fn part_received(
        &mut self,
        ahead: &Path,
        part: crate::wire::Part,
        brought: &crate::wire::Brought,
    ) {
        if part == crate::wire::Part::Final {
            return self.final_part(ahead, brought);
        }
        if self.begun {
            // What it brought below where each file ended before it was written again; told
            // before the lengths, so that no chunk is loaded as it was before it is named.
            let told = Some(self.told.as_slice());
            let unfinished: Vec<PathBuf> = (self.images.iter())
                .map(|abs| abs.strip_prefix(ahead).unwrap_or(abs).to_path_buf())
                .collect();
            let again = (self.rewrites).then(|| Self::rewritten(&unfinished, brought, told));
            if let Some(pieces) = again.flatten() {
                self.tell(Told::Rewritten(pieces));
            }
            self.told = self.images.iter().map(|d| lengths(d)).collect();
            self.tell(Told::Grown(self.told.clone()));
            return;
        }
        let Ok(text) = fs::read(ahead.join(AHEAD_FILE)) else {
            return;
        };
        let drafts = drafts(ahead);
        if drafts.is_empty() {
            return;
        }
        self.begun = true;
        let hint: AheadHint = match serde_json::from_slice(&text) {
            Ok(h) => h,
            Err(_) => return,
        };
        // Where a restore would look for a keeper only (docs/image-format.md).
        let places = crate::places::Places::of_environment(None);
        let Some(keeper) = hint
            .keeper
            .filter(|k| places.check_dir("the keeper's directory", &k.dir).is_ok())
        else {
            return;
        };
        let gpus = hint.gpu_memory;
        self.images = drafts.iter().map(|(_, abs, _)| abs.clone()).collect();
        self.finished = drafts.iter().map(|(rel, _, _)| rel.clone()).collect();
        let present: Vec<Lengths> = self.images.iter().map(|d| lengths(d)).collect();
        self.told = present.clone();
        let (tx, rx) = mpsc::channel::<Told>();
        self.grown = Some(tx);
        self.thread = std::thread::Builder::new()
            .name("possum-prestage".into())
            .spawn(move || {
                // Per image: none without a keeper there; else the prestage, with the keeper
                // while it takes the files' lengths.
                let mut made: Vec<Option<(Option<possum_keeper::Keeper>, Prestaged)>> =
                    (drafts.into_iter().zip(present))
                        .map(|((rel, abs, device), present)| {
                            let socket = crate::image::keeper_socket(&gpus, &keeper.dir, device);
                            // Only a keeper already there.
                            let mut k = possum_keeper::Keeper::connect(&socket).ok()?;
                            let p = prestage_one(&mut k, socket, rel, &abs, present);
                            Some((p.stage.is_some().then_some(k), p))
                        })
                        .collect();
                // Until the transfer is over: each part's lengths to each keeper; the images
                // finished, staged ahead.
                for told in rx {
                    let parts = match told {
                        Told::Grown(parts) => parts,
                        Told::Rewritten(pieces) => {
                            (made.iter_mut().zip(pieces))
                                .for_each(|(m, pieces)| tell_rewritten(m, pieces));
                            continue;
                        }
                        Told::Finished(dir, done) => {
                            made.iter_mut().flatten().for_each(|m| stage_ahead(m, &dir));
                            let _ = done.send(());
                            continue;
                        }
                        Told::Progress(answer) => {
                            let _ = answer.send(progress(&mut made));
                            continue;
                        }
                    };
                    for (made, files) in made.iter_mut().zip(parts) {
                        let Some((keeper, p)) = made else {
                            continue;
                        };
                        let (Some(k), Some(stage)) = (keeper.as_mut(), p.stage) else {
                            continue;
                        };
                        match k.stage_grown(stage, files) {
                            Ok(left) => p.pending = Some(left),
                            // That keeper is not told again; its stage loads what it was told.
                            Err(_) => *keeper = None,
                        }
                    }
                }
                made.into_iter().flatten().map(|(_, p)| p).collect()
            })
            .ok();
    }

    /// How far the loads ahead came, as their keepers say: the bytes loaded into GPU memory and
    /// those still loading (0 once every prestage settled). (0, 0) without a prestage, or
    /// if the keepers do not answer within [`PROGRESS_WAIT`].
    pub(crate) fn loaded(&mut self) -> (u64, u64) {
        let (answer, answered) = mpsc::sync_channel(1);
        self.tell(Told::Progress(answer));
        answered.recv_timeout(PROGRESS_WAIT).unwrap_or((0, 0))
    }

    /// The prestages made (waiting for the requests, not for the loads).
    pub(crate) fn finish(&mut self) -> Vec<Prestaged> {
        self.grown = None;
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

/// How far the prestages `made` came (their keepers' `stats`): the bytes of their chunks
/// copied into GPU memory, and those left (none of a prestage settled). A keeper that fails to
/// answer is not asked again.
fn progress(made: &mut [Option<(Option<possum_keeper::Keeper>, Prestaged)>]) -> (u64, u64) {
    let (mut loaded, mut left) = (0, 0);
    for (keeper, p) in made.iter_mut().flatten() {
        let (Some(k), Some(stage)) = (keeper.as_mut(), p.stage) else {
            continue;
        };
        let stats = match k.stats() {
            Ok(s) => s,
            Err(_) => {
                *keeper = None;
                continue;
            }
        };
        if let Some(s) = stats.stages.iter().find(|s| s.stage == stage) {
            loaded += s.chunk_bytes;
            if s.done_ms.is_none() {
                left += s.bytes.saturating_sub(s.chunk_bytes);
            }
        }
    }
    (loaded, left)
}

/// Tells the keeper of prestage `made` (if it was made) that `pieces` of its image's data files
/// were written again; a keeper that fails to answer is not told again.
fn tell_rewritten(
    made: &mut Option<(Option<possum_keeper::Keeper>, Prestaged)>,
    pieces: Vec<possum_keeper::PendingPiece>,
) {
    let Some((keeper, p)) = made else {
        return;
    };
    let (Some(k), Some(stage)) = (keeper.as_mut(), p.stage) else {
        return;
    };
    if pieces.is_empty() || p.ahead.is_some() {
        return;
    }
    match k.stage_rewritten(stage, pieces) {
        Ok(n) => *p.rewritten.get_or_insert(0) += n,
        Err(_) => *keeper = None,
    }
}

/// Stages ahead the finished image of prestage `p` (under the received directory `dir`) on its
/// keeper, built on it; `p` names the stage ahead from then on, or none if it failed (the
/// prestage is gone with it).
fn stage_ahead((keeper, p): &mut (Option<possum_keeper::Keeper>, Prestaged), dir: &Path) {
    let (Some(k), Some(prestage)) = (keeper.as_mut(), p.stage) else {
        return;
    };
    let t = Instant::now();
    let r = k.stage_ahead(&dir.join(&p.image), HOLD_SECS, prestage);
    let mut ahead = StagedAhead {
        prestage,
        reused_bytes: 0,
        request_ms: t.elapsed().as_secs_f64() * 1e3,
        error: None,
    };
    match r {
        Ok(info) => {
            p.stage = Some(info.stage);
            ahead.reused_bytes = info.reused_bytes;
        }
        Err(e) => {
            p.stage = None;
            ahead.error = Some(e.to_string());
        }
    }
    p.ahead = Some(ahead);
}

/// Asks `k` to load the unfinished image at `abs` ahead, its data files `present` so long.
fn prestage_one(
    k: &mut possum_keeper::Keeper,
    socket: PathBuf,
    image: PathBuf,
    abs: &Path,
    present: Lengths,
) -> Prestaged {
    let t = Instant::now();
    let r = k.prestage_arriving(abs, HOLD_SECS, present.clone());
    let mut p = Prestaged {
        image,
        socket,
        stage: None,
        buffers: 0,
        bytes: 0,
        request_ms: t.elapsed().as_secs_f64() * 1e3,
        arriving: None,
        pending: None,
        error: None,
        rewritten: None,
        ahead: None,
    };
    match r {
        Ok(info) => {
            p.stage = Some(info.stage);
            p.buffers = info.buffers;
            p.bytes = info.bytes;
            // What is there now arrives nothing: the pieces it waits for.
            p.arriving = k.stage_grown(info.stage, present).ok();
        }
        Err(e) => p.error = Some(e.to_string()),
    }
    p
}

/// Ends the prestages no stage took (their memory freed); one a stage took is gone already,
/// and the keeper's refusal of it is no matter.
pub(crate) fn end(list: &[Prestaged]) {
    for p in list {
        if let Some(id) = p.stage {
            if let Ok(mut k) = possum_keeper::Keeper::connect(&p.socket) {
                let _ = k.stage_end(id);
            }
        }
    }
}

/// The prestage of the image at `image` (absolute) on keeper socket `socket`, if any.
pub(crate) fn base_for(list: &[Prestaged], dir: &Path, image: &Path, socket: &Path) -> Option<u64> {
    let rel = image.strip_prefix(dir).ok()?;
    list.iter()
        .find(|p| p.image == rel && p.socket == socket)
        .and_then(|p| p.stage)
}

/// What of the directory `ahead` (a checkpoint's, as it is sent ahead) a destination needs to
/// begin loading its GPU images, relative to it: [`AHEAD_FILE`], each unfinished image's draft,
/// and those of their other files (the data files, which the load opens as they arrive) that
/// `sent` says were not sent yet.
pub(crate) fn ahead_files(ahead: &Path, sent: impl Fn(&str) -> bool) -> Vec<String> {
    let mut out: Vec<String> = (ahead.join(AHEAD_FILE).is_file())
        .then(|| AHEAD_FILE.to_string())
        .into_iter()
        .collect();
    let rel = |p: &Path| Some(p.strip_prefix(ahead).ok()?.to_str()?.to_string());
    for (_, abs, _) in drafts(ahead) {
        out.extend(rel(&abs.join(possum_engine::image::DRAFT_FILE)));
        let Ok(entries) = fs::read_dir(&abs) else {
            continue;
        };
        let mut data: Vec<String> = (entries.flatten())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .filter(|e| e.file_name() != possum_engine::image::DRAFT_FILE)
            .filter_map(|e| rel(&e.path()))
            .filter(|f| !sent(f))
            .collect();
        data.sort();
        out.extend(data);
    }
    out
}

/// The unfinished GPU images in `ahead` that have a draft: for the job (`gpu/`) and its other
/// processes (`gpu-PID/`), each device's (`gpu-N`, named when finished), as (the finished
/// image's path relative to the checkpoint, the unfinished directory, the device).
fn drafts(ahead: &Path) -> Vec<(PathBuf, PathBuf, usize)> {
    let mut out = Vec::new();
    let Ok(top) = fs::read_dir(ahead) else {
        return out;
    };
    for proc_dir in top.flatten() {
        let pname = proc_dir.file_name();
        let Some(pname) = pname.to_str() else {
            continue;
        };
        if pname != "gpu" && !pname.strip_prefix("gpu-").is_some_and(all_digits) {
            continue;
        }
        let Ok(images) = fs::read_dir(proc_dir.path()) else {
            continue;
        };
        for img in images.flatten() {
            let iname = img.file_name();
            let Some(final_name) = iname
                .to_str()
                .and_then(possum_engine::image::unfinished_image_name)
            else {
                continue;
            };
            let Some(device) = final_name
                .strip_prefix("gpu-")
                .filter(|d| all_digits(d))
                .and_then(|d| d.parse().ok())
            else {
                continue;
            };
            if img.path().join(possum_engine::image::DRAFT_FILE).is_file() {
                out.push((Path::new(pname).join(final_name), img.path(), device));
            }
        }
    }
    out.sort();
    out
}

fn all_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_part_brought_is_told_per_image_by_file_name() {
        let dirs = [
            PathBuf::from("gpu/.gpu-0.tmp-1"),
            PathBuf::from("gpu-7/.gpu-1.tmp-2"),
        ];
        let mut brought = crate::wire::Brought::new();
        assert!(Prestages::rewritten(&dirs, &brought, None).is_none());
        brought.insert("criu/pages-1.img".into(), vec![(0, 10)]);
        brought.insert("gpu/.gpu-0.tmp-1/sub/data-000.bin".into(), vec![(0, 10)]);
        assert!(
            Prestages::rewritten(&dirs, &brought, None).is_none(),
            "none of theirs"
        );
        brought.insert(
            "gpu/.gpu-0.tmp-1/data-001.bin".into(),
            vec![(8, 4), (64, 2)],
        );
        let told = Prestages::rewritten(&dirs, &brought, None).expect("the first image's");
        let piece = |offset, len| possum_keeper::PendingPiece {
            file: "data-001.bin".into(),
            offset,
            len,
        };
        assert_eq!(told, vec![vec![piece(8, 4), piece(64, 2)], vec![]]);
        // Only what begins below the file's length as last told was written again.
        let lengths = vec![
            Lengths::from([("data-001.bin".to_string(), 64)]),
            Lengths::new(),
        ];
        let again = Prestages::rewritten(&dirs, &brought, Some(&lengths));
        assert_eq!(again, Some(vec![vec![piece(8, 4)], vec![]]));
    }

    /// The part of the final set that finished the images returns only once the thread has
    /// had the keepers take the stages ahead: the transfer renames the received directory
    /// after it, and a keeper given the old name later would find nothing there.
    #[test]
    fn the_final_part_waits_for_the_stages_ahead_to_be_taken() {
        let d = tempfile::tempdir().unwrap();
        let image = d.path().join("gpu/gpu-0");
        fs::create_dir_all(&image).unwrap();
        fs::write(image.join(possum_engine::image::MANIFEST_FILE), b"m").unwrap();
        let (tx, rx) = mpsc::channel::<Told>();
        let taken = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = std::sync::Arc::clone(&taken);
        let thread = std::thread::spawn(move || {
            for told in rx {
                if let Told::Finished(dir, done) = told {
                    // A keeper slow to answer, the directory still there when it does.
                    std::thread::sleep(Duration::from_millis(200));
                    assert!(dir.join("gpu/gpu-0").is_dir());
                    seen.store(true, std::sync::atomic::Ordering::SeqCst);
                    let _ = done.send(());
                }
            }
            Vec::new()
        });
        let mut p = Prestages::staging_ahead(true);
        p.begun = true;
        p.finished = vec![PathBuf::from("gpu/gpu-0")];
        p.grown = Some(tx);
        p.thread = Some(thread);
        p.part_received(
            d.path(),
            crate::wire::Part::Final,
            &crate::wire::Brought::new(),
        );
        assert!(
            taken.load(std::sync::atomic::Ordering::SeqCst),
            "the final part returned before the stages ahead were taken"
        );
        assert!(p.finish().is_empty());
    }

    #[test]
    fn drafts_are_found_under_the_jobs_unfinished_images_only() {
        let d = tempfile::tempdir().unwrap();
        let mk = |p: &str, draft: bool| {
            let at = d.path().join(p);
            fs::create_dir_all(&at).unwrap();
            if draft {
                fs::write(at.join(possum_engine::image::DRAFT_FILE), b"x").unwrap();
            }
        };
        mk("gpu/.gpu-0.tmp-12-abc", true);
        mk("gpu/.gpu-1.tmp-12-abd", false);
        mk("gpu-77/.gpu-2.tmp-13-x", true);
        mk("criu/.gpu-0.tmp-1", true);
        mk("gpu/gpu-3", true);
        mk("gpu/.weights.tmp-1", true);
        let found = drafts(d.path());
        let rels: Vec<(String, usize)> = found
            .iter()
            .map(|(r, _, dev)| (r.display().to_string(), *dev))
            .collect();
        assert_eq!(
            rels,
            vec![
                ("gpu/gpu-0".to_string(), 0),
                ("gpu-77/gpu-2".to_string(), 2)
            ]
        );
        fs::write(d.path().join(AHEAD_FILE), b"{}").unwrap();
        for f in ["data-000.bin", "data-001.bin"] {
            fs::write(d.path().join("gpu/.gpu-0.tmp-12-abc").join(f), b"d").unwrap();
        }
        let sent = |f: &str| f == "gpu/.gpu-0.tmp-12-abc/data-000.bin";
        assert_eq!(
            ahead_files(d.path(), sent),
            vec![
                AHEAD_FILE.to_string(),
                format!("gpu/.gpu-0.tmp-12-abc/{}", possum_engine::image::DRAFT_FILE),
                "gpu/.gpu-0.tmp-12-abc/data-001.bin".to_string(),
                format!(
                    "gpu-77/.gpu-2.tmp-13-x/{}",
                    possum_engine::image::DRAFT_FILE
                ),
            ]
        );
        let list = vec![Prestaged {
            image: "gpu/gpu-0".into(),
            socket: "/k/keeper-0.sock".into(),
            stage: Some(9),
            buffers: 1,
            bytes: 1,
            request_ms: 0.0,
            arriving: None,
            pending: None,
            error: None,
            rewritten: None,
            ahead: None,
        }];
        let dir = Path::new("/imgs/job");
        let sock = Path::new("/k/keeper-0.sock");
        assert_eq!(base_for(&list, dir, &dir.join("gpu/gpu-0"), sock), Some(9));
        assert_eq!(base_for(&list, dir, &dir.join("gpu/gpu-1"), sock), None);
        let other = Path::new("/k/keeper-1.sock");
        assert_eq!(base_for(&list, dir, &dir.join("gpu/gpu-0"), other), None);
    }
}
