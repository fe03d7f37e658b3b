//! An AMDGPU code object's kernel argument metadata (ELF, notes, MessagePack, layout checks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| possum_fuzz::amdgpu_code_object(data));
