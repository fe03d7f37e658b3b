//! Tests of `image`.
use super::*;

/// An nvidia-smi that hangs is killed at the deadline and taken as not answering.
#[test]
fn a_hung_nvidia_smi_is_no_answer() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let smi = tmp.path().join("nvidia-smi");
    fs::write(&smi, "#!/bin/sh\nexec sleep 600\n").unwrap();
    fs::set_permissions(&smi, fs::Permissions::from_mode(0o755)).unwrap();
    let t = std::time::Instant::now();
    let got = smi::output_within(
        smi.to_str().unwrap(),
        &[],
        std::time::Duration::from_millis(200),
    );
    assert!(got.is_none());
    assert!(
        t.elapsed() < std::time::Duration::from_secs(60),
        "{:?}",
        t.elapsed()
    );
    let echo = smi::output_within(
        "/bin/echo",
        &["1, GPU-x, 5"],
        std::time::Duration::from_secs(60),
    );
    assert_eq!(echo.unwrap().stdout, b"1, GPU-x, 5\n");
}

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
    assert!(
        e.to_string()
            .starts_with("incomplete image: the checkpoint did not finish"),
        "{e}"
    );
    fs::write(empty.join(MANIFEST), [0xffu8, 0x00, 0x9c, 0x42, 0x17]).unwrap();
    let e = open_image(&empty).unwrap_err();
    assert!(matches!(e, ImageError::Unreadable { .. }), "{e:?}");
    assert!(e
        .to_string()
        .contains(&empty.join(MANIFEST).display().to_string()));
}

/// A description of a job in `dir`, its CRIU images there.
fn manifest(dir: &Path) -> Manifest {
    fs::create_dir_all(dir.join("criu")).unwrap();
    fs::write(dir.join("criu/inventory.img"), "x").unwrap();
    Manifest {
        possum_image: MANIFEST_VERSION,
        engine: Engine::Driver,
        runtime: GpuRuntime::Cuda,
        pid: 4242,
        shell_job: false,
        socket_dir: "/tmp/possum".into(),
        created: 0,
        criu_dir: Some("criu".into()),
        gpu_dir: None,
        gpu_memory: Vec::new(),
        cuda_children: Vec::new(),
        possum_children: Vec::new(),
        socket_dirs: Vec::new(),
        stdio_pipes: Vec::new(),
        keeper: None,
        held: Vec::new(),
        owner: None,
        tcp_established: None,
        figures: Value::Null,
        check: None,
    }
}

/// `open_image`'s verdict on `m` written with its check.
fn open_sealed(dir: &Path, m: &Manifest) -> Result<Image, ImageError> {
    fs::write(dir.join(MANIFEST), manifest_text(m).unwrap()).unwrap();
    open_image(dir)
}

/// Figures of every precision read back as written: the check of `possum.json` (of its text)
/// holds for a description whose figures carry floats of full precision, which a parser that
/// rounds some of them by a unit in the last place would break.
#[test]
fn figures_of_any_precision_keep_the_description_s_check() {
    let tmp = tempfile::tempdir().unwrap();
    let mut m = manifest(tmp.path());
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let values: Vec<f64> = (0..2000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Times in ms as a copy sums them: up to minutes, to the last bit.
            (x >> 11) as f64 / (1u64 << 53) as f64 * 1e5
        })
        .collect();
    m.figures = serde_json::json!({ "pipeline": { "sink_ms": values } });
    let back = open_sealed(tmp.path(), &m).unwrap().manifest;
    assert_eq!(back.figures, m.figures);
}

/// An image a migration received and never synced (its mark still there) is refused, saying
/// why and what to do; the migration's own restore of it, before it syncs it, opens it.
#[test]
fn an_image_received_and_never_synced_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let m = manifest(tmp.path());
    open_sealed(tmp.path(), &m).unwrap();
    fs::write(tmp.path().join(crate::wire::UNSYNCED), b"").unwrap();
    let e = open_image(tmp.path()).unwrap_err();
    assert!(matches!(e, ImageError::Unsynced { .. }), "{e:?}");
    assert!(e.to_string().contains("never synced"), "{e}");
    assert!(e.to_string().contains("remove that file"), "{e}");
    open_received_image(tmp.path()).unwrap();
}

#[test]
fn dumped_tcp_connections_and_their_lock_are_recorded_and_read_back() {
    let tmp = tempfile::tempdir().unwrap();
    let mut m = manifest(tmp.path());
    // Not asked: the key is absent, as in images written before it existed.
    let text = manifest_text(&m).unwrap();
    assert!(!text.contains("tcp_established"), "{text}");
    assert_eq!(
        open_sealed(tmp.path(), &m)
            .unwrap()
            .manifest
            .tcp_established,
        None
    );
    for lock in [
        NetworkLock::Skip,
        NetworkLock::Iptables,
        NetworkLock::Nftables,
    ] {
        m.tcp_established = Some(lock);
        let v: Value = serde_json::from_str(&manifest_text(&m).unwrap()).unwrap();
        assert_eq!(v["tcp_established"], serde_json::to_value(lock).unwrap());
        let img = open_sealed(tmp.path(), &m).unwrap();
        assert_eq!(img.manifest.tcp_established, Some(lock));
    }
    assert_eq!(
        possum_criu::NetworkLockMethod::from(NetworkLock::Skip),
        possum_criu::NetworkLockMethod::Skip
    );
}

