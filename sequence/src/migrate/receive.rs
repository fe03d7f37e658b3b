//! The destination of a migration: `possum receive`'s handshake ([`receive_handshake`]) and
//! the rest of its session ([`receive_in_session`]): the image received (its GPU images loaded
//! ahead where a keeper is there), the restore after the source's `Released`, the job let run
//! at the go, post-copy, and the image synced once the job runs.

use std::fs;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::deadlines::Deadlines;
use super::post_copy::{self, PostCopyReport};
use super::report::opt_ms;
use crate::auth::HmacKey;
use crate::figures::as_ms;
use crate::prestage::{self, Prestaged, Prestages};
use crate::restore::{restore_opened, RestoreError, RestoreParams};
use crate::wire::{
    self, accept_handshake, await_released, receive_dir_post_copy, send_abort, send_demand,
    send_outcome, Accepted, Durability, FrameError, HandoffError, Outcome, Sessions, WireError,
};
use crate::Observer;

/// Where and how the destination receives (`possum receive`'s flags).
#[derive(Debug, Clone)]
pub struct ReceiveParams {
    /// The directory images are received into, each as a new directory in it.
    pub dir: PathBuf,
    /// The secret both hosts hold.
    pub key: HmacKey,
    /// The deadlines.
    pub deadlines: Deadlines,
    /// The restore's parameters but its `dir` (the image received).
    pub restore: RestoreParams,
    /// The sessions open to more streams: one registry for every connection of this receiver.
    pub sessions: Sessions,
}

/// How long each phase of a receive took.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ReceiveTimings {
    /// The handshake and the transfer, up to `Committed`.
    #[serde(rename = "receive_ms", serialize_with = "as_ms")]
    pub receive: Duration,
    /// From `Committed` to `Released` (the source's kill).
    #[serde(rename = "release_ms", serialize_with = "as_ms")]
    pub release: Duration,
    /// The restore.
    #[serde(rename = "restore_ms", serialize_with = "as_ms")]
    pub restore: Duration,
    /// The image synced to disk, after the job ran (or was refused the go): it was received
    /// unsynced, the source keeping its own until then.
    #[serde(rename = "sync_ms", serialize_with = "as_ms")]
    pub sync: Duration,
    /// How long the job waited, once it ran, for buffers not yet back (its own account; null
    /// if it did not say).
    #[serde(rename = "waited_after_resume_ms", serialize_with = "opt_ms")]
    pub waited_after_resume: Option<Duration>,
    /// Post-copy: from the job's run here until every piece left for it came.
    #[serde(rename = "post_copy_ms", serialize_with = "opt_ms")]
    pub post_copy: Option<Duration>,
}

/// A job received and running: what `possum receive` prints.
#[derive(Debug, Serialize)]
pub struct Received {
    /// The image, kept (the job's buffers come back from it as it runs).
    pub dir: PathBuf,
    /// The job, running.
    pub pid: i32,
    /// Files received.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// The phases' timings.
    pub timings: ReceiveTimings,
    /// The restore's own figures (`possum restore --json`'s `figures`).
    pub restore: crate::figures::RestoreFigures,
    /// Whether the source heard that the job runs here (it restores its own otherwise).
    pub source_told: bool,
    /// The GPU images loaded ahead, while the job was still at the source.
    pub prestaged: Vec<Prestaged>,
    /// The restore's stages (`possum restore --json`'s `staged`): what each took of them.
    pub staged: Vec<crate::stage::StageReport>,
    /// Why the restore staged nothing, if it did not.
    pub stage_skipped: Option<String>,
    /// Post-copy: the pieces received after the transfer (null: none was left for it).
    pub post_copy: Option<PostCopyReport>,
}

