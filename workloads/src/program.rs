//! Programs: operations on streams with read and write sets.

use crate::rng::Rng;

/// One operation of the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op {
    /// Which of the job's streams it runs on.
    pub stream: usize,
    /// Buffers it only reads (indices into the program's buffers).
    pub reads: Vec<usize>,
    /// Buffers it writes (and may read); disjoint from `reads`, not empty.
    pub writes: Vec<usize>,
    /// Makes each operation's effect distinct.
    pub salt: u64,
}

/// A program: buffers and operations in issue order.
#[derive(Clone, Debug)]
pub struct Program {
    /// Buffer sizes in bytes (multiples of 8).
    pub sizes: Vec<u64>,
    /// Number of streams.
    pub streams: usize,
    /// Seed of the initial contents.
    pub seed: u64,
    /// The operations.
    pub ops: Vec<Op>,
}

/// Parameters of a random program.
#[derive(Clone, Debug)]
pub struct Shape {
    /// Number of buffers.
    pub buffers: usize,
    /// Smallest and largest buffer, in bytes.
    pub size_range: (u64, u64),
    /// Number of streams.
    pub streams: usize,
    /// Number of operations.
    pub ops: usize,
    /// At most this many buffers read per operation.
    pub max_reads: usize,
    /// At most this many buffers written per operation.
    pub max_writes: usize,
}

impl Program {
    /// A random program of the given shape.
    pub fn random(seed: u64, shape: &Shape) -> Program {
        let mut rng = Rng::new(seed);
        let (lo, hi) = shape.size_range;
        let sizes = (0..shape.buffers)
            .map(|_| (lo + rng.below(hi - lo + 1)).max(8) / 8 * 8)
            .collect();
        let mut p = Program {
            sizes,
            streams: shape.streams,
            seed,
            ops: Vec::new(),
        };
        p.ops = (0..shape.ops)
            .map(|_| p.random_op(&mut rng, shape.max_reads, shape.max_writes))
            .collect();
        p
    }

    fn random_op(&self, rng: &mut Rng, max_reads: usize, max_writes: usize) -> Op {
        let n = self.sizes.len() as u64;
        let nw = 1 + rng.below(max_writes.max(1) as u64) as usize;
        let nr = rng.below(max_reads as u64 + 1) as usize;
        let mut picked: Vec<usize> = Vec::new();
        while picked.len() < (nw + nr).min(self.sizes.len()) {
            let b = rng.below(n) as usize;
            if !picked.contains(&b) {
                picked.push(b);
            }
        }
        let reads = picked.split_off(nw.min(picked.len()));
        Op {
            stream: rng.below(self.streams as u64) as usize,
            reads,
            writes: picked,
            salt: rng.next_u64(),
        }
    }

    /// Operations of step `step` of a step-structured job (the demo): `per_step` operations drawn
    /// from a generator seeded by the step, so any step can be regenerated after a restore.
    pub fn step_ops(&self, step: u64, per_step: usize) -> Vec<Op> {
        let mut rng = Rng::new(self.seed ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xabcd);
        (0..per_step)
            .map(|_| self.random_op(&mut rng, 2, 1))
            .collect()
    }

    /// Total bytes of the buffers.
    pub fn bytes(&self) -> u64 {
        self.sizes.iter().sum()
    }
}
