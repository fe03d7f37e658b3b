//! `possum checkpoint`, `possum restore` and `possum resume`: the command line of the
//! sequences in possum-sequence (its documentation describes them): clap's arguments to their
//! parameters, the progress bar, and what is printed.

mod restore;
mod runtime;

pub(crate) use restore::Notes;
pub use restore::{restore, RestoreArgs};
use runtime::on_runtime;

use std::fs;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use possum_control::reply::CuptiReply;
use possum_control::Request;
use possum_sequence::figures::ms;
use possum_sequence::guard::GuardPlan;
use possum_sequence::image::{dir_bytes, NetworkLock};
use possum_sequence::job::ask;
use possum_sequence::{CheckpointParams, CheckpointReport, Engine, Environment, Observer};
use serde::{Deserialize, Serialize};

pub(crate) use possum_sequence::process::alive;

/// Which engine takes the GPU side.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// Buffers pre-copied as the job runs; the job held only for what it wrote since.
    Possum,
    /// The baseline: CRIU + NVIDIA's driver checkpoint, nothing of possum's.
    Driver,
}

impl From<EngineKind> for Engine {
    fn from(e: EngineKind) -> Engine {
        match e {
            EngineKind::Possum => Engine::Possum,
            EngineKind::Driver => Engine::Driver,
        }
    }
}

/// How CRIU locks the network of the established TCP connections it dumps.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetworkLockKind {
    /// No lock (the connections are only put in TCP repair mode).
    Skip,
    /// iptables rules.
    Iptables,
    /// An nftables table.
    Nftables,
}

impl From<NetworkLockKind> for NetworkLock {
    fn from(k: NetworkLockKind) -> NetworkLock {
        match k {
            NetworkLockKind::Skip => NetworkLock::Skip,
            NetworkLockKind::Iptables => NetworkLock::Iptables,
            NetworkLockKind::Nftables => NetworkLock::Nftables,
        }
    }
}

/// `--tcp-established` and `--network-lock`, of `possum checkpoint` and `possum migrate`.
#[derive(Args, Debug, Clone, Copy)]
pub struct TcpArgs {
    /// Dump the job's established TCP connections (e.g. torchrun's TCPStore between its agent
    /// and ranks, a server's clients) in TCP repair mode; without it CRIU refuses a tree that
    /// holds one. The image records it: the restore (or a migration's destination) restores the
    /// connections. A killed job's connections are closed without a word to their peers, and go
    /// on once it is restored on this host (elsewhere: `possum restore --tcp-close`).
    #[arg(long)]
    pub tcp_established: bool,
    /// With --tcp-established: how packets are kept from the connections while they are dumped
    /// and restored. skip: no lock, nothing needed (enough when both ends are the job's);
    /// iptables: rules added with iptables-restore (iptables installed); nftables: a table in the
    /// kernel's nf_tables. The restore uses the same.
    #[arg(
        long,
        value_enum,
        value_name = "METHOD",
        default_value = "skip",
        requires = "tcp_established"
    )]
    pub network_lock: NetworkLockKind,
}

impl TcpArgs {
    /// The lock method of a dump that takes the established connections; `None` without
    /// `--tcp-established`.
    pub fn lock(&self) -> Option<NetworkLock> {
        self.tcp_established.then(|| self.network_lock.into())
    }
}

