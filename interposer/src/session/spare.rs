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

impl possum_engine::store::ShadowSaver for SpareSaver {
    fn save(
        &self,
        buffer: u64,
        shadow: possum_engine::device::DevPtr,
        size: u64,
    ) -> Result<(), String> {
        use std::sync::atomic::Ordering;
        let alloc = self
            .dev
            .owned_id(shadow.0)
            .ok_or_else(|| format!("the memory at {:#x} is not the keeper's", shadow.0))?;
        // Each shadow on a 2 MiB boundary of the file (whole huge pages).
        let at = self
            .next
            .fetch_add(size.next_multiple_of(2 << 20), Ordering::Relaxed);
        if at.saturating_add(size) > self.len {
            return Err(format!("the spare ({} bytes) is full", self.len));
        }
        let mut keeper = self.keeper().map_err(|e| e.to_string())?;
        let crcs = keeper
            .spare_fill(&possum_keeper::SpareFill {
                drain: self.drain,
                alloc,
                offset: 0,
                len: size,
                at,
                piece: self.chunk,
            })
            .map_err(|e| e.to_string())?;
        self.keepers.lock().push(keeper);
        if crcs.len() as u64 != size.div_ceil(self.chunk) {
            return Err(format!("{} checksums for {size} bytes", crcs.len()));
        }
        let writer = self.writer.upgrade().ok_or("the image is gone")?;
        for (k, crc) in crcs.into_iter().enumerate() {
            let off = k as u64 * self.chunk;
            let len = self.chunk.min(size - off);
            writer
                .record_chunk(buffer, off, len, self.file, at + off, crc)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}
