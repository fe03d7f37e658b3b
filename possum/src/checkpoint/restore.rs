//! `possum restore`.

use std::fs;
use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use possum_control::Request;
use possum_criu::{Criu, RestoreOptions};
use possum_cuda::checkpoint::DriverCheckpoint;
use serde_json::json;

use super::image::{open_image, plan_gpus, smi, KeptBuffers};
use super::stage::{self, Staging};
use super::{alive, ask, kill_job, ms, resume_children, Clock};

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
}

pub fn restore(a: &RestoreArgs) -> Result<bool> {
    let t_all = Instant::now();
    let img = open_image(&a.dir)?;
    let m = &img.manifest;
    let pid = m.pid;
    if alive(pid) {
        bail!(
            "process {pid} is running: CRIU restores the job under its old PID, which must be \
             free (kill the original first, or restore on another machine)"
        );
    }
    // nvidia-smi (tens of ms) answers while the rest is made ready; its verdict still comes
    // before anything is started. Its keeper first frees the memory of processes that are gone
    // (the job's, killed a moment ago, is otherwise freed within the keeper's periodic check,
    // and nvidia-smi would count it as taken).
    let keeper_dir = m.keeper.as_ref().map(|k| k.dir.clone());
    let gpus = (!m.gpu_memory.is_empty()).then(|| {
        std::thread::spawn(move || {
            if let Some(dir) = keeper_dir {
                stage::reap(&dir);
            }
            smi::gpus()
        })
    });
    // Buffers a keeper held are not the job's in nvidia-smi's count: a move needs room for them,
    // and so does a restore on the job's own GPU unless the keeper still holds them there.
    let kept = if m.keeper.is_some() {
        KeptBuffers {
            mib: img.buffer_mib()?,
            held: stage::keeper_holds(m),
        }
    } else {
        KeptBuffers::default()
    };
    let criu = Criu::locate().context("CRIU is needed for the CPU side");
    let drv = DriverCheckpoint::load().context("NVIDIA's driver checkpoint is needed");
    let pairs = plan_gpus(m, a.device, kept, || {
        gpus.and_then(|t| t.join().ok()).flatten()
    })?;
    let (criu, drv) = (criu?, drv?);
    refuse_split_without_plugin(&img.criu, &criu)?;
    let prepared = t_all.elapsed();
    let sockets = a.socket_dir.clone().unwrap_or_else(|| m.socket_dir.clone());
    if img.gpu.is_some() {
        // The killed job's socket files are still there; the restored job listens on them again.
        for p in std::iter::once(&pid).chain(&m.possum_children) {
            let _ = fs::remove_file(possum_control::socket_path(&sockets, *p as u32));
        }
    }
    // CRIU binds the tree's unix sockets at their paths again: their directories must exist
    // (a job that ended, or another machine, may not have them).
    let mut recreated = Vec::new();
    for d in &m.socket_dirs {
        if !d.exists() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(d)
                .with_context(|| format!("creating {} for the job's sockets", d.display()))?;
            recreated.push(d.clone());
        }
    }
    let mut clock = Clock::default();
    let mut opts = RestoreOptions::new(&img.criu);
    opts.shell_job = m.shell_job;
    opts.ext_unix_sk = true;
    opts.log_file = format!("restore-{}.log", std::process::id());
    if let Some(l) = criu_log_level() {
        opts.log_level = l;
    }
    // The job's standard descriptors that were pipes to a process outside its tree (`possum run
    // job | tee log`): CRIU would restore each with nobody at its other end, and the job's next
    // write there would kill it (SIGPIPE).
    let stdio = StdioPlan::new(&m.stdio_pipes)?;
    opts.inherit_fds = stdio.inherit.clone();
    // The keeper loads the GPU images while CRIU restores the process (stage.rs).
    let mut staging = None;
    // `--device`: the job's GPU moves to another (the driver's first pair; none for its own).
    let moved = pairs.first().copied();
    let stage_skipped = match stage::plan(m, img.gpu.as_deref(), moved, kept.held) {
        Ok(plan) => match clock.time("stage_begin", || Staging::begin(&img, plan)) {
            Ok(s) => {
                staging = Some(s);
                None
            }
            Err(e) => Some(format!("the keeper could not be asked: {e:#}")),
        },
        Err(why) => Some(why),
    };
    if let Err(e) = clock.time("criu_restore", || Ok(criu.restore(&opts)?)) {
        match staging.take() {
            // The keeper started for the staging may hold a PID of the job's: without it, once
            // more.
            Some(s) if s.started_keeper() => {
                s.abandon();
                clock
                    .time("criu_restore_again", || Ok(criu.restore(&opts)?))
                    .map_err(|again| {
                        again.context(format!(
                            "CRIU's restore failed twice (first with a keeper started for \
                             staging: {e:#})"
                        ))
                    })?;
            }
            Some(s) => {
                s.abandon();
                return Err(e);
            }
            None => return Err(e),
        }
    }
    // A job whose buffer memory was a keeper's gets one again where it looks for it, before it
    // resumes (the keeper sees the job's CUDA_VISIBLE_DEVICES; a job moved by `--device` finds
    // the socket serving its new GPU by UUID). Started after CRIU's restore, so that it cannot
    // take the job's PID (unless the staging started it before).
    let keeper_started = match (&m.keeper, &staging) {
        (_, Some(s)) if s.started_keeper() => Some(s.keeper_dir().to_path_buf()),
        (Some(k), _) => clock.time("keeper", || Ok(start_keeper_for(k, pid)))?,
        _ => None,
    };
    let mut resumed = serde_json::Value::Null;
    let mut children_resumed = Vec::new();
    let r = (|| -> Result<()> {
        clock.time("driver_restore", || {
            drv.restore(pid, &pairs)?;
            for &c in &m.cuda_children {
                drv.restore(c, &pairs)
                    .map_err(|e| anyhow::anyhow!("process {c} of the job's tree: {e}"))?;
            }
            Ok(())
        })?;
        clock.time("driver_unlock", || {
            drv.unlock(pid)?;
            for &c in &m.cuda_children {
                drv.unlock(c)?;
            }
            Ok(())
        })?;
        if let Some(gpu) = &img.gpu {
            let req = Request::Resume {
                dir: Some(gpu.display().to_string()),
            };
            resumed = clock.time("resume", || ask(pid, &sockets, &req))?;
            children_resumed = resume_children(&m.possum_children, &a.dir, &sockets, &mut clock)?;
        }
        Ok(())
    })();
    if let Err(e) = r {
        // A half-restored job is of no use to anyone: it must not linger, locked.
        let _ = kill_job(pid);
        if let Some(s) = staging {
            s.abandon();
        }
        return Err(e.context(format!(
            "restore of process {pid} failed; the restored process was killed, the image is intact"
        )));
    }
    // The stages the restored processes took, from their resume reports. Those none took (a
    // device without the keeper's memory, ...) are ended now: their memory would otherwise stay
    // retained for a live process.
    let taken: Vec<&serde_json::Value> = std::iter::once(&resumed)
        .chain(&children_resumed)
        .filter_map(|r| r["staged"].as_array())
        .flatten()
        .collect();
    let used: Vec<u64> = taken.iter().filter_map(|s| s["stage"].as_u64()).collect();
    let staged_used: u64 = taken.iter().filter_map(|s| s["buffers"].as_u64()).sum();
    let staged = staging.map(|s| s.finish_keeping(&used)).unwrap_or_default();
    // Buffers copied GPU to GPU from the job's old GPU (`--device`) into the stages it took.
    let peer_copied: u64 = staged
        .iter()
        .filter(|s| !s.unused)
        .map(|s| s.peer_buffers)
        .sum();
    let mut fig = clock.json();
    // possum's plugin wrote the memory taken out of CRIU's images back (part of CRIU's time).
    let fills = std::fs::read_to_string(img.criu.join(&opts.log_file))
        .map(|log| possum_criu::hostmem::fills_in_log(&log))
        .unwrap_or_default();
    if !fills.is_empty() {
        fig.insert(
            "hostmem_fill_ms".into(),
            json!(fills.iter().map(|f| f.2).sum::<f64>()),
        );
        fig.insert(
            "hostmem_fill_bytes".into(),
            json!(fills.iter().map(|f| f.1).sum::<u64>()),
        );
    }
    fig.insert("prepare_ms".into(), json!(ms(prepared)));
    fig.insert("total_ms".into(), json!(ms(t_all.elapsed())));
    // Buffers the keeper still held (a job killed on this host): mapped again, nothing copied.
    let from_keeper = resumed["attached"]
        .as_array()
        .is_some_and(|a| !a.is_empty());
    let out = json!({"pid": pid, "engine": m.engine, "dir": a.dir, "figures": fig,
                     "recreated_socket_dirs": recreated, "keeper_started": keeper_started,
                     "stdio_from_restore": stdio.from_restore, "stdio_discarded": stdio.discarded,
                     "gpu_from_keeper": from_keeper, "staged": staged,
                     "peer_buffers": peer_copied,
                     "stage_skipped": stage_skipped, "staged_buffers_mapped": staged_used,
                     "resume_report": resumed});
    if a.json {
        println!("{out}");
    } else {
        println!(
            "possum: process {pid} restored from {} ({:?} engine) in {:.0} ms (CRIU {:.0}, driver {:.0}, resume {:.0}){}",
            a.dir.display(),
            m.engine,
            ms(t_all.elapsed()),
            ms(clock.get("criu_restore")),
            ms(clock.get("driver_restore") + clock.get("driver_unlock")),
            ms(clock.get("resume")),
            match (&img.gpu, resumed["on_demand"].as_bool()) {
                (None, _) => "",
                (Some(_), _) if from_keeper =>
                    "; its GPU buffers were still on the GPU with the keeper: mapped again, nothing copied",
                (Some(_), _) if peer_copied > 0 =>
                    "; its GPU buffers were copied GPU to GPU from the keeper's memory on its old GPU while CRIU restored it: mapped, each waited for only while it still loads",
                (Some(_), _) if staged_used > 0 =>
                    "; its GPU buffers were loaded by the keeper while CRIU restored it: mapped, each waited for only while it still loads",
                (Some(_), Some(false)) => "; every GPU buffer was back before it ran on (hooks off)",
                (Some(_), _) => "; GPU buffers come back on demand",
            }
        );
        for s in staged
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
    Ok(true)
}

