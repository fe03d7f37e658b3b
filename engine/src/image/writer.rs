//! [`ImageWriter`]: writes an image into a temporary directory and commits it atomically.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::SystemTime;

use parking_lot::Mutex;

use super::manifest::{
    self, encode_framed, summarize, to_unix_nanos, BufferMsg, ChunkMsg, DataFileMsg, Manifest,
    ParentMsg,
};
use super::{
    Image, ImageError, ImageSummary, DRAFT_FILE, FORMAT_MAJOR, FORMAT_MINOR, MANIFEST_FILE,
    MAX_CHUNK_LEN, MAX_DATA_FILES,
};
use crate::fingerprint::{self, Fingerprint};
use crate::store::{BufferRecord, ChunkSink, Proof};

/// Bytes per write of a chunk by default: CRC'd and written while still in the core's cache (L2
/// is 2 MiB on the H100 machine's Xeons), and one huge page of a huge-page tmpfs: a write that
/// fills a new 2 MiB page whole is copied once, one that fills half of it has the kernel zero the
/// other half first (written twice).
pub const DEFAULT_WRITE_PIECE: usize = 2 << 20;

/// A chunk at least this long starts at a multiple of it in its data file (the gap before it is
/// a hole), so that its pieces fill whole huge pages.
const CHUNK_ALIGN: u64 = 2 << 20;

/// How an [`ImageWriter`] behaves.
#[derive(Clone, Debug)]
pub struct WriterOptions {
    /// Replace an existing non-empty directory at the final name. The old one is removed only after
    /// the new one is complete and in place. Default: false (refuse).
    pub force: bool,
    /// How many data files ("lanes") to spread chunks over; each new chunk takes the next lane
    /// in turn with no write under way, so this many threads can write without sharing a file.
    /// Clamped to `1 ..= MAX_DATA_FILES`. Default: 4.
    pub data_files: usize,
    /// fsync the data files, the manifest and the directories on commit. Turn off only for tests and
    /// benchmarks: without it a crash can leave an image whose files are incomplete. Default: true.
    pub fsync: bool,
    /// Bytes CRC'd and written at a time (clamped to 4 KiB ..= 64 MiB, rounded down to a
    /// multiple of 8). Default: [`DEFAULT_WRITE_PIECE`].
    pub write_piece: usize,
    /// An earlier committed image of the same job (its directory), whose chunks this one may
    /// hold by reference instead of a copy ([`ChunkSink::reuse_chunk`]): a chunk of the same
    /// length and fingerprint, in the parent's data files or in those of the parent's own
    /// parents (the original file, not a chain). The new image then depends on those files:
    /// they must stay where they are, relative to it (it records their place as a relative
    /// path: the images may be moved together). [`ImageWriter::create`] opens and checks it
    /// ([`ImageError::ParentUnusable`]) and refuses a final directory that is the parent or one
    /// of its parents, or holds one ([`ImageError::ParentIsTarget`]). Default: none.
    pub parent: Option<PathBuf>,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            force: false,
            data_files: 4,
            fsync: true,
            write_piece: DEFAULT_WRITE_PIECE,
            parent: None,
        }
    }
}

/// One data file that chunks are appended to. Space is reserved with an atomic add and the bytes
/// are written with a positioned write, so several threads may share a lane without a lock.
#[derive(Debug)]
struct Lane {
    name: String,
    path: PathBuf,
    file: File,
    /// Its (device, inode): the file whatever its directory is named.
    inode: (u64, u64),
    /// Bytes reserved so far (the next chunk goes here).
    end: AtomicU64,
    /// The ranges (offset, length) written since [`ImageWriter::take_written`] last took them.
    written: Mutex<Vec<(u64, u64)>>,
    /// Writes into it under way now.
    busy: AtomicUsize,
}

/// A write into a lane under way: counted in its `busy` until dropped.
struct Writing<'a>(&'a AtomicUsize);

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Lane {
    /// Counts a write into this file until the guard is dropped.
    fn writing(&self) -> Writing<'_> {
        self.busy.fetch_add(1, Ordering::Relaxed);
        Writing(&self.busy)
    }

    /// Reserves `len` bytes at the end of this file and returns where they start: a multiple of
    /// [`CHUNK_ALIGN`] for a chunk that long, else right at the end.
    fn reserve(&self, len: u64) -> u64 {
        if len < CHUNK_ALIGN {
            return self.end.fetch_add(len, Ordering::Relaxed);
        }
        let mut end = self.end.load(Ordering::Relaxed);
        loop {
            let at = end.next_multiple_of(CHUNK_ALIGN);
            match self.end.compare_exchange_weak(
                end,
                at + len,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return at,
                Err(now) => end = now,
            }
        }
    }
}

/// The file index, while writing, of a chunk held by a parent image: this plus its file's index
/// in [`Lineage::files`] (renumbered after this image's own files at commit).
const HELD_FILE: u32 = 1 << 31;

/// An image whose data files hold chunks this one may take: the parent, or one of its parents.
#[derive(Debug)]
struct Ancestor {
    /// Its directory, relative to the final directory (as the manifest records it).
    path: String,
    manifest_crc32c: u32,
    created_unix_nanos: u64,
}

