//! The cut across the ranks of a multi-process job: one T0 at a collective boundary every rank
//! reaches, found before any rank is held.
//!
//! Holding each rank at its own next operation deadlocks when one rank already launched a
//! collective (NCCL's kernel) its peer never joins: the kernel waits on the GPU for ever, and so
//! does that rank's T0. So, before the ranks are released:
//!
//! 1. **barrier**: each process's collective launches are held from its next one on
//!    (`CollectiveHold`); its reply says how many it launched. The ranks are the processes that
//!    launched any (a launcher such as torchrun's agent loads NCCL but launches none); the
//!    others are let go at once.
//! 2. **target**: the most any rank launched. Every collective below it was launched by some
//!    rank, so its peers must launch it too; none above it is launched by anyone.
//! 3. **run to the target**: each rank's barrier moves to the target and possum waits until it
//!    has launched exactly that many (`CollectiveWait`), all within one deadline.
//!
//! Then every collective launched is joined by every rank, and each rank's `Release` (T0) finds
//! nothing on its streams that waits for a peer. The barriers stay up until each rank resumes
//! (its resume lifts them), so no rank starts a collective its held peers cannot join. Any
//! failure lifts every barrier: the ranks run on, and the error names the rank and what it was
//! waiting for.
//!
//! Assumes what NCCL requires of its users: the ranks launch their collectives in the same order.

use std::path::Path;
use std::time::{Duration, Instant};

use possum_control::reply::CollectiveReply;
use possum_control::Request;

use crate::job::{ask_within, JobError};

/// How long a request about the barrier may take beyond its own wait.
const ASK_MARGIN: Duration = Duration::from_secs(10);

/// A cut found: the ranks and the collective boundary they all stand at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RanksCut {
    /// The processes held at the boundary.
    pub ranks: Vec<i32>,
    /// The number of collective launches every rank made: the boundary.
    pub target: u64,
    /// How many each rank had launched when its barrier went up, in `ranks`' order.
    pub reached: Vec<u64>,
    /// How long the ranks took to reach the target.
    pub waited: Duration,
}

/// Why no consistent cut was found (every barrier is lifted: the job runs on).
#[derive(Debug, thiserror::Error)]
pub enum RanksError {
    /// A rank's possum did not answer (the process died, or its possum failed).
    #[error("rank {pid} could not be held at a collective boundary: {source}")]
    Job {
        /// The rank.
        pid: i32,
        /// What failed.
        #[source]
        source: JobError,
    },
    /// A rank did not reach the boundary in time.
    #[error(
        "rank {pid} launched {launched} of the {target} collectives its peers had launched \
         within {secs:.1} s: it waits for something else (a peer outside the job's tree, a \
         collective no other rank joins, host-side work); no rank was held, the job runs on \
         (a longer wait: POSSUM_CUT_DEADLINE_MS)"
    )]
    Behind {
        /// The rank.
        pid: i32,
        /// Its collective launches.
        launched: u64,
        /// The boundary.
        target: u64,
        /// The deadline, s.
        secs: f64,
    },
}

/// How the cut reaches each process's possum.
pub trait Ranks {
    /// Asks process `pid`'s possum `req`, waiting at most `timeout`.
    fn ask(&self, pid: i32, req: &Request, timeout: Duration) -> Result<CollectiveReply, JobError>;
}

/// The job's processes, reached through the socket directory `sockets`.
#[derive(Debug, Clone, Copy)]
pub struct JobRanks<'a>(pub &'a Path);

impl Ranks for JobRanks<'_> {
    fn ask(&self, pid: i32, req: &Request, timeout: Duration) -> Result<CollectiveReply, JobError> {
        ask_within(pid, self.0, req, timeout).map(|r| r.body)
    }
}

