// fake-libamdhip64: a simulated HIP runtime (a stand-in for libamdhip64.so) for tests on a
// machine without an AMD GPU. It exports a subset of the HIP runtime API with HIP's signatures
// and error codes (declared in include/hip/hip_runtime_api.h) over host memory.
//
//   cc -O1 -shared -fPIC -Wl,-Bsymbolic -Wl,-soname,libamdhip64.so.6
//      -o DIR/libamdhip64.so.6 hip/testdata/fake-libamdhip64.c -lpthread
//
// What it simulates:
// - Devices: FAKE_HIP_DEVICES of them (1 to 8, default 1); FAKE_HIP_NODEV=1 makes hipInit and
//   hipGetDeviceCount answer hipErrorNoDevice. The current device is per thread.
// - Device memory is host memory in one arena the library reserves at a fixed address
//   (FAKE_HIP_VA_BASE, default 0x7e0000000000; 64 GiB of address space, PROT_NONE until used).
//   Addresses are handed out in order and never reused by another allocation, so the same
//   sequence of calls gets the same addresses in every run: device addresses are VA-stable.
//   hipMalloc (and hipMallocManaged and HSA's hsa_amd_memory_pool_allocate, the same memory:
//   every byte is host memory here), memory
//   pools (hipMemPoolCreate, hipMallocAsync on the device's default pool,
//   hipMallocFromPoolAsync) and hipMemAddressReserve all carve from it. A pool reuses the blocks
//   freed into it (first fit), as a real pool does.
// - Virtual memory management: hipMemCreate is a memfd, hipMemMap maps it MAP_SHARED into a
//   reserved range (no access until hipMemSetAccess), hipMemUnmap puts PROT_NONE address space
//   back: the same handle mapped elsewhere shows the same bytes.
// - Streams are deferred queues: copies, memsets, launches, stream-ordered frees, event records
//   and waits are queued on their stream and run, in order, only when something waits for them
//   (hipStreamSynchronize, hipEventSynchronize, hipDeviceSynchronize, a hipStreamWaitEvent's
//   op, the synchronous hipMemcpy, or any op on the null stream, which first drains every
//   stream of its device as the legacy default stream does). A program that reads device memory
//   without waiting sees stale bytes, as it could on a GPU. Ops run on the thread that waits;
//   one lock serialises every call, so calls from several threads are safe.
// - Kernels: a code object passed to hipModuleLoadData (or registered with
//   __hipRegisterFatBinary) must be an AMDGPU ELF file (e_machine 224); hipModuleGetFunction
//   finds `<name>.kd` in its dynamic symbol table, and only the kernels in `kernels[]` below
//   (those of sim-kernels.cl) can be launched: a launch packs the arguments at the kernel's
//   kernarg offsets, as the runtime does from the code object's metadata, and runs the C
//   version of the kernel over gridDim.x * blockDim.x work-items. hipLaunchKernel finds the
//   kernel by the host stub address __hipRegisterFunction registered.
// - Graphs: hipStreamBeginCapture..hipStreamEndCapture records the ops queued on the capturing
//   stream (kernel arguments are copied at capture, as kernel nodes keep theirs); a graph
//   launch queues a copy of them on the stream it is launched on.
// - Pinned host memory: hipHostMalloc is page-aligned anonymous memory (every host byte is
//   reachable by the simulated device anyway); hipHostFree takes only what hipHostMalloc gave.
// - Events: hipEventQuery answers hipErrorNotReady until the ops before the record have run
//   (it does not run them: nothing runs until something waits). hipEventCreateWithFlags
//   checks the flags and otherwise ignores them.
// - Stream priorities: hipDeviceGetStreamPriorityRange answers (1, -1) as ROCm's runtime does
//   (low, high; smaller is more urgent), hipStreamCreateWithPriority clamps into that range and
//   hipStreamGetPriority reads it back. Priorities change no order (ops run when waited for),
//   but they are observable: fakeHipCopiesAtPriority(p) counts the hipMemcpyAsync calls queued
//   so far on streams of priority p (a test hook of this library's, not HIP's).
// - hipMemGetInfo reports the arena's untaken address space as free memory; hipDeviceGetName
//   names the device "Simulated HIP device N".
// - hipGetProcAddress answers with this library's own exported functions.
//
// What it does not simulate: real concurrency between streams (or with the host), stream
// priorities' effect on scheduling, multi-stream capture (fork/join through events in a capture),
// memory allocation inside a capture, peer access, IPC, managed memory, textures, any kernel not
// in `kernels[]`, device code of any kind, timing, and the GPU's memory model. It proves nothing
// about ROCm; it lets possum's HIP front end be built and tested on the CPU.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "include/hip/hip_runtime_api.h"

#define MAXDEV 8
#define ARENA_SIZE (64ull << 30)
#define POOL_SIZE (256ull << 20)
#define GRANULARITY (64ull << 10)
#define ALIGN 256
#define PRIO_LOW 1
#define PRIO_HIGH (-1)

// Guards all of the library's state. Recursive: a drain runs ops that free pool blocks, and
// hipMallocAsync makes its pool under it.
static pthread_mutex_t lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
static __thread int cur_dev;
static __thread hipError_t last_error;

// Every entry point returns through RET: the error is remembered for hipGetLastError.
#define RET(e) do { hipError_t e_ = (e); if (e_ != hipSuccess) last_error = e_; return e_; } while (0)

// ---------------------------------------------------------------------------------------------
// Devices.

static int ndev(void) {
  const char* e = getenv("FAKE_HIP_DEVICES");
  int n = e ? atoi(e) : 1;
  return n < 1 ? 1 : n > MAXDEV ? MAXDEV : n;
}

hipError_t hipInit(unsigned int flags) {
  if (flags != 0) RET(hipErrorInvalidValue);
  RET(getenv("FAKE_HIP_NODEV") ? hipErrorNoDevice : hipSuccess);
}

hipError_t hipGetDeviceCount(int* count) {
  if (!count) RET(hipErrorInvalidValue);
  if (getenv("FAKE_HIP_NODEV")) { *count = 0; RET(hipErrorNoDevice); }
  *count = ndev();
  RET(hipSuccess);
}

hipError_t hipSetDevice(int d) {
  if (d < 0 || d >= ndev()) RET(hipErrorInvalidDevice);
  cur_dev = d;
  RET(hipSuccess);
}

hipError_t hipGetDevice(int* d) {
  if (!d) RET(hipErrorInvalidValue);
  *d = cur_dev;
  RET(hipSuccess);
}

hipError_t hipGetLastError(void) {
  hipError_t e = last_error;
  last_error = hipSuccess;
  return e;
}

