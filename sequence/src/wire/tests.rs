//! Tests of `wire`.
use super::mac::{keyed, HEADER_BYTES};
use super::*;
use crate::auth::HmacKey;
use possum_engine::store::{BufferRecord, ChunkSink};
use std::fs;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(20);

/// Asserts that the `WireError` `$e` is the receiver's refusal `$refusal` (a `ReceiveError`
/// pattern).
macro_rules! assert_refused {
    ($e:expr, $refusal:pat) => {
        assert!(matches!($e, WireError::Receive($refusal)), "{:?}", $e)
    };
}

fn key(b: u8) -> HmacKey {
    HmacKey::from_bytes(vec![b; 32]).unwrap()
}

fn pair() -> (UnixStream, UnixStream) {
    let (a, b) = UnixStream::pair().unwrap();
    for s in [&a, &b] {
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        s.set_write_timeout(Some(TIMEOUT)).unwrap();
    }
    (a, b)
}

fn noise(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut v)
        .unwrap();
    v
}

/// Every entry under `d`: its path, mode, and bytes for a file.
fn snapshot(d: &Path) -> Vec<(String, u32, Option<Vec<u8>>)> {
    fn walk(root: &Path, at: &Path, out: &mut Vec<(String, u32, Option<Vec<u8>>)>) {
        for e in fs::read_dir(at).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_str().unwrap().to_string();
            let m = fs::symlink_metadata(&p).unwrap();
            let mode = m.permissions().mode() & 0o7777;
            if m.is_dir() {
                out.push((rel, mode, None));
                walk(root, &p, out);
            } else {
                out.push((rel, mode, Some(fs::read(&p).unwrap())));
            }
        }
    }
    let mut out = Vec::new();
    walk(d, d, &mut out);
    out.sort();
    out
}

fn names(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// A source directory `tmp/src` and an empty `tmp/out` to receive into.
fn dirs() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let out = tmp.path().join("out");
    fs::create_dir(&src).unwrap();
    fs::create_dir(&out).unwrap();
    (tmp, src, out)
}

/// `send_dir` and `receive_dir` over loopback TCP, each with its key.
fn over_tcp(
    send_key: HmacKey,
    recv_key: HmacKey,
    src: &Path,
    dest: &Path,
) -> (
    Result<SendReport, WireError>,
    Result<ReceiveReport, WireError>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let dest = dest.to_path_buf();
    let receiver = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        set_timeouts(&s, TIMEOUT).unwrap();
        receive_dir(&mut s, &recv_key, &dest)
    });
    let mut s = TcpStream::connect(addr).unwrap();
    set_timeouts(&s, TIMEOUT).unwrap();
    let sent = send_dir(&mut s, &send_key, src);
    drop(s);
    (sent, receiver.join().unwrap())
}

