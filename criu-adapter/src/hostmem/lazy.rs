//! A dump whose pages possum writes: CRIU's `--lazy-pages` dump leaves the pages of the
//! processes' private anonymous mappings in the frozen processes (its pagemap marks those runs
//! `PE_LAZY`, its pages file holds only the rest); [`complete`], while CRIU still holds the
//! tree frozen (at its `post-dump` notification), reads them with `process_vm_readv` on
//! several threads straight into the mapping of a pages file of the standard layout, and marks
//! every run `PE_PRESENT` too (a lazy run of CRIU 4.2's own dump is `PE_LAZY | PE_PRESENT`).
//! The images are then those of a dump without lazy pages, byte for byte in every page;
//! everything downstream (the split, the send, the restore) is unchanged.
//!
//! Measured no shorter than CRIU's own write (docs/decisions.md, 44): possum reads 1.3 GB in
//! 0.1 s where CRIU's one thread takes 0.3-0.5 s to write it, but CRIU's lazy dump still drains
//! every page into its page pipes, all at once, before its `post-dump`.
//!
//! CRIU then serves the lazy pages on the page server socket possum handed it (never a TCP
//! port: see [`crate::Criu::dump`]), where possum's close is already waiting.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, IoSliceMut};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::Pid;

use super::index::{io_err, HostMemError};
use super::work::{namespace_pid, on_threads};
use super::{cut_pieces, write_synced, Piece};
use crate::images::{
    self, image_path, Pagemap, PagemapEntry, PstreeEntry, PE_LAZY, PE_PARENT, PE_PRESENT,
    PSTREE_MAGIC,
};
use crate::mapped::MappedFileMut;

/// What [`complete`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LazyReport {
    /// Processes whose pages files were completed, with the bytes read from each.
    pub processes: Vec<(u32, u64)>,
    /// Time taken.
    pub time: Duration,
}

impl LazyReport {
    /// Bytes read from the processes' memory.
    pub fn bytes(&self) -> u64 {
        self.processes.iter().map(|(_, b)| b).sum()
    }
}

/// Where a piece of the new pages file comes from: the process's memory (the piece's `from` is
/// an address) or CRIU's pages file (an offset in it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Memory,
    Pages,
}

/// The layout of a process's completed pages file.
#[derive(Debug, PartialEq, Eq)]
struct Layout {
    /// Its pieces (at most a fill chunk, 8 MiB, each: [`cut_pieces`]), in file order.
    pieces: Vec<(Source, Piece)>,
    /// The bytes taken from memory.
    lazy: u64,
    /// The file's length.
    len: u64,
}

/// The [`Layout`] of the pages file of a process whose lazy dump's pagemap is `entries`: runs
/// present in CRIU's pages file (in order, back to back; `pages_len` bytes) and lazy runs (not
/// in it).
fn layout(entries: &[PagemapEntry], pages_len: u64) -> Result<Layout, String> {
    let (mut to, mut at, mut lazy) = (0u64, 0u64, 0u64);
    let mut pieces = Vec::new();
    for e in entries {
        let flags = e.effective_flags();
        let len = e.len();
        let (source, from) = if flags & PE_PARENT != 0 {
            return Err(format!("a run in a parent image at {:#x}", e.vaddr));
        } else if flags & PE_PRESENT != 0 {
            at += len;
            (Source::Pages, at - len)
        } else if flags & PE_LAZY != 0 {
            lazy += len;
            (Source::Memory, e.vaddr)
        } else {
            return Err(format!("a run of flags {flags:#x} at {:#x}", e.vaddr));
        };
        let run = Piece { from, to, len };
        pieces.extend(cut_pieces([run]).into_iter().map(|p| (source, p)));
        to += len;
    }
    if at != pages_len {
        return Err(format!(
            "its pagemap has {at} bytes in the pages file, which has {pages_len}"
        ));
    }
    Ok(Layout {
        pieces,
        lazy,
        len: to,
    })
}

