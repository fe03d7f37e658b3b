//! Tests of the image format: round trips, crash safety of commit, and one test per way an image
//! is rejected.

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::manifest::{
    encode_framed, read_framed, BufferMsg, ChunkMsg, DataFileMsg, Manifest, HEADER_LEN,
};
use super::*;
use crate::store::{BufferRecord, ChunkSink, ChunkSource};

const GIB: u64 = 1 << 30;

/// Deterministic bytes for a chunk; `generation` distinguishes a rewrite of the same place.
fn pattern(buffer: u64, offset: u64, len: u64, generation: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let x = (buffer.wrapping_mul(31) ^ (offset + i).wrapping_mul(2654435761)) as u8;
            x.wrapping_add(generation.wrapping_mul(101))
        })
        .collect()
}

fn rec(id: u64, size: u64, rank: u32) -> BufferRecord {
    BufferRecord {
        id,
        va: 0x7f00_0000_0000 + id * 0x100_0000,
        size,
        prefetch_rank: rank,
    }
}

fn fast() -> WriterOptions {
    WriterOptions {
        fsync: false,
        ..Default::default()
    }
}

/// Options for an image whose chunks all go to one data file.
fn one_file() -> WriterOptions {
    WriterOptions {
        data_files: 1,
        ..fast()
    }
}

/// Options that replace whatever stands at the destination.
fn forced() -> WriterOptions {
    WriterOptions {
        force: true,
        ..fast()
    }
}

/// A temporary root and the not yet existing `<root>/img` in it.
fn scratch() -> (tempfile::TempDir, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("img");
    (root, dir)
}

/// [`scratch`] with a writer for its `img`.
fn scratch_writer(options: WriterOptions) -> (tempfile::TempDir, PathBuf, ImageWriter) {
    let (root, dir) = scratch();
    let w = ImageWriter::create(&dir, options).unwrap();
    (root, dir, w)
}

/// A temporary root holding [`small_image`].
fn small() -> (tempfile::TempDir, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let dir = small_image(root.path());
    (root, dir)
}

/// The (offset, len) pieces of a buffer of `size` cut into `chunk`-sized chunks.
fn pieces(size: u64, chunk: u64) -> Vec<(u64, u64)> {
    (0..size.div_ceil(chunk))
        .map(|i| (i * chunk, chunk.min(size - i * chunk)))
        .collect()
}

/// Sorted names in `dir`.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Asserts that `root` holds nothing but the image `img`; `what` names what was left behind.
fn assert_only_img(root: &Path, what: &str) {
    assert_eq!(entries(root), vec!["img"], "{what}");
}

/// Writes the `(buffer, offset, len)` chunks of generation `generation` from `threads` threads.
fn write_in_threads(w: &ImageWriter, work: &[(u64, u64, u64)], threads: usize, generation: u8) {
    std::thread::scope(|sc| {
        for part in work.chunks(work.len().div_ceil(threads)) {
            sc.spawn(move || {
                for &(id, off, len) in part {
                    w.write_chunk(id, off, &pattern(id, off, len, generation))
                        .unwrap();
                }
            });
        }
    });
}

/// A small committed image at `<root>/img` with one data file: buffer 1 (3000 bytes in chunks of
/// 1000), buffer 2 (1500 bytes: 1000 + 500), buffer 3 (empty).
fn small_image(root: &Path) -> PathBuf {
    let dir = root.join("img");
    let w = ImageWriter::create(&dir, one_file()).unwrap();
    for (id, size) in [(1, 3000), (2, 1500), (3, 0)] {
        w.add_buffer(rec(id, size, id as u32)).unwrap();
        for (off, len) in pieces(size, 1000) {
            w.write_chunk(id, off, &pattern(id, off, len, 0)).unwrap();
        }
    }
    w.set_meta("backend", "host").unwrap();
    w.commit().unwrap();
    dir
}

/// Decodes the manifest, lets `f` change it, and writes it back with valid framing and CRC.
fn rewrite_manifest(dir: &Path, f: impl FnOnce(&mut Manifest)) {
    let (major, minor, mut m) = read_framed(dir).unwrap();
    f(&mut m);
    fs::write(dir.join(MANIFEST_FILE), encode_framed(&m, major, minor)).unwrap();
}

fn manifest_of(dir: &Path) -> Manifest {
    read_framed(dir).unwrap().2
}

fn flip_byte(path: &Path, at: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x40;
    f.write_all_at(&b, at).unwrap();
}

