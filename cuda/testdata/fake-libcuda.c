// fake-libcuda: a stand-in for libcuda.so.1 that emulates, in host memory, just the driver calls
// possum-cuda makes (virtual memory via mmap + memfd, synchronous copies, no-op streams and events).
// It lets possum-cuda's tests and self-test run their logic on a machine without a GPU. It proves
// nothing about CUDA itself: runs against it report the device as "Fake GPU".
//
//   cc -O2 -shared -fPIC -Wl,-Bsymbolic -o /tmp/fakecuda/libcuda.so.1 cuda/testdata/fake-libcuda.c
//   LD_LIBRARY_PATH=/tmp/fakecuda cargo test -p possum-cuda
//   FAKE_CUDA_NODEV=1 ...   makes cuInit fail with CUDA_ERROR_NO_DEVICE (the skip path)
//   FAKE_CUDA_DEVICES=N ... N devices (default 1, at most 8): ordinals 0..N-1, each with its own
//                           primary context and UUID; their memory is one host pool, and each
//                           reaches the others' (cuDeviceCanAccessPeer)
//   FAKE_CUDA_PEERS_REFUSED=1 ... cuMemSetAccess refuses more than one descriptor
//                           (CUDA_ERROR_INVALID_VALUE), as a host whose peers can't be granted
//   FAKE_CUDA_FINGERPRINT=1 ... possum's fingerprint kernel runs (on the CPU; see cuModuleLoadData);
//                           without it the driver refuses the kernel's PTX
//   FAKE_CUDA_QUEUE=1 ...   a cuMemcpyPeerAsync on a stream of the job's is queued until its
//                           stream or device is synchronized (see run_queued)
// The driver's GPU remapping is emulated too: a device ordinal o of a process is physical device
// remap[o] (itself unless a restore remapped it), whose UUID cuDeviceGetUuid_v2 answers; a
// cuCheckpointProcessRestore with gpuPairs (old UUID -> new UUID) remaps the restored process's
// ordinals, so that it sees another GPU under the same ordinal as after NVIDIA's restore.
// It also has the checkpoint API (cuCheckpointProcess*, possum_cuda::checkpoint) as a state machine
// per pid (FAKE_CKPT_IN_PROCESS=1: kept in the process itself, see below); fake-libcuda-nockpt.c
// is a driver without it. FAKE_CKPT_HANG=cuCheckpointProcessCheckpoint[,...] makes those entry
// points hang for ever (a hung driver), FAKE_CKPT_DELAY_MS slows the checkpoint,
// FAKE_CKPT_LOCK_UNSUPPORTED refuses the lock.
//
// A job can really run on it: kernel launches (cuLaunchKernel and its variants) run the kernel's
// host function at once (struct fake_kernel below), copies and memsets are done at once in host
// memory, streams and graphs are no-ops, and cuGetProcAddress / _v2 answer with this driver's own
// exported functions as the real driver does (the _v2 export for a name that has one, the
// per-thread-stream _ptsz/_ptds one with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM).
// Build it with -Wl,-Bsymbolic, as the real libcuda is linked: then the addresses it hands out and
// its calls of its own functions are its own even when a preloaded library (libpossum.so) exports
// the same names.
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <signal.h>
#include <pthread.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
typedef unsigned long long ull;
static __thread void* cur;
static size_t used;
static const size_t TOTAL = 80ull<<30;
// A physical allocation: a memfd. `htype` is the prop's requestedHandleTypes (1: POSIX fd, which
// cuMemExportToShareableHandle needs); `imported` ones (cuMemImportFromShareableHandle, a dup of
// the exporter's memfd, so a mapping of it maps the same pages, across processes too) do not
// count in `used`: the exporter's allocation does.
struct h { int fd; size_t size; int htype; int imported; };
// A mapping; `access`: the devices cuMemSetAccess gave access to it (bit d: device d).
struct m { ull va; size_t size; ull h; unsigned access; };
static struct m maps[64];
// Guards maps: possum maps buffers from several threads at once (reattach).
static pthread_mutex_t maps_lock=PTHREAD_MUTEX_INITIALIZER;
int cuGetErrorString(int e, const char** s){
  *s = e==100? "no CUDA-capable device is detected" : e==1? "invalid argument (fake)"
     : e==401? "illegal state (fake)" : "fake error";
  return 0; }
int cuInit(unsigned f){ return getenv("FAKE_CUDA_NODEV") ? 100 : 0; }
int cuDriverGetVersion(int* v){ *v=13000; return 0; }
// The devices: FAKE_CUDA_DEVICES of them (1 to MAXDEV; 1 when unset or out of range). A device
// handle (CUdevice) is its ordinal; an ordinal out of range is CUDA_ERROR_INVALID_DEVICE (101).
#define MAXDEV 8
static int ndev(void){
  const char* e=getenv("FAKE_CUDA_DEVICES"); int n=e? atoi(e) : 1;
  return n<1? 1 : n>MAXDEV? MAXDEV : n; }
static int bad_dev(int d){ return d<0 || d>=ndev(); }
int cuDeviceGetCount(int* n){ *n=ndev(); return 0; }
int cuDeviceGet(int* d, int o){ if(bad_dev(o)) return 101; *d=o; return 0; }
int cuDeviceGetName(char* n, int len, int d){ strncpy(n, "Fake GPU", len); return 0; }
// Device attributes: only CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED (110), yes
// as on the H100; any other is CUDA_ERROR_INVALID_VALUE.
int cuDeviceGetAttribute(int* v, int attr, int d){ if(!v || bad_dev(d) || attr!=110) return 1; *v=1; return 0; }
// Every pair of distinct devices can reach each other's memory.
int cuDeviceCanAccessPeer(int* can, int d, int peer){
  if(!can || bad_dev(d) || bad_dev(peer)) return 101;
  *can = d!=peer; return 0; }
// The physical device behind each ordinal of this process: itself, unless a restore of the
// process with gpuPairs remapped it (cuCheckpointProcessRestore, written into the restored
// process's copy of this array).
static volatile int remap[MAXDEV]={0,1,2,3,4,5,6,7};
// Physical device p's UUID: bytes 0xf0+i+p*16 (device 0: f0..ff, device 1: 00..0f, ...);
// FAKE_UUID_SALT, when set, changes them ("another machine's" devices).
static void uuid_of(unsigned char* u, int p){
  const char* salt = getenv("FAKE_UUID_SALT");
  for (int i = 0; i < 16; i++) u[i] = (unsigned char)(0xf0 + i + p * 16 + (salt ? salt[0] : 0));
}
// The UUID of the physical device ordinal d is now.
int cuDeviceGetUuid_v2(unsigned char* u, int d){
  if(bad_dev(d)) return 101;
  uuid_of(u, remap[d]);
  return 0;
}
// One primary context per device: cuCtxGetDevice answers the current one's.
static int ctxobj[MAXDEV];
int cuDevicePrimaryCtxRetain(void** c, int d){ if(!c || bad_dev(d)) return 101; *c=&ctxobj[d]; return 0; }
int cuDevicePrimaryCtxRelease_v2(int d){ return 0; }
int cuCtxGetCurrent(void** c){ *c=cur; return 0; }
int cuCtxSetCurrent(void* c){ cur=c; return 0; }
int cuCtxGetStreamPriorityRange(int* l, int* g){ *l=0; *g=-5; return 0; }
// A driver-internal lock: cuCtxSynchronize takes it, and a job may hold it (fake_driver_hold) to
// stand for a thread stopped inside a driver call (possum's park watchdog is tested with it).
static pthread_mutex_t driver_mu = PTHREAD_MUTEX_INITIALIZER;
void fake_driver_hold(int on){ if(on) pthread_mutex_lock(&driver_mu); else pthread_mutex_unlock(&driver_mu); }
static void run_queued(void* st, int dev);
static int cur_dev(void);
int cuCtxSynchronize(void){
  if(!cur) return 201;
  pthread_mutex_lock(&driver_mu); pthread_mutex_unlock(&driver_mu);
  run_queued(0, cur_dev());
  return 0; }
