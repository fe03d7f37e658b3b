//! A bounded pool of host buffers (pinned memory on a GPU) through which all copies pass.
//!
//! The pool bounds the engine's host memory: a checkpoint or restore of any size uses at most
//! `count` chunks of `chunk` bytes. Buffers are allocated up front and reused; a pool can be
//! *parked* (every buffer freed, e.g. before the process's memory is dumped by CRIU, whose image
//! would otherwise carry them) and then grows back on demand, one buffer per request, up to
//! `count`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::device::{Device, DeviceResult};

#[derive(Debug)]
struct Slots<B> {
    free: Vec<B>,
    /// Buffers that exist (free or out), at most `count`.
    allocated: usize,
}

/// The pool.
#[derive(Debug)]
pub struct StagingPool<D: Device> {
    dev: Arc<D>,
    slots: Mutex<Slots<D::HostBuf>>,
    cv: Condvar,
    chunk: usize,
    count: usize,
}

impl<D: Device> StagingPool<D> {
    /// Allocates `count` buffers of `chunk` bytes.
    pub fn new(dev: Arc<D>, chunk: usize, count: usize) -> DeviceResult<Self> {
        let free = (0..count)
            .map(|_| dev.alloc_host(chunk))
            .collect::<DeviceResult<Vec<_>>>()?;
        Ok(StagingPool {
            dev,
            slots: Mutex::new(Slots {
                free,
                allocated: count,
            }),
            cv: Condvar::new(),
            chunk,
            count,
        })
    }

    /// Bytes per buffer.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Number of buffers.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Buffers that exist now (fewer than `count` after [`StagingPool::park`] until they are
    /// needed again).
    pub fn allocated(&self) -> usize {
        self.slots.lock().allocated
    }

    /// Takes a buffer: a free one, a new one while fewer than `count` exist, or else waits for
    /// one to come back. Fails only if a new one cannot be allocated.
    pub fn get(&self) -> DeviceResult<D::HostBuf> {
        let mut s = self.slots.lock();
        loop {
            if let Some(b) = s.free.pop() {
                return Ok(b);
            }
            if s.allocated < self.count {
                s.allocated += 1;
                drop(s);
                return self.grow();
            }
            self.cv.wait(&mut s);
        }
    }

    /// Takes a buffer if one is free now or can be allocated now.
    pub fn try_get(&self) -> Option<D::HostBuf> {
        let mut s = self.slots.lock();
        if let Some(b) = s.free.pop() {
            return Some(b);
        }
        if s.allocated < self.count {
            s.allocated += 1;
            drop(s);
            return self.grow().ok();
        }
        None
    }

    /// Allocates a buffer already counted in `allocated` (uncounted again on failure).
    fn grow(&self) -> DeviceResult<D::HostBuf> {
        self.dev.alloc_host(self.chunk).inspect_err(|_| self.lost())
    }

    /// Gives a buffer back.
    pub fn put(&self, b: D::HostBuf) {
        self.slots.lock().free.push(b);
        self.cv.notify_one();
    }

    /// A buffer taken from the pool will not come back (it went down with a failed copy): the
    /// pool may allocate another in its place.
    pub fn lost(&self) {
        let mut s = self.slots.lock();
        s.allocated = s.allocated.saturating_sub(1);
        drop(s);
        self.cv.notify_one();
    }

    /// Frees every buffer once all are back (waiting at most `timeout` for those still out);
    /// returns the bytes freed, or `None` (nothing freed) if some buffer did not come back in
    /// time. The pool grows again on demand.
    pub fn park(&self, timeout: Duration) -> Option<u64> {
        let deadline = Instant::now() + timeout;
        let mut s = self.slots.lock();
        while s.free.len() < s.allocated {
            if self.cv.wait_until(&mut s, deadline).timed_out() && s.free.len() < s.allocated {
                return None;
            }
        }
        let freed = std::mem::take(&mut s.free);
        s.allocated = 0;
        drop(s);
        let bytes = (freed.len() * self.chunk) as u64;
        drop(freed);
        Some(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::HostBuffer;
    use crate::host::HostDevice;

    #[test]
    fn a_parked_pool_frees_everything_and_grows_back_to_its_bound() {
        let pool = StagingPool::new(Arc::new(HostDevice::new(1 << 20)), 64, 3).unwrap();
        let out = pool.get().unwrap();
        // A buffer still out: parking waits for it, then gives up.
        assert_eq!(pool.park(Duration::from_millis(10)), None);
        assert_eq!(pool.allocated(), 3);
        pool.put(out);
        assert_eq!(pool.park(Duration::from_secs(5)), Some(3 * 64));
        assert_eq!(pool.allocated(), 0);
        let a = pool.get().unwrap();
        let b = pool.try_get().unwrap();
        let c = pool.get().unwrap();
        assert_eq!(a.len(), 64);
        assert_eq!(pool.allocated(), 3);
        assert!(pool.try_get().is_none(), "never more than count buffers");
        pool.lost();
        drop(c);
        assert!(pool.try_get().is_some(), "a lost buffer is replaced");
        pool.put(a);
        pool.put(b);
    }
}
