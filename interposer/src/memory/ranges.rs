//! The snapshot launches resolve their words against: every allocation possum knows, sorted
//! ([`Ranges`], rebuilt copy-on-write when allocations change), what a word points into
//! ([`Resolved`]), the span outside which no word points anywhere ([`Span`]), and the hash of a
//! launch's words that keys the launch path's memo ([`WordHash`]).
//!
//! Plain data: the state (`runtime.rs`) holds the current snapshot; the hooks read it.

use possum_analyzer::dag::BufRef;
use possum_engine::registry::Buffer;

/// From the lowest start of a known allocation to the highest end: a word outside it points into
/// none, whatever its value.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    lo: u64,
    len: u64,
}

impl Span {
    /// `w` if it lies in the span, else 0: a launch's words differing only outside it (scalars,
    /// seeds, sizes) name the same buffers.
    #[inline]
    pub fn canon(self, w: u64) -> u64 {
        if w.wrapping_sub(self.lo) < self.len {
            w
        } else {
            0
        }
    }
}

/// A 128-bit hash of a launch's (canonical) words, by which the launch path finds the memo entry
/// of an earlier launch with the same words without keeping or comparing the words themselves
/// (they are read once, where the job wrote them; a memo entry is then two cache lines, not the
/// kilobytes of a by-value struct). Four independent lanes (word `i` goes to lane `i % 4`), each
/// step a bijection of the lane for a given word, so sequences differing in one word always
/// differ; the lanes and the count are mixed into 128 bits at the end.
#[derive(Debug, Clone)]
pub struct WordHash {
    lanes: [u64; 4],
    n: u64,
}

impl Default for WordHash {
    fn default() -> Self {
        Self {
            lanes: [
                0x243f_6a88_85a3_08d3,
                0x1319_8a2e_0370_7344,
                0xa409_3822_299f_31d0,
                0x082e_fa98_ec4e_6c89,
            ],
            n: 0,
        }
    }
}

impl WordHash {
    /// Adds the next word. The lane it goes to is always the first: the lanes then turn by one,
    /// so that word `i` lands in lane `i % 4` once [`Self::finish`] turns them back (fixed
    /// indices keep the lanes in registers in a loop of pushes).
    #[inline]
    pub fn push(&mut self, w: u64) {
        let [a, b, c, d] = self.lanes;
        self.lanes = [
            b,
            c,
            d,
            (a ^ w).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29),
        ];
        self.n += 1;
    }

    /// The hash of the words pushed.
    pub fn finish(&self) -> u128 {
        fn mix(mut z: u64) -> u64 {
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        // Lane `i` (words `i`, `i + 4`, ...) back in place `i`.
        let [w, x, y, z] = self.lanes;
        let lanes = match self.n % 4 {
            0 => [w, x, y, z],
            1 => [z, w, x, y],
            2 => [y, z, w, x],
            _ => [x, y, z, w],
        };
        // Each half depends on every lane: the memo's index is keyed by the low half alone, and
        // a kernel with one or two words leaves lanes untouched (with the low half made of two
        // lanes only, every buffer set of a one-pointer kernel had the same key, measured).
        let [a, b, c, d] = lanes;
        let hi = mix(a ^ mix(b ^ mix(c ^ mix(d ^ self.n))));
        let lo =
            mix(d.rotate_left(47)
                ^ mix(c.rotate_left(31) ^ mix(b.rotate_left(17) ^ mix(a ^ !self.n))));
        (u128::from(hi) << 64) | u128::from(lo)
    }

    /// The hash of `words`, each first passed through `span` ([`Span::canon`]).
    pub fn of_canonical(words: &[u64], span: Span) -> u128 {
        let mut h = WordHash::default();
        for &w in words {
            h.push(span.canon(w));
        }
        h.finish()
    }
}

/// Every allocation possum knows, sorted: what launches resolve their words against, without a
/// lock per word. Rebuilt (copy on write) after allocations change.
#[derive(Debug, Default)]
pub struct Ranges {
    starts: Vec<u64>,
    entries: Vec<(u64, Resolved)>,
    /// The allocations' neighbourhoods: clusters of ranges less than [`HULL_GAP`] apart, widened
    /// by that much on each side. Only a word inside one is worth asking the driver about.
    hulls: Vec<(u64, u64)>,
    /// The highest end of any range.
    max_end: u64,
}

