#!/usr/bin/env bash
# What CRIU dumps of a possum job (the stall's CRIU share, and the restore's, are the
# process's host memory, 1.35 GB for the MLP whatever its GPU state): the MLP holding 1 GiB under
# libpossum.so with a keeper, its full smaps and GPU memory (nvidia-smi) before a kept checkpoint,
# the same for the MLP without possum, then `possum checkpoint --leave-running` keeping CRIU's
# small images (mm, pagemap, pstree, files, core) and dump log, so the dumped pages can be named
# VMA by VMA here (crit). One archive: $OUT/diag-memory.tgz (or .gpu/out/).
# From the build in .gpu/ (gpu-ckpt.sh --stage). Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi -L >/dev/null 2>&1 || { echo "SKIPPED: no GPU (nvidia-smi -L failed)"; exit 0; }
source scripts/gpu-criu.sh
res="${OUT:-.gpu/out}/diag-memory"; mkdir -p "$res"
W=/dev/shm/possum-diag-memory; rm -rf "$W"; mkdir -p "$W/sockets"
gpu_mem() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';'; }
wait_steps() { for _ in $(seq 900); do [ "$(wc -l < "$1" 2>/dev/null || echo 0)" -ge 100 ] && break; sleep 0.1; done; }
# The job without possum, for comparison.
python3 workloads/gpu/jobs.py mlp --steps 1000000 --hold-gib 1 --sleep-ms 1 --log "$W/plain.log" > /dev/null 2> "$W/plain.err" &
plain=$!
wait_steps "$W/plain.log"
cat "/proc/$plain/smaps" > "$res/plain-smaps.txt"; echo "plain $plain: $(gpu_mem)" > "$res/gpu-mem.txt"
kill -9 "$plain"; wait "$plain" 2>/dev/null
.gpu/possum keeper --dir "$W/keeper" > "$W/keeper.out" 2> "$W/keeper.err" &
keeper=$!
for _ in $(seq 100); do grep -q ready "$W/keeper.out" 2>/dev/null && break; sleep 0.1; done
POSSUM_KEEPER="$W/keeper" POSSUM_SOCKET_DIR="$W/sockets" LD_PRELOAD="$PWD/.gpu/libpossum.so" setsid \
    python3 workloads/gpu/jobs.py mlp --steps 1000000 --hold-gib 1 --sleep-ms 1 --log "$W/job.log" > /dev/null 2> "$W/job.err" &
pid=$!
wait_steps "$W/job.log"
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
