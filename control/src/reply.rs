//! The replies the command line reads, as types.
//!
//! Each type parses what libpossum.so answers to one [`Request`](crate::Request): every field is
//! optional or defaulted (`#[serde(default)]`), so a reply from an older or newer library, with
//! fields missing or added, still parses; unknown fields are ignored. Only the fields a reader
//! uses are typed. A reply that is passed on verbatim (`possum checkpoint --json` embeds the
//! job's reports) is read as a [`Reply`], which keeps the job's JSON beside the typed view.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ControlError;

/// A reply read as `R`, with the JSON the job sent (serialized as that JSON, unchanged).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reply<R> {
    /// The typed view.
    pub body: R,
    /// The reply as the job sent it.
    pub raw: Value,
}

impl<R: DeserializeOwned> Reply<R> {
    /// Reads `raw` as `R`; a reply that does not fit `R` is a [`ControlError::Protocol`].
    pub fn parse(raw: Value) -> Result<Reply<R>, ControlError> {
        let body = R::deserialize(&raw).map_err(|e| {
            ControlError::Protocol(format!(
                "reply does not fit {}: {e}",
                std::any::type_name::<R>()
            ))
        })?;
        Ok(Reply { body, raw })
    }
}

impl<R> Serialize for Reply<R> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.raw.serialize(s)
    }
}

/// A field sent as `null` reads as its default, as one that is absent does.
fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Option::<T>::deserialize(d).map(Option::unwrap_or_default)
}

/// The answer to `Status` (what `possum status` prints): the fields a checkpoint reads.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct StatusReply {
    /// The job's pid.
    pub pid: Option<u32>,
    /// How possum sees the job's operations: `entry`, `cupti` or `off` (`POSSUM_HOOKS`).
    pub hooks: Option<String>,
    /// What possum manages; absent until the job has used CUDA.
    pub possum: Option<PossumStatus>,
    /// The entry points' statistics (with `hooks` = `entry`).
    pub entry: Option<EntryStats>,
}

/// How the driver's entry points were handed out (`Status`'s `entry`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct EntryStats {
    /// Entry points possum wraps.
    #[serde(deserialize_with = "null_default")]
    pub wrapped: u64,
    /// Wrappers handed out by `cuGetProcAddress`.
    #[serde(deserialize_with = "null_default")]
    pub swapped_proc_address: u64,
    /// Wrappers handed out by `dlsym`.
    #[serde(deserialize_with = "null_default")]
    pub swapped_dlsym: u64,
    /// Other `cuGetProcAddress` answers, passed through.
    #[serde(deserialize_with = "null_default")]
    pub passed_proc_address: u64,
    /// Unknown versions of wrapped names.
    #[serde(deserialize_with = "null_default")]
    pub unmatched: Vec<Value>,
}

/// `Status`'s `possum`: the engines and the session.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct PossumStatus {
    /// One per device possum manages.
    #[serde(deserialize_with = "null_default")]
    pub engines: Vec<EngineStatus>,
    /// GPU memory the job has that possum does not manage.
    pub unmanaged: Option<Unmanaged>,
    /// The checkpoint session in the job.
    pub session: Option<SessionStatus>,
    /// The job's own virtual-memory mappings possum serves (`POSSUM_SERVE_VMM`).
    pub vmm: Option<VmmStatus>,
    /// Stream-ordered allocations possum serves (`POSSUM_SERVE_POOLS`).
    pub pools: Option<PoolsStatus>,
}

/// `Status`'s `possum.vmm`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct VmmStatus {
    /// possum serves them.
    #[serde(deserialize_with = "null_default")]
    pub serving: bool,
    /// Pieces mapped as engine buffers now.
    #[serde(deserialize_with = "null_default")]
    pub pieces_mapped_now: u64,
    /// possum's handles alive.
    #[serde(deserialize_with = "null_default")]
    pub handles_live: u64,
    /// Handles exported to other processes.
    #[serde(deserialize_with = "null_default")]
    pub handles_shared: u64,
    /// `cuMemCreate` calls left to the driver (properties possum does not serve).
    #[serde(deserialize_with = "null_default")]
    pub left_to_driver: u64,
    /// The first of those calls' properties.
    pub left_to_driver_first_prop: Option<String>,
}

