//! `possum demo --criu`: the demo job in a child process, dumped by CRIU mid-run (once with
//! `--leave-running`, once killing it), restored, and compared with an uninterrupted run.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use possum_criu::{Criu, DumpOptions, RestoreOptions};
use possum_engine::host::HostDevice;
use possum_engine::{Engine, EngineConfig};
use possum_workloads::demo::{DemoJob, DemoSpec};

use crate::demo::DemoArgs;

/// Options of the hidden `possum demo-child`.
#[derive(clap::Args, Debug, Clone)]
pub struct ChildArgs {
    /// Buffer memory, MiB.
    #[arg(long)]
    pub(crate) mib: u64,
    /// Steps.
    #[arg(long)]
    pub(crate) steps: u64,
    /// Streams.
    #[arg(long)]
    pub(crate) streams: usize,
    /// File that holds the number of steps done.
    #[arg(long)]
    pub(crate) progress: PathBuf,
    /// File that receives the final digest.
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// Pre-copy to this receiver from step --at on, then wait to be moved (`demo --migrate`).
    #[arg(long, value_name = "ADDR:PORT")]
    pub(crate) precopy_to: Option<String>,
    /// The step the pre-copy begins at.
    #[arg(long, default_value_t = 0)]
    pub(crate) at: u64,
    /// The most pre-copy rounds.
    #[arg(long, default_value_t = 4)]
    pub(crate) max_rounds: u32,
    /// The key shared with the receiver.
    #[arg(long)]
    pub(crate) key_file: Option<PathBuf>,
    /// The engine image the receiver commits, which the restored job's buffers come from.
    #[arg(long)]
    pub(crate) image: Option<PathBuf>,
    /// File written once the job is held at its cut (the pre-copy's figures).
    #[arg(long)]
    pub(crate) held: Option<PathBuf>,
    /// File whose appearance tells a restored job to go on.
    #[arg(long)]
    pub(crate) go: Option<PathBuf>,
}

/// How long a demo child (the original or a restored one) may take to finish its steps.
const CHILD_TIMEOUT: Duration = Duration::from_secs(300);

pub(crate) fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

/// The child's progress file: opened once and rewritten in place at one width, so that a dump
/// at any moment finds it open under its own name and of the size it keeps (a file written under
/// a temporary name and renamed over it is open under a name gone by the restore, which CRIU
/// then cannot open: the dump may land between the write and the rename).
struct ProgressFile(std::fs::File);

impl ProgressFile {
    fn create(path: &Path) -> Result<ProgressFile> {
        let f =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        Ok(ProgressFile(f))
    }

    /// `steps` done, written over what was there (20 digits wide and a newline).
    fn set(&self, steps: u64) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let text = format!("{steps:>20}\n");
        self.0
            .write_all_at(text.as_bytes(), 0)
            .context("writing the demo's progress")
    }
}

impl ChildArgs {
    /// The child's start: a session of its own (CRIU dumps it without --shell-job), and its job.
    pub fn start(&self) -> DemoSpec {
        let _ = nix::unistd::setsid();
        DemoSpec {
            mib: self.mib,
            steps: self.steps,
            streams: self.streams,
            ..DemoSpec::default()
        }
    }
}

/// The child: leaves the caller's session (so CRIU needs no `--shell-job`), runs the job, writes
/// its progress after each step and its digest at the end. (With `--precopy-to` the child is
/// `migrate_demo`'s.)
pub fn child(a: &ChildArgs) -> Result<bool> {
    let spec = a.start();
    let engine = Engine::new(
        Arc::new(HostDevice::new((a.mib << 20) + (64 << 20))),
        EngineConfig::default(),
    )?;
    let mut job = DemoJob::new(&engine, &spec)?;
    let progress = ProgressFile::create(&a.progress)?;
    for step in 0..a.steps {
        job.run_step(step)?;
        progress.set(step + 1)?;
        // Long enough steps that a dump lands mid-run.
        std::thread::sleep(Duration::from_millis(20));
    }
    write_atomically(&a.out, &format!("{:016x}\n", job.digest()?))?;
    Ok(true)
}

struct Child {
    proc: std::process::Child,
    progress: PathBuf,
    out: PathBuf,
}

fn spawn(dir: &Path, name: &str, a: &DemoArgs) -> Result<Child> {
    let progress = dir.join(format!("{name}.progress"));
    let out = dir.join(format!("{name}.out"));
    let log = std::fs::File::create(dir.join(format!("{name}.log")))?;
    let exe = std::env::current_exe().context("finding the possum binary")?;
    let proc = Command::new(exe)
        .arg("demo-child")
        .args(["--mib", &a.mib.to_string(), "--steps", &a.steps.to_string()])
        .args(["--streams", &a.streams.to_string()])
        .arg("--progress")
        .arg(&progress)
        .arg("--out")
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting the demo child")?;
    Ok(Child {
        proc,
        progress,
        out,
    })
}

