/* A "GPU job" for the fake driver, runtime and CUPTI: it allocates through cudaMalloc (served by
 * libpossum), and "launches" kernels by firing CUPTI's entry and exit callbacks around host code
 * that does what the kernel would (device memory is host memory under the fake driver):
 *   axpy(const float *x, float *y)        reads x, writes y (3 launches)
 *   bump_table(float *const *table)       writes through a table of pointers (3 launches)
 *   scale(struct { const float *in; float *out; long n; })   pointers inside a by-value struct
 * plus one device-to-device copy. Prints "ok" and exits 0, or says what failed. Other modes:
 * `bench N`, `bench-entry N` and `fill`, below. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_abi.h"

static struct fake_kernel axpy = {FAKE_KERNEL_MAGIC, "axpy", 2, {0, 8}, {8, 8}};
static struct fake_kernel bump = {FAKE_KERNEL_MAGIC, "bump_table", 1, {0}, {8}};
static struct fake_kernel scale = {FAKE_KERNEL_MAGIC, "scale", 1, {0}, {24}};

/* `fake_job bench N`: N launches of each of four kernels shaped like PyTorch's (an elementwise
 * kernel with 2 pointers, a GEMM-like one with a 736-byte by-value struct, a multi-tensor-apply-like
 * one with a 3 KiB by-value struct, a fill with one pointer), cycling over 8 buffer sets, for timing
 * possum's launch path. */
static struct fake_kernel gemm = {FAKE_KERNEL_MAGIC, "gemm_like", 1, {0}, {736}};
static struct fake_kernel mta = {FAKE_KERNEL_MAGIC, "multi_tensor_apply_like", 1, {0}, {3200}};
static struct fake_kernel fill1 = {FAKE_KERNEL_MAGIC, "fill_like", 1, {0}, {8}};
/* `fake_job bench-entry N`: the same launches made through the driver's cuLaunchKernel, looked up
 * by name as a caller linked against libcuda finds it (possum's, under LD_PRELOAD: its default
 * entry-point hooks see them), without CUPTI. */
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         void *, void **, void **);
static launch_fn cu_launch;
static void fire_entry(uint32_t cbid, int site, const void *params, void *ret) {
    const launch_params *p = params;
    (void)cbid;
    if (site == 0)
        *(int *)ret = cu_launch(p->f, p->g[0], p->g[1], p->g[2], p->g[3], p->g[4], p->g[5], p->shmem,
                                     p->stream, p->params, p->extra);
}
static int bench(fire_fn fire, long iters) {
    /* FAKE_JOB_SETS buffer sets (default 8, at most 32) cycled over, like one kernel launched
     * once per layer of a model. */
    int sets = getenv("FAKE_JOB_SETS") ? atoi(getenv("FAKE_JOB_SETS")) : 8;
    if (sets < 1 || sets > 32) return 1;
    float *bufs[64];
    for (int i = 0; i < 2 * sets; i++) if (cudaMalloc((void **)&bufs[i], 1 << 20)) return 1;
    uint64_t gemm_args[92], mta_args[400];
    /* The non-pointer words of two kernels change every launch (a step count, a seed): one launch
     * in three differs in its words. */
    int miss = getenv("FAKE_JOB_MISS") != NULL;
    /* FAKE_JOB_POLLUTE=KiB: that much memory written between launches, as a framework's own work
     * would, so possum's data is no longer in the caches when the next launch comes. */
    size_t pollute = getenv("FAKE_JOB_POLLUTE") ? (size_t)atol(getenv("FAKE_JOB_POLLUTE")) << 10 : 0;
    char *junk = pollute ? malloc(pollute) : NULL;
#define POLLUTE() do { if (junk) memset(junk, (int)it, pollute); } while (0)
    int ret = 0;
    for (long it = 0; it < iters && !ret; it++) {
        int k = it % sets;
        void *args[] = {&bufs[k], &bufs[k + sets]};
        launch_params p = {&axpy, {1, 1, 1, 1, 1, 1}, 0, NULL, args, NULL};
        POLLUTE();
        fire(307, 0, &p, &ret);
        fire(307, 1, &p, &ret);
        for (int w = 0; w < 92; w++) gemm_args[w] = w < 3 ? (uint64_t)(uintptr_t)bufs[(k + w) % (2 * sets)] : (uint64_t)(w * 64 + k);
        if (miss) gemm_args[50] = (uint64_t)it, mta_args[300] = (uint64_t)it;
        void *gargs[] = {gemm_args};
        launch_params g = {&gemm, {1, 1, 1, 1, 1, 1}, 0, NULL, gargs, NULL};
        POLLUTE();
        fire(307, 0, &g, &ret);
        fire(307, 1, &g, &ret);
        for (int w = 0; w < 400; w++) mta_args[w] = w < 24 ? (uint64_t)(uintptr_t)bufs[(k + w) % (2 * sets)] + 256 * w : (uint64_t)(w * 3 + k) | ((uint64_t)(w & 7) << 32);
        void *margs[] = {mta_args};
        launch_params m = {&mta, {1, 1, 1, 1, 1, 1}, 0, NULL, margs, NULL};
        POLLUTE();
        fire(307, 0, &m, &ret);
        fire(307, 1, &m, &ret);
        /* A kernel with one pointer and nothing else (a fill): its sets differ in one word. */
        void *fargs[] = {&bufs[k]};
        launch_params f1 = {&fill1, {1, 1, 1, 1, 1, 1}, 0, NULL, fargs, NULL};
        POLLUTE();
        fire(307, 0, &f1, &ret);
        fire(307, 1, &f1, &ret);
    }
    free(junk);
    if (ret) { printf("launch failed: %d\n", ret); return 1; }
    puts("ok");
    return 0;
}

