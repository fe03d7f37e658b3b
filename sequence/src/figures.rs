//! The figures of a checkpoint and of a restore: how long each phase took and what it moved,
//! serialized under the keys `possum checkpoint --json` and `possum restore --json` print
//! (`<step>_ms` in milliseconds, a step absent when it was not taken).

use std::time::{Duration, Instant};

use possum_control::reply::{CopyPipeline, DeviceCopy, WaitedOn};
use serde::{Serialize, Serializer};

/// Milliseconds, to the microsecond.
pub fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Runs `f`, adding the time it took to `slot` (a step taken several times, once per process of
/// the job's tree, sums them).
pub fn timed<T>(slot: &mut Option<Duration>, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    *slot = Some(slot.unwrap_or_default() + t.elapsed());
    r
}

fn opt_ms<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(ms(d.unwrap_or_default()))
}

pub(crate) fn as_ms<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(ms(*d))
}

fn ms_or_null<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_f64(ms(*d)),
        None => s.serialize_none(),
    }
}

/// The steps that give a job its GPU back, at a checkpoint that leaves it running and at a
/// restore (serialized in place, in the figures that hold them).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Resumed {
    /// The driver's restore.
    #[serde(rename = "driver_restore_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver_restore: Step,
    /// The driver's unlock.
    #[serde(rename = "driver_unlock_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver_unlock: Step,
    /// possum's resume of every process.
    #[serde(rename = "resume_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resume: Step,
}

/// One pre-copy round of every process of the job, the job running.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PrecopyRound {
    /// Bytes copied: the buffers written since the round before (all of them in the first).
    pub bytes: u64,
    /// How long it took.
    #[serde(rename = "ms", serialize_with = "as_ms")]
    pub took: Duration,
    /// Where the copies' time went, summed over every device of every process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<CopyPipeline>,
}

impl PrecopyRound {
    /// Counts in one process's copies.
    pub fn add(&mut self, copies: &[DeviceCopy]) {
        self.bytes += copies.iter().map(|d| d.bytes).sum::<u64>();
        for p in copies.iter().filter_map(|d| d.pipeline.as_ref()) {
            self.pipeline
                .get_or_insert_with(CopyPipeline::default)
                .add(p);
        }
    }
}

/// A step's time, `None` when it was not taken.
type Step = Option<Duration>;

/// CRIU's account of a dump (`criu_dump_stats`), from the `stats-dump` it leaves.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CriuDumpStats {
    /// The tree frozen, as CRIU counts it.
    #[serde(rename = "frozen_ms", serialize_with = "as_ms")]
    pub frozen: Duration,
    /// Its memory dumped (collected and written).
    #[serde(rename = "memdump_ms", serialize_with = "as_ms")]
    pub memdump: Duration,
    /// Of that, its memory written to the pages files.
    #[serde(rename = "memwrite_ms", serialize_with = "as_ms")]
    pub memwrite: Duration,
    /// The bytes of memory written.
    pub memory_bytes: u64,
}

impl From<possum_criu::stats::DumpStats> for CriuDumpStats {
    fn from(s: possum_criu::stats::DumpStats) -> Self {
        CriuDumpStats {
            frozen: s.frozen,
            memdump: s.memdump,
            memwrite: s.memwrite,
            memory_bytes: s.memory_bytes,
        }
    }
}

/// CRIU's account of a restore (`criu_restore_stats`), from the `stats-restore` it leaves.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CriuRestoreStats {
    /// The tree forked.
    #[serde(rename = "forking_ms", serialize_with = "as_ms")]
    pub forking: Duration,
    /// The whole restore by CRIU's clock, forking included.
    #[serde(rename = "restore_ms", serialize_with = "as_ms")]
    pub restore: Duration,
    /// The bytes of memory CRIU wrote (not what possum's plugin wrote back).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
}

impl From<possum_criu::stats::RestoreStats> for CriuRestoreStats {
    fn from(s: possum_criu::stats::RestoreStats) -> Self {
        CriuRestoreStats {
            forking: s.forking,
            restore: s.restore,
            memory_bytes: s.memory_bytes,
        }
    }
}

