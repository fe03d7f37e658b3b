//! The CPU's side of the proof by content: a chunk's fingerprint (which every copy possum makes
//! is checked by, on a writer thread) and its CRC32C (which the image records), one core, 8 MiB
//! chunks.
//!
//! `cargo bench -p possum-engine --bench fingerprint`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use possum_engine::fingerprint;

fn chunk() -> Vec<u8> {
    (0..8u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

fn one_core(c: &mut Criterion) {
    let data = chunk();
    let mut g = c.benchmark_group("chunk");
    g.throughput(Throughput::Bytes(data.len() as u64));
    g.bench_function("fingerprint", |b| b.iter(|| fingerprint::of(&data)));
    g.bench_function("crc32c", |b| b.iter(|| crc32c::crc32c(&data)));
    g.finish();
}

criterion_group!(benches, one_core);
criterion_main!(benches);
