//! Tests of `wire`.
use super::*;
use std::net::TcpListener;
use std::os::unix::net::UnixStream;
use std::thread;

const TIMEOUT: Duration = Duration::from_secs(20);

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
        let mut proof = [0u8; 8 + 4 + NONCE_BYTES + TAG_BYTES];
        b.read_exact(&mut proof).unwrap();
        b.write_all(
            &tag(&key(9), SERVER_LABEL, &proof[12..44], &[5u8; NONCE_BYTES])
                .finalize()
                .into_bytes(),
        )
        .unwrap();
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
    let _ = write_frame_to(s, frame, Some(&mut session.frames));
}

/// Writes a file's frames (not `Done`).
fn put(s: &mut UnixStream, session: &mut Session, path: &str, data: &[u8]) {
    let h = FileHeader {
        path: path.to_string(),
        size: data.len() as u64,
        mode: 0o644,
        base: None,
    };
    send(s, session, &Frame::File(h));
    send(s, session, &Frame::Chunk { offset: 0, data });
    send(s, session, &Frame::EndFile);
}

/// Writes `Done`, sealed.
fn done(s: &mut UnixStream, session: &mut Session, totals: Totals) {
    let tag = session.done(&totals).finalize().into_bytes().into();
    let _ = write_frame(s, &Frame::Done(Seal { totals, tag }));
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
    let e = against(&dest, |s, _| {
        let _ = write_frame(
            s,
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

fn against_ok(dest: &Path, frames: impl FnOnce(&mut UnixStream, &mut Session)) {
    let (mut a, mut b) = pair();
    let d = dest.to_path_buf();
    let receiver = thread::spawn(move || receive_dir(&mut b, &key(3), &d));
    let mut session = sender_handshake(&mut a, &key(3)).unwrap();
    frames(&mut a, &mut session);
    let mut buf = Vec::new();
    assert!(matches!(
        read_frame(&mut a, &mut buf).unwrap(),
        Frame::Committed(_)
    ));
    receiver.join().unwrap().unwrap();
}

#[test]
fn a_connection_dropped_mid_file_fails_and_nothing_is_written() {
    let (_tmp, _src, out) = dirs();
    let dest = out.join("image");
    let e = against(&dest, |s, _| {
        let data = noise(1 << 20);
        write_frame(
            s,
            &Frame::File(FileHeader {
                path: "criu/pages-1.img".into(),
                size: 2 << 20,
                mode: 0o600,
                base: None,
            }),
        )
        .unwrap();
        write_frame(
            s,
            &Frame::Chunk {
                offset: 0,
                data: &data,
            },
        )
        .unwrap();
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
    // A file shorter than its size, ended: refused too.
    let e = against(&dest, |s, _| {
        let _ = write_frame(
            s,
            &Frame::File(FileHeader {
                path: "f".into(),
                size: 10,
                mode: 0o600,
                base: None,
            }),
        );
        let _ = write_frame(
            s,
            &Frame::Chunk {
                offset: 0,
                data: b"12345",
            },
        );
        let _ = write_frame(s, &Frame::EndFile);
    });
    assert!(
        matches!(
            e,
            WireError::Receive(ReceiveError::Size {
                size: 10,
                got: 5,
                ..
            })
        ),
        "{e:?}"
    );
    assert!(names(&out).is_empty());
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
        // The proof is 76 bytes; the file's header frame is under 100: this is in its data.
        let flip_at = 76 + 1_000_000;
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
            WireError::Receive(ReceiveError::Frame(FrameError::Checksum {
                kind: "Chunk",
                ..
            }))
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("checksum"), "{e}");
    assert!(names(&out).is_empty());
}

#[test]
fn frames_changed_with_their_checksums_fixed_are_refused_by_their_hmac() {
    let (_tmp, _src, out) = dirs();
    let dest = out.join("image");
    // What a man in the middle would send: another chunk, its checksum right.
    let e = against(&dest, |s, session| {
        let h = FileHeader {
            path: "f".into(),
            size: 4,
            mode: 0o644,
            base: None,
        };
        send(s, session, &Frame::File(h));
        let good = Frame::Chunk {
            offset: 0,
            data: b"good",
        };
        write_frame_to(&mut io::sink(), &good, Some(&mut session.frames)).unwrap();
        let _ = write_frame(
            s,
            &Frame::Chunk {
                offset: 0,
                data: b"evil",
            },
        );
        send(s, session, &Frame::EndFile);
        done(s, session, Totals { files: 1, bytes: 4 });
    });
    assert!(
        matches!(e, WireError::Receive(ReceiveError::Forged)),
        "{e:?}"
    );
    assert!(e.to_string().contains("changed in transit"), "{e}");
    assert!(names(&out).is_empty());
    // A frame left out.
    let e = against(&dest, |s, session| {
        put(s, session, "a", b"1");
        write_frame_to(
            &mut io::sink(),
            &Frame::Dir(DirHeader {
                path: "d".into(),
                mode: 0o755,
            }),
            Some(&mut session.frames),
        )
        .unwrap();
        done(s, session, Totals { files: 1, bytes: 1 });
    });
    assert!(
        matches!(e, WireError::Receive(ReceiveError::Forged)),
        "{e:?}"
    );
    assert!(names(&out).is_empty());
}

#[test]
fn a_confirmation_without_the_sessions_hmac_fails_the_send() {
    let (_tmp, src, _out) = dirs();
    fs::write(src.join("f"), "data").unwrap();
    let (mut a, mut b) = pair();
    let receiver = thread::spawn(move || {
        let mut session = receiver_handshake(&mut b, &key(8)).unwrap();
        let mut buf = Vec::new();
        loop {
            let f = read_frame_from(&mut b, &mut buf, Some(&mut session.frames)).unwrap();
            if let Frame::Done(d) = f {
                let forged = Seal {
                    totals: d.totals,
                    tag: [0; TAG_BYTES],
                };
                write_frame(&mut b, &Frame::Committed(forged)).unwrap();
                return;
            }
        }
    });
    let e = send_dir(&mut a, &key(8), &src).unwrap_err();
    receiver.join().unwrap();
    assert!(matches!(e, WireError::Send(SendError::Forged)), "{e:?}");
    assert!(e.to_string().contains("not known to be complete"), "{e}");
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

/// After `Committed`: `Released` then `Outcome`, each checked under the session's key; one
/// from another session (a replay) is refused.
#[test]
fn the_hand_off_after_a_transfer_is_authenticated_by_the_session() {
    let (_tmp, src, out) = dirs();
    fs::write(src.join("a"), b"image").unwrap();
    let (mut a, mut b) = pair();
    let dest = out.join("img");
    let receiver = thread::spawn(move || {
        let (_, mut session) = receive_dir_session(&mut b, &key(1), &dest).unwrap();
        await_released(&mut b, &mut session).unwrap();
        let outcome = Outcome::RestoreFailed {
            reason: "no CRIU here".into(),
        };
        send_outcome(&mut b, &mut session, &outcome).unwrap();
        // Another session's Released (here: this one's, replayed) is refused.
        await_released(&mut b, &mut session)
    });
    let (report, mut session) = send_dir_session(&mut a, &key(1), &src).unwrap();
    assert_eq!(report.totals, Totals { files: 1, bytes: 5 });
    let tag: [u8; TAG_BYTES] = session.released().finalize().into_bytes().into();
    send_released(&mut a, &mut session).unwrap();
    assert_eq!(
        await_outcome(&mut a, &mut session).unwrap(),
        Outcome::RestoreFailed {
            reason: "no CRIU here".into()
        }
    );
    write_frame(&mut a, &Frame::Released { tag }).unwrap();
    let replayed = receiver.join().unwrap();
    assert!(
        matches!(replayed, Err(HandoffError::Forged { what: "Released" })),
        "{replayed:?}"
    );
    assert_eq!(fs::read(out.join("img/a")).unwrap(), b"image");
}

/// A restore held for the go: `Restored`, the second `Released` (the go), then `Running`,
/// each chained to the one before: the first `Released` replayed as the go is refused.
#[test]
fn the_go_after_a_held_restore_is_chained_to_it() {
    let (_tmp, src, out) = dirs();
    fs::write(src.join("a"), b"image").unwrap();
    let (mut a, mut b) = pair();
    let dest = out.join("img");
    let receiver = thread::spawn(move || {
        let (_, mut session) = receive_dir_session(&mut b, &key(1), &dest).unwrap();
        await_released(&mut b, &mut session).unwrap();
        send_outcome(&mut b, &mut session, &Outcome::Restored { pid: 7 }).unwrap();
        await_released(&mut b, &mut session).unwrap();
        send_outcome(&mut b, &mut session, &Outcome::Running { pid: 7 }).unwrap();
        // The first go replayed: refused.
        await_released(&mut b, &mut session)
    });
    let (_, mut session) = send_dir_session(&mut a, &key(1), &src).unwrap();
    send_released(&mut a, &mut session).unwrap();
    assert_eq!(
        await_outcome(&mut a, &mut session).unwrap(),
        Outcome::Restored { pid: 7 }
    );
    let go: [u8; TAG_BYTES] = session.released().finalize().into_bytes().into();
    send_released(&mut a, &mut session).unwrap();
    assert_eq!(
        await_outcome(&mut a, &mut session).unwrap(),
        Outcome::Running { pid: 7 }
    );
    write_frame(&mut a, &Frame::Released { tag: go }).unwrap();
    let replayed = receiver.join().unwrap();
    assert!(
        matches!(replayed, Err(HandoffError::Forged { what: "Released" })),
        "{replayed:?}"
    );
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
    let mut p = Paced::new(Writes::default(), 2_000_000);
    let data = noise(300_000);
    p.write_all(&data).unwrap();
    let w = p.get_mut();
    assert_eq!(w.1, data);
    assert_eq!(w.0.iter().max(), Some(&100_000), "{:?}", w.0);
    assert_eq!(w.0.len(), 3, "{:?}", w.0);
}

#[test]
fn frames_read_back_as_written() {
    let frames = [
        Frame::Dir(DirHeader {
            path: "a".into(),
            mode: 0o755,
        }),
        Frame::File(FileHeader {
            path: "a/b".into(),
            size: 3,
            mode: 0o600,
            base: None,
        }),
        Frame::Chunk {
            offset: 0,
            data: b"abc",
        },
        Frame::EndFile,
        Frame::Done(Seal {
            totals: Totals { files: 1, bytes: 3 },
            tag: [7; TAG_BYTES],
        }),
        Frame::Committed(Seal {
            totals: Totals { files: 1, bytes: 3 },
            tag: [8; TAG_BYTES],
        }),
        Frame::Abort {
            reason: "why".into(),
        },
        Frame::Released {
            tag: [9; TAG_BYTES],
        },
        Frame::Outcome {
            outcome: Outcome::Running { pid: 4242 },
            tag: [10; TAG_BYTES],
        },
        Frame::Outcome {
            outcome: Outcome::RestoreFailed {
                reason: "no room".into(),
            },
            tag: [11; TAG_BYTES],
        },
    ];
    let mut wire = Vec::new();
    for f in &frames {
        write_frame(&mut wire, f).unwrap();
    }
    let mut r = &wire[..];
    let mut buf = Vec::new();
    for f in &frames {
        assert_eq!(&read_frame(&mut r, &mut buf).unwrap(), f);
    }
    assert!(matches!(
        read_frame(&mut r, &mut buf),
        Err(FrameError::Closed)
    ));
    // A JSON header with a field it does not have is malformed.
    let payload = br#"{"path":"a","mode":1,"owner":0}"#;
    let mut w = vec![KIND_DIR];
    w.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    w.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    w.extend_from_slice(payload);
    assert!(matches!(
        read_frame(&mut &w[..], &mut buf),
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
    write_frame_to(&mut a, &Frame::Buffer(rec), Some(&mut session.frames)).unwrap();
    // The transcript says one chunk, the wire carries another (a valid checksum of its own).
    let mut other = session.frames.clone();
    let data = [1u8; 8];
    let chunk = |data| Frame::BufferChunk {
        buffer: 1,
        offset: 0,
        data,
    };
    write_frame_to(&mut io::sink(), &chunk(&data), Some(&mut session.frames)).unwrap();
    write_frame_to(&mut a, &chunk(&[2u8; 8]), Some(&mut other)).unwrap();
    let totals = Totals { files: 1, bytes: 8 };
    let done = Seal {
        totals,
        tag: session.done(&totals).finalize().into_bytes().into(),
    };
    write_frame(&mut a, &Frame::Done(done)).unwrap();
    assert!(matches!(recv.join().unwrap(), Err(ReceiveError::Forged)));
    let mut buf = Vec::new();
    assert!(matches!(
        read_frame(&mut a, &mut buf),
        Ok(Frame::Abort { .. })
    ));
}

/// A file sent ahead whose final version begins with it (found by its inode, renamed and
/// grown since), one unchanged, one rewritten in place, one gone and one new: only the new
/// bytes are sent after the cut, and DEST is the final set, nothing more.
#[test]
fn a_directory_sent_ahead_then_whole_sends_only_what_changed_after_the_cut() {
    let (_tmp, src, out) = dirs();
    fs::create_dir(src.join(".gpu.tmp")).unwrap();
    let data = noise(CHUNK_BYTES + 1000);
    fs::write(src.join(".gpu.tmp/data-000.bin"), &data).unwrap();
    fs::write(src.join("same"), b"unchanged").unwrap();
    fs::write(src.join("rewritten"), b"version 1").unwrap();
    fs::write(src.join("lock"), b"").unwrap();
    let (mut a, mut b) = pair();
    let dest = out.join("image");
    let d = dest.clone();
    let receiver = thread::spawn(move || receive_dir(&mut b, &key(2), &d));
    let mut sender = DirSender::start(&mut a, &key(2)).unwrap();
    let ahead = sender.send_ahead(&mut a, &src).unwrap();
    assert_eq!(ahead.files, 4);
    // The cut: the engine's image named, appended to; a file rewritten, one removed, one new.
    fs::rename(src.join(".gpu.tmp"), src.join("gpu")).unwrap();
    let more = noise(5000);
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(src.join("gpu/data-000.bin"))
        .unwrap();
    f.write_all(&more).unwrap();
    drop(f);
    fs::write(src.join("rewritten"), b"version 2").unwrap();
    fs::remove_file(src.join("lock")).unwrap();
    fs::write(src.join("possum.json"), b"{}").unwrap();
    let (report, _) = sender.finish(&mut a, &src).unwrap();
    let got = receiver.join().unwrap().unwrap();
    let whole = (data.len() + more.len() + 9 + 9 + 2) as u64;
    assert_eq!(
        report.totals,
        Totals {
            files: 4,
            bytes: whole
        }
    );
    assert_eq!(got.totals, report.totals);
    assert_eq!(report.sent_bytes, (more.len() + 9 + 2) as u64);
    assert_eq!(snapshot(&dest), snapshot(&src));
    assert_eq!(names(&out), vec!["image".to_string()]);
}

/// After a `Cut`, a base that was not sent ahead, or is not what was, is refused, and
/// nothing is named.
#[test]
fn a_final_set_that_lacks_or_changes_a_file_sent_ahead_is_refused() {
    let (_tmp, _src, out) = dirs();
    let dest = out.join("image");
    let with_base = |base: Base| {
        move |s: &mut UnixStream, session: &mut Session| {
            put(s, session, "a", b"ahead");
            send(s, session, &Frame::Cut);
            let h = FileHeader {
                path: "a".into(),
                size: 7,
                mode: 0o644,
                base: Some(base),
            };
            send(s, session, &Frame::File(h));
            send(
                s,
                session,
                &Frame::Chunk {
                    offset: 5,
                    data: b"!!",
                },
            );
            send(s, session, &Frame::EndFile);
            done(s, session, Totals { files: 1, bytes: 7 });
        }
    };
    let sha = |d: &[u8]| hex(&<[u8; 32]>::from(<sha2::Sha256 as sha2::Digest>::digest(d)));
    // The sound one is taken.
    against_ok(
        &dest,
        with_base(Base {
            path: "a".into(),
            size: 5,
            sha256: sha(b"ahead"),
        }),
    );
    assert_eq!(fs::read(dest.join("a")).unwrap(), b"ahead!!");
    fs::remove_dir_all(&dest).unwrap();
    for (base, why) in [
        (
            Base {
                path: "b".into(),
                size: 5,
                sha256: sha(b"ahead"),
            },
            "not sent ahead",
        ),
        (
            Base {
                path: "a".into(),
                size: 5,
                sha256: sha(b"other"),
            },
            "not what was sent ahead",
        ),
        (
            Base {
                path: "a".into(),
                size: 4,
                sha256: sha(b"ahea"),
            },
            "not what was sent ahead",
        ),
    ] {
        let e = against(&dest, with_base(base));
        assert!(
            matches!(e, WireError::Receive(ReceiveError::Ahead { .. })),
            "{e:?}"
        );
        assert!(e.to_string().contains(why), "{e}");
        assert!(names(&out).is_empty(), "{:?}", names(&out));
    }
    // Before any Cut, a base that was not sent ahead, or another file's.
    let e = against(&dest, |s, session| {
        put(s, session, "a", b"ahead");
        let h = FileHeader {
            path: "b".into(),
            size: 7,
            mode: 0o644,
            base: Some(Base {
                path: "a".into(),
                size: 5,
                sha256: sha(b"ahead"),
            }),
        };
        send(s, session, &Frame::File(h));
        send(s, session, &Frame::EndFile);
        done(s, session, Totals { files: 1, bytes: 7 });
    });
    assert!(e.to_string().contains("goes on only itself"), "{e}");
    assert!(names(&out).is_empty());
    let e = against(&dest, |s, session| {
        let h = FileHeader {
            path: "a".into(),
            size: 1,
            mode: 0o644,
            base: Some(Base {
                path: "a".into(),
                size: 0,
                sha256: sha(b""),
            }),
        };
        send(s, session, &Frame::File(h));
        send(s, session, &Frame::EndFile);
        done(s, session, Totals { files: 1, bytes: 1 });
    });
    assert!(e.to_string().contains("not sent ahead"), "{e}");
    assert!(names(&out).is_empty());
}

/// Rounds ahead of the cut (a migration's pre-copy rounds): a file sent in an earlier round
/// sends only what it gained since, one unchanged nothing, one rewritten in place waits for
/// the final set, a new one goes whole; after the cut, only what changed since the last
/// round. DEST is the final set.
#[test]
fn a_directory_sent_ahead_in_rounds_sends_each_file_s_gain_once() {
    let (_tmp, src, out) = dirs();
    let append = |name: &str, bytes: &[u8]| {
        let mut f = fs::OpenOptions::new()
            .append(true)
            .open(src.join(name))
            .unwrap();
        f.write_all(bytes).unwrap();
    };
    let data = noise(CHUNK_BYTES + 1000);
    fs::write(src.join("data"), &data).unwrap();
    fs::write(src.join("same"), b"unchanged").unwrap();
    fs::write(src.join("rewritten"), b"version 1").unwrap();
    let (mut a, mut b) = pair();
    let dest = out.join("image");
    let d = dest.clone();
    let receiver = thread::spawn(move || receive_dir(&mut b, &key(2), &d));
    let mut sender = DirSender::start(&mut a, &key(2)).unwrap();
    let first = sender.send_ahead(&mut a, &src).unwrap();
    assert_eq!(first.files, 3);
    // Round 2: data grew, a file is new, one is rewritten in place.
    let gain = noise(3000);
    append("data", &gain);
    fs::write(src.join("new"), b"new file").unwrap();
    fs::write(src.join("rewritten"), b"version 2").unwrap();
    let second = sender.send_ahead(&mut a, &src).unwrap();
    assert_eq!(
        second,
        Totals {
            files: 2,
            bytes: (gain.len() + 8) as u64
        },
        "data's gain and the new file"
    );
    // Round 3: nothing changed.
    assert_eq!(sender.send_ahead(&mut a, &src).unwrap(), Totals::default());
    // The cut: data grows again.
    let last = noise(700);
    append("data", &last);
    let (report, _) = sender.finish(&mut a, &src).unwrap();
    let got = receiver.join().unwrap().unwrap();
    assert_eq!(got.totals, report.totals);
    assert_eq!(report.totals.files, 4);
    assert_eq!(
        report.sent_bytes,
        (last.len() + 9) as u64,
        "data's last gain and the rewritten file, whole"
    );
    assert_eq!(snapshot(&dest), snapshot(&src));
    assert_eq!(names(&out), vec!["image".to_string()]);
}
