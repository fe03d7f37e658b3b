//! Tests of `CudaDevice` on a real GPU. Without one (no driver, or no device) each test prints
//! "SKIPPED: no CUDA device (...)" to the terminal, past the test harness's capture, and returns;
//! with `POSSUM_REQUIRE_GPU=1` it fails instead.

use std::io::Write;

use possum_cuda::{probe, CudaDevice};
use possum_engine::device::{Device, DeviceError, HostBuffer, StreamPriority, Transfer};

fn device_or_skip(test: &str) -> Option<CudaDevice> {
    match probe() {
        Ok(_) => Some(CudaDevice::new(0).expect("a device was probed but could not be opened")),
        Err(why) => {
            if std::env::var("POSSUM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("POSSUM_REQUIRE_GPU=1 but no CUDA device: {why}");
            }
            // Written to the stream directly: the harness captures only print!/eprint!.
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: no CUDA device ({why}) [{test}]"
            );
            None
        }
    }
}

#[test]
fn map_copy_remap_roundtrip() {
    let Some(dev) = device_or_skip("map_copy_remap_roundtrip") else {
        return;
    };
    let g = dev.granularity();
    assert!(g.is_power_of_two(), "granularity {g}");
    let va = dev.reserve(2 * g).unwrap();
    dev.map(va, g).unwrap();
    dev.map(va.add(g), g).unwrap();
    let s = dev.create_stream(StreamPriority::High).unwrap();

    let n = g as usize;
    let mut h = dev.alloc_host(n).unwrap();
    assert!(
        h.as_slice().iter().all(|&b| b == 0),
        "pinned memory starts zeroed"
    );
    for (i, b) in h.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let h = dev.copy_h2d(&s, h, va.add(g), g).unwrap().wait().unwrap();
    dev.copy_d2d(&s, va.add(g), va, g).unwrap();
    // Release and remap the second mapping: the first keeps the data, the address stays.
    dev.unmap(va.add(g), g).unwrap();
    dev.map(va.add(g), g).unwrap();
    let back = dev.alloc_host(n).unwrap();
    let back = dev.copy_d2h(&s, va, back, g).unwrap().wait().unwrap();
    assert_eq!(back.as_slice(), h.as_slice());

    let ev = dev.record_event(&s).unwrap();
    dev.event_synchronize(&ev).unwrap();
    assert!(dev.event_query(&ev).unwrap());

    dev.unmap(va, g).unwrap();
    dev.unmap(va.add(g), g).unwrap();
    dev.unreserve(va, 2 * g).unwrap();
}

#[test]
fn bad_ranges_are_refused() {
    let Some(dev) = device_or_skip("bad_ranges_are_refused") else {
        return;
    };
    let g = dev.granularity();
    let va = dev.reserve(2 * g).unwrap();
    let invalid = |r: Result<(), DeviceError>| matches!(r, Err(DeviceError::InvalidAddress { .. }));
    assert!(
        invalid(dev.map(va.add(g), 2 * g)),
        "mapping past the reservation"
    );
    assert!(invalid(dev.map(va.add(1), g)), "unaligned mapping");
    dev.map(va, g).unwrap();
    assert!(invalid(dev.map(va, g)), "mapping twice");
    assert!(
        invalid(dev.unmap(va, 2 * g)),
        "unmapping with the wrong size"
    );
    assert!(
        invalid(dev.unreserve(va, 2 * g)),
        "unreserving with a mapping left"
    );
    let s = dev.create_stream(StreamPriority::Normal).unwrap();
    assert!(
        invalid(dev.copy_d2d(&s, va, va.add(g), g)),
        "copy into the unmapped half"
    );
    assert!(
        invalid(dev.copy_d2d(&s, va.add(g / 2), va, g)),
        "copy across a mapping's end"
    );
    let small = dev.alloc_host(16).unwrap();
    assert!(matches!(
        dev.copy_d2h(&s, va, small, 32),
        Err(DeviceError::HostBufferTooSmall { need: 32, have: 16 })
    ));
    dev.unmap(va, g).unwrap();
    dev.unreserve(va, 2 * g).unwrap();
}

