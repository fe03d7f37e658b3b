#!/usr/bin/env bash
# The interposer's launch path timed without a GPU: builds the fake driver
# (cuda/testdata/fake-libcuda.c), fake libcudart and fake CUPTI, and runs
# interposer/tests/fake/fake_job.c's `bench` mode (three kernels shaped like PyTorch's: 2, 92 and
# 400 pointer slots), printing the time spent in possum's callbacks per launch (sampled 1 in 16,
# as on the GPU) with every launch resolved, in the default sampling, with none resolved (no
# checkpoint open), without the DAG, and watching only; then with one launch in three missing the
# per-kernel memo (their non-pointer words change; canonical words hit), and with 24 buffer sets
# and caches made cold between launches. Instruction counts, repeatable on any machine:
#   VALGRIND=1 bash scripts/fake-gpu-bench.sh   (callgrind; then callgrind_annotate the output)
# ENTRY=1: the launches go through the driver's cuLaunchKernel instead (`fake_job bench-entry`),
# seen by possum's default entry-point hooks (no POSSUM_HOOKS, no CUPTI), as a GPU job's are.
# Usage: bash scripts/fake-gpu-bench.sh [LAUNCHES_PER_KERNEL]   (default 100000)
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-100000}"
d="$(mktemp -d /tmp/possum-fakebench.XXXXXX)"
cargo build --release -p possum-interposer >&2
cc -O1 -shared -fPIC -Wl,-Bsymbolic -o "$d/libcuda.so.1" cuda/testdata/fake-libcuda.c
cc -O1 -shared -fPIC -Wl,-soname,libcudart.so.13 -o "$d/libcudart.so.13" interposer/tests/fake/fake_cudart.c -L"$d" -l:libcuda.so.1
cc -O1 -shared -fPIC -o "$d/libfakecupti.so" interposer/tests/fake/fake_cupti.c
cc -O1 -o "$d/fake_job" interposer/tests/fake/fake_job.c -L"$d" -l:libcudart.so.13 -Wl,-rpath,"$d" -ldl
run() {
    local label=$1; shift
    local pre=()
    rm -f "$d/stats.json"
    [ -n "${VALGRIND:-}" ] && pre=(valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$d/callgrind.$label")
    # The job fires the fake CUPTI's callbacks: possum must listen to CUPTI (POSSUM_HOOKS=cupti);
    # with ENTRY=1 it calls cuLaunchKernel, under possum's default hooks.
    local hooks=(POSSUM_HOOKS=cupti) mode=bench
    [ -n "${ENTRY:-}" ] && hooks=() mode=bench-entry
    env "${hooks[@]}" "$@" LD_PRELOAD="$PWD/target/release/libpossum.so" LD_LIBRARY_PATH="$d" POSSUM_CUPTI="$d/libfakecupti.so" \
        FAKE_CUPTI_NO_AUTOFIRE=1 POSSUM_STATS="$d/stats.json" POSSUM_SOCKET_DIR="$d/sockets" \
        "${pre[@]}" "$d/fake_job" "$mode" "$n" > /dev/null
    python3 - "$d/stats.json" "$label" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["possum"]["counters"]
print(f"{sys.argv[2]:<28} {c['timed_launch_ns'] / max(c['timed_launches'], 1) / 1e3:6.2f} us/launch  "
      f"memo hits {100 * c['memo_hits'] / max(c['launches'], 1):5.1f}%  dag dropped {c['dag_dropped']}")
PY
}
if [ -n "${ONLY:-}" ]; then
    # One configuration: ONLY="label VAR=VALUE ...".
    run $ONLY
    exit 0
fi
run always POSSUM_RESOLVE=always
run sample X=1
run sessions POSSUM_RESOLVE=sessions
run no-dag POSSUM_DAG=0 POSSUM_RESOLVE=always
run watch-only POSSUM_DAG=0 POSSUM_MANAGE=0 POSSUM_VALIDATE=off POSSUM_RESOLVE=always
run always,1/3-memo-misses FAKE_JOB_MISS=1 POSSUM_RESOLVE=always
# 24 buffer sets per kernel, 8 MiB written between launches: possum's data cold, as under a framework.
run always,24-sets,cold FAKE_JOB_SETS=24 FAKE_JOB_POLLUTE=8192 POSSUM_RESOLVE=always
run sample,24-sets,cold FAKE_JOB_SETS=24 FAKE_JOB_POLLUTE=8192
run sessions,24-sets,cold FAKE_JOB_SETS=24 FAKE_JOB_POLLUTE=8192 POSSUM_RESOLVE=sessions
echo "outputs in $d"
