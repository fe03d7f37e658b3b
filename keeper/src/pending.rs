//! The bytes a stage waits for: pieces of its image's data files that have not arrived yet
//! (a migration's post-copy), which buffers each blocks, and which of them a wait needs.
//!
//! A chunk is blocked while a piece still pending overlaps its bytes, and a buffer while one of
//! the chunks it loads is; [`Pending`] keeps those counts, so that a loader starts a buffer
//! once its first chunk to load may be read, reads each chunk once it may, and an arrival
//! unblocks them. A wait for a blocked buffer makes its pieces wanted: `stage_demands` hands each out
//! once, for whoever sends the files to send those first.

use std::collections::HashMap;

use crate::PendingPiece;

/// The bytes of a data file that a buffer's chunk is read from: `[start, end)` of `file`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) file: String,
    pub(crate) start: u64,
    pub(crate) end: u64,
    /// The buffer (its position in the stage).
    pub(crate) buffer: usize,
    /// The chunk's offset in the buffer.
    pub(crate) chunk: u64,
}

/// For each of `pieces`, the chunks (buffer, offset in it) whose `spans` it overlaps (each once,
/// in order).
pub(crate) fn overlaps(spans: Vec<Span>, pieces: &[PendingPiece]) -> Vec<Vec<(usize, u64)>> {
    // Per file, the spans by start, and the furthest end of each prefix: the spans before the
    // first that starts past a piece are walked back only while one of them may reach it.
    let mut by_file: HashMap<String, Vec<Span>> = HashMap::new();
    for s in spans.into_iter().filter(|s| s.start < s.end) {
        by_file.entry(s.file.clone()).or_default().push(s);
    }
    let by_file: HashMap<String, (Vec<Span>, Vec<u64>)> = by_file
        .into_iter()
        .map(|(f, mut v)| {
            v.sort_unstable_by_key(|s| (s.start, s.end));
            let reach = v
                .iter()
                .scan(0, |r, s| {
                    *r = s.end.max(*r);
                    Some(*r)
                })
                .collect();
            (f, (v, reach))
        })
        .collect();
    pieces
        .iter()
        .map(|p| {
            let (start, end) = (p.offset, p.offset.saturating_add(p.len));
            let mut hit = Vec::new();
            if let Some((v, reach)) = by_file.get(&p.file).filter(|_| start < end) {
                let mut j = v.partition_point(|s| s.start < end);
                while j > 0 && reach[j - 1] > start {
                    j -= 1;
                    if v[j].end > start {
                        hit.push((v[j].buffer, v[j].chunk));
                    }
                }
            }
            hit.sort_unstable();
            hit.dedup();
            hit
        })
        .collect()
}

/// The pieces of data files still arriving from their start (a migration's first round, received
/// in parts): each of `files` (name, recorded length), of which `present` says how many first
/// bytes are there (none if not named), in pieces of `piece` bytes at multiples of it, those
/// not wholly present pending.
pub(crate) fn arriving(
    files: &[(&str, u64)],
    present: &std::collections::BTreeMap<String, u64>,
    piece: u64,
) -> Vec<PendingPiece> {
    let piece = piece.max(1);
    let mut out = Vec::new();
    for &(file, len) in files {
        let have = present.get(file).copied().unwrap_or(0);
        let mut at = have / piece * piece;
        while at < len {
            let end = (at + piece).min(len);
            if end > have {
                out.push(PendingPiece {
                    file: file.to_string(),
                    offset: at,
                    len: end - at,
                });
            }
            at = end;
        }
    }
    out
}

/// A stage's pieces not arrived yet, and the buffers they block.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    /// The pieces, each once, in the order given.
    pieces: Vec<PendingPiece>,
    index: HashMap<PendingPiece, usize>,
    /// Per piece, whether it has arrived.
    arrived: Vec<bool>,
    /// Per piece, whether a wait needed it (it is handed out once, unless it arrives first).
    asked: Vec<bool>,
    /// Per piece, the chunks (buffer, offset) it overlaps, and the buffers those are of.
    blocks: Vec<Vec<(usize, u64)>>,
    buffers_of: Vec<Vec<usize>>,
    /// Per chunk, how many pieces overlapping it have not arrived (absent: none).
    chunk_missing: HashMap<(usize, u64), usize>,
    /// Per buffer, its first chunk to load (none: nothing to load).
    first: Vec<Option<u64>>,
    /// Per buffer, the pieces it overlaps.
    blocked_by: Vec<Vec<usize>>,
    /// Per buffer, how many of those have not arrived.
    missing: Vec<usize>,
    /// Per buffer, whether a wait met it blocked.
    wanted: Vec<bool>,
    /// Pieces a wait needs, not handed out yet (some may have arrived since).
    demand: Vec<usize>,
    /// Pieces not arrived.
    left: usize,
}