#[derive(Args, Debug)]
pub struct CheckpointArgs {
    /// The process to checkpoint (the root of its tree).
    pub pid: i32,
    /// Image directory (must not exist or be empty, unless --force).
    #[arg(short = 'D', long = "images-dir", value_name = "DIR")]
    pub dir: PathBuf,
    /// Let the job run on after the checkpoint (default: it is killed once the image is complete).
    #[arg(long)]
    pub leave_running: bool,
    /// possum, or the baseline `driver` (CRIU + NVIDIA's driver checkpoint only).
    #[arg(long, value_enum, default_value = "possum")]
    pub engine: EngineKind,
    /// Only possum's GPU side, without the process (no driver checkpoint, no CRIU): the buffers
    /// are saved, released and brought back on demand while the job runs on. A diagnostic of the
    /// engine on a live job; the image cannot be restored.
    #[arg(long, conflicts_with = "engine")]
    pub gpu_only: bool,
    /// Replace an existing image at DIR (the old one is removed only once the new one is complete).
    #[arg(long)]
    pub force: bool,
    /// An earlier image of this job: write only what changed since.
    ///
    /// The GPU chunks whose fingerprint equals one in PARENT are referenced from PARENT instead
    /// of copied, so each periodic checkpoint costs what the job changed. The new image then
    /// needs PARENT (and PARENT's own parents) where they are: keep them, or restore fails with
    /// a message naming the missing one. PARENT may not be DIR.
    #[arg(long, value_name = "PARENT", conflicts_with = "gpu_only")]
    pub parent: Option<PathBuf>,
    /// When the job is killed (no --leave-running) and its GPU memory is a keeper's (`possum
    /// run`'s default): the keeper keeps the job's GPU buffers on the GPU this many seconds after
    /// it is gone, so that `possum restore` on this host maps them instead of copying them back
    /// from the image (the image is complete either way). The keeper frees them sooner if a
    /// live job needs the memory. 0: freed with the job.
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    pub keep_on_gpu: u64,
    /// With --leave-running, when the job's GPU memory is a keeper's: device memory the save of
    /// its buffers may use for copies made on the GPU (MiB). Buffers that fit are copied there
    /// before the job runs on (1.5 TB/s) and saved from those copies; the rest are saved from the
    /// job's memory, each copied first when the job is about to write it. Default: the job's
    /// `POSSUM_SHADOW_MIB`, else three quarters of the GPU's free memory beyond 4 GiB.
    #[arg(long, value_name = "MIB")]
    pub shadow_budget: Option<u64>,
    /// Established TCP connections.
    #[command(flatten)]
    pub tcp: TcpArgs,
    /// Print the figures as JSON.
    #[arg(long)]
    pub json: bool,
    /// Directory of the job's control socket (default: $POSSUM_SOCKET_DIR, else /tmp/possum).
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
    /// Authenticate the image with the key in FILE (32 bytes or more, shared with the hosts that
    /// restore it): once the image is complete, DIR/possum.hmac gets the HMAC-SHA256 of all of
    /// it, which `possum restore --hmac-key FILE` checks.
    #[arg(long, value_name = "FILE")]
    pub hmac_key: Option<PathBuf>,
}

/// `--parent`'s directory, absolute (the job's possum opens it) and an image (a directory).
fn absolute_parent(p: &std::path::Path) -> Result<PathBuf> {
    let abs = std::path::absolute(p).with_context(|| format!("--parent {}", p.display()))?;
    anyhow::ensure!(
        abs.is_dir(),
        "--parent {}: no such image directory",
        abs.display()
    );
    Ok(abs)
}

fn socket_dir_of(a: Option<&PathBuf>) -> PathBuf {
    a.cloned().unwrap_or_else(possum_control::socket_dir)
}

impl CheckpointArgs {
    /// The sequence's parameters: these flags, and the environment.
    fn params(&self) -> Result<CheckpointParams> {
        Ok(CheckpointParams {
            pid: self.pid,
            dir: self.dir.clone(),
            leave_running: self.leave_running,
            engine: self.engine.into(),
            gpu_only: self.gpu_only,
            force: self.force,
            parent: self.parent.as_deref().map(absolute_parent).transpose()?,
            keep_on_gpu: self.keep_on_gpu,
            shadow_budget: self.shadow_budget,
            tcp_established: self.tcp.lock(),
            precopy_rounds: 1,
            sockets: socket_dir_of(self.socket_dir.as_ref()),
            possum_exe: std::env::current_exe().context("finding possum's own binary")?,
            env: Environment::read(),
            relay_watch: Default::default(),
        })
    }
}

/// `possum checkpoint`.
pub fn checkpoint(a: &CheckpointArgs) -> Result<bool> {
    let params = a.params()?;
    // Read before anything is done: a key that is not one refuses the checkpoint.
    let key = (a.hmac_key.as_deref())
        .map(possum_sequence::auth::HmacKey::read)
        .transpose()?;
    let mut bar = ProgressBar {
        show: !a.json && std::io::stderr().is_terminal(),
        running: None,
    };
    let report = possum_sequence::checkpoint(&params, &mut bar)?;
    drop(bar);
    if let Some(key) = &key {
        possum_sequence::auth::seal(&report.dir, key).with_context(|| {
            format!(
                "the image {} is complete but could not be authenticated",
                report.dir.display()
            )
        })?;
    }
    if a.json {
        println!("{}", serde_json::to_value(&report)?);
    } else {
        print_checkpoint(a, &report);
    }
    Ok(true)
}

