//! The receiver's check of its copies of the files sent ahead (part of [`super`]): once each
//! part ahead is written, the pieces it brought are read back and checked against the CRC32C
//! of the bytes received (a change by accident, not by an adversary: the wire's MAC is for
//! those), on threads of their own, while the job still runs at the source ([`AheadChecks`]).
//! The next part's writes do not wait for them: the pieces it writes again are not judged by
//! the checks before it. At the `Cut` a copy changed since (its length, inode or times not
//! those it had after its part was written) is read back again whole. A file of the final set
//! takes one as its base only once its every piece holds the bytes received for it.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::mac::Piece;
use std::collections::{HashMap, HashSet};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Why a copy sent ahead is not what was received of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Unsound {
    /// A piece of it holds other bytes.
    Changed {
        /// Where it begins.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// It could not be read back.
    Unreadable(String),
}

impl std::fmt::Display for Unsound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unsound::Changed { offset, len } => write!(
                f,
                "read back, its {len} bytes at offset {offset} are not those received for them: \
                 it changed here after it was written"
            ),
            Unsound::Unreadable(why) => write!(f, "it could not be read back: {why}"),
        }
    }
}

/// The copies being checked, and the threads that check them; dropped, they stop.
pub(super) struct CopyCheck {
    shared: Arc<Shared>,
    /// Each copy's number, by the path it was sent ahead under.
    by_path: HashMap<String, usize>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for CopyCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CopyCheck({} files)", self.by_path.len())
    }
}

struct Shared {
    copies: Vec<Copied>,
    /// (copy, piece), the copies in the order a sender lists them.
    work: Vec<(usize, usize)>,
    next: AtomicUsize,
    stop: AtomicBool,
    /// Each copy's state.
    states: Mutex<Vec<State>>,
    changed: Condvar,
    /// The workers still running.
    running: AtomicUsize,
}

struct Copied {
    /// Where it is (opened by the workers as they come to it: no descriptor held per file).
    at: PathBuf,
    pieces: Vec<Piece>,
}

#[derive(Clone)]
struct State {
    /// Pieces not yet found sound.
    left: usize,
    bad: Option<Unsound>,
    /// Pieces (by offset) a later part writes again: not this check's to judge (what it reads
    /// of them may be half written; the later part's own check reads them back).
    superseded: HashSet<u64>,
}

