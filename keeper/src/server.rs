//! The keeper's side: [`Server`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use possum_control::EnvConfig;
use possum_cuda::share::{ShareDevice, SharedMem};
use serde_json::{json, Value};

use crate::process::alive;
use crate::spare;
use crate::stage::{self, Reuse, Stage};
use crate::PEER_MISSES_SAID;
use crate::{
    fdpass, Allocated, DeviceInfo, KeeperError, PeerSource, Request, Retained, RetainedAlloc,
    StageInfo, StagePlan, StagedBuffer, Stats, Usage, MAX_REQUEST_BYTES,
};

/// A keeper: a listening socket and the memory it holds. Cheap to clone (shared); run
/// [`serve`](Server::serve) on one thread and look at it ([`stats`](Server::stats),
/// [`read`](Server::read)) from another.
#[derive(Debug, Clone)]
pub struct Server {
    inner: Arc<Inner>,
}

/// What a request is answered with: the reply, and the descriptor sent with it if any.
type Answer = Result<(Value, Option<std::os::fd::OwnedFd>), KeeperError>;

#[derive(Debug)]
struct Inner {
    listener: UnixListener,
    path: PathBuf,
    /// The device, opened at the first request that needs it (a keeper serving every GPU of a
    /// machine makes a context only on those its jobs use).
    dev: OnceLock<ShareDevice>,
    ordinal: usize,
    dev_init: Mutex<()>,
    uid: u32,
    state: Mutex<State>,
    /// Restores being staged, by id ([`crate::stage`]).
    stages: Mutex<BTreeMap<u64, Arc<Stage>>>,
    /// The last stages ended, as they stood then (`stats`' `stages_ended`).
    ended: Mutex<std::collections::VecDeque<crate::StageStats>>,
    next_stage: std::sync::atomic::AtomicU64,
    /// Spare image memory, when configured ([`crate::spare`]).
    spares: Option<Arc<crate::spare::Spares>>,
    /// This keeper's instance, random: `identify` says it and `peer_share` must name it (the
    /// allocation ids of a keeper started again begin anew).
    instance: u64,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    allocs: BTreeMap<u64, Alloc>,
}

impl State {
    /// Keeps `a` under a new id, which it returns.
    fn insert(&mut self, a: Alloc) -> u64 {
        self.next_id += 1;
        self.allocs.insert(self.next_id, a);
        self.next_id
    }
}

#[derive(Debug)]
struct Alloc {
    mem: SharedMem,
    /// The process that made it (or took it back): it is freed once that process is gone.
    pid: i32,
    /// No handle to it in `pid` now (detached for a checkpoint); only `pid` may reclaim it.
    retained: bool,
    /// The checkpoint it was retained for (`reclaim` must name it).
    epoch: u64,
    /// Retained: kept until then after `pid` is gone.
    hold_until: Option<Instant>,
    /// Where `pid` mapped it, as its `retain` said (a stage on another device matches by it).
    va: Option<u64>,
    /// The fd `share` handed out of it (one export, duplicated for every `share` and
    /// `peer_share`), so that `identify` knows an fd of it again in the hands of whoever
    /// imported it.
    shared: Option<std::os::fd::OwnedFd>,
}

impl Alloc {
    /// Whether it is kept for a restore although its process is gone (or may be).
    fn held(&self, now: Instant) -> bool {
        self.retained && self.hold_until.is_some_and(|t| t > now)
    }
}

impl Server {
    /// Opens device `device` and listens at `path` (a stale socket file there is replaced).
    pub fn bind(path: &Path, device: usize) -> Result<Server, KeeperError> {
        let s = Self::bind_lazy(path, device)?;
        s.inner.dev()?;
        Ok(s)
    }

    /// Listens at `path` for device `device`, which is opened at the first request that needs it.
    pub fn bind_lazy(path: &Path, device: usize) -> Result<Server, KeeperError> {
        let sock_err = |op, source| KeeperError::Socket {
            path: path.to_path_buf(),
            op,
            source,
        };
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(sock_err("remove the old socket", e)),
        }
        let listener = UnixListener::bind(path).map_err(|e| sock_err("bind", e))?;
        Ok(Server {
            inner: Arc::new(Inner {
                listener,
                path: path.to_path_buf(),
                dev: OnceLock::new(),
                ordinal: device,
                dev_init: Mutex::new(()),
                uid: nix::unistd::geteuid().as_raw(),
                state: Mutex::new(State::default()),
                stages: Mutex::new(BTreeMap::new()),
                ended: Mutex::new(std::collections::VecDeque::new()),
                next_stage: std::sync::atomic::AtomicU64::new(0),
                spares: crate::spare::SpareConfig::from_config(&crate::config::Config::from_env())
                    .map(|c| Arc::new(crate::spare::Spares::new(c))),
                instance: new_instance(),
            }),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Accepts clients for ever, one thread each (and one that frees orphans whose process is
    /// gone, every [`crate::ORPHAN_CHECK`]). Returns only if accepting fails.
    pub fn serve(&self) -> Result<(), KeeperError> {
        // Spare image memory, if configured, is made at once (it takes seconds).
        self.inner.replenish_spare();
        let weak = Arc::downgrade(&self.inner);
        let _ = std::thread::Builder::new()
            .name("possum-keeper-orphans".to_string())
            .spawn(move || loop {
                std::thread::sleep(crate::ORPHAN_CHECK);
                match weak.upgrade() {
                    Some(inner) => {
                        let _ = inner.free_orphans_of_dead();
                    }
                    None => return,
                }
            });
        loop {
            let (stream, _) = match self.inner.listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(KeeperError::Socket {
                        path: self.inner.path.clone(),
                        op: "accept",
                        source,
                    })
                }
            };
            let inner = self.inner.clone();
            std::thread::Builder::new()
                .name("possum-keeper-conn".to_string())
                .spawn(move || inner.connection(stream))
                .map_err(|source| KeeperError::Io {
                    op: "spawn a connection thread",
                    source,
                })?;
        }
    }

    /// The accounting, as `stats` answers it.
    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// Frees the allocations of processes that are gone now, without waiting for the periodic
    /// check (for tests).
    #[doc(hidden)]
    pub fn free_orphans_now(&self) {
        self.inner.free_orphans_of_dead();
    }

    /// (free, total) bytes of the keeper's device, as the driver says.
    pub fn device_mem_info(&self) -> Result<(u64, u64), KeeperError> {
        Ok(self.inner.dev()?.mem_info()?)
    }

    /// Reads `len` bytes at `offset` of allocation `id`, through a mapping of the keeper's own.
    pub fn read(&self, id: u64, offset: u64, len: usize) -> Result<Vec<u8>, KeeperError> {
        let st = self.inner.lock();
        let a = st
            .allocs
            .get(&id)
            .ok_or(KeeperError::NoSuchAllocation(id))?;
        let res = self.inner.dev()?.reserve(a.mem.size())?;
        let m = a.mem.map(&res, 0)?;
        let mut out = vec![0u8; len];
        m.read(offset, &mut out)?;
        Ok(out)
    }
}

impl Inner {
    fn dev(&self) -> Result<&ShareDevice, KeeperError> {
        if let Some(d) = self.dev.get() {
            return Ok(d);
        }
        let _g = self.dev_init.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = self.dev.get() {
            return Ok(d);
        }
        let d = ShareDevice::open(self.ordinal)?;
        Ok(self.dev.get_or_init(|| d))
    }

