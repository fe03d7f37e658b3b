//! The `host` backend: a [`Device`] in host memory, with real concurrency.
//!
//! Each stream is a worker thread that runs its operations in order; events are flags with a
//! condition variable; "device memory" is a map from virtual address to a heap block, so a released
//! buffer really loses its contents and an access to it really fails (as a GPU would fault). This is
//! what lets CI run the engine's real logic without a GPU.
//!
//! A job's "kernels" are closures run on a stream by [`HostDevice::launch`]; they see memory through
//! [`HostMem::with`], which locks the buffers they read and write (in address order, so racing jobs
//! cannot deadlock). Stream priorities are recorded but not enforced: each stream already has its own
//! thread, so a priority copy never queues behind background copies.
//!
//! Operations fail like CUDA's: a failed operation makes its stream's error sticky, later operations
//! on that stream are skipped, and the error surfaces at the next synchronisation point.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use parking_lot::lock_api::{ArcRwLockReadGuard, ArcRwLockWriteGuard};
use parking_lot::{Condvar, Mutex, RawRwLock, RwLock};

use crate::device::{
    DevPtr, Device, DeviceError, DeviceResult, HostBuffer, StreamPriority, Transfer,
};

const GRANULARITY: u64 = 64 * 1024;
/// Virtual addresses start here so that 0 and small integers are never valid pointers.
const VA_BASE: u64 = 0x7f00_0000_0000;

/// The memory of one mapping, shared with the kernels and copies using it.
type Block = Arc<RwLock<Box<[u8]>>>;

#[derive(Debug)]
struct Mapping {
    size: u64,
    data: Block,
}

#[derive(Debug)]
struct Space {
    capacity: u64,
    used: AtomicU64,
    next_va: AtomicU64,
    reservations: Mutex<BTreeMap<u64, u64>>,
    mappings: RwLock<BTreeMap<u64, Mapping>>,
    /// With a simulated keeper: memory detached from its mapping, by address, kept with its
    /// contents (still counted in `used`).
    kept: Option<Mutex<BTreeMap<u64, Mapping>>>,
    /// Times `disconnect` was called.
    disconnects: AtomicU64,
    /// Bytes of kept memory `reattach` mapped again, in all.
    reattached: AtomicU64,
}

impl Space {
    /// The simulated keeper's memory, for `what` (only on a device made with
    /// [`HostDevice::keeping`]).
    fn kept(&self, what: &'static str) -> DeviceResult<&Mutex<BTreeMap<u64, Mapping>>> {
        self.kept.as_ref().ok_or(DeviceError::Unsupported(what))
    }

    /// `size` bytes of new zeroed memory, counted as used; out of memory past the capacity.
    fn new_mapping(&self, size: u64) -> DeviceResult<Mapping> {
        let used = self.used.load(Ordering::Relaxed);
        if used + size > self.capacity {
            return Err(DeviceError::OutOfMemory {
                requested: size,
                free: self.capacity.saturating_sub(used),
            });
        }
        self.used.fetch_add(size, Ordering::Relaxed);
        Ok(Mapping {
            size,
            data: Arc::new(RwLock::new(vec![0u8; to_usize(size)].into_boxed_slice())),
        })
    }

    /// The mapping containing `[va, va+len)`, and the offset of `va` in it.
    fn find(&self, va: DevPtr, len: u64) -> DeviceResult<(Block, usize)> {
        let maps = self.mappings.read();
        let (start, m) = maps
            .range(..=va.0)
            .next_back()
            .ok_or(DeviceError::InvalidAddress {
                va,
                len,
                why: "not mapped",
            })?;
        let off = va.0 - start;
        if off + len > m.size {
            return Err(DeviceError::InvalidAddress {
                va,
                len,
                why: if off >= m.size {
                    "not mapped"
                } else {
                    "crosses the end of a mapping"
                },
            });
        }
        Ok((Arc::clone(&m.data), to_usize(off)))
    }
}

fn to_usize(v: u64) -> usize {
    usize::try_from(v).expect("host backend needs a 64-bit target")
}

/// Host memory for copies (plain heap memory: nothing to pin on the host backend).
#[derive(Debug)]
pub struct HostBuf(Box<[u8]>);

