//! The source's side of the cut: the held job killed beside the send of the rest of its image
//! (or once it is sent), and the restore here should the destination not run it.

use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::error::{JobAt, MigrateError};
use crate::checkpoint::{CheckpointParams, CheckpointReport};
use crate::config::Environment;
use crate::guard::{GuardPlan, HandOff};
use crate::restore::{restore, RestoreError, RestoreParams, RestoreReport};
use crate::wire::{self, send_abort, WireError};
use crate::Observer;

/// The figures of [`send_killing`] and [`AtSource::report`].
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct KillTimes {
    /// The send.
    pub(super) send: Duration,
    /// The kill and the wait for the job's PIDs.
    pub(super) kill: Duration,
    /// Of that, after the send (and the report written).
    pub(super) kill_after_send: Duration,
}

/// Sends the rest of the image (`send`), the job held, killing it meanwhile if `beside` (its
/// image here is whole: a destination on this host restores under its PIDs as soon as the send
/// is over): what the send said, the job at the source, and the send's time.
pub(super) fn send_killing<'p, R: Send>(
    beside: bool,
    held: crate::HeldCheckpoint<'p>,
    here: &Fallback<'_>,
    send: impl FnOnce() -> R,
) -> (R, AtSource<'p>, KillTimes) {
    let t = Instant::now();
    let mut times = KillTimes::default();
    if !beside {
        let sending = send();
        times.send = t.elapsed();
        return (sending, AtSource::Held(Box::new(held)), times);
    }
    std::thread::scope(|sc| {
        let killing = sc.spawn(move || Killed::now(held, here));
        let sending = send();
        times.send = t.elapsed();
        let killed = killing
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        times.kill_after_send = t.elapsed() - times.send;
        (sending, AtSource::Killed(Box::new(killed)), times)
    })
}

/// The held job at the source once the rest of its image is sent.
pub(super) enum AtSource<'p> {
    /// Held, to be killed now that the destination has the image.
    Held(Box<crate::HeldCheckpoint<'p>>),
    /// Killed beside the send (its image here is whole), or the kill failed.
    Killed(Box<Killed<'p>>),
}

impl AtSource<'_> {
    /// The checkpoint's report once the destination has the image: the job killed now if it
    /// is still held, its report written either way (`times` get the kill's); and its guard,
    /// which restores it here should this process end before the destination runs it.
    pub(super) fn report(
        self,
        here: &Fallback<'_>,
        (stream, session): (&mut TcpStream, &mut wire::Session),
        times: &mut KillTimes,
        obs: &mut dyn Observer,
    ) -> Result<(CheckpointReport, HandOff), MigrateError> {
        let t = Instant::now();
        let killed = match self {
            AtSource::Held(held) => Killed::now(*held, here),
            AtSource::Killed(killed) => *killed,
        };
        times.kill = killed.took;
        // (Its figures written into the image now that it is sent.)
        let report = killed.into_report(here, stream, session, obs)?;
        times.kill_after_send += t.elapsed();
        Ok(report)
    }
}

/// The held job's kill at the source, and its PIDs waited free for the restore (a destination
/// on this host restores under them).
pub(super) struct Killed<'p> {
    /// The checkpoint, its job killed (its report not written yet: the image may be being
    /// sent), or why the kill failed (the guard let the job go on, unless it was killed after
    /// all).
    killed: Result<crate::KilledCheckpoint<'p>, crate::CheckpointError>,
    /// A PID still taken at the deadline.
    taken: Option<crate::process::PidTaken>,
    /// How long it took.
    took: Duration,
}

