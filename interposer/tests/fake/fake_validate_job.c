/* A "GPU job" for the fake driver whose writes are hard to see (tests/fake_validate.rs), driven
 * one command at a time on stdin while possum checkpoints it. Through the driver's entry points
 * (cuLaunchKernel, cuMemcpyHtoD_v2/DtoH_v2, cuStreamCreate, cuStreamDestroy_v2, all found with
 * dlsym on the driver's handle: possum's wrappers).
 *
 * At start: cudaMalloc X (64 MiB), Y (64 MiB), F (4 KiB), T (4 KiB), filled (HtoD copies) with
 *   X[i] = i * 2654435761, Y[i] = i ^ 0x00abcdef, F[i] = i + 1 (u32 words), T[0] = Y's address;
 *   answers "ready".
 * Kernels (u32 s is the step number):
 *   poke(const u32 *x, u32 *y, s):  y[K] = x[K] + s: one element at a fixed offset of Y
 *                                   (K: 40 MiB + 4 KiB + 4 bytes in);
 *   flag(const u32 *x, u32 *f, s):  when s % 4 == 3 only, f[0] += x[s] | 1 (an overflow flag);
 *   late(const u64 *t, s):          ((u32 *)t[0])[K2] = 7s + 1: Y written through a pointer table
 *                                   (K2: 20 MiB + 8 bytes in).
 * Commands, each answered with one line:
 *   step N     N steps, each poke then flag with s = ++steps; answers "done S".
 *   late N     N launches of late with s = ++steps; answers "done S".
 *   stream     a stream created, poke launched on it with s = ++steps, the stream destroyed;
 *              answers "done S".
 *   doomed     as stream, but the driver's fences fail while the stream is destroyed (the
 *              driver's fake_fail_fences, when it has one: tests/fake/fake_failing_libcuda.c);
 *              answers "done S".
 *   dump PATH  X, Y, F, T read back (DtoH) and written to PATH in that order; "dumped".
 *   exit       frees everything; "bye".
 * Anything failing answers "error ..." and exits 1. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_abi.h"
#include "fake_driver.h"

#define NX ((size_t)16 << 20) /* u32 words: 64 MiB */
#define NF ((size_t)1024)     /* 4 KiB */
#define K ((((size_t)40 << 20) + 4096 + 4) / 4)
#define K2 ((((size_t)20 << 20) + 8) / 4)

static void run_poke(void **p) {
    const uint32_t *x = *(const uint32_t **)p[0];
    uint32_t *y = *(uint32_t **)p[1];
    uint32_t s = *(uint32_t *)p[2];
    y[K] = x[K] + s;
}
static void run_flag(void **p) {
    const uint32_t *x = *(const uint32_t **)p[0];
    uint32_t *f = *(uint32_t **)p[1];
    uint32_t s = *(uint32_t *)p[2];
    if (s % 4 == 3) f[0] += x[s] | 1;
}
static void run_late(void **p) {
    const uint64_t *t = *(const uint64_t **)p[0];
    uint32_t s = *(uint32_t *)p[1];
    ((uint32_t *)(uintptr_t)t[0])[K2] = 7 * s + 1;
}
static struct fake_kernel poke = {FAKE_KERNEL_MAGIC, "poke", 3, {0, 8, 16}, {8, 8, 4}, run_poke};
static struct fake_kernel flag = {FAKE_KERNEL_MAGIC, "flag", 3, {0, 8, 16}, {8, 8, 4}, run_flag};
static struct fake_kernel late = {FAKE_KERNEL_MAGIC, "late", 2, {0, 8}, {8, 4}, run_late};

static int (*drv_stream_create)(void **, unsigned);
static int (*drv_stream_destroy)(void *);


static void launch(struct fake_kernel *k, void *stream, void **args) {
    if (drv_launch(k, 1, 1, 1, 1, 1, 1, 0, stream, args, NULL)) die(k->name);
}

