//! Staging a restore: the keeper loads a job's image into new GPU memory while
//! CRIU restores the job's process, so that the restored job maps its buffers at once and waits
//! only for those still loading.
//!
//! `stage` (from `possum restore`, before CRIU runs) opens the image, creates one allocation per
//! buffer for the job's pid, retained with a new epoch and held `hold_secs` (the process does not
//! exist yet), and starts loader threads that fill them in the image's prefetch order: each maps
//! an allocation in a reservation of the keeper's own, reads the buffer's chunks (their checksums
//! checked) into pinned buffers and copies them to the device, a few in flight per thread. The
//! restored job asks `staged` for its image's plan (buffer -> allocation), takes each allocation
//! back with `reclaim` like memory a checkpoint kept, and `stage_wait`s for an allocation before
//! anything touches it: a waited-for buffer is loaded next. `stage_end` (the job's restore is
//! over, or `possum restore` gave up) stops the loaders and frees what nobody took back.
//!
//! A stage `from` another device's keeper (`possum restore --device` of a job killed with its
//! memory kept on its old GPU) has that memory of a buffer imported here: the loader copies it
//! device to device (one copy, read over the interconnect from the other GPU) instead of
//! reading the image; a buffer it has no memory of, or whose copy fails, is read from the image.
//!
//! A stage may start before all of its image's bytes are there (a migration's post-copy): its
//! `pending` pieces name byte ranges of the data files still to come ([`crate::pending`]). A
//! chunk to load that overlaps one is blocked until `stage_arrived` says every piece it overlaps
//! is in its file: a loader starts a buffer once its first chunk to load is not blocked, and
//! reads each later chunk once it is not (the bytes are loaded as they come, not once the whole
//! buffer came); while the buffers left are blocked, the loaders wait rather than exit. A
//! `stage_wait` for a blocked buffer makes the pieces it needs wanted, and `stage_demands` (a
//! long poll, for whoever sends the files) hands each of them out once.
//!
//! A buffer that fails to load (a checksum mismatch, a read error, its memory freed) is reported
//! failed to whoever waits; the job then copies it from the image itself. A keeper that dies
//! mid-load loses nothing either: the job holds the memory it mapped and copies what it was not
//! told is loaded.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use possum_control::EnvConfig;
use possum_cuda::share::{ShareDevice, SharedMem};
use possum_cuda::{CudaPending, PinnedBuf};
use possum_engine::device::{DeviceError, HostBuffer, Transfer};
use possum_engine::image::{ChunkPlace, Image, ImageError};
use possum_engine::store::ChunkSource;
use thiserror::Error;

use crate::pending::{self, Pending, Span};
use crate::{PendingPiece, StageStats, StagedBuffer};

/// Copies one loader keeps in flight.
const DEPTH: usize = 3;
/// The pinned buffers' size (an image's chunks are at most this in practice: the engine writes
/// 8 MiB chunks; a larger one gets a buffer of its own).
const PINNED: usize = 8 << 20;