/// A checkpoint's figures (`figures` in its JSON).
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckpointFigures {
    /// The pre-copy (or, for a kept checkpoint, the engines' preparation) of every process.
    #[serde(rename = "engine_snapshot_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_snapshot: Step,
    /// A job of several ranks: their collective launches held until every rank stood at the
    /// same collective boundary ([`crate::ranks`]).
    #[serde(rename = "ranks_cut_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranks_cut: Step,
    /// The pre-copy rounds while the job ran, the first included (more than one only where
    /// asked: a migration's `--max-rounds`); empty without a pre-copy.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub precopy_rounds: Vec<PrecopyRound>,
    /// The cut: the job held, what was written since copied, the buffers' memory released.
    #[serde(rename = "release_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub release: Step,
    /// A kept hold: the check that the keeper still answers (and its revival if not).
    #[serde(rename = "keeper_check_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keeper_check: Step,
    /// The driver's lock of every CUDA process of the tree.
    #[serde(rename = "driver_lock_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver_lock: Step,
    /// The driver's checkpoint (its residue: contexts, memory possum does not manage).
    #[serde(rename = "driver_checkpoint_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver_checkpoint: Step,
    /// CRIU's dump, from its request (a dump made ready ahead: `criu_ready_ms`).
    #[serde(rename = "criu_dump_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criu_dump: Step,
    /// CRIU's dump made ready while the cut and the driver's checkpoint ran, not in the stall:
    /// its worker started, the relay's pipes made.
    #[serde(rename = "criu_ready_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criu_ready: Step,
    /// After CRIU's dump, the job held: the wait for what began while it was held and must be
    /// over before the commit (a migration's send of the GPU images, and of CRIU's pages as
    /// CRIU wrote them).
    #[serde(rename = "held_send_wait_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held_send_wait: Step,
    /// Of CRIU's dump, possum's read of the pages its lazy dump left in the frozen tree
    /// (`POSSUM_DUMP_PAGES`).
    #[serde(rename = "criu_pages_read_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criu_pages_read: Step,
    /// The bytes of that read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criu_pages_read_bytes: Option<u64>,
    /// Of CRIU's dump, from the first byte of the pages CRIU wrote into possum's pipes to the
    /// last copied into the pages files (`POSSUM_DUMP_PAGES=relay`).
    #[serde(rename = "criu_pages_relayed_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criu_pages_relayed: Step,
    /// The bytes relayed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criu_pages_relayed_bytes: Option<u64>,
    /// Of CRIU's dump, the time until its `post-dump` notification (the tree frozen, its
    /// images written but for the pages possum reads then), where one was asked for.
    #[serde(rename = "criu_post_dump_at_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criu_post_dump_at: Step,
    /// CRIU's own account of its dump (the last, where a tree took several).
    #[serde(rename = "criu_dump_stats", skip_serializing_if = "Option::is_none")]
    pub criu_dump_stats: Option<CriuDumpStats>,
    /// The job's private memory taken out of CRIU's images.
    #[serde(rename = "hostmem_split_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hostmem_split: Step,
    /// The driver's restore and unlock, and possum's resume.
    #[serde(flatten)]
    pub resumed: Resumed,
    /// A kept checkpoint: the save of the buffers after the job runs again.
    #[serde(rename = "saved_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saved: Step,
    /// `possum.json` written and the image named.
    #[serde(rename = "commit_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub commit: Step,
    /// The job killed.
    #[serde(rename = "kill_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kill: Step,
    /// The image made durable (fsync), with the job running again.
    #[serde(rename = "sync_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync: Step,
    /// The whole command.
    #[serde(rename = "total_ms", serialize_with = "as_ms")]
    pub total: Duration,
    /// The stall the job saw: the hold, plus the time it waited on possum after it ran again
    /// (as far as that is known when the command returns).
    #[serde(rename = "stall_ms", serialize_with = "as_ms")]
    pub stall: Duration,
    /// How long the job's GPU operations were held.
    #[serde(rename = "hold_ms", serialize_with = "as_ms")]
    pub hold: Duration,
    /// How long the job waited on possum after it ran again: its threads blocked and its streams
    /// waiting while a kept checkpoint's buffers were saved. `None` (null) when not known when the
    /// command returns (buffers still coming back on demand).
    #[serde(rename = "job_waited_ms", serialize_with = "ms_or_null")]
    pub job_waited: Option<Duration>,
    /// The buffers the job waited on longest, longest first.
    pub waited_on: Vec<WaitedOn>,
    /// The stall by who held it.
    #[serde(rename = "stall_breakdown_ms")]
    pub stall_breakdown: StallBreakdown,
    /// What the split of the job's memory moved (null when none was made).
    pub hostmem: Option<HostmemFigures>,
    /// Bytes of the image: CRIU's and possum's GPU images.
    pub image_bytes: u64,
    /// Bytes of CRIU's images.
    pub criu_image_bytes: u64,
    /// Bytes of possum's GPU images.
    pub gpu_image_bytes: u64,
}

