//! The protocol between a keeper and its clients: where its sockets are, the requests, their
//! replies, and what fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// How often the keeper looks for retained allocations whose process is gone.
pub const ORPHAN_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a client waits for the keeper's greeting and for each answer (and to send a
/// request) before it gives up ([`KeeperError::Timeout`]).
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// How long a client's `stage_wait` waits for the keeper to load the allocation.
pub const LOAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30 * 60);

/// How long the keeper waits for a client to take a reply before it drops the connection.
pub const REPLY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The environment variable naming the directory of a keeper's sockets (`possum run` sets it
/// for its job; libpossum.so reads it).
pub const KEEPER_ENV: &str = "POSSUM_KEEPER";

/// The socket of device `ordinal`'s keeper in a keeper's directory (`possum keeper --dir`).
pub fn socket_of(dir: &Path, ordinal: usize) -> PathBuf {
    dir.join(format!("keeper-{ordinal}.sock"))
}

/// The device sockets in a keeper's directory: `keeper-0.sock`, `keeper-1.sock`, ... while they
/// exist.
pub fn sockets_in(dir: &Path) -> Vec<PathBuf> {
    (0..)
        .map(|n| socket_of(dir, n))
        .take_while(|p| p.exists())
        .collect()
}

/// A device UUID as 32 hex digits.
pub fn uuid_hex(u: &[u8; 16]) -> String {
    u.iter().map(|b| format!("{b:02x}")).collect()
}

