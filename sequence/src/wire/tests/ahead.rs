//! Directories sent ahead while they are written (pre-copy rounds, patches of files rewritten
//! in place), and sessions of several streams (part of [`super`]).

use super::*;
use crate::wire::mac::{pieces_digest, FrameMac, Piece, Way, KEY_BYTES};
use std::io::Read;
use std::os::unix::fs::{FileExt as _, MetadataExt};

/// What a receiver on a thread of its own makes of a send.
type Receiving = thread::JoinHandle<Result<ReceiveReport, WireError>>;

/// A receiver into `dest` on one end of a pair, on a thread of its own; the other end, and a
/// sender of one stream started on it.
fn sender_to(dest: &Path) -> (UnixStream, DirSender, Receiving) {
    let (mut a, mut b) = pair();
    let d = dest.to_path_buf();
    let receiver = thread::spawn(move || receive_dir(&mut b, &key(2), &d));
    let sender = DirSender::start(&mut a, &key(2)).unwrap();
    (a, sender, receiver)
}

/// The final set of `src` sent on `conn`; asserts the receiver's totals are the sender's. The
/// sender's report.
fn finish(
    sender: DirSender,
    conn: &mut (impl Read + Write),
    src: &Path,
    receiver: Receiving,
) -> SendReport {
    let (report, _) = sender.finish(conn, src).unwrap();
    let got = receiver.join().unwrap().unwrap();
    assert_eq!(got.totals, report.totals);
    report
}

/// Writes each of `files` (a path under `src`, its bytes).
fn write_files(src: &Path, files: &[(&str, &[u8])]) {
    for (path, bytes) in files {
        fs::write(src.join(path), bytes).unwrap();
    }
}

/// Asserts `dest` is `src`, bit-exact with its modes, and the only entry of `out`.
fn assert_arrived(src: &Path, dest: &Path, out: &Path) {
    assert_eq!(snapshot(dest), snapshot(src));
    assert_eq!(names(out), ["image"]);
}

/// A file sent ahead whose final version begins with it (found by its inode, renamed and
/// grown since), one unchanged, one rewritten in place, one gone and one new: only the new
/// bytes are sent after the cut, and DEST is the final set, nothing more.
#[test]
fn a_directory_sent_ahead_then_whole_sends_only_what_changed_after_the_cut() {
    let (_tmp, src, out) = dirs();
    fs::create_dir(src.join(".gpu.tmp")).unwrap();
    let data = noise(CHUNK_BYTES + 1000);
    write_files(
        &src,
        &[
            (".gpu.tmp/data-000.bin", &data),
            ("same", b"unchanged"),
            ("rewritten", b"version 1"),
            ("lock", b""),
        ],
    );
    let dest = out.join("image");
    let (mut a, mut sender, receiver) = sender_to(&dest);
    let ahead = sender.send_ahead(&mut a, &src).unwrap();
    assert_eq!(ahead.files, 4);
    // The cut: the engine's image named, appended to; a file rewritten, one removed, one new.
    fs::rename(src.join(".gpu.tmp"), src.join("gpu")).unwrap();
    let more = noise(5000);
    append_to(&src.join("gpu/data-000.bin"), &more);
    fs::write(src.join("rewritten"), b"version 2").unwrap();
    fs::remove_file(src.join("lock")).unwrap();
    fs::write(src.join("possum.json"), b"{}").unwrap();
    let report = finish(sender, &mut a, &src, receiver);
    let whole = (data.len() + more.len() + 9 + 9 + 2) as u64;
    assert_eq!(
        report.totals,
        Totals {
            files: 4,
            bytes: whole
        }
    );
    assert_eq!(report.sent_bytes, (more.len() + 9 + 2) as u64);
    assert_arrived(&src, &dest, &out);
}

/// After a `Cut`, a base that was not sent ahead, or is not what was, is refused, and
/// nothing is named.
#[test]
fn a_final_set_that_lacks_or_changes_a_file_sent_ahead_is_refused() {
    let (_tmp, _src, out) = dirs();
    let dest = out.join("image");
    // The digest of bytes sent as one piece.
    let digest = |d: &[u8]| {
        let pieces: Vec<Piece> = (!d.is_empty())
            .then(|| Piece {
                offset: 0,
                len: d.len() as u64,
                hash: *blake3::hash(d).as_bytes(),
                crc: None,
            })
            .into_iter()
            .collect();
        pieces_digest(&pieces)
    };
    // A base: `path` sent ahead as the `size` bytes `sent`, unpatched.
    let base = |path: &str, size: u64, sent: &[u8]| Base {
        path: path.into(),
        size,
        digest: digest(sent),
        patches: Vec::new(),
    };
    let with_base = |base: Base| {
        move |s: &mut UnixStream, session: &mut Session| {
            put(s, session, "a", b"ahead");
            send(s, session, &Frame::Cut);
            part(s, session, on_base("a", 7, base), &[(5, b"!!")]);
            done(s, session, Totals { files: 1, bytes: 7 });
        }
    };
    // The sound one is taken.
    against_ok(&dest, with_base(base("a", 5, b"ahead")));
    assert_eq!(fs::read(dest.join("a")).unwrap(), b"ahead!!");
    fs::remove_dir_all(&dest).unwrap();
    for (base, why) in [
        (base("b", 5, b"ahead"), "not sent ahead"),
        (base("a", 5, b"other"), "not what was sent ahead"),
        (base("a", 4, b"ahea"), "not what was sent ahead"),
    ] {
        let e = against(&dest, with_base(base));
        assert!(
            matches!(e, WireError::Receive(ReceiveError::Ahead { .. })),
            "{why}: {e:?}"
        );
        assert!(e.to_string().contains(why), "{e}");
        assert!(names(&out).is_empty(), "{:?}", names(&out));
    }
    // Before any Cut, a base that was not sent ahead, or another file's.
    for (ahead, path, size, base, why) in [
        (true, "b", 7, base("a", 5, b"ahead"), "goes on only itself"),
        (false, "a", 1, base("a", 0, b""), "not sent ahead"),
    ] {
        let e = against(&dest, |s, session| {
            if ahead {
                put(s, session, "a", b"ahead");
            }
            part(s, session, on_base(path, size, base), &[]);
            done(
                s,
                session,
                Totals {
                    files: 1,
                    bytes: size,
                },
            );
        });
        assert!(e.to_string().contains(why), "{why}: {e}");
        assert!(names(&out).is_empty(), "{why}");
    }
}

/// The header of file 0 of a part, `path` of `size` bytes on `base`.
fn on_base(path: &str, size: u64, base: Base) -> FileHeader {
    FileHeader {
        base: Some(base),
        ..file_header(path, size, 0o644)
    }
}

/// Rounds ahead of the cut (a migration's pre-copy rounds): a file sent in an earlier round
/// sends only what it gained since, one unchanged nothing, one rewritten in place its changed
/// piece (here all of it), a new one goes whole; after the cut, only what changed since the
/// last round. DEST is the final set.
#[test]
fn a_directory_sent_ahead_in_rounds_sends_each_file_s_gain_once() {
    let (_tmp, src, out) = dirs();
    let data = noise(CHUNK_BYTES + 1000);
    let first = [
        ("data", &data[..]),
        ("same", b"unchanged"),
        ("rewritten", b"version 1"),
    ];
    write_files(&src, &first);
    let dest = out.join("image");
    let (mut a, mut sender, receiver) = sender_to(&dest);
    let first = sender.send_ahead(&mut a, &src).unwrap();
    assert_eq!(first.files, 3);
    // Round 2: data grew, a file is new, one is rewritten in place.
    let gain = noise(3000);
    append_to(&src.join("data"), &gain);
    fs::write(src.join("new"), b"new file").unwrap();
    fs::write(src.join("rewritten"), b"version 2").unwrap();
    let second = sender.send_ahead(&mut a, &src).unwrap();
    assert_eq!(
        second,
        Totals {
            files: 3,
            bytes: (gain.len() + 8 + 9) as u64
        },
        "data's gain, the new file and the rewritten one's piece"
    );
    // Round 3: nothing changed.
    assert_eq!(sender.send_ahead(&mut a, &src).unwrap(), Totals::default());
    // The cut: data grows again.
    let last = noise(700);
    append_to(&src.join("data"), &last);
    let report = finish(sender, &mut a, &src, receiver);
    assert_eq!(report.totals.files, 4);
    assert_eq!(
        report.sent_bytes,
        last.len() as u64,
        "data's last gain only"
    );
    assert_arrived(&src, &dest, &out);
}

