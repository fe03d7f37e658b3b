//! possum's analyzer: which buffers each operation touches, and in what order they are needed.
//!
//! The analyzer never calls the driver: the interposer hands it parameter buffers, layouts,
//! checksums and launch records, and it answers with predictions and graphs.
//!
//! # Speculation
//!
//! A kernel launch passes a packed parameter buffer whose layout ([`ParamLayout`]) comes from the
//! driver or, failing that, from the cubin's `.nv.info.<kernel>` section ([`nvinfo`]); AMDGPU
//! code objects' argument metadata gives the same layouts ([`amdgpu`], there for a HIP front end
//! that is not built yet). Every pointer-sized word of every parameter, including the words inside
//! by-value structs, is a [`Slot`]. A slot whose value falls inside a live allocation (an [`IntervalMap`] look-up) names
//! that buffer. Each named buffer is taken as read-write until validation has shown that slot's
//! buffer unchanged across `readonly_after` validated launches (2 by default; 0 with `strict`)
//! and never changed: then it is speculated read-only ([`KernelModel::is_readonly`]).
//! Observation cannot prove that a later launch does not write; what makes the speculation safe
//! is the engine's proof by content: every image is checked chunk by chunk against the job's
//! fingerprints at T0 before it is committed, and a mismatch takes every read-only verdict back
//! ([`KernelModel::revoke_readonly`]) before the checkpoint is taken again.
//! Buffers no slot names are predicted untouched once a validation checked the kernel
//! ([`KernelModel::is_validated`]).
//!
//! # Validation
//!
//! The first launches of each kernel (and then every Kth, per [`ValidationConfig`]) are checked:
//! the interposer checksums every buffer, named or not, whole (or, when asked, sampled windows:
//! [`sample_windows`], [`checksum`]) before and after the launch, and looks for device pointers inside
//! the named buffers ([`find_pointers`]). The result ([`Validation`]) goes to
//! [`KernelModel::record_validation`]. A change in an unnamed buffer, or a pointer table behind a
//! named one, makes the kernel **opaque** for good: it is then treated as touching every buffer.
//! A slot whose buffer changed is read-write forever.
//!
//! # The DAG
//!
//! [`Dag`] keeps an aggregate bipartite graph of kernels (copies and memsets as pseudo-kernels)
//! and buffers, with read and write counts, and a bounded window of the last launches as a true
//! dependency DAG (RAW, WAR, WAW and stream order). The window's order of first use is the
//! prefetch order for a restore.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod amdgpu;
pub mod dag;
mod elfbytes;
pub mod intervals;
pub mod kernel;
pub mod layout;
pub mod nvinfo;

pub use amdgpu::{AmdgpuError, AmdgpuKernel, ArgKind, KernelArg};
pub use dag::{BufRef, Dag, DepKind, EdgeKind, KernelRef, MEMCPY_HANDLE, MEMSET_HANDLE};
pub use elfbytes::ElfError;
pub use intervals::IntervalMap;
pub use kernel::{
    checksum, find_pointers, sample_windows, KernelModel, KernelStats, SlotAccess, Validation,
    ValidationConfig, Verdict,
};
pub use layout::{Param, ParamLayout, Slot, MAX_SLOTS};
pub use nvinfo::{param_layouts, NvInfoError};
