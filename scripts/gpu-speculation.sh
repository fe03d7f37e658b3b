#!/usr/bin/env bash
# Validated speculation by content on one GPU: fingerprints, read-only speculation on by default,
# only changed chunks moved. Builds nothing: carry .gpu, staged here by
# `bash scripts/gpu-ckpt.sh --stage` (possum, libpossum.so, the CRIU plugin, CRIU's .debs, the
# CUDA self-test).
#   bash scripts/gpu-speculation.sh frozen     (~7 min)
#       possum-cuda-selftest (the fingerprint kernel loaded from libpossum's PTX: bits against the
#       CPU's, time over 32 GiB); then eval/speculation.py frozen: a job with 8 GiB of fp16
#       weights read every step and a 64 MiB state written every step, strict (today's: no
#       read-only speculation, no fingerprints) against speculative (the defaults), in the same
#       run: a kept checkpoint, a second with --parent, a migration over loopback.
#       -> $OUT/speculation.jsonl, speculation-selftest.txt, speculation-frozen.tgz
#       SPEC_MODES picks the modes, SPEC_SELFTEST=0 skips the self-test, SPEC_FLAGS passes more
#       flags (--criu-log: CRIU's logs at level 4 and its statistics, in the .tgz).
#   bash scripts/gpu-speculation.sh trials [N]  (~9 min)
#       N (50) random-step trials with the defaults (`eval/ckpt.py correctness`: kept checkpoints
#       left running then restored, and checkpoints with the job killed then restored) over the
#       workloads, few-byte writes at fixed offsets (fewbytes) and fp16 loss scaling (amp)
#       among them; every output bit-exact against a run without possum.
#       -> $OUT/speculation-trials.{jsonl,md}, speculation-trials.log
#   bash scripts/gpu-speculation.sh ab          (~5 min)
#       GPT-2 small's in-process A/B (eval/overhead.py --ab) with the defaults.
#       -> $OUT/overhead-ab-gpt2.json
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
gpu_libraries
source scripts/gpu-criu.sh
harness_run speculation SPEC_BUDGET_S
case "${1:-}" in
frozen)
    if [ "${SPEC_SELFTEST:-1}" != 0 ]; then
        timeout -k 5 120 .gpu/possum-cuda-selftest > "$res/speculation-selftest.txt" 2>&1
        echo "selftest rc $?" >> "$res/speculation-selftest.txt"
        grep -i "fingerprint" "$res/speculation-selftest.txt"
    fi
    # SPEC_FLAGS: more of speculation.py's flags (--criu-log, --migrate-flags ...).
    # shellcheck disable=SC2086
    timeout -k 5 $(( $(left) - 15 )) python3 eval/speculation.py frozen --out "$res" \
        --gib "${SPEC_GIB:-8}" --state-mib "${SPEC_STATE_MIB:-64}" \
        --modes "${SPEC_MODES:-strict,speculative,speculative-2mib}" ${SPEC_FLAGS:-} 2>&1 | tee "$res/speculation-frozen.log"
    cp "$res/speculation.jsonl" "$res/speculation-selftest.txt" "$out"/ 2>/dev/null
    ;;
trials)
    CKPT_TIMEOUT=120 OUT="$res/c" timeout -k 5 $(( $(left) - 15 )) bash scripts/gpu-ckpt.sh correctness \
        --engines possum-keeper,possum-keeper-kill --trials "$(( ${2:-50} / 2 )),$(( ${2:-50} - ${2:-50} / 2 ))" \
        --parallel 3 --seed 43 --budget-s $(( $(left) - 40 )) \
        --jobs mlp,fewbytes,amp,gpt2,cnn,triton,graph,multistream,mlp+expandable,gpt2+async \
        > "$res/speculation-trials.log" 2>&1
    cp "$res/c/ckpt-correctness.jsonl" "$out/speculation-trials.jsonl" 2>/dev/null
    cp "$res/c/correctness.md" "$out/speculation-trials.md" 2>/dev/null
    grep -h "trials identical\|not started" "$res/speculation-trials.log"
    cp "$res/speculation-trials.log" "$out"/
    ;;
ab)
    timeout -k 5 $(( $(left) - 10 )) python3 eval/overhead.py --ab --job gpt2 --pairs 3 --steps 1800 \
        --ab-ms 400 --ab-skip 100 --budget-s $(( $(left) - 30 )) --out "$res" > "$res/ab.log" 2>&1
    cp "$res"/overhead-ab-gpt2*.json "$out"/ 2>/dev/null
    tail -5 "$res/ab.log"
    ;;
*) echo "usage: gpu-speculation.sh frozen | trials [N] | ab"; exit 2 ;;
esac
(cd /dev/shm && tar czf "$out/speculation-$1.tgz" --exclude='img-*' --exclude='received' \
    --exclude='possum-speculation' possum-speculation-out 2>/dev/null)
exit 0
