//! What each callback does: the engine hook for launches, graph launches, copies and memsets;
//! tracking of allocations possum does not manage; streams, captures and graphs.
//!
//! On a call's entry the operation is admitted by its device's engine ([`Engine::enter_op`]);
//! if the engine is tracking (a checkpoint is open), or the operation falls in a sampling window
//! ([`ResolveMode`]), its buffers are resolved, recorded in the DAG and, while tracking, checked
//! by the engine ([`OpGuard::check`]). The guard is kept in a thread-local slot until the call's
//! exit callback, when the operation is enqueued (CUPTI calls entry and exit on the calling
//! thread, with nothing of the job's in between). A launch chosen for validation is resolved and
//! checked on both sides (see [`crate::ops::validate`]).
//!
//! [`Engine::enter_op`]: possum_engine::Engine::enter_op
//! [`OpGuard::check`]: possum_engine::OpGuard::check
//! [`ResolveMode`]: crate::base::config::ResolveMode

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

// Keys are handles: the fast hash.
use rustc_hash::FxHashMap as HashMap;

use possum_analyzer::kernel::{KernelModel, SlotAccess};
use possum_cuda::introspect;
use possum_cuda::{CudaDevice, CudaStream};
use possum_engine::{Access, Buffer, OpGuard};

use crate::cuda::cbid::{Shape, StreamAt, WriteAt};
use crate::cuda::decode::{KernelArgs, RawCall, Span, STREAM_PER_THREAD};
use crate::memory::ranges::{Ranges, Resolved, WordHash};
use crate::ops::hook_state::{BufferSets, Foreign, Memo, MemoSet, Pending, Ways};
use crate::ops::thread_state::ThreadState;
use crate::ops::validate;
use crate::process::dag::{DagMsg, DagOp, DagSets, SetsRef};
use crate::process::runtime::{state, DevEngine, Reentry, SnapNode, State};

/// One launch in this many on a thread has its time in possum's callbacks measured.
const TIME_EVERY: u32 = 16;

/// What an operation touches on other devices than its own.
#[derive(Clone, Copy)]
enum Others<'a> {
    /// These buffers (none, mostly).
    Listed(&'a [Foreign]),
    /// Anything: a launch on several devices whose buffers possum does not know.
    Every,
}

/// Adds `b` (of device `dev`) to `foreign`, once; written wins over read.
fn push_foreign(foreign: &mut Vec<Foreign>, dev: usize, b: &Buffer, write: bool) {
    if let Some(f) = foreign.iter_mut().find(|f| f.buf.id() == b.id()) {
        f.write |= write;
        return;
    }
    foreign.push(Foreign {
        dev,
        buf: b.clone(),
        write,
    });
}

/// The allocation snapshot of `generation`, from the thread's `cache`.
fn ranges_at<'a>(
    cache: &'a mut Option<(u64, Arc<Ranges>)>,
    st: &State,
    generation: u64,
) -> &'a Arc<Ranges> {
    if cache.as_ref().map(|r| r.0) != Some(generation) {
        *cache = Some((generation, st.ranges()));
    }
    &cache.as_ref().expect("just set").1
}

/// Handles one callback (`enter`: API entry, else exit) of callback id `cbid` in context `ctx`:
/// a launch's entry (most callbacks) in a function of its own (where a wrapper knows its
/// callback id, the choice is made when it is compiled).
#[inline]
pub fn on_call(enter: bool, cbid: u32, ctx: u64, call: &RawCall<'_>) {
    if !enter {
        let operation = crate::cuda::cbid::shape(cbid).is_operation();
        crate::ops::thread_state::with(|t| on_exit_call(t, cbid, operation, call));
        return;
    }
    match crate::cuda::cbid::shape(cbid) {
        Shape::Launch {
            func,
            stream,
            params,
            extra,
        } => on_launch_entry(cbid, ctx, call, (func, stream, params, extra)),
        shape => on_other_entry(cbid, shape, ctx, call),
    }
}

/// An exit callback, with the calling thread's state `t`; `operation`: the call's shape is an
/// operation's ([`Shape::is_operation`]).
#[inline(never)]
fn on_exit_call(t: &ThreadState, cbid: u32, operation: bool, call: &RawCall<'_>) {
    if t.ignores() {
        return;
    }
    if operation && !t.hooks.more.get() {
        // Only its own device's guard to drop (most operations): the operation is enqueued, a
        // checkpoint may fix T0 again.
        drop(t.hooks.guard.take());
        return;
    }
    let shape = crate::cuda::cbid::shape(cbid);
    let st = state();
    // As in `other_entry`.
    let _panic = PanicFault;
    on_exit(st, t, cbid, shape, call);
}

/// A launch's entry callback: `at` says where its function, stream, parameters and `extra` are
/// ([`Shape::Launch`]).
fn on_launch_entry(
    cbid: u32,
    ctx: u64,
    call: &RawCall<'_>,
    at: (usize, StreamAt, usize, Option<usize>),
) {
    crate::ops::thread_state::with(|t| launch_entry(t, cbid, ctx, call, at));
}

/// [`on_launch_entry`] with the calling thread's state `t`.
#[inline]
fn launch_entry(
    t: &ThreadState,
    cbid: u32,
    ctx: u64,
    call: &RawCall<'_>,
    at: (usize, StreamAt, usize, Option<usize>),
) {
    let Some(tick) = t.hooked_launch() else {
        return;
    };
    let st = state();
    // As in `other_entry`.
    let _panic = PanicFault;
    crate::process::stats::record(cbid);
    // A checkpoint may have released the buffers: wait for them to come back first.
    crate::ops::gate::wait_if_paused();
    let (func, stream, params, extra) = at;
    let t0 = (tick % TIME_EVERY == 0).then(Instant::now);
    let f = call.word(func);
    let s = call.stream(stream);
    launch(st, t, ctx, f, s, &call.kernel_args(params, extra));
    if let Some(t0) = t0 {
        let mut p = t.hooks.pending.borrow_mut();
        if p.validation.is_none() {
            p.timed = Some(t0.elapsed());
            t.hooks.more.set(true);
        }
    }
}