#[test]
fn a_tree_arrives_bit_exact_with_its_modes() {
    let (_tmp, src, out) = dirs();
    fs::create_dir_all(src.join("criu")).unwrap();
    fs::create_dir_all(src.join("gpu/gpu-0/empty")).unwrap();
    fs::write(src.join("possum.json"), "{\"version\":1}").unwrap();
    fs::write(src.join("criu/empty.img"), "").unwrap();
    let big = src.join("gpu/gpu-0/data-000.bin");
    fs::write(&big, noise((5 << 20) + 12345)).unwrap();
    fs::set_permissions(&big, fs::Permissions::from_mode(0o640)).unwrap();
    fs::write(src.join("criu/run.sh"), "#!/bin/sh\n").unwrap();
    fs::set_permissions(src.join("criu/run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::set_permissions(src.join("gpu"), fs::Permissions::from_mode(0o750)).unwrap();
    fs::set_permissions(
        src.join("gpu/gpu-0/empty"),
        fs::Permissions::from_mode(0o500),
    )
    .unwrap();
    let dest = out.join("image");

    let (sent, received) = over_tcp(key(7), key(7), &src, &dest);
    let sent = sent.unwrap();
    let received = received.unwrap();
    let bytes = 13 + (5 << 20) + 12345 + 10;
    assert_eq!(sent.totals, Totals { files: 4, bytes });
    assert_eq!(received.totals, sent.totals);
    assert_eq!(snapshot(&dest), snapshot(&src));
    assert_eq!(
        fs::metadata(&dest).unwrap().permissions().mode() & 0o777,
        0o700
    );
    // Only the destination: no temporary directory left beside it.
    assert_eq!(names(&out), ["image"]);
    // A destination that exists is refused before the handshake.
    let (sent, received) = over_tcp(key(7), key(7), &src, &dest);
    assert!(sent.is_err());
    assert!(
        matches!(
            received,
            Err(WireError::Receive(ReceiveError::DestExists { .. }))
        ),
        "{received:?}"
    );
    assert_eq!(names(&out), ["image"]);
    assert_eq!(snapshot(&dest), snapshot(&src));
}

#[test]
fn another_secret_on_either_side_is_refused_and_nothing_is_written() {
    let (_tmp, src, out) = dirs();
    fs::write(src.join("f"), "data").unwrap();
    let dest = out.join("image");
    let (sent, received) = over_tcp(key(1), key(2), &src, &dest);
    let (sent, received) = (sent.unwrap_err(), received.unwrap_err());
    assert!(
        matches!(
            received,
            WireError::Handshake(HandshakeError::PeerNotAuthenticated { peer: "sender" })
        ),
        "{received:?}"
    );
    assert!(received.to_string().contains("failed authentication"));
    // The receiver wrote nothing after its hello: the sender saw the connection close.
    assert!(
        matches!(sent, WireError::Handshake(HandshakeError::Refused)),
        "{sent:?}"
    );
    assert!(sent.to_string().contains("authentication"), "{sent}");
    assert!(names(&out).is_empty());

    // A receiver that does not hold the secret: the sender refuses it and sends nothing.
    let (mut a, mut b) = pair();
    let impostor = thread::spawn(move || {
        let mut hello = Vec::new();
        hello.extend_from_slice(&MAGIC);
        hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        hello.extend_from_slice(&[5u8; NONCE_BYTES]);
        b.write_all(&hello).unwrap();
        let mut proof = [0u8; PROOF_BYTES];
        b.read_exact(&mut proof).unwrap();
        let (sn, claimed) = (&proof[12..44], &proof[44..44 + CLAIM_BYTES]);
        let answer = keyed(
            &key(9).wire_key(),
            &[SERVER_LABEL, sn, &[5u8; NONCE_BYTES], claimed],
        );
        b.write_all(answer.as_bytes()).unwrap();
        let mut rest = Vec::new();
        b.read_to_end(&mut rest).unwrap();
        rest
    });
    let e = send_dir(&mut a, &key(1), &src).unwrap_err();
    drop(a);
    assert!(
        matches!(
            e,
            WireError::Handshake(HandshakeError::PeerNotAuthenticated { peer: "receiver" })
        ),
        "{e:?}"
    );
    assert!(
        e.to_string().contains("receiver failed authentication"),
        "{e}"
    );
    assert!(impostor.join().unwrap().is_empty());
}

/// Runs `receive_dir` into `dest` against a sender that passes the handshake and then writes
/// what `frames` writes; the receiver's error.
fn against(dest: &Path, frames: impl FnOnce(&mut UnixStream, &mut Session)) -> WireError {
    let (mut a, mut b) = pair();
    let d = dest.to_path_buf();
    let receiver = thread::spawn(move || receive_dir(&mut b, &key(3), &d));
    let mut session = sender_handshake(&mut a, &key(3)).unwrap();
    frames(&mut a, &mut session);
    drop(a);
    receiver.join().unwrap().unwrap_err()
}

/// Writes a frame as a sender does.
fn send(s: &mut UnixStream, session: &mut Session, frame: &Frame<'_>) {
    let _ = write_frame(s, session, frame);
}

/// The header of file 0 of a part: `path`, `size` bytes, `mode`, on no base.
fn file_header(path: &str, size: u64, mode: u32) -> FileHeader {
    FileHeader {
        id: 0,
        path: path.to_string(),
        size,
        mode,
        base: None,
    }
}

/// Writes the start of a part of one file: its header `h`, `Chunks`, then each of `chunks`
/// (offset, bytes) of file 0; no `EndPart`.
fn begin_part(s: &mut UnixStream, session: &mut Session, h: FileHeader, chunks: &[(u64, &[u8])]) {
    send(s, session, &Frame::File(h));
    send(s, session, &Frame::Chunks);
    for &(offset, data) in chunks {
        send(
            s,
            session,
            &Frame::Chunk {
                file: 0,
                offset,
                data,
            },
        );
    }
}

/// Writes a part of one file (not `Done`): `begin_part`, then the `EndPart` that counts its
/// chunks and their bytes.
fn part(s: &mut UnixStream, session: &mut Session, h: FileHeader, chunks: &[(u64, &[u8])]) {
    begin_part(s, session, h, chunks);
    let bytes = chunks.iter().map(|(_, d)| d.len() as u64).sum();
    let chunks = chunks.len() as u64;
    send(s, session, &Frame::EndPart { chunks, bytes });
}

/// Writes a part of one file (not `Done`): its header, `Chunks`, its chunk, `EndPart`.
fn put(s: &mut UnixStream, session: &mut Session, path: &str, data: &[u8]) {
    let h = file_header(path, data.len() as u64, 0o644);
    part(s, session, h, &[(0, data)]);
}

/// Asserts that `e`, in `case`, is the receiver's refusal of frame `seq` of stream 0 for `why`,
/// its message beginning `frame {seq} of stream 0` and holding `says`.
fn assert_misfit(case: &str, e: &WireError, seq: u64, why: Misfit, says: &str) {
    let got = match e {
        WireError::Receive(ReceiveError::Frame(FrameError::Unauthenticated {
            stream: 0,
            seq,
            why,
            ..
        })) => Some((*seq, *why)),
        _ => None,
    };
    assert_eq!(got, Some((seq, why)), "{case}: {e:?}");
    let text = e.to_string();
    let head = format!("frame {seq} of stream 0");
    assert!(text.starts_with(&head), "{case}: {e}");
    assert!(text.contains(says), "{case}: {e}");
}

/// Writes `Done`.
fn done(s: &mut UnixStream, session: &mut Session, totals: Totals) {
    send(s, session, &Frame::Done(totals));
}

/// The bytes of `frame` as `session` would send it next (its MAC counted).
fn encoded(session: &mut Session, frame: &Frame<'_>) -> Vec<u8> {
    let mut v = Vec::new();
    write_frame(&mut v, session, frame).unwrap();
    v
}

/// One file and `Done`.
fn file(path: &str, data: &[u8]) -> impl FnOnce(&mut UnixStream, &mut Session) {
    let path = path.to_string();
    let data = data.to_vec();
    move |s, session| {
        put(s, session, &path, &data);
        let bytes = data.len() as u64;
        done(s, session, Totals { files: 1, bytes });
    }
}

#[test]
fn paths_out_of_the_destination_are_refused_and_nothing_is_written() {
    let (tmp, _src, out) = dirs();
    let dest = out.join("image");
    let outside = tmp.path().join("escaped");
    let absolute = outside.to_str().unwrap().to_string();
    for bad in [
        "../escaped",
        "a/../../escaped",
        absolute.as_str(),
        "",
        "a//b",
        "./a",
        "a/.",
    ] {
        let e = against(&dest, file(bad, b"evil"));
        assert!(
            matches!(e, WireError::Receive(ReceiveError::Path { ref path, .. }) if path == bad),
            "{bad:?}: {e:?}"
        );
        assert!(e.to_string().contains("refused"), "{e}");
        assert!(names(&out).is_empty(), "{bad:?}");
        assert!(!outside.exists());
    }
    // A directory named like that, too.
    let e = against(&dest, |s, session| {
        send(
            s,
            session,
            &Frame::Dir(DirHeader {
                path: "../escaped".into(),
                mode: 0o755,
            }),
        );
    });
    assert!(
        matches!(e, WireError::Receive(ReceiveError::Path { .. })),
        "{e:?}"
    );
    assert!(!outside.exists());
    // A path through a file the sender sent.
    let e = against(&dest, |s, session| {
        put(s, session, "f", b"x");
        put(s, session, "f/g", b"y");
    });
    assert!(
        matches!(
            e,
            WireError::Receive(ReceiveError::Path {
                why: "it goes through a file",
                ..
            })
        ),
        "{e:?}"
    );
    assert!(names(&out).is_empty());
    // A frame over the cap is refused before it is read.
    let e = against(&dest, |s, _| {
        let mut h = [0u8; HEADER_BYTES];
        h[0] = KIND_CHUNK;
        h[1..9].copy_from_slice(&(MAX_FRAME + 1).to_le_bytes());
        let _ = s.write_all(&h);
    });
    assert!(
        matches!(
            e,
            WireError::Receive(ReceiveError::Frame(FrameError::TooLarge { .. }))
        ),
        "{e:?}"
    );
    assert!(names(&out).is_empty());
    // What is well formed is received.
    against_ok(&dest, file("a/b/c", b"fine"));
    assert_eq!(fs::read(dest.join("a/b/c")).unwrap(), b"fine");
}

/// A `Remove` the receiver has no reason to take (before the `Cut`; after it, of a path out
/// of the destination, of a directory, of what was not received, or before its part's chunks)
/// fails the transfer, names nothing outside and leaves nothing; one of a file received since
/// the `Cut` takes it out of the directory and of the totals.
#[test]
fn a_remove_of_what_is_not_a_file_received_since_the_cut_is_refused() {
    let (tmp, _src, out) = dirs();
    let dest = out.join("image");
    let outside = tmp.path().join("kept");
    fs::write(&outside, b"not the receiver's").unwrap();
    fn remove(path: &str) -> Frame<'static> {
        Frame::Remove { path: path.into() }
    }
    type Frames = Box<dyn FnOnce(&mut UnixStream, &mut Session)>;
    let cases: [(&str, Frames); 5] = [
        (
            "before the cut",
            Box::new(|s, session| {
                put(s, session, "f", b"x");
                send(s, session, &remove("f"));
            }),
        ),
        (
            "out of the destination",
            Box::new(|s, session| {
                send(s, session, &Frame::Cut);
                send(s, session, &remove("../../kept"));
            }),
        ),
        (
            "a directory",
            Box::new(|s, session| {
                send(s, session, &Frame::Cut);
                put(s, session, "d/f", b"x");
                send(s, session, &remove("d"));
            }),
        ),
        (
            "not received",
            Box::new(|s, session| {
                send(s, session, &Frame::Cut);
                send(s, session, &remove("nothing"));
            }),
        ),
        (
            "before its part's chunks",
            Box::new(|s, session| {
                send(s, session, &Frame::Cut);
                send(s, session, &Frame::File(file_header("f", 1, 0o600)));
                send(s, session, &remove("f"));
            }),
        ),
    ];
    for (case, frames) in cases {
        let e = against(&dest, frames);
        assert!(matches!(e, WireError::Receive(_)), "{case}: {e:?}");
        assert!(names(&out).is_empty(), "{case}");
        assert_eq!(fs::read(&outside).unwrap(), b"not the receiver's", "{case}");
    }
    against_ok(&dest, |s, session| {
        send(s, session, &Frame::Cut);
        put(s, session, "early", b"sent while written");
        put(s, session, "kept", b"final");
        send(s, session, &remove("early"));
        done(s, session, Totals { files: 1, bytes: 5 });
    });
    assert_eq!(names(&dest), ["kept"]);
}

fn against_ok(dest: &Path, frames: impl FnOnce(&mut UnixStream, &mut Session)) {
    let (mut a, mut b) = pair();
    let d = dest.to_path_buf();
    let receiver = thread::spawn(move || receive_dir(&mut b, &key(3), &d));
    let mut session = sender_handshake(&mut a, &key(3)).unwrap();
    frames(&mut a, &mut session);
    let mut buf = Vec::new();
    assert!(matches!(
        read_frame(&mut a, &mut session, &mut buf).unwrap(),
        Frame::Committed(_)
    ));
    receiver.join().unwrap().unwrap();
}

#[test]
fn a_connection_dropped_mid_file_fails_and_nothing_is_written() {
    let (_tmp, _src, out) = dirs();
    let dest = out.join("image");
    let e = against(&dest, |s, session| {
        let data = noise(1 << 20);
        let h = file_header("criu/pages-1.img", 2 << 20, 0o600);
        begin_part(s, session, h, &[(0, &data)]);
        // Half a frame, then the close.
        let _ = s.write_all(&[KIND_CHUNK, 1, 0]);
    });
    assert!(
        matches!(
            e,
            WireError::Receive(ReceiveError::Frame(FrameError::Closed))
        ),
        "{e:?}"
    );
    assert!(names(&out).is_empty());
    // A file shorter than its size, its part ended: refused too.
    let e = against(&dest, |s, session| {
        part(s, session, file_header("f", 10, 0o600), &[(0, b"12345")]);
    });
    assert_refused!(
        e,
        ReceiveError::Size {
            size: 10,
            got: 5,
            ..
        }
    );
    assert!(names(&out).is_empty());
    // Two chunks of the same bytes, or one past the file's end.
    for (offset, data) in [(3u64, &b"45678"[..]), (8, b"90abc")] {
        let e = against(&dest, |s, session| {
            let chunks = [(0, &b"12345"[..]), (offset, data)];
            part(s, session, file_header("f", 10, 0o600), &chunks);
        });
        assert!(
            matches!(
                e,
                WireError::Receive(ReceiveError::Overlap { offset: 3, .. })
                    | WireError::Receive(ReceiveError::OutOfRange { offset: 8, .. })
            ),
            "{e:?}"
        );
        assert!(names(&out).is_empty());
    }
}

#[test]
fn a_chunk_damaged_in_transit_is_detected_and_nothing_is_written() {
    let (_tmp, src, out) = dirs();
    fs::write(src.join("data.bin"), noise(3 << 20)).unwrap();
    let dest = out.join("image");
    // sender <-> (a, pa) proxy (pb, b) <-> receiver; the proxy flips one byte of the first
    // chunk's data.
    let (mut a, pa) = pair();
    let (pb, mut b) = pair();
    let d = dest.clone();
    let receiver = thread::spawn(move || receive_dir(&mut b, &key(4), &d));
    let (mut pa2, mut pb2) = (pa.try_clone().unwrap(), pb.try_clone().unwrap());
    let back = thread::spawn(move || {
        let _ = io::copy(&mut pb2, &mut pa2);
        let _ = pa2.shutdown(std::net::Shutdown::Both);
        let _ = pb2.shutdown(std::net::Shutdown::Both);
    });
    let forth = thread::spawn(move || {
        let (mut pa, mut pb) = (pa, pb);
        // The proof, the file's header, `Chunks`: a few hundred bytes; this is in its data.
        let flip_at = PROOF_BYTES + 1_000_000;
        let mut seen = 0usize;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let k = match pa.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(k) => k,
            };
            if (seen..seen + k).contains(&flip_at) {
                buf[flip_at - seen] ^= 0x40;
            }
            seen += k;
            if pb.write_all(&buf[..k]).is_err() {
                break;
            }
        }
        let _ = pa.shutdown(std::net::Shutdown::Both);
        let _ = pb.shutdown(std::net::Shutdown::Both);
    });
    let sent = send_dir(&mut a, &key(4), &src);
    drop(a);
    let received = receiver.join().unwrap();
    forth.join().unwrap();
    back.join().unwrap();
    assert!(sent.is_err(), "{sent:?}");
    let e = received.unwrap_err();
    assert!(
        matches!(
            e,
            WireError::Receive(ReceiveError::Frame(FrameError::Unauthenticated {
                kind: KIND_CHUNK,
                stream: 0,
                why: Misfit::Changed,
                ..
            }))
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("a Chunk of"), "{e}");
    assert!(e.to_string().contains("changed in transit"), "{e}");
    assert!(names(&out).is_empty());
}

