//! [`super`]'s tests: the split of synthetic CRIU images, the index, the fill.

use super::*;

/// Every process split, whatever it holds, into one data file.
const ANY_SIZE: SplitOptions = SplitOptions {
    min_bytes: 1,
    part_bytes: None,
    ahead: None,
};

fn pe(vaddr: u64, pages: u32) -> PagemapEntry {
    PagemapEntry::run(vaddr, u64::from(pages), None, Some(PE_PRESENT))
}

const P: u64 = PAGE_SIZE;

#[test]
fn runs_are_cut_at_mapping_boundaries_with_their_file_offsets() {
    // Runs: [0x10,0x20) pages, [0x30,0x34) pages. Movable: [0x12,0x18), [0x1c,0x32).
    let entries = vec![pe(0x10 * P, 0x10), pe(0x30 * P, 4)];
    let movable = vec![(0x12 * P, 0x18 * P), (0x1c * P, 0x32 * P)];
    let (kept, moved) = cut(&entries, &movable);
    let kept: Vec<(u64, u64, u64)> = kept
        .iter()
        .map(|(e, off)| (e.vaddr / P, e.pages(), off / P))
        .collect();
    assert_eq!(kept, vec![(0x10, 2, 0), (0x18, 4, 8), (0x32, 2, 0x12)]);
    let moved: Vec<(u64, u64, u64)> = moved
        .iter()
        .map(|r| (r.vaddr / P, r.offset / P, r.len / P))
        .collect();
    // [0x1c,0x20) at offset 0xc and [0x30,0x32) at 0x10 are contiguous in the file but
    // not in memory: two runs.
    assert_eq!(moved, vec![(0x12, 2, 6), (0x1c, 0xc, 4), (0x30, 0x10, 2)]);
    let total: u64 = kept.iter().map(|k| k.1).sum::<u64>() + moved.iter().map(|m| m.2).sum::<u64>();
    assert_eq!(total, 0x14);
}

#[test]
fn adjacent_runs_merge_and_holes_are_cut_out() {
    let entries = vec![pe(0, 4), pe(4 * P, 4)];
    let (kept, moved) = cut(&entries, &[(0, 8 * P)]);
    assert!(kept.is_empty());
    assert_eq!(
        moved,
        vec![Range {
            vaddr: 0,
            offset: 0,
            len: 8 * P
        }]
    );
    let with_hole = subtract(vec![(0, 8 * P), (10 * P, 12 * P)], &[(3 * P, 4 * P)]);
    assert_eq!(
        with_hole,
        vec![(0, 3 * P), (4 * P, 8 * P), (10 * P, 12 * P)]
    );
    assert_eq!(subtract(vec![(0, P)], &[(0, P)]), vec![]);
}

