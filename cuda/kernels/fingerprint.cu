// possum's chunk fingerprint kernel (the definition: engine/src/fingerprint.rs).
//
// Built into fingerprint.ptx by scripts/gpu-fingerprint.sh (`nvcc -ptx -arch=compute_75`) and
// shipped inside libpossum.so, where the driver compiles it for the GPU at hand: no CUDA
// toolkit is needed on the user's machine.
//
// One launch fingerprints the chunks [first, first + gridDim.y) of a range of `len` bytes at
// `base` (16-byte aligned, `chunk` a multiple of 16): block (x, y) sums its share of chunk
// first + y and adds the two lanes into out[2 * y] and out[2 * y + 1], which the caller zeroes.
// Sums commute, so the result does not depend on the grid's shape.
#include <stdint.h>

#define M0 0x9E3779B1u
#define A0 0x7F4A7C15u
#define M1 0x85EBCA77u
#define A1 0x165667B1u
#define M2 0xC2B2AE3Du
#define A2 0x27D4EB2Fu
#define M3 0x165667B1u
#define A3 0x9E3779B9u

__device__ __forceinline__ void possum_pair(uint32_t a, uint32_t b, uint32_t j,
                                            unsigned long long &lo, unsigned long long &hi)
{
    lo += (unsigned long long)(a + j * M0 + A0) * (unsigned long long)(b + j * M1 + A1);
    hi += (unsigned long long)(a + j * M2 + A2) * (unsigned long long)(b + j * M3 + A3);
}

extern "C" __global__ void possum_fingerprint(const uint8_t *__restrict__ base,
                                              unsigned long long len,
                                              unsigned long long chunk,
                                              unsigned long long first,
                                              unsigned long long *__restrict__ out)
{
    unsigned long long c = first + blockIdx.y;
    unsigned long long start = c * chunk;
    if (start >= len)
        return;
    unsigned long long n = len - start < chunk ? len - start : chunk;
    const uint8_t *p = base + start;
    unsigned long long quads = n / 16;
    unsigned long long lo = 0, hi = 0;
    const uint4 *q4 = (const uint4 *)p;
    for (unsigned long long q = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         q < quads; q += (unsigned long long)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(q4 + q);
        uint32_t j = (uint32_t)(q * 2);
        possum_pair(v.x, v.y, j, lo, hi);
        possum_pair(v.z, v.w, j + 1, lo, hi);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        // The bytes after the last whole 16: at most two pairs, zero-padded.
        for (unsigned long long off = quads * 16; off < n; off += 8) {
            uint32_t w[2] = {0, 0};
            for (unsigned long long i = 0; i < 8 && off + i < n; i++)
                w[i / 4] |= (uint32_t)p[off + i] << (8 * (i % 4));
            possum_pair(w[0], w[1], (uint32_t)(off / 8), lo, hi);
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        lo += __shfl_down_sync(0xffffffffu, lo, o);
        hi += __shfl_down_sync(0xffffffffu, hi, o);
    }
    __shared__ unsigned long long s_lo[32], s_hi[32];
    unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) {
        s_lo[warp] = lo;
        s_hi[warp] = hi;
    }
    __syncthreads();
    if (warp == 0) {
        unsigned warps = (blockDim.x + 31) / 32;
        lo = lane < warps ? s_lo[lane] : 0;
        hi = lane < warps ? s_hi[lane] : 0;
        for (int o = 16; o > 0; o >>= 1) {
            lo += __shfl_down_sync(0xffffffffu, lo, o);
            hi += __shfl_down_sync(0xffffffffu, hi, o);
        }
        if (lane == 0) {
            atomicAdd(out + 2 * blockIdx.y, lo);
            atomicAdd(out + 2 * blockIdx.y + 1, hi);
        }
    }
}
