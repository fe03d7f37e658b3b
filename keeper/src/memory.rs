//! [`KeeperMemory`]: a keeper as the memory owner of a job's `CudaDevice`.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use possum_cuda::owner::{owner_error, MemoryOwner, Owned, UNREACHABLE};
use possum_engine::device::{DeviceError, DeviceResult};

use crate::{Keeper, KeeperError};

/// A connection to the keeper at a socket path, opened when first needed and again after
/// [`MemoryOwner::disconnect`] (a job closes it before CRIU dumps it, so that its image holds no
/// socket to the keeper).
#[derive(Debug)]
pub struct KeeperMemory {
    path: PathBuf,
    conn: Mutex<Option<Keeper>>,
}

impl KeeperMemory {
    /// Connects to the keeper at `path` now, so that a keeper that is not there is known at once.
    pub fn connect(path: &Path) -> Result<KeeperMemory, KeeperError> {
        let k = Keeper::connect(path)?;
        Ok(KeeperMemory {
            path: path.to_path_buf(),
            conn: Mutex::new(Some(k)),
        })
    }

    /// The keeper's socket.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the connection (opened again if closed). A failed connection is dropped, so
    /// the next call opens a new one.
    fn with<T>(
        &self,
        what: &'static str,
        f: impl FnOnce(&mut Keeper) -> Result<T, KeeperError>,
    ) -> DeviceResult<T> {
        let mut g: MutexGuard<'_, Option<Keeper>> =
            self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            let k = Keeper::connect(&self.path).map_err(|e| DeviceError::Backend {
                call: what,
                code: UNREACHABLE,
                message: e.to_string(),
            })?;
            *g = Some(k);
        }
        let k = g.as_mut().expect("connected above");
        f(k).map_err(|e| {
            if matches!(e, KeeperError::Io { .. } | KeeperError::Protocol { .. }) {
                *g = None;
            }
            owner_error(what, e.to_string())
        })
    }
}

impl MemoryOwner for KeeperMemory {
    fn create(&self, size: u64) -> DeviceResult<Owned> {
        let (a, fd) = self.with("keeper alloc", |k| k.alloc(size))?;
        Ok(Owned {
            id: a.id,
            size: a.size,
            fd,
        })
    }

    fn free(&self, id: u64) -> DeviceResult<()> {
        self.with("keeper free", |k| k.free(id))
    }

    fn keep(&self, id: u64) -> DeviceResult<()> {
        self.with("keeper retain", |k| k.retain(id))
    }

    fn reclaim(&self, id: u64) -> DeviceResult<OwnedFd> {
        self.with("keeper reclaim", |k| k.reclaim(id))
            .map(|(_, fd)| fd)
    }

    fn disconnect(&self) {
        *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    fn alive(&self) -> bool {
        self.with("keeper stats", |k| k.stats()).is_ok()
    }

    fn unreachable(&self, e: &DeviceError) -> bool {
        matches!(e, DeviceError::Backend { code, .. } if *code == UNREACHABLE)
    }
}
