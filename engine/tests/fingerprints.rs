//! Proof by content on the host backend: pre-copy rounds and final copies take the chunks whose
//! fingerprint changed, whatever the hooks saw; a committed image equals the buffers at T0; a
//! restore checks every chunk it loads against the fingerprint its image recorded.

use std::sync::Arc;

use possum_engine::device::{DevPtr, Device, StreamPriority};
use possum_engine::fingerprint::{self, Fingerprint};
use possum_engine::host::HostDevice;
use possum_engine::image::ImageError;
use possum_engine::store::{BufferRecord, ChunkSink, ChunkSource, MemStore};
use possum_engine::{Access, Engine, EngineConfig, EngineError};
use proptest::prelude::*;

const CHUNK: usize = 4096;
const BUF: u64 = 64 << 10;

fn setup(
    n: usize,
) -> (
    Arc<HostDevice>,
    Engine<HostDevice>,
    Vec<possum_engine::Buffer>,
) {
    let dev = Arc::new(HostDevice::new(1 << 30));
    let cfg = EngineConfig {
        chunk_size: CHUNK,
        staging_buffers: 4,
        ..EngineConfig::default()
    };
    let e = Engine::new(dev.clone(), cfg).unwrap();
    let bufs: Vec<_> = (0..n).map(|_| e.alloc(BUF).unwrap()).collect();
    for (i, b) in bufs.iter().enumerate() {
        let bytes: Vec<u8> = (0..BUF).map(|j| (j as usize * 7 + i * 13) as u8).collect();
        dev.write_now(b.va(), &bytes).unwrap();
    }
    (dev, e, bufs)
}

fn poke(dev: &HostDevice, b: &possum_engine::Buffer, off: u64, bytes: &[u8]) {
    dev.write_now(DevPtr(b.va().0 + off), bytes).unwrap();
}

fn contents(dev: &HostDevice, bufs: &[possum_engine::Buffer]) -> Vec<Vec<u8>> {
    bufs.iter()
        .map(|b| dev.read_now(b.va(), b.size()).unwrap())
        .collect()
}

/// Rounds send what changed, chunk by chunk, even where no hook said so; the final copy (T0)
/// takes only the chunks that differ from what the rounds sent, and the image is the state at T0.
#[test]
fn rounds_and_the_final_copy_take_only_the_chunks_that_changed() {
    let (dev, e, bufs) = setup(4);
    let store = Arc::new(MemStore::new());
    e.mark_all_dirty();
    let r1 = e.precopy_round(store.clone()).unwrap();
    assert_eq!(r1.bytes, 4 * BUF);
    assert_eq!(r1.prints.fingerprinted_bytes, 4 * BUF);
    // Unseen writes of a few bytes, in two chunks of two buffers.
    poke(&dev, &bufs[0], 5 * CHUNK as u64 + 17, &[1, 2, 3]);
    poke(&dev, &bufs[2], 0, &[9]);
    let r2 = e.precopy_round(store.clone()).unwrap();
    assert_eq!(r2.bytes, 2 * CHUNK as u64, "only the two chunks written");
    assert_eq!(r2.buffers, 2);
    assert_eq!(r2.prints.proven_bytes, 4 * BUF - 2 * CHUNK as u64);
    // Nothing changed: nothing sent.
    assert_eq!(e.precopy_round(store.clone()).unwrap().bytes, 0);
    // One more unseen write, then T0: the final copy takes that chunk alone.
    poke(&dev, &bufs[3], BUF - 1, &[0xaa]);
    let fin = e.checkpoint(store.clone(), true).unwrap().wait().unwrap();
    assert_eq!(fin.bytes, CHUNK as u64);
    assert_eq!(fin.mismatches, 0);
    let want = contents(&dev, &bufs);
    for (b, w) in bufs.iter().zip(&want) {
        assert_eq!(&store.buffer_bytes(b.id()).unwrap(), w, "buffer {}", b.id());
    }
}

/// A new sink (`mark_all_dirty`) forgets what earlier rounds sent: its first round takes
/// everything again.
#[test]
fn a_new_sink_starts_from_nothing() {
    let (_dev, e, _bufs) = setup(2);
    let first = Arc::new(MemStore::new());
    e.mark_all_dirty();
    e.precopy_round(first).unwrap();
    let second = Arc::new(MemStore::new());
    e.mark_all_dirty();
    assert_eq!(e.precopy_round(second).unwrap().bytes, 2 * BUF);
}

/// A source whose recorded fingerprint of one chunk is not its bytes' (a chunk changed on disk
/// past its CRC, or loaded wrong).
struct Lying {
    inner: Arc<MemStore>,
    buffer: u64,
    offset: u64,
}

