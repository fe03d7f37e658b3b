//! The replies to the control requests, as types: libpossum.so builds its answers to the session
//! requests from them, and the command line reads them.
//!
//! Each type parses what libpossum.so answers to one [`Request`](crate::Request): every field is
//! optional or defaulted (`#[serde(default)]`), so a reply from an older or newer library, with
//! fields missing or added, still parses; unknown fields are ignored. Only the fields a reader
//! uses are typed in [`StatusReply`]; the session replies type every field the job sends, an
//! optional one left out when it is `None`. A reply that is passed on verbatim (`possum
//! checkpoint --json` embeds the job's reports) is read as a [`Reply`], which keeps the job's
//! JSON beside the typed view.

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
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
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
    /// The GPU runtime possum serves the job on: `hip` once the job has used AMD's HIP
    /// runtime through possum's HIP front end; absent for CUDA (the default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
}

impl StatusReply {
    /// The job's GPU work goes through possum's HIP front end.
    pub fn is_hip(&self) -> bool {
        self.runtime.as_deref() == Some(RUNTIME_HIP)
    }
}

/// [`StatusReply::runtime`] of a job served by possum's HIP front end.
pub const RUNTIME_HIP: &str = "hip";

/// How the driver's entry points were handed out (`Status`'s `entry`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
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
    /// Memory other processes shared with this one, imported through possum.
    pub imports: Option<ImportsStatus>,
    /// Stream-ordered allocations possum serves (`POSSUM_SERVE_POOLS`).
    pub pools: Option<PoolsStatus>,
}

/// `Status`'s `possum.imports`: memory another process of the job shared (an fd its keeper
/// handed out), imported as possum's handles, released at each checkpoint and mapped again.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct ImportsStatus {
    /// Imports possum answered.
    #[serde(deserialize_with = "null_default")]
    pub imported: u64,
    /// Handles live now.
    #[serde(deserialize_with = "null_default")]
    pub live: u64,
    /// Of them mapped now.
    #[serde(deserialize_with = "null_default")]
    pub mapped_now: u64,
    /// Mappings released for checkpoints (each mapped again at the resume).
    #[serde(deserialize_with = "null_default")]
    pub released_at_checkpoints: u64,
}

/// `Status`'s `possum.vmm`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
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

/// The kind ([`Unmanaged::by_kind`]) of mappings of memory another process shared with the job
/// (`cuMemImportFromShareableHandle`, then `cuMemMap`): NVIDIA's driver cannot restore a process
/// that maps it.
pub const IMPORTED_MAPPING: &str = "cuMemMap of imported memory";

/// GPU memory possum does not manage.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
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
    /// The job's collective launches (NCCL's kernels) and its barrier.
    #[serde(deserialize_with = "null_default")]
    pub collectives: CollectiveReply,
}

/// The last figures of the session's steps (kept opaque: only their presence is read).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct SessionLast {
    /// The last restore's figures, once it has finished.
    pub restore: Option<Value>,
}

/// The answer to `Checkpoint` and `CheckpointKept`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct CheckpointReply {
    /// The pre-copy, per device.
    #[serde(deserialize_with = "null_default")]
    pub precopy: Vec<DeviceCopy>,
    /// possum sees the job's operations (a pre-copy was made).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hooks: Option<bool>,
    /// A kept checkpoint: nothing copied yet, the buffers saved after the job runs again.
    #[serde(deserialize_with = "null_default")]
    pub kept: bool,
    /// Milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ms: Option<f64>,
}

