//! [`KeeperMemory`]: a keeper as the memory owner of a job's `CudaDevice`.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use possum_cuda::owner::{owner_error, unreachable_error, MemoryOwner, Owned, OwnerStatus};
use possum_engine::device::DeviceResult;

use crate::{Keeper, KeeperError};

/// The keeper at a socket path, reached by a new connection for each request: no connection of
/// the job's outlives a request, so none is inherited by a process it forks (a DataLoader worker)
/// or found in its image by CRIU. The keeper owns the memory by the job's pid, not by connection.
#[derive(Debug)]
pub struct KeeperMemory {
    /// The socket; another of the same keeper directory's once the process's device moved
    /// ([`KeeperMemory::follow_device`]).
    path: std::sync::RwLock<PathBuf>,
}

impl KeeperMemory {
    /// Checks that the keeper at `path` answers now, so that a keeper that is not there is known
    /// at once.
    pub fn connect(path: &Path) -> Result<KeeperMemory, KeeperError> {
        Keeper::connect(path)?;
        Ok(KeeperMemory {
            path: std::sync::RwLock::new(path.to_path_buf()),
        })
    }

    /// The keeper's socket.
    pub fn path(&self) -> PathBuf {
        self.path.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The process's device is now the one with UUID `uuid` (a job restored onto another GPU
    /// keeps its device ordinal): its memory comes from the socket of the same keeper directory
    /// that serves that device from now on. The socket, or `None` (left as it was) if none
    /// serves it.
    pub fn follow_device(&self, uuid: &[u8; 16]) -> Option<PathBuf> {
        let dir = self.path().parent()?.to_path_buf();
        let sock = crate::keeper_for_device(&dir, &crate::uuid_hex(uuid))?;
        *self.path.write().unwrap_or_else(|p| p.into_inner()) = sock.clone();
        Some(sock)
    }

    /// Runs `f` on a new connection.
    fn with<T>(
        &self,
        what: &'static str,
        f: impl FnOnce(&mut Keeper) -> Result<T, KeeperError>,
    ) -> DeviceResult<T> {
        let mut k =
            Keeper::connect(&self.path()).map_err(|e| unreachable_error(what, e.to_string()))?;
        f(&mut k).map_err(|e| owner_error(what, e.to_string()))
    }
}

impl KeeperMemory {
    /// The keeper's stage of this process's restore from `image` (one device's image
    /// directory), if it has one: the memory it prepared for each buffer, and its loads to wait
    /// for ([`possum_engine::Staged`]).
    pub fn staged(&self, image: &Path) -> Result<Option<KeeperStage>, KeeperError> {
        let path = self.path();
        let plan = Keeper::connect(&path)?.staged(image)?;
        Ok(plan.map(|plan| KeeperStage {
            path,
            stage: plan.stage,
            epoch: plan.epoch,
            buffers: plan.buffers.into_iter().map(|b| (b.buf, b)).collect(),
        }))
    }
}

/// A keeper's stage of a restore, as the restoring engine uses it: a buffer's prepared memory is
/// taken back like kept memory (its allocation, the stage's epoch), and waited for through a new
/// connection per wait (a restorer and a hook may wait at once).
#[derive(Debug)]
pub struct KeeperStage {
    path: PathBuf,
    stage: u64,
    epoch: u64,
    buffers: std::collections::HashMap<u64, crate::StagedBuffer>,
}

impl KeeperStage {
    /// The stage's id at its keeper.
    pub fn id(&self) -> u64 {
        self.stage
    }

    /// Buffers the keeper loads.
    pub fn buffers(&self) -> usize {
        self.buffers.len()
    }
}

impl possum_engine::Staged for KeeperStage {
    fn memory_of(&self, buffer: u64) -> Option<possum_engine::StagedMemory> {
        self.buffers
            .get(&buffer)
            .map(|b| possum_engine::StagedMemory {
                id: b.alloc,
                epoch: self.epoch,
                size: b.alloc_size,
            })
    }

    fn wait_loaded(&self, buffer: u64) -> Result<(), String> {
        let b = self
            .buffers
            .get(&buffer)
            .ok_or_else(|| format!("buffer {buffer} is not staged"))?;
        Keeper::connect(&self.path)
            .and_then(|mut k| k.stage_wait(self.stage, b.alloc))
            .map_err(|e| e.to_string())
    }

    fn finished(&self) {
        if let Ok(mut k) = Keeper::connect(&self.path) {
            let _ = k.stage_end(self.stage);
        }
    }
}

impl MemoryOwner for KeeperMemory {
    fn create(&self, size: u64) -> DeviceResult<Owned> {
        let (a, fd) = self.with("keeper alloc", |k| k.alloc(size))?;
        Ok(Owned {
            id: a.id,
            size: a.size,
            fd,
            device: a.device.as_deref().and_then(crate::uuid_from_hex),
        })
    }

    fn free(&self, id: u64) -> DeviceResult<()> {
        self.with("keeper free", |k| k.free(id))
    }

    fn keep(&self, id: u64, epoch: u64, hold_secs: u64, va: u64) -> DeviceResult<()> {
        self.with("keeper retain", |k| {
            k.retain_at(id, epoch, hold_secs, Some(va))
        })
    }

    fn reclaim(&self, id: u64, epoch: u64) -> DeviceResult<OwnedFd> {
        self.with("keeper reclaim", |k| k.reclaim(id, epoch))
            .map(|(_, fd)| fd)
    }

    fn release_kept(&self, id: u64, epoch: u64) -> DeviceResult<()> {
        self.with("keeper release_retained", |k| {
            k.release_retained_of(id, Some(epoch))
        })
    }

    fn share(&self, id: u64) -> DeviceResult<OwnedFd> {
        self.with("keeper share", |k| k.share(id))
    }

    fn alive(&self) -> bool {
        self.with("keeper stats", |k| k.stats()).is_ok()
    }

    fn status(&self) -> OwnerStatus {
        let mut st = OwnerStatus {
            name: format!("keeper {} (does not answer)", self.path().display()),
            ..OwnerStatus::default()
        };
        if let Ok(s) = self.with("keeper stats", |k| k.stats()) {
            st.reachable = true;
            st.name = format!("keeper {}", self.path().display());
            let mine = s
                .clients
                .get(&(std::process::id() as i32))
                .copied()
                .unwrap_or_default();
            st.allocations = mine.allocations;
            st.bytes = mine.bytes;
            st.retained_bytes = s.retained.bytes.min(mine.bytes);
            st.spare = s.spare.map(|sp| {
                format!(
                    "{} MiB in {} ({}{}){}",
                    sp.bytes >> 20,
                    sp.dir,
                    if sp.ready { "ready" } else { "not ready" },
                    if sp.lent > 0 {
                        ", one lent to a drain"
                    } else {
                        ""
                    },
                    sp.error.map(|e| format!("; {e}")).unwrap_or_default()
                )
            });
        }
        st
    }
}
