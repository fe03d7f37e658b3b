//! The client side: [`Keeper`].

use std::collections::BTreeMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::{
    fdpass, Allocated, DeviceInfo, Identified, Identify, KeeperError, PeerSource, PendingPiece,
    Request, Retained, RetainedAlloc, StageArrived, StageDemands, StageInfo, StagePlan, Stats,
    LOAD_TIMEOUT, REQUEST_TIMEOUT,
};

/// The socket in keeper directory `dir` (`possum keeper --dir`: `keeper-N.sock`, one per device
/// it sees) that serves the device with UUID `uuid` (32 hex digits), asked of each; `None` if
/// none does (the keeper sees other devices: another `CUDA_VISIBLE_DEVICES`) or none answers.
/// A process's device ordinals need not be the keeper's: a job restored onto another GPU keeps
/// its ordinal for a device the keeper numbers otherwise.
pub fn keeper_for_device(dir: &Path, uuid: &str) -> Option<std::path::PathBuf> {
    crate::sockets_in(dir).into_iter().find(|s| {
        Keeper::connect(s)
            .and_then(|mut k| k.device())
            .is_ok_and(|d| d.uuid.eq_ignore_ascii_case(uuid))
    })
}

/// A connection to a keeper. Dropping it (or the process ending) frees what it allocated, except
/// what it retained.
#[derive(Debug)]
pub struct Keeper {
    stream: UnixStream,
    pending: Vec<u8>,
    keeper_pid: i32,
    /// The socket, for errors.
    path: PathBuf,
    /// How long each request may wait for its answer (a `stage_wait`: `load_timeout`).
    timeout: Duration,
    load_timeout: Duration,
}

const MAX_REPLY: usize = 16 << 20;

impl Keeper {
    /// Connects and reads the keeper's greeting: [`KeeperError::Refused`] if it does not accept
    /// this process (another uid).
    /// Every request waits at most [`REQUEST_TIMEOUT`] for its answer ([`LOAD_TIMEOUT`] for a
    /// `stage_wait`; for a `stage_demands`, [`REQUEST_TIMEOUT`] plus the time it asks the keeper
    /// to wait): [`KeeperError::Timeout`] after it.
    pub fn connect(path: &Path) -> Result<Keeper, KeeperError> {
        Keeper::connect_within(path, REQUEST_TIMEOUT, LOAD_TIMEOUT)
    }

