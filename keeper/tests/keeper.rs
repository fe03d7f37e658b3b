//! The keeper against the fake driver (`cuda/testdata/fake-libcuda.c`, built here with `cc`;
//! without a C compiler each test prints "SKIPPED: ..." and passes). The fake backs each physical
//! allocation with a memfd and exports/imports it as that fd, so memory shared through the keeper
//! really is shared between the processes.
//!
//! Each test runs this binary again as a child with the fake driver on `LD_LIBRARY_PATH` (the
//! driver is found by `dlopen` at run time) and `POSSUM_KEEPER_TEST_INNER` naming the test; the
//! child runs the keeper on a thread and its clients as processes (`possum-keeper-test-client`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use possum_keeper::{Keeper, KeeperError, PendingPiece, Server, StagedBuffer, Usage};

const INNER: &str = "POSSUM_KEEPER_TEST_INNER";
const MIB4: u64 = 4 << 20;

fn skipped(test: &str, why: &str) {
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why} [{test}]");
}

/// `true` in the child, where the test's body runs; in the parent, runs the child and checks it
/// passed, then `false`.
fn inner_or_spawn(test: &str) -> bool {
    if std::env::var(INNER).is_ok_and(|t| t == test) {
        return true;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../cuda/testdata/fake-libcuda.c");
    let lib = dir.path().join("libcuda.so.1");
    let built = Command::new("cc")
        .args(["-O1", "-shared", "-fPIC", "-Wl,-Bsymbolic", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
        .is_ok_and(|s| s.success());
    if !built {
        skipped(test, "no C compiler to build cuda/testdata/fake-libcuda.c");
        return false;
    }
    std::os::unix::fs::symlink(&lib, dir.path().join("libcuda.so")).unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", dir.path())
        .env(INNER, test)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&[out.stdout, out.stderr].concat()).into_owned();
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{test} in the fake driver's process failed:\n{text}"
    );
    if let Some(l) = text.lines().find(|l| l.starts_with("SKIPPED")) {
        let _ = writeln!(std::io::stderr(), "{l}");
    }
    false
}

/// Runs `body` as the calling test in the fake driver's child process (see [`inner_or_spawn`]).
/// The test harness runs each test on a thread named after it.
fn in_child(body: impl FnOnce()) {
    let current = std::thread::current();
    let test = current
        .name()
        .expect("the test harness names each test's thread");
    if inner_or_spawn(test) {
        body();
    }
}

/// [`in_child`] with a fresh keeper for `body`.
fn with_keeper(body: impl FnOnce(&Server)) {
    in_child(|| {
        let (_dir, server) = fresh_keeper();
        body(&server);
    });
}

/// Ends `other` and checks that its memory is freed when `k` asks (`reap`, what a restore asks
/// first), not only at the keeper's next periodic check.
fn exit_and_reap(k: &mut Keeper, other: Client) {
    let their_pid = other.pid;
    other.exit();
    k.reap().unwrap();
    assert!(
        !k.stats().unwrap().clients.contains_key(&their_pid),
        "a dead process's memory is freed by reap"
    );
}

/// The device's free memory before the client, then a client of `server`.
fn free_then_client(server: &Server) -> (u64, Client) {
    let (free0, _) = server.device_mem_info().unwrap();
    (free0, Client::of(server))
}

/// What a process holds: `allocations` of `bytes` in all.
fn usage(allocations: u64, bytes: u64) -> Usage {
    Usage { allocations, bytes }
}

/// A keeper serving on a thread in a directory of its own (removed when the first is dropped).
fn fresh_keeper() -> (tempfile::TempDir, Server) {
    let dir = tempfile::tempdir().unwrap();
    let server = keeper(dir.path());
    (dir, server)
}

/// A keeper serving on a thread, at `dir/keeper.sock`.
fn keeper(dir: &Path) -> Server {
    let server = Server::bind(&dir.join("keeper.sock"), 0).expect("keeper binds");
    let s = server.clone();
    std::thread::spawn(move || s.serve());
    server
}

/// A keeper in `dir` keeping spares of `mib` MiB in `spares`, with `env` besides
/// (`POSSUM_KEEPER_SPARE_*`, read as it binds).
fn keeper_with_spares(dir: &Path, spares: &Path, mib: u64, env: &[(&str, &str)]) -> Server {
    let mib = mib.to_string();
    let vars = [
        ("POSSUM_KEEPER_SPARE_DIR", spares.to_str().unwrap()),
        ("POSSUM_KEEPER_SPARE_MIB", mib.as_str()),
    ];
    for (k, v) in vars.iter().chain(env) {
        std::env::set_var(k, v);
    }
    let server = keeper(dir);
    for (k, _) in vars.iter().chain(env) {
        std::env::remove_var(k);
    }
    server
}

/// Waits until `cond` holds (10 s at most; then fails saying `what`).
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(10), "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (10 s at most, failing with `what`) until stage `stage` of `server` is shown as `cond`
/// says.
fn wait_for_stage(
    server: &Server,
    stage: u64,
    what: &str,
    cond: impl Fn(&possum_keeper::StageStats) -> bool,
) {
    wait_until(what, || {
        let st = server.stats();
        st.stages.iter().any(|s| s.stage == stage && cond(s))
    });
}

/// The keeper's spare, lent to a drain into `dir`: asked until one is ready (10 s at most).
fn take_spare(k: &mut Keeper, dir: &Path) -> possum_keeper::SpareLease {
    let t = Instant::now();
    loop {
        match k.spare_take(dir) {
            Ok(l) => return l,
            Err(e) => {
                assert!(t.elapsed() < Duration::from_secs(10), "no spare: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pid: i32,
}

impl Client {
    /// A client of `server` ([`client_cmd`]).
    fn of(server: &Server) -> Client {
        Client::spawn(&mut client_cmd(server))
    }

    fn spawn(cmd: &mut Command) -> Client {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the test client");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut c = Client {
            child,
            stdin,
            stdout,
            pid: 0,
        };
        let hello = c.line();
        c.pid = hello
            .strip_prefix("connected ")
            .unwrap_or_else(|| panic!("client said {hello:?}"))
            .parse()
            .unwrap();
        c
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.stdout.read_line(&mut l).unwrap();
        l.trim_end().to_string()
    }

    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.line()
    }

    /// `alloc size` → (id, size).
    fn alloc(&mut self, size: u64) -> (u64, u64) {
        let r = self.ask(&format!("alloc {size}"));
        let w: Vec<&str> = r.split_whitespace().collect();
        assert_eq!(w.first(), Some(&"allocated"), "{r}");
        (w[1].parse().unwrap(), w[2].parse().unwrap())
    }

    fn exit(mut self) {
        writeln!(self.stdin, "exit").unwrap();
        assert!(self.child.wait().unwrap().success());
    }
}

fn client_cmd(server: &Server) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_possum-keeper-test-client"));
    c.arg(server.path());
    c
}

fn pattern(id: u64, size: u64) -> Vec<u8> {
    (0..size as usize)
        .map(|i| (i % 251) as u8 ^ id as u8)
        .collect()
}

/// Waits (up to 10 s) until the keeper holds nothing: a closed connection is cleaned up by its
/// thread, a moment after the client has gone.
fn wait_total(server: &Server, want: Usage) {
    let t = Instant::now();
    loop {
        // A gone client's memory is freed by the keeper's periodic check: done here at once.
        server.free_orphans_now();
        if server.stats().total == want {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "keeper still holds {:?}, want {want:?}",
            server.stats()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn client_memory_is_shared_accounted_and_freed_on_exit() {
    with_keeper(|server| {
        let (free0, mut c) = free_then_client(server);
        let (id, size) = c.alloc(MIB4);
        assert_eq!(size, MIB4);
        // The client wrote the pattern through its own mapping of the imported fd; the keeper reads
        // its own mapping of the memory it created.
        assert_eq!(
            server.read(id, 0, size as usize).unwrap(),
            pattern(id, size)
        );

        let one = usage(1, MIB4);
        let s = server.stats();
        assert_eq!(s.clients.get(&c.pid), Some(&one), "{s:?}");
        assert_eq!(s.total, one);
        let from_client: serde_json::Value = serde_json::from_str(&c.ask("stats")).unwrap();
        assert_eq!(from_client["clients"][c.pid.to_string()]["bytes"], MIB4);
        assert_eq!(server.device_mem_info().unwrap().0, free0 - MIB4);

        // A size that is not a multiple of the granularity is rounded up.
        let (_, small) = c.alloc(1000);
        assert_eq!(small % (2 << 20), 0);
        assert!(small >= 1000);

        c.exit();
        wait_total(server, Usage::default());
        assert!(server.stats().clients.is_empty());
        assert_eq!(
            server.device_mem_info().unwrap().0,
            free0,
            "the memory is released"
        );
    });
}

/// Memory retained with a hold (a job checkpointed, then killed) outlives its process for a
/// restore, contents intact, where memory retained without one goes with its process; it is
/// taken back only with the epoch it was retained with.
#[test]
fn held_memory_outlives_its_process_and_is_reclaimed_only_with_its_epoch() {
    with_keeper(|server| {
        let mut c = Client::of(server);
        let (held, _) = c.alloc(MIB4);
        let (plain, _) = c.alloc(MIB4);
        assert_eq!(c.ask(&format!("hold {held} 600")), format!("held {held}"));
        assert_eq!(
            c.ask(&format!("retain {plain}")),
            format!("retained {plain}")
        );
        // The test client retains with epoch 7: another epoch is refused, and the memory stays
        // retained.
        let other = c.ask(&format!("reclaim {held} 8"));
        assert!(other.contains("another checkpoint"), "{other}");
        let one = usage(1, MIB4);
        // Its process alive, nothing is "held" yet.
        assert_eq!(server.stats().held, Usage::default());
        c.exit();
        wait_total(server, one);
        let s = server.stats();
        assert_eq!(s.held, one, "{s:?}");
        assert_eq!(s.retained, one, "{s:?}");
        assert_eq!(
            server.read(held, 0, MIB4 as usize).unwrap(),
            pattern(held, MIB4),
            "held memory keeps its contents"
        );
        assert!(server.read(plain, 0, 16).is_err(), "freed with its process");
        // Released explicitly, it goes.
        let mut k = Keeper::connect(server.path()).unwrap();
        k.release_retained(held).unwrap();
        wait_total(server, Usage::default());
    });
}

/// A client whose process name is not UTF-8 (the kernel cuts names at 15 bytes, which can split
/// a character) is alive to the keeper: its memory is not taken for an orphan's.
#[test]
fn a_client_whose_name_is_not_utf8_keeps_its_memory() {
    with_keeper(|server| {
        let mut c = Client::of(server);
        let (id, size) = c.alloc(MIB4);
        assert_eq!(c.ask("name 6b6565706572e697"), "named");
        let stat = std::fs::read(format!("/proc/{}/stat", c.pid)).unwrap();
        assert!(String::from_utf8(stat).is_err(), "the name was not set");
        server.free_orphans_now();
        assert_eq!(
            server.read(id, 0, size as usize).unwrap(),
            pattern(id, size),
            "the live client's memory is kept"
        );
        c.exit();
        wait_total(server, Usage::default());
    });
}

/// Another keeper takes over retained allocations from fds a third process held (`possum
/// checkpoint` during a kept hold, after the job's keeper died): the same id, owner, epoch and
/// contents, retained there; an id it already has is refused.
#[test]
fn a_second_keeper_adopts_retained_memory_from_held_fds() {
    in_child(|| {
        let dir = tempfile::tempdir().unwrap();
        let first = keeper(dir.path());
        let mut c = Client::spawn(&mut client_cmd(&first));
        let (kept, _) = c.alloc(MIB4);
        let (_other, _) = c.alloc(MIB4);
        assert_eq!(c.ask(&format!("hold {kept} 600")), format!("held {kept}"));
        let mut k = Keeper::connect(first.path()).unwrap();
        let listed = k.retained(c.pid).unwrap();
        assert_eq!(listed.len(), 1, "only the retained one: {listed:?}");
        let a = listed[0].clone();
        assert_eq!((a.id, a.size, a.epoch, a.pid), (kept, MIB4, 7, c.pid));
        assert!(a.hold_secs > 500 && a.hold_secs <= 600, "{a:?}");
        let fd = k.dup(kept).unwrap();

        let dir2 = tempfile::tempdir().unwrap();
        let second = keeper(dir2.path());
        let mut k2 = Keeper::connect(second.path()).unwrap();
        k2.adopt(&a, std::os::fd::AsFd::as_fd(&fd)).unwrap();
        drop(fd);
        assert_eq!(
            second.read(kept, 0, MIB4 as usize).unwrap(),
            pattern(kept, MIB4),
            "the adopted memory has its contents"
        );
        let s = second.stats();
        assert_eq!(s.retained.bytes, MIB4, "{s:?}");
        assert_eq!(s.clients.get(&c.pid).map(|u| u.bytes), Some(MIB4), "{s:?}");
        let there = k2.retained(c.pid).unwrap();
        assert_eq!(there.len(), 1, "{there:?}");
        assert_eq!(
            (there[0].id, there[0].size, there[0].epoch, there[0].pid),
            (a.id, a.size, a.epoch, a.pid)
        );
        assert!(there[0].hold_secs > 500, "the hold goes on: {there:?}");
        let fd = k.dup(kept).unwrap();
        assert!(
            matches!(
                k2.adopt(&a, std::os::fd::AsFd::as_fd(&fd)),
                Err(KeeperError::Remote { .. })
            ),
            "the same id twice"
        );
        // A new allocation there gets an id past the adopted one.
        let (b, _fd) = k2.alloc(MIB4).unwrap();
        assert!(b.id > kept, "{} after {kept}", b.id);
        // Its owner takes it back from there (the second keeper hands out adopted memory as its
        // own: the driver exports no imported handle, so this failed on the H100 until adopted
        // memory kept its fd), with its contents.
        let at = second.path().display().to_string();
        assert_eq!(c.ask(&format!("connect {at}")), format!("connected {at}"));
        assert_eq!(c.ask(&format!("check {kept} 7")), format!("intact {kept}"));
        c.exit();
    });
}

/// Memory belongs to the process that made it, not to a connection: it survives the connection
/// (the client connects again and sees it), and is freed by `free`, by `release_retained` once
/// retained, or once that process is gone; only that process reclaims what it retained.
#[test]
fn memory_lives_as_long_as_its_process_and_retained_memory_until_released() {
    with_keeper(|server| {
        let (free0, mut c) = free_then_client(server);
        let (kept, _) = c.alloc(MIB4);
        let (other, _) = c.alloc(MIB4);
        assert_eq!(c.ask(&format!("retain {kept}")), format!("retained {kept}"));
        let one = usage(1, MIB4);
        let two = usage(2, 2 * MIB4);
        // Connections come and go: nothing is freed.
        for _ in 0..3 {
            let mut k = Keeper::connect(server.path()).unwrap();
            let s = k.stats().unwrap();
            assert_eq!(s.clients.get(&c.pid), Some(&two), "{s:?}");
            assert_eq!(s.retained, one, "{s:?}");
        }
        server.free_orphans_now();
        assert_eq!(server.stats().total, two, "the client lives");
        assert_eq!(
            server.read(kept, 0, MIB4 as usize).unwrap(),
            pattern(kept, MIB4)
        );

        // Another process (this one, same uid) may not reclaim it, but may release it.
        let mut k = Keeper::connect(server.path()).unwrap();
        assert!(matches!(
            k.reclaim(kept, 7),
            Err(KeeperError::Remote { .. })
        ));
        assert!(
            matches!(k.release_retained(other), Err(KeeperError::Remote { .. })),
            "not retained"
        );
        k.release_retained(kept).unwrap();
        assert!(matches!(
            k.release_retained(kept),
            Err(KeeperError::Remote { .. })
        ));
        assert_eq!(server.stats().total, one);
        // A free, then its client's exit: everything back.
        let (a, _fd) = k.alloc(MIB4).unwrap();
        k.free(a.id).unwrap();
        assert!(matches!(k.free(a.id), Err(KeeperError::Remote { .. })));
        c.exit();
        wait_total(server, Usage::default());
        assert!(server.read(other, 0, 16).is_err());
        assert_eq!(server.device_mem_info().unwrap().0, free0);
    });
}

#[test]
fn a_client_of_another_uid_is_refused() {
    in_child(|| {
        if !nix::unistd::geteuid().is_root() {
            skipped(
                "a_client_of_another_uid_is_refused",
                "not root: cannot start a client as uid 65534",
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let server = keeper(dir.path());
        // The socket reachable by anyone, so that only the keeper's own check refuses.
        std::fs::set_permissions(server.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let bin = dir.path().join("client");
        std::fs::copy(env!("CARGO_BIN_EXE_possum-keeper-test-client"), &bin).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = {
            use std::os::unix::process::CommandExt;
            Command::new(&bin)
                .arg(server.path())
                .uid(65534)
                .gid(65534)
                .stdin(Stdio::null())
                .output()
                .unwrap()
        };
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(3), "{text}");
        assert!(
            text.contains("refused: uid 65534 is not the keeper's uid 0"),
            "{text}"
        );
        // The keeper goes on serving its own uid.
        let mut k = Keeper::connect(server.path()).unwrap();
        assert_eq!(k.stats().unwrap().total, Usage::default());
    });
}

/// A job's engine on a `CudaDevice` whose memory the keeper owns (`KeeperMemory`): its buffers
/// are the keeper's allocations; detached, they stay in the keeper (retained, the connection
/// closed) with their contents; attached again, the data is intact and the keeper counts them
/// as the job's again; freed, the keeper frees them.
/// An engine whose device takes its memory from the keeper `server`, with a stream to write and
/// read its buffers through.
struct KeptEngine {
    dev: std::sync::Arc<possum_cuda::CudaDevice>,
    engine: possum_engine::Engine<possum_cuda::CudaDevice>,
    stream: possum_cuda::CudaStream,
}

impl KeptEngine {
    fn new(server: &Server, cfg: possum_engine::EngineConfig) -> KeptEngine {
        use possum_engine::device::{Device, StreamPriority};
        use std::sync::Arc;
        let owner = possum_keeper::KeeperMemory::connect(server.path()).unwrap();
        let dev = Arc::new(
            possum_cuda::CudaDevice::new(0)
                .unwrap()
                .with_owner(Arc::new(owner)),
        );
        let engine = possum_engine::Engine::new(dev.clone(), cfg).unwrap();
        let stream = dev.create_stream(StreamPriority::Normal).unwrap();
        KeptEngine {
            dev,
            engine,
            stream,
        }
    }

    /// [`KeptEngine::new`] with 1 MiB chunks (an image of several chunks per buffer).
    fn chunked(server: &Server) -> KeptEngine {
        let cfg = possum_engine::EngineConfig {
            chunk_size: 1 << 20,
            ..possum_engine::EngineConfig::default()
        };
        KeptEngine::new(server, cfg)
    }

    /// Writes `pattern(id, len)` at `va`.
    fn write(&self, va: possum_engine::device::DevPtr, id: u64, len: u64) {
        use possum_engine::device::{Device, HostBuffer, Transfer};
        let mut h = self.dev.alloc_host(len as usize).unwrap();
        h.as_mut_slice()[..len as usize].copy_from_slice(&pattern(id, len));
        self.dev
            .copy_h2d(&self.stream, h, va, len)
            .unwrap()
            .wait()
            .unwrap();
    }

    /// `len` bytes at `va`.
    fn read(&self, va: possum_engine::device::DevPtr, len: u64) -> Vec<u8> {
        use possum_engine::device::{Device, HostBuffer, Transfer};
        let h = self.dev.alloc_host(len as usize).unwrap();
        let h = self
            .dev
            .copy_d2h(&self.stream, va, h, len)
            .unwrap()
            .wait()
            .unwrap();
        h.as_slice()[..len as usize].to_vec()
    }
}

#[test]
fn an_engine_detaches_its_buffers_into_the_keeper_and_back() {
    with_keeper(|server| {
        use possum_engine::device::Device;
        let k = KeptEngine::new(server, possum_engine::EngineConfig::default());
        assert!(k.dev.keeps_memory());
        let e = &k.engine;
        let a = e.alloc(MIB4).unwrap();
        let b = e.alloc(2 * MIB4 - 4096).unwrap();
        let me = std::process::id() as i32;
        let two = usage(2, 3 * MIB4);
        assert_eq!(server.stats().clients.get(&me), Some(&two));
        k.write(a.va(), 1, MIB4);
        k.write(b.va(), 2, b.size());

        assert_eq!(e.detach().unwrap(), 3 * MIB4);
        // The keeper holds both, retained, this process's still (it is alive).
        server.free_orphans_now();
        let s1 = server.stats();
        assert_eq!(s1.retained, two, "{s1:?}");
        assert_eq!(s1.clients.get(&me), Some(&two), "{s1:?}");

        assert_eq!(e.reattach().unwrap(), 3 * MIB4);
        assert_eq!(k.read(a.va(), MIB4), pattern(1, MIB4));
        assert_eq!(k.read(b.va(), b.size()), pattern(2, b.size()));
        let s2 = server.stats();
        assert_eq!(s2.clients.get(&me), Some(&two), "{s2:?}");
        assert_eq!(s2.retained, Usage::default());

        e.free(a.va()).unwrap();
        e.free(b.va()).unwrap();
        wait_total(server, Usage::default());
    });
}

/// `share`: a new fd of one of the caller's own allocations in use (the job's
/// `cuMemExportToShareableHandle` of memory possum serves), the same memory as the one the
/// caller has; refused for another process's allocation, a retained one, or an unknown id.
#[test]
fn a_process_shares_only_its_own_memory_in_use() {
    with_keeper(|server| {
        use std::os::unix::fs::FileExt;
        let mut k = Keeper::connect(server.path()).unwrap();
        let (a, fd) = k.alloc(MIB4).unwrap();
        let shared = std::fs::File::from(k.share(a.id).unwrap());
        std::fs::File::from(fd)
            .write_all_at(b"possum", 4096)
            .unwrap();
        let mut back = [0u8; 6];
        shared.read_exact_at(&mut back, 4096).unwrap();
        assert_eq!(&back, b"possum", "the shared fd is the allocation's memory");

        let mut other = Client::of(server);
        let (theirs, _) = other.alloc(MIB4);
        let err = k.share(theirs).unwrap_err().to_string();
        assert!(err.contains("no allocation"), "{err}");
        exit_and_reap(&mut k, other);
        k.retain(a.id, 1, 0).unwrap();
        let err = k.share(a.id).unwrap_err().to_string();
        assert!(err.contains("no allocation"), "{err}");
        assert!(k.share(999_999).is_err());
    });
}

/// `identify` and `peer_share`: an fd `share` handed out, in the hands of a process that
/// imported it (as NCCL's peers import each other's buffers), is known again as the
/// allocation's; that process may take a new fd of it, retained or not, naming its owner and
/// the keeper's instance; an fd of memory never shared, or of no allocation, is not known.
#[test]
fn an_imported_fd_is_known_again_and_shared_anew_to_its_importer() {
    with_keeper(|server| {
        use std::os::fd::AsFd;
        use std::os::unix::fs::FileExt;
        let mut k = Keeper::connect(server.path()).unwrap();
        let (a, a_fd) = k.alloc(MIB4).unwrap();
        let (_b, b_fd) = k.alloc(MIB4).unwrap();
        let shared = k.share(a.id).unwrap();
        let found = k
            .identify(shared.as_fd())
            .unwrap()
            .expect("the shared fd is known");
        assert_eq!((found.id, found.size), (a.id, a.size));
        assert_eq!(found.owner, std::process::id() as i32);
        assert_eq!(
            k.identify(b_fd.as_fd()).unwrap(),
            None,
            "b was never shared"
        );
        let other = tempfile::tempfile().unwrap();
        assert_eq!(k.identify(other.as_fd()).unwrap(), None);

        // Another instance or owner: refused.
        let wrong = |f: &dyn Fn(&mut possum_keeper::Identified)| {
            let mut w = found;
            f(&mut w);
            w
        };
        for w in [wrong(&|w| w.instance ^= 1), wrong(&|w| w.owner += 1)] {
            let err = k.peer_share(&w).unwrap_err().to_string();
            assert!(err.contains("no allocation"), "{err}");
        }
        // In use, then retained for a checkpoint: the same memory each time.
        std::fs::File::from(a_fd)
            .write_all_at(b"peer", 8192)
            .unwrap();
        for retain in [false, true] {
            if retain {
                k.retain(a.id, 7, 60).unwrap();
            }
            let again = std::fs::File::from(k.peer_share(&found).unwrap());
            let mut back = [0u8; 4];
            again.read_exact_at(&mut back, 8192).unwrap();
            assert_eq!(&back, b"peer");
        }
        k.release_retained(a.id).unwrap();
        assert!(k.peer_share(&found).is_err(), "freed");
    });
}

/// Staging: an engine's buffers checkpointed into an image on disk and
/// released; the keeper loads the image into new memory for this process, and the engine's
/// restore maps that memory and waits for the loads instead of copying. A buffer whose load
/// fails (`POSSUM_KEEPER_STAGE_FAIL`) is copied by the engine from the image; the last round's
/// loaders read a large buffer's chunks three at a time (`POSSUM_KEEPER_STAGE_READERS`), its
/// last batch short. The memory is this process's in use afterwards, nothing retained; a
/// stage's memory nobody takes is freed by `stage_end`; an image that is not there is refused
/// by name.
#[test]
fn a_staged_restore_maps_memory_the_keeper_loaded() {
    in_child(|| {
        use possum_engine::image::{Image, ImageWriter, WriterOptions};
        use std::sync::Arc;
        let (dir, server) = fresh_keeper();
        let kept = KeptEngine::chunked(&server);
        let e = &kept.engine;
        let bufs: Vec<_> = [MIB4, 2 * MIB4 - 4096, 3 * MIB4]
            .iter()
            .map(|&n| e.alloc(n).unwrap())
            .collect();
        let me = std::process::id() as i32;
        let mut k = Keeper::connect(server.path()).unwrap();
        let missing = dir.path().join("no-such-image");
        let err = k
            .stage(me, &missing, 60, None, None, Vec::new())
            .unwrap_err()
            .to_string();
        assert!(err.contains("no-such-image"), "{err}");

        for (round, fail, readers) in [
            (1u64, None, None),
            (2, Some("0"), None),
            (3, None, Some("3")),
        ] {
            for (i, b) in bufs.iter().enumerate() {
                kept.write(b.va(), round * 10 + i as u64, b.size());
            }
            let img = dir.path().join(format!("img-{round}/gpu-0"));
            let w = Arc::new(ImageWriter::create(&img, WriterOptions::default()).unwrap());
            e.checkpoint(w.clone(), false).unwrap().wait().unwrap();
            Arc::try_unwrap(w).unwrap().commit().unwrap();
            e.release().unwrap();
            match fail {
                Some(n) => std::env::set_var("POSSUM_KEEPER_STAGE_FAIL", n),
                None => std::env::remove_var("POSSUM_KEEPER_STAGE_FAIL"),
            }
            match readers {
                Some(n) => std::env::set_var("POSSUM_KEEPER_STAGE_READERS", n),
                None => std::env::remove_var("POSSUM_KEEPER_STAGE_READERS"),
            }
            let info = k.stage(me, &img, 60, None, None, Vec::new()).unwrap();
            assert_eq!(info.buffers, 3);
            let plan = possum_keeper::KeeperMemory::connect(server.path())
                .unwrap()
                .staged(&img)
                .unwrap()
                .expect("a stage of this image for this process");
            assert_eq!(plan.id(), info.stage);
            let r = e
                .restore_staged(Arc::new(Image::open(&img).unwrap()), Arc::new(plan))
                .unwrap()
                .wait()
                .unwrap();
            assert_eq!(
                (r.staged, r.staged_fallback),
                if fail.is_some() { (2, 1) } else { (3, 0) },
                "{r:?}"
            );
            for (i, b) in bufs.iter().enumerate() {
                assert!(
                    kept.read(b.va(), b.size()) == pattern(round * 10 + i as u64, b.size()),
                    "round {round}: buffer {i} restored wrong"
                );
            }
            // Every buffer's memory is this process's in use: nothing retained, and no stage left
            // (the restore's end ended it).
            server.free_orphans_now();
            let st = server.stats();
            assert_eq!(st.retained, Usage::default(), "{st:?}");
            assert_eq!(
                st.clients.get(&me).map(|u| u.allocations),
                Some(3),
                "{st:?}"
            );
            assert!(st.stages.is_empty(), "{st:?}");
        }
        std::env::remove_var("POSSUM_KEEPER_STAGE_FAIL");
        std::env::remove_var("POSSUM_KEEPER_STAGE_READERS");

        // A stage nobody takes: its memory is freed when it is ended.
        let img = dir.path().join("img-2/gpu-0");
        let info = k.stage(me, &img, 60, None, None, Vec::new()).unwrap();
        assert_eq!(server.stats().retained.allocations, 3);
        assert_eq!(k.stage_end(info.stage).unwrap(), 3);
        let st = server.stats();
        assert_eq!(st.retained, Usage::default());
        let last = st.stages_ended.last().expect("the ended stage is shown");
        assert_eq!((last.stage, last.buffers), (info.stage, 3), "{st:?}");
        assert!(
            k.stage_wait(info.stage, 1).is_err(),
            "an ended stage is gone"
        );
        assert!(
            possum_keeper::KeeperMemory::connect(server.path())
                .unwrap()
                .staged(&img)
                .unwrap()
                .is_none(),
            "no stage of the image any more"
        );
        for b in &bufs {
            e.free(b.va()).unwrap();
        }
        wait_total(&server, Usage::default());
    });
}

/// Three buffers of a keeper's engine, written with the patterns `first`, `first + 1` and
/// `first + 2`, and the draft of a pre-copy round of them: its writer, the image unfinished
/// under `dir/draft/gpu-0`.
struct Drafted {
    kept: KeptEngine,
    sizes: [u64; 3],
    bufs: Vec<possum_engine::Buffer>,
    me: i32,
    k: Keeper,
    w: std::sync::Arc<possum_engine::image::ImageWriter>,
}

impl Drafted {
    fn new(server: &Server, dir: &Path, first: u64) -> Drafted {
        use possum_engine::image::{ImageWriter, WriterOptions};
        use std::sync::Arc;
        let kept = KeptEngine::chunked(server);
        let sizes = [MIB4, 2 * MIB4 - 4096, 3 * MIB4];
        let bufs: Vec<_> = (sizes.iter())
            .map(|&n| kept.engine.alloc(n).unwrap())
            .collect();
        for (i, b) in bufs.iter().enumerate() {
            kept.write(b.va(), first + i as u64, b.size());
        }
        let draft_of = dir.join("draft/gpu-0");
        let w = Arc::new(ImageWriter::create(&draft_of, WriterOptions::default()).unwrap());
        kept.engine
            .checkpoint(w.clone(), false)
            .unwrap()
            .wait()
            .unwrap();
        w.write_draft().unwrap();
        Drafted {
            kept,
            sizes,
            bufs,
            me: std::process::id() as i32,
            k: Keeper::connect(server.path()).unwrap(),
            w,
        }
    }

    /// The unfinished image as a migration's destination receives it, at
    /// `dir/arriving/.gpu-0.tmp-1`: its draft, and its data files with their bytes (`data`) or
    /// empty; and their lengths once whole, by name.
    fn arriving(
        &self,
        dir: &Path,
        data: bool,
    ) -> (PathBuf, std::collections::BTreeMap<String, u64>) {
        let arriving = dir.join("arriving/.gpu-0.tmp-1");
        std::fs::create_dir_all(&arriving).unwrap();
        let mut whole = std::collections::BTreeMap::new();
        for f in std::fs::read_dir(self.w.temp_dir()).unwrap() {
            let f = f.unwrap();
            let name = f.file_name().into_string().unwrap();
            if !name.starts_with("data-") {
                std::fs::copy(f.path(), arriving.join(&name)).unwrap();
                continue;
            }
            whole.insert(name.clone(), f.metadata().unwrap().len());
            if data {
                std::fs::copy(f.path(), arriving.join(&name)).unwrap();
            } else {
                std::fs::File::create(arriving.join(&name)).unwrap();
            }
        }
        (arriving, whole)
    }

    /// The finished image of the buffers as they are now, at `dir/img/gpu-0`; their memory
    /// released.
    fn finished(&self, dir: &Path) -> PathBuf {
        use possum_engine::image::{ImageWriter, WriterOptions};
        use std::sync::Arc;
        let img = dir.join("img/gpu-0");
        let w2 = Arc::new(ImageWriter::create(&img, WriterOptions::default()).unwrap());
        let e = &self.kept.engine;
        e.checkpoint(w2.clone(), false).unwrap().wait().unwrap();
        Arc::try_unwrap(w2).unwrap().commit().unwrap();
        e.release().unwrap();
        img
    }

    /// The pre-copy's image finished where its draft is (the chunks where the draft places
    /// them), this one's buffers as they are now, their memory released; the draft's writer
    /// replaced by one under `dir/unused` that nothing writes.
    fn finished_in_place(&mut self, dir: &Path) -> PathBuf {
        use possum_engine::image::{ImageWriter, WriterOptions};
        use std::sync::Arc;
        let e = &self.kept.engine;
        e.checkpoint(self.w.clone(), false).unwrap().wait().unwrap();
        let spare = ImageWriter::create(&dir.join("unused/gpu-0"), WriterOptions::default());
        let w = std::mem::replace(&mut self.w, Arc::new(spare.unwrap()));
        let img = w.final_dir().to_path_buf();
        Arc::try_unwrap(w).unwrap().commit().unwrap();
        e.release().unwrap();
        img
    }

    /// Buffer `i` written again with `pattern(id, ..)` and copied in place into the draft's
    /// files (a later pre-copy round).
    fn rewrite(&self, i: usize, id: u64) {
        let b = &self.bufs[i];
        self.kept.write(b.va(), id, b.size());
        let e = &self.kept.engine;
        e.checkpoint(self.w.clone(), false).unwrap().wait().unwrap();
    }

    /// The pieces of the draft's data files that hold buffer `i`.
    fn pieces_of(&self, i: usize) -> Vec<PendingPiece> {
        let draft = possum_engine::image::Image::open_draft(self.w.temp_dir()).unwrap();
        self.chunks_in(&draft, i)
    }

    /// Where the chunks of buffer `i` lie in the draft `draft`, in order: each as a piece of its
    /// data file.
    fn chunks_in(&self, draft: &possum_engine::image::Image, i: usize) -> Vec<PendingPiece> {
        use possum_engine::store::ChunkSource;
        let va = self.bufs[i].va();
        let rec = (draft.buffers().into_iter())
            .find(|b| b.va == va.0)
            .expect("the buffer is in the draft");
        (draft.chunks(rec.id).into_iter())
            .map(|(off, len)| {
                let (file, at) = draft.chunk_location(rec.id, off).unwrap();
                PendingPiece {
                    file: file.to_string(),
                    offset: at,
                    len,
                }
            })
            .collect()
    }

    /// A stage of `img` built on prestage `base` (its reply), the engine restored from it:
    /// every buffer staged, buffer `i` holding the pattern `want(i)`.
    fn restored_on(
        &mut self,
        server: &Server,
        img: &Path,
        base: u64,
        want: impl Fn(usize) -> u64,
    ) -> possum_keeper::StageInfo {
        use possum_engine::image::Image;
        use std::sync::Arc;
        let info = (self.k)
            .stage(self.me, img, 60, None, Some(base), Vec::new())
            .unwrap();
        let mem = possum_keeper::KeeperMemory::connect(server.path()).unwrap();
        let plan = mem.staged(img).unwrap().expect("the stage of the image");
        let r = (self.kept.engine)
            .restore_staged(Arc::new(Image::open(img).unwrap()), Arc::new(plan))
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!((r.staged, r.staged_fallback), (3, 0), "{r:?}");
        for (i, b) in self.bufs.iter().enumerate() {
            assert!(
                self.kept.read(b.va(), b.size()) == pattern(want(i), b.size()),
                "buffer {i} restored wrong"
            );
        }
        info
    }

    /// Frees the buffers; waits until the keeper holds no memory.
    fn free(self, server: &Server) {
        drop(self.w);
        for b in &self.bufs {
            self.kept.engine.free(b.va()).unwrap();
        }
        wait_total(server, Usage::default());
    }
}

/// Loading ahead: the keeper loads an unfinished image by its draft manifest (`prestage`), and a
/// stage of the finished image built on it keeps that memory, loading only the chunks that
/// differ (a buffer written since) and every chunk of a buffer the prestage did not load whole
/// (its load failed). The engine's restore from that stage is bit-exact, and nothing of the
/// prestage is left. A base that is not a prestage is refused by name.
#[test]
fn a_stage_builds_on_a_prestage_of_the_draft() {
    in_child(|| {
        let (dir, server) = fresh_keeper();
        let mut d = Drafted::new(&server, dir.path(), 10);
        // The first buffer's load fails in the prestage.
        std::env::set_var("POSSUM_KEEPER_STAGE_FAIL", "0");
        let pre = d.k.prestage(d.w.temp_dir(), 60).unwrap();
        std::env::remove_var("POSSUM_KEEPER_STAGE_FAIL");
        assert_eq!(pre.buffers, 3);
        wait_until("the prestage is loaded", || {
            server
                .stats()
                .stages
                .iter()
                .any(|s| s.draft && s.done_ms.is_some())
        });
        // A restored job never finds a prestage as its stage.
        let mem = possum_keeper::KeeperMemory::connect(server.path()).unwrap();
        assert!(mem.staged(d.w.temp_dir()).unwrap().is_none());

        // The job writes the second buffer again; the finished image.
        d.kept.write(d.bufs[1].va(), 21, d.bufs[1].size());
        let img = d.finished(dir.path());
        let err = (d.k)
            .stage(d.me, &img, 60, None, Some(pre.stage + 100), Vec::new())
            .unwrap_err();
        assert!(err.to_string().contains("no stage"), "{err}");
        let info = d.restored_on(&server, &img, pre.stage, |i| {
            if i == 1 {
                21
            } else {
                10 + i as u64
            }
        });
        // Only the third buffer came whole from the prestage: the first failed to load there,
        // the second changed.
        assert_eq!(info.reused_bytes, d.sizes[2], "{info:?}");
        // Nothing retained, no stage left; the prestage shown ended.
        server.free_orphans_now();
        let st = server.stats();
        assert_eq!(st.retained, Usage::default(), "{st:?}");
        assert_eq!(st.clients.get(&d.me).map(|u| u.allocations), Some(3));
        assert!(st.stages.is_empty(), "{st:?}");
        assert!(st
            .stages_ended
            .iter()
            .any(|s| s.draft && s.stage == pre.stage));
        // Taken, the prestage is gone.
        assert!(d.k.stage_end(pre.stage).is_err());
        d.free(&server);
    });
}

/// A stage ahead (a migration's destination, the job's GPU image whole before its restore):
/// built on the prestage of the draft, it loads what changed since; the image is then moved
/// (the received directory named), and a stage of it where it lies now, built on the stage
/// ahead, takes every buffer from it; the restore is bit-exact. A restored job never finds the
/// stage ahead as its stage.
#[test]
fn a_stage_ahead_of_the_whole_image_is_built_on_where_the_image_lies_later() {
    in_child(|| {
        let (dir, server) = fresh_keeper();
        let mut d = Drafted::new(&server, dir.path(), 50);
        let pre = d.k.prestage(d.w.temp_dir(), 60).unwrap();
        d.kept.write(d.bufs[1].va(), 61, d.bufs[1].size());
        let img = d.finished(dir.path());
        let ahead = d.k.stage_ahead(&img, 60, pre.stage).unwrap();
        assert_eq!(ahead.reused_bytes, d.sizes[0] + d.sizes[2], "{ahead:?}");
        wait_for_stage(&server, ahead.stage, "the stage ahead is loaded", |s| {
            s.done_ms.is_some() && s.ready == 3
        });
        let mem = possum_keeper::KeeperMemory::connect(server.path()).unwrap();
        assert!(
            mem.staged(&img).unwrap().is_none(),
            "not a restored job's stage"
        );
        let moved = dir.path().join("named/gpu-0");
        std::fs::create_dir_all(moved.parent().unwrap()).unwrap();
        std::fs::rename(&img, &moved).unwrap();
        let info = d.restored_on(&server, &moved, ahead.stage, |i| {
            if i == 1 {
                61
            } else {
                50 + i as u64
            }
        });
        assert_eq!(info.reused_bytes, d.sizes.iter().sum::<u64>(), "{info:?}");
        d.free(&server);
    });
}

/// Loading ahead while the first round still arrives: a prestage of a draft whose data files
/// hold none of their bytes yet (`present`: zero of each) loads nothing, its buffers blocked;
/// once the files are whole and `stage_grown` says so, it loads them, and a stage of the finished
/// image (nothing written since) takes every byte from it. The restore is bit-exact.
#[test]
fn a_prestage_loads_as_the_draft_files_arrive() {
    in_child(|| {
        use std::collections::BTreeMap;
        let (dir, server) = fresh_keeper();
        let mut d = Drafted::new(&server, dir.path(), 30);
        // The draft as the destination has it before the round's data came: empty data files.
        let (arriving, whole) = d.arriving(dir.path(), false);
        assert!(!whole.is_empty());
        let none: BTreeMap<String, u64> = whole.keys().map(|n| (n.clone(), 0)).collect();
        let pre = d.k.prestage_arriving(&arriving, 60, none).unwrap();
        assert_eq!(pre.buffers, 3);
        wait_for_stage(
            &server,
            pre.stage,
            "the prestage's buffers are blocked",
            |s| s.blocked_buffers == 3 && s.ready == 0,
        );
        // A file said grown that is not yet: nothing arrives past what is said.
        let one = whole.keys().next().unwrap().clone();
        assert!(d.k.stage_grown(pre.stage, [(one, 0)].into()).unwrap() > 0);
        // The bytes come, in place (the same files).
        for (name, &len) in &whole {
            let bytes = std::fs::read(d.w.temp_dir().join(name)).unwrap();
            assert_eq!(bytes.len() as u64, len);
            std::fs::write(arriving.join(name), bytes).unwrap();
        }
        assert_eq!(d.k.stage_grown(pre.stage, whole.clone()).unwrap(), 0);
        wait_for_stage(&server, pre.stage, "the prestage is loaded", |s| {
            s.done_ms.is_some() && s.ready == 3
        });
        let img = d.finished(dir.path());
        let info = d.restored_on(&server, &img, pre.stage, |i| 30 + i as u64);
        assert_eq!(info.reused_bytes, d.sizes.iter().sum::<u64>(), "{info:?}");
        d.free(&server);
    });
}

/// Loading ahead where a chunk's bytes are not yet where the files' lengths say (a migration's
/// first round sent as it was copied: a chunk in flight then, sent again after the draft): the
/// prestage loads every buffer all the same, leaving that chunk out, and a stage of the
/// finished image built on it loads that chunk alone; the restore is bit-exact.
#[test]
fn a_prestage_leaves_a_chunk_not_there_yet_to_the_stage_built_on_it() {
    in_child(|| {
        let (dir, server) = fresh_keeper();
        let mut d = Drafted::new(&server, dir.path(), 40);
        let (arriving, whole) = d.arriving(dir.path(), true);
        // The first chunk of the first data file (1 MiB) still a hole.
        let first = arriving.join("data-000.bin");
        let real = std::fs::read(&first).unwrap();
        let mut holed = real.clone();
        holed[..4096].fill(0);
        std::fs::write(&first, &holed).unwrap();
        let pre = d.k.prestage_arriving(&arriving, 60, whole.clone()).unwrap();
        wait_for_stage(&server, pre.stage, "the prestage is loaded", |s| {
            s.done_ms.is_some() && s.ready == 3
        });
        // Its bytes come after the draft.
        std::fs::write(&first, &real).unwrap();
        let img = d.finished(dir.path());
        let info = d.restored_on(&server, &img, pre.stage, |i| 40 + i as u64);
        assert_eq!(
            info.reused_bytes,
            d.sizes.iter().sum::<u64>() - (1 << 20),
            "all but the chunk that was not there: {info:?}"
        );
        d.free(&server);
    });
}

/// Loading ahead while the job's state is written again (a migration's later rounds, or the
/// held job's final copy, sent into the same files): the chunks of the pieces named written
/// again are loaded again once the prestage is loaded, and a stage of the finished image (its
/// chunks where the draft has them) takes them from it. A buffer written again after its
/// chunks were loaded again, and not named again, is loaded by the stage (what its memory holds
/// does not sum to the image's CRC32C); the restore is bit-exact either way. A stage is not
/// told of pieces written again.
#[test]
fn a_prestage_loads_again_what_is_written_again() {
    in_child(|| {
        let (dir, server) = fresh_keeper();
        let mut d = Drafted::new(&server, dir.path(), 70);
        let pre = d.k.prestage(d.w.temp_dir(), 60).unwrap();
        let loaded = |what: &str, bytes: u64| {
            wait_for_stage(&server, pre.stage, what, |s| {
                s.ready == 3 && s.reloaded_bytes == bytes && s.reloads_left == 0
            })
        };
        loaded("the prestage is loaded", 0);
        // The second buffer written again, rewritten in place in the draft's files, named.
        d.rewrite(1, 81);
        let second = d.pieces_of(1);
        let n = d.k.stage_rewritten(pre.stage, second.clone()).unwrap();
        assert_eq!(n, second.len() as u64);
        loaded("its chunks are loaded again", d.sizes[1]);
        // The third: named, loaded again, then written again, not named.
        d.rewrite(2, 82);
        d.k.stage_rewritten(pre.stage, d.pieces_of(2)).unwrap();
        let both = d.sizes[1] + d.sizes[2];
        loaded("the third's chunks are loaded again", both);
        d.kept.write(d.bufs[2].va(), 92, d.bufs[2].size());
        let img = d.finished_in_place(dir.path());
        let want = |i: usize| [70, 81, 92][i];
        let info = d.restored_on(&server, &img, pre.stage, want);
        assert_eq!(info.reused_bytes, d.sizes[0] + d.sizes[1], "{info:?}");
        // A stage (not a prestage) refuses to be told.
        let staged = d.k.stage(d.me, &img, 60, None, None, Vec::new()).unwrap();
        let err = d.k.stage_rewritten(staged.stage, second).unwrap_err();
        assert!(err.to_string().contains("not a prestage"), "{err}");
        d.k.stage_end(staged.stage).unwrap();
        d.free(&server);
    });
}

/// A stage built on a prestage that was still loading a buffer (its load waiting for bytes not
/// there yet when the stage took it) takes the chunks that load copied, not only the buffers
/// loaded whole, and loads the rest; the restore is bit-exact. (Each chunk read alone,
/// `POSSUM_KEEPER_STAGE_READERS=1`: what a load copies before it waits then follows from where
/// the writer put the chunks, whichever files they went to.)
#[test]
fn a_stage_takes_the_chunks_of_a_buffer_its_base_was_still_loading() {
    in_child(|| {
        std::env::set_var("POSSUM_KEEPER_STAGE_READERS", "1");
        let (dir, server) = fresh_keeper();
        let mut d = Drafted::new(&server, dir.path(), 90);
        let (arriving, whole) = d.arriving(dir.path(), true);
        let draft = possum_engine::image::Image::open_draft(&arriving).unwrap();
        // Each buffer's chunks in load order: their lengths and the files they lie in.
        let layout: Vec<Vec<(u64, String)>> = (0..3)
            .map(|i| {
                let chunks = d.chunks_in(&draft, i).into_iter();
                chunks.map(|p| (p.len, p.file)).collect()
            })
            .collect();
        // A data file said not whole (every chunk in it waits) holding a chunk of the largest
        // buffer but not its first: that buffer's load starts, then waits.
        let third = &layout[2];
        let held = (whole.keys())
            .find(|f| third[0].1 != **f && third.iter().any(|(_, file)| file == *f))
            .expect("the third buffer's chunks lie in several files")
            .clone();
        let mut present = whole.clone();
        *present.get_mut(&held).unwrap() -= 1;
        // What each buffer's load copies before it waits: its chunks read one at a time, those
        // before the first in that file. (Buffers loaded whole, reads left waiting.)
        let (mut expect, mut whole_bytes, mut ready, mut waiting) = (0, 0, 0, 0);
        for chunks in &layout {
            let batch = 1;
            let Some(g) = chunks
                .chunks(batch)
                .position(|g| g.iter().any(|c| c.1 == held))
            else {
                let size: u64 = chunks.iter().map(|c| c.0).sum();
                (expect, whole_bytes, ready) = (expect + size, whole_bytes + size, ready + 1);
                continue;
            };
            if chunks[0].1 == held {
                continue;
            }
            let group = &chunks[g * batch..((g + 1) * batch).min(chunks.len())];
            waiting += group.iter().filter(|c| c.1 == held).count() as u64;
            expect += chunks[..g * batch].iter().map(|c| c.0).sum::<u64>();
        }
        assert!(expect > whole_bytes, "the test takes part of a buffer");
        let pre = d.k.prestage_arriving(&arriving, 60, present).unwrap();
        wait_for_stage(
            &server,
            pre.stage,
            "the prestage's loads are done or waiting",
            |s| s.ready == ready && s.reads_waiting == waiting,
        );
        let img = d.finished(dir.path());
        let info = d.restored_on(&server, &img, pre.stage, |i| 90 + i as u64);
        assert_eq!(info.reused_bytes, expect, "{info:?}");
        d.free(&server);
    });
}

/// An image of three buffers (several 1 MiB chunks each) that an engine on `server` wrote at
/// `dir/img/gpu-0`, the engine's memory freed since.
fn three_buffer_image(server: &Server, dir: &Path) -> PathBuf {
    use possum_engine::image::{ImageWriter, WriterOptions};
    use std::sync::Arc;
    let kept = KeptEngine::chunked(server);
    let e = &kept.engine;
    let bufs: Vec<_> = [MIB4, 2 * MIB4 - 4096, 3 * MIB4]
        .iter()
        .map(|&n| e.alloc(n).unwrap())
        .collect();
    for (i, b) in bufs.iter().enumerate() {
        kept.write(b.va(), 30 + i as u64, b.size());
    }
    let img = dir.join("img/gpu-0");
    let w = Arc::new(ImageWriter::create(&img, WriterOptions::default()).unwrap());
    e.checkpoint(w.clone(), false).unwrap().wait().unwrap();
    Arc::try_unwrap(w).unwrap().commit().unwrap();
    for b in &bufs {
        e.free(b.va()).unwrap();
    }
    img
}

/// `len` bytes of the data file holding the first chunk of buffer `buf` of `image`, `into`
/// bytes into that chunk, as a stage names them.
fn piece_of(image: &possum_engine::image::Image, buf: u64, into: u64, len: u64) -> PendingPiece {
    use possum_engine::store::ChunkSource;
    let (off, _) = image.chunks(buf)[0];
    let (file, at) = image.chunk_location(buf, off).expect("the chunk is there");
    PendingPiece {
        file: file.to_string(),
        offset: at + into,
        len,
    }
}

/// Writes `bytes` at piece `p` of the data files of the image in `dir`: the bytes there before.
/// A stage of a [`three_buffer_image`] whose buffer `which` has `len` bytes at `at` of its
/// first chunk still to come ([`staged_with_bytes_to_come`]).
struct ToCome {
    img: PathBuf,
    image: possum_engine::image::Image,
    buf: u64,
    piece: PendingPiece,
    /// The bytes the piece should hold (its file holds others until they are put back).
    good: Vec<u8>,
    k: Keeper,
    info: possum_keeper::StageInfo,
}

/// Stages a [`three_buffer_image`] with `len` bytes at `at` of buffer `which`'s first chunk
/// pending (with `stale`, those bytes replaced by it in the file meanwhile), once the other
/// two buffers are loaded.
fn staged_with_bytes_to_come(
    server: &Server,
    dir: &Path,
    which: usize,
    (at, len): (u64, u64),
    stale: Option<u8>,
) -> ToCome {
    use possum_engine::image::Image;
    use possum_engine::store::ChunkSource;
    let img = three_buffer_image(server, dir);
    let image = Image::open(&img).unwrap();
    let buf = image.buffers()[which].id;
    let piece = piece_of(&image, buf, at, len);
    let good = match stale {
        Some(b) => swap_bytes(&img, &piece, &vec![b; len as usize]),
        None => Vec::new(),
    };
    let me = std::process::id() as i32;
    let mut k = Keeper::connect(server.path()).unwrap();
    let info = k
        .stage(me, &img, 60, None, None, vec![piece.clone()])
        .unwrap();
    wait_until("the other buffers are loaded", || {
        server.stats().stages[0].ready == 2
    });
    ToCome {
        img,
        image,
        buf,
        piece,
        good,
        k,
        info,
    }
}

fn swap_bytes(dir: &Path, p: &PendingPiece, bytes: &[u8]) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join(&p.file))
        .unwrap();
    let mut before = vec![0u8; bytes.len()];
    f.read_exact_at(&mut before, p.offset).unwrap();
    f.write_all_at(bytes, p.offset).unwrap();
    before
}

/// Whether the memory of staged buffer `b` holds what `image` holds for it (each chunk read,
/// its checksum checked).
fn holds_image(server: &Server, image: &possum_engine::image::Image, b: &StagedBuffer) -> bool {
    use possum_engine::store::ChunkSource;
    image.chunks(b.buf).into_iter().all(|(off, len)| {
        let mut want = vec![0u8; len as usize];
        image.read_chunk(b.buf, off, &mut want).unwrap();
        server.read(b.alloc, off, len as usize).unwrap() == want
    })
}

/// The stage's loader threads alive in this process.
fn loader_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        // "possum-keeper-stage", cut to the kernel's 15 bytes ("possum-keeper-spare" is
        // made only with spares).
        .filter(|c| c.trim_end() == "possum-keeper-s")
        .count()
}

/// `stage_wait` for allocation `alloc` of stage `stage` on a thread of its own: its answer comes
/// on the channel.
fn wait_on_thread(
    server: &Server,
    stage: u64,
    alloc: u64,
) -> std::sync::mpsc::Receiver<Result<(), KeeperError>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let path = server.path().to_path_buf();
    std::thread::spawn(move || {
        let r = Keeper::connect(&path).and_then(|mut k| k.stage_wait(stage, alloc));
        let _ = tx.send(r);
    });
    rx
}

/// `stage_demands` of stage `stage` waiting up to `wait`, on a thread of its own.
fn demands_on_thread(
    server: &Server,
    stage: u64,
    wait: Duration,
) -> std::sync::mpsc::Receiver<Result<Vec<PendingPiece>, KeeperError>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let path = server.path().to_path_buf();
    std::thread::spawn(move || {
        let r = Keeper::connect(&path).and_then(|mut k| k.stage_demands(stage, wait));
        let _ = tx.send(r);
    });
    rx
}

/// What a channel of [`wait_on_thread`] or [`demands_on_thread`] says within 10 s.
fn answer<T>(rx: &std::sync::mpsc::Receiver<T>) -> T {
    rx.recv_timeout(Duration::from_secs(10))
        .expect("an answer within 10 s")
}

/// Checks that nothing came on `rx` yet (a reply that must not have come).
fn no_answer_yet<T: std::fmt::Debug>(rx: &std::sync::mpsc::Receiver<T>, what: &str) {
    let r = rx.recv_timeout(Duration::from_millis(300));
    assert!(
        matches!(r, Err(std::sync::mpsc::RecvTimeoutError::Timeout)),
        "{what}: {r:?}"
    );
}

/// Post-copy: a stage whose image has bytes still to come at a chunk of one buffer loads the
/// others, and leaves that one blocked (its loaders waiting, not gone): a `stage_wait` for it
/// is not answered, and `stage_demands` hands out the piece it needs, once. Once the bytes are
/// in the file and `stage_arrived` says so, the buffer is loaded with the image's bytes and the
/// wait answered.
#[test]
fn a_stage_waits_for_the_bytes_still_to_come() {
    in_child(|| {
        let (dir, server) = fresh_keeper();
        let ToCome {
            img,
            image,
            buf,
            piece,
            good,
            mut k,
            info,
        } = staged_with_bytes_to_come(&server, dir.path(), 1, (100, 4096), Some(0xee));
        let plan = k.staged(&img).unwrap().expect("the stage");
        let blocked = plan.buffers.iter().find(|b| b.buf == buf).unwrap().clone();
        let st = server.stats().stages[0].clone();
        assert_eq!((st.pending_pieces, st.blocked_buffers), (1, 1), "{st:?}");
        assert!(
            loader_threads() > 0,
            "the loaders wait for the blocked buffer"
        );
        for b in plan.buffers.iter().filter(|b| b.buf != buf) {
            assert!(holds_image(&server, &image, b), "buffer {} loaded", b.buf);
        }

        let waited = wait_on_thread(&server, info.stage, blocked.alloc);
        no_answer_yet(&waited, "a wait for a blocked buffer");
        assert_eq!(
            k.stage_demands(info.stage, Duration::from_secs(10))
                .unwrap(),
            vec![piece.clone()]
        );
        assert!(
            k.stage_demands(info.stage, Duration::ZERO)
                .unwrap()
                .is_empty(),
            "a piece is handed out once"
        );
        no_answer_yet(&waited, "a wait for a blocked buffer");

        swap_bytes(&img, &piece, &good);
        assert_eq!(
            k.stage_arrived(info.stage, std::slice::from_ref(&piece))
                .unwrap(),
            0
        );
        answer(&waited).expect("loaded once its bytes arrived");
        assert!(holds_image(&server, &image, &blocked));
        let st = server.stats().stages[0].clone();
        assert_eq!((st.ready, st.failed), (3, 0), "{st:?}");
        assert_eq!((st.pending_pieces, st.blocked_buffers), (0, 0), "{st:?}");
        assert!(st.done_ms.is_some(), "{st:?}");
        // Nothing pending: a long poll answers at once.
        assert!(k
            .stage_demands(info.stage, Duration::from_secs(600))
            .unwrap()
            .is_empty());
        wait_until("the loaders are gone", || loader_threads() == 0);
        assert_eq!(k.stage_end(info.stage).unwrap(), 3);
    });
}

/// Pieces said to have arrived that are not pending (another range, another file, one that
/// arrived already) change nothing: the buffer stays blocked until its own piece arrives.
#[test]
fn pieces_arrived_that_are_not_pending_are_ignored() {
    in_child(|| {
        let (dir, server) = fresh_keeper();
        let ToCome {
            img,
            image,
            buf,
            piece,
            good,
            mut k,
            info,
        } = staged_with_bytes_to_come(&server, dir.path(), 0, (0, 8), Some(0));
        let others = [
            PendingPiece {
                len: 4,
                ..piece.clone()
            },
            PendingPiece {
                offset: piece.offset + 1,
                ..piece.clone()
            },
            PendingPiece {
                file: "data-999.bin".to_string(),
                ..piece.clone()
            },
        ];
        assert_eq!(k.stage_arrived(info.stage, &others).unwrap(), 1);
        assert_eq!(k.stage_arrived(info.stage, &[]).unwrap(), 1);
        let st = server.stats().stages[0].clone();
        assert_eq!((st.ready, st.blocked_buffers), (2, 1), "{st:?}");

        swap_bytes(&img, &piece, &good);
        assert_eq!(
            k.stage_arrived(info.stage, std::slice::from_ref(&piece))
                .unwrap(),
            0
        );
        assert_eq!(k.stage_arrived(info.stage, &[piece]).unwrap(), 0);
        let plan = k.staged(&img).unwrap().expect("the stage");
        let b = plan.buffers.iter().find(|b| b.buf == buf).unwrap();
        k.stage_wait(info.stage, b.alloc).unwrap();
        assert!(holds_image(&server, &image, b));
        assert_eq!(k.stage_end(info.stage).unwrap(), 3);
    });
}

/// A stage ended while a buffer is blocked: the wait for it fails, a long poll for demands is
/// answered (empty), the loaders exit, and its memory is freed.
#[test]
fn a_stage_ended_while_blocked_fails_its_waits_and_stops_its_loaders() {
    in_child(|| {
        let (dir, server) = fresh_keeper();
        let ToCome {
            img,
            buf,
            piece,
            mut k,
            info,
            ..
        } = staged_with_bytes_to_come(&server, dir.path(), 2, (4096, 1), None);
        let plan = k.staged(&img).unwrap().expect("the stage");
        let blocked = plan.buffers.iter().find(|b| b.buf == buf).unwrap();
        // Nothing waited for yet: a long poll waits.
        let polled = demands_on_thread(&server, info.stage, Duration::from_secs(60));
        no_answer_yet(&polled, "demands before any wait");
        let waited = wait_on_thread(&server, info.stage, blocked.alloc);
        assert_eq!(answer(&polled).unwrap(), vec![piece]);
        let polled = demands_on_thread(&server, info.stage, Duration::from_secs(60));
        no_answer_yet(&polled, "demands handed out already");
        assert!(
            loader_threads() > 0,
            "the loaders wait for the blocked buffer"
        );

        assert_eq!(k.stage_end(info.stage).unwrap(), 3);
        let err = answer(&waited).unwrap_err().to_string();
        assert!(err.contains("ended"), "{err}");
        assert!(answer(&polled).unwrap().is_empty());
        wait_until("the loaders are gone", || loader_threads() == 0);
        let st = server.stats();
        let last = st.stages_ended.last().expect("the ended stage is shown");
        assert_eq!((last.ready, last.failed), (2, 1), "{last:?}");
        assert_eq!(
            (last.pending_pieces, last.blocked_buffers),
            (1, 0),
            "{last:?}"
        );
        assert_eq!(st.retained, Usage::default());
    });
}

/// Spare image memory: a keeper with `POSSUM_KEEPER_SPARE_*` makes a spare
/// file in that directory; a drain into that filesystem takes it, has the keeper copy its own
/// allocation into it (the bytes and each piece's CRC32C as the caller's), gives it back, and a
/// new spare is made. Another process's allocation is refused, a directory on another
/// filesystem too, and a drain that is not lent is named.
#[test]
fn a_drain_copies_its_memory_into_the_keeper_s_spare() {
    in_child(|| {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let spares = dir.path().join("spares");
        std::fs::create_dir(&spares).unwrap();
        // A stale spare of a keeper that is gone is removed when the first spare is made.
        std::fs::write(spares.join(".possum-spare-999999999-1"), b"stale").unwrap();
        // Registered 4 MiB at a time: a fill across a step is split there.
        let server = keeper_with_spares(
            dir.path(),
            &spares,
            16,
            &[("POSSUM_KEEPER_SPARE_STEP_MIB", "4")],
        );
        let spare_files = || -> Vec<PathBuf> {
            let mut v: Vec<PathBuf> = std::fs::read_dir(&spares)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            v.sort();
            v
        };
        let mut k = Keeper::connect(server.path()).unwrap();
        let lease = take_spare(&mut k, dir.path());
        assert_eq!(lease.len, 16 << 20);
        assert_eq!(
            spare_files(),
            vec![PathBuf::from(&lease.path)],
            "the stale one is gone"
        );
        // The caller takes the file (renamed into its image), then the keeper fills it.
        let taken = dir.path().join("data-keeper.bin");
        std::fs::rename(&lease.path, &taken).unwrap();
        let fill = |alloc, offset, len, at, piece| possum_keeper::SpareFill {
            drain: lease.drain,
            alloc,
            offset,
            len,
            at,
            piece,
        };
        let (a, fd) = k.alloc(MIB4).unwrap();
        let data = pattern(7, MIB4);
        std::fs::File::from(fd).write_all_at(&data, 0).unwrap();
        // Two fills at once, from two connections (they share the keeper's fill threads); the
        // first crosses the 4 MiB registration step.
        let (b, fd) = k.alloc(MIB4).unwrap();
        let data_b = pattern(8, MIB4);
        std::fs::File::from(fd).write_all_at(&data_b, 0).unwrap();
        let mut k2 = Keeper::connect(server.path()).unwrap();
        let (crcs, crcs_b) = std::thread::scope(|sc| {
            let second = sc.spawn(|| k2.spare_fill(&fill(b.id, 0, MIB4, 8 << 20, 1 << 20)));
            let first = k.spare_fill(&fill(a.id, 4096, 3 << 20, 3 << 20, 1 << 20));
            (first.unwrap(), second.join().unwrap().unwrap())
        });
        let want: Vec<u32> = data[4096..4096 + (3 << 20)]
            .chunks(1 << 20)
            .map(crc32c::crc32c)
            .collect();
        assert_eq!(crcs, want);
        let want_b: Vec<u32> = data_b.chunks(1 << 20).map(crc32c::crc32c).collect();
        assert_eq!(crcs_b, want_b);
        let mut back = vec![0u8; 3 << 20];
        std::fs::File::open(&taken)
            .unwrap()
            .read_exact_at(&mut back, 3 << 20)
            .unwrap();
        assert!(
            back == data[4096..4096 + (3 << 20)],
            "the file holds the bytes"
        );
        let mut back_b = vec![0u8; MIB4 as usize];
        std::fs::File::open(&taken)
            .unwrap()
            .read_exact_at(&mut back_b, 8 << 20)
            .unwrap();
        assert!(back_b == data_b, "the file holds the second fill's bytes");
        // Out of the spare: refused by name.
        let err = k
            .spare_fill(&fill(a.id, 0, 1 << 20, 16 << 20, 1 << 20))
            .unwrap_err()
            .to_string();
        assert!(err.contains("outside"), "{err}");
        let mut other = Client::of(&server);
        let (theirs, _) = other.alloc(MIB4);
        let err = k
            .spare_fill(&fill(theirs, 0, 4096, 0, 4096))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no allocation"), "{err}");
        exit_and_reap(&mut k, other);
        k.spare_end(lease.drain).unwrap();
        let err = k
            .spare_fill(&fill(a.id, 0, 4096, 0, 4096))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not lent") || err.contains("no spare is lent"),
            "{err}"
        );
        assert!(k.spare_end(lease.drain).is_err());
        // Given back, the file stays the caller's, and another spare is made.
        assert!(taken.exists());
        wait_until("no new spare", || !spare_files().is_empty());
        // A directory on another filesystem (or none) gets no spare.
        let err = k.spare_take(Path::new("/proc")).unwrap_err().to_string();
        assert!(
            err.contains("another filesystem") || err.contains("being made"),
            "{err}"
        );
        // A process that takes the spare and dies without giving it back: the keeper ends the loan
        // (the spare unmapped, its file removed) and makes another.
        let mut taker = Client::of(&server);
        let t = Instant::now();
        let lent = loop {
            // The new spare's file exists before it is registered: asked until it is ready.
            let r = taker.ask(&format!("spare_take {}", dir.path().display()));
            if r.starts_with("lent ") || t.elapsed() > Duration::from_secs(10) {
                break r;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(lent.starts_with("lent "), "{lent}");
        let path = lent.split_whitespace().nth(2).unwrap().to_string();
        taker.exit();
        server.free_orphans_now();
        assert!(
            !Path::new(&path).exists(),
            "the dead drain's spare is removed"
        );
        wait_until("no spare after the dead drain", || {
            !spare_files().is_empty()
        });
    });
}

/// The keeper makes a spare only while none of its jobs is being checkpointed: memory retained
/// by a live process (the job's hold) delays the next spare until the memory is taken back.
#[test]
fn a_spare_is_made_only_outside_a_hold() {
    in_child(|| {
        let dir = tempfile::tempdir().unwrap();
        let server = keeper_with_spares(dir.path(), dir.path(), 8, &[]);
        let mut k = Keeper::connect(server.path()).unwrap();
        let first = take_spare(&mut k, dir.path());
        // This process holds: its allocation retained (as at a checkpoint's release).
        let (a, fd) = k.alloc(MIB4).unwrap();
        drop(fd);
        k.retain(a.id, 1, 0).unwrap();
        k.spare_end(first.drain).unwrap();
        std::thread::sleep(Duration::from_millis(500));
        let err = k.spare_take(dir.path()).unwrap_err().to_string();
        assert!(err.contains("being made"), "{err}");
        // The hold ends: the spare is made.
        drop(k.reclaim(a.id, 1).unwrap());
        let second = take_spare(&mut k, dir.path());
        assert_ne!(second.path, first.path);
        k.spare_end(second.drain).unwrap();
    });
}

/// A client that connects and stalls (half a request, never finished; another that never says
/// anything) holds up nobody else: each connection has its own thread, and the others are
/// served meanwhile.
#[test]
fn a_client_that_stalls_holds_up_nobody_else() {
    with_keeper(|server| {
        let mut half = std::os::unix::net::UnixStream::connect(server.path()).unwrap();
        half.write_all(br#"{"cmd":"sta"#).unwrap();
        let _silent = std::os::unix::net::UnixStream::connect(server.path()).unwrap();
        let limit = Duration::from_secs(10);
        let mut k = Keeper::connect_within(server.path(), limit, limit).unwrap();
        let (a, _fd) = k.alloc(MIB4).unwrap();
        assert_eq!(a.size, MIB4);
        assert_eq!(k.stats().unwrap().total.bytes, MIB4);
        k.free(a.id).unwrap();
        assert_eq!(k.stats().unwrap().total.bytes, 0);
    });
}