impl<'p> Killed<'p> {
    /// Kills the held job, and waits for its PIDs to be free.
    pub(super) fn now(held: crate::HeldCheckpoint<'p>, here: &Fallback<'_>) -> Killed<'p> {
        let t = Instant::now();
        let killed = held.kill_only();
        let taken = match killed {
            Ok(_) => crate::process::wait_pids_free(here.pids, here.deadline).err(),
            Err(_) => None,
        };
        Killed {
            killed,
            taken,
            took: t.elapsed(),
        }
    }

    /// The kill's report once the destination has the image (the image made durable and its
    /// figures written now), and the job's guard until the hand-off. A failed kill aborts the
    /// transfer; the job runs on here, or is restored here.
    pub(super) fn into_report(
        self,
        here: &Fallback<'_>,
        stream: &mut TcpStream,
        session: &mut wire::Session,
        obs: &mut dyn Observer,
    ) -> Result<(CheckpointReport, HandOff), MigrateError> {
        match self
            .killed
            .and_then(crate::KilledCheckpoint::report_handing_off)
        {
            Ok(report) => {
                if let Some(taken) = self.taken {
                    // Another host restores under them all the same; this one cannot until
                    // they are free.
                    obs.note(&format!(
                        "the job was killed, but its PIDs are not free after {} s ({taken}): a \
                         destination on this host cannot restore it until they are",
                        here.deadline.as_secs()
                    ));
                }
                Ok(report)
            }
            Err(source) => {
                send_abort(stream, session, "the source could not kill its job");
                let job = here.unless_alive(obs);
                let source = Box::new(source);
                Err(MigrateError::Kill { job, source })
            }
        }
    }

    /// The send beside the kill failed (`source`): the job, killed, is restored here from its
    /// image; one whose kill failed runs on here.
    pub(super) fn send_failed(
        self,
        source: WireError,
        here: &Fallback<'_>,
        to: &str,
        obs: &mut dyn Observer,
    ) -> MigrateError {
        let job = match self.killed {
            // (Its guard watches this process's restore.)
            Ok(killed) => {
                here.watched_by(killed.into_hand_off());
                here.restore(obs)
            }
            Err(_) => here.unless_alive(obs),
        };
        MigrateError::Send {
            to: to.to_string(),
            job,
            source: Box::new(source),
        }
    }
}

/// Before the kill: lets the held job go on at the source (its image is kept, its buffers come
/// back from it).
pub(super) fn let_go(
    held: crate::HeldCheckpoint<'_>,
    c: &CheckpointParams,
    obs: &mut dyn Observer,
) -> JobAt {
    match held.resume() {
        Ok(_) => {
            obs.note(&format!(
                "the job runs on here; its image {} stays while its buffers come back from it",
                c.dir.display()
            ));
            JobAt::Source
        }
        Err(e) => JobAt::lost(c, possum_cuda::error_chain(&e)),
    }
}

/// The restore at the source after the kill, should the destination not run the job.
pub(super) struct Fallback<'a> {
    /// The checkpoint: its image, and the socket directory it reached the job in.
    pub(super) c: &'a CheckpointParams,
    /// The job's PIDs when it was killed.
    pub(super) pids: &'a [i32],
    /// How long they may take to be free (a destination on this host that restored the job
    /// and killed it again frees them too).
    pub(super) deadline: Duration,
    /// The checkpoint's guard once the job is killed: it restores the job here should this
    /// process end before the destination runs it, or while this process restores it here.
    guard: Mutex<Option<HandOff>>,
}

impl<'a> Fallback<'a> {
    /// The restore of the job `c` checkpointed, its PIDs `pids` freed within `deadline`.
    pub(super) fn new(c: &'a CheckpointParams, pids: &'a [i32], deadline: Duration) -> Self {
        Fallback {
            c,
            pids,
            deadline,
            guard: Mutex::new(None),
        }
    }

    /// `guard` watches the job from now ([`HandOff`]).
    pub(super) fn watched_by(&self, guard: HandOff) {
        *self.guard.lock().unwrap_or_else(PoisonError::into_inner) = Some(guard);
    }

    /// The destination is about to be told to run the job: the guard leaves it to the
    /// destination ([`HandOff::handing_off`]).
    pub(super) fn handing_off(&self) {
        let mut g = self.guard.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(g) = g.as_mut() {
            g.handing_off();
        }
    }

