//! A server in this process with a dummy handler, and the client against it.

#[path = "support/mapper.rs"]
#[allow(dead_code)]
mod mapper;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use possum_control::{
    remove_socket_of_this_process, request, socket_path, ControlError, Request, Server,
};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(10);

fn me() -> u32 {
    std::process::id()
}

fn dummy(req: Request) -> Value {
    match req {
        Request::Ping => json!({"pong": true}),
        Request::Status => json!({"phase": "idle", "buffers": 3}),
        Request::Trace => panic!("dummy handler: no trace"),
        Request::Checkpoint { dir, .. } => json!({ "dir": dir }),
        // Every other request asks for a job to act on; the dummy has none.
        _ => json!({"error": "nothing to release"}),
    }
}

fn start(dir: &Path) -> Server {
    Server::start(dir, Arc::new(dummy)).unwrap()
}

/// Sends raw bytes and returns the reply line as JSON.
fn raw(path: &Path, bytes: &[u8]) -> Value {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    // The server may stop reading before the end of an oversized request.
    let _ = s.write_all(bytes);
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
}

#[test]
fn ping_and_status_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sock");
    let server = start(&dir);
    assert_eq!(server.path(), socket_path(&dir, me()));
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
    assert_eq!(mode & 0o077, 0, "{mode:o}");
    assert_eq!(
        request(me(), &dir, &Request::Ping, T).unwrap(),
        json!({"pong": true, "protocol": possum_control::PROTOCOL})
    );
    let st = request(me(), &dir, &Request::Status, T).unwrap();
    assert_eq!(st["phase"], "idle");
    assert_eq!(st["buffers"], 3);
    let ck = Request::Checkpoint {
        dir: "/x/y".into(),
        parent: None,
    };
    assert_eq!(request(me(), &dir, &ck, T).unwrap()["dir"], "/x/y");
    assert!(matches!(
        request(me(), &dir, &Request::Release, T),
        Err(ControlError::Remote(m)) if m == "nothing to release"
    ));
}

#[test]
fn unknown_command_and_garbage_get_error_replies() {
    let tmp = tempfile::tempdir().unwrap();
    let server = start(tmp.path());
    let r = raw(server.path(), b"{\"cmd\":\"frobnicate\"}\n");
    let msg = r["error"].as_str().unwrap();
    assert!(msg.contains("unknown variant `frobnicate`"), "{msg}");
    let r = raw(server.path(), b"not json\n");
    assert!(
        r["error"].as_str().unwrap().starts_with("bad request"),
        "{r}"
    );
    // A request without its newline, then end of stream, is still read.
    let mut s = UnixStream::connect(server.path()).unwrap();
    s.write_all(b"{\"cmd\":\"ping\"}").unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    assert_eq!(line, "{\"pong\":true,\"protocol\":1}\n");
}

#[test]
fn oversized_request_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let server = start(tmp.path());
    let mut big = vec![b' '; 70 * 1024];
    big.extend_from_slice(b"{\"cmd\":\"ping\"}\n");
    let r = raw(server.path(), &big);
    assert!(
        r["error"].as_str().unwrap().contains("longer than 65536"),
        "{r}"
    );
    // Exactly at the limit is fine.
    let mut ok = vec![b' '; 64 * 1024 - 14];
    ok.extend_from_slice(b"{\"cmd\":\"ping\"}\n");
    assert_eq!(ok.len(), 64 * 1024 + 1);
    assert_eq!(
        raw(server.path(), &ok),
        json!({"pong": true, "protocol": possum_control::PROTOCOL})
    );
    assert!(request(me(), tmp.path(), &Request::Ping, T).is_ok());
}

#[test]
fn handler_panic_is_an_error_reply_and_the_server_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let _server = start(tmp.path());
    match request(me(), tmp.path(), &Request::Trace, T) {
        Err(ControlError::Remote(m)) => assert_eq!(m, "internal: handler panicked"),
        other => panic!("{other:?}"),
    }
    assert!(request(me(), tmp.path(), &Request::Ping, T).is_ok());
}