impl HostBuffer for HostBuf {
    fn as_slice(&self) -> &[u8] {
        &self.0
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

type Op = Box<dyn FnOnce(&Space) -> DeviceResult<()> + Send>;
/// Stream-order work that also runs after a failure, receiving the sticky error.
type MarkerFn = Box<dyn FnOnce(Option<&str>) + Send>;

enum Work {
    Op(Op),
    /// Runs even when the stream has failed, receiving the sticky error.
    Marker(MarkerFn),
}

#[derive(Debug)]
struct StreamInner {
    tx: Sender<Work>,
    priority: StreamPriority,
    id: u64,
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Work::Op(_) => "Op",
            Work::Marker(_) => "Marker",
        })
    }
}

/// A stream of the host backend: a worker thread running operations in order.
#[derive(Clone, Debug)]
pub struct HostStream(Arc<StreamInner>);

impl HostStream {
    /// The stream's priority as created.
    pub fn priority(&self) -> StreamPriority {
        self.0.priority
    }
    /// A number identifying the stream within its device.
    pub fn id(&self) -> u64 {
        self.0.id
    }
}

#[derive(Debug, Default)]
struct EventState {
    /// `None` until complete; then `Some(Ok)` or the stream's error.
    done: Mutex<Option<Result<(), String>>>,
    cv: Condvar,
}

/// An event of the host backend.
#[derive(Clone, Debug)]
pub struct HostEvent(Arc<EventState>);

impl HostEvent {
    fn complete(&self, r: Result<(), String>) {
        *self.0.done.lock() = Some(r);
        self.0.cv.notify_all();
    }
    fn wait(&self) -> Result<(), String> {
        let mut g = self.0.done.lock();
        while g.is_none() {
            self.0.cv.wait(&mut g);
        }
        g.clone().expect("checked above")
    }
}

/// A copy in flight on the host backend.
#[derive(Debug)]
pub struct HostPending(Receiver<(DeviceResult<()>, HostBuf)>);

impl Transfer<HostBuf> for HostPending {
    fn wait(self) -> DeviceResult<HostBuf> {
        let (r, buf) = self
            .0
            .recv()
            .map_err(|_| DeviceError::StreamFailed("stream worker exited".into()))?;
        r.map(|()| buf)
    }
}

/// A device in host memory.
#[derive(Clone, Debug)]
pub struct HostDevice {
    space: Arc<Space>,
    next_stream: Arc<AtomicU64>,
    /// Every stream made on this device, for `synchronize_device` (dropped ones are skipped).
    streams: Arc<Mutex<Vec<std::sync::Weak<StreamInner>>>>,
}

impl HostDevice {
    /// A device with `capacity` bytes of "device memory".
    pub fn new(capacity: u64) -> Self {
        Self::with_space(capacity, false)
    }

    /// A device whose memory is kept by a simulated keeper: [`Device::detach`] keeps a mapping's
    /// memory and contents, [`Device::reattach`] maps it again.
    pub fn keeping(capacity: u64) -> Self {
        Self::with_space(capacity, true)
    }

    /// Times [`Device::disconnect`] was called.
    pub fn disconnects(&self) -> u64 {
        self.space.disconnects.load(Ordering::Relaxed)
    }

    /// Bytes kept detached now.
    pub fn kept_bytes(&self) -> u64 {
        self.space
            .kept
            .as_ref()
            .map_or(0, |k| k.lock().values().map(|m| m.size).sum())
    }

    /// Bytes of kept memory [`Device::reattach`] has mapped again since the device was made.
    pub fn reattached_bytes(&self) -> u64 {
        self.space.reattached.load(Ordering::Relaxed)
    }

    /// Simulates the keeper losing what it kept (its process gone): `reattach` then fails.
    #[doc(hidden)]
    pub fn lose_kept(&self) {
        if let Some(k) = &self.space.kept {
            let n: u64 = std::mem::take(&mut *k.lock())
                .values()
                .map(|m| m.size)
                .sum();
            self.space.used.fetch_sub(n, Ordering::Relaxed);
        }
    }

