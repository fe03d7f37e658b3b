//! Reading and writing the few CRIU image files possum rewrites ([`crate::hostmem`]).
//!
//! A CRIU 4.x protobuf image is a little-endian `u32` head magic (`IMG_COMMON_MAGIC`; the
//! inventory has none), the image's own `u32` magic, then entries, each a `u32` length and that
//! many bytes of one protobuf message. `pages-N.img` is raw page data with no header, in the
//! order of the present entries of the pagemap that names it. The messages below are the subsets
//! of CRIU's `images/*.proto` (proto2) that possum reads, written out by hand; prost skips the
//! fields they leave out when decoding. Only the pagemap is written back, and every field of its
//! messages is declared, so nothing is lost.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Magic of every image but the inventory and the service images, before the image's own
/// (`IMG_COMMON_MAGIC`).
pub const COMMON_MAGIC: u32 = 0x5456_4319;
/// Head magic of CRIU's service images (`IMG_SERVICE_MAGIC`: statistics, irmap cache).
pub const SERVICE_MAGIC: u32 = 0x5510_5940;
/// `stats-dump`, `stats-restore` (a service image).
pub const STATS_MAGIC: u32 = 0x5709_3306;

/// The head magic an image of `magic` starts with: none for the inventory.
fn head_magic(magic: u32) -> Option<u32> {
    match magic {
        INVENTORY_MAGIC => None,
        STATS_MAGIC => Some(SERVICE_MAGIC),
        _ => Some(COMMON_MAGIC),
    }
}
/// `inventory.img`.
pub const INVENTORY_MAGIC: u32 = 0x5831_3116;
/// `pstree.img`.
pub const PSTREE_MAGIC: u32 = 0x5027_3030;
/// `mm-PID.img`.
pub const MM_MAGIC: u32 = 0x5749_2820;
/// `pagemap-PID.img`.
pub const PAGEMAP_MAGIC: u32 = 0x5608_4025;
/// `core-TID.img`.
pub const CORE_MAGIC: u32 = 0x5505_3847;

/// A CRIU page (x86-64, the only architecture possum runs on).
pub const PAGE_SIZE: u64 = 4096;

/// `pagemap_entry.flags`: the pages are in the parent image (a pre-dump chain).
pub const PE_PARENT: u32 = 1 << 0;
/// `pagemap_entry.flags`: the pages may be restored lazily (userfaultfd).
pub const PE_LAZY: u32 = 1 << 1;
/// `pagemap_entry.flags`: the pages are in this pagemap's `pages-N.img`.
pub const PE_PRESENT: u32 = 1 << 2;

/// `vma_entry.status` bits (criu/include/image.h).
pub mod status {
    /// A mapping CRIU restores itself.
    pub const REGULAR: u32 = 1 << 0;
    /// The main thread's stack.
    pub const STACK: u32 = 1 << 1;
    /// `[vsyscall]`.
    pub const VSYSCALL: u32 = 1 << 2;
    /// `[vdso]`.
    pub const VDSO: u32 = 1 << 3;
    /// `[heap]`.
    pub const HEAP: u32 = 1 << 5;
    /// Private mapping of a file.
    pub const FILE_PRIVATE: u32 = 1 << 6;
    /// Shared mapping of a file.
    pub const FILE_SHARED: u32 = 1 << 7;
    /// Shared anonymous memory.
    pub const ANON_SHARED: u32 = 1 << 8;
    /// Private anonymous memory.
    pub const ANON_PRIVATE: u32 = 1 << 9;
    /// SysV shared memory.
    pub const SYSVIPC: u32 = 1 << 10;
    /// A packet socket's ring.
    pub const SOCKET: u32 = 1 << 11;
    /// `[vvar]`.
    pub const VVAR: u32 = 1 << 12;
    /// An AIO ring.
    pub const AIORING: u32 = 1 << 13;
    /// A memfd mapping.
    pub const MEMFD: u32 = 1 << 14;
    /// A shadow stack.
    pub const SHSTK: u32 = 1 << 15;
    /// A mapping a plugin restores.
    pub const EXT_PLUGIN: u32 = 1 << 27;
    /// A mapping CRIU cannot restore.
    pub const UNSUPP: u32 = 1 << 31;
}

