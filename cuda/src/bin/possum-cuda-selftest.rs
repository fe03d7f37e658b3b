//! possum-cuda-selftest: checks possum's CUDA backend on a real GPU and measures pinned copies.
//!
//! Steps: (1) reserve + map 64 MiB, 1 GiB and 4 GiB, fill them through host-to-device copies, read
//! them back and check; (2) copy the first buffer out, unmap and release it, map new memory at the
//! same address, copy back in and check; (3) order a normal and a high-priority stream with events;
//! (4) fingerprints taken on the device (`Device::fingerprint`, the kernel of
//! `cuda/kernels/fingerprint.ptx`) equal the definition's (`possum_engine::fingerprint`) of the
//! same bytes, for several chunk sizes and lengths, and the time to fingerprint as many GiB as fit
//! (up to 32), printed as one line of JSON; (5) device-to-host and host-to-device throughput for
//! 2/8/32/64 MiB chunks on 1/2/4 streams over the 4 GiB buffer, printed as a table and one JSON
//! line.
//!
//! Exit status: 0 when all steps pass, or when there is no CUDA device ("SKIPPED: ...") unless
//! `POSSUM_REQUIRE_GPU=1`; 1 on any failure (the failed step is printed); 2 on bad arguments.
//! Options: `--device N` (ordinal, default 0), `--no-bench` (skip step 5).
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::process::ExitCode;
use std::time::Instant;

use possum_control::EnvConfig;
use possum_cuda::{probe, CudaDevice, CudaPending, CudaStream, PinnedBuf};
use possum_engine::device::{DevPtr, Device, DeviceError, HostBuffer, StreamPriority, Transfer};
use possum_engine::fingerprint;
use serde_json::{json, Value};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Staging buffer size, and the largest benchmark chunk.
const STAGE: u64 = 64 * MIB;
/// Staging buffers (1 GiB of pinned memory in all).
const POOL: usize = 16;

type Res<T> = Result<T, String>;

/// Adds what was being done to a device error.
trait Context<T> {
    fn ctx(self, what: &str) -> Res<T>;
}

impl<T> Context<T> for Result<T, DeviceError> {
    fn ctx(self, what: &str) -> Res<T> {
        self.map_err(|e| format!("{what}: {e}"))
    }
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(format!($($fmt)*));
        }
    };
}

// ---- the data pattern: a word depends on the buffer's seed and the word's offset in the buffer ----