    fn with_space(capacity: u64, keeps: bool) -> Self {
        HostDevice {
            space: Arc::new(Space {
                capacity,
                used: AtomicU64::new(0),
                next_va: AtomicU64::new(VA_BASE),
                reservations: Mutex::new(BTreeMap::new()),
                mappings: RwLock::new(BTreeMap::new()),
                kept: keeps.then(|| Mutex::new(BTreeMap::new())),
                disconnects: AtomicU64::new(0),
                reattached: AtomicU64::new(0),
            }),
            next_stream: Arc::new(AtomicU64::new(0)),
            streams: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// Runs `kernel` on `stream`, in order with the stream's other work: the job's own operations.
    pub fn launch(
        &self,
        stream: &HostStream,
        kernel: impl FnOnce(&HostMem<'_>) -> DeviceResult<()> + Send + 'static,
    ) -> DeviceResult<()> {
        enqueue(
            stream,
            Work::Op(Box::new(move |space| kernel(&HostMem { space }))),
        )
    }

    /// Reads device memory synchronously (outside any stream): for tests and verification.
    pub fn read_now(&self, va: DevPtr, len: u64) -> DeviceResult<Vec<u8>> {
        let (data, off) = self.space.find(va, len)?;
        let g = data.read();
        Ok(g[off..off + to_usize(len)].to_vec())
    }

    /// Writes device memory synchronously (outside any stream): for tests and set-up.
    pub fn write_now(&self, va: DevPtr, bytes: &[u8]) -> DeviceResult<()> {
        let (data, off) = self.space.find(va, bytes.len() as u64)?;
        data.write()[off..off + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    /// Bytes of device memory mapped now.
    pub fn mapped_bytes(&self) -> u64 {
        self.space.used.load(Ordering::Relaxed)
    }
}

/// Device memory as a host "kernel" sees it.
#[derive(Debug)]
pub struct HostMem<'a> {
    space: &'a Space,
}

impl HostMem<'_> {
    /// Locks the ranges a kernel reads and writes (in address order) and calls `f` with them.
    /// A range must lie inside one mapping; no mapping may appear twice.
    pub fn with<R>(
        &self,
        reads: &[(DevPtr, u64)],
        writes: &[(DevPtr, u64)],
        f: impl FnOnce(&[&[u8]], &mut [&mut [u8]]) -> R,
    ) -> DeviceResult<R> {
        enum G {
            R(ArcRwLockReadGuard<RawRwLock, Box<[u8]>>),
            W(ArcRwLockWriteGuard<RawRwLock, Box<[u8]>>),
        }
        let mut order: Vec<(u64, bool, usize)> = reads
            .iter()
            .enumerate()
            .map(|(i, r)| (r.0 .0, false, i))
            .chain(writes.iter().enumerate().map(|(i, w)| (w.0 .0, true, i)))
            .collect();
        order.sort_unstable();
        let mut found = Vec::with_capacity(order.len());
        for &(_, is_write, i) in &order {
            let (va, len) = if is_write { writes[i] } else { reads[i] };
            let (data, off) = self.space.find(va, len)?;
            if found.iter().any(|(d, _, _, _, _)| Arc::ptr_eq(d, &data)) {
                return Err(DeviceError::InvalidAddress {
                    va,
                    len,
                    why: "a kernel's ranges must lie in distinct mappings",
                });
            }
            found.push((data, off, to_usize(len), is_write, i));
        }
        let mut guards: Vec<(G, usize, usize, bool, usize)> = found
            .into_iter()
            .map(|(d, off, len, w, i)| {
                let g = if w {
                    G::W(d.write_arc())
                } else {
                    G::R(d.read_arc())
                };
                (g, off, len, w, i)
            })
            .collect();
        let mut ins: Vec<(usize, &[u8])> = Vec::with_capacity(reads.len());
        let mut outs: Vec<(usize, &mut [u8])> = Vec::with_capacity(writes.len());
        for (g, off, len, _, i) in guards.iter_mut() {
            match g {
                G::R(r) => ins.push((*i, &r[*off..*off + *len])),
                G::W(w) => outs.push((*i, &mut w[*off..*off + *len])),
            }
        }
        ins.sort_unstable_by_key(|(i, _)| *i);
        outs.sort_unstable_by_key(|(i, _)| *i);
        let ins: Vec<&[u8]> = ins.into_iter().map(|(_, s)| s).collect();
        let mut outs: Vec<&mut [u8]> = outs.into_iter().map(|(_, s)| s).collect();
        Ok(f(&ins, &mut outs))
    }
}

fn enqueue(stream: &HostStream, work: Work) -> DeviceResult<()> {
    stream
        .0
        .tx
        .send(work)
        .map_err(|_| DeviceError::StreamFailed("stream worker exited".into()))
}

/// Enqueues a copy between the device memory at `va` and the host buffer `buf`, which travels with
/// the operation and comes back through the returned [`HostPending`] whichever way the stream goes:
/// if the stream has already failed, the operation is skipped and the marker after it reports that.
fn enqueue_transfer(
    stream: &HostStream,
    va: DevPtr,
    len: u64,
    mut buf: HostBuf,
    copy: fn(&Block, usize, &mut HostBuf, usize),
) -> DeviceResult<HostPending> {
    if len > buf.len() as u64 {
        return Err(DeviceError::HostBufferTooSmall {
            need: len,
            have: buf.len() as u64,
        });
    }
    let (tx, rx) = bounded(1);
    let tx2 = tx.clone();
    enqueue(
        stream,
        Work::Op(Box::new(move |space| {
            let r = space
                .find(va, len)
                .map(|(data, off)| copy(&data, off, &mut buf, to_usize(len)));
            let sticky = r.as_ref().err().map(ToString::to_string);
            let _ = tx.send((r, buf));
            sticky.map_or(Ok(()), |e| Err(DeviceError::StreamFailed(e)))
        })),
    )?;
    enqueue(
        stream,
        Work::Marker(Box::new(move |err| {
            if let Some(e) = err {
                let failed = Err(DeviceError::StreamFailed(e.to_owned()));
                let _ = tx2.try_send((failed, HostBuf(Box::new([]))));
            }
        })),
    )?;
    Ok(HostPending(rx))
}

fn stream_worker(space: Arc<Space>, rx: Receiver<Work>) {
    let mut sticky: Option<String> = None;
    for work in rx {
        match work {
            Work::Op(op) => {
                if sticky.is_none() {
                    if let Err(e) = op(&space) {
                        sticky = Some(e.to_string());
                    }
                }
            }
            Work::Marker(m) => m(sticky.as_deref()),
        }
    }
}

/// [`DeviceError::InvalidAddress`] of the range `size` bytes at `va`.
fn invalid(va: DevPtr, size: u64, why: &'static str) -> DeviceError {
    DeviceError::InvalidAddress { va, len: size, why }
}

impl Device for HostDevice {
    type Stream = HostStream;
    type Event = HostEvent;
    type HostBuf = HostBuf;
    type Pending = HostPending;

    fn name(&self) -> String {
        "host".into()
    }

    fn granularity(&self) -> u64 {
        GRANULARITY
    }

    fn memory_info(&self) -> DeviceResult<(u64, u64)> {
        let used = self.space.used.load(Ordering::Relaxed);
        Ok((
            self.space.capacity.saturating_sub(used),
            self.space.capacity,
        ))
    }

    fn reserve(&self, size: u64) -> DeviceResult<DevPtr> {
        if size == 0 || !size.is_multiple_of(GRANULARITY) {
            return Err(DeviceError::InvalidAddress {
                va: DevPtr(0),
                len: size,
                why: "reservation size must be a non-zero multiple of the granularity",
            });
        }
        // Leave a guard gap between reservations so an overrun never lands in a neighbour.
        let va = self
            .space
            .next_va
            .fetch_add(size + GRANULARITY, Ordering::Relaxed);
        self.space.reservations.lock().insert(va, size);
        Ok(DevPtr(va))
    }

    fn adopt_reservation(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        if size == 0 || !size.is_multiple_of(GRANULARITY) || !va.0.is_multiple_of(GRANULARITY) {
            return Err(invalid(
                va,
                size,
                "start or size is not a multiple of the granularity",
            ));
        }
        let mut res = self.space.reservations.lock();
        let overlaps = res
            .range(..va.0 + size)
            .next_back()
            .is_some_and(|(s, l)| s + l > va.0);
        if overlaps {
            return Err(invalid(va, size, "overlaps a reservation"));
        }
        // Nothing is reserved for it here (host addresses stand for device ones): it is only
        // recorded, as the CUDA backend records the job's range.
        res.insert(va.0, size);
        Ok(())
    }

    fn unreserve(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let maps = self.space.mappings.read();
        if maps.range(va.0..va.0 + size).next().is_some() {
            return Err(invalid(va, size, "still mapped"));
        }
        match self.space.reservations.lock().remove(&va.0) {
            Some(s) if s == size => Ok(()),
            _ => Err(invalid(va, size, "not a reservation")),
        }
    }

    fn map(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let inside = {
            let res = self.space.reservations.lock();
            res.range(..=va.0)
                .next_back()
                .is_some_and(|(s, l)| va.0 + size <= s + l)
        };
        if !inside {
            return Err(invalid(va, size, "outside any reservation"));
        }
        let mut maps = self.space.mappings.write();
        if maps.range(va.0..va.0 + size).next().is_some()
            || maps
                .range(..va.0)
                .next_back()
                .is_some_and(|(s, m)| s + m.size > va.0)
        {
            return Err(invalid(va, size, "already mapped"));
        }
        maps.insert(va.0, self.space.new_mapping(size)?);
        Ok(())
    }

    fn unmap(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let mut maps = self.space.mappings.write();
        match maps.get(&va.0) {
            Some(m) if m.size == size => {
                maps.remove(&va.0);
                self.space.used.fetch_sub(size, Ordering::Relaxed);
                Ok(())
            }
            _ => Err(invalid(va, size, "not a mapping of that size")),
        }
    }

    fn keeps_memory(&self) -> bool {
        self.space.kept.is_some()
    }

    fn detach(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let kept = self.space.kept("detach")?;
        let mut maps = self.space.mappings.write();
        match maps.get(&va.0) {
            Some(m) if m.size == size => {
                let m = maps.remove(&va.0).expect("checked above");
                kept.lock().insert(va.0, m);
                Ok(())
            }
            _ => Err(invalid(va, size, "not a mapping of that size")),
        }
    }

    fn reattach(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let kept = self.space.kept("reattach")?;
        let mut maps = self.space.mappings.write();
        let mut k = kept.lock();
        match k.get(&va.0) {
            Some(m) if m.size == size => {
                let m = k.remove(&va.0).expect("checked above");
                maps.insert(va.0, m);
                self.space.reattached.fetch_add(size, Ordering::Relaxed);
                Ok(())
            }
            _ => Err(invalid(va, size, "no memory kept for it")),
        }
    }

    /// The simulated keeper's prepared memory is zeroed; a test writes its contents once it is
    /// mapped ([`HostDevice::write_now`]).
    fn expect_kept(&self, va: DevPtr, size: u64, _id: u64, _epoch: u64) -> DeviceResult<()> {
        let kept = self.space.kept("expect_kept")?;
        let maps = self.space.mappings.read();
        let mut k = kept.lock();
        if maps.contains_key(&va.0) || k.contains_key(&va.0) {
            return Err(invalid(va, size, "mapped or kept already"));
        }
        k.insert(va.0, self.space.new_mapping(size)?);
        Ok(())
    }

    fn forget(&self, va: DevPtr, size: u64) -> DeviceResult<()> {
        let kept = self.space.kept("forget")?;
        match kept.lock().remove(&va.0) {
            Some(m) if m.size == size => {
                self.space.used.fetch_sub(size, Ordering::Relaxed);
                Ok(())
            }
            _ => Err(invalid(va, size, "no memory kept for it")),
        }
    }

    fn disconnect(&self) {
        self.space.disconnects.fetch_add(1, Ordering::Relaxed);
    }

    fn alloc_host(&self, len: usize) -> DeviceResult<HostBuf> {
        // Touch every page now, as pinning does on a GPU backend, so that first-touch page faults
        // happen here (at engine start) and not inside a checkpoint.
        let mut v = vec![0u8; len].into_boxed_slice();
        for page in v.chunks_mut(4096) {
            page[0] = std::hint::black_box(0);
        }
        Ok(HostBuf(v))
    }

    fn create_stream(&self, priority: StreamPriority) -> DeviceResult<HostStream> {
        let (tx, rx) = unbounded();
        let space = Arc::clone(&self.space);
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        std::thread::Builder::new()
            .name(format!("host-stream-{id}"))
            .spawn(move || stream_worker(space, rx))
            .map_err(|e| DeviceError::Backend {
                call: "thread spawn",
                code: i64::from(e.raw_os_error().unwrap_or(0)),
                message: e.to_string(),
            })?;
        let inner = Arc::new(StreamInner { tx, priority, id });
        let mut all = self.streams.lock();
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&inner));
        Ok(HostStream(inner))
    }

    fn copy_d2h(
        &self,
        stream: &HostStream,
        src: DevPtr,
        dst: HostBuf,
        len: u64,
    ) -> DeviceResult<HostPending> {
        enqueue_transfer(stream, src, len, dst, |data, off, buf, len| {
            buf.as_mut_slice()[..len].copy_from_slice(&data.read()[off..off + len]);
        })
    }

    fn copy_h2d(
        &self,
        stream: &HostStream,
        src: HostBuf,
        dst: DevPtr,
        len: u64,
    ) -> DeviceResult<HostPending> {
        enqueue_transfer(stream, dst, len, src, |data, off, buf, len| {
            data.write()[off..off + len].copy_from_slice(&buf.as_slice()[..len]);
        })
    }

    fn copy_d2d(
        &self,
        stream: &HostStream,
        src: DevPtr,
        dst: DevPtr,
        len: u64,
    ) -> DeviceResult<()> {
        enqueue(
            stream,
            Work::Op(Box::new(move |space| {
                let (s, so) = space.find(src, len)?;
                let (d, doff) = space.find(dst, len)?;
                if Arc::ptr_eq(&s, &d) {
                    let mut g = d.write();
                    g.copy_within(so..so + to_usize(len), doff);
                } else {
                    let sg = s.read();
                    let mut dg = d.write();
                    dg[doff..doff + to_usize(len)].copy_from_slice(&sg[so..so + to_usize(len)]);
                }
                Ok(())
            })),
        )
    }

    fn record_event(&self, stream: &HostStream) -> DeviceResult<HostEvent> {
        let ev = HostEvent(Arc::new(EventState::default()));
        let e2 = ev.clone();
        enqueue(
            stream,
            Work::Marker(Box::new(move |err| {
                e2.complete(err.map_or(Ok(()), |e| Err(e.to_owned())))
            })),
        )?;
        Ok(ev)
    }

    fn wait_event(&self, stream: &HostStream, event: &HostEvent) -> DeviceResult<()> {
        let ev = event.clone();
        enqueue(
            stream,
            Work::Op(Box::new(move |_| {
                ev.wait().map_err(DeviceError::StreamFailed)
            })),
        )
    }

    fn event_synchronize(&self, event: &HostEvent) -> DeviceResult<()> {
        event.wait().map_err(DeviceError::StreamFailed)
    }

    fn event_query(&self, event: &HostEvent) -> DeviceResult<bool> {
        match &*event.0.done.lock() {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(e)) => Err(DeviceError::StreamFailed(e.clone())),
        }
    }

