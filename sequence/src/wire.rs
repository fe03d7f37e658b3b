//! Moving a directory between hosts over one stream: how a checkpoint image travels from the host
//! a job runs on to the host it is restored on (`possum migrate PID --to HOST:PORT` sends,
//! `possum receive --listen ADDR:PORT -D DIR` receives).
//!
//! ```text
//! sender ([`send_dir`])                              receiver ([`receive_dir`])
//!                  ◀── hello: magic, version, receiver nonce (32 bytes)
//!   proof: magic, version, sender nonce, HMAC(key, "possum-migrate-v1/client" ‖ rn ‖ sn) ──▶
//!                  ◀── HMAC(key, "possum-migrate-v1/server" ‖ sn ‖ rn)
//!   frames: Dir, File, Chunk.., EndFile, ..., Done + HMAC ──▶  under a temporary sibling of DEST
//!                  ◀── Committed + HMAC (DEST named) or Abort (why not)
//!   (a migration) Released + HMAC: the source's job is gone ──▶
//!                  ◀── Outcome + HMAC: restored and held at the destination, or why not
//!   Released + HMAC again: go ──▶
//!                  ◀── Outcome + HMAC: running at the destination, or why not
//! ```
//!
//! **Handshake** (step [`HandshakeError`]): both ends hold the same secret ([`HmacKey`], a file of
//! at least 32 bytes) and each proves it to the other on fresh nonces from `/dev/urandom`, the
//! tags compared in constant time. The receiver writes nothing after its hello to a sender that
//! fails its proof; the sender sends no file to a receiver that fails its own. Both then hold a
//! [`Session`]: a key of this connection alone, HMAC(secret, "possum-migrate-v1/session" ‖ rn ‖
//! sn).
//!
//! **Frames** (step [`FrameError`]): a 13-byte header, `kind: u8`, `length: u64` (little endian),
//! `crc32c: u32` (little endian, of the payload), then `length` bytes of payload; a frame longer
//! than [`MAX_FRAME`] is refused before anything is read of it. The kinds ([`Frame`]):
//! - `Dir` and `File`: a JSON object `{"path": "a/b", "mode": 420}` (and `"size"` for a file), the
//!   path relative, `/`-separated, UTF-8, with no empty, `.` or `..` component; a file may name
//!   a `"base"`, `{"path", "size", "sha256"}`: a file sent ahead that holds its first `size`
//!   bytes, its chunks then beginning there (before the `Cut`, in a later round ahead, only the
//!   file itself: it goes on);
//! - `Chunk`: the offset in the current file (`u64` LE) then the bytes, in order, at most
//!   [`CHUNK_BYTES`] of them;
//! - `EndFile`: empty; the file got exactly its size;
//! - `Cut` (a transfer in two parts, [`DirSender`]): empty; the files before it were sent ahead
//!   (a migration's pre-copy rounds, the job running), the final set follows. The receiver sets
//!   aside what came before, with the SHA-256 of each file; a file (of a later round, or of the
//!   final set) takes a base from there only if its length and hash are those received, each
//!   base once; what is left aside is removed. `Done`'s totals are the final set's, whole files
//!   counted;
//! - `Done` and `Committed`: `files: u64`, `bytes: u64` (LE), the totals sent and received, then a
//!   32-byte HMAC under the session's key ([`Seal`]): `Done`'s of every frame before it (headers
//!   and payloads) and the totals, `Committed`'s of `Done`'s HMAC and the totals received;
//! - `Abort`: why, as UTF-8 text;
//! - `Released` (a migration's, after `Committed`): a 32-byte HMAC under the session's key of
//!   `Committed`'s: the source's job is gone, restore it. Sent again after `Outcome` `Restored`
//!   (its HMAC of that one's): let it run;
//! - `Outcome` (the answer to `Released`): `status: u8` (0 the restore failed, 1 the job runs,
//!   2 restored but held until the source says go), the restored `pid: i32` (LE), a 32-byte HMAC
//!   under the session's key of `Released`'s and what precedes and follows it, then why the
//!   restore failed, as UTF-8 text (empty otherwise).
//! - `Buffer` and `BufferChunk` (a pre-copy's, in place of `Dir`..`EndFile`: [`PrecopySender`],
//!   [`receive_precopy`]): an engine buffer declared, `id`, `va`, `size` (`u64` LE) and its
//!   prefetch rank (`u32` LE); and bytes of a declared buffer, its `id` and the offset in it
//!   (`u64` LE each) then at most [`CHUNK_BYTES`] bytes. A buffer comes again in each round that
//!   found it written; its later bytes replace the earlier. Both go into the HMAC of the frames
//!   like the transfer's; `Done` and `Committed` then count `Buffer` frames as files and chunk
//!   bytes as bytes.
//!
//! Invariants of a receive:
//! - Nothing is written outside DEST's temporary sibling, which [`receive_dir`] creates itself
//!   (mode 0700, never through a symbolic link) and fills only with directories and regular files
//!   it creates (modes limited to `0o777`).
//! - DEST appears only complete: every chunk's checksum checked, every file its size, `Done`'s
//!   HMAC that of the frames received (nothing changed, left out or added between the two ends),
//!   its totals those received, the files and directories fsynced, then the temporary directory
//!   renamed to DEST (which must not exist, and is not replaced if it appears meanwhile). On any
//!   error the temporary directory is removed and DEST is not created.
//! - The sender's [`send_dir`] succeeds only when the receiver said `Committed` with its totals
//!   and the session's HMAC: a migration may drop the source job only then.
//!
//! The stream is not encrypted: whoever can read the network can read the image. Every read
//! blocks at most as long as the stream lets it: set a read timeout (a [`TcpStream`] with
//! [`set_timeouts`]) before calling these.

use std::fs;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hmac::Mac;
use serde::{Deserialize, Serialize};

use crate::auth::HmacKey;
use possum_engine::image::ImageError;
use possum_engine::store::{BufferRecord, ChunkSink};

/// The protocol's version, in the hello and the proof.
pub const PROTOCOL_VERSION: u32 = 1;
/// The first bytes of the hello and the proof.
const MAGIC: [u8; 8] = *b"POSSUMWR";
/// A nonce's and an HMAC tag's length (bytes).
const NONCE_BYTES: usize = 32;
const TAG_BYTES: usize = 32;
const CLIENT_LABEL: &[u8] = b"possum-migrate-v1/client";
const SERVER_LABEL: &[u8] = b"possum-migrate-v1/server";
const SESSION_LABEL: &[u8] = b"possum-migrate-v1/session";
const FRAMES_LABEL: &[u8] = b"possum-migrate-v1/frames";
const DONE_LABEL: &[u8] = b"possum-migrate-v1/done";
const COMMITTED_LABEL: &[u8] = b"possum-migrate-v1/committed";
const RELEASED_LABEL: &[u8] = b"possum-migrate-v1/released";
const OUTCOME_LABEL: &[u8] = b"possum-migrate-v1/outcome";
/// The longest frame payload accepted (bytes).
pub const MAX_FRAME: u64 = 64 << 20;
/// The most file bytes a sender puts in one chunk.
pub const CHUNK_BYTES: usize = 4 << 20;
/// The longest abort reason sent (bytes).
const MAX_REASON: usize = 4096;
const HEADER_BYTES: usize = 13;

/// Sets `stream`'s read and write timeouts to `timeout`: no read or write of a transfer then
/// waits longer for the peer.
pub fn set_timeouts(stream: &TcpStream, timeout: Duration) -> io::Result<()> {
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_nodelay(true)
}

/// A stream whose writes go at most `rate` bytes a second (a token bucket, a twentieth of a
/// second's worth of burst): what `possum migrate --max-rate` sends through. Reads pass through.
#[derive(Debug)]
pub struct Paced<S> {
    inner: S,
    rate: u64,
    burst: u64,
    start: Instant,
    written: u64,
}

impl<S> Paced<S> {
    /// `inner`, its writes paced at `rate` bytes a second (at least 1).
    pub fn new(inner: S, rate: u64) -> Paced<S> {
        let rate = rate.max(1);
        Paced {
            inner,
            rate,
            burst: (rate / 20).max(1),
            start: Instant::now(),
            written: 0,
        }
    }

    /// The stream paced.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }
}

impl<S: Write> Write for Paced<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(self.burst as usize);
        // When the bucket holds `n` bytes: `written + n - burst` bytes' worth after the start.
        let due = (self.written + n as u64).saturating_sub(self.burst) as f64 / self.rate as f64;
        let wait = Duration::from_secs_f64(due).saturating_sub(self.start.elapsed());
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
        let k = self.inner.write(&buf[..n])?;
        self.written += k as u64;
        Ok(k)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<S: Read> Read for Paced<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf)
    }
}

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
}

/// `N` random bytes from `/dev/urandom`.
fn random<const N: usize>() -> io::Result<[u8; N]> {
    let mut n = [0u8; N];
    fs::File::open("/dev/urandom")?.read_exact(&mut n)?;
    Ok(n)
}

fn nonce() -> Result<[u8; NONCE_BYTES], HandshakeError> {
    random().map_err(HandshakeError::Nonce)
}

fn tag(key: &HmacKey, label: &[u8], first: &[u8], second: &[u8]) -> hmac::Hmac<sha2::Sha256> {
    let mut mac = key.mac();
    mac.update(label);
    mac.update(first);
    mac.update(second);
    mac
}

/// What a handshake agreed on: a key of this connection alone (an HMAC of the secret and both
/// nonces) and the HMAC under it of the frames so far, which `Done` and `Committed` carry.
pub struct Session {
    key: [u8; TAG_BYTES],
    frames: hmac::Hmac<sha2::Sha256>,
    /// The HMAC of the last frame of the exchange after the transfer (`Committed`, `Released`),
    /// which the next one's covers.
    last: [u8; TAG_BYTES],
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Session(..)")
    }
}

impl Session {
    fn new(secret: &HmacKey, rn: &[u8], sn: &[u8]) -> Session {
        let key: [u8; TAG_BYTES] = tag(secret, SESSION_LABEL, rn, sn)
            .finalize()
            .into_bytes()
            .into();
        let mut frames = Self::keyed(&key);
        frames.update(FRAMES_LABEL);
        Session {
            key,
            frames,
            last: [0; TAG_BYTES],
        }
    }

    fn keyed(key: &[u8; TAG_BYTES]) -> hmac::Hmac<sha2::Sha256> {
        hmac::Hmac::new_from_slice(key).expect("HMAC takes a key of any length")
    }

    /// The HMAC `Done` carries: of the frames so far and the totals.
    fn done(&self, totals: &Totals) -> hmac::Hmac<sha2::Sha256> {
        let mut m = self.frames.clone();
        m.update(DONE_LABEL);
        m.update(&totals_bytes(totals));
        m
    }

    /// The HMAC `Committed` carries: of `Done`'s and the totals received.
    fn committed(&self, done: &[u8], totals: &Totals) -> hmac::Hmac<sha2::Sha256> {
        let mut m = Self::keyed(&self.key);
        m.update(COMMITTED_LABEL);
        m.update(done);
        m.update(&totals_bytes(totals));
        m
    }

    /// The HMAC `Released` carries: of `Committed`'s.
    fn released(&self) -> hmac::Hmac<sha2::Sha256> {
        let mut m = Self::keyed(&self.key);
        m.update(RELEASED_LABEL);
        m.update(&self.last);
        m
    }

    /// The HMAC `Outcome` carries: of `Released`'s and the outcome.
    fn outcome(&self, running: u8, pid: i32, reason: &[u8]) -> hmac::Hmac<sha2::Sha256> {
        let mut m = Self::keyed(&self.key);
        m.update(OUTCOME_LABEL);
        m.update(&self.last);
        m.update(&[running]);
        m.update(&pid.to_le_bytes());
        m.update(reason);
        m
    }
}

fn hs_io(what: &'static str) -> impl FnOnce(io::Error) -> HandshakeError {
    move |source| HandshakeError::Io { what, source }
}

/// Writes one handshake message whole and flushes it (`what` names it in an error).
fn hs_send<S: Write>(
    stream: &mut S,
    bytes: &[u8],
    what: &'static str,
) -> Result<(), HandshakeError> {
    stream
        .write_all(bytes)
        .and_then(|()| stream.flush())
        .map_err(hs_io(what))
}

/// The receiver's side of the handshake: sends its hello, checks the sender's proof (writing
/// nothing more if it fails), answers its own. The session authenticates the frames that follow.
pub fn receiver_handshake<S: Read + Write>(
    stream: &mut S,
    key: &HmacKey,
) -> Result<Session, HandshakeError> {
    let rn = nonce()?;
    let mut hello = Vec::with_capacity(8 + 4 + NONCE_BYTES);
    hello.extend_from_slice(&MAGIC);
    hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    hello.extend_from_slice(&rn);
    hs_send(stream, &hello, "sending the hello")?;

    let mut proof = [0u8; 8 + 4 + NONCE_BYTES + TAG_BYTES];
    stream
        .read_exact(&mut proof)
        .map_err(hs_io("reading the sender's proof"))?;
    let (magic, rest) = proof.split_at(8);
    let (version, rest) = rest.split_at(4);
    let (sn, client_tag) = rest.split_at(NONCE_BYTES);
    check_greeting(magic, version, "sender")?;
    tag(key, CLIENT_LABEL, &rn, sn)
        .verify_slice(client_tag)
        .map_err(|_| HandshakeError::PeerNotAuthenticated { peer: "sender" })?;
    let server_tag = tag(key, SERVER_LABEL, sn, &rn).finalize().into_bytes();
    hs_send(stream, &server_tag, "sending the receiver's proof")?;
    Ok(Session::new(key, &rn, sn))
}

