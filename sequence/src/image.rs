//! The image directory of a process checkpoint: `possum.json` ([`Manifest`]), CRIU's images and
//! possum's GPU images; what it records of the GPUs the job used (from nvidia-smi), and the
//! checks a restore makes of them.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::Engine;

/// The image's own description, `DIR/possum.json`.
pub const MANIFEST: &str = "possum.json";
/// Format version of `possum.json`.
pub const MANIFEST_VERSION: u32 = 1;

/// `DIR/possum.json`.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct Manifest {
    /// [`MANIFEST_VERSION`].
    pub possum_image: u32,
    pub engine: Engine,
    pub pid: i32,
    pub shell_job: bool,
    pub socket_dir: PathBuf,
    /// Seconds since the epoch.
    pub created: u64,
    /// Subdirectories: CRIU's images (none for a `--gpu-only` image), and possum's GPU images
    /// (engine possum).
    pub criu_dir: Option<String>,
    pub gpu_dir: Option<String>,
    /// The GPU memory the job used when checkpointed, per GPU (from nvidia-smi; empty when it
    /// could not be asked): a restore refuses a GPU with less free memory.
    #[serde(default)]
    pub gpu_memory: Vec<GpuUse>,
    /// The other CUDA processes of the job's tree (descendants of `pid`), checkpointed by the
    /// driver with it: a restore restores and unlocks each after CRIU's restore.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cuda_children: Vec<i32>,
    /// Those of `cuda_children` with possum loaded: their buffers were saved and released by
    /// possum like the root's, each into `gpu-PID/`; a restore resumes each from it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub possum_children: Vec<i32>,
    /// The directories the tree's unix sockets were bound in: a restore creates those missing
    /// (CRIU binds the sockets there again).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub socket_dirs: Vec<PathBuf>,
    /// The root's standard descriptors that were pipes to a process outside the tree: (fd,
    /// `pipe:[INODE]`). A restore gives the job its own descriptor of that number instead.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stdio_pipes: Vec<(i32, String)>,
    /// The keeper the job's buffer memory came from (its `POSSUM_KEEPER`), and the job's
    /// `CUDA_VISIBLE_DEVICES`: a restore starts a keeper there if none answers, seeing the
    /// devices the job sees, so that the restored job keeps its memory in one again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keeper: Option<KeeperOfJob>,
    /// The buffers' memory left on the GPU with the keeper for this image's restore (a job
    /// killed with `--keep-on-gpu`): per process and device, the epoch it is kept under. A
    /// restore onto another GPU copies that memory there only while it is still this
    /// checkpoint's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<HeldMemory>,
    /// The checkpoint's figures.
    pub figures: Value,
    /// CRC32C (hex) of the rest of the description, serialized compactly ([`manifest_text`]):
    /// a change that leaves valid JSON is caught too. Absent in images of earlier versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<String>,
}

/// Memory a keeper holds for a restore ([`Manifest::held`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldMemory {
    /// The process.
    pub pid: i32,
    /// Its device ordinal (its image `gpu-N`).
    pub device: usize,
    /// The epoch the keeper holds it under.
    pub epoch: u64,
}

impl HeldMemory {
    /// The entries of a job's `release` reply (`held_epochs`) for process `pid`.
    pub fn from_release(pid: i32, reply: &possum_control::reply::ReleaseReply) -> Vec<HeldMemory> {
        (reply.held_epochs.iter())
            .map(|h| HeldMemory {
                pid,
                device: h.device,
                epoch: h.epoch,
            })
            .collect()
    }
}

/// Where a job's keeper was ([`Manifest::keeper`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeeperOfJob {
    /// Its socket directory.
    pub dir: PathBuf,
    /// The job's `CUDA_VISIBLE_DEVICES`, if set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_visible_devices: Option<String>,
}