// cuMemAlloc and friends (host memory): device memory is host memory here.
static int fake_mem_alloc(ull* p, size_t n){
  if(!p) return 1;
  if(!cur) return 201;
  void* m = aligned_alloc(256, (n+255)&~(size_t)255); if(!m) return 2;
  memset(m, 0, n); *p=(ull)m; return 0; }
int cuMemAlloc_v2(ull* p, size_t n){ return fake_mem_alloc(p, n); }
int cuMemFree_v2(ull p){ free((void*)p); return 0; }
int cuMemAllocPitch_v2(ull* p, size_t* pitch, size_t w, size_t h, unsigned e){
  *pitch=(w+255)&~(size_t)255; return fake_mem_alloc(p, *pitch*h); }
// Stream-ordered and managed allocations: the same host memory (streams are no-ops).
int cuMemAllocAsync(ull* p, size_t n, void* s){ return fake_mem_alloc(p, n); }
int cuMemAllocAsync_ptsz(ull* p, size_t n, void* s){ return fake_mem_alloc(p, n); }
int cuMemAllocFromPoolAsync(ull* p, size_t n, void* pool, void* s){ return fake_mem_alloc(p, n); }
int cuMemAllocFromPoolAsync_ptsz(ull* p, size_t n, void* pool, void* s){ return fake_mem_alloc(p, n); }
int cuMemFreeAsync(ull p, void* s){ free((void*)p); return 0; }
int cuMemFreeAsync_ptsz(ull p, void* s){ free((void*)p); return 0; }
int cuMemAllocManaged(ull* p, size_t n, unsigned flags){ return fake_mem_alloc(p, n); }
// The context's local memory: 64 KiB of it per byte of the per-thread stack limit (1 KiB: 64 MiB),
// counted as used. Fake kernels need their stack: a launch while it is 0 (trimmed for a
// checkpoint) fails, so a resume that lets the job launch before setting it back is caught.
static size_t stack_limit=1024;
#define LMEM (stack_limit*65536)
int cuCtxGetLimit(size_t* v, int which){ if(!cur) return 201; if(which!=0) return 1; *v=stack_limit; return 0; }
int cuCtxSetLimit(int which, size_t v){ if(!cur) return 201; if(which!=0) return 1; stack_limit=v; return 0; }
int cuMemGetInfo_v2(size_t* f, size_t* t){ if(!cur) return 201; *f=TOTAL-__atomic_load_n(&used, __ATOMIC_SEQ_CST)-LMEM; *t=TOTAL; return 0; }
int cuMemGetAllocationGranularity(size_t* g, const void* p, int o){ *g=2u<<20; return 0; }
int cuMemAddressReserve(ull* p, size_t size, size_t align, ull addr, ull flags){
  if(!cur) return 201;
  if(align<(2u<<20)) align=2u<<20;
  char* r = mmap(0, size+align, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE, -1, 0);
  if(r==MAP_FAILED) return 2;
  uintptr_t a = ((uintptr_t)r + align-1) & ~(uintptr_t)(align-1);
  if(a>(uintptr_t)r) munmap(r, a-(uintptr_t)r);
  if((uintptr_t)r+size+align > a+size) munmap((void*)(a+size), (uintptr_t)r+size+align-(a+size));
  *p=a; return 0; }
int cuMemAddressFree(ull p, size_t size){ return munmap((void*)p, size)? 1:0; }
// `used` and `imports_live` change on every thread that allocates or frees (a restore loads on
// several at once): atomically, else a lost update leaves them wrong for the process's life.
int cuMemCreate(ull* h, size_t size, const void* prop, ull f){
  if(!cur) return 201;
  if(__atomic_add_fetch(&used, size, __ATOMIC_SEQ_CST)>TOTAL){ __atomic_sub_fetch(&used, size, __ATOMIC_SEQ_CST); return 2; }
  struct h* x=malloc(sizeof *x); x->fd=memfd_create("fakegpu",0); x->size=size;
  x->htype = prop? ((const int*)prop)[1] : 0; x->imported=0;  // CUmemAllocationProp: type, requestedHandleTypes
  if(x->fd<0 || ftruncate(x->fd,size)){
    if(x->fd>=0) close(x->fd);
    free(x); __atomic_sub_fetch(&used, size, __ATOMIC_SEQ_CST); return 2; }
  *h=(ull)(uintptr_t)x; return 0; }
// Imported handles this process holds: the driver's restore of a process checkpointed holding
// one fails (CUDA_ERROR_NOT_SUPPORTED, as driver 580 on the H100 answers), read by the process
// restoring it (cuCheckpointProcessRestore) in this variable of the checkpointed process.
static volatile int imports_live;
int cuMemRelease(ull h){
  struct h* x=(void*)(uintptr_t)h; close(x->fd);
  if(!x->imported) __atomic_sub_fetch(&used, x->size, __ATOMIC_SEQ_CST);
  else __atomic_sub_fetch(&imports_live, 1, __ATOMIC_SEQ_CST);
  free(x); return 0; }
// Shareable handles: only CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (1), and only for memory
// created with it (else CUDA_ERROR_INVALID_VALUE, as the real driver answers).
int cuMemExportToShareableHandle(void* out, ull h, int type, ull flags){
  struct h* x=(void*)(uintptr_t)h;
  // As driver 580 on the H100: an imported handle is not exported again (INVALID_VALUE).
  if(!out || !x || type!=1 || (x->htype & 1)==0 || x->imported) return 1;
  int fd=fcntl(x->fd, F_DUPFD_CLOEXEC, 0); if(fd<0) return 2;
  *(int*)out=fd; return 0; }
int cuMemImportFromShareableHandle(ull* h, void* os, int type){
  if(!cur) return 201;
  int fd=(int)(intptr_t)os; struct stat st;
  if(!h || type!=1 || fd<0 || fstat(fd, &st)) return 1;
  struct h* x=malloc(sizeof *x); x->fd=fcntl(fd, F_DUPFD_CLOEXEC, 0); x->size=st.st_size;
  x->htype=1; x->imported=1;
  if(x->fd<0){ free(x); return 2; }
  __atomic_add_fetch(&imports_live, 1, __ATOMIC_SEQ_CST);
  *h=(ull)(uintptr_t)x; return 0; }
int cuMemMap(ull p, size_t size, size_t off, ull h, ull f){
  struct h* x=(void*)(uintptr_t)h;
  if(mmap((void*)p, size, PROT_READ|PROT_WRITE, MAP_SHARED|MAP_FIXED, x->fd, off)==MAP_FAILED) return 1;
  pthread_mutex_lock(&maps_lock);
  for(int i=0;i<64;i++) if(!maps[i].size){ maps[i].va=p; maps[i].size=size; maps[i].h=h; maps[i].access=0; break; }
  pthread_mutex_unlock(&maps_lock);
  return 0; }
