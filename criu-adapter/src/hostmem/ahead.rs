//! The job's private memory sent ahead of its checkpoint, by content (a migration's pre-copy).
//!
//! CRIU writes a job's private memory into its image only at the cut, the job held: ~1 GB for a
//! PyTorch job, all of it sent again while the job is held. Most of it does not change from one
//! second to the next (the heap, torch's and the driver's host allocations). So while the job
//! still runs, [`draft`] reads the memory [`super::split`] would move (the present pages of the
//! plain private anonymous writable mappings) of each process into a draft of that process's
//! data file, `DIR/hostmem-ahead/possum-hostmem-PID.pages`, laid out as its layout file
//! `possum-hostmem-PID.ahead` says (an [`Index`] of the draft): each round writes only the pages
//! whose bytes changed since the round before, and appends the pages it had not seen. A
//! migration sends the drafts ahead with its GPU images.
//!
//! At the cut, [`rebase`] (called by the split) lays the pages CRIU dumped onto the draft: a
//! page the draft holds at its address is written over it only where its bytes differ, a page
//! it does not hold is appended, and the process's index then points into the draft, which
//! becomes its data file (same inode: the wire sends it as the file sent ahead, with only the
//! pieces written at the cut, [`Rebased::written`]). Every page's bytes come from CRIU's image and
//! every one is compared, so a draft that is stale, torn by a concurrent write or wrong gives
//! the same data file: it only decides how much is sent at the cut.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::index::{data_name, io_err, HostMemError, Index, Range};
use super::work::{namespace_pid, on_threads, FILL_CHUNK};
use crate::images::PAGE_SIZE;

/// The directory, in an image being made, of the drafts sent ahead.
pub const AHEAD_DIR: &str = "hostmem-ahead";

/// The largest piece one thread reads, compares and writes at a time.
const PIECE: u64 = FILL_CHUNK;

/// A draft's layout file.
fn layout_name(pid: u32) -> String {
    format!("possum-hostmem-{pid}.ahead")
}

/// Pieces of a file: (offset, length) each.
pub type Pieces = Vec<(u64, u64)>;

/// What [`draft`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraftReport {
    /// Processes drafted (image PIDs).
    pub processes: Vec<u32>,
    /// Bytes of memory read.
    pub read_bytes: u64,
    /// Bytes written into the drafts (changed or new).
    pub written_bytes: u64,
    /// Each draft's (device, inode) and the pieces of it written, sorted.
    pub written: Vec<((u64, u64), Pieces)>,
    /// Processes not drafted, and why.
    pub left: Vec<(i32, String)>,
    /// Time taken.
    pub time: Duration,
}

/// One stretch of pages to lay onto a draft: `len` bytes at `vaddr`, read from `src` in their
/// source, going to `dst` in the draft; `fresh` where the draft did not hold them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Move {
    pub vaddr: u64,
    pub src: u64,
    pub dst: u64,
    pub len: u64,
    pub fresh: bool,
}

/// Lays `runs` (address, length, offset in their source; sorted by address, disjoint) onto a
/// draft of layout `layout` (sorted by address) and `end` bytes: the moves, cut to at most
/// [`PIECE`] bytes, and the layout and length after them (what the draft held and did not get
/// again stays in it).
pub(super) fn place(
    runs: &[(u64, u64, u64)],
    layout: &[Range],
    mut end: u64,
) -> (Vec<Move>, Vec<Range>, u64) {
    let mut moves = Vec::new();
    let mut added = Vec::new();
    for &(vaddr, len, src) in runs {
        let mut cur = vaddr;
        let stop = vaddr + len;
        while cur < stop {
            // The first range of the layout ending after `cur`.
            let i = layout.partition_point(|r| r.vaddr + r.len <= cur);
            let (held, upto) = match layout.get(i) {
                Some(r) if r.vaddr <= cur => (Some(r.offset + (cur - r.vaddr)), r.vaddr + r.len),
                Some(r) => (None, r.vaddr),
                None => (None, stop),
            };
            let upto = upto.min(stop);
            let dst = match held {
                Some(d) => d,
                None => {
                    let d = end;
                    end += upto - cur;
                    added.push(Range {
                        vaddr: cur,
                        offset: d,
                        len: upto - cur,
                    });
                    d
                }
            };
            let mut at = cur;
            while at < upto {
                let n = (upto - at).min(PIECE);
                moves.push(Move {
                    vaddr: at,
                    src: src + (at - vaddr),
                    dst: dst + (at - cur),
                    len: n,
                    fresh: held.is_none(),
                });
                at += n;
            }
            cur = upto;
        }
    }
    let mut all: Vec<Range> = layout.iter().copied().chain(added).collect();
    all.sort_unstable_by_key(|r| r.vaddr);
    (moves, merged(all), end)
}