/// The sender's side of the handshake: reads the hello, sends its proof, checks the receiver's.
/// The session authenticates the frames that follow.
pub fn sender_handshake<S: Read + Write>(
    stream: &mut S,
    key: &HmacKey,
) -> Result<Session, HandshakeError> {
    let mut hello = [0u8; 8 + 4 + NONCE_BYTES];
    stream
        .read_exact(&mut hello)
        .map_err(hs_io("reading the receiver's hello"))?;
    let (magic, rest) = hello.split_at(8);
    let (version, rn) = rest.split_at(4);
    check_greeting(magic, version, "receiver")?;
    let sn = nonce()?;
    let mut proof = Vec::with_capacity(8 + 4 + NONCE_BYTES + TAG_BYTES);
    proof.extend_from_slice(&MAGIC);
    proof.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    proof.extend_from_slice(&sn);
    proof.extend_from_slice(&tag(key, CLIENT_LABEL, rn, &sn).finalize().into_bytes());
    hs_send(stream, &proof, "sending the sender's proof")?;

    let mut server_tag = [0u8; TAG_BYTES];
    match stream.read_exact(&mut server_tag) {
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
    tag(key, SERVER_LABEL, &sn, rn)
        .verify_slice(&server_tag)
        .map_err(|_| HandshakeError::PeerNotAuthenticated { peer: "receiver" })?;
    Ok(Session::new(key, rn, &sn))
}

fn check_greeting(magic: &[u8], version: &[u8], peer: &'static str) -> Result<(), HandshakeError> {
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

/// A file's header: the chunks that follow, up to `EndFile`, are its bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileHeader {
    /// Its path, relative to the directory sent.
    pub path: String,
    /// Its length (bytes).
    pub size: u64,
    /// Its permission bits.
    pub mode: u32,
    /// After a `Cut`: the file sent ahead that holds its first bytes (the chunks then begin
    /// where it ends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<Base>,
}

/// A file sent ahead (before the `Cut`) that a file of the final set begins with: the receiver
/// moves it into place, once its own hash of what it received matches.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Base {
    /// Its path as it was sent ahead.
    pub path: String,
    /// Its length as it was sent ahead (bytes).
    pub size: u64,
    /// The SHA-256 of those bytes, lowercase hex.
    pub sha256: String,
}

/// The counts of a transfer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Regular files.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// Totals and the session's HMAC that vouches for them (`Done`, `Committed`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seal {
    /// Files and bytes.
    pub totals: Totals,
    /// The HMAC.
    pub tag: [u8; TAG_BYTES],
}

/// One frame after the handshake.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A directory to create.
    Dir(DirHeader),
    /// A file begins.
    File(FileHeader),
    /// The current file's bytes from `offset`.
    Chunk {
        /// Where in the file.
        offset: u64,
        /// The bytes.
        data: &'a [u8],
    },
    /// The current file is complete.
    EndFile,
    /// Everything was sent.
    Done(Seal),
    /// The receiver named the directory.
    Committed(Seal),
    /// The peer gives up.
    Abort {
        /// Why.
        reason: String,
    },
    /// The source's job is gone: restore it (a migration, after `Committed`).
    Released {
        /// The session's HMAC of `Committed`'s.
        tag: [u8; TAG_BYTES],
    },
    /// What became of the restore at the destination (the answer to `Released`).
    Outcome {
        /// What became of it.
        outcome: Outcome,
        /// The session's HMAC of `Released`'s and the outcome.
        tag: [u8; TAG_BYTES],
    },
    /// The files so far were sent ahead (the job still running); the final set follows.
    Cut,
    /// A pre-copy's buffer declared (before any of its bytes; again in a later round).
    Buffer(BufferRecord),
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
}

impl Outcome {
    /// The fields on the wire: running, pid, the reason's bytes (cut at [`MAX_REASON`] on a
    /// character boundary).
    fn parts(&self) -> (u8, i32, &[u8]) {
        match self {
            Outcome::Running { pid } => (1, *pid, &[]),
            Outcome::Restored { pid } => (2, *pid, &[]),
            Outcome::RestoreFailed { reason } => (0, 0, cut_reason(reason)),
        }
    }
}

/// `reason`'s bytes, at most [`MAX_REASON`] of them, cut on a character boundary.
fn cut_reason(reason: &str) -> &[u8] {
    let mut end = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason.as_bytes()[..end]
}

const KIND_DIR: u8 = 1;
const KIND_FILE: u8 = 2;
const KIND_CHUNK: u8 = 3;
const KIND_END_FILE: u8 = 4;
const KIND_DONE: u8 = 5;
const KIND_COMMITTED: u8 = 6;
const KIND_ABORT: u8 = 7;
const KIND_RELEASED: u8 = 8;
const KIND_OUTCOME: u8 = 9;
const KIND_BUFFER: u8 = 10;
const KIND_BUFFER_CHUNK: u8 = 11;
const KIND_CUT: u8 = 12;
/// A `Buffer` frame's payload: id, va, size (`u64` LE), prefetch rank (`u32` LE).
const BUFFER_BYTES: usize = 28;

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
    /// The payload does not match its checksum.
    #[error("a {kind} frame of {len} bytes fails its checksum (crc32c {got:#010x}, sent {sent:#010x}): the data was damaged in transit")]
    Checksum {
        /// Its kind.
        kind: &'static str,
        /// Its length.
        len: u64,
        /// The checksum sent.
        sent: u32,
        /// The payload's.
        got: u32,
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

fn kind_name(kind: u8) -> &'static str {
    match kind {
        KIND_DIR => "Dir",
        KIND_FILE => "File",
        KIND_CHUNK => "Chunk",
        KIND_END_FILE => "EndFile",
        KIND_DONE => "Done",
        KIND_COMMITTED => "Committed",
        KIND_ABORT => "Abort",
        KIND_RELEASED => "Released",
        KIND_OUTCOME => "Outcome",
        KIND_BUFFER => "Buffer",
        KIND_BUFFER_CHUNK => "BufferChunk",
        KIND_CUT => "Cut",
        _ => "unknown",
    }
}

impl Frame<'_> {
    fn name(&self) -> &'static str {
        kind_name(self.kind())
    }

    fn kind(&self) -> u8 {
        match self {
            Frame::Dir(_) => KIND_DIR,
            Frame::File(_) => KIND_FILE,
            Frame::Chunk { .. } => KIND_CHUNK,
            Frame::EndFile => KIND_END_FILE,
            Frame::Done(_) => KIND_DONE,
            Frame::Committed(_) => KIND_COMMITTED,
            Frame::Abort { .. } => KIND_ABORT,
            Frame::Released { .. } => KIND_RELEASED,
            Frame::Outcome { .. } => KIND_OUTCOME,
            Frame::Buffer(_) => KIND_BUFFER,
            Frame::BufferChunk { .. } => KIND_BUFFER_CHUNK,
            Frame::Cut => KIND_CUT,
        }
    }
}

fn seal_bytes(seal: &Seal) -> [u8; 16 + TAG_BYTES] {
    let mut b = [0u8; 16 + TAG_BYTES];
    b[..16].copy_from_slice(&totals_bytes(&seal.totals));
    b[16..].copy_from_slice(&seal.tag);
    b
}

fn buffer_bytes(r: &BufferRecord) -> [u8; BUFFER_BYTES] {
    let mut b = [0u8; BUFFER_BYTES];
    b[..8].copy_from_slice(&r.id.to_le_bytes());
    b[8..16].copy_from_slice(&r.va.to_le_bytes());
    b[16..24].copy_from_slice(&r.size.to_le_bytes());
    b[24..].copy_from_slice(&r.prefetch_rank.to_le_bytes());
    b
}

fn totals_bytes(t: &Totals) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&t.files.to_le_bytes());
    b[8..].copy_from_slice(&t.bytes.to_le_bytes());
    b
}

/// Writes `frame` to `w`.
pub fn write_frame<W: Write>(w: &mut W, frame: &Frame<'_>) -> Result<(), FrameError> {
    write_frame_to(w, frame, None)
}

/// Whether a frame of `kind` goes into the session's HMAC of the frames (those before `Done`).
fn in_transcript(kind: u8) -> bool {
    (KIND_DIR..=KIND_END_FILE).contains(&kind)
        || kind == KIND_BUFFER
        || kind == KIND_BUFFER_CHUNK
        || kind == KIND_CUT
}

/// Writes `frame` to `w`, into `transcript` if it is one of the transfer's.
fn write_frame_to<W: Write>(
    w: &mut W,
    frame: &Frame<'_>,
    transcript: Option<&mut hmac::Hmac<sha2::Sha256>>,
) -> Result<(), FrameError> {
    let owned: Vec<u8>;
    let offset: [u8; 8];
    let place: [u8; 16];
    let record: [u8; BUFFER_BYTES];
    let sealed: [u8; 16 + TAG_BYTES];
    let parts: [&[u8]; 2] = match frame {
        Frame::Dir(h) => {
            owned = serde_json::to_vec(h).expect("a header serializes");
            [&owned, &[]]
        }
        Frame::File(h) => {
            owned = serde_json::to_vec(h).expect("a header serializes");
            [&owned, &[]]
        }
        Frame::Chunk { offset: o, data } => {
            offset = o.to_le_bytes();
            [&offset, data]
        }
        Frame::EndFile | Frame::Cut => [&[], &[]],
        Frame::Done(seal) | Frame::Committed(seal) => {
            sealed = seal_bytes(seal);
            [&sealed, &[]]
        }
        Frame::Abort { reason } => [cut_reason(reason), &[]],
        Frame::Released { tag } => [tag, &[]],
        Frame::Outcome { outcome, tag } => {
            let (running, pid, reason) = outcome.parts();
            let mut head = Vec::with_capacity(5 + TAG_BYTES);
            head.push(running);
            head.extend_from_slice(&pid.to_le_bytes());
            head.extend_from_slice(tag);
            owned = head;
            [&owned, reason]
        }
        Frame::Buffer(r) => {
            record = buffer_bytes(r);
            [&record, &[]]
        }
        Frame::BufferChunk {
            buffer,
            offset: o,
            data,
        } => {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&buffer.to_le_bytes());
            b[8..].copy_from_slice(&o.to_le_bytes());
            place = b;
            [&place, data]
        }
    };
    let len = (parts[0].len() + parts[1].len()) as u64;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge { len });
    }
    let crc = crc32c::crc32c_append(crc32c::crc32c(parts[0]), parts[1]);
    let mut header = [0u8; HEADER_BYTES];
    header[0] = frame.kind();
    header[1..9].copy_from_slice(&len.to_le_bytes());
    header[9..].copy_from_slice(&crc.to_le_bytes());
    let io = |source| FrameError::Io {
        what: "sending",
        source,
    };
    if let Some(t) = transcript.filter(|_| in_transcript(header[0])) {
        t.update(&header);
        t.update(parts[0]);
        t.update(parts[1]);
    }
    w.write_all(&header).map_err(io)?;
    for p in parts {
        w.write_all(p).map_err(io)?;
    }
    Ok(())
}

/// Reads one frame from `r`, its payload into `buf` (which the frame borrows).
pub fn read_frame<'b, R: Read>(r: &mut R, buf: &'b mut Vec<u8>) -> Result<Frame<'b>, FrameError> {
    read_frame_from(r, buf, None)
}

