#!/usr/bin/env bash
# Does the job wait on possum? The checks of a kept checkpoint seen from the job's own step log,
# on one GPU (carry .gpu; each mode is one device call of at most 10 minutes):
#   (here)  bash scripts/gpu-ckpt.sh --stage
#   (there) bash scripts/gpu-never-waits.sh stall        (~4 min)
#       The MLP holding 8, 24 and 40 GiB more state, one 1 GiB tensor of it rewritten each
#       step (40 GiB: more than free GPU memory holds twice), copying a 64 MiB batch from pinned
#       memory every step; `possum checkpoint --leave-running` with the keeper holding its
#       memory, 2 reps a size; each checkpoint's image restored. Per rep: the largest gap in
#       the job's step log, `stall_ms`, the time the job lost in all (every step beyond a normal
#       one until the save ended), its steps' median time during the save against a normal
#       step, the drain's GB/s, restore to the first step and the keeper's load GB/s.
#       -> $OUT/stall/{figures.md,ckpt-figures.jsonl}
#   (there) bash scripts/gpu-never-waits.sh stall-driver (~8 min)
#       The same job under NVIDIA's driver checkpoint (`--engine driver`) at 8 and 24 GiB.
#       -> $OUT/stall-driver/{figures.md,ckpt-figures.jsonl}
#   (there) bash scripts/gpu-never-waits.sh coldstart    (~3 min)
#       Serverless cold start: a job whose every step reads all of 16 GiB of weights
#       (`CKPT_BALLAST_READ_ALL=1`), its fresh start to the first step against its restore from
#       a kept checkpoint's image (memory-backed) to the first step, 2 reps.
#       -> $OUT/coldstart/{figures.md,ckpt-figures.jsonl}
#   (there) bash scripts/gpu-never-waits.sh ab           (~7 min)
#       Steady-state cost by in-process A/B: GPT-2 small, a CUDA-graph job and a torch.compile
#       reduce-overhead job (scripts/gpu-overhead.sh with AB=1 AB_SHORT=1).
#       -> $OUT/ab/overhead-ab-{mlp,gpt2,graph,compiled}.json
# Images go to a huge-page tmpfs (POSSUM_CKPT_HUGE=1); the keeper loads a restore with 16
# threads. Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "SKIPPED: no GPU (nvidia-smi -L failed)"
    exit 0
fi
mode=${1:?usage: gpu-never-waits.sh stall | stall-driver | coldstart | ab}
out="${OUT:-.gpu/out}"
export POSSUM_CKPT_HUGE=1 POSSUM_KEEPER_STAGE_THREADS=16
figures() {
    local dir="$out/$1" limit=$2; shift 2
    mkdir -p "$dir"
    OUT="$dir" timeout -k 5 "$limit" bash scripts/gpu-ckpt.sh figures "$@" > "$dir/run.log" 2>&1
    local rc=$?
    rm -f "$dir/ckpt-logs.tgz" "$dir/figures.json"
    grep -h "^| mlp" "$dir/figures.md" 2>/dev/null
    return $rc
}
case "$mode" in
    stall)
        CKPT_HOST_BATCH_MIB=64 figures stall 560 --engines possum-keeper --bench-plan mlp:8,24,40 \
            --reps 2 --budget-s 520 ;;
    stall-driver)
        CKPT_HOST_BATCH_MIB=64 figures stall-driver 580 --engines driver --bench-plan mlp:8,24 \
            --reps 1 --budget-s 540 ;;
    coldstart)
        CKPT_BALLAST_READ_ALL=1 figures coldstart 560 --engines possum-keeper-frozen \
            --bench-plan mlp:16 --reps 2 --budget-s 500 ;;
    ab)
        mkdir -p "$out/ab"
        OUT="$out/ab" AB=1 AB_SHORT=1 AB_MLP_PROCS=1 AB_MLP_BUDGET=30 AB_GPT2_PROCS=4 AB_GPT2_BUDGET=180 \
            AB_SHORT_BUDGET=80 timeout -k 5 580 bash scripts/gpu-overhead.sh > "$out/ab/run.log" 2>&1
        rc=$?
        rm -f "$out/ab/overhead-logs.tgz"
        grep "A/B:" "$out/ab/run.log"
        exit $rc ;;
    *)
        echo "unknown mode $mode (stall | stall-driver | coldstart | ab)" >&2
        exit 2 ;;
esac
