#!/usr/bin/env bash
# Issue 14 item 4 on the H100: the keeper loads a job's image into GPU memory while CRIU restores
# the process (`possum restore`'s staging), and the restored job maps that memory and waits only
# for buffers still loading. Two device calls of at most 10 minutes (carry .gpu, staged by
# `bash scripts/gpu-ckpt.sh --stage`):
#   bash scripts/gpu-stage.sh figures       (~9 min)
#       The MLP holding 1, 8 and 32 GiB of extra state written every step, checkpointed and
#       killed with --keep-on-gpu 0 (the keeper keeps nothing: the restore reads the image), then
#       restored: with the keeper's staging (possum-keeper-kill-disk, the default) and without it
#       (-nostage: POSSUM_RESTORE_STAGE=0, the restored job copies from the image itself); images
#       on a huge-page tmpfs. Restore to the first step, every buffer back, restore parts.
#       -> $OUT/stage-figures.{json,md}, stage-figures.jsonl
#       (STAGE_ENGINES, STAGE_PLAN, STAGE_REPS change the engines, cells and reps.)
#   bash scripts/gpu-stage.sh correctness   (~6 min)
#       Checkpointed-and-killed trials restored through the staging, at random steps, over
#       mlp, gpt2, cnn, triton, graph, multistream and the two served allocators: bit-exact from
#       the restore on.
#       -> $OUT/stage-correctness.{jsonl,md}
#   bash scripts/gpu-stage.sh ab-gpt2       (~9 min)
#       GPT-2 small's in-process A/B (issue 13's overhead), up to 12 processes in the budget.
#       -> $OUT/overhead-ab-gpt2.json, ab-gpt2.log
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L >/dev/null 2>&1 || { echo "SKIPPED: no GPU (nvidia-smi -L failed)"; exit 0; }
res="${OUT:-.gpu/out}"; mkdir -p "$res"; res=$(cd "$res" && pwd)
case "${1:-}" in
figures)
    POSSUM_CKPT_HUGE=1 POSSUM_WRITERS=16 POSSUM_STAGING_MIB=1024 CKPT_TIMEOUT=200 OUT="$res/f" \
        timeout -k 5 570 bash scripts/gpu-ckpt.sh figures \
        --engines "${STAGE_ENGINES:-possum-keeper-kill-disk,possum-keeper-kill-disk-nostage}" \
        --bench-plan "${STAGE_PLAN:-mlp:1,8,32}" --reps "${STAGE_REPS:-1}" --budget-s 520 \
        > "$res/stage-figures.log" 2>&1
    cp "$res/f/figures.json" "$res/stage-figures.json" 2>/dev/null
    cp "$res/f/figures.md" "$res/stage-figures.md" 2>/dev/null
    cp "$res/f/ckpt-figures.jsonl" "$res/stage-figures.jsonl" 2>/dev/null
    rm -rf "$res/f"
    cat "$res/stage-figures.md" 2>/dev/null || tail -20 "$res/stage-figures.log"
    ;;
correctness)
    CKPT_TIMEOUT=120 OUT="$res/c" timeout -k 5 ${STAGE_TIMEOUT_S:-400} bash scripts/gpu-ckpt.sh correctness \
        --engines possum-keeper-kill-disk --trials 9 --seed 23 --budget-s ${STAGE_BUDGET_S:-340} \
        --jobs mlp,gpt2+async,cnn,triton,gpt2,graph,multistream,mlp+expandable,gpt2+expandable \
        > "$res/stage-correctness.log" 2>&1
    cp "$res/c/ckpt-correctness.jsonl" "$res/stage-correctness.jsonl" 2>/dev/null
    cp "$res/c/correctness.md" "$res/stage-correctness.md" 2>/dev/null
    rm -rf "$res/c"
    grep -h "trials identical" "$res/stage-correctness.log"
    cat "$res/stage-correctness.md" 2>/dev/null
    ;;
ab-gpt2)
    # Issue 13's overhead figure for GPT-2 small again, more processes (the A/B inside each
    # process, hooks on and off in 1 s intervals; saved after every process).
    export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    timeout -k 5 "${AB_TIMEOUT_S:-560}" python3 eval/overhead.py --ab --job gpt2 --pairs 12 \
        --steps 500 --ab-ms 1000 --ab-skip 100 --budget-s "${AB_BUDGET_S:-470}" --out "$res" \
        > "$res/ab-gpt2.log" 2>&1
    tail -3 "$res/ab-gpt2.log"
    ;;
*)
    echo "usage: gpu-stage.sh figures | correctness | ab-gpt2" >&2
    exit 2
    ;;
esac
