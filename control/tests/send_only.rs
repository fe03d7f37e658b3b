//! `send_only`: a request sent without waiting for the reply (how possum's CRIU plugin resumes a
//! job that CRIU still holds stopped) reaches the job, and the job's server survives writing its
//! reply to a closed connection even where SIGPIPE is not ignored (a C program's default).
//! Its own test binary: it sets SIGPIPE back to its default action for the whole process.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use possum_control::{request, send_only, socket_path, Request, Server};
use serde_json::{json, Value};

#[test]
fn a_request_sent_without_waiting_is_answered_into_the_void_and_the_server_goes_on() {
    // SAFETY: restoring the default action of SIGPIPE installs no handler; it is what a C job
    // has. Were the server's write to the closed connection to raise SIGPIPE (std's UnixStream
    // sends with MSG_NOSIGNAL today), this test process would be killed and the test would fail.
    unsafe {
        nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGPIPE,
            nix::sys::signal::SigHandler::SigDfl,
        )
    }
    .unwrap();
    let seen: Arc<Mutex<Vec<Request>>> = Arc::default();
    let handler = {
        let seen = Arc::clone(&seen);
        move |req: Request| -> Value {
            // Slow enough that the sender has closed its end before the reply is written.
            std::thread::sleep(Duration::from_millis(100));
            seen.lock().unwrap().push(req);
            json!({"big": "x".repeat(1 << 20)})
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sock");
    let _server = Server::start(&dir, Arc::new(handler)).unwrap();
    let me = std::process::id();
    let resume = Request::Resume {
        dir: Some("/images/possum-gpu-1".into()),
    };
    send_only(me, &socket_path(&dir, me), &resume, None).unwrap();
    let t = Instant::now();
    while seen.lock().unwrap().is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the request never arrived"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(seen.lock().unwrap()[0], resume);
    // The server answers the next client.
    let v = request(me, &dir, &Request::Ping, Duration::from_secs(10)).unwrap();
    assert_eq!(v["big"].as_str().map(str::len), Some(1 << 20));
    assert_eq!(seen.lock().unwrap().len(), 2);
}