int cuMemUnmap(ull p, size_t size){
  mmap((void*)p, size, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_FIXED|MAP_NORESERVE, -1, 0);
  pthread_mutex_lock(&maps_lock);
  for(int i=0;i<64;i++) if(maps[i].va==p){ maps[i].size=0; maps[i].va=0; }
  pthread_mutex_unlock(&maps_lock);
  return 0; }
// CUmemAccessDesc: location type (1: device), location id, flags (0: PROT_NONE, which takes the
// device's access away). Each descriptor must name a device of this process, else
// CUDA_ERROR_INVALID_VALUE; the devices named are recorded on every mapping in [p, p+s).
struct access_desc { int type, id, flags; };
int cuMemSetAccess(ull p, size_t s, const void* d, size_t c){
  const struct access_desc* a=d;
  if((c && !a) || (c>1 && getenv("FAKE_CUDA_PEERS_REFUSED"))) return 1;
  for(size_t k=0;k<c;k++) if(a[k].type!=1 || bad_dev(a[k].id)) return 1;
  pthread_mutex_lock(&maps_lock);
  for(int i=0;i<64;i++){
    if(!maps[i].size || maps[i].va>=p+s || maps[i].va+maps[i].size<=p) continue;
    for(size_t k=0;k<c;k++){
      if(a[k].flags) maps[i].access |= 1u<<a[k].id; else maps[i].access &= ~(1u<<a[k].id); } }
  pthread_mutex_unlock(&maps_lock);
  return 0; }
// For tests: the devices with access to the mapping holding `va` (bit d: device d); 0 where
// nothing is mapped.
unsigned fake_access_mask(ull va){
  unsigned mask=0;
  pthread_mutex_lock(&maps_lock);
  for(int i=0;i<64;i++) if(maps[i].size && va>=maps[i].va && va<maps[i].va+maps[i].size){ mask=maps[i].access; break; }
  pthread_mutex_unlock(&maps_lock);
  return mask; }
// The handle mapped at an address (no reference counting: the fake's handles are freed by their
// one cuMemRelease), and a plain device allocation's properties for any handle.
int cuMemRetainAllocationHandle(ull* h, ull p){
  int found=1;
  pthread_mutex_lock(&maps_lock);
  for(int i=0;i<64;i++) if(maps[i].size && p>=maps[i].va && p<maps[i].va+maps[i].size){ *h=maps[i].h; found=0; break; }
  pthread_mutex_unlock(&maps_lock);
  return found; }
int cuMemGetAllocationPropertiesFromHandle(void* prop, ull h){
  if(!prop || !h) return 1;
  memset(prop, 0, 32); ((int*)prop)[0]=1; ((int*)prop)[2]=1; return 0; }
int cuMemGetAddressRange_v2(ull* b, size_t* s, ull p){
  pthread_mutex_lock(&maps_lock);
  for(int i=0;i<64;i++) if(maps[i].size && p>=maps[i].va && p<maps[i].va+maps[i].size){ *b=maps[i].va; *s=maps[i].size; pthread_mutex_unlock(&maps_lock); return 0; }
  pthread_mutex_unlock(&maps_lock);
  return 1; }
int cuMemHostAlloc(void** p, size_t n, unsigned f){ if(!cur) return 201; *p=malloc(n); memset(*p, 0x77, n); return *p?0:2; }
int cuMemFreeHost(void* p){ free(p); return 0; }
/* Host memory registered with the "device": nothing to pin here (DtoH copies reach any host
 * memory); counted, so a test can see registrations undone. */
static int host_registered;
int cuMemHostRegister_v2(void* p, size_t n, unsigned f){ if(!cur) return 201; if(!p||!n) return 1; host_registered++; return 0; }
int cuMemHostUnregister(void* p){ if(!p) return 1; host_registered--; return 0; }
// A stream: its priority, and the device of the context it was made in (-1: none current).
static int cur_dev(void){ return cur? (int)((int*)cur-ctxobj) : -1; }
static void* new_stream(int prio){ int* x=malloc(2*sizeof(int)); x[0]=prio; x[1]=cur_dev(); return x; }
int cuStreamCreate(void** s, unsigned f){ *s=new_stream(0); return 0; }
int cuStreamCreateWithPriority(void** s, unsigned f, int prio){ *s=new_stream(prio); return 0; }
int cuStreamGetPriority(void* s, int* p){ *p = s? *(int*)s : 0; return 0; }
// FAKE_CUDA_QUEUE=1: a cuMemcpyPeerAsync on a stream the job made is queued, as on a GPU that
// runs it later, instead of done at once: it is done when its stream (cuStreamSynchronize) or its
// stream's device (cuCtxSynchronize there) is synchronized, and nothing else waits for it (events
// are no-ops). A stream destroyed with work queued keeps it queued on its device.
struct queued { void* st; int dev; ull d, s; size_t n; };
static struct queued queue[64];
static int nqueued;
static pthread_mutex_t queue_lock=PTHREAD_MUTEX_INITIALIZER;
static int queue_on(void){ return getenv("FAKE_CUDA_QUEUE")!=0; }
// Does the queued copies of stream `st` (any stream when null) on device `dev` (any when -1).
static void run_queued(void* st, int dev){
  pthread_mutex_lock(&queue_lock);
  int k=0;
  for(int i=0;i<nqueued;i++){
    struct queued q=queue[i];
    if((!st || q.st==st) && (dev<0 || q.dev==dev)) memmove((void*)(uintptr_t)q.d,(void*)(uintptr_t)q.s,q.n);
    else queue[k++]=q;
  }
  nqueued=k;
  pthread_mutex_unlock(&queue_lock); }
int cuStreamDestroy_v2(void* s){
  pthread_mutex_lock(&queue_lock);
  for(int i=0;i<nqueued;i++) if(queue[i].st==s) queue[i].st=0;
  pthread_mutex_unlock(&queue_lock);
  free(s); return 0; }
int cuStreamSynchronize(void* s){ if(s) run_queued(s, -1); return 0; }
int cuStreamQuery(void* s){ return 0; }
int cuStreamWaitEvent(void* s, void* e, unsigned f){ return 0; }
int cuEventCreate(void** e, unsigned f){ *e=malloc(8); return 0; }
int cuEventRecord(void* e, void* s){ return 0; }
int cuEventQuery(void* e){ return 0; }
int cuEventSynchronize(void* e){ return 0; }
int cuEventDestroy_v2(void* e){ free(e); return 0; }
// Copies and memsets: done at once (a stream-ordered one is complete when it returns).
#define H(x) ((void*)(uintptr_t)(x))
int cuMemcpy(ull d, ull s, size_t n){ memmove(H(d),H(s),n); return 0; }
int cuMemcpy_ptds(ull d, ull s, size_t n){ memmove(H(d),H(s),n); return 0; }
int cuMemcpyAsync(ull d, ull s, size_t n, void* st){ memmove(H(d),H(s),n); return 0; }
int cuMemcpyAsync_ptsz(ull d, ull s, size_t n, void* st){ memmove(H(d),H(s),n); return 0; }
int cuMemcpyHtoD_v2(ull d, const void* s, size_t n){ memcpy(H(d),s,n); return 0; }
int cuMemcpyHtoD_v2_ptds(ull d, const void* s, size_t n){ memcpy(H(d),s,n); return 0; }
int cuMemcpyHtoDAsync_v2(ull d, const void* s, size_t n, void* st){ memcpy(H(d),s,n); return 0; }
int cuMemcpyHtoDAsync_v2_ptsz(ull d, const void* s, size_t n, void* st){ memcpy(H(d),s,n); return 0; }
// Device-to-host reads of memory that is not mapped (freed, or never made) fail with
// CUDA_ERROR_INVALID_VALUE as the real driver's do, instead of faulting: read through
// process_vm_readv, which answers EFAULT for such a range.
static int dtoh(void* d, ull s, size_t n){
  struct iovec local={d,n}, remote={H(s),n};
  return process_vm_readv(getpid(), &local, 1, &remote, 1, 0)==(ssize_t)n? 0 : 1; }
