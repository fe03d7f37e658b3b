//! Sending: an image directory's frames, its bytes spread over the session's streams (part of
//! [`super`]).

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::answers::confirmation;
use super::error::{on_stream, SendError, WireError};
use super::handoff::send_abort;
use super::later::{LaterPiece, LaterSender};
use super::mac::{pieces_digest, FrameMac, Piece};
use super::session::{
    read_frame, send_frame, sender_handshake_streams, write_frame, Base, Connection, DirHeader,
    FileHeader, Frame, FrameError, Patch, SendLane, Session, Totals, CHUNK_BYTES, MAX_STREAMS,
};
use super::written::Written;
use crate::auth::HmacKey;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// What [`send_dir`] sent.
#[derive(Clone, Copy, Debug)]
pub struct SendReport {
    /// Files and bytes of the directory, as the receiver counted them.
    pub totals: Totals,
    /// The files' bytes this end sent after the `Cut` (all of them without one; the rest came
    /// from what was sent ahead): the bytes after each base, and its pieces that changed since.
    pub sent_bytes: u64,
    /// From the handshake to the receiver's `Committed`.
    pub elapsed: Duration,
    /// Of that, after the `Cut`: hashing again the pieces sent ahead that may have changed
    /// ([`DirSender::told`]).
    pub hashing: Duration,
    /// Of that: from `Done` to the receiver's `Committed` (its files synced, its directory
    /// named).
    pub committing: Duration,
}

/// An entry of the directory sent.
#[derive(Debug)]
pub(super) enum Entry {
    Dir(DirHeader),
    File(FileHeader),
    /// The header's `size` bytes of the file `of` (`whole` bytes long; none: it is still
    /// being appended to, and only the bytes sent must be there, [`DirSender::send_growing`])
    /// from `at`, sent as the file the header names ([`DirSender::send_in_parts`]).
    Slice {
        header: FileHeader,
        of: String,
        at: u64,
        whole: Option<u64>,
    },
}

/// `entries` with each file named in `in_parts` replaced by its parts, `NAME.0`, `NAME.1`, ...,
/// of the bytes given (the last shorter).
fn sliced(entries: Vec<Entry>, in_parts: &[(String, u64)]) -> Vec<Entry> {
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        let Entry::File(h) = e else {
            out.push(e);
            continue;
        };
        match in_parts.iter().find(|(p, _)| *p == h.path) {
            Some(&(_, part)) if part > 0 && h.size > 0 => {
                for k in 0..h.size.div_ceil(part) {
                    out.push(Entry::Slice {
                        header: FileHeader {
                            id: 0,
                            path: format!("{}.{k}", h.path),
                            size: (h.size - k * part).min(part),
                            mode: h.mode,
                            base: None,
                        },
                        of: h.path.clone(),
                        at: k * part,
                        whole: Some(h.size),
                    });
                }
            }
            _ => out.push(Entry::File(h)),
        }
    }
    out
}

/// The entries under `root/rel`, sorted, each directory before what it holds. Not `strict` (a
/// directory still being written): what is neither a file nor a directory, or gone meanwhile,
/// is left out.
pub(super) fn list(
    root: &Path,
    rel: &str,
    out: &mut Vec<Entry>,
    strict: bool,
) -> Result<(), SendError> {
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
                id: 0,
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

/// A file sent ahead, as the sender remembers it: its bytes sent so far, as pieces.
#[derive(Debug, Clone)]
pub(super) struct AheadFile {
    path: String,
    size: u64,
    pieces: Vec<Piece>,
}

/// A directory sent in two parts over one session: [`DirSender::send_ahead`] sends what it holds
/// while it is still being written (a migration's pre-copy rounds, the job running), as often as
/// asked: a file sent ahead before goes on from where it ended (its own path as its [`Base`]),
/// sending again only the pieces of it that changed since (its [`Patch`]es); then
/// [`DirSender::finish`] sends `Cut` and the final set: each file that is one sent ahead, or
/// begins with one (the same file, found by its inode, not shorter, each piece sent ahead
/// hashed again here), names it as its base and sends only its changed pieces and the bytes
/// after it, every other file (another file now, or one that shrank) is sent whole. The
/// receiver moves the bases into place, checking its own digest of them and its copies read
/// back, writes the patches over them (each checked against the sender's hash at the cut), and
/// drops what was sent ahead and is not in the final set. Each part's bytes go over every
/// stream of the session at once.
#[derive(Debug)]
pub struct DirSender {
    session: Session,
    /// The session's streams beyond the first connection (which each call is given).
    lanes: Vec<SendLane>,
    /// The files sent ahead, by (device, inode).
    ahead: HashMap<(u64, u64), AheadFile>,
    /// Every path sent ahead: one the receiver has that cannot go on (its file changed, or is
    /// another file now) waits for the final set.
    ahead_paths: HashSet<String>,
    /// Something was sent ahead: the final set follows a `Cut`.
    sent_ahead: bool,
    /// The files the last part sent ahead read, by (device, inode)
    /// ([`DirSender::read_in_last_part`]).
    last_part: HashSet<(u64, u64)>,
    /// What the files' writer said it wrote since the last part ([`DirSender::told`]).
    written: Written,
    /// The files' bytes sent so far, every part and stream ([`DirSender::sent_counter`]).
    sent: Arc<AtomicU64>,
    /// Files of the final set sent in parts ([`DirSender::send_in_parts`]).
    in_parts: Vec<(String, u64)>,
    /// Directories whose files' patches of the final set go after it ([`DirSender::post_copy`]).
    later_under: Vec<String>,
    /// The first part sent ahead goes in slices of this many bytes of each file
    /// ([`DirSender::slice_first_round`]).
    first_slice: Option<u64>,
    /// The final set's first part, sent with the `Cut` ([`DirSender::send_final_under`]).
    first_part: Option<FirstPart>,
}

/// The final set's first part ([`DirSender::send_final_under`]): its directories, its files'
/// lengths by path, and its totals.
#[derive(Debug)]
struct FirstPart {
    under: Vec<String>,
    files: HashMap<String, u64>,
    totals: Totals,
    /// Its pieces left for later (post-copy: [`DirSender::post_copy`]).
    later: Vec<LaterPiece>,
    /// The parts of files still being written sent since ([`DirSender::send_growing`]).
    early: Vec<EarlyPart>,
    /// Their file was written again since ([`DirSender::forget_growing`]): none is claimed,
    /// and none is sent any more.
    early_stale: bool,
}

/// A part of a file still being written, sent after the final set's first part as the file
/// `path` of the final set ([`DirSender::send_growing`]): `size` bytes from `at` of the file
/// whose (device, inode) is `inode`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct EarlyPart {
    path: String,
    inode: (u64, u64),
    at: u64,
    size: u64,
}

