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
//! At the cut, [`rebase`] (called by the split) compares the pages CRIU dumped with the draft: a
//! page the draft holds at its address with the same bytes stays there; the others (changed
//! since the last round, or not seen: the driver's checkpoint residue is new at every hold) are
//! copied from CRIU's pages into a tail of new files in 64 MiB parts, written from every thread.
//! The draft, left as it was sent, becomes the process's data file (same inode: the wire sends
//! it as the file sent ahead, nothing of it again) and the tail's parts follow it in the data
//! (an index of version 3). Every page's bytes are compared with CRIU's, so a draft that is
//! stale, torn by a concurrent write or wrong gives the same memory: it only decides how much
//! is sent at the cut.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
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

/// The runs of pages (offset, length in bytes) where `new` differs from `old`; every page when
/// `old` is not whole (the draft ended before it).
fn differing_pages(new: &[u8], old: &[u8], whole: bool) -> Vec<(usize, usize)> {
    let page = PAGE_SIZE as usize;
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (k, (a, b)) in new.chunks(page).zip(old.chunks(page)).enumerate() {
        if whole && a == b {
            continue;
        }
        let at = k * page;
        match out.last_mut() {
            Some((o, l)) if *o + *l == at => *l += a.len(),
            _ => out.push((at, a.len())),
        }
    }
    out
}

/// Reads move `m`'s bytes from `src` into `bufs.0` and the draft's at its place into `bufs.1`:
/// whether the draft holds all of them (it may end before).
fn read_both(
    src: &File,
    draft: &File,
    m: &Move,
    bufs: &mut (Vec<u8>, Vec<u8>),
) -> io::Result<bool> {
    let len = m.len as usize;
    bufs.0.resize(len, 0);
    bufs.1.resize(len, 0);
    if !read_full(src, &mut bufs.0[..len], m.src)? {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
    }
    read_full(draft, &mut bufs.1[..len], m.dst)
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
    if m.fresh {
        bufs.0.resize(len, 0);
        if !read_full(src, &mut bufs.0[..len], m.src)? {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        draft.write_all_at(&bufs.0[..len], m.dst)?;
        return Ok(vec![(m.dst, m.len)]);
    }
    let whole = read_both(src, draft, m, bufs)?;
    let pieces = differing_pages(&bufs.0[..len], &bufs.1[..len], whole);
    for &(at, l) in &pieces {
        draft.write_all_at(&bufs.0[at..at + l], m.dst + at as u64)?;
    }
    Ok(pieces
        .into_iter()
        .map(|(at, l)| (m.dst + at as u64, l as u64))
        .collect())
}

/// Lays `moves` onto the draft from `threads` threads: the pieces written, sorted and joined
/// where they touch. A move whose source cannot be read (the job unmapped it meanwhile) leaves
/// that piece of the draft as it was.
fn lay_all(
    src: &File,
    draft: &File,
    moves: &[Move],
    threads: usize,
) -> Result<Vec<(u64, u64)>, HostMemError> {
    let written = Mutex::new(Vec::new());
    on_threads(moves, threads, Default::default, |bufs, m| {
        if let Ok(w) = lay(src, draft, m, bufs) {
            written.lock().unwrap_or_else(|e| e.into_inner()).extend(w);
        }
        Ok(())
    })?;
    let mut w = written.into_inner().unwrap_or_else(|e| e.into_inner());
    w.sort_unstable();
    let mut pieces: Vec<(u64, u64)> = Vec::with_capacity(w.len());
    for (o, l) in w {
        match pieces.last_mut() {
            Some((po, pl)) if *po + *pl == o => *pl += l,
            _ => pieces.push((o, l)),
        }
    }
    Ok(pieces)
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
        let written = lay_all(&mem, &file, &moves, threads)?;
        let meta = file.metadata().map_err(io_err(&path))?;
        if meta.len() < end {
            file.set_len(end).map_err(io_err(&path))?;
        }
        let index = Index {
            data_file: data_name(image_pid),
            data_len: end,
            part_bytes: 0,
            more: Vec::new(),
            ranges: layout,
        };
        let layout_path = dir.join(layout_name(image_pid));
        fs::write(&layout_path, index.encode()).map_err(io_err(&layout_path))?;
        report.processes.push(image_pid);
        report.written_bytes += written.iter().map(|(_, l)| l).sum::<u64>();
        report.written.push(((meta.dev(), meta.ino()), written));
    }
    report.time = start.elapsed();
    Ok(report)
}