fn truncate(path: &Path, len: u64) {
    OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

fn open_err(dir: &Path) -> ImageError {
    Image::open(dir).expect_err("the image should have been rejected")
}

/// Asserts that opening `dir` fails with an error matching `pattern`.
macro_rules! assert_open_fails {
    ($dir:expr, $($pattern:tt)+) => {{
        let e = open_err($dir);
        assert!(matches!(e, $($pattern)+), "{e:?}");
    }};
}

// ---------------------------------------------------------------------------------------------
// Round trips

#[test]
fn round_trip_threads_out_of_order_with_superseded_chunks() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ckpt");
    // Default options: fsync on, 4 data files.
    let w = ImageWriter::create(&dir, WriterOptions::default()).unwrap();
    let layout: [(u64, u64, u64); 5] = [
        (1, (1 << 20) + 123, 64 << 10),
        (7, 300 << 10, 100 << 10),
        (3, 0, 1),
        (9, 4096, 4096),
        (42, 777_777, 65_536),
    ];
    let mut work = Vec::new();
    for (i, &(id, size, chunk)) in layout.iter().enumerate() {
        w.add_buffer(rec(id, size, i as u32)).unwrap();
        work.extend(pieces(size, chunk).into_iter().map(|(o, l)| (id, o, l)));
    }
    // Shuffle deterministically (xorshift) so chunks arrive out of order.
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..work.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        work.swap(i, (s % (i as u64 + 1)) as usize);
    }
    write_in_threads(&w, &work, 4, 0);
    // A second "pre-copy round" rewrites some chunks; the manifest must keep only these.
    let superseded: Vec<(u64, u64, u64)> = work.iter().copied().step_by(5).collect();
    write_in_threads(&w, &superseded, 3, 1);
    w.set_meta("backend", "host").unwrap();
    w.set_meta("cpu-state", "criu:/var/lib/x").unwrap();
    w.set_meta("backend", "host-v2").unwrap();
    let tmp = w.temp_dir().to_path_buf();
    let summary = w.commit().unwrap();
    assert!(!tmp.exists());
    assert_eq!(entries(root.path()), vec!["ckpt"]);

    let total: u64 = layout.iter().map(|l| l.1).sum();
    assert_eq!(summary.total_bytes, total);
    assert_eq!(summary.chunks, work.len() as u64);
    // The second round's chunks were rewritten where the first round put them: no garbage.
    assert_eq!(summary.data_file_bytes, total);
    assert_eq!(summary.version, (FORMAT_MAJOR, FORMAT_MINOR));

    let img = Image::open(&dir).unwrap();
    assert_eq!(img.summary(), &summary);
    img.verify().unwrap();
    assert_eq!(img.meta("backend").as_deref(), Some("host-v2"));
    assert_eq!(img.meta("cpu-state").as_deref(), Some("criu:/var/lib/x"));
    assert_eq!(img.meta("nope"), None);
    let mut bufs = img.buffers();
    bufs.sort_by_key(|b| b.id);
    let mut want: Vec<BufferRecord> = layout
        .iter()
        .enumerate()
        .map(|(i, l)| rec(l.0, l.1, i as u32))
        .collect();
    want.sort_by_key(|b| b.id);
    assert_eq!(bufs, want);

    let newer: std::collections::HashSet<(u64, u64)> =
        superseded.iter().map(|&(b, o, _)| (b, o)).collect();
    // Read everything back from several threads at once.
    std::thread::scope(|sc| {
        for t in 0..3 {
            let (img, layout, newer) = (&img, &layout, &newer);
            sc.spawn(move || {
                for &(id, size, chunk) in layout.iter().skip(t) {
                    let got = img.chunks(id);
                    assert_eq!(got, pieces(size, chunk));
                    for (off, len) in got {
                        let mut dst = vec![0u8; len as usize];
                        img.read_chunk(id, off, &mut dst).unwrap();
                        let generation = u8::from(newer.contains(&(id, off)));
                        assert_eq!(
                            dst,
                            pattern(id, off, len, generation),
                            "buffer {id} @ {off}"
                        );
                    }
                }
            });
        }
    });
}

#[test]
fn later_write_call_wins() {
    let (_root, dir, w) = scratch_writer(fast());
    w.add_buffer(rec(5, 100, 0)).unwrap();
    for generation in 0..4 {
        w.write_chunk(5, 0, &pattern(5, 0, 100, generation))
            .unwrap();
    }
    let s = w.commit().unwrap();
    // Rewritten in place each time: one chunk's bytes in the data files.
    assert_eq!((s.chunks, s.data_file_bytes), (1, 100));
    let img = Image::open(&dir).unwrap();
    let mut dst = [0u8; 100];
    img.read_chunk(5, 0, &mut dst).unwrap();
    assert_eq!(dst.to_vec(), pattern(5, 0, 100, 3));
}

/// A chunk written with the fingerprint it must have: its fingerprint computed as it is written
/// (the one of its bytes), recorded when it is the one expected; one that is not is not
/// recorded, and the image, whose data file it may have overwritten in place, is never
/// committed.
#[test]
fn a_chunk_proven_as_it_is_written_and_one_that_is_not() {
    let (_root, dir, w) = scratch_writer(one_file());
    w.add_buffer(rec(1, 2000, 0)).unwrap();
    let (a, b) = (pattern(1, 0, 1000, 0), pattern(1, 1000, 1000, 0));
    let fp_a = crate::fingerprint::of(&a);
    assert_eq!(
        w.write_chunk_proving(1, 0, &a, Some(fp_a)).unwrap(),
        Ok(fp_a)
    );
    assert_eq!(
        w.write_chunk_proving(1, 1000, &b, None).unwrap(),
        Ok(crate::fingerprint::of(&b))
    );
    w.commit().unwrap();
    let img = Image::open(&dir).unwrap();
    let mut got = vec![0; 1000];
    img.read_chunk(1, 0, &mut got).unwrap();
    assert_eq!(got, a);
    assert_eq!(img.fingerprint(1, 0), Some(fp_a));

    let (_root, dir, w) = scratch_writer(one_file());
    w.add_buffer(rec(1, 1000, 0)).unwrap();
    w.write_chunk(1, 0, &a).unwrap();
    let torn = pattern(1, 0, 1000, 1);
    let r = w.write_chunk_proving(1, 0, &torn, Some(fp_a)).unwrap();
    assert_eq!(
        r,
        Err(crate::fingerprint::of(&torn)),
        "not the chunk expected"
    );
    let e = w.commit().unwrap_err();
    assert!(
        matches!(&e, ImageError::Spoiled { image } if image == &dir),
        "{e:?}"
    );
    assert!(!dir.exists(), "nothing committed");
}