/* `fake_job fill`: read-only speculation must not be earned from writes of a constant.
 *   fill_zero(float *p)     6 launches on a 1 MiB buffer of zeros: launches 0-3 write zeros (no
 *                           visible change), launches 4-5 write 1.0f (a change nobody validates)
 *   fill_ff(float *p)       6 launches on a 4 KiB buffer of 0xff bytes writing 0xff bytes
 *   sum_read(const float *in)  6 launches on a 1 MiB buffer of distinct floats, only read
 * Run with POSSUM_VALIDATE=first=4: the fills' slots stay read-write (no evidence), sum_read's
 * slot becomes read-only after its second validated launch. */
static struct fake_kernel fill_zero = {FAKE_KERNEL_MAGIC, "fill_zero", 1, {0}, {8}};
static struct fake_kernel fill_ff = {FAKE_KERNEL_MAGIC, "fill_ff", 1, {0}, {8}};
static struct fake_kernel sum_read = {FAKE_KERNEL_MAGIC, "sum_read", 1, {0}, {8}};
static int fill(fire_fn fire) {
    const size_t n = 1 << 20, m = 4096;
    float *zeros, *ffs, *data;
    if (cudaMalloc((void **)&zeros, n) || cudaMalloc((void **)&ffs, m) || cudaMalloc((void **)&data, n)) {
        puts("cudaMalloc failed");
        return 1;
    }
    memset(zeros, 0, n);
    memset(ffs, 0xff, m);
    for (size_t i = 0; i < n / 4; i++) data[i] = (float)i;
    int ret = 0;
    volatile float sink = 0;
    for (int s = 0; s < 6; s++) {
        void *args[] = {&zeros};
        launch_params p = {&fill_zero, {1, 1, 1, 1, 1, 1}, 0, NULL, args, NULL};
        fire(307, 0, &p, &ret);
        for (size_t i = 0; i < n / 4; i++) zeros[i] = s < 4 ? 0.0f : 1.0f;
        fire(307, 1, &p, &ret);
    }
    for (int s = 0; s < 6; s++) {
        void *args[] = {&ffs};
        launch_params p = {&fill_ff, {1, 1, 1, 1, 1, 1}, 0, NULL, args, NULL};
        fire(307, 0, &p, &ret);
        memset(ffs, 0xff, m);
        fire(307, 1, &p, &ret);
    }
    for (int s = 0; s < 6; s++) {
        void *args[] = {&data};
        launch_params p = {&sum_read, {1, 1, 1, 1, 1, 1}, 0, NULL, args, NULL};
        fire(307, 0, &p, &ret);
        float acc = 0;
        for (size_t i = 0; i < n / 4; i++) acc += data[i];
        sink += acc;
        fire(307, 1, &p, &ret);
    }
    if (zeros[0] != 1.0f) { puts("fill_zero did not fill"); return 1; }
    if (cudaFree(zeros) || cudaFree(ffs) || cudaFree(data)) { puts("cudaFree failed"); return 1; }
    puts("ok");
    return 0;
}

