//! Receiving: the frames of a transfer into an image directory (part of [`super`]).

use super::copies::AheadChecks;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::error::{ReceiveError, WireError};
pub(super) use super::fsio::{components, open_to_write};
use super::handoff::{send_abort, unexpected};
use super::later::{mark_post_copy, LaterPiece, LaterReceiver};
use super::mac::{pieces_digest, FrameMac, Piece};
use super::send::{hex, unhex};
use super::session::{
    random, read_frame, receiver_handshake, recv_frame, write_frame, DirHeader, FileHeader, Frame,
    FrameError, RecvLane, Session, Totals,
};
use crate::auth::HmacKey;
use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt, PermissionsExt};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

/// What [`receive_dir`] received.
#[derive(Clone, Copy, Debug)]
pub struct ReceiveReport {
    /// Files and bytes.
    pub totals: Totals,
    /// From the handshake to the directory named.
    pub elapsed: Duration,
}

/// The directory being received: removed, with what it holds, unless committed.
#[derive(Debug)]
pub(super) struct Staging {
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
pub(super) fn make_writable(dir: &Path) {
    let _ = fs::set_permissions(dir, fs::Permissions::from_mode(0o700));
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            make_writable(&e.path());
        }
    }
}

/// Creates (or finds) the directory `root/parts..`, each component a directory this receive
/// created, none a link or a file.
pub(super) fn ensure_dir(root: &Path, path: &str, parts: &[&str]) -> Result<PathBuf, ReceiveError> {
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

/// A base's patches sent in a part, by offset: their lengths, and (after the `Cut`) the BLAKE3
/// their bytes must have.
type Patches = HashMap<u64, (u64, Option<[u8; 32]>)>;

/// A file of the part being received: its chunks are written at their offsets, from any
/// stream.
#[derive(Debug)]
pub(super) struct Incoming {
    path: String,
    at: PathBuf,
    file: fs::File,
    size: u64,
    /// Where its bytes sent begin (where its base ends).
    from: u64,
    /// Its base's pieces sent again, by offset: their lengths, and (after the `Cut`) the BLAKE3
    /// their bytes must have.
    patches: Patches,
    mode: u32,
    /// Ahead of the `Cut`: the pieces of its earlier rounds (which its digest goes on from).
    prior: Option<Vec<Piece>>,
    /// Its pieces received in this part, by offset: each claimed before it is written.
    pieces: Mutex<BTreeMap<u64, Piece>>,
}

/// The file a directory received before it was synced holds ([`Durability::Later`]) until
/// [`make_durable`] synced it: an image that still holds it is refused by a restore, had the
/// host stopped meanwhile.
pub const UNSYNCED: &str = ".possum-unsynced";

/// When a received directory's files are synced to disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Before it is named (and `Committed` said).
    Synced,
    /// Later, by [`make_durable`]: it is named unsynced, holding [`UNSYNCED`] (itself synced
    /// first) until then. A migration's: its source keeps its own image until the job runs at
    /// the destination, and syncing the image of its process while the job waits would lengthen
    /// its downtime by as long as the disk takes to write it.
    Later,
}