int cuMemcpyDtoH_v2(void* d, ull s, size_t n){ return dtoh(d,s,n); }
int cuMemcpyDtoH_v2_ptds(void* d, ull s, size_t n){ return dtoh(d,s,n); }
int cuMemcpyDtoHAsync_v2(void* d, ull s, size_t n, void* st){ return dtoh(d,s,n); }
int cuMemcpyDtoHAsync_v2_ptsz(void* d, ull s, size_t n, void* st){ return dtoh(d,s,n); }
int cuMemcpyDtoD_v2(ull d, ull s, size_t n){ memmove(H(d),H(s),n); return 0; }
int cuMemcpyDtoD_v2_ptds(ull d, ull s, size_t n){ memmove(H(d),H(s),n); return 0; }
int cuMemcpyDtoDAsync_v2(ull d, ull s, size_t n, void* st){ memmove(H(d),H(s),n); return 0; }
int cuMemcpyDtoDAsync_v2_ptsz(ull d, ull s, size_t n, void* st){ memmove(H(d),H(s),n); return 0; }
static void set16(ull d, unsigned short v, size_t n){ unsigned short* p=H(d); for(size_t i=0;i<n;i++) p[i]=v; }
static void set32(ull d, unsigned v, size_t n){ unsigned* p=H(d); for(size_t i=0;i<n;i++) p[i]=v; }
int cuMemsetD8_v2(ull d, unsigned char v, size_t n){ memset(H(d),v,n); return 0; }
int cuMemsetD8_v2_ptds(ull d, unsigned char v, size_t n){ memset(H(d),v,n); return 0; }
int cuMemsetD16_v2(ull d, unsigned short v, size_t n){ set16(d,v,n); return 0; }
int cuMemsetD16_v2_ptds(ull d, unsigned short v, size_t n){ set16(d,v,n); return 0; }
int cuMemsetD32_v2(ull d, unsigned v, size_t n){ set32(d,v,n); return 0; }
int cuMemsetD32_v2_ptds(ull d, unsigned v, size_t n){ set32(d,v,n); return 0; }
int cuMemsetD8Async(ull d, unsigned char v, size_t n, void* st){ memset(H(d),v,n); return 0; }
int cuMemsetD8Async_ptsz(ull d, unsigned char v, size_t n, void* st){ memset(H(d),v,n); return 0; }
int cuMemsetD16Async(ull d, unsigned short v, size_t n, void* st){ set16(d,v,n); return 0; }
int cuMemsetD16Async_ptsz(ull d, unsigned short v, size_t n, void* st){ set16(d,v,n); return 0; }
int cuMemsetD32Async(ull d, unsigned v, size_t n, void* st){ set32(d,v,n); return 0; }
int cuMemsetD32Async_ptsz(ull d, unsigned v, size_t n, void* st){ set32(d,v,n); return 0; }
// Peer copies (every device's memory is this process's), pitched copies and memsets, copies
// from arrays (a CUarray here is a pointer to its bytes) and stream memory operations.
int cuMemcpyPeer(ull d, void* dc, ull s, void* sc, size_t n){ memmove(H(d),H(s),n); return 0; }
int cuMemcpyPeer_ptds(ull d, void* dc, ull s, void* sc, size_t n){ memmove(H(d),H(s),n); return 0; }
int cuMemcpyPeerAsync(ull d, void* dc, ull s, void* sc, size_t n, void* st){
  if(st && queue_on()){
    pthread_mutex_lock(&queue_lock);
    int full = nqueued==64;
    if(!full) queue[nqueued++] = (struct queued){st, ((int*)st)[1], d, s, n};
    pthread_mutex_unlock(&queue_lock);
    return full? 2 : 0;
  }
  memmove(H(d),H(s),n); return 0; }
int cuMemcpyPeerAsync_ptsz(ull d, void* dc, ull s, void* sc, size_t n, void* st){ memmove(H(d),H(s),n); return 0; }
int cuMemcpyAtoD_v2(ull d, void* a, size_t off, size_t n){ memmove(H(d),(char*)a+off,n); return 0; }
int cuMemcpyAtoD_v2_ptds(ull d, void* a, size_t off, size_t n){ memmove(H(d),(char*)a+off,n); return 0; }
// CUDA_MEMCPY3D and CUDA_MEMCPY3D_PEER (the same 25 words; the memory type in the low half of
// words 4 and 15): host, device or unified sides; arrays are not supported (1).
static char* side3d(const ull* w, int base){
  unsigned t=(unsigned)w[base+4]; ull p = t==1? w[base+5] : (t==2||t==4)? w[base+6] : 0;
  if(!p) return 0;
  return (char*)H(p) + w[base+0] + w[base+1]*w[base+9] + w[base+2]*w[base+10]*w[base+9]; }
static int copy3d(const ull* w){
  if(!w) return 1;
  char* s=side3d(w,0); char* d=side3d(w,11); if(!s||!d) return 1;
  for(ull z=0;z<w[24];z++) for(ull y=0;y<w[23];y++)
    memmove(d + (z*w[21]+y)*w[20], s + (z*w[10]+y)*w[9], w[22]);
  return 0; }
int cuMemcpy3D_v2(const ull* p){ return copy3d(p); }
int cuMemcpy3D_v2_ptds(const ull* p){ return copy3d(p); }
int cuMemcpy3DAsync_v2(const ull* p, void* st){ return copy3d(p); }
int cuMemcpy3DAsync_v2_ptsz(const ull* p, void* st){ return copy3d(p); }
// CUDA_MEMCPY2D (16 words): as a 3D copy of one slice.
static int copy2d(const ull* w){
  if(!w) return 1;
  ull d[25]={0};
  memcpy(d, w, 2*8); memcpy(d+4, w+2, 4*8); d[9]=w[6];
  memcpy(d+11, w+7, 2*8); memcpy(d+15, w+9, 4*8); d[20]=w[13];
  d[22]=w[14]; d[23]=w[15]; d[24]=1;
  return copy3d(d); }
