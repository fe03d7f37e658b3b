//! The HIP backend on the simulated runtime: the `Device` contract (reservations, mappings,
//! copies, events, priorities), the engine's real protocol over it (a job writing its buffers
//! while a checkpoint runs, a restore into fresh memory at the same addresses, an on-demand
//! restore), and the typed errors of a runtime that can't be used. Without a C compiler each
//! test prints "SKIPPED: ..." and returns.
//!
//! With `POSSUM_HIP_RUNTIME` naming a real HIP runtime (`/opt/rocm/lib/libamdhip64.so`) the same
//! tests run on its device 0; what only the simulator fixes (its name, granularity, device count,
//! lazily run queues, zeroed fresh memory) is asserted on the simulator only.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{
    cfg, device_or_skip, gated_sink, pattern, read, runtime_or_skip, simulated, write, Job, SIZES,
};
use possum_engine::device::{DevPtr, Device, DeviceError, StreamPriority, Transfer};
use possum_engine::store::MemStore;
use possum_engine::{Buffer, Engine, EngineConfig};
use possum_hip::result::HipStream;
use possum_hip::{HipDevice, LoadError, OpenError};

/// A copy out of `va` is refused before the runtime sees it: nothing is mapped there.
fn assert_unmapped(dev: &HipDevice, s: &HipStream, va: DevPtr) {
    let err = dev
        .copy_d2h(s, va, dev.alloc_host(16).unwrap(), 16)
        .unwrap_err();
    assert!(
        matches!(
            err,
            DeviceError::InvalidAddress {
                why: "not mapped",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn reservations_and_mappings_keep_their_addresses() {
    let Some(dev) = device_or_skip("reservations_and_mappings_keep_their_addresses") else {
        return;
    };
    let g = dev.granularity();
    assert!(g.is_power_of_two(), "granularity {g}");
    assert!(dev.name().starts_with("hip:0 "), "{}", dev.name());
    if simulated() {
        assert_eq!(g, 64 << 10, "the simulated runtime's granularity");
        assert!(
            dev.name().starts_with("hip:0 Simulated HIP device 0"),
            "{}",
            dev.name()
        );
    }
    let (free, total) = dev.memory_info().unwrap();
    assert!(free <= total && total > 0);

    let va = dev.reserve(4 * g).unwrap();
    assert_eq!(va.0 % g, 0);
    let s = dev.create_stream(StreamPriority::Normal).unwrap();
    // Nothing mapped yet: a copy there is refused before the runtime sees it.
    assert_unmapped(&dev, &s, va);
    // A mapping must lie inside the reservation, on the granularity.
    assert!(matches!(
        dev.map(va.add(g), 4 * g),
        Err(DeviceError::InvalidAddress { .. })
    ));
    assert!(matches!(
        dev.map(va.add(1), g),
        Err(DeviceError::InvalidAddress { .. })
    ));

    dev.map(va, 2 * g).unwrap();
    assert!(matches!(
        dev.map(va.add(g), g),
        Err(DeviceError::InvalidAddress {
            why: "overlaps a mapping",
            ..
        })
    ));
    // A copy may not cross the end of the mapping.
    let err = dev.copy_d2d(&s, va, va.add(2 * g - 8), 16).unwrap_err();
    assert!(
        matches!(
            err,
            DeviceError::InvalidAddress {
                why: "crosses the end of a mapping",
                ..
            }
        ),
        "{err}"
    );

    let bytes = pattern(1, 1, (2 * g) as usize);
    write(&dev, &s, va, &bytes).wait().unwrap();
    assert_eq!(read(&dev, &s, va, 2 * g), bytes);
    // A device-to-device copy inside the mapping, and a memset.
    dev.copy_d2d(&s, va, va.add(g), 100).unwrap();
    dev.memset_d8(&s, va, 0xa5, 10).unwrap();
    let got = read(&dev, &s, va, 2 * g);
    assert_eq!(&got[..10], &[0xa5; 10]);
    assert_eq!(&got[10..g as usize], &bytes[10..g as usize]);
    assert_eq!(&got[g as usize..g as usize + 100], &bytes[..100]);

    // The reservation can't go while mapped; unmapped, the address stays reserved and maps
    // again, to fresh memory (zeroed, on the simulator).
    assert!(matches!(
        dev.unreserve(va, 4 * g),
        Err(DeviceError::InvalidAddress { .. })
    ));
    assert!(matches!(
        dev.unmap(va, g),
        Err(DeviceError::InvalidAddress { .. })
    ));
    dev.unmap(va, 2 * g).unwrap();
    assert!(matches!(
        dev.copy_d2h(&s, va, dev.alloc_host(16).unwrap(), 16),
        Err(DeviceError::InvalidAddress { .. })
    ));
    dev.map(va, 2 * g).unwrap();
    let fresh = read(&dev, &s, va, 2 * g);
    if simulated() {
        assert_eq!(fresh, vec![0; (2 * g) as usize]);
    }
    dev.unmap(va, 2 * g).unwrap();
    dev.unreserve(va, 4 * g).unwrap();
    assert!(matches!(
        dev.unreserve(va, 4 * g),
        Err(DeviceError::InvalidAddress { .. })
    ));
}

#[test]
fn a_host_buffer_too_small_is_refused() {
    let Some(dev) = device_or_skip("a_host_buffer_too_small_is_refused") else {
        return;
    };
    let g = dev.granularity();
    let va = dev.reserve(g).unwrap();
    dev.map(va, g).unwrap();
    let s = dev.create_stream(StreamPriority::Normal).unwrap();
    let err = dev
        .copy_d2h(&s, va, dev.alloc_host(8).unwrap(), 16)
        .unwrap_err();
    assert!(
        matches!(err, DeviceError::HostBufferTooSmall { need: 16, have: 8 }),
        "{err}"
    );
    let err = dev
        .copy_h2d(&s, dev.alloc_host(8).unwrap(), va, 16)
        .unwrap_err();
    assert!(
        matches!(err, DeviceError::HostBufferTooSmall { need: 16, have: 8 }),
        "{err}"
    );
}

#[test]
fn events_order_streams_and_report_completion() {
    let Some(dev) = device_or_skip("events_order_streams_and_report_completion") else {
        return;
    };
    let g = dev.granularity();
    let va = dev.reserve(g).unwrap();
    dev.map(va, g).unwrap();
    let a = dev.create_stream(StreamPriority::Normal).unwrap();
    let b = dev.create_stream(StreamPriority::High).unwrap();
    // The simulated runtime runs queued work only when something waits for it, so the event is
    // not complete until then.
    let bytes = pattern(2, 0, g as usize);
    let pending = write(&dev, &a, va, &bytes);
    let ev = dev.record_event(&a).unwrap();
    let done = dev.event_query(&ev).unwrap();
    if simulated() {
        assert!(!done, "nothing has waited yet");
    }
    // b's copy is ordered after a's write by the event alone.
    dev.wait_event(&b, &ev).unwrap();
    assert_eq!(read(&dev, &b, va, g), bytes);
    assert!(dev.event_query(&ev).unwrap());
    dev.event_synchronize(&ev).unwrap();
    pending.wait().unwrap();
    dev.synchronize(&a).unwrap();
    dev.synchronize_device().unwrap();
}

#[test]
fn streams_take_the_device_s_priorities() {
    let Some(dev) = device_or_skip("streams_take_the_device_s_priorities") else {
        return;
    };
    let (least, greatest) = dev.stream_priority_range();
    assert!(greatest < least, "({least}, {greatest})");
    if simulated() {
        assert_eq!(
            (least, greatest),
            (1, -1),
            "ROCm's range, as the simulated runtime has it"
        );
    }
    let normal = dev.create_stream(StreamPriority::Normal).unwrap();
    let high = dev.create_stream(StreamPriority::High).unwrap();
    assert_eq!(normal.priority().unwrap(), least);
    assert_eq!(high.priority().unwrap(), greatest);
}

#[test]
fn a_missing_runtime_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("libamdhip64.so.6");
    let err = HipDevice::open(&path, 0).unwrap_err();
    match &err {
        OpenError::Load(LoadError::Open { path: p, .. }) => assert_eq!(p, &path),
        other => panic!("unexpected {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("cannot load the HIP runtime") && text.contains(&*path.to_string_lossy()),
        "{text}"
    );
}

#[test]
fn a_library_without_hip_s_entry_points_is_a_typed_error() {
    // Builds a library with the C compiler the simulated runtime needs (skipped without one).
    if runtime_or_skip("a_library_without_hip_s_entry_points_is_a_typed_error").is_none() {
        return;
    }
    // A library with only the first entry point.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("not-hip.c");
    std::fs::write(
        &src,
        "int hipInit(unsigned flags) { return flags ? 1 : 0; }\n",
    )
    .unwrap();
    let lib = dir.path().join("libnot-hip.so");
    let out = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .output();
    let Ok(out) = out else {
        eprintln!("SKIPPED: no C compiler [a_library_without_hip_s_entry_points_is_a_typed_error]");
        return;
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = HipDevice::open(&lib, 0).unwrap_err();
    match &err {
        OpenError::Load(LoadError::MissingSymbol { path, symbol }) => {
            assert_eq!(path, &lib);
            assert_eq!(*symbol, "hipGetDeviceCount");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(
        err.to_string().contains("has no hipGetDeviceCount"),
        "{err}"
    );
}

#[test]
fn a_device_the_runtime_does_not_have_is_a_typed_error() {
    let Some(lib) = runtime_or_skip("a_device_the_runtime_does_not_have_is_a_typed_error") else {
        return;
    };
    // The simulated runtime has one device; a real one fewer than 1000.
    let ordinal = if simulated() { 5 } else { 1000 };
    let err = HipDevice::open(lib, ordinal).unwrap_err();
    match err {
        OpenError::NoDevice { ordinal: o, count } => {
            assert_eq!(o, ordinal);
            assert!((1..1000).contains(&count), "{count}");
            if simulated() {
                assert_eq!(count, 1);
            }
        }
        ref other => panic!("unexpected {other}"),
    }
}

/// Checkpoints while the job keeps working, then releases every buffer and restores them into
/// fresh memory at the same addresses.
fn checkpoint_while_running_then_restore(shadow_budget: u64) {
    let Some(dev) = device_or_skip("checkpoint_while_running_then_restore") else {
        return;
    };
    let e = Engine::new(dev, cfg(shadow_budget)).unwrap();
    let mut job = Job::new(&e, SIZES);
    for step in 1..4 {
        job.step(step);
    }
    job.sync();
    let at_t0 = job.model.clone();
    assert_eq!(job.contents(), at_t0, "the job's own writes");

    let store = Arc::new(MemStore::new());
    let ck = e.checkpoint(store.clone(), false).unwrap();
    for step in 4..10 {
        job.step(step);
    }
    let rep = ck.wait().unwrap();
    job.sync();
    assert_eq!(rep.buffers, SIZES.len());
    assert_eq!(rep.bytes, SIZES.iter().sum::<u64>());
    assert!(job.image(&store) == at_t0, "the image is the buffers at T0");
    let at_end = job.model.clone();
    assert!(
        job.contents() == at_end,
        "the job's writes after T0 are all there"
    );

    // Every buffer's memory dropped; the addresses stay reserved.
    let vas: Vec<DevPtr> = job.bufs.iter().map(Buffer::va).collect();
    e.release().unwrap();
    for b in &job.bufs {
        assert_unmapped(&job.dev, &job.stream, b.va());
    }
    let rr = e.restore(store).unwrap().wait().unwrap();
    assert_eq!(rr.on_demand + rr.prefetched, SIZES.len() as u64, "{rr:?}");
    assert_eq!(job.bufs.iter().map(Buffer::va).collect::<Vec<_>>(), vas);
    assert!(
        job.contents() == at_t0,
        "restored bit-exact at the same addresses"
    );

    // The job goes on from T0.
    job.model = at_t0;
    for step in 4..6 {
        job.step(step);
    }
    job.sync();
    assert!(job.contents() == job.model);
}

#[test]
fn a_checkpoint_without_shadows_is_the_state_at_t0_and_restores_bit_exact() {
    checkpoint_while_running_then_restore(0);
}

#[test]
fn a_checkpoint_with_shadows_is_the_state_at_t0_and_restores_bit_exact() {
    checkpoint_while_running_then_restore(64 << 20);
}

#[test]
fn writes_to_buffers_not_yet_saved_are_shadowed_on_the_high_priority_stream() {
    let Some(dev) = device_or_skip("writes_to_buffers_not_yet_saved_are_shadowed") else {
        return;
    };
    let e = Engine::new(dev, cfg(64 << 20)).unwrap();
    let mut job = Job::new(&e, SIZES);
    job.step(1);
    job.sync();
    let at_t0 = job.model.clone();
    let store = Arc::new(MemStore::new());
    let (sink, gate) = gated_sink(&store);
    let ck = e.checkpoint(sink.clone(), false).unwrap();
    // The copier is held at the sink in the first buffers (lowest addresses first): the two
    // buffers at the highest addresses are saved by shadows before the job's writes reach them.
    let top = job.highest_first();
    job.write(top[0], 2);
    job.memset(top[1], 0x77, 5000);
    job.write(top[0], 3);
    job.sync();
    gate.open();
    let rep = ck.wait().unwrap();
    assert_eq!(rep.cow_shadow, 2, "{rep:?}");
    let mut waited: Vec<u64> = rep.waited_on.iter().map(|w| w.id).collect();
    waited.sort_unstable();
    let mut written = vec![job.bufs[top[0]].id(), job.bufs[top[1]].id()];
    written.sort_unstable();
    assert_eq!(
        waited, written,
        "the job waited for the buffers it wrote, only: {rep:?}"
    );
    assert!(job.image(&store) == at_t0, "the image is the buffers at T0");
    assert!(job.contents() == job.model);
}

#[test]
fn an_operation_overtakes_the_background_restorer() {
    let Some(dev) = device_or_skip("an_operation_overtakes_the_background_restorer") else {
        return;
    };
    let e = Engine::new(
        dev,
        EngineConfig {
            prefetch_delay: Duration::from_millis(40),
            restore_threads: 1,
            ..cfg(0)
        },
    )
    .unwrap();
    let mut job = Job::new(&e, SIZES);
    job.step(1);
    job.sync();
    let at_t0 = job.model.clone();
    let store = Arc::new(MemStore::new());
    e.checkpoint(store.clone(), false).unwrap().wait().unwrap();
    e.release().unwrap();
    // The buffer the background restorer reaches last.
    let last = store.last_in_prefetch_order().unwrap();
    let idx = job.bufs.iter().position(|b| b.id() == last.id).unwrap();
    let rs = e.restore(store.clone()).unwrap();
    // The job's first operation writes part of it: it waits for that buffer (its T0 bytes under
    // the part it does not write), not for the others.
    job.model = at_t0;
    job.memset(idx, 0x5a, 1000);
    job.sync();
    let rr = rs.wait().unwrap();
    assert!(rr.on_demand >= 1, "restored on demand: {rr:?}");
    assert_eq!(
        rr.waited_on.iter().map(|w| w.id).collect::<Vec<_>>(),
        vec![last.id],
        "the job waited for the buffer it wrote, only: {rr:?}"
    );
    assert!(
        job.contents() == job.model,
        "restored bytes under the job's write"
    );
}