impl DirSender {
    /// The handshake, for a session of one stream: `stream`.
    pub fn start<S: Read + Write>(stream: &mut S, key: &HmacKey) -> Result<DirSender, WireError> {
        Self::start_streams(stream, key, 1, |_| unreachable!("a session of one stream"))
    }

    /// The handshake on `stream`, for a session of `streams` streams (at most [`MAX_STREAMS`]):
    /// `stream` and `streams - 1` more connections `open` makes (given the stream's number),
    /// each of which joins the session with a handshake of its own.
    pub fn start_streams<S: Read + Write>(
        stream: &mut S,
        key: &HmacKey,
        streams: u32,
        open: impl FnMut(u32) -> io::Result<Box<dyn Connection>>,
    ) -> Result<DirSender, WireError> {
        let session = sender_handshake_streams(stream, key, streams.clamp(1, MAX_STREAMS))?;
        let lanes = session.open_lanes(open)?;
        Ok(DirSender {
            session,
            lanes,
            ahead: HashMap::new(),
            ahead_paths: HashSet::new(),
            last_part: HashSet::new(),
            sent_ahead: false,
            written: Written::new(),
            sent: Arc::default(),
            in_parts: Vec::new(),
            later_under: Vec::new(),
            first_slice: None,
            first_part: None,
        })
    }

    /// Sends the file at `path` (relative to the directory) of the final set as files of
    /// `part_bytes` each (the last shorter), `PATH.0`, `PATH.1`, ...: the receiver writes them
    /// from every stream at once, where writes into one file are taken one at a time. Whoever
    /// reads the received directory must take the parts for the file (a process's private
    /// memory split out of CRIU's images: `possum_criu::hostmem::read_index`). A file that was
    /// sent ahead (the same inode, under any name) is sent as that file instead, not in parts.
    pub fn send_in_parts(&mut self, path: impl Into<String>, part_bytes: u64) {
        self.in_parts.push((path.into(), part_bytes));
    }

    /// The first [`DirSender::send_ahead`] (nothing sent ahead yet) sends its files in parts,
    /// each of the next `bytes` of every file still longer (the first part: every file's first
    /// `bytes`), so that the receiver has each file's first bytes whole, part by part, long before
    /// the last: a migration's destination loads a large first round into GPU memory as it
    /// comes. The files and bytes sent are the same; each part after the first goes on with the
    /// files as a later round would, nothing changed in them.
    pub fn slice_first_round(&mut self, bytes: u64) {
        self.first_slice = (bytes > 0).then_some(bytes);
    }

    /// Post-copy: the pieces of the files under the directories `dirs` (relative, `/`-separated)
    /// that changed since they were sent ahead are not sent in the final set: its bases name
    /// them as `later` patches, and [`DirSender::finish_post_copy`] hands them back, with the
    /// session's other streams, to be sent once the receiver named the directory
    /// ([`LaterSender`]). Files not sent ahead, and the bytes after a base, go in the final set.
    pub fn post_copy(&mut self, dirs: Vec<String>) {
        self.later_under = dirs;
    }

    /// The files' bytes this session sent so far, every part and every stream counted as each
    /// chunk goes out: for a progress line, read from another thread.
    pub fn sent_counter(&self) -> Arc<AtomicU64> {
        self.sent.clone()
    }

    /// Whether the last part sent ahead read the file `inode`: the pieces its writer's account
    /// named ([`DirSender::told`]) and what it gained, from the file opened as it was listed
    /// (under whatever name it has since).
    pub fn read_in_last_part(&self, inode: (u64, u64)) -> bool {
        self.last_part.contains(&inode)
    }

    /// What the writer of the files sent says it wrote since the last part: the next part
    /// ([`DirSender::send_ahead`] or [`DirSender::finish`]) reads again, of the files sent ahead
    /// that it names, only the pieces those ranges meet; the other files' pieces, all of them.
    /// A wrong account costs no wrong image only where the files' contents are checked after
    /// (a checkpoint image's chunk fingerprints, at its restore).
    pub fn told(&mut self, written: Written) {
        self.written = written;
    }

    /// Sends the regular files and directories under `dir` as they are now (what is neither, or
    /// goes away meanwhile, left out; a file that grows, only the bytes it had when listed): a
    /// round ahead of the final set, before [`DirSender::finish`], as many as wanted. A file sent
    /// in an earlier round goes on from where it ended (only what it gained is sent, and its
    /// pieces that changed since, rewritten in place); one that shrank or is another file now
    /// waits for the final set. The files and the bytes sent (of files whose first bytes went
    /// in an earlier round, only what they gained and their changed pieces).
    pub fn send_ahead<S: Read + Write>(
        &mut self,
        stream: &mut S,
        dir: &Path,
    ) -> Result<Totals, WireError> {
        let first = !self.sent_ahead;
        self.sent_ahead = true;
        let sent = (|| {
            let mut entries = Vec::new();
            list(dir, "", &mut entries, false)?;
            let written = std::mem::take(&mut self.written);
            match self.first_slice.filter(|_| first) {
                Some(slice) => self.ahead_in_slices(stream, dir, entries, written, slice),
                None => {
                    let sent = self.ahead_part(stream, dir, entries, (&written, true))?;
                    Ok(Totals {
                        files: sent.totals.files,
                        bytes: sent.bytes,
                    })
                }
            }
        })();
        sent.map_err(|e| self.failed(stream, e))
    }

