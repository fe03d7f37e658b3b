/* A job for tests/fake_dlvsym.rs: it takes driver functions with dlvsym (a versioned lookup) on
 * the driver's handle (the fake driver built with its functions under version FAKE_CUDA), as
 * dlsym's callers do, and uses them. Prints, one per line:
 *   wrapped 1     dlvsym(handle, "cuMemsetD32_v2", ..) is the function the program is linked to
 *                 (possum's wrapper under LD_PRELOAD, the driver's without)
 *   passed 1      dlvsym of a name possum does not wrap is what dlsym answers
 *   default 1     dlvsym(RTLD_DEFAULT, "getpid", "GLIBC_2.2.5") is libc's getpid
 *   value 7       the u32 word the cuMemsetD32_v2 it took wrote into a new allocation
 * Anything failing prints "error ..." and exits 1. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "fake_die.h"

typedef unsigned long long ull;
int cuInit(unsigned);
int cuDevicePrimaryCtxRetain(void **, int);
int cuCtxSetCurrent(void *);
int cuMemAlloc_v2(ull *, size_t);
int cuMemsetD32_v2(ull, unsigned, size_t);
int cuMemcpyDtoH_v2(void *, ull, size_t);
typedef int (*memset_t)(ull, unsigned, size_t);


int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) die("dlopen");
    memset_t f = (memset_t)dlvsym(h, "cuMemsetD32_v2", "FAKE_CUDA");
    void *other = dlvsym(h, "cuDeviceGetCount", "FAKE_CUDA");
    if (!f || !other) die("dlvsym");
    printf("wrapped %d\n", (void *)f == (void *)cuMemsetD32_v2);
    printf("passed %d\n", other == dlsym(h, "cuDeviceGetCount"));
    printf("default %d\n", dlvsym(RTLD_DEFAULT, "getpid", "GLIBC_2.2.5") == (void *)getpid);
    void *ctx;
    ull x;
    unsigned v = 0;
    if (cuInit(0) || cuDevicePrimaryCtxRetain(&ctx, 0) || cuCtxSetCurrent(ctx)) die("context");
    if (cuMemAlloc_v2(&x, 4096)) die("cuMemAlloc_v2");
    if (f(x, 7, 1024)) die("memset");
    if (cuMemcpyDtoH_v2(&v, x, 4)) die("cuMemcpyDtoH_v2");
    printf("value %u\n", v);
    return 0;
}