/// A receive that failed, by phase (nothing of the image is left, and no job was restored).
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    /// The handshake or the transfer.
    #[error("receiving the image failed")]
    Transfer(#[source] Box<WireError>),
    /// `Released` did not come (the source lets its job go on, or restores it).
    #[error("the image arrived, but the source did not let its job go; the image is removed")]
    Release(#[source] HandoffError),
    /// The source did not say go after the job was restored here: it was killed before it ran.
    /// Its image is kept (the source may not know whether it runs here).
    #[error(
        "the job was restored here as process {pid} but the source did not let it run ({why}): \
         it was killed before it ran; its image stays at {}: restore it with `possum restore -D` \
         only if the source does not run the job",
        dir.display()
    )]
    NotLetRun {
        /// The image (kept).
        dir: PathBuf,
        /// The restored process (killed).
        pid: i32,
        /// Why.
        why: String,
    },
    /// Post-copy: the pieces left for it did not all come after the job ran here: it was killed
    /// (the source restores its own), and the incomplete image removed.
    #[error(
        "the job ran here as process {pid}, but the pieces of its GPU images sent after the \
         transfer did not all come ({why}): it was killed, and the source restores its own"
    )]
    PostCopy {
        /// The restored process (killed).
        pid: i32,
        /// Why.
        why: String,
    },
    /// The restore failed (the source was told, and restores its job).
    #[error("restoring the job from {} failed; the source was told to restore its own", dir.display())]
    Restore {
        /// The image (removed).
        dir: PathBuf,
        /// Why.
        #[source]
        source: Box<RestoreError>,
    },
}

/// The names [`image_name`] handed out in this process: receives that run at once never get the
/// same one, though neither has made its directory yet.
static NAMED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// A new name for an image under `dir`: none there, and none handed out before.
fn image_name(dir: &Path) -> PathBuf {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let base = format!("job-{}", stamp.as_millis());
    let mut named = NAMED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // A name whose directory exists is kept off by the file system itself.
    named.retain(|p| fs::symlink_metadata(p).is_err());
    let mut at = dir.join(&base);
    let mut k = 1;
    while fs::symlink_metadata(&at).is_ok() || named.contains(&at) {
        at = dir.join(format!("{base}-{k}"));
        k += 1;
    }
    named.push(at.clone());
    at
}

/// The receiver's handshake on a new connection, each of its reads and writes within
/// `p.deadlines.handshake`, the connection's reads and writes bounded by `p.deadlines.io` again
/// for what follows: a new session (its first connection; [`receive_in_session`] receives the
/// migration), or another stream of one open in `p.sessions` (hand it over with
/// [`wire::Joined::join`]). A connection that does not prove it holds the secret in time, or
/// claims a stream of a session it does not belong to, is refused.
pub fn receive_handshake(
    stream: &mut TcpStream,
    p: &ReceiveParams,
) -> Result<Accepted, ReceiveError> {
    let failed = |e: wire::HandshakeError| ReceiveError::Transfer(Box::new(e.into()));
    let timeouts = |source| {
        failed(wire::HandshakeError::Io {
            what: "setting the connection's timeouts",
            source,
        })
    };
    wire::set_timeouts(stream, p.deadlines.handshake).map_err(timeouts)?;
    let accepted = accept_handshake(stream, &p.key, &p.sessions).map_err(failed)?;
    wire::set_timeouts(stream, p.deadlines.io).map_err(timeouts)?;
    Ok(accepted)
}

/// The image received at `dest` synced to disk ([`wire::make_durable`]), the job off its
/// downtime: how long it took, and whether it is on disk. One that cannot be synced keeps its
/// [`wire::UNSYNCED`] (a restore refuses it), said.
fn synced(dest: &Path, obs: &mut dyn Observer) -> (Duration, bool) {
    let t = Instant::now();
    let made = wire::make_durable(dest);
    if let Err(e) = &made {
        obs.note(&format!(
            "the image received at {} could not be synced to disk ({e}): it keeps {} and a \
             restore refuses it",
            dest.display(),
            wire::UNSYNCED
        ));
    }
    (t.elapsed(), made.is_ok())
}

/// How long the destination waits for the restored job to say how long it waited for its
/// buffers (they are all back by then) before it syncs its image without that figure.
const WAITED_LIMIT: Duration = Duration::from_secs(60);

/// Ends, when dropped, the prestages a restore did not take.
struct EndPrestages<'a>(&'a [Prestaged]);

impl Drop for EndPrestages<'_> {
    fn drop(&mut self) {
        prestage::end(self.0);
    }
}

