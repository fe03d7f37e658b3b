// What a job expects of cudaMalloc, checked under possum (which serves it from VA-stable,
// releasable buffers): alignment, cudaPointerGetAttributes, cudaMemGetInfo accounting, copies,
// a kernel writing it, cudaFree giving the memory back, and cudaMemset. Prints one JSON line;
// exits 1 if any check fails.
//
//   nvcc -O2 -arch=sm_90 -cudart shared -o allocattrs allocattrs.cu && ./allocattrs
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <cuda_runtime.h>

static int failures = 0;
#define EXPECT(c, what) do { if (!(c)) { fprintf(stderr, "FAIL: %s\n", what); ++failures; } } while (0)
#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); exit(2); } } while (0)

__global__ void fill(uint32_t *p, size_t n, uint32_t salt) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) p[i] = (uint32_t)i * 2654435761u ^ salt;
}

int main() {
    CHECK(cudaFree(0));
    size_t free0, total;
    CHECK(cudaMemGetInfo(&free0, &total));
    const size_t big = 256ull << 20;
    void *a = nullptr, *b = nullptr, *small = nullptr;
    CHECK(cudaMalloc(&a, big));
    CHECK(cudaMalloc(&small, 100));
    CHECK(cudaMalloc(&b, big + 12345));
    size_t free1;
    CHECK(cudaMemGetInfo(&free1, &total));
    EXPECT(free0 - free1 >= 2 * big, "cudaMemGetInfo counts the allocations");
    EXPECT(((uintptr_t)a % 256) == 0 && ((uintptr_t)b % 256) == 0 && ((uintptr_t)small % 256) == 0,
           "256-byte alignment");
    cudaPointerAttributes attr;
    memset(&attr, 0, sizeof attr);
    CHECK(cudaPointerGetAttributes(&attr, (char *)b + 4096));
    EXPECT(attr.type == cudaMemoryTypeDevice, "cudaPointerGetAttributes: device memory");
    EXPECT(attr.device == 0, "cudaPointerGetAttributes: device 0");
    EXPECT(attr.devicePointer == (char *)b + 4096, "cudaPointerGetAttributes: devicePointer");
    // A kernel writes a, a copy moves it to b, the host reads b back.
    size_t n = big / 4;
    fill<<<(n + 255) / 256, 256>>>((uint32_t *)a, n, 7);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(b, a, big, cudaMemcpyDeviceToDevice));
    uint32_t *host = (uint32_t *)malloc(big);
    CHECK(cudaMemcpy(host, b, big, cudaMemcpyDeviceToHost));
    bool ok = true;
    for (size_t i = 0; i < n; i += 4099) ok &= host[i] == ((uint32_t)i * 2654435761u ^ 7);
    EXPECT(ok, "kernel + copies give the right data");
    CHECK(cudaMemset(small, 0xab, 100));
    unsigned char s[100];
    CHECK(cudaMemcpy(s, small, 100, cudaMemcpyDeviceToHost));
    EXPECT(s[0] == 0xab && s[99] == 0xab, "cudaMemset");
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    CHECK(cudaFree(small));
    size_t free2;
    CHECK(cudaMemGetInfo(&free2, &total));
    EXPECT(free2 + (8ull << 20) >= free0, "cudaFree gives the memory back");
    // A failing allocation fails as cudaMalloc does.
    void *huge = nullptr;
    cudaError_t e = cudaMalloc(&huge, total * 2);
    EXPECT(e == cudaErrorMemoryAllocation, "an impossible allocation is cudaErrorMemoryAllocation");
    cudaGetLastError();
    printf("{\"allocattrs\": %s, \"failures\": %d, \"free0_mib\": %zu, \"used_mib\": %zu}\n",
           failures ? "false" : "true", failures, free0 >> 20, (free0 - free1) >> 20);
    return failures ? 1 : 0;
}
