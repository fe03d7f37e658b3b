//! A control request line, as the server in every job parses it.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| possum_fuzz::control_request(data));
