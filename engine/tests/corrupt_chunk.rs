//! A chunk whose bytes in an image's data file do not match its checksum never reaches the job:
//! not through a restore waited for before the job runs again, and not through a buffer the job
//! asks for on demand while the restore goes on. The device here records every host-to-device
//! copy, so the tests see what was written to device memory, not only what the engine reports.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use possum_engine::device::{DevPtr, Device, DeviceResult, HostBuffer, StreamPriority};
use possum_engine::host::{HostBuf, HostDevice, HostEvent, HostPending, HostStream};
use possum_engine::image::{Image, ImageWriter, WriterOptions};
use possum_engine::store::ChunkSource;
use possum_engine::{Access, Buffer, Engine, EngineConfig, Residency, Staged, StagedMemory};

/// The host device, with a record of every host-to-device copy (and of every write by the
/// memory's owner in a staged restore): (destination, bytes).
#[derive(Debug)]
struct Recording {
    dev: HostDevice,
    h2d: Mutex<Vec<(u64, Vec<u8>)>>,
}

impl Recording {
    /// A write into device memory by its owner (a keeper loading a staged restore), recorded.
    fn owner_write(&self, va: u64, bytes: &[u8]) -> Result<(), String> {
        self.h2d.lock().push((va, bytes.to_vec()));
        self.dev
            .write_now(DevPtr(va), bytes)
            .map_err(|e| e.to_string())
    }

    /// Whether any copy wrote a byte of `va .. va + len`.
    fn wrote_into(&self, va: u64, len: u64) -> bool {
        self.h2d
            .lock()
            .iter()
            .any(|(at, bytes)| *at < va + len && va < *at + bytes.len() as u64)
    }
}

impl Device for Recording {
    type Stream = HostStream;
    type Event = HostEvent;
    type HostBuf = HostBuf;
    type Pending = HostPending;

    fn name(&self) -> String {
        self.dev.name()
    }
    fn granularity(&self) -> u64 {
        self.dev.granularity()
    }
    fn memory_info(&self) -> DeviceResult<(u64, u64)> {
        self.dev.memory_info()
    }
    fn reserve(&self, size: u64) -> DeviceResult<DevPtr> {
        self.dev.reserve(size)
    }
    fn unreserve(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        self.dev.unreserve(va, size)
    }
    fn map(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        self.dev.map(va, size)
    }
    fn adopt_reservation(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        self.dev.adopt_reservation(va, size)
    }
    fn unmap(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        self.dev.unmap(va, size)
    }
    fn keeps_memory(&self) -> bool {
        self.dev.keeps_memory()
    }
    fn begin_detach(&self, hold_secs: u64) {
        self.dev.begin_detach(hold_secs)
    }
    fn detach(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        self.dev.detach(va, size)
    }
    fn reattach(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        self.dev.reattach(va, size)
    }
    fn expect_kept(&self, va: DevPtr, size: u64, id: u64, epoch: u64) -> DeviceResult<()> {
        self.dev.expect_kept(va, size, id, epoch)
    }
    fn forget(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        self.dev.forget(va, size)
    }
    fn alloc_host(&self, len: usize) -> DeviceResult<HostBuf> {
        self.dev.alloc_host(len)
    }
    fn create_stream(&self, priority: StreamPriority) -> DeviceResult<HostStream> {
        self.dev.create_stream(priority)
    }
    fn copy_d2h(
        &self,
        stream: &HostStream,
        src: DevPtr,
        dst: HostBuf,
        len: u64,
    ) -> DeviceResult<HostPending> {
        self.dev.copy_d2h(stream, src, dst, len)
    }
    fn copy_h2d(
        &self,
        stream: &HostStream,
        src: HostBuf,
        dst: DevPtr,
        len: u64,
    ) -> DeviceResult<HostPending> {
        let bytes = src.as_slice()[..len as usize].to_vec();
        self.h2d.lock().push((dst.0, bytes));
        self.dev.copy_h2d(stream, src, dst, len)
    }
    fn copy_d2d(
        &self,
        stream: &HostStream,
        src: DevPtr,
        dst: DevPtr,
        len: u64,
    ) -> DeviceResult<()> {
        self.dev.copy_d2d(stream, src, dst, len)
    }
    fn record_event(&self, stream: &HostStream) -> DeviceResult<HostEvent> {
        self.dev.record_event(stream)
    }
    fn wait_event(&self, stream: &HostStream, event: &HostEvent) -> DeviceResult<()> {
        self.dev.wait_event(stream, event)
    }
    fn event_synchronize(&self, event: &HostEvent) -> DeviceResult<()> {
        self.dev.event_synchronize(event)
    }
    fn event_query(&self, event: &HostEvent) -> DeviceResult<bool> {
        self.dev.event_query(event)
    }
    fn synchronize(&self, stream: &HostStream) -> DeviceResult<()> {
        self.dev.synchronize(stream)
    }
    fn synchronize_device(&self) -> DeviceResult<()> {
        self.dev.synchronize_device()
    }
}

