//! The session: its handshake, and the frames every connection of it carries (part of
//! [`super`], whose documentation describes both).

use std::collections::HashMap;
use std::fs;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::Duration;

use possum_engine::store::BufferRecord;
use serde::{Deserialize, Serialize};

use super::mac::{keyed, session_id, FrameMac, Misfit, Way, HEADER_BYTES, KEY_BYTES, TAG_BYTES};
use crate::auth::HmacKey;

/// The protocol's version, in the hello and the proof.
pub const PROTOCOL_VERSION: u32 = 7;
/// The first bytes of the hello and the proof.
pub(super) const MAGIC: [u8; 8] = *b"POSSUMWR";
/// A nonce's length (bytes).
pub(super) const NONCE_BYTES: usize = 32;
pub(super) const CLIENT_LABEL: &[u8] = b"possum-wire-v2/client";
pub(super) const SERVER_LABEL: &[u8] = b"possum-wire-v2/server";
pub(super) const JOIN_LABEL: &[u8] = b"possum-wire-v2/join";
pub(super) const JOINED_LABEL: &[u8] = b"possum-wire-v2/joined";
pub(super) const SESSION_LABEL: &[u8] = b"possum-wire-v2/session";
/// The longest frame payload accepted (bytes).
pub const MAX_FRAME: u64 = 64 << 20;
/// The most file bytes a sender puts in one chunk.
pub const CHUNK_BYTES: usize = 4 << 20;
/// The most streams a session may have.
pub const MAX_STREAMS: u32 = 64;
/// The longest abort reason sent (bytes).
pub(super) const MAX_REASON: usize = 4096;
/// The hello: magic, version, receiver nonce.
pub(super) const HELLO_BYTES: usize = 8 + 4 + NONCE_BYTES;
/// What a proof names: the session's id (zeros for a new one), the stream, the streams.
pub(super) const CLAIM_BYTES: usize = 16 + 4 + 4;
/// The proof: magic, version, sender nonce, claim, tag.
pub(super) const PROOF_BYTES: usize = 8 + 4 + NONCE_BYTES + CLAIM_BYTES + TAG_BYTES;

/// Sets `stream`'s read and write timeouts to `timeout`: no read or write of a transfer then
/// waits longer for the peer.
pub fn set_timeouts(stream: &TcpStream, timeout: Duration) -> io::Result<()> {
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_nodelay(true)
}

/// A connection a session's stream goes over (a [`TcpStream`], paced or not).
pub trait Connection: Read + Write + Send {}
impl<T: Read + Write + Send> Connection for T {}

// ---------------------------------------------------------------------------------------------
// Handshake

/// Why the handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// Reading or writing the stream (a timeout included).
    #[error("{what} during the handshake")]
    Io {
        /// What was done.
        what: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The nonce from `/dev/urandom`.
    #[error("reading a nonce from /dev/urandom")]
    Nonce(#[source] io::Error),
    /// The peer does not speak this protocol.
    #[error("the peer is not a possum {peer}: its greeting has no possum magic")]
    NotPossum {
        /// The peer's role.
        peer: &'static str,
    },
    /// The peer speaks another version.
    #[error("the {peer} speaks protocol version {theirs}, this possum {ours}")]
    Version {
        /// The peer's role.
        peer: &'static str,
        /// This end's version.
        ours: u32,
        /// The peer's.
        theirs: u32,
    },
    /// The peer's proof does not match the secret: another secret, or not a possum at all.
    #[error(
        "the {peer} failed authentication: its proof does not match this secret (the two hosts \
         hold different secrets?)"
    )]
    PeerNotAuthenticated {
        /// The peer's role.
        peer: &'static str,
    },
    /// The receiver closed the connection after the sender's proof: it refused it.
    #[error(
        "the receiver closed the connection after this sender's proof: it refused its \
         authentication (the two hosts hold different secrets?) or could not receive"
    )]
    Refused,
    /// A sender asked for more streams than this receiver takes.
    #[error("the sender asked for {asked} streams; this receiver takes 1 to {most}")]
    Streams {
        /// What it asked for.
        asked: u32,
        /// The most taken.
        most: u32,
    },
    /// A connection that claims to be a stream of a session this receiver does not have open.
    #[error(
        "a connection claims to be stream {index} of a session this receiver does not have \
         open: it belongs to no session here"
    )]
    UnknownSession {
        /// The stream it claimed to be.
        index: u32,
    },
    /// A connection that claims a stream its session does not have, or has already.
    #[error("a connection claims to be stream {index} of a session of {streams} streams: {why}")]
    NotAStream {
        /// The stream it claimed to be.
        index: u32,
        /// The session's streams.
        streams: u32,
        /// Why that is refused.
        why: &'static str,
    },
    /// Opening another stream of the session (the sender's).
    #[error("opening stream {index} of the session")]
    Open {
        /// The stream.
        index: u32,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// `N` random bytes from `/dev/urandom`.
pub(super) fn random<const N: usize>() -> io::Result<[u8; N]> {
    let mut n = [0u8; N];
    fs::File::open("/dev/urandom")?.read_exact(&mut n)?;
    Ok(n)
}

pub(super) fn nonce() -> Result<[u8; NONCE_BYTES], HandshakeError> {
    random().map_err(HandshakeError::Nonce)
}

/// What a handshake agreed on: the session's key, how many streams it has, and the MACs of the
/// frames on its first connection, each way.
pub struct Session {
    pub(super) key: [u8; KEY_BYTES],
    pub(super) id: [u8; 16],
    pub(super) streams: u32,
    /// This end's frames on the first connection.
    pub(super) send: FrameMac,
    /// The peer's frames on the first connection.
    pub(super) recv: FrameMac,
    /// A receiver's: where the session's other streams arrive.
    pub(super) joins: Option<Joins>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Session({} streams)", self.streams)
    }
}

