//! The unsafe layer towards CUPTI: one of the crate's modules with `unsafe` code (with `load`,
//! `exit`, `entry`, `decode`, `cudart`, `drvalloc` and `park_sys`).
//!
//! - CUPTI is loaded with `dlopen` (libloading) at run time and never unloaded; only the three
//!   functions used are looked up. Nothing of CUDA is needed to build or to load the library.
//! - The CUPTI callback, which reads the fields of `CUpti_CallbackData` it needs, counts the call
//!   ([`crate::process::stats::record`]) and hands it, wrapped in a [`crate::cuda::decode::RawCall`], to the safe
//!   [`crate::ops::hooks::on_call`].
//!
//! Everything here is safe to call.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::OnceLock;

use libloading::Library;

/// `CUptiResult`; 0 is `CUPTI_SUCCESS`.
type CuptiResult = c_int;
/// `CUpti_SubscriberHandle`: an opaque pointer.
type SubscriberHandle = *mut c_void;
/// `CUpti_CallbackFunc`.
type CallbackFunc =
    unsafe extern "C" fn(userdata: *mut c_void, domain: u32, cbid: u32, cbdata: *const c_void);

/// `CUPTI_CB_DOMAIN_DRIVER_API` (`CUpti_CallbackDomain`, cupti_callbacks.h).
const DOMAIN_DRIVER_API: u32 = 1;
/// `CUPTI_API_ENTER` (`CUpti_ApiCallbackSite`, cupti_callbacks.h).
const API_ENTER: u32 = 0;
/// `CUPTI_CB_DOMAIN_RESOURCE` (`CUpti_CallbackDomain`).
const DOMAIN_RESOURCE: u32 = 3;
/// `CUPTI_CBID_RESOURCE_MODULE_LOADED` (`CUpti_CallbackIdResource`).
const CBID_MODULE_LOADED: u32 = 6;

/// `CUpti_ResourceData` (cupti_callbacks.h, CUDA 13.0, as cudarc 0.19.10 lays it out): the
/// callback data of the resource domain. Only `resource_descriptor` is read.
#[repr(C)]
#[allow(dead_code)]
struct ResourceData {
    /// `CUcontext context`.
    context: *mut c_void,
    /// `union { CUstream stream; } resourceHandle`.
    resource_handle: u64,
    /// `void *resourceDescriptor`: for module events a `CUpti_ModuleResourceData *`.
    resource_descriptor: *mut c_void,
}

/// `CUpti_ModuleResourceData`: the module a `MODULE_LOADED` callback is about.
#[repr(C)]
#[allow(dead_code)]
struct ModuleResourceData {
    /// `uint32_t moduleId`.
    module_id: u32,
    /// `size_t cubinSize`.
    cubin_size: usize,
    /// `const char *pCubin`: the module's image, valid during the callback.
    p_cubin: *const c_char,
}

/// `CUpti_CallbackData` from cupti_callbacks.h (CUDA 13.0; unchanged since CUDA 11), as cudarc
/// 0.19.10's bindgen output of that header lays it out. Only `callback_site`, `function_params`,
/// `function_return_value` and `context` are read; the rest is here to keep the layout right.
#[repr(C)]
#[allow(dead_code)]
struct CallbackData {
    /// `CUpti_ApiCallbackSite callbackSite` (a C enum: 32 bits).
    callback_site: u32,
    /// `const char *functionName`.
    function_name: *const c_char,
    /// `const void *functionParams`: points at the call's `cu<name>_params` struct.
    function_params: *const c_void,
    /// `void *functionReturnValue`.
    function_return_value: *mut c_void,
    /// `const char *symbolName`.
    symbol_name: *const c_char,
    /// `CUcontext context`.
    context: *mut c_void,
    /// `uint32_t contextUid`.
    context_uid: u32,
    /// `uint64_t *correlationData`.
    correlation_data: *mut u64,
    /// `uint32_t correlationId`.
    correlation_id: u32,
}

