//! CRIU's dump: its options, what possum does at its `post-dump` notification (the relay's
//! copies, a lazy dump's read, the stop), and a dump made ready ahead of its start
//! ([`PreparedDump`]): its `criu swrk` worker started and waiting for the request, the relay's
//! pipes in place, while the job's GPU side is still being checkpointed, so that CRIU begins the
//! moment the request is sent.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::page_server::PageServer;
use crate::rpc::{self, CriuOpts, ReqType};
use crate::{
    check_log_name, dir_bytes, hostmem, open_images_dir, process, read_stats, relay, request,
    stats, swrk, Criu, CriuError, DumpOptions, DumpReport, PagesBy, Scope,
};

impl Criu {
    /// Dumps the tree rooted at `opts.pid` into `opts.images_dir`. Fails early with
    /// [`CriuError::NoSuchProcess`] or [`CriuError::Zombie`] when there is nothing to dump, and
    /// with [`CriuError::DeadlineExceeded`] when CRIU runs past `opts.deadline` (scaled by the
    /// tree's resident memory).
    pub fn dump(&self, opts: &DumpOptions) -> Result<DumpReport, CriuError> {
        self.prepare_dump(opts.clone())?.run()
    }

    /// Makes the dump of `opts` ready without starting it: the tree checked to be there, the
    /// images directory opened, the relay's pipes made ([`PagesBy::Relay`]) or the lazy dump's
    /// page server ([`PagesBy::Possum`]), and a `criu swrk` worker started, which waits for the
    /// request. Nothing of the tree is touched. [`PreparedDump::run`] dumps; dropped unrun, the
    /// worker is ended and the relay's pipes go.
    pub fn prepare_dump(&self, opts: DumpOptions) -> Result<PreparedDump, CriuError> {
        let t = Instant::now();
        check_log_name(&opts.log_file)?;
        process::check_alive(opts.pid)?;
        let images = open_images_dir(&opts.images_dir, true)?;
        let server = match opts.pages {
            PagesBy::Possum => Some(PageServer::new()?),
            PagesBy::Criu | PagesBy::Relay => None,
        };
        let relay = match opts.pages {
            PagesBy::Relay => start_relay(&opts),
            PagesBy::Criu | PagesBy::Possum => None,
        };
        // How long the worker is left to finish should this process die during the dump,
        // counted from now: for the tree's memory now, and as long again for what may be added
        // to it before the request (a driver's checkpoint moves the job's GPU residue into it).
        let limit = opts
            .deadline
            .for_bytes(process::tree_resident_bytes(opts.pid));
        let inherit = server.as_ref().map(PageServer::inherit);
        let worker = self.spawn_worker(
            "dump",
            inherit.as_ref().map_or(&[], |fds| &fds[..]),
            swrk::OnOwnerDeath::FinishesBy(Instant::now() + limit.saturating_mul(2)),
        )?;
        Ok(PreparedDump {
            opts,
            images,
            server,
            relay,
            worker: Some(worker),
            took: t.elapsed(),
        })
    }
}

/// A dump made ready ([`Criu::prepare_dump`]), its worker waiting for the request.
#[derive(Debug)]
pub struct PreparedDump {
    opts: DumpOptions,
    images: File,
    server: Option<PageServer>,
    relay: Option<relay::Relay>,
    /// Taken by [`PreparedDump::run`]; one still here when it is dropped is ended.
    worker: Option<swrk::Worker>,
    took: Duration,
}

impl PreparedDump {
    /// How long making it ready took.
    pub fn took(&self) -> Duration {
        self.took
    }

    /// The PID of its worker's guard, this process's child while the worker waits.
    pub fn worker_pid(&self) -> Option<i32> {
        self.worker.as_ref().map(swrk::Worker::pid)
    }