/// The entry callback of any other call than a launch, of shape `shape`.
fn on_other_entry(cbid: u32, shape: Shape, ctx: u64, call: &RawCall<'_>) {
    crate::ops::thread_state::with(|t| other_entry(t, cbid, shape, ctx, call));
}

/// [`on_other_entry`] with the calling thread's state `t`.
fn other_entry(t: &ThreadState, cbid: u32, shape: Shape, ctx: u64, call: &RawCall<'_>) {
    if t.ignores() {
        return;
    }
    let st = state();
    // A panic below leaves the operation to run with whatever the hook did so far: counted as a
    // fault, which fails a checkpoint that is open (its image is not committed).
    let _panic = PanicFault;
    crate::process::stats::record(cbid);
    if shape.is_operation() {
        // A checkpoint may have released the buffers: wait for them to come back first.
        crate::ops::gate::wait_if_paused();
    }
    match shape {
        Shape::GraphLaunch { stream } => {
            graph_launch(st, t, ctx, call.word(0), call.stream(stream));
        }
        Shape::Copy {
            dst, src, stream, ..
        } => {
            copy_like(
                st,
                t,
                ctx,
                stream,
                call,
                Some(call.word(src)),
                call.word(dst),
            );
        }
        Shape::Memset { dst, stream, .. } => {
            copy_like(st, t, ctx, stream, call, None, call.word(dst));
        }
        Shape::Write { at, stream } => write_op(st, t, ctx, cbid, at, stream, call),
        Shape::OpaqueOp { stream } => {
            let s = call.stream(stream);
            if !skip_captured(st, s) {
                st.counters.opaque_ops.fetch_add(1, Ordering::Relaxed);
                let eng = engine_of(st, t, ctx);
                label_op(t, || {
                    let name = crate::cuda::cbid::lookup(cbid).map_or("?", |c| c.name);
                    format!("operation {name}")
                });
                // Opaque: it may write anything on any device (`hook` tells every engine).
                let guard = admit(t, eng, s);
                hook(t, eng, guard, s, Access::Opaque, Others::Every, None);
            }
        }
        Shape::Free { ptr } => st.remove_unmanaged(call.word(ptr)),
        Shape::Unmap => st.remove_unmanaged(call.word(0)),
        Shape::StreamDestroy => {
            // Work still queued on the stream runs on after it is destroyed: a later T0 must
            // wait for it (see `DevEngine::retire_stream`).
            let raw = call.word(0);
            for e in st.engines() {
                if let Err(err) = e.retire_stream(raw) {
                    crate::ops::gate::note_fault(&format!("destroying stream {raw:#x}: {err}"));
                }
            }
        }
        Shape::CaptureBegin => {
            st.captures.fetch_add(1, Ordering::SeqCst);
        }
        Shape::GraphExecDestroy | Shape::GraphExecChanged => st.forget_graph(call.word(0)),
        // Launches go to `on_launch_entry`.
        Shape::Launch { .. }
        | Shape::CaptureEnd
        | Shape::GraphInstantiate
        | Shape::Alloc { .. }
        | Shape::AllocPitch
        | Shape::Map
        | Shape::Import
        | Shape::Release
        | Shape::ProcAddress
        | Shape::Count => {}
    }
}

/// Notes a fault ([`crate::ops::gate::note_fault`]) if dropped while the hook's thread unwinds.
struct PanicFault;

impl Drop for PanicFault {
    fn drop(&mut self) {
        if std::thread::panicking() {
            crate::ops::gate::note_fault("a panic in possum's hook");
        }
    }
}

fn on_exit(st: &State, t: &ThreadState, cbid: u32, shape: Shape, call: &RawCall<'_>) {
    match shape {
        _ if shape.is_operation() => {
            let guard = t.hooks.guard.take();
            let p = if t.hooks.more.replace(false) {
                std::mem::take(&mut *t.hooks.pending.borrow_mut())
            } else {
                Pending::EMPTY
            };
            // Read the clock only for a timed launch: in a VM it may cost a system call.
            let t0 = p.timed.map(|_| Instant::now());
            // The operation is enqueued: let a checkpoint fix T0 again.
            drop(guard);
            if let (Some(entry), Some(t0)) = (p.timed, t0) {
                let ns = (entry + t0.elapsed()).as_nanos();
                st.counters.timed_launches.fetch_add(1, Ordering::Relaxed);
                st.counters
                    .timed_launch_ns
                    .fetch_add(u64::try_from(ns).unwrap_or(u64::MAX), Ordering::Relaxed);
            }
            if let Some(finish) = p.validation {
                finish();
            }
        }
        Shape::CaptureEnd => {
            let _ = st
                .captures
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| c.checked_sub(1));
        }
        _ if call.result() != 0 => {}
        Shape::Alloc { out, bytes } => {
            // Unmanaged allocations are counted by the call that made them.
            let name = crate::cuda::cbid::lookup(cbid).map_or("?", |c| c.name);
            if let Some(va) = call.deref(out) {
                st.add_unmanaged(va, call.word(bytes), name);
            }
        }
        Shape::AllocPitch => {
            // (dptr*, pPitch*, WidthInBytes, Height, ElementSizeBytes)
            if let (Some(va), Some(pitch)) = (call.deref(0), call.deref(1)) {
                st.add_unmanaged(va, pitch.saturating_mul(call.word(3)), "cuMemAllocPitch");
            }
        }
        Shape::Map => {
            let kind = if st.is_imported(call.word(3)) {
                possum_control::reply::IMPORTED_MAPPING
            } else {
                "cuMemMap"
            };
            st.add_unmanaged(call.word(0), call.word(1), kind);
        }
        Shape::Import => {
            if let Some(h) = call.deref(0) {
                st.note_imported(h, true);
            }
        }
        Shape::Release => st.note_imported(call.word(0), false),
        Shape::GraphInstantiate => {
            if let Some(exec) = call.deref(0) {
                st.instantiate_graph(exec, call.word(1));
            }
        }
        _ => {}
    }
}

