//! The op gate's pause: where a checkpoint holds the job's GPU operations.
//!
//! Acts on the session's pause ([`crate::session::state::Pause`]: set by a checkpoint
//! session's release, cleared at its resume): the waiting it imposes on the job's threads
//! ([`wait_if_paused`], [`admit`]) and the counts of those waits. The hooks and the allocators
//! call it before each operation; the session (`session/checkpoint.rs`) sets and clears it.
//!
//! Invariant: while paused, no thread of the job enters an operation (the pause is checked first,
//! and again inside the engine's gate), so the job never touches a released buffer.
//!
//! Also the writing driver functions the job got unwrapped ([`note_unwrapped_writer`]), and the
//! faults of the write path ([`note_fault`]): an error or a panic in a hook, after which
//! the operation runs although its buffers may not have been saved or marked written. The session
//! counts them from a checkpoint's start to its commit, and a checkpoint that saw one is undone
//! (no image; the job runs on): it fails closed.

use std::sync::atomic::Ordering;
use std::time::Instant;

use possum_cuda::CudaDevice;
use possum_engine::device::Device;
use possum_engine::{Engine, OpGuard};

use crate::process::runtime::DevEngine;
use crate::session::state::session;

/// Notes that the job got the writing driver function `what` unwrapped (each one logged once).
pub fn note_unwrapped_writer(what: String) {
    let mut u = session().unwrapped.lock();
    if u.contains(&what) || u.len() >= 64 {
        return;
    }
    crate::base::log::log(&format!(
        "the job took {what}, a driver function that writes device memory, without possum's \
         wrapper: checkpoints hold its threads for the whole copy"
    ));
    u.push(what);
}

/// The writing driver functions the job got unwrapped ([`note_unwrapped_writer`]).
pub fn unwrapped_writers() -> Vec<String> {
    session().unwrapped.lock().clone()
}

/// Notes a fault of the write path: an operation goes on (or went on) although the hook could
/// not do its part for it. A checkpoint open now is not committed.
pub fn note_fault(what: &str) {
    let f = &session().faults;
    *f.last.lock() = Some(what.to_string());
    f.count.fetch_add(1, Ordering::SeqCst);
    crate::base::log::log(&format!("fault on the write path: {what}"));
}

/// Faults of the write path so far, and the last one's description.
pub fn faults() -> (u64, Option<String>) {
    let f = &session().faults;
    (f.count.load(Ordering::SeqCst), f.last.lock().clone())
}

/// Blocks the calling thread while the job is paused (one atomic load when it is not).
#[inline]
pub fn wait_if_paused() {
    if session().pause.paused.load(Ordering::Acquire) {
        wait_slow();
    }
}

/// Enters `e`'s op gate for an operation or an allocation of the job, never while the job is
/// paused. A thread that passed [`wait_if_paused`] just before a pause began, and reaches the gate
/// after the T0 that pause fixed (the session closes the gate for it), backs out and waits: what
/// the job does after T0 must not reach the engine until the resume (an allocation made then
/// would be released without being in the image; a launch would run on after T0 while the job
/// is held). One that entered before the gate closed is waited for, and so is before T0.
/// Hold the guard until the operation is enqueued or the buffer made; the caller must not be
/// inside the gate already (so no [`possum_engine::Engine::free`] while holding it).
#[inline]
pub fn admit(e: &DevEngine) -> OpGuard<'_, CudaDevice> {
    admit_engine(&e.engine)
}

/// [`admit`] for any engine (the HIP front end's too).
#[inline]
pub fn admit_engine<D: Device>(engine: &Engine<D>) -> OpGuard<'_, D> {
    loop {
        wait_if_paused();
        let g = engine.enter_op();
        // SeqCst, as the gate's own operations: a thread that found the gate open after the
        // session closed it (and opened it again) finds the pause that came before.
        if !session().pause.paused.load(Ordering::SeqCst) {
            return g;
        }
        drop(g);
    }
}

#[cold]
fn wait_slow() {
    let t = Instant::now();
    let p = &session().pause;
    let mut g = p.lock.lock();
    while p.paused.load(Ordering::Acquire) {
        p.resumed.wait(&mut g);
    }
    p.waits.fetch_add(1, Ordering::Relaxed);
    crate::base::add_elapsed_ns(&p.wait_ns, t);
}

/// Pauses the job's operations, or lets them go on (waking those that wait).
pub fn set_paused(p: bool) {
    let pause = &session().pause;
    let _g = pause.lock.lock();
    pause.paused.store(p, Ordering::SeqCst);
    if !p {
        pause.resumed.notify_all();
    }
}

/// Whether the job's operations are paused now.
pub fn is_paused() -> bool {
    session().pause.paused.load(Ordering::Acquire)
}

/// Operations that waited for a resume, and for how long in total (ns).
pub fn waits() -> (u64, u64) {
    let p = &session().pause;
    (
        p.waits.load(Ordering::Relaxed),
        p.wait_ns.load(Ordering::Relaxed),
    )
}
