//! Post-copy: the pieces of a final set left for after the transfer (part of [`super`]).
//!
//! A sender's [`DirSender::post_copy`](super::DirSender::post_copy) names directories (a
//! migration's GPU images) whose files' pieces that changed since they were sent ahead are not
//! sent in the final set: its bases name them `later` patches, and the receiver names the
//! directory without their bytes (their places hold what was sent ahead), holding [`POST_COPY`]
//! (the pieces left, as JSON) until they came. Then [`LaterSender::send`] sends them, in the
//! order asked (a migration's: the order its job's buffers are needed in), on the session's
//! streams but the first, on which the hand-off goes on meanwhile. [`LaterReceiver::receive`]
//! writes each at its place once its bytes hash to what the sender hashed at the cut, tells its
//! caller each that came (a restore's stage waits for them), and removes [`POST_COPY`] once
//! every piece came, each once. A chunk that is not a piece left, or not its bytes, or comes
//! twice, fails the receive, and the directory keeps [`POST_COPY`]: a restore refuses it.

use std::collections::{HashMap, VecDeque};
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::error::{ReceiveError, SendError};
use super::fsio::{components, open_to_write};
use super::mac::FrameMac;
use super::session::{recv_frame, send_frame, Frame, FrameError, RecvLane, SendLane};

/// A received directory whose post-copy pieces have not all come holds this file, the pieces
/// left as a JSON array of [`LaterPiece`]s: a restore refuses it, but the migration's own.
pub const POST_COPY: &str = ".possum-post-copy";

/// A piece of a file left for after the transfer. Both ends number the pieces left in their
/// order (by path, then offset: the fields' order), which `Chunk` and `Demand` frames name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LaterPiece {
    /// The file, relative to the directory sent, `/`-separated.
    pub path: String,
    /// Where the piece begins in it.
    pub offset: u64,
    /// Its length.
    pub len: u64,
    /// The BLAKE3 of its bytes when the sender hashed them at the cut.
    pub hash: [u8; 32],
}

/// What a post-copy moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaterReport {
    /// Pieces.
    pub pieces: u64,
    /// Their bytes.
    pub bytes: u64,
    /// How long it took.
    pub elapsed: Duration,
}

/// The pieces a [`DirSender::finish_post_copy`](super::DirSender::finish_post_copy) left, and
/// the session's streams (but the first) to send them on.
#[derive(Debug)]
pub struct LaterSender {
    lanes: Vec<SendLane>,
    pieces: Vec<LaterPiece>,
}

impl LaterSender {
    pub(super) fn new(lanes: Vec<SendLane>, pieces: Vec<LaterPiece>) -> LaterSender {
        LaterSender { lanes, pieces }
    }

    /// The pieces left, in the order of their files' paths and offsets.
    pub fn pieces(&self) -> &[LaterPiece] {
        &self.pieces
    }

    /// Sends the pieces, read from the directory `dir` (which must still hold them as they
    /// were at the cut): those `urgent` is asked for first, as they are asked, then those
    /// `order` names (indices into [`LaterSender::pieces`]) in its order, the others after;
    /// each stream takes the next piece as it is ready and ends its share with `EndPart`.
    /// `sent` counts the bytes as they go.
    pub fn send(
        self,
        dir: &Path,
        order: &[usize],
        urgent: &Urgent,
        sent: &AtomicU64,
    ) -> Result<LaterReport, SendError> {
        let start = Instant::now();
        let LaterSender { mut lanes, pieces } = self;
        if lanes.is_empty() {
            return Err(SendError::NoLaterStream);
        }
        let order = full_order(order, pieces.len());
        let mut files = HashMap::new();
        for p in &pieces {
            if !files.contains_key(&p.path) {
                let at = dir.join(&p.path);
                let f =
                    fs::File::open(&at).map_err(|source| SendError::Read { path: at, source })?;
                files.insert(p.path.clone(), f);
            }
        }
        let share = LaterShare {
            dir,
            pieces: &pieces,
            files: &files,
            queue: Mutex::new(Queue {
                taken: vec![false; order.len()],
                order,
                next: 0,
            }),
            urgent,
            stop: AtomicBool::new(false),
            sent,
        };
        let results: Vec<Result<(), SendError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (lanes.iter_mut())
                .map(|lane| {
                    let share = &share;
                    scope.spawn(move || share.send(lane))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        });
        for (r, index) in results.into_iter().zip(1u32..) {
            if let Err(e) = r {
                return Err(super::error::on_stream(e, index));
            }
        }
        Ok(LaterReport {
            pieces: pieces.len() as u64,
            bytes: pieces.iter().map(|p| p.len).sum(),
            elapsed: start.elapsed(),
        })
    }
}

/// `order`'s indices below `n`, each once, then the rest in their order.
fn full_order(order: &[usize], n: usize) -> Vec<usize> {
    let mut seen = vec![false; n];
    let mut all = Vec::with_capacity(n);
    for i in order.iter().copied().chain(0..n) {
        if i < n && !seen[i] {
            seen[i] = true;
            all.push(i);
        }
    }
    all
}

