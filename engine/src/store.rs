//! Where checkpointed bytes go and where restored bytes come from.
//!
//! The engine writes through [`ChunkSink`] and reads through [`ChunkSource`]; the on-disk image
//! ([`crate::image`]) and the in-memory [`MemStore`] implement both. Chunks are addressed by
//! (buffer id, offset in buffer); writing the same chunk twice keeps the newer bytes (pre-copy rounds
//! resend buffers).

use std::collections::{BTreeMap, HashMap};

use std::sync::Arc;

use parking_lot::Mutex;

use crate::image::ImageError;

/// One buffer of an image: where it lived and how large it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferRecord {
    /// The engine's id of the buffer (stable within one process).
    pub id: u64,
    /// Its device virtual address, restored at the same address.
    pub va: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Where it comes in the predicted order of first use after restore (0 = first).
    pub prefetch_rank: u32,
}

/// Receives checkpointed data. Implementations must accept chunks from several threads, in any order.
pub trait ChunkSink: Send + Sync {
    /// Declares a buffer before any of its chunks. Declaring it again replaces its record, except
    /// that `prefetch_rank: u32::MAX` (no rank) keeps a rank already recorded: a later round that
    /// has no ranking of its own does not erase an earlier one's ([`keep_rank`]).
    fn add_buffer(&self, rec: BufferRecord) -> Result<(), ImageError>;
    /// Stores `data` as the bytes of `buffer` at `offset` (replacing an earlier chunk at the same place).
    fn write_chunk(&self, buffer: u64, offset: u64, data: &[u8]) -> Result<(), ImageError>;
    /// Stores a key/value pair of metadata (the job's CPU-side state, the backend's name, ...).
    fn set_meta(&self, key: &str, value: &str) -> Result<(), ImageError>;
}

/// `rec` as a sink stores it over `old` (see [`ChunkSink::add_buffer`]): an unranked
/// declaration of the same buffer keeps the rank `old` had.
pub fn keep_rank(old: Option<&BufferRecord>, mut rec: BufferRecord) -> BufferRecord {
    if let Some(o) = old {
        if rec.prefetch_rank == u32::MAX && o.va == rec.va && o.size == rec.size {
            rec.prefetch_rank = o.prefetch_rank;
        }
    }
    rec
}

/// Supplies data to restore.
pub trait ChunkSource: Send + Sync {
    /// The buffers, in no particular order.
    fn buffers(&self) -> Vec<BufferRecord>;
    /// The chunks of `buffer` as (offset, len), sorted, covering the buffer exactly.
    fn chunks(&self, buffer: u64) -> Vec<(u64, u64)>;
    /// Reads the chunk of `buffer` starting at `offset` into `dst` (whose length is the chunk's),
    /// checking its integrity.
    fn read_chunk(&self, buffer: u64, offset: u64, dst: &mut [u8]) -> Result<(), ImageError>;
    /// A metadata value.
    fn meta(&self, key: &str) -> Option<String>;
}

#[derive(Default, Debug)]
struct MemInner {
    buffers: BTreeMap<u64, BufferRecord>,
    chunks: HashMap<u64, BTreeMap<u64, Arc<[u8]>>>,
    meta: BTreeMap<String, String>,
}

/// An image held in host memory: for tests, and for a checkpoint that never leaves the process.
#[derive(Default, Debug)]
pub struct MemStore {
    inner: Mutex<MemInner>,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The whole contents of `buffer`, assembled from its chunks (missing bytes read as zero).
    pub fn buffer_bytes(&self, buffer: u64) -> Option<Vec<u8>> {
        let inner = self.inner.lock();
        let rec = inner.buffers.get(&buffer)?;
        let mut out = vec![0u8; usize::try_from(rec.size).ok()?];
        if let Some(chunks) = inner.chunks.get(&buffer) {
            for (&off, data) in chunks {
                let off = usize::try_from(off).ok()?;
                out[off..off + data.len()].copy_from_slice(data);
            }
        }
        Some(out)
    }

    /// Total bytes of chunk data held.
    pub fn bytes(&self) -> u64 {
        let inner = self.inner.lock();
        inner
            .chunks
            .values()
            .flat_map(|c| c.values())
            .map(|d| d.len() as u64)
            .sum()
    }
}

impl ChunkSink for MemStore {
    fn add_buffer(&self, rec: BufferRecord) -> Result<(), ImageError> {
        let mut inner = self.inner.lock();
        let rec = keep_rank(inner.buffers.get(&rec.id), rec);
        inner.buffers.insert(rec.id, rec);
        Ok(())
    }

    fn write_chunk(&self, buffer: u64, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        // Copy outside the lock: several writer threads copy at once.
        let data: Arc<[u8]> = Arc::from(data);
        let mut inner = self.inner.lock();
        let Some(rec) = inner.buffers.get(&buffer) else {
            return Err(ImageError::UnknownBuffer { buffer });
        };
        if offset + data.len() as u64 > rec.size {
            return Err(ImageError::ChunkOutOfRange {
                buffer,
                offset,
                len: data.len() as u64,
            });
        }
        inner.chunks.entry(buffer).or_default().insert(offset, data);
        Ok(())
    }

    fn set_meta(&self, key: &str, value: &str) -> Result<(), ImageError> {
        self.inner
            .lock()
            .meta
            .insert(key.to_owned(), value.to_owned());
        Ok(())
    }
}

impl ChunkSource for MemStore {
    fn buffers(&self) -> Vec<BufferRecord> {
        self.inner.lock().buffers.values().cloned().collect()
    }

    fn chunks(&self, buffer: u64) -> Vec<(u64, u64)> {
        let inner = self.inner.lock();
        inner
            .chunks
            .get(&buffer)
            .map(|c| c.iter().map(|(&o, d)| (o, d.len() as u64)).collect())
            .unwrap_or_default()
    }

    fn read_chunk(&self, buffer: u64, offset: u64, dst: &mut [u8]) -> Result<(), ImageError> {
        let data = {
            let inner = self.inner.lock();
            inner
                .chunks
                .get(&buffer)
                .and_then(|c| c.get(&offset))
                .cloned()
                .ok_or(ImageError::MissingChunk { buffer, offset })?
        };
        if data.len() != dst.len() {
            return Err(ImageError::ChunkOutOfRange {
                buffer,
                offset,
                len: dst.len() as u64,
            });
        }
        // Copy outside the lock: several restorer threads read at once.
        dst.copy_from_slice(&data);
        Ok(())
    }

    fn meta(&self, key: &str) -> Option<String> {
        self.inner.lock().meta.get(key).cloned()
    }
}

/// Saves a *shadow* (a device-side copy of a buffer as of T0, which the job never writes) into
/// the image by other means than the engine's staging: the keeper's spare image memory, which
/// the copy engine fills directly. [`crate::Engine::checkpoint_snapshot_with`].
pub trait ShadowSaver: Send + Sync {
    /// Saves the `size` bytes at `shadow` as buffer `buffer`'s contents: returns once they are
    /// in the image (its chunks recorded in the sink). On an error the engine saves the shadow
    /// through its staging instead.
    fn save(&self, buffer: u64, shadow: crate::device::DevPtr, size: u64) -> Result<(), String>;
}