/// New chunks take the data files in turn, whichever thread writes them: one thread's chunks
/// spread over every file, so that a later copy writing them again in place (each in its own
/// file) can write into every file at once.
#[test]
fn new_chunks_take_the_data_files_in_turn() {
    let (_root, dir, w) = scratch_writer(WriterOptions {
        data_files: 4,
        ..fast()
    });
    w.add_buffer(rec(1, 8000, 0)).unwrap();
    for (off, len) in pieces(8000, 1000) {
        w.write_chunk(1, off, &pattern(1, off, len, 0)).unwrap();
    }
    // Written again from four threads at once, each chunk stays where it was.
    std::thread::scope(|s| {
        for k in 0..4u64 {
            let w = &w;
            s.spawn(move || {
                for off in [k * 1000, (k + 4) * 1000] {
                    w.write_chunk(1, off, &pattern(1, off, 1000, 1)).unwrap();
                }
            });
        }
    });
    w.commit().unwrap();
    let m = manifest_of(&dir);
    let mut per_file = vec![0; m.files.len()];
    for c in &m.chunks {
        per_file[c.file as usize] += 1;
    }
    assert_eq!(per_file, vec![2, 2, 2, 2], "{:?}", m.chunks);
    let img = Image::open(&dir).unwrap();
    for (off, len) in pieces(8000, 1000) {
        let mut got = vec![0; len as usize];
        img.read_chunk(1, off, &mut got).unwrap();
        assert_eq!(got, pattern(1, off, len, 1));
    }
}

/// What a writer wrote since it was last asked: every data file by inode (the same after the
/// commit renames its directory), the ranges written in it merged, and after a second round
/// only the chunk written again.
#[test]
fn take_written_names_the_ranges_written_since_the_last_call() {
    use std::os::unix::fs::MetadataExt;
    let (_root, dir, w) = scratch_writer(one_file());
    w.add_buffer(rec(1, 300, 0)).unwrap();
    for off in [0u64, 100, 200] {
        w.write_chunk(1, off, &pattern(1, off, 100, 0)).unwrap();
    }
    let first = w.take_written();
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(first[0].ranges, vec![(0, 300)], "three chunks, one range");
    assert_eq!(w.take_written()[0].ranges, vec![], "nothing written since");
    w.write_chunk(1, 100, &pattern(1, 100, 100, 1)).unwrap();
    let again = w.take_written();
    assert_eq!(again[0].ranges, vec![(100, 100)], "{again:?}");
    w.commit().unwrap();
    let m = fs::metadata(dir.join("data-000.bin")).unwrap();
    assert_eq!(
        again[0].inode,
        (m.dev(), m.ino()),
        "the file, once committed"
    );
}

/// A writer's journal: each chunk written while it is set, one record in order of writing, with
/// the file and the range the written account names; nothing before it is set or after it is
/// taken away.
#[test]
fn the_journal_records_each_chunk_written_while_it_is_set() {
    let (root, _dir, w) = scratch_writer(one_file());
    w.add_buffer(rec(1, 400, 0)).unwrap();
    w.write_chunk(1, 0, &pattern(1, 0, 100, 0)).unwrap();
    let path = root.path().join("journal");
    let open = || OpenOptions::new().create(true).append(true).open(&path);
    w.journal_to(Some(open().unwrap()));
    w.write_chunk(1, 100, &pattern(1, 100, 100, 0)).unwrap();
    w.write_chunk(1, 0, &pattern(1, 0, 100, 1)).unwrap();
    w.journal_to(None);
    w.write_chunk(1, 200, &pattern(1, 200, 100, 0)).unwrap();
    let inode = w.take_written()[0].inode;
    let bytes = fs::read(&path).unwrap();
    assert_eq!(bytes.len(), 2 * JournalRecord::BYTES, "two records");
    let recs: Vec<JournalRecord> = bytes
        .chunks_exact(JournalRecord::BYTES)
        .map(|b| JournalRecord::from_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(
        recs,
        vec![
            JournalRecord {
                inode,
                at: 100,
                len: 100
            },
            JournalRecord {
                inode,
                at: 0,
                len: 100
            },
        ]
    );
    let r = recs[0];
    assert_eq!(JournalRecord::from_bytes(&r.to_bytes()), r);
}

#[test]
fn empty_image_round_trips() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("empty");
    let s = ImageWriter::create(&dir, fast()).unwrap().commit().unwrap();
    assert_eq!((s.total_bytes, s.chunks, s.buffers.len()), (0, 0, 0));
    let img = Image::open(&dir).unwrap();
    img.verify().unwrap();
    assert!(img.buffers().is_empty());
    assert_eq!(img.version(), (FORMAT_MAJOR, FORMAT_MINOR));
    assert_eq!(img.dir(), dir);
}

