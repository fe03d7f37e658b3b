//! The fingerprint kernel (part of [`super`], the unsafe layer over the driver, under its
//! rules): the PTX embedded, its own entry points looked up apart, the module loaded into a
//! context, launched over a range and its sums read back on the caller's stream.
#![allow(unsafe_code)]

use std::ffi::{c_void, CStr};
use std::fmt;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;
use possum_engine::device::{DeviceError, DeviceResult, HostBuffer, Transfer};

use super::{
    address_free, address_reserve, alloc_granularity, check, loaded, pinned, to_usize, unmap,
    CUresult, Context, CudaStream, PhysMem, PinnedBuf,
};

/// The fingerprint kernel (`cuda/kernels/fingerprint.cu`; its definition is
/// `possum_engine::fingerprint`) as PTX, built by `scripts/gpu-fingerprint.sh`, NUL-terminated
/// for `cuModuleLoadData`. The driver compiles it for the GPU at hand when it is loaded.
const FINGERPRINT_PTX: &CStr = match CStr::from_bytes_with_nul(
    concat!(include_str!("../../kernels/fingerprint.ptx"), "\0").as_bytes(),
) {
    Ok(s) => s,
    Err(_) => panic!("cuda/kernels/fingerprint.ptx must hold no NUL byte"),
};

/// The kernel's entry point in the PTX.
const FINGERPRINT_ENTRY: &CStr = c"possum_fingerprint";

macro_rules! lazy_symbols {
    ($($name:literal),* $(,)?) => {
        &[$(($name, concat!("fingerprint: libcuda has no ", $name))),*]
    };
}

/// The entry points only [`FingerprintKernel`] calls, each with what its absence makes
/// [`FingerprintKernel::load`] answer (`Unsupported`). They are not in [`SYMBOLS`]: [`load`]
/// refuses the whole driver when one of those is missing, and a driver without these (the
/// tests' fake one may lack them) must lose fingerprints only. cudarc's loader panics at the
/// first call of a missing entry point, so [`FingerprintKernel::load`] looks each one up before
/// any is called.
///
/// Inside a job, libpossum.so (the interposer) wraps `cuLaunchKernel`, `cuMemsetD8Async`,
/// `cuMemcpyDtoHAsync_v2` and `cuMemMap` (not the `cuModule*` functions) and defines `dlsym`
/// itself. These calls still reach the driver's own functions: cudarc finds
/// each entry point with `dlsym` on libcuda's handle, called from libloading's code, which is
/// linked into libpossum.so, and the interposer's `dlsym` answers a caller inside libpossum.so
/// with the driver's function, not its wrapper (`interposer/src/cuda/entry.rs`: `possum_dlsym`
/// passes the caller's return address to `handed_out`, which compares its object with
/// libpossum.so's, `from_this_library`). So possum's own launch, mapping, memset and copy pass
/// none of the hooks: no op gate, no validation or write tracking of possum's kernel, no mapping
/// taken for the job's. (With `POSSUM_HOOKS=cupti`, CUPTI reports them all the same;
/// its callbacks ignore a thread inside possum, `Reentry`, and possum's own threads.)
const FINGERPRINT_SYMBOLS: &[(&str, &str)] = lazy_symbols!(
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
);

/// Threads per block of the kernel.
const FP_THREADS: u32 = 256;
/// 16-byte words each thread sums before the grid strides on: a chunk gets
/// `ceil(words / (FP_THREADS * FP_PER_THREAD))` blocks. `scripts/gpu/fingerprint_check.cpp`
/// measured 16 and 64 at the H200's bandwidth (32 GiB in 7.7 ms), 4 about 10% slower.
const FP_PER_THREAD: u64 = 16;
/// Chunks per launch: the limit of a grid's y dimension.
const FP_MAX_CHUNKS: u64 = 65535;
/// The smallest results buffers asked for (4096 chunks: 32 GiB in 8 MiB chunks; the device's is
/// a mapping, a multiple of the granularity).
const FP_MIN_SCRATCH: usize = 64 << 10;

/// Whether the loaded libcuda has `name` (looked up, not called).
fn has_symbol(name: &str) -> bool {
    // SAFETY: `loaded()` says a libcuda was found, so `culib` does not panic; the symbol is
    // looked up without being called and the pointer dropped at once.
    loaded() && unsafe { sys::culib().get::<*const c_void>(name.as_bytes()) }.is_ok()
}

