#!/usr/bin/env bash
# Target: a drain of 40 GB/s into a memory-backed directory: can the drain DMA straight
# into the image file's pages, all of it after T0, and beat the write() path (26-30 GB/s)?
# gpu-probe-register.sh measured the parts one at a time and single-threaded (4 GiB on a huge=always
# tmpfs: fault-in 709 ms, cudaHostRegister 165 ms, D2H 55 GB/s). Here the whole pipeline runs as
# a drain would, DRAIN GiB (default 32) from one device tensor into one fresh file on a huge=always
# tmpfs, by T threads each taking chunks of C MiB in turn:
#   fault the chunk in (MADV_POPULATE_WRITE: the kernel zeroes its pages), cudaHostRegister it,
#   cudaMemcpyAsync D2H on the thread's own stream, synchronize, checksum it (zlib.crc32, a read
#   pass; the engine's CRC32C is faster per core), cudaHostUnregister it;
# the time from the first fault to the last checksum is the drain; the file is checked against
# the tensor after. Also the same with the file's pages already there (a recycled image file),
# and plain multi-threaded pwrite from pinned staging for comparison.
# With `ahead` (PROBE_MODE=ahead): the file's pages faulted in and registered once, before the
# clock starts (what spare image memory registered ahead of the checkpoint, outside the
# checkpointed process, would give), then only D2H + CRC32C per chunk (the `crc32c` wheel, SSE4.2,
# from .gpu/wheels when carried; zlib's CRC otherwise), and each half alone.
# Writes $OUT/probe-inplace.txt (or .gpu/out/). Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
source "$(dirname "$0")/probe.sh"
gpu_probe
huge=/tmp/possum-huge-tmpfs
huge_tmpfs "$huge" 70g
wheels=$(mktemp -d); for w in .gpu/wheels/*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" "$wheels"; done
PYTHONPATH="$wheels" python3 - "$res/probe-inplace.txt" "$huge" "${DRAIN:-32}" "${1:-${PROBE_MODE:-fresh}}" <<'PY'
import ctypes, mmap, os, sys, threading, time, zlib
import torch
sys.path.insert(0, "eval/probes")
from probe_host import G, M, MADV_POPULATE_WRITE, PROT_RW, libc, reporter
say = reporter(sys.argv[1], "a")
cudart = torch.cuda.cudart()
size = int(sys.argv[3]) * G
g = torch.empty(size, dtype=torch.uint8, device="cuda")
for o in range(0, size, G):
    g[o:o + G].view(torch.int64).copy_(torch.arange(o // 8, (o + G) // 8, device="cuda", dtype=torch.int64) * 2654435761)
torch.cuda.synchronize()
say(f"cores {os.cpu_count()}; {size // G} GiB; {sys.argv[2]} huge=always tmpfs")
path = f"{sys.argv[2]}/img"

def in_threads(threads, n, work, init=lambda: None):
    """Chunks 0..n taken in turn by `threads` threads, each with a stream of its own and what
    `init` makes: work(i, stream, state) per chunk (False ends the thread); the wall seconds."""
    nxt = [0]; lock = threading.Lock()
    def worker():
        s, state = torch.cuda.Stream(), init()
        while True:
            with lock:
                i = nxt[0]; nxt[0] += 1
            if i >= n or work(i, s, state) is False:
                return
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    t = time.perf_counter()
    for x in ts: x.start()
    for x in ts: x.join()
    return time.perf_counter() - t

def in_place(threads, chunk, crc, fresh, register=True):
    if fresh and os.path.exists(path):
        os.remove(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    base = libc.mmap(None, size, PROT_RW, mmap.MAP_SHARED, fd, 0)
    lock = threading.Lock(); parts = {"fault": 0.0, "reg": 0.0, "dma": 0.0, "crc": 0.0, "unreg": 0.0}
    errs = []
    def work(i, s, _):
        p = base + i * chunk
        t0 = time.perf_counter()
        if libc.madvise(p, chunk, MADV_POPULATE_WRITE) != 0:
            errs.append(f"madvise errno {ctypes.get_errno()}"); return False
        t1 = time.perf_counter()
        rc = int(cudart.cudaHostRegister(p, chunk, 0)) if register else 0
        if rc:
            errs.append(f"register rc {rc}"); return False
        t2 = time.perf_counter()
        host = torch.frombuffer((ctypes.c_char * chunk).from_address(p), dtype=torch.uint8)
        with torch.cuda.stream(s):
            host.copy_(g[i * chunk:(i + 1) * chunk], non_blocking=register)
        s.synchronize()
        t3 = time.perf_counter()
        if crc:
            zlib.crc32(memoryview((ctypes.c_char * chunk).from_address(p)))
        t4 = time.perf_counter()
        if register:
            cudart.cudaHostUnregister(p)
        t5 = time.perf_counter()
        with lock:
            for k, d in (("fault", t1 - t0), ("reg", t2 - t1), ("dma", t3 - t2), ("crc", t4 - t3), ("unreg", t5 - t4)):
                parts[k] += d
    dt = in_threads(threads, size // chunk, work)
    host = torch.frombuffer((ctypes.c_char * size).from_address(base), dtype=torch.uint8)
    ok = not errs and bool(torch.equal(host[:: 4096].cuda(), g[:: 4096]))
    del host
    libc.munmap(base, size); os.close(fd)
    share = ", ".join(f"{k} {v / threads * 1e3:.0f}" for k, v in parts.items())
    say(f"in place{'' if register else ' (no register, pageable copy)'}, {'fresh file' if fresh else 'pages there'}, "
        f"{threads} threads, {chunk // M} MiB chunks, crc {crc}: {dt * 1e3:.0f} ms, {size / dt / 1e9:.1f} GB/s, "
        f"data {ok} {errs[:1]}; per thread ms: {share}")

def via_staging(threads, chunk):
    if os.path.exists(path):
        os.remove(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    def init():
        st = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
        return st, memoryview(st.numpy())
    def work(i, s, state):
        st, mv = state
        with torch.cuda.stream(s):
            st.copy_(g[i * chunk:(i + 1) * chunk], non_blocking=True)
        s.synchronize()
        zlib.crc32(mv)
        os.pwrite(fd, mv, i * chunk)
    dt = in_threads(threads, size // chunk, work, init)
    os.close(fd)
    say(f"staging + pwrite, fresh file, {threads} threads, {chunk // M} MiB chunks, crc True: "
        f"{dt * 1e3:.0f} ms, {size / dt / 1e9:.1f} GB/s")

def ahead():
    """Registered before the clock: D2H + CRC only, per chunk, from `threads` threads."""
    try:
        import crc32c
        crc = lambda mv: crc32c.crc32c(mv, gil_release_mode=1)
        kind = "crc32c (SSE4.2)"
    except ImportError:
        crc, kind = zlib.crc32, "zlib crc32"
    if os.path.exists(path):
        os.remove(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    base = libc.mmap(None, size, PROT_RW, mmap.MAP_SHARED, fd, 0)
    t = time.perf_counter()
    libc.madvise(base, size, MADV_POPULATE_WRITE)
    t_fault = time.perf_counter() - t
    t = time.perf_counter()
    rc = int(cudart.cudaHostRegister(base, size, 0))
    say(f"ahead: {size // G} GiB file faulted in {t_fault * 1e3:.0f} ms, registered in "
        f"{(time.perf_counter() - t) * 1e3:.0f} ms (rc {rc}), before the clock; checksum {kind}")
    def run(threads, chunk, dma, check):
        def work(i, s, _):
            p = base + i * chunk
            if dma:
                host = torch.frombuffer((ctypes.c_char * chunk).from_address(p), dtype=torch.uint8)
                with torch.cuda.stream(s):
                    host.copy_(g[i * chunk:(i + 1) * chunk], non_blocking=True)
                s.synchronize()
            if check:
                crc(memoryview((ctypes.c_char * chunk).from_address(p)))
        dt = in_threads(threads, size // chunk, work)
        say(f"ahead, {threads} threads, {chunk // M} MiB chunks, {'D2H' if dma else ''}"
            f"{' + ' if dma and check else ''}{'CRC' if check else ''}: {dt * 1e3:.0f} ms, {size / dt / 1e9:.1f} GB/s")
    for threads, chunk in ((8, 64 * M), (16, 64 * M), (16, 256 * M), (24, 64 * M)):
        run(threads, chunk, True, True)
    run(16, 64 * M, True, False)
    run(16, 64 * M, False, True)
    run(16, 64 * M, True, True)
    host = torch.frombuffer((ctypes.c_char * size).from_address(base), dtype=torch.uint8)
    say(f"ahead: data {bool(torch.equal(host[:: 4096].cuda(), g[:: 4096]))}")
    del host
    cudart.cudaHostUnregister(base)
    libc.munmap(base, size); os.close(fd); os.remove(path)

if sys.argv[4] == "ahead":
    ahead()
    sys.exit(0)
via_staging(16, 64 * M)
for threads, chunk in ((16, 64 * M), (16, 256 * M), (24, 64 * M), (8, 256 * M)):
    in_place(threads, chunk, True, True)
in_place(16, 64 * M, False, True)
in_place(16, 64 * M, True, False)
in_place(16, 256 * M, True, False)
in_place(16, 64 * M, True, True, register=False)
os.remove(path)
PY
umount "$huge" 2>/dev/null || true; rm -rf "$wheels"