    fn fingerprint_ready(&self) -> Result<(), String> {
        Ok(())
    }

    fn fingerprint(
        &self,
        stream: &HostStream,
        va: DevPtr,
        len: u64,
        chunk: u64,
    ) -> DeviceResult<Vec<crate::fingerprint::Fingerprint>> {
        if !va.0.is_multiple_of(16) || chunk == 0 || !chunk.is_multiple_of(16) {
            return Err(DeviceError::InvalidAddress {
                va,
                len,
                why: "a fingerprint's range and chunk must be aligned to 16 bytes",
            });
        }
        let (tx, rx) = bounded(1);
        enqueue(
            stream,
            Work::Op(Box::new(move |space| {
                let r = space.find(va, len).map(|(data, off)| {
                    let g = data.read();
                    crate::fingerprint::of_chunks(&g[off..off + to_usize(len)], to_usize(chunk))
                });
                let sticky = r.as_ref().err().map(ToString::to_string);
                let _ = tx.send(r);
                sticky.map_or(Ok(()), |e| Err(DeviceError::StreamFailed(e)))
            })),
        )?;
        match rx.recv() {
            Ok(r) => r,
            Err(_) => Err(DeviceError::StreamFailed(
                "an earlier operation on this stream failed".into(),
            )),
        }
    }

