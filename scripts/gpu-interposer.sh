#!/usr/bin/env bash
# Issue 3 checks on the GPU machine, from the repo root, with the build in .gpu/ (libpossum.so):
# every workload with and without libpossum.so (LD_PRELOAD, and CUDA_INJECTION64_PATH for one),
# outputs compared bit for bit, possum's launch counts beside torch.profiler's, step times.
set -uo pipefail
cd "$(dirname "$0")/.."
res="${OUT:-.gpu/out}"; out=/tmp/possum-interposer; mkdir -p "$res" "$out"
so="$PWD/.gpu/libpossum.so"
steps="${STEPS:-10}"
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export POSSUM_CUPTI="${POSSUM_CUPTI:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcupti.so.13}"
nvcc -O2 -arch=sm_90 -o "$out/ptrtable" workloads/gpu/ptrtable.cu || echo "nvcc failed"
status=0
summary="$res/interposer-summary.jsonl"; : > "$summary"
for job in ${JOBS:-mlp cnn gpt2 triton graph multistream ptrtable}; do
    if [ "$job" = ptrtable ]; then cmd=("$out/ptrtable" "$steps"); else cmd=(python3 workloads/gpu/jobs.py "$job" --steps "$steps"); fi
    # Plain and with possum, alternating, REPS times each: median step time of each.
    for r in $(seq 1 "${REPS:-3}"); do
        POSSUM_TIMING_FILE="$out/$job.plain.t$r" "${cmd[@]}" > "$out/$job.plain" 2> "$out/$job.plain.err"
        LD_PRELOAD="$so" POSSUM_STATS="$out/$job.stats.json" POSSUM_TIMING_FILE="$out/$job.possum.t$r" "${cmd[@]}" > "$out/$job.possum" 2> "$out/$job.possum.err"
    done
    timing=$(python3 - "$out" "$job" <<'PY'
import json, statistics, sys, glob
out, job = sys.argv[1], sys.argv[2]
def med(kind):
    v = [json.load(open(f))["step_ms_median"] for f in glob.glob(f"{out}/{job}.{kind}.t*")]
    return statistics.median(v) if v else None
p, q = med("plain"), med("possum")
print(json.dumps({"plain_step_ms": p, "possum_step_ms": q, "overhead_pct": (100 * (q - p) / p) if p and q else None}))
PY
)
    same=false; cmp -s "$out/$job.plain" "$out/$job.possum" && [ -s "$out/$job.plain" ] && same=true
    prof='{}'
    if [ "$job" != ptrtable ]; then
        python3 workloads/gpu/jobs.py "$job" --steps "$steps" --profile > "$out/$job.profile" 2>/dev/null
        prof=$(tail -n 1 "$out/$job.profile" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin).get("profiler", {})))' 2>/dev/null || echo '{}')
    fi
    stats=$(cat "$out/$job.stats.json" 2>/dev/null || echo '{}')
    echo "{\"job\":\"$job\",\"identical\":$same,\"timing\":$timing,\"profiler\":$prof,\"possum\":$stats}" >> "$summary"
    echo "$job: identical=$same timing=$timing profiler=$prof possum_launches=$(echo "$stats" | python3 -c 'import json,sys; j=json.load(sys.stdin); print(j.get("total_launches"), "graphs", j.get("graph_launches"))' 2>/dev/null)"
    [ "$same" = true ] || { status=1; echo "DIFF in $job:"; diff "$out/$job.plain" "$out/$job.possum" | head -5; tail -3 "$out/$job.possum.err"; }
done
# The injection entry point, once.
CUDA_INJECTION64_PATH="$so" POSSUM_STATS="$out/mlp.inject.json" python3 workloads/gpu/jobs.py mlp --steps "$steps" > "$out/mlp.inject" 2> "$out/mlp.inject.err"
cmp -s "$out/mlp.plain" "$out/mlp.inject" && echo "injection: identical, stats: $(cat "$out/mlp.inject.json" 2>/dev/null | head -c 300)" || { status=1; echo "injection run differs"; diff "$out/mlp.plain" "$out/mlp.inject" | head; tail -5 "$out/mlp.inject.err"; }
# A job that never touches CUDA.
LD_PRELOAD="$so" python3 -c 'print("no cuda here")' | grep -q "no cuda here" && echo "non-CUDA job: unchanged" || { status=1; echo "non-CUDA job broke"; }
exit $status
