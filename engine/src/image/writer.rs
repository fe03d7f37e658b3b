//! [`ImageWriter`]: writes an image into a temporary directory and commits it atomically.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::SystemTime;

use parking_lot::Mutex;

use super::manifest::{
    self, encode_framed, summarize, to_unix_nanos, BufferMsg, ChunkMsg, DataFileMsg, Manifest,
};
use super::{
    ImageError, ImageSummary, FORMAT_MAJOR, FORMAT_MINOR, MANIFEST_FILE, MAX_CHUNK_LEN,
    MAX_DATA_FILES,
};
use crate::store::{BufferRecord, ChunkSink};

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
    /// How many data files ("lanes") to spread chunks over; writing threads are assigned to lanes
    /// round-robin, so this many threads can append without sharing a file. Clamped to
    /// `1 ..= MAX_DATA_FILES`. Default: 4.
    pub data_files: usize,
    /// fsync the data files, the manifest and the directories on commit. Turn off only for tests and
    /// benchmarks: without it a crash can leave an image whose files are incomplete. Default: true.
    pub fsync: bool,
    /// Bytes CRC'd and written at a time (clamped to 4 KiB ..= 64 MiB). Default:
    /// [`DEFAULT_WRITE_PIECE`].
    pub write_piece: usize,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            force: false,
            data_files: 4,
            fsync: true,
            write_piece: DEFAULT_WRITE_PIECE,
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
    /// Bytes reserved so far (the next chunk goes here).
    end: AtomicU64,
}

impl Lane {
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
}

/// A data file this writer did not write: its name and path here, and the end of the last
/// chunk recorded in it (its length in the image).
#[derive(Debug)]
struct Adopted {
    name: String,
    path: PathBuf,
    end: u64,
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

/// This thread's lane slot: threads are numbered in order of their first write.
fn lane_slot() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SLOT: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    SLOT.with(|s| *s)
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
    /// and `opts.force` is not set.
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
        };
        for i in 0..lanes_wanted {
            let name = format!("data-{i:03}.bin");
            let path = w.tmp_dir.join(&name);
            let file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(|e| ImageError::io(&path, e))?;
            w.lanes.push(Lane {
                name,
                path,
                file,
                end: AtomicU64::new(0),
            });
        }
        Ok(w)
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
        adopted.push(Adopted { name, path, end: 0 });
        Ok(index as u32)
    }

    /// Records the chunk of `buffer` at `offset`, `len` bytes that someone else wrote at
    /// `file_offset` of adopted data file `file` with CRC32C `crc`; a later record of the same
    /// place wins over earlier ones (and over chunks written here before it).
    #[allow(clippy::too_many_arguments)]
    pub fn record_chunk(
        &self,
        buffer: u64,
        offset: u64,
        len: u64,
        file: u32,
        file_offset: u64,
        crc: u32,
    ) -> Result<(), ImageError> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let mut state = self.state.lock();
        self.check_chunk(&state, buffer, offset, len)?;
        {
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
        }
        let chunk = ChunkMsg {
            buffer,
            offset,
            len,
            file,
            file_offset,
            crc32c: crc,
        };
        settle(&mut state, seq, chunk, false);
        Ok(())
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

    /// Finishes the image: checks that every buffer is covered exactly by its chunks (refusing with
    /// [`ImageError::BadCoverage`] otherwise), writes `manifest.pb`, fsyncs the data files, the
    /// manifest and the directory, and renames the temporary directory to the final name.
    ///
    /// If the final name is taken by a non-empty directory (or a file), this refuses with
    /// [`ImageError::AlreadyExists`] unless `force` was set; with `force` the old one is renamed
    /// aside, the new one renamed in, and the old one then removed. On any error the temporary
    /// directory is removed and the final name is left as it was.
    pub fn commit(mut self) -> Result<ImageSummary, ImageError> {
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

        self.install()?;
        Ok(summarize(&manifest, &index))
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
            });
        }
        files.extend(self.adopted.lock().iter().map(|a| DataFileMsg {
            name: a.name.clone(),
            len: a.end,
        }));
        Ok(Manifest {
            major: FORMAT_MAJOR,
            minor: FORMAT_MINOR,
            created_unix_nanos: to_unix_nanos(self.created),
            meta: state.meta.clone(),
            buffers: state.buffers.values().map(BufferMsg::from).collect(),
            chunks: state.chunks.values().map(|r| r.chunk.clone()).collect(),
            files,
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
    /// `offset`, superseding an earlier chunk at the same place (whose bytes become garbage).
    fn write_chunk(&self, buffer: u64, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let len = data.len() as u64;
        self.check_chunk(&self.state.lock(), buffer, offset, len)?;

        // A chunk written again (a later pre-copy round, the final copy) of the same length goes
        // where it was: the image stays the size of the buffers, and a second round writes into
        // pages the first one already allocated. Unless another call is rewriting it right now:
        // then this one appends, and whichever call came later wins below.
        let in_place = {
            let mut state = self.state.lock();
            match state.chunks.get_mut(&(buffer, offset)) {
                Some(r) if r.chunk.len == len && !r.rewriting => {
                    r.rewriting = true;
                    Some((r.chunk.file as usize, r.chunk.file_offset))
                }
                _ => None,
            }
        };
        let (lane_idx, file_offset) = match in_place {
            Some(place) => place,
            None => {
                let i = lane_slot() % self.lanes.len();
                (i, self.lanes[i].reserve(len))
            }
        };
        let lane = &self.lanes[lane_idx];
        // The CRC and the write one piece at a time: the write's copy reads the piece from the
        // cache the CRC just brought it into, not from memory again (a drain into tmpfs is bound
        // by the host's memory traffic: the copy engine's write, the CRC's read, the copy into
        // the file's pages and their zeroing; this takes one read away).
        let mut crc = 0u32;
        let piece = self.opts.write_piece.clamp(4 << 10, 64 << 20);
        let written = data
            .chunks(piece)
            .zip((file_offset..).step_by(piece))
            .try_for_each(|(piece, at)| {
                crc = crc32c::crc32c_append(crc, piece);
                lane.file.write_all_at(piece, at)
            })
            .map_err(|e| ImageError::io(&lane.path, e));
        if let Err(e) = written {
            // The place's bytes are unknown now: a failed write fails the image (the caller
            // abandons it), so its record need not be right; only the flag is let go.
            if let Some(place) = in_place {
                if let Some(r) = self.state.lock().chunks.get_mut(&(buffer, offset)) {
                    if (r.chunk.file as usize, r.chunk.file_offset) == place {
                        r.rewriting = false;
                    }
                }
            }
            return Err(e);
        }

        let chunk = ChunkMsg {
            buffer,
            offset,
            len,
            file: lane_idx as u32,
            file_offset,
            crc32c: crc,
        };
        settle(&mut self.state.lock(), seq, chunk, in_place.is_some());
        Ok(())
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
