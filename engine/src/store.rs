//! Where checkpointed bytes go and where restored bytes come from.
//!
//! The engine writes through [`ChunkSink`] and reads through [`ChunkSource`]; the on-disk image
//! ([`crate::image`]) and the in-memory [`MemStore`] implement both. Chunks are addressed by
//! (buffer id, offset in buffer); writing the same chunk twice keeps the newer bytes (pre-copy rounds
//! resend buffers).

use std::collections::{BTreeMap, HashMap};

use std::sync::Arc;

use parking_lot::Mutex;

use crate::fingerprint::Fingerprint;
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

/// A chunk written against its expected fingerprint ([`ChunkSink::write_chunk_proving`]): its
/// fingerprint, `Ok` where it was the one expected (the chunk stored), `Err` where not.
pub type Proof = Result<Fingerprint, Fingerprint>;

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
    /// [`ChunkSink::write_chunk`] of bytes whose fingerprint is `fp` ([`crate::fingerprint::of`]
    /// of `data`, computed by the caller on the bytes it copied): a sink that records
    /// fingerprints keeps it with the chunk, so that a restore can check the bytes it loads.
    fn write_chunk_fp(
        &self,
        buffer: u64,
        offset: u64,
        data: &[u8],
        fp: Fingerprint,
    ) -> Result<(), ImageError> {
        let _ = fp;
        self.write_chunk(buffer, offset, data)
    }
    /// [`ChunkSink::write_chunk`] that returns the bytes' fingerprint ([`crate::fingerprint::of`]
    /// of `data`): `Ok(Ok(fp))`, the chunk stored; with `expect`, a chunk whose fingerprint is
    /// another is not stored (`Ok(Err(fp))`). A sink that computes the fingerprint as it writes
    /// the bytes reads them once, not twice; it may then have written them where an earlier
    /// chunk was, and must refuse to be completed afterwards (the engine fails the checkpoint
    /// on such a chunk; an image writer's commit refuses).
    fn write_chunk_proving(
        &self,
        buffer: u64,
        offset: u64,
        data: &[u8],
        expect: Option<Fingerprint>,
    ) -> Result<Proof, ImageError> {
        let fp = crate::fingerprint::of(data);
        if expect.is_some_and(|e| e != fp) {
            return Ok(Err(fp));
        }
        self.write_chunk_fp(buffer, offset, data, fp)?;
        Ok(Ok(fp))
    }
    /// Stores the chunk of `buffer` at `offset`, `len` bytes whose fingerprint is `fp`, by
    /// reference to equal bytes an earlier image holds (a parent image: [`ImageWriter`]'s
    /// `parent`) instead of a copy. `Ok(true)`: the chunk is in this sink now (replacing an
    /// earlier one at the same place); `Ok(false)`: the sink has no such bytes, the caller copies
    /// them.
    ///
    /// [`ImageWriter`]: crate::image::ImageWriter
    fn reuse_chunk(
        &self,
        buffer: u64,
        offset: u64,
        len: u64,
        fp: Fingerprint,
    ) -> Result<bool, ImageError> {
        let _ = (buffer, offset, len, fp);
        Ok(false)
    }
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
    /// The fingerprint recorded with the chunk of `buffer` at `offset`, if the source has one:
    /// a restore fingerprints the bytes it loaded into device memory and refuses a chunk whose
    /// fingerprint differs.
    fn fingerprint(&self, buffer: u64, offset: u64) -> Option<Fingerprint> {
        let _ = (buffer, offset);
        None
    }
}

/// A chunk a [`MemStore`] holds.
#[derive(Debug, Clone)]
struct MemChunk {
    data: Arc<[u8]>,
    /// Its fingerprint (given to `write_chunk_fp`, else computed).
    fp: Fingerprint,
    /// Taken from the parent store by [`ChunkSink::reuse_chunk`] (its bytes shared, not copied).
    reused: bool,
}

#[derive(Default, Debug)]
struct MemInner {
    buffers: BTreeMap<u64, BufferRecord>,
    chunks: HashMap<u64, BTreeMap<u64, MemChunk>>,
    meta: BTreeMap<String, String>,
}