/// Why the keeper's memory for a load could not be had ([`Memory`]).
#[derive(Debug, Error)]
pub(crate) enum MemoryError {
    /// The keeper's device did not open.
    #[error(transparent)]
    Device(#[from] crate::KeeperError),
    /// The buffer's allocation is gone.
    #[error("its memory (allocation {0}) was freed")]
    Freed(u64),
    /// The allocation could not be mapped.
    #[error(transparent)]
    Map(#[from] DeviceError),
}

/// Why one buffer of a stage did not load (said to whoever waits for it).
#[derive(Debug, Error)]
pub(crate) enum LoadError {
    /// The test knob `POSSUM_KEEPER_STAGE_FAIL` asked for it.
    #[error("failed on purpose (POSSUM_KEEPER_STAGE_FAIL)")]
    OnPurpose,
    /// The loader has no stream (its device did not open, or refused one).
    #[error("no stream to load with: {0}")]
    NoStream(String),
    /// The loader panicked.
    #[error("the keeper's loader panicked")]
    Panicked,
    /// The stage was ended first.
    #[error("the stage was ended before it was loaded")]
    Ended,
    /// The stage was ended while it loaded.
    #[error("the stage was ended while it was loading")]
    EndedWhileLoading,
    /// The buffer's memory could not be had.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// No reservation to map its memory in.
    #[error(transparent)]
    Reserve(DeviceError),
    /// Its copy from another device's memory failed.
    #[error("buffer {buf} from the other GPU: {source}")]
    Peer {
        /// The buffer.
        buf: u64,
        /// The device's answer.
        source: DeviceError,
    },
    /// Its chunks could not be read or copied.
    #[error("buffer {buf}: {source}")]
    Chunks {
        /// The buffer.
        buf: u64,
        /// What failed.
        source: ChunkError,
    },
}

/// Why a chunk of a buffer did not reach the device.
#[derive(Debug, Error)]
pub(crate) enum ChunkError {
    /// A chunk longer than the host's address space.
    #[error("chunk at {0} too large")]
    TooLarge(u64),
    /// Reading it from the image failed (its checksum included).
    #[error(transparent)]
    Read(#[from] ImageError),
    /// No pinned buffer, a copy refused, or one that failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The stage was ended.
    #[error("the stage was ended")]
    Ended,
}

/// What a stage takes from the prestage it builds on ([`Stage::reusing`]), per buffer in the
/// stage's order: the offsets of the chunks already in its memory, and whether that is all of
/// them; and those chunks' bytes.
#[derive(Debug, Default)]
pub(crate) struct Reuse {
    pub(crate) skip: Vec<HashSet<u64>>,
    pub(crate) whole: Vec<bool>,
    pub(crate) bytes: u64,
}

/// Why a wait for a staged allocation failed.
#[derive(Debug, Error)]
pub(crate) enum WaitError {
    /// The allocation is not one of the stage's.
    #[error("allocation {alloc} is not of stage {stage}")]
    NotOfStage {
        /// The allocation asked for.
        alloc: u64,
        /// The stage.
        stage: u64,
    },
    /// It failed to load (why, as [`LoadError`] said it).
    #[error("{0}")]
    Failed(String),
}

/// One buffer's load.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Status {
    Waiting,
    Loading,
    Ready,
    Failed(String),
}

#[derive(Debug)]
struct Progress {
    status: Vec<Status>,
    /// The next buffer in prefetch order that may be waiting.
    next: usize,
    /// Buffers a job waits for, loaded before the rest.
    urgent: VecDeque<usize>,
    loaded_bytes: u64,
    /// Buffers, and bytes, copied from another device's memory.
    peer_copied: u64,
    peer_bytes: u64,
    settled: usize,
    failed: usize,
    ended: bool,
    done_after: Option<Duration>,
    /// Waits for its buffers pending now.
    waiting: usize,
    /// Bytes already in memory from the prestage it builds on ([`Reuse`]).
    reused_bytes: u64,
    /// Whether loading may start (see [`Knobs`]'s `hold_waiters`).
    released: bool,
    /// The image's bytes still to come, and the buffers they block.
    pending: Pending,
    /// A prestage's chunks written again since it was made.
    rewrites: Rewrites,
    /// Reads of chunks waiting for their pending pieces now.
    reads_waiting: usize,
}

/// A prestage's chunks whose bytes were written again in its draft's files
/// ([`Stage::rewritten`]): each is loaded again once its buffer is loaded, and a stage built on
/// the prestage takes it only as it was last loaded after it was last named.
#[derive(Debug, Default)]
struct Rewrites {
    /// Per chunk (buffer index, offset), how many times it was named.
    named: HashMap<(usize, u64), u64>,
    /// Per named chunk, what its memory holds: of which naming (the count then), and its bytes'
    /// CRC32C as read.
    loaded: HashMap<(usize, u64), (u64, u32)>,
    /// Chunks to load again, in the order they were named (each once) ...
    queue: VecDeque<(usize, u64)>,
    /// ... as a set.
    queued: HashSet<(usize, u64)>,
    /// Loads of them under way.
    loading: usize,
    /// Chunks, and bytes, loaded again.
    chunks: u64,
    bytes: u64,
}

impl Rewrites {
    /// Chunk `c` named: to be loaded again.
    fn name(&mut self, c: (usize, u64)) {
        let n = self.named.entry(c).or_insert(0);
        *n += 1;
        if self.queued.insert(c) {
            self.queue.push_back(c);
        }
    }

    /// The naming chunk `c` last had (0: never named).
    fn naming(&self, c: (usize, u64)) -> u64 {
        self.named.get(&c).copied().unwrap_or(0)
    }

    /// Whether what chunk `c`'s memory holds was loaded after its last naming.
    fn fresh(&self, c: (usize, u64)) -> bool {
        self.loaded.get(&c).map(|l| l.0) == Some(self.naming(c))
    }

    /// Up to `most` chunks of one loaded buffer to load again, taken off the queue; those
    /// loaded since they were named, or of a buffer that failed, are dropped; those of a buffer
    /// not loaded yet are left (its load reads them as they are then).
    fn take(&mut self, status: &[Status], most: usize) -> Option<(usize, Vec<u64>)> {
        let mut buffer = None;
        let mut offsets = Vec::new();
        let mut k = 0;
        while k < self.queue.len() && offsets.len() < most {
            let c @ (i, off) = self.queue[k];
            match status.get(i) {
                Some(Status::Ready) if self.fresh(c) => {}
                Some(Status::Ready) if buffer.is_none() || buffer == Some(i) => {
                    buffer = Some(i);
                    offsets.push(off);
                }
                Some(Status::Waiting | Status::Loading) | Some(Status::Ready) => {
                    k += 1;
                    continue;
                }
                Some(Status::Failed(_)) | None => {}
            }
            self.queue.remove(k);
            self.queued.remove(&c);
        }
        buffer.map(|i| (i, offsets))
    }
}

/// Whether two chunks lie at the same place: the same data file, offset and length.
fn same_place(a: &ChunkPlace<'_>, b: &ChunkPlace<'_>) -> bool {
    (a.file, a.at, a.len) == (b.file, b.at, b.len)
}

/// What a loader is given to do ([`Stage::pick`]).
enum Work {
    /// Load this buffer.
    Buffer(usize),
    /// Load these chunks of this loaded buffer again (a prestage's, written again).
    Again(usize, Vec<u64>),
}

/// What a loader may do next ([`Progress::choose`]).
enum Choice {
    /// Load this buffer.
    Load(usize),
    /// Wait: the buffers left are blocked.
    Blocked,
    /// Nothing is left to load.
    Done,
}

impl Progress {
    /// The next buffer to load: the first waited-for one not blocked, else the first in prefetch
    /// order not blocked.
    fn choose(&mut self) -> Choice {
        let mut k = 0;
        while k < self.urgent.len() {
            let i = self.urgent[k];
            if self.status[i] != Status::Waiting {
                self.urgent.remove(k);
            } else if self.pending.startable(i) {
                self.urgent.remove(k);
                return Choice::Load(i);
            } else {
                k += 1;
            }
        }
        while self.next < self.status.len() && self.status[self.next] != Status::Waiting {
            self.next += 1;
        }
        let mut blocked = false;
        for i in self.next..self.status.len() {
            if self.status[i] == Status::Waiting {
                if self.pending.startable(i) {
                    return Choice::Load(i);
                }
                blocked = true;
            }
        }
        if blocked {
            Choice::Blocked
        } else {
            Choice::Done
        }
    }

    /// Up to `most` chunks of one loaded buffer to load again ([`Rewrites::take`]), their load
    /// counted under way.
    fn take_again(&mut self, most: usize) -> Option<Work> {
        let (i, offsets) = self.rewrites.take(&self.status, most)?;
        self.rewrites.loading += 1;
        Some(Work::Again(i, offsets))
    }

    /// Buffers not loaded yet that a pending piece blocks.
    fn blocked(&self) -> usize {
        (0..self.status.len())
            .filter(|&i| self.status[i] == Status::Waiting && self.pending.is_blocked(i))
            .count()
    }
}

/// A restore being staged.
#[derive(Debug)]
pub(crate) struct Stage {
    pub(crate) id: u64,
    pub(crate) pid: i32,
    pub(crate) epoch: u64,
    pub(crate) image: PathBuf,
    /// In prefetch order.
    pub(crate) buffers: Vec<StagedBuffer>,
    by_alloc: HashMap<u64, usize>,
    /// Per buffer, another device's memory holding it (taken by the loader that copies it).
    peers: Mutex<Vec<Option<SharedMem>>>,
    /// Per buffer, the offsets of its chunks already in its memory (not loaded).
    skip: Vec<HashSet<u64>>,
    /// A prestage's draft image (a later stage compares its chunks with it); `None` for a stage.
    pub(crate) draft: Option<Arc<Image>>,
    /// A prestage's chunks whose bytes, when read, were not the draft's (by buffer index: their
    /// offsets): a later stage loads them again ([`Stage::missed`]).
    missed: Mutex<HashMap<usize, HashSet<u64>>>,
    /// Per buffer a load of which did not finish (the stage ended meanwhile), the chunks it
    /// copied into its memory: a stage built on this one takes them ([`Stage::partial`]).
    partial: Mutex<HashMap<usize, HashSet<u64>>>,
    /// A prestage's chunks by where its draft places them (by file: start, end, buffer index,
    /// offset; in order), for [`Stage::rewritten`]; empty for a stage.
    places: HashMap<String, Vec<(u64, u64, usize, u64)>>,
    /// Until when a prestage's loaders wait for chunks written again once every buffer is
    /// settled (none: they stop then).
    rewrites_until: Option<Instant>,
    progress: Mutex<Progress>,
    /// Bytes of chunks whose copy into the buffers' memory was issued (a buffer not whole yet
    /// included, a chunk loaded again counted again): how far the loads came, finer than
    /// whole buffers.
    chunk_bytes: std::sync::atomic::AtomicU64,
    cv: Condvar,
    started: Instant,
}

impl Stage {
    pub(crate) fn new(
        id: u64,
        pid: i32,
        epoch: u64,
        image: PathBuf,
        buffers: Vec<StagedBuffer>,
        mut peers: Vec<Option<SharedMem>>,
    ) -> Stage {
        let n = buffers.len();
        peers.resize_with(n, || None);
        Stage {
            id,
            pid,
            epoch,
            image,
            by_alloc: buffers
                .iter()
                .enumerate()
                .map(|(i, b)| (b.alloc, i))
                .collect(),
            buffers,
            peers: Mutex::new(peers),
            skip: vec![HashSet::new(); n],
            draft: None,
            missed: Mutex::new(HashMap::new()),
            partial: Mutex::new(HashMap::new()),
            places: HashMap::new(),
            rewrites_until: None,
            progress: Mutex::new(Progress {
                status: vec![Status::Waiting; n],
                next: 0,
                urgent: VecDeque::new(),
                loaded_bytes: 0,
                peer_copied: 0,
                peer_bytes: 0,
                settled: 0,
                failed: 0,
                ended: false,
                done_after: (n == 0).then(Duration::default),
                waiting: 0,
                reused_bytes: 0,
                released: false,
                pending: Pending::default(),
                rewrites: Rewrites::default(),
                reads_waiting: 0,
            }),
            chunk_bytes: Default::default(),
            cv: Condvar::new(),
            started: Instant::now(),
        }
    }

    /// This stage as a prestage of draft image `draft`.
    pub(crate) fn of_draft(mut self, draft: Arc<Image>) -> Stage {
        self.draft = Some(draft);
        self
    }

    /// This prestage taking chunks written again in `draft`'s files ([`Stage::rewritten`])
    /// until `until`: its loaders wait for them until then once every buffer is settled.
    pub(crate) fn rewritable(mut self, draft: &Image, until: Instant) -> Stage {
        let mut places: HashMap<String, Vec<(u64, u64, usize, u64)>> = HashMap::new();
        for (i, b) in self.buffers.iter().enumerate() {
            for (off, _) in draft.chunks(b.buf) {
                if let Some(c) = draft.chunk_place(b.buf, off) {
                    let end = c.at.saturating_add(c.len);
                    places
                        .entry(c.file.to_string())
                        .or_default()
                        .push((c.at, end, i, off));
                }
            }
        }
        places.values_mut().for_each(|v| v.sort_unstable());
        self.places = places;
        self.rewrites_until = Some(until);
        self
    }

    /// The bytes of `pieces` of the draft's files were written again: each chunk they overlap
    /// is named, to be loaded again once its buffer is loaded. How many chunks were named.
    pub(crate) fn rewritten(&self, pieces: &[PendingPiece]) -> u64 {
        let mut hits = Vec::new();
        for piece in pieces {
            let Some(places) = self.places.get(&piece.file) else {
                continue;
            };
            let end = piece.offset.saturating_add(piece.len);
            // Chunks do not overlap: those starting before the piece's end, back to the first
            // that ends after its start.
            let upto = places.partition_point(|&(start, ..)| start < end);
            for &(_, c_end, i, off) in places[..upto].iter().rev() {
                if c_end <= piece.offset {
                    break;
                }
                hits.push((i, off));
            }
        }
        let mut p = self.lock();
        if p.ended {
            return 0;
        }
        hits.iter().for_each(|&c| p.rewrites.name(c));
        drop(p);
        self.cv.notify_all();
        hits.len() as u64
    }

    /// The chunks of buffer `i` of this prestage (the image `img`'s buffer `buf`) that its
    /// memory holds as `img` has them, (offset, length) each, for a stage of `img` built on it;
    /// `loaded_whole`: its load finished; `partial`: of a buffer whose load did not, take the
    /// chunks it copied ([`Stage::partial`]). A chunk never named written again is held where
    /// the draft and `img` have the same bytes (by fingerprint) and its read found the draft's;
    /// a named one, where what was last loaded of it was read after its last naming, at the
    /// place `img` has it, and sums to `img`'s CRC32C.
    pub(crate) fn held_as_in(
        &self,
        i: usize,
        loaded_whole: bool,
        partial: bool,
        img: &Image,
        buf: u64,
    ) -> Vec<(u64, u64)> {
        let draft = self.draft.as_deref().expect("a prestage has its draft");
        let loaded = match (loaded_whole, partial) {
            (true, _) => None,
            (false, true) => Some(self.partial(i)),
            (false, false) => Some(HashSet::new()),
        };
        let missed = self.missed(i);
        let held = |off: u64| match self.rewritten_chunk(i, off) {
            None => img.same_chunk(draft, buf, off) && !missed.contains(&off),
            Some(loaded) => {
                match (
                    img.chunk_place(buf, off),
                    draft.chunk_place(buf, off),
                    loaded,
                ) {
                    (Some(now), Some(then), Some(crc)) => {
                        same_place(&now, &then) && now.crc32c == crc
                    }
                    _ => false,
                }
            }
        };
        (img.chunks(buf).into_iter())
            .filter(|(off, _)| loaded.as_ref().is_none_or(|l| l.contains(off)))
            .filter(|&(off, _)| held(off))
            .collect()
    }

    /// Whether chunk `offset` of buffer `i` was named written again ([`Stage::rewritten`]), and
    /// if so, the CRC32C of what its memory holds if that was loaded after its last naming.
    fn rewritten_chunk(&self, i: usize, offset: u64) -> Option<Option<u32>> {
        let p = self.lock();
        let r = &p.rewrites;
        let c = (i, offset);
        (r.naming(c) > 0).then(|| r.fresh(c).then(|| r.loaded[&c].1))
    }

    /// The naming chunk `offset` of buffer `i` has now (0: never named).
    fn naming(&self, i: usize, offset: u64) -> u64 {
        self.lock().rewrites.naming((i, offset))
    }

    /// Named chunks of buffer `i` loaded: each (offset, its naming when read, its CRC32C).
    fn loaded_named(&self, i: usize, chunks: Vec<(u64, u64, u32)>) {
        let mut p = self.lock();
        for (off, naming, crc) in chunks {
            p.rewrites.loaded.insert((i, off), (naming, crc));
        }
    }

    /// The chunks of buffer `i` in its memory when its load did not finish: those the load
    /// copied before it stopped, and those this stage took from the one it was built on (for a
    /// buffer loaded whole: only the latter).
    pub(crate) fn partial(&self, i: usize) -> HashSet<u64> {
        let m = self.partial.lock().unwrap_or_else(|e| e.into_inner());
        let mut loaded = m.get(&i).cloned().unwrap_or_default();
        loaded.extend(self.skip.get(i).into_iter().flatten());
        loaded
    }

    /// A load of buffer `i` that did not finish copied `offsets` into its memory.
    fn loaded_part(&self, i: usize, offsets: Vec<u64>) {
        let mut m = self.partial.lock().unwrap_or_else(|e| e.into_inner());
        m.entry(i).or_default().extend(offsets);
    }

    /// A load of chunks of buffer `i` again is over: `bytes` loaded, or failed (what their
    /// memory holds is then unknown).
    fn loaded_again(&self, i: usize, offsets: &[u64], r: Result<u64, LoadError>) {
        let mut p = self.lock();
        p.rewrites.loading -= 1;
        match r {
            Ok(bytes) => {
                p.rewrites.chunks += offsets.len() as u64;
                p.rewrites.bytes += bytes;
            }
            Err(_) => offsets.iter().for_each(|&off| {
                p.rewrites.loaded.remove(&(i, off));
            }),
        }
        drop(p);
        self.cv.notify_all();
    }

    /// A prestage's chunks of buffer `i` that it did not load as the draft has them: their bytes
    /// were not there yet where the files said they were (a migration's round sent as it was
    /// copied leaves pieces of its files to come after its draft; the keeper is told the
    /// files' lengths only). A stage built on it loads them.
    pub(crate) fn missed(&self, i: usize) -> HashSet<u64> {
        let m = self.missed.lock().unwrap_or_else(|e| e.into_inner());
        m.get(&i).cloned().unwrap_or_default()
    }

    /// This stage built on a prestage: what `reuse` says is in memory is not loaded, and a
    /// buffer whose chunks all are is ready at once.
    pub(crate) fn reusing(mut self, reuse: Reuse) -> Stage {
        let p = self.progress.get_mut().unwrap_or_else(|e| e.into_inner());
        p.reused_bytes = reuse.bytes;
        for (i, whole) in reuse.whole.iter().enumerate() {
            if *whole && i < p.status.len() {
                p.status[i] = Status::Ready;
                p.loaded_bytes += self.buffers[i].size;
                p.settled += 1;
            }
        }
        if p.settled == p.status.len() {
            p.done_after = Some(Duration::default());
        }
        for (i, offsets) in reuse.skip.into_iter().enumerate() {
            if i < self.skip.len() {
                self.skip[i] = offsets;
            }
        }
        self
    }

    /// This stage waiting for `pieces` of `image`'s data files: a buffer with a chunk to load
    /// (not already in its memory) whose bytes one of them overlaps is blocked until all of
    /// those have arrived ([`Stage::arrived`]).
    pub(crate) fn pending_on(mut self, image: &Image, pieces: &[PendingPiece]) -> Stage {
        if pieces.is_empty() {
            return self;
        }
        let mut spans = Vec::new();
        let mut first = vec![None; self.buffers.len()];
        for (i, b) in self.buffers.iter().enumerate() {
            for (off, len) in image.chunks(b.buf) {
                if self.skip[i].contains(&off) {
                    continue;
                }
                first[i] = first[i].or(Some(off));
                if let Some((file, at)) = image.chunk_location(b.buf, off) {
                    spans.push(Span {
                        file: file.to_string(),
                        start: at,
                        end: at.saturating_add(len),
                        buffer: i,
                        chunk: off,
                    });
                }
            }
        }
        let blocks = pending::overlaps(spans, pieces);
        let n = self.buffers.len();
        let p = self.progress.get_mut().unwrap_or_else(|e| e.into_inner());
        p.pending = Pending::new(n, pieces, blocks, first);
        self
    }

    /// `pieces` are in the image's files now: the chunks they blocked, and no other piece
    /// blocks, may load. How many pieces are still pending.
    pub(crate) fn arrived(&self, pieces: &[PendingPiece]) -> u64 {
        let mut p = self.lock();
        p.pending.arrive(pieces);
        let left = p.pending.left() as u64;
        drop(p);
        // Loaders wait for what it unblocked; a long poll answers once nothing is pending.
        self.cv.notify_all();
        left
    }

    /// The image's data files are now at least `files` long (name, bytes from their start): its
    /// pending pieces within those bytes arrived ([`Stage::arrived`]). How many are still
    /// pending.
    pub(crate) fn grown(&self, files: &std::collections::BTreeMap<String, u64>) -> u64 {
        let pieces: Vec<PendingPiece> = {
            let p = self.lock();
            (files.iter())
                .flat_map(|(f, &len)| p.pending.within(f, len))
                .collect()
        };
        self.arrived(&pieces)
    }

    /// Waits until the chunk of buffer `i` at `offset` waits for no piece (at once if none
    /// was pending for it); an error once the stage is ended.
    fn wait_chunk(&self, i: usize, offset: u64) -> Result<(), ChunkError> {
        let mut p = self.lock();
        let mut waited = false;
        let r = loop {
            if p.ended {
                break Err(ChunkError::Ended);
            }
            if !p.pending.chunk_blocked(i, offset) {
                break Ok(());
            }
            if !waited {
                waited = true;
                p.reads_waiting += 1;
            }
            p = self.sleep(p);
        };
        if waited {
            p.reads_waiting -= 1;
        }
        r
    }

    /// The pending pieces a wait for a blocked buffer needs, not handed out before: waits up to
    /// `wait` for one (not at all once the stage is ended or nothing is pending).
    pub(crate) fn demands(&self, wait: Duration) -> Vec<PendingPiece> {
        let deadline = Instant::now() + wait.min(Duration::from_secs(24 * 3600));
        let mut p = self.lock();
        loop {
            if p.ended || p.pending.left() == 0 {
                return Vec::new();
            }
            let pieces = p.pending.take_demands();
            let left = deadline.saturating_duration_since(Instant::now());
            if !pieces.is_empty() || left.is_zero() {
                return pieces;
            }
            p = self.sleep_for(p, left);
        }
    }

    /// Ends the stage and waits until no loader writes into its memory any more (a loader
    /// stops at its next chunk); which buffers were loaded whole.
    pub(crate) fn quiesce(&self) -> Vec<bool> {
        self.end();
        let mut p = self.lock();
        while p.status.contains(&Status::Loading) || p.rewrites.loading > 0 {
            p = self.sleep(p);
        }
        p.status.iter().map(|s| *s == Status::Ready).collect()
    }

    /// Whether the stage was ended.
    fn ended(&self) -> bool {
        self.lock().ended
    }

    fn lock(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits on the stage's condition variable with `p` held, until it is notified.
    fn sleep<'a>(&self, p: MutexGuard<'a, Progress>) -> MutexGuard<'a, Progress> {
        self.cv.wait(p).unwrap_or_else(|e| e.into_inner())
    }

    /// [`Stage::sleep`], `left` at most.
    fn sleep_for<'a>(
        &self,
        p: MutexGuard<'a, Progress>,
        left: Duration,
    ) -> MutexGuard<'a, Progress> {
        self.cv
            .wait_timeout(p, left)
            .unwrap_or_else(|e| e.into_inner())
            .0
    }

    /// Buffers with another device's memory to copy from.
    pub(crate) fn peer_buffers(&self) -> usize {
        self.lock_peers().iter().filter(|p| p.is_some()).count()
    }

    fn lock_peers(&self) -> MutexGuard<'_, Vec<Option<SharedMem>>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Buffer `i`'s memory on another device, if it has one (once: the caller copies it).
    fn take_peer(&self, i: usize) -> Option<SharedMem> {
        self.lock_peers().get_mut(i).and_then(Option::take)
    }

    /// Buffer `i` was copied from another device's memory.
    fn note_peer(&self, i: usize) {
        let mut p = self.lock();
        p.peer_copied += 1;
        p.peer_bytes += self.buffers[i].size;
    }

    /// The next buffer to load (a waited-for one first), marked loading; `None` when none is left
    /// or the stage is ended. Waits while the buffers left are blocked by pending pieces. With
    /// `hold_waiters` above 0, nothing is picked before that many waits are pending at once.
    /// A prestage's chunks written again are loaded again once no buffer is left to load (twice
    /// `readers` at a time), and its loaders wait for them until `rewrites_until` once none is
    /// left either.
    fn pick(&self, (hold_waiters, readers): (usize, usize)) -> Option<Work> {
        let mut p = self.lock();
        while !p.released && !p.ended {
            if p.waiting >= hold_waiters {
                p.released = true;
                break;
            }
            p = self.sleep(p);
        }
        loop {
            if p.ended {
                return None;
            }
            let choice = p.choose();
            if let Choice::Load(i) = choice {
                p.status[i] = Status::Loading;
                return Some(Work::Buffer(i));
            }
            if let Some(again) = p.take_again(2 * readers.max(1)) {
                return Some(again);
            }
            match (choice, self.rewrites_until) {
                (Choice::Done, None) => return None,
                (Choice::Done, Some(until)) => {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    p = self.sleep_for(p, left);
                }
                _ => p = self.sleep(p),
            }
        }
    }

    fn settle(&self, i: usize, r: Result<(), LoadError>) {
        let mut p = self.lock();
        if !matches!(p.status[i], Status::Waiting | Status::Loading) {
            return;
        }
        p.status[i] = match r {
            Ok(()) => {
                p.loaded_bytes += self.buffers[i].size;
                Status::Ready
            }
            Err(e) => {
                p.failed += 1;
                Status::Failed(e.to_string())
            }
        };
        p.settled += 1;
        if p.settled == p.status.len() {
            p.done_after = Some(self.started.elapsed());
        }
        drop(p);
        self.cv.notify_all();
    }

    /// Waits until allocation `alloc` is loaded (loaded next if it is still waiting; once its
    /// pending pieces arrived if it is blocked).
    pub(crate) fn wait(&self, alloc: u64) -> Result<(), WaitError> {
        let &i = self.by_alloc.get(&alloc).ok_or(WaitError::NotOfStage {
            alloc,
            stage: self.id,
        })?;
        let mut p = self.lock();
        if p.status[i] == Status::Waiting {
            if !p.urgent.contains(&i) {
                p.urgent.push_back(i);
            }
            // Blocked: the pieces it needs are asked for (`stage_demands`).
            p.pending.want(i);
        }
        p.waiting += 1;
        // A loader holding back for waiters counts this one.
        self.cv.notify_all();
        let r = loop {
            match &p.status[i] {
                Status::Ready => break Ok(()),
                Status::Failed(e) => break Err(WaitError::Failed(e.clone())),
                Status::Waiting | Status::Loading => {
                    p = self.sleep(p);
                }
            }
        };
        p.waiting -= 1;
        r
    }

    /// Stops loading: buffers not loaded yet are failed ("ended").
    pub(crate) fn end(&self) {
        // The other device's memory is not held for buffers nobody will copy now.
        self.lock_peers().iter_mut().for_each(|p| *p = None);
        let mut p = self.lock();
        p.ended = true;
        let mut n = 0;
        for s in p.status.iter_mut() {
            if *s == Status::Waiting {
                *s = Status::Failed(LoadError::Ended.to_string());
                n += 1;
            }
        }
        p.failed += n;
        p.settled += n;
        drop(p);
        self.cv.notify_all();
    }

    /// Whether every buffer has settled (loaded, failed or ended).
    pub(crate) fn is_done(&self) -> bool {
        self.lock().done_after.is_some()
    }

    pub(crate) fn stats(&self) -> StageStats {
        let p = self.lock();
        StageStats {
            stage: self.id,
            pid: self.pid,
            image: self.image.display().to_string(),
            buffers: self.buffers.len() as u64,
            bytes: self.buffers.iter().map(|b| b.size).sum(),
            ready: p.status.iter().filter(|s| **s == Status::Ready).count() as u64,
            peer_copied: p.peer_copied,
            peer_bytes: p.peer_bytes,
            failed: p.failed as u64,
            loaded_bytes: p.loaded_bytes,
            chunk_bytes: self.chunk_bytes.load(std::sync::atomic::Ordering::Relaxed),
            pending_pieces: p.pending.left() as u64,
            blocked_buffers: p.blocked() as u64,
            ms: ms(self.started.elapsed()),
            done_ms: p.done_after.map(ms),
            reused_bytes: p.reused_bytes,
            draft: self.draft.is_some(),
            reloaded_chunks: p.rewrites.chunks,
            reloaded_bytes: p.rewrites.bytes,
            reloads_left: p.rewrites.queue.len() as u64,
            reads_waiting: p.reads_waiting as u64,
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Test knobs, read once per stage: `POSSUM_KEEPER_STAGE_DELAY_MS` (each buffer waits that long
/// before it loads, so that a restored job meets buffers still loading) and
/// `POSSUM_KEEPER_STAGE_FAIL=N` (the buffer at position N of the prefetch order fails to load)
/// and `POSSUM_KEEPER_STAGE_HOLD_WAITERS=N` (nothing loads until N waits are pending at once: a
/// job restoring with one restorer thread then meets a buffer still loading however slowly it
/// was restored, its operation's wait being the second).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Knobs {
    delay: Duration,
    fail: Option<usize>,
    threads: usize,
    readers: usize,
    hold_waiters: usize,
}

impl Knobs {
    pub(crate) fn from_env() -> Knobs {
        let c = crate::config::Config::from_env();
        Knobs {
            delay: c.stage_delay,
            fail: c.stage_fail,
            threads: c.stage_threads,
            readers: c.stage_readers,
            hold_waiters: c.stage_hold_waiters,
        }
    }

    pub(crate) fn threads(&self) -> usize {
        self.threads
    }
}

/// What a loader needs of the keeper: its device, and a buffer's memory mapped for it.
pub(crate) trait Memory: Send + Sync + 'static {
    fn device(&self) -> Result<&ShareDevice, MemoryError>;
    /// Maps allocation `alloc` in `res`; an error if it is gone.
    fn map<'r>(
        &self,
        alloc: u64,
        res: &'r possum_cuda::share::Reservation,
    ) -> Result<possum_cuda::share::Mapped<'r>, MemoryError>;
}

