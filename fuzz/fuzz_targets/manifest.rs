//! An engine image's manifest.pb (framing, checksum, protobuf, consistency checks), with round trip through the writer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| possum_engine::image::fuzz::manifest(data));