/// An image held in host memory: for tests, and for a checkpoint that never leaves the process.
///
/// Every chunk has a fingerprint (the one given to [`ChunkSink::write_chunk_fp`], or computed by
/// [`ChunkSink::write_chunk`]), which [`ChunkSource::fingerprint`] returns. A store made with
/// [`MemStore::with_parent`] takes a chunk the parent holds (same length and fingerprint) by
/// sharing its bytes ([`ChunkSink::reuse_chunk`]).
#[derive(Default, Debug)]
pub struct MemStore {
    inner: Mutex<MemInner>,
    /// The parent store, if any.
    parent: Option<Arc<MemStore>>,
    /// The parent's chunks by (fingerprint, length), as of [`MemStore::with_parent`].
    by_fp: HashMap<(Fingerprint, u64), Arc<[u8]>>,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store whose [`ChunkSink::reuse_chunk`] takes chunks from `parent` (an earlier
    /// checkpoint of the same job): those it holds when this is called, found by length and
    /// fingerprint, shared (the same `Arc`), not copied. Chunks `parent` itself took from its
    /// parent are among them.
    pub fn with_parent(parent: Arc<MemStore>) -> Self {
        let mut by_fp = HashMap::new();
        for c in parent.inner.lock().chunks.values().flat_map(|c| c.values()) {
            by_fp
                .entry((c.fp, c.data.len() as u64))
                .or_insert_with(|| c.data.clone());
        }
        MemStore {
            inner: Mutex::default(),
            parent: Some(parent),
            by_fp,
        }
    }

    /// The parent store ([`MemStore::with_parent`]), if any.
    pub fn parent(&self) -> Option<&Arc<MemStore>> {
        self.parent.as_ref()
    }

    /// The whole contents of `buffer`, assembled from its chunks (missing bytes read as zero).
    pub fn buffer_bytes(&self, buffer: u64) -> Option<Vec<u8>> {
        let inner = self.inner.lock();
        let rec = inner.buffers.get(&buffer)?;
        let mut out = vec![0u8; usize::try_from(rec.size).ok()?];
        if let Some(chunks) = inner.chunks.get(&buffer) {
            for (&off, c) in chunks {
                let off = usize::try_from(off).ok()?;
                out[off..off + c.data.len()].copy_from_slice(&c.data);
            }
        }
        Some(out)
    }

    /// Total bytes of chunk data held (those shared with the parent included).
    pub fn bytes(&self) -> u64 {
        self.sum(|_| true)
    }

    /// Bytes of the chunks held now that were taken from the parent ([`ChunkSink::reuse_chunk`])
    /// rather than copied (a reused chunk written again later no longer counts).
    pub fn reused_bytes(&self) -> u64 {
        self.sum(|c| c.reused)
    }

    fn sum(&self, which: impl Fn(&MemChunk) -> bool) -> u64 {
        let inner = self.inner.lock();
        inner
            .chunks
            .values()
            .flat_map(|c| c.values())
            .filter(|c| which(c))
            .map(|c| c.data.len() as u64)
            .sum()
    }

    /// Stores `chunk` as the chunk of `buffer` at `offset`, if it fits in a declared buffer.
    fn put(&self, buffer: u64, offset: u64, chunk: MemChunk) -> Result<(), ImageError> {
        let mut inner = self.inner.lock();
        let Some(rec) = inner.buffers.get(&buffer) else {
            return Err(ImageError::UnknownBuffer { buffer });
        };
        let len = chunk.data.len() as u64;
        if !matches!(offset.checked_add(len), Some(end) if end <= rec.size) {
            return Err(ImageError::ChunkOutOfRange {
                buffer,
                offset,
                len,
            });
        }
        inner
            .chunks
            .entry(buffer)
            .or_default()
            .insert(offset, chunk);
        Ok(())
    }

    fn chunk(&self, buffer: u64, offset: u64) -> Option<MemChunk> {
        let inner = self.inner.lock();
        inner.chunks.get(&buffer)?.get(&offset).cloned()
    }
}

impl ChunkSink for MemStore {
    fn add_buffer(&self, rec: BufferRecord) -> Result<(), ImageError> {
        let mut inner = self.inner.lock();
        let rec = keep_rank(inner.buffers.get(&rec.id), rec);
        inner.buffers.insert(rec.id, rec);
        Ok(())
    }

    /// Stores a copy of `data` with its fingerprint (computed here).
    fn write_chunk(&self, buffer: u64, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        self.write_chunk_fp(buffer, offset, data, crate::fingerprint::of(data))
    }

