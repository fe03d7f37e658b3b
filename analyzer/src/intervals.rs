//! A map from non-overlapping half-open address ranges to values, with O(log n) point lookup.
//!
//! Used for "which live allocation contains this address": a pointer-sized word of a kernel's
//! parameters names a buffer when [`IntervalMap::lookup`] finds it inside one.

use std::collections::BTreeMap;

/// Non-overlapping half-open ranges `[start, start + len)` mapped to values.
///
/// Empty ranges are never stored, and a range reaching past `u64::MAX` is cut at it.
#[derive(Clone, Debug)]
pub struct IntervalMap<V> {
    /// start -> (len, value)
    map: BTreeMap<u64, (u64, V)>,
    total: u64,
}

impl<V> Default for IntervalMap<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V> IntervalMap<V> {
    /// An empty map.
    pub fn new() -> Self {
        Self {
            map: BTreeMap::new(),
            total: 0,
        }
    }

    /// Maps `[start, start + len)` to `value`.
    ///
    /// Every stored range that overlaps the new one is removed **whole** (not trimmed) and
    /// returned as `(start, len, value)`, lowest start first: an empty vector means nothing
    /// overlapped. With `len == 0` nothing is inserted or removed.
    pub fn insert(&mut self, start: u64, len: u64, value: V) -> Vec<(u64, u64, V)> {
        let end = start.saturating_add(len);
        if end == start {
            return Vec::new();
        }
        let mut displaced = Vec::new();
        // Stored ranges are sorted and disjoint, so those starting below `end` have descending
        // ends too: walk back until one ends at or before `start`.
        while let Some((&s, &(l, _))) = self.map.range(..end).next_back() {
            if s + l <= start {
                break;
            }
            let (l, v) = self.map.remove(&s).expect("key just seen");
            self.total -= l;
            displaced.push((s, l, v));
        }
        displaced.reverse();
        self.map.insert(start, (end - start, value));
        self.total += end - start;
        displaced
    }

    /// Removes the range starting exactly at `start`, returning its length and value.
    pub fn remove(&mut self, start: u64) -> Option<(u64, V)> {
        let removed = self.map.remove(&start);
        if let Some((l, _)) = &removed {
            self.total -= l;
        }
        removed
    }

    /// The range containing `addr`, as `(start, len, value)`.
    pub fn lookup(&self, addr: u64) -> Option<(u64, u64, &V)> {
        let (&s, (l, v)) = self.map.range(..=addr).next_back()?;
        (addr - s < *l).then_some((s, *l, v))
    }

    /// The range starting exactly at `start`, as `(len, value)`.
    pub fn get(&self, start: u64) -> Option<(u64, &V)> {
        self.map.get(&start).map(|(l, v)| (*l, v))
    }

    /// Number of ranges.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether there are no ranges.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The ranges in address order, as `(start, len, value)`.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, &V)> + '_ {
        self.map.iter().map(|(&s, (l, v))| (s, *l, v))
    }

    /// The lowest start and the highest end, or `None` when empty.
    pub fn bounds(&self) -> Option<(u64, u64)> {
        let (&lo, _) = self.map.first_key_value()?;
        let (&s, (l, _)) = self.map.last_key_value()?;
        Some((lo, s + l))
    }

    /// Sum of the lengths of all ranges.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn insert_lookup_remove() {
        let mut m = IntervalMap::new();
        assert!(m.insert(100, 50, 'a').is_empty());
        assert!(m.insert(150, 10, 'b').is_empty());
        assert_eq!(m.lookup(99), None);
        assert_eq!(m.lookup(100), Some((100, 50, &'a')));
        assert_eq!(m.lookup(149), Some((100, 50, &'a')));
        assert_eq!(m.lookup(150), Some((150, 10, &'b')));
        assert_eq!(m.lookup(160), None);
        assert_eq!(m.bounds(), Some((100, 160)));
        assert_eq!(m.total_bytes(), 60);
        // Overlaps both: both go, whole.
        assert_eq!(m.insert(140, 15, 'c'), vec![(100, 50, 'a'), (150, 10, 'b')]);
        assert_eq!(m.len(), 1);
        assert_eq!(m.total_bytes(), 15);
        assert_eq!(m.remove(140), Some((15, 'c')));
        assert_eq!(m.remove(140), None);
        assert!(m.is_empty());
        assert_eq!(m.bounds(), None);
        assert!(m.insert(5, 0, 'z').is_empty());
        assert!(m.is_empty());
    }

    #[test]
    fn range_at_top_of_address_space_is_cut() {
        let mut m = IntervalMap::new();
        m.insert(u64::MAX - 4, 100, ());
        assert_eq!(m.lookup(u64::MAX - 1), Some((u64::MAX - 4, 4, &())));
        assert_eq!(m.bounds(), Some((u64::MAX - 4, u64::MAX)));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u64, u32),
        Remove(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..1000, 0u64..80, any::<u32>()).prop_map(|(s, l, v)| Op::Insert(s, l, v)),
            (0u64..1000).prop_map(Op::Remove),
        ]
    }

    proptest! {
        #[test]
        fn matches_naive_model(ops in prop::collection::vec(op(), 0..60), probes in prop::collection::vec(0u64..1100, 20)) {
            let mut m = IntervalMap::new();
            let mut model: Vec<(u64, u64, u32)> = Vec::new();
            for op in ops {
                match op {
                    Op::Insert(s, l, v) => {
                        let got = m.insert(s, l, v);
                        if l == 0 {
                            prop_assert!(got.is_empty());
                            continue;
                        }
                        let mut gone: Vec<_> = model.iter().copied().filter(|&(ms, ml, _)| ms < s + l && s < ms + ml).collect();
                        gone.sort();
                        model.retain(|&(ms, ml, _)| !(ms < s + l && s < ms + ml));
                        model.push((s, l, v));
                        prop_assert_eq!(got, gone);
                    }
                    Op::Remove(s) => {
                        let want = model.iter().position(|&(ms, _, _)| ms == s).map(|i| model.remove(i));
                        prop_assert_eq!(m.remove(s), want.map(|(_, l, v)| (l, v)));
                    }
                }
                prop_assert_eq!(m.len(), model.len());
                prop_assert_eq!(m.total_bytes(), model.iter().map(|x| x.1).sum::<u64>());
            }
            for a in probes {
                let want = model.iter().find(|&&(s, l, _)| s <= a && a < s + l).map(|&(s, l, v)| (s, l, v));
                prop_assert_eq!(m.lookup(a).map(|(s, l, v)| (s, l, *v)), want);
            }
            model.sort();
            let listed: Vec<_> = m.iter().map(|(s, l, v)| (s, l, *v)).collect();
            prop_assert_eq!(&listed, &model);
            let b = model.first().map(|f| (f.0, model.iter().map(|x| x.0 + x.1).max().unwrap()));
            prop_assert_eq!(m.bounds(), b);
        }
    }
}
