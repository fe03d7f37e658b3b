//! The job's private memory restored by possum, in parallel, instead of by CRIU's restorer.
//!
//! CRIU's restorer fills a restored process's private memory with `preadv` from one thread, one
//! 4 KiB page fault at a time (with THP `madvise` it applies the process's `MADV_HUGEPAGE` only
//! afterwards): about 2 GB/s on the H100 machines, ~550 ms for a PyTorch job's 1.1 GB, most of a
//! keeper-held restore. `process_vm_writev` from 16 threads of another process fills the same
//! memory at ~20 GB/s (a probe on the H100 machine).
//!
//! [`split`], after CRIU's dump: for each process of the tree, the pages of its plain private
//! anonymous writable mappings (heap, malloc arenas, thread stacks, the driver's checkpoint
//! residue) are taken out of CRIU's pagemap. CRIU's pagemap and a new, smaller `pages-N.img`
//! keep the rest; the original pages file stays as `possum-hostmem-PID.pages` and
//! `possum-hostmem-PID.idx` says which of its bytes go where ([`Index`], CRC32C-checked). CRIU
//! then maps those mappings empty at restore. The inventory then names possum's plugin as
//! required, so that CRIU refuses to restore the images without it.
//!
//! [`fill`], at restore, while CRIU still holds the restored process stopped (possum's CRIU
//! plugin, `RESUME_DEVICES_LATE`): writes those bytes back into the process with
//! `process_vm_writev` from several threads, before it runs an instruction. A fill that fails
//! leaves the process to be killed by the caller: it never runs with memory missing.
//!
//! Left to CRIU (never split): mappings another process of the tree has at the same addresses
//! (CRIU shares their pages copy-on-write between parent and child: splitting would unshare
//! them), grow-down stacks, locked, huge-TLB, shared, file-backed, special and plugin mappings,
//! read-only ones (`process_vm_writev` honours protections), the pages holding a thread's rseq
//! area (CRIU writes into them after its restorer ran), and any pagemap of a pre-dump chain or
//! with pages not present.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Write as _};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::images::{
    self, image_path, status, CoreEntry, MmEntry, Pagemap, PagemapEntry, PstreeEntry, VmaEntry,
    CORE_MAGIC, MM_MAGIC, PAGE_SIZE, PE_PARENT, PE_PRESENT, PSTREE_MAGIC,
};

pub use index::{data_name, index_path, part_bytes_for, HostMemError, Index, Range};
use index::{io_err, MAX_PARTS};
pub use work::{default_threads, namespace_pid};
use work::{on_threads, FILL_CHUNK};

/// The plugin name CRIU records in the inventory when possum's plugin was loaded at dump time.
pub const PLUGIN_NAME: &str = "possum";

/// The size of each part of a data file a migration sends in parts (a multiple of
/// [`FILL_CHUNK`]): the receiver writes the parts from several streams at once.
pub const MIGRATION_PART_BYTES: u64 = 64 << 20;

/// A process's pages smaller than this stay with CRIU (not worth a second file).
pub const DEFAULT_MIN_BYTES: u64 = 4 << 20;