impl KeeperOfJob {
    /// Starts a keeper (`exe keeper`, `exe` the possum executable) in its directory for the job
    /// `pid` (ending when the job does), seeing the devices the job sees, and returns it once it
    /// listens ([`crate::process::start_keeper`]).
    pub fn start_keeper(&self, exe: &Path, pid: i32) -> Result<std::process::Child> {
        crate::process::start_keeper(exe, &self.dir, pid, |cmd| {
            match &self.cuda_visible_devices {
                Some(v) => cmd.env("CUDA_VISIBLE_DEVICES", v),
                None => cmd.env_remove("CUDA_VISIBLE_DEVICES"),
            };
        })
    }

    /// A keeper for the restore of job `pid` in its directory: `None` if one answers there
    /// already, else one started ([`Self::start_keeper`]), again if its process took a PID of
    /// `avoid` (PIDs CRIU is about to restore).
    pub fn ensure_keeper(
        &self,
        exe: &Path,
        pid: i32,
        avoid: &[i32],
    ) -> Result<Option<std::process::Child>> {
        if possum_keeper::Keeper::connect(&possum_keeper::socket_of(&self.dir, 0)).is_ok() {
            return Ok(None);
        }
        let mut child = self.start_keeper(exe, pid)?;
        if avoid.contains(&(child.id() as i32)) {
            let _ = child.kill();
            let _ = child.wait();
            child = self.start_keeper(exe, pid)?;
        }
        Ok(Some(child))
    }
}

/// The check of `m` ([`Manifest::check`] ignored).
fn manifest_check(m: &Manifest) -> serde_json::Result<String> {
    let bare = Manifest {
        check: None,
        ..m.clone()
    };
    Ok(format!(
        "{:08x}",
        crc32c::crc32c(serde_json::to_string(&bare)?.as_bytes())
    ))
}

/// `possum.json`'s text for `m`, with its check.
pub fn manifest_text(m: &Manifest) -> serde_json::Result<String> {
    let checked = Manifest {
        check: Some(manifest_check(m)?),
        ..m.clone()
    };
    serde_json::to_string_pretty(&checked)
}

/// GPU memory used by a process on one GPU.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct GpuUse {
    /// The GPU's UUID, as nvidia-smi prints it (`GPU-...`).
    pub uuid: String,
    /// MiB.
    pub mib: u64,
}

/// What nvidia-smi (`bin`: [`Environment::nvidia_smi`](crate::Environment::nvidia_smi)) says
/// about GPU memory.
pub mod smi {
    use super::GpuUse;
    use std::process::Command;

    fn query(bin: &str, args: &[&str]) -> Option<Vec<Vec<String>>> {
        let out = Command::new(bin).args(args).output().ok()?;
        if !out.status.success() {
            return None;
        }
        Some(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| l.split(',').map(|f| f.trim().to_string()).collect())
                .collect(),
        )
    }

    /// The memory `pid` uses on each GPU; None when nvidia-smi cannot be asked.
    pub fn process_usage(bin: &str, pid: i32) -> Option<Vec<GpuUse>> {
        let rows = query(
            bin,
            &[
                "--query-compute-apps=pid,gpu_uuid,used_memory",
                "--format=csv,noheader,nounits",
            ],
        )?;
        Some(
            rows.iter()
                .filter(|r| r.len() >= 3 && r[0] == pid.to_string())
                .filter_map(|r| {
                    Some(GpuUse {
                        uuid: r[1].clone(),
                        mib: r[2].parse().ok()?,
                    })
                })
                .collect(),
        )
    }

    /// The GPUs here: (index, UUID, free MiB); None when nvidia-smi cannot be asked.
    pub fn gpus(bin: &str) -> Option<Vec<(u32, String, u64)>> {
        let rows = query(
            bin,
            &[
                "--query-gpu=index,uuid,memory.free",
                "--format=csv,noheader,nounits",
            ],
        )?;
        Some(
            rows.iter()
                .filter(|r| r.len() >= 3)
                .filter_map(|r| Some((r[0].parse().ok()?, r[1].clone(), r[2].parse().ok()?)))
                .collect(),
        )
    }
}

/// The driver's GPU remapping for a restore: (the UUID the job saw, the GPU's it gets).
pub type UuidPairs = Vec<([u8; 16], [u8; 16])>;