/// A copy of one device's buffers (a pre-copy, a copy while held, or a save). The optional
/// figures are those of the copy that has them.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ms: Option<f64>,
    /// A pre-copy: buffers written again while it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dirty_after: Option<u64>,
    /// A copy while held: milliseconds waiting for the device's work first (with the job
    /// paused at the op gate, every device's fence at once: the same figure for each).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_ms: Option<f64>,
    /// A copy while held: milliseconds committing its image (its manifest written, its
    /// directory renamed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub commit_ms: Option<f64>,
    /// A save: buffers copied ahead of the job's writes to them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cow_priority: Option<u64>,
    /// A save: buffers shadowed on the device before the job wrote them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cow_shadow: Option<u64>,
    /// A save: the most bytes of shadows at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadow_peak: Option<u64>,
    /// A save: buffers shadowed at its start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot_shadows: Option<u64>,
    /// A save: shadows the keeper saved into its spare image memory; a copy while held: the
    /// buffers it saved there, whole or the chunks that changed (`POSSUM_HELD_SPARE=1`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadows_saved_by_keeper: Option<u64>,
    /// A save: its rate, in GB/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gb_per_s: Option<f64>,
    /// The committed image's data bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_bytes: Option<u64>,
    /// The committed image's buffers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_buffers: Option<u64>,
    /// A save: milliseconds the job waited on it after it ran again (its threads blocked by
    /// copy-on-write, and its streams waiting for a buffer's copy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_waited_ms: Option<f64>,
    /// A save: the buffers the job waited on longest, longest first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waited_on: Option<Vec<WaitedOn>>,
    /// Bytes fingerprinted on the device (at T0, or at a pre-copy round's start).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fingerprinted_bytes: Option<u64>,
    /// Milliseconds that took.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fingerprint_ms: Option<f64>,
    /// Bytes not copied: the image already held them, proven equal by fingerprint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proven_bytes: Option<u64>,
    /// Bytes not copied: an earlier image (the parent) holds them, referenced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reused_bytes: Option<u64>,
    /// A pre-copy round or a copy while held: what it wrote into the image's data files, each
    /// of them named (unchanged ones with no range). A migration sends again only these
    /// ranges of the files it sent ahead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub written: Option<Vec<WrittenFile>>,
    /// Where the copy's time went, summed over its threads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<CopyPipeline>,
}

/// Where a copy's time went, each stage summed over the threads at it (milliseconds). With
/// `writers` threads, `sink_ms / writers` close to the copy's `ms` says the writers (checksum
/// and write) bound it; `copy_wait_ms / writers` close to it, the device; `staging_wait_ms`
/// close to it, the staging buffers coming back too slowly.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct CopyPipeline {
    /// Writer threads.
    #[serde(deserialize_with = "null_default")]
    pub writers: u64,
    /// Waiting for a free staging buffer.
    #[serde(deserialize_with = "null_default")]
    pub staging_wait_ms: f64,
    /// Writers waiting for the device's copy of their chunk.
    #[serde(deserialize_with = "null_default")]
    pub copy_wait_ms: f64,
    /// Writers checksumming and writing chunks into the image.
    #[serde(deserialize_with = "null_default")]
    pub sink_ms: f64,
}

impl CopyPipeline {
    /// `writers`' time at each stage, to the microsecond as every figure possum writes
    /// (`possum.json`'s check is of their text).
    pub fn of(writers: u64, [staging_wait, copy_wait, sink]: [std::time::Duration; 3]) -> Self {
        let ms = |d: std::time::Duration| to_the_microsecond(d.as_secs_f64() * 1e3);
        CopyPipeline {
            writers,
            staging_wait_ms: ms(staging_wait),
            copy_wait_ms: ms(copy_wait),
            sink_ms: ms(sink),
        }
    }

    /// Adds `other`'s threads and times (a sum over copies), still to the microsecond.
    pub fn add(&mut self, other: &CopyPipeline) {
        self.writers += other.writers;
        self.staging_wait_ms = to_the_microsecond(self.staging_wait_ms + other.staging_wait_ms);
        self.copy_wait_ms = to_the_microsecond(self.copy_wait_ms + other.copy_wait_ms);
        self.sink_ms = to_the_microsecond(self.sink_ms + other.sink_ms);
    }
}

/// Milliseconds `ms` rounded to the microsecond.
fn to_the_microsecond(ms: f64) -> f64 {
    (ms * 1e3).round() / 1e3
}

