//! Receiving: the frames of a transfer into an image directory (part of [`super`]).

use super::copies::CopyCheck;
use super::mapped::Mapped;
use super::streams::RecvLane;
use super::*;
use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::FileExt;
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
    #[error("writing a pre-copied buffer into the image")]
    Sink(#[source] ImageError),
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

/// The components of a path the sender named; refused unless relative and plain.
pub(super) fn components(path: &str) -> Result<Vec<&str>, ReceiveError> {
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
    patches: HashMap<u64, (u64, Option<[u8; 32]>)>,
    mode: u32,
    /// Ahead of the `Cut`: the pieces of its earlier rounds (which its digest goes on from).
    prior: Option<Vec<Piece>>,
    /// Its pieces received in this part, by offset: each claimed before it is written.
    pieces: Mutex<BTreeMap<u64, Piece>>,
    /// The file mapped, for the streams to write it at once (none: through `pwrite`).
    map: Option<Mapped>,
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
    mut session: Session,
    dest: &Path,
) -> Result<(ReceiveReport, Session), WireError> {
    let start = Instant::now();
    let received = new_dest(dest).and_then(|name| {
        let lanes = session.lanes()?;
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        receive_into(stream, &mut session, lanes, parent, name, dest)
    });
    match received {
        Ok(totals) => {
            // The directory is named: the sender not hearing it changes nothing here.
            let _ = write_frame(stream, &mut session, &Frame::Committed(totals));
            let _ = stream.flush();
            let report = ReceiveReport {
                totals,
                elapsed: start.elapsed(),
            };
            Ok((report, session))
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
pub(super) fn receive_into<S: Read>(
    stream: &mut S,
    session: &mut Session,
    mut lanes: Vec<RecvLane>,
    parent: &Path,
    name: &std::ffi::OsStr,
    dest: &Path,
) -> Result<Totals, ReceiveError> {
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
    // The files of the part whose headers came, by their number in it.
    let mut part: Vec<Incoming> = Vec::new();
    let mut got = Totals::default();
    let mut buf = Vec::new();
    // After a `Cut`: what was sent ahead, moved aside (removed at the end whatever happens), and
    // its files' lengths and pieces by path, each taken out as a later round or the final set
    // names it a base.
    let mut pre: Option<Staging> = None;
    let mut sent_ahead: HashMap<String, (u64, Vec<Piece>)> = HashMap::new();
    // After a `Cut`: the copies of what was sent ahead, read back and checked (dropped first).
    let mut copies: Option<CopyCheck> = None;
    let sent = loop {
        match read_frame(stream, session, &mut buf)? {
            Frame::Dir(h) => {
                let parts = components(&h.path)?;
                let at = ensure_dir(&root, &h.path, &parts)?;
                dirs.push((at, h.mode & 0o777));
            }
            Frame::File(h) => {
                if h.id != part.len() as u64 {
                    return Err(unexpected("File", "out of its part's order"));
                }
                let aside = pre.as_ref().zip(copies.as_ref());
                let incoming = open_file(&root, h, aside, &mut sent_ahead)?;
                part.push(incoming);
            }
            Frame::Chunks => {
                // The final set's headers all came: its bases were all checked.
                if let Some(copies) = &copies {
                    copies.stop();
                }
                receive_part(stream, &mut session.recv, &mut lanes, &part)?;
                for f in part.drain(..) {
                    let (path, size, pieces) = complete(f)?;
                    if let Some(pieces) = pieces {
                        sent_ahead.insert(path, (size, pieces));
                    }
                    got.files += 1;
                    got.bytes += size;
                }
            }
            Frame::Cut => {
                if !part.is_empty() {
                    return Err(unexpected("Cut", "before its part's chunks"));
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
                // Read back while the sender hashes its side.
                copies = Some(CopyCheck::start(&aside.path, &sent_ahead));
                pre = Some(aside);
                dirs.clear();
                got = Totals::default();
            }
            Frame::Done(totals) => {
                if !part.is_empty() {
                    return Err(unexpected("Done", "before its part's chunks"));
                }
                break totals;
            }
            Frame::Abort { reason } => return Err(ReceiveError::Aborted { reason }),
            other => return Err(unexpected(other.name(), "in a directory's transfer")),
        }
    };
    if sent != got {
        return Err(ReceiveError::Totals { sent, got });
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

/// Creates (or, with a base, takes over) the file `h` names under `root`, for its chunks to
/// come. Before the `Cut` (`pre` none) its pieces are kept, for a later base; after it, a base
/// is one of `sent_ahead`, moved into place from `pre` once its copy there is found to hold
/// what was received of it. A base's patches must each be one of its pieces, once; after the
/// `Cut`, each with the hash it must have.
fn open_file(
    root: &Path,
    h: FileHeader,
    pre: Option<(&Staging, &CopyCheck)>,
    sent_ahead: &mut HashMap<String, (u64, Vec<Piece>)>,
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
            let file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(&at)
                .map_err(creating)?;
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
            let places: HashMap<u64, u64> = pieces.iter().map(|p| (p.offset, p.len)).collect();
            for p in &base.patches {
                if places.get(&p.offset) != Some(&p.len) {
                    return Err(refuse("a patch is not a piece of it as it was sent ahead"));
                }
                let hash = match (&p.hash, pre) {
                    (Some(hex), _) => {
                        Some(unhex(hex).ok_or_else(|| refuse("a patch's hash is not BLAKE3's"))?)
                    }
                    (None, Some(_)) => return Err(refuse("a patch after the cut has no hash")),
                    (None, None) => None,
                };
                if patches.insert(p.offset, (p.len, hash)).is_some() {
                    return Err(refuse("two patches of one piece"));
                }
            }
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
            // Written at offsets: not O_APPEND, which would ignore them.
            let file = fs::OpenOptions::new()
                .write(true)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(&at)
                .map_err(creating)?;
            (file, base.size, prior)
        }
    };
    // Its whole length now, so that it can be mapped and its chunks written anywhere.
    file.set_len(h.size).map_err(|source| ReceiveError::Io {
        what: "sizing",
        path: at.clone(),
        source,
    })?;
    let map = Mapped::new(&file, h.size);
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
        map,
    })
}

/// A file whose part's chunks all came: it must hold exactly its bytes, each once; then its mode
/// is set and it is synced. Its path, size and (ahead of the cut) all its pieces.
fn complete(f: Incoming) -> Result<(String, u64, Option<Vec<Piece>>), ReceiveError> {
    // Unmapped first: what follows goes through the file.
    drop(f.map);
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
    f.file.sync_all().map_err(io("syncing"))?;
    // A patch replaces the piece it was sent again for.
    let all = f.prior.map(|prior| {
        let mut all: BTreeMap<u64, Piece> = prior.into_iter().map(|p| (p.offset, p)).collect();
        all.extend(pieces);
        all.into_values().collect()
    });
    Ok((f.path, f.size, all))
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
    claim(f, offset, len, hash)?;
    let written = match &f.map {
        Some(map) => map.write(&f.file, offset, data),
        None => f.file.write_all_at(data, offset),
    };
    written.map_err(|source| ReceiveError::Io {
        what: "writing",
        path: f.at.clone(),
        source,
    })
}

/// Claims the bytes of a chunk of `f` for it (and keeps its piece): refused if another chunk
/// holds any of them. No two writes then touch the same bytes.
fn claim(f: &Incoming, offset: u64, len: u64, hash: blake3::Hash) -> Result<(), ReceiveError> {
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
    };
    pieces.insert(offset, piece);
    Ok(())
}
