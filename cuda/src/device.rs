//! [`CudaDevice`]: the engine's [`Device`] trait on the CUDA driver API. Safe code over
//! [`crate::driver`].

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use possum_engine::addresses::{
    check_reserve_size, end_of, granular_range, invalid, out_of_memory, AddressTables, MappedMemory,
};
use possum_engine::device::{
    DevPtr, Device, DeviceError, DeviceResult, HostBuffer, StreamPriority,
};
use possum_engine::fingerprint::Fingerprint;

use crate::driver::fingerprint::FingerprintKernel;
use crate::driver::{
    self, CUcontext, Context, CudaEvent, CudaPending, CudaStream, PhysMem, PinnedBuf,
};
use crate::owner::{is_unreachable, owner_error, MemoryOwner, OwnerStatus};
use std::os::fd::AsFd;

/// What [`probe`] found: a driver and at least one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverInfo {
    /// The driver's CUDA version as the driver API reports it (13000 for CUDA 13.0).
    pub driver_version: i32,
    /// Devices the driver sees (after `CUDA_VISIBLE_DEVICES`).
    pub device_count: usize,
}

/// Loads libcuda, runs `cuInit` and counts devices. `Err` says, in words, why there is no usable
/// CUDA device (no driver library, `cuInit` failed, no device); it never panics.
pub fn probe() -> Result<DriverInfo, String> {
    driver::init().map_err(|e| e.to_string())?;
    let driver_version = driver::driver_version().map_err(|e| e.to_string())?;
    let device_count = driver::device_count().map_err(|e| e.to_string())?;
    if device_count == 0 {
        return Err("the driver sees no device".to_string());
    }
    Ok(DriverInfo {
        driver_version,
        device_count,
    })
}

/// What possum has reserved and mapped through this device: the address tables every backend
/// keeps ([`AddressTables`], which the checks on copies use through `Deref`), and what memory an
/// owner (the keeper) holds.
#[derive(Debug, Default)]
struct Tables {
    /// Reservations, mappings (start -> the physical memory mapped there) and adopted ranges.
    addr: AddressTables<PhysMem>,
    /// Mapping start -> the owner's id of its memory (memory from a [`MemoryOwner`]).
    owned: BTreeMap<u64, u64>,
    /// Detached mapping start -> (owner's id, size, epoch): kept by the owner, mapped nowhere
    /// here, taken back with the epoch of the detach that left it there.
    detached: BTreeMap<u64, (u64, u64, u64)>,
    /// The epoch and hold (seconds the owner keeps it after this process is gone) of the next
    /// detaches ([`Device::begin_detach`]).
    detaching: (u64, u64),
}

impl std::ops::Deref for Tables {
    type Target = AddressTables<PhysMem>;
    fn deref(&self) -> &Self::Target {
        &self.addr
    }
}

impl std::ops::DerefMut for Tables {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.addr
    }
}

impl MappedMemory for PhysMem {
    fn size(&self) -> u64 {
        PhysMem::size(self)
    }
}

