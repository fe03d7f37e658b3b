//! `possum checkpoint` of a HIP (AMD GPU) job that possum does not serve (no possum loaded, or
//! `--engine driver`) is refused before anything is done, saying what does checkpoint it; a
//! process with both CUDA's and HIP's libraries loaded is named as mixing both. The job is a
//! process mapping files of those names, as the dynamic loader maps the libraries.

use std::path::Path;
use std::process::Command;

#[path = "../../control/tests/support/mapper.rs"]
#[allow(dead_code)]
mod mapper;
use mapper::Mapper;

/// A process that maps each of `libs` (files of those names in `dir`) and sleeps.
fn mapping(dir: &Path, libs: &[&str]) -> Mapper {
    let files: Vec<_> = libs.iter().map(|l| dir.join(l)).collect();
    Mapper::start(&files).expect("python3")
}

/// Runs `possum checkpoint` of `job` into `img` (with `extra` arguments); returns its exit code
/// and output.
fn checkpoint(job: &Mapper, img: &Path, sockets: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_possum"))
        .args(["checkpoint", &job.pid().to_string(), "-D"])
        .arg(img)
        .args(extra)
        .arg("--socket-dir")
        .arg(sockets)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

fn refused(libs: &[&str], extra: &[&str]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let mut job = mapping(tmp.path(), libs);
    let img = tmp.path().join("img");
    let (code, text) = checkpoint(&job, &img, tmp.path(), extra);
    let exited = job.exited();
    drop(job);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        exited.is_none(),
        "the job was left running: {exited:?}; {text}"
    );
    assert!(!img.exists(), "no image: {text}");
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !libs.contains(&n.as_str()))
        .collect();
    assert!(left.is_empty(), "nothing written: {left:?}");
    assert!(text.contains("nothing was done"), "{text}");
    text
}

#[test]
fn a_hip_job_without_possum_is_refused_with_what_checkpoints_it() {
    let text = refused(&["libamdhip64.so.6"], &[]);
    assert!(
        text.contains("is a HIP (AMD GPU) job")
            && text.contains("without possum loaded")
            && text.contains("CRIU's amdgpu plugin")
            && text.contains("criu dump --tree "),
        "{text}"
    );
    assert!(!text.contains("mixes"), "{text}");
}

#[test]
fn a_hip_job_is_refused_with_the_drivers_engine() {
    let text = refused(&["libamdhip64.so.6"], &["--engine", "driver"]);
    assert!(
        text.contains("is a HIP (AMD GPU) job")
            && text.contains("--engine driver is NVIDIA's driver checkpoint")
            && text.contains("CRIU's amdgpu plugin"),
        "{text}"
    );
}

#[test]
fn a_process_with_cuda_and_hip_is_refused_as_mixing_both() {
    for extra in [&[][..], &["--gpu-only"], &["--engine", "driver"]] {
        let text = refused(&["libcuda.so.1", "libamdhip64.so.6"], extra);
        assert!(
            text.contains("mixes CUDA and HIP")
                && text.contains("libcuda")
                && text.contains("libamdhip64"),
            "{extra:?}: {text}"
        );
    }
}

#[test]
fn a_process_with_libcuda_alone_is_not_refused_as_hip() {
    let tmp = tempfile::tempdir().unwrap();
    let job = mapping(tmp.path(), &["libcuda.so.1"]);
    let (code, text) = checkpoint(&job, &tmp.path().join("img"), tmp.path(), &[]);
    drop(job);
    // Refused for another reason (it has no possum loaded), not as a HIP job.
    assert_eq!(code, Some(2), "{text}");
    assert!(!text.contains("HIP"), "{text}");
}
