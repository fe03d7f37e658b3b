//! `possum.json`, the description at the top of an image, as a restore reads and validates it.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| possum_sequence::fuzz::possum_json(data));
