// A CUDA C job whose kernels hide pointers where a launch's parameter list does not show them:
// `scale_struct` takes its pointers inside a by-value struct, and `gather_table` reads a table of
// pointers that lives in device memory. Prints one line per step with a checksum of every output,
// then "digest <hex>". Deterministic.
//
//   nvcc -O2 -arch=sm_90 -cudart shared -o ptrtable ptrtable.cu && ./ptrtable [steps]
// (-cudart shared: possum serves cudaMalloc only to jobs that link libcudart dynamically.)
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <unistd.h>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

struct Args {
    const float *in;
    float *out;
    int n;
    float scale;
};

__global__ void scale_struct(Args a) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a.n) a.out[i] = a.in[i] * a.scale + 1.0f;
}

// table[k] points at buffer k; out[i] = sum_k table[k][i] / nbuf
__global__ void gather_table(float *const *table, int nbuf, float *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = 0.0f;
    for (int k = 0; k < nbuf; ++k) s += table[k][i];
    out[i] = s / nbuf;
}

// Writes through the table: the classic write a parameter scan cannot see.
__global__ void bump_table(float *const *table, int nbuf, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    for (int k = 0; k < nbuf; ++k) table[k][i] = table[k][i] * 0.5f + 0.25f;
}

static uint64_t fnv(const float *v, int n, uint64_t h) {
    const unsigned char *p = (const unsigned char *)v;
    for (size_t i = 0; i < (size_t)n * sizeof(float); ++i) { h ^= p[i]; h *= 1099511628211ull; }
    return h;
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 10;
    // Checkpoint tests: argv[2] names a log appended to (opened and closed) after each step,
    // argv[3] the milliseconds to sleep after each step.
    const char *log = argc > 2 ? argv[2] : NULL;
    int sleep_ms = argc > 3 ? atoi(argv[3]) : 0;
    const int n = 1 << 20, nbuf = 4;
    float *host = (float *)malloc(n * sizeof(float));
    for (int i = 0; i < n; ++i) host[i] = (float)((i * 2654435761u) % 1000) / 1000.0f;
    float *bufs[nbuf], *out, **table;
    for (int k = 0; k < nbuf; ++k) {
        CHECK(cudaMalloc(&bufs[k], n * sizeof(float)));
        CHECK(cudaMemcpy(bufs[k], host, n * sizeof(float), cudaMemcpyHostToDevice));
    }
    CHECK(cudaMalloc(&out, n * sizeof(float)));
    CHECK(cudaMalloc(&table, nbuf * sizeof(float *)));
    CHECK(cudaMemcpy(table, bufs, nbuf * sizeof(float *), cudaMemcpyHostToDevice));
    uint64_t all = 1469598103934665603ull;
    for (int s = 0; s < steps; ++s) {
        Args a = {bufs[s % nbuf], bufs[(s + 1) % nbuf], n, 0.5f};
        scale_struct<<<(n + 255) / 256, 256>>>(a);
        bump_table<<<(n + 255) / 256, 256>>>(table, nbuf, n);
        gather_table<<<(n + 255) / 256, 256>>>(table, nbuf, out, n);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpy(host, out, n * sizeof(float), cudaMemcpyDeviceToHost));
        uint64_t h = fnv(host, n, 1469598103934665603ull);
        all = fnv(host, n, all);
        printf("{\"step\": %d, \"checksum\": \"%016llx\"}\n", s, (unsigned long long)h);
        fflush(stdout);
        if (log) {
            FILE *f = fopen(log, "a");
            if (!f) { perror(log); return 1; }
            fprintf(f, "{\"step\": %d, \"loss\": \"%016llx\"}\n", s, (unsigned long long)h);
            fclose(f);
        }
        if (sleep_ms) usleep(sleep_ms * 1000);
    }
    printf("{\"digest\": \"%016llx\"}\n", (unsigned long long)all);
    if (log) {
        FILE *f = fopen(log, "a");
        if (f) { fprintf(f, "{\"digest\": \"%016llx\"}\n", (unsigned long long)all); fclose(f); }
    }
    return 0;
}
