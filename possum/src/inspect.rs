//! `possum inspect DIR`: what an image holds, read without restoring it (as CRIU's `crit` reads
//! CRIU's images): the job, its process tree, each GPU image's buffers, chunks, bytes, the bytes
//! held by reference to parent images, how many chunks carry a fingerprint; `--verify` reads
//! every chunk and checks it against its CRC and fingerprint.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use possum_engine::store::ChunkSource;
use serde::Serialize;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The image directory (`possum checkpoint -D DIR`).
    #[arg(short = 'D', long = "images-dir", value_name = "DIR")]
    pub dir: PathBuf,
    /// Read every GPU chunk and check it against its CRC and fingerprint (reads the whole image).
    #[arg(long)]
    pub verify: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// What `possum inspect` says of an image.
#[derive(Debug, Serialize)]
struct Inspected {
    dir: PathBuf,
    pid: i32,
    engine: String,
    created_unix: u64,
    possum_children: Vec<i32>,
    cuda_children: Vec<i32>,
    tcp_established: bool,
    criu_bytes: u64,
    gpu: Vec<GpuImage>,
}

/// One engine image: a process's buffers on one device.
#[derive(Debug, Serialize)]
struct GpuImage {
    pid: i32,
    device: usize,
    path: PathBuf,
    format: String,
    buffers: usize,
    bytes: u64,
    chunks: u64,
    fingerprinted_chunks: u64,
    data_file_bytes: u64,
    reused_bytes: u64,
    parents: Vec<PathBuf>,
    /// `--verify`: "ok", or the first problem found.
    #[serde(skip_serializing_if = "Option::is_none")]
    verified: Option<String>,
}

pub fn run(a: &InspectArgs) -> Result<bool> {
    let img = possum_sequence::image::open_image(&a.dir)
        .with_context(|| format!("{} is not a possum image", a.dir.display()))?;
    let m = &img.manifest;
    let mut gpu = Vec::new();
    let mut ok = true;
    for (pid, device, path) in img.gpu_images() {
        let g = gpu_image(pid, device, &path, a.verify)?;
        ok &= g.verified.as_deref().is_none_or(|v| v == "ok");
        gpu.push(g);
    }
    let out = Inspected {
        dir: a.dir.clone(),
        pid: m.pid,
        engine: format!("{:?}", m.engine).to_lowercase(),
        created_unix: m.created,
        possum_children: m.possum_children.clone(),
        cuda_children: m.cuda_children.clone(),
        tcp_established: m.tcp_established.is_some(),
        criu_bytes: possum_sequence::image::dir_bytes(&img.criu),
        gpu,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{}", words(&out));
    }
    Ok(ok)
}

/// One engine image's summary, and with `verify` the check of every chunk.
fn gpu_image(pid: i32, device: usize, path: &Path, verify: bool) -> Result<GpuImage> {
    let img = possum_engine::image::Image::open(path)
        .with_context(|| format!("GPU image {}", path.display()))?;
    let s = img.summary();
    let fingerprinted = s
        .buffers
        .iter()
        .flat_map(|b| {
            img.chunks(b.id)
                .into_iter()
                .map(move |(off, _)| (b.id, off))
        })
        .filter(|&(id, off)| img.fingerprint(id, off).is_some())
        .count() as u64;
    let verified = verify.then(|| match img.verify() {
        Ok(()) => "ok".to_string(),
        Err(e) => e.to_string(),
    });
    Ok(GpuImage {
        pid,
        device,
        path: path.to_path_buf(),
        format: format!("{}.{}", s.version.0, s.version.1),
        buffers: s.buffers.len(),
        bytes: s.total_bytes,
        chunks: s.chunks,
        fingerprinted_chunks: fingerprinted,
        data_file_bytes: s.data_file_bytes,
        reused_bytes: s.reused_bytes,
        parents: s.parents.clone(),
        verified,
    })
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// The summary in words, a line per GPU image.
fn words(i: &Inspected) -> String {
    let mut s = format!(
        "image {}: process {} ({} engine){}{}, CRIU's images {}\n",
        i.dir.display(),
        i.pid,
        i.engine,
        if i.possum_children.is_empty() {
            String::new()
        } else {
            format!(", possum children {:?}", i.possum_children)
        },
        if i.tcp_established {
            ", established TCP connections"
        } else {
            ""
        },
        mib(i.criu_bytes)
    );
    for g in &i.gpu {
        s += &format!(
            "  pid {} device {}: {} buffers, {} in {} chunks ({} fingerprinted), {} in its files{}{}\n",
            g.pid,
            g.device,
            g.buffers,
            mib(g.bytes),
            g.chunks,
            g.fingerprinted_chunks,
            mib(g.data_file_bytes),
            if g.reused_bytes > 0 {
                format!(
                    ", {} referenced from {}",
                    mib(g.reused_bytes),
                    g.parents
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            } else {
                String::new()
            },
            g.verified
                .as_deref()
                .map(|v| format!("; verified: {v}"))
                .unwrap_or_default()
        );
    }
    if i.gpu.is_empty() {
        s += "  no GPU image (a job whose GPU state is all in CRIU's image: --engine driver)\n";
    }
    s
}
