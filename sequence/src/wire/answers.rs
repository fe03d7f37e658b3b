//! The receiver's answers on a transfer's first stream: `Committed` to the sender's `Done`
//! ([`confirmation`]), and `Loaded` to a migration source's `LoadQuery`, asked before it holds
//! the job until the destination loaded what was sent ahead, stalls, or the limit passes
//! ([`super::DirSender::await_loaded`]).

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use super::error::SendError;
use super::session::{read_frame, write_frame, Frame, FrameError, Session, Totals};

/// The receiver's answer to `Done`: its totals, once checked.
pub(super) fn confirmation<S: Read + ?Sized>(
    stream: &mut S,
    session: &mut Session,
    done: &Totals,
) -> Result<Totals, SendError> {
    let mut buf = Vec::new();
    match read_frame(stream, session, &mut buf)? {
        Frame::Committed(got) if got != *done => Err(SendError::Miscounted { sent: *done, got }),
        Frame::Committed(got) => Ok(got),
        Frame::Abort { reason } => Err(SendError::Rejected { reason }),
        other => Err(SendError::Unconfirmed { got: other.name() }),
    }
}

/// How long [`super::DirSender::await_loaded`] waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadWait {
    /// At most this long in all.
    pub limit: Duration,
    /// It stops once the destination loaded nothing more for this long.
    pub stalled: Duration,
    /// Between two questions.
    pub poll: Duration,
}

/// Why the wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadWaitEnd {
    /// The destination loads nothing ahead.
    Nothing,
    /// It loaded all it loads ahead.
    Loaded,
    /// It loaded nothing more for [`LoadWait::stalled`].
    Stalled,
    /// [`LoadWait::limit`] passed.
    Limit,
}

/// What the destination said at the end of the wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct LoadedAhead {
    /// The bytes sent ahead it had loaded into GPU memory ...
    pub loaded: u64,
    /// ... and those it was still loading.
    pub left: u64,
    /// How long the wait took.
    #[serde(rename = "waited_ms", serialize_with = "crate::figures::as_ms")]
    pub waited: Duration,
    /// Why it ended.
    pub end: LoadWaitEnd,
}

/// Asks over `stream` (the session's first, before the `Cut`) until the wait `w` ends.
pub(super) fn await_loaded<S: Read + Write>(
    stream: &mut S,
    session: &mut Session,
    w: LoadWait,
) -> Result<LoadedAhead, SendError> {
    let t = Instant::now();
    let mut buf = Vec::new();
    let (mut last, mut moved) = (None, t);
    loop {
        write_frame(stream, session, &Frame::LoadQuery)?;
        stream.flush().map_err(|source| FrameError::Io {
            what: "sending",
            source,
        })?;
        let (loaded, left) = match read_frame(stream, session, &mut buf)? {
            Frame::Loaded { loaded, left } => (loaded, left),
            Frame::Abort { reason } => return Err(SendError::Rejected { reason }),
            other => {
                return Err(SendError::Unanswered {
                    asked: "LoadQuery",
                    got: other.name(),
                })
            }
        };
        if last != Some(loaded) {
            (last, moved) = (Some(loaded), Instant::now());
        }
        let end = match () {
            () if left == 0 && loaded == 0 => Some(LoadWaitEnd::Nothing),
            () if left == 0 => Some(LoadWaitEnd::Loaded),
            () if t.elapsed() >= w.limit => Some(LoadWaitEnd::Limit),
            () if moved.elapsed() >= w.stalled => Some(LoadWaitEnd::Stalled),
            () => None,
        };
        if let Some(end) = end {
            return Ok(LoadedAhead {
                loaded,
                left,
                waited: t.elapsed(),
                end,
            });
        }
        std::thread::sleep(w.poll.min(w.limit.saturating_sub(t.elapsed())));
    }
}