#[test]
fn stale_socket_is_reported_then_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    // A socket directory is private to its user (as the server makes it).
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let path = socket_path(tmp.path(), me());
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let e = request(me(), tmp.path(), &Request::Ping, T).unwrap_err();
    assert!(matches!(e, ControlError::Stale { .. }), "{e:?}");
    assert!(e.to_string().contains("stale"), "{e}");
    let _server = start(tmp.path());
    assert!(request(me(), tmp.path(), &Request::Ping, T).is_ok());
}

#[test]
fn a_live_socket_is_not_taken_over() {
    let tmp = tempfile::tempdir().unwrap();
    let _first = start(tmp.path());
    let e = Server::start(tmp.path(), Arc::new(dummy)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{e}");
    assert!(request(me(), tmp.path(), &Request::Ping, T).is_ok());
}

#[test]
fn shutdown_removes_the_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let mut server = start(tmp.path());
    let path = server.path().to_path_buf();
    server.shutdown();
    assert!(!path.exists());
    let e = request(me(), tmp.path(), &Request::Ping, T).unwrap_err();
    assert!(matches!(e, ControlError::NotLoaded { .. }), "{e:?}");
    drop(server);

    let server = start(tmp.path());
    let path = server.path().to_path_buf();
    std::mem::forget(server);
    remove_socket_of_this_process(tmp.path()).unwrap();
    assert!(!path.exists());
    remove_socket_of_this_process(tmp.path()).unwrap();
}

#[test]
fn not_loaded_names_the_socket_and_the_remedy() {
    let tmp = tempfile::tempdir().unwrap();
    let e = request(me(), tmp.path(), &Request::Ping, T).unwrap_err();
    assert!(
        matches!(e, ControlError::NotLoaded { pid, .. } if pid == me()),
        "{e:?}"
    );
    let want = format!(
        "process {} does not have possum loaded: no control socket at {}; start the job with `possum run JOB` or LD_PRELOAD=/path/to/libpossum.so (its socket appears at its first CUDA call)",
        me(),
        socket_path(tmp.path(), me()).display()
    );
    assert_eq!(e.to_string(), want);
}

#[test]
fn dead_pid_is_no_process() {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let e = request(pid, tmp.path(), &Request::Ping, T).unwrap_err();
    assert!(matches!(e, ControlError::NoProcess(p) if p == pid), "{e:?}");
    assert_eq!(e.to_string(), format!("no process with pid {pid}"));
}

#[test]
fn slow_handler_times_out() {
    let tmp = tempfile::tempdir().unwrap();
    let _server = Server::start(
        tmp.path(),
        Arc::new(|_| {
            std::thread::sleep(Duration::from_millis(1500));
            json!({})
        }),
    )
    .unwrap();
    let e = request(me(), tmp.path(), &Request::Ping, Duration::from_millis(200)).unwrap_err();
    assert!(matches!(e, ControlError::Timeout { .. }), "{e:?}");
}

