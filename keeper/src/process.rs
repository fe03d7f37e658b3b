//! Whether a client process is still there.

/// Whether process `pid` exists (a zombie counts as gone).
pub(crate) fn alive(pid: i32) -> bool {
    // Not as UTF-8: a live client whose name is not must not look gone (its memory would be
    // dropped).
    match possum_control::proc_text(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z')),
        Err(_) => false,
    }
}
