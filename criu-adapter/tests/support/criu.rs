//! Shared by the tests that need root and CRIU (this crate's, the CRIU plugin's and the CLI's,
//! which include this file by path): they skip visibly without them, or fail under
//! `POSSUM_REQUIRE_CRIU=1` (as CI sets).

use std::io::Write as _;

use possum_criu::Criu;

/// A line on stderr, past the test harness's capture.
pub fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

/// The CRIU to test with, or `None` (after saying so) when the test `test` must be skipped.
pub fn criu_or_skip(test: &str) -> Option<Criu> {
    let why = if !nix::unistd::geteuid().is_root() {
        "the CRIU tests need root".to_string()
    } else {
        match Criu::locate() {
            Ok(c) => return Some(c),
            Err(e) => format!("criu not installed (run scripts/install-criu.sh): {e}"),
        }
    };
    if std::env::var("POSSUM_REQUIRE_CRIU").as_deref() == Ok("1") {
        panic!("{test}: POSSUM_REQUIRE_CRIU=1, but {why}");
    }
    say(&format!("{test}: SKIPPED: {why}"));
    None
}