type SubscribeFn =
    unsafe extern "C" fn(*mut SubscriberHandle, CallbackFunc, *mut c_void) -> CuptiResult;
type EnableCallbackFn = unsafe extern "C" fn(u32, SubscriberHandle, u32, u32) -> CuptiResult;
type GetResultStringFn = unsafe extern "C" fn(CuptiResult, *mut *const c_char) -> CuptiResult;
type UnsubscribeFn = unsafe extern "C" fn(SubscriberHandle) -> CuptiResult;
type FinalizeFn = unsafe extern "C" fn() -> CuptiResult;

/// A loaded CUPTI: the library (kept loaded for the life of the process) and the functions used.
#[derive(Debug)]
pub struct Cupti {
    _lib: Library,
    subscribe: SubscribeFn,
    enable_callback: EnableCallbackFn,
    get_result_string: GetResultStringFn,
    /// Optional: only a detach (for NVIDIA's driver checkpoint) needs them.
    unsubscribe: Option<UnsubscribeFn>,
    finalize: Option<FinalizeFn>,
    /// The current subscription (none while detached).
    subscribed: parking_lot::Mutex<Option<Subscriber>>,
}

/// A CUPTI subscription, with this crate's [`callback`] as its callback (ended only by
/// [`Cupti::detach`]).
#[derive(Debug, Clone, Copy)]
pub struct Subscriber(SubscriberHandle);

// SAFETY: a `CUpti_SubscriberHandle` is an opaque token CUPTI accepts from any thread.
unsafe impl Send for Subscriber {}
// SAFETY: as above; this crate never dereferences it.
unsafe impl Sync for Subscriber {}

static CUPTI: OnceLock<Cupti> = OnceLock::new();

impl Cupti {
    /// Loads CUPTI from the first of `candidates` (`dlopen` names or paths) that loads and has the
    /// functions used. `Ok` gives the library and the candidate that worked; `Err` lists why each
    /// failed. Later calls return the library the first successful call loaded.
    pub fn load(candidates: &[String]) -> Result<(&'static Cupti, String), CuptiError> {
        if let Some(c) = CUPTI.get() {
            return Ok((c, "(already loaded)".into()));
        }
        let mut why = Vec::new();
        for name in candidates {
            match Self::open(name) {
                Ok(c) => return Ok((CUPTI.get_or_init(|| c), name.clone())),
                Err(e) => why.push(format!("{name}: {}", possum_cuda::error_chain(&e))),
            }
        }
        Err(CuptiError::NotLoaded(why))
    }

    fn open(name: &str) -> Result<Cupti, libloading::Error> {
        // SAFETY: loading CUPTI runs its initialisers, which have no preconditions (CUPTI is made
        // to be loaded into any CUDA process, by profilers as well as by the application).
        let lib = unsafe { Library::new(name) }?;
        // SAFETY: the types are those of cupti_callbacks.h / cupti_result.h (CUDA 13.0):
        // `CUptiResult cuptiSubscribe(CUpti_SubscriberHandle*, CUpti_CallbackFunc, void*)`,
        // `CUptiResult cuptiEnableCallback(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain,
        // CUpti_CallbackId)` and `CUptiResult cuptiGetResultString(CUptiResult, const char**)`.
        // The pointers are copied out; `lib` is stored beside them and never dropped before them.
        unsafe {
            let subscribe = *lib.get::<SubscribeFn>(b"cuptiSubscribe\0")?;
            let enable_callback = *lib.get::<EnableCallbackFn>(b"cuptiEnableCallback\0")?;
            let get_result_string = *lib.get::<GetResultStringFn>(b"cuptiGetResultString\0")?;
            let unsubscribe = lib
                .get::<UnsubscribeFn>(b"cuptiUnsubscribe\0")
                .ok()
                .map(|f| *f);
            let finalize = lib.get::<FinalizeFn>(b"cuptiFinalize\0").ok().map(|f| *f);
            Ok(Cupti {
                _lib: lib,
                subscribe,
                enable_callback,
                get_result_string,
                unsubscribe,
                finalize,
                subscribed: parking_lot::Mutex::new(None),
            })
        }
    }