/// A loader thread: loads the stage's buffers until none is left.
pub(crate) fn loader(mem: Arc<dyn Memory>, stage: Arc<Stage>, image: Arc<Image>, knobs: Knobs) {
    let mut bufs: Vec<PinnedBuf> = Vec::new();
    let stream = mem
        .device()
        .and_then(|d| Ok(d.stream()?))
        .map_err(|e| e.to_string());
    while let Some(work) = stage.pick((knobs.hold_waiters, knobs.readers)) {
        let i = match work {
            Work::Buffer(i) => i,
            Work::Again(i, offsets) => {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let s = stream
                        .as_ref()
                        .map_err(|e| LoadError::NoStream(e.clone()))?;
                    let via = Via::new(&image, s, &knobs);
                    load_again(&*mem, &stage, i, &offsets, &via, &mut bufs)
                }))
                .unwrap_or(Err(LoadError::Panicked));
                stage.loaded_again(i, &offsets, r);
                continue;
            }
        };
        if !knobs.delay.is_zero() {
            std::thread::sleep(knobs.delay);
        }
        // A panic fails this buffer (its copies in flight were waited for as they were
        // dropped), never leaves it loading: someone may wait for it.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            match (&stream, knobs.fail == Some(i)) {
                (_, true) => Err(LoadError::OnPurpose),
                (Err(e), _) => Err(LoadError::NoStream(e.clone())),
                (Ok(s), _) => {
                    let b = &stage.buffers[i];
                    // From the other device's memory if it has this buffer; the image if not,
                    // or if that copy fails.
                    match stage.take_peer(i).map(|src| copy_peer(&*mem, b, &src, s)) {
                        Some(Ok(())) => {
                            stage.note_peer(i);
                            Ok(())
                        }
                        _ => load(&*mem, &stage, i, &Via::new(&image, s, &knobs), &mut bufs),
                    }
                }
            }
        }))
        .unwrap_or(Err(LoadError::Panicked));
        stage.settle(i, r);
    }
}

