#!/usr/bin/env bash
# Device memory into an image's data file on a tmpfs, by possum's staged route (pinned staging,
# writer threads pwrite()ing) and by a registered one (the file mapped and registered with the
# driver, the GPU copying straight into its pages, each chunk then read once as the fingerprint
# pass would): the rate of each, and what the registered route costs off the copy's path (map and
# populate, register, unregister, unmap). Decides whether a held copy should land in the file
# directly. Builds scripts/gpu/registered_copy.cpp with nvcc; needs nothing of possum.
#   bash scripts/gpu-registered-copy.sh [GIB] [WRITERS...]   (~1.5 min; default 8 GiB, 6 and 16)
#       on /dev/shm and on a tmpfs mounted with huge=always -> $OUT/registered-copy.jsonl
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
gpu_libraries
out="${OUT:-.gpu/out}"; mkdir -p "$out"
gib=${1:-8}; shift || true
bin=/tmp/possum-registered-copy
timeout 120 nvcc -x cu -O2 -std=c++17 -o "$bin" scripts/gpu/registered_copy.cpp -lcuda || exit 1
huge=/mnt/possum-huge; mount_huge "$huge" 100g || huge=
for dir in /dev/shm $huge; do
    timeout 150 "$bin" "$dir" "$gib" "$@" | tee -a "$out/registered-copy.jsonl"
    echo "rc ${PIPESTATUS[0]} ($dir)"
done
rm -f "$bin"