/// A data file of an ancestor.
#[derive(Debug)]
struct HeldFile {
    /// Index into [`Lineage::ancestors`].
    ancestor: usize,
    name: String,
    /// Its length as the ancestor recorded it.
    len: u64,
}

/// Where an ancestor holds a chunk.
#[derive(Debug, Clone, Copy)]
struct Held {
    /// Index into [`Lineage::files`].
    file: u32,
    file_offset: u64,
    crc32c: u32,
}

/// The parent image's chunks, indexed by length and fingerprint, each resolved to the data file
/// that holds its bytes ([`WriterOptions::parent`]).
#[derive(Debug)]
struct Lineage {
    ancestors: Vec<Ancestor>,
    files: Vec<HeldFile>,
    by_fp: HashMap<(Fingerprint, u64), Held>,
}

/// `to` relative to `from` (both absolute and canonical): `..` up to their common ancestor, then
/// down. `None` if a component is not UTF-8.
fn relative(from: &Path, to: &Path) -> Option<String> {
    let f: Vec<Component<'_>> = from.components().collect();
    let t: Vec<Component<'_>> = to.components().collect();
    let common = f.iter().zip(&t).take_while(|(a, b)| a == b).count();
    let mut parts: Vec<&str> = vec![".."; f.len() - common];
    for c in &t[common..] {
        match c {
            Component::Normal(s) => parts.push(s.to_str()?),
            _ => return None,
        }
    }
    Some(parts.join("/"))
}

impl Lineage {
    /// Opens the parent image `parent` of the image to be committed at `final_dir` (whose
    /// canonical form is `final_canon`) and indexes its chunks.
    fn load(final_dir: &Path, final_canon: &Path, parent: &Path) -> Result<Lineage, ImageError> {
        let unusable = |source: ImageError| ImageError::ParentUnusable {
            image: final_dir.to_path_buf(),
            parent: parent.to_path_buf(),
            source: Box::new(source),
        };
        let img = Image::open(parent).map_err(unusable)?;
        let mut l = Lineage {
            ancestors: Vec::new(),
            files: Vec::new(),
            by_fp: HashMap::new(),
        };
        let mut by_dir: HashMap<PathBuf, usize> = HashMap::new();
        // The parent itself, then the images it takes chunks from.
        let mut ancestry = vec![(
            parent.to_path_buf(),
            img.manifest_crc32c,
            img.created_unix_nanos,
        )];
        ancestry.extend(
            img.parents
                .iter()
                .map(|p| (p.dir.clone(), p.manifest_crc32c, p.created_unix_nanos)),
        );
        let mut which = Vec::with_capacity(ancestry.len());
        for (dir, manifest_crc32c, created_unix_nanos) in ancestry {
            let canon = fs::canonicalize(&dir).map_err(|e| unusable(ImageError::io(&dir, e)))?;
            if let Some(&i) = by_dir.get(&canon) {
                which.push(i);
                continue;
            }
            if canon.starts_with(final_canon) {
                return Err(ImageError::ParentIsTarget {
                    image: final_dir.to_path_buf(),
                    parent: dir,
                });
            }
            let path = relative(final_canon, &canon)
                .filter(|p| manifest::valid_parent_path(p))
                .ok_or_else(|| {
                    unusable(ImageError::io(
                        &canon,
                        std::io::Error::new(
                            ErrorKind::InvalidInput,
                            format!(
                                "cannot be named relative to {} in a manifest (a name that is not UTF-8?)",
                                final_canon.display()
                            ),
                        ),
                    ))
                })?;
            by_dir.insert(canon, l.ancestors.len());
            which.push(l.ancestors.len());
            l.ancestors.push(Ancestor {
                path,
                manifest_crc32c,
                created_unix_nanos,
            });
        }
        let mut by_name: HashMap<(usize, &str), u32> = HashMap::new();
        let mut file_of = Vec::with_capacity(img.files.len());
        for f in &img.files {
            let ancestor = which[f.parent.map_or(0, |k| k + 1)];
            let i = *by_name.entry((ancestor, &f.name)).or_insert_with(|| {
                l.files.push(HeldFile {
                    ancestor,
                    name: f.name.clone(),
                    len: 0,
                });
                (l.files.len() - 1) as u32
            });
            let held = &mut l.files[i as usize];
            held.len = held.len.max(f.len);
            file_of.push(i);
        }
        for c in img.chunks.values().flatten() {
            if let Some(fp) = c.fingerprint() {
                l.by_fp.entry((fp, c.len)).or_insert(Held {
                    file: file_of[c.file as usize],
                    file_offset: c.file_offset,
                    crc32c: c.crc32c,
                });
            }
        }
        Ok(l)
    }
}

/// A chunk recorded in the manifest-to-be, with the sequence number of the call that wrote it.
#[derive(Debug)]
struct Recorded {
    seq: u64,
    chunk: ChunkMsg,
    /// A call is rewriting this chunk's bytes in place now (no other call may, meanwhile).
    rewriting: bool,
}

