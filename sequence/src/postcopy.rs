//! A migration's post-copy: the job runs at the destination before the pieces of its GPU images
//! that it wrote after the last pre-copy round have come.
//!
//! At the source, the final set's changed pieces of the GPU images are left for later
//! ([`crate::wire::DirSender::post_copy`]) and sent once the destination named the image, in the order
//! the job needs its buffers (`later_order`: the prefetch rank of the first buffer each piece
//! holds a chunk of), while the hand-off goes on. At the destination, [`PostCopy`] keeps which
//! have come: the restore's stage of each GPU image is told which pieces are still to come
//! (the keeper loads a buffer only once the pieces its chunks lie in came) and then each piece
//! as it comes. A GPU image that could not be staged is restored only once every piece came.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use possum_engine::image::Image as EngineImage;
use possum_engine::store::ChunkSource;
use possum_keeper::PendingPiece;

use crate::wire::LaterPiece;

/// The GPU images of the image at `dir` (a checkpoint's, committed), as directories relative to
/// it, `/`-separated: what a migration leaves for post-copy.
pub(crate) fn gpu_image_dirs(dir: &Path) -> Vec<String> {
    let Ok(img) = crate::image::open_image(dir) else {
        return Vec::new();
    };
    (img.gpu_images().into_iter())
        .filter_map(|(_, _, path)| relative(dir, &path))
        .collect()
}

/// `path` relative to `dir`, `/`-separated, if it is under it and UTF-8.
pub(crate) fn relative(dir: &Path, path: &Path) -> Option<String> {
    let rel = path.strip_prefix(dir).ok()?;
    let parts: Option<Vec<&str>> = rel.components().map(|c| c.as_os_str().to_str()).collect();
    Some(parts?.join("/"))
}

/// The order to send `pieces` (of the image at `dir`, whose GPU images are `gpu_dirs`) in: by
/// the prefetch rank of the first-needed buffer one of whose chunks lies in each, then by path
/// and offset; a piece no chunk lies in last.
pub(crate) fn later_order(dir: &Path, gpu_dirs: &[String], pieces: &[LaterPiece]) -> Vec<usize> {
    // Per data file (its path relative to `dir`): the chunks' ranges in it and their ranks.
    let mut ranges: HashMap<String, Vec<(u64, u64, u32)>> = HashMap::new();
    for g in gpu_dirs {
        let Ok(img) = EngineImage::open(&dir.join(g)) else {
            continue;
        };
        for b in img.buffers() {
            for (offset, len) in img.chunks(b.id) {
                if let Some((file, at)) = img.chunk_location(b.id, offset) {
                    let path = format!("{g}/{file}");
                    ranges
                        .entry(path)
                        .or_default()
                        .push((at, len, b.prefetch_rank));
                }
            }
        }
    }
    let rank = |p: &LaterPiece| {
        (ranges.get(&p.path).into_iter().flatten())
            .filter(|(at, len, _)| *at < p.offset + p.len && p.offset < at + len)
            .map(|(_, _, r)| *r)
            .min()
            .unwrap_or(u32::MAX)
    };
    let mut order: Vec<(u32, usize)> = pieces
        .iter()
        .enumerate()
        .map(|(i, p)| (rank(p), i))
        .collect();
    order.sort();
    order.into_iter().map(|(_, i)| i).collect()
}

/// Which of a migration's post-copy pieces have come to the destination, and the stages told.
#[derive(Debug)]
pub struct PostCopy {
    pieces: Vec<LaterPiece>,
    /// Each piece's number, by its file's path and its offset.
    index: HashMap<(String, u64), usize>,
    state: Mutex<State>,
    cv: Condvar,
    /// Connections to the stages' keepers, by stage (its place in `State::stages`): used by
    /// whoever flushes `State::outbox`, one at a time.
    keepers: Mutex<HashMap<usize, possum_keeper::Keeper>>,
}

/// What [`PostCopy::wait_watching`] saw of the pieces coming.
#[derive(Debug, Default)]
pub struct Watch {
    came: usize,
    since: Option<Instant>,
}

#[derive(Debug, Default)]
struct State {
    arrived: Vec<bool>,
    /// How many have arrived.
    came: usize,
    /// The stages waiting for pieces: the GPU image's directory (relative, `/`-separated), its
    /// keeper socket and the stage.
    stages: Vec<Told>,
    /// Pieces come that their stages are not told of yet: (the stage's place, the piece).
    outbox: Vec<(usize, PendingPiece)>,
    /// Someone tells the stages now (the others leave their pieces in `outbox` to them).
    flushing: bool,
    /// The receive's end: `Ok` once every piece came, or why it failed.
    end: Option<Result<(), String>>,
}

