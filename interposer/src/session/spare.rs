//! A kept checkpoint's shadows saved into the keeper's spare image memory (the `ShadowSaver`
//! of a save, `session::save::start_save`), and, where asked, the buffers a held copy takes
//! whole (`session::release`).

use std::path::Path;
use std::sync::Arc;

use possum_engine::image::ImageWriter;

use crate::base::config;
use crate::base::log::log;
use crate::process::runtime::DevEngine;

/// A kept checkpoint's shadows saved into the keeper's spare image memory:
/// the spare file is one of the image's data files, the keeper copies each shadow (its memory)
/// into it at the copy engine's speed and checksums it, and the chunks are recorded here.
pub(crate) struct SpareSaver {
    /// Connections to the keeper not in use (each save takes one, or makes one: saves run at
    /// once).
    keepers: parking_lot::Mutex<Vec<possum_keeper::Keeper>>,
    path: std::path::PathBuf,
    drain: u64,
    file: u32,
    len: u64,
    next: std::sync::atomic::AtomicU64,
    chunk: u64,
    /// The image (not kept alive by this: its writer must be the only one left to commit).
    writer: std::sync::Weak<ImageWriter>,
    dev: Arc<possum_cuda::CudaDevice>,
    ended: std::sync::atomic::AtomicBool,
}

impl SpareSaver {
    /// Borrows the spare of `keeper` for `writer`'s image, if it has one on that filesystem (a
    /// keeper run with `POSSUM_KEEPER_SPARE_DIR` and `POSSUM_KEEPER_SPARE_MIB`): `None`, said
    /// once, if not. `POSSUM_SPARE_DRAIN=0` never asks.
    pub(crate) fn borrow(e: &DevEngine, writer: &Arc<ImageWriter>) -> Option<Arc<SpareSaver>> {
        // Only shadows go through it: without a shadow budget it would be taken for nothing.
        if !config::get().diag.spare_drain || e.engine.shadow_budget() == 0 {
            return None;
        }
        static SAID: std::sync::Once = std::sync::Once::new();
        Self::borrow_any(e, writer, ("kept checkpoints saved", &SAID))
    }

    /// [`SpareSaver::borrow`] for the copy made while the job is held, whose buffers go to the
    /// spare whole (`POSSUM_HELD_SPARE=1`; off: `None`).
    pub(crate) fn borrow_held(e: &DevEngine, writer: &Arc<ImageWriter>) -> Option<Arc<SpareSaver>> {
        if !config::get().diag.held_spare {
            return None;
        }
        static SAID: std::sync::Once = std::sync::Once::new();
        Self::borrow_any(e, writer, ("copies made while held go", &SAID))
    }

