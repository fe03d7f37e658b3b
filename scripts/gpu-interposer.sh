#!/usr/bin/env bash
# libpossum.so's checks on the GPU machine, from the repo root, with the build in .gpu/ (libpossum.so,
# possum).
#
# A full check of the default hooks fits three device calls of at most 10 minutes each
# (about 23 minutes of device time; each writes at most 7 files under $OUT):
#   A (~8.5 min): bash scripts/gpu-interposer.sh coverage; AB=1 bash scripts/gpu-overhead.sh
#       -> coverage.{json,md}, coverage-logs.tgz, overhead-check.json, overhead-ab-{mlp,gpt2}.json, overhead-logs.tgz
#   B (~8 min):   timeout -k 5 590 bash scripts/gpu-ckpt.sh correctness --trials 20 --budget-s 540
#       -> ckpt-correctness.jsonl, correctness.md, ckpt-logs.tgz
#   C (~6.5 min): timeout -k 5 590 bash scripts/gpu-ckpt.sh figures --budget-s 540
#       -> figures.{json,md}, ckpt-figures.jsonl, ckpt-logs.tgz
#
#   (here)  bash scripts/gpu-interposer.sh --stage
#   (there) bash scripts/gpu-interposer.sh coverage                                    (~2-3 min)
#       The entry points' coverage (possum's default hooks, no CUPTI): eval/hooks_coverage.py. Every
#       workload of jobs.py (MLP+Adam, CNN/cuDNN, GPT-2 small AMP, Triton, CUDA graph,
#       multi-stream; short step counts) x PYTORCH_CUDA_ALLOC_CONF unset / expandable_segments:True
#       / backend:cudaMallocAsync: launches possum saw run + graph kernel nodes per graph launch
#       against torch.profiler's kernels (separate run), outputs byte-identical with and without
#       possum; workloads/gpu/lcuda.cu (built here with `nvcc ... -lcuda`: cuLaunchKernel,
#       cuLaunchKernelEx, cuMemcpyHtoD_v2, cuMemsetD32_v2 called directly) against its own
#       counts, plain and with parameters in `extra`; the MLP under POSSUM_HOOKS=cupti (entry
#       wrappers' counts = CUPTI's, name by name). Runs PAR (8) processes at a time; budget
#       COVERAGE_BUDGET_S (300 s).
#       -> $OUT/coverage.json, $OUT/coverage.md, $OUT/coverage-logs.tgz
#   (there) bash scripts/gpu-interposer.sh    # the full run (below); REPS=3 JOBS="mlp cnn ..." BREAKDOWN="mlp" STEPS=N to vary
#
# The full run: every workload with and without libpossum.so (LD_PRELOAD; CUDA_INJECTION64_PATH
# for one), outputs compared bit for bit; possum's launch counts beside torch.profiler's; buffer
# identification, opaque kernels (the pointer-table kernels must be caught), validation cost;
# what cudaMalloc's callers expect (allocattrs.cu); possum run --trace, possum trace/status on a
# live job; step times with and without (alternating runs, REPS each). possum's hooks are its
# default (the driver's entry points; HOOKS=cupti or off to change).
# Coverage is measured with every launch resolved (POSSUM_RESOLVE=always; RESOLVE=sample for the
# default, which resolves launches only in sampling windows and while a checkpoint is open).
# Results: $OUT (or .gpu/out): interposer-summary.jsonl and interposer-files.tgz (every log).
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--stage" ]; then
    cargo build --release -p possum-interposer -p possum -p possum-analyzer || exit 1
    mkdir -p .gpu
    cp target/release/libpossum.so target/release/possum target/release/possum-nvinfo .gpu/
    strip .gpu/possum .gpu/possum-nvinfo && strip --strip-debug .gpu/libpossum.so
    ls -la .gpu
    exit 0
fi
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "SKIPPED: no GPU (nvidia-smi -L failed)"
    exit 0
