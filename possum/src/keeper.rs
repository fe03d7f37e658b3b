//! `possum keeper`: runs a keeper (possum-keeper) until it is killed (SIGTERM's default action
//! ends it; the socket file is replaced at the next start). Issue 14's first part: nothing uses
//! it yet.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct KeeperArgs {
    /// The Unix socket to listen on (an old socket file there is replaced).
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    /// The CUDA device whose memory it holds.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub device: usize,
}

pub fn run(a: &KeeperArgs) -> Result<bool> {
    let server = possum_keeper::Server::bind(&a.socket, a.device)
        .with_context(|| format!("starting a keeper on device {}", a.device))?;
    eprintln!(
        "possum keeper: device {}, listening on {}",
        a.device,
        a.socket.display()
    );
    server.serve().context("keeper")?;
    Ok(true)
}
