/* What the fake jobs share with the fake driver, runtime and CUPTI: the runtime's allocation
 * entry points, the fake driver's kernel descriptor (a CUfunction is a pointer to one; a launch
 * through the driver calls its `run`, when set, with the launch's kernelParams), the layout of
 * cuLaunchKernel's CUPTI params struct, and fake_cupti_fire's signature. */
#ifndef FAKE_ABI_H
#define FAKE_ABI_H
#include <stddef.h>
#include <stdint.h>

int cudaMalloc(void **, size_t);
int cudaFree(void *);

#define FAKE_KERNEL_MAGIC 0x6b65726e656c2121ull
struct fake_kernel {
    uint64_t magic;
    const char *name;
    int n;
    size_t off[8];
    size_t size[8];
    void (*run)(void **params);
};
typedef struct { void *f; unsigned g[6]; unsigned shmem; void *stream; void **params; void **extra; } launch_params;
typedef void (*fire_fn)(uint32_t cbid, int site, const void *params, void *ret);
#endif