/* `fake_job shared`: a reduction whose input and output sit in one allocation (as in a segment of
 * PyTorch's caching allocator): reduce_shared(const float *in, float *out) with `in` the first half
 * of a 1 MiB buffer of distinct floats and `out` its second half, 4 launches, each writing the whole
 * second half; then reduce_small(in, out) with a 4 KiB input and its output right after it, as
 * small tensors sit in a segment. Both input slots must earn read-only (their own windows, cut at
 * the output's address, never change) and the output slots must not. Run with
 * POSSUM_VALIDATE=first=4. */
static struct fake_kernel reduce_small = {FAKE_KERNEL_MAGIC, "reduce_small", 2, {0, 8}, {8, 8}};
static struct fake_kernel reduce_shared = {FAKE_KERNEL_MAGIC, "reduce_shared", 2, {0, 8}, {8, 8}};
static int shared(fire_fn fire) {
    const size_t n = 1 << 20, half = n / 2 / 4;
    float *buf;
    if (cudaMalloc((void **)&buf, n)) { puts("cudaMalloc failed"); return 1; }
    for (size_t i = 0; i < half; i++) buf[i] = (float)i * 0.5f + 1.0f;
    float *in = buf, *out = buf + half;
    int ret = 0;
    for (int s = 0; s < 4; s++) {
        void *args[] = {&in, &out};
        launch_params p = {&reduce_shared, {1, 1, 1, 1, 1, 1}, 0, NULL, args, NULL};
        fire(307, 0, &p, &ret);
        for (size_t i = 0; i < half; i++) out[i] = in[i] * (float)(s + 2);
        fire(307, 1, &p, &ret);
    }
    if (out[1] != in[1] * 5.0f) { puts("reduce_shared did not write"); return 1; }
    float *small_in = buf, *small_out = buf + 1024;
    for (int s = 0; s < 4; s++) {
        void *args[] = {&small_in, &small_out};
        launch_params p = {&reduce_small, {1, 1, 1, 1, 1, 1}, 0, NULL, args, NULL};
        fire(307, 0, &p, &ret);
        float acc = 0;
        for (size_t i = 0; i < 1024; i++) acc += small_in[i];
        for (size_t i = 0; i < 64; i++) small_out[i] = acc + (float)(s * 64 + i);
        fire(307, 1, &p, &ret);
    }
    if (cudaFree(buf)) { puts("cudaFree failed"); return 1; }
    puts("ok");
    return 0;
}

/* `module CUBIN [late]`: a module is loaded (CUBIN's bytes, then bytes that are no cubin), and a
 * kernel of it the driver cannot describe, k1(int, float *, struct { float *, int, double * },
 * char, float *) (tests/data/params.cu of the analyzer), is launched 3 times: reads its second
 * pointer, writes its last. With `late`, it is launched once more before the module is loaded
 * (as under lazy loading, which loads a module inside its first kernel's launch). */
static struct fake_kernel k1 = {FAKE_KERNEL_MAGIC, "_Z2k1iPf1ScS_", -1, {0}, {0}};
static void launch_k1(fire_fn fire, int count, float *a, void *s, char c, float *b, int k) {
    int ret = 0;
    void *args[] = {&count, &a, s, &c, &b};
    launch_params p = {&k1, {1, 1, 1, 1, 1, 1}, 0, NULL, args, NULL};
    fire(307, 0, &p, &ret);
    for (int i = 0; i < count; i++) b[i] = a[i] + (float)k;
    fire(307, 1, &p, &ret);
}