#[derive(Debug, Default)]
struct State {
    buffers: BTreeMap<u64, BufferRecord>,
    chunks: BTreeMap<(u64, u64), Recorded>,
    meta: BTreeMap<String, String>,
}

/// Writes an image directory. Implements [`ChunkSink`]: several threads may write chunks
/// concurrently, in any order. Each chunk goes straight to a data file (nothing is buffered beyond
/// the call); only its place and CRC32C are kept in memory for the manifest.
///
/// Nothing appears under the final name until [`ImageWriter::commit`]; dropping the writer without
/// committing removes its temporary directory.
#[derive(Debug)]
pub struct ImageWriter {
    final_dir: PathBuf,
    tmp_dir: PathBuf,
    opts: WriterOptions,
    lanes: Vec<Lane>,
    state: Mutex<State>,
    /// Orders `write_chunk` calls, so that of two writes to the same place the later call wins
    /// even if it finishes first.
    seq: AtomicU64,
    created: SystemTime,
    /// Set once the temporary directory has been renamed into place (or is gone).
    done: bool,
    /// Data files written by someone else (the keeper's spare image memory), after the lanes:
    /// [`ImageWriter::adopt_file`], [`ImageWriter::record_chunk`].
    adopted: Mutex<Vec<Adopted>>,
    /// The parent image's chunks ([`WriterOptions::parent`]).
    lineage: Option<Lineage>,
    /// Where each chunk written into a lane is recorded once its bytes are there
    /// ([`ImageWriter::journal_to`]).
    journal: Mutex<Option<File>>,
    /// Where the next new chunk looks for a lane first ([`ImageWriter::idle_lane`]).
    next_lane: AtomicUsize,
    /// A write failed, or wrote a chunk that was not the one expected: never committed.
    spoiled: AtomicBool,
}

/// One record of a writer's journal ([`ImageWriter::journal_to`]): a chunk's bytes, written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalRecord {
    /// The data file's (device, inode).
    pub inode: (u64, u64),
    /// Where in it the chunk's bytes are.
    pub at: u64,
    /// How many.
    pub len: u64,
}

impl JournalRecord {
    /// The bytes of a record: four little-endian `u64`s (device, inode, offset, length).
    pub const BYTES: usize = 32;

    /// Its bytes.
    pub fn to_bytes(self) -> [u8; Self::BYTES] {
        let mut rec = [0u8; Self::BYTES];
        let words = [self.inode.0, self.inode.1, self.at, self.len];
        for (out, v) in rec.chunks_exact_mut(8).zip(words) {
            out.copy_from_slice(&v.to_le_bytes());
        }
        rec
    }

    /// The record in `bytes`.
    pub fn from_bytes(bytes: &[u8; Self::BYTES]) -> JournalRecord {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        JournalRecord {
            inode: (word(0), word(1)),
            at: word(2),
            len: word(3),
        }
    }
}

/// A data file this writer did not write: its name and path here, its (device, inode), the end
/// of the last chunk recorded in it (its length in the image), and the ranges recorded in it
/// since [`ImageWriter::take_written`] was last called.
#[derive(Debug)]
struct Adopted {
    name: String,
    path: PathBuf,
    inode: (u64, u64),
    end: u64,
    written: Vec<(u64, u64)>,
}

/// Records `chunk`, written by call `seq` (`in_place`: over the place recorded for it), unless
/// a later call recorded its place already: that one's bytes win, these are garbage. Bytes
/// written over the recorded place are this call's whatever the order, and the call rewriting
/// it lets go of its flag (an appending call may have recorded another place meanwhile, which a
/// third may be rewriting).
fn settle(state: &mut State, seq: u64, chunk: ChunkMsg, in_place: bool) {
    let mine = Recorded {
        seq,
        chunk,
        rewriting: false,
    };
    match state.chunks.entry((mine.chunk.buffer, mine.chunk.offset)) {
        Entry::Vacant(v) => {
            v.insert(mine);
        }
        Entry::Occupied(mut o) => {
            let r = o.get_mut();
            let same_place =
                r.chunk.file == mine.chunk.file && r.chunk.file_offset == mine.chunk.file_offset;
            if in_place && same_place {
                r.rewriting = false;
            }
            if r.seq < seq || same_place {
                *r = mine;
            }
        }
    }
}

/// The byte ranges written into one data file ([`ImageWriter::take_written`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileWrites {
    /// The file's (device, inode).
    pub inode: (u64, u64),
    /// (offset, length), in order, none overlapping or touching another.
    pub ranges: Vec<(u64, u64)>,
}

/// `ranges` (offset, length) sorted, those that overlap or touch made one: the byte ranges a
/// writer's account names ([`FileWrites::ranges`]), and any other caller's.
pub fn merged_ranges(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (at, len) in ranges {
        match out.last_mut() {
            Some((start, l)) if at <= *start + *l => *l = (*l).max(at + len - *start),
            _ => out.push((at, len)),
        }
    }
    out
}

/// The name an image will have whose unfinished directory is named `dir_name` (`.NAME.tmp-...`,
/// as [`ImageWriter::create`] names it), if it is such a directory.
pub fn unfinished_image_name(dir_name: &str) -> Option<&str> {
    let (name, _) = dir_name.strip_prefix('.')?.rsplit_once(".tmp-")?;
    (!name.is_empty()).then_some(name)
}