/// Whether some process's memory in the CRIU images in `dir` was split (an index is there).
pub fn is_split(dir: &Path) -> Result<bool, HostMemError> {
    for e in fs::read_dir(dir).map_err(io_err(dir))? {
        let name = e.map_err(io_err(dir))?.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("possum-hostmem-") && name.ends_with(".idx") {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Reads `DIR/possum-hostmem-PID.idx`, if there is one. An index of one data file whose file is
/// not there but in parts is (`NAME.0`, `NAME.1`, ...: a migration's sender sends it so, for the
/// receiver to write from every stream at once) reads the parts: their size is the first's.
pub fn read_index(dir: &Path, pid: u32) -> Result<Option<Index>, HostMemError> {
    let path = index_path(dir, pid);
    let mut index = match fs::read(&path) {
        Ok(b) => Index::decode(&b, &path)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path)(e)),
    };
    if index.part_bytes == 0 && index.more.is_empty() && !dir.join(&index.data_file).exists() {
        let first = dir.join(format!("{}.0", index.data_file));
        if let Ok(m) = fs::metadata(&first) {
            let p = m.len();
            if p == 0 || !p.is_multiple_of(PAGE_SIZE) || index.data_len.div_ceil(p) > MAX_PARTS {
                return Err(HostMemError::Index {
                    path: first,
                    detail: format!("a first part of {p} bytes: not whole pages, or too small"),
                });
            }
            index.part_bytes = p;
        }
    }
    Ok(Some(index))
}

/// The data files, each in one piece, of the processes split in CRIU's image directory `dir`
/// (file names in `dir`): what a migration's sender sends in parts.
pub fn whole_data_files(dir: &Path) -> Result<Vec<String>, HostMemError> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).map_err(io_err(dir))? {
        let name = e.map_err(io_err(dir))?.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("possum-hostmem-"))
            .and_then(|n| n.strip_suffix(".idx"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some(i) = read_index(dir, pid)? {
            if i.part_bytes == 0 && i.more.is_empty() {
                out.push(i.data_file);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// How [`split`] chooses.
#[derive(Debug, Clone)]
pub struct SplitOptions {
    /// A process whose movable pages are fewer bytes than this is left to CRIU.
    pub min_bytes: u64,
    /// `None`: CRIU's pages file becomes possum's data file as it is (renamed, no copy).
    /// `Some(n)`: it is copied into parts of `n` bytes (a multiple of 8 MiB) from several threads
    /// and removed (index version 2). A migration does not: its sender cuts the one file into
    /// parts as it sends it, which [`read_index`] takes for the file.
    pub part_bytes: Option<u64>,
    /// The drafts of the processes' memory sent ahead ([`ahead::draft`]'s directory), with
    /// `part_bytes` `None`: a process with a draft there has its draft for data file, followed
    /// by a tail of the pages it lacks or has wrong ([`ahead::rebase`]).
    pub ahead: Option<PathBuf>,
}

impl Default for SplitOptions {
    fn default() -> Self {
        SplitOptions {
            min_bytes: DEFAULT_MIN_BYTES,
            part_bytes: None,
            ahead: None,
        }
    }
}

/// What [`split`] did with one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskSplit {
    /// The process (image PID).
    pub pid: u32,
    /// Bytes now restored by possum.
    pub moved_bytes: u64,
    /// Bytes left to CRIU.
    pub kept_bytes: u64,
    /// Runs in the index.
    pub ranges: usize,
    /// Its data file is its draft sent ahead (a tail of what it lacked after it).
    pub rebased: Option<RebasedFile>,
    /// Why a draft of it could not be used (its data file is CRIU's pages).
    pub ahead_error: Option<String>,
}

/// A data file that is the process's draft sent ahead ([`ahead::rebase`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebasedFile {
    /// The data file's name.
    pub data_file: String,
    /// Its (device, inode): the draft's, as it was sent ahead (unchanged at the cut).
    pub inode: (u64, u64),
    /// Bytes of the memory the draft already held.
    pub reused_bytes: u64,
}

/// What [`split`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SplitReport {
    /// Processes split.
    pub split: Vec<TaskSplit>,
    /// Processes (or, PID 0, the whole image) left alone, and why.
    pub left: Vec<(u32, String)>,
    /// Time taken.
    pub time: Duration,
}

impl SplitReport {
    /// Bytes moved over all processes.
    pub fn moved_bytes(&self) -> u64 {
        self.split.iter().map(|t| t.moved_bytes).sum()
    }
}

/// Whether possum may fill `v` itself (see the module's doc for what stays with CRIU).
fn movable_vma(v: &VmaEntry) -> bool {
    let want = status::REGULAR | status::ANON_PRIVATE;
    let special = status::STACK
        | status::VSYSCALL
        | status::VDSO
        | status::VVAR
        | status::AIORING
        | status::SHSTK
        | status::SYSVIPC
        | status::SOCKET
        | status::MEMFD
        | status::FILE_PRIVATE
        | status::FILE_SHARED
        | status::ANON_SHARED
        | status::EXT_PLUGIN
        | status::UNSUPP;
    let flags = v.flags as i32;
    v.status & want == want
        && v.status & special == 0
        && flags & libc::MAP_PRIVATE != 0
        && flags & libc::MAP_ANONYMOUS != 0
        && flags & (libc::MAP_GROWSDOWN | libc::MAP_LOCKED | libc::MAP_HUGETLB) == 0
        && v.prot & libc::PROT_WRITE as u32 != 0
        && v.end > v.start
}

/// Sorted disjoint intervals minus `holes` (sorted by start, may overlap).
fn subtract(intervals: Vec<(u64, u64)>, holes: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for (mut s, e) in intervals {
        for &(hs, he) in holes {
            if he <= s || hs >= e {
                continue;
            }
            if hs > s {
                out.push((s, hs));
            }
            s = s.max(he);
        }
        if s < e {
            out.push((s, e));
        }
    }
    out
}

/// The pagemap of one process cut along `movable` (sorted disjoint intervals): the runs CRIU
/// keeps (with their offsets in the old pages file) and the runs possum moves.
fn cut(entries: &[PagemapEntry], movable: &[(u64, u64)]) -> (Vec<(PagemapEntry, u64)>, Vec<Range>) {
    let mut kept = Vec::new();
    let mut moved: Vec<Range> = Vec::new();
    let mut src = 0u64;
    for e in entries {
        let (a, b) = (e.vaddr, e.vaddr + e.len());
        let mut cur = a;
        while cur < b {
            // The first movable interval ending after `cur`.
            let i = movable.partition_point(|&(_, end)| end <= cur);
            let (inside, end) = match movable.get(i) {
                Some(&(s, e2)) if s <= cur => (true, e2.min(b)),
                Some(&(s, _)) => (false, s.min(b)),
                None => (false, b),
            };
            let off = src + (cur - a);
            let len = end - cur;
            if inside {
                match moved.last_mut() {
                    Some(r) if r.vaddr + r.len == cur && r.offset + r.len == off => r.len += len,
                    _ => moved.push(Range {
                        vaddr: cur,
                        offset: off,
                        len,
                    }),
                }
            } else {
                let piece = PagemapEntry::run(cur, len / PAGE_SIZE, e.in_parent, e.flags);
                kept.push((piece, off));
            }
            cur = end;
        }
        src += e.len();
    }
    (kept, moved)
}

/// Splits the images in `dir` (a CRIU dump directory) so that possum restores the bulk of each
/// process's private memory itself ([`fill`]). Processes that cannot be split are left as CRIU
/// wrote them and named in the report. An error leaves the process being split as CRIU wrote it
/// (those split before it stay split: the images restore either way).
pub fn split(dir: &Path, opts: &SplitOptions) -> Result<SplitReport, HostMemError> {
    let start = Instant::now();
    let mut report = SplitReport::default();
    let tree: Vec<PstreeEntry> = images::read_messages(&dir.join("pstree.img"), PSTREE_MAGIC)?;
    let mut mms = Vec::new();
    for t in &tree {
        let path = image_path(dir, "mm", t.pid);
        if !path.exists() {
            continue; // a zombie: no memory
        }
        let mm: Vec<MmEntry> = images::read_messages(&path, MM_MAGIC)?;
        mms.push((t, mm.into_iter().next().unwrap_or_default()));
    }
    // Mappings at the same addresses in two processes: CRIU shares their pages.
    let mut seen: HashMap<(u64, u64), usize> = HashMap::new();
    for (_, mm) in &mms {
        for v in &mm.vmas {
            *seen.entry((v.start, v.end)).or_default() += 1;
        }
    }
    let mut next_pages_id = max_pages_id(dir)? + 1;
    let mut required = false;
    for (t, mm) in &mms {
        let movable: Vec<(u64, u64)> = mm
            .vmas
            .iter()
            .filter(|v| movable_vma(v) && seen[&(v.start, v.end)] == 1)
            .map(|v| (v.start, v.end))
            .collect();
        let mut holes = Vec::new();
        for &tid in &t.threads {
            let path = image_path(dir, "core", tid);
            let core: Vec<CoreEntry> = images::read_messages(&path, CORE_MAGIC)?;
            let rseq = core
                .first()
                .and_then(|c| c.thread_core.as_ref())
                .and_then(|tc| tc.rseq_entry.as_ref());
            if let Some(r) = rseq.filter(|r| r.rseq_abi_pointer != 0) {
                let s = r.rseq_abi_pointer & !(PAGE_SIZE - 1);
                let e = (r.rseq_abi_pointer + u64::from(r.rseq_abi_size.max(32)) + PAGE_SIZE - 1)
                    & !(PAGE_SIZE - 1);
                holes.push((s, e));
            }
        }
        holes.sort_unstable();
        let movable = subtract(movable, &holes);
        if movable.is_empty() {
            report
                .left
                .push((t.pid, "no mapping possum may fill".into()));
            continue;
        }
        if !required {
            // Before any memory leaves CRIU's images: a restore without possum's plugin fails.
            images::require_plugin(dir, PLUGIN_NAME)?;
            required = true;
        }
        match split_task(dir, t.pid, &movable, opts, next_pages_id)? {
            Ok(s) => {
                next_pages_id += 1;
                report.split.push(s);
            }
            Err(why) => report.left.push((t.pid, why)),
        }
    }
    report.time = start.elapsed();
    Ok(report)
}

/// The largest `N` of the `pages-N.img` in `dir`.
fn max_pages_id(dir: &Path) -> Result<u32, HostMemError> {
    let ids = images::pages_ids(dir).map_err(io_err(dir))?;
    Ok(ids.last().copied().unwrap_or(0))
}

/// Splits one process: `Ok(Err(why))` when it is left to CRIU.
fn split_task(
    dir: &Path,
    pid: u32,
    movable: &[(u64, u64)],
    opts: &SplitOptions,
    new_id: u32,
) -> Result<Result<TaskSplit, String>, HostMemError> {
    let pm_path = image_path(dir, "pagemap", pid);
    let pm = Pagemap::read(&pm_path)?;
    if let Some(e) = pm
        .entries
        .iter()
        .find(|e| e.effective_flags() & PE_PARENT != 0 || e.effective_flags() & PE_PRESENT == 0)
    {
        return Ok(Err(format!(
            "its pagemap has a run not in this image (flags {:#x} at {:#x})",
            e.effective_flags(),
            e.vaddr
        )));
    }
    let old_pages = image_path(dir, "pages", pm.head.pages_id);
    let present: u64 = pm.entries.iter().map(PagemapEntry::len).sum();
    let old_len = fs::metadata(&old_pages).map_err(io_err(&old_pages))?.len();
    if old_len != present {
        return Ok(Err(format!(
            "{} has {old_len} bytes, its pagemap {present}",
            old_pages.display()
        )));
    }
    let (kept, moved) = cut(&pm.entries, movable);
    let moved_bytes: u64 = moved.iter().map(|r| r.len).sum();
    if moved_bytes < opts.min_bytes.max(1) {
        return Ok(Err(format!(
            "{moved_bytes} bytes could be moved, fewer than {}",
            opts.min_bytes
        )));
    }
    let new_pages = image_path(dir, "pages", new_id);
    let index_file = index_path(dir, pid);
    let data = dir.join(data_name(pid));
    // Onto a draft sent ahead, where there is one: it becomes the data file. One that cannot
    // be used leaves CRIU's pages file to be the data file.
    let (rebased, ahead_error) = match (&opts.ahead, opts.part_bytes) {
        (Some(a), None) => {
            match ahead::rebase(a, pid, &old_pages, &moved, dir, default_threads()) {
                Ok(r) => (r, None),
                Err(e) => (None, Some(e.to_string())),
            }
        }
        _ => (None, None),
    };
    // Whole pieces of a fill, and never more parts than an index may name.
    let index = if let Some(r) = &rebased {
        r.index.clone()
    } else {
        Index {
            data_file: data_name(pid),
            data_len: old_len,
            part_bytes: opts.part_bytes.map_or(0, |p| {
                p.max(old_len.div_ceil(MAX_PARTS))
                    .max(FILL_CHUNK)
                    .next_multiple_of(FILL_CHUNK)
            }),
            more: Vec::new(),
            ranges: moved,
        }
    };
    let in_parts = index.part_bytes != 0;
    let parts: Vec<PathBuf> = match (in_parts, &rebased) {
        (true, _) => index.files().iter().map(|(f, _)| dir.join(f)).collect(),
        (false, Some(r)) => r.tail.clone(),
        (false, None) => Vec::new(),
    };
    let new_pm_tmp = dir.join(format!("pagemap-{pid}.img.possum-tmp"));
    let written = (|| -> Result<u64, HostMemError> {
        let src = File::open(&old_pages).map_err(io_err(&old_pages))?;
        let out = File::create_new(&new_pages).map_err(io_err(&new_pages))?;
        let kept_bytes = copy_pieces(&src, &old_pages, &out, &new_pages, &kept)?;
        out.sync_all().map_err(io_err(&new_pages))?;
        if in_parts {
            copy_into_parts(&src, &old_pages, dir, &index)?;
        }
        write_synced(&index_file, &index.encode())?;
        let new_pm = Pagemap {
            head: images::PagemapHead { pages_id: new_id },
            entries: kept.iter().map(|(e, _)| e.clone()).collect(),
        };
        write_synced(&new_pm_tmp, &new_pm.encode())?;
        Ok(kept_bytes)
    })();
    let clean = || {
        for p in [&new_pages, &index_file, &new_pm_tmp]
            .into_iter()
            .chain(&parts)
        {
            let _ = fs::remove_file(p);
        }
    };
    let kept_bytes = written.inspect_err(|_| clean())?;
    let from = match (&rebased, in_parts) {
        (_, true) => DataFrom::Parts,
        (Some(r), false) => DataFrom::Draft(&r.draft),
        (None, false) => DataFrom::CriuPages,
    };
    install(from, &old_pages, &data, &new_pm_tmp, &pm_path, clean)?;
    Ok(Ok(TaskSplit {
        pid,
        moved_bytes,
        kept_bytes,
        ranges: index.ranges.len(),
        rebased: rebased.map(|r| RebasedFile {
            data_file: index.data_file.clone(),
            inode: r.inode,
            reused_bytes: r.reused_bytes,
        }),
        ahead_error,
    }))
}

/// What becomes a process's data file.
enum DataFrom<'a> {
    /// The parts, written already.
    Parts,
    /// The draft sent ahead (its tail written already).
    Draft(&'a Path),
    /// CRIU's pages file.
    CriuPages,
}

/// Puts a split's files in place: the data file (`from`, renamed to `data`), then the new
/// pagemap over CRIU's (`pm_path`); CRIU's old pages file goes unless it is the data file. A
/// failure undoes what was done and `clean`s what the split wrote, leaving the images as CRIU
/// wrote them.
fn install(
    from: DataFrom<'_>,
    old_pages: &Path,
    data: &Path,
    new_pm_tmp: &Path,
    pm_path: &Path,
    clean: impl Fn(),
) -> Result<(), HostMemError> {
    let src = match from {
        DataFrom::Parts => None,
        DataFrom::Draft(d) => Some(d),
        DataFrom::CriuPages => Some(old_pages),
    };
    if let Some(src) = src {
        if let Err(e) = fs::rename(src, data) {
            clean();
            return Err(io_err(src)(e));
        }
    }
    if let Err(e) = fs::rename(new_pm_tmp, pm_path) {
        match from {
            DataFrom::CriuPages => drop(fs::rename(data, old_pages)),
            DataFrom::Draft(_) => drop(fs::remove_file(data)),
            DataFrom::Parts => {}
        }
        clean();
        return Err(io_err(pm_path)(e));
    }
    if !matches!(from, DataFrom::CriuPages) {
        let _ = fs::remove_file(old_pages);
    }
    Ok(())
}

/// Copies the whole of `src` (CRIU's pages file) into the parts `index` names, in pieces of
/// [`FILL_CHUNK`] taken part by part in turn, so that the threads write different files at once.
/// The parts are synced.
fn copy_into_parts(
    src: &File,
    src_path: &Path,
    dir: &Path,
    index: &Index,
) -> Result<(), HostMemError> {
    let files = index.files();
    let outs = files
        .iter()
        .map(|(name, len)| {
            let path = dir.join(name);
            let f = File::create_new(&path).map_err(io_err(&path))?;
            f.set_len(*len).map_err(io_err(&path))?;
            Ok((path, f))
        })
        .collect::<Result<Vec<_>, HostMemError>>()?;
    // Piece j of every part, then piece j + 1: `from` is the offset in `src`, `to` the part.
    let per_part = index.part_bytes.div_ceil(FILL_CHUNK);
    let mut pieces = Vec::new();
    for j in 0..per_part {
        for (k, (_, len)) in files.iter().enumerate() {
            let at = j * FILL_CHUNK;
            if at < *len {
                pieces.push(Piece {
                    from: k as u64 * index.part_bytes + at,
                    to: k as u64,
                    len: (len - at).min(FILL_CHUNK),
                });
            }
        }
    }
    on_threads(&pieces, default_threads(), Vec::new, |buf, p| {
        let (path, out) = &outs[p.to as usize];
        let to = p.from % index.part_bytes;
        // In the kernel (one copy, no bounce through this process), where it can.
        match copy_range(src, p.from, out, to, p.len) {
            Ok(()) => return Ok(()),
            Err(e) if !copy_unsupported(&e) => return Err(io_err(path)(e)),
            Err(_) => {}
        }
        buf.resize(FILL_CHUNK as usize, 0);
        let b = &mut buf[..p.len as usize];
        src.read_exact_at(b, p.from).map_err(io_err(src_path))?;
        out.write_all_at(b, to).map_err(io_err(path))
    })?;
    for (path, f) in &outs {
        f.sync_all().map_err(io_err(path))?;
    }
    Ok(())
}

/// `copy_file_range` of `len` bytes of `src` at `from` to `out` at `to`, until all are copied.
fn copy_range(src: &File, from: u64, out: &File, to: u64, len: u64) -> io::Result<()> {
    let offset =
        |v: u64| i64::try_from(v).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput));
    let (mut from, mut to) = (offset(from)?, offset(to)?);
    let mut left =
        usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    while left > 0 {
        match nix::fcntl::copy_file_range(src, Some(&mut from), out, Some(&mut to), left) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            Ok(n) => left -= n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// A `copy_file_range` the filesystems or the kernel do not offer (read and write instead).
fn copy_unsupported(e: &io::Error) -> bool {
    use nix::errno::Errno;
    [
        Errno::EXDEV,
        Errno::EINVAL,
        Errno::ENOSYS,
        Errno::EOPNOTSUPP,
    ]
    .iter()
    .any(|&n| e.raw_os_error() == Some(n as i32))
}

/// Copies the runs CRIU keeps (`(run, offset in src)`) one after another into `out`, in
/// pieces of at most [`FILL_CHUNK`] spread over a few threads (a tree's parent keeps hundreds
/// of MB its children share: 170 ms from one thread on the H100 machine). Bytes copied.
fn copy_pieces(
    src: &File,
    src_path: &Path,
    out: &File,
    out_path: &Path,
    kept: &[(PagemapEntry, u64)],
) -> Result<u64, HostMemError> {
    let mut to = 0u64;
    let runs: Vec<Piece> = kept
        .iter()
        .map(|(e, from)| {
            let run = Piece {
                from: *from,
                to,
                len: e.len(),
            };
            to += e.len();
            run
        })
        .collect();
    out.set_len(to).map_err(io_err(out_path))?;
    on_threads(
        &cut_pieces(runs),
        default_threads().min(8),
        || vec![0u8; FILL_CHUNK as usize],
        |buf, p| {
            let b = &mut buf[..p.len as usize];
            src.read_exact_at(b, p.from).map_err(io_err(src_path))?;
            out.write_all_at(b, p.to).map_err(io_err(out_path))
        },
    )?;
    Ok(to)
}

/// `len` bytes from `from` to `to` (file offsets, or a data file's offset and an address).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    from: u64,
    to: u64,
    len: u64,
}

