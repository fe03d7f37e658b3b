//! Whom the control channel trusts: the socket directory's rule (a real directory, private to
//! its user) and the credentials of each end (the client checks the process serving the socket,
//! the job's server the user connecting). Tests that need a second user run as root and are
//! skipped, saying so, otherwise.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use possum_control::{
    refused_connections, request, secure_dir, socket_path, ControlError, DirError, Request, Server,
};
use serde_json::json;

#[path = "support/socket_dir.rs"]
mod support;
use support::{chmod, private_dir, Sleeper};

const T: Duration = Duration::from_secs(10);
const NOBODY: u32 = 65534;

fn me() -> u32 {
    std::process::id()
}

fn root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn start(dir: &Path) -> Server {
    Server::start(dir, Arc::new(|_| json!({"pong": true}))).unwrap()
}

/// Runs `body` with a private directory when this process is root; otherwise says on stderr that
/// the test is skipped because it `needs` root.
fn as_root(needs: &str, body: impl FnOnce(&Path)) {
    if !root() {
        eprintln!("skipped: {needs}");
        return;
    }
    let (_tmp, dir) = private_dir();
    body(&dir);
}

/// The `DirError` inside a failed `Server::start`.
fn start_error(dir: &Path) -> (std::io::ErrorKind, String, bool) {
    let e = Server::start(dir, Arc::new(|_| json!({}))).unwrap_err();
    let typed = e
        .get_ref()
        .is_some_and(|inner| inner.downcast_ref::<DirError>().is_some());
    (e.kind(), e.to_string(), typed)
}

#[test]
fn a_socket_directory_that_is_a_symbolic_link_is_refused() {
    let (tmp, real) = private_dir();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();

    let (kind, text, typed) = start_error(&link);
    assert_eq!(kind, std::io::ErrorKind::PermissionDenied, "{text}");
    assert!(typed, "{text}");
    assert!(text.contains("is a symbolic link"), "{text}");
    assert!(std::fs::read_dir(&real).unwrap().next().is_none());

    // A job serving in the real directory is not asked through the link.
    let _server = start(&real);
    let e = request(me(), &link, &Request::Ping, T).unwrap_err();
    assert!(
        matches!(&e, ControlError::Dir(DirError::Symlink { path }) if path == &link),
        "{e:?}"
    );
    assert!(
        e.to_string().contains(&format!("rm {}", link.display())),
        "{e}"
    );
    assert!(request(me(), &real, &Request::Ping, T).is_ok());
}

#[test]
fn a_socket_directory_open_to_others_is_refused_by_the_client_and_tightened_by_its_owner() {
    let (_tmp, dir) = private_dir();
    let _server = start(&dir);
    for mode in [0o755, 0o777, 0o710] {
        chmod(&dir, mode);
        let e = request(me(), &dir, &Request::Ping, T).unwrap_err();
        assert!(
            matches!(&e, ControlError::Dir(DirError::Mode { mode: m, .. }) if *m == mode),
            "{mode:o}: {e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains(&format!("mode {mode:04o}"))
                && text.contains(&format!("chmod 700 {}", dir.display())),
            "{text}"
        );
    }
    // The check changes nothing.
    assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o710);

    // Its owner's server makes it private again, and serves there.
    let (_tmp2, wide) = private_dir();
    chmod(&wide, 0o777);
    let _s2 = start(&wide);
    assert_eq!(std::fs::metadata(&wide).unwrap().mode() & 0o777, 0o700);
    assert!(request(me(), &wide, &Request::Ping, T).is_ok());
}

#[test]
fn a_socket_directory_that_is_a_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("f");
    std::fs::write(&file, b"x").unwrap();
    let (kind, text, typed) = start_error(&file);
    assert_eq!(kind, std::io::ErrorKind::PermissionDenied, "{text}");
    assert!(typed && text.contains("is not a directory"), "{text}");
}

#[test]
fn a_socket_directory_of_another_user_is_refused() {
    as_root(
        "a socket directory of another user needs root to chown it",
        |dir| {
            let server = start(dir);
            std::os::unix::fs::chown(dir, Some(NOBODY), None).unwrap();

            // The client: the job (this process) is root's, the directory nobody's.
            let e = request(me(), dir, &Request::Ping, T).unwrap_err();
            assert!(
                matches!(&e, ControlError::Dir(DirError::Owner { owner, allowed, .. })
            if *owner == NOBODY && allowed == &vec![0]),
                "{e:?}"
            );
            let text = e.to_string();
            assert!(
                text.contains("belongs to uid 65534, not to uid 0")
                    && text.contains(&format!("rm -r {}", dir.display())),
                "{text}"
            );
            let direct = secure_dir(dir, &[0]).unwrap_err();
            assert!(matches!(direct, DirError::Owner { .. }), "{direct:?}");

            // The server: root's job does not serve in nobody's directory.
            drop(server);
            let (kind, text, typed) = start_error(dir);
            assert_eq!(kind, std::io::ErrorKind::PermissionDenied, "{text}");
            assert!(typed && text.contains("belongs to uid 65534"), "{text}");
            assert!(!socket_path(dir, me()).exists());

            // A directory of root is not one for a job of nobody either.
            assert!(matches!(
                secure_dir(dir.parent().unwrap(), &[NOBODY]),
                Err(DirError::Owner { owner: 0, .. })
            ));
        },
    );
}

