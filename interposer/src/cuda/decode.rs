//! Reading a driver call's parameters inside a CUPTI callback or a wrapper: one of the crate's
//! modules with `unsafe` code.
//!
//! CUPTI hands the callback a pointer to the call's `cu<name>_params` struct, valid for the
//! duration of the callback. [`RawCall`] wraps it with the lifetime of the callback, so nothing read
//! through it outlives the call, and reads only the 8-byte words that the call's
//! [`Shape`](crate::cuda::cbid::Shape) names (the shapes are checked against cudarc's bindings of
//! cupti_driver_cbid.h in `cbid`). Kernel arguments are read through the launch's
//! `kernelParams` (one pointer per parameter) or its `extra` buffer, only at offsets inside the
//! parameter layout the driver reported for that very kernel.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::marker::PhantomData;

use possum_analyzer::layout::SlotRun;

use possum_cuda::{CudaDevice, CudaStream};

use crate::cuda::cbid::{StreamAt, WriteAt};

/// `CU_STREAM_PER_THREAD`.
pub const STREAM_PER_THREAD: u64 = 2;

/// A driver call's parameters, during its callback.
#[derive(Debug, Clone, Copy)]
pub struct RawCall<'a> {
    params: *const c_void,
    ret: *const c_void,
    _life: PhantomData<&'a ()>,
}

impl<'a> RawCall<'a> {
    /// Wraps CUPTI's `functionParams` and `functionReturnValue`.
    ///
    /// # Safety
    /// `params` must point at the `cu<name>_params` struct of the callback id the caller will use
    /// the value with (so that the words its [`Shape`](crate::cuda::cbid::Shape) names exist), and
    /// `ret` at its `CUresult` (or be null), both valid for `'a`.
    pub(crate) unsafe fn new(params: *const c_void, ret: *const c_void) -> RawCall<'a> {
        RawCall {
            params,
            ret,
            _life: PhantomData,
        }
    }

    /// 8-byte word `i` of the params struct (0 if there are no params).
    pub fn word(&self, i: usize) -> u64 {
        if self.params.is_null() {
            return 0;
        }
        // SAFETY: by `new`'s contract the struct has word `i` (the shape names only existing
        // words); fields are 8-byte aligned in these structs, but read unaligned to be sure.
        unsafe { self.params.cast::<u64>().add(i).read_unaligned() }
    }

    /// The `u64` that word `i` points at (an out-parameter such as `CUdeviceptr *dptr`, read on
    /// the call's exit), or `None` if the pointer is null.
    pub fn deref(&self, i: usize) -> Option<u64> {
        let p = self.word(i) as usize as *const u64;
        if p.is_null() {
            return None;
        }
        // SAFETY: the word is the call's out-pointer to a `CUdeviceptr`/`size_t`/handle, which the
        // caller passed and which is valid during the call.
        Some(unsafe { p.read_unaligned() })
    }

    /// The call's stream handle.
    #[inline]
    pub fn stream(&self, at: StreamAt) -> u64 {
        match at {
            StreamAt::Word(i) => self.word(i),
            StreamAt::Config(i) => self.config_stream(i),
            StreamAt::Legacy => 0,
            StreamAt::PerThread => STREAM_PER_THREAD,
            StreamAt::WordPt(i) => per_thread_if_null(self.word(i)),
            StreamAt::ConfigPt(i) => per_thread_if_null(self.config_stream(i)),
        }
    }

    /// The stream of the `CUlaunchConfig` in word `i`.
    fn config_stream(&self, i: usize) -> u64 {
        let cfg = self.word(i) as usize as *const u8;
        if cfg.is_null() {
            return 0;
        }
        // SAFETY: word `i` is `const CUlaunchConfig *config`, valid during the call; its
        // `hStream` follows seven `unsigned int`s, at byte 32.
        unsafe { cfg.add(32).cast::<u64>().read_unaligned() }
    }

    /// The call's `CUresult` (on exit), 0 for success.
    pub fn result(&self) -> i32 {
        if self.ret.is_null() {
            return 0;
        }
        // SAFETY: `ret` points at the call's `CUresult` (a C enum, 32 bits) by `new`'s contract.
        unsafe { self.ret.cast::<i32>().read_unaligned() }
    }

    /// A launch's kernel arguments: `kernelParams` in word `params`, `extra` in word `extra`.
    pub fn kernel_args(&self, params: usize, extra: Option<usize>) -> KernelArgs<'a> {
        KernelArgs {
            params: self.word(params) as usize as *const *const u8,
            extra: extra.map_or(std::ptr::null(), |e| {
                self.word(e) as usize as *const *const u8
            }),
            _life: PhantomData,
        }
    }
}

