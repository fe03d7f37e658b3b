//! The seed corpus of the `manifest` fuzz target (`fuzz/corpus/manifest/`), run through the same
//! entry point the fuzzer calls, on stable, with every `cargo test`.
//!
//! `cargo test -p possum-engine --test fuzz_corpus -- --ignored write_seeds` rewrites the seeds.

use std::fs;
use std::path::{Path, PathBuf};

use possum_engine::image::{check_manifest, fuzz, ImageWriter, WriterOptions, MANIFEST_FILE};
use possum_engine::store::{BufferRecord, ChunkSink};

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/manifest")
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn every_seed_passes_the_manifest_target() {
    let seeds = files(&corpus());
    assert!(seeds.len() >= 6, "the seed corpus is missing");
    for (name, bytes) in &seeds {
        fuzz::manifest(bytes);
        // The valid seeds (written by the image writer) are accepted, the corrupt ones and bare
        // payloads refused. (Inputs a local fuzzing run added, named by their hash, are only run.)
        if name.starts_with("valid") {
            check_manifest(Path::new(name), bytes).unwrap();
        } else if name.contains('-') {
            check_manifest(Path::new(name), bytes).unwrap_err();
        }
    }
}

/// A committed image with `buffers` (id, size), cut into `chunk`-byte chunks; its `manifest.pb`.
fn written(root: &Path, buffers: &[(u64, u64)], chunk: u64, files: usize) -> Vec<u8> {
    let dir = root.join(format!("img-{}-{chunk}-{files}", buffers.len()));
    let w = ImageWriter::create(
        &dir,
        WriterOptions {
            data_files: files,
            fsync: false,
            ..Default::default()
        },
    )
    .unwrap();
    for &(id, size) in buffers {
        w.add_buffer(BufferRecord {
            id,
            va: 0x7f00_0000_0000 + (id << 24),
            size,
            prefetch_rank: id as u32,
        })
        .unwrap();
        let mut off = 0;
        while off < size {
            let len = chunk.min(size - off);
            w.write_chunk(id, off, &vec![id as u8; len as usize])
                .unwrap();
            off += len;
        }
    }
    w.set_meta("backend", "host").unwrap();
    w.commit().unwrap();
    fs::read(dir.join(MANIFEST_FILE)).unwrap()
}

#[test]
#[ignore = "rewrites fuzz/corpus/manifest; run by hand"]
fn write_seeds() {
    let root = tempfile::tempdir().unwrap();
    let one = written(root.path(), &[(1, 3000), (2, 1500), (3, 0)], 1000, 1);
    let two = written(root.path(), &[(7, 8192), (9, 100)], 4096, 2);
    let payload = |m: &[u8]| m[24..m.len() - 4].to_vec();
    let mut flipped = one.clone();
    flipped[40] ^= 0x40;
    let mut huge = one.clone();
    huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut other_major = one.clone();
    other_major[8] = 9;
    let seeds: Vec<(&str, Vec<u8>)> = vec![
        ("valid-three-buffers", one.clone()),
        ("valid-two-files", two.clone()),
        ("payload-three-buffers", payload(&one)),
        ("payload-two-files", payload(&two)),
        ("corrupt-flipped-byte", flipped),
        ("corrupt-truncated", one[..one.len() / 2].to_vec()),
        ("corrupt-huge-length", huge),
        ("corrupt-other-major", other_major),
        ("corrupt-bad-magic", b"NOTPOSSUM-IMAGE-AT-ALL-----".to_vec()),
    ];
    let dir = corpus();
    fs::create_dir_all(&dir).unwrap();
    for (name, bytes) in seeds {
        fs::write(dir.join(name), bytes).unwrap();
    }
}
