//! `hostfill-probe [MIB] [DIR]`: a file of MIB (1024) MiB of pseudo-random data in DIR
//! (`/dev/shm`) fills the untouched anonymous memory of a forked child, two reps of:
//! - the child `pread`s it in itself, 64 MiB per call (CRIU's restorer's way), with and without
//!   `MADV_HUGEPAGE` first;
//! - this process writes it into the child with `process_vm_writev`, 4 MiB per call, from 1, 2,
//!   4, 8 and 16 threads, the source either the file mapped (`mmap`) or read into a buffer
//!   (`pread+buf`).
//!
//! Every fill is checked: the child's checksum of its memory must equal the file's. A probe:
//! raw libc calls, each `unsafe` block on plain memory this program maps itself.
use std::os::fd::AsRawFd;
use std::time::Instant;

const MIB: usize = 1 << 20;

/// A fresh private anonymous mapping of `size` bytes, untouched.
fn anon(size: usize, huge: bool) -> *mut u8 {
    // SAFETY: a new mapping the kernel places; checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert!(p != libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
    if huge {
        // SAFETY: advice on the mapping just made.
        unsafe { libc::madvise(p, size, libc::MADV_HUGEPAGE) };
    }
    p.cast()
}

/// A sampled checksum of `size` bytes at `p` (every 509th word).
fn checksum(p: *const u8, size: usize) -> u64 {
    // SAFETY: callers pass a live mapping of at least `size` readable bytes, 8-aligned.
    let s = unsafe { std::slice::from_raw_parts(p.cast::<u64>(), size / 8) };
    s.iter()
        .step_by(509)
        .fold(0u64, |a, &x| a.wrapping_mul(31).wrapping_add(x))
}

fn write_fd<T>(fd: i32, v: &T) {
    // SAFETY: writes the bytes of `v` to a pipe.
    let n = unsafe { libc::write(fd, std::ptr::from_ref(v).cast(), std::mem::size_of::<T>()) };
    assert_eq!(n as usize, std::mem::size_of::<T>());
}

fn read_fd<T: Default>(fd: i32) -> T {
    let mut v = T::default();
    // SAFETY: reads `size_of::<T>()` bytes from a pipe into `v` (plain integers only).
    let n = unsafe { libc::read(fd, std::ptr::from_mut(&mut v).cast(), std::mem::size_of::<T>()) };
    assert_eq!(n as usize, std::mem::size_of::<T>());
    v
}

struct Child {
    pid: i32,
    to: i32,
    from: i32,
}

/// Forks a child that maps `size` bytes (and, with `selfread`, `pread`s the file into them,
/// timed); returns it, the mapping's address and the time of its own fill (ms).
fn spawn(size: usize, huge: bool, selfread: Option<i32>) -> (Child, usize, f64) {
    let (mut a, mut b) = ([0i32; 2], [0i32; 2]);
    // SAFETY: two fresh pipes.
    unsafe {
        assert_eq!(libc::pipe(a.as_mut_ptr()), 0);
        assert_eq!(libc::pipe(b.as_mut_ptr()), 0);
    }
    // SAFETY: the probe is single-threaded here; the child only calls async-signal-safe
    // functions and the checksum, then `_exit`s.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let p = anon(size, huge);
        let mut ms = 0f64;
        if let Some(fd) = selfread {
            let t = Instant::now();
            let mut off = 0;
            while off < size {
                let n = (64 * MIB).min(size - off);
                // SAFETY: reads into the child's own mapping, inside its `size` bytes.
                let r = unsafe { libc::pread(fd, p.add(off).cast(), n, off as i64) };
                assert_eq!(r as usize, n);
                off += n;
            }
            ms = t.elapsed().as_secs_f64() * 1e3;
        }
        write_fd(b[1], &[p as u64, ms.to_bits()]);
        let _go: u8 = read_fd(a[0]);
        write_fd(b[1], &checksum(p, size));
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(0) };
    }
    let msg: [u64; 2] = read_fd(b[0]);
    (
        Child {
            pid,
            to: a[1],
            from: b[0],
        },
        msg[0] as usize,
        f64::from_bits(msg[1]),
    )
}