int cuMemcpy2D_v2(const ull* p){ return copy2d(p); }
int cuMemcpy2D_v2_ptds(const ull* p){ return copy2d(p); }
int cuMemcpy2DUnaligned_v2(const ull* p){ return copy2d(p); }
int cuMemcpy2DUnaligned_v2_ptds(const ull* p){ return copy2d(p); }
int cuMemcpy2DAsync_v2(const ull* p, void* st){ return copy2d(p); }
int cuMemcpy2DAsync_v2_ptsz(const ull* p, void* st){ return copy2d(p); }
int cuMemcpy3DPeer(const ull* p){ return copy3d(p); }
int cuMemcpy3DPeer_ptds(const ull* p){ return copy3d(p); }
int cuMemcpy3DPeerAsync(const ull* p, void* st){ return copy3d(p); }
int cuMemcpy3DPeerAsync_ptsz(const ull* p, void* st){ return copy3d(p); }
// (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs[, failIdx], hStream)
static int copy_batch(const ull* d, const ull* s, const size_t* n, size_t count){
  for(size_t i=0;i<count;i++) memmove(H(d[i]),H(s[i]),n[i]);
  return 0; }
int cuMemcpyBatchAsync(const ull* d, const ull* s, const size_t* n, size_t c, void* a, size_t* ai, size_t na, size_t* f, void* st){ return copy_batch(d,s,n,c); }
int cuMemcpyBatchAsync_ptsz(const ull* d, const ull* s, const size_t* n, size_t c, void* a, size_t* ai, size_t na, size_t* f, void* st){ return copy_batch(d,s,n,c); }
int cuMemcpyBatchAsync_v2(const ull* d, const ull* s, const size_t* n, size_t c, void* a, size_t* ai, size_t na, void* st){ return copy_batch(d,s,n,c); }
int cuMemcpyBatchAsync_v2_ptsz(const ull* d, const ull* s, const size_t* n, size_t c, void* a, size_t* ai, size_t na, void* st){ return copy_batch(d,s,n,c); }
int cuMemcpyWithAttributesAsync(ull d, ull s, size_t n, void* attr, void* st){ memmove(H(d),H(s),n); return 0; }
int cuMemcpyWithAttributesAsync_ptsz(ull d, ull s, size_t n, void* attr, void* st){ memmove(H(d),H(s),n); return 0; }
static void set2d(ull d, size_t pitch, unsigned v, size_t elem, size_t w, size_t h){
  for(size_t y=0;y<h;y++){ char* row=(char*)H(d)+y*pitch;
    for(size_t x=0;x<w;x++) memcpy(row+x*elem, &v, elem); } }
#define SET2D(name, T, E) \
  int name(ull d, size_t p, T v, size_t w, size_t h){ set2d(d,p,v,E,w,h); return 0; } \
  int name##_ptds(ull d, size_t p, T v, size_t w, size_t h){ set2d(d,p,v,E,w,h); return 0; }
#define SET2DASYNC(name, T, E) \
  int name(ull d, size_t p, T v, size_t w, size_t h, void* s){ set2d(d,p,v,E,w,h); return 0; } \
  int name##_ptsz(ull d, size_t p, T v, size_t w, size_t h, void* s){ set2d(d,p,v,E,w,h); return 0; }
SET2D(cuMemsetD2D8_v2, unsigned char, 1)
SET2D(cuMemsetD2D16_v2, unsigned short, 2)
SET2D(cuMemsetD2D32_v2, unsigned, 4)
SET2DASYNC(cuMemsetD2D8Async, unsigned char, 1)
SET2DASYNC(cuMemsetD2D16Async, unsigned short, 2)
SET2DASYNC(cuMemsetD2D32Async, unsigned, 4)
int cuStreamWriteValue32(void* s, ull a, unsigned v, unsigned f){ *(unsigned*)H(a)=v; return 0; }
int cuStreamWriteValue32_ptsz(void* s, ull a, unsigned v, unsigned f){ *(unsigned*)H(a)=v; return 0; }
int cuStreamWriteValue32_v2(void* s, ull a, unsigned v, unsigned f){ *(unsigned*)H(a)=v; return 0; }
int cuStreamWriteValue32_v2_ptsz(void* s, ull a, unsigned v, unsigned f){ *(unsigned*)H(a)=v; return 0; }
int cuStreamWriteValue64(void* s, ull a, ull v, unsigned f){ memcpy(H(a),&v,8); return 0; }
int cuStreamWriteValue64_ptsz(void* s, ull a, ull v, unsigned f){ memcpy(H(a),&v,8); return 0; }
int cuStreamWriteValue64_v2(void* s, ull a, ull v, unsigned f){ memcpy(H(a),&v,8); return 0; }
int cuStreamWriteValue64_v2_ptsz(void* s, ull a, ull v, unsigned f){ memcpy(H(a),&v,8); return 0; }
// CUstreamBatchMemOpParams: 48 bytes, the operation first, the address at byte 8 and the value
// at 16; writes (2: 32-bit, 5: 64-bit) are done, waits (1, 4), flush (3) and barrier (6) are
// nothing here; anything else is refused (1).
static int batch(unsigned n, const ull* ops){
  for(unsigned i=0;i<n;i++){ const ull* o=ops+6*i; unsigned t=(unsigned)o[0];
    if(t==2) *(unsigned*)H(o[1])=(unsigned)o[2];
    else if(t==5) memcpy(H(o[1]),&o[2],8);
    else if(t!=1 && t!=3 && t!=4 && t!=6) return 1; }
  return 0; }
int cuStreamBatchMemOp(void* s, unsigned n, const ull* ops, unsigned f){ return batch(n,ops); }
int cuStreamBatchMemOp_ptsz(void* s, unsigned n, const ull* ops, unsigned f){ return batch(n,ops); }
int cuStreamBatchMemOp_v2(void* s, unsigned n, const ull* ops, unsigned f){ return batch(n,ops); }
int cuStreamBatchMemOp_v2_ptsz(void* s, unsigned n, const ull* ops, unsigned f){ return batch(n,ops); }
// Introspection (possum_cuda::introspect) and launches. A kernel "handle" is a pointer to a
// struct fake_kernel { uint64_t magic; const char *name; int n; size_t off[8]; size_t size[8];
// void (*run)(void **params); } made by the test program; anything else is an invalid handle. A
// kernel with n < 0 is one the driver cannot describe (CUDA_ERROR_NOT_SUPPORTED): its layout must
// come from elsewhere. A launch calls `run` (when set) with the launch's kernelParams, at once.
#define FAKE_KERNEL_MAGIC 0x6b65726e656c2121ull
struct fake_kernel { ull magic; const char* name; int n; size_t off[8]; size_t size[8]; void (*run)(void** params); };
static struct fake_kernel* fk(void* h){
  struct fake_kernel* k=h; return (k && (uintptr_t)k%8==0 && k->magic==FAKE_KERNEL_MAGIC)? k : 0; }
static int launch(void* f, void** params){
  struct fake_kernel* k=fk(f); if(!k) return 400; if(!cur) return 201;
  if(!stack_limit) return 701;
  if(k->run) k->run(params);
  return 0; }
// possum's fingerprint kernel (cuda/kernels/fingerprint.ptx, possum_cuda's FingerprintKernel),
// with FAKE_CUDA_FINGERPRINT=1 only: cuModuleLoadData then takes a PTX image that defines
// possum_fingerprint (anything else is CUDA_ERROR_INVALID_IMAGE, 200), and a launch of its function
// does on the CPU what the kernel does on the GPU: block row y of the grid adds the lanes' sums of
// chunk first + y of the range into out[2y], out[2y+1] (the definition: engine/src/fingerprint.rs).
// A misaligned range or chunk is CUDA_ERROR_MISALIGNED_ADDRESS (716), as the GPU's 16-byte loads
// would fault. Without it, cuModuleLoadData refuses every image with
// CUDA_ERROR_UNSUPPORTED_PTX_VERSION (222), as a driver older than the PTX: possum then has no
// fingerprints, as before this driver had the module API.
static int fp_module, fp_function;
int cuModuleLoadData(void** m, const void* image){
  if(!m || !image) return 1;
  if(!cur) return 201;
  if(!getenv("FAKE_CUDA_FINGERPRINT")) return 222;
  if(!strstr(image, ".entry possum_fingerprint(")) return 200;
  *m=&fp_module; return 0; }