/// A root whose GPU directory holds no image: refused for a single process (its images
/// are gone), accepted at the head of a tree of possum processes (a launcher such as
/// torchrun's agent, which holds no buffer while its ranks do).
#[test]
fn an_empty_root_gpu_directory_is_refused_alone_and_accepted_above_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let mut m = manifest(tmp.path());
    m.engine = Engine::Possum;
    m.gpu_dir = Some("gpu".into());
    fs::create_dir_all(tmp.path().join("gpu")).unwrap();
    match open_sealed(tmp.path(), &m) {
        Err(e @ ImageError::NoGpuImage { .. }) => {
            assert!(e.to_string().contains("no GPU image"), "{e}")
        }
        other => panic!("a single process without its GPU images: {other:?}"),
    }
    m.possum_children = vec![4343];
    fs::create_dir_all(tmp.path().join(child_gpu_dir(4343))).unwrap();
    let img = open_sealed(tmp.path(), &m).unwrap();
    assert!(img.gpu_images().is_empty());
}

#[test]
fn a_hip_job_s_runtime_is_recorded_and_read_back() {
    let tmp = tempfile::tempdir().unwrap();
    let mut m = manifest(tmp.path());
    // A CUDA job's: the key is absent, as in images written before it existed, and reads
    // as CUDA; written out, it reads as CUDA too.
    let text = manifest_text(&m).unwrap();
    assert!(!text.contains("runtime"), "{text}");
    let img = open_sealed(tmp.path(), &m).unwrap();
    assert_eq!(img.manifest.runtime, GpuRuntime::Cuda);
    assert!(img.manifest.runtime.has_nvidia_driver());
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v["runtime"] = "cuda".into();
    let read: Manifest = serde_json::from_value(v).unwrap();
    assert_eq!(read.runtime, GpuRuntime::Cuda);

    m.runtime = GpuRuntime::Hip;
    let text = manifest_text(&m).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["runtime"], "hip", "{text}");
    assert_eq!(v["possum_image"], MANIFEST_VERSION);
    let img = open_sealed(tmp.path(), &m).unwrap();
    assert_eq!(img.manifest.runtime, GpuRuntime::Hip);
    assert!(!img.manifest.runtime.has_nvidia_driver());

    // A reader that does not know the field (or an edit that drops it, to have the image
    // restored as CUDA's) finds the check wrong.
    let mut dropped = v.clone();
    dropped.as_object_mut().unwrap().remove("runtime");
    fs::write(tmp.path().join(MANIFEST), dropped.to_string()).unwrap();
    let e = open_image(tmp.path()).unwrap_err();
    assert!(matches!(e, ImageError::CheckMismatch { .. }), "{e:?}");
}

#[test]
fn a_runtime_possum_does_not_know_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let m = manifest(tmp.path());
    let mut v: Value = serde_json::from_str(&manifest_text(&m).unwrap()).unwrap();
    for wrong in [
        serde_json::json!("rocm"),
        serde_json::json!("HIP"),
        serde_json::json!(1),
        serde_json::json!(null),
    ] {
        v["runtime"] = wrong.clone();
        fs::write(tmp.path().join(MANIFEST), v.to_string()).unwrap();
        let e = open_image(tmp.path()).unwrap_err();
        assert!(matches!(e, ImageError::Unreadable { .. }), "{wrong}: {e:?}");
        let chain = format!("{:#}", anyhow::Error::from(e));
        assert!(
            chain.contains("not a possum image's description"),
            "{chain}"
        );
        if wrong.is_string() {
            assert!(
                chain.contains(&format!("unknown variant `{}`", wrong.as_str().unwrap()))
                    && chain.contains("`cuda`")
                    && chain.contains("`hip`"),
                "{chain}"
            );
        }
    }
}

#[test]
fn a_hip_job_s_image_naming_nvidia_driver_state_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut m = manifest(tmp.path());
    m.runtime = GpuRuntime::Hip;
    m.cuda_children = vec![4343];
    let e = open_sealed(tmp.path(), &m).unwrap_err().to_string();
    assert!(
        e.contains("cuda_children is set, but the image is of a HIP job"),
        "{e}"
    );
    m.cuda_children.clear();
    m.gpu_memory = vec![GpuUse {
        uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
        mib: 1,
    }];
    let e = open_sealed(tmp.path(), &m).unwrap_err().to_string();
    assert!(e.contains("gpu_memory is set"), "{e}");
    // The same lists in a CUDA job's image are its own.
    m.runtime = GpuRuntime::Cuda;
    open_sealed(tmp.path(), &m).unwrap();
}

