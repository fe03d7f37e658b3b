//! Why a transfer failed (part of [`super`]).

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use possum_engine::image::ImageError;

use super::session::{FrameError, HandshakeError, Totals};

/// Why a directory could not be sent.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// Listing the directory.
    #[error("reading the directory {}", path.display())]
    List {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Something that is neither a regular file nor a directory.
    #[error("{}: {what}, which is not sent (only regular files and directories are)", path.display())]
    Unsupported {
        /// The entry.
        path: PathBuf,
        /// What it is.
        what: &'static str,
    },
    /// A step asked of the sender out of its order (a caller's mistake, not the files').
    #[error("{what}: not at this point of the transfer")]
    OutOfOrder {
        /// The step.
        what: &'static str,
    },
    /// A name that is not UTF-8.
    #[error("{}: its name is not UTF-8, which the transfer cannot carry", path.display())]
    NotUtf8 {
        /// The entry.
        path: PathBuf,
    },
    /// Reading a file.
    #[error("reading {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A file whose length changed while it was sent.
    #[error("{} changed while it was sent ({listed} bytes when listed)", path.display())]
    Changed {
        /// The file.
        path: PathBuf,
        /// Its length when listed.
        listed: u64,
    },
    /// A file of the final set's first part ([`crate::wire::DirSender::send_final_under`])
    /// that changed or went away before the rest was sent, or a file new under its directories.
    #[error("{path} changed after it was sent with the first part of the final set")]
    ChangedSinceFirstPart {
        /// The file, relative to the directory sent.
        path: String,
    },
    /// A piece of the final set sent again (a patch of a file sent ahead) whose bytes are not
    /// those hashed at the cut: the file changed again since.
    #[error(
        "{}: the {len} bytes at offset {offset} changed again after they were hashed at the cut \
         (the image must not change while it is sent)",
        path.display()
    )]
    Rechanged {
        /// The file.
        path: PathBuf,
        /// Where the piece begins.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// A frame to or from the receiver on the session's first stream.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// A frame on another stream of the session.
    #[error("sending on stream {index} of the session")]
    Stream {
        /// The stream.
        index: u32,
        /// Why.
        #[source]
        source: FrameError,
    },
    /// The receiver gave up.
    #[error("the receiver refused the transfer: {reason}")]
    Rejected {
        /// Its reason.
        reason: String,
    },
    /// Post-copy needs a stream of the session besides the first (which the hand-off uses).
    #[error("post-copy needs a session of two streams or more (--streams), this one has one")]
    NoLaterStream,
    /// The receiver answered `Done` with something else than its confirmation.
    #[error("the receiver answered the transfer's end with a {got} frame, not Committed")]
    Unconfirmed {
        /// What it sent.
        got: &'static str,
    },
    /// The receiver answered a question with something else than its answer.
    #[error("the receiver answered {asked} with a {got} frame")]
    Unanswered {
        /// The question.
        asked: &'static str,
        /// What it sent.
        got: &'static str,
    },
    /// The receiver counted other totals.
    #[error(
        "the receiver counted {} files and {} bytes, {} and {} were sent",
        got.files, got.bytes, sent.files, sent.bytes
    )]
    Miscounted {
        /// Sent.
        sent: Totals,
        /// Counted.
        got: Totals,
    },
}