/// `inventory_entry`, only its plugin list.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InventoryEntry {
    /// `img_version`.
    #[prost(uint32, required, tag = "1")]
    pub img_version: u32,
    /// The plugins loaded at dump time; a restore loads only these.
    #[prost(message, optional, tag = "12")]
    pub plugins_entry: Option<PluginsEntry>,
}

/// `plugins_entry`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginsEntry {
    /// Plugin names (`CR_PLUGIN_DESC.name`).
    #[prost(string, repeated, tag = "12")]
    pub plugins: Vec<String>,
}

/// `pstree_entry`: one process of the tree.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PstreeEntry {
    /// PID (in the dumped tree's namespace).
    #[prost(uint32, required, tag = "1")]
    pub pid: u32,
    /// Parent PID.
    #[prost(uint32, required, tag = "2")]
    pub ppid: u32,
    /// Thread IDs, the first the process itself.
    #[prost(uint32, repeated, packed = "false", tag = "5")]
    pub threads: Vec<u32>,
}

/// `mm_entry`, only its mappings.
#[derive(Clone, PartialEq, prost::Message)]
pub struct MmEntry {
    /// Every mapping, sorted by address.
    #[prost(message, repeated, tag = "14")]
    pub vmas: Vec<VmaEntry>,
}

/// `vma_entry`: one mapping.
#[derive(Clone, PartialEq, prost::Message)]
pub struct VmaEntry {
    /// First address.
    #[prost(uint64, required, tag = "1")]
    pub start: u64,
    /// One past the last address.
    #[prost(uint64, required, tag = "2")]
    pub end: u64,
    /// `PROT_*`.
    #[prost(uint32, required, tag = "5")]
    pub prot: u32,
    /// `MAP_*`.
    #[prost(uint32, required, tag = "6")]
    pub flags: u32,
    /// [`status`] bits.
    #[prost(uint32, required, tag = "7")]
    pub status: u32,
    /// `madvise` advice bits (bit n: advice n was given).
    #[prost(uint64, optional, tag = "9")]
    pub madv: Option<u64>,
}

/// `pagemap_head`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PagemapHead {
    /// The `N` of the `pages-N.img` holding the present pages.
    #[prost(uint32, required, tag = "1")]
    pub pages_id: u32,
}

/// `pagemap_entry`: a run of pages.
///
/// The run's length has two fields: CRIU 4.1 and older write `nr_pages` (tag 2, 32 bits); CRIU
/// 4.2 renamed it `compat_nr_pages`, writes 0 there and the length in a new 64-bit `nr_pages`
/// (tag 5), and reads tag 2 only when tag 5 is absent. [`PagemapEntry::pages`] reads either;
/// [`PagemapEntry::run`] writes both, so that either CRIU reads the entry.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PagemapEntry {
    /// First address.
    #[prost(uint64, required, tag = "1")]
    pub vaddr: u64,
    /// Pages in the run, as CRIU 4.1 and older write it (0 in CRIU 4.2's images).
    #[prost(uint32, required, tag = "2")]
    pub compat_nr_pages: u32,
    /// Old images' way of saying [`PE_PARENT`].
    #[prost(bool, optional, tag = "3")]
    pub in_parent: Option<bool>,
    /// `PE_*` bits; absent in old images, meaning [`PE_PRESENT`] (or in parent).
    #[prost(uint32, optional, tag = "4")]
    pub flags: Option<u32>,
    /// Pages in the run, as CRIU 4.2 and later write it (absent in older images).
    #[prost(uint64, optional, tag = "5")]
    pub nr_pages: Option<u64>,
}

impl PagemapEntry {
    /// A run of `pages` pages at `vaddr`, its length in both fields.
    pub fn run(vaddr: u64, pages: u64, in_parent: Option<bool>, flags: Option<u32>) -> Self {
        Self {
            vaddr,
            compat_nr_pages: u32::try_from(pages).unwrap_or(u32::MAX),
            in_parent,
            flags,
            nr_pages: Some(pages),
        }
    }

    /// Pages in the run, from whichever field the CRIU that wrote it uses.
    pub fn pages(&self) -> u64 {
        self.nr_pages.unwrap_or(u64::from(self.compat_nr_pages))
    }

