//! The guard: a separate process that undoes a checkpoint which failed or whose `possum` died.

use std::fs;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use possum_control::reply::{ResumeReply, StatusReply};
use possum_control::Request;
use possum_criu::{tree_resident_bytes, Deadline};
use possum_cuda::checkpoint::{DriverCheckpoint, DriverCkptError, ProcessState};

use crate::config::DriverDeadlines;
use crate::image::{child_gpu_dir, MANIFEST};
use crate::job::JOB_TIMEOUT;
use crate::process::alive;
use crate::temps::TempLock;

/// What `possum checkpoint` tells its guard, each before it is taken (so that a `possum` killed
/// inside a step still gets it undone), one name per line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The collective launches of the job's ranks are about to be held at one boundary.
    Cutting,
    /// The job is about to be held and its buffers released.
    Releasing,
    /// The driver is about to lock (and then checkpoint) the job.
    Locking,
    /// CRIU is about to dump the job's tree.
    Dumping,
    /// CRIU's dump has ended (done or failed): it holds the tree no more.
    Dumped,
    /// The job's tree is about to be stopped (SIGSTOP) until it is killed or let run on.
    Stopped,
    /// The image is complete under its final name.
    Committed,
    /// The driver has restored and unlocked the job.
    Unlocked,
    /// The job runs again (its buffers come back from the named image).
    Resumed,
    /// A migration is about to kill the held job, its image complete: should `possum` end
    /// before [`Step::HandedOff`] or [`Step::Done`], the job is restored here from its image.
    Migrating,
    /// A migration is about to tell the destination to run the job: the job is its now.
    HandedOff,
    /// A migration's `possum` is about to restore the job here itself (the destination did not
    /// run it): should `possum` end before [`Step::Done`], the guard waits for that restore's
    /// outcome and restores the job from its image if nothing runs it.
    RestoringHere,
    /// Nothing to undo.
    Done,
}

impl Step {
    const ALL: [Step; 13] = [
        Step::Cutting,
        Step::Releasing,
        Step::Locking,
        Step::Dumping,
        Step::Dumped,
        Step::Stopped,
        Step::Committed,
        Step::Unlocked,
        Step::Resumed,
        Step::Migrating,
        Step::HandedOff,
        Step::RestoringHere,
        Step::Done,
    ];

    fn name(self) -> &'static str {
        match self {
            Step::Cutting => "cutting",
            Step::Releasing => "releasing",
            Step::Locking => "locking",
            Step::Dumping => "dumping",
            Step::Dumped => "dumped",
            Step::Stopped => "stopped",
            Step::Committed => "committed",
            Step::Unlocked => "unlocked",
            Step::Resumed => "resumed",
            Step::Migrating => "migrating",
            Step::HandedOff => "handed-off",
            Step::RestoringHere => "restoring-here",
            Step::Done => "done",
        }
    }

    fn parse(s: &str) -> Option<Step> {
        Step::ALL.into_iter().find(|x| x.name() == s)
    }
}

/// The guard process's end: each step is reported to it before it is taken.
#[derive(Debug)]
pub struct Guard {
    child: Child,
    pipe: Option<ChildStdin>,
}

impl Guard {
    /// Starts `exe checkpoint-guard` (`exe`: the possum executable) for the checkpoint `a`.
    pub fn start(exe: &Path, a: &GuardPlan) -> std::io::Result<Guard> {
        let mut cmd = Command::new(exe);
        cmd.arg("checkpoint-guard")
            .arg("--pid")
            .arg(a.pid.to_string())
            .args(
                a.children
                    .iter()
                    .flat_map(|c| ["--child".to_string(), c.to_string()]),
            )
            .args(
                a.possum_children
                    .iter()
                    .flat_map(|c| ["--possum-child".to_string(), c.to_string()]),
            )
            .arg("--tmp")
            .arg(&a.tmp)
            .arg("--final-dir")
            .arg(&a.final_dir)
            .arg("--socket-dir")
            .arg(&a.socket_dir)
            .arg("--gpu-bytes")
            .arg(a.gpu_bytes.to_string())
            .stdin(Stdio::piped());
        // Its own process group: a Ctrl-C at the terminal stops possum, not the guard.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = cmd.spawn()?;
        let pipe = child.stdin.take();
        Ok(Guard { child, pipe })
    }

