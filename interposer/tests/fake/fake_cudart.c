/* A stand-in for libcudart.so.13 (with cuda/testdata/fake-libcuda.c as the driver): the three
 * functions libpossum passes calls on to, plus cudaMemcpy for the test job. Device memory of the
 * fake driver is host memory. */
#include <stdlib.h>
#include <string.h>
int cuInit(unsigned);
int cuDevicePrimaryCtxRetain(void **, int);
int cuCtxSetCurrent(void *);
static int init(void) {
    void *c;
    if (cuInit(0) || cuDevicePrimaryCtxRetain(&c, 0) || cuCtxSetCurrent(c)) return 3;
    return 0;
}
int cudaGetDevice(int *d) { *d = 0; return 0; }
int cudaMalloc(void **p, size_t n) { if (init()) return 3; *p = calloc(1, n); return *p ? 0 : 2; }
int cudaFree(void *p) { if (!p) return init(); free(p); return 0; }
