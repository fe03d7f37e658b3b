//! What can go wrong when driving CRIU, each variant naming the thing at fault.

use std::fmt::Write as _;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// An error from locating, starting or talking to CRIU, or from CRIU itself.
#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    /// No CRIU binary was found.
    #[error(
        "criu not found (looked for {}); run scripts/install-criu.sh, or point POSSUM_CRIU at a criu binary",
        list_paths(searched)
    )]
    NotFound {
        /// The places looked at, in order.
        searched: Vec<PathBuf>,
    },
    /// `POSSUM_CRIU` names something that is not an executable file.
    #[error("POSSUM_CRIU={} is not an executable file", path.display())]
    BadBinary {
        /// The value of `POSSUM_CRIU`.
        path: PathBuf,
    },
    /// The `criu swrk` process could not be started.
    #[error("cannot start {} swrk: {source}", binary.display())]
    Spawn {
        /// The binary that was run.
        binary: PathBuf,
        /// Why it could not run.
        source: io::Error,
    },
    /// The process to dump does not exist.
    #[error("process {pid} does not exist")]
    NoSuchProcess {
        /// The PID asked for.
        pid: i32,
    },
    /// The process to dump has exited and waits to be reaped: there is nothing left to dump.
    #[error("process {pid} is a zombie (it exited and its parent has not reaped it yet)")]
    Zombie {
        /// The PID asked for.
        pid: i32,
    },
    /// The images directory could not be created or opened.
    #[error("images directory {}: {source}", path.display())]
    ImagesDir {
        /// The directory.
        path: PathBuf,
        /// What went wrong.
        source: io::Error,
    },
    /// The options given cannot be sent to CRIU.
    #[error("invalid CRIU options: {0}")]
    InvalidOptions(String),
    /// Reading or writing the swrk socket failed.
    #[error("criu swrk socket, {what}: {source}")]
    Socket {
        /// What was being done.
        what: &'static str,
        /// The error.
        source: io::Error,
    },
    /// `criu swrk` exited (or closed its socket) without answering.
    #[error(
        "criu swrk ended without answering the {op} request ({status}){}",
        output_tail(output)
    )]
    WorkerDied {
        /// The request (`dump`, `restore`, ...).
        op: &'static str,
        /// How it ended, e.g. `exit status: 1`.
        status: String,
        /// The last of what it wrote on stdout/stderr.
        output: String,
    },
    /// CRIU's answer could not be understood.
    #[error("criu's answer to the {op} request is malformed: {detail}")]
    Protocol {
        /// The request.
        op: &'static str,
        /// What is wrong with the answer.
        detail: String,
    },
    /// CRIU ran the request and reported failure.
    #[error("criu {op} failed{}", failure_detail(*errno, message.as_deref(), log.as_ref(), log_tail))]
    Failed {
        /// The request (`dump`, `restore`, `check`).
        op: &'static str,
        /// CRIU's error number (`cr_errno`), when it set one.
        errno: Option<i32>,
        /// The first error CRIU logged (`cr_errmsg`), when it sent one.
        message: Option<String>,
        /// CRIU's log file for the request, when there is one.
        log: Option<PathBuf>,
        /// The last lines of that log (empty when unreadable).
        log_tail: String,
    },
    /// The process to wait for is not a child of this one.
    #[error(
        "process {pid} is not a child of this process: call set_child_subreaper() before the \
         restore, or restore with restore_sibling, to be able to wait for it"
    )]
    NotAChild {
        /// The PID waited for.
        pid: i32,
    },
    /// The process did not exit in time.
    #[error("process {pid} still runs after {timeout:?}")]
    WaitTimeout {
        /// The PID waited for.
        pid: i32,
        /// How long it was waited for.
        timeout: Duration,
    },
    /// CRIU did not finish a request in time: the worker, and every task under it (those a
    /// restore had created and not handed over yet, helpers), were killed.
    #[error(
        "criu {op} did not finish within {} (deadline){}; {}{}",
        seconds(*deadline),
        images_dir.as_ref().map(|d| format!(", images in {}", d.display())).unwrap_or_default(),
        what_was_killed(op, *killed),
        log_detail(log.as_ref(), log_tail)
    )]
    DeadlineExceeded {
        /// The request (`dump`, `restore`, ...).
        op: &'static str,
        /// How long it was given.
        deadline: Duration,
        /// The images directory of a dump or restore.
        images_dir: Option<PathBuf>,
        /// How many tasks besides the worker were killed.
        killed: usize,
        /// CRIU's log file for the request, when there is one.
        log: Option<PathBuf>,
        /// The last lines of that log (empty when unreadable).
        log_tail: String,
    },
    /// possum could not read the pages CRIU's lazy dump left in the frozen tree: the images
    /// are incomplete, and the dump failed (CRIU lets the tree run on).
    #[error(
        "criu dump of {}: reading the pages its lazy dump left in the frozen processes: {source}",
        images_dir.display()
    )]
    LazyPages {
        /// The images directory.
        images_dir: PathBuf,
        /// What went wrong.
        source: crate::hostmem::HostMemError,
    },
    /// possum could not copy the pages CRIU wrote into its pipes: the images are incomplete,
    /// and the dump failed (CRIU lets the tree run on).
    #[error("criu dump of {}: copying the pages CRIU wrote: {source}", images_dir.display())]
    PagesRelay {
        /// The images directory.
        images_dir: PathBuf,
        /// What went wrong.
        source: crate::relay::RelayError,
    },
    /// A dump whose pages possum writes (a lazy dump's, or those CRIU relays) ended without
    /// the `post-dump` notification at which possum completes them.
    #[error(
        "criu dump of {}: it ended without its post-dump notification, so possum never \
         completed its pages (the images are incomplete)",
        images_dir.display()
    )]
    LazyPagesUnread {
        /// The images directory.
        images_dir: PathBuf,
    },
    /// Another I/O error, with what was being done.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, naming the file or process.
        what: String,
        /// The error.
        source: io::Error,
    },
}