/// A chunk of 2 MiB or more starts at a 2 MiB boundary of its data file whatever came before it
/// (so that its pieces fill a huge-page tmpfs's pages whole), smaller ones are packed, and the
/// gaps read back as nothing: every chunk round-trips, with odd write pieces too.
#[test]
fn long_chunks_start_on_huge_page_boundaries() {
    const MIB: u64 = 1 << 20;
    for piece in [4096, 1 << 20, 3 << 20] {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("img");
        let w = ImageWriter::create(
            &dir,
            WriterOptions {
                data_files: 1,
                write_piece: piece,
                ..fast()
            },
        )
        .unwrap();
        // 1000 bytes, 2 MiB, 5 bytes, 3 MiB + 7, 4 KiB: two long chunks after short ones.
        let sizes = [(1, 1000), (2, 2 * MIB), (3, 5), (4, 3 * MIB + 7), (5, 4096)];
        for (id, size) in sizes {
            w.add_buffer(rec(id, size, id as u32)).unwrap();
            w.write_chunk(id, 0, &pattern(id, 0, size, 0)).unwrap();
        }
        w.commit().unwrap();
        let m = manifest_of(&dir);
        let at = |id: u64| {
            m.chunks
                .iter()
                .find(|c| c.buffer == id)
                .unwrap()
                .file_offset
        };
        assert_eq!(at(1), 0);
        assert_eq!(at(2), 2 * MIB, "piece {piece}");
        assert_eq!(at(3), 4 * MIB);
        assert_eq!(at(4), 6 * MIB);
        assert_eq!(at(5), 9 * MIB + 7);
        assert_eq!(m.files[0].len, 9 * MIB + 7 + 4096);
        let img = Image::open(&dir).unwrap();
        img.verify().unwrap();
        for (id, size) in sizes {
            let mut got = vec![0u8; size as usize];
            img.read_chunk(id, 0, &mut got).unwrap();
            assert!(got == pattern(id, 0, size, 0), "buffer {id}, piece {piece}");
        }
    }
}

#[test]
fn read_chunk_rejects_bad_requests() {
    let root = tempfile::tempdir().unwrap();
    let img = Image::open(&small_image(root.path())).unwrap();
    let mut dst = vec![0u8; 1000];
    assert!(matches!(
        img.read_chunk(99, 0, &mut dst),
        Err(ImageError::UnknownBuffer { buffer: 99 })
    ));
    assert!(matches!(
        img.read_chunk(1, 500, &mut dst),
        Err(ImageError::MissingChunk {
            buffer: 1,
            offset: 500
        })
    ));
    assert!(matches!(
        img.read_chunk(3, 0, &mut dst),
        Err(ImageError::MissingChunk {
            buffer: 3,
            offset: 0
        })
    ));
    assert!(matches!(
        img.read_chunk(2, 1000, &mut dst),
        Err(ImageError::ChunkOutOfRange {
            buffer: 2,
            offset: 1000,
            len: 1000
        })
    ));
    img.read_chunk(2, 1000, &mut dst[..500]).unwrap();
    assert_eq!(dst[..500], pattern(2, 1000, 500, 0)[..]);
    assert!(img.chunks(3).is_empty());
}

#[test]
fn writer_rejects_bad_chunks() {
    let root = tempfile::tempdir().unwrap();
    let w = ImageWriter::create(&root.path().join("img"), fast()).unwrap();
    w.add_buffer(rec(1, 5 * GIB, 0)).unwrap();
    assert!(matches!(
        w.write_chunk(2, 0, &[1]),
        Err(ImageError::UnknownBuffer { buffer: 2 })
    ));
    assert!(matches!(
        w.write_chunk(1, 5 * GIB - 1, &[1, 2]),
        Err(ImageError::ChunkOutOfRange { buffer: 1, offset, len: 2 }) if offset == 5 * GIB - 1
    ));
    assert!(matches!(
        w.write_chunk(1, u64::MAX, &[1]),
        Err(ImageError::ChunkOutOfRange { buffer: 1, .. })
    ));
    assert!(matches!(
        w.write_chunk(1, 0, &[]),
        Err(ImageError::ChunkBadLength { len: 0, .. })
    ));
    // Zero-filled allocations are lazy: this does not touch 1 GiB of memory.
    let too_big = vec![0u8; (MAX_CHUNK_LEN + 1) as usize];
    assert!(matches!(
        w.write_chunk(1, 0, &too_big),
        Err(ImageError::ChunkBadLength { len, .. }) if len == MAX_CHUNK_LEN + 1
    ));
    // A chunk past 4 GiB in a large buffer is fine.
    w.write_chunk(1, 4 * GIB + 17, &[9; 10]).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Commit, force, drop

#[test]
fn commit_refuses_incomplete_buffer() {
    let (root, _dir, w) = scratch_writer(fast());
    w.add_buffer(rec(4, 2000, 0)).unwrap();
    w.write_chunk(4, 0, &[1; 1000]).unwrap();
    let e = w.commit().unwrap_err();
    assert!(
        matches!(
            &e,
            ImageError::BadCoverage {
                buffer: 4,
                problem: CoverageError::Gap {
                    start: 1000,
                    end: 2000
                },
                ..
            }
        ),
        "{e}"
    );
    assert!(
        entries(root.path()).is_empty(),
        "{:?}",
        entries(root.path())
    );
}

#[test]
fn commit_refuses_non_empty_existing_dir_without_force() {
    let (root, dir) = scratch();
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("precious"), b"keep me").unwrap();
    // Refused up front...
    let e = ImageWriter::create(&dir, fast()).unwrap_err();
    assert!(matches!(&e, ImageError::AlreadyExists { image } if image == &dir));
    assert!(e.to_string().contains("already exists"), "{e}");

    // ...and at commit, if the directory filled up in the meantime.
    fs::remove_file(dir.join("precious")).unwrap();
    let w = ImageWriter::create(&dir, fast()).unwrap();
    w.add_buffer(rec(1, 10, 0)).unwrap();
    w.write_chunk(1, 0, &[7; 10]).unwrap();
    fs::write(dir.join("precious"), b"keep me").unwrap();
    assert!(matches!(w.commit(), Err(ImageError::AlreadyExists { .. })));
    assert_eq!(entries(&dir), vec!["precious"]);
    assert_only_img(root.path(), "temporary directory left behind");
}