/// A frame changed (its MAC kept), dropped, replayed or reordered is refused, the error naming
/// the frame and what it is; nothing is written.
#[test]
fn a_frame_changed_dropped_replayed_or_reordered_is_refused_naming_it() {
    let (_tmp, _src, out) = dirs();
    let dest = out.join("image");
    let header = |path: &str| Frame::File(file_header(path, 4, 0o644));
    type Frames = Box<dyn FnOnce(&mut UnixStream, &mut Session)>;
    let cases: [(&str, Frames, u64, Misfit, &str); 4] = [
        (
            // What a man in the middle would send: the chunk's bytes changed.
            "changed",
            Box::new(move |s, session| {
                send(s, session, &header("f"));
                send(s, session, &Frame::Chunks);
                let good = Frame::Chunk {
                    file: 0,
                    offset: 0,
                    data: b"good",
                };
                let mut wire = encoded(session, &good);
                let at = wire.len() - TAG_BYTES - 4;
                wire[at..at + 4].copy_from_slice(b"evil");
                let _ = s.write_all(&wire);
            }),
            2,
            Misfit::Changed,
            "frame 2 of stream 0, a Chunk",
        ),
        (
            // A frame left out: the next is early.
            "dropped",
            Box::new(move |s, session| {
                send(s, session, &header("f"));
                let dir = DirHeader {
                    path: "d".into(),
                    mode: 0o755,
                };
                let _ = encoded(session, &Frame::Dir(dir));
                send(s, session, &Frame::Chunks);
            }),
            1,
            Misfit::Early { is: 2 },
            "dropped or reordered",
        ),
        (
            // A frame sent twice.
            "replayed",
            Box::new(move |s, session| {
                let wire = encoded(session, &header("f"));
                let _ = s.write_all(&wire);
                let _ = s.write_all(&wire);
            }),
            1,
            Misfit::Replayed { of: 0 },
            "a replay",
        ),
        (
            // Two frames in the other order.
            "reordered",
            Box::new(move |s, session| {
                let first = encoded(session, &header("f"));
                let second = encoded(session, &Frame::Chunks);
                let _ = s.write_all(&second);
                let _ = s.write_all(&first);
            }),
            0,
            Misfit::Early { is: 1 },
            "dropped or reordered",
        ),
    ];
    for (case, frames, seq, why, says) in cases {
        let e = against(&dest, frames);
        assert_misfit(case, &e, seq, why, says);
        assert!(names(&out).is_empty(), "{case}");
    }
}

