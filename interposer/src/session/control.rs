//! The control socket inside the job (`possum-control`'s server): `possum status PID` and
//! `possum trace PID` ask it. Started when the job first uses CUDA, not at load, so a process
//! that never touches CUDA gets no thread and no socket. `POSSUM_CONTROL=0` turns it off.
//!
//! Above the session's steps (`checkpoint.rs`, `release.rs`, ...) in the crate's layers: the
//! handlers call the checkpoint sessions, the state and CUPTI; the set-up starts the server and
//! hands it what `Status` answers. A front end above it (HIP's) registers the handler of its own
//! sessions ([`set_front_end`]): the socket names none of its modules.

use std::sync::{Arc, Once, OnceLock};
use std::time::Duration;

use possum_control::reply::CuptiReply;
use possum_control::{Request, Server};
use serde_json::{json, Value};

use crate::base::config;
use crate::base::log::log;
use crate::cuda::cupti::{cupti_attach, cupti_attached, cupti_detach};
use crate::ops::collective;
use crate::process::runtime::state_if_created;
use crate::session::replies::{reply, to_json};
use crate::session::state::session;
use crate::session::{checkpoint, release, resume, save};

static START: Once = Once::new();

/// A front end's answer to a request; `None` for a request it leaves to the rest.
pub type FrontEnd = fn(&Request) -> Option<Value>;

/// The front end's handler, asked first ([`set_front_end`]).
static FRONT_END: OnceLock<FrontEnd> = OnceLock::new();

/// Hands every request to `front_end` first from now on (the HIP front end's sessions, once it
/// is made); its `Some` answer is the reply. The first handler registered stays.
pub fn set_front_end(front_end: FrontEnd) {
    let _ = FRONT_END.set(front_end);
}

/// Starts the server (once), answering `Status` with `status()` (the statistics).
pub fn start(status: fn() -> Value) {
    if !config::get().user.control {
        return;
    }
    START.call_once(|| {
        let dir = config::get().user.socket_dir.clone();
        let handler = Arc::new(move |req: Request| {
            if let Some(v) = FRONT_END.get().and_then(|handle| handle(&req)) {
                return v;
            }
            answer(req, status)
        });
        match Server::start(&dir, handler) {
            Ok(s) => {
                log(&format!("control socket {}", s.path().display()));
                *session().server.lock() = Some(s);
            }
            Err(e) => log(&format!("no control socket in {}: {e}", dir.display())),
        }
    });
}

/// The answer to `req`, `Status` answered with `status()`.
fn answer(req: Request, status: fn() -> Value) -> Value {
    match req {
        Request::Ping => {
            json!({"pid": std::process::id(), "possum": env!("CARGO_PKG_VERSION")})
        }
        Request::Status => status(),
        Request::Trace => match state_if_created() {
            Some(st) => st.trace_json(),
            None => possum_control::error_reply("the job has not used CUDA yet"),
        },
        Request::Checkpoint { dir, parent } => {
            checkpoint::checkpoint(&dir, false, parent.as_deref())
        }
        Request::CheckpointKept { dir, parent } => {
            checkpoint::checkpoint(&dir, true, parent.as_deref())
        }
        Request::PrecopyRound => checkpoint::precopy_round(),
        Request::Release => release::release(None),
        Request::ReleaseKeeping { hold_secs } => release::release(Some(hold_secs)),
        Request::JournalWrites { path } => release::journal_next(path),
        Request::Resume { dir } => resume::resume(dir.as_deref(), None),
        Request::ResumeAndSave {
            dir,
            shadow_mib,
            parent,
        } => resume::resume(
            Some(&dir),
            Some((shadow_mib, parent.map(std::path::PathBuf::from))),
        ),
        Request::Saved => save::saved(),
        Request::CollectiveHold { at, lease_ms } => {
            reply(collective::hold(at, Duration::from_millis(lease_ms)))
        }
        Request::CollectiveWait { at, timeout_ms } => {
            to_json(&collective::wait_for(at, Duration::from_millis(timeout_ms)))
        }
        Request::CollectiveLift => to_json(&collective::lift()),
        Request::Cupti { attach } => {
            let r = if attach {
                cupti_attach()
            } else {
                cupti_detach()
            };
            reply(r.map(|()| CuptiReply {
                cupti_attached: cupti_attached(),
            }))
        }
    }
}

/// Stops the server and removes its socket (at exit).
pub fn stop() {
    if let Some(mut s) = session().server.lock().take() {
        s.shutdown();
    }
}