int cuModuleGetFunction(void** f, void* m, const char* name){
  if(!f || !name) return 1;
  if(m!=&fp_module) return 400;
  if(strcmp(name, "possum_fingerprint")) return 500;
  *f=&fp_function; return 0; }
int cuModuleUnload(void* m){ return m==&fp_module? 0 : 400; }
static const uint32_t FPK[4][2] = {{0x9E3779B1u, 0x7F4A7C15u}, {0x85EBCA77u, 0x165667B1u},
                                   {0xC2B2AE3Du, 0x27D4EB2Fu}, {0x165667B1u, 0x9E3779B9u}};
static int fp_launch(unsigned gx, unsigned gy, unsigned bx, void** params){
  if(!cur) return 201;
  if(!params || !gx || !gy || gy>65535 || !bx || bx>1024) return 1;
  const unsigned char* base=*(const unsigned char**)params[0];
  ull len=*(ull*)params[1], chunk=*(ull*)params[2], first=*(ull*)params[3];
  ull* out=*(ull**)params[4];
  if((uintptr_t)base%16 || !chunk || chunk%16) return 716;
  for(ull y=0;y<gy;y++){
    ull start=(first+y)*chunk; if(start>=len) continue;
    ull n=len-start<chunk? len-start : chunk, lo=0, hi=0;
    for(ull off=0;off<n;off+=8){
      uint32_t w[2]={0,0};
      for(ull i=0;i<8 && off+i<n;i++) w[i/4]|=(uint32_t)base[start+off+i]<<(8*(i%4));
      uint32_t j=(uint32_t)(off/8);
      lo+=(ull)(w[0]+j*FPK[0][0]+FPK[0][1])*(ull)(w[1]+j*FPK[1][0]+FPK[1][1]);
      hi+=(ull)(w[0]+j*FPK[2][0]+FPK[2][1])*(ull)(w[1]+j*FPK[3][0]+FPK[3][1]); }
    out[2*y]+=lo; out[2*y+1]+=hi; }
  return 0; }
#define DIMS unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shmem
int cuLaunchKernel(void* f, DIMS, void* s, void** params, void** extra){
  if(f==&fp_function) return fp_launch(gx, gy, bx, params);
  return launch(f, params); }
int cuLaunchKernel_ptsz(void* f, DIMS, void* s, void** params, void** extra){ return launch(f, params); }
int cuLaunchCooperativeKernel(void* f, DIMS, void* s, void** params){ return launch(f, params); }
int cuLaunchCooperativeKernel_ptsz(void* f, DIMS, void* s, void** params){ return launch(f, params); }
// CUlaunchConfig: grid and block dimensions, sharedMemBytes, then hStream at byte 32 (unused here).
int cuLaunchKernelEx(const void* config, void* f, void** params, void** extra){ return config? launch(f, params) : 1; }
int cuLaunchKernelEx_ptsz(const void* config, void* f, void** params, void** extra){ return config? launch(f, params) : 1; }
// Legacy launches: the arguments were set by cuParamSet*, which this driver lacks: the kernel
// runs with none (NULL params).
int cuLaunch(void* f){ return launch(f, 0); }
int cuLaunchGrid(void* f, int w, int h){ return launch(f, 0); }
int cuLaunchGridAsync(void* f, int w, int h, void* s){ return launch(f, 0); }
// CUDA_LAUNCH_PARAMS (7 words): the function first, kernelParams last; each launched in turn.
int cuLaunchCooperativeKernelMultiDevice(const ull* lp, unsigned n, unsigned f){
  for(unsigned i=0;i<n;i++){ int r=launch((void*)(uintptr_t)lp[7*i], (void**)(uintptr_t)lp[7*i+6]); if(r) return r; }
  return 0; }
int cuGraphLaunch(void* exec, void* s){ return exec? 0 : 400; }
int cuGraphLaunch_ptsz(void* exec, void* s){ return exec? 0 : 400; }
int cuFuncGetParamInfo(void* f, size_t i, size_t* off, size_t* size){
  struct fake_kernel* k=fk(f); if(!k) return 400; if(k->n<0) return 801; if((int)i>=k->n) return 1;
  *off=k->off[i]; *size=k->size[i]; return 0; }
int cuKernelGetParamInfo(void* f, size_t i, size_t* off, size_t* size){ return 400; }
int cuFuncGetName(const char** n, void* f){ struct fake_kernel* k=fk(f); if(!k) return 400; *n=k->name; return 0; }
int cuKernelGetName(const char** n, void* f){ return 400; }
int cuCtxGetDevice(int* d){
  if(!cur) return 201;
  int i=(int)((int*)cur-ctxobj); *d = (int*)cur>=ctxobj && i<MAXDEV? i : 0; return 0; }
int cuStreamIsCapturing(void* s, int* st){ *st=0; return 0; }
int cuGraphGetNodes(void* g, void** n, size_t* c){ return 1; }
int cuGraphNodeGetType(void* n, int* t){ return 1; }
int cuGraphKernelNodeGetParams_v2(void* n, void* p){ return 1; }
int cuGraphMemsetNodeGetParams(void* n, void* p){ return 1; }
// Checkpoint API (possum_cuda::checkpoint). Each pid has a state: RUNNING (0, any live pid not in
// the table), LOCKED (1), CHECKPOINTED (2). A dead pid (kill(pid, 0) fails) is
// CUDA_ERROR_INVALID_VALUE (1); a call in the wrong state is CUDA_ERROR_ILLEGAL_STATE (401). The
// argument structs (64 bytes each, CUDA 13.0) must have their reserved bytes zeroed, else
// CUDA_ERROR_INVALID_VALUE. A lock with timeoutMs == 1 of a RUNNING pid times out as the real
// driver's does: CUDA_ERROR_NOT_READY (600), the pid left RUNNING.
// FAKE_CKPT_IN_PROCESS=1 (in the caller's environment): the state of a pid that has this driver
// loaded is that process's own (`ckpt_self` in its copy of this library, read and written through
// /proc/PID/mem), as the real driver's is: CRIU dumps it with the process, so a job checkpointed
// by one `possum checkpoint` and restored by a later `possum restore` comes back CHECKPOINTED.
// Otherwise the table below, in the caller's memory.
static pthread_mutex_t ckpt_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { int pid; int state; } ckpt[64];
static volatile int ckpt_self;
// The address of this library's variable `var` (`ckpt_self`, `remap`) in process pid (this
// library's file mapped at offset 0 there), or 0.
static unsigned long remote_addr(int pid, const volatile void* var){
  Dl_info di; struct stat me;
  if(!dladdr((const void*)var, &di) || stat(di.dli_fname, &me)) return 0;
  char path[64]; snprintf(path, sizeof path, "/proc/%d/maps", pid);
  FILE* f=fopen(path, "r"); if(!f) return 0;
  char line[4096]; unsigned long base=0;
  while(!base && fgets(line, sizeof line, f)){
    unsigned long lo, hi, off, ino; char perms[8], dev[16];
    if(sscanf(line, "%lx-%lx %7s %lx %15s %lu", &lo, &hi, perms, &off, dev, &ino)==6
       && off==0 && ino==(unsigned long)me.st_ino) base=lo; }
  fclose(f);
  return base? base + ((uintptr_t)var - (uintptr_t)di.dli_fbase) : 0; }