    /// CUPTI's name for result code `r`.
    fn describe(&self, r: CuptiResult) -> String {
        let mut s: *const c_char = ptr::null();
        // SAFETY: `s` is a valid out-pointer; the library is loaded for the life of the process.
        let ok = unsafe { (self.get_result_string)(r, &mut s) };
        if ok != 0 || s.is_null() {
            return format!("CUptiResult {r}");
        }
        // SAFETY: on success CUPTI points `s` at a static NUL-terminated string.
        let name = unsafe { CStr::from_ptr(s) }.to_string_lossy();
        format!("{name} ({r})")
    }

    /// Ends the subscription made by [`Cupti::attach`] (and with `finalize`, detaches CUPTI
    /// from the process): NVIDIA's driver checkpoint refuses a process CUPTI is attached to.
    pub fn detach(&self, finalize: bool) -> Result<(), CuptiError> {
        let Some(sub) = self.subscribed.lock().take() else {
            return Ok(());
        };
        if let Some(unsubscribe) = self.unsubscribe {
            // SAFETY: `sub` is the live handle cuptiSubscribe returned; taken out of `subscribed`,
            // so it is unsubscribed once.
            let r = unsafe { unsubscribe(sub.0) };
            if r != 0 {
                return Err(self.failed("cuptiUnsubscribe", r));
            }
        }
        if finalize {
            let f = self.finalize.ok_or(CuptiError::NoFinalize)?;
            // SAFETY: no argument; no subscriber is left.
            let r = unsafe { f() };
            if r != 0 {
                return Err(self.failed("cuptiFinalize", r));
            }
        }
        Ok(())
    }

    /// Whether a subscription is live.
    pub fn attached(&self) -> bool {
        self.subscribed.lock().is_some()
    }

    /// Subscribes and enables `cbids` (at start, and again after a [`Cupti::detach`]).
    pub fn attach(
        &self,
        cbids: impl Iterator<Item = u32>,
    ) -> (Result<Subscriber, CuptiError>, Vec<String>) {
        let mut failed = Vec::new();
        let mut cur = self.subscribed.lock();
        if let Some(s) = *cur {
            return (Ok(s), failed);
        }
        let sub = match self.subscribe() {
            Ok(s) => s,
            Err(e) => return (Err(e), failed),
        };
        for id in cbids {
            if let Err(e) = self.enable(sub, id) {
                let name = crate::cuda::cbid::lookup(id).map_or("?", |c| c.name);
                failed.push(format!("{name} ({id}): {e}"));
            }
        }
        // Loaded modules' images: the parameter layouts of kernels the driver cannot describe.
        // SAFETY: as in `enable`, for the resource domain.
        let r = unsafe { (self.enable_callback)(1, sub.0, DOMAIN_RESOURCE, CBID_MODULE_LOADED) };
        if r != 0 {
            failed.push(format!(
                "module loads (resource {CBID_MODULE_LOADED}): {}",
                self.describe(r)
            ));
        }
        *cur = Some(sub);
        (Ok(sub), failed)
    }