/// A module was loaded (CUPTI's resource callback): the parameter layouts of its kernels are
/// kept for those whose layout the driver cannot give ([`State::kernel`]).
///
/// [`State::kernel`]: crate::process::runtime::State::kernel
pub fn module_loaded(image: &[u8]) {
    // Whichever thread: a module load inside possum's own call (the runtime initialised inside
    // an interposed cudaMalloc) is still the job's module.
    state().note_module(image);
}

/// A query about device pointer `ptr` (`cuPointerGetAttribute(s)`, `cuMemGetAddressRange`):
/// Triton asks before every launch whether each argument is device memory. A buffer possum has
/// released must be back first: the query waits while the job is paused, and while the engine
/// tracks (a restore may be under way) the buffer is brought back as for an operation reading
/// it on the legacy stream.
pub fn pointer_query(ctx: u64, ptr: u64) {
    crate::ops::thread_state::with(|t| pointer_query_in(t, ctx, ptr));
}

fn pointer_query_in(t: &ThreadState, ctx: u64, ptr: u64) {
    if t.ignores() {
        return;
    }
    crate::ops::gate::wait_if_paused();
    let st = state();
    let Some(e) = engine_of(st, t, ctx) else {
        return;
    };
    let g = crate::ops::gate::admit(e);
    if !g.tracking() {
        return;
    }
    if let Resolved::Managed(b, d) = st.ranges().lookup(ptr) {
        if d == e.ordinal {
            let _r = Reentry::enter();
            let access = Access::Known {
                reads: std::slice::from_ref(&b),
                writes: &[],
            };
            if let Err(err) = e.with_stream(t, 0, |s| g.check(s, access)) {
                st.counters.hook_errors.fetch_add(1, Ordering::Relaxed);
                crate::base::log::log(&format!("pointer query: {err}"));
            }
        }
    }
}

/// Whether an operation on `stream` is being captured into a graph (then it does not run now:
/// nothing to hook). Costs a driver call only while some capture is in progress.
fn skip_captured(st: &State, stream: u64) -> bool {
    if st.captures.load(Ordering::Relaxed) == 0 {
        return false;
    }
    let _r = Reentry::enter();
    if introspect::is_capturing(stream).unwrap_or(false) {
        st.counters
            .captured_launches
            .fetch_add(1, Ordering::Relaxed);
        return true;
    }
    false
}

/// Admits an operation on the job's stream `stream` to `eng` (the engine of the calling thread's
/// device, if possum manages allocations there): the stream is registered (a session fences
/// every stream the job used) and the engine's gate entered. The guard's
/// [`tracking`](OpGuard::tracking) says whether the engine needs the operation's buffers.
#[inline]
fn admit(
    t: &ThreadState,
    eng: Option<&'static DevEngine>,
    stream: u64,
) -> Option<OpGuard<'static, CudaDevice>> {
    let e = eng?;
    if stream == STREAM_PER_THREAD {
        state()
            .counters
            .per_thread_stream_ops
            .fetch_add(1, Ordering::Relaxed);
    }
    e.note_stream(t, stream);
    Some(crate::ops::gate::admit(e))
}

/// Whether an admitted operation is resolved: while the engine tracks, or in a sampling window.
/// One that is not leaves a gap in the DAG.
fn resolving(st: &State, guard: Option<&OpGuard<'_, CudaDevice>>) -> bool {
    let r = st.resolve_now(guard.is_some_and(OpGuard::tracking));
    if !r {
        st.note_unresolved();
    }
    r
}

/// `POSSUM_DEBUG_DIRTY=1` (diagnostics): while the engine tracks, each operation that marks a
/// buffer written that was not marked yet is logged, with what the operation is (the first 400
/// such lines): what a pre-copy leaves for the pause, and why.
fn debug_dirty() -> bool {
    crate::base::config::get().diag.debug_dirty
}

/// Names the operation being hooked, for [`debug_dirty`].
fn label_op(t: &ThreadState, what: impl FnOnce() -> String) {
    if debug_dirty() {
        *t.hooks.label.borrow_mut() = what();
    }
}

/// Logs what `access` newly marks written ([`debug_dirty`]).
fn log_newly_dirty(t: &ThreadState, access: &Access<'_>) {
    static LINES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let label = t.hooks.label.borrow().clone();
    let lines: Vec<String> = match access {
        Access::Known { writes, .. } => writes
            .iter()
            .filter(|b| !b.is_dirty())
            .map(|b| {
                format!(
                    "dirty: {label} writes buffer {} ({:.1} MiB)",
                    b.id(),
                    b.size() as f64 / f64::from(1u32 << 20)
                )
            })
            .collect(),
        Access::Opaque => vec![format!("dirty: opaque {label}: every buffer")],
    };
    for l in lines {
        if LINES.fetch_add(1, Ordering::Relaxed) < 400 {
            // Asked for explicitly: on stderr whatever POSSUM_VERBOSE says.
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "possum: {l}");
        }
    }
}

