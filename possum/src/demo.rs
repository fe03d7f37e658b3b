//! `possum demo`: the engine end to end on the host backend, with an on-disk image.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use possum_engine::host::HostDevice;
use possum_engine::image::{Image, ImageWriter, WriterOptions};
use possum_engine::store::{ChunkSink, ChunkSource};
use possum_engine::{Engine, EngineConfig};
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

pub fn run(a: &DemoArgs) -> Result<bool> {
    let spec = a.spec();
    if a.at + 1 >= spec.steps {
        bail!(
            "--at {} must be before the last step ({})",
            a.at,
            spec.steps
        );
    }
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

    // Steps before the checkpoint: the normal step time.
    let mut normal = Vec::new();
    for step in 0..a.at {
        normal.push(job.run_step(step)?);
    }
    // Mid-run: T0 falls after step `at` is issued, while it is still running.
    let t_step = Instant::now();
    job.issue_step(a.at)?;
    let writer = Arc::new(ImageWriter::create(&dir, WriterOptions::default())?);
    writer.set_meta("resume_step", &(a.at + 1).to_string())?;
    writer.set_meta("backend", "host")?;
    let ck = engine.checkpoint(writer.clone(), false)?;
    job.job.sync()?;
    let mut during = vec![t_step.elapsed()];
    let mut step = a.at + 1;
    while !ck.is_finished() && step < spec.steps {
        during.push(job.run_step(step)?);
        step += 1;
    }
    let ckr = ck.wait()?;
    let summary = Arc::into_inner(writer)
        .context("image writer still shared")?
        .commit()?;
    let ran_to = step;

    // Failure: the device memory goes away; the job resumes from the image.
    let released = engine.release()?;
    let img = Arc::new(Image::open(&dir)?);
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
    let rsr = rs.wait()?;
    let final_digest = job.digest()?;
    let image_ok = image_digest(&img, &job)?;
    let want = reference
        .join()
        .map_err(|_| anyhow::anyhow!("reference thread panicked"))?;
    let bitexact = image_ok == want[0] && final_digest == want[1];

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
        released as f64 / 1048576.0
    );
    println!(
        "  restore                      first step after {:.1} ms (step {} took {:.1} ms); all back after {:.1} ms",
        ms(to_first_step),
        resume,
        ms(first),
        ms(rsr.elapsed)
    );
    println!(
        "    {} buffers on demand, {} prefetched",
        rsr.on_demand, rsr.prefetched
    );
    println!(
        "  image == reference at T0: {}; final state == uninterrupted run: {}",
        image_ok == want[0],
        final_digest == want[1]
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
        "restore_first_step_ms": ms(to_first_step),
        "restore_ms": ms(rsr.elapsed),
        "on_demand": rsr.on_demand,
        "prefetched": rsr.prefetched,
        "bitexact": bitexact,
    });
    println!("{json}");
    Ok(bitexact)
}