/// What `possum checkpoint` prints without --json.
fn print_checkpoint(a: &CheckpointArgs, r: &CheckpointReport) {
    let f = &r.figures;
    let step = |d: Option<Duration>| ms(d.unwrap_or_default());
    let (copied, copied_bytes) = r.copied_at_release();
    println!(
        "possum: process {} checkpointed to {} ({:?} engine{}{}): {:.2} GiB image",
        r.pid,
        a.dir.display(),
        r.engine,
        on_runtime(r.runtime),
        if a.leave_running {
            ", still running"
        } else {
            ", then killed"
        },
        f.image_bytes as f64 / (1u64 << 30) as f64
    );
    let b = &f.stall_breakdown;
    println!(
        "  job paused {:.0} ms (engine {:.0}, driver {:.0}, CRIU {:.0}, commit {:.0}); total {:.0} ms",
        ms(f.hold),
        ms(b.engine),
        ms(b.driver),
        ms(b.criu),
        step(f.commit),
        ms(f.total)
    );
    match f.job_waited {
        Some(w) if !w.is_zero() => println!(
            "  then waited {:.0} ms on possum as it ran again: stall {:.0} ms",
            ms(w),
            ms(f.stall)
        ),
        Some(_) => {}
        None => println!(
            "  buffers coming back as the job runs again: its waits on them are not counted yet"
        ),
    }
    if r.kept_any() {
        println!(
            "  GPU buffers stayed on the GPU with the keeper while held; saved while the job \
             ran on ({:.0} ms after it resumed)",
            step(f.saved)
        );
    } else if r.engine == Engine::Possum && r.parked {
        println!(
            "  hooks off: the job's threads were parked, and every GPU buffer ({copied}, {}) \
             was copied while they were",
            gib(copied_bytes)
        );
    } else if r.engine == Engine::Possum {
        println!(
            "  GPU buffers pre-copied while the job ran ({:.0} ms); held at possum's op gate: \
             {copied} buffers ({}) written since the pre-copy copied while held",
            step(f.engine_snapshot),
            gib(copied_bytes)
        );
    }
    if r.resume_report.as_ref().and_then(|rr| rr.body.on_demand) == Some(true) {
        println!("  the job runs on; its GPU buffers come back on demand");
    }
    if r.release_report
        .as_ref()
        .is_some_and(|rr| !rr.body.held_for_restore.is_empty())
    {
        println!(
            "  its GPU buffers stay on the GPU with its keeper for {} s: `possum restore` on \
             this host maps them again instead of copying them from the image",
            a.keep_on_gpu
        );
    }
    if let Some(q) = &r.tcp_quiet {
        if q.sockets > 0 {
            println!(
                "  its {} TCP connections were closed without a word to their peers: they go on \
                 once it is restored on this host",
                q.sockets
            );
        }
        tcp_warnings(q);
    }
}

