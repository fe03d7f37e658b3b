//! Reading a driver call's parameters inside a CUPTI callback or a wrapper: one of the crate's
//! modules with `unsafe` code.
//!
//! CUPTI hands the callback a pointer to the call's `cu<name>_params` struct, valid for the
//! duration of the callback. [`RawCall`] wraps it with the lifetime of the callback, so nothing read
//! through it outlives the call, and reads only the 8-byte words that the call's
//! [`Shape`](crate::cbid::Shape) names (the shapes are checked against cudarc's bindings of
//! cupti_driver_cbid.h in `cbid`). Kernel arguments are read through the launch's
//! `kernelParams` (one pointer per parameter) or its `extra` buffer, only at offsets inside the
//! parameter layout the driver reported for that very kernel.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::marker::PhantomData;

use possum_analyzer::layout::SlotRun;

use possum_cuda::{CudaDevice, CudaStream};

use crate::cbid::StreamAt;

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
    /// the value with (so that the words its [`Shape`](crate::cbid::Shape) names exist), and
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
    pub fn stream(&self, at: StreamAt) -> u64 {
        match at {
            StreamAt::Word(i) => self.word(i),
            StreamAt::Config(i) => {
                let cfg = self.word(i) as usize as *const u8;
                if cfg.is_null() {
                    return 0;
                }
                // SAFETY: word `i` is `const CUlaunchConfig *config`, valid during the call; its
                // `hStream` follows seven `unsigned int`s, at byte 32.
                unsafe { cfg.add(32).cast::<u64>().read_unaligned() }
            }
            StreamAt::Legacy => 0,
            StreamAt::PerThread => STREAM_PER_THREAD,
            StreamAt::WordPt(i) => per_thread_if_null(self.stream(StreamAt::Word(i))),
            StreamAt::ConfigPt(i) => per_thread_if_null(self.stream(StreamAt::Config(i))),
        }
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
    /// copy): the words [`Self::read_slots`] gives. Same contract on `runs`.
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
        for c in crate::cbid::CALLBACKS
            .iter()
            .filter(|c| c.name.ends_with("_ptsz"))
        {
            let at = match c.shape {
                crate::cbid::Shape::Launch { stream, .. }
                | crate::cbid::Shape::Copy { stream, .. }
                | crate::cbid::Shape::Memset { stream, .. }
                | crate::cbid::Shape::OpaqueOp { stream }
                | crate::cbid::Shape::GraphLaunch { stream } => stream,
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
}