/// A process's memory at the cut: its draft, and a tail of what the draft lacks or has wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rebased {
    /// The process's index: into the draft, then the tail's parts.
    pub index: Index,
    /// The draft, as it was sent ahead: the process's data file once moved beside its index.
    pub draft: PathBuf,
    /// Its (device, inode).
    pub inode: (u64, u64),
    /// The tail's parts, written beside the index: the pages the draft lacked or has wrong.
    pub tail: Vec<PathBuf>,
    /// Bytes of the memory the draft already held.
    pub reused_bytes: u64,
}

/// The size of each part of a tail (a multiple of [`PIECE`]).
const TAIL_PART: u64 = 64 << 20;

/// The name of part `k` of the tail of `pid`'s data.
fn tail_name(pid: u32, k: u64) -> String {
    format!("possum-hostmem-{pid}.tail.{k}")
}

/// Compares a move held by the draft with CRIU's bytes: the runs of pages that differ, as
/// (address, offset in CRIU's pages file, length).
fn differing(
    src: &File,
    draft: &File,
    m: &Move,
    bufs: &mut (Vec<u8>, Vec<u8>),
) -> io::Result<Vec<(u64, u64, u64)>> {
    let len = m.len as usize;
    let whole = read_both(src, draft, m, bufs)?;
    Ok(differing_pages(&bufs.0[..len], &bufs.1[..len], whole)
        .into_iter()
        .map(|(at, l)| (m.vaddr + at as u64, m.src + at as u64, l as u64))
        .collect())
}

/// Lays the pages of image PID `pid` that the split moves (`moved`, offsets in CRIU's pages
/// file `pages`) onto the process's draft in `ahead` (see the module's doc), the draft left as
/// it was sent: a page it holds with the same bytes stays there, the others go to a tail of
/// new files in `dir` (in parts, written from `threads` threads), after it in the data.
/// `Ok(None)`: no draft of it there.
pub fn rebase(
    ahead: &Path,
    pid: u32,
    pages: &Path,
    moved: &[Range],
    dir: &Path,
    threads: usize,
) -> Result<Option<Rebased>, HostMemError> {
    let Some(layout) = read_layout(ahead, pid)? else {
        return Ok(None);
    };
    let path = ahead.join(data_name(pid));
    let draft = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path)(e)),
    };
    let meta = draft.metadata().map_err(io_err(&path))?;
    let src = File::open(pages).map_err(io_err(pages))?;
    let runs: Vec<(u64, u64, u64)> = moved.iter().map(|r| (r.vaddr, r.len, r.offset)).collect();
    let (moves, _, _) = place(&runs, &layout.ranges, layout.data_len);
    // What of the memory the draft holds differs from CRIU's bytes.
    let changed = Mutex::new(Vec::new());
    let held: Vec<Move> = moves.iter().filter(|m| !m.fresh).copied().collect();
    on_threads(&held, threads, Default::default, |bufs, m| {
        let d = differing(&src, &draft, m, bufs).map_err(io_err(&path))?;
        changed.lock().unwrap_or_else(|e| e.into_inner()).extend(d);
        Ok(())
    })?;
    let mut to_tail = changed.into_inner().unwrap_or_else(|e| e.into_inner());
    let changed_bytes: u64 = to_tail.iter().map(|(_, _, l)| l).sum();
    to_tail.extend(
        moves
            .iter()
            .filter(|m| m.fresh)
            .map(|m| (m.vaddr, m.src, m.len)),
    );
    to_tail.sort_unstable();
    let (tail, pieces, tail_len) = tail_of(&to_tail, meta.len());
    let names: Vec<String> = (0..tail_len.div_ceil(TAIL_PART))
        .map(|k| tail_name(pid, k))
        .collect();
    let files: Vec<PathBuf> = names.iter().map(|n| dir.join(n)).collect();
    write_tail(&src, pages, &files, &pieces, threads)?;
    // The index: a held page whose bytes are the draft's stays there; the rest is the tail's.
    let mut ranges = tail;
    for m in &held {
        ranges.extend(subtract_runs(m, &to_tail));
    }
    ranges.sort_unstable_by_key(|r| r.vaddr);
    let more = (names.iter().enumerate())
        .map(|(k, n)| (n.clone(), (tail_len - k as u64 * TAIL_PART).min(TAIL_PART)))
        .collect();
    let held_bytes: u64 = held.iter().map(|m| m.len).sum();
    Ok(Some(Rebased {
        index: Index {
            data_file: data_name(pid),
            data_len: meta.len() + tail_len,
            part_bytes: 0,
            more,
            ranges: merged(ranges),
        },
        draft: path,
        inode: (meta.dev(), meta.ino()),
        tail: files,
        reused_bytes: held_bytes - changed_bytes,
    }))
}

