//! A migration's source asking, before the cut, how far the destination loaded what was sent
//! ahead (`LoadQuery`, `Loaded`): the wait's ends, and the transfer in step after it.

use super::*;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A receiver's side whose loads answer as `answers` says, in turn (the last again once they
/// run out), counting the questions.
struct Scripted {
    answers: VecDeque<(u64, u64)>,
    asked: Arc<AtomicUsize>,
}

impl Watch for Scripted {
    fn part(&mut self, _: &Path, _: Part, _: &Brought) {}
    fn loaded(&mut self) -> (u64, u64) {
        self.asked.fetch_add(1, Ordering::Relaxed);
        match self.answers.len() {
            0 => (0, 0),
            1 => self.answers[0],
            _ => self.answers.pop_front().unwrap_or_default(),
        }
    }
}

/// Sends a directory ahead, waits as `wait` says for a receiver whose loads answer
/// `answers`, then sends the final set: what the wait found, how often the receiver was asked,
/// and that the directory arrived bit-exact all the same.
fn sent_waiting(answers: &[(u64, u64)], wait: LoadWait) -> (LoadedAhead, usize) {
    let (_tmp, src, out) = dirs();
    fs::write(src.join("weights"), noise(3 * CHUNK_BYTES / 2)).unwrap();
    let dest = out.join("image");
    let (mut a, mut b) = pair();
    let asked = Arc::new(AtomicUsize::new(0));
    let mut watch = Scripted {
        answers: answers.iter().copied().collect(),
        asked: asked.clone(),
    };
    let d = dest.clone();
    let receiver = thread::spawn(move || {
        let session = receiver_handshake(&mut b, &key(3)).unwrap();
        receive_dir_watching(&mut b, session, &d, Durability::Synced, &mut watch)
            .map(|(report, _)| report)
    });
    let mut sender = DirSender::start(&mut a, &key(3)).unwrap();
    sender.send_ahead(&mut a, &src).unwrap();
    let loaded = sender.await_loaded(&mut a, wait).unwrap();
    let (report, _) = sender.finish(&mut a, &src).unwrap();
    assert_eq!(receiver.join().unwrap().unwrap().totals, report.totals);
    assert_eq!(snapshot(&dest), snapshot(&src));
    (loaded, asked.load(Ordering::Relaxed))
}

fn wait(limit: Duration, stalled: Duration) -> LoadWait {
    LoadWait {
        limit,
        stalled,
        poll: Duration::from_millis(1),
    }
}

/// The source asks until nothing is left to load, and says what the destination last said.
#[test]
fn the_source_waits_until_what_went_ahead_is_loaded() {
    let answers = [(0, 300), (100, 200), (250, 50), (300, 0)];
    let long = Duration::from_secs(60);
    let (l, asked) = sent_waiting(&answers, wait(long, long));
    assert_eq!((l.loaded, l.left, l.end), (300, 0, LoadWaitEnd::Loaded));
    assert_eq!(asked, 4, "asked once per answer, until all was loaded");
}

/// A destination that loads nothing ahead is asked once.
#[test]
fn a_destination_loading_nothing_ahead_is_asked_once() {
    let long = Duration::from_secs(60);
    let (l, asked) = sent_waiting(&[], wait(long, long));
    assert_eq!((l.loaded, l.left, l.end), (0, 0, LoadWaitEnd::Nothing));
    assert_eq!(asked, 1);
}

/// Loads that stop moving end the wait (not the limit, far off); loads that move but never end
/// are waited for until the limit.
#[test]
fn the_wait_ends_when_the_loads_stall_or_at_its_limit() {
    let long = Duration::from_secs(60);
    let (l, asked) = sent_waiting(&[(10, 90)], wait(long, Duration::from_millis(30)));
    assert_eq!((l.loaded, l.left, l.end), (10, 90, LoadWaitEnd::Stalled));
    assert!(asked >= 2, "asked again before it gave up: {asked}");
    assert!(l.waited < long);

    let moving: Vec<(u64, u64)> = (1..100_000).map(|n| (n, 1 << 40)).collect();
    // (The first answer comes once the receiver has synced what was sent: the limit is long
    // enough for more after it.)
    let limit = Duration::from_secs(1);
    let (l, _) = sent_waiting(&moving, wait(limit, long));
    assert_eq!(l.end, LoadWaitEnd::Limit);
    assert!(l.loaded > 1 && l.left == 1 << 40, "{l:?}");
    assert!(l.waited >= limit);
}
