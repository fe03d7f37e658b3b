//! What a GPU backend has reserved and mapped at which addresses, and the checks on them that
//! every backend makes the same way (the CUDA and the HIP backends share this).
//!
//! A backend reserves address ranges ([`AddressTables::reservations`]), maps physical memory at
//! the start of some of them ([`AddressTables::mappings`], keyed by address; each mapping knows its
//! size, [`MappedMemory`]), and may adopt ranges the job reserved itself
//! ([`AddressTables::adopted`]). A copy into or out of possum's reservations must lie within one
//! mapping; addresses outside every reservation are the job's own and are left to the runtime.

use std::collections::{BTreeMap, BTreeSet};

use crate::device::{DevPtr, DeviceError, DeviceResult};

/// Physical memory mapped at an address: its size in bytes.
pub trait MappedMemory {
    /// The bytes mapped.
    fn size(&self) -> u64;
}

/// The reservations and mappings of a backend.
#[derive(Debug)]
pub struct AddressTables<M> {
    /// Reservation start -> size.
    pub reservations: BTreeMap<u64, u64>,
    /// Mapping start -> the physical memory mapped there.
    pub mappings: BTreeMap<u64, M>,
    /// Reservations that are the job's (`Device::adopt_reservation`): `unreserve` forgets them
    /// and frees no address range.
    pub adopted: BTreeSet<u64>,
}

impl<M> Default for AddressTables<M> {
    fn default() -> Self {
        AddressTables {
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            adopted: BTreeSet::new(),
        }
    }
}

/// An invalid address range, and why.
pub fn invalid(va: u64, len: u64, why: &'static str) -> DeviceError {
    DeviceError::InvalidAddress {
        va: DevPtr(va),
        len,
        why,
    }
}

/// The end of `[va, va + len)`, unless it wraps around the address space.
pub fn end_of(va: u64, len: u64) -> DeviceResult<u64> {
    va.checked_add(len)
        .ok_or_else(|| invalid(va, len, "range wraps around the address space"))
}

/// How many bytes of a host buffer of `have` bytes a copy of `len` bytes uses: `len`, unless the
/// buffer is smaller.
pub fn host_len(len: u64, have: usize) -> DeviceResult<usize> {
    usize::try_from(len)
        .ok()
        .filter(|&n| n <= have)
        .ok_or(DeviceError::HostBufferTooSmall {
            need: len,
            have: have as u64,
        })
}

impl<M: MappedMemory> AddressTables<M> {
    /// The reservation holding all of `[va, end)`, if one does: (start, size).
    pub fn reservation_holding(&self, va: u64, end: u64) -> Option<(u64, u64)> {
        let (&start, &size) = self.reservations.range(..=va).next_back()?;
        (end <= start + size && va < start + size).then_some((start, size))
    }

    /// Whether any reservation overlaps `[va, end)` (`end > va`).
    pub fn touches_reservation(&self, va: u64, end: u64) -> bool {
        let before = self
            .reservations
            .range(..=va)
            .next_back()
            .is_some_and(|(&s, &n)| s + n > va);
        before || self.reservations.range(va..end).next().is_some()
    }

    /// Whether any mapping overlaps `[va, end)` (`end > va`).
    pub fn touches_mapping(&self, va: u64, end: u64) -> bool {
        let before = self
            .mappings
            .range(..=va)
            .next_back()
            .is_some_and(|(&s, m)| s + m.size() > va);
        before || self.mappings.range(va..end).next().is_some()
    }

    /// A copy may use `[va, va + len)` if it lies inside one of possum's mappings, or outside
    /// every reservation of possum's (memory the job allocated itself, which the runtime checks).
    pub fn check_copy_range(&self, va: u64, len: u64) -> DeviceResult<()> {
        if len == 0 {
            return Ok(());
        }
        let end = end_of(va, len)?;
        if !self.touches_reservation(va, end) {
            return Ok(());
        }
        let Some((&start, mem)) = self.mappings.range(..=va).next_back() else {
            return Err(invalid(va, len, "not mapped"));
        };
        if start + mem.size() <= va {
            return Err(invalid(va, len, "not mapped"));
        }
        if end > start + mem.size() {
            return Err(invalid(va, len, "crosses the end of a mapping"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Mem(u64);
    impl MappedMemory for Mem {
        fn size(&self) -> u64 {
            self.0
        }
    }

    #[test]
    fn copies_stay_inside_one_mapping_or_outside_every_reservation() {
        let mut t = AddressTables::<Mem>::default();
        t.reservations.insert(0x1000, 0x4000);
        t.mappings.insert(0x1000, Mem(0x2000));
        assert_eq!(
            t.reservation_holding(0x1800, 0x2000),
            Some((0x1000, 0x4000))
        );
        assert_eq!(t.reservation_holding(0x4800, 0x5800), None);
        assert!(t.touches_mapping(0x0, 0x1001));
        assert!(!t.touches_mapping(0x3000, 0x4000));
        assert!(t.check_copy_range(0x1000, 0x2000).is_ok());
        assert!(
            t.check_copy_range(0x8000, 0x100).is_ok(),
            "the job's own memory"
        );
        assert!(t.check_copy_range(0x1000, 0).is_ok());
        assert_eq!(host_len(8, 16).unwrap(), 8);
        assert!(matches!(
            host_len(32, 16),
            Err(DeviceError::HostBufferTooSmall { need: 32, have: 16 })
        ));
        for (va, len, why) in [
            (0x2800, 0x1000, "crosses the end of a mapping"),
            (0x3000, 0x100, "not mapped"),
            (u64::MAX - 1, 4, "range wraps around the address space"),
        ] {
            match t.check_copy_range(va, len) {
                Err(DeviceError::InvalidAddress { why: w, .. }) => assert_eq!(w, why),
                other => panic!("{va:#x}+{len:#x}: {other:?}"),
            }
        }
    }
}