/// A receiver on a loopback port that takes `conns` connections, each on a thread of its own:
/// the first session's receive (into `dest`), its other streams handed to it, and what each
/// refused connection was told.
#[allow(clippy::type_complexity)]
fn streams_receiver(
    key: HmacKey,
    dest: PathBuf,
    conns: usize,
) -> (
    std::net::SocketAddr,
    thread::JoinHandle<Result<ReceiveReport, WireError>>,
    std::sync::mpsc::Receiver<HandshakeError>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (got, report) = std::sync::mpsc::channel();
    let (refused, refusals) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let sessions = Sessions::new(TIMEOUT);
        for _ in 0..conns {
            let (mut s, _) = listener.accept().unwrap();
            set_timeouts(&s, TIMEOUT).unwrap();
            let (key, dest, sessions) = (key.clone(), dest.clone(), sessions.clone());
            let (got, refused) = (got.clone(), refused.clone());
            thread::spawn(move || match accept_handshake(&mut s, &key, &sessions) {
                Ok(Accepted::Session(session)) => {
                    let r = receive_dir_in_session(&mut s, session, &dest).map(|(r, _)| r);
                    let _ = got.send(r);
                }
                Ok(Accepted::Stream(joined)) => assert!(joined.join(s)),
                Err(e) => {
                    let _ = refused.send(e);
                }
            });
        }
    });
    let receiver = thread::spawn(move || report.recv().unwrap());
    (addr, receiver, refusals)
}

/// A connection to `addr` for a stream.
fn lane_to(addr: std::net::SocketAddr) -> io::Result<TcpStream> {
    let s = TcpStream::connect(addr)?;
    set_timeouts(&s, TIMEOUT)?;
    Ok(s)
}

/// A receiver into `dest` of a session of `streams` streams under `key(k)`, and a sender of
/// that session started on its first connection; each other stream's connection goes through
/// `wrap` (given the stream's index).
fn streams_sender(
    k: u8,
    dest: &Path,
    streams: u32,
    wrap: fn(TcpStream, u32) -> Box<dyn Connection>,
) -> (TcpStream, DirSender, Receiving) {
    let (addr, receiver, _) = streams_receiver(key(k), dest.to_path_buf(), streams as usize);
    let mut main = lane_to(addr).unwrap();
    let sender = DirSender::start_streams(&mut main, &key(k), streams, |index| {
        Ok(wrap(lane_to(addr)?, index))
    })
    .unwrap();
    (main, sender, receiver)
}

/// A directory of files of several sizes, one of many chunks.
fn many_files(src: &Path) {
    fs::create_dir_all(src.join("gpu/gpu-0")).unwrap();
    fs::write(src.join("possum.json"), b"{}").unwrap();
    fs::write(src.join("empty"), b"").unwrap();
    fs::write(
        src.join("gpu/gpu-0/data-000.bin"),
        noise(5 * CHUNK_BYTES + 12345),
    )
    .unwrap();
    fs::write(src.join("gpu/gpu-0/data-001.bin"), noise(CHUNK_BYTES)).unwrap();
    for i in 0..20 {
        fs::write(src.join(format!("gpu/small-{i}")), noise(i * 1000)).unwrap();
    }
}

/// Over four streams, rounds sent ahead then the final set arrive bit-exact: every stream
/// ends every part, the files written where their chunks say.
#[test]
fn a_send_over_several_streams_arrives_bit_exact() {
    let (_tmp, src, out) = dirs();
    many_files(&src);
    let dest = out.join("image");
    let (mut main, mut sender, receiver) = streams_sender(7, &dest, 4, |s, _| Box::new(s));
    let ahead = sender.send_ahead(&mut main, &src).unwrap();
    assert_eq!(ahead.files, 24);
    // The big file grows and a new one comes, between the round and the final set.
    let more = noise(3 * CHUNK_BYTES + 7);
    append_to(&src.join("gpu/gpu-0/data-000.bin"), &more);
    fs::write(src.join("criu.img"), noise(2 * CHUNK_BYTES + 1)).unwrap();
    let report = finish(sender, &mut main, &src, receiver);
    assert_eq!(report.totals.files, 25);
    assert_eq!(
        report.sent_bytes,
        (more.len() + 2 * CHUNK_BYTES + 1) as u64,
        "after the cut, the big file's gain and the new file only"
    );
    assert_arrived(&src, &dest, &out);
}

/// Writes `bytes` over `path` at `offset`, in place: the same file, its other bytes kept.
fn rewrite(path: &Path, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
}

/// Appends `bytes` to `path`.
fn append_to(path: &Path, bytes: &[u8]) {
    let mut f = fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(bytes).unwrap();
}

/// Over four streams, a file rewritten in place (pieces of it changed, its size the same, as
/// possum's image writer rewrites a chunk of a data file) sends again only its changed pieces,
/// in a later round ahead and after the cut, and a file appended to only what it gained: the
/// bytes sent while held are about those, not the files' whole lengths, and DEST is
/// bit-exact.
#[test]
fn a_file_rewritten_in_place_sends_only_its_changed_pieces() {
    let (_tmp, src, out) = dirs();
    fs::create_dir(src.join("gpu")).unwrap();
    let big = src.join("gpu/data-000.bin");
    let grown = src.join("gpu/data-001.bin");
    fs::write(&big, noise(6 * CHUNK_BYTES + 4321)).unwrap();
    fs::write(&grown, noise(2 * CHUNK_BYTES + 10)).unwrap();
    fs::write(src.join("possum.json"), b"{}").unwrap();
    let dest = out.join("image");
    let (mut main, mut sender, receiver) = streams_sender(8, &dest, 4, |s, _| Box::new(s));
    let first = sender.send_ahead(&mut main, &src).unwrap();
    assert_eq!(first.files, 3);
    // Round 2: 100 bytes of the third piece rewritten: that piece alone is sent again.
    rewrite(&big, 2 * CHUNK_BYTES as u64 + 50, &noise(100));
    let second = sender.send_ahead(&mut main, &src).unwrap();
    assert_eq!(
        second,
        Totals {
            files: 1,
            bytes: CHUNK_BYTES as u64
        },
        "the changed piece only"
    );
    // The cut: bytes of the first and sixth pieces rewritten, the other file appended to,
    // a new file.
    rewrite(&big, 10, &noise(3));
    rewrite(&big, 5 * CHUNK_BYTES as u64 + 7, &noise(CHUNK_BYTES / 2));
    let more = noise(CHUNK_BYTES + 77);
    append_to(&grown, &more);
    fs::write(src.join("criu.img"), noise(1000)).unwrap();
    let report = finish(sender, &mut main, &src, receiver);
    assert_eq!(report.totals.files, 4);
    let whole = (6 * CHUNK_BYTES + 4321) + (2 * CHUNK_BYTES + 10) + more.len() + 2 + 1000;
    assert_eq!(report.totals.bytes, whole as u64);
    // Two changed pieces of the big file, the other's gain, the new file.
    let most = (2 * CHUNK_BYTES + more.len() + 1000) as u64;
    assert!(
        report.sent_bytes <= most,
        "{} bytes sent while held, at most {most} changed (of {whole})",
        report.sent_bytes
    );
    assert!(report.sent_bytes >= (more.len() + 1000) as u64);
    assert_arrived(&src, &dest, &out);
}

/// The device and inode of `path`.
fn inode_of(path: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let m = fs::metadata(path).unwrap();
    (m.dev(), m.ino())
}

/// Told what the files' writer wrote (as a checkpoint's image writer tells), the sender reads
/// again only the pieces those ranges meet of a file it names, and every piece of a file it
/// does not: a change it was told of is sent, in a round ahead and after the cut; a named file
/// told unwritten is not read at all (a change to it the writer did not tell is not found:
/// the account is trusted, which is why only fingerprinted files are named).
#[test]
fn a_writer_s_account_of_its_writes_is_what_is_read_again() {
    let (_tmp, src, out) = dirs();
    fs::create_dir(src.join("gpu")).unwrap();
    let big = src.join("gpu/data-000.bin");
    let quiet = src.join("gpu/data-001.bin");
    let original = noise(CHUNK_BYTES + 10);
    fs::write(&big, noise(6 * CHUNK_BYTES)).unwrap();
    fs::write(&quiet, &original).unwrap();
    fs::write(src.join("possum.json"), b"{\"a\": 1}").unwrap();
    let dest = out.join("image");
    let (mut a, mut sender, receiver) = sender_to(&dest);
    sender.send_ahead(&mut a, &src).unwrap();

    // Round 2: a piece of the big file rewritten, and told; the other file told unwritten.
    rewrite(&big, 3 * CHUNK_BYTES as u64 + 5, &noise(64));
    let mut w = Written::new();
    w.add(inode_of(&big), [(3 * CHUNK_BYTES as u64 + 5, 64)]);
    w.add(inode_of(&quiet), []);
    sender.told(w);
    let second = sender.send_ahead(&mut a, &src).unwrap();
    assert_eq!(
        second.bytes, CHUNK_BYTES as u64,
        "the piece told of: {second:?}"
    );

    // The cut: the big file's first piece told; the file not named (possum.json) rewritten;
    // the quiet file changed without a word.
    rewrite(&big, 7, &noise(9));
    fs::write(src.join("possum.json"), b"{\"a\": 2}").unwrap();
    rewrite(&quiet, 0, b"untold");
    let mut w = Written::new();
    w.add(inode_of(&big), [(7, 9)]);
    w.add(inode_of(&quiet), []);
    sender.told(w);
    let report = finish(sender, &mut a, &src, receiver);
    assert_eq!(
        report.sent_bytes,
        CHUNK_BYTES as u64 + 8,
        "the told piece, and the file not named (8 bytes)"
    );
    assert_eq!(
        fs::read(dest.join("gpu/data-000.bin")).unwrap(),
        fs::read(&big).unwrap()
    );
    assert_eq!(fs::read(dest.join("possum.json")).unwrap(), b"{\"a\": 2}");
    assert_eq!(
        fs::read(dest.join("gpu/data-001.bin")).unwrap(),
        original,
        "told unwritten: not read again"
    );
}