/// A directory passed with a request (SCM_RIGHTS) is where its `dir` lies: the handler gets
/// `/proc/self/fd/N/<dir>`, usable as a path (a job writes its GPU images there even when the
/// directory's own path does not exist for it), and it stays open after the answer.
#[test]
fn a_directory_passed_with_a_request_is_where_its_dir_lies() {
    use std::os::fd::AsFd;
    let tmp = tempfile::tempdir().unwrap();
    let sock = tmp.path().join("sock");
    let images = tmp.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let handler = |req: Request| match req {
        // Only under a passed directory: a relative `dir` would land in the test's cwd.
        Request::Checkpoint { dir, .. } | Request::Resume { dir: Some(dir) }
            if dir.starts_with("/proc/self/fd/") =>
        {
            let made = std::fs::create_dir_all(&dir)
                .and_then(|()| std::fs::write(format!("{dir}/written"), b"x"));
            json!({"dir": dir, "made": made.is_ok()})
        }
        Request::Checkpoint { dir, .. } => json!({ "dir": dir }),
        _ => json!({}),
    };
    let _server = Server::start(&sock, Arc::new(handler)).unwrap();
    let dirfd = std::fs::File::open(&images).unwrap();
    let path = socket_path(&sock, me());
    let req = Request::Checkpoint {
        dir: "possum-gpu-7".into(),
        parent: None,
    };
    let v = possum_control::request_at(me(), &path, &req, T, Some(dirfd.as_fd())).unwrap();
    let dir = v["dir"].as_str().unwrap();
    assert!(
        dir.starts_with("/proc/self/fd/") && dir.ends_with("/possum-gpu-7"),
        "{v}"
    );
    assert_eq!(v["made"], true, "{v}");
    assert!(images.join("possum-gpu-7/written").is_file());
    // Still open after the answer (the job reads its images back later).
    drop(dirfd);
    assert!(std::path::Path::new(dir).join("written").is_file());
    // Without one, the request is as sent.
    let v = request(me(), &sock, &req, T).unwrap();
    assert_eq!(v["dir"], "possum-gpu-7", "{v}");
    // send_only passes one too.
    possum_control::send_only(
        me(),
        &path,
        &Request::Resume {
            dir: Some("again".into()),
        },
        Some(std::fs::File::open(&images).unwrap().as_fd()),
    )
    .unwrap();
    let t = std::time::Instant::now();
    while !images.join("again/written").is_file() {
        assert!(
            t.elapsed() < T,
            "the resume sent without waiting never came"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A process with libpossum.so mapped but no control socket (it has not used CUDA yet) is told
/// apart from one without possum: the error says so, and what to do.
#[test]
fn a_process_with_possum_but_no_socket_is_not_started() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = tmp.path().join(possum_control::LIBRARY_FILE);
    // A process that maps a file of that name, as the dynamic loader maps the preloaded library,
    // and another whose name is not UTF-8 (the maps are not text).
    let child =
        mapper::Mapper::start(&[lib.clone(), mapper::not_utf8(tmp.path())]).expect("python3");
    let pid = child.pid();
    let e = request(pid, tmp.path(), &Request::Ping, T).unwrap_err();
    // Its file removed since (the kernel's maps say "(deleted)"): still mapped.
    std::fs::remove_file(&lib).unwrap();
    assert!(possum_control::has_possum_mapped(pid));
    drop(child);
    assert!(
        matches!(e, ControlError::NotStarted { pid: p, .. } if p == pid),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(
        text.contains("runs with possum but has not used the GPU yet")
            && text.contains("first CUDA call"),
        "{text}"
    );
    // This test process has no libpossum.so: not loaded, as before.
    assert!(!possum_control::has_possum_mapped(me()));
}

/// A job whose process name is not UTF-8 (the kernel cuts names at 15 bytes, which can split a
/// character): it is found for what it is, its owner read, never taken for a process that is
/// gone.
#[test]
fn a_process_whose_name_is_not_utf8_is_found() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = tmp.path().join(possum_control::LIBRARY_FILE);
    let Some(child) = mapper::Mapper::start_named(&[lib], b"job \xe6\x97") else {
        eprintln!("SKIPPED: no python3 for the job");
        return;
    };
    let pid = child.pid();
    let stat = std::fs::read(format!("/proc/{pid}/stat")).unwrap();
    assert!(
        String::from_utf8(stat).is_err(),
        "the name was not set: the test shows nothing"
    );
    assert_eq!(
        possum_control::process_uid(pid).unwrap(),
        nix::unistd::geteuid().as_raw()
    );
    let e = request(pid, tmp.path(), &Request::Ping, T).unwrap_err();
    assert!(
        matches!(e, ControlError::NotStarted { pid: p, .. } if p == pid),
        "{e:?}"
    );
}