/// A fresh suffix for temporary names: pid, time and a process-wide counter.
fn nonce() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{}-{:08x}{:x}", std::process::id(), t, n)
}

/// Whether `path` exists as anything other than an empty directory.
fn occupied(path: &Path) -> Result<bool, ImageError> {
    match fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => {
            let mut entries = fs::read_dir(path).map_err(|e| ImageError::io(path, e))?;
            Ok(entries.next().is_some())
        }
        Ok(_) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(ImageError::io(path, e)),
    }
}

/// fsyncs a directory, so that renames and creations in it are durable.
fn sync_dir(dir: &Path) -> Result<(), ImageError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| ImageError::io(dir, e))
}

impl ImageWriter {
    /// Starts writing an image that [`commit`](Self::commit) will put at `final_dir`. Creates the
    /// parent directory if needed and a temporary sibling directory holding the data files. Fails
    /// early with [`ImageError::AlreadyExists`] if `final_dir` exists, is not an empty directory,
    /// and `opts.force` is not set. With `opts.parent`, opens that image first and indexes its
    /// chunks ([`ImageError::ParentUnusable`] if it cannot be opened), and refuses
    /// ([`ImageError::ParentIsTarget`]) a `final_dir` that is, or holds, the parent or one of the
    /// images the parent takes chunks from: committing would replace the files the new image
    /// refers to.
    pub fn create(final_dir: &Path, opts: WriterOptions) -> Result<ImageWriter, ImageError> {
        let Some(name) = final_dir.file_name() else {
            return Err(ImageError::io(
                final_dir,
                std::io::Error::new(ErrorKind::InvalidInput, "an image path must end in a name"),
            ));
        };
        let parent = match final_dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        fs::create_dir_all(&parent).map_err(|e| ImageError::io(&parent, e))?;
        let lineage = match &opts.parent {
            Some(p) => {
                let canon = fs::canonicalize(&parent).map_err(|e| ImageError::io(&parent, e))?;
                Some(Lineage::load(final_dir, &canon.join(name), p)?)
            }
            None => None,
        };
        if !opts.force && occupied(final_dir)? {
            return Err(ImageError::AlreadyExists {
                image: final_dir.to_path_buf(),
            });
        }
        let tmp_dir = parent.join(format!(".{}.tmp-{}", name.to_string_lossy(), nonce()));
        fs::create_dir(&tmp_dir).map_err(|e| ImageError::io(&tmp_dir, e))?;

        let lanes_wanted = opts.data_files.clamp(1, MAX_DATA_FILES);
        // From here on, dropping `w` (on an error) removes the temporary directory.
        let mut w = ImageWriter {
            final_dir: final_dir.to_path_buf(),
            tmp_dir,
            opts,
            lanes: Vec::with_capacity(lanes_wanted),
            state: Mutex::new(State::default()),
            seq: AtomicU64::new(0),
            created: SystemTime::now(),
            done: false,
            adopted: Mutex::new(Vec::new()),
            lineage,
            journal: Mutex::new(None),
            next_lane: AtomicUsize::new(0),
            spoiled: AtomicBool::new(false),
        };
        for i in 0..lanes_wanted {
            let name = format!("data-{i:03}.bin");
            let path = w.tmp_dir.join(&name);
            let file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(|e| ImageError::io(&path, e))?;
            let m = file.metadata().map_err(|e| ImageError::io(&path, e))?;
            w.lanes.push(Lane {
                name,
                path,
                file,
                inode: (m.dev(), m.ino()),
                end: AtomicU64::new(0),
                written: Mutex::new(Vec::new()),
                busy: AtomicUsize::new(0),
            });
        }
        Ok(w)
    }

    /// What this writer wrote into its data files since the last call (since its creation, the
    /// first time): every data file it writes, by (device, inode), with the byte ranges written
    /// in it, merged and in order (none: unchanged since). A reader of the files sent elsewhere
    /// after the last call (a migration sending a pre-copy round ahead) need read again only
    /// these ranges. A file it adopted ([`Self::adopt_file`]) is listed after them with the
    /// chunks recorded in it ([`Self::record_chunk`]): whoever wrote it wrote only those.
    pub fn take_written(&self) -> Vec<FileWrites> {
        let lanes = self.lanes.iter().map(|lane| FileWrites {
            inode: lane.inode,
            ranges: merged_ranges(std::mem::take(&mut *lane.written.lock())),
        });
        let mut files: Vec<FileWrites> = lanes.collect();
        files.extend(self.adopted.lock().iter_mut().map(|a| FileWrites {
            inode: a.inode,
            ranges: merged_ranges(std::mem::take(&mut a.written)),
        }));
        files
    }

    /// From now on (until called again), each chunk written into a data file of this writer,
    /// or recorded in one it adopted, is also recorded in `journal` once its bytes are there: a [`JournalRecord`], each with one
    /// `write` (a file opened to append takes them whole, in the order they
    /// come). A reader of the files elsewhere (a migration sending them while the job is held)
    /// may read those ranges as final for this copy. `None` stops it. A record that cannot be
    /// written is left out (the journal is a hint: the ranges stay in [`Self::take_written`]).
    pub fn journal_to(&self, journal: Option<File>) {
        *self.journal.lock() = journal;
    }