fn pattern_word(seed: u64, word: u64) -> u64 {
    let x = (word ^ seed.rotate_left(40))
        .wrapping_add(seed)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// Bytes per thread, a multiple of 8.
fn part_len(len: usize) -> usize {
    (len.div_ceil(threads()).max(8) + 7) & !7
}

/// Fills `buf` (which sits at byte `off` of its device buffer) with the pattern.
fn fill(buf: &mut [u8], seed: u64, off: u64) {
    let part = part_len(buf.len());
    std::thread::scope(|s| {
        for (i, chunk) in buf.chunks_mut(part).enumerate() {
            let first = (off + (i * part) as u64) / 8;
            s.spawn(move || {
                for (j, w) in chunk.chunks_exact_mut(8).enumerate() {
                    w.copy_from_slice(&pattern_word(seed, first + j as u64).to_le_bytes());
                }
            });
        }
    });
}

/// The offset (in the device buffer) of the first byte of `buf` that breaks the pattern.
fn first_mismatch(buf: &[u8], seed: u64, off: u64) -> Option<u64> {
    let part = part_len(buf.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = buf
            .chunks(part)
            .enumerate()
            .map(|(i, chunk)| {
                let start = off + (i * part) as u64;
                s.spawn(move || {
                    chunk.chunks_exact(8).enumerate().find_map(|(j, w)| {
                        let want = pattern_word(seed, start / 8 + j as u64).to_le_bytes();
                        (w != want).then_some(start + 8 * j as u64)
                    })
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().unwrap()).min()
    })
}

// ---- staged fills and checks of device buffers ----

fn take_buf(pool: &mut Vec<PinnedBuf>, inflight: &mut VecDeque<CudaPending>) -> Res<PinnedBuf> {
    match pool.pop() {
        Some(b) => Ok(b),
        None => inflight
            .pop_front()
            .expect("buffers are either free or in flight")
            .wait()
            .ctx("waiting for a copy"),
    }
}

/// Device memory written and read through the pinned buffers of `pool`, on stream `s`.
struct Staging<'a> {
    dev: &'a CudaDevice,
    s: &'a CudaStream,
    pool: &'a mut Vec<PinnedBuf>,
}

impl Staging<'_> {
    /// Writes the pattern `seed` over `[va, va + size)` through host-to-device copies.
    fn write_pattern(&mut self, va: DevPtr, size: u64, seed: u64) -> Res<()> {
        let (dev, s, pool) = (self.dev, self.s, &mut *self.pool);
        let mut inflight = VecDeque::new();
        let mut off = 0;
        while off < size {
            let n = STAGE.min(size - off);
            let mut buf = take_buf(pool, &mut inflight)?;
            fill(&mut buf.as_mut_slice()[..n as usize], seed, off);
            inflight.push_back(dev.copy_h2d(s, buf, va.add(off), n).ctx("copy_h2d")?);
            off += n;
        }
        for p in inflight {
            pool.push(p.wait().ctx("waiting for copy_h2d")?);
        }
        Ok(())
    }

    /// Reads `[va, va + size)` back through device-to-host copies and checks the pattern `seed`.
    fn check_pattern(&mut self, va: DevPtr, size: u64, seed: u64) -> Res<()> {
        let (dev, s, pool) = (self.dev, self.s, &mut *self.pool);
        let mut inflight: VecDeque<(u64, u64, CudaPending)> = VecDeque::new();
        let mut off = 0;
        loop {
            while off < size && !pool.is_empty() {
                let n = STAGE.min(size - off);
                let buf = pool.pop().expect("not empty");
                inflight.push_back((
                    off,
                    n,
                    dev.copy_d2h(s, va.add(off), buf, n).ctx("copy_d2h")?,
                ));
                off += n;
            }
            let Some((o, n, p)) = inflight.pop_front() else {
                return Ok(());
            };
            let buf = p.wait().ctx("waiting for copy_d2h")?;
            let bad = first_mismatch(&buf.as_slice()[..n as usize], seed, o);
            pool.push(buf);
            if let Some(at) = bad {
                return Err(format!(
                    "buffer at {va} (seed {seed}): wrong data at byte {at:#x}"
                ));
            }
        }
    }
}

/// Copies `len` bytes from `va` into `buf` and waits.
fn read_back(
    dev: &CudaDevice,
    s: &CudaStream,
    va: DevPtr,
    buf: PinnedBuf,
    len: u64,
) -> Res<PinnedBuf> {
    dev.copy_d2h(s, va, buf, len)
        .ctx("copy_d2h")?
        .wait()
        .ctx("waiting for copy_d2h")
}

fn round_up(n: u64, g: u64) -> u64 {
    n.div_ceil(g) * g
}

// ---- the steps ----

struct Buffers {
    /// (address, size, seed)
    bufs: Vec<(DevPtr, u64, u64)>,
}

fn step_map_fill_check(
    dev: &CudaDevice,
    pool: &mut Vec<PinnedBuf>,
    report: &mut Value,
) -> Res<Buffers> {
    let g = dev.granularity();
    let s = dev
        .create_stream(StreamPriority::Normal)
        .ctx("create_stream")?;
    let (free0, total) = dev.memory_info().ctx("memory_info")?;
    let mut bufs = Vec::new();
    for (i, want) in [64 * MIB, GIB, 4 * GIB].into_iter().enumerate() {
        let size = round_up(want, g);
        let va = dev.reserve(size).ctx("reserve")?;
        ensure!(va.0 % g == 0, "reservation {va} is not aligned to {g}");
        dev.map(va, size).ctx("map")?;
        bufs.push((va, size, i as u64 + 1));
    }
    let (free1, _) = dev.memory_info().ctx("memory_info")?;
    let mapped: u64 = bufs.iter().map(|b| b.1).sum();
    println!(
        "  mapped {} MiB at {}; free {} -> {} MiB of {} MiB",
        mapped / MIB,
        bufs.iter()
            .map(|b| b.0.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        free0 / MIB,
        free1 / MIB,
        total / MIB
    );
    ensure!(
        free0.saturating_sub(free1) >= mapped,
        "free memory fell by {} MiB, less than the {} MiB mapped",
        free0.saturating_sub(free1) / MIB,
        mapped / MIB
    );
    let mut staging = Staging { dev, s: &s, pool };
    for &(va, size, seed) in &bufs {
        staging.write_pattern(va, size, seed)?;
    }
    for &(va, size, seed) in &bufs {
        staging.check_pattern(va, size, seed)?;
    }
    report["mapped_bytes"] = json!(mapped);
    Ok(Buffers { bufs })
}

fn step_release_remap(dev: &CudaDevice, b: &Buffers) -> Res<()> {
    let (va, size, seed) = b.bufs[0];
    let (other, _, _) = b.bufs[1];
    let s = dev
        .create_stream(StreamPriority::Normal)
        .ctx("create_stream")?;
    let len = usize::try_from(size).map_err(|e| e.to_string())?;
    let saved = dev.alloc_host(len).ctx("alloc_host")?;
    let readback = dev.alloc_host(len).ctx("alloc_host")?;

    let saved = read_back(dev, &s, va, saved, size)?;
    ensure!(
        first_mismatch(saved.as_slice(), seed, 0).is_none(),
        "buffer A's contents were wrong before the release"
    );
    let (free0, _) = dev.memory_info().ctx("memory_info")?;
    dev.unmap(va, size).ctx("unmap A")?;
    let (free1, _) = dev.memory_info().ctx("memory_info")?;
    println!(
        "  unmapped A ({} MiB at {va}): free {} -> {} MiB",
        size / MIB,
        free0 / MIB,
        free1 / MIB
    );
    ensure!(
        free1.saturating_sub(free0) >= size,
        "unmapping A freed only {} MiB",
        free1.saturating_sub(free0) / MIB
    );
    // possum's tables must refuse copies into the now unmapped range.
    let refused = dev.copy_d2d(&s, other, va, MIB);
    ensure!(
        matches!(refused, Err(DeviceError::InvalidAddress { .. })),
        "a copy into unmapped A was not refused: {refused:?}"
    );

    dev.map(va, size).ctx("map A again")?;
    let (base, range) = dev.address_range(va).ctx("address_range")?;
    ensure!(
        base == va,
        "the driver puts the new mapping at {base}, not at A's address {va}"
    );
    println!(
        "  remapped A at {va} (driver's range: {base}+{} MiB)",
        range / MIB
    );
    // Poison the new memory, so that only the copy back in can make it right.
    dev.memset_d8(&s, va, 0xA5, size).ctx("memset_d8")?;
    let saved = dev
        .copy_h2d(&s, saved, va, size)
        .ctx("copy_h2d")?
        .wait()
        .ctx("waiting for copy_h2d")?;
    let readback = read_back(dev, &s, va, readback, size)?;
    ensure!(
        readback.as_slice() == saved.as_slice(),
        "A's contents differ after release and remap"
    );
    ensure!(
        first_mismatch(readback.as_slice(), seed, 0).is_none(),
        "A's pattern is wrong after release and remap"
    );

    // The tables refuse what the driver would refuse, or worse, accept.
    let twice = dev.map(va, size);
    ensure!(
        matches!(twice, Err(DeviceError::InvalidAddress { .. })),
        "mapping A twice was not refused: {twice:?}"
    );
    let half = dev.unmap(va, size / 2);
    ensure!(
        matches!(half, Err(DeviceError::InvalidAddress { .. })),
        "unmapping half of A's mapping was not refused: {half:?}"
    );
    let busy = dev.unreserve(va, size);
    ensure!(
        matches!(busy, Err(DeviceError::InvalidAddress { .. })),
        "unreserving mapped A was not refused: {busy:?}"
    );
    Ok(())
}

fn step_events(
    dev: &CudaDevice,
    pool: &mut Vec<PinnedBuf>,
    b: &Buffers,
    report: &mut Value,
) -> Res<()> {
    let (a, _, seed_a) = b.bufs[0];
    let (bb, size_b, _) = b.bufs[1];
    let (c, size_c, seed_c) = b.bufs[2];
    let normal = dev
        .create_stream(StreamPriority::Normal)
        .ctx("create_stream")?;
    let high = dev
        .create_stream(StreamPriority::High)
        .ctx("create_stream")?;
    let (least, greatest) = dev.stream_priority_range();
    let (pn, ph) = (
        normal.priority().ctx("priority")?,
        high.priority().ctx("priority")?,
    );
    println!("  priority range {least}..{greatest}; normal stream {pn}, high stream {ph}");
    ensure!(
        pn == least && ph == greatest,
        "stream priorities {pn}/{ph} are not the range's ends {least}/{greatest}"
    );
    report["priority_range"] = json!([least, greatest]);

    // normal: overwrite B with each GiB of C in turn, so B ends up holding C's last GiB.
    let gib_count = size_c / size_b;
    for k in 0..gib_count {
        dev.copy_d2d(&normal, c.add(k * size_b), bb, size_b)
            .ctx("copy_d2d")?;
    }
    let ev = dev.record_event(&normal).ctx("record_event")?;
    let early = dev.event_query(&ev).ctx("event_query")?;
    // high: wait for that, then read B's first and last 64 MiB.
    dev.wait_event(&high, &ev).ctx("wait_event")?;
    let mut inflight = VecDeque::new();
    let first = take_buf(pool, &mut inflight)?;
    let last = take_buf(pool, &mut inflight)?;
    let p1 = dev.copy_d2h(&high, bb, first, STAGE).ctx("copy_d2h")?;
    let p2 = dev
        .copy_d2h(&high, bb.add(size_b - STAGE), last, STAGE)
        .ctx("copy_d2h")?;
    let first = p1.wait().ctx("waiting for copy_d2h")?;
    let last = p2.wait().ctx("waiting for copy_d2h")?;
    let src = (gib_count - 1) * size_b;
    let bad1 = first_mismatch(first.as_slice(), seed_c, src);
    let bad2 = first_mismatch(last.as_slice(), seed_c, src + size_b - STAGE);
    pool.push(first);
    pool.push(last);
    ensure!(
        bad1.is_none() && bad2.is_none(),
        "the high-priority stream read B before the normal stream's copies into it were done"
    );
    dev.event_synchronize(&ev).ctx("event_synchronize")?;
    ensure!(
        dev.event_query(&ev).ctx("event_query")?,
        "event not complete after event_synchronize"
    );
    println!("  normal -> high: ok (event complete right after recording: {early})");

    // The other way: high writes, normal waits for it and reads.
    dev.memset_d8(&high, bb, 0x3C, STAGE).ctx("memset_d8")?;
    let eh = dev.record_event(&high).ctx("record_event")?;
    dev.wait_event(&normal, &eh).ctx("wait_event")?;
    let buf = take_buf(pool, &mut inflight)?;
    let buf = read_back(dev, &normal, bb, buf, STAGE)?;
    let ok = buf.as_slice().iter().all(|&x| x == 0x3C);
    pool.push(buf);
    ensure!(
        ok,
        "the normal stream read B before the high stream's memset was done"
    );
    println!("  high -> normal: ok");

    // The legacy default stream, as the job's streams will be wrapped.
    let legacy = dev.legacy_stream();
    let buf = take_buf(pool, &mut inflight)?;
    let buf = read_back(dev, &legacy, a, buf, 2 * MIB)?;
    let bad = first_mismatch(&buf.as_slice()[..(2 * MIB) as usize], seed_a, 0);
    pool.push(buf);
    ensure!(
        bad.is_none(),
        "a copy on the legacy default stream read wrong data"
    );
    dev.synchronize(&legacy).ctx("synchronize legacy")?;
    dev.synchronize(&normal).ctx("synchronize")?;
    dev.synchronize(&high).ctx("synchronize")?;
    println!("  legacy default stream: ok");
    report["event_complete_right_after_record"] = json!(early);
    Ok(())
}

/// Step 4's check: the device's fingerprints of a buffer of known bytes against the definition's,
/// for chunk sizes from 16 bytes (over 65535 chunks: several launches) to more than the buffer,
/// and lengths that end inside a 16-byte word; then what the device refuses.
fn fingerprint_check(dev: &CudaDevice, s: &CudaStream, report: &mut Value) -> Res<()> {
    let size = round_up(64 * MIB, dev.granularity());
    let va = dev.reserve(size).ctx("reserve")?;
    dev.map(va, size).ctx("map")?;
    let len = usize::try_from(size).map_err(|e| e.to_string())?;
    let mut h = dev.alloc_host(len).ctx("alloc_host")?;
    fill(h.as_mut_slice(), 7, 0);
    let h = dev
        .copy_h2d(s, h, va, size)
        .ctx("copy_h2d")?
        .wait()
        .ctx("waiting for copy_h2d")?;
    let bytes = h.as_slice();
    let mut checked = 0;
    for chunk in [16, 4096, 2 * MIB, 3 * MIB + 16, 8 * MIB, GIB] {
        for n in [size, size - 13, 3 * 4096 + 5, 100, 8, 0] {
            let got = dev.fingerprint(s, va, n, chunk).ctx("fingerprint")?;
            let want = fingerprint::of_chunks(&bytes[..n as usize], chunk as usize);
            ensure!(
                got.len() == want.len(),
                "{} fingerprints of {n} bytes in {chunk}-byte chunks, not {}",
                got.len(),
                want.len()
            );
            if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
                return Err(format!(
                    "{n} bytes in {chunk}-byte chunks: chunk {i} is {} on the device, {} by the \
                     definition",
                    got[i], want[i]
                ));
            }
            checked += got.len();
        }
    }
    // The definition's pinned value (engine/src/fingerprint.rs's test).
    let mut h = h;
    for (i, w) in h.as_mut_slice()[..4000].chunks_exact_mut(4).enumerate() {
        w.copy_from_slice(&(i as u32).wrapping_mul(2_654_435_761).to_le_bytes());
    }
    let h = dev
        .copy_h2d(s, h, va, 4000)
        .ctx("copy_h2d")?
        .wait()
        .ctx("waiting for copy_h2d")?;
    let pinned = dev.fingerprint(s, va, 4000, 4096).ctx("fingerprint")?;
    ensure!(
        pinned.len() == 1 && pinned[0].to_string() == "aeda37bf452ab940b902ae2dfd724f64",
        "the pinned value is {pinned:?} on the device"
    );
    drop(h);
    // What the device refuses, before any launch: a misaligned start or chunk, a range past the
    // mapping (a kernel reading an unmapped page would fault the context).
    for (at, n, chunk) in [
        (va.add(8), MIB, MIB),
        (va, MIB, MIB + 8),
        (va, MIB, 0),
        (va, size + MIB, MIB),
    ] {
        let r = dev.fingerprint(s, at, n, chunk);
        ensure!(
            matches!(r, Err(DeviceError::InvalidAddress { .. })),
            "fingerprint({at}, {n}, {chunk}) was not refused: {r:?}"
        );
    }
    dev.unmap(va, size).ctx("unmap")?;
    dev.unreserve(va, size).ctx("unreserve")?;
    println!("  {checked} chunk fingerprints equal the definition's (and the pinned value)");
    report["fingerprint_chunks_checked"] = json!(checked);
    Ok(())
}

/// Step 4's timing: as many GiB as fit (up to 32, 2 GiB left free) mapped, filled, and
/// fingerprinted in 8 and 2 MiB chunks, best of 5 by the host's clock (the call waits for the
/// result); one line of JSON.
fn fingerprint_timing(dev: &CudaDevice, s: &CudaStream, report: &mut Value) -> Res<()> {
    let (free, _) = dev.memory_info().ctx("memory_info")?;
    let g = dev.granularity();
    let mut gib = (free.saturating_sub(2 * GIB) / GIB).min(32);
    let (va, size) = loop {
        if gib == 0 {
            println!("  fingerprint timing: not run ({} MiB free)", free / MIB);
            return Ok(());
        }
        let size = round_up(gib * GIB, g);
        let va = dev.reserve(size).ctx("reserve")?;
        match dev.map(va, size) {
            Ok(()) => break (va, size),
            Err(DeviceError::OutOfMemory { .. }) => {
                dev.unreserve(va, size).ctx("unreserve")?;
                gib /= 2;
            }
            Err(e) => return Err(format!("map: {e}")),
        }
    };
    dev.memset_d8(s, va, 0x3C, size).ctx("memset_d8")?;
    dev.synchronize(s).ctx("synchronize")?;
    let mut runs = Vec::new();
    for chunk in [8 * MIB, 2 * MIB] {
        let mut best = f64::MAX;
        let mut fps = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            fps = dev.fingerprint(s, va, size, chunk).ctx("fingerprint")?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        ensure!(
            fps.len() as u64 == size / chunk && fps.windows(2).all(|w| w[0] == w[1]),
            "the fingerprints of uniform {chunk}-byte chunks are not all equal"
        );
        runs.push(json!({
            "chunk_mib": chunk / MIB,
            "ms": (best * 1e6).round() / 1e3,
            "gb_s": (size as f64 / best / 1e9).round(),
        }));
    }
    dev.unmap(va, size).ctx("unmap")?;
    dev.unreserve(va, size).ctx("unreserve")?;
    let line = json!({ "fingerprint_gib": size / GIB, "runs": runs });
    println!("  {line}");
    report["fingerprint"] = line;
    Ok(())
}

fn step_fingerprints(dev: &CudaDevice, report: &mut Value) -> Res<()> {
    let s = dev
        .create_stream(StreamPriority::Normal)
        .ctx("create_stream")?;
    fingerprint_check(dev, &s, report)?;
    fingerprint_timing(dev, &s, report)
}

#[derive(Clone, Copy, PartialEq)]
enum Dir {
    D2H,
    H2D,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::D2H => "d2h",
            Dir::H2D => "h2d",
        }
    }
}

