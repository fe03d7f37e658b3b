//! Moving a directory between hosts: how a checkpoint image travels from the host a job runs on
//! to the host it is restored on (`possum migrate PID --to HOST:PORT` sends, `possum receive
//! --listen ADDR:PORT -D DIR` receives), over one connection or several (`--streams N`).
//!
//! ```text
//! sender ([`send_dir`], [`DirSender`])                 receiver ([`receive_dir`], [`accept_handshake`])
//!                  ◀── hello: magic, version, receiver nonce rn (32 bytes)
//!   proof: magic, version, sender nonce sn, session 0, stream 0, streams N,
//!          MAC(wire key, "client" ‖ rn ‖ sn ‖ 0 ‖ 0 ‖ N) ──▶
//!                  ◀── MAC(wire key, "server" ‖ sn ‖ rn ‖ 0 ‖ 0 ‖ N)
//!   streams 1..N-1, each a connection of its own:
//!                  ◀── hello: magic, version, rn'
//!   proof: magic, version, sn', session id, stream k, N, MAC(session key, "join" ‖ ...) ──▶
//!                  ◀── MAC(session key, "joined" ‖ ...)
//!   per part (a round sent ahead, or the final set), on stream 0:
//!     Dir.., File.. (each file numbered in its part), Chunks ──▶
//!   then on every stream at once: Chunk.. (file, offset, bytes), EndPart ──▶  pwritten in place
//!   (between parts ahead, a migration before its cut) LoadQuery ──▶
//!                  ◀── Loaded: the bytes sent ahead loaded into GPU memory, and still loading
//!   (parts ahead of the final set, then) Cut; the final set's part; Done ──▶
//!                  ◀── Committed (DEST named) or Abort (why not)
//!   (post-copy) on every stream but the first: Chunk.. (the pieces left), EndPart ──▶
//!   (a migration) Released: the source's job is gone ──▶
//!                  ◀── Outcome: restored and held at the destination, or why not
//!   Released again: go ──▶
//!                  ◀── Outcome: running at the destination, or why not
//!                  ◀── (post-copy) Demand.., then Outcome: synced, or Abort
//! ```
//!
//! **Handshake** (step [`HandshakeError`]): both ends hold the same secret ([`HmacKey`], a file of
//! at least 32 bytes), from which each derives the wire key (BLAKE3's `derive_key` under a
//! context of the wire's own), and each proves it holds it to the other on fresh nonces from
//! `/dev/urandom`, the tags compared in constant time. The receiver writes nothing after its
//! hello to a sender that fails its proof; the sender sends no file to a receiver that fails
//! its own. Both then hold a [`Session`], whose key is of this session alone ([`mac`]'s doc
//! draws the keys). A session of N streams has N connections: the first makes the session,
//! each other joins it with a proof under the session's key, naming the session's public id
//! and its stream number; the receiver ([`Sessions`]) refuses a connection that names a session
//! it does not have open, proves no key of it, names a stream the session does not have or has
//! already, and waits a bounded time for the streams to join.
//!
//! **Frames** (step [`FrameError`]): a 9-byte header, `kind: u8`, `length: u64` (little endian),
//! then `length` bytes of payload, then the frame's 32-byte MAC: keyed BLAKE3 under a key of its
//! stream and way, of its number on that stream and way, its header, its head and the BLAKE3 of
//! its body ([`mac`]). A frame is acted on only once its MAC is checked: one changed, dropped,
//! replayed, reordered or moved to another stream or session is refused, the error naming the
//! frame, its stream and what it turned out to be. A frame longer than [`MAX_FRAME`] is
//! refused before anything is read of it. The kinds ([`Frame`]):
//! - `Dir` and `File`: a JSON object `{"path": "a/b", "mode": 420}` (and `"id"`, the file's number
//!   in its part from 0, and `"size"` for a file), the path relative, `/`-separated, UTF-8, with no
//!   empty, `.` or `..` component; a file may name a `"base"`, `{"path", "size", "digest"}`: a
//!   file sent ahead that holds its first `size` bytes, its chunks then beginning there (before
//!   the `Cut`, in a later round ahead, only the file itself: it goes on). A base may have
//!   `"patches"`, `[{"offset", "len", "hash"}]`: pieces of it as it was sent ahead whose bytes
//!   changed since (the file rewritten in place), each sent again as one chunk at its offset and
//!   written over the base; after the `Cut` each carries `"hash"`, the BLAKE3 of its bytes when
//!   the sender hashed them at the cut (hex), which the chunk's body must hash to (ahead of the
//!   cut, none: the file may change while it is sent, and the chunk's body hash is kept);
//! - `Chunks`: empty; the headers of the part end, its chunks follow on every stream;
//! - `Chunk`: the file's number and the offset in it (`u64` LE each), then the bytes (the body),
//!   at most [`CHUNK_BYTES`] of them; the receiver writes them at their offset, so the streams
//!   need no order between them (a patch's chunk, on any stream, is exactly that patch);
//! - `EndPart`: `chunks: u64`, `bytes: u64` (LE): this stream's share of the part is over. Once
//!   every stream's has come, each file of the part must hold exactly its bytes, each once (its
//!   base's patches, each once, and every byte after its base);
//! - `Cut` (a transfer in two parts, [`DirSender`]): empty; the files before it were sent ahead
//!   (a migration's pre-copy rounds, the job running), the final set follows. A transfer with
//!   nothing sent ahead begins with it, so that none of its parts is read back. The receiver sets
//!   aside what came before, with the digest of each file (the BLAKE3 of its pieces' offsets,
//!   lengths and body hashes, in order); a file (of a later round, or of the final set) takes a
//!   base from there only if its length and digest are those received, each base once, and its
//!   patches are pieces of it, each once. The receiver reads back its copies of each part sent
//!   ahead once the part is written (on threads of its own, before the next part is written),
//!   and at the `Cut` again those whose length, inode or times changed since: a file of the
//!   final set takes a base only once every piece of the copy hashes to what was received for
//!   it, then each patch's bytes must be those the sender hashed at the cut, so that the file
//!   assembled is the sender's at the cut, piece by piece. The sender hashes again at the cut
//!   the pieces sent ahead that may have changed: all of them, or those the files' writer says
//!   it wrote in ([`DirSender::told`]). What is left aside is
//!   removed. A base's pieces received again replace the earlier in its digest (a later round's
//!   patches). `Done`'s totals are the final set's, whole files counted;
//! - `Done` and `Committed`: `files: u64`, `bytes: u64` (LE), the totals sent and received;
//! - `Abort`: why, as UTF-8 text;
//! - `Released` (a migration's, after `Committed`): empty: the source's job is gone, restore it.
//!   Sent again after `Outcome` `Restored`: let it run;
//! - `Outcome` (the answer to `Released`): `status: u8` (0 the restore failed, 1 the job runs,
//!   2 restored but held until the source says go, 3 after 1: the image it was restored from is
//!   synced to disk), the restored `pid: i32` (LE), then why the restore failed, as UTF-8 text
//!   (empty otherwise).
//! - `Demand` (post-copy, from the destination once the job runs there, before its last
//!   `Outcome`): `piece: u64` (LE), the number of a piece left for later (its place in the final
//!   set's list of them, by path and offset): send it next ([`later`] draws post-copy; a patch
//!   marked `"later"` in the final set is one of them, its bytes not in the part).
//! - `LoadQuery` (between parts sent ahead, before the `Cut`): empty; answered at once with
//!   `Loaded`, `loaded: u64`, `left: u64` (LE): the bytes of the GPU images sent ahead that the
//!   receiver's side has loaded into GPU memory, and those it is still loading (0: no more will
//!   be, or nothing is loaded ahead). A migration's source asks before it holds the job
//!   ([`DirSender::await_loaded`]).
//! - `Buffer` and `BufferChunk` (a pre-copy's, on one stream, in place of the parts:
//!   [`PrecopySender`], [`receive_precopy`]): an engine buffer declared, `id`, `va`, `size` (`u64`
//!   LE) and its prefetch rank (`u32` LE); and bytes of a declared buffer, its `id` and the offset
//!   in it (`u64` LE each) then at most [`CHUNK_BYTES`] bytes. A buffer comes again in each round
//!   that found it written; its later bytes replace the earlier. `Done` and `Committed` then
//!   count `Buffer` frames as files and chunk bytes as bytes.
//!
//! Invariants of a receive:
//! - Nothing is written outside DEST's temporary sibling, which [`receive_dir`] creates itself
//!   (mode 0700, never through a symbolic link) and fills only with directories and regular files
//!   it creates (modes limited to `0o777`).
//! - DEST appears only complete: every frame's MAC checked, every file exactly its bytes (each
//!   base read back as received, each patch as the sender hashed it at the cut), each
//!   stream's share of each part ended, `Done`'s totals those received, the files and
//!   directories fsynced, then the temporary directory renamed to DEST (which must not exist,
//!   and is not replaced if it appears meanwhile). On any error, on any stream, the temporary
//!   directory is removed and DEST is not created. Received to be synced later
//!   ([`Durability::Later`], a migration's), DEST holds [`UNSYNCED`], synced before anything
//!   else, until [`make_durable`] synced the rest.
//! - The sender's [`send_dir`] succeeds only when the receiver said `Committed` with its totals
//!   under the session's MAC: a migration may drop the source job only then.
//!
//! The streams are not encrypted: whoever can read the network can read the image. Every read
//! blocks at most as long as the stream lets it: set a read timeout (a [`TcpStream`] with
//! [`set_timeouts`]) before calling these.

mod answers;
mod copies;
mod error;
mod fsio;
mod handoff;
mod later;
mod mac;
mod pace;
mod precopy;
mod receive;
mod send;
mod session;
mod streams;
mod written;
pub use answers::{LoadWait, LoadWaitEnd, LoadedAhead};
pub use error::{ReceiveError, SendError, WireError};
pub use handoff::*;
pub use later::*;
pub use mac::{Misfit, TAG_BYTES};
pub use pace::*;
pub use precopy::*;
pub use receive::*;
pub use send::*;
pub use session::*;
pub use written::Written;

#[cfg(test)]
mod tests;