/// The hook's second half for an operation `admit` let in with `guard`: while the engine
/// tracks, it checks `access` (the operation may wait or be refused); the guard (and a launch's
/// validation) is kept for the exit callback.
fn hook(
    t: &ThreadState,
    eng: Option<&DevEngine>,
    guard: Option<OpGuard<'static, CudaDevice>>,
    stream: u64,
    access: Access<'_>,
    others: Others<'_>,
    validation: Option<Box<validate::Before>>,
) {
    if let (Some(e), Some(g)) = (eng, &guard) {
        if g.tracking() {
            let _r = Reentry::enter();
            if debug_dirty() {
                log_newly_dirty(t, &access);
            }
            if let Err(err) = e.with_stream(t, stream, |s| g.check(s, access)) {
                // The operation runs anyway (refusing it would break the job), perhaps before
                // the buffers it writes were saved: the checkpoint open now must not commit.
                let st = state();
                st.counters.hook_errors.fetch_add(1, Ordering::Relaxed);
                crate::ops::gate::note_fault(&format!("hook: {err}"));
            }
        }
    }
    // An operation whose buffers possum does not know may write any device's memory (a kernel
    // or graph through peer access, a copy it cannot decode): every other engine takes it as
    // writing all its buffers.
    let others = if matches!(access, Access::Opaque) {
        Others::Every
    } else {
        others
    };
    let others = hook_foreign(t, eng, guard.is_some(), stream, others);
    keep(t, guard, others, validation);
}

/// The buffers of other devices than its own that an operation touches (`foreign`), hooked by
/// their own engines: a write lands on the buffer's device, and is marked there. Each such
/// engine's gate is entered: directly when the operation holds its own device's gate (it was
/// admitted before any pause, and must not wait for one while holding it), else through the
/// pause ([`crate::ops::gate::admit`]). While that engine tracks, its buffers are checked on the job's
/// stream. Returns the guards, kept until the exit callback.
///
/// With [`Others::Every`] (an operation whose buffers possum does not know: it may write any
/// device's memory through peer access), every other engine takes it as touching all its
/// buffers. Nothing is allocated when there is no other engine.
fn hook_foreign(
    t: &ThreadState,
    own: Option<&DevEngine>,
    admitted: bool,
    stream: u64,
    others: Others<'_>,
) -> Vec<OpGuard<'static, CudaDevice>> {
    let st = state();
    let mut guards = Vec::new();
    match others {
        Others::Listed([]) => {}
        Others::Listed(foreign) => {
            let mut devs: Vec<usize> = foreign.iter().map(|f| f.dev).collect();
            devs.sort_unstable();
            devs.dedup();
            for d in devs {
                if let Some(e) = st.engine_ref(d) {
                    guards.extend(hook_other(t, st, e, own, admitted, stream, others));
                }
            }
        }
        Others::Every => {
            for e in st.engine_refs() {
                guards.extend(hook_other(t, st, e, own, admitted, stream, others));
            }
        }
    }
    guards
}

/// [`hook_foreign`] for engine `e`: its guard, or `None` for the operation's own engine.
fn hook_other(
    t: &ThreadState,
    st: &'static State,
    e: &'static DevEngine,
    own: Option<&DevEngine>,
    admitted: bool,
    stream: u64,
    others: Others<'_>,
) -> Option<OpGuard<'static, CudaDevice>> {
    let d = e.ordinal;
    if own.is_some_and(|o| o.ordinal == d) {
        return None;
    }
    let g = if admitted {
        e.engine.enter_op()
    } else {
        crate::ops::gate::admit(e)
    };
    if g.tracking() {
        let (writes, reads): (Vec<Buffer>, Vec<Buffer>) = match others {
            Others::Listed(foreign) => {
                let mine = || foreign.iter().filter(|f| f.dev == d);
                (
                    mine().filter(|f| f.write).map(|f| f.buf.clone()).collect(),
                    mine().filter(|f| !f.write).map(|f| f.buf.clone()).collect(),
                )
            }
            Others::Every => (Vec::new(), Vec::new()),
        };
        let access = match others {
            Others::Listed(_) => Access::Known {
                reads: &reads,
                writes: &writes,
            },
            Others::Every => Access::Opaque,
        };
        let _r = Reentry::enter();
        if debug_dirty() {
            log_newly_dirty(t, &access);
        }
        // The job's stream as its own device's engine knows it: the other engine makes it
        // wait for its copies (an event of one device waited for on another's stream), but
        // does not take it among the streams it fences (an event is recorded only on a
        // stream of its own context).
        let check = |s: &CudaStream| g.check(s, access);
        let r = match own {
            Some(o) => o.with_stream(t, stream, check),
            None => e.with_stream(t, stream, check),
        };
        if let Err(err) = r {
            st.counters.hook_errors.fetch_add(1, Ordering::Relaxed);
            crate::base::log::log(&format!("hook (device {d}): {err}"));
        }
    }
    Some(g)
}

/// Keeps an admitted operation's guards (and validation) until the exit callback.
#[inline]
fn keep(
    t: &ThreadState,
    guard: Option<OpGuard<'static, CudaDevice>>,
    others: Vec<OpGuard<'static, CudaDevice>>,
    validation: Option<Box<validate::Before>>,
) {
    t.hooks.guard.set(guard);
    // (`more` is set here only if an operation's exit callback never came: its leftovers are
    // replaced, as everything else it left.)
    if !others.is_empty() || validation.is_some() || t.hooks.more.get() {
        keep_more(t, others, validation);
    }
}

/// [`keep`] for an operation that has only its own device's guard to keep (one not resolved).
#[inline]
fn keep_guard(t: &ThreadState, guard: Option<OpGuard<'static, CudaDevice>>) {
    t.hooks.guard.set(guard);
    if t.hooks.more.get() {
        keep_more(t, Vec::new(), None);
    }
}

