#!/usr/bin/env bash
# What session 21 built and could not run on the GPU (its device time was spent), in one device
# call of about 8 minutes (carry .gpu, staged by `bash scripts/gpu-ckpt.sh --stage`):
#   1. torch's expandable segments and cudaMallocAsync served by possum (POSSUM_SERVE_VMM=1,
#      POSSUM_SERVE_POOLS=1, both off by default): correctness of mlp/gpt2 +vmm and +pools, kept
#      (--leave-running, the image restored too) and killed-and-restored from the keeper, against
#      gpt2 with the driver copying that memory (+expandable, +async): the stall of each is in
#      the rows;
#   2. a job whose stdout is a pipe to the launching script, checkpointed, killed and restored
#      with the restore's stdout a file: its restored self must keep writing there
#      (`stdio_from_restore`).
# Writes $OUT/next-*.{jsonl,md,txt} (or .gpu/out/). Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L >/dev/null 2>&1 || { echo "SKIPPED: no GPU (nvidia-smi -L failed)"; exit 0; }
res="${OUT:-.gpu/out}"; mkdir -p "$res"
OUT="$res/vmm" timeout -k 5 420 bash scripts/gpu-ckpt.sh correctness --engines possum-keeper,possum-keeper-kill \
    --jobs mlp+vmm,gpt2+vmm,mlp+pools,gpt2+pools,gpt2+expandable,gpt2+async --trials 6,4 --budget-s 400 \
    > "$res/next-vmm.log" 2>&1
for f in ckpt-correctness.jsonl correctness.md; do cp "$res/vmm/$f" "$res/next-vmm-$f" 2>/dev/null; done
rm -rf "$res/vmm"
source scripts/gpu-criu.sh
W=/dev/shm/possum-next-pipe; rm -rf "$W"; mkdir -p "$W/sockets"
{
    echo "checkpoint of a job writing to a pipe, then its restore (the pipe now the restore's stdout)"
    POSSUM_SOCKET_DIR="$W/sockets" LD_PRELOAD="$PWD/.gpu/libpossum.so" setsid \
        python3 workloads/gpu/jobs.py mlp --steps 100000 --hold-gib 1 --sleep-ms 5 --log "$W/job.log" 2> "$W/job.err" \
        | cat > "$W/before.out" &
    sleep 1; pid=$(pgrep -f "jobs.py mlp --steps 100000" | head -1)
    for _ in $(seq 300); do [ -s "$W/job.log" ] && break; sleep 0.1; done
    timeout 120 .gpu/possum checkpoint "$pid" -D "$W/img" --json --socket-dir "$W/sockets" > "$W/ck.json" 2> "$W/ck.err"
    echo "checkpoint rc $? ($(head -c 300 "$W/ck.err"))"
    wait 2>/dev/null
    # The restore's stdout a file (a pipe would give the job /dev/null instead).
    timeout 120 .gpu/possum restore -D "$W/img" --json 2> "$W/restore.err" > "$W/after.out" &
    sleep 20
    echo "restore JSON: $(head -c 400 "$W/after.out")"
    echo "lines the restored job wrote into the restore's stdout: $(($(wc -l < "$W/after.out") - 1))"
    echo "job.log lines: $(wc -l < "$W/job.log")"
    pkill -9 -f "jobs.py mlp --steps 100000"
} > "$res/next-pipe.txt" 2>&1
cat "$res/next-pipe.txt"; grep -h "trials identical" "$res/next-vmm.log"