    /// Dumps: the request sent to the waiting worker, the `post-dump` work done at its
    /// notification, the answer checked, the worker waited for. Its report's times count from
    /// here.
    pub fn run(mut self) -> Result<DumpReport, CriuError> {
        let start = Instant::now();
        // (A tree gone since it was made ready: the worker, still unasked, is ended on drop.)
        process::check_alive(self.opts.pid)?;
        let worker = self.worker.take().expect("taken only here");
        let opts = &self.opts;
        let log = opts.images_dir.join(&opts.log_file);
        let limit = opts
            .deadline
            .for_bytes(process::tree_resident_bytes(opts.pid));
        let relaying = self.relay.is_some();
        let server = self.server.take();
        let rpc_opts = dump_rpc_opts(opts, self.images.as_raw_fd(), server.as_ref(), relaying);
        let mut post = PostDump {
            opts,
            start,
            relay: self.relay.take(),
            lazy: server.is_some(),
            done: PostDumpDone::default(),
        };
        let called = Criu::answer(
            worker,
            "dump",
            request(ReqType::Dump, Some(rpc_opts)),
            Some(&log),
            start + limit,
            Scope {
                limit,
                images_dir: Some(&opts.images_dir),
                adopted: &[],
                on_notify: Some(&mut |n: &rpc::Notify| post.notify(n)),
            },
        );
        drop(server);
        let done = post.outcome(relaying, called.is_ok())?;
        called?;
        let time = start.elapsed();
        let image_bytes = dir_bytes(&opts.images_dir);
        tracing::info!(pid = opts.pid, ?time, image_bytes, "criu dump done");
        Ok(DumpReport {
            images_dir: opts.images_dir.clone(),
            log,
            time,
            image_bytes,
            stopped: done.stopped,
            stats: read_stats(stats::dump_stats(&opts.images_dir)),
            pages_read: done.read,
            pages_relayed: done.relayed,
            post_dump_at: done.post_dump_at,
        })
    }
}

impl Drop for PreparedDump {
    fn drop(&mut self) {
        if let Some(w) = self.worker.take() {
            w.end_unasked();
        }
    }
}

/// CRIU's options for a dump of `opts` into the images directory `images_fd`; with a lazy
/// dump's page `server`, and notifications where possum acts at `post-dump` (`relaying`).
fn dump_rpc_opts(
    opts: &DumpOptions,
    images_fd: std::os::fd::RawFd,
    server: Option<&PageServer>,
    relaying: bool,
) -> CriuOpts {
    CriuOpts {
        images_dir_fd: images_fd,
        pid: Some(opts.pid),
        leave_running: Some(opts.leave_running),
        shell_job: Some(opts.shell_job),
        tcp_established: Some(opts.tcp_established),
        tcp_skip_in_flight: opts.tcp_skip_in_flight.then_some(true),
        network_lock: opts.network_lock.map(|m| m as i32),
        ext_unix_sk: Some(opts.ext_unix_sk),
        file_locks: Some(opts.file_locks),
        link_remap: Some(opts.link_remap),
        external: opts.external.clone(),
        timeout: opts
            .freeze_timeout
            .map(|t| u32::try_from(t.as_secs().max(1)).unwrap_or(u32::MAX)),
        log_file: Some(opts.log_file.clone()),
        log_level: Some(opts.log_level as i32),
        // The `post-dump` notification comes with the tree still frozen.
        notify_scripts: (opts.leave_stopped || server.is_some() || relaying).then_some(true),
        lazy_pages: server.is_some().then_some(true),
        config_file: server.map(PageServer::config_path),
        ..Default::default()
    }
}

/// What possum does at a dump's `post-dump` notification (the tree still frozen): completes the
/// pages it writes (the relay's copies, a lazy dump's read), then stops the tree if asked.
struct PostDump<'o> {
    opts: &'o DumpOptions,
    start: Instant,
    relay: Option<relay::Relay>,
    /// A lazy dump: possum reads the pages it left.
    lazy: bool,
    done: PostDumpDone,
}

/// What [`PostDump`] did.
#[derive(Default)]
struct PostDumpDone {
    stopped: bool,
    read: Option<Result<hostmem::lazy::LazyReport, hostmem::HostMemError>>,
    relayed: Option<Result<relay::RelayReport, relay::RelayError>>,
    post_dump_at: Option<Duration>,
}

