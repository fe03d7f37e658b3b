//! Images past 4 GiB: buffers, chunks and data files whose sizes or offsets do not fit 32
//! bits (part of [`super`]).

use super::*;

#[test]
fn coverage_of_buffers_past_4_gib() {
    let size = 5 * GIB + 3;
    let mut exact = pieces(size, GIB);
    assert_eq!(exact.len(), 6);
    assert_eq!(check_coverage(size, &exact), Ok(()));

    // Gap past 4 GiB.
    let mut gapped = exact.clone();
    gapped.remove(4);
    assert_eq!(
        check_coverage(size, &gapped),
        Err(CoverageError::Gap {
            start: 4 * GIB,
            end: 5 * GIB
        })
    );
    // Overlap past 4 GiB.
    exact[5].0 -= 1;
    exact[5].1 += 1;
    assert_eq!(
        check_coverage(size, &exact),
        Err(CoverageError::Overlap {
            offset: 5 * GIB - 1,
            prev_end: 5 * GIB
        })
    );
    // Missing tail.
    let head = pieces(size, GIB);
    assert_eq!(
        check_coverage(size, &head[..5]),
        Err(CoverageError::Gap {
            start: 5 * GIB,
            end: size
        })
    );
    // Past the end, and u64 overflow.
    assert_eq!(
        check_coverage(4 * GIB, &[(0, 4 * GIB + 1)]),
        Err(CoverageError::PastEnd {
            offset: 0,
            len: 4 * GIB + 1,
            size: 4 * GIB
        })
    );
    assert_eq!(
        check_coverage(u64::MAX, &[(0, u64::MAX - 1), (u64::MAX - 1, 2)]),
        Err(CoverageError::PastEnd {
            offset: u64::MAX - 1,
            len: 2,
            size: u64::MAX
        })
    );
    assert_eq!(check_coverage(u64::MAX, &[(0, u64::MAX)]), Ok(()));
    // Degenerate cases.
    assert_eq!(check_coverage(0, &[]), Ok(()));
    assert_eq!(
        check_coverage(0, &[(0, 1)]),
        Err(CoverageError::PastEnd {
            offset: 0,
            len: 1,
            size: 0
        })
    );
    assert_eq!(
        check_coverage(10, &[(0, 0)]),
        Err(CoverageError::Empty { offset: 0 })
    );
    assert_eq!(
        check_coverage(10, &[]),
        Err(CoverageError::Gap { start: 0, end: 10 })
    );
    assert_eq!(
        check_coverage(20, &[(10, 10), (0, 10)]),
        Err(CoverageError::Gap { start: 0, end: 10 })
    );
    assert_eq!(
        check_coverage(20, &[(0, 10), (10, 5), (5, 5)]),
        Err(CoverageError::Overlap {
            offset: 5,
            prev_end: 15
        })
    );
}

/// A 5 GiB buffer through the manifest and reader without writing 5 GiB: its first chunks share
/// one region of a sparse data file (never read here); its last 4 KiB chunk, past 4 GiB, holds real
/// bytes.
#[test]
fn buffer_past_4_gib_through_manifest_and_reader() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("big");
    fs::create_dir(&dir).unwrap();
    let size = 5 * GIB;
    let tail_off = size - 4096;
    let tail = pattern(1, tail_off, 4096, 0);
    let data = fs::File::create(dir.join("data-000.bin")).unwrap();
    data.set_len(GIB).unwrap();
    data.write_all_at(&tail, GIB).unwrap();
    let mut chunks: Vec<ChunkMsg> = (0..4)
        .map(|i| ChunkMsg {
            buffer: 1,
            offset: i * GIB,
            len: GIB,
            file: 0,
            file_offset: 0,
            crc32c: 0,
            ..Default::default()
        })
        .collect();
    chunks.push(ChunkMsg {
        buffer: 1,
        offset: 4 * GIB,
        len: GIB - 4096,
        file: 0,
        file_offset: 0,
        crc32c: 0,
        ..Default::default()
    });
    chunks.push(ChunkMsg {
        buffer: 1,
        offset: tail_off,
        len: 4096,
        file: 0,
        file_offset: GIB,
        crc32c: crc32c::crc32c(&tail),
        ..Default::default()
    });
    chunks.reverse(); // order in the manifest does not matter
    let m = Manifest {
        major: FORMAT_MAJOR,
        minor: FORMAT_MINOR,
        created_unix_nanos: 1,
        meta: BTreeMap::from([("k".to_owned(), "v".to_owned())]),
        buffers: vec![BufferMsg {
            id: 1,
            va: 0x7000_0000_0000,
            size,
            prefetch_rank: 0,
        }],
        chunks,
        files: vec![DataFileMsg {
            name: "data-000.bin".into(),
            len: GIB + 4096,
            parent: None,
        }],
        parents: vec![],
    };
    fs::write(
        dir.join(MANIFEST_FILE),
        encode_framed(&m, FORMAT_MAJOR, FORMAT_MINOR),
    )
    .unwrap();

    let img = Image::open(&dir).unwrap();
    assert_eq!(img.summary().total_bytes, size);
    assert_eq!(
        img.summary().created,
        std::time::UNIX_EPOCH + std::time::Duration::from_nanos(1)
    );
    let got = img.chunks(1);
    assert_eq!(got.len(), 6);
    assert_eq!(got[5], (tail_off, 4096));
    let mut dst = vec![0u8; 4096];
    img.read_chunk(1, tail_off, &mut dst).unwrap();
    assert_eq!(dst, tail);

    flip_byte(&dir.join("data-000.bin"), GIB + 7);
    let e = img.read_chunk(1, tail_off, &mut dst).unwrap_err();
    assert!(
        e.to_string()
            .ends_with("data-000.bin: checksum mismatch in buffer 1 at offset 5368705024"),
        "{e}"
    );

    // Shrinking the buffer below the chunks is caught with the large offset.
    let mut m2 = m.clone();
    m2.buffers[0].size = size - 1;
    fs::write(
        dir.join(MANIFEST_FILE),
        encode_framed(&m2, FORMAT_MAJOR, FORMAT_MINOR),
    )
    .unwrap();
    assert_open_fails!(
        &dir,
        ImageError::BadCoverage { problem: CoverageError::PastEnd { offset, .. }, .. }
            if offset == tail_off
    );
}