/// How many buffers the figures name among those the job waited on.
pub const WAITED_ON_TOP: usize = 8;

/// The buffers waited on longest (at most `top`) of `all`, longest first.
pub fn longest_waits(mut all: Vec<WaitedOn>, top: usize) -> Vec<WaitedOn> {
    all.sort_by(|a, b| {
        b.ms.total_cmp(&a.ms)
            .then(a.device.cmp(&b.device))
            .then(a.id.cmp(&b.id))
    });
    all.truncate(top);
    all
}

/// Who held the job, how long.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct StallBreakdown {
    /// The ranks of a multi-process job brought to one collective boundary.
    #[serde(serialize_with = "as_ms")]
    pub cut: Duration,
    /// possum's release, keeper check and resume.
    #[serde(serialize_with = "as_ms")]
    pub engine: Duration,
    /// The driver's lock, checkpoint, restore and unlock.
    #[serde(serialize_with = "as_ms")]
    pub driver: Duration,
    /// CRIU's dump (and a split made while held).
    #[serde(serialize_with = "as_ms")]
    pub criu: Duration,
    /// Naming the image while held.
    #[serde(serialize_with = "as_ms")]
    pub commit: Duration,
    /// Waiting, after CRIU's dump, for the send begun while held (a migration's).
    #[serde(serialize_with = "as_ms")]
    pub send: Duration,
}

impl CheckpointFigures {
    /// The hold, from the steps taken: `kept` (the image named after the job ran again) and
    /// `split_in_hold` (a split made while a job left running without a keeper was held); the
    /// stall, the hold and [`job_waited`](Self::job_waited).
    pub fn account_stall(&mut self, kept: bool, split_in_hold: bool) {
        let t = |d: Step| d.unwrap_or_default();
        let b = StallBreakdown {
            cut: t(self.ranks_cut),
            engine: t(self.release) + t(self.keeper_check) + t(self.resumed.resume),
            driver: t(self.driver_lock)
                + t(self.driver_checkpoint)
                + t(self.resumed.driver_restore)
                + t(self.resumed.driver_unlock),
            criu: t(self.criu_dump)
                + if split_in_hold {
                    t(self.hostmem_split)
                } else {
                    Duration::ZERO
                },
            commit: if kept { Duration::ZERO } else { t(self.commit) },
            send: t(self.held_send_wait),
        };
        self.hold = b.cut + b.engine + b.driver + b.criu + b.commit + b.send;
        self.stall = self.hold + self.job_waited.unwrap_or_default();
        self.stall_breakdown = b;
    }
}

/// What the split of the job's private memory out of CRIU's images did.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum HostmemFigures {
    /// Not made, and why.
    Off {
        /// Why.
        off: &'static str,
    },
    /// Made.
    Split {
        /// Bytes moved out of CRIU's images.
        moved_bytes: u64,
        /// Bytes left in them.
        kept_bytes: u64,
        /// The processes split.
        processes: Vec<u32>,
        /// Processes left whole, and why.
        left: Vec<LeftWhole>,
        /// The data files that are drafts sent ahead (a migration's), a tail of what they lacked
        /// after each.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        sent_ahead: Vec<String>,
        /// Of the bytes moved, those their drafts already held.
        #[serde(skip_serializing_if = "Option::is_none")]
        ahead_reused_bytes: Option<u64>,
        /// Why a draft sent ahead could not be used, by process.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        ahead_errors: Vec<LeftWhole>,
    },
    /// It failed: the images are whole (CRIU restores them itself).
    Failed {
        /// Why.
        error: String,
    },
}