    /// The loaded CUPTI, if any.
    pub fn get() -> Option<&'static Cupti> {
        CUPTI.get()
    }

    /// Subscribes [`callback`]. Fails if another subscriber exists (CUPTI allows one per process:
    /// a profiler that uses CUPTI, Kineto included, then can't subscribe after possum).
    fn subscribe(&self) -> Result<Subscriber, CuptiError> {
        let mut h: SubscriberHandle = ptr::null_mut();
        // SAFETY: `h` is a valid out-pointer; `callback` has the `CUpti_CallbackFunc` signature,
        // never unwinds, and ignores its (null) userdata.
        let r = unsafe { (self.subscribe)(&mut h, callback, ptr::null_mut()) };
        if r != 0 {
            return Err(self.failed("cuptiSubscribe", r));
        }
        Ok(Subscriber(h))
    }

    /// Enables the driver-API callback `cbid` for `sub`.
    pub fn enable(&self, sub: Subscriber, cbid: u32) -> Result<(), CuptiError> {
        // SAFETY: `sub` came from a successful `cuptiSubscribe` of this library; CUPTI validates
        // `cbid` and returns an error for an unknown one.
        let r = unsafe { (self.enable_callback)(1, sub.0, DOMAIN_DRIVER_API, cbid) };
        if r != 0 {
            return Err(CuptiError::Refused(self.describe(r)));
        }
        Ok(())
    }

    /// CUPTI's function `call` answered `r`.
    fn failed(&self, call: &'static str, r: CuptiResult) -> CuptiError {
        CuptiError::Call {
            call,
            result: self.describe(r),
        }
    }
}

/// Why CUPTI could not be loaded, attached or detached.
#[derive(Debug, thiserror::Error)]
pub enum CuptiError {
    /// No candidate loaded: why each failed ("name: why").
    #[error("{}", .0.join("; "))]
    NotLoaded(Vec<String>),
    /// A CUPTI function failed.
    #[error("{call}: {result}")]
    Call {
        /// The function.
        call: &'static str,
        /// CUPTI's name for its result.
        result: String,
    },
    /// CUPTI refused to enable a callback: its name for the result.
    #[error("{0}")]
    Refused(String),
    /// A detach with `finalize` of a CUPTI without it.
    #[error("this CUPTI has no cuptiFinalize")]
    NoFinalize,
    /// Attached again, these callbacks were refused although they were enabled at start.
    #[error("callbacks not enabled again: {}", .0.join(", "))]
    NotEnabledAgain(Vec<String>),
}

/// The CUPTI callback. Runs on the thread making the driver call, inside that call, on its entry
/// and on its exit.
unsafe extern "C" fn callback(
    _userdata: *mut c_void,
    domain: u32,
    cbid: u32,
    cbdata: *const c_void,
) {
    if cbdata.is_null() {
        return;
    }
    if domain == DOMAIN_RESOURCE && cbid == CBID_MODULE_LOADED {
        // SAFETY: for the resource domain CUPTI passes a `const CUpti_ResourceData*`, valid for
        // the callback; for a module event its descriptor is a `CUpti_ModuleResourceData*`.
        let m = unsafe { (*cbdata.cast::<ResourceData>()).resource_descriptor }
            .cast_const()
            .cast::<ModuleResourceData>();
        if m.is_null() {
            return;
        }
        // SAFETY: `m` is valid for the callback (above).
        let (p, n) = unsafe { ((*m).p_cubin, (*m).cubin_size) };
        if !p.is_null() && n > 0 {
            // SAFETY: CUPTI says `p` holds the module's `n`-byte image during the callback; the
            // slice does not outlive it (the layouts are copied out).
            let image = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), n) };
            let _ = catch_unwind(|| crate::ops::hooks::module_loaded(image));
        }
        return;
    }
    if domain != DOMAIN_DRIVER_API {
        return;
    }
    let data = cbdata.cast::<CallbackData>();
    // SAFETY: for the driver-API domain CUPTI passes a `const CUpti_CallbackData*`, valid for the
    // duration of the callback; `CallbackData` has its layout.
    let (site, params, ret, ctx) = unsafe {
        (
            (*data).callback_site,
            (*data).function_params,
            (*data).function_return_value,
            (*data).context,
        )
    };
    let enter = site == API_ENTER;
    // SAFETY: `params` is this callback id's `cu<name>_params` struct and `ret` its `CUresult`,
    // both valid during the callback, which outlives the `RawCall`.
    let call = unsafe { crate::cuda::decode::RawCall::new(params, ret.cast_const()) };
    // A panic must not unwind into CUPTI.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        crate::ops::hooks::on_call(enter, cbid, ctx as usize as u64, &call)
    }));
}