/// Reads one frame from `r`, into `transcript` if it is one of the transfer's.
fn read_frame_from<'b, R: Read>(
    r: &mut R,
    buf: &'b mut Vec<u8>,
    transcript: Option<&mut hmac::Hmac<sha2::Sha256>>,
) -> Result<Frame<'b>, FrameError> {
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
    let len = u64::from_le_bytes(header[1..9].try_into().expect("8 bytes"));
    let sent = u32::from_le_bytes(header[9..].try_into().expect("4 bytes"));
    if !(KIND_DIR..=KIND_CUT).contains(&kind) {
        return Err(FrameError::UnknownKind(kind));
    }
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge { len });
    }
    buf.clear();
    buf.resize(len as usize, 0);
    r.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => FrameError::Closed,
        _ => FrameError::Io {
            what: "receiving",
            source: e,
        },
    })?;
    let got = crc32c::crc32c(buf);
    let name = kind_name(kind);
    if got != sent {
        return Err(FrameError::Checksum {
            kind: name,
            len,
            sent,
            got,
        });
    }
    if let Some(t) = transcript.filter(|_| in_transcript(kind)) {
        t.update(&header);
        t.update(buf);
    }
    let malformed = |why: String| FrameError::Malformed { kind: name, why };
    let payload: &'b [u8] = buf;
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
    Ok(match kind {
        KIND_DIR => {
            Frame::Dir(serde_json::from_slice(payload).map_err(|e| malformed(e.to_string()))?)
        }
        KIND_FILE => {
            Frame::File(serde_json::from_slice(payload).map_err(|e| malformed(e.to_string()))?)
        }
        KIND_CHUNK => {
            if payload.len() < 8 {
                return Err(malformed("shorter than its offset".into()));
            }
            let (o, data) = payload.split_at(8);
            Frame::Chunk {
                offset: u64::from_le_bytes(o.try_into().expect("8 bytes")),
                data,
            }
        }
        KIND_END_FILE => {
            exact(0)?;
            Frame::EndFile
        }
        KIND_CUT => {
            exact(0)?;
            Frame::Cut
        }
        KIND_DONE | KIND_COMMITTED => {
            exact(16 + TAG_BYTES)?;
            let seal = Seal {
                totals: Totals {
                    files: u64::from_le_bytes(payload[..8].try_into().expect("8 bytes")),
                    bytes: u64::from_le_bytes(payload[8..16].try_into().expect("8 bytes")),
                },
                tag: payload[16..].try_into().expect("32 bytes"),
            };
            if kind == KIND_DONE {
                Frame::Done(seal)
            } else {
                Frame::Committed(seal)
            }
        }
        KIND_BUFFER => {
            exact(BUFFER_BYTES)?;
            let u =
                |at: usize| u64::from_le_bytes(payload[at..at + 8].try_into().expect("8 bytes"));
            Frame::Buffer(BufferRecord {
                id: u(0),
                va: u(8),
                size: u(16),
                prefetch_rank: u32::from_le_bytes(payload[24..].try_into().expect("4 bytes")),
            })
        }
        KIND_BUFFER_CHUNK => {
            if payload.len() < 16 {
                return Err(malformed("shorter than its buffer and offset".into()));
            }
            let (place, data) = payload.split_at(16);
            Frame::BufferChunk {
                buffer: u64::from_le_bytes(place[..8].try_into().expect("8 bytes")),
                offset: u64::from_le_bytes(place[8..].try_into().expect("8 bytes")),
                data,
            }
        }
        KIND_RELEASED => {
            exact(TAG_BYTES)?;
            Frame::Released {
                tag: payload.try_into().expect("32 bytes"),
            }
        }
        KIND_OUTCOME => {
            if payload.len() < 5 + TAG_BYTES {
                return Err(malformed("shorter than its status and HMAC".into()));
            }
            let pid = i32::from_le_bytes(payload[1..5].try_into().expect("4 bytes"));
            let reason = String::from_utf8(payload[5 + TAG_BYTES..].to_vec())
                .map_err(|_| malformed("a reason that is not UTF-8".into()))?;
            let outcome = match payload[0] {
                1 if reason.is_empty() => Outcome::Running { pid },
                2 if reason.is_empty() => Outcome::Restored { pid },
                0 => Outcome::RestoreFailed { reason },
                _ => return Err(malformed("neither restored, running nor failed".into())),
            };
            Frame::Outcome {
                outcome,
                tag: payload[5..5 + TAG_BYTES].try_into().expect("32 bytes"),
            }
        }
        _ => Frame::Abort {
            reason: String::from_utf8_lossy(payload).into_owned(),
        },
    })
}

// ---------------------------------------------------------------------------------------------
// Sending

/// What [`send_dir`] sent.
#[derive(Clone, Copy, Debug)]
pub struct SendReport {
    /// Files and bytes of the directory, as the receiver counted them.
    pub totals: Totals,
    /// The files' bytes this end sent after the `Cut` (all of them without one; the rest came
    /// from what was sent ahead).
    pub sent_bytes: u64,
    /// From the handshake to the receiver's `Committed`.
    pub elapsed: Duration,
}

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
    /// A frame to or from the receiver.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The receiver gave up.
    #[error("the receiver refused the transfer: {reason}")]
    Rejected {
        /// Its reason.
        reason: String,
    },
    /// A confirmation the receiver did not write.
    #[error(
        "the receiver's confirmation does not carry this session's HMAC: it was forged or changed \
         in transit, and the transfer is not known to be complete"
    )]
    Forged,
    /// The receiver answered `Done` with something else than its confirmation.
    #[error("the receiver answered the transfer's end with a {got} frame, not Committed")]
    Unconfirmed {
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

/// An entry of the directory sent.
#[derive(Debug)]
enum Entry {
    Dir(DirHeader),
    File(FileHeader),
}

/// The entries under `root/rel`, sorted, each directory before what it holds. Not `strict` (a
/// directory still being written): what is neither a file nor a directory, or gone meanwhile,
/// is left out.
fn list(root: &Path, rel: &str, out: &mut Vec<Entry>, strict: bool) -> Result<(), SendError> {
    let at = if rel.is_empty() {
        root.to_path_buf()
    } else {
        root.join(rel)
    };
    let err = |source| SendError::List {
        path: at.clone(),
        source,
    };
    let mut entries = fs::read_dir(&at)
        .map_err(err)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(err)?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = e.path();
        let name = e
            .file_name()
            .into_string()
            .map_err(|_| SendError::NotUtf8 { path: path.clone() })?;
        let r = if rel.is_empty() {
            name
        } else {
            format!("{rel}/{name}")
        };
        // Not followed: a link is refused, not sent as what it points to.
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if !strict && e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(SendError::List {
                    path: path.clone(),
                    source,
                })
            }
        };
        let t = meta.file_type();
        let mode = meta.permissions().mode() & 0o777;
        if t.is_dir() {
            out.push(Entry::Dir(DirHeader {
                path: r.clone(),
                mode,
            }));
            match list(root, &r, out, strict) {
                Err(SendError::List { source, .. })
                    if !strict && source.kind() == io::ErrorKind::NotFound => {}
                other => other?,
            }
        } else if t.is_file() {
            out.push(Entry::File(FileHeader {
                path: r,
                size: meta.len(),
                mode,
                base: None,
            }));
        } else if !strict {
            continue;
        } else {
            let what = if t.is_symlink() {
                "a symbolic link"
            } else {
                "neither a regular file nor a directory"
            };
            return Err(SendError::Unsupported { path, what });
        }
    }
    Ok(())
}

/// Sends the directory `dir` (its regular files and directories, with their permission bits)
/// over `stream` to a [`receive_dir`] holding the same `key`; returns once the receiver has
/// named it, complete.
///
/// The handshake comes first; a failure after it (a symbolic link found, a file unreadable) is
/// told to the receiver (`Abort`) before it is returned.
pub fn send_dir<S: Read + Write>(
    stream: &mut S,
    key: &HmacKey,
    dir: &Path,
) -> Result<SendReport, WireError> {
    send_dir_session(stream, key, dir).map(|(report, _)| report)
}

/// [`send_dir`], and the session, for an exchange after the transfer ([`send_released`],
/// [`await_outcome`]).
pub fn send_dir_session<S: Read + Write>(
    stream: &mut S,
    key: &HmacKey,
    dir: &Path,
) -> Result<(SendReport, Session), WireError> {
    DirSender::start(stream, key)?.finish(stream, dir)
}

/// A file sent ahead, as the sender remembers it: its bytes sent so far and their hash (the
/// hasher too, to go on with what a later round sends of it).
#[derive(Debug, Clone)]
struct AheadFile {
    path: String,
    size: u64,
    sha256: [u8; 32],
    hasher: sha2::Sha256,
}

/// A directory sent in two parts over one session: [`DirSender::send_ahead`] sends what it holds
/// while it is still being written (a migration's pre-copy rounds, the job running), as often as
/// asked: a file sent ahead before whose bytes are unchanged goes on from where it ended (its
/// own path as its [`Base`]), one whose bytes changed waits for the final set; then
/// [`DirSender::finish`] sends `Cut` and the final set: each file that begins with one sent
/// ahead (the same file, found by its inode, its first bytes hashed again here) names it as its
/// base and sends only the bytes after it, every other file is sent whole. The receiver moves
/// the bases into place, checking its own hash of them, and drops what was sent ahead and is not
/// in the final set.
#[derive(Debug)]
pub struct DirSender {
    session: Session,
    /// The files sent ahead, by (device, inode).
    ahead: std::collections::HashMap<(u64, u64), AheadFile>,
    /// Every path sent ahead: one the receiver has that cannot go on (its file changed, or is
    /// another file now) waits for the final set.
    ahead_paths: std::collections::HashSet<String>,
    /// Something was sent ahead: the final set follows a `Cut`.
    sent_ahead: bool,
}

impl DirSender {
    /// The handshake.
    pub fn start<S: Read + Write>(stream: &mut S, key: &HmacKey) -> Result<DirSender, WireError> {
        Ok(DirSender {
            session: sender_handshake(stream, key)?,
            ahead: std::collections::HashMap::new(),
            ahead_paths: std::collections::HashSet::new(),
            sent_ahead: false,
        })
    }

    /// Sends the regular files and directories under `dir` as they are now (what is neither, or
    /// goes away meanwhile, left out; a file that grows, only the bytes it had when listed): a
    /// round ahead of the final set, before [`DirSender::finish`], as many as wanted. A file sent
    /// in an earlier round goes on from where it ended if those bytes are unchanged (only what it
    /// gained is sent), and waits for the final set if they changed. The files and the bytes
    /// sent (of files whose first bytes went in an earlier round, only what they gained).
    pub fn send_ahead<S: Read + Write>(
        &mut self,
        stream: &mut S,
        dir: &Path,
    ) -> Result<Totals, WireError> {
        self.sent_ahead = true;
        let sent = (|| {
            let mut entries = Vec::new();
            list(dir, "", &mut entries, false)?;
            let continued = bases(dir, &entries, self.ahead.clone());
            let sent = send_files(
                stream,
                &mut self.session,
                dir,
                entries,
                Sending::Ahead {
                    known: &mut self.ahead,
                    paths: &mut self.ahead_paths,
                    continued,
                },
            )?;
            stream.flush().map_err(|source| FrameError::Io {
                what: "sending",
                source,
            })?;
            Ok(Totals {
                files: sent.totals.files,
                bytes: sent.bytes,
            })
        })();
        sent.map_err(|e| failed(stream, e))
    }

    /// Sends the directory `dir` (the final set) and `Done`; returns once the receiver has named
    /// it, complete, with the session for an exchange after the transfer.
    pub fn finish<S: Read + Write>(
        mut self,
        stream: &mut S,
        dir: &Path,
    ) -> Result<(SendReport, Session), WireError> {
        let start = Instant::now();
        let sent = (|| {
            let mut entries = Vec::new();
            list(dir, "", &mut entries, true)?;
            let mode = if self.sent_ahead {
                write_frame_to(stream, &Frame::Cut, Some(&mut self.session.frames))?;
                Sending::Final(bases(dir, &entries, std::mem::take(&mut self.ahead)))
            } else {
                Sending::Plain
            };
            let sent = send_files(stream, &mut self.session, dir, entries, mode)?;
            let done = Seal {
                totals: sent.totals,
                tag: self
                    .session
                    .done(&sent.totals)
                    .finalize()
                    .into_bytes()
                    .into(),
            };
            write_frame(stream, &Frame::Done(done))?;
            stream.flush().map_err(|source| FrameError::Io {
                what: "sending",
                source,
            })?;
            Ok((done, sent.bytes))
        })();
        let (done, sent_bytes) = sent.map_err(|e| failed(stream, e))?;
        let totals = confirmation(stream, &mut self.session, &done)?;
        let report = SendReport {
            totals,
            sent_bytes,
            elapsed: start.elapsed(),
        };
        Ok((report, self.session))
    }
}

/// A send that failed after the handshake: the receiver told why (`Abort`) unless the stream
/// failed, where the receiver's own reason is read if it sent one.
fn failed<S: Read + Write>(stream: &mut S, e: SendError) -> WireError {
    match e {
        e @ SendError::Frame(FrameError::Io { .. }) => {
            // The receiver may have closed the connection after telling why.
            let mut buf = Vec::new();
            match read_frame(stream, &mut buf) {
                Ok(Frame::Abort { reason }) => SendError::Rejected { reason }.into(),
                _ => e.into(),
            }
        }
        e @ SendError::Frame(_) => e.into(),
        e => {
            let reason = possum_cuda::error_chain(&e);
            let _ = write_frame(stream, &Frame::Abort { reason });
            let _ = stream.flush();
            e.into()
        }
    }
}

/// Which part of a transfer [`send_files`] sends.
enum Sending<'m> {
    /// The whole directory, once.
    Plain,
    /// Ahead of the cut: each file's hash is remembered in `known`; a file sent ahead before
    /// goes on from where it ended if it is in `continued` (its first bytes unchanged:
    /// [`bases`]), and is left for the final set if not.
    Ahead {
        known: &'m mut std::collections::HashMap<(u64, u64), AheadFile>,
        paths: &'m mut std::collections::HashSet<String>,
        continued: std::collections::HashMap<String, ((u64, u64), Base)>,
    },
    /// After the cut: the files that begin with one sent ahead, unchanged ([`bases`]), by path,
    /// with their (device, inode) when checked; each names its base.
    Final(std::collections::HashMap<String, ((u64, u64), Base)>),
}

/// What [`send_files`] sent.
struct Sent {
    /// The files and their whole lengths.
    totals: Totals,
    /// The bytes sent of them (less than their lengths where a base holds the rest).
    bytes: u64,
}