fi
res="${OUT:-.gpu/out}"; mkdir -p "$res"
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$PATH:/usr/local/cuda/bin"
cupti_lib=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcupti.so.13
if [ "${1:-}" = coverage ]; then
    work=/tmp/possum-coverage; rm -rf "$work"; mkdir -p "$work"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$work/gpu.txt"
    # Linked with -lcuda (nvcc's profile adds the driver's stub directory; the stubs path is the
    # fallback): its driver calls bind to libcuda's exported names at load time.
    nvcc -O2 -arch=sm_90 -o "$work/lcuda" workloads/gpu/lcuda.cu -lcuda > "$work/nvcc.log" 2>&1 \
        || nvcc -O2 -arch=sm_90 -o "$work/lcuda" workloads/gpu/lcuda.cu -L/usr/local/cuda/lib64/stubs -lcuda >> "$work/nvcc.log" 2>&1 \
        || { echo "nvcc lcuda failed:"; tail -5 "$work/nvcc.log"; }
    lcuda=""; [ -x "$work/lcuda" ] && lcuda="$work/lcuda"
    POSSUM_CUPTI="${POSSUM_CUPTI:-$cupti_lib}" python3 eval/hooks_coverage.py --out "$res" --work "$work" --lcuda "$lcuda" \
        --par "${PAR:-8}" --budget-s "${COVERAGE_BUDGET_S:-300}" ${COVERAGE_ARGS:-}
    rc=$?
    [ -n "$lcuda" ] || { echo "FAIL: the -lcuda program was not built (see coverage-logs.tgz: nvcc.log)"; rc=1; }
    tar czf "$res/coverage-logs.tgz" -C "$work" --exclude=lcuda --exclude='*.sock' . 2>/dev/null
    exit $rc
fi
out=/tmp/possum-interposer; rm -rf "$out"; mkdir -p "$out"
so="$PWD/.gpu/libpossum.so"
possum="$PWD/.gpu/possum"
export POSSUM_CUPTI="${POSSUM_CUPTI:-$cupti_lib}"
[ -n "${HOOKS:-}" ] && export POSSUM_HOOKS="$HOOKS"
export POSSUM_SOCKET_DIR="$out/sockets"
export POSSUM_RESOLVE="${RESOLVE:-always}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
for p in ptrtable allocattrs; do
    nvcc -O2 -arch=sm_90 -cudart shared -o "$out/$p" "workloads/gpu/$p.cu" || echo "nvcc $p failed"
done
status=0
fail() { echo "FAIL: $*"; status=1; }
summary="$res/interposer-summary.jsonl"; : > "$summary"

# What a caller of cudaMalloc expects, with allocations served by the engine.
POSSUM_STATS="$out/allocattrs.stats.json" LD_PRELOAD="$so" "$out/allocattrs" > "$out/allocattrs.out" 2> "$out/allocattrs.err" \
    || fail "allocattrs under possum: $(cat "$out/allocattrs.err")"
"$out/allocattrs" > "$out/allocattrs.plain" 2>&1 || fail "allocattrs without possum"
python3 - "$out" <<'PY' || fail "allocattrs: allocations not served by the engine"
import json, sys
out = sys.argv[1]
s = json.load(open(f"{out}/allocattrs.stats.json"))["possum"]["counters"]
print("allocattrs:", open(f"{out}/allocattrs.out").read().strip(), "managed_allocs", s["managed_allocs"], "frees", s["managed_frees"])
assert s["managed_allocs"] >= 3 and s["managed_frees"] >= 3, s
PY