/// Adjacent ranges, contiguous in address and offset, made one.
fn merged(ranges: Vec<Range>) -> Vec<Range> {
    let mut out: Vec<Range> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(l) if l.vaddr + l.len == r.vaddr && l.offset + l.len == r.offset => l.len += r.len,
            _ => out.push(r),
        }
    }
    out
}

/// Reads `buf.len()` bytes of `f` at `at`; `Ok(false)` when it ends first.
fn read_full(f: &File, buf: &mut [u8], at: u64) -> io::Result<bool> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], at + done as u64) {
            Ok(0) => return Ok(false),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Lays one move onto the draft: its bytes read from `src`, written where they differ from the
/// draft's (a fresh move: all of them). The pieces written (offset, length in the draft).
fn lay(
    src: &File,
    draft: &File,
    m: &Move,
    bufs: &mut (Vec<u8>, Vec<u8>),
) -> io::Result<Vec<(u64, u64)>> {
    let len = m.len as usize;
    bufs.0.resize(len, 0);
    if !read_full(src, &mut bufs.0[..len], m.src)? {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
    }
    let new = &bufs.0[..len];
    if m.fresh {
        draft.write_all_at(new, m.dst)?;
        return Ok(vec![(m.dst, m.len)]);
    }
    bufs.1.resize(len, 0);
    let old_whole = read_full(draft, &mut bufs.1[..len], m.dst)?;
    let old = &bufs.1[..len];
    let page = PAGE_SIZE as usize;
    let mut written: Vec<(u64, u64)> = Vec::new();
    for (k, (a, b)) in new.chunks(page).zip(old.chunks(page)).enumerate() {
        if old_whole && a == b {
            continue;
        }
        let at = m.dst + (k * page) as u64;
        draft.write_all_at(a, at)?;
        match written.last_mut() {
            Some((o, l)) if *o + *l == at => *l += a.len() as u64,
            _ => written.push((at, a.len() as u64)),
        }
    }
    Ok(written)
}

/// Lays `moves` onto the draft from `threads` threads: the pieces written (sorted), and of them
/// the bytes of pages the draft held that changed. A source unreadable for a move (the job
/// unmapped it meanwhile) leaves that piece of the draft as it was where `skip_unreadable`,
/// and is an error otherwise.
fn lay_all(
    src: &File,
    draft: &File,
    draft_path: &Path,
    moves: &[Move],
    threads: usize,
    skip_unreadable: bool,
) -> Result<(Vec<(u64, u64)>, u64), HostMemError> {
    let written = Mutex::new(Vec::new());
    let changed = AtomicU64::new(0);
    on_threads(
        moves,
        threads,
        || (Vec::new(), Vec::new()),
        |bufs, m| match lay(src, draft, m, bufs) {
            Ok(w) => {
                if !m.fresh {
                    changed.fetch_add(w.iter().map(|(_, l)| l).sum(), Ordering::Relaxed);
                }
                written.lock().unwrap_or_else(|e| e.into_inner()).extend(w);
                Ok(())
            }
            Err(_) if skip_unreadable => Ok(()),
            Err(e) => Err(io_err(draft_path)(e)),
        },
    )?;
    let mut w = written.into_inner().unwrap_or_else(|e| e.into_inner());
    w.sort_unstable();
    let mut pieces: Vec<(u64, u64)> = Vec::with_capacity(w.len());
    for (o, l) in w {
        match pieces.last_mut() {
            Some((po, pl)) if *po + *pl == o => *pl += l,
            _ => pieces.push((o, l)),
        }
    }
    Ok((pieces, changed.into_inner()))
}

/// The address ranges of `pid`'s plain private anonymous writable mappings (what the split
/// would move: not its main stack, no file, no device, nothing shared), from `/proc/PID/maps`.
fn private_mappings(pid: i32) -> io::Result<Vec<(u64, u64)>> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let mut out = Vec::new();
    for line in maps.lines() {
        let mut f = line.split_ascii_whitespace();
        let (Some(range), Some(perms), Some(_), Some(_), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let name = f.next().unwrap_or("");
        let anonymous = name.is_empty() || name == "[heap]" || name.starts_with("[anon:");
        if perms != "rw-p" || inode != "0" || !anonymous {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
            out.push((a, b));
        }
    }
    Ok(out)
}

/// The pages of `mappings` present in memory or swapped out (`/proc/PID/pagemap`), as runs
/// (address, length).
fn present_runs(pid: i32, mappings: &[(u64, u64)]) -> io::Result<Vec<(u64, u64)>> {
    const PRESENT: u64 = 1 << 63;
    const SWAPPED: u64 = 1 << 62;
    let pagemap = File::open(format!("/proc/{pid}/pagemap"))?;
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut buf = vec![0u8; 8 << 12];
    for &(start, end) in mappings {
        let mut page = start / PAGE_SIZE;
        let last = end / PAGE_SIZE;
        while page < last {
            let n = ((last - page) as usize).min(buf.len() / 8);
            if !read_full(&pagemap, &mut buf[..n * 8], page * 8)? {
                break;
            }
            for (k, e) in buf[..n * 8].chunks_exact(8).enumerate() {
                let e = u64::from_le_bytes(e.try_into().expect("8 bytes"));
                if e & (PRESENT | SWAPPED) == 0 {
                    continue;
                }
                let at = (page + k as u64) * PAGE_SIZE;
                match runs.last_mut() {
                    Some((a, l)) if *a + *l == at => *l += PAGE_SIZE,
                    _ => runs.push((at, PAGE_SIZE)),
                }
            }
            page += n as u64;
        }
    }
    Ok(runs)
}

/// The layout of the draft of image PID `pid` in `dir`: none yet, or what its file says.
fn read_layout(dir: &Path, pid: u32) -> Result<Option<Index>, HostMemError> {
    let path = dir.join(layout_name(pid));
    match fs::read(&path) {
        Ok(b) => Index::decode(&b, &path).map(Some),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(&path)(e)),
    }
}