// Variable `var` of this library in process pid (0 where it cannot be read).
static int remote_int(int pid, const volatile int* var){
  unsigned long at=remote_addr(pid, var); int v=0;
  if(!at) return 0;
  char path[64]; snprintf(path, sizeof path, "/proc/%d/mem", pid);
  int fd=open(path, O_RDONLY); if(fd<0) return 0;
  if(pread(fd, &v, sizeof v, at)!=sizeof v) v=0;
  close(fd);
  return v; }
static int ckpt_step_in_process(int pid, unsigned long at, int from, int to, int* out){
  char path[64]; snprintf(path, sizeof path, "/proc/%d/mem", pid);
  int fd=open(path, O_RDWR), st=0, r=0;
  if(fd<0) return 2;
  if(pread(fd, &st, sizeof st, at)!=sizeof st) r=2;
  else if(out) *out=st;
  else if(st!=from) r=401;
  else if(to<0) r=600;
  else if(pwrite(fd, &to, sizeof to, at)!=sizeof to) r=2;
  close(fd);
  return r; }
static int ckpt_step(int pid, int from, int to, int* out){
  if(pid<=0 || kill(pid, 0)!=0) return 1;
  if(getenv("FAKE_CKPT_IN_PROCESS")){
    unsigned long at=remote_addr(pid, &ckpt_self);
    if(at) return ckpt_step_in_process(pid, at, from, to, out); }
  pthread_mutex_lock(&ckpt_mu);
  int slot=-1, free_slot=-1;
  for(int i=0;i<64;i++){
    if(ckpt[i].pid==pid) slot=i;
    else if(!ckpt[i].pid && free_slot<0) free_slot=i; }
  int st = slot>=0? ckpt[slot].state : 0;
  int r = 0;
  if(out) *out=st;
  else if(st!=from) r=401;
  else if(to<0) r=600;
  else if(to==0){ if(slot>=0) ckpt[slot].pid=0; }
  else if(slot>=0) ckpt[slot].state=to;
  else if(free_slot>=0){ ckpt[free_slot].pid=pid; ckpt[free_slot].state=to; }
  else r=2;
  pthread_mutex_unlock(&ckpt_mu);
  return r; }
// FAKE_CKPT_HANG: a comma-separated list of checkpoint entry points (e.g.
// "cuCheckpointProcessCheckpoint") that never return, as a hung driver's: the caller's thread
// stays in the call, the process's checkpoint state unchanged.
static void hang_if_asked(const char* call){
  const char* h=getenv("FAKE_CKPT_HANG"); size_t n=strlen(call);
  for(const char* p=h? strstr(h, call) : 0; p; p=strstr(p+1, call))
    if((p==h || p[-1]==',') && (p[n]==0 || p[n]==','))
      for(;;) pause(); }
static int zeroed(const void* args, int from){
  const unsigned char* p=args; for(int i=from;i<64;i++) if(p[i]) return 0; return 1; }
int cuCheckpointProcessLock(int pid, void* args){
  unsigned timeout = args? *(unsigned*)args : 0;  // timeoutMs, then reserved0 and reserved1[7]
  if(args && !zeroed(args, 4)) return 1;
  // FAKE_CKPT_LOCK_UNSUPPORTED: driver 580's answer for a process CUPTI subscribed in.
  if(getenv("FAKE_CKPT_LOCK_UNSUPPORTED")) return 801;
  hang_if_asked("cuCheckpointProcessLock");
  return ckpt_step(pid, 0, timeout==1? -1 : 1, 0); }
int cuCheckpointProcessCheckpoint(int pid, void* args){
  if(args && !zeroed(args, 0)) return 1;
  // FAKE_CKPT_DELAY_MS: a checkpoint that takes that long (tests that act while the job is held).
  const char* delay=getenv("FAKE_CKPT_DELAY_MS"); if(delay) usleep(1000*atoi(delay));
  hang_if_asked("cuCheckpointProcessCheckpoint");
  return ckpt_step(pid, 1, 2, 0); }
// gpuPairs (each CUcheckpointGpuPair: the old UUID's 16 bytes, then the new one's) remap the
// restored process's GPUs, with FAKE_CKPT_IN_PROCESS only (in its copy of `remap`, through
// /proc/PID/mem): each ordinal whose physical device has a pair's old UUID is the physical device
// with that pair's new UUID from then on (all pairs taken against the mapping before the
// restore: a pair of swaps swaps). A new UUID of no device (of the MAXDEV) is
// CUDA_ERROR_INVALID_VALUE, the process left CHECKPOINTED.
struct remote_remap { int fd; unsigned long at; int to[MAXDEV]; };
static int remap_plan(int pid, const unsigned char* pairs, unsigned n, struct remote_remap* r){
  r->fd=-1;
  if(!n || !getenv("FAKE_CKPT_IN_PROCESS") || !(r->at=remote_addr(pid, remap))) return 0;
  char path[64]; snprintf(path, sizeof path, "/proc/%d/mem", pid);
  if((r->fd=open(path, O_RDWR))<0) return 2;
  if(pread(r->fd, r->to, sizeof r->to, r->at)!=sizeof r->to){ close(r->fd); r->fd=-1; return 2; }
  int from[MAXDEV]; memcpy(from, r->to, sizeof from);
  for(int o=0;o<MAXDEV;o++){
    unsigned char now[16], u[16]; uuid_of(now, from[o]);
    for(unsigned k=0;k<n;k++){
      const unsigned char* pair=pairs+32*k;
      if(memcmp(pair, now, 16)) continue;
      int p=0; while(p<MAXDEV && (uuid_of(u, p), memcmp(pair+16, u, 16))) p++;
      if(p==MAXDEV){ close(r->fd); r->fd=-1; return 1; }
      r->to[o]=p; break; } }
  return 0; }
int cuCheckpointProcessRestore(int pid, void* args){
  const unsigned char* pairs=0; unsigned n=0;
  if(args){  // gpuPairs at 0, gpuPairsCount at 8, reserved from 12
    pairs=*(const unsigned char**)args; n=*(unsigned*)((char*)args+8);
    if(!zeroed(args, 12) || (n==0)!=(pairs==0)) return 1; }
  hang_if_asked("cuCheckpointProcessRestore");
  if(pid<=0 || kill(pid, 0)!=0) return 1;
  if(remote_int(pid, &imports_live)>0) return 801;
  struct remote_remap rm;
  int r=remap_plan(pid, pairs, n, &rm);
  if(!r) r=ckpt_step(pid, 2, 1, 0);
  if(!r && rm.fd>=0 && pwrite(rm.fd, rm.to, sizeof rm.to, rm.at)!=sizeof rm.to) r=2;
  if(rm.fd>=0) close(rm.fd);
  return r; }
int cuCheckpointProcessUnlock(int pid, void* args){
  if(args && !zeroed(args, 0)) return 1;
  hang_if_asked("cuCheckpointProcessUnlock");
  return ckpt_step(pid, 1, 0, 0); }
