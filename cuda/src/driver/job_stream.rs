//! The job's own streams wrapped without being owned (part of [`super`], the unsafe layer over
//! the driver, under its rules): a method of [`CudaDevice`], which the layer above owns.
#![allow(unsafe_code)]

use super::{CUstream, CudaStream};
use crate::device::CudaDevice;

impl CudaDevice {
    /// Wraps one of the job's streams (as the interposer sees them) without taking ownership:
    /// possum never destroys it; dropping the wrapper only drops the wrapper. Handle 0 is the legacy
    /// default stream (safe as [`CudaDevice::legacy_stream`]).
    /// Copies queued on it are ordered with the job's work on that stream.
    ///
    /// # Safety
    /// `raw` must be 0 or a live stream of this device's primary context, and must stay live (not
    /// be destroyed by the job) while the returned stream, any clone of it, or any copy queued on
    /// it through possum is alive.
    pub unsafe fn wrap_stream(&self, raw: CUstream) -> CudaStream {
        // SAFETY: the caller keeps `borrow_raw`'s contract, which is this function's.
        unsafe { CudaStream::borrow_raw(self.context(), raw) }
    }
}