# Steps per job: enough for a steady median step time (launch-bound jobs vary from step to step).
steps_for() {
    [ -n "${STEPS:-}" ] && { echo "$STEPS"; return; }
    case "$1" in mlp|multistream) echo 200;; graph) echo 100;; gpt2) echo 20;; ptrtable) echo 10;; *) echo 50;; esac
}
for job in ${JOBS:-mlp cnn gpt2 triton graph multistream ptrtable}; do
    steps=$(steps_for "$job")
    if [ "$job" = ptrtable ]; then cmd=("$out/ptrtable" "$steps"); else cmd=(python3 workloads/gpu/jobs.py "$job" --steps "$steps"); fi
    # Plain and with possum, alternating, REPS times each: median step time of each.
    for r in $(seq 1 "${REPS:-3}"); do
        POSSUM_TIMING_FILE="$out/$job.plain.t$r" "${cmd[@]}" > "$out/$job.plain" 2> "$out/$job.plain.err"
        LD_PRELOAD="$so" POSSUM_VERBOSE=1 POSSUM_STATS="$out/$job.stats.json" POSSUM_TRACE="$out/$job.trace.json" \
            POSSUM_TIMING_FILE="$out/$job.possum.t$r" "${cmd[@]}" > "$out/$job.possum" 2> "$out/$job.possum.err"
        if [[ " ${BREAKDOWN:-} " == *" $job "* ]]; then
            # Where the overhead goes: without the DAG; and watching only (no engine, no DAG, no
            # validation: the first slice's cost).
            LD_PRELOAD="$so" POSSUM_DAG=0 POSSUM_STATS="$out/$job.nodag.stats.json" POSSUM_TIMING_FILE="$out/$job.nodag.t$r" "${cmd[@]}" > /dev/null 2>&1
            LD_PRELOAD="$so" POSSUM_DAG=0 POSSUM_MANAGE=0 POSSUM_VALIDATE=off POSSUM_STATS="$out/$job.watch.stats.json" POSSUM_TIMING_FILE="$out/$job.watch.t$r" "${cmd[@]}" > /dev/null 2>&1
        fi
    done
    same=false; cmp -s "$out/$job.plain" "$out/$job.possum" && [ -s "$out/$job.plain" ] && same=true
    if [ "$job" != ptrtable ]; then
        python3 workloads/gpu/jobs.py "$job" --steps "$steps" --profile > "$out/$job.profile" 2>/dev/null
    fi
    python3 - "$out" "$job" "$same" >> "$summary" <<'PY'
import json, statistics, sys, glob
out, job, same = sys.argv[1], sys.argv[2], sys.argv[3] == "true"
def runs(kind):
    return [json.load(open(f))["step_ms_median"] for f in sorted(glob.glob(f"{out}/{job}.{kind}.t*"))]
def med(kind):
    v = runs(kind)
    return statistics.median(v) if v else None
p, q = med("plain"), med("possum")
# The fastest run of each: interference (other tenants, clocks) only ever slows a run down.
pmin, qmin = min(runs("plain") or [0]), min(runs("possum") or [0])
try:
    prof = json.loads(open(f"{out}/{job}.profile").read().strip().splitlines()[-1]).get("profiler", {})
except Exception:
    prof = {}
try:
    s = json.load(open(f"{out}/{job}.stats.json"))
except Exception as e:
    s = {"error": str(e)}
c = s.get("possum", {}).get("counters", {})
try:
    # The kernels whose launches most often missed the launch path's memo (resolved again).
    ks = json.load(open(f"{out}/{job}.trace.json")).get("kernels") or []
    most_resolved = [{"name": (k.get("name") or "?")[:100], "launches": k.get("launches"),
                      "resolved": k.get("resolved"), "slots": k.get("slots")}
                     for k in sorted(ks, key=lambda k: -(k.get("resolved") or 0))[:8]]
except Exception:
    most_resolved = None
