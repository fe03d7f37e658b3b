//! Validation of a launch's speculated buffer sets, on both sides of the launch.
//!
//! Before: the device is synchronised, then every readable buffer (managed and unmanaged) is
//! checksummed whole (`POSSUM_VALIDATE=sample=N`: sampled windows of N bytes instead, which can
//! miss a write outside them), and the first 4 KiB behind each pointer the launch was passed
//! are scanned for live device pointers (a pointer table: the kernel may reach buffers its
//! parameters do not name). After (on the call's exit): the device is synchronised again, the same
//! windows are checksummed, and [`KernelModel::record_validation`] judges: a change in a buffer
//! the launch was not passed, or a pointer table, makes the kernel opaque from then on. Slots
//! whose buffer did not change earn read-only speculation, unless every sampled byte of that buffer
//! was one value before the launch (all zeros, all 0xff, ...): a write of that value, such as a
//! fill of zeros over zeros, would look the same, so such a slot counts neither way.
//!
//! The windows and scans of one side are read together: copies queued on a stream of possum's
//! into a pinned buffer, one wait per 8 MiB ([`Reader`]), not one synchronous copy each.
//!
//! With whole buffers (`sample=all`) and the device's engine there, a buffer of the engine's of
//! [`FP_MIN`] bytes or more is not read to the host: its fingerprints ([`Device::fingerprint`],
//! 8 MiB chunks) are taken on the device, on the same stream of possum's, and the two sides
//! compare those (each target is summed the same way on both sides). Its uniformity is told by
//! the first bytes, read as a window ([`PROBE`]), and by its fingerprints, which must equal those
//! of a buffer of that one byte: the rule above holds unchanged. A target not aligned to 16 bytes
//! (a slot's window at the address it was passed) is fingerprinted widened to 16 bytes each way
//! ([`device_range`]), counted constant if its first bytes are. Where the device cannot
//! fingerprint (a driver without the kernel, or that refuses it), the buffer is read to the host
//! as before; so is every allocation of the job's own (possum cannot know it is still mapped,
//! and a kernel reading an unmapped page would fault the context where a copy fails cleanly). A
//! target of 64 MiB or more read to the host is said in the log once, with why ([`LARGE_HOST_READ`]).
//! Device memory possum made for its own work (the
//! kernel's results) is never read: a stale word of the job can make it look like an
//! allocation of the job's, and possum's own work rewrites it; it counts neither way.
//!
//! The whole-buffer checksums see any change a launch made, but only on that launch: a write
//! that happens only on some launches, or that writes the bytes already there, is not seen, which
//! is why read-only speculation is off unless `readonly_after` is set (see
//! [`possum_analyzer::kernel::ValidationConfig::readonly_after`]). Work on other streams during
//! the launch can only add changes, which makes a kernel opaque wrongly but safely.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use possum_analyzer::kernel::{
    checksum, find_pointers, sample_windows, uniform_byte, KernelModel, Validation, Verdict, WHOLE,
};
use possum_cuda::{introspect, CudaDevice, CudaStream, PinnedBuf};
use possum_engine::device::{
    DevPtr, Device, DeviceError, DeviceResult, HostBuffer, StreamPriority,
};
use possum_engine::fingerprint::{self, Fingerprint};
use possum_engine::Residency;

use crate::memory::ranges::Resolved;
use crate::process::runtime::{DevEngine, Reentry, State, ValidationMemo};

/// Bytes scanned for device pointers behind each pointer parameter.
const TABLE_SCAN: u64 = 4096;

/// Why a side of a validation could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum ValidateError {
    /// The device could not be synchronised or read.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The exit side could not fingerprint a target the entry side fingerprinted on the device.
    #[error("device fingerprint: {0}")]
    Fingerprint(DeviceError),
    /// The exit side found the device's engine gone.
    #[error("device fingerprint: the device's engine is gone")]
    EngineGone,
}

/// Bytes of the pinned buffer a validation reads through.
const BOUNCE: usize = 8 << 20;

/// The chunk of a whole buffer's device fingerprints.
const FP_CHUNK: u64 = 8 << 20;

/// Whole buffers smaller than this are read to the host all the same: a fingerprint is a launch
/// and a wait of its own, where small reads share one wait in the bounce buffer.
const FP_MIN: u64 = 256 << 10;

