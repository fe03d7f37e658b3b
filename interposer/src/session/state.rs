//! The checkpoint session's state in the job: one [`Session`], reached through [`session`].
//!
//! Everything a checkpoint session keeps between the control requests and the job's threads
//! lives here, owned by one value: the op gate's pause ([`Pause`]), the write path's faults
//! ([`Faults`]), the writing functions the job took unwrapped, the step running now, the
//! checkpoint being made ([`Phase`]), the save of a kept one ([`Saving`]), the last figures, the
//! hold's heartbeat, the collective barrier ([`Barrier`]), whether the A/B test runs and the
//! control socket's server. The
//! modules that act on it (`ops::gate`, `ops::park`, `ops::collective`, `session::*`,
//! `hip::session`) hold no state of their own.
//!
//! There is one global: the C entry points and the control socket's thread reach the session
//! without an owner to hand it to them, and the hot path reads the pause flag with one atomic
//! load, so the value is a `static` built at compile time (no lazy initialisation, nothing to
//! check on the launch path). A leaf of the crate's layers: it names no other module, so every
//! layer may reach it. The other owners of the job's state, and the kinds of `static` that stay
//! (real functions, per-thread state, signal-handler atomics, once-cells of set-up, hot
//! counters, log-once flags), are listed in the crate's README ("State and what stays static").
//!
//! ```text
//! Idle ── Checkpoint ──► PreCopied ── PrecopyRound ──► PreCopied
//!   │       (hooks)          │
//!   │                        └── Release ──► Idle (released; Resume restores)
//!   ├── Checkpoint ──► ToHold ── Release (threads parked) ──► Idle
//!   │    (no hooks)
//!   └── CheckpointKept ──► Kept ── Release ──► KeptReleased ── ResumeAndSave ──► Idle
//!                                                              (Saving: Running ─► Done | Failed)
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};
use possum_control::reply::{CheckpointReply, ReleaseReply, SavedReply};
use possum_control::Server;
use possum_engine::image::ImageWriter;
use serde::Serialize;

/// The job's checkpoint session (see the module doc).
#[derive(Debug)]
pub struct Session {
    /// Where the job's operations wait while a checkpoint holds them.
    pub pause: Pause,
    /// Faults of the write path.
    pub faults: Faults,
    /// Driver functions that write device memory which the job got without possum's wrapper (a
    /// `cuGetProcAddress` answer possum could not match to one), as "name (version, flags)": the
    /// hooks may miss what they write, so a checkpoint holds the job's threads for its whole
    /// copy instead of trusting the hooks.
    pub unwrapped: Mutex<Vec<String>>,
    /// The session step running now: one at a time (a second `possum checkpoint` is refused).
    pub busy: Mutex<Option<&'static str>>,
    /// The checkpoint being made.
    pub phase: Mutex<Phase>,
    /// The save of a kept checkpoint's buffers while the job runs; [`Session::save_changed`]
    /// wakes whoever waits for its end.
    pub saving: Mutex<Saving>,
    /// Notified whenever [`Session::saving`] changes.
    pub save_changed: Condvar,
    /// The last session's figures, for `possum status` (`None` before the first).
    pub last: Mutex<Option<Last>>,
    /// Progress of the work done while the job's threads are parked (the watchdog's heartbeat).
    pub beat: AtomicU64,
    /// The barrier that holds NCCL's collective launches for a cut across ranks.
    pub collective: Barrier,
    /// The A/B test of the hooks' cost runs (then a checkpoint is refused).
    pub ab_running: AtomicBool,
    /// The control socket's server, once started (`session::control`); stopped at exit.
    pub server: Mutex<Option<Server>>,
    /// Where the next copy into a checkpoint's images (its first round, or a release's final
    /// copy) records each chunk it writes (`JournalWrites`).
    pub journal: Mutex<Option<PathBuf>>,
}

static SESSION: Session = Session {
    pause: Pause {
        paused: AtomicBool::new(false),
        lock: Mutex::new(()),
        resumed: Condvar::new(),
        waits: AtomicU64::new(0),
        wait_ns: AtomicU64::new(0),
    },
    faults: Faults {
        count: AtomicU64::new(0),
        last: Mutex::new(None),
        at_open: AtomicU64::new(0),
    },
    unwrapped: Mutex::new(Vec::new()),
    busy: Mutex::new(None),
    phase: Mutex::new(Phase::Idle),
    saving: Mutex::new(Saving::Idle),
    save_changed: Condvar::new(),
    last: Mutex::new(None),
    beat: AtomicU64::new(0),
    collective: Barrier {
        counts: Mutex::new(Counts {
            launched: 0,
            barrier: None,
            held: 0,
        }),
        changed: Condvar::new(),
        communicators: Mutex::new(BTreeMap::new()),
    },
    ab_running: AtomicBool::new(false),
    server: Mutex::new(None),
    journal: Mutex::new(None),
};

/// The job's session: the one global through which the entry points, the hooks and the
/// control socket's handlers reach it.
#[inline]
pub fn session() -> &'static Session {
    &SESSION
}