#[test]
fn only_plain_private_anonymous_writable_mappings_move() {
    let anon = VmaEntry {
        start: 0,
        end: P,
        prot: (libc::PROT_READ | libc::PROT_WRITE) as u32,
        flags: (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u32,
        status: status::REGULAR | status::ANON_PRIVATE,
        madv: None,
    };
    assert!(movable_vma(&anon));
    let heap = VmaEntry {
        status: anon.status | status::HEAP,
        ..anon.clone()
    };
    assert!(movable_vma(&heap));
    for not in [
        VmaEntry {
            prot: libc::PROT_READ as u32,
            ..anon.clone()
        },
        VmaEntry {
            flags: anon.flags | libc::MAP_GROWSDOWN as u32,
            ..anon.clone()
        },
        VmaEntry {
            status: anon.status | status::STACK,
            ..anon.clone()
        },
        VmaEntry {
            status: status::REGULAR | status::FILE_PRIVATE,
            flags: libc::MAP_PRIVATE as u32,
            ..anon.clone()
        },
        VmaEntry {
            status: status::REGULAR | status::ANON_SHARED,
            flags: (libc::MAP_SHARED | libc::MAP_ANONYMOUS) as u32,
            ..anon.clone()
        },
        VmaEntry {
            status: anon.status | status::VDSO,
            ..anon.clone()
        },
    ] {
        assert!(!movable_vma(&not), "{not:?}");
    }
}

/// A dump directory written by hand: process 10 (threads 10 and 11, 11 with an rseq area in
/// mapping D) and its child 20, which has mapping B at the same addresses.
fn synthetic_dump(dir: &Path) -> Vec<u8> {
    use crate::images::{
        encode_image, InventoryEntry, PagemapHead, PluginsEntry, RseqEntry, ThreadCoreEntry,
        INVENTORY_MAGIC,
    };
    use prost::Message as _;
    let write = |name: &str, magic: u32, msgs: Vec<Vec<u8>>| {
        fs::write(dir.join(name), encode_image(magic, &msgs)).unwrap();
    };
    write(
        "inventory.img",
        INVENTORY_MAGIC,
        vec![InventoryEntry {
            img_version: 2,
            plugins_entry: Some(PluginsEntry::default()),
        }
        .encode_to_vec()],
    );
    write(
        "pstree.img",
        PSTREE_MAGIC,
        vec![
            PstreeEntry {
                pid: 10,
                ppid: 0,
                threads: vec![10, 11],
            }
            .encode_to_vec(),
            PstreeEntry {
                pid: 20,
                ppid: 10,
                threads: vec![20],
            }
            .encode_to_vec(),
        ],
    );
    let anon = |start: u64, pages: u64| VmaEntry {
        start,
        end: start + pages * P,
        prot: (libc::PROT_READ | libc::PROT_WRITE) as u32,
        flags: (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u32,
        status: status::REGULAR | status::ANON_PRIVATE,
        madv: None,
    };
    let file = VmaEntry {
        flags: libc::MAP_PRIVATE as u32,
        status: status::REGULAR | status::FILE_PRIVATE,
        ..anon(0x300 * P, 1)
    };
    let vmas10 = vec![
        anon(0x100 * P, 64),
        anon(0x200 * P, 16),
        file,
        anon(0x400 * P, 8),
    ];
    let mm = |vmas| vec![MmEntry { vmas }.encode_to_vec()];
    write("mm-10.img", MM_MAGIC, mm(vmas10));
    write("mm-20.img", MM_MAGIC, mm(vec![anon(0x200 * P, 16)]));
    let core = |rseq: Option<u64>| {
        vec![CoreEntry {
            thread_core: Some(ThreadCoreEntry {
                rseq_entry: rseq.map(|p| RseqEntry {
                    rseq_abi_pointer: p,
                    rseq_abi_size: 32,
                }),
            }),
        }
        .encode_to_vec()]
    };
    write("core-10.img", CORE_MAGIC, core(None));
    write("core-11.img", CORE_MAGIC, core(Some(0x403 * P + 0x10)));
    write("core-20.img", CORE_MAGIC, core(None));
    let runs = [(0x100, 64), (0x200, 16), (0x300, 1), (0x400, 8)];
    let pm = Pagemap {
        head: PagemapHead { pages_id: 1 },
        entries: runs.iter().map(|&(a, n)| pe(a * P, n)).collect(),
    };
    fs::write(dir.join("pagemap-10.img"), pm.encode()).unwrap();
    // Page k of the file is filled with its page number's low byte, plus 1.
    let pages: Vec<u8> = (0..89u64)
        .flat_map(|k| std::iter::repeat_n(k as u8 + 1, P as usize))
        .collect();
    fs::write(dir.join("pages-1.img"), &pages).unwrap();
    let pm20 = Pagemap {
        head: PagemapHead { pages_id: 2 },
        entries: vec![pe(0x200 * P, 16)],
    };
    fs::write(dir.join("pagemap-20.img"), pm20.encode()).unwrap();
    fs::write(dir.join("pages-2.img"), vec![7u8; 16 * P as usize]).unwrap();
    pages
}

#[test]
fn a_split_moves_private_memory_and_leaves_shared_file_and_rseq_pages_to_criu() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let pages = synthetic_dump(dir);
    let page_of = |vaddr: u64| -> u64 {
        // The file offset of a page of process 10 in the original pages file.
        let runs = [(0x100u64, 64u64), (0x200, 16), (0x300, 1), (0x400, 8)];
        let mut off = 0;
        for (a, n) in runs {
            if vaddr >= a * P && vaddr < (a + n) * P {
                return off + (vaddr - a * P);
            }
            off += n * P;
        }
        panic!("{vaddr:#x} not in the pagemap")
    };
    assert!(!is_split(dir).unwrap());
    let report = split(dir, &ANY_SIZE).unwrap();
    assert!(is_split(dir).unwrap());
    assert_eq!(
        report.split,
        vec![TaskSplit {
            pid: 10,
            moved_bytes: 71 * P,
            kept_bytes: 18 * P,
            ranges: 3,
            rebased: None,
            ahead_error: None,
        }]
    );
    assert_eq!(report.left.len(), 1, "{report:?}");
    assert_eq!(report.left[0].0, 20);
    // CRIU keeps the shared mapping B, the file page and the rseq page, in a new pages file.
    let pm = Pagemap::read(&dir.join("pagemap-10.img")).unwrap();
    assert_eq!(pm.head.pages_id, 3);
    let kept: Vec<(u64, u64)> = pm
        .entries
        .iter()
        .map(|e| (e.vaddr / P, e.pages()))
        .collect();
    assert_eq!(kept, vec![(0x200, 16), (0x300, 1), (0x403, 1)]);
    let new_pages = fs::read(dir.join("pages-3.img")).unwrap();
    let mut want = Vec::new();
    for e in &pm.entries {
        let off = page_of(e.vaddr) as usize;
        want.extend_from_slice(&pages[off..off + e.len() as usize]);
    }
    assert_eq!(new_pages, want);
    // possum's data file is CRIU's old pages file; every moved byte is where the index says.
    assert!(!dir.join("pages-1.img").exists());
    let data = fs::read(dir.join("possum-hostmem-10.pages")).unwrap();
    assert_eq!(data, pages);
    let index = read_index(dir, 10).unwrap().unwrap();
    let runs: Vec<(u64, u64)> = index
        .ranges
        .iter()
        .map(|r| (r.vaddr / P, r.len / P))
        .collect();
    assert_eq!(runs, vec![(0x100, 64), (0x400, 3), (0x404, 4)]);
    for r in &index.ranges {
        for k in 0..r.len / P {
            let at = (r.offset + k * P) as usize;
            assert_eq!(data[at], pages[page_of(r.vaddr + k * P) as usize]);
        }
    }
    // The child is untouched; the images now need possum's plugin.
    assert_eq!(
        fs::read(dir.join("pages-2.img")).unwrap(),
        vec![7u8; 16 * P as usize]
    );
    assert!(read_index(dir, 20).unwrap().is_none());
    assert!(!crate::images::require_plugin(dir, PLUGIN_NAME).unwrap());
}

/// Split onto a draft sent ahead: the draft, unchanged, becomes the data file; the pages it
/// lacks or has wrong are copied into a tail after it, and the index points into both.
#[test]
fn a_split_onto_a_draft_keeps_it_as_sent_and_puts_what_it_lacks_or_has_wrong_in_a_tail() {
    use std::os::unix::fs::MetadataExt as _;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("criu");
    fs::create_dir(&dir).unwrap();
    let pages = synthetic_dump(&dir);
    // Process 10's moved pages, by address: runs (0x100, 64), then 0x400..0x403, 0x404..0x408.
    let byte_of = |vaddr: u64| -> u8 {
        let k = if vaddr >= 0x400 * P {
            64 + 16 + 1 + (vaddr / P - 0x400)
        } else {
            vaddr / P - 0x100
        };
        pages[(k * P) as usize]
    };
    // The draft: pages 0x100..0x120 at 0 (right but for 0x105 and 0x106), 0x400..0x402 at 32P
    // (wrong), and 0x500..0x504 at 34P (gone since).
    let ahead = tmp.path().join(ahead::AHEAD_DIR);
    fs::create_dir(&ahead).unwrap();
    let mut draft = Vec::new();
    for k in 0..32u64 {
        let b = if k == 5 || k == 6 {
            0
        } else {
            byte_of((0x100 + k) * P)
        };
        draft.extend(std::iter::repeat_n(b, P as usize));
    }
    draft.extend(std::iter::repeat_n(0xaa, 6 * P as usize));
    fs::write(ahead.join("possum-hostmem-10.pages"), &draft).unwrap();
    let layout = Index {
        data_file: "possum-hostmem-10.pages".into(),
        data_len: 38 * P,
        part_bytes: 0,
        more: Vec::new(),
        ranges: vec![
            Range {
                vaddr: 0x100 * P,
                offset: 0,
                len: 32 * P,
            },
            Range {
                vaddr: 0x400 * P,
                offset: 32 * P,
                len: 2 * P,
            },
            Range {
                vaddr: 0x500 * P,
                offset: 34 * P,
                len: 4 * P,
            },
        ],
    };
    fs::write(ahead.join("possum-hostmem-10.ahead"), layout.encode()).unwrap();
    let inode = fs::metadata(ahead.join("possum-hostmem-10.pages"))
        .unwrap()
        .ino();
    let opts = SplitOptions {
        ahead: Some(ahead.clone()),
        ..ANY_SIZE
    };
    let report = split(&dir, &opts).unwrap();
    let t = &report.split[0];
    assert_eq!((t.pid, t.moved_bytes), (10, 71 * P));
    let rebased = t.rebased.as_ref().expect("laid onto its draft");
    assert_eq!(t.ahead_error, None);
    assert_eq!(rebased.inode.1, inode);
    assert_eq!(rebased.reused_bytes, 30 * P);
    // The draft is the data file now, as it was sent; the tail holds 0x105, 0x106, 0x400,
    // 0x401 (wrong), 0x120..0x140, 0x402 and 0x404..0x408 (new; the rseq page 0x403 stays with
    // CRIU): 41 pages, in one part.
    assert!(!dir.join("pages-1.img").exists());
    assert!(!ahead.join("possum-hostmem-10.pages").exists());
    let data_path = dir.join("possum-hostmem-10.pages");
    assert_eq!(fs::metadata(&data_path).unwrap().ino(), inode);
    assert_eq!(fs::read(&data_path).unwrap(), draft);
    let index = read_index(&dir, 10).unwrap().unwrap();
    assert_eq!(
        index.more,
        vec![("possum-hostmem-10.tail.0".to_string(), 41 * P)]
    );
    assert_eq!(index.files()[0], ("possum-hostmem-10.pages".into(), 38 * P));
    assert_eq!(index.bytes(), 71 * P);
    assert!(index
        .ranges
        .windows(2)
        .all(|w| w[0].vaddr + w[0].len <= w[1].vaddr));
    // Every moved byte is where the index says, in the draft and its tail one after another.
    let mut data = draft.clone();
    data.extend(fs::read(dir.join("possum-hostmem-10.tail.0")).unwrap());
    assert_eq!(data.len() as u64, index.data_len);
    for r in &index.ranges {
        for k in 0..r.len / P {
            let at = (r.offset + k * P) as usize;
            let v = r.vaddr + k * P;
            assert!(
                data[at..at + P as usize].iter().all(|&b| b == byte_of(v)),
                "page {:#x}",
                v / P
            );
        }
    }
    // The index of several files reads back as written.
    let path = index_path(&dir, 10);
    assert_eq!(Index::decode(&index.encode(), &path).unwrap(), index);
}

/// A fill takes each run from the file of the data it falls in, draft or tail.
#[test]
fn a_fill_from_a_draft_and_its_tail_writes_every_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut target = vec![0u8; 6 * P as usize];
    let at = target.as_mut_ptr() as u64;
    let base = at.next_multiple_of(P);
    let skip = (base - at) as usize;
    // The data: a 2-page draft (pages 'a', 'b') and a 3-page tail ('c', 'd', 'e').
    fs::write(
        dir.join("possum-hostmem-3.pages"),
        [vec![b'a'; P as usize], vec![b'b'; P as usize]].concat(),
    )
    .unwrap();
    let tail: Vec<u8> = [b'c', b'd', b'e']
        .iter()
        .flat_map(|&c| vec![c; P as usize])
        .collect();
    fs::write(dir.join("possum-hostmem-3.tail.0"), &tail).unwrap();
    // Pages 0..2 from the tail's last two then the draft's first (a run across two files),
    // page 3 from the draft's second.
    let index = Index {
        data_file: "possum-hostmem-3.pages".into(),
        data_len: 5 * P,
        part_bytes: 0,
        more: vec![("possum-hostmem-3.tail.0".into(), 3 * P)],
        ranges: vec![
            Range {
                vaddr: base,
                offset: 3 * P,
                len: 2 * P,
            },
            Range {
                vaddr: base + 2 * P,
                offset: 0,
                len: P,
            },
            Range {
                vaddr: base + 3 * P,
                offset: P,
                len: P,
            },
        ],
    };
    fs::write(index_path(dir, 3), index.encode()).unwrap();
    let pid = std::process::id() as i32;
    fill(dir, 3, pid, 2).unwrap().unwrap();
    let page = |k: usize| target[skip + k * P as usize];
    assert_eq!(
        [page(0), page(1), page(2), page(3)],
        [b'd', b'e', b'a', b'b']
    );
    // A run across the draft's end into the tail reads both.
    let across = Index {
        ranges: vec![Range {
            vaddr: base,
            offset: P,
            len: 2 * P,
        }],
        ..index
    };
    fs::write(index_path(dir, 3), across.encode()).unwrap();
    fill(dir, 3, pid, 2).unwrap().unwrap();
    assert_eq!([page(0), page(1)], [b'b', b'c']);
}