/// A worker's end, even by a panic: counted, and said to whoever waits.
struct Running<'a>(&'a Shared);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
        let _states = lock(&self.0.states);
        self.0.changed.notify_all();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl CopyCheck {
    /// Starts checking the files of `sent`, by path, under `dir`: each must hold its pieces
    /// (`(size, pieces)`, as received).
    pub(super) fn start(dir: &Path, sent: &HashMap<String, (u64, Vec<Piece>)>) -> CopyCheck {
        let mut paths: Vec<&String> = sent.keys().collect();
        // As a sender lists them: a directory's entries by name, each directory's before what
        // follows it (the order the final set's bases come in).
        paths.sort_by(|a, b| a.split('/').cmp(b.split('/')));
        let copies: Vec<Copied> = paths
            .iter()
            .map(|p| Copied {
                at: under(dir, p),
                pieces: sent[*p].1.clone(),
            })
            .collect();
        let states = copies
            .iter()
            .map(|c| State {
                left: c.pieces.len(),
                bad: None,
                superseded: HashSet::new(),
            })
            .collect();
        let work: Vec<(usize, usize)> = copies
            .iter()
            .enumerate()
            .flat_map(|(i, c)| (0..c.pieces.len()).map(move |k| (i, k)))
            .collect();
        let workers = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, 8)
            .min(work.len());
        let shared = Arc::new(Shared {
            copies,
            work,
            next: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            states: Mutex::new(states),
            changed: Condvar::new(),
            running: AtomicUsize::new(workers),
        });
        let mut started = Vec::with_capacity(workers);
        for _ in 0..workers {
            let s = Arc::clone(&shared);
            match std::thread::Builder::new()
                .name("possum-copies".into())
                .spawn(move || s.check())
            {
                Ok(w) => started.push(w),
                // One that could not start checks nothing (with none, no copy is found sound).
                Err(_) => {
                    shared.running.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
        CopyCheck {
            by_path: paths
                .into_iter()
                .enumerate()
                .map(|(i, p)| (p.clone(), i))
                .collect(),
            shared,
            workers: started,
        }
    }

    /// Waits until the copy sent ahead under `path` is found sound, or not.
    pub(super) fn wait(&self, path: &str) -> Result<(), Unsound> {
        let Some(&i) = self.by_path.get(path) else {
            return Err(Unsound::Unreadable("it was not sent ahead".into()));
        };
        let s = &self.shared;
        let mut states = lock(&s.states);
        loop {
            let state = &states[i];
            if let Some(bad) = &state.bad {
                return Err(bad.clone());
            }
            if state.left == 0 {
                return Ok(());
            }
            if s.running.load(Ordering::SeqCst) == 0 {
                return Err(Unsound::Unreadable(
                    "its check ended before it was done".into(),
                ));
            }
            states = s
                .changed
                .wait(states)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Waits until every worker ended, at most until `deadline`; stops them then (each ends at
    /// its next piece) and waits for that. Whether every piece was checked.
    fn finish_by(&self, deadline: Instant) -> bool {
        let s = &self.shared;
        let mut states = lock(&s.states);
        while s.running.load(Ordering::SeqCst) > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                s.stop.store(true, Ordering::Relaxed);
                while s.running.load(Ordering::SeqCst) > 0 {
                    states = s
                        .changed
                        .wait(states)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                break;
            }
            states = (s.changed.wait_timeout(states, left))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        states.iter().all(|st| st.left == 0 || st.bad.is_some())
    }

    /// Each copy's verdict once its workers ended ([`CopyCheck::finish_by`]): sound, not, or
    /// not checked whole (`None`).
    fn verdicts(&self) -> Vec<(String, Option<Result<(), Unsound>>)> {
        let states = lock(&self.shared.states);
        self.by_path
            .iter()
            .map(|(path, &i)| {
                let st = &states[i];
                let v = match (&st.bad, st.left) {
                    (Some(bad), _) => Some(Err(bad.clone())),
                    (None, 0) => Some(Ok(())),
                    (None, _) => None,
                };
                (path.clone(), v)
            })
            .collect()
    }

    /// Stops the check: the copies not waited for yet are not needed.
    pub(super) fn stop(&self) {
        self.shared.stop.store(true, Ordering::Relaxed);
    }

    /// The pieces at `offsets` of the copy under `path` are about to be written again (by a
    /// later part): each counts as checked, whatever a worker reads of it from now on.
    fn supersede(&self, path: &str, offsets: impl IntoIterator<Item = u64>) {
        let Some(&i) = self.by_path.get(path) else {
            return;
        };
        let s = &self.shared;
        let ours: HashSet<u64> = s.copies[i].pieces.iter().map(|p| p.offset).collect();
        let mut states = lock(&s.states);
        let state = &mut states[i];
        state
            .superseded
            .extend(offsets.into_iter().filter(|o| ours.contains(o)));
    }
}

/// The longest the `Cut` waits for the checks of the parts ahead ([`AheadChecks::settle`]):
/// the sender's writes wait meanwhile, and must not reach their deadline. What is not checked
/// by then is read back whole after the `Cut`.
const SETTLE_LIMIT: Duration = Duration::from_secs(2);

/// What a copy's metadata was when its part was written: one that differs at the `Cut` was
/// written since by someone else (this receiver takes it again after each part it writes; the
/// pieces a part writes again are not judged by the checks before it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(at: &Path) -> Option<Stamp> {
        let m = fs::symlink_metadata(at).ok()?;
        Some(Stamp {
            ino: m.ino(),
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
}

/// The `/`-separated `path` under `dir`.
fn under(dir: &Path, path: &str) -> PathBuf {
    path.split('/').fold(dir.to_path_buf(), |at, c| at.join(c))
}

/// The checks of the copies sent ahead: each part's pieces read back once the part is written
/// ([`AheadChecks::part_written`]), then at the `Cut` ([`AheadChecks::cut`]) the verdicts, and
/// a copy changed since its check began read back again whole.
#[derive(Debug, Default)]
pub(super) struct AheadChecks {
    /// The checks of the parts, running or done.
    running: Vec<CopyCheck>,
    /// Each copy's metadata when its last check began.
    stamps: HashMap<String, Stamp>,
    /// Copies found not to hold what was received for them.
    bad: HashMap<String, Unsound>,
    /// Copies whose check was stopped before it was done ([`SETTLE_LIMIT`]): read back again
    /// whole at the `Cut`.
    unchecked: HashSet<String>,
    /// From the `Cut`: the copies read back again then.
    late: Option<CopyCheck>,
}

impl AheadChecks {
    /// Waits for the checks begun, at most [`SETTLE_LIMIT`]; their verdicts kept, the copies
    /// they did not finish left to be read back after the `Cut`. At the `Cut`: the sender
    /// waits meanwhile, within its deadlines.
    pub(super) fn settle(&mut self) {
        let deadline = Instant::now() + SETTLE_LIMIT;
        // A copy is checked once every check that read some of it finished: a later part's
        // check of the pieces it brought does not vouch for the earlier pieces.
        let mut finished: HashMap<String, bool> = HashMap::new();
        for check in self.running.drain(..) {
            check.finish_by(deadline);
            for (path, verdict) in check.verdicts() {
                let done = match verdict {
                    Some(Ok(())) => true,
                    Some(Err(why)) => {
                        self.bad.entry(path.clone()).or_insert(why);
                        true
                    }
                    None => false,
                };
                *finished.entry(path).or_insert(true) &= done;
            }
        }
        for (path, done) in finished {
            if done {
                self.unchecked.remove(&path);
            } else {
                self.unchecked.insert(path);
            }
        }
    }

    /// A part ahead is about to write again the pieces `rewritten` names (by path, their
    /// offsets): the checks still running take them as checked (each part's own check reads
    /// its pieces back). The part's other bytes are new: no check reads them. So the part's
    /// writes need not wait for the checks before it.
    pub(super) fn rewriting<'a>(&self, rewritten: impl IntoIterator<Item = (&'a str, Vec<u64>)>) {
        for (path, offsets) in rewritten {
            for check in &self.running {
                check.supersede(path, offsets.iter().copied());
            }
        }
    }

    /// A part ahead is written under `root`: the pieces it brought (`part`, by path, with the
    /// file's size) are read back, from now on.
    pub(super) fn part_written(&mut self, root: &Path, part: &HashMap<String, (u64, Vec<Piece>)>) {
        for path in part.keys() {
            match Stamp::of(&under(root, path)) {
                Some(s) => self.stamps.insert(path.clone(), s),
                None => self.stamps.remove(path),
            };
        }
        self.running.push(CopyCheck::start(root, part));
    }

    /// The `Cut`, before `root` is moved aside: the checks begun are waited for; the copies of
    /// `sent` (all that was sent ahead) changed since their check began, to be read back again
    /// whole once moved ([`AheadChecks::moved_to`]).
    pub(super) fn cut(
        &mut self,
        root: &Path,
        sent: &HashMap<String, (u64, Vec<Piece>)>,
    ) -> HashMap<String, (u64, Vec<Piece>)> {
        self.settle();
        sent.iter()
            .filter(|(path, _)| !self.bad.contains_key(*path))
            .filter(|(path, _)| {
                let now = Stamp::of(&under(root, path));
                self.unchecked.contains(*path)
                    || now.is_none()
                    || now != self.stamps.get(*path).copied()
            })
            .map(|(path, v)| (path.clone(), v.clone()))
            .collect()
    }

    /// The copies `again` ([`AheadChecks::cut`]) read back under `aside`, where they were moved.
    pub(super) fn moved_to(&mut self, aside: &Path, again: &HashMap<String, (u64, Vec<Piece>)>) {
        self.late = Some(CopyCheck::start(aside, again));
    }

    /// Waits until the copy sent ahead under `path` is found sound, or not.
    pub(super) fn wait(&self, path: &str) -> Result<(), Unsound> {
        if let Some(bad) = self.bad.get(path) {
            return Err(bad.clone());
        }
        match &self.late {
            Some(late) if late.by_path.contains_key(path) => late.wait(path),
            _ => Ok(()),
        }
    }

    /// The copies not waited for yet are not needed.
    pub(super) fn stop(&self) {
        if let Some(late) = &self.late {
            late.stop();
        }
    }
}

/// Opens the copy at `at` to read it back, never through a link; one whose mode does not let
/// its owner read it (as it was sent) is given that right first: it is this receiver's, and a
/// file of the final set gets its mode again once complete.
fn open_copy(at: &Path) -> io::Result<fs::File> {
    let open = || {
        fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(at)
    };
    match open() {
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            let meta = fs::symlink_metadata(at)?;
            if !meta.is_file() {
                return Err(e);
            }
            let mode = meta.permissions().mode() | 0o400;
            fs::set_permissions(at, fs::Permissions::from_mode(mode))?;
            open()
        }
        other => other,
    }
}

impl Drop for CopyCheck {
    fn drop(&mut self) {
        self.stop();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl Shared {
    /// A worker: checks the next piece until none is left, or the check is stopped.
    fn check(&self) {
        let _running = Running(self);
        let mut buf = Vec::new();
        // The copy this worker has open, by number.
        let mut open: Option<(usize, fs::File)> = None;
        while !self.stop.load(Ordering::Relaxed) {
            let Some(&(c, k)) = self.work.get(self.next.fetch_add(1, Ordering::Relaxed)) else {
                return;
            };
            let copy = &self.copies[c];
            let p = copy.pieces[k];
            {
                let mut states = lock(&self.states);
                let state = &mut states[c];
                if state.bad.is_some() {
                    continue;
                }
                if state.superseded.contains(&p.offset) {
                    state.left -= 1;
                    if state.left == 0 {
                        self.changed.notify_all();
                    }
                    continue;
                }
            }
            if open.as_ref().is_none_or(|(i, _)| *i != c) {
                open = None;
            }
            let file = match open.take() {
                Some((_, f)) => Ok(f),
                None => open_copy(&copy.at),
            };
            // As long as the piece received: a sender's pieces may be longer than this end's.
            buf.resize(buf.len().max(p.len as usize), 0);
            let data = &mut buf[..p.len as usize];
            let found = match file {
                Err(e) => Some(Unsound::Unreadable(format!("opening it: {e}"))),
                Ok(file) => {
                    let read = file.read_exact_at(data, p.offset);
                    open = Some((c, file));
                    let sound = |data: &[u8]| match p.crc {
                        Some(crc) => crc32c::crc32c(data) == crc,
                        None => blake3::hash(data) == blake3::Hash::from_bytes(p.hash),
                    };
                    match read {
                        Ok(()) if sound(data) => None,
                        Ok(()) => Some(Unsound::Changed {
                            offset: p.offset,
                            len: p.len,
                        }),
                        Err(e) => Some(Unsound::Unreadable(format!(
                            "reading {} bytes at offset {}: {e}",
                            p.len, p.offset
                        ))),
                    }
                }
            };
            let mut states = lock(&self.states);
            let state = &mut states[c];
            // (Superseded while it was read: it was marked before its writes began, so what
            // was read may be half written, and is not judged.)
            match found {
                Some(bad) if !state.superseded.contains(&p.offset) => {
                    state.bad = state.bad.take().or(Some(bad))
                }
                _ => state.left -= 1,
            }
            if state.left == 0 || state.bad.is_some() {
                self.changed.notify_all();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `data` in pieces of `len`, as received.
    fn pieces(data: &[u8], len: usize) -> Vec<Piece> {
        (data.chunks(len).enumerate())
            .map(|(i, d)| Piece {
                offset: (i * len) as u64,
                len: d.len() as u64,
                hash: *blake3::hash(d).as_bytes(),
                crc: (i % 2 == 0).then(|| crc32c::crc32c(d)),
            })
            .collect()
    }

    /// A part's copies checked once written: at the cut only a copy changed since, or whose
    /// check did not finish, is read back again; one found unsound stays so.
    #[test]
    fn at_the_cut_only_changed_or_unfinished_copies_are_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let (a, b) = (vec![1u8; 10_000], vec![2u8; 10_000]);
        fs::write(root.join("a"), &a).unwrap();
        fs::write(root.join("b"), &b).unwrap();
        let sent: HashMap<String, (u64, Vec<Piece>)> = [("a", &a), ("b", &b)]
            .into_iter()
            .map(|(p, d)| (p.to_string(), (d.len() as u64, pieces(d, 4096))))
            .collect();
        let mut checks = AheadChecks::default();
        checks.part_written(root, &sent);
        checks.settle();
        assert!(checks.bad.is_empty() && checks.unchecked.is_empty());
        assert!(checks.cut(root, &sent).is_empty(), "nothing changed");
        // A copy whose check was stopped before it was done is read again at the cut.
        checks.unchecked.insert("b".into());
        assert_eq!(
            checks.cut(root, &sent).into_keys().collect::<Vec<_>>(),
            ["b"]
        );
        // A copy found unsound is not read again: its verdict stands.
        fs::write(root.join("a"), vec![9u8; 10_000]).unwrap();
        let mut checks2 = AheadChecks::default();
        checks2.part_written(root, &sent);
        checks2.settle();
        assert!(checks2.bad.contains_key("a"), "{:?}", checks2.bad);
        assert!(!checks2.cut(root, &sent).contains_key("a"));
        assert!(checks2.wait("a").is_err());
        assert!(checks2.wait("b").is_ok());
    }

    /// The file "a" of `len` bytes of `byte` under `root`, as sent in 4 KiB pieces.
    fn one_copy(root: &Path, byte: u8, len: usize) -> (Vec<u8>, Vec<Piece>) {
        let a = vec![byte; len];
        fs::write(root.join("a"), &a).unwrap();
        let all = pieces(&a, 4096);
        (a, all)
    }

    /// A later part writes pieces of a copy while its check still runs (the part does not wait
    /// for it): those pieces are not judged, whatever was read of them; a piece that changed
    /// and was not written again still makes the copy unsound.
    #[test]
    fn pieces_a_later_part_writes_again_are_not_judged_by_the_check_before() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // Long enough that the check is still running when the part's writes come.
        let (a, all) = one_copy(root, 1, 4096 * 4096);
        let sent = HashMap::from([("a".to_string(), (a.len() as u64, all))]);
        let rewrite = |checks: &mut AheadChecks, at: u64| {
            checks.rewriting([("a", vec![at])]);
            let f = fs::OpenOptions::new()
                .write(true)
                .open(root.join("a"))
                .unwrap();
            f.write_all_at(&[7u8; 4096], at).unwrap();
        };
        let mut checks = AheadChecks::default();
        checks.part_written(root, &sent);
        // Written again at once, while the check reads: read before or after, it is not judged.
        for k in [4000u64, 3, 4095] {
            rewrite(&mut checks, k * 4096);
        }
        checks.settle();
        assert!(checks.bad.is_empty(), "{:?}", checks.bad);
        assert!(checks.unchecked.is_empty());
        // A piece changed by someone else (not written again by a part) is found.
        fs::write(root.join("a"), &a).unwrap();
        let f = fs::OpenOptions::new()
            .write(true)
            .open(root.join("a"))
            .unwrap();
        f.write_all_at(&[9u8; 10], 5 * 4096).unwrap();
        let mut checks = AheadChecks::default();
        checks.part_written(root, &sent);
        rewrite(&mut checks, 4000 * 4096);
        checks.settle();
        assert_eq!(
            checks.bad.get("a"),
            Some(&Unsound::Changed {
                offset: 5 * 4096,
                len: 4096
            })
        );
    }

    /// A copy whose earlier check was stopped before it was done stays to be read again at the
    /// cut, even where a later part's check of the pieces it brought found them sound.
    #[test]
    fn a_later_parts_check_does_not_vouch_for_an_earlier_unfinished_one() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // Enough pieces that the check is stopped long before it could be done.
        let (a, all) = one_copy(root, 3, 16384 * 4096);
        let sent = HashMap::from([("a".to_string(), (a.len() as u64, all.clone()))]);
        let mut checks = AheadChecks::default();
        checks.part_written(root, &sent);
        checks.running[0].stop();
        let brought = HashMap::from([("a".to_string(), (a.len() as u64, all[..1].to_vec()))]);
        checks.part_written(root, &brought);
        checks.settle();
        assert!(checks.bad.is_empty(), "{:?}", checks.bad);
        assert!(checks.unchecked.contains("a"));
    }
}
