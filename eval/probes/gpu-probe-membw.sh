#!/usr/bin/env bash
# The host's memory bandwidth on the GPU machine (a drain into tmpfs moves
# each byte through host memory several times: the copy engine's write into pinned staging, the
# CRC's read, the write's copy into the file's pages, their zeroing). torch CPU tensors of 4 GiB
# on every core: write (fill), read (sum), copy (read + write), 3 repetitions each.
# Writes $OUT/probe-membw.txt (or .gpu/out/). Runs anywhere torch does.
set -uo pipefail
res="${OUT:-.gpu/out}"; mkdir -p "$res"
python3 - "$res/probe-membw.txt" <<'PY'
import os, sys, time
import torch
out = open(sys.argv[1], "w")
def say(s):
    print(s, flush=True); out.write(s + "\n"); out.flush()
torch.set_num_threads(os.cpu_count())
n = 4 << 30
a = torch.empty(n, dtype=torch.uint8); b = torch.empty(n, dtype=torch.uint8)
a.fill_(1); b.fill_(2)
def bw(label, f, moved):
    r = []
    for _ in range(3):
        t = time.perf_counter(); f(); r.append(moved / (time.perf_counter() - t) / 1e9)
    say(f"{label}: {', '.join(f'{x:.1f}' for x in r)} GB/s of memory traffic")
say(f"{os.cpu_count()} threads, 4 GiB tensors")
bw("write (fill)", lambda: a.fill_(3), n)
a64 = a.view(torch.int64)
bw("read (sum)", lambda: a64.sum(), n)
bw("copy (read + write)", lambda: b.copy_(a), 2 * n)
PY