/// One CUDA device, through its primary context: the context the CUDA runtime (so PyTorch) uses, so
/// possum's memory, streams and events live beside the job's and are usable by it.
///
/// Every method makes that context current on the calling thread first (a no-op when it already
/// is). Reservations and mappings made through this value are tracked; dropping it waits for the
/// context to go idle (`cuCtxSynchronize`, which includes the job's work) and then unmaps, releases
/// and unreserves them all.
///
/// Copies to or from addresses inside possum's reservations must lie within one mapping; addresses
/// outside them (the job's own allocations) are passed to the driver unchecked. Unmapping memory that
/// queued device work still uses is a caller bug: the GPU faults and the context (shared with the
/// job) becomes unusable.
pub struct CudaDevice {
    ctx: Arc<Context>,
    ordinal: usize,
    name: String,
    granularity: u64,
    recommended_granularity: u64,
    /// (least, greatest) stream priority of the context.
    priorities: (i32, i32),
    tables: Mutex<Tables>,
    /// Where buffer memory comes from when another process owns it (a keeper).
    owner: Option<Arc<dyn MemoryOwner>>,
    /// The device's UUID, to check the owner's memory is on it: another GPU's once a restore
    /// moved the process there ([`CudaDevice::follow_move`]).
    uuid: Mutex<[u8; 16]>,
    /// Why the owner is no longer asked for memory (its memory was on another device).
    owner_refused: Mutex<Option<String>>,
    /// The stack size limit [`Device::trim_context`] lowered, to be set again.
    trimmed_stack: Mutex<Option<usize>>,
    /// The fingerprint kernel, loaded into the context at the first [`Device::fingerprint`]; or
    /// why it can't be (the answer of every fingerprint from then on).
    fingerprint: OnceLock<Result<FingerprintKernel, DeviceError>>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("ctx", &self.ctx)
            .field("granularity", &self.granularity)
            .field("priorities", &self.priorities)
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Opens device `ordinal`: loads the driver, `cuInit`, retains the device's primary context.
    pub fn new(ordinal: usize) -> DeviceResult<CudaDevice> {
        driver::init()?;
        let dev = driver::device_get(ordinal)?;
        let name = driver::device_name(dev)?;
        let ctx = Context::retain_primary(dev)?;
        ctx.bind()?;
        // The minimum granularity is the unit of mapping and so of release: the finer it is, the
        // less a reservation is padded and the finer the engine can release memory. The
        // recommended one is a performance hint only (both are 2 MiB on current NVIDIA GPUs).
        let granularity = driver::alloc_granularity(dev, false)?;
        let recommended_granularity = driver::alloc_granularity(dev, true)?;
        let priorities = ctx.stream_priority_range()?;
        let uuid = driver::device_uuid(dev)?;
        Ok(CudaDevice {
            ctx,
            ordinal,
            name,
            granularity,
            recommended_granularity,
            priorities,
            tables: Mutex::new(Tables::default()),
            owner: None,
            uuid: Mutex::new(uuid),
            owner_refused: Mutex::new(None),
            trimmed_stack: Mutex::new(None),
            fingerprint: OnceLock::new(),
        })
    }

    /// Takes the memory of every mapping made from now on from `owner` (a keeper), so that
    /// [`Device::detach`] can keep it across NVIDIA's driver checkpoint.
    pub fn with_owner(mut self, owner: Arc<dyn MemoryOwner>) -> CudaDevice {
        self.owner = Some(owner);
        self
    }

    /// A POSIX fd of the memory mapped at `va` (a mapping's start), for another process to import
    /// (CUDA IPC): its owner's (a keeper's) fd. Memory of this process's own has none
    /// (`Unsupported`): it is made without a shareable handle type.
    pub fn share(&self, va: DevPtr) -> DeviceResult<std::os::fd::OwnedFd> {
        let id = self.tables.lock().owned.get(&va.0).copied();
        match (self.owner.as_ref(), id) {
            (Some(owner), Some(id)) => owner.share(id),
            _ => Err(DeviceError::Unsupported(
                "share: memory of this process's own, not a keeper's (no shareable handle)",
            )),
        }
    }

    /// What the memory's owner holds for this process (a keeper), if the memory has one; with
    /// how many of this device's mappings are the owner's and how many its own.
    pub fn owner_status(&self) -> Option<(OwnerStatus, usize, usize)> {
        let owner = self.owner.as_ref()?;
        let (owned, all) = {
            let t = self.tables.lock();
            (
                t.owned.len() + t.detached.len(),
                t.mappings.len() + t.detached.len(),
            )
        };
        let st = match self.owner_refused.lock().clone() {
            Some(why) => OwnerStatus {
                name: format!("keeper not used: {why}"),
                ..OwnerStatus::default()
            },
            None => owner.status(),
        };
        Some((st, owned, all - owned))
    }

    /// The device's UUID now, when it is not the one this was opened on: NVIDIA's restore of the
    /// process mapped its device to another GPU (`possum restore --device`), which the process
    /// sees under the same ordinal.
    pub fn moved(&self) -> Option<[u8; 16]> {
        let now = driver::device_uuid(self.ctx.device()).ok()?;
        (now != *self.uuid.lock()).then_some(now)
    }