/// A range of device addresses an operation touches: (start, length in bytes).
pub type Span = (u64, u64);

/// `CU_MEMORYTYPE_DEVICE`, `CU_MEMORYTYPE_UNIFIED`: a copy descriptor's side whose
/// `*Device` field is the address.
const MEMORYTYPE_DEVICE: u64 = 2;
const MEMORYTYPE_UNIFIED: u64 = 4;

/// Where one side of a copy descriptor is, as 8-byte words of the struct: x in bytes, y, z (if
/// 3D), memory type, device address, pitch, allocation height (if 3D).
struct Side {
    x: usize,
    y: usize,
    z: Option<usize>,
    kind: usize,
    dev: usize,
    pitch: usize,
    height: Option<usize>,
}

/// `CUDA_MEMCPY2D`'s sides and its (width in bytes, height) words.
const COPY2D: (Side, Side, [usize; 2]) = (
    Side {
        x: 0,
        y: 1,
        z: None,
        kind: 2,
        dev: 4,
        pitch: 6,
        height: None,
    },
    Side {
        x: 7,
        y: 8,
        z: None,
        kind: 9,
        dev: 11,
        pitch: 13,
        height: None,
    },
    [14, 15],
);
/// `CUDA_MEMCPY3D`'s and `CUDA_MEMCPY3D_PEER`'s (the same words: `reserved0/1` where the peer
/// struct has its contexts) sides and (width in bytes, height, depth) words.
const COPY3D: (Side, Side, [usize; 3]) = (
    Side {
        x: 0,
        y: 1,
        z: Some(2),
        kind: 4,
        dev: 6,
        pitch: 9,
        height: Some(10),
    },
    Side {
        x: 11,
        y: 12,
        z: Some(13),
        kind: 15,
        dev: 17,
        pitch: 20,
        height: Some(21),
    },
    [22, 23, 24],
);

/// The bytes a pitched box covers, from its first byte: `depth` slices of `height` rows of
/// `width` bytes, rows `pitch` apart and slices `rows * pitch` apart (0 for an empty box).
pub fn pitched_len(width: u64, height: u64, depth: u64, pitch: u64, rows: u64) -> u64 {
    if width == 0 || height == 0 || depth == 0 {
        return 0;
    }
    let slices = (depth - 1).saturating_mul(rows).saturating_mul(pitch);
    let lines = (height - 1).saturating_mul(pitch);
    slices.saturating_add(lines).saturating_add(width)
}

/// `CU_STREAM_MEM_OP_*`: the batch operations that write (`WRITE_VALUE_32/64`) and those that
/// touch no memory possum tracks (waits read a value; flush, barrier).
const MEMOP_WAIT_32: u32 = 1;
const MEMOP_WRITE_32: u32 = 2;
const MEMOP_FLUSH: u32 = 3;
const MEMOP_WAIT_64: u32 = 4;
const MEMOP_WRITE_64: u32 = 5;
const MEMOP_BARRIER: u32 = 6;
/// `sizeof(CUstreamBatchMemOpParams)`.
const MEMOP_SIZE: usize = 48;