/// Device memory for possum's own work (the fingerprint kernel's results): a mapping of its own
/// (`cuMemAddressReserve` + `cuMemCreate` + `cuMemMap`, a multiple of the granularity), outside
/// possum's reservations and none of the job's allocations; unmapped and freed on drop. Not
/// `cuMemAlloc`: the driver packs small allocations into shared pages, where possum's would sit
/// beside the job's (and the interposer tells allocations apart by the ranges the driver
/// reports), and `cuMemFree` waits for the whole device, the job's work included. Only
/// [`FingerprintKernel`] makes it, and drops it only when no work queued on it can still be
/// running (it leaks it otherwise).
struct DeviceMem {
    ptr: u64,
    len: usize,
    /// Taken (released) on drop, after the unmap.
    mem: Option<PhysMem>,
    ctx: Arc<Context>,
}

impl DeviceMem {
    /// At least `len` bytes (`len` > 0) on `ctx`'s device, which is current.
    fn alloc(ctx: &Arc<Context>, len: usize) -> DeviceResult<DeviceMem> {
        let g = alloc_granularity(ctx.dev, false)?.max(1);
        let size = (len as u64).div_ceil(g) * g;
        let va = address_reserve(size, g)?;
        let mem = PhysMem::create(ctx, size).and_then(|m| m.map_at(va).map(|()| m));
        match mem {
            Ok(mem) => Ok(DeviceMem {
                ptr: va,
                len: to_usize("cuMemCreate", size)?,
                mem: Some(mem),
                ctx: ctx.clone(),
            }),
            Err(e) => {
                // Nothing is mapped (`map_at` unmaps what it mapped on failure).
                let _ = address_free(va, size);
                Err(e)
            }
        }
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        let size = self.len as u64;
        if unmap(self.ptr, size).is_ok() {
            drop(self.mem.take());
            let _ = address_free(self.ptr, size);
        }
    }
}

/// The results' buffers: on the device (16 bytes a chunk: the lanes' sums, which the kernel adds
/// into) and their pinned copy on the host. Grown as needed, never shrunk.
#[derive(Default)]
struct Scratch {
    out: Option<DeviceMem>,
    host: Option<PinnedBuf>,
    /// A device buffer was leaked: work on it (and so the module) may still be running.
    leaked: bool,
}

/// A buffer size for `bytes`: at least [`FP_MIN_SCRATCH`], a power of two.
fn scratch_len(bytes: usize) -> usize {
    let n = bytes.max(FP_MIN_SCRATCH);
    n.checked_next_power_of_two().unwrap_or(n)
}

impl Scratch {
    /// The device buffer's address, the buffer at least `bytes` long. An old, smaller one is
    /// freed: no work uses it (every use was waited for, or the buffer leaked).
    fn device(&mut self, ctx: &Arc<Context>, bytes: usize) -> DeviceResult<u64> {
        if self.out.as_ref().is_none_or(|m| m.len < bytes) {
            self.out = None;
            self.out = Some(DeviceMem::alloc(ctx, scratch_len(bytes))?);
        }
        Ok(self.out.as_ref().map_or(0, |m| m.ptr))
    }

    /// The pinned buffer, at least `bytes` long, taken out (a copy owns it while it runs).
    fn host(&mut self, ctx: &Arc<Context>, bytes: usize) -> DeviceResult<PinnedBuf> {
        match self.host.take() {
            Some(h) if h.len() >= bytes => Ok(h),
            _ => pinned(ctx, scratch_len(bytes)),
        }
    }

    /// Forgets the device buffer without freeing it: work that may still write it could not be
    /// waited for.
    fn leak_device(&mut self) {
        if let Some(m) = self.out.take() {
            std::mem::forget(m);
            self.leaked = true;
        }
    }
}

/// The fingerprint kernel loaded into a context (`cuModuleLoadData` of the embedded PTX;
/// unloaded on drop), with the buffers its results come back through.
pub struct FingerprintKernel {
    module: sys::CUmodule,
    func: sys::CUfunction,
    /// Held for the whole of a [`FingerprintKernel::sums`], which waits for its work (or leaks
    /// the buffers) before it lets go: the buffers are idle whenever it is free.
    scratch: parking_lot::Mutex<Scratch>,
    /// (address, length) of the results' device buffer, readable without the lock
    /// ([`FingerprintKernel::owns`]).
    results: (AtomicU64, AtomicU64),
    ctx: Arc<Context>,
}

// SAFETY: module and function handles are usable from every thread of the process (the driver
// serialises launches itself); the only mutable state, the buffers, is behind a mutex.
unsafe impl Send for FingerprintKernel {}
// SAFETY: as above; the handles are never mutated.
unsafe impl Sync for FingerprintKernel {}

impl fmt::Debug for FingerprintKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FingerprintKernel")
            .field("module", &self.module)
            .field("func", &self.func)
            .finish_non_exhaustive()
    }
}

