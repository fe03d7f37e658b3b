//! The op gate: makes "before T0" and "after T0" well defined for a job that never stops launching.
//!
//! The job's thread enters the gate when the hook is called for an operation and leaves it once the
//! operation is enqueued on its stream. Closing the gate waits for operations between those two
//! points, so when `begin` records its fence on a job stream, every operation the hook has seen is
//! already enqueued before the fence, and every later one will be hooked under the new phase.
//! The gate is closed only for microseconds (record a few events); the launch path otherwise pays
//! two atomic operations.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// See the module doc.
#[derive(Debug, Default)]
pub struct Gate {
    closed: AtomicBool,
    in_flight: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Gate {
    /// Called by the job's thread before an operation. Inlined: it runs on every operation of
    /// the job; the wait for a closed gate is out of line.
    #[inline]
    pub fn enter(&self) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        if self.closed.load(Ordering::SeqCst) {
            self.enter_closed();
        }
    }

    /// [`Self::enter`] finding the gate closed: backs out, waits until it opens, enters again.
    #[cold]
    #[inline(never)]
    fn enter_closed(&self) {
        loop {
            self.leave();
            let mut g = self.lock.lock();
            while self.closed.load(Ordering::SeqCst) {
                self.cv.wait_for(&mut g, Duration::from_millis(1));
            }
            drop(g);
            self.in_flight.fetch_add(1, Ordering::SeqCst);
            if !self.closed.load(Ordering::SeqCst) {
                return;
            }
        }
    }

    /// Called once the operation is enqueued.
    #[inline]
    pub fn leave(&self) {
        if self.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 && self.closed.load(Ordering::SeqCst)
        {
            self.wake_closer();
        }
    }

    /// Wakes a [`Self::close`] waiting for the last operation to leave.
    #[cold]
    #[inline(never)]
    fn wake_closer(&self) {
        let _g = self.lock.lock();
        self.cv.notify_all();
    }

    /// Closes the gate and waits until no operation is between hook and enqueue. The caller must not
    /// itself be inside the gate.
    pub fn close(&self) {
        let mut g = self.lock.lock();
        while self.closed.swap(true, Ordering::SeqCst) {
            // Someone else holds it closed: wait our turn.
            self.cv.wait_for(&mut g, Duration::from_millis(1));
        }
        while self.in_flight.load(Ordering::SeqCst) != 0 {
            self.cv.wait_for(&mut g, Duration::from_millis(1));
        }
    }

    /// Opens it again.
    pub fn open(&self) {
        let _g = self.lock.lock();
        self.closed.store(false, Ordering::SeqCst);
        self.cv.notify_all();
    }
}
