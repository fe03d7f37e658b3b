#!/usr/bin/env bash
# Multi-GPU jobs over NCCL on a two-GPU machine (device kind nvidia-h100-x2 / nvidia-h200-x2):
# workloads/gpu/ddp.py started by torchrun (2 ranks), under `possum run`. Builds nothing: the
# build is staged in .gpu/ (bash scripts/gpu-ckpt.sh --stage here; carry .gpu).
#
#   (there) bash scripts/gpu-nccl.sh probe [STEPS]
#       What the machine and the job are: torch, CUDA and NCCL versions, the GPUs' topology; a
#       reference run; the same job under `possum run` with a step log per rank; each rank's
#       `possum status`, the NCCL kernels its `possum trace` names, its shared-memory mappings and
#       descriptors; then `possum checkpoint TORCHRUN_PID --leave-running --json` under a 120 s
#       limit, and whether the job's logs still equal the reference's.
#   (there) bash scripts/gpu-nccl.sh trials [N] [MODE] [STATE_GIB]
#       N checkpoints (default 3) of the torchrun job (MODE ddp|fsdp, default ddp; STATE_GIB GiB
#       of state per rank written every step, default 1), each at a random step with
#       --leave-running, then the job's logs compared with the reference's, and the image restored
#       (`possum restore`) once the job is over: the restored ranks' logs must equal the
#       reference's from the checkpointed step on. The stall each rank's step log shows and
#       possum's figures are recorded.
# Results: $OUT (or .gpu/out)/nccl-*.json, nccl-logs.tgz. Without two GPUs it says SKIPPED.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: gpu-nccl.sh probe [STEPS] | trials [N] [MODE] [STATE_GIB]}
shift
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then
    echo "SKIPPED: fewer than two GPUs"
    exit 0
fi
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$PATH:/usr/local/cuda/bin"
source scripts/gpu-criu.sh
res="${OUT:-.gpu/out}"; mkdir -p "$res"; res=$(cd "$res" && pwd)
work=/dev/shm/possum-nccl; rm -rf "$work"; mkdir -p "$work"
possum="$PWD/.gpu/possum"
export POSSUM_LIB="$PWD/.gpu/libpossum.so" POSSUM_SOCKET_DIR="$work/sockets"
job=(torchrun --nproc_per_node=2 --master-port 29611 workloads/gpu/ddp.py)

# Waits (at most $2 s) until file $1 has at least $3 lines.
wait_lines() {
    local t=0
    while [ "$(cat "$1" 2>/dev/null | wc -l)" -lt "$3" ]; do
        sleep 0.2; t=$((t + 1))
        [ $t -gt $(($2 * 5)) ] && return 1
    done
}
# The ranks of torchrun $1: its children running ddp.py.
ranks_of() { pgrep -f "workloads/gpu/ddp.py" -P "$1" | sort -n; }

if [ "$mode" = probe ]; then
    steps=${1:-150}
    {
        nvidia-smi -L; nvidia-smi topo -m
        python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
        nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1
    } > "$res/nccl-probe.txt" 2>&1
    t=$(date +%s.%N)
    timeout 300 "${job[@]}" --steps "$steps" --sleep-ms 40 --step-log "$work/ref.log" > "$work/ref.err" 2>&1
    echo "reference rc $? in $(python3 -c "import time;print(round(time.time()-$t,1))") s" >> "$res/nccl-probe.txt"
    POSSUM_VERBOSE=1 timeout 300 "$possum" run -v "${job[@]}" --steps "$steps" --sleep-ms 40 --step-log "$work/p.log" > "$work/p.err" 2>&1 &
    runner=$!
    wait_lines "$work/p.log.rank0" 120 20 || echo "job under possum made no 20 steps" >> "$res/nccl-probe.txt"
    tr=$(pgrep -f "python[0-9.]* [^ ]*torchrun --nproc_per_node=2 --master-port 29611" | head -1)
    echo "torchrun pid $tr, ranks $(ranks_of "$tr" | tr '\n' ' ')" >> "$res/nccl-probe.txt"
    for r in $(ranks_of "$tr"); do
        timeout 20 "$possum" status "$r" --json > "$res/nccl-status-$r.json" 2>&1
        timeout 20 "$possum" trace "$r" > "$work/trace-$r.json" 2>&1
        grep -o '"[^"]*nccl[^"]*"' "$work/trace-$r.json" | sort | uniq -c | sort -rn | head -30 > "$res/nccl-kernels-$r.txt"
        { echo "== maps (shm, nvidia, memfd)"; grep -E "shm|nvidia|memfd|nccl" "/proc/$r/maps" | awk '{print $2, $6}' | sort | uniq -c | head -60
          echo "== fds"; ls -l "/proc/$r/fd" | awk '{print $NF}' | sed 's/[0-9]\+/N/g' | sort | uniq -c
          echo "== threads"; ls "/proc/$r/task" | while read t; do cat "/proc/$r/task/$t/comm"; done | sort | uniq -c
        } > "$res/nccl-proc-$r.txt" 2>&1
    done
    t=$(date +%s.%N)
    timeout -k 5 120 "$possum" checkpoint "$tr" -D "$work/img" --leave-running --json > "$res/nccl-checkpoint.json" 2> "$work/ckpt.err"
    echo "checkpoint rc $? after $(python3 -c "import time;print(round(time.time()-$t,1))") s" >> "$res/nccl-probe.txt"
    tail -20 "$work/ckpt.err" >> "$res/nccl-probe.txt"
    wait $runner; echo "job rc $?" >> "$res/nccl-probe.txt"
    python3 - "$work" >> "$res/nccl-probe.txt" <<'PY'
import json, sys
w = sys.argv[1]
def rows(p):
    try:
        return [{k: v for k, v in json.loads(l).items() if k != "t"} for l in open(p)]
    except OSError:
        return None
for r in (0, 1):
    a, b = rows(f"{w}/ref.log.rank{r}"), rows(f"{w}/p.log.rank{r}")
    print(f"rank {r}: reference {len(a or [])} lines, under possum {len(b or [])}, equal: {a == b}")
PY
    (cd "$work" && tar czf "$res/nccl-logs.tgz" *.err *.log* trace-* 2>/dev/null)
    cat "$res/nccl-probe.txt"
    exit 0
fi
echo "unknown mode $mode"; exit 2