    /// Makes a spare in the background if spares are configured and none is ready or being made
    /// (the device opened first).
    fn replenish_spare(self: &Arc<Self>) {
        let Some(sp) = self.spares.clone().filter(|sp| sp.should_make()) else {
            return;
        };
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("possum-keeper-spare".to_string())
            .spawn({
                let sp = Arc::clone(&sp);
                move || {
                    let t = Instant::now();
                    let r = me
                        .dev()
                        .map_err(spare::MakeError::from)
                        .and_then(|d| sp.make(d, || me.wait_until_quiet()));
                    sp.made(r, t.elapsed());
                }
            });
        if let Err(e) = spawned {
            sp.made(Err(spare::MakeError::Thread(e)), Duration::ZERO);
        }
    }

    /// Waits (up to a minute) while a job this keeper serves is being checkpointed or killed and
    /// kept for a restore (memory retained: its image may still be written from it, or its
    /// restore be under way), drained into a spare or restored (a stage loading): making a spare
    /// meanwhile would slow them (the driver serializes registrations with the job's own memory
    /// calls, and the kernel zeroing new pages takes memory bandwidth).
    fn wait_until_quiet(&self) {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(60) {
            let held = self.lock().allocs.values().any(|a| a.retained);
            let lent = self.spares.as_ref().is_some_and(|sp| sp.any_lent());
            let staging = self.lock_stages().values().any(|x| !x.is_done());
            if !(held || lent || staging) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn spares(&self) -> Result<&Arc<crate::spare::Spares>, KeeperError> {
        self.spares.as_ref().ok_or_else(|| {
            KeeperError::Spare(
                "this keeper keeps no spare image memory (POSSUM_KEEPER_SPARE_DIR, \
                 POSSUM_KEEPER_SPARE_MIB)"
                    .into(),
            )
        })
    }

    /// A new fd for allocation `id`, if `allowed`: a fresh export of it (reply like `alloc`'s).
    fn another_fd(
        &self,
        id: u64,
        allowed: impl FnOnce(&Alloc) -> Result<(), KeeperError>,
    ) -> Answer {
        self.fd_of(id, allowed, |a| Ok(a.mem.export()?))
    }

    /// A duplicate of allocation `id`'s shared fd (made at the first), if `allowed`; reply like
    /// `alloc`'s.
    fn shared_fd(&self, id: u64, allowed: impl FnOnce(&Alloc) -> bool) -> Answer {
        let allowed = |a: &Alloc| {
            allowed(a)
                .then_some(())
                .ok_or(KeeperError::NoSuchAllocation(id))
        };
        self.fd_of(id, allowed, |a| {
            let shared = match &a.shared {
                Some(fd) => fd,
                None => a.shared.insert(a.mem.export()?),
            };
            shared.try_clone().map_err(|source| KeeperError::Io {
                op: "duplicate a shared fd",
                source,
            })
        })
    }

    /// Allocation `id`'s fd that `fd` makes, if `allowed`, with a reply like `alloc`'s.
    fn fd_of(
        &self,
        id: u64,
        allowed: impl FnOnce(&Alloc) -> Result<(), KeeperError>,
        fd: impl FnOnce(&mut Alloc) -> Result<std::os::fd::OwnedFd, KeeperError>,
    ) -> Answer {
        let mut st = self.lock();
        let a = st
            .allocs
            .get_mut(&id)
            .ok_or(KeeperError::NoSuchAllocation(id))?;
        allowed(a)?;
        let fd = fd(a)?;
        let r = Allocated {
            id,
            size: a.mem.size(),
            device: None,
        };
        Ok((json!(r), Some(fd)))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn connection(self: &Arc<Self>, stream: UnixStream) {
        // A client that does not take its replies is dropped rather than holding its thread.
        let _ = stream.set_write_timeout(Some(crate::REPLY_TIMEOUT));
        let pid = match getsockopt(&stream, PeerCredentials) {
            Ok(c) if c.uid() == self.uid => c.pid(),
            Ok(c) => {
                let msg = format!(
                    "uid {} is not the keeper's uid {}: connection refused",
                    c.uid(),
                    self.uid
                );
                let _ = reply(&stream, &json!({ "error": msg }), None);
                return;
            }
            Err(e) => {
                let msg = format!("SO_PEERCRED: {e}");
                let _ = reply(&stream, &json!({ "error": msg }), None);
                return;
            }
        };
        let hello = json!({ "keeper": 1, "pid": std::process::id() });
        if reply(&stream, &hello, None).is_ok() {
            self.requests(&stream, pid);
        }
    }

    fn requests(self: &Arc<Self>, stream: &UnixStream, pid: i32) {
        let mut pending = Vec::new();
        loop {
            // A request may come with a descriptor (`adopt`); any others are closed unread.
            let mut fds = Vec::new();
            let line = match fdpass::recv_line(
                stream,
                &mut pending,
                &mut fds,
                MAX_REQUEST_BYTES,
                None,
            ) {
                Ok(Some(l)) => l,
                Ok(None) => return,
                Err(e) => {
                    let _ = reply(
                        stream,
                        &json!({ "error": format!("request over {MAX_REQUEST_BYTES} bytes or cut short ({e})") }),
                        None,
                    );
                    return;
                }
            };
            let req: Request = match serde_json::from_str(&line) {
                Ok(r) => r,
                Err(e) => {
                    let msg = format!("bad request: {e}");
                    if reply(stream, &json!({ "error": msg }), None).is_err() {
                        return;
                    }
                    continue;
                }
            };
            let sent = match self.handle(req, pid, fds) {
                Ok((v, Some(mem_fd))) => {
                    use std::os::fd::AsFd;
                    reply(stream, &v, Some(mem_fd.as_fd()))
                }
                Ok((v, None)) => reply(stream, &v, None),
                Err(e) => reply(stream, &json!({ "error": e.to_string() }), None),
            };
            if sent.is_err() {
                return;
            }
        }
    }

    /// The answer to one request of process `pid`, with the descriptors that came with it: a
    /// reply and the descriptor to send with it, if any.
    fn handle(self: &Arc<Self>, req: Request, pid: i32, fds: Vec<std::os::fd::OwnedFd>) -> Answer {
        match req {
            Request::Retained { pid: of } => self.retained(of),
            Request::Dup { id } => self.another_fd(id, |a| {
                if a.retained {
                    Ok(())
                } else {
                    Err(KeeperError::NotRetained(id))
                }
            }),
            // Another process's memory is not handed out here, nor memory whose process holds
            // no handle to it (detached for a checkpoint).
            Request::Share { id } => self.shared_fd(id, |a| a.pid == pid && !a.retained),
            // Any process of the keeper's uid may take again what it imported: it had the fd.
            Request::PeerShare {
                id,
                owner,
                instance,
            } => self.shared_fd(id, |a| a.pid == owner && instance == self.instance),
            Request::Identify => self.identify(fds),
            Request::Adopt(a) => self.adopt(&a, fds),
            Request::Alloc { size } => self.alloc(size, pid),
            Request::Free { id } => self.free(id),
            Request::Retain {
                id,
                epoch,
                hold_secs,
                va,
            } => self.retain(id, pid, epoch, hold_secs, va),
            Request::Reclaim { id, epoch } => self.reclaim(id, pid, epoch),
            Request::ReleaseRetained { id, epoch } => self.release_retained(id, epoch),
            Request::Stats => Ok((json!(self.stats()), None)),
            Request::Reap => self.reap(),
            Request::Stage {
                pid: of,
                image,
                hold_secs,
                from,
                base,
                ahead,
                pending,
            } => {
                let base = base.map(|b| self.take_prestage(b, pid)).transpose()?;
                let how = Staging {
                    hold_secs,
                    from: from.as_ref(),
                    pending: &pending,
                    ahead,
                };
                // (Ahead: the caller's memory, as a prestage's.)
                self.stage(if ahead { pid } else { of }, &image, &how, base)
            }
            Request::Prestage {
                image,
                hold_secs,
                present,
            } => self.prestage(pid, &image, hold_secs, present.as_ref()),
            Request::SpareTake { dir } => self.spare_take(&dir, pid),
            Request::SpareFill(f) => self.spare_fill(&f, pid),
            Request::SpareEnd { drain } => self.spare_end(drain, pid),
            Request::Device => self.device(),
            Request::Staged { image } => self.staged(&image, pid),
            Request::StageWait { stage, alloc } => self.stage_wait(stage, alloc),
            Request::StageEnd { stage } => self.stage_end(stage),
            Request::StageArrived { stage, pieces } => {
                let pending = self.stage_of(stage)?.arrived(&pieces);
                Ok((json!(crate::StageArrived { pending }), None))
            }
            Request::StageGrown { stage, files } => {
                let pending = self.stage_of(stage)?.grown(&files);
                Ok((json!(crate::StageArrived { pending }), None))
            }
            Request::StageRewritten { stage, pieces } => {
                let s = self.stage_of(stage)?;
                if s.draft.is_none() {
                    return Err(KeeperError::Stage(format!(
                        "stage {stage} is not a prestage"
                    )));
                }
                let chunks = s.rewritten(&pieces);
                Ok((json!(crate::StageRewritten { chunks }), None))
            }
            // The stage's own lock only, as `stage_wait`: a long poll holds up nobody else.
            Request::StageDemands { stage, wait_ms } => {
                let pieces = self
                    .stage_of(stage)?
                    .demands(Duration::from_millis(wait_ms));
                Ok((json!(crate::StageDemands { pieces }), None))
            }
        }
    }

    /// `retained`: the allocations process `of` retained, with what is left of their holds.
    fn retained(&self, of: i32) -> Answer {
        let now = Instant::now();
        let st = self.lock();
        let allocs: Vec<RetainedAlloc> = st
            .allocs
            .iter()
            .filter(|(_, a)| a.retained && a.pid == of)
            .map(|(&id, a)| RetainedAlloc {
                id,
                size: a.mem.size(),
                epoch: a.epoch,
                hold_secs: a
                    .hold_until
                    .map_or(0, |t| t.saturating_duration_since(now).as_secs()),
                pid: a.pid,
                va: a.va,
            })
            .collect();
        Ok((json!(Retained { allocs }), None))
    }

    /// `identify`: which allocation the one descriptor that came with it shares, if any.
    fn identify(&self, fds: Vec<std::os::fd::OwnedFd>) -> Answer {
        let [fd] = <[_; 1]>::try_from(fds).map_err(|fds| KeeperError::Protocol {
            request: "identify",
            detail: format!("{} descriptors came with it, not 1", fds.len()),
        })?;
        use std::os::fd::AsFd;
        let st = self.lock();
        let identified = st.allocs.iter().find_map(|(&id, a)| {
            let shared = a.shared.as_ref()?;
            fdpass::same_file(shared.as_fd(), fd.as_fd()).then(|| crate::Identified {
                id,
                size: a.mem.size(),
                owner: a.pid,
                instance: self.instance,
            })
        });
        Ok((json!(crate::Identify { identified }), None))
    }

    /// `adopt`: the memory of the one descriptor that came with it, kept as retained allocation
    /// `a`.
    fn adopt(&self, a: &RetainedAlloc, mut fds: Vec<std::os::fd::OwnedFd>) -> Answer {
        if fds.len() != 1 {
            return Err(KeeperError::Protocol {
                request: "adopt",
                detail: format!("{} descriptors came with it, not 1", fds.len()),
            });
        }
        let fd = fds.remove(0);
        let dev = self.dev()?;
        // Adopted, not imported: the driver exports no imported handle again, and this
        // keeper must hand the memory out (reclaim, dup) like its own.
        let mem = dev.adopt(fd, a.size)?;
        let mut st = self.lock();
        if st.allocs.contains_key(&a.id) {
            return Err(KeeperError::Protocol {
                request: "adopt",
                detail: format!("allocation {} exists here already", a.id),
            });
        }
        st.next_id = st.next_id.max(a.id);
        st.allocs.insert(
            a.id,
            Alloc {
                mem,
                pid: a.pid,
                retained: true,
                epoch: a.epoch,
                hold_until: hold_until(a.hold_secs),
                va: a.va,
                shared: None,
            },
        );
        Ok((json!({ "ok": true }), None))
    }

    /// `alloc`: `size` bytes (rounded up to the granularity) of new memory for process `pid`,
    /// its descriptor sent with the reply.
    fn alloc(self: &Arc<Self>, size: u64, pid: i32) -> Answer {
        let dev = self.dev()?;
        let g = dev.granularity();
        let rounded = size
            .max(1)
            .checked_next_multiple_of(g)
            .ok_or(KeeperError::Protocol {
                request: "alloc",
                detail: format!("size {size} too large"),
            })?;
        let mem = self.create(dev, rounded)?;
        let fd = mem.export()?;
        let id = self.lock().insert(Alloc {
            mem,
            pid,
            retained: false,
            epoch: 0,
            hold_until: None,
            va: None,
            shared: None,
        });
        let a = Allocated {
            id,
            size: rounded,
            device: dev.uuid().ok().map(|u| crate::uuid_hex(&u)),
        };
        Ok((json!(a), Some(fd)))
    }

    /// `free`: allocation `id` dropped.
    fn free(&self, id: u64) -> Answer {
        let removed = self.lock().allocs.remove(&id);
        removed.ok_or(KeeperError::NoSuchAllocation(id))?;
        Ok((json!({ "ok": true }), None))
    }

    /// `retain`: process `pid`'s allocation `id` kept for it (in `epoch`, for `hold_secs`, at
    /// `va`) while it has no handle to it.
    fn retain(&self, id: u64, pid: i32, epoch: u64, hold_secs: u64, va: Option<u64>) -> Answer {
        let mut st = self.lock();
        let a = st
            .allocs
            .get_mut(&id)
            .ok_or(KeeperError::NoSuchAllocation(id))?;
        if a.pid != pid {
            return Err(KeeperError::NoSuchAllocation(id));
        }
        a.retained = true;
        a.epoch = epoch;
        a.hold_until = hold_until(hold_secs);
        a.va = va;
        Ok((json!({ "ok": true }), None))
    }

    /// `reclaim`: retained allocation `id` of `epoch` handed back to process `pid`, its
    /// descriptor sent with the reply.
    fn reclaim(&self, id: u64, pid: i32, epoch: u64) -> Answer {
        let mut st = self.lock();
        let a = st
            .allocs
            .get_mut(&id)
            .ok_or(KeeperError::NoSuchAllocation(id))?;
        // Only the process that retained it takes it back (a job restored by CRIU has
        // its pid again).
        if !a.retained || a.pid != pid {
            return Err(KeeperError::NotRetained(id));
        }
        if a.epoch != epoch {
            return Err(KeeperError::OtherEpoch(id));
        }
        let fd = a.mem.export()?;
        a.retained = false;
        a.hold_until = None;
        let r = Allocated {
            id,
            size: a.mem.size(),
            device: None,
        };
        Ok((json!(r), Some(fd)))
    }

    /// `release_retained`: retained allocation `id` (of `epoch`, if given) dropped.
    fn release_retained(&self, id: u64, epoch: Option<u64>) -> Answer {
        let mut st = self.lock();
        match st.allocs.get(&id) {
            None => return Err(KeeperError::NoSuchAllocation(id)),
            Some(a) if !a.retained => return Err(KeeperError::NotRetained(id)),
            Some(a) if epoch.is_some_and(|e| e != a.epoch) => {
                return Err(KeeperError::OtherEpoch(id))
            }
            Some(_) => {}
        }
        let removed = st.allocs.remove(&id);
        drop(st);
        drop(removed);
        Ok((json!({ "ok": true }), None))
    }

    /// `reap`: the allocations of processes that are gone freed, counted.
    fn reap(self: &Arc<Self>) -> Answer {
        let (freed, freed_bytes) = self.free_orphans_of_dead();
        Ok((
            json!({"ok": true, "freed": freed, "freed_bytes": freed_bytes}),
            None,
        ))
    }

    /// `spare_take`: a spare file for the image in `dir` lent to process `pid`.
    fn spare_take(&self, dir: &str, pid: i32) -> Answer {
        let lease = self
            .spares()?
            .take(Path::new(dir), pid)
            .map_err(|e| KeeperError::Spare(e.to_string()))?;
        Ok((json!(lease), None))
    }

    /// `spare_fill`: part of process `pid`'s allocation copied into the spare lent to its
    /// drain, each piece's CRC32C in the reply.
    fn spare_fill(&self, f: &crate::SpareFill, pid: i32) -> Answer {
        let sp = self.spares()?;
        let spare = sp
            .lent(f.drain, pid)
            .map_err(|e| KeeperError::Spare(e.to_string()))?;
        let dev = self.dev()?;
        let src = {
            let st = self.lock();
            match st.allocs.get(&f.alloc) {
                Some(a) if a.pid == pid => dev.map_owned(&a.mem)?,
                _ => return Err(KeeperError::NoSuchAllocation(f.alloc)),
            }
        };
        let crcs = sp
            .fill(dev, &spare, &Arc::new(src), f)
            .map_err(|e| KeeperError::Spare(e.to_string()))?;
        Ok((json!(crate::SpareFilled { crcs }), None))
    }

    /// `spare_end`: the spare lent to `drain` of process `pid` given back (dropped on a thread of
    /// its own), and another made ready.
    fn spare_end(self: &Arc<Self>, drain: u64, pid: i32) -> Answer {
        let sp = self.spares()?;
        let Some(spare) = sp.end(drain, pid) else {
            return Err(KeeperError::Spare(
                spare::LendError::NotLent(drain).to_string(),
            ));
        };
        // Unregistering and unmapping tens of GiB takes most of a second: not on the
        // drain's path (the file is the image's already).
        let _ = std::thread::Builder::new()
            .name("possum-keeper-spare-end".to_string())
            .spawn(move || drop(spare));
        self.replenish_spare();
        Ok((json!({ "ok": true }), None))
    }

    /// `device`: the keeper's device, by UUID and ordinal.
    fn device(&self) -> Answer {
        let dev = self.dev()?;
        let info = DeviceInfo {
            uuid: crate::uuid_hex(&dev.uuid()?),
            ordinal: self.ordinal,
        };
        Ok((json!(info), None))
    }

    /// `staged`: the stage made for process `pid` from `image`; `null` when there is none (not
    /// an error: most restores have none).
    fn staged(&self, image: &str, pid: i32) -> Answer {
        let path = canonical(image)?;
        let plan = self
            .lock_stages()
            .values()
            .find(|s| s.pid == pid && s.image == path && s.draft.is_none())
            .map(|s| StagePlan {
                stage: s.id,
                epoch: s.epoch,
                buffers: s.buffers.clone(),
            });
        Ok((json!(plan), None))
    }

    /// `stage_wait`: waits until allocation `alloc` of stage `stage` is loaded.
    fn stage_wait(&self, stage: u64, alloc: u64) -> Answer {
        let s = self.stage_of(stage)?;
        s.wait(alloc)
            .map_err(|e| KeeperError::Stage(e.to_string()))?;
        Ok((json!({ "ok": true }), None))
    }

    /// `stage_end`: stage `stage` ended, what it still held freed.
    fn stage_end(&self, stage: u64) -> Answer {
        self.stage_of(stage)?;
        let freed = self.end_stage(stage);
        Ok((json!({ "ok": true, "freed": freed }), None))
    }

    fn lock_stages(&self) -> MutexGuard<'_, BTreeMap<u64, Arc<Stage>>> {
        self.stages.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stage_of(&self, id: u64) -> Result<Arc<Stage>, KeeperError> {
        self.lock_stages()
            .get(&id)
            .cloned()
            .ok_or_else(|| KeeperError::Stage(format!("no stage {id}")))
    }

    /// `prestage`: the draft image's buffers get memory of the caller's `by` (all of it, or
    /// none), retained under a new epoch and held `hold_secs`, and loader threads fill it; a
    /// later `stage` with it as `base` takes what it loaded.
    fn prestage(
        self: &Arc<Self>,
        by: i32,
        image: &str,
        hold_secs: u64,
        present: Option<&BTreeMap<String, u64>>,
    ) -> Answer {
        use possum_engine::image::Image;
        let path = canonical(image)?;
        let img = match present {
            None => Image::open_draft(&path),
            Some(_) => Image::open_draft_arriving(&path),
        }
        .map_err(|e| KeeperError::Stage(format!("{}: {e}", path.display())))?;
        let pending = present.map_or_else(Vec::new, |have| {
            crate::pending::arriving(&img.own_data_files(), have, crate::ARRIVING_PIECE)
        });
        let dev = self.dev()?;
        let (recs, sizes) = staged_order(&img, dev.granularity());
        let made = self.stage_memory(dev, &path, &recs, &sizes)?;
        let epoch = possum_cuda::owner::new_epoch();
        let none = vec![None; recs.len()];
        let buffers = self.keep_staged((by, epoch, hold_secs), &recs, &sizes, &none, made)?;
        let id = self.next_stage_id();
        let img = Arc::new(img);
        let until = Instant::now() + Duration::from_secs(hold_secs);
        let stage = Stage::new(id, by, epoch, path, buffers, Vec::new())
            .pending_on(&img, &pending)
            .rewritable(&img, until)
            .of_draft(img.clone());
        let stage = Arc::new(stage);
        let info = StageInfo {
            stage: id,
            epoch,
            buffers: stage.buffers.len() as u64,
            bytes: stage.buffers.iter().map(|b| b.size).sum(),
            peer: 0,
            peer_misses: Vec::new(),
            reused_bytes: 0,
        };
        self.lock_stages().insert(id, Arc::clone(&stage));
        self.start_loaders(&stage, img)?;
        Ok((json!(info), None))
    }

    /// The caller's prestage `id`, taken out of the stages and its loaders stopped, for a stage
    /// to build on.
    fn take_prestage(&self, id: u64, by: i32) -> Result<Prestaged, KeeperError> {
        let s = self.stage_of(id)?;
        if s.draft.is_none() || s.pid != by {
            return Err(KeeperError::Stage(format!(
                "stage {id} is not a prestage of this process's"
            )));
        }
        self.lock_stages().remove(&id);
        let ready = s.quiesce();
        Ok(Prestaged { stage: s, ready })
    }

    fn next_stage_id(&self) -> u64 {
        self.next_stage
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1
    }

    /// What a stage built on `base` takes of its memory: for each of `recs` (of image `img`,
    /// `sizes` bytes of memory each), the allocation of the base's buffer with the same id,
    /// address and size, if it has one, and the chunks it loaded that `img` holds unchanged (of a
    /// buffer it was still loading, those its load copied before it was stopped).
    fn reuse_of(
        base: &Prestaged,
        img: &possum_engine::image::Image,
        recs: &[possum_engine::store::BufferRecord],
        sizes: &[u64],
    ) -> (Vec<Option<u64>>, Reuse) {
        use possum_engine::store::ChunkSource;
        let partial = crate::config::Config::from_env().stage_partial;
        let by_buf: HashMap<u64, usize> = base
            .stage
            .buffers
            .iter()
            .enumerate()
            .map(|(i, b)| (b.buf, i))
            .collect();
        let mut allocs = Vec::with_capacity(recs.len());
        let mut reuse = Reuse::default();
        for (r, &size) in recs.iter().zip(sizes) {
            let found = by_buf.get(&r.id).copied().filter(|&i| {
                let b = &base.stage.buffers[i];
                b.va == r.va && b.size == r.size && b.alloc_size == size
            });
            let mut skip = HashSet::new();
            let mut whole = false;
            if let Some(i) = found {
                let kept = base.stage.held_as_in(i, base.ready[i], partial, img, r.id);
                reuse.bytes += kept.iter().map(|(_, len)| len).sum::<u64>();
                whole = kept.len() == img.chunks(r.id).len();
                skip = kept.into_iter().map(|(off, _)| off).collect();
            }
            allocs.push(found.map(|i| base.stage.buffers[i].alloc));
            reuse.skip.push(skip);
            reuse.whole.push(whole);
        }
        (allocs, reuse)
    }

    /// `stage`: the image's buffers get memory for process `of` (all of it, or none), then
    /// loader threads fill it: from `from`'s memory where it has a buffer's, else from the image.
    /// Built on a prestage (`base`), a buffer it holds keeps that memory, and only its chunks
    /// that changed are loaded.
    fn stage(
        self: &Arc<Self>,
        of: i32,
        image: &str,
        how: &Staging<'_>,
        mut base: Option<Prestaged>,
    ) -> Answer {
        let r = self.stage_on(of, image, how, &mut base);
        // A prestage the stage did not take (it failed first) ends: its memory is freed.
        if let Some(b) = base {
            self.retire(&b.stage);
        }
        r
    }

    /// [`Self::stage`], taking `base` once its memory is the stage's.
    fn stage_on(
        self: &Arc<Self>,
        of: i32,
        image: &str,
        how: &Staging<'_>,
        base: &mut Option<Prestaged>,
    ) -> Answer {
        let Staging {
            hold_secs, from, ..
        } = *how;
        let path = canonical(image)?;
        let img = possum_engine::image::Image::open(&path)
            .map_err(|e| KeeperError::Stage(format!("{}: {e}", path.display())))?;
        if !how.ahead {
            self.end_stages_of(of);
        }
        let dev = self.dev()?;
        let (recs, sizes) = staged_order(&img, dev.granularity());
        let (taken, reuse) = match base {
            Some(b) => Self::reuse_of(b, &img, &recs, &sizes),
            None => (vec![None; recs.len()], Reuse::default()),
        };
        let (new_recs, new_sizes): (Vec<_>, Vec<_>) = recs
            .iter()
            .zip(&sizes)
            .zip(&taken)
            .filter(|(_, t)| t.is_none())
            .map(|((r, s), _)| (r.clone(), *s))
            .unzip();
        let made = self.stage_memory(dev, &path, &new_recs, &new_sizes)?;
        // The other device's memory of each buffer, imported here (the copies read it over the
        // interconnect); a buffer without one is read from the image.
        let (peers, peer_misses) = match from {
            Some(f) => match peer_sources(dev, of, f, &recs, &sizes) {
                Ok(found) => {
                    let misses: Vec<String> = found
                        .iter()
                        .filter_map(|r| r.as_ref().err())
                        .map(ToString::to_string)
                        .collect();
                    (found.into_iter().map(Result::ok).collect(), misses)
                }
                // Every buffer is read from the image, each for that reason.
                Err(e) => (Vec::new(), vec![e.to_string(); recs.len()]),
            },
            None => (Vec::new(), Vec::new()),
        };
        let epoch = possum_cuda::owner::new_epoch();
        let buffers = self.keep_staged((of, epoch, hold_secs), &recs, &sizes, &taken, made)?;
        if let Some(b) = base.take() {
            self.retire(&b.stage);
        }
        let id = self.next_stage_id();
        let reused_bytes = reuse.bytes;
        let stage = Stage::new(id, of, epoch, path, buffers, peers).reusing(reuse);
        let stage = stage.pending_on(&img, how.pending);
        // Ahead: a prestage whose "draft" is the whole image (a later stage compares with it).
        let img = Arc::new(img);
        let stage = Arc::new(match how.ahead {
            true => stage.of_draft(Arc::clone(&img)),
            false => stage,
        });
        let info = StageInfo {
            stage: id,
            epoch,
            buffers: stage.buffers.len() as u64,
            bytes: stage.buffers.iter().map(|b| b.size).sum(),
            peer: stage.peer_buffers() as u64,
            peer_misses: peer_misses.iter().take(PEER_MISSES_SAID).cloned().collect(),
            reused_bytes,
        };
        if !peer_misses.is_empty() {
            crate::notes::say(&format!(
                "stage {id} of process {of}: {} of {} buffers read from the image, not copied \
                 from the other GPU; first: {}",
                peer_misses.len(),
                stage.buffers.len(),
                peer_misses[0]
            ));
        }
        self.lock_stages().insert(id, Arc::clone(&stage));
        self.start_loaders(&stage, img)?;
        Ok((json!(info), None))
    }

    /// Ends the stages made earlier for process `of` (a new one replaces them).
    fn end_stages_of(&self, of: i32) {
        let earlier: Vec<u64> = self
            .lock_stages()
            .values()
            .filter(|s| s.pid == of)
            .map(|s| s.id)
            .collect();
        for id in earlier {
            self.end_stage(id);
        }
    }

    /// New memory for each of `recs` (of image `path`), `sizes` bytes each: all of it, or an
    /// error saying how much the image needs and how much is free.
    fn stage_memory(
        &self,
        dev: &ShareDevice,
        path: &Path,
        recs: &[possum_engine::store::BufferRecord],
        sizes: &[u64],
    ) -> Result<Vec<(possum_engine::store::BufferRecord, SharedMem, u64)>, KeeperError> {
        let need: u64 = sizes.iter().sum();
        let mut made = Vec::with_capacity(recs.len());
        for (r, &size) in recs.iter().zip(sizes) {
            // On a failure what was made so far is dropped (freed) with `made`.
            let mem = self.create(dev, size).map_err(|e| {
                let free = dev.mem_info().map(|(f, _)| f).unwrap_or(0);
                KeeperError::Stage(format!(
                    "{}: its {} buffers need {need} bytes of GPU memory, {free} free: buffer {} \
                     ({size} bytes): {e}",
                    path.display(),
                    recs.len(),
                    r.id
                ))
            })?;
            made.push((r.clone(), mem, size));
        }
        Ok(made)
    }

    /// The memory of each of `recs` (`sizes` bytes each) kept as process `of`'s retained
    /// allocations (`epoch`, held at least a second after it is gone): the prestage's allocation
    /// `taken` for it, else the next of the memory `made` for the others; the stage's buffers
    /// that name them. An error if an allocation taken is gone (then the memory kept so far is
    /// freed once its hold ends).
    fn keep_staged(
        &self,
        (of, epoch, hold_secs): (i32, u64, u64),
        recs: &[possum_engine::store::BufferRecord],
        sizes: &[u64],
        taken: &[Option<u64>],
        made: Vec<(possum_engine::store::BufferRecord, SharedMem, u64)>,
    ) -> Result<Vec<StagedBuffer>, KeeperError> {
        let mut made = made.into_iter().map(|(_, mem, _)| mem);
        let mut buffers = Vec::with_capacity(recs.len());
        let mut st = self.lock();
        for ((r, &size), t) in recs.iter().zip(sizes).zip(taken) {
            let hold = hold_until(hold_secs.max(1));
            let id = match *t {
                Some(id) => {
                    let a = st.allocs.get_mut(&id).ok_or_else(|| {
                        KeeperError::Stage(format!("the prestage's allocation {id} was freed"))
                    })?;
                    (a.pid, a.retained, a.epoch, a.hold_until) = (of, true, epoch, hold);
                    a.va = Some(r.va);
                    id
                }
                None => st.insert(Alloc {
                    mem: made.next().expect("memory made for each buffer not taken"),
                    pid: of,
                    retained: true,
                    epoch,
                    hold_until: hold,
                    va: Some(r.va),
                    shared: None,
                }),
            };
            buffers.push(StagedBuffer {
                buf: r.id,
                va: r.va,
                size: r.size,
                alloc: id,
                alloc_size: size,
            });
        }
        Ok(buffers)
    }

    /// Starts the loader threads of `stage`, which read `img`; ends the stage if not even one
    /// starts (fewer load slower; none would leave every wait unanswered).
    fn start_loaders(
        self: &Arc<Self>,
        stage: &Arc<Stage>,
        img: impl Into<Arc<possum_engine::image::Image>>,
    ) -> Result<(), KeeperError> {
        let img: Arc<possum_engine::image::Image> = img.into();
        let knobs = stage::Knobs::from_env();
        let mut loaders = 0;
        for _ in 0..knobs.threads().min(stage.buffers.len()) {
            let mem: Arc<dyn stage::Memory> = self.clone();
            let (s, i) = (Arc::clone(stage), Arc::clone(&img));
            match std::thread::Builder::new()
                .name("possum-keeper-stage".to_string())
                .spawn(move || stage::loader(mem, s, i, knobs))
            {
                Ok(_) => loaders += 1,
                // Fewer loaders load slower; none would leave every wait unanswered.
                Err(source) if loaders == 0 => {
                    self.end_stage(stage.id);
                    return Err(KeeperError::Io {
                        op: "spawn a loader thread",
                        source,
                    });
                }
                Err(_) => break,
            }
        }
        Ok(())
    }

    /// `size` bytes of new memory. Memory held for the restore of a job that is gone never keeps
    /// a live job from its memory: if the device has no room, that is dropped and the allocation
    /// tried again.
    fn create(
        &self,
        dev: &ShareDevice,
        size: u64,
    ) -> Result<possum_cuda::share::SharedMem, possum_engine::device::DeviceError> {
        match dev.create(size) {
            Err(e) if self.drop_held_of_dead() > 0 => {
                held_dropped_note(&e);
                dev.create(size)
            }
            r => r,
        }
    }

    /// Ends stage `id` (if it is there) and frees its memory nobody took back; how many
    /// allocations were freed.
    fn end_stage(&self, id: u64) -> usize {
        let Some(s) = self.lock_stages().remove(&id) else {
            return 0;
        };
        s.end();
        self.retire(&s)
    }

    /// A stage over (ended, or a prestage a stage took): shown among the ended ones, and its
    /// memory nobody took freed; how many allocations.
    fn retire(&self, s: &Stage) -> usize {
        {
            let mut ended = self.ended.lock().unwrap_or_else(|p| p.into_inner());
            if ended.len() == crate::ENDED_STAGES_KEPT {
                ended.pop_front();
            }
            ended.push_back(s.stats());
        }
        self.free_where(|a, _| a.retained && a.pid == s.pid && a.epoch == s.epoch)
            .0
    }

    /// Ends the stages whose process is gone and whose memory is all freed (held past its hold,
    /// or freed with the restored process).
    fn prune_stages(&self) {
        let stages: Vec<Arc<Stage>> = self.lock_stages().values().cloned().collect();
        for s in stages {
            let left = self
                .lock()
                .allocs
                .values()
                .any(|a| a.pid == s.pid && a.epoch == s.epoch);
            if !left && !alive(s.pid) {
                self.end_stage(s.id);
            }
        }
    }

    /// Frees the allocations held for the restore of a process that is gone; how many.
    fn drop_held_of_dead(&self) -> usize {
        self.free_where(|a, alive| a.retained && a.hold_until.is_some() && !alive)
            .0
    }

    /// Frees the allocations whose process is gone, but those held for a restore until their
    /// hold ends: how many, and their bytes.
    fn free_orphans_of_dead(self: &Arc<Self>) -> (usize, u64) {
        let now = Instant::now();
        let freed = self.free_where(|a, alive| !a.held(now) && !alive);
        self.prune_stages();
        // Spares lent to a drain whose process died: unmapped, and another made.
        if self.spares.as_ref().is_some_and(|sp| sp.end_gone() > 0) {
            self.replenish_spare();
        }
        freed
    }

    /// Frees the allocations `gone` picks, given each with whether its process is alive (asked
    /// once per process); the memory is released outside the lock. How many, and their bytes.
    fn free_where(&self, gone: impl Fn(&Alloc, bool) -> bool) -> (usize, u64) {
        let freed: Vec<Alloc> = {
            let mut st = self.lock();
            let mut alive_of = Alives::default();
            let ids: Vec<u64> = st
                .allocs
                .iter()
                .filter(|(_, a)| gone(a, alive_of.get(a.pid)))
                .map(|(&id, _)| id)
                .collect();
            ids.iter().filter_map(|id| st.allocs.remove(id)).collect()
        };
        (freed.len(), freed.iter().map(|a| a.mem.size()).sum())
    }

    fn stats(&self) -> Stats {
        let now = Instant::now();
        let st = self.lock();
        let mut alive_of = Alives::default();
        let mut s = Stats::default();
        for a in st.allocs.values() {
            let size = a.mem.size();
            s.total.add(size);
            s.clients
                .entry(a.pid)
                .or_insert_with(Usage::default)
                .add(size);
            if a.retained {
                s.retained.add(size);
            }
            if a.held(now) && !alive_of.get(a.pid) {
                s.held.add(size);
            }
        }
        drop(st);
        s.stages = self.lock_stages().values().map(|x| x.stats()).collect();
        s.stages_ended = self
            .ended
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect();
        s.spare = self.spares.as_ref().map(|sp| sp.stats());
        s
    }
}

impl stage::Memory for Inner {
    fn device(&self) -> Result<&ShareDevice, stage::MemoryError> {
        Ok(self.dev()?)
    }

    fn map<'r>(
        &self,
        alloc: u64,
        res: &'r possum_cuda::share::Reservation,
    ) -> Result<possum_cuda::share::Mapped<'r>, stage::MemoryError> {
        let st = self.lock();
        let a = st
            .allocs
            .get(&alloc)
            .ok_or(stage::MemoryError::Freed(alloc))?;
        Ok(a.mem.map(res, 0)?)
    }
}

/// Why no memory of another device's keeper is taken for a restore staged `from` it: the keeper
/// could not be asked.
#[derive(Debug, thiserror::Error)]
enum PeerError {
    /// Its socket did not answer.
    #[error("{socket} not reached: {source}")]
    NotReached {
        /// The other keeper's socket.
        socket: String,
        /// Why.
        source: KeeperError,
    },
    /// It did not list the process's retained memory.
    #[error("{socket}: its retained memory not listed: {source}")]
    NotListed {
        /// The other keeper's socket.
        socket: String,
        /// Why.
        source: KeeperError,
    },
}

/// Why one buffer's memory on another device is not taken (it is read from the image).
#[derive(Debug, thiserror::Error)]
#[error("buffer {id} at {va:#x}: {why}")]
struct PeerMiss {
    /// The buffer.
    id: u64,
    /// Its address.
    va: u64,
    /// What the other keeper has, or what failed.
    why: MissReason,
}

/// What [`PeerMiss`] found at the buffer's address.
#[derive(Debug, thiserror::Error)]
enum MissReason {
    #[error("nothing of process {0} retained there")]
    Nothing(i32),
    #[error("retained with epoch {held}, the checkpoint's was {want}")]
    Epoch { held: u64, want: u64 },
    #[error("{held} bytes retained there, {want} needed")]
    Size { held: u64, want: u64 },
    #[error("dup: {0}")]
    Dup(KeeperError),
    #[error("import: {0}")]
    Import(possum_engine::device::DeviceError),
}

/// The memory of each of `recs` (sizes `sizes`, rounded to the granularity) that the keeper at
/// `from.socket` holds for process `of`, retained with `from.epoch`, at the buffer's address
/// and of its size: a new fd of it (`dup`) imported on `dev`. A miss for a buffer it does not
/// have (or that fails to import): that one is read from the image. Several buffers, or none,
/// may be taken from it; a keeper that does not answer gives none (`Err`).
fn peer_sources(
    dev: &ShareDevice,
    of: i32,
    from: &PeerSource,
    recs: &[possum_engine::store::BufferRecord],
    sizes: &[u64],
) -> Result<Vec<Result<SharedMem, PeerMiss>>, PeerError> {
    let socket = || from.socket.clone();
    let mut k = crate::Keeper::connect(Path::new(&from.socket)).map_err(|source| {
        PeerError::NotReached {
            socket: socket(),
            source,
        }
    })?;
    let held = k.retained(of).map_err(|source| PeerError::NotListed {
        socket: socket(),
        source,
    })?;
    // The process's allocations by address, the checkpoint's epoch first: a miss then says
    // what is there instead.
    let mut at: BTreeMap<u64, &RetainedAlloc> = BTreeMap::new();
    for a in &held {
        let Some(va) = a.va else { continue };
        let e = at.entry(va).or_insert(a);
        if a.epoch == from.epoch {
            *e = a;
        }
    }
    let found = recs.iter().zip(sizes).map(|(r, &size)| {
        let miss = |why| PeerMiss {
            id: r.id,
            va: r.va,
            why,
        };
        let a = at.get(&r.va).ok_or(miss(MissReason::Nothing(of)))?;
        if a.epoch != from.epoch {
            let (held, want) = (a.epoch, from.epoch);
            return Err(miss(MissReason::Epoch { held, want }));
        }
        if a.size != size {
            let (held, want) = (a.size, size);
            return Err(miss(MissReason::Size { held, want }));
        }
        let fd = k.dup(a.id).map_err(|e| miss(MissReason::Dup(e)))?;
        dev.import(std::os::fd::AsFd::as_fd(&fd), size)
            .map_err(|e| miss(MissReason::Import(e)))
    });
    Ok(found.collect())
}

/// How a `stage` loads, as it asked: how long its memory is held, the other device's keeper it
/// copies from, the image's bytes still to come.
#[derive(Clone, Copy)]
struct Staging<'a> {
    hold_secs: u64,
    from: Option<&'a PeerSource>,
    pending: &'a [crate::PendingPiece],
    /// A stage ahead: a prestage of the whole image (see [`Request::Stage`]).
    ahead: bool,
}

/// A prestage taken by a stage: its loaders stopped, and which buffers they loaded whole.
struct Prestaged {
    stage: Arc<Stage>,
    ready: Vec<bool>,
}

/// An image's buffers in the order a stage loads them (prefetch rank, then id), and the memory
/// each needs (its size rounded up to the granularity `g`).
fn staged_order(
    img: &possum_engine::image::Image,
    g: u64,
) -> (Vec<possum_engine::store::BufferRecord>, Vec<u64>) {
    use possum_engine::store::ChunkSource;
    let mut recs = img.buffers();
    recs.sort_unstable_by_key(|r| (r.prefetch_rank, r.id));
    let sizes = recs
        .iter()
        .map(|r| r.size.max(1).div_ceil(g).saturating_mul(g))
        .collect();
    (recs, sizes)
}

/// `image` made absolute and canonical, so that the job's name of it and the restore's agree.
fn canonical(image: &str) -> Result<PathBuf, KeeperError> {
    std::fs::canonicalize(image).map_err(|e| KeeperError::Stage(format!("{image}: {e}")))
}

/// Until when memory held `secs` seconds after its process is gone is kept (0: not held).
fn hold_until(secs: u64) -> Option<Instant> {
    (secs > 0)
        .then(|| Instant::now().checked_add(Duration::from_secs(secs)))
        .flatten()
}

/// [`alive`] asked once per process in one pass over the allocations.
#[derive(Default)]
struct Alives(BTreeMap<i32, bool>);

impl Alives {
    fn get(&mut self, pid: i32) -> bool {
        *self.0.entry(pid).or_insert_with(|| alive(pid))
    }
}

/// Says on stderr that held memory was dropped for a new allocation.
fn held_dropped_note(e: &possum_engine::device::DeviceError) {
    crate::notes::say(&format!(
        "an allocation failed ({e}); memory held for the restore of jobs that are gone was \
         freed for it"
    ));
}

fn reply(
    stream: &UnixStream,
    v: &Value,
    fd: Option<std::os::fd::BorrowedFd<'_>>,
) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(v)?;
    line.push(b'\n');
    fdpass::send(stream, &line, fd)
}

/// A random instance number for a keeper starting now.
fn new_instance() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
