#!/usr/bin/env bash
# What session 22 fixed and could not run on the GPU (its device time was spent), in one device
# call of about 9 minutes (carry .gpu, staged by `bash scripts/gpu-ckpt.sh --stage`):
#   1. GPT-2 with cudaMallocAsync, now served by default: the two races its frees found
#      (a free unmapping a buffer a starting pre-copy round had picked; a buffer freed while the
#      checkpoint was made, in the image and not in the job) are fixed on the CPU. Correctness of
#      gpt2+async with `possum checkpoint` and no flags, and killed and restored from the keeper,
#      beside the other jobs that free engine buffers (mlp+async, gpt2+expandable);
#   2. the MLP's in-process A/B again on a warm machine (session 22's ran on a machine just
#      started: +0.89%, CI -1.19 .. +5.07%);
#   3. CUDA IPC of served VMM memory (workloads/gpu/vmmshare.cu, as NCCL shares its buffers):
#      under `possum run` (a keeper) the export must give an fd of the same memory; with
#      libpossum.so and no keeper it is refused, said on stderr; without possum, the reference.
# Writes $OUT/next-*.{jsonl,md,log,txt} and overhead-ab-mlp.json (or .gpu/out/). Without a GPU it
# says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L >/dev/null 2>&1 || { echo "SKIPPED: no GPU (nvidia-smi -L failed)"; exit 0; }
res="${OUT:-.gpu/out}"; mkdir -p "$res"
CKPT_TIMEOUT=120 OUT="$res/c" timeout -k 5 400 bash scripts/gpu-ckpt.sh correctness \
    --engines possum,possum-keeper-kill --jobs gpt2+async,mlp+async,gpt2+expandable --trials 5,3 \
    --budget-s 330 > "$res/next-async.log" 2>&1
for f in ckpt-correctness.jsonl correctness.md; do cp "$res/c/$f" "$res/next-async-$f" 2>/dev/null; done
rm -rf "$res/c"
grep -h "trials identical" "$res/next-async.log"
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
timeout -k 5 150 python3 eval/overhead.py --ab --job mlp --pairs 4 --steps 4000 --ab-ms 250 \
    --budget-s 130 --out "$res" > "$res/next-ab.log" 2>&1
tail -2 "$res/next-ab.log"
W=/dev/shm/possum-vmmshare; rm -rf "$W"; mkdir -p "$W/sockets"
{
    nvcc -O2 -arch=sm_90 -o "$W/vmmshare" workloads/gpu/vmmshare.cu -lcuda 2>&1 \
        || nvcc -O2 -arch=sm_90 -o "$W/vmmshare" workloads/gpu/vmmshare.cu \
            -L/usr/local/cuda/lib64/stubs -lcuda 2>&1
    echo "without possum: $("$W/vmmshare" 2>&1)"
    echo "possum run (keeper): $(timeout 60 .gpu/possum run --socket-dir "$W/sockets" -- "$W/vmmshare" 2>&1)"
    echo "libpossum.so, no keeper: $(POSSUM_SOCKET_DIR="$W/sockets" LD_PRELOAD="$PWD/.gpu/libpossum.so" \
        timeout 60 "$W/vmmshare" 2>&1)"
} > "$res/next-vmmshare.txt" 2>&1
cat "$res/next-vmmshare.txt"
