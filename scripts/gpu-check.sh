#!/usr/bin/env bash
# GPU checks, run on the GPU machine from the repo root, with the build carried in .gpu/:
#   cargo build --release -p possum-cuda -p possum --bins --examples && bash scripts/gpu-check.sh --stage   (here)
#   bash scripts/gpu-check.sh                                                             (there)
# Results go to $OUT (or .gpu/out) as logs and JSON. Without a GPU every check says SKIPPED.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--stage" ]; then
    mkdir -p .gpu
    for b in possum-cuda-selftest examples/possum-cuda-engine-check possum; do
        [ -x "target/release/$b" ] && cp "target/release/$b" .gpu/ && strip ".gpu/${b##*/}"
    done
    ls -la .gpu
    exit 0
fi
out="${OUT:-.gpu/out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
status=0
run() {
    local name=$1; shift
    echo "== $name: $*"
    "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$out/$name.log"
    grep '^{' "$out/$name.log" | tail -n 1 > "$out/$name.json"
    echo "== $name: exit $rc"
    [ $rc -eq 0 ] || status=1
}
[ -x .gpu/possum-cuda-selftest ] && run selftest .gpu/possum-cuda-selftest
if [ -x .gpu/possum-cuda-engine-check ]; then
    # Staging: 16 x 32 MiB (bounded) against 256 x 32 MiB = 8 GiB pinned (capture at PCIe speed).
    run engine-4g-memory .gpu/possum-cuda-engine-check --gib 4
    run engine-4g-memory-stage8g .gpu/possum-cuda-engine-check --gib 4 --staging 256 --restore-threads 6
    run engine-4g-disk-stage8g .gpu/possum-cuda-engine-check --gib 4 --staging 256 --restore-threads 6 --disk /tmp/possum-image-4g
    rm -rf /tmp/possum-image-4g
    run engine-16g-memory-stage8g .gpu/possum-cuda-engine-check --gib 16 --buffers 64 --staging 256 --restore-threads 6
    run engine-16g-shadow-stage8g .gpu/possum-cuda-engine-check --gib 16 --buffers 64 --staging 256 --restore-threads 6 --shadow-gib 4
fi
exit $status