/// Split for a migration: the same runs, CRIU's pages file copied into parts and removed.
#[test]
fn a_split_into_parts_leaves_the_bytes_in_the_parts_and_no_pages_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let pages = synthetic_dump(dir);
    let opts = SplitOptions {
        part_bytes: Some(1),
        ..ANY_SIZE
    };
    let report = split(dir, &opts).unwrap();
    assert_eq!(report.split.len(), 1, "{report:?}");
    assert_eq!(report.split[0].moved_bytes, 71 * P);
    let index = read_index(dir, 10).unwrap().unwrap();
    // Parts are whole pieces of a fill (one here: the file is smaller).
    assert_eq!(index.part_bytes, FILL_CHUNK);
    assert_eq!(
        index.files(),
        vec![("possum-hostmem-10.pages.0".to_string(), pages.len() as u64)]
    );
    assert_eq!(
        fs::read(dir.join("possum-hostmem-10.pages.0")).unwrap(),
        pages
    );
    assert!(!dir.join("pages-1.img").exists());
    assert!(!dir.join("possum-hostmem-10.pages").exists());
    let pm = Pagemap::read(&dir.join("pagemap-10.img")).unwrap();
    assert_eq!(pm.head.pages_id, 3);
}

#[test]
fn a_pagemap_of_a_pre_dump_chain_is_left_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    synthetic_dump(dir);
    let path = dir.join("pagemap-10.img");
    let mut pm = Pagemap::read(&path).unwrap();
    pm.entries[0].flags = Some(PE_PARENT);
    fs::write(&path, pm.encode()).unwrap();
    let report = split(dir, &ANY_SIZE).unwrap();
    assert!(report.split.is_empty(), "{report:?}");
    assert!(report
        .left
        .iter()
        .any(|(p, why)| *p == 10 && why.contains("not in this image")));
    assert_eq!(Pagemap::read(&path).unwrap(), pm);
    assert!(dir.join("pages-1.img").exists());
}