impl CriuError {
    /// CRIU failed, its error or the end of its log saying `says`.
    fn failed_saying(&self, says: &str) -> bool {
        match self {
            CriuError::Failed {
                message, log_tail, ..
            } => message.as_deref().is_some_and(|m| m.contains(says)) || log_tail.contains(says),
            _ => false,
        }
    }

    /// CRIU refused to dump a connected TCP socket because it was not asked to dump
    /// established connections (its error says "consider using --tcp-established").
    pub fn is_established_tcp_refused(&self) -> bool {
        self.failed_saying("Connected TCP socket")
    }

    /// CRIU failed on a socket option the kernel no longer answers for inet sockets
    /// (SO_PASSCRED, refused since Linux 6.16): a CRIU without its fix for that cannot dump a
    /// TCP socket on this kernel.
    pub fn is_inet_passcred_refused(&self) -> bool {
        self.failed_saying("Can't get 1:16 opt: Operation not supported")
    }

    /// CRIU refused to dump a unix stream connection whose other end is a process outside the
    /// tree (a client of the job's unix socket, say): it dumps no half of one.
    pub fn is_external_unix_stream(&self) -> bool {
        self.failed_saying("Can't dump half of stream unix connection")
    }

    /// CRIU's restore could not bind an established TCP connection back to its address (not
    /// this host's, or taken).
    pub fn is_tcp_bind_back_refused(&self) -> bool {
        self.failed_saying("Can't bind inet socket back")
    }
}

fn list_paths(paths: &[PathBuf]) -> String {
    let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    names.join(", ")
}

fn output_tail(output: &str) -> String {
    let output = output.trim_end();
    if output.is_empty() {
        String::new()
    } else {
        format!("; its output ends with:\n{output}")
    }
}

