//! The image format 1.1's additions: chunk fingerprints, and chunks held by reference to
//! parent images (part of [`super`]).

use super::*;

// ---------------------------------------------------------------------------------------------
// Fingerprints (format 1.1)

/// Every chunk of a new image has a fingerprint: the one given to `write_chunk_fp`, or the one
/// `write_chunk` computes piece by piece as it writes (equal to `fingerprint::of` whatever the
/// piece and the chunk's length); they read back through `ChunkSource::fingerprint`, and
/// `verify` checks them.
#[test]
fn fingerprints_round_trip_through_an_image() {
    use crate::fingerprint;
    for piece in [4096, 5000, 1 << 20] {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("img");
        let w = ImageWriter::create(
            &dir,
            WriterOptions {
                write_piece: piece,
                ..fast()
            },
        )
        .unwrap();
        // Lengths not a multiple of 8, of the piece, or shorter than one pair.
        let layout = [
            (1u64, 70_001u64, 30_003u64),
            (2, 5, 5),
            (3, 3 << 20, 1 << 20),
        ];
        for &(id, size, chunk) in &layout {
            w.add_buffer(rec(id, size, id as u32)).unwrap();
            for (off, len) in pieces(size, chunk) {
                let data = pattern(id, off, len, 0);
                if id == 2 {
                    w.write_chunk_fp(id, off, &data, fingerprint::of(&data))
                        .unwrap();
                } else {
                    w.write_chunk(id, off, &data).unwrap();
                }
            }
        }
        let s = w.commit().unwrap();
        assert_eq!(s.version, (1, 1));
        assert_eq!((s.reused_bytes, s.parents.len()), (0, 0));
        let m = manifest_of(&dir);
        assert!(m
            .chunks
            .iter()
            .all(|c| c.fp_lo.is_some() && c.fp_hi.is_some()));
        assert!(m.parents.is_empty() && m.files.iter().all(|f| f.parent.is_none()));
        let img = Image::open(&dir).unwrap();
        img.verify().unwrap();
        for &(id, size, chunk) in &layout {
            for (off, len) in pieces(size, chunk) {
                let want = fingerprint::of(&pattern(id, off, len, 0));
                assert_eq!(
                    img.fingerprint(id, off),
                    Some(want),
                    "piece {piece}, {id}@{off}"
                );
            }
        }
        assert_eq!(img.fingerprint(1, 1), None);
        assert_eq!(img.fingerprint(9, 0), None);
    }
}

