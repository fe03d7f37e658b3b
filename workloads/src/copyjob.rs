//! A job of device-to-device copies on several streams, generic over the engine's `Device`: the
//! same check runs on the host backend (in CI) and on a GPU (`possum-cuda-engine-check`).
//!
//! The job runs steps of random copies between its buffers (each step waits for its copies, as a
//! training step waits for its loss). Mid-run a concurrent checkpoint is taken while the job goes
//! on; then the device memory is released, restored on demand from the image, and the job resumes
//! from the checkpointed step. The image is compared with a host reference at T0 and the final
//! device contents with the reference of an uninterrupted run, bit for bit.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use possum_engine::device::{Device, HostBuffer, StreamPriority, Transfer};
use possum_engine::image::{Image, ImageWriter, WriterOptions};
use possum_engine::store::{ChunkSink, ChunkSource, MemStore};
use possum_engine::{Access, Buffer, CheckpointReport, Engine, EngineError, RestoreReport};

use crate::rng::Rng;

/// Parameters of the copy job.
#[derive(Clone, Debug)]
pub struct CopySpec {
    /// Number of buffers.
    pub buffers: usize,
    /// Bytes per buffer (a multiple of 8).
    pub buffer_bytes: u64,
    /// Job streams.
    pub streams: usize,
    /// Copies per step.
    pub ops_per_step: usize,
    /// Steps in all.
    pub steps: u64,
    /// The step after whose issue the checkpoint begins.
    pub at: u64,
    /// Largest copy, bytes (the host reference replays every copy, so keep this modest).
    pub max_op_bytes: u64,
    /// Seed.
    pub seed: u64,
}

/// Where the checkpoint goes.
#[derive(Clone, Debug)]
pub enum Target {
    /// Host memory.
    Memory,
    /// An image directory on disk.
    Dir(PathBuf),
}

/// Figures of one run.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CopyReport {
    /// The device's name.
    pub device: String,
    /// "memory" or "disk".
    pub target: String,
    /// Bytes of buffers.
    pub bytes: u64,
    /// Number of buffers.
    pub buffers: usize,
    /// Median step time before the checkpoint, ms.
    pub step_ms: f64,
    /// Slowest step during the checkpoint minus the median step, ms.
    pub stall_ms: f64,
    /// Time the job's thread was blocked in the engine's hook during the checkpoint, ms.
    pub stall_engine_blocked_ms: f64,
    /// Steps completed while the checkpoint ran.
    pub steps_during_checkpoint: usize,
    /// From T0 to every byte copied off the device, ms.
    pub captured_ms: f64,
    /// Capture throughput, GB/s.
    pub capture_gbps: f64,
    /// From T0 to the image complete, ms.
    pub checkpoint_ms: f64,
    /// Checkpoint throughput, GB/s.
    pub checkpoint_gbps: f64,
    /// Copy-on-write by priority device-to-host copy.
    pub cow_priority: u64,
    /// Copy-on-write by shadow copy.
    pub cow_shadow: u64,
    /// From restore start to the first step completed, ms.
    pub restore_first_step_ms: f64,
    /// From restore start to every buffer back, ms.
    pub restore_ms: f64,
    /// Restore throughput, GB/s.
    pub restore_gbps: f64,
    /// Buffers restored on demand.
    pub on_demand: u64,
    /// Buffers prefetched.
    pub prefetched: u64,
    /// The image equals the reference at T0.
    pub image_bitexact: bool,
    /// The restored job ended equal to an uninterrupted run.
    pub final_bitexact: bool,
    /// Both.
    pub bitexact: bool,
}

#[derive(Clone, Debug)]
struct CopyOp {
    stream: usize,
    src: usize,
    dst: usize,
    src_off: u64,
    dst_off: u64,
    len: u64,
}