/// Bytes read at the start of a buffer fingerprinted on the device, on the entry side: whether
/// they are one byte value, and which ([`sums_of`]).
const PROBE: u64 = 4096;

/// Reads device ranges for a validation. With the device's engine there, they are queued
/// together into a pinned buffer with one wait per buffer-full (a validation of a job with a
/// hundred buffers reads thousands of sampled windows, each a synchronous copy of ~10 us
/// otherwise); without it (or if the buffer cannot be made), one synchronous copy each.
struct Reader<'a> {
    io: Option<parking_lot::MutexGuard<'a, Option<(PinnedBuf, CudaStream)>>>,
    /// The device's engine, when `io` is there: fingerprints are taken on its stream.
    eng: Option<&'a DevEngine>,
    scratch: Vec<u8>,
}

impl<'a> Reader<'a> {
    fn new(eng: Option<&'a DevEngine>) -> Self {
        let io = eng.and_then(|e| {
            let mut g = e.validation_io.lock();
            if g.is_none() {
                let dev = e.engine.device();
                match (
                    dev.alloc_host(BOUNCE),
                    dev.create_stream(StreamPriority::Normal),
                ) {
                    (Ok(b), Ok(s)) => *g = Some((b, s)),
                    (b, s) => {
                        let err = b.err().or(s.err()).map(|e| e.to_string());
                        crate::base::log::log(&format!(
                            "validation reads one copy at a time: {}",
                            err.unwrap_or_default()
                        ));
                        return None;
                    }
                }
            }
            Some(g)
        });
        Reader {
            eng: eng.filter(|_| io.is_some()),
            io,
            scratch: Vec::new(),
        }
    }

    /// Whether `[start, start + len)` lies in one buffer of the engine's that is mapped: memory
    /// possum maps itself, which the device's fingerprint kernel may read.
    fn in_mapped_buffer(&self, start: u64, len: u64) -> bool {
        self.eng
            .and_then(|e| e.engine.lookup(DevPtr(start)))
            .is_some_and(|b| {
                b.residency() == Residency::Mapped && start + len <= b.va().0 + b.size()
            })
    }

    /// The device's fingerprints of `[start, start + len)` in [`FP_CHUNK`] chunks, taken on the
    /// reader's stream of possum's after the synchronisation the caller made; `None` without
    /// the device's engine.
    fn fingerprint(&self, start: u64, len: u64) -> Option<DeviceResult<Vec<Fingerprint>>> {
        let dev: &CudaDevice = self.eng?.engine.device();
        let (_, stream) = self.io.as_deref()?.as_ref()?;
        Some(dev.fingerprint(stream, DevPtr(start), len, FP_CHUNK))
    }

    /// Reads each `(address, len)` of `ranges`, calling `each(index, bytes)` in order.
    fn read(
        &mut self,
        ranges: &[(u64, usize)],
        mut each: impl FnMut(usize, &[u8]),
    ) -> Result<(), ValidateError> {
        let scratch = &mut self.scratch;
        let Some((buf, stream)) = self.io.as_deref_mut().and_then(Option::as_mut) else {
            for (i, &(src, len)) in ranges.iter().enumerate() {
                each(i, read_one(scratch, src, len)?);
            }
            return Ok(());
        };
        for run in runs(ranges, buf.len()) {
            if run.len() == 1 && ranges[run.start].1 > buf.len() {
                // Larger than the buffer: on its own.
                let (src, len) = ranges[run.start];
                each(run.start, read_one(scratch, src, len)?);
                continue;
            }
            stream.gather_d2h(&ranges[run.clone()], buf)?;
            let mut off = 0;
            for k in run {
                let len = ranges[k].1;
                each(k, &buf.as_slice()[off..off + len]);
                off += len;
            }
        }
        Ok(())
    }
}

/// `ranges` cut into consecutive runs, each as long as fits `cap` bytes (a range larger than
/// `cap` alone in its run).
fn runs(ranges: &[(u64, usize)], cap: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < ranges.len() {
        let (mut j, mut total) = (i, 0);
        while j < ranges.len() && total + ranges[j].1 <= cap {
            total += ranges[j].1;
            j += 1;
        }
        let end = j.max(i + 1);
        out.push(i..end);
        i = end;
    }
    out
}

/// `[off, off + len)` cut into consecutive pieces of at most `max` bytes (`max` > 0).
fn pieces(off: u64, len: u64, max: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..len.div_ceil(max)).map(move |k| (off + k * max, max.min(len - k * max)))
}