/// The op gate's pause (`ops::gate` acts on it).
#[derive(Debug)]
pub struct Pause {
    /// The job's operations are paused.
    pub paused: AtomicBool,
    /// Taken to change [`Pause::paused`] and to wait on [`Pause::resumed`].
    pub lock: Mutex<()>,
    /// Notified when the pause ends.
    pub resumed: Condvar,
    /// Operations that waited for a resume.
    pub waits: AtomicU64,
    /// How long they waited in total (ns).
    pub wait_ns: AtomicU64,
}

/// Faults of the write path since the library was loaded (`ops::gate::note_fault`).
#[derive(Debug)]
pub struct Faults {
    /// How many.
    pub count: AtomicU64,
    /// The last one's description.
    pub last: Mutex<Option<String>>,
    /// [`Faults::count`] when the checkpoint in progress began: one more at its commit and the
    /// checkpoint is undone.
    pub at_open: AtomicU64,
}

/// Where a checkpoint's images go.
#[derive(Debug, Clone, Default)]
pub struct Target {
    /// The image directory (one image per device under it).
    pub dir: PathBuf,
    /// The earlier image whose unchanged chunks the images reference (`--parent`).
    pub parent: Option<PathBuf>,
}

/// Images being written, one per device (a held release may start them again).
#[derive(Debug, Default)]
pub struct Images {
    /// Where they go.
    pub target: Target,
    /// Each device's image.
    pub writers: Vec<(usize, Arc<ImageWriter>)>,
}

/// The checkpoint being made, from `Checkpoint` to `Release` (a kept one: to `ResumeAndSave`).
#[derive(Debug, Default)]
pub enum Phase {
    /// None.
    #[default]
    Idle,
    /// The images hold a pre-copy, made trusting the hooks to mark what the job writes next;
    /// `PrecopyRound` adds to them, `Release` copies what was written since at T0.
    PreCopied(Images),
    /// The images are open and hold nothing: `Release` parks the job's threads for the whole
    /// copy (the hooks see nothing, or may miss writes).
    ToHold(Images),
    /// A kept checkpoint before its release: nothing is copied; `Release` detaches the buffers,
    /// their memory left with the keeper.
    Kept(Target),
    /// A kept checkpoint released: its buffers are detached; `ResumeAndSave` saves them after
    /// the job runs again (its images are made then).
    KeptReleased(Target),
}

impl Phase {
    /// A kept checkpoint into `dir`'s target, released or not.
    pub fn kept_into(&self, dir: &std::path::Path) -> Option<&Target> {
        match self {
            Phase::Kept(t) | Phase::KeptReleased(t) if t.dir == dir => Some(t),
            _ => None,
        }
    }
}

/// Saving a kept checkpoint's buffers while the job runs (`ResumeAndSave` to `Saved`).
#[derive(Debug, Clone, Default)]
pub enum Saving {
    /// No save was started.
    #[default]
    Idle,
    /// A save runs.
    Running,
    /// The last save's figures.
    Done(SavedReply),
    /// Why the last save failed.
    Failed(String),
}

/// The last session's figures, for `possum status`: each step's, as it answered (a restore's
/// once it has finished).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Last {
    /// The checkpoint's answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointReply>,
    /// The release's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub release: Option<ReleaseReply>,
    /// The last restore's figures (of one device), once it has finished.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restore: Option<RestoreFigures>,
    /// The save's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saved: Option<SavedReply>,
}

/// A restore's figures, as `possum status` shows them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RestoreFigures {
    /// The device.
    pub device: usize,
    /// Why it failed (then nothing else is said).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Buffers restored.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buffers: Option<usize>,
    /// Bytes restored.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// Milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ms: Option<f64>,
    /// Buffers brought back on demand (`false`: restored before the job ran).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_demand: Option<OnDemand>,
    /// Buffers brought back ahead of the job.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetched: Option<u64>,
    /// Chunks the job's threads helped copy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub helped_chunks: Option<u64>,
    /// Operations the hook held until their buffers were back, and how long in all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hook_blocked: Option<u64>,
    /// Milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hook_blocked_ms: Option<f64>,
    /// Buffers mapped from the keeper's stage, and those copied because their stage failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub staged: Option<u64>,
    /// See [`RestoreFigures::staged`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub staged_fallback: Option<u64>,
    /// How long the job waited for its buffers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_waited_ms: Option<f64>,
    /// The buffers it waited on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waited_on: Option<Vec<possum_control::reply::WaitedOn>>,
}

/// How a restore brought buffers back: `false` before the job ran, or how many on demand.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(untagged)]
pub enum OnDemand {
    /// Everything was restored before the job ran (`false`).
    Before(bool),
    /// Buffers brought back as the job asked for them.
    Buffers(u64),
}

/// The collective barrier's state (`ops::collective` acts on it).
#[derive(Debug)]
pub struct Barrier {
    /// The counts and the barrier.
    pub counts: Mutex<Counts>,
    /// Notified at every change of [`Barrier::counts`].
    pub changed: Condvar,
    /// The process's NCCL communicators, by handle: (id, ranks in all).
    pub communicators: Mutex<BTreeMap<usize, (u64, u32)>>,
}

/// The job's collective launches and the barrier that holds them.
#[derive(Debug)]
pub struct Counts {
    /// Collective launches let through.
    pub launched: u64,
    /// The first launch number held, and when the barrier lifts itself.
    pub barrier: Option<(u64, Instant)>,
    /// Threads waiting at the barrier.
    pub held: u32,
}