impl ChunkSource for Lying {
    fn buffers(&self) -> Vec<BufferRecord> {
        self.inner.buffers()
    }
    fn chunks(&self, buffer: u64) -> Vec<(u64, u64)> {
        self.inner.chunks(buffer)
    }
    fn read_chunk(&self, buffer: u64, offset: u64, dst: &mut [u8]) -> Result<(), ImageError> {
        self.inner.read_chunk(buffer, offset, dst)
    }
    fn meta(&self, key: &str) -> Option<String> {
        self.inner.meta(key)
    }
    fn fingerprint(&self, buffer: u64, offset: u64) -> Option<Fingerprint> {
        let fp = self.inner.fingerprint(buffer, offset)?;
        if (buffer, offset) == (self.buffer, self.offset) {
            return Some(Fingerprint([fp.0[0] ^ 1, fp.0[1]]));
        }
        Some(fp)
    }
}

/// Every chunk a restore loads is fingerprinted on the device against its image's record: all of
/// them pass when the image is right, and the one whose record differs fails its buffer's
/// restore, named.
#[test]
fn a_restore_checks_what_it_loaded_against_the_image() {
    let (dev, e, bufs) = setup(3);
    let store = Arc::new(MemStore::new());
    e.checkpoint(store.clone(), false).unwrap().wait().unwrap();
    assert_eq!(
        store.fingerprint(bufs[1].id(), 0),
        Some(fingerprint::of(
            &dev.read_now(bufs[1].va(), CHUNK as u64).unwrap()
        )),
        "the store keeps the fingerprint of what was copied"
    );
    let want = contents(&dev, &bufs);
    e.release().unwrap();
    let r = e.restore(store.clone()).unwrap().wait().unwrap();
    assert_eq!(r.verified_bytes, 3 * BUF);
    assert_eq!(contents(&dev, &bufs), want);
    // Again, from a source that lies about one chunk.
    e.release().unwrap();
    let lying = Arc::new(Lying {
        inner: store,
        buffer: bufs[2].id(),
        offset: 3 * CHUNK as u64,
    });
    let err = e.restore(lying).unwrap().wait().unwrap_err().to_string();
    assert!(
        err.contains(&format!("offset {}", 3 * CHUNK)) && err.contains("refused"),
        "{err}"
    );
}

/// A sink that holds an earlier image's chunks by fingerprint, as an image with a parent does.
#[derive(Default)]
struct WithParent {
    own: MemStore,
    parent: std::collections::HashMap<Fingerprint, Vec<u8>>,
    reused: std::sync::atomic::AtomicU64,
}

