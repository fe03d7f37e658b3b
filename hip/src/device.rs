//! [`HipDevice`]: the engine's [`Device`] trait on the HIP runtime API. Safe code over
//! [`crate::result`].

use std::ffi::c_int;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;
use possum_engine::addresses::{check_reserve_size, out_of_memory, AddressTables, MappedMemory};
use possum_engine::device::{
    DevPtr, Device, DeviceError, DeviceResult, HostBuffer, StreamPriority,
};
use thiserror::Error;

use crate::result::{
    is_out_of_memory, HipEvent, HipPending, HipStream, PhysMem, PinnedBuf, Runtime,
};
use crate::sys::LoadError;

/// Why [`HipDevice::open`] failed, by step.
#[derive(Debug, Error)]
pub enum OpenError {
    /// The runtime library could not be loaded, or lacks an entry point possum calls.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// `hipInit` failed (no driver, no device).
    #[error("the HIP runtime did not start: {0}")]
    Init(#[source] DeviceError),
    /// The runtime sees no device of that ordinal.
    #[error("no HIP device {ordinal}: the runtime sees {count}")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the runtime sees.
        count: usize,
    },
    /// A query of the device's properties failed.
    #[error("cannot query HIP device {ordinal}: {source}")]
    Query {
        /// The device.
        ordinal: usize,
        /// The runtime's answer.
        #[source]
        source: DeviceError,
    },
}

/// What possum has reserved and mapped through this device.
type Tables = AddressTables<PhysMem>;

impl MappedMemory for PhysMem {
    fn size(&self) -> u64 {
        PhysMem::size(self)
    }
}

/// One HIP device, through a runtime loaded from a path.
///
/// Every method makes the device current on the calling thread first (HIP's current device is
/// per thread). Reservations and mappings made through this value are tracked; dropping it waits
/// for the device (`hipDeviceSynchronize`, the job's work included) and then unmaps, releases and
/// unreserves them all.
///
/// Copies to or from addresses inside possum's reservations must lie within one mapping;
/// addresses outside them (the job's own allocations) are passed to the runtime unchecked.
/// Unmapping memory that queued device work still uses is a caller bug (the GPU faults).
pub struct HipDevice {
    rt: Arc<Runtime>,
    ordinal: usize,
    name: String,
    granularity: u64,
    /// (least, greatest) stream priority of the device.
    priorities: (i32, i32),
    tables: Mutex<Tables>,
}

/// A device made current by [`HipDevice::bind`]; dropped, the one before is current again.
struct Bound<'a> {
    rt: &'a Runtime,
    before: Option<c_int>,
}

impl Drop for Bound<'_> {
    fn drop(&mut self) {
        if let Some(d) = self.before {
            let _ = self.rt.set_device(d);
        }
    }
}

impl fmt::Debug for HipDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HipDevice")
            .field("runtime", &self.rt.path())
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("granularity", &self.granularity)
            .field("priorities", &self.priorities)
            .finish_non_exhaustive()
    }
}

impl HipDevice {
    /// Loads the HIP runtime at `runtime` (a path, or a bare soname such as
    /// `libamdhip64.so.6` searched for on the library path), starts it and opens device
    /// `ordinal`.
    pub fn open(runtime: impl AsRef<Path>, ordinal: usize) -> Result<HipDevice, OpenError> {
        let rt = Runtime::load(runtime)?;
        rt.init().map_err(OpenError::Init)?;
        let count = rt.device_count().map_err(OpenError::Init)?;
        let dev = c_int::try_from(ordinal)
            .ok()
            .filter(|_| ordinal < count)
            .ok_or(OpenError::NoDevice { ordinal, count })?;
        let query = |source| OpenError::Query { ordinal, source };
        rt.set_device(dev).map_err(query)?;
        let name = rt.device_name(dev).map_err(query)?;
        // The minimum granularity is the unit of mapping and so of release.
        let granularity = rt.granularity(dev, false).map_err(query)?;
        let priorities = rt.stream_priority_range().map_err(query)?;
        Ok(HipDevice {
            rt,
            ordinal,
            name,
            granularity,
            priorities,
            tables: Mutex::new(Tables::default()),
        })
    }

    /// The runtime this device is opened on.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.rt
    }

    /// The device ordinal this was opened with.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The runtime's name of the device.
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// (least, greatest) stream priority: `Normal` streams get the first, `High` ones the
    /// second (numerically smaller is more urgent).
    pub fn stream_priority_range(&self) -> (i32, i32) {
        self.priorities
    }

    /// Makes the device current on the calling thread until the guard is dropped, which makes
    /// the thread's device before current again: possum's calls run on the job's threads too
    /// (its hooks), whose current device is the job's.
    fn bind(&self) -> DeviceResult<Bound<'_>> {
        let before = self.rt.current_device()?;
        // Checked in `open`: the ordinal fits.
        let ordinal = self.ordinal as c_int;
        if before != ordinal {
            self.rt.set_device(ordinal)?;
        }
        Ok(Bound {
            rt: &self.rt,
            before: (before != ordinal).then_some(before),
        })
    }

    /// Queues `len` bytes of `value` at `va`, in `stream` order.
    pub fn memset_d8(
        &self,
        stream: &HipStream,
        va: DevPtr,
        value: u8,
        len: u64,
    ) -> DeviceResult<()> {
        let _bound = self.bind()?;
        self.tables.lock().check_copy_range(va.0, len)?;
        stream.memset_d8(va.0, value, len)
    }
}