/// Syncs every file and directory under `dir`, received with [`Durability::Later`], then removes
/// its [`UNSYNCED`] and syncs `dir` again.
pub fn make_durable(dir: &Path) -> io::Result<()> {
    fn sync_tree(at: &Path) -> io::Result<()> {
        for e in fs::read_dir(at)? {
            let e = e?;
            let t = e.file_type()?;
            if t.is_dir() {
                sync_tree(&e.path())?;
            } else if t.is_file() {
                fs::File::open(e.path())?.sync_all()?;
            }
        }
        fs::File::open(at)?.sync_all()
    }
    sync_tree(dir)?;
    if let Err(e) = fs::remove_file(dir.join(UNSYNCED)) {
        if e.kind() != io::ErrorKind::NotFound {
            return Err(e);
        }
    }
    fs::File::open(dir)?.sync_all()
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
pub(super) fn new_dest(dest: &Path) -> Result<&std::ffi::OsStr, ReceiveError> {
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
/// the session a [`receiver_handshake`] or an [`accept_handshake`] agreed on, `stream` its
/// first connection; its other streams, if it has more, are awaited first.
pub fn receive_dir_in_session<S: Read + Write>(
    stream: &mut S,
    session: Session,
    dest: &Path,
) -> Result<(ReceiveReport, Session), WireError> {
    receive_dir_in_session_as(stream, session, dest, Durability::Synced)
}

/// [`receive_dir_in_session`], its files synced as `durability` says.
pub fn receive_dir_in_session_as<S: Read + Write>(
    stream: &mut S,
    session: Session,
    dest: &Path,
    durability: Durability,
) -> Result<(ReceiveReport, Session), WireError> {
    receive_dir_watching(
        stream,
        session,
        dest,
        durability,
        &mut on_parts(|_, _, _| {}),
    )
}

/// What a part brought ([`receive_dir_watching`]'s `ahead`): by each file's path under the
/// directory, the byte ranges its chunks were written at (offset, length), in order, those that
/// follow each other as one.
pub type Brought = std::collections::BTreeMap<String, Vec<(u64, u64)>>;

/// Which part of a transfer is whole ([`receive_dir_watching`]'s `ahead`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// A part sent ahead, while the source's job runs.
    Ahead,
    /// A part of the final set, after the `Cut`: the directory now holds it (what was sent
    /// ahead moved aside), the files its parts brought complete.
    Final,
}

/// What a receive tells of its parts as they come, and asks about what they began
/// ([`receive_dir_watching`]'s `ahead`). [`on_parts`] makes one of a function that loads
/// nothing ahead.
pub trait Watch {
    /// A part is whole in `dir` (see [`receive_dir_watching`]), with what it brought.
    fn part(&mut self, dir: &Path, part: Part, brought: &Brought);
    /// The sender's `LoadQuery` before the `Cut`: the bytes sent ahead loaded into GPU memory
    /// so far, and those still loading (0: no more will be). (0, 0) where nothing is loaded
    /// ahead.
    fn loaded(&mut self) -> (u64, u64) {
        (0, 0)
    }
}

/// A [`Watch`] that tells `f` of each part, and loads nothing ahead.
pub fn on_parts<F: FnMut(&Path, Part, &Brought)>(f: F) -> OnParts<F> {
    OnParts(f)
}

/// [`on_parts`]'s.
pub struct OnParts<F>(F);

impl<F> std::fmt::Debug for OnParts<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnParts")
    }
}

impl<F: FnMut(&Path, Part, &Brought)> Watch for OnParts<F> {
    fn part(&mut self, dir: &Path, part: Part, brought: &Brought) {
        (self.0)(dir, part, brought)
    }
}

/// [`receive_dir_in_session_as`], `ahead` told of the directory where what is sent ahead is
/// received each time a part of it is whole there (its files complete and checked), with what the
/// part brought, while the source's job runs: a migration's destination begins loading the
/// job's GPU images then. The
/// directory is moved at the `Cut` (files opened before stay good); `ahead` is then told of
/// each part of the final set that is whole, in the same directory ([`Part::Final`]).
pub fn receive_dir_watching<S: Read + Write>(
    stream: &mut S,
    session: Session,
    dest: &Path,
    durability: Durability,
    ahead: &mut dyn Watch,
) -> Result<(ReceiveReport, Session), WireError> {
    let (report, session, later) = receive_dir_post_copy(stream, session, dest, durability, ahead)?;
    // Pieces left for later come now: the directory is whole when this returns.
    if let Some(later) = later {
        if let Err(e) = later.receive(dest, &|_| {}) {
            let _ = fs::remove_dir_all(dest);
            return Err(e.into());
        }
        if durability == Durability::Synced {
            make_durable(dest).map_err(|source| ReceiveError::Io {
                what: "syncing",
                path: dest.to_path_buf(),
                source,
            })?;
        }
    }
    Ok((report, session))
}

