//! Sequential execution in plain memory: the ground truth a concurrent run must equal.

use crate::kernel;
use crate::program::{Op, Program};

/// The state of a program's buffers, executed in issue order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    /// Buffer contents.
    pub bufs: Vec<Vec<u8>>,
}

impl Reference {
    /// The initial state of `p`.
    pub fn new(p: &Program) -> Self {
        Reference {
            bufs: p
                .sizes
                .iter()
                .enumerate()
                .map(|(i, &s)| kernel::initial(p.seed, i, s))
                .collect(),
        }
    }

    /// Executes one operation.
    pub fn run(&mut self, op: &Op) {
        let mut outs: Vec<Vec<u8>> = op
            .writes
            .iter()
            .map(|&w| std::mem::take(&mut self.bufs[w]))
            .collect();
        {
            let ins: Vec<&[u8]> = op.reads.iter().map(|&r| self.bufs[r].as_slice()).collect();
            let mut o: Vec<&mut [u8]> = outs.iter_mut().map(|v| v.as_mut_slice()).collect();
            kernel::apply(op.salt, &ins, &mut o);
        }
        for (&w, v) in op.writes.iter().zip(outs) {
            self.bufs[w] = v;
        }
    }

    /// Executes several.
    pub fn run_all<'a>(&mut self, ops: impl IntoIterator<Item = &'a Op>) {
        ops.into_iter().for_each(|op| self.run(op));
    }

    /// Digest of the whole state.
    pub fn digest(&self) -> u64 {
        kernel::digest(self.bufs.iter().map(Vec::as_slice))
    }
}