/// A round of some files only (a migration's GPU images while the held job's final copy writes
/// them): only the files named and the pieces the writer's account names go (unread before:
/// the writer says they changed); another file
/// changed meanwhile waits for the final set; then the final set, told only what was not
/// settled by that round, sends nothing of it again, and DEST is bit-exact.
#[test]
fn a_round_of_some_files_sends_only_them_and_the_final_set_only_what_it_left() {
    let (_tmp, src, out) = dirs();
    fs::create_dir(src.join("gpu")).unwrap();
    let big = src.join("gpu/data-000.bin");
    let other = src.join("gpu/data-001.bin");
    fs::write(&big, noise(6 * CHUNK_BYTES)).unwrap();
    fs::write(&other, noise(2 * CHUNK_BYTES)).unwrap();
    fs::write(src.join("possum.json"), b"{}").unwrap();
    let dest = out.join("image");
    let (mut a, mut sender, receiver) = sender_to(&dest);
    sender.send_ahead(&mut a, &src).unwrap();

    // While held: two pieces of the big file written, one complete and told; the other file
    // changed too.
    rewrite(&big, 2 * CHUNK_BYTES as u64, &noise(CHUNK_BYTES));
    rewrite(&big, 4 * CHUNK_BYTES as u64, &noise(CHUNK_BYTES));
    rewrite(&other, 0, &noise(10));
    let settled_range = (2 * CHUNK_BYTES as u64, CHUNK_BYTES as u64);
    let mut w = Written::new();
    w.add(inode_of(&big), [settled_range]);
    sender.told(w.clone());
    let part = sender
        .send_ahead_only(&mut a, &src, &["gpu/data-000.bin".to_string()])
        .unwrap();
    assert_eq!(
        part,
        Totals {
            files: 1,
            bytes: CHUNK_BYTES as u64
        },
        "the settled piece alone"
    );
    // Told again, unchanged: sent again all the same (the writer's word is not checked).
    sender.told(w.clone());
    let again = sender
        .send_ahead_only(&mut a, &src, &["gpu/data-000.bin".to_string()])
        .unwrap();
    assert_eq!(
        again.bytes, CHUNK_BYTES as u64,
        "told, sent without a comparison"
    );

    // The final set: the copy's whole account, without what that round settled.
    let mut all = Written::new();
    all.add(
        inode_of(&big),
        [settled_range, (4 * CHUNK_BYTES as u64, CHUNK_BYTES as u64)],
    );
    all.add(inode_of(&other), [(0, 10)]);
    sender.told(all.without(&w));
    let report = finish(sender, &mut a, &src, receiver);
    assert_eq!(
        report.sent_bytes,
        2 * CHUNK_BYTES as u64,
        "the big file's unsettled piece and the other's changed piece (possum.json unchanged)"
    );
    assert_arrived(&src, &dest, &out);
}

/// A round of some files before any round of the whole directory (a migration's first pre-copy
/// round, sent as it is copied): each file goes whole, as it is then; the round of the whole
/// directory after it is not sent in slices, goes on with those files from where they ended
/// (what they gained, and the pieces told), sends the others whole, and DEST is bit-exact.
#[test]
fn a_round_of_some_files_before_the_first_round_sends_them_whole() {
    let (_tmp, src, out) = dirs();
    fs::create_dir(src.join("gpu")).unwrap();
    let data = src.join("gpu/data-000.bin");
    fs::write(&data, noise(3 * CHUNK_BYTES)).unwrap();
    fs::write(src.join("gpu/draft.pb"), b"draft").unwrap();
    let dest = out.join("image");
    let (mut a, mut sender, receiver) = sender_to(&dest);
    sender.slice_first_round(CHUNK_BYTES as u64);
    let first = sender
        .send_ahead_only(&mut a, &src, &["gpu/data-000.bin".to_string()])
        .unwrap();
    assert_eq!(
        first,
        Totals {
            files: 1,
            bytes: 3 * CHUNK_BYTES as u64
        }
    );
    // The copy goes on: a piece written again (told), a chunk appended; then the round is
    // over, its other files written.
    rewrite(&data, CHUNK_BYTES as u64, &noise(CHUNK_BYTES));
    let mut grown = fs::OpenOptions::new().append(true).open(&data).unwrap();
    std::io::Write::write_all(&mut grown, &noise(CHUNK_BYTES)).unwrap();
    fs::write(src.join("possum.json"), b"{}").unwrap();
    let mut w = Written::new();
    w.add(inode_of(&data), [(CHUNK_BYTES as u64, CHUNK_BYTES as u64)]);
    sender.told(w);
    let round = sender.send_ahead(&mut a, &src).unwrap();
    assert_eq!(
        round,
        Totals {
            files: 3,
            bytes: 2 * CHUNK_BYTES as u64 + 5 + 2
        },
        "the told piece, the chunk gained, the draft and possum.json whole; in one part"
    );
    sender.told(Written::new());
    let report = finish(sender, &mut a, &src, receiver);
    assert_eq!(report.sent_bytes, 0, "nothing changed since");
    assert_arrived(&src, &dest, &out);
}

/// Received to be synced later (a migration's): a round ahead and the final set arrive
/// bit-exact, named holding the unsynced mark (which a restore refuses) until
/// `make_durable` syncs them and takes it away.
#[test]
fn a_directory_received_unsynced_holds_its_mark_until_it_is_made_durable() {
    let (_tmp, src, out) = dirs();
    fs::create_dir(src.join("gpu")).unwrap();
    fs::write(src.join("gpu/data-000.bin"), noise(2 * CHUNK_BYTES + 5)).unwrap();
    let dest = out.join("image");
    let (mut a, mut b) = pair();
    let d = dest.clone();
    let receiver = thread::spawn(move || {
        let session = receiver_handshake(&mut b, &key(2))?;
        receive_dir_in_session_as(&mut b, session, &d, Durability::Later)
    });
    let mut sender = DirSender::start(&mut a, &key(2)).unwrap();
    sender.send_ahead(&mut a, &src).unwrap();
    rewrite(&src.join("gpu/data-000.bin"), 3, b"later");
    fs::write(src.join("possum.json"), b"{}").unwrap();
    let (sent, _) = sender.finish(&mut a, &src).unwrap();
    let (got, _) = receiver.join().unwrap().unwrap();
    assert_eq!(got.totals, sent.totals);
    assert!(dest.join(UNSYNCED).is_file(), "{:?}", names(&dest));
    make_durable(&dest).unwrap();
    assert!(!dest.join(UNSYNCED).exists());
    assert_arrived(&src, &dest, &out);
}

/// A file that shrank after it was sent ahead (truncated in place: the same file) waits for
/// the final set in a later round, and is sent whole then; so is a file that is another file
/// under the same path.
#[test]
fn a_file_truncated_after_it_was_sent_ahead_is_sent_whole() {
    let (_tmp, src, out) = dirs();
    let shrunk = src.join("shrunk");
    fs::write(&shrunk, noise(2 * CHUNK_BYTES + 100)).unwrap();
    fs::write(src.join("replaced"), noise(5000)).unwrap();
    fs::write(src.join("same"), noise(3000)).unwrap();
    let dest = out.join("image");
    let (mut a, mut sender, receiver) = sender_to(&dest);
    assert_eq!(sender.send_ahead(&mut a, &src).unwrap().files, 3);
    let f = fs::OpenOptions::new().write(true).open(&shrunk).unwrap();
    f.set_len(CHUNK_BYTES as u64 + 5).unwrap();
    drop(f);
    // Another file under the path, as long as the first.
    fs::write(src.join("replaced.new"), noise(5000)).unwrap();
    fs::rename(src.join("replaced.new"), src.join("replaced")).unwrap();
    assert_eq!(
        sender.send_ahead(&mut a, &src).unwrap(),
        Totals::default(),
        "neither goes on ahead of the cut"
    );
    let report = finish(sender, &mut a, &src, receiver);
    assert_eq!(
        report.sent_bytes,
        (CHUNK_BYTES + 5 + 5000) as u64,
        "the shrunk and the replaced file whole, nothing of the unchanged one"
    );
    assert_arrived(&src, &dest, &out);
}