/// [`receive_dir_watching`], but a final set that left pieces for later (the sender's
/// post-copy) is named without them, holding [`super::POST_COPY`]: the [`LaterReceiver`] then
/// receives them, on the session's other streams, while the first goes on with what follows
/// the transfer.
pub fn receive_dir_post_copy<S: Read + Write>(
    stream: &mut S,
    mut session: Session,
    dest: &Path,
    durability: Durability,
    ahead: &mut dyn Watch,
) -> Result<(ReceiveReport, Session, Option<LaterReceiver>), WireError> {
    let start = Instant::now();
    let mut lanes = Vec::new();
    let received = new_dest(dest).and_then(|name| {
        lanes = session.lanes()?;
        receive_into(
            stream,
            &mut session,
            &mut lanes,
            (name, dest),
            durability,
            ahead,
        )
    });
    match received {
        Ok((totals, later)) => {
            // The directory is named: the sender not hearing it changes nothing here.
            let _ = write_frame(stream, &mut session, &Frame::Committed(totals));
            let _ = stream.flush();
            let report = ReceiveReport {
                totals,
                elapsed: start.elapsed(),
            };
            let later = (!later.is_empty()).then(|| LaterReceiver::new(lanes, later));
            Ok((report, session, later))
        }
        Err(e) => {
            if !consequential(&e) {
                send_abort(stream, &mut session, &possum_cuda::error_chain(&e));
            }
            Err(e.into())
        }
    }
}

/// An error that follows from the sender's (it gave up, or went away): not told back.
fn consequential(e: &ReceiveError) -> bool {
    matches!(
        e,
        ReceiveError::Frame(FrameError::Io { .. } | FrameError::Closed)
            | ReceiveError::Aborted { .. }
    )
}

/// Receives the frames into a temporary sibling of `dest`, then names it `dest`; the totals
/// `Done` said, checked.
pub(super) fn receive_into<S: Read + Write>(
    stream: &mut S,
    session: &mut Session,
    lanes: &mut Vec<RecvLane>,
    (name, dest): (&std::ffi::OsStr, &Path),
    durability: Durability,
    ahead: &mut dyn Watch,
) -> Result<(Totals, Vec<LaterPiece>), ReceiveError> {
    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut r = Receiving::new(parent, name, durability)?;
    let mut buf = Vec::new();
    let sent = loop {
        match read_frame(stream, session, &mut buf)? {
            Frame::Dir(h) => r.dir(&h)?,
            Frame::File(h) => r.file(h)?,
            Frame::Chunks => {
                let brought = r.chunks(stream, &mut session.recv, lanes)?;
                let part = match r.pre {
                    None => Part::Ahead,
                    Some(_) => Part::Final,
                };
                ahead.part(&r.root, part, &brought);
            }
            Frame::LoadQuery if r.pre.is_none() => {
                let (loaded, left) = ahead.loaded();
                write_frame(stream, session, &Frame::Loaded { loaded, left })?;
                stream.flush().map_err(|source| FrameError::Io {
                    what: "sending",
                    source,
                })?;
            }
            Frame::Cut => r.cut()?,
            Frame::Remove { path } => r.remove(&path)?,
            Frame::Done(totals) => {
                if !r.part.is_empty() {
                    return Err(unexpected("Done", "before its part's chunks"));
                }
                // The final set's headers all came (in one part or more): its bases were all
                // checked.
                r.copies.stop();
                break totals;
            }
            Frame::Abort { reason } => return Err(ReceiveError::Aborted { reason }),
            other => return Err(unexpected(other.name(), "in a directory's transfer")),
        }
    };
    if sent != r.got {
        return Err(ReceiveError::Totals { sent, got: r.got });
    }
    r.commit(dest)?;
    Ok((sent, std::mem::take(&mut r.later)))
}

/// A temporary sibling `.NAME.receiving-RANDOMsuffix` of the destination `name` in `parent`,
/// removed unless committed.
fn make_staging(
    parent: &Path,
    name: &std::ffi::OsStr,
    suffix: &str,
) -> Result<Staging, ReceiveError> {
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
    Ok(Staging {
        path,
        committed: false,
    })
}

