#!/usr/bin/env bash
# Migration on a two-GPU machine (kind nvidia-h100-x2 or nvidia-h200-x2; carry .gpu, staged
# here by `bash scripts/gpu-ckpt.sh --stage`): `possum restore --device 1` of a job that ran on
# GPU 0, checkpointed and killed while its keeper held its buffers (`--keep-on-gpu`, the
# default): the keeper's socket for GPU 1 copies each buffer GPU to GPU from the memory the
# keeper still holds on GPU 0, while CRIU restores the process, instead of reading the image.
#   bash scripts/gpu-migrate.sh all        (~9 min, one device call)
#     1. topology: nvidia-smi topo -m (NVLink or PCIe between the two GPUs) -> $OUT/migrate-topo.txt
#     2. correctness (`eval/ckpt.py migrate`): the MLP on GPU 0, checkpointed and killed, restored
#        with --device 1 under possum-keeper-kill (kept memory copied GPU to GPU),
#        possum-keeper-kill-disk (--keep-on-gpu 0: the keeper on GPU 1 loads the image), possum
#        (no keeper: the job copies from the image) and driver: it must run on GPU 1 and write
#        the reference's lines from the checkpointed step on.
#        -> $OUT/migrate-correctness.jsonl
#     3. figures (`eval/ckpt.py figures`, CKPT_RESTORE_DEVICE=1): the MLP holding 1, 8 and 32 GiB
#        written every step, checkpointed and killed, restored onto GPU 1: restore to the first
#        step and until every buffer is back, for possum-keeper-kill (GPU to GPU),
#        possum-keeper-kill-disk (image staged by the keeper) and driver-kill; then
#        possum-keeper-kill restored on its own GPU (no --device: mapped again) for comparison.
#        -> $OUT/migrate-figures.{json,md,jsonl}, migrate-same.{json,md}
#   bash scripts/gpu-migrate.sh figures    (~3 min)
#     Step 3 alone for the keeper's variants at 8 and 32 GiB (MIGRATE_FIG_ENGINES, MIGRATE_PLAN),
#     with what each restore's stage took (`stages_ended` of the keeper's stats): bytes copied GPU
#     to GPU or loaded from the image, and GB/s. -> $OUT/migrate-figures.*, migrate-stages.txt
#   bash scripts/gpu-migrate.sh trials     (~6 min)
#     Random-step trials (`eval/ckpt.py correctness`, CKPT_RESTORE_DEVICE=1) of every workload
#     and both served allocators under possum-keeper-kill: each job checkpointed and killed on
#     GPU 0 with its memory kept, restored onto GPU 1 (its buffers copied GPU to GPU), and its
#     output from the restore on compared with the reference's.
#     -> $OUT/migrate-trials.{jsonl,md}
# Without two GPUs it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "${n:-0}" -ge 2 ] || { echo "SKIPPED: needs two GPUs (nvidia-smi -L lists ${n:-0})"; exit 0; }
res="${OUT:-.gpu/out}"; mkdir -p "$res"; res=$(cd "$res" && pwd)
budget_end=$(( $(date +%s) + ${MIGRATE_BUDGET_S:-560} ))
left() { echo $(( budget_end - $(date +%s) )); }
# The figures of a move: engines $1, plan $2 (eval/ckpt.py figures, CKPT_RESTORE_DEVICE=1), and
# the keeper's stage of each restore (loaded or copied bytes, time, GB/s).
figures() {
    POSSUM_CKPT_HUGE=1 CKPT_RESTORE_DEVICE=1 OUT="$res/f" CKPT_TIMEOUT=200 timeout -k 5 $(( $(left) - 70 )) \
        bash scripts/gpu-ckpt.sh figures --engines "$1" --bench-plan "$2" --reps 1 \
        --budget-s $(( $(left) - 90 )) > "$res/migrate-figures.log" 2>&1
    cp "$res/f/figures.json" "$res/migrate-figures.json" 2>/dev/null
    cp "$res/f/figures.md" "$res/migrate-figures.md" 2>/dev/null
    cp "$res/f/ckpt-figures.jsonl" "$res/migrate-figures.jsonl" 2>/dev/null
    cat "$res/migrate-figures.md" 2>/dev/null || tail -20 "$res/migrate-figures.log"
    rm -rf "$res/f"
    python3 - "$res/migrate-figures.jsonl" <<'PY' | tee "$res/migrate-stages.txt"
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l); s = r.get("stage_ended") or {}
    if s:
        print(f"{r['engine']} {r['gib']} GiB: stage on {s.get('socket')}: {s.get('ready')} buffers "
              f"({s.get('peer_copied')} GPU to GPU, {s.get('peer_bytes')} B), {s.get('loaded_bytes')} B "
              f"loaded in {s.get('done_ms')} ms: {s.get('gb_per_s') or 0:.1f} GB/s")
