//! What the HIP backend's tests share: the simulated runtime built once per test process, a job
//! driving its buffers through the engine, and a sink held closed until the test opens it.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use possum_engine::device::{DevPtr, Device, HostBuffer, StreamPriority, Transfer};
use possum_engine::store::{ChunkSink, MemStore, TapSink};
use possum_engine::{Access, Buffer, Engine, EngineConfig, OpGuard};
use possum_hip::result::{HipPending, HipStream, Runtime};
use possum_hip::{build_runtime, BuildError, HipDevice};

/// The environment variable naming a real HIP runtime for the tests that don't need the
/// simulator (e.g. `/opt/rocm/lib/libamdhip64.so`); unset or empty, they run on the simulator.
pub const RUNTIME_ENV: &str = "POSSUM_HIP_RUNTIME";

/// The real runtime `POSSUM_HIP_RUNTIME` names, if it names one.
pub fn real_runtime() -> Option<&'static Path> {
    static REAL: OnceLock<Option<PathBuf>> = OnceLock::new();
    REAL.get_or_init(|| {
        std::env::var_os(RUNTIME_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    })
    .as_deref()
}

/// Whether the tests run on the simulated runtime (what they may assert of its exact values).
pub fn simulated() -> bool {
    real_runtime().is_none()
}

/// The runtime the tests run on: the one `POSSUM_HIP_RUNTIME` names, else the simulated one
/// (see [`simulated_runtime_or_skip`]). A real runtime, too, stays loaded for the process's life
/// (kept in `LOADED`): the tests' devices come and go, the runtime is loaded once.
pub fn runtime_or_skip(test: &str) -> Option<&'static Path> {
    static LOADED: OnceLock<Arc<Runtime>> = OnceLock::new();
    match real_runtime() {
        Some(real) => {
            LOADED.get_or_init(|| {
                Runtime::load(real).unwrap_or_else(|e| panic!("{RUNTIME_ENV}: {e}"))
            });
            Some(real)
        }
        None => simulated_runtime_or_skip(test),
    }
}

/// The simulated runtime, for a test that needs its hooks; `None` (said on stderr) when the
/// tests run on a real runtime or there is no C compiler.
///
/// Built once per test process (in a directory of the test binary's own under the target
/// directory). The library stays loaded for the process's life (the `Runtime` kept in `BUILT`):
/// its arena is at a fixed address, which a second load could not take.
pub fn simulated_runtime_or_skip(test: &str) -> Option<&'static Path> {
    if let Some(real) = real_runtime() {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: needs the simulated HIP runtime, not {} [{test}]",
            real.display()
        );
        return None;
    }
    static BUILT: OnceLock<Option<(PathBuf, Arc<Runtime>)>> = OnceLock::new();
    let built = BUILT.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(concat!("hip-sim-", env!("CARGO_CRATE_NAME")));
        std::fs::create_dir_all(&dir).expect("target tmp dir");
        match build_runtime(&dir) {
            Ok(lib) => {
                let keep = Runtime::load(&lib).expect("the simulated runtime loads");
                Some((lib, keep))
            }
            Err(BuildError::NoCompiler(_)) => None,
            Err(e) => panic!("{e}"),
        }
    });
    match built {
        Some((lib, _)) => Some(lib.as_path()),
        None => {
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: no C compiler to build the simulated HIP runtime [{test}]"
            );
            None
        }
    }
}

/// Device 0 of the runtime the tests run on (`None`, said on stderr, without a C compiler to
/// build the simulated one).
pub fn device_or_skip(test: &str) -> Option<Arc<HipDevice>> {
    let lib = runtime_or_skip(test)?;
    Some(Arc::new(HipDevice::open(lib, 0).expect("device 0 opens")))
}

/// Device 0 of the simulated runtime, for a test that needs its hooks (`None`, said on stderr,
/// on a real runtime or without a C compiler).
pub fn simulated_device_or_skip(test: &str) -> Option<Arc<HipDevice>> {
    let lib = simulated_runtime_or_skip(test)?;
    Some(Arc::new(HipDevice::open(lib, 0).expect("device 0 opens")))
}

