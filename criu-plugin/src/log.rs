//! The plugin's log lines.

/// The prefix of every line this plugin logs.
pub const LOG_PREFIX: &str = "possum-criu-plugin:";
