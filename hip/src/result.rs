//! The middle layer: each HIP call possum makes, wrapped so that it returns a
//! [`DeviceResult`], and RAII types for the runtime objects possum owns. The only module with
//! `unsafe` code besides [`crate::sys`]. Rules it keeps:
//!
//! - Every call's answer goes through [`Runtime::check`] (or [`Runtime::check_async`]), so a
//!   failure becomes a [`DeviceError`] naming the call, with HIP's code, name and description.
//! - Every function here is safe to call, and its soundness does not depend on the caller.
//!   Device addresses are not host memory here: a wrong one makes the runtime refuse the call
//!   or the GPU fault; the layer above ([`crate::device`]) checks them against its own tables
//!   first. (On the simulated runtime device memory *is* host memory, at addresses the runtime
//!   chose in its own arena; the same checks keep copies inside it.)
//! - Host memory the device reads or writes asynchronously belongs to a [`HipPending`] until the
//!   copy is known to be complete; if that can't be established, the memory is leaked, never
//!   freed.
//! - HIP's current device is per thread: the layer above calls [`Runtime::set_device`] before
//!   calls that act on "the current device".
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::path::Path;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use possum_engine::backend::{
    self, backend_error, check_call, CopyEvent, CopyStream, Pinned, PinnedAlloc,
};
use possum_engine::device::{DeviceError, DeviceResult};

use crate::sys::{self, hipError_t, Api, LoadError};

/// A loaded HIP runtime. Shared (`Arc`) by every object made through it, so the library stays
/// loaded while any of them lives.
#[derive(Debug)]
pub struct Runtime {
    api: Api,
}

/// A device address as HIP's `void*`.
fn dptr(va: u64) -> *mut c_void {
    va as usize as *mut c_void
}

macro_rules! call {
    ($rt:expr, $f:ident ( $($arg:expr),* $(,)? )) => {{
        let rt: &Runtime = $rt;
        // SAFETY: the entry point was looked up with HIP's declared type (`sys::Api::load`);
        // its arguments are plain values, device addresses (refused by the runtime, not host
        // memory, when wrong), or pointers to locals of the declared types that outlive the
        // call, as each call site shows.
        rt.check(stringify!($f), unsafe { (rt.api.$f)($($arg),*) })
    }};
}

impl Runtime {
    /// Loads the HIP runtime at `path` ([`Api::load`]).
    pub fn load(path: impl AsRef<Path>) -> Result<Arc<Runtime>, LoadError> {
        Ok(Arc::new(Runtime {
            api: Api::load(path)?,
        }))
    }

    /// The path the runtime was loaded from.
    pub fn path(&self) -> &Path {
        self.api.path()
    }