    fn synchronize(&self, stream: &HostStream) -> DeviceResult<()> {
        let ev = self.record_event(stream)?;
        self.event_synchronize(&ev)
    }

    /// Waits for every stream made on this device and still alive, as a device-wide
    /// synchronisation waits for every queue.
    fn synchronize_device(&self) -> DeviceResult<()> {
        let live: Vec<HostStream> = self
            .streams
            .lock()
            .iter()
            .filter_map(|w| w.upgrade().map(HostStream))
            .collect();
        for s in &live {
            self.synchronize(s)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev() -> HostDevice {
        HostDevice::new(1 << 30)
    }

    #[test]
    fn map_copy_release_remap_keeps_address() {
        let d = dev();
        let s = d.create_stream(StreamPriority::Normal).unwrap();
        let va = d.reserve(GRANULARITY * 2).unwrap();
        d.map(va, GRANULARITY * 2).unwrap();
        let mut b = d.alloc_host(4096).unwrap();
        b.as_mut_slice().fill(7);
        let b = d
            .copy_h2d(&s, b, va.add(100), 4096)
            .unwrap()
            .wait()
            .unwrap();
        let out = d
            .copy_d2h(&s, va.add(100), b, 4096)
            .unwrap()
            .wait()
            .unwrap();
        assert!(out.as_slice().iter().all(|&x| x == 7));
        d.unmap(va, GRANULARITY * 2).unwrap();
        // Released: an access now fails, as a GPU would fault.
        assert!(d.copy_d2h(&s, va, out, 16).unwrap().wait().is_err());
        // The stream error is sticky.
        assert!(d.synchronize(&s).is_err());
        let s = d.create_stream(StreamPriority::High).unwrap();
        d.map(va, GRANULARITY * 2).unwrap();
        assert_eq!(
            d.read_now(va.add(100), 4).unwrap(),
            vec![0; 4],
            "new memory, old contents gone"
        );
        d.synchronize(&s).unwrap();
    }

    #[test]
    fn events_order_streams() {
        let d = dev();
        let a = d.create_stream(StreamPriority::Normal).unwrap();
        let b = d.create_stream(StreamPriority::Normal).unwrap();
        let va = d.reserve(GRANULARITY).unwrap();
        d.map(va, GRANULARITY).unwrap();
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let g2 = Arc::clone(&gate);
        d.launch(&a, move |mem| {
            let mut open = g2.0.lock();
            while !*open {
                g2.1.wait(&mut open);
            }
            mem.with(&[], &[(va, 8)], |_, o| o[0].fill(1))
        })
        .unwrap();
        let ev = d.record_event(&a).unwrap();
        d.wait_event(&b, &ev).unwrap();
        d.launch(&b, move |mem| {
            mem.with(&[], &[(va, 8)], |_, o| {
                o[0].iter_mut().for_each(|x| *x += 1)
            })
        })
        .unwrap();
        assert!(!d.event_query(&ev).unwrap());
        *gate.0.lock() = true;
        gate.1.notify_all();
        d.synchronize(&b).unwrap();
        assert_eq!(d.read_now(va, 8).unwrap(), vec![2; 8]);
    }

    #[test]
    fn capacity_is_enforced() {
        let d = HostDevice::new(GRANULARITY * 2);
        let va = d.reserve(GRANULARITY * 4).unwrap();
        let err = d.map(va, GRANULARITY * 4).unwrap_err();
        assert!(matches!(err, DeviceError::OutOfMemory { .. }), "{err}");
    }
}