/// Sends the frames of `entries`, under `dir`.
fn send_files<S: Write>(
    stream: &mut S,
    session: &mut Session,
    dir: &Path,
    entries: Vec<Entry>,
    mut mode: Sending<'_>,
) -> Result<Sent, SendError> {
    use sha2::Digest;
    use std::io::Seek;
    use std::os::unix::fs::MetadataExt;
    let ahead = matches!(mode, Sending::Ahead { .. });
    let mut sent = Sent {
        totals: Totals::default(),
        bytes: 0,
    };
    let mut buf = vec![0u8; CHUNK_BYTES];
    for entry in entries {
        let mut h = match entry {
            Entry::Dir(h) => {
                write_frame_to(stream, &Frame::Dir(h), Some(&mut session.frames))?;
                continue;
            }
            Entry::File(h) => h,
        };
        let path = dir.join(&h.path);
        let read = |source| SendError::Read {
            path: path.clone(),
            source,
        };
        let opened = fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path);
        let mut f = match opened {
            Ok(f) => f,
            // Ahead of the cut, a file may go away between its listing and its read.
            Err(e) if ahead && e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(read(e)),
        };
        let size = h.size;
        let meta = f.metadata().map_err(read)?;
        let inode = (meta.dev(), meta.ino());
        let mut offset = 0u64;
        let mut hasher = ahead.then(sha2::Sha256::new);
        match &mut mode {
            Sending::Final(bases) => {
                // Checked against the file as listed: the same file (inode) still.
                if let Some((_, base)) = bases.remove(&h.path).filter(|(at, _)| *at == inode) {
                    f.seek(io::SeekFrom::Start(base.size)).map_err(read)?;
                    offset = base.size;
                    h.base = Some(base);
                }
            }
            Sending::Ahead {
                known,
                paths,
                continued,
            } => {
                let before = known.get(&inode).filter(|b| b.path == h.path);
                // Sent before: it goes on from there, unchanged and still the same file under
                // the same path; else (a path the receiver has) it waits for the final set.
                // `bases` made the base of the file sent ahead under this inode: `before`.
                match (before, continued.remove(&h.path)) {
                    (Some(before), Some((at, base))) if at == inode => {
                        // Nothing gained since: nothing to send this round.
                        if base.size == size {
                            continue;
                        }
                        f.seek(io::SeekFrom::Start(base.size)).map_err(read)?;
                        offset = base.size;
                        hasher = Some(before.hasher.clone());
                        h.base = Some(base);
                    }
                    _ if paths.contains(&h.path) => {
                        known.remove(&inode);
                        continue;
                    }
                    _ => {
                        paths.insert(h.path.clone());
                    }
                }
            }
            Sending::Plain => {}
        }
        let rel = h.path.clone();
        write_frame_to(stream, &Frame::File(h), Some(&mut session.frames))?;
        while offset < size {
            let want = (size - offset).min(CHUNK_BYTES as u64) as usize;
            let k = read_full(&mut f, &mut buf[..want]).map_err(read)?;
            if k < want {
                return Err(SendError::Changed { path, listed: size });
            }
            if let Some(hs) = hasher.as_mut() {
                hs.update(&buf[..k]);
            }
            write_frame_to(
                stream,
                &Frame::Chunk {
                    offset,
                    data: &buf[..k],
                },
                Some(&mut session.frames),
            )?;
            offset += k as u64;
            sent.bytes += k as u64;
        }
        // Ahead of the cut a file may grow (its first bytes were sent); the final set may not
        // change while it is sent.
        if !ahead && f.metadata().map_err(read)?.len() != size {
            return Err(SendError::Changed { path, listed: size });
        }
        write_frame_to(stream, &Frame::EndFile, Some(&mut session.frames))?;
        if let (Sending::Ahead { known, .. }, Some(hs)) = (&mut mode, hasher) {
            known.insert(
                inode,
                AheadFile {
                    path: rel,
                    size,
                    sha256: hs.clone().finalize().into(),
                    hasher: hs,
                },
            );
        }
        sent.totals.files += 1;
        sent.totals.bytes += size;
    }
    Ok(sent)
}

/// The files of `entries` (under `dir`) that begin with a file sent ahead (the same file: its
/// device and inode), its bytes unchanged: their first bytes hashed again, the files in parallel
/// (one worker a file, at most 8). A file that cannot be read there is no base (it is then sent
/// whole, or fails its send).
fn bases(
    dir: &Path,
    entries: &[Entry],
    mut ahead: std::collections::HashMap<(u64, u64), AheadFile>,
) -> std::collections::HashMap<String, ((u64, u64), Base)> {
    use std::os::unix::fs::MetadataExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let candidates: Vec<(&str, (u64, u64), AheadFile)> = entries
        .iter()
        .filter_map(|e| match e {
            Entry::File(h) => Some(h),
            Entry::Dir(_) => None,
        })
        .filter_map(|h| {
            let m = fs::symlink_metadata(dir.join(&h.path)).ok()?;
            let inode = (m.dev(), m.ino());
            let a = ahead.remove(&inode).filter(|a| a.size <= h.size)?;
            Some((h.path.as_str(), inode, a))
        })
        .collect();
    let unchanged = |path: &str, a: &AheadFile| -> io::Result<bool> {
        use sha2::Digest;
        let mut f = fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(dir.join(path))?;
        let mut hasher = sha2::Sha256::new();
        let mut buf = vec![0u8; (1 << 20).min(a.size as usize)];
        let mut left = a.size;
        while left > 0 {
            let want = left.min(buf.len() as u64) as usize;
            if read_full(&mut f, &mut buf[..want])? < want {
                return Ok(false);
            }
            hasher.update(&buf[..want]);
            left -= want as u64;
        }
        Ok(<[u8; 32]>::from(hasher.finalize()) == a.sha256)
    };
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8)
        .min(candidates.len().max(1));
    let found = std::sync::Mutex::new(std::collections::HashMap::new());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                let Some((path, inode, a)) = candidates.get(next.fetch_add(1, Ordering::Relaxed))
                else {
                    return;
                };
                if unchanged(path, a).unwrap_or(false) {
                    let base = Base {
                        path: a.path.clone(),
                        size: a.size,
                        sha256: hex(&a.sha256),
                    };
                    found
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(path.to_string(), (*inode, base));
                }
            });
        }
    });
    found.into_inner().unwrap_or_else(|p| p.into_inner())
}

/// `bytes` in lowercase hex.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Reads into `buf` until it is full or the file ends; how much was read.
fn read_full(f: &mut fs::File, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match f.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// The receiver's answer to `Done`: its totals, once checked.
fn confirmation<S: Read>(
    stream: &mut S,
    session: &mut Session,
    done: &Seal,
) -> Result<Totals, SendError> {
    let mut buf = Vec::new();
    match read_frame(stream, &mut buf)? {
        Frame::Committed(c) => {
            session
                .committed(&done.tag, &c.totals)
                .verify_slice(&c.tag)
                .map_err(|_| SendError::Forged)?;
            session.last = c.tag;
            if c.totals != done.totals {
                return Err(SendError::Miscounted {
                    sent: done.totals,
                    got: c.totals,
                });
            }
            Ok(c.totals)
        }
        Frame::Abort { reason } => Err(SendError::Rejected { reason }),
        other => Err(SendError::Unconfirmed { got: other.name() }),
    }
}

// ---------------------------------------------------------------------------------------------
// Receiving

/// What [`receive_dir`] received.
#[derive(Clone, Copy, Debug)]
pub struct ReceiveReport {
    /// Files and bytes.
    pub totals: Totals,
    /// From the handshake to the directory named.
    pub elapsed: Duration,
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
    /// A chunk not at the current end of its file.
    #[error("{path}: a chunk at offset {offset}, where {expected} was due")]
    OutOfOrder {
        /// The file.
        path: String,
        /// The chunk's offset.
        offset: u64,
        /// The bytes received so far.
        expected: u64,
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
    /// Frames the sender did not write.
    #[error(
        "the frames received do not carry this session's HMAC: they were changed in transit \
         (their checksums are no defence against a deliberate change)"
    )]
    Forged,
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
    /// A pre-copy's buffer or chunk the image refused (an unknown buffer, out of its range, a
    /// full disk).
    #[error("writing a pre-copied buffer into the image")]
    Sink(#[source] ImageError),
}

/// The directory being received: removed, with what it holds, unless committed.
#[derive(Debug)]
struct Staging {
    path: PathBuf,
    committed: bool,
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            make_writable(&self.path);
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// Gives the owner every right on the directories under `dir` (not followed through links), so
/// that they can be removed whatever modes were set.
fn make_writable(dir: &Path) {
    let _ = fs::set_permissions(dir, fs::Permissions::from_mode(0o700));
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            make_writable(&e.path());
        }
    }
}

/// The components of a path the sender named; refused unless relative and plain.
fn components(path: &str) -> Result<Vec<&str>, ReceiveError> {
    let refuse = |why| ReceiveError::Path {
        path: path.to_string(),
        why,
    };
    if path.is_empty() {
        return Err(refuse("it is empty"));
    }
    if path.starts_with('/') {
        return Err(refuse("it is absolute"));
    }
    if path.contains('\0') {
        return Err(refuse("it holds a NUL"));
    }
    let parts: Vec<&str> = path.split('/').collect();
    for p in &parts {
        match *p {
            "" => return Err(refuse("it has an empty component")),
            "." => return Err(refuse("it has a `.` component")),
            ".." => return Err(refuse("it has a `..` component")),
            _ => {}
        }
    }
    Ok(parts)
}

/// Creates (or finds) the directory `root/parts..`, each component a directory this receive
/// created, none a link or a file.
fn ensure_dir(root: &Path, path: &str, parts: &[&str]) -> Result<PathBuf, ReceiveError> {
    let mut at = root.to_path_buf();
    for p in parts {
        at.push(p);
        match fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(ReceiveError::Path {
                    path: path.to_string(),
                    why: "it goes through a file",
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&at)
                    .map_err(|source| ReceiveError::Io {
                        what: "creating",
                        path: at.clone(),
                        source,
                    })?;
            }
            Err(source) => {
                return Err(ReceiveError::Io {
                    what: "reading",
                    path: at,
                    source,
                })
            }
        }
    }
    Ok(at)
}

/// The file being received.
#[derive(Debug)]
struct Current {
    path: String,
    at: PathBuf,
    file: fs::File,
    size: u64,
    got: u64,
    mode: u32,
    /// Ahead of the `Cut`: the hash of what came.
    hash: Option<sha2::Sha256>,
}

/// Receives a directory from a [`send_dir`] holding the same `key` over `stream`, as `dest`
/// (which must not exist): written under a new temporary sibling of `dest`, named `dest` only
/// when complete and checked; on any error nothing is left.
///
/// Once the handshake passed, a failure is told to the sender (`Abort`) before it is returned.
pub fn receive_dir<S: Read + Write>(
    stream: &mut S,
    key: &HmacKey,
    dest: &Path,
) -> Result<ReceiveReport, WireError> {
    receive_dir_session(stream, key, dest).map(|(report, _)| report)
}

/// [`receive_dir`], and the session, for an exchange after the transfer ([`await_released`],
/// [`send_outcome`]).
pub fn receive_dir_session<S: Read + Write>(
    stream: &mut S,
    key: &HmacKey,
    dest: &Path,
) -> Result<(ReceiveReport, Session), WireError> {
    // Refused before the handshake, as after it.
    new_dest(dest)?;
    let session = receiver_handshake(stream, key)?;
    receive_dir_in_session(stream, session, dest)
}

/// `dest`'s file name, if `dest` is one a received image can be named: it has one, and nothing
/// is there yet.
fn new_dest(dest: &Path) -> Result<&std::ffi::OsStr, ReceiveError> {
    let name = dest.file_name().ok_or_else(|| ReceiveError::DestName {
        dest: dest.to_path_buf(),
    })?;
    if fs::symlink_metadata(dest).is_ok() {
        return Err(ReceiveError::DestExists {
            dest: dest.to_path_buf(),
        });
    }
    Ok(name)
}

/// [`receive_dir_session`] after its handshake: the image into the new directory `dest` over
/// the session a [`receiver_handshake`] agreed on.
pub fn receive_dir_in_session<S: Read + Write>(
    stream: &mut S,
    mut session: Session,
    dest: &Path,
) -> Result<(ReceiveReport, Session), WireError> {
    let name = new_dest(dest)?;
    let start = Instant::now();
    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match receive_into(stream, &mut session, parent, name, dest) {
        Ok(done) => {
            // The directory is named: the sender not hearing it changes nothing here.
            let totals = done.totals;
            let committed = Seal {
                totals,
                tag: session
                    .committed(&done.tag, &totals)
                    .finalize()
                    .into_bytes()
                    .into(),
            };
            let _ = write_frame(stream, &Frame::Committed(committed));
            let _ = stream.flush();
            session.last = committed.tag;
            let report = ReceiveReport {
                totals,
                elapsed: start.elapsed(),
            };
            Ok((report, session))
        }
        Err(e) => {
            if !matches!(
                e,
                ReceiveError::Frame(FrameError::Io { .. } | FrameError::Closed)
                    | ReceiveError::Aborted { .. }
            ) {
                let reason = possum_cuda::error_chain(&e);
                let _ = write_frame(stream, &Frame::Abort { reason });
                let _ = stream.flush();
            }
            Err(e.into())
        }
    }
}