#[test]
fn commit_into_existing_empty_dir() {
    let (_root, dir) = scratch();
    fs::create_dir(&dir).unwrap();
    let w = ImageWriter::create(&dir, fast()).unwrap();
    w.set_meta("k", "v").unwrap();
    w.commit().unwrap();
    assert_eq!(Image::open(&dir).unwrap().meta("k").as_deref(), Some("v"));
}

#[test]
fn commit_with_force_replaces_old_image() {
    let (root, dir) = small();
    let w = ImageWriter::create(&dir, forced()).unwrap();
    w.add_buffer(rec(8, 10, 0)).unwrap();
    w.write_chunk(8, 0, &[8; 10]).unwrap();
    w.set_meta("generation", "2").unwrap();
    // Until commit, the old image is intact.
    assert_eq!(
        Image::open(&dir).unwrap().meta("backend").as_deref(),
        Some("host")
    );
    w.commit().unwrap();
    let img = Image::open(&dir).unwrap();
    assert_eq!(img.meta("generation").as_deref(), Some("2"));
    assert_eq!(img.meta("backend"), None);
    assert_eq!(img.buffers(), vec![rec(8, 10, 0)]);
    assert_only_img(root.path(), "old image or temp dir left behind");
}

#[test]
fn commit_with_force_replaces_a_plain_file() {
    let (root, dir) = scratch();
    fs::write(&dir, b"not an image").unwrap();
    assert!(matches!(
        ImageWriter::create(&dir, fast()),
        Err(ImageError::AlreadyExists { .. })
    ));
    let w = ImageWriter::create(&dir, forced()).unwrap();
    w.commit().unwrap();
    Image::open(&dir).unwrap();
    assert_eq!(entries(root.path()), vec!["img"]);
}

#[test]
fn dropped_writer_leaves_nothing() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("sub").join("img");
    let w = ImageWriter::create(&dir, fast()).unwrap();
    assert!(w.temp_dir().starts_with(root.path().join("sub")));
    assert!(w.temp_dir().exists());
    assert_eq!(w.final_dir(), dir);
    w.add_buffer(rec(1, 10, 0)).unwrap();
    w.write_chunk(1, 0, &[1; 10]).unwrap();
    drop(w);
    assert!(entries(&root.path().join("sub")).is_empty());
    assert!(matches!(open_err(&dir), ImageError::Io { .. }));
}

// ---------------------------------------------------------------------------------------------
// One test per way of rejecting an image

#[test]
fn rejects_flipped_byte_in_data_file() {
    let (_root, dir) = small();
    let m = manifest_of(&dir);
    let c = m
        .chunks
        .iter()
        .find(|c| (c.buffer, c.offset) == (2, 1000))
        .unwrap();
    let name = m.files[c.file as usize].name.clone();
    flip_byte(&dir.join(&name), c.file_offset + 123);

    let img = Image::open(&dir).expect("a data byte is only checked when read");
    let mut dst = vec![0u8; 500];
    let e = img.read_chunk(2, 1000, &mut dst).unwrap_err();
    assert!(
        matches!(&e, ImageError::ChecksumMismatch { file, buffer: 2, offset: 1000, .. } if file == &name),
        "{e:?}"
    );
    let want = format!(
        "image {}: {name}: checksum mismatch in buffer 2 at offset 1000",
        dir.display()
    );
    assert_eq!(e.to_string(), want);
    // The other chunks still read fine; verify finds the bad one.
    img.read_chunk(2, 0, &mut vec![0u8; 1000]).unwrap();
    assert_eq!(img.verify().unwrap_err().to_string(), want);
}

#[test]
fn rejects_flipped_byte_in_manifest() {
    let (_root, dir) = small();
    let path = dir.join(MANIFEST_FILE);
    let len = fs::metadata(&path).unwrap().len();
    // A payload byte, then (after undoing it) a byte of the stored checksum, then the minor version.
    for at in [HEADER_LEN + 3, len - 2, 12] {
        flip_byte(&path, at);
        let e = open_err(&dir);
        assert!(
            matches!(e, ImageError::ManifestChecksum { .. }),
            "byte {at}: {e:?}"
        );
        assert!(
            e.to_string().contains("manifest.pb: checksum mismatch"),
            "{e}"
        );
        flip_byte(&path, at);
        Image::open(&dir).unwrap();
    }
}

#[test]
fn rejects_truncated_data_file() {
    let (_root, dir) = small();
    let m = manifest_of(&dir);
    let f = &m.files[0];
    truncate(&dir.join(&f.name), f.len - 1);
    let e = open_err(&dir);
    assert!(
        matches!(&e, ImageError::DataFileTruncated { file, expected, actual, .. }
            if file == &f.name && *expected == f.len && *actual == f.len - 1),
        "{e:?}"
    );
    assert!(e.to_string().contains("data-000.bin truncated"), "{e}");
}

#[test]
fn rejects_truncated_manifest() {
    let (_root, dir) = small();
    let path = dir.join(MANIFEST_FILE);
    let full = fs::read(&path).unwrap();
    for cut in [
        0,
        5,
        8,
        20,
        HEADER_LEN as usize,
        full.len() / 2,
        full.len() - 4,
        full.len() - 1,
    ] {
        fs::write(&path, &full[..cut]).unwrap();
        let e = open_err(&dir);
        assert!(
            matches!(e, ImageError::ManifestTruncated { actual, .. } if actual == cut as u64),
            "cut at {cut}: {e:?}"
        );
    }
}

#[test]
fn rejects_trailing_bytes_after_manifest() {
    let (_root, dir) = small();
    let path = dir.join(MANIFEST_FILE);
    let mut bytes = fs::read(&path).unwrap();
    bytes.push(0);
    fs::write(&path, &bytes).unwrap();
    assert_open_fails!(&dir, ImageError::ManifestTrailingBytes { .. });
}