impl Session {
    pub(super) fn new(
        wire_key: &[u8; KEY_BYTES],
        rn: &[u8],
        sn: &[u8],
        streams: u32,
        sender: bool,
    ) -> Self {
        let key = *keyed(wire_key, &[SESSION_LABEL, rn, sn, &streams.to_le_bytes()]).as_bytes();
        let (mine, theirs) = if sender {
            (Way::ToReceiver, Way::ToSender)
        } else {
            (Way::ToSender, Way::ToReceiver)
        };
        Session {
            key,
            id: session_id(&key),
            streams,
            send: FrameMac::new(&key, 0, mine),
            recv: FrameMac::new(&key, 0, theirs),
            joins: None,
        }
    }

    /// How many streams (connections) the session has: 1, its first alone, or more.
    pub fn streams(&self) -> u32 {
        self.streams
    }
}

pub(super) fn hs_io(what: &'static str) -> impl FnOnce(io::Error) -> HandshakeError {
    move |source| HandshakeError::Io { what, source }
}

/// Writes one handshake message whole and flushes it (`what` names it in an error).
pub(super) fn hs_send<S: Write + ?Sized>(
    stream: &mut S,
    bytes: &[u8],
    what: &'static str,
) -> Result<(), HandshakeError> {
    stream
        .write_all(bytes)
        .and_then(|()| stream.flush())
        .map_err(hs_io(what))
}

/// What a proof claims: the session (zeros for a new one), the stream, the session's streams.
pub(super) fn claim(id: &[u8; 16], index: u32, streams: u32) -> [u8; CLAIM_BYTES] {
    let mut c = [0u8; CLAIM_BYTES];
    c[..16].copy_from_slice(id);
    c[16..20].copy_from_slice(&index.to_le_bytes());
    c[20..].copy_from_slice(&streams.to_le_bytes());
    c
}

/// What a receiver's handshake on a new connection accepted.
#[derive(Debug)]
pub enum Accepted {
    /// A new session, on its first connection.
    Session(Session),
    /// Another stream of a session this receiver has open: hand its connection to it.
    Stream(Joined),
}

/// The receiver's side of the handshake on a connection that may make a session or join one of
/// `sessions`: sends its hello, checks the sender's proof (writing nothing more if it fails),
/// answers its own.
pub fn accept_handshake<S: Read + Write + ?Sized>(
    stream: &mut S,
    key: &HmacKey,
    sessions: &Sessions,
) -> Result<Accepted, HandshakeError> {
    let rn = nonce()?;
    let mut hello = Vec::with_capacity(HELLO_BYTES);
    hello.extend_from_slice(&MAGIC);
    hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    hello.extend_from_slice(&rn);
    hs_send(stream, &hello, "sending the hello")?;

    let mut proof = [0u8; PROOF_BYTES];
    let reading = hs_io("reading the sender's proof");
    // The greeting first: a sender of another version is told so, whatever its proof's length.
    stream.read_exact(&mut proof[..12]).map_err(reading)?;
    check_greeting(&proof[..8], &proof[8..12], "sender")?;
    stream
        .read_exact(&mut proof[12..])
        .map_err(hs_io("reading the sender's proof"))?;
    let sn = &proof[12..12 + NONCE_BYTES];
    let claimed = &proof[12 + NONCE_BYTES..12 + NONCE_BYTES + CLAIM_BYTES];
    let tag = blake3::Hash::from_bytes(proof[PROOF_BYTES - TAG_BYTES..].try_into().expect("32"));
    let id: [u8; 16] = claimed[..16].try_into().expect("16 bytes");
    let index = u32::from_le_bytes(claimed[16..20].try_into().expect("4 bytes"));
    let streams = u32::from_le_bytes(claimed[20..].try_into().expect("4 bytes"));
    let refused = HandshakeError::PeerNotAuthenticated { peer: "sender" };

    if id == [0; 16] && index == 0 {
        let wire_key = key.wire_key();
        if keyed(&wire_key, &[CLIENT_LABEL, &rn, sn, claimed]) != tag {
            return Err(refused);
        }
        let most = if sessions.joinable() { MAX_STREAMS } else { 1 };
        if !(1..=most).contains(&streams) {
            return Err(HandshakeError::Streams {
                asked: streams,
                most,
            });
        }
        let mut session = Session::new(&wire_key, &rn, sn, streams, false);
        // Open before the answer: the sender's other streams come only after it.
        if streams > 1 {
            session.joins = Some(sessions.open(&session));
        }
        let answer = keyed(&wire_key, &[SERVER_LABEL, sn, &rn, claimed]);
        hs_send(stream, answer.as_bytes(), "sending the receiver's proof")?;
        return Ok(Accepted::Session(session));
    }
    let (session_key, has) = sessions
        .find(&id)
        .ok_or(HandshakeError::UnknownSession { index })?;
    if keyed(&session_key, &[JOIN_LABEL, &rn, sn, claimed]) != tag {
        return Err(refused);
    }
    let joined = sessions.claim(&id, index, streams, has)?;
    let answer = keyed(&session_key, &[JOINED_LABEL, sn, &rn, claimed]);
    hs_send(stream, answer.as_bytes(), "sending the receiver's proof")?;
    Ok(Accepted::Stream(joined))
}

