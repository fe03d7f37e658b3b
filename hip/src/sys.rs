//! The unsafe bottom layer: HIP's C types, and the entry points possum calls, looked up in a
//! HIP runtime loaded from a path (`libamdhip64.so.6` or `.so.7` on a machine with ROCm, the
//! simulated runtime in tests).
//!
//! Nothing here calls HIP. [`Api::load`] opens the library and looks up every symbol of
//! [`SYMBOLS`] at once, so that a library lacking one is a [`LoadError`] before anything runs,
//! never a failure in the middle of a checkpoint. The function pointers stay valid as long as
//! the [`Api`] that holds them (it owns the library). Calling them is `unsafe`: [`crate::result`]
//! does, with the arguments each call documents.
//!
//! Types are HIP's as `hip_runtime_api.h` declares them; names keep HIP's spelling so they can be
//! grepped for.
#![allow(
    unsafe_code,
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals
)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::fmt;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// `hipError_t`: 0 is success.
pub type hipError_t = c_int;
/// `hipSuccess`.
pub const hipSuccess: hipError_t = 0;
/// `hipErrorInvalidValue`.
pub const hipErrorInvalidValue: hipError_t = 1;
/// `hipErrorOutOfMemory`.
pub const hipErrorOutOfMemory: hipError_t = 2;
/// `hipErrorNotReady`: an event or stream query's "not yet".
pub const hipErrorNotReady: hipError_t = 600;

/// `hipStream_t`: an opaque handle; null is the null (default) stream.
pub type hipStream_t = *mut c_void;
/// `hipEvent_t`: an opaque handle.
pub type hipEvent_t = *mut c_void;
/// `hipMemGenericAllocationHandle_t`: physical memory made by `hipMemCreate`.
pub type hipMemGenericAllocationHandle_t = *mut c_void;
/// `hipDevice_t`: a device ordinal.
pub type hipDevice_t = c_int;

/// `hipMemcpyKind` values.
pub type hipMemcpyKind = c_int;
/// `hipMemcpyHostToDevice`.
pub const hipMemcpyHostToDevice: hipMemcpyKind = 1;
/// `hipMemcpyDeviceToHost`.
pub const hipMemcpyDeviceToHost: hipMemcpyKind = 2;
/// `hipMemcpyDeviceToDevice`.
pub const hipMemcpyDeviceToDevice: hipMemcpyKind = 3;

/// `hipStreamNonBlocking`: the stream does not synchronise with the null stream.
pub const hipStreamNonBlocking: c_uint = 0x1;
/// `hipEventBlockingSync`: a thread waiting for the event sleeps instead of spinning.
pub const hipEventBlockingSync: c_uint = 0x1;
/// `hipEventDisableTiming`: the event records no time stamp (cheaper).
pub const hipEventDisableTiming: c_uint = 0x2;
/// `hipHostMallocDefault`.
pub const hipHostMallocDefault: c_uint = 0x0;

/// `hipMemAllocationTypePinned`.
pub const hipMemAllocationTypePinned: c_int = 0x1;
/// `hipMemHandleTypeNone`.
pub const hipMemHandleTypeNone: c_int = 0x0;
/// `hipMemLocationTypeDevice`.
pub const hipMemLocationTypeDevice: c_int = 1;
/// `hipMemAccessFlagsProtReadWrite`.
pub const hipMemAccessFlagsProtReadWrite: c_int = 3;
/// `hipMemAllocationGranularityMinimum`.
pub const hipMemAllocationGranularityMinimum: c_int = 0x0;
/// `hipMemAllocationGranularityRecommended`.
pub const hipMemAllocationGranularityRecommended: c_int = 0x1;

/// `hipMemLocation`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipMemLocation {
    /// `hipMemLocationType`.
    pub type_: c_int,
    /// The device ordinal.
    pub id: c_int,
}

/// The `allocFlags` member of [`hipMemAllocationProp`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct hipMemAllocationFlags {
    /// `compressionType`.
    pub compressionType: u8,
    /// `gpuDirectRDMACapable`.
    pub gpuDirectRDMACapable: u8,
    /// `usage`.
    pub usage: u16,
}

