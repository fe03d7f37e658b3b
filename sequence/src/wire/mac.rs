//! The wire's keys and the MAC of every frame (part of [`super`]): BLAKE3 in keyed mode.
//!
//! ```text
//! wire key     derive_key("possum 2026-12 migration wire v2: ...", key file)
//! session key  keyed(wire key, "possum-wire-v2/session" ‖ rn ‖ sn ‖ streams)
//! session id   keyed(session key, "possum-wire-v2/id")[..16]           (public: joins name it)
//! frame key    keyed(session key, "possum-wire-v2/frames" ‖ stream ‖ way)
//! frame MAC    keyed(frame key, seq ‖ kind ‖ length ‖ head ‖ BLAKE3(body))
//! ```
//!
//! Each connection of a session (`stream`, 0 the first) has a key each way (`way`: 0 towards the
//! receiver, 1 towards the sender), and each way numbers its frames from 0 (`seq`): a frame
//! changed, dropped, replayed, reordered or moved to another connection or session fails its
//! MAC. A frame's payload is its head (its fields) and its body (a chunk's bytes, empty for
//! most kinds): the body is hashed once, and that hash is what a file sent ahead is compared by
//! ([`Piece`]).

/// A frame's header: kind, payload length.
pub(super) const HEADER_BYTES: usize = 9;
/// A key's, a nonce's and a tag's length (bytes).
pub(super) const KEY_BYTES: usize = 32;
/// A frame MAC's length (bytes).
pub const TAG_BYTES: usize = 32;
const FRAMES_LABEL: &[u8] = b"possum-wire-v2/frames";
const ID_LABEL: &[u8] = b"possum-wire-v2/id";
/// How far from the frame due a failed MAC is looked for among the others, to name the fault.
const LOOK_AROUND: u64 = 4096;

/// The keyed BLAKE3 of `parts`, one after the other.
pub(super) fn keyed(key: &[u8; KEY_BYTES], parts: &[&[u8]]) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(key);
    for p in parts {
        h.update(p);
    }
    h.finalize()
}

/// The public name of the session whose key is `key`.
pub(super) fn session_id(key: &[u8; KEY_BYTES]) -> [u8; 16] {
    let mut id = [0u8; 16];
    id.copy_from_slice(&keyed(key, &[ID_LABEL]).as_bytes()[..16]);
    id
}

/// Which way a frame goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Way {
    /// From the sender to the receiver.
    ToReceiver = 0,
    /// From the receiver to the sender.
    ToSender = 1,
}

/// One way of one connection of a session: its key, and the number of its next frame.
pub struct FrameMac {
    key: [u8; KEY_BYTES],
    stream: u32,
    next: u64,
}

impl std::fmt::Debug for FrameMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FrameMac(stream {}, next {})", self.stream, self.next)
    }
}

/// Why a frame failed its MAC, as far as the frames around it tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Misfit {
    /// It carries no MAC of this stream: changed in transit, or not this session's.
    Changed,
    /// It carries the MAC of an earlier frame of this stream: that frame again.
    Replayed {
        /// The frame it repeats.
        of: u64,
    },
    /// It carries the MAC of a later frame: the frames before it were dropped, or came in
    /// another order.
    Early {
        /// The frame it is.
        is: u64,
    },
}

impl std::fmt::Display for Misfit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Misfit::Changed => f.write_str(
                "does not carry this session's MAC: it was changed in transit, or is not this \
                 session's",
            ),
            Misfit::Replayed { of } => write!(f, "is frame {of} of the stream again: a replay"),
            Misfit::Early { is } => write!(
                f,
                "is frame {is} of the stream: frames before it were dropped or reordered"
            ),
        }
    }
}

impl FrameMac {
    /// The frames of connection `stream` of the session whose key is `key`, going `way`.
    pub(super) fn new(key: &[u8; KEY_BYTES], stream: u32, way: Way) -> FrameMac {
        let k = keyed(key, &[FRAMES_LABEL, &stream.to_le_bytes(), &[way as u8]]);
        FrameMac {
            key: *k.as_bytes(),
            stream,
            next: 0,
        }
    }

    /// The connection of the session these frames go on (0 the first).
    pub(super) fn stream(&self) -> u32 {
        self.stream
    }

    /// The number of the next frame.
    pub(super) fn next(&self) -> u64 {
        self.next
    }

    fn at(
        &self,
        seq: u64,
        header: &[u8; HEADER_BYTES],
        head: &[u8],
        body: &blake3::Hash,
    ) -> blake3::Hash {
        keyed(
            &self.key,
            &[&seq.to_le_bytes(), header, head, body.as_bytes()],
        )
    }

    /// The MAC of the next frame, which it becomes.
    pub(super) fn seal(
        &mut self,
        header: &[u8; HEADER_BYTES],
        head: &[u8],
        body: &blake3::Hash,
    ) -> [u8; TAG_BYTES] {
        let tag = self.at(self.next, header, head, body);
        self.next += 1;
        *tag.as_bytes()
    }

    /// Checks `tag` as the next frame's MAC (in constant time), and counts the frame; if it is
    /// not, says what it is instead.
    pub(super) fn check(
        &mut self,
        header: &[u8; HEADER_BYTES],
        head: &[u8],
        body: &blake3::Hash,
        tag: &[u8; TAG_BYTES],
    ) -> Result<(), Misfit> {
        // blake3::Hash compares in constant time.
        if self.at(self.next, header, head, body) == blake3::Hash::from_bytes(*tag) {
            self.next += 1;
            return Ok(());
        }
        let due = self.next;
        let from = due.saturating_sub(LOOK_AROUND);
        let found = (from..due + LOOK_AROUND)
            .filter(|s| *s != due)
            .find(|s| self.at(*s, header, head, body) == blake3::Hash::from_bytes(*tag));
        Err(match found {
            Some(of) if of < due => Misfit::Replayed { of },
            Some(is) => Misfit::Early { is },
            None => Misfit::Changed,
        })
    }
}

/// A piece of a file as it was sent: where, how long, and the BLAKE3 of its bytes (the body
/// hash of its frame).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Piece {
    pub offset: u64,
    pub len: u64,
    pub hash: [u8; 32],
    /// The receiver's: the CRC32C of the bytes it received, which its read-back of the copy
    /// compares (a check for a change by accident, at several times the hash's speed); `None`
    /// on the sender's side, and for a piece of the final set (never read back).
    pub crc: Option<u32>,
}

/// The digest of a file's bytes as they were sent, from its pieces in order: what a file of
/// the final set names its base by ([`super::Base`]), lowercase hex.
pub(super) fn pieces_digest(pieces: &[Piece]) -> String {
    let mut h = blake3::Hasher::new();
    for p in pieces {
        h.update(&p.offset.to_le_bytes());
        h.update(&p.len.to_le_bytes());
        h.update(&p.hash);
    }
    h.finalize().to_hex().to_string()
}
