/* A job for tests/fake_writes.rs: it writes device memory through each of the driver's less
 * common writing functions (peer, pitched, array and attribute copies, 2D memsets, stream
 * write-value and batch memory operations, legacy and multi-device launches), called by name (the
 * job is linked against libcuda, so under LD_PRELOAD they are possum's wrappers), one command at
 * a time on stdin.
 *
 * At start: cuMemAlloc_v2 X and Y (64 KiB each) on device 0, zeroed (cuMemsetD32_v2); with
 * FAKE_CUDA_DEVICES=2 also Z (64 KiB) on device 1, the thread's context being device 0's again
 * afterwards. Answers "ready X Y Z" (hex addresses; Z 0 without a second device).
 * Commands, each answered with one line:
 *   op NAME V   writes through NAME: the u32 word at X becomes V (at Z, device 1's, for
 *               cuMemcpyPeer1 and cuMemcpyPeerAsync1: NAME without the 1, from Y) (for the
 *               8-bit and 16-bit memsets, V's low byte or half repeated: V < 256 gives
 *               0x01010101 * V and 0x00010001 * V); copies take their source from Y (filled
 *               with V first, cuMemsetD32_v2) or from a host array; answers "did NAME".
 *               Two more need device 1, each called from device 1's context and writing X
 *               (device 0's): cuLaunch1 (the legacy launch) and queued (Z filled with V, then
 *               a cuMemcpyPeerAsync from Z to X on a stream of device 1's: with
 *               FAKE_CUDA_QUEUE=1 the fake driver queues it until that stream or device is
 *               synchronized). And next: X filled with V through the cuMemsetD32 that
 *               cuGetProcAddress_v2 answers at version 14000 (on the fake driver a function it
 *               does not export, which possum cannot match to a wrapper).
 *   exit        answers "bye" and exits 0.
 * Anything failing answers "error ..." and exits 1. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_abi.h"
#include "fake_die.h"

typedef unsigned long long ull;
int cuInit(unsigned);
int cuDeviceGetCount(int *);
int cuDevicePrimaryCtxRetain(void **, int);
int cuCtxSetCurrent(void *);
int cuStreamCreate(void **, unsigned);
int cuGetProcAddress_v2(const char *, void **, int, ull, int *);
int cuMemAlloc_v2(ull *, size_t);
int cuMemsetD32_v2(ull, unsigned, size_t);
int cuMemcpyPeer(ull, void *, ull, void *, size_t);
int cuMemcpyPeerAsync(ull, void *, ull, void *, size_t, void *);
int cuMemcpy2D_v2(const ull *);
int cuMemcpy3D_v2(const ull *);
int cuMemcpy3DPeer(const ull *);
int cuMemcpy3DPeerAsync(const ull *, void *);
int cuMemcpyAtoD_v2(ull, void *, size_t, size_t);
int cuMemcpyBatchAsync_v2(const ull *, const ull *, const size_t *, size_t, void *, size_t *, size_t, void *);
int cuMemcpyWithAttributesAsync(ull, ull, size_t, void *, void *);
int cuMemsetD2D8_v2(ull, size_t, unsigned char, size_t, size_t);
int cuMemsetD2D16_v2(ull, size_t, unsigned short, size_t, size_t);
int cuMemsetD2D32_v2(ull, size_t, unsigned, size_t, size_t);
int cuMemsetD2D8Async(ull, size_t, unsigned char, size_t, size_t, void *);
int cuMemsetD2D16Async(ull, size_t, unsigned short, size_t, size_t, void *);
int cuMemsetD2D32Async(ull, size_t, unsigned, size_t, size_t, void *);
int cuStreamWriteValue32(void *, ull, unsigned, unsigned);
int cuStreamWriteValue32_v2(void *, ull, unsigned, unsigned);
int cuStreamWriteValue64(void *, ull, ull, unsigned);
int cuStreamWriteValue64_v2(void *, ull, ull, unsigned);
int cuStreamBatchMemOp(void *, unsigned, const ull *, unsigned);
int cuStreamBatchMemOp_v2(void *, unsigned, const ull *, unsigned);
int cuLaunch(void *);
int cuLaunchGrid(void *, int, int);
int cuLaunchGridAsync(void *, int, int, void *);
int cuLaunchCooperativeKernelMultiDevice(void *, unsigned, unsigned);

#define SIZE ((size_t)64 << 10)
static ull X, Y, Z;
static void *ctx0, *ctx1;

#define CHECK(call)                  \
    do {                             \
        if (call) die(#call);        \
    } while (0)

/* A kernel whose arguments possum cannot read (a legacy launch's come from cuParamSet*): it
 * writes `legacy_value` at X. */
