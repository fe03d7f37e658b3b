//! The dump's pages relayed ([`crate::PagesBy::Relay`]): before CRIU dumps, each pages file it
//! will open (`pages-N.img`) is a pipe (a FIFO). CRIU writes pages with `splice` from the page
//! pipes its parasite filled; into a pipe, that moves references to the frozen processes' pages
//! instead of copying them into a file from CRIU's one thread (3-4 GB/s, most of its dump).
//! possum copies them into the file from several threads while CRIU goes on.
//!
//! One thread (the splicer) waits on every pipe. As bytes come, it moves them (by reference
//! again) into the pipe of an idle worker, with the offset they go to; the worker reads them
//! into the file's shared mapping ([`SharedFill`]). Each file is a temporary one beside the
//! pipe, renamed over it once CRIU has opened the pipe (its first bytes or its close), and
//! allocated in windows ahead of the bytes (`fallocate`: a full filesystem is an error here).
//! How much of it is written whole, front to back, is published ([`RelayWatch`]); its size is
//! not that while the workers fill it.
//!
//! At CRIU's `post-dump` notification every file CRIU opened is closed: [`Relay::finish`] waits
//! for the copies, cuts each file to its length and removes the pipes CRIU never opened (it
//! numbers pages files as it opens them; a file past the pipes made is CRIU's own, written as
//! usual). A file that fails (the filesystem full) still has its pipe read to its end, so CRIU
//! is never left blocked, and the dump fails. Dropped unfinished (a failed dump), the relay
//! removes its pipes and files.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, PipeReader, PipeWriter, Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{fallocate, fcntl, splice, FallocateFlags, FcntlArg, OFlag, SpliceFFlags};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::stat::Mode;

use crate::mapped::SharedFill;

/// The most a worker's pipe holds (one move of the splicer), where the system allows it.
const PIPE_WANT: usize = 8 << 20;
/// How far ahead of the bytes a file is allocated.
const WINDOW: u64 = 64 << 20;
/// What a pages file is allocated when made.
const PAGE: libc::off_t = 4096;
/// How long [`Relay::finish`] waits for the copies once CRIU closed its files.
const FINISH_WAIT: Duration = Duration::from_secs(60);

/// What went wrong in a relay.
#[derive(Debug, thiserror::Error)]
#[error("{what} ({}): {source}", path.display())]
pub struct RelayError {
    /// What was being done.
    pub what: &'static str,
    /// The file.
    pub path: PathBuf,
    /// The error.
    #[source]
    pub source: io::Error,
}

fn err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> RelayError {
    let path = path.to_path_buf();
    move |source| RelayError { what, path, source }
}

/// The files a relay writes, as it writes them: for a reader of a pages file during the dump
/// (a migration sends its parts as they are written), whose size says nothing until it ends.
#[derive(Debug, Default)]
pub struct RelayWatch {
    files: Mutex<Vec<Arc<Relayed>>>,
}

impl RelayWatch {
    /// The bytes of `name` (`pages-N.img`) written whole, front to back, while the relay still
    /// writes it; `None` for a file it does not write or has finished (its size is its length).
    pub fn whole(&self, name: &str) -> Option<u64> {
        let files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        let f = files.iter().find(|f| f.name == name)?;
        (!f.done.load(Ordering::Acquire)).then(|| f.whole.load(Ordering::Acquire))
    }

    /// The first pages file CRIU opened once the image `pagemap` (`pagemap-PID.img`) was there:
    /// the process's (CRIU makes a process's pagemap just before its pages file; a memfd's
    /// pages come before, the tree's shared memory after). Opened as the relay saw it: a
    /// memfd's file it saw only once the pagemap was made would be taken, which costs a reader
    /// bytes sent for nothing, never a wrong image.
    pub fn opened_after(&self, pagemap: &str) -> Option<String> {
        let files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        (files.iter())
            .filter_map(|f| Some((f.opened.get()?, &f.name)))
            .filter(|(o, _)| o.pagemaps.iter().any(|p| p == pagemap))
            .min_by_key(|(o, _)| o.at)
            .map(|(_, name)| name.clone())
    }