    /// The entry's `PE_*` bits, old images' form included (as CRIU reads them).
    pub fn effective_flags(&self) -> u32 {
        if self.in_parent == Some(true) {
            return self.flags.unwrap_or(0) | PE_PARENT;
        }
        self.flags.unwrap_or(PE_PRESENT)
    }

    /// Bytes the run covers.
    pub fn len(&self) -> u64 {
        self.pages() * PAGE_SIZE
    }

    /// Whether the run is empty.
    pub fn is_empty(&self) -> bool {
        self.pages() == 0
    }
}

/// `core_entry`, only what says where a thread's rseq area is.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CoreEntry {
    /// `thread_core`.
    #[prost(message, optional, tag = "5")]
    pub thread_core: Option<ThreadCoreEntry>,
}

/// `thread_core_entry`, only its rseq registration.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ThreadCoreEntry {
    /// The thread's registered rseq area, if any.
    #[prost(message, optional, tag = "15")]
    pub rseq_entry: Option<RseqEntry>,
}

/// `rseq_entry`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RseqEntry {
    /// Address of the registered `struct rseq` (0: none).
    #[prost(uint64, required, tag = "1")]
    pub rseq_abi_pointer: u64,
    /// Its size.
    #[prost(uint32, required, tag = "2")]
    pub rseq_abi_size: u32,
}

/// An image file that is not what it should be.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// Reading or writing failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The file is not a CRIU image of the expected kind, or is cut short or corrupt.
    #[error("{}: {detail}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
}

/// The entries of the image at `path`, checked to start with `magic` (after the head magic,
/// which the inventory lacks).
pub fn read_entries(path: &Path, magic: u32) -> Result<Vec<Vec<u8>>, ImageError> {
    let data = fs::read(path).map_err(|source| ImageError::Io {
        path: path.into(),
        source,
    })?;
    parse_entries(&data, magic, path)
}

/// [`read_entries`] on an image's bytes already in memory (`path` names it in errors only). Each
/// entry is a slice of `data`: nothing is allocated beyond `data`'s size, whatever the lengths
/// say.
pub fn parse_entries(data: &[u8], magic: u32, path: &Path) -> Result<Vec<Vec<u8>>, ImageError> {
    let bad = |detail: String| ImageError::Malformed {
        path: path.into(),
        detail,
    };
    let word = |at: usize| -> Option<u32> {
        data.get(at..at.checked_add(4)?)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    };
    let mut at = 0;
    if let Some(head) = head_magic(magic) {
        match word(0) {
            Some(h) if h == head => at = 4,
            other => return Err(bad(format!("head magic {other:x?}, not a CRIU 4.x image"))),
        }
    }
    match word(at) {
        Some(m) if m == magic => at += 4,
        other => return Err(bad(format!("magic {other:x?}, expected {magic:#x}"))),
    }
    let mut entries = Vec::new();
    while at < data.len() {
        let len = word(at).ok_or_else(|| bad(format!("entry length cut short at byte {at}")))?;
        let len = len as usize;
        let body = (at + 4)
            .checked_add(len)
            .and_then(|end| data.get(at + 4..end))
            .ok_or_else(|| bad(format!("entry of {len} bytes at byte {at} cut short")))?;
        entries.push(body.to_vec());
        at += 4 + len;
    }
    Ok(entries)
}

/// The messages of the image at `path`.
pub fn read_messages<M: prost::Message + Default>(
    path: &Path,
    magic: u32,
) -> Result<Vec<M>, ImageError> {
    read_entries(path, magic)?
        .iter()
        .enumerate()
        .map(|(i, e)| {
            M::decode(e.as_slice()).map_err(|err| ImageError::Malformed {
                path: path.into(),
                detail: format!("entry {i}: {err}"),
            })
        })
        .collect()
}

/// The bytes of an image holding `entries` (already encoded), with `magic`.
pub fn encode_image(magic: u32, entries: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + entries.iter().map(|e| e.len() + 4).sum::<usize>());
    if let Some(head) = head_magic(magic) {
        out.extend_from_slice(&head.to_le_bytes());
    }
    out.extend_from_slice(&magic.to_le_bytes());
    for e in entries {
        out.extend_from_slice(&(e.len() as u32).to_le_bytes());
        out.extend_from_slice(e);
    }
    out
}

/// A pagemap image: its head and runs.
#[derive(Debug, Clone, PartialEq)]
pub struct Pagemap {
    /// The head.
    pub head: PagemapHead,
    /// The runs, in address order.
    pub entries: Vec<PagemapEntry>,
}