/// Two calls writing the same chunk at once: one rewrites it in place, the other appends (it may
/// not share the place); the image holds exactly one of them, CRC intact, whichever order they
/// end in. A chunk of another length is appended.
#[test]
fn concurrent_rewrites_of_a_chunk_never_tear_it() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ckpt");
    let w = ImageWriter::create(
        &dir,
        WriterOptions {
            fsync: false,
            ..WriterOptions::default()
        },
    )
    .unwrap();
    let len = 1u64 << 20;
    w.add_buffer(rec(1, len, 0)).unwrap();
    w.write_chunk(1, 0, &pattern(1, 0, len, 0)).unwrap();
    for round in 1..=20u8 {
        std::thread::scope(|sc| {
            for g in [round, round.wrapping_add(100)] {
                let w = &w;
                sc.spawn(move || w.write_chunk(1, 0, &pattern(1, 0, len, g)).unwrap());
            }
        });
    }
    let summary = w.commit().unwrap();
    // At most one appended copy per round (the loser of each race), never less than the buffer.
    assert!(summary.data_file_bytes >= len && summary.data_file_bytes <= 21 * len);
    let img = Image::open(&dir).unwrap();
    img.verify().unwrap();
    let mut got = vec![0u8; len as usize];
    img.read_chunk(1, 0, &mut got).unwrap();
    assert!(
        (0..=255u8).any(|g| got == pattern(1, 0, len, g)),
        "the chunk is a mix of two writes"
    );
}

/// A chunk longer than the piece `read_chunk` reads at once: read whole and right, and a byte
/// flipped in its last piece is still caught.
#[test]
fn a_chunk_read_in_pieces_is_checked_whole() {
    let (_root, dir) = scratch();
    let size = (3 << 20) + 5;
    let w = ImageWriter::create(&dir, one_file()).unwrap();
    w.add_buffer(rec(7, size, 0)).unwrap();
    w.write_chunk(7, 0, &pattern(7, 0, size, 0)).unwrap();
    w.commit().unwrap();
    let img = Image::open(&dir).unwrap();
    let mut dst = vec![0u8; size as usize];
    img.read_chunk(7, 0, &mut dst).unwrap();
    assert!(dst == pattern(7, 0, size, 0));
    let m = manifest_of(&dir);
    let c = &m.chunks[0];
    flip_byte(
        &dir.join(&m.files[c.file as usize].name),
        c.file_offset + size - 2,
    );
    let e = Image::open(&dir)
        .unwrap()
        .read_chunk(7, 0, &mut dst)
        .unwrap_err();
    assert!(
        matches!(e, ImageError::ChecksumMismatch { buffer: 7, .. }),
        "{e:?}"
    );
}

/// A data file written by someone else (the keeper's spare): adopted into the image, its chunks
/// recorded with their CRCs, cut to their end at commit; the image reads back whole, and a
/// record naming a file that was not adopted, or a wrong CRC, is caught.
#[test]
fn adopted_files_hold_chunks_written_elsewhere() {
    use std::os::unix::fs::FileExt;
    let (root, dir, w) = scratch_writer(one_file());
    w.add_buffer(rec(1, 3000, 0)).unwrap();
    w.add_buffer(rec(2, 5000, 1)).unwrap();
    w.write_chunk(1, 0, &pattern(1, 0, 3000, 0)).unwrap();
    let (spare, b2) = spare_holding_buffer_2(root.path());
    let file = w.adopt_file(&spare).unwrap();
    assert_eq!(file, 1);
    assert!(!spare.exists(), "renamed into the image");
    let err = w.record_chunk(2, 0, 2000, 0, 4096, 0).unwrap_err();
    assert!(err.to_string().contains("not adopted"), "{err}");
    w.record_chunk(2, 0, 2000, file, 4096, crc32c::crc32c(&b2[..2000]))
        .unwrap();
    w.record_chunk(2, 2000, 3000, file, 6096, crc32c::crc32c(&b2[2000..]))
        .unwrap();
    w.commit().unwrap();
    let m = manifest_of(&dir);
    assert_eq!(m.files[1].len, 9096, "cut to its last chunk's end");
    assert_eq!(
        fs::metadata(dir.join(&m.files[1].name)).unwrap().len(),
        9096
    );
    let img = Image::open(&dir).unwrap();
    img.verify().unwrap();
    let mut got = vec![0u8; 5000];
    img.read_chunk(2, 0, &mut got[..2000]).unwrap();
    img.read_chunk(2, 2000, &mut got[2000..]).unwrap();
    assert!(got == b2);
    // A wrong CRC recorded is caught when read.
    let dir2 = root.path().join("img2");
    let w = ImageWriter::create(&dir2, fast()).unwrap();
    w.add_buffer(rec(2, 5000, 0)).unwrap();
    let f = fs::File::create(&spare).unwrap();
    f.write_all_at(&b2, 0).unwrap();
    let file = w.adopt_file(&spare).unwrap();
    w.record_chunk(2, 0, 5000, file, 0, 12345).unwrap();
    w.commit().unwrap();
    assert!(Image::open(&dir2).unwrap().verify().is_err());
}

