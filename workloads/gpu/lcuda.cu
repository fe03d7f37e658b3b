// A CUDA C job linked with -lcuda that launches its kernels through the driver API itself:
// cuLaunchKernel and cuLaunchKernelEx on CUfunctions the runtime hands out
// (cudaGetFuncBySymbol), device memory from cuMemAlloc, cuMemcpyHtoD / cuMemsetD32 / cuMemcpyDtoH
// (the _v2 entry points, through cuda.h's macros). These calls bind to libcuda's exported
// names at load time, not through dlsym or cuGetProcAddress: what possum must see through the
// symbols it exports itself. It counts its own driver calls and prints them at the end, so a
// coverage check compares exactly (scripts/gpu-interposer.sh coverage).
//
//   nvcc -O2 -arch=sm_90 -o lcuda lcuda.cu -lcuda && ./lcuda [steps] [log] [sleep_ms]
//
// stdout: one line per step {"step", "loss": checksum of the outputs}, then
// {"digest": ..., "calls": {"cuLaunchKernel": N, ...}}. With a log (checkpoint tests, as
// ptrtable.cu): the same step lines with "t" (wall time) appended to it, opened and closed each
// step, then {"digest": ...}. LCUDA_EXTRA=1: every step also launches one kernel with its
// parameters packed into `extra` (CU_LAUNCH_PARAM_BUFFER_POINTER) instead of kernelParams.
// Deterministic.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/time.h>
#include <unistd.h>
#include <cuda.h>
#include <cuda_runtime.h>

#define CHECK_RT(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CHECK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_ = "?"; \
    cuGetErrorName(r_, &s_); fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, s_); exit(1); } } while (0)

// y = y/2 + a*x
__global__ void axpy_half(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 0.5f * y[i] + a * x[i];
}

// x = 0.999 x + 0.001 y
__global__ void mix(float *x, const float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = 0.999f * x[i] + 0.001f * y[i];
}

// z += y (z is cleared by cuMemsetD32 every fourth step)
__global__ void accumulate(float *z, const float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) z[i] += y[i];
}

// FNV-1a over 64-bit words (bytes a multiple of 8): cheap enough to run on 8 MiB every step.
static uint64_t fnv(const void *v, size_t bytes, uint64_t h) {
    const uint64_t *p = (const uint64_t *)v;
    for (size_t i = 0; i < bytes / 8; ++i) { h ^= p[i]; h *= 1099511628211ull; }
    return h;
}