/// The UUID [`uuid_hex`] wrote; `None` for anything else.
pub fn uuid_from_hex(h: &str) -> Option<[u8; 16]> {
    let mut u = [0u8; 16];
    for (i, b) in u.iter_mut().enumerate() {
        *b = u8::from_str_radix(h.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    (h.len() == 32).then_some(u)
}

/// The longest request line the keeper reads, newline excluded: a `stage` of a post-copy
/// names each piece still to come (about 60 bytes each; 32 GiB in 4 MiB pieces is 0.5 MB).
pub const MAX_REQUEST_BYTES: usize = 4 << 20;

/// What a client asks, sent as `{"cmd": "<name>", ...fields}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Request {
    /// Create `size` bytes (rounded up to the granularity); the reply carries the fd.
    Alloc {
        /// Bytes asked for.
        size: u64,
    },
    /// Free an allocation.
    Free {
        /// The allocation.
        id: u64,
    },
    /// Mark an allocation held by no handle in its process (detached for a checkpoint).
    Retain {
        /// The allocation.
        id: u64,
        /// The checkpoint's epoch: `reclaim` must name it.
        #[serde(default)]
        epoch: u64,
        /// Keep it this long after its process is gone (0: freed with its process).
        #[serde(default)]
        hold_secs: u64,
        /// The device address the process mapped it at: a stage on another device finds a
        /// buffer's memory by it ([`PeerSource`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        va: Option<u64>,
    },
    /// Free a retained allocation.
    ReleaseRetained {
        /// The allocation.
        id: u64,
        /// Only if retained with this epoch (any, if absent).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        epoch: Option<u64>,
    },
    /// Take a retained allocation back: it becomes this connection's (no longer retained), and
    /// the reply carries a new fd for it, like `alloc`'s. Only the process that retained it may.
    Reclaim {
        /// The allocation.
        id: u64,
        /// The epoch it was retained with.
        #[serde(default)]
        epoch: u64,
    },
    /// The accounting.
    Stats,
    /// Free now what the periodic check ([`ORPHAN_CHECK`]) would: the memory of processes that
    /// are gone, but what is held for a restore. `{"ok":true,"freed":N,"freed_bytes":B}`.
    Reap,
    /// The allocations process `pid` retained ([`Retained`]): for someone who keeps them alive
    /// while the job holds no handle to them (`possum checkpoint`, during a kept hold).
    Retained {
        /// Whose.
        pid: i32,
    },
    /// A new fd for a retained allocation (reply like `alloc`'s), its state unchanged: held by
    /// the caller, it keeps the memory alive should this keeper die.
    Dup {
        /// The allocation.
        id: u64,
    },
    /// A new fd for one of the caller's own allocations in use (reply like `alloc`'s), for the
    /// job to hand to another process (CUDA IPC: `cuMemExportToShareableHandle` of memory
    /// possum serves). Only the process it belongs to may ask.
    Share {
        /// The allocation.
        id: u64,
    },
    /// Which allocation the fd that comes with the request is of: one `share` handed out (and
    /// another process imported, as NCCL imports its peers' buffers). Answered with
    /// [`Identify`]; `identified` null for an fd of no allocation shared here.
    Identify,
    /// A new fd for allocation `id` of process `owner`, retained or not (reply like `alloc`'s),
    /// for another process that imported it (found by `identify`) to import it again after its
    /// own checkpoint released its handles. Refused unless `instance` is this keeper's (a new
    /// keeper numbers its allocations anew) and `owner` the allocation's.
    PeerShare {
        /// The allocation.
        id: u64,
        /// The process it belongs to, as `identify` said.
        owner: i32,
        /// The keeper's instance, as `identify` said.
        instance: u64,
    },
    /// Take over a retained allocation of another keeper (one that died), from the fd that
    /// comes with the request: the same id, owner and epoch, so the job's `reclaim` finds it.
    Adopt(RetainedAlloc),
    /// Load the possum image directory `image` (one device's: `gpu-N/`) into new memory for
    /// process `pid`, which is being restored: one allocation per buffer, retained for `pid`
    /// with a new epoch and held `hold_secs` (its process may not exist yet), filled in the
    /// background in prefetch order. Answered with [`StageInfo`] once the memory exists. A
    /// stage of `pid` already there is ended first.
    Stage {
        /// The process being restored.
        pid: i32,
        /// The image directory.
        image: String,
        /// Seconds the memory is kept while `pid` does not exist (before it is taken back).
        #[serde(default)]
        hold_secs: u64,
        /// Copy the buffers from the memory another keeper (another device's) still holds for
        /// `pid` instead of reading them from the image, where it has them: `possum restore
        /// --device` of a job killed with its memory kept.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        from: Option<PeerSource>,
        /// Build on the caller's `prestage` of that id: each buffer it loaded takes its memory
        /// as it is, and only the chunks that differ between its draft and `image` (by length,
        /// CRC32C and fingerprint) are loaded; the rest of its memory is freed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        base: Option<u64>,
        /// A stage ahead: `pid` is ignored, the memory is the caller's (as a prestage's), no
        /// stage is ended first, and the stage is a prestage of `image` (whole: its manifest,
        /// not a draft) that a later `stage` of the image, wherever it lies by then, builds on
        /// (`base`). A migration's destination stages the job's GPU images once they are whole,
        /// before its restore.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        ahead: bool,
        /// Byte ranges of the image's data files whose bytes have not arrived yet (a migration's
        /// post-copy): the files hold other bytes there until `stage_arrived` says they are in.
        /// A chunk to load (one not already in memory from `base`) that overlaps one of them is
        /// not loaded until every piece it overlaps has arrived; its buffer's other chunks, and
        /// the other buffers, load as usual.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pending: Vec<PendingPiece>,
    },
    /// Load the unfinished image directory `image` by its draft manifest (`draft.pb`, written
    /// after each pre-copy round) into new memory, for a later `stage` (`base`) of the finished
    /// image: a migration's destination loads what it was sent ahead while the job is still
    /// held at the source. The memory is the caller's, retained, held `hold_secs`; answered
    /// with [`StageInfo`] once it exists, filled in the background.
    Prestage {
        /// The unfinished image directory.
        image: String,
        /// Seconds the memory is kept unless a `stage` takes it or `stage_end` ends it.
        #[serde(default)]
        hold_secs: u64,
        /// The image's data files are still arriving, each from its start (a migration's first
        /// round received in parts): how many bytes of each are there (a file not named: none).
        /// The rest is pending, in pieces of [`ARRIVING_PIECE`] bytes, until
        /// `stage_grown` says the files are that long. None: the files are whole.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        present: Option<std::collections::BTreeMap<String, u64>>,
    },
    /// The caller's stage of `image`: [`StagePlan`].
    Staged {
        /// The image directory.
        image: String,
    },
    /// Answers once allocation `alloc` of stage `stage` is loaded (it is loaded next if it is
    /// still waiting), or with an error if its load failed.
    StageWait {
        /// The stage.
        stage: u64,
        /// The allocation.
        alloc: u64,
    },
    /// Ends stage `stage`: loading stops, and its memory not taken back is freed.
    StageEnd {
        /// The stage.
        stage: u64,
    },
    /// The bytes of `pieces` are now in the data files of stage `stage`'s image: each that
    /// was pending is pending no more, and a buffer none still pending overlaps is loaded.
    /// Pieces that are not pending (never were, or arrived already) are ignored. Answered with
    /// [`StageArrived`].
    StageArrived {
        /// The stage.
        stage: u64,
        /// The pieces now in the files.
        pieces: Vec<PendingPiece>,
    },
    /// Stage `stage`'s data files (arriving from their start: `prestage`'s `present`) are now
    /// at least `files` long (name, bytes): its pending pieces within those bytes arrived, as
    /// `stage_arrived` says of them. Answered with [`StageArrived`].
    StageGrown {
        /// The stage.
        stage: u64,
        /// Each file's bytes there now, from its start.
        files: std::collections::BTreeMap<String, u64>,
    },
    /// The bytes of `pieces` of the data files of prestage `stage`'s draft were written again
    /// (a migration's later round, or the held job's final copy, sent into the same files): each
    /// chunk of the draft they overlap is loaded again once its buffer is loaded, and a stage
    /// built on the prestage takes such a chunk only if what was last loaded of it came after
    /// the last time it was named here and sums to the finished image's CRC32C there. Answered
    /// with [`StageRewritten`].
    StageRewritten {
        /// The prestage.
        stage: u64,
        /// The ranges written again.
        pieces: Vec<PendingPiece>,
    },
    /// The pending pieces of stage `stage` that a wait needs ([`StageDemands`]): those that
    /// overlap a buffer that a `stage_wait` met blocked, each answered once per stage. Waits up
    /// to `wait_ms` for there to be one, then answers with what there is: nothing once that
    /// time is up, or at once when the stage was ended or has no piece pending.
    StageDemands {
        /// The stage.
        stage: u64,
        /// How long to wait for a piece to be needed, ms.
        wait_ms: u64,
    },
    /// The device this socket serves ([`DeviceInfo`]); opens it if it is not open yet.
    Device,
    /// Lend the spare image memory to a drain into image directory `dir` ([`SpareLease`]):
    /// refused unless a spare is ready on `dir`'s filesystem (`spare.rs`).
    SpareTake {
        /// The image's directory (its temporary one): the spare must be on its filesystem.
        dir: String,
    },
    /// Copy part of the caller's allocation into a drain's spare ([`SpareFill`]): the reply
    /// ([`SpareFilled`]) has each piece's CRC32C, in order.
    SpareFill(SpareFill),
    /// End drain `drain`'s loan: the spare is unregistered and unmapped (the file is the
    /// caller's now), and another is made.
    SpareEnd {
        /// The drain.
        drain: u64,
    },
}

/// `spare_fill`: `len` bytes of the caller's allocation `alloc` from `offset`, copied into drain
/// `drain`'s spare at `at`, checksummed `piece` bytes at a time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpareFill {
    /// The drain ([`SpareLease::drain`]).
    pub drain: u64,
    /// The caller's allocation.
    pub alloc: u64,
    /// Where in it.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Where in the spare.
    pub at: u64,
    /// Bytes per checksum.
    pub piece: u64,
}