impl FingerprintKernel {
    /// Loads the kernel into `ctx`. `Unsupported` when the driver lacks an entry point it needs
    /// ([`FINGERPRINT_SYMBOLS`]); a `Backend` error naming the call when the driver refuses the
    /// module (a driver too old for its PTX, say).
    pub fn load(ctx: &Arc<Context>) -> DeviceResult<FingerprintKernel> {
        if !loaded() {
            return Err(DeviceError::Unsupported(
                "fingerprint: libcuda is not loaded",
            ));
        }
        if let Some((_, missing)) = FINGERPRINT_SYMBOLS.iter().find(|(n, _)| !has_symbol(n)) {
            return Err(DeviceError::Unsupported(missing));
        }
        ctx.bind()?;
        let mut module: sys::CUmodule = ptr::null_mut();
        // SAFETY: the library is loaded and has the entry point (checked above); the image is the
        // NUL-terminated PTX text, static; `module` is a valid out-pointer.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, FINGERPRINT_PTX.as_ptr().cast())
        })?;
        let mut func: sys::CUfunction = ptr::null_mut();
        // SAFETY: `module` was just loaded; the name is a static NUL-terminated string; `func` is
        // a valid out-pointer.
        let found = check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut func, module, FINGERPRINT_ENTRY.as_ptr())
        });
        if let Err(e) = found {
            // SAFETY: the module was loaded above and nothing uses it.
            let _ = check("cuModuleUnload", unsafe { sys::cuModuleUnload(module) });
            return Err(e);
        }
        Ok(FingerprintKernel {
            module,
            func,
            scratch: parking_lot::Mutex::new(Scratch::default()),
            results: (AtomicU64::new(0), AtomicU64::new(0)),
            ctx: ctx.clone(),
        })
    }

    /// Whether `[va, va + len)` overlaps the device memory the kernel's results go to: possum's
    /// own, which its own work rewrites (never the job's).
    pub fn owns(&self, va: u64, len: u64) -> bool {
        let start = self.results.0.load(Ordering::Acquire);
        let n = self.results.1.load(Ordering::Acquire);
        n > 0 && va < start.saturating_add(n) && start < va.saturating_add(len.max(1))
    }

    /// The lanes' sums `(lo, hi)` ([`possum_engine::fingerprint::sums`]) of each `chunk`-byte
    /// chunk of the `len` bytes at device address `base` (the last chunk shorter), computed on
    /// `stream` after the work queued there before: the results zeroed (`cuMemsetD8Async`), one
    /// launch per 65535 chunks, the results copied to pinned memory (`cuMemcpyDtoHAsync`), then
    /// waited for (an event recorded after the copy: the stream's work up to it, nobody else's).
    ///
    /// `base` and `chunk` must be multiples of 16 (the kernel reads 16 bytes at a time): else
    /// `InvalidAddress`, and nothing is queued. The range must be device memory mapped for the
    /// whole of it: the kernel reading an unmapped page faults the context (which the layer above
    /// keeps from happening in possum's own reservations). `stream` must not be capturing a graph.
    pub fn sums(
        &self,
        stream: &CudaStream,
        base: u64,
        len: u64,
        chunk: u64,
    ) -> DeviceResult<Vec<(u64, u64)>> {
        let invalid = |why| DeviceError::InvalidAddress {
            va: possum_engine::device::DevPtr(base),
            len,
            why,
        };
        if base % 16 != 0 || chunk == 0 || chunk % 16 != 0 {
            return Err(invalid(
                "a fingerprint's range and chunk must be aligned to 16 bytes",
            ));
        }
        if base.checked_add(len).is_none() {
            return Err(invalid("range wraps around the address space"));
        }
        if len == 0 {
            return Ok(Vec::new());
        }
        if stream.0.ctx.raw() != self.ctx.raw() {
            return Err(DeviceError::Backend {
                call: "cuLaunchKernel",
                code: CUresult::CUDA_ERROR_INVALID_CONTEXT as i64,
                message: "the stream is of another context than the fingerprint kernel's"
                    .to_string(),
            });
        }
        let chunks = len.div_ceil(chunk);
        let results = chunks
            .checked_mul(16)
            .ok_or_else(|| invalid("too many chunks"))?;
        let bytes = to_usize("cuMemAlloc_v2", results)?;
        self.ctx.bind()?;
        let mut scratch = self.scratch.lock();
        let out = scratch.device(&self.ctx, bytes)?;
        if let Some(m) = &scratch.out {
            self.results.0.store(m.ptr, Ordering::Release);
            self.results.1.store(m.len as u64, Ordering::Release);
        }
        let host = scratch.host(&self.ctx, bytes)?;
        if let Err(e) = self.launch(stream, base, len, chunk, chunks, out) {
            // Launches queued before the failure may still write the results.
            if stream.synchronize().is_err() {
                scratch.leak_device();
            }
            scratch.host = Some(host);
            return Err(e);
        }
        let copied = stream.copy_d2h(out, host, bytes).and_then(Transfer::wait);
        let host = match copied {
            Ok(h) => h,
            Err(e) => {
                // The copy has waited for the stream, or leaked the pinned buffer; the launches
                // before it are waited for here, or their results' buffer leaked too.
                if stream.synchronize().is_err() {
                    scratch.leak_device();
                }
                return Err(e);
            }
        };
        let sums = host.as_slice()[..bytes]
            .chunks_exact(16)
            .map(|s| {
                let word = |i: usize| {
                    u64::from_le_bytes(s[i..i + 8].try_into().expect("8 bytes of a 16-byte chunk"))
                };
                (word(0), word(8))
            })
            .collect();
        scratch.host = Some(host);
        Ok(sums)
    }

    /// Queues the zeroing of the results at `out` and the launches for `chunks` chunks.
    fn launch(
        &self,
        stream: &CudaStream,
        base: u64,
        len: u64,
        chunk: u64,
        chunks: u64,
        out: u64,
    ) -> DeviceResult<()> {
        stream.memset_d8(out, 0, chunks * 16)?;
        // Blocks per chunk, for the longest chunk there is (one block at least: it sums the
        // bytes after the last whole 16).
        let words = chunk.min(len) / 16;
        let per_block = u64::from(FP_THREADS) * FP_PER_THREAD;
        let blocks = u32::try_from(words.div_ceil(per_block).clamp(1, i32::MAX as u64))
            .expect("clamped to i32::MAX");
        let mut first = 0u64;
        while first < chunks {
            let n = (chunks - first).min(FP_MAX_CHUNKS);
            // The kernel's five 8-byte parameters: base, len, chunk, first, out + 16 * first.
            let mut args: [u64; 5] = [base, len, chunk, first, out + 16 * first];
            let mut params: [*mut c_void; 5] = [ptr::null_mut(); 5];
            for (p, a) in params.iter_mut().zip(args.iter_mut()) {
                *p = ptr::from_mut(a).cast();
            }
            // SAFETY: the library is loaded and has the entry point (`load` checked). `func` is
            // `possum_fingerprint` of the embedded PTX, whose parameters are five 8-byte values;
            // `params` points at five 8-byte locals that outlive the call (the driver copies the
            // values at the launch); no `extra`. The kernel reads device memory only (a bad
            // address faults the device, never host memory) and writes only the 16-byte results
            // of its chunks `first..first + n` (a block whose chunk starts past `len` returns),
            // all below `chunks`: inside the results buffer of at least `16 * chunks` bytes at
            // `out`, which stays allocated until this work is known complete (`sums`).
            check("cuLaunchKernel", unsafe {
                sys::cuLaunchKernel(
                    self.func,
                    blocks,
                    u32::try_from(n).expect("at most 65535"),
                    1,
                    FP_THREADS,
                    1,
                    1,
                    0,
                    stream.0.raw,
                    params.as_mut_ptr(),
                    ptr::null_mut(),
                )
            })?;
            first += n;
        }
        Ok(())
    }
}