launches = c.get("launches", 0)
# Shares of the launches whose buffers were looked at (all of them with POSSUM_RESOLVE=always).
examined = c.get("launches_examined", launches)
nodag, watch = med("nodag"), med("watch")
pct = lambda x: (100 * (x - p) / p) if p and x else None
row = {"job": job, "identical": same,
       "plain_step_ms": p, "possum_step_ms": q, "overhead_pct": pct(q),
       "nodag_overhead_pct": pct(nodag), "watch_overhead_pct": pct(watch),
       "plain_runs_ms": runs("plain"), "possum_runs_ms": runs("possum"),
       "overhead_min_pct": (100 * (qmin - pmin) / pmin) if pmin and qmin else None,
       "profiler_kernels": prof.get("kernels"), "hooks": s.get("hooks"), "total_launches": s.get("total_launches"),
       "possum_kernels": c.get("launches", 0) + c.get("graph_nodes_expanded", 0),
       "graph_launches": s.get("graph_launches"), "graph_nodes_expanded": c.get("graph_nodes_expanded"),
       "examined_pct": (100 * examined / launches) if launches else None,
       "identified_pct": (100 * c.get("launches_identified", 0) / examined) if examined else None,
       "validated_identified_pct": (100 * c.get("validated_launches_identified", 0) / c["validations"]) if c.get("validations") else None,
       "unmanaged_launch_pct": (100 * c.get("launches_unmanaged", 0) / examined) if examined else None,
       "opaque_launch_pct": (100 * c.get("launches_opaque", 0) / examined) if examined else None,
       "kernels": s.get("possum", {}).get("kernels"),
       "opaque_kernels": s.get("possum", {}).get("opaque_kernels"),
       "validations": c.get("validations"), "validation_ms": c.get("validation_ns", 0) / 1e6,
       "managed_allocs": c.get("managed_allocs"), "fallback_allocs": c.get("fallback_allocs"),
       "hook_us_per_launch": (c["timed_launch_ns"] / c["timed_launches"] / 1e3) if c.get("timed_launches") else None,
       "memo_hit_pct": (100 * c.get("memo_hits", 0) / examined) if examined else None,
       "most_resolved": most_resolved,
       "unmanaged": s.get("possum", {}).get("unmanaged"), "counters": c}
print(json.dumps(row))
PY
    tail -n 1 "$summary" | python3 -c 'import json,sys; r=json.load(sys.stdin); print({k: r[k] for k in ["job","identical","plain_step_ms","overhead_pct","overhead_min_pct","nodag_overhead_pct","watch_overhead_pct","hook_us_per_launch","memo_hit_pct","hooks","profiler_kernels","possum_kernels","total_launches","examined_pct","identified_pct","validated_identified_pct","unmanaged_launch_pct","opaque_launch_pct","validations","validation_ms","managed_allocs"]}); print("  counters:", r["counters"]); [print("  opaque:", (o.get("name") or "?")[:90], "--", o.get("reason")) for o in (r["opaque_kernels"] or [])[:12]]'
    [ "$same" = true ] || { fail "output differs in $job"; diff "$out/$job.plain" "$out/$job.possum" | head -5; tail -5 "$out/$job.possum.err"; }
done

# The pointer-table kernels must be caught; the by-value struct kernel must not be opaque.
if [ -f "$out/ptrtable.stats.json" ]; then
    python3 - "$out" <<'PY' || fail "ptrtable: validation did not catch the pointer-table kernels"
import json, sys
s = json.load(open(f"{sys.argv[1]}/ptrtable.stats.json"))["possum"]
names = [o["name"] or "" for o in s["opaque_kernels"]]
print("ptrtable opaque kernels:", names)
assert any("bump_table" in n for n in names) and any("gather_table" in n for n in names), names
assert not any("scale_struct" in n for n in names), names
PY
fi

# The .nv.info fallback on real modules: every kernel's layout from the modules CUPTI reports
# loaded, none from the driver (POSSUM_LAYOUTS=cubin); outputs must still be identical.
for job in ${CUBIN_JOBS:-mlp ptrtable}; do
    steps=$(steps_for "$job")
    if [ "$job" = ptrtable ]; then cmd=("$out/ptrtable" "$steps"); else cmd=(python3 workloads/gpu/jobs.py "$job" --steps "$steps"); fi
    [ -s "$out/$job.plain" ] || "${cmd[@]}" > "$out/$job.plain" 2>/dev/null
    POSSUM_LAYOUTS=cubin LD_PRELOAD="$so" POSSUM_STATS="$out/$job.cubin.stats.json" "${cmd[@]}" > "$out/$job.cubin" 2> "$out/$job.cubin.err"
    cmp -s "$out/$job.plain" "$out/$job.cubin" || { fail "$job with layouts from .nv.info only: output differs"; tail -3 "$out/$job.cubin.err"; }
    python3 - "$out/$job.cubin.stats.json" "$job" <<'PY' || fail "$job: no layouts from loaded modules"
