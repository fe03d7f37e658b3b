/* A job for the fake driver with no CUPTI and no runtime: it reaches the driver the three ways a
 * real job (or libcudart, cuBLAS, PyTorch) does, and possum must see its work through the
 * driver's entry points it wraps (tests/fake_entry.rs):
 *
 *   direct   linked against libcuda (-l:libcuda.so.1): cuMemAlloc_v2, cuMemcpyHtoD_v2,
 *            cuMemsetD32_v2, cuLaunchKernel, cuLaunchKernelEx, cuMemcpyDtoH_v2 called by name;
 *   dlsym    dlopen("libcuda.so.1") and dlsym on its handle: cuLaunchKernel,
 *            cuLaunchCooperativeKernel, cuMemcpyDtoH_v2;
 *   gpa      cuGetProcAddress_v2 (from dlsym), then through the function its self-lookup of
 *            "cuGetProcAddress" returns: cuLaunchKernel per-thread (cuLaunchKernel_ptsz),
 *            cuMemAlloc and cuMemFree (cuMemAlloc_v2, cuMemFree_v2), cuMemcpyHtoD and
 *            cuMemcpyDtoH per-thread (_v2_ptds); and cuGetProcAddress (v1, from dlsym) for
 *            cuMemsetD32 and itself;
 *
 * then the allocations a job makes without cudaMalloc: stream-ordered (cuMemAllocAsync /
 * cuMemFreeAsync on a stream of its own), the expandable-segments sequence (cuMemAddressReserve,
 * cuMemCreate, cuMemMap, cuMemSetAccess) and managed memory (cuMemAllocManaged), each used by a
 * kernel; and a graph launch. One of each kind of these allocations is kept to the end.
 *
 * Kernels run on the host under the fake driver (struct fake_kernel's `run`), on u32 words:
 *   iota(u32 *y, u32 base, u64 n)                y[i] = base + i
 *   axpy(const u32 *x, u32 *y, u32 a, u64 n)     y[i] += a * x[i]
 * Every result is read back and checked against the host's own computation. Prints one fact a
 * line ("PHASE ok SUM", SUM the u64 sum of the phase's result; "gpa NAME 1" when a lookup gave the
 * function the job is linked against) and "done", exit 0; "error ..." or "PHASE wrong ..." and
 * exit 1 on a failure. Nothing printed depends on possum: a run without it prints the same. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_abi.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUstream;

/* The driver's functions the job is linked against, as cuda.h declares them. */
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuCtxSetCurrent(void *);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemcpyDtoH_v2_ptds(void *, CUdeviceptr, size_t);
CUresult cuMemcpyDtoD_v2(CUdeviceptr, CUdeviceptr, size_t);
CUresult cuMemcpyAsync(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, CUstream);
CUresult cuMemcpyDtoHAsync_v2(void *, CUdeviceptr, size_t, CUstream);
CUresult cuMemsetD8_v2(CUdeviceptr, unsigned char, size_t);
CUresult cuMemsetD32_v2(CUdeviceptr, unsigned, size_t);
CUresult cuMemsetD32Async(CUdeviceptr, unsigned, size_t, CUstream);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        CUstream, void **, void **);
CUresult cuLaunchKernel_ptsz(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void **, void **);
CUresult cuLaunchCooperativeKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   unsigned, unsigned, CUstream, void **);
CUresult cuLaunchKernelEx(const void *, void *, void **, void **);
CUresult cuGraphLaunch(void *, CUstream);
CUresult cuStreamCreate(CUstream *, unsigned);
CUresult cuStreamSynchronize(CUstream);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned);
CUresult cuMemGetAllocationGranularity(size_t *, const void *, int);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemCreate(unsigned long long *, size_t, const void *, unsigned long long);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, unsigned long long, unsigned long long);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const void *, size_t);
CUresult cuGetProcAddress(const char *, void **, int, unsigned long long);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);

typedef CUresult (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void **, void **);
typedef CUresult (*coop_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, CUstream, void **);
typedef CUresult (*dtoh_t)(void *, CUdeviceptr, size_t);
typedef CUresult (*htod_t)(CUdeviceptr, const void *, size_t);
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);
typedef CUresult (*free_t)(CUdeviceptr);
typedef CUresult (*gpa_t)(const char *, void **, int, unsigned long long);
typedef CUresult (*gpa2_t)(const char *, void **, int, unsigned long long, int *);

