//! What the keeper says on its stderr.

/// One line on the keeper's stderr, `possum keeper: WHAT`. Whoever started the keeper may no
/// longer read it (a `possum restore` that has ended, or a pipe no one drains): a failed write
/// is ignored, never a panic.
pub fn say(what: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "possum keeper: {what}");
}