/// The reply to `spare_fill`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpareFilled {
    /// Each piece's CRC32C, in order.
    pub crcs: Vec<u32>,
}

/// The reply to `spare_take`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpareLease {
    /// The drain's id (`spare_fill`, `spare_end` name it).
    pub drain: u64,
    /// The spare file: the caller renames it into its image.
    pub path: String,
    /// Its length.
    pub len: u64,
}

/// The pieces a `prestage` of data files still arriving ([`Request::Prestage`]'s `present`)
/// waits for, in bytes: each file's bytes from a multiple of this to the next load once the file
/// is that long ([`Request::StageGrown`]).
pub const ARRIVING_PIECE: u64 = 64 << 20;

/// A byte range of a data file of a stage's image whose bytes have not arrived yet
/// ([`Request::Stage`]'s `pending`, [`Request::StageArrived`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PendingPiece {
    /// The data file's path relative to the image directory, as the image's manifest names it
    /// (`data-000.bin`; a parent image's file after that image's path).
    pub file: String,
    /// Where the range starts in the file.
    pub offset: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// The reply to `stage_arrived`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageArrived {
    /// The stage's pieces still pending after these.
    pub pending: u64,
}

/// The reply to `stage_rewritten`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageRewritten {
    /// The draft's chunks those pieces overlap, each to be loaded again.
    pub chunks: u64,
}