/// `Status`'s `possum.pools`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct PoolsStatus {
    /// possum serves them.
    #[serde(deserialize_with = "null_default")]
    pub serving: bool,
    /// Blocks alive.
    #[serde(deserialize_with = "null_default")]
    pub blocks_live: u64,
    /// Their bytes.
    #[serde(deserialize_with = "null_default")]
    pub bytes_live: u64,
    /// Engine slabs they live in.
    #[serde(deserialize_with = "null_default")]
    pub slabs: u64,
    /// Blocks freed, waiting for their stream.
    #[serde(deserialize_with = "null_default")]
    pub blocks_pending_free: u64,
    /// Allocations served by a block freed on their stream.
    #[serde(deserialize_with = "null_default")]
    pub reused_on_their_stream: u64,
    /// Allocations served.
    #[serde(deserialize_with = "null_default")]
    pub allocations_served: u64,
}

/// One device's engine in `Status`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct EngineStatus {
    /// Its device ordinal.
    #[serde(deserialize_with = "null_default")]
    pub device: usize,
    /// The engine's figures.
    #[serde(deserialize_with = "null_default")]
    pub engine: EngineFigures,
    /// The keeper its buffers' memory comes from, if any.
    pub keeper: Option<KeeperStatus>,
}

/// An engine's figures (the fields read).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct EngineFigures {
    /// The bytes of its buffers.
    pub bytes: Option<u64>,
    /// Its buffers.
    #[serde(deserialize_with = "null_default")]
    pub buffers: u64,
    /// Bytes backed by GPU memory now.
    #[serde(deserialize_with = "null_default")]
    pub resident_bytes: u64,
    /// Bytes written since the last pre-copy.
    #[serde(deserialize_with = "null_default")]
    pub dirty_bytes: u64,
    /// Writes are recorded (a checkpoint open to its restore); absent from older libraries.
    pub tracking: Option<bool>,
    /// The engine's phase.
    pub phase: Option<String>,
}

/// The keeper serving an engine's buffer memory.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct KeeperStatus {
    /// Its socket.
    pub name: Option<String>,
    /// Whether it answers.
    pub reachable: Option<bool>,
    /// Allocations it holds for the job.
    pub allocations: Option<u64>,
    /// Their bytes.
    pub bytes: Option<u64>,
    /// Bytes of memory detached from the job and retained for it.
    pub retained_bytes: Option<u64>,
    /// The engine's mappings of the keeper's memory.
    pub mappings_kept: Option<u64>,
    /// The engine's mappings of its own memory.
    pub mappings_own: Option<u64>,
    /// The keeper's spare image memory, in words.
    pub spare: Option<String>,
}

/// GPU memory possum does not manage.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Unmanaged {
    /// Allocations.
    #[serde(deserialize_with = "null_default")]
    pub allocations: u64,
    /// Their bytes.
    #[serde(deserialize_with = "null_default")]
    pub bytes: u64,
    /// By the entry point that made them (`cuMemAllocManaged`, ...).
    #[serde(deserialize_with = "null_default")]
    pub by_kind: BTreeMap<String, Allocations>,
}

/// A count of allocations and their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct Allocations {
    /// How many.
    #[serde(deserialize_with = "null_default")]
    pub allocations: u64,
    /// Their bytes.
    #[serde(deserialize_with = "null_default")]
    pub bytes: u64,
}

/// The job's checkpoint session, in `Status`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SessionStatus {
    /// The job's GPU operations are held.
    #[serde(deserialize_with = "null_default")]
    pub paused: bool,
    /// The session step running now, if any.
    pub busy: Option<String>,
    /// CUPTI's callbacks are subscribed.
    #[serde(deserialize_with = "null_default")]
    pub cupti_attached: bool,
    /// possum sees the job's operations now (absent from libraries older than the entry points'
    /// hooks).
    pub hooks_live: Option<bool>,
    /// The last figures of each session step.
    #[serde(deserialize_with = "null_default")]
    pub last: SessionLast,
}