impl Pagemap {
    /// Reads `pagemap-PID.img`.
    pub fn read(path: &Path) -> Result<Pagemap, ImageError> {
        let data = fs::read(path).map_err(|source| ImageError::Io {
            path: path.into(),
            source,
        })?;
        Pagemap::decode(&data, path)
    }

    /// [`Pagemap::read`] on the image's bytes already in memory (`path` names it in errors only).
    pub fn decode(data: &[u8], path: &Path) -> Result<Pagemap, ImageError> {
        let raw = parse_entries(data, PAGEMAP_MAGIC, path)?;
        let bad = |detail: String| ImageError::Malformed {
            path: path.into(),
            detail,
        };
        let (head, rest) = raw
            .split_first()
            .ok_or_else(|| bad("no pagemap head".into()))?;
        let head = <PagemapHead as prost::Message>::decode(head.as_slice())
            .map_err(|e| bad(format!("head: {e}")))?;
        let entries = rest
            .iter()
            .enumerate()
            .map(|(i, e)| {
                <PagemapEntry as prost::Message>::decode(e.as_slice())
                    .map_err(|err| bad(format!("entry {i}: {err}")))
            })
            .collect::<Result<_, _>>()?;
        Ok(Pagemap { head, entries })
    }

    /// The image's bytes.
    pub fn encode(&self) -> Vec<u8> {
        use prost::Message as _;
        let mut raw = vec![self.head.encode_to_vec()];
        raw.extend(self.entries.iter().map(|e| e.encode_to_vec()));
        encode_image(PAGEMAP_MAGIC, &raw)
    }
}

/// Adds `name` to the plugins the inventory in `dir` says a restore needs (CRIU 4.x then fails
/// a restore without a plugin that claims it: `Missing required plugin: NAME`). Every other field
/// of the inventory is kept byte for byte. Whether it was added (`false`: already there).
pub fn require_plugin(dir: &Path, name: &str) -> Result<bool, ImageError> {
    let path = dir.join("inventory.img");
    let data = fs::read(&path).map_err(|source| ImageError::Io {
        path: path.clone(),
        source,
    })?;
    let Some(rewritten) = with_plugin(&data, name, &path)? else {
        return Ok(false);
    };
    let tmp = dir.join("inventory.img.possum-tmp");
    let io = |source| ImageError::Io {
        path: tmp.clone(),
        source,
    };
    fs::write(&tmp, rewritten).map_err(io)?;
    fs::rename(&tmp, &path).map_err(|source| ImageError::Io {
        path: path.clone(),
        source,
    })?;
    Ok(true)
}

/// The bytes of the inventory image `data` with `name` among the plugins a restore needs, every
/// other field kept byte for byte; `None` if it is there already (`path` names the image in
/// errors only).
pub fn with_plugin(data: &[u8], name: &str, path: &Path) -> Result<Option<Vec<u8>>, ImageError> {
    use prost::Message as _;
    let bad = |detail: String| ImageError::Malformed {
        path: path.into(),
        detail,
    };
    let entries = parse_entries(data, INVENTORY_MAGIC, path)?;
    let [inv] = entries.as_slice() else {
        return Err(bad(format!("{} entries, expected 1", entries.len())));
    };
    // The message's top-level fields: field 12 (plugins_entry) taken out, the rest kept.
    let mut kept = Vec::with_capacity(inv.len() + 16);
    let mut plugins = PluginsEntry::default();
    let mut at = 0;
    while at < inv.len() {
        let start = at;
        let key = varint(inv, &mut at).ok_or_else(|| bad("truncated field key".into()))?;
        // How many bytes the field's value takes after its key (a varint: read already).
        let skip = match key & 7 {
            0 => {
                varint(inv, &mut at).ok_or_else(|| bad("truncated varint".into()))?;
                0
            }
            1 => 8,
            5 => 4,
            2 => {
                let len = varint(inv, &mut at).ok_or_else(|| bad("truncated length".into()))?;
                usize::try_from(len).map_err(|_| bad("huge field".into()))?
            }
            w => return Err(bad(format!("wire type {w} in the inventory"))),
        };
        let body_start = at;
        at = at
            .checked_add(skip)
            .filter(|&end| end <= inv.len())
            .ok_or_else(|| bad("truncated field".into()))?;
        if key >> 3 == 12 {
            if key & 7 != 2 {
                return Err(bad(format!("plugins_entry with wire type {}", key & 7)));
            }
            let more = PluginsEntry::decode(&inv[body_start..at])
                .map_err(|e| bad(format!("plugins_entry: {e}")))?;
            plugins.plugins.extend(more.plugins);
        } else {
            kept.extend_from_slice(&inv[start..at]);
        }
    }
    if plugins.plugins.iter().any(|p| p == name) {
        return Ok(None);
    }
    plugins.plugins.push(name.to_string());
    let field = InventoryEntry {
        img_version: 0,
        plugins_entry: Some(plugins),
    }
    .encode_to_vec();
    // Skip the encoded img_version (field 1, varint 0: two bytes); keep field 12.
    kept.extend_from_slice(&field[2..]);
    Ok(Some(encode_image(INVENTORY_MAGIC, &[kept])))
}