    fn c_text(p: *const c_char) -> Option<String> {
        if p.is_null() {
            return None;
        }
        // SAFETY: HIP's hipGetErrorName/String return static NUL-terminated strings.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }

    /// HIP's name and description of `r`: "hipErrorOutOfMemory: out of memory".
    pub fn describe(&self, r: hipError_t) -> String {
        // SAFETY: both take any code and return a static string (or null).
        let name = Self::c_text(unsafe { (self.api.hipGetErrorName)(r) });
        // SAFETY: as above.
        let text = Self::c_text(unsafe { (self.api.hipGetErrorString)(r) });
        match (name, text) {
            (Some(n), Some(t)) => format!("{n}: {t}"),
            (Some(n), None) => n,
            _ => format!("HIP error {r}"),
        }
    }

    /// `Ok` for `hipSuccess`, else a [`DeviceError::Backend`] naming `call`.
    pub fn check(&self, call: &'static str, r: hipError_t) -> DeviceResult<()> {
        check_call(call, r == sys::hipSuccess, i64::from(r), || {
            self.describe(r)
        })
    }

    /// Like [`check`](Self::check), for calls that wait for earlier asynchronous work: their
    /// errors are that work's, so they become [`DeviceError::StreamFailed`].
    pub fn check_async(&self, call: &'static str, r: hipError_t) -> DeviceResult<()> {
        backend::as_stream_failure(self.check(call, r))
    }

    /// `hipInit(0)`.
    pub fn init(&self) -> DeviceResult<()> {
        call!(self, hipInit(0))
    }

    /// Devices the runtime sees.
    pub fn device_count(&self) -> DeviceResult<usize> {
        let mut n: c_int = 0;
        call!(self, hipGetDeviceCount(&mut n))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Makes `ordinal` the calling thread's current device.
    pub fn set_device(&self, ordinal: c_int) -> DeviceResult<()> {
        call!(self, hipSetDevice(ordinal))
    }

    /// The calling thread's current device.
    pub fn current_device(&self) -> DeviceResult<c_int> {
        let mut d: c_int = 0;
        call!(self, hipGetDevice(&mut d))?;
        Ok(d)
    }

    /// The runtime's name of device `ordinal`.
    pub fn device_name(&self, ordinal: c_int) -> DeviceResult<String> {
        let mut buf = [0 as c_char; 256];
        call!(
            self,
            hipDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, ordinal)
        )?;
        // The runtime NUL-terminates within `len`; the last byte is forced to NUL anyway.
        buf[buf.len() - 1] = 0;
        Ok(Self::c_text(buf.as_ptr()).unwrap_or_default())
    }

    /// Waits for everything queued on the current device, by anyone.
    pub fn synchronize_device(&self) -> DeviceResult<()> {
        // SAFETY: takes no arguments.
        let r = unsafe { (self.api.hipDeviceSynchronize)() };
        self.check_async("hipDeviceSynchronize", r)
    }

    /// (least, greatest) stream priority of the current device (smaller is more urgent).
    pub fn stream_priority_range(&self) -> DeviceResult<(i32, i32)> {
        let (mut least, mut greatest): (c_int, c_int) = (0, 0);
        call!(
            self,
            hipDeviceGetStreamPriorityRange(&mut least, &mut greatest)
        )?;
        Ok((least, greatest))
    }

    /// (free, total) memory of the current device, in bytes.
    pub fn mem_get_info(&self) -> DeviceResult<(u64, u64)> {
        let (mut free, mut total) = (0usize, 0usize);
        call!(self, hipMemGetInfo(&mut free, &mut total))?;
        Ok((free as u64, total as u64))
    }

    /// `hipMemGetAllocationGranularity` for plain memory on device `ordinal`.
    pub fn granularity(&self, ordinal: c_int, recommended: bool) -> DeviceResult<u64> {
        let prop = alloc_prop(ordinal);
        let option = if recommended {
            sys::hipMemAllocationGranularityRecommended
        } else {
            sys::hipMemAllocationGranularityMinimum
        };
        let mut g = 0usize;
        call!(self, hipMemGetAllocationGranularity(&mut g, &prop, option))?;
        Ok(g as u64)
    }

    /// Reserves `size` bytes of device address space aligned to `align`.
    pub fn address_reserve(&self, size: u64, align: u64) -> DeviceResult<u64> {
        let size = to_usize("hipMemAddressReserve", size)?;
        let align = to_usize("hipMemAddressReserve", align)?;
        let mut va: *mut c_void = ptr::null_mut();
        call!(
            self,
            hipMemAddressReserve(&mut va, size, align, ptr::null_mut(), 0)
        )?;
        Ok(va as usize as u64)
    }

    /// Frees a reservation made by [`address_reserve`](Self::address_reserve). Nothing may be
    /// mapped in it.
    pub fn address_free(&self, va: u64, size: u64) -> DeviceResult<()> {
        let size = to_usize("hipMemAddressFree", size)?;
        call!(self, hipMemAddressFree(dptr(va), size))
    }

    /// Unmaps `[va, va + size)`. No queued work may still use it (the runtime waits for the
    /// device; a GPU would fault on work that reaches it later).
    pub fn unmap(&self, va: u64, size: u64) -> DeviceResult<()> {
        let size = to_usize("hipMemUnmap", size)?;
        call!(self, hipMemUnmap(dptr(va), size))
    }
}

fn to_usize(call: &'static str, n: u64) -> DeviceResult<usize> {
    backend::usize_arg(call, n, i64::from(sys::hipErrorInvalidValue))
}

fn device_location(ordinal: c_int) -> sys::hipMemLocation {
    sys::hipMemLocation {
        type_: sys::hipMemLocationTypeDevice,
        id: ordinal,
    }
}

/// Plain device memory on `ordinal`: pinned (not migratable), no shareable handle.
fn alloc_prop(ordinal: c_int) -> sys::hipMemAllocationProp {
    sys::hipMemAllocationProp {
        type_: sys::hipMemAllocationTypePinned,
        requestedHandleType: sys::hipMemHandleTypeNone,
        location: device_location(ordinal),
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::hipMemAllocationFlags::default(),
    }
}

/// Whether `e` is the runtime saying it is out of memory.
pub fn is_out_of_memory(e: &DeviceError) -> bool {
    matches!(e, DeviceError::Backend { code, .. } if *code == i64::from(sys::hipErrorOutOfMemory))
}

/// Physical device memory (`hipMemCreate`), released on drop. A mapping holds its own reference
/// in the runtime, so dropping this while mapped only drops possum's handle.
#[derive(Debug)]
pub struct PhysMem {
    handle: sys::hipMemGenericAllocationHandle_t,
    size: u64,
    ordinal: c_int,
    released: bool,
    rt: Arc<Runtime>,
}

// SAFETY: the handle is an opaque value the runtime lets any thread use; it is never
// dereferenced here.
unsafe impl Send for PhysMem {}
// SAFETY: as above; no method mutates through `&self`.
unsafe impl Sync for PhysMem {}

impl PhysMem {
    /// Creates `size` bytes of physical memory on device `ordinal`.
    pub fn create(rt: &Arc<Runtime>, ordinal: c_int, size: u64) -> DeviceResult<PhysMem> {
        let prop = alloc_prop(ordinal);
        let mut handle: sys::hipMemGenericAllocationHandle_t = ptr::null_mut();
        let n = to_usize("hipMemCreate", size)?;
        call!(rt, hipMemCreate(&mut handle, n, &prop, 0))?;
        Ok(PhysMem {
            handle,
            size,
            ordinal,
            released: false,
            rt: rt.clone(),
        })
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Maps all of it at `va` (inside a reservation) and gives its device read/write access. On
    /// failure nothing stays mapped.
    pub fn map_at(&self, va: u64) -> DeviceResult<()> {
        let size = to_usize("hipMemMap", self.size)?;
        call!(&self.rt, hipMemMap(dptr(va), size, 0, self.handle, 0))?;
        let desc = sys::hipMemAccessDesc {
            location: device_location(self.ordinal),
            flags: sys::hipMemAccessFlagsProtReadWrite,
        };
        if let Err(e) = call!(&self.rt, hipMemSetAccess(dptr(va), size, &desc, 1)) {
            let _ = self.rt.unmap(va, self.size);
            return Err(e);
        }
        Ok(())
    }

    /// Releases the handle, reporting the runtime's answer (dropping does the same, silently).
    pub fn release(mut self) -> DeviceResult<()> {
        self.released = true;
        call!(&self.rt, hipMemRelease(self.handle))
    }
}

impl Drop for PhysMem {
    fn drop(&mut self) {
        if !self.released {
            let _ = call!(&self.rt, hipMemRelease(self.handle));
        }
    }
}

/// Where [`PinnedBuf`]s come from: `hipHostMalloc` of a runtime.
#[derive(Debug, Clone)]
pub struct PinnedHost(Arc<Runtime>);

impl PinnedAlloc for PinnedHost {
    fn alloc_pinned(&self, len: usize) -> DeviceResult<&'static mut [u8]> {
        let mut p: *mut c_void = ptr::null_mut();
        call!(
            &self.0,
            hipHostMalloc(&mut p, len, sys::hipHostMallocDefault)
        )?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| {
            backend_error(
                "hipHostMalloc",
                i64::from(sys::hipErrorOutOfMemory),
                "the runtime returned a null pointer".to_string(),
            )
        })?;
        // SAFETY: the runtime just allocated `len` writable bytes at `ptr`, used by nothing
        // else, and freed only in `free_pinned`, which takes them back from the one
        // `PinnedBuf` they are handed to; zeroed first, they are initialised.
        unsafe {
            ptr::write_bytes(ptr.as_ptr(), 0, len);
            Ok(std::slice::from_raw_parts_mut(ptr.as_ptr(), len))
        }
    }

