/* Peer access to a job's memory, on the fake driver (tests/fake_peer_access.rs): a cuMemAlloc_v2
 * on device 0, one on device 1 when the fake has two devices, and a piece of the job's own virtual
 * memory on device 0 (cuMemAddressReserve, cuMemCreate, cuMemMap, then cuMemSetAccess for device 0
 * only), all called as a program linked against libcuda would (the global scope: libpossum's
 * functions when preloaded). Prints the devices the fake driver says may access each one
 * (fake_access_mask, bit d: device d), one line each; again for each line "again" on stdin
 * (after possum released and restored the memory, say); "done" at the end of stdin. "error ..."
 * and exit 1 on a failure. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef unsigned long long ull;

static unsigned (*mask)(ull);
static int allocs;
static ull alloc_at[2], piece;

static void report(void) {
    for (int d = 0; d < allocs; d++) printf("alloc on %d mask %u\n", d, mask(alloc_at[d]));
    printf("piece mask %u\n", mask(piece));
    fflush(stdout);
}

static void die(const char *what, int r) {
    printf("error %s %d\n", what, r);
    exit(1);
}

static void *fn(const char *name) {
    void *f = dlsym(RTLD_DEFAULT, name);
    if (!f) die(name, -1);
    return f;
}

int main(void) {
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!drv) die("no fake driver", -1);
    mask = (unsigned (*)(ull))dlsym(drv, "fake_access_mask");
    if (!mask) die("no fake_access_mask", -1);
    int (*init)(unsigned) = fn("cuInit");
    int (*count)(int *) = fn("cuDeviceGetCount");
    int (*retain)(void **, int) = fn("cuDevicePrimaryCtxRetain");
    int (*set)(void *) = fn("cuCtxSetCurrent");
    int (*alloc)(ull *, size_t) = fn("cuMemAlloc_v2");
    int (*reserve)(ull *, size_t, size_t, ull, ull) = fn("cuMemAddressReserve");
    int (*create)(ull *, size_t, const void *, ull) = fn("cuMemCreate");
    int (*map)(ull, size_t, size_t, ull, ull) = fn("cuMemMap");
    int (*set_access)(ull, size_t, const void *, size_t) = fn("cuMemSetAccess");
    int (*granularity)(size_t *, const void *, int) = fn("cuMemGetAllocationGranularity");

    int n = 0, r;
    void *ctx[2];
    if ((r = init(0)) || (r = count(&n))) die("init", r);
    for (int d = 0; d < n && d < 2; d++)
        if ((r = retain(&ctx[d], d))) die("cuDevicePrimaryCtxRetain", r);

    for (int d = 0; d < n && d < 2; d++, allocs++) {
        if ((r = set(ctx[d]))) die("cuCtxSetCurrent", r);
        if ((r = alloc(&alloc_at[d], 1 << 20))) die("cuMemAlloc_v2", r);
    }

    /* CUmemAllocationProp as PyTorch's expandable segments ask on an H100: pinned (1), a POSIX fd
     * as handle type (1), device (1) 0, allocFlags.gpuDirectRDMACapable (byte 25) 1. */
    uint32_t prop[8] = {1, 1, 1, 0, 0, 0, 0x100, 0};
    /* CUmemAccessDesc: device 0, read-write (3). */
    uint32_t access[3] = {1, 0, 3};
    size_t g = 0;
    ull base = 0, h = 0;
    if ((r = set(ctx[0]))) die("cuCtxSetCurrent", r);
    if ((r = granularity(&g, prop, 0))) die("cuMemGetAllocationGranularity", r);
    if ((r = reserve(&base, g, 0, 0, 0))) die("cuMemAddressReserve", r);
    if ((r = create(&h, g, prop, 0))) die("cuMemCreate", r);
    if ((r = map(base, g, 0, h, 0))) die("cuMemMap", r);
    if ((r = set_access(base, g, access, 1))) die("cuMemSetAccess", r);
    piece = base;
    report();
    char line[64];
    while (fgets(line, sizeof line, stdin))
        if (!strcmp(line, "again\n")) report();
    puts("done");
    return 0;
}