static void *filled(size_t words, uint32_t (*f)(size_t)) {
    void *d;
    uint32_t *h = malloc(words * 4);
    if (!h) die("malloc");
    if (cudaMalloc(&d, words * 4)) die("cudaMalloc");
    for (size_t i = 0; i < words; i++) h[i] = f(i);
    if (drv_htod((uint64_t)(uintptr_t)d, h, words * 4)) die("cuMemcpyHtoD_v2");
    free(h);
    return d;
}

static uint32_t init_x(size_t i) { return (uint32_t)i * 2654435761u; }
static uint32_t init_y(size_t i) { return (uint32_t)i ^ 0x00abcdefu; }
static uint32_t init_f(size_t i) { return (uint32_t)i + 1; }
static uint32_t init_zero(size_t i) { (void)i; return 0; }

int main(void) {
    void *h = driver_context();
    driver_copies(h);
    drv_stream_create = (int (*)(void **, unsigned))dlsym(h, "cuStreamCreate");
    drv_stream_destroy = (int (*)(void *))dlsym(h, "cuStreamDestroy_v2");
    if (!drv_stream_create || !drv_stream_destroy) die("context");
    uint32_t *x = filled(NX, init_x), *y = filled(NX, init_y), *f = filled(NF, init_f);
    uint64_t *t = filled(NF, init_zero);
    uint64_t ya = (uint64_t)(uintptr_t)y;
    if (drv_htod((uint64_t)(uintptr_t)t, &ya, 8)) die("cuMemcpyHtoD_v2");
    uint32_t s = 0;
    puts("ready");
    fflush(stdout);
    char line[4096];
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        if (!strncmp(line, "step ", 5)) {
            for (long n = atol(line + 5); n > 0; n--) {
                ++s;
                void *a1[] = {&x, &y, &s};
                launch(&poke, NULL, a1);
                void *a2[] = {&x, &f, &s};
                launch(&flag, NULL, a2);
            }
            printf("done %u\n", s);
        } else if (!strncmp(line, "late ", 5)) {
            for (long n = atol(line + 5); n > 0; n--) {
                ++s;
                void *a[] = {&t, &s};
                launch(&late, NULL, a);
            }
            printf("done %u\n", s);
        } else if (!strcmp(line, "stream") || !strcmp(line, "doomed")) {
            void (*fail)(int) = (void (*)(int))dlsym(h, "fake_fail_fences");
            int doomed = !strcmp(line, "doomed");
            if (doomed && !fail) die("no fake_fail_fences");
            void *st = NULL;
            if (drv_stream_create(&st, 0)) die("cuStreamCreate");
            ++s;
            void *a[] = {&x, &y, &s};
            launch(&poke, st, a);
            if (doomed) fail(1);
            if (drv_stream_destroy(st)) die("cuStreamDestroy_v2");
            if (doomed) fail(0);
            printf("done %u\n", s);
        } else if (!strncmp(line, "dump ", 5)) {
            FILE *out = fopen(line + 5, "wb");
            if (!out) die("fopen");
            void *bufs[] = {x, y, f, t};
            size_t words[] = {NX, NX, NF, NF};
            for (int j = 0; j < 4; j++) {
                uint32_t *hb = malloc(words[j] * 4);
                if (!hb) die("malloc");
                if (drv_dtoh(hb, (uint64_t)(uintptr_t)bufs[j], words[j] * 4)) die("cuMemcpyDtoH_v2");
                if (fwrite(hb, 4, words[j], out) != words[j]) die("fwrite");
                free(hb);
            }
            if (fclose(out)) die("fclose");
            puts("dumped");
        } else if (!strcmp(line, "exit")) {
            break;
        } else {
            die("unknown command");
        }
        fflush(stdout);
    }
    if (cudaFree(x) || cudaFree(y) || cudaFree(f) || cudaFree(t)) die("cudaFree");
    puts("bye");
    return 0;
}
