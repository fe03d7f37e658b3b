//! The possum executable as the CLI tests on the fake GPU stack run it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// `possum` for the fake GPU stack built into `dir`: the jobs' socket directory `dir/sockets`
/// is possum's too (a restore removes a stale socket only there), the fake driver is
/// `dir/libcuda.so.1`, and no LD_PRELOAD is inherited.
pub fn possum_in(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_possum"));
    c.env("POSSUM_SOCKET_DIR", dir.join("sockets"))
        .env("POSSUM_LIBCUDA", dir.join("libcuda.so.1"))
        .env_remove("LD_PRELOAD");
    c
}

/// [`possum_in`], with the fake driver's checkpoint state kept in the job's own process, as the
/// real driver's is.
pub fn possum_checkpointing_in(dir: &Path) -> Command {
    let mut c = possum_in(dir);
    c.env("FAKE_CKPT_IN_PROCESS", "1");
    c
}

/// A command's stdout, then its stderr.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The fake driver (cuda/testdata/fake-libcuda.c), built into `dir` as `libcuda.so.1`; `None`
/// without a C compiler.
pub fn fake_libcuda(dir: &Path) -> Option<PathBuf> {
    let lib = dir.join("libcuda.so.1");
    Command::new("cc")
        .args(["-O1", "-shared", "-fPIC", "-Wl,-Bsymbolic", "-o"])
        .arg(&lib)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../cuda/testdata/fake-libcuda.c"
        ))
        .status()
        .is_ok_and(|s| s.success())
        .then_some(lib)
}

/// A new temporary directory with the fake driver built into it ([`fake_libcuda`]): (the
/// directory, the driver); `None`, said on stderr, without a C compiler (the test is skipped).
pub fn fake_libcuda_or_skip() -> Option<(tempfile::TempDir, PathBuf)> {
    let tmp = tempfile::tempdir().unwrap();
    let Some(lib) = fake_libcuda(tmp.path()) else {
        eprintln!("SKIPPED: no C compiler for the fake driver");
        return None;
    };
    Some((tmp, lib))
}

/// A keeper process ended when dropped.
pub struct KeeperProcess(pub Child);

impl Drop for KeeperProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `possum keeper --dir DIR/keeper` on the fake driver (`DIR/libcuda.so.1`), once it is ready: (the process, DIR/keeper).
pub fn start_keeper(dir: &Path) -> (KeeperProcess, PathBuf) {
    start_keeper_with(dir, &[])
}

/// [`start_keeper`] with `env` added to the keeper's environment.
pub fn start_keeper_with(dir: &Path, env: &[(&str, &str)]) -> (KeeperProcess, PathBuf) {
    start_keeper_args(dir, env, &[])
}

/// [`start_keeper_with`], `args` added to its command line.
pub fn start_keeper_args(
    dir: &Path,
    env: &[(&str, &str)],
    args: &[&str],
) -> (KeeperProcess, PathBuf) {
    let keeper_dir = dir.join("keeper");
    let mut keeper = possum_in(dir)
        .args(["keeper", "--dir"])
        .arg(&keeper_dir)
        .args(args)
        .env("LD_LIBRARY_PATH", dir)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(keeper.stdout.take().unwrap()),
        &mut ready,
    )
    .unwrap();
    assert_eq!(ready.trim(), "ready");
    (KeeperProcess(keeper), keeper_dir)
}

/// Runs `c`, which must succeed: its output.
pub fn run_ok(c: &mut Command) -> Output {
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    o
}

/// `possum.json`'s text for the description `m`, with its check.
pub fn sealed(m: &serde_json::Value) -> String {
    possum_sequence::image::manifest_text(&serde_json::from_value(m.clone()).unwrap()).unwrap()
}

/// A PID that is free: a reaped child's.
pub fn free_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    c.wait().unwrap();
    c.id()
}

/// A committed engine image in `dir` of one buffer, id 1 at 0x7f00_0000_0000, of `size` bytes
/// of 7s: a job's GPU image, for an image made by hand.
pub fn one_buffer_gpu_image(dir: &Path, size: u64) {
    use possum_engine::store::{BufferRecord, ChunkSink};
    let w = possum_engine::image::ImageWriter::create(
        dir,
        possum_engine::image::WriterOptions {
            fsync: false,
            ..Default::default()
        },
    )
    .unwrap();
    w.add_buffer(BufferRecord {
        id: 1,
        va: 0x7f00_0000_0000,
        size,
        prefetch_rank: 0,
    })
    .unwrap();
    w.write_chunk(1, 0, &vec![7u8; size as usize]).unwrap();
    w.commit().unwrap();
}

/// Starts `checkpoint` (a `possum checkpoint` into `img`, its output dropped), kills it after
/// `delay_ms` and reaps it; asserts that `img` is then absent or a complete image. Whether it
/// is there.
pub fn checkpoint_killed_after(checkpoint: &mut Command, img: &Path, delay_ms: u64) -> bool {
    let mut c = checkpoint
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(delay_ms));
    let _ = c.kill();
    let _ = c.wait();
    assert!(
        !img.exists() || img.join("possum.json").is_file(),
        "killed after {delay_ms} ms: an incomplete image under DIR's name"
    );
    img.exists()
}