/// The receiver's side of the handshake on a connection that is a session of one stream: a
/// sender asking for more, or joining a session, is refused.
pub fn receiver_handshake<S: Read + Write + ?Sized>(
    stream: &mut S,
    key: &HmacKey,
) -> Result<Session, HandshakeError> {
    match accept_handshake(stream, key, &Sessions::single())? {
        Accepted::Session(s) => Ok(s),
        Accepted::Stream(j) => Err(HandshakeError::UnknownSession { index: j.index() }),
    }
}

/// The sender's side of the handshake for a session of one stream: reads the hello, sends its
/// proof, checks the receiver's.
pub fn sender_handshake<S: Read + Write + ?Sized>(
    stream: &mut S,
    key: &HmacKey,
) -> Result<Session, HandshakeError> {
    sender_handshake_streams(stream, key, 1)
}

/// The sender's side of the handshake for a session of `streams` streams, on its first
/// connection (the others join it: [`DirSender::start_streams`]).
pub fn sender_handshake_streams<S: Read + Write + ?Sized>(
    stream: &mut S,
    key: &HmacKey,
    streams: u32,
) -> Result<Session, HandshakeError> {
    let wire_key = key.wire_key();
    let (rn, sn) = prove(
        stream,
        &wire_key,
        [CLIENT_LABEL, SERVER_LABEL],
        &claim(&[0; 16], 0, streams),
    )?;
    Ok(Session::new(&wire_key, &rn, &sn, streams, true))
}

/// The sender's handshake on another connection of `session`, which it joins as stream
/// `index`: the MAC of its frames.
pub(super) fn join_handshake<S: Read + Write + ?Sized>(
    stream: &mut S,
    session: &Session,
    index: u32,
) -> Result<FrameMac, HandshakeError> {
    prove(
        stream,
        &session.key,
        [JOIN_LABEL, JOINED_LABEL],
        &claim(&session.id, index, session.streams),
    )?;
    Ok(FrameMac::new(&session.key, index, Way::ToReceiver))
}

/// The sender's half of a handshake: reads the hello, sends the proof of `claimed` under `key`,
/// checks the answer; the two nonces.
pub(super) fn prove<S: Read + Write + ?Sized>(
    stream: &mut S,
    key: &[u8; KEY_BYTES],
    [client, server]: [&[u8]; 2],
    claimed: &[u8; CLAIM_BYTES],
) -> Result<([u8; NONCE_BYTES], [u8; NONCE_BYTES]), HandshakeError> {
    let mut hello = [0u8; HELLO_BYTES];
    stream
        .read_exact(&mut hello)
        .map_err(hs_io("reading the receiver's hello"))?;
    check_greeting(&hello[..8], &hello[8..12], "receiver")?;
    let rn: [u8; NONCE_BYTES] = hello[12..].try_into().expect("32 bytes");
    let sn = nonce()?;
    let mut proof = Vec::with_capacity(PROOF_BYTES);
    proof.extend_from_slice(&MAGIC);
    proof.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    proof.extend_from_slice(&sn);
    proof.extend_from_slice(claimed);
    proof.extend_from_slice(keyed(key, &[client, &rn, &sn, claimed]).as_bytes());
    hs_send(stream, &proof, "sending the sender's proof")?;

    let mut answer = [0u8; TAG_BYTES];
    match stream.read_exact(&mut answer) {
        Ok(()) => {}
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::BrokenPipe
            ) =>
        {
            return Err(HandshakeError::Refused)
        }
        Err(e) => return Err(hs_io("reading the receiver's proof")(e)),
    }
    if keyed(key, &[server, &sn, &rn, claimed]) != blake3::Hash::from_bytes(answer) {
        return Err(HandshakeError::PeerNotAuthenticated { peer: "receiver" });
    }
    Ok((rn, sn))
}

