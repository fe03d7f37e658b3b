//! Keeps a job off io_uring: CRIU cannot dump an io_uring instance (`Unknown shit 600
//! (anon_inode:[io_uring])`), and libuv 1.50 and later (under torch's TCPStore, in torchrun's
//! agent and every rank) makes one whatever `UV_USE_IO_URING` says. `possum run` installs a
//! seccomp filter in the job before it starts under which `io_uring_setup` fails with `ENOSYS`,
//! as on a kernel without io_uring, and libuv and every other user fall back to epoll and
//! threads. Inherited by the job's children; CRIU dumps and restores the filter with the job.
//!
//! The one `unsafe` of this module: the filter's installation in the child between `fork` and
//! `exec` (`prctl` only, async-signal-safe, on memory made before the fork).

use std::os::unix::process::CommandExt;
use std::process::Command;

/// `io_uring_setup`'s number on x86-64.
const NR_IO_URING_SETUP: u32 = 425;
/// `AUDIT_ARCH_X86_64`.
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const ENOSYS: u32 = 38;
// Classic BPF, as seccomp takes it.
const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JEQ_K: u16 = 0x15;
const BPF_RET_K: u16 = 0x06;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
/// Offsets in `struct seccomp_data`: the syscall number, then the architecture.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;

const fn op(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// The filter: on x86-64, `io_uring_setup` fails with `ENOSYS`; every other call is allowed.
const FILTER: [libc::sock_filter; 6] = [
    op(BPF_LD_W_ABS, 0, 0, DATA_ARCH),
    op(BPF_JEQ_K, 0, 3, AUDIT_ARCH_X86_64),
    op(BPF_LD_W_ABS, 0, 0, DATA_NR),
    op(BPF_JEQ_K, 0, 1, NR_IO_URING_SETUP),
    op(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),
    op(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
];

/// Has `cmd`'s process install the filter before it runs the job. Where the kernel refuses it
/// (no seccomp), the job starts all the same.
pub fn keep_off_io_uring(cmd: &mut Command) {
    let root = nix::unistd::geteuid().is_root();
    // SAFETY: runs in the forked child before exec; `prctl` is async-signal-safe and reads only
    // `FILTER`, a constant of this executable mapped in the child as in the parent.
    unsafe {
        cmd.pre_exec(move || {
            let prog = libc::sock_fprog {
                len: FILTER.len() as u16,
                filter: FILTER.as_ptr().cast_mut(),
            };
            // Without CAP_SYS_ADMIN a filter needs no_new_privs (setuid programs then gain
            // nothing); root's job is left as it was.
            if !root {
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
            }
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &prog as *const libc::sock_fprog,
            );
            Ok(())
        });
    }
}
