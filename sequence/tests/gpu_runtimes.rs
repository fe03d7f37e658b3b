//! What a live process maps, read from its `/proc/PID/maps`.

#[path = "../../control/tests/support/mapper.rs"]
#[allow(dead_code)]
mod mapper;

use possum_sequence::gpu_runtimes::GpuRuntimes;

/// A process that maps a file whose name is not UTF-8 beside a `libcuda.so.1`: the driver
/// library is still found (the maps are read as bytes).
#[test]
fn a_path_that_is_not_utf8_hides_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let files = [
        mapper::not_utf8(tmp.path()),
        tmp.path().join("libcuda.so.1"),
    ];
    let Some(child) = mapper::Mapper::start(&files) else {
        eprintln!("SKIPPED: no python3 to map the files");
        return;
    };
    let found = GpuRuntimes::of(child.pid() as i32);
    assert_eq!(
        found,
        GpuRuntimes {
            cuda: true,
            hip: false
        }
    );
}
