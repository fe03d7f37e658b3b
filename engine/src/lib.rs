//! possum's engine: checkpoint and restore of device buffers while the job runs.
//!
//! The engine knows nothing about CUDA: it talks to a [`device::Device`]. See ARCHITECTURE.md.
#![warn(missing_docs)]

pub mod device;
pub mod image;
pub mod store;