    fn write_chunk_fp(
        &self,
        buffer: u64,
        offset: u64,
        data: &[u8],
        fp: Fingerprint,
    ) -> Result<(), ImageError> {
        // Copy outside the lock: several writer threads copy at once.
        let data: Arc<[u8]> = Arc::from(data);
        let chunk = MemChunk {
            data,
            fp,
            reused: false,
        };
        self.put(buffer, offset, chunk)
    }

    /// Takes the parent's chunk of `len` bytes with fingerprint `fp`, if it has one.
    fn reuse_chunk(
        &self,
        buffer: u64,
        offset: u64,
        len: u64,
        fp: Fingerprint,
    ) -> Result<bool, ImageError> {
        let Some(data) = self.by_fp.get(&(fp, len)) else {
            return Ok(false);
        };
        let chunk = MemChunk {
            data: data.clone(),
            fp,
            reused: true,
        };
        self.put(buffer, offset, chunk)?;
        Ok(true)
    }

    fn set_meta(&self, key: &str, value: &str) -> Result<(), ImageError> {
        self.inner
            .lock()
            .meta
            .insert(key.to_owned(), value.to_owned());
        Ok(())
    }
}

/// A sink over a [`MemStore`] that calls `tap` with each chunk's buffer before storing it (an
/// `Err` fails the write): tests hold a checkpoint's writes, fail them or watch them with it.
pub struct TapSink<F> {
    /// Where the chunks go.
    pub store: Arc<MemStore>,
    /// Called before each chunk is stored.
    pub tap: F,
}

impl<F> std::fmt::Debug for TapSink<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TapSink")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl<F> ChunkSink for TapSink<F>
where
    F: Fn(u64) -> Result<(), ImageError> + Send + Sync,
{
    fn add_buffer(&self, rec: BufferRecord) -> Result<(), ImageError> {
        self.store.add_buffer(rec)
    }
    fn write_chunk(&self, buffer: u64, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        (self.tap)(buffer)?;
        self.store.write_chunk(buffer, offset, data)
    }
    fn set_meta(&self, key: &str, value: &str) -> Result<(), ImageError> {
        self.store.set_meta(key, value)
    }
}

impl MemStore {
    /// The buffer a restore of this store reaches last: the greatest prefetch rank (then id).
    pub fn last_in_prefetch_order(&self) -> Option<BufferRecord> {
        self.buffers()
            .into_iter()
            .max_by_key(|r| (r.prefetch_rank, r.id))
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
            .map(|c| c.iter().map(|(&o, c)| (o, c.data.len() as u64)).collect())
            .unwrap_or_default()
    }