/// The byte ranges a copy wrote into one data file of an image.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct WrittenFile {
    /// The file's device number.
    #[serde(deserialize_with = "null_default")]
    pub dev: u64,
    /// Its inode.
    #[serde(deserialize_with = "null_default")]
    pub ino: u64,
    /// (offset, length) of each range written, in order.
    #[serde(deserialize_with = "null_default")]
    pub ranges: Vec<[u64; 2]>,
}

/// A buffer the job waited on, and how long.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct WaitedOn {
    /// The device ordinal.
    #[serde(deserialize_with = "null_default")]
    pub device: usize,
    /// The buffer's id.
    #[serde(deserialize_with = "null_default")]
    pub id: u64,
    /// Its device address.
    #[serde(deserialize_with = "null_default")]
    pub va: u64,
    /// Its size in bytes.
    #[serde(deserialize_with = "null_default")]
    pub size: u64,
    /// Milliseconds the job waited on it.
    #[serde(deserialize_with = "null_default")]
    pub ms: f64,
}

/// The answer to `Release` and `ReleaseKeeping`.
///
/// Written as the job has always written it: a kept checkpoint's release (`kept_bytes`) copies
/// nothing and holds nothing for a restore, so `final`, `held_for_restore` and `held_epochs` are
/// left out of it when empty; so are the last two from a release with the threads parked (`held`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct ReleaseReply {
    /// The copy made while held, per device (what was written since the pre-copy, or everything
    /// for a job whose threads were parked).
    #[serde(rename = "final")]
    #[serde(deserialize_with = "null_default")]
    pub finals: Vec<DeviceCopy>,
    /// Milliseconds from the release to the images committed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_copy_ms: Option<f64>,
    /// Bytes of GPU memory released.
    #[serde(deserialize_with = "null_default")]
    pub released_bytes: u64,
    /// A kept checkpoint: bytes detached, left with the keeper.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept_bytes: Option<u64>,
    /// Bytes of pinned staging memory freed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub staging_freed_bytes: Option<u64>,
    /// Bytes freed by trimming the contexts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_trimmed_bytes: Option<u64>,
    /// Milliseconds letting go of the buffers (released or detached) and of the memory other
    /// processes shared with this one, after the copy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buffers_released_ms: Option<f64>,
    /// Milliseconds freeing the pinned staging memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub staging_freed_ms: Option<f64>,
    /// Milliseconds trimming the contexts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_trimmed_ms: Option<f64>,
    /// Devices whose buffers stay on the GPU with the keeper for a restore.
    #[serde(deserialize_with = "null_default")]
    pub held_for_restore: Vec<usize>,
    /// The epochs the keeper holds them under.
    #[serde(deserialize_with = "null_default")]
    pub held_epochs: Vec<HeldEpoch>,
    /// Devices released (or detached).
    #[serde(deserialize_with = "null_default")]
    pub devices: Vec<usize>,
    /// Mappings of memory other processes shared with this one, released for the driver's
    /// checkpoint (mapped again at the resume).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub imports_released: Option<u64>,
    /// Milliseconds detaching (CUPTI, or a kept checkpoint's buffers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detach_ms: Option<f64>,
    /// How the job was held, when not at the op gate (`threads parked`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held: Option<String>,
    /// With the threads parked: how they were parked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parked: Option<Value>,
    /// With the threads parked: the holds the watchdog ended before the one that copied.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempts: Option<Vec<HoldAttempt>>,
    /// Milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
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

/// [`ReleaseReply`] as written: the lists a release of its kind never fills left out.
#[derive(Serialize)]
struct ReleaseWire<'a> {
    #[serde(rename = "final", skip_serializing_if = "Option::is_none")]
    finals: Option<&'a [DeviceCopy]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    final_copy_ms: Option<f64>,
    released_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    kept_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    staging_freed_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    context_trimmed_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    buffers_released_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    staging_freed_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    context_trimmed_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    held_for_restore: Option<&'a [usize]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    held_epochs: Option<&'a [HeldEpoch]>,
    devices: &'a [usize],
    #[serde(skip_serializing_if = "Option::is_none")]
    imports_released: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detach_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    held: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parked: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    attempts: Option<&'a [HoldAttempt]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ms: Option<f64>,
}