pub(super) fn check_greeting(
    magic: &[u8],
    version: &[u8],
    peer: &'static str,
) -> Result<(), HandshakeError> {
    if magic != MAGIC {
        return Err(HandshakeError::NotPossum { peer });
    }
    let theirs = u32::from_le_bytes(version.try_into().expect("4 bytes"));
    if theirs != PROTOCOL_VERSION {
        return Err(HandshakeError::Version {
            peer,
            ours: PROTOCOL_VERSION,
            theirs,
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Frames

/// A directory's header.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirHeader {
    /// Its path, relative to the directory sent.
    pub path: String,
    /// Its permission bits.
    pub mode: u32,
}

/// A file's header: the chunks of its part that name its `id` are its bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileHeader {
    /// Its number in its part (the files of a part are numbered from 0, in order).
    pub id: u64,
    /// Its path, relative to the directory sent.
    pub path: String,
    /// Its length (bytes).
    pub size: u64,
    /// Its permission bits.
    pub mode: u32,
    /// The file sent ahead that holds its first bytes (the chunks then begin where it ends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<Base>,
}

/// A file sent ahead (before the `Cut`, or in an earlier round) that a file begins with: the
/// receiver moves it into place (or goes on with it), once its own digest of what it received
/// matches (and, after the `Cut`, its copy read back holds exactly that), and writes its
/// `patches` over it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Base {
    /// Its path as it was sent ahead.
    pub path: String,
    /// Its length as it was sent ahead (bytes).
    pub size: u64,
    /// The digest of those bytes as they were sent: the BLAKE3 of their pieces' offsets,
    /// lengths and BLAKE3 hashes, in order, lowercase hex.
    pub digest: String,
    /// The pieces of it (each one as it was sent ahead: its offset and length) whose bytes
    /// changed since, in the file rewritten in place: sent again in this part, each as one
    /// chunk at its offset, and written over the copy sent ahead. The rest of it is unchanged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub patches: Vec<Patch>,
}

/// A piece of a [`Base`] sent again: it changed since it was sent ahead.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Patch {
    /// Where it begins in the file (a piece sent ahead begins there).
    pub offset: u64,
    /// Its length (that piece's).
    pub len: u64,
    /// After the `Cut`: the BLAKE3 of its bytes as the sender hashed them at the cut, lowercase
    /// hex; its chunk must carry exactly those bytes (the file did not change again since).
    /// Ahead of the cut, none: the file may change while it is sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    /// Post-copy ([`super::LaterSender`]): not sent in this part but after the transfer, over
    /// the session's other streams, once the receiver named the directory (which holds
    /// [`super::POST_COPY`] until it came). Only after the `Cut`, with a `hash`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub later: bool,
}

/// The counts of a transfer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Regular files.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// One frame after the handshake.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A directory to create.
    Dir(DirHeader),
    /// A file of the part.
    File(FileHeader),
    /// The part's headers are over: its chunks follow, on every stream.
    Chunks,
    /// Bytes of a file of the part, from `offset`.
    Chunk {
        /// The file's number in its part.
        file: u64,
        /// Where in the file.
        offset: u64,
        /// The bytes.
        data: &'a [u8],
    },
    /// This stream's share of the part is over.
    EndPart {
        /// The chunks it carried.
        chunks: u64,
        /// Their bytes.
        bytes: u64,
    },
    /// Everything was sent.
    Done(Totals),
    /// The receiver named the directory.
    Committed(Totals),
    /// The peer gives up.
    Abort {
        /// Why.
        reason: String,
    },
    /// The source's job is gone: restore it (a migration, after `Committed`); again after
    /// `Outcome` `Restored`: let it run.
    Released,
    /// What became of the restore at the destination (the answer to `Released`).
    Outcome(Outcome),
    /// The files so far were sent ahead (the job still running); the final set follows.
    Cut,
    /// A pre-copy's buffer declared (before any of its bytes; again in a later round).
    Buffer(BufferRecord),
    /// Post-copy, from the destination once the job runs there: the piece left for later of
    /// this number (its index in the final set's pieces left, in the order of their files'
    /// paths and offsets) is needed now: send it next.
    Demand {
        /// The piece.
        piece: u64,
    },
    /// After the `Cut`, between parts: the file of the final set at this path, received since
    /// the `Cut` (a part of a file sent while it was still being written that the final set
    /// does not have), is to go.
    Remove {
        /// The file, relative to the directory.
        path: String,
    },
    /// Before the `Cut`, between parts: how much of what was sent ahead has the destination
    /// loaded into GPU memory? (Answered with `Loaded`.)
    LoadQuery,
    /// The answer to `LoadQuery`: the bytes of the GPU images sent ahead that the destination
    /// has loaded, and those it still loads (0: it loads no more, or loads nothing ahead).
    Loaded {
        /// Loaded.
        loaded: u64,
        /// Still loading.
        left: u64,
    },
    /// A pre-copy's bytes of a declared buffer from `offset` (a later round's replace them).
    BufferChunk {
        /// The buffer's id.
        buffer: u64,
        /// Where in the buffer.
        offset: u64,
        /// The bytes.
        data: &'a [u8],
    },
}

/// What became of a migrated job's restore at the destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It is restored there, as this process, and held until the source says go (a second
    /// `Released`): until then it has not run, and without the go it is killed.
    Restored {
        /// The restored process.
        pid: i32,
    },
    /// It runs there, as this process.
    Running {
        /// The restored process.
        pid: i32,
    },
    /// It could not be restored there.
    RestoreFailed {
        /// Why.
        reason: String,
    },
    /// After `Running`: the image it was restored from is synced to disk there (received
    /// unsynced, [`super::Durability::Later`]), so the source may drop its own.
    Synced {
        /// The process running there.
        pid: i32,
        /// How long it waited, once it ran, for buffers not yet back (its own account, known
        /// once they all were; `None` if it did not say).
        waited: Option<Duration>,
    },
}

/// `reason`'s bytes, at most [`MAX_REASON`] of them, cut on a character boundary.
pub(super) fn cut_reason(reason: &str) -> &[u8] {
    let mut end = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason.as_bytes()[..end]
}