/// Receives the frames into a temporary sibling of `dest`, then names it `dest`; what `Done`
/// said, checked.
fn receive_into<S: Read>(
    stream: &mut S,
    session: &mut Session,
    parent: &Path,
    name: &std::ffi::OsStr,
    dest: &Path,
) -> Result<Seal, ReceiveError> {
    // A temporary sibling of `dest`, removed unless committed.
    let make_staging = |suffix: &str| {
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        let n: [u8; 6] = random().map_err(|source| ReceiveError::Io {
            what: "reading",
            path: "/dev/urandom".into(),
            source,
        })?;
        tmp_name.push(format!(".receiving-{}{suffix}", hex(&n)));
        let path = parent.join(tmp_name);
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|source| ReceiveError::Io {
                what: "creating",
                path: path.clone(),
                source,
            })?;
        Ok::<_, ReceiveError>(Staging {
            path,
            committed: false,
        })
    };
    let mut staging = make_staging("")?;
    let root = staging.path.clone();
    let mut dirs: Vec<(PathBuf, u32)> = Vec::new();
    let mut current: Option<Current> = None;
    let mut got = Totals::default();
    let mut buf = Vec::new();
    // After a `Cut`: what was sent ahead, moved aside (removed at the end whatever happens), and
    // its files' lengths and hashes by path (the hashers, which a later round ahead goes on
    // with), each taken out as a later round or the final set names it a base.
    let mut pre: Option<Staging> = None;
    let mut sent_ahead: std::collections::HashMap<String, (u64, sha2::Sha256)> =
        std::collections::HashMap::new();
    let sent = loop {
        match read_frame_from(stream, &mut buf, Some(&mut session.frames))? {
            Frame::Dir(h) => {
                if current.is_some() {
                    return Err(unexpected("Dir", "inside a file"));
                }
                let parts = components(&h.path)?;
                let at = ensure_dir(&root, &h.path, &parts)?;
                dirs.push((at, h.mode & 0o777));
            }
            Frame::File(h) => {
                if current.is_some() {
                    return Err(unexpected("File", "inside a file"));
                }
                let parts = components(&h.path)?;
                let (last, up) = parts.split_last().expect("a path has a component");
                let at = ensure_dir(&root, &h.path, up)?.join(last);
                let creating = |source| ReceiveError::Io {
                    what: "creating",
                    path: at.clone(),
                    source,
                };
                let (file, got_already, hash) = match &h.base {
                    None => {
                        // O_EXCL: never through a link, never a file twice.
                        let file = fs::OpenOptions::new()
                            .write(true)
                            .create_new(true)
                            .mode(0o600)
                            .custom_flags(nix::libc::O_NOFOLLOW)
                            .open(&at)
                            .map_err(creating)?;
                        (
                            file,
                            0,
                            pre.is_none().then(<sha2::Sha256 as sha2::Digest>::new),
                        )
                    }
                    Some(base) => {
                        let base_parts = components(&base.path)?;
                        let refuse = |why| ReceiveError::Ahead {
                            path: h.path.clone(),
                            base: base.path.clone(),
                            why,
                        };
                        // Each file sent ahead is a base once, of exactly what came.
                        let (size, hasher) = sent_ahead.remove(&base.path).ok_or_else(|| {
                            refuse("it was not sent ahead (or is a base already)")
                        })?;
                        let sha: [u8; 32] = sha2::Digest::finalize(hasher.clone()).into();
                        if size != base.size || hex(&sha) != base.sha256 {
                            return Err(refuse("it is not what was sent ahead"));
                        }
                        if base.size > h.size {
                            return Err(refuse("it is longer than the file"));
                        }
                        // After the cut the base moves into place; ahead of it a later round
                        // goes on with the same file, and its hash.
                        let hash = match &pre {
                            None if base.path != h.path => {
                                return Err(refuse("ahead of the cut a file goes on only itself"))
                            }
                            None => Some(hasher),
                            Some(pre) => {
                                let from =
                                    base_parts.iter().fold(pre.path.clone(), |p, c| p.join(c));
                                // Never replaces: a file is named once.
                                rustix::fs::renameat_with(
                                    rustix::fs::CWD,
                                    &from,
                                    rustix::fs::CWD,
                                    &at,
                                    rustix::fs::RenameFlags::NOREPLACE,
                                )
                                .map_err(|e| creating(e.into()))?;
                                None
                            }
                        };
                        let file = fs::OpenOptions::new()
                            .append(true)
                            .custom_flags(nix::libc::O_NOFOLLOW)
                            .open(&at)
                            .map_err(creating)?;
                        (file, base.size, hash)
                    }
                };
                current = Some(Current {
                    path: h.path,
                    at,
                    file,
                    size: h.size,
                    got: got_already,
                    mode: h.mode & 0o777,
                    hash,
                });
            }
            Frame::Cut => {
                if current.is_some() {
                    return Err(unexpected("Cut", "inside a file"));
                }
                if pre.is_some() {
                    return Err(unexpected("Cut", "after a Cut"));
                }
                // What came so far moves aside; the final set is received where it was.
                let aside = make_staging(".ahead")?;
                let io = |source: io::Error| ReceiveError::Io {
                    what: "setting aside what was sent ahead in",
                    path: aside.path.clone(),
                    source,
                };
                fs::remove_dir(&aside.path).map_err(io)?;
                fs::rename(&root, &aside.path).map_err(io)?;
                fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&root)
                    .map_err(io)?;
                pre = Some(aside);
                dirs.clear();
                got = Totals::default();
            }
            Frame::Chunk { offset, data } => {
                let Some(c) = current.as_mut() else {
                    return Err(unexpected("Chunk", "outside a file"));
                };
                if offset != c.got {
                    return Err(ReceiveError::OutOfOrder {
                        path: c.path.clone(),
                        offset,
                        expected: c.got,
                    });
                }
                let after = c.got + data.len() as u64;
                if after > c.size {
                    return Err(ReceiveError::Size {
                        path: c.path.clone(),
                        size: c.size,
                        got: after,
                    });
                }
                c.file.write_all(data).map_err(|source| ReceiveError::Io {
                    what: "writing",
                    path: c.at.clone(),
                    source,
                })?;
                if let Some(h) = c.hash.as_mut() {
                    sha2::Digest::update(h, data);
                }
                c.got = after;
            }
            Frame::EndFile => {
                let Some(c) = current.take() else {
                    return Err(unexpected("EndFile", "outside a file"));
                };
                if c.got != c.size {
                    return Err(ReceiveError::Size {
                        path: c.path,
                        size: c.size,
                        got: c.got,
                    });
                }
                let io = |what| {
                    let path = c.at.clone();
                    move |source| ReceiveError::Io { what, path, source }
                };
                c.file
                    .set_permissions(fs::Permissions::from_mode(c.mode))
                    .map_err(io("setting the mode of"))?;
                c.file.sync_all().map_err(io("syncing"))?;
                if let Some(h) = c.hash {
                    sent_ahead.insert(c.path, (c.size, h));
                }
                got.files += 1;
                got.bytes += c.size;
            }
            Frame::Done(done) => {
                if current.is_some() {
                    return Err(unexpected("Done", "inside a file"));
                }
                session
                    .done(&done.totals)
                    .verify_slice(&done.tag)
                    .map_err(|_| ReceiveError::Forged)?;
                break done;
            }
            Frame::Abort { reason } => return Err(ReceiveError::Aborted { reason }),
            Frame::Committed(_) => return Err(unexpected("Committed", "(a receiver's frame)")),
            Frame::Outcome { .. } => return Err(unexpected("Outcome", "(a receiver's frame)")),
            Frame::Released { .. } => return Err(unexpected("Released", "before Done")),
            Frame::Buffer(_) => return Err(unexpected("Buffer", "in a directory's transfer")),
            Frame::BufferChunk { .. } => {
                return Err(unexpected("BufferChunk", "in a directory's transfer"))
            }
        }
    };
    if sent.totals != got {
        return Err(ReceiveError::Totals {
            sent: sent.totals,
            got,
        });
    }
    // Deepest first: a directory's mode may take away what its children's need.
    dirs.push((root.clone(), 0o700));
    dirs.sort_by_key(|(p, _)| std::cmp::Reverse(p.components().count()));
    for (d, mode) in &dirs {
        let io = |what| {
            let path = d.clone();
            move |source| ReceiveError::Io { what, path, source }
        };
        let f = fs::File::open(d).map_err(io("opening"))?;
        f.sync_all().map_err(io("syncing"))?;
        f.set_permissions(fs::Permissions::from_mode(*mode))
            .map_err(io("setting the mode of"))?;
    }
    // Never replaces: a `dest` that appeared meanwhile stays, and this receive fails.
    rustix::fs::renameat_with(
        rustix::fs::CWD,
        &root,
        rustix::fs::CWD,
        dest,
        rustix::fs::RenameFlags::NOREPLACE,
    )
    .map_err(|e| ReceiveError::Io {
        what: "naming the received directory",
        path: dest.to_path_buf(),
        source: e.into(),
    })?;
    staging.committed = true;
    if let Ok(p) = fs::File::open(parent) {
        let _ = p.sync_all();
    }
    Ok(sent)
}

// ---------------------------------------------------------------------------------------------
// Pre-copy: an engine's buffers, in rounds, while the job runs

/// The sending end of a pre-copy, after [`sender_handshake`]: an engine's [`ChunkSink`] whose
/// every declaration and chunk goes out at once as a `Buffer` or `BufferChunk` frame (at most
/// [`CHUNK_BYTES`] of bytes each), into the session's HMAC; [`PrecopySender::finish`] sends
/// `Done` (totals: the `Buffer` frames, the bytes of the `BufferChunk` frames) and checks the
/// receiver's `Committed`. The engine's copier threads share it (one frame at a time).
pub struct PrecopySender<S> {
    inner: std::sync::Mutex<PrecopyState<S>>,
}

struct PrecopyState<S> {
    stream: S,
    session: Session,
    sent: Totals,
}

impl<S> std::fmt::Debug for PrecopySender<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrecopySender(..)")
    }
}

/// A frame that could not be sent, as the engine's sink reports it.
fn sink_error(e: FrameError) -> ImageError {
    ImageError::Io {
        path: PathBuf::from("(the migration stream)"),
        source: io::Error::other(e.to_string()),
    }
}

