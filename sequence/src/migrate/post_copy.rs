//! A migration's post-copy, at each end (part of [`super`]): the source's send of the pieces
//! left for it, and what it makes of the destination's answer; the destination's receive of
//! them, and its end once the job runs there ([`crate::postcopy`] has the rules).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::figures::as_ms;
use crate::postcopy::{gpu_image_dirs, later_order, PostCopy, Watch};
use crate::wire::{DirSender, LaterReceiver, LaterReport, LaterSender, SendError, Urgent};
use crate::Observer;

/// Post-copy: how long the destination waits for the next piece once its job runs before it
/// kills the job (it cannot run on without its buffers); the source restores its own job only
/// once that long and 5 s more have passed since its own send of them failed.
pub const POST_COPY_LEASE: Duration = Duration::from_secs(15);
/// See [`POST_COPY_LEASE`].
pub(crate) const LEASE_MARGIN: Duration = Duration::from_secs(5);

/// What a post-copy sent, after the destination had the rest of the image.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PostCopyReport {
    /// Pieces of the GPU images' files.
    pub pieces: u64,
    /// Their bytes.
    pub bytes: u64,
    /// From the destination's `Committed` to the last piece sent.
    #[serde(rename = "ms", serialize_with = "as_ms")]
    pub took: Duration,
    /// Pieces the destination asked for first, its job waiting for them (`Demand`s).
    pub demanded: u64,
}

/// A post-copy's receive at the destination: which pieces came ([`PostCopy`], which the
/// restore's stages are told through), and the thread that receives them.
pub(crate) struct Receiving {
    pub(crate) pc: Arc<PostCopy>,
    thread: std::thread::JoinHandle<Option<LaterReport>>,
}

/// Post-copy at the destination: the pieces left come on a thread of their own into the image
/// at `dest`, each told to the [`PostCopy`] (and through it to the stages); the thread ends it.
pub(crate) fn receive_later(later: LaterReceiver, dest: &Path) -> Receiving {
    let pc = Arc::new(PostCopy::new(later.pieces().to_vec()));
    let (to, dir) = (pc.clone(), dest.to_path_buf());
    let thread = std::thread::spawn(move || {
        let r = later.receive(&dir, &|i| to.arrived(i));
        let report = r.as_ref().ok().copied();
        to.ended(r.map(drop).map_err(|e| possum_cuda::error_chain(&e)));
        report
    });
    Receiving { pc, thread }
}

/// Post-copy at the destination once the job runs there as `pid` ([`post_copy_end`]): how long
/// it waited for the pieces, and what came; why it failed (the job killed).
pub(crate) fn after_run(
    receiving: Receiving,
    pid: i32,
    demand: &mut dyn FnMut(u64) -> bool,
    obs: &mut dyn Observer,
) -> Result<(Duration, PostCopyReport), String> {
    let t = Instant::now();
    // Should this process die meanwhile, the job it runs without its buffers dies with it.
    let watchdog = Watchdog::start(pid);
    let ended = post_copy_end(&receiving.pc, pid, demand, obs);
    if let Some(w) = watchdog {
        w.disarm();
    }
    let demanded = ended?;
    let took = t.elapsed();
    let r = receiving.thread.join().ok().flatten().unwrap_or_default();
    let report = PostCopyReport {
        pieces: r.pieces,
        bytes: r.bytes,
        took: r.elapsed,
        demanded,
    };
    Ok((took, report))
}

/// A post-copy's send at the source: the thread that sends the pieces, and the pieces the
/// destination asks for first.
pub(crate) struct Sending {
    pub(crate) thread: std::thread::JoinHandle<Result<PostCopyReport, SendError>>,
    pub(crate) urgent: Arc<Urgent>,
}

/// Starts the post-copy's send of `later` from the image at `dir` (whose GPU images are
/// `gpu_dirs`) on a thread of its own, the pieces in the order the job needs them
/// ([`later_order`]), `sent` counting their bytes.
pub(crate) fn start_sending(
    later: LaterSender,
    dir: &Path,
    gpu_dirs: &[String],
    sent: Arc<AtomicU64>,
) -> Sending {
    let order = later_order(dir, gpu_dirs, later.pieces());
    let (dir, t) = (dir.to_path_buf(), Instant::now());
    let urgent = Arc::new(Urgent::default());
    let asked = urgent.clone();
    let thread = std::thread::spawn(move || {
        later
            .send(&dir, &order, &asked, &sent)
            .map(|r| PostCopyReport {
                pieces: r.pieces,
                bytes: r.bytes,
                took: t.elapsed(),
                demanded: asked.asked(),
            })
    });
    Sending { thread, urgent }
}