pub(super) const KIND_DIR: u8 = 1;
pub(super) const KIND_FILE: u8 = 2;
pub(super) const KIND_CHUNK: u8 = 3;
pub(super) const KIND_END_PART: u8 = 4;
pub(super) const KIND_DONE: u8 = 5;
pub(super) const KIND_COMMITTED: u8 = 6;
pub(super) const KIND_ABORT: u8 = 7;
pub(super) const KIND_RELEASED: u8 = 8;
pub(super) const KIND_OUTCOME: u8 = 9;
pub(super) const KIND_BUFFER: u8 = 10;
pub(super) const KIND_BUFFER_CHUNK: u8 = 11;
pub(super) const KIND_CUT: u8 = 12;
pub(super) const KIND_CHUNKS: u8 = 13;
pub(super) const KIND_DEMAND: u8 = 14;
pub(super) const KIND_REMOVE: u8 = 15;
pub(super) const KIND_LOAD_QUERY: u8 = 16;
pub(super) const KIND_LOADED: u8 = 17;
/// A `Buffer` frame's payload: id, va, size (`u64` LE), prefetch rank (`u32` LE).
pub(super) const BUFFER_BYTES: usize = 28;
/// The head of a `Chunk` or `BufferChunk` (the rest is its body): two `u64`.
pub(super) const PLACE_BYTES: usize = 16;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// Reading or writing the stream (a timeout included).
    #[error("{what} a frame")]
    Io {
        /// What was done.
        what: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The peer closed the connection where a frame was due.
    #[error("the peer closed the connection before the transfer was complete")]
    Closed,
    /// A frame over the cap.
    #[error("a frame of {len} bytes: the largest accepted is {MAX_FRAME}")]
    TooLarge {
        /// Its announced length.
        len: u64,
    },
    /// A kind this protocol does not have.
    #[error("a frame of unknown kind {0}")]
    UnknownKind(u8),
    /// A frame whose MAC is not the one due: changed, dropped, replayed or reordered.
    #[error("frame {seq} of stream {stream}, a {} of {len} bytes, {why}", kind_name(*kind))]
    Unauthenticated {
        /// Its kind.
        kind: u8,
        /// Its length.
        len: u64,
        /// The stream it came on (0 the session's first).
        stream: u32,
        /// Its number on that stream, as received.
        seq: u64,
        /// What it is instead.
        why: Misfit,
    },
    /// A payload that is not its kind's.
    #[error("a malformed {kind} frame: {why}")]
    Malformed {
        /// Its kind.
        kind: &'static str,
        /// What is wrong.
        why: String,
    },
}

pub(super) fn kind_name(kind: u8) -> &'static str {
    match kind {
        KIND_DIR => "Dir",
        KIND_FILE => "File",
        KIND_CHUNK => "Chunk",
        KIND_END_PART => "EndPart",
        KIND_DONE => "Done",
        KIND_COMMITTED => "Committed",
        KIND_ABORT => "Abort",
        KIND_RELEASED => "Released",
        KIND_OUTCOME => "Outcome",
        KIND_BUFFER => "Buffer",
        KIND_BUFFER_CHUNK => "BufferChunk",
        KIND_CUT => "Cut",
        KIND_CHUNKS => "Chunks",
        KIND_DEMAND => "Demand",
        KIND_REMOVE => "Remove",
        KIND_LOAD_QUERY => "LoadQuery",
        KIND_LOADED => "Loaded",
        _ => "unknown",
    }
}

impl Frame<'_> {
    pub(super) fn name(&self) -> &'static str {
        kind_name(self.kind())
    }

    fn kind(&self) -> u8 {
        match self {
            Frame::Dir(_) => KIND_DIR,
            Frame::File(_) => KIND_FILE,
            Frame::Chunks => KIND_CHUNKS,
            Frame::Chunk { .. } => KIND_CHUNK,
            Frame::EndPart { .. } => KIND_END_PART,
            Frame::Done(_) => KIND_DONE,
            Frame::Committed(_) => KIND_COMMITTED,
            Frame::Abort { .. } => KIND_ABORT,
            Frame::Released => KIND_RELEASED,
            Frame::Outcome(_) => KIND_OUTCOME,
            Frame::Buffer(_) => KIND_BUFFER,
            Frame::BufferChunk { .. } => KIND_BUFFER_CHUNK,
            Frame::Cut => KIND_CUT,
            Frame::Demand { .. } => KIND_DEMAND,
            Frame::Remove { .. } => KIND_REMOVE,
            Frame::LoadQuery => KIND_LOAD_QUERY,
            Frame::Loaded { .. } => KIND_LOADED,
        }
    }
}

pub(super) fn u64s(a: u64, b: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(16);
    v.extend_from_slice(&a.to_le_bytes());
    v.extend_from_slice(&b.to_le_bytes());
    v
}

