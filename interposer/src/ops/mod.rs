//! What happens around each GPU operation of the job: the op gate where a checkpoint pauses
//! the job (`gate`), holding the job's threads when the hooks see nothing (`park`, over the
//! signal handling of `park_sys`), the hooks that resolve an operation's buffers and mark what it
//! writes (`hooks`, with the per-thread data of `hook_state` and `thread_state`), the
//! validation of those resolutions (`validate`) and the barrier for NCCL's collective launches
//! (`collective`).

pub(crate) mod collective;
pub(crate) mod gate;
pub(crate) mod hook_state;
pub(crate) mod hooks;
pub(crate) mod park;
pub(crate) mod park_sys;
pub(crate) mod thread_state;
pub(crate) mod validate;
