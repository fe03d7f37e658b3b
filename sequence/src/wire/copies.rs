//! The receiver's check of its copies of the files sent ahead (part of [`super`]): from the
//! `Cut` on, each is read back and hashed piece by piece, on threads of its own, while the
//! sender hashes its side of them; a file of the final set takes one as its base only once its
//! every piece holds the bytes received for it.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::mac::Piece;
use super::session::CHUNK_BYTES;
use std::collections::HashMap;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

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
                at: p.split('/').fold(dir.to_path_buf(), |at, c| at.join(c)),
                pieces: sent[*p].1.clone(),
            })
            .collect();
        let states = copies
            .iter()
            .map(|c| State {
                left: c.pieces.len(),
                bad: None,
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

    /// Stops the check: the copies not waited for yet are not needed.
    pub(super) fn stop(&self) {
        self.shared.stop.store(true, Ordering::Relaxed);
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
        let mut buf = vec![0u8; CHUNK_BYTES];
        // The copy this worker has open, by number.
        let mut open: Option<(usize, fs::File)> = None;
        while !self.stop.load(Ordering::Relaxed) {
            let Some(&(c, k)) = self.work.get(self.next.fetch_add(1, Ordering::Relaxed)) else {
                return;
            };
            if lock(&self.states)[c].bad.is_some() {
                continue;
            }
            let copy = &self.copies[c];
            let p = copy.pieces[k];
            if open.as_ref().is_none_or(|(i, _)| *i != c) {
                open = None;
            }
            let file = match open.take() {
                Some((_, f)) => Ok(f),
                None => open_copy(&copy.at),
            };
            let data = &mut buf[..p.len as usize];
            let found = match file {
                Err(e) => Some(Unsound::Unreadable(format!("opening it: {e}"))),
                Ok(file) => {
                    let read = file.read_exact_at(data, p.offset);
                    open = Some((c, file));
                    match read {
                        Ok(()) if blake3::hash(data) == blake3::Hash::from_bytes(p.hash) => None,
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
            match found {
                None => state.left -= 1,
                Some(bad) => state.bad = state.bad.take().or(Some(bad)),
            }
            if state.left == 0 || state.bad.is_some() {
                self.changed.notify_all();
            }
        }
    }
}
