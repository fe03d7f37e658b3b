//! The device-generic copy job on the host backend: the same check the GPU runs.

use std::sync::Arc;

use possum_engine::host::HostDevice;
use possum_engine::{Engine, EngineConfig};
use possum_workloads::copyjob::{run, CopySpec, Target};

fn spec() -> CopySpec {
    CopySpec {
        buffers: 12,
        buffer_bytes: 1 << 20,
        streams: 2,
        ops_per_step: 8,
        steps: 12,
        at: 4,
        seed: 9,
        max_op_bytes: 1 << 20,
    }
}

fn engine() -> Engine<HostDevice> {
    let cfg = EngineConfig {
        chunk_size: 256 << 10,
        staging_buffers: 4,
        ..EngineConfig::default()
    };
    Engine::new(Arc::new(HostDevice::new(64 << 20)), cfg).unwrap()
}

#[test]
fn copy_job_checkpointed_to_memory_is_bit_exact() {
    let r = run(&engine(), &spec(), &Target::Memory).unwrap();
    assert!(r.image_bitexact && r.final_bitexact, "{r:?}");
    assert_eq!(r.on_demand + r.prefetched, 12);
}

#[test]
fn copy_job_checkpointed_to_disk_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let r = run(&engine(), &spec(), &Target::Dir(tmp.path().join("img"))).unwrap();
    assert!(r.bitexact, "{r:?}");
    assert_eq!(r.target, "disk");
}
