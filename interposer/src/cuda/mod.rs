//! The CUDA front end: the driver's and the runtime's entry points as the job reaches them.
//!
//! The wrapped driver functions and the lookups that hand them out (`entry`), the callback ids
//! and shapes that key them (`cbid`), the writing functions and why each is wrapped or not
//! (`writers`), reading a call's parameters (`decode`), the served allocation entry points
//! (`cudart`, `drvalloc`), NCCL's communicator calls (`nccl`) and CUPTI, the diagnostic feed of
//! the same hooks (`cupti_sys`, its binding; `cupti`, as the rest uses it).

pub mod cbid;
pub(crate) mod cudart;
pub(crate) mod cupti;
pub(crate) mod cupti_sys;
pub(crate) mod decode;
pub(crate) mod drvalloc;
pub mod entry;
pub(crate) mod nccl;
pub mod writers;