/// A directory being received, frame by frame. Its fields drop in order: the copies' check
/// first, the staging directory last.
struct Receiving<'a> {
    /// The copies of what was sent ahead, read back and checked.
    copies: AheadChecks,
    /// What was sent ahead, its files' lengths and pieces by path, each taken out as a later
    /// round or the final set names it a base.
    sent_ahead: HashMap<String, (u64, Vec<Piece>)>,
    /// After a `Cut`: what was sent ahead, moved aside (removed at the end whatever happens).
    pre: Option<Staging>,
    /// What came, since the `Cut` if there was one.
    got: Totals,
    /// The files of the part whose headers came, by their number in it.
    part: Vec<Incoming>,
    /// The directories received, with their modes (set at the end).
    dirs: Vec<(PathBuf, u32)>,
    /// The final set's pieces left for later (post-copy).
    later: Vec<LaterPiece>,
    /// Where the frames are written: the staging directory.
    root: PathBuf,
    parent: &'a Path,
    name: &'a std::ffi::OsStr,
    staging: Staging,
    durability: Durability,
}

impl<'a> Receiving<'a> {
    fn new(
        parent: &'a Path,
        name: &'a std::ffi::OsStr,
        durability: Durability,
    ) -> Result<Self, ReceiveError> {
        let staging = make_staging(parent, name, "")?;
        mark_unsynced(&staging.path, durability)?;
        Ok(Receiving {
            copies: AheadChecks::default(),
            sent_ahead: HashMap::new(),
            pre: None,
            got: Totals::default(),
            part: Vec::new(),
            dirs: Vec::new(),
            later: Vec::new(),
            root: staging.path.clone(),
            parent,
            name,
            staging,
            durability,
        })
    }

    /// A `Dir`: made now, its mode set at the end.
    fn dir(&mut self, h: &DirHeader) -> Result<(), ReceiveError> {
        let parts = components(&h.path)?;
        let at = ensure_dir(&self.root, &h.path, &parts)?;
        self.dirs.push((at, h.mode & 0o777));
        Ok(())
    }

    /// A `File`: the next of the part, opened for its chunks.
    fn file(&mut self, h: FileHeader) -> Result<(), ReceiveError> {
        if h.id != self.part.len() as u64 {
            return Err(unexpected("File", "out of its part's order"));
        }
        let aside = self.pre.as_ref().map(|pre| (pre, &self.copies));
        let incoming = open_file(&self.root, h, aside, &mut self.sent_ahead, &mut self.later)?;
        self.part.push(incoming);
        Ok(())
    }

    /// `Chunks`: the part's chunks from every stream, then each of its files completed; what
    /// the part brought.
    fn chunks<S: Read>(
        &mut self,
        stream: &mut S,
        mac: &mut FrameMac,
        lanes: &mut Vec<RecvLane>,
    ) -> Result<Brought, ReceiveError> {
        let ahead = self.pre.is_none();
        if ahead {
            // No check judges a piece while it is written again.
            let rewritten = self.part.iter().map(|f| {
                let offsets: Vec<u64> = f.patches.keys().copied().collect();
                (f.path.as_str(), offsets)
            });
            self.copies.rewriting(rewritten);
        }
        receive_part(stream, mac, lanes, &self.part)?;
        let mut brought = HashMap::new();
        let mut ranges = Brought::new();
        for f in self.part.drain(..) {
            let c = complete(f, self.durability)?;
            if let Some(all) = c.all {
                self.sent_ahead.insert(c.path.clone(), (c.size, all));
            }
            ranges.insert(c.path.clone(), joined(&c.brought));
            if ahead {
                brought.insert(c.path, (c.size, c.brought));
            }
            self.got.files += 1;
            self.got.bytes += c.size;
        }
        if ahead {
            self.copies.part_written(&self.root, &brought);
        }
        Ok(ranges)
    }