    /// Takes [`moved`](Self::moved)'s answer: the device is `uuid` from now on. `owner_serves`:
    /// the owner now gives memory on it (it followed the move); else new memory is this
    /// process's own.
    pub fn follow_move(&self, uuid: [u8; 16], owner_serves: bool) {
        *self.uuid.lock() = uuid;
        *self.owner_refused.lock() = (!owner_serves && self.owner.is_some())
            .then(|| "no keeper of the job's serves the GPU it was restored on".to_string());
    }

    /// The epoch of this device's last detach (the one [`Device::begin_detach`] began), while
    /// buffers are detached: the keeper holds their memory under it.
    pub fn detached_epoch(&self) -> Option<u64> {
        let t = self.tables.lock();
        (!t.detached.is_empty()).then_some(t.detaching.0)
    }

    /// The owner's id of the memory mapped at `va` (the start of a mapping), if it is the
    /// owner's (a keeper's): what the keeper knows it by (its spare image memory copies it).
    pub fn owned_id(&self, va: u64) -> Option<u64> {
        self.tables.lock().owned.get(&va).copied()
    }

    /// Whether new memory comes from an owner (a keeper of this device's), without asking it.
    pub fn has_usable_owner(&self) -> bool {
        self.usable_owner().is_some()
    }

    /// The owner new memory comes from: none, or one found to be on another device.
    fn usable_owner(&self) -> Option<&Arc<dyn MemoryOwner>> {
        self.owner
            .as_ref()
            .filter(|_| self.owner_refused.lock().is_none())
    }

    /// The owner, for an operation only memory from one has (`what`).
    fn owner_for(&self, what: &'static str) -> DeviceResult<&Arc<dyn MemoryOwner>> {
        self.owner.as_ref().ok_or(DeviceError::Unsupported(what))
    }

    /// The memory of `size` bytes for a new mapping: created here, or by the owner (imported).
    fn new_memory(&self, size: u64) -> DeviceResult<(PhysMem, Option<u64>)> {
        let Some(owner) = self.usable_owner() else {
            return PhysMem::create(&self.ctx, size).map(|m| (m, None));
        };
        // An owner out of reach (its keeper gone, as for a job restored where none runs):
        // the memory is this process's own, and is copied at a checkpoint like any.
        let o = match owner.create(size) {
            Ok(o) => o,
            Err(e) if is_unreachable(&e) => {
                return PhysMem::create(&self.ctx, size).map(|m| (m, None));
            }
            Err(e) => return Err(e),
        };
        if o.device.is_some_and(|u| u != *self.uuid.lock()) {
            // Another GPU's memory (the keeper sees other devices than the job: another
            // CUDA_VISIBLE_DEVICES): it would be reached over the interconnect, if at all.
            let _ = owner.free(o.id);
            *self.owner_refused.lock() = Some(format!(
                "the keeper's memory is on another GPU than this device ({})",
                self.name
            ));
            return PhysMem::create(&self.ctx, size).map(|m| (m, None));
        }
        if o.size != size {
            let _ = owner.free(o.id);
            return Err(owner_error(
                "keeper alloc",
                format!("asked {size} bytes, the keeper made {}", o.size),
            ));
        }
        match PhysMem::import(&self.ctx, o.fd.as_fd(), size) {
            Ok(m) => Ok((m, Some(o.id))),
            Err(e) => {
                let _ = owner.free(o.id);
                Err(e)
            }
        }
    }

    /// The device ordinal this was opened with.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The driver's name of the device ("NVIDIA H100 80GB HBM3").
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// The recommended mapping granularity (informative; [`Device::granularity`] is the minimum).
    pub fn recommended_granularity(&self) -> u64 {
        self.recommended_granularity
    }

    /// (least, greatest) stream priority: `Normal` streams get the first, `High` ones the second
    /// (numerically smaller is more urgent).
    pub fn stream_priority_range(&self) -> (i32, i32) {
        self.priorities
    }

    /// The primary context's raw handle (retained by this device while it lives).
    pub fn raw_context(&self) -> CUcontext {
        self.ctx.raw()
    }

