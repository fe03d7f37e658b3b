//! The engine's protocol against a sequential reference, on the host backend with real concurrency.

use std::sync::Arc;
use std::time::Duration;

use possum_engine::host::HostDevice;
use possum_engine::store::{ChunkSink, ChunkSource, MemStore, TapSink};
use possum_engine::{Access, Engine, EngineConfig, EngineError};
use possum_workloads::host::HostJob;
use possum_workloads::program::{Program, Shape};
use possum_workloads::reference::Reference;
use proptest::prelude::*;

fn engine(cfg: EngineConfig) -> Engine<HostDevice> {
    Engine::new(Arc::new(HostDevice::new(1 << 30)), cfg).unwrap()
}

fn small_cfg(chunk: usize, staging: usize, shadow: u64) -> EngineConfig {
    EngineConfig {
        chunk_size: chunk,
        staging_buffers: staging,
        copy_streams: 2,
        writer_threads: 2,
        restore_threads: 2,
        shadow_budget: shadow,
        ..EngineConfig::default()
    }
}

/// Demo program `seed`, an engine configured by `cfg`, and the job running the program on it.
fn demo_job(seed: u64, cfg: EngineConfig) -> (Program, Engine<HostDevice>, HostJob) {
    let p = demo_program(seed);
    let (e, job) = job_of(&p, cfg);
    (p, e, job)
}

/// An engine configured by `cfg` and a job running `p` on it.
fn job_of(p: &Program, cfg: EngineConfig) -> (Engine<HostDevice>, HostJob) {
    let e = engine(cfg);
    let job = HostJob::new(&e, p).unwrap();
    (e, job)
}

/// The reference state of `p` after `ops`.
fn reference(p: &Program, ops: &[possum_workloads::program::Op]) -> Reference {
    let mut r = Reference::new(p);
    r.run_all(ops);
    r
}

/// A [`serial_cfg`] engine with eight buffers of two chunks each.
fn eight_buffers_serial(mib: usize) -> (Engine<HostDevice>, Vec<possum_engine::Buffer>) {
    let e = engine(serial_cfg(mib));
    let bufs = (0..8).map(|_| e.alloc(2 * mib as u64).unwrap()).collect();
    (e, bufs)
}

/// A device that keeps detached memory, and an engine on it.
fn keeping_engine(cfg: EngineConfig) -> (Arc<HostDevice>, Engine<HostDevice>) {
    let dev = Arc::new(HostDevice::keeping(1 << 30));
    let e = Engine::new(dev.clone(), cfg).unwrap();
    (dev, e)
}

/// [`small_cfg`] without fingerprints: the hooks' write sets alone decide what a copy takes.
fn unprinted_cfg(chunk: usize, staging: usize, shadow: u64) -> EngineConfig {
    EngineConfig {
        fingerprints: false,
        ..small_cfg(chunk, staging, shadow)
    }
}

/// One copy stream and one writer, so the sink sees the buffers in the copier's order.
fn serial_cfg(chunk: usize) -> EngineConfig {
    EngineConfig {
        copy_streams: 1,
        writer_threads: 1,
        ..unprinted_cfg(chunk, 2, 0)
    }
}

/// A stream of normal priority, registered with `e`.
fn registered_stream(e: &Engine<HostDevice>) -> possum_engine::host::HostStream {
    use possum_engine::device::{Device, StreamPriority};
    let s = e.device().create_stream(StreamPriority::Normal).unwrap();
    e.register_stream(s.clone());
    s
}

/// A checkpoint of `e` into `store`, waited for.
fn checkpoint_now(
    e: &Engine<HostDevice>,
    store: &Arc<MemStore>,
) -> possum_engine::CheckpointReport {
    e.checkpoint(store.clone(), false).unwrap().wait().unwrap()
}

/// A new store holding a checkpoint of `e`, waited for.
fn saved(e: &Engine<HostDevice>) -> Arc<MemStore> {
    let store = Arc::new(MemStore::new());
    checkpoint_now(e, &store);
    store
}

/// Whether the image in `store` is the state `at_t0`, and whether `job` holds the state `at_end`.
fn agree_with(
    store: &MemStore,
    job: &HostJob,
    at_t0: &Reference,
    at_end: &Reference,
) -> (bool, bool) {
    (
        image_of(store, job) == at_t0.bufs,
        job.contents().unwrap() == at_end.bufs,
    )
}

/// Issues `ops` on `job`, each expected to succeed.
fn issue_all(job: &mut HostJob, ops: &[possum_workloads::program::Op]) {
    for op in ops {
        job.issue(op).unwrap();
    }
}

/// An operation on stream 0 that writes buffer `idx` and reads nothing.
fn write_op(idx: usize, salt: u64) -> possum_workloads::program::Op {
    possum_workloads::program::Op {
        stream: 0,
        reads: vec![],
        writes: vec![idx],
        salt,
    }
}

fn image_of(store: &MemStore, job: &HostJob) -> Vec<Vec<u8>> {
    job.buffers()
        .iter()
        .map(|b| store.buffer_bytes(b.id()).expect("buffer in image"))
        .collect()
}

