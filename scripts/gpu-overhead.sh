#!/usr/bin/env bash
# Issue 3 on the GPU machine: outputs with and without libpossum.so still bit-identical (MLP,
# GPT-2 small), the allocation counters of a possum run, then the steady-state overhead as a
# statistic (eval/overhead.py: rotated rounds, pinned CPUs, bootstrap interval).
#   (here)  bash scripts/gpu-ckpt.sh --stage
#   (there) bash scripts/gpu-overhead.sh [PAIRS] [STEPS]      results in $OUT (or .gpu/out)
#           MODES=plain,possum,possum-nocupti,possum-nodag,possum-hooksoff for the breakdown
#           AB=1: the A/B test inside each process instead (MLP and GPT-2 small; eval/overhead.py --ab);
#           AB_HOOKSOFF=1 adds GPT-2 with possum's callbacks returning at once (CUPTI's dispatch alone);
#           AB_ALWAYS=1 adds GPT-2 with every launch resolved (POSSUM_RESOLVE=always; the default
#           resolves launches in sampling windows and while a checkpoint is open)
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
    python3 -c "import json,sys; s=json.load(open(sys.argv[1])); c=s['possum']['counters']; print(sys.argv[2], {k: c.get(k) for k in ('managed_allocs','fallback_allocs','entry_points_swapped','launches','launches_examined','memo_hits')}, 'us/launch in callbacks %.2f' % (c['timed_launch_ns'] / max(c['timed_launches'], 1) / 1e3), 'entry_points', s.get('entry_points'), 'unmanaged', s['possum'].get('unmanaged_bytes'))" "$out/$1-stats.json" "$1" || status=1
done
# The VM's clock: if reading it is a system call, possum's sampled per-launch timing includes it.
echo "clocksource: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null)"
python3 -c "import time; n=200000; t=time.perf_counter(); [time.perf_counter_ns() for _ in range(n)]; print('perf_counter_ns: %.0f ns a call (Python included)' % ((time.perf_counter()-t)/n*1e9))"
if [ -n "${AB:-}" ]; then
    # Inside each process: CUPTI switched off and on (eval/overhead.py --ab).
    python3 eval/overhead.py --ab --job mlp --pairs "${AB_MLP_PROCS:-5}" --steps 4000 --ab-ms 250 \
        --budget-s 200 --out "$out" || status=1
    # GPT-2 small: ab_gpt2 PROCESSES BUDGET_S [more eval/overhead.py arguments]
    ab_gpt2() {
        local procs=$1 budget=$2; shift 2
        python3 eval/overhead.py --ab --job gpt2 --pairs "$procs" --steps "${AB_GPT2_STEPS:-500}" \
            --ab-ms 1000 --ab-skip 100 --budget-s "$budget" --out "$out" "$@" || status=1
    }
    ab_gpt2 "${AB_GPT2_PROCS:-4}" "${AB_GPT2_BUDGET:-150}"
    [ -n "${AB_ALWAYS:-}" ] && ab_gpt2 "${AB_GPT2_PROCS:-4}" 150 --ab-env POSSUM_RESOLVE=always
    # CUPTI's dispatch alone (possum's callbacks return at once) against no CUPTI.
    [ -n "${AB_HOOKSOFF:-}" ] && ab_gpt2 2 60 --ab-env POSSUM_HOOKS=off
else
    python3 eval/overhead.py --job mlp --pairs "$pairs" --steps "$steps" --budget-s "${BUDGET_S:-330}" --out "$out" \
        --modes "${MODES:-plain,possum,possum-nocupti}" || status=1
fi
exit $status
