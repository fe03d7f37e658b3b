//! Spare image memory: a file on the images' filesystem, its pages faulted in
//! and registered with CUDA *before* a checkpoint, so that a drain's copies land in the image's
//! pages at the copy engine's speed (55 GB/s on the H100) instead of going through pinned staging
//! and a write (each byte crossing host memory a third time, and the kernel zeroing new pages:
//! 26-30 GB/s). The keeper holds it because it is never checkpointed: memory registered in the
//! job would be in CRIU's dump and the driver's.
//!
//! Off unless `POSSUM_KEEPER_SPARE_DIR` names a directory and `POSSUM_KEEPER_SPARE_MIB` a size.
//! One spare at a time: made in the background once the device is open and again after each
//! drain took the last one, registered a step (1 GiB) at a time and only while the keeper is
//! quiet (no memory retained, no spare lent, no stage loading: `Inner::wait_until_quiet`), since
//! each registration holds the driver against the job's own memory calls. A drain takes it
//! (`spare_take`, refused unless the image directory is on the spare's filesystem, so that the
//! file can be renamed into the image), has the keeper copy the job's memory into it (`spare_fill`: the job's own allocations only, each piece
//! checksummed while it is still in the cache, on a pool of fill threads shared by every fill so
//! that fills asked at once queue with no gap) and gives it back (`spare_end`): the keeper
//! unregisters and unmaps it in the background, and the file is the image's (renamed by the
//! job) or gone (an abandoned image takes it with it).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use possum_cuda::share::{OwnedMapping, RegisteredFile, ShareDevice};
use possum_engine::device::DeviceError;
use thiserror::Error;

use crate::SpareLease;