#[test]
fn a_socket_served_by_another_process_is_refused() {
    let (_tmp, dir) = private_dir();
    let job = Sleeper::start();
    // This process listens at the path of the `sleep`'s socket, and would answer in its name.
    let path = socket_path(&dir, job.pid());
    let _squatter = UnixListener::bind(&path).unwrap();
    let e = request(job.pid(), &dir, &Request::Ping, T).unwrap_err();
    assert!(
        matches!(&e, ControlError::WrongProcess { pid, peer, path: p }
            if *pid == job.pid() && *peer == me() as i32 && p == &path),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        format!(
            "the socket at {} is served by process {}, not by {}: refused",
            path.display(),
            me(),
            job.pid()
        )
    );
    // `request_at` and `send_only` check the same.
    let e = possum_control::request_at(job.pid(), &path, &Request::Ping, T, None).unwrap_err();
    assert!(matches!(e, ControlError::WrongProcess { .. }), "{e:?}");
    let e = possum_control::send_only(job.pid(), &path, &Request::Ping, None).unwrap_err();
    assert!(matches!(e, ControlError::WrongProcess { .. }), "{e:?}");
}

#[test]
fn the_server_thread_of_the_job_is_the_job() {
    // The topology of a real job: the socket is served by a thread of the process asked.
    let (_tmp, dir) = private_dir();
    let server = std::thread::spawn({
        let dir = dir.clone();
        move || start(&dir)
    })
    .join()
    .unwrap();
    assert_eq!(
        request(me(), &dir, &Request::Ping, T).unwrap(),
        json!({"pong": true, "protocol": possum_control::PROTOCOL})
    );
    drop(server);
}

/// `python3 -c SCRIPT ARGS...`, its stdout piped, run as `uid` when given.
fn python(script: &str, args: &[&std::ffi::OsStr], uid: Option<u32>) -> Child {
    let mut c = Command::new("python3");
    c.arg("-c").arg(script).args(args).stdout(Stdio::piped());
    if let Some(uid) = uid {
        c.uid(uid).gid(uid);
    }
    c.spawn().expect("python3")
}

#[test]
fn a_socket_served_as_another_user_than_the_jobs_is_refused() {
    as_root(
        "a listener of another user than its process's needs root",
        |dir| {
            // A root process that listened (`SO_PEERCRED` is taken at `listen`) as uid 65534, then
            // went back to root.
            let script = "import os, socket, sys, time\n\
                  s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n\
                  s.bind(os.path.join(sys.argv[1], 'possum-%d.sock' % os.getpid()))\n\
                  os.seteuid(65534)\n\
                  s.listen(4)\n\
                  os.seteuid(0)\n\
                  print('ready', flush=True)\n\
                  time.sleep(60)\n";
            let mut child = python(script, &[dir.as_os_str()], None);
            let mut ready = String::new();
            BufReader::new(child.stdout.as_mut().unwrap())
                .read_line(&mut ready)
                .unwrap();
            let pid = child.id();
            let e = request(pid, dir, &Request::Ping, T).unwrap_err();
            let _ = child.kill();
            let _ = child.wait();
            assert_eq!(ready.trim(), "ready");
            assert!(
                matches!(&e, ControlError::WrongUser { pid: p, peer_uid: NOBODY, job_uid: 0, .. } if *p == pid),
                "{e:?}"
            );
            assert!(
                e.to_string()
                    .contains("is served as uid 65534, but process"),
                "{e}"
            );
        },
    );
}

#[test]
fn the_server_refuses_a_client_of_another_user() {
    as_root("a client of another user needs root to setuid", |dir| {
        let server = start(dir);
        // Only for this test: let the other user reach the socket, to see the server refuse it.
        chmod(dir, 0o711);
        chmod(server.path(), 0o777);
        let before = refused_connections();
        let script = "import socket, sys\n\
                  s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n\
                  s.connect(sys.argv[1])\n\
                  s.sendall(b'{\"cmd\":\"ping\"}\\n')\n\
                  sys.stdout.write(s.makefile().readline())\n";
        let mut child = python(script, &[server.path().as_os_str()], Some(NOBODY));
        let mut reply = String::new();
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut reply)
            .unwrap();
        assert!(child.wait().unwrap().success(), "{reply}");
        let v: serde_json::Value =
            serde_json::from_str(&reply).unwrap_or_else(|e| panic!("{e}: {reply:?}"));
        assert_eq!(
            v,
            json!({
                "error": "refused: this job answers only uid 0 and root, not uid 65534",
                "protocol": possum_control::PROTOCOL
            })
        );
        assert!(refused_connections() > before);
        // Its own user (root) is answered.
        chmod(dir, 0o700);
        assert_eq!(
            request(me(), dir, &Request::Ping, T).unwrap(),
            json!({"pong": true, "protocol": possum_control::PROTOCOL})
        );
    });
}