    fn free_pinned(&self, mem: Pinned) {
        let _ = call!(&self.0, hipHostFree(mem.into_ptr().cast()));
    }
}

/// Pinned host memory from `hipHostMalloc` ([`PinnedHost`]): usable for asynchronous copies.
/// Zeroed when allocated; freed on drop.
pub type PinnedBuf = backend::PinnedBuf<PinnedHost>;

/// Allocates `len` bytes of pinned, zeroed host memory through `rt`.
pub fn pinned(rt: &Arc<Runtime>, len: usize) -> DeviceResult<PinnedBuf> {
    PinnedBuf::alloc(PinnedHost(rt.clone()), len)
}

struct StreamInner {
    raw: sys::hipStream_t,
    rt: Arc<Runtime>,
    /// Destroyed with the last clone (possum's own); a job's stream is not.
    owned: bool,
}

// SAFETY: a hipStream_t is a handle the runtime lets every thread use concurrently.
unsafe impl Send for StreamInner {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for StreamInner {}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if self.owned {
            // The runtime lets work already queued finish before the stream goes.
            let _ = call!(&self.rt, hipStreamDestroy(self.raw));
        }
    }
}

/// A HIP stream possum created: cheap to clone (shared), destroyed with the last clone.
#[derive(Clone)]
pub struct HipStream(Arc<StreamInner>);

