//! Runs a program on the engine's host backend, as a well-behaved multi-stream job would.

use std::sync::Arc;

use possum_engine::device::{Device, StreamPriority};
use possum_engine::host::{HostDevice, HostEvent, HostStream};
use possum_engine::{Access, Buffer, Engine, EngineError};

use crate::kernel;
use crate::program::{Op, Program};

#[derive(Default, Clone)]
struct Deps {
    last_write: Option<(usize, HostEvent)>,
    reads_since: Vec<(usize, HostEvent)>,
}

/// A job on the host backend: its buffers (managed by the engine), its streams, and the events that
/// order its streams.
pub struct HostJob {
    engine: Engine<HostDevice>,
    dev: Arc<HostDevice>,
    streams: Vec<HostStream>,
    bufs: Vec<Buffer>,
    deps: Vec<Deps>,
    /// Split hook, as the interposer calls it: buffers given to the engine only while it tracks.
    lazy: bool,
}

impl std::fmt::Debug for HostJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostJob")
            .field("buffers", &self.bufs.len())
            .field("streams", &self.streams.len())
            .finish()
    }
}

impl HostJob {
    /// Allocates the program's buffers through the engine, fills them with their initial contents,
    /// and creates and registers its streams.
    pub fn new(engine: &Engine<HostDevice>, p: &Program) -> Result<Self, EngineError> {
        let dev = Arc::clone(engine.device());
        let streams = (0..p.streams.max(1))
            .map(|_| dev.create_stream(StreamPriority::Normal))
            .collect::<Result<Vec<_>, _>>()?;
        for s in &streams {
            engine.register_stream(s.clone());
        }
        let mut bufs = Vec::with_capacity(p.sizes.len());
        for (i, &size) in p.sizes.iter().enumerate() {
            let b = engine.alloc(size)?;
            dev.write_now(b.va(), &kernel::initial(p.seed, i, size))?;
            bufs.push(b);
        }
        Ok(HostJob {
            engine: engine.clone(),
            dev,
            streams,
            deps: vec![Deps::default(); bufs.len()],
            bufs,
            lazy: false,
        })
    }

    /// With `lazy`, each operation is admitted with [`Engine::enter_op`] and its buffers are
    /// checked only if the engine is tracking (the interposer's way); else [`Engine::before_op`].
    pub fn lazy_hook(mut self, lazy: bool) -> Self {
        self.lazy = lazy;
        self
    }

    /// The managed buffers, in program order.
    pub fn buffers(&self) -> &[Buffer] {
        &self.bufs
    }

    /// Issues one operation: the engine's hook, the cross-stream waits it needs, the kernel.
    pub fn issue(&mut self, op: &Op) -> Result<(), EngineError> {
        let s = op.stream % self.streams.len();
        let stream = self.streams[s].clone();
        let reads: Vec<Buffer> = op.reads.iter().map(|&i| self.bufs[i].clone()).collect();
        let writes: Vec<Buffer> = op.writes.iter().map(|&i| self.bufs[i].clone()).collect();
        let access = Access::Known {
            reads: &reads,
            writes: &writes,
        };
        let guard = if self.lazy {
            let g = self.engine.enter_op();
            if g.tracking() {
                g.check(&stream, access)?;
            }
            g
        } else {
            self.engine.before_op(&stream, access)?
        };
        // Wait for other streams' conflicting work (read-after-write, write-after-read/write).
        for &r in &op.reads {
            if let Some((t, ev)) = &self.deps[r].last_write {
                if *t != s {
                    self.dev.wait_event(&stream, ev)?;
                }
            }
        }
        for &w in &op.writes {
            let d = &self.deps[w];
            for (t, ev) in d.last_write.iter().chain(d.reads_since.iter()) {
                if *t != s {
                    self.dev.wait_event(&stream, ev)?;
                }
            }
        }
        let r: Vec<_> = reads.iter().map(|b| (b.va(), b.size())).collect();
        let w: Vec<_> = writes.iter().map(|b| (b.va(), b.size())).collect();
        let salt = op.salt;
        self.dev.launch(&stream, move |mem| {
            mem.with(&r, &w, |ins, outs| kernel::apply(salt, ins, outs))
        })?;
        drop(guard);
        let ev = self.dev.record_event(&stream)?;
        for &r in &op.reads {
            self.deps[r].reads_since.push((s, ev.clone()));
        }
        for &w in &op.writes {
            self.deps[w] = Deps {
                last_write: Some((s, ev.clone())),
                reads_since: Vec::new(),
            };
        }
        Ok(())
    }

    /// Waits for all of the job's streams.
    pub fn sync(&self) -> Result<(), EngineError> {
        for s in &self.streams {
            self.dev.synchronize(s)?;
        }
        Ok(())
    }

    /// Forgets cross-stream ordering state (after a restore rewinds the job: the old events are done).
    pub fn reset_deps(&mut self) {
        self.deps = vec![Deps::default(); self.bufs.len()];
    }

    /// Reads every buffer (call after `sync`).
    pub fn contents(&self) -> Result<Vec<Vec<u8>>, EngineError> {
        self.bufs
            .iter()
            .map(|b| Ok(self.dev.read_now(b.va(), b.size())?))
            .collect()
    }

    /// Digest of every buffer (call after `sync`).
    pub fn digest(&self) -> Result<u64, EngineError> {
        let c = self.contents()?;
        Ok(kernel::digest(c.iter().map(Vec::as_slice)))
    }
}