/// Why the GPUs cannot take the restored job ([`plan_gpus`]).
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// `--device` for an image that does not record the job's GPU.
    #[error(
        "the image does not record which GPU the job used (nvidia-smi was not available when it \
         was checkpointed): --device cannot be honoured"
    )]
    NotRecorded,
    /// `--device` without nvidia-smi.
    #[error("--device needs nvidia-smi, which cannot be asked here")]
    NoSmi,
    /// Too little free memory for the job's own memory and more.
    #[error(
        "GPU {uuid} has too little memory: {free} MiB free, the job needs {} MiB there ({own} MiB \
         of its own, {extra} MiB of {what})",
        own + extra
    )]
    TooLittleFor {
        /// The GPU.
        uuid: String,
        /// Its free MiB.
        free: u64,
        /// The job's own MiB.
        own: u64,
        /// MiB more.
        extra: u64,
        /// Of what.
        what: &'static str,
    },
    /// Too little free memory for what the job used.
    #[error("GPU {uuid} has too little memory: {free} MiB free, the job used {own} MiB")]
    TooLittle {
        /// The GPU.
        uuid: String,
        /// Its free MiB.
        free: u64,
        /// The job's MiB.
        own: u64,
    },
    /// The job's GPU is elsewhere.
    #[error("the GPU the job ran on ({uuid}) is not on this machine: choose one with --device")]
    NotHere {
        /// The GPU.
        uuid: String,
    },
    /// `--device` for a job of several GPUs.
    #[error("the job used {0} GPUs; --device moves a job that used one")]
    SeveralGpus(usize),
    /// `--device` names no GPU here.
    #[error("there is no GPU {0} here")]
    NoSuchGpu(u32),
    /// nvidia-smi's answer holds something that is not a GPU UUID.
    #[error(transparent)]
    Uuid(#[from] NotAUuid),
}

/// A string that is not a GPU UUID.
#[derive(Debug, thiserror::Error)]
#[error("not a GPU UUID: {0}")]
pub struct NotAUuid(pub String);

/// The 16 bytes of a GPU UUID as nvidia-smi prints it (`GPU-8a9c1d2e-...`).
pub(crate) fn uuid_bytes(s: &str) -> Result<[u8; 16], NotAUuid> {
    let hex: String = s
        .trim_start_matches("GPU-")
        .chars()
        .filter(|c| *c != '-')
        .collect();
    let mut out = [0u8; 16];
    if hex.len() != 32 || !hex.is_ascii() {
        return Err(NotAUuid(s.to_string()));
    }
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| NotAUuid(s.to_string()))?;
    }
    Ok(out)
}

/// The buffers of a job whose memory was its keeper's, for the room checks of a restore.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KeptBuffers {
    /// Their MiB (0 for a job without a keeper: nvidia-smi counted them as the job's).
    pub mib: u64,
    /// The keeper still holds them (mapped again on the job's own GPU, nothing made).
    pub held: bool,
}

