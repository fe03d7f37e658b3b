//! `possum keeper`: runs a keeper (possum-keeper), the process that owns the GPU memory of jobs'
//! buffers so that a checkpoint leaves it on the GPU.
//!
//! - `--dir DIR`: serves every visible device, device N at `DIR/keeper-N.sock` (a job started
//!   with `POSSUM_KEEPER=DIR` takes its buffers' memory there). Each device is opened at its
//!   first request. Prints `ready` on stdout once every socket listens. This is what
//!   `possum run` starts for its job.
//! - `--socket PATH [--device N]`: one device, opened at once.
//!
//! It runs until it is killed (SIGTERM's default action ends it; socket files are replaced at the
//! next start), or, with `--while-alive PID`, until that process is gone and it holds no memory
//! (`possum run` starts it so; `possum restore` too for a restored job whose keeper is gone):
//! a job killed by `possum checkpoint` leaves its buffers held for a restore on this host
//! (`--keep-on-gpu`), and the keeper serves until they are freed or taken back, then as long as
//! the restored job lives.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct KeeperArgs {
    /// Serve every visible device, device N at DIR/keeper-N.sock (the directory is created, mode
    /// 0700).
    #[arg(long, value_name = "DIR", conflicts_with = "socket")]
    pub dir: Option<PathBuf>,
    /// The Unix socket to listen on, for one device (an old socket file there is replaced).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// With --socket: the CUDA device whose memory it holds.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub device: usize,
    /// Exit once process PID is gone (checked every second); a PID that does not exist yet (a
    /// process CRIU is about to restore) is waited for up to a minute.
    #[arg(long, value_name = "PID")]
    pub while_alive: Option<i32>,
}

pub fn run(a: &KeeperArgs) -> Result<bool> {
    let servers = match (&a.dir, &a.socket) {
        (Some(dir), _) => {
            let created = !dir.exists();
            create_private_dir(dir)?;
            let bound = possum_cuda::probe()
                .map_err(|e| anyhow::anyhow!("no CUDA device for a keeper: {e}"))
                .and_then(|info| {
                    (0..info.device_count)
                        .map(|n| {
                            possum_keeper::Server::bind_lazy(&possum_keeper::socket_of(dir, n), n)
                                .with_context(|| format!("starting a keeper for device {n}"))
                        })
                        .collect::<Result<Vec<_>>>()
                });
            match bound {
                Ok(servers) => servers,
                Err(e) => {
                    if created {
                        // Only if empty: nothing but what this keeper made was there.
                        for sock in possum_keeper::sockets_in(dir) {
                            let _ = std::fs::remove_file(sock);
                        }
                        let _ = std::fs::remove_dir(dir);
                    }
                    return Err(e);
                }
            }
        }
        (None, Some(socket)) => vec![possum_keeper::Server::bind(socket, a.device)
            .with_context(|| format!("starting a keeper on device {}", a.device))?],
        (None, None) => bail!("give --dir DIR (every device) or --socket PATH (one device)"),
    };
    for s in &servers {
        possum_keeper::say(&format!("listening on {}", s.path().display()));
        let s = s.clone();
        std::thread::Builder::new()
            .name("possum-keeper-accept".into())
            .spawn(move || {
                if let Err(e) = s.serve() {
                    possum_keeper::say(&e.to_string());
                    std::process::exit(1);
                }
            })
            .context("starting the keeper's thread")?;
    }
    // Seen before `ready`: a process that ends right after its keeper listens is known to have
    // lived (not one yet to come, which is waited for).
    let mut seen = a.while_alive.is_some_and(crate::checkpoint::alive);
    // The starter reads this line, then no more of the output.
    let _ = writeln!(std::io::stdout(), "ready");
    let _ = std::io::stdout().flush();
    let started = std::time::Instant::now();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        if let Some(pid) = a.while_alive {
            let alive = crate::checkpoint::alive(pid);
            seen |= alive;
            // Memory it still holds (a killed job's buffers held for its restore here, or a
            // job restored since) keeps it serving until that is freed too.
            let holds = servers.iter().any(|s| s.stats().total.allocations > 0);
            if !alive && !holds && (seen || started.elapsed() > Duration::from_secs(60)) {
                for s in &servers {
                    let _ = std::fs::remove_file(s.path());
                }
                if let Some(dir) = &a.dir {
                    // Only if empty: nothing but its sockets was there.
                    let _ = std::fs::remove_dir(dir);
                }
                return Ok(true);
            }
        }
    }
}

/// Creates `dir` and any missing parents, mode 0700 (only its owner may reach a keeper's sockets).
pub fn create_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))
}

/// Whether the keeper at `dir` holds memory for a restore: the buffers of a job that is gone,
/// or a restore being staged (a migration's destination loading a job's image ahead on this
/// host, while the job is still here).
pub fn holds_for_restore(dir: &Path) -> bool {
    possum_keeper::sockets_in(dir).iter().any(|sock| {
        possum_keeper::Keeper::connect(sock)
            .and_then(|mut k| k.stats())
            .is_ok_and(|s| s.held.bytes > 0 || !s.stages.is_empty())
    })
}
