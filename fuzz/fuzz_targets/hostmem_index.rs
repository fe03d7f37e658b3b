//! possum-hostmem-PID.idx, the index of host memory moved out of CRIU's images, with round trip.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| possum_criu::fuzz::hostmem_index(data));
