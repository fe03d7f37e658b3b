//! The CRIU images possum reads (inventory, pstree, mm, pagemap, core) and the inventory rewrite.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| possum_criu::fuzz::criu_image(data));