    /// [`connect`](Self::connect), each request waiting at most `timeout` for its answer (a
    /// `stage_demands`, `timeout` plus its wait), a `stage_wait` at most `load_timeout`.
    pub fn connect_within(
        path: &Path,
        timeout: Duration,
        load_timeout: Duration,
    ) -> Result<Keeper, KeeperError> {
        let stream = UnixStream::connect(path).map_err(|source| KeeperError::Socket {
            path: path.to_path_buf(),
            op: "connect",
            source,
        })?;
        let mut k = Keeper {
            stream,
            pending: Vec::new(),
            keeper_pid: 0,
            path: path.to_path_buf(),
            timeout,
            load_timeout,
        };
        let deadline = deadline_after(timeout);
        let (hello, _) = k.read_reply("connect", timeout, deadline)?;
        if let Some(e) = hello.get("error") {
            return Err(KeeperError::Refused(
                e.as_str().unwrap_or("(no message)").to_string(),
            ));
        }
        k.keeper_pid = hello
            .get("pid")
            .and_then(Value::as_i64)
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| KeeperError::Protocol {
                request: "connect",
                detail: format!("greeting without a pid: {hello}"),
            })?;
        Ok(k)
    }

    /// The keeper's pid, from its greeting.
    pub fn keeper_pid(&self) -> i32 {
        self.keeper_pid
    }

    /// Allocates `size` bytes (rounded up to the granularity): the allocation and its fd, to
    /// import with `possum_cuda::share::ShareDevice::import`.
    pub fn alloc(&mut self, size: u64) -> Result<(Allocated, OwnedFd), KeeperError> {
        self.ask_fd("alloc", &Request::Alloc { size })
    }

    /// Frees allocation `id`.
    pub fn free(&mut self, id: u64) -> Result<(), KeeperError> {
        self.ask("free", &Request::Free { id }).map(drop)
    }

    /// Marks allocation `id` detached (no handle to it in this process), for checkpoint `epoch`;
    /// kept `hold_secs` after this process is gone.
    pub fn retain(&mut self, id: u64, epoch: u64, hold_secs: u64) -> Result<(), KeeperError> {
        self.retain_at(id, epoch, hold_secs, None)
    }

    /// [`retain`](Self::retain), saying the device address this process mapped it at (a stage
    /// on another device matches the image's buffers to it).
    pub fn retain_at(
        &mut self,
        id: u64,
        epoch: u64,
        hold_secs: u64,
        va: Option<u64>,
    ) -> Result<(), KeeperError> {
        self.ask(
            "retain",
            &Request::Retain {
                id,
                epoch,
                hold_secs,
                va,
            },
        )
        .map(drop)
    }

    /// Frees retained allocation `id`.
    pub fn release_retained(&mut self, id: u64) -> Result<(), KeeperError> {
        self.release_retained_of(id, None)
    }

    /// Frees retained allocation `id` if it was retained with `epoch` (any, if `None`).
    pub fn release_retained_of(&mut self, id: u64, epoch: Option<u64>) -> Result<(), KeeperError> {
        self.ask("release_retained", &Request::ReleaseRetained { id, epoch })
            .map(drop)
    }

    /// Takes retained allocation `id` (of checkpoint `epoch`) back: a new fd for it.
    pub fn reclaim(&mut self, id: u64, epoch: u64) -> Result<(Allocated, OwnedFd), KeeperError> {
        self.ask_fd("reclaim", &Request::Reclaim { id, epoch })
    }

    /// The allocations process `pid` has retained.
    pub fn retained(&mut self, pid: i32) -> Result<Vec<RetainedAlloc>, KeeperError> {
        self.ask_parsed::<Retained>("retained", &Request::Retained { pid })
            .map(|r| r.allocs)
    }

    /// A new fd for retained allocation `id` (its state unchanged).
    pub fn dup(&mut self, id: u64) -> Result<OwnedFd, KeeperError> {
        self.ask_fd("dup", &Request::Dup { id }).map(|(_, fd)| fd)
    }

    /// A new fd for this process's allocation `id`, to hand to another process (CUDA IPC).
    pub fn share(&mut self, id: u64) -> Result<OwnedFd, KeeperError> {
        self.ask_fd("share", &Request::Share { id })
            .map(|(_, fd)| fd)
    }

    /// Which of this keeper's allocations `fd` is of, if it is one [`share`](Self::share) handed
    /// out (in another process that passed it on).
    pub fn identify(&mut self, fd: BorrowedFd<'_>) -> Result<Option<Identified>, KeeperError> {
        let (v, _) = self.ask_with("identify", &Request::Identify, Some(fd))?;
        parse::<Identify>("identify", v).map(|r| r.identified)
    }

    /// A new fd for allocation `a` that [`identify`](Self::identify) found, to import again.
    pub fn peer_share(&mut self, a: &Identified) -> Result<OwnedFd, KeeperError> {
        let req = Request::PeerShare {
            id: a.id,
            owner: a.owner,
            instance: a.instance,
        };
        self.ask_fd("peer_share", &req).map(|(_, fd)| fd)
    }

    /// Hands this keeper retained allocation `a` of another (which died) through `fd`.
    pub fn adopt(&mut self, a: &RetainedAlloc, fd: BorrowedFd<'_>) -> Result<(), KeeperError> {
        self.ask_with("adopt", &Request::Adopt(a.clone()), Some(fd))
            .map(drop)
    }

    /// Stages the restore of process `pid` from image directory `image` (one device's): the
    /// keeper creates the buffers' memory and loads them in the background; from `from`'s
    /// memory (another device's keeper) where it holds them, else from the image. A buffer
    /// whose chunks to load overlap one of `pending` (bytes of the image's data files still to
    /// come) waits for [`stage_arrived`](Self::stage_arrived).
    pub fn stage(
        &mut self,
        pid: i32,
        image: &Path,
        hold_secs: u64,
        from: Option<PeerSource>,
        base: Option<u64>,
        pending: Vec<PendingPiece>,
    ) -> Result<StageInfo, KeeperError> {
        self.ask_parsed(
            "stage",
            &Request::Stage {
                pid,
                image: image.display().to_string(),
                hold_secs,
                from,
                base,
                ahead: false,
                pending,
            },
        )
    }

    /// A stage ahead of the whole image at `image`, built on this process's prestage `base`
    /// ([`Request::Stage`]'s `ahead`): a later [`Self::stage`] of the image builds on it.
    pub fn stage_ahead(
        &mut self,
        image: &Path,
        hold_secs: u64,
        base: u64,
    ) -> Result<StageInfo, KeeperError> {
        self.ask_parsed(
            "stage",
            &Request::Stage {
                pid: 0,
                image: image.display().to_string(),
                hold_secs,
                from: None,
                base: Some(base),
                ahead: true,
                pending: Vec::new(),
            },
        )
    }

    /// Says that the bytes of `pieces` are in stage `stage`'s image files now (pieces not
    /// pending are ignored): how many pieces are still pending.
    pub fn stage_arrived(
        &mut self,
        stage: u64,
        pieces: &[PendingPiece],
    ) -> Result<u64, KeeperError> {
        let req = Request::StageArrived {
            stage,
            pieces: pieces.to_vec(),
        };
        self.ask_parsed::<StageArrived>("stage_arrived", &req)
            .map(|r| r.pending)
    }

    /// The pending pieces of stage `stage` that a wait for a blocked buffer needs, each given
    /// once: waits up to `wait` for one (empty after that, or at once when the stage has none
    /// pending or was ended).
    pub fn stage_demands(
        &mut self,
        stage: u64,
        wait: Duration,
    ) -> Result<Vec<PendingPiece>, KeeperError> {
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        self.ask_parsed::<StageDemands>("stage_demands", &Request::StageDemands { stage, wait_ms })
            .map(|r| r.pieces)
    }

    /// Loads the unfinished image `image` by its draft manifest into new memory of the
    /// caller's, for a later [`stage`](Self::stage) of the finished image to build on (`base`).
    pub fn prestage(&mut self, image: &Path, hold_secs: u64) -> Result<StageInfo, KeeperError> {
        self.ask_parsed(
            "prestage",
            &Request::Prestage {
                image: image.display().to_string(),
                hold_secs,
                present: None,
            },
        )
    }

    /// [`Keeper::prestage`] of an image whose data files are still arriving from their start:
    /// `present` says how many bytes of each are there (a file not named: none); the rest loads
    /// as [`Keeper::stage_grown`] says it came.
    pub fn prestage_arriving(
        &mut self,
        image: &Path,
        hold_secs: u64,
        present: BTreeMap<String, u64>,
    ) -> Result<StageInfo, KeeperError> {
        self.ask_parsed(
            "prestage",
            &Request::Prestage {
                image: image.display().to_string(),
                hold_secs,
                present: Some(present),
            },
        )
    }

    /// The data files of stage `stage` (a [`Keeper::prestage_arriving`]) are now at least
    /// `files` long, from their start: how many of its pieces are still pending.
    pub fn stage_grown(
        &mut self,
        stage: u64,
        files: BTreeMap<String, u64>,
    ) -> Result<u64, KeeperError> {
        let req = Request::StageGrown { stage, files };
        self.ask_parsed::<StageArrived>("stage_grown", &req)
            .map(|r| r.pending)
    }

    /// The bytes of `pieces` of the data files of prestage `stage`'s draft were written again:
    /// how many of its chunks they overlap, each loaded again.
    pub fn stage_rewritten(
        &mut self,
        stage: u64,
        pieces: Vec<crate::PendingPiece>,
    ) -> Result<u64, KeeperError> {
        let req = Request::StageRewritten { stage, pieces };
        self.ask_parsed::<crate::StageRewritten>("stage_rewritten", &req)
            .map(|r| r.chunks)
    }

    /// Borrows the keeper's spare image memory for a drain into `dir`'s filesystem.
    pub fn spare_take(&mut self, dir: &Path) -> Result<crate::SpareLease, KeeperError> {
        self.ask_parsed(
            "spare_take",
            &Request::SpareTake {
                dir: dir.display().to_string(),
            },
        )
    }

    /// Has the keeper copy part of this process's allocation into a drain's spare: each
    /// piece's CRC32C.
    pub fn spare_fill(&mut self, fill: &crate::SpareFill) -> Result<Vec<u32>, KeeperError> {
        self.ask_parsed::<crate::SpareFilled>("spare_fill", &Request::SpareFill(fill.clone()))
            .map(|f| f.crcs)
    }

    /// Ends drain `drain`'s loan of the spare.
    pub fn spare_end(&mut self, drain: u64) -> Result<(), KeeperError> {
        self.ask("spare_end", &Request::SpareEnd { drain })
            .map(drop)
    }

    /// The device this keeper socket serves.
    pub fn device(&mut self) -> Result<DeviceInfo, KeeperError> {
        self.ask_parsed("device", &Request::Device)
    }

    /// This process's stage of `image`, if the keeper has one.
    pub fn staged(&mut self, image: &Path) -> Result<Option<StagePlan>, KeeperError> {
        self.ask_parsed(
            "staged",
            &Request::Staged {
                image: image.display().to_string(),
            },
        )
    }

    /// Waits until allocation `alloc` of stage `stage` is loaded (an error if its load failed).
    pub fn stage_wait(&mut self, stage: u64, alloc: u64) -> Result<(), KeeperError> {
        self.ask("stage_wait", &Request::StageWait { stage, alloc })
            .map(drop)
    }

    /// Ends stage `stage`; how many allocations nobody took back were freed.
    pub fn stage_end(&mut self, stage: u64) -> Result<u64, KeeperError> {
        let (v, _) = self.ask("stage_end", &Request::StageEnd { stage })?;
        Ok(v.get("freed").and_then(Value::as_u64).unwrap_or(0))
    }

    /// Has the keeper free now the memory of processes that are gone (but what is held for a
    /// restore): how many allocations, and their bytes.
    pub fn reap(&mut self) -> Result<(u64, u64), KeeperError> {
        let (v, _) = self.ask("reap", &Request::Reap)?;
        let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        Ok((n("freed"), n("freed_bytes")))
    }

    /// The keeper's accounting.
    pub fn stats(&mut self) -> Result<Stats, KeeperError> {
        self.ask_parsed("stats", &Request::Stats)
    }

    /// A request answered with a `T` (a descriptor that came with the reply is closed).
    fn ask_parsed<T: DeserializeOwned>(
        &mut self,
        request: &'static str,
        req: &Request,
    ) -> Result<T, KeeperError> {
        let (v, _) = self.ask(request, req)?;
        parse(request, v)
    }

    /// A request answered with an allocation and exactly one fd.
    fn ask_fd(
        &mut self,
        request: &'static str,
        req: &Request,
    ) -> Result<(Allocated, OwnedFd), KeeperError> {
        let (v, mut fds) = self.ask(request, req)?;
        let a: Allocated = parse(request, v)?;
        if fds.len() != 1 {
            return Err(KeeperError::Protocol {
                request,
                detail: format!("{} descriptors came with the reply, not 1", fds.len()),
            });
        }
        Ok((a, fds.remove(0)))
    }

    fn ask(
        &mut self,
        request: &'static str,
        req: &Request,
    ) -> Result<(Value, Vec<OwnedFd>), KeeperError> {
        self.ask_with(request, req, None)
    }

    /// A request, with `fd` attached if given: the reply and the descriptors that came with it.
    fn ask_with(
        &mut self,
        request: &'static str,
        req: &Request,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<(Value, Vec<OwnedFd>), KeeperError> {
        let mut line = serde_json::to_vec(req).map_err(|e| KeeperError::Protocol {
            request,
            detail: e.to_string(),
        })?;
        line.push(b'\n');
        let limit = match req {
            Request::StageWait { .. } => self.load_timeout,
            // The keeper answers after up to `wait_ms`.
            Request::StageDemands { wait_ms, .. } => {
                self.timeout.saturating_add(Duration::from_millis(*wait_ms))
            }
            _ => self.timeout,
        };
        let deadline = deadline_after(limit);
        let sent = self
            .stream
            .set_write_timeout(Some(limit))
            .and_then(|()| fdpass::send(&self.stream, &line, fd));
        sent.map_err(|source| self.io_error(request, limit, source))?;
        let (v, fds) = self.read_reply(request, limit, deadline)?;
        if let Some(e) = v.get("error") {
            return Err(KeeperError::Remote {
                request,
                message: e.as_str().unwrap_or("(no message)").to_string(),
            });
        }
        Ok((v, fds))
    }

    /// [`KeeperError::Timeout`] for a send or receive of `request` that ran out of its `limit`,
    /// else [`KeeperError::Io`].
    fn io_error(
        &self,
        request: &'static str,
        limit: Duration,
        source: std::io::Error,
    ) -> KeeperError {
        use std::io::ErrorKind::{TimedOut, WouldBlock};
        if matches!(source.kind(), TimedOut | WouldBlock) {
            KeeperError::Timeout {
                path: self.path.clone(),
                request,
                after: limit,
            }
        } else {
            KeeperError::Io {
                op: request,
                source,
            }
        }
    }

    /// The answer to `request` (allowed `limit`, until `deadline`).
    fn read_reply(
        &mut self,
        request: &'static str,
        limit: Duration,
        deadline: Instant,
    ) -> Result<(Value, Vec<OwnedFd>), KeeperError> {
        let mut fds = Vec::new();
        let got = fdpass::recv_line(
            &self.stream,
            &mut self.pending,
            &mut fds,
            MAX_REPLY,
            Some(deadline),
        );
        let line = got
            .map_err(|source| self.io_error(request, limit, source))?
            .ok_or_else(|| KeeperError::Protocol {
                request,
                detail: "the keeper closed the connection".to_string(),
            })?;
        let v = serde_json::from_str(&line).map_err(|e| KeeperError::Protocol {
            request,
            detail: format!("{e}: {line}"),
        })?;
        Ok((v, fds))
    }
}

