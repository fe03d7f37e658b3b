//! Per-kernel speculation and validation state: which parameter slots are read-only, whether the
//! kernel is opaque, and the sampling helpers validation uses.
//!
//! A [`KernelModel`] is shared between the job's threads. The launch-path methods
//! ([`KernelModel::next_launch`], [`KernelModel::is_opaque`], [`KernelModel::is_readonly`],
//! [`KernelModel::classify`]) use atomics only; [`KernelModel::opaque_reason`] clones a string and
//! is meant for reports.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use serde::Serialize;

use crate::layout::{slot_runs, ParamLayout, Slot, SlotRun};

/// [`ValidationConfig::sample_bytes`] that reads whole buffers.
pub const WHOLE: u64 = u64::MAX;

/// The default [`ValidationConfig::sample_bytes`]: 256 KiB per buffer.
pub const SAMPLED: u64 = 256 << 10;

/// How often launches are validated, and how read-only speculation is earned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidationConfig {
    /// Validate the first N launches of each kernel.
    pub first_launches: u32,
    /// Then validate every Kth launch (launch numbers divisible by K); 0 = never.
    pub every: u64,
    /// A slot whose buffer was unchanged across this many validated launches (and never seen
    /// changed) is speculated read-only; 0 (`strict`): never, every slot that names a buffer
    /// counts as a write of it. The default is [`READONLY_AFTER`]. Observation cannot prove that
    /// a kernel never writes a slot's buffer (a write that happens only on some launches, such
    /// as an overflow flag, or that writes the value already there, looks like no write on the
    /// launches validated): a wrong speculation costs a checkpoint its image, never its
    /// correctness, because every image is proven equal to the job at T0 by content (each
    /// chunk's fingerprint) before it is committed, and a mismatch takes the verdicts back
    /// ([`KernelModel::revoke_readonly`]) and the checkpoint again.
    pub readonly_after: u32,
    /// Bytes checksummed per buffer: [`WHOLE`] (`sample=all`) reads every byte of every buffer on
    /// both sides of a validated launch; a number samples that many bytes per buffer in
    /// [`Self::windows`] windows, which can miss a write outside them. The default is [`WHOLE`]
    /// (read-only verdicts rest on it; a device with fingerprints reads whole buffers at its
    /// memory bandwidth); `strict` makes it [`SAMPLED`] (no verdict rests on the sample, and
    /// whole buffers read through the host cost two full reads of every buffer a kernel reaches
    /// on each validated launch: a GPT-2 job with expandable segments ran 3x longer on an H200).
    /// Read-only speculation (`readonly_after` > 0) without a `sample` makes it [`WHOLE`].
    pub sample_bytes: u64,
    /// The sampled bytes are spread over this many windows.
    pub windows: u32,
    /// While some slot that named a buffer has no verdict yet (neither read-only nor seen
    /// changed), launches whose number is a power of two are validated too, up to this launch
    /// number; 0 = never. A slot gets a verdict only from validated launches that find a buffer
    /// behind it, and the first ones may not (the word named nothing then, or a constant buffer):
    /// without this it stayed read-write for good, and every launch marked its buffer written.
    pub recheck_until: u64,
}

/// The default [`ValidationConfig::readonly_after`].
pub const READONLY_AFTER: u32 = 2;

impl Default for ValidationConfig {
    fn default() -> Self {
        Self {
            first_launches: 2,
            every: 0,
            readonly_after: READONLY_AFTER,
            sample_bytes: WHOLE,
            windows: 16,
            recheck_until: 1024,
        }
    }
}

impl ValidationConfig {
    /// Parses `"first=3,every=1000,readonly_after=2,sample=262144,windows=16,recheck=1024"`:
    /// any subset of the keys, the rest keep their defaults (`readonly_after` > 0 without `sample`
    /// reads whole buffers, `sample=all`). `strict` sets `readonly_after=0` and the sampled
    /// reads (no read-only speculation: every buffer a kernel names counts as written). `off`
    /// sets `first=0,every=0,recheck=0` (validation never runs). The error names the key or
    /// item at fault.
    pub fn from_env_str(s: &str) -> Result<Self, String> {
        let mut cfg = Self::default();
        let mut sample_given = false;
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            if item == "off" {
                cfg.first_launches = 0;
                cfg.every = 0;
                cfg.recheck_until = 0;
                continue;
            }
            if item == "strict" {
                cfg.readonly_after = 0;
                if !sample_given {
                    cfg.sample_bytes = SAMPLED;
                }
                continue;
            }
            let Some((key, value)) = item.split_once('=') else {
                return Err(format!("`{item}`: expected key=value or `off`"));
            };
            let (key, value) = (key.trim(), value.trim());
            let bad = |e: std::num::ParseIntError| format!("key `{key}`: bad value `{value}`: {e}");
            match key {
                "first" => cfg.first_launches = value.parse().map_err(bad)?,
                "every" => cfg.every = value.parse().map_err(bad)?,
                "readonly_after" => cfg.readonly_after = value.parse().map_err(bad)?,
                "sample" if value == "all" => {
                    cfg.sample_bytes = WHOLE;
                    sample_given = true;
                }
                "sample" => {
                    cfg.sample_bytes = value.parse().map_err(bad)?;
                    sample_given = true;
                }
                "windows" => cfg.windows = value.parse().map_err(bad)?,
                "recheck" => cfg.recheck_until = value.parse().map_err(bad)?,
                _ => {
                    return Err(format!(
                    "unknown key `{key}` (known: first, every, readonly_after, sample, windows, \
                         recheck, strict, off)"
                ))
                }
            }
        }
        if cfg.readonly_after > 0 && !sample_given {
            cfg.sample_bytes = WHOLE;
        }
        Ok(cfg)
    }
}

/// A set of slot indices, of any size (a kernel's by-value struct can hold hundreds of words:
/// PyTorch's reductions pass 131, its multi-tensor kernels over 400).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotSet(Vec<u64>);

impl SlotSet {
    /// The slots of the low 64 indices set in `mask`.
    pub fn from_mask(mask: u64) -> SlotSet {
        SlotSet(if mask == 0 { Vec::new() } else { vec![mask] })
    }