/// Copies buffer `b` from `src` (its memory on another device, imported here) into its memory:
/// both mapped in reservations of this device's with access for it, one device-to-device copy,
/// waited for. The source is released by the caller afterwards.
fn copy_peer(
    mem: &dyn Memory,
    b: &StagedBuffer,
    src: &SharedMem,
    stream: &possum_cuda::CudaStream,
) -> Result<(), LoadError> {
    let dev = mem.device()?;
    let err = |source| LoadError::Peer { buf: b.buf, source };
    let (dst_res, src_res) = (
        dev.reserve(b.alloc_size).map_err(err)?,
        dev.reserve(src.size()).map_err(err)?,
    );
    let dst = mem.map(b.alloc, &dst_res)?;
    let from = src.map(&src_res, 0).map_err(err)?;
    stream
        .copy_d2d(from.va(), dst.va(), b.alloc_size.min(src.size()))
        .map_err(err)?;
    // Waited for before the mappings go (and before the buffer is called loaded).
    stream.synchronize().map_err(err)
}

/// Loads buffer `i` of `stage`: its chunks (those not already in its memory) read into pinned
/// buffers and copied to its memory, `DEPTH` in flight.
fn load(
    mem: &dyn Memory,
    stage: &Stage,
    i: usize,
    via: &Via<'_>,
    free: &mut Vec<PinnedBuf>,
) -> Result<(), LoadError> {
    let todo = |off: u64| !stage.skip[i].contains(&off);
    load_chunks(mem, (stage, i), todo, via, free).map(drop)
}