/// A frame's head (its fields) and body (its bulk bytes).
pub(super) fn encode<'a>(frame: &Frame<'a>) -> (Vec<u8>, &'a [u8]) {
    match frame {
        Frame::Dir(h) => (serde_json::to_vec(h).expect("a header serializes"), &[]),
        Frame::File(h) => (serde_json::to_vec(h).expect("a header serializes"), &[]),
        Frame::Chunk { file, offset, data } => (u64s(*file, *offset), data),
        Frame::EndPart { chunks, bytes } => (u64s(*chunks, *bytes), &[]),
        Frame::Demand { piece } => (piece.to_le_bytes().to_vec(), &[]),
        Frame::Loaded { loaded, left } => (u64s(*loaded, *left), &[]),
        Frame::Chunks | Frame::Cut | Frame::Released | Frame::LoadQuery => (Vec::new(), &[]),
        Frame::Done(t) | Frame::Committed(t) => (u64s(t.files, t.bytes), &[]),
        Frame::Abort { reason } => (cut_reason(reason).to_vec(), &[]),
        Frame::Remove { path } => (path.as_bytes().to_vec(), &[]),
        Frame::Outcome(o) => {
            let (status, pid, reason) = match o {
                Outcome::Running { pid } => (1u8, *pid, &[][..]),
                Outcome::Restored { pid } => (2, *pid, &[][..]),
                Outcome::RestoreFailed { reason } => (0, 0, cut_reason(reason)),
                Outcome::Synced { pid, .. } => (3, *pid, &[][..]),
            };
            let mut head = vec![status];
            head.extend_from_slice(&pid.to_le_bytes());
            head.extend_from_slice(reason);
            if let Outcome::Synced { waited, .. } = o {
                // Microseconds; all ones: not said.
                let us = waited.map_or(u64::MAX, |w| {
                    u64::try_from(w.as_micros()).unwrap_or(u64::MAX - 1)
                });
                head.extend_from_slice(&us.to_le_bytes());
            }
            (head, &[])
        }
        Frame::Buffer(r) => {
            let mut b = Vec::with_capacity(BUFFER_BYTES);
            b.extend_from_slice(&r.id.to_le_bytes());
            b.extend_from_slice(&r.va.to_le_bytes());
            b.extend_from_slice(&r.size.to_le_bytes());
            b.extend_from_slice(&r.prefetch_rank.to_le_bytes());
            (b, &[])
        }
        Frame::BufferChunk {
            buffer,
            offset,
            data,
        } => (u64s(*buffer, *offset), data),
    }
}

/// Where a payload of `kind` and `len` bytes splits into head and body.
pub(super) fn head_len(kind: u8, len: usize) -> usize {
    match kind {
        KIND_CHUNK | KIND_BUFFER_CHUNK => PLACE_BYTES.min(len),
        _ => len,
    }
}

/// Writes `frame` on the session's first connection.
pub fn write_frame<W: Write + ?Sized>(
    w: &mut W,
    session: &mut Session,
    frame: &Frame<'_>,
) -> Result<(), FrameError> {
    send_frame(w, &mut session.send, frame, None).map(drop)
}

/// Reads one frame from the session's first connection, its payload into `buf` (which the
/// frame borrows), its MAC checked.
pub fn read_frame<'b, R: Read + ?Sized>(
    r: &mut R,
    session: &mut Session,
    buf: &'b mut Vec<u8>,
) -> Result<Frame<'b>, FrameError> {
    recv_frame(r, &mut session.recv, buf).map(|(f, _)| f)
}

/// Writes `frame` to `w` under `mac`, its body's BLAKE3 `body` (computed here if not given);
/// returns that hash.
pub(super) fn send_frame<W: Write + ?Sized>(
    w: &mut W,
    mac: &mut FrameMac,
    frame: &Frame<'_>,
    body: Option<blake3::Hash>,
) -> Result<blake3::Hash, FrameError> {
    let (head, data) = encode(frame);
    let len = (head.len() + data.len()) as u64;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge { len });
    }
    let body = body.unwrap_or_else(|| blake3::hash(data));
    let mut header = [0u8; HEADER_BYTES];
    header[0] = frame.kind();
    header[1..].copy_from_slice(&len.to_le_bytes());
    let tag = mac.seal(&header, &head, &body);
    let io = |source| FrameError::Io {
        what: "sending",
        source,
    };
    // Header and head in one write; a frame without a body, its MAC too.
    let mut first = Vec::with_capacity(HEADER_BYTES + head.len() + TAG_BYTES);
    first.extend_from_slice(&header);
    first.extend_from_slice(&head);
    if data.is_empty() {
        first.extend_from_slice(&tag);
        return w.write_all(&first).map_err(io).map(|()| body);
    }
    w.write_all(&first).map_err(io)?;
    w.write_all(data).map_err(io)?;
    w.write_all(&tag).map_err(io)?;
    Ok(body)
}

