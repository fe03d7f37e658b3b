//! A runtime that starts without a device is a typed error naming `hipInit`. A test binary of
//! its own: it sets the simulated runtime's `FAKE_HIP_NODEV` for the whole process.

mod common;

use common::simulated_runtime_or_skip;
use possum_engine::device::DeviceError;
use possum_hip::{HipDevice, OpenError};

#[test]
fn a_runtime_without_a_device_fails_at_init() {
    let Some(lib) = simulated_runtime_or_skip("a_runtime_without_a_device_fails_at_init") else {
        return;
    };
    // The only test of this process: nothing else reads the environment meanwhile.
    std::env::set_var("FAKE_HIP_NODEV", "1");
    let err = HipDevice::open(lib, 0).unwrap_err();
    match &err {
        OpenError::Init(DeviceError::Backend {
            call,
            code,
            message,
        }) => {
            assert_eq!(*call, "hipInit");
            assert_eq!(*code, 100);
            assert!(message.starts_with("hipErrorNoDevice"), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(err.to_string().contains("did not start"), "{err}");
}