impl RawCall<'_> {
    /// The device ranges an operation of [`Shape::Write`](crate::cuda::cbid::Shape::Write) at `at`
    /// writes (into `writes`) and reads (into `reads`); host and array sides give none. `false`
    /// when the call cannot be decoded (an unknown batch operation, a null descriptor): then it
    /// must be taken as touching everything.
    pub fn write_spans(&self, at: WriteAt, writes: &mut Vec<Span>, reads: &mut Vec<Span>) -> bool {
        match at {
            WriteAt::Span { ptr, bytes } => writes.push((self.word(ptr), self.word(bytes))),
            WriteAt::Value { ptr, size } => writes.push((self.word(ptr), size)),
            WriteAt::Pitched { elem } => {
                // (dstDevice, dstPitch, value, Width, Height)
                let width = self.word(3).saturating_mul(elem);
                let len = pitched_len(width, self.word(4), 1, self.word(1), 1);
                writes.push((self.word(0), len));
            }
            WriteAt::Copy2D => {
                let (src, dst, [w, h]) = COPY2D;
                let Some(d) = self.descriptor(0) else {
                    return false;
                };
                let (w, h) = (d(w), d(h));
                reads.extend(side_span(&d, &src, w, h, 1));
                writes.extend(side_span(&d, &dst, w, h, 1));
            }
            WriteAt::Copy3D => {
                let (src, dst, [w, h, z]) = COPY3D;
                let Some(d) = self.descriptor(0) else {
                    return false;
                };
                let (w, h, z) = (d(w), d(h), d(z));
                reads.extend(side_span(&d, &src, w, h, z));
                writes.extend(side_span(&d, &dst, w, h, z));
            }
            WriteAt::CopyBatch => {
                // (dsts, srcs, sizes, count, ...)
                let (dsts, srcs, sizes) = (
                    self.word(0) as usize as *const u64,
                    self.word(1) as usize as *const u64,
                    self.word(2) as usize as *const u64,
                );
                let count = self.word(3) as usize;
                if count > 0 && (dsts.is_null() || srcs.is_null() || sizes.is_null()) {
                    return false;
                }
                for i in 0..count {
                    // SAFETY: `dsts`, `srcs` and `sizes` are arrays of `count` 8-byte
                    // `CUdeviceptr`s and `size_t`s (the call's contract), valid during the call.
                    let (d, s, n) = unsafe {
                        (
                            dsts.add(i).read_unaligned(),
                            srcs.add(i).read_unaligned(),
                            sizes.add(i).read_unaligned(),
                        )
                    };
                    writes.push((d, n));
                    reads.push((s, n));
                }
            }
            WriteAt::BatchMemOp => {
                // (stream, count, paramArray, flags)
                let count = self.word(1) as u32 as usize;
                let ops = self.word(2) as usize as *const u8;
                if ops.is_null() && count > 0 {
                    return false;
                }
                for i in 0..count {
                    // SAFETY: `paramArray` holds `count` 48-byte `CUstreamBatchMemOpParams`
                    // (the call's contract), valid during the call; each starts with its
                    // operation (a 32-bit enum) and a write's address is at byte 8.
                    let (op, addr) = unsafe {
                        let p = ops.add(i * MEMOP_SIZE);
                        (
                            p.cast::<u32>().read_unaligned(),
                            p.add(8).cast::<u64>().read_unaligned(),
                        )
                    };
                    match op {
                        MEMOP_WRITE_32 => writes.push((addr, 4)),
                        MEMOP_WRITE_64 => writes.push((addr, 8)),
                        MEMOP_WAIT_32 | MEMOP_WAIT_64 | MEMOP_FLUSH | MEMOP_BARRIER => {}
                        _ => return false,
                    }
                }
            }
        }
        true
    }

    /// Word `i`'s pointer to a copy descriptor, as a reader of its 8-byte words (`None` if
    /// null).
    fn descriptor(&self, i: usize) -> Option<impl Fn(usize) -> u64 + '_> {
        let p = self.word(i) as usize as *const u64;
        if p.is_null() {
            return None;
        }
        Some(move |w: usize| {
            // SAFETY: word `i` is the call's `const CUDA_MEMCPY2D/3D/3D_PEER *`, valid during
            // the call; the words read are those of [`COPY2D`] / [`COPY3D`], all inside the
            // struct the shape names.
            unsafe { p.add(w).read_unaligned() }
        })
    }
}

/// One side of a copy descriptor read with `d`: its device range for a box of `w` bytes by `h`
/// rows by `z` slices, or `None` for a host or array side.
fn side_span(d: &impl Fn(usize) -> u64, s: &Side, w: u64, h: u64, z: u64) -> Option<Span> {
    let kind = d(s.kind) & 0xffff_ffff;
    if kind != MEMORYTYPE_DEVICE && kind != MEMORYTYPE_UNIFIED {
        return None;
    }
    let pitch = d(s.pitch);
    let rows = s.height.map_or(0, d);
    let start = d(s.dev)
        .wrapping_add(s.z.map_or(0, d).wrapping_mul(rows).wrapping_mul(pitch))
        .wrapping_add(d(s.y).wrapping_mul(pitch))
        .wrapping_add(d(s.x));
    Some((start, pitched_len(w, h, z, pitch, rows)))
}