    pub(crate) fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The legacy default stream (handle 0): never destroyed; work on it is ordered with all
    /// blocking streams of the context (possum's own streams are non-blocking).
    pub fn legacy_stream(&self) -> CudaStream {
        CudaStream::legacy(&self.ctx)
    }

    /// The driver's view of the allocation or mapping containing `va`: (base, size).
    pub fn address_range(&self, va: DevPtr) -> DeviceResult<(DevPtr, u64)> {
        self.ctx.bind()?;
        let (base, size) = driver::address_range(va.0)?;
        Ok((DevPtr(base), size))
    }

    /// The fingerprint kernel, loaded at the first call. A driver that cannot load it (it lacks
    /// an entry point, or refuses the module: a driver older than its PTX) is a device without
    /// one: `Unsupported`, the trait's answer for that, which its callers fall back on; the
    /// driver's own words are [`CudaDevice::fingerprint_unavailable`]'s.
    fn fingerprint_kernel(&self) -> DeviceResult<&FingerprintKernel> {
        self.fingerprint
            .get_or_init(|| FingerprintKernel::load(&self.ctx))
            .as_ref()
            .map_err(again)
    }

    /// Why [`Device::fingerprint`] is `Unsupported` here, in the driver's words (the call, its
    /// code and description); `None` while it is not (or not yet known to be).
    pub fn fingerprint_unavailable(&self) -> Option<String> {
        match self.fingerprint.get()? {
            Ok(_) => None,
            Err(e) => Some(e.to_string()),
        }
    }

    /// Whether `[va, va + len)` overlaps device memory possum made for its own work on this device
    /// (the fingerprint kernel's results, which every [`Device::fingerprint`] rewrites): never
    /// the job's, nor a buffer of the engine's, although the driver reports it as an allocation
    /// when asked about an address in it.
    pub fn is_own_memory(&self, va: DevPtr, len: u64) -> bool {
        self.fingerprint
            .get()
            .and_then(|k| k.as_ref().ok())
            .is_some_and(|k| k.owns(va.0, len))
    }

    /// Queues `len` bytes of `value` at `va`, in `stream` order.
    pub fn memset_d8(
        &self,
        stream: &CudaStream,
        va: DevPtr,
        value: u8,
        len: u64,
    ) -> DeviceResult<()> {
        self.ctx.bind()?;
        self.tables.lock().check_copy_range(va.0, len)?;
        stream.memset_d8(va.0, value, len)
    }
}

impl Device for CudaDevice {
    type Stream = CudaStream;
    type Event = CudaEvent;
    type HostBuf = PinnedBuf;
    type Pending = CudaPending;