    /// Adds slot `i`.
    pub fn insert(&mut self, i: usize) {
        let w = i / 64;
        if self.0.len() <= w {
            self.0.resize(w + 1, 0);
        }
        self.0[w] |= 1 << (i % 64);
    }

    /// Removes slot `i`.
    pub fn remove(&mut self, i: usize) {
        if let Some(w) = self.0.get_mut(i / 64) {
            *w &= !(1 << (i % 64));
        }
    }

    /// Whether slot `i` is in the set.
    pub fn contains(&self, i: usize) -> bool {
        self.0.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    /// The slots in the set, in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.0.iter().enumerate().flat_map(|(k, &w)| {
            (0..64)
                .filter(move |b| w & (1 << b) != 0)
                .map(move |b| k * 64 + b)
        })
    }
}

/// What one validated launch showed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Validation {
    /// Ids of buffers predicted untouched whose checksum changed.
    pub changed_untouched: Vec<u64>,
    /// Slots whose buffer (or own window, for a buffer shared with another slot) changed.
    pub slot_changed: SlotSet,
    /// Slots whose buffer did not change, and whose sampled bytes were not all one byte value
    /// before the launch (see [`uniform_byte`]: a constant region cannot show a write of that
    /// constant). A slot in neither set gave no evidence either way.
    pub slot_unchanged: SlotSet,
    /// A slot whose buffer holds a live device pointer: (slot index, the pointer value found).
    pub pointer_table: Option<(usize, u64)>,
    /// Every slot that named a buffer at this launch (whatever the verdict): one with none keeps
    /// its kernel validated again ([`ValidationConfig::recheck_until`]).
    pub slot_named: SlotSet,
}

/// The outcome of [`KernelModel::record_validation`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing this validation saw contradicts the speculation.
    Consistent,
    /// This validation made the kernel opaque, for the reason given.
    Opaque(String),
}

/// How a launch is taken to use the buffer a slot names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum SlotAccess {
    /// Speculated read-only.
    Read,
    /// Read and (maybe) written.
    ReadWrite,
}

/// Whether kernel `name` (mangled or not) is one of NCCL's collective or point-to-point kernels
/// (`ncclDevKernel_AllReduce_Sum_f32_RING_LL`; `ncclKernel_...` in older NCCL).
pub fn is_collective_name(name: &str) -> bool {
    name.contains("ncclDevKernel") || name.contains("ncclKernel")
}

/// A snapshot of a kernel's counters, for reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KernelStats {
    /// The kernel handle (CUfunction or CUkernel value).
    pub handle: u64,
    /// Its (mangled) name, when known.
    pub name: Option<String>,
    /// Launches seen.
    pub launches: u64,
    /// Validations recorded.
    pub validated: u64,
    /// Launches whose words had to be resolved (the launch path's memo did not have them): a
    /// kernel whose every launch is resolved changes some pointer word every time.
    pub resolved: u64,
    /// Whether the kernel is treated as touching every buffer.
    pub opaque: bool,
    /// Why it is opaque.
    pub opaque_reason: Option<String>,
    /// Slots speculated read-only now.
    pub readonly_slots: u32,
    /// Pointer slots of its layout.
    pub slots: u32,
}

/// Speculation and validation state of one kernel handle.
/// `repr(C)`: what every launch reads (`launches`, `has_layout`) first.
#[derive(Debug)]
#[repr(C)]
pub struct KernelModel {
    launches: AtomicU64,
    /// Whether the model was made with a parameter layout.
    has_layout: bool,
    /// Whether the kernel is one of NCCL's collectives ([`is_collective_name`]).
    collective: bool,
    /// The model that replaces this one (it had no layout; one came later): launches move on to
    /// it ([`KernelModel::successor`]).
    successor: OnceLock<Arc<KernelModel>>,
    handle: u64,
    name: Option<String>,
    slots: Vec<Slot>,
    /// `slots` as runs (what a launch reads).
    runs: Vec<SlotRun>,
    validated: AtomicU64,
    /// Validations that changed a slot's verdict ([`Self::speculation_version`]).
    spec_changes: AtomicU64,
    resolved: AtomicU64,
    /// Set (once, to the first reason given) when the kernel becomes opaque: the kernel is opaque
    /// exactly when this is set.
    opaque_reason: OnceLock<String>,
    /// Slots ever seen changed: read-write forever (a bit per slot).
    rw_mask: Vec<AtomicU64>,
    /// Slots speculated read-only (a bit per slot).
    ro_mask: Vec<AtomicU64>,
    /// Per slot: validated launches that saw its buffer unchanged.
    unchanged: Vec<AtomicU32>,
    /// Slots seen naming a buffer (a bit per slot): at a validation or a resolution.
    named: Vec<AtomicU64>,
    /// Some slot of `named` has no verdict yet (neither read-only nor read-write): launches are
    /// validated again ([`ValidationConfig::recheck_until`]).
    undecided: AtomicBool,
}

impl KernelModel {
    /// State for a newly seen kernel. Without a layout the kernel is opaque from the start.
    pub fn new(handle: u64, name: Option<String>, layout: Option<ParamLayout>) -> Self {
        Self::build(handle, name, layout, || "no parameter layout".to_string())
    }

    /// State for a kernel whose layout could not be had, opaque from the start for reason `why`.
    pub fn without_layout(handle: u64, name: Option<String>, why: String) -> Self {
        Self::build(handle, name, None, || why)
    }

    fn build(
        handle: u64,
        name: Option<String>,
        layout: Option<ParamLayout>,
        why: impl FnOnce() -> String,
    ) -> Self {
        let slots = layout
            .as_ref()
            .map(ParamLayout::pointer_slots)
            .unwrap_or_default();
        let unchanged = (0..slots.len()).map(|_| AtomicU32::new(0)).collect();
        let words = slots.len().div_ceil(64);
        let bits = || (0..words).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        let opaque_reason = OnceLock::new();
        if layout.is_none() {
            let _ = opaque_reason.set(why());
        }
        Self {
            has_layout: layout.is_some(),
            collective: name.as_deref().is_some_and(is_collective_name),
            successor: OnceLock::new(),
            handle,
            name,
            runs: slot_runs(&slots),
            slots,
            launches: AtomicU64::new(0),
            validated: AtomicU64::new(0),
            spec_changes: AtomicU64::new(0),
            resolved: AtomicU64::new(0),
            opaque_reason,
            rw_mask: bits(),
            ro_mask: bits(),
            unchanged,
            named: bits(),
            undecided: AtomicBool::new(false),
        }
    }