/// With `on`, the GPU images of the image at `dir` (relative), whose pieces `sender` leaves for
/// post-copy; none otherwise.
pub(crate) fn left_for_later(on: bool, dir: &Path, sender: &mut DirSender) -> Vec<String> {
    let dirs = if on { gpu_image_dirs(dir) } else { Vec::new() };
    sender.post_copy(dirs.clone());
    dirs
}

/// How often the destination asks its stages which pieces its job waits for.
const ASK_EVERY: Duration = Duration::from_millis(20);

/// The destination's questions to its stages: which pieces the job waits for
/// (`stage_demands`), each then asked of the source (`Demand`) once.
#[derive(Default)]
struct Asker {
    keepers: Vec<((PathBuf, u64), possum_keeper::Keeper)>,
    asked: u64,
    /// The source cannot be asked (its stream failed): no more questions.
    off: bool,
}

impl Asker {
    /// Asks each stage of `pc` (a connection of its own to its keeper, kept) for the pieces its
    /// buffers waited for, and the source (`demand`) for each.
    fn ask(&mut self, pc: &PostCopy, demand: &mut dyn FnMut(u64) -> bool) {
        if self.off {
            return;
        }
        for (image, socket, stage) in pc.stages() {
            let key = (socket, stage);
            let at = match self.keepers.iter().position(|(k, _)| *k == key) {
                Some(at) => at,
                None => match possum_keeper::Keeper::connect(&key.0) {
                    Ok(k) => {
                        self.keepers.push((key.clone(), k));
                        self.keepers.len() - 1
                    }
                    Err(_) => continue,
                },
            };
            let Ok(pieces) = self.keepers[at].1.stage_demands(stage, Duration::ZERO) else {
                self.keepers.swap_remove(at);
                continue;
            };
            for p in pieces.iter().filter_map(|p| pc.index_of(&image, p)) {
                if !demand(p as u64) {
                    self.off = true;
                    return;
                }
                self.asked += 1;
            }
        }
    }
}

/// Post-copy, the job running here as `pid`: waits until every piece came, meanwhile asking
/// the source (`demand`) for those the job's buffers wait for, or kills the job once none came
/// for [`POST_COPY_LEASE`] (it cannot run on without its buffers; the source restores its own
/// after that) or the receive failed. How many pieces were asked for.
fn post_copy_end(
    pc: &PostCopy,
    pid: i32,
    demand: &mut dyn FnMut(u64) -> bool,
    obs: &mut dyn Observer,
) -> Result<u64, String> {
    let mut watch = Watch::default();
    let mut asker = Asker::default();
    let why = loop {
        match pc.wait_watching(POST_COPY_LEASE, ASK_EVERY, &mut watch) {
            Some(Ok(())) => return Ok(asker.asked),
            Some(Err(why)) => break why,
            None => asker.ask(pc, demand),
        }
    };
    let _ = crate::process::kill_job(pid);
    // Reaped (CRIU restored it as this process's child): its PID is free for the source's
    // restore, should that be on this host.
    let _ = possum_criu::wait_for_exit(pid, Some(Duration::from_secs(10)));
    obs.note(&format!(
        "post-copy failed after the job ran here as process {pid} ({why}): it was killed, \
         without the buffers it needs; the source restores its own"
    ));
    Err(why)
}

/// Kills a job that waits for its post-copy pieces here should this process die first (the
/// source then restores its own): a shell in a process group of its own reads a line from a
/// pipe this process holds, and unless it is `done` (its end, this process gone) kills the
/// job's processes.
struct Watchdog {
    shell: std::process::Child,
}

impl Watchdog {
    /// Watches the job `pid` (and its processes now); `None` if no shell could be started.
    fn start(pid: i32) -> Option<Watchdog> {
        use std::os::unix::process::CommandExt;
        let tree: Vec<String> = (crate::tree::with_descendants(pid).iter())
            .map(|p| p.to_string())
            .collect();
        let script = format!(
            "read line; [ \"$line\" = done ] || kill -9 {} 2>/dev/null",
            tree.join(" ")
        );
        let shell = std::process::Command::new("/bin/sh")
            .args(["-c", &script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0)
            .spawn()
            .ok()?;
        Some(Watchdog { shell })
    }

    /// The wait is over (the pieces came, or the job was killed here): the shell ends without
    /// killing anything.
    fn disarm(mut self) {
        if let Some(mut line) = self.shell.stdin.take() {
            use std::io::Write;
            let _ = line.write_all(b"done\n");
        }
        let _ = self.shell.wait();
    }
}