/// The pieces of a post-copy asked for now (the destination's `Demand`s), sent before the
/// others: [`LaterSender::send`] takes them as they are asked, from another thread.
#[derive(Debug, Default)]
pub struct Urgent {
    asked: Mutex<VecDeque<usize>>,
    count: AtomicU64,
}

impl Urgent {
    /// Piece `piece` is needed now (one already sent, or not a piece, is passed over).
    pub fn ask(&self, piece: usize) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.asked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(piece);
    }

    /// How many were asked for.
    pub fn asked(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn next(&self) -> Option<usize> {
        self.asked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front()
    }
}

/// The order the pieces go in, and which went.
struct Queue {
    order: Vec<usize>,
    next: usize,
    taken: Vec<bool>,
}

/// The pieces of a post-copy, which the streams take one at a time.
struct LaterShare<'a> {
    dir: &'a Path,
    pieces: &'a [LaterPiece],
    files: &'a HashMap<String, fs::File>,
    queue: Mutex<Queue>,
    urgent: &'a Urgent,
    stop: AtomicBool,
    sent: &'a AtomicU64,
}

impl LaterShare<'_> {
    /// The next piece to send: one asked for, else the next in order; each once.
    fn take(&self) -> Option<usize> {
        let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some(i) = self.urgent.next() {
            if i < q.taken.len() && !q.taken[i] {
                q.taken[i] = true;
                return Some(i);
            }
        }
        while let Some(&i) = q.order.get(q.next) {
            q.next += 1;
            if !q.taken[i] {
                q.taken[i] = true;
                return Some(i);
            }
        }
        None
    }

    fn send(&self, lane: &mut SendLane) -> Result<(), SendError> {
        let r = self.pieces_on(lane);
        if r.is_err() {
            self.stop.store(true, Ordering::Relaxed);
        }
        r
    }

    fn pieces_on(&self, lane: &mut SendLane) -> Result<(), SendError> {
        let mut buf = Vec::new();
        let (mut chunks, mut bytes) = (0u64, 0u64);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            let Some(i) = self.take() else {
                break;
            };
            let p = &self.pieces[i];
            let path = self.dir.join(&p.path);
            buf.resize(p.len as usize, 0);
            self.files[&p.path]
                .read_exact_at(&mut buf, p.offset)
                .map_err(|source| SendError::Read {
                    path: path.clone(),
                    source,
                })?;
            let hash = blake3::hash(&buf);
            if hash != blake3::Hash::from_bytes(p.hash) {
                return Err(SendError::Rechanged {
                    path,
                    offset: p.offset,
                    len: p.len,
                });
            }
            let chunk = Frame::Chunk {
                file: i as u64,
                offset: p.offset,
                data: &buf,
            };
            send_frame(&mut lane.conn, &mut lane.mac, &chunk, Some(hash))?;
            self.sent.fetch_add(p.len, Ordering::Relaxed);
            chunks += 1;
            bytes += p.len;
        }
        send_frame(
            &mut lane.conn,
            &mut lane.mac,
            &Frame::EndPart { chunks, bytes },
            None,
        )?;
        lane.conn.flush().map_err(|source| FrameError::Io {
            what: "sending",
            source,
        })?;
        Ok(())
    }
}

/// The pieces a received directory's final set left for later, and the session's streams (but
/// the first) they come on.
pub struct LaterReceiver {
    lanes: Vec<RecvLane>,
    pieces: Vec<LaterPiece>,
}

impl std::fmt::Debug for LaterReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LaterReceiver({} pieces)", self.pieces.len())
    }
}

impl LaterReceiver {
    pub(super) fn new(lanes: Vec<RecvLane>, pieces: Vec<LaterPiece>) -> LaterReceiver {
        LaterReceiver { lanes, pieces }
    }

    /// The pieces left, in the order of their files' paths and offsets.
    pub fn pieces(&self) -> &[LaterPiece] {
        &self.pieces
    }

    /// Receives the pieces into the directory `dir` (the one named with them left), each
    /// written at its place once its bytes are checked, `arrived` told its index in
    /// [`LaterReceiver::pieces`] once it is written; once all came, [`POST_COPY`] is removed.
    /// Each read waits at most as long as the streams' read timeouts.
    pub fn receive(
        self,
        dir: &Path,
        arrived: &(dyn Fn(usize) + Sync),
    ) -> Result<LaterReport, ReceiveError> {
        let start = Instant::now();
        let LaterReceiver { lanes, pieces } = self;
        if lanes.is_empty() {
            return Err(later("the session has no stream for it".into()));
        }
        let mut files = HashMap::new();
        for p in &pieces {
            if !files.contains_key(&p.path) {
                let parts = components(&p.path)?;
                let at = parts.iter().fold(dir.to_path_buf(), |a, c| a.join(c));
                let f = open_to_write(&at, false).map_err(|source| ReceiveError::Io {
                    what: "opening",
                    path: at,
                    source,
                })?;
                files.insert(p.path.clone(), f);
            }
        }
        let got: Vec<AtomicBool> = pieces.iter().map(|_| AtomicBool::new(false)).collect();
        let into = Landing {
            pieces: &pieces,
            files: &files,
            got: &got,
            arrived,
            stop: AtomicBool::new(false),
        };
        let results: Vec<Result<(), ReceiveError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = lanes
                .into_iter()
                .map(|mut lane| {
                    let into = &into;
                    scope.spawn(move || into.share(&mut lane.conn, &mut lane.mac))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        });
        if let Some(e) = results.into_iter().find_map(Result::err) {
            return Err(e);
        }
        let came = got.iter().filter(|g| g.load(Ordering::Relaxed)).count();
        if came != pieces.len() {
            return Err(later(format!("{came} of its {} pieces came", pieces.len())));
        }
        let marker = dir.join(POST_COPY);
        fs::remove_file(&marker).map_err(|source| ReceiveError::Io {
            what: "removing",
            path: marker,
            source,
        })?;
        Ok(LaterReport {
            pieces: pieces.len() as u64,
            bytes: pieces.iter().map(|p| p.len).sum(),
            elapsed: start.elapsed(),
        })
    }
}