    /// A round ahead ([`DirSender::send_ahead`]) of only the regular files `files` (relative
    /// to `dir`) and the directories above them, each as it is now (one not there, left out):
    /// for files being written while the job is held, before the `Cut`, each time the writer's
    /// account ([`DirSender::told`]) names what it completed (a migration's GPU images while
    /// its final copy runs). The pieces the account names are sent without being compared with
    /// what was sent ahead: the writer wrote them again. Before the first round of the whole
    /// directory too (a migration's first pre-copy round, sent as it is copied): a file not
    /// sent yet goes whole, as it is now, and that round is then not sent in slices
    /// ([`DirSender::slice_first_round`]). Not after the `Cut`.
    pub fn send_ahead_only<S: Read + Write>(
        &mut self,
        stream: &mut S,
        dir: &Path,
        files: &[String],
    ) -> Result<Totals, WireError> {
        self.send_ahead_upto(stream, dir, files, &HashMap::new())
    }

    /// [`DirSender::send_ahead_only`], each file named in `upto` only as far as it says (a file
    /// its writer fills out of order and makes longer than it fills, past whose end the bytes
    /// may not be written yet: the keeper's spare). A file shorter than that goes as it is.
    pub fn send_ahead_upto<S: Read + Write>(
        &mut self,
        stream: &mut S,
        dir: &Path,
        files: &[String],
        upto: &HashMap<String, u64>,
    ) -> Result<Totals, WireError> {
        let sent = (|| {
            if self.first_part.is_some() {
                return Err(SendError::OutOfOrder {
                    what: "a round of some files after the cut",
                });
            }
            self.sent_ahead = true;
            let mut all = Vec::new();
            list(dir, "", &mut all, false)?;
            let above = |d: &str| files.iter().any(|f| f.starts_with(&format!("{d}/")));
            let entries: Vec<Entry> = (all.into_iter())
                .filter(|e| match e {
                    Entry::File(h) => files.contains(&h.path),
                    Entry::Dir(d) => above(&d.path),
                    Entry::Slice { .. } => false,
                })
                .map(|e| match e {
                    Entry::File(h) => Entry::File(FileHeader {
                        size: upto.get(&h.path).map_or(h.size, |&u| h.size.min(u)),
                        ..h
                    }),
                    other => other,
                })
                .collect();
            let written = std::mem::take(&mut self.written);
            let sent = self.ahead_part(stream, dir, entries, (&written, false))?;
            Ok(Totals {
                files: sent.totals.files,
                bytes: sent.bytes,
            })
        })();
        sent.map_err(|e| self.failed(stream, e))
    }

    /// The `Cut`, and the first part of the final set, while the rest of `dir` is still being
    /// written: the directories `under` (relative to `dir`, each there) and what they hold,
    /// complete by now and not to change (a migration's GPU images, sent while CRIU dumps the
    /// held job). Each file that is, or begins with, one sent ahead (by its inode, under any
    /// name) names it as its base, as in [`DirSender::finish`], the pieces the writer's
    /// account ([`DirSender::told`]) names hashed again. [`DirSender::finish`] then sends the
    /// rest; the files of this part must be there as they were, and no other file under
    /// `under`. Only once, after something was sent ahead. With [`DirSender::post_copy`] its
    /// patches under those directories are left for later, as the rest's are:
    /// [`DirSender::finish_post_copy`] hands them back with the rest's.
    pub fn send_final_under<S: Read + Write>(
        &mut self,
        stream: &mut S,
        dir: &Path,
        under: &[String],
    ) -> Result<Totals, WireError> {
        let sent = (|| {
            if !self.sent_ahead || self.first_part.is_some() {
                return Err(SendError::OutOfOrder {
                    what: "a first part of the final set before any round or after the cut",
                });
            }
            let mut entries = Vec::new();
            for u in under {
                let at = dir.join(u);
                let meta = fs::symlink_metadata(&at).map_err(|source| SendError::List {
                    path: at.clone(),
                    source,
                })?;
                entries.push(Entry::Dir(DirHeader {
                    path: u.clone(),
                    mode: meta.permissions().mode() & 0o777,
                }));
                list(dir, u, &mut entries, true)?;
            }
            self.cut(stream)?;
            let written = std::mem::take(&mut self.written);
            let mut bases = bases(dir, &entries, self.ahead.clone(), (&written, true));
            for (inode, _) in bases.values() {
                self.ahead.remove(inode);
            }
            let later = leave_for_later(&mut bases, &self.later_under);
            let mut files = HashMap::new();
            for e in &entries {
                if let Entry::File(h) = e {
                    files.insert(h.path.clone(), h.size);
                }
            }
            let sent = self.send_part(stream, dir, entries, Sending::Final(bases))?;
            self.first_part = Some(FirstPart {
                under: under.to_vec(),
                files,
                totals: sent.totals,
                later,
                early: Vec::new(),
                early_stale: false,
            });
            Ok(Totals {
                files: sent.totals.files,
                bytes: sent.bytes,
            })
        })();
        sent.map_err(|e| self.failed(stream, e))
    }

