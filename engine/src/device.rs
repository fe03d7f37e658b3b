//! The `Device` trait: what the engine needs from a GPU (or from host memory pretending to be one).
//!
//! The shape follows CUDA's virtual memory management API, because that is what makes buffers
//! *releasable*: a virtual range is reserved once ([`Device::reserve`]) and physical memory is mapped
//! under it ([`Device::map`]) or dropped ([`Device::unmap`]) without the address changing. Copies are
//! asynchronous and ordered per stream; events order streams against each other.
//!
//! Host memory taking part in an asynchronous copy is *moved into* the copy and handed back by
//! [`Transfer::wait`], so safe code can never touch a buffer the device is still reading or writing.

use std::fmt::Debug;

/// A device virtual address.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DevPtr(pub u64);

impl DevPtr {
    /// The address `off` bytes further on.
    #[allow(clippy::should_implement_trait)]
    pub fn add(self, off: u64) -> DevPtr {
        DevPtr(self.0 + off)
    }
}

impl std::fmt::Display for DevPtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// Stream priority. Priority copies (copy-on-write, on-demand restore) go on `High` streams so they
/// overtake the background copier.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum StreamPriority {
    /// Background work.
    Normal,
    /// Work a job's operation is waiting for.
    High,
}

/// Errors a backend reports.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// Not enough device memory for a mapping.
    #[error("out of device memory: {requested} bytes requested, {free} free")]
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// Bytes free at the time.
        free: u64,
    },
    /// An address that is not reserved, not mapped, or a range that crosses mappings.
    #[error("invalid device address range {va}+{len}: {why}")]
    InvalidAddress {
        /// Start of the range.
        va: DevPtr,
        /// Length of the range.
        len: u64,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A host buffer too small for the copy asked of it.
    #[error("host buffer of {have} bytes is too small for a copy of {need} bytes")]
    HostBufferTooSmall {
        /// Bytes the copy needs.
        need: u64,
        /// Bytes the buffer has.
        have: u64,
    },
    /// An earlier asynchronous operation on this stream failed; the stream is unusable.
    #[error("stream failed: {0}")]
    StreamFailed(String),
    /// The backend cannot do this (e.g. `detach` without a memory owner outside the process).
    #[error("not supported by this device: {0}")]
    Unsupported(&'static str),
    /// A call into the backend's driver failed.
    #[error("{call} failed: {message} (code {code})")]
    Backend {
        /// The driver call.
        call: &'static str,
        /// The driver's error code.
        code: i64,
        /// The driver's description.
        message: String,
    },
}

/// Result of a device operation.
pub type DeviceResult<T> = Result<T, DeviceError>;

/// Host memory usable for asynchronous copies (pinned memory on a GPU backend).
pub trait HostBuffer: Send + Debug + 'static {
    /// The bytes.
    fn as_slice(&self) -> &[u8];
    /// The bytes, writable.
    fn as_mut_slice(&mut self) -> &mut [u8];
    /// Capacity in bytes.
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    /// Whether the buffer has no capacity.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An asynchronous copy in flight that holds a host buffer until it completes.
pub trait Transfer<B>: Send + Debug {
    /// Waits for the copy and hands the host buffer back.
    fn wait(self) -> DeviceResult<B>;
}

/// A GPU as the engine sees it. Implementations: `host::HostDevice` (host memory, real concurrency)
/// and the CUDA backend.
pub trait Device: Send + Sync + Debug + 'static {
    /// An ordered queue of device work.
    type Stream: Clone + Send + Sync + Debug;
    /// A marker recorded in a stream; complete once everything before it in that stream is.
    type Event: Clone + Send + Sync + Debug;
    /// Host memory for copies.
    type HostBuf: HostBuffer;
    /// A copy in flight holding a host buffer.
    type Pending: Transfer<Self::HostBuf>;

    /// A short name ("host", "cuda:0 NVIDIA H100 80GB HBM3").
    fn name(&self) -> String;
    /// Mapping granularity: reservations and mappings are multiples of it.
    fn granularity(&self) -> u64;
    /// (free, total) device memory in bytes.
    fn memory_info(&self) -> DeviceResult<(u64, u64)>;

    /// Reserves `size` bytes of virtual address space (a multiple of the granularity).
    fn reserve(&self, size: u64) -> DeviceResult<DevPtr>;
    /// Gives a reservation back. Nothing may be mapped in it.
    fn unreserve(&self, va: DevPtr, size: u64) -> DeviceResult<()>;
    /// Creates physical memory of `size` bytes and maps it at `va` (inside a reservation).
    fn map(&self, va: DevPtr, size: u64) -> DeviceResult<()>;
    /// Takes `size` bytes at `va`, inside an address range someone else reserved (the job), as
    /// a reservation of its own for [`map`](Device::map): [`unreserve`](Device::unreserve) of it
    /// forgets it and leaves the range reserved. It must overlap no reservation of this device's.
    fn adopt_reservation(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let _ = (va, size);
        Err(DeviceError::Unsupported("adopt_reservation"))
    }
    /// Unmaps and frees the physical memory at `va`; the reservation stays, the contents are gone.
    fn unmap(&self, va: DevPtr, size: u64) -> DeviceResult<()>;

    /// Whether [`detach`](Device::detach) keeps memory: the physical memory under possum's mappings
    /// is owned outside this process (a keeper) and outlives this process's handles to it.
    fn keeps_memory(&self) -> bool {
        false
    }
    /// Starts a detach of every buffer (before its [`detach`](Device::detach) calls): the memory
    /// they leave with its owner is of one new checkpoint (taken back only by a process holding
    /// that checkpoint's state: this one, or one restored from its image), and is kept
    /// `hold_secs` after this process is gone (0: freed with it). A no-op where nothing is kept.
    fn begin_detach(&self, hold_secs: u64) {
        let _ = hold_secs;
    }
    /// Unmaps the mapping at `va` and drops this process's handle to its memory, which lives on
    /// with its contents where it is owned (a keeper) until [`reattach`](Device::reattach) maps
    /// it there again. For NVIDIA's driver checkpoint, which must not see that memory in the
    /// process. No work of the process may be in flight on it.
    fn detach(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let _ = (va, size);
        Err(DeviceError::Unsupported("detach"))
    }
    /// Maps the memory [`detach`](Device::detach) kept at `va` again, contents intact.
    fn reattach(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let _ = (va, size);
        Err(DeviceError::Unsupported("reattach"))
    }
    /// Takes memory its owner prepared for this process ahead of a restore (a keeper that loaded
    /// an image while CRIU restored the process) as the detached memory of `size` bytes at `va`:
    /// kept under the owner's `id`, taken back with `epoch`. [`reattach`](Device::reattach) then
    /// maps it, [`forget`](Device::forget) frees it. `va` must be neither mapped nor detached.
    fn expect_kept(&self, va: DevPtr, size: u64, id: u64, epoch: u64) -> DeviceResult<()> {
        let _ = (va, size, id, epoch);
        Err(DeviceError::Unsupported("expect_kept"))
    }
    /// Forgets the memory [`detach`](Device::detach) kept at `va` (gone, or not wanted: the job
    /// was restored from an image elsewhere), asking its owner to free it if it still has it;
    /// the address is then reserved with nothing kept, as after [`unmap`](Device::unmap).
    fn forget(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let _ = (va, size);
        Err(DeviceError::Unsupported("forget"))
    }
    /// Shrinks what the device's context holds besides the buffers, for NVIDIA's driver
    /// checkpoint, which copies all of it to host memory (and CRIU then dumps and restores it):
    /// the local memory reserved for thread stacks. Only while no work of the process can be
    /// launched (the job held at the op gate). Bytes of device memory freed; 0 where nothing is
    /// trimmed (already trimmed, or a backend without a context).
    fn trim_context(&self) -> DeviceResult<u64> {
        Ok(0)
    }
    /// Undoes [`trim_context`](Device::trim_context) before the job launches again; a no-op when
    /// nothing is trimmed. Whether something was.
    fn untrim_context(&self) -> DeviceResult<bool> {
        Ok(false)
    }
    /// Closes any connection to the memory's owner (reopened when next needed), so that a process
    /// dump (CRIU) of a job whose buffers are released or detached finds none; the engine calls
    /// it after a release and a detach. A no-op by default: the CUDA backend reaches its keeper
    /// by a new connection per request, so it has none open.
    fn disconnect(&self) {}

    /// Allocates host memory for copies.
    fn alloc_host(&self, len: usize) -> DeviceResult<Self::HostBuf>;
    /// Creates a stream.
    fn create_stream(&self, priority: StreamPriority) -> DeviceResult<Self::Stream>;

    /// Copies `len` bytes from device `src` into the start of `dst`, in `stream` order.
    fn copy_d2h(
        &self,
        stream: &Self::Stream,
        src: DevPtr,
        dst: Self::HostBuf,
        len: u64,
    ) -> DeviceResult<Self::Pending>;
    /// Copies the first `len` bytes of `src` to device `dst`, in `stream` order.
    fn copy_h2d(
        &self,
        stream: &Self::Stream,
        src: Self::HostBuf,
        dst: DevPtr,
        len: u64,
    ) -> DeviceResult<Self::Pending>;
    /// Copies `len` bytes device to device, in `stream` order.
    fn copy_d2d(
        &self,
        stream: &Self::Stream,
        src: DevPtr,
        dst: DevPtr,
        len: u64,
    ) -> DeviceResult<()>;

    /// Records an event at the current end of `stream`.
    fn record_event(&self, stream: &Self::Stream) -> DeviceResult<Self::Event>;
    /// Makes `stream` wait (on the device, not the host) until `event` completes.
    fn wait_event(&self, stream: &Self::Stream, event: &Self::Event) -> DeviceResult<()>;
    /// Blocks the calling thread until `event` completes.
    fn event_synchronize(&self, event: &Self::Event) -> DeviceResult<()>;
    /// Whether `event` has completed.
    fn event_query(&self, event: &Self::Event) -> DeviceResult<bool>;
    /// Blocks until everything enqueued on `stream` so far has completed.
    fn synchronize(&self, stream: &Self::Stream) -> DeviceResult<()>;
    /// Blocks until everything enqueued on the device so far, by anyone (the job's streams that
    /// possum never saw included), has completed.
    fn synchronize_device(&self) -> DeviceResult<()>;

    /// Whether [`Device::fingerprint`] works on this device (a backend loads what it needs
    /// here, once): `Err` says why not. The engine asks at its creation; without fingerprints
    /// its images are not proven by content, and read-only speculation must stay off.
    fn fingerprint_ready(&self) -> Result<(), String> {
        Err("this device has no fingerprint kernel".into())
    }

    /// The fingerprints ([`crate::fingerprint`]) of the `len` bytes at `va`, cut into chunks of
    /// `chunk` bytes (the last one shorter), taken on `stream` after everything enqueued there;
    /// blocks until they are known. `va` and `chunk` must be multiples of 16. Computed on the
    /// device at its memory bandwidth: nothing crosses to the host but 16 bytes a chunk.
    /// A backend without a fingerprint kernel says [`DeviceError::Unsupported`], and the engine
    /// then tracks changes by the hooks' write sets alone.
    fn fingerprint(
        &self,
        stream: &Self::Stream,
        va: DevPtr,
        len: u64,
        chunk: u64,
    ) -> DeviceResult<Vec<crate::fingerprint::Fingerprint>> {
        let _ = (stream, va, len, chunk);
        Err(DeviceError::Unsupported("fingerprint"))
    }
}