/// A sender whose pieces are longer than this end's (a piece of 2.5 chunks, sent ahead, then
/// named a base after the cut): the receiver's check of its copy reads the whole piece, and the
/// file arrives.
#[test]
fn a_piece_longer_than_this_end_s_is_checked_whole() {
    let (_tmp, _src, out) = dirs();
    let dest = out.join("image");
    let data: &'static [u8] =
        Box::leak(noise(2 * CHUNK_BYTES + CHUNK_BYTES / 2).into_boxed_slice());
    let size = data.len() as u64;
    let piece = Piece {
        offset: 0,
        len: size,
        hash: *blake3::hash(data).as_bytes(),
        crc: None,
    };
    against_ok(&dest, move |s: &mut UnixStream, session: &mut Session| {
        part(s, session, file_header("big", size, 0o600), &[(0, data)]);
        send(s, session, &Frame::Cut);
        let base = Base {
            path: "big".into(),
            size,
            digest: pieces_digest(&[piece]),
            patches: vec![],
        };
        part(s, session, on_base("big", size, base), &[]);
        done(
            s,
            session,
            Totals {
                files: 1,
                bytes: size,
            },
        );
    });
    assert_eq!(fs::read(dest.join("big")).unwrap(), data);
}

/// After a `Cut`, a patch whose bytes are not those the sender hashed at the cut (its file
/// changed again after it was hashed), one that is not a piece sent ahead, one without its
/// hash, or one that does not come, is refused with nothing named; a sound one is written over
/// the base.
#[test]
fn a_patch_not_what_the_sender_hashed_at_the_cut_is_refused() {
    let (_tmp, _src, out) = dirs();
    let dest = out.join("image");
    let piece = |offset: u64, d: &[u8]| Piece {
        offset,
        len: d.len() as u64,
        hash: *blake3::hash(d).as_bytes(),
        crc: None,
    };
    let digest = pieces_digest(&[piece(0, b"AAAA"), piece(4, b"BBBB")]);
    let hex_of = |d: &[u8]| Some(blake3::hash(d).to_hex().to_string());
    // "AAAABBBB" sent ahead in two pieces; after the cut, `patches` over it and `chunks`.
    let with = |patches: Vec<Patch>, chunks: Vec<(u64, &'static [u8])>| {
        let digest = digest.clone();
        move |s: &mut UnixStream, session: &mut Session| {
            let ahead = [(0, &b"AAAA"[..]), (4, b"BBBB")];
            part(s, session, file_header("a", 8, 0o644), &ahead);
            send(s, session, &Frame::Cut);
            let base = Base {
                path: "a".into(),
                size: 8,
                digest,
                patches,
            };
            part(s, session, on_base("a", 8, base), &chunks);
            done(s, session, Totals { files: 1, bytes: 8 });
        }
    };
    let patch = |offset, hash| Patch {
        offset,
        len: 4,
        hash,
        later: false,
    };
    against_ok(
        &dest,
        with(vec![patch(4, hex_of(b"CCCC"))], vec![(4, b"CCCC")]),
    );
    assert_eq!(fs::read(dest.join("a")).unwrap(), b"AAAACCCC");
    fs::remove_dir_all(&dest).unwrap();
    // Hashed "CCCC" at the cut, "DDDD" sent: changed again since.
    let e = against(
        &dest,
        with(vec![patch(4, hex_of(b"CCCC"))], vec![(4, b"DDDD")]),
    );
    assert_refused!(
        e,
        ReceiveError::Patch {
            offset: 4,
            len: 4,
            ..
        }
    );
    assert!(
        e.to_string().contains("changed again after it was hashed"),
        "{e}"
    );
    assert!(names(&out).is_empty(), "{:?}", names(&out));
    for (patches, chunks, why) in [
        (
            vec![patch(2, hex_of(b"CCCC"))],
            vec![(2, &b"CCCC"[..])],
            "not a piece of it",
        ),
        (vec![patch(4, None)], vec![(4, b"CCCC")], "has no hash"),
        (
            vec![patch(4, hex_of(b"CCCC")), patch(4, hex_of(b"CCCC"))],
            vec![(4, b"CCCC")],
            "two patches",
        ),
        (
            vec![patch(4, hex_of(b"CCCC"))],
            vec![],
            "0 of its 1 patches",
        ),
        (vec![], vec![(4, b"CCCC")], "not one of its patches"),
    ] {
        let e = against(&dest, with(patches, chunks));
        assert!(e.to_string().contains(why), "{why}: {e}");
        assert!(names(&out).is_empty(), "{:?}", names(&out));
    }
}

/// The receiver's copy of a file sent ahead changed there after it was written: the final
/// set, which patches that file, is refused when it names it as a base, and nothing is named;
/// the sender hears why.
#[test]
fn a_copy_changed_at_the_receiver_after_it_was_sent_ahead_is_refused() {
    let (_tmp, src, out) = dirs();
    let data = noise(3 * CHUNK_BYTES + 99);
    fs::write(src.join("data"), &data).unwrap();
    let dest = out.join("image");
    let (mut a, mut sender, receiver) = sender_to(&dest);
    sender.send_ahead(&mut a, &src).unwrap();
    // The receiver's copy, once all of it is there.
    let copy = (0..2000)
        .find_map(|_| {
            let at = fs::read_dir(&out)
                .unwrap()
                .map(|e| e.unwrap().path().join("data"))
                .find(|p| fs::read(p).is_ok_and(|d| d == data));
            if at.is_none() {
                thread::sleep(Duration::from_millis(10));
            }
            at
        })
        .expect("the receiver's copy of what was sent ahead");
    // A byte of its second piece changed there, a clock tick after the receiver wrote it (so
    // that its times show it, if its check after the part read it before); the sender's file
    // patched in its first.
    thread::sleep(Duration::from_millis(20));
    rewrite(&copy, CHUNK_BYTES as u64 + 3, &[data[CHUNK_BYTES + 3] ^ 1]);
    rewrite(&src.join("data"), 7, b"patched");
    let sent = sender.finish(&mut a, &src).unwrap_err();
    let e = receiver.join().unwrap().unwrap_err();
    assert!(
        matches!(e, WireError::Receive(ReceiveError::AheadCopy { .. })),
        "{e:?}"
    );
    let offset = format!("at offset {CHUNK_BYTES}");
    assert!(e.to_string().contains(&offset), "{e}");
    assert!(
        e.to_string().contains("changed here after it was written"),
        "{e}"
    );
    assert!(
        sent.to_string()
            .contains("changed here after it was written"),
        "the sender hears why: {sent}"
    );
    assert!(names(&out).is_empty(), "{:?}", names(&out));
}

/// A connection's writes, one byte of them flipped: a man in the middle of one stream.
struct Tamper {
    inner: TcpStream,
    written: usize,
    at: usize,
}

impl Read for Tamper {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf)
    }
}