static const struct { hipError_t e; const char* name; const char* text; } errors[] = {
  {hipSuccess, "hipSuccess", "no error"},
  {hipErrorInvalidValue, "hipErrorInvalidValue", "invalid argument"},
  {hipErrorOutOfMemory, "hipErrorOutOfMemory", "out of memory"},
  {hipErrorNotInitialized, "hipErrorNotInitialized", "initialization error"},
  {hipErrorInvalidConfiguration, "hipErrorInvalidConfiguration", "invalid configuration argument"},
  {hipErrorInvalidDevicePointer, "hipErrorInvalidDevicePointer", "invalid device pointer"},
  {hipErrorInvalidMemcpyDirection, "hipErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"},
  {hipErrorInvalidDeviceFunction, "hipErrorInvalidDeviceFunction", "invalid device function"},
  {hipErrorNoDevice, "hipErrorNoDevice", "no ROCm-capable device is detected"},
  {hipErrorInvalidDevice, "hipErrorInvalidDevice", "invalid device ordinal"},
  {hipErrorInvalidImage, "hipErrorInvalidImage", "device kernel image is invalid"},
  {hipErrorMapFailed, "hipErrorMapFailed", "mapping of buffer object failed"},
  {hipErrorUnmapFailed, "hipErrorUnmapFailed", "unmapping of buffer object failed"},
  {hipErrorAlreadyMapped, "hipErrorAlreadyMapped", "resource already mapped"},
  {hipErrorNotMapped, "hipErrorNotMapped", "resource not mapped"},
  {hipErrorInvalidHandle, "hipErrorInvalidHandle", "invalid resource handle"},
  {hipErrorIllegalState, "hipErrorIllegalState", "the operation cannot be performed in the present state"},
  {hipErrorNotFound, "hipErrorNotFound", "named symbol not found"},
  {hipErrorNotReady, "hipErrorNotReady", "device not ready"},
  {hipErrorNotSupported, "hipErrorNotSupported", "operation not supported"},
  {hipErrorStreamCaptureUnsupported, "hipErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"},
  {hipErrorStreamCaptureUnmatched, "hipErrorStreamCaptureUnmatched", "capture was not initiated in this stream"},
  {hipErrorCapturedEvent, "hipErrorCapturedEvent", "operation not permitted on an event last recorded in a capturing stream"},
};

const char* hipGetErrorName(hipError_t e) {
  for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
    if (errors[i].e == e) return errors[i].name;
  return "hipErrorUnknown";
}

const char* hipGetErrorString(hipError_t e) {
  for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
    if (errors[i].e == e) return errors[i].text;
  return "unknown error";
}

// ---------------------------------------------------------------------------------------------
// The arena: device address space at a fixed place, handed out in order.

static uintptr_t arena_base, arena_next;

// Address space of `size` bytes aligned to `align`, PROT_NONE; 0 when the arena is spent.
static uintptr_t arena_take(size_t size, size_t align) {
  if (!arena_base) {
    const char* e = getenv("FAKE_HIP_VA_BASE");
    uintptr_t want = e ? (uintptr_t)strtoull(e, 0, 0) : (uintptr_t)0x7e0000000000ull;
    void* p = mmap((void*)want, ARENA_SIZE, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == MAP_FAILED) return 0;
    arena_base = arena_next = (uintptr_t)p;
  }
  if (align < ALIGN) align = ALIGN;
  uintptr_t at = (arena_next + align - 1) & ~(uintptr_t)(align - 1);
  if (size > ARENA_SIZE || at + size > arena_base + ARENA_SIZE) return 0;
  arena_next = at + ((size + GRANULARITY - 1) & ~(GRANULARITY - 1));
  return at;
}

static int in_arena(uintptr_t p, size_t n) {
  return arena_base && p >= arena_base && p + n <= arena_next && p + n >= p;
}

