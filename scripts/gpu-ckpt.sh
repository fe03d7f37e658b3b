#!/usr/bin/env bash
# Issue 4 checks on the GPU machine: checkpoint/restore of live GPU jobs, with the build and CRIU's
# packages carried in .gpu/.
#
#   (here)  bash scripts/gpu-ckpt.sh --stage        build possum + libpossum.so, download CRIU .debs
#   (there) bash scripts/gpu-ckpt.sh MODE [ARGS]    MODE: smoke | correctness | figures | errors | bench | probe
#           (ARGS go to eval/ckpt.py: --trials N --jobs a,b --gib 8,32 --reps N --engines a,b ...)
#   issue 5: bash scripts/gpu-ckpt.sh bench --engines driver,possum --reps 2   (the default plan:
#           every workload at 1 GiB, the MLP at 8 and 32 too; --bench-plan "JOB:GIB,.. ..." for others;
#           the whole matrix as three invocations: --bench-plan full --shard 1/3 (2/3, 3/3))
#   issue 4 --device (kind nvidia-h200-x2): bash scripts/gpu-ckpt.sh migrate --engines driver,possum
#   (here)  python3 eval/report.py FILES_AT/bench.json --readme README.md   (after `bench`: the
#           table, plots and README's Results section; issue 5)
# Results: $OUT (or .gpu/out)/ckpt-MODE.jsonl (bench: bench.json). Without a GPU it says SKIPPED
# and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--stage" ]; then
    cargo build --release -p possum-interposer -p possum || exit 1
    mkdir -p .gpu
    cp target/release/libpossum.so target/release/possum .gpu/
    strip .gpu/possum && strip --strip-debug .gpu/libpossum.so
    [ -d .gpu/criu-debs ] || bash scripts/install-criu.sh --download-only .gpu/criu-debs || exit 1
    du -sh .gpu/*
    exit 0
fi
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "SKIPPED: no GPU (nvidia-smi -L failed)"
    exit 0
fi
mode=${1:?usage: gpu-ckpt.sh --stage | smoke | correctness | figures | errors | bench | probe | migrate}
shift
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export POSSUM_CUPTI="${POSSUM_CUPTI:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcupti.so.13}"
prefix=/tmp/possum-criu
[ -x "$prefix/bin/criu" ] || bash scripts/install-criu.sh --from-debs .gpu/criu-debs --prefix "$prefix" > /tmp/install-criu.log 2>&1 \
    || { cat /tmp/install-criu.log; exit 1; }
export POSSUM_CRIU="$prefix/bin/criu"
export POSSUM_CKPT_WORK="${POSSUM_CKPT_WORK:-/dev/shm/possum-ckpt}"
mkdir -p "$POSSUM_CKPT_WORK"
if [ "$mode" = correctness ] && [ ! -x "$POSSUM_CKPT_WORK/ptrtable" ]; then
    nvcc -O2 -arch=sm_90 -cudart shared -o "$POSSUM_CKPT_WORK/ptrtable" workloads/gpu/ptrtable.cu || echo "nvcc ptrtable failed"
fi
"$POSSUM_CRIU" --version | head -1
python3 eval/ckpt.py "$mode" "$@"