/// How a loader loads: the image it reads, the stream its copies go on, and how many threads
/// read a large buffer's chunks at once.
struct Via<'a> {
    image: &'a Image,
    stream: &'a possum_cuda::CudaStream,
    readers: usize,
}

impl<'a> Via<'a> {
    fn new(image: &'a Image, stream: &'a possum_cuda::CudaStream, knobs: &Knobs) -> Via<'a> {
        Via {
            image,
            stream,
            readers: knobs.readers.max(1),
        }
    }
}

/// Loads the chunks at `offsets` of buffer `i` of `stage` (a prestage's, loaded, named written
/// again) again: the bytes loaded.
fn load_again(
    mem: &dyn Memory,
    stage: &Stage,
    i: usize,
    offsets: &[u64],
    via: &Via<'_>,
    free: &mut Vec<PinnedBuf>,
) -> Result<u64, LoadError> {
    load_chunks(mem, (stage, i), |off| offsets.contains(&off), via, free)
}

/// Loads the chunks of buffer `i` of `stage` at the offsets `todo` keeps ([`copy_in`]): their
/// bytes.
fn load_chunks(
    mem: &dyn Memory,
    (stage, i): (&Stage, usize),
    todo: impl Fn(u64) -> bool,
    via: &Via<'_>,
    free: &mut Vec<PinnedBuf>,
) -> Result<u64, LoadError> {
    let chunks = via.image.chunks(stage.buffers[i].buf).into_iter();
    let todo: Vec<(u64, u64)> = chunks.filter(|&(off, _)| todo(off)).collect();
    copy_in(mem, stage, i, &todo, via, free)?;
    Ok(todo.iter().map(|(_, len)| len).sum())
}

