#!/usr/bin/env bash
# Issue 3 on the GPU machine: outputs with and without libpossum.so still bit-identical (MLP,
# GPT-2 small), the allocation counters of a possum run, then the steady-state overhead as a
# statistic (eval/overhead.py: rotated rounds, pinned CPUs, bootstrap interval).
#   (here)  bash scripts/gpu-ckpt.sh --stage
#   (there) bash scripts/gpu-overhead.sh [PAIRS] [STEPS]      results in $OUT (or .gpu/out)
#           MODES=plain,possum,possum-nocupti,possum-nodag,possum-hooksoff for the breakdown
set -uo pipefail
cd "$(dirname "$0")/.."
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "SKIPPED: no GPU (nvidia-smi -L failed)"
    exit 0
fi
pairs="${1:-12}"; steps="${2:-800}"
out="${OUT:-.gpu/out}"; mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
for job in "mlp 60" "gpt2 6"; do
    set -- $job
    POSSUM_STATS="$out/$1-stats.json" LD_PRELOAD="$PWD/.gpu/libpossum.so" POSSUM_SOCKET_DIR=/tmp \
        python3 workloads/gpu/jobs.py "$1" --steps "$2" > "$out/$1-possum.txt" 2> "$out/$1-possum.err"
    python3 workloads/gpu/jobs.py "$1" --steps "$2" > "$out/$1-plain.txt" 2> "$out/$1-plain.err"
    if cmp -s "$out/$1-possum.txt" "$out/$1-plain.txt" && [ -s "$out/$1-plain.txt" ]; then
        echo "$1: outputs identical with and without possum"
    else
        echo "FAIL: $1 outputs differ"; status=1; tail -5 "$out/$1-possum.err"
    fi
    python3 -c "import json,sys; s=json.load(open(sys.argv[1])); c=s['possum']['counters']; print(sys.argv[2], {k: c.get(k) for k in ('managed_allocs','fallback_allocs','entry_points_swapped','launches','memo_hits')}, 'us/launch in callbacks %.2f' % (c['timed_launch_ns'] / max(c['timed_launches'], 1) / 1e3), 'entry_points', s.get('entry_points'), 'unmanaged', s['possum'].get('unmanaged_bytes'))" "$out/$1-stats.json" "$1" || status=1
done
python3 eval/overhead.py --job mlp --pairs "$pairs" --steps "$steps" --budget-s "${BUDGET_S:-330}" --out "$out" \
    --modes "${MODES:-plain,possum,possum-nocupti}" || status=1
exit $status