impl Pending {
    /// `pieces` pending for a stage of `buffers` buffers (whose first chunks to load are
    /// `first`), `blocks` saying which chunks each overlaps ([`overlaps`]); a piece named twice
    /// counts once.
    pub(crate) fn new(
        buffers: usize,
        pieces: &[PendingPiece],
        blocks: Vec<Vec<(usize, u64)>>,
        first: Vec<Option<u64>>,
    ) -> Self {
        let mut p = Pending {
            blocked_by: vec![Vec::new(); buffers],
            missing: vec![0; buffers],
            wanted: vec![false; buffers],
            first,
            ..Pending::default()
        };
        for (piece, chunks) in pieces.iter().zip(blocks) {
            if p.index.contains_key(piece) {
                continue;
            }
            let k = p.pieces.len();
            p.index.insert(piece.clone(), k);
            p.pieces.push(piece.clone());
            let chunks: Vec<(usize, u64)> = chunks.into_iter().filter(|c| c.0 < buffers).collect();
            // (`overlaps` sorts them: a buffer's chunks follow each other.)
            let mut bufs: Vec<usize> = chunks.iter().map(|c| c.0).collect();
            bufs.dedup();
            for &b in &bufs {
                p.blocked_by[b].push(k);
                p.missing[b] += 1;
            }
            for &c in &chunks {
                *p.chunk_missing.entry(c).or_default() += 1;
            }
            p.blocks.push(chunks);
            p.buffers_of.push(bufs);
        }
        p.left = p.pieces.len();
        p.arrived = vec![false; p.left];
        p.asked = vec![false; p.left];
        p
    }

    /// Whether buffer `i` waits for a piece.
    pub(crate) fn is_blocked(&self, i: usize) -> bool {
        self.missing.get(i).is_some_and(|&n| n > 0)
    }

    /// Whether the chunk of buffer `i` at `offset` waits for a piece.
    pub(crate) fn chunk_blocked(&self, i: usize, offset: u64) -> bool {
        self.chunk_missing.get(&(i, offset)).is_some_and(|&n| n > 0)
    }

    /// Whether a loader may start buffer `i`: its first chunk to load waits for no piece.
    pub(crate) fn startable(&self, i: usize) -> bool {
        match self.first.get(i).copied().flatten() {
            Some(offset) => !self.chunk_blocked(i, offset),
            None => !self.is_blocked(i),
        }
    }

    /// Pieces not arrived.
    pub(crate) fn left(&self) -> usize {
        self.left
    }