import json, sys
s = json.load(open(sys.argv[1]))["possum"]
c = s["counters"]
no_layout = [o["name"] for o in s["opaque_kernels"] if "no parameter layout" in (o.get("reason") or "")]
print(f"{sys.argv[2]} layouts from .nv.info only: modules parsed {c['modules_parsed']}, unparsed {c['modules_unparsed']}, "
      f"kernels {s['kernels']}, layouts from cubins {c['layouts_from_cubin']}, without a layout {len(no_layout)} {no_layout[:3]}, "
      f"launches identified {c['launches_identified']} of {c['launches']}")
assert c["layouts_from_cubin"] > 0, c
PY
done

# possum run --trace, and possum trace / status against a live job.
"$possum" run --lib "$so" --trace "$out/trace-mlp.json" -- python3 workloads/gpu/jobs.py mlp --steps 3 > "$out/trace-run.out" 2>&1 || fail "possum run --trace"
python3 -c "import json,sys; t=json.load(open('$out/trace-mlp.json')); print('trace: kernels', len(t['kernels']), 'dag kernels', len(t['dag']['kernels']), 'buffers', len(t['dag']['buffers']), 'edges', len(t['dag']['edges']), 'window', len(t['dag']['window']['launches']))" || fail "trace file"
[ -s "$out/trace-mlp.json.dot" ] && head -c 300 "$out/trace-mlp.json.dot" && echo || fail "trace DOT"
rm -rf "$POSSUM_SOCKET_DIR"
"$possum" run --lib "$so" -- python3 workloads/gpu/jobs.py mlp --steps 3000 > "$out/live.out" 2>&1 &
pid=""
for i in $(seq 1 150); do
    for s in "$POSSUM_SOCKET_DIR"/possum-*.sock; do
        [ -S "$s" ] && pid=$(basename "$s" .sock) && pid=${pid#possum-}
    done
    [ -n "$pid" ] && break
    sleep 0.1
done
"$possum" status "$pid" > "$out/live-status.txt" 2>&1 && head -n 30 "$out/live-status.txt" || fail "possum status on a live job"
"$possum" trace "$pid" -o "$out/live-trace.json" --dot "$out/live-trace.dot" 2>&1 && echo "live trace: $(wc -c < "$out/live-trace.json") bytes" || fail "possum trace on a live job"
wait
"$possum" trace $$ > "$out/not-loaded.txt" 2>&1; echo "possum trace on a shell (exit $?): $(cat "$out/not-loaded.txt")"

# The injection entry point, once (against a plain run of the same steps; JOBS may have left
# the MLP out).
[ -s "$out/mlp.plain" ] || python3 workloads/gpu/jobs.py mlp --steps "$(steps_for mlp)" > "$out/mlp.plain" 2>/dev/null
CUDA_INJECTION64_PATH="$so" POSSUM_STATS="$out/mlp.inject.json" python3 workloads/gpu/jobs.py mlp --steps "$(steps_for mlp)" > "$out/mlp.inject" 2> "$out/mlp.inject.err"
cmp -s "$out/mlp.plain" "$out/mlp.inject" && echo "injection: identical, launches $(python3 -c "import json; print(json.load(open('$out/mlp.inject.json'))['total_launches'])")" || { fail "injection run differs"; tail -5 "$out/mlp.inject.err"; }
# A job that never touches CUDA.
LD_PRELOAD="$so" python3 -c 'print("no cuda here")' | grep -q "no cuda here" && echo "non-CUDA job: unchanged" || fail "non-CUDA job broke"
# The .nv.info parser against cuobjdump, on the pointer-table job's cubin.
cuobjdump -xelf all "$out/ptrtable" > /dev/null 2>&1; for c in *.cubin; do [ -f "$c" ] && .gpu/possum-nvinfo "$c" && rm -f "$c"; done
tar czf "$res/interposer-files.tgz" -C "$out" --exclude=sockets --exclude=ptrtable --exclude=allocattrs --exclude='*.trace.json*' . 2>/dev/null
exit $status
