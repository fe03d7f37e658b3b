//! The HIP front end: the same interposer for a job on AMD's HIP runtime.
//!
//! libpossum.so exports the HIP runtime's allocation, launch, copy, memset, graph-launch,
//! module and lookup entry points beside the CUDA driver's (`entry.rs`, the unsafe layer); a job
//! that never calls HIP never reaches them. At the job's first HIP call that needs it, the
//! front end (`front.rs`) opens an engine over the job's own runtime (`possum_hip::HipDevice`,
//! found as the library defining the `hipMalloc` after this one), and the control socket starts
//! (`through.rs`), its status saying `runtime: "hip"`. From then on:
//!
//! - `hipMalloc`, `hipMallocAsync` and `hipMallocFromPoolAsync` on the first device are served
//!   as engine buffers (VA-stable, releasable); frees wait for the work queued before them.
//!   Memory the job makes otherwise (its own `hipMemMap`s, `hipMallocManaged`, another device)
//!   is recorded, and a checkpoint refuses the job while it has any.
//! - Every launch, copy, memset and graph launch passes the op gate and the engine's hook
//!   first. A kernel's pointer arguments come from its code object's metadata (read when a
//!   module is loaded or a fat binary registered: `possum_analyzer::amdgpu`); each engine
//!   buffer one points into is taken as written (its read-only hints are not trusted). A kernel
//!   whose layout is unknown, and every graph launch, is taken to write every buffer.
//! - The control socket's checkpoint requests go to `session.rs`: the front end, once made,
//!   registers its handler with the socket (`crate::session::control::set_front_end`), so the socket
//!   names no HIP module.
//!
//! The modules form layers, from the top: `entry.rs` (the exported functions and the lookup of
//! a wrapper), `writers.rs` (the other writing functions) and `hsa.rs`; `through.rs` (what the
//! wrappers share: the runtime's functions, the front end found on first use, the hook around
//! a copy or launch); `session.rs` (the control requests); `front.rs` (the state).

/// The slot where the runtime's function is kept once looked up (`through::real`).
macro_rules! slot {
    ($vis:vis $slot:ident) => {
        $vis static $slot: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    };
}

/// Calls the runtime's function `$name` (kept in `$slot`) of type `$ty` with the arguments;
/// `hipErrorNotSupported` when the runtime has no such function.
macro_rules! call_real {
    ($slot:ident, $name:literal, $ty:ty, $($arg:expr),*) => {{
        let p = real(&$slot, $name);
        if p == 0 {
            NOT_SUPPORTED
        } else {
            // SAFETY: `p` is the runtime's exported function of that name, whose C signature
            // (hip_runtime_api.h) is `$ty`; the arguments are the caller's, passed on.
            #[allow(unused_unsafe)]
            let r = unsafe { std::mem::transmute::<usize, $ty>(p)($($arg),*) };
            r
        }
    }};
}

/// A launch of host stub `$stub` with kernel arguments `$args` on `$stream`, passed through the
/// hook (`through::launch_through`) to the runtime's function, called as [`call_real`] does with
/// the arguments after the `;`.
macro_rules! launch_stub {
    ($slot:ident, $name:literal, $ty:ty, $stub:expr, $stream:expr, $args:expr; $($arg:expr),*) => {
        launch_through($stub as usize, $stream as usize, $args, std::ptr::null_mut(), || {
            call_real!($slot, $name, $ty, $($arg),*)
        })
    };
}

/// The wrapper among the functions `$f` named `$name` (bytes), as `Option<*const ()>`.
macro_rules! wrapper_of {
    ($name:expr; $($f:ident),* $(,)?) => {
        match $name {
            $(n if n == stringify!($f).as_bytes() => Some($f as *const ()),)*
            _ => None,
        }
    };
}

pub mod entry;
pub mod front;
#[cfg(target_arch = "x86_64")]
pub mod hsa;
pub mod session;
pub mod through;
pub mod writers;