/// See [`Ranges`]'s `hulls`.
const HULL_GAP: u64 = 4 << 30;

impl Ranges {
    /// The snapshot of `v`: (start, end, what is there), in any order.
    pub fn new(mut v: Vec<(u64, u64, Resolved)>) -> Ranges {
        v.sort_by_key(|e| e.0);
        let mut hulls: Vec<(u64, u64)> = Vec::new();
        for &(s, e, _) in &v {
            match hulls.last_mut() {
                Some(h) if s <= h.1.saturating_add(HULL_GAP) => h.1 = h.1.max(e),
                _ => hulls.push((s, e)),
            }
        }
        Ranges {
            max_end: v.iter().map(|e| e.1).max().unwrap_or(0),
            starts: v.iter().map(|e| e.0).collect(),
            entries: v.into_iter().map(|(_, end, r)| (end, r)).collect(),
            hulls: hulls
                .into_iter()
                .map(|(s, e)| (s.saturating_sub(HULL_GAP), e.saturating_add(HULL_GAP)))
                .collect(),
        }
    }

    /// Whether `w` is near enough to a known allocation to be a device pointer worth asking
    /// the driver about.
    pub fn near(&self, w: u64) -> bool {
        self.hulls.iter().any(|&(s, e)| w >= s && w < e)
    }

    /// The span every known allocation lies in (see [`Span`]).
    pub fn span(&self) -> Span {
        let lo = self.starts.first().copied().unwrap_or(u64::MAX);
        Span {
            lo,
            len: self.max_end.saturating_sub(lo),
        }
    }

    /// What `w` points into (never anything for 0: no allocation starts at address 0).
    pub fn lookup(&self, w: u64) -> Resolved {
        let below = match self.starts.first() {
            Some(&lo) => w < lo,
            None => true,
        };
        if below || w >= self.max_end {
            return Resolved::None;
        }
        let i = self.starts.partition_point(|&s| s <= w);
        if i == 0 {
            return Resolved::None;
        }
        let (end, r) = &self.entries[i - 1];
        if w < *end {
            r.clone()
        } else {
            Resolved::None
        }
    }
}

/// What a parameter word points into.
#[derive(Debug, Clone)]
pub enum Resolved {
    /// A managed buffer of the engine of device `.1`.
    Managed(Buffer, usize),
    /// An allocation possum does not manage: (start, len).
    Unmanaged(u64, u64),
    /// Nothing known.
    None,
}

impl Resolved {
    /// The key validation and the DAG use: a managed buffer's id, or an unmanaged range's start
    /// with the top bit set.
    pub fn key(&self) -> Option<u64> {
        match self {
            Resolved::Managed(b, _) => Some(b.id()),
            Resolved::Unmanaged(s, _) => Some(s | 1 << 63),
            Resolved::None => None,
        }
    }

    /// (start, len) of what was found.
    pub fn range(&self) -> Option<(u64, u64)> {
        match self {
            Resolved::Managed(b, _) => Some((b.va().0, b.size())),
            Resolved::Unmanaged(s, l) => Some((*s, *l)),
            Resolved::None => None,
        }
    }

