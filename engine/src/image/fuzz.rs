//! The entry points of the fuzz targets in `fuzz/` that read image files, also run over the seed
//! corpus by the crate's tests. Each takes arbitrary bytes and panics only when a property fails:
//! the parser itself must never panic, never allocate more than its caps allow, and what it
//! accepts must survive the writer (parse, write, parse again: the same value).

use std::path::Path;

use super::manifest::{decode_framed, encode_framed, frame};
use super::{check_manifest, FORMAT_MAJOR, FORMAT_MINOR};

/// `manifest.pb`: `data` taken as the whole file, and `data` taken as the protobuf payload in a
/// valid frame (right magic, version, length and checksum), so that mutations reach the decoder
/// and the consistency checks behind the checksum too.
pub fn manifest(data: &[u8]) {
    manifest_file(data);
    manifest_file(&frame(data, FORMAT_MAJOR, FORMAT_MINOR));
}

fn manifest_file(bytes: &[u8]) {
    let image = Path::new("fuzz-image");
    let checked = check_manifest(image, bytes);
    let (major, minor, m) = match decode_framed(image, bytes) {
        Ok(d) => d,
        Err(_) => {
            assert!(
                checked.is_err(),
                "a manifest that does not decode passed the checks"
            );
            return;
        }
    };
    let again = encode_framed(&m, major, minor);
    let (major2, minor2, m2) =
        decode_framed(image, &again).expect("the writer's framing of a decoded manifest decodes");
    assert_eq!((major2, minor2), (major, minor));
    assert_eq!(m2, m, "manifest changed through write and read");
    match checked {
        Ok(summary) => {
            assert_eq!(summary.chunks, m.chunks.len() as u64);
            assert_eq!(summary.buffers.len(), m.buffers.len());
            assert!(summary.buffers.windows(2).all(|w| w[0].id < w[1].id));
            // What an accepted manifest can make the reader open: plain names, in the image's
            // directory or in a parent's reached by `..` first, never an absolute path.
            assert!(m
                .files
                .iter()
                .all(|f| !f.name.contains('/') && f.name != ".."));
            assert!(m.parents.iter().all(|p| p.path.starts_with("..")
                && !p.path.starts_with('/')
                && !p.path.split('/').any(|c| c.is_empty() || c == ".")));
            assert!(summary.reused_bytes <= summary.total_bytes);
            assert_eq!(summary.parents.len(), m.parents.len());
            let summary2 = check_manifest(image, &again).expect("a rewritten valid manifest");
            assert_eq!(summary2, summary);
        }
        Err(e) => {
            assert!(
                check_manifest(image, &again).is_err(),
                "rewriting a rejected manifest made it valid ({e})"
            );
        }
    }
}
