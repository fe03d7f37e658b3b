// What the HIP test programs (hip-sim-job.c, hip-session-job.c) share: the error check, the
// code object read from a file, the host stubs hipLaunchKernel launches by (what hipcc would
// generate, registered by name), and device 0's memory pools and mapped allocations.
#ifndef HIP_JOB_H
#define HIP_JOB_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hip/hip_runtime_api.h>

#define CHECK(call)                                                                       \
  do {                                                                                    \
    hipError_t e_ = (call);                                                               \
    if (e_ != hipSuccess) {                                                               \
      fprintf(stderr, "line %d: %s: %s (%d)\n", __LINE__, #call, hipGetErrorName(e_), e_); \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

static const char fill_u32_stub, axpy_f32_stub, copy_u32_stub;

static void* read_file(const char* path) {
  FILE* f = fopen(path, "rb");
  if (!f) { perror(path); exit(1); }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  void* p = malloc((size_t)n);
  if (!p || fread(p, 1, (size_t)n, f) != (size_t)n) { perror(path); exit(1); }
  fclose(f);
  return p;
}

// The program's kernels registered as hipcc's start-up code does (from `image`, the code
// object); exits on a failure.
static void** register_kernels(void* image) {
  static __CudaFatBinaryWrapper wrapper = {HIP_FATBIN_MAGIC, 1, 0, 0};
  wrapper.binary = image;
  void** fatbin = __hipRegisterFatBinary(&wrapper);
  if (!fatbin) { fprintf(stderr, "__hipRegisterFatBinary failed\n"); exit(1); }
  __hipRegisterFunction(fatbin, &fill_u32_stub, "fill_u32", "fill_u32", ~0u, 0, 0, 0, 0, 0);
  __hipRegisterFunction(fatbin, &axpy_f32_stub, "axpy_f32", "axpy_f32", ~0u, 0, 0, 0, 0, 0);
  __hipRegisterFunction(fatbin, &copy_u32_stub, "copy_u32", "copy_u32", ~0u, 0, 0, 0, 0, 0);
  return fatbin;
}

// A memory pool of device 0's memory; exits on a failure.
static hipMemPool_t device_pool(void) {
  hipMemPool_t pool;
  hipMemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = hipMemAllocationTypePinned;
  props.location.type = hipMemLocationTypeDevice;
  props.location.id = 0;
  CHECK(hipMemPoolCreate(&pool, &props));
  return pool;
}

// The properties of a physical allocation of device 0's memory, and in `*gran` the size its
// allocations are a multiple of; exits on a failure.
static hipMemAllocationProp device_allocation(size_t* gran) {
  hipMemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = hipMemAllocationTypePinned;
  prop.location.type = hipMemLocationTypeDevice;
  prop.location.id = 0;
  *gran = 0;
  CHECK(hipMemGetAllocationGranularity(gran, &prop, hipMemAllocationGranularityMinimum));
  return prop;
}

// Maps `first` then `second`, `piece` bytes each, into the reservation at `va` and lets device 0
// read and write the two; exits on a failure.
static void map_pair(char* va, size_t piece, hipMemGenericAllocationHandle_t first,
                     hipMemGenericAllocationHandle_t second) {
  hipMemAccessDesc access = {{hipMemLocationTypeDevice, 0}, hipMemAccessFlagsProtReadWrite};
  CHECK(hipMemMap(va, piece, 0, first, 0));
  CHECK(hipMemMap(va + piece, piece, 0, second, 0));
  CHECK(hipMemSetAccess(va, 2 * piece, &access, 1));
}

#endif
