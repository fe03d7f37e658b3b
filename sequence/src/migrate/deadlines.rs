//! How long each wait of a migration may take, at either end.

use std::time::Duration;

/// How long each wait of a migration may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// The TCP connection to the destination.
    pub connect: Duration,
    /// Each read and each write of the transfer (a frame, `Committed`).
    pub io: Duration,
    /// The destination: each read and each write of a connection's handshake, up to the
    /// sender's proof of the secret. Short, so that a connection that says nothing holds a
    /// receiver's slot only briefly.
    pub handshake: Duration,
    /// The destination: from `Committed` to `Released` (the source's kill).
    pub release: Duration,
    /// The source: from `Released` to the destination's `Outcome` (its restore).
    pub restore: Duration,
    /// The source: the killed job's PIDs freed (its processes ended and reaped by their
    /// parents), before `Released`, and before a restore at the source.
    pub kill: Duration,
}

impl Default for Deadlines {
    fn default() -> Deadlines {
        Deadlines {
            connect: Duration::from_secs(10),
            io: Duration::from_secs(60),
            handshake: Duration::from_secs(10),
            release: Duration::from_secs(60),
            restore: Duration::from_secs(300),
            kill: Duration::from_secs(30),
        }
    }
}