static int module(fire_fn fire, void *h, const char *path, int late) {
    void (*fire_module)(const void *, size_t) = (void (*)(const void *, size_t))dlsym(h, "fake_cupti_fire_module");
    FILE *f = fopen(path, "rb");
    static char image[1 << 20];
    size_t size = f ? fread(image, 1, sizeof image, f) : 0;
    if (!fire_module || !size) { puts("no module to load"); return 1; }
    fclose(f);
    const size_t n = 1 << 16;
    float *a, *b;
    double *d;
    if (cudaMalloc((void **)&a, n) || cudaMalloc((void **)&b, n) || cudaMalloc((void **)&d, n)) {
        puts("cudaMalloc failed"); return 1;
    }
    for (size_t i = 0; i < n / 4; i++) a[i] = (float)i;
    int count = (int)(n / 4);
    struct { float *p; int i; double *q; } s = {a, 7, d};
    if (late) launch_k1(fire, count, a, &s, 'c', b, -1);
    fire_module(image, size);
    fire_module("not a cubin", 11);
    for (int k = 0; k < 3; k++) launch_k1(fire, count, a, &s, 'c', b, k);
    if (cudaFree(a) || cudaFree(b) || cudaFree(d)) { puts("cudaFree failed"); return 1; }
    puts("ok");
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 2 && !strcmp(argv[1], "bench-entry")) {
        cu_launch = (launch_fn)dlsym(RTLD_DEFAULT, "cuLaunchKernel");
        if (!cu_launch) { puts("no cuLaunchKernel"); return 1; }
        return bench(fire_entry, atol(argv[2]));
    }
    void *h = dlopen(getenv("POSSUM_CUPTI"), RTLD_NOW | RTLD_NOLOAD);
    fire_fn fire = h ? (fire_fn)dlsym(h, "fake_cupti_fire") : NULL;
    if (!fire) { puts("no fake CUPTI loaded"); return 1; }
    if (argc > 2 && !strcmp(argv[1], "module"))
        return module(fire, h, argv[2], argc > 3 && !strcmp(argv[3], "late"));
    if (argc > 2 && !strcmp(argv[1], "bench")) return bench(fire, atol(argv[2]));
    if (argc > 1 && !strcmp(argv[1], "fill")) return fill(fire);
    if (argc > 1 && !strcmp(argv[1], "shared")) return shared(fire);
    const size_t n = 1 << 20;
    float *x, *y, *z;
    void **table;
    if (cudaMalloc((void **)&x, n) || cudaMalloc((void **)&y, n) || cudaMalloc((void **)&z, n) ||
        cudaMalloc((void **)&table, 4096)) { puts("cudaMalloc failed"); return 1; }
    for (size_t i = 0; i < n / 4; i++) x[i] = (float)i;
    table[0] = z;
    int ret = 0;
    for (int s = 0; s < 3; s++) {
        void *args[] = {&x, &y};
        launch_params p = {&axpy, {1, 1, 1, 1, 1, 1}, 0, NULL, args, NULL};
        fire(307, 0, &p, &ret);
        for (size_t i = 0; i < n / 4; i++) y[i] = 2 * x[i] + s;
        fire(307, 1, &p, &ret);
    }
    for (int s = 0; s < 3; s++) {
        void *args[] = {&table};
        launch_params p = {&bump, {1, 1, 1, 1, 1, 1}, 0, NULL, args, NULL};
        fire(307, 0, &p, &ret);
        float *t = table[0];
        for (size_t i = 0; i < n / 4; i++) t[i] += 1.0f;
        fire(307, 1, &p, &ret);
    }
    struct { const float *in; float *out; long n; } sa = {y, z, (long)(n / 4)};
    for (int s = 0; s < 2; s++) {
        void *args[] = {&sa};
        launch_params p = {&scale, {1, 1, 1, 1, 1, 1}, 0, NULL, args, NULL};
        fire(307, 0, &p, &ret);
        for (size_t i = 0; i < n / 4; i++) z[i] = y[i] * 0.5f;
        fire(307, 1, &p, &ret);
    }
    /* cuMemcpyDtoDAsync_v2(dst, src, bytes, stream) */
    uint64_t copy[4] = {(uint64_t)(uintptr_t)x, (uint64_t)(uintptr_t)z, n, 0};
    fire(281, 0, copy, &ret);
    memcpy(x, z, n);
    fire(281, 1, copy, &ret);
    if (cudaFree(x) || cudaFree(y) || cudaFree(z) || cudaFree(table)) { puts("cudaFree failed"); return 1; }
    puts("ok");
    return 0;
}