// Gives [at, at+size) back to PROT_NONE, its pages dropped.
static void arena_drop(uintptr_t at, size_t size) {
  mmap((void*)at, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
}

// hipMalloc'd blocks.
struct block { uintptr_t at; size_t size; struct block* next; };
static struct block* blocks;

static size_t rounded(size_t n) { return (n + GRANULARITY - 1) & ~(GRANULARITY - 1); }

hipError_t hipMalloc(void** ptr, size_t size) {
  if (!ptr) RET(hipErrorInvalidValue);
  if (size == 0) { *ptr = 0; RET(hipSuccess); }
  pthread_mutex_lock(&lock);
  uintptr_t at = arena_take(size, ALIGN);
  if (at && mprotect((void*)at, rounded(size), PROT_READ | PROT_WRITE) != 0) at = 0;
  struct block* b = at ? malloc(sizeof *b) : 0;
  if (b) { b->at = at; b->size = size; b->next = blocks; blocks = b; }
  pthread_mutex_unlock(&lock);
  if (!b) RET(hipErrorOutOfMemory);
  *ptr = (void*)at;
  RET(hipSuccess);
}

// HSA's pool allocation, below HIP (in ROCm it is libhsa-runtime64's): device memory as
// hipMalloc's; any pool handle is taken.
unsigned hsa_amd_memory_pool_allocate(hsa_amd_memory_pool_t pool, size_t size, unsigned flags,
                                      void** ptr) {
  (void)pool;
  if (flags || !ptr || !size) return 0x1001;  // HSA_STATUS_ERROR_INVALID_ARGUMENT
  return hipMalloc(ptr, size) == hipSuccess ? 0 : 0x1008;  // ..._OUT_OF_RESOURCES
}

unsigned hsa_amd_memory_pool_free(void* ptr) {
  return hipFree(ptr) == hipSuccess ? 0 : 0x1001;
}

hipError_t hipMallocManaged(void** ptr, size_t size, unsigned int flags) {
  if (flags != 1 && flags != 2) RET(hipErrorInvalidValue);  // hipMemAttachGlobal, ...Host
  return hipMalloc(ptr, size);
}

static void drain_all(int dev);

hipError_t hipFree(void* ptr) {
  if (!ptr) RET(hipSuccess);
  drain_all(cur_dev);
  pthread_mutex_lock(&lock);
  struct block** pb = &blocks;
  while (*pb && (*pb)->at != (uintptr_t)ptr) pb = &(*pb)->next;
  struct block* b = *pb;
  if (b) { *pb = b->next; arena_drop(b->at, rounded(b->size)); free(b); }
  pthread_mutex_unlock(&lock);
  RET(b ? hipSuccess : hipErrorInvalidValue);
}

// ---------------------------------------------------------------------------------------------
// Memory pools: a 256 MiB range of the arena, its blocks allocated first fit.

struct piece { size_t off, size; int used; };
struct ihipMemPoolHandle_t {
  int dev;
  uintptr_t base;
  struct piece* pieces;
  size_t npieces;
};
static struct ihipMemPoolHandle_t* default_pool[MAXDEV];

static struct ihipMemPoolHandle_t* pool_new(int dev) {
  struct ihipMemPoolHandle_t* p = calloc(1, sizeof *p);
  if (!p) return 0;
  pthread_mutex_lock(&lock);
  p->base = arena_take(POOL_SIZE, GRANULARITY);
  if (p->base && mprotect((void*)p->base, POOL_SIZE, PROT_READ | PROT_WRITE) != 0) p->base = 0;
  pthread_mutex_unlock(&lock);
  p->pieces = malloc(sizeof *p->pieces);
  if (!p->base || !p->pieces) { free(p->pieces); free(p); return 0; }
  p->dev = dev;
  p->pieces[0] = (struct piece){0, POOL_SIZE, 0};
  p->npieces = 1;
  return p;
}

static uintptr_t pool_alloc(struct ihipMemPoolHandle_t* p, size_t size) {
  size = (size + ALIGN - 1) & ~(size_t)(ALIGN - 1);
  for (size_t i = 0; i < p->npieces; i++) {
    struct piece* q = &p->pieces[i];
    if (q->used || q->size < size) continue;
    if (q->size > size) {
      struct piece* more = realloc(p->pieces, (p->npieces + 1) * sizeof *more);
      if (!more) return 0;
      p->pieces = more;
      q = &p->pieces[i];
      memmove(q + 2, q + 1, (p->npieces - i - 1) * sizeof *q);
      q[1] = (struct piece){q->off + size, q->size - size, 0};
      q->size = size;
      p->npieces++;
    }
    q->used = 1;
    return p->base + q->off;
  }
  return 0;
}

// Frees the block at `at` if it is one of `p`'s: 1, else 0. Free neighbours are merged.
static int pool_free(struct ihipMemPoolHandle_t* p, uintptr_t at) {
  for (size_t i = 0; i < p->npieces; i++) {
    struct piece* q = &p->pieces[i];
    if (!q->used || p->base + q->off != at) continue;
    q->used = 0;
    if (i + 1 < p->npieces && !q[1].used) {
      q->size += q[1].size;
      memmove(q + 1, q + 2, (p->npieces - i - 2) * sizeof *q);
      p->npieces--;
    }
    if (i > 0 && !q[-1].used) {
      q[-1].size += q->size;
      memmove(q, q + 1, (p->npieces - i - 1) * sizeof *q);
      p->npieces--;
    }
    return 1;
  }
  return 0;
}

// Every pool, so that hipFreeAsync finds the one a block came from.
static struct ihipMemPoolHandle_t* pools[64];

static int pool_register(struct ihipMemPoolHandle_t* p) {
  for (size_t i = 0; i < 64; i++) if (!pools[i]) { pools[i] = p; return 1; }
  return 0;
}

hipError_t hipMemPoolCreate(hipMemPool_t* out, const hipMemPoolProps* props) {
  if (!out || !props) RET(hipErrorInvalidValue);
  if (props->allocType != hipMemAllocationTypePinned ||
      props->location.type != hipMemLocationTypeDevice)
    RET(hipErrorInvalidValue);
  if (props->location.id < 0 || props->location.id >= ndev()) RET(hipErrorInvalidDevice);
  struct ihipMemPoolHandle_t* p = pool_new(props->location.id);
  if (!p) RET(hipErrorOutOfMemory);
  pthread_mutex_lock(&lock);
  int ok = pool_register(p);
  pthread_mutex_unlock(&lock);
  if (!ok) RET(hipErrorOutOfMemory);
  *out = p;
  RET(hipSuccess);
}

hipError_t hipMemPoolDestroy(hipMemPool_t p) {
  pthread_mutex_lock(&lock);
  int found = 0;
  for (size_t i = 0; p && i < 64; i++) if (pools[i] == p) { pools[i] = 0; found = 1; }
  for (int d = 0; d < MAXDEV; d++) if (default_pool[d] == p) found = 0;
  if (found) { arena_drop(p->base, POOL_SIZE); free(p->pieces); free(p); }
  pthread_mutex_unlock(&lock);
  RET(found ? hipSuccess : hipErrorInvalidValue);
}

// ---------------------------------------------------------------------------------------------
// Kernels: the ones of sim-kernels.cl, run on the CPU over their packed kernarg bytes.

typedef void (*kernel_fn)(const unsigned char* kernarg, uint64_t items);
struct sim_kernel { const char* name; int nargs; size_t off[4]; size_t size[4]; size_t kernarg; kernel_fn run; };

// Reads the argument at kernarg offset `at` into `var`.
#define ARG(var, at) memcpy(&(var), kernarg + (at), sizeof(var))

static void k_fill_u32(const unsigned char* kernarg, uint64_t items) {
  uint32_t* out; uint32_t value, n;
  ARG(out, 0); ARG(value, 8); ARG(n, 12);
  for (uint64_t i = 0; i < items && i < n; i++) out[i] = value;
}

static void k_axpy_f32(const unsigned char* kernarg, uint64_t items) {
  float* y; const float* x; float a; uint32_t n;
  ARG(y, 0); ARG(x, 8); ARG(a, 16); ARG(n, 20);
  for (uint64_t i = 0; i < items && i < n; i++) y[i] = a * x[i] + y[i];
}

static void k_copy_u32(const unsigned char* kernarg, uint64_t items) {
  uint32_t* dst; const uint32_t* src; uint32_t n;
  ARG(dst, 0); ARG(src, 8); ARG(n, 16);
  for (uint64_t i = 0; i < items && i < n; i++) dst[i] = src[i];
}

// The explicit arguments' offsets and sizes are those of sim-kernels-gfx942.hsaco's metadata.
static const struct sim_kernel kernels[] = {
  {"fill_u32", 3, {0, 8, 12}, {8, 4, 4}, 16, k_fill_u32},
  {"axpy_f32", 4, {0, 8, 16, 20}, {8, 8, 4, 4}, 24, k_axpy_f32},
  {"copy_u32", 3, {0, 8, 16}, {8, 8, 4}, 20, k_copy_u32},
};
#define MAX_KERNARG 64

struct ihipModule_t { const unsigned char* image; size_t size; };
struct ihipModuleSymbol_t { const struct sim_kernel* k; struct ihipModule_t* module; };

static uint16_t rd16(const unsigned char* p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t rd32(const unsigned char* p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t rd64(const unsigned char* p) { uint64_t v; memcpy(&v, p, 8); return v; }

// The size of an AMDGPU code object from its ELF header (the section headers come last, as
// lld writes them); 0 when it is not one.
static size_t code_object_size(const unsigned char* e) {
  if (memcmp(e, "\x7f" "ELF", 4) != 0 || e[4] != 2 || e[5] != 1 || rd16(e + 18) != 224) return 0;
  uint64_t shoff = rd64(e + 40), phoff = rd64(e + 32);
  uint64_t sh_end = shoff + (uint64_t)rd16(e + 58) * rd16(e + 60);
  uint64_t ph_end = phoff + (uint64_t)rd16(e + 54) * rd16(e + 56);
  uint64_t end = sh_end > ph_end ? sh_end : ph_end;
  return end < 64 || end > (1ull << 30) ? 0 : (size_t)end;
}

// Whether the code object's dynamic symbol table has `sym`.
static int has_symbol(const struct ihipModule_t* m, const char* sym) {
  const unsigned char* e = m->image;
  uint64_t shoff = rd64(e + 40);
  unsigned shentsize = rd16(e + 58), shnum = rd16(e + 60);
  if (shentsize < 64) return 0;
  for (unsigned i = 0; i < shnum; i++) {
    const unsigned char* sh = e + shoff + (uint64_t)i * shentsize;
    if (rd32(sh + 4) != 11) continue;  // SHT_DYNSYM
    uint32_t link = rd32(sh + 40);
    if (link >= shnum) return 0;
    const unsigned char* str = e + shoff + (uint64_t)link * shentsize;
    uint64_t soff = rd64(sh + 24), ssize = rd64(sh + 32), entsize = rd64(sh + 56);
    uint64_t stroff = rd64(str + 24), strsize = rd64(str + 32);
    if (entsize < 24 || soff + ssize > m->size || stroff + strsize > m->size) return 0;
    for (uint64_t s = 0; s + entsize <= ssize; s += entsize) {
      uint32_t name = rd32(e + soff + s);
      if (name >= strsize) continue;
      const char* n = (const char*)e + stroff + name;
      size_t room = strsize - name, len = strlen(sym);
      if (room > len && memcmp(n, sym, len + 1) == 0) return 1;
    }
  }
  return 0;
}

static hipError_t module_load(struct ihipModule_t** out, const void* image) {
  if (!out || !image) return hipErrorInvalidValue;
  size_t size = code_object_size(image);
  if (!size) return hipErrorInvalidImage;
  struct ihipModule_t* m = malloc(sizeof *m);
  if (!m) return hipErrorOutOfMemory;
  m->image = image;
  m->size = size;
  *out = m;
  return hipSuccess;
}

hipError_t hipModuleLoadData(hipModule_t* module, const void* image) {
  RET(module_load(module, image));
}

hipError_t hipModuleUnload(hipModule_t module) {
  if (!module) RET(hipErrorInvalidHandle);
  free(module);
  RET(hipSuccess);
}

static hipError_t get_function(struct ihipModuleSymbol_t** out, struct ihipModule_t* m,
                               const char* name) {
  if (!out || !m || !name) return hipErrorInvalidValue;
  char sym[256];
  if (snprintf(sym, sizeof sym, "%s.kd", name) >= (int)sizeof sym) return hipErrorNotFound;
  if (!has_symbol(m, sym)) return hipErrorNotFound;
  for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++) {
    if (strcmp(kernels[i].name, name) != 0) continue;
    struct ihipModuleSymbol_t* f = malloc(sizeof *f);
    if (!f) return hipErrorOutOfMemory;
    f->k = &kernels[i];
    f->module = m;
    *out = f;
    return hipSuccess;
  }
  // In the code object, but the simulation cannot run it.
  return hipErrorNotSupported;
}

hipError_t hipModuleGetFunction(hipFunction_t* function, hipModule_t module, const char* kname) {
  RET(get_function(function, module, kname));
}

// ---------------------------------------------------------------------------------------------
// Streams: deferred queues of ops.

enum op_kind { OP_COPY, OP_SET, OP_KERNEL, OP_FREE, OP_RECORD, OP_WAIT };
struct op {
  enum op_kind kind;
  void* dst; const void* src; size_t n; int value;      // copy, set
  const struct sim_kernel* k; uint64_t items;             // kernel
  unsigned char kernarg[MAX_KERNARG];
  struct ihipMemPoolHandle_t* pool; uintptr_t at;         // free
  struct ihipEvent_t* event;                              // record, wait
  uint64_t seq;                                           // the event's record number
  struct ihipStream_t* recorder;                          // wait: the stream of that record
  struct op* next;
};

struct ihipGraph { struct op* head; struct op** tail; };
struct ihipStream_t {
  int dev;
  unsigned flags;
  int priority;
  struct op* head;
  struct op** tail;
  struct ihipGraph* capture;  // while capturing: the graph being recorded
  struct ihipStream_t* next;
};
// An event lives on, once destroyed, until no queued op refers to it (`refs`), as the
// runtime lets an event be destroyed while its record or a wait for it is still queued.
struct ihipEvent_t { struct ihipStream_t* stream; uint64_t recorded, done; int refs, destroyed; };

static struct ihipStream_t* streams;  // every stream but the null one

static void run_op(struct op* o);

// Frees a run op, and the event it referred to if that was destroyed and is referred to no more.
static void op_done(struct op* o) {
  struct ihipEvent_t* e = (o->kind == OP_RECORD || o->kind == OP_WAIT) ? o->event : 0;
  if (e && --e->refs == 0 && e->destroyed) free(e);
  free(o);
}

// Runs `s`'s queued ops in order, up to and including `until` (all of them when null).
static void drain(struct ihipStream_t* s, const struct op* until) {
  pthread_mutex_lock(&lock);
  while (s->head) {
    struct op* o = s->head;
    s->head = o->next;
    if (!s->head) s->tail = &s->head;
    int last = o == until;
    run_op(o);
    op_done(o);
    if (last) break;
  }
  pthread_mutex_unlock(&lock);
}

static void drain_all(int dev) {
  pthread_mutex_lock(&lock);
  for (struct ihipStream_t* s = streams; s; s = s->next)
    if (s->dev == dev) drain(s, 0);
  pthread_mutex_unlock(&lock);
}

// The op of `s` that records `e`'s number `seq`, if still queued.
static struct op* find_record(struct ihipStream_t* s, struct ihipEvent_t* e, uint64_t seq) {
  for (struct op* o = s ? s->head : 0; o; o = o->next)
    if (o->kind == OP_RECORD && o->event == e && o->seq == seq) return o;
  return 0;
}

static void run_op(struct op* o) {
  switch (o->kind) {
  case OP_COPY: memmove(o->dst, o->src, o->n); break;
  case OP_SET: memset(o->dst, o->value, o->n); break;
  case OP_KERNEL: o->k->run(o->kernarg, o->items); break;
  case OP_FREE: pool_free(o->pool, o->at); break;
  case OP_RECORD: if (o->event->done < o->seq) o->event->done = o->seq; break;
  case OP_WAIT: {
    struct ihipEvent_t* e = o->event;
    if (e->done < o->seq) drain(o->recorder, find_record(o->recorder, e, o->seq));
    break;
  }
  }
}

static int valid_stream(struct ihipStream_t* s) {
  int found = !s;
  pthread_mutex_lock(&lock);
  for (struct ihipStream_t* t = streams; t && !found; t = t->next) found = t == s;
  pthread_mutex_unlock(&lock);
  return found;
}

// Queues `o` on `s`: recorded into the graph when `s` is capturing, run at once (after every
// stream of the device) on the null stream.
static hipError_t submit(struct ihipStream_t* s, struct op* o) {
  if (!valid_stream(s)) { op_done(o); return hipErrorInvalidHandle; }
  pthread_mutex_lock(&lock);
  if (!s) {
    drain_all(cur_dev);
    run_op(o);
    op_done(o);
  } else {
    o->next = 0;
    struct op*** tail = s->capture ? &s->capture->tail : &s->tail;
    **tail = o;
    *tail = &o->next;
  }
  pthread_mutex_unlock(&lock);
  return hipSuccess;
}

static struct op* new_op(enum op_kind kind) {
  struct op* o = calloc(1, sizeof *o);
  if (o) o->kind = kind;
  return o;
}

static int bad_kind(hipMemcpyKind k) { return k < hipMemcpyHostToHost || k > hipMemcpyDefault; }

hipError_t hipStreamCreateWithPriority(hipStream_t* stream, unsigned int flags, int priority) {
  if (!stream || flags > hipStreamNonBlocking) RET(hipErrorInvalidValue);
  struct ihipStream_t* s = calloc(1, sizeof *s);
  if (!s) RET(hipErrorOutOfMemory);
  s->dev = cur_dev;
  s->flags = flags;
  s->priority = priority > PRIO_LOW ? PRIO_LOW : priority < PRIO_HIGH ? PRIO_HIGH : priority;
  s->tail = &s->head;
  pthread_mutex_lock(&lock);
  s->next = streams;
  streams = s;
  pthread_mutex_unlock(&lock);
  *stream = s;
  RET(hipSuccess);
}

hipError_t hipDeviceGetStreamPriorityRange(int* leastPriority, int* greatestPriority) {
  if (leastPriority) *leastPriority = PRIO_LOW;
  if (greatestPriority) *greatestPriority = PRIO_HIGH;
  RET(hipSuccess);
}

hipError_t hipStreamGetPriority(hipStream_t s, int* priority) {
  if (!priority) RET(hipErrorInvalidValue);
  if (!valid_stream(s)) RET(hipErrorInvalidHandle);
  *priority = s ? s->priority : 0;
  RET(hipSuccess);
}

// hipMemcpyAsync calls queued on streams of each priority (index: priority - PRIO_HIGH).
static uint64_t copies_at[PRIO_LOW - PRIO_HIGH + 1];

uint64_t fakeHipCopiesAtPriority(int priority) {
  if (priority < PRIO_HIGH || priority > PRIO_LOW) return 0;
  pthread_mutex_lock(&lock);
  uint64_t n = copies_at[priority - PRIO_HIGH];
  pthread_mutex_unlock(&lock);
  return n;
}

hipError_t hipStreamCreate(hipStream_t* stream) {
  return hipStreamCreateWithPriority(stream, hipStreamDefault, 0);
}

hipError_t hipStreamSynchronize(hipStream_t s) {
  if (!valid_stream(s)) RET(hipErrorInvalidHandle);
  if (s && s->capture) RET(hipErrorStreamCaptureUnsupported);
  if (s) drain(s, 0); else drain_all(cur_dev);
  RET(hipSuccess);
}

hipError_t hipStreamDestroy(hipStream_t s) {
  if (!s || !valid_stream(s)) RET(hipErrorInvalidHandle);
  pthread_mutex_lock(&lock);
  drain(s, 0);
  struct ihipStream_t** ps = &streams;
  while (*ps != s) ps = &(*ps)->next;
  *ps = s->next;
  pthread_mutex_unlock(&lock);
  free(s);
  RET(hipSuccess);
}

hipError_t hipDeviceSynchronize(void) {
  drain_all(cur_dev);
  RET(hipSuccess);
}

hipError_t hipEventCreate(hipEvent_t* event) {
  if (!event) RET(hipErrorInvalidValue);
  struct ihipEvent_t* e = calloc(1, sizeof *e);
  if (!e) RET(hipErrorOutOfMemory);
  *event = e;
  RET(hipSuccess);
}

hipError_t hipEventCreateWithFlags(hipEvent_t* event, unsigned flags) {
  unsigned known = hipEventBlockingSync | hipEventDisableTiming | hipEventInterprocess;
  if (!event || (flags & ~known)) RET(hipErrorInvalidValue);
  if ((flags & hipEventInterprocess) && !(flags & hipEventDisableTiming)) RET(hipErrorInvalidValue);
  return hipEventCreate(event);
}

hipError_t hipEventQuery(hipEvent_t e) {
  if (!e) RET(hipErrorInvalidHandle);
  pthread_mutex_lock(&lock);
  int done = e->done >= e->recorded;
  pthread_mutex_unlock(&lock);
  // Not an error of the caller's: not remembered for hipGetLastError.
  return done ? hipSuccess : hipErrorNotReady;
}

hipError_t hipEventRecord(hipEvent_t e, hipStream_t s) {
  if (!e) RET(hipErrorInvalidHandle);
  if (s && s->capture) RET(hipErrorStreamCaptureUnsupported);
  struct op* o = new_op(OP_RECORD);
  if (!o) RET(hipErrorOutOfMemory);
  pthread_mutex_lock(&lock);
  o->event = e;
  o->seq = ++e->recorded;
  e->stream = s;
  e->refs++;
  hipError_t r = submit(s, o);
  pthread_mutex_unlock(&lock);
  RET(r);
}

hipError_t hipEventSynchronize(hipEvent_t e) {
  if (!e) RET(hipErrorInvalidHandle);
  pthread_mutex_lock(&lock);
  if (e->done < e->recorded && e->stream) drain(e->stream, find_record(e->stream, e, e->recorded));
  pthread_mutex_unlock(&lock);
  RET(hipSuccess);
}

hipError_t hipEventDestroy(hipEvent_t e) {
  if (!e) RET(hipErrorInvalidHandle);
  pthread_mutex_lock(&lock);
  if (e->refs == 0) free(e); else e->destroyed = 1;
  pthread_mutex_unlock(&lock);
  RET(hipSuccess);
}

hipError_t hipStreamWaitEvent(hipStream_t s, hipEvent_t e, unsigned int flags) {
  if (!e || flags != 0) RET(hipErrorInvalidValue);
  if (s && s->capture) RET(hipErrorStreamCaptureUnsupported);
  pthread_mutex_lock(&lock);
  hipError_t r = hipSuccess;
  struct op* o = 0;
  if (e->recorded == 0 || e->done >= e->recorded) r = valid_stream(s) ? hipSuccess : hipErrorInvalidHandle;
  else if (!(o = new_op(OP_WAIT))) r = hipErrorOutOfMemory;
  else {
    o->event = e;
    o->seq = e->recorded;
    o->recorder = e->stream;
    e->refs++;
    r = submit(s, o);
  }
  pthread_mutex_unlock(&lock);
  RET(r);
}

// ---------------------------------------------------------------------------------------------
// Copies, memsets, stream-ordered allocation.

hipError_t hipMemcpyAsync(void* dst, const void* src, size_t n, hipMemcpyKind kind, hipStream_t s) {
  if ((!dst || !src) && n) RET(hipErrorInvalidValue);
  if (bad_kind(kind)) RET(hipErrorInvalidMemcpyDirection);
  if (n == 0) RET(hipSuccess);
  struct op* o = new_op(OP_COPY);
  if (!o) RET(hipErrorOutOfMemory);
  o->dst = dst; o->src = src; o->n = n;
  int prio = s && valid_stream(s) ? s->priority : 0;
  hipError_t e = submit(s, o);
  if (e == hipSuccess) {
    pthread_mutex_lock(&lock);
    copies_at[prio - PRIO_HIGH]++;
    pthread_mutex_unlock(&lock);
  }
  RET(e);
}

hipError_t hipMemcpy(void* dst, const void* src, size_t n, hipMemcpyKind kind) {
  if ((!dst || !src) && n) RET(hipErrorInvalidValue);
  if (bad_kind(kind)) RET(hipErrorInvalidMemcpyDirection);
  drain_all(cur_dev);
  memmove(dst, src, n);
  RET(hipSuccess);
}

hipError_t hipMemsetAsync(void* dst, int value, size_t n, hipStream_t s) {
  if (!dst && n) RET(hipErrorInvalidValue);
  if (n && !in_arena((uintptr_t)dst, n)) RET(hipErrorInvalidValue);
  struct op* o = new_op(OP_SET);
  if (!o) RET(hipErrorOutOfMemory);
  o->dst = dst; o->value = value; o->n = n;
  RET(submit(s, o));
}

hipError_t hipMallocFromPoolAsync(void** ptr, size_t size, hipMemPool_t pool, hipStream_t s) {
  if (!ptr || !pool) RET(hipErrorInvalidValue);
  if (!valid_stream(s)) RET(hipErrorInvalidHandle);
  if (s && s->capture) RET(hipErrorStreamCaptureUnsupported);
  if (size == 0) { *ptr = 0; RET(hipSuccess); }
  pthread_mutex_lock(&lock);
  uintptr_t at = pool_alloc(pool, size);
  pthread_mutex_unlock(&lock);
  if (!at) RET(hipErrorOutOfMemory);
  *ptr = (void*)at;
  RET(hipSuccess);
}

hipError_t hipMallocAsync(void** ptr, size_t size, hipStream_t s) {
  int dev = s && valid_stream(s) ? s->dev : cur_dev;
  pthread_mutex_lock(&lock);
  if (!default_pool[dev]) {
    pthread_mutex_unlock(&lock);
    struct ihipMemPoolHandle_t* p = pool_new(dev);
    pthread_mutex_lock(&lock);
    if (p && !default_pool[dev] && pool_register(p)) default_pool[dev] = p;
  }
  struct ihipMemPoolHandle_t* p = default_pool[dev];
  pthread_mutex_unlock(&lock);
  if (!p) RET(hipErrorOutOfMemory);
  return hipMallocFromPoolAsync(ptr, size, p, s);
}

hipError_t hipFreeAsync(void* ptr, hipStream_t s) {
  if (!ptr) RET(hipSuccess);
  if (s && s->capture) RET(hipErrorStreamCaptureUnsupported);
  struct ihipMemPoolHandle_t* pool = 0;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < 64 && !pool; i++) {
    struct ihipMemPoolHandle_t* p = pools[i];
    if (p && (uintptr_t)ptr >= p->base && (uintptr_t)ptr < p->base + POOL_SIZE) pool = p;
  }
  pthread_mutex_unlock(&lock);
  if (!pool) RET(hipErrorInvalidValue);
  struct op* o = new_op(OP_FREE);
  if (!o) RET(hipErrorOutOfMemory);
  o->pool = pool;
  o->at = (uintptr_t)ptr;
  RET(submit(s, o));
}

// ---------------------------------------------------------------------------------------------
// Launches.

// Packs a launch of `k` into an op: from `params` (a pointer per explicit argument) or from
// `extra`'s buffer.
static hipError_t launch(const struct sim_kernel* k, dim3 grid, dim3 block, hipStream_t s,
                         void** params, void** extra) {
  if (!grid.x || !grid.y || !grid.z || !block.x || !block.y || !block.z ||
      (uint64_t)block.x * block.y * block.z > 1024)
    return hipErrorInvalidConfiguration;
  struct op* o = new_op(OP_KERNEL);
  if (!o) return hipErrorOutOfMemory;
  o->k = k;
  o->items = (uint64_t)grid.x * block.x;
  if (params) {
    for (int i = 0; i < k->nargs; i++) memcpy(o->kernarg + k->off[i], params[i], k->size[i]);
  } else if (extra) {
    void* buf = 0;
    size_t* size = 0;
    for (size_t i = 0; extra[i] != HIP_LAUNCH_PARAM_END; i += 2) {
      if (extra[i] == HIP_LAUNCH_PARAM_BUFFER_POINTER) buf = extra[i + 1];
      else if (extra[i] == HIP_LAUNCH_PARAM_BUFFER_SIZE) size = extra[i + 1];
      else { free(o); return hipErrorInvalidValue; }
    }
    if (!buf || !size || *size < k->kernarg || *size > MAX_KERNARG) { free(o); return hipErrorInvalidValue; }
    memcpy(o->kernarg, buf, k->kernarg);
  } else {
    free(o);
    return hipErrorInvalidValue;
  }
  return submit(s, o);
}

hipError_t hipModuleLaunchKernel(hipFunction_t f, unsigned int gx, unsigned int gy,
                                 unsigned int gz, unsigned int bx, unsigned int by,
                                 unsigned int bz, unsigned int shared, hipStream_t s,
                                 void** params, void** extra) {
  if (!f) RET(hipErrorInvalidHandle);
  (void)shared;
  RET(launch(f->k, (dim3){gx, gy, gz}, (dim3){bx, by, bz}, s, params, extra));
}

// Host stubs registered by __hipRegisterFunction.
static struct { const void* host; const struct sim_kernel* k; } registered[64];

void** __hipRegisterFatBinary(const void* data) {
  const __CudaFatBinaryWrapper* w = data;
  if (!w || w->magic != HIP_FATBIN_MAGIC || !w->binary) return 0;
  struct ihipModule_t* m = 0;
  if (module_load(&m, w->binary) != hipSuccess) return 0;
  void** modules = malloc(sizeof *modules);
  if (!modules) { free(m); return 0; }
  *modules = m;
  return modules;
}

void __hipRegisterFunction(void** modules, const void* hostFunction, char* deviceFunction,
                           const char* deviceName, unsigned int threadLimit, void* tid, void* bid,
                           dim3* blockDim, dim3* gridDim, int* wSize) {
  (void)deviceFunction; (void)threadLimit; (void)tid; (void)bid; (void)blockDim; (void)gridDim; (void)wSize;
  struct ihipModuleSymbol_t* f = 0;
  if (!modules || get_function(&f, *modules, deviceName) != hipSuccess) return;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < 64; i++)
    if (!registered[i].host) { registered[i].host = hostFunction; registered[i].k = f->k; break; }
  pthread_mutex_unlock(&lock);
  free(f);
}