    /// After the final set's first part ([`DirSender::send_final_under`]), while the rest is
    /// still being written: the parts `NAME.0`, `NAME.1`, ... of `part_bytes` each of the file
    /// `file` (relative to `dir`) that it already holds whole and that were not sent yet, at most
    /// `most` of them, as files of the final set. For a file only ever appended to (CRIU's pages
    /// file while it dumps) that the final set then sends in parts as `NAME`
    /// ([`DirSender::send_in_parts`]: the same file, renamed). There, each part whose bytes went
    /// here (the same file by its inode, the same offset and length) is not sent again; a part
    /// sent here that the final set does not have so (the file was not renamed `NAME`, or parts
    /// of another file went under those names) is removed at the receiver. The files and bytes
    /// sent; none when `file` is not there. `whole`: how much of it is written whole where that
    /// is not its size (a file filled by several writers at once), else `None`.
    pub fn send_growing<S: Read + Write>(
        &mut self,
        stream: &mut S,
        dir: &Path,
        (file, name): (&str, &str),
        whole: Option<u64>,
        part_bytes: u64,
        most: usize,
    ) -> Result<Totals, WireError> {
        let sent = (|| {
            let Some(first) = self.first_part.as_ref().filter(|_| part_bytes > 0) else {
                return Err(SendError::OutOfOrder {
                    what: "a part of a file still being written before the final set's first part",
                });
            };
            let path = dir.join(file);
            let meta = match fs::symlink_metadata(&path) {
                Ok(m) if m.file_type().is_file() => m,
                Ok(_) => {
                    return Err(SendError::Unsupported {
                        path,
                        what: "not a regular file",
                    })
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Totals::default()),
                Err(source) => return Err(SendError::List { path, source }),
            };
            if first.early_stale {
                return Ok(Totals::default());
            }
            let inode = (meta.dev(), meta.ino());
            let mut entries = Vec::new();
            let mut parts = Vec::new();
            let len = whole.map_or(meta.len(), |w| w.min(meta.len()));
            for k in 0..len / part_bytes {
                if entries.len() >= most {
                    break;
                }
                let part = EarlyPart {
                    path: format!("{name}.{k}"),
                    inode,
                    at: k * part_bytes,
                    size: part_bytes,
                };
                if first.early.iter().any(|e| e.path == part.path) {
                    continue;
                }
                entries.push(Entry::Slice {
                    header: FileHeader {
                        id: 0,
                        path: part.path.clone(),
                        size: part.size,
                        mode: meta.permissions().mode() & 0o777,
                        base: None,
                    },
                    of: file.to_string(),
                    at: part.at,
                    whole: None,
                });
                parts.push(part);
            }
            if entries.is_empty() {
                return Ok(Totals::default());
            }
            let sent = self.send_part(stream, dir, entries, Sending::Final(HashMap::new()))?;
            let first = self.first_part.as_mut().expect("checked above");
            first.early.extend(parts);
            first.totals.files += sent.totals.files;
            first.totals.bytes += sent.totals.bytes;
            Ok(sent.totals)
        })();
        sent.map_err(|e| self.failed(stream, e))
    }

    /// The parts sent by [`DirSender::send_growing`] so far are stale (their file was written
    /// again from its start): the final set claims none of them, and the receiver removes them.
    pub fn forget_growing(&mut self) {
        if let Some(first) = &mut self.first_part {
            first.early_stale = true;
        }
    }

    /// The final set's `entries` (in parts) less the parts sent early that they are
    /// ([`DirSender::send_growing`]); those that they are not are told to the receiver to
    /// remove (`Remove`), and leave the first part's totals.
    fn claim_early<S: Write>(
        &mut self,
        stream: &mut S,
        dir: &Path,
        entries: Vec<Entry>,
    ) -> Result<Vec<Entry>, SendError> {
        let Some(first) = self.first_part.as_mut().filter(|f| !f.early.is_empty()) else {
            return Ok(entries);
        };
        let mut inodes: HashMap<String, Option<(u64, u64)>> = HashMap::new();
        let mut claimed = HashSet::new();
        let mut rest = Vec::with_capacity(entries.len());
        for e in entries {
            // (Stale parts are claimed by none.)
            if let (false, Entry::Slice { header, of, at, .. }) = (first.early_stale, &e) {
                let inode = *inodes.entry(of.clone()).or_insert_with(|| {
                    fs::symlink_metadata(dir.join(of))
                        .ok()
                        .map(|m| (m.dev(), m.ino()))
                });
                let sent = first.early.iter().position(|p| {
                    p.path == header.path
                        && Some(p.inode) == inode
                        && p.at == *at
                        && p.size == header.size
                });
                if let Some(k) = sent {
                    claimed.insert(k);
                    continue;
                }
            }
            rest.push(e);
        }
        let early = std::mem::take(&mut first.early);
        for (k, part) in early.into_iter().enumerate() {
            if claimed.contains(&k) {
                continue;
            }
            first.totals.files -= 1;
            first.totals.bytes -= part.size;
            write_frame(
                stream,
                &mut self.session,
                &Frame::Remove { path: part.path },
            )?;
        }
        Ok(rest)
    }

    /// Sends `Cut`, out at once: the receiver reads its copies back while this end hashes its
    /// files.
    fn cut<S: Write>(&mut self, stream: &mut S) -> Result<(), SendError> {
        write_frame(stream, &mut self.session, &Frame::Cut)?;
        stream.flush().map_err(|source| {
            FrameError::Io {
                what: "sending",
                source,
            }
            .into()
        })
    }

    /// The final set's `entries` less what its first part sent ([`DirSender::send_final_under`]),
    /// each of whose files must be listed as it was sent; a file under its directories that it
    /// did not send is refused.
    fn after_first_part(&self, entries: Vec<Entry>) -> Result<Vec<Entry>, SendError> {
        let Some(first) = &self.first_part else {
            return Ok(entries);
        };
        let within = |p: &str| {
            (first.under.iter()).any(|u| {
                p == u
                    || p.strip_prefix(u.as_str())
                        .is_some_and(|r| r.starts_with('/'))
            })
        };
        let mut seen = HashSet::new();
        let mut rest = Vec::with_capacity(entries.len());
        for e in entries {
            match &e {
                Entry::Dir(h) if within(&h.path) => {}
                Entry::File(h) if within(&h.path) => {
                    if first.files.get(&h.path) != Some(&h.size) {
                        return Err(SendError::ChangedSinceFirstPart {
                            path: h.path.clone(),
                        });
                    }
                    seen.insert(h.path.as_str().to_owned());
                }
                _ => rest.push(e),
            }
        }
        if let Some(gone) = first.files.keys().find(|p| !seen.contains(*p)) {
            return Err(SendError::ChangedSinceFirstPart { path: gone.clone() });
        }
        Ok(rest)
    }

    /// A part sent ahead: `entries` of `dir`, those sent ahead before going on from where they
    /// ended, their pieces `written` names read again.
    fn ahead_part<S: Write>(
        &mut self,
        stream: &mut S,
        dir: &Path,
        entries: Vec<Entry>,
        (written, compare): (&Written, bool),
    ) -> Result<Sent, SendError> {
        let continued = bases(dir, &entries, self.ahead.clone(), (written, compare));
        let mut known = std::mem::take(&mut self.ahead);
        let mut paths = std::mem::take(&mut self.ahead_paths);
        let sent = self.send_part(
            stream,
            dir,
            entries,
            Sending::Ahead {
                known: &mut known,
                paths: &mut paths,
                continued,
            },
        );
        self.ahead = known;
        self.ahead_paths = paths;
        sent
    }

