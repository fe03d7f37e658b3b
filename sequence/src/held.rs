//! During a kept hold, `possum checkpoint` holds a second reference to every
//! buffer the job detached: an fd of each retained allocation, from the keeper (`dup`). Should
//! the keeper die while the job holds no handle to its memory, those fds keep the memory alive,
//! and before the job attaches its buffers again a new keeper is started in the same directory
//! and takes them over (`adopt`: the same ids, owner and epochs), so the job's `reclaim` finds
//! them there. Without them the job's GPU state would be lost with the keeper.
//!
//! On by default (`POSSUM_KEEPER_REVIVE=0` turns it off). The new keeper keeps each adopted fd
//! and hands out duplicates of it: driver 580 refuses to export an imported handle again
//! (CUDA_ERROR_INVALID_VALUE); with that, a keeper killed in a kept hold leaves the job running
//! bit-exact (`scripts/gpu-faults.sh`).

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::image::KeeperOfJob;

/// The fds of the retained allocations of some processes, per keeper socket.
#[derive(Debug, Default)]
pub(crate) struct HeldHandles {
    held: Vec<(PathBuf, possum_keeper::RetainedAlloc, OwnedFd)>,
    /// Sockets that did not answer, or allocations whose fd could not be had.
    missed: Vec<String>,
}

impl HeldHandles {
    /// Asks the keeper at `dir` for an fd of every allocation `pids` retained.
    pub(crate) fn collect(dir: &Path, pids: &[i32]) -> HeldHandles {
        let mut h = HeldHandles::default();
        for sock in possum_keeper::sockets_in(dir) {
            let mut k = match possum_keeper::Keeper::connect(&sock) {
                Ok(k) => k,
                Err(e) => {
                    h.missed.push(format!("{}: {e}", sock.display()));
                    continue;
                }
            };
            for &pid in pids {
                let allocs = match k.retained(pid) {
                    Ok(a) => a,
                    Err(e) => {
                        h.missed.push(format!("{} pid {pid}: {e}", sock.display()));
                        continue;
                    }
                };
                for a in allocs {
                    match k.dup(a.id) {
                        Ok(fd) => h.held.push((sock.clone(), a, fd)),
                        Err(e) => h
                            .missed
                            .push(format!("{} id {}: {e}", sock.display(), a.id)),
                    }
                }
            }
        }
        h
    }

    /// If the keeper that holds them no longer answers, starts one in its directory (for the
    /// job `pid`, seeing the job's `CUDA_VISIBLE_DEVICES`) and hands it every allocation. What was
    /// done, for the checkpoint's JSON.
    pub(crate) fn revive(&self, keeper: &KeeperOfJob, exe: &Path, pid: i32) -> Value {
        let gone: Vec<&PathBuf> = {
            let mut socks: Vec<&PathBuf> = self.held.iter().map(|(s, _, _)| s).collect();
            socks.dedup();
            socks
                .into_iter()
                .filter(|s| possum_keeper::Keeper::connect(s).is_err())
                .collect()
        };
        let mut out = json!({"handles_held": self.held.len(), "missed": self.missed,
                             "keeper_restarted": false});
        if gone.is_empty() {
            return out;
        }
        let t = std::time::Instant::now();
        let child = match keeper.start_keeper(exe, pid) {
            Ok(c) => c,
            Err(e) => {
                out["keeper_restart_error"] = json!(format!("{e:#}"));
                return out;
            }
        };
        // It serves on without us (ending with the job); nobody reads its output now.
        drop(child);
        out["keeper_restarted"] = json!(true);
        out["keeper_start_ms"] = json!(t.elapsed().as_secs_f64() * 1e3);
        let mut adopted = 0;
        let mut errors = Vec::new();
        for sock in gone {
            let mut k = match possum_keeper::Keeper::connect(sock) {
                Ok(k) => k,
                Err(e) => {
                    errors.push(format!("{}: {e}", sock.display()));
                    continue;
                }
            };
            for (_, a, fd) in self.held.iter().filter(|(s, _, _)| s == sock) {
                match k.adopt(a, fd.as_fd()) {
                    Ok(()) => adopted += 1,
                    Err(e) => errors.push(format!("{} id {}: {e}", sock.display(), a.id)),
                }
            }
        }
        out["adopted"] = json!(adopted);
        out["adopt_ms"] = json!(t.elapsed().as_secs_f64() * 1e3);
        out["adopt_errors"] = json!(errors);
        out
    }
}