/// [`keep`]'s rarer part: the guards of other devices, a validation (and the slot's leftovers
/// replaced).
#[cold]
fn keep_more(
    t: &ThreadState,
    others: Vec<OpGuard<'static, CudaDevice>>,
    validation: Option<Box<validate::Before>>,
) {
    let mut p = t.hooks.pending.borrow_mut();
    p.others = others;
    p.validation = validation
        .map(|v| -> Box<dyn FnOnce()> { Box::new(move || validate::finish(state(), *v)) });
    let more = !p.others.is_empty() || p.validation.is_some() || p.timed.is_some();
    t.hooks.more.set(more);
}

fn engine_of(st: &'static State, t: &ThreadState, ctx: u64) -> Option<&'static DevEngine> {
    st.device_of(t, ctx)
        .and_then(|d| st.engine_ref(d))
        .map(|e| &**e)
}

/// Resolves `words` (the slots of `model`) against the snapshot `ranges` into `sets` (the hook's
/// lists hold managed buffers of device `dev` only). With `discover`, a word no known allocation
/// contains but near one is asked of the driver ([`State::discover`]; `ranges` is then taken
/// again). Returns (touched an unmanaged allocation, needed discovery: then the launch named an
/// allocation possum did not know).
fn resolve_slots(
    st: &State,
    ranges: &mut Arc<Ranges>,
    discover: bool,
    dev: Option<usize>,
    model: &KernelModel,
    words: &[u64],
    sets: &mut BufferSets,
) -> (bool, bool) {
    let mut unmanaged = false;
    let mut discovered = false;
    let mut pointer_words = 0;
    for (i, &w) in words.iter().enumerate() {
        if w == 0 {
            continue;
        }
        let mut r = ranges.lookup(w);
        if matches!(r, Resolved::None) {
            // Every managed buffer is in the snapshot: an unknown word can only be an allocation
            // possum does not manage (or no pointer at all). The driver is asked only on
            // validated launches, off the fast path.
            if !discover || !ranges.near(w) || !st.discover(w) {
                continue;
            }
            discovered = true;
            *ranges = st.ranges();
            r = ranges.lookup(w);
        }
        pointer_words += 1;
        let ro = model.classify(i) == SlotAccess::Read;
        match &r {
            Resolved::None => continue,
            Resolved::Unmanaged(..) => unmanaged = true,
            Resolved::Managed(b, d) if Some(*d) == dev => {
                if !ro {
                    model.note_named(i);
                }
                push_buffer(b, ro, &mut sets.reads, &mut sets.writes)
            }
            // Another device's buffer (peer access): hooked by its own engine.
            Resolved::Managed(b, d) => push_foreign(&mut sets.foreign, *d, b, !ro),
        }
        if st.cfg.tuning.dag {
            if let Some(br) = r.buf_ref() {
                sets.add_dag(br, !ro);
            }
        }
    }
    st.counters
        .pointer_words
        .fetch_add(pointer_words, Ordering::Relaxed);
    (unmanaged, discovered)
}

fn push_buffer(b: &Buffer, read_only: bool, reads: &mut Vec<Buffer>, writes: &mut Vec<Buffer>) {
    let id = b.id();
    if writes.iter().any(|x| x.id() == id) {
        return;
    }
    if read_only {
        if !reads.iter().any(|x| x.id() == id) {
            reads.push(b.clone());
        }
    } else {
        reads.retain(|x| x.id() != id);
        writes.push(b.clone());
    }
}

impl Ways {
    /// The kernel's current model (borrowed, not cloned: no reference count touched per
    /// launch) and memo entries: the model taken at the thread's first launch of `func`, or its
    /// successor once it was replaced (its layout came with a module loaded later; the entries
    /// made under the old one are dropped).
    #[inline]
    fn current<'a>(
        w: &'a mut Ways,
        st: &State,
        func: u64,
    ) -> (&'a Arc<KernelModel>, &'a mut MemoSet) {
        if !matches!(&w.model, Some(m) if m.successor().is_none()) {
            Self::renew(w, st, func);
        }
        let model = w.model.as_ref().expect("just made");
        (model, &mut w.memo)
    }

    /// [`Self::current`]'s model made (the thread's first launch of `func`) or replaced by its
    /// successor.
    #[cold]
    fn renew(w: &mut Ways, st: &State, func: u64) {
        if let Some(next) = w.model.as_ref().and_then(|m| m.successor()).cloned() {
            for m in &w.memo.entries {
                if m.dag != 0 {
                    st.to_dag(DagMsg::Forget(m.dag));
                }
            }
            w.memo = MemoSet::default();
            w.model = Some(next);
        }
        if w.model.is_none() {
            crate::process::stats::note_function(func as usize);
            w.model = Some(st.kernel(func));
        }
    }
}

fn launch(
    st: &'static State,
    t: &ThreadState,
    ctx: u64,
    func: u64,
    stream: u64,
    args: &KernelArgs<'_>,
) {
    if skip_captured(st, stream) {
        crate::process::stats::note_function(func as usize);
        return;
    }
    let mut memo = t.hooks.memo.borrow_mut();
    let memo = memo.get_or_insert_with(HashMap::default);
    // A look-up without the entry API's insertion path first: a thread launches a kernel for the
    // first time once.
    let w = match memo.get_mut(&func) {
        Some(w) => w,
        None => memo.entry(func).or_default(),
    };
    let (model, ways) = Ways::current(w, st, func);
    // A collective (NCCL's kernels) passes the cut's barrier first, outside the op gate.
    if model.is_collective() {
        crate::ops::collective::pass(crate::ops::gate::is_paused);
    }
    let c = &st.counters;
    let n = c.launches.fetch_add(1, Ordering::Relaxed);
    let eng = engine_of(st, t, ctx);
    let guard = admit(t, eng, stream);
    let tracking = guard.as_ref().is_some_and(OpGuard::tracking);
    let resolve = tracking || st.cfg.tuning.resolve.sampled(n);
    {
        let (_, due) = model.next_launch(st.validation());
        // Validation reads every buffer: never while a session may have released some of them
        // or is copying them (the launch is then just not validated).
        let validate_now = due && !eng.is_some_and(|e| e.engine.session_active());
        if !resolve && !validate_now {
            st.note_unresolved();
            keep_guard(t, guard);
            return;
        }
        resolve_launch(
            st,
            t,
            eng,
            guard,
            (model, ways),
            (func, stream, args),
            (n, tracking, validate_now),
        );
    }
}