    fn add(&self, f: Arc<Relayed>) {
        self.files.lock().unwrap_or_else(|p| p.into_inner()).push(f);
    }
}

/// One file of a relay, as a [`RelayWatch`] sees it.
#[derive(Debug)]
struct Relayed {
    name: String,
    whole: AtomicU64,
    done: AtomicBool,
    opened: OnceLock<Opened>,
}

/// When CRIU opened a pipe, and the pagemap images there then.
#[derive(Debug)]
struct Opened {
    at: Instant,
    pagemaps: Vec<String>,
}

/// What a relay did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RelayReport {
    /// The pages files CRIU wrote through it, with their lengths.
    pub files: Vec<(String, u64)>,
    /// The workers that copied them.
    pub workers: usize,
    /// From the first byte CRIU wrote to the last copied.
    pub time: Duration,
}

impl RelayReport {
    /// Bytes relayed.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|(_, n)| n).sum()
    }
}

/// The relay of one dump: its pipes made, its threads waiting on them.
#[derive(Debug)]
pub struct Relay {
    dir: PathBuf,
    /// Its pipes: `pages-1.img` to `pages-{files}.img`.
    files: u32,
    stopping: Arc<AtomicBool>,
    wake: Arc<PipeWriter>,
    splicer: Option<JoinHandle<Result<RelayReport, RelayError>>>,
    /// [`Relay::finish`] ran: what is in place stays.
    finished: bool,
}

impl Relay {
    /// Makes `pages-1.img` to `pages-{files}.img` in `dir` pipes (replacing any such file of
    /// an earlier dump), and starts a splicer and `workers` workers on them. `capacity`: what
    /// one file is expected to take at most (the tree's memory; a file past it is mapped
    /// again, larger). Fails where the pipes or files cannot be made, or the filesystem
    /// cannot allocate ahead (then CRIU should write the pages itself).
    pub fn start(
        dir: &Path,
        files: u32,
        workers: usize,
        capacity: u64,
        watch: Option<Arc<RelayWatch>>,
    ) -> Result<Relay, RelayError> {
        let workers = workers.max(1);
        let files = files.max(1);
        let (wake_rx, wake_tx) = io::pipe().map_err(err("making the relay's wake pipe", dir))?;
        for end in [wake_rx.as_fd(), wake_tx.as_fd()] {
            fcntl(end.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK))
                .map_err(|e| err("making the relay's wake pipe", dir)(e.into()))?;
        }
        let mut relay = Relay {
            dir: dir.to_path_buf(),
            files: 0,
            stopping: Arc::new(AtomicBool::new(false)),
            wake: Arc::new(wake_tx),
            splicer: None,
            finished: false,
        };
        let capacity = capacity.max(WINDOW).next_multiple_of(WINDOW);
        if let Some(w) = &watch {
            // A dump run again: its files are this relay's, not the last one's.
            w.files.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
        let mut slots = Vec::new();
        for n in 1..=files {
            // (Counted before it is made: a failed start removes what it made so far.)
            relay.files = n;
            let slot = Slot::make(dir, pages_name(n), capacity)?;
            if let Some(w) = &watch {
                w.add(slot.told.clone());
            }
            slots.push(slot);
        }
        let (done_tx, done_rx) = mpsc::channel();
        let mut crew = Vec::new();
        for id in 0..workers {
            crew.push(Worker::start(id, done_tx.clone(), relay.wake.clone(), dir)?);
        }
        let splicer = Splicer {
            slots,
            crew,
            idle: (0..workers).collect(),
            done: done_rx,
            wake: wake_rx,
            stopping: relay.stopping.clone(),
            first: None,
        };
        relay.splicer = Some(
            std::thread::Builder::new()
                .name("possum-relay".into())
                .spawn(move || splicer.run())
                .map_err(err("starting the relay's splicer", dir))?,
        );
        Ok(relay)
    }

