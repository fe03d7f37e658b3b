/* A stand-in for libcupti, for testing libpossum without a GPU: it has the three functions
 * libpossum calls, and when libpossum enables the last callback of its table it "fires" a fixed
 * series of driver-API callbacks, laid out as cupti_callbacks.h / cupti_driver_cbid.h (CUDA 13.0)
 * lay them out. Only ids the test expects are fired. */
#include <stddef.h>
#include <stdlib.h>
#include <stdint.h>

typedef void (*callback_fn)(void *userdata, int domain, uint32_t cbid, const void *cbdata);

typedef struct {
    int callbackSite; /* CUpti_ApiCallbackSite: 0 enter, 1 exit */
    const char *functionName;
    const void *functionParams;
    void *functionReturnValue;
    const char *symbolName;
    void *context;
    uint32_t contextUid;
    uint64_t *correlationData;
    uint32_t correlationId;
} callback_data;

typedef struct { void *f; unsigned g[6]; unsigned shmem; void *stream; void **params; void **extra; } launch_params;
typedef struct { const void *config; void *f; void **params; void **extra; } launch_ex_params;

static callback_fn cb;
static int subscribed;

int cuptiSubscribe(void **subscriber, callback_fn f, void *userdata) {
    (void)userdata;
    if (subscribed) return 39; /* CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED */
    subscribed = 1;
    __atomic_store_n(&cb, f, __ATOMIC_SEQ_CST);
    *subscriber = (void *)&cb;
    return 0;
}

/* Ends the subscription (the A/B test of POSSUM_AB_MS detaches and attaches again). Callbacks
 * stop until the next cuptiSubscribe; the enabled set is kept, as CUPTI would start afresh. */
int cuptiUnsubscribe(void *subscriber) {
    if (!subscribed || subscriber != (void *)&cb) return 1;
    __atomic_store_n(&cb, (callback_fn)NULL, __ATOMIC_SEQ_CST);
    subscribed = 0;
    return 0;
}

int cuptiGetResultString(int result, const char **str) {
    *str = result == 1 ? "CUPTI_ERROR_INVALID_PARAMETER" : "CUPTI_ERROR_UNKNOWN";
    return 0;
}

static void fire(int domain, int site, uint32_t cbid, const void *params) {
    callback_data d = {site, "fake", params, NULL, NULL, NULL, 0, NULL, 0};
    cb(NULL, domain, cbid, &d);
}

static int modules_enabled;

int cuptiEnableCallback(uint32_t enable, void *subscriber, int domain, uint32_t cbid) {
    if (enable && subscriber == (void *)&cb && domain == 3 && cbid == 6) { /* module loaded */
        modules_enabled = 1;
        return 0;
    }
    if (!enable || subscriber != (void *)&cb || domain != 1) return 1;
    if (cbid == 797) return 1; /* pretend this CUPTI lacks cuMemcpyBatchAsync_v2_ptsz */
    if (cbid != 714) return 0; /* cuGraphExecNodeSetParams: the last entry of the table */
    if (getenv("FAKE_CUPTI_NO_AUTOFIRE")) return 0; /* the job fires its own (fake_cupti_fire) */
    static unsigned char config[64]; /* a CUlaunchConfig: zeroes, so stream 0 */
    launch_params k1 = {(void *)0x1000}, k2 = {(void *)0x2000};
    launch_ex_params ex = {config, (void *)0x3000};
    fire(1, 0, 307, &k1);
    fire(1, 0, 307, &k1);
    fire(1, 0, 307, &k1);
    fire(1, 0, 442, &k2); /* cuLaunchKernel_ptsz */
    fire(1, 0, 652, &ex); /* cuLaunchKernelEx */
    fire(1, 0, 653, &ex); /* cuLaunchKernelEx_ptsz */
    fire(1, 1, 307, &k2); /* exit site: not counted */
    fire(2, 0, 307, &k2); /* runtime domain: not counted */
    static uint64_t words[8];
    /* cuGraphInstantiateWithFlags(&exec, graph 0x5000, 0) returning exec 0x6000 (exit site):
     * its nodes cannot be read here (no driver), so the graph is opaque, with that reason. */
    static uint64_t exec = 0x6000, inst[3] = {0, 0x5000, 0};
    inst[0] = (uint64_t)(uintptr_t)&exec;
    fire(1, 1, 643, inst);
    fire(1, 0, 514, words); /* cuGraphLaunch */
    fire(1, 0, 306, words); /* cuMemcpyAsync */
    fire(1, 0, 243, words); /* cuMemAlloc_v2 */
    cb(NULL, 1, 307, NULL); /* no callback data: ignored */
    return 0;
}

/* For test jobs: fires the resource callback CUPTI_CBID_RESOURCE_MODULE_LOADED for a module whose
 * image is `image` (CUpti_ResourceData pointing at a CUpti_ModuleResourceData), if enabled. */
void fake_cupti_fire_module(const void *image, size_t size) {
    struct { uint32_t id; size_t size; const void *cubin; } mod = {1, size, image};
    struct { void *context; uint64_t handle; void *descriptor; } rd = {NULL, 0, &mod};
    callback_fn f = __atomic_load_n(&cb, __ATOMIC_SEQ_CST);
    if (f && modules_enabled) f(NULL, 3, 6, &rd);
}

/* For test jobs: fires one driver-API callback (site 0: entry, 1: exit) with the given params
 * struct and CUresult. */
void fake_cupti_fire(uint32_t cbid, int site, const void *params, void *ret) {
    callback_data d = {site, "fake", params, ret, NULL, NULL, 0, NULL, 0};
    callback_fn f = __atomic_load_n(&cb, __ATOMIC_SEQ_CST);
    if (f) f(NULL, 1, cbid, &d);
}