    /// The spare of `e`'s keeper, if it has one, adopted into `writer`'s image, its fills
    /// checksummed in the engine's chunks; if not, said once (`said`) that `what` through the
    /// staging, and why.
    fn borrow_any(
        e: &DevEngine,
        writer: &Arc<ImageWriter>,
        (what, said): (&str, &std::sync::Once),
    ) -> Option<Arc<SpareSaver>> {
        let chunk = e.engine.config().chunk_size as u64;
        let path = e.keeper.as_ref()?.path();
        let mut keeper = possum_keeper::Keeper::connect(&path).ok()?;
        let lease = match keeper.spare_take(writer.temp_dir()) {
            Ok(l) => l,
            Err(err) => {
                said.call_once(|| {
                    log(&format!(
                        "device {}: {what} through the staging: {err}",
                        e.ordinal
                    ))
                });
                return None;
            }
        };
        let file = match writer.adopt_file(Path::new(&lease.path)) {
            Ok(f) => f,
            Err(err) => {
                log(&format!(
                    "device {}: the keeper's spare not taken: {err}",
                    e.ordinal
                ));
                let _ = keeper.spare_end(lease.drain);
                return None;
            }
        };
        Some(Arc::new(SpareSaver {
            keepers: parking_lot::Mutex::new(vec![keeper]),
            path,
            drain: lease.drain,
            file,
            len: lease.len,
            next: std::sync::atomic::AtomicU64::new(0),
            chunk,
            writer: Arc::downgrade(writer),
            dev: Arc::clone(e.engine.device()),
            ended: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// A connection to the keeper: one not in use, or a new one.
    fn keeper(&self) -> Result<possum_keeper::Keeper, possum_keeper::KeeperError> {
        match self.keepers.lock().pop() {
            Some(k) => Ok(k),
            None => possum_keeper::Keeper::connect(&self.path),
        }
    }

    /// Gives the spare back (once; dropping it does too): the keeper unmaps it; the file is the
    /// image's.
    pub(crate) fn end(&self) {
        if !self.ended.swap(true, std::sync::atomic::Ordering::SeqCst) {
            if let Err(err) = self.keeper().and_then(|mut k| k.spare_end(self.drain)) {
                log(&format!("giving the keeper's spare back: {err}"));
            }
        }
    }
}

impl Drop for SpareSaver {
    /// A spare not given back on the way (an error path) is given back now.
    fn drop(&mut self) {
        self.end();
    }
}

impl SpareSaver {
    /// Fills the spare with the `len` bytes at `offset` of buffer `buffer` (the keeper's
    /// allocation `alloc`), on a 2 MiB boundary of the file (whole huge pages), and records
    /// them in the image, a chunk per checksum.
    fn fill(&self, buffer: u64, alloc: u64, (offset, len): (u64, u64)) -> Result<(), String> {
        use std::sync::atomic::Ordering;
        let at = self
            .next
            .fetch_add(len.next_multiple_of(2 << 20), Ordering::Relaxed);
        if at.saturating_add(len) > self.len {
            return Err(format!("the spare ({} bytes) is full", self.len));
        }
        let mut keeper = self.keeper().map_err(|e| e.to_string())?;
        let crcs = keeper
            .spare_fill(&possum_keeper::SpareFill {
                drain: self.drain,
                alloc,
                offset,
                len,
                at,
                piece: self.chunk,
            })
            .map_err(|e| e.to_string())?;
        self.keepers.lock().push(keeper);
        if crcs.len() as u64 != len.div_ceil(self.chunk) {
            return Err(format!("{} checksums for {len} bytes", crcs.len()));
        }
        let writer = self.writer.upgrade().ok_or("the image is gone")?;
        for (k, crc) in crcs.into_iter().enumerate() {
            let off = k as u64 * self.chunk;
            let piece = self.chunk.min(len - off);
            writer
                .record_chunk(buffer, offset + off, piece, self.file, at + off, crc)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// The keeper's allocation at `va`.
    fn alloc(&self, va: u64) -> Result<u64, String> {
        (self.dev.owned_id(va)).ok_or_else(|| format!("the memory at {va:#x} is not the keeper's"))
    }
}

impl possum_engine::store::ShadowSaver for SpareSaver {
    fn save(
        &self,
        buffer: u64,
        shadow: possum_engine::device::DevPtr,
        size: u64,
    ) -> Result<(), String> {
        self.fill(buffer, self.alloc(shadow.0)?, (0, size))
    }

    /// Each run of adjacent chunks in one fill.
    fn save_chunks(
        &self,
        buffer: u64,
        at: possum_engine::device::DevPtr,
        size: u64,
        (offsets, chunk): (&[u64], u64),
    ) -> Result<(), String> {
        if chunk != self.chunk {
            return Err(format!(
                "chunks of {chunk} bytes, not the image's {}",
                self.chunk
            ));
        }
        let alloc = self.alloc(at.0)?;
        (runs(offsets, size, chunk).into_iter()).try_for_each(|run| self.fill(buffer, alloc, run))
    }
}

/// The chunks at `offsets` (each `chunk` bytes, the last of `size` bytes shorter) as runs of
/// adjacent ones: (offset, length), in order.
fn runs(offsets: &[u64], size: u64, chunk: u64) -> Vec<(u64, u64)> {
    let chunks = offsets
        .iter()
        .map(|&off| (off, chunk.min(size.saturating_sub(off))));
    possum_engine::image::merged_ranges(chunks.collect())
}

#[cfg(test)]
mod tests {
    /// Adjacent chunks make one run, in any order given; the buffer's last chunk is shorter.
    #[test]
    fn adjacent_chunks_are_filled_as_one_run() {
        let chunk = 4u64 << 20;
        let size = 5 * chunk - 1000;
        let offsets = [3 * chunk, 0, chunk, 4 * chunk];
        assert_eq!(
            super::runs(&offsets, size, chunk),
            vec![(0, 2 * chunk), (3 * chunk, 2 * chunk - 1000)]
        );
        assert!(super::runs(&[], size, chunk).is_empty());
    }
}
