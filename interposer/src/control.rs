//! The control socket inside the job (`possum-control`'s server): `possum status PID` and
//! `possum trace PID` ask it. Started when the job first uses CUDA, not at load, so a process
//! that never touches CUDA gets no thread and no socket. `POSSUM_CONTROL=0` turns it off.

use std::sync::{Arc, Once};

use parking_lot::Mutex;
use possum_control::{Request, Server};
use serde_json::json;

use crate::runtime::state_if_created;

static SERVER: Mutex<Option<Server>> = Mutex::new(None);
static START: Once = Once::new();

/// Starts the server (once).
pub fn start() {
    if std::env::var_os("POSSUM_CONTROL").is_some_and(|v| v == "0") {
        return;
    }
    START.call_once(|| {
        let dir = possum_control::socket_dir();
        let handler = Arc::new(|req: Request| match req {
            Request::Ping => {
                json!({"pid": std::process::id(), "possum": env!("CARGO_PKG_VERSION")})
            }
            Request::Status => crate::stats_json(),
            Request::Trace => match state_if_created() {
                Some(st) => st.trace_json(),
                None => possum_control::error_reply("the job has not used CUDA yet"),
            },
            Request::Checkpoint { dir } => crate::session::checkpoint(&dir, false),
            Request::CheckpointKept { dir } => crate::session::checkpoint(&dir, true),
            Request::Release => crate::session::release(None),
            Request::ReleaseKeeping { hold_secs } => crate::session::release(Some(hold_secs)),
            Request::Resume { dir } => crate::session::resume(dir.as_deref(), None),
            Request::ResumeAndSave { dir, shadow_mib } => {
                crate::session::resume(Some(&dir), Some(shadow_mib))
            }
            Request::Saved => crate::session::saved(),
            Request::Cupti { attach } => {
                let r = if attach {
                    crate::cupti_attach()
                } else {
                    crate::cupti_detach()
                };
                match r {
                    Ok(()) => json!({"cupti_attached": crate::cupti_attached()}),
                    Err(e) => possum_control::error_reply(e),
                }
            }
        });
        match Server::start(&dir, handler) {
            Ok(s) => {
                crate::log(&format!("control socket {}", s.path().display()));
                *SERVER.lock() = Some(s);
            }
            Err(e) => crate::log(&format!("no control socket in {}: {e}", dir.display())),
        }
    });
}

/// Stops the server and removes its socket (at exit).
pub fn stop() {
    if let Some(mut s) = SERVER.lock().take() {
        s.shutdown();
    }
}