int cuCheckpointProcessGetState(int pid, int* state){
  hang_if_asked("cuCheckpointProcessGetState");
  return ckpt_step(pid, 0, 0, state); }
int cuCheckpointProcessGetRestoreThreadId(int pid, int* tid){
  int st; int r=ckpt_step(pid, 0, 0, &st); if(!r) *tid=pid; return r; }
// cuGetProcAddress and _v2: this driver's exported function for a name, as the real driver
// answers: the name's _v2 export when there is one and `version` is at least the version that
// introduced it (3020, CUDA 3.2, for most: cuMemAlloc, cuMemcpyHtoD, cuMemsetD32...), then with
// flags & 2 (CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) its _ptsz or _ptds export if it has
// one; "cuGetProcAddress" is cuGetProcAddress_v2 from 12000 (CUDA 12.0) on. An unknown name is
// CUDA_ERROR_NOT_FOUND (500), with status CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND (1). One name
// has an unexported answer at a version past CUDA 13 (memset_d32_next).
int cuGetProcAddress(const char* sym, void** pfn, int ver, ull flags);
int cuGetProcAddress_v2(const char* sym, void** pfn, int ver, ull flags, int* status);
#define EXPORTS(X) X(cuGetErrorString) X(cuInit) X(cuDriverGetVersion) X(cuDeviceGetCount) \
  X(cuDeviceGet) X(cuDeviceGetName) X(cuDeviceGetAttribute) X(cuDeviceCanAccessPeer) X(cuDeviceGetUuid_v2) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease_v2) \
  X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuCtxGetStreamPriorityRange) X(cuCtxSynchronize) \
  X(cuCtxGetDevice) X(cuMemAlloc_v2) X(cuMemFree_v2) X(cuMemAllocPitch_v2) X(cuMemAllocAsync) \
  X(cuMemAllocAsync_ptsz) X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz) \
  X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz) X(cuMemAllocManaged) X(cuMemGetInfo_v2) X(cuCtxGetLimit) X(cuCtxSetLimit) \
  X(cuMemGetAllocationGranularity) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate) \
  X(cuMemRelease) X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuMemGetAddressRange_v2) \
  X(cuMemRetainAllocationHandle) X(cuMemGetAllocationPropertiesFromHandle) \
  X(cuMemHostAlloc) X(cuMemFreeHost) X(cuMemHostRegister_v2) X(cuMemHostUnregister) X(cuStreamCreate) X(cuStreamCreateWithPriority) \
  X(cuStreamGetPriority) X(cuStreamDestroy_v2) X(cuStreamSynchronize) X(cuStreamQuery) \
  X(cuStreamWaitEvent) X(cuStreamIsCapturing) X(cuEventCreate) X(cuEventRecord) X(cuEventQuery) \
  X(cuEventSynchronize) X(cuEventDestroy_v2) X(cuMemcpy) X(cuMemcpy_ptds) X(cuMemcpyAsync) \
  X(cuMemcpyAsync_ptsz) X(cuMemcpyHtoD_v2) X(cuMemcpyHtoD_v2_ptds) X(cuMemcpyHtoDAsync_v2) \
  X(cuMemcpyHtoDAsync_v2_ptsz) X(cuMemcpyDtoH_v2) X(cuMemcpyDtoH_v2_ptds) X(cuMemcpyDtoHAsync_v2) \
  X(cuMemcpyDtoHAsync_v2_ptsz) X(cuMemcpyDtoD_v2) X(cuMemcpyDtoD_v2_ptds) X(cuMemcpyDtoDAsync_v2) \
  X(cuMemcpyDtoDAsync_v2_ptsz) X(cuMemsetD8_v2) X(cuMemsetD8_v2_ptds) X(cuMemsetD16_v2) \
  X(cuMemsetD16_v2_ptds) X(cuMemsetD32_v2) X(cuMemsetD32_v2_ptds) X(cuMemsetD8Async) \
  X(cuMemsetD8Async_ptsz) X(cuMemsetD16Async) X(cuMemsetD16Async_ptsz) X(cuMemsetD32Async) \
  X(cuMemsetD32Async_ptsz) X(cuLaunchKernel) X(cuLaunchKernel_ptsz) X(cuLaunchCooperativeKernel) \
  X(cuLaunchCooperativeKernel_ptsz) X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz) X(cuGraphLaunch) \
  X(cuGraphLaunch_ptsz) X(cuFuncGetParamInfo) X(cuKernelGetParamInfo) X(cuFuncGetName) \
  X(cuKernelGetName) X(cuGraphGetNodes) X(cuGraphNodeGetType) X(cuGraphKernelNodeGetParams_v2) \
  X(cuGraphMemsetNodeGetParams) X(cuCheckpointProcessLock) X(cuCheckpointProcessCheckpoint) \
  X(cuCheckpointProcessRestore) X(cuCheckpointProcessUnlock) X(cuCheckpointProcessGetState) \
  X(cuCheckpointProcessGetRestoreThreadId) X(cuGetProcAddress) X(cuGetProcAddress_v2)
#define EXPORT(f) {#f, (void*)f},
static const struct { const char* name; void* f; } exports[] = { EXPORTS(EXPORT) };
static void* export_of(const char* name){
  for(size_t i=0;i<sizeof exports/sizeof exports[0];i++) if(!strcmp(exports[i].name, name)) return exports[i].f;
  return 0; }
// The version that introduced a name's _v2 (3020 unless listed).
static int v2_since(const char* sym){
  static const struct { const char* name; int ver; } later[] = {
    {"cuStreamDestroy", 4000}, {"cuEventDestroy", 4000}, {"cuDevicePrimaryCtxRelease", 11000},
    {"cuGraphKernelNodeGetParams", 12000}, {"cuGetProcAddress", 12000}};
  for(size_t i=0;i<sizeof later/sizeof later[0];i++) if(!strcmp(later[i].name, sym)) return later[i].ver;
  return 3020; }
// "cuMemsetD32" at version 14000 or later: a variant this driver does not export, as a newer
// driver answers a newer version of a function (it writes as cuMemsetD32_v2 does).
static int memset_d32_next(ull d, unsigned v, size_t n){ set32(d,v,n); return 0; }
static void* proc_address(const char* sym, int ver, ull flags){
  char name[128], pt[136];
  if(!sym || strlen(sym)>=sizeof name-3) return 0;
  if(ver>=14000 && !strcmp(sym, "cuMemsetD32")) return (void*)memset_d32_next;
  snprintf(name, sizeof name, "%s_v2", sym);
  if(!export_of(name) || ver<v2_since(sym)) snprintf(name, sizeof name, "%s", sym);
  if(flags & 2)
    for(int i=0;i<2;i++){
      snprintf(pt, sizeof pt, "%s%s", name, i? "_ptds" : "_ptsz");
      void* f=export_of(pt); if(f) return f; }
  return export_of(name); }
int cuGetProcAddress_v2(const char* sym, void** pfn, int ver, ull flags, int* status){
  if(!pfn) return 1;
  void* f = proc_address(sym, ver, flags);
  if(status) *status = f? 0 : 1;
  *pfn = f;
  return f? 0 : 500; }
int cuGetProcAddress(const char* sym, void** pfn, int ver, ull flags){
  return cuGetProcAddress_v2(sym, pfn, ver, flags, 0); }
