//! A process that maps files, as the dynamic loader maps a job's libraries, under a name of the
//! test's choosing: for the tests that read `/proc/PID/maps`, `stat` and `status`. Included with
//! `#[path]` where needed.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

/// A `python3` child that maps each of its files (read-only, whole) and sleeps; killed and reaped
/// when dropped.
pub struct Mapper {
    child: Child,
    // Kept open until the end: closed, a write of the child's could kill it.
    _out: ChildStdout,
}

impl Mapper {
    /// Starts one over `files` (each made first: 4 KiB of zeros) and waits until they are
    /// mapped. `None` when there is no `python3`.
    pub fn start(files: &[PathBuf]) -> Option<Mapper> {
        Mapper::start_named(files, b"")
    }

    /// [`Mapper::start`], the process named `name` (its `comm`, as `prctl(PR_SET_NAME)` sets
    /// it: any bytes, up to 15) unless empty.
    pub fn start_named(files: &[PathBuf], name: &[u8]) -> Option<Mapper> {
        for f in files {
            std::fs::write(f, [0u8; 4096]).unwrap();
        }
        let hex: String = name.iter().map(|b| format!("{b:02x}")).collect();
        let mut child = Command::new("python3")
            .args([
                "-c",
                "import ctypes, mmap, sys, time\n\
                 if sys.argv[1]: ctypes.CDLL(None).prctl(15, bytes.fromhex(sys.argv[1]), 0, 0, 0)\n\
                 fs = [open(p, 'rb') for p in sys.argv[2:]]\n\
                 ms = [mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) for f in fs]\n\
                 print('ready', flush=True)\n\
                 time.sleep(60)\n",
                &hex,
            ])
            .args(files)
            .stdout(Stdio::piped())
            .spawn()
            .ok()?;
        let mut out = child.stdout.take().unwrap();
        let mut ready = [0u8; 6];
        out.read_exact(&mut ready).unwrap();
        assert_eq!(&ready, b"ready\n");
        Some(Mapper { child, _out: out })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// How it ended, if it did.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().unwrap()
    }
}

impl Drop for Mapper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `dir/odd-\xff`: a file name that is not UTF-8.
pub fn not_utf8(dir: &Path) -> PathBuf {
    dir.join(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(b"odd-\xff"))
}