static unsigned legacy_value;
static void run_legacy(void **p) {
    (void)p;
    *(unsigned *)(uintptr_t)X = legacy_value;
}
static struct fake_kernel legacy = {FAKE_KERNEL_MAGIC, "legacy", 0, {0}, {0}, run_legacy};
/* write(unsigned *x, unsigned v) */
static void run_write(void **p) { **(unsigned **)p[0] = *(unsigned *)p[1]; }
static struct fake_kernel writer = {FAKE_KERNEL_MAGIC, "write", 2, {0, 8}, {8, 4}, run_write};

/* A CUDA_MEMCPY3D_PEER: device `src` to device `dst`, 64 bytes by 2 rows by 1 slice, pitch 64. */
static void desc3d(ull *d, ull dst, ull src) {
    memset(d, 0, 25 * 8);
    d[4] = 2, d[6] = src, d[8] = (ull)(uintptr_t)ctx0, d[9] = 64, d[10] = 2;
    d[15] = 2, d[17] = dst, d[19] = (ull)(uintptr_t)ctx0, d[20] = 64, d[21] = 2;
    d[22] = 64, d[23] = 2, d[24] = 1;
}

static void op(const char *name, unsigned v) {
    ull d[25], ops[12];
    unsigned host[16];
    for (int i = 0; i < 16; i++) host[i] = v;
    if (!strncmp(name, "cuMemcpy", 8) && strcmp(name, "cuMemcpyAtoD_v2"))
        CHECK(cuMemsetD32_v2(Y, v, SIZE / 4));
    if (!strcmp(name, "queued") || !strcmp(name, "cuLaunch1")) {
        static void *q1;
        if (!ctx1) die("no device 1");
        CHECK(cuCtxSetCurrent(ctx1));
        if (!strcmp(name, "cuLaunch1")) {
            legacy_value = v;
            CHECK(cuLaunch(&legacy));
        } else {
            if (!q1) CHECK(cuStreamCreate(&q1, 0));
            CHECK(cuMemsetD32_v2(Z, v, SIZE / 4));
            CHECK(cuMemcpyPeerAsync(X, ctx0, Z, ctx1, 64, q1));
        }
        CHECK(cuCtxSetCurrent(ctx0));
    }
    else if (!strcmp(name, "next")) {
        int (*f)(ull, unsigned, size_t) = 0;
        int st = 0;
        CHECK(cuGetProcAddress_v2("cuMemsetD32", (void **)&f, 14000, 0, &st));
        CHECK(f(X, v, SIZE / 4));
    }
    else if (!strcmp(name, "cuMemcpyPeer")) CHECK(cuMemcpyPeer(X, ctx0, Y, ctx0, 64));
    else if (!strcmp(name, "cuMemcpyPeer1")) CHECK(cuMemcpyPeer(Z, ctx1, Y, ctx0, 64));
    else if (!strcmp(name, "cuMemcpyPeerAsync")) CHECK(cuMemcpyPeerAsync(X, ctx0, Y, ctx0, 64, NULL));
    else if (!strcmp(name, "cuMemcpyPeerAsync1")) CHECK(cuMemcpyPeerAsync(Z, ctx1, Y, ctx0, 64, NULL));
    else if (!strcmp(name, "cuMemcpy3DPeer")) { desc3d(d, X, Y); CHECK(cuMemcpy3DPeer(d)); }
    else if (!strcmp(name, "cuMemcpy3D_v2")) { desc3d(d, X, Y); d[8] = d[19] = 0; CHECK(cuMemcpy3D_v2(d)); }
    else if (!strcmp(name, "cuMemcpy2D_v2")) {
        /* CUDA_MEMCPY2D: device Y to device X, 64 bytes by 2 rows, pitch 128. */
        memset(d, 0, 16 * 8);
        d[2] = 2, d[4] = Y, d[6] = 128, d[9] = 2, d[11] = X, d[13] = 128, d[14] = 64, d[15] = 2;
        CHECK(cuMemcpy2D_v2(d));
    }
    else if (!strcmp(name, "cuMemcpy3DPeerAsync")) { desc3d(d, X, Y); CHECK(cuMemcpy3DPeerAsync(d, NULL)); }
    else if (!strcmp(name, "cuMemcpyAtoD_v2")) CHECK(cuMemcpyAtoD_v2(X, host, 0, sizeof host));
    else if (!strcmp(name, "cuMemcpyBatchAsync_v2")) {
        ull dsts[1] = {X}, srcs[1] = {Y};
        size_t sizes[1] = {64};
        CHECK(cuMemcpyBatchAsync_v2(dsts, srcs, sizes, 1, NULL, NULL, 0, NULL));
    } else if (!strcmp(name, "cuMemcpyWithAttributesAsync")) CHECK(cuMemcpyWithAttributesAsync(X, Y, 64, NULL, NULL));
    else if (!strcmp(name, "cuMemsetD2D8_v2")) CHECK(cuMemsetD2D8_v2(X, 256, (unsigned char)v, 16, 4));
    else if (!strcmp(name, "cuMemsetD2D16_v2")) CHECK(cuMemsetD2D16_v2(X, 256, (unsigned short)v, 8, 4));
    else if (!strcmp(name, "cuMemsetD2D32_v2")) CHECK(cuMemsetD2D32_v2(X, 256, v, 4, 4));
    else if (!strcmp(name, "cuMemsetD2D8Async")) CHECK(cuMemsetD2D8Async(X, 256, (unsigned char)v, 16, 4, NULL));
    else if (!strcmp(name, "cuMemsetD2D16Async")) CHECK(cuMemsetD2D16Async(X, 256, (unsigned short)v, 8, 4, NULL));
    else if (!strcmp(name, "cuMemsetD2D32Async")) CHECK(cuMemsetD2D32Async(X, 256, v, 4, 4, NULL));
    else if (!strcmp(name, "cuStreamWriteValue32")) CHECK(cuStreamWriteValue32(NULL, X, v, 0));
    else if (!strcmp(name, "cuStreamWriteValue32_v2")) CHECK(cuStreamWriteValue32_v2(NULL, X, v, 0));
    else if (!strcmp(name, "cuStreamWriteValue64")) CHECK(cuStreamWriteValue64(NULL, X, v, 0));
    else if (!strcmp(name, "cuStreamWriteValue64_v2")) CHECK(cuStreamWriteValue64_v2(NULL, X, v, 0));
    else if (!strncmp(name, "cuStreamBatchMemOp", 18)) {
        /* A wait (on Y), then a 32-bit write of V at X. */
        memset(ops, 0, sizeof ops);
        ops[0] = 1, ops[1] = Y;
        ops[6] = 2, ops[7] = X, ops[8] = v;
        if (!strcmp(name, "cuStreamBatchMemOp")) CHECK(cuStreamBatchMemOp(NULL, 2, ops, 0));
        else CHECK(cuStreamBatchMemOp_v2(NULL, 2, ops, 0));
    } else if (!strncmp(name, "cuLaunch", 8)) {
        legacy_value = v;
        if (!strcmp(name, "cuLaunch")) CHECK(cuLaunch(&legacy));
        else if (!strcmp(name, "cuLaunchGrid")) CHECK(cuLaunchGrid(&legacy, 1, 1));
        else if (!strcmp(name, "cuLaunchGridAsync")) CHECK(cuLaunchGridAsync(&legacy, 1, 1, NULL));
        else if (!strcmp(name, "cuLaunchCooperativeKernelMultiDevice")) {
            /* CUDA_LAUNCH_PARAMS: function, grid and block dimensions, sharedMemBytes (seven
             * unsigned ints), hStream (byte 40), kernelParams (byte 48). */
            unsigned *x = (unsigned *)(uintptr_t)X;
            void *args[2] = {&x, &v};
            ull lp[7] = {(ull)(uintptr_t)&writer, 0, 0, 0, 0, 0, (ull)(uintptr_t)args};
            CHECK(cuLaunchCooperativeKernelMultiDevice(lp, 1, 0));
        } else die("unknown launch");
    } else
        die("unknown op");
    printf("did %s\n", name);
    fflush(stdout);
}

