#!/usr/bin/env bash
# Diagnostic: which operations mark buffers written while a pre-copy runs,
# for the MLP holding frozen ballast (workloads/gpu/jobs.py --ballast-frozen). The job runs with
# POSSUM_DEBUG_DIRTY=1 (libpossum logs each operation that marks a buffer written that was not
# marked yet, with the slots whose words name it, and each validation's verdicts), gets a full
# `possum checkpoint --leave-running`, and the lines go to $OUT/dirty-GIB.txt with the
# checkpoint's JSON and a summary (what the release copied, the reduce kernels' read-only slots).
#   (here)  bash scripts/gpu-ckpt.sh --stage
#   (there) OUT=... GIBS="8 32" bash eval/probes/gpu-diag-dirty.sh        (~1 min for both)
# Result: eval/results/2026-11-24-h100-diag-dirty-before.txt.
set -u
source "$(dirname "$0")/probe.sh"
gpu_probe
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
source scripts/gpu-criu.sh
o="$res"
for gib in ${GIBS:-8 32}; do
  W=/dev/shm/dirty-$gib; rm -rf $W; mkdir -p $W/s
  POSSUM_DEBUG_DIRTY=1 LD_PRELOAD=$PWD/.gpu/libpossum.so POSSUM_SOCKET_DIR=$W/s python3 workloads/gpu/jobs.py mlp --steps 6000 --hold-gib $gib --ballast-frozen --log $W/log > $W/out 2> $W/err &
  pid=$!
  for i in $(seq 1 120); do [ -s $W/log ] && [ $(wc -l < $W/log) -gt 400 ] && break; sleep 1; done; wc -l $W/log
  ./.gpu/possum trace $pid --socket-dir $W/s -o $W/trace.json > /dev/null 2> $W/trace.err
  ./.gpu/possum checkpoint $pid -D $W/img --leave-running --socket-dir $W/s --json > $o/ckpt-$gib.json 2> $W/ckpt.err
  tail -3 $W/ckpt.err
  sleep 2
  ./.gpu/possum status $pid --socket-dir $W/s --json > $o/status-$gib.json 2>&1
  kill $pid; wait $pid 2>/dev/null
  grep -c "dirty:" $W/err
  grep "dirty:" $W/err > $o/dirty-$gib.txt
  grep "validation" $W/err > $o/validations-$gib.txt
  python3 - $o/ckpt-$gib.json $W/trace.json <<'PY' | tee $o/summary-$gib.txt
import json, sys, collections
c = json.load(open(sys.argv[1]))
print("figures", json.dumps(c.get("figures"))[:600])
print("release final", json.dumps(c.get("release_report", {}).get("final"))[:800])
print("engine report", json.dumps(c.get("engine_report"))[:1500])
t = json.load(open(sys.argv[2]))
ks = t.get("kernels") or []
for k in ks:
    n = (k.get("name") or "")
    if "reduce" in n.lower() or "sum" in n.lower():
        print(json.dumps(k)[:1200])
PY
  rm -rf $W/img
done
