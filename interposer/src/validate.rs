//! Validation of a launch's speculated buffer sets, on both sides of the launch.
//!
//! Before: the device is synchronised, then sampled windows of every readable buffer (managed
//! and unmanaged) are checksummed, and the first 4 KiB behind each pointer the launch was passed
//! are scanned for live device pointers (a pointer table: the kernel may reach buffers its
//! parameters do not name). After (on the call's exit): the device is synchronised again, the same
//! windows are checksummed, and [`KernelModel::record_validation`] judges: a change in a buffer
//! the launch was not passed, or a pointer table, makes the kernel opaque from then on. Slots
//! whose buffer did not change earn read-only speculation, unless every sampled byte of that buffer
//! was one value before the launch (all zeros, all 0xff, ...): a write of that value, such as a
//! fill of zeros over zeros, would look the same, so such a slot counts neither way.
//!
//! Sampling can miss a write to a window it did not read; `POSSUM_VALIDATE=sample=N` reads more.
//! Work on other streams during the launch can only add changes, which makes a kernel opaque
//! wrongly but safely.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use possum_analyzer::kernel::{
    checksum, find_pointers, sample_windows, uniform_byte, KernelModel, Validation, Verdict,
};
use possum_cuda::introspect;

use crate::runtime::{DevEngine, Reentry, Resolved, State};

/// Bytes scanned for device pointers behind each pointer parameter.
const TABLE_SCAN: u64 = 4096;

/// What the entry side saw.
#[derive(Debug)]
pub struct Before {
    model: Arc<KernelModel>,
    /// (key, start, len, checksum, constant) of every target; constant: every sampled byte
    /// equalled the first ([`sum_of`]).
    sums: Vec<(u64, u64, u64, u64, bool)>,
    /// The key each slot resolved to (`None`: nothing).
    slot_keys: Vec<Option<u64>>,
    pointer_table: Option<(usize, u64)>,
    started: Instant,
}

/// The checksum of the sampled windows of `len` bytes at `start`, and whether every sampled byte
/// equals the first sampled byte (vacuously true when nothing is sampled).
fn sum_of(st: &State, start: u64, len: u64) -> Result<(u64, bool), String> {
    let mut acc = 0xcbf2_9ce4_8422_2325u64;
    let mut first = None;
    let mut constant = true;
    let mut buf = Vec::new();
    for (off, l) in sample_windows(
        len,
        st.cfg.validation.sample_bytes,
        st.cfg.validation.windows,
    ) {
        buf.resize(l as usize, 0);
        introspect::read_device(start + off, &mut buf).map_err(|e| e.to_string())?;
        acc = (acc ^ checksum(&buf)).wrapping_mul(0x100_0000_01b3);
        if constant {
            constant = uniform_byte(&buf).is_some_and(|b| *first.get_or_insert(b) == b);
        }
    }
    Ok((acc, constant))
}

/// The entry side, for a launch of `model` whose slots hold `words`. `None` (and the validation
/// skipped, counted) if the device cannot be read.
pub fn begin(
    st: &State,
    eng: Option<&DevEngine>,
    model: &Arc<KernelModel>,
    words: &[u64],
) -> Option<Before> {
    let started = Instant::now();
    let _r = Reentry::enter();
    let r = (|| -> Result<Before, String> {
        introspect::ctx_synchronize().map_err(|e| e.to_string())?;
        let mut sums = Vec::new();
        for (key, start, len) in st.validation_targets(eng) {
            let (sum, constant) = sum_of(st, start, len)?;
            sums.push((key, start, len, sum, constant));
        }
        let mut slot_keys = Vec::with_capacity(words.len());
        let mut pointer_table = None;
        let mut scan = Vec::new();
        let ranges = st.ranges();
        for (i, &w) in words.iter().enumerate() {
            let r = ranges.lookup(w);
            slot_keys.push(r.key());
            if pointer_table.is_some() {
                continue;
            }
            if let Some((s, l)) = r.range() {
                let n = TABLE_SCAN.min(s + l - w) & !7;
                scan.resize(n as usize, 0);
                introspect::read_device(w, &mut scan).map_err(|e| e.to_string())?;
                if let Some((_, p)) =
                    find_pointers(&scan, |v| !matches!(ranges.lookup(v), Resolved::None))
                {
                    pointer_table = Some((i, p));
                }
            }
        }
        Ok(Before {
            model: model.clone(),
            sums,
            slot_keys,
            pointer_table,
            started,
        })
    })();
    match r {
        Ok(b) => Some(b),
        Err(e) => {
            st.counters
                .validation_errors
                .fetch_add(1, Ordering::Relaxed);
            crate::log(&format!("validation skipped: {e}"));
            None
        }
    }
}

/// The exit side: compares and records the verdict.
pub fn finish(st: &State, b: Before) {
    let _r = Reentry::enter();
    let r = (|| -> Result<Validation, String> {
        introspect::ctx_synchronize().map_err(|e| e.to_string())?;
        let mut v = Validation {
            pointer_table: b.pointer_table,
            ..Validation::default()
        };
        let mut changed_keys = Vec::new();
        // Unchanged, but constant before: no evidence that the launch did not write them.
        let mut constant_keys = Vec::new();
        for &(key, start, len, before, constant) in &b.sums {
            if sum_of(st, start, len)?.0 != before {
                changed_keys.push(key);
            } else if constant {
                constant_keys.push(key);
            }
        }
        for (i, k) in b.slot_keys.iter().enumerate().take(64) {
            if let Some(k) = k {
                if changed_keys.contains(k) {
                    v.slot_changed |= 1 << i;
                } else if !constant_keys.contains(k) {
                    v.slot_unchanged |= 1 << i;
                }
            }
        }
        v.changed_untouched = changed_keys
            .into_iter()
            .filter(|k| !b.slot_keys.contains(&Some(*k)))
            .collect();
        Ok(v)
    })();
    let c = &st.counters;
    match r {
        Ok(v) => {
            c.validations.fetch_add(1, Ordering::Relaxed);
            if let Verdict::Opaque(why) = b.model.record_validation(&v, &st.cfg.validation) {
                c.kernels_made_opaque.fetch_add(1, Ordering::Relaxed);
                crate::log(&format!(
                    "kernel {} is opaque from now on: {why}",
                    b.model.name().unwrap_or("?")
                ));
                st.to_dag(crate::runtime::DagMsg::Opaque(b.model.handle()));
            }
        }
        Err(e) => {
            c.validation_errors.fetch_add(1, Ordering::Relaxed);
            crate::log(&format!("validation abandoned: {e}"));
        }
    }
    c.validation_ns.fetch_add(
        u64::try_from(b.started.elapsed().as_nanos()).unwrap_or(u64::MAX),
        Ordering::Relaxed,
    );
}
