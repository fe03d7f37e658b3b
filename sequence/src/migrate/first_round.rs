//! While the first pre-copy round writes the GPU images, the job running (part of [`super`]):
//! the connection is made as the round begins, and each chunk the round completed, as its
//! journal says, goes to the destination in a round ahead of only the files written
//! ([`super::copying`]), instead of the whole round after it. Once the round is over, the
//! destination is sent what it needs to begin loading the images into its GPU (the hint, the
//! drafts, the data files no round sent: [`crate::prestage::ahead_files`]) before the rest:
//! what the rounds did not settle, and what the files gained since.

use std::net::TcpStream;
use std::path::Path;
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::copying::{self, Copied, Copying};
use super::held_send::{paced, ReadWrite};
use crate::wire::{DirSender, Pacer, Totals, WireError, Written};

/// The send while the first round runs.
pub(super) struct FirstRound {
    /// Told (or dropped) once the round is over.
    over: Sender<()>,
    thread: JoinHandle<Result<(TcpStream, DirSender, Copied), WireError>>,
}

/// Starts sending, on `link` paced by `pacer`, the chunks the round `copying` follows completes.
pub(super) fn spawn(
    link: (TcpStream, DirSender),
    mut copying: Copying,
    pacer: Option<Arc<Pacer>>,
) -> FirstRound {
    let (over, told) = mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        let (mut stream, mut sender) = link;
        let (copied, _) = paced(pacer.as_ref(), &mut stream, |s| {
            copying::send_while_copying(&mut sender, s, &mut copying, &told)
        })?;
        Ok((stream, sender, copied))
    });
    FirstRound { over, thread }
}

impl FirstRound {
    /// The round is over (or failed): the sending ends once its journal is read to its end
    /// (what it completed since the last round ahead waits for [`after`]). The link back, and
    /// what went; or why the send failed.
    pub(super) fn end(self) -> Result<(TcpStream, DirSender, Copied), WireError> {
        let _ = self.over.send(());
        self.thread
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }
}

/// After the round: the files the destination needs to load the images ahead, then the rest of
/// `dir` as a round ahead, told `written` (the round's account) less what `copied` settled.
pub(super) fn after(
    sender: &mut DirSender,
    stream: &mut dyn ReadWrite,
    dir: &Path,
    (written, copied): (Written, &Copied),
) -> Result<Totals, WireError> {
    let needed = crate::prestage::ahead_files(dir, |f| copied.files.contains(f));
    let first = sender.send_ahead_only(&mut &mut *stream, dir, &needed)?;
    sender.told(written.without(&copied.settled));
    let rest = sender.send_ahead(&mut &mut *stream, dir)?;
    Ok(Totals {
        files: first.files + rest.files,
        bytes: first.bytes + rest.bytes,
    })
}
