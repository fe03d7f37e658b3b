//! The entry points of the fuzz targets in `fuzz/` that read CRIU's images and possum's index of
//! moved host memory, also run over the seed corpus by the crate's tests. Each takes arbitrary
//! bytes and panics only when a property fails: the parser itself must never panic, never
//! allocate more than the input's size allows, and what it accepts must survive the writer.

use std::path::Path;

use prost::Message;

use crate::hostmem::Index;
use crate::images::{
    encode_image, parse_entries, with_plugin, CoreEntry, InventoryEntry, MmEntry, Pagemap,
    PstreeEntry, CORE_MAGIC, INVENTORY_MAGIC, MM_MAGIC, PAGEMAP_MAGIC, PSTREE_MAGIC,
};

/// `possum-hostmem-PID.idx`: `data` taken as the whole file, and `data` taken as the file without
/// its checksum (one is appended), so that mutations reach the checks behind the checksum too.
pub fn hostmem_index(data: &[u8]) {
    index_file(data);
    let mut sealed = data.to_vec();
    sealed.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
    index_file(&sealed);
}

fn index_file(bytes: &[u8]) {
    let path = Path::new("possum-hostmem-1.idx");
    let Ok(idx) = Index::decode(bytes, path) else {
        return;
    };
    // The format has one spelling of each index: the writer gives back the very bytes.
    assert_eq!(idx.encode(), bytes, "index changed through read and write");
    assert!(idx.bytes() <= idx.data_len);
    // Its files hold the data exactly.
    let files = idx.files();
    assert_eq!(files.iter().map(|f| f.1).sum::<u64>(), idx.data_len);
    assert!(idx.part_bytes == 0 || files.iter().all(|f| f.1 <= idx.part_bytes));
    for r in &idx.ranges {
        assert!(r.offset + r.len <= idx.data_len);
        assert!(r.vaddr.checked_add(r.len).is_some());
    }
}

/// A CRIU image of each kind possum reads (inventory, pstree, mm, pagemap, core), and the
/// inventory rewrite that adds possum's plugin.
pub fn criu_image(data: &[u8]) {
    let path = Path::new("criu.img");
    for magic in [
        INVENTORY_MAGIC,
        PSTREE_MAGIC,
        MM_MAGIC,
        PAGEMAP_MAGIC,
        CORE_MAGIC,
    ] {
        let Ok(entries) = parse_entries(data, magic, path) else {
            continue;
        };
        assert_eq!(
            encode_image(magic, &entries),
            data,
            "entries changed through read and write"
        );
        for e in &entries {
            match magic {
                INVENTORY_MAGIC => round_trip::<InventoryEntry>(e),
                PSTREE_MAGIC => round_trip::<PstreeEntry>(e),
                MM_MAGIC => round_trip::<MmEntry>(e),
                CORE_MAGIC => round_trip::<CoreEntry>(e),
                _ => {}
            }
        }
    }
    if let Ok(pm) = Pagemap::decode(data, path) {
        let again = Pagemap::decode(&pm.encode(), path).expect("a written pagemap reads back");
        assert_eq!(again, pm, "pagemap changed through write and read");
    }
    if let Ok(Some(rewritten)) = with_plugin(data, "possum", path) {
        assert_eq!(
            with_plugin(&rewritten, "possum", path).expect("the rewritten inventory reads"),
            None,
            "the plugin was not recorded"
        );
        let entries = parse_entries(&rewritten, INVENTORY_MAGIC, path).expect("one entry");
        assert_eq!(entries.len(), 1);
    }
}

/// A message that decodes encodes to bytes that decode to it again.
fn round_trip<M: Message + Default + PartialEq + std::fmt::Debug>(bytes: &[u8]) {
    if let Ok(m) = M::decode(bytes) {
        let again = M::decode(m.encode_to_vec().as_slice()).expect("a written message reads back");
        assert_eq!(again, m);
    }
}