/// The reply to `stage_demands`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageDemands {
    /// Pending pieces that a wait for a blocked buffer needs, none of them answered before.
    pub pieces: Vec<PendingPiece>,
}

/// Where a stage copies buffers from device to device ([`Request::Stage`]'s `from`): the
/// memory the keeper at `socket` holds for the process, retained with `epoch` (the image's: a
/// later checkpoint's memory is never taken for it), matched to the image's buffers by address
/// and size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerSource {
    /// The socket of the keeper holding the memory (another device's).
    pub socket: String,
    /// The epoch the memory was retained with.
    pub epoch: u64,
}

/// The reply to `device`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// The device's UUID (32 hex digits).
    pub uuid: String,
    /// Its ordinal in the keeper's process.
    pub ordinal: usize,
}

/// The reply to `stage`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageInfo {
    /// The stage's id.
    pub stage: u64,
    /// The epoch its memory is retained with.
    pub epoch: u64,
    /// Buffers it loads.
    pub buffers: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Of the buffers, those copied from another device's memory ([`PeerSource`]); the rest
    /// are read from the image.
    #[serde(default)]
    pub peer: u64,
    /// Why buffers that were to be copied from another device are read from the image instead,
    /// one line each, the first [`PEER_MISSES_SAID`] (`buffers - peer` of them in all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peer_misses: Vec<String>,
    /// Bytes already in memory from the prestage it was built on (`base`): not loaded again.
    #[serde(default)]
    pub reused_bytes: u64,
}

/// How many reasons a stage's reply gives for buffers not copied from another device.
pub const PEER_MISSES_SAID: usize = 8;

/// One buffer of a stage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagedBuffer {
    /// The engine's id of the buffer (the image's).
    pub buf: u64,
    /// Its device address in the job.
    pub va: u64,
    /// Its size.
    pub size: u64,
    /// The allocation holding it.
    pub alloc: u64,
    /// The allocation's size (the buffer's, rounded up to the granularity).
    pub alloc_size: u64,
}

/// The reply to `staged`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagePlan {
    /// The stage's id.
    pub stage: u64,
    /// The epoch its memory is retained with (`reclaim` names it).
    pub epoch: u64,
    /// Its buffers, in the order they are loaded.
    pub buffers: Vec<StagedBuffer>,
}

/// A stage, as `stats` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageStats {
    /// The stage's id.
    pub stage: u64,
    /// The process it is for.
    pub pid: i32,
    /// The image directory.
    pub image: String,
    /// Buffers.
    pub buffers: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Buffers loaded.
    pub ready: u64,
    /// Buffers copied from another device's memory (counted in `ready` too).
    #[serde(default)]
    pub peer_copied: u64,
    /// Bytes copied from another device's memory.
    #[serde(default)]
    pub peer_bytes: u64,
    /// Bytes already in memory from the prestage it was built on.
    #[serde(default)]
    pub reused_bytes: u64,
    /// A prestage (of a draft image, for a later stage to build on).
    #[serde(default)]
    pub draft: bool,
    /// Buffers whose load failed (or was ended).
    pub failed: u64,
    /// Bytes loaded (of buffers whole in memory).
    pub loaded_bytes: u64,
    /// Bytes of chunks whose copy into memory was issued, a buffer not whole yet included (a
    /// chunk loaded again counted again): how far the loads came.
    #[serde(default)]
    pub chunk_bytes: u64,
    /// Pieces of its image's data files still pending ([`Request::Stage`]'s `pending`).
    #[serde(default)]
    pub pending_pieces: u64,
    /// Buffers not loaded yet that a piece still pending overlaps.
    #[serde(default)]
    pub blocked_buffers: u64,
    /// A prestage's chunks loaded again since they were written again
    /// ([`Request::StageRewritten`]) ...
    #[serde(default)]
    pub reloaded_chunks: u64,
    /// ... and their bytes.
    #[serde(default)]
    pub reloaded_bytes: u64,
    /// Its chunks written again and not loaded again yet.
    #[serde(default)]
    pub reloads_left: u64,
    /// Reads of its chunks waiting for their bytes (pending pieces) now.
    #[serde(default)]
    pub reads_waiting: u64,
    /// Since it began, ms.
    pub ms: f64,
    /// When every buffer was loaded or failed, ms after it began.
    pub done_ms: Option<f64>,
}