/// The last figures of the session's steps (kept opaque: only their presence is read).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SessionLast {
    /// The last restore's figures, once it has finished.
    pub restore: Option<Value>,
}

/// The answer to `Checkpoint` and `CheckpointKept`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct CheckpointReply {
    /// The pre-copy, per device.
    #[serde(deserialize_with = "null_default")]
    pub precopy: Vec<DeviceCopy>,
    /// possum sees the job's operations (a pre-copy was made).
    pub hooks: Option<bool>,
    /// A kept checkpoint: nothing copied yet, the buffers saved after the job runs again.
    #[serde(deserialize_with = "null_default")]
    pub kept: bool,
    /// Milliseconds.
    pub ms: Option<f64>,
}

/// A copy of one device's buffers.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct DeviceCopy {
    /// The device ordinal.
    #[serde(deserialize_with = "null_default")]
    pub device: usize,
    /// Buffers copied.
    #[serde(deserialize_with = "null_default")]
    pub buffers: u64,
    /// Bytes copied.
    #[serde(deserialize_with = "null_default")]
    pub bytes: u64,
    /// Milliseconds.
    pub ms: Option<f64>,
}

/// The answer to `Release` and `ReleaseKeeping`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct ReleaseReply {
    /// The copy made while held, per device (what was written since the pre-copy, or everything
    /// for a job whose threads were parked).
    #[serde(rename = "final")]
    #[serde(deserialize_with = "null_default")]
    pub finals: Vec<DeviceCopy>,
    /// Bytes of GPU memory released.
    #[serde(deserialize_with = "null_default")]
    pub released_bytes: u64,
    /// A kept checkpoint: bytes detached, left with the keeper.
    pub kept_bytes: Option<u64>,
    /// Devices whose buffers stay on the GPU with the keeper for a restore.
    #[serde(deserialize_with = "null_default")]
    pub held_for_restore: Vec<usize>,
    /// The epochs the keeper holds them under.
    #[serde(deserialize_with = "null_default")]
    pub held_epochs: Vec<HeldEpoch>,
    /// How the job was held, when not at the op gate (`threads parked`).
    pub held: Option<String>,
    /// Milliseconds.
    pub ms: Option<f64>,
}

impl ReleaseReply {
    /// The buffers and bytes copied while held, over every device.
    pub fn copied(&self) -> (u64, u64) {
        self.finals
            .iter()
            .fold((0, 0), |(n, b), f| (n + f.buffers, b + f.bytes))
    }
}

/// A device's memory a keeper holds for a restore, and the epoch it is held under.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct HeldEpoch {
    /// The device ordinal.
    pub device: usize,
    /// The epoch.
    pub epoch: u64,
}

/// The answer to `Resume` and `ResumeAndSave`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct ResumeReply {
    /// Devices whose buffers come back from the image.
    #[serde(deserialize_with = "null_default")]
    pub restoring: Vec<usize>,
    /// Whether they come back on demand (false: every buffer was back before the job ran on).
    pub on_demand: Option<bool>,
    /// Devices whose buffers the keeper still held: mapped again, nothing copied.
    #[serde(deserialize_with = "null_default")]
    pub attached: Vec<usize>,
    /// The keeper's stages the restore took (loaded while CRIU restored the job).
    #[serde(deserialize_with = "null_default")]
    pub staged: Vec<StageTaken>,
    /// Devices whose kept buffers are being saved.
    #[serde(deserialize_with = "null_default")]
    pub saving: Vec<usize>,
    /// Milliseconds.
    pub ms: Option<f64>,
}

/// A keeper's stage a restored device took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct StageTaken {
    /// The device ordinal.
    #[serde(deserialize_with = "null_default")]
    pub device: usize,
    /// The stage's id at the keeper.
    #[serde(deserialize_with = "null_default")]
    pub stage: u64,
    /// Buffers it holds.
    #[serde(deserialize_with = "null_default")]
    pub buffers: u64,
}

/// The answer to `Saved`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SavedReply {
    /// Per device.
    #[serde(deserialize_with = "null_default")]
    pub saved: Vec<DeviceCopy>,
    /// Milliseconds.
    pub ms: Option<f64>,
}

