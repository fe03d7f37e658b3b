//! [`MemoryOwner`]: memory for a [`crate::CudaDevice`]'s buffers owned by another process (the
//! keeper), so that a buffer can be *detached* for NVIDIA's driver checkpoint (unmapped,
//! this process's handle released) while its memory and contents stay on the GPU, and attached
//! again after it in about a millisecond.
//!
//! The trait is implemented by `possum-keeper`'s client; this crate only consumes it, so the
//! device does not depend on how the owner is reached.

use std::fmt;
use std::os::fd::OwnedFd;

use possum_engine::device::{DeviceError, DeviceResult};

/// New memory from the owner.
#[derive(Debug)]
pub struct Owned {
    /// The owner's id for it.
    pub id: u64,
    /// Its size (the size asked, rounded up to the owner's granularity).
    pub size: u64,
    /// A POSIX fd to import it with (`cuMemImportFromShareableHandle`).
    pub fd: OwnedFd,
    /// The UUID of the device it is on, when the owner says.
    pub device: Option<[u8; 16]>,
}

/// What an owner says of itself, for `possum status`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnerStatus {
    /// Where it is (a keeper's socket).
    pub name: String,
    /// Whether it answered.
    pub reachable: bool,
    /// Allocations it holds for this process, and their bytes.
    pub allocations: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Of those, the bytes detached now (kept while this process holds no handle to them).
    pub retained_bytes: u64,
    /// Its spare image memory, in words, if it keeps some (a keeper's `POSSUM_KEEPER_SPARE_*`).
    pub spare: Option<String>,
}

/// Where a device's buffer memory comes from when another process owns it.
pub trait MemoryOwner: Send + Sync + fmt::Debug {
    /// Creates `size` bytes on the device.
    fn create(&self, size: u64) -> DeviceResult<Owned>;
    /// Frees memory `id`.
    fn free(&self, id: u64) -> DeviceResult<()>;
    /// Keeps memory `id`, contents and all, while this process holds no handle to it (detached),
    /// until [`reclaim`](MemoryOwner::reclaim) names the same `epoch` (one per checkpoint); and
    /// for `hold_secs` after this process is gone (0: freed with it). `va` is where this
    /// process mapped it (a restore onto another device matches the image's buffers to it).
    fn keep(&self, id: u64, epoch: u64, hold_secs: u64, va: u64) -> DeviceResult<()>;
    /// Takes kept memory back (kept with `epoch`): a new fd for it.
    fn reclaim(&self, id: u64, epoch: u64) -> DeviceResult<OwnedFd>;
    /// Frees kept memory, only if it is still kept with `epoch` (memory a later checkpoint of
    /// this process kept under the same id is left alone).
    fn release_kept(&self, id: u64, epoch: u64) -> DeviceResult<()>;
    /// A new fd for memory `id` of this process's, in use, to hand to another process (CUDA
    /// IPC of memory possum serves).
    fn share(&self, id: u64) -> DeviceResult<OwnedFd>;
    /// Whether the owner answers now (a connection is opened if none is).
    fn alive(&self) -> bool;
    /// What it holds for this process.
    fn status(&self) -> OwnerStatus;
}

/// A new checkpoint epoch, which memory an owner keeps is taken back with: unique in practice
/// (the time, this process, a counter), never 0 (the epoch of memory never detached).
pub fn new_epoch() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let e = nanos ^ (u64::from(std::process::id()) << 40) ^ COUNT.fetch_add(1, Ordering::Relaxed);
    e.max(1)
}

/// The code of an owner's failure to be reached at all ([`unreachable_error`]).
const UNREACHABLE: i64 = -2;

/// An owner that cannot be reached at all, as a device error: the device then makes the memory
/// itself ([`is_unreachable`]), where a refusal of the owner's ([`owner_error`]) is an error.
pub fn unreachable_error(what: &'static str, message: impl Into<String>) -> DeviceError {
    DeviceError::Backend {
        call: what,
        code: UNREACHABLE,
        message: message.into(),
    }
}

/// Whether `e` is an [`unreachable_error`].
pub fn is_unreachable(e: &DeviceError) -> bool {
    matches!(e, DeviceError::Backend { code, .. } if *code == UNREACHABLE)
}

/// An owner's failure as a device error.
pub fn owner_error(what: &'static str, message: impl Into<String>) -> DeviceError {
    DeviceError::Backend {
        call: what,
        code: -1,
        message: message.into(),
    }
}