/// Copies the chunks `todo` of buffer `i` of `stage` into its memory, `DEPTH` in flight; a
/// chunk named written again is read as its file holds it, and what was read of it is recorded
/// once every copy is over ([`Stage::loaded_named`]).
fn copy_in(
    mem: &dyn Memory,
    stage: &Stage,
    i: usize,
    todo: &[(u64, u64)],
    via: &Via<'_>,
    free: &mut Vec<PinnedBuf>,
) -> Result<(), LoadError> {
    let b = &stage.buffers[i];
    let dev = mem.device()?;
    let res = dev.reserve(b.alloc_size).map_err(LoadError::Reserve)?;
    let m = mem.map(b.alloc, &res)?;
    let mut inflight = VecDeque::new();
    let load = Load {
        stage,
        i,
        via,
        dev,
        va: m.va(),
        named: Mutex::new(Vec::new()),
    };
    let mut issued = Vec::new();
    let sent = send_chunks(&load, todo, free, &mut inflight, &mut issued);
    // Every copy in flight is waited for, whatever failed: nothing of this load may land on the
    // memory once the load is settled (the job may copy it in itself then).
    let mut waited = Ok(());
    for p in inflight {
        match p.wait() {
            Ok(buf) if buf.len() == PINNED => free.push(buf),
            Ok(_) => {}
            Err(e) => waited = waited.and(Err(e.into())),
        }
    }
    // Every copy issued landed: what it read is in the memory, whether or not all of `todo` was.
    if waited.is_ok() {
        let named = load.named.into_inner().unwrap_or_else(|e| e.into_inner());
        stage.loaded_named(i, named);
        if sent.is_err() {
            stage.loaded_part(i, issued);
        }
    }
    match sent.and(waited) {
        Err(ChunkError::Ended) => Err(LoadError::EndedWhileLoading),
        Ok(()) => Ok(()),
        Err(source) => Err(LoadError::Chunks { buf: b.buf, source }),
    }
}

