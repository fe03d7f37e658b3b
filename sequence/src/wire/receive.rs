//! Receiving: the frames of a transfer into an image directory (part of [`super`]).

use super::*;

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

/// The file being received.
#[derive(Debug)]
pub(super) struct Current {
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
pub(super) fn receive_into<S: Read>(
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