fn step_ops(spec: &CopySpec, step: u64) -> Vec<CopyOp> {
    let mut rng = Rng::new(spec.seed ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let words = spec.buffer_bytes / 8;
    (0..spec.ops_per_step)
        .map(|_| {
            let src = rng.below(spec.buffers as u64) as usize;
            let mut dst = rng.below(spec.buffers as u64 - 1) as usize;
            if dst >= src {
                dst += 1;
            }
            let len = 1 + rng.below((words / 2).min(spec.max_op_bytes / 8).max(1));
            CopyOp {
                stream: rng.below(spec.streams as u64) as usize,
                src,
                dst,
                src_off: rng.below(words - len + 1) * 8,
                dst_off: rng.below(words - len + 1) * 8,
                len: len * 8,
            }
        })
        .collect()
}

fn pattern(seed: u64, buf: usize, off: u64, out: &mut [u8]) {
    for (i, w) in out.chunks_exact_mut(8).enumerate() {
        let word = (off / 8) + i as u64;
        w.copy_from_slice(
            &(seed ^ ((buf as u64) << 40) ^ word.wrapping_mul(0x9e37_79b9)).to_le_bytes(),
        );
    }
}

struct Reference(Vec<Vec<u8>>);

impl Reference {
    fn new(spec: &CopySpec) -> Self {
        Reference(
            (0..spec.buffers)
                .map(|b| {
                    let mut v = vec![0u8; to_usize(spec.buffer_bytes)];
                    pattern(spec.seed, b, 0, &mut v);
                    v
                })
                .collect(),
        )
    }
    fn run(&mut self, op: &CopyOp) {
        let (s, d, l) = (to_usize(op.src_off), to_usize(op.dst_off), to_usize(op.len));
        let src = self.0[op.src][s..s + l].to_vec();
        self.0[op.dst][d..d + l].copy_from_slice(&src);
    }
}

fn to_usize(v: u64) -> usize {
    usize::try_from(v).expect("fits in memory")
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

struct Job<D: Device> {
    engine: Engine<D>,
    streams: Vec<D::Stream>,
    bufs: Vec<Buffer>,
    last_write: Vec<Option<(usize, D::Event)>>,
    reads_since: Vec<Vec<(usize, D::Event)>>,
}

impl<D: Device> Job<D> {
    fn issue(&mut self, op: &CopyOp) -> Result<(), EngineError> {
        let dev = Arc::clone(self.engine.device());
        let s = op.stream;
        let stream = self.streams[s].clone();
        let (src, dst) = (self.bufs[op.src].clone(), self.bufs[op.dst].clone());
        let g = self.engine.before_op(
            &stream,
            Access::Known {
                reads: std::slice::from_ref(&src),
                writes: std::slice::from_ref(&dst),
            },
        )?;
        let mut waits: Vec<&D::Event> = Vec::new();
        if let Some((t, ev)) = &self.last_write[op.src] {
            if *t != s {
                waits.push(ev);
            }
        }
        for (t, ev) in self.last_write[op.dst]
            .iter()
            .chain(self.reads_since[op.dst].iter())
        {
            if *t != s {
                waits.push(ev);
            }
        }
        for ev in waits {
            dev.wait_event(&stream, ev)?;
        }
        dev.copy_d2d(
            &stream,
            src.va().add(op.src_off),
            dst.va().add(op.dst_off),
            op.len,
        )?;
        drop(g);
        let ev = dev.record_event(&stream)?;
        self.reads_since[op.src].push((s, ev.clone()));
        self.last_write[op.dst] = Some((s, ev));
        self.reads_since[op.dst].clear();
        Ok(())
    }

    fn sync(&self) -> Result<(), EngineError> {
        for s in &self.streams {
            self.engine.device().synchronize(s)?;
        }
        Ok(())
    }

    fn run_step(&mut self, spec: &CopySpec, step: u64) -> Result<Duration, EngineError> {
        let t = Instant::now();
        for op in step_ops(spec, step) {
            self.issue(&op)?;
        }
        self.sync()?;
        Ok(t.elapsed())
    }

    fn reset_deps(&mut self) {
        self.last_write.iter_mut().for_each(|x| *x = None);
        self.reads_since.iter_mut().for_each(Vec::clear);
    }
}

/// Reads `size` bytes at `b` back to host memory through a staging buffer.
fn read_back<D: Device>(
    dev: &D,
    stream: &D::Stream,
    b: &Buffer,
    chunk: usize,
) -> Result<Vec<u8>, EngineError> {
    let mut out = vec![0u8; to_usize(b.size())];
    let mut hb = dev.alloc_host(chunk)?;
    let mut off = 0u64;
    while off < b.size() {
        let len = (chunk as u64).min(b.size() - off);
        hb = dev.copy_d2h(stream, b.va().add(off), hb, len)?.wait()?;
        out[to_usize(off)..to_usize(off + len)].copy_from_slice(&hb.as_slice()[..to_usize(len)]);
        off += len;
    }
    Ok(out)
}

fn source_bytes(src: &dyn ChunkSource, id: u64, size: u64) -> Result<Vec<u8>, EngineError> {
    let mut v = vec![0u8; to_usize(size)];
    for (off, len) in src.chunks(id) {
        src.read_chunk(id, off, &mut v[to_usize(off)..to_usize(off + len)])?;
    }
    Ok(v)
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Runs the whole check on `engine`'s device.
pub fn run<D: Device>(
    engine: &Engine<D>,
    spec: &CopySpec,
    target: &Target,
) -> Result<CopyReport, EngineError> {
    assert!(spec.buffers >= 2 && spec.at + 1 < spec.steps && spec.buffer_bytes.is_multiple_of(8));
    let dev = Arc::clone(engine.device());
    let chunk = engine.config().chunk_size;
    let mut job = Job::start(engine, spec)?;
    let mut reference = Reference::new(spec);
    let ck = checkpoint_mid_run(engine, &mut job, &mut reference, spec, target)?;
    let mut image_ok = true;
    for (i, b) in job.bufs.iter().enumerate() {
        if source_bytes(&*ck.source, b.id(), b.size())? != reference.0[i] {
            image_ok = false;
        }
    }
    let (first, rsr) = fail_and_restore(engine, &mut job, &mut reference, spec, &ck.source)?;
    let mut final_ok = true;
    for (i, b) in job.bufs.iter().enumerate() {
        if read_back(&*dev, &job.streams[0], b, chunk)? != reference.0[i] {
            final_ok = false;
        }
    }
    for b in &job.bufs {
        engine.free(b.va())?;
    }
    let Checkpointed {
        mut normal,
        during,
        report: ckr,
        ..
    } = ck;
    let bytes = spec.buffer_bytes * spec.buffers as u64;
    let normal_ms = median(&mut normal);
    let worst = during.iter().copied().max().unwrap_or_default();
    Ok(CopyReport {
        device: dev.name(),
        target: match target {
            Target::Memory => "memory".into(),
            Target::Dir(_) => "disk".into(),
        },
        bytes,
        buffers: spec.buffers,
        step_ms: ms(normal_ms),
        stall_ms: ms(worst.saturating_sub(normal_ms)),
        stall_engine_blocked_ms: ms(ckr.hook_blocked_total),
        steps_during_checkpoint: during.len(),
        captured_ms: ms(ckr.captured),
        capture_gbps: bytes as f64 / ckr.captured.as_secs_f64() / 1e9,
        checkpoint_ms: ms(ckr.elapsed),
        checkpoint_gbps: bytes as f64 / ckr.elapsed.as_secs_f64() / 1e9,
        cow_priority: ckr.cow_priority,
        cow_shadow: ckr.cow_shadow,
        restore_first_step_ms: ms(first),
        restore_ms: ms(rsr.elapsed),
        restore_gbps: bytes as f64 / rsr.elapsed.as_secs_f64() / 1e9,
        on_demand: rsr.on_demand,
        prefetched: rsr.prefetched,
        image_bitexact: image_ok,
        final_bitexact: final_ok,
        bitexact: image_ok && final_ok,
    })
}

impl<D: Device> Job<D> {
    /// The job on `engine`: its streams registered, its buffers allocated and filled with their
    /// patterns.
    fn start(engine: &Engine<D>, spec: &CopySpec) -> Result<Job<D>, EngineError> {
        let dev = Arc::clone(engine.device());
        let chunk = engine.config().chunk_size;
        let streams = (0..spec.streams.max(1))
            .map(|_| dev.create_stream(StreamPriority::Normal))
            .collect::<Result<Vec<_>, _>>()?;
        for s in &streams {
            engine.register_stream(s.clone());
        }
        // Allocate and fill.
        let mut bufs = Vec::with_capacity(spec.buffers);
        let mut hb = dev.alloc_host(chunk)?;
        for b in 0..spec.buffers {
            let buf = engine.alloc(spec.buffer_bytes)?;
            let mut off = 0;
            while off < spec.buffer_bytes {
                let len = (chunk as u64).min(spec.buffer_bytes - off);
                pattern(spec.seed, b, off, &mut hb.as_mut_slice()[..to_usize(len)]);
                hb = dev
                    .copy_h2d(&streams[0], hb, buf.va().add(off), len)?
                    .wait()?;
                off += len;
            }
            bufs.push(buf);
        }
        Ok(Job {
            engine: engine.clone(),
            streams,
            last_write: vec![None; spec.buffers],
            reads_since: vec![Vec::new(); spec.buffers],
            bufs,
        })
    }
}

/// The checkpoint taken mid-run, and the steps around it.
struct Checkpointed {
    /// Each step's time before the checkpoint.
    normal: Vec<Duration>,
    /// Each step's time while it ran (the first: step `at`, T0 in it).
    during: Vec<Duration>,
    report: CheckpointReport,
    /// The image, to read and restore from.
    source: Arc<dyn ChunkSource>,
}

/// Runs the steps before `spec.at` (the reference with them), then checkpoints into `target`
/// with T0 right after step `at` is issued, the job stepping on until the checkpoint ends.
fn checkpoint_mid_run<D: Device>(
    engine: &Engine<D>,
    job: &mut Job<D>,
    reference: &mut Reference,
    spec: &CopySpec,
    target: &Target,
) -> Result<Checkpointed, EngineError> {
    let mut normal = Vec::new();
    for step in 0..spec.at {
        normal.push(job.run_step(spec, step)?);
        step_ops(spec, step).iter().for_each(|op| reference.run(op));
    }
    // T0: right after step `at` is issued, while it runs.
    let t = Instant::now();
    for op in step_ops(spec, spec.at) {
        job.issue(&op)?;
        reference.run(&op);
    }
    let mem = Arc::new(MemStore::new());
    let (sink, writer): (Arc<dyn ChunkSink>, Option<Arc<ImageWriter>>) = match target {
        Target::Memory => (mem.clone(), None),
        Target::Dir(d) => {
            let w = Arc::new(ImageWriter::create(
                d,
                WriterOptions {
                    force: true,
                    ..WriterOptions::default()
                },
            )?);
            (w.clone(), Some(w))
        }
    };
    let ck = engine.checkpoint(Arc::clone(&sink), false)?;
    job.sync()?;
    let mut during = vec![t.elapsed()];
    let mut step = spec.at + 1;
    while !ck.is_finished() && step < spec.steps {
        during.push(job.run_step(spec, step)?);
        step += 1;
    }
    let report = ck.wait()?;
    job.sync()?;
    drop(sink);
    let source: Arc<dyn ChunkSource> = match (target, writer) {
        (Target::Dir(d), Some(w)) => {
            Arc::into_inner(w)
                .expect("the engine let go of the image writer")
                .commit()?;
            Arc::new(Image::open(d)?)
        }
        _ => mem,
    };
    Ok(Checkpointed {
        normal,
        during,
        report,
        source,
    })
}

/// Failure: release, restore from `source` on demand, resume after step `at` and run to the end
/// (the reference with it). The time to the first step's end, and the restore's report.
fn fail_and_restore<D: Device>(
    engine: &Engine<D>,
    job: &mut Job<D>,
    reference: &mut Reference,
    spec: &CopySpec,
    source: &Arc<dyn ChunkSource>,
) -> Result<(Duration, RestoreReport), EngineError> {
    engine.release()?;
    job.reset_deps();
    let t = Instant::now();
    let rs = engine.restore(Arc::clone(source))?;
    job.run_step(spec, spec.at + 1)?;
    let first = t.elapsed();
    for s in spec.at + 1..spec.steps {
        if s > spec.at + 1 {
            job.run_step(spec, s)?;
        }
        step_ops(spec, s).iter().for_each(|op| reference.run(op));
    }
    let rsr = rs.wait()?;
    job.sync()?;
    Ok((first, rsr))
}
