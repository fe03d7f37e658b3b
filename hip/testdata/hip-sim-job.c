// A HIP program for the simulated runtime (fake-libamdhip64.c): several streams and threads,
// stream-ordered and pool allocations, a captured graph replayed, virtual memory management,
// launches by module and by registered stub. Written against HIP's API only
// (include/hip/hip_runtime_api.h), so it is also a HIP program for a real GPU given the same code
// object.
//
//   hip-sim-job KERNELS.hsaco
//
// It prints one line per step: the step's name and an FNV-1a 64 digest of the bytes it read back
// (and a few plain values); possum-hip's tests compare them with digests they compute
// themselves. The last line lists the device addresses it was given, in order.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hip/hip_runtime_api.h>

#include "hip-job.h"

#define N 3000u
#define BLOCK 256u
#define GRID ((N + BLOCK - 1) / BLOCK)

static unsigned long long fnv(const void* p, size_t n) {
  const unsigned char* b = p;
  unsigned long long h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

static hipFunction_t fn_fill, fn_axpy, fn_copy;

// fill_u32(out, value, n) through hipModuleLaunchKernel's kernelParams.
static void module_fill(hipStream_t s, void* out, unsigned value, unsigned n) {
  void* params[] = {&out, &value, &n};
  CHECK(hipModuleLaunchKernel(fn_fill, (n + BLOCK - 1) / BLOCK, 1, 1, BLOCK, 1, 1, 0, s, params, 0));
}

// copy_u32(dst, src, n) through hipModuleLaunchKernel's `extra` buffer (the explicit kernarg
// bytes: two pointers and a count at 0, 8, 16).
static void module_copy(hipStream_t s, void* dst, const void* src, unsigned n) {
  struct { void* dst; const void* src; unsigned n; unsigned pad; } args = {dst, src, n, 0};
  size_t size = sizeof args;
  void* extra[] = {HIP_LAUNCH_PARAM_BUFFER_POINTER, &args, HIP_LAUNCH_PARAM_BUFFER_SIZE, &size,
                   HIP_LAUNCH_PARAM_END};
  CHECK(hipModuleLaunchKernel(fn_copy, (n + BLOCK - 1) / BLOCK, 1, 1, BLOCK, 1, 1, 0, s, 0, extra));
}

// threads: each thread fills a buffer of its own on a stream of its own, many times over.
struct worker { unsigned value; unsigned out[N]; };

static void* work(void* arg) {
  struct worker* w = arg;
  hipStream_t s;
  unsigned* buf;
  CHECK(hipSetDevice(0));
  CHECK(hipStreamCreate(&s));
  CHECK(hipMallocAsync((void**)&buf, N * 4, s));
  for (unsigned round = 0; round < 50; round++) {
    module_fill(s, buf, w->value + round, N);
    CHECK(hipMemcpyAsync(w->out, buf, N * 4, hipMemcpyDeviceToHost, s));
    CHECK(hipStreamSynchronize(s));
    if (w->out[N - 1] != w->value + round) {
      fprintf(stderr, "thread %x: round %u read %x\n", w->value, round, w->out[N - 1]);
      exit(1);
    }
  }
  CHECK(hipFreeAsync(buf, s));
  CHECK(hipStreamDestroy(s));
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 2) { fprintf(stderr, "usage: %s KERNELS.hsaco\n", argv[0]); return 2; }
  void* image = read_file(argv[1]);
  static unsigned host[4 * N], host2[4 * N];
  static float xh[N], yh[N];
  void* addrs[16];
  int naddrs = 0;

  // devices: how many, and switching between them.
  int count = 0, dev = -1;
  CHECK(hipInit(0));
  CHECK(hipGetDeviceCount(&count));
  CHECK(hipSetDevice(count - 1));
  CHECK(hipGetDevice(&dev));
  CHECK(hipSetDevice(0));
  printf("devices %d %d\n", count, dev);

  // The program's kernels, registered as hipcc's start-up code does, and the same code object
  // loaded as a module.
  void** fatbin = register_kernels(image);
  hipModule_t module;
  CHECK(hipModuleLoadData(&module, image));
  CHECK(hipModuleGetFunction(&fn_fill, module, "fill_u32"));
  CHECK(hipModuleGetFunction(&fn_axpy, module, "axpy_f32"));
  CHECK(hipModuleGetFunction(&fn_copy, module, "copy_u32"));

  // fill: hipLaunchKernel on the null stream; the whole buffer, then only two blocks' worth.
  unsigned* a;
  CHECK(hipMalloc((void**)&a, N * 4));
  addrs[naddrs++] = a;
  {
    unsigned value = 0xa5a5a5a5u, n = N;
    void* args[] = {&a, &value, &n};
    CHECK(hipLaunchKernel(&fill_u32_stub, (dim3){GRID, 1, 1}, (dim3){BLOCK, 1, 1}, args, 0, 0));
    value = 7;
    CHECK(hipLaunchKernel(&fill_u32_stub, (dim3){2, 1, 1}, (dim3){BLOCK, 1, 1}, args, 0, 0));
  }
  CHECK(hipMemcpy(host, a, N * 4, hipMemcpyDeviceToHost));
  printf("fill %016llx\n", fnv(host, N * 4));

  // streams: axpy on s1, then a copy of its result on s2 after s1's event.
  hipStream_t s1, s2;
  hipEvent_t done;
  CHECK(hipStreamCreate(&s1));
  CHECK(hipStreamCreateWithPriority(&s2, hipStreamNonBlocking, -1));
  CHECK(hipEventCreate(&done));
  for (unsigned i = 0; i < N; i++) { xh[i] = (float)(i % 97); yh[i] = (float)(i % 13) - 6.0f; }
  float *x, *y;
  unsigned* c;
  CHECK(hipMallocAsync((void**)&x, N * 4, s1));
  CHECK(hipMallocAsync((void**)&y, N * 4, s1));
  addrs[naddrs++] = x;
  addrs[naddrs++] = y;
  CHECK(hipMemcpyAsync(x, xh, N * 4, hipMemcpyHostToDevice, s1));
  CHECK(hipMemcpyAsync(y, yh, N * 4, hipMemcpyHostToDevice, s1));
  {
    float factor = 3.0f;
    unsigned n = N;
    void* params[] = {&y, &x, &factor, &n};
    CHECK(hipModuleLaunchKernel(fn_axpy, GRID, 1, 1, BLOCK, 1, 1, 0, s1, params, 0));
  }
  CHECK(hipEventRecord(done, s1));
  CHECK(hipStreamWaitEvent(s2, done, 0));
  CHECK(hipMallocAsync((void**)&c, N * 4, s2));
  addrs[naddrs++] = c;
  module_copy(s2, c, y, N);
  memset(host, 0, sizeof host);
  CHECK(hipMemcpyAsync(host, c, N * 4, hipMemcpyDeviceToHost, s2));
  CHECK(hipStreamSynchronize(s2));
  printf("streams %016llx\n", fnv(host, N * 4));
  CHECK(hipEventSynchronize(done));
  CHECK(hipFreeAsync(x, s1));
  CHECK(hipFreeAsync(y, s1));
  CHECK(hipFreeAsync(c, s2));
  CHECK(hipStreamSynchronize(s1));
  CHECK(hipStreamSynchronize(s2));

  // pool: blocks from an explicit pool; a freed one is reused.
  hipMemPool_t pool = device_pool();
  unsigned *p1, *p2, *p3;
  CHECK(hipMallocFromPoolAsync((void**)&p1, 4096 * 4, pool, s1));
  CHECK(hipMallocFromPoolAsync((void**)&p2, N * 4, pool, s1));
  CHECK(hipFreeAsync(p1, s1));
  CHECK(hipStreamSynchronize(s1));
  CHECK(hipMallocFromPoolAsync((void**)&p3, 1000 * 4, pool, s1));
  addrs[naddrs++] = p1;
  addrs[naddrs++] = p2;
  addrs[naddrs++] = p3;
  module_fill(s1, p2, 0x11111111u, N);
  module_fill(s1, p3, 0x22222222u, 1000);
  module_copy(s1, p2 + 500, p3, 1000);
  CHECK(hipMemcpyAsync(host, p2, N * 4, hipMemcpyDeviceToHost, s1));
  CHECK(hipStreamSynchronize(s1));
  printf("pool %d %016llx\n", p3 == p1, fnv(host, N * 4));
  CHECK(hipFreeAsync(p2, s1));
  CHECK(hipFreeAsync(p3, s1));
  CHECK(hipStreamSynchronize(s1));
  CHECK(hipMemPoolDestroy(pool));

  // graph: axpy, a copy and a copy back to the host captured on s1, then launched three times.
  float *gx, *gy;
  unsigned* gz;
  CHECK(hipMalloc((void**)&gx, N * 4));
  CHECK(hipMalloc((void**)&gy, N * 4));
  CHECK(hipMalloc((void**)&gz, N * 4));
  addrs[naddrs++] = gx;
  addrs[naddrs++] = gy;
  addrs[naddrs++] = gz;
  for (unsigned i = 0; i < N; i++) { xh[i] = (float)(i % 7); yh[i] = 1.0f; }
  CHECK(hipMemcpy(gx, xh, N * 4, hipMemcpyHostToDevice));
  CHECK(hipMemcpy(gy, yh, N * 4, hipMemcpyHostToDevice));
  memset(host2, 0, sizeof host2);
  hipGraph_t graph;
  hipGraphExec_t exec;
  CHECK(hipStreamBeginCapture(s1, hipStreamCaptureModeGlobal));
  {
    float factor = 2.0f;
    unsigned n = N;
    void* args[] = {&gy, &gx, &factor, &n};
    CHECK(hipLaunchKernel(&axpy_f32_stub, (dim3){GRID, 1, 1}, (dim3){BLOCK, 1, 1}, args, 0, s1));
    factor = 100.0f;  // the graph keeps the value it captured
    void* cargs[] = {&gz, &gy, &n};
    CHECK(hipLaunchKernel(&copy_u32_stub, (dim3){GRID, 1, 1}, (dim3){BLOCK, 1, 1}, cargs, 0, s1));
  }
  CHECK(hipMemcpyAsync(host2, gz, N * 4, hipMemcpyDeviceToHost, s1));
  CHECK(hipStreamEndCapture(s1, &graph));
  CHECK(hipStreamSynchronize(s1));
  CHECK(hipMemcpy(host, gy, N * 4, hipMemcpyDeviceToHost));
  printf("graph-captured %016llx\n", fnv(host, N * 4));
  CHECK(hipGraphInstantiate(&exec, graph, 0, 0, 0));
  for (int i = 0; i < 3; i++) CHECK(hipGraphLaunch(exec, s1));
  CHECK(hipStreamSynchronize(s1));
  printf("graph %016llx\n", fnv(host2, N * 4));
  CHECK(hipGraphExecDestroy(exec));
  CHECK(hipGraphDestroy(graph));

  // vmm: two physical allocations mapped into one reservation, filled, then mapped the other
  // way round: the bytes follow their allocation.
  size_t gran;
  hipMemAllocationProp prop = device_allocation(&gran);
  char* va;
  hipMemGenericAllocationHandle_t h1, h2;
  CHECK(hipMemAddressReserve((void**)&va, 2 * gran, 0, 0, 0));
  addrs[naddrs++] = va;
  CHECK(hipMemCreate(&h1, gran, &prop, 0));
  CHECK(hipMemCreate(&h2, gran, &prop, 0));
  map_pair(va, gran, h1, h2);
  module_fill(0, va, 0x33333333u, (unsigned)(gran / 4));
  module_fill(0, va + gran, 0x44444444u, (unsigned)(gran / 4));
  int busy = hipMemRelease(h1);
  CHECK(hipMemUnmap(va, 2 * gran));
  map_pair(va, gran, h2, h1);
  unsigned* back = malloc(2 * gran);
  if (!back) return 1;
  CHECK(hipMemcpy(back, va, 2 * gran, hipMemcpyDeviceToHost));
  printf("vmm %zu %d %016llx\n", gran, busy, fnv(back, 2 * gran));
  free(back);
  CHECK(hipMemUnmap(va, 2 * gran));
  CHECK(hipMemRelease(h1));
  CHECK(hipMemRelease(h2));
  CHECK(hipMemAddressFree(va, 2 * gran));

  // procaddress: hipMemsetAsync called through hipGetProcAddress; a name the runtime lacks.
  hipError_t (*memset_async)(void*, int, size_t, hipStream_t) = 0;
  hipDriverProcAddressQueryResult status = HIP_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  CHECK(hipGetProcAddress("hipMemsetAsync", (void**)&memset_async, 604, 0, &status));
  CHECK(memset_async(a, 0x5a, N * 4, 0));
  CHECK(hipMemcpy(host, a, N * 4, hipMemcpyDeviceToHost));
  printf("procaddress %d %016llx\n", status, fnv(host, N * 4));
  void* missing = &status;
  int missing_err = hipGetProcAddress("hipNoSuchCall", &missing, 604, 0, &status);
  printf("procaddress-missing %d %d %d\n", missing_err, status, missing == 0);

  // threads: four at once.
  {
    static struct worker workers[4];
    pthread_t t[4];
    for (int i = 0; i < 4; i++) {
      workers[i].value = 0x1000u * (unsigned)(i + 1);
      if (pthread_create(&t[i], 0, work, &workers[i]) != 0) return 1;
    }
    unsigned long long d = 0;
    for (int i = 0; i < 4; i++) {
      pthread_join(t[i], 0);
      d ^= fnv(workers[i].out, N * 4);
    }
    printf("threads %016llx\n", d);
  }

  // errors: the codes of calls that must fail, and the last error.
  (void)hipGetLastError();
  int e_dev = hipSetDevice(99);
  int e_free = hipFree((void*)0x1234);
  hipFunction_t none;
  int e_fn = hipModuleGetFunction(&none, module, "no_such_kernel");
  hipModule_t bad;
  int e_img = hipModuleLoadData(&bad, "this is not a code object, not even an ELF file.........."
                                      "................................................");
  int last = hipGetLastError(), after = hipGetLastError();
  printf("errors %d %d %d %d %d %d\n", e_dev, e_free, e_fn, e_img, last, after);
  printf("errstr %s|%s\n", hipGetErrorName(hipErrorInvalidValue), hipGetErrorString(hipErrorInvalidValue));

  CHECK(hipFree(a));
  CHECK(hipFree(gx));
  CHECK(hipFree(gy));
  CHECK(hipFree(gz));
  CHECK(hipEventDestroy(done));
  CHECK(hipStreamDestroy(s1));
  CHECK(hipStreamDestroy(s2));
  CHECK(hipModuleUnload(module));
  __hipUnregisterFatBinary(fatbin);
  CHECK(hipDeviceSynchronize());
  printf("addresses");
  for (int i = 0; i < naddrs; i++) printf(" %p", addrs[i]);
  printf("\n");
  free(image);
  return 0;
}