    /// After a kill that failed: the job runs on here if it is alive (the guard let it go),
    /// else it is restored here.
    pub(super) fn unless_alive(&self, obs: &mut dyn Observer) -> JobAt {
        if crate::process::alive(self.c.pid) {
            JobAt::Source
        } else {
            self.restore(obs)
        }
    }

    /// Restores the job from its local image (kept either way) once its PIDs are free, its
    /// control socket in the directory its checkpoint used: a restore possum does not refuse
    /// for a socket directory that is not its own by default.
    /// The guard, told first, sees to the job should this process end during the restore; it
    /// is let go once the restore is over, whatever its outcome.
    pub(super) fn restore(&self, obs: &mut dyn Observer) -> JobAt {
        let c = self.c;
        let mut guard = self
            .guard
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(g) = guard.as_mut() {
            g.restoring_here();
        }
        obs.note(&format!(
            "restoring the job at the source from {}",
            c.dir.display()
        ));
        // Still taken at the deadline: the restore says by what.
        let _ = crate::process::wait_pids_free(self.pids, self.deadline);
        let here = (c.dir.clone(), c.sockets.clone());
        let job = match restore_at_source(here, c.possum_exe.clone(), c.env.clone(), obs) {
            Ok(_) => JobAt::Source,
            Err(e) => JobAt::lost(c, possum_cuda::error_chain(&e)),
        };
        drop(guard);
        job
    }
}

/// Restores the job at the source from its image `dir`, its control socket in `sockets` (the
/// directory its checkpoint used: a restore possum does not refuse for a socket directory that
/// is not its own by default).
fn restore_at_source(
    (dir, sockets): (PathBuf, PathBuf),
    possum_exe: PathBuf,
    env: Environment,
    obs: &mut dyn Observer,
) -> Result<RestoreReport, RestoreError> {
    let params = RestoreParams {
        dir,
        socket_dir: Some(sockets),
        socket_dir_from_source: false,
        device: None,
        possum_exe,
        env,
        hmac_key: None,
        received_unsynced: false,
        prestaged: Vec::new(),
        post_copy: None,
    };
    restore(&params, obs)
}

/// How long a migrated job's PIDs may take to be free for its restore here (a destination on
/// this host that restored it kills its copy once this end is gone).
const MIGRATED_PIDS_FREE: Duration = Duration::from_secs(60);

/// The job of a migration whose `possum` ended after the kill and before the destination was
/// told to run it: restored here from its image once its PIDs are free, its control socket
/// where the checkpoint found it, as `possum migrate` itself restores it when the destination
/// does not run it.
pub fn restore_after_migration(a: &GuardPlan, tell: &dyn Fn(&str)) {
    let say = |m: &str| {
        tell(&format!(
            "the migration of process {} ended before the destination ran it: {m}",
            a.pid
        ))
    };
    let dir = a.final_dir.display();
    let pids: Vec<i32> = std::iter::once(a.pid)
        .chain(a.children.iter().copied())
        .collect();
    if let Err(taken) = crate::process::wait_pids_free(&pids, MIGRATED_PIDS_FREE) {
        say(&format!("not restored from {dir}: {taken}"));
        return;
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return say(&format!("not restored from {dir}: this executable: {e}")),
    };
    say(&format!("restoring it from {dir}"));
    let here = (a.final_dir.clone(), a.socket_dir.clone());
    match restore_at_source(here, exe, Environment::read(), &mut Telling(&say)) {
        Ok(r) => say(&format!("restored from {dir} as process {}", r.pid)),
        Err(e) => say(&format!(
            "not restored from {dir}: {}",
            possum_cuda::error_chain(&e)
        )),
    }
}

/// An observer that says its notes.
struct Telling<'a>(&'a dyn Fn(&str));

impl Observer for Telling<'_> {
    fn copying(&mut self, _: u64, _: &std::path::Path) {}
    fn copied(&mut self) {}
    fn note(&mut self, what: &str) {
        (self.0)(what);
    }
}