#[test]
fn fill_lines_are_read_back_from_a_log() {
    let r = FillReport {
        bytes: 1 << 30,
        ranges: 12,
        threads: 16,
        time: Duration::from_micros(54_321),
    };
    let log = format!(
        "(00.1) other line\n(00.2) possum-criu-plugin: {}\n(00.3) pid 9: host memory lost\n",
        r.log_line(4242)
    );
    assert_eq!(fills_in_log(&log), vec![(4242, 1 << 30, 54.3)]);
}

#[test]
fn the_index_round_trips_and_corruption_is_caught() {
    let idx = Index {
        data_file: "possum-hostmem-7.pages".into(),
        data_len: 16 * P,
        part_bytes: 0,
        more: Vec::new(),
        ranges: vec![
            Range {
                vaddr: 0x7f00_0000_0000,
                offset: 0,
                len: 4 * P,
            },
            Range {
                vaddr: 0x10_0000,
                offset: 8 * P,
                len: 8 * P,
            },
        ],
    };
    let path = Path::new("possum-hostmem-7.idx");
    let bytes = idx.encode();
    assert_eq!(Index::decode(&bytes, path).unwrap(), idx);
    assert_eq!(idx.bytes(), 12 * P);
    let mut bad = bytes.clone();
    bad[30] ^= 1;
    let e = Index::decode(&bad, path).unwrap_err().to_string();
    assert!(e.contains("checksum"), "{e}");
    let e = Index::decode(b"garbage!garbage!", path)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a possum host-memory index"), "{e}");
    // A run past the data file is refused even with a good checksum.
    let past = Index {
        data_len: 4 * P,
        ..idx
    };
    let e = Index::decode(&past.encode(), path).unwrap_err().to_string();
    assert!(e.contains("outside the data file"), "{e}");
}