impl<S: Read + Write + Send> PrecopySender<S> {
    /// Pre-copies over `stream`, whose handshake gave `session`.
    pub fn new(stream: S, session: Session) -> PrecopySender<S> {
        PrecopySender {
            inner: std::sync::Mutex::new(PrecopyState {
                stream,
                session,
                sent: Totals::default(),
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PrecopyState<S>> {
        // A copier thread that panicked mid-frame leaves a stream the receiver will refuse.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What was sent so far: `Buffer` frames and chunk bytes.
    pub fn sent(&self) -> Totals {
        self.state().sent
    }

    /// Sends `Done` and waits for the receiver's `Committed`: returns its totals (those sent)
    /// and the stream once the receiver has committed every buffer sent.
    pub fn finish(self) -> Result<(Totals, S), SendError> {
        let mut st = self.inner.into_inner().unwrap_or_else(|p| p.into_inner());
        let PrecopyState {
            stream,
            session,
            sent,
        } = &mut st;
        let done = Seal {
            totals: *sent,
            tag: session.done(sent).finalize().into_bytes().into(),
        };
        write_frame(stream, &Frame::Done(done))?;
        stream.flush().map_err(|source| FrameError::Io {
            what: "sending",
            source,
        })?;
        let totals = confirmation(stream, session, &done)?;
        Ok((totals, st.stream))
    }
}

impl<S: Read + Write + Send> ChunkSink for PrecopySender<S> {
    fn add_buffer(&self, rec: BufferRecord) -> Result<(), ImageError> {
        let mut st = self.state();
        let PrecopyState {
            stream, session, ..
        } = &mut *st;
        write_frame_to(stream, &Frame::Buffer(rec), Some(&mut session.frames))
            .map_err(sink_error)?;
        st.sent.files += 1;
        Ok(())
    }

    fn write_chunk(&self, buffer: u64, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        let mut st = self.state();
        for (i, piece) in data.chunks(CHUNK_BYTES).enumerate() {
            let PrecopyState {
                stream, session, ..
            } = &mut *st;
            let frame = Frame::BufferChunk {
                buffer,
                offset: offset + (i * CHUNK_BYTES) as u64,
                data: piece,
            };
            write_frame_to(stream, &frame, Some(&mut session.frames)).map_err(sink_error)?;
            st.sent.bytes += piece.len() as u64;
        }
        Ok(())
    }

    fn set_meta(&self, _key: &str, _value: &str) -> Result<(), ImageError> {
        // A pre-copy carries buffers only; the job's own state travels in its process image.
        Ok(())
    }
}

/// The receiving end of a pre-copy, after [`receiver_handshake`]: writes every `Buffer` and
/// `BufferChunk` into `sink` (an image writer: a later round's chunk replaces an earlier one's)
/// until `Done`, checks `Done`'s HMAC and totals against what came, then `commit`s the sink
/// (an image writer's commit: the image complete on disk) and only then answers `Committed`.
/// On an error the sender is told why (`Abort`) where the connection still stands, and the sink
/// is dropped uncommitted.
pub fn receive_precopy<S: Read + Write, K: ChunkSink, T>(
    stream: &mut S,
    session: &mut Session,
    sink: K,
    commit: impl FnOnce(K) -> Result<T, ImageError>,
) -> Result<(Totals, T), ReceiveError> {
    let got = receive_buffers(stream, session, &sink)
        .and_then(|done| Ok((done, commit(sink).map_err(ReceiveError::Sink)?)));
    match got {
        Ok((done, committed_sink)) => {
            let committed = Seal {
                totals: done.totals,
                tag: session
                    .committed(&done.tag, &done.totals)
                    .finalize()
                    .into_bytes()
                    .into(),
            };
            write_frame(stream, &Frame::Committed(committed))?;
            stream.flush().map_err(|source| FrameError::Io {
                what: "sending",
                source,
            })?;
            session.last = committed.tag;
            Ok((done.totals, committed_sink))
        }
        Err(e) => {
            if !matches!(
                e,
                ReceiveError::Frame(FrameError::Io { .. } | FrameError::Closed)
                    | ReceiveError::Aborted { .. }
            ) {
                let _ = write_frame(
                    stream,
                    &Frame::Abort {
                        reason: possum_cuda::error_chain(&e),
                    },
                );
                let _ = stream.flush();
            }
            Err(e)
        }
    }
}

fn receive_buffers<S: Read>(
    stream: &mut S,
    session: &mut Session,
    sink: &dyn ChunkSink,
) -> Result<Seal, ReceiveError> {
    let mut got = Totals::default();
    let mut buf = Vec::new();
    let sent = loop {
        match read_frame_from(stream, &mut buf, Some(&mut session.frames))? {
            Frame::Buffer(rec) => {
                sink.add_buffer(rec).map_err(ReceiveError::Sink)?;
                got.files += 1;
            }
            Frame::BufferChunk {
                buffer,
                offset,
                data,
            } => {
                sink.write_chunk(buffer, offset, data)
                    .map_err(ReceiveError::Sink)?;
                got.bytes += data.len() as u64;
            }
            Frame::Done(done) => {
                session
                    .done(&done.totals)
                    .verify_slice(&done.tag)
                    .map_err(|_| ReceiveError::Forged)?;
                break done;
            }
            Frame::Abort { reason } => return Err(ReceiveError::Aborted { reason }),
            other => return Err(unexpected(other.name(), "in a pre-copy")),
        }
    };
    if sent.totals != got {
        return Err(ReceiveError::Totals {
            sent: sent.totals,
            got,
        });
    }
    Ok(sent)
}

// ---------------------------------------------------------------------------------------------
// After the transfer: a migration's hand-off

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
    /// A frame that does not carry this session's HMAC.
    #[error(
        "the peer's {what} does not carry this session's HMAC: it was forged or changed in transit"
    )]
    Forged {
        /// The frame.
        what: &'static str,
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
    let tag: [u8; TAG_BYTES] = session.released().finalize().into_bytes().into();
    write_frame(stream, &Frame::Released { tag })?;
    stream.flush().map_err(|source| FrameError::Io {
        what: "sending",
        source,
    })?;
    session.last = tag;
    Ok(())
}

/// Waits for `Released` after a [`receive_dir_session`] (as long as the stream's read timeout
/// lets it), and checks its HMAC.
pub fn await_released<S: Read>(stream: &mut S, session: &mut Session) -> Result<(), HandoffError> {
    let mut buf = Vec::new();
    match read_frame(stream, &mut buf)? {
        Frame::Released { tag } => {
            session
                .released()
                .verify_slice(&tag)
                .map_err(|_| HandoffError::Forged { what: "Released" })?;
            session.last = tag;
            Ok(())
        }
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
    let (running, pid, reason) = outcome.parts();
    let tag: [u8; TAG_BYTES] = session
        .outcome(running, pid, reason)
        .finalize()
        .into_bytes()
        .into();
    write_frame(
        stream,
        &Frame::Outcome {
            outcome: outcome.clone(),
            tag,
        },
    )?;
    stream.flush().map_err(|source| FrameError::Io {
        what: "sending",
        source,
    })?;
    session.last = tag;
    Ok(())
}

/// Waits for `Outcome` after [`send_released`] (as long as the stream's read timeout lets it),
/// and checks its HMAC.
pub fn await_outcome<S: Read>(
    stream: &mut S,
    session: &mut Session,
) -> Result<Outcome, HandoffError> {
    let mut buf = Vec::new();
    match read_frame(stream, &mut buf)? {
        Frame::Outcome { outcome, tag } => {
            let (running, pid, reason) = outcome.parts();
            session
                .outcome(running, pid, reason)
                .verify_slice(&tag)
                .map_err(|_| HandoffError::Forged { what: "Outcome" })?;
            session.last = tag;
            Ok(outcome)
        }
        Frame::Abort { reason } => Err(HandoffError::Aborted { reason }),
        other => Err(HandoffError::Unexpected {
            got: other.name(),
            want: "Outcome",
        }),
    }
}

/// Tells the peer why this end gives up (`Abort`), best effort.
pub fn send_abort<S: Write>(stream: &mut S, reason: &str) {
    let _ = write_frame(
        stream,
        &Frame::Abort {
            reason: reason.to_string(),
        },
    );
    let _ = stream.flush();
}

fn unexpected(got: &'static str, context: &'static str) -> ReceiveError {
    ReceiveError::Unexpected { got, context }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::os::unix::net::UnixStream;
    use std::thread;

    const TIMEOUT: Duration = Duration::from_secs(20);

    fn key(b: u8) -> HmacKey {
        HmacKey::from_bytes(vec![b; 32]).unwrap()
    }

    fn pair() -> (UnixStream, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        for s in [&a, &b] {
            s.set_read_timeout(Some(TIMEOUT)).unwrap();
            s.set_write_timeout(Some(TIMEOUT)).unwrap();
        }
        (a, b)
    }

    fn noise(n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        fs::File::open("/dev/urandom")
            .unwrap()
            .read_exact(&mut v)
            .unwrap();
        v
    }

    /// Every entry under `d`: its path, mode, and bytes for a file.
    fn snapshot(d: &Path) -> Vec<(String, u32, Option<Vec<u8>>)> {
        fn walk(root: &Path, at: &Path, out: &mut Vec<(String, u32, Option<Vec<u8>>)>) {
            for e in fs::read_dir(at).unwrap() {
                let e = e.unwrap();
                let p = e.path();
                let rel = p.strip_prefix(root).unwrap().to_str().unwrap().to_string();
                let m = fs::symlink_metadata(&p).unwrap();
                let mode = m.permissions().mode() & 0o7777;
                if m.is_dir() {
                    out.push((rel, mode, None));
                    walk(root, &p, out);
                } else {
                    out.push((rel, mode, Some(fs::read(&p).unwrap())));
                }
            }
        }
        let mut out = Vec::new();
        walk(d, d, &mut out);
        out.sort();
        out
    }

    fn names(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    /// A source directory `tmp/src` and an empty `tmp/out` to receive into.
    fn dirs() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        let out = tmp.path().join("out");
        fs::create_dir(&src).unwrap();
        fs::create_dir(&out).unwrap();
        (tmp, src, out)
    }

    /// `send_dir` and `receive_dir` over loopback TCP, each with its key.
    fn over_tcp(
        send_key: HmacKey,
        recv_key: HmacKey,
        src: &Path,
        dest: &Path,
    ) -> (
        Result<SendReport, WireError>,
        Result<ReceiveReport, WireError>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let dest = dest.to_path_buf();
        let receiver = thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            set_timeouts(&s, TIMEOUT).unwrap();
            receive_dir(&mut s, &recv_key, &dest)
        });
        let mut s = TcpStream::connect(addr).unwrap();
        set_timeouts(&s, TIMEOUT).unwrap();
        let sent = send_dir(&mut s, &send_key, src);
        drop(s);
        (sent, receiver.join().unwrap())
    }

    #[test]
    fn a_tree_arrives_bit_exact_with_its_modes() {
        let (_tmp, src, out) = dirs();
        fs::create_dir_all(src.join("criu")).unwrap();
        fs::create_dir_all(src.join("gpu/gpu-0/empty")).unwrap();
        fs::write(src.join("possum.json"), "{\"version\":1}").unwrap();
        fs::write(src.join("criu/empty.img"), "").unwrap();
        let big = src.join("gpu/gpu-0/data-000.bin");
        fs::write(&big, noise((5 << 20) + 12345)).unwrap();
        fs::set_permissions(&big, fs::Permissions::from_mode(0o640)).unwrap();
        fs::write(src.join("criu/run.sh"), "#!/bin/sh\n").unwrap();
        fs::set_permissions(src.join("criu/run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
        fs::set_permissions(src.join("gpu"), fs::Permissions::from_mode(0o750)).unwrap();
        fs::set_permissions(
            src.join("gpu/gpu-0/empty"),
            fs::Permissions::from_mode(0o500),
        )
        .unwrap();
        let dest = out.join("image");

        let (sent, received) = over_tcp(key(7), key(7), &src, &dest);
        let sent = sent.unwrap();
        let received = received.unwrap();
        let bytes = 13 + (5 << 20) + 12345 + 10;
        assert_eq!(sent.totals, Totals { files: 4, bytes });
        assert_eq!(received.totals, sent.totals);
        assert_eq!(snapshot(&dest), snapshot(&src));
        assert_eq!(
            fs::metadata(&dest).unwrap().permissions().mode() & 0o777,
            0o700
        );
        // Only the destination: no temporary directory left beside it.
        assert_eq!(names(&out), ["image"]);
        // A destination that exists is refused before the handshake.
        let (sent, received) = over_tcp(key(7), key(7), &src, &dest);
        assert!(sent.is_err());
        assert!(
            matches!(
                received,
                Err(WireError::Receive(ReceiveError::DestExists { .. }))
            ),
            "{received:?}"
        );
        assert_eq!(names(&out), ["image"]);
        assert_eq!(snapshot(&dest), snapshot(&src));
    }

    #[test]
    fn another_secret_on_either_side_is_refused_and_nothing_is_written() {
        let (_tmp, src, out) = dirs();
        fs::write(src.join("f"), "data").unwrap();
        let dest = out.join("image");
        let (sent, received) = over_tcp(key(1), key(2), &src, &dest);
        let (sent, received) = (sent.unwrap_err(), received.unwrap_err());
        assert!(
            matches!(
                received,
                WireError::Handshake(HandshakeError::PeerNotAuthenticated { peer: "sender" })
            ),
            "{received:?}"
        );
        assert!(received.to_string().contains("failed authentication"));
        // The receiver wrote nothing after its hello: the sender saw the connection close.
        assert!(
            matches!(sent, WireError::Handshake(HandshakeError::Refused)),
            "{sent:?}"
        );
        assert!(sent.to_string().contains("authentication"), "{sent}");
        assert!(names(&out).is_empty());

        // A receiver that does not hold the secret: the sender refuses it and sends nothing.
        let (mut a, mut b) = pair();
        let impostor = thread::spawn(move || {
            let mut hello = Vec::new();
            hello.extend_from_slice(&MAGIC);
            hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
            hello.extend_from_slice(&[5u8; NONCE_BYTES]);
            b.write_all(&hello).unwrap();
            let mut proof = [0u8; 8 + 4 + NONCE_BYTES + TAG_BYTES];
            b.read_exact(&mut proof).unwrap();
            b.write_all(
                &tag(&key(9), SERVER_LABEL, &proof[12..44], &[5u8; NONCE_BYTES])
                    .finalize()
                    .into_bytes(),
            )
            .unwrap();
            let mut rest = Vec::new();
            b.read_to_end(&mut rest).unwrap();
            rest
        });
        let e = send_dir(&mut a, &key(1), &src).unwrap_err();
        drop(a);
        assert!(
            matches!(
                e,
                WireError::Handshake(HandshakeError::PeerNotAuthenticated { peer: "receiver" })
            ),
            "{e:?}"
        );
        assert!(
            e.to_string().contains("receiver failed authentication"),
            "{e}"
        );
        assert!(impostor.join().unwrap().is_empty());
    }

    /// Runs `receive_dir` into `dest` against a sender that passes the handshake and then writes
    /// what `frames` writes; the receiver's error.
    fn against(dest: &Path, frames: impl FnOnce(&mut UnixStream, &mut Session)) -> WireError {
        let (mut a, mut b) = pair();
        let d = dest.to_path_buf();
        let receiver = thread::spawn(move || receive_dir(&mut b, &key(3), &d));
        let mut session = sender_handshake(&mut a, &key(3)).unwrap();
        frames(&mut a, &mut session);
        drop(a);
        receiver.join().unwrap().unwrap_err()
    }

    /// Writes a frame as a sender does.
    fn send(s: &mut UnixStream, session: &mut Session, frame: &Frame<'_>) {
        let _ = write_frame_to(s, frame, Some(&mut session.frames));
    }

    /// Writes a file's frames (not `Done`).
    fn put(s: &mut UnixStream, session: &mut Session, path: &str, data: &[u8]) {
        let h = FileHeader {
            path: path.to_string(),
            size: data.len() as u64,
            mode: 0o644,
            base: None,
        };
        send(s, session, &Frame::File(h));
        send(s, session, &Frame::Chunk { offset: 0, data });
        send(s, session, &Frame::EndFile);
    }

    /// Writes `Done`, sealed.
    fn done(s: &mut UnixStream, session: &mut Session, totals: Totals) {
        let tag = session.done(&totals).finalize().into_bytes().into();
        let _ = write_frame(s, &Frame::Done(Seal { totals, tag }));
    }

    /// One file and `Done`.
    fn file(path: &str, data: &[u8]) -> impl FnOnce(&mut UnixStream, &mut Session) {
        let path = path.to_string();
        let data = data.to_vec();
        move |s, session| {
            put(s, session, &path, &data);
            let bytes = data.len() as u64;
            done(s, session, Totals { files: 1, bytes });
        }
    }

    #[test]
    fn paths_out_of_the_destination_are_refused_and_nothing_is_written() {
        let (tmp, _src, out) = dirs();
        let dest = out.join("image");
        let outside = tmp.path().join("escaped");
        let absolute = outside.to_str().unwrap().to_string();
        for bad in [
            "../escaped",
            "a/../../escaped",
            absolute.as_str(),
            "",
            "a//b",
            "./a",
            "a/.",
        ] {
            let e = against(&dest, file(bad, b"evil"));
            assert!(
                matches!(e, WireError::Receive(ReceiveError::Path { ref path, .. }) if path == bad),
                "{bad:?}: {e:?}"
            );
            assert!(e.to_string().contains("refused"), "{e}");
            assert!(names(&out).is_empty(), "{bad:?}");
            assert!(!outside.exists());
        }
        // A directory named like that, too.
        let e = against(&dest, |s, _| {
            let _ = write_frame(
                s,
                &Frame::Dir(DirHeader {
                    path: "../escaped".into(),
                    mode: 0o755,
                }),
            );
        });
        assert!(
            matches!(e, WireError::Receive(ReceiveError::Path { .. })),
            "{e:?}"
        );
        assert!(!outside.exists());
        // A path through a file the sender sent.
        let e = against(&dest, |s, session| {
            put(s, session, "f", b"x");
            put(s, session, "f/g", b"y");
        });
        assert!(
            matches!(
                e,
                WireError::Receive(ReceiveError::Path {
                    why: "it goes through a file",
                    ..
                })
            ),
            "{e:?}"
        );
        assert!(names(&out).is_empty());
        // A frame over the cap is refused before it is read.
        let e = against(&dest, |s, _| {
            let mut h = [0u8; HEADER_BYTES];
            h[0] = KIND_CHUNK;
            h[1..9].copy_from_slice(&(MAX_FRAME + 1).to_le_bytes());
            let _ = s.write_all(&h);
        });
        assert!(
            matches!(
                e,
                WireError::Receive(ReceiveError::Frame(FrameError::TooLarge { .. }))
            ),
            "{e:?}"
        );
        assert!(names(&out).is_empty());
        // What is well formed is received.
        against_ok(&dest, file("a/b/c", b"fine"));
        assert_eq!(fs::read(dest.join("a/b/c")).unwrap(), b"fine");
    }

    fn against_ok(dest: &Path, frames: impl FnOnce(&mut UnixStream, &mut Session)) {
        let (mut a, mut b) = pair();
        let d = dest.to_path_buf();
        let receiver = thread::spawn(move || receive_dir(&mut b, &key(3), &d));
        let mut session = sender_handshake(&mut a, &key(3)).unwrap();
        frames(&mut a, &mut session);
        let mut buf = Vec::new();
        assert!(matches!(
            read_frame(&mut a, &mut buf).unwrap(),
            Frame::Committed(_)
        ));
        receiver.join().unwrap().unwrap();
    }

    #[test]
    fn a_connection_dropped_mid_file_fails_and_nothing_is_written() {
        let (_tmp, _src, out) = dirs();
        let dest = out.join("image");
        let e = against(&dest, |s, _| {
            let data = noise(1 << 20);
            write_frame(
                s,
                &Frame::File(FileHeader {
                    path: "criu/pages-1.img".into(),
                    size: 2 << 20,
                    mode: 0o600,
                    base: None,
                }),
            )
            .unwrap();
            write_frame(
                s,
                &Frame::Chunk {
                    offset: 0,
                    data: &data,
                },
            )
            .unwrap();
            // Half a frame, then the close.
            let _ = s.write_all(&[KIND_CHUNK, 1, 0]);
        });
        assert!(
            matches!(
                e,
                WireError::Receive(ReceiveError::Frame(FrameError::Closed))
            ),
            "{e:?}"
        );
        assert!(names(&out).is_empty());
        // A file shorter than its size, ended: refused too.
        let e = against(&dest, |s, _| {
            let _ = write_frame(
                s,
                &Frame::File(FileHeader {
                    path: "f".into(),
                    size: 10,
                    mode: 0o600,
                    base: None,
                }),
            );
            let _ = write_frame(
                s,
                &Frame::Chunk {
                    offset: 0,
                    data: b"12345",
                },
            );
            let _ = write_frame(s, &Frame::EndFile);
        });
        assert!(
            matches!(
                e,
                WireError::Receive(ReceiveError::Size {
                    size: 10,
                    got: 5,
                    ..
                })
            ),
            "{e:?}"
        );
        assert!(names(&out).is_empty());
    }

    #[test]
    fn a_chunk_damaged_in_transit_is_detected_and_nothing_is_written() {
        let (_tmp, src, out) = dirs();
        fs::write(src.join("data.bin"), noise(3 << 20)).unwrap();
        let dest = out.join("image");
        // sender <-> (a, pa) proxy (pb, b) <-> receiver; the proxy flips one byte of the first
        // chunk's data.
        let (mut a, pa) = pair();
        let (pb, mut b) = pair();
        let d = dest.clone();
        let receiver = thread::spawn(move || receive_dir(&mut b, &key(4), &d));
        let (mut pa2, mut pb2) = (pa.try_clone().unwrap(), pb.try_clone().unwrap());
        let back = thread::spawn(move || {
            let _ = io::copy(&mut pb2, &mut pa2);
            let _ = pa2.shutdown(std::net::Shutdown::Both);
            let _ = pb2.shutdown(std::net::Shutdown::Both);
        });
        let forth = thread::spawn(move || {
            let (mut pa, mut pb) = (pa, pb);
            // The proof is 76 bytes; the file's header frame is under 100: this is in its data.
            let flip_at = 76 + 1_000_000;
            let mut seen = 0usize;
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let k = match pa.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => k,
                };
                if (seen..seen + k).contains(&flip_at) {
                    buf[flip_at - seen] ^= 0x40;
                }
                seen += k;
                if pb.write_all(&buf[..k]).is_err() {
                    break;
                }
            }
            let _ = pa.shutdown(std::net::Shutdown::Both);
            let _ = pb.shutdown(std::net::Shutdown::Both);
        });
        let sent = send_dir(&mut a, &key(4), &src);
        drop(a);
        let received = receiver.join().unwrap();
        forth.join().unwrap();
        back.join().unwrap();
        assert!(sent.is_err(), "{sent:?}");
        let e = received.unwrap_err();
        assert!(
            matches!(
                e,
                WireError::Receive(ReceiveError::Frame(FrameError::Checksum {
                    kind: "Chunk",
                    ..
                }))
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("checksum"), "{e}");
        assert!(names(&out).is_empty());
    }

    #[test]
    fn frames_changed_with_their_checksums_fixed_are_refused_by_their_hmac() {
        let (_tmp, _src, out) = dirs();
        let dest = out.join("image");
        // What a man in the middle would send: another chunk, its checksum right.
        let e = against(&dest, |s, session| {
            let h = FileHeader {
                path: "f".into(),
                size: 4,
                mode: 0o644,
                base: None,
            };
            send(s, session, &Frame::File(h));
            let good = Frame::Chunk {
                offset: 0,
                data: b"good",
            };
            write_frame_to(&mut io::sink(), &good, Some(&mut session.frames)).unwrap();
            let _ = write_frame(
                s,
                &Frame::Chunk {
                    offset: 0,
                    data: b"evil",
                },
            );
            send(s, session, &Frame::EndFile);
            done(s, session, Totals { files: 1, bytes: 4 });
        });
        assert!(
            matches!(e, WireError::Receive(ReceiveError::Forged)),
            "{e:?}"
        );
        assert!(e.to_string().contains("changed in transit"), "{e}");
        assert!(names(&out).is_empty());
        // A frame left out.
        let e = against(&dest, |s, session| {
            put(s, session, "a", b"1");
            write_frame_to(
                &mut io::sink(),
                &Frame::Dir(DirHeader {
                    path: "d".into(),
                    mode: 0o755,
                }),
                Some(&mut session.frames),
            )
            .unwrap();
            done(s, session, Totals { files: 1, bytes: 1 });
        });
        assert!(
            matches!(e, WireError::Receive(ReceiveError::Forged)),
            "{e:?}"
        );
        assert!(names(&out).is_empty());
    }

    #[test]
    fn a_confirmation_without_the_sessions_hmac_fails_the_send() {
        let (_tmp, src, _out) = dirs();
        fs::write(src.join("f"), "data").unwrap();
        let (mut a, mut b) = pair();
        let receiver = thread::spawn(move || {
            let mut session = receiver_handshake(&mut b, &key(8)).unwrap();
            let mut buf = Vec::new();
            loop {
                let f = read_frame_from(&mut b, &mut buf, Some(&mut session.frames)).unwrap();
                if let Frame::Done(d) = f {
                    let forged = Seal {
                        totals: d.totals,
                        tag: [0; TAG_BYTES],
                    };
                    write_frame(&mut b, &Frame::Committed(forged)).unwrap();
                    return;
                }
            }
        });
        let e = send_dir(&mut a, &key(8), &src).unwrap_err();
        receiver.join().unwrap();
        assert!(matches!(e, WireError::Send(SendError::Forged)), "{e:?}");
        assert!(e.to_string().contains("not known to be complete"), "{e}");
    }

    #[test]
    fn a_symbolic_link_in_the_source_is_refused_naming_it() {
        let (_tmp, src, out) = dirs();
        fs::create_dir(src.join("criu")).unwrap();
        fs::write(src.join("criu/a.img"), "a").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", src.join("criu/link")).unwrap();
        let dest = out.join("image");
        let (sent, received) = over_tcp(key(5), key(5), &src, &dest);
        let sent = sent.unwrap_err();
        assert!(
            matches!(
                sent,
                WireError::Send(SendError::Unsupported { ref path, .. }) if path.ends_with("criu/link")
            ),
            "{sent:?}"
        );
        assert!(
            sent.to_string().contains("criu/link: a symbolic link"),
            "{sent}"
        );
        // The receiver was told why.
        let received = received.unwrap_err();
        assert!(
            matches!(
                received,
                WireError::Receive(ReceiveError::Aborted { ref reason }) if reason.contains("criu/link")
            ),
            "{received:?}"
        );
        assert!(names(&out).is_empty());
    }

    #[test]
    fn a_silent_sender_times_out_and_nothing_is_written() {
        let (_tmp, _src, out) = dirs();
        let dest = out.join("image");
        let (a, mut b) = pair();
        b.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let e = receive_dir(&mut b, &key(6), &dest).unwrap_err();
        drop(a);
        assert!(
            matches!(
                e,
                WireError::Handshake(HandshakeError::Io { ref source, .. })
                    if matches!(source.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
            ),
            "{e:?}"
        );
        assert!(names(&out).is_empty());
    }

    /// After `Committed`: `Released` then `Outcome`, each checked under the session's key; one
    /// from another session (a replay) is refused.
    #[test]
    fn the_hand_off_after_a_transfer_is_authenticated_by_the_session() {
        let (_tmp, src, out) = dirs();
        fs::write(src.join("a"), b"image").unwrap();
        let (mut a, mut b) = pair();
        let dest = out.join("img");
        let receiver = thread::spawn(move || {
            let (_, mut session) = receive_dir_session(&mut b, &key(1), &dest).unwrap();
            await_released(&mut b, &mut session).unwrap();
            let outcome = Outcome::RestoreFailed {
                reason: "no CRIU here".into(),
            };
            send_outcome(&mut b, &mut session, &outcome).unwrap();
            // Another session's Released (here: this one's, replayed) is refused.
            await_released(&mut b, &mut session)
        });
        let (report, mut session) = send_dir_session(&mut a, &key(1), &src).unwrap();
        assert_eq!(report.totals, Totals { files: 1, bytes: 5 });
        let tag: [u8; TAG_BYTES] = session.released().finalize().into_bytes().into();
        send_released(&mut a, &mut session).unwrap();
        assert_eq!(
            await_outcome(&mut a, &mut session).unwrap(),
            Outcome::RestoreFailed {
                reason: "no CRIU here".into()
            }
        );
        write_frame(&mut a, &Frame::Released { tag }).unwrap();
        let replayed = receiver.join().unwrap();
        assert!(
            matches!(replayed, Err(HandoffError::Forged { what: "Released" })),
            "{replayed:?}"
        );
        assert_eq!(fs::read(out.join("img/a")).unwrap(), b"image");
    }

    /// A restore held for the go: `Restored`, the second `Released` (the go), then `Running`,
    /// each chained to the one before: the first `Released` replayed as the go is refused.
    #[test]
    fn the_go_after_a_held_restore_is_chained_to_it() {
        let (_tmp, src, out) = dirs();
        fs::write(src.join("a"), b"image").unwrap();
        let (mut a, mut b) = pair();
        let dest = out.join("img");
        let receiver = thread::spawn(move || {
            let (_, mut session) = receive_dir_session(&mut b, &key(1), &dest).unwrap();
            await_released(&mut b, &mut session).unwrap();
            send_outcome(&mut b, &mut session, &Outcome::Restored { pid: 7 }).unwrap();
            await_released(&mut b, &mut session).unwrap();
            send_outcome(&mut b, &mut session, &Outcome::Running { pid: 7 }).unwrap();
            // The first go replayed: refused.
            await_released(&mut b, &mut session)
        });
        let (_, mut session) = send_dir_session(&mut a, &key(1), &src).unwrap();
        send_released(&mut a, &mut session).unwrap();
        assert_eq!(
            await_outcome(&mut a, &mut session).unwrap(),
            Outcome::Restored { pid: 7 }
        );
        let go: [u8; TAG_BYTES] = session.released().finalize().into_bytes().into();
        send_released(&mut a, &mut session).unwrap();
        assert_eq!(
            await_outcome(&mut a, &mut session).unwrap(),
            Outcome::Running { pid: 7 }
        );
        write_frame(&mut a, &Frame::Released { tag: go }).unwrap();
        let replayed = receiver.join().unwrap();
        assert!(
            matches!(replayed, Err(HandoffError::Forged { what: "Released" })),
            "{replayed:?}"
        );
    }

    /// A paced stream writes everything, in bursts of at most a twentieth of its rate.
    #[test]
    fn a_paced_stream_writes_in_bursts_of_its_rate() {
        #[derive(Default)]
        struct Writes(Vec<usize>, Vec<u8>);
        impl Write for Writes {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                self.0.push(buf.len());
                self.1.extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut p = Paced::new(Writes::default(), 2_000_000);
        let data = noise(300_000);
        p.write_all(&data).unwrap();
        let w = p.get_mut();
        assert_eq!(w.1, data);
        assert_eq!(w.0.iter().max(), Some(&100_000), "{:?}", w.0);
        assert_eq!(w.0.len(), 3, "{:?}", w.0);
    }

    #[test]
    fn frames_read_back_as_written() {
        let frames = [
            Frame::Dir(DirHeader {
                path: "a".into(),
                mode: 0o755,
            }),
            Frame::File(FileHeader {
                path: "a/b".into(),
                size: 3,
                mode: 0o600,
                base: None,
            }),
            Frame::Chunk {
                offset: 0,
                data: b"abc",
            },
            Frame::EndFile,
            Frame::Done(Seal {
                totals: Totals { files: 1, bytes: 3 },
                tag: [7; TAG_BYTES],
            }),
            Frame::Committed(Seal {
                totals: Totals { files: 1, bytes: 3 },
                tag: [8; TAG_BYTES],
            }),
            Frame::Abort {
                reason: "why".into(),
            },
            Frame::Released {
                tag: [9; TAG_BYTES],
            },
            Frame::Outcome {
                outcome: Outcome::Running { pid: 4242 },
                tag: [10; TAG_BYTES],
            },
            Frame::Outcome {
                outcome: Outcome::RestoreFailed {
                    reason: "no room".into(),
                },
                tag: [11; TAG_BYTES],
            },
        ];
        let mut wire = Vec::new();
        for f in &frames {
            write_frame(&mut wire, f).unwrap();
        }
        let mut r = &wire[..];
        let mut buf = Vec::new();
        for f in &frames {
            assert_eq!(&read_frame(&mut r, &mut buf).unwrap(), f);
        }
        assert!(matches!(
            read_frame(&mut r, &mut buf),
            Err(FrameError::Closed)
        ));
        // A JSON header with a field it does not have is malformed.
        let payload = br#"{"path":"a","mode":1,"owner":0}"#;
        let mut w = vec![KIND_DIR];
        w.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        w.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
        w.extend_from_slice(payload);
        assert!(matches!(
            read_frame(&mut &w[..], &mut buf),
            Err(FrameError::Malformed { kind: "Dir", .. })
        ));
    }

    #[test]
    fn precopy_rounds_reach_the_sink_the_later_bytes_winning() {
        use possum_engine::store::{ChunkSource, MemStore};
        let (mut a, mut b) = pair();
        let recv = thread::spawn(move || {
            let mut session = receiver_handshake(&mut b, &key(3)).unwrap();
            receive_precopy(&mut b, &mut session, MemStore::new(), Ok).unwrap()
        });
        let session = sender_handshake(&mut a, &key(3)).unwrap();
        let sender = PrecopySender::new(a, session);
        let rec = |id, size| BufferRecord {
            id,
            va: 0x1000 * id,
            size,
            prefetch_rank: u32::MAX,
        };
        let big = noise(CHUNK_BYTES + 100);
        // Round 1: both buffers; round 2: the second one again, changed.
        sender.add_buffer(rec(1, 64)).unwrap();
        sender.write_chunk(1, 0, &[7u8; 64]).unwrap();
        sender.add_buffer(rec(2, big.len() as u64)).unwrap();
        sender.write_chunk(2, 0, &noise(big.len())).unwrap();
        sender.add_buffer(rec(2, big.len() as u64)).unwrap();
        sender.write_chunk(2, 0, &big).unwrap();
        let sent = sender.sent();
        assert_eq!(sent.files, 3);
        assert_eq!(sent.bytes, 64 + 2 * big.len() as u64);
        let (confirmed, _stream) = sender.finish().unwrap();
        let (got, store) = recv.join().unwrap();
        assert_eq!(confirmed, sent);
        assert_eq!(got, sent);
        assert_eq!(store.buffer_bytes(1).unwrap(), vec![7u8; 64]);
        let mut back = vec![0u8; big.len()];
        for (off, len) in store.chunks(2) {
            let o = off as usize;
            store
                .read_chunk(2, off, &mut back[o..o + len as usize])
                .unwrap();
        }
        assert_eq!(back, big);
    }

    #[test]
    fn a_precopy_chunk_changed_in_transit_is_refused() {
        use possum_engine::store::MemStore;
        let (mut a, mut b) = pair();
        let recv = thread::spawn(move || {
            let mut session = receiver_handshake(&mut b, &key(4)).unwrap();
            receive_precopy(&mut b, &mut session, MemStore::new(), |_| Ok(()))
        });
        let mut session = sender_handshake(&mut a, &key(4)).unwrap();
        let rec = BufferRecord {
            id: 1,
            va: 0x1000,
            size: 8,
            prefetch_rank: 0,
        };
        write_frame_to(&mut a, &Frame::Buffer(rec), Some(&mut session.frames)).unwrap();
        // The transcript says one chunk, the wire carries another (a valid checksum of its own).
        let mut other = session.frames.clone();
        let data = [1u8; 8];
        let chunk = |data| Frame::BufferChunk {
            buffer: 1,
            offset: 0,
            data,
        };
        write_frame_to(&mut io::sink(), &chunk(&data), Some(&mut session.frames)).unwrap();
        write_frame_to(&mut a, &chunk(&[2u8; 8]), Some(&mut other)).unwrap();
        let totals = Totals { files: 1, bytes: 8 };
        let done = Seal {
            totals,
            tag: session.done(&totals).finalize().into_bytes().into(),
        };
        write_frame(&mut a, &Frame::Done(done)).unwrap();
        assert!(matches!(recv.join().unwrap(), Err(ReceiveError::Forged)));
        let mut buf = Vec::new();
        assert!(matches!(
            read_frame(&mut a, &mut buf),
            Ok(Frame::Abort { .. })
        ));
    }

    /// A file sent ahead whose final version begins with it (found by its inode, renamed and
    /// grown since), one unchanged, one rewritten in place, one gone and one new: only the new
    /// bytes are sent after the cut, and DEST is the final set, nothing more.
    #[test]
    fn a_directory_sent_ahead_then_whole_sends_only_what_changed_after_the_cut() {
        let (_tmp, src, out) = dirs();
        fs::create_dir(src.join(".gpu.tmp")).unwrap();
        let data = noise(CHUNK_BYTES + 1000);
        fs::write(src.join(".gpu.tmp/data-000.bin"), &data).unwrap();
        fs::write(src.join("same"), b"unchanged").unwrap();
        fs::write(src.join("rewritten"), b"version 1").unwrap();
        fs::write(src.join("lock"), b"").unwrap();
        let (mut a, mut b) = pair();
        let dest = out.join("image");
        let d = dest.clone();
        let receiver = thread::spawn(move || receive_dir(&mut b, &key(2), &d));
        let mut sender = DirSender::start(&mut a, &key(2)).unwrap();
        let ahead = sender.send_ahead(&mut a, &src).unwrap();
        assert_eq!(ahead.files, 4);
        // The cut: the engine's image named, appended to; a file rewritten, one removed, one new.
        fs::rename(src.join(".gpu.tmp"), src.join("gpu")).unwrap();
        let more = noise(5000);
        let mut f = fs::OpenOptions::new()
            .append(true)
            .open(src.join("gpu/data-000.bin"))
            .unwrap();
        f.write_all(&more).unwrap();
        drop(f);
        fs::write(src.join("rewritten"), b"version 2").unwrap();
        fs::remove_file(src.join("lock")).unwrap();
        fs::write(src.join("possum.json"), b"{}").unwrap();
        let (report, _) = sender.finish(&mut a, &src).unwrap();
        let got = receiver.join().unwrap().unwrap();
        let whole = (data.len() + more.len() + 9 + 9 + 2) as u64;
        assert_eq!(
            report.totals,
            Totals {
                files: 4,
                bytes: whole
            }
        );
        assert_eq!(got.totals, report.totals);
        assert_eq!(report.sent_bytes, (more.len() + 9 + 2) as u64);
        assert_eq!(snapshot(&dest), snapshot(&src));
        assert_eq!(names(&out), vec!["image".to_string()]);
    }

    /// After a `Cut`, a base that was not sent ahead, or is not what was, is refused, and
    /// nothing is named.
    #[test]
    fn a_final_set_that_lacks_or_changes_a_file_sent_ahead_is_refused() {
        let (_tmp, _src, out) = dirs();
        let dest = out.join("image");
        let with_base = |base: Base| {
            move |s: &mut UnixStream, session: &mut Session| {
                put(s, session, "a", b"ahead");
                send(s, session, &Frame::Cut);
                let h = FileHeader {
                    path: "a".into(),
                    size: 7,
                    mode: 0o644,
                    base: Some(base),
                };
                send(s, session, &Frame::File(h));
                send(
                    s,
                    session,
                    &Frame::Chunk {
                        offset: 5,
                        data: b"!!",
                    },
                );
                send(s, session, &Frame::EndFile);
                done(s, session, Totals { files: 1, bytes: 7 });
            }
        };
        let sha = |d: &[u8]| hex(&<[u8; 32]>::from(<sha2::Sha256 as sha2::Digest>::digest(d)));
        // The sound one is taken.
        against_ok(
            &dest,
            with_base(Base {
                path: "a".into(),
                size: 5,
                sha256: sha(b"ahead"),
            }),
        );
        assert_eq!(fs::read(dest.join("a")).unwrap(), b"ahead!!");
        fs::remove_dir_all(&dest).unwrap();
        for (base, why) in [
            (
                Base {
                    path: "b".into(),
                    size: 5,
                    sha256: sha(b"ahead"),
                },
                "not sent ahead",
            ),
            (
                Base {
                    path: "a".into(),
                    size: 5,
                    sha256: sha(b"other"),
                },
                "not what was sent ahead",
            ),
            (
                Base {
                    path: "a".into(),
                    size: 4,
                    sha256: sha(b"ahea"),
                },
                "not what was sent ahead",
            ),
        ] {
            let e = against(&dest, with_base(base));
            assert!(
                matches!(e, WireError::Receive(ReceiveError::Ahead { .. })),
                "{e:?}"
            );
            assert!(e.to_string().contains(why), "{e}");
            assert!(names(&out).is_empty(), "{:?}", names(&out));
        }
        // Before any Cut, a base that was not sent ahead, or another file's.
        let e = against(&dest, |s, session| {
            put(s, session, "a", b"ahead");
            let h = FileHeader {
                path: "b".into(),
                size: 7,
                mode: 0o644,
                base: Some(Base {
                    path: "a".into(),
                    size: 5,
                    sha256: sha(b"ahead"),
                }),
            };
            send(s, session, &Frame::File(h));
            send(s, session, &Frame::EndFile);
            done(s, session, Totals { files: 1, bytes: 7 });
        });
        assert!(e.to_string().contains("goes on only itself"), "{e}");
        assert!(names(&out).is_empty());
        let e = against(&dest, |s, session| {
            let h = FileHeader {
                path: "a".into(),
                size: 1,
                mode: 0o644,
                base: Some(Base {
                    path: "a".into(),
                    size: 0,
                    sha256: sha(b""),
                }),
            };
            send(s, session, &Frame::File(h));
            send(s, session, &Frame::EndFile);
            done(s, session, Totals { files: 1, bytes: 1 });
        });
        assert!(e.to_string().contains("not sent ahead"), "{e}");
        assert!(names(&out).is_empty());
    }

    /// Rounds ahead of the cut (a migration's pre-copy rounds): a file sent in an earlier round
    /// sends only what it gained since, one unchanged nothing, one rewritten in place waits for
    /// the final set, a new one goes whole; after the cut, only what changed since the last
    /// round. DEST is the final set.
    #[test]
    fn a_directory_sent_ahead_in_rounds_sends_each_file_s_gain_once() {
        let (_tmp, src, out) = dirs();
        let append = |name: &str, bytes: &[u8]| {
            let mut f = fs::OpenOptions::new()
                .append(true)
                .open(src.join(name))
                .unwrap();
            f.write_all(bytes).unwrap();
        };
        let data = noise(CHUNK_BYTES + 1000);
        fs::write(src.join("data"), &data).unwrap();
        fs::write(src.join("same"), b"unchanged").unwrap();
        fs::write(src.join("rewritten"), b"version 1").unwrap();
        let (mut a, mut b) = pair();
        let dest = out.join("image");
        let d = dest.clone();
        let receiver = thread::spawn(move || receive_dir(&mut b, &key(2), &d));
        let mut sender = DirSender::start(&mut a, &key(2)).unwrap();
        let first = sender.send_ahead(&mut a, &src).unwrap();
        assert_eq!(first.files, 3);
        // Round 2: data grew, a file is new, one is rewritten in place.
        let gain = noise(3000);
        append("data", &gain);
        fs::write(src.join("new"), b"new file").unwrap();
        fs::write(src.join("rewritten"), b"version 2").unwrap();
        let second = sender.send_ahead(&mut a, &src).unwrap();
        assert_eq!(
            second,
            Totals {
                files: 2,
                bytes: (gain.len() + 8) as u64
            },
            "data's gain and the new file"
        );
        // Round 3: nothing changed.
        assert_eq!(sender.send_ahead(&mut a, &src).unwrap(), Totals::default());
        // The cut: data grows again.
        let last = noise(700);
        append("data", &last);
        let (report, _) = sender.finish(&mut a, &src).unwrap();
        let got = receiver.join().unwrap().unwrap();
        assert_eq!(got.totals, report.totals);
        assert_eq!(report.totals.files, 4);
        assert_eq!(
            report.sent_bytes,
            (last.len() + 9) as u64,
            "data's last gain and the rewritten file, whole"
        );
        assert_eq!(snapshot(&dest), snapshot(&src));
        assert_eq!(names(&out), vec!["image".to_string()]);
    }
}