/// One buffer's load: its stage, its place there and how it is loaded ([`Via`]); where the
/// copies go (the device, the buffer's memory as mapped); what was read of chunks named written
/// again ((offset, naming, CRC32C) each, from the reading threads).
struct Load<'a> {
    stage: &'a Stage,
    i: usize,
    via: &'a Via<'a>,
    dev: &'a ShareDevice,
    va: u64,
    named: Mutex<Vec<(u64, u64, u32)>>,
}

/// Reads each chunk `todo` of `load`'s buffer into a pinned buffer and queues its copy to its
/// memory + its offset (its offset added to `issued`); stops if the stage is ended.
fn send_chunks(
    load: &Load<'_>,
    todo: &[(u64, u64)],
    free: &mut Vec<PinnedBuf>,
    inflight: &mut VecDeque<CudaPending>,
    issued: &mut Vec<u64>,
) -> Result<(), ChunkError> {
    // A large buffer's chunks are read `readers` at a time (one thread reads a page-cache file
    // at a few GB/s, the copies go at tens), each batch's copies in flight while the next is
    // read; a small one's one at a time.
    let readers = load.via.readers;
    let batch = if todo.len() >= 2 * readers {
        readers
    } else {
        1
    };
    for group in todo.chunks(batch) {
        if load.stage.ended() {
            return Err(ChunkError::Ended);
        }
        let mut bufs = Vec::with_capacity(group.len());
        for &(off, len) in group {
            let n = usize::try_from(len).map_err(|_| ChunkError::TooLarge(off))?;
            let depth = DEPTH.max(2 * batch);
            bufs.push((next_buf(load.dev, free, inflight, n, depth)?, n));
        }
        let read = read_group(load, group, &mut bufs);
        if let Err(e) = read {
            free.extend(bufs.into_iter().map(|(b, _)| b));
            return Err(e);
        }
        for ((buf, n), &(off, _)) in bufs.into_iter().zip(group) {
            inflight.push_back(load.via.stream.copy_h2d(buf, load.va + off, n)?);
            issued.push(off);
            (load.stage.chunk_bytes).fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        }
    }
    Ok(())
}