impl fmt::Debug for HipStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("HipStream").field(&self.0.raw).finish()
    }
}

impl PartialEq for HipStream {
    fn eq(&self, other: &Self) -> bool {
        self.0.raw == other.0.raw
    }
}

impl Eq for HipStream {}

impl HipStream {
    /// Creates a non-blocking stream (not synchronised with the null stream) of `priority`.
    pub fn create(rt: &Arc<Runtime>, priority: i32) -> DeviceResult<HipStream> {
        let mut raw: sys::hipStream_t = ptr::null_mut();
        call!(
            rt,
            hipStreamCreateWithPriority(&mut raw, sys::hipStreamNonBlocking, priority)
        )?;
        Ok(HipStream(Arc::new(StreamInner {
            raw,
            rt: rt.clone(),
            owned: true,
        })))
    }

    /// The job's stream `raw` (a `hipStream_t` it made, or 0 for the null stream), for the
    /// engine to order its copies against: never destroyed by possum. `raw` must stay valid
    /// while this is used (the job destroys it only once done with it).
    pub fn of_job(rt: &Arc<Runtime>, raw: usize) -> HipStream {
        HipStream(Arc::new(StreamInner {
            raw: raw as sys::hipStream_t,
            rt: rt.clone(),
            owned: false,
        }))
    }

    /// The `hipStream_t`, as an address.
    pub fn raw(&self) -> usize {
        self.0.raw as usize
    }

    fn rt(&self) -> &Runtime {
        &self.0.rt
    }

    /// The stream's priority as the runtime reports it (smaller is more urgent).
    pub fn priority(&self) -> DeviceResult<i32> {
        let mut p: c_int = 0;
        call!(self.rt(), hipStreamGetPriority(self.0.raw, &mut p))?;
        Ok(p)
    }

    /// Blocks until all work queued so far has completed: on an event recorded at its end
    /// (which sleeps rather than spins); if none can be made, on the stream itself.
    pub fn synchronize(&self) -> DeviceResult<()> {
        if let Ok(ev) = HipEvent::record(self) {
            return ev.synchronize();
        }
        // SAFETY: the stream handle is owned by `self` and valid.
        let r = unsafe { (self.rt().api.hipStreamSynchronize)(self.0.raw) };
        self.rt().check_async("hipStreamSynchronize", r)
    }

    /// Makes the device wait, in this stream, for `event`.
    pub fn wait_event(&self, event: &HipEvent) -> DeviceResult<()> {
        call!(self.rt(), hipStreamWaitEvent(self.0.raw, event.0.raw, 0))
    }

    /// Queues `len` bytes of `value` at device address `dst`.
    pub fn memset_d8(&self, dst: u64, value: u8, len: u64) -> DeviceResult<()> {
        let n = to_usize("hipMemsetAsync", len)?;
        call!(
            self.rt(),
            hipMemsetAsync(dptr(dst), c_int::from(value), n, self.0.raw)
        )
    }

    /// Queues a device-to-device copy of `len` bytes.
    pub fn copy_d2d(&self, src: u64, dst: u64, len: u64) -> DeviceResult<()> {
        if len == 0 {
            return Ok(());
        }
        let n = to_usize("hipMemcpyAsync", len)?;
        call!(
            self.rt(),
            hipMemcpyAsync(
                dptr(dst),
                dptr(src),
                n,
                sys::hipMemcpyDeviceToDevice,
                self.0.raw
            )
        )
    }

    /// Queues a copy of `len` bytes from device `src` into the start of `dst`.
    pub fn copy_d2h(&self, src: u64, dst: PinnedBuf, len: usize) -> DeviceResult<HipPending> {
        let kind = sys::hipMemcpyDeviceToHost;
        HipPending::start(self, dst, len, |host| {
            let (to, n) = (host.as_mut_ptr().cast::<c_void>(), host.len());
            // SAFETY: `to` is valid for `n` bytes of writes. The buffer it is in moves into the
            // returned `HipPending`, which keeps it alive, unread and unwritten by safe code,
            // until an event recorded after this copy (or the stream) says it is complete.
            let r = unsafe { (self.rt().api.hipMemcpyAsync)(to, dptr(src), n, kind, self.0.raw) };
            self.rt().check("hipMemcpyAsync", r)
        })
    }

