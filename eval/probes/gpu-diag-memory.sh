#!/usr/bin/env bash
# What CRIU dumps of a possum job (the stall's CRIU share, and the restore's, are the
# process's host memory, 1.35 GB for the MLP whatever its GPU state): the MLP holding 1 GiB under
# libpossum.so with a keeper, its full smaps and GPU memory (nvidia-smi) before a kept checkpoint,
# the same for the MLP without possum, then `possum checkpoint --leave-running` keeping CRIU's
# small images (mm, pagemap, pstree, files, core) and dump log, so the dumped pages can be named
# VMA by VMA here (crit). One archive: $OUT/diag-memory.tgz (or .gpu/out/).
# From the build in .gpu/ (gpu-ckpt.sh --stage). Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
source "$(dirname "$0")/probe.sh"
gpu_probe diag-memory
source scripts/gpu-criu.sh
W=/dev/shm/possum-diag-memory; rm -rf "$W"; mkdir -p "$W/sockets"
gpu_mem() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';'; }
# The job without possum, for comparison.
python3 workloads/gpu/jobs.py mlp --steps 1000000 --hold-gib 1 --sleep-ms 1 --log "$W/plain.log" > /dev/null 2> "$W/plain.err" &
plain=$!
wait_steps "$W/plain.log"
cat "/proc/$plain/smaps" > "$res/plain-smaps.txt"; echo "plain $plain: $(gpu_mem)" > "$res/gpu-mem.txt"
kill -9 "$plain"; wait "$plain" 2>/dev/null
keeper_in "$W"
mlp_with_keeper "$W" 1
cat "/proc/$pid/smaps" > "$res/possum-smaps.txt"; echo "possum $pid: $(gpu_mem)" >> "$res/gpu-mem.txt"
.gpu/possum status "$pid" --socket-dir "$W/sockets" > "$res/status.txt" 2>&1
timeout -k 5 120 .gpu/possum checkpoint "$pid" -D "$W/img" --leave-running --json --socket-dir "$W/sockets" \
    > "$res/checkpoint.json" 2> "$res/checkpoint.err"
cat "/proc/$pid/smaps" > "$res/possum-smaps-after.txt"; echo "possum after: $(gpu_mem)" >> "$res/gpu-mem.txt"
mkdir -p "$res/criu"
ls -la "$W/img/criu" > "$res/criu/ls.txt"
for f in "$W"/img/criu/*; do
    case "$(basename "$f")" in pages-*) ;; *) [ "$(stat -c %s "$f")" -lt 20000000 ] && cp "$f" "$res/criu/";; esac
done
kill -9 "$pid" 2>/dev/null; kill "$keeper" 2>/dev/null; wait 2>/dev/null
cat "$res/gpu-mem.txt"; grep -E "^(Rss|Anonymous|Private_Dirty|Shmem)" "$res/possum-smaps.txt" | awk '{s[$1]+=$2} END {for (k in s) print k, s[k]}'
(cd "$res/.." && tar czf diag-memory.tgz diag-memory && rm -rf diag-memory)