int main(void) {
    int n = 0;
    CHECK(cuInit(0));
    CHECK(cuDeviceGetCount(&n));
    CHECK(cuDevicePrimaryCtxRetain(&ctx0, 0));
    if (n > 1) {
        CHECK(cuDevicePrimaryCtxRetain(&ctx1, 1));
        CHECK(cuCtxSetCurrent(ctx1));
        CHECK(cuMemAlloc_v2(&Z, SIZE));
        CHECK(cuMemsetD32_v2(Z, 0, SIZE / 4));
    }
    CHECK(cuCtxSetCurrent(ctx0));
    CHECK(cuMemAlloc_v2(&X, SIZE));
    CHECK(cuMemAlloc_v2(&Y, SIZE));
    CHECK(cuMemsetD32_v2(X, 0, SIZE / 4));
    CHECK(cuMemsetD32_v2(Y, 0, SIZE / 4));
    printf("ready %llx %llx %llx\n", X, Y, Z);
    fflush(stdout);
    char line[256], name[128];
    unsigned v;
    while (fgets(line, sizeof line, stdin)) {
        if (sscanf(line, "op %127s %u", name, &v) == 2) op(name, v);
        else if (!strncmp(line, "exit", 4)) break;
        else die("bad command");
    }
    printf("bye\n");
    fflush(stdout);
    return 0;
}
