//! CRIU's dump of the held job, tried again when it failed for a passing reason (part of
//! [`super`]).

use std::path::Path;
use std::thread::JoinHandle;
use std::time::Duration;

use possum_criu::dump::PreparedDump;
use possum_criu::{Criu, CriuError, DumpOptions};

use crate::observer::Observer;

/// Dumps tried when the job's control socket had a client connected ([`dump_retrying_transient`]).
const DUMP_TRIES: u32 = 3;
const DUMP_RETRY_WAIT: Duration = Duration::from_millis(200);

/// CRIU's dump of the held job, again (up to [`DUMP_TRIES`] times, [`DUMP_RETRY_WAIT`] apart)
/// when it failed only because the job's control socket had a client connected at that moment
/// (CRIU cannot dump one end of a stream connection whose other end is outside the tree): a
/// `possum status` from elsewhere, or a client of an earlier checkpoint that died, whose
/// exchange the job's control thread (not held) ends meanwhile. A failed dump leaves the tree
/// as it was, still held. The first try is `ready`'s, where one was made ready.
pub(super) fn dump_retrying_transient(
    criu: &Criu,
    opts: &DumpOptions,
    mut ready: Option<PreparedDump>,
    pid: i32,
    obs: &mut dyn Observer,
) -> Result<possum_criu::DumpReport, CriuError> {
    // The control socket's file name, as CRIU's log names it.
    let sock = possum_control::socket_path(Path::new(""), pid as u32)
        .display()
        .to_string();
    let mut tries = 0;
    loop {
        tries += 1;
        let dumped = match ready.take() {
            Some(r) => r.run(),
            None => criu.dump(opts),
        };
        match dumped {
            Ok(d) => return Ok(d),
            Err(e) => {
                let m = e.to_string();
                let transient =
                    m.contains("Can't dump half of stream unix connection") && m.contains(&sock);
                if !transient || tries >= DUMP_TRIES {
                    return Err(e);
                }
                obs.note(&format!(
                    "CRIU's dump of process {pid} met a client connected to its control socket; \
                     dumping again in {} ms",
                    DUMP_RETRY_WAIT.as_millis()
                ));
                obs.dumping_again();
                std::thread::sleep(DUMP_RETRY_WAIT);
            }
        }
    }
}

/// CRIU's dump being made ready on a thread (`Run::ready_dump`), or none. Dropped untaken
/// (the hold failed before the dump), the thread is waited for and what it made is ended.
pub(super) struct ReadyDump(pub(super) Option<JoinHandle<Result<PreparedDump, CriuError>>>);

impl ReadyDump {
    /// The dump made ready; none where it could not be (the dump is then made at once, and
    /// says what fails).
    pub(super) fn take(mut self) -> Option<PreparedDump> {
        self.0.take()?.join().ok()?.ok()
    }
}

impl Drop for ReadyDump {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.join();
        }
    }
}
