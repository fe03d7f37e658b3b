#!/usr/bin/env bash
# How fast this machine writes into a memory-backed directory (/dev/shm), the ceiling of a drain
# there (the drain's D2H copy runs at 55 GB/s pinned; the writes follow it):
# N threads each pwrite 64 MiB blocks into a file of its own, 16 GiB in all, fresh files (tmpfs
# pages allocated as they are written) and the same files again (pages already there).
# With --huge, the same into a tmpfs mounted with huge=always (2 MiB pages: a page allocated and
# zeroed per 2 MiB, not per 4 KiB) at /tmp/possum-huge-tmpfs, appended to the same file.
# Writes $OUT/tmpfs-write.txt (or .gpu/out/). Runs anywhere (no GPU needed).
set -uo pipefail
res="${OUT:-.gpu/out}"; mkdir -p "$res"
dir=/dev/shm; mode=w
if [ "${1:-}" = "--huge" ]; then
    source "$(dirname "$0")/../../scripts/huge-tmpfs.sh"
    dir=/tmp/possum-huge-tmpfs; mode=a; mount_huge "$dir" 40g || exit 1
    echo "shmem_enabled: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>&1)" >> "$res/tmpfs-write.txt"
fi
python3 - "$res/tmpfs-write.txt" "$dir" "$mode" <<'PY'
import os, sys, threading, time
out = open(sys.argv[1], sys.argv[3])
d = sys.argv[2]
def say(s):
    print(s, flush=True); out.write(s + "\n"); out.flush()
say(f"cores {os.cpu_count()}; {d}: {os.statvfs(d).f_bavail * os.statvfs(d).f_frsize / 2**30:.0f} GiB free")
block = os.urandom(1 << 20) * 64
total = 16 << 30
for threads in (1, 4, 8, 12, 16) if d == '/dev/shm' else (1, 8, 16):
    per = total // threads
    paths = [f"{d}/possum-tmpfs-{i}" for i in range(threads)]
    def run(path, fresh):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if fresh else 0), 0o600)
        off = 0
        while off < per:
            off += os.pwrite(fd, block, off)
        os.close(fd)
    for fresh in (True, False):
        ts = [threading.Thread(target=run, args=(p, fresh)) for p in paths]
        t = time.perf_counter()
        for x in ts: x.start()
        for x in ts: x.join()
        dt = time.perf_counter() - t
        say(f"{threads:2d} threads, {'fresh files' if fresh else 'rewrite   '}: {total / dt / 1e9:5.1f} GB/s")
    for p in paths:
        os.remove(p)
PY
[ "$dir" = /dev/shm ] || umount "$dir"