    /// The lane a new chunk goes to: the first from the next in turn with no write under way,
    /// else that one. New chunks take the lanes in turn, so that every lane holds some of a
    /// buffer's chunks whoever wrote them: a later copy that writes them again in place (the
    /// final copy, with more writers than the pre-copy had) writes into as many files at once
    /// as it has writers, each file's writes being serialized by the filesystem.
    fn idle_lane(&self) -> usize {
        let n = self.lanes.len();
        let start = self.next_lane.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| self.lanes[i].busy.load(Ordering::Relaxed) == 0)
            .unwrap_or(start)
    }

    fn journal_chunk(&self, inode: (u64, u64), at: u64, len: u64) {
        let mut journal = self.journal.lock();
        let Some(file) = journal.as_mut() else {
            return;
        };
        let rec = JournalRecord { inode, at, len }.to_bytes();
        if file.write(&rec).ok() != Some(JournalRecord::BYTES) {
            // (A short or failed write would misalign every later record: none follows.)
            *journal = None;
        }
    }

    /// The directory the image will have once committed.
    pub fn final_dir(&self) -> &Path {
        &self.final_dir
    }

    /// The temporary directory being written.
    pub fn temp_dir(&self) -> &Path {
        &self.tmp_dir
    }

    /// Makes the file at `from` (on this image's filesystem) one of its data files, renamed into
    /// its temporary directory, for chunks someone else writes there ([`Self::record_chunk`]):
    /// its index. Only the recorded chunks' bytes count; it is cut to their end at commit.
    pub fn adopt_file(&self, from: &Path) -> Result<u32, ImageError> {
        let mut adopted = self.adopted.lock();
        let index = self.lanes.len() + adopted.len();
        if index >= MAX_DATA_FILES {
            return Err(ImageError::io(
                from,
                std::io::Error::other(format!("an image has at most {MAX_DATA_FILES} data files")),
            ));
        }
        let name = format!("data-{index:03}.bin");
        let path = self.tmp_dir.join(&name);
        fs::rename(from, &path).map_err(|e| ImageError::io(&path, e))?;
        let meta = fs::symlink_metadata(&path).map_err(|e| ImageError::io(&path, e))?;
        adopted.push(Adopted {
            name,
            path,
            inode: (meta.dev(), meta.ino()),
            end: 0,
            written: Vec::new(),
        });
        Ok(index as u32)
    }

    /// Records the chunk of `buffer` at `offset`, `len` bytes that someone else wrote at
    /// `file_offset` of adopted data file `file` with CRC32C `crc` (its bytes there by now: the
    /// journal names them, [`Self::journal_to`]); a later record of the same place wins over
    /// earlier ones (and over chunks written here before it). The chunk has no
    /// fingerprint: [`Self::record_chunk_fp`] records one.
    pub fn record_chunk(
        &self,
        buffer: u64,
        offset: u64,
        len: u64,
        file: u32,
        file_offset: u64,
        crc: u32,
    ) -> Result<(), ImageError> {
        self.record_chunk_fp(buffer, offset, len, file, file_offset, crc, None)
    }

    /// [`Self::record_chunk`] of a chunk whose fingerprint is `fp` (computed by whoever wrote
    /// its bytes).
    #[allow(clippy::too_many_arguments)]
    pub fn record_chunk_fp(
        &self,
        buffer: u64,
        offset: u64,
        len: u64,
        file: u32,
        file_offset: u64,
        crc: u32,
        fp: Option<Fingerprint>,
    ) -> Result<(), ImageError> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let mut state = self.state.lock();
        self.check_chunk(&state, buffer, offset, len)?;
        let inode = {
            let mut adopted = self.adopted.lock();
            let Some(a) = (file as usize)
                .checked_sub(self.lanes.len())
                .and_then(|k| adopted.get_mut(k))
            else {
                return Err(ImageError::io(
                    &self.tmp_dir,
                    std::io::Error::other(format!("data file {file} was not adopted")),
                ));
            };
            a.end = a.end.max(file_offset.saturating_add(len));
            a.written.push((file_offset, len));
            a.inode
        };
        let mut chunk = ChunkMsg {
            buffer,
            offset,
            len,
            file,
            file_offset,
            crc32c: crc,
            fp_lo: None,
            fp_hi: None,
        };
        chunk.set_fingerprint(fp);
        settle(&mut state, seq, chunk, false);
        drop(state);
        self.journal_chunk(inode, file_offset, len);
        Ok(())
    }

    /// Writes `data` as the chunk of `buffer` at `offset` (see [`ChunkSink::write_chunk`]), with
    /// fingerprint `fp`, or the one computed as it is written; returns that fingerprint. With
    /// `expect`, a chunk whose fingerprint is another is not recorded (`Ok(Err(fp))`), and the
    /// image is spoiled: its bytes may have gone where an earlier chunk's were.
    fn write(
        &self,
        buffer: u64,
        offset: u64,
        data: &[u8],
        (fp, expect): (Option<Fingerprint>, Option<Fingerprint>),
    ) -> Result<Proof, ImageError> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let len = data.len() as u64;
        self.check_chunk(&self.state.lock(), buffer, offset, len)?;

        // A chunk written again (a later pre-copy round, the final copy) of the same length goes
        // where it was: the image stays the size of the buffers, and a second round writes into
        // pages the first one already allocated. Unless another call is rewriting it right now:
        // then this one appends, and whichever call came later wins below. Only a place in a
        // lane is rewritten (not an adopted file's, nor a parent image's).
        let in_place = {
            let mut state = self.state.lock();
            match state.chunks.get_mut(&(buffer, offset)) {
                Some(r)
                    if r.chunk.len == len
                        && !r.rewriting
                        && (r.chunk.file as usize) < self.lanes.len() =>
                {
                    r.rewriting = true;
                    Some((r.chunk.file as usize, r.chunk.file_offset))
                }
                _ => None,
            }
        };
        let (lane_idx, file_offset) = match in_place {
            Some(place) => place,
            None => {
                let i = self.idle_lane();
                (i, self.lanes[i].reserve(len))
            }
        };
        let lane = &self.lanes[lane_idx];
        let _writing = lane.writing();
        // The CRC (and the fingerprint, unless given) and the write one piece at a time: the
        // write's copy reads the piece from the cache the CRC just brought it into, not from
        // memory again (a drain into tmpfs is bound by the host's memory traffic: the copy
        // engine's write, the CRC's read, the copy into the file's pages and their zeroing;
        // this takes one read away). Pieces are a multiple of 8 bytes, so that the pieces'
        // fingerprint sums add up to the chunk's.
        let mut crc = 0u32;
        let (mut lo, mut hi) = (0u64, 0u64);
        let piece = self.opts.write_piece.clamp(4 << 10, 64 << 20) & !7;
        let written = data
            .chunks(piece)
            .zip((file_offset..).step_by(piece))
            .enumerate()
            .try_for_each(|(i, (bytes, at))| {
                crc = crc32c::crc32c_append(crc, bytes);
                if fp.is_none() {
                    let (l, h) = fingerprint::sums(bytes, (i * piece / 8) as u64);
                    lo = lo.wrapping_add(l);
                    hi = hi.wrapping_add(h);
                }
                lane.file.write_all_at(bytes, at)
            })
            .map_err(|e| ImageError::io(&lane.path, e));
        let fp = fp.unwrap_or(Fingerprint::from_sums(lo, hi, len));
        let unproven = expect.is_some_and(|e| e != fp);
        if written.is_err() || unproven {
            // The place's bytes are unknown, or not the job's: the image is failed (the
            // caller abandons it, and its commit refuses), so its record need not be right;
            // only the flag is let go.
            self.spoiled.store(true, Ordering::Release);
            if let Some(place) = in_place {
                if let Some(r) = self.state.lock().chunks.get_mut(&(buffer, offset)) {
                    if (r.chunk.file as usize, r.chunk.file_offset) == place {
                        r.rewriting = false;
                    }
                }
            }
            written?;
            return Ok(Err(fp));
        }
        lane.written.lock().push((file_offset, len));
        self.journal_chunk(lane.inode, file_offset, len);

        let mut chunk = ChunkMsg {
            buffer,
            offset,
            len,
            file: lane_idx as u32,
            file_offset,
            crc32c: crc,
            fp_lo: None,
            fp_hi: None,
        };
        chunk.set_fingerprint(Some(fp));
        settle(&mut self.state.lock(), seq, chunk, in_place.is_some());
        Ok(Ok(fp))
    }

    /// That a chunk of `len` bytes at `offset` of `buffer` may be recorded: a length the format
    /// allows, inside a buffer declared in `state`.
    fn check_chunk(
        &self,
        state: &State,
        buffer: u64,
        offset: u64,
        len: u64,
    ) -> Result<(), ImageError> {
        if len == 0 || len > MAX_CHUNK_LEN {
            return Err(ImageError::ChunkBadLength {
                image: self.final_dir.clone(),
                buffer,
                offset,
                len,
                max: MAX_CHUNK_LEN,
            });
        }
        let Some(rec) = state.buffers.get(&buffer) else {
            return Err(ImageError::UnknownBuffer { buffer });
        };
        if !matches!(offset.checked_add(len), Some(end) if end <= rec.size) {
            return Err(ImageError::ChunkOutOfRange {
                buffer,
                offset,
                len,
            });
        }
        Ok(())
    }

    /// Finishes the image: refuses one a write into which failed or was unproven
    /// ([`ImageError::Spoiled`]), checks that every buffer is covered exactly by its chunks
    /// (refusing with [`ImageError::BadCoverage`] otherwise), writes `manifest.pb`, fsyncs the data files, the
    /// manifest and the directory, and renames the temporary directory to the final name.
    ///
    /// If the final name is taken by a non-empty directory (or a file), this refuses with
    /// [`ImageError::AlreadyExists`] unless `force` was set; with `force` the old one is renamed
    /// aside, the new one renamed in, and the old one then removed. On any error the temporary
    /// directory is removed and the final name is left as it was.
    pub fn commit(mut self) -> Result<ImageSummary, ImageError> {
        if self.spoiled.load(Ordering::Acquire) {
            return Err(ImageError::Spoiled {
                image: self.final_dir.clone(),
            });
        }
        let manifest = self.build_manifest()?;
        let index = manifest::validate(&self.final_dir, &manifest)?;

        if self.opts.fsync {
            for lane in &self.lanes {
                lane.file
                    .sync_all()
                    .map_err(|e| ImageError::io(&lane.path, e))?;
            }
        }
        for a in self.adopted.lock().iter() {
            // Its length is what its chunks need (a spare is made larger than a drain fills).
            let f = OpenOptions::new()
                .write(true)
                .open(&a.path)
                .map_err(|e| ImageError::io(&a.path, e))?;
            f.set_len(a.end).map_err(|e| ImageError::io(&a.path, e))?;
            if self.opts.fsync {
                f.sync_all().map_err(|e| ImageError::io(&a.path, e))?;
            }
        }
        let bytes = encode_framed(&manifest, FORMAT_MAJOR, FORMAT_MINOR);
        let mpath = self.tmp_dir.join(MANIFEST_FILE);
        let mut mfile = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&mpath)
            .map_err(|e| ImageError::io(&mpath, e))?;
        mfile
            .write_all(&bytes)
            .map_err(|e| ImageError::io(&mpath, e))?;
        if self.opts.fsync {
            mfile.sync_all().map_err(|e| ImageError::io(&mpath, e))?;
            sync_dir(&self.tmp_dir)?;
        }
        drop(mfile);
        match fs::remove_file(self.tmp_dir.join(DRAFT_FILE)) {
            Err(e) if e.kind() != ErrorKind::NotFound => {
                return Err(ImageError::io(self.tmp_dir.join(DRAFT_FILE), e))
            }
            _ => {}
        }

        self.install()?;
        Ok(summarize(&manifest, &index))
    }

    /// Writes (or replaces) the draft manifest ([`DRAFT_FILE`]): the chunks recorded so far, in
    /// the manifest's format, for a reader of the unfinished image ([`Image::open_draft`]:
    /// a migration's destination loads what it was sent ahead before the image is complete).
    /// Written beside the data files under a temporary name, then renamed: a reader sees a whole
    /// draft or the one before. Not synced; removed at commit.
    ///
    /// [`Image::open_draft`]: super::Image::open_draft
    pub fn write_draft(&self) -> Result<(), ImageError> {
        let manifest = self.build_manifest()?;
        let bytes = encode_framed(&manifest, FORMAT_MAJOR, FORMAT_MINOR);
        let tmp = self.tmp_dir.join(format!(".{DRAFT_FILE}.tmp"));
        fs::write(&tmp, &bytes).map_err(|e| ImageError::io(&tmp, e))?;
        let path = self.tmp_dir.join(DRAFT_FILE);
        fs::rename(&tmp, &path).map_err(|e| ImageError::io(&path, e))
    }

    /// The manifest for what has been written so far (data file lengths as they are on disk).
    fn build_manifest(&self) -> Result<Manifest, ImageError> {
        let state = self.state.lock();
        let mut files = Vec::with_capacity(self.lanes.len());
        for lane in &self.lanes {
            // The length on disk, not the bytes reserved: a write that failed may have left its
            // reserved range short, and no recorded chunk lies in such a range.
            let len = lane
                .file
                .metadata()
                .map_err(|e| ImageError::io(&lane.path, e))?
                .len();
            files.push(DataFileMsg {
                name: lane.name.clone(),
                len,
                parent: None,
            });
        }
        files.extend(self.adopted.lock().iter().map(|a| DataFileMsg {
            name: a.name.clone(),
            len: a.end,
            parent: None,
        }));
        let mut chunks: Vec<ChunkMsg> = state.chunks.values().map(|r| r.chunk.clone()).collect();
        // The parents' files that chunks are held in, listed after this image's own, and the
        // images they belong to, in order of first use.
        let mut parents = Vec::new();
        if let Some(l) = &self.lineage {
            let mut file_at: HashMap<u32, u32> = HashMap::new();
            let mut parent_at: HashMap<usize, u32> = HashMap::new();
            for c in chunks.iter_mut().filter(|c| c.file >= HELD_FILE) {
                let k = c.file - HELD_FILE;
                c.file = match file_at.get(&k) {
                    Some(&i) => i,
                    None => {
                        let held = &l.files[k as usize];
                        let p = match parent_at.get(&held.ancestor) {
                            Some(&p) => p,
                            None => {
                                let a = &l.ancestors[held.ancestor];
                                parents.push(ParentMsg {
                                    path: a.path.clone(),
                                    manifest_crc32c: a.manifest_crc32c,
                                    created_unix_nanos: a.created_unix_nanos,
                                });
                                let p = (parents.len() - 1) as u32;
                                parent_at.insert(held.ancestor, p);
                                p
                            }
                        };
                        files.push(DataFileMsg {
                            name: held.name.clone(),
                            len: held.len,
                            parent: Some(p),
                        });
                        let i = (files.len() - 1) as u32;
                        file_at.insert(k, i);
                        i
                    }
                };
            }
        }
        Ok(Manifest {
            major: FORMAT_MAJOR,
            minor: FORMAT_MINOR,
            created_unix_nanos: to_unix_nanos(self.created),
            meta: state.meta.clone(),
            buffers: state.buffers.values().map(BufferMsg::from).collect(),
            chunks,
            files,
            parents,
        })
    }

    /// Renames the finished temporary directory to the final name (see [`commit`](Self::commit)).
    fn install(&mut self) -> Result<(), ImageError> {
        let parent = self
            .tmp_dir
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| ".".into());
        let rename =
            |from: &Path, to: &Path| fs::rename(from, to).map_err(|e| ImageError::io(to, e));
        if !occupied(&self.final_dir)? {
            // Absent, or an empty directory, which rename(2) replaces atomically.
            rename(&self.tmp_dir, &self.final_dir)?;
            self.done = true;
        } else if !self.opts.force {
            return Err(ImageError::AlreadyExists {
                image: self.final_dir.clone(),
            });
        } else {
            let name = self
                .final_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned());
            let aside = parent.join(format!(".{}.old-{}", name.unwrap_or_default(), nonce()));
            rename(&self.final_dir, &aside)?;
            if let Err(e) = rename(&self.tmp_dir, &self.final_dir) {
                // Put the old image back; the new one stays in the temp dir and is removed on drop.
                let _ = fs::rename(&aside, &self.final_dir);
                return Err(e);
            }
            self.done = true;
            if self.opts.fsync {
                sync_dir(&parent)?;
            }
            let removed = match fs::symlink_metadata(&aside) {
                Ok(md) if md.is_dir() => fs::remove_dir_all(&aside),
                _ => fs::remove_file(&aside),
            };
            if let Err(e) = removed {
                tracing::warn!(
                    "could not remove the replaced image at {}: {e}",
                    aside.display()
                );
            }
        }
        if self.opts.fsync {
            sync_dir(&parent)?;
        }
        Ok(())
    }
}