#[test]
fn a_description_without_its_check_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let m = manifest(tmp.path());
    open_sealed(tmp.path(), &m).unwrap();
    fs::write(
        tmp.path().join(MANIFEST),
        serde_json::to_string(&m).unwrap(),
    )
    .unwrap();
    let e = open_image(tmp.path()).unwrap_err();
    assert!(matches!(e, ImageError::NoCheck { .. }), "{e:?}");
    assert!(e.to_string().contains("has no check"), "{e}");
}

#[test]
fn pids_that_are_not_a_single_process_of_a_job_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let me = std::process::id() as i32;
    let parent = nix::unistd::getppid().as_raw();
    for pid in [-1, 0, 1, me, parent, i32::MIN] {
        let mut m = manifest(tmp.path());
        m.pid = pid;
        let e = open_sealed(tmp.path(), &m).unwrap_err();
        assert!(
            matches!(
                e,
                ImageError::Invalid {
                    why: InvalidManifest::Pid { .. } | InvalidManifest::OwnPid { .. },
                    ..
                }
            ),
            "{pid}: {e:?}"
        );
        let mut m = manifest(tmp.path());
        m.cuda_children = vec![77, pid];
        assert!(open_sealed(tmp.path(), &m).is_err(), "child {pid}");
        let mut m = manifest(tmp.path());
        m.possum_children = vec![pid];
        assert!(open_sealed(tmp.path(), &m).is_err(), "possum child {pid}");
    }
}

#[test]
fn paths_that_leave_the_image_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img");
    let outside = tmp.path().join("outside");
    fs::create_dir_all(outside.join("criu")).unwrap();
    fs::write(outside.join("criu/inventory.img"), "x").unwrap();
    let refused = |criu: &str, gpu: Option<&str>| {
        let mut m = manifest(&img);
        m.criu_dir = Some(criu.into());
        m.gpu_dir = gpu.map(Into::into);
        open_sealed(&img, &m).unwrap_err().to_string()
    };
    let e = refused(&outside.join("criu").display().to_string(), None);
    assert!(e.contains("must be relative"), "{e}");
    let e = refused("../outside/criu", None);
    assert!(e.contains("without `..`"), "{e}");
    let e = refused("criu", Some("/etc"));
    assert!(
        e.contains("gpu_dir") && e.contains("must be relative"),
        "{e}"
    );
    std::os::unix::fs::symlink(outside.join("criu"), img.join("link")).unwrap();
    let e = refused("link", None);
    assert!(e.contains("leads outside the image"), "{e}");
    // A device image inside a GPU directory that is a link out.
    fs::create_dir_all(img.join("gpu")).unwrap();
    std::os::unix::fs::symlink(&outside, img.join("gpu/gpu-0")).unwrap();
    let e = refused("criu", Some("gpu"));
    assert!(e.contains("gpu_dir/gpu-0") && e.contains("outside"), "{e}");
    // Host directories: absolute and normalized.
    let mut m = manifest(&img);
    m.socket_dirs = vec!["/tmp/../etc".into()];
    let e = open_sealed(&img, &m).unwrap_err().to_string();
    assert!(e.contains("socket_dirs"), "{e}");
    let mut m = manifest(&img);
    m.keeper = Some(KeeperOfJob {
        dir: "relative/k".into(),
        cuda_visible_devices: None,
    });
    assert!(open_sealed(&img, &m).is_err());
}

#[test]
fn lists_and_sizes_are_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let mut m = manifest(tmp.path());
    m.cuda_children = (2..2 + MAX_PROCESSES as i32 + 1).collect();
    let e = open_sealed(tmp.path(), &m).unwrap_err().to_string();
    assert!(e.contains("cuda_children has 4097 entries"), "{e}");
    let mut m = manifest(tmp.path());
    m.gpu_memory = vec![GpuUse {
        uuid: "GPU-x".into(),
        mib: u64::MAX,
    }];
    let e = open_sealed(tmp.path(), &m).unwrap_err().to_string();
    assert!(e.contains("gpu_memory.mib is too large"), "{e}");
    let mut m = manifest(tmp.path());
    m.stdio_pipes = vec![(9, "pipe:[1]".into())];
    assert!(open_sealed(tmp.path(), &m).is_err());
    // A description larger than any possum writes is not even parsed.
    let f = fs::File::create(tmp.path().join(MANIFEST)).unwrap();
    f.set_len(MAX_MANIFEST_BYTES + 1).unwrap();
    let e = open_image(tmp.path()).unwrap_err();
    assert!(matches!(e, ImageError::TooLarge { .. }), "{e:?}");
}

#[test]
fn gpu_uuids_are_parsed() {
    let b = uuid_bytes("GPU-8a9c1d2e-0011-2233-4455-66778899aabb").unwrap();
    assert_eq!(b[0], 0x8a);
    assert_eq!(b[15], 0xbb);
    assert!(uuid_bytes("GPU-8a9c").is_err());
    assert!(uuid_bytes("GPU-zz9c1d2e-0011-2233-4455-66778899aabb").is_err());
}
