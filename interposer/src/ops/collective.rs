//! The job's collective launches (NCCL's kernels), counted, and the barrier that holds them for a
//! cut across the ranks of a multi-process job.
//!
//! Holding each rank at its own next operation deadlocks when one rank already launched a
//! collective its peer will never join: the kernel waits on the GPU for ever, and so does the
//! T0 that waits for it. A consistent cut is a collective boundary every rank reaches: possum
//! (`sequence/`'s cut) puts a barrier at each rank's next collective ([`hold`] with no number),
//! takes the largest count any rank reached as the target, moves every barrier there and waits
//! ([`wait_for`]) until each rank has launched exactly that many. Every collective below the
//! target was then launched by all ranks and completes; none above it is launched; each rank's
//! T0 (`Release`) finds nothing on its streams that waits for a peer.
//!
//! Invariant: a launch is counted when it passes [`pass`], and it never passes while the count
//! has reached the barrier. The held thread waits before the op gate admits the launch, so a
//! `Release` of the rank never waits for it.
//!
//! Every wait has an end: a barrier lifts itself when its lease runs out, unless the job's
//! operations are paused by then (a `Release` came: the resume lifts it).

use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use possum_control::reply::{CollectiveReply, Communicator};

use crate::session::state::{session, Barrier, Counts};

/// Lets one collective launch through, counted: waits while the barrier holds the launch's
/// number (until the barrier is moved, lifted, or its lease ends while `paused()` says the job's
/// operations are not paused).
pub fn pass(paused: impl Fn() -> bool) {
    let b = barrier();
    let mut c = b.counts.lock();
    while let Some((at, until)) = c.barrier {
        if c.launched < at {
            break;
        }
        if Instant::now() >= until && !paused() {
            crate::base::log::log(&format!(
                "the collective barrier at launch {at} was neither moved nor lifted within its \
                 lease: lifted"
            ));
            c.barrier = None;
            b.changed.notify_all();
            break;
        }
        c.held += 1;
        // Woken by every change; the lease is looked at again at least once a second.
        let wake = until.min(Instant::now() + Duration::from_secs(1));
        b.changed.wait_until(&mut c, wake);
        c.held -= 1;
    }
    c.launched += 1;
    b.changed.notify_all();
}

/// The barrier's state.
fn barrier() -> &'static Barrier {
    &session().collective
}

fn reply(c: &Counts) -> CollectiveReply {
    CollectiveReply {
        launched: c.launched,
        barrier: c.barrier.map(|(at, _)| at),
        held: c.held,
        communicators: communicators(),
    }
}

/// Notes that the process has a rank in communicator `handle`, whose ranks, in whichever
/// process, all know it as `id`, of `nranks` ranks.
pub fn note_communicator(handle: usize, id: u64, nranks: u32) {
    session()
        .collective
        .communicators
        .lock()
        .insert(handle, (id, nranks));
}

/// The communicator `handle`'s id, if the process has it.
pub fn communicator_id(handle: usize) -> Option<u64> {
    session()
        .collective
        .communicators
        .lock()
        .get(&handle)
        .map(|&(id, _)| id)
}

/// Forgets communicator `handle` (destroyed or aborted).
pub fn forget_communicator(handle: usize) {
    session().collective.communicators.lock().remove(&handle);
}

/// The process's communicators, each with the ranks it has in it.
fn communicators() -> Vec<Communicator> {
    let mut by_id: BTreeMap<u64, Communicator> = BTreeMap::new();
    for &(id, nranks) in session().collective.communicators.lock().values() {
        let c = by_id.entry(id).or_insert_with(|| Communicator {
            id: format!("{id:016x}"),
            nranks,
            ranks_here: 0,
        });
        c.ranks_here += 1;
    }
    by_id.into_values().collect()
}

/// A barrier asked for below the launches already let through.
#[derive(Debug, thiserror::Error)]
#[error("the job launched {launched} collectives already, past the barrier asked for at {at}")]
pub struct PastBarrier {
    /// The launches let through.
    pub launched: u64,
    /// The barrier asked for.
    pub at: u64,
}

/// Puts the barrier at launch `at` (`None`: the next launch), lifting itself after `lease`
/// unless the job is paused then. `Err` if `at` is below the launches already let through.
pub fn hold(at: Option<u64>, lease: Duration) -> Result<CollectiveReply, PastBarrier> {
    let b = barrier();
    let mut c = b.counts.lock();
    let at = at.unwrap_or(c.launched);
    if at < c.launched {
        return Err(PastBarrier {
            launched: c.launched,
            at,
        });
    }
    c.barrier = Some((at, Instant::now() + lease));
    b.changed.notify_all();
    Ok(reply(&c))
}

/// Waits until `at` collectives were let through, at most `timeout`; the counts either way.
pub fn wait_for(at: u64, timeout: Duration) -> CollectiveReply {
    let end = Instant::now() + timeout;
    let b = barrier();
    let mut c = b.counts.lock();
    while c.launched < at && Instant::now() < end {
        b.changed.wait_until(&mut c, end);
    }
    reply(&c)
}

/// Lifts the barrier (the held launches go on); the counts.
pub fn lift() -> CollectiveReply {
    let b = barrier();
    let mut c = b.counts.lock();
    c.barrier = None;
    b.changed.notify_all();
    reply(&c)
}

/// The counts, for `Status`.
pub fn counts() -> CollectiveReply {
    reply(&barrier().counts.lock())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// One test drives the process-wide counts through hold, move, wait, lease and lift (the
    /// state is global: separate tests would race).
    #[test]
    fn the_barrier_holds_launches_at_its_number_until_moved_or_lifted() {
        lift();
        let base = counts().launched;
        // A barrier at the next launch: a launching thread waits, counted as held.
        let r = hold(None, Duration::from_secs(60)).unwrap();
        assert_eq!((r.launched, r.barrier), (base, Some(base)));
        let passed = Arc::new(AtomicU64::new(0));
        let p = Arc::clone(&passed);
        let t = std::thread::spawn(move || {
            for _ in 0..3 {
                pass(|| false);
                p.fetch_add(1, Ordering::SeqCst);
            }
        });
        while counts().held == 0 {
            std::thread::yield_now();
        }
        assert_eq!(passed.load(Ordering::SeqCst), 0);
        // Moved two further: exactly two launches go through, the third waits.
        hold(Some(base + 2), Duration::from_secs(60)).unwrap();
        let r = wait_for(base + 2, Duration::from_secs(10));
        assert_eq!(r.launched, base + 2);
        while counts().held == 0 {
            std::thread::yield_now();
        }
        assert_eq!(passed.load(Ordering::SeqCst), 2);
        // A wait for more than the barrier lets through times out with the counts.
        let r = wait_for(base + 3, Duration::from_millis(50));
        assert_eq!((r.launched, r.barrier), (base + 2, Some(base + 2)));
        // A barrier below what was launched is refused.
        assert!(hold(Some(base + 1), Duration::from_secs(60)).is_err());
        // Lifted: the last launch goes.
        let r = lift();
        assert_eq!(r.barrier, None);
        t.join().unwrap();
        assert_eq!(counts().launched, base + 3);
        // A lease that runs out with the job not paused lifts the barrier by itself.
        hold(None, Duration::from_millis(30)).unwrap();
        pass(|| false);
        assert_eq!(counts().barrier, None);
        assert_eq!(counts().launched, base + 4);
    }
}