#[test]
fn a_confirmation_not_under_the_sessions_mac_fails_the_send() {
    let (_tmp, src, _out) = dirs();
    fs::write(src.join("f"), "data").unwrap();
    let (mut a, mut b) = pair();
    let receiver = thread::spawn(move || {
        let mut session = receiver_handshake(&mut b, &key(8)).unwrap();
        let mut buf = Vec::new();
        loop {
            let f = read_frame(&mut b, &mut session, &mut buf).unwrap();
            if let Frame::Done(totals) = f {
                let mut forged = encoded(&mut session, &Frame::Committed(totals));
                let last = forged.len() - 1;
                forged[last] ^= 1;
                b.write_all(&forged).unwrap();
                return;
            }
        }
    });
    let e = send_dir(&mut a, &key(8), &src).unwrap_err();
    receiver.join().unwrap();
    assert!(
        matches!(
            e,
            WireError::Send(SendError::Frame(FrameError::Unauthenticated {
                kind: KIND_COMMITTED,
                ..
            }))
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("a Committed"), "{e}");
}

#[test]
fn a_symbolic_link_in_the_source_is_refused_naming_it() {
    let (_tmp, src, out) = dirs();
    fs::create_dir(src.join("criu")).unwrap();
    fs::write(src.join("criu/a.img"), "a").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", src.join("criu/link")).unwrap();
    let dest = out.join("image");
    let (sent, received) = over_tcp(key(5), key(5), &src, &dest);
    let sent = sent.unwrap_err();
    assert!(
        matches!(
            sent,
            WireError::Send(SendError::Unsupported { ref path, .. }) if path.ends_with("criu/link")
        ),
        "{sent:?}"
    );
    assert!(
        sent.to_string().contains("criu/link: a symbolic link"),
        "{sent}"
    );
    // The receiver was told why.
    let received = received.unwrap_err();
    assert!(
        matches!(
            received,
            WireError::Receive(ReceiveError::Aborted { ref reason }) if reason.contains("criu/link")
        ),
        "{received:?}"
    );
    assert!(names(&out).is_empty());
}

#[test]
fn a_silent_sender_times_out_and_nothing_is_written() {
    let (_tmp, _src, out) = dirs();
    let dest = out.join("image");
    let (a, mut b) = pair();
    b.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let e = receive_dir(&mut b, &key(6), &dest).unwrap_err();
    drop(a);
    assert!(
        matches!(
            e,
            WireError::Handshake(HandshakeError::Io { ref source, .. })
                if matches!(source.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
        ),
        "{e:?}"
    );
    assert!(names(&out).is_empty());
}

/// Sends `src` into `dest`, then the hand-off: the receiver, after the first `Released`,
/// answers `outcome` and waits for a second `Released`; the sender sends the first, hears
/// `outcome`, and sends that first `Released` again. Asserts the receiver refuses it as a
/// replay; the sender's report.
fn hand_off_with_a_replayed_release(src: &Path, dest: PathBuf, outcome: Outcome) -> SendReport {
    let (mut a, mut b) = pair();
    let answer = outcome.clone();
    let receiver = thread::spawn(move || {
        let (_, mut session) = receive_dir_session(&mut b, &key(1), &dest).unwrap();
        await_released(&mut b, &mut session).unwrap();
        send_outcome(&mut b, &mut session, &answer).unwrap();
        await_released(&mut b, &mut session)
    });
    let (report, mut session) = send_dir_session(&mut a, &key(1), src).unwrap();
    let released = encoded(&mut session, &Frame::Released);
    a.write_all(&released).unwrap();
    assert_eq!(await_outcome(&mut a, &mut session).unwrap(), outcome);
    a.write_all(&released).unwrap();
    let replayed = receiver.join().unwrap();
    assert!(
        matches!(
            replayed,
            Err(HandoffError::Frame(FrameError::Unauthenticated {
                kind: KIND_RELEASED,
                why: Misfit::Replayed { .. },
                ..
            }))
        ),
        "{replayed:?}"
    );
    report
}

/// After `Committed`: `Released` then `Outcome`, each under the session's MAC; one sent again
/// (a replay) is refused.
#[test]
fn the_hand_off_after_a_transfer_is_authenticated_by_the_session() {
    let (_tmp, src, out) = dirs();
    fs::write(src.join("a"), b"image").unwrap();
    let outcome = Outcome::RestoreFailed {
        reason: "no CRIU here".into(),
    };
    let report = hand_off_with_a_replayed_release(&src, out.join("img"), outcome);
    assert_eq!(report.totals, Totals { files: 1, bytes: 5 });
    assert_eq!(fs::read(out.join("img/a")).unwrap(), b"image");
}

/// A restore held for the go: `Restored`, the second `Released` (the go), then `Running`,
/// each after the one before: the first `Released` replayed as the go is refused.
#[test]
fn the_go_after_a_held_restore_is_chained_to_it() {
    let (_tmp, src, out) = dirs();
    fs::write(src.join("a"), b"image").unwrap();
    hand_off_with_a_replayed_release(&src, out.join("img"), Outcome::Restored { pid: 7 });
}

/// A paced stream writes everything, in bursts of at most a twentieth of its rate.
#[test]
fn a_paced_stream_writes_in_bursts_of_its_rate() {
    #[derive(Default)]
    struct Writes(Vec<usize>, Vec<u8>);
    impl Write for Writes {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.push(buf.len());
            self.1.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let mut p = Paced::new(
        Writes::default(),
        std::sync::Arc::new(Pacer::new(2_000_000)),
    );
    let data = noise(300_000);
    p.write_all(&data).unwrap();
    let w = p.get_mut();
    assert_eq!(w.1, data);
    assert_eq!(w.0.iter().max(), Some(&100_000), "{:?}", w.0);
    assert_eq!(w.0.len(), 3, "{:?}", w.0);
}

/// Streams that share a pacer, each writing as soon as it may, write at its rate together: by
/// any time, no more than a burst ahead of it, and, over a long send, within 5% of it; after
/// an idle while, one burst at once, not what the idle while would have allowed.
#[test]
fn streams_sharing_a_pacer_hold_its_rate_together() {
    let rate = 500_000_000u64;
    let pacer = Pacer::new(rate);
    let n = 4 << 20;
    // Each stream's next write, when it is ready (seconds after the start).
    let mut ready = [0.0f64, 0.0001, 0.0002, 0.0003];
    let mut sent = 0u64;
    let mut last = 0.0;
    for _ in 0..2000 {
        let (s, &at) = ready
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(b.1))
            .unwrap();
        // Writes of at most a burst at a time, as `Paced` writes.
        let mut left = n;
        let mut t = at;
        while left > 0 {
            let k = left.min(pacer.burst());
            let go = pacer.take_at(k, Duration::from_secs_f64(t)).as_secs_f64();
            assert!(go >= t);
            sent += k;
            let allowed = rate as f64 * go + pacer.burst() as f64;
            assert!(sent as f64 <= allowed + 1.0, "{sent} bytes by {go} s");
            t = go;
            left -= k;
        }
        ready[s] = t + 0.001;
        last = t;
    }
    let achieved = sent as f64 / last;
    assert!(
        (achieved / rate as f64 - 1.0).abs() < 0.05,
        "{achieved} bytes/s, not {rate}"
    );
    // Ten idle seconds: then one burst at once, and the rate again.
    let idle = last + 10.0;
    let first = pacer.take_at(pacer.burst(), Duration::from_secs_f64(idle));
    assert_eq!(first.as_secs_f64(), idle);
    let second = pacer.take_at(pacer.burst(), Duration::from_secs_f64(idle));
    let gap = second.as_secs_f64() - idle;
    let want = pacer.burst() as f64 / rate as f64;
    assert!((gap - want).abs() < 1e-6, "{gap} s after a burst");
}

#[test]
fn rates_parse_in_bytes_and_bits_and_garbage_is_refused_saying_why() {
    for (text, bytes) in [
        ("500MB/s", 500_000_000),
        ("500MB", 500_000_000),
        ("10Gbit", 1_250_000_000),
        ("10Gbit/s", 1_250_000_000),
        ("10Gbps", 1_250_000_000),
        ("800Mbit", 100_000_000),
        ("1.5GiB/s", 1_610_612_736),
        ("64KiB", 65_536),
        ("2kB/s", 2_000),
        ("250000000", 250_000_000),
        (" 1 GB/s ", 1_000_000_000),
    ] {
        assert_eq!(parse_rate(text), Ok(bytes), "{text}");
    }
    for (text, says) in [
        ("fast", "is not a rate"),
        ("", "is not a rate"),
        ("-5MB", "is not a rate"),
        ("MB", "is not a rate"),
        ("1.2.3MB", "is not a rate"),
        ("10Mb", "could be bits or bytes"),
        ("5 parsecs", "unknown unit"),
        ("5XB", "unknown unit"),
        ("0", "at least 1 byte"),
        ("0.5bit", "at least 1 byte"),
        ("99999999999999999999TB", "more bytes a second"),
    ] {
        let e = parse_rate(text).unwrap_err();
        assert!(e.to_string().contains(says), "{text}: {e}");
    }
}

/// A sender's session and its receiver's, made without a handshake.
fn sessions() -> (Session, Session) {
    let (k, rn, sn) = ([1u8; 32], [2u8; 32], [3u8; 32]);
    (
        Session::new(&k, &rn, &sn, 1, true),
        Session::new(&k, &rn, &sn, 1, false),
    )
}

/// A destination's `Demand`s before its `Outcome` are told to whoever waits for the outcome
/// with demands in mind; to one without, a `Demand` is not due.
#[test]
fn demands_before_an_outcome_are_told_and_refused_where_not_due() {
    let (mut a, mut b) = pair();
    let (mut src, mut dst) = sessions();
    send_demand(&mut a, &mut src, 3).unwrap();
    send_demand(&mut a, &mut src, 5).unwrap();
    send_outcome(&mut a, &mut src, &Outcome::Running { pid: 7 }).unwrap();
    let mut got = Vec::new();
    let mut tell = |p| got.push(p);
    let o = await_outcome_or_demands(&mut b, &mut dst, Some(&mut tell)).unwrap();
    assert_eq!(o, Outcome::Running { pid: 7 });
    assert_eq!(got, [3, 5]);
    send_demand(&mut a, &mut src, 1).unwrap();
    let e = await_outcome(&mut b, &mut dst).unwrap_err();
    assert!(
        matches!(e, HandoffError::Unexpected { got: "Demand", .. }),
        "{e}"
    );
}

#[test]
fn frames_read_back_as_written() {
    let frames = [
        Frame::Dir(DirHeader {
            path: "a".into(),
            mode: 0o755,
        }),
        Frame::File(FileHeader {
            id: 0,
            path: "a/b".into(),
            size: 3,
            mode: 0o600,
            base: None,
        }),
        Frame::Chunks,
        Frame::Chunk {
            file: 0,
            offset: 0,
            data: b"abc",
        },
        Frame::EndPart {
            chunks: 1,
            bytes: 3,
        },
        Frame::Cut,
        Frame::Done(Totals { files: 1, bytes: 3 }),
        Frame::Committed(Totals { files: 1, bytes: 3 }),
        Frame::Abort {
            reason: "why".into(),
        },
        Frame::Released,
        Frame::Outcome(Outcome::Running { pid: 4242 }),
        Frame::Outcome(Outcome::Synced {
            pid: 4243,
            waited: Some(Duration::from_micros(412_345)),
        }),
        Frame::Outcome(Outcome::Synced {
            pid: 4243,
            waited: None,
        }),
        Frame::Outcome(Outcome::RestoreFailed {
            reason: "no room".into(),
        }),
        Frame::Buffer(BufferRecord {
            id: 1,
            va: 2,
            size: 3,
            prefetch_rank: 4,
        }),
        Frame::BufferChunk {
            buffer: 1,
            offset: 2,
            data: b"xyz",
        },
        Frame::Remove {
            path: "criu/data.pages.3".into(),
        },
        Frame::LoadQuery,
        Frame::Loaded {
            loaded: 10 << 30,
            left: 7,
        },
    ];
    let (mut sender, mut receiver) = sessions();
    let mut wire = Vec::new();
    for f in &frames {
        write_frame(&mut wire, &mut sender, f).unwrap();
    }
    let mut r = &wire[..];
    let mut buf = Vec::new();
    for f in &frames {
        assert_eq!(&read_frame(&mut r, &mut receiver, &mut buf).unwrap(), f);
    }
    assert!(matches!(
        read_frame(&mut r, &mut receiver, &mut buf),
        Err(FrameError::Closed)
    ));
    // The receiver's own frames do not read as the sender's.
    let mut wire = Vec::new();
    write_frame(&mut wire, &mut receiver, &Frame::Released).unwrap();
    assert!(matches!(
        read_frame(&mut &wire[..], &mut receiver, &mut buf),
        Err(FrameError::Unauthenticated { .. })
    ));
    // A JSON header with a field it does not have is malformed (its MAC sound).
    let (mut sender, mut receiver) = sessions();
    let payload = br#"{"path":"a","mode":1,"owner":0}"#;
    let mut header = [0u8; HEADER_BYTES];
    header[0] = KIND_DIR;
    header[1..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let tag = sender.send.seal(&header, payload, &blake3::hash(&[]));
    let mut w = header.to_vec();
    w.extend_from_slice(payload);
    w.extend_from_slice(&tag);
    assert!(matches!(
        read_frame(&mut &w[..], &mut receiver, &mut buf),
        Err(FrameError::Malformed { kind: "Dir", .. })
    ));
}

#[test]
fn precopy_rounds_reach_the_sink_the_later_bytes_winning() {
    use possum_engine::store::{ChunkSource, MemStore};
    let (mut a, mut b) = pair();
    let recv = thread::spawn(move || {
        let mut session = receiver_handshake(&mut b, &key(3)).unwrap();
        receive_precopy(&mut b, &mut session, MemStore::new(), Ok).unwrap()
    });
    let session = sender_handshake(&mut a, &key(3)).unwrap();
    let sender = PrecopySender::new(a, session);
    let rec = |id, size| BufferRecord {
        id,
        va: 0x1000 * id,
        size,
        prefetch_rank: u32::MAX,
    };
    let big = noise(CHUNK_BYTES + 100);
    // Round 1: both buffers; round 2: the second one again, changed.
    sender.add_buffer(rec(1, 64)).unwrap();
    sender.write_chunk(1, 0, &[7u8; 64]).unwrap();
    sender.add_buffer(rec(2, big.len() as u64)).unwrap();
    sender.write_chunk(2, 0, &noise(big.len())).unwrap();
    sender.add_buffer(rec(2, big.len() as u64)).unwrap();
    sender.write_chunk(2, 0, &big).unwrap();
    let sent = sender.sent();
    assert_eq!(sent.files, 3);
    assert_eq!(sent.bytes, 64 + 2 * big.len() as u64);
    let (confirmed, _stream) = sender.finish().unwrap();
    let (got, store) = recv.join().unwrap();
    assert_eq!(confirmed, sent);
    assert_eq!(got, sent);
    assert_eq!(store.buffer_bytes(1).unwrap(), vec![7u8; 64]);
    let mut back = vec![0u8; big.len()];
    for (off, len) in store.chunks(2) {
        let o = off as usize;
        store
            .read_chunk(2, off, &mut back[o..o + len as usize])
            .unwrap();
    }
    assert_eq!(back, big);
}

#[test]
fn a_precopy_chunk_changed_in_transit_is_refused() {
    use possum_engine::store::MemStore;
    let (mut a, mut b) = pair();
    let recv = thread::spawn(move || {
        let mut session = receiver_handshake(&mut b, &key(4)).unwrap();
        receive_precopy(&mut b, &mut session, MemStore::new(), |_| Ok(()))
    });
    let mut session = sender_handshake(&mut a, &key(4)).unwrap();
    let rec = BufferRecord {
        id: 1,
        va: 0x1000,
        size: 8,
        prefetch_rank: 0,
    };
    write_frame(&mut a, &mut session, &Frame::Buffer(rec)).unwrap();
    // The MAC of one chunk, the bytes of another.
    let chunk = Frame::BufferChunk {
        buffer: 1,
        offset: 0,
        data: &[1u8; 8],
    };
    let mut wire = encoded(&mut session, &chunk);
    let at = wire.len() - TAG_BYTES - 8;
    wire[at..at + 8].copy_from_slice(&[2u8; 8]);
    a.write_all(&wire).unwrap();
    write_frame(
        &mut a,
        &mut session,
        &Frame::Done(Totals { files: 1, bytes: 8 }),
    )
    .unwrap();
    let e = recv.join().unwrap().unwrap_err();
    assert!(
        matches!(
            e,
            ReceiveError::Frame(FrameError::Unauthenticated {
                kind: KIND_BUFFER_CHUNK,
                ..
            })
        ),
        "{e:?}"
    );
    let mut buf = Vec::new();
    assert!(matches!(
        read_frame(&mut a, &mut session, &mut buf),
        Ok(Frame::Abort { .. })
    ));
}

// Directories sent ahead while they are written (pre-copy rounds, patches of files rewritten
// in place) and sessions of several streams: `tests/ahead.rs`.
mod ahead;
mod load_wait;
