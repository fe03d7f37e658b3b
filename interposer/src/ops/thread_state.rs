//! What possum keeps per thread for its callbacks, in one thread-local: the thread's flags
//! (inside possum, one of possum's own threads, its context's device, its launch count), the
//! stream of its last operation, and the hooks' state (the operation between its entry and exit
//! callbacks, the kernels' memo entries, scratch space).
//!
//! One thread-local, not one per item: this library is loaded as a shared object, where every
//! thread-local access is a call to `__tls_get_addr`; a callback looks the state up once and
//! passes it down. It has no destructor, so it is usable until the thread is gone (a driver call
//! from another library's thread-local destructor, or from `exit` after the main thread's, is
//! still told apart as possum's own or the job's): what it owns on the heap is behind
//! [`ManuallyDrop`], and freed by a second, empty thread-local whose destructor empties the
//! state (registered at the thread's first use). A callback after that starts afresh (what it
//! then keeps is left to the process's end).

use std::cell::{Cell, RefCell};
use std::mem::ManuallyDrop;

use crate::ops::hook_state::HookState;
use possum_cuda::CudaStream;

/// A thread's state (see the module documentation).
pub struct ThreadState {
    /// Set while possum itself calls the driver on this thread: callbacks then ignore the call.
    pub in_possum: Cell<bool>,
    /// 0: not yet known; 1: a job thread; 2: one of possum's own threads (named `possum-*`).
    kind: Cell<u8>,
    /// The last (context, device ordinal) this thread resolved.
    pub ctx_device: Cell<(u64, usize)>,
    /// Launches this thread made (their entry callbacks), wrapping ([`ThreadState::hooked_launch`]).
    launches: Cell<u32>,
    /// Whether [`OWNER`] is registered on this thread (it frees the heap parts at its exit).
    owned: Cell<bool>,
    /// The last stream this thread operated on: (device, raw handle, the device's stream epoch)
    /// ([`crate::process::runtime::DevEngine::with_stream`]).
    pub stream_key: Cell<(usize, u64, u64)>,
    /// Its wrapper (if still kept).
    pub stream: ManuallyDrop<RefCell<Option<CudaStream>>>,
    /// The hooks' state.
    pub hooks: ManuallyDrop<HookState>,
}

thread_local! {
    static STATE: ThreadState = const {
        ThreadState {
            in_possum: Cell::new(false),
            kind: Cell::new(0),
            ctx_device: Cell::new((u64::MAX, 0)),
            launches: Cell::new(0),
            owned: Cell::new(false),
            stream_key: Cell::new((usize::MAX, 0, 0)),
            stream: ManuallyDrop::new(RefCell::new(None)),
            hooks: ManuallyDrop::new(HookState::new()),
        }
    };
    /// Frees the heap parts of [`STATE`] when the thread exits.
    static OWNER: Owner = const { Owner };
}

/// See [`OWNER`].
struct Owner;

impl Drop for Owner {
    fn drop(&mut self) {
        let _ = STATE.try_with(ThreadState::release);
    }
}

/// Calls `f` with the calling thread's state (first registering what frees its heap parts when
/// the thread exits, if not yet done).
#[inline]
pub fn with<R>(f: impl FnOnce(&ThreadState) -> R) -> R {
    STATE.with(|t| {
        if !t.owned.get() {
            t.own();
        }
        f(t)
    })
}

/// Calls `f` with the calling thread's flags only (nothing on the heap is touched, so nothing is
/// registered).
#[inline]
pub fn flags<R>(f: impl FnOnce(&ThreadState) -> R) -> R {
    STATE.with(f)
}

impl ThreadState {
    #[cold]
    fn own(&self) {
        self.owned.set(true);
        // Fails only while the thread's thread-locals are being destroyed: then nothing is
        // registered, and what this thread keeps from now on is left to the process's end.
        let _ = OWNER.try_with(|_| ());
    }

    /// Empties the heap parts (the thread is exiting). What they hold is dropped as possum's own
    /// (a driver call it makes is not the job's).
    fn release(&self) {
        let was = self.in_possum.replace(true);
        let stream = self.stream.try_borrow_mut().map(|mut s| s.take());
        let hooks = self.hooks.take();
        drop(stream);
        drop(hooks);
        self.in_possum.set(was);
    }

    /// Whether a callback on this thread must ignore the call: possum's own call, or one of
    /// possum's own threads (the engine's copier, writers and restorers, the control thread).
    #[inline]
    pub fn ignores(&self) -> bool {
        if self.in_possum.get() {
            return true;
        }
        match self.kind.get() {
            1 => false,
            2 => true,
            _ => self.learn_kind(),
        }
    }

    #[cold]
    fn learn_kind(&self) -> bool {
        let ours = std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("possum"));
        self.kind.set(if ours { 2 } else { 1 });
        ours
    }

    /// [`Self::ignores`] for a launch's entry callback, with the thread's launch count: `None`
    /// if the call is ignored; else the number of launch entries this thread made, this one
    /// included (wrapping).
    #[inline]
    pub fn hooked_launch(&self) -> Option<u32> {
        if self.ignores() {
            return None;
        }
        let n = self.launches.get().wrapping_add(1);
        self.launches.set(n);
        Some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::hook_state::Ways;
    use possum_analyzer::kernel::KernelModel;
    use std::sync::Arc;

    #[test]
    fn a_thread_s_heap_parts_are_freed_at_its_exit() {
        let model = Arc::new(KernelModel::without_layout(7, None, "a test".into()));
        let kept = model.clone();
        std::thread::spawn(move || {
            with(|t| {
                let mut memo = t.hooks.memo.borrow_mut();
                let ways = memo.get_or_insert_with(Default::default);
                ways.insert(
                    7,
                    Ways {
                        model: Some(model),
                        ..Ways::default()
                    },
                );
            });
        })
        .join()
        .unwrap();
        // The thread's memo held the other reference: gone with the thread.
        assert_eq!(Arc::strong_count(&kept), 1);
    }

    #[test]
    fn launches_are_counted_and_possum_s_own_calls_ignored() {
        std::thread::spawn(|| {
            let first = flags(ThreadState::hooked_launch).unwrap();
            assert_eq!(
                flags(ThreadState::hooked_launch),
                Some(first.wrapping_add(1))
            );
            // Inside possum's own call.
            let was = flags(|t| t.in_possum.replace(true));
            assert!(flags(ThreadState::ignores));
            assert_eq!(flags(ThreadState::hooked_launch), None);
            flags(|t| t.in_possum.set(was));
            assert!(!flags(ThreadState::ignores));
            assert_eq!(
                flags(ThreadState::hooked_launch),
                Some(first.wrapping_add(2))
            );
        })
        .join()
        .unwrap();
        // One of possum's own threads: every call ignored.
        std::thread::Builder::new()
            .name("possum-test".into())
            .spawn(|| assert_eq!(flags(ThreadState::hooked_launch), None))
            .unwrap()
            .join()
            .unwrap();
    }
}