/// Reads one frame from `r` under `mac` (its payload into `buf`, which the frame borrows): the
/// frame, once its MAC is checked, and its body's BLAKE3.
pub(super) fn recv_frame<'b, R: Read + ?Sized>(
    r: &mut R,
    mac: &mut FrameMac,
    buf: &'b mut Vec<u8>,
) -> Result<(Frame<'b>, blake3::Hash), FrameError> {
    let mut header = [0u8; HEADER_BYTES];
    // A close before a frame's first byte is the peer going away; within it, a truncation.
    let mut got = 0;
    while got < HEADER_BYTES {
        match r.read(&mut header[got..]) {
            Ok(0) => return Err(FrameError::Closed),
            Ok(k) => got += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(FrameError::Io {
                    what: "receiving",
                    source,
                })
            }
        }
    }
    let kind = header[0];
    let len = u64::from_le_bytes(header[1..].try_into().expect("8 bytes"));
    if !(KIND_DIR..=KIND_LOADED).contains(&kind) {
        return Err(FrameError::UnknownKind(kind));
    }
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge { len });
    }
    let n = len as usize;
    // Grown, never cleared: no pass over the bytes before they are read into.
    if buf.len() < n + TAG_BYTES {
        buf.resize(n + TAG_BYTES, 0);
    }
    r.read_exact(&mut buf[..n + TAG_BYTES])
        .map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => FrameError::Closed,
            _ => FrameError::Io {
                what: "receiving",
                source: e,
            },
        })?;
    let buf: &'b [u8] = buf;
    let (payload, rest) = buf.split_at(n);
    let tag: &[u8; TAG_BYTES] = rest[..TAG_BYTES].try_into().expect("32 bytes");
    let (head, data) = payload.split_at(head_len(kind, n));
    let body = blake3::hash(data);
    let (stream, seq) = (mac.stream(), mac.next());
    mac.check(&header, head, &body, tag)
        .map_err(|why| FrameError::Unauthenticated {
            kind,
            len,
            stream,
            seq,
            why,
        })?;
    Ok((decode(kind, payload)?, body))
}

/// The frame of `kind` whose payload is `payload` (its MAC checked).
pub(super) fn decode(kind: u8, payload: &[u8]) -> Result<Frame<'_>, FrameError> {
    let name = kind_name(kind);
    let malformed = |why: String| FrameError::Malformed { kind: name, why };
    let exact = |n: usize| {
        if payload.len() == n {
            Ok(())
        } else {
            Err(malformed(format!(
                "{} bytes of payload, not {n}",
                payload.len()
            )))
        }
    };
    let u = |at: usize| u64::from_le_bytes(payload[at..at + 8].try_into().expect("8 bytes"));
    let placed = || {
        if payload.len() < PLACE_BYTES {
            return Err(malformed("shorter than its place".into()));
        }
        Ok((u(0), u(8), &payload[PLACE_BYTES..]))
    };
    Ok(match kind {
        KIND_DIR => {
            Frame::Dir(serde_json::from_slice(payload).map_err(|e| malformed(e.to_string()))?)
        }
        KIND_FILE => {
            Frame::File(serde_json::from_slice(payload).map_err(|e| malformed(e.to_string()))?)
        }
        KIND_CHUNK => {
            let (file, offset, data) = placed()?;
            Frame::Chunk { file, offset, data }
        }
        KIND_BUFFER_CHUNK => {
            let (buffer, offset, data) = placed()?;
            Frame::BufferChunk {
                buffer,
                offset,
                data,
            }
        }
        KIND_DEMAND => {
            exact(8)?;
            Frame::Demand { piece: u(0) }
        }
        KIND_REMOVE => Frame::Remove {
            path: String::from_utf8(payload.to_vec())
                .map_err(|_| malformed("a path that is not UTF-8".into()))?,
        },
        KIND_END_PART => {
            exact(16)?;
            Frame::EndPart {
                chunks: u(0),
                bytes: u(8),
            }
        }
        KIND_CHUNKS | KIND_CUT | KIND_RELEASED | KIND_LOAD_QUERY => {
            exact(0)?;
            match kind {
                KIND_CHUNKS => Frame::Chunks,
                KIND_CUT => Frame::Cut,
                KIND_LOAD_QUERY => Frame::LoadQuery,
                _ => Frame::Released,
            }
        }
        KIND_LOADED => {
            exact(16)?;
            Frame::Loaded {
                loaded: u(0),
                left: u(8),
            }
        }
        KIND_DONE | KIND_COMMITTED => {
            exact(16)?;
            let t = Totals {
                files: u(0),
                bytes: u(8),
            };
            if kind == KIND_DONE {
                Frame::Done(t)
            } else {
                Frame::Committed(t)
            }
        }
        KIND_BUFFER => {
            exact(BUFFER_BYTES)?;
            Frame::Buffer(BufferRecord {
                id: u(0),
                va: u(8),
                size: u(16),
                prefetch_rank: u32::from_le_bytes(payload[24..].try_into().expect("4 bytes")),
            })
        }
        KIND_OUTCOME => Frame::Outcome(decode_outcome(payload).map_err(malformed)?),
        _ => Frame::Abort {
            reason: String::from_utf8_lossy(payload).into_owned(),
        },
    })
}

/// An `Outcome` frame's payload: its outcome, or what is wrong with it.
fn decode_outcome(payload: &[u8]) -> Result<Outcome, String> {
    if payload.len() < 5 {
        return Err("shorter than its status and pid".into());
    }
    let pid = i32::from_le_bytes(payload[1..5].try_into().expect("4 bytes"));
    if payload[0] == 3 {
        // Synced: the job's wait after it ran, not a reason.
        let us: [u8; 8] = (payload[5..].try_into())
            .map_err(|_| "synced, without the wait after resume".to_string())?;
        let us = u64::from_le_bytes(us);
        return Ok(Outcome::Synced {
            pid,
            waited: (us != u64::MAX).then(|| Duration::from_micros(us)),
        });
    }
    let reason = String::from_utf8(payload[5..].to_vec())
        .map_err(|_| "a reason that is not UTF-8".to_string())?;
    match payload[0] {
        1 if reason.is_empty() => Ok(Outcome::Running { pid }),
        2 if reason.is_empty() => Ok(Outcome::Restored { pid }),
        0 => Ok(Outcome::RestoreFailed { reason }),
        _ => Err("neither restored, running, synced nor failed".into()),
    }
}