/* CUlaunchConfig: hStream at byte 32. */
typedef struct {
    unsigned grid[3], block[3], shmem;
    CUstream stream;
    void *attrs;
    unsigned nattrs;
} launch_config;

#define N ((size_t)1 << 16) /* u32 words per buffer */
#define PTR(d) ((uint32_t *)(uintptr_t)(d))

static void run_iota(void **p) {
    uint32_t *y = *(uint32_t **)p[0];
    uint32_t base = *(uint32_t *)p[1];
    uint64_t n = *(uint64_t *)p[2];
    for (uint64_t i = 0; i < n; i++) y[i] = base + (uint32_t)i;
}

static void run_axpy(void **p) {
    const uint32_t *x = *(const uint32_t **)p[0];
    uint32_t *y = *(uint32_t **)p[1];
    uint32_t a = *(uint32_t *)p[2];
    uint64_t n = *(uint64_t *)p[3];
    for (uint64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static struct fake_kernel iota = {FAKE_KERNEL_MAGIC, "iota", 3, {0, 8, 16}, {8, 4, 8}, run_iota};
static struct fake_kernel axpy = {FAKE_KERNEL_MAGIC, "axpy", 4, {0, 8, 16, 24}, {8, 8, 4, 8}, run_axpy};

static void die(const char *what, int r) {
    printf("error %s %d\n", what, r);
    exit(1);
}

static void ok(const char *what, CUresult r) {
    if (r) die(what, r);
}

static uint32_t hx[N], hy[N];
static uint64_t n = N;

/* x's contents. */
static uint32_t xv(size_t i) { return (uint32_t)(7 * i + 1); }

/* Checks got[i] == base + i * step + a * x(i) for every i; prints "PHASE ok SUM". */
static void check(const char *phase, const uint32_t *got, uint32_t base, uint32_t step, uint32_t a) {
    uint64_t sum = 0;
    for (size_t i = 0; i < N; i++) {
        uint32_t want = base + (uint32_t)i * step + a * xv(i);
        if (got[i] != want) {
            printf("%s wrong at %zu: %u, want %u\n", phase, i, got[i], want);
            exit(1);
        }
        sum += got[i];
    }
    printf("%s ok %llu\n", phase, (unsigned long long)sum);
}

static void launch(launch_t f, struct fake_kernel *k, CUstream s, void **args) {
    ok(k->name, f(k, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
}

/* "gpa NAME 1": the lookup's answer is `want`, the function of that name the job is linked
 * against (possum's wrapper where possum is preloaded, the driver's otherwise). */
static void same(const char *what, const void *got, const void *want) {
    printf("%s %d\n", what, got == want);
}

int main(void) {
    void *ctx;
    ok("context", cuInit(0) || cuDevicePrimaryCtxRetain(&ctx, 0) || cuCtxSetCurrent(ctx));
    for (size_t i = 0; i < N; i++) hx[i] = xv(i);

    /* direct: linked against libcuda. */
    CUdeviceptr x, y;
    ok("cuMemAlloc_v2", cuMemAlloc_v2(&x, N * 4));
    ok("cuMemAlloc_v2", cuMemAlloc_v2(&y, N * 4));
    ok("cuMemcpyHtoD_v2", cuMemcpyHtoD_v2(x, hx, N * 4));
    ok("cuMemsetD32_v2", cuMemsetD32_v2(y, 5, N));
    for (uint32_t a = 1; a <= 3; a++) {
        void *args[] = {&x, &y, &a, &n};
        launch(cuLaunchKernel, &axpy, NULL, args);
    }
    {
        uint32_t a = 1;
        void *args[] = {&x, &y, &a, &n};
        launch_config cfg = {{1, 1, 1}, {1, 1, 1}, 0, NULL, NULL, 0};
        ok("cuLaunchKernelEx", cuLaunchKernelEx(&cfg, &axpy, args, NULL));
    }
    ok("cuMemcpyDtoH_v2", cuMemcpyDtoH_v2(hy, y, N * 4));
    check("direct", hy, 5, 0, 7);

    /* dlsym on the driver's handle. */
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) die("dlopen", 0);
    launch_t dl_launch = (launch_t)dlsym(h, "cuLaunchKernel");
    coop_t dl_coop = (coop_t)dlsym(h, "cuLaunchCooperativeKernel");
    dtoh_t dl_dtoh = (dtoh_t)dlsym(h, "cuMemcpyDtoH_v2");
    if (!dl_launch || !dl_coop || !dl_dtoh) die("dlsym", 0);
    same("dlsym cuLaunchKernel", (void *)dl_launch, (void *)cuLaunchKernel);
    same("dlsym cuLaunchCooperativeKernel", (void *)dl_coop, (void *)cuLaunchCooperativeKernel);
    same("dlsym cuMemcpyDtoH_v2", (void *)dl_dtoh, (void *)cuMemcpyDtoH_v2);
    {
        uint32_t base = 1000, a = 2;
        void *args[] = {&y, &base, &n};
        launch(dl_launch, &iota, NULL, args);
        void *args2[] = {&x, &y, &a, &n};
        ok("cuLaunchCooperativeKernel", dl_coop(&axpy, 1, 1, 1, 1, 1, 1, 0, NULL, args2));
    }
    ok("cuMemcpyDtoH_v2", dl_dtoh(hy, y, N * 4));
    check("dlsym", hy, 1000, 1, 2);

    /* cuGetProcAddress_v2, and the function its self-lookup gives. */
    gpa2_t dl_gpa = (gpa2_t)dlsym(h, "cuGetProcAddress_v2");
    if (!dl_gpa) die("dlsym cuGetProcAddress_v2", 0);
    same("dlsym cuGetProcAddress_v2", (void *)dl_gpa, (void *)cuGetProcAddress_v2);
    void *f = NULL;
    int st = -1;
    ok("cuGetProcAddress", dl_gpa("cuGetProcAddress", &f, 12000, 0, &st) || st);
    same("gpa cuGetProcAddress", f, (void *)cuGetProcAddress_v2);
    gpa2_t gpa = (gpa2_t)f;
    struct {
        const char *name;
        unsigned long long flags;
        const void *want;
        void *got;
    } look[] = {
        {"cuLaunchKernel", 2, (void *)cuLaunchKernel_ptsz, NULL},
        {"cuLaunchKernel", 0, (void *)cuLaunchKernel, NULL},
        {"cuMemAlloc", 0, (void *)cuMemAlloc_v2, NULL},
        {"cuMemFree", 0, (void *)cuMemFree_v2, NULL},
        {"cuMemcpyHtoD", 2, (void *)cuMemcpyHtoD_v2_ptds, NULL},
        {"cuMemcpyDtoH", 2, (void *)cuMemcpyDtoH_v2_ptds, NULL},
        /* Not one possum wraps: handed out as the driver gives it. */
        {"cuCtxSynchronize", 0, (void *)cuCtxSynchronize, NULL},
    };
    for (size_t i = 0; i < sizeof look / sizeof look[0]; i++) {
        char what[96];
        st = -1;
        ok(look[i].name, gpa(look[i].name, &look[i].got, 12000, look[i].flags, &st) || st);
        snprintf(what, sizeof what, "gpa %s%s", look[i].name, look[i].flags ? " per-thread" : "");
        same(what, look[i].got, look[i].want);
    }
    st = -1;
    f = (void *)1;
    CUresult r = gpa("cuNoSuchFunction", &f, 12000, 0, &st);
    printf("gpa cuNoSuchFunction %d %d %d\n", r, st, f == NULL);
    /* The CUDA 11.3 form. */
    gpa_t dl_gpa1 = (gpa_t)dlsym(h, "cuGetProcAddress");
    if (!dl_gpa1) die("dlsym cuGetProcAddress", 0);
    same("dlsym cuGetProcAddress", (void *)dl_gpa1, (void *)cuGetProcAddress);
    ok("cuGetProcAddress", dl_gpa1("cuGetProcAddress", &f, 11030, 0));
    same("gpa1 cuGetProcAddress", f, (void *)cuGetProcAddress);
    ok("cuGetProcAddress", dl_gpa1("cuMemsetD32", &f, 3020, 0));
    same("gpa1 cuMemsetD32", f, (void *)cuMemsetD32_v2);
    {
        launch_t lk_pt = (launch_t)look[0].got;
        alloc_t ma = (alloc_t)look[2].got;
        free_t mf = (free_t)look[3].got;
        htod_t h2d = (htod_t)look[4].got;
        dtoh_t d2h = (dtoh_t)look[5].got;
        CUdeviceptr p, q;
        ok("cuMemAlloc", ma(&p, N * 4));
        ok("cuMemAlloc", ma(&q, N * 4));
        ok("cuMemcpyHtoD", h2d(p, hx, N * 4));
        uint32_t base = 100, a = 3;
        void *args[] = {&q, &base, &n};
        launch(lk_pt, &iota, NULL, args);
        void *args2[] = {&p, &q, &a, &n};
        launch(lk_pt, &axpy, NULL, args2);
        ok("cuMemcpyDtoH", d2h(hy, q, N * 4));
        check("gpa", hy, 100, 1, 3);
        ok("cuMemFree", mf(p));
        ok("cuMemFree", mf(q));
    }

    /* Stream-ordered allocations on a stream of the job's. */
    CUstream s;
    ok("cuStreamCreate", cuStreamCreate(&s, 0));
    CUdeviceptr a1, a2;
    ok("cuMemAllocAsync", cuMemAllocAsync(&a1, N * 4, s));
    ok("cuMemAllocAsync", cuMemAllocAsync(&a2, N * 4, s));
    ok("cuMemsetD32Async", cuMemsetD32Async(a1, 9, N, s));
    {
        uint32_t a = 1;
        void *args[] = {&x, &a1, &a, &n};
        launch(cuLaunchKernel, &axpy, s, args);
    }
    ok("cuMemcpyAsync", cuMemcpyAsync(a2, a1, N * 4, s));
    ok("cuMemcpyDtoHAsync_v2", cuMemcpyDtoHAsync_v2(hy, a2, N * 4, s));
    ok("cuStreamSynchronize", cuStreamSynchronize(s));
    ok("cuMemFreeAsync", cuMemFreeAsync(a1, s));
    check("async", hy, 9, 0, 1);

    /* Expandable segments: a reserved range, a physical allocation mapped into it. */
    struct { int type, handle_types, loc_type, loc_id; unsigned long long pad[4]; } prop = {1, 0, 1, 0, {0}};
    struct { int loc_type, loc_id, flags; } access = {1, 0, 3};
    size_t gran = 0;
    CUdeviceptr va;
    unsigned long long mem;
    ok("cuMemGetAllocationGranularity", cuMemGetAllocationGranularity(&gran, &prop, 0));
    if (gran < 2 * N * 4) die("granularity", (int)gran);
    ok("cuMemAddressReserve", cuMemAddressReserve(&va, gran, 0, 0, 0));
    ok("cuMemCreate", cuMemCreate(&mem, gran, &prop, 0));
    ok("cuMemMap", cuMemMap(va, gran, 0, mem, 0));
    ok("cuMemSetAccess", cuMemSetAccess(va, gran, &access, 1));
    {
        CUdeviceptr vx = va, vy = va + N * 4;
        ok("cuMemcpyHtoDAsync_v2", cuMemcpyHtoDAsync_v2(vx, hx, N * 4, s));
        ok("cuMemsetD8_v2", cuMemsetD8_v2(vy, 0, N * 4));
        uint32_t a = 4;
        void *args[] = {&vx, &vy, &a, &n};
        launch_config cfg = {{1, 1, 1}, {1, 1, 1}, 0, s, NULL, 0};
        ok("cuLaunchKernelEx", cuLaunchKernelEx(&cfg, &axpy, args, NULL));
        ok("cuMemcpyDtoD_v2", cuMemcpyDtoD_v2(a2, vy, N * 4));
        ok("cuMemcpyDtoH_v2", cuMemcpyDtoH_v2(hy, a2, N * 4));
        check("vmm", hy, 0, 0, 4);
    }

    /* Managed memory, written and read by the host directly. */
    CUdeviceptr m;
    ok("cuMemAllocManaged", cuMemAllocManaged(&m, N * 4, 1 /* CU_MEM_ATTACH_GLOBAL */));
    for (size_t i = 0; i < N; i++) PTR(m)[i] = 50 + (uint32_t)i * 2;
    {
        uint32_t a = 2;
        void *args[] = {&x, &m, &a, &n};
        launch(cuLaunchKernel, &axpy, NULL, args);
    }
    ok("cuCtxSynchronize", cuCtxSynchronize());
    check("managed", PTR(m), 50, 2, 2);

    /* A graph (the fake driver's graphs do nothing). */
    printf("graph %d\n", cuGraphLaunch((void *)0x6000, s));

    ok("cuMemFree_v2", cuMemFree_v2(x));
    ok("cuMemFree_v2", cuMemFree_v2(y));
    puts("done");
    return 0;
}
