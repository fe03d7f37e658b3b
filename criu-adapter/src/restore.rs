//! CRIU's restore, and a restore made ready ahead of its request ([`PreparedRestore`]): its
//! `criu swrk` worker started, holding the descriptors the restored tree inherits, and waiting
//! for the request, so that a migration's destination starts it while the source still kills
//! the job, and CRIU begins the moment the request is sent.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::rpc::{self, CriuOpts, ReqType};
use crate::{
    check_log_name, dir_bytes, images, open_images_dir, process, read_stats, request, stats, swrk,
    Criu, CriuError, RestoreOptions, RestoreReport, Scope,
};

impl Criu {
    /// Restores the tree dumped in `opts.images_dir`. Returns once the tree runs and the criu
    /// worker has exited (so the tree has been reparented; see [`crate::set_child_subreaper`]).
    /// Fails with [`CriuError::DeadlineExceeded`] when CRIU runs past `opts.deadline` (scaled by
    /// the size of the images; images whose pages file is cut short make CRIU wait forever),
    /// after killing it and the tasks it had restored.
    pub fn restore(&self, opts: &RestoreOptions) -> Result<RestoreReport, CriuError> {
        self.prepare_restore(opts)?.run(opts)
    }

    /// Makes a restore with `opts` ready without starting it: a `criu swrk` worker started with
    /// the descriptors `opts.inherit_fds` names (those numbered 0-2 handed over as copies
    /// above 2), waiting for the request. Nothing is read of the images and nothing of the
    /// tree exists yet. [`PreparedRestore::run`] restores; dropped unrun, the worker is ended.
    /// Its worker and guard hold PIDs of their own: a tree to restore under one of them
    /// ([`PreparedRestore::pids`]) must not be restored with it. With `opts.restore_sibling`
    /// there is no guard and the worker dies with the thread that made it ready (the kernel's
    /// parent-death signal follows the thread): run it before that thread ends.
    pub fn prepare_restore(&self, opts: &RestoreOptions) -> Result<PreparedRestore, CriuError> {
        let t = Instant::now();
        check_log_name(&opts.log_file)?;
        // The worker's 0-2 are not ours: a descriptor there is handed over as a copy above 2.
        let mut copies = Vec::new();
        let mut inherit = Vec::new();
        for (key, fd) in &opts.inherit_fds {
            let std_fd = match fd {
                0 => Some(std::io::stdin().as_fd().try_clone_to_owned()),
                1 => Some(std::io::stdout().as_fd().try_clone_to_owned()),
                2 => Some(std::io::stderr().as_fd().try_clone_to_owned()),
                _ => None,
            };
            let fd = match std_fd {
                None => *fd,
                Some(copy) => {
                    // A close-on-exec copy numbered above 2 (the worker clears the flag).
                    let copy = copy.map_err(|source| CriuError::Io {
                        what: format!("duplicating descriptor {fd} for CRIU's inherit_fd {key}"),
                        source,
                    })?;
                    let raw = copy.as_raw_fd();
                    copies.push(copy);
                    raw
                }
            };
            inherit.push(rpc::InheritFd {
                key: key.clone(),
                fd,
            });
        }
        let inherited: Vec<RawFd> = inherit.iter().map(|i| i.fd).collect();
        let worker = self.spawn_worker("restore", &inherited, owner_death(opts))?;
        Ok(PreparedRestore {
            worker: Some(worker),
            _copies: copies,
            inherit,
            made_for: Made::of(opts),
            took: t.elapsed(),
        })
    }
}

/// Who ends a restore's worker should this process die: with the root created as the worker's
/// sibling (this process's child) the worker just dies with it (a guard would be the root's
/// parent); otherwise its guard kills it at once, with what it was restoring.
fn owner_death(opts: &RestoreOptions) -> swrk::OnOwnerDeath {
    match opts.restore_sibling {
        true => swrk::OnOwnerDeath::DiesWithParent,
        false => swrk::OnOwnerDeath::KilledAtOnce,
    }
}

/// What a worker was started for: the descriptors it inherited, and how it ends with its owner.
#[derive(Debug, PartialEq, Eq)]
struct Made {
    inherit_fds: Vec<(String, RawFd)>,
    restore_sibling: bool,
}