/// Indexes that checksum right but would make a fill plan without bound, overflow an
/// address or name a file that is not a plain one are refused.
#[test]
fn a_well_checksummed_index_is_still_checked() {
    let path = Path::new("possum-hostmem-7.idx");
    let run = |vaddr, offset, len| Range { vaddr, offset, len };
    let refused = |idx: Index| Index::decode(&idx.encode(), path).unwrap_err().to_string();
    // The same 4 pages of the file, a million times: more than the file holds.
    let e = refused(Index {
        data_file: "p".into(),
        data_len: 4 * P,
        part_bytes: 0,
        more: Vec::new(),
        ranges: vec![run(0, 0, 4 * P); 1 << 20],
    });
    assert!(e.contains("add up to more than"), "{e}");
    let e = refused(Index {
        data_file: "p".into(),
        data_len: u64::MAX,
        part_bytes: 0,
        more: Vec::new(),
        ranges: vec![run(u64::MAX - P + 1, 0, 2 * P)],
    });
    assert!(e.contains("address space"), "{e}");
    for name in ["..", ".", "a/b", "a\0b", ""] {
        let e = refused(Index {
            data_file: name.into(),
            data_len: 0,
            part_bytes: 0,
            more: Vec::new(),
            ranges: vec![],
        });
        assert!(e.contains("not a plain file name"), "{name:?}: {e}");
    }
    // Runs that together reach exactly the file's end are fine.
    let ok = Index {
        data_file: "p".into(),
        data_len: 8 * P,
        part_bytes: 0,
        more: Vec::new(),
        ranges: vec![run(0, 4 * P, 4 * P), run(8 * P, 0, 4 * P)],
    };
    assert_eq!(Index::decode(&ok.encode(), path).unwrap().bytes(), 8 * P);
    // In parts: of whole pages, and not more than a directory should hold.
    for part_bytes in [P + 1, 1] {
        let e = refused(Index {
            part_bytes,
            ..ok.clone()
        });
        assert!(e.contains("parts of"), "{part_bytes}: {e}");
    }
    let e = refused(Index {
        data_len: u64::MAX - u64::MAX % P,
        part_bytes: P,
        more: Vec::new(),
        ranges: vec![],
        ..ok.clone()
    });
    assert!(e.contains("more than"), "{e}");
}

