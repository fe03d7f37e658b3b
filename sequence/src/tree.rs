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

use possum_cuda::checkpoint::{
    own_context, DriverCheckpoint, DriverCkptError, OwnContext, ProcessState,
};

/// The parent of each process, from `/proc/PID/stat` (`proc` is `/proc`, or a stand-in in tests).
fn parents(proc: &Path) -> HashMap<i32, i32> {
    let Ok(entries) = fs::read_dir(proc) else {
        return HashMap::new();
    };
    entries
        .filter_map(|e| {
            let pid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = possum_control::proc_text(proc.join(pid.to_string()).join("stat")).ok()?;
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

/// `root` and every descendant of it ([`descendants`]): a job's processes.
pub fn with_descendants(root: i32) -> Vec<i32> {
    std::iter::once(root).chain(descendants(root)).collect()
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

/// The driver's view of process `pid` (as [`DriverCheckpoint::own_context_of`]); a query that
/// did not return within its deadline is an error, not "no CUDA".
pub fn member(drv: &DriverCheckpoint, pid: i32) -> Result<Member, DriverCkptError> {
    let state = match drv.state(pid) {
        Err(e @ DriverCkptError::DeadlineExceeded { .. }) => return Err(e),
        other => other,
    };
    let tid = match state.is_ok().then(|| drv.restore_thread_id(pid)) {
        Some(Err(e @ DriverCkptError::DeadlineExceeded { .. })) => return Err(e),
        other => other,
    };
    let code = |e: DriverCkptError| e.code().unwrap_or(-1);
    let own = own_context(state.map_err(code), tid.map(|t| t.map_err(code)), |t| {
        Path::new(&format!("/proc/{pid}/task/{t}")).exists()
    });
    Ok(match own {
        OwnContext::None(_) => Member::NoCuda,
        OwnContext::Present(state) => Member::Cuda(state),
    })
}

/// A process of the job's tree that the driver holds in another state than running.
#[derive(Debug, thiserror::Error)]
#[error(
    "process {pid} (in the job's process tree under {root}) is {state} in the CUDA driver: \
     another checkpoint holds it, or it was left so by one"
)]
pub struct NotRunning {
    /// The process.
    pub pid: i32,
    /// The root of the tree.
    pub root: i32,
    /// Its state.
    pub state: ProcessState,
}

/// The CUDA processes among `root`'s descendants, or an error naming one the driver holds in
/// another state than running (another checkpoint has it, or left it so).
pub fn cuda_descendants(drv: &DriverCheckpoint, root: i32) -> Result<Vec<i32>, TreeError> {
    let mut out = Vec::new();
    for pid in descendants(root) {
        let m = member(drv, pid).map_err(|source| TreeError::Deadline { pid, source })?;
        match m {
            Member::NoCuda => {}
            Member::Cuda(ProcessState::Running) => out.push(pid),
            Member::Cuda(state) => return Err(NotRunning { pid, root, state }.into()),
        }
    }
    Ok(out)
}

/// Why the CUDA processes of a job's tree could not be listed.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    /// One is held by another checkpoint.
    #[error(transparent)]
    NotRunning(#[from] NotRunning),
    /// The driver did not answer about one in time.
    #[error("process {pid} of the job's tree: the driver did not answer in time")]
    Deadline {
        /// The process.
        pid: i32,
        /// The driver's call past its deadline.
        #[source]
        source: DriverCkptError,
    },
}

/// The directories of the filesystem paths that `pids`' unix sockets are bound to (a socket's
/// `sun_path`, from `/proc/net/unix`; abstract ones aside), sorted. CRIU binds a listening socket
/// at its path again at the restore, in a directory that must exist: a job that ended (or a restore
/// on another machine) may have removed it, e.g. Python multiprocessing's `pymp-*` directories,
/// where DataLoader workers' sockets live.
pub fn socket_dirs(pids: &[i32]) -> Vec<std::path::PathBuf> {
    let mut inodes = std::collections::HashSet::new();
    for pid in pids {
        let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.filter_map(Result::ok) {
            if let Some(ino) = fs::read_link(fd.path()).ok().and_then(|t| socket_inode(&t)) {
                inodes.insert(ino);
            }
        }
    }
    let table = possum_control::proc_text("/proc/net/unix").unwrap_or_default();
    let mut dirs: Vec<std::path::PathBuf> = unix_paths(&table)
        .into_iter()
        .filter(|(ino, _)| inodes.contains(ino))
        .filter_map(|(_, path)| Path::new(&path).parent().map(Path::to_path_buf))
        .collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

/// The root's standard descriptors (0, 1, 2) that are pipes whose other end no process of the
/// tree holds (`possum run job | tee log`): (fd, CRIU's name for the pipe, `pipe:[INODE]`).
/// CRIU restores such a pipe with nobody at its other end (the job's next write to it would get
/// SIGPIPE); the restore hands the job its own descriptor of that number instead.
pub fn external_stdio_pipes(root: i32, tree: &[i32]) -> Vec<(i32, String)> {
    let mut all = Vec::new();
    for &p in tree {
        let Ok(fds) = fs::read_dir(format!("/proc/{p}/fd")) else {
            continue;
        };
        all.extend(
            fds.filter_map(Result::ok)
                .filter_map(|fd| pipe_end(p, fd.file_name().to_str()?)),
        );
    }
    (0..=2)
        .filter_map(|fd| {
            let (target, mode) = pipe_end(root, &fd.to_string())?;
            // The other end inside the tree: CRIU restores the pipe whole.
            let inside = all.iter().any(|(t, m)| *t == target && *m != mode);
            (!inside).then_some((fd, target))
        })
        .collect()
}

/// Descriptor `fd` of `pid`, if it is a pipe: (`pipe:[INODE]`, its access mode).
fn pipe_end(pid: i32, fd: &str) -> Option<(String, i32)> {
    let target = fs::read_link(format!("/proc/{pid}/fd/{fd}")).ok()?;
    let target = target.to_str()?.to_string();
    target.starts_with("pipe:[").then_some(())?;
    let info = fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).ok()?;
    Some((target, access_mode(&info)?))
}

/// O_ACCMODE of a `/proc/PID/fdinfo/FD` text's `flags:` line (octal).
fn access_mode(fdinfo: &str) -> Option<i32> {
    let flags = fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags:"))?
        .trim();
    i32::from_str_radix(flags, 8).ok().map(|f| f & 3)
}

/// The inode of a descriptor's target `socket:[INODE]`.
pub(crate) fn socket_inode(target: &Path) -> Option<u64> {
    target
        .to_str()?
        .strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// (inode, path) of every socket bound to a filesystem path in a `/proc/net/unix` table
/// (`Num RefCount Protocol Flags Type St Inode Path`).
fn unix_paths(table: &str) -> Vec<(u64, String)> {
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let ino = f.get(6)?.parse().ok()?;
            let path = f.get(7)?;
            path.starts_with('/').then(|| (ino, path.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_access_mode_is_read_from_fdinfo() {
        let info = "pos:\t0\nflags:\t02000001\nmnt_id:\t15\nino:\t7\n";
        assert_eq!(access_mode(info), Some(1));
        assert_eq!(access_mode("pos:\t0\nflags:\t0100002\n"), Some(2));
        assert_eq!(access_mode("pos:\t0\n"), None);
    }

    /// `external_stdio_pipes` of a `sleep` with this stdin and stdout.
    fn pipes_of_sleep(
        stdin: std::process::Stdio,
        stdout: std::process::Stdio,
    ) -> Vec<(i32, String)> {
        let mut c = std::process::Command::new("sleep")
            .arg("30")
            .stdin(stdin)
            .stdout(stdout)
            .spawn()
            .unwrap();
        let pid = c.id() as i32;
        let got = external_stdio_pipes(pid, &[pid]);
        c.kill().unwrap();
        c.wait().unwrap();
        got
    }

    /// A child whose stdout is a pipe this process reads: external; one whose stdin and stdout
    /// are the two ends of one pipe: inside its tree. (Its stderr is this test's, which may be a
    /// pipe too.)
    #[test]
    fn a_stdio_pipe_is_external_unless_the_tree_holds_its_other_end() {
        use std::process::Stdio;
        let (rd, wr) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let got = pipes_of_sleep(Stdio::null(), Stdio::from(wr));
        drop(rd);
        let out: Vec<_> = got.iter().filter(|(fd, _)| *fd < 2).collect();
        assert_eq!(out.len(), 1, "{got:?}");
        assert_eq!(out[0].0, 1);
        assert!(out[0].1.starts_with("pipe:["), "{got:?}");

        let (rd, wr) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let got = pipes_of_sleep(Stdio::from(rd), Stdio::from(wr));
        assert!(got.iter().all(|(fd, _)| *fd == 2), "{got:?}");
    }

    #[test]
    fn bound_socket_paths_are_read_from_the_unix_table() {
        let table = "Num       RefCount Protocol Flags    Type St Inode Path\n\
            0000000000000000: 00000002 00000000 00010000 0001 01 4242 /tmp/pymp-x/listener-1\n\
            0000000000000000: 00000002 00000000 00010000 0001 01 4243 @abstract\n\
            0000000000000000: 00000003 00000000 00000000 0001 03 4244\n";
        assert_eq!(
            unix_paths(table),
            vec![(4242, "/tmp/pymp-x/listener-1".to_string())]
        );
        assert_eq!(socket_inode(Path::new("socket:[4242]")), Some(4242));
        assert_eq!(socket_inode(Path::new("/dev/null")), None);
    }

    #[test]
    fn only_a_descriptor_of_a_socket_names_its_inode() {
        assert_eq!(socket_inode(Path::new("socket:[123]")), Some(123));
        assert_eq!(socket_inode(Path::new("pipe:[123]")), None);
        assert_eq!(socket_inode(Path::new("/tmp/socket:[1]")), None);
        assert_eq!(socket_inode(Path::new("socket:[x]")), None);
    }

    #[test]
    fn the_directory_of_a_bound_socket_of_this_process_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("pymp-test");
        fs::create_dir(&sub).unwrap();
        let _l = std::os::unix::net::UnixListener::bind(sub.join("listener")).unwrap();
        let found = socket_dirs(&[std::process::id() as i32]);
        assert!(found.contains(&sub), "{found:?}");
    }

    #[test]
    fn ppid_survives_odd_command_names() {
        assert_eq!(ppid_of("12 (python3) S 7 12 12 0"), Some(7));
        assert_eq!(ppid_of("12 (a) b (c) R 99 12 12 0"), Some(99));
        assert_eq!(ppid_of("garbage"), None);
    }

    #[test]
    fn descendants_are_the_whole_subtree_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        // 1 -> 10 -> {11, 12 -> 13}; 1 -> 20 (not under 10). 12's name is cut inside a character,
        // as the kernel cuts names at 15 bytes: not UTF-8.
        for (pid, ppid) in [(10, 1), (11, 10), (12, 10), (13, 12), (20, 1)] {
            let d = dir.path().join(pid.to_string());
            fs::create_dir_all(&d).unwrap();
            let name: &[u8] = if pid == 12 { b"job \xe6\x97" } else { b"job x" };
            let stat = [
                format!("{pid} (").as_bytes(),
                name,
                format!(") S {ppid} 1 1 0").as_bytes(),
            ]
            .concat();
            fs::write(d.join("stat"), stat).unwrap();
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