impl Made {
    fn of(opts: &RestoreOptions) -> Made {
        Made {
            inherit_fds: opts.inherit_fds.clone(),
            restore_sibling: opts.restore_sibling,
        }
    }
}

/// A restore made ready ([`Criu::prepare_restore`]), its worker waiting for the request.
#[derive(Debug)]
pub struct PreparedRestore {
    /// Taken by [`PreparedRestore::run`]; one still here when it is dropped is ended.
    worker: Option<swrk::Worker>,
    /// The copies above 2 of this process's descriptors 0-2 the worker inherited: open until
    /// the restore is over.
    _copies: Vec<OwnedFd>,
    inherit: Vec<rpc::InheritFd>,
    made_for: Made,
    took: Duration,
}

impl PreparedRestore {
    /// How long making it ready took.
    pub fn took(&self) -> Duration {
        self.took
    }

    /// The PIDs its worker and the worker's guard hold while it waits.
    pub fn pids(&self) -> Vec<i32> {
        let Some(w) = &self.worker else {
            return Vec::new();
        };
        let guard = w.pid();
        let mut pids = vec![guard];
        pids.extend(process::children_of(guard));
        pids
    }

    /// Restores with `opts`: the request sent to the waiting worker, the answer checked, the
    /// worker waited for (see [`Criu::restore`]). Its report's time counts from here. Options
    /// whose inherited descriptors or sibling mode differ from those it was made ready with
    /// are refused before anything is sent ([`CriuError::Protocol`]).
    pub fn run(mut self, opts: &RestoreOptions) -> Result<RestoreReport, CriuError> {
        let start = Instant::now();
        if self.made_for != Made::of(opts) {
            return Err(CriuError::Protocol {
                op: "restore",
                detail: "its worker was made ready for other inherited descriptors or another \
                         sibling mode"
                    .into(),
            });
        }
        let images = open_images_dir(&opts.images_dir, false)?;
        let log = opts.images_dir.join(&opts.log_file);
        let limit = opts.deadline.for_bytes(dir_bytes(&opts.images_dir));
        // The processes the restore creates (a root created as the worker's sibling is this
        // process's child, out of the worker's tree): unreadable images have none to kill.
        let dumped: Vec<i32> = images::read_messages::<images::PstreeEntry>(
            &opts.images_dir.join("pstree.img"),
            images::PSTREE_MAGIC,
        )
        .map(|tree| {
            tree.iter()
                .filter_map(|e| i32::try_from(e.pid).ok())
                .collect()
        })
        .unwrap_or_default();
        let rpc_opts = CriuOpts {
            images_dir_fd: images.as_raw_fd(),
            shell_job: Some(opts.shell_job),
            tcp_established: Some(opts.tcp_established),
            tcp_close: opts.tcp_close.then_some(true),
            network_lock: opts.network_lock.map(|m| m as i32),
            ext_unix_sk: Some(opts.ext_unix_sk),
            file_locks: Some(opts.file_locks),
            rst_sibling: Some(opts.restore_sibling),
            external: opts.external.clone(),
            log_file: Some(opts.log_file.clone()),
            log_level: Some(opts.log_level as i32),
            inherit_fd: std::mem::take(&mut self.inherit),
            ..Default::default()
        };
        let worker = self.worker.take().expect("taken only here");
        let resp = Criu::answer(
            worker,
            "restore",
            request(ReqType::Restore, Some(rpc_opts)),
            Some(&log),
            start + limit,
            Scope {
                limit,
                images_dir: Some(&opts.images_dir),
                adopted: &dumped,
                on_notify: None,
            },
        )?;
        drop(images);
        let pid = match resp.restore {
            Some(r) if r.pid > 0 => r.pid,
            other => {
                return Err(CriuError::Protocol {
                    op: "restore",
                    detail: format!("no restored PID in a successful answer ({other:?})"),
                })
            }
        };
        let time = start.elapsed();
        tracing::info!(pid, ?time, "criu restore done");
        Ok(RestoreReport {
            pid,
            log,
            time,
            stats: read_stats(stats::restore_stats(&opts.images_dir)),
        })
    }
}

impl Drop for PreparedRestore {
    fn drop(&mut self) {
        if let Some(w) = self.worker.take() {
            w.end_unasked();
        }
    }
}
