//! `possum demo`: the engine end to end on the host backend, with an on-disk image.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use possum_engine::host::HostDevice;
use possum_engine::image::{Image, ImageSummary, ImageWriter, WriterOptions};
use possum_engine::store::{ChunkSink, ChunkSource};
use possum_engine::{CheckpointReport, Engine, EngineConfig, RestoreReport};
use possum_workloads::demo::{DemoJob, DemoSpec};
use possum_workloads::kernel;

/// Options of `possum demo`.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Buffer memory of the job, MiB.
    #[arg(long, default_value_t = 320)]
    pub mib: u64,
    /// Steps of the job.
    #[arg(long, default_value_t = 24)]
    pub steps: u64,
    /// Step at which the checkpoint begins.
    #[arg(long, default_value_t = 8)]
    pub at: u64,
    /// Streams of the job.
    #[arg(long, default_value_t = 3)]
    pub streams: usize,
    /// Where to write the image (default: a temporary directory, removed afterwards). With
    /// --criu: the working directory, kept (CRIU's images and logs, the child's logs).
    #[arg(short = 'D', long = "images-dir", value_name = "DIR", alias = "dir")]
    pub dir: Option<PathBuf>,
    /// Device memory for shadow copies during the checkpoint, MiB (0: priority copies only).
    #[arg(long, default_value_t = 0)]
    pub shadow_mib: u64,
    /// Host staging memory for copies, MiB (in 8 MiB chunks). At least the job's size lets the
    /// checkpoint capture everything at copy speed while the image drains to disk behind it.
    #[arg(long, default_value_t = 256)]
    pub staging_mib: usize,
    /// Run the job in a child process and dump it with CRIU instead (once left running, once
    /// killed), restore it and compare (needs root and CRIU 4.x; `--shadow-mib` is ignored).
    #[arg(long)]
    pub criu: bool,
    /// Migrate the job, in a child process, to a receiver on loopback with pre-copy: its buffers
    /// sent in rounds while it runs from step `--at` on, then the cut (the last dirty buffers
    /// and CRIU's image), the restore there, and the output compared (needs root and CRIU 4.x).
    #[arg(long, conflicts_with = "criu")]
    pub migrate: bool,
    /// With --migrate: the most pre-copy rounds (fewer if a round sends no less than the one
    /// before it).
    #[arg(long, default_value_t = 4, requires = "migrate")]
    pub max_rounds: u32,
    /// With --migrate: print the figures as one JSON line instead of text.
    #[arg(long, requires = "migrate")]
    pub json: bool,
}

impl DemoArgs {
    pub fn spec(&self) -> DemoSpec {
        DemoSpec {
            mib: self.mib,
            streams: self.streams,
            steps: self.steps,
            ..DemoSpec::default()
        }
    }

    /// [`DemoArgs::spec`], `--at` checked to be before the job's last step.
    pub fn spec_checked(&self) -> Result<DemoSpec> {
        let spec = self.spec();
        if self.at + 1 >= spec.steps {
            bail!(
                "--at {} must be before the last step ({})",
                self.at,
                spec.steps
            );
        }
        Ok(spec)
    }
}

pub(crate) fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Reads every buffer of an image, in the job's order, and digests them as the job does.
fn image_digest(img: &Image, job: &DemoJob) -> Result<u64> {
    let mut bufs = Vec::new();
    for b in job.job.buffers() {
        let mut v = vec![0u8; usize::try_from(b.size())?];
        for (off, len) in img.chunks(b.id()) {
            let o = usize::try_from(off)?;
            img.read_chunk(b.id(), off, &mut v[o..o + usize::try_from(len)?])?;
        }
        bufs.push(v);
    }
    Ok(kernel::digest(bufs.iter().map(Vec::as_slice)))
}

/// The checkpoint taken mid-run, and the steps around it.
struct Checkpointed {
    /// Each step's time before the checkpoint.
    normal: Vec<Duration>,
    /// Each step's time while it ran (the first: step `--at`, T0 in it).
    during: Vec<Duration>,
    report: CheckpointReport,
    summary: ImageSummary,
    /// The first step not run before the failure.
    ran_to: u64,
}