#[test]
fn an_index_in_parts_round_trips_and_names_its_parts() {
    let idx = Index {
        data_file: "possum-hostmem-7.pages".into(),
        data_len: 5 * P,
        part_bytes: 2 * P,
        more: Vec::new(),
        ranges: vec![Range {
            vaddr: 0x10_0000,
            offset: P,
            len: 3 * P,
        }],
    };
    let path = Path::new("possum-hostmem-7.idx");
    let bytes = idx.encode();
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 2);
    assert_eq!(Index::decode(&bytes, path).unwrap(), idx);
    let names: Vec<(String, u64)> = idx.files();
    assert_eq!(
        names,
        vec![
            ("possum-hostmem-7.pages.0".to_string(), 2 * P),
            ("possum-hostmem-7.pages.1".to_string(), 2 * P),
            ("possum-hostmem-7.pages.2".to_string(), P),
        ]
    );
    // One file: version 1, as before.
    let one = Index {
        part_bytes: 0,
        more: Vec::new(),
        ..idx
    };
    assert_eq!(
        u32::from_le_bytes(one.encode()[8..12].try_into().unwrap()),
        1
    );
    assert_eq!(
        one.files(),
        vec![("possum-hostmem-7.pages".to_string(), 5 * P)]
    );
}

/// A data file copied into parts holds every byte where the whole file had it.
#[test]
fn a_pages_file_copied_into_parts_keeps_every_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let len = 2 * FILL_CHUNK + 5 * P;
    let data: Vec<u8> = (0..len).map(|i| (i / P * 7 + i) as u8).collect();
    let src_path = dir.join("pages-1.img");
    fs::write(&src_path, &data).unwrap();
    let index = Index {
        data_file: "possum-hostmem-3.pages".into(),
        data_len: len,
        part_bytes: FILL_CHUNK,
        more: Vec::new(),
        ranges: vec![],
    };
    copy_into_parts(&File::open(&src_path).unwrap(), &src_path, dir, &index).unwrap();
    let mut joined = Vec::new();
    for (name, want) in index.files() {
        let part = fs::read(dir.join(&name)).unwrap();
        assert_eq!(part.len() as u64, want, "{name}");
        joined.extend_from_slice(&part);
    }
    assert_eq!(index.files().len(), 3);
    assert!(joined == data, "the parts differ from the file");
}