#[test]
fn rejects_missing_data_file() {
    let (_root, dir) = small();
    fs::remove_file(dir.join("data-000.bin")).unwrap();
    let e = open_err(&dir);
    assert!(matches!(&e, ImageError::DataFileMissing { file, .. } if file == "data-000.bin"));
    assert_eq!(
        e.to_string(),
        format!("image {}: data-000.bin missing", dir.display())
    );
}

#[test]
fn rejects_missing_manifest() {
    let (root, dir) = small();
    fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
    let e = open_err(&dir);
    assert!(matches!(e, ImageError::ManifestMissing { .. }));
    assert_eq!(
        e.to_string(),
        format!(
            "image {}: manifest.pb missing: not a possum image or an incomplete one",
            dir.display()
        )
    );
    // A directory that does not exist at all is an I/O error naming it.
    let nowhere = root.path().join("nowhere");
    assert!(matches!(open_err(&nowhere), ImageError::Io { path, .. } if path == nowhere));
}

#[test]
fn rejects_wrong_magic() {
    let (_root, dir) = small();
    let path = dir.join(MANIFEST_FILE);
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(b"PK\x03\x04zip!", 0).unwrap();
    let e = open_err(&dir);
    assert!(matches!(&e, ImageError::BadMagic { found, .. } if found == b"PK\x03\x04zip!"));
    assert!(e.to_string().contains("not a possum image"), "{e}");
}

#[test]
fn rejects_other_major_versions() {
    let (_root, dir) = small();
    let m = manifest_of(&dir);
    for major in [0, 2, u32::MAX] {
        let mut m2 = m.clone();
        m2.major = major;
        fs::write(dir.join(MANIFEST_FILE), encode_framed(&m2, major, 0)).unwrap();
        let e = open_err(&dir);
        assert!(
            matches!(e, ImageError::UnsupportedVersion { major: got, minor: 0, .. } if got == major),
            "{e:?}"
        );
        if major == 2 {
            assert_eq!(
                e.to_string(),
                format!(
                    "image {}: format version 2.0 not supported (this possum reads 1.x)",
                    dir.display()
                )
            );
        }
    }
}

#[test]
fn accepts_newer_minor_version() {
    let (_root, dir) = small();
    let mut m = manifest_of(&dir);
    m.minor = FORMAT_MINOR + 7;
    fs::write(
        dir.join(MANIFEST_FILE),
        encode_framed(&m, FORMAT_MAJOR, FORMAT_MINOR + 7),
    )
    .unwrap();
    let img = Image::open(&dir).unwrap();
    assert_eq!(img.version(), (FORMAT_MAJOR, FORMAT_MINOR + 7));
    img.verify().unwrap();
}

/// The open error of a small image once `edit` rewrote its manifest.
fn open_edited(edit: impl FnOnce(&mut Manifest)) -> ImageError {
    let (_root, dir) = small();
    rewrite_manifest(&dir, edit);
    open_err(&dir)
}

/// Writes `m` as the manifest of `dir`, framed with its own version.
fn write_manifest(dir: &Path, m: &Manifest) {
    fs::write(dir.join(MANIFEST_FILE), encode_framed(m, m.major, m.minor)).unwrap();
}

#[test]
fn rejects_manifests_that_contradict_themselves() {
    type Edit = fn(&mut Manifest);
    type Expect = fn(&ImageError) -> bool;
    let cases: [(&str, Edit, Expect); 5] = [
        (
            "header and payload versions disagree",
            |m| m.minor = 3,
            |e| matches!(e, ImageError::ManifestInvalid { .. }),
        ),
        (
            "a chunk past its buffer's end",
            |m| m.buffers.iter_mut().find(|b| b.id == 2).unwrap().size = 1400,
            |e| {
                matches!(
                    e,
                    ImageError::BadCoverage {
                        buffer: 2,
                        problem: CoverageError::PastEnd {
                            offset: 1000,
                            len: 500,
                            size: 1400
                        },
                        ..
                    }
                )
            },
        ),
        (
            "a chunk of an undeclared buffer",
            |m| m.buffers.retain(|b| b.id != 2),
            |e| {
                matches!(
                    e,
                    ImageError::ChunkUnknownBuffer {
                        buffer: 2,
                        offset: 0,
                        ..
                    }
                )
            },
        ),
        (
            "a chunk in an unlisted file",
            |m| m.chunks[1].file = 1,
            |e| matches!(e, ImageError::ChunkUnknownFile { file: 1, .. }),
        ),
        (
            "a buffer listed twice",
            |m| m.buffers.push(m.buffers[0].clone()),
            |e| matches!(e, ImageError::DuplicateBuffer { buffer: 1, .. }),
        ),
    ];
    for (what, edit, expect) in cases {
        let e = open_edited(edit);
        assert!(expect(&e), "{what}: {e:?}");
    }
}

