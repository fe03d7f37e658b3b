//! `possum restore`: its arguments and what it prints (the sequence is possum-sequence's).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use possum_sequence::figures::ms;
use possum_sequence::{Environment, Observer, RestoreParams, RestoreReport};

#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// Image directory written by `possum checkpoint`.
    #[arg(short = 'D', long = "images-dir", value_name = "DIR")]
    pub dir: PathBuf,
    /// Print the figures as JSON.
    #[arg(long)]
    pub json: bool,
    /// Directory of the job's control socket (default: the one it had when checkpointed).
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
    /// Restore onto this GPU (its index as nvidia-smi numbers it) instead of the one the job ran
    /// on: the driver's restore maps the old GPU's UUID to this one's. A single-GPU job (an image of
    /// either engine). Buffers its keeper still holds on the old GPU (killed with --keep-on-gpu)
    /// are copied GPU to GPU by the keeper while CRIU restores the job.
    #[arg(long, value_name = "GPU")]
    pub device: Option<u32>,
    /// Restore only an image authenticated under the key in FILE (checkpointed with the same
    /// --hmac-key): the whole image is checked against its possum.hmac before anything else of
    /// it is read, and refused if anything in it changed.
    #[arg(long, value_name = "FILE")]
    pub hmac_key: Option<PathBuf>,
    /// Bring the image's established TCP connections (checkpointed with --tcp-established)
    /// back closed instead of whole: for a restore where they cannot come back (another host,
    /// or their peers gone). The job runs, each such socket unconnected and shut down; its peer
    /// gets a reset at its next packet. Also POSSUM_RESTORE_TCP_CLOSE=1.
    #[arg(long)]
    pub tcp_close: bool,
}

/// `possum restore`.
pub fn restore(a: &RestoreArgs) -> Result<bool> {
    let mut env = Environment::read();
    env.tcp_close |= a.tcp_close;
    let params = RestoreParams {
        dir: a.dir.clone(),
        socket_dir: a.socket_dir.clone(),
        socket_dir_from_source: false,
        device: a.device,
        possum_exe: std::env::current_exe().context("finding possum's own binary")?,
        env,
        hmac_key: (a.hmac_key.as_deref())
            .map(possum_sequence::auth::HmacKey::read)
            .transpose()?,
        received_unsynced: false,
        prestaged: Vec::new(),
        post_copy: None,
    };
    let report = possum_sequence::restore(&params, &mut Notes)?;
    if a.json {
        println!("{}", serde_json::to_value(&report)?);
    } else {
        print_restore(&report);
    }
    Ok(true)
}

/// A sequence's notes, on stderr.
pub(crate) struct Notes;

impl Observer for Notes {
    fn copying(&mut self, _: u64, _: &std::path::Path) {}
    fn copied(&mut self) {}
    fn note(&mut self, what: &str) {
        eprintln!("possum: {what}");
    }
}

/// What `possum restore` prints without --json.
fn print_restore(r: &RestoreReport) {
    let f = &r.figures;
    let step = |d: Option<std::time::Duration>| d.unwrap_or_default();
    let on_demand = r.resume_report.as_ref().and_then(|rr| rr.body.on_demand);
    println!(
        "possum: process {} restored from {} ({:?} engine{}) in {:.0} ms (CRIU {:.0}, driver {:.0}, resume {:.0}){}",
        r.pid,
        r.dir.display(),
        r.engine,
        super::runtime::on_runtime(r.runtime),
        ms(f.total),
        ms(step(f.criu_restore)),
        ms(step(f.resumed.driver_restore) + step(f.resumed.driver_unlock)),
        ms(step(f.resumed.resume)),
        match (r.has_gpu, on_demand) {
            (false, _) => "",
            (true, _) if r.gpu_from_keeper =>
                "; its GPU buffers were still on the GPU with the keeper: mapped again, nothing copied",
            (true, _) if r.peer_buffers > 0 =>
                "; its GPU buffers were copied GPU to GPU from the keeper's memory on its old GPU while CRIU restored it: mapped, each waited for only while it still loads",
            (true, _) if r.staged_buffers_mapped > 0 =>
                "; its GPU buffers were loaded by the keeper while CRIU restored it: mapped, each waited for only while it still loads",
            (true, Some(false)) => "; every GPU buffer was back before it ran on (hooks off)",
            (true, _) => "; GPU buffers come back on demand",
        }
    );
    if r.tcp_closed {
        println!(
            "possum: its established TCP connections were restored closed (--tcp-close): their \
             peers get a reset at their next packet"
        );
    }
    for s in r
        .staged
        .iter()
        .filter(|s| !s.unused && !s.peer_misses.is_empty())
    {
        eprintln!(
            "possum: {} of the {} buffers of {} were read from the image, not copied from the \
             old GPU; {}",
            s.buffers - s.peer_buffers,
            s.buffers,
            s.image.display(),
            s.peer_misses.join("; ")
        );
    }
}