fn cases() -> u32 {
    std::env::var("POSSUM_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

/// Checkpoint at op `k` while ops k.. keep running; then release, restore on demand, and re-run k..
/// With `lazy`, the job hooks as the interposer does (buffers only while the engine tracks).
fn checkpoint_restore_case(
    p: &Program,
    k: usize,
    cfg: EngineConfig,
    lazy: bool,
) -> Result<(), TestCaseError> {
    let e = engine(cfg);
    let mut job = HostJob::new(&e, p).unwrap().lazy_hook(lazy);
    let at_t0 = reference(p, &p.ops[..k]);
    let mut at_end = at_t0.clone();
    at_end.run_all(&p.ops[k..]);

    issue_all(&mut job, &p.ops[..k]);
    let store = Arc::new(MemStore::new());
    let ck = e.checkpoint(store.clone(), false).unwrap();
    issue_all(&mut job, &p.ops[k..]);
    let report = ck.wait().unwrap();
    job.sync().unwrap();
    prop_assert_eq!(report.buffers, p.sizes.len());
    prop_assert_eq!(report.bytes, p.bytes());
    let (image_ok, job_ok) = agree_with(&store, &job, &at_t0, &at_end);
    prop_assert!(image_ok, "image differs from the state at T0");
    prop_assert!(job_ok, "job's own run differs from the reference");

    // Fail-over: drop the device memory, restore on demand, redo the work after T0.
    e.release().unwrap();
    job.reset_deps();
    let rs = e.restore(store).unwrap();
    issue_all(&mut job, &p.ops[k..]);
    job.sync().unwrap();
    let rr = rs.wait().unwrap();
    prop_assert_eq!(rr.on_demand + rr.prefetched, p.sizes.len() as u64);
    prop_assert!(
        job.contents().unwrap() == at_end.bufs,
        "restored run differs from an uninterrupted one"
    );
    Ok(())
}

fn shape() -> impl Strategy<Value = (u64, Shape)> {
    (
        any::<u64>(),
        1usize..10,
        1usize..4,
        0usize..48,
        8u64..20_000,
    )
        .prop_map(|(seed, buffers, streams, ops, hi)| {
            (
                seed,
                Shape {
                    buffers,
                    size_range: (8, hi),
                    streams,
                    ops,
                    max_reads: 2,
                    max_writes: 2,
                },
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn concurrent_checkpoint_equals_state_at_t0(
        (seed, shape) in shape(),
        k_frac in 0.0f64..=1.0,
        chunk_pow in 6u32..14,
        staging in 2usize..5,
        shadow in prop_oneof![Just(0u64), Just(1u64 << 20), Just(64 * 1024)],
        lazy in any::<bool>(),
    ) {
        let p = Program::random(seed, &shape);
        let k = ((p.ops.len() as f64) * k_frac) as usize;
        checkpoint_restore_case(&p, k.min(p.ops.len()), small_cfg(1 << chunk_pow, staging, shadow), lazy)?;
    }

    #[test]
    fn precopy_rounds_then_final_checkpoint_equal_state_at_t0(
        (seed, shape) in shape(),
        cuts in proptest::collection::vec(0.0f64..=1.0, 1..4),
        chunk_pow in 6u32..14,
        lazy in any::<bool>(),
        stop_before_final in any::<bool>(),
    ) {
        let p = Program::random(seed, &shape);
        let e = engine(small_cfg(1 << chunk_pow, 3, 0));
        // Lazy: the job's operations before the first round reach the engine unrecorded.
        let mut job = HostJob::new(&e, &p).unwrap().lazy_hook(lazy);
        let store = Arc::new(MemStore::new());
        let mut cuts: Vec<usize> = cuts.iter().map(|c| ((p.ops.len() as f64) * c) as usize).collect();
        cuts.sort_unstable();
        let k = *cuts.last().unwrap();
        let mut done = 0;
        for &c in &cuts[..cuts.len() - 1] {
            let c = c.max(done);
            issue_all(&mut job, &p.ops[done..c]);
            done = c;
            // A round runs while more operations are issued.
            let st = store.clone();
            let e2 = e.clone();
            let round = std::thread::spawn(move || e2.precopy_round(st).unwrap());
            for op in &p.ops[done..(done + 3).min(k)] {
                job.issue(op).unwrap();
            }
            done = (done + 3).min(k);
            round.join().unwrap();
        }
        if stop_before_final {
            // Tracking ended between the rounds and the final copy (an abandoned session):
            // what the job writes now goes unrecorded, and the final copy must take it anyway.
            e.stop_tracking().unwrap();
        }
        issue_all(&mut job, &p.ops[done..k]);
        let ck = e.checkpoint(store.clone(), true).unwrap();
        issue_all(&mut job, &p.ops[k..]);
        ck.wait().unwrap();
        job.sync().unwrap();
        let at_t0 = reference(&p, &p.ops[..k]);
        prop_assert!(image_of(&store, &job) == at_t0.bufs, "pre-copied image differs from the state at T0");
    }
}

fn demo_program(seed: u64) -> Program {
    Program::random(
        seed,
        &Shape {
            buffers: 16,
            size_range: (4096, 65536),
            streams: 3,
            ops: 40,
            max_reads: 2,
            max_writes: 1,
        },
    )
}

#[test]
fn an_operation_overtakes_the_prefetcher() {
    let (p, e, mut job) = demo_job(
        11,
        EngineConfig {
            prefetch_delay: Duration::from_millis(30),
            restore_threads: 1,
            ..small_cfg(4096, 4, 0)
        },
    );
    let store = saved(&e);
    e.release().unwrap();
    // The buffer the prefetcher will reach last.
    let last = store.last_in_prefetch_order().unwrap();
    let idx = job
        .buffers()
        .iter()
        .position(|b| b.id() == last.id)
        .unwrap();
    let rs = e.restore(store.clone()).unwrap();
    let op = write_op(idx, 5);
    job.reset_deps();
    job.issue(&op).unwrap();
    job.sync().unwrap();
    assert!(
        !rs.is_finished(),
        "the prefetcher should still be running (30 ms per buffer)"
    );
    let rr = rs.wait().unwrap();
    assert!(
        rr.on_demand >= 1,
        "the operation's buffer was restored on demand: {rr:?}"
    );
    assert_eq!(
        rr.waited_on.iter().map(|w| w.id).collect::<Vec<_>>(),
        vec![last.id],
        "the job waited on the buffer it wrote, only: {rr:?}"
    );
    assert!(rr.job_waited > Duration::ZERO, "{rr:?}");
    let mut r = Reference::new(&p);
    r.run(&op);
    assert_eq!(job.contents().unwrap(), r.bufs);
}

#[test]
fn many_operations_race_the_prefetcher() {
    let (p, e, mut job) = demo_job(
        12,
        EngineConfig {
            prefetch_delay: Duration::from_millis(2),
            ..small_cfg(4096, 3, 0)
        },
    );
    let store = saved(&e);
    e.release().unwrap();
    job.reset_deps();
    let rs = e.restore(store).unwrap();
    issue_all(&mut job, &p.ops);
    job.sync().unwrap();
    let rr = rs.wait().unwrap();
    assert_eq!(rr.on_demand + rr.prefetched, 16);
    let r = reference(&p, &p.ops);
    assert_eq!(job.contents().unwrap(), r.bufs);
}

#[test]
fn session_active_follows_the_phases() {
    let e = engine(small_cfg(1 << 16, 4, 0));
    let _b = e.alloc(1 << 16).unwrap();
    assert!(!e.session_active());
    let store = Arc::new(MemStore::default());
    checkpoint_now(&e, &store);
    assert!(!e.session_active());
    e.release().unwrap();
    assert!(e.session_active());
    e.restore(store).unwrap().wait().unwrap();
    assert!(!e.session_active());
}

#[test]
fn touching_a_released_buffer_without_restore_is_an_error() {
    let (p, e, mut job) = demo_job(13, small_cfg(4096, 2, 0));
    e.release().unwrap();
    let err = job.issue(&p.ops[0]).unwrap_err();
    assert!(matches!(err, EngineError::Released { .. }), "{err}");
    assert!(err.to_string().contains("released"), "{err}");
}

#[test]
fn an_image_of_another_job_is_refused() {
    let e1 = engine(small_cfg(4096, 2, 0));
    let j1 = HostJob::new(&e1, &demo_program(1)).unwrap();
    let store = Arc::new(MemStore::new());
    e1.checkpoint(store.clone(), false).unwrap().wait().unwrap();
    drop(j1);
    let other = Program::random(
        2,
        &Shape {
            buffers: 16,
            size_range: (8, 64),
            streams: 1,
            ops: 0,
            max_reads: 0,
            max_writes: 1,
        },
    );
    let e2 = engine(small_cfg(4096, 2, 0));
    let _j2 = HostJob::new(&e2, &other).unwrap();
    e2.release().unwrap();
    let err = e2.restore(store).unwrap_err();
    assert!(matches!(err, EngineError::ImageMismatch { .. }), "{err}");
}

#[test]
fn restore_on_a_device_too_small_names_the_buffer() {
    let p = demo_program(14);
    let dev = Arc::new(HostDevice::new(p.bytes() * 2 + (4 << 20)));
    let e = Engine::new(dev.clone(), small_cfg(4096, 2, 0)).unwrap();
    let mut job = HostJob::new(&e, &p).unwrap();
    let store = saved(&e);
    e.release().unwrap();
    // Something else takes the memory meanwhile.
    let (free, _) = possum_engine::device::Device::memory_info(&*dev).unwrap();
    let hog = e.alloc(free - 64 * 1024).unwrap();
    let rs = e.restore(store).unwrap();
    job.reset_deps();
    let err = job.issue(&p.ops[0]).unwrap_err();
    assert!(err.to_string().contains("out of device memory"), "{err}");
    let err = rs.wait().unwrap_err();
    assert!(err.to_string().contains("restoring buffer"), "{err}");
    drop(hog);
}

/// An image in memory whose chunk reads go through `before` first (an error from it is the read's).
struct OnRead<F> {
    inner: Arc<MemStore>,
    before: F,
}

impl<F> ChunkSource for OnRead<F>
where
    F: Fn(u64, u64) -> Result<(), possum_engine::image::ImageError> + Send + Sync,
{
    fn buffers(&self) -> Vec<possum_engine::store::BufferRecord> {
        self.inner.buffers()
    }
    fn chunks(&self, buffer: u64) -> Vec<(u64, u64)> {
        self.inner.chunks(buffer)
    }
    fn read_chunk(
        &self,
        buffer: u64,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), possum_engine::image::ImageError> {
        (self.before)(buffer, offset)?;
        self.inner.read_chunk(buffer, offset, dst)
    }
    fn meta(&self, key: &str) -> Option<String> {
        self.inner.meta(key)
    }
}

/// A source whose chunks of buffer `bad` are corrupt.
fn corrupt(
    inner: Arc<MemStore>,
    bad: u64,
) -> OnRead<impl Fn(u64, u64) -> Result<(), possum_engine::image::ImageError> + Send + Sync> {
    OnRead {
        inner,
        before: move |buffer, offset| {
            if buffer == bad {
                Err(possum_engine::image::ImageError::MissingChunk { buffer, offset })
            } else {
                Ok(())
            }
        },
    }
}

#[test]
fn a_corrupt_buffer_fails_the_operations_that_need_it_and_only_those() {
    let (_p, e, mut job) = demo_job(15, small_cfg(4096, 3, 0));
    let store = saved(&e);
    e.release().unwrap();
    let bad = job.buffers()[3].id();
    let rs = e.restore(Arc::new(corrupt(store, bad))).unwrap();
    job.reset_deps();
    let ok = possum_workloads::program::Op {
        stream: 0,
        reads: vec![1],
        writes: vec![2],
        salt: 1,
    };
    job.issue(&ok).unwrap();
    let bad_op = write_op(3, 1);
    let err = job.issue(&bad_op).unwrap_err();
    assert!(err.to_string().contains(&format!("buffer {bad}")), "{err}");
    assert!(rs.wait().is_err());
    job.sync().unwrap();
}

#[test]
fn a_buffer_freed_after_t0_is_in_the_image_with_its_t0_contents() {
    let (_p, e, job) = demo_job(16, small_cfg(1024, 2, 0));
    let victim = job.buffers()[5].clone();
    let want = e.device().read_now(victim.va(), victim.size()).unwrap();
    let store = Arc::new(MemStore::new());
    let ck = e.checkpoint(store.clone(), false).unwrap();
    e.free(victim.va()).unwrap();
    ck.wait().unwrap();
    assert_eq!(store.buffer_bytes(victim.id()).unwrap(), want);
}

#[test]
fn an_opaque_operation_saves_everything_first() {
    let (_p, e, job) = demo_job(17, small_cfg(1024, 2, 0));
    let before = job.contents().unwrap();
    let store = Arc::new(MemStore::new());
    let ck = e.checkpoint(store.clone(), false).unwrap();
    // An operation the analyzer could not understand: it may write anything.
    let s = registered_stream(&e);
    let g = e.before_op(&s, Access::Opaque).unwrap();
    let bufs: Vec<_> = job.buffers().iter().map(|b| (b.va(), b.size())).collect();
    e.device()
        .launch(&s, move |mem| {
            for &(va, size) in &bufs {
                mem.with(&[], &[(va, size)], |_, o| o[0].fill(0xee))?;
            }
            Ok(())
        })
        .unwrap();
    drop(g);
    let r = ck.wait().unwrap();
    assert_eq!(
        image_of(&store, &job),
        before,
        "the opaque write must not reach the image: {r:?}"
    );
    job.sync().unwrap();
}

#[test]
fn shadows_take_copy_on_write_when_the_budget_allows() {
    let p = demo_program(18);
    let e = engine(EngineConfig {
        chunk_size: 512,
        staging_buffers: 2,
        shadow_budget: 64 << 20,
        ..EngineConfig::default()
    });
    let mut job = HostJob::new(&e, &p).unwrap();
    let mut r = Reference::new(&p);
    let store = Arc::new(MemStore::new());
    let ck = e.checkpoint(store.clone(), false).unwrap();
    issue_all(&mut job, &p.ops);
    let rep = ck.wait().unwrap();
    job.sync().unwrap();
    assert_eq!(image_of(&store, &job), r.bufs);
    r.run_all(&p.ops);
    assert_eq!(job.contents().unwrap(), r.bufs);
    assert!(rep.cow_shadow + rep.cow_priority > 0, "{rep:?}");
    assert_eq!(
        e.device().mapped_bytes(),
        job.buffers().iter().map(|b| b.mapped_size()).sum::<u64>(),
        "shadows freed"
    );
}

#[test]
fn a_second_checkpoint_while_one_runs_is_refused() {
    let (_p, e, _job) = demo_job(19, small_cfg(256, 2, 0));
    let store = Arc::new(MemStore::new());
    let ck = e.checkpoint(store.clone(), false).unwrap();
    let second = e.checkpoint(Arc::new(MemStore::new()), false);
    if !ck.is_finished() {
        if let Err(err) = second {
            assert!(matches!(err, EngineError::Busy { .. }), "{err}");
        }
    }
    ck.wait().unwrap();
}

/// A sink whose disk is full after a few chunks.
fn failing_sink() -> Arc<dyn ChunkSink> {
    let written = std::sync::atomic::AtomicUsize::new(0);
    Arc::new(TapSink {
        store: Arc::new(MemStore::new()),
        tap: move |_| {
            if written.fetch_add(1, std::sync::atomic::Ordering::Relaxed) > 5 {
                return Err(possum_engine::image::ImageError::Io {
                    path: "/full/disk".into(),
                    source: std::io::Error::other("No space left on device"),
                });
            }
            Ok(())
        },
    })
}

#[test]
fn a_full_disk_fails_the_checkpoint_and_not_the_job() {
    let (p, e, mut job) = demo_job(20, small_cfg(512, 2, 0));
    let ck = e.checkpoint(failing_sink(), false).unwrap();
    issue_all(&mut job, &p.ops);
    let err = ck.wait().unwrap_err();
    assert!(err.to_string().contains("No space left"), "{err}");
    job.sync().unwrap();
    let r = reference(&p, &p.ops);
    assert_eq!(job.contents().unwrap(), r.bufs, "the job is unharmed");
    assert_eq!(e.stats().phase, "idle");
}

/// A stream the job destroys is forgotten (once), and checkpoints go on with the others.
#[test]
fn unregistered_streams_are_not_fenced() {
    use possum_engine::device::{Device, StreamPriority};
    let e = engine(small_cfg(1 << 16, 4, 0));
    let dev = e.device().clone();
    let keep = dev.create_stream(StreamPriority::Normal).unwrap();
    let gone = dev.create_stream(StreamPriority::Normal).unwrap();
    e.register_stream(keep.clone());
    e.register_stream(gone.clone());
    assert_eq!(e.unregister_streams(|s| s.id() == gone.id()), 1);
    assert_eq!(e.unregister_streams(|s| s.id() == gone.id()), 0);
    let b = e.alloc(1 << 16).unwrap();
    {
        let _g = e
            .before_op(
                &keep,
                Access::Known {
                    reads: &[],
                    writes: std::slice::from_ref(&b),
                },
            )
            .unwrap();
    }
    let store = Arc::new(MemStore::default());
    let r = checkpoint_now(&e, &store);
    assert_eq!(r.buffers, 1);
}

/// A write enqueued before T0 on a stream the engine does not fence (a per-thread default stream
/// it cannot record an event on from another thread) is in the image once T0 waits for the
/// device; the job is held meanwhile (nothing new is enqueued).
#[test]
fn the_device_fence_covers_streams_the_engine_cannot_fence() {
    use possum_engine::device::{Device, StreamPriority};
    let e = engine(small_cfg(1 << 16, 4, 0));
    let dev = e.device().clone();
    let unfenced = dev.create_stream(StreamPriority::Normal).unwrap();
    let b = e.alloc(1 << 16).unwrap();
    let (va, size) = (b.va(), b.size());
    // The write waits until the checkpoint is over (or 200 ms): without the fence the image is
    // taken before it.
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    dev.launch(&unfenced, move |mem| {
        let _ = go_rx.recv_timeout(std::time::Duration::from_millis(200));
        mem.with(&[], &[(va, size)], |_, o| o[0].fill(0xab))
    })
    .unwrap();
    e.set_device_fence(true);
    let store = Arc::new(MemStore::default());
    checkpoint_now(&e, &store);
    let _ = go_tx.send(());
    e.set_device_fence(false);
    assert!(store
        .buffer_bytes(b.id())
        .unwrap()
        .iter()
        .all(|&x| x == 0xab));
}

/// What keeps a [`gated_sink`]'s chunks waiting until the test opens it.
#[derive(Default)]
struct Gate(std::sync::Mutex<bool>, std::sync::Condvar);

impl Gate {
    fn open(&self) {
        *self.0.lock().unwrap() = true;
        self.1.notify_all();
    }
    fn wait(&self) {
        let open = self.0.lock().unwrap();
        drop(self.1.wait_while(open, |o| !*o).unwrap());
    }
}

/// A sink over `store` whose chunks wait until the test opens its gate: a round stays in progress
/// while the test issues operations.
fn gated_sink(store: &Arc<MemStore>) -> (Arc<dyn ChunkSink>, Arc<Gate>) {
    let gate = Arc::new(Gate::default());
    let g = Arc::clone(&gate);
    let sink = Arc::new(TapSink {
        store: Arc::clone(store),
        tap: move |_| {
            g.wait();
            Ok(())
        },
    });
    (sink, gate)
}

/// The final copy of a held job sees no operation, so it ranks nothing: the prefetch ranks are the
/// order the job first touched its buffers during the pre-copy (before: every buffer ranked by
/// id, and a restored job's first step waited for all of them on the H100).
#[test]
fn a_held_final_copy_keeps_the_precopys_prefetch_order() {
    // The hooks' write sets decide what the final copy takes (nothing changes bytes here).
    let e = Arc::new(engine(unprinted_cfg(1 << 12, 4, 0)));
    let s = registered_stream(&e);
    let bufs: Vec<_> = (0..4).map(|_| e.alloc(1 << 12).unwrap()).collect();
    let store = Arc::new(MemStore::default());
    let (sink, gate) = gated_sink(&store);
    let (e2, sink2) = (e.clone(), sink.clone());
    let round = std::thread::spawn(move || e2.precopy_round(sink2).unwrap());
    while !e.session_active() {
        std::thread::sleep(Duration::from_millis(1));
    }
    // The job touches buffer 3, then 1 (a write), while the round is under way.
    for (b, write) in [(&bufs[3], false), (&bufs[1], true)] {
        let one = std::slice::from_ref(b);
        let access = if write {
            Access::Known {
                reads: &[],
                writes: one,
            }
        } else {
            Access::Known {
                reads: one,
                writes: &[],
            }
        };
        drop(e.before_op(&s, access).unwrap());
    }
    gate.open();
    let r = round.join().unwrap();
    assert_eq!(r.buffers, 4);
    // The final copy, the job held: buffer 1 was written since.
    let fin = e.checkpoint(sink, true).unwrap().wait().unwrap();
    assert_eq!(fin.buffers, 1);
    let rank = |i: usize| {
        store
            .buffers()
            .into_iter()
            .find(|r| r.id == bufs[i].id())
            .unwrap()
            .prefetch_rank
    };
    assert_eq!((rank(3), rank(1)), (0, 1));
    assert!(
        rank(0) >= 2 && rank(2) >= 2 && rank(0) != u32::MAX,
        "{:?}",
        store.buffers()
    );
}

/// The threads that read chunks of one buffer: each read waits (at most `patience`) until two
/// different threads have read chunks of it, so a restore that copies a wanted buffer on one
/// thread only is seen (one reader) instead of passing by luck.
#[derive(Default)]
struct Readers {
    seen: parking_lot::Mutex<std::collections::HashSet<std::thread::ThreadId>>,
    cv: parking_lot::Condvar,
}

impl Readers {
    fn read(&self, patience: Duration) {
        let mut r = self.seen.lock();
        r.insert(std::thread::current().id());
        self.cv.notify_all();
        if r.len() < 2 {
            let _ = self.cv.wait_for(&mut r, patience);
        }
    }
}

#[test]
fn every_restorer_helps_with_a_buffer_an_operation_waits_for() {
    use possum_engine::device::{Device, StreamPriority};
    // Restorers that would sleep a minute before each buffer of their own: only a buffer that an
    // operation waits for (urgent) gets them at once.
    let cfg = EngineConfig {
        prefetch_delay: Duration::from_secs(60),
        restore_threads: 3,
        ..small_cfg(4096, 8, 0)
    };
    let e = engine(cfg);
    let dev = Arc::clone(e.device());
    let stream = dev.create_stream(StreamPriority::Normal).unwrap();
    e.register_stream(stream.clone());
    let bufs: Vec<_> = [4096u64, 64 * 4096, 8192]
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let b = e.alloc(size).unwrap();
            let bytes: Vec<u8> = (0..size).map(|k| (k as u8) ^ (i as u8 * 37)).collect();
            dev.write_now(b.va(), &bytes).unwrap();
            (b, bytes)
        })
        .collect();
    let store = saved(&e);
    e.release().unwrap();
    let big = bufs[1].0.clone();
    let watched = big.id();
    let readers = Arc::new(Readers::default());
    let seen = Arc::clone(&readers);
    let source = Arc::new(OnRead {
        inner: store,
        before: move |buffer, _| {
            if buffer == watched {
                seen.read(Duration::from_secs(20));
            }
            Ok(())
        },
    });
    let rs = e.restore(source).unwrap();
    // The job's operation on the big buffer: the hook waits for it, helped by the restorers.
    drop(
        e.before_op(
            &stream,
            Access::Known {
                reads: &[],
                writes: std::slice::from_ref(&big),
            },
        )
        .unwrap(),
    );
    assert!(
        readers.seen.lock().len() >= 2,
        "the wanted buffer's chunks were copied by one thread only"
    );
    // The rest, on demand too (the restorers are still sleeping out their delay).
    for (b, _) in [&bufs[0], &bufs[2]] {
        let all = [b.clone()];
        drop(
            e.before_op(
                &stream,
                Access::Known {
                    reads: &all,
                    writes: &[],
                },
            )
            .unwrap(),
        );
    }
    let rr = rs.wait().unwrap();
    assert!(rr.helped_chunks >= 1, "{rr:?}");
    assert_eq!((rr.on_demand, rr.prefetched), (3, 0), "{rr:?}");
    for (b, bytes) in &bufs {
        assert_eq!(&dev.read_now(b.va(), b.size()).unwrap(), bytes);
    }
}

/// The keeper's checkpoint: at T0 the buffers are detached (memory kept, nothing
/// copied), then attached again, and the T0 state drains to the image while the job runs on.
#[test]
fn a_detached_then_drained_checkpoint_is_the_state_at_t0() {
    for seed in 0..24u64 {
        let p = demo_program(seed);
        let k = (seed as usize * 7) % p.ops.len();
        let (dev, e) = keeping_engine(small_cfg(4096, 2, (seed % 2) * (1 << 20)));
        let mut job = HostJob::new(&e, &p).unwrap().lazy_hook(seed % 3 == 0);
        let at_t0 = reference(&p, &p.ops[..k]);
        let mut at_end = at_t0.clone();
        at_end.run_all(&p.ops[k..]);
        issue_all(&mut job, &p.ops[..k]);
        let detached = e.detach().unwrap();
        assert_eq!(detached, dev.kept_bytes(), "seed {seed}");
        assert_eq!(dev.disconnects(), 1, "seed {seed}");
        assert_eq!(e.stats().phase, "detached");
        assert_eq!(e.stats().resident_bytes, 0);
        if k < p.ops.len() {
            let err = job.issue(&p.ops[k]).unwrap_err();
            assert!(matches!(err, EngineError::Released { .. }), "{err}");
        }
        assert_eq!(e.reattach().unwrap(), detached);
        assert_eq!(dev.kept_bytes(), 0);
        let store = Arc::new(MemStore::new());
        let ck = e.checkpoint(store.clone(), false).unwrap();
        issue_all(&mut job, &p.ops[k..]);
        ck.wait().unwrap();
        job.sync().unwrap();
        let (image_ok, job_ok) = agree_with(&store, &job, &at_t0, &at_end);
        assert!(
            image_ok,
            "seed {seed}: drained image differs from the state at T0"
        );
        assert!(
            job_ok,
            "seed {seed}: the job's own run differs from the reference"
        );
    }
}

#[test]
fn detach_needs_a_device_that_keeps_memory_and_changes_nothing_without_one() {
    let (p, e, mut job) = demo_job(5, small_cfg(4096, 2, 0));
    let err = e.detach().unwrap_err();
    assert!(err.to_string().contains("not supported"), "{err}");
    assert!(!e.session_active());
    job.issue(&p.ops[0]).unwrap();
    job.sync().unwrap();
    let err = e.reattach().unwrap_err();
    assert!(matches!(err, EngineError::Busy { .. }), "{err}");
}

#[test]
fn a_buffer_freed_while_detached_leaves_nothing_kept() {
    let (dev, e) = keeping_engine(small_cfg(4096, 2, 0));
    let a = e.alloc(1 << 16).unwrap();
    let b = e.alloc(1 << 16).unwrap();
    dev.write_now(b.va(), &[7u8; 16]).unwrap();
    e.detach().unwrap();
    e.free(a.va()).unwrap();
    assert_eq!(dev.kept_bytes(), b.mapped_size());
    e.reattach().unwrap();
    assert_eq!(dev.read_now(b.va(), 16).unwrap(), vec![7u8; 16]);
    assert_eq!(dev.mapped_bytes(), b.mapped_size());
}

/// A detached job whose keeper lost its memory (or a job restored elsewhere) comes back from the
/// image: reattach fails, the buffers are dropped to released and restored on demand.
#[test]
fn detached_buffers_the_keeper_lost_come_back_from_the_image() {
    let p = demo_program(11);
    let k = 25;
    let (dev, e) = keeping_engine(small_cfg(4096, 2, 0));
    let mut job = HostJob::new(&e, &p).unwrap();
    let want = reference(&p, &p.ops);
    issue_all(&mut job, &p.ops[..k]);
    let store = saved(&e);
    e.detach().unwrap();
    dev.lose_kept();
    assert!(e.reattach().is_err());
    assert!(e.restore(store.clone()).is_err(), "restore while detached");
    e.drop_detached().unwrap();
    assert_eq!(e.stats().phase, "released");
    assert_eq!(dev.mapped_bytes(), 0);
    job.reset_deps();
    let rs = e.restore(store).unwrap();
    issue_all(&mut job, &p.ops[k..]);
    job.sync().unwrap();
    rs.wait().unwrap();
    assert!(job.contents().unwrap() == want.bufs);
}

/// Writes the hooks never see (straight to device memory here) racing the copier. Without
/// fingerprints, a snapshot checkpoint copies every buffer into a shadow at T0 (the budget
/// allowing), so they cannot reach the image, and a plain checkpoint's image can take them
/// (shown on the same setup). With fingerprints at T0, no image ever takes them: every copy is
/// checked against the chunk's fingerprint at T0, and a checkpoint that copied a changed chunk
/// fails with a mismatch, never commits; no shadow is made while the job is held.
#[test]
fn writes_the_hooks_miss_never_reach_an_image() {
    let run = |snapshot: bool, prints: bool| -> Result<(bool, u64), EngineError> {
        let (dev, e) = keeping_engine(EngineConfig {
            fingerprints: prints,
            ..small_cfg(4096, 2, 0)
        });
        let bufs: Vec<_> = (0..8).map(|_| e.alloc(1 << 18).unwrap()).collect();
        for (i, b) in bufs.iter().enumerate() {
            dev.write_now(b.va(), &vec![i as u8 + 1; 1 << 18]).unwrap();
        }
        let store = Arc::new(MemStore::new());
        let h = if snapshot {
            e.set_shadow_budget(64 << 20);
            e.checkpoint_snapshot(store.clone()).unwrap()
        } else {
            e.checkpoint(store.clone(), false).unwrap()
        };
        // Unseen writes, racing the copier.
        for b in &bufs {
            dev.write_now(b.va(), &vec![0xee; 1 << 18]).unwrap();
        }
        let r = h.wait()?;
        let t0 = bufs
            .iter()
            .enumerate()
            .all(|(i, b)| store.buffer_bytes(b.id()).unwrap() == vec![i as u8 + 1; 1 << 18]);
        Ok((t0, r.snapshot_shadows))
    };
    let (t0, shadows) = run(true, false).unwrap();
    assert!(t0, "the snapshot's image is not the state at T0");
    assert_eq!(shadows, 8);
    // The plain checkpoint on a slow sink (one staging buffer) loses at least once in a few
    // tries: the copier is still behind when the unseen writes land.
    let lost = (0..20).any(|_| !run(false, false).unwrap().0);
    assert!(
        lost,
        "unseen writes never reached the plain checkpoint: the test shows nothing"
    );
    // With fingerprints: the image is the state at T0 or there is none.
    let mut mismatches = 0;
    for snapshot in [false, true] {
        for _ in 0..20 {
            match run(snapshot, true) {
                Ok((t0, shadows)) => {
                    assert!(t0, "an image that is not the state at T0 was committed");
                    assert_eq!(shadows, 0, "nothing is copied into shadows while held");
                }
                Err(e @ EngineError::Mismatch { chunks, .. }) => {
                    assert!(chunks > 0);
                    let words = e.to_string();
                    assert!(words.contains(possum_engine::MISMATCH_TEXT), "{words}");
                    mismatches += 1;
                }
                Err(other) => panic!("{other}"),
            }
        }
    }
    assert!(
        mismatches > 0,
        "no unseen write was caught: the test shows nothing"
    );
}

/// A [`ShadowSaver`] standing in for the keeper's spare image memory: it reads what it is given
/// from the host device into `store` in chunks of `chunk` bytes, as the keeper records its
/// fills (or fails, `fail`), counting its saves and how many ran at once; with `some`, it saves
/// some chunks of a buffer too (counted in `saved_some`).
struct TestSaver {
    dev: Arc<HostDevice>,
    store: Arc<MemStore>,
    chunk: usize,
    fail: bool,
    some: bool,
    saved: std::sync::atomic::AtomicU64,
    saved_some: std::sync::atomic::AtomicU64,
    in_flight: std::sync::atomic::AtomicU64,
    most_at_once: std::sync::atomic::AtomicU64,
}

impl TestSaver {
    fn new(dev: &Arc<HostDevice>, store: &Arc<MemStore>, chunk: usize, fail: bool) -> Arc<Self> {
        Arc::new(TestSaver {
            dev: dev.clone(),
            store: store.clone(),
            chunk,
            fail,
            some: false,
            saved: Default::default(),
            saved_some: Default::default(),
            in_flight: Default::default(),
            most_at_once: Default::default(),
        })
    }

    fn saved(&self) -> u64 {
        self.saved.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn most_at_once(&self) -> u64 {
        self.most_at_once.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl possum_engine::store::ShadowSaver for TestSaver {
    fn save(
        &self,
        buffer: u64,
        from: possum_engine::device::DevPtr,
        size: u64,
    ) -> Result<(), String> {
        use std::sync::atomic::Ordering;
        if self.fail {
            return Err("failed on purpose".into());
        }
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_at_once.fetch_max(now, Ordering::SeqCst);
        // Long enough that saves handed out together overlap.
        std::thread::sleep(std::time::Duration::from_millis(30));
        let bytes = self.dev.read_now(from, size).map_err(|e| e.to_string())?;
        for (k, piece) in bytes.chunks(self.chunk).enumerate() {
            let at = (k * self.chunk) as u64;
            self.store
                .write_chunk(buffer, at, piece)
                .map_err(|e| e.to_string())?;
        }
        self.saved.fetch_add(1, Ordering::SeqCst);
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }

    fn save_chunks(
        &self,
        buffer: u64,
        at: possum_engine::device::DevPtr,
        size: u64,
        (offsets, chunk): (&[u64], u64),
    ) -> Result<(), String> {
        use std::sync::atomic::Ordering;
        if self.fail || !self.some {
            return Err("whole buffers only".into());
        }
        for &off in offsets {
            let len = chunk.min(size - off);
            let bytes = self
                .dev
                .read_now(at.add(off), len)
                .map_err(|e| e.to_string())?;
            self.store
                .write_chunk(buffer, off, &bytes)
                .map_err(|e| e.to_string())?;
        }
        self.saved_some.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// Six buffers of 256 KiB, buffer `i` holding bytes `i + 1`.
fn six_filled(e: &Engine<HostDevice>, dev: &HostDevice) -> Vec<possum_engine::Buffer> {
    let bufs: Vec<_> = (0..6).map(|_| e.alloc(1 << 18).unwrap()).collect();
    for (i, b) in bufs.iter().enumerate() {
        dev.write_now(b.va(), &vec![i as u8 + 1; 1 << 18]).unwrap();
    }
    bufs
}

/// A snapshot checkpoint with a [`ShadowSaver`] (the keeper's spare image memory in possum):
/// every shadow goes through it, none through the staging, and the image is still the state at
/// T0 whatever the job writes meanwhile; a saver that fails leaves the shadows to the staging,
/// with the same image.
#[test]
fn a_snapshot_s_shadows_are_saved_elsewhere_when_a_saver_is_given() {
    for fail in [false, true] {
        let dev = Arc::new(HostDevice::keeping(1 << 30));
        let e = Engine::new(dev.clone(), unprinted_cfg(1 << 20, 2, 0)).unwrap();
        let bufs = six_filled(&e, &dev);
        let store = Arc::new(MemStore::new());
        let saver = TestSaver::new(&dev, &store, 1 << 20, fail);
        e.set_shadow_budget(64 << 20);
        let h = e
            .checkpoint_snapshot_with(store.clone(), Some(saver.clone()))
            .unwrap();
        for b in &bufs {
            dev.write_now(b.va(), &vec![0xee; 1 << 18]).unwrap();
        }
        let r = h.wait().unwrap();
        assert_eq!(r.snapshot_shadows, 6);
        let elsewhere = if fail { 0 } else { 6 };
        assert_eq!(r.shadows_saved_elsewhere, elsewhere, "fail {fail}");
        assert_eq!(saver.saved(), elsewhere);
        if !fail {
            // Shadows are handed to the saver from several threads (its copies queue behind
            // each other's): never one at a time.
            assert!(
                saver.most_at_once() > 1,
                "the saver was given one shadow at a time"
            );
        }
        assert_eq!(r.bytes, 6 << 18);
        for (i, b) in bufs.iter().enumerate() {
            assert!(
                store.buffer_bytes(b.id()).unwrap() == vec![i as u8 + 1; 1 << 18],
                "buffer {i} (fail {fail}) is not as of T0"
            );
        }
    }
}

/// A copy holding the job with a [`ShadowSaver`]: each buffer it takes whole goes to the saver
/// itself (nothing writes it meanwhile), several at once, none through the staging; one of
/// which only some chunks changed since the image's last copy goes to a saver that takes some
/// chunks as those chunks, and through the staging to one that does not; a saver that fails
/// leaves every buffer to the staging. The image is the buffers either way.
#[test]
fn a_held_copy_hands_its_whole_buffers_to_a_saver() {
    for (fail, some) in [(false, false), (false, true), (true, true)] {
        let dev = Arc::new(HostDevice::keeping(1 << 30));
        let e = Engine::new(dev.clone(), small_cfg(1 << 16, 4, 0)).unwrap();
        let bufs = six_filled(&e, &dev);
        let store = Arc::new(MemStore::new());
        // A first copy (as a pre-copy's), then one chunk of buffer 0 and all of the others
        // changed, the job held for the copy of what changed.
        e.checkpoint(store.clone(), false).unwrap().wait().unwrap();
        dev.write_now(bufs[0].va(), &[0xaa; 1 << 16]).unwrap();
        for (i, b) in bufs.iter().enumerate().skip(1) {
            dev.write_now(b.va(), &vec![i as u8 + 0x40; 1 << 18])
                .unwrap();
        }
        for b in &bufs {
            assert!(e.mark_written(b.va()));
        }
        let mut saver = TestSaver::new(&dev, &store, 1 << 16, fail);
        Arc::get_mut(&mut saver).unwrap().some = some;
        let h = e.checkpoint_held_with(store.clone(), true, Some(saver.clone()));
        let r = h.unwrap().wait().unwrap();
        let whole = if fail { 0 } else { 5 };
        let partly = u64::from(!fail && some);
        assert_eq!(
            r.shadows_saved_elsewhere,
            whole + partly,
            "fail {fail}, some {some}: {r:?}"
        );
        assert_eq!(saver.saved(), whole);
        assert_eq!(
            saver.saved_some.load(std::sync::atomic::Ordering::SeqCst),
            partly
        );
        if !fail {
            assert!(
                saver.most_at_once() > 1,
                "the saver was given one buffer at a time"
            );
        }
        // Buffer 0's one changed chunk, and the five others whole.
        assert_eq!(r.bytes, (1 << 16) + 5 * (1 << 18), "fail {fail}");
        for (i, b) in bufs.iter().enumerate() {
            assert!(
                store.buffer_bytes(b.id()).unwrap() == dev.read_now(b.va(), 1 << 18).unwrap(),
                "buffer {i} (fail {fail}) is not as the job left it"
            );
        }
    }
}

/// Buffers mapped piece by piece into an address range the job reserved (`alloc_at`, one
/// group): an operation that names one piece is taken to touch them all (the job's data may span
/// pieces), so a write to one puts every piece into the final copy, and a buffer outside the
/// group stays out of it. A piece freed leaves its range to the job, to be mapped again.
#[test]
fn a_write_to_one_piece_of_a_group_copies_every_piece() {
    use possum_engine::device::{DevPtr, Device};
    // The hooks' write sets decide here (with fingerprints, what did not change is not copied).
    let e = Arc::new(engine(unprinted_cfg(1 << 12, 4, 0)));
    let s = registered_stream(&e);
    let g = e.device().granularity();
    let base = DevPtr(0x7000_0000_0000);
    let a = e.alloc_at(base, g, 1).unwrap();
    let b = e.alloc_at(DevPtr(base.0 + g), g, 1).unwrap();
    let other = e.alloc(g).unwrap();
    assert!(e.alloc_at(base, g, 1).is_err(), "a range already taken");
    let store = Arc::new(MemStore::default());
    assert_eq!(e.precopy_round(store.clone()).unwrap().buffers, 3);
    assert!(!a.is_dirty() && !b.is_dirty() && !other.is_dirty());
    // Read through one piece: nothing written.
    drop(
        e.before_op(
            &s,
            Access::Known {
                reads: std::slice::from_ref(&a),
                writes: &[],
            },
        )
        .unwrap(),
    );
    assert!(!a.is_dirty() && !b.is_dirty());
    // Written through one piece: both pieces, not the other buffer.
    drop(
        e.before_op(
            &s,
            Access::Known {
                reads: std::slice::from_ref(&other),
                writes: std::slice::from_ref(&a),
            },
        )
        .unwrap(),
    );
    assert!(a.is_dirty() && b.is_dirty() && !other.is_dirty());
    let fin = e.checkpoint(store, true).unwrap().wait().unwrap();
    assert_eq!(fin.buffers, 2);
    e.free(b.va()).unwrap();
    let again = e.alloc_at(DevPtr(base.0 + g), g, 1).unwrap();
    assert_eq!(again.va(), b.va());
    assert_eq!(again.group(), Some(1));
}

/// A buffer freed while a pre-copy round or checkpoint starts (cudaMallocAsync frees its large
/// blocks all the time, `interposer/src/memory/pools.rs`): either the session never sees it, or the free
/// waits until its copy is done. Before the free entered the op gate, a free that had read the
/// phase as idle could unmap a buffer the starting round had just picked, and the round's copy
/// failed (on the H100: cuMemcpyDtoHAsync_v2 CUDA_ERROR_INVALID_VALUE in GPT-2's pre-copy).
#[test]
fn buffers_freed_while_rounds_start_never_fail_a_round() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let e = Arc::new(engine(small_cfg(1 << 12, 4, 0)));
    let keep: Vec<_> = (0..2).map(|_| e.alloc(1 << 12).unwrap()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let churn: Vec<_> = (0..2)
        .map(|_| {
            let (e, stop) = (e.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let b = e.alloc(1 << 12).unwrap();
                    e.free(b.va()).unwrap();
                    n += 1;
                }
                n
            })
        })
        .collect();
    for round in 0..300 {
        let store = Arc::new(MemStore::default());
        e.mark_all_dirty();
        if let Err(err) = e.precopy_round(store) {
            stop.store(true, Ordering::Relaxed);
            panic!("round {round}: {err}");
        }
    }
    stop.store(true, Ordering::Relaxed);
    let freed: u64 = churn.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(freed > 0);
    assert_eq!(e.buffers().len(), keep.len());
}

/// Buffers the job frees while a checkpoint is being made stay in its image (copied before the
/// free) but not in the job: between pre-copy rounds, and after the final T0 by a thread that
/// was already past the pause (cudaMallocAsync's blocks, on the H100: "image does not match this
/// job: the job has no such buffer"). The restore skips them and brings the others back; a
/// buffer the job never had is still a mismatch.
#[test]
fn buffers_freed_during_the_checkpoint_are_skipped_by_the_restore() {
    let e = engine(small_cfg(1 << 12, 4, 0));
    let keep = e.alloc(1 << 12).unwrap();
    let between = e.alloc(1 << 12).unwrap();
    let after_t0 = e.alloc(1 << 12).unwrap();
    let store = Arc::new(MemStore::default());
    assert_eq!(e.precopy_round(store.clone()).unwrap().buffers, 3);
    e.free(between.va()).unwrap();
    e.checkpoint(store.clone(), true).unwrap().wait().unwrap();
    e.free(after_t0.va()).unwrap();
    e.release().unwrap();
    let r = e.restore(store.clone()).unwrap().wait().unwrap();
    assert_eq!(r.buffers, 1);
    assert_eq!(e.lookup(keep.va()).map(|b| b.id()), Some(keep.id()));

    // A buffer that is in the image and was never freed by this job: refused as before.
    let other = engine(small_cfg(1 << 12, 4, 0));
    let b = other.alloc(1 << 12).unwrap();
    let store2 = Arc::new(MemStore::default());
    other
        .checkpoint(store2.clone(), false)
        .unwrap()
        .wait()
        .unwrap();
    other.free(b.va()).unwrap();
    let _c = other.alloc(1 << 12).unwrap();
    other.stop_tracking().unwrap();
    other
        .checkpoint(Arc::new(MemStore::default()), false)
        .unwrap()
        .wait()
        .unwrap();
    other.release().unwrap();
    let Err(err) = other.restore(store2) else {
        panic!("restored an image with a buffer the job never freed");
    };
    assert!(matches!(err, EngineError::ImageMismatch { .. }), "{err}");
}

/// A memory owner that "loads" buffers from an image into memory it prepared (a keeper staging
/// a restore), slowly, failing some.
struct TestStaged {
    dev: Arc<HostDevice>,
    store: Arc<MemStore>,
    /// Buffer id -> (va, mapped size).
    bufs: std::collections::HashMap<u64, (u64, u64)>,
    fail: std::collections::HashSet<u64>,
    delay: Duration,
    loaded: parking_lot::Mutex<std::collections::HashSet<u64>>,
    waits: std::sync::atomic::AtomicU64,
    finished: std::sync::atomic::AtomicBool,
    /// The owner loads nothing until this thread (the job's) first asks it for a buffer: an
    /// operation then always meets a buffer still loading, however the threads are scheduled.
    held_for: Option<std::thread::ThreadId>,
    /// Whether `held_for` has asked yet.
    asked: (parking_lot::Mutex<bool>, parking_lot::Condvar),
}

impl TestStaged {
    /// Holds the owner's loading back until the job's thread asks for a buffer (see `held_for`);
    /// a minute at most, against a hang.
    fn hold(&self) {
        let Some(job) = self.held_for else {
            return;
        };
        let (asked, cv) = &self.asked;
        let mut asked = asked.lock();
        if std::thread::current().id() == job {
            *asked = true;
            cv.notify_all();
            return;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !*asked && !cv.wait_until(&mut asked, deadline).timed_out() {}
    }
}

impl possum_engine::Staged for TestStaged {
    fn memory_of(&self, buffer: u64) -> Option<possum_engine::StagedMemory> {
        self.bufs
            .get(&buffer)
            .map(|&(_, size)| possum_engine::StagedMemory {
                id: buffer + 1000,
                epoch: 7,
                size,
            })
    }

    fn wait_loaded(&self, buffer: u64) -> Result<(), String> {
        use std::sync::atomic::Ordering;
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.hold();
        let mut loaded = self.loaded.lock();
        if loaded.contains(&buffer) {
            return Ok(());
        }
        std::thread::sleep(self.delay);
        if self.fail.contains(&buffer) {
            return Err(format!("buffer {buffer}: the owner's read failed"));
        }
        // The owner writes through its own mapping; here the engine has mapped the memory at
        // the buffer's address already (it waits only for mapped staged memory).
        let (va, _) = self.bufs[&buffer];
        let data = self.store.buffer_bytes(buffer).ok_or("not in the image")?;
        self.dev
            .write_now(possum_engine::device::DevPtr(va), &data)
            .map_err(|e| e.to_string())?;
        loaded.insert(buffer);
        Ok(())
    }

    fn finished(&self) {
        self.finished
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[test]
fn a_staged_restore_maps_what_the_owner_loaded_and_copies_the_rest() {
    let p = demo_program(11);
    let k = 25;
    let (dev, e) = keeping_engine(EngineConfig {
        restore_threads: 1,
        ..small_cfg(4096, 2, 0)
    });
    let mut job = HostJob::new(&e, &p).unwrap();
    let want = reference(&p, &p.ops);
    issue_all(&mut job, &p.ops[..k]);
    let store = saved(&e);
    e.release().unwrap();
    let bufs: std::collections::HashMap<u64, (u64, u64)> = job
        .buffers()
        .iter()
        .map(|b| (b.id(), (b.va().0, b.mapped_size())))
        .collect();
    // Two buffers the owner fails to load: copied from the image by the engine instead.
    let fail: std::collections::HashSet<u64> =
        job.buffers().iter().take(2).map(|b| b.id()).collect();
    let staged = Arc::new(TestStaged {
        dev: dev.clone(),
        store: store.clone(),
        bufs,
        fail: fail.clone(),
        delay: Duration::from_millis(15),
        loaded: parking_lot::Mutex::new(Default::default()),
        waits: Default::default(),
        finished: Default::default(),
        held_for: Some(std::thread::current().id()),
        asked: Default::default(),
    });
    job.reset_deps();
    let reattached = dev.reattached_bytes();
    let rs = e.restore_staged(store, staged.clone()).unwrap();
    // The restorer may have mapped some of it already (it runs from the start).
    assert_eq!(
        dev.kept_bytes() + (dev.reattached_bytes() - reattached),
        job.buffers().iter().map(|b| b.mapped_size()).sum::<u64>(),
        "every buffer's memory is the owner's prepared memory"
    );
    issue_all(&mut job, &p.ops[k..]);
    job.sync().unwrap();
    let rr = rs.wait().unwrap();
    assert!(
        job.contents().unwrap() == want.bufs,
        "the staged restore's run differs from an uninterrupted one"
    );
    assert_eq!(
        rr.staged + rr.staged_fallback,
        p.sizes.len() as u64,
        "{rr:?}"
    );
    assert_eq!(rr.staged_fallback, fail.len() as u64, "{rr:?}");
    assert_eq!(rr.on_demand + rr.prefetched, p.sizes.len() as u64, "{rr:?}");
    assert!(
        rr.on_demand >= 1,
        "an operation waited for the owner: {rr:?}"
    );
    assert!(staged.finished.load(std::sync::atomic::Ordering::Relaxed));
    assert_eq!(dev.kept_bytes(), 0, "nothing left kept");
    assert_eq!(e.stats().phase, "idle");
}

#[test]
fn a_staged_restore_with_memory_of_the_wrong_size_copies_everything() {
    let p = demo_program(11);
    let (dev, e) = keeping_engine(small_cfg(4096, 2, 0));
    let mut job = HostJob::new(&e, &p).unwrap();
    let want = reference(&p, &p.ops);
    issue_all(&mut job, &p.ops[..10]);
    let store = saved(&e);
    e.release().unwrap();
    let staged = Arc::new(TestStaged {
        dev: dev.clone(),
        store: store.clone(),
        bufs: job
            .buffers()
            .iter()
            .map(|b| (b.id(), (b.va().0, b.mapped_size() * 2)))
            .collect(),
        fail: Default::default(),
        delay: Duration::ZERO,
        loaded: parking_lot::Mutex::new(Default::default()),
        waits: Default::default(),
        finished: Default::default(),
        held_for: None,
        asked: Default::default(),
    });
    job.reset_deps();
    let rs = e.restore_staged(store, staged.clone()).unwrap();
    issue_all(&mut job, &p.ops[10..]);
    job.sync().unwrap();
    let rr = rs.wait().unwrap();
    assert!(job.contents().unwrap() == want.bufs);
    assert_eq!((rr.staged, rr.staged_fallback), (0, 0), "{rr:?}");
    assert_eq!(staged.waits.load(std::sync::atomic::Ordering::Relaxed), 0);
}

#[test]
fn a_write_to_a_buffer_not_yet_saved_waits_for_that_buffer_only() {
    let p = demo_program(19);
    // Every buffer is several chunks: the copier stalls in the first buffer (lowest address) once
    // both staging buffers wait at the closed sink; a write of another buffer is saved by a
    // shadow and waits for it.
    let e = engine(small_cfg(1024, 2, 64 << 20));
    let mut job = HostJob::new(&e, &p).unwrap();
    let before = job.contents().unwrap();
    let idx = (0..job.buffers().len())
        .max_by_key(|&i| job.buffers()[i].va())
        .unwrap();
    let target = job.buffers()[idx].clone();
    let store = Arc::new(MemStore::new());
    let (sink, gate) = gated_sink(&store);
    let ck = e.checkpoint(sink.clone(), false).unwrap();
    let op = write_op(idx, 7);
    job.reset_deps();
    job.issue(&op).unwrap();
    job.sync().unwrap();
    gate.open();
    let rep = ck.wait().unwrap();
    assert_eq!(
        image_of(&store, &job),
        before,
        "the image is the state at T0"
    );
    assert_eq!(
        rep.waited_on
            .iter()
            .map(|w| (w.id, w.va, w.size))
            .collect::<Vec<_>>(),
        vec![(target.id(), target.va().0, target.size())],
        "{rep:?}"
    );
    assert!(rep.job_waited > Duration::ZERO, "{rep:?}");
    assert!(rep.waited_on[0].waited > Duration::ZERO, "{rep:?}");
    assert!(rep.job_waited >= rep.waited_on[0].waited, "{rep:?}");
}

#[test]
fn a_job_that_only_reads_during_a_checkpoint_never_waits() {
    let (_p, e, job) = demo_job(20, small_cfg(1024, 2, 0));
    let before = job.contents().unwrap();
    let store = Arc::new(MemStore::new());
    let (sink, gate) = gated_sink(&store);
    let ck = e.checkpoint(sink.clone(), false).unwrap();
    // An operation that reads every buffer of the checkpoint while the copier is stalled, and
    // writes only a buffer allocated after T0 (not in the checkpoint).
    let extra = e.alloc(4096).unwrap();
    let s = registered_stream(&e);
    let reads: Vec<_> = job.buffers().to_vec();
    let writes = vec![extra.clone()];
    let g = e
        .before_op(
            &s,
            Access::Known {
                reads: &reads,
                writes: &writes,
            },
        )
        .unwrap();
    drop(g);
    gate.open();
    let rep = ck.wait().unwrap();
    assert_eq!(image_of(&store, &job), before);
    assert_eq!(rep.job_waited, Duration::ZERO, "{rep:?}");
    assert!(rep.waited_on.is_empty(), "{rep:?}");
    job.sync().unwrap();
}

#[test]
fn a_free_of_a_buffer_not_yet_saved_waits_for_that_buffer_only() {
    let p = demo_program(21);
    // As above: the copier stalls in the first buffer; the freed one is saved into a shadow
    // first, and the free waits for that copy.
    let e = engine(small_cfg(1024, 2, 64 << 20));
    let job = HostJob::new(&e, &p).unwrap();
    let victim = job.buffers().iter().max_by_key(|b| b.va()).unwrap().clone();
    let want = e.device().read_now(victim.va(), victim.size()).unwrap();
    let store = Arc::new(MemStore::new());
    let (sink, gate) = gated_sink(&store);
    let ck = e.checkpoint(sink.clone(), false).unwrap();
    e.free(victim.va()).unwrap();
    gate.open();
    let rep = ck.wait().unwrap();
    assert_eq!(store.buffer_bytes(victim.id()).unwrap(), want);
    assert_eq!(
        rep.waited_on.iter().map(|w| w.id).collect::<Vec<_>>(),
        vec![victim.id()],
        "{rep:?}"
    );
    assert!(rep.job_waited > Duration::ZERO, "{rep:?}");
}

/// A sink that records the buffer of each chunk in the order it gets them.
fn order_sink(store: &Arc<MemStore>) -> (Arc<dyn ChunkSink>, Arc<std::sync::Mutex<Vec<u64>>>) {
    let order: Arc<std::sync::Mutex<Vec<u64>>> = Arc::default();
    let o = Arc::clone(&order);
    let sink = Arc::new(TapSink {
        store: Arc::clone(store),
        tap: move |buffer| {
            let mut seen = o.lock().unwrap();
            if !seen.contains(&buffer) {
                seen.push(buffer);
            }
            Ok(())
        },
    });
    (sink, order)
}

#[test]
fn buffers_predicted_to_be_written_soonest_are_saved_first_in_that_order() {
    let p = demo_program(22);
    // One copy stream and one writer: the sink sees the buffers in the copier's order.
    let (e, job) = job_of(
        &p,
        EngineConfig {
            copy_streams: 1,
            writer_threads: 1,
            ..small_cfg(1 << 20, 2, 0)
        },
    );
    let ids: Vec<u64> = job.buffers().iter().map(|b| b.id()).collect();
    assert!(ids.len() >= 3, "{ids:?}");
    let (last, mid) = (ids[ids.len() - 1], ids[ids.len() / 2]);
    // The prediction names the last buffer, then one in the middle, then an id of no buffer.
    e.set_save_order(vec![last, mid, u64::MAX]);
    let before = job.contents().unwrap();
    let store = Arc::new(MemStore::new());
    let (sink, order) = order_sink(&store);
    let rep = e.checkpoint(sink, false).unwrap().wait().unwrap();
    assert_eq!(rep.predicted_first, 2, "{rep:?}");
    let order = order.lock().unwrap().clone();
    let mut want = vec![last, mid];
    want.extend(ids.iter().filter(|&&i| i != last && i != mid));
    assert_eq!(order, want);
    assert_eq!(image_of(&store, &job), before);
    // Without a prediction: the registry's order.
    e.set_save_order(Vec::new());
    let (sink, order) = order_sink(&Arc::new(MemStore::new()));
    let rep = e.checkpoint(sink, false).unwrap().wait().unwrap();
    assert_eq!(rep.predicted_first, 0);
    assert_eq!(*order.lock().unwrap(), ids);
}

/// A snapshot's shadows go to the buffers predicted to be written soonest: with room for two,
/// the job's writes to the two predicted buffers wait for nothing, while the copier is stalled
/// (its sink gated, both staging buffers in flight) and every other buffer is still unsaved.
#[test]
fn a_snapshot_shadows_the_buffers_predicted_to_be_written_first() {
    let mib = 1 << 20;
    let (e, bufs) = eight_buffers_serial(mib);
    let s = registered_stream(&e);
    let (b7, b5) = (bufs[7].clone(), bufs[5].clone());
    e.set_save_order(vec![b7.id(), b5.id()]);
    e.set_shadow_budget(2 * 2 * mib as u64);
    let store = Arc::new(MemStore::new());
    let (sink, gate) = gated_sink(&store);
    let h = e.checkpoint_snapshot(sink).unwrap();
    // Should a write wait after all, the gate opens after a while instead of hanging the test.
    let g = Arc::clone(&gate);
    let opener = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        g.open();
    });
    for b in [&b7, &b5] {
        let one = std::slice::from_ref(b);
        drop(
            e.before_op(
                &s,
                Access::Known {
                    reads: &[],
                    writes: one,
                },
            )
            .unwrap(),
        );
    }
    gate.open();
    let r = h.wait().unwrap();
    opener.join().unwrap();
    assert_eq!(r.snapshot_shadows, 2, "{r:?}");
    assert_eq!(r.predicted_first, 2, "{r:?}");
    assert!(r.waited_on.is_empty(), "{r:?}");
    assert_eq!(r.job_waited, Duration::ZERO, "{r:?}");
}

/// The copier saves first what the job may still wait for: with room for two shadows at T0,
/// the six buffers outside them reach the image first, in the predicted order, and the two
/// shadows (which no write waits for) after them.
#[test]
fn buffers_outside_the_snapshot_s_shadows_are_saved_before_the_shadows() {
    let mib = 1 << 20;
    // One copy stream and one writer: the sink sees the buffers in the copier's order.
    let (e, bufs) = eight_buffers_serial(mib);
    let ids: Vec<u64> = bufs.iter().map(|b| b.id()).collect();
    // Predicted: 7, 5, 2, then the rest in the registry's order.
    e.set_save_order(vec![ids[7], ids[5], ids[2]]);
    e.set_shadow_budget(2 * 2 * mib as u64);
    let store = Arc::new(MemStore::new());
    let (sink, order) = order_sink(&store);
    let r = e.checkpoint_snapshot(sink).unwrap().wait().unwrap();
    assert_eq!(r.snapshot_shadows, 2, "{r:?}");
    let order = order.lock().unwrap().clone();
    let mut want = vec![ids[2]];
    want.extend([0, 1, 3, 4, 6].map(|i| ids[i]));
    want.extend([ids[7], ids[5]]);
    assert_eq!(order, want);
}

/// The nice value of the calling thread, from /proc.
fn own_nice() -> i64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
    // After the command's closing parenthesis: state is field 3, nice field 19.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    rest.split(' ').nth(16).unwrap().parse().unwrap()
}

/// The engine's writers run at the configured nice value (the job's threads go first), and
/// the calling thread keeps its own.
#[test]
fn background_threads_take_the_configured_nice_value() {
    let mine = own_nice();
    let cfg = EngineConfig {
        background_nice: 7,
        ..small_cfg(1 << 20, 2, 0)
    };
    let e = engine(cfg);
    let p = demo_program(3);
    let job = HostJob::new(&e, &p).unwrap();
    let before = job.contents().unwrap();
    let seen: Arc<std::sync::Mutex<Vec<i64>>> = Arc::default();
    let s2 = Arc::clone(&seen);
    let store = Arc::new(MemStore::new());
    let sink = Arc::new(TapSink {
        store: Arc::clone(&store),
        tap: move |_| {
            s2.lock().unwrap().push(own_nice());
            Ok(())
        },
    });
    e.checkpoint(sink, false).unwrap().wait().unwrap();
    let seen = seen.lock().unwrap().clone();
    assert!(!seen.is_empty());
    assert!(seen.iter().all(|&n| n == 7), "{seen:?}");
    assert_eq!(own_nice(), mine);
    assert_eq!(image_of(&store, &job), before);
}

/// A copy that holds the job (a final copy) is written by `held_writer_threads`; one beside the
/// running job by `writer_threads`.
#[test]
fn a_copy_that_holds_the_job_has_its_own_writers() {
    use std::collections::HashSet;
    use std::sync::Mutex;
    for (held, want) in [(false, 1), (true, 4)] {
        let e = engine(EngineConfig {
            writer_threads: 1,
            held_writer_threads: 4,
            ..small_cfg(1 << 16, 8, 0)
        });
        for _ in 0..4 {
            e.alloc(8 << 16).unwrap();
        }
        let threads = Arc::new(Mutex::new(HashSet::new()));
        let seen = Arc::clone(&threads);
        let sink = Arc::new(TapSink {
            store: Arc::new(MemStore::new()),
            tap: move |_| {
                seen.lock().unwrap().insert(std::thread::current().id());
                // Long enough that every idle writer takes one of the 32 chunks.
                std::thread::sleep(Duration::from_millis(5));
                Ok(())
            },
        });
        let h = if held {
            e.checkpoint_held(sink.clone(), false)
        } else {
            e.checkpoint(sink.clone(), false)
        };
        let r = h.unwrap().wait().unwrap();
        assert_eq!(r.bytes, 32 << 16);
        assert_eq!(threads.lock().unwrap().len(), want, "held: {held}");
        // The report says where the time went: each of the 32 chunks spent its 5 ms in the
        // sink, whichever writer took it.
        assert_eq!(r.pipeline.writers, want, "{:?}", r.pipeline);
        assert!(
            r.pipeline.sink >= Duration::from_millis(32 * 5),
            "{:?}",
            r.pipeline
        );
    }
}