/// Checks the GPUs the restore will use (the job's own, or `--device`) for free memory, and
/// returns the driver's UUID remapping (empty: the same GPUs). `kept`: the job's buffers that
/// another process (its keeper) held, which nvidia-smi did not count as the job's: a move to
/// another GPU needs room for them there too, and so does a single-GPU job's own GPU unless the
/// keeper still holds them. `gpus`: nvidia-smi's answer ([`smi::gpus`]), asked only if needed.
pub(crate) fn plan_gpus(
    m: &Manifest,
    device: Option<u32>,
    kept: KeptBuffers,
    gpus: impl FnOnce() -> Option<Vec<(u32, String, u64)>>,
    obs: &mut dyn crate::Observer,
) -> Result<UuidPairs, GpuError> {
    if m.gpu_memory.is_empty() {
        if device.is_some() {
            return Err(GpuError::NotRecorded);
        }
        return Ok(Vec::new());
    }
    let Some(gpus) = gpus() else {
        if device.is_some() {
            return Err(GpuError::NoSmi);
        }
        obs.note("nvidia-smi cannot be asked: free GPU memory not checked");
        return Ok(Vec::new());
    };
    // Room on GPU `uuid` for the job's own `own` MiB and `extra` MiB more (`what`).
    let room = |uuid: &str, free: u64, own: u64, extra: u64, what: &'static str| {
        let uuid = uuid.to_string();
        if extra > 0 && free < own + extra {
            return Err(GpuError::TooLittleFor {
                uuid,
                free,
                own,
                extra,
                what,
            });
        }
        if free < own {
            return Err(GpuError::TooLittle { uuid, free, own });
        }
        Ok(())
    };
    // On its own GPU, a single-GPU job's buffers that its keeper no longer holds are made again
    // there (nvidia-smi counted them as the keeper's, not in the job's MiB).
    let again = if m.gpu_memory.len() == 1 && !kept.held {
        kept.mib
    } else {
        0
    };
    let own_gpu = |uuid: &str, free: u64, used: u64| {
        room(
            uuid,
            free,
            used,
            again,
            "buffers its keeper no longer holds, made again",
        )
    };
    let Some(d) = device else {
        for u in &m.gpu_memory {
            let Some((_, _, free)) = gpus.iter().find(|(_, id, _)| *id == u.uuid) else {
                let uuid = u.uuid.clone();
                return Err(GpuError::NotHere { uuid });
            };
            own_gpu(&u.uuid, *free, u.mib)?;
        }
        return Ok(Vec::new());
    };
    let [used] = m.gpu_memory.as_slice() else {
        return Err(GpuError::SeveralGpus(m.gpu_memory.len()));
    };
    let Some((_, target, free)) = gpus.iter().find(|(i, _, _)| *i == d) else {
        return Err(GpuError::NoSuchGpu(d));
    };
    if *target == used.uuid {
        own_gpu(target, *free, used.mib)?;
        return Ok(Vec::new());
    }
    room(target, *free, used.mib, kept.mib, "buffers its keeper held")?;
    // NVIDIA's restore wants every GPU the process saw mapped (one pair per GPU; a single pair on
    // a two-GPU machine is CUDA_ERROR_INVALID_VALUE, measured on 2 H200s): the job's GPU and the
    // target swap places, every other GPU of this machine maps to itself. A GPU the image names
    // that is not here (another machine) maps to the target alone.
    let mut pairs = vec![(uuid_bytes(&used.uuid)?, uuid_bytes(target)?)];
    if gpus.iter().any(|(_, id, _)| *id == used.uuid) {
        pairs.push((uuid_bytes(target)?, uuid_bytes(&used.uuid)?));
        for (_, id, _) in gpus
            .iter()
            .filter(|(_, id, _)| *id != used.uuid && id != target)
        {
            pairs.push((uuid_bytes(id)?, uuid_bytes(id)?));
        }
    }
    Ok(pairs)
}

/// Whether `path` exists as anything but an empty directory.
pub(crate) fn occupied(path: &Path) -> bool {
    match fs::read_dir(path) {
        Ok(mut d) => d.next().is_some(),
        Err(e) => e.kind() != std::io::ErrorKind::NotFound,
    }
}

/// The bytes the files under `path` hold: each file's length, or what it occupies when that is
/// less (a data file's holes before chunks aligned to 2 MiB are not image bytes; a small file on
/// a huge-page tmpfs occupies a whole 2 MiB page, but holds only its length).
pub fn dir_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = fs::read_dir(path) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e
                .metadata()
                .map(|m| m.len().min(m.blocks().saturating_mul(512)))
                .unwrap_or(0),
            Err(_) => 0,
        })
        .sum()
}

/// fsyncs every file and directory under `dir`.
pub(crate) fn sync_tree(dir: &Path) -> Result<()> {
    for e in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e?;
        if e.file_type()?.is_dir() {
            sync_tree(&e.path())?;
        } else {
            fs::File::open(e.path())?.sync_all()?;
        }
    }
    fs::File::open(dir)?.sync_all()?;
    Ok(())
}

/// A checked image directory: its description and where its parts are.
#[derive(Debug)]
pub struct Image {
    /// The image directory.
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// CRIU's images.
    pub criu: PathBuf,
    /// possum's GPU images (engine possum).
    pub gpu: Option<PathBuf>,
}

