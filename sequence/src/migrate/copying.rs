//! While the held job's final copy writes its GPU images, or the first pre-copy round does
//! (part of [`super`]): each chunk it has completed, as its journal says (`JournalWrites`, the
//! engine's `JournalRecord`s), goes to the destination in a round ahead of only the files
//! written, before the `Cut` (before the round is over). What such a round
//! read after its chunk was complete, from the file still under its name after the round, is
//! settled, until the journal says it was written again (a chunk the copy took again, its proof
//! by fingerprint having failed): the final set does not read a settled range again. A file
//! that appears under `dir` while the copy runs (the keeper's spare, adopted into the images
//! once the copy borrows it) goes only as far as the journal has named chunks in it: what lies
//! past them may not be written yet.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Duration;

use possum_engine::image::JournalRecord;

use crate::wire::{DirSender, Totals, WireError, Written};

/// A round goes once the chunks completed since the last one hold this many bytes (a part
/// costs a round trip); what is left when the copy is over goes with the final set.
const ROUND_BYTES: u64 = 32 << 20;

/// Chunks completed, by their file's (device, inode): the ranges (offset, length).
type Chunks = HashMap<(u64, u64), Vec<(u64, u64)>>;

/// How often the journal is read while it has nothing new.
const POLL: Duration = Duration::from_millis(2);

/// What the send while the copy runs follows.
pub(super) struct Copying {
    /// The image's temporary directory (what the rounds ahead sent).
    pub(super) dir: PathBuf,
    /// The journal the job's final copy writes.
    pub(super) journal: PathBuf,
    /// The regular files under `dir`, by (device, inode): their paths relative to it. Those
    /// there as the copy began, and those found since where the journal named one not listed
    /// (a file that cannot be found waits for the final set).
    pub(super) files: HashMap<(u64, u64), String>,
    /// Of them, those there as the copy began: the others the copy made, and their bytes past
    /// the end of the last chunk the journal named in them are not sent.
    first: HashSet<(u64, u64)>,
    /// Of each file, the end of the furthest chunk the journal named in it.
    ends: HashMap<(u64, u64), u64>,
    /// Whether the files are listed anew when the journal names one not listed: a copy that
    /// makes its files as it goes (the first pre-copy round), whose directories keep their
    /// names while it runs. The final copy's files keep the paths first found (its images are
    /// renamed at their commit): only those not listed are added.
    pub(super) growing: bool,
}

impl Copying {
    /// To follow `journal`, the copy writing into the files under `dir` now.
    pub(super) fn new(dir: &Path, journal: &Path) -> Copying {
        let mut files = HashMap::new();
        files_under(dir, "", journal, &mut files);
        Copying {
            dir: dir.to_path_buf(),
            journal: journal.to_path_buf(),
            first: files.keys().copied().collect(),
            files,
            ends: HashMap::new(),
            growing: false,
        }
    }

    /// [`Copying::new`] for a copy that makes its files under `dir` as it goes.
    pub(super) fn growing(dir: &Path, journal: &Path) -> Copying {
        Copying {
            growing: true,
            ..Copying::new(dir, journal)
        }
    }

    /// Lists the files again where `pending` names one not listed: anew where the copy makes
    /// them as it goes; else only those not listed are added.
    fn list_new(&mut self, pending: &Chunks) {
        if pending.keys().all(|i| self.files.contains_key(i)) {
            return;
        }
        let mut now = HashMap::new();
        files_under(&self.dir, "", &self.journal, &mut now);
        if self.growing {
            self.files = now;
        } else {
            for (inode, path) in now {
                self.files.entry(inode).or_insert(path);
            }
        }
    }

    /// Notes the chunks `records` name (the furthest end of each file's).
    fn note(&mut self, records: &[JournalRecord]) {
        for r in records {
            let end = self.ends.entry(r.inode).or_default();
            *end = (*end).max(r.at.saturating_add(r.len));
        }
    }

