#!/usr/bin/env bash
# Can the drain DMA straight into its image file (target: 40 GB/s into a memory-backed
# directory)? Today a chunk crosses host memory three times (the D2H copy into pinned staging,
# the CRC's read, the write's copy into the file's pages) and the drain reached 24 GB/s into a
# huge-page tmpfs whose own write ceiling is 42.6 GB/s. Here a 4 GiB file in such a tmpfs is
# mapped (MAP_SHARED), registered with CUDA (cudaHostRegister) and copied into from the GPU
# directly: registration time (fresh file, and after fallocate), D2H GB/s into it, against D2H into
# cudaHostAlloc'd memory; and the same with 4 threads each registering and filling 1 GiB of it.
# Writes $OUT/probe-filedma.txt (or .gpu/out/). Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
source "$(dirname "$0")/probe.sh"
gpu_probe
dir=/tmp/possum-huge-tmpfs
huge_tmpfs "$dir" 40g
python3 - "$res/probe-filedma.txt" "$dir" <<'PY'
import ctypes, mmap, os, sys, threading, time
import torch
out = open(sys.argv[1], "w"); d = sys.argv[2]
def say(s):
    print(s, flush=True); out.write(s + "\n"); out.flush()
cudart = torch.cuda.cudart()
G = 1 << 30
size = 4 * G
g = torch.empty(size, dtype=torch.uint8, device="cuda").fill_(7)
def d2h(host, n=3, label=""):
    r = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter()
        host.copy_(g[: host.numel()], non_blocking=True); torch.cuda.synchronize()
        r.append(host.numel() / (time.perf_counter() - t) / 1e9)
    say(f"{label}: D2H {', '.join(f'{x:.1f}' for x in r)} GB/s")
pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
d2h(pinned, label="cudaHostAlloc 4 GiB")
del pinned
for prealloc in (False, True):
    path = f"{d}/img-{int(prealloc)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    t = time.perf_counter()
    if prealloc:
        os.posix_fallocate(fd, 0, size)
    else:
        os.ftruncate(fd, size)
    t_alloc = time.perf_counter() - t
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    buf = (ctypes.c_char * size).from_buffer(mm); ptr = ctypes.addressof(buf)
    t = time.perf_counter(); rc = cudart.cudaHostRegister(ptr, size, 0); t_reg = time.perf_counter() - t
    say(f"file {'fallocated' if prealloc else 'fresh'}: size set {t_alloc*1e3:.0f} ms, cudaHostRegister rc {rc} {t_reg*1e3:.0f} ms ({size / t_reg / 1e9:.1f} GB/s), aligned 2M: {ptr % (2<<20) == 0}")
    if int(rc) == 0:
        host = torch.frombuffer(buf, dtype=torch.uint8)
        say(f"  is_pinned {host.is_pinned()}")
        d2h(host, label="  into the file's pages")
        ok = bool((host[:: 1 << 20] == 7).all())
        os.lseek(fd, 123 << 20, 0); byte = os.read(fd, 1)
        say(f"  data there (read back through the file): {ok}, {byte!r}")
        t = time.perf_counter(); cudart.cudaHostUnregister(ptr); say(f"  unregister {1e3*(time.perf_counter()-t):.0f} ms")
        del host
    del buf; mm.close(); os.close(fd); os.remove(path)
    smaps = open("/proc/meminfo").read()
    say("  " + " ".join(l for l in smaps.splitlines() if l.startswith(("ShmemHugePages", "FileHugePages"))))
# Four threads, each its own 1 GiB file: register, copy on its own stream, unregister.
def worker(i, res):
    path = f"{d}/img-t{i}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600); os.ftruncate(fd, G)
    mm = mmap.mmap(fd, G, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    buf = (ctypes.c_char * G).from_buffer(mm); ptr = ctypes.addressof(buf)
    t0 = time.perf_counter(); cudart.cudaHostRegister(ptr, G, 0); t1 = time.perf_counter()
    host = torch.frombuffer(buf, dtype=torch.uint8); s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        host.copy_(g[i * G:(i + 1) * G], non_blocking=True)
    s.synchronize(); t2 = time.perf_counter()
    cudart.cudaHostUnregister(ptr); del host; del buf; mm.close(); os.close(fd); os.remove(path)
    res[i] = (t1 - t0, t2 - t1)
for n in (4, 8):
    res = {}
    ths = [threading.Thread(target=worker, args=(i % 4, res)) for i in range(n)] if n == 4 else None
    if n == 8:
        break
    t = time.perf_counter()
    for x in ths: x.start()
    for x in ths: x.join()
    dt = time.perf_counter() - t
    say(f"{n} threads x 1 GiB fresh files: {n * G / dt / 1e9:.1f} GB/s end to end (register + copy + unregister); per thread register/copy ms: " + ", ".join(f"{a*1e3:.0f}/{b*1e3:.0f}" for a, b in res.values()))
PY
umount "$dir" 2>/dev/null || true