/// What is wrong with an image directory ([`open_image`]).
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The directory does not exist.
    #[error("there is no image at {}: the directory does not exist", dir.display())]
    NoDirectory {
        /// The directory.
        dir: PathBuf,
    },
    /// It has no `possum.json` (a checkpoint that did not complete, or not an image).
    #[error("{} is not a complete possum image (no {MANIFEST})", dir.display())]
    NoManifest {
        /// The directory.
        dir: PathBuf,
        /// Why it could not be read.
        #[source]
        source: std::io::Error,
    },
    /// `possum.json` is not a possum image's description.
    #[error("{} is corrupt: not a possum image's description", path.display())]
    Unreadable {
        /// `DIR/possum.json`.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// `possum.json` was changed after it was written.
    #[error(
        "{} is corrupt: its content does not match its check (changed after it was written)",
        path.display()
    )]
    CheckMismatch {
        /// `DIR/possum.json`.
        path: PathBuf,
    },
    /// Another format version.
    #[error("{}: image format {version} (this possum reads {MANIFEST_VERSION})", path.display())]
    Version {
        /// `DIR/possum.json`.
        path: PathBuf,
        /// The image's version.
        version: u32,
    },
    /// A `--gpu-only` image.
    #[error(
        "{} holds only GPU buffers (written with --gpu-only): there is no process to restore",
        dir.display()
    )]
    GpuOnly {
        /// The directory.
        dir: PathBuf,
    },
    /// CRIU's part is missing.
    #[error("{}: CRIU's images are missing or partial (no inventory.img)", criu.display())]
    CriuPartial {
        /// CRIU's images.
        criu: PathBuf,
    },
    /// possum's GPU images are missing.
    #[error("{}: no GPU image", gpu.display())]
    NoGpuImage {
        /// The GPU images' directory.
        gpu: PathBuf,
    },
    /// A GPU image does not open.
    #[error(transparent)]
    GpuImage(anyhow::Error),
}

/// Reads and checks `DIR/possum.json` and what it names.
pub fn open_image(dir: &Path) -> Result<Image, ImageError> {
    if !dir.exists() {
        return Err(ImageError::NoDirectory {
            dir: dir.to_path_buf(),
        });
    }
    let path = dir.join(MANIFEST);
    let bytes = fs::read(&path).map_err(|source| ImageError::NoManifest {
        dir: dir.to_path_buf(),
        source,
    })?;
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|source| ImageError::Unreadable {
        path: path.clone(),
        source,
    })?;
    if let Some(check) = &m.check {
        let unreadable = |source| ImageError::Unreadable {
            path: path.clone(),
            source,
        };
        if *check != manifest_check(&m).map_err(unreadable)? {
            return Err(ImageError::CheckMismatch { path });
        }
    }
    if m.possum_image != MANIFEST_VERSION {
        return Err(ImageError::Version {
            path,
            version: m.possum_image,
        });
    }
    let Some(criu_dir) = &m.criu_dir else {
        return Err(ImageError::GpuOnly {
            dir: dir.to_path_buf(),
        });
    };
    let criu = dir.join(criu_dir);
    if !criu.join("inventory.img").is_file() {
        return Err(ImageError::CriuPartial { criu });
    }
    let gpu = m.gpu_dir.as_ref().map(|g| dir.join(g));
    if let Some(gpu) = &gpu {
        if check_gpu_images(gpu).map_err(ImageError::GpuImage)? == 0 {
            return Err(ImageError::NoGpuImage { gpu: gpu.clone() });
        }
    }
    // A child's may be empty: a process that had no buffer yet.
    for &c in &m.possum_children {
        check_gpu_images(&dir.join(child_gpu_dir(c))).map_err(ImageError::GpuImage)?;
    }
    Ok(Image {
        dir: dir.to_path_buf(),
        manifest: m,
        criu,
        gpu,
    })
}