/// What the kill could not do for the job's TCP connections, on stderr: those its peer may see
/// closed (reset).
pub(crate) fn tcp_warnings(q: &possum_sequence::tcp::QuietConnections) {
    for f in &q.failed {
        eprintln!(
            "possum: a TCP connection of the job may have been closed at its peer by the kill: {f}"
        );
    }
    for u in &q.unacknowledged {
        eprintln!(
            "possum: the peer of a TCP connection of the job had not acknowledged all it was sent \
             after {} ms: a packet it sends before the restore resets the connection \
             (--network-lock iptables or nftables drops it instead): {u}",
            q.acks_waited_ms
        );
    }
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn progress_bar(total: u64, watch: PathBuf, stop: std::sync::mpsc::Receiver<()>) {
    let t = Instant::now();
    let mut shown = false;
    // Until told to stop, or the sender is dropped (a disconnected channel ends the bar too).
    while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
        stop.recv_timeout(Duration::from_millis(200))
    {
        if t.elapsed() < Duration::from_millis(500) {
            continue;
        }
        let done = dir_bytes(&watch).min(total.max(1));
        let frac = done as f64 / total.max(1) as f64;
        let width = 30;
        let filled = (frac * width as f64) as usize;
        eprint!(
            "\r  GPU buffers [{}{}] {:5.1}% {:.2}/{:.2} GiB {:.1} s",
            "#".repeat(filled),
            " ".repeat(width - filled),
            100.0 * frac,
            done as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64,
            t.elapsed().as_secs_f64()
        );
        shown = true;
    }
    if shown {
        eprintln!();
    }
}

/// [`progress_bar`] on its own thread while the sequence copies the job's buffers, ended when
/// told or dropped.
struct ProgressBar {
    /// Whether to show it (on a terminal, without --json); once ended, it is not shown again.
    show: bool,
    running: Option<(std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>)>,
}

impl Observer for ProgressBar {
    fn copying(&mut self, total: u64, dir: &Path) {
        if !self.show || self.running.is_some() {
            return;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let watch = dir.to_path_buf();
        let thread = std::thread::spawn(move || progress_bar(total, watch, rx));
        self.running = Some((tx, thread));
    }

    fn copied(&mut self) {
        if let Some((tx, thread)) = self.running.take() {
            drop(tx);
            let _ = thread.join();
        }
        self.show = false;
    }

    fn note(&mut self, what: &str) {
        eprintln!("possum: {what}");
    }
}

impl Drop for ProgressBar {
    fn drop(&mut self) {
        self.copied();
    }
}

/// Arguments of the hidden `possum checkpoint-guard`.
#[derive(Args, Debug, Clone)]
pub struct GuardArgs {
    #[arg(long)]
    pub pid: i32,
    /// Other CUDA processes of the job's tree, checkpointed by the driver with it.
    #[arg(long = "child")]
    pub children: Vec<i32>,
    /// Those of them whose buffers possum released too (their images in `gpu-PID/`).
    #[arg(long = "possum-child")]
    pub possum_children: Vec<i32>,
    #[arg(long)]
    pub tmp: PathBuf,
    #[arg(long)]
    pub final_dir: PathBuf,
    #[arg(long)]
    pub socket_dir: PathBuf,
    /// The job's GPU memory (for the deadline of a driver restore).
    #[arg(long, default_value_t = 0)]
    pub gpu_bytes: u64,
}

/// `possum checkpoint-guard`: undoes a checkpoint whose `possum checkpoint` failed or died (its
/// steps read from stdin).
pub fn guard(a: &GuardArgs) -> Result<bool> {
    let env = Environment::read();
    let plan = GuardPlan {
        pid: a.pid,
        children: a.children.clone(),
        possum_children: a.possum_children.clone(),
        tmp: a.tmp.clone(),
        final_dir: a.final_dir.clone(),
        socket_dir: a.socket_dir.clone(),
        libcuda: env.libcuda,
        driver_deadlines: env.driver_deadlines,
        gpu_bytes: a.gpu_bytes,
    };
    let tell = |m: &str| eprintln!("possum: {m}");
    Ok(possum_sequence::guard::guard(
        &plan,
        std::io::stdin().lock(),
        &tell,
        &possum_sequence::migrate::restore_after_migration,
    ))
}

/// Arguments of `possum resume`.
#[derive(Args, Debug)]
pub struct ResumeArgs {
    /// The job.
    pub pid: i32,
    /// possum's GPU image of the job (`IMAGES/possum-gpu-PID` after a `criu dump` with possum's
    /// plugin).
    pub gpu_dir: PathBuf,
    /// Directory of the job's control socket (default: $POSSUM_SOCKET_DIR, else /tmp/possum).
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
}

/// `possum resume PID GPU_DIR`: the job's buffers back on demand from GPU_DIR, its GPU
/// operations let go.
pub fn resume(a: &ResumeArgs) -> Result<bool> {
    let dir = socket_dir_of(a.socket_dir.as_ref());
    let gpu = fs::canonicalize(&a.gpu_dir)
        .with_context(|| format!("the GPU image {}", a.gpu_dir.display()))?;
    let req = Request::Resume {
        dir: Some(gpu.display().to_string()),
    };
    ask::<serde_json::Value>(a.pid, &dir, &req)?;
    println!(
        "possum: process {} runs on; its GPU buffers come back from {}",
        a.pid,
        gpu.display()
    );
    Ok(true)
}

/// Arguments of the hidden `possum cupti` (diagnostics).
#[derive(Args, Debug)]
pub struct CuptiArgs {
    pub pid: i32,
    /// Attach again (default: detach).
    #[arg(long)]
    pub attach: bool,
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
}

/// `possum cupti PID [--attach]`: detaches CUPTI from a job (or attaches it again).
pub fn cupti(a: &CuptiArgs) -> Result<bool> {
    let dir = socket_dir_of(a.socket_dir.as_ref());
    let v = ask::<CuptiReply>(a.pid, &dir, &Request::Cupti { attach: a.attach })?;
    println!("{}", v.raw);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bar ends when its sender is dropped (it used to spin forever then, so a checkpoint run
    /// on a terminal never finished).
    #[test]
    fn the_progress_bar_ends_when_its_sender_is_dropped() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            progress_bar(1 << 20, std::env::temp_dir(), rx);
            let _ = done_tx.send(());
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(tx);
        assert!(
            done_rx.recv_timeout(Duration::from_secs(5)).is_ok(),
            "the progress bar did not stop"
        );
    }
}