/// Drafts, in `dir` (made if missing), the private memory of each of `pids` (host PIDs, the
/// job's processes, running) as it is now, over the drafts of the round before. A process
/// whose memory cannot be read (gone, or not this user's to read) is left out and named.
pub fn draft(dir: &Path, pids: &[i32], threads: usize) -> Result<DraftReport, HostMemError> {
    let start = Instant::now();
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let mut report = DraftReport::default();
    for &pid in pids {
        let Some(image_pid) = namespace_pid(pid) else {
            report.left.push((pid, "it has ended".into()));
            continue;
        };
        let listed = private_mappings(pid).and_then(|m| present_runs(pid, &m));
        let mem = File::open(format!("/proc/{pid}/mem"));
        let (runs, mem) = match (listed, mem) {
            (Ok(r), Ok(m)) => (r, m),
            (Err(e), _) | (_, Err(e)) => {
                report
                    .left
                    .push((pid, format!("its memory cannot be read: {e}")));
                continue;
            }
        };
        let old = read_layout(dir, image_pid)?;
        let (layout, end) = old.map_or((Vec::new(), 0), |i| (i.ranges, i.data_len));
        let runs: Vec<(u64, u64, u64)> = runs.into_iter().map(|(a, l)| (a, l, a)).collect();
        let (moves, layout, end) = place(&runs, &layout, end);
        let path = dir.join(data_name(image_pid));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_err(&path))?;
        let (written, _) = lay_all(&mem, &file, &path, &moves, threads, true)?;
        file.set_len(end.max(file.metadata().map_err(io_err(&path))?.len()))
            .map_err(io_err(&path))?;
        let index = Index {
            data_file: data_name(image_pid),
            data_len: end,
            part_bytes: 0,
            ranges: layout,
        };
        let layout_path = dir.join(layout_name(image_pid));
        fs::write(&layout_path, index.encode()).map_err(io_err(&layout_path))?;
        report.processes.push(image_pid);
        report.read_bytes += moves.iter().map(|m| m.len).sum::<u64>();
        report.written_bytes += written.iter().map(|(_, l)| l).sum::<u64>();
        let meta = file.metadata().map_err(io_err(&path))?;
        report.written.push(((meta.dev(), meta.ino()), written));
    }
    report.time = start.elapsed();
    Ok(report)
}