const CHUNK: u64 = 4096;
/// Three chunks and a short one.
const SIZE: u64 = 3 * CHUNK + 100;

/// Bytes no two places of any buffer share (a 64-bit mix of buffer and position).
fn contents(buffer: u64) -> Vec<u8> {
    (0..SIZE)
        .map(|i| {
            let mut x = (buffer << 32 | i).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            x ^= x >> 29;
            x.wrapping_mul(0xbf58_476d_1ce4_e5b9).to_le_bytes()[7]
        })
        .collect()
}

struct Setup {
    engine: Engine<Recording>,
    buffers: Vec<Buffer>,
    image: PathBuf,
    _root: tempfile::TempDir,
}

/// A job of `n` buffers checkpointed into an image on disk, then released; the chunk at offset
/// `CHUNK` of buffer `bad` has one byte flipped in the image's data file.
fn checkpointed(n: usize, bad: usize, prefetch_delay: Duration) -> Setup {
    checkpointed_on(HostDevice::new(64 << 20), n, bad, prefetch_delay)
}

fn checkpointed_on(dev: HostDevice, n: usize, bad: usize, prefetch_delay: Duration) -> Setup {
    let dev = Arc::new(Recording {
        dev,
        h2d: Mutex::new(Vec::new()),
    });
    let engine = Engine::new(
        dev,
        EngineConfig {
            chunk_size: CHUNK as usize,
            staging_buffers: 4,
            copy_streams: 2,
            writer_threads: 2,
            restore_threads: 2,
            prefetch_delay,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let buffers: Vec<Buffer> = (0..n).map(|_| engine.alloc(SIZE).unwrap()).collect();
    for b in &buffers {
        engine
            .device()
            .dev
            .write_now(b.va(), &contents(b.id()))
            .unwrap();
    }
    let root = tempfile::tempdir().unwrap();
    let image = root.path().join("img");
    let writer = Arc::new(
        ImageWriter::create(
            &image,
            WriterOptions {
                data_files: 1,
                fsync: false,
                ..WriterOptions::default()
            },
        )
        .unwrap(),
    );
    engine
        .checkpoint(writer.clone(), false)
        .unwrap()
        .wait()
        .unwrap();
    Arc::into_inner(writer).unwrap().commit().unwrap();
    engine.release().unwrap();
    engine.device().h2d.lock().clear();

    // Find the chunk's bytes in the data file (they are unique) and flip one of them.
    let want = &contents(buffers[bad].id())[CHUNK as usize..CHUNK as usize + 64];
    flip_after(
        &image.join("data-000.bin"),
        want,
        "the chunk is in the data file",
    );
    Setup {
        engine,
        buffers,
        image,
        _root: root,
    }
}

fn open(image: &Path) -> Arc<Image> {
    // Opening checks the manifest only: the flipped byte is found when its chunk is read.
    Arc::new(Image::open(image).expect("the manifest is intact"))
}

/// An operation on a new stream of `e` that reads `bad` (or writes it, with `writes`) is refused
/// naming the corrupt chunk at `CHUNK` of `bad`, which never reached the device, while the chunk
/// before it did; `bad` is released again.
fn stops_at_the_corrupt_chunk(e: &Engine<Recording>, bad: &Buffer, writes: bool) {
    let stream = e.device().create_stream(StreamPriority::Normal).unwrap();
    e.register_stream(stream.clone());
    let one = std::slice::from_ref(bad);
    let (reads, writes) = if writes {
        (&[][..], one)
    } else {
        (one, &[][..])
    };
    let err = match e.before_op(&stream, Access::Known { reads, writes }) {
        Ok(_) => panic!("an operation on the corrupt buffer was let through"),
        Err(err) => err.to_string(),
    };
    names_the_chunk(&err, bad);
    assert!(
        !e.device().wrote_into(bad.va().0 + CHUNK, CHUNK),
        "a corrupt chunk was copied to the device"
    );
    assert!(
        e.device().wrote_into(bad.va().0, CHUNK),
        "the chunk before the corrupt one was not loaded"
    );
    assert_eq!(bad.residency(), Residency::Released);
}

/// Flips the byte 10 past the bytes `want` in data file `data` (`found` says where they are).
fn flip_after(data: &Path, want: &[u8], found: &str) {
    let mut bytes = fs::read(data).unwrap();
    let at = bytes
        .windows(want.len())
        .position(|w| w == want)
        .expect(found);
    bytes[at + 10] ^= 0x01;
    fs::write(data, bytes).unwrap();
}

/// The names an error about the corrupt chunk must carry.
fn names_the_chunk(err: &str, buffer: &Buffer) {
    for part in [
        format!("buffer {}", buffer.id()),
        "data-000.bin".to_string(),
        "checksum mismatch".to_string(),
        format!("offset {CHUNK}"),
    ] {
        assert!(err.contains(&part), "{part:?} missing from: {err}");
    }
}

/// Restore waited for before the job runs: it fails, naming the buffer, the chunk's offset and the
/// data file; no byte of the corrupt chunk reached device memory; the buffer stays released, so
/// the job's operations on it fail; the other buffers are back intact.
#[test]
fn a_corrupt_chunk_fails_a_restore_waited_for_before_the_job_runs() {
    let s = checkpointed(3, 1, Duration::ZERO);
    let e = &s.engine;
    let rs = e.restore(open(&s.image)).unwrap();
    let err = rs.wait().unwrap_err().to_string();
    let bad = &s.buffers[1];
    names_the_chunk(&err, bad);
    assert!(
        !e.device().wrote_into(bad.va().0 + CHUNK, CHUNK),
        "a corrupt chunk was copied to the device"
    );
    assert_eq!(bad.residency(), Residency::Released);
    let stream = e.device().create_stream(StreamPriority::Normal).unwrap();
    e.register_stream(stream.clone());
    let op = e.before_op(
        &stream,
        Access::Known {
            reads: std::slice::from_ref(bad),
            writes: &[],
        },
    );
    assert!(
        op.is_err(),
        "an operation on the corrupt buffer was let through"
    );
    drop(op);
    for b in [&s.buffers[0], &s.buffers[2]] {
        assert_eq!(b.residency(), Residency::Mapped);
        assert_eq!(
            e.device().dev.read_now(b.va(), SIZE).unwrap(),
            contents(b.id())
        );
    }
}

/// The job runs again at once and touches the corrupt buffer before any restorer would have
/// (the prefetch delay holds them back): the hook reads the buffer's chunks itself, the corrupt
/// one fails its check, the job's operation fails with an error naming the buffer and the chunk,
/// and the corrupt bytes were never copied to the device (the chunks before it were, into memory
/// that is unmapped again before anyone may use it).
#[test]
fn a_corrupt_chunk_read_on_demand_never_reaches_the_device() {
    let s = checkpointed(1, 0, Duration::from_secs(600));
    let e = &s.engine;
    let bad = &s.buffers[0];
    let rs = e.restore(open(&s.image)).unwrap();
    stops_at_the_corrupt_chunk(e, bad, true);
    let err = rs.wait().unwrap_err().to_string();
    names_the_chunk(&err, bad);
}

/// The same image without the flipped byte restores completely (the tests above fail for the
/// corrupt chunk, not for their set-up).
#[test]
fn the_same_image_intact_restores() {
    let s = checkpointed(2, 0, Duration::ZERO);
    // Undo the flip.
    let good = contents(s.buffers[0].id());
    let want = &good[CHUNK as usize..CHUNK as usize + 10];
    flip_after(
        &s.image.join("data-000.bin"),
        want,
        "the chunk's first bytes are intact",
    );
    let e = &s.engine;
    e.restore(open(&s.image)).unwrap().wait().unwrap();
    for b in &s.buffers {
        assert_eq!(
            e.device().dev.read_now(b.va(), SIZE).unwrap(),
            contents(b.id())
        );
    }
}

/// The device's owner loading a staged restore as the keeper does: each chunk read from the image
/// (its checksum checked) before it is written to the memory; the first failure ends the load.
struct Owner {
    dev: Arc<Recording>,
    image: Arc<Image>,
    /// Buffer id -> (address, mapped size).
    bufs: HashMap<u64, (u64, u64)>,
    /// The job's own thread has asked for its buffer: until then a restorer asking waits, so
    /// that the test sees the job's thread meet the corrupt chunk itself.
    job_asked: Mutex<bool>,
    job_asked_cv: Condvar,
}

impl Staged for Owner {
    fn memory_of(&self, buffer: u64) -> Option<StagedMemory> {
        let &(_, size) = self.bufs.get(&buffer)?;
        Some(StagedMemory {
            id: buffer + 100,
            epoch: 1,
            size,
        })
    }

    fn wait_loaded(&self, buffer: u64) -> Result<(), String> {
        let restorer = std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("possum-restorer"));
        if restorer {
            let mut asked = self.job_asked.lock();
            while !*asked {
                self.job_asked_cv.wait(&mut asked);
            }
        }
        let r = self.load(buffer);
        if !restorer {
            *self.job_asked.lock() = true;
            self.job_asked_cv.notify_all();
        }
        r
    }

    fn finished(&self) {}
}

impl Owner {
    fn load(&self, buffer: u64) -> Result<(), String> {
        let &(va, _) = self.bufs.get(&buffer).ok_or("not staged")?;
        for (off, len) in self.image.chunks(buffer) {
            let mut bytes = vec![0u8; len as usize];
            self.image
                .read_chunk(buffer, off, &mut bytes)
                .map_err(|e| e.to_string())?;
            self.dev.owner_write(va + off, &bytes)?;
        }
        Ok(())
    }
}

/// A staged restore (the keeper loads the image into the job's memory while CRIU restores the
/// process): the owner's load stops at the corrupt chunk, the engine falls back to copying the
/// buffer itself, its own read of the chunk fails too, and the job's operation fails naming the
/// chunk; neither the owner nor the engine wrote the corrupt bytes to device memory.
#[test]
fn a_corrupt_chunk_in_a_staged_restore_never_reaches_the_device() {
    let s = checkpointed_on(
        HostDevice::keeping(64 << 20),
        1,
        0,
        Duration::from_secs(600),
    );
    let e = &s.engine;
    let bad = &s.buffers[0];
    let image = open(&s.image);
    let owner = Arc::new(Owner {
        dev: Arc::clone(e.device()),
        image: Arc::clone(&image),
        bufs: HashMap::from([(bad.id(), (bad.va().0, bad.mapped_size()))]),
        job_asked: Mutex::new(false),
        job_asked_cv: Condvar::new(),
    });
    let rs = e.restore_staged(image, owner).unwrap();
    stops_at_the_corrupt_chunk(e, bad, false);
    let err = rs.wait().unwrap_err().to_string();
    names_the_chunk(&err, bad);
}