impl ChunkSink for ImageWriter {
    /// Declares (or re-declares, replacing the record) a buffer.
    fn add_buffer(&self, rec: BufferRecord) -> Result<(), ImageError> {
        let mut state = self.state.lock();
        let rec = crate::store::keep_rank(state.buffers.get(&rec.id), rec);
        state.buffers.insert(rec.id, rec);
        Ok(())
    }

    /// Appends `data` to this thread's data file and records it as the chunk of `buffer` at
    /// `offset`, superseding an earlier chunk at the same place (whose bytes become garbage),
    /// with the fingerprint of `data` (computed as it is written).
    fn write_chunk(&self, buffer: u64, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        self.write(buffer, offset, data, (None, None)).map(|_| ())
    }

    /// [`Self::write_chunk`], recording `fp` as the chunk's fingerprint (not computed again).
    fn write_chunk_fp(
        &self,
        buffer: u64,
        offset: u64,
        data: &[u8],
        fp: Fingerprint,
    ) -> Result<(), ImageError> {
        self.write(buffer, offset, data, (Some(fp), None))
            .map(|_| ())
    }

    /// [`Self::write_chunk`], the fingerprint computed in the same pass as the CRC and the
    /// write; a chunk that is not `expect` spoils the image (see [`ChunkSink::write_chunk_proving`]).
    fn write_chunk_proving(
        &self,
        buffer: u64,
        offset: u64,
        data: &[u8],
        expect: Option<Fingerprint>,
    ) -> Result<Proof, ImageError> {
        self.write(buffer, offset, data, (None, expect))
    }

