//! What the writer of the files being sent says it wrote since the part before (part of
//! [`super`]): a [`DirSender`](super::DirSender) told of it reads again only those ranges of the
//! files sent ahead that it names, instead of every piece of them.

use std::collections::HashMap;

/// The byte ranges written into files since the last part was sent, by the file's (device,
/// inode). A file named here changed only in its ranges (none: not at all); a file not named may
/// have changed anywhere.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Written {
    files: HashMap<(u64, u64), Vec<(u64, u64)>>,
}

impl Written {
    /// Nothing known: every file sent ahead is read again whole.
    pub fn new() -> Written {
        Written::default()
    }

    /// The file `inode` was written only in `ranges` (offset, length) since the part before (a
    /// file named twice: both sets of ranges).
    pub fn add(&mut self, inode: (u64, u64), ranges: impl IntoIterator<Item = (u64, u64)>) {
        self.files.entry(inode).or_default().extend(ranges);
    }

    /// The bytes of every range named (a range named twice, twice).
    pub fn bytes(&self) -> u64 {
        self.files.values().flatten().map(|(_, len)| len).sum()
    }

    /// What this names that `settled` does not: each file's ranges without the bytes `settled`
    /// names in the same file (a file left with none is named with none: unchanged).
    pub fn without(&self, settled: &Written) -> Written {
        let files = (self.files.iter())
            .map(|(inode, ranges)| {
                let mut cut: Vec<(u64, u64)> =
                    settled.files.get(inode).cloned().unwrap_or_default();
                cut.sort_unstable();
                let left = ranges.iter().flat_map(|&r| minus(r, &cut)).collect();
                (*inode, left)
            })
            .collect();
        Written { files }
    }

    /// Whether nothing is known.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// Whether the piece `offset..offset + len` of the file `inode` may have changed: the file is
    /// not named, or one of its ranges meets the piece.
    pub(super) fn may_have_changed(&self, inode: (u64, u64), offset: u64, len: u64) -> bool {
        match self.files.get(&inode) {
            None => true,
            Some(ranges) => ranges
                .iter()
                .any(|&(at, l)| at < offset.saturating_add(len) && offset < at.saturating_add(l)),
        }
    }
}

/// The range `(at, len)` without the ranges `cut` (sorted by offset): what is left, in order.
fn minus((at, len): (u64, u64), cut: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let end = at.saturating_add(len);
    let mut left = Vec::new();
    let mut from = at;
    for &(c, l) in cut {
        let c_end = c.saturating_add(l);
        if c_end <= from || l == 0 {
            continue;
        }
        if c >= end {
            break;
        }
        if c > from {
            left.push((from, c - from));
        }
        from = from.max(c_end);
        if from >= end {
            break;
        }
    }
    if from < end {
        left.push((from, end - from));
    }
    left
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_may_have_changed_only_where_a_range_meets_it() {
        let mut w = Written::new();
        w.add((1, 2), [(100, 50)]);
        w.add((1, 3), []);
        assert!(w.may_have_changed((9, 9), 0, 10), "a file not named");
        assert!(!w.may_have_changed((1, 3), 0, 1 << 30), "named, unwritten");
        assert!(
            !w.may_have_changed((1, 2), 0, 100),
            "ends where the range begins"
        );
        assert!(w.may_have_changed((1, 2), 0, 101));
        assert!(w.may_have_changed((1, 2), 149, 10));
        assert!(!w.may_have_changed((1, 2), 150, 10), "begins where it ends");
    }

    #[test]
    fn without_leaves_what_the_settled_ranges_do_not_cover() {
        let mut w = Written::new();
        w.add((1, 2), [(0, 100), (200, 100)]);
        w.add((1, 3), [(0, 50)]);
        let mut settled = Written::new();
        settled.add((1, 2), [(250, 100), (10, 20), (0, 5)]);
        settled.add((1, 3), [(0, 50)]);
        settled.add((1, 4), [(0, 50)]);
        let left = w.without(&settled);
        let mut expect = Written::new();
        expect.add((1, 2), [(5, 5), (30, 70), (200, 50)]);
        expect.add((1, 3), []);
        assert_eq!(left, expect);
        assert_eq!(w.without(&Written::new()), w, "nothing settled");
        assert_eq!(
            minus((10, 10), &[(0, 10), (20, 5)]),
            vec![(10, 10)],
            "touching"
        );
        assert_eq!(minus((10, 10), &[(5, 30)]), vec![], "covered");
    }
}