    /// Replaces this model, made without a layout, by one with `layout` (known from a module
    /// loaded after the kernel's first launch): fresh speculation, the launches counted so far
    /// kept. Holders of this model find the new one with [`KernelModel::successor`]. `None` if
    /// this model has a layout or was replaced already.
    pub fn replace_with_layout(&self, layout: ParamLayout) -> Option<Arc<KernelModel>> {
        if self.has_layout {
            return None;
        }
        let m = Arc::new(Self::new(self.handle, self.name.clone(), Some(layout)));
        m.launches
            .store(self.launches.load(Ordering::Relaxed), Ordering::Relaxed);
        self.successor.set(m.clone()).ok()?;
        Some(m)
    }

    /// The model that replaced this one, if any (only a model without a layout is replaced).
    #[inline]
    pub fn successor(&self) -> Option<&Arc<KernelModel>> {
        if self.has_layout {
            return None;
        }
        self.successor.get()
    }

    /// Whether the model was made with a parameter layout (without one it is opaque).
    pub fn has_layout(&self) -> bool {
        self.has_layout
    }

    /// The kernel handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// The kernel's name, when known.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Whether the kernel is one of NCCL's collective or point-to-point kernels: a launch of it
    /// waits on the GPU for the same launch in every peer rank.
    pub fn is_collective(&self) -> bool {
        self.collective
    }

    /// The layout's pointer slots ([`ParamLayout::pointer_slots`]); empty without a layout.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Counts a launch whose words were resolved (not found in the launch path's memo).
    pub fn note_resolved(&self) {
        self.resolved.fetch_add(1, Ordering::Relaxed);
    }

    /// The slots as runs of consecutive words ([`slot_runs`]): what a launch's words are read by.
    pub fn slot_runs(&self) -> &[SlotRun] {
        &self.runs
    }

    /// Counts a launch: returns its number (0-based) and whether to validate it, which is when
    /// the kernel is not opaque and the number is below `first_launches` or a multiple of
    /// `every` (when `every > 0`), or a power of two while no validation was recorded yet (with
    /// `first_launches > 0`), or one while a slot awaits a verdict (`recheck_until`).
    pub fn next_launch(&self, cfg: &ValidationConfig) -> (u64, bool) {
        let n = self.launches.fetch_add(1, Ordering::Relaxed);
        let due = n < u64::from(cfg.first_launches)
            || n.checked_rem(cfg.every) == Some(0)
            // Its first launches were not validated (the device was being copied then, or a
            // read failed): again at powers of two until one is.
            || (cfg.first_launches > 0 && n.is_power_of_two() && !self.is_validated())
            || (n.is_power_of_two()
                && n <= cfg.recheck_until
                && cfg.readonly_after > 0
                && self.undecided.load(Ordering::Relaxed));
        (n, due && !self.is_opaque())
    }

    /// Notes that slot `slot_index` named a buffer at a launch (resolved off the memo, or
    /// validated): while it has no verdict, launches are validated again
    /// ([`ValidationConfig::recheck_until`]).
    pub fn note_named(&self, slot_index: usize) {
        let (w, bit) = (slot_index / 64, 1u64 << (slot_index % 64));
        let Some(named) = self.named.get(w) else {
            return;
        };
        // A plain load first: resolutions of a hot kernel would otherwise all write one line.
        if named.load(Ordering::Relaxed) & bit != 0 {
            return;
        }
        if named.fetch_or(bit, Ordering::AcqRel) & bit == 0 && !self.decided(slot_index) {
            self.undecided.store(true, Ordering::Release);
        }
    }

    /// Whether slot `slot_index` has a verdict: read-only, or seen changed.
    fn decided(&self, slot_index: usize) -> bool {
        let (w, bit) = (slot_index / 64, 1u64 << (slot_index % 64));
        let rw = self.rw_mask.get(w).map_or(0, |m| m.load(Ordering::Acquire));
        rw & bit != 0 || self.is_readonly(slot_index)
    }

    /// Recomputes [`Self::undecided`] from the masks.
    fn update_undecided(&self) {
        let open = (0..self.named.len()).any(|w| {
            let named = self.named[w].load(Ordering::Acquire);
            let rw = self.rw_mask[w].load(Ordering::Acquire);
            named & !rw & !self.readonly_word(w) != 0
        });
        self.undecided.store(open, Ordering::Release);
    }

    /// Whether some slot that named a buffer has no verdict yet.
    pub fn has_undecided_slots(&self) -> bool {
        self.undecided.load(Ordering::Acquire)
    }

    /// Changes whenever the kernel's speculation changed (a validation changed a slot's verdict,
    /// or the kernel was made opaque): a cache of buffer sets derived from it is stale when this
    /// differs; a validation that changed nothing (a recheck) leaves the caches valid.
    /// Lock-free.
    pub fn speculation_version(&self) -> u64 {
        (self.spec_changes.load(Ordering::Acquire) << 1) | u64::from(self.is_opaque())
    }

    /// Whether at least one validation was recorded: until then nothing is known of what the
    /// kernel reaches beyond the buffers its parameters name (a pointer table, a pointer it
    /// computes), so a launch while a checkpoint is open treats it as touching every buffer.
    #[inline]
    pub fn is_validated(&self) -> bool {
        self.validated.load(Ordering::Acquire) > 0
    }

    /// Whether the kernel is treated as touching every buffer.
    pub fn is_opaque(&self) -> bool {
        self.opaque_reason.get().is_some()
    }

    /// Why the kernel is opaque (the first reason given), if it is.
    pub fn opaque_reason(&self) -> Option<String> {
        self.opaque_reason.get().cloned()
    }

    /// Makes the kernel opaque for good. The first reason is kept.
    pub fn mark_opaque(&self, reason: String) {
        let _ = self.opaque_reason.set(reason);
    }

    /// Slots speculated read-only now (earned and never seen changed), in word `w` of the masks.
    fn readonly_word(&self, w: usize) -> u64 {
        match (self.ro_mask.get(w), self.rw_mask.get(w)) {
            (Some(ro), Some(rw)) => ro.load(Ordering::Acquire) & !rw.load(Ordering::Acquire),
            _ => 0,
        }
    }

