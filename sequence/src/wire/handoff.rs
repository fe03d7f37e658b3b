//! After the transfer: a migration's hand-off (part of [`super`]).

use std::io::{self, Read, Write};

use super::error::ReceiveError;
use super::session::{read_frame, write_frame, Frame, FrameError, Outcome, Session};

/// Why the exchange after a transfer (`Released`, `Outcome`) failed.
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    /// A frame to or from the peer (a timeout, a dropped connection included).
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The peer gave up.
    #[error("the peer aborted: {reason}")]
    Aborted {
        /// Its reason.
        reason: String,
    },
    /// Another frame than the one due.
    #[error("the peer sent a {got} frame where {want} was due")]
    Unexpected {
        /// What came.
        got: &'static str,
        /// What was due.
        want: &'static str,
    },
}

impl HandoffError {
    /// The wait for the peer's frame ran out (the stream's read timeout).
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            HandoffError::Frame(FrameError::Io { source, .. })
                if matches!(source.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
        )
    }
}

/// Sends `Released` (the source's job is gone: the destination may restore it), after a
/// [`send_dir_session`] that ended `Committed`.
pub fn send_released<S: Write>(stream: &mut S, session: &mut Session) -> Result<(), FrameError> {
    write_frame(stream, session, &Frame::Released)?;
    stream.flush().map_err(|source| FrameError::Io {
        what: "sending",
        source,
    })
}

/// Waits for `Released` after a [`receive_dir_session`] (as long as the stream's read timeout
/// lets it), its MAC checked.
pub fn await_released<S: Read>(stream: &mut S, session: &mut Session) -> Result<(), HandoffError> {
    let mut buf = Vec::new();
    match read_frame(stream, session, &mut buf)? {
        Frame::Released => Ok(()),
        Frame::Abort { reason } => Err(HandoffError::Aborted { reason }),
        other => Err(HandoffError::Unexpected {
            got: other.name(),
            want: "Released",
        }),
    }
}

/// Sends `Outcome`, the answer to [`await_released`].
pub fn send_outcome<S: Write>(
    stream: &mut S,
    session: &mut Session,
    outcome: &Outcome,
) -> Result<(), FrameError> {
    write_frame(stream, session, &Frame::Outcome(outcome.clone()))?;
    stream.flush().map_err(|source| FrameError::Io {
        what: "sending",
        source,
    })
}

/// Waits for `Outcome` after [`send_released`] (as long as the stream's read timeout lets it),
/// its MAC checked.
pub fn await_outcome<S: Read>(
    stream: &mut S,
    session: &mut Session,
) -> Result<Outcome, HandoffError> {
    await_outcome_or_demands(stream, session, None)
}

/// [`await_outcome`], and meanwhile, with `demands`, each `Demand` that comes told to it (a
/// post-copy's destination asks for the pieces its job waits for); without, a `Demand` is not
/// due.
pub fn await_outcome_or_demands<S: Read>(
    stream: &mut S,
    session: &mut Session,
    mut demands: Option<&mut dyn FnMut(u64)>,
) -> Result<Outcome, HandoffError> {
    let mut buf = Vec::new();
    loop {
        match read_frame(stream, session, &mut buf)? {
            Frame::Outcome(outcome) => return Ok(outcome),
            Frame::Abort { reason } => return Err(HandoffError::Aborted { reason }),
            Frame::Demand { piece } if demands.is_some() => {
                if let Some(tell) = demands.as_mut() {
                    tell(piece);
                }
            }
            other => {
                return Err(HandoffError::Unexpected {
                    got: other.name(),
                    want: "Outcome",
                })
            }
        }
    }
}

/// Asks the source for post-copy piece `piece` next (`Demand`).
pub fn send_demand<S: Write>(
    stream: &mut S,
    session: &mut Session,
    piece: u64,
) -> Result<(), FrameError> {
    write_frame(stream, session, &Frame::Demand { piece })?;
    stream.flush().map_err(|source| FrameError::Io {
        what: "sending",
        source,
    })
}

/// Tells the peer why this end gives up (`Abort`, under the session's MAC), best effort.
pub fn send_abort<S: Write + ?Sized>(stream: &mut S, session: &mut Session, reason: &str) {
    let _ = write_frame(
        stream,
        session,
        &Frame::Abort {
            reason: reason.to_string(),
        },
    );
    let _ = stream.flush();
}

pub(super) fn unexpected(got: &'static str, context: &'static str) -> ReceiveError {
    ReceiveError::Unexpected { got, context }
}
