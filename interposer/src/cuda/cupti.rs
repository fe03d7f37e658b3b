//! CUPTI as the rest of the crate uses it: whether the hooks are live, and CUPTI detached and
//! attached again around a checkpoint (`POSSUM_HOOKS=cupti`).
//!
//! Owns the set-up's outcome ([`Setup`], recorded once by the set-up for the statistics and for
//! [`cupti_attach`]) and the choice of callbacks to enable (`POSSUM_CALLBACKS`). The unsafe
//! binding itself is `cupti_sys.rs`.

use std::sync::OnceLock;

use crate::base::config::{self, Detach};
use crate::base::mode::{self, Mode};
use crate::cuda::cupti_sys::CuptiError;
use crate::process::stats::Setup;
use crate::{cuda::cbid, cuda::cupti_sys};

static SETUP: OnceLock<Setup> = OnceLock::new();

/// Records how the set-up went (once; later calls are ignored).
pub fn set_setup(setup: Setup) {
    let _ = SETUP.set(setup);
}

/// How the set-up went, once it has run.
pub fn setup() -> Option<&'static Setup> {
    SETUP.get()
}

/// Whether possum sees the job's GPU operations now (through the entry points, or CUPTI): then
/// a checkpoint pre-copies while the job runs, holds it at the op gate and restores on demand;
/// otherwise it parks the job's threads and copies everything while they are held. Asked only
/// after the set-up (a checkpoint session reaches here through the control socket, which the
/// set-up starts).
pub fn hooks_live() -> bool {
    mode::after_set_up() == Mode::Hooks || cupti_attached()
}

/// Detaches CUPTI (NVIDIA's driver checkpoint refuses a process it is attached to):
/// `POSSUM_DETACH` = `unsubscribe` (default), `finalize` (also `cuptiFinalize`) or `none`.
pub fn cupti_detach() -> Result<(), CuptiError> {
    let how = config::get().diag.detach.unwrap_or(Detach::Unsubscribe);
    match (cupti_sys::Cupti::get(), how) {
        (None, _) | (_, Detach::Never) => Ok(()),
        (Some(c), how) => c.detach(how == Detach::Finalize),
    }
}

/// The callbacks to enable: all of them, or with `POSSUM_CALLBACKS` (diagnostics) `none`
/// (subscribe only) or a comma-separated list of driver function names.
pub fn enabled_callbacks() -> impl Iterator<Item = u32> + Clone {
    let only: Option<&'static Vec<String>> = config::get().diag.callbacks.as_ref();
    cbid::CALLBACKS
        .iter()
        .filter(move |c| only.is_none_or(|o| o.iter().any(|n| n == c.name)))
        .map(|c| c.id)
}

/// Whether CUPTI's callbacks are subscribed now.
pub fn cupti_attached() -> bool {
    cupti_sys::Cupti::get().is_some_and(|c| c.attached())
}

/// Subscribes CUPTI again after [`cupti_detach`] (its callbacks enabled as at start).
pub fn cupti_attach() -> Result<(), CuptiError> {
    let Some(c) = cupti_sys::Cupti::get() else {
        return Ok(());
    };
    let (sub, mut failed) = c.attach(enabled_callbacks());
    sub?;
    // Callbacks this CUPTI refused at start as well are no news.
    let at_start = SETUP
        .get()
        .and_then(|s| s.error.clone())
        .unwrap_or_default();
    failed.retain(|f| !at_start.contains(f.as_str()));
    if failed.is_empty() {
        Ok(())
    } else {
        Err(CuptiError::NotEnabledAgain(failed))
    }
}
