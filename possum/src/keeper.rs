//! `possum keeper`: runs a keeper (possum-keeper), the process that owns the GPU memory of jobs'
//! buffers so that a checkpoint leaves it on the GPU (issue 14).
//!
//! - `--dir DIR`: serves every visible device, device N at `DIR/keeper-N.sock` (a job started
//!   with `POSSUM_KEEPER=DIR` takes its buffers' memory there). Each device is opened at its
//!   first request. Prints `ready` on stdout once every socket listens. This is what
//!   `possum run` starts for its job.
//! - `--socket PATH [--device N]`: one device, opened at once.
//!
//! It runs until it is killed (SIGTERM's default action ends it; socket files are replaced at the
//! next start), or, with `--while-alive PID`, until that process is gone (`possum restore` starts
//! one so for a restored job whose keeper is gone).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct KeeperArgs {
    /// Serve every visible device, device N at DIR/keeper-N.sock (the directory is created).
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

/// The socket of device `ordinal`'s keeper under `dir` (what libpossum.so connects to).
pub fn socket_of(dir: &Path, ordinal: usize) -> PathBuf {
    dir.join(format!("keeper-{ordinal}.sock"))
}

pub fn run(a: &KeeperArgs) -> Result<bool> {
    let servers = match (&a.dir, &a.socket) {
        (Some(dir), _) => {
            std::fs::create_dir_all(dir).with_context(|| format!("{}", dir.display()))?;
            let info = possum_cuda::probe()
                .map_err(|e| anyhow::anyhow!("no CUDA device for a keeper: {e}"))?;
            (0..info.device_count)
                .map(|n| {
                    possum_keeper::Server::bind_lazy(&socket_of(dir, n), n)
                        .with_context(|| format!("starting a keeper for device {n}"))
                })
                .collect::<Result<Vec<_>>>()?
        }
        (None, Some(socket)) => vec![possum_keeper::Server::bind(socket, a.device)
            .with_context(|| format!("starting a keeper on device {}", a.device))?],
        (None, None) => bail!("give --dir DIR (every device) or --socket PATH (one device)"),
    };
    for s in &servers {
        eprintln!("possum keeper: listening on {}", s.path().display());
        let s = s.clone();
        std::thread::Builder::new()
            .name("possum-keeper-accept".into())
            .spawn(move || {
                if let Err(e) = s.serve() {
                    eprintln!("possum keeper: {e}");
                    std::process::exit(1);
                }
            })
            .context("starting the keeper's thread")?;
    }
    println!("ready");
    let started = std::time::Instant::now();
    let mut seen = false;
    loop {
        std::thread::sleep(Duration::from_secs(1));
        if let Some(pid) = a.while_alive {
            let alive = std::path::Path::new(&format!("/proc/{pid}")).exists();
            seen |= alive;
            if !alive && (seen || started.elapsed() > Duration::from_secs(60)) {
                return Ok(true);
            }
        }
    }
}