/// `hipMemAllocationProp`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipMemAllocationProp {
    /// `hipMemAllocationType`.
    pub type_: c_int,
    /// `hipMemAllocationHandleType` (the union of `requestedHandleType(s)`).
    pub requestedHandleType: c_int,
    /// Where the memory lives.
    pub location: hipMemLocation,
    /// Windows only; null.
    pub win32HandleMetaData: *mut c_void,
    /// `allocFlags`.
    pub allocFlags: hipMemAllocationFlags,
}

/// `hipMemAccessDesc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipMemAccessDesc {
    /// The device given access.
    pub location: hipMemLocation,
    /// `hipMemAccessFlags`.
    pub flags: c_int,
}

/// Why a HIP runtime could not be loaded.
#[derive(Debug, Error)]
pub enum LoadError {
    /// `dlopen` failed: no file there, or not a loadable library.
    #[error("cannot load the HIP runtime {}: {source}", path.display())]
    Open {
        /// The path given.
        path: PathBuf,
        /// The loader's answer.
        #[source]
        source: libloading::Error,
    },
    /// The library loaded but lacks an entry point possum calls (not a HIP runtime, or one
    /// too old).
    #[error("{} is not a HIP runtime possum can use: it has no {symbol}", path.display())]
    MissingSymbol {
        /// The path given.
        path: PathBuf,
        /// The first symbol of [`SYMBOLS`] it lacks.
        symbol: &'static str,
    },
}

macro_rules! api {
    ($($name:ident: fn($($arg:ty),* $(,)?) $(-> $ret:ty)?;)*) => {
        /// The runtime's entry points possum calls, each looked up once, with the library that
        /// holds them.
        pub struct Api {
            $(
                #[doc = concat!("`", stringify!($name), "`.")]
                pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,
            )*
            /// Owns the mapping the pointers above point into; dropped last.
            path: PathBuf,
            _lib: libloading::Library,
        }

        /// Every entry point [`Api::load`] looks up.
        pub const SYMBOLS: &[&str] = &[$(stringify!($name)),*];

        impl Api {
            /// Loads the HIP runtime at `path` (as given to `dlopen`: a bare name is searched
            /// for on the library path) and looks up every entry point of [`SYMBOLS`].
            ///
            /// Loading a library runs its initialisers: `path` must be a HIP runtime (or the
            /// simulated one), as it is for every caller of this crate.
            pub fn load(path: impl AsRef<Path>) -> Result<Api, LoadError> {
                let path = path.as_ref().to_path_buf();
                // SAFETY: loading runs the library's initialisers; the library is a HIP
                // runtime by this function's contract, whose initialisers have no
                // preconditions on this process.
                let lib = unsafe { libloading::Library::new(&path) }.map_err(|source| {
                    LoadError::Open { path: path.clone(), source }
                })?;
                $(
                    // SAFETY: the symbol's type is the one HIP's header declares for it; the
                    // pointer is copied out and used only while `lib` (moved into the `Api`
                    // below, which outlives every use) stays loaded.
                    let $name = *unsafe {
                        lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(
                            concat!(stringify!($name), "\0").as_bytes(),
                        )
                    }
                    .map_err(|_| LoadError::MissingSymbol {
                        path: path.clone(),
                        symbol: stringify!($name),
                    })?;
                )*
                Ok(Api { $($name,)* path, _lib: lib })
            }

            /// The path the library was loaded from.
            pub fn path(&self) -> &Path {
                &self.path
            }
        }
    };
}