/// Finds the cut across `pids` (the tree's processes with possum) within `deadline`: `None`
/// when fewer than two of them are ranks (nothing to agree on: no barrier is left up), else the
/// ranks held at their common boundary. On `Err`, every barrier is lifted.
pub fn cut(
    pids: &[i32],
    ranks: &dyn Ranks,
    deadline: Duration,
) -> Result<Option<RanksCut>, RanksError> {
    let t = Instant::now();
    // The barrier lifts itself if neither possum nor its guard is there to release or lift it.
    let lease_ms =
        u64::try_from((deadline * 2 + Duration::from_secs(60)).as_millis()).unwrap_or(u64::MAX);
    let mut up: Vec<i32> = Vec::new();
    let r = (|| {
        let mut reached = Vec::new();
        for &pid in pids {
            let req = Request::CollectiveHold { at: None, lease_ms };
            let r = ranks
                .ask(pid, &req, ASK_MARGIN)
                .map_err(|source| RanksError::Job { pid, source })?;
            up.push(pid);
            reached.push((pid, r.launched));
        }
        let (in_cut, others): (Vec<_>, Vec<_>) = reached.into_iter().partition(|&(_, n)| n > 0);
        for (pid, _) in others {
            lift(ranks, pid);
            up.retain(|&p| p != pid);
        }
        if in_cut.len() < 2 {
            return Ok(None);
        }
        let target = in_cut.iter().map(|&(_, n)| n).max().unwrap_or(0);
        for &(pid, n) in &in_cut {
            if n < target {
                let req = Request::CollectiveHold {
                    at: Some(target),
                    lease_ms,
                };
                ranks
                    .ask(pid, &req, ASK_MARGIN)
                    .map_err(|source| RanksError::Job { pid, source })?;
            }
        }
        for &(pid, _) in &in_cut {
            let left = deadline.saturating_sub(t.elapsed());
            let req = Request::CollectiveWait {
                at: target,
                timeout_ms: u64::try_from(left.as_millis()).unwrap_or(u64::MAX),
            };
            let r = ranks
                .ask(pid, &req, left + ASK_MARGIN)
                .map_err(|source| RanksError::Job { pid, source })?;
            if r.launched < target {
                return Err(RanksError::Behind {
                    pid,
                    launched: r.launched,
                    target,
                    secs: deadline.as_secs_f64(),
                });
            }
        }
        Ok(Some(RanksCut {
            ranks: in_cut.iter().map(|&(p, _)| p).collect(),
            target,
            reached: in_cut.iter().map(|&(_, n)| n).collect(),
            waited: t.elapsed(),
        }))
    })();
    if !matches!(r, Ok(Some(_))) {
        lift_all(ranks, &up);
    }
    r
}

/// Lifts the barriers of `pids` (best effort: a process that is gone has none).
pub fn lift_all(ranks: &dyn Ranks, pids: &[i32]) {
    for &pid in pids {
        lift(ranks, pid);
    }
}

fn lift(ranks: &dyn Ranks, pid: i32) {
    let _ = ranks.ask(pid, &Request::CollectiveLift, ASK_MARGIN);
}

#[cfg(test)]
mod tests {
    use super::*;
    use possum_control::ControlError;
    use std::collections::HashMap;
    use std::sync::Mutex;

    type SimRank = (u64, Option<u64>, u64);

    /// Ranks simulated in memory: each has launched some collectives and, let run, launches up
    /// to `can_reach` of them (a rank stuck on something else reaches fewer).
    #[derive(Default)]
    struct Sim {
        /// Per rank: (launched, barrier, can_reach).
        ranks: Mutex<HashMap<i32, SimRank>>,
        dead: Vec<i32>,
        asked: Mutex<Vec<String>>,
    }

    impl Sim {
        fn with(ranks: &[(i32, u64, u64)]) -> Sim {
            let s = Sim::default();
            for &(pid, launched, can_reach) in ranks {
                s.ranks
                    .lock()
                    .unwrap()
                    .insert(pid, (launched, None, can_reach));
            }
            s
        }
        fn barrier(&self, pid: i32) -> Option<u64> {
            self.ranks.lock().unwrap()[&pid].1
        }
    }