fn wait_progress(c: &mut Child, at_least: u64) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let done: u64 = std::fs::read_to_string(&c.progress)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        if done >= at_least {
            return Ok(());
        }
        if let Some(st) = c.proc.try_wait()? {
            bail!("the demo child exited early ({st}) at step {done}");
        }
        if Instant::now() > deadline {
            bail!("the demo child made no progress past step {done}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub(crate) fn read_digest(path: &Path) -> Result<u64> {
    let s = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(u64::from_str_radix(s.trim(), 16)?)
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Restores `images` and waits for the restored child to finish; returns its digest and timing.
fn restore_and_finish(criu: &Criu, images: &Path, out: &Path) -> Result<(u64, Duration)> {
    let _ = std::fs::remove_file(out);
    let r = criu.restore(&RestoreOptions::new(images))?;
    let st = possum_criu::wait_for_exit(r.pid, Some(CHILD_TIMEOUT))?;
    if !st.success() {
        bail!("the restored child {} ended badly: {st:?}", r.pid);
    }
    Ok((read_digest(out)?, r.time))
}

/// Refuses `what` (a demo that runs CRIU) unless possum runs as root, before anything is done:
/// CRIU dumps and restores processes only as root, and would otherwise fail half-way through.
pub fn refuse_without_root(what: &str) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("{what} runs CRIU, which dumps and restores processes only as root: run it as root (e.g. with sudo)");
    }
    Ok(())
}

/// CRIU, its version, and `a` with the job's memory 64 MiB unless given: what a demo through
/// CRIU starts from.
pub fn criu_and_args(a: &DemoArgs) -> Result<(Criu, possum_criu::CriuVersion, DemoArgs)> {
    let criu = Criu::locate()?;
    let version = criu.version()?;
    let a = DemoArgs {
        mib: if a.mib == 320 { 64 } else { a.mib },
        ..a.clone()
    };
    Ok((criu, version, a))
}

pub fn run(a: &DemoArgs) -> Result<bool> {
    refuse_without_root("possum demo --criu")?;
    let (criu, version, a) = criu_and_args(a)?;
    let spec = a.spec();
    let tmp = crate::scratch::Scratch::new()?;
    let dir = a.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    std::fs::create_dir_all(&dir)?;
    println!(
        "possum demo --criu: CRIU {version}, job in a child process: {} MiB, {} streams, {} steps; dump at step {}",
        a.mib, a.streams, a.steps, a.at
    );
    let want = spec.reference_digests(&[spec.steps - 1])[0];
    // Restored children reparent to us, so we can wait for them.
    possum_criu::set_child_subreaper()?;

    // 1. --leave-running: the original goes on to the end; the image, restored, must end the same.
    let mut c = spawn(&dir, "leave", &a)?;
    wait_progress(&mut c, a.at)?;
    let images1 = dir.join("images-leave-running");
    let d1 = criu.dump(&DumpOptions {
        leave_running: true,
        ..DumpOptions::new(pid_of(&c)?, &images1)
    })?;
    let st = possum_criu::wait_for_exit(pid_of(&c)?, Some(CHILD_TIMEOUT))?;
    if !st.success() {
        bail!("the original child ended badly after the dump: {st:?}");
    }
    let original = read_digest(&c.out)?;
    let (restored1, r1) = restore_and_finish(&criu, &images1, &c.out)?;

    // 2. Dump and kill, then restore.
    let mut c = spawn(&dir, "kill", &a)?;
    wait_progress(&mut c, a.at)?;
    let images2 = dir.join("images-kill");
    let d2 = criu.dump(&DumpOptions::new(pid_of(&c)?, &images2))?;
    // CRIU ended it after the dump.
    let _ = possum_criu::wait_for_exit(pid_of(&c)?, Some(CHILD_TIMEOUT));
    let (restored2, r2) = restore_and_finish(&criu, &images2, &c.out)?;

    let bitexact = original == want && restored1 == want && restored2 == want;
    println!("  uninterrupted reference      {want:016x}");
    println!(
        "  --leave-running: original    {original:016x}  (dump {:.1} ms, image {} bytes)",
        ms(d1.time),
        d1.image_bytes
    );
    println!(
        "                   restored    {restored1:016x}  (restore {:.1} ms)",
        ms(r1)
    );
    println!(
        "  killed:          restored    {restored2:016x}  (dump {:.1} ms, restore {:.1} ms)",
        ms(d2.time),
        ms(r2)
    );
    let json = serde_json::json!({
        "backend": "host",
        "mode": "criu",
        "criu": version.to_string(),
        "bytes": spec.program().bytes(),
        "image_bytes": d2.image_bytes,
        "dump_leave_running_ms": ms(d1.time),
        "dump_kill_ms": ms(d2.time),
        "restore_ms": ms(r2),
        "stall_ms": ms(d1.time),
        "checkpoint_ms": ms(d1.time),
        "bitexact": bitexact,
    });
    println!("{json}");
    Ok(bitexact)
}

fn pid_of(c: &Child) -> Result<i32> {
    Ok(i32::try_from(c.proc.id())?)
}