static struct {
    long launch, launch_ex, htod, dtoh, memset32, alloc;
} calls;

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 10;
    const char *log = argc > 2 && argv[2][0] ? argv[2] : NULL;
    int sleep_ms = argc > 3 ? atoi(argv[3]) : 0;
    bool extra = getenv("LCUDA_EXTRA") && strcmp(getenv("LCUDA_EXTRA"), "1") == 0;
    const int n = 1 << 20, threads = 256, blocks = (n + threads - 1) / threads;
    const size_t bytes = n * sizeof(float);

    // The runtime makes the device's primary context current; its kernel handles are CUfunctions.
    CHECK_RT(cudaFree(0));
    CUcontext ctx;
    CHECK(cuCtxGetCurrent(&ctx));
    if (!ctx) { fprintf(stderr, "no current context\n"); return 1; }
    CUfunction f_axpy, f_mix, f_acc;
    CHECK_RT(cudaGetFuncBySymbol((cudaFunction_t *)&f_axpy, (const void *)axpy_half));
    CHECK_RT(cudaGetFuncBySymbol((cudaFunction_t *)&f_mix, (const void *)mix));
    CHECK_RT(cudaGetFuncBySymbol((cudaFunction_t *)&f_acc, (const void *)accumulate));
    CUstream stream;
    CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));

    CUdeviceptr x, y, z;
    CHECK(cuMemAlloc(&x, bytes)); calls.alloc++;
    CHECK(cuMemAlloc(&y, bytes)); calls.alloc++;
    CHECK(cuMemAlloc(&z, bytes)); calls.alloc++;
    float *host = (float *)malloc(bytes), *hy = (float *)malloc(bytes), *hz = (float *)malloc(bytes);
    for (int i = 0; i < n; ++i) host[i] = (float)((i * 2654435761u) % 1000) / 1000.0f;
    CHECK(cuMemcpyHtoD(x, host, bytes)); calls.htod++;
    float one = 1.0f;
    unsigned int one_bits;
    memcpy(&one_bits, &one, 4);
    CHECK(cuMemsetD32(y, one_bits, n)); calls.memset32++;
    CHECK(cuMemsetD32(z, 0, n)); calls.memset32++;

    int nn = n;
    for (int s = 0; s < steps; ++s) {
        float a = 0.25f + 0.01f * (s % 7);
        // cuLaunchKernel, legacy default stream, parameters by kernelParams.
        void *p_axpy[] = {&a, &x, &y, &nn};
        CHECK(cuLaunchKernel(f_axpy, blocks, 1, 1, threads, 1, 1, 0, 0, p_axpy, NULL)); calls.launch++;
        // cuLaunchKernelEx on a stream of its own (ordered after the above: the legacy default
        // stream does not synchronise with a non-blocking stream, so wait for it first).
        CHECK(cuCtxSynchronize());
        CUlaunchConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.gridDimX = blocks; cfg.gridDimY = 1; cfg.gridDimZ = 1;
        cfg.blockDimX = threads; cfg.blockDimY = 1; cfg.blockDimZ = 1;
        cfg.hStream = stream;
        void *p_mix[] = {&x, &y, &nn};
        CHECK(cuLaunchKernelEx(&cfg, f_mix, p_mix, NULL)); calls.launch_ex++;
        if (extra) {
            // The same kernel's parameters packed into one buffer (each at its natural alignment).
            struct { CUdeviceptr z, y; int n; } packed = {z, y, nn};
            // The kernel's parameter space ends with `n`: the struct's tail padding is not in it
            // (the driver refuses a larger buffer with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES).
            size_t size = 2 * sizeof(CUdeviceptr) + sizeof(int);
            void *ex[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &packed, CU_LAUNCH_PARAM_BUFFER_SIZE, &size,
                          CU_LAUNCH_PARAM_END};
            CHECK(cuLaunchKernel(f_acc, blocks, 1, 1, threads, 1, 1, 0, stream, NULL, ex)); calls.launch++;
        } else {
            void *p_acc[] = {&z, &y, &nn};
            CHECK(cuLaunchKernel(f_acc, blocks, 1, 1, threads, 1, 1, 0, stream, p_acc, NULL)); calls.launch++;
        }
        CHECK(cuStreamSynchronize(stream));
        if (s % 4 == 3) {
            CHECK(cuMemsetD32(z, 0, n)); calls.memset32++;
            CHECK(cuMemcpyHtoD(x, host, bytes / 2)); calls.htod++;
        }
        CHECK(cuMemcpyDtoH(hy, y, bytes)); calls.dtoh++;
        CHECK(cuMemcpyDtoH(hz, z, bytes)); calls.dtoh++;
        uint64_t h = fnv(hz, bytes, fnv(hy, bytes, 1469598103934665603ull));
        printf("{\"step\": %d, \"loss\": \"%016llx\"}\n", s, (unsigned long long)h);
        fflush(stdout);
        if (log) {
            struct timeval tv;
            gettimeofday(&tv, NULL);
            FILE *f = fopen(log, "a");
            if (f) {
                fprintf(f, "{\"step\": %d, \"loss\": \"%016llx\", \"t\": %.6f}\n", s,
                        (unsigned long long)h, tv.tv_sec + tv.tv_usec / 1e6);
                fclose(f);
            }
        }
        if (sleep_ms) usleep(sleep_ms * 1000);
    }
    float *hx = (float *)malloc(bytes);
    CHECK(cuMemcpyDtoH(hx, x, bytes)); calls.dtoh++;
    CHECK(cuMemcpyDtoH(hy, y, bytes)); calls.dtoh++;
    uint64_t d = fnv(hy, bytes, fnv(hx, bytes, 1469598103934665603ull));
    if (log) {
        FILE *f = fopen(log, "a");
        if (f) { fprintf(f, "{\"digest\": \"%016llx\"}\n", (unsigned long long)d); fclose(f); }
    }
    printf("{\"digest\": \"%016llx\", \"extra\": %s, \"calls\": {\"cuLaunchKernel\": %ld, \"cuLaunchKernelEx\": %ld, "
           "\"launches\": %ld, \"cuMemcpyHtoD_v2\": %ld, \"cuMemcpyDtoH_v2\": %ld, \"cuMemsetD32_v2\": %ld, "
           "\"cuMemAlloc_v2\": %ld}}\n",
           (unsigned long long)d, extra ? "true" : "false", calls.launch, calls.launch_ex,
           calls.launch + calls.launch_ex, calls.htod, calls.dtoh, calls.memset32, calls.alloc);
    CHECK(cuMemFree(x));
    CHECK(cuMemFree(y));
    CHECK(cuMemFree(z));
    CHECK(cuStreamDestroy(stream));
    return 0;
}