/// A fingerprint given to `write_chunk_fp` is recorded as given (the caller took it of the
/// bytes it copied); a wrong one is what a restore's check and `verify` catch.
#[test]
fn a_recorded_fingerprint_that_is_not_the_bytes_is_reported() {
    use crate::fingerprint::{self, Fingerprint};
    let root = tempfile::tempdir().unwrap();
    let dir = small_image(root.path());
    let good = manifest_of(&dir);
    let i = good
        .chunks
        .iter()
        .position(|c| (c.buffer, c.offset) == (2, 1000))
        .unwrap();
    let recorded = good.chunks[i].fingerprint().unwrap();
    let altered = Fingerprint([recorded.0[0] ^ 1, recorded.0[1]]);
    rewrite_manifest(&dir, |m| m.chunks[i].fp_lo = Some(altered.0[0]));
    // The manifest is consistent, the bytes match their CRC: only the fingerprint check sees it.
    let img = Image::open(&dir).unwrap();
    let mut dst = vec![0u8; 500];
    img.read_chunk(2, 1000, &mut dst).unwrap();
    // A restore's check: the loaded bytes' fingerprint against the source's.
    assert_eq!(img.fingerprint(2, 1000), Some(altered));
    assert_ne!(fingerprint::of(&dst), altered);
    assert_eq!(fingerprint::of(&dst), recorded);
    let e = img.verify().unwrap_err();
    assert!(
        matches!(&e, ImageError::FingerprintMismatch { buffer: 2, offset: 1000, recorded: r, computed: c, .. }
            if *r == altered && *c == recorded),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(
        text.contains("fingerprint mismatch in buffer 2 at offset 1000")
            && text.contains(&altered.to_string())
            && text.contains(&recorded.to_string()),
        "{text}"
    );
    // Half a fingerprint is a manifest that contradicts itself.
    rewrite_manifest(&dir, |m| {
        m.chunks[i].fp_lo = None;
    });
    let e = open_err(&dir);
    assert!(
        matches!(&e, ImageError::ManifestInvalid { problem, .. } if problem.contains("one word of its fingerprint")),
        "{e:?}"
    );
}

/// A chunk message as format 1.0 wrote it (tags 1 to 6).
#[derive(Clone, PartialEq, prost::Message)]
struct ChunkMsg10 {
    #[prost(uint64, tag = "1")]
    buffer: u64,
    #[prost(uint64, tag = "2")]
    offset: u64,
    #[prost(uint64, tag = "3")]
    len: u64,
    #[prost(uint32, tag = "4")]
    file: u32,
    #[prost(uint64, tag = "5")]
    file_offset: u64,
    #[prost(fixed32, tag = "6")]
    crc32c: u32,
}

/// An image written by format 1.0 (no fingerprints, no parents) still opens, reads and
/// verifies; its chunks have no fingerprint. A 1.0 reader skips the new fields of a 1.1 chunk.
#[test]
fn an_old_format_image_without_fingerprints_still_opens() {
    use prost::Message;
    let root = tempfile::tempdir().unwrap();
    let dir = small_image(root.path());
    rewrite_manifest(&dir, |m| {
        m.minor = 0;
        for c in &mut m.chunks {
            c.set_fingerprint(None);
        }
    });
    // Re-framed as 1.0 (rewrite_manifest kept the header's 1.1).
    let m = manifest_of(&dir);
    fs::write(dir.join(MANIFEST_FILE), encode_framed(&m, 1, 0)).unwrap();
    // What was written is what a 1.0 writer wrote: the absent fields take no bytes.
    for c in &m.chunks {
        let old = ChunkMsg10 {
            buffer: c.buffer,
            offset: c.offset,
            len: c.len,
            file: c.file,
            file_offset: c.file_offset,
            crc32c: c.crc32c,
        };
        assert_eq!(old.encode_to_vec(), c.encode_to_vec());
    }
    let img = Image::open(&dir).unwrap();
    assert_eq!(img.version(), (1, 0));
    img.verify().unwrap();
    assert_eq!(img.fingerprint(1, 0), None);
    let mut dst = vec![0u8; 1000];
    img.read_chunk(1, 1000, &mut dst).unwrap();
    assert_eq!(dst, pattern(1, 1000, 1000, 0));
    assert_eq!(img.summary().reused_bytes, 0);

    // And a 1.1 chunk decodes as a 1.0 reader's message, the fingerprint skipped.
    let mut new = m.chunks[0].clone();
    new.set_fingerprint(Some(crate::fingerprint::Fingerprint([1, 2])));
    let old = ChunkMsg10::decode(new.encode_to_vec().as_slice()).unwrap();
    assert_eq!(
        (old.buffer, old.offset, old.crc32c),
        (new.buffer, new.offset, new.crc32c)
    );
}

// ---------------------------------------------------------------------------------------------
// Parent images (format 1.1)

/// What each buffer of a test job holds in generation `g`: buffer id -> (size, chunk size), and
/// which chunks changed since generation 0 (the chunk index `k` changed in generation g when
/// `(k + id) % 3 == g % 3`, for g > 0).
const JOB: [(u64, u64, u64); 3] = [(1, 10_000, 1000), (2, 4096, 1024), (3, 7, 7)];

fn job_bytes(id: u64, off: u64, len: u64, generation: u8) -> Vec<u8> {
    // The generation in which this chunk last changed.
    let k = off / JOB.iter().find(|j| j.0 == id).unwrap().2;
    let last = (0..=generation)
        .rev()
        .find(|&g| g == 0 || (k + id) % 3 == u64::from(g) % 3)
        .unwrap();
    pattern(id, off, len, last)
}

/// Writes generation `g` of the test job at `dir`, with `parent`, the way the engine does: a
/// chunk whose fingerprint the parent may hold is offered to `reuse_chunk` first, copied if
/// refused. Returns the summary and the bytes reused.
fn write_job(dir: &Path, parent: Option<&Path>, generation: u8) -> (ImageSummary, u64) {
    let w = ImageWriter::create(
        dir,
        WriterOptions {
            data_files: 2,
            parent: parent.map(Path::to_path_buf),
            ..fast()
        },
    )
    .unwrap();
    let mut reused = 0;
    for &(id, size, chunk) in &JOB {
        w.add_buffer(rec(id, size, id as u32)).unwrap();
        for (off, len) in pieces(size, chunk) {
            let data = job_bytes(id, off, len, generation);
            let fp = crate::fingerprint::of(&data);
            if w.reuse_chunk(id, off, len, fp).unwrap() {
                reused += len;
            } else {
                w.write_chunk_fp(id, off, &data, fp).unwrap();
            }
        }
    }
    w.set_meta("generation", &generation.to_string()).unwrap();
    (w.commit().unwrap(), reused)
}

/// Reads every chunk of the image at `dir` and compares it with generation `g` of the job.
fn check_job(dir: &Path, generation: u8) {
    let img = Image::open(dir).unwrap();
    img.verify().unwrap();
    for &(id, size, chunk) in &JOB {
        assert_eq!(img.chunks(id), pieces(size, chunk));
        for (off, len) in pieces(size, chunk) {
            let mut dst = vec![0u8; len as usize];
            img.read_chunk(id, off, &mut dst).unwrap();
            let want = job_bytes(id, off, len, generation);
            assert_eq!(dst, want, "generation {generation}: {id}@{off}");
            assert_eq!(
                img.fingerprint(id, off),
                Some(crate::fingerprint::of(&want))
            );
        }
    }
}

/// The bytes of the job's chunks that did not change from generation `from` to `to`.
fn unchanged_bytes(from: u8, to: u8) -> u64 {
    let mut n = 0;
    for &(id, size, chunk) in &JOB {
        for (off, len) in pieces(size, chunk) {
            if job_bytes(id, off, len, from) == job_bytes(id, off, len, to) {
                n += len;
            }
        }
    }
    n
}

/// The sum of the lengths of the files in `dir` named `data-*`.
fn own_data_bytes(dir: &Path) -> u64 {
    entries(dir)
        .iter()
        .filter(|n| n.starts_with("data-"))
        .map(|n| fs::metadata(dir.join(n)).unwrap().len())
        .sum()
}

/// A child image takes the parent's unchanged chunks by reference: its own data files hold only
/// the chunks that changed, its manifest names the parent's files through the parent's
/// relative path, and it reads back bit-exact. A grandchild takes chunks both from its parent
/// and from the grandparent (through the original file, not the parent), and so does a
/// fourth generation; the whole chain survives being moved together.
#[test]
fn child_images_reuse_their_parents_chunks_down_a_chain() {
    let root = tempfile::tempdir().unwrap();
    let base = root.path().join("ckpts");
    let total: u64 = JOB.iter().map(|j| j.1).sum();
    let dirs: Vec<PathBuf> = (0..4).map(|g| base.join(format!("gen-{g}"))).collect();

    let (s0, reused) = write_job(&dirs[0], None, 0);
    assert_eq!((s0.reused_bytes, reused, s0.data_file_bytes), (0, 0, total));
    for g in 1..4u8 {
        let (s, reused) = write_job(&dirs[g as usize], Some(&dirs[g as usize - 1]), g);
        // What did not change since the parent's generation is reused (and more: a chunk that
        // changed back to an older generation's bytes is found in the grandparent's files).
        assert!(reused >= unchanged_bytes(g - 1, g), "generation {g}");
        assert!(reused > 0 && reused < total);
        assert_eq!(s.reused_bytes, reused, "generation {g}");
        assert_eq!(s.total_bytes, total);
        // The image's own files hold exactly the chunks copied.
        assert_eq!(s.data_file_bytes, total - reused, "generation {g}");
        assert_eq!(own_data_bytes(&dirs[g as usize]), total - reused);
        check_job(&dirs[g as usize], g);
    }
    check_job(&dirs[0], 0);

    // Generation 1 refers to generation 0 only; generation 2 to 0 and 1 directly (what 1 took
    // from 0 is named in 0's files); and every reused chunk points into a file of an image
    // that wrote it.
    let m1 = manifest_of(&dirs[1]);
    assert_eq!(
        m1.parents
            .iter()
            .map(|p| p.path.as_str())
            .collect::<Vec<_>>(),
        vec!["../gen-0"]
    );
    let m2 = manifest_of(&dirs[2]);
    let mut paths: Vec<&str> = m2.parents.iter().map(|p| p.path.as_str()).collect();
    paths.sort();
    assert_eq!(paths, vec!["../gen-0", "../gen-1"]);
    let crc_of = |dir: &Path| {
        let b = fs::read(dir.join(MANIFEST_FILE)).unwrap();
        u32::from_le_bytes(b[b.len() - 4..].try_into().unwrap())
    };
    for p in &m2.parents {
        let pdir = dirs[2].join(&p.path);
        assert_eq!(p.manifest_crc32c, crc_of(&pdir));
        assert_eq!(p.created_unix_nanos, manifest_of(&pdir).created_unix_nanos);
    }
    for c in &m2.chunks {
        let f = &m2.files[c.file as usize];
        let Some(p) = f.parent else { continue };
        let pdir = dirs[2].join(&m2.parents[p as usize].path);
        let pm = manifest_of(&pdir);
        let held = pm
            .chunks
            .iter()
            .find(|pc| {
                let pf = &pm.files[pc.file as usize];
                pf.parent.is_none()
                    && pf.name == f.name
                    && pc.file_offset == c.file_offset
                    && pc.len == c.len
            })
            .expect("a reused chunk points at a chunk its image wrote");
        assert_eq!(
            (held.crc32c, held.fingerprint()),
            (c.crc32c, c.fingerprint())
        );
    }
    // A later write of a reused chunk goes to the child's own file (never into the parent's).
    let before: Vec<Vec<u8>> = entries(&dirs[0])
        .iter()
        .filter(|n| n.starts_with("data-"))
        .map(|n| fs::read(dirs[0].join(n)).unwrap())
        .collect();
    let dir5 = base.join("gen-1b");
    let w = ImageWriter::create(
        &dir5,
        WriterOptions {
            parent: Some(dirs[0].clone()),
            ..fast()
        },
    )
    .unwrap();
    w.add_buffer(rec(3, 7, 0)).unwrap();
    let old = job_bytes(3, 0, 7, 0);
    assert!(w
        .reuse_chunk(3, 0, 7, crate::fingerprint::of(&old))
        .unwrap());
    w.write_chunk(3, 0, b"NEWNEWN").unwrap();
    let s = w.commit().unwrap();
    assert_eq!(
        (s.reused_bytes, s.data_file_bytes, s.parents.len()),
        (0, 7, 0)
    );
    let mut got = [0u8; 7];
    Image::open(&dir5)
        .unwrap()
        .read_chunk(3, 0, &mut got)
        .unwrap();
    assert_eq!(&got, b"NEWNEWN");
    let after: Vec<Vec<u8>> = entries(&dirs[0])
        .iter()
        .filter(|n| n.starts_with("data-"))
        .map(|n| fs::read(dirs[0].join(n)).unwrap())
        .collect();
    assert!(before == after, "the parent's files were written");

    // The chain moved as a whole still opens: the references are relative.
    let moved = root.path().join("elsewhere");
    fs::rename(&base, &moved).unwrap();
    for g in 0..4u8 {
        check_job(&moved.join(format!("gen-{g}")), g);
    }
}

/// `reuse_chunk` takes only a chunk of the same fingerprint and the same length, and a writer
/// without a parent takes none; a reused chunk counts as declared data (buffer and range
/// checked as for a write).
#[test]
fn reuse_needs_the_same_fingerprint_and_length() {
    use crate::fingerprint::of;
    let root = tempfile::tempdir().unwrap();
    let parent = small_image(root.path());
    let w = ImageWriter::create(&root.path().join("lonely"), fast()).unwrap();
    w.add_buffer(rec(1, 3000, 0)).unwrap();
    assert!(!w
        .reuse_chunk(1, 0, 1000, of(&pattern(1, 0, 1000, 0)))
        .unwrap());
    drop(w);

    let w = ImageWriter::create(
        &root.path().join("child"),
        WriterOptions {
            parent: Some(parent.clone()),
            ..fast()
        },
    )
    .unwrap();
    w.add_buffer(rec(1, 3000, 0)).unwrap();
    let fp = of(&pattern(1, 0, 1000, 0));
    assert!(!w.reuse_chunk(1, 0, 999, fp).unwrap(), "another length");
    assert!(!w
        .reuse_chunk(1, 0, 1000, of(&pattern(1, 0, 1000, 9)))
        .unwrap());
    assert!(matches!(
        w.reuse_chunk(7, 0, 1000, fp),
        Err(ImageError::UnknownBuffer { buffer: 7 })
    ));
    assert!(matches!(
        w.reuse_chunk(1, 2500, 1000, fp),
        Err(ImageError::ChunkOutOfRange { .. })
    ));
    // The same bytes at another place of another buffer are taken all the same.
    w.add_buffer(rec(9, 1000, 1)).unwrap();
    assert!(w.reuse_chunk(9, 0, 1000, fp).unwrap());
    for (off, len) in pieces(3000, 1000) {
        assert!(w
            .reuse_chunk(1, off, len, of(&pattern(1, off, len, 0)))
            .unwrap());
    }
    let s = w.commit().unwrap();
    assert_eq!((s.reused_bytes, s.data_file_bytes), (4000, 0));
    let img = Image::open(&root.path().join("child")).unwrap();
    img.verify().unwrap();
    let mut got = vec![0u8; 1000];
    img.read_chunk(9, 0, &mut got).unwrap();
    assert_eq!(got, pattern(1, 0, 1000, 0));
}

/// The parent may live in another checkpoint directory: the manifest names it by a relative
/// path up to the common ancestor and down.
#[test]
fn a_parent_in_another_checkpoint_directory() {
    let root = tempfile::tempdir().unwrap();
    let a = root.path().join("ckpt-a/gpu/gpu-0");
    let b = root.path().join("ckpt-b/gpu/gpu-0");
    write_job(&a, None, 0);
    let (s, reused) = write_job(&b, Some(&a), 1);
    assert_eq!(s.reused_bytes, reused);
    assert_eq!(s.parents, vec![PathBuf::from("../../../ckpt-a/gpu/gpu-0")]);
    check_job(&b, 1);
}

/// A child whose parent is gone, replaced, truncated or missing a file is refused on open, with
/// a message that names both images.
#[test]
fn a_child_without_its_parent_is_refused_clearly() {
    let root = tempfile::tempdir().unwrap();
    let p = root.path().join("p");
    let c = root.path().join("c");
    write_job(&p, None, 0);
    write_job(&c, Some(&p), 1);
    let saved = root.path().join("saved");
    let copy = |from: &Path, to: &Path| {
        fs::create_dir_all(to).unwrap();
        for n in entries(from) {
            fs::copy(from.join(&n), to.join(&n)).unwrap();
        }
    };
    copy(&p, &saved);
    let restore = || {
        let _ = fs::remove_dir_all(&p);
        copy(&saved, &p);
        Image::open(&c).unwrap();
    };

    // Gone.
    fs::remove_dir_all(&p).unwrap();
    let e = open_err(&c);
    assert!(matches!(&e, ImageError::ParentMissing { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.starts_with(&format!(
            "image {} refers to chunks of parent image {}, which is missing",
            c.display(),
            c.join("../p").display()
        )),
        "{text}"
    );
    // A directory without a manifest.
    fs::create_dir(&p).unwrap();
    assert!(
        matches!(open_err(&c), ImageError::ParentMissing { problem, .. } if problem.contains("manifest.pb"))
    );
    restore();

    // Replaced by another image under the same name (a later checkpoint with force).
    let w = ImageWriter::create(
        &p,
        WriterOptions {
            force: true,
            ..fast()
        },
    )
    .unwrap();
    for &(id, size, chunk) in &JOB {
        w.add_buffer(rec(id, size, 0)).unwrap();
        for (off, len) in pieces(size, chunk) {
            w.write_chunk(id, off, &job_bytes(id, off, len, 0)).unwrap();
        }
    }
    w.commit().unwrap();
    let e = open_err(&c);
    assert!(
        matches!(&e, ImageError::ParentChanged { problem, .. } if problem.contains("checksum")),
        "{e:?}"
    );
    assert!(e.to_string().contains("which has changed"), "{e}");
    restore();

    // A data file of the parent truncated, then removed.
    let pm = manifest_of(&p);
    let used = manifest_of(&c)
        .files
        .into_iter()
        .find(|f| f.parent.is_some())
        .unwrap();
    let listed = pm.files.iter().find(|f| f.name == used.name).unwrap();
    truncate(&p.join(&used.name), listed.len - 1);
    let e = open_err(&c);
    assert!(
        matches!(&e, ImageError::ParentChanged { problem, .. } if problem.contains("truncated")),
        "{e:?}"
    );
    fs::remove_file(p.join(&used.name)).unwrap();
    let e = open_err(&c);
    assert!(
        matches!(&e, ImageError::ParentChanged { problem, .. } if problem.contains("missing")),
        "{e:?}"
    );
    restore();

    // A flipped byte in a parent's data file: the CRC copied from the parent catches it when read.
    let hit = manifest_of(&c)
        .chunks
        .into_iter()
        .find(|ch| manifest_of(&c).files[ch.file as usize].parent.is_some())
        .unwrap();
    flip_byte(&p.join(&used.name), hit.file_offset);
    let e = Image::open(&c).unwrap().verify().unwrap_err();
    assert!(
        matches!(&e, ImageError::ChecksumMismatch { file, .. } if file.starts_with("../p/")),
        "{e:?}"
    );
}

/// A manifest cannot make the reader open anything but a data file of a possum image at a
/// `..`-relative path that it records: odd parent paths, a file of an unlisted parent, a file
/// the parent does not list are refused.
#[test]
fn parent_references_are_validated() {
    let root = tempfile::tempdir().unwrap();
    let p = root.path().join("p");
    let c = root.path().join("c");
    write_job(&p, None, 0);
    write_job(&c, Some(&p), 1);
    let good = manifest_of(&c);
    assert_eq!(good.parents.len(), 1);
    let put = |m: &Manifest| {
        fs::write(c.join(MANIFEST_FILE), encode_framed(m, m.major, m.minor)).unwrap();
    };
    for bad in [
        "",
        "/etc",
        "p",
        "./../p",
        "../p/",
        "..//p",
        "../p/../p",
        "../.",
        "../p\0",
        "a/../p",
    ] {
        let mut m = good.clone();
        m.parents[0].path = bad.to_owned();
        put(&m);
        let e = open_err(&c);
        assert!(
            matches!(&e, ImageError::ManifestInvalid { problem, .. } if problem.contains("invalid parent image path")),
            "{bad:?}: {e:?}"
        );
    }
    // A parent listed twice, a file of a parent not listed.
    let mut m = good.clone();
    m.parents.push(m.parents[0].clone());
    put(&m);
    assert!(
        matches!(open_err(&c), ImageError::ManifestInvalid { problem, .. } if problem.contains("twice"))
    );
    let mut m = good.clone();
    let f = m.files.iter_mut().find(|f| f.parent.is_some()).unwrap();
    f.parent = Some(1);
    put(&m);
    assert!(
        matches!(open_err(&c), ImageError::ManifestInvalid { problem, .. } if problem.contains("not listed"))
    );
    // A name the parent does not list (a file that is there, but not one of its data files).
    fs::write(p.join("notes.bin"), vec![0u8; 1 << 16]).unwrap();
    let mut m = good.clone();
    let f = m.files.iter_mut().find(|f| f.parent.is_some()).unwrap();
    f.name = "notes.bin".into();
    put(&m);
    assert!(
        matches!(open_err(&c), ImageError::ParentChanged { problem, .. } if problem.contains("does not list"))
    );
    // A directory up the tree that is no image.
    let mut m = good.clone();
    m.parents[0].path = "../..".into();
    put(&m);
    assert!(matches!(open_err(&c), ImageError::ParentMissing { .. }));
    // The same name in the image's own files and in the parent's is fine.
    put(&good);
    let names: Vec<&str> = good.files.iter().map(|f| f.name.as_str()).collect();
    let distinct: std::collections::BTreeSet<&str> = names.iter().copied().collect();
    assert!(distinct.len() < names.len(), "{names:?}");
    Image::open(&c).unwrap();
}

/// The writer refuses a missing or corrupt parent up front, naming it, and refuses to write an
/// image over its parent (or its grandparent, or a directory holding one), even with force.
#[test]
fn the_writer_checks_its_parent() {
    let root = tempfile::tempdir().unwrap();
    let with = |parent: &Path, force: bool| WriterOptions {
        parent: Some(parent.to_path_buf()),
        force,
        ..fast()
    };
    let nowhere = root.path().join("nowhere");
    let e = ImageWriter::create(&root.path().join("c"), with(&nowhere, false)).unwrap_err();
    assert!(matches!(&e, ImageError::ParentUnusable { parent, .. } if parent == &nowhere));
    assert!(
        e.to_string()
            .contains(&format!("cannot use parent image {}", nowhere.display())),
        "{e}"
    );
    assert!(
        entries(root.path()).is_empty(),
        "{:?}",
        entries(root.path())
    );

    let p = root.path().join("p");
    write_job(&p, None, 0);
    flip_byte(&p.join(MANIFEST_FILE), HEADER_LEN + 2);
    let e = ImageWriter::create(&root.path().join("c"), with(&p, false)).unwrap_err();
    assert!(
        matches!(&e, ImageError::ParentUnusable { source, .. } if matches!(**source, ImageError::ManifestChecksum { .. })),
        "{e:?}"
    );
    flip_byte(&p.join(MANIFEST_FILE), HEADER_LEN + 2);

    let c = root.path().join("c");
    write_job(&c, Some(&p), 1);
    for (target, parent) in [(&p, &p), (&p, &c), (&c, &c)] {
        for force in [false, true] {
            let e = ImageWriter::create(target, with(parent, force)).unwrap_err();
            assert!(matches!(&e, ImageError::ParentIsTarget { .. }), "{e:?}");
            assert!(
                e.to_string()
                    .contains("cannot be written over its parent image"),
                "{e}"
            );
        }
    }
    // Through another spelling of the same path.
    let e = ImageWriter::create(&root.path().join("x/../p"), with(&p, true));
    assert!(matches!(e, Err(ImageError::ParentIsTarget { .. })));
    // A directory holding the parent.
    let outer = root.path().join("outer");
    let inner = outer.join("p");
    write_job(&inner, None, 0);
    let e = ImageWriter::create(&outer, with(&inner, true)).unwrap_err();
    assert!(matches!(&e, ImageError::ParentIsTarget { .. }), "{e:?}");
    // Nothing was harmed.
    check_job(&p, 0);
    check_job(&c, 1);
    check_job(&inner, 0);
}

/// The fuzz target's properties hold for a manifest with fingerprints and parents, and for the
/// same one with its parent path made absolute (refused).
#[test]
fn the_manifest_fuzz_target_accepts_a_child_manifest() {
    let root = tempfile::tempdir().unwrap();
    let p = root.path().join("p");
    let c = root.path().join("c");
    write_job(&p, None, 0);
    write_job(&c, Some(&p), 1);
    let bytes = fs::read(c.join(MANIFEST_FILE)).unwrap();
    let summary = check_manifest(&c, &bytes).unwrap();
    assert_eq!(&summary, Image::open(&c).unwrap().summary());
    super::fuzz::manifest(&bytes);
    let mut m = manifest_of(&c);
    m.parents[0].path = p.display().to_string();
    let bad = encode_framed(&m, m.major, m.minor);
    assert!(check_manifest(&c, &bad).is_err());
    super::fuzz::manifest(&bad);
}