impl HostmemFigures {
    /// The figures of a split that was made.
    pub fn of_split(rep: &possum_criu::hostmem::SplitReport) -> HostmemFigures {
        let rebased: Vec<_> = rep
            .split
            .iter()
            .filter_map(|t| t.rebased.as_ref())
            .collect();
        let left = |pid: u32, why: &str| LeftWhole {
            pid,
            why: why.to_string(),
        };
        HostmemFigures::Split {
            moved_bytes: rep.moved_bytes(),
            kept_bytes: rep.split.iter().map(|t| t.kept_bytes).sum(),
            processes: rep.split.iter().map(|t| t.pid).collect(),
            left: rep.left.iter().map(|(p, w)| left(*p, w)).collect(),
            sent_ahead: rebased.iter().map(|f| f.data_file.clone()).collect(),
            ahead_reused_bytes: (!rebased.is_empty())
                .then(|| rebased.iter().map(|f| f.reused_bytes).sum()),
            ahead_errors: (rep.split.iter())
                .filter_map(|t| t.ahead_error.as_deref().map(|e| left(t.pid, e)))
                .collect(),
        }
    }
}

/// A process whose memory the split left in CRIU's images.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LeftWhole {
    /// The process.
    pub pid: u32,
    /// Why.
    pub why: String,
}