/// A `_ptsz` call's stream: null there means the calling thread's per-thread default stream.
pub(crate) fn per_thread_if_null(s: u64) -> u64 {
    if s == 0 {
        STREAM_PER_THREAD
    } else {
        s
    }
}

/// `CU_LAUNCH_PARAM_END`, `CU_LAUNCH_PARAM_BUFFER_POINTER`, `CU_LAUNCH_PARAM_BUFFER_SIZE`.
const PARAM_END: usize = 0;
const PARAM_BUFFER_POINTER: usize = 1;
const PARAM_BUFFER_SIZE: usize = 2;

/// A launch's arguments, during its callback.
#[derive(Debug, Clone, Copy)]
pub struct KernelArgs<'a> {
    params: *const *const u8,
    extra: *const *const u8,
    _life: PhantomData<&'a ()>,
}

impl KernelArgs<'_> {
    /// Reads the 8-byte word of every slot (in order) into `out` (cleared first), given as runs
    /// of consecutive words (`possum_analyzer::layout::slot_runs`). A slot that cannot be read
    /// (no argument pointer, outside the `extra` buffer) reads as 0.
    ///
    /// `runs` must come from the parameter layout the driver reported for the launched kernel
    /// (`possum_analyzer::KernelModel::slot_runs`): that is what makes the reads in bounds.
    pub fn read_slots(&self, runs: &[SlotRun], out: &mut Vec<u64>) {
        out.clear();
        self.for_each_slot(runs, |w| out.push(w));
    }

    /// Calls `f` with the 8-byte word of every slot, in order, where the job wrote them (no
    /// copy): the words [`Self::read_slots`] gives. Same contract on `runs`. Inlined: the hot
    /// caller folds the words into a hash kept in registers.
    #[inline]
    pub fn for_each_slot(&self, runs: &[SlotRun], mut f: impl FnMut(u64)) {
        let (buf, size) = if self.params.is_null() {
            self.extra_buffer()
        } else {
            (std::ptr::null(), 0)
        };
        for r in runs {
            let len = usize::from(r.len);
            let (src, readable): (*const u8, usize) = if !self.params.is_null() {
                // SAFETY: `kernelParams` has one pointer per parameter of the kernel, and the
                // run's parameter index lies inside the driver's layout for it.
                let arg: *const u8 = unsafe { self.params.add(usize::from(r.param)).read() };
                if arg.is_null() {
                    (arg, 0)
                } else {
                    // SAFETY: the run's words lie inside its parameter, whose bytes `arg` points
                    // at for the duration of the call.
                    (unsafe { arg.add(8 * usize::from(r.word)) }, len)
                }
            } else {
                let off = r.offset as usize;
                let readable = (size.saturating_sub(off) / 8).min(len);
                if buf.is_null() || readable == 0 {
                    (buf, 0)
                } else {
                    // SAFETY: at least one word at `off` lies inside the packed buffer.
                    (unsafe { buf.add(off) }, readable)
                }
            };
            for i in 0..readable {
                // SAFETY: word `i < readable` of the run lies inside the argument (above).
                f(unsafe { src.add(8 * i).cast::<u64>().read_unaligned() });
            }
            for _ in readable..len {
                f(0);
            }
        }
    }

    /// The `extra` array's packed argument buffer and its size ((null, 0) if absent).
    fn extra_buffer(&self) -> (*const u8, usize) {
        let (mut buf, mut size) = (std::ptr::null::<u8>(), 0usize);
        if self.extra.is_null() {
            return (buf, size);
        }
        // SAFETY: `extra` is a CU_LAUNCH_PARAM_END-terminated array of (key, value) pointer pairs
        // (the driver rejects the launch otherwise); at most 16 pairs are looked at.
        unsafe {
            for i in 0..16 {
                let key = self.extra.add(2 * i).read() as usize;
                if key == PARAM_END {
                    break;
                }
                let val = self.extra.add(2 * i + 1).read();
                match key {
                    PARAM_BUFFER_POINTER => buf = val,
                    PARAM_BUFFER_SIZE if !val.is_null() => {
                        size = val.cast::<usize>().read_unaligned()
                    }
                    _ => {}
                }
            }
        }
        (buf, size)
    }
}

