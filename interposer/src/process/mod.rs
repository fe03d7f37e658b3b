//! The library's life in the process: loading (`load`), the one set-up and the statistics
//! (`setup`), the process state made at the first driver call (`runtime`, with the DAG
//! thread's messages in `dag`), the per-function counters (`stats`), the `atexit` handler
//! (`exit`) and the in-process A/B test of the hooks' cost (`ab`).

pub(crate) mod ab;
pub(crate) mod dag;
pub(crate) mod exit;
pub(crate) mod load;
pub(crate) mod runtime;
pub(crate) mod setup;
pub mod stats;