#[test]
fn rejects_undecodable_payload() {
    let (_root, dir) = small();
    let payload = [0xffu8; 11];
    let mut bytes = MANIFEST_MAGIC.to_vec();
    bytes.extend_from_slice(&FORMAT_MAJOR.to_le_bytes());
    bytes.extend_from_slice(&FORMAT_MINOR.to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&payload);
    let crc = crc32c::crc32c(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    fs::write(dir.join(MANIFEST_FILE), bytes).unwrap();
    assert!(matches!(open_err(&dir), ImageError::ManifestDecode { .. }));
}

#[test]
fn rejects_gap_in_coverage() {
    let (_root, dir) = small();
    rewrite_manifest(&dir, |m| {
        m.chunks.retain(|c| (c.buffer, c.offset) != (1, 1000))
    });
    let e = open_err(&dir);
    assert!(
        matches!(
            &e,
            ImageError::BadCoverage {
                buffer: 1,
                problem: CoverageError::Gap {
                    start: 1000,
                    end: 2000
                },
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("buffer 1: no chunk holds bytes 1000..2000"),
        "{e}"
    );

    // A missing last chunk is a gap at the end.
    rewrite_manifest(&dir, |m| {
        m.chunks.retain(|c| (c.buffer, c.offset) != (2, 1000))
    });
    let e = open_err(&dir);
    assert!(
        matches!(e, ImageError::BadCoverage { buffer: 1, .. }),
        "first problem first: {e:?}"
    );
}

#[test]
fn rejects_overlap_in_coverage() {
    // Shift one chunk back a byte.
    let e = open_edited(|m| {
        m.chunks
            .iter_mut()
            .find(|c| (c.buffer, c.offset) == (1, 2000))
            .unwrap()
            .offset = 1999;
    });
    assert!(
        matches!(
            &e,
            ImageError::BadCoverage {
                buffer: 1,
                problem: CoverageError::Overlap {
                    offset: 1999,
                    prev_end: 2000
                },
                ..
            }
        ),
        "{e:?}"
    );
    // The same chunk listed twice.
    let e = open_edited(|m| {
        let c = m.chunks.iter().find(|c| c.buffer == 2).unwrap().clone();
        m.chunks.push(c);
    });
    assert!(matches!(
        e,
        ImageError::BadCoverage {
            buffer: 2,
            problem: CoverageError::Overlap {
                offset: 0,
                prev_end: 1000
            },
            ..
        }
    ));
}

#[test]
fn rejects_chunk_outside_its_file() {
    let (_root, dir) = small();
    rewrite_manifest(&dir, |m| {
        let flen = m.files[0].len;
        let c = m
            .chunks
            .iter_mut()
            .find(|c| (c.buffer, c.offset) == (2, 0))
            .unwrap();
        c.file_offset = flen - 10;
    });
    let e = open_err(&dir);
    assert!(
        matches!(&e, ImageError::ChunkOutsideFile { file, buffer: 2, offset: 0, .. } if file == "data-000.bin"),
        "{e:?}"
    );
    // An offset that overflows u64 is outside too.
    rewrite_manifest(&dir, |m| m.chunks[0].file_offset = u64::MAX - 5);
    assert_open_fails!(&dir, ImageError::ChunkOutsideFile { .. });
}

#[test]
fn rejects_unsafe_or_duplicate_data_file_names() {
    let (_root, dir) = small();
    let good = manifest_of(&dir);
    for bad in [
        "../outside.bin",
        "/etc/passwd",
        "a/b.bin",
        "",
        ".hidden",
        "manifest.pb",
        "nul\0",
    ] {
        let mut m = good.clone();
        m.files[0].name = bad.to_owned();
        write_manifest(&dir, &m);
        let e = open_err(&dir);
        assert!(
            matches!(&e, ImageError::ManifestInvalid { problem, .. } if problem.contains("invalid data file name")),
            "{bad:?}: {e:?}"
        );
    }
    let mut m = good.clone();
    m.files.push(m.files[0].clone());
    write_manifest(&dir, &m);
    assert!(
        matches!(open_err(&dir), ImageError::ManifestInvalid { problem, .. } if problem.contains("twice"))
    );
}

#[test]
fn rejects_absurd_manifest_length() {
    let (_root, dir) = small();
    let path = dir.join(MANIFEST_FILE);
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    for len in [u64::MAX, MAX_MANIFEST_LEN + 1, 1 << 40] {
        f.write_all_at(&len.to_le_bytes(), 16).unwrap();
        let e = open_err(&dir);
        assert!(
            matches!(e, ImageError::ManifestTooLarge { len: got, .. } if got == len),
            "{e:?}"
        );
    }
    // Within the cap but longer than the file: truncated, not an allocation of that size.
    f.write_all_at(&(MAX_MANIFEST_LEN).to_le_bytes(), 16)
        .unwrap();
    assert_open_fails!(&dir, ImageError::ManifestTruncated { .. });
}

#[test]
fn rejects_absurd_chunk_lengths() {
    let (_root, dir) = small();
    for len in [0, MAX_CHUNK_LEN + 1, u64::MAX] {
        rewrite_manifest(&dir, |m| m.chunks[0].len = len);
        let e = open_err(&dir);
        assert!(
            matches!(e, ImageError::ChunkBadLength { buffer: 1, offset: 0, len: got, .. } if got == len),
            "{e:?}"
        );
    }
}

#[test]
fn rejects_absurd_data_file_length_and_count() {
    let (_root, dir) = small();
    let good = manifest_of(&dir);
    rewrite_manifest(&dir, |m| m.files[0].len = u64::MAX);
    assert_open_fails!(
        &dir,
        ImageError::DataFileTruncated {
            expected: u64::MAX,
            ..
        }
    );
    let mut m = good.clone();
    m.files = (0..=MAX_DATA_FILES)
        .map(|i| DataFileMsg {
            name: format!("data-{i:03}.bin"),
            len: 0,
            parent: None,
        })
        .collect();
    write_manifest(&dir, &m);
    assert!(
        matches!(open_err(&dir), ImageError::ManifestInvalid { problem, .. } if problem.contains("limit"))
    );
}

// Sizes past 4 GiB: `tests/large.rs`.
mod large;

// Fingerprints and parent images (format 1.1): `tests/format_1_1.rs`.
mod format_1_1;

/// The draft manifest: what was written so far, readable by [`Image::open_draft`] while the
/// image is unfinished, replaced by each later draft, gone from the committed image. Two images
/// hold the same chunk with the same length, CRC32C and fingerprint.
#[test]
fn a_draft_reads_the_unfinished_image_and_the_commit_removes_it() {
    let (_root, dir, w) = scratch_writer(fast());
    w.add_buffer(rec(1, 200, 0)).unwrap();
    w.add_buffer(rec(2, 100, 0)).unwrap();
    let fp = |b: &[u8]| crate::fingerprint::of(b);
    let (a0, b0) = (pattern(1, 0, 200, 0), pattern(2, 0, 100, 0));
    w.write_chunk_fp(1, 0, &a0, fp(&a0)).unwrap();
    w.write_chunk(2, 0, &b0).unwrap();
    // No draft yet.
    assert!(matches!(
        Image::open_draft(w.temp_dir()),
        Err(ImageError::ManifestMissing { .. })
    ));
    w.write_draft().unwrap();
    let first = Image::open_draft(w.temp_dir()).unwrap();
    let mut got = [0u8; 200];
    first.read_chunk(1, 0, &mut got).unwrap();
    assert_eq!(got.to_vec(), a0);
    let name = w.temp_dir().file_name().unwrap().to_str().unwrap();
    assert_eq!(unfinished_image_name(name), Some("img"));
    assert_eq!(unfinished_image_name("img"), None);
    assert_eq!(unfinished_image_name(".tmp-1"), None);

    // Buffer 1 written again, the same bytes; a second draft.
    w.write_chunk_fp(1, 0, &a0, fp(&a0)).unwrap();
    w.write_draft().unwrap();
    let second = Image::open_draft(w.temp_dir()).unwrap();
    assert!(second.same_chunk(&first, 1, 0));
    // Its fingerprint computed as it was written.
    assert!(second.same_chunk(&first, 2, 0));
    w.commit().unwrap();
    assert!(!dir.join(DRAFT_FILE).exists());
    let done = Image::open(&dir).unwrap();
    assert!(done.same_chunk(&first, 1, 0));
    assert!(!done.same_chunk(&first, 1, 8));

    // Other bytes: not the same.
    let (_root2, _dir2, w2) = scratch_writer(fast());
    w2.add_buffer(rec(1, 200, 0)).unwrap();
    let a1 = pattern(1, 0, 200, 1);
    w2.write_chunk_fp(1, 0, &a1, fp(&a1)).unwrap();
    w2.write_draft().unwrap();
    let other = Image::open_draft(w2.temp_dir()).unwrap();
    assert!(!other.same_chunk(&first, 1, 0));
}

/// A draft whose data file is still arriving: refused by [`Image::open_draft`] (truncated),
/// opened by [`Image::open_draft_arriving`], whose chunks read once their bytes are there and
/// fail their check before.
#[test]
fn a_draft_opens_while_its_data_file_arrives() {
    let (_root, _dir, w) = scratch_writer(WriterOptions {
        data_files: 1,
        ..fast()
    });
    w.add_buffer(rec(1, 200, 0)).unwrap();
    w.add_buffer(rec(2, 100, 0)).unwrap();
    let (a0, b0) = (pattern(1, 0, 200, 0), pattern(2, 0, 100, 0));
    w.write_chunk(1, 0, &a0).unwrap();
    w.write_chunk(2, 0, &b0).unwrap();
    w.write_draft().unwrap();
    let whole = Image::open_draft(w.temp_dir()).unwrap();
    let files: Vec<(String, u64)> = (whole.own_data_files().into_iter())
        .map(|(n, l)| (n.to_string(), l))
        .collect();
    assert_eq!(files.len(), 1);
    let (name, len) = files[0].clone();
    assert_eq!(len, 300);
    let (file, at) = whole.chunk_location(2, 0).unwrap();
    assert_eq!(file, name);
    // The copy of the image as it arrives: the data file's first bytes, up to buffer 2's chunk.
    let arriving = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(w.temp_dir()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), arriving.path().join(e.file_name())).unwrap();
    }
    let data = arriving.path().join(&name);
    let bytes = std::fs::read(&data).unwrap();
    std::fs::write(&data, &bytes[..at as usize]).unwrap();
    assert!(matches!(
        Image::open_draft(arriving.path()),
        Err(ImageError::DataFileTruncated { .. })
    ));
    let img = Image::open_draft_arriving(arriving.path()).unwrap();
    let (mut got_a, mut got_b) = ([0u8; 200], [0u8; 100]);
    let (first, _) = img.chunk_location(1, 0).unwrap();
    assert_eq!(first, name);
    img.read_chunk(1, 0, &mut got_a).unwrap();
    assert_eq!(got_a.to_vec(), a0);
    assert!(img.read_chunk(2, 0, &mut got_b).is_err());
    // The rest arrives, zeros first (a file sized before its bytes came): a mismatch, then the
    // bytes.
    let f = std::fs::OpenOptions::new().write(true).open(&data).unwrap();
    f.set_len(len).unwrap();
    assert!(matches!(
        img.read_chunk(2, 0, &mut got_b),
        Err(ImageError::ChecksumMismatch { .. })
    ));
    f.write_all_at(&bytes[at as usize..], at).unwrap();
    img.read_chunk(2, 0, &mut got_b).unwrap();
    assert_eq!(got_b.to_vec(), b0);
    // A data file that is not there at all is still refused.
    std::fs::remove_file(&data).unwrap();
    assert!(matches!(
        Image::open_draft_arriving(arriving.path()),
        Err(ImageError::DataFileMissing { .. })
    ));
}