// ---------------------------------------------------------------------------------------------
// The streams of a session beyond its first connection: the receiver's registry of sessions
// they may join, and each stream's connection and MAC.

/// A stream's connection as the receiver reads it.
pub(super) type Conn = Box<dyn Read + Send>;

/// A stream of a session, as its receiver holds it: its connection and the MAC of its frames.
pub(super) struct RecvLane {
    pub conn: Conn,
    pub mac: FrameMac,
}

/// A stream of a session, as its sender holds it.
pub(super) struct SendLane {
    pub conn: Box<dyn Connection>,
    pub mac: FrameMac,
}

impl std::fmt::Debug for SendLane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SendLane({:?})", self.mac)
    }
}

/// A session open to joins: its key, its streams, which have joined, and where they go.
struct Open {
    key: [u8; KEY_BYTES],
    streams: u32,
    joined: Vec<bool>,
    to: mpsc::Sender<(u32, Conn)>,
}

type Registry = Arc<Mutex<HashMap<[u8; 16], Open>>>;

/// The sessions of a receiver that more streams may join: one registry shared by the threads
/// that take its connections ([`accept_handshake`]), each stream handed to its session's
/// receive ([`Joined::join`]).
#[derive(Clone)]
pub struct Sessions {
    /// None: this receiver takes sessions of one stream.
    open: Option<Registry>,
    /// How long a session's receive waits for its streams to join.
    wait: Duration,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let open = self.open.as_ref().map(|o| lock(o).len());
        write!(f, "Sessions(open {open:?}, wait {:?})", self.wait)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Sessions {
    /// Sessions of any number of streams (up to [`MAX_STREAMS`]), each of whose receives waits
    /// at most `wait` for its streams to join.
    pub fn new(wait: Duration) -> Sessions {
        Sessions {
            open: Some(Arc::default()),
            wait,
        }
    }

    /// Sessions of one stream only: a sender asking for more is refused at its handshake.
    pub fn single() -> Sessions {
        Sessions {
            open: None,
            wait: Duration::ZERO,
        }
    }

    pub(super) fn joinable(&self) -> bool {
        self.open.is_some()
    }

    /// Opens `session` to joins, until the handle returned is dropped.
    pub(super) fn open(&self, session: &Session) -> Joins {
        let registry = self.open.clone().expect("a joinable registry");
        let (to, from) = mpsc::channel();
        lock(&registry).insert(
            session.id,
            Open {
                key: session.key,
                streams: session.streams,
                joined: vec![false; session.streams as usize],
                to,
            },
        );
        Joins {
            registry,
            id: session.id,
            from,
            wait: self.wait,
        }
    }

    /// The key and the streams of the open session `id`.
    pub(super) fn find(&self, id: &[u8; 16]) -> Option<([u8; KEY_BYTES], u32)> {
        let open = self.open.as_ref()?;
        lock(open).get(id).map(|o| (o.key, o.streams))
    }

    /// Stream `index` of the open session `id` (of `has` streams), claimed by a connection that
    /// said the session has `streams`: refused unless it is one of its streams not yet joined.
    pub(super) fn claim(
        &self,
        id: &[u8; 16],
        index: u32,
        streams: u32,
        has: u32,
    ) -> Result<Joined, HandshakeError> {
        let not = |why| HandshakeError::NotAStream {
            index,
            streams: has,
            why,
        };
        if streams != has {
            return Err(not("it says the session has another number of streams"));
        }
        if index == 0 || index >= has {
            return Err(not("the session has no such stream"));
        }
        let registry = self
            .open
            .as_ref()
            .ok_or(HandshakeError::UnknownSession { index })?;
        let mut open = lock(registry);
        let o = open
            .get_mut(id)
            .ok_or(HandshakeError::UnknownSession { index })?;
        if std::mem::replace(&mut o.joined[index as usize], true) {
            return Err(not("that stream has joined already"));
        }
        Ok(Joined {
            index,
            to: o.to.clone(),
        })
    }
}

/// A connection that joined a session as one of its streams: hand it over with
/// [`Joined::join`].
#[derive(Debug)]
pub struct Joined {
    index: u32,
    to: mpsc::Sender<(u32, Conn)>,
}

impl Joined {
    /// The stream it is.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Hands `conn` (its reads bounded) to its session's receive; false if that receive is
    /// over.
    pub fn join(self, conn: impl Read + Send + 'static) -> bool {
        self.to.send((self.index, Box::new(conn))).is_ok()
    }
}

/// A receiver's session open to joins: closed to them when dropped.
pub(super) struct Joins {
    registry: Registry,
    id: [u8; 16],
    pub(super) from: mpsc::Receiver<(u32, Conn)>,
    pub(super) wait: Duration,
}

impl Drop for Joins {
    fn drop(&mut self) {
        lock(&self.registry).remove(&self.id);
    }
}