/// The image into `dest`, unsynced until the job runs here (the source keeps its image until
/// then), and its GPU images loaded ahead from the first round sent ahead
/// ([`crate::prestage`]); the prestages are ended if the transfer fails.
fn receive_loading_ahead(
    stream: &mut TcpStream,
    session: wire::Session,
    dest: &Path,
    p: &ReceiveParams,
) -> Result<Loaded, ReceiveError> {
    let env = &p.restore.env;
    let ahead = Prestages::staging_ahead(env.stage_ahead).told_rewritten(env.load_rewritten);
    let mut watch = LoadingAhead {
        ahead,
        on: env.restore_stage,
    };
    let received = receive_dir_post_copy(stream, session, dest, Durability::Later, &mut watch);
    let prestaged = watch.ahead.finish();
    match received {
        Ok((got, session, later)) => Ok((got, session, prestaged, later)),
        Err(e) => {
            prestage::end(&prestaged);
            Err(ReceiveError::Transfer(Box::new(e)))
        }
    }
}

/// The receive's [`wire::Watch`] at a migration's destination: each part told to the loads
/// ahead (unless the restore does not stage, `on`), and the source told how far they came.
struct LoadingAhead {
    ahead: Prestages,
    on: bool,
}

impl wire::Watch for LoadingAhead {
    fn part(&mut self, dir: &Path, part: wire::Part, brought: &wire::Brought) {
        if self.on {
            self.ahead.part_received(dir, part, brought);
        }
    }
    fn loaded(&mut self) -> (u64, u64) {
        self.ahead.loaded()
    }
}

/// What [`receive_loading_ahead`] received: the image's totals, the session, the prestages, and
/// the pieces left for post-copy.
type Loaded = (
    wire::ReceiveReport,
    wire::Session,
    Vec<Prestaged>,
    Option<wire::LaterReceiver>,
);

/// Waits at most `deadline` for the source's `Released`.
fn released_within(
    stream: &mut TcpStream,
    session: &mut wire::Session,
    deadline: Duration,
) -> Result<(), HandoffError> {
    stream.set_read_timeout(Some(deadline)).map_err(|source| {
        HandoffError::from(FrameError::Io {
            what: "waiting for",
            source,
        })
    })?;
    await_released(stream, session)
}

/// The received image opened for its restore ([`crate::restore::open`]: nothing done on this
/// host yet) while the source kills the job, whose `Released` is waited for at most
/// `deadline`. Without it, the image (`params.dir`) is removed.
fn opened_while_released(
    stream: &mut TcpStream,
    session: &mut wire::Session,
    deadline: Duration,
    params: &RestoreParams,
) -> Result<Result<crate::restore::Opened, RestoreError>, ReceiveError> {
    let (released, opened) = std::thread::scope(|s| {
        let waiting = s.spawn(|| released_within(stream, session, deadline));
        let opened = crate::restore::open(params);
        let released = waiting
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (released, opened)
    });
    if let Err(e) = released {
        drop(opened);
        let _ = fs::remove_dir_all(&params.dir);
        return Err(ReceiveError::Release(e));
    }
    Ok(opened)
}

/// Post-copy once the job runs here (its receive, the job): waits for its pieces, asking
/// the source (`Demand`s on `stream`) for those its buffers wait for; how long it waited and
/// what came (`None` without post-copy). If they do not all come, the job is killed, the image
/// at `dest` removed and the source told why.
fn post_copy_here(
    (receiving, pid): (Option<post_copy::Receiving>, i32),
    stream: &mut TcpStream,
    session: &mut wire::Session,
    dest: &Path,
    obs: &mut dyn Observer,
) -> Result<Option<(Duration, PostCopyReport)>, ReceiveError> {
    let Some(receiving) = receiving else {
        return Ok(None);
    };
    let mut demand = |piece| send_demand(stream, session, piece).is_ok();
    match post_copy::after_run(receiving, pid, &mut demand, obs) {
        Ok(done) => Ok(Some(done)),
        Err(why) => {
            let reason = format!("post-copy failed: {why}; the job was killed here");
            send_abort(stream, session, &reason);
            let _ = fs::remove_dir_all(dest);
            Err(ReceiveError::PostCopy { pid, why })
        }
    }
}