    fn read_chunk(&self, buffer: u64, offset: u64, dst: &mut [u8]) -> Result<(), ImageError> {
        let data = self
            .chunk(buffer, offset)
            .ok_or(ImageError::MissingChunk { buffer, offset })?
            .data;
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

    fn fingerprint(&self, buffer: u64, offset: u64) -> Option<Fingerprint> {
        self.chunk(buffer, offset).map(|c| c.fp)
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

    /// Saves only the chunks at `offsets` (each `chunk` bytes, a buffer's last one shorter) of
    /// the `size` bytes of buffer `buffer` at `at`, for a copy that holds the job (nothing writes
    /// the buffer meanwhile), of which only those chunks changed: returns once they are in the
    /// image, the rest of the buffer left as the sink holds it. A saver that takes whole buffers
    /// only says so; on any error the engine saves those chunks through its staging instead.
    fn save_chunks(
        &self,
        buffer: u64,
        at: crate::device::DevPtr,
        size: u64,
        (offsets, chunk): (&[u64], u64),
    ) -> Result<(), String> {
        let _ = (buffer, at, size, offsets, chunk);
        Err("this saver takes whole buffers only".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::of;

    fn buf(id: u64, size: u64) -> BufferRecord {
        BufferRecord {
            id,
            va: 0x1000 * id,
            size,
            prefetch_rank: 0,
        }
    }

    fn bytes(seed: u8, len: usize) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect()
    }

    #[test]
    fn mem_store_records_fingerprints() {
        let s = MemStore::new();
        s.add_buffer(buf(1, 300)).unwrap();
        s.write_chunk(1, 0, &bytes(1, 100)).unwrap();
        s.write_chunk_fp(1, 100, &bytes(2, 200), Fingerprint([7, 8]))
            .unwrap();
        assert_eq!(s.fingerprint(1, 0), Some(of(&bytes(1, 100))));
        // Recorded as given (a restore's check compares the loaded bytes with it).
        assert_eq!(s.fingerprint(1, 100), Some(Fingerprint([7, 8])));
        assert_eq!(s.fingerprint(1, 50), None);
        assert_eq!(s.fingerprint(2, 0), None);
        assert_eq!(s.reused_bytes(), 0);
        assert!(s.parent().is_none());
        // A store without a parent reuses nothing.
        assert!(!s.reuse_chunk(1, 0, 100, of(&bytes(1, 100))).unwrap());
        // Out of range is refused, overflow included.
        assert!(s.write_chunk(1, u64::MAX, &[1]).is_err());
        assert!(s.write_chunk(2, 0, &[1]).is_err());
    }

    #[test]
    fn mem_store_with_parent_shares_equal_chunks_down_a_chain() {
        let p = Arc::new(MemStore::new());
        p.add_buffer(buf(1, 300)).unwrap();
        for k in 0..3u8 {
            p.write_chunk(1, u64::from(k) * 100, &bytes(k, 100))
                .unwrap();
        }
        let c = Arc::new(MemStore::with_parent(p.clone()));
        assert!(Arc::ptr_eq(c.parent().unwrap(), &p));
        c.add_buffer(buf(1, 300)).unwrap();
        // Chunk 0 unchanged, chunk 1 changed, chunk 2 moved to buffer 2.
        assert!(c.reuse_chunk(1, 0, 100, of(&bytes(0, 100))).unwrap());
        assert!(!c.reuse_chunk(1, 100, 100, of(&bytes(9, 100))).unwrap());
        c.write_chunk(1, 100, &bytes(9, 100)).unwrap();
        assert!(
            !c.reuse_chunk(1, 200, 99, of(&bytes(2, 100))).unwrap(),
            "length differs"
        );
        c.write_chunk(1, 200, &bytes(3, 100)).unwrap();
        c.add_buffer(buf(2, 100)).unwrap();
        assert!(c.reuse_chunk(2, 0, 100, of(&bytes(2, 100))).unwrap());
        // Checked as a write is.
        assert!(c.reuse_chunk(3, 0, 100, of(&bytes(0, 100))).is_err());
        assert_eq!(c.reused_bytes(), 200);
        assert_eq!(c.bytes(), 400);
        {
            let (pi, ci) = (p.inner.lock(), c.inner.lock());
            // The same bytes, not a copy.
            assert!(Arc::ptr_eq(
                &ci.chunks[&1][&0].data,
                &pi.chunks[&1][&0].data
            ));
            assert!(Arc::ptr_eq(
                &ci.chunks[&2][&0].data,
                &pi.chunks[&1][&200].data
            ));
        }
        let mut want = bytes(0, 100);
        want.extend(bytes(9, 100));
        want.extend(bytes(3, 100));
        assert_eq!(c.buffer_bytes(1).unwrap(), want);
        assert_eq!(c.buffer_bytes(2).unwrap(), bytes(2, 100));
        let mut dst = vec![0u8; 100];
        c.read_chunk(2, 0, &mut dst).unwrap();
        assert_eq!(dst, bytes(2, 100));
        assert_eq!(c.fingerprint(2, 0), Some(of(&bytes(2, 100))));

        // A grandchild finds the grandparent's bytes through the child (which shares them).
        let g = MemStore::with_parent(c.clone());
        g.add_buffer(buf(1, 300)).unwrap();
        assert!(g.reuse_chunk(1, 0, 100, of(&bytes(0, 100))).unwrap());
        assert!(g.reuse_chunk(1, 100, 100, of(&bytes(9, 100))).unwrap());
        // Not chunk 1 of the grandparent: the child no longer holds it.
        assert!(!g.reuse_chunk(1, 200, 100, of(&bytes(1, 100))).unwrap());
        g.write_chunk(1, 200, &bytes(1, 100)).unwrap();
        assert_eq!(g.reused_bytes(), 200);
        // A reused chunk written again is no longer held by reference.
        g.write_chunk(1, 0, &bytes(0, 100)).unwrap();
        assert_eq!(g.reused_bytes(), 100);
        let gi = g.inner.lock();
        let pi = p.inner.lock();
        assert!(!Arc::ptr_eq(
            &gi.chunks[&1][&0].data,
            &pi.chunks[&1][&0].data
        ));
    }
}