/// `len` bytes at device address `src`, read synchronously into `scratch`.
fn read_one(scratch: &mut Vec<u8>, src: u64, len: usize) -> Result<&[u8], ValidateError> {
    scratch.resize(len, 0);
    introspect::read_device(src, scratch)?;
    Ok(scratch)
}

/// A target's checksum, taken the same way on both sides of a launch.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Sum {
    /// Of its sampled windows (all of it with `sample=all`), read to the host.
    Host(u64),
    /// Its fingerprints in [`FP_CHUNK`] chunks, taken on the device: all of it.
    Device(Vec<Fingerprint>),
    /// None: device memory of possum's own work ([`CudaDevice::is_own_memory`]), not read.
    Own,
}

/// How a target is summed ([`Sum`]'s kind), chosen on the entry side and kept on the exit side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    Host,
    Device,
    Own,
}

impl Sum {
    fn way(&self) -> Way {
        match self {
            Sum::Host(_) => Way::Host,
            Sum::Device(_) => Way::Device,
            Sum::Own => Way::Own,
        }
    }
}

/// What the entry side saw.
#[derive(Debug)]
pub struct Before {
    model: Arc<KernelModel>,
    /// (key, start, len, checksum, constant) of every target; constant: every sampled byte
    /// equalled the first ([`sums_of`]).
    sums: Vec<(u64, u64, u64, Sum, bool)>,
    /// The key each slot resolved to (`None`: nothing).
    slot_keys: Vec<Option<u64>>,
    /// For slots whose buffer another slot of the launch also points into: (slot, start, len,
    /// checksum, constant) of a window at the slot's own address. A change of the shared buffer
    /// cannot say which slot wrote; the slot's own window can (see [`own_window`]).
    slot_windows: Vec<(usize, u64, u64, Sum, bool)>,
    pointer_table: Option<(usize, u64)>,
    /// The ordinal of the device engine the entry side read through (the exit side reads the
    /// same way).
    device: Option<usize>,
    started: Instant,
}

/// The window checksummed at a slot's own address `w` inside `[start, start + len)` (the buffer, or
/// its part below the next slot's address): from the address to that end, at most `sample` bytes
/// (at least one 8-byte word, never past the end).
fn own_window(start: u64, len: u64, w: u64, sample: u64) -> u64 {
    (start + len).saturating_sub(w).min(sample.max(8))
}

