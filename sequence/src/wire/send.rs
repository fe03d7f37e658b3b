//! Sending: an image directory's frames (part of [`super`]).

use super::*;

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
pub(super) enum Entry {
    Dir(DirHeader),
    File(FileHeader),
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
pub(super) struct AheadFile {
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
pub(super) fn failed<S: Read + Write>(stream: &mut S, e: SendError) -> WireError {
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
pub(super) enum Sending<'m> {
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
pub(super) struct Sent {
    /// The files and their whole lengths.
    totals: Totals,
    /// The bytes sent of them (less than their lengths where a base holds the rest).
    bytes: u64,
}

/// Sends the frames of `entries`, under `dir`.
pub(super) fn send_files<S: Write>(
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
pub(super) fn bases(
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
pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Reads into `buf` until it is full or the file ends; how much was read.
pub(super) fn read_full(f: &mut fs::File, buf: &mut [u8]) -> io::Result<usize> {
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
pub(super) fn confirmation<S: Read>(
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