    impl Ranks for Sim {
        fn ask(
            &self,
            pid: i32,
            req: &Request,
            _timeout: Duration,
        ) -> Result<CollectiveReply, JobError> {
            self.asked.lock().unwrap().push(format!("{pid}: {req:?}"));
            if self.dead.contains(&pid) {
                return Err(JobError::NoProcess(ControlError::NoProcess(pid as u32)));
            }
            let mut all = self.ranks.lock().unwrap();
            let r = all.get_mut(&pid).expect("known rank");
            match req {
                Request::CollectiveHold { at, .. } => {
                    let at = at.unwrap_or(r.0);
                    assert!(at >= r.0, "a barrier below what was launched");
                    r.1 = Some(at);
                }
                Request::CollectiveWait { at, .. } => {
                    // Let run: up to its barrier, as far as it can get.
                    let limit = r.1.unwrap_or(u64::MAX).min(*at).min(r.2);
                    r.0 = r.0.max(limit);
                }
                Request::CollectiveLift => r.1 = None,
                other => panic!("unexpected {other:?}"),
            }
            Ok(CollectiveReply {
                launched: r.0,
                barrier: r.1,
                held: 0,
                ..CollectiveReply::default()
            })
        }
    }

    #[test]
    fn ranks_behind_are_run_to_the_most_any_rank_launched_and_held_there() {
        let sim = Sim::with(&[(10, 7, 100), (11, 9, 100), (12, 0, 100)]);
        let cut = cut(&[10, 11, 12], &sim, Duration::from_secs(5))
            .unwrap()
            .expect("two ranks");
        assert_eq!(cut.ranks, vec![10, 11]);
        assert_eq!(cut.target, 9);
        assert_eq!(cut.reached, vec![7, 9]);
        let all = sim.ranks.lock().unwrap();
        // Both stand at the boundary, their barriers up there; the process without NCCL is free.
        assert_eq!((all[&10].0, all[&10].1), (9, Some(9)));
        assert_eq!((all[&11].0, all[&11].1), (9, Some(9)));
        assert_eq!(all[&12].1, None);
    }

    #[test]
    fn a_process_that_launched_no_collective_is_no_rank_and_is_let_go() {
        // torchrun's agent: possum and NCCL loaded, no collective launched.
        let sim = Sim::with(&[(1, 0, 0), (10, 4, 100), (11, 5, 100)]);
        let cut = cut(&[1, 10, 11], &sim, Duration::from_secs(5))
            .unwrap()
            .unwrap();
        assert_eq!((cut.ranks.clone(), cut.target), (vec![10, 11], 5));
        assert_eq!(sim.barrier(1), None);
    }

    #[test]
    fn one_rank_or_none_needs_no_cut_and_leaves_no_barrier() {
        let sim = Sim::with(&[(10, 5, 100), (11, 0, 100)]);
        assert_eq!(cut(&[10, 11], &sim, Duration::from_secs(5)).unwrap(), None);
        assert_eq!((sim.barrier(10), sim.barrier(11)), (None, None));
    }

    #[test]
    fn a_rank_that_cannot_reach_the_boundary_is_named_and_every_barrier_lifted() {
        let sim = Sim::with(&[(10, 3, 4), (11, 6, 100)]);
        let e = cut(&[10, 11], &sim, Duration::from_secs(5)).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(
                e,
                RanksError::Behind {
                    pid: 10,
                    launched: 4,
                    target: 6,
                    ..
                }
            ),
            "{text}"
        );
        assert!(text.contains("rank 10 launched 4 of the 6"), "{text}");
        assert_eq!((sim.barrier(10), sim.barrier(11)), (None, None));
    }

    #[test]
    fn a_dead_rank_lifts_the_barriers_already_up() {
        let mut sim = Sim::with(&[(10, 3, 100), (11, 6, 100), (12, 1, 100)]);
        sim.dead = vec![11];
        let e = cut(&[10, 11, 12], &sim, Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, RanksError::Job { pid: 11, .. }), "{e}");
        assert!(e.to_string().contains("rank 11"), "{e}");
        assert_eq!(sim.barrier(10), None);
        assert!(sim
            .asked
            .lock()
            .unwrap()
            .iter()
            .any(|a| a.starts_with("10: CollectiveLift")));
    }
}
