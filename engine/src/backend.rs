//! What the GPU backends of [`Device`](crate::device::Device) build alike, whatever their API
//! (the CUDA and the HIP backends share it): pinned host buffers, copies that own their host
//! buffer until they are known to be complete, and the checked answer of an API call.
//!
//! The API's own calls (allocating pinned memory, recording an event, queueing a copy) stay in
//! each backend, behind [`PinnedAlloc`], [`CopyStream`] and [`CopyEvent`]; this module holds
//! the rules they keep the same way:
//!
//! - Host memory the device reads or writes asynchronously belongs to a [`Pending`] until the
//!   copy is known to be complete; if that can't be established, the memory is leaked rather
//!   than freed.
//! - A copy call that fails frees its buffer only once the stream is known idle.

use std::fmt;

use crate::device::{DeviceError, DeviceResult, HostBuffer, Transfer};

/// A failed API call as a [`DeviceError::Backend`]: `call`, the API's error code and its
/// description of it.
pub fn backend_error(call: &'static str, code: i64, message: String) -> DeviceError {
    DeviceError::Backend {
        call,
        code,
        message,
    }
}

/// The answer of an API call: `Ok` if `ok`, else a [`DeviceError::Backend`] naming `call`, with
/// the error `code` and the API's description of it (`describe`, asked only on failure).
pub fn check_call(
    call: &'static str,
    ok: bool,
    code: i64,
    describe: impl FnOnce() -> String,
) -> DeviceResult<()> {
    if ok {
        Ok(())
    } else {
        Err(backend_error(call, code, describe()))
    }
}

/// A checked answer ([`check_call`]) of a call that waits for earlier asynchronous work: its
/// error is that work's, so it becomes [`DeviceError::StreamFailed`] (naming the call, the
/// API's description and its code).
pub fn as_stream_failure(checked: DeviceResult<()>) -> DeviceResult<()> {
    checked.map_err(|e| {
        DeviceError::StreamFailed(match e {
            DeviceError::Backend {
                call,
                code,
                message,
            } => format!("{call}: {message} (code {code})"),
            other => other.to_string(),
        })
    })
}

/// A size for an API call that takes a `size_t`: refused (as the API's `invalid_code`) where
/// it does not fit.
pub fn usize_arg(call: &'static str, n: u64, invalid_code: i64) -> DeviceResult<usize> {
    usize::try_from(n).map_err(|_| {
        backend_error(
            call,
            invalid_code,
            format!("size {n} does not fit in usize"),
        )
    })
}

/// Where a backend's pinned (page-locked) host memory comes from.
pub trait PinnedAlloc: Send + Sync + 'static {
    /// `len` (more than 0) bytes of pinned host memory, zeroed, that nothing else refers to.
    fn alloc_pinned(&self, len: usize) -> DeviceResult<&'static mut [u8]>;

    /// Frees memory [`alloc_pinned`](Self::alloc_pinned) gave. Only [`PinnedBuf`]'s drop
    /// calls it: no one else can make a [`Pinned`].
    fn free_pinned(&self, mem: Pinned);
}

/// Memory of [`PinnedAlloc::alloc_pinned`] on its way back to [`PinnedAlloc::free_pinned`]:
/// only this module makes one, from a [`PinnedBuf`] being dropped.
#[derive(Debug)]
pub struct Pinned(&'static mut [u8]);

impl Pinned {
    /// The start of the memory, to hand to the API's free.
    pub fn into_ptr(self) -> *mut u8 {
        self.0.as_mut_ptr()
    }
}

/// Pinned host memory of a backend ([`PinnedAlloc`]): usable for asynchronous copies, zeroed
/// when allocated, freed on drop. Its bytes are never touched by safe code while a copy owns
/// it ([`Pending`]).
pub struct PinnedBuf<A: PinnedAlloc> {
    mem: &'static mut [u8],
    alloc: A,
}

impl<A: PinnedAlloc> PinnedBuf<A> {
    /// Allocates `len` bytes of pinned, zeroed host memory from `alloc` (none for `len` 0).
    pub fn alloc(alloc: A, len: usize) -> DeviceResult<Self> {
        let mem = if len == 0 {
            <&mut [u8]>::default()
        } else {
            alloc.alloc_pinned(len)?
        };
        debug_assert_eq!(mem.len(), len);
        Ok(PinnedBuf { mem, alloc })
    }
}

impl<A: PinnedAlloc> fmt::Debug for PinnedBuf<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuf")
            .field("ptr", &self.mem.as_ptr())
            .field("len", &self.mem.len())
            .finish()
    }
}

