//! `possum restore` of an image that was edited or comes from another host: `possum.json` is
//! untrusted input. Every image here is sealed with a valid check (as an attacker who rewrites
//! `possum.json` can do), so what refuses it is the validation of what it says, before the
//! restore acts on anything: PIDs that are no single process of a job, paths that leave the
//! image, host paths outside possum's places, files where a stale socket was.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

#[path = "support/cli.rs"]
#[allow(dead_code)]
mod cli;
use cli::{free_pid, sealed, text};

fn possum() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_possum"));
    // Nothing here gets as far as CRIU; should it, it finds none.
    c.env("POSSUM_CRIU", "/nonexistent/criu")
        .env("POSSUM_NVIDIA_SMI", "/nonexistent/nvidia-smi");
    c
}

/// An image directory `img` with CRIU's part, and the description of a job `pid` (engine
/// driver) whose control sockets were in `socket_dir`.
fn image(img: &Path, pid: i64, socket_dir: &Path) -> Value {
    std::fs::create_dir_all(img.join("criu")).unwrap();
    std::fs::write(img.join("criu/inventory.img"), "x").unwrap();
    json!({"possum_image": 1, "engine": "driver", "pid": pid, "shell_job": false,
           "socket_dir": socket_dir, "created": 0, "criu_dir": "criu", "gpu_dir": null,
           "figures": null})
}

/// [`image`] of engine possum: with a GPU image of one buffer in `img/gpu/gpu-0`.
fn possum_image(img: &Path, pid: i64, socket_dir: &Path) -> Value {
    let mut m = image(img, pid, socket_dir);
    cli::one_buffer_gpu_image(&img.join("gpu/gpu-0"), 4096);
    m["engine"] = json!("possum");
    m["gpu_dir"] = json!("gpu");
    m
}

/// `possum restore -D img` of the description `m` (sealed), with `env` added: its output, which
/// must be a refusal (exit status 2).
fn refused(img: &Path, m: &Value, env: &[(&str, &Path)]) -> String {
    std::fs::write(img.join("possum.json"), sealed(m)).unwrap();
    let mut c = possum();
    c.args(["restore", "-D"]).arg(img);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    text(&out)
}

/// Set in the copy of this test run inside a PID namespace of its own.
const IN_NAMESPACE: &str = "POSSUM_TEST_IN_PID_NAMESPACE";

/// An image whose PID is -1 (every process), 0 (the process group), 1 (init), this test's
/// (possum's parent) or another live process's is refused before any signal: run inside a PID
/// namespace of its own (`unshare --pid --fork --mount-proc`), so that a possum that did signal
/// such a PID could reach nothing outside it, with a bystander process that must survive.
#[test]
fn pids_of_no_single_job_process_are_refused_before_any_signal() {
    if std::env::var_os(IN_NAMESPACE).is_some() {
        return in_namespace();
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: a PID namespace needs root");
        return;
    }
    let out = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "pids_of_no_single_job_process_are_refused_before_any_signal",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(IN_NAMESPACE, "1")
        .output()
        .unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("in the namespace: 7 images refused"), "{t}");
}

/// The test proper, inside the PID namespace.
fn in_namespace() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img");
    let mut bystander = Command::new("sleep").arg("1000").spawn().unwrap();
    let b = bystander.id() as i64;
    let me = std::process::id() as i64;
    let mut n = 0;
    for pid in [-1, 0, 1, me, b] {
        let m = image(&img, pid, &tmp.path().join("sockets"));
        let t = refused(&img, &m, &[]);
        let why = if pid == b {
            format!("process {b} is running")
        } else if pid <= 1 {
            format!("pid is {pid}: a process of a job has a PID greater than 1")
        } else {
            format!("pid is {pid}: that is this possum process or its parent")
        };
        assert!(t.contains(&why), "{pid}: {t}");
        assert!(bystander.try_wait().unwrap().is_none(), "{pid}: {t}");
        n += 1;
    }
    // A child of the job's tree, the same.
    for (field, pid) in [("cuda_children", -1), ("possum_children", 1)] {
        let mut m = image(&img, free_pid() as i64, &tmp.path().join("sockets"));
        m[field] = json!([pid]);
        let t = refused(&img, &m, &[]);
        assert!(t.contains(&format!("{field} is {pid}")), "{t}");
        assert!(bystander.try_wait().unwrap().is_none());
        n += 1;
    }
    bystander.kill().unwrap();
    bystander.wait().unwrap();
    println!("in the namespace: {n} images refused");
}