/// The host PID of each process of the tree under `root` (itself included), by the PID it has
/// in its own namespace (the one CRIU's images name it by).
fn host_pids(root: i32) -> HashMap<u32, i32> {
    crate::process::tree_of(root)
        .into_iter()
        .filter_map(|p| Some((namespace_pid(p)?, p)))
        .collect()
}

/// Writes the new pages file `out`, laid out as `layout` says, from up to `threads` threads,
/// each piece straight into the file's mapping: from the memory of process `pid` with
/// `process_vm_readv`, or from CRIU's pages file `src` (at `src_path`).
fn copy(
    layout: &Layout,
    (pid, src, src_path): (i32, &File, &Path),
    out: &Path,
    threads: usize,
) -> Result<(), HostMemError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(out)
        .map_err(io_err(out))?;
    file.set_len(layout.len).map_err(io_err(out))?;
    let mut map = MappedFileMut::map(&file, layout.len).map_err(io_err(out))?;
    // Each piece's bytes of the mapping, in file order (the pieces are back to back).
    let mut rest = map.bytes_mut();
    let mut work = Vec::with_capacity(layout.pieces.len());
    for &(source, p) in &layout.pieces {
        let (this, more) = std::mem::take(&mut rest).split_at_mut(p.len as usize);
        work.push((source, p.from, Mutex::new(this)));
        rest = more;
    }
    let pid = Pid::from_raw(pid);
    on_threads(
        &work,
        threads,
        || (),
        |(), (source, from, to)| {
            let mut to = to.lock().unwrap_or_else(|e| e.into_inner());
            match source {
                Source::Memory => read_memory(pid, *from, &mut to),
                Source::Pages => src.read_exact_at(&mut to, *from).map_err(io_err(src_path)),
            }
        },
    )
    .map(drop)
}

/// Fills `to` from process `pid`'s memory at `addr`.
fn read_memory(pid: Pid, addr: u64, to: &mut [u8]) -> Result<(), HostMemError> {
    let mut done = 0;
    while done < to.len() {
        let at = addr + done as u64;
        let remote = [RemoteIoVec {
            base: at as usize,
            len: to.len() - done,
        }];
        let err = |detail: String| HostMemError::Io {
            path: format!("process {pid}'s memory at {at:#x}").into(),
            source: io::Error::other(detail),
        };
        match process_vm_readv(pid, &mut [IoSliceMut::new(&mut to[done..])], &remote) {
            Ok(0) => return Err(err("nothing read".into())),
            Ok(n) => done += n,
            Err(e) => return Err(err(e.desc().to_string())),
        }
    }
    Ok(())
}