/// Reads the chunks `group` of `load`'s buffer into `bufs` (one each, its first `n` bytes), each
/// once its bytes are in the image's file (post-copy), one thread each; a chunk named written
/// again as its file holds it, its sum added to the load's `named`.
fn read_group(
    load: &Load<'_>,
    group: &[(u64, u64)],
    bufs: &mut [(PinnedBuf, usize)],
) -> Result<(), ChunkError> {
    let Load {
        stage, i, named, ..
    } = load;
    let image = load.via.image;
    let (i, buf_id) = (*i, stage.buffers[*i].buf);
    let read_one = |off: u64, dst: &mut [u8]| -> Result<(), ChunkError> {
        // Post-copy: its bytes may still be on their way.
        stage.wait_chunk(i, off)?;
        // Written again since the draft: read as it is now, its sum kept for a later stage.
        let naming = stage.naming(i, off);
        if naming > 0 {
            let crc = image.read_chunk_as_is(buf_id, off, dst)?;
            let mut n = named.lock().unwrap_or_else(|e| e.into_inner());
            n.push((off, naming, crc));
            return Ok(());
        }
        match image.read_chunk(buf_id, off, dst) {
            // A prestage's chunk not there yet: left to the stage built on it (what was read
            // goes to the memory all the same, to be loaded over).
            Err(ImageError::ChecksumMismatch { .. }) if stage.draft.is_some() => {
                let mut m = stage.missed.lock().unwrap_or_else(|e| e.into_inner());
                m.entry(i).or_default().insert(off);
                Ok(())
            }
            r => r.map_err(ChunkError::from),
        }
    };
    if let ([(off, _)], [(buf, n)]) = (group, &mut *bufs) {
        return read_one(*off, &mut buf.as_mut_slice()[..*n]);
    }
    std::thread::scope(|scope| {
        let reads: Vec<_> = (group.iter().zip(bufs.iter_mut()))
            .map(|(&(off, _), (buf, n))| {
                let read_one = &read_one;
                scope.spawn(move || read_one(off, &mut buf.as_mut_slice()[..*n]))
            })
            .collect();
        reads
            .into_iter()
            .try_for_each(|r| r.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })
}

/// A pinned buffer of at least `n` bytes: the oldest copy's once `depth` are in flight, else a
/// free one, else a new one.
fn next_buf(
    dev: &ShareDevice,
    free: &mut Vec<PinnedBuf>,
    inflight: &mut VecDeque<CudaPending>,
    n: usize,
    depth: usize,
) -> Result<PinnedBuf, DeviceError> {
    let buf = if inflight.len() >= depth {
        let oldest = inflight.pop_front().expect("depth > 0 copies in flight");
        oldest.wait()?
    } else if let Some(b) = free.pop() {
        b
    } else {
        dev.pinned(PINNED.max(n))?
    };
    if buf.len() >= n {
        return Ok(buf);
    }
    free.push(buf);
    dev.pinned(n)
}