    /// How far each file of `inodes` that the copy made goes in a round: to the end of the
    /// furthest chunk the journal named in it. By path.
    fn made_upto<'a>(&self, inodes: impl Iterator<Item = &'a (u64, u64)>) -> HashMap<String, u64> {
        inodes
            .filter(|i| !self.first.contains(i))
            .filter_map(|i| Some((self.files.get(i)?.clone(), *self.ends.get(i)?)))
            .collect()
    }
}

/// The regular files under `root/rel` but `skip`, by (device, inode), into `out`. What cannot
/// be listed is left out (its chunks wait for the final set).
fn files_under(root: &Path, rel: &str, skip: &Path, out: &mut HashMap<(u64, u64), String>) {
    let Ok(entries) = fs::read_dir(root.join(rel)) else {
        return;
    };
    for e in entries.flatten() {
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        let r = if rel.is_empty() {
            name
        } else {
            format!("{rel}/{name}")
        };
        let Ok(meta) = fs::symlink_metadata(e.path()) else {
            continue;
        };
        if meta.is_dir() {
            files_under(root, &r, skip, out);
        } else if meta.is_file() && e.path() != skip {
            out.insert((meta.dev(), meta.ino()), r);
        }
    }
}

/// What the rounds sent while the copy ran.
#[derive(Debug, Default)]
pub(super) struct Copied {
    /// Files and bytes sent.
    pub(super) sent: Totals,
    /// The ranges read by a round after their chunk was complete, and not written since.
    pub(super) settled: Written,
    /// Rounds sent.
    pub(super) rounds: u32,
    /// The files they sent (relative to the directory).
    pub(super) files: HashSet<String>,
}

/// The journal as read so far.
struct Journal {
    path: PathBuf,
    file: Option<File>,
    /// Bytes of a record not whole yet.
    partial: Vec<u8>,
}

impl Journal {
    /// The chunks recorded since the last call (none while the file is not there yet).
    fn read_new(&mut self) -> io::Result<Vec<JournalRecord>> {
        if self.file.is_none() {
            match File::open(&self.path) {
                Ok(f) => self.file = Some(f),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
                Err(e) => return Err(e),
            }
        }
        let Some(file) = self.file.as_mut() else {
            return Ok(Vec::new());
        };
        file.read_to_end(&mut self.partial)?;
        let whole = self.partial.len() / JournalRecord::BYTES * JournalRecord::BYTES;
        let records = (self.partial[..whole].chunks_exact(JournalRecord::BYTES))
            .filter_map(|rec| rec.try_into().ok().map(JournalRecord::from_bytes))
            .collect();
        self.partial.drain(..whole);
        Ok(records)
    }
}

impl Copied {
    /// The chunks `records` wrote are to be sent (`pending`), and no longer settled.
    fn written(&mut self, records: Vec<JournalRecord>, pending: &mut Chunks) {
        if records.is_empty() {
            return;
        }
        let mut fresh = Written::new();
        for r in records {
            fresh.add(r.inode, [(r.at, r.len)]);
            pending.entry(r.inode).or_default().push((r.at, r.len));
        }
        self.settled = self.settled.without(&fresh);
    }
}

/// Sends on `stream`, round after round, the chunks the copy `c` completed, until `next` says
/// what comes after (the final set's first part: returned, once the journal, complete by then,
/// is read to its end) or is gone (none). A journal that cannot be read settles nothing and ends
/// the rounds, not the send; so does a file of the copy gone from its name (the images
/// committed: the copy is over).
pub(super) fn send_while_copying<S: Read + Write + ?Sized, T>(
    sender: &mut DirSender,
    stream: &mut S,
    c: &mut Copying,
    next: &Receiver<T>,
) -> Result<(Copied, Option<T>), WireError> {
    let mut journal = Journal {
        path: c.journal.clone(),
        file: None,
        partial: Vec::new(),
    };
    let mut copied = Copied::default();
    let mut pending = Chunks::new();
    let (mut readable, mut rounds) = (true, true);
    loop {
        // (Told what follows only once the copy is over: its journal is complete, and read to
        // its end after.)
        let next = next.try_recv();
        if readable {
            match journal.read_new() {
                Ok(records) => {
                    c.note(&records);
                    copied.written(records, &mut pending);
                }
                Err(_) => {
                    (readable, rounds) = (false, false);
                    copied.settled = Written::new();
                }
            }
        }
        match next {
            Ok(what) => return Ok((copied, Some(what))),
            Err(TryRecvError::Disconnected) => return Ok((copied, None)),
            Err(TryRecvError::Empty) => {}
        }
        c.list_new(&pending);
        pending.retain(|inode, _| c.files.contains_key(inode));
        let bytes: u64 = pending.values().flatten().map(|(_, len)| len).sum();
        if !rounds || bytes < ROUND_BYTES {
            std::thread::sleep(POLL);
            continue;
        }
        rounds = round(
            sender,
            &mut &mut *stream,
            c,
            std::mem::take(&mut pending),
            &mut copied,
        )?;
    }
}

