//! The leaves every other module may use: the settings read from the environment once
//! (`config`), the `POSSUM_VERBOSE` lines (`log`), what the wrappers do now (`mode`) and the
//! symbol lookups in the loaded objects (`elfsym`). None of them names another module of the
//! crate but these.

pub(crate) mod config;
pub(crate) mod elfsym;
pub(crate) mod log;
pub(crate) mod mode;