/// For each `(start, len)` of `targets`: its checksum, and whether every sampled byte equals its
/// first sampled byte (vacuously true when nothing is sampled).
///
/// `ways`: on the exit side, how each target was summed on the entry side ([`Sum::way`]): the
/// same way again, or the side fails (the two sums could not be compared); the constant flag is
/// not computed then (only the entry side's counts). On the entry side (`None`) a target is
/// possum's own memory, not read (constant: it counts neither way); or fingerprinted on the
/// device where [`by_device`] says so and the device can; else read to the host. A
/// device-fingerprinted target is constant when its first [`PROBE`] bytes are one value and its
/// fingerprints are those of a buffer of that value ([`all_of_byte`]): every byte of it then is,
/// as every byte read whole was before.
fn sums_of(
    st: &State,
    reader: &mut Reader<'_>,
    targets: impl Iterator<Item = (u64, u64)>,
    ways: Option<&[Way]>,
) -> Result<Vec<(Sum, bool)>, ValidateError> {
    let cfg = st.validation();
    let targets: Vec<(u64, u64)> = targets.collect();
    // The device's fingerprints first: each call waits for its own.
    let mut chosen: Vec<Way> = Vec::with_capacity(targets.len());
    let mut fps: Vec<Option<Vec<Fingerprint>>> = Vec::with_capacity(targets.len());
    for (t, &(start, len)) in targets.iter().enumerate() {
        let (dstart, dlen) = device_range(start, len);
        let way = match ways {
            Some(w) => w.get(t).copied().unwrap_or(Way::Host),
            None if is_own_memory(st, start, len) => Way::Own,
            None if by_device(&st.validation_memo, cfg.sample_bytes, len)
                && reader.in_mapped_buffer(dstart, dlen) =>
            {
                Way::Device
            }
            None => {
                if len >= LARGE_HOST_READ {
                    said_large_host_read(st, reader, start, len);
                }
                Way::Host
            }
        };
        let fp = match (way, ways) {
            (Way::Device, _) => match (timed_fingerprint(st, reader, dstart, dlen), ways) {
                (Some(Ok(f)), _) => Some(f),
                // The exit side must take it the entry side's way.
                (Some(Err(e)), Some(_)) => return Err(ValidateError::Fingerprint(e)),
                (None, Some(_)) => return Err(ValidateError::EngineGone),
                (Some(Err(e)), None) => {
                    let dev = reader.eng.map(|e| &**e.engine.device());
                    host_instead(&st.validation_memo, &e, dev);
                    None
                }
                (None, None) => None,
            },
            _ => None,
        };
        chosen.push(match (way, &fp) {
            (Way::Device, None) => Way::Host,
            (w, _) => w,
        });
        fps.push(fp);
    }
    let probe = ways.is_none();
    let mut ranges = Vec::new();
    let mut owner = Vec::new();
    for (t, &(start, len)) in targets.iter().enumerate() {
        match chosen[t] {
            Way::Own => {}
            Way::Device => {
                if probe {
                    ranges.push((start, PROBE.min(len) as usize));
                    owner.push(t);
                }
            }
            Way::Host => {
                for (off, l) in sample_windows(len, cfg.sample_bytes, cfg.windows) {
                    // A whole buffer is read a bounce buffer at a time.
                    for (p, pl) in pieces(off, l, BOUNCE as u64) {
                        ranges.push((start + p, pl as usize));
                        owner.push(t);
                    }
                }
            }
        }
    }
    let mut sums = vec![(0xcbf2_9ce4_8422_2325u64, None::<u8>, true); targets.len()];
    let t = Instant::now();
    st.counters
        .validation_host_bytes
        .fetch_add(ranges.iter().map(|r| r.1 as u64).sum(), Ordering::Relaxed);
    let _timed = Timed(&st.counters.validation_host_ns, t);
    reader.read(&ranges, |i, bytes| {
        let (acc, first, constant) = &mut sums[owner[i]];
        *acc = (*acc ^ checksum(bytes)).wrapping_mul(0x100_0000_01b3);
        if *constant {
            *constant = uniform_byte(bytes).is_some_and(|b| *first.get_or_insert(b) == b);
        }
    })?;
    Ok(sums
        .into_iter()
        .zip(fps)
        .zip(chosen)
        .zip(&targets)
        .map(
            |((((acc, first, constant), fp), way), &(start, len))| match (way, fp) {
                (Way::Own, _) => (Sum::Own, true),
                (_, Some(f)) => {
                    // Widened to 16 bytes ([`device_range`]), the fingerprints take in bytes
                    // either side: a first PROBE of one value counts as constant then (neither
                    // way), the safe side of the rule.
                    let widened = (start | len) % 16 != 0;
                    let uniform = probe
                        && constant
                        && first.is_some_and(|b| {
                            widened || all_of_byte(&st.validation_memo, b, &f, len)
                        });
                    (Sum::Device(f), uniform)
                }
                (_, None) => (Sum::Host(acc), constant),
            },
        )
        .collect())
}

/// Adds the time since it was made to a counter when dropped.
struct Timed<'a>(&'a std::sync::atomic::AtomicU64, Instant);

impl Drop for Timed<'_> {
    fn drop(&mut self) {
        crate::base::add_elapsed_ns(self.0, self.1);
    }
}

/// [`Reader::fingerprint`], timed and counted.
fn timed_fingerprint(
    st: &State,
    reader: &Reader<'_>,
    start: u64,
    len: u64,
) -> Option<DeviceResult<Vec<Fingerprint>>> {
    let _timed = Timed(&st.counters.validation_fingerprint_ns, Instant::now());
    let r = reader.fingerprint(start, len);
    if matches!(r, Some(Ok(_))) {
        st.counters
            .validation_fingerprint_bytes
            .fetch_add(len, Ordering::Relaxed);
    }
    r
}

/// Whether `[start, start + len)` overlaps device memory possum made for its own work, on any
/// device ([`CudaDevice::is_own_memory`]).
fn is_own_memory(st: &State, start: u64, len: u64) -> bool {
    st.engine_refs()
        .any(|e| e.engine.device().is_own_memory(DevPtr(start), len))
}

