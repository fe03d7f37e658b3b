//! The GPU harness's pure parts (`eval/test_eval.py`: the bench's plan and shards, the A/B's
//! pairing, the reaping of restored jobs, the report's metrics), run here so that CI checks them
//! on every change. Without `python3` the test says SKIPPED and passes.

use std::path::Path;
use std::process::Command;

#[test]
fn the_harness_unit_tests_pass() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let script = root.join("eval/test_eval.py");
    let out = match Command::new("python3")
        .arg(&script)
        .current_dir(&root)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("SKIPPED: no python3 to run {} ({e})", script.display());
            return;
        }
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}:\n{stderr}", script.display());
    // unittest reports on stderr: "Ran N tests ... OK".
    assert!(stderr.contains("OK"), "{stderr}");
}