/// One retained allocation, as `retained` lists it and `adopt` takes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetainedAlloc {
    /// Its id.
    pub id: u64,
    /// Its size.
    pub size: u64,
    /// The checkpoint epoch it was retained with.
    pub epoch: u64,
    /// What is left of its hold after its process is gone, seconds (0: none).
    pub hold_secs: u64,
    /// The process it belongs to (in `adopt`; `retained` lists one process's).
    #[serde(default)]
    pub pid: i32,
    /// The device address its process mapped it at, when the process said (`retain`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub va: Option<u64>,
}

/// The reply to `retained`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retained {
    /// The allocations.
    pub allocs: Vec<RetainedAlloc>,
}

impl From<possum_engine::device::DeviceError> for KeeperError {
    fn from(e: possum_engine::device::DeviceError) -> Self {
        KeeperError::Device(e)
    }
}

/// The answer to `identify`: the allocation an fd is of, or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identify {
    /// The allocation, if the fd is one `share` handed out here.
    pub identified: Option<Identified>,
}

/// An allocation another process shared, as `identify` found it: what `peer_share` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identified {
    /// The allocation.
    pub id: u64,
    /// Its size in bytes.
    pub size: u64,
    /// The process it belongs to.
    pub owner: i32,
    /// This keeper's instance (random, made at its start).
    pub instance: u64,
}

/// The reply to `alloc` (the fd comes with it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocated {
    /// The allocation's id, for `free`, `retain` and `release_retained`.
    pub id: u64,
    /// Its size: the size asked, rounded up to the granularity.
    pub size: u64,
    /// The UUID of the device it is on (32 hex digits), for the client to check it is its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

/// A count of allocations and their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// How many allocations.
    pub allocations: u64,
    /// Their bytes.
    pub bytes: u64,
}

impl Usage {
    pub(crate) fn add(&mut self, bytes: u64) {
        self.allocations += 1;
        self.bytes += bytes;
    }
}

/// The reply to `stats`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Per owning process: what it holds (its retained allocations included).
    pub clients: BTreeMap<i32, Usage>,
    /// Retained allocations (of any process).
    pub retained: Usage,
    /// Of those, the ones whose process is gone, kept for a restore (`retain`'s `hold_secs`).
    #[serde(default)]
    pub held: Usage,
    /// Everything the keeper holds.
    pub total: Usage,
    /// Restores being staged.
    #[serde(default)]
    pub stages: Vec<StageStats>,
    /// The last [`ENDED_STAGES_KEPT`] stages ended (taken by their job, or given up), oldest
    /// first, as they stood when ended: what a restore's loading took.
    #[serde(default)]
    pub stages_ended: Vec<StageStats>,
    /// Its spare image memory, when it keeps some (`POSSUM_KEEPER_SPARE_*`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spare: Option<SpareStats>,
}

/// The keeper's spare image memory, as `stats` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpareStats {
    /// Where spares are made.
    pub dir: String,
    /// A spare's size.
    pub bytes: u64,
    /// One is ready (made and registered) for the next drain.
    pub ready: bool,
    /// Spares lent to drains now.
    pub lent: u64,
    /// Why the last one could not be made, if it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How many ended stages `stats` still shows.
pub const ENDED_STAGES_KEPT: usize = 16;

