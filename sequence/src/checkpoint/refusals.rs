//! The jobs a checkpoint refuses before anything is done, from their status (part of
//! [`super`]).

use std::path::Path;

use possum_control::reply::StatusReply;
use possum_control::Request;

use super::error::PlanError;
use crate::job::ask;

/// Refuses a job with managed (unified) memory, before anything is done: NVIDIA's driver
/// checkpoint does not support it, and possum's engine does not save it.
pub(super) fn refuse_unsupported_memory(
    pid: i32,
    status: &StatusReply,
    gpu_only: bool,
) -> Result<(), PlanError> {
    let managed = status
        .possum
        .as_ref()
        .and_then(|p| p.unmanaged.as_ref())
        .and_then(|u| u.by_kind.get("cuMemAllocManaged"));
    if let Some(m) = managed.filter(|m| m.allocations > 0) {
        return Err(PlanError::Managed {
            pid,
            allocations: m.allocations,
            bytes: m.bytes,
            gpu_only,
        });
    }
    let imported = status
        .possum
        .as_ref()
        .and_then(|p| p.unmanaged.as_ref())
        .and_then(|u| u.by_kind.get(possum_control::reply::IMPORTED_MAPPING));
    match imported {
        Some(m) if m.allocations > 0 && !gpu_only => Err(PlanError::Imported {
            pid,
            mappings: m.allocations,
            bytes: m.bytes,
        }),
        _ => Ok(()),
    }
}

/// Under the driver's engine, refuses a job whose possum serves its buffers from a keeper's
/// memory: the driver's restore of a process holding imported memory fails (FINDINGS, the
/// keeper probe), and the job would be killed or held with no way back. A job without possum
/// (or whose possum does not answer) is the driver's to take as it is.
pub(super) fn refuse_driver_over_keeper(pid: i32, sockets: &Path) -> Result<(), PlanError> {
    let Ok(status) = ask::<StatusReply>(pid, sockets, &Request::Status) else {
        return Ok(());
    };
    let engines = status.body.possum.iter().flat_map(|p| &p.engines);
    match engines.clone().any(|e| e.keeper.is_some()) {
        true => Err(PlanError::DriverKeeper { pid }),
        false => Ok(()),
    }
}

/// Refuses a job with an NCCL communicator some of whose ranks are not among the processes
/// `statuses` answered for (the job's tree): they cannot be cut with it.
pub(super) fn refuse_peers_outside(statuses: &[(i32, &StatusReply)]) -> Result<(), PlanError> {
    let mut by_id: std::collections::BTreeMap<&str, (u32, u32, Vec<i32>)> = Default::default();
    for (pid, s) in statuses {
        let comms = s
            .possum
            .iter()
            .flat_map(|p| p.session.iter())
            .flat_map(|s| s.collectives.communicators.iter());
        for c in comms {
            let e = by_id.entry(&c.id).or_default();
            e.0 = e.0.max(c.nranks);
            e.1 += c.ranks_here;
            e.2.push(*pid);
        }
    }
    match by_id.into_iter().find(|(_, (n, found, _))| found < n) {
        None => Ok(()),
        Some((id, (nranks, found, pids))) => Err(PlanError::PeersOutside {
            id: id.to_string(),
            nranks,
            found,
            pids,
        }),
    }
}