/// Whether a target of `len` bytes is fingerprinted on the device rather than read to the host,
/// if its [`device_range`] lies in a mapped buffer of the engine's
/// ([`Reader::in_mapped_buffer`]): whole buffers are checksummed, and it is large enough to gain
/// ([`FP_MIN`]).
fn by_device(memo: &ValidationMemo, sample_bytes: u64, len: u64) -> bool {
    sample_bytes == WHOLE && len >= FP_MIN && !memo.no_device_fingerprints.load(Ordering::Relaxed)
}

/// The range the device fingerprints for a target of `len` bytes at `start`: widened to 16
/// bytes each way (the kernel reads 16 bytes at a time). A target at an address a kernel was
/// passed (a slot's window, [`own_window`]) need not be aligned, and reading a window of
/// gigabytes to the host costs seconds on every validated launch; the widened range stays
/// inside the buffer (buffers are aligned far more coarsely) and is taken the same way on both
/// sides, so a change in it is still a change. Bytes of a neighbour in it can only make a slot
/// look written, never read-only.
fn device_range(start: u64, len: u64) -> (u64, u64) {
    let lo = start & !15;
    let hi = start.saturating_add(len).saturating_add(15) & !15;
    (lo, hi - lo)
}

/// A target this large read to the host is said in the log (once): it costs about 0.2 s a GiB on
/// both sides of every validated launch.
const LARGE_HOST_READ: u64 = 64 << 20;

/// Says in the log, once, that a validation reads `len` bytes at `start` to the host, and why.
fn said_large_host_read(st: &State, reader: &Reader<'_>, start: u64, len: u64) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if SAID.swap(true, Ordering::Relaxed) {
        return;
    }
    let why = if st.validation().sample_bytes != WHOLE {
        "sampled validation reads windows"
    } else if reader.eng.is_none() {
        "the device's engine is not there"
    } else if !reader.in_mapped_buffer(start, len) {
        "not in a buffer possum maps"
    } else {
        "the device cannot fingerprint"
    };
    crate::base::log::log(&format!(
        "validation reads {} MiB at {start:#x} to the host on each side of a validated launch \
         ({why}); more such reads are not said",
        len >> 20
    ));
}

/// The device could not fingerprint a target (`e`), which is read to the host instead. Said once
/// in the log; an `Unsupported` device is not asked again.
fn host_instead(memo: &ValidationMemo, e: &DeviceError, dev: Option<&CudaDevice>) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if matches!(e, DeviceError::Unsupported(_)) {
        memo.no_device_fingerprints.store(true, Ordering::Relaxed);
    }
    if !SAID.swap(true, Ordering::Relaxed) {
        let why = dev
            .and_then(CudaDevice::fingerprint_unavailable)
            .map(|w| format!(" ({w})"))
            .unwrap_or_default();
        crate::base::log::log(&format!(
            "validation reads whole buffers to the host where the device cannot fingerprint \
             them: {e}{why}"
        ));
    }
}

/// Whether `fps`, the fingerprints of `len` bytes in [`FP_CHUNK`] chunks, are those of `len`
/// bytes of value `b`.
fn all_of_byte(memo: &ValidationMemo, b: u8, fps: &[Fingerprint], len: u64) -> bool {
    fps.len() as u64 == len.div_ceil(FP_CHUNK)
        && fps.iter().enumerate().all(|(i, f)| {
            *f == uniform_fingerprint(memo, b, FP_CHUNK.min(len - i as u64 * FP_CHUNK))
        })
}

/// The fingerprint of `len` bytes of value `b`, computed on the host once per `(b, len)` (8 MiB
/// takes a few milliseconds) and kept: a job's buffers come in a few sizes, and both sides of a
/// launch ask for the same ones.
fn uniform_fingerprint(memo: &ValidationMemo, b: u8, len: u64) -> Fingerprint {
    const KEPT: usize = 64;
    const PIECE: usize = 64 << 10;
    let mut memo = memo.uniform.lock();
    if let Some(&(_, f)) = memo.iter().find(|(k, _)| *k == (b, len)) {
        return f;
    }
    // The sums of pieces add up (each piece's pairs numbered from where it starts).
    let piece = vec![b; PIECE];
    let (mut lo, mut hi) = (0u64, 0u64);
    let mut off = 0u64;
    while off < len {
        let n = (PIECE as u64).min(len - off);
        let (l, h) = fingerprint::sums(&piece[..n as usize], off / 8);
        lo = lo.wrapping_add(l);
        hi = hi.wrapping_add(h);
        off += n;
    }
    let f = Fingerprint::from_sums(lo, hi, len);
    if memo.len() == KEPT {
        memo.remove(0);
    }
    memo.push(((b, len), f));
    f
}