    /// Queues a copy of the first `len` bytes of `src` to device `dst`.
    pub fn copy_h2d(&self, src: PinnedBuf, dst: u64, len: usize) -> DeviceResult<HipPending> {
        let kind = sys::hipMemcpyHostToDevice;
        HipPending::start(self, src, len, |host| {
            let (from, n) = (host.as_ptr().cast::<c_void>(), host.len());
            // SAFETY: `from` is valid for `n` bytes of reads; the buffer it is in moves into the
            // returned `HipPending`, which keeps it alive and unwritten until the copy is
            // complete.
            let r = unsafe { (self.rt().api.hipMemcpyAsync)(dptr(dst), from, n, kind, self.0.raw) };
            self.rt().check("hipMemcpyAsync", r)
        })
    }
}

impl CopyStream for HipStream {
    type Event = HipEvent;

    fn record(&self) -> DeviceResult<HipEvent> {
        HipEvent::record(self)
    }

    fn synchronize(&self) -> DeviceResult<()> {
        HipStream::synchronize(self)
    }
}

#[derive(Debug)]
struct EventInner {
    raw: sys::hipEvent_t,
    rt: Arc<Runtime>,
}

// SAFETY: a hipEvent_t is a handle the runtime lets every thread use concurrently.
unsafe impl Send for EventInner {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for EventInner {}

impl Drop for EventInner {
    fn drop(&mut self) {
        // Destroying an event whose work is still queued is allowed: the runtime frees it once
        // that work is done.
        let _ = call!(&self.rt, hipEventDestroy(self.raw));
    }
}

/// A HIP event (no timing, blocking sync), recorded once when made. Cheap to clone.
#[derive(Clone, Debug)]
pub struct HipEvent(Arc<EventInner>);

impl HipEvent {
    /// Creates an event and records it at the current end of `stream`. A thread that waits for
    /// it sleeps (`hipEventBlockingSync`): possum's background threads wait on many copies and
    /// must not take CPUs from the job's threads by spinning.
    pub fn record(stream: &HipStream) -> DeviceResult<HipEvent> {
        let rt = &stream.0.rt;
        let mut raw: sys::hipEvent_t = ptr::null_mut();
        call!(
            rt,
            hipEventCreateWithFlags(
                &mut raw,
                sys::hipEventDisableTiming | sys::hipEventBlockingSync
            )
        )?;
        let ev = HipEvent(Arc::new(EventInner {
            raw,
            rt: rt.clone(),
        }));
        call!(rt, hipEventRecord(raw, stream.0.raw))?;
        Ok(ev)
    }

    /// Blocks until the work before the event has completed.
    pub fn synchronize(&self) -> DeviceResult<()> {
        // SAFETY: the event handle is owned by `self` and valid.
        let r = unsafe { (self.0.rt.api.hipEventSynchronize)(self.0.raw) };
        self.0.rt.check_async("hipEventSynchronize", r)
    }

    /// Whether the work before the event has completed (without blocking).
    pub fn query(&self) -> DeviceResult<bool> {
        // SAFETY: the event handle is owned by `self` and valid.
        let r = unsafe { (self.0.rt.api.hipEventQuery)(self.0.raw) };
        if r == sys::hipErrorNotReady {
            return Ok(false);
        }
        self.0.rt.check_async("hipEventQuery", r).map(|()| true)
    }
}

impl CopyEvent for HipEvent {
    fn synchronize(&self) -> DeviceResult<()> {
        HipEvent::synchronize(self)
    }

    fn query(&self) -> DeviceResult<bool> {
        HipEvent::query(self)
    }
}

/// An asynchronous copy between a [`PinnedBuf`] and the device on a [`HipStream`]
/// ([`backend::Pending`]): owns the buffer until the copy is complete.
pub type HipPending = backend::Pending<HipStream, PinnedBuf>;

/// What the simulated runtime lets a test observe ([`sys::SimHooks`]); nothing of HIP's.
#[derive(Debug)]
pub struct SimProbe {
    hooks: sys::SimHooks,
}

impl SimProbe {
    /// The hooks of the simulated runtime at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<SimProbe, LoadError> {
        Ok(SimProbe {
            hooks: sys::SimHooks::load(path)?,
        })
    }

    /// The `hipMemcpyAsync` calls queued so far, by every thread of the process, on streams of
    /// `priority`.
    pub fn copies_at_priority(&self, priority: i32) -> u64 {
        // SAFETY: takes any value and reads a counter under the runtime's lock.
        unsafe { (self.hooks.fakeHipCopiesAtPriority)(priority) }
    }
}