PY
}
case "${1:-all}" in
all)
    nvidia-smi topo -m > "$res/migrate-topo.txt" 2>&1
    nvidia-smi --query-gpu=index,name,uuid,memory.total --format=csv >> "$res/migrate-topo.txt" 2>&1
    cat "$res/migrate-topo.txt"
    OUT="$res/c" CKPT_TIMEOUT=150 timeout -k 5 $(( $(left) > 200 ? 200 : $(left) )) bash scripts/gpu-ckpt.sh migrate \
        --engines "${MIGRATE_ENGINES:-possum-keeper-kill,possum-keeper-kill-disk,possum,driver}" \
        > "$res/migrate-correctness.log" 2>&1
    cp "$res/c/ckpt-migrate.jsonl" "$res/migrate-correctness.jsonl" 2>/dev/null
    python3 - "$res/migrate-correctness.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l); rs = r.get("restore") or {}
    print(f"migrate {r.get('engine')}: ok={r.get('ok')} gpu {r.get('gpu_before')} -> {r.get('gpu_after')}, "
          f"resumed at step {r.get('resumed_at_step')}, identical={r.get('restored_identical')}, "
          f"peer_buffers={rs.get('peer_buffers')} staged_mapped={rs.get('staged_buffers_mapped')} "
          f"moved={rs.get('moved')} skipped={rs.get('stage_skipped')} err={(rs.get('stderr') or '')[-300:]}")
PY
    rm -rf "$res/c"
    figures "${MIGRATE_FIG_ENGINES:-possum-keeper-kill,possum-keeper-kill-disk,driver-kill}" "${MIGRATE_PLAN:-mlp:1,8,32}"
    if [ "$(left)" -gt 60 ]; then
        POSSUM_CKPT_HUGE=1 OUT="$res/s" CKPT_TIMEOUT=120 timeout -k 5 $(( $(left) - 5 )) bash scripts/gpu-ckpt.sh figures \
            --engines possum-keeper-kill --bench-plan "${MIGRATE_PLAN:-mlp:1,8,32}" --reps 1 \
            --budget-s $(( $(left) - 15 )) > "$res/migrate-same.log" 2>&1
        cp "$res/s/figures.json" "$res/migrate-same.json" 2>/dev/null
        cp "$res/s/figures.md" "$res/migrate-same.md" 2>/dev/null
        cat "$res/migrate-same.md" 2>/dev/null || tail -20 "$res/migrate-same.log"
        rm -rf "$res/s"
    fi
    ;;
figures)
    figures "${MIGRATE_FIG_ENGINES:-possum-keeper-kill,possum-keeper-kill-disk}" "${MIGRATE_PLAN:-mlp:8,32}"
    ;;
trials)
    CKPT_RESTORE_DEVICE=1 OUT="$res/t" CKPT_TIMEOUT=150 timeout -k 5 $(( $(left) - 5 )) \
        bash scripts/gpu-ckpt.sh correctness --engines possum-keeper-kill \
        --trials "${MIGRATE_TRIALS:-10}" --seed "${MIGRATE_SEED:-24}" --budget-s $(( $(left) - 40 )) \
        --jobs "${MIGRATE_JOBS:-mlp,cnn,gpt2,triton,graph,multistream,ptrtable,lcuda,mlp+expandable,gpt2+async}" \
        > "$res/migrate-trials.log" 2>&1
    cp "$res/t/ckpt-correctness.jsonl" "$res/migrate-trials.jsonl" 2>/dev/null
    cp "$res/t/correctness.md" "$res/migrate-trials.md" 2>/dev/null
    rm -rf "$res/t"
    grep -h "trials identical" "$res/migrate-trials.log"
    python3 - "$res/migrate-trials.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l); rs = r.get("restore") or {}
    print(f"{r.get('job')} k={r.get('k')}: ok={r.get('ok')} gpu_after={r.get('gpu_after')} "
          f"peer_buffers={rs.get('peer_buffers')} mapped={rs.get('staged_buffers_mapped')} "
          f"identical={r.get('restored_identical')} err={(rs.get('stderr') or '')[-200:]}")
PY
    ;;
*)
    echo "usage: gpu-migrate.sh all | figures | trials"; exit 2 ;;
esac
