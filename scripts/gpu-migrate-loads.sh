#!/usr/bin/env bash
# How a migration's destination loads the GPU images ahead of the restore, A/B on one GPU, both
# ends on it over loopback, in one call of under ten minutes (LOADS_LIMIT_S, default 570 s):
#   1. the training job (8 GiB of state written every step): SPEC_SLICE_RUNS (2) pairs through
#      `scripts/gpu-speculation.sh LOADS_AB`, images on a huge-page tmpfs. LOADS_AB is
#      `partial` (the default: a stage built on another taking the chunks of a buffer that one
#      was still loading, POSSUM_KEEPER_STAGE_PARTIAL) or `rewritten` (the keeper told which
#      bytes each part sent ahead brought again, POSSUM_MIGRATE_LOAD_REWRITTEN);
#   2. GPT-2 training migrated at the same random step with POSSUM_MIGRATE_LOAD_REWRITTEN
#      at 0 and 1, one pair per seed of LOADS_GPT2_SEEDS (none by default; "61 62" for two)
#      (`scripts/gpu-ckpt.sh correctness --trials 1`, images on a huge-page tmpfs);
#   3. if 150 s are left: 32 GiB of frozen weights, its first round sent once copied (the
#      default) and as it is copied (`scripts/gpu-speculation.sh first-round`), one pair.
# Builds nothing: carry .gpu (staged by `bash scripts/gpu-ckpt.sh --stage`).
# -> $OUT/loads-bars.jsonl (rows tagged t8-A-N, t8-B-N as LOADS_AB names them, f32-after-1,
#    f32-copying-1), $OUT/loads-gpt2.jsonl (each row with `load_rewritten` and `seed`),
#    $OUT/loads-logs.tgz (every log, the images left out)
# Without a GPU it says SKIPPED and exits 0.
set -u
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
harness_run loads LOADS_LIMIT_S
scratch=$res

echo "== 1. the training job, $(left) s left"
OUT=$scratch/t8 SPEC_HUGE=1 SPEC_BARS="0 8192 t8" SPEC_SLICE_RUNS=${SPEC_SLICE_RUNS:-2} \
    timeout -k 5 $(( $(left) - 150 )) bash scripts/gpu-speculation.sh "${LOADS_AB:-partial}"
cat "$scratch/t8/speculation-bars.jsonl" >> "$out/loads-bars.jsonl" 2>/dev/null
free_huge_images

echo "== 2. GPT-2 training, $(left) s left"
for seed in ${LOADS_GPT2_SEEDS:-}; do
    for v in 0 1; do
        [ "$(left)" -gt 90 ] || break 2
        d=$scratch/gpt2-$seed-$v
        POSSUM_CKPT_HUGE=1 POSSUM_MIGRATE_LOAD_REWRITTEN=$v OUT=$d timeout -k 5 80 \
            bash scripts/gpu-ckpt.sh correctness --engines possum-keeper-migrate --jobs gpt2 \
            --trials 1 --seed "$seed" > "$d.log" 2>&1
        tail -3 "$d.log"
        python3 -c 'import json,sys
for l in open(sys.argv[1]):
    print(json.dumps(dict(json.loads(l), load_rewritten=int(sys.argv[2]), seed=int(sys.argv[3]))))' \
            "$d/ckpt-correctness.jsonl" "$v" "$seed" >> "$out/loads-gpt2.jsonl" 2>/dev/null
    done
done

if [ "$(left)" -gt 150 ]; then
    echo "== 3. 32 GiB of frozen weights, $(left) s left"
    OUT=$scratch/f32 SPEC_HUGE=1 SPEC_BARS="32 64 f32" SPEC_SLICE_RUNS=1 \
        timeout -k 5 $(( $(left) - 10 )) bash scripts/gpu-speculation.sh first-round
    cat "$scratch/f32/speculation-bars.jsonl" >> "$out/loads-bars.jsonl" 2>/dev/null
    free_huge_images
fi
(cd "$scratch" && find . -type f \( -name '*.log' -o -name '*.err' -o -name '*.md' -o -name '*.tgz' \) \
    -size -20M | tar czf "$out/loads-logs.tgz" -T -)
echo "== done, $(left) s left"
