//! `possum trace`: ask a running job for its kernel/buffer trace.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use possum_control::Request;
use serde_json::Value;

#[derive(Args, Debug)]
pub struct TraceArgs {
    /// The job's process id.
    pub pid: u32,
    /// Write the trace (JSON) to FILE instead of stdout.
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Also write the trace's DOT graph to FILE.
    #[arg(long, value_name = "FILE")]
    pub dot: Option<PathBuf>,
    #[command(flatten)]
    pub job: JobArgs,
}

/// How to reach a job's control socket.
#[derive(Args, Debug)]
pub struct JobArgs {
    /// Directory of the job's control socket (default: $POSSUM_SOCKET_DIR, else /tmp/possum).
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
    /// Seconds to wait for the job's answer.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub timeout: f64,
}

/// Sends `req` to process `pid` and returns its answer.
pub fn ask(pid: u32, job: &JobArgs, req: &Request) -> Result<Value> {
    let dir = job
        .socket_dir
        .clone()
        .unwrap_or_else(possum_control::socket_dir);
    let timeout = Duration::try_from_secs_f64(job.timeout).context("--timeout")?;
    Ok(possum_control::request(pid, &dir, req, timeout)?)
}

pub fn run(a: &TraceArgs) -> Result<bool> {
    let reply = ask(a.pid, &a.job, &Request::Trace)?;
    let dot = match (&a.dot, reply.get("dot")) {
        (None, _) => None,
        (Some(f), Some(Value::String(d))) => Some((f, d)),
        (Some(_), _) => anyhow::bail!(
            "process {}'s trace has no DOT graph (no \"dot\" string)",
            a.pid
        ),
    };
    let mut json = serde_json::to_string_pretty(&reply)?;
    json.push('\n');
    match &a.output {
        Some(f) => write(f, json.as_bytes())?,
        None => std::io::stdout()
            .lock()
            .write_all(json.as_bytes())
            .context("stdout")?,
    }
    if let Some((f, d)) = dot {
        write(f, d.as_bytes())?;
    }
    Ok(true)
}

fn write(f: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(f, bytes).with_context(|| format!("cannot write {}", f.display()))
}