/// Fingerprints taken on the device equal the definition's (`possum_engine::fingerprint`) of the
/// same bytes: chunks from 16 bytes (more than one launch's 65535) to more than the range, a
/// range across two mappings side by side, lengths that end inside a 16-byte word; misaligned
/// and unmapped ranges refused before anything runs.
#[test]
fn fingerprints_are_the_definitions() {
    let Some(dev) = device_or_skip("fingerprints_are_the_definitions") else {
        return;
    };
    let s = dev.create_stream(StreamPriority::Normal).unwrap();
    // A driver that cannot load the kernel (the fake one without FAKE_CUDA_FINGERPRINT=1) has
    // none: skipped, visibly.
    match dev.fingerprint(&s, possum_engine::device::DevPtr(0), 0, 16) {
        Err(DeviceError::Unsupported(why))
            if std::env::var("POSSUM_REQUIRE_GPU").map_or(true, |v| v != "1") =>
        {
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: no fingerprint kernel ({why}; {}) [fingerprints_are_the_definitions]",
                dev.fingerprint_unavailable().unwrap_or_default()
            );
            return;
        }
        r => assert!(r.unwrap().is_empty()),
    }
    let g = dev.granularity();
    let size = 2 * g;
    let va = dev.reserve(2 * size).unwrap();
    dev.map(va, g).unwrap();
    dev.map(va.add(g), g).unwrap();
    let mut h = dev.alloc_host(size as usize).unwrap();
    let mut x = 88_172_645_463_325_252u64;
    for b in h.as_mut_slice() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    // A copy stays inside one mapping: one per mapping.
    let h = dev.copy_h2d(&s, h, va, g).unwrap().wait().unwrap();
    let mut rest = dev.alloc_host(g as usize).unwrap();
    rest.as_mut_slice()
        .copy_from_slice(&h.as_slice()[g as usize..]);
    let _rest = dev
        .copy_h2d(&s, rest, va.add(g), g)
        .unwrap()
        .wait()
        .unwrap();
    let bytes = h.as_slice();
    for chunk in [16u64, 4096, g / 2 + 16, g, 4 * g] {
        for len in [size, size - 13, 3 * 4096 + 5, 100, 7, 0] {
            let got = dev.fingerprint(&s, va, len, chunk).unwrap();
            let want =
                possum_engine::fingerprint::of_chunks(&bytes[..len as usize], chunk as usize);
            assert_eq!(got, want, "{len} bytes in {chunk}-byte chunks");
        }
    }
    // An offset start (16-byte aligned) and the pinned value of the definition's test.
    let got = dev
        .fingerprint(&s, va.add(4096 + 16), 10_000, 4096)
        .unwrap();
    let want = possum_engine::fingerprint::of_chunks(&bytes[4096 + 16..][..10_000], 4096);
    assert_eq!(got, want);
    let mut h = h;
    for (i, w) in h.as_mut_slice()[..4000].chunks_exact_mut(4).enumerate() {
        w.copy_from_slice(&(i as u32).wrapping_mul(2_654_435_761).to_le_bytes());
    }
    let _h = dev.copy_h2d(&s, h, va, 4000).unwrap().wait().unwrap();
    let got = dev.fingerprint(&s, va, 4000, 4096).unwrap();
    assert_eq!(got[0].to_string(), "aeda37bf452ab940b902ae2dfd724f64");
    // Refused: misaligned start or chunk, no chunk, a range into the unmapped half of the
    // reservation (a kernel reading it would fault the context).
    let invalid = |r: Result<_, DeviceError>| matches!(r, Err(DeviceError::InvalidAddress { .. }));
    assert!(invalid(dev.fingerprint(&s, va.add(8), 4096, 4096)));
    assert!(invalid(dev.fingerprint(&s, va, 4096, 24)));
    assert!(invalid(dev.fingerprint(&s, va, 4096, 0)));
    assert!(invalid(dev.fingerprint(&s, va, size + 16, 4096)));
    assert!(invalid(dev.fingerprint(&s, va.add(size), 4096, 4096)));
    // The stream still works after the refusals.
    assert_eq!(dev.fingerprint(&s, va, 4000, 4096).unwrap(), got);
    dev.unmap(va, g).unwrap();
    dev.unmap(va.add(g), g).unwrap();
    dev.unreserve(va, 2 * size).unwrap();
}