/// `list`, written if `always` or if not empty.
fn written_if<T>(list: &[T], always: bool) -> Option<&[T]> {
    (always || !list.is_empty()).then_some(list)
}

impl Serialize for ReleaseReply {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let kept = self.kept_bytes.is_some();
        let at_gate = !kept && self.held.is_none();
        ReleaseWire {
            finals: written_if(&self.finals, !kept),
            final_copy_ms: self.final_copy_ms,
            released_bytes: self.released_bytes,
            kept_bytes: self.kept_bytes,
            staging_freed_bytes: self.staging_freed_bytes,
            context_trimmed_bytes: self.context_trimmed_bytes,
            buffers_released_ms: self.buffers_released_ms,
            staging_freed_ms: self.staging_freed_ms,
            context_trimmed_ms: self.context_trimmed_ms,
            held_for_restore: written_if(&self.held_for_restore, at_gate),
            held_epochs: written_if(&self.held_epochs, at_gate),
            devices: &self.devices,
            imports_released: self.imports_released,
            detach_ms: self.detach_ms,
            held: self.held.as_deref(),
            parked: self.parked.as_ref(),
            attempts: self.attempts.as_deref(),
            ms: self.ms,
        }
        .serialize(s)
    }
}

/// A hold of the job's parked threads that did not copy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct HoldAttempt {
    /// Its number, from 1.
    #[serde(deserialize_with = "null_default")]
    pub attempt: u32,
    /// The watchdog ended it (a parked thread held a lock the copy needed).
    #[serde(deserialize_with = "null_default")]
    pub ended_by_watchdog: bool,
    /// Milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ms: Option<f64>,
}

/// A device's memory a keeper holds for a restore, and the epoch it is held under.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct HeldEpoch {
    /// The device ordinal.
    pub device: usize,
    /// The epoch.
    pub epoch: u64,
}

/// The answer to `Resume` and `ResumeAndSave`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct ResumeReply {
    /// Devices whose buffers come back from the image.
    #[serde(deserialize_with = "null_default")]
    pub restoring: Vec<usize>,
    /// Whether they come back on demand (false: every buffer was back before the job ran on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_demand: Option<bool>,
    /// Devices whose buffers the keeper still held: mapped again, nothing copied.
    #[serde(deserialize_with = "null_default")]
    pub attached: Vec<usize>,
    /// Devices whose kept buffers the keeper no longer had: they come back from the image.
    #[serde(deserialize_with = "null_default")]
    pub kept_memory_gone: Vec<usize>,
    /// The keeper's stages the restore took (loaded while CRIU restored the job).
    #[serde(deserialize_with = "null_default")]
    pub staged: Vec<StageTaken>,
    /// Devices now another GPU than the job had (a restore onto another GPU).
    #[serde(deserialize_with = "null_default")]
    pub moved: Vec<DeviceMoved>,
    /// Milliseconds attaching kept buffers again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attach_ms: Option<f64>,
    /// Mappings of memory other processes shared with this one, mapped again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub imports_attached: Option<u64>,
    /// Devices whose kept buffers are being saved.
    #[serde(deserialize_with = "null_default")]
    pub saving: Vec<usize>,
    /// Milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ms: Option<f64>,
}

/// A device restored onto another GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct DeviceMoved {
    /// The device ordinal.
    #[serde(deserialize_with = "null_default")]
    pub device: usize,
    /// The GPU it is now, by UUID.
    #[serde(deserialize_with = "null_default")]
    pub uuid: String,
    /// The keeper's socket serving that GPU; `null` where none does.
    pub keeper: Option<String>,
    /// The buffers kept on the old GPU were let go.
    #[serde(deserialize_with = "null_default")]
    pub kept_dropped: bool,
}

/// A keeper's stage a restored device took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct SavedReply {
    /// Per device.
    #[serde(deserialize_with = "null_default")]
    pub saved: Vec<DeviceCopy>,
    /// Milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ms: Option<f64>,
}

