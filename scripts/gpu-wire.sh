#!/usr/bin/env bash
# The migration's transport on a GPU machine's host (both ends on it, over loopback): the
# criterion bench `sequence/benches/wire.rs`, a directory of DIR_MIB MiB (default 4096) on
# WIRE_DIR (default /dev/shm; a huge-page tmpfs is what migrations' images sit on in the bars'
# runs) sent over 4, 8, 12 and 16 streams (WIRE_STREAMS), authenticated, unpaced, then paced
# (WIRE_FILTER, a regex of the benches' names, picks some).
# Builds nothing: carry .gpu with the bench's binary, staged here by
#   cargo bench -p possum-sequence --bench wire --no-run
#   cp target/release/deps/wire-<hash> .gpu/wire-bench && strip .gpu/wire-bench
#   bash scripts/gpu-wire.sh [BENCH...]   (~2 min a binary; default .gpu/wire-bench)
#       -> $OUT/wire-bench.txt (criterion's lines: time and throughput per stream count, and
#          each paced send's rate against the rate asked, under each binary's name: several
#          builds compared in one run)
# Without a GPU it says SKIPPED and exits 0 (it measures the GPU machine's host, not the GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
out="${OUT:-.gpu/out}"; mkdir -p "$out"
dir="${WIRE_DIR:-/dev/shm}"
echo "cores: $(nproc)" > "$out/wire-bench.txt"
for bench in "${@:-.gpu/wire-bench}"; do
    [ -x "$bench" ] || { echo "no $bench: stage it (see the top of this script)"; exit 1; }
    echo "== $bench" | tee -a "$out/wire-bench.txt"
    POSSUM_BENCH_DIR="$dir" POSSUM_BENCH_MIB="${DIR_MIB:-4096}" \
        POSSUM_BENCH_STREAMS="${WIRE_STREAMS:-4,8,12,16}" \
        timeout -k 5 "${WIRE_TIMEOUT_S:-240}" "$bench" --bench "${WIRE_FILTER:-loopback}" \
        --warm-up-time 1 --measurement-time 4 2>&1 \
        | grep -E "^loopback|time:|thrpt:|paced:" | tee -a "$out/wire-bench.txt"
    rm -rf "$dir"/possum-wire-bench-*
done
exit 0