    /// Once CRIU has closed the pages files it opened (its `post-dump`): waits for every copy,
    /// puts each file in place at its length and removes the pipes CRIU did not open.
    pub fn finish(mut self) -> Result<RelayReport, RelayError> {
        let splicer = self.splicer.take().expect("a relay finishes once");
        self.finished = true;
        self.stop();
        let t = Instant::now();
        while !splicer.is_finished() {
            if t.elapsed() > FINISH_WAIT {
                // Left to its thread: a pipe still open for writing (CRIU's worker gone
                // astray) keeps it; the dump fails.
                return Err(RelayError {
                    what: "waiting for the pages CRIU wrote",
                    path: self.dir.clone(),
                    source: io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("a pages pipe still open for writing after {FINISH_WAIT:?}"),
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let report = splicer.join().unwrap_or_else(|_| {
            Err(RelayError {
                what: "relaying the pages",
                path: self.dir.clone(),
                source: io::Error::other("the relay's splicer panicked"),
            })
        });
        self.remove_pipes();
        report
    }

    fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        let _ = (&*self.wake).write(&[1]);
    }

    fn names(&self) -> impl Iterator<Item = String> {
        (1..=self.files).map(pages_name)
    }

    /// Removes what is still a pipe, and the files not put in place.
    fn remove_pipes(&self) {
        for name in self.names() {
            let path = self.dir.join(&name);
            if fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_fifo()) {
                let _ = fs::remove_file(&path);
            }
            let _ = fs::remove_file(self.dir.join(temp_name(&name)));
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if let Some(splicer) = self.splicer.take() {
            self.stop();
            // A dump that failed: CRIU's worker is gone, so every pipe it opened has ended.
            let _ = splicer.join();
        }
        // Nothing of it stays: pipes, files put in place or not.
        for name in self.names() {
            let _ = fs::remove_file(self.dir.join(&name));
            let _ = fs::remove_file(self.dir.join(temp_name(&name)));
        }
    }
}

fn pages_name(n: u32) -> String {
    format!("pages-{n}.img")
}

fn temp_name(name: &str) -> String {
    format!(".relay-{name}")
}

/// Sets a pipe's capacity to `want` where allowed, else to the system's most; returns it.
fn widen(pipe: impl AsFd, want: usize) -> usize {
    static MOST: OnceLock<Option<usize>> = OnceLock::new();
    let most = *MOST.get_or_init(|| {
        let s = fs::read_to_string("/proc/sys/fs/pipe-max-size").ok()?;
        s.trim().parse::<usize>().ok()
    });
    let fd = pipe.as_fd().as_raw_fd();
    for size in [Some(want), most.filter(|&m| m < want)]
        .into_iter()
        .flatten()
    {
        if let Ok(n) = fcntl(fd, FcntlArg::F_SETPIPE_SZ(size as libc::c_int)) {
            return n as usize;
        }
    }
    fcntl(fd, FcntlArg::F_GETPIPE_SZ).map_or(64 << 10, |n| n as usize)
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum State {
    /// CRIU has not opened the pipe.
    Waiting,
    /// Opened: bytes come.
    Open,
    /// Its writer closed it and every byte was taken.
    Ended,
    /// CRIU never opened it (the dump is over).
    Unused,
}

struct Slot {
    path: PathBuf,
    temp: PathBuf,
    fifo: File,
    file: File,
    map: Arc<SharedFill>,
    state: State,
    /// Bytes taken from the pipe.
    taken: u64,
    /// Allocated up to here.
    allocated: u64,
    /// Where the bytes handed to workers and not yet copied begin.
    flight: BTreeSet<u64>,
    /// What a watch is told.
    told: Arc<Relayed>,
    failed: Option<RelayError>,
}

impl Slot {
    fn make(dir: &Path, name: String, capacity: u64) -> Result<Slot, RelayError> {
        let path = dir.join(&name);
        let temp = dir.join(temp_name(&name));
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(err("removing an earlier dump's pages file", &path)(e))
            }
            _ => {}
        }
        nix::unistd::mkfifo(&path, Mode::from_bits_truncate(0o600))
            .map_err(|e| err("making a pages pipe", &path)(e.into()))?;
        let fifo = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .map_err(err("opening a pages pipe", &path))?;
        widen(&fifo, PIPE_WANT);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&temp)
            .map_err(err("creating a pages file", &temp))?;
        let map = SharedFill::map(&file, capacity).map_err(err("mapping a pages file", &temp))?;
        let mut slot = Slot {
            path,
            temp,
            fifo,
            file,
            map: Arc::new(map),
            state: State::Waiting,
            taken: 0,
            allocated: 0,
            flight: BTreeSet::new(),
            told: Arc::new(Relayed {
                name,
                whole: AtomicU64::new(0),
                done: AtomicBool::new(false),
                opened: OnceLock::new(),
            }),
            failed: None,
        };
        // A filesystem that cannot allocate ahead fails the start (its first page only: the
        // start is in the dump, and most pipes are never opened).
        fallocate(slot.file.as_raw_fd(), FallocateFlags::empty(), 0, PAGE)
            .map_err(|e| err("allocating a pages file", &slot.temp)(e.into()))?;
        slot.allocated = PAGE as u64;
        Ok(slot)
    }

    /// Allocates the file up to `end` and beyond by a window, mapping it again, larger, where
    /// `end` is past the mapping (the workers then hold the old one only for copies already
    /// handed out, which end before the file is cut).
    fn allocate(&mut self, end: u64) -> Result<(), RelayError> {
        if end <= self.allocated {
            return Ok(());
        }
        let fd = self.file.as_raw_fd();
        let at = self.allocated as libc::off_t;
        // (Past its first page, a file is allocated once CRIU opened it: named as the pages file.)
        let full = |e: Errno| err("allocating a pages file", &self.path)(e.into());
        // A window where there is room for one, else only what the bytes need.
        let window = end.next_multiple_of(WINDOW);
        let to = match fallocate(
            fd,
            FallocateFlags::empty(),
            at,
            (window - self.allocated) as _,
        ) {
            Ok(()) => window,
            Err(Errno::ENOSPC) => {
                let to = end.next_multiple_of(PAGE as u64);
                fallocate(fd, FallocateFlags::empty(), at, (to - self.allocated) as _)
                    .map_err(full)?;
                to
            }
            Err(e) => return Err(full(e)),
        };
        self.allocated = to;
        if to > self.map.len() {
            let cap = to.max(self.map.len() * 2);
            let map = SharedFill::map(&self.file, cap)
                .map_err(err("mapping a pages file", &self.temp))?;
            self.map = Arc::new(map);
        }
        Ok(())
    }

    /// The writer opened the pipe: the file takes the pipe's name (CRIU no longer needs it).
    /// A watch is told of it only once it is in place: a reader it names the file to finds a
    /// regular file, never the pipe.
    fn opened(&mut self) {
        self.state = State::Open;
        let at = Instant::now();
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let pagemaps = (fs::read_dir(dir).into_iter().flatten().flatten())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("pagemap-"))
            .collect();
        match fs::rename(&self.temp, &self.path) {
            Ok(()) => {
                let _ = self.told.opened.set(Opened { at, pagemaps });
            }
            Err(e) => self.fail(err("putting a pages file in place", &self.temp)(e)),
        }
    }