    /// The first round's `entries` (as listed) in parts of `slice` bytes of each file
    /// ([`DirSender::slice_first_round`]), the first part with the writer's account `written`.
    fn ahead_in_slices<S: Write>(
        &mut self,
        stream: &mut S,
        dir: &Path,
        entries: Vec<Entry>,
        mut written: Written,
        slice: u64,
    ) -> Result<Totals, SendError> {
        let sizes = || {
            entries.iter().filter_map(|e| match e {
                Entry::File(h) => Some(h.size),
                Entry::Dir(_) | Entry::Slice { .. } => None,
            })
        };
        let longest = sizes().max().unwrap_or(0);
        let mut totals = Totals {
            files: sizes().count() as u64,
            bytes: 0,
        };
        let mut upto = 0u64;
        loop {
            let from = upto;
            upto = upto.saturating_add(slice);
            let part: Vec<Entry> = (entries.iter())
                .filter_map(|e| match e {
                    Entry::Dir(d) => Some(Entry::Dir(d.clone())),
                    Entry::File(h) if from == 0 || h.size > from => Some(Entry::File(FileHeader {
                        size: h.size.min(upto),
                        ..h.clone()
                    })),
                    Entry::File(_) | Entry::Slice { .. } => None,
                })
                .collect();
            let sent = self.ahead_part(stream, dir, part, (&written, true))?;
            totals.bytes += sent.bytes;
            if upto >= longest {
                return Ok(totals);
            }
            // Between the parts nothing is written: every file sent goes on unchanged.
            written = Written::new();
            for inode in self.ahead.keys() {
                written.add(*inode, []);
            }
        }
    }

    /// Sends the directory `dir` (the final set) and `Done`; returns once the receiver has named
    /// it, complete, with the session for an exchange after the transfer.
    pub fn finish<S: Read + Write>(
        self,
        stream: &mut S,
        dir: &Path,
    ) -> Result<(SendReport, Session), WireError> {
        self.finish_post_copy(stream, dir)
            .map(|(report, session, _)| (report, session))
    }

    /// [`DirSender::finish`], and with [`DirSender::post_copy`], the pieces left for after it
    /// with the streams to send them on (none when no piece was left).
    pub fn finish_post_copy<S: Read + Write>(
        mut self,
        stream: &mut S,
        dir: &Path,
    ) -> Result<(SendReport, Session, Option<LaterSender>), WireError> {
        let start = Instant::now();
        let mut later = Vec::new();
        let mut hashing = Duration::ZERO;
        let sent = (|| {
            let mut entries = Vec::new();
            list(dir, "", &mut entries, true)?;
            let entries = self.after_first_part(entries)?;
            let entries = sliced(entries, &self.in_parts_not_ahead(dir));
            let entries = self.claim_early(stream, dir, entries)?;
            // The `Cut` before the final set (its first part sent it, if there was one), also
            // when nothing went ahead: the receiver then takes every part as the final set's
            // and reads none of its copies back, a check only a base sent ahead needs.
            if self.first_part.is_none() {
                self.cut(stream)?;
            }
            let mode = if self.sent_ahead {
                let (ahead, written) = (
                    std::mem::take(&mut self.ahead),
                    std::mem::take(&mut self.written),
                );
                let t = Instant::now();
                let mut bases = bases(dir, &entries, ahead, (&written, true));
                hashing = t.elapsed();
                later = leave_for_later(&mut bases, &self.later_under);
                // (With the first part's, in the same order.)
                if let Some(first) = self.first_part.as_mut() {
                    later.append(&mut first.later);
                    later.sort();
                }
                Sending::Final(bases)
            } else {
                Sending::Plain
            };
            let mut sent = self.send_part(stream, dir, entries, mode)?;
            if let Some(first) = &self.first_part {
                sent.totals.files += first.totals.files;
                sent.totals.bytes += first.totals.bytes;
            }
            write_frame(stream, &mut self.session, &Frame::Done(sent.totals))?;
            stream.flush().map_err(|source| FrameError::Io {
                what: "sending",
                source,
            })?;
            Ok(sent)
        })();
        let sent = sent.map_err(|e| self.failed(stream, e))?;
        // The transfer is over: the other streams end, unless pieces go on them after it.
        let lanes = std::mem::take(&mut self.lanes);
        let later = (!later.is_empty()).then(|| LaterSender::new(lanes, later));
        let t = Instant::now();
        let totals = confirmation(stream, &mut self.session, &sent.totals)?;
        let report = SendReport {
            totals,
            sent_bytes: sent.bytes,
            elapsed: start.elapsed(),
            hashing,
            committing: t.elapsed(),
        };
        Ok((report, self.session, later))
    }

    /// The files asked in parts ([`DirSender::send_in_parts`]) that were not sent ahead: one
    /// that was (the same inode under `dir`) goes as that file, only what changed of it and its
    /// later bytes, which parts, new files, would send whole.
    fn in_parts_not_ahead(&self, dir: &Path) -> Vec<(String, u64)> {
        (self.in_parts.iter())
            .filter(|(path, _)| {
                fs::symlink_metadata(dir.join(path))
                    .map_or(true, |m| !self.ahead.contains_key(&(m.dev(), m.ino())))
            })
            .cloned()
            .collect()
    }

    /// Before the `Cut`, once what is to go ahead went: waits, as `wait` says, for the receiver's
    /// side to load into GPU memory the GPU images sent ahead (`LoadQuery`, `Loaded`), so that
    /// a migration holds its job only once the destination has what it can load ahead. What
    /// the receiver last said.
    pub fn await_loaded<S: Read + Write>(
        &mut self,
        stream: &mut S,
        wait: super::LoadWait,
    ) -> Result<super::LoadedAhead, WireError> {
        let asked = match self.first_part {
            Some(_) => Err(SendError::OutOfOrder {
                what: "a question of what was loaded ahead after the cut",
            }),
            None => super::answers::await_loaded(stream, &mut self.session, wait),
        };
        asked.map_err(|e| self.failed(stream, e))
    }

    /// Tells the receiver why this end gives up (`Abort`), best effort, and ends the streams.
    pub fn abort<S: Write>(&mut self, stream: &mut S, reason: &str) {
        self.lanes.clear();
        send_abort(stream, &mut self.session, reason);
    }

