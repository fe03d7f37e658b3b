#!/usr/bin/env bash
# One tensor of several GiB under `possum run`: how far a job gets, by the tensor's size, against
# the same job without possum. Builds nothing: carry .gpu (`bash scripts/gpu-ckpt.sh --stage`).
#   bash scripts/gpu-bigalloc.sh [MIB...]   (~2.5 min; default 2048 4200 8192)
#       workloads/gpu/jobs.py mlp --state-mib MIB (one tensor of MIB, written every step) for
#       20 s each, bare, under `possum run -v` (POSSUM_VERBOSE=1: the library's lines too), and with POSSUM_VALIDATE=off
#       (BIGALLOC_HOWS picks among bare, possum, possum-novalidate): steps made; a job that made none has its
#       Python threads' stacks dumped (faulthandler, SIGABRT) and its threads' kernel wait
#       channels listed; under possum, `possum status --json`'s allocation and validation
#       counters (managed or not, validation's time and errors). -> $OUT/bigalloc.txt
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
gpu_libraries
harness_run bigalloc BIGALLOC_BUDGET_S
sizes=("$@"); [ ${#sizes[@]} -gt 0 ] || sizes=(2048 4200 8192)
{
    for mib in "${sizes[@]}"; do
        for how in ${BIGALLOC_HOWS:-bare possum possum-novalidate}; do
            pre=(); [ "$how" != bare ] && pre=("$POSSUM" run -v)
            validate=; [ "$how" = possum-novalidate ] && validate=off
            o="$res/$how-$mib"
            POSSUM_VERBOSE=1 POSSUM_VALIDATE=${validate:-${POSSUM_VALIDATE:-}} PYTHONFAULTHANDLER=1 "${pre[@]}" python3 workloads/gpu/jobs.py mlp --steps 100000 \
                --state-mib "$mib" --sleep-ms 20 > "$o.out" 2> "$o.err" &
            runner=$!
            sleep 20
            job=$(pgrep -f "^python3 workloads/gpu/jobs.py mlp" | head -1)
            if [ -n "$job" ] && [ "$how" != bare ]; then
                # What possum serves and validates: managed or not, validation's time and errors.
                timeout 20 "$POSSUM" status "$job" --json > "$o.status.json" 2>&1
                python3 - "$o.status.json" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except ValueError:
    print("  status: " + open(sys.argv[1]).read()[:300]); sys.exit()
def find(v, keys, path=""):
    if isinstance(v, dict):
        for k, x in v.items():
            if any(w in k for w in keys):
                print(f"  {path}{k}: {json.dumps(x)[:300]}")
            else:
                find(x, keys, f"{path}{k}.")
find(s, ("managed", "fallback", "validation", "unmanaged", "fingerprint"))
PY
            fi
            if [ -n "$job" ] && ! grep -q step "$o.out"; then
                # Where its threads are, natively, where gdb is there (two looks, 3 s apart).
                if command -v gdb > /dev/null; then
                    for look in 1 2; do
                        echo "  native stacks, look $look:"
                        timeout 30 gdb -p "$job" -batch -ex "thread apply all bt 12" 2>/dev/null \
                            | grep -E "^#|^Thread" | grep -v "in ?? ()" | head -60 | sed 's/^/    /'
                        sleep 3
                    done
                fi
                for t in /proc/"$job"/task/*; do echo "  wchan $(basename "$t"): $(cat "$t"/wchan 2>/dev/null) $(cat "$t"/comm)"; done | sort | uniq -c -f2 | head -20
                kill -ABRT "$job"; sleep 2
            fi
            kill -9 "$runner" $job 2>/dev/null; pkill -9 -f "workloads/gpu/jobs.py mlp"; wait "$runner" 2>/dev/null
            echo "$mib MiB $how: $(grep -c step "$o.out") steps in 20 s"
            grep -v "UserWarning\|tensor.detach\|struct.pack" "$o.err" | head -40
        done
    done
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv
} 2>&1 | tee "$out/bigalloc.txt"
exit 0