/// An image whose PID is held by a process that ended and that its parent does not reap (CRIU
/// could not restore under it) is refused, naming that parent; one its parent reaps within a
/// moment is not refused for its PID.
#[test]
fn a_pid_held_by_an_unreaped_process_is_refused_naming_its_parent() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img");
    let me = std::process::id();
    for reaped_after in [None, Some(std::time::Duration::from_millis(300))] {
        let mut ended = Command::new("true").spawn().unwrap();
        let pid = ended.id();
        let zombie = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('Z'))
            })
        };
        let t = std::time::Instant::now();
        while !zombie() {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(30),
                "it did not end"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let m = image(&img, pid.into(), &tmp.path().join("sockets"));
        let reaper = reaped_after.map(|after| {
            std::thread::spawn(move || {
                std::thread::sleep(after);
                ended.wait().unwrap();
            })
        });
        let said = refused(&img, &m, &[]);
        match reaper {
            None => {
                assert!(
                    said.contains(&format!(
                        "process {pid} has ended, but its parent (process {me}) has not reaped it"
                    )),
                    "{said}"
                );
                let pid = nix::unistd::Pid::from_raw(pid as i32);
                nix::sys::wait::waitpid(pid, None).unwrap();
            }
            Some(r) => {
                r.join().unwrap();
                assert!(!said.contains(&format!("process {pid}")), "{said}");
            }
        }
    }
}

/// Paths of the image that are absolute, hold `..`, or lead out through a symbolic link are
/// refused, each by name.
#[test]
fn paths_that_leave_the_image_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img");
    let outside = tmp.path().join("outside");
    std::fs::create_dir_all(outside.join("criu")).unwrap();
    std::fs::write(outside.join("criu/inventory.img"), "x").unwrap();
    let pid = free_pid() as i64;
    let sockets = tmp.path().join("sockets");
    let with = |criu: &str, gpu: Option<&str>| {
        let mut m = image(&img, pid, &sockets);
        m["criu_dir"] = json!(criu);
        m["gpu_dir"] = json!(gpu);
        refused(&img, &m, &[])
    };
    let t = with(&outside.join("criu").display().to_string(), None);
    assert!(
        t.contains("is refused: criu_dir is") && t.contains("must be relative"),
        "{t}"
    );
    let t = with("../outside/criu", None);
    assert!(t.contains("criu_dir") && t.contains("without `..`"), "{t}");
    let t = with("criu", Some("/etc"));
    assert!(
        t.contains("gpu_dir") && t.contains("must be relative"),
        "{t}"
    );
    std::os::unix::fs::symlink(outside.join("criu"), img.join("elsewhere")).unwrap();
    let t = with("elsewhere", None);
    assert!(
        t.contains("criu_dir") && t.contains("leads outside the image"),
        "{t}"
    );
    // A child's GPU images that are a link out.
    std::os::unix::fs::symlink(&outside, img.join(format!("gpu-{}", pid + 1))).unwrap();
    let mut m = image(&img, pid, &sockets);
    m["possum_children"] = json!([pid + 1]);
    let t = refused(&img, &m, &[]);
    assert!(t.contains("leads outside the image"), "{t}");
}

/// A stale control socket's path that holds a regular file or a link, or a socket in a
/// directory that is not possum's, is neither removed nor followed: refused by name.
#[test]
fn only_a_stale_socket_in_possums_socket_directory_is_removed() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img");
    let pid = free_pid() as i64;
    let sockets = tmp.path().join("sockets");
    std::fs::create_dir(&sockets).unwrap();
    let m = possum_image(&img, pid, &sockets);
    let stale = sockets.join(format!("possum-{pid}.sock"));
    let env: &[(&str, &Path)] = &[("POSSUM_SOCKET_DIR", &sockets)];
    // A regular file where the socket was.
    std::fs::write(&stale, "precious").unwrap();
    let t = refused(&img, &m, env);
    assert!(
        t.contains(&format!("{} is a regular file", stale.display())),
        "{t}"
    );
    assert_eq!(std::fs::read_to_string(&stale).unwrap(), "precious");
    // A link to a file elsewhere.
    std::fs::remove_file(&stale).unwrap();
    let target = tmp.path().join("target");
    std::fs::write(&target, "elsewhere").unwrap();
    std::os::unix::fs::symlink(&target, &stale).unwrap();
    let t = refused(&img, &m, env);
    assert!(t.contains("is a symbolic link"), "{t}");
    assert!(std::fs::symlink_metadata(&stale).is_ok());
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "elsewhere");
    // A socket, but in a directory that is not possum's (the image's word is not enough).
    std::fs::remove_file(&stale).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let t = refused(&img, &m, &[]);
    assert!(t.contains("not possum's socket directory"), "{t}");
    assert!(std::fs::symlink_metadata(&stale).is_ok());
    // possum's socket directory reached through a link is not entered.
    let linked = tmp.path().join("linked");
    std::os::unix::fs::symlink(&sockets, &linked).unwrap();
    let mut m2 = m.clone();
    m2["socket_dir"] = json!(linked);
    let t = refused(&img, &m2, &[("POSSUM_SOCKET_DIR", &linked)]);
    assert!(t.contains("symbolic link or not a directory"), "{t}");
    assert!(std::fs::symlink_metadata(&stale).is_ok());
    // In possum's directory, a socket: accepted, and the restore goes on to CRIU (absent here),
    // which is checked before the socket is removed (sequence/src/places.rs tests the removal).
    let t = refused(&img, &m, env);
    assert!(t.contains("CRIU is needed"), "{t}");
    assert!(
        std::fs::symlink_metadata(&stale).is_ok(),
        "nothing done before the checks"
    );
}

