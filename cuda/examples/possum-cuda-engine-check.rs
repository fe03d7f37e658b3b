//! The engine end to end on a real GPU: a copy job on `CudaDevice`, checkpointed concurrently
//! mid-run, released, restored on demand, resumed, and checked bit for bit (see
//! `possum_workloads::copyjob`).
//!
//! ```text
//! possum-cuda-engine-check [--gib G] [--buffers N] [--disk DIR] [--chunk-mib M] [--staging N]
//!                          [--shadow-gib G] [--steps N] [--at K] [--ops N] [--device N]
//!                          [--restore-threads N]
//! ```
//! Prints a summary and one JSON line. Exit 0 when bit-exact (or SKIPPED: no CUDA device, unless
//! `POSSUM_REQUIRE_GPU=1`), 1 when not, 2 on errors.
#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::sync::Arc;

use possum_control::EnvConfig;
use possum_cuda::CudaDevice;
use possum_engine::{Engine, EngineConfig};
use possum_workloads::copyjob::{run, CopySpec, Target};

struct Args {
    gib: f64,
    buffers: usize,
    disk: Option<std::path::PathBuf>,
    chunk_mib: usize,
    staging: usize,
    shadow_gib: f64,
    steps: u64,
    at: u64,
    ops: usize,
    device: usize,
    restore_threads: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        gib: 4.0,
        buffers: 32,
        disk: None,
        chunk_mib: 32,
        staging: 16,
        shadow_gib: 0.0,
        steps: 200,
        at: 10,
        ops: 16,
        device: 0,
        restore_threads: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or(format!("{k} needs a value"));
        let num = |s: String| s.parse::<f64>().map_err(|e| format!("{s}: {e}"));
        match k.as_str() {
            "--gib" => a.gib = num(v()?)?,
            "--buffers" => a.buffers = num(v()?)? as usize,
            "--disk" => a.disk = Some(v()?.into()),
            "--chunk-mib" => a.chunk_mib = num(v()?)? as usize,
            "--staging" => a.staging = num(v()?)? as usize,
            "--shadow-gib" => a.shadow_gib = num(v()?)?,
            "--steps" => a.steps = num(v()?)? as u64,
            "--at" => a.at = num(v()?)? as u64,
            "--ops" => a.ops = num(v()?)? as usize,
            "--device" => a.device = num(v()?)? as usize,
            "--restore-threads" => a.restore_threads = num(v()?)? as usize,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("possum-cuda-engine-check: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(why) = possum_cuda::probe() {
        println!("SKIPPED: no CUDA device ({why})");
        let required = possum_cuda::config::Config::from_env().require_gpu;
        return if required {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        };
    }
    let dev = match CudaDevice::new(a.device) {
        Ok(d) => Arc::new(d),
        Err(e) => {
            eprintln!("possum-cuda-engine-check: {e}");
            return ExitCode::from(2);
        }
    };
    let cfg = EngineConfig {
        chunk_size: a.chunk_mib << 20,
        staging_buffers: a.staging,
        copy_streams: 2,
        writer_threads: 4,
        restore_threads: a.restore_threads,
        shadow_budget: (a.shadow_gib * f64::from(1u32 << 30)) as u64,
        ..EngineConfig::default()
    };
    let engine = match Engine::new(dev, cfg) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("possum-cuda-engine-check: {e}");
            return ExitCode::from(2);
        }
    };
    let per = ((a.gib * f64::from(1u32 << 30)) as u64 / a.buffers as u64) / (2 << 20) * (2 << 20);
    let spec = CopySpec {
        buffers: a.buffers,
        buffer_bytes: per,
        streams: 2,
        ops_per_step: a.ops,
        steps: a.steps,
        at: a.at,
        seed: 7,
        max_op_bytes: 8 << 20,
    };
    let target = a.disk.clone().map_or(Target::Memory, Target::Dir);
    match run(&engine, &spec, &target) {
        Ok(r) => {
            println!(
                "{}: {:.1} GiB in {} buffers to {}: step {:.1} ms, stall {:.1} ms (hook blocked {:.1} ms); \
                 captured in {:.0} ms = {:.1} GB/s, checkpoint {:.0} ms = {:.1} GB/s \
                 ({} priority, {} shadow copy-on-write); \
                 restore: first step after {:.1} ms, all back after {:.0} ms = {:.1} GB/s ({} on demand); bitexact {}",
                r.device,
                r.bytes as f64 / f64::from(1u32 << 30),
                r.buffers,
                r.target,
                r.step_ms,
                r.stall_ms,
                r.stall_engine_blocked_ms,
                r.captured_ms,
                r.capture_gbps,
                r.checkpoint_ms,
                r.checkpoint_gbps,
                r.cow_priority,
                r.cow_shadow,
                r.restore_first_step_ms,
                r.restore_ms,
                r.restore_gbps,
                r.on_demand,
                r.bitexact
            );
            println!("{}", serde_json::to_string(&r).unwrap_or_default());
            if r.bitexact {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("possum-cuda-engine-check: {e}");
            ExitCode::from(2)
        }
    }
}
