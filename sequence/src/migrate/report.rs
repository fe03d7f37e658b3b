//! What a migration reports (part of [`super`]): its phases' timings at the source, what it
//! sent when, and the source's checkpoint.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Serialize, Serializer};

use super::post_copy::PostCopyReport;
use crate::checkpoint::CheckpointReport;
use crate::figures::as_ms;

/// Milliseconds, or null when not known.
pub(super) fn opt_ms<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => as_ms(d, s),
        None => s.serialize_none(),
    }
}

/// How long each phase of a migration took at the source.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct MigrateTimings {
    /// The checkpoint, up to the image committed with the job held.
    #[serde(rename = "checkpoint_ms", serialize_with = "as_ms")]
    pub checkpoint: Duration,
    /// The connection and the handshake.
    #[serde(rename = "connect_ms", serialize_with = "as_ms")]
    pub connect: Duration,
    /// What the pre-copy wrote, sent ahead while the job runs (part of the checkpoint's time).
    #[serde(rename = "ahead_ms", serialize_with = "as_ms")]
    pub ahead: Duration,
    /// The rest of the transfer, the job held, up to `Committed`.
    #[serde(rename = "send_ms", serialize_with = "as_ms")]
    pub send: Duration,
    /// Of that: the files sent ahead hashed again where they may have changed since.
    #[serde(rename = "send_hashing_ms", serialize_with = "as_ms")]
    pub send_hashing: Duration,
    /// Of that: from the last byte sent to the destination's `Committed` (its files synced).
    #[serde(rename = "send_committing_ms", serialize_with = "as_ms")]
    pub send_committing: Duration,
    /// The GPU images as the cut completed them, sent while the driver and CRIU worked (the
    /// job held; part of the checkpoint's time, and of its hold only where it outlasted them).
    #[serde(rename = "held_send_ms", serialize_with = "as_ms")]
    pub held_send: Duration,
    /// The job's kill, its PIDs waited free (and the local image made durable).
    #[serde(rename = "kill_ms", serialize_with = "as_ms")]
    pub kill: Duration,
    /// Of that, the time after the send (the kill runs beside the send unless
    /// `POSSUM_MIGRATE_KILL_WHILE_SENDING=0`; then all of it).
    #[serde(rename = "kill_after_send_ms", serialize_with = "as_ms")]
    pub kill_after_send: Duration,
    /// From `Released` to the destination's `Outcome` (its restore).
    #[serde(rename = "remote_restore_ms", serialize_with = "as_ms")]
    pub remote_restore: Duration,
    /// The job not running: from its hold to its running at the destination, and there its
    /// wait for buffers not yet back ([`Self::waited_after_resume`], when known).
    #[serde(rename = "downtime_ms", serialize_with = "as_ms")]
    pub downtime: Duration,
    /// Of that: how long the job, running at the destination, waited for buffers not yet back
    /// (its own account, which the destination gives with its image's sync; null if not said).
    #[serde(rename = "waited_after_resume_ms", serialize_with = "opt_ms")]
    pub waited_after_resume: Option<Duration>,
    /// After the job ran there: until the destination said its image is on its disk (this
    /// end's is removed only then).
    #[serde(rename = "synced_there_ms", serialize_with = "as_ms")]
    pub synced_there: Duration,
    /// The whole migration.
    #[serde(rename = "total_ms", serialize_with = "as_ms")]
    pub total: Duration,
}

/// A migration made: what `possum migrate` prints.
#[derive(Debug, Serialize)]
pub struct MigrateReport {
    /// The job at the source.
    pub pid: i32,
    /// The destination.
    pub to: String,
    /// The job at the destination.
    pub remote_pid: i32,
    /// Files of the image sent.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// The bytes of them sent ahead, while the job ran (what its pre-copy rounds wrote).
    pub bytes_before_hold: u64,
    /// The pre-copy rounds sent ahead (`checkpoint.figures.precopy_rounds` says what each
    /// copied).
    pub rounds: usize,
    /// Of the bytes sent ahead, those sent while the first pre-copy round ran, as it completed
    /// each chunk, and in so many rounds.
    pub bytes_while_first_round: u64,
    pub rounds_while_first_round: u32,
    /// The bytes of them sent while the job was held (the rest came from those sent ahead):
    /// with those of the GPU images sent while the driver and CRIU worked.
    pub bytes_while_held: u64,
    /// Of those, the bytes sent while the driver and CRIU worked: the GPU images', and parts
    /// of CRIU's pages file as it wrote them.
    pub bytes_while_dumping: u64,
    /// Of those, the parts of CRIU's pages file.
    pub criu_bytes_while_dumping: u64,
    /// Of the bytes sent while held, those sent while the job's final copy ran, as it completed
    /// each chunk (before the `Cut`).
    pub bytes_while_copying: u64,
    /// The rounds those went in (a round reads the chunks completed since the one before, and
    /// sends those that changed since sent ahead).
    pub rounds_while_copying: u32,
    /// The phases' timings.
    pub timings: MigrateTimings,
    /// The job's private memory drafted and sent with the pre-copy rounds (what of it the
    /// cut found unchanged: `checkpoint.figures.hostmem.ahead_reused_bytes`).
    pub host_memory_ahead: HostAhead,
    /// What the destination had loaded into GPU memory of what was sent ahead when the job
    /// was held, and how long the source waited for it, the job running (null: not asked).
    pub loaded_ahead: Option<crate::wire::LoadedAhead>,
    /// The local image, kept: the destination did not say that its own is on its disk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_kept: Option<PathBuf>,
    /// With `post_copy`: what was sent after the transfer (null: nothing was left for it).
    pub post_copy: Option<PostCopyReport>,
    /// The source's checkpoint.
    pub checkpoint: CheckpointReport,
}

/// What drafting the job's private memory for the pre-copy rounds took.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct HostAhead {
    /// Rounds drafted.
    pub rounds: usize,
    /// Bytes written into the drafts (what changed, and what was new).
    pub written_bytes: u64,
    /// Time taken, the job running.
    #[serde(rename = "ms", serialize_with = "as_ms")]
    pub time: Duration,
}
