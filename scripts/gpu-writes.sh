#!/usr/bin/env bash
# "Every write is seen" on the GPU machine: jobs whose writes are easy to miss, each checkpointed at
# a random step while it runs (--leave-running: it must end bit-identical to a run without possum)
# and its image restored (bit-identical from there on), every save through copy-on-write
# (--shadow-budget 0: no buffer is copied on the GPU first).
#   (here)  bash scripts/gpu-ckpt.sh --stage
#   (there) timeout -k 5 590 bash scripts/gpu-writes.sh [TRIALS] [PARALLEL]      (~9 min)
# Jobs (workloads/gpu/jobs.py): fewbytes (single elements written at fixed offsets of 64 MiB
# buffers, some only on some steps), amp (fp16 with a GradScaler: found_inf written only on
# overflow steps), twodev (one process using two GPUs: peer copies both ways; only where two GPUs
# are visible, kind nvidia-h100-x2 / nvidia-h200-x2). Engines: possum-keeper-noshadow (the
# default hooks) and possum-keeper-spec-noshadow (read-only speculation on, every read-only verdict
# proven over whole buffers). TRIALS (default 60) per engine, the jobs in turn; PARALLEL (default
# 4) trials at a time. Results: $OUT/ckpt-correctness.jsonl, $OUT/correctness.md, $OUT/ckpt-logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
trials="${1:-60}"; par="${2:-4}"
jobs=fewbytes,amp
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then jobs="$jobs,twodev"; else echo "one GPU: twodev left out"; fi
exec bash scripts/gpu-ckpt.sh correctness --jobs "$jobs" \
    --engines possum-keeper-noshadow,possum-keeper-spec-noshadow --trials "$trials,$trials" \
    --parallel "$par" --budget-s "${BUDGET_S:-540}"