/// The entry side, for a launch of `model` whose slots hold `words`. `None` (and the validation
/// skipped, counted) if the device cannot be read. Boxed: it waits for the exit callback in the
/// thread's pending state, which every launch moves (a validated launch is rare).
pub fn begin(
    st: &State,
    eng: Option<&DevEngine>,
    model: &Arc<KernelModel>,
    words: &[u64],
) -> Option<Box<Before>> {
    let started = Instant::now();
    let _r = Reentry::enter();
    let r = (|| -> Result<Before, ValidateError> {
        synchronize(st)?;
        let mut reader = Reader::new(eng);
        let targets = st.validation_targets(eng);
        let sums = sums_of(st, &mut reader, targets.iter().map(|t| (t.1, t.2)), None)?
            .into_iter()
            .zip(&targets)
            .map(|((sum, constant), &(key, start, len))| (key, start, len, sum, constant))
            .collect();
        // The first bytes behind each pointer word, read together, scanned in slot order.
        let ranges = st.ranges();
        let mut slot_keys = Vec::with_capacity(words.len());
        let mut scans = Vec::new();
        for (i, &w) in words.iter().enumerate() {
            let r = ranges.lookup(w);
            slot_keys.push(r.key());
            if let Some((s, l)) = r.range() {
                let n = TABLE_SCAN.min(s + l - w) & !7;
                scans.push((i, (w, n as usize)));
            }
        }
        // Slots sharing a buffer: a window at each one's own address.
        let windows: Vec<(usize, u64, u64)> = words
            .iter()
            .enumerate()
            .filter_map(|(i, &w)| {
                let k = slot_keys[i]?;
                let shared = slot_keys
                    .iter()
                    .enumerate()
                    .any(|(j, kj)| j != i && *kj == Some(k) && words[j] != w);
                let (s, l) = ranges.lookup(w).range()?;
                // Up to the next address another slot names in the same allocation: small tensors
                // sit next to each other in a segment, and an output right after an input must
                // not fall in the input's window.
                let next = slot_keys
                    .iter()
                    .zip(words)
                    .filter(|&(kj, &wj)| *kj == Some(k) && wj > w)
                    .map(|(_, &wj)| wj)
                    .min()
                    .unwrap_or(s + l);
                let n = own_window(s, next - s, w, st.validation().sample_bytes);
                (shared && n > 0).then_some((i, w, n))
            })
            .collect();
        let slot_windows = sums_of(
            st,
            &mut reader,
            windows.iter().map(|&(_, a, l)| (a, l)),
            None,
        )?
        .into_iter()
        .zip(&windows)
        .map(|((sum, constant), &(i, a, l))| (i, a, l, sum, constant))
        .collect();
        let mut pointer_table = None;
        let reads: Vec<(u64, usize)> = scans.iter().map(|s| s.1).collect();
        reader.read(&reads, |k, bytes| {
            if pointer_table.is_none() {
                if let Some((_, p)) =
                    find_pointers(bytes, |v| !matches!(ranges.lookup(v), Resolved::None))
                {
                    pointer_table = Some((scans[k].0, p));
                }
            }
        })?;
        Ok(Before {
            model: model.clone(),
            sums,
            slot_keys,
            slot_windows,
            pointer_table,
            device: eng.map(|e| e.ordinal),
            started,
        })
    })();
    match r {
        Ok(b) => Some(Box::new(b)),
        Err(e) => {
            st.counters
                .validation_errors
                .fetch_add(1, Ordering::Relaxed);
            crate::base::log::log(&format!("validation skipped: {e}"));
            None
        }
    }
}

/// Waits for the device before a side is read, timed (the `validation_sync_ns` counter).
fn synchronize(st: &State) -> Result<(), ValidateError> {
    let _timed = Timed(&st.counters.validation_sync_ns, Instant::now());
    Ok(introspect::ctx_synchronize()?)
}

