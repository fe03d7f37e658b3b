//! The engine's tuning.

use std::time::Duration;

#[cfg(doc)]
use crate::device::Device;

/// Tuning of the engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Bytes per copy chunk (and per staging buffer).
    pub chunk_size: usize,
    /// Staging buffers: bounds the host memory a checkpoint or restore uses in flight.
    pub staging_buffers: usize,
    /// Streams the background copier spreads buffers over.
    pub copy_streams: usize,
    /// Threads writing chunks to the sink.
    pub writer_threads: usize,
    /// Threads writing chunks to the sink in a copy that holds the job until it is over
    /// ([`crate::Engine::checkpoint_held`]: a final copy); 0: `writer_threads`. Those threads
    /// also run at the job's priority, not at `background_nice`.
    pub held_writer_threads: usize,
    /// Threads restoring in the background.
    pub restore_threads: usize,
    /// Device memory a checkpoint may use for shadow copies (copy-on-write by a device-to-device
    /// copy, so the job waits for a fast copy instead of a device-to-host one). 0 disables shadows.
    pub shadow_budget: u64,
    /// Test knob: the background restorer sleeps this long before each buffer, so tests can make
    /// the job overtake it.
    #[doc(hidden)]
    pub prefetch_delay: Duration,
    /// Whether checkpoints prove their images by content: each chunk's fingerprint on the
    /// device at T0 ([`Device::fingerprint`]) against the fingerprint of the bytes copied, and
    /// pre-copy rounds and final copies take only the chunks whose fingerprint changed since they
    /// were sent (see [`crate::checkpoint`]). Off, or on a device without fingerprints: the
    /// hooks' write sets alone decide what is copied.
    pub fingerprints: bool,
    /// The nice value the engine's background threads (the copier, the writers, the
    /// restorers) take when they start, so that the job's own threads go first when the CPUs
    /// are busy; 0 leaves them at the job's. On Linux a thread's nice value is its own.
    pub background_nice: i32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            chunk_size: 8 << 20,
            staging_buffers: 8,
            copy_streams: 2,
            writer_threads: 2,
            held_writer_threads: 0,
            restore_threads: 2,
            shadow_budget: 0,
            fingerprints: true,
            prefetch_delay: Duration::ZERO,
            background_nice: 0,
        }
    }
}