/// Directories the image names are made only where possum's own may be (under its socket
/// directory, the keeper's, or a temporary directory), never through a link; the keeper's
/// directory likewise; CRIU's outputs in the image must not be links.
#[test]
fn directories_the_image_names_are_made_only_in_possums_places() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img");
    let pid = free_pid() as i64;
    let sockets = tmp.path().join("sockets");
    let base = image(&img, pid, &sockets);
    let nowhere = PathBuf::from(format!("/var/lib/possum-untrusted-test-{pid}/sockets"));
    let mut m = base.clone();
    m["socket_dirs"] = json!([nowhere]);
    let t = refused(&img, &m, &[]);
    assert!(
        t.contains("the directory of the job's sockets")
            && t.contains("makes directories an image names only under"),
        "{t}"
    );
    assert!(!nowhere.parent().unwrap().exists());
    // Under a temporary directory, through a link to elsewhere: not followed.
    let away = tmp.path().join("away");
    std::fs::create_dir(&away).unwrap();
    std::os::unix::fs::symlink(&away, tmp.path().join("link")).unwrap();
    let mut m = base.clone();
    m["socket_dirs"] = json!([tmp.path().join("link/new")]);
    let t = refused(&img, &m, &[("TMPDIR", tmp.path())]);
    assert!(t.contains("is a symbolic link or not a directory"), "{t}");
    assert!(!away.join("new").exists());
    // The keeper's directory.
    let mut m = base.clone();
    m["keeper"] = json!({"dir": format!("/etc/possum-untrusted-test-{pid}")});
    let t = refused(&img, &m, &[]);
    assert!(t.contains("the keeper's directory"), "{t}");
    // CRIU's statistics, a link out of the image: CRIU would write through it.
    let target = tmp.path().join("target");
    std::fs::write(&target, "precious").unwrap();
    std::os::unix::fs::symlink(&target, img.join("criu/stats-restore")).unwrap();
    let t = refused(&img, &base, &[]);
    assert!(t.contains("stats-restore is a symbolic link"), "{t}");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious");
}

/// `--hmac-key`: an image sealed under the key passes (the restore goes on, to CRIU, absent
/// here); one changed anywhere, one without `possum.hmac` and one sealed under another key are
/// refused before possum.json is even read.
#[test]
fn an_authenticated_image_is_refused_if_changed_or_sealed_with_another_key() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img");
    let m = possum_image(&img, free_pid() as i64, &tmp.path().join("sockets"));
    std::fs::write(img.join("possum.json"), sealed(&m)).unwrap();
    let key = tmp.path().join("key");
    std::fs::write(&key, [7u8; 32]).unwrap();
    let other = tmp.path().join("other-key");
    std::fs::write(&other, [8u8; 32]).unwrap();
    let restore = |k: &Path| {
        let out = possum()
            .args(["restore", "-D"])
            .arg(&img)
            .arg("--hmac-key")
            .arg(k)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        text(&out)
    };
    let t = restore(&key);
    assert!(t.contains("has no possum.hmac"), "{t}");
    let read = |p: &Path| possum_sequence::auth::HmacKey::read(p).unwrap();
    possum_sequence::auth::seal(&img, &read(&key)).unwrap();
    let t = restore(&key);
    assert!(t.contains("CRIU is needed"), "authenticated, then on: {t}");
    let t = restore(&other);
    assert!(t.contains("does not match its possum.hmac"), "{t}");
    // One byte of a GPU image's data changed (its own CRC would catch it only when read).
    let data = img.join("gpu/gpu-0/data-000.bin");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&data, &bytes).unwrap();
    let t = restore(&key);
    assert!(t.contains("does not match its possum.hmac"), "{t}");
    // A key that is too short is refused by name.
    std::fs::write(&other, "short").unwrap();
    let t = restore(&other);
    assert!(t.contains("holds 5 bytes"), "{t}");
}