/// Memory `possum checkpoint` took out of CRIU's images is written back only by possum's CRIU
/// plugin, and CRIU checks that a required plugin is loaded only when it loads plugins at all.
fn refuse_split_without_plugin(criu_dir: &Path, criu: &Criu) -> Result<()> {
    if !criu.has_possum_plugin() && possum_criu::hostmem::is_split(criu_dir)? {
        bail!(
            "{} holds memory only possum's CRIU plugin restores, and no plugin was found \
             (POSSUM_CRIU_PLUGIN_DIR, or criu-plugins/{} beside the possum executable)",
            criu_dir.display(),
            possum_criu::PLUGIN_FILE
        );
    }
    Ok(())
}

/// CRIU's log level from `POSSUM_CRIU_LOG_LEVEL` (1 errors .. 4 everything), for a diagnosis.
fn criu_log_level() -> Option<possum_criu::LogLevel> {
    use possum_criu::LogLevel::*;
    match std::env::var("POSSUM_CRIU_LOG_LEVEL").ok()?.trim() {
        "1" => Some(Error),
        "2" => Some(Warn),
        "3" => Some(Info),
        "4" => Some(Debug),
        _ => None,
    }
}

/// Starts a keeper where the restored job `pid` looks for its keeper, unless one answers there:
/// seeing the job's `CUDA_VISIBLE_DEVICES`, ending when the job does, left running when possum
/// exits. Its directory once it listens; `None` if none was needed or it did not start (the job
/// then uses memory of its own, and says so in `possum status`).
fn start_keeper_for(k: &super::image::KeeperOfJob, pid: i32) -> Option<std::path::PathBuf> {
    k.ensure_keeper(pid, &[])
        .ok()
        .flatten()
        .map(|_| k.dir.clone())
}

