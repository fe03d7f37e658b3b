// A HIP program that steps until it is killed, for checkpoints of a running HIP job (on the
// simulated runtime, fake-libamdhip64.c, or a real one given the same code object). Each step
// works on three streams: a block from an explicit pool filled and added into Y by registered
// stub (hipLaunchKernel), a captured graph adding X into Y, then Y copied into Z through a
// module launch's `extra` buffer and Z subtracted from X, with memsets and a stream-ordered
// scratch buffer on the way; then W, two pieces of memory the job maps itself into one range
// (virtual memory management), takes X's words with each piece's first word the step number. Every value depends on every earlier step, so a buffer restored
// wrong shows in every step after.
//
//   hip-session-job KERNELS.hsaco [STEPS]
//
// It prints `ready` once set up, then `step N DIGEST` after step N (DIGEST: FNV-1a 64 of X, Y,
// Z and W read back), sleeping 2 ms between steps; with STEPS, it stops after that many. With
// HIP_JOB_MANAGED=1 in its environment it also holds a managed allocation, with HIP_JOB_HSA=1
// one made through HSA below HIP (possum saves neither).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <hip/hip_runtime_api.h>

#include "hip-job.h"

#define N (256u * 1024u)
#define BLOCK 256u
#define GRID ((N + BLOCK - 1) / BLOCK)