    /// Tells the guard that `step` is about to be taken.
    pub fn step(&mut self, step: Step) {
        if let Some(p) = self.pipe.as_mut() {
            let _ = writeln!(p, "{}", step.name());
            let _ = p.flush();
        }
    }

    /// Success: the guard has nothing to undo.
    pub fn done(mut self) {
        self.step(Step::Done);
        self.pipe = None;
        let _ = self.child.wait();
    }

    /// Failure: the guard undoes what was done; returns when it has.
    pub fn undo(mut self) {
        self.pipe = None;
        let _ = self.child.wait();
    }
}

/// A migration's job, killed and reported, until the destination is told to run it: should
/// this process end meanwhile, its guard restores the job here from its image. Dropped, it
/// tells the guard that nothing is left to do.
#[derive(Debug)]
pub struct HandOff {
    guard: Option<Guard>,
}

impl HandOff {
    /// Watches the hand-off with `guard` (none: nothing watches).
    pub(crate) fn new(guard: Option<Guard>) -> HandOff {
        HandOff { guard }
    }

    /// The destination is about to be told to run the job: it is the destination's from now.
    pub fn handing_off(&mut self) {
        if let Some(g) = &mut self.guard {
            g.step(Step::HandedOff);
        }
    }

    /// This process is about to restore the job here itself (the destination did not run it):
    /// should it end before the `HandOff` is dropped, the guard waits for that restore's
    /// outcome and restores the job if nothing runs it.
    pub fn restoring_here(&mut self) {
        if let Some(g) = &mut self.guard {
            g.step(Step::RestoringHere);
        }
    }
}

impl Drop for HandOff {
    fn drop(&mut self) {
        if let Some(g) = self.guard.take() {
            g.done();
        }
    }
}

/// What a guard undoes: the checkpoint of `pid` (the arguments of the hidden `possum
/// checkpoint-guard`, which [`Guard::start`] passes on its command line).
#[derive(Debug, Clone)]
pub struct GuardPlan {
    /// The job.
    pub pid: i32,
    /// Other CUDA processes of the job's tree, checkpointed by the driver with it (`--child`).
    pub children: Vec<i32>,
    /// Those of them whose buffers possum released too, their images in `gpu-PID/`
    /// (`--possum-child`).
    pub possum_children: Vec<i32>,
    /// The temporary image directory (`--tmp`).
    pub tmp: PathBuf,
    /// The image's name once complete (`--final-dir`).
    pub final_dir: PathBuf,
    /// The job's control socket directory (`--socket-dir`).
    pub socket_dir: PathBuf,
    /// The driver library (`POSSUM_LIBCUDA`), loaded only to undo the driver's lock.
    pub libcuda: String,
    /// How long each driver call may take (`POSSUM_DRIVER_DEADLINE_MS`).
    pub driver_deadlines: DriverDeadlines,
    /// The job's GPU memory, for the deadline of a driver restore (`--gpu-bytes`).
    pub gpu_bytes: u64,
}

/// How the guard restores a migration's job here from its image (told what to say):
/// `possum_sequence::migrate::restore_after_migration`.
pub type RestoreHere<'a> = &'a dyn Fn(&GuardPlan, &dyn Fn(&str));