/// Receives one migration over `session`, whose handshake ([`receive_handshake`]) on `stream`,
/// its first connection, began at `t`: the image into a new directory of `p.dir` (over all the
/// session's streams), then, once the source released its job, its restore, whose outcome the
/// source is told.
pub fn receive_in_session(
    stream: &mut TcpStream,
    session: wire::Session,
    t: Instant,
    p: &ReceiveParams,
    obs: &mut dyn Observer,
) -> Result<Received, ReceiveError> {
    let mut timings = ReceiveTimings::default();
    let dest = image_name(&p.dir);
    let (got, mut session, prestaged, later) = receive_loading_ahead(stream, session, &dest, p)?;
    timings.receive = t.elapsed();
    let later = later.map(|l| post_copy::receive_later(l, &dest));
    // Whatever the restore took of them, the rest is freed at the end.
    let _end_prestages = EndPrestages(&prestaged);

    // The job's socket directory is the one the source named, unless `p.restore` gives one.
    let params = RestoreParams {
        dir: dest.clone(),
        socket_dir_from_source: true,
        received_unsynced: true,
        prestaged: prestaged.clone(),
        post_copy: later.as_ref().map(|l| l.pc.clone()),
        ..p.restore.clone()
    };
    let t = Instant::now();
    let opened = opened_while_released(stream, &mut session, p.deadlines.release, &params)?;
    timings.release = t.elapsed();

    let t = Instant::now();
    // Restored, the job is held until the source says go: without it, it never runs here.
    let _ = stream.set_write_timeout(Some(p.deadlines.io));
    let restored = opened.and_then(|o| {
        restore_opened(&params, o, obs, &mut |pid| {
            send_outcome(stream, &mut session, &Outcome::Restored { pid })
                .map_err(|e| format!("telling the source: {}", possum_cuda::error_chain(&e)))?;
            stream
                .set_read_timeout(Some(p.deadlines.release))
                .map_err(|e| e.to_string())?;
            await_released(stream, &mut session).map_err(|e| match e.is_timeout() {
                true => format!(
                    "no go from the source within {} s",
                    p.deadlines.release.as_secs()
                ),
                false => format!("no go from the source: {}", possum_cuda::error_chain(&e)),
            })
        })
    });
    timings.restore = t.elapsed();
    match restored {
        Ok(r) => {
            let told = send_outcome(stream, &mut session, &Outcome::Running { pid: r.pid });
            let here = (later, r.pid);
            let post_copied = post_copy_here(here, stream, &mut session, &dest, obs)?;
            timings.post_copy = post_copied.map(|(took, _)| took);
            let post_copied = post_copied.map(|(_, r)| r);
            // What the job waited for after it ran is part of its downtime: known once its
            // buffers are all back.
            let waited = match r.figures.job_waited {
                Some(w) => Some(w),
                None if r.has_gpu => {
                    let limit = p.deadlines.restore.min(WAITED_LIMIT);
                    crate::restore::waited_after_resume(r.pid, &r.socket_dir, limit)
                }
                None => None,
            };
            timings.waited_after_resume = waited;
            let (took, on_disk) = synced(&dest, obs);
            timings.sync = took;
            if on_disk && told.is_ok() {
                let synced = Outcome::Synced { pid: r.pid, waited };
                let _ = send_outcome(stream, &mut session, &synced);
            }
            if let Err(e) = &told {
                obs.note(&format!(
                    "the job runs here as process {}, but the source was not told ({}); it \
                     keeps its image and does not restore it",
                    r.pid,
                    possum_cuda::error_chain(e)
                ));
            }
            Ok(Received {
                post_copy: post_copied,
                dir: dest,
                pid: r.pid,
                files: got.totals.files,
                bytes: got.totals.bytes,
                timings,
                restore: r.figures,
                source_told: told.is_ok(),
                prestaged: prestaged.clone(),
                staged: r.staged,
                stage_skipped: r.stage_skipped,
            })
        }
        Err(RestoreError::NotConfirmed { pid, why }) => {
            synced(&dest, obs);
            Err(ReceiveError::NotLetRun {
                dir: dest,
                pid,
                why,
            })
        }
        Err(source) => {
            let reason = possum_cuda::error_chain(&source);
            let _ = send_outcome(stream, &mut session, &Outcome::RestoreFailed { reason });
            let _ = fs::remove_dir_all(&dest);
            let source = Box::new(source);
            Err(ReceiveError::Restore { dir: dest, source })
        }
    }
}