/// The rest of [`launch`] for one that is resolved (while the engine tracks, in a sampling
/// window, or validated): `kernel` is its model and memo entries, `op` the function, stream and
/// arguments, `when` the launch's process-wide number, whether the engine tracks and whether the
/// launch is validated.
#[inline(never)]
fn resolve_launch(
    st: &'static State,
    t: &ThreadState,
    eng: Option<&'static DevEngine>,
    guard: Option<OpGuard<'static, CudaDevice>>,
    kernel: (&Arc<KernelModel>, &mut MemoSet),
    op: (u64, u64, &KernelArgs<'_>),
    when: (u64, bool, bool),
) {
    let (model, ways) = kernel;
    let (func, stream, args) = op;
    let (n, tracking, validate_now) = when;
    let c = &st.counters;
    c.launches_examined.fetch_add(1, Ordering::Relaxed);
    if guard.is_some() {
        c.launches_hooked.fetch_add(1, Ordering::Relaxed);
    }
    let mut s = t.hooks.scratch.borrow_mut();
    let s = &mut *s;
    let generation = st.generation();
    let ranges = ranges_at(&mut s.ranges, st, generation);
    let span = ranges.span();
    let words = &mut s.words;
    let version = model.speculation_version();
    // The words are hashed where the job wrote them; they are copied out only to be
    // resolved (a miss) or validated. A validated launch never reuses an entry.
    let hash = (!validate_now).then(|| {
        let mut h = WordHash::default();
        args.for_each_slot(model.slot_runs(), |w| h.push(span.canon(w)));
        h.finish()
    });
    let found = hash.and_then(|h| ways.find(generation, version, h));
    let hit = found.is_some();
    let slot = found.unwrap_or_else(|| {
        args.read_slots(model.slot_runs(), words);
        ways.victim(hash.unwrap_or_else(|| WordHash::of_canonical(words, span)))
    });
    ways.last = slot;
    let m = &mut ways.entries[slot];
    // A reused entry needed no discovery (see `Memo`).
    let identified = if hit {
        c.memo_hits.fetch_add(1, Ordering::Relaxed);
        true
    } else {
        fill_memo(
            st,
            ranges,
            eng,
            model,
            words,
            m,
            (generation, version, validate_now),
        )
    };
    let opaque = count_launch(st, model, tracking, identified, m.unmanaged);
    if st.cfg.tuning.dag {
        st.to_dag(DagMsg::Launch {
            op: DagOp::Kernel(func),
            stream,
            sets: SetsRef::Memo(m.dag),
        });
    }
    let access = if opaque {
        Access::Opaque
    } else {
        m.sets.access()
    };
    label_op(t, || launch_label(model, args, &access, n, hit));
    let before = (validate_now && !model.is_opaque())
        .then(|| validate::begin(st, eng, model, words))
        .flatten();
    hook(
        t,
        eng,
        guard,
        stream,
        access,
        Others::Listed(&m.sets.foreign),
        before,
    );
}

/// Fills memo entry `m` for a launch of `model` whose slots hold `words` (a miss): its buffer
/// sets resolved against `ranges` (`when`: the allocations' generation, the model's speculation
/// version, whether the launch is validated), its DAG lists defined. Whether the buffers were
/// all identified (no allocation discovered).
fn fill_memo(
    st: &'static State,
    ranges: &Arc<Ranges>,
    eng: Option<&'static DevEngine>,
    model: &KernelModel,
    words: &[u64],
    m: &mut Memo,
    when: (u64, u64, bool),
) -> bool {
    let (generation, version, validate_now) = when;
    let c = &st.counters;
    model.note_resolved();
    m.sets.clear();
    let (unmanaged, discovered) = resolve_slots(
        st,
        &mut ranges.clone(),
        validate_now,
        eng.map(|e| e.ordinal),
        model,
        words,
        &mut m.sets,
    );
    if discovered {
        c.launches_discovered.fetch_add(1, Ordering::Relaxed);
    }
    if validate_now && !discovered && !model.is_opaque() {
        c.validated_launches_identified
            .fetch_add(1, Ordering::Relaxed);
    }
    // Discovery changed the allocations: the next launch resolves again.
    m.generation = if discovered { u64::MAX } else { generation };
    m.version = version;
    m.unmanaged = unmanaged;
    if st.cfg.tuning.dag {
        if m.dag != 0 {
            st.to_dag(DagMsg::Forget(m.dag));
        }
        m.dag = st.next_dag_id();
        st.to_dag(DagMsg::Define {
            id: m.dag,
            sets: DagSets::new(&m.sets.dag_reads, &m.sets.dag_writes),
        });
    }
    !discovered
}

/// Counts a resolved launch of `model` by what possum knows of its buffers; whether it is taken
/// as opaque (it touches every buffer).
fn count_launch(
    st: &State,
    model: &KernelModel,
    tracking: bool,
    identified: bool,
    unmanaged: bool,
) -> bool {
    let c = &st.counters;
    // A kernel never validated (first seen while a checkpoint copies, or validation off or
    // failed) may reach buffers its parameters do not name: while the engine tracks, it
    // touches every buffer.
    let unproven = tracking && !model.is_validated() && !model.is_opaque();
    if unproven {
        c.launches_unvalidated.fetch_add(1, Ordering::Relaxed);
    }
    let opaque = model.is_opaque() || unproven;
    if opaque {
        c.launches_opaque.fetch_add(1, Ordering::Relaxed);
    } else if identified {
        c.launches_identified.fetch_add(1, Ordering::Relaxed);
    }
    if unmanaged {
        c.launches_unmanaged.fetch_add(1, Ordering::Relaxed);
    }
    opaque
}

/// The label of launch `n` of `model` ([`debug_dirty`]): which of its words name each buffer
/// `access` newly marks written, and whether their slots are speculated read-only.
fn launch_label(
    model: &KernelModel,
    args: &KernelArgs<'_>,
    access: &Access<'_>,
    n: u64,
    hit: bool,
) -> String {
    let mut fresh = Vec::new();
    args.read_slots(model.slot_runs(), &mut fresh);
    let mut why = String::new();
    if let Access::Known { writes, .. } = access {
        for b in writes.iter().filter(|b| !b.is_dirty()) {
            let slots: Vec<String> = fresh
                .iter()
                .enumerate()
                .filter(|(_, &w)| b.contains(possum_engine::device::DevPtr(w)))
                .map(|(i, &w)| {
                    let ro = if model.is_readonly(i) { "ro" } else { "rw" };
                    format!("{i}:{ro}+{:#x}", w - b.va().0)
                })
                .collect();
            why.push_str(&format!(
                " [buffer {} at {:#x}: slots {}]",
                b.id(),
                b.va().0,
                slots.join(",")
            ));
        }
    }
    format!(
        "kernel {} (launch {}, memo {}){why}",
        model.name().unwrap_or("?"),
        n,
        if hit { "hit" } else { "miss" }
    )
}

fn graph_launch(st: &'static State, t: &ThreadState, ctx: u64, exec: u64, stream: u64) {
    if skip_captured(st, stream) {
        return;
    }
    let c = &st.counters;
    c.graph_launches.fetch_add(1, Ordering::Relaxed);
    let eng = engine_of(st, t, ctx);
    let guard = admit(t, eng, stream);
    let Some(snap) = st.graph(exec).filter(|g| g.opaque.is_none()) else {
        c.graph_launches_opaque.fetch_add(1, Ordering::Relaxed);
        hook(
            t,
            eng,
            guard,
            stream,
            Access::Opaque,
            Others::Listed(&[]),
            None,
        );
        return;
    };
    if !resolving(st, guard.as_ref()) {
        keep_guard(t, guard);
        return;
    }
    {
        let s = &mut *t.hooks.scratch.borrow_mut();
        let mut ranges = ranges_at(&mut s.ranges, st, st.generation()).clone();
        let sets = &mut s.sets;
        sets.clear();
        let mut opaque = false;
        for node in &snap.nodes {
            c.graph_nodes_expanded.fetch_add(1, Ordering::Relaxed);
            // Each node is its own record in the DAG; the hook gets the union of their buffers.
            sets.dag_reads.clear();
            sets.dag_writes.clear();
            let kref = match node {
                SnapNode::Kernel { model, words } => {
                    // A kernel seen only in graphs is never validated: it may reach buffers its
                    // parameters do not name.
                    opaque |= model.is_opaque() || !model.is_validated();
                    resolve_slots(
                        st,
                        &mut ranges,
                        false,
                        eng.map(|e| e.ordinal),
                        model,
                        words,
                        sets,
                    );
                    DagOp::Kernel(model.handle())
                }
                SnapNode::Memset { dst } => {
                    let r = ranges.lookup(*dst);
                    // This engine's buffers; another device's are hooked by its own engine.
                    match (&r, eng.map(|e| e.ordinal)) {
                        (Resolved::Managed(b, d), own) if Some(*d) == own => {
                            push_buffer(b, false, &mut sets.reads, &mut sets.writes);
                        }
                        (Resolved::Managed(b, d), _) => {
                            push_foreign(&mut sets.foreign, *d, b, true)
                        }
                        _ => {}
                    }
                    sets.dag_writes.extend(r.buf_ref());
                    DagOp::Memset
                }
            };
            if st.cfg.tuning.dag {
                st.to_dag(DagMsg::Launch {
                    op: kref,
                    stream,
                    sets: SetsRef::Once(DagSets::new(&sets.dag_reads, &sets.dag_writes)),
                });
            }
        }
        let access = if opaque {
            c.graph_launches_opaque.fetch_add(1, Ordering::Relaxed);
            Access::Opaque
        } else {
            sets.access()
        };
        label_op(t, || "graph launch".to_string());
        hook(
            t,
            eng,
            guard,
            stream,
            access,
            Others::Listed(&sets.foreign),
            None,
        );
    }
}

/// A copy (`src` is `Some`) or memset: `dst` is written, `src` read; host addresses resolve to
/// nothing.
fn copy_like(
    st: &'static State,
    t: &ThreadState,
    ctx: u64,
    stream: StreamAt,
    call: &RawCall<'_>,
    src: Option<u64>,
    dst: u64,
) {
    let s = call.stream(stream);
    if skip_captured(st, s) {
        return;
    }
    let c = &st.counters;
    if src.is_some() {
        c.copies.fetch_add(1, Ordering::Relaxed);
    } else {
        c.memsets.fetch_add(1, Ordering::Relaxed);
    }
    let eng = engine_of(st, t, ctx);
    let guard = admit(t, eng, s);
    if !resolving(st, guard.as_ref()) {
        keep_guard(t, guard);
        return;
    }
    let dev = eng.map(|e| e.ordinal);
    let look = |r: &Ranges| (src.map_or(Resolved::None, |a| r.lookup(a)), r.lookup(dst));
    // The thread's snapshot (no lock).
    let (rd, wr) = look(ranges_at(
        &mut t.hooks.scratch.borrow_mut().ranges,
        st,
        st.generation(),
    ));
    label_op(t, || {
        let what = if src.is_some() { "copy" } else { "memset" };
        format!("{what} to {dst:#x}")
    });
    // At most one buffer each way; one both read and written is only in `writes`.
    let written = managed_on(&wr, dev);
    let read = managed_on(&rd, dev).filter(|b| written.is_none_or(|w| w.id() != b.id()));
    // Another device's buffers (a peer copy): hooked by their own engines.
    let mut foreign = Vec::new();
    for (r, write) in [(&wr, true), (&rd, false)] {
        if let Resolved::Managed(b, d) = r {
            if Some(*d) != dev {
                push_foreign(&mut foreign, *d, b, write);
            }
        }
    }
    if st.cfg.tuning.dag && (rd.key().is_some() || wr.key().is_some()) {
        st.to_dag(DagMsg::Launch {
            op: if src.is_some() {
                DagOp::Memcpy
            } else {
                DagOp::Memset
            },
            stream: s,
            sets: SetsRef::Once(Arc::new(DagSets {
                reads: rd.buf_ref().into_iter().collect(),
                writes: wr.buf_ref().into_iter().collect(),
            })),
        });
    }
    hook(
        t,
        eng,
        guard,
        s,
        Access::Known {
            reads: read.map_or(&[], std::slice::from_ref),
            writes: written.map_or(&[], std::slice::from_ref),
        },
        Others::Listed(&foreign),
        None,
    );
}

/// An operation of [`Shape::Write`] (2D/3D and peer copies, 2D memsets, stream memory
/// operations): the device ranges its params name ([`RawCall::write_spans`]) resolved to the
/// buffers they lie in, of whichever device, written or read; one it cannot decode is opaque.
fn write_op(
    st: &'static State,
    t: &ThreadState,
    ctx: u64,
    cbid: u32,
    at: WriteAt,
    stream: StreamAt,
    call: &RawCall<'_>,
) {
    let s = call.stream(stream);
    if skip_captured(st, s) {
        return;
    }
    let copy = matches!(
        at,
        WriteAt::Span { .. } | WriteAt::Copy2D | WriteAt::Copy3D | WriteAt::CopyBatch
    );
    let c = &st.counters;
    if copy {
        c.copies.fetch_add(1, Ordering::Relaxed);
    } else {
        c.memsets.fetch_add(1, Ordering::Relaxed);
    }
    let eng = engine_of(st, t, ctx);
    let name = || crate::cuda::cbid::lookup(cbid).map_or("?", |c| c.name);
    let (mut writes, mut reads) = (Vec::new(), Vec::new());
    if !call.write_spans(at, &mut writes, &mut reads) {
        st.counters.opaque_ops.fetch_add(1, Ordering::Relaxed);
        label_op(t, || format!("operation {}", name()));
        let guard = admit(t, eng, s);
        hook(t, eng, guard, s, Access::Opaque, Others::Listed(&[]), None);
        return;
    }
    let guard = admit(t, eng, s);
    if !resolving(st, guard.as_ref()) {
        keep_guard(t, guard);
        return;
    }
    let dev = eng.map(|e| e.ordinal);
    let look = |r: &Ranges| {
        let side = |spans: &[Span]| -> Vec<Resolved> {
            let mut out: Vec<Resolved> = Vec::new();
            for &(start, len) in spans.iter().filter(|sp| sp.1 > 0) {
                // A range lies in one allocation; its last byte is looked up too, so that one
                // that runs into the next buffer marks both.
                for a in [start, start.saturating_add(len - 1)] {
                    let r = r.lookup(a);
                    if r.key().is_some() && !out.iter().any(|x| x.key() == r.key()) {
                        out.push(r);
                    }
                }
            }
            out
        };
        (side(&reads), side(&writes))
    };
    let (rd, wr) = look(ranges_at(
        &mut t.hooks.scratch.borrow_mut().ranges,
        st,
        st.generation(),
    ));
    label_op(t, || {
        format!("{} to {:#x}", name(), writes.first().map_or(0, |w| w.0))
    });
    let mut sets = BufferSets::default();
    for (side, write) in [(&wr, true), (&rd, false)] {
        for r in side.iter() {
            match r {
                Resolved::Managed(b, d) if Some(*d) == dev => {
                    push_buffer(b, !write, &mut sets.reads, &mut sets.writes);
                }
                Resolved::Managed(b, d) => push_foreign(&mut sets.foreign, *d, b, write),
                _ => {}
            }
            if let Some(br) = r.buf_ref() {
                sets.add_dag(br, write);
            }
        }
    }
    if st.cfg.tuning.dag && !(sets.dag_reads.is_empty() && sets.dag_writes.is_empty()) {
        st.to_dag(DagMsg::Launch {
            op: if copy { DagOp::Memcpy } else { DagOp::Memset },
            stream: s,
            sets: SetsRef::Once(DagSets::new(&sets.dag_reads, &sets.dag_writes)),
        });
    }
    hook(
        t,
        eng,
        guard,
        s,
        sets.access(),
        Others::Listed(&sets.foreign),
        None,
    );
}

/// The managed buffer `r` resolved to, if it belongs to device `dev`.
fn managed_on(r: &Resolved, dev: Option<usize>) -> Option<&Buffer> {
    match r {
        Resolved::Managed(b, d) if Some(*d) == dev => Some(b),
        _ => None,
    }
}