/// A fill from parts writes each run into the process, runs crossing a part's end included
/// (here into this very process, whose memory `process_vm_writev` reaches as any other's).
#[test]
fn a_fill_from_parts_writes_runs_across_part_boundaries() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let data: Vec<u8> = (0..5 * P).map(|i| (i / P + 1) as u8 ^ (i as u8)).collect();
    let index = Index {
        data_file: "possum-hostmem-9.pages".into(),
        data_len: 5 * P,
        part_bytes: 2 * P,
        more: Vec::new(),
        ranges: Vec::new(),
    };
    for (k, (name, len)) in index.files().into_iter().enumerate() {
        let at = k * 2 * P as usize;
        fs::write(dir.join(name), &data[at..at + len as usize]).unwrap();
    }
    // Four pages of this process, page-aligned, zeroed.
    let mut mem = vec![0u8; 5 * P as usize];
    let base = (mem.as_ptr() as u64).next_multiple_of(P);
    let index = Index {
        ranges: vec![
            Range {
                vaddr: base,
                offset: P,
                len: 3 * P,
            },
            Range {
                vaddr: base + 3 * P,
                offset: 0,
                len: P,
            },
        ],
        ..index
    };
    fs::write(index_path(dir, 9), index.encode()).unwrap();
    let me = std::process::id() as i32;
    let report = fill(dir, 9, me, 3).unwrap().unwrap();
    assert_eq!(report.bytes, 4 * P);
    let start = (base - mem.as_ptr() as u64) as usize;
    let got = std::hint::black_box(&mut mem)[start..start + 4 * P as usize].to_vec();
    let mut want = data[P as usize..4 * P as usize].to_vec();
    want.extend_from_slice(&data[..P as usize]);
    assert!(
        got == want,
        "the runs were not written where the index says"
    );
    // A part cut short is refused by name before anything is written.
    fs::write(dir.join("possum-hostmem-9.pages.1"), [0u8; 3]).unwrap();
    let e = fill(dir, 9, me, 3).unwrap_err().to_string();
    assert!(
        e.contains("possum-hostmem-9.pages.1") && e.contains("truncated"),
        "{e}"
    );
}

