//! `possum migrate`'s progress line on a terminal: the round sent ahead, the bytes sent and their
//! rate, the downtime expected were the job held now; then the hold and the restore. Redrawn
//! in place on stderr by a thread of its own, a few times a second; the notes the sequence says
//! are printed above it.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use possum_sequence::{MigrateStep, Observer};

/// How often the line is redrawn.
const TICK: Duration = Duration::from_millis(250);

/// What the line says, shared with its thread.
#[derive(Default)]
struct Shown {
    /// The image's bytes sent so far.
    sent: Option<Arc<AtomicU64>>,
    /// Where the migration is, in words.
    phase: String,
    /// The downtime expected were the job held now, from the last round.
    estimate: Option<Duration>,
}

/// The progress line: an [`Observer`] whose notes go above it; shown only on a terminal.
pub(crate) struct MigrateLine {
    shown: Arc<Mutex<Shown>>,
    thread: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
}

fn lock(m: &Mutex<Shown>) -> std::sync::MutexGuard<'_, Shown> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl MigrateLine {
    /// A line drawn when `show` (stderr a terminal, no --json); otherwise only the notes.
    pub(crate) fn new(show: bool) -> MigrateLine {
        let shown = Arc::new(Mutex::new(Shown {
            phase: "checkpoint: pre-copy".into(),
            ..Shown::default()
        }));
        let thread = show.then(|| {
            let (tx, rx) = mpsc::channel();
            let s = shown.clone();
            (tx, std::thread::spawn(move || draw_until(&s, &rx)))
        });
        MigrateLine { shown, thread }
    }
}

/// Redraws the line every [`TICK`] until `stop` says or hangs up; then clears it.
fn draw_until(shown: &Mutex<Shown>, stop: &mpsc::Receiver<()>) {
    // (when, bytes) a second or so ago: the rate is over the last second.
    let mut since = (Instant::now(), 0u64);
    let mut rate = 0.0;
    loop {
        let line = {
            let s = lock(shown);
            let sent = s.sent.as_ref().map_or(0, |c| c.load(Ordering::Relaxed));
            let dt = since.0.elapsed().as_secs_f64();
            if dt >= 1.0 {
                rate = sent.saturating_sub(since.1) as f64 / dt;
                since = (Instant::now(), sent);
            }
            line(&s.phase, sent, rate, s.estimate)
        };
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[K{line}");
        let _ = err.flush();
        drop(err);
        match stop.recv_timeout(TICK) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            _ => break,
        }
    }
    let _ = write!(std::io::stderr(), "\r\x1b[K");
}

/// The line's text.
fn line(phase: &str, sent: u64, rate: f64, estimate: Option<Duration>) -> String {
    let mut out = format!(
        "possum migrate: {phase}; {:.2} GiB sent",
        sent as f64 / f64::from(1u32 << 30)
    );
    if rate > 0.0 {
        out += &format!(" ({:.1} GB/s)", rate / 1e9);
    }
    if let Some(e) = estimate {
        out += &format!("; downtime if held now ~{:.1} s", e.as_secs_f64());
    }
    out
}

impl Observer for MigrateLine {
    fn copying(&mut self, _: u64, _: &Path) {}
    fn copied(&mut self) {}

    fn note(&mut self, what: &str) {
        let mut err = std::io::stderr().lock();
        let clear = if self.thread.is_some() {
            "\r\x1b[K"
        } else {
            ""
        };
        let _ = writeln!(err, "{clear}possum: {what}");
    }

    fn migrating(&mut self, step: MigrateStep) {
        let mut s = lock(&self.shown);
        match step {
            MigrateStep::Connected { sent } => {
                s.sent = Some(sent);
                s.phase = "connected, pre-copy".into();
            }
            MigrateStep::Round {
                round,
                bytes,
                estimate,
            } => {
                let mib = bytes as f64 / f64::from(1u32 << 20);
                s.phase = format!("pre-copy round {round} sent ahead ({mib:.0} MiB written)");
                s.estimate = estimate;
            }
            MigrateStep::Loading { limit } => {
                s.phase = format!(
                    "the destination loads what was sent ahead (at most {:.1} s)",
                    limit.as_secs_f64()
                );
            }
            MigrateStep::Held => {
                s.phase = "the job held, sending the rest".into();
                s.estimate = None;
            }
            MigrateStep::Restoring => s.phase = "the destination restores the job".into(),
        }
    }
}

impl Drop for MigrateLine {
    fn drop(&mut self) {
        if let Some((tx, thread)) = self.thread.take() {
            drop(tx);
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_says_the_phase_the_bytes_their_rate_and_the_estimate() {
        let l = line("pre-copy round 2 sent ahead", 3 << 30, 8.6e9, None);
        assert_eq!(
            l,
            "possum migrate: pre-copy round 2 sent ahead; 3.00 GiB sent (8.6 GB/s)"
        );
        let l = line("x", 0, 0.0, Some(Duration::from_millis(2400)));
        assert_eq!(
            l,
            "possum migrate: x; 0.00 GiB sent; downtime if held now ~2.4 s"
        );
    }

    #[test]
    fn steps_change_what_the_line_says() {
        let mut m = MigrateLine::new(false);
        let sent = Arc::new(AtomicU64::new(5));
        m.migrating(MigrateStep::Connected { sent: sent.clone() });
        m.migrating(MigrateStep::Round {
            round: 1,
            bytes: 3 << 20,
            estimate: Some(Duration::from_secs(2)),
        });
        {
            let s = lock(&m.shown);
            assert_eq!(s.phase, "pre-copy round 1 sent ahead (3 MiB written)");
            assert_eq!(s.estimate, Some(Duration::from_secs(2)));
            assert_eq!(s.sent.as_ref().unwrap().load(Ordering::Relaxed), 5);
        }
        m.migrating(MigrateStep::Loading {
            limit: Duration::from_secs(5),
        });
        assert_eq!(
            lock(&m.shown).phase,
            "the destination loads what was sent ahead (at most 5.0 s)"
        );
        m.migrating(MigrateStep::Held);
        assert_eq!(lock(&m.shown).estimate, None, "no estimate once held");
        m.migrating(MigrateStep::Restoring);
        assert_eq!(lock(&m.shown).phase, "the destination restores the job");
    }
}