    /// Records the chunk as held by the parent image ([`WriterOptions::parent`]) if it has a
    /// chunk of `len` bytes with fingerprint `fp`: a reference to the file that holds those
    /// bytes, with their CRC32C as recorded there. `Ok(false)` without a parent or such a chunk.
    fn reuse_chunk(
        &self,
        buffer: u64,
        offset: u64,
        len: u64,
        fp: Fingerprint,
    ) -> Result<bool, ImageError> {
        let Some(held) = self.lineage.as_ref().and_then(|l| l.by_fp.get(&(fp, len))) else {
            return Ok(false);
        };
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let mut state = self.state.lock();
        self.check_chunk(&state, buffer, offset, len)?;
        let mut chunk = ChunkMsg {
            buffer,
            offset,
            len,
            file: HELD_FILE + held.file,
            file_offset: held.file_offset,
            crc32c: held.crc32c,
            fp_lo: None,
            fp_hi: None,
        };
        chunk.set_fingerprint(Some(fp));
        settle(&mut state, seq, chunk, false);
        Ok(true)
    }

    fn set_meta(&self, key: &str, value: &str) -> Result<(), ImageError> {
        self.state
            .lock()
            .meta
            .insert(key.to_owned(), value.to_owned());
        Ok(())
    }
}

impl Drop for ImageWriter {
    fn drop(&mut self) {
        if !self.done {
            // Best effort: the temporary directory has a name no reader takes for an image.
            let _ = fs::remove_dir_all(&self.tmp_dir);
        }
    }
}