/// The exit side: compares and records the verdict.
pub fn finish(st: &State, b: Before) {
    let eng = b.device.and_then(|d| st.engine_ref(d)).map(|e| &**e);
    let _r = Reentry::enter();
    let r = (|| -> Result<Validation, ValidateError> {
        synchronize(st)?;
        let mut v = Validation {
            pointer_table: b.pointer_table,
            ..Validation::default()
        };
        let mut changed_keys = Vec::new();
        // Unchanged, but constant before: no evidence that the launch did not write them.
        let mut constant_keys = Vec::new();
        let mut reader = Reader::new(eng);
        let ways: Vec<Way> = b.sums.iter().map(|t| t.3.way()).collect();
        let after = sums_of(
            st,
            &mut reader,
            b.sums.iter().map(|t| (t.1, t.2)),
            Some(&ways),
        )?;
        for ((key, _, _, before, constant), (now, _)) in b.sums.iter().zip(after) {
            let (key, constant) = (*key, *constant);
            if now != *before {
                changed_keys.push(key);
            } else if constant {
                constant_keys.push(key);
            }
        }
        for (i, k) in b.slot_keys.iter().enumerate() {
            if let Some(k) = k {
                v.slot_named.insert(i);
                if changed_keys.contains(k) {
                    v.slot_changed.insert(i);
                } else if !constant_keys.contains(k) {
                    v.slot_unchanged.insert(i);
                }
            }
        }
        // A shared buffer that changed: each sharing slot is judged by its own window instead
        // (a reduction whose input and output sit in one segment of the caching allocator must
        // not make its input slot read-write for good).
        let ways: Vec<Way> = b.slot_windows.iter().map(|w| w.3.way()).collect();
        let own = sums_of(
            st,
            &mut reader,
            b.slot_windows.iter().map(|w| (w.1, w.2)),
            Some(&ways),
        )?;
        for ((i, _, _, before, constant), (now, _)) in b.slot_windows.iter().zip(own) {
            let (i, constant) = (*i, *constant);
            if !v.slot_changed.contains(i) {
                continue;
            }
            if now == *before {
                v.slot_changed.remove(i);
                if !constant {
                    v.slot_unchanged.insert(i);
                }
            }
        }
        if crate::base::config::get().diag.debug_dirty {
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "possum: validation detail: changed keys {changed_keys:?} constant keys \
                 {constant_keys:?}; shared windows {:?}",
                b.slot_windows
                    .iter()
                    .map(|w| (w.0, w.1, w.2))
                    .collect::<Vec<_>>()
            );
        }
        v.changed_untouched = changed_keys
            .into_iter()
            .filter(|k| !b.slot_keys.contains(&Some(*k)))
            .collect();
        Ok(v)
    })();
    let c = &st.counters;
    match r {
        Ok(v) => {
            c.validations.fetch_add(1, Ordering::Relaxed);
            if crate::base::config::get().diag.debug_dirty {
                use std::io::Write as _;
                let keyed: Vec<String> = b
                    .slot_keys
                    .iter()
                    .enumerate()
                    .filter_map(|(i, k)| k.map(|k| format!("{i}->{k}")))
                    .collect();
                let _ = writeln!(
                    std::io::stderr(),
                    "possum: validation: kernel {}: changed {:?} unchanged {:?} slots {}",
                    b.model.name().unwrap_or("?"),
                    v.slot_changed.iter().collect::<Vec<_>>(),
                    v.slot_unchanged.iter().collect::<Vec<_>>(),
                    keyed.join(" ")
                );
            }
            if let Verdict::Opaque(why) = b.model.record_validation(&v, st.validation()) {
                c.kernels_made_opaque.fetch_add(1, Ordering::Relaxed);
                crate::base::log::log(&format!(
                    "kernel {} is opaque from now on: {why}",
                    b.model.name().unwrap_or("?")
                ));
                st.to_dag(crate::process::dag::DagMsg::Opaque(b.model.handle()));
            }
        }
        Err(e) => {
            c.validation_errors.fetch_add(1, Ordering::Relaxed);
            crate::base::log::log(&format!("validation abandoned: {e}"));
        }
    }
    crate::base::add_elapsed_ns(&c.validation_ns, b.started);
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn own_windows_stay_inside_the_buffer() {
        use super::own_window;
        assert_eq!(own_window(0x1000, 0x1000, 0x1000, 256), 256);
        assert_eq!(own_window(0x1000, 0x1000, 0x1f80, 256), 0x80);
        assert_eq!(own_window(0x1000, 0x1000, 0x2000, 256), 0);
        assert_eq!(own_window(0x1000, 0x1000, 0x1000, 0), 8);
        assert_eq!(own_window(0x1000, 0x100, 0x10fc, 256), 4);
    }

    #[test]
    fn whole_buffers_are_read_in_pieces() {
        use super::pieces;
        let p: Vec<_> = pieces(16, 20, 8).collect();
        assert_eq!(p, [(16, 8), (24, 8), (32, 4)]);
        assert_eq!(pieces(0, 8, 8).collect::<Vec<_>>(), [(0, 8)]);
        assert_eq!(pieces(0, 0, 8).count(), 0);
        // Every byte of a 64 MiB buffer, in 8 MiB reads.
        let p: Vec<_> = pieces(0, 64 << 20, super::BOUNCE as u64).collect();
        assert_eq!(p.len(), 8);
        assert_eq!(p.iter().map(|x| x.1).sum::<u64>(), 64 << 20);
    }

    #[test]
    fn uniform_fingerprints_are_the_definitions() {
        use super::{all_of_byte, by_device, uniform_fingerprint, FP_CHUNK, FP_MIN};
        use possum_engine::fingerprint;
        let memo = &crate::process::runtime::ValidationMemo::default();
        for (b, len) in [
            (0u8, 16u64),
            (0, 100_003),
            (0xff, 65_536 * 3 + 8),
            (7, 8 << 20),
        ] {
            let bytes = vec![b; len as usize];
            assert_eq!(
                uniform_fingerprint(memo, b, len),
                fingerprint::of(&bytes),
                "{b} x {len}"
            );
            // Kept: the same answer again.
            assert_eq!(uniform_fingerprint(memo, b, len), fingerprint::of(&bytes));
        }
        // A buffer of two chunks and a bit: uniform only if every chunk is.
        let len = 2 * FP_CHUNK + 4096;
        let mut bytes = vec![0u8; len as usize];
        let fps = fingerprint::of_chunks(&bytes, FP_CHUNK as usize);
        assert!(all_of_byte(memo, 0, &fps, len));
        assert!(!all_of_byte(memo, 1, &fps, len));
        assert!(
            !all_of_byte(memo, 0, &fps[..2], len),
            "a fingerprint missing"
        );
        bytes[len as usize - 1] = 1;
        let fps = fingerprint::of_chunks(&bytes, FP_CHUNK as usize);
        assert!(
            !all_of_byte(memo, 0, &fps, len),
            "one byte of the last chunk differs"
        );
        // Only whole buffers, large enough, aligned.
        let whole = possum_analyzer::kernel::WHOLE;
        assert!(by_device(memo, whole, FP_MIN));
        assert!(!by_device(memo, whole, FP_MIN - 1));
        assert!(!by_device(memo, 256 << 10, 64 << 20));
    }

    #[test]
    fn unaligned_targets_are_fingerprinted_widened_to_16_bytes() {
        use super::device_range;
        assert_eq!(device_range(0x1000, 0x100), (0x1000, 0x100));
        // A window at an odd address to a buffer's end: from the 16 bytes it starts in.
        assert_eq!(device_range(0x1008, 0x1000 - 8), (0x1000, 0x1000));
        assert_eq!(device_range(0x1001, 3), (0x1000, 16));
        // Both ends widened, never narrowed.
        for (s, l) in [(0x1003u64, 0x2005u64), (0x10, 1), (0x1f, 0x11)] {
            let (ds, dl) = device_range(s, l);
            assert!(ds <= s && ds + dl >= s + l && ds % 16 == 0 && dl % 16 == 0);
            assert!(s - ds < 16 && ds + dl - (s + l) < 16);
        }
    }

    #[test]
    fn reads_are_cut_into_runs_that_fit() {
        let r = |lens: &[usize]| lens.iter().map(|&l| (0u64, l)).collect::<Vec<_>>();
        assert_eq!(runs(&r(&[4, 4, 4]), 8), vec![0..2, 2..3]);
        assert_eq!(runs(&r(&[4, 20, 4, 4]), 8), vec![0..1, 1..2, 2..4]);
        assert_eq!(runs(&r(&[8, 8]), 8), vec![0..1, 1..2]);
        assert_eq!(runs(&r(&[0, 3, 5, 0]), 8), vec![0..4]);
        assert!(runs(&[], 8).is_empty());
    }
}