fn later(why: String) -> ReceiveError {
    ReceiveError::Later { why }
}

/// Where a post-copy's chunks go.
struct Landing<'a> {
    pieces: &'a [LaterPiece],
    files: &'a HashMap<String, fs::File>,
    got: &'a [AtomicBool],
    arrived: &'a (dyn Fn(usize) + Sync),
    stop: AtomicBool,
}

impl Landing<'_> {
    fn share(
        &self,
        conn: &mut super::session::Conn,
        mac: &mut FrameMac,
    ) -> Result<(), ReceiveError> {
        let r = self.chunks(conn, mac);
        if r.is_err() {
            self.stop.store(true, Ordering::Relaxed);
        }
        r
    }

    fn chunks(
        &self,
        conn: &mut super::session::Conn,
        mac: &mut FrameMac,
    ) -> Result<(), ReceiveError> {
        let mut buf = Vec::new();
        let (mut chunks, mut bytes) = (0u64, 0u64);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            match recv_frame(conn, mac, &mut buf)? {
                (Frame::Chunk { file, offset, data }, hash) => {
                    let i = usize::try_from(file).unwrap_or(usize::MAX);
                    let p = self.pieces.get(i).ok_or_else(|| {
                        later(format!("a chunk of piece {file}, of {}", self.pieces.len()))
                    })?;
                    if offset != p.offset || data.len() as u64 != p.len {
                        return Err(later(format!(
                            "{}: a chunk of {} bytes at {offset} for the piece of {} at {}",
                            p.path,
                            data.len(),
                            p.len,
                            p.offset
                        )));
                    }
                    if hash != blake3::Hash::from_bytes(p.hash) {
                        return Err(ReceiveError::Patch {
                            path: p.path.clone(),
                            offset,
                            len: p.len,
                        });
                    }
                    if self.got[i].swap(true, Ordering::AcqRel) {
                        return Err(ReceiveError::Overlap {
                            path: p.path.clone(),
                            offset,
                        });
                    }
                    let f = &self.files[&p.path];
                    f.write_all_at(data, offset)
                        .map_err(|source| ReceiveError::Io {
                            what: "writing",
                            path: p.path.clone().into(),
                            source,
                        })?;
                    (self.arrived)(i);
                    chunks += 1;
                    bytes += p.len;
                }
                (
                    Frame::EndPart {
                        chunks: said_chunks,
                        bytes: said_bytes,
                    },
                    _,
                ) => {
                    if (said_chunks, said_bytes) != (chunks, bytes) {
                        return Err(ReceiveError::Share {
                            stream: mac.stream(),
                            said_chunks,
                            said_bytes,
                            chunks,
                            bytes,
                        });
                    }
                    return Ok(());
                }
                (Frame::Abort { reason }, _) => return Err(ReceiveError::Aborted { reason }),
                (other, _) => {
                    return Err(super::handoff::unexpected(
                        other.name(),
                        "among post-copy chunks",
                    ))
                }
            }
        }
    }
}

/// The pieces `dir` (a received directory) still waits for, if it holds [`POST_COPY`]: `None`
/// if it does not, an error naming the file if it cannot be read.
pub fn post_copy_left(dir: &Path) -> Result<Option<Vec<LaterPiece>>, String> {
    let at = dir.join(POST_COPY);
    match fs::read(&at) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("{}: {e}", at.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", at.display())),
    }
}

/// Writes [`POST_COPY`] into `root` (a directory being received), listing `pieces`.
pub(super) fn mark_post_copy(root: &Path, pieces: &[LaterPiece]) -> Result<(), ReceiveError> {
    let at = root.join(POST_COPY);
    let json = serde_json::to_vec(pieces).expect("pieces serialise");
    fs::write(&at, json).map_err(|source| ReceiveError::Io {
        what: "creating",
        path: at,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_order_asked_comes_first_and_every_piece_once() {
        assert_eq!(full_order(&[3, 1, 3, 9], 5), vec![3, 1, 0, 2, 4]);
        assert_eq!(full_order(&[], 3), vec![0, 1, 2]);
    }
}