/// What failed, named.
#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    /// The socket could not be set up or reached.
    #[error("keeper socket {path}: {op}: {source}")]
    Socket {
        /// The socket's path.
        path: PathBuf,
        /// What was being done (bind, connect...).
        op: &'static str,
        /// The system's error.
        source: std::io::Error,
    },
    /// A stage request that cannot be done (no such stage, an image that does not open, not
    /// enough memory for it).
    #[error("stage: {0}")]
    Stage(String),
    /// Spare image memory: none configured or ready, or a fill that failed.
    #[error("spare image memory: {0}")]
    Spare(String),
    /// The keeper did not answer a request (or take it) in time.
    #[error(
        "keeper socket {}: no answer to {request} within {} s (the keeper is hung or overloaded)",
        path.display(),
        after.as_secs_f64()
    )]
    Timeout {
        /// The socket's path.
        path: PathBuf,
        /// The request's name (`connect` for the greeting).
        request: &'static str,
        /// The time waited.
        after: std::time::Duration,
    },
    /// Reading from or writing to a connection failed.
    #[error("keeper connection: {op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The system's error.
        source: std::io::Error,
    },
    /// The driver refused something.
    #[error("keeper device: {0}")]
    Device(possum_engine::device::DeviceError),
    /// The keeper refused the connection (another uid).
    #[error("refused by the keeper: {0}")]
    Refused(String),
    /// The keeper answered a request with an error.
    #[error("keeper refused {request}: {message}")]
    Remote {
        /// The request's name.
        request: &'static str,
        /// The keeper's message.
        message: String,
    },
    /// A reply that does not follow the protocol.
    #[error("keeper protocol, {request}: {detail}")]
    Protocol {
        /// The request's name.
        request: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// No allocation has this id (or it is not in the state the request needs).
    #[error("no allocation {0}")]
    NoSuchAllocation(u64),
    /// `release_retained` of an allocation that is not retained (or `reclaim` of one another
    /// process retained).
    #[error("allocation {0} is not retained (by this process)")]
    NotRetained(u64),
    /// `reclaim` of an allocation retained by another checkpoint of the process (a later one:
    /// its contents are not the state the caller was checkpointed with).
    #[error("allocation {0} holds the state of another checkpoint of this process")]
    OtherEpoch(u64),
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_post_copy_fields_are_optional_on_the_wire() {
        let stage = Request::Stage {
            pid: 1,
            image: "img".into(),
            hold_secs: 0,
            from: None,
            base: None,
            ahead: false,
            pending: Vec::new(),
        };
        let line = serde_json::to_string(&stage).unwrap();
        assert!(
            !line.contains("pending") && !line.contains("ahead"),
            "{line}"
        );
        let old = r#"{"cmd":"stage","pid":1,"image":"img"}"#;
        assert_eq!(serde_json::from_str::<Request>(old).unwrap(), stage);
        let old_stats = r#"{"stage":1,"pid":2,"image":"img","buffers":3,"bytes":4,"ready":3,
            "failed":0,"loaded_bytes":4,"ms":1.0,"done_ms":null}"#;
        let s: StageStats = serde_json::from_str(old_stats).unwrap();
        assert_eq!((s.pending_pieces, s.blocked_buffers), (0, 0));
        assert_eq!(
            (s.reloaded_chunks, s.reloaded_bytes, s.reloads_left),
            (0, 0, 0)
        );
    }

    #[test]
    fn the_post_copy_requests_are_named_in_snake_case() {
        let piece = PendingPiece {
            file: "data-000.bin".into(),
            offset: 8,
            len: 4,
        };
        let arrived = Request::StageArrived {
            stage: 1,
            pieces: vec![piece],
        };
        assert_eq!(
            serde_json::to_value(&arrived).unwrap(),
            json!({"cmd": "stage_arrived", "stage": 1,
                   "pieces": [{"file": "data-000.bin", "offset": 8, "len": 4}]})
        );
        let grown = Request::StageGrown {
            stage: 2,
            files: [("data-001.bin".to_string(), 64)].into(),
        };
        assert_eq!(
            serde_json::to_value(&grown).unwrap(),
            json!({"cmd": "stage_grown", "stage": 2, "files": {"data-001.bin": 64}})
        );
        let again = Request::StageRewritten {
            stage: 3,
            pieces: vec![PendingPiece {
                file: "data-002.bin".into(),
                offset: 0,
                len: 8,
            }],
        };
        assert_eq!(
            serde_json::to_value(&again).unwrap(),
            json!({"cmd": "stage_rewritten", "stage": 3,
                   "pieces": [{"file": "data-002.bin", "offset": 0, "len": 8}]})
        );
        let whole = json!({"cmd": "prestage", "image": "img", "hold_secs": 3});
        assert_eq!(
            serde_json::from_value::<Request>(whole.clone()).unwrap(),
            Request::Prestage {
                image: "img".into(),
                hold_secs: 3,
                present: None
            }
        );
        let arriving = Request::Prestage {
            image: "img".into(),
            hold_secs: 3,
            present: Some([("data-000.bin".to_string(), 0)].into()),
        };
        assert_eq!(
            serde_json::to_value(&arriving).unwrap(),
            json!({"cmd": "prestage", "image": "img", "hold_secs": 3,
                   "present": {"data-000.bin": 0}})
        );
        let demands = Request::StageDemands {
            stage: 1,
            wait_ms: 5,
        };
        assert_eq!(
            serde_json::to_value(&demands).unwrap(),
            json!({"cmd": "stage_demands", "stage": 1, "wait_ms": 5})
        );
    }
}