/// What a restored job's standard descriptors that were pipes to outside its tree become: this
/// command's descriptor of the same number (a terminal, a file: where the user runs the restore),
/// or `/dev/null` when that is itself a pipe or closed (a script capturing this command's output
/// would otherwise wait for the job to end, and `--json` would mix the job's output into it).
struct StdioPlan {
    /// CRIU's `inherit_fd`: (the pipe's name in the image, a descriptor here).
    inherit: Vec<(String, std::os::fd::RawFd)>,
    /// The job's descriptors given this command's.
    from_restore: Vec<i32>,
    /// The job's descriptors given `/dev/null`.
    discarded: Vec<i32>,
    /// The `/dev/null`s, open until CRIU has restored the job.
    _null: Vec<fs::File>,
}

impl StdioPlan {
    fn new(pipes: &[(i32, String)]) -> Result<StdioPlan> {
        use std::os::fd::AsRawFd;
        let mut plan = StdioPlan {
            inherit: Vec::new(),
            from_restore: Vec::new(),
            discarded: Vec::new(),
            _null: Vec::new(),
        };
        for (fd, key) in pipes {
            let ours = fs::read_link(format!("/proc/self/fd/{fd}")).ok();
            let usable = ours
                .as_ref()
                .and_then(|t| t.to_str())
                .is_some_and(|t| !t.starts_with("pipe:["));
            if usable {
                plan.inherit.push((key.clone(), *fd));
                plan.from_restore.push(*fd);
            } else {
                let null = fs::OpenOptions::new()
                    .read(*fd == 0)
                    .write(*fd != 0)
                    .open("/dev/null")
                    .context("opening /dev/null for the job's standard descriptors")?;
                plan.inherit.push((key.clone(), null.as_raw_fd()));
                plan.discarded.push(*fd);
                plan._null.push(null);
            }
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_image_is_refused_without_possums_plugin() {
        let tmp = tempfile::tempdir().unwrap();
        let criu_dir = tmp.path().join("criu");
        fs::create_dir(&criu_dir).unwrap();
        let plugins = tmp.path().join("plugins");
        fs::create_dir(&plugins).unwrap();
        let none = Criu::with_binary("/bin/true").with_plugin_dir(None);
        let empty = none.clone().with_plugin_dir(Some(plugins.clone()));
        // Not split: no plugin needed.
        refuse_split_without_plugin(&criu_dir, &none).unwrap();
        fs::write(criu_dir.join("possum-hostmem-42.idx"), b"x").unwrap();
        for criu in [&none, &empty] {
            let e = refuse_split_without_plugin(&criu_dir, criu)
                .unwrap_err()
                .to_string();
            assert!(e.contains("only possum's CRIU plugin restores"), "{e}");
        }
        fs::write(plugins.join(possum_criu::PLUGIN_FILE), b"").unwrap();
        refuse_split_without_plugin(&criu_dir, &empty).unwrap();
    }
}
