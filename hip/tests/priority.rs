//! The engine's priority stream on the HIP backend is the device's high-priority stream: the
//! simulated runtime counts the copies queued on streams of each priority. A test binary of its
//! own, so that the counts are this test's alone (they are the process's).

mod common;

use std::sync::Arc;

use common::{cfg, gated_sink, simulated_device_or_skip, simulated_runtime_or_skip, Job, SIZES};
use possum_engine::store::MemStore;
use possum_engine::Engine;
use possum_hip::result::SimProbe;

#[test]
fn copy_on_write_goes_on_the_high_priority_stream_and_the_copier_does_not() {
    let Some(dev) = simulated_device_or_skip("copy_on_write_goes_on_the_high_priority_stream")
    else {
        return;
    };
    let probe = SimProbe::load(simulated_runtime_or_skip("").unwrap()).unwrap();
    let (least, greatest) = dev.stream_priority_range();
    let chunk = 16u64 << 10;
    let e = Engine::new(dev, cfg(64 << 20)).unwrap();
    let mut job = Job::new(&e, SIZES);
    job.sync();
    let (high0, low0) = (
        probe.copies_at_priority(greatest),
        probe.copies_at_priority(least),
    );

    let store = Arc::new(MemStore::new());
    let (sink, gate) = gated_sink(&store);
    let ck = e.checkpoint(sink.clone(), false).unwrap();
    // The copier is held at the sink in the first buffers; the two at the highest addresses are
    // shadowed (a device-to-device copy each) before the job's writes reach them.
    let top = job.highest_first();
    job.write(top[0], 1);
    job.write(top[1], 1);
    job.sync();
    gate.open();
    let rep = ck.wait().unwrap();
    assert_eq!(rep.cow_shadow, 2, "{rep:?}");

    let high = probe.copies_at_priority(greatest) - high0;
    let low = probe.copies_at_priority(least) - low0;
    assert_eq!(
        high, 2,
        "the two shadow copies, and nothing else, went on high-priority streams"
    );
    // Every chunk of every buffer (its own or its shadow's) was copied to the host on the
    // copier's streams, and the job's two writes on its own (normal priority) stream.
    let chunks: u64 = SIZES.iter().map(|&n| n.div_ceil(chunk)).sum();
    assert!(
        low >= chunks + 2,
        "{low} copies at priority {least}, {chunks} chunks"
    );
}
