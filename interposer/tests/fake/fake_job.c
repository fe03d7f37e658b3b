/* A "GPU job" for the fake driver, runtime and CUPTI: it allocates through cudaMalloc (served by
 * libpossum), and "launches" kernels by firing CUPTI's entry and exit callbacks around host code
 * that does what the kernel would (device memory is host memory under the fake driver):
 *   axpy(const float *x, float *y)        reads x, writes y (3 launches)
 *   bump_table(float *const *table)       writes through a table of pointers (3 launches)
 *   scale(struct { const float *in; float *out; long n; })   pointers inside a by-value struct
 * plus one device-to-device copy. Prints "ok" and exits 0, or says what failed. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cudaMalloc(void **, size_t);
int cudaFree(void *);

#define FAKE_KERNEL_MAGIC 0x6b65726e656c2121ull
struct fake_kernel { uint64_t magic; const char *name; int n; size_t off[8]; size_t size[8]; };
typedef struct { void *f; unsigned g[6]; unsigned shmem; void *stream; void **params; void **extra; } launch_params;
typedef void (*fire_fn)(uint32_t cbid, int site, const void *params, void *ret);

static struct fake_kernel axpy = {FAKE_KERNEL_MAGIC, "axpy", 2, {0, 8}, {8, 8}};
static struct fake_kernel bump = {FAKE_KERNEL_MAGIC, "bump_table", 1, {0}, {8}};
static struct fake_kernel scale = {FAKE_KERNEL_MAGIC, "scale", 1, {0}, {24}};

int main(void) {
    void *h = dlopen(getenv("POSSUM_CUPTI"), RTLD_NOW | RTLD_NOLOAD);
    fire_fn fire = h ? (fire_fn)dlsym(h, "fake_cupti_fire") : NULL;
    if (!fire) { puts("no fake CUPTI loaded"); return 1; }
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
