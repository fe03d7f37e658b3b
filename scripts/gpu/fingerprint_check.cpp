// Checks the fingerprint kernel (cuda/kernels/fingerprint.ptx, loaded through the driver as
// libpossum.so loads it) against the definition (engine/src/fingerprint.rs, restated below on
// the CPU) and times it over 32 GiB. Run by scripts/gpu-fingerprint.sh; prints one JSON line.
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_ = 0; \
    cuGetErrorString(r_, &s_); fprintf(stderr, "%s: %s\n", #x, s_ ? s_ : "?"); exit(1); } } while (0)

static const uint32_t K[4][2] = {{0x9E3779B1u, 0x7F4A7C15u}, {0x85EBCA77u, 0x165667B1u},
                                 {0xC2B2AE3Du, 0x27D4EB2Fu}, {0x165667B1u, 0x9E3779B9u}};

static void cpu_sums(const uint8_t *p, uint64_t n, uint64_t *lo, uint64_t *hi) {
    uint64_t l = 0, h = 0;
    for (uint64_t off = 0, j = 0; off < n; off += 8, j++) {
        uint8_t b[8] = {0};
        memcpy(b, p + off, n - off < 8 ? n - off : 8);
        uint32_t a, c;
        memcpy(&a, b, 4);
        memcpy(&c, b + 4, 4);
        uint32_t jj = (uint32_t)j;
        l += (uint64_t)(a + jj * K[0][0] + K[0][1]) * (uint64_t)(c + jj * K[1][0] + K[1][1]);
        h += (uint64_t)(a + jj * K[2][0] + K[2][1]) * (uint64_t)(c + jj * K[3][0] + K[3][1]);
    }
    *lo = l;
    *hi = h;
}

static CUfunction fn;

static void gpu_sums(CUdeviceptr base, uint64_t len, uint64_t chunk, CUdeviceptr out,
                     unsigned threads, unsigned per_thread, CUstream s) {
    uint64_t nchunks = (len + chunk - 1) / chunk;
    CK(cuMemsetD8Async(out, 0, nchunks * 16, s));
    uint64_t quads = chunk / 16;
    uint64_t bx = (quads + (uint64_t)threads * per_thread - 1) / ((uint64_t)threads * per_thread);
    if (bx == 0) bx = 1;
    for (uint64_t first = 0; first < nchunks; first += 65535) {
        uint64_t ny = nchunks - first < 65535 ? nchunks - first : 65535;
        CUdeviceptr o = out + first * 16;
        void *args[] = {&base, &len, &chunk, &first, &o};
        CK(cuLaunchKernel(fn, (unsigned)bx, (unsigned)ny, 1, threads, 1, 1, 0, s, args, 0));
    }
}

int main(int argc, char **argv) {
    const char *ptx_path = argc > 1 ? argv[1] : "fingerprint.ptx";
    double gib = argc > 2 ? atof(argv[2]) : 32.0;
    FILE *f = fopen(ptx_path, "rb");
    if (!f) { perror(ptx_path); return 1; }
    std::string ptx;
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) ptx.append(buf, n);
    fclose(f);
    CK(cuInit(0));
    CUdevice dev;
    CK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    CUmodule mod;
    CK(cuModuleLoadData(&mod, ptx.c_str()));
    CK(cuModuleGetFunction(&fn, mod, "possum_fingerprint"));
    CUstream s;
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUdeviceptr out;
    CK(cuMemAlloc(&out, 16 * 70000));
    int failures = 0;
    // 1. The pinned value.
    {
        std::vector<uint8_t> v(4000);
        for (uint32_t i = 0; i < 1000; i++) { uint32_t w = i * 2654435761u; memcpy(&v[4 * i], &w, 4); }
        CUdeviceptr d;
        CK(cuMemAlloc(&d, 4096));
        CK(cuMemcpyHtoD(d, v.data(), 4000));
        gpu_sums(d, 4000, 4000, out, 256, 4, s);
        uint64_t r[2];
        CK(cuStreamSynchronize(s));
        CK(cuMemcpyDtoH(r, out, 16));
        bool ok = r[0] == 13331409359518974148ull && r[1] == 12599444614477953344ull;
        if (!ok) failures++;
        fprintf(stderr, "# pinned value: %s (%llu %llu)\n", ok ? "ok" : "WRONG", (unsigned long long)r[0], (unsigned long long)r[1]);
        CK(cuMemFree(d));
    }
    // 2. Random bytes, odd lengths and chunk sizes, against the CPU.
    {
        uint64_t len = (64ull << 20) + 13;
        std::vector<uint8_t> v(len);
        uint64_t x = 88172645463325252ull;
        for (auto &b : v) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; b = (uint8_t)x; }
        CUdeviceptr d;
        CK(cuMemAlloc(&d, len + 64));
        CK(cuMemcpyHtoD(d, v.data(), len));
        uint64_t chunks[] = {2ull << 20, 8ull << 20, 4096, 1ull << 30};
        uint64_t lens[] = {len, len - 13, 4096 * 3 + 5, 100};
        for (uint64_t ch : chunks)
            for (uint64_t L : lens)
                for (unsigned pt : {1u, 4u, 64u}) {
                    uint64_t nc = (L + ch - 1) / ch;
                    gpu_sums(d, L, ch, out, 256, pt, s);
                    std::vector<uint64_t> r(2 * nc);
                    CK(cuStreamSynchronize(s));
                    CK(cuMemcpyDtoH(r.data(), out, 16 * nc));
                    for (uint64_t c = 0; c < nc; c++) {
                        uint64_t lo, hi, st = c * ch, m = L - st < ch ? L - st : ch;
                        cpu_sums(v.data() + st, m, &lo, &hi);
                        if (lo != r[2 * c] || hi != r[2 * c + 1]) {
                            failures++;
                            fprintf(stderr, "# MISMATCH chunk %llu len %llu chunk %llu per_thread %u\n",
                                   (unsigned long long)c, (unsigned long long)L, (unsigned long long)ch, pt);
                        }
                    }
                }
        CK(cuMemFree(d));
        fprintf(stderr, "# random bytes against the CPU: %d failures\n", failures);
    }
    // 3. Time over `gib` GiB.
    uint64_t big = (uint64_t)(gib * (1ull << 30));
    CUdeviceptr d;
    CK(cuMemAlloc(&d, big));
    CK(cuMemsetD32(d, 0x3c003c00u, big / 4));
    CUevent e0, e1;
    CK(cuEventCreate(&e0, 0));
    CK(cuEventCreate(&e1, 0));
    printf("{\"gib\": %.1f, \"failures\": %d, \"runs\": [", gib, failures);
    bool first_run = true;
    for (uint64_t ch : {2ull << 20, 8ull << 20})
        for (unsigned threads : {256u, 512u})
            for (unsigned pt : {4u, 16u, 64u}) {
                float best = 1e9;
                for (int rep = 0; rep < 5; rep++) {
                    CK(cuEventRecord(e0, s));
                    gpu_sums(d, big, ch, out, threads, pt, s);
                    CK(cuEventRecord(e1, s));
                    CK(cuEventSynchronize(e1));
                    float ms;
                    CK(cuEventElapsedTime(&ms, e0, e1));
                    if (ms < best) best = ms;
                }
                printf("%s{\"chunk_mib\": %llu, \"threads\": %u, \"per_thread\": %u, \"ms\": %.3f, \"gb_s\": %.0f}",
                       first_run ? "" : ", ", (unsigned long long)(ch >> 20), threads, pt, best,
                       big / best / 1e6);
                first_run = false;
            }
    // A device-to-device copy of the same bytes, for the bandwidth the card gives.
    {
        uint64_t half = big / 2;
        float best = 1e9;
        for (int rep = 0; rep < 3; rep++) {
            CK(cuEventRecord(e0, s));
            CK(cuMemcpyDtoDAsync(d + half, d, half, s));
            CK(cuEventRecord(e1, s));
            CK(cuEventSynchronize(e1));
            float ms;
            CK(cuEventElapsedTime(&ms, e0, e1));
            if (ms < best) best = ms;
        }
        printf("], \"d2d_copy_read_plus_write_gb_s\": %.0f}\n", 2.0 * half / best / 1e6);
    }
    return failures ? 2 : 0;
}