    /// For the DAG.
    pub fn buf_ref(&self) -> Option<BufRef> {
        let (va, size) = self.range()?;
        Some(BufRef {
            id: self.key()?,
            va,
            size,
            managed: matches!(self, Resolved::Managed(..)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(v: &[(u64, u64)]) -> Ranges {
        Ranges::new(
            v.iter()
                .map(|&(s, l)| (s, s + l, Resolved::Unmanaged(s, l)))
                .collect(),
        )
    }

    #[test]
    fn words_outside_every_allocation_do_not_change_the_hash() {
        let r = ranges(&[(0x7f00_0000_0000, 0x10_0000), (0x7f00_0100_0000, 0x1000)]);
        let span = r.span();
        let a = 0x7f00_0000_0040;
        let b = 0x7f00_0100_0008;
        // A step count and a seed outside the span: canonical 0, the same hash.
        let base = WordHash::of_canonical(&[a, 7, b, 0xdead_beef], span);
        assert_eq!(base, WordHash::of_canonical(&[a, 8, b, 0x1234], span));
        assert_eq!(span.canon(7), 0);
        assert_eq!(span.canon(a), a);
        // A pointer moved, swapped, or one word more: another hash.
        assert_ne!(base, WordHash::of_canonical(&[a + 8, 7, b, 0], span));
        assert_ne!(base, WordHash::of_canonical(&[b, 7, a, 0], span));
        assert_ne!(base, WordHash::of_canonical(&[a, 7, b, 0, 0], span));
        // Both halves change with a one-word launch's word (the memo's index keys on the low
        // half).
        let one = WordHash::of_canonical(&[a], span);
        let other = WordHash::of_canonical(&[a + 8], span);
        assert_ne!(one as u64, other as u64);
        assert_ne!((one >> 64) as u64, (other >> 64) as u64);
        // Any single word changed inside the span changes the hash (each lane step is a
        // bijection of the lane for a given word).
        let words: Vec<u64> = (0..40).map(|i| a + 8 * i).collect();
        let h = WordHash::of_canonical(&words, span);
        for i in 0..words.len() {
            let mut w = words.clone();
            w[i] += 8;
            assert_ne!(h, WordHash::of_canonical(&w, span), "word {i}");
        }
    }

    #[test]
    fn word_i_goes_to_lane_i_mod_4() {
        // However many words were pushed, the lanes (turned back) are what folding word `i`
        // into lane `i % 4` gives.
        for n in 0..12u64 {
            let words: Vec<u64> = (0..n).map(|i| 0x1000 + 8 * i).collect();
            let mut h = WordHash::default();
            for &w in &words {
                h.push(w);
            }
            let mut lanes = h.lanes;
            lanes.rotate_right((n % 4) as usize);
            let mut want = WordHash::default().lanes;
            for (i, &w) in words.iter().enumerate() {
                let l = &mut want[i % 4];
                *l = (*l ^ w).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
            }
            assert_eq!(lanes, want, "{n} words");
        }
    }

    #[test]
    fn lookup_finds_the_containing_allocation_only() {
        let r = ranges(&[(0x7f00_0040_0000, 0x20_0000), (0x7f00_0000_0000, 0x1000)]);
        assert!(matches!(
            r.lookup(0x7f00_0000_0000),
            Resolved::Unmanaged(0x7f00_0000_0000, 0x1000)
        ));
        assert!(matches!(
            r.lookup(0x7f00_0000_0fff),
            Resolved::Unmanaged(..)
        ));
        assert!(matches!(r.lookup(0x7f00_0000_1000), Resolved::None));
        assert!(matches!(
            r.lookup(0x7f00_0050_0000),
            Resolved::Unmanaged(0x7f00_0040_0000, _)
        ));
        assert!(matches!(r.lookup(0x7f00_0060_0000), Resolved::None));
        assert!(matches!(r.lookup(12), Resolved::None));
        assert!(matches!(r.lookup(u64::MAX), Resolved::None));
        assert!(matches!(
            ranges(&[]).lookup(0x7f00_0000_0000),
            Resolved::None
        ));
        assert_eq!(
            r.lookup(0x7f00_0000_0010).key(),
            Some(0x7f00_0000_0000 | 1 << 63)
        );
    }

    #[test]
    fn near_covers_the_neighbourhood_of_allocations() {
        let r = ranges(&[(0x7f00_0000_0000, 0x1000), (0x3_0000_0000, 0x20_0000)]);
        assert!(r.near(0x7f00_0000_2000));
        assert!(r.near(0x7f00_0000_0000 - (1 << 30)));
        assert!(!r.near(0x7f00_0000_0000 + (8 << 30)));
        assert!(r.near(0x3_0000_0000 + (2 << 30)));
        assert!(!r.near(0x10));
        assert!(!r.near(0x0303_0303_0303_0303));
    }
}