    fn fail(&mut self, e: RelayError) {
        if self.failed.is_none() {
            tracing::warn!(error = %e, "the dump's pages relay failed");
            self.failed = Some(e);
        }
    }

    /// Publishes the bytes written whole.
    fn publish(&self) {
        let whole = self.flight.first().copied().unwrap_or(self.taken);
        self.told.whole.store(whole, Ordering::Release);
    }

    /// Its pipe at its end, its copies over: the file cut to its length.
    fn close(&mut self) -> Result<u64, RelayError> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        self.file
            .set_len(self.taken)
            .map_err(err("cutting a pages file to its length", &self.path))?;
        self.told.done.store(true, Ordering::Release);
        Ok(self.taken)
    }
}

/// A job for a worker: `len` bytes in its pipe, for slot `slot` at `at`.
struct Job {
    slot: usize,
    map: Arc<SharedFill>,
    at: u64,
    len: usize,
}

struct Done {
    worker: usize,
    slot: usize,
    at: u64,
    result: io::Result<()>,
}

struct Worker {
    pipe: PipeWriter,
    room: usize,
    jobs: Sender<Job>,
    thread: JoinHandle<()>,
}

impl Worker {
    fn start(
        id: usize,
        done: Sender<Done>,
        wake: Arc<PipeWriter>,
        dir: &Path,
    ) -> Result<Worker, RelayError> {
        let (mut rx, tx) = io::pipe().map_err(err("making a relay worker's pipe", dir))?;
        let room = widen(&tx, PIPE_WANT);
        let (jobs, inbox) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("possum-relay-{id}"))
            .spawn(move || {
                for job in inbox {
                    let result = job.map.read_into(rx.as_fd(), job.at, job.len);
                    if result.is_err() {
                        // What the failed read left is discarded: the pipe starts clean.
                        let mut left = [0u8; 1 << 16];
                        while readable(&rx) {
                            if rx.read(&mut left).unwrap_or(0) == 0 {
                                break;
                            }
                        }
                    }
                    let _ = done.send(Done {
                        worker: id,
                        slot: job.slot,
                        at: job.at,
                        result,
                    });
                    let _ = (&*wake).write(&[1]);
                }
            })
            .map_err(err("starting a relay worker", dir))?;
        Ok(Worker {
            pipe: tx,
            room,
            jobs,
            thread,
        })
    }
}

