//! Who takes a checkpoint's GPU side.

use serde::{Deserialize, Serialize};

/// Who takes a checkpoint's GPU side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// possum: buffers pre-copied while the job runs; the job held for what it wrote since, the
    /// driver's residue and CRIU; buffers back on demand.
    Possum,
    /// The baseline: CRIU + NVIDIA's driver checkpoint, nothing of possum's.
    Driver,
}