/// Why a spare could not be made.
#[derive(Debug, Error)]
pub(crate) enum MakeError {
    /// The keeper's device did not open.
    #[error(transparent)]
    Device(#[from] crate::KeeperError),
    /// No thread to make it on.
    #[error("no thread to make it: {0}")]
    Thread(std::io::Error),
    /// Its file could not be created, sized or looked at.
    #[error("{}: {what}: {source}", path.display())]
    File {
        /// The spare's file.
        path: PathBuf,
        /// What was being done (create, size, stat).
        what: &'static str,
        /// The system's error.
        source: std::io::Error,
    },
    /// Its file could not be mapped and registered with the driver.
    #[error("{}: map and register: {source}", path.display())]
    Register {
        /// The spare's file.
        path: PathBuf,
        /// The driver's (or the system's) answer.
        source: DeviceError,
    },
}

/// Why no spare is lent to a drain, or none is found lent.
#[derive(Debug, Error)]
pub(crate) enum LendError {
    /// The image directory could not be looked at.
    #[error("{}: {source}", dir.display())]
    ImageDir {
        /// The image directory.
        dir: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// The spare is on another filesystem than the image.
    #[error("the spare ({}) is on another filesystem than {}", spare.display(), dir.display())]
    OtherFilesystem {
        /// The spare's file.
        spare: PathBuf,
        /// The image directory.
        dir: PathBuf,
    },
    /// The spare is still being made.
    #[error("the spare is still being made")]
    BeingMade,
    /// None could be made (why).
    #[error("no spare: {0}")]
    Failed(String),
    /// None is configured or was made.
    #[error("no spare")]
    None,
    /// The drain has none lent.
    #[error("no spare is lent to drain {0}")]
    NotLent(u64),
}

/// Why a fill of a spare failed.
#[derive(Debug, Error)]
pub(crate) enum FillError {
    /// A fill asked in pieces of 0 bytes.
    #[error("pieces of 0 bytes")]
    ZeroPieces,
    /// The fill threads could not be started.
    #[error(transparent)]
    Pool(#[from] Arc<PoolError>),
    /// The fill threads are gone.
    #[error("the fill threads are gone")]
    ThreadsGone,
    /// A piece was left uncopied.
    #[error("a piece was not copied")]
    NotCopied,
    /// A piece's copy failed.
    #[error(transparent)]
    Copy(#[from] DeviceError),
}

/// Why the fill threads could not be started.
#[derive(Debug, Error)]
pub(crate) enum PoolError {
    /// The device gave no stream for one.
    #[error("no stream for the fill threads: {0}")]
    NoStream(DeviceError),
    /// The system gave no thread.
    #[error("no fill thread: {0}")]
    NoThread(std::io::Error),
}

/// Where and how large spares are made, from the keeper's environment.
#[derive(Debug, Clone)]
pub(crate) struct SpareConfig {
    pub dir: PathBuf,
    pub bytes: u64,
    /// Registered this much at a time (`POSSUM_KEEPER_SPARE_STEP_MIB`, default 1024).
    pub step: u64,
    /// Threads copying into spares (`POSSUM_KEEPER_SPARE_THREADS`, default 16: the copy engine
    /// and the checksums overlap; 16 threads reached 53.7 GB/s on an H100).
    pub threads: usize,
}

impl SpareConfig {
    /// The spare `config` asks for, if any ([`crate::config`]).
    pub(crate) fn from_config(config: &crate::config::Config) -> Option<SpareConfig> {
        let (dir, bytes) = config.spare.clone()?;
        Some(SpareConfig {
            dir,
            bytes,
            step: config.spare_step_bytes,
            threads: config.spare_threads,
        })
    }
}

/// A spare, ready or lent.
pub(crate) struct Spare {
    path: PathBuf,
    /// The filesystem it is on (`st_dev`).
    dev: u64,
    reg: RegisteredFile,
}

impl Drop for Spare {
    /// A spare no drain took (the keeper ending, a drain's image abandoned) is removed; one an
    /// image took was renamed away from `path` first.
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Removes the spare files in `dir` of keepers that are gone (a keeper SIGKILLed leaves its
/// spare behind, holding memory on a tmpfs).
fn remove_stale(dir: &Path) {
    possum_control::remove_files_of_gone_processes(
        dir,
        |name| {
            let rest = name.strip_prefix(".possum-spare-")?;
            rest.split('-').next()?.parse().ok()
        },
        |pid| pid != std::process::id() && !crate::process::alive(pid as i32),
    );
}

#[derive(Default)]
struct State {
    ready: Option<Spare>,
    /// One is being made.
    making: bool,
    /// Why the last one could not be made.
    error: Option<String>,
    /// Lent spares by drain, with the process that took each.
    lent: BTreeMap<u64, (i32, Arc<Spare>)>,
    next: u64,
}

/// The keeper's spares.
pub(crate) struct Spares {
    cfg: SpareConfig,
    state: Mutex<State>,
    /// The threads filling spares, started by the first fill.
    pool: OnceLock<Result<FillPool, Arc<PoolError>>>,
}

impl std::fmt::Debug for Spares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spares").field("cfg", &self.cfg).finish()
    }
}

impl Spares {
    pub(crate) fn new(cfg: SpareConfig) -> Spares {
        Spares {
            cfg,
            state: Mutex::new(State::default()),
            pool: OnceLock::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a spare should be made now (none ready nor being made); if so, it counts as
    /// being made until [`Spares::made`].
    pub(crate) fn should_make(&self) -> bool {
        let mut st = self.lock();
        if st.ready.is_some() || st.making {
            return false;
        }
        st.making = true;
        true
    }

    /// What making one gave (said on stderr: `spare image memory ready` or why not; never a
    /// panic where no one reads the keeper's stderr any more).
    pub(crate) fn made(&self, r: Result<Spare, MakeError>, took: std::time::Duration) {
        let said = match &r {
            Ok(s) => format!(
                "spare image memory ready: {} ({} MiB, {} ms)",
                s.path.display(),
                s.reg.len() >> 20,
                took.as_millis()
            ),
            Err(e) => format!("no spare image memory: {e}"),
        };
        // Said before it is published: whoever sees it ready may also find it said.
        crate::notes::say(&said);
        let mut st = self.lock();
        st.making = false;
        match r {
            Ok(s) => (st.ready, st.error) = (Some(s), None),
            Err(e) => st.error = Some(e.to_string()),
        }
    }

    /// Makes one on `dev` (slow: the file's pages are faulted in and registered), a step at a
    /// time, calling `before_step` before each (the keeper waits there while a job it serves is
    /// being checkpointed, restored or drained, not to slow them).
    pub(crate) fn make(
        &self,
        dev: &ShareDevice,
        before_step: impl FnMut(),
    ) -> Result<Spare, MakeError> {
        let n = {
            let mut st = self.lock();
            st.next += 1;
            st.next
        };
        remove_stale(&self.cfg.dir);
        let path = self
            .cfg
            .dir
            .join(format!(".possum-spare-{}-{n}", std::process::id()));
        let fail = |what, source| MakeError::File {
            path: path.clone(),
            what,
            source,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| fail("create", e))?;
        let made = file
            .set_len(self.cfg.bytes)
            .map_err(|e| fail("size", e))
            .and_then(|()| file.metadata().map_err(|e| fail("stat", e)))
            .and_then(|m| {
                dev.register_file(&file, self.cfg.bytes, self.cfg.step, before_step)
                    .map(|reg| (m.dev(), reg))
                    .map_err(|source| MakeError::Register {
                        path: path.clone(),
                        source,
                    })
            });
        match made {
            Ok((fs_dev, reg)) => Ok(Spare {
                path,
                dev: fs_dev,
                reg,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Lends the ready spare to a drain of process `pid` into `image_dir`'s filesystem.
    pub(crate) fn take(&self, image_dir: &Path, pid: i32) -> Result<SpareLease, LendError> {
        let fs_dev = std::fs::metadata(image_dir)
            .map_err(|source| LendError::ImageDir {
                dir: image_dir.to_path_buf(),
                source,
            })?
            .dev();
        let mut st = self.lock();
        let Some(s) = st.ready.take_if(|s| s.dev == fs_dev) else {
            return Err(match (&st.ready, &st.error, st.making) {
                (Some(s), _, _) => LendError::OtherFilesystem {
                    spare: s.path.clone(),
                    dir: image_dir.to_path_buf(),
                },
                (None, _, true) => LendError::BeingMade,
                (None, Some(e), false) => LendError::Failed(e.clone()),
                (None, None, false) => LendError::None,
            });
        };
        st.next += 1;
        let drain = st.next;
        let lease = SpareLease {
            drain,
            path: s.path.display().to_string(),
            len: s.reg.len(),
        };
        st.lent.insert(drain, (pid, Arc::new(s)));
        Ok(lease)
    }

    /// The spare lent to `drain` of process `pid`.
    pub(crate) fn lent(&self, drain: u64, pid: i32) -> Result<Arc<Spare>, LendError> {
        match self.lock().lent.get(&drain) {
            Some((p, s)) if *p == pid => Ok(Arc::clone(s)),
            _ => Err(LendError::NotLent(drain)),
        }
    }

    /// Ends `drain`'s loan (process `pid`'s): the spare, unregistered and unmapped once the
    /// caller and every fill let go of it (slow: the caller drops it off the reply's path).
    pub(crate) fn end(&self, drain: u64, pid: i32) -> Option<Arc<Spare>> {
        let mut st = self.lock();
        match st.lent.get(&drain) {
            Some((p, _)) if *p == pid => st.lent.remove(&drain).map(|(_, s)| s),
            _ => None,
        }
    }

    /// Whether a drain has a spare now.
    pub(crate) fn any_lent(&self) -> bool {
        !self.lock().lent.is_empty()
    }

    /// What `stats` shows.
    pub(crate) fn stats(&self) -> crate::SpareStats {
        let st = self.lock();
        crate::SpareStats {
            dir: self.cfg.dir.display().to_string(),
            bytes: self.cfg.bytes,
            ready: st.ready.is_some(),
            lent: st.lent.len() as u64,
            error: st.error.clone(),
        }
    }

    /// Ends the loans of processes that are gone (a job that died while draining): how many.
    pub(crate) fn end_gone(&self) -> usize {
        let mut st = self.lock();
        let before = st.lent.len();
        st.lent.retain(|_, (pid, _)| crate::process::alive(*pid));
        before - st.lent.len()
    }
    /// Copies `fill.len` bytes of `src` from `fill.offset` into `spare` at `fill.at`, `fill.piece`
    /// bytes at a time, on the keeper's fill threads (the pieces of fills asked at once queue
    /// behind each other: the copy engine never waits for one fill's last piece): each piece's
    /// CRC32C, in order.
    pub(crate) fn fill(
        &self,
        dev: &ShareDevice,
        spare: &Arc<Spare>,
        src: &Arc<OwnedMapping>,
        fill: &crate::SpareFill,
    ) -> Result<Vec<u32>, FillError> {
        let crate::SpareFill {
            offset,
            len,
            at,
            piece,
            ..
        } = *fill;
        if piece == 0 {
            return Err(FillError::ZeroPieces);
        }
        let pool = self
            .pool
            .get_or_init(|| FillPool::start(dev, self.cfg.threads))
            .as_ref()
            .map_err(Arc::clone)?;
        let n = len.div_ceil(piece) as usize;
        let done = Arc::new(Pieces {
            progress: Mutex::new(Progress {
                crcs: (0..n).map(|_| None).collect(),
                left: n,
            }),
            cv: Condvar::new(),
        });
        for index in 0..n {
            let off = index as u64 * piece;
            let p = Piece {
                spare: Arc::clone(spare),
                src: Arc::clone(src),
                src_offset: offset + off,
                at: at + off,
                len: piece.min(len - off) as usize,
                index,
                done: Arc::clone(&done),
            };
            if pool.tx.send(p).is_err() {
                // No thread takes it: settle this one and the rest as failed.
                for i in index..n {
                    done.settle(i, Err(FillError::ThreadsGone));
                }
                break;
            }
        }
        let mut st = done.progress.lock().unwrap_or_else(|p| p.into_inner());
        while st.left > 0 {
            st = done.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        std::mem::take(&mut st.crcs)
            .into_iter()
            .map(|c| c.unwrap_or(Err(FillError::NotCopied)))
            .collect()
    }
}

/// One piece of a fill, for a fill thread.
struct Piece {
    spare: Arc<Spare>,
    src: Arc<OwnedMapping>,
    src_offset: u64,
    at: u64,
    len: usize,
    index: usize,
    done: Arc<Pieces>,
}

/// A fill's pieces as the fill threads settle them.
struct Pieces {
    progress: Mutex<Progress>,
    cv: Condvar,
}

struct Progress {
    /// Each piece's checksum, or why it has none; `None` while it is being copied.
    crcs: Vec<Option<Result<u32, FillError>>>,
    /// Pieces not settled yet.
    left: usize,
}

impl Pieces {
    fn settle(&self, index: usize, r: Result<u32, FillError>) {
        let mut st = self.progress.lock().unwrap_or_else(|p| p.into_inner());
        st.crcs[index] = Some(r);
        st.left -= 1;
        if st.left == 0 {
            self.cv.notify_all();
        }
    }
}

/// The keeper's fill threads, each with a stream of its own (their copies queue beside each
/// other's on the copy engine); they end when the pool is dropped.
struct FillPool {
    tx: crossbeam_channel::Sender<Piece>,
}

impl FillPool {
    fn start(dev: &ShareDevice, threads: usize) -> Result<FillPool, Arc<PoolError>> {
        let (tx, rx) = crossbeam_channel::unbounded::<Piece>();
        for i in 0..threads.max(1) {
            let stream = dev.stream().map_err(|e| Arc::new(PoolError::NoStream(e)))?;
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("possum-keeper-fill-{i}"))
                .spawn(move || {
                    for p in rx {
                        let r = p
                            .spare
                            .reg
                            .fill(&stream, p.at, &p.src, p.src_offset, p.len, crc32c::crc32c)
                            .map_err(FillError::Copy);
                        p.done.settle(p.index, r);
                    }
                })
                .map_err(|e| Arc::new(PoolError::NoThread(e)))?;
        }
        Ok(FillPool { tx })
    }
}
