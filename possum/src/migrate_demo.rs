//! `possum demo --migrate`: the migration protocol end to end on one host, with pre-copy. The
//! demo job runs in a child process (as `demo --criu`'s); a receiver on loopback, a thread of this
//! process, plays the destination, authenticated by a fresh random key in the working directory.
//!
//! ```text
//! child (source job)                          this process                 receiver thread
//!   steps 0..AT
//!   pre-copy   connect, handshake ───────────────────────────────────────▶ engine image, open
//!              round 1 every buffer, the job's next step running meanwhile ▶ (Buffer, BufferChunk)
//!              round k the buffers written since; until a round does not
//!              shrink or --max-rounds
//!   cut        held: last dirty buffers, Done ◀────── Committed ─────────── image committed
//!              release its buffers; say held ───▶ CRIU dump (kill)
//!                                                  send CRIU's image ─────▶ received, Committed
//!                                                  Released ──────────────▶ CRIU restore
//!   (restored) ◀─────────────────────────────────────────────────────────── go on (a file)
//!              its buffers from the engine image             ◀── Outcome: Running
//!              steps to the end, digest
//! ```
//!
//! The pre-copy is the job's own: the child owns the host backend's engine, so it sends the
//! rounds itself ([`possum_sequence::wire::PrecopySender`], an engine sink) over its own
//! connection, the engine's dirty marks choosing each round's buffers; CRIU's image follows on a
//! second connection from this process, which drives CRIU. The destination restores the process
//! with CRIU, and the process its buffers from the received engine image: the ordinary restore.
//! Downtime is from the job held to its buffers' restore begun at the destination (the job free
//! to run its next step); the total from the first round's start to the same point.

use std::fs;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use possum_criu::{Criu, DumpOptions, RestoreOptions};
use possum_engine::host::HostDevice;
use possum_engine::image::{Image, ImageWriter, WriterOptions};
use possum_engine::store::ChunkSink;
use possum_engine::{Engine, EngineConfig};
use possum_sequence::auth::HmacKey;
use possum_sequence::wire::{self, Outcome, PrecopySender, Totals};
use possum_workloads::demo::DemoJob;
use serde::{Deserialize, Serialize};

use crate::criu_demo::ChildArgs;
use crate::demo::DemoArgs;

/// Each read or write of the transfers may wait this long.
const IO_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the child may take to reach the cut, and a restored child to finish.
const CHILD_TIMEOUT: Duration = Duration::from_secs(300);

/// Nanoseconds since the epoch: a stamp both the source and the restored process read from the
/// same clock (one host).
fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn ms_ns(ns: u64) -> f64 {
    (ns as f64 / 1e3).round() / 1e3
}

/// One pre-copy round, as the engine did it.
#[derive(Serialize, Deserialize, Debug, Clone, Copy)]
pub struct Round {
    /// Buffers sent.
    pub buffers: usize,
    /// Their bytes.
    pub bytes: u64,
    /// How long the round took, ms.
    pub ms: f64,
}

/// What the child tells once held (a file it writes before the dump).
#[derive(Serialize, Deserialize, Debug)]
struct Held {
    rounds: Vec<Round>,
    /// The cut's dirty remainder.
    last: Round,
    /// The step the job resumes at.
    resume_step: u64,
    start_ns: u64,
    held_ns: u64,
}