/// The job restored from the image after the failure, and run to its end.
struct Restored {
    /// Device memory the failure released, bytes.
    released: u64,
    /// The step the image resumes at.
    resume: u64,
    /// The time of that step.
    first: Duration,
    /// From the restore's start to the end of the first step.
    to_first_step: Duration,
    report: RestoreReport,
    /// The job's digest at its end.
    final_digest: u64,
    /// The image's digest (its buffers at T0).
    image_digest: u64,
}

/// `possum demo`: runs the job, checkpoints it mid-run, fails it, restores it and compares;
/// whether the image and the final state are bit-exact.
pub fn run(a: &DemoArgs) -> Result<bool> {
    let spec = a.spec_checked()?;
    let tmp;
    let dir = match &a.dir {
        Some(d) => d.clone(),
        None => {
            tmp = crate::scratch::Scratch::new()?;
            tmp.path().join("image")
        }
    };
    let dev = Arc::new(HostDevice::new((spec.mib << 20) * 2 + (256 << 20)));
    let cfg = EngineConfig {
        shadow_budget: a.shadow_mib << 20,
        ..EngineConfig::default()
    };
    let engine = Engine::new(dev, cfg)?;
    let mut job = DemoJob::new(&engine, &spec)?;
    println!(
        "possum demo: host backend, {} buffers, {:.0} MiB, {} streams, {} steps; checkpoint at step {}",
        job.job.buffers().len(),
        job.bytes() as f64 / 1048576.0,
        spec.streams,
        spec.steps,
        a.at
    );
    let reference = std::thread::spawn({
        let spec = spec.clone();
        let at = a.at;
        move || spec.reference_digests(&[at, spec.steps - 1])
    });
    let ck = checkpoint_mid_run(&engine, &mut job, &spec, a.at, &dir)?;
    let rs = fail_and_restore(&engine, &mut job, &spec, &dir)?;
    let want = reference
        .join()
        .map_err(|_| anyhow::anyhow!("reference thread panicked"))?;
    Ok(report(&job, &dir, ck, &rs, &want))
}

/// Runs the steps before `at`, then checkpoints into `dir` with T0 after step `at` is issued
/// (while it still runs), the job stepping on until the checkpoint ends.
fn checkpoint_mid_run(
    engine: &Engine<HostDevice>,
    job: &mut DemoJob,
    spec: &DemoSpec,
    at: u64,
    dir: &Path,
) -> Result<Checkpointed> {
    // Steps before the checkpoint: the normal step time.
    let mut normal = Vec::new();
    for step in 0..at {
        normal.push(job.run_step(step)?);
    }
    // Mid-run: T0 falls after step `at` is issued, while it is still running.
    let t_step = Instant::now();
    job.issue_step(at)?;
    let writer = Arc::new(ImageWriter::create(dir, WriterOptions::default())?);
    writer.set_meta("resume_step", &(at + 1).to_string())?;
    writer.set_meta("backend", "host")?;
    let ck = engine.checkpoint(writer.clone(), false)?;
    job.job.sync()?;
    let mut during = vec![t_step.elapsed()];
    let mut step = at + 1;
    while !ck.is_finished() && step < spec.steps {
        during.push(job.run_step(step)?);
        step += 1;
    }
    let report = ck.wait()?;
    let summary = Arc::into_inner(writer)
        .context("image writer still shared")?
        .commit()?;
    Ok(Checkpointed {
        normal,
        during,
        report,
        summary,
        ran_to: step,
    })
}

