//! What can go wrong letting CUDA's restore thread run while CRIU holds its process.

/// Why CUDA's restore thread of a process CRIU holds stopped could not be let run, or stopped
/// again.
#[derive(Debug, thiserror::Error)]
pub enum RestoreThreadError {
    /// Its signal mask could not be read.
    #[error("ptrace(GETSIGMASK) of thread {tid}: {source}")]
    Sigmask {
        /// The thread.
        tid: i32,
        /// Why.
        source: nix::errno::Errno,
    },
    /// A step that lets it run failed.
    #[error("letting CUDA's restore thread {tid} run: {what}: {source}")]
    LetRun {
        /// The thread.
        tid: i32,
        /// The step.
        what: &'static str,
        /// Why.
        source: nix::errno::Errno,
    },
    /// It could not be stopped again, as CRIU left it.
    #[error("stopping CUDA's restore thread {tid} again: {source}")]
    StopAgain {
        /// The thread.
        tid: i32,
        /// Why.
        source: nix::errno::Errno,
    },
}