/// A process's memory at the cut laid onto its draft.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rebased {
    /// The process's index, into the draft.
    pub index: Index,
    /// The draft, now the process's data file once moved beside its index.
    pub draft: PathBuf,
    /// Its (device, inode).
    pub inode: (u64, u64),
    /// The pieces of it written at the cut (offset, length), sorted.
    pub written: Vec<(u64, u64)>,
    /// Bytes of the memory the draft already held.
    pub reused_bytes: u64,
}

/// Lays the pages of image PID `pid` that the split moves (`moved`, offsets in CRIU's pages
/// file `pages`) onto the process's draft in `ahead` (see the module's doc). `Ok(None)`: no
/// draft of it there.
pub fn rebase(
    ahead: &Path,
    pid: u32,
    pages: &Path,
    moved: &[Range],
    threads: usize,
) -> Result<Option<Rebased>, HostMemError> {
    let Some(layout) = read_layout(ahead, pid)? else {
        return Ok(None);
    };
    let path = ahead.join(data_name(pid));
    let draft = match OpenOptions::new().read(true).write(true).open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path)(e)),
    };
    let src = File::open(pages).map_err(io_err(pages))?;
    let runs: Vec<(u64, u64, u64)> = moved.iter().map(|r| (r.vaddr, r.len, r.offset)).collect();
    let (moves, _, end) = place(&runs, &layout.ranges, layout.data_len);
    let (written, changed) = lay_all(&src, &draft, &path, &moves, threads, false)?;
    let meta = draft.metadata().map_err(io_err(&path))?;
    if meta.len() < end {
        draft.set_len(end).map_err(io_err(&path))?;
    }
    let mut ranges: Vec<Range> = moves
        .iter()
        .map(|m| Range {
            vaddr: m.vaddr,
            offset: m.dst,
            len: m.len,
        })
        .collect();
    ranges.sort_unstable_by_key(|r| r.vaddr);
    let data_len = end.max(meta.len());
    let held: u64 = moves.iter().filter(|m| !m.fresh).map(|m| m.len).sum();
    Ok(Some(Rebased {
        index: Index {
            data_file: data_name(pid),
            data_len,
            part_bytes: 0,
            ranges: merged(ranges),
        },
        draft: path,
        inode: (meta.dev(), meta.ino()),
        written,
        reused_bytes: held - changed,
    }))
}

#[cfg(test)]
mod tests;
