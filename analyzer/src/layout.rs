//! A kernel's parameter layout and the 8-byte words of it that could hold device pointers.

/// One kernel parameter: where it sits in the packed parameter buffer, and how big it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    /// Byte offset in the packed parameter buffer.
    pub offset: u32,
    /// Size in bytes.
    pub size: u32,
}

/// The parameters of one kernel, in parameter-index order.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ParamLayout {
    /// One entry per parameter, index `i` being parameter `i`.
    pub params: Vec<Param>,
}

/// An 8-byte word of the parameter buffer that could hold a device pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The parameter's index.
    pub param: u16,
    /// Index of the word within the parameter (word `w` starts `8 * w` bytes into it).
    pub word: u16,
    /// Byte offset of the word in the packed parameter buffer: `param.offset + 8 * word`.
    pub offset: u32,
}

/// A run of consecutive slots inside one parameter: words `word .. word + len` of parameter
/// `param`, at byte `offset` of the packed buffer. A launch's slot words are read run by run, as
/// plain copies of `8 * len` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotRun {
    /// The parameter's index.
    pub param: u16,
    /// Index of the run's first word within the parameter.
    pub word: u16,
    /// Number of words.
    pub len: u16,
    /// Byte offset of the first word in the packed parameter buffer.
    pub offset: u32,
}

/// `slots` (in parameter order, as [`ParamLayout::pointer_slots`] gives them) as maximal runs of
/// consecutive words of one parameter; the runs' words, in order, are exactly the slots.
pub fn slot_runs(slots: &[Slot]) -> Vec<SlotRun> {
    let mut out: Vec<SlotRun> = Vec::new();
    for s in slots {
        match out.last_mut() {
            Some(r)
                if r.param == s.param
                    && u32::from(r.word) + u32::from(r.len) == u32::from(s.word)
                    && r.len < u16::MAX =>
            {
                r.len += 1;
            }
            _ => out.push(SlotRun {
                param: s.param,
                word: s.word,
                len: 1,
                offset: s.offset,
            }),
        }
    }
    out
}

/// At most this many pointer slots are considered per kernel; words past it are never looked at.
pub const MAX_SLOTS: usize = 1024;

impl ParamLayout {
    /// A layout from its parameters, in parameter-index order.
    pub fn new(params: Vec<Param>) -> Self {
        Self { params }
    }

    /// Size of the packed parameter buffer: the largest `offset + size` (0 with no parameters).
    pub fn total_size(&self) -> usize {
        self.params
            .iter()
            .map(|p| p.offset as usize + p.size as usize)
            .max()
            .unwrap_or(0)
    }

    /// Every 8-byte word that could hold a device pointer: for each parameter of 8 bytes or more,
    /// each 8-byte word lying wholly inside it, at parameter-relative offsets 0, 8, 16, ...
    /// Parameters smaller than 8 bytes give none. At most [`MAX_SLOTS`] words in all, the first
    /// ones in parameter order.
    pub fn pointer_slots(&self) -> Vec<Slot> {
        let mut out = Vec::new();
        for (index, p) in self.params.iter().enumerate() {
            let Ok(param) = u16::try_from(index) else {
                break;
            };
            for word in 0..p.size / 8 {
                if out.len() >= MAX_SLOTS {
                    return out;
                }
                let Ok(word16) = u16::try_from(word) else {
                    break;
                };
                let Some(offset) = p.offset.checked_add(word * 8) else {
                    break;
                };
                out.push(Slot {
                    param,
                    word: word16,
                    offset,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(offset: u32, size: u32) -> Param {
        Param { offset, size }
    }

    #[test]
    fn slots_cover_whole_words_only() {
        // int n; float* x; struct { float* a; int b; int c; float* d; } s (24 bytes); char c; 12-byte struct
        let l = ParamLayout::new(vec![p(0, 4), p(8, 8), p(16, 24), p(40, 1), p(44, 12)]);
        assert_eq!(l.total_size(), 56);
        let s = l.pointer_slots();
        let got: Vec<(u16, u16, u32)> = s.iter().map(|s| (s.param, s.word, s.offset)).collect();
        assert_eq!(
            got,
            vec![(1, 0, 8), (2, 0, 16), (2, 1, 24), (2, 2, 32), (4, 0, 44)]
        );
    }

    #[test]
    fn runs_group_consecutive_words_of_one_parameter() {
        let l = ParamLayout::new(vec![p(0, 4), p(8, 8), p(16, 24), p(40, 1), p(48, 16)]);
        let runs = slot_runs(&l.pointer_slots());
        let got: Vec<(u16, u16, u16, u32)> = runs
            .iter()
            .map(|r| (r.param, r.word, r.len, r.offset))
            .collect();
        assert_eq!(got, vec![(1, 0, 1, 8), (2, 0, 3, 16), (4, 0, 2, 48)]);
        // The runs' words are the slots, in order.
        let words: usize = runs.iter().map(|r| usize::from(r.len)).sum();
        assert_eq!(words, l.pointer_slots().len());
        assert!(slot_runs(&[]).is_empty());
    }

    #[test]
    fn empty_layout() {
        let l = ParamLayout::default();
        assert_eq!(l.total_size(), 0);
        assert!(l.pointer_slots().is_empty());
    }

    #[test]
    fn slots_are_capped() {
        let l = ParamLayout::new(vec![p(0, 8 * 1000), p(8000, 8 * 1000)]);
        let s = l.pointer_slots();
        assert_eq!(s.len(), MAX_SLOTS);
        assert_eq!(
            s[999],
            Slot {
                param: 0,
                word: 999,
                offset: 7992
            }
        );
        assert_eq!(
            s[1000],
            Slot {
                param: 1,
                word: 0,
                offset: 8000
            }
        );
        assert_eq!(s[MAX_SLOTS - 1].word, 23);
    }
}
