//! Deterministic workloads.
#![warn(missing_docs)]