    /// The pieces of `file` still pending that end within its first `len` bytes.
    pub(crate) fn within(&self, file: &str, len: u64) -> Vec<PendingPiece> {
        (self.pieces.iter().zip(&self.arrived))
            .filter(|(p, arrived)| {
                !**arrived && p.file == file && p.offset.saturating_add(p.len) <= len
            })
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// `pieces` arrived (those not pending ignored); whether a chunk was unblocked.
    pub(crate) fn arrive(&mut self, pieces: &[PendingPiece]) -> bool {
        let mut unblocked = false;
        for piece in pieces {
            let Some(&k) = self.index.get(piece) else {
                continue;
            };
            if std::mem::replace(&mut self.arrived[k], true) {
                continue;
            }
            self.left -= 1;
            for &b in &self.buffers_of[k] {
                self.missing[b] -= 1;
            }
            for c in &self.blocks[k] {
                if let Some(n) = self.chunk_missing.get_mut(c) {
                    *n -= 1;
                    unblocked |= *n == 0;
                }
            }
        }
        unblocked
    }

    /// A wait for buffer `i`: if it is blocked, its pieces are wanted; whether any became so.
    pub(crate) fn want(&mut self, i: usize) -> bool {
        if !self.is_blocked(i) || std::mem::replace(&mut self.wanted[i], true) {
            return false;
        }
        let before = self.demand.len();
        for &k in &self.blocked_by[i] {
            if !self.arrived[k] && !std::mem::replace(&mut self.asked[k], true) {
                self.demand.push(k);
            }
        }
        self.demand.len() > before
    }

    /// The pieces wanted and not arrived that were not handed out before, handed out now.
    pub(crate) fn take_demands(&mut self) -> Vec<PendingPiece> {
        let demand = std::mem::take(&mut self.demand);
        demand
            .into_iter()
            .filter(|&k| !self.arrived[k])
            .map(|k| self.pieces[k].clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(file: &str, offset: u64, len: u64) -> PendingPiece {
        PendingPiece {
            file: file.to_string(),
            offset,
            len,
        }
    }

    fn span(file: &str, start: u64, end: u64, buffer: usize) -> Span {
        Span {
            file: file.to_string(),
            start,
            end,
            buffer,
            chunk: start,
        }
    }

    #[test]
    fn a_piece_blocks_the_buffers_whose_bytes_it_overlaps() {
        let spans = vec![
            span("a", 0, 100, 0),
            span("a", 100, 200, 1),
            span("a", 200, 300, 0),
            span("b", 0, 1000, 2),
            // A long span early in the file reaches past later ones.
            span("c", 0, 500, 3),
            span("c", 10, 20, 4),
            span("c", 600, 700, 5),
        ];
        let pieces = [
            piece("a", 99, 2),      // the end of 0's first, the start of 1's
            piece("a", 300, 10),    // just past the end
            piece("a", 150, 100),   // 1, and 0 again
            piece("b", 999, 1),     // the last byte of 2
            piece("c", 400, 250),   // 3 and 5, not 4
            piece("x", 0, 1 << 40), // no such file
            piece("a", 50, 0),      // no bytes
            piece("a", u64::MAX - 1, 10),
        ];
        assert_eq!(
            overlaps(spans, &pieces),
            vec![
                vec![(0, 0), (1, 100)],
                vec![],
                vec![(0, 200), (1, 100)],
                vec![(2, 0)],
                vec![(3, 0), (5, 600)],
                vec![],
                vec![],
                vec![],
            ]
        );
    }

    #[test]
    fn files_arriving_from_their_start_are_pending_past_what_is_there() {
        let present: std::collections::BTreeMap<String, u64> =
            [("a".to_string(), 25), ("b".to_string(), 40)].into();
        let got = arriving(&[("a", 35), ("b", 40), ("c", 12)], &present, 10);
        assert_eq!(
            got,
            vec![
                piece("a", 20, 10), // 20..25 there, 25..30 not
                piece("a", 30, 5),
                piece("c", 0, 10), // not there at all
                piece("c", 10, 2),
            ]
        );
        let first = Pending::new(0, &got, vec![Vec::new(); got.len()], Vec::new());
        assert_eq!(first.within("a", 30), vec![piece("a", 20, 10)]);
        assert_eq!(
            first.within("a", 35),
            vec![piece("a", 20, 10), piece("a", 30, 5)]
        );
        assert!(
            first.within("a", 29).is_empty(),
            "a piece part there is not arrived"
        );
        assert!(first.within("b", 1 << 30).is_empty());
        let mut p = first;
        p.arrive(&[piece("c", 0, 10)]);
        assert_eq!(
            p.within("c", 12),
            vec![piece("c", 10, 2)],
            "arrived: not again"
        );
    }

    #[test]
    fn buffers_unblock_once_every_piece_they_overlap_arrived() {
        let pieces = [piece("a", 0, 10), piece("a", 10, 10), piece("a", 0, 10)];
        let blocks = vec![vec![(0, 0), (1, 0)], vec![(1, 0)], vec![(0, 0), (1, 0)]];
        let mut p = Pending::new(3, &pieces, blocks, vec![Some(0); 3]);
        assert_eq!(p.left(), 2, "a piece named twice is one");
        assert!(p.is_blocked(0) && p.is_blocked(1) && !p.is_blocked(2));
        assert!(!p.arrive(&[piece("a", 5, 5)]), "never pending: ignored");
        assert!(p.arrive(&[piece("a", 0, 10)]));
        assert!(!p.is_blocked(0) && p.is_blocked(1));
        assert!(!p.arrive(&[piece("a", 0, 10)]), "again: ignored");
        assert_eq!(p.left(), 1);
        assert!(p.arrive(&[piece("a", 10, 10)]));
        assert!(!p.is_blocked(1));
        assert_eq!(p.left(), 0);
    }

    #[test]
    fn a_wait_for_a_blocked_buffer_demands_its_pieces_once() {
        let pieces = [piece("a", 0, 10), piece("a", 10, 10), piece("b", 0, 10)];
        let blocks = vec![vec![(0, 0), (1, 0)], vec![(1, 0)], vec![(2, 0)]];
        let mut p = Pending::new(3, &pieces, blocks, vec![Some(0); 3]);
        assert!(p.take_demands().is_empty(), "nothing waited for");
        assert!(p.want(2));
        p.arrive(&[piece("b", 0, 10)]);
        assert!(
            p.take_demands().is_empty(),
            "2's piece arrived before it was handed out"
        );
        assert!(p.want(0));
        assert!(!p.want(0), "wanted already");
        assert_eq!(p.take_demands(), vec![piece("a", 0, 10)]);
        assert!(p.want(1));
        assert_eq!(
            p.take_demands(),
            vec![piece("a", 10, 10)],
            "each piece once"
        );
        assert!(p.take_demands().is_empty());
        let mut q = Pending::new(1, &[piece("a", 0, 1)], vec![vec![]], vec![Some(0)]);
        assert!(!q.want(0), "not blocked: nothing wanted");
        assert!(q.take_demands().is_empty());
    }

    #[test]
    fn a_buffer_starts_once_its_first_chunk_may_be_read_and_each_chunk_waits_for_its_own() {
        let pieces = [piece("a", 0, 8), piece("a", 8, 8)];
        let blocks = vec![vec![(0, 0)], vec![(0, 8)]];
        let mut p = Pending::new(2, &pieces, blocks, vec![Some(0), None]);
        assert!(!p.startable(0) && p.startable(1));
        assert!(p.arrive(&[piece("a", 0, 8)]));
        assert!(p.startable(0) && !p.chunk_blocked(0, 0));
        assert!(
            p.chunk_blocked(0, 8) && p.is_blocked(0),
            "its second chunk still waits"
        );
        assert!(p.arrive(&[piece("a", 8, 8)]));
        assert!(!p.chunk_blocked(0, 8) && !p.is_blocked(0));
    }
}