impl Image {
    /// Its engine images: (pid, device ordinal, directory), for the job's root (`gpu/gpu-N`)
    /// and each of its possum processes (`gpu-PID/gpu-N`), sorted.
    pub fn gpu_images(&self) -> Vec<(i32, usize, PathBuf)> {
        let Some(gpu) = &self.gpu else {
            return Vec::new();
        };
        let roots = std::iter::once((self.manifest.pid, gpu.clone())).chain(
            self.manifest
                .possum_children
                .iter()
                .map(|&c| (c, self.dir.join(child_gpu_dir(c)))),
        );
        let mut out = Vec::new();
        for (pid, root) in roots {
            let Ok(entries) = fs::read_dir(&root) else {
                continue;
            };
            for e in entries.flatten() {
                let name = e.file_name();
                let Some(n) = name
                    .to_str()
                    .and_then(|n| n.strip_prefix("gpu-"))
                    .and_then(|n| n.parse::<usize>().ok())
                else {
                    continue;
                };
                out.push((pid, n, e.path()));
            }
        }
        out.sort();
        out
    }

    /// The bytes of the buffers in its engine images (every process's), in MiB rounded up.
    pub fn buffer_mib(&self) -> Result<u64> {
        use possum_engine::store::ChunkSource;
        let mut bytes = 0u64;
        for (_, _, path) in self.gpu_images() {
            let img = possum_engine::image::Image::open(&path)?;
            bytes += img.buffers().iter().map(|b| b.size).sum::<u64>();
        }
        Ok(bytes.div_ceil(1 << 20))
    }
}

/// The directory of child `pid`'s GPU images in an image directory.
pub fn child_gpu_dir(pid: i32) -> String {
    format!("gpu-{pid}")
}

/// Opens every engine image under `gpu` (one per device): how many there are.
fn check_gpu_images(gpu: &Path) -> Result<usize> {
    let mut n = 0;
    for e in fs::read_dir(gpu).with_context(|| format!("{}: GPU images missing", gpu.display()))? {
        let e = e?;
        possum_engine::image::Image::open(&e.path())
            .with_context(|| format!("GPU image {}", e.path().display()))?;
        n += 1;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file with a hole counts what it holds, not its length; nested directories are summed.
    #[test]
    fn image_bytes_leave_holes_out() {
        use std::os::unix::fs::FileExt;
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir(tmp.path().join("gpu")).unwrap();
        let sparse = fs::File::create(tmp.path().join("gpu/data-000.bin")).unwrap();
        sparse.write_all_at(&[7u8; 4096], 8 << 20).unwrap();
        fs::write(tmp.path().join("manifest"), [1u8; 100]).unwrap();
        let n = dir_bytes(tmp.path());
        assert!((4096 + 100..=4 * 4096 + 100).contains(&n), "{n}");
    }

    /// A missing directory and a `possum.json` of random bytes each say what is wrong.
    #[test]
    fn a_missing_directory_and_a_garbled_manifest_are_named() {
        let tmp = tempfile::tempdir().unwrap();
        let none = tmp.path().join("none");
        let e = open_image(&none).unwrap_err();
        assert!(matches!(e, ImageError::NoDirectory { .. }), "{e:?}");
        let empty = tmp.path().join("empty");
        fs::create_dir(&empty).unwrap();
        let e = open_image(&empty).unwrap_err();
        assert!(matches!(e, ImageError::NoManifest { .. }), "{e:?}");
        fs::write(empty.join(MANIFEST), [0xffu8, 0x00, 0x9c, 0x42, 0x17]).unwrap();
        let e = open_image(&empty).unwrap_err();
        assert!(matches!(e, ImageError::Unreadable { .. }), "{e:?}");
        assert!(e
            .to_string()
            .contains(&empty.join(MANIFEST).display().to_string()));
    }

    #[test]
    fn gpu_uuids_are_parsed() {
        let b = uuid_bytes("GPU-8a9c1d2e-0011-2233-4455-66778899aabb").unwrap();
        assert_eq!(b[0], 0x8a);
        assert_eq!(b[15], 0xbb);
        assert!(uuid_bytes("GPU-8a9c").is_err());
        assert!(uuid_bytes("GPU-zz9c1d2e-0011-2233-4455-66778899aabb").is_err());
    }
}
