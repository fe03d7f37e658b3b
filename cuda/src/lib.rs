//! possum's CUDA backend: [`CudaDevice`] implements the engine's
//! [`Device`](possum_engine::device::Device) trait on the CUDA driver API.
//!
//! - Memory: virtual address ranges are reserved (`cuMemAddressReserve`) and physical memory is
//!   mapped under them (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`) or released (`cuMemUnmap` +
//!   `cuMemRelease`) without the addresses changing. A mapping is reachable from its device and
//!   from every peer device that can reach it (`cuDeviceCanAccessPeer`), as `cudaMalloc`'s memory
//!   is once peer access is enabled.
//! - Copies: between pinned host buffers ([`PinnedBuf`], `cuMemHostAlloc`) and the device, queued on
//!   streams; a [`CudaPending`] owns the host buffer until the copy is complete.
//! - Context: the device's *primary* context, the one the CUDA runtime and so PyTorch use, made
//!   current on each calling thread; possum's objects therefore live beside the job's.
//!
//! The driver (libcuda) is loaded at run time through cudarc, so this crate builds without CUDA and
//! [`probe`] says, without panicking, whether a device is usable. All `unsafe` code is in the private
//! `driver` module, in [`introspect`] (the job's kernels, graphs and streams, for the interposer)
//! in [`checkpoint`] (the driver's checkpoint of another process, for the CLI) and in [`share`]
//! (memory exported to and imported from other processes, for the keeper); everything else is safe.
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod checkpoint;
pub mod config;
mod device;
mod driver;
pub mod introspect;
pub mod owner;
pub mod share;

pub use device::{probe, CudaDevice, DriverInfo};
pub use driver::{
    check, is_out_of_memory, CUcontext, CUresult, CUstream, CudaEvent, CudaPending, CudaStream,
    PinnedBuf,
};

/// `e` followed by its sources, `: `-separated (libloading's `Display` says only "dlopen failed";
/// `dlerror`'s text is its source).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}