void __hipUnregisterFatBinary(void** modules) {
  if (!modules) return;
  free(*modules);
  free(modules);
}

hipError_t hipLaunchKernel(const void* fn, dim3 grid, dim3 block, void** args, size_t shared,
                           hipStream_t s) {
  (void)shared;
  const struct sim_kernel* k = 0;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < 64 && !k; i++) if (fn && registered[i].host == fn) k = registered[i].k;
  pthread_mutex_unlock(&lock);
  if (!k) RET(hipErrorInvalidDeviceFunction);
  if (!args) RET(hipErrorInvalidValue);
  RET(launch(k, grid, block, s, args, 0));
}

// ---------------------------------------------------------------------------------------------
// Graphs.

hipError_t hipStreamBeginCapture(hipStream_t s, hipStreamCaptureMode mode) {
  if (!s) RET(hipErrorStreamCaptureUnsupported);
  if (!valid_stream(s)) RET(hipErrorInvalidHandle);
  if (mode > hipStreamCaptureModeRelaxed) RET(hipErrorInvalidValue);
  if (s->capture) RET(hipErrorIllegalState);
  struct ihipGraph* g = calloc(1, sizeof *g);
  if (!g) RET(hipErrorOutOfMemory);
  g->tail = &g->head;
  pthread_mutex_lock(&lock);
  s->capture = g;
  pthread_mutex_unlock(&lock);
  RET(hipSuccess);
}