/// Wraps the job's stream `raw` for the engine (which records fences on it and makes it wait for
/// possum's copies). Never destroys it.
pub fn job_stream(dev: &CudaDevice, raw: u64) -> CudaStream {
    // SAFETY: `wrap_stream`'s contract is that the stream outlives the wrapper. The interposer
    // drops every wrapper of a stream (`DevEngine::forget_stream`, and the engine's registration)
    // in the entry callback of the job's `cuStreamDestroy`, before the driver destroys it; the
    // legacy (0) and per-thread (2) default streams are never destroyed.
    unsafe { dev.wrap_stream(raw as usize as possum_cuda::CUstream) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use possum_analyzer::layout::{slot_runs, Param, ParamLayout};

    /// A null stream in a `_ptsz` call is the calling thread's per-thread default stream; in the
    /// plain call, the legacy one; any other handle is itself.
    #[test]
    fn a_null_stream_of_a_ptsz_call_is_the_per_thread_stream() {
        // cuMemcpyAsync(dst, src, n, hStream): the stream in word 3; cuLaunchKernelEx's
        // CUlaunchConfig has hStream at byte 32.
        let mut cfg = [0u64; 8];
        let params = |s: u64, cfg: &[u64; 8]| [1u64, 2, 3, s, cfg.as_ptr() as u64];
        for (s, plain, ptsz) in [(0, 0, STREAM_PER_THREAD), (0x55aa, 0x55aa, 0x55aa)] {
            cfg[4] = s;
            let p = params(s, &cfg);
            // SAFETY: `p` holds five words, `cfg` eight; both outlive the calls.
            let call = unsafe { RawCall::new(p.as_ptr().cast(), std::ptr::null()) };
            assert_eq!(call.stream(StreamAt::Word(3)), plain);
            assert_eq!(call.stream(StreamAt::WordPt(3)), ptsz);
            assert_eq!(call.stream(StreamAt::Config(4)), plain);
            assert_eq!(call.stream(StreamAt::ConfigPt(4)), ptsz);
        }
        // Every `_ptsz` operation in the table reads its stream that way.
        for c in crate::cuda::cbid::CALLBACKS
            .iter()
            .filter(|c| c.name.ends_with("_ptsz"))
        {
            let at = match c.shape {
                crate::cuda::cbid::Shape::Launch { stream, .. }
                | crate::cuda::cbid::Shape::Copy { stream, .. }
                | crate::cuda::cbid::Shape::Memset { stream, .. }
                | crate::cuda::cbid::Shape::OpaqueOp { stream }
                | crate::cuda::cbid::Shape::Write { stream, .. }
                | crate::cuda::cbid::Shape::GraphLaunch { stream } => stream,
                _ => continue,
            };
            assert!(
                matches!(at, StreamAt::WordPt(_) | StreamAt::ConfigPt(_)),
                "{}: {at:?}",
                c.name
            );
        }
    }

    #[test]
    fn launch_words_come_from_kernel_params_and_by_value_structs() {
        // kernel(float *a, struct { float *in; float *out; int n; } s, int k)
        let a: u64 = 0x7f00_0000_1000;
        let s: [u64; 3] = [0x7f00_0020_0000, 0x7f00_0040_0000, 1 << 20];
        let k: u32 = 7;
        let args: [*const u8; 3] = [
            (&a as *const u64).cast(),
            s.as_ptr().cast(),
            (&k as *const u32).cast(),
        ];
        let layout = ParamLayout::new(vec![
            Param { offset: 0, size: 8 },
            Param {
                offset: 8,
                size: 24,
            },
            Param {
                offset: 32,
                size: 4,
            },
        ]);
        let slots = layout.pointer_slots();
        // cuLaunchKernel's params: f, grid/block/shared words, hStream (5), kernelParams (6),
        // extra (7).
        let mut launch = [0u64; 8];
        launch[0] = 0xf00;
        launch[5] = 0x5;
        launch[6] = args.as_ptr() as u64;
        // SAFETY: `launch` has the 8 words of cuLaunchKernel's params struct and outlives `call`.
        let call = unsafe { RawCall::new(launch.as_ptr().cast(), std::ptr::null()) };
        assert_eq!(call.word(0), 0xf00);
        assert_eq!(call.stream(StreamAt::Word(5)), 5);
        assert_eq!(call.stream(StreamAt::Legacy), 0);
        assert_eq!(call.stream(StreamAt::PerThread), STREAM_PER_THREAD);
        assert_eq!(call.result(), 0);
        let mut out = Vec::new();
        call.kernel_args(6, Some(7))
            .read_slots(&slot_runs(&slots), &mut out);
        assert_eq!(out, vec![a, s[0], s[1], s[2]]);
        // Read in place, the same words.
        let mut seen = Vec::new();
        call.kernel_args(6, Some(7))
            .for_each_slot(&slot_runs(&slots), |w| seen.push(w));
        assert_eq!(seen, out);
    }

    #[test]
    fn launch_words_come_from_an_extra_buffer() {
        let mut packed = [0u8; 40];
        packed[0..8].copy_from_slice(&0x7f00_0000_1000u64.to_le_bytes());
        packed[16..24].copy_from_slice(&0x7f00_0000_2000u64.to_le_bytes());
        let size: usize = 20; // the second slot (16..24) lies past the declared size
        let extra: [*const u8; 5] = [
            PARAM_BUFFER_POINTER as *const u8,
            packed.as_ptr(),
            PARAM_BUFFER_SIZE as *const u8,
            (&size as *const usize).cast(),
            PARAM_END as *const u8,
        ];
        let layout = ParamLayout::new(vec![
            Param { offset: 0, size: 8 },
            Param {
                offset: 16,
                size: 8,
            },
        ]);
        // cuLaunchKernelEx: config (0), f (1), kernelParams (2, null), extra (3).
        let config = [0u64, 0, 0, 0, 0x77, 0, 0, 0];
        let words = [config.as_ptr() as u64, 0xf00, 0, extra.as_ptr() as u64];
        let res: i32 = 2;
        // SAFETY: `words` has cuLaunchKernelEx's four words, `res` is a CUresult; both outlive
        // `call`.
        let call = unsafe { RawCall::new(words.as_ptr().cast(), (&res as *const i32).cast()) };
        assert_eq!(call.stream(StreamAt::Config(0)), 0x77);
        assert_eq!(call.result(), 2);
        let mut out = Vec::new();
        call.kernel_args(2, Some(3))
            .read_slots(&slot_runs(&layout.pointer_slots()), &mut out);
        assert_eq!(out, vec![0x7f00_0000_1000, 0]);
        let mut seen = Vec::new();
        call.kernel_args(2, Some(3))
            .for_each_slot(&slot_runs(&layout.pointer_slots()), |w| seen.push(w));
        assert_eq!(seen, out);
    }

    #[test]
    fn out_pointers_are_read_on_exit() {
        let dptr: u64 = 0x7f00_1234_0000;
        let words = [(&dptr as *const u64) as u64, 4096];
        // SAFETY: `words` is cuMemAlloc_v2's params struct (dptr*, bytesize), outliving `call`.
        let call = unsafe { RawCall::new(words.as_ptr().cast(), std::ptr::null()) };
        assert_eq!(call.deref(0), Some(dptr));
        assert_eq!(call.word(1), 4096);
        let null = [0u64; 2];
        // SAFETY: as above, with a null out-pointer.
        let call = unsafe { RawCall::new(null.as_ptr().cast(), std::ptr::null()) };
        assert_eq!(call.deref(0), None);
    }

    /// The ranges of each kind of [`WriteAt`]: pitched boxes from their descriptors, a value,
    /// batch write operations; host and array sides give none, an unknown batch operation or a
    /// null descriptor makes the call undecodable.
    #[test]
    fn write_spans_cover_pitched_boxes_values_and_batch_writes() {
        let spans = |words: &[u64], at: WriteAt| {
            // SAFETY: `words` is the params struct (and what its words point at outlives it).
            let call = unsafe { RawCall::new(words.as_ptr().cast(), std::ptr::null()) };
            let (mut w, mut r) = (Vec::new(), Vec::new());
            let ok = call.write_spans(at, &mut w, &mut r);
            (ok, w, r)
        };
        // cuMemsetD2D32_v2(dst, pitch 256, value, width 10 elements, height 3)
        let (ok, w, r) = spans(&[0x1000, 256, 7, 10, 3], WriteAt::Pitched { elem: 4 });
        assert!(ok && r.is_empty());
        assert_eq!(w, vec![(0x1000, 2 * 256 + 40)]);
        // cuMemsetD2D8_v2 of height 0: nothing.
        let (_, w, _) = spans(&[0x1000, 256, 7, 10, 0], WriteAt::Pitched { elem: 1 });
        assert_eq!(w, vec![(0x1000, 0)]);
        // cuStreamWriteValue64(stream, addr, value, flags)
        let (_, w, _) = spans(&[5, 0x2000, 1, 0], WriteAt::Value { ptr: 1, size: 8 });
        assert_eq!(w, vec![(0x2000, 8)]);
        // CUDA_MEMCPY2D: device source at (x 4, y 1), pitch 512; device destination at (x 8,
        // y 2), pitch 1024; 100 bytes by 5 rows.
        let mut d2 = [0u64; 16];
        d2[..7].copy_from_slice(&[4, 1, MEMORYTYPE_DEVICE, 0, 0x10_0000, 0, 512]);
        d2[7..16].copy_from_slice(&[8, 2, MEMORYTYPE_UNIFIED, 0, 0x20_0000, 0, 1024, 100, 5]);
        let (ok, w, r) = spans(&[d2.as_ptr() as u64], WriteAt::Copy2D);
        assert!(ok);
        assert_eq!(r, vec![(0x10_0000 + 512 + 4, 4 * 512 + 100)]);
        assert_eq!(w, vec![(0x20_0000 + 2 * 1024 + 8, 4 * 1024 + 100)]);
        // A host source gives no read.
        d2[2] = 1;
        let (_, _, r) = spans(&[d2.as_ptr() as u64], WriteAt::Copy2D);
        assert!(r.is_empty());
        // CUDA_MEMCPY3D_PEER: host source; device destination at (x 0, y 1, z 2), pitch 64,
        // 8 rows a slice; 16 bytes by 2 rows by 3 slices.
        let mut d3 = [0u64; 25];
        d3[4] = 1;
        d3[11..25].copy_from_slice(&[
            0,
            1,
            2,
            0,
            MEMORYTYPE_DEVICE,
            0,
            0x40_0000,
            0,
            0,
            64,
            8,
            16,
            2,
            3,
        ]);
        let (ok, w, r) = spans(&[d3.as_ptr() as u64], WriteAt::Copy3D);
        assert!(ok && r.is_empty());
        assert_eq!(
            w,
            vec![(0x40_0000 + 2 * 8 * 64 + 64, (2 * 8 + 1) * 64 + 16)]
        );
        // An array destination: nothing written that possum tracks.
        d3[15] = 3;
        let (ok, w, _) = spans(&[d3.as_ptr() as u64], WriteAt::Copy3D);
        assert!(ok && w.is_empty());
        assert!(!spans(&[0], WriteAt::Copy3D).0);
        // cuMemcpyBatchAsync_v2(dsts, srcs, sizes, 2, ...)
        let (dsts, srcs, sizes) = ([0x5000u64, 0x6000], [0x7000u64, 0x8000], [16u64, 32]);
        let call = [
            dsts.as_ptr() as u64,
            srcs.as_ptr() as u64,
            sizes.as_ptr() as u64,
            2,
        ];
        let (ok, w, r) = spans(&call, WriteAt::CopyBatch);
        assert!(ok);
        assert_eq!(w, vec![(0x5000, 16), (0x6000, 32)]);
        assert_eq!(r, vec![(0x7000, 16), (0x8000, 32)]);
        assert!(!spans(&[0, 0, 0, 1], WriteAt::CopyBatch).0);
        // cuStreamBatchMemOp(stream, 3, ops, 0): a 32-bit write, a wait, a 64-bit write.
        let mut ops = [0u64; 18];
        ops[0] = MEMOP_WRITE_32 as u64;
        ops[1] = 0x3000;
        ops[6] = MEMOP_WAIT_32 as u64;
        ops[7] = 0x3100;
        ops[12] = MEMOP_WRITE_64 as u64;
        ops[13] = 0x3200;
        let call = [1, 3, ops.as_ptr() as u64, 0];
        let (ok, w, _) = spans(&call, WriteAt::BatchMemOp);
        assert!(ok);
        assert_eq!(w, vec![(0x3000, 4), (0x3200, 8)]);
        ops[6] = 8; // an operation possum does not know (an atomic reduction)
        let call = [1, 3, ops.as_ptr() as u64, 0];
        assert!(!spans(&call, WriteAt::BatchMemOp).0);
    }
}