/// A restore's figures (`figures` in its JSON).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RestoreFigures {
    /// CRIU's own account of its restore.
    #[serde(rename = "criu_restore_stats", skip_serializing_if = "Option::is_none")]
    pub criu_restore_stats: Option<CriuRestoreStats>,
    /// The keeper asked to load the GPU images while CRIU restores the process.
    #[serde(rename = "stage_begin_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage_begin: Step,
    /// CRIU's restore.
    #[serde(rename = "criu_restore_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criu_restore: Step,
    /// CRIU's restore, again without the keeper started for the staging.
    #[serde(rename = "criu_restore_again_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criu_restore_again: Step,
    /// A keeper started for the restored job.
    #[serde(rename = "keeper_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keeper: Step,
    /// The driver's restore and unlock, and possum's resume.
    #[serde(flatten)]
    pub resumed: Resumed,
    /// possum's CRIU plugin writing back the memory taken out of CRIU's images (part of CRIU's
    /// time), from CRIU's log.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hostmem_fill_ms: Option<f64>,
    /// The bytes it wrote back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hostmem_fill_bytes: Option<u64>,
    /// The image opened, CRIU and the driver found, CRIU's worker started
    /// ([`crate::restore::open`]); a migration's
    /// destination does it while its source kills the job, and then it is not in `prepare_ms`
    /// nor in `total_ms`.
    #[serde(rename = "open_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub open: Step,
    /// Of `open`, CRIU's worker started and made ready for the restore; absent where the
    /// restore started its own at its request.
    #[serde(rename = "criu_ready_ms", serialize_with = "opt_ms")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criu_ready: Step,
    /// Everything before the first process is started (checks of the image and the GPUs).
    #[serde(rename = "prepare_ms", serialize_with = "as_ms")]
    pub prepare: Duration,
    /// The whole command.
    #[serde(rename = "total_ms", serialize_with = "as_ms")]
    pub total: Duration,
    /// How long the restored job waited for buffers not yet back: 0 when every buffer was back
    /// before it ran again; `None` (null) while they come back on demand, not known when the
    /// command returns (the job's `possum status` counts it once they are all back).
    #[serde(rename = "job_waited_ms", serialize_with = "ms_or_null")]
    pub job_waited: Option<Duration>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A round's figures sum every process's devices: bytes, and where their time went; a
    /// round whose copies said nothing of it has no pipeline in its JSON.
    #[test]
    fn a_round_sums_its_copies_and_their_pipelines() {
        let copy = |bytes, p: Option<(u64, f64)>| DeviceCopy {
            bytes,
            pipeline: p.map(|(writers, sink_ms)| CopyPipeline {
                writers,
                staging_wait_ms: 1.0,
                copy_wait_ms: 2.0,
                sink_ms,
            }),
            ..DeviceCopy::default()
        };
        let mut r = PrecopyRound::default();
        r.add(&[copy(10, None)]);
        assert_eq!(
            serde_json::to_value(r).unwrap(),
            json!({"bytes": 10, "ms": 0.0})
        );
        r.add(&[copy(5, Some((6, 30.0))), copy(7, Some((16, 12.5)))]);
        let p = r.pipeline.unwrap();
        assert_eq!(r.bytes, 22);
        assert_eq!((p.writers, p.sink_ms, p.copy_wait_ms), (22, 42.5, 4.0));
        // Summed to the microsecond, as every figure (`possum.json`'s check is of their text).
        r.add(&[copy(1, Some((1, 0.123_456_789)))]);
        assert_eq!(r.pipeline.unwrap().sink_ms, 42.623);
    }

    /// The keys are those the JSON of the checkpoint always had: steps not taken are absent.
    #[test]
    fn checkpoint_figures_keep_their_keys() {
        let mut f = CheckpointFigures::default();
        timed(&mut f.release, || ());
        f.release = Some(Duration::from_micros(1500));
        f.resumed.resume = Some(Duration::from_millis(2));
        f.commit = Some(Duration::from_millis(3));
        f.total = Duration::from_millis(10);
        f.account_stall(false, false);
        f.hostmem = Some(HostmemFigures::Off {
            off: "no CRIU plugin",
        });
        let v = serde_json::to_value(&f).unwrap();
        assert_eq!(v["release_ms"], json!(1.5));
        assert_eq!(v["stall_ms"], json!(6.5));
        assert_eq!(v["hold_ms"], json!(6.5));
        assert_eq!(v["job_waited_ms"], json!(null));
        assert_eq!(
            v["stall_breakdown_ms"],
            json!({"cut": 0.0, "engine": 3.5, "driver": 0.0, "criu": 0.0, "commit": 3.0, "send": 0.0})
        );
        assert_eq!(v["hostmem"], json!({"off": "no CRIU plugin"}));
        assert!(v.get("criu_dump_ms").is_none());
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            [
                "commit_ms",
                "criu_image_bytes",
                "gpu_image_bytes",
                "hold_ms",
                "hostmem",
                "image_bytes",
                "job_waited_ms",
                "release_ms",
                "resume_ms",
                "stall_breakdown_ms",
                "stall_ms",
                "total_ms",
                "waited_on"
            ]
        );
        // A kept checkpoint names its image after the job runs again: not part of the stall;
        // the time the job waited on its save is.
        f.job_waited = Some(Duration::from_millis(2));
        f.account_stall(true, false);
        let v = serde_json::to_value(&f).unwrap();
        assert_eq!(v["hold_ms"], json!(3.5));
        assert_eq!(v["job_waited_ms"], json!(2.0));
        assert_eq!(v["stall_ms"], json!(5.5));
        // The ranks of a multi-process job held at their collective boundary: part of the hold.
        f.ranks_cut = Some(Duration::from_millis(4));
        f.account_stall(true, false);
        let v = serde_json::to_value(&f).unwrap();
        assert_eq!(v["ranks_cut_ms"], json!(4.0));
        assert_eq!(v["stall_breakdown_ms"]["cut"], json!(4.0));
        assert_eq!(v["hold_ms"], json!(7.5));
        // A migration's wait for its send begun while held: part of the hold.
        f.held_send_wait = Some(Duration::from_millis(5));
        f.account_stall(true, false);
        let v = serde_json::to_value(f).unwrap();
        assert_eq!(v["held_send_wait_ms"], json!(5.0));
        assert_eq!(v["stall_breakdown_ms"]["send"], json!(5.0));
        assert_eq!(v["hold_ms"], json!(12.5));
    }

    #[test]
    fn the_longest_waits_come_first_and_at_most_top() {
        let w = |device, id, ms| WaitedOn {
            device,
            id,
            va: id << 12,
            size: 4096,
            ms,
        };
        let all = vec![w(0, 1, 1.0), w(1, 2, 3.0), w(0, 3, 2.0), w(0, 4, 3.0)];
        let top: Vec<(usize, u64)> = longest_waits(all, 3)
            .iter()
            .map(|w| (w.device, w.id))
            .collect();
        assert_eq!(top, [(0, 4), (1, 2), (0, 3)]);
    }

    #[test]
    fn restore_figures_keep_their_keys() {
        let f = RestoreFigures {
            criu_restore: Some(Duration::from_millis(4)),
            hostmem_fill_bytes: Some(7),
            hostmem_fill_ms: Some(1.25),
            ..RestoreFigures::default()
        };
        let v = serde_json::to_value(f).unwrap();
        assert_eq!(
            v,
            json!({"criu_restore_ms": 4.0, "hostmem_fill_ms": 1.25, "hostmem_fill_bytes": 7,
                   "prepare_ms": 0.0, "total_ms": 0.0, "job_waited_ms": null})
        );
    }
}