hipError_t hipStreamEndCapture(hipStream_t s, hipGraph_t* graph) {
  if (!graph) RET(hipErrorInvalidValue);
  if (!s || !valid_stream(s)) RET(hipErrorInvalidHandle);
  pthread_mutex_lock(&lock);
  struct ihipGraph* g = s->capture;
  s->capture = 0;
  pthread_mutex_unlock(&lock);
  if (!g) RET(hipErrorIllegalState);
  *graph = g;
  RET(hipSuccess);
}

static void free_ops(struct op* o) {
  while (o) { struct op* n = o->next; free(o); o = n; }
}

// A copy of the op list from `o`; null (and *ok 0) when memory runs out.
static struct op* copy_ops(const struct op* o, int* ok) {
  struct op* head = 0;
  struct op** tail = &head;
  *ok = 1;
  for (; o; o = o->next) {
    struct op* c = malloc(sizeof *c);
    if (!c) { free_ops(head); *ok = 0; return 0; }
    *c = *o;
    c->next = 0;
    *tail = c;
    tail = &c->next;
  }
  return head;
}

struct hipGraphExec { struct op* head; };

hipError_t hipGraphInstantiate(hipGraphExec_t* exec, hipGraph_t g, hipGraphNode_t* error_node,
                               char* log, size_t log_size) {
  if (!exec || !g) RET(hipErrorInvalidValue);
  if (error_node) *error_node = 0;
  if (log && log_size) log[0] = 0;
  struct hipGraphExec* x = malloc(sizeof *x);
  int ok;
  if (!x) RET(hipErrorOutOfMemory);
  x->head = copy_ops(g->head, &ok);
  if (!ok) { free(x); RET(hipErrorOutOfMemory); }
  *exec = x;
  RET(hipSuccess);
}