/// Failure: the device memory goes away; the job resumes from the image in `dir` and runs to
/// its end.
fn fail_and_restore(
    engine: &Engine<HostDevice>,
    job: &mut DemoJob,
    spec: &DemoSpec,
    dir: &Path,
) -> Result<Restored> {
    let released = engine.release()?;
    let img = Arc::new(Image::open(dir)?);
    let resume: u64 = img
        .meta("resume_step")
        .context("image lacks resume_step")?
        .parse()?;
    let t_restore = Instant::now();
    let rs = engine.restore(img.clone())?;
    job.job.reset_deps();
    let first = job.run_step(resume)?;
    let to_first_step = t_restore.elapsed();
    for s in resume + 1..spec.steps {
        job.run_step(s)?;
    }
    let report = rs.wait()?;
    let final_digest = job.digest()?;
    let image_digest = image_digest(&img, job)?;
    Ok(Restored {
        released,
        resume,
        first,
        to_first_step,
        report,
        final_digest,
        image_digest,
    })
}

/// Prints the figures (text, then one JSON line); whether the image matches the reference at T0
/// and the final state the uninterrupted run's (`want`).
fn report(job: &DemoJob, dir: &Path, ck: Checkpointed, rs: &Restored, want: &[u64]) -> bool {
    let Checkpointed {
        mut normal,
        during,
        report: ckr,
        summary,
        ran_to,
    } = ck;
    let rsr = &rs.report;
    let bitexact = rs.image_digest == want[0] && rs.final_digest == want[1];
    let normal_ms = median(&mut normal);
    let worst = during.iter().copied().max().unwrap_or_default();
    let stall = worst.saturating_sub(normal_ms);
    println!(
        "  normal step                  {:>9.1} ms (median of {})",
        ms(normal_ms),
        normal.len()
    );
    println!(
        "  checkpoint                   {:>9.1} ms for {:.0} MiB, {} steps ran meanwhile (to step {})",
        ms(ckr.elapsed),
        ckr.bytes as f64 / 1048576.0,
        during.len(),
        ran_to - 1
    );
    println!(
        "    captured (all copies off the device) after {:.1} ms",
        ms(ckr.captured)
    );
    println!(
        "  stall seen by the job        {:>9.1} ms (slowest step during checkpoint {:.1} ms minus normal)",
        ms(stall),
        ms(worst)
    );
    println!(
        "    engine: {} copy-on-write ({} priority, {} shadow), hook blocked {} times, {:.1} ms in all",
        ckr.cow_priority + ckr.cow_shadow,
        ckr.cow_priority,
        ckr.cow_shadow,
        ckr.hook_blocked,
        ms(ckr.hook_blocked_total)
    );
    println!(
        "  image                        {} ({} bytes of data files)",
        dir.display(),
        summary.data_file_bytes
    );
    println!(
        "  released                     {:.0} MiB of device memory",
        rs.released as f64 / 1048576.0
    );
    println!(
        "  restore                      first step after {:.1} ms (step {} took {:.1} ms); all back after {:.1} ms",
        ms(rs.to_first_step),
        rs.resume,
        ms(rs.first),
        ms(rsr.elapsed)
    );
    println!(
        "    {} buffers on demand, {} prefetched",
        rsr.on_demand, rsr.prefetched
    );
    println!(
        "  image == reference at T0: {}; final state == uninterrupted run: {}",
        rs.image_digest == want[0],
        rs.final_digest == want[1]
    );
    let json = serde_json::json!({
        "backend": "host",
        "buffers": job.job.buffers().len(),
        "bytes": job.bytes(),
        "image_bytes": summary.data_file_bytes,
        "step_ms": ms(normal_ms),
        "stall_ms": ms(stall),
        "stall_engine_blocked_ms": ms(ckr.hook_blocked_total),
        "captured_ms": ms(ckr.captured),
        "checkpoint_ms": ms(ckr.elapsed),
        "cow_priority": ckr.cow_priority,
        "cow_shadow": ckr.cow_shadow,
        "restore_first_step_ms": ms(rs.to_first_step),
        "restore_ms": ms(rsr.elapsed),
        "on_demand": rsr.on_demand,
        "prefetched": rsr.prefetched,
        "bitexact": bitexact,
    });
    println!("{json}");
    bitexact
}
