//! The fuzz target's entry point for `possum.json` (`fuzz/`, cargo-fuzz): a description read from
//! an untrusted image. Not part of the API.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::image::{manifest_text, Manifest, MAX_MANIFEST_BYTES};

/// An empty image directory (with `criu/` and `gpu/`), made once, that [`Manifest::validate`]
/// resolves paths against.
fn image_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("possum-fuzz-image-{}", std::process::id()));
        for sub in ["criu", "gpu"] {
            std::fs::create_dir_all(dir.join(sub)).expect("the fuzz image directory");
        }
        dir
    })
}

/// `possum.json` as a restore reads it: what parses is validated (no panic, whatever it says),
/// and what parses is written and read again to the same text (its figures, free-form JSON with
/// floats, left out of that comparison).
pub fn possum_json(data: &[u8]) {
    if data.len() as u64 > MAX_MANIFEST_BYTES {
        return;
    }
    let Ok(m) = serde_json::from_slice::<Manifest>(data) else {
        return;
    };
    let _ = m.validate(image_dir());
    let bare = Manifest {
        figures: serde_json::Value::Null,
        ..m
    };
    let text = manifest_text(&bare).expect("a description serializes");
    let again: Manifest = serde_json::from_str(&text).expect("a written description parses");
    let text2 = manifest_text(&again).expect("a description serializes");
    assert_eq!(text, text2, "possum.json changed through write and read");
}
