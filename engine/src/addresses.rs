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

/// [`DeviceError::OutOfMemory`] for a mapping of `requested` bytes the runtime refused, with the
/// free memory it reports (`(free, total)`; 0 if it can't say).
pub fn out_of_memory(requested: u64, info: DeviceResult<(u64, u64)>) -> DeviceError {
    DeviceError::OutOfMemory {
        requested,
        free: info.map(|(free, _)| free).unwrap_or(0),
    }
}

/// The end of `[va, va + size)`, which must start and end on the granularity `g`.
pub fn granular_range(va: u64, size: u64, g: u64) -> DeviceResult<u64> {
    if size == 0 || !size.is_multiple_of(g) || !va.is_multiple_of(g) {
        return Err(invalid(
            va,
            size,
            "start or size is not a multiple of the granularity",
        ));
    }
    end_of(va, size)
}

/// A new reservation must be a positive multiple of the granularity `g`.
pub fn check_reserve_size(size: u64, g: u64) -> DeviceResult<()> {
    if size == 0 || !size.is_multiple_of(g) {
        return Err(invalid(
            0,
            size,
            "size is not a positive multiple of the granularity",
        ));
    }
    Ok(())
}

impl<M: MappedMemory> AddressTables<M> {
    /// Records `[va, va + size)`, a range the job reserved itself, as a reservation of possum's
    /// (`Device::adopt_reservation`): it must be granular and overlap none.
    pub fn adopt(&mut self, va: u64, size: u64, g: u64) -> DeviceResult<()> {
        let end = granular_range(va, size, g)?;
        if self.touches_reservation(va, end) {
            return Err(invalid(va, size, "overlaps a reservation of possum's"));
        }
        self.reservations.insert(va, size);
        self.adopted.insert(va);
        Ok(())
    }

    /// Forgets the reservation `[va, va + size)` (start and size must match one, and nothing be
    /// mapped in it); `free` frees its address range unless it was adopted.
    pub fn unreserve(
        &mut self,
        va: u64,
        size: u64,
        free: impl FnOnce() -> DeviceResult<()>,
    ) -> DeviceResult<()> {
        if self.reservations.get(&va) != Some(&size) {
            return Err(invalid(
                va,
                size,
                "not a reservation (start and size must match)",
            ));
        }
        if self.touches_mapping(va, va + size) {
            return Err(invalid(va, size, "reservation still has mappings"));
        }
        if !self.adopted.remove(&va) {
            free()?;
        }
        self.reservations.remove(&va);
        Ok(())
    }

    /// Whether memory may be mapped at `[va, va + size)`: granular (`g`), inside one
    /// reservation, overlapping no mapping.
    pub fn check_map(&self, va: u64, size: u64, g: u64) -> DeviceResult<()> {
        let end = granular_range(va, size, g)?;
        if self.reservation_holding(va, end).is_none() {
            return Err(invalid(va, size, "not inside one reservation"));
        }
        if self.touches_mapping(va, end) {
            return Err(invalid(va, size, "overlaps a mapping"));
        }
        Ok(())
    }

    /// Whether a mapping of `size` bytes starts at `va`, to be unmapped.
    pub fn check_unmap(&self, va: u64, size: u64) -> DeviceResult<()> {
        match self.mappings.get(&va) {
            Some(m) if m.size() == size => Ok(()),
            Some(_) => Err(invalid(va, size, "size differs from the mapping's")),
            None => Err(invalid(va, size, "not the start of a mapping")),
        }
    }

    /// How many bytes of a host buffer of `have` bytes a copy of `len` bytes at device address
    /// `va` uses ([`host_len`]), the device side checked ([`check_copy_range`](Self::check_copy_range)).
    pub fn check_host_copy(&self, va: u64, len: u64, have: usize) -> DeviceResult<usize> {
        let n = host_len(len, have)?;
        self.check_copy_range(va, len)?;
        Ok(n)
    }

    /// Both sides of a device-to-device copy of `len` bytes ([`check_copy_range`](Self::check_copy_range)).
    pub fn check_copy_ranges(&self, src: u64, dst: u64, len: u64) -> DeviceResult<()> {
        self.check_copy_range(src, len)?;
        self.check_copy_range(dst, len)
    }

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
