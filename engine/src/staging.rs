//! A bounded pool of host buffers (pinned memory on a GPU) through which all copies pass.
//!
//! The pool bounds the engine's host memory: a checkpoint or restore of any size uses at most
//! `count` chunks of `chunk` bytes. Buffers are allocated once and reused.

use parking_lot::{Condvar, Mutex};

use crate::device::{Device, DeviceResult};

/// The pool.
#[derive(Debug)]
pub struct StagingPool<D: Device> {
    free: Mutex<Vec<D::HostBuf>>,
    cv: Condvar,
    chunk: usize,
    count: usize,
}

impl<D: Device> StagingPool<D> {
    /// Allocates `count` buffers of `chunk` bytes.
    pub fn new(dev: &D, chunk: usize, count: usize) -> DeviceResult<Self> {
        let free = (0..count)
            .map(|_| dev.alloc_host(chunk))
            .collect::<DeviceResult<Vec<_>>>()?;
        Ok(StagingPool {
            free: Mutex::new(free),
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

    /// Takes a buffer, waiting for one to come back if all are in use.
    pub fn get(&self) -> D::HostBuf {
        let mut free = self.free.lock();
        loop {
            if let Some(b) = free.pop() {
                return b;
            }
            self.cv.wait(&mut free);
        }
    }

    /// Takes a buffer if one is free now.
    pub fn try_get(&self) -> Option<D::HostBuf> {
        self.free.lock().pop()
    }

    /// Gives a buffer back.
    pub fn put(&self, b: D::HostBuf) {
        self.free.lock().push(b);
        self.cv.notify_one();
    }
}