    /// A send that failed after the handshake: the other streams end, and the receiver is told
    /// why (`Abort`) unless the first stream failed, where the receiver's own reason is read if
    /// it sent one (as it is after a failure on another stream).
    fn failed<S: Read + Write>(&mut self, stream: &mut S, e: SendError) -> WireError {
        // Closed: the receiver's reads of them end.
        self.lanes.clear();
        let session = &mut self.session;
        let theirs = |stream: &mut S, session: &mut Session, e: SendError| {
            let mut buf = Vec::new();
            match read_frame(stream, session, &mut buf) {
                Ok(Frame::Abort { reason }) => SendError::Rejected { reason }.into(),
                _ => e.into(),
            }
        };
        match e {
            e @ SendError::Frame(FrameError::Io { .. }) => theirs(stream, session, e),
            e @ SendError::Frame(_) => e.into(),
            e => {
                send_abort(stream, session, &possum_cuda::error_chain(&e));
                match e {
                    e @ SendError::Stream { .. } => theirs(stream, session, e),
                    e => e.into(),
                }
            }
        }
    }

    /// Sends one part: the headers of `entries` (under `dir`) on `stream`, then their bytes over
    /// every stream, each ending its share with `EndPart`.
    fn send_part<S: Write>(
        &mut self,
        stream: &mut S,
        dir: &Path,
        entries: Vec<Entry>,
        mut mode: Sending<'_>,
    ) -> Result<Sent, SendError> {
        let files = headers(stream, &mut self.session, dir, entries, &mut mode)?;
        write_frame(stream, &mut self.session, &Frame::Chunks)?;
        spread(
            stream,
            &mut self.session.send,
            &mut self.lanes,
            &files,
            &self.sent,
        )?;
        let ahead = matches!(mode, Sending::Ahead { .. });
        if ahead {
            self.last_part = files.iter().map(|f| f.inode).collect();
        }
        let mut sent = Sent {
            totals: Totals::default(),
            bytes: 0,
        };
        for f in files {
            // Ahead of the cut a file may grow (its first bytes were sent); the final set may
            // not change while it is sent.
            let read = |source| SendError::Read {
                path: f.path.clone(),
                source,
            };
            // (Not a file still being appended to: only its bytes sent must be there.)
            if let (false, Some(whole)) = (ahead, f.whole) {
                if f.file.metadata().map_err(read)?.len() != whole {
                    return Err(SendError::Changed {
                        path: f.path,
                        listed: f.size,
                    });
                }
            }
            if let (Sending::Ahead { known, .. }, Some(pieces)) = (&mut mode, f.pieces) {
                // Those of earlier rounds first: a piece sent again replaces its earlier self.
                let pieces: BTreeMap<u64, Piece> = (pieces.into_inner())
                    .unwrap_or_else(PoisonError::into_inner)
                    .into_iter()
                    .map(|p| (p.offset, p))
                    .collect();
                let pieces = pieces.into_values().collect();
                let (path, size) = (f.rel, f.size);
                known.insert(f.inode, AheadFile { path, size, pieces });
            }
            sent.totals.files += 1;
            sent.totals.bytes += f.size;
            sent.bytes += f.bytes;
        }
        Ok(sent)
    }
}

/// Which part of a transfer [`DirSender::send_part`] sends.
pub(super) enum Sending<'m> {
    /// The whole directory, once.
    Plain,
    /// Ahead of the cut: each file's pieces are remembered in `known`; a file sent ahead before
    /// goes on from where it ended if it is in `continued` (the same file, not shorter:
    /// [`bases`]), its changed pieces sent again, and is left for the final set if not.
    Ahead {
        known: &'m mut HashMap<(u64, u64), AheadFile>,
        paths: &'m mut HashSet<String>,
        continued: HashMap<String, ((u64, u64), Base)>,
    },
    /// After the cut: the files that begin with one sent ahead ([`bases`]), by path, with their
    /// (device, inode) when checked; each names its base, and its changed pieces.
    Final(HashMap<String, ((u64, u64), Base)>),
}

/// What [`DirSender::send_part`] sent.
pub(super) struct Sent {
    /// The files and their whole lengths.
    totals: Totals,
    /// The bytes sent of them (less than their lengths where a base holds the rest).
    bytes: u64,
}

/// A file of the part being sent: its `sends` go out as chunks (its patches, then its bytes
/// from where its base ends to `size`).
struct Outgoing {
    rel: String,
    path: PathBuf,
    file: fs::File,
    inode: (u64, u64),
    size: u64,
    /// Where its bytes begin in `file` (a part of a file sent in parts; else 0), and `file`'s
    /// length as listed (none: it is still being appended to).
    at: u64,
    whole: Option<u64>,
    /// Its pieces to send, in order.
    sends: Vec<ToSend>,
    /// Their bytes.
    bytes: u64,
    /// Ahead of the cut: its pieces as sent (those of earlier rounds first).
    pieces: Option<Mutex<Vec<Piece>>>,
}

/// A piece of a file to send as one chunk.
#[derive(Clone, Copy)]
struct ToSend {
    offset: u64,
    len: u64,
    /// A patch of the final set: the BLAKE3 its bytes had at the cut, which they must still have.
    hash: Option<[u8; 32]>,
}

/// The chunks of a file: its `patches`, then its bytes from `from` to `size` in pieces of at
/// most [`CHUNK_BYTES`].
fn sends(patches: &[Patch], from: u64, size: u64) -> Vec<ToSend> {
    let mut v: Vec<ToSend> = patches
        .iter()
        .filter(|p| !p.later)
        .map(|p| ToSend {
            offset: p.offset,
            len: p.len,
            hash: p.hash.as_deref().and_then(unhex),
        })
        .collect();
    let mut at = from;
    while at < size {
        let len = (size - at).min(CHUNK_BYTES as u64);
        v.push(ToSend {
            offset: at,
            len,
            hash: None,
        });
        at += len;
    }
    v
}

