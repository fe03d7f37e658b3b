#!/usr/bin/env bash
# Builds the fingerprint kernel's PTX from cuda/kernels/fingerprint.cu and checks it on the GPU:
# the bits against the definition (engine/src/fingerprint.rs) and its time over 32 GiB.
#   bash scripts/gpu-fingerprint.sh [GIB]        (on the GPU machine; needs nvcc)
# Writes $OUT/fingerprint.ptx (to be committed as cuda/kernels/fingerprint.ptx when it changed)
# and $OUT/fingerprint.json.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/possum-fingerprint}
mkdir -p "$OUT"
# compute_75: the driver compiles the PTX for any GPU from Turing on (CUDA 13 compiles for nothing older).
timeout 120 nvcc -ptx -arch=compute_75 -O3 cuda/kernels/fingerprint.cu -o "$OUT/fingerprint.ptx"
# The PTX ISA version nvcc wrote is the one its toolkit knows; the kernel needs nothing newer
# than 7.0 (CUDA 11.0), so older drivers can load it too.
sed -i 's/^\.version .*/.version 7.0/' "$OUT/fingerprint.ptx"
timeout 120 nvcc -O2 -o "$OUT/fingerprint_check" scripts/gpu/fingerprint_check.cpp -lcuda
timeout 300 "$OUT/fingerprint_check" "$OUT/fingerprint.ptx" "${1:-32}" | tee "$OUT/fingerprint.json"
rm -f "$OUT/fingerprint_check"