impl Drop for FingerprintKernel {
    fn drop(&mut self) {
        // Every launch was waited for, unless a results' buffer was leaked: then the module is
        // left loaded as well.
        if !self.scratch.get_mut().leaked && self.ctx.bind().is_ok() {
            let _ = call!(cuModuleUnload(self.module));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::SYMBOLS;

    #[test]
    fn the_fingerprint_ptx_is_embedded_whole() {
        let ptx = FINGERPRINT_PTX.to_str().unwrap();
        assert!(
            ptx.contains(".entry possum_fingerprint("),
            "the kernel's entry point"
        );
        assert!(
            ptx.trim_end().ends_with('}'),
            "the PTX ends with the kernel's body"
        );
        // The PTX ISA the driver needs: 7.0 (CUDA 11.0), as scripts/gpu-fingerprint.sh writes.
        assert!(ptx.contains("\n.version 7.0\n"), "PTX ISA 7.0");
        // Five 8-byte parameters, as `FingerprintKernel::launch` passes them.
        assert_eq!(
            ptx.matches(".param .u64 possum_fingerprint_param_").count(),
            5
        );
        assert!(!ptx.contains("possum_fingerprint_param_5"));
        assert_eq!(FINGERPRINT_ENTRY.to_str().unwrap(), "possum_fingerprint");
    }

    #[test]
    fn the_kernels_entry_points_are_looked_up_apart() {
        for (name, missing) in FINGERPRINT_SYMBOLS {
            assert!(
                !SYMBOLS.contains(name),
                "{name} would make the whole driver unusable"
            );
            assert!(missing.ends_with(name), "{missing}");
        }
        assert!(!has_symbol("cuNoSuchEntryPoint"));
        assert_eq!(scratch_len(1), FP_MIN_SCRATCH);
        assert_eq!(scratch_len(FP_MIN_SCRATCH + 1), 2 * FP_MIN_SCRATCH);
    }
}