/// The answer to `Cupti`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct CuptiReply {
    /// CUPTI's callbacks are subscribed now.
    #[serde(deserialize_with = "null_default")]
    pub cupti_attached: bool,
}

/// The answer to `JournalWrites`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct JournalReply {
    /// The journal the next release's final copy records its chunks in.
    pub journal: String,
}

/// The answer to `CollectiveHold`, `CollectiveWait` and `CollectiveLift`: the job's collective
/// launches (NCCL's kernels) and its barrier.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct CollectiveReply {
    /// Collective launches let through since the job started.
    pub launched: u64,
    /// The first collective launch held, if a barrier is up.
    pub barrier: Option<u64>,
    /// Threads waiting at the barrier now.
    pub held: u32,
    /// The NCCL communicators the process has ranks in now (made through the entry points
    /// possum wraps).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub communicators: Vec<Communicator>,
}

/// An NCCL communicator a process has ranks in.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct Communicator {
    /// The same for every rank of the communicator, in whichever process (a hash of its unique
    /// id, or of its parent's and its split colour).
    pub id: String,
    /// Its ranks, in all.
    pub nranks: u32,
    /// Those in this process.
    pub ranks_here: u32,
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

    /// Serializes `v`, reads it back, and checks both the value and that nothing was dropped
    /// (the JSON written again is the JSON read).
    fn round_trip<R>(v: &R) -> Value
    where
        R: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug,
    {
        let j = serde_json::to_value(v).unwrap();
        let back: R = Reply::parse(j.clone()).unwrap().body;
        assert_eq!(&back, v, "{j}");
        assert_eq!(serde_json::to_value(&back).unwrap(), j);
        j
    }

    fn copy_with_every_field(device: usize) -> DeviceCopy {
        DeviceCopy {
            device,
            buffers: 3,
            bytes: 300,
            ms: Some(1.5),
            dirty_after: Some(1),
            sync_ms: Some(0.25),
            commit_ms: Some(0.75),
            cow_priority: Some(2),
            cow_shadow: Some(4),
            shadow_peak: Some(4096),
            snapshot_shadows: Some(5),
            shadows_saved_by_keeper: Some(6),
            gb_per_s: Some(12.5),
            image_bytes: Some(512),
            image_buffers: Some(3),
            job_waited_ms: Some(2.5),
            waited_on: Some(vec![WaitedOn {
                device,
                id: 7,
                va: 0x7000,
                size: 4096,
                ms: 2.5,
            }]),
            fingerprinted_bytes: Some(1 << 20),
            fingerprint_ms: Some(0.5),
            proven_bytes: Some(200),
            reused_bytes: Some(100),
            written: Some(vec![WrittenFile {
                dev: 27,
                ino: 182,
                ranges: vec![[0, 4096], [8192, 100]],
            }]),
            pipeline: Some(CopyPipeline {
                writers: 16,
                staging_wait_ms: 1.5,
                copy_wait_ms: 2.5,
                sink_ms: 30.0,
            }),
        }
    }

    /// A copy's pipeline is kept to the microsecond, made or summed.
    #[test]
    fn a_pipeline_is_kept_to_the_microsecond() {
        let d = |ns| std::time::Duration::from_nanos(ns);
        let mut p = CopyPipeline::of(2, [d(1_234_567), d(499), d(2_000_501)]);
        assert_eq!(
            p,
            CopyPipeline {
                writers: 2,
                staging_wait_ms: 1.235,
                copy_wait_ms: 0.0,
                sink_ms: 2.001,
            }
        );
        p.add(&CopyPipeline::of(4, [d(100_000), d(0), d(123_456_789)]));
        assert_eq!(
            (p.writers, p.staging_wait_ms, p.sink_ms),
            (6, 1.335, 125.458)
        );
    }

    /// Every session reply, with every field set, reads back as itself.
    #[test]
    fn session_replies_round_trip_with_every_field_set() {
        let j = round_trip(&CheckpointReply {
            precopy: vec![copy_with_every_field(0), copy_with_every_field(1)],
            hooks: Some(true),
            kept: true,
            ms: Some(4.0),
        });
        assert_eq!(j["precopy"][1]["shadows_saved_by_keeper"], 6);
        assert_eq!(j["precopy"][0]["pipeline"]["writers"], 16);
        assert_eq!(j["precopy"][0]["pipeline"]["sink_ms"], 30.0);
        let j = round_trip(&ReleaseReply {
            finals: vec![copy_with_every_field(0)],
            final_copy_ms: Some(1.0),
            released_bytes: 300,
            kept_bytes: Some(200),
            staging_freed_bytes: Some(64),
            context_trimmed_bytes: Some(32),
            buffers_released_ms: Some(3.0),
            staging_freed_ms: Some(2.0),
            context_trimmed_ms: Some(0.25),
            held_for_restore: vec![0],
            held_epochs: vec![HeldEpoch {
                device: 0,
                epoch: 9,
            }],
            devices: vec![0, 1],
            imports_released: Some(2),
            detach_ms: Some(0.5),
            held: Some("threads parked".into()),
            parked: Some(json!({"threads": 4})),
            attempts: Some(vec![HoldAttempt {
                attempt: 1,
                ended_by_watchdog: true,
                ms: Some(20.0),
            }]),
            ms: Some(3.0),
        });
        assert_eq!(j["final"][0]["image_buffers"], 3);
        assert_eq!(j["imports_released"], 2);
        assert_eq!(j["attempts"][0]["ended_by_watchdog"], true);
        let j = round_trip(&ResumeReply {
            restoring: vec![0],
            on_demand: Some(true),
            attached: vec![1],
            kept_memory_gone: vec![2],
            staged: vec![StageTaken {
                device: 0,
                stage: 5,
                buffers: 2,
            }],
            moved: vec![
                DeviceMoved {
                    device: 0,
                    uuid: "0a1b".into(),
                    keeper: Some("/k/keeper-1.sock".into()),
                    kept_dropped: true,
                },
                DeviceMoved {
                    device: 1,
                    uuid: "2c3d".into(),
                    keeper: None,
                    kept_dropped: false,
                },
            ],
            attach_ms: Some(0.1),
            imports_attached: Some(2),
            saving: vec![0, 1],
            ms: Some(2.0),
        });
        // A device no keeper serves on its new GPU: `keeper` is sent, as null.
        assert_eq!(j["moved"][1]["keeper"], Value::Null);
        round_trip(&SavedReply {
            saved: vec![copy_with_every_field(0)],
            ms: Some(9.0),
        });
        round_trip(&CuptiReply {
            cupti_attached: true,
        });
    }

    /// `Status`'s types, with every field set, read back as themselves.
    #[test]
    fn the_status_reply_round_trips_with_every_field_set() {
        let engine = EngineStatus {
            device: 1,
            engine: EngineFigures {
                bytes: Some(4096),
                buffers: 2,
                resident_bytes: 1024,
                dirty_bytes: 512,
                tracking: Some(true),
                phase: Some("live".into()),
            },
            keeper: Some(KeeperStatus {
                name: Some("/k/keeper-0.sock".into()),
                reachable: Some(true),
                allocations: Some(2),
                bytes: Some(4096),
                retained_bytes: Some(0),
                mappings_kept: Some(2),
                mappings_own: Some(0),
                spare: Some("1 GiB".into()),
            }),
        };
        let counted = Allocations {
            allocations: 1,
            bytes: 64,
        };
        round_trip(&StatusReply {
            pid: Some(7),
            hooks: Some("entry".into()),
            possum: Some(PossumStatus {
                engines: vec![engine],
                imports: Some(ImportsStatus {
                    imported: 2,
                    live: 2,
                    mapped_now: 1,
                    released_at_checkpoints: 3,
                }),
                unmanaged: Some(Unmanaged {
                    allocations: 1,
                    bytes: 64,
                    by_kind: BTreeMap::from([("cuMemAllocManaged".to_string(), counted)]),
                }),
                session: Some(SessionStatus {
                    paused: true,
                    busy: Some("release".into()),
                    cupti_attached: true,
                    hooks_live: Some(true),
                    last: SessionLast {
                        restore: Some(json!({"device": 0})),
                    },
                    collectives: CollectiveReply {
                        launched: 12,
                        barrier: Some(12),
                        held: 1,
                        communicators: vec![Communicator {
                            id: "00ff".into(),
                            nranks: 2,
                            ranks_here: 1,
                        }],
                    },
                }),
                vmm: Some(VmmStatus {
                    serving: true,
                    pieces_mapped_now: 1,
                    handles_live: 2,
                    handles_shared: 3,
                    left_to_driver: 4,
                    left_to_driver_first_prop: Some("type 1".into()),
                }),
                pools: Some(PoolsStatus {
                    serving: true,
                    blocks_live: 1,
                    bytes_live: 2,
                    slabs: 3,
                    blocks_pending_free: 4,
                    reused_on_their_stream: 5,
                    allocations_served: 6,
                }),
            }),
            entry: Some(EntryStats {
                wrapped: 40,
                swapped_proc_address: 10,
                swapped_dlsym: 2,
                passed_proc_address: 100,
                unmatched: vec![json!("cuFoo_v9")],
            }),
            runtime: Some(RUNTIME_HIP.into()),
        });
    }

    /// The job leaves out an optional figure it has not got (a pre-copy's entry has no image
    /// figures), as its hand-built replies did.
    #[test]
    fn an_absent_optional_figure_is_left_out() {
        let precopy = DeviceCopy {
            device: 0,
            buffers: 2,
            bytes: 20,
            ms: Some(1.0),
            dirty_after: Some(0),
            ..DeviceCopy::default()
        };
        assert_eq!(
            serde_json::to_value(&precopy).unwrap(),
            json!({"device": 0, "buffers": 2, "bytes": 20, "ms": 1.0, "dirty_after": 0})
        );
    }

    /// Each kind of release is written with the keys the job has always sent for it.
    #[test]
    fn each_kind_of_release_keeps_its_keys() {
        let keys = |r: &ReleaseReply| -> Vec<String> {
            let j = round_trip(r);
            j.as_object().unwrap().keys().cloned().collect()
        };
        // At the op gate, nothing held for a restore: the empty lists are sent.
        let gate = ReleaseReply {
            final_copy_ms: Some(1.0),
            staging_freed_bytes: Some(0),
            context_trimmed_bytes: Some(0),
            detach_ms: Some(0.0),
            ms: Some(1.0),
            ..ReleaseReply::default()
        };
        let j = serde_json::to_value(&gate).unwrap();
        assert_eq!(j["final"], json!([]));
        assert_eq!(j["held_for_restore"], json!([]));
        assert_eq!(j["held_epochs"], json!([]));
        assert_eq!(keys(&gate).len(), 10, "{j}");
        // A kept checkpoint's release: no copy, nothing held.
        let kept = ReleaseReply {
            kept_bytes: Some(300),
            ..gate.clone()
        };
        let mut k = keys(&kept);
        k.sort();
        assert_eq!(
            k,
            [
                "context_trimmed_bytes",
                "detach_ms",
                "devices",
                "final_copy_ms",
                "kept_bytes",
                "ms",
                "released_bytes",
                "staging_freed_bytes"
            ]
        );
        // The threads parked: the copy, no lists of what is held for a restore.
        let parked = ReleaseReply {
            finals: vec![copy_with_every_field(0)],
            final_copy_ms: Some(1.0),
            staging_freed_bytes: Some(0),
            held: Some("threads parked".into()),
            parked: Some(json!({"threads": 2})),
            attempts: Some(Vec::new()),
            ms: Some(1.0),
            ..ReleaseReply::default()
        };
        let mut k = keys(&parked);
        k.sort();
        assert_eq!(
            k,
            [
                "attempts",
                "devices",
                "final",
                "final_copy_ms",
                "held",
                "ms",
                "parked",
                "released_bytes",
                "staging_freed_bytes"
            ]
        );
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