/// `limit` from now (a day at most: an `Instant` cannot hold every `Duration`).
fn deadline_after(limit: Duration) -> Instant {
    Instant::now() + limit.min(Duration::from_secs(24 * 3600))
}

fn parse<T: DeserializeOwned>(request: &'static str, v: Value) -> Result<T, KeeperError> {
    serde_json::from_value(v.clone()).map_err(|e| KeeperError::Protocol {
        request,
        detail: format!("{e}: {v}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixListener;

    /// A "keeper" at `dir/keeper.sock` that accepts one client, says `greeting` if given, then
    /// never answers (it holds the connection until the test ends).
    fn mute_keeper(dir: &Path, greeting: Option<&str>) -> PathBuf {
        let path = dir.join("keeper.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let greeting = greeting.map(str::to_string);
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            if let Some(g) = greeting {
                s.write_all(g.as_bytes()).unwrap();
            }
            std::thread::sleep(Duration::from_secs(60));
            drop(s);
        });
        path
    }

    #[test]
    fn a_keeper_that_never_greets_is_a_timeout_naming_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = mute_keeper(dir.path(), None);
        let limit = Duration::from_millis(200);
        let t = Instant::now();
        let e = Keeper::connect_within(&path, limit, limit).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
        match &e {
            KeeperError::Timeout {
                path: p,
                request,
                after,
            } => {
                assert_eq!(p, &path);
                assert_eq!(*request, "connect");
                assert_eq!(*after, limit);
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert_eq!(
            e.to_string(),
            format!(
                "keeper socket {}: no answer to connect within 0.2 s (the keeper is hung or \
                 overloaded)",
                path.display()
            )
        );
    }

    #[test]
    fn a_request_the_keeper_never_answers_is_a_timeout_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = mute_keeper(dir.path(), Some("{\"keeper\":1,\"pid\":1}\n"));
        let limit = Duration::from_millis(200);
        let mut k = Keeper::connect_within(&path, limit, Duration::from_millis(300)).unwrap();
        assert_eq!(k.keeper_pid(), 1);
        let e = k.stats().unwrap_err();
        assert!(
            matches!(&e, KeeperError::Timeout { request: "stats", after, .. } if *after == limit),
            "{e:?}"
        );
        assert!(e.to_string().contains("no answer to stats"), "{e}");
        let e = k.stage_wait(1, 1).unwrap_err();
        assert!(
            matches!(&e, KeeperError::Timeout { request: "stage_wait", after, .. }
                if *after == Duration::from_millis(300)),
            "{e:?}"
        );
    }
}
