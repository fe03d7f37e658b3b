/* The fake jobs that call the driver by name (dlsym on libcuda.so.1's handle, as FAKE_VIA=entry
 * does): the functions they call and the context they make current; they fail with die(what)
 * (fake_die.h). */
#ifndef FAKE_DRIVER_H
#define FAKE_DRIVER_H
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

#include "fake_die.h"

typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        void *, void **, void **);
static launch_t drv_launch;
static int (*drv_htod)(uint64_t, const void *, size_t);
static int (*drv_dtoh)(void *, uint64_t, size_t);

/* Opens the driver, finds cuLaunchKernel (drv_launch) and makes device 0's primary context
 * current; dies ("context") where a function is missing or fails. The driver's handle. */
static inline void *driver_context(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) die("no driver");
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
    int (*retain)(void **, int) = (int (*)(void **, int))dlsym(h, "cuDevicePrimaryCtxRetain");
    int (*set)(void *) = (int (*)(void *))dlsym(h, "cuCtxSetCurrent");
    drv_launch = (launch_t)dlsym(h, "cuLaunchKernel");
    void *ctx;
    if (!init || !retain || !set || !drv_launch || init(0) || retain(&ctx, 0) || set(ctx))
        die("context");
    return h;
}

/* drv_htod and drv_dtoh found on the driver's handle `h`; dies ("context") without them. */
static inline void driver_copies(void *h) {
    drv_htod = (int (*)(uint64_t, const void *, size_t))dlsym(h, "cuMemcpyHtoD_v2");
    drv_dtoh = (int (*)(void *, uint64_t, size_t))dlsym(h, "cuMemcpyDtoH_v2");
    if (!drv_htod || !drv_dtoh) die("context");
}
#endif
