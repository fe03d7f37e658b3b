//! What a sequence tells its caller as it goes.

use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use crate::wire::Written;

/// Told how a sequence goes: the copy of the job's buffers (for a progress bar), and what the
/// user should know that is not an error (the sequences print nothing themselves).
pub trait Observer {
    /// The copy of `total` bytes of the job's buffers into `dir` begins.
    fn copying(&mut self, total: u64, dir: &Path);
    /// It is over (may be told more than once).
    fn copied(&mut self);
    /// Something the user should know (a step taken again, a check that could not be made).
    fn note(&mut self, what: &str);
    /// The first pre-copy round begins: the job is about to write the GPU images under `dir`,
    /// the temporary directory, while it runs. An observer that returns true reads `journal`
    /// while it does, as at [`Observer::cutting`] (the job's process only, not the other
    /// processes of its tree). Engine possum only.
    fn first_round(&mut self, dir: &Path, journal: &Path) -> bool {
        let _ = (dir, journal);
        false
    }
    /// The pre-copy is over and the job runs on until the cut: what it wrote is under `dir`, the
    /// image's temporary directory, which the cut then completes (a migration sends it ahead
    /// from here); `written`, what the round wrote into its data files. Told after each round,
    /// engine possum only.
    fn precopied(&mut self, dir: &Path, written: &Written) {
        let _ = (dir, written);
    }
    /// The pre-copy rounds are over and nothing of the job is held (no ranks stand at a
    /// collective): the cut comes once this returns. A migration waits here, bounded, for its
    /// destination to load what was sent ahead. Engine possum only.
    fn ready_to_cut(&mut self) {}
    /// The cut begins: the job's final copy is about to write the GPU images under `dir`, the
    /// temporary directory. An observer that returns true reads `journal` while it does: each
    /// chunk the copy completes is recorded there (`JournalWrites`, the engine's
    /// `JournalRecord`s; the file is the sequence's, gone once the copy is over, and may stay
    /// empty if the job cannot write it). Engine possum only.
    fn cutting(&mut self, dir: &Path, journal: &Path) -> bool {
        let _ = (dir, journal);
        false
    }
    /// The job is held and the cut completed its GPU images, the directories `gpu` (each
    /// relative to `dir`, the temporary directory): `written`, what the cut's copy wrote into
    /// their data files since the last round. The driver's checkpoint and CRIU's dump come next
    /// (a migration sends the images from here, while they work). Engine possum only.
    fn held(&mut self, dir: &Path, gpu: &[String], written: &Written) {
        let _ = (dir, gpu, written);
    }
    /// CRIU's dump is over; the image is committed next (what began at [`Observer::held`] ends
    /// here). Told only after [`Observer::held`].
    ///
    /// The time it waited there, the job held, for work of its own begun at
    /// [`Observer::held`] (part of the hold's figures), if any.
    fn dumped(&mut self) -> Option<Duration> {
        None
    }
    /// CRIU's dump failed for a passing reason and runs again into the same directory: what it
    /// wrote there so far is written again (a file sent while it was written is stale).
    fn dumping_again(&mut self) {}
    /// Where a migration is, for a progress line: told as it moves on.
    fn migrating(&mut self, step: MigrateStep) {
        let _ = step;
    }
}

/// Where a migration is ([`Observer::migrating`]).
#[derive(Debug, Clone)]
pub enum MigrateStep {
    /// The connection is made: `sent` counts the image's bytes sent from now on, every stream
    /// (read it from another thread as it grows).
    Connected {
        /// The bytes sent.
        sent: Arc<AtomicU64>,
    },
    /// Pre-copy round `round` (from 1) wrote `bytes` and was sent ahead, the job running.
    Round {
        /// Its number.
        round: usize,
        /// The bytes it wrote.
        bytes: u64,
        /// The downtime expected if the cut came now ([`crate::migrate::estimated_downtime`]).
        estimate: Option<Duration>,
    },
    /// The rounds are sent ahead: the job runs on while the destination loads them into GPU
    /// memory, at most `limit`.
    Loading {
        /// The wait's limit.
        limit: Duration,
    },
    /// The job is held: the rest of the image goes out.
    Held,
    /// The destination restores the job.
    Restoring,
}

/// An [`Observer`] that shows nothing and drops the notes.
#[derive(Debug, Default)]
pub struct Quiet;

impl Observer for Quiet {
    fn copying(&mut self, _: u64, _: &Path) {}
    fn copied(&mut self) {}
    fn note(&mut self, _: &str) {}
}
