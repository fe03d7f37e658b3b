//! [`super`]'s tests: placing runs onto a draft, and drafting a live process's memory.

use super::*;

const P: u64 = PAGE_SIZE;

fn r(vaddr: u64, offset: u64, len: u64) -> Range {
    Range { vaddr, offset, len }
}

#[test]
fn runs_go_where_the_draft_holds_them_and_the_rest_is_appended() {
    // The draft holds pages 10..14 at 0 and 20..22 at 4P; it is 8 pages long (2 stale).
    let layout = [r(10 * P, 0, 4 * P), r(20 * P, 4 * P, 2 * P)];
    // Pages 8..12 (2 new, 2 held), 21..24 (1 held, 2 new), 30 (new); sources at 100P on.
    let runs = [
        (8 * P, 4 * P, 100 * P),
        (21 * P, 3 * P, 104 * P),
        (30 * P, P, 107 * P),
    ];
    let (moves, layout, end) = place(&runs, &layout, 8 * P);
    let m = |vaddr: u64, src: u64, dst: u64, len: u64, fresh| Move {
        vaddr: vaddr * P,
        src: src * P,
        dst: dst * P,
        len: len * P,
        fresh,
    };
    assert_eq!(
        moves,
        vec![
            m(8, 100, 8, 2, true),
            m(10, 102, 0, 2, false),
            m(21, 104, 5, 1, false),
            m(22, 105, 10, 2, true),
            m(30, 107, 12, 1, true),
        ]
    );
    assert_eq!(end, 13 * P);
    // The layout keeps what it held (pages 12..14 too) and gains the appended runs; 20..22
    // and 22..24 are contiguous in address but not in the draft, so stay two.
    assert_eq!(
        layout,
        vec![
            r(8 * P, 8 * P, 2 * P),
            r(10 * P, 0, 4 * P),
            r(20 * P, 4 * P, 2 * P),
            r(22 * P, 10 * P, 2 * P),
            r(30 * P, 12 * P, P),
        ]
    );
    // The same runs placed again are all held now: nothing is appended.
    let (again, layout2, end2) = place(&runs, &layout, end);
    assert!(again.iter().all(|m| !m.fresh), "{again:?}");
    assert_eq!((layout2, end2), (layout, end));
}

#[test]
fn a_long_run_is_cut_into_pieces_a_thread_each() {
    let (moves, _, end) = place(&[(0, 3 * PIECE + P, 0)], &[], 0);
    assert_eq!(moves.len(), 4);
    assert_eq!(end, 3 * PIECE + P);
    assert!(moves.iter().all(|m| m.fresh && m.len <= PIECE));
    assert_eq!(moves.iter().map(|m| m.len).sum::<u64>(), end);
    assert!(moves.windows(2).all(|w| w[0].dst + w[0].len == w[1].dst));
}

/// Where the draft holds the page at `vaddr`: its offset.
fn offset_of(layout: &[Range], vaddr: u64) -> Option<u64> {
    layout
        .iter()
        .find(|r| r.vaddr <= vaddr && vaddr < r.vaddr + r.len)
        .map(|r| r.offset + (vaddr - r.vaddr))
}

#[test]
fn a_live_process_is_drafted_and_a_second_round_writes_only_what_changed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(AHEAD_DIR);
    // 16 MiB of this process's own memory with a pattern (a mapping of its own, present).
    let mut mem: Vec<u8> = (0..16u64 << 20).map(|i| (i / P) as u8 ^ 0x5a).collect();
    let at = mem.as_ptr() as u64;
    let pid = std::process::id() as i32;
    let me = super::super::namespace_pid(pid).unwrap();
    let draft_of = |dir: &Path| {
        let layout = read_layout(dir, me).unwrap().unwrap().ranges;
        let data = fs::read(dir.join(data_name(me))).unwrap();
        (layout, data)
    };
    let first = draft(&dir, &[pid], 4).unwrap();
    assert_eq!(first.processes, vec![me], "{first:?}");
    assert!(first.written_bytes >= 16 << 20, "{first:?}");
    let (layout, data) = draft_of(&dir);
    let page_at = |data: &[u8], layout: &[Range], vaddr: u64| {
        let o = offset_of(layout, vaddr).expect("the page is in the draft") as usize;
        data[o..o + P as usize].to_vec()
    };
    let start = at.next_multiple_of(P);
    for k in [0, 1, 100, 1000, 4000] {
        let v = start + k * P;
        let i = (v - at) as usize;
        assert_eq!(
            page_at(&data, &layout, v),
            mem[i..i + P as usize],
            "page {k}"
        );
    }
    // Three pages change; the next round writes them and little else of this buffer.
    for k in [3u64, 7, 2000] {
        let i = (start + k * P - at) as usize;
        mem[i..i + P as usize].fill(0xee);
    }
    let second = draft(&dir, &[pid], 4).unwrap();
    let (layout2, data2) = draft_of(&dir);
    // Of this buffer, the round wrote the changed pages and no other (the rest of the process,
    // its other threads' and allocator's memory, changes as it likes).
    let written = &second.written[0].1;
    let wrote = |v: u64| {
        let o = offset_of(&layout2, v).unwrap();
        written.iter().any(|&(w, l)| w <= o && o < w + l)
    };
    for k in 0..4000u64 {
        assert_eq!(wrote(start + k * P), [3, 7, 2000].contains(&k), "page {k}");
    }
    for k in [3u64, 7, 2000] {
        assert_eq!(
            page_at(&data2, &layout2, start + k * P),
            vec![0xee; P as usize]
        );
    }
    // A page already drafted stays where it was.
    assert_eq!(offset_of(&layout, start), offset_of(&layout2, start));
    drop(mem);
}

#[test]
fn a_process_that_cannot_be_read_is_named_and_left_out() {
    let tmp = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let gone = child.id() as i32;
    child.wait().unwrap();
    let report = draft(&tmp.path().join(AHEAD_DIR), &[gone], 2).unwrap();
    assert!(report.processes.is_empty());
    assert_eq!(report.left.len(), 1, "{report:?}");
    assert_eq!(report.left[0].0, gone);
}