/// The tail of `runs` (address, offset in CRIU's pages, length; sorted): the index's runs into
/// it (offsets in the data, after the draft's `base` bytes), the pieces to copy (from CRIU's
/// pages to the tail's offset, none across two parts), and its length.
fn tail_of(runs: &[(u64, u64, u64)], base: u64) -> (Vec<Range>, Vec<Move>, u64) {
    let mut ranges = Vec::new();
    let mut pieces = Vec::new();
    let mut at = 0u64;
    for &(vaddr, src, len) in runs {
        ranges.push(Range {
            vaddr,
            offset: base + at,
            len,
        });
        let mut done = 0;
        while done < len {
            let n = (len - done)
                .min(TAIL_PART - (at + done) % TAIL_PART)
                .min(PIECE);
            pieces.push(Move {
                vaddr: vaddr + done,
                src: src + done,
                dst: at + done,
                len: n,
                fresh: true,
            });
            done += n;
        }
        at += len;
    }
    (ranges, pieces, at)
}

/// Copies `pieces` (from CRIU's pages at `src` to the tail's offset `dst`) into the tail's
/// parts `files`, made new, from `threads` threads. A failure removes them.
fn write_tail(
    src: &File,
    pages: &Path,
    files: &[PathBuf],
    pieces: &[Move],
    threads: usize,
) -> Result<(), HostMemError> {
    let made = (|| {
        let mut outs = Vec::new();
        for f in files {
            outs.push(File::create_new(f).map_err(io_err(f))?);
        }
        on_threads(pieces, threads, Vec::new, |buf: &mut Vec<u8>, m| {
            let len = m.len as usize;
            buf.resize(len, 0);
            if !read_full(src, &mut buf[..len], m.src).map_err(io_err(pages))? {
                return Err(io_err(pages)(io::ErrorKind::UnexpectedEof.into()));
            }
            let k = (m.dst / TAIL_PART) as usize;
            outs[k]
                .write_all_at(&buf[..len], m.dst % TAIL_PART)
                .map_err(io_err(&files[k]))
        })
    })();
    if made.is_err() {
        for f in files {
            let _ = fs::remove_file(f);
        }
    }
    made.map(|_| ())
}

/// The pieces of move `m` (held by the draft) not among `tail`'s runs (sorted by address), as
/// runs into the draft.
fn subtract_runs(m: &Move, tail: &[(u64, u64, u64)]) -> Vec<Range> {
    let mut out = Vec::new();
    let mut cur = m.vaddr;
    let end = m.vaddr + m.len;
    let first = tail.partition_point(|&(v, _, l)| v + l <= m.vaddr);
    for &(v, _, l) in &tail[first..] {
        if v >= end {
            break;
        }
        if v > cur {
            out.push(Range {
                vaddr: cur,
                offset: m.dst + (cur - m.vaddr),
                len: v - cur,
            });
        }
        cur = cur.max(v + l);
    }
    if cur < end {
        out.push(Range {
            vaddr: cur,
            offset: m.dst + (cur - m.vaddr),
            len: end - cur,
        });
    }
    out
}

#[cfg(test)]
mod tests;