    /// Takes back every read-only verdict: the slots count as written from now on, for good (a
    /// checkpoint found a buffer changed that no launch was predicted to write: whichever kernel
    /// wrote it, it is among those with a read-only slot). Whether any verdict was taken back.
    pub fn revoke_readonly(&self) -> bool {
        let mut any = false;
        for (ro, rw) in self.ro_mask.iter().zip(&self.rw_mask) {
            let r = ro.swap(0, Ordering::AcqRel);
            if r & !rw.fetch_or(r, Ordering::AcqRel) != 0 {
                any = true;
            }
        }
        if any {
            self.spec_changes.fetch_add(1, Ordering::AcqRel);
        }
        self.update_undecided();
        any
    }

    /// Whether slot `slot_index` (an index into [`Self::slots`]) is speculated read-only.
    pub fn is_readonly(&self, slot_index: usize) -> bool {
        self.readonly_word(slot_index / 64) & (1u64 << (slot_index % 64)) != 0
    }

    /// How a launch uses the buffer slot `slot_index` names.
    pub fn classify(&self, slot_index: usize) -> SlotAccess {
        if self.is_readonly(slot_index) {
            SlotAccess::Read
        } else {
            SlotAccess::ReadWrite
        }
    }

    /// Records what one validated launch showed and updates the speculation:
    /// - a change in a buffer predicted untouched, or a pointer table behind a slot, makes the
    ///   kernel opaque (returned as [`Verdict::Opaque`]);
    /// - slots in `slot_changed` become read-write forever;
    /// - slots in `slot_unchanged` (and not in `slot_changed`) count one more unchanged launch and
    ///   become read-only once they reach `cfg.readonly_after` (never when it is 0);
    /// - slots in neither mask (e.g. a buffer that was all one byte value before the launch and
    ///   unchanged after: a fill of that value would look the same) are left as they were.
    ///
    /// Returns [`Verdict::Consistent`] when this validation found nothing wrong, even if the
    /// kernel was already opaque.
    pub fn record_validation(&self, v: &Validation, cfg: &ValidationConfig) -> Verdict {
        let n = self.unchanged.len();
        let mut verdicts_changed = false;
        for i in v.slot_changed.iter().take_while(|&i| i < n) {
            let bit = 1u64 << (i % 64);
            verdicts_changed |= self.rw_mask[i / 64].fetch_or(bit, Ordering::AcqRel) & bit == 0;
            self.ro_mask[i / 64].fetch_and(!bit, Ordering::AcqRel);
        }
        for i in v.slot_unchanged.iter().take_while(|&i| i < n) {
            let bit = 1u64 << (i % 64);
            if v.slot_changed.contains(i) || self.rw_mask[i / 64].load(Ordering::Acquire) & bit != 0
            {
                continue;
            }
            let seen = self.unchanged[i]
                .fetch_add(1, Ordering::AcqRel)
                .saturating_add(1);
            if cfg.readonly_after > 0 && seen >= cfg.readonly_after {
                verdicts_changed |= self.ro_mask[i / 64].fetch_or(bit, Ordering::AcqRel) & bit == 0;
            }
        }
        for i in v.slot_named.iter().take_while(|&i| i < n) {
            self.named[i / 64].fetch_or(1u64 << (i % 64), Ordering::AcqRel);
        }
        self.update_undecided();
        // A slot made read-write concurrently with the promotion above loses read-only status
        // through `is_readonly` checking rw_mask too.
        // Counted after the masks changed, so a reader that sees the new
        // `speculation_version` also sees the new masks.
        self.validated.fetch_add(1, Ordering::AcqRel);
        if verdicts_changed {
            self.spec_changes.fetch_add(1, Ordering::AcqRel);
        }

        let reason = if !v.changed_untouched.is_empty() {
            let ids: Vec<String> = v.changed_untouched.iter().map(u64::to_string).collect();
            Some(format!(
                "wrote buffer(s) it was not passed: ids {}",
                ids.join(", ")
            ))
        } else {
            v.pointer_table.map(|(slot, ptr)| {
                format!("param slot {slot} points at a buffer holding device pointers ({ptr:#x})")
            })
        };
        match reason {
            Some(r) => {
                self.mark_opaque(r.clone());
                Verdict::Opaque(r)
            }
            None => Verdict::Consistent,
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> KernelStats {
        KernelStats {
            handle: self.handle,
            name: self.name.clone(),
            launches: self.launches.load(Ordering::Relaxed),
            validated: self.validated.load(Ordering::Relaxed),
            resolved: self.resolved.load(Ordering::Relaxed),
            opaque: self.is_opaque(),
            opaque_reason: self.opaque_reason(),
            readonly_slots: (0..self.ro_mask.len())
                .map(|w| self.readonly_word(w).count_ones())
                .sum(),
            slots: u32::try_from(self.slots.len()).unwrap_or(u32::MAX),
        }
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// A fast deterministic checksum: FNV-1a 64 over little-endian 8-byte words, then the tail
/// bytes, then the length.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h = FNV_OFFSET;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let w = u64::from_le_bytes(w.try_into().expect("8-byte chunk"));
        h = (h ^ w).wrapping_mul(FNV_PRIME);
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(FNV_PRIME);
    }
    (h ^ bytes.len() as u64).wrapping_mul(FNV_PRIME)
}

/// The byte value every byte of `bytes` equals, if there is one: `None` when `bytes` is empty or
/// holds two different values. Validation uses it to tell a constant region (all zeros, all 0xff,
/// ...), which cannot show a write of that constant, from one whose unchanged checksum is evidence
/// that the launch did not write it. Compares 8-byte words; stops at the first difference.
pub fn uniform_byte(bytes: &[u8]) -> Option<u8> {
    let &b = bytes.first()?;
    let word = u64::from_ne_bytes([b; 8]);
    let mut words = bytes.chunks_exact(8);
    let same = words.all(|w| u64::from_ne_bytes(w.try_into().expect("8-byte chunk")) == word)
        && words.remainder().iter().all(|&x| x == b);
    same.then_some(b)
}

/// The `(offset, len)` windows to checksum in a buffer of `size` bytes.
///
/// The whole buffer when `size <= sample_bytes`; nothing when `sample_bytes == 0`. Otherwise
/// `windows` windows (fewer when `sample_bytes` cannot give each 8 bytes) of equal length, a
/// multiple of 8, together about `sample_bytes`, spread evenly: the first at 0, the last ending at
/// `size` (it is up to 7 bytes longer than the others when `size` is not a multiple of 8). All
/// offsets are 8-byte aligned and the windows do not overlap.
pub fn sample_windows(size: u64, sample_bytes: u64, windows: u32) -> Vec<(u64, u64)> {
    if size <= sample_bytes {
        return if size == 0 {
            Vec::new()
        } else {
            vec![(0, size)]
        };
    }
    if sample_bytes == 0 {
        return Vec::new();
    }
    let mut n = u64::from(windows.max(1));
    if sample_bytes < 8 * n {
        n = (sample_bytes / 8).max(1);
    }
    let len = if sample_bytes >= 8 {
        (sample_bytes / n) & !7
    } else {
        sample_bytes
    };
    if n == 1 {
        return vec![(0, len)];
    }
    // span >= (n - 1) * len because size > sample_bytes >= n * len and len is a multiple of 8,
    // so consecutive aligned offsets are at least `len` apart.
    let span = (size - len) & !7;
    (0..n)
        .map(|i| {
            let off = ((u128::from(i) * u128::from(span) / u128::from(n - 1)) as u64) & !7;
            let l = if i == n - 1 { size - off } else { len };
            (off, l)
        })
        .collect()
}

/// The first 8-byte-aligned word of `bytes` (aligned to the slice start) that is not 0 and that
/// `is_live` says is a live device address, as `(byte offset, value)`.
pub fn find_pointers(bytes: &[u8], is_live: impl Fn(u64) -> bool) -> Option<(usize, u64)> {
    bytes.chunks_exact(8).enumerate().find_map(|(i, w)| {
        let v = u64::from_le_bytes(w.try_into().expect("8-byte chunk"));
        (v != 0 && is_live(v)).then_some((i * 8, v))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Param;
    use proptest::prelude::*;

    fn model(slots: u32) -> KernelModel {
        let params = (0..slots)
            .map(|i| Param {
                offset: i * 8,
                size: 8,
            })
            .collect();
        KernelModel::new(7, Some("k".into()), Some(ParamLayout::new(params)))
    }

    /// Read-only speculation on (opt-in): read-only after two unchanged validated launches.
    fn observed() -> ValidationConfig {
        ValidationConfig {
            readonly_after: 2,
            sample_bytes: WHOLE,
            ..Default::default()
        }
    }

    /// A validation that saw the buffers of the slots in `mask` unchanged.
    fn unchanged(mask: u64) -> Validation {
        Validation {
            slot_unchanged: SlotSet::from_mask(mask),
            ..Default::default()
        }
    }

    /// A validation that saw the buffers of the slots in `mask` changed.
    fn changed(mask: u64) -> Validation {
        Validation {
            slot_changed: SlotSet::from_mask(mask),
            ..Default::default()
        }
    }

    /// The defaults read whole buffers and never speculate read-only: however many validated
    /// launches saw a slot's buffer unchanged, a later launch that writes it (an overflow flag
    /// set only on some steps) is counted as a write; nor are kernels rechecked for verdicts
    /// that are never given.
    #[test]
    fn nccl_kernels_are_collectives_and_others_are_not() {
        let m = |n: &str| KernelModel::new(1, Some(n.to_string()), None);
        assert!(m(
            "_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE"
        )
        .is_collective());
        assert!(m("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t").is_collective());
        assert!(!m("_Z13vectorAddKernelPfS_S_i").is_collective());
        assert!(!m("ampere_sgemm_128x64_nn").is_collective());
        assert!(!KernelModel::new(2, None, None).is_collective());
    }

    #[test]
    fn by_default_read_only_is_earned_and_strict_takes_it_back() {
        let d = ValidationConfig::default();
        assert_eq!((d.readonly_after, d.sample_bytes), (READONLY_AFTER, WHOLE));
        let m = model(2);
        for _ in 0..READONLY_AFTER {
            let mut v = unchanged(0b11);
            v.slot_named.insert(0);
            v.slot_named.insert(1);
            m.record_validation(&v, &d);
        }
        assert!(m.is_readonly(0) && m.is_readonly(1));
        let before = m.speculation_version();
        assert!(m.revoke_readonly());
        assert!(!m.is_readonly(0) && !m.is_readonly(1));
        assert_ne!(
            m.speculation_version(),
            before,
            "caches of buffer sets go stale"
        );
        assert!(!m.revoke_readonly(), "nothing left to take back");
        // Revoked for good: more unchanged launches do not earn it again.
        for _ in 0..4 {
            m.record_validation(&unchanged(0b11), &d);
        }
        assert!(!m.is_readonly(0));
        let strict = ValidationConfig::from_env_str("strict").unwrap();
        assert_eq!((strict.readonly_after, strict.sample_bytes), (0, SAMPLED));
        assert_eq!(
            ValidationConfig::from_env_str("strict,sample=all")
                .unwrap()
                .sample_bytes,
            WHOLE
        );
    }

    #[test]
    fn strictly_nothing_is_read_only() {
        let cfg = ValidationConfig::from_env_str("strict").unwrap();
        assert_eq!(cfg.sample_bytes, SAMPLED);
        assert_eq!(cfg.readonly_after, 0);
        // Opting into read-only speculation reads whole buffers unless a sample is named.
        let opted = ValidationConfig::from_env_str("readonly_after=2").unwrap();
        assert_eq!(opted.sample_bytes, WHOLE);
        assert_eq!(
            sample_windows(64 << 20, opted.sample_bytes, opted.windows),
            [(0, 64 << 20)]
        );
        let sampled = ValidationConfig::from_env_str("readonly_after=2,sample=4096").unwrap();
        assert_eq!(sampled.sample_bytes, 4096);
        let m = model(2);
        for _ in 0..100 {
            let mut v = unchanged(0b11);
            v.slot_named.insert(0);
            v.slot_named.insert(1);
            m.record_validation(&v, &cfg);
        }
        assert!(!m.is_readonly(0) && !m.is_readonly(1));
        assert_eq!(m.classify(0), SlotAccess::ReadWrite);
        assert_eq!(m.stats().readonly_slots, 0);
        let dues = (0..64).filter(|_| m.next_launch(&cfg).1).count();
        assert_eq!(dues, 2, "only the first launches");
        assert_eq!(
            ValidationConfig::from_env_str("sample=all,readonly_after=3").unwrap(),
            ValidationConfig {
                readonly_after: 3,
                sample_bytes: WHOLE,
                ..Default::default()
            }
        );
    }

    /// A kernel whose first launches were not validated (they ran while a checkpoint copied) is
    /// validated at its next launch numbered by a power of two, and then no more.
    #[test]
    fn a_kernel_whose_first_launches_went_unvalidated_is_validated_later() {
        let m = model(1);
        let cfg = ValidationConfig::default();
        // Launches 0 and 1 were due but skipped (not recorded).
        assert!(m.next_launch(&cfg).1 && m.next_launch(&cfg).1);
        assert!(m.next_launch(&cfg).1, "launch 2");
        assert!(!m.next_launch(&cfg).1, "launch 3");
        assert!(m.next_launch(&cfg).1, "launch 4");
        m.record_validation(&Validation::default(), &cfg);
        assert!(
            (5..20).all(|_| !m.next_launch(&cfg).1),
            "validated: no more"
        );
        // With validation off, never.
        let m = model(1);
        let off = ValidationConfig::from_env_str("off").unwrap();
        assert!((0..20).all(|_| !m.next_launch(&off).1));
    }

    /// A kernel is validated once a validation was recorded, whatever it found.
    #[test]
    fn validated_once_a_validation_is_recorded() {
        let m = model(1);
        assert!(!m.is_validated());
        m.next_launch(&ValidationConfig::default());
        assert!(!m.is_validated(), "a launch is no validation");
        m.record_validation(&Validation::default(), &ValidationConfig::default());
        assert!(m.is_validated());
    }

    /// With read-only speculation on, a slot seen written once (a data-dependent write caught on
    /// one validated launch) is read-write for good, whatever the launches after show.
    #[test]
    fn a_write_seen_once_is_never_forgotten() {
        let m = model(1);
        let cfg = observed();
        m.record_validation(&changed(1), &cfg);
        for _ in 0..10 {
            m.record_validation(&unchanged(1), &cfg);
        }
        assert!(!m.is_readonly(0));
    }

    #[test]
    fn config_parsing() {
        let c = ValidationConfig::from_env_str(
            "first=3,every=1000,readonly_after=4,sample=4096,windows=8",
        )
        .unwrap();
        assert_eq!(
            c,
            ValidationConfig {
                first_launches: 3,
                every: 1000,
                readonly_after: 4,
                sample_bytes: 4096,
                windows: 8,
                recheck_until: 1024,
            }
        );
        assert_eq!(
            ValidationConfig::from_env_str("recheck=0")
                .unwrap()
                .recheck_until,
            0
        );
        let c = ValidationConfig::from_env_str(" every = 5 ").unwrap();
        assert_eq!((c.first_launches, c.every), (2, 5));
        let c = ValidationConfig::from_env_str("off").unwrap();
        assert_eq!((c.first_launches, c.every, c.recheck_until), (0, 0, 0));
        assert_eq!(
            ValidationConfig::from_env_str("").unwrap(),
            ValidationConfig::default()
        );
        let e = ValidationConfig::from_env_str("first=1,bogus=2").unwrap_err();
        assert!(e.contains("bogus"), "{e}");
        let e = ValidationConfig::from_env_str("windows=x").unwrap_err();
        assert!(e.contains("windows"), "{e}");
        assert!(ValidationConfig::from_env_str("first").is_err());
    }

    #[test]
    fn launch_numbering_and_validation_schedule() {
        let m = model(1);
        let cfg = ValidationConfig {
            first_launches: 2,
            every: 3,
            ..Default::default()
        };
        // Validated already (else powers of two would be validated too: below).
        m.record_validation(&Validation::default(), &cfg);
        let got: Vec<_> = (0..7).map(|_| m.next_launch(&cfg)).collect();
        assert_eq!(
            got,
            vec![
                (0, true),
                (1, true),
                (2, false),
                (3, true),
                (4, false),
                (5, false),
                (6, true)
            ]
        );
        let off = ValidationConfig::from_env_str("off").unwrap();
        assert_eq!(m.next_launch(&off), (7, false));
        m.mark_opaque("x".into());
        assert_eq!(m.next_launch(&cfg), (8, false));
        assert_eq!(m.stats().launches, 9);
    }

    #[test]
    fn no_layout_is_opaque() {
        let m = KernelModel::new(1, None, None);
        assert!(m.is_opaque());
        assert_eq!(m.opaque_reason().as_deref(), Some("no parameter layout"));
        assert!(m.slots().is_empty());
        assert_eq!(m.next_launch(&ValidationConfig::default()), (0, false));
        m.mark_opaque("later".into());
        assert_eq!(m.opaque_reason().as_deref(), Some("no parameter layout"));
    }

    #[test]
    fn a_kernel_without_layout_keeps_the_drivers_reason() {
        let m = KernelModel::without_layout(2, None, "no parameter layout: error 500".into());
        assert!(m.is_opaque());
        assert_eq!(
            m.opaque_reason().as_deref(),
            Some("no parameter layout: error 500")
        );
    }

    /// A slot that named a buffer at only one of the first validated launches (PyTorch's
    /// reduction: a config word that looks like an address inside a 1 GiB frozen tensor, while
    /// the first launch's layout differed) has no verdict after them: launches are validated
    /// again at powers of two until it has one, then no more. Without that it stayed read-write
    /// and every launch marked the frozen tensor written (copied again at every pause).
    #[test]
    fn a_slot_without_a_verdict_gets_its_kernel_validated_again_until_it_has_one() {
        let m = model(131);
        let cfg = observed();
        let due = |m: &KernelModel| m.next_launch(&cfg).1;
        assert!(due(&m) && due(&m), "launches 0 and 1");
        // Launch 0 saw slot 3 unchanged, launch 1 slots 3 and 117.
        let mut v = unchanged(1 << 3);
        v.slot_named.insert(3);
        m.record_validation(&v, &cfg);
        let mut v = unchanged(1 << 3);
        v.slot_unchanged.insert(117);
        v.slot_named.insert(3);
        v.slot_named.insert(117);
        m.record_validation(&v, &cfg);
        assert!(m.is_readonly(3) && !m.is_readonly(117));
        assert!(m.has_undecided_slots());
        // Launch 2 (a power of two) is validated again, launch 3 is not.
        assert!(due(&m));
        assert!(!due(&m));
        let mut v = unchanged(0);
        v.slot_unchanged.insert(117);
        v.slot_named.insert(117);
        m.record_validation(&v, &cfg);
        assert!(m.is_readonly(117));
        assert!(!m.has_undecided_slots());
        // Launch 4: nothing left to decide.
        assert!(!due(&m));
        // A slot first named by a resolution (not a validation) reopens it; one that is decided
        // does not.
        m.note_named(117);
        assert!(!m.has_undecided_slots());
        m.note_named(50);
        assert!(m.has_undecided_slots());
        for _ in 5..8 {
            assert!(!due(&m));
        }
        assert!(due(&m), "launch 8");
        // Seen changed: decided (read-write for good), no more rechecks.
        let mut v = changed(0);
        v.slot_changed.insert(50);
        v.slot_named.insert(50);
        m.record_validation(&v, &cfg);
        assert!(!m.has_undecided_slots());
        // Never past recheck_until.
        let m = model(1);
        m.record_validation(&Validation::default(), &observed());
        m.note_named(0);
        let cfg = ValidationConfig {
            recheck_until: 4,
            ..observed()
        };
        let dues: Vec<u64> = (0..20)
            .filter_map(|_| Some(m.next_launch(&cfg)).filter(|x| x.1).map(|x| x.0))
            .collect();
        assert_eq!(dues, [0, 1, 2, 4]);
    }

    /// A by-value struct of 131 words (PyTorch's reductions): a pointer at word 100 earns
    /// read-only like one at word 0 (with 64-bit masks, no slot past 63 ever could: a frozen
    /// tensor read by such a kernel was copied again at every checkpoint's pause).
    #[test]
    fn slots_past_64_earn_readonly_too() {
        let m = model(131);
        let cfg = observed(); // readonly_after = 2
        let mut v = Validation::default();
        v.slot_unchanged.insert(100);
        v.slot_unchanged.insert(3);
        v.slot_changed.insert(120);
        for _ in 0..2 {
            assert_eq!(m.record_validation(&v, &cfg), Verdict::Consistent);
        }
        assert!(m.is_readonly(100) && m.is_readonly(3) && !m.is_readonly(120));
        assert_eq!(m.classify(100), SlotAccess::Read);
        assert_eq!(m.stats().readonly_slots, 2);
        // Seen changed once: read-write for good.
        let mut w = Validation::default();
        w.slot_changed.insert(100);
        m.record_validation(&w, &cfg);
        assert!(!m.is_readonly(100) && m.is_readonly(3));
        // Slots past the kernel's own are ignored.
        let mut x = Validation::default();
        x.slot_unchanged.insert(5000);
        m.record_validation(&x, &cfg);
        assert!(!m.is_readonly(5000));
    }

    #[test]
    fn slot_sets_hold_any_index() {
        let mut s = SlotSet::default();
        for i in [0, 63, 64, 130, 700] {
            s.insert(i);
        }
        assert!(s.contains(130) && s.contains(700) && !s.contains(129));
        s.remove(64);
        s.remove(9999);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 63, 130, 700]);
        assert_eq!(
            SlotSet::from_mask(0b101).iter().collect::<Vec<_>>(),
            vec![0, 2]
        );
    }

    #[test]
    fn readonly_is_earned_and_lost_for_good() {
        let m = model(3);
        let cfg = observed(); // readonly_after = 2
        let v = Validation {
            slot_changed: SlotSet::from_mask(0b100),
            ..unchanged(0b011)
        };
        assert_eq!(m.record_validation(&v, &cfg), Verdict::Consistent);
        assert!(!m.is_readonly(0) && !m.is_readonly(1) && !m.is_readonly(2));
        assert_eq!(m.record_validation(&v, &cfg), Verdict::Consistent);
        assert!(m.is_readonly(0) && m.is_readonly(1) && !m.is_readonly(2));
        assert_eq!(m.classify(0), SlotAccess::Read);
        assert_eq!(m.classify(2), SlotAccess::ReadWrite);
        assert_eq!(m.stats().readonly_slots, 2);
        // Slot 1 changes once: read-write forever, however often it is unchanged after.
        m.record_validation(&changed(0b010), &cfg);
        for _ in 0..5 {
            m.record_validation(&unchanged(0b111), &cfg);
        }
        assert!(m.is_readonly(0) && !m.is_readonly(1) && !m.is_readonly(2));
        let s = m.stats();
        assert_eq!(
            (s.validated, s.readonly_slots, s.slots, s.opaque),
            (8, 1, 3, false)
        );
        assert!(!m.is_readonly(64));
        assert!(!m.is_readonly(1000));
    }

    #[test]
    fn bits_past_the_slot_count_are_ignored() {
        let m = model(2);
        let cfg = ValidationConfig {
            readonly_after: 1,
            ..Default::default()
        };
        m.record_validation(&unchanged(u64::MAX), &cfg);
        assert_eq!(m.stats().readonly_slots, 2);
        assert!(!m.is_readonly(5));
    }

    #[test]
    fn violations_make_the_kernel_opaque() {
        let m = model(2);
        let cfg = ValidationConfig::default();
        let v = Validation {
            changed_untouched: vec![4, 9],
            ..Default::default()
        };
        let Verdict::Opaque(r) = m.record_validation(&v, &cfg) else {
            panic!("not opaque")
        };
        assert_eq!(r, "wrote buffer(s) it was not passed: ids 4, 9");
        assert!(m.is_opaque());
        assert_eq!(m.next_launch(&cfg), (0, false));

        let m = model(2);
        let v = Validation {
            pointer_table: Some((1, 0x7f00_0000_1000)),
            ..Default::default()
        };
        assert_eq!(
            m.record_validation(&v, &cfg),
            Verdict::Opaque(
                "param slot 1 points at a buffer holding device pointers (0x7f0000001000)".into()
            )
        );
        let s = m.stats();
        assert!(s.opaque);
        assert_eq!(
            s.opaque_reason.as_deref(),
            Some("param slot 1 points at a buffer holding device pointers (0x7f0000001000)")
        );
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["handle"], 7);
        assert_eq!(json["opaque"], true);
    }

    #[test]
    fn more_than_64_slots() {
        let m = model(100);
        assert_eq!(m.slots().len(), 100);
        let cfg = ValidationConfig {
            readonly_after: 1,
            ..Default::default()
        };
        m.record_validation(&unchanged(1 << 63), &cfg);
        assert!(m.is_readonly(63));
        assert!(!m.is_readonly(64));
    }

    #[test]
    fn checksum_sees_changes() {
        let a = vec![0u8; 1000];
        let mut b = a.clone();
        assert_eq!(checksum(&a), checksum(&b));
        b[999] = 1;
        assert_ne!(checksum(&a), checksum(&b));
        b[999] = 0;
        b[3] = 1;
        assert_ne!(checksum(&a), checksum(&b));
        assert_ne!(checksum(&a[..8]), checksum(&a[..16]));
        assert_ne!(checksum(&[]), checksum(&[0]));
    }

    #[test]
    fn uniform_byte_examples() {
        assert_eq!(uniform_byte(&[]), None);
        assert_eq!(uniform_byte(&[0]), Some(0));
        assert_eq!(uniform_byte(&[0u8; 4096]), Some(0));
        assert_eq!(uniform_byte(&[0xffu8; 13]), Some(0xff));
        assert_eq!(uniform_byte(&[0x3fu8; 7]), Some(0x3f));
        // A difference anywhere: in a word, in the tail, in the first byte.
        for at in [0, 5, 8, 15, 16, 1000, 1002] {
            let mut b = vec![0u8; 1003];
            b[at] = 1;
            assert_eq!(uniform_byte(&b), None, "difference at {at}");
        }
        // Floats 1.0 repeat a 4-byte pattern, not a byte: not constant.
        let ones: Vec<u8> = (0..64).flat_map(|_| 1.0f32.to_le_bytes()).collect();
        assert_eq!(uniform_byte(&ones), None);
    }

    proptest! {
        #[test]
        fn uniform_byte_matches_the_definition(bytes in prop::collection::vec(prop::sample::select(vec![0u8, 1, 0xff]), 0..70)) {
            let want = bytes.first().copied().filter(|&f| bytes.iter().all(|&x| x == f));
            prop_assert_eq!(uniform_byte(&bytes), want);
        }
    }

    #[test]
    fn no_evidence_leaves_a_slot_as_it_was() {
        // Slot 0 unchanged every time; slot 1 in neither mask (constant and unchanged): it never
        // earns read-only, and its count does not advance towards it.
        let m = model(2);
        let cfg = observed(); // readonly_after = 2
        let v = unchanged(0b01);
        for _ in 0..4 {
            assert_eq!(m.record_validation(&v, &cfg), Verdict::Consistent);
        }
        assert!(m.is_readonly(0) && !m.is_readonly(1));
        m.record_validation(&unchanged(0b10), &cfg);
        assert!(!m.is_readonly(1), "one observation is not enough");
        assert_eq!(m.stats().readonly_slots, 1);
    }

    #[test]
    fn windows_examples() {
        assert_eq!(sample_windows(100, 256, 16), vec![(0, 100)]);
        assert_eq!(sample_windows(0, 256, 16), vec![]);
        assert_eq!(sample_windows(1000, 0, 16), vec![]);
        assert_eq!(
            sample_windows(1 << 20, 4096, 4),
            vec![(0, 1024), (349184, 1024), (698368, 1024), (1047552, 1024)]
        );
        // Size not a multiple of 8: last window runs to the end.
        let w = sample_windows(10_001, 160, 2);
        assert_eq!(w, vec![(0, 80), (9920, 81)]);
    }

    proptest! {
        #[test]
        fn windows_properties(size in 0u64..(1 << 40), sample in 0u64..(1 << 20), windows in 0u32..64) {
            let w = sample_windows(size, sample, windows);
            if size <= sample {
                prop_assert_eq!(w, if size == 0 { vec![] } else { vec![(0, size)] });
                return Ok(());
            }
            if sample == 0 {
                prop_assert!(w.is_empty());
                return Ok(());
            }
            prop_assert!(!w.is_empty());
            prop_assert!(w.len() <= windows.max(1) as usize);
            prop_assert_eq!(w[0].0, 0);
            let total: u64 = w.iter().map(|x| x.1).sum();
            prop_assert!(total <= sample + 7, "total {} sample {}", total, sample);
            if w.len() > 1 {
                prop_assert_eq!(w.last().map(|l| l.0 + l.1), Some(size));
                prop_assert!(total + 8 * w.len() as u64 >= sample, "total {} too small for {}", total, sample);
            }
            for pair in w.windows(2) {
                prop_assert!(pair[0].0 + pair[0].1 <= pair[1].0, "{:?}", pair);
            }
            for &(o, l) in &w {
                prop_assert_eq!(o % 8, 0);
                prop_assert!(l > 0 && o + l <= size);
            }
        }

        #[test]
        fn find_pointers_finds_the_first_live(words in prop::collection::vec(0u64..20, 0..40), tail in 0usize..8) {
            let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            bytes.resize(bytes.len() + tail, 0xff);
            let live = |v: u64| v >= 10;
            let want = words.iter().position(|&w| w >= 10).map(|i| (i * 8, words[i]));
            prop_assert_eq!(find_pointers(&bytes, live), want);
        }
    }

    #[test]
    fn find_pointers_ignores_zero_and_unaligned() {
        let mut b = vec![0u8; 24];
        b[3..11].copy_from_slice(&5u64.to_le_bytes());
        assert_eq!(find_pointers(&b, |v| v == 5), None);
        assert_eq!(find_pointers(&b, |_| true).map(|x| x.0), Some(0)); // word 0 is nonzero now
        assert_eq!(find_pointers(&[0u8; 16], |_| true), None);
    }
}
