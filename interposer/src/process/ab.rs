//! `POSSUM_AB_MS` (diagnostics): an A/B test of possum's launch-path cost inside one process.
//!
//! Process-to-process noise on the GPU machine (+-15% between two runs of one job) is larger than
//! the cost being measured. Here a `possum-ab` thread switches possum's hooks off (the entry
//! points' wrappers call the driver and nothing else; with `POSSUM_HOOKS=cupti`, CUPTI is
//! detached: no callback at all) and on again (possum's work included) every `POSSUM_AB_MS`
//! milliseconds, appending `{"t": unix seconds, "on": bool}` to
//! `POSSUM_AB_LOG` after each switch. `eval/overhead.py --ab` lays the job's own step times over
//! those intervals and compares neighbouring on and off intervals.
//!
//! Launches of the off intervals are not seen: the DAG and dirty tracking are incomplete, so a
//! run with this set must not be checkpointed (a checkpoint refuses while it is on).

use std::io::Write as _;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::session::state::session;

/// Whether the A/B test runs in this process (then a checkpoint is refused).
pub fn running() -> bool {
    session().ab_running.load(Ordering::Relaxed)
}

/// Starts the `possum-ab` thread when `POSSUM_AB_MS` and `POSSUM_AB_LOG` are set (after CUPTI
/// was attached).
pub fn start_if_asked() {
    let Some(crate::base::config::AbTest { every, log }) =
        crate::base::config::get().diag.ab.clone()
    else {
        return;
    };
    session().ab_running.store(true, Ordering::Relaxed);
    let spawned = std::thread::Builder::new()
        .name("possum-ab".into())
        .spawn(move || {
            let mut on = true;
            loop {
                std::thread::sleep(every);
                let t0 = std::time::Instant::now();
                let r = switch(!on);
                on = !on;
                let t = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                // The pid: a job's children (compiler workers) inherit the log and write
                // their own switches to it.
                let line = serde_json::json!({
                    "t": t, "on": on, "switch_ms": t0.elapsed().as_secs_f64() * 1e3,
                    "error": r.err().map(|e| e.to_string()), "pid": std::process::id(),
                });
                // One write(2) of the whole line: `writeln!` on a File writes each formatted
                // piece with its own call, and a job exiting between two of them left a torn
                // last line (`{"error":`) that the readers could not parse.
                let text = format!("{line}\n");
                let written = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .and_then(|mut f| f.write_all(text.as_bytes()));
                if written.is_err() {
                    crate::base::log::log(&format!(
                        "POSSUM_AB_LOG {log}: cannot write; A/B test ends"
                    ));
                    let _ = switch(true);
                    return;
                }
            }
        });
    if spawned.is_err() {
        session().ab_running.store(false, Ordering::Relaxed);
    }
}

/// Switches possum's hooks on or off: the entry points' mode, or CUPTI's subscription.
fn switch(on: bool) -> Result<(), crate::cuda::cupti_sys::CuptiError> {
    use crate::base::mode::{after_set_up, set_mode, Mode};
    // The set-up started this test: the mode is known.
    match (after_set_up(), on) {
        (Mode::Count, true) => crate::cuda::cupti::cupti_attach(),
        (Mode::Count, false) => crate::cuda::cupti::cupti_detach(),
        (_, true) => {
            set_mode(Mode::Hooks);
            Ok(())
        }
        (_, false) => {
            set_mode(Mode::Off);
            Ok(())
        }
    }
}
