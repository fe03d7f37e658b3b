//! Deterministic workloads for possum's tests and demo.
//!
//! A [`program::Program`] is a list of operations, each on a stream with the buffers it reads and
//! writes. [`reference::Reference`] executes it sequentially in plain memory: the ground truth.
//! [`host::HostJob`] runs it for real on the engine's host backend, on several streams, inserting the
//! cross-stream event waits a correct job would (so the concurrent run must equal the sequential one),
//! and calling the engine's hook before every operation.
//!
//! GPU workloads (PyTorch jobs, CUDA C programs) live beside this crate as scripts.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod copyjob;
pub mod demo;
pub mod host;
pub mod kernel;
pub mod program;
pub mod reference;
pub mod rng;