impl PostDump<'_> {
    /// CRIU's notification `n`; `false` fails the dump (CRIU then lets the tree run on).
    fn notify(&mut self, n: &rpc::Notify) -> bool {
        if n.script.as_deref() != Some("post-dump") {
            return true;
        }
        let (opts, done) = (self.opts, &mut self.done);
        done.post_dump_at = Some(self.start.elapsed());
        if let Some(r) = self.relay.take() {
            // Every pages file CRIU opened is closed: the copies end with its pipes.
            let told = |r: &relay::RelayReport| {
                let (bytes, time) = (r.bytes(), r.time);
                tracing::info!(pid = opts.pid, bytes, ?time, "the dump's pages relayed");
            };
            if !kept(&mut done.relayed, r.finish(), told) {
                return false;
            }
        }
        if self.lazy {
            let threads = hostmem::default_threads();
            let r = hostmem::lazy::complete(&opts.images_dir, opts.pid, threads);
            let told = |r: &hostmem::lazy::LazyReport| {
                let (bytes, time) = (r.bytes(), r.time);
                tracing::info!(pid = opts.pid, bytes, ?time, "the lazy dump's pages read");
            };
            if !kept(&mut done.read, r, told) {
                return false;
            }
        }
        if opts.leave_stopped {
            process::stop_tree(opts.pid);
            done.stopped = true;
        }
        true
    }

    /// What it did, once the dump's call is over (`called_ok`): an error where the pages it
    /// writes failed, or never came to be written (no notification).
    fn outcome(self, relaying: bool, called_ok: bool) -> Result<PostDumpOutcome, CriuError> {
        let images_dir = self.opts.images_dir.clone();
        let done = self.done;
        let unwritten = called_ok
            && ((relaying && done.relayed.is_none()) || (self.lazy && done.read.is_none()));
        if unwritten {
            return Err(CriuError::LazyPagesUnread { images_dir });
        }
        let relayed = (done.relayed.transpose()).map_err(|source| CriuError::PagesRelay {
            images_dir: images_dir.clone(),
            source,
        })?;
        let read = (done.read.transpose())
            .map_err(|source| CriuError::LazyPages { images_dir, source })?;
        Ok(PostDumpOutcome {
            stopped: done.stopped,
            read,
            relayed,
            post_dump_at: done.post_dump_at,
        })
    }
}

/// [`PostDump`]'s outcome, its pages written.
struct PostDumpOutcome {
    stopped: bool,
    read: Option<hostmem::lazy::LazyReport>,
    relayed: Option<relay::RelayReport>,
    post_dump_at: Option<Duration>,
}

/// Keeps `r` (what possum did to a dump's pages at its `post-dump`) in `slot`, telling `told`
/// of a success; whether it succeeded.
fn kept<T, E>(slot: &mut Option<Result<T, E>>, r: Result<T, E>, told: impl FnOnce(&T)) -> bool {
    if let Ok(t) = &r {
        told(t);
    }
    let ok = r.is_ok();
    *slot = Some(r);
    ok
}

/// Pipes made for a dump's pages files beyond one per process: CRIU numbers its pages files as it
/// opens them, each memfd's before its process's, the tree's shared memory after (a PyTorch
/// job's process has several). A file past the pipes is CRIU's own, written as usual.
const RELAY_SPARE_FILES: usize = 32;

/// The relay of a dump's pages ([`PagesBy::Relay`]), or `None` where it cannot be made (CRIU
/// then writes the pages itself, as it would without it).
fn start_relay(opts: &DumpOptions) -> Option<relay::Relay> {
    let files = process::tree_of(opts.pid).len() + RELAY_SPARE_FILES;
    let files = u32::try_from(files).unwrap_or(u32::MAX);
    let capacity = process::tree_resident_bytes(opts.pid);
    let workers = hostmem::default_threads();
    let watch = opts.relay_watch.clone();
    match relay::Relay::start(&opts.images_dir, files, workers, capacity, watch) {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(error = %e, "CRIU writes the dump's pages itself: no relay");
            None
        }
    }
}
