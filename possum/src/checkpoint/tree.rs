//! The job's process tree: the CUDA processes among the root's descendants, which the driver must
//! lock and checkpoint with the root before CRIU dumps the tree, and restore and unlock after.
//!
//! A descendant is a CUDA process if NVIDIA's driver reports it running, locked or checkpointed
//! and its CUDA restore thread is one of its own threads. A process forked from a CUDA process
//! (a DataLoader worker) has no CUDA context of its own: the driver either does not know it or
//! names a restore thread the fork did not copy; CRIU's possum plugin handles its inherited NVIDIA
//! mappings.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use possum_cuda::checkpoint::{DriverCheckpoint, ProcessState};

/// The parent of each process, from `/proc/PID/stat` (`proc` is `/proc`, or a stand-in in tests).
fn parents(proc: &Path) -> HashMap<i32, i32> {
    let Ok(entries) = fs::read_dir(proc) else {
        return HashMap::new();
    };
    entries
        .filter_map(|e| {
            let pid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = fs::read_to_string(proc.join(pid.to_string()).join("stat")).ok()?;
            Some((pid, ppid_of(&stat)?))
        })
        .collect()
}

/// The parent pid in a `/proc/PID/stat` line: the field after the state, which follows the last
/// `)` (the command name may itself hold spaces and parentheses).
fn ppid_of(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Every descendant of `root` (children, grandchildren, ...), sorted.
pub fn descendants(root: i32) -> Vec<i32> {
    descendants_in(Path::new("/proc"), root)
}

fn descendants_in(proc: &Path, root: i32) -> Vec<i32> {
    let parents = parents(proc);
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for (&child, &parent) in &parents {
            if parent == p && child != root && !out.contains(&child) {
                out.push(child);
                frontier.push(child);
            }
        }
    }
    out.sort_unstable();
    out
}

/// What the driver says about a descendant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Member {
    /// No CUDA context of its own (CRIU and its plugin handle it alone).
    NoCuda,
    /// A CUDA process in this state.
    Cuda(ProcessState),
}

/// Whether thread `tid` belongs to process `pid`.
fn has_thread(pid: i32, tid: i32) -> bool {
    Path::new(&format!("/proc/{pid}/task/{tid}")).exists()
}

/// The driver's view of process `pid`.
pub fn member(drv: &DriverCheckpoint, pid: i32) -> Member {
    match drv.state(pid) {
        Err(_) => Member::NoCuda,
        Ok(state) => match drv.restore_thread_id(pid) {
            Ok(tid) if !has_thread(pid, tid) => Member::NoCuda,
            _ => Member::Cuda(state),
        },
    }
}

/// The CUDA processes among `root`'s descendants, or an error naming one the driver holds in
/// another state than running (another checkpoint has it, or left it so).
pub fn cuda_descendants(drv: &DriverCheckpoint, root: i32) -> anyhow::Result<Vec<i32>> {
    let mut out = Vec::new();
    for pid in descendants(root) {
        match member(drv, pid) {
            Member::NoCuda => {}
            Member::Cuda(ProcessState::Running) => out.push(pid),
            Member::Cuda(other) => anyhow::bail!(
                "process {pid} (in the job's process tree under {root}) is {other} in the CUDA \
                 driver: another checkpoint holds it, or it was left so by one"
            ),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ppid_survives_odd_command_names() {
        assert_eq!(ppid_of("12 (python3) S 7 12 12 0"), Some(7));
        assert_eq!(ppid_of("12 (a) b (c) R 99 12 12 0"), Some(99));
        assert_eq!(ppid_of("garbage"), None);
    }

    #[test]
    fn descendants_are_the_whole_subtree_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        // 1 -> 10 -> {11, 12 -> 13}; 1 -> 20 (not under 10).
        for (pid, ppid) in [(10, 1), (11, 10), (12, 10), (13, 12), (20, 1)] {
            let d = dir.path().join(pid.to_string());
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("stat"), format!("{pid} (job x) S {ppid} 1 1 0")).unwrap();
        }
        fs::create_dir_all(dir.path().join("self")).unwrap();
        assert_eq!(descendants_in(dir.path(), 10), vec![11, 12, 13]);
        assert_eq!(descendants_in(dir.path(), 12), vec![13]);
        assert!(descendants_in(dir.path(), 13).is_empty());
    }

    #[test]
    fn this_process_children_are_found_in_proc() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let me = std::process::id() as i32;
        let found = descendants(me);
        child.kill().unwrap();
        let _ = child.wait();
        assert!(found.contains(&(child.id() as i32)), "{found:?}");
    }
}