/// The child's checksum of its memory; reaps it.
fn finish(c: Child) -> u64 {
    write_fd(c.to, &1u8);
    let sum: u64 = read_fd(c.from);
    // SAFETY: reaps our own child.
    unsafe { libc::waitpid(c.pid, std::ptr::null_mut(), 0) };
    sum
}

/// Writes `size` bytes into `pid` at `dst` from `threads` threads, `chunk` bytes per call: from
/// `src` (the file mapped) or, with `buffered`, from a buffer each thread `pread`s into. ms.
fn vmwrite(
    pid: i32,
    src: usize,
    dst: usize,
    size: usize,
    threads: usize,
    chunk: usize,
    buffered: Option<i32>,
) -> f64 {
    let t = Instant::now();
    let per = size.div_ceil(threads).div_ceil(chunk) * chunk;
    std::thread::scope(|s| {
        for k in 0..threads {
            s.spawn(move || {
                let end = ((k + 1) * per).min(size);
                let mut buf = vec![0u8; if buffered.is_some() { chunk } else { 0 }];
                let mut off = k * per;
                while off < end {
                    let n = chunk.min(end - off);
                    let base = match buffered {
                        Some(fd) => {
                            // SAFETY: reads into this thread's own buffer of `chunk` bytes.
                            let r = unsafe {
                                libc::pread(fd, buf.as_mut_ptr().cast(), n, off as i64)
                            };
                            assert_eq!(r as usize, n);
                            buf.as_ptr() as usize
                        }
                        None => src + off,
                    };
                    let l = libc::iovec {
                        iov_base: base as *mut _,
                        iov_len: n,
                    };
                    let r = libc::iovec {
                        iov_base: (dst + off) as *mut _,
                        iov_len: n,
                    };
                    // SAFETY: the local iovec is readable memory of ours (the mapped file or
                    // the buffer); the remote one is the child's mapping.
                    let w = unsafe { libc::process_vm_writev(pid, &l, 1, &r, 1, 0) };
                    assert_eq!(w as usize, n, "{}", std::io::Error::last_os_error());
                    off += n;
                }
            });
        }
    });
    t.elapsed().as_secs_f64() * 1e3
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let size = args.get(1).map_or(1024, |s| s.parse::<usize>().expect("MiB")) * MIB;
    let dir = args.get(2).cloned().unwrap_or_else(|| "/dev/shm".into());
    let path = format!("{dir}/hostfill-probe.bin");
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let data: Vec<u8> = (0..size / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    std::fs::write(&path, &data).expect("write the data file");
    drop(data);
    let f = std::fs::File::open(&path).expect("open the data file");
    let fd = f.as_raw_fd();
    // SAFETY: a read-only shared mapping of the whole file, which outlives every use.
    let src = unsafe {
        libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ, libc::MAP_SHARED, fd, 0)
    };
    assert!(src != libc::MAP_FAILED);
    let want = checksum(src.cast(), size);
    let gb = size as f64 / 1e9;
    for rep in 0..2 {
        for huge in [false, true] {
            let (c, _, ms) = spawn(size, huge, Some(fd));
            assert_eq!(finish(c), want);
            println!(
                "rep {rep} huge={huge} self pread (CRIU-like): {ms:.1} ms ({:.2} GB/s)",
                gb / ms * 1e3
            );
        }
        for threads in [1usize, 2, 4, 8, 16] {
            for (name, buffered) in [("mmap", None), ("pread+buf", Some(fd))] {
                let (c, addr, _) = spawn(size, false, None);
                let ms = vmwrite(c.pid, src as usize, addr, size, threads, 4 * MIB, buffered);
                assert_eq!(finish(c), want);
                println!(
                    "rep {rep} process_vm_writev {name} threads={threads}: {ms:.1} ms ({:.2} GB/s)",
                    gb / ms * 1e3
                );
            }
        }
    }
    let _ = std::fs::remove_file(&path);
}