/// One round: the chunks `chunks` names (of files `c` knows) sent as a round ahead of only
/// their files, what it read settled in `copied`. Settled only where the round read the file:
/// found under its name as the round listed them (the images are renamed at their commit, and
/// never back), and read from it opened then, renamed meanwhile or not. A file gone is read
/// again by the final set. Whether every file was there (if not, the copy is over: no round is
/// worth sending after).
fn round<S: Read + Write>(
    sender: &mut DirSender,
    stream: &mut S,
    c: &Copying,
    chunks: Chunks,
    copied: &mut Copied,
) -> Result<bool, WireError> {
    let mut told = Written::new();
    let mut paths = Vec::new();
    for (inode, ranges) in &chunks {
        told.add(*inode, ranges.iter().copied());
        paths.push(c.files[inode].clone());
    }
    sender.told(told);
    let upto = c.made_upto(chunks.keys());
    let sent = sender.send_ahead_upto(stream, &c.dir, &paths, &upto)?;
    copied.files.extend(paths);
    copied.sent.files += sent.files;
    copied.sent.bytes += sent.bytes;
    copied.rounds += 1;
    let mut all_there = true;
    for (inode, ranges) in chunks {
        if sender.read_in_last_part(inode) {
            copied.settled.add(inode, ranges);
        } else {
            all_there = false;
        }
    }
    Ok(all_there)
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;
    use crate::auth::HmacKey;
    use crate::wire::{receive_dir, ReceiveReport};

    /// Under `tmp`, `src/.gpu.tmp/data-000.bin` (`bytes` bytes) sent ahead to `dest`: the
    /// source directory, the sender's end of the link and its sender, the receiver's thread.
    struct SentAhead {
        src: PathBuf,
        a: UnixStream,
        sender: DirSender,
        receiving: std::thread::JoinHandle<Result<ReceiveReport, WireError>>,
    }

    fn sent_ahead(tmp: &Path, bytes: usize) -> SentAhead {
        let (src, dest) = (tmp.join("src"), tmp.join("dest"));
        fs::create_dir_all(src.join(".gpu.tmp")).unwrap();
        fs::write(src.join(".gpu.tmp/data-000.bin"), vec![1u8; bytes]).unwrap();
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let key = || HmacKey::from_bytes(vec![7; 32]).unwrap();
        let receiving = std::thread::spawn(move || receive_dir(&mut b, &key(), &dest));
        let mut sender = DirSender::start(&mut a, &key()).unwrap();
        sender.send_ahead(&mut a, &src).unwrap();
        SentAhead {
            src,
            a,
            sender,
            receiving,
        }
    }

    /// A round of the chunks a copy completed: what it read, from its file still under its
    /// name, is settled; the same round over a directory renamed meanwhile (the images
    /// committed) reads nothing and settles nothing, and says so.
    #[test]
    fn a_round_settles_only_what_it_read_from_a_file_still_under_its_name() {
        let tmp = tempfile::tempdir().unwrap();
        let SentAhead {
            src,
            mut a,
            mut sender,
            receiving,
        } = sent_ahead(tmp.path(), 8 << 20);
        let data = src.join(".gpu.tmp/data-000.bin");

        let journal = src.join(".journal");
        let c = Copying::new(&src, &journal);
        let m = fs::metadata(&data).unwrap();
        let inode = (m.dev(), m.ino());
        assert_eq!(
            c.files.get(&inode).map(String::as_str),
            Some(".gpu.tmp/data-000.bin")
        );
        let first = (0u64, 4u64 << 20);
        fs::OpenOptions::new()
            .write(true)
            .open(&data)
            .unwrap()
            .write_all(&[2u8; 4 << 20])
            .unwrap();
        let mut copied = Copied::default();
        let there = round(
            &mut sender,
            &mut a,
            &c,
            [(inode, vec![first])].into(),
            &mut copied,
        );
        assert!(there.unwrap());
        assert_eq!((copied.rounds, copied.sent.bytes), (1, 4 << 20));
        let mut want = Written::new();
        want.add(inode, [first]);
        assert_eq!(copied.settled, want);

        // Committed: the directory renamed. Nothing is read, nothing settled.
        fs::rename(src.join(".gpu.tmp"), src.join("gpu")).unwrap();
        let second = (4u64 << 20, 4u64 << 20);
        let there = round(
            &mut sender,
            &mut a,
            &c,
            [(inode, vec![second])].into(),
            &mut copied,
        );
        assert!(!there.unwrap(), "the file is gone from its name");
        assert_eq!((copied.rounds, copied.sent.bytes), (2, 4 << 20));
        assert_eq!(copied.settled, want, "the second range is not settled");

        // A chunk written again is no longer settled.
        let again = JournalRecord {
            inode,
            at: 0,
            len: 1 << 20,
        };
        let mut pending = Chunks::new();
        copied.written(vec![again], &mut pending);
        let mut left = Written::new();
        left.add(inode, [(1u64 << 20, 3u64 << 20)]);
        assert_eq!(copied.settled, left);
        assert_eq!(pending[&inode], vec![(0, 1 << 20)]);
        drop((a, sender));
        let _ = receiving.join();
    }

    /// A file that appears while the copy runs (the keeper's spare, adopted into the images)
    /// is found once the journal names it, and goes only as far as the furthest chunk named in
    /// it: not the rest of its length, which may not be written yet.
    #[test]
    fn a_file_made_while_copying_goes_as_far_as_the_journal_named_it() {
        let tmp = tempfile::tempdir().unwrap();
        let SentAhead {
            src,
            mut a,
            mut sender,
            receiving,
        } = sent_ahead(tmp.path(), 1 << 20);

        let journal = src.join(".journal");
        let mut c = Copying::new(&src, &journal);
        // The spare: 16 MiB long, chunks recorded at 0 and at 8 MiB.
        let spare = src.join(".gpu.tmp/data-001.bin");
        fs::write(&spare, vec![3u8; 16 << 20]).unwrap();
        let m = fs::metadata(&spare).unwrap();
        let inode = (m.dev(), m.ino());
        assert!(!c.files.contains_key(&inode), "not there as the copy began");
        let records = vec![
            JournalRecord {
                inode,
                at: 0,
                len: 4 << 20,
            },
            JournalRecord {
                inode,
                at: 8 << 20,
                len: 2 << 20,
            },
        ];
        let mut copied = Copied::default();
        let mut pending = Chunks::new();
        c.note(&records);
        copied.written(records, &mut pending);
        c.list_new(&pending);
        assert_eq!(
            c.files.get(&inode).map(String::as_str),
            Some(".gpu.tmp/data-001.bin")
        );
        assert!(round(&mut sender, &mut a, &c, pending, &mut copied).unwrap());
        assert_eq!(
            (copied.rounds, copied.sent.bytes),
            (1, 10 << 20),
            "up to the end of the chunk at 8 MiB"
        );
        let mut want = Written::new();
        want.add(inode, [(0, 4 << 20), (8 << 20, 2 << 20)]);
        assert_eq!(copied.settled, want);
        drop((a, sender));
        let _ = receiving.join();
    }
}
