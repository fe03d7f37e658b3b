//! What a checkpoint is asked for: the process, the image directory and how (`possum
//! checkpoint`'s flags, with the environment).

use std::path::PathBuf;
use std::sync::Arc;

use possum_criu::relay::RelayWatch;

use crate::config::Environment;
use crate::image::NetworkLock;
use crate::Engine;

/// What to checkpoint, and how (`possum checkpoint`'s flags, with the environment).
#[derive(Debug, Clone)]
pub struct CheckpointParams {
    /// The process (the root of its tree).
    pub pid: i32,
    /// The image directory (must not exist or be empty, unless `force`).
    pub dir: PathBuf,
    /// The job runs on after the checkpoint (else it is killed once the image is complete).
    pub leave_running: bool,
    /// Who takes the GPU side.
    pub engine: Engine,
    /// Only possum's GPU side: no driver checkpoint, no CRIU.
    pub gpu_only: bool,
    /// Replace an existing image at `dir` (once the new one is complete).
    pub force: bool,
    /// An earlier image of the same job (`possum checkpoint --parent`): the GPU chunks it holds
    /// unchanged are referenced from it, not copied (it must then stay where it is for as long
    /// as the new image is kept).
    pub parent: Option<PathBuf>,
    /// A killed job's buffers stay on the GPU with its keeper this many seconds.
    pub keep_on_gpu: u64,
    /// Device memory (MiB) a kept checkpoint's save may use for copies on the GPU.
    pub shadow_budget: Option<u64>,
    /// Dump the tree's established TCP connections, the network locked this way (`None`: a
    /// tree holding one is refused by CRIU).
    pub tcp_established: Option<NetworkLock>,
    /// At most this many pre-copy rounds while the job runs (0 and 1: one); each after the
    /// first copies what was written since the one before, and they stop once a round copies
    /// nothing, or no less than the one before ([`Observer::precopied`] after each).
    pub precopy_rounds: u32,
    /// The job's control socket directory.
    pub sockets: PathBuf,
    /// The possum executable (started as the checkpoint's guard and as a keeper).
    pub possum_exe: PathBuf,
    /// What the environment says.
    pub env: Environment,
    /// Told of the pages files CRIU's dump relays as they are written
    /// (`POSSUM_DUMP_PAGES=relay`), for a migration that sends them meanwhile.
    pub relay_watch: Arc<RelayWatch>,
}
