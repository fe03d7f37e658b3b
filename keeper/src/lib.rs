//! The keeper: a process that owns the physical GPU memory of the buffers
//! possum serves and hands it to jobs as VMM shareable handles, so that a job can unmap and release
//! its handles before NVIDIA's driver checkpoint while the memory stays on the GPU.
//!
//! One Unix stream socket; each connection is one client (a job), and lives as long as it wants its
//! memory. The keeper accepts only peers with its own uid (`SO_PEERCRED`). On accept it sends one
//! greeting line, then answers one JSON line per request, in order:
//!
//! ```text
//! keeper ── {"keeper":1,"pid":P}\n  or  {"error":"..."}\n (refused, then closed)
//! client ── {"cmd":"alloc","size":N}\n   ──▶ {"id":I,"size":S}\n + the memory's fd (SCM_RIGHTS)
//! client ── {"cmd":"free","id":I}\n      ──▶ {"ok":true}\n
//! client ── {"cmd":"retain","id":I,"epoch":E,"hold_secs":H,"va":V}\n ──▶ {"ok":true}\n   detached: kept for pid
//! client ── {"cmd":"release_retained","id":I}\n ──▶ {"ok":true}\n   frees a retained allocation
//! client ── {"cmd":"reclaim","id":I,"epoch":E}\n ──▶ {"id":I,"size":S}\n + a new fd (SCM_RIGHTS)
//! client ── {"cmd":"share","id":I}\n     ──▶ {"id":I,"size":S}\n + a new fd (SCM_RIGHTS)   CUDA IPC
//! client ── {"cmd":"identify"}\n + an fd  ──▶ {"identified":{"id":I,"size":S,"owner":P,"instance":N}}\n or null
//! client ── {"cmd":"peer_share","id":I,"owner":P,"instance":N}\n ──▶ {"id":I,"size":S}\n + a new fd   re-import
//! client ── {"cmd":"stats"}\n            ──▶ Stats: per client pid, retained, total, stages
//! client ── {"cmd":"stage","pid":P,"image":DIR,"hold_secs":H,"from":F,"pending":[..]}\n ──▶ StageInfo   loads DIR for P
//! client ── {"cmd":"staged","image":DIR}\n ──▶ StagePlan   the caller's stage of DIR
//! client ── {"cmd":"stage_wait","stage":S,"alloc":A}\n ──▶ {"ok":true}\n once A is loaded
//! client ── {"cmd":"stage_end","stage":S}\n ──▶ {"ok":true,"freed":N}\n
//! client ── {"cmd":"stage_arrived","stage":S,"pieces":[..]}\n ──▶ {"pending":N}\n   bytes now in the files
//! client ── {"cmd":"stage_grown","stage":S,"files":{NAME:LEN,..}}\n ──▶ {"pending":N}\n   files arriving from their start
//! client ── {"cmd":"stage_rewritten","stage":S,"pieces":[..]}\n ──▶ {"chunks":N}\n   a prestage's bytes written again
//! client ── {"cmd":"stage_demands","stage":S,"wait_ms":T}\n ──▶ {"pieces":[..]}\n   what waits need
//! client ── {"cmd":"device"}\n            ──▶ {"uuid":"<32 hex>","ordinal":N}\n
//! client ── {"cmd":"reap"}\n              ──▶ {"ok":true,"freed":N,"freed_bytes":B}\n
//! client ── {"cmd":"spare_take","dir":DIR}\n ──▶ SpareLease   the spare image file, lent
//! client ── {"cmd":"spare_fill",..SpareFill}\n ──▶ SpareFilled  the caller's memory copied in
//! client ── {"cmd":"spare_end","drain":D}\n ──▶ {"ok":true}\n   given back, another made
//! ```
//!
//! Every wait has a deadline. A client waits at most [`REQUEST_TIMEOUT`] for the greeting and
//! for each answer (a `stage_wait`, which waits for a load: [`LOAD_TIMEOUT`]; a `stage_demands`,
//! a long poll: [`REQUEST_TIMEOUT`] plus the time it asked the keeper to wait), then fails with
//! [`KeeperError::Timeout`] naming the socket and the request. The keeper serves each connection
//! on a thread of its own, so a client that stalls holds up nobody else; one that does not take
//! its replies is dropped after [`REPLY_TIMEOUT`]. A connection may stay idle between requests
//! as long as its client wants.
//!
//! `alloc` rounds the size up to the device's granularity (the reply says the size made). A failed
//! request is answered `{"error":"..."}` and the connection goes on. An allocation belongs to the
//! process that made it (the peer's pid), not to a connection: a client may connect for each
//! request (a job does, so that no connection of its is open when it forks or is dumped). It is
//! freed by `free`, or by `release_retained` once retained, or once its process is gone (checked
//! every [`ORPHAN_CHECK`]). `retain` marks it held by no handle in its process (detached for a
//! driver checkpoint); only that process may `reclaim` it (a job restored by CRIU has its pid
//! again), and only with the `epoch` it was retained with: each checkpoint detaches with a new
//! epoch, recorded in the process's memory (and so in CRIU's image of it), so that a job restored
//! from an older image never takes back memory holding a later state. A retained allocation with
//! `hold_secs` outlives its process for that long (a job killed after its checkpoint: the memory
//! stays on the GPU for a restore on this host), then is freed.
//!
//! The `stage*` requests pre-load an image for a restore (the `stage` module): memory created
//! for the restored job's pid, retained with a new epoch, and filled while CRIU restores the
//! process; the job reclaims it as kept memory and waits only for what is still loading. A stage
//! `from` another device's keeper (`possum restore --device` of a job whose memory is still kept)
//! copies each buffer device to device from that memory ([`PeerSource`]) instead of reading the
//! image. A stage may name `pending` pieces of the image's data files ([`PendingPiece`]) whose
//! bytes are still to come (a migration's post-copy): the buffers they overlap load once
//! `stage_arrived` says they are in, and `stage_demands` tells the sender which a wait needs. A
//! `prestage` may name how much of each data file is `present` (a migration's first round,
//! received in parts): the rest is pending in pieces of [`ARRIVING_PIECE`] bytes, and
//! `stage_grown` says how far the files have come; `stage_rewritten` names ranges written again
//! since (a later round's, sent into the same files), whose chunks the prestage loads again.
//!
//! The `spare*` requests lend spare image memory (the `spare` module, with
//! `POSSUM_KEEPER_SPARE_DIR`/`_MIB`): a file on the images' filesystem the keeper faulted in and
//! registered with CUDA ahead (a GiB at a time, while no memory is retained, no spare lent and no stage loading), into
//! which its fill threads copy a kept checkpoint's snapshot of the caller's own memory at the copy
//! engine's speed; the image adopts the file as a data file.
//!
//! The job's side is [`KeeperMemory`], the `possum_cuda::owner::MemoryOwner` a job's
//! `CudaDevice` takes its buffers' memory from. The only `unsafe` is in the private `fdpass` module (taking ownership of the
//! descriptors `recvmsg` received, and `kcmp`).
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod client;
pub mod config;
mod fdpass;
mod memory;
mod notes;
mod pending;
mod process;
mod protocol;
mod server;
mod spare;
mod stage;

pub use client::{keeper_for_device, Keeper};
pub use memory::{KeeperMemory, KeeperStage};
pub use notes::say;
pub use protocol::{
    socket_of, sockets_in, uuid_from_hex, uuid_hex, Allocated, DeviceInfo, Identified, Identify,
    KeeperError, PeerSource, PendingPiece, Request, Retained, RetainedAlloc, SpareFill,
    SpareFilled, SpareLease, SpareStats, StageArrived, StageDemands, StageInfo, StagePlan,
    StageRewritten, StageStats, StagedBuffer, Stats, Usage, ARRIVING_PIECE, ENDED_STAGES_KEPT,
    KEEPER_ENV, LOAD_TIMEOUT, MAX_REQUEST_BYTES, ORPHAN_CHECK, PEER_MISSES_SAID, REPLY_TIMEOUT,
    REQUEST_TIMEOUT,
};
pub use server::Server;