/// A protobuf varint at `*at`, moving past it.
fn varint(b: &[u8], at: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at)?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// `DIR/NAME-ID.img`.
pub fn image_path(dir: &Path, name: &str, id: u32) -> PathBuf {
    dir.join(format!("{name}-{id}.img"))
}

/// The numbers `N` of the `pages-N.img` in `dir`, least first.
pub fn pages_ids(dir: &Path) -> io::Result<Vec<u32>> {
    let mut ids = Vec::new();
    for e in fs::read_dir(dir)? {
        let name = e?.file_name();
        let id = (name.to_str())
            .and_then(|n| n.strip_prefix("pages-"))
            .and_then(|r| r.strip_suffix(".img"))
            .and_then(|n| n.parse::<u32>().ok());
        ids.extend(id);
    }
    ids.sort_unstable();
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn a_pagemap_round_trips_and_old_entries_read_as_present() {
        let dir = tempfile::tempdir().unwrap();
        let pm = Pagemap {
            head: PagemapHead { pages_id: 7 },
            entries: vec![
                PagemapEntry::run(0x1000, 3, None, Some(PE_PRESENT | PE_LAZY)),
                PagemapEntry {
                    vaddr: 0x9000,
                    compat_nr_pages: 1,
                    in_parent: None,
                    flags: None,
                    nr_pages: None,
                },
            ],
        };
        let path = dir.path().join("pagemap-1.img");
        fs::write(&path, pm.encode()).unwrap();
        let back = Pagemap::read(&path).unwrap();
        assert_eq!(back, pm);
        assert_eq!(back.entries[1].effective_flags(), PE_PRESENT);
        let parent = PagemapEntry {
            in_parent: Some(true),
            ..back.entries[1].clone()
        };
        assert_eq!(parent.effective_flags() & PE_PARENT, PE_PARENT);
        assert_eq!(back.entries[0].pages(), 3);
        assert_eq!(back.entries[1].pages(), 1, "a CRIU 4.1 entry");
        assert_eq!(back.entries[1].len(), PAGE_SIZE);
    }

    /// An entry as CRIU 4.2 writes it: the length only in the 64-bit field, 0 in the old one.
    /// The bytes are those of a 4.2.1 dump (`vaddr`, `compat_nr_pages` 0, `flags`,
    /// `nr_pages`).
    #[test]
    fn a_criu_4_2_entry_reads_its_length_from_the_new_field() {
        let bytes = [0x08, 0x80, 0xc0, 0x01, 0x10, 0x00, 0x20, 0x06, 0x28, 0x03];
        let e = PagemapEntry::decode(&bytes[..]).unwrap();
        assert_eq!(e.vaddr, 0x6000);
        assert_eq!(e.compat_nr_pages, 0);
        assert_eq!(e.pages(), 3);
        assert_eq!(e.len(), 3 * PAGE_SIZE);
        assert!(!e.is_empty());
        // Written back by possum: both fields, so CRIU 4.1 (which knows only the old) reads it.
        let w = PagemapEntry::run(e.vaddr, e.pages(), e.in_parent, e.flags);
        let again = PagemapEntry::decode(&w.encode_to_vec()[..]).unwrap();
        assert_eq!((again.compat_nr_pages, again.nr_pages), (3, Some(3)));
    }

    #[test]
    fn wrong_magic_and_cut_entries_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mm-1.img");
        let mm = MmEntry { vmas: vec![] }.encode_to_vec();
        fs::write(&path, encode_image(PSTREE_MAGIC, std::slice::from_ref(&mm))).unwrap();
        let e = read_entries(&path, MM_MAGIC).unwrap_err().to_string();
        assert!(e.contains("mm-1.img") && e.contains("expected"), "{e}");
        let mut cut = encode_image(MM_MAGIC, &[vec![1, 2, 3, 4, 5]]);
        cut.truncate(cut.len() - 2);
        fs::write(&path, cut).unwrap();
        let e = read_entries(&path, MM_MAGIC).unwrap_err().to_string();
        assert!(e.contains("cut short"), "{e}");
        fs::write(&path, b"not an image").unwrap();
        assert!(read_entries(&path, MM_MAGIC).is_err());
    }

    #[test]
    fn the_inventory_has_no_head_magic() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inventory.img");
        let inv = InventoryEntry {
            img_version: 2,
            plugins_entry: Some(PluginsEntry {
                plugins: vec!["possum".into()],
            }),
        };
        let bytes = encode_image(INVENTORY_MAGIC, &[inv.encode_to_vec()]);
        assert_eq!(&bytes[..4], &INVENTORY_MAGIC.to_le_bytes());
        fs::write(&path, bytes).unwrap();
        let back: Vec<InventoryEntry> = read_messages(&path, INVENTORY_MAGIC).unwrap();
        assert_eq!(back, vec![inv]);
    }

    /// A field whose length runs past the inventory (up to `u64::MAX`, where adding it to the
    /// position would overflow) is refused as truncated, not followed.
    #[test]
    fn an_inventory_field_longer_than_the_inventory_is_refused() {
        let path = Path::new("inventory.img");
        for len in [u64::MAX, u64::MAX - 1, 1 << 63, 1000] {
            // Field 13 (a string), then the length as a varint, then two bytes.
            let mut field = vec![13 << 3 | 2];
            let mut v = len;
            while v >= 0x80 {
                field.push((v as u8) | 0x80);
                v >>= 7;
            }
            field.push(v as u8);
            field.extend_from_slice(b"ab");
            let image = encode_image(INVENTORY_MAGIC, &[field]);
            let e = with_plugin(&image, "possum", path).unwrap_err().to_string();
            assert!(e.contains("truncated field"), "{len}: {e}");
        }
        // A plugins entry that is not length-delimited is refused too.
        let image = encode_image(INVENTORY_MAGIC, &[vec![12 << 3, 1]]);
        let e = with_plugin(&image, "possum", path).unwrap_err().to_string();
        assert!(e.contains("plugins_entry"), "{e}");
    }

    /// A fuller inventory, as CRIU writes it: fields possum does not declare survive.
    #[derive(Clone, PartialEq, prost::Message)]
    struct FullInventory {
        #[prost(uint32, required, tag = "1")]
        img_version: u32,
        #[prost(bool, optional, tag = "2")]
        fdinfo_per_id: Option<bool>,
        #[prost(uint64, optional, tag = "8")]
        dump_uptime: Option<u64>,
        #[prost(message, optional, tag = "12")]
        plugins_entry: Option<PluginsEntry>,
        #[prost(string, optional, tag = "13")]
        dump_criu_run_id: Option<String>,
    }

    #[test]
    fn a_required_plugin_is_added_once_and_the_rest_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inventory.img");
        let inv = FullInventory {
            img_version: 2,
            fdinfo_per_id: Some(true),
            dump_uptime: Some(123_456_789),
            plugins_entry: Some(PluginsEntry { plugins: vec![] }),
            dump_criu_run_id: Some("run-1".into()),
        };
        fs::write(&path, encode_image(INVENTORY_MAGIC, &[inv.encode_to_vec()])).unwrap();
        assert!(require_plugin(dir.path(), "possum").unwrap());
        assert!(!require_plugin(dir.path(), "possum").unwrap());
        let back: Vec<FullInventory> = read_messages(&path, INVENTORY_MAGIC).unwrap();
        let want = FullInventory {
            plugins_entry: Some(PluginsEntry {
                plugins: vec!["possum".into()],
            }),
            ..inv
        };
        assert_eq!(back, vec![want]);
    }
}