impl Device for HipDevice {
    type Stream = HipStream;
    type Event = HipEvent;
    type HostBuf = PinnedBuf;
    type Pending = HipPending;

    fn name(&self) -> String {
        format!("hip:{} {}", self.ordinal, self.name)
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn memory_info(&self) -> DeviceResult<(u64, u64)> {
        let _bound = self.bind()?;
        self.rt.mem_get_info()
    }

    fn reserve(&self, size: u64) -> DeviceResult<DevPtr> {
        check_reserve_size(size, self.granularity)?;
        let _bound = self.bind()?;
        let va = self.rt.address_reserve(size, self.granularity)?;
        self.tables.lock().reservations.insert(va, size);
        Ok(DevPtr(va))
    }

    fn adopt_reservation(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        self.tables.lock().adopt(va.0, size, self.granularity)
    }

    fn unreserve(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let _bound = self.bind()?;
        let free = || self.rt.address_free(va.0, size);
        self.tables.lock().unreserve(va.0, size, free)
    }

    fn map(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let _bound = self.bind()?;
        // Held across the runtime's calls, so two maps can't race for the same range.
        let mut t = self.tables.lock();
        t.check_map(va.0, size, self.granularity)?;
        let mem = match PhysMem::create(&self.rt, self.ordinal as c_int, size) {
            Ok(m) => m,
            Err(e) if is_out_of_memory(&e) => {
                return Err(out_of_memory(size, self.rt.mem_get_info()));
            }
            Err(e) => return Err(e),
        };
        mem.map_at(va.0)?;
        t.mappings.insert(va.0, mem);
        Ok(())
    }

    fn unmap(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let _bound = self.bind()?;
        let mut t = self.tables.lock();
        t.check_unmap(va.0, size)?;
        self.rt.unmap(va.0, size)?;
        let mem = t.mappings.remove(&va.0).expect("checked above");
        mem.release()
    }

    fn alloc_host(&self, len: usize) -> DeviceResult<PinnedBuf> {
        let _bound = self.bind()?;
        crate::result::pinned(&self.rt, len)
    }

    fn create_stream(&self, priority: StreamPriority) -> DeviceResult<HipStream> {
        let _bound = self.bind()?;
        let p = match priority {
            StreamPriority::Normal => self.priorities.0,
            StreamPriority::High => self.priorities.1,
        };
        HipStream::create(&self.rt, p)
    }

    fn copy_d2h(
        &self,
        stream: &HipStream,
        src: DevPtr,
        dst: PinnedBuf,
        len: u64,
    ) -> DeviceResult<HipPending> {
        let n = self.tables.lock().check_host_copy(src.0, len, dst.len())?;
        stream.copy_d2h(src.0, dst, n)
    }

    fn copy_h2d(
        &self,
        stream: &HipStream,
        src: PinnedBuf,
        dst: DevPtr,
        len: u64,
    ) -> DeviceResult<HipPending> {
        let n = self.tables.lock().check_host_copy(dst.0, len, src.len())?;
        stream.copy_h2d(src, dst.0, n)
    }

    fn copy_d2d(&self, stream: &HipStream, src: DevPtr, dst: DevPtr, len: u64) -> DeviceResult<()> {
        self.tables.lock().check_copy_ranges(src.0, dst.0, len)?;
        stream.copy_d2d(src.0, dst.0, len)
    }

    fn record_event(&self, stream: &HipStream) -> DeviceResult<HipEvent> {
        HipEvent::record(stream)
    }

    fn wait_event(&self, stream: &HipStream, event: &HipEvent) -> DeviceResult<()> {
        stream.wait_event(event)
    }

    fn event_synchronize(&self, event: &HipEvent) -> DeviceResult<()> {
        event.synchronize()
    }

    fn event_query(&self, event: &HipEvent) -> DeviceResult<bool> {
        event.query()
    }

    fn synchronize(&self, stream: &HipStream) -> DeviceResult<()> {
        stream.synchronize()
    }

    /// `hipDeviceSynchronize`: the job's work included.
    fn synchronize_device(&self) -> DeviceResult<()> {
        let _bound = self.bind()?;
        self.rt.synchronize_device()
    }
}

impl Drop for HipDevice {
    fn drop(&mut self) {
        let t = self.tables.get_mut();
        if t.mappings.is_empty() && t.reservations.is_empty() {
            return;
        }
        if self.rt.set_device(self.ordinal as c_int).is_err() {
            return;
        }
        // Nothing queued may still use the memory.
        let _ = self.rt.synchronize_device();
        for (va, mem) in std::mem::take(&mut t.mappings) {
            let _ = self.rt.unmap(va, mem.size());
            let _ = mem.release();
        }
        let adopted = std::mem::take(&mut t.adopted);
        for (va, size) in std::mem::take(&mut t.reservations) {
            if !adopted.contains(&va) {
                let _ = self.rt.address_free(va, size);
            }
        }
    }
}
