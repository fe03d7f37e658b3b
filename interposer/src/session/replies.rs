//! What the session's replies are made of: a copy's figures as the replies say them, the
//! JSON of a reply, a restore's figures, and the sink that beats the hold's watchdog. Leaf
//! helpers of the session's steps, needing none of them.

use std::sync::Arc;

use possum_control::reply::DeviceCopy;
use possum_engine::image::ImageWriter;
use possum_engine::store::ChunkSink;
use serde::Serialize;
use serde_json::Value;

use crate::ops::park;
use crate::session::state::{OnDemand, RestoreFigures};

/// What a pre-copy round of device `device` copied, as the replies say it.
pub(crate) fn round_copy(device: usize, r: &possum_engine::RoundReport) -> DeviceCopy {
    DeviceCopy {
        device,
        buffers: r.buffers as u64,
        bytes: r.bytes,
        ms: Some(ms(r.elapsed)),
        dirty_after: Some(r.dirty_after as u64),
        pipeline: Some(pipeline(&r.pipeline)),
        ..with_prints(DeviceCopy::default(), &r.prints)
    }
}

/// Where a copy's time went, as the replies say it.
pub(crate) fn pipeline(p: &possum_engine::Pipeline) -> possum_control::reply::CopyPipeline {
    possum_control::reply::CopyPipeline::of(p.writers as u64, [p.staging_wait, p.copy_wait, p.sink])
}

/// What `writer` wrote into its data files since it was last asked, as the replies say it.
pub(crate) fn written(writer: &ImageWriter) -> Option<Vec<possum_control::reply::WrittenFile>> {
    let files = writer
        .take_written()
        .into_iter()
        .map(|f| possum_control::reply::WrittenFile {
            dev: f.inode.0,
            ino: f.inode.1,
            ranges: f.ranges.into_iter().map(|(at, len)| [at, len]).collect(),
        });
    Some(files.collect())
}

/// `d` with what the fingerprints decided (nothing where the engine took none).
pub(crate) fn with_prints(mut d: DeviceCopy, p: &possum_engine::Prints) -> DeviceCopy {
    if p.fingerprinted_bytes > 0 {
        d.fingerprinted_bytes = Some(p.fingerprinted_bytes);
        d.fingerprint_ms = Some(ms(p.time));
        d.proven_bytes = Some(p.proven_bytes);
        d.reused_bytes = Some(p.reused_bytes);
    }
    d
}

pub(crate) fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The buffers of device `device` a session's job waited on, as replies name them.
pub(crate) fn waited_on(
    device: usize,
    w: &[possum_engine::WaitedOn],
) -> Vec<possum_control::reply::WaitedOn> {
    w.iter()
        .map(|w| possum_control::reply::WaitedOn {
            device,
            id: w.id,
            va: w.va,
            size: w.size,
            ms: ms(w.waited),
        })
        .collect()
}

/// A sink that reports progress to the hold's watchdog.
pub(crate) struct Beating(pub(crate) Arc<ImageWriter>);

impl ChunkSink for Beating {
    fn add_buffer(
        &self,
        rec: possum_engine::store::BufferRecord,
    ) -> Result<(), possum_engine::image::ImageError> {
        park::beat();
        self.0.add_buffer(rec)
    }
    fn write_chunk(
        &self,
        buffer: u64,
        offset: u64,
        data: &[u8],
    ) -> Result<(), possum_engine::image::ImageError> {
        park::beat();
        self.0.write_chunk(buffer, offset, data)
    }
    fn set_meta(&self, key: &str, value: &str) -> Result<(), possum_engine::image::ImageError> {
        park::beat();
        self.0.set_meta(key, value)
    }
    fn write_chunk_proving(
        &self,
        buffer: u64,
        offset: u64,
        data: &[u8],
        expect: Option<possum_engine::fingerprint::Fingerprint>,
    ) -> Result<possum_engine::store::Proof, possum_engine::image::ImageError> {
        park::beat();
        self.0.write_chunk_proving(buffer, offset, data, expect)
    }
    fn reuse_chunk(
        &self,
        buffer: u64,
        offset: u64,
        len: u64,
        fp: possum_engine::fingerprint::Fingerprint,
    ) -> Result<bool, possum_engine::image::ImageError> {
        self.0.reuse_chunk(buffer, offset, len, fp)
    }
}

/// A reply as the JSON sent: `r`'s, or its error's message.
pub(crate) fn reply<R: Serialize, E: std::fmt::Display>(r: Result<R, E>) -> Value {
    r.map_or_else(
        |e| possum_control::error_reply(e.to_string()),
        |v| to_json(&v),
    )
}

/// A finished restore's figures, as `possum status` shows them; `on_demand`: the restore ran
/// while the job did (the figures of its work on demand included).
pub(crate) fn restore_figures(
    device: usize,
    r: &possum_engine::restore::RestoreReport,
    on_demand: bool,
) -> RestoreFigures {
    let mut v = RestoreFigures {
        device,
        buffers: Some(r.buffers),
        bytes: Some(r.bytes),
        ms: Some(ms(r.elapsed)),
        staged: Some(r.staged),
        staged_fallback: Some(r.staged_fallback),
        job_waited_ms: Some(ms(r.job_waited)),
        waited_on: Some(waited_on(device, &r.waited_on)),
        ..RestoreFigures::default()
    };
    if on_demand {
        v.on_demand = Some(OnDemand::Buffers(r.on_demand));
        v.prefetched = Some(r.prefetched);
        v.helped_chunks = Some(r.helped_chunks);
        v.hook_blocked = Some(r.hook_blocked);
        v.hook_blocked_ms = Some(ms(r.hook_blocked_total));
    }
    v
}

/// A reply type's JSON (serializing one cannot fail: every key is a string, every value plain
/// data).
pub(crate) fn to_json<R: Serialize>(r: &R) -> Value {
    serde_json::to_value(r).unwrap_or_else(|e| possum_control::error_reply(e.to_string()))
}