static unsigned long long fnv(unsigned long long h, const void* p, size_t n) {
  const unsigned char* b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

// axpy_f32(y, x, a, N) through hipLaunchKernel on `s`: Y += a X.
static void axpy(hipStream_t s, float* y, float* x, float a) {
  unsigned n = N;
  void* args[] = {&y, &x, &a, &n};
  CHECK(hipLaunchKernel(&axpy_f32_stub, (dim3){GRID, 1, 1}, (dim3){BLOCK, 1, 1}, args, 0, s));
}

int main(int argc, char** argv) {
  if (argc < 2) { fprintf(stderr, "usage: %s KERNELS.hsaco [STEPS]\n", argv[0]); return 2; }
  long steps = argc > 2 ? atol(argv[2]) : -1;
  void* image = read_file(argv[1]);
  static float xh[N], yh[N];
  static unsigned zh[N], wh[N];
  CHECK(hipInit(0));
  CHECK(hipSetDevice(0));

  register_kernels(image);
  hipModule_t module;
  hipFunction_t fn_axpy, fn_copy;
  CHECK(hipModuleLoadData(&module, image));
  CHECK(hipModuleGetFunction(&fn_axpy, module, "axpy_f32"));
  CHECK(hipModuleGetFunction(&fn_copy, module, "copy_u32"));

  hipStream_t s1, s2, s3;
  CHECK(hipStreamCreate(&s1));
  CHECK(hipStreamCreateWithPriority(&s2, 0, 0));
  CHECK(hipStreamCreate(&s3));
  hipEvent_t e1, e2;
  CHECK(hipEventCreate(&e1));
  CHECK(hipEventCreate(&e2));
  hipMemPool_t pool = device_pool();

  float *x, *y;
  unsigned* z;
  CHECK(hipMalloc((void**)&x, N * 4));
  CHECK(hipMalloc((void**)&y, N * 4));
  CHECK(hipMallocAsync((void**)&z, N * 4, s3));
  for (unsigned i = 0; i < N; i++) { xh[i] = (float)(i % 13) * 0.25f; yh[i] = 1.0f; }
  CHECK(hipMemcpy(x, xh, N * 4, hipMemcpyHostToDevice));
  CHECK(hipMemcpy(y, yh, N * 4, hipMemcpyHostToDevice));
  CHECK(hipMemsetAsync(z, 0, N * 4, s3));
  CHECK(hipStreamSynchronize(s3));

  // W: a range of the job's own, two pieces of N * 2 bytes each mapped into it.
  size_t gran;
  hipMemAllocationProp prop = device_allocation(&gran);
  size_t piece = ((size_t)N * 2 + gran - 1) / gran * gran;
  unsigned* w;
  hipMemGenericAllocationHandle_t h1, h2;
  CHECK(hipMemAddressReserve((void**)&w, 2 * piece, 0, 0, 0));
  CHECK(hipMemCreate(&h1, piece, &prop, 0));
  CHECK(hipMemCreate(&h2, piece, &prop, 0));
  map_pair((char*)w, piece, h1, h2);
  CHECK(hipMemsetAsync(w, 0, N * 4, s3));
  CHECK(hipStreamSynchronize(s3));

  // The graph: Y += 0.5 X, captured on s2.
  hipGraph_t graph;
  hipGraphExec_t exec;
  CHECK(hipStreamBeginCapture(s2, hipStreamCaptureModeGlobal));
  axpy(s2, y, x, 0.5f);
  CHECK(hipStreamEndCapture(s2, &graph));
  CHECK(hipGraphInstantiate(&exec, graph, 0, 0, 0));
  if (getenv("HIP_JOB_MANAGED")) {
    void* managed;
    CHECK(hipMallocManaged(&managed, 1 << 20, hipMemAttachGlobal));
  }
  if (getenv("HIP_JOB_HSA")) {
    void* below;
    hsa_amd_memory_pool_t any = {0};
    if (hsa_amd_memory_pool_allocate(any, 1 << 20, 0, &below) != 0) {
      fprintf(stderr, "hsa_amd_memory_pool_allocate failed\n");
      return 1;
    }
  }
  printf("ready\n");
  fflush(stdout);

  for (long step = 1; steps < 0 || step <= steps; step++) {
    // s1: a pool block filled with the step's value (as float bits), Y += 2^-10 * block.
    unsigned* t;
    CHECK(hipMallocFromPoolAsync((void**)&t, N * 4, pool, s1));
    {
      float v = (float)(step % 17) * 0.125f;
      unsigned bits, n = N;
      memcpy(&bits, &v, 4);
      void* fargs[] = {&t, &bits, &n};
      CHECK(hipLaunchKernel(&fill_u32_stub, (dim3){GRID, 1, 1}, (dim3){BLOCK, 1, 1}, fargs, 0, s1));
    }
    axpy(s1, y, (float*)t, 1.0f / 1024.0f);
    CHECK(hipFreeAsync(t, s1));
    CHECK(hipEventRecord(e1, s1));
    // s2, after s1: the graph, Y += 0.5 X.
    CHECK(hipStreamWaitEvent(s2, e1, 0));
    CHECK(hipGraphLaunch(exec, s2));
    CHECK(hipEventRecord(e2, s2));
    // s3, after s2: Z = Y (module launch, extra buffer), X -= 2^-4 Z (module launch, params),
    // the last 64 words of a scratch block zeroed and copied over Z's first.
    CHECK(hipStreamWaitEvent(s3, e2, 0));
    {
      struct { void* dst; const void* src; unsigned n; unsigned pad; } cargs = {z, y, N, 0};
      size_t size = sizeof cargs;
      void* extra[] = {HIP_LAUNCH_PARAM_BUFFER_POINTER, &cargs, HIP_LAUNCH_PARAM_BUFFER_SIZE,
                       &size, HIP_LAUNCH_PARAM_END};
      CHECK(hipModuleLaunchKernel(fn_copy, GRID, 1, 1, BLOCK, 1, 1, 0, s3, 0, extra));
      float a = -1.0f / 16.0f;
      unsigned n = N;
      float* zf = (float*)z;
      void* params[] = {&x, &zf, &a, &n};
      CHECK(hipModuleLaunchKernel(fn_axpy, GRID, 1, 1, BLOCK, 1, 1, 0, s3, params, 0));
      unsigned* scratch;
      CHECK(hipMallocAsync((void**)&scratch, 4096, s3));
      CHECK(hipMemsetAsync(scratch, (int)(step & 0xff), 4096, s3));
      CHECK(hipMemcpyAsync(z, scratch, 256, hipMemcpyDeviceToDevice, s3));
      CHECK(hipFreeAsync(scratch, s3));
      void* wargs[] = {&w, &x, &n};
      CHECK(hipModuleLaunchKernel(fn_copy, GRID, 1, 1, BLOCK, 1, 1, 0, s3, wargs, 0));
      static unsigned mark;  // read by the copies when the stream runs them
      mark = (unsigned)step;
      CHECK(hipMemcpyAsync(w, &mark, 4, hipMemcpyHostToDevice, s3));
      CHECK(hipMemcpyAsync((char*)w + piece, &mark, 4, hipMemcpyHostToDevice, s3));
    }
    CHECK(hipStreamSynchronize(s3));
    CHECK(hipMemcpy(xh, x, N * 4, hipMemcpyDeviceToHost));
    CHECK(hipMemcpy(yh, y, N * 4, hipMemcpyDeviceToHost));
    CHECK(hipMemcpy(zh, z, N * 4, hipMemcpyDeviceToHost));
    CHECK(hipMemcpy(wh, w, N * 4, hipMemcpyDeviceToHost));
    unsigned long long h = 0xcbf29ce484222325ull;
    h = fnv(h, xh, N * 4);
    h = fnv(h, yh, N * 4);
    h = fnv(h, zh, N * 4);
    h = fnv(h, wh, N * 4);
    printf("step %ld %016llx\n", step, h);
    fflush(stdout);
    struct timespec ts = {0, 2000000};
    nanosleep(&ts, 0);
  }
  return 0;
}
