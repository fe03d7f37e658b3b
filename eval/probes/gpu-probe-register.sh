#!/usr/bin/env bash
# Target: a drain of 40 GB/s into a memory-backed directory. The drain through write()
# is bound by host memory (each byte: the copy engine's write into pinned staging, the checksum's
# read, the write's copy into the file's pages), 26-30 GB/s on the H100. DMA straight into the
# file's pages runs at 55 GB/s, but registering them with CUDA cost 0.8-1.0 s per 4 GiB on a
# huge-page tmpfs (gpu-probe-filedma.sh). This probe asks whether the page size is what registration pays
# for: cudaHostRegister of 4 GiB of
#   - a huge=always tmpfs file, pre-faulted (MADV_POPULATE_WRITE), its huge pages counted;
#   - a hugetlbfs file (2 MiB pages, the pool set here);
#   - anonymous memory with MAP_HUGETLB, and plain anonymous memory (4 KiB pages), pre-faulted;
# each with the time to fault it in, to register, D2H GB/s into it, and to unregister.
# Writes $OUT/probe-register.txt (or .gpu/out/). Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
source "$(dirname "$0")/probe.sh"
gpu_probe
huge=/tmp/possum-huge-tmpfs
huge_tmpfs "$huge" 20g
tlb=/tmp/possum-hugetlbfs; mkdir -p "$tlb"
echo 2600 > /proc/sys/vm/nr_hugepages
grep -E "HugePages_(Total|Free)|Hugepagesize" /proc/meminfo
mountpoint -q "$tlb" || mount -t hugetlbfs -o pagesize=2M none "$tlb" || echo "no hugetlbfs mount"
python3 - "$res/probe-register.txt" "$huge" "$tlb" <<'PY'
import ctypes, mmap, os, sys, time
import torch
sys.path.insert(0, "eval/probes")
from probe_host import G, MADV_POPULATE_WRITE, MAP_HUGETLB, MAP_FAILED, PROT_RW as PROT, libc, reporter
say = reporter(sys.argv[1])
cudart = torch.cuda.cudart()
size = 4 * G
g = torch.empty(size, dtype=torch.uint8, device="cuda").fill_(7)
torch.cuda.synchronize()
def meminfo(keys):
    m = dict(l.split(":", 1) for l in open("/proc/meminfo"))
    return " ".join(f"{k} {m[k].strip()}" for k in keys if k in m)
def probe(label, ptr):
    t = time.perf_counter(); r = libc.madvise(ptr, size, MADV_POPULATE_WRITE); t_fault = time.perf_counter() - t
    pages = meminfo(["ShmemHugePages", "ShmemPmdMapped", "AnonHugePages", "HugePages_Free"])
    t = time.perf_counter(); rc = cudart.cudaHostRegister(ptr, size, 0); t_reg = time.perf_counter() - t
    line = (f"{label}: fault-in {t_fault*1e3:.0f} ms (madvise rc {r}); {pages}; cudaHostRegister {int(rc)} "
            f"{t_reg*1e3:.0f} ms ({size / t_reg / 1e9:.1f} GB/s)")
    if int(rc) == 0:
        buf = (ctypes.c_char * size).from_address(ptr)
        host = torch.frombuffer(buf, dtype=torch.uint8)
        bw = []
        for _ in range(3):
            torch.cuda.synchronize(); t = time.perf_counter()
            host.copy_(g, non_blocking=True); torch.cuda.synchronize()
            bw.append(size / (time.perf_counter() - t) / 1e9)
        ok = bool((host[:: 1 << 20] == 7).all())
        t = time.perf_counter(); cudart.cudaHostUnregister(ptr); t_un = time.perf_counter() - t
        line += f"; D2H {', '.join(f'{x:.1f}' for x in bw)} GB/s, data {ok}; unregister {t_un*1e3:.0f} ms"
        del host, buf
    say(line)
def file_map(path, prealloc=True):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    if prealloc:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.ftruncate(fd, size)
    else:
        os.ftruncate(fd, size)
    p = libc.mmap(None, size, PROT, mmap.MAP_SHARED, fd, 0)
    return fd, p
t = time.perf_counter(); pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
say(f"cudaHostAlloc 4 GiB: {1e3*(time.perf_counter()-t):.0f} ms"); del pinned
for label, path in (("huge=always tmpfs file", f"{sys.argv[2]}/reg"), ("hugetlbfs file", f"{sys.argv[3]}/reg")):
    try:
        fd, p = file_map(path, prealloc=not path.startswith(sys.argv[3]))
    except OSError as e:
        say(f"{label}: {e}"); continue
    if p in (None, MAP_FAILED):
        say(f"{label}: mmap failed errno {ctypes.get_errno()}"); os.close(fd); continue
    say(f"{label}: aligned 2M {p % (2 << 20) == 0}")
    probe(label, p)
    libc.munmap(p, size); os.close(fd); os.remove(path)
for label, flags in (("anonymous MAP_HUGETLB", mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB),
                     ("anonymous 4 KiB", mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)):
    p = libc.mmap(None, size, PROT, flags, -1, 0)
    if p in (None, MAP_FAILED):
        say(f"{label}: mmap failed errno {ctypes.get_errno()}"); continue
    probe(label, p)
    libc.munmap(p, size)
PY
umount "$huge" "$tlb" 2>/dev/null || true
echo 0 > /proc/sys/vm/nr_hugepages