/// The guard: reads the steps done from `steps` (the checkpoint's pipe); at end of input without
/// `done`, undoes them, telling `tell` what it does; a migration's job killed and not yet the
/// destination's is restored here (`restore_here`). Whether there was nothing to undo.
pub fn guard(
    a: &GuardPlan,
    steps: impl BufRead,
    tell: &dyn Fn(&str),
    restore_here: RestoreHere<'_>,
) -> bool {
    // The temporary directory is in use while this guard may undo from it: a later checkpoint
    // into the same DIR leaves it alone (`temps::sweep`). None if it is not there (yet).
    let _in_use = TempLock::take(&a.tmp).ok();
    let mut seen = Vec::new();
    for line in steps.lines() {
        let Ok(line) = line else { break };
        seen.extend(Step::parse(line.trim()));
    }
    let has = |s: Step| seen.contains(&s);
    if has(Step::Done) {
        return true;
    }
    let say = |m: &str| tell(&format!("undoing the checkpoint of process {}: {m}", a.pid));
    // Killed between the rename and telling the guard: the image is named all the same.
    let committed =
        has(Step::Committed) || (!a.tmp.exists() && a.final_dir.join(MANIFEST).is_file());
    // A migration's job that `possum migrate` was restoring here itself when it ended: left
    // running if that restore got it there, else restored from its image.
    if has(Step::Migrating) && has(Step::RestoringHere) && committed {
        restore_unless_running(a, tell, restore_here);
        return false;
    }
    // A migration's job killed, not yet the destination's: it comes back here from its image.
    if has(Step::Migrating) && !has(Step::HandedOff) && committed && !alive(a.pid) {
        restore_here(a, tell);
        return false;
    }
    // Every process whose buffers possum may have released, with its images' directory.
    let released: Vec<(i32, String)> = std::iter::once((a.pid, "gpu".to_string()))
        .chain(a.possum_children.iter().map(|&c| (c, child_gpu_dir(c))))
        .collect();
    // A dump possum did not see end goes on in CRIU's worker (left to finish: stopped midway
    // it may leave its parasite in the tree): nothing is undone while it holds the tree.
    if has(Step::Dumping) && !has(Step::Dumped) {
        wait_for_dump(a, &say);
    }
    // A tree stopped after its dump runs again before anything else (the driver's restore and
    // possum's resume need its threads).
    if has(Step::Stopped) {
        match crate::process::continue_tree(a.pid) {
            Ok(()) => say("the job's tree, stopped after its dump, continued"),
            Err(e) => say(&format!("SIGCONT to the job's tree: {e}")),
        }
    }
    // Steps are announced before they are taken, so a `possum` killed inside a driver call
    // still gets it undone: the driver's own state says what is left to do. A checkpoint without
    // the driver (`--gpu-only`, a HIP job) never announces the lock: no driver is loaded here.
    if has(Step::Locking) && !has(Step::Unlocked) {
        undo_driver_lock(a, &say);
    }
    // The processes resumed with buffers to bring back from the images on demand.
    let mut on_demand = Vec::new();
    if has(Step::Releasing) && !has(Step::Resumed) {
        let dir = if committed { &a.final_dir } else { &a.tmp };
        for (pid, gpu) in &released {
            if resume(a, *pid, &dir.join(gpu), &say) {
                on_demand.push(*pid);
            }
        }
    }
    // The ranks' collective barriers (a resume lifts them too; a process never released
    // still has its up).
    if has(Step::Cutting) && !has(Step::Resumed) {
        for (pid, _) in &released {
            let req = Request::CollectiveLift;
            if possum_control::request(*pid as u32, &a.socket_dir, &req, LIFT_TIMEOUT).is_ok() {
                say(&format!("process {pid}: collective launches let go"));
            }
        }
    }
    put_old_image_back(a, committed, &say);
    if !committed {
        // The GPU images may still be read on demand by the resumed job: keep them until it has
        // them all, then remove the directory.
        for pid in &on_demand {
            wait_restored(*pid, &a.socket_dir);
        }
        let _ = fs::remove_dir_all(&a.tmp);
    }
    false
}

/// How long a restore `possum migrate` began before it ended may take to have the job running,
/// or to be undone (the tasks CRIU had half restored killed by the worker's guard).
const RESTORE_OUTCOME_WAIT: Duration = Duration::from_secs(60);

/// How long a CRIU worker may go on after the `possum` that started it ended (its guard looks
/// every 5 ms: `possum_criu`'s worker guard).
const WORKER_GONE: Duration = Duration::from_millis(500);