    /// The `Cut`: what came so far moves aside; the final set is received where it was.
    fn cut(&mut self) -> Result<(), ReceiveError> {
        if !self.part.is_empty() {
            return Err(unexpected("Cut", "before its part's chunks"));
        }
        if self.pre.is_some() {
            return Err(unexpected("Cut", "after a Cut"));
        }
        let aside = make_staging(self.parent, self.name, ".ahead")?;
        let io = |source: io::Error| ReceiveError::Io {
            what: "setting aside what was sent ahead in",
            path: aside.path.clone(),
            source,
        };
        fs::remove_dir(&aside.path).map_err(io)?;
        let again = self.copies.cut(&self.root, &self.sent_ahead);
        fs::rename(&self.root, &aside.path).map_err(io)?;
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&self.root)
            .map_err(io)?;
        mark_unsynced(&self.root, self.durability)?;
        // Read back again while the sender hashes its side.
        self.copies.moved_to(&aside.path, &again);
        self.pre = Some(aside);
        self.dirs.clear();
        self.got = Totals::default();
        Ok(())
    }

    /// A `Remove`: a file of the final set received since the `Cut` goes, and leaves the
    /// totals. Only between parts, after the `Cut`, of a regular file.
    fn remove(&mut self, path: &str) -> Result<(), ReceiveError> {
        if !self.part.is_empty() {
            return Err(unexpected("Remove", "before its part's chunks"));
        }
        if self.pre.is_none() {
            return Err(unexpected("Remove", "before the Cut"));
        }
        let at = components(path)?
            .iter()
            .fold(self.root.clone(), |p, c| p.join(c));
        let io = |what| {
            let path = at.clone();
            move |source| ReceiveError::Io { what, path, source }
        };
        let meta = fs::symlink_metadata(&at).map_err(io("removing"))?;
        if !meta.file_type().is_file() || self.got.files == 0 || self.got.bytes < meta.len() {
            return Err(unexpected("Remove", "of what is not a file received"));
        }
        fs::remove_file(&at).map_err(io("removing"))?;
        self.got.files -= 1;
        self.got.bytes -= meta.len();
        Ok(())
    }

    /// Every directory's mode set and synced, the staging directory named `dest`.
    fn commit(&mut self, dest: &Path) -> Result<(), ReceiveError> {
        if !self.later.is_empty() {
            self.later.sort();
            mark_post_copy(&self.root, &self.later)?;
        }
        // Deepest first: a directory's mode may take away what its children's need.
        self.dirs.push((self.root.clone(), 0o700));
        self.dirs
            .sort_by_key(|(p, _)| std::cmp::Reverse(p.components().count()));
        for (d, mode) in &self.dirs {
            let io = |what| {
                let path = d.clone();
                move |source| ReceiveError::Io { what, path, source }
            };
            let f = fs::File::open(d).map_err(io("opening"))?;
            if self.durability == Durability::Synced {
                f.sync_all().map_err(io("syncing"))?;
            }
            f.set_permissions(fs::Permissions::from_mode(*mode))
                .map_err(io("setting the mode of"))?;
        }
        // Never replaces: a `dest` that appeared meanwhile stays, and this receive fails.
        rustix::fs::renameat_with(
            rustix::fs::CWD,
            &self.root,
            rustix::fs::CWD,
            dest,
            rustix::fs::RenameFlags::NOREPLACE,
        )
        .map_err(|e| ReceiveError::Io {
            what: "naming the received directory",
            path: dest.to_path_buf(),
            source: e.into(),
        })?;
        self.staging.committed = true;
        if self.durability == Durability::Synced {
            if let Ok(p) = fs::File::open(self.parent) {
                let _ = p.sync_all();
            }
        }
        Ok(())
    }
}

/// The byte ranges of `pieces`, those that follow each other as one.
fn joined(pieces: &[Piece]) -> Vec<(u64, u64)> {
    possum_engine::image::merged_ranges(pieces.iter().map(|p| (p.offset, p.len)).collect())
}

/// With [`Durability::Later`], [`UNSYNCED`] in the new directory `root`, synced with it before
/// anything else is written there: whatever else the disk loses, not this.
fn mark_unsynced(root: &Path, durability: Durability) -> Result<(), ReceiveError> {
    if durability == Durability::Synced {
        return Ok(());
    }
    let at = root.join(UNSYNCED);
    let marked = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&at)
        .and_then(|f| f.sync_all())
        .and_then(|()| fs::File::open(root)?.sync_all());
    marked.map_err(|source| ReceiveError::Io {
        what: "creating",
        path: at,
        source,
    })
}