api! {
    hipInit: fn(c_uint) -> hipError_t;
    hipGetDeviceCount: fn(*mut c_int) -> hipError_t;
    hipSetDevice: fn(c_int) -> hipError_t;
    hipGetDevice: fn(*mut c_int) -> hipError_t;
    hipDeviceGetName: fn(*mut c_char, c_int, hipDevice_t) -> hipError_t;
    hipGetErrorName: fn(hipError_t) -> *const c_char;
    hipGetErrorString: fn(hipError_t) -> *const c_char;
    hipDeviceSynchronize: fn() -> hipError_t;
    hipDeviceGetStreamPriorityRange: fn(*mut c_int, *mut c_int) -> hipError_t;
    hipMemGetInfo: fn(*mut usize, *mut usize) -> hipError_t;
    hipMemGetAllocationGranularity: fn(*mut usize, *const hipMemAllocationProp, c_int) -> hipError_t;
    hipMemAddressReserve: fn(*mut *mut c_void, usize, usize, *mut c_void, c_ulonglong) -> hipError_t;
    hipMemAddressFree: fn(*mut c_void, usize) -> hipError_t;
    hipMemCreate: fn(*mut hipMemGenericAllocationHandle_t, usize, *const hipMemAllocationProp, c_ulonglong) -> hipError_t;
    hipMemRelease: fn(hipMemGenericAllocationHandle_t) -> hipError_t;
    hipMemMap: fn(*mut c_void, usize, usize, hipMemGenericAllocationHandle_t, c_ulonglong) -> hipError_t;
    hipMemUnmap: fn(*mut c_void, usize) -> hipError_t;
    hipMemSetAccess: fn(*mut c_void, usize, *const hipMemAccessDesc, usize) -> hipError_t;
    hipHostMalloc: fn(*mut *mut c_void, usize, c_uint) -> hipError_t;
    hipHostFree: fn(*mut c_void) -> hipError_t;
    hipStreamCreateWithPriority: fn(*mut hipStream_t, c_uint, c_int) -> hipError_t;
    hipStreamGetPriority: fn(hipStream_t, *mut c_int) -> hipError_t;
    hipStreamDestroy: fn(hipStream_t) -> hipError_t;
    hipStreamSynchronize: fn(hipStream_t) -> hipError_t;
    hipStreamWaitEvent: fn(hipStream_t, hipEvent_t, c_uint) -> hipError_t;
    hipEventCreateWithFlags: fn(*mut hipEvent_t, c_uint) -> hipError_t;
    hipEventRecord: fn(hipEvent_t, hipStream_t) -> hipError_t;
    hipEventQuery: fn(hipEvent_t) -> hipError_t;
    hipEventSynchronize: fn(hipEvent_t) -> hipError_t;
    hipEventDestroy: fn(hipEvent_t) -> hipError_t;
    hipMemcpyAsync: fn(*mut c_void, *const c_void, usize, hipMemcpyKind, hipStream_t) -> hipError_t;
    hipMemsetAsync: fn(*mut c_void, c_int, usize, hipStream_t) -> hipError_t;
}

impl fmt::Debug for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Api")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// The simulated runtime's own test hooks (not HIP's): what it lets a test observe.
pub struct SimHooks {
    /// `fakeHipCopiesAtPriority(priority)`: the `hipMemcpyAsync` calls queued so far on streams
    /// of that priority.
    pub fakeHipCopiesAtPriority: unsafe extern "C" fn(c_int) -> u64,
    _lib: libloading::Library,
}

impl SimHooks {
    /// Loads the simulated runtime at `path` (the same library a [`Api`] of the same path
    /// shares: `dlopen` loads a library once) and looks its hooks up.
    ///
    /// `path` must be the simulated runtime (its initialisers run if it is not loaded yet).
    pub fn load(path: impl AsRef<Path>) -> Result<SimHooks, LoadError> {
        let path = path.as_ref().to_path_buf();
        // SAFETY: as in `Api::load`: the library is the simulated runtime by this function's
        // contract.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|source| LoadError::Open {
            path: path.clone(),
            source,
        })?;
        // SAFETY: the type is the one fake-libamdhip64.c defines; the pointer is used only
        // while `lib` (moved into the value returned) stays loaded.
        let copies =
            *unsafe { lib.get::<unsafe extern "C" fn(c_int) -> u64>(b"fakeHipCopiesAtPriority\0") }
                .map_err(|_| LoadError::MissingSymbol {
                    path: path.clone(),
                    symbol: "fakeHipCopiesAtPriority",
                })?;
        Ok(SimHooks {
            fakeHipCopiesAtPriority: copies,
            _lib: lib,
        })
    }
}

impl fmt::Debug for SimHooks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimHooks").finish_non_exhaustive()
    }
}
