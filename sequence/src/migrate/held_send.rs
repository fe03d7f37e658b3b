//! The send begun while the job is held (part of [`super`]): the `Cut` and the GPU images, as
//! the final set's first part, while the driver and CRIU work; then, while CRIU dumps, its pages
//! file as CRIU writes it ([`super::dumping`]); begun, where the job's final copy journals its
//! chunks, as that copy runs ([`super::copying`]). On a thread of its own; joined once CRIU's dump
//! is over, the commit waiting for it.

use std::io;
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::copying::{self, Copied, Copying};
use super::dumping::{self, Follow};
use crate::wire::{DirSender, Paced, Pacer, Totals, WireError, Written};

/// The send begun while the job is held: the connection and its sender back, and what it sent
/// (none: the final set's first part did not go); or why it failed.
pub(super) type HeldSend = Result<(TcpStream, DirSender, Option<HeldSent>), WireError>;

/// `f` on `stream`, paced by `pacer` if there is one.
pub(super) fn paced<T>(
    pacer: Option<&Arc<Pacer>>,
    stream: &mut TcpStream,
    f: impl FnOnce(&mut dyn ReadWrite) -> T,
) -> T {
    match pacer {
        Some(pacer) => f(&mut Paced::new(stream, pacer.clone())),
        None => f(stream),
    }
}

/// A stream both ways.
pub(super) trait ReadWrite: io::Read + io::Write {}
impl<T: io::Read + io::Write> ReadWrite for T {}

/// What was sent while the job was held and the driver and CRIU worked.
#[derive(Debug, Clone, Default)]
pub(super) struct HeldSent {
    /// The `Cut` and the GPU images.
    pub(super) gpu: Totals,
    /// Parts of CRIU's pages file, as CRIU wrote it ([`dumping`]).
    pub(super) criu: Totals,
    /// Before the `Cut`, the chunks the final copy completed as it ran ([`copying`]).
    pub(super) copying: Totals,
    /// In so many rounds.
    pub(super) copying_rounds: u32,
    /// Where it was followed and nothing was sent: what was seen of it.
    pub(super) unsent: Option<String>,
    /// From the `Cut` to the end of CRIU's dump (or of the GPU images, if later).
    pub(super) took: Duration,
}

impl HeldSent {
    /// The bytes sent while the driver and CRIU worked.
    pub(super) fn dumping_bytes(&self) -> u64 {
        self.gpu.bytes + self.criu.bytes
    }

    /// What to tell the user of it.
    pub(super) fn notes(&self) -> Vec<String> {
        let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
        let mut notes = Vec::new();
        if self.copying_rounds > 0 {
            notes.push(format!(
                "sent while the job's final copy ran: {:.1} MiB in {} rounds",
                mib(self.copying.bytes),
                self.copying_rounds
            ));
        }
        notes.push(format!(
            "sent while the driver and CRIU worked, the job held: {} files, {:.1} MiB ({:.1} MiB \
             of CRIU's pages as it wrote them) in {:.0} ms",
            self.gpu.files + self.criu.files,
            mib(self.dumping_bytes()),
            mib(self.criu.bytes),
            self.took.as_secs_f64() * 1e3
        ));
        if let Some(seen) = &self.unsent {
            notes.push(format!(
                "no part of CRIU's pages file was whole while it dumped ({seen})"
            ));
        }
        notes
    }
}

/// What the send takes: the image directory being written, its GPU images' directories (under
/// it), what the cut wrote in them, and the pages file to follow, if any.
pub(super) struct What {
    pub(super) dir: PathBuf,
    pub(super) gpu: Vec<String>,
    pub(super) written: Written,
    pub(super) follow: Option<Follow>,
}

/// Starts the send on `link` (the connection and its sender), paced by `pacer`; `dump` says
/// when CRIU's dump is over, and when it runs again.
pub(super) fn spawn(
    link: (TcpStream, DirSender),
    what: What,
    pacer: Option<Arc<Pacer>>,
    dump: (Arc<AtomicBool>, Arc<AtomicBool>),
) -> JoinHandle<HeldSend> {
    std::thread::spawn(move || {
        let (stream, sender) = link;
        send_held((stream, sender), what, pacer, dump, Copied::default())
    })
}

/// Starts the send on `link` as the held job's final copy begins: its chunks as it completes
/// them ([`copying`]), then, once `next` says what, the send [`spawn`] starts; nothing more if
/// `next` is gone first.
pub(super) fn spawn_copying(
    link: (TcpStream, DirSender),
    mut copying: Copying,
    pacer: Option<Arc<Pacer>>,
    dump: (Arc<AtomicBool>, Arc<AtomicBool>),
    next: Receiver<What>,
) -> JoinHandle<HeldSend> {
    std::thread::spawn(move || {
        let (mut stream, mut sender) = link;
        let (copied, what) = paced(pacer.as_ref(), &mut stream, |s| {
            copying::send_while_copying(&mut sender, s, &mut copying, &next)
        })?;
        let Some(mut what) = what else {
            return Ok((stream, sender, None));
        };
        // (What a round read once its chunk was complete is not read again.)
        what.written = what.written.without(&copied.settled);
        send_held((stream, sender), what, pacer, dump, copied)
    })
}

/// The `Cut` and the GPU images, then CRIU's pages file as it is written; `copied`, what went
/// while the final copy ran.
fn send_held(
    (mut stream, mut sender): (TcpStream, DirSender),
    what: What,
    pacer: Option<Arc<Pacer>>,
    dump: (Arc<AtomicBool>, Arc<AtomicBool>),
    copied: Copied,
) -> HeldSend {
    let t = Instant::now();
    let What {
        dir,
        gpu,
        written,
        follow,
    } = what;
    sender.told(written);
    let (gpu, criu) = paced(pacer.as_ref(), &mut stream, |mut s| {
        let gpu = sender.send_final_under(&mut s, &dir, &gpu)?;
        let criu = match &follow {
            Some(f) => Some(dumping::send_while_dumping(
                &mut sender,
                s,
                &dir,
                f,
                (&dump.0, &dump.1),
            )?),
            None => None,
        };
        Ok::<_, WireError>((gpu, criu))
    })?;
    let took = t.elapsed();
    let unsent = (criu.as_ref())
        .filter(|d| d.sent.files == 0 && !d.seen.is_empty())
        .map(dumping::Dumped::seen);
    let criu = criu.map(|d| d.sent).unwrap_or_default();
    let sent = HeldSent {
        gpu,
        criu,
        copying: copied.sent,
        copying_rounds: copied.rounds,
        took,
        unsent,
    };
    Ok((stream, sender, Some(sent)))
}