/// Creates (or, with a base, takes over) the file `h` names under `root`, for its chunks to
/// come. Before the `Cut` (`pre` none) its pieces are kept, for a later base; after it, a base
/// is one of `sent_ahead`, moved into place from `pre` once its copy there is found to hold
/// what was received of it. A base's patches must each be one of its pieces, once; after the
/// `Cut`, each with the hash it must have.
fn open_file(
    root: &Path,
    h: FileHeader,
    pre: Option<(&Staging, &AheadChecks)>,
    sent_ahead: &mut HashMap<String, (u64, Vec<Piece>)>,
    later: &mut Vec<LaterPiece>,
) -> Result<Incoming, ReceiveError> {
    let parts = components(&h.path)?;
    let (last, up) = parts.split_last().expect("a path has a component");
    let at = ensure_dir(root, &h.path, up)?.join(last);
    let creating = |source| ReceiveError::Io {
        what: "creating",
        path: at.clone(),
        source,
    };
    let mut patches = HashMap::new();
    let (file, from, prior) = match &h.base {
        None => {
            // O_EXCL: never through a link, never a file twice.
            let file = open_to_write(&at, true).map_err(creating)?;
            (file, 0, pre.is_none().then(Vec::new))
        }
        Some(base) => {
            let base_parts = components(&base.path)?;
            let refuse = |why| ReceiveError::Ahead {
                path: h.path.clone(),
                base: base.path.clone(),
                why,
            };
            // Each file sent ahead is a base once, of exactly what came.
            let (size, pieces) = sent_ahead
                .remove(&base.path)
                .ok_or_else(|| refuse("it was not sent ahead (or is a base already)"))?;
            if size != base.size || pieces_digest(&pieces) != base.digest {
                return Err(refuse("it is not what was sent ahead"));
            }
            if base.size > h.size {
                return Err(refuse("it is longer than the file"));
            }
            patches = base_patches(&h.path, base, &pieces, pre.is_some(), later).map_err(refuse)?;
            // After the cut the base moves into place; ahead of it a later round goes on with
            // the same file, and its pieces.
            let prior = match pre {
                None if base.path != h.path => {
                    return Err(refuse("ahead of the cut a file goes on only itself"))
                }
                None => Some(pieces),
                Some((pre, copies)) => {
                    copies
                        .wait(&base.path)
                        .map_err(|why| ReceiveError::AheadCopy {
                            path: h.path.clone(),
                            base: base.path.clone(),
                            why: format!("this receiver's copy of it: {why}"),
                        })?;
                    let from = base_parts.iter().fold(pre.path.clone(), |p, c| p.join(c));
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
            let file = open_to_write(&at, false).map_err(creating)?;
            (file, base.size, prior)
        }
    };
    // Its whole length now, its chunks written anywhere in it.
    file.set_len(h.size).map_err(|source| ReceiveError::Io {
        what: "sizing",
        path: at.clone(),
        source,
    })?;
    Ok(Incoming {
        path: h.path,
        at,
        file,
        size: h.size,
        from,
        patches,
        mode: h.mode & 0o777,
        prior,
        pieces: Mutex::new(BTreeMap::new()),
    })
}

/// The patches of `base` (of the file `path`, whose pieces as sent ahead are `pieces`), by
/// offset: their lengths and, after the cut (`cut`), the hashes their bytes must have; those
/// left for later are added to `later` instead. Refused (why) unless each is one of the
/// pieces, once, with a hash after the cut, and none is left for later before it.
fn base_patches(
    path: &str,
    base: &super::session::Base,
    pieces: &[Piece],
    cut: bool,
    later: &mut Vec<LaterPiece>,
) -> Result<Patches, &'static str> {
    let places: HashMap<u64, u64> = pieces.iter().map(|p| (p.offset, p.len)).collect();
    let mut patches = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for p in &base.patches {
        if places.get(&p.offset) != Some(&p.len) {
            return Err("a patch is not a piece of it as it was sent ahead");
        }
        let hash = match &p.hash {
            Some(hex) => Some(unhex(hex).ok_or("a patch's hash is not BLAKE3's")?),
            None if cut => return Err("a patch after the cut has no hash"),
            None => None,
        };
        if !seen.insert(p.offset) {
            return Err("two patches of one piece");
        }
        match (p.later, hash) {
            (false, hash) => {
                patches.insert(p.offset, (p.len, hash));
            }
            (true, Some(hash)) if cut => later.push(LaterPiece {
                path: path.to_string(),
                offset: p.offset,
                len: p.len,
                hash,
            }),
            (true, _) => return Err("a patch left for later before the cut"),
        }
    }
    Ok(patches)
}

/// A file of a part, complete ([`complete`]).
struct Completed {
    path: String,
    size: u64,
    /// Ahead of the cut: all its pieces (those of earlier rounds, less those sent again).
    all: Option<Vec<Piece>>,
    /// The pieces this part brought.
    brought: Vec<Piece>,
}

/// A file whose part's chunks all came: it must hold exactly its bytes, each once; then its mode
/// is set and it is synced (unless later: `durability`).
fn complete(f: Incoming, durability: Durability) -> Result<Completed, ReceiveError> {
    let pieces = f
        .pieces
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    // Below `from` only patches are claimed, each at most once: all came if as many came.
    let patched = pieces.range(..f.from).count();
    if patched != f.patches.len() {
        return Err(ReceiveError::Patches {
            path: f.path,
            patches: f.patches.len(),
            got: patched,
        });
    }
    // Claimed without overlaps: they cover the rest if they follow each other to its end.
    let mut end = f.from;
    for p in pieces.range(f.from..).map(|(_, p)| p) {
        if p.offset != end {
            break;
        }
        end += p.len;
    }
    if end != f.size {
        return Err(ReceiveError::Size {
            path: f.path,
            size: f.size,
            got: end,
        });
    }
    let io = |what| {
        let path = f.at.clone();
        move |source| ReceiveError::Io { what, path, source }
    };
    f.file
        .set_permissions(fs::Permissions::from_mode(f.mode))
        .map_err(io("setting the mode of"))?;
    if durability == Durability::Synced {
        f.file.sync_all().map_err(io("syncing"))?;
    }
    let brought: Vec<Piece> = pieces.values().copied().collect();
    // A patch replaces the piece it was sent again for.
    let all = f.prior.map(|prior| {
        let mut all: BTreeMap<u64, Piece> = prior.into_iter().map(|p| (p.offset, p)).collect();
        all.extend(pieces);
        all.into_values().collect()
    });
    Ok(Completed {
        path: f.path,
        size: f.size,
        all,
        brought,
    })
}

/// Receives the chunks of a part (whose files are `files`) from every stream at once: `stream`
/// (under `mac`) here, each of `lanes` on a thread of its own, until each stream's `EndPart`.
/// A stream that fails stops the others at their next frame and is closed (its sender's writes
/// fail); the error said is the first that did not follow from another.
fn receive_part<S: Read>(
    stream: &mut S,
    mac: &mut FrameMac,
    lanes: &mut Vec<RecvLane>,
    files: &[Incoming],
) -> Result<(), ReceiveError> {
    let stop = AtomicBool::new(false);
    let taken = std::mem::take(lanes);
    let (mine, theirs) = std::thread::scope(|scope| {
        let handles: Vec<_> = taken
            .into_iter()
            .map(|mut lane| {
                let stop = &stop;
                scope.spawn(move || {
                    let r = receive_share(&mut lane.conn, &mut lane.mac, files, stop);
                    // A lane that failed or stopped is dropped: closed.
                    r.map(|done| done.then_some(lane))
                })
            })
            .collect();
        let mine = receive_share(stream, mac, files, &stop);
        let theirs: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect();
        (mine, theirs)
    });
    let mut errors = Vec::new();
    let mine_ok = matches!(mine, Ok(true));
    if let Err(e) = mine {
        errors.push(e);
    }
    for r in theirs {
        match r {
            Ok(Some(lane)) => lanes.push(lane),
            Ok(None) => {}
            Err(e) => errors.push(e),
        }
    }
    let Some(first) = errors.iter().position(|e| !consequential(e)) else {
        let Some(e) = errors.into_iter().next() else {
            return Ok(());
        };
        // Another stream closed: the sender, which closes them all when it gives up, may have
        // said why on the first.
        if mine_ok {
            let mut buf = Vec::new();
            if let Ok((Frame::Abort { reason }, _)) = recv_frame(stream, mac, &mut buf) {
                return Err(ReceiveError::Aborted { reason });
            }
        }
        return Err(e);
    };
    Err(errors.swap_remove(first))
}

/// Receives one stream's share of a part: its chunks written at their offsets into `files`,
/// until its `EndPart` (true), or until another stream failed (false).
fn receive_share<R: Read + ?Sized>(
    conn: &mut R,
    mac: &mut FrameMac,
    files: &[Incoming],
    stop: &AtomicBool,
) -> Result<bool, ReceiveError> {
    let mut buf = Vec::new();
    let (mut chunks, mut bytes) = (0u64, 0u64);
    let failed = |e| {
        stop.store(true, Ordering::Relaxed);
        e
    };
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let (frame, hash) = recv_frame(conn, mac, &mut buf)
            .map_err(ReceiveError::from)
            .map_err(failed)?;
        match frame {
            Frame::Chunk { file, offset, data } => {
                write_chunk(files, file, offset, data, hash).map_err(failed)?;
                chunks += 1;
                bytes += data.len() as u64;
            }
            Frame::EndPart {
                chunks: said_chunks,
                bytes: said_bytes,
            } => {
                if (said_chunks, said_bytes) != (chunks, bytes) {
                    return Err(failed(ReceiveError::Share {
                        stream: mac.stream(),
                        said_chunks,
                        said_bytes,
                        chunks,
                        bytes,
                    }));
                }
                return Ok(true);
            }
            Frame::Abort { reason } => return Err(failed(ReceiveError::Aborted { reason })),
            other => return Err(failed(unexpected(other.name(), "among a part's chunks"))),
        }
    }
}

