//! possum's engine: checkpoint and restore of device buffers while the job runs.
//!
//! The engine knows nothing about CUDA: it talks to a [`device::Device`]. See ARCHITECTURE.md.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod addresses;
pub mod checkpoint;
pub mod device;
mod engine;
pub mod fingerprint;
pub mod gate;
pub mod host;
pub mod image;
pub mod registry;
pub mod restore;
mod session;
pub mod staging;
pub mod store;

pub use checkpoint::{CheckpointHandle, CheckpointReport};
pub use engine::{
    Access, Engine, EngineConfig, EngineError, OpGuard, Prints, RoundReport, Stats, MISMATCH_TEXT,
};
pub use registry::{Buffer, Residency};
pub use restore::{RestoreHandle, RestoreReport, Staged, StagedMemory};
pub use session::{SessionHandle, WaitedOn, WAITED_ON_TOP};
