#!/usr/bin/env bash
# What a GPU job's host memory is made of: the pages CRIU writes at every checkpoint and a
# migration sends while the job is held. Builds nothing: carry .gpu, staged here by
# `bash scripts/gpu-ckpt.sh --stage`.
#   bash scripts/gpu-hostmem.sh        (~1.5 min)
#       eval/hostmem.py: the job of the migration figures (8 GiB of fp16 weights read every step,
#       64 MiB of state) under `possum run` and bare, and GPT-2 training under `possum run`:
#       private dirty and anonymous kB of each mapping summed by what backs it, and what glibc's
#       malloc_trim(0) gives back and takes. -> $OUT/hostmem-*.json
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
gpu_libraries
harness_run hostmem HOSTMEM_BUDGET_S
frozen=(--hold-gib 8 --ballast-read-all --ballast-half --state-mib 64 --sleep-ms 20)
timeout -k 5 150 python3 eval/hostmem.py --out "$res" --job mlp --possum --tag frozen-possum -- "${frozen[@]}"
timeout -k 5 150 python3 eval/hostmem.py --out "$res" --job mlp --tag frozen-bare -- "${frozen[@]}"
timeout -k 5 150 python3 eval/hostmem.py --out "$res" --job gpt2 --possum --steps-before 20 --trim-step 30 \
    --tag gpt2-possum -- --sleep-ms 20
cp "$res"/hostmem-*.json "$out"/ 2>/dev/null
exit 0
