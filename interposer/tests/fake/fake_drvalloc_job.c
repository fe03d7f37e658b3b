/* Driver-API allocations under possum, on the fake driver (tests/fake_drvalloc.rs):
 * cuMemAlloc_v2 / cuMemAllocPitch_v2 / cuMemFree_v2 called as a program linked against libcuda
 * would (the first definition in the global scope: libpossum's when preloaded), and cuMemAlloc
 * and cuMemFree looked up with cuGetProcAddress_v2 (itself found with dlsym on libcuda's handle)
 * as libcudart does. Prints one line per fact the test checks, then exits 0; "error ..." and exit
 * 1 on a failure. The facts do not depend on possum: the same lines without it. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_die.h"

typedef unsigned long long ull;
typedef int (*alloc_t)(ull *, size_t);
typedef int (*pitch_t)(ull *, size_t *, size_t, size_t, unsigned);
typedef int (*free_t)(ull);
typedef int (*gpa_t)(const char *, void **, int, ull, int *);


int main(void) {
    /* Global, as for a program linked against libcuda (the driver is then in the global scope). */
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!drv) die("no fake driver");
    int (*init)(unsigned) = dlsym(drv, "cuInit");
    int (*retain)(void **, int) = dlsym(drv, "cuDevicePrimaryCtxRetain");
    int (*set)(void *) = dlsym(drv, "cuCtxSetCurrent");
    gpa_t gpa = (gpa_t)dlsym(drv, "cuGetProcAddress_v2");
    void *ctx;
    if (!init || !retain || !set || !gpa || init(0) || retain(&ctx, 0) || set(ctx)) die("context");

    /* As a program linked against libcuda. */
    alloc_t direct_alloc = (alloc_t)dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    pitch_t direct_pitch = (pitch_t)dlsym(RTLD_DEFAULT, "cuMemAllocPitch_v2");
    free_t direct_free = (free_t)dlsym(RTLD_DEFAULT, "cuMemFree_v2");
    ull a = 0, b = 0, c = 0;
    size_t pitch = 0;
    int r = direct_alloc(&a, 1 << 20);
    if (r) { printf("error cuMemAlloc_v2 %d\n", r); return 1; }
    if (direct_pitch(&c, &pitch, 1000, 10, 4)) die("cuMemAllocPitch_v2");
    printf("pitch %zu\n", pitch);

    /* As libcudart: look the functions up (the driver answers with its cuMemAlloc_v2 and
     * cuMemFree_v2, possum with its wrappers of them: the functions of the global scope). */
    void *fp = NULL, *ff = NULL;
    int status = -1;
    if (gpa("cuMemAlloc", &fp, 13000, 0, &status) || status || !fp) die("cuGetProcAddress_v2");
    if (gpa("cuMemFree", &ff, 13000, 0, &status) || status || !ff) die("cuGetProcAddress_v2");
    printf("swapped %d\n", fp == (void *)direct_alloc && ff == (void *)direct_free);
    if (((alloc_t)fp)(&b, 1 << 16)) die("looked-up cuMemAlloc");

    /* The memory is usable (host memory under the fake driver) and distinct. */
    memset((void *)(uintptr_t)a, 0xab, 1 << 20);
    memset((void *)(uintptr_t)b, 0xcd, 1 << 16);
    memset((void *)(uintptr_t)c, 0xef, pitch * 10);
    printf("distinct %d\n", a != b && b != c && a != c);
    if (direct_free(a) || ((free_t)ff)(b) || direct_free(c)) die("cuMemFree_v2");
    puts("done");
    return 0;
}