fn seconds(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

fn what_was_killed(op: &str, killed: usize) -> String {
    let tasks = |n: usize| if n == 1 { "task" } else { "tasks" };
    match (op, killed) {
        ("restore", 0) => "it was killed before it had restored any task".into(),
        ("restore", n) => format!("it and the {n} {} it had restored were killed", tasks(n)),
        (_, 0) => "it was killed".into(),
        (_, n) => format!("it and the {n} {} it had started were killed", tasks(n)),
    }
}

fn log_detail(log: Option<&PathBuf>, log_tail: &str) -> String {
    let Some(log) = log else {
        return String::new();
    };
    let tail = log_tail.trim_end();
    if tail.is_empty() {
        format!("; see {}", log.display())
    } else {
        format!("; the end of {}:\n{tail}", log.display())
    }
}

fn failure_detail(
    errno: Option<i32>,
    message: Option<&str>,
    log: Option<&PathBuf>,
    log_tail: &str,
) -> String {
    let mut s = String::new();
    if let Some(e) = errno.filter(|&e| e != 0) {
        let _ = write!(s, " (errno {e}: {})", nix::errno::Errno::from_raw(e).desc());
    }
    if let Some(m) = message.map(str::trim).filter(|m| !m.is_empty()) {
        let _ = write!(s, ": {m}");
    }
    s.push_str(&log_detail(log, log_tail));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_names_errno_message_and_log() {
        let e = CriuError::Failed {
            op: "dump",
            errno: Some(3),
            message: Some("Can't seize 42".into()),
            log: Some("/img/dump.log".into()),
            log_tail: "line 1\nline 2\n".into(),
        };
        assert_eq!(
            e.to_string(),
            "criu dump failed (errno 3: No such process): Can't seize 42; the end of /img/dump.log:\nline 1\nline 2"
        );
    }

    #[test]
    fn a_refused_connected_tcp_socket_is_recognized_from_the_message_or_the_log() {
        let failed = |message: Option<&str>, log_tail: &str| CriuError::Failed {
            op: "dump",
            errno: None,
            message: message.map(str::to_string),
            log: None,
            log_tail: log_tail.into(),
        };
        let says = "Error (criu/sk-inet.c:199): inet: Connected TCP socket, consider using \
                    --tcp-established option.";
        assert!(failed(Some(says), "").is_established_tcp_refused());
        assert!(failed(None, says).is_established_tcp_refused());
        assert!(!failed(Some("Can't seize 42"), "line 1").is_established_tcp_refused());
        assert!(!CriuError::NoSuchProcess { pid: 1 }.is_established_tcp_refused());
        let passcred = "Error (criu/sockets.c:628): sockets: Can't get 1:16 opt: Operation not \
                        supported";
        assert!(failed(Some(passcred), "").is_inet_passcred_refused());
        assert!(!failed(Some(passcred), "").is_established_tcp_refused());
        assert!(!failed(Some(says), "").is_inet_passcred_refused());
        let unix = "Error (criu/sk-unix.c:881): unix: Can't dump half of stream unix connection. \
                    name: /run/app.sock; peer name: (null)";
        assert!(failed(None, unix).is_external_unix_stream());
        assert!(!failed(Some(says), "").is_external_unix_stream());
        assert!(!failed(Some(unix), "").is_established_tcp_refused());
        let bind = "Error (soccr/soccr.c:498): Can't bind inet socket back: Cannot assign \
                    requested address";
        assert!(failed(Some(bind), "").is_tcp_bind_back_refused());
        assert!(!failed(Some(says), "").is_tcp_bind_back_refused());
    }

    #[test]
    fn a_missed_deadline_names_the_phase_the_deadline_and_the_images() {
        let e = CriuError::DeadlineExceeded {
            op: "restore",
            deadline: Duration::from_secs(30),
            images_dir: Some("/img".into()),
            killed: 2,
            log: Some("/img/restore.log".into()),
            log_tail: String::new(),
        };
        assert_eq!(
            e.to_string(),
            "criu restore did not finish within 30 s (deadline), images in /img; it and the 2 \
             tasks it had restored were killed; see /img/restore.log"
        );
        let e = CriuError::DeadlineExceeded {
            op: "dump",
            deadline: Duration::from_millis(1500),
            images_dir: Some("/img".into()),
            killed: 0,
            log: None,
            log_tail: String::new(),
        };
        assert_eq!(
            e.to_string(),
            "criu dump did not finish within 1.5 s (deadline), images in /img; it was killed"
        );
    }

    #[test]
    fn not_found_says_how_to_install() {
        let e = CriuError::NotFound {
            searched: vec!["/opt/possum-criu/bin/criu".into(), "$PATH".into()],
        };
        let s = e.to_string();
        assert!(s.contains("/opt/possum-criu/bin/criu, $PATH"), "{s}");
        assert!(s.contains("scripts/install-criu.sh"), "{s}");
    }
}