/// Writes a chunk of file `file` of the part at `offset`, and keeps its piece.
fn write_chunk(
    files: &[Incoming],
    file: u64,
    offset: u64,
    data: &[u8],
    hash: blake3::Hash,
) -> Result<(), ReceiveError> {
    let f = usize::try_from(file)
        .ok()
        .and_then(|i| files.get(i))
        .ok_or(ReceiveError::NoSuchFile {
            file,
            files: files.len(),
        })?;
    let len = data.len() as u64;
    let end = offset.checked_add(len).filter(|end| *end <= f.size);
    let out_of_range = || ReceiveError::OutOfRange {
        path: f.path.clone(),
        offset,
        len,
        from: f.from,
        size: f.size,
    };
    if offset < f.from {
        // A patch: exactly one of the base's pieces, and after the cut the bytes hashed then.
        match f.patches.get(&offset) {
            Some((l, _)) if *l != len => return Err(out_of_range()),
            Some((_, Some(want))) if blake3::Hash::from_bytes(*want) != hash => {
                return Err(ReceiveError::Patch {
                    path: f.path.clone(),
                    offset,
                    len,
                })
            }
            Some(_) => {}
            None => return Err(out_of_range()),
        }
    } else if end.is_none() || len == 0 {
        return Err(out_of_range());
    }
    // Only a piece sent ahead is read back (and needs its CRC32C).
    let crc = f.prior.is_some().then(|| crc32c::crc32c(data));
    claim(f, offset, len, hash, crc)?;
    f.file
        .write_all_at(data, offset)
        .map_err(|source| ReceiveError::Io {
            what: "writing",
            path: f.at.clone(),
            source,
        })
}

/// Claims the bytes of a chunk of `f` for it (and keeps its piece): refused if another chunk
/// holds any of them. No two writes then touch the same bytes.
fn claim(
    f: &Incoming,
    offset: u64,
    len: u64,
    hash: blake3::Hash,
    crc: Option<u32>,
) -> Result<(), ReceiveError> {
    let mut pieces = f.pieces.lock().unwrap_or_else(PoisonError::into_inner);
    let before = pieces.range(..=offset).next_back();
    let after = pieces.range(offset..).next();
    let overlap = before.is_some_and(|(_, p)| p.offset + p.len > offset)
        || after.is_some_and(|(at, _)| *at < offset + len);
    if overlap {
        return Err(ReceiveError::Overlap {
            path: f.path.clone(),
            offset,
        });
    }
    let piece = Piece {
        offset,
        len,
        hash: *hash.as_bytes(),
        crc,
    };
    pieces.insert(offset, piece);
    Ok(())
}
