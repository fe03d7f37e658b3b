//! The migration wire on the CPU: what the frame MAC costs a core, and a directory sent over
//! loopback TCP over one stream and several, paced and not.
//!
//! `cargo bench -p possum-sequence --bench wire` (`-- mac` or `-- loopback` for one group).
//! `POSSUM_BENCH_MIB` sets the directory's size (default 1024), `POSSUM_BENCH_DIR` where it and
//! the received copies are written (default /dev/shm, so that the disk is not what is
//! measured), `POSSUM_BENCH_STREAMS` the stream counts (default "1,4").

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use hmac::Mac;
use possum_sequence::auth::HmacKey;
use possum_sequence::wire::{
    accept_handshake, read_frame, receive_dir_in_session, receiver_handshake, sender_handshake,
    set_timeouts, write_frame, Accepted, Connection, DirSender, Frame, Paced, Pacer, Session,
    Sessions, CHUNK_BYTES,
};

const TIMEOUT: Duration = Duration::from_secs(120);

fn key() -> HmacKey {
    HmacKey::from_bytes(vec![7; 32]).unwrap()
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

/// A sender's session and its receiver's, from a handshake over a socket pair.
fn sessions() -> (Session, Session) {
    let (mut a, mut b) = UnixStream::pair().unwrap();
    let t = thread::spawn(move || receiver_handshake(&mut b, &key()).unwrap());
    let sender = sender_handshake(&mut a, &key()).unwrap();
    (sender, t.join().unwrap())
}

fn noise(n: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// One core's work per chunk: a 4 MiB chunk framed and MACed (sent to nowhere), and read back
/// and checked; beside it HMAC-SHA256 of the same bytes, for comparison.
fn mac(c: &mut Criterion) {
    let data = noise(CHUNK_BYTES);
    let mut g = c.benchmark_group("mac");
    g.throughput(Throughput::Bytes(CHUNK_BYTES as u64));
    let chunk = Frame::Chunk {
        file: 0,
        offset: 0,
        data: &data,
    };
    g.bench_function("blake3 keyed frame, send", |b| {
        let (mut sender, _) = sessions();
        b.iter(|| write_frame(&mut io::sink(), &mut sender, &chunk).unwrap());
    });
    g.bench_function("blake3 keyed frame, receive", |b| {
        let mut buf = Vec::with_capacity(CHUNK_BYTES + 64);
        b.iter_batched(
            || {
                let (mut sender, receiver) = sessions();
                let mut wire = Vec::with_capacity(CHUNK_BYTES + 64);
                write_frame(&mut wire, &mut sender, &chunk).unwrap();
                (wire, receiver)
            },
            |(wire, mut receiver)| {
                read_frame(&mut &wire[..], &mut receiver, &mut buf).unwrap();
            },
            BatchSize::PerIteration,
        );
    });
    g.bench_function("hmac-sha256", |b| {
        b.iter(|| {
            let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(&[7; 32]).unwrap();
            m.update(&data);
            m.finalize()
        });
    });
    g.finish();
}

/// A directory of `mib` MiB under `root`: four files of a quarter each, and a few small ones.
fn source(root: &Path, mib: usize) -> PathBuf {
    let src = root.join("src");
    if src.exists() {
        std::fs::remove_dir_all(&src).unwrap();
    }
    std::fs::create_dir_all(src.join("gpu")).unwrap();
    let quarter = noise(mib << 18);
    for i in 0..4 {
        std::fs::write(src.join(format!("gpu/data-{i:03}.bin")), &quarter).unwrap();
    }
    for i in 0..16 {
        std::fs::write(src.join(format!("criu-{i}.img")), noise(4096 * (i + 1))).unwrap();
    }
    src
}

/// A receiver on a loopback port that takes sessions of any number of streams until the
/// process ends, each received into a new directory under `out`, removed once received; each
/// removal said on the channel returned.
fn receiver(out: PathBuf) -> (SocketAddr, mpsc::Receiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let sessions = Sessions::new(TIMEOUT);
    let (removed, removals) = mpsc::channel();
    thread::spawn(move || {
        for n in 0u64.. {
            let Ok((mut s, _)) = listener.accept() else {
                continue;
            };
            set_timeouts(&s, TIMEOUT).unwrap();
            let (sessions, dest) = (sessions.clone(), out.join(format!("got-{n}")));
            let removed = removed.clone();
            thread::spawn(move || match accept_handshake(&mut s, &key(), &sessions) {
                Ok(Accepted::Session(session)) => {
                    receive_dir_in_session(&mut s, session, &dest).unwrap();
                    std::fs::remove_dir_all(&dest).unwrap();
                    removed.send(()).unwrap();
                }
                Ok(Accepted::Stream(joined)) => {
                    joined.join(s);
                }
                Err(e) => panic!("{e}"),
            });
        }
    });
    (addr, removals)
}

fn connect(addr: SocketAddr, pacer: Option<&Arc<Pacer>>) -> io::Result<Box<dyn Connection>> {
    let s = TcpStream::connect(addr)?;
    set_timeouts(&s, TIMEOUT)?;
    Ok(match pacer {
        Some(p) => Box::new(Paced::new(s, p.clone())),
        None => Box::new(s),
    })
}

/// Sends `src` to the receiver at `to` over `streams` streams, paced by `pacer`; the time
/// from the first connection to the receiver's `Committed` (the copy it received is removed
/// before this returns, untimed).
fn send(
    to: &(SocketAddr, mpsc::Receiver<()>),
    src: &Path,
    streams: u32,
    pacer: Option<&Arc<Pacer>>,
) -> Duration {
    let (addr, removals) = to;
    let t = Instant::now();
    let mut main = connect(*addr, pacer).unwrap();
    let sender =
        DirSender::start_streams(&mut main, &key(), streams, |_| connect(*addr, pacer)).unwrap();
    sender.finish(&mut main, src).unwrap();
    let took = t.elapsed();
    removals.recv().unwrap();
    took
}

/// Sends `src` ahead (its first round, in parts of `slice` bytes of each file if some) and then
/// its final set (nothing changed) to the receiver at `to` over `streams` streams: the time
/// until the receiver's `Committed`.
fn send_ahead(
    to: &(SocketAddr, mpsc::Receiver<()>),
    src: &Path,
    streams: u32,
    slice: Option<u64>,
) -> Duration {
    let (addr, removals) = to;
    let t = Instant::now();
    let mut main = connect(*addr, None).unwrap();
    let mut sender =
        DirSender::start_streams(&mut main, &key(), streams, |_| connect(*addr, None)).unwrap();
    if let Some(bytes) = slice {
        sender.slice_first_round(bytes);
    }
    sender.send_ahead(&mut main, src).unwrap();
    sender.finish(&mut main, src).unwrap();
    let took = t.elapsed();
    removals.recv().unwrap();
    took
}

fn loopback(c: &mut Criterion) {
    let mib: usize = env_or("POSSUM_BENCH_MIB", "1024").parse().unwrap();
    let root = PathBuf::from(env_or("POSSUM_BENCH_DIR", "/dev/shm"))
        .join(format!("possum-wire-bench-{}", std::process::id()));
    let src = source(&root, mib);
    let out = root.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let to = receiver(out);
    let bytes = (mib as u64) << 20;
    let mut g = c.benchmark_group("loopback");
    g.sample_size(10).throughput(Throughput::Bytes(bytes));
    let counts = env_or("POSSUM_BENCH_STREAMS", "1,4");
    for streams in counts.split(',').map(|s| s.trim().parse::<u32>().unwrap()) {
        g.bench_function(format!("{mib} MiB, {streams} streams"), |b| {
            b.iter_custom(|n| (0..n).map(|_| send(&to, &src, streams, None)).sum());
        });
    }
    // Sent ahead, then the final set: in one part, and in parts of an eighth of each data file
    // (a migration's first round, which its destination loads as it comes).
    let eighth = (bytes / 4).div_ceil(8);
    for (how, slice) in [("in one part", None), ("in 8 slices", Some(eighth))] {
        g.bench_function(format!("{mib} MiB sent ahead {how}, 4 streams"), |b| {
            b.iter_custom(|n| (0..n).map(|_| send_ahead(&to, &src, 4, slice)).sum());
        });
    }
    // Paced at half the directory a second, four streams: the rate all of them hold together.
    let rate = bytes / 2;
    g.bench_function(
        format!("{mib} MiB, 4 streams, --max-rate {rate} B/s"),
        |b| {
            b.iter_custom(|n| {
                (0..n)
                    .map(|_| {
                        let pacer = Arc::new(Pacer::new(rate));
                        let took = send(&to, &src, 4, Some(&pacer));
                        let got = bytes as f64 / took.as_secs_f64();
                        eprintln!(
                            "  paced: {:.1} MB/s for {:.1} MB/s asked ({:+.1}%)",
                            got / 1e6,
                            rate as f64 / 1e6,
                            (got / rate as f64 - 1.0) * 100.0
                        );
                        took
                    })
                    .sum()
            });
        },
    );
    g.finish();
    let _ = std::fs::remove_dir_all(&root);
}

/// What is left of a PyTorch job's CRIU image once its memory went ahead (~76 MB): a file per
/// thread and per kind of record, small, and a few larger (memfd contents, the memory map),
/// sent as the final set after the dump: against the same bytes in one file, what the files'
/// number costs.
fn criu_rest(c: &mut Criterion) {
    let root = PathBuf::from(env_or("POSSUM_BENCH_DIR", "/dev/shm"))
        .join(format!("possum-wire-bench-rest-{}", std::process::id()));
    let many = root.join("many");
    let one = root.join("one");
    for d in [&many, &one] {
        let _ = std::fs::remove_dir_all(d);
        std::fs::create_dir_all(d).unwrap();
    }
    let mut total = 0usize;
    let mut add = |name: String, len: usize| {
        std::fs::write(many.join(name), noise(len)).unwrap();
        total += len;
    };
    for i in 0..96 {
        add(format!("core-{i}.img"), 6 << 10);
    }
    for (i, len) in [(0, 64 << 10), (1, 256 << 10), (2, 1 << 20), (3, 3 << 20)] {
        add(format!("mm-{i}.img"), len);
    }
    for i in 0..8 {
        add(format!("pages-{i}.img"), 8 << 20);
    }
    std::fs::write(one.join("pages-all.img"), noise(total)).unwrap();
    let out = root.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let to = receiver(out);
    let mut g = c.benchmark_group("criu-rest");
    g.sample_size(20)
        .throughput(Throughput::Bytes(total as u64));
    for streams in [1, 8] {
        for (how, dir) in [("108 files", &many), ("one file", &one)] {
            g.bench_function(
                format!("{} MB in {how}, {streams} streams", total >> 20),
                |b| {
                    b.iter_custom(|n| (0..n).map(|_| send(&to, dir, streams, None)).sum());
                },
            );
        }
    }
    g.finish();
    let _ = std::fs::remove_dir_all(&root);
}

criterion_group!(benches, mac, loopback, criu_rest);
criterion_main!(benches);