/// Completes the lazy dump in `dir` of the frozen tree rooted at `root` (a host PID): each
/// process's lazy runs are read from its memory on up to `threads` threads into a new pages
/// file of the standard layout, which replaces CRIU's together with a pagemap whose runs are all
/// present. A process none of whose runs is lazy is left as it is. An error leaves the process
/// being completed as CRIU wrote it (the images are then not restorable: the dump must fail).
pub fn complete(dir: &Path, root: i32, threads: usize) -> Result<LazyReport, HostMemError> {
    let start = Instant::now();
    let tree: Vec<PstreeEntry> = images::read_messages(&dir.join("pstree.img"), PSTREE_MAGIC)?;
    let hosts = host_pids(root);
    let mut report = LazyReport::default();
    for t in &tree {
        let pm_path = image_path(dir, "pagemap", t.pid);
        if !pm_path.exists() {
            continue; // a zombie: no memory
        }
        let pm = Pagemap::read(&pm_path)?;
        if !pm
            .entries
            .iter()
            .any(|e| e.effective_flags() & PE_LAZY != 0)
        {
            continue;
        }
        let old = image_path(dir, "pages", pm.head.pages_id);
        let old_len = fs::metadata(&old).map_err(io_err(&old))?.len();
        let bad = |detail: String| HostMemError::Index {
            path: pm_path.clone(),
            detail,
        };
        let layout = layout(&pm.entries, old_len).map_err(bad)?;
        let host = *hosts.get(&t.pid).ok_or_else(|| {
            bad(format!(
                "process {} of the dump is not in the tree under {root} any more",
                t.pid
            ))
        })?;
        let src = File::open(&old).map_err(io_err(&old))?;
        let tmp = dir.join(format!("pages-{}.img.possum-tmp", pm.head.pages_id));
        let pm_tmp = dir.join(format!("pagemap-{}.img.possum-tmp", t.pid));
        let written = (|| -> Result<(), HostMemError> {
            copy(&layout, (host, &src, &old), &tmp, threads)?;
            let present = Pagemap {
                head: pm.head.clone(),
                entries: pm
                    .entries
                    .iter()
                    .map(|e| {
                        let flags = e.effective_flags() | PE_PRESENT;
                        PagemapEntry::run(e.vaddr, e.pages(), None, Some(flags))
                    })
                    .collect(),
            };
            write_synced(&pm_tmp, &present.encode())?;
            fs::rename(&tmp, &old).map_err(io_err(&old))?;
            fs::rename(&pm_tmp, &pm_path).map_err(io_err(&pm_path))
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            let _ = fs::remove_file(&pm_tmp);
            return Err(e);
        }
        report.processes.push((t.pid, layout.lazy));
    }
    report.time = start.elapsed();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::super::work::FILL_CHUNK;
    use super::*;
    use crate::images::PAGE_SIZE;

    fn run(vaddr: u64, pages: u64, flags: u32) -> PagemapEntry {
        PagemapEntry::run(vaddr, pages, None, Some(flags))
    }

    #[test]
    fn the_layout_interleaves_present_and_lazy_runs_in_pagemap_order() {
        let p = PAGE_SIZE;
        let entries = [
            run(0x1000_0000, 2, PE_PRESENT),
            run(0x2000_0000, 3, PE_LAZY),
            run(0x3000_0000, 1, PE_PRESENT),
        ];
        let l = layout(&entries, 3 * p).unwrap();
        assert_eq!((l.lazy, l.len), (3 * p, 6 * p));
        let piece = |from, to, len| Piece { from, to, len };
        assert_eq!(
            l.pieces,
            vec![
                (Source::Pages, piece(0, 0, 2 * p)),
                (Source::Memory, piece(0x2000_0000, 2 * p, 3 * p)),
                (Source::Pages, piece(2 * p, 5 * p, p)),
            ]
        );
    }

    #[test]
    fn a_long_lazy_run_is_cut_into_pieces_of_a_fill_chunk() {
        let pages = 2 * FILL_CHUNK / PAGE_SIZE + 1;
        let l = layout(&[run(0x4000_0000, pages, PE_LAZY)], 0).unwrap();
        assert_eq!(l.lazy, pages * PAGE_SIZE);
        assert_eq!(l.pieces.len(), 3);
        let (source, second) = l.pieces[1];
        assert_eq!(
            (source, second.from),
            (Source::Memory, 0x4000_0000 + FILL_CHUNK)
        );
        assert_eq!(l.pieces[2].1.len, PAGE_SIZE);
    }

    /// A dump directory of this process: one present run (CRIU's one page of 9s) and a lazy run
    /// over `lazy` (page-aligned), as CRIU's lazy dump writes them.
    fn lazy_dump_of_self(dir: &Path, lazy: (u64, u64)) -> (u32, Vec<u8>, Vec<u8>) {
        use crate::images::{encode_image, PagemapHead};
        use prost::Message as _;
        let me = namespace_pid(std::process::id() as i32).unwrap();
        let tree = PstreeEntry {
            pid: me,
            ppid: 0,
            threads: vec![me],
        };
        fs::write(
            dir.join("pstree.img"),
            encode_image(PSTREE_MAGIC, &[tree.encode_to_vec()]),
        )
        .unwrap();
        let pm = Pagemap {
            head: PagemapHead { pages_id: 1 },
            entries: vec![
                run(0x1000, 1, PE_PRESENT),
                run(lazy.0, lazy.1 / PAGE_SIZE, PE_LAZY),
            ],
        }
        .encode();
        fs::write(image_path(dir, "pagemap", me), &pm).unwrap();
        let pages = vec![9u8; PAGE_SIZE as usize];
        fs::write(image_path(dir, "pages", 1), &pages).unwrap();
        (me, pm, pages)
    }

    #[test]
    fn a_lazy_run_is_read_from_the_process_and_every_run_is_then_present() {
        let tmp = tempfile::tempdir().unwrap();
        // Three pages of this process's heap, each of its own byte.
        let mut buf = vec![0u8; 4 * PAGE_SIZE as usize];
        let skip = buf.as_ptr().align_offset(PAGE_SIZE as usize);
        let at = buf.as_ptr() as u64 + skip as u64;
        let three = &mut buf[skip..skip + 3 * PAGE_SIZE as usize];
        for (k, page) in three.chunks_mut(PAGE_SIZE as usize).enumerate() {
            page.fill(k as u8 + 1);
        }
        let (me, _, _) = lazy_dump_of_self(tmp.path(), (at, 3 * PAGE_SIZE));
        let r = complete(tmp.path(), std::process::id() as i32, 2).unwrap();
        assert_eq!(r.processes, vec![(me, 3 * PAGE_SIZE)]);
        let pages = fs::read(image_path(tmp.path(), "pages", 1)).unwrap();
        let mut want = vec![9u8; PAGE_SIZE as usize];
        want.extend_from_slice(&buf[skip..skip + 3 * PAGE_SIZE as usize]);
        assert!(pages == want, "CRIU's page, then the three read");
        let pm = Pagemap::read(&image_path(tmp.path(), "pagemap", me)).unwrap();
        let flags: Vec<u32> = pm.entries.iter().map(|e| e.effective_flags()).collect();
        assert_eq!(flags, vec![PE_PRESENT, PE_LAZY | PE_PRESENT]);
        assert_eq!(pm.entries[1].pages(), 3);
    }

    #[test]
    fn a_lazy_run_that_cannot_be_read_fails_and_leaves_the_images_as_criu_wrote_them() {
        let tmp = tempfile::tempdir().unwrap();
        // Page 1 of the address space is never mapped (mmap_min_addr).
        let (me, pm, pages) = lazy_dump_of_self(tmp.path(), (PAGE_SIZE, PAGE_SIZE));
        let err = complete(tmp.path(), std::process::id() as i32, 2).unwrap_err();
        assert!(err.to_string().contains("memory at 0x1000"), "{err}");
        assert_eq!(fs::read(image_path(tmp.path(), "pagemap", me)).unwrap(), pm);
        assert_eq!(fs::read(image_path(tmp.path(), "pages", 1)).unwrap(), pages);
        let names: Vec<String> = fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.contains("possum-tmp")), "{names:?}");
    }

    #[test]
    fn a_pagemap_that_does_not_match_its_pages_file_or_has_a_parent_is_refused() {
        let e = [run(0x1000, 2, PE_PRESENT), run(0x9000, 1, PE_LAZY)];
        let err = layout(&e, PAGE_SIZE).unwrap_err();
        assert!(err.contains("which has 4096"), "{err}");
        let err = layout(&[run(0x1000, 1, PE_PARENT)], 0).unwrap_err();
        assert!(err.contains("parent"), "{err}");
        let err = layout(&[run(0x1000, 1, 0)], 0).unwrap_err();
        assert!(err.contains("flags 0x0"), "{err}");
    }
}