/// The job of a migration whose `possum` ended while restoring it here ([`Step::RestoringHere`]):
/// once its possum answers, that restore has it running, and nothing is done; once none of its
/// processes is there, it is restored from its image (`restore_here`). Neither within
/// [`RESTORE_OUTCOME_WAIT`]: said, and left (a second restore would race what is there).
fn restore_unless_running(a: &GuardPlan, tell: &dyn Fn(&str), restore_here: RestoreHere<'_>) {
    let say = |m: &str| {
        tell(&format!(
            "the migration of process {} ended while it restored the job here: {m}",
            a.pid
        ))
    };
    // The restore's CRIU worker is killed by its own guard as this process saw `possum` end
    // (within milliseconds): nothing new is made after this.
    std::thread::sleep(WORKER_GONE);
    let t = std::time::Instant::now();
    let gone = || !alive(a.pid) && !a.children.iter().any(|&c| alive(c));
    let answers = || {
        let one_second = Duration::from_secs(1);
        let status = &Request::Status;
        crate::job::ask_within::<StatusReply>(a.pid, &a.socket_dir, status, one_second).is_ok()
    };
    loop {
        if answers() {
            return say(&format!("it runs (process {}), restored", a.pid));
        }
        if gone() {
            return restore_here(a, tell);
        }
        if t.elapsed() > RESTORE_OUTCOME_WAIT {
            return say(&format!(
                "process {} is there but does not answer after {} s: not restored again (its \
                 image stays at {})",
                a.pid,
                RESTORE_OUTCOME_WAIT.as_secs(),
                a.final_dir.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits (a dump's deadline for the job's memory, and 10 s) until CRIU no longer traces the
/// job's tree, saying so if it still does then.
fn wait_for_dump(a: &GuardPlan, say: &dyn Fn(&str)) {
    let tree: Vec<i32> = std::iter::once(a.pid)
        .chain(a.children.iter().copied())
        .collect();
    let limit = Deadline::DUMP.for_bytes(tree_resident_bytes(a.pid)) + Duration::from_secs(10);
    if !wait_untraced(&tree, limit) {
        say(&format!(
            "CRIU still holds the job's tree after {} s; undoing all the same",
            limit.as_secs()
        ));
    }
}

/// Undoes the driver's lock (or checkpoint) of the job and of its children.
fn undo_driver_lock(a: &GuardPlan, say: &dyn Fn(&str)) {
    match a.driver_deadlines.load(&a.libcuda) {
        Ok(drv) => {
            let limit = a.driver_deadlines.restore.for_bytes(a.gpu_bytes);
            undo_driver(&drv, a.pid, limit, say);
            for &c in &a.children {
                undo_driver(&drv, c, limit, say);
            }
        }
        Err(e) => say(&format!("cannot load the driver: {e}")),
    }
}

/// Resumes process `pid` from its images in `dir`; whether it brings buffers back from them on
/// demand (or its reply was not understood).
fn resume(a: &GuardPlan, pid: i32, dir: &Path, say: &dyn Fn(&str)) -> bool {
    let req = Request::Resume {
        dir: Some(dir.display().to_string()),
    };
    // The job answers one request at a time; a session step still running in it (a
    // release possum did not wait for) says it is busy: ask again until it is done.
    let t = Instant::now();
    loop {
        match possum_control::request(pid as u32, &a.socket_dir, &req, JOB_TIMEOUT) {
            Ok(reply) => {
                say(&format!("process {pid} resumed"));
                // Kept buffers attached again, or every buffer back already: no
                // image is read after this. A reply not understood: waited for.
                return serde_json::from_value::<ResumeReply>(reply).map_or(true, |r| {
                    !r.restoring.is_empty() && r.on_demand != Some(false)
                });
            }
            Err(possum_control::ControlError::Remote(m))
                if m.contains("busy") && t.elapsed() < JOB_TIMEOUT =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                say(&format!("resume of process {pid} failed: {e}"));
                return false;
            }
        }
    }
}

/// `--force` moved the old image aside just before naming the new one: removed if the new one
/// is committed, else put back under its name (if nothing took it).
fn put_old_image_back(a: &GuardPlan, committed: bool, say: &dyn Fn(&str)) {
    let old = a.tmp.with_extension("old");
    if old.exists() {
        if committed {
            let _ = fs::remove_dir_all(&old);
        } else if !a.final_dir.exists() && fs::rename(&old, &a.final_dir).is_ok() {
            say("the old image is back under its name");
        }
    }
}

/// How long the guard waits for a job to lift its collective barrier.
const LIFT_TIMEOUT: Duration = Duration::from_secs(10);

/// Waits until no process of `tree` is traced (CRIU seizes every task it dumps and lets them go
/// when it ends), at most `limit`; whether none is.
fn wait_untraced(tree: &[i32], limit: Duration) -> bool {
    let t = Instant::now();
    loop {
        if !tree.iter().any(|&p| traced(p)) {
            return true;
        }
        if t.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether some process traces `pid` (`TracerPid` in /proc/PID/status; a process that is gone
/// is not traced).
fn traced(pid: i32) -> bool {
    possum_control::proc_text(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("TracerPid:"))
                .map(|v| v.trim() != "0")
        })
        .unwrap_or(false)
}

/// Brings process `pid` back to RUNNING in the driver from wherever a checkpoint left it (a
/// driver restore waited for at most `limit`). A call past its deadline leaves the process as
/// it is: a driver that hangs would hang again.
fn undo_driver(drv: &DriverCheckpoint, pid: i32, limit: Duration, say: &dyn Fn(&str)) {
    for _ in 0..20 {
        let r = match drv.state(pid) {
            Ok(ProcessState::Running) => return,
            Ok(ProcessState::Checkpointed) => {
                drv.restore(pid, &[], limit).map(|()| "driver restore done")
            }
            Ok(ProcessState::Locked) => drv.unlock(pid).map(|()| "driver unlock done"),
            Ok(other) => {
                say(&format!(
                    "the driver reports the process {other}; left as it is"
                ));
                return;
            }
            Err(e) => {
                say(&format!("driver state: {e}"));
                return;
            }
        };
        match r {
            Ok(m) => say(m),
            Err(e @ DriverCkptError::DeadlineExceeded { .. }) => {
                say(&format!("{e}; the process is left as it is"));
                return;
            }
            Err(e) => {
                say(&format!("{e}"));
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// Waits (bounded) until process `pid`'s on-demand restore has finished reading its images.
fn wait_restored(pid: i32, socket_dir: &Path) {
    if alive(pid) {
        crate::job::finished_restore(pid, socket_dir, Duration::from_secs(600));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::temps::tests::{dead_pid, let_go};
    use crate::temps::{in_use, temp_name};
    use nix::sys::ptrace;
    use nix::sys::wait::waitpid;
    use nix::unistd::Pid;
    use std::io;

    #[test]
    fn every_step_reads_back_from_its_name() {
        for s in Step::ALL {
            assert_eq!(Step::parse(s.name()), Some(s));
        }
        assert_eq!(Step::parse("dumpin"), None);
    }

    #[test]
    fn a_traced_tree_is_waited_for_until_its_tracer_lets_go() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        assert!(!traced(pid));
        assert!(wait_untraced(&[pid], Duration::ZERO));
        ptrace::attach(Pid::from_raw(pid)).unwrap();
        waitpid(Pid::from_raw(pid), None).unwrap();
        assert!(traced(pid), "attached: traced");
        assert!(!wait_untraced(
            &[pid, std::process::id() as i32],
            Duration::from_millis(200)
        ));
        ptrace::detach(Pid::from_raw(pid), None).unwrap();
        assert!(wait_untraced(&[pid], Duration::from_secs(10)));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!traced(pid), "a process that is gone is not traced");
    }

    /// Steps that, when the guard reads them, say whether the directory was in use then.
    struct Watched<'a> {
        tmp: &'a Path,
        seen: &'a std::cell::Cell<Option<bool>>,
        text: io::Cursor<&'static [u8]>,
    }

    impl io::Read for Watched<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.seen.get().is_none() {
                self.seen.set(Some(in_use(self.tmp)));
            }
            self.text.read(buf)
        }
    }

    #[test]
    fn the_guard_holds_the_directory_while_it_may_undo() {
        let root = tempfile::tempdir().unwrap();
        let tmp = root.path().join(temp_name("img", 3));
        fs::create_dir(&tmp).unwrap();
        let plan = GuardPlan {
            pid: dead_pid(),
            children: Vec::new(),
            possum_children: Vec::new(),
            tmp: tmp.clone(),
            final_dir: root.path().join("img"),
            socket_dir: root.path().join("sockets"),
            libcuda: String::new(),
            driver_deadlines: Default::default(),
            gpu_bytes: 0,
        };
        let seen = std::cell::Cell::new(None);
        let steps = Watched {
            tmp: &tmp,
            seen: &seen,
            text: io::Cursor::new(b"done\n"),
        };
        assert!(guard(&plan, io::BufReader::new(steps), &|_| (), &|_, _| ()));
        assert_eq!(
            seen.get(),
            Some(true),
            "locked while the guard read its steps"
        );
        assert!(let_go(&tmp), "released when it ended");
    }
}
