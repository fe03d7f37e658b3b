#!/usr/bin/env bash
# AMD checks, run from the repo root on a machine with ROCm and an AMD GPU:
#   bash scripts/amd-check.sh
# 1. the HIP backend's tests (hip/tests/device.rs) on the real HIP runtime, through
#    POSSUM_HIP_RUNTIME (tests that need the simulated runtime's hooks say SKIPPED there);
# 2. the analyzer's AMDGPU code-object tests;
# 3. `possum doctor`, whose "gpu runtimes" line must name the HIP runtime found (its other
#    checks are shown, not judged: a ROCm machine usually has no libcuda).
# The runtime is $POSSUM_HIP_RUNTIME if set, else /opt/rocm/lib/libamdhip64.so; a GPU is one that
# `rocminfo` lists (gfx*). Without them it prints "SKIPPED: no ROCm runtime/AMD GPU" and exits 0.
# Exit status: 0 when every check passed (or skipped), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
runtime="${POSSUM_HIP_RUNTIME:-/opt/rocm/lib/libamdhip64.so}"
rocminfo=$(command -v rocminfo || echo /opt/rocm/bin/rocminfo)
gpus=$("$rocminfo" 2>/dev/null | grep -oE '^ *Name: +gfx[0-9a-f]+' | awk '{print $2}' | sort -u | tr '\n' ' ')
if [ ! -e "$runtime" ] || [ -z "$gpus" ]; then
    echo "SKIPPED: no ROCm runtime/AMD GPU (runtime $runtime: $([ -e "$runtime" ] && echo found || echo missing); GPUs: ${gpus:-none})"
    exit 0
fi
echo "== HIP runtime $runtime; GPUs: $gpus"
status=0
step() {
    echo "== $1"
    shift
    "$@" || { echo "== FAILED: $*"; status=1; }
}
export CARGO_INCREMENTAL=0
step "HIP backend on the real runtime" \
    env POSSUM_HIP_RUNTIME="$runtime" cargo test -p possum-hip --test device --test priority --test nodev
step "analyzer: AMDGPU code objects" cargo test -p possum-analyzer --test amdgpu_code_object
echo "== possum doctor"
doctor=$(LD_LIBRARY_PATH="$(dirname "$runtime")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo run -q -p possum -- doctor 2>&1)
echo "$doctor"
if ! grep -q "libamdhip64 /" <<<"$doctor"; then
    echo "== FAILED: possum doctor's \"gpu runtimes\" does not name the HIP runtime"
    status=1
fi
exit $status