#[derive(Debug)]
struct Told {
    image: String,
    socket: PathBuf,
    stage: u64,
}

impl PostCopy {
    /// The pieces to come, none yet come.
    pub fn new(pieces: Vec<LaterPiece>) -> PostCopy {
        let state = State {
            arrived: vec![false; pieces.len()],
            ..State::default()
        };
        let index = (pieces.iter().enumerate())
            .map(|(i, p)| ((p.path.clone(), p.offset), i))
            .collect();
        PostCopy {
            pieces,
            index,
            state: Mutex::new(state),
            cv: Condvar::new(),
            keepers: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The pieces to come.
    pub fn pieces(&self) -> &[LaterPiece] {
        &self.pieces
    }

    /// The pieces of the GPU image in `image` (relative, `/`-separated) still to come, as its
    /// stage names them (relative to the image).
    pub(crate) fn pending_in(&self, image: &str) -> Vec<PendingPiece> {
        let s = self.lock();
        (self.pieces.iter().zip(&s.arrived))
            .filter(|(_, came)| !**came)
            .filter_map(|(p, _)| in_image(image, p))
            .collect()
    }

    /// Stage `stage` at the keeper socket `socket` loads the GPU image in `image`: it is told
    /// of each piece of it that comes from now on, and now of those that came since
    /// [`PostCopy::pending_in`] was asked.
    pub(crate) fn told_by(&self, image: &str, socket: &Path, stage: u64) {
        let mut s = self.lock();
        let at = s.stages.len();
        let came: Vec<(usize, PendingPiece)> = (self.pieces.iter().zip(&s.arrived))
            .filter(|(_, came)| **came)
            .filter_map(|(p, _)| in_image(image, p))
            .map(|p| (at, p))
            .collect();
        s.stages.push(Told {
            image: image.to_string(),
            socket: socket.to_path_buf(),
            stage,
        });
        s.outbox.extend(came);
        self.flush(s);
    }

    /// Piece `i` came (written where it goes): the stage of its GPU image is told.
    pub fn arrived(&self, i: usize) {
        let mut s = self.lock();
        let Some(slot) = s.arrived.get_mut(i) else {
            return;
        };
        if std::mem::replace(slot, true) {
            return;
        }
        s.came += 1;
        self.cv.notify_all();
        let p = &self.pieces[i];
        let tell: Vec<(usize, PendingPiece)> = (s.stages.iter().enumerate())
            .filter_map(|(at, t)| in_image(&t.image, p).map(|pp| (at, pp)))
            .collect();
        s.outbox.extend(tell);
        self.flush(s);
    }

    /// Tells the stages of the pieces in the outbox, in batches, the lock let go meanwhile
    /// (the pieces' receive goes on); unless someone does already, who then tells them of
    /// these too. Best effort: a keeper that cannot be told leaves its buffers waiting, and
    /// the job's own restore copies them from the image once it is whole.
    fn flush<'a>(&'a self, mut s: MutexGuard<'a, State>) {
        if s.flushing {
            return;
        }
        s.flushing = true;
        loop {
            let batch = std::mem::take(&mut s.outbox);
            if batch.is_empty() {
                s.flushing = false;
                return;
            }
            let stages: Vec<(PathBuf, u64)> = (s.stages.iter())
                .map(|t| (t.socket.clone(), t.stage))
                .collect();
            drop(s);
            let mut by_stage: HashMap<usize, Vec<PendingPiece>> = HashMap::new();
            for (at, p) in batch {
                by_stage.entry(at).or_default().push(p);
            }
            let mut keepers = self.keepers.lock().unwrap_or_else(PoisonError::into_inner);
            for (at, pieces) in by_stage {
                let (socket, stage) = &stages[at];
                if let std::collections::hash_map::Entry::Vacant(e) = keepers.entry(at) {
                    match possum_keeper::Keeper::connect(socket) {
                        Ok(k) => {
                            e.insert(k);
                        }
                        Err(_) => continue,
                    }
                }
                let told = keepers
                    .get_mut(&at)
                    .map(|k| k.stage_arrived(*stage, &pieces));
                if matches!(told, Some(Err(_))) {
                    keepers.remove(&at);
                }
            }
            drop(keepers);
            s = self.lock();
        }
    }

    /// The receive of the pieces ended: `Ok` once every piece came, or why not.
    pub fn ended(&self, r: Result<(), String>) {
        self.lock().end = Some(r);
        self.cv.notify_all();
    }

    /// Waits until the receive of the pieces ended: `Ok` once every piece came.
    pub fn wait(&self) -> Result<(), String> {
        let mut s = self.lock();
        loop {
            if let Some(r) = &s.end {
                return r.clone();
            }
            s = self.cv.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// [`PostCopy::wait`] for at most `slice`: `None` if the receive has not ended by then.
    /// Once no piece came for `lease` (as `watch` saw them come, from its first call), the
    /// receive is taken as failed: that is the answer.
    pub fn wait_watching(
        &self,
        lease: Duration,
        slice: Duration,
        watch: &mut Watch,
    ) -> Option<Result<(), String>> {
        let end = Instant::now() + slice;
        let mut s = self.lock();
        loop {
            if let Some(r) = &s.end {
                return Some(r.clone());
            }
            if watch.since.is_none() || s.came != watch.came {
                (watch.came, watch.since) = (s.came, Some(Instant::now()));
            }
            let since = watch.since.unwrap_or_else(Instant::now);
            if since.elapsed() >= lease {
                let why = format!("no piece came for {} s", lease.as_secs());
                s.end = Some(Err(why.clone()));
                self.cv.notify_all();
                return Some(Err(why));
            }
            let now = Instant::now();
            if now >= end {
                return None;
            }
            let left = (end - now).min(lease.saturating_sub(since.elapsed()));
            s = (self.cv.wait_timeout(s, left))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// The stages told of the pieces: each GPU image's directory, keeper socket and stage.
    pub(crate) fn stages(&self) -> Vec<(String, PathBuf, u64)> {
        (self.lock().stages.iter())
            .map(|t| (t.image.clone(), t.socket.clone(), t.stage))
            .collect()
    }

    /// The number of the piece the stage of the GPU image in `image` names `p`, if one is.
    pub(crate) fn index_of(&self, image: &str, p: &PendingPiece) -> Option<usize> {
        let &i = self.index.get(&(format!("{image}/{}", p.file), p.offset))?;
        (self.pieces[i].len == p.len).then_some(i)
    }

    /// Why the receive of the pieces failed, if it did.
    pub fn failed(&self) -> Option<String> {
        match &self.lock().end {
            Some(Err(why)) => Some(why.clone()),
            _ => None,
        }
    }
}

/// `p` as the stage of the GPU image in `image` names it, if it is a piece of that image.
fn in_image(image: &str, p: &LaterPiece) -> Option<PendingPiece> {
    let file = p.path.strip_prefix(image)?.strip_prefix('/')?;
    Some(PendingPiece {
        file: file.to_string(),
        offset: p.offset,
        len: p.len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(path: &str, offset: u64) -> LaterPiece {
        LaterPiece {
            path: path.into(),
            offset,
            len: 4,
            hash: [0; 32],
        }
    }

    #[test]
    fn a_piece_is_of_the_image_whose_directory_holds_it() {
        let p = piece("gpu/gpu-0/data-1", 8);
        assert_eq!(in_image("gpu/gpu-0", &p).unwrap().file, "data-1");
        assert!(in_image("gpu/gpu-1", &p).is_none());
        assert!(in_image("gpu/gpu-", &p).is_none());
    }

    #[test]
    fn pending_pieces_are_those_not_come() {
        let pc = PostCopy::new(vec![
            piece("g/gpu-0/d", 0),
            piece("g/gpu-0/d", 4),
            piece("x/y", 0),
        ]);
        pc.arrived(1);
        let left = pc.pending_in("g/gpu-0");
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].offset, 0);
        assert!(pc.failed().is_none());
        let mut w = Watch::default();
        let slice = Duration::from_millis(1);
        assert_eq!(
            pc.wait_watching(Duration::from_secs(60), slice, &mut w),
            None
        );
        let (i, p) = (pc.index_of("g/gpu-0", &left[0]), &pc.pieces()[0]);
        assert_eq!((i, p.offset), (Some(0), 0));
        pc.ended(Err("cut".into()));
        assert_eq!(pc.wait(), Err("cut".to_string()));
        assert!(pc.wait_watching(Duration::ZERO, slice, &mut w).is_some());
    }
}
