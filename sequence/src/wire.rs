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

mod handoff;
mod precopy;
mod receive;
mod send;
pub use handoff::*;
pub use precopy::*;
pub use receive::*;
pub use send::*;

#[cfg(test)]
mod tests;