/// An index of one data file whose file came in parts (a migration's sender cuts it so): read
/// as parts of the first's size, which a fill takes across their boundaries; the file itself,
/// when it is there, wins. A first part not of whole pages is refused by name.
#[test]
fn an_index_of_one_file_reads_that_file_sent_in_parts() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let data: Vec<u8> = (0..5 * P).map(|i| (i / P + 7) as u8 ^ (i as u8)).collect();
    let mut mem = vec![0u8; 6 * P as usize];
    let base = (mem.as_ptr() as u64).next_multiple_of(P);
    let index = Index {
        data_file: "possum-hostmem-8.pages".into(),
        data_len: 5 * P,
        part_bytes: 0,
        more: Vec::new(),
        ranges: vec![Range {
            vaddr: base,
            offset: P,
            len: 4 * P,
        }],
    };
    fs::write(index_path(dir, 8), index.encode()).unwrap();
    for (k, chunk) in data.chunks(2 * P as usize).enumerate() {
        fs::write(dir.join(format!("possum-hostmem-8.pages.{k}")), chunk).unwrap();
    }
    let read = read_index(dir, 8).unwrap().unwrap();
    assert_eq!(read.part_bytes, 2 * P);
    assert_eq!(whole_data_files(dir).unwrap(), Vec::<String>::new());
    let me = std::process::id() as i32;
    assert_eq!(fill(dir, 8, me, 2).unwrap().unwrap().bytes, 4 * P);
    let start = (base - mem.as_ptr() as u64) as usize;
    let got = std::hint::black_box(&mut mem)[start..start + 4 * P as usize].to_vec();
    assert!(
        got == data[P as usize..],
        "the parts were not read in order"
    );

    // The whole file there: it is the data, and what a sender cuts.
    fs::write(dir.join("possum-hostmem-8.pages"), &data).unwrap();
    assert_eq!(read_index(dir, 8).unwrap().unwrap().part_bytes, 0);
    assert_eq!(
        whole_data_files(dir).unwrap(),
        vec!["possum-hostmem-8.pages".to_string()]
    );
    fs::remove_file(dir.join("possum-hostmem-8.pages")).unwrap();
    fs::write(dir.join("possum-hostmem-8.pages.0"), [1u8; 100]).unwrap();
    let e = read_index(dir, 8).unwrap_err().to_string();
    assert!(e.contains("possum-hostmem-8.pages.0"), "{e}");
}

/// A data file is sent in parts of the size asked, unless that would make more parts than a
/// reader takes: then in the least whole MiB that makes no more.
#[test]
fn parts_are_as_asked_unless_too_many() {
    use super::index::MAX_PARTS;
    assert_eq!(part_bytes_for(1 << 30, 64 << 20), 64 << 20);
    assert_eq!(part_bytes_for(0, 1 << 20), 1 << 20);
    // 32 GiB in 1 MiB parts would be 32768 of them: 2 MiB parts.
    let len = 32u64 << 30;
    let p = part_bytes_for(len, 1 << 20);
    assert_eq!(p, 2 << 20);
    assert!(len.div_ceil(p) <= MAX_PARTS);
    // A size not of whole pages is made so.
    assert_eq!(part_bytes_for(0, 5000), 8192);
}