impl ChunkSink for WithParent {
    fn add_buffer(&self, rec: BufferRecord) -> Result<(), ImageError> {
        self.own.add_buffer(rec)
    }
    fn write_chunk(&self, buffer: u64, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        self.own.write_chunk(buffer, offset, data)
    }
    fn set_meta(&self, key: &str, value: &str) -> Result<(), ImageError> {
        self.own.set_meta(key, value)
    }
    fn reuse_chunk(
        &self,
        buffer: u64,
        offset: u64,
        len: u64,
        fp: Fingerprint,
    ) -> Result<bool, ImageError> {
        match self.parent.get(&fp).filter(|d| d.len() as u64 == len) {
            Some(d) => {
                self.own.write_chunk(buffer, offset, d)?;
                self.reused
                    .fetch_add(len, std::sync::atomic::Ordering::Relaxed);
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

/// A checkpoint beside an earlier image takes from it every chunk whose fingerprint it holds and
/// copies the rest: the second checkpoint of a job that changed one chunk copies one chunk.
#[test]
fn a_checkpoint_with_a_parent_copies_only_what_differs() {
    let (dev, e, bufs) = setup(4);
    let first = Arc::new(MemStore::new());
    let r = e.checkpoint(first.clone(), false).unwrap().wait().unwrap();
    assert_eq!(r.bytes, 4 * BUF);
    poke(&dev, &bufs[1], 2 * CHUNK as u64, &[7, 7]);
    let mut parent = std::collections::HashMap::new();
    for b in &bufs {
        let bytes = first.buffer_bytes(b.id()).unwrap();
        for c in bytes.chunks(CHUNK) {
            parent.insert(fingerprint::of(c), c.to_vec());
        }
    }
    let second = Arc::new(WithParent {
        parent,
        ..WithParent::default()
    });
    let r = e.checkpoint(second.clone(), false).unwrap().wait().unwrap();
    assert_eq!(r.bytes, CHUNK as u64);
    assert_eq!(r.reused_bytes, 4 * BUF - CHUNK as u64);
    let want = contents(&dev, &bufs);
    for (b, w) in bufs.iter().zip(&want) {
        assert_eq!(&second.own.buffer_bytes(b.id()).unwrap(), w);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Random unseen writes (a few bytes at random offsets, between and during the rounds):
    /// whatever happens, a final copy that commits holds exactly the buffers at T0.
    #[test]
    fn a_committed_image_is_the_state_at_t0(
        writes in proptest::collection::vec((0usize..3, 0u64..BUF, 1usize..9, 0u8..3), 0..24),
    ) {
        let (dev, e, bufs) = setup(3);
        let store = Arc::new(MemStore::new());
        e.mark_all_dirty();
        for (i, (b, off, n, when)) in writes.iter().enumerate() {
            let off = (*off).min(BUF - *n as u64);
            poke(&dev, &bufs[*b], off, &vec![i as u8 ^ 0x5a; *n]);
            if *when == 0 {
                e.precopy_round(store.clone()).unwrap();
            }
        }
        let want = contents(&dev, &bufs);
        match e.checkpoint(store.clone(), true).unwrap().wait() {
            Ok(_) => {
                for (b, w) in bufs.iter().zip(&want) {
                    prop_assert_eq!(&store.buffer_bytes(b.id()).unwrap(), w);
                }
            }
            // Nothing writes after T0 here: a mismatch would be a false alarm.
            Err(EngineError::Mismatch { .. }) => prop_assert!(false, "mismatch without a write"),
            Err(other) => prop_assert!(false, "{}", other),
        }
    }
}

/// A kept (snapshot) checkpoint proven by fingerprints copies nothing while the job is held: a
/// write the hooks see right after T0, to the buffer the job is predicted to write, is met by
/// copy-on-write, and the image is the state at T0.
#[test]
fn a_proven_snapshot_copies_nothing_while_held() {
    let (dev, e, bufs) = setup(4);
    e.set_shadow_budget(64 << 20);
    e.set_save_order(vec![bufs[2].id()]);
    let s = dev.create_stream(StreamPriority::Normal).unwrap();
    e.register_stream(s.clone());
    let want = contents(&dev, &bufs);
    let store = Arc::new(MemStore::new());
    let ck = e.checkpoint_snapshot(store.clone()).unwrap();
    let written = [bufs[2].clone()];
    let g = e
        .before_op(
            &s,
            Access::Known {
                reads: &[],
                writes: &written,
            },
        )
        .unwrap();
    let (va, size) = (bufs[2].va(), bufs[2].size());
    dev.launch(&s, move |mem| {
        mem.with(&[], &[(va, size)], |_, o| o[0].fill(0x5a))
    })
    .unwrap();
    drop(g);
    let r = ck.wait().unwrap();
    assert_eq!(r.snapshot_shadows, 0, "{r:?}");
    assert_eq!(r.predicted_first, 1);
    assert_eq!(r.mismatches, 0, "{r:?}");
    for (b, w) in bufs.iter().zip(&want) {
        assert_eq!(&store.buffer_bytes(b.id()).unwrap(), w);
    }
    dev.synchronize(&s).unwrap();
    assert!(dev.read_now(va, size).unwrap().iter().all(|&x| x == 0x5a));
}

/// A copy torn after T0 reaching an image writer (its fingerprint computed as it is written):
/// the checkpoint fails as a mismatch, and the image, whose data file may hold those bytes, is
/// never committed.
#[test]
fn a_torn_copy_spoils_the_image_it_reached() {
    use possum_engine::image::{ImageWriter, WriterOptions};
    /// An image writer whose every chunk arrives with one byte changed.
    struct Torn(Arc<ImageWriter>);
    impl ChunkSink for Torn {
        fn add_buffer(&self, rec: BufferRecord) -> Result<(), ImageError> {
            self.0.add_buffer(rec)
        }
        fn write_chunk(&self, buffer: u64, offset: u64, data: &[u8]) -> Result<(), ImageError> {
            self.0.write_chunk(buffer, offset, data)
        }
        fn set_meta(&self, key: &str, value: &str) -> Result<(), ImageError> {
            self.0.set_meta(key, value)
        }
        fn write_chunk_proving(
            &self,
            buffer: u64,
            offset: u64,
            data: &[u8],
            expect: Option<Fingerprint>,
        ) -> Result<possum_engine::store::Proof, ImageError> {
            let mut torn = data.to_vec();
            torn[0] ^= 1;
            self.0.write_chunk_proving(buffer, offset, &torn, expect)
        }
    }
    let (_dev, e, _bufs) = setup(2);
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("img");
    let opts = WriterOptions {
        fsync: false,
        ..WriterOptions::default()
    };
    let w = Arc::new(ImageWriter::create(&dir, opts).unwrap());
    let err = (e.checkpoint_held(Arc::new(Torn(w.clone())), false))
        .and_then(|h| h.wait())
        .unwrap_err();
    assert!(matches!(err, EngineError::Mismatch { .. }), "{err}");
    let w = Arc::try_unwrap(w).unwrap();
    assert!(matches!(w.commit(), Err(ImageError::Spoiled { .. })));
    assert!(!dir.exists());
}