impl Write for Tamper {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut b = buf.to_vec();
        if (self.written..self.written + b.len()).contains(&self.at) {
            b[self.at - self.written] ^= 0x10;
        }
        let k = self.inner.write(&b)?;
        self.written += k;
        Ok(k)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A frame changed on one stream of three is refused, naming the stream; the receiver commits
/// nothing, and the sender hears why.
#[test]
fn a_frame_tampered_on_one_stream_is_refused_and_nothing_is_committed() {
    let (_tmp, src, out) = dirs();
    many_files(&src);
    let dest = out.join("image");
    let (mut main, sender, receiver) = streams_sender(5, &dest, 3, |s, index| {
        if index == 2 {
            // In the head of the stream's first frame (a chunk's place, or its EndPart's count),
            // past its proof.
            let at = PROOF_BYTES + HEADER_BYTES + 3;
            Box::new(Tamper {
                inner: s,
                written: 0,
                at,
            })
        } else {
            Box::new(s)
        }
    });
    let sent = sender.finish(&mut main, &src).unwrap_err();
    let e = receiver.join().unwrap().unwrap_err();
    assert!(
        matches!(
            e,
            WireError::Receive(ReceiveError::Frame(FrameError::Unauthenticated {
                stream: 2,
                seq: 0,
                why: Misfit::Changed,
                ..
            }))
        ),
        "{e:?}"
    );
    assert!(e.to_string().starts_with("frame 0 of stream 2"), "{e}");
    assert!(
        sent.to_string().contains("stream 2"),
        "the sender hears which stream: {sent}"
    );
    assert!(names(&out).is_empty(), "{:?}", names(&out));
}

/// A connection that claims a stream of a session is refused unless it proves the session's key
/// for one of its streams not yet joined; the session goes on, and is then closed to joins.
#[test]
fn a_connection_claiming_a_session_it_does_not_belong_to_is_refused() {
    type Accepting = thread::JoinHandle<(Result<Accepted, HandshakeError>, Option<UnixStream>)>;
    let sessions = Sessions::new(TIMEOUT);
    // A connection to the receiver: its handshake's outcome, and its end if it was accepted.
    let accept = |sessions: &Sessions| -> (UnixStream, Accepting) {
        let (a, mut b) = pair();
        let sessions = sessions.clone();
        let t = thread::spawn(move || {
            let r = accept_handshake(&mut b, &key(2), &sessions);
            let kept = r.is_ok().then_some(b);
            (r, kept)
        });
        (a, t)
    };
    // The session, of two streams.
    let (mut a, t) = accept(&sessions);
    let session = sender_handshake_streams(&mut a, &key(2), 2).unwrap();
    let Ok(Accepted::Session(mut received)) = t.join().unwrap().0 else {
        panic!("no session")
    };
    let claim_as = |key: &[u8; KEY_BYTES], id: [u8; 16], index, streams| {
        let (mut a, t) = accept(&sessions);
        let sent = prove(
            &mut a,
            key,
            [JOIN_LABEL, JOINED_LABEL],
            &claim(&id, index, streams),
        );
        (sent, t.join().unwrap().0)
    };
    // Another session's id.
    let (sent, got) = claim_as(&session.key, [9; 16], 1, 2);
    assert!(
        matches!(got, Err(HandshakeError::UnknownSession { index: 1 })),
        "{got:?}"
    );
    assert!(got
        .unwrap_err()
        .to_string()
        .contains("belongs to no session here"));
    assert!(matches!(sent, Err(HandshakeError::Refused)), "{sent:?}");
    // This session's id, without its key (the shared secret's is not it).
    let (_, got) = claim_as(&key(2).wire_key(), session.id, 1, 2);
    assert!(
        matches!(
            got,
            Err(HandshakeError::PeerNotAuthenticated { peer: "sender" })
        ),
        "{got:?}"
    );
    // Its key, and a stream it does not have.
    let (_, got) = claim_as(&session.key, session.id, 2, 2);
    assert!(
        matches!(got, Err(HandshakeError::NotAStream { index: 2, .. })),
        "{got:?}"
    );
    let (_, got) = claim_as(&session.key, session.id, 1, 3);
    assert!(
        matches!(got, Err(HandshakeError::NotAStream { .. })),
        "{got:?}"
    );
    // The stream itself joins; a second time, it is refused.
    let (mut a, t) = accept(&sessions);
    let mut mac = join_handshake(&mut a, &session, 1).unwrap();
    let (Ok(Accepted::Stream(joined)), Some(b)) = t.join().unwrap() else {
        panic!("the stream did not join")
    };
    let (_, again) = claim_as(&session.key, session.id, 1, 2);
    assert!(
        matches!(again, Err(HandshakeError::NotAStream { why, .. }) if why.contains("joined already")),
        "{again:?}"
    );
    assert!(joined.join(b));
    let mut lanes = received.lanes().unwrap();
    assert_eq!(lanes.len(), 1);
    // Once its streams joined, the session takes no more.
    let (_, late) = claim_as(&session.key, session.id, 1, 2);
    assert!(
        matches!(late, Err(HandshakeError::UnknownSession { .. })),
        "{late:?}"
    );
    // The stream's frames are its own: they read on it, not on the first.
    send_frame(&mut a, &mut mac, &Frame::Chunks, None).unwrap();
    let mut buf = Vec::new();
    let lane = &mut lanes[0];
    assert_eq!(
        recv_frame(&mut lane.conn, &mut lane.mac, &mut buf)
            .unwrap()
            .0,
        Frame::Chunks
    );
    let mut wire = Vec::new();
    let mut other = FrameMac::new(&session.key, 1, Way::ToReceiver);
    send_frame(&mut wire, &mut other, &Frame::Chunks, None).unwrap();
    assert!(matches!(
        read_frame(&mut &wire[..], &mut received, &mut buf),
        Err(FrameError::Unauthenticated { stream: 0, .. })
    ));
}

/// A receiver that takes one connection refuses a session of more; one whose streams do not
/// all join in time fails naming how many did, and writes nothing.
#[test]
fn streams_that_cannot_or_do_not_join_fail_the_session() {
    let (_tmp, _src, out) = dirs();
    let (mut a, mut b) = pair();
    let t = thread::spawn(move || receiver_handshake(&mut b, &key(1)));
    let _ = sender_handshake_streams(&mut a, &key(1), 4);
    let e = t.join().unwrap().unwrap_err();
    assert!(
        matches!(e, HandshakeError::Streams { asked: 4, most: 1 }),
        "{e:?}"
    );
    assert!(e.to_string().contains("takes 1 to 1"), "{e}");

    let (mut a, mut b) = pair();
    let dest = out.join("image");
    let t = thread::spawn(move || {
        let sessions = Sessions::new(Duration::from_millis(200));
        let Accepted::Session(session) = accept_handshake(&mut b, &key(1), &sessions).unwrap()
        else {
            panic!("not a session")
        };
        receive_dir_in_session(&mut b, session, &dest)
    });
    let mut session = sender_handshake_streams(&mut a, &key(1), 3).unwrap();
    let e = t.join().unwrap().unwrap_err();
    assert_refused!(
        e,
        ReceiveError::Streams {
            joined: 1,
            streams: 3,
            ..
        }
    );
    // The sender is told.
    let mut buf = Vec::new();
    assert!(matches!(
        read_frame(&mut a, &mut session, &mut buf),
        Ok(Frame::Abort { reason }) if reason.contains("1 of the session's 3 streams")
    ));
    assert!(names(&out).is_empty());
}

/// A file of the final set sent in parts (`send_in_parts`), after a part sent ahead: the
/// receiver has `NAME.0`, `NAME.1`, ... holding its bytes in order, not the file; every other
/// file as it is.
#[test]
fn a_file_sent_in_parts_arrives_as_its_parts() {
    let (_tmp, src, out) = dirs();
    fs::create_dir(src.join("criu")).unwrap();
    write_files(&src, &[("criu/ahead", b"sent ahead")]);
    let dest = out.join("image");
    let (mut a, mut sender, receiver) = sender_to(&dest);
    sender.send_ahead(&mut a, &src).unwrap();
    let data = noise(2 * CHUNK_BYTES + 777);
    write_files(&src, &[("criu/pages", &data), ("criu/other", b"x")]);
    sender.send_in_parts("criu/pages", CHUNK_BYTES as u64);
    let report = finish(sender, &mut a, &src, receiver);
    assert_eq!(report.totals.files, 5, "{report:?}");
    assert_eq!(report.totals.bytes, data.len() as u64 + 11, "{report:?}");
    for (k, want) in data.chunks(CHUNK_BYTES).enumerate() {
        let got = fs::read(dest.join(format!("criu/pages.{k}"))).unwrap();
        assert!(got == want, "part {k} differs");
    }
    assert!(!dest.join("criu/pages").exists());
    assert!(!dest.join("criu/pages.3").exists());
    assert_eq!(fs::read(dest.join("criu/other")).unwrap(), b"x");
    assert_eq!(fs::read(dest.join("criu/ahead")).unwrap(), b"sent ahead");
}

/// A file asked in parts that is one sent ahead under another name (the same inode: a draft
/// renamed into place) goes as that file, its base and the bytes it gained, not as parts.
#[test]
fn a_file_asked_in_parts_that_was_sent_ahead_goes_as_that_file() {
    let (_tmp, src, out) = dirs();
    fs::create_dir(src.join("ahead")).unwrap();
    fs::create_dir(src.join("criu")).unwrap();
    let data = noise(2 * CHUNK_BYTES);
    write_files(&src, &[("ahead/draft", &data)]);
    let dest = out.join("image");
    let (mut a, mut sender, receiver) = sender_to(&dest);
    sender.send_ahead(&mut a, &src).unwrap();
    fs::rename(src.join("ahead/draft"), src.join("criu/pages")).unwrap();
    fs::remove_dir(src.join("ahead")).unwrap();
    append_to(&src.join("criu/pages"), b"tail");
    sender.send_in_parts("criu/pages", CHUNK_BYTES as u64);
    let report = finish(sender, &mut a, &src, receiver);
    assert_eq!(report.sent_bytes, 4, "only what it gained: {report:?}");
    let mut want = data.clone();
    want.extend_from_slice(b"tail");
    assert!(fs::read(dest.join("criu/pages")).unwrap() == want);
    assert!(!dest.join("criu/pages.0").exists());
    assert!(!dest.join("ahead").exists());
}

/// Post-copy: over three streams, a GPU image's pieces rewritten in place after they were sent
/// ahead are left out of the final set (its bytes sent while held are the other file's only);
/// a receiver that does not ask for post-copy receives them itself after `Committed`, and DEST
/// is the final set, bit-exact, without the post-copy mark.
#[test]
fn pieces_left_for_post_copy_come_after_the_final_set_bit_exact() {
    let (_tmp, src, out) = dirs();
    many_files(&src);
    let dest = out.join("image");
    let (mut main, mut sender, receiver) = streams_sender(9, &dest, 3, |s, _| Box::new(s));
    sender.send_ahead(&mut main, &src).unwrap();
    let big = src.join("gpu/gpu-0/data-000.bin");
    rewrite(&big, 0, b"changed at the start");
    rewrite(&big, 3 * CHUNK_BYTES as u64 + 5, b"and in the fourth piece");
    rewrite(&src.join("gpu/small-7"), 0, b"not a GPU image's");
    sender.post_copy(vec!["gpu/gpu-0".into()]);
    let sent = sender.sent_counter();
    let (report, _, later) = sender.finish_post_copy(&mut main, &src).unwrap();
    let later = later.expect("pieces left for later");
    let left: Vec<(String, u64)> = (later.pieces().iter())
        .map(|p| (p.path.clone(), p.offset))
        .collect();
    let data = "gpu/gpu-0/data-000.bin".to_string();
    assert_eq!(left, [(data.clone(), 0), (data, 3 * CHUNK_BYTES as u64)]);
    assert_eq!(
        report.sent_bytes, 7000,
        "while held, only gpu/small-7, whole piece"
    );
    // In the order asked: the fourth piece first.
    let r = later.send(&src, &[1], &Urgent::default(), &sent).unwrap();
    assert_eq!((r.pieces, r.bytes), (2, 2 * CHUNK_BYTES as u64));
    receiver.join().unwrap().unwrap();
    assert_arrived(&src, &dest, &out);
}

/// Post-copy with the final set's first part sent while the job is held (the GPU images, while
/// CRIU dumps): the pieces of that part's files rewritten since they were sent ahead are left for
/// later too, only the bytes appended to them go in it; the rest of the final set hands them back
/// with its own, and DEST is the source, bit-exact.
#[test]
fn a_first_part_of_the_final_set_leaves_its_rewritten_pieces_for_post_copy() {
    let (_tmp, src, out) = dirs();
    many_files(&src);
    let dest = out.join("image");
    let (mut main, mut sender, receiver) = streams_sender(10, &dest, 3, |s, _| Box::new(s));
    sender.send_ahead(&mut main, &src).unwrap();
    let big = src.join("gpu/gpu-0/data-000.bin");
    rewrite(&big, CHUNK_BYTES as u64 + 7, b"rewritten at the cut");
    let appended = noise(CHUNK_BYTES / 3);
    append_to(&big, &appended);
    sender.post_copy(vec!["gpu".into()]);
    let first = sender
        .send_final_under(&mut main, &src, &["gpu".to_string()])
        .unwrap();
    assert_eq!(
        first.bytes,
        appended.len() as u64,
        "only the appended bytes of the GPU image go while held"
    );
    // What is not under the first part's directory, written since: in the rest.
    rewrite(&src.join("possum.json"), 0, b"[]");
    sender.post_copy(vec!["gpu/gpu-0".into()]);
    let sent = sender.sent_counter();
    let (report, _, later) = sender.finish_post_copy(&mut main, &src).unwrap();
    let later = later.expect("the first part's piece left for later");
    let left: Vec<(String, u64)> = (later.pieces().iter())
        .map(|p| (p.path.clone(), p.offset))
        .collect();
    assert_eq!(
        left,
        [("gpu/gpu-0/data-000.bin".to_string(), CHUNK_BYTES as u64)]
    );
    assert_eq!(report.sent_bytes, 2, "the rest: possum.json's piece");
    let r = later.send(&src, &[0], &Urgent::default(), &sent).unwrap();
    assert_eq!((r.pieces, r.bytes), (1, CHUNK_BYTES as u64));
    receiver.join().unwrap().unwrap();
    assert_arrived(&src, &dest, &out);
}

/// Post-copy at a receiver that asks for it: DEST is named before the pieces left came, holding
/// the mark that lists them (a restore refuses it); each piece that comes is told; once all
/// came DEST is the final set and the mark is gone. A piece changed at the source after the
/// cut is refused by its sender.
#[test]
fn a_directory_named_before_its_post_copy_holds_its_mark_until_every_piece_came() {
    let (_tmp, src, out) = dirs();
    many_files(&src);
    let dest = out.join("image");
    let (addr, receiver) = post_copy_receiver(3, &dest, Durability::Later, |d, later| {
        let left = post_copy_left(d).unwrap().expect("the mark");
        assert_eq!(left, later.pieces());
        assert!(crate::image::open_image(d).is_err());
    });
    let mut main = lane_to(addr).unwrap();
    let mut sender =
        DirSender::start_streams(&mut main, &key(3), 2, |_| Ok(Box::new(lane_to(addr)?))).unwrap();
    sender.send_ahead(&mut main, &src).unwrap();
    let file = src.join("gpu/gpu-0/data-001.bin");
    rewrite(&file, 10, b"written after the round");
    sender.post_copy(vec!["gpu/gpu-0/".into()]);
    let (_, _, later) = sender.finish_post_copy(&mut main, &src).unwrap();
    let later = later.unwrap();
    later
        .send(
            &src,
            &[],
            &Urgent::default(),
            &std::sync::atomic::AtomicU64::new(0),
        )
        .unwrap();
    let (r, came) = receiver.join().unwrap();
    assert_eq!(r.unwrap().pieces, 1);
    assert_eq!(came, [0]);
    assert!(post_copy_left(&dest).unwrap().is_none());
    assert_eq!(
        fs::read(dest.join("gpu/gpu-0/data-001.bin")).unwrap(),
        fs::read(&file).unwrap()
    );
}

/// A piece left for post-copy that changed at the source after the cut is not sent: its
/// sender refuses it, naming it.
#[test]
fn a_post_copy_piece_changed_after_the_cut_is_refused_by_its_sender() {
    let (_tmp, src, out) = dirs();
    many_files(&src);
    let dest = out.join("image");
    let (mut main, mut sender, _receiver) = streams_sender(5, &dest, 2, |s, _| Box::new(s));
    sender.send_ahead(&mut main, &src).unwrap();
    let file = src.join("gpu/gpu-0/data-001.bin");
    rewrite(&file, 0, b"after the round");
    sender.post_copy(vec!["gpu/gpu-0".into()]);
    let (_, _, later) = sender.finish_post_copy(&mut main, &src).unwrap();
    rewrite(&file, 0, b"after the cut!!");
    let e = later
        .unwrap()
        .send(
            &src,
            &[],
            &Urgent::default(),
            &std::sync::atomic::AtomicU64::new(0),
        )
        .unwrap_err();
    assert!(matches!(e, SendError::Rechanged { offset: 0, .. }), "{e}");
}

/// Post-copy over one stream besides the first: a piece asked for (`Urgent`, as a destination's
/// `Demand` asks) goes before those in the order given, and the others follow in that order.
#[test]
fn a_post_copy_piece_asked_for_goes_first() {
    let (_tmp, src, out) = dirs();
    many_files(&src);
    let dest = out.join("image");
    let (addr, receiver) = post_copy_receiver(4, &dest, Durability::Synced, |_, _| {});
    let mut main = lane_to(addr).unwrap();
    let mut sender =
        DirSender::start_streams(&mut main, &key(4), 2, |_| Ok(Box::new(lane_to(addr)?))).unwrap();
    sender.send_ahead(&mut main, &src).unwrap();
    let big = src.join("gpu/gpu-0/data-000.bin");
    for k in 0..4u64 {
        rewrite(&big, k * CHUNK_BYTES as u64, b"rewritten");
    }
    sender.post_copy(vec!["gpu/gpu-0".into()]);
    let (_, _, later) = sender.finish_post_copy(&mut main, &src).unwrap();
    let later = later.unwrap();
    assert_eq!(later.pieces().len(), 4);
    let urgent = Urgent::default();
    urgent.ask(2);
    urgent.ask(2);
    later
        .send(
            &src,
            &[3, 0, 1],
            &urgent,
            &std::sync::atomic::AtomicU64::new(0),
        )
        .unwrap();
    let (r, came) = receiver.join().unwrap();
    assert_eq!((r.unwrap().pieces, came), (4, vec![2, 3, 0, 1]));
    assert_eq!(urgent.asked(), 2);
    assert_arrived(&src, &dest, &out);
}

/// A receiver of a session of two streams under `key(k)` on a loopback port: the directory into
/// `dest` (`durability`), its final set named with pieces left for later, `named` told of it
/// then; then the pieces. What their receive said, and the pieces in the order they came.
#[allow(clippy::type_complexity)]
fn post_copy_receiver(
    k: u8,
    dest: &Path,
    durability: Durability,
    named: impl FnOnce(&Path, &LaterReceiver) + Send + 'static,
) -> (
    std::net::SocketAddr,
    thread::JoinHandle<(Result<LaterReport, ReceiveError>, Vec<usize>)>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let d = dest.to_path_buf();
    let receiver = thread::spawn(move || {
        let sessions = Sessions::new(TIMEOUT);
        let mut conns = (0..2).map(|_| {
            let (s, _) = listener.accept().unwrap();
            set_timeouts(&s, TIMEOUT).unwrap();
            s
        });
        let mut s = conns.next().unwrap();
        let Ok(Accepted::Session(session)) = accept_handshake(&mut s, &key(k), &sessions) else {
            panic!("the first connection makes the session")
        };
        let mut l = conns.next().unwrap();
        let Ok(Accepted::Stream(joined)) = accept_handshake(&mut l, &key(k), &sessions) else {
            panic!("the second joins it")
        };
        assert!(joined.join(l));
        let (_, _, later) =
            receive_dir_post_copy(&mut s, session, &d, durability, &mut on_parts(|_, _, _| {}))
                .unwrap();
        let later = later.expect("pieces left");
        named(&d, &later);
        let came = std::sync::Mutex::new(Vec::new());
        let r = later.receive(&d, &|i| came.lock().unwrap().push(i));
        (r, came.into_inner().unwrap())
    });
    (addr, receiver)
}

/// A directory sent with nothing ahead of it comes as a final set: its parts are not taken as
/// sent ahead, so the receiver reads none of its copies back (a check only a base needs), and it
/// arrives bit-exact.
#[test]
fn a_directory_sent_with_nothing_ahead_comes_as_the_final_set() {
    let (_tmp, src, out) = dirs();
    write_files(&src, &[("a", &noise(3 * CHUNK_BYTES / 2)), ("b", b"small")]);
    let dest = out.join("image");
    let (mut a, mut b) = pair();
    let d = dest.clone();
    let receiver = thread::spawn(move || {
        let session = receiver_handshake(&mut b, &key(2)).unwrap();
        let mut parts = Vec::new();
        let mut watch = on_parts(|_: &Path, part, _: &Brought| parts.push(part));
        let r = receive_dir_watching(&mut b, session, &d, Durability::Synced, &mut watch);
        (r.map(|(report, _)| report), parts)
    });
    let (report, _) = DirSender::start(&mut a, &key(2))
        .unwrap()
        .finish(&mut a, &src)
        .unwrap();
    let (received, parts) = receiver.join().unwrap();
    assert_eq!(received.unwrap().totals, report.totals);
    assert_eq!(parts, vec![Part::Final], "one part, the final set's");
    assert_arrived(&src, &dest, &out);
}

/// The first round sent ahead in slices (a migration's, whose destination loads it as it comes):
/// each part brings the next slice of every file still longer, so that when a part is whole the
/// receiver has each file's first bytes up to it; the bytes sent are the file's once, and a later
/// round and the final set go on from there as without slices.
#[test]
fn a_first_round_in_slices_brings_each_file_s_bytes_in_order_once() {
    let (_tmp, src, out) = dirs();
    let (long, short) = (noise(5 * CHUNK_BYTES / 2 + 100), noise(CHUNK_BYTES / 2));
    write_files(&src, &[("long", &long), ("short", &short), ("empty", b"")]);
    let dest = out.join("image");
    let (mut a, mut b) = pair();
    let d = dest.clone();
    let receiver = thread::spawn(move || {
        let session = receiver_handshake(&mut b, &key(2)).unwrap();
        // The files' lengths as each part sent ahead is whole, and what it brought of the long
        // one; what the final set's parts brought.
        let (mut seen, mut finals) = (Vec::new(), Vec::new());
        let mut watch = on_parts(|dir: &Path, part, brought: &Brought| {
            let len = |n: &str| fs::metadata(dir.join(n)).map_or(0, |m| m.len());
            match part {
                Part::Ahead => seen.push((
                    (len("long"), len("short"), len("empty")),
                    brought.get("long").cloned().unwrap_or_default(),
                )),
                Part::Final => finals.push(brought.clone()),
            }
        });
        let r = receive_dir_watching(&mut b, session, &d, Durability::Synced, &mut watch);
        assert_eq!(finals.len(), 1, "the final set in one part");
        (r.map(|(report, _)| report), (seen, finals))
    });
    let mut sender = DirSender::start(&mut a, &key(2)).unwrap();
    sender.slice_first_round(CHUNK_BYTES as u64);
    let first = sender.send_ahead(&mut a, &src).unwrap();
    let whole = (long.len() + short.len()) as u64;
    assert_eq!(
        first,
        Totals {
            files: 3,
            bytes: whole
        }
    );
    // A later round: not sliced; only the gain goes.
    let gain = noise(2 * CHUNK_BYTES);
    append_to(&src.join("long"), &gain);
    let second = sender.send_ahead(&mut a, &src).unwrap();
    assert_eq!(second.bytes, gain.len() as u64);
    fs::write(src.join("short"), noise(CHUNK_BYTES / 2 + 1)).unwrap();
    let (report, _) = sender.finish(&mut a, &src).unwrap();
    let (got, (seen, finals)) = receiver.join().unwrap();
    assert_eq!(got.unwrap().totals, report.totals);
    let c = CHUNK_BYTES as u64;
    let (l, s, g) = (long.len() as u64, short.len() as u64, gain.len() as u64);
    assert_eq!(
        seen,
        vec![
            ((c, s, 0), vec![(0, c)]),
            ((2 * c, s, 0), vec![(c, c)]),
            ((l, s, 0), vec![(2 * c, l - 2 * c)]),
            ((l + g, s, 0), vec![(l, g)])
        ],
        "one slice of each file a part, then the later round's gain at once, as brought"
    );
    assert_eq!(
        finals[0].get("short"),
        Some(&vec![(0, s + 1)]),
        "the file changed since, brought whole: {:?}",
        finals[0]
    );
    assert_arrived(&src, &dest, &out);
}

/// The first part of the final set sent with the `Cut` while the rest is still written (a
/// migration's GPU images, while CRIU dumps the held job): only the directory named goes, each
/// file that begins with one sent ahead (renamed since, as an engine image is at its commit)
/// with what was written in it since (as told) and its new bytes; the rest of the final set
/// then sends only what that part did not, and the result is the source, bit-exact.
#[test]
fn a_first_part_of_the_final_set_takes_one_directory_and_the_rest_follows() {
    let (_tmp, src, out) = dirs();
    fs::create_dir_all(src.join("gpu/.gpu-0.tmp")).unwrap();
    let data = noise(3 * CHUNK_BYTES);
    write_files(
        &src,
        &[
            ("gpu/.gpu-0.tmp/data-000.bin", &data),
            ("gpu/.gpu-0.tmp/draft.pb", b"draft"),
        ],
    );
    let dest = out.join("image");
    let (mut a, mut sender, receiver) = sender_to(&dest);
    sender.send_ahead(&mut a, &src).unwrap();
    // The cut: one chunk rewritten in place, one appended, the draft gone, the manifest
    // written, the engine's image named; CRIU's directory begins.
    let tmp_data = src.join("gpu/.gpu-0.tmp/data-000.bin");
    rewrite(&tmp_data, CHUNK_BYTES as u64, &noise(CHUNK_BYTES));
    let appended = noise(CHUNK_BYTES / 2);
    append_to(&tmp_data, &appended);
    fs::remove_file(src.join("gpu/.gpu-0.tmp/draft.pb")).unwrap();
    fs::write(src.join("gpu/.gpu-0.tmp/manifest.pb"), b"manifest").unwrap();
    fs::rename(src.join("gpu/.gpu-0.tmp"), src.join("gpu/gpu-0")).unwrap();
    fs::create_dir(src.join("criu")).unwrap();
    fs::write(src.join("criu/pages-1.img"), noise(1000)).unwrap();
    let m = fs::metadata(src.join("gpu/gpu-0/data-000.bin")).unwrap();
    let mut w = Written::new();
    w.add(
        (m.dev(), m.ino()),
        [(CHUNK_BYTES as u64, CHUNK_BYTES as u64)],
    );
    sender.told(w);
    let first = sender
        .send_final_under(&mut a, &src, &["gpu".to_string()])
        .unwrap();
    assert_eq!(
        first,
        Totals {
            files: 2,
            bytes: (CHUNK_BYTES + appended.len() + 8) as u64
        },
        "the rewritten chunk, the appended bytes and the manifest; nothing of CRIU's"
    );
    // CRIU's dump goes on and ends.
    fs::write(src.join("criu/core-1.img"), b"core").unwrap();
    let report = finish(sender, &mut a, &src, receiver);
    assert_eq!(
        report.sent_bytes,
        1000 + 4,
        "the rest of the final set: CRIU's files only"
    );
    assert_eq!(report.totals.files, 4, "both parts counted");
    assert_arrived(&src, &dest, &out);
}

/// A file of the final set's first part that changes before the rest is sent, or one new under
/// its directories, fails the send, naming it; nothing is named at the destination.
#[test]
fn a_first_part_changed_before_the_rest_is_sent_fails_the_send() {
    for case in ["grown", "new"] {
        let (_tmp, src, dest, mut a, sender, receiver) = after_a_first_part();
        let named = match case {
            "grown" => {
                append_to(&src.join("gpu/data"), b"more");
                "gpu/data"
            }
            _ => {
                fs::write(src.join("gpu/late"), b"late").unwrap();
                "gpu/late"
            }
        };
        let e = sender.finish(&mut a, &src).unwrap_err().to_string();
        assert!(e.contains(named) && e.contains("first part"), "{case}: {e}");
        assert!(receiver.join().unwrap().is_err(), "{case}");
        assert!(!dest.exists(), "{case}");
    }
}

/// A directory with `gpu/` (sent ahead, then as the final set's first part) and an empty
/// `criu/`, and a receiver: (the temporary directory, the source, the destination, the
/// sender's end, the sender, the receiver).
fn after_a_first_part() -> (
    tempfile::TempDir,
    PathBuf,
    PathBuf,
    UnixStream,
    DirSender,
    Receiving,
) {
    let (tmp, src, out) = dirs();
    fs::create_dir(src.join("gpu")).unwrap();
    fs::create_dir(src.join("criu")).unwrap();
    write_files(&src, &[("gpu/data", &noise(1000))]);
    let dest = out.join("image");
    let (mut a, mut sender, receiver) = sender_to(&dest);
    sender.send_ahead(&mut a, &src).unwrap();
    sender
        .send_final_under(&mut a, &src, &["gpu".to_string()])
        .unwrap();
    (tmp, src, dest, a, sender, receiver)
}

/// A file filled by several writers at once (the dump's pages relayed) is as long as it will
/// be long before its bytes are there: only the parts within what its writer says is whole go.
#[test]
fn a_growing_file_s_parts_go_only_as_far_as_it_is_whole() {
    let (_tmp, src, _dest, mut a, mut sender, _receiver) = after_a_first_part();
    let part = CHUNK_BYTES as u64;
    let growing = ("criu/pages-1.img", "criu/data.pages");
    let pages = src.join("criu/pages-1.img");
    fs::write(&pages, noise(3 * CHUNK_BYTES)).unwrap();
    let whole = Some(part + 10);
    let one = sender
        .send_growing(&mut a, &src, growing, whole, part, 8)
        .unwrap();
    assert_eq!(
        (one.files, one.bytes),
        (1, part),
        "the one part written whole"
    );
    let none = sender
        .send_growing(&mut a, &src, growing, whole, part, 8)
        .unwrap();
    assert_eq!(none.files, 0, "the file's size is not how far it is whole");
    let all = sender
        .send_growing(&mut a, &src, growing, Some(3 * part), part, 8)
        .unwrap();
    assert_eq!(all.files, 2, "the rest, once whole");
}

/// The parts of a file still being appended to, sent after the final set's first part
/// (`send_growing`, CRIU's pages file while it dumps): once the file is renamed to the name
/// sent in parts, the final set claims them (the same inode, offset and length) and sends only
/// the parts not sent yet; the receiver has every part, bit-exact.
#[test]
fn parts_of_a_growing_file_sent_early_are_not_sent_again() {
    let (_tmp, src, dest, mut a, mut sender, receiver) = after_a_first_part();
    let part = CHUNK_BYTES as u64;
    let growing = ("criu/pages-1.img", "criu/data.pages");
    // Not there yet: nothing sent.
    let none = sender
        .send_growing(&mut a, &src, growing, None, part, 8)
        .unwrap();
    assert_eq!(none, Totals::default());
    let data = noise(3 * CHUNK_BYTES + 500);
    let pages = src.join("criu/pages-1.img");
    fs::write(&pages, &data[..CHUNK_BYTES + 10]).unwrap();
    let one = sender
        .send_growing(&mut a, &src, growing, None, part, 8)
        .unwrap();
    assert_eq!((one.files, one.bytes), (1, part), "the one whole part");
    append_to(&pages, &data[CHUNK_BYTES + 10..]);
    let most = sender
        .send_growing(&mut a, &src, growing, None, part, 1)
        .unwrap();
    assert_eq!(most.files, 1, "at most one at a time");
    let rest = sender
        .send_growing(&mut a, &src, growing, None, part, 8)
        .unwrap();
    assert_eq!(rest.files, 1, "the third part");
    let none = sender
        .send_growing(&mut a, &src, growing, None, part, 8)
        .unwrap();
    assert_eq!(
        none.files, 0,
        "every whole part was sent; the last is not whole"
    );
    // The dump ends: the split renames the pages file to the data file, sent in parts.
    fs::rename(&pages, src.join("criu/data.pages")).unwrap();
    sender.send_in_parts("criu/data.pages", part);
    fs::write(src.join("criu/core-1.img"), b"core").unwrap();
    let report = finish(sender, &mut a, &src, receiver);
    assert_eq!(
        report.sent_bytes,
        500 + 4,
        "the last part and the core only"
    );
    assert_eq!(report.totals.files, 1 + 4 + 1, "every part counted once");
    for (k, want) in data.chunks(CHUNK_BYTES).enumerate() {
        let got = fs::read(dest.join(format!("criu/data.pages.{k}"))).unwrap();
        assert!(got == want, "part {k} differs");
    }
    assert!(!dest.join("criu/pages-1.img").exists());
}

/// Parts sent early that the final set does not claim (the file was not renamed to the name
/// sent; another file is under that name, whose parts differ; the file was written again from
/// its start, `forget_growing`) are removed at the receiver: it holds the final set exactly,
/// and the totals agree.
#[test]
fn parts_sent_early_that_the_final_set_does_not_claim_are_removed() {
    for case in ["not renamed", "another file", "written again"] {
        let (_tmp, src, dest, mut a, mut sender, receiver) = after_a_first_part();
        let part = CHUNK_BYTES as u64;
        let pages = src.join("criu/pages-1.img");
        fs::write(&pages, noise(2 * CHUNK_BYTES)).unwrap();
        let growing = ("criu/pages-1.img", "criu/data.pages");
        let early = sender
            .send_growing(&mut a, &src, growing, None, part, 8)
            .unwrap();
        assert_eq!(early.files, 2, "{case}");
        if case == "another file" {
            let other: Vec<u8> = noise(2 * CHUNK_BYTES).iter().map(|b| !b).collect();
            fs::write(src.join("criu/data.pages"), other).unwrap();
            sender.send_in_parts("criu/data.pages", part);
        }
        if case == "written again" {
            // The same inode, its bytes written again: nothing sent before may be claimed.
            sender.forget_growing();
            let again: Vec<u8> = noise(2 * CHUNK_BYTES).iter().map(|b| b ^ 0x55).collect();
            fs::OpenOptions::new()
                .write(true)
                .open(&pages)
                .unwrap()
                .write_all_at(&again, 0)
                .unwrap();
            let none = sender
                .send_growing(&mut a, &src, growing, None, part, 8)
                .unwrap();
            assert_eq!(none.files, 0, "nothing more once forgotten");
            fs::rename(&pages, src.join("criu/data.pages")).unwrap();
            sender.send_in_parts("criu/data.pages", part);
        }
        let report = finish(sender, &mut a, &src, receiver);
        // gpu/data, the pages file where it was not renamed, and the parts of data.pages.
        let files = match case {
            "not renamed" => 2,
            "another file" => 4,
            _ => 3,
        };
        assert_eq!(report.totals.files, files, "{case}");
        if case != "not renamed" {
            let want = fs::read(src.join("criu/data.pages")).unwrap();
            let mut got = fs::read(dest.join("criu/data.pages.0")).unwrap();
            got.extend(fs::read(dest.join("criu/data.pages.1")).unwrap());
            assert!(
                got == want,
                "{case}: the final set's parts, not the early ones"
            );
        } else {
            assert!(!dest.join("criu/data.pages.0").exists(), "{case}");
            assert!(!dest.join("criu/data.pages.1").exists(), "{case}");
            assert_eq!(snapshot(&dest), snapshot(&src), "{case}");
        }
    }
}

/// `send_growing` before the final set's first part is refused; the receiver is told.
#[test]
fn parts_of_a_growing_file_need_the_first_part_before_them() {
    let (_tmp, src, out) = dirs();
    write_files(&src, &[("pages-1.img", &noise(CHUNK_BYTES))]);
    let dest = out.join("image");
    let (mut a, mut sender, receiver) = sender_to(&dest);
    sender.send_ahead(&mut a, &src).unwrap();
    let e = sender
        .send_growing(
            &mut a,
            &src,
            ("pages-1.img", "data"),
            None,
            CHUNK_BYTES as u64,
            8,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("first part"), "{e}");
    assert!(receiver.join().unwrap().is_err());
    assert!(!dest.exists());
}