/// The child's pre-copy and cut (`demo-child --precopy-to`), then, once restored at the
/// destination, the rest of its steps from its buffers received there.
pub fn child(a: &ChildArgs, to: &str) -> Result<bool> {
    let (Some(key_file), Some(image), Some(held_file), Some(go)) =
        (&a.key_file, &a.image, &a.held, &a.go)
    else {
        bail!("--precopy-to needs --key-file, --image, --held and --go");
    };
    let spec = a.start();
    let key = HmacKey::read(key_file).context("the key file")?;
    // Small staging: the process image CRIU sends at the cut holds it.
    let engine = Engine::new(
        Arc::new(HostDevice::new((a.mib << 20) + (64 << 20))),
        EngineConfig {
            chunk_size: 1 << 20,
            staging_buffers: 4,
            ..EngineConfig::default()
        },
    )?;
    let mut job = DemoJob::new(&engine, &spec)?;
    let mut step = 0;
    while step < a.at.min(a.steps) {
        job.run_step(step)?;
        step += 1;
    }

    // Pre-copy: each round takes what the engine saw written since the previous one; the job
    // runs its next step meanwhile, whose writes the next round (or the cut) takes.
    let start_ns = now_ns();
    let mut stream = TcpStream::connect(to).with_context(|| format!("connecting to {to}"))?;
    wire::set_timeouts(&stream, IO_TIMEOUT)?;
    let session = wire::sender_handshake(&mut stream, &key)?;
    let sender = Arc::new(PrecopySender::new(stream, session));
    let sink: Arc<dyn ChunkSink> = sender.clone();
    engine.mark_all_dirty();
    let mut rounds: Vec<Round> = Vec::new();
    loop {
        let (r, ran) = std::thread::scope(|sc| {
            let round = sc.spawn(|| engine.precopy_round(sink.clone()));
            let ran = if step < a.steps {
                job.run_step(step).map(|_| true)
            } else {
                Ok(false)
            };
            let r = round.join().expect("a pre-copy round panicked");
            (r, ran)
        });
        let r = r?;
        if ran? {
            step += 1;
        }
        let shrank = rounds.last().is_none_or(|p| r.bytes < p.bytes);
        rounds.push(Round {
            buffers: r.buffers,
            bytes: r.bytes,
            ms: crate::demo::ms(r.elapsed),
        });
        if !shrank || rounds.len() >= a.max_rounds as usize {
            break;
        }
    }

    // The cut: the job held (no step issued), the last dirty buffers sent, the image committed
    // at the destination; then the buffers released here, so that CRIU's image carries the
    // process without them.
    let held_ns = now_ns();
    let last = engine.checkpoint(sink.clone(), true)?.wait()?;
    drop(sink);
    let sender = Arc::into_inner(sender).context("the pre-copy sink still shared")?;
    let (_, stream) = sender.finish()?;
    drop(stream);
    engine.release()?;
    let held = Held {
        rounds,
        last: Round {
            buffers: last.buffers,
            bytes: last.bytes,
            ms: crate::demo::ms(last.elapsed),
        },
        resume_step: step,
        start_ns,
        held_ns,
    };
    crate::criu_demo::write_atomically(held_file, &serde_json::to_string(&held)?)?;

    // Dumped and killed while waiting here; restored at the destination, which then says go.
    let deadline = Instant::now() + CHILD_TIMEOUT;
    while !go.exists() {
        if Instant::now() > deadline {
            bail!("held, never moved: no go within {CHILD_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let img = Arc::new(Image::open(image)?);
    let rs = engine.restore(img)?;
    let running_ns = now_ns();
    crate::criu_demo::write_atomically(&running_file(held_file), &running_ns.to_string())?;
    job.job.reset_deps();
    for s in step..a.steps {
        job.run_step(s)?;
    }
    rs.wait()?;
    crate::criu_demo::write_atomically(&a.out, &format!("{:016x}\n", job.digest()?))?;
    Ok(true)
}

/// Where the restored child writes when its job runs again.
fn running_file(held: &Path) -> PathBuf {
    held.with_extension("running")
}

/// What the destination received and did.
struct Destination {
    precopy: Totals,
    restore: Duration,
    pid: i32,
}

/// The destination: the pre-copy into an engine image, then CRIU's image, the hand-off and
/// CRIU's restore; the restored process is told to go on.
fn destination(
    listener: &TcpListener,
    key: &HmacKey,
    criu: &Criu,
    dir: &Path,
    go: &Path,
) -> Result<Destination> {
    let (mut s, _) = listener.accept().context("accepting the pre-copy")?;
    wire::set_timeouts(&s, IO_TIMEOUT)?;
    let mut session = wire::receiver_handshake(&mut s, key)?;
    let writer = ImageWriter::create(&dir.join("engine-image"), WriterOptions::default())?;
    let (precopy, _) = wire::receive_precopy(&mut s, &mut session, writer, ImageWriter::commit)
        .context("receiving the pre-copy")?;
    drop(s);

    let (mut s, _) = listener.accept().context("accepting the migration")?;
    wire::set_timeouts(&s, IO_TIMEOUT)?;
    let images = dir.join("criu-images");
    let (_, mut session) = wire::receive_dir_session(&mut s, key, &images)?;
    wire::await_released(&mut s, &mut session)?;
    let t = Instant::now();
    // Restored, the child waits for its go file: it is told only once the source says go.
    let outcome = match criu.restore(&RestoreOptions::new(&images)) {
        Ok(r) => {
            wire::send_outcome(&mut s, &mut session, &Outcome::Restored { pid: r.pid })?;
            wire::await_released(&mut s, &mut session).context("waiting for the source's go")?;
            fs::write(go, b"go\n")
                .map(|()| Outcome::Running { pid: r.pid })
                .unwrap_or_else(|e| Outcome::RestoreFailed {
                    reason: format!("telling the restored job to go on: {e}"),
                })
        }
        Err(e) => Outcome::RestoreFailed {
            reason: format!("{e:#}"),
        },
    };
    let restore = t.elapsed();
    wire::send_outcome(&mut s, &mut session, &outcome)?;
    match outcome {
        Outcome::Running { pid } => Ok(Destination {
            precopy,
            restore,
            pid,
        }),
        Outcome::Restored { .. } => bail!("the destination sent Restored twice"),
        Outcome::Synced { .. } => bail!("the destination said Synced before Running"),
        Outcome::RestoreFailed { reason } => bail!("the restore at the destination: {reason}"),
    }
}

/// The source's child, killed (and reaped) when dropped unless taken out.
struct KillOnDrop(Option<std::process::Child>);

impl KillOnDrop {
    fn get(&mut self) -> &mut std::process::Child {
        self.0.as_mut().expect("the child is there until the dump")
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A fresh random key of 32 bytes in `path` (mode 0600).
fn new_key(path: &Path) -> Result<HmacKey> {
    let mut bytes = vec![0u8; 32];
    use std::io::Read;
    fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(&bytes))
        .with_context(|| format!("writing the key {}", path.display()))?;
    HmacKey::from_bytes(bytes).map_err(|n| anyhow::anyhow!("a key of {n} bytes"))
}

/// The figures of `possum demo --migrate --json`.
#[derive(Serialize, Debug)]
struct Report {
    backend: &'static str,
    mode: &'static str,
    criu: String,
    bytes: u64,
    rounds: Vec<Round>,
    last: Round,
    precopy_wire_bytes: u64,
    criu_image_bytes: u64,
    sent_bytes: u64,
    downtime_ms: f64,
    total_ms: f64,
    dump_ms: f64,
    restore_ms: f64,
    resume_step: u64,
    bitexact: bool,
}

/// The files of the working directory: the key, both ends' images, the child's files.
struct Files {
    /// The source's CRIU images are made under it.
    source: PathBuf,
    /// The destination's images (the engine image, CRIU's) are received under it.
    dest: PathBuf,
    key: PathBuf,
    /// Made by the destination: the restored child may go on.
    go: PathBuf,
    /// Written by the child once it is held at its cut ([`Held`]).
    held: PathBuf,
    /// The child's digest at its end.
    out: PathBuf,
}

impl Files {
    /// The files of working directory `dir`, which must be empty (or not exist yet); the source's
    /// and the destination's directories made.
    fn make(dir: &Path) -> Result<Files> {
        if fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some()) {
            bail!(
                "the working directory {} is not empty (it would hold the key, both ends' images and \
                 the child's files)",
                dir.display()
            );
        }
        let (source, dest) = (dir.join("source"), dir.join("destination"));
        fs::create_dir_all(&source)?;
        fs::create_dir_all(&dest)?;
        Ok(Files {
            source,
            dest,
            key: dir.join("migrate.key"),
            go: dir.join("child.go"),
            held: dir.join("child.held"),
            out: dir.join("child.out"),
        })
    }
}

/// `possum demo --migrate`: the job migrated from a child process to a receiver thread with
/// pre-copy, restored there and run to its end; whether its output is bit-identical.
pub fn run(a: &DemoArgs) -> Result<bool> {
    crate::criu_demo::refuse_without_root("possum demo --migrate")?;
    if a.max_rounds == 0 {
        bail!("--max-rounds must be at least 1");
    }
    let (criu, version, a) = crate::criu_demo::criu_and_args(a)?;
    let spec = a.spec_checked()?;
    let tmp = crate::scratch::Scratch::new()?;
    let dir = a.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let files = Files::make(&dir)?;
    if !a.json {
        println!(
            "possum demo --migrate: CRIU {version}, job in a child process: {} MiB, {} streams, {} steps; \
             pre-copy from step {}, at most {} rounds",
            a.mib, a.streams, a.steps, a.at, a.max_rounds
        );
    }
    let key = new_key(&files.key)?;
    let want = std::thread::spawn({
        let spec = spec.clone();
        move || spec.reference_digests(&[spec.steps - 1])[0]
    });
    // The restored child reparents to us, so we can wait for it.
    possum_criu::set_child_subreaper()?;

    let listener = TcpListener::bind("127.0.0.1:0").context("listening on loopback")?;
    let addr = listener.local_addr()?;
    let receiver = std::thread::spawn({
        let (key, criu, dest, go) = (
            key.clone(),
            criu.clone(),
            files.dest.clone(),
            files.go.clone(),
        );
        move || destination(&listener, &key, &criu, &dest, &go)
    });
    let proc = spawn_child(&a, &dir, &files, addr)?;
    let pid = i32::try_from(proc.id())?;
    // Killed should this return before CRIU's dump did.
    let mut proc = KillOnDrop(Some(proc));

    // The cut: once the child is held, CRIU dumps it (and kills it), and its image follows.
    let held = wait_until_held(&mut proc, &files.held, &dir)?;
    let images = files.source.join("criu-images");
    let dump = criu.dump(&DumpOptions::new(pid, &images))?;
    // CRIU killed it: reaped, its PID free for the restore.
    let _ = proc.0.take().map(|mut c| c.wait());
    let (criu_image_bytes, outcome) = hand_off(addr, &key, &images)?;
    let there = receiver
        .join()
        .map_err(|_| anyhow::anyhow!("the receiver thread panicked"))??;
    if outcome != (Outcome::Running { pid: there.pid }) {
        bail!("the destination answered {outcome:?}");
    }
    let st = possum_criu::wait_for_exit(there.pid, Some(CHILD_TIMEOUT))?;
    if !st.success() {
        bail!("the restored child {} ended badly: {st:?}", there.pid);
    }
    let running_ns: u64 = fs::read_to_string(running_file(&files.held))?
        .trim()
        .parse()?;
    let got = crate::criu_demo::read_digest(&files.out)?;
    let want = want
        .join()
        .map_err(|_| anyhow::anyhow!("the reference thread panicked"))?;
    let bitexact = got == want;
    let downtime_ns = running_ns.saturating_sub(held.held_ns);
    let total_ns = running_ns.saturating_sub(held.start_ns);
    let report = Report {
        backend: "host",
        mode: "migrate",
        criu: version.to_string(),
        bytes: spec.program().bytes(),
        rounds: held.rounds,
        last: held.last,
        precopy_wire_bytes: there.precopy.bytes,
        criu_image_bytes,
        sent_bytes: there.precopy.bytes + criu_image_bytes,
        downtime_ms: ms_ns(downtime_ns),
        total_ms: ms_ns(total_ns),
        dump_ms: crate::demo::ms(dump.time),
        restore_ms: crate::demo::ms(there.restore),
        resume_step: held.resume_step,
        bitexact,
    };
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        say_report(&report, want, got);
    }
    Ok(bitexact)
}

/// Starts the demo child: the job, pre-copying to `addr` from step `--at` on, held at its cut
/// until told to go on (`files`); its output in `dir`'s `child.log`.
fn spawn_child(
    a: &DemoArgs,
    dir: &Path,
    files: &Files,
    addr: std::net::SocketAddr,
) -> Result<std::process::Child> {
    let log = fs::File::create(dir.join("child.log"))?;
    Command::new(std::env::current_exe().context("finding the possum binary")?)
        .arg("demo-child")
        .args(["--mib", &a.mib.to_string(), "--steps", &a.steps.to_string()])
        .args(["--streams", &a.streams.to_string()])
        .arg("--progress")
        .arg(dir.join("child.progress"))
        .arg("--out")
        .arg(&files.out)
        .args(["--precopy-to", &addr.to_string(), "--at", &a.at.to_string()])
        .args(["--max-rounds", &a.max_rounds.to_string()])
        .arg("--key-file")
        .arg(&files.key)
        .arg("--image")
        .arg(files.dest.join("engine-image"))
        .arg("--held")
        .arg(&files.held)
        .arg("--go")
        .arg(&files.go)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting the demo child")
}

/// Waits until the child says it is held at its cut (`held_file`), and reads what it says.
fn wait_until_held(proc: &mut KillOnDrop, held_file: &Path, dir: &Path) -> Result<Held> {
    let deadline = Instant::now() + CHILD_TIMEOUT;
    while !held_file.exists() {
        if let Some(st) = proc.get().try_wait()? {
            bail!(
                "the demo child exited before its cut ({st}); see its log in {}",
                dir.display()
            );
        }
        if Instant::now() > deadline {
            bail!("the demo child did not reach its cut");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(serde_json::from_str(&fs::read_to_string(held_file)?)?)
}

/// Sends CRIU's `images` to the destination at `addr`, then the hand-off (and the go once it
/// restored the process); the bytes of CRIU's image sent and the destination's last outcome.
fn hand_off(addr: std::net::SocketAddr, key: &HmacKey, images: &Path) -> Result<(u64, Outcome)> {
    let mut s = TcpStream::connect(addr).context("connecting to the destination")?;
    wire::set_timeouts(&s, IO_TIMEOUT)?;
    let (sent, mut session) = wire::send_dir_session(&mut s, key, images)?;
    wire::send_released(&mut s, &mut session)?;
    let mut outcome = wire::await_outcome(&mut s, &mut session)?;
    if let Outcome::Restored { .. } = outcome {
        // The go: the destination lets the restored child run.
        wire::send_released(&mut s, &mut session)?;
        outcome = wire::await_outcome(&mut s, &mut session)?;
    }
    Ok((sent.totals.bytes, outcome))
}

/// Prints the figures of `report` as text, with the reference's digest and the migrated job's.
fn say_report(report: &Report, want: u64, got: u64) {
    for (i, r) in report.rounds.iter().enumerate() {
        println!(
            "  pre-copy round {:<2}            {:>12} bytes, {} buffers, {:.1} ms",
            i + 1,
            r.bytes,
            r.buffers,
            r.ms
        );
    }
    println!(
        "  cut: last dirty buffers       {:>12} bytes, {} buffers; CRIU image {} bytes (dump {:.1} ms)",
        report.last.bytes, report.last.buffers, report.criu_image_bytes, report.dump_ms
    );
    println!(
        "  sent in all                   {:>12} bytes ({} of buffers, {} of CRIU's image)",
        report.sent_bytes, report.precopy_wire_bytes, report.criu_image_bytes
    );
    println!(
        "  downtime                      {:>9.1} ms (held to running at the destination; its restore {:.1} ms)",
        report.downtime_ms, report.restore_ms
    );
    println!(
        "  total                         {:>9.1} ms (first round to running at the destination)",
        report.total_ms
    );
    println!(
        "  reference {want:016x}, migrated {got:016x}: bit-identical: {}",
        report.bitexact
    );
}