/// Sends the `Dir` and `File` frames of `entries` (under `dir`), each file numbered in the
/// part, and opens the files whose bytes follow.
fn headers<S: Write>(
    stream: &mut S,
    session: &mut Session,
    dir: &Path,
    entries: Vec<Entry>,
    mode: &mut Sending<'_>,
) -> Result<Vec<Outgoing>, SendError> {
    let ahead = matches!(mode, Sending::Ahead { .. });
    let mut files = Vec::new();
    for entry in entries {
        let (mut h, of, at, whole) = match entry {
            Entry::Dir(h) => {
                write_frame(stream, session, &Frame::Dir(h))?;
                continue;
            }
            Entry::File(h) => {
                let (of, size) = (h.path.clone(), h.size);
                (h, of, 0, Some(size))
            }
            Entry::Slice {
                header,
                of,
                at,
                whole,
            } => (header, of, at, whole),
        };
        let path = dir.join(&of);
        let read = |source| SendError::Read {
            path: path.clone(),
            source,
        };
        let opened = fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path);
        let file = match opened {
            Ok(f) => f,
            // Ahead of the cut, a file may go away between its listing and its read.
            Err(e) if ahead && e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(read(e)),
        };
        let meta = file.metadata().map_err(read)?;
        let inode = (meta.dev(), meta.ino());
        let mut from = 0u64;
        let mut prior = ahead.then(Vec::new);
        match mode {
            Sending::Final(bases) => {
                // Checked against the file as listed: the same file (inode) still.
                if let Some((_, base)) = bases.remove(&h.path).filter(|(at, _)| *at == inode) {
                    from = base.size;
                    h.base = Some(base);
                }
            }
            Sending::Ahead {
                known,
                paths,
                continued,
            } => {
                let before = known.get(&inode).filter(|b| b.path == h.path);
                // Sent before: it goes on from there, still the same file under the same path
                // and not shorter, its pieces changed since sent again; else (a path the
                // receiver has: another file now, or one that shrank) it waits for the final
                // set. `bases` made the base of the file sent ahead under this inode: `before`.
                match (before, continued.remove(&h.path)) {
                    (Some(before), Some((at, mut base))) if at == inode => {
                        // Nothing gained or changed since: nothing to send this round.
                        if base.size == h.size && base.patches.is_empty() {
                            continue;
                        }
                        // Ahead of the cut the file may change again while it is sent: its
                        // pieces are remembered as sent, not as hashed.
                        for p in &mut base.patches {
                            p.hash = None;
                        }
                        from = base.size;
                        prior = Some(before.pieces.clone());
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
        h.id = files.len() as u64;
        let (rel, size) = (h.path.clone(), h.size);
        let patches = h.base.as_ref().map_or(&[][..], |b| &b.patches[..]);
        let sends = sends(patches, from, size);
        write_frame(stream, session, &Frame::File(h))?;
        files.push(Outgoing {
            rel,
            path,
            file,
            inode,
            size,
            at,
            whole,
            bytes: sends.iter().map(|s| s.len).sum(),
            sends,
            pieces: prior.map(Mutex::new),
        });
    }
    Ok(files)
}

/// Sends the bytes of `files` as chunks over `stream` (under `mac`) and `lanes` at once, each
/// stream taking the next piece as it is ready, then each stream's `EndPart`. The pieces are
/// taken from the files in turn (the first piece of each, then the second, ...): the streams
/// then write different files at the receiver at once, where writes into one file are taken
/// one at a time.
fn spread<S: Write>(
    stream: &mut S,
    mac: &mut FrameMac,
    lanes: &mut [SendLane],
    files: &[Outgoing],
    sent: &AtomicU64,
) -> Result<(), SendError> {
    let pieces = interleaved(files);
    let share = Share {
        files,
        pieces: &pieces,
        next: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        sent,
    };
    let (mine, theirs) = std::thread::scope(|scope| {
        let handles: Vec<_> = lanes
            .iter_mut()
            .map(|lane| {
                let share = &share;
                scope.spawn(move || share.send(&mut lane.conn, &mut lane.mac))
            })
            .collect();
        let mine = share.send(stream, mac);
        let theirs: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect();
        (mine, theirs)
    });
    // A stream's own failure before a write that failed because the receiver gave up; of
    // those, the first stream's, after which the receiver's reason is read there.
    let errors: Vec<SendError> = std::iter::once(mine.err())
        .chain(
            theirs
                .into_iter()
                .zip(1u32..)
                .map(|(r, index)| r.err().map(|e| on_stream(e, index))),
        )
        .flatten()
        .collect();
    let failed_write = |e: &SendError| {
        matches!(
            e,
            SendError::Frame(FrameError::Io { .. })
                | SendError::Stream {
                    source: FrameError::Io { .. },
                    ..
                }
        )
    };
    let first = errors.iter().position(|e| !failed_write(e)).unwrap_or(0);
    match errors.into_iter().nth(first) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The pieces of `files` (file, and its piece to send), the files' in turn.
fn interleaved(files: &[Outgoing]) -> Vec<(usize, ToSend)> {
    let most = files.iter().map(|f| f.sends.len()).max().unwrap_or(0);
    (0..most)
        .flat_map(|k| {
            files
                .iter()
                .enumerate()
                .filter_map(move |(i, f)| f.sends.get(k).map(|s| (i, *s)))
        })
        .collect()
}

/// The pieces of a part, which the streams take one at a time.
struct Share<'a> {
    files: &'a [Outgoing],
    pieces: &'a [(usize, ToSend)],
    next: AtomicUsize,
    /// A stream failed: the others stop at their next piece.
    stop: AtomicBool,
    /// The bytes of chunks sent, every stream.
    sent: &'a AtomicU64,
}

impl Share<'_> {
    /// Sends pieces on `w` under `mac` until none is left, then `EndPart`; stops early (without
    /// `EndPart`) once another stream failed.
    fn send<W: Write + ?Sized>(&self, w: &mut W, mac: &mut FrameMac) -> Result<(), SendError> {
        let sent = self.pieces_on(w, mac).and_then(|share| {
            let Some((chunks, bytes)) = share else {
                return Ok(());
            };
            send_frame(w, mac, &Frame::EndPart { chunks, bytes }, None)?;
            w.flush().map_err(|source| FrameError::Io {
                what: "sending",
                source,
            })?;
            Ok(())
        });
        if sent.is_err() {
            self.stop.store(true, Ordering::Relaxed);
        }
        sent
    }

    fn pieces_on<W: Write + ?Sized>(
        &self,
        w: &mut W,
        mac: &mut FrameMac,
    ) -> Result<Option<(u64, u64)>, SendError> {
        let mut buf = vec![0u8; CHUNK_BYTES];
        let (mut chunks, mut bytes) = (0u64, 0u64);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(None);
            }
            let Some(&(i, piece)) = self.pieces.get(self.next.fetch_add(1, Ordering::Relaxed))
            else {
                return Ok(Some((chunks, bytes)));
            };
            // A patch of the final set: the hash its bytes had at the cut.
            let ToSend {
                offset,
                len,
                hash: at_cut,
            } = piece;
            let f = &self.files[i];
            let data = &mut buf[..len as usize];
            f.file
                .read_exact_at(data, f.at + offset)
                .map_err(|e| match e.kind() {
                    io::ErrorKind::UnexpectedEof => SendError::Changed {
                        path: f.path.clone(),
                        listed: f.size,
                    },
                    _ => SendError::Read {
                        path: f.path.clone(),
                        source: e,
                    },
                })?;
            let hash = blake3::hash(data);
            if at_cut.is_some_and(|h| blake3::Hash::from_bytes(h) != hash) {
                return Err(SendError::Rechanged {
                    path: f.path.clone(),
                    offset,
                    len,
                });
            }
            if let Some(pieces) = &f.pieces {
                let piece = Piece {
                    offset,
                    len,
                    hash: *hash.as_bytes(),
                    crc: None,
                };
                pieces
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(piece);
            }
            let chunk = Frame::Chunk {
                file: i as u64,
                offset,
                data,
            };
            send_frame(w, mac, &chunk, Some(hash))?;
            self.sent.fetch_add(len, Ordering::Relaxed);
            chunks += 1;
            bytes += len;
        }
    }
}