/// Why a directory could not be received (nothing is left of it).
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    /// The destination exists already.
    #[error("{} exists: a directory is received only under a new name", dest.display())]
    DestExists {
        /// The destination.
        dest: PathBuf,
    },
    /// A destination without a final name.
    #[error("{}: not a directory name to receive into", dest.display())]
    DestName {
        /// The destination.
        dest: PathBuf,
    },
    /// Creating, writing or naming what is received.
    #[error("{what} {}", path.display())]
    Io {
        /// What was done.
        what: &'static str,
        /// On what.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A path the sender may not write.
    #[error("the sender named the path {path:?}, which is refused: {why}")]
    Path {
        /// The path as sent.
        path: String,
        /// Why it is refused.
        why: &'static str,
    },
    /// A frame that does not fit where it came.
    #[error("the sender sent a {got} frame {context}")]
    Unexpected {
        /// What came.
        got: &'static str,
        /// Where.
        context: &'static str,
    },
    /// A chunk of a file its part does not have.
    #[error("a chunk of file {file} of the part, which has {files} files")]
    NoSuchFile {
        /// The file's number, as the chunk said.
        file: u64,
        /// The part's files.
        files: usize,
    },
    /// A chunk outside the bytes sent of its file (and not one of its patches).
    #[error(
        "{path}: a chunk of {len} bytes at offset {offset}, outside the bytes sent of it ({from} \
         to {size}) and not one of its patches"
    )]
    OutOfRange {
        /// The file.
        path: String,
        /// The chunk's offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// Where the file's bytes sent begin (where its base ends).
        from: u64,
        /// The file's size.
        size: u64,
    },
    /// Two chunks of one file that hold the same bytes.
    #[error("{path}: two chunks hold the bytes at offset {offset}")]
    Overlap {
        /// The file.
        path: String,
        /// Where the second begins.
        offset: u64,
    },
    /// A stream whose share of a part is not what it said.
    #[error(
        "stream {stream} ended its share of a part saying {said_chunks} chunks and {said_bytes} \
         bytes; {chunks} and {bytes} came"
    )]
    Share {
        /// The stream.
        stream: u32,
        /// What it said.
        said_chunks: u64,
        /// What it said.
        said_bytes: u64,
        /// What came.
        chunks: u64,
        /// What came.
        bytes: u64,
    },
    /// The session's streams did not all join.
    #[error(
        "only {joined} of the session's {streams} streams joined within {} s",
        waited.as_secs()
    )]
    Streams {
        /// The streams that did (the first connection included).
        joined: u32,
        /// The session's.
        streams: u32,
        /// How long they were waited for.
        waited: Duration,
    },
    /// A file whose bytes are not its size.
    #[error("{path}: {got} bytes received, its size is {size}")]
    Size {
        /// The file.
        path: String,
        /// Its size as announced.
        size: u64,
        /// What came (or would have).
        got: u64,
    },
    /// The sender's totals are not what came.
    #[error(
        "the sender counted {} files and {} bytes, {} and {} were received",
        sent.files, sent.bytes, got.files, got.bytes
    )]
    Totals {
        /// The sender's.
        sent: Totals,
        /// Received.
        got: Totals,
    },
    /// A frame to or from the sender.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The sender gave up.
    #[error("the sender aborted the transfer: {reason}")]
    Aborted {
        /// Its reason.
        reason: String,
    },
    /// A file of the final set whose base is not one sent ahead as it says.
    #[error("{path}: its first bytes are said to be {base}, sent ahead, which is refused: {why}")]
    Ahead {
        /// The file.
        path: String,
        /// The base it named.
        base: String,
        /// Why it is refused.
        why: &'static str,
    },
    /// A file of the final set whose base, this receiver's copy of a file sent ahead, is not
    /// what was received of it.
    #[error("{path}: its base {base}, sent ahead, is refused: {why}")]
    AheadCopy {
        /// The file.
        path: String,
        /// The base it named.
        base: String,
        /// What is wrong with the copy.
        why: String,
    },
    /// A piece of a base sent again after the `Cut` whose bytes are not those the sender hashed
    /// at the cut.
    #[error(
        "{path}: the {len} bytes at offset {offset} sent again over its base are not those the \
         sender hashed at the cut (the file changed again after it was hashed): refused"
    )]
    Patch {
        /// The file.
        path: String,
        /// Where the piece begins.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// A file whose patches did not all come.
    #[error("{path}: {got} of its {patches} patches came")]
    Patches {
        /// The file.
        path: String,
        /// Its patches.
        patches: usize,
        /// Those that came.
        got: usize,
    },
    /// A pre-copy's buffer or chunk the image refused (an unknown buffer, out of its range, a
    /// full disk).
    /// A post-copy chunk that is not one of the pieces left for later, or not its bytes.
    #[error("post-copy: {why}")]
    Later {
        /// What was wrong with it.
        why: String,
    },
    #[error("writing a pre-copied buffer into the image")]
    Sink(#[source] ImageError),
}

/// Why a transfer failed, by step.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The handshake.
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    /// Sending.
    #[error(transparent)]
    Send(#[from] SendError),
    /// Receiving.
    #[error(transparent)]
    Receive(#[from] ReceiveError),
}

/// An error of stream `index` (not the first), said as that stream's.
pub(super) fn on_stream(e: SendError, index: u32) -> SendError {
    match e {
        SendError::Frame(source) => SendError::Stream { index, source },
        e => e,
    }
}