/// The answer to `Cupti`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct CuptiReply {
    /// CUPTI's callbacks are subscribed now.
    #[serde(deserialize_with = "null_default")]
    pub cupti_attached: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The replies parse what libpossum.so sends (shapes as in the interposer's session).
    #[test]
    fn replies_parse_what_the_job_sends() {
        let status = json!({"pid": 7, "hooks": "entry", "possum": {
            "engines": [{"device": 0, "name": "fake", "engine": {"bytes": 4096, "buffers": 2},
                         "keeper": {"name": "/k/keeper-0.sock", "reachable": true}},
                        {"device": 1, "engine": {"bytes": 10}, "keeper": null}],
            "unmanaged": {"allocations": 1, "bytes": 64,
                          "by_kind": {"cuMemAllocManaged": {"allocations": 1, "bytes": 64}}},
            "session": {"paused": false, "cupti_attached": false, "hooks_live": true,
                        "busy": null, "last": {"restore": {"device": 0}}}}});
        let s: StatusReply = Reply::parse(status).unwrap().body;
        let p = s.possum.unwrap();
        assert_eq!(s.hooks.as_deref(), Some("entry"));
        assert_eq!(p.engines[0].engine.bytes, Some(4096));
        assert!(p.engines[0].keeper.is_some() && p.engines[1].keeper.is_none());
        assert_eq!(p.unmanaged.unwrap().by_kind["cuMemAllocManaged"].bytes, 64);
        let session = p.session.unwrap();
        assert_eq!(session.hooks_live, Some(true));
        assert!(session.last.restore.is_some());
        assert_eq!(session.busy, None);
        // Fields sent as null (a session with no step yet) read as their defaults.
        let fresh =
            json!({"possum": {"engines": null, "session": {"last": null, "cupti_attached": null}}});
        let p = Reply::<StatusReply>::parse(fresh)
            .unwrap()
            .body
            .possum
            .unwrap();
        assert!(p.engines.is_empty() && p.session.unwrap().last.restore.is_none());
        assert!(p.unmanaged.is_none() && p.vmm.is_none() && p.pools.is_none());
        // A job that has not used CUDA yet: no `possum`.
        let s: StatusReply = Reply::parse(json!({"pid": 7, "hooks": "entry"}))
            .unwrap()
            .body;
        assert!(s.possum.is_none());

        let release = json!({"final": [{"device": 0, "buffers": 3, "bytes": 300, "ms": 1.5},
                                       {"device": 1, "buffers": 1, "bytes": 10}],
                             "released_bytes": 310, "held_for_restore": [0],
                             "held_epochs": [{"device": 0, "epoch": 9}], "ms": 2.0});
        let r: Reply<ReleaseReply> = Reply::parse(release.clone()).unwrap();
        assert_eq!(r.body.copied(), (4, 310));
        assert_eq!(
            r.body.held_epochs,
            [HeldEpoch {
                device: 0,
                epoch: 9
            }]
        );
        // Passed on verbatim.
        assert_eq!(serde_json::to_value(&r).unwrap(), release);

        let resume = json!({"restoring": [0], "on_demand": true, "attached": [],
                            "kept_memory_gone": [], "staged": [{"device": 0, "stage": 5,
                            "buffers": 2}], "moved": null, "saving": []});
        let r: ResumeReply = Reply::parse(resume).unwrap().body;
        assert_eq!(r.on_demand, Some(true));
        assert_eq!(r.staged[0].stage, 5);
        let c: CheckpointReply = Reply::parse(json!({"precopy": [], "hooks": true, "kept": true}))
            .unwrap()
            .body;
        assert!(c.kept);
    }

    /// A reply of the wrong shape is a protocol error naming the type, not a silent default.
    #[test]
    fn a_reply_of_the_wrong_shape_is_an_error() {
        let e = Reply::<ReleaseReply>::parse(json!({"final": "all of it"})).unwrap_err();
        assert!(
            matches!(&e, ControlError::Protocol(m) if m.contains("ReleaseReply")),
            "{e}"
        );
    }
}
