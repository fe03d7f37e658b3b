//! The seed corpora of the `hostmem_index` and `criu_image` fuzz targets
//! (`fuzz/corpus/<target>/`), run through the same entry points the fuzzer calls, on stable, with
//! every `cargo test`.
//!
//! `cargo test -p possum-criu --test fuzz_corpus -- --ignored write_seeds` rewrites the seeds.

use std::fs;
use std::path::{Path, PathBuf};

use possum_criu::fuzz;
use possum_criu::hostmem::{Index, Range};
use possum_criu::images::*;
use prost::Message;

fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target)
}

fn seeds(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus(target);
    let mut v: Vec<_> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            (name, fs::read(e.path()).unwrap())
        })
        .collect();
    v.sort();
    v
}

/// Runs every seed of `target` through its fuzz entry point `run`, then `check(name, bytes)`;
/// the corpus must hold at least `least` seeds.
fn run_seeds(target: &str, least: usize, run: fn(&[u8]), check: impl Fn(&str, &[u8])) {
    let seeds = seeds(target);
    assert!(seeds.len() >= least, "the seed corpus is missing");
    for (name, bytes) in &seeds {
        run(bytes);
        check(name, bytes);
    }
}

#[test]
fn every_seed_passes_the_hostmem_index_target() {
    run_seeds("hostmem_index", 4, fuzz::hostmem_index, |name, bytes| {
        // Inputs a local fuzzing run added, named by their hash, are only run.
        let ok = Index::decode(bytes, Path::new(name)).is_ok();
        assert!(
            !name.contains('-') || ok == name.starts_with("valid"),
            "{name}"
        );
    });
}

#[test]
fn every_seed_passes_the_criu_image_target() {
    run_seeds("criu_image", 6, fuzz::criu_image, |name, bytes| {
        let magics = [
            INVENTORY_MAGIC,
            PSTREE_MAGIC,
            MM_MAGIC,
            PAGEMAP_MAGIC,
            CORE_MAGIC,
        ];
        let ok = magics
            .iter()
            .any(|&m| parse_entries(bytes, m, Path::new(name)).is_ok());
        // Seeds named crash-* are inputs that crashed a parser once (the fuzzer's artifacts).
        if name.starts_with("valid") || name.starts_with("corrupt") {
            assert_eq!(ok, name.starts_with("valid"), "{name}");
        }
    });
}

const P: u64 = PAGE_SIZE;

fn index() -> Index {
    let runs = [(0x7f00_0000_0000, 0, 4 * P), (0x10_0000, 8 * P, 8 * P)];
    Index {
        data_file: "possum-hostmem-7.pages".into(),
        data_len: 16 * P,
        part_bytes: 0,
        more: Vec::new(),
        ranges: runs
            .into_iter()
            .map(|(vaddr, offset, len)| Range { vaddr, offset, len })
            .collect(),
    }
}

#[test]
#[ignore = "rewrites fuzz/corpus/hostmem_index and fuzz/corpus/criu_image; run by hand"]
fn write_seeds() {
    let write = |target: &str, name: &str, bytes: &[u8]| {
        let dir = corpus(target);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(name), bytes).unwrap();
    };

    let idx = index().encode();
    write("hostmem_index", "valid-two-runs", &idx);
    let empty = Index {
        ranges: vec![],
        data_len: 0,
        ..index()
    };
    write("hostmem_index", "valid-no-runs", &empty.encode());
    // Without its checksum: the target appends one (a valid index once sealed).
    write("hostmem_index", "unsealed-two-runs", &idx[..idx.len() - 4]);
    let mut flipped = idx.clone();
    flipped[30] ^= 1;
    write("hostmem_index", "corrupt-flipped-byte", &flipped);
    write("hostmem_index", "corrupt-cut", &idx[..20]);

    let inv = |plugins: Vec<String>| {
        InventoryEntry {
            img_version: 2,
            plugins_entry: Some(PluginsEntry { plugins }),
        }
        .encode_to_vec()
    };
    write(
        "criu_image",
        "valid-inventory",
        &encode_image(INVENTORY_MAGIC, &[inv(vec!["cuda".into()])]),
    );
    write(
        "criu_image",
        "valid-inventory-with-possum",
        &encode_image(INVENTORY_MAGIC, &[inv(vec!["possum".into()])]),
    );
    let tree = [
        PstreeEntry {
            pid: 10,
            ppid: 1,
            threads: vec![10, 11],
        },
        PstreeEntry {
            pid: 20,
            ppid: 10,
            threads: vec![20],
        },
    ];
    write(
        "criu_image",
        "valid-pstree",
        &encode_image(
            PSTREE_MAGIC,
            &tree.iter().map(Message::encode_to_vec).collect::<Vec<_>>(),
        ),
    );
    let vma = |start: u64, pages: u64| VmaEntry {
        start,
        end: start + pages * P,
        prot: 3,
        flags: 0x22,
        status: 0x1,
        madv: Some(0),
    };
    let mm = MmEntry {
        vmas: vec![vma(0x100 * P, 16), vma(0x400 * P, 8)],
    };
    write(
        "criu_image",
        "valid-mm",
        &encode_image(MM_MAGIC, &[mm.encode_to_vec()]),
    );
    let pm = Pagemap {
        head: PagemapHead { pages_id: 2 },
        entries: vec![
            PagemapEntry::run(0x100 * P, 16, None, Some(PE_PRESENT)),
            PagemapEntry {
                vaddr: 0x400 * P,
                compat_nr_pages: 3,
                in_parent: Some(true),
                flags: None,
                nr_pages: None,
            },
        ],
    };
    write("criu_image", "valid-pagemap", &pm.encode());
    let core = CoreEntry {
        thread_core: Some(ThreadCoreEntry {
            rseq_entry: Some(RseqEntry {
                rseq_abi_pointer: 0x7f00_1234_0000,
                rseq_abi_size: 32,
            }),
        }),
    };
    write(
        "criu_image",
        "valid-core",
        &encode_image(CORE_MAGIC, &[core.encode_to_vec()]),
    );
    let mut cut = pm.encode();
    cut.truncate(cut.len() - 3);
    write("criu_image", "corrupt-cut-entry", &cut);
    write("criu_image", "corrupt-no-magic", b"\x19\x43");
}