/// A spare (`dir/spare`, 1 MiB) holding buffer 2's 5000 bytes at 4096: its path and those bytes.
fn spare_holding_buffer_2(dir: &std::path::Path) -> (std::path::PathBuf, Vec<u8>) {
    use std::os::unix::fs::FileExt;
    let spare = dir.join("spare");
    let f = fs::File::create(&spare).unwrap();
    f.set_len(1 << 20).unwrap();
    let b2 = pattern(2, 0, 5000, 0);
    f.write_all_at(&b2, 4096).unwrap();
    (spare, b2)
}

/// Chunks recorded in an adopted file are in the writer's account of what it wrote (only
/// those ranges, once) and in its journal while one is set, like a lane's: a migration sends
/// them while the copy runs and reads only them again.
#[test]
fn chunks_recorded_in_an_adopted_file_are_journaled_and_accounted() {
    use std::os::unix::fs::MetadataExt;
    let (root, _dir, w) = scratch_writer(one_file());
    w.add_buffer(rec(2, 5000, 0)).unwrap();
    let (spare, b2) = spare_holding_buffer_2(root.path());
    let file = w.adopt_file(&spare).unwrap();
    let m = fs::metadata(w.temp_dir().join(format!("data-{file:03}.bin"))).unwrap();
    let inode = (m.dev(), m.ino());
    let before = w.take_written();
    assert_eq!(before.len(), 2, "the lane and the adopted file: {before:?}");
    assert_eq!((before[1].inode, before[1].ranges.len()), (inode, 0));
    let journal = root.path().join("journal");
    let open = || OpenOptions::new().create(true).append(true).open(&journal);
    w.journal_to(Some(open().unwrap()));
    w.record_chunk(2, 0, 2000, file, 4096, crc32c::crc32c(&b2[..2000]))
        .unwrap();
    w.journal_to(None);
    w.record_chunk(2, 2000, 3000, file, 6096, crc32c::crc32c(&b2[2000..]))
        .unwrap();
    let recs: Vec<JournalRecord> = fs::read(&journal)
        .unwrap()
        .chunks_exact(JournalRecord::BYTES)
        .map(|b| JournalRecord::from_bytes(b.try_into().unwrap()))
        .collect();
    let want = JournalRecord {
        inode,
        at: 4096,
        len: 2000,
    };
    assert_eq!(recs, vec![want], "only the chunk recorded while it was set");
    let written = w.take_written();
    assert_eq!(written[1].inode, inode);
    assert_eq!(written[1].ranges, vec![(4096, 5000)], "merged");
    assert!(w.take_written()[1].ranges.is_empty(), "taken");
}

/// `check_manifest` on a manifest's bytes agrees with `Image::open` on its directory.
#[test]
fn check_manifest_agrees_with_open() {
    let (_root, dir) = small();
    let bytes = fs::read(dir.join(MANIFEST_FILE)).unwrap();
    let summary = super::super::check_manifest(&dir, &bytes).unwrap();
    assert_eq!(&summary, Image::open(&dir).unwrap().summary());

    let mut flipped = bytes.clone();
    flipped[30] ^= 1;
    assert!(matches!(
        super::super::check_manifest(&dir, &flipped),
        Err(ImageError::ManifestChecksum { .. })
    ));
    assert!(matches!(
        super::super::check_manifest(&dir, &bytes[..5]),
        Err(ImageError::ManifestTruncated { .. })
    ));
    assert!(matches!(
        super::super::check_manifest(&dir, &bytes[..bytes.len() - 1]),
        Err(ImageError::ManifestTruncated { .. })
    ));
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(matches!(
        super::super::check_manifest(&dir, &longer),
        Err(ImageError::ManifestTrailingBytes { .. })
    ));
    // A payload length near u64::MAX is refused before anything is allocated or added up.
    let mut huge = bytes;
    huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        super::super::check_manifest(&dir, &huge),
        Err(ImageError::ManifestTooLarge { .. })
    ));
}