/// Whether `fd` has bytes to read, or its writer came and went (a pipe), now.
fn readable(fd: impl AsFd) -> bool {
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n > 0)
}

struct Splicer {
    slots: Vec<Slot>,
    crew: Vec<Worker>,
    idle: Vec<usize>,
    done: Receiver<Done>,
    wake: PipeReader,
    stopping: Arc<AtomicBool>,
    first: Option<Instant>,
}

impl Splicer {
    fn run(mut self) -> Result<RelayReport, RelayError> {
        let result = self.relay();
        let workers = self.crew.len();
        for w in self.crew.drain(..) {
            drop(w.jobs);
            let _ = w.thread.join();
        }
        result?;
        let mut report = RelayReport {
            workers,
            time: self.first.map_or(Duration::ZERO, |t| t.elapsed()),
            ..Default::default()
        };
        let mut first_error = None;
        for slot in &mut self.slots {
            if slot.state != State::Ended {
                continue;
            }
            match slot.close() {
                Ok(n) => report.files.push((slot.told.name.clone(), n)),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    fn in_flight(&self) -> bool {
        self.idle.len() < self.crew.len()
    }

    fn relay(&mut self) -> Result<(), RelayError> {
        let mut devnull = None;
        loop {
            self.collect();
            let stopping = self.stopping.load(Ordering::Acquire);
            if stopping {
                for slot in &mut self.slots {
                    if slot.state == State::Waiting {
                        if readable(&slot.fifo) {
                            slot.opened();
                        } else {
                            slot.state = State::Unused;
                        }
                    }
                }
                let open = self.slots.iter().any(|s| s.state == State::Open);
                if !open && !self.in_flight() {
                    return Ok(());
                }
            }
            // The pipes with bytes to take, while a worker is free to take them.
            let listening: Vec<usize> = match self.idle.is_empty() {
                true => Vec::new(),
                false => (0..self.slots.len())
                    .filter(|&i| matches!(self.slots[i].state, State::Waiting | State::Open))
                    .collect(),
            };
            let ready = {
                let mut fds: Vec<PollFd> = (listening.iter())
                    .map(|&i| PollFd::new(self.slots[i].fifo.as_fd(), PollFlags::POLLIN))
                    .collect();
                fds.push(PollFd::new(self.wake.as_fd(), PollFlags::POLLIN));
                match poll(&mut fds, PollTimeout::NONE) {
                    Ok(_) | Err(Errno::EINTR) => {}
                    Err(e) => {
                        return Err(err("waiting on the pages pipes", &self.slots[0].path)(
                            e.into(),
                        ))
                    }
                }
                (listening.iter().zip(&fds))
                    .filter(|(_, fd)| fd.any().unwrap_or(false))
                    .map(|(&i, _)| i)
                    .collect::<Vec<usize>>()
            };
            let mut drain = [0u8; 64];
            while matches!((&self.wake).read(&mut drain), Ok(n) if n > 0) {}
            for i in ready {
                if self.slots[i].state == State::Waiting {
                    self.slots[i].opened();
                }
                if self.slots[i].failed.is_some() {
                    let null = match &devnull {
                        Some(f) => f,
                        None => devnull.insert(
                            File::create("/dev/null")
                                .map_err(err("opening", Path::new("/dev/null")))?,
                        ),
                    };
                    self.discard(i, null);
                } else {
                    self.take(i);
                }
            }
        }
    }

    /// Takes what pipe `i` holds (up to a worker's pipe) and hands it to an idle worker.
    fn take(&mut self, i: usize) {
        let Some(&w) = self.idle.last() else { return };
        let worker = &self.crew[w];
        let slot = &mut self.slots[i];
        let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
        match splice(&slot.fifo, None, &worker.pipe, None, worker.room, flags) {
            Ok(0) => slot.state = State::Ended,
            Ok(n) => {
                self.first.get_or_insert_with(Instant::now);
                let at = slot.taken;
                slot.taken += n as u64;
                if let Err(e) = slot.allocate(slot.taken) {
                    slot.fail(e);
                }
                self.idle.pop();
                slot.flight.insert(at);
                let job = Job {
                    slot: i,
                    map: slot.map.clone(),
                    at,
                    len: n,
                };
                // A failed slot's bytes are still read out of the worker's pipe, into the
                // mapping where it has room, else discarded by the worker's error path.
                let _ = worker.jobs.send(job);
            }
            Err(Errno::EAGAIN) | Err(Errno::EINTR) => {}
            Err(e) => {
                let e = err("taking the pages CRIU wrote", &slot.path)(e.into());
                slot.fail(e);
            }
        }
    }

    /// A failed file's pipe, read to its end into nothing, so CRIU never blocks on it.
    fn discard(&mut self, i: usize, null: &File) {
        let slot = &mut self.slots[i];
        match splice(
            &slot.fifo,
            None,
            null,
            None,
            1 << 20,
            SpliceFFlags::SPLICE_F_NONBLOCK,
        ) {
            Ok(0) => slot.state = State::Ended,
            Ok(n) => slot.taken += n as u64,
            Err(Errno::EAGAIN) | Err(Errno::EINTR) => {}
            Err(_) => slot.state = State::Ended,
        }
    }

    /// The copies the workers finished.
    fn collect(&mut self) {
        loop {
            // Blocks while every worker is busy and nothing else can move.
            let next = match self.idle.is_empty() {
                true => self.done.recv().ok(),
                false => self.done.try_recv().ok(),
            };
            let Some(d) = next else { return };
            self.idle.push(d.worker);
            let slot = &mut self.slots[d.slot];
            slot.flight.remove(&d.at);
            if let Err(e) = d.result {
                slot.fail(err("copying the pages CRIU wrote", &slot.path)(e));
            }
            slot.publish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(w: &RelayWatch, name: &str) -> bool {
        let files = w.files.lock().unwrap();
        (files.iter()).any(|f| f.name == name && f.opened.get().is_some())
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 4093) as u8).collect()
    }

    /// What a writer puts into one of the pipes, in pieces of uneven sizes, lands in that file
    /// whole and in order, copied by several workers; the file takes the pipe's name (before a
    /// watch tells of it), the pipes nobody opened are gone, and a watch named the file the
    /// first opened after its pagemap.
    #[test]
    fn what_is_written_into_a_pipe_lands_in_its_file_and_unopened_pipes_go() {
        let d = tempfile::tempdir().unwrap();
        // A memfd's pages file, written before the process's pagemap.
        let watch = Arc::new(RelayWatch::default());
        let relay = Relay::start(d.path(), 3, 4, 1 << 20, Some(watch.clone())).unwrap();
        for n in 1..=3 {
            let m = fs::symlink_metadata(d.path().join(format!("pages-{n}.img"))).unwrap();
            assert!(
                m.file_type().is_fifo(),
                "pages-{n}.img: a pipe before the dump"
            );
        }
        let memfd = pattern(3000);
        let data = pattern(9 << 20);
        let dir = d.path().to_path_buf();
        let (a, b, w) = (memfd.clone(), data.clone(), watch.clone());
        let writer = std::thread::spawn(move || {
            let mut f = File::options()
                .write(true)
                .open(dir.join("pages-1.img"))
                .unwrap();
            f.write_all(&a).unwrap();
            drop(f);
            // (CRIU makes the pagemap long after the relay saw a memfd's file opened; here, once
            // it did.)
            while !seen(&w, "pages-1.img") {
                std::thread::yield_now();
            }
            // Told of only once in place: a reader finds the file, not the pipe.
            let m = fs::symlink_metadata(dir.join("pages-1.img")).unwrap();
            assert!(m.is_file(), "pages-1.img named while still a pipe");
            fs::write(dir.join("pagemap-7.img"), b"").unwrap();
            let mut f = File::options()
                .write(true)
                .open(dir.join("pages-2.img"))
                .unwrap();
            let mut at = 0;
            for step in [1, 4096, 100_000, 3 << 20, 17].iter().cycle() {
                if at == b.len() {
                    break;
                }
                let end = (at + step).min(b.len());
                f.write_all(&b[at..end]).unwrap();
                at = end;
            }
        });
        writer.join().unwrap();
        assert_eq!(
            watch.opened_after("pagemap-7.img").as_deref(),
            Some("pages-2.img")
        );
        let report = relay.finish().unwrap();
        let mut files = report.files.clone();
        files.sort();
        assert_eq!(
            files,
            [
                ("pages-1.img".to_string(), memfd.len() as u64),
                ("pages-2.img".to_string(), data.len() as u64)
            ]
        );
        assert_eq!(report.workers, 4);
        assert_eq!(fs::read(d.path().join("pages-1.img")).unwrap(), memfd);
        assert_eq!(fs::read(d.path().join("pages-2.img")).unwrap(), data);
        assert_eq!(
            watch.whole("pages-2.img"),
            None,
            "done: its size is its length"
        );
        let mut names: Vec<String> = (fs::read_dir(d.path()).unwrap().flatten())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["pagemap-7.img", "pages-1.img", "pages-2.img"]);
    }

    /// A dump run again: the watch tells of the new relay's files only.
    #[test]
    fn a_watch_tells_of_the_last_relay_only() {
        let d = tempfile::tempdir().unwrap();
        let watch = Arc::new(RelayWatch::default());
        let first = Relay::start(d.path(), 1, 1, 1 << 20, Some(watch.clone())).unwrap();
        let told = watch.files.lock().unwrap()[0].clone();
        told.whole.store(5 << 20, Ordering::Release);
        drop(first);
        assert_eq!(watch.whole("pages-1.img"), Some(5 << 20));
        let _again = Relay::start(d.path(), 1, 1, 1 << 20, Some(watch.clone())).unwrap();
        assert_eq!(
            watch.whole("pages-1.img"),
            Some(0),
            "the new file, nothing whole yet"
        );
    }

    /// A relay dropped unfinished (a dump that failed) leaves nothing of its own behind.
    #[test]
    fn a_relay_dropped_unfinished_leaves_nothing() {
        let d = tempfile::tempdir().unwrap();
        let relay = Relay::start(d.path(), 2, 2, 1 << 20, None).unwrap();
        let mut f = File::options()
            .write(true)
            .open(d.path().join("pages-1.img"))
            .unwrap();
        f.write_all(&pattern(1 << 20)).unwrap();
        drop(f);
        drop(relay);
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 0);
    }
}