/// Marks `later` the patches of the bases of files under `dirs` (post-copy), and lists them.
fn leave_for_later(
    bases: &mut HashMap<String, ((u64, u64), Base)>,
    dirs: &[String],
) -> Vec<LaterPiece> {
    let under = |path: &str| {
        dirs.iter().any(|d| {
            path.strip_prefix(d.trim_end_matches('/'))
                .is_some_and(|rest| rest.starts_with('/'))
        })
    };
    let mut later = Vec::new();
    for (path, (_, base)) in bases.iter_mut().filter(|(path, _)| under(path)) {
        for p in &mut base.patches {
            let Some(hash) = p.hash.as_deref().and_then(unhex) else {
                continue;
            };
            p.later = true;
            later.push(LaterPiece {
                path: path.clone(),
                offset: p.offset,
                len: p.len,
                hash,
            });
        }
    }
    later.sort();
    later
}

/// The files of `entries` (under `dir`) that are, or begin with, a file sent ahead (the same
/// file: its device and inode; not shorter than it was sent), with the pieces of it that
/// changed since: each piece sent ahead that may have changed (`written`) hashed again, the
/// pieces of all the files in parallel (at most 8 workers), a changed one a [`Patch`] carrying
/// its hash now; without `compare`, each such piece a [`Patch`] without reading it (the writer
/// says it changed). A file that cannot be read there is no base (it is then sent whole, or
/// fails its send).
pub(super) fn bases(
    dir: &Path,
    entries: &[Entry],
    mut ahead: HashMap<(u64, u64), AheadFile>,
    (written, compare): (&Written, bool),
) -> HashMap<String, ((u64, u64), Base)> {
    let candidates: Vec<(&str, (u64, u64), AheadFile, fs::File)> = entries
        .iter()
        .filter_map(|e| match e {
            Entry::File(h) => Some(h),
            Entry::Dir(_) | Entry::Slice { .. } => None,
        })
        .filter_map(|h| {
            let file = fs::OpenOptions::new()
                .read(true)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(dir.join(&h.path))
                .ok()?;
            let m = file.metadata().ok()?;
            let inode = (m.dev(), m.ino());
            let a = ahead.remove(&inode).filter(|a| a.size <= h.size)?;
            Some((h.path.as_str(), inode, a, file))
        })
        .collect();
    let work: Vec<(usize, Piece)> = candidates
        .iter()
        .enumerate()
        .flat_map(|(c, (_, inode, a, _))| {
            (a.pieces.iter())
                .filter(|p| written.may_have_changed(*inode, p.offset, p.len))
                .map(move |p| (c, *p))
        })
        .collect();
    let readable: Vec<AtomicBool> = candidates.iter().map(|_| AtomicBool::new(true)).collect();
    let changed: Vec<Mutex<Vec<Patch>>> = candidates.iter().map(|_| Mutex::default()).collect();
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8)
        .min(work.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                let mut buf = vec![0u8; CHUNK_BYTES];
                while let Some(&(c, p)) = work.get(next.fetch_add(1, Ordering::Relaxed)) {
                    if !readable[c].load(Ordering::Relaxed) {
                        continue;
                    }
                    // (Told changed, without `compare`: sent, not read and compared first.)
                    let hash = if compare {
                        let data = &mut buf[..p.len as usize];
                        if candidates[c].3.read_exact_at(data, p.offset).is_err() {
                            readable[c].store(false, Ordering::Relaxed);
                            continue;
                        }
                        let now = blake3::hash(data);
                        if now == blake3::Hash::from_bytes(p.hash) {
                            continue;
                        }
                        Some(now.to_hex().to_string())
                    } else {
                        None
                    };
                    let patch = Patch {
                        offset: p.offset,
                        len: p.len,
                        hash,
                        later: false,
                    };
                    changed[c]
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(patch);
                }
            });
        }
    });
    candidates
        .into_iter()
        .zip(readable)
        .zip(changed)
        .filter(|((_, readable), _)| readable.load(Ordering::Relaxed))
        .map(|(((path, inode, a, _), _), changed)| {
            let mut patches = changed.into_inner().unwrap_or_else(PoisonError::into_inner);
            patches.sort_by_key(|p| p.offset);
            let base = Base {
                digest: pieces_digest(&a.pieces),
                path: a.path,
                size: a.size,
                patches,
            };
            (path.to_string(), (inode, base))
        })
        .collect()
}

/// `bytes` in lowercase hex.
pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The 32 bytes written in hex by `s` (64 digits, either case), if it is that.
pub(super) fn unhex(s: &str) -> Option<[u8; 32]> {
    blake3::Hash::from_hex(s).ok().map(|h| *h.as_bytes())
}