/// `runs` cut into pieces of at most [`FILL_CHUNK`], the unit of work of [`on_threads`].
fn cut_pieces(runs: impl IntoIterator<Item = Piece>) -> Vec<Piece> {
    let mut pieces = Vec::new();
    for r in runs {
        let mut done = 0;
        while done < r.len {
            let len = (r.len - done).min(FILL_CHUNK);
            pieces.push(Piece {
                from: r.from + done,
                to: r.to + done,
                len,
            });
            done += len;
        }
    }
    pieces
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), HostMemError> {
    let mut f = File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

/// What [`fill`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FillReport {
    /// Bytes written.
    pub bytes: u64,
    /// Runs.
    pub ranges: usize,
    /// Threads used.
    pub threads: usize,
    /// Time taken.
    pub time: Duration,
}

impl FillReport {
    /// The line possum's plugin logs for it (after its prefix), which [`fills_in_log`] reads.
    pub fn log_line(&self, pid: i32) -> String {
        format!(
            "pid {pid}: host memory filled: {} bytes, {} runs, {:.1} ms, {} threads",
            self.bytes,
            self.ranges,
            self.time.as_secs_f64() * 1e3,
            self.threads
        )
    }
}

/// A fill a CRIU restore log reports: (pid, bytes, milliseconds).
pub fn fills_in_log(log: &str) -> Vec<(i32, u64, f64)> {
    log.lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once("pid ")?;
            let (pid, rest) = rest.split_once(": host memory filled: ")?;
            let (bytes, rest) = rest.split_once(" bytes, ")?;
            let (_, rest) = rest.split_once(" runs, ")?;
            let (ms, _) = rest.split_once(" ms")?;
            Some((pid.parse().ok()?, bytes.parse().ok()?, ms.parse().ok()?))
        })
        .collect()
}

