//! CRIU's stages, as its plugin interface numbers them (`criu/include/criu-plugin.h`).

use std::ffi::c_int;

/// `CR_PLUGIN_STAGE__DUMP`
pub const CR_PLUGIN_STAGE_DUMP: c_int = 0;
/// `CR_PLUGIN_STAGE__PRE_DUMP`
pub const CR_PLUGIN_STAGE_PRE_DUMP: c_int = 1;
/// `CR_PLUGIN_STAGE__RESTORE`
pub const CR_PLUGIN_STAGE_RESTORE: c_int = 2;