/// Bytes that differ by buffer, step and position.
pub fn pattern(buf: usize, step: u64, len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ ((buf as u64) << 32) ^ step.wrapping_mul(0x2545_f491);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Reads `len` bytes at `va` (after the stream's earlier work).
pub fn read(dev: &HipDevice, s: &HipStream, va: DevPtr, len: u64) -> Vec<u8> {
    let buf = dev.alloc_host(len as usize).unwrap();
    let got = dev.copy_d2h(s, va, buf, len).unwrap().wait().unwrap();
    got.as_slice()[..len as usize].to_vec()
}

/// Writes `bytes` at `va`, queued on `s`.
pub fn write(dev: &HipDevice, s: &HipStream, va: DevPtr, bytes: &[u8]) -> HipPending {
    let mut buf = dev.alloc_host(bytes.len()).unwrap();
    buf.as_mut_slice().copy_from_slice(bytes);
    dev.copy_h2d(s, buf, va, bytes.len() as u64).unwrap()
}

/// A job on the HIP backend: its buffers allocated through the engine, one stream, and what each
/// buffer holds once the stream's work has run.
pub struct Job {
    pub engine: Engine<HipDevice>,
    pub dev: Arc<HipDevice>,
    pub stream: HipStream,
    pub bufs: Vec<Buffer>,
    pub model: Vec<Vec<u8>>,
    pending: Vec<HipPending>,
}

impl Job {
    /// The indices of the job's buffers, the highest address first.
    pub fn highest_first(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.bufs.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(self.bufs[i].va()));
        order
    }

    pub fn new(engine: &Engine<HipDevice>, sizes: &[u64]) -> Job {
        let dev = Arc::clone(engine.device());
        let stream = dev.create_stream(StreamPriority::Normal).unwrap();
        engine.register_stream(stream.clone());
        let bufs: Vec<Buffer> = sizes.iter().map(|&n| engine.alloc(n).unwrap()).collect();
        let mut job = Job {
            engine: engine.clone(),
            dev,
            stream,
            model: bufs.iter().map(|b| vec![0; b.size() as usize]).collect(),
            bufs,
            pending: Vec::new(),
        };
        for i in 0..sizes.len() {
            job.write(i, 0);
        }
        job.sync();
        job
    }

    /// The engine's hook for an operation on the job's stream that reads `reads` and writes
    /// `writes`: the guard to drop once it is queued.
    fn hook<'e>(
        engine: &'e Engine<HipDevice>,
        stream: &HipStream,
        reads: &[Buffer],
        writes: &[Buffer],
    ) -> OpGuard<'e, HipDevice> {
        let access = Access::Known { reads, writes };
        engine.before_op(stream, access).unwrap()
    }

    /// Writes buffer `i` whole with step `step`'s pattern, through the engine's hook.
    pub fn write(&mut self, i: usize, step: u64) {
        let b = self.bufs[i].clone();
        let bytes = pattern(i, step, b.size() as usize);
        let guard = Self::hook(&self.engine, &self.stream, &[], std::slice::from_ref(&b));
        self.pending
            .push(write(&self.dev, &self.stream, b.va(), &bytes));
        drop(guard);
        self.model[i] = bytes;
    }

    /// Copies the start of buffer `src` over the start of buffer `dst` (a read and a write).
    pub fn copy(&mut self, src: usize, dst: usize) {
        let (s, d) = (self.bufs[src].clone(), self.bufs[dst].clone());
        let n = s.size().min(d.size());
        let guard = Self::hook(
            &self.engine,
            &self.stream,
            std::slice::from_ref(&s),
            std::slice::from_ref(&d),
        );
        self.dev.copy_d2d(&self.stream, s.va(), d.va(), n).unwrap();
        drop(guard);
        let head = self.model[src][..n as usize].to_vec();
        self.model[dst][..n as usize].copy_from_slice(&head);
    }

    /// Sets the first `n` bytes of buffer `i` to `value`.
    pub fn memset(&mut self, i: usize, value: u8, n: u64) {
        let b = self.bufs[i].clone();
        let guard = Self::hook(&self.engine, &self.stream, &[], std::slice::from_ref(&b));
        self.dev.memset_d8(&self.stream, b.va(), value, n).unwrap();
        drop(guard);
        self.model[i][..n as usize].fill(value);
    }

    /// One step of work: every other buffer rewritten, a copy and a memset.
    pub fn step(&mut self, step: u64) {
        let n = self.bufs.len();
        for i in (step as usize % 2..n).step_by(2) {
            self.write(i, step);
        }
        self.copy(step as usize % n, (step as usize + 3) % n);
        self.memset((step as usize + 5) % n, step as u8, 1000);
    }

    pub fn sync(&mut self) {
        for p in self.pending.drain(..) {
            p.wait().unwrap();
        }
        self.dev.synchronize(&self.stream).unwrap();
    }

    /// Every buffer's bytes, read back through the device (after `sync`).
    pub fn contents(&self) -> Vec<Vec<u8>> {
        self.bufs
            .iter()
            .map(|b| read(&self.dev, &self.stream, b.va(), b.size()))
            .collect()
    }

    pub fn image(&self, store: &MemStore) -> Vec<Vec<u8>> {
        self.bufs
            .iter()
            .map(|b| store.buffer_bytes(b.id()).expect("buffer in image"))
            .collect()
    }
}

/// Sizes on and off the granularity, several chunks each.
pub const SIZES: &[u64] = &[
    64 << 10,
    100_000,
    3 << 16,
    150_001,
    1 << 18,
    70_000,
    128 << 10,
    90_000,
];

pub fn cfg(shadow_budget: u64) -> EngineConfig {
    EngineConfig {
        chunk_size: 16 << 10,
        staging_buffers: 3,
        copy_streams: 2,
        writer_threads: 2,
        restore_threads: 2,
        shadow_budget,
        ..EngineConfig::default()
    }
}

/// What holds a [`gated_sink`]'s chunks until the test opens it.
#[derive(Default)]
pub struct Gate {
    open: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
}

impl Gate {
    /// Lets every chunk through from now on.
    pub fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }

    fn wait(&self) {
        drop(
            self.cv
                .wait_while(self.open.lock().unwrap(), |o| !*o)
                .unwrap(),
        );
    }
}

/// A sink over `store` whose chunks wait until the test opens its [`Gate`]: the checkpoint's
/// copier stays in its first buffer while the job writes the others.
pub fn gated_sink(store: &Arc<MemStore>) -> (Arc<dyn ChunkSink>, Arc<Gate>) {
    let gate = Arc::new(Gate::default());
    let held = gate.clone();
    let sink = TapSink {
        store: store.clone(),
        tap: move |_| {
            held.wait();
            Ok(())
        },
    };
    (Arc::new(sink), gate)
}
