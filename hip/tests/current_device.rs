//! possum's calls run on the job's threads too (its hooks): a `HipDevice` leaves the calling
//! thread's current device as it found it. A test binary of its own: it sets the simulated
//! runtime's `FAKE_HIP_DEVICES` for the whole process.

mod common;

use common::simulated_runtime_or_skip;
use possum_engine::device::{Device, StreamPriority};
use possum_hip::result::Runtime;
use possum_hip::HipDevice;

#[test]
fn the_calling_thread_keeps_its_current_device() {
    // The only test of this process: nothing else reads the environment meanwhile.
    std::env::set_var("FAKE_HIP_DEVICES", "2");
    let Some(lib) = simulated_runtime_or_skip("the_calling_thread_keeps_its_current_device") else {
        return;
    };
    let rt = Runtime::load(lib).unwrap();
    let dev = HipDevice::open(lib, 0).unwrap();
    // The job works on device 1 on this thread.
    rt.set_device(1).unwrap();
    let g = dev.granularity();
    let va = dev.reserve(2 * g).unwrap();
    dev.map(va, g).unwrap();
    let _s = dev.create_stream(StreamPriority::High).unwrap();
    dev.synchronize_device().unwrap();
    dev.unmap(va, g).unwrap();
    dev.unreserve(va, 2 * g).unwrap();
    assert_eq!(
        rt.current_device().unwrap(),
        1,
        "possum's calls moved the thread"
    );
    // And on device 0, it stays there.
    rt.set_device(0).unwrap();
    let va = dev.reserve(g).unwrap();
    dev.unreserve(va, g).unwrap();
    assert_eq!(rt.current_device().unwrap(), 0);
}