impl<A: PinnedAlloc> HostBuffer for PinnedBuf<A> {
    fn as_slice(&self) -> &[u8] {
        &*self.mem
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut *self.mem
    }

    fn len(&self) -> usize {
        self.mem.len()
    }
}

impl<A: PinnedAlloc> Drop for PinnedBuf<A> {
    fn drop(&mut self) {
        let mem = std::mem::take(&mut self.mem);
        if !mem.is_empty() {
            self.alloc.free_pinned(Pinned(mem));
        }
    }
}

/// A backend's event, as a [`Pending`] waits on it.
pub trait CopyEvent: Send + Sync + fmt::Debug {
    /// Blocks until the work before the event has completed.
    fn synchronize(&self) -> DeviceResult<()>;
    /// Whether the work before the event has completed (without blocking).
    fn query(&self) -> DeviceResult<bool>;
}

/// A backend's stream, as a [`Pending`] orders itself on it.
pub trait CopyStream: Clone + Send + Sync + fmt::Debug {
    /// The backend's event.
    type Event: CopyEvent;
    /// An event recorded at the stream's current end.
    fn record(&self) -> DeviceResult<Self::Event>;
    /// Blocks until all work queued so far has completed.
    fn synchronize(&self) -> DeviceResult<()>;
    /// Whether all work queued so far has completed (without blocking); `Unsupported` where
    /// the API can't say.
    fn query(&self) -> DeviceResult<bool> {
        Err(DeviceError::Unsupported("stream query"))
    }
}

/// An asynchronous copy between a host buffer and the device on a stream. Owns the buffer
/// until the copy is complete: [`Transfer::wait`] hands it back; dropping it without waiting
/// blocks until the copy is complete, then frees the buffer (or leaks it if completion can't
/// be established).
#[derive(Debug)]
pub struct Pending<S: CopyStream, B: HostBuffer> {
    buf: Option<B>,
    /// Recorded right after the copy; `None` if recording failed (then the stream is waited
    /// for).
    done: Option<S::Event>,
    stream: S,
}

impl<S: CopyStream, B: HostBuffer> Pending<S, B> {
    /// Queues a copy of `len` bytes between the start of `buf` and the device on `stream`:
    /// checks `buf` holds them, and hands them to `enqueue`, which queues the API's copy of
    /// them (nothing for `len` 0). The copy owns `buf` from then on; if `enqueue` fails, `buf`
    /// is freed only once the stream is known idle (else leaked).
    pub fn start(
        stream: &S,
        mut buf: B,
        len: usize,
        enqueue: impl FnOnce(&mut [u8]) -> DeviceResult<()>,
    ) -> DeviceResult<Self> {
        if len > buf.len() {
            return Err(DeviceError::HostBufferTooSmall {
                need: len as u64,
                have: buf.len() as u64,
            });
        }
        if len > 0 {
            if let Err(e) = enqueue(&mut buf.as_mut_slice()[..len]) {
                // It should have queued nothing, but the buffer is only freed once the stream
                // is known idle.
                if stream.synchronize().is_err() {
                    std::mem::forget(buf);
                }
                return Err(e);
            }
        }
        Ok(Pending {
            buf: Some(buf),
            done: stream.record().ok(),
            stream: stream.clone(),
        })
    }

    /// Whether the copy has completed (without blocking).
    pub fn is_complete(&self) -> DeviceResult<bool> {
        match &self.done {
            Some(ev) => ev.query(),
            None => self.stream.query(),
        }
    }

    fn finish(&self) -> DeviceResult<()> {
        match &self.done {
            Some(ev) => ev.synchronize(),
            None => self.stream.synchronize(),
        }
    }
}

impl<S: CopyStream, B: HostBuffer> Transfer<B> for Pending<S, B> {
    fn wait(mut self) -> DeviceResult<B> {
        let r = self.finish();
        let buf = self
            .buf
            .take()
            .expect("a Pending holds its buffer until waited");
        match r {
            Ok(()) => Ok(buf),
            Err(e) => {
                // The device may still be using the buffer: never free it.
                std::mem::forget(buf);
                Err(e)
            }
        }
    }
}

impl<S: CopyStream, B: HostBuffer> Drop for Pending<S, B> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            if self.finish().is_err() {
                std::mem::forget(buf);
            }
        }
    }
}