hipError_t hipGraphLaunch(hipGraphExec_t x, hipStream_t s) {
  if (!x) RET(hipErrorInvalidValue);
  if (!valid_stream(s)) RET(hipErrorInvalidHandle);
  if (s && s->capture) RET(hipErrorStreamCaptureUnsupported);
  int ok;
  struct op* ops = copy_ops(x->head, &ok);
  if (!ok) RET(hipErrorOutOfMemory);
  hipError_t e = hipSuccess;
  pthread_mutex_lock(&lock);
  while (ops && e == hipSuccess) {
    struct op* n = ops->next;
    e = submit(s, ops);
    ops = n;
  }
  pthread_mutex_unlock(&lock);
  free_ops(ops);
  RET(e);
}

hipError_t hipGraphExecDestroy(hipGraphExec_t x) {
  if (!x) RET(hipErrorInvalidValue);
  free_ops(x->head);
  free(x);
  RET(hipSuccess);
}

hipError_t hipGraphDestroy(hipGraph_t g) {
  if (!g) RET(hipErrorInvalidValue);
  free_ops(g->head);
  free(g);
  RET(hipSuccess);
}

// ---------------------------------------------------------------------------------------------
// Pinned host memory, device properties.

struct host_block { void* at; size_t size; struct host_block* next; };
static struct host_block* host_blocks;