/// Writes the pages [`split`] moved out of process `image_pid`'s CRIU image in `dir` into the
/// restored process `pid` (stopped: nothing of it may run before this returns). `Ok(None)`:
/// nothing was split for it.
pub fn fill(
    dir: &Path,
    image_pid: u32,
    pid: i32,
    threads: usize,
) -> Result<Option<FillReport>, HostMemError> {
    let start = Instant::now();
    let Some(index) = read_index(dir, image_pid)? else {
        return Ok(None);
    };
    // Each file of the data, mapped, once its length is checked.
    let files = index.files();
    let mut sources = Vec::new();
    for (name, want) in &files {
        let want = *want;
        let path = dir.join(name);
        let file = File::open(&path).map_err(io_err(&path))?;
        let len = file.metadata().map_err(io_err(&path))?.len();
        if len != want {
            return Err(HostMemError::Index {
                path,
                detail: format!("has {len} bytes, the index says {want} (truncated or replaced)"),
            });
        }
        sources.push(crate::mapped::MappedFile::map(&file, len).map_err(io_err(&path))?);
    }
    // A run's pieces, none across two files: `from` is the offset in the data as a whole.
    let starts: Vec<u64> = (files.iter())
        .scan(0u64, |at, (_, len)| {
            let s = *at;
            *at += len;
            Some(s)
        })
        .collect();
    let file_of = |from: u64| starts.partition_point(|&s| s <= from).saturating_sub(1);
    let ends: Vec<u64> = (files.iter().zip(&starts))
        .map(|((_, len), s)| s + len)
        .collect();
    let pieces = cut_pieces(index.ranges.iter().flat_map(|r| {
        let mut runs = Vec::new();
        let mut done = 0;
        while done < r.len {
            let from = r.offset + done;
            let len = (r.len - done).min(ends[file_of(from)].saturating_sub(from).max(1));
            runs.push(Piece {
                from,
                to: r.vaddr + done,
                len,
            });
            done += len;
        }
        runs
    }));
    // The process will not run anyway once a piece fails: the others are not started.
    let threads = on_threads(
        &pieces,
        threads,
        || (),
        |(), p| {
            let k = file_of(p.from);
            let at = p.from - starts[k];
            let src = sources[k].bytes();
            let bytes =
                src.get(at as usize..(at + p.len) as usize)
                    .ok_or_else(|| HostMemError::Index {
                        path: dir.join(&files[k].0),
                        detail: format!("{} bytes at {at} are past its end", p.len),
                    })?;
            write_remote(pid, p.to, bytes)
        },
    )?;
    Ok(Some(FillReport {
        bytes: index.bytes(),
        ranges: index.ranges.len(),
        threads,
        time: start.elapsed(),
    }))
}

/// `process_vm_writev` of `from` to `addr` in `pid`, until all is written.
fn write_remote(pid: i32, addr: u64, from: &[u8]) -> Result<(), HostMemError> {
    use nix::sys::uio::{process_vm_writev, RemoteIoVec};
    let mut done = 0usize;
    while done < from.len() {
        let local = [io::IoSlice::new(&from[done..])];
        let remote = [RemoteIoVec {
            base: addr as usize + done,
            len: from.len() - done,
        }];
        let fail = |detail: String| HostMemError::Fill {
            pid,
            addr: addr + done as u64,
            len: (from.len() - done) as u64,
            detail,
        };
        match process_vm_writev(nix::unistd::Pid::from_raw(pid), &local, &remote) {
            Ok(0) => return Err(fail("nothing written (not mapped writable there)".into())),
            Ok(n) => done += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(fail(format!("process_vm_writev: {e}"))),
        }
    }
    Ok(())
}

pub mod ahead;
mod index;
pub mod lazy;
#[cfg(test)]
mod tests;
mod work;
