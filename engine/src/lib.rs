//! possum's engine: checkpoint and restore of device buffers while the job runs.
//!
//! The engine knows nothing about CUDA: it talks to a [`device::Device`]. See ARCHITECTURE.md.
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod addresses;
pub mod backend;
pub mod checkpoint;
mod config;
pub mod device;
mod engine;
mod error;
pub mod fingerprint;
pub mod gate;
pub mod host;
pub mod image;
pub mod pipeline;
pub mod registry;
pub mod restore;
mod session;
mod shared;
pub mod staging;
pub mod store;

pub use checkpoint::{CheckpointHandle, CheckpointReport};
pub use config::EngineConfig;
pub use engine::{Engine, OpGuard, Prints, RoundReport, Stats};
pub use error::{EngineError, MISMATCH_TEXT};
pub use pipeline::Pipeline;
pub use registry::{Buffer, Residency};
pub use restore::{RestoreHandle, RestoreReport, Staged, StagedMemory};
pub use session::{SessionHandle, WaitedOn, WAITED_ON_TOP};
pub use shared::Access;