    fn name(&self) -> String {
        format!("cuda:{} {}", self.ordinal, self.name)
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn memory_info(&self) -> DeviceResult<(u64, u64)> {
        self.ctx.bind()?;
        driver::mem_get_info()
    }

    fn reserve(&self, size: u64) -> DeviceResult<DevPtr> {
        self.ctx.bind()?;
        check_reserve_size(size, self.granularity)?;
        let va = driver::address_reserve(size, self.granularity)?;
        self.tables.lock().reservations.insert(va, size);
        Ok(DevPtr(va))
    }

    fn adopt_reservation(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        self.tables.lock().adopt(va.0, size, self.granularity)
    }

    fn unreserve(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        self.ctx.bind()?;
        let free = || driver::address_free(va.0, size);
        self.tables.lock().unreserve(va.0, size, free)
    }

    fn map(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        self.ctx.bind()?;
        // Held across the driver calls, so two maps can't race for the same range.
        let mut t = self.tables.lock();
        t.check_map(va.0, size, self.granularity)?;
        let (mem, id) = match self.new_memory(size) {
            Ok(x) => x,
            Err(e) if driver::is_out_of_memory(&e) => {
                return Err(out_of_memory(size, driver::mem_get_info()));
            }
            Err(e) => return Err(e),
        };
        if let Err(e) = mem.map_at(va.0) {
            drop(mem);
            if let (Some(owner), Some(id)) = (&self.owner, id) {
                let _ = owner.free(id);
            }
            return Err(e);
        }
        t.mappings.insert(va.0, mem);
        if let Some(id) = id {
            t.owned.insert(va.0, id);
        }
        Ok(())
    }

    fn unmap(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        self.ctx.bind()?;
        let mut t = self.tables.lock();
        t.check_unmap(va.0, size)?;
        driver::unmap(va.0, size)?;
        let mem = t.mappings.remove(&va.0).expect("checked above");
        let released = mem.release();
        if let (Some(owner), Some(id)) = (&self.owner, t.owned.remove(&va.0)) {
            // Best effort: a keeper that is gone has freed it already (with this process's
            // handle released, nothing refers to it any more).
            let _ = owner.free(id);
        }
        released
    }

    fn trim_context(&self) -> DeviceResult<u64> {
        let mut trimmed = self.trimmed_stack.lock();
        if trimmed.is_some() {
            return Ok(0);
        }
        let stack = self.ctx.stack_limit()?;
        if stack == 0 {
            return Ok(0);
        }
        let (free0, _) = self.memory_info()?;
        // 0: the driver keeps what the loaded kernels need and frees the rest; a kernel that
        // needs more grows it again at its launch, and the untrim sets it back before any.
        self.ctx.set_stack_limit(0)?;
        *trimmed = Some(stack);
        let (free1, _) = self.memory_info()?;
        Ok(free1.saturating_sub(free0))
    }

    fn untrim_context(&self) -> DeviceResult<bool> {
        let mut trimmed = self.trimmed_stack.lock();
        let Some(stack) = *trimmed else {
            return Ok(false);
        };
        self.ctx.set_stack_limit(stack)?;
        *trimmed = None;
        Ok(true)
    }

    fn keeps_memory(&self) -> bool {
        // Every mapping's memory must be the owner's (some may have been made while it was out
        // of reach).
        let Some(owner) = self.usable_owner() else {
            return false;
        };
        let all_owned = {
            let t = self.tables.lock();
            t.mappings.len() == t.owned.len()
        };
        // A keeper that died keeps nothing: the memory lives on only through this process's
        // handles to it, which a detach would drop.
        all_owned && owner.alive()
    }

    fn begin_detach(&self, hold_secs: u64) {
        self.tables.lock().detaching = (crate::owner::new_epoch(), hold_secs);
    }

    fn detach(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let owner = self.owner_for("detach")?;
        self.ctx.bind()?;
        let mut t = self.tables.lock();
        match (t.mappings.get(&va.0), t.owned.get(&va.0)) {
            (Some(m), Some(_)) if m.size() == size => {}
            (Some(_), Some(_)) => {
                return Err(invalid(va.0, size, "size differs from the mapping's"))
            }
            _ => {
                return Err(invalid(
                    va.0,
                    size,
                    "not the start of a mapping of kept memory",
                ))
            }
        }
        let id = t.owned[&va.0];
        let (epoch, hold_secs) = t.detaching;
        // Marked kept first: from here on only this process may take it back.
        owner.keep(id, epoch, hold_secs, va.0)?;
        driver::unmap(va.0, size)?;
        let mem = t.mappings.remove(&va.0).expect("checked above");
        t.owned.remove(&va.0);
        t.detached.insert(va.0, (id, size, epoch));
        // The driver's checkpoint must find no handle to it in this process either.
        mem.release()
    }

    fn reattach(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let owner = self.owner_for("reattach")?;
        self.ctx.bind()?;
        let t = self.tables.lock();
        let (id, epoch) = match t.detached.get(&va.0) {
            Some(&(id, n, epoch)) if n == size => (id, epoch),
            Some(_) => {
                return Err(invalid(
                    va.0,
                    size,
                    "size differs from the detached mapping's",
                ))
            }
            None => return Err(invalid(va.0, size, "nothing detached there")),
        };
        // The keeper's answer and the mapping without the tables' lock: the engine reattaches
        // several buffers at once (each address once).
        drop(t);
        let fd = owner.reclaim(id, epoch)?;
        let mem = PhysMem::import(&self.ctx, fd.as_fd(), size)?;
        mem.map_at(va.0)?;
        let mut t = self.tables.lock();
        t.detached.remove(&va.0);
        t.mappings.insert(va.0, mem);
        t.owned.insert(va.0, id);
        Ok(())
    }

    fn expect_kept(&self, va: DevPtr, size: u64, id: u64, epoch: u64) -> DeviceResult<()> {
        self.owner_for("expect_kept")?;
        let end = granular_range(va.0, size, self.granularity)?;
        let mut t = self.tables.lock();
        if t.reservation_holding(va.0, end).is_none() {
            return Err(invalid(va.0, size, "not inside one reservation"));
        }
        if t.touches_mapping(va.0, end) || t.detached.contains_key(&va.0) {
            return Err(invalid(va.0, size, "mapped or kept already"));
        }
        t.detached.insert(va.0, (id, size, epoch));
        Ok(())
    }

    fn forget(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let owner = self.owner_for("forget")?;
        let mut t = self.tables.lock();
        match t.detached.get(&va.0) {
            Some(&(_, n, _)) if n == size => {}
            _ => return Err(invalid(va.0, size, "nothing detached there")),
        }
        let (id, _, epoch) = t.detached.remove(&va.0).expect("checked above");
        // Its memory may be gone already (the keeper freed it), or kept under the same id by a
        // later checkpoint of this process (this one restored from an older image): left alone.
        let _ = owner.release_kept(id, epoch);
        Ok(())
    }

    fn alloc_host(&self, len: usize) -> DeviceResult<PinnedBuf> {
        self.ctx.bind()?;
        driver::pinned(&self.ctx, len)
    }

    fn create_stream(&self, priority: StreamPriority) -> DeviceResult<CudaStream> {
        self.ctx.bind()?;
        let p = match priority {
            StreamPriority::Normal => self.priorities.0,
            StreamPriority::High => self.priorities.1,
        };
        CudaStream::create(&self.ctx, p)
    }

    fn copy_d2h(
        &self,
        stream: &CudaStream,
        src: DevPtr,
        dst: PinnedBuf,
        len: u64,
    ) -> DeviceResult<CudaPending> {
        self.ctx.bind()?;
        let n = self.tables.lock().check_host_copy(src.0, len, dst.len())?;
        stream.copy_d2h(src.0, dst, n)
    }

    fn copy_h2d(
        &self,
        stream: &CudaStream,
        src: PinnedBuf,
        dst: DevPtr,
        len: u64,
    ) -> DeviceResult<CudaPending> {
        self.ctx.bind()?;
        let n = self.tables.lock().check_host_copy(dst.0, len, src.len())?;
        stream.copy_h2d(src, dst.0, n)
    }

    fn copy_d2d(
        &self,
        stream: &CudaStream,
        src: DevPtr,
        dst: DevPtr,
        len: u64,
    ) -> DeviceResult<()> {
        self.ctx.bind()?;
        self.tables.lock().check_copy_ranges(src.0, dst.0, len)?;
        stream.copy_d2d(src.0, dst.0, len)
    }

    fn record_event(&self, stream: &CudaStream) -> DeviceResult<CudaEvent> {
        self.ctx.bind()?;
        CudaEvent::record(stream)
    }

    fn wait_event(&self, stream: &CudaStream, event: &CudaEvent) -> DeviceResult<()> {
        self.ctx.bind()?;
        stream.wait_event(event)
    }

    fn event_synchronize(&self, event: &CudaEvent) -> DeviceResult<()> {
        self.ctx.bind()?;
        event.synchronize()
    }

    fn event_query(&self, event: &CudaEvent) -> DeviceResult<bool> {
        self.ctx.bind()?;
        event.query()
    }

    fn synchronize(&self, stream: &CudaStream) -> DeviceResult<()> {
        self.ctx.bind()?;
        stream.synchronize()
    }

    /// On the device, by the fingerprint kernel (`cuda/kernels/fingerprint.ptx`), loaded into
    /// the context at the first call; `Unsupported` (naming the call) if the driver lacks an
    /// entry point it needs or refuses its module, the same answer from then on
    /// ([`CudaDevice::fingerprint_unavailable`] says why in the driver's words).
    /// Inside possum's reservations the range must be mapped throughout (several mappings side
    /// by side are fine): a kernel reading an unmapped page would fault the context.
    fn fingerprint_ready(&self) -> Result<(), String> {
        match self.fingerprint_kernel() {
            Ok(_) => Ok(()),
            Err(e) => Err(self
                .fingerprint_unavailable()
                .unwrap_or_else(|| e.to_string())),
        }
    }

    fn fingerprint(
        &self,
        stream: &CudaStream,
        va: DevPtr,
        len: u64,
        chunk: u64,
    ) -> DeviceResult<Vec<Fingerprint>> {
        if va.0 % 16 != 0 || chunk == 0 || chunk % 16 != 0 {
            return Err(invalid(
                va.0,
                len,
                "a fingerprint's range and chunk must be aligned to 16 bytes",
            ));
        }
        check_readable(&self.tables.lock(), va.0, len)?;
        let kernel = self.fingerprint_kernel()?;
        self.ctx.bind()?;
        let sums = kernel.sums(stream, va.0, len, chunk)?;
        Ok(sums
            .into_iter()
            .zip((0..len).step_by(usize::try_from(chunk).unwrap_or(usize::MAX)))
            .map(|((lo, hi), start)| Fingerprint::from_sums(lo, hi, chunk.min(len - start)))
            .collect())
    }

    /// `cuCtxSynchronize` on the primary context: the job's work included.
    fn synchronize_device(&self) -> DeviceResult<()> {
        self.ctx.synchronize()
    }
}

/// Whether a kernel may read `[va, va + len)`: it lies outside every reservation of possum's (the
/// job's own memory, which the runtime keeps mapped while allocated), or possum's mappings cover
/// all of it, side by side (an engine's buffer is several mappings). A copy over an unmapped page
/// is refused by the driver; a kernel reading one faults, and the context (the job's) with it.
fn check_readable(t: &Tables, va: u64, len: u64) -> DeviceResult<()> {
    if len == 0 {
        return Ok(());
    }
    let end = end_of(va, len)?;
    if !t.touches_reservation(va, end) {
        return Ok(());
    }
    let mut at = va;
    while at < end {
        match t.mappings.range(..=at).next_back() {
            Some((&start, mem)) if start + mem.size() > at => at = start + mem.size(),
            _ => return Err(invalid(va, len, "not mapped throughout")),
        }
    }
    Ok(())
}

/// What every fingerprint answers once the kernel's load failed with `e` (a [`DeviceError`] is not
/// `Clone`): `Unsupported` when the driver lacks the kernel's entry points or refuses its module,
/// naming the call; the same error again otherwise (the context could not be made current).
fn again(e: &DeviceError) -> DeviceError {
    match e {
        DeviceError::Unsupported(what) => DeviceError::Unsupported(what),
        DeviceError::Backend {
            call: "cuModuleLoadData",
            ..
        } => DeviceError::Unsupported(
            "fingerprint: the driver refused the kernel's module (cuModuleLoadData failed)",
        ),
        DeviceError::Backend {
            call: "cuModuleGetFunction",
            ..
        } => DeviceError::Unsupported(
            "fingerprint: the kernel's module lacks it (cuModuleGetFunction failed)",
        ),
        DeviceError::Backend {
            call,
            code,
            message,
        } => DeviceError::Backend {
            call,
            code: *code,
            message: message.clone(),
        },
        other => DeviceError::Backend {
            call: "fingerprint kernel",
            code: -1,
            message: other.to_string(),
        },
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let t = self.tables.get_mut();
        if t.mappings.is_empty() && t.reservations.is_empty() {
            return;
        }
        if self.ctx.bind().is_err() {
            return;
        }
        // Nothing queued may still use the memory. An error here is a sticky context error: then
        // nothing runs any more either.
        let _ = self.ctx.synchronize();
        for (va, mem) in std::mem::take(&mut t.mappings) {
            let _ = driver::unmap(va, mem.size());
            let _ = mem.release();
        }
        for (va, size) in std::mem::take(&mut t.reservations) {
            let _ = driver::address_free(va, size);
        }
    }
}