hipError_t hipHostMalloc(void** ptr, size_t size, unsigned int flags) {
  unsigned known = hipHostMallocPortable | hipHostMallocMapped | hipHostMallocWriteCombined |
                   hipHostMallocNumaUser | hipHostMallocCoherent | hipHostMallocNonCoherent;
  if (!ptr || (flags & ~known)) RET(hipErrorInvalidValue);
  if ((flags & hipHostMallocCoherent) && (flags & hipHostMallocNonCoherent)) RET(hipErrorInvalidValue);
  if (size == 0) { *ptr = 0; RET(hipSuccess); }
  void* p = mmap(0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  struct host_block* b = p != MAP_FAILED ? malloc(sizeof *b) : 0;
  if (!b) { if (p != MAP_FAILED) munmap(p, size); RET(hipErrorOutOfMemory); }
  pthread_mutex_lock(&lock);
  *b = (struct host_block){p, size, host_blocks};
  host_blocks = b;
  pthread_mutex_unlock(&lock);
  *ptr = p;
  RET(hipSuccess);
}

// As the runtime's, it waits for the device first: a queued copy may still use the memory.
hipError_t hipHostFree(void* ptr) {
  if (!ptr) RET(hipSuccess);
  drain_all(cur_dev);
  pthread_mutex_lock(&lock);
  struct host_block** pb = &host_blocks;
  while (*pb && (*pb)->at != ptr) pb = &(*pb)->next;
  struct host_block* b = *pb;
  if (b) *pb = b->next;
  pthread_mutex_unlock(&lock);
  if (!b) RET(hipErrorInvalidValue);
  munmap(b->at, b->size);
  free(b);
  RET(hipSuccess);
}

hipError_t hipMemGetInfo(size_t* free_bytes, size_t* total) {
  if (!free_bytes || !total) RET(hipErrorInvalidValue);
  pthread_mutex_lock(&lock);
  *total = ARENA_SIZE;
  *free_bytes = arena_base ? ARENA_SIZE - (arena_next - arena_base) : ARENA_SIZE;
  pthread_mutex_unlock(&lock);
  RET(hipSuccess);
}

hipError_t hipDeviceGetName(char* name, int len, hipDevice_t device) {
  if (!name || len <= 0) RET(hipErrorInvalidValue);
  if (device < 0 || device >= ndev()) RET(hipErrorInvalidDevice);
  snprintf(name, (size_t)len, "Simulated HIP device %d", device);
  RET(hipSuccess);
}

// ---------------------------------------------------------------------------------------------
// Virtual memory management.

struct ihipMemGenericAllocationHandle { int fd; size_t size; int dev; };

// Reserved ranges and mappings, so that unmaps and frees can be checked.
struct range { uintptr_t at; size_t size; struct ihipMemGenericAllocationHandle* h; };
#define NRESERVED 1024
#define NMAPPED 1024
static struct range reserved[NRESERVED], mapped[NMAPPED];

static struct range* find_range(struct range* t, size_t n, uintptr_t at, size_t size) {
  for (size_t i = 0; i < n; i++) if (t[i].size && t[i].at == at && (!size || t[i].size == size)) return &t[i];
  return 0;
}

static struct range* free_slot(struct range* t, size_t n) {
  for (size_t i = 0; i < n; i++) if (!t[i].size) return &t[i];
  return 0;
}

// The reservation holding [at, at+size), if any.
static struct range* reservation_of(uintptr_t at, size_t size) {
  for (size_t i = 0; i < NRESERVED; i++) {
    struct range* r = &reserved[i];
    if (r->size && at >= r->at && at + size <= r->at + r->size && at + size > at) return r;
  }
  return 0;
}

static int overlaps_mapping(uintptr_t at, size_t size) {
  for (size_t i = 0; i < NMAPPED; i++) {
    struct range* m = &mapped[i];
    if (m->size && at < m->at + m->size && m->at < at + size) return 1;
  }
  return 0;
}

static int good_prop(const hipMemAllocationProp* prop) {
  return prop && prop->type == hipMemAllocationTypePinned &&
         prop->location.type == hipMemLocationTypeDevice && prop->location.id >= 0 &&
         prop->location.id < ndev();
}

hipError_t hipMemGetAllocationGranularity(size_t* g, const hipMemAllocationProp* prop,
                                          hipMemAllocationGranularity_flags option) {
  if (!g || !good_prop(prop) || option > hipMemAllocationGranularityRecommended)
    RET(hipErrorInvalidValue);
  *g = GRANULARITY;
  RET(hipSuccess);
}

hipError_t hipMemAddressReserve(void** ptr, size_t size, size_t alignment, void* addr,
                                unsigned long long flags) {
  (void)addr;  // a hint; the arena decides
  if (!ptr || !size || size % GRANULARITY || flags || (alignment & (alignment - 1)))
    RET(hipErrorInvalidValue);
  pthread_mutex_lock(&lock);
  struct range* r = free_slot(reserved, NRESERVED);
  uintptr_t at = r ? arena_take(size, alignment ? alignment : GRANULARITY) : 0;
  if (at) *r = (struct range){at, size, 0};
  pthread_mutex_unlock(&lock);
  if (!at) RET(hipErrorOutOfMemory);
  *ptr = (void*)at;
  RET(hipSuccess);
}

hipError_t hipMemAddressFree(void* ptr, size_t size) {
  pthread_mutex_lock(&lock);
  struct range* r = find_range(reserved, NRESERVED, (uintptr_t)ptr, size);
  hipError_t e = !r ? hipErrorInvalidValue : overlaps_mapping(r->at, r->size) ? hipErrorIllegalState : hipSuccess;
  if (e == hipSuccess) r->size = 0;
  pthread_mutex_unlock(&lock);
  RET(e);
}

hipError_t hipMemCreate(hipMemGenericAllocationHandle_t* handle, size_t size,
                        const hipMemAllocationProp* prop, unsigned long long flags) {
  if (!handle || !size || size % GRANULARITY || flags || !good_prop(prop)) RET(hipErrorInvalidValue);
  struct ihipMemGenericAllocationHandle* h = malloc(sizeof *h);
  if (!h) RET(hipErrorOutOfMemory);
  h->fd = memfd_create("fake-hip-vmm", MFD_CLOEXEC);
  if (h->fd < 0 || ftruncate(h->fd, (off_t)size) != 0) {
    if (h->fd >= 0) close(h->fd);
    free(h);
    RET(hipErrorOutOfMemory);
  }
  h->size = size;
  h->dev = prop->location.id;
  *handle = h;
  RET(hipSuccess);
}

// The memfd stays open while a mapping of it exists; hipMemRelease closes it once unmapped.
hipError_t hipMemRelease(hipMemGenericAllocationHandle_t h) {
  if (!h) RET(hipErrorInvalidValue);
  pthread_mutex_lock(&lock);
  int in_use = 0;
  for (size_t i = 0; i < NMAPPED; i++) if (mapped[i].size && mapped[i].h == h) in_use = 1;
  pthread_mutex_unlock(&lock);
  if (in_use) RET(hipErrorIllegalState);
  close(h->fd);
  free(h);
  RET(hipSuccess);
}

hipError_t hipMemMap(void* ptr, size_t size, size_t offset, hipMemGenericAllocationHandle_t h,
                     unsigned long long flags) {
  uintptr_t at = (uintptr_t)ptr;
  if (!h || !size || flags || at % GRANULARITY || size % GRANULARITY || offset % GRANULARITY ||
      offset + size > h->size || offset + size < offset)
    RET(hipErrorInvalidValue);
  pthread_mutex_lock(&lock);
  hipError_t e = hipSuccess;
  struct range* slot = free_slot(mapped, NMAPPED);
  if (!reservation_of(at, size)) e = hipErrorInvalidValue;
  else if (overlaps_mapping(at, size)) e = hipErrorAlreadyMapped;
  else if (!slot) e = hipErrorOutOfMemory;
  else if (mmap(ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, (off_t)offset) == MAP_FAILED)
    e = hipErrorMapFailed;
  else *slot = (struct range){at, size, h};
  pthread_mutex_unlock(&lock);
  RET(e);
}

hipError_t hipMemSetAccess(void* ptr, size_t size, const hipMemAccessDesc* desc, size_t count) {
  uintptr_t at = (uintptr_t)ptr;
  if (!desc || !count || !size) RET(hipErrorInvalidValue);
  int prot = PROT_NONE;
  for (size_t i = 0; i < count; i++) {
    if (desc[i].location.type != hipMemLocationTypeDevice || desc[i].location.id < 0 ||
        desc[i].location.id >= ndev())
      RET(hipErrorInvalidDevice);
    if (desc[i].flags == hipMemAccessFlagsProtReadWrite) prot = PROT_READ | PROT_WRITE;
    else if (desc[i].flags == hipMemAccessFlagsProtRead && prot == PROT_NONE) prot = PROT_READ;
    else if (desc[i].flags != hipMemAccessFlagsProtNone && desc[i].flags != hipMemAccessFlagsProtRead)
      RET(hipErrorInvalidValue);
  }
  // Every byte of the range must be mapped.
  pthread_mutex_lock(&lock);
  size_t covered = 0;
  for (size_t i = 0; i < NMAPPED; i++) {
    struct range* m = &mapped[i];
    if (!m->size) continue;
    uintptr_t lo = m->at > at ? m->at : at, hi = m->at + m->size < at + size ? m->at + m->size : at + size;
    if (lo < hi) covered += hi - lo;
  }
  hipError_t e = covered != size ? hipErrorInvalidValue
               : mprotect(ptr, size, prot) != 0 ? hipErrorInvalidValue : hipSuccess;
  pthread_mutex_unlock(&lock);
  RET(e);
}

hipError_t hipMemUnmap(void* ptr, size_t size) {
  uintptr_t at = (uintptr_t)ptr;
  if (!size) RET(hipErrorInvalidValue);
  drain_all(cur_dev);
  pthread_mutex_lock(&lock);
  // Every mapping inside [at, at+size) goes; one that sticks out of it is an error.
  hipError_t e = hipErrorNotMapped;
  for (size_t i = 0; i < NMAPPED; i++) {
    struct range* m = &mapped[i];
    if (!m->size || m->at + m->size <= at || m->at >= at + size) continue;
    if (m->at < at || m->at + m->size > at + size) { e = hipErrorInvalidValue; break; }
    e = hipSuccess;
  }
  if (e == hipSuccess) {
    for (size_t i = 0; i < NMAPPED; i++) {
      struct range* m = &mapped[i];
      if (m->size && m->at >= at && m->at + m->size <= at + size) m->size = 0;
    }
    arena_drop(at, size);
  }
  pthread_mutex_unlock(&lock);
  RET(e);
}

// ---------------------------------------------------------------------------------------------
// hipGetProcAddress: this library's own functions.

#define EXPORTS(X) \
  X(hipInit) X(hipGetDeviceCount) X(hipSetDevice) X(hipGetDevice) X(hipDeviceSynchronize) \
  X(hipGetLastError) X(hipGetErrorString) X(hipGetErrorName) X(hipGetProcAddress) X(hipMalloc) X(hipMallocManaged) \
  X(hipFree) X(hipMallocAsync) X(hipFreeAsync) X(hipMemPoolCreate) X(hipMemPoolDestroy) \
  X(hipMallocFromPoolAsync) X(hipMemcpy) X(hipMemcpyAsync) X(hipMemsetAsync) X(hipStreamCreate) \
  X(hipStreamCreateWithPriority) X(hipStreamDestroy) X(hipStreamSynchronize) \
  X(hipStreamWaitEvent) X(hipEventCreate) X(hipEventRecord) X(hipEventSynchronize) \
  X(hipEventDestroy) X(hipModuleLoadData) X(hipModuleUnload) X(hipModuleGetFunction) \
  X(hipModuleLaunchKernel) X(hipLaunchKernel) X(hipStreamBeginCapture) X(hipStreamEndCapture) \
  X(hipGraphInstantiate) X(hipGraphLaunch) X(hipGraphExecDestroy) X(hipGraphDestroy) \
  X(hipMemGetAllocationGranularity) X(hipMemAddressReserve) X(hipMemAddressFree) \
  X(hipMemCreate) X(hipMemRelease) X(hipMemMap) X(hipMemUnmap) X(hipMemSetAccess) \
  X(hipHostMalloc) X(hipHostFree) X(hipMemGetInfo) X(hipDeviceGetName) \
  X(hipDeviceGetStreamPriorityRange) X(hipStreamGetPriority) X(hipEventCreateWithFlags) \
  X(hipEventQuery)
#define ENTRY(n) {#n, (void*)n},
static const struct { const char* name; void* f; } exports[] = { EXPORTS(ENTRY) };

hipError_t hipGetProcAddress(const char* symbol, void** pfn, int hipVersion, uint64_t flags,
                             hipDriverProcAddressQueryResult* status) {
  (void)flags;
  if (!symbol || !*symbol || !pfn) RET(hipErrorInvalidValue);
  *pfn = 0;
  for (size_t i = 0; i < sizeof exports / sizeof exports[0]; i++) {
    if (strcmp(exports[i].name, symbol) != 0) continue;
    if (hipVersion < 600) {  // this subset is that of HIP 6
      if (status) *status = HIP_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      RET(hipErrorInvalidValue);
    }
    *pfn = exports[i].f;
    if (status) *status = HIP_GET_PROC_ADDRESS_SUCCESS;
    RET(hipSuccess);
  }
  if (status) *status = HIP_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  RET(hipErrorInvalidValue);
}
