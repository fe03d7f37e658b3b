//! The buffers the engine manages: one VA-stable reservation each, mapped or released.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use crate::device::DevPtr;

/// Whether a buffer has physical memory behind it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Residency {
    /// Physical memory is mapped; contents are live.
    Mapped = 0,
    /// Physical memory was dropped; the address is kept, the contents are in an image.
    Released = 1,
    /// Not mapped in this process, but kept with its contents by the memory's owner (a keeper):
    /// [`crate::Engine::reattach`] maps it again.
    Detached = 2,
}

/// What the engine knows of one buffer.
#[derive(Debug)]
pub struct BufferInfo {
    id: u64,
    va: DevPtr,
    size: u64,
    mapped_size: u64,
    residency: AtomicU8,
    /// Written since the last pre-copy round took it.
    dirty: AtomicBool,
    /// Buffers of one group are touched together: an operation that touches one is taken to
    /// touch all (memory the job mapped itself, piece by piece, into one address range, where a
    /// tensor may span pieces: [`Engine::alloc_at`](crate::Engine::alloc_at)).
    group: Option<u64>,
}

/// A handle on a managed buffer, cheap to clone. Operations name the buffers they touch by these.
#[derive(Clone, Debug)]
pub struct Buffer(pub(crate) Arc<BufferInfo>);

impl Buffer {
    /// The engine's id of the buffer.
    pub fn id(&self) -> u64 {
        self.0.id
    }
    /// Its device address.
    pub fn va(&self) -> DevPtr {
        self.0.va
    }
    /// Its size in bytes, as the job asked for it.
    pub fn size(&self) -> u64 {
        self.0.size
    }
    /// Its size rounded up to the mapping granularity.
    pub fn mapped_size(&self) -> u64 {
        self.0.mapped_size
    }
    /// Whether it has physical memory now.
    pub fn residency(&self) -> Residency {
        match self.0.residency.load(Ordering::Acquire) {
            x if x == Residency::Mapped as u8 => Residency::Mapped,
            x if x == Residency::Detached as u8 => Residency::Detached,
            _ => Residency::Released,
        }
    }
    pub(crate) fn set_residency(&self, r: Residency) {
        self.0.residency.store(r as u8, Ordering::Release);
    }
    pub(crate) fn mark_dirty(&self) {
        // Relaxed: the pre-copy round orders itself against the job's streams with fences.
        if !self.0.dirty.load(Ordering::Relaxed) {
            self.0.dirty.store(true, Ordering::Relaxed);
        }
    }
    pub(crate) fn take_dirty(&self) -> bool {
        self.0.dirty.swap(false, Ordering::AcqRel)
    }
    /// Whether it was written since the last pre-copy round.
    pub fn is_dirty(&self) -> bool {
        self.0.dirty.load(Ordering::Relaxed)
    }
    /// Its group, if it belongs to one (see [`Registry::group`]).
    pub fn group(&self) -> Option<u64> {
        self.0.group
    }
    /// Whether `ptr` lies inside it.
    pub fn contains(&self, ptr: DevPtr) -> bool {
        ptr.0 >= self.0.va.0 && ptr.0 < self.0.va.0 + self.0.size.max(1)
    }
}

/// The set of live buffers, found by id or by any address inside them.
#[derive(Debug, Default)]
pub struct Registry {
    by_va: BTreeMap<u64, Buffer>,
    by_id: HashMap<u64, Buffer>,
    next_id: u64,
    /// Group -> its buffers.
    groups: HashMap<u64, Vec<Buffer>>,
}

impl Registry {
    /// Registers a new buffer.
    pub fn insert(&mut self, va: DevPtr, size: u64, mapped_size: u64) -> Buffer {
        self.insert_in(va, size, mapped_size, None)
    }

    /// Registers a new buffer, a member of `group` if given.
    pub fn insert_in(
        &mut self,
        va: DevPtr,
        size: u64,
        mapped_size: u64,
        group: Option<u64>,
    ) -> Buffer {
        let id = self.next_id;
        self.next_id += 1;
        let b = Buffer(Arc::new(BufferInfo {
            id,
            va,
            size,
            mapped_size,
            residency: AtomicU8::new(Residency::Mapped as u8),
            dirty: AtomicBool::new(true),
            group,
        }));
        self.by_va.insert(va.0, b.clone());
        self.by_id.insert(id, b.clone());
        if let Some(g) = group {
            self.groups.entry(g).or_default().push(b.clone());
        }
        b
    }

    /// Removes the buffer that starts at `va`.
    pub fn remove(&mut self, va: DevPtr) -> Option<Buffer> {
        let b = self.by_va.remove(&va.0)?;
        self.by_id.remove(&b.id());
        if let Some(g) = b.group() {
            if let Some(members) = self.groups.get_mut(&g) {
                members.retain(|m| m.id() != b.id());
                if members.is_empty() {
                    self.groups.remove(&g);
                }
            }
        }
        Some(b)
    }

    /// The buffers of `group` (none if it has none).
    pub fn group(&self, group: u64) -> &[Buffer] {
        self.groups.get(&group).map_or(&[], Vec::as_slice)
    }

    /// The buffer containing `ptr`.
    pub fn lookup(&self, ptr: DevPtr) -> Option<&Buffer> {
        self.by_va
            .range(..=ptr.0)
            .next_back()
            .map(|(_, b)| b)
            .filter(|b| b.contains(ptr))
    }

    /// The buffer with id `id`.
    pub fn get(&self, id: u64) -> Option<&Buffer> {
        self.by_id.get(&id)
    }

    /// All buffers, by address.
    pub fn iter(&self) -> impl Iterator<Item = &Buffer> {
        self.by_va.values()
    }

    /// Number of buffers.
    pub fn len(&self) -> usize {
        self.by_va.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.by_va.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_finds_interior_pointers_only() {
        let mut r = Registry::default();
        let a = r.insert(DevPtr(0x1000), 0x100, 0x1000);
        let b = r.insert(DevPtr(0x3000), 0x2000, 0x2000);
        assert_eq!(r.lookup(DevPtr(0x1000)).unwrap().id(), a.id());
        assert_eq!(r.lookup(DevPtr(0x10ff)).unwrap().id(), a.id());
        assert!(
            r.lookup(DevPtr(0x1100)).is_none(),
            "past the requested size"
        );
        assert!(r.lookup(DevPtr(0xfff)).is_none());
        assert_eq!(r.lookup(DevPtr(0x4fff)).unwrap().id(), b.id());
        assert!(r.lookup(DevPtr(0x5000)).is_none());
        r.remove(DevPtr(0x1000)).unwrap();
        assert!(r.lookup(DevPtr(0x1000)).is_none());
        assert!(r.get(a.id()).is_none());
    }
}
