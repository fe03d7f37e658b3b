//! The fuzz targets' entry points that live here (those of the engine, the CRIU adapter and the
//! sequence live in their crates: `possum_engine::image::fuzz`, `possum_criu::fuzz`,
//! `possum_sequence::fuzz`), and a test that runs every seed of every target through its entry
//! point, without libFuzzer, on a stable toolchain.

use possum_control::{Request, MAX_REQUEST_BYTES};

/// A control request line as the job's server parses it (`serde_json::from_slice::<Request>`;
/// longer lines are refused before parsing). What parses survives serializing and parsing again.
pub fn control_request(data: &[u8]) {
    if data.len() > MAX_REQUEST_BYTES {
        return;
    }
    let Ok(mut req) = serde_json::from_slice::<Request>(data) else {
        return;
    };
    let text = serde_json::to_vec(&req).expect("a request serializes");
    let again: Request = serde_json::from_slice(&text).expect("a serialized request parses");
    assert_eq!(again, req, "request changed through write and read");
    if let Some(dir) = req.dir_mut() {
        dir.push('x');
    }
}

/// An AMDGPU code object's kernel argument metadata (`possum_analyzer::amdgpu::kernels`). What
/// reads keeps every argument inside its kernel's kernarg segment, and so its layout too.
pub fn amdgpu_code_object(data: &[u8]) {
    let Ok(kernels) = possum_analyzer::amdgpu::kernels(data) else {
        return;
    };
    for k in kernels {
        for a in &k.args {
            assert!(
                u64::from(a.offset) + u64::from(a.size) <= u64::from(k.kernarg_size),
                "{}: argument past the kernarg segment",
                k.name
            );
        }
        assert!(k.layout().total_size() <= k.kernarg_size as usize);
    }
}

/// A fuzz target's entry point: arbitrary bytes in, a panic only when a property fails.
pub type Target = fn(&[u8]);

/// Each target and its entry point.
pub const TARGETS: [(&str, Target); 6] = [
    ("manifest", possum_engine::image::fuzz::manifest),
    ("hostmem_index", possum_criu::fuzz::hostmem_index),
    ("criu_image", possum_criu::fuzz::criu_image),
    ("control_request", control_request),
    ("possum_json", possum_sequence::fuzz::possum_json),
    ("amdgpu_code_object", amdgpu_code_object),
];

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::Path;

    use super::*;

    #[test]
    fn every_seed_passes_its_target() {
        for (target, run) in TARGETS {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("corpus")
                .join(target);
            let mut n = 0;
            for e in fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
                let path = e.unwrap().path();
                run(&fs::read(&path).unwrap());
                n += 1;
            }
            assert!(n >= 4, "{target}: only {n} seeds");
        }
    }

    #[test]
    fn control_seeds_cover_accepted_and_refused_requests() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/control_request");
        let (mut ok, mut refused) = (0, 0);
        for e in fs::read_dir(dir).unwrap() {
            let bytes = fs::read(e.unwrap().path()).unwrap();
            match serde_json::from_slice::<Request>(&bytes) {
                Ok(_) => ok += 1,
                Err(_) => refused += 1,
            }
        }
        assert!(ok >= 5 && refused >= 3, "{ok} accepted, {refused} refused");
    }
}
