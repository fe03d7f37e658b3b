//! Checkpoint sessions inside the job, driven over the control socket.
//!
//! The session's state, one value reached through `state::session` (`state`), and why a step
//! fails (`error`); the steps: opening a checkpoint and its pre-copy (`checkpoint`), the pause
//! and the release (`release`), the resume (`resume`) and a kept checkpoint's save (`save`),
//! over what they share (`common`), what their replies are made of (`replies`) and a save's
//! shadows in the keeper's spare memory (`spare`); the socket and its handlers (`control`).

pub(crate) mod checkpoint;
pub(crate) mod common;
pub(crate) mod control;
pub(crate) mod error;
pub(crate) mod release;
pub(crate) mod replies;
pub(crate) mod resume;
pub(crate) mod save;
pub(crate) mod spare;
pub(crate) mod state;