/// Copies all of `[va, va + total)` in `chunk`-byte pieces, round robin over `streams`, through the
/// pool's buffers; returns the seconds from the first copy queued to the last one complete.
fn bench_pass(
    dev: &CudaDevice,
    streams: &[CudaStream],
    pool: &mut Vec<PinnedBuf>,
    dir: Dir,
    va: DevPtr,
    total: u64,
    chunk: u64,
) -> Res<f64> {
    let n = streams.len();
    let mut queues: Vec<VecDeque<CudaPending>> = (0..n).map(|_| VecDeque::new()).collect();
    let t0 = Instant::now();
    let mut off = 0;
    let mut i = 0;
    while off < total {
        let s = i % n;
        let buf = match pool.pop() {
            Some(b) => b,
            None => {
                let q = if queues[s].is_empty() {
                    (0..n)
                        .find(|&k| !queues[k].is_empty())
                        .expect("buffers are in flight")
                } else {
                    s
                };
                queues[q]
                    .pop_front()
                    .expect("not empty")
                    .wait()
                    .ctx("waiting for a copy")?
            }
        };
        let len = chunk.min(total - off);
        let p = match dir {
            Dir::D2H => dev.copy_d2h(&streams[s], va.add(off), buf, len),
            Dir::H2D => dev.copy_h2d(&streams[s], buf, va.add(off), len),
        }
        .ctx("copy")?;
        queues[s].push_back(p);
        off += len;
        i += 1;
    }
    for q in queues {
        for p in q {
            pool.push(p.wait().ctx("waiting for a copy")?);
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn step_bench(
    dev: &CudaDevice,
    pool: &mut Vec<PinnedBuf>,
    b: &Buffers,
    report: &mut Value,
) -> Res<()> {
    let (c, size_c, _) = b.bufs[2];
    let streams: Vec<CudaStream> = (0..4)
        .map(|_| dev.create_stream(StreamPriority::Normal))
        .collect::<Result<_, _>>()
        .ctx("create_stream")?;
    // Warm up both directions (first-touch costs in the driver and the IOMMU).
    bench_pass(dev, &streams[..2], pool, Dir::D2H, c, GIB, STAGE)?;
    bench_pass(dev, &streams[..2], pool, Dir::H2D, c, GIB, STAGE)?;
    let mut rows = Vec::new();
    println!(
        "  {} MiB each way through a ring of {} pinned buffers, host clock",
        size_c / MIB,
        pool.len()
    );
    println!(
        "  {:<4} {:>9} {:>7} {:>8} {:>8}",
        "dir", "chunk_MiB", "streams", "GB/s", "ms"
    );
    for dir in [Dir::D2H, Dir::H2D] {
        for chunk_mib in [2u64, 8, 32, 64] {
            for n in [1usize, 2, 4] {
                let secs = bench_pass(dev, &streams[..n], pool, dir, c, size_c, chunk_mib * MIB)?;
                let gbps = size_c as f64 / secs / 1e9;
                println!(
                    "  {:<4} {:>9} {:>7} {:>8.1} {:>8.1}",
                    dir.name(),
                    chunk_mib,
                    n,
                    gbps,
                    secs * 1e3
                );
                rows.push(json!({
                    "dir": dir.name(),
                    "chunk_mib": chunk_mib,
                    "streams": n,
                    "bytes": size_c,
                    "secs": secs,
                    "gb_per_s": (gbps * 100.0).round() / 100.0,
                }));
            }
        }
    }
    report["bench"] = Value::Array(rows);
    Ok(())
}

struct Args {
    device: usize,
    bench: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        device: 0,
        bench: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--no-bench" => args.bench = false,
            "--device" => {
                let v = it.next().ok_or("--device needs a value")?;
                args.device = v.parse().map_err(|_| format!("bad device ordinal {v:?}"))?;
            }
            "-h" | "--help" => {
                return Err("usage: possum-cuda-selftest [--device N] [--no-bench]".to_string())
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let require = possum_cuda::config::Config::from_env().require_gpu;
    let info = match probe() {
        Ok(info) => info,
        Err(why) => {
            println!("SKIPPED: no CUDA device ({why})");
            if require {
                eprintln!("POSSUM_REQUIRE_GPU=1: a CUDA device is required");
                return ExitCode::from(1);
            }
            return ExitCode::SUCCESS;
        }
    };
    let mut report = json!({
        "selftest": "possum-cuda",
        "driver_version": info.driver_version,
        "device_count": info.device_count,
    });
    let t_all = Instant::now();
    let result = run(&args, &mut report);
    report["total_secs"] = json!(t_all.elapsed().as_secs_f64());
    match result {
        Ok(()) => {
            report["ok"] = json!(true);
            println!("{report}");
            println!(
                "possum-cuda-selftest: all steps passed in {:.1} s",
                t_all.elapsed().as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err((step, msg)) => {
            report["ok"] = json!(false);
            report["failed_step"] = json!(step);
            report["error"] = json!(msg);
            println!("{report}");
            println!("FAILED: step {step}: {msg}");
            ExitCode::from(1)
        }
    }
}

/// Runs step `name` ("N what"), prints how long it took and records its seconds in `secs[key]`.
fn timed<T>(
    secs: &mut Value,
    key: &str,
    name: &'static str,
    run: impl FnOnce() -> Res<T>,
) -> Result<T, (&'static str, String)> {
    let t = Instant::now();
    let out = run().map_err(|msg| (name, msg))?;
    let (n, what) = name.split_once(' ').unwrap_or(("?", name));
    println!("[{n}] {what}: ok in {:.2} s", t.elapsed().as_secs_f64());
    secs[key] = json!(t.elapsed().as_secs_f64());
    Ok(out)
}

fn run(args: &Args, report: &mut Value) -> Result<(), (&'static str, String)> {
    let step = |name: &'static str| move |msg: String| (name, msg);
    let t = Instant::now();
    let dev = CudaDevice::new(args.device).map_err(|e| ("0 open device", e.to_string()))?;
    println!(
        "{} (driver CUDA {}.{}), granularity {} KiB (recommended {} KiB)",
        dev.name(),
        report["driver_version"].as_i64().unwrap_or(0) / 1000,
        report["driver_version"].as_i64().unwrap_or(0) % 1000 / 10,
        dev.granularity() / 1024,
        dev.recommended_granularity() / 1024
    );
    report["device"] = json!(dev.name());
    report["granularity"] = json!(dev.granularity());
    report["recommended_granularity"] = json!(dev.recommended_granularity());
    let mut pool = (0..POOL)
        .map(|_| dev.alloc_host(STAGE as usize))
        .collect::<Result<Vec<_>, _>>()
        .ctx("alloc_host")
        .map_err(step("0 open device"))?;
    println!(
        "[0] opened, {} MiB pinned: {:.2} s",
        POOL as u64 * STAGE / MIB,
        t.elapsed().as_secs_f64()
    );
    let mut secs = json!({});

    let bufs = timed(&mut secs, "map_fill_check", "1 map, fill, check", || {
        step_map_fill_check(&dev, &mut pool, report)
    })?;

    timed(
        &mut secs,
        "release_remap",
        "2 release and remap at the same address",
        || step_release_remap(&dev, &bufs),
    )?;

    timed(&mut secs, "events", "3 events across streams", || {
        step_events(&dev, &mut pool, &bufs, report)
    })?;

    timed(&mut secs, "fingerprints", "4 fingerprints", || {
        step_fingerprints(&dev, report)
    })?;

    if args.bench {
        timed(&mut secs, "bench", "5 copy throughput", || {
            step_bench(&dev, &mut pool, &bufs, report)
        })?;
    } else {
        println!("[5] copy throughput: not run (--no-bench)");
    }

    let name = "6 clean up";
    let t = Instant::now();
    for &(va, size, _) in &bufs.bufs {
        dev.unmap(va, size).ctx("unmap").map_err(step(name))?;
        dev.unreserve(va, size)
            .ctx("unreserve")
            .map_err(step(name))?;
    }
    drop(pool);
    let (free, total) = dev.memory_info().ctx("memory_info").map_err(step(name))?;
    println!(
        "[6] clean up: ok in {:.2} s ({} of {} MiB free)",
        t.elapsed().as_secs_f64(),
        free / MIB,
        total / MIB
    );
    report["secs"] = secs;
    Ok(())
}
