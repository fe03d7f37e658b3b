/* A long-running "GPU job" for the fake driver, runtime and CUPTI, driven one command at a time on
 * stdin by tests/fake_session.rs while possum checkpoints, releases and restores it. Every access
 * to device memory (host memory under the fake driver) is a kernel launch or an HtoD or DtoH copy
 * possum sees, so a paused job blocks before touching anything. Two ways:
 *   FAKE_VIA=entry  through the driver's entry points, as a real job: cuLaunchKernel (dlsym on the
 *                   driver's handle) of kernels whose `run` does the work, cuMemcpyHtoD_v2 and
 *                   cuMemcpyDtoH_v2 (looked up with cuGetProcAddress_v2); possum's wrappers of
 *                   them run its hooks (no CUPTI);
 *   otherwise       the work done by the job itself, bracketed by the CUPTI entry and exit
 *                   callbacks the real CUDA call would fire (fake_cupti_fire of POSSUM_CUPTI).
 *
 * At start: cudaMalloc A (1 MiB), B (1 MiB), C (256 KiB), fill them (HtoD copies) with
 *   A[i] = 7i + 1, B[i] = i ^ 0x5a5a5a5a, C[i] = 0 (u32 words); answers "ready".
 * Commands, one a line, each answered with one line on stdout:
 *   step N     runs N steps; answers "done S", S being the steps run since the start. Step s:
 *              mix(A, B, s): B[i] = B[i] * 2654435761 + (A[i] ^ s) (A read, B written);
 *              when s % 3 == 0 also bump(C, s): C[i] += i * s + 1.
 *   malloc     cudaMalloc D (64 KiB), D[i] = 0xd0000000 + i (an HtoD copy); answers "malloced".
 *   dump PATH  reads A, B, C and D if allocated back (DtoH copies) and writes them, in that order,
 *              to PATH; answers "dumped".
 *   share      (FAKE_VMM) exports B's first piece (cuMemExportToShareableHandle, a POSIX fd, as
 *              NCCL does for a peer) and closes the fd; answers "shared", or "error ..." if
 *              the export fails.
 *   exit       cudaFree every buffer; answers "bye" and exits 0 (also at the end of stdin).
 * Anything failing answers "error ..." and exits 1.
 *
 * FAKE_VMM=1 (with FAKE_VIA=entry): B is not a cudaMalloc but the job's own virtual memory, as
 * PyTorch's expandable segments make it: a 4 MiB range reserved (cuMemAddressReserve), two 2 MiB
 * pieces made and mapped there (cuMemCreate, cuMemMap, cuMemSetAccess), B starting 1.5 MiB in,
 * so that it spans both pieces (every mix writes across the boundary through a pointer into the
 * first); at exit the pieces are unmapped and released and the range freed. With
 * FAKE_VMM_HANDLE_CHECKS=refused or =shared (a job whose handles possum serves) it also checks
 * possum's answers for them: cuMemRetainAllocationHandle of an address in B gives the first
 * piece's handle (released again), cuMemGetAllocationPropertiesFromHandle the properties it was
 * made with, and cuMemExportToShareableHandle is refused (CUDA_ERROR_NOT_SUPPORTED: no keeper),
 * or (=shared, with a keeper) gives an fd of the first piece's memory.
 *
 * FAKE_ASYNC=1 (with FAKE_VIA=entry): C and D are stream-ordered allocations (cuMemAllocAsync on
 * the default stream, as cudaMallocAsync makes them) instead of cudaMallocs; before D, a block
 * of D's size is allocated and freed in stream order (cuMemFreeAsync), so D may reuse it; at exit
 * C and D are freed with cuMemFreeAsync.
 *
 * FAKE_CHURN=1 (with FAKE_ASYNC=1): a thread allocates and frees in stream order all the time
 * (a 16 MiB block, a buffer of possum's of its own, and a 64 KiB one from a slab, both freed on
 * a stream of the thread's own, so that possum does not reuse them at once but frees them), as
 * a cudaMallocAsync job does between its steps; nothing it touches is in the results.
 *
 * FAKE_TICKS=PATH: a thread that never touches the GPU appends "tick N" (N = 1, 2, ...) to PATH
 * every millisecond, as a job's logging thread writes: a checkpoint whose job does not run on
 * must not let it write past the dump (the restored job would write those lines again).
 *
 * FAKE_HEAP_MIB=N: N MiB of the job's own memory (malloc), filled with a pattern at start and
 * checked at exit ("error ..." if it changed): a job whose private memory CRIU takes a while to
 * dump. FAKE_MEMFD_MIB=N: as much again in a memfd mapped shared (CRIU dumps its contents in a
 * pages file of their own, before the job's memory).
 *
 * FAKE_WRITER_MIB=N (with FAKE_VIA=entry): a thread rewrites a buffer W of N MiB whole, over
 * and over (the "fill" kernel, word i of launch s being fill_word(i, s)), as a training job
 * rewrites its state every step; at exit it stops, and W must hold one launch's words whole
 * ("W torn" otherwise): an image that mixed two launches' chunks of it fails the job.
 * FAKE_WRITER_HALF=1: only W's first half is rewritten, its second half keeping the words it
 * was filled with ("W torn" otherwise): a buffer of which a copy takes only some chunks.
 *
 * FAKE_CMDS=PATH: the commands come from PATH (a FIFO) instead of stdin, opened read-write onto
 * fd 0, so the open does not wait for a writer and a writer closing is no end of input. For a
 * job CRIU dumps and restores (possum/tests/entry_checkpoint.rs): CRIU reopens the FIFO by its
 * path at restore, where a pipe to the test would come back connected to nothing. (Its stdout is
 * then a file.)
 *
 * Without libpossum (the test's reference run) cudaMalloc is the fake runtime's calloc, the
 * callbacks go nowhere and the driver's functions are the fake driver's own: the same results,
 * computed without possum. */
#define _GNU_SOURCE /* memfd_create */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/mman.h>

#include "fake_abi.h"
#include "fake_driver.h"

enum { CB_LAUNCH = 307, CB_HTOD = 276, CB_DTOH = 278 }; /* cuLaunchKernel, cuMemcpy{HtoD,DtoH}_v2 */
#define NA ((size_t)1 << 18) /* u32 words */
#define NB ((size_t)1 << 18)
#define NC ((size_t)1 << 16)
#define ND ((size_t)1 << 14)

/* mix(const uint32_t *x, uint32_t *y, uint32_t s): B's length; bump(uint32_t *z, uint32_t s): C's. */
static void run_mix(void **p) {
    const uint32_t *a = *(const uint32_t **)p[0];
    uint32_t *b = *(uint32_t **)p[1];
    uint32_t s = *(uint32_t *)p[2];
    for (size_t i = 0; i < NB; i++) b[i] = b[i] * 2654435761u + (a[i] ^ s);
}
static void run_bump(void **p) {
    uint32_t *c = *(uint32_t **)p[0];
    uint32_t s = *(uint32_t *)p[1];
    for (size_t i = 0; i < NC; i++) c[i] += (uint32_t)i * s + 1;
}
static struct fake_kernel mix = {FAKE_KERNEL_MAGIC, "mix", 3, {0, 8, 16}, {8, 8, 4}, run_mix};
static struct fake_kernel bump = {FAKE_KERNEL_MAGIC, "bump", 2, {0, 8}, {8, 4}, run_bump};
static uint32_t fill_word(size_t i, uint32_t s) { return ((uint32_t)i * 2654435761u) ^ s; }
static void run_fill(void **p) {
    uint32_t *w = *(uint32_t **)p[0];
    size_t n = *(size_t *)p[1];
    uint32_t s = *(uint32_t *)p[2];
    for (size_t i = 0; i < n; i++) w[i] = fill_word(i, s);
}
static struct fake_kernel fill = {FAKE_KERNEL_MAGIC, "fill", 3, {0, 8, 16}, {8, 8, 4}, run_fill};

static fire_fn fire;
static int ret;
/* FAKE_VMM: the driver's virtual-memory functions and B's range. */
static int (*drv_reserve)(uint64_t *, size_t, size_t, uint64_t, uint64_t);
static int (*drv_addr_free)(uint64_t, size_t);
static int (*drv_create)(uint64_t *, size_t, const void *, uint64_t);
static int (*drv_release)(uint64_t);
static int (*drv_map)(uint64_t, size_t, size_t, uint64_t, uint64_t);
static int (*drv_unmap)(uint64_t, size_t);
static int (*drv_set_access)(uint64_t, size_t, const void *, size_t);
#define PIECE ((size_t)2 << 20)
/* FAKE_ASYNC: the driver's stream-ordered allocation. */
static int (*drv_alloc_async)(uint64_t *, size_t, void *);
static int (*drv_free_async)(uint64_t, void *);
static uint64_t vmm_base, vmm_handles[2];


/* cuMemcpyHtoD_v2(dst, src, bytes) */
static void htod(void *dst, const void *src, size_t bytes) {
    if (drv_htod) {
        if (drv_htod((uint64_t)(uintptr_t)dst, src, bytes)) die("cuMemcpyHtoD_v2");
        return;
    }
    uint64_t p[3] = {(uint64_t)(uintptr_t)dst, (uint64_t)(uintptr_t)src, bytes};
    fire(CB_HTOD, 0, p, &ret);
    memcpy(dst, src, bytes);
    fire(CB_HTOD, 1, p, &ret);
}

/* cuMemcpyDtoH_v2(dst, src, bytes) */
static void dtoh(void *dst, const void *src, size_t bytes) {
    if (drv_dtoh) {
        if (drv_dtoh(dst, (uint64_t)(uintptr_t)src, bytes)) die("cuMemcpyDtoH_v2");
        return;
    }
    uint64_t p[3] = {(uint64_t)(uintptr_t)dst, (uint64_t)(uintptr_t)src, bytes};
    fire(CB_DTOH, 0, p, &ret);
    memcpy(dst, src, bytes);
    fire(CB_DTOH, 1, p, &ret);
}

/* cuLaunchKernel(k, 1x1x1, 1x1x1, 0, NULL, args, NULL) */
static void launch(struct fake_kernel *k, void **args) {
    if (drv_launch) {
        if (drv_launch(k, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL)) die("cuLaunchKernel");
        return;
    }
    launch_params p = {k, {1, 1, 1, 1, 1, 1}, 0, NULL, args, NULL};
    fire(CB_LAUNCH, 0, &p, &ret);
    k->run(args);
    fire(CB_LAUNCH, 1, &p, &ret);
}

static uint32_t *alloc_filled(size_t n, uint32_t (*f)(size_t)) {
    uint32_t *d, *h = malloc(n * 4);
    if (!h) die("malloc");
    if (cudaMalloc((void **)&d, n * 4)) die("cudaMalloc");
    for (size_t i = 0; i < n; i++) h[i] = f(i);
    htod(d, h, n * 4);
    free(h);
    return d;
}

/* FAKE_TICKS: "tick N" appended to the file every millisecond, for ever. */
static void *ticker(void *path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd < 0) die("FAKE_TICKS");
    for (unsigned long n = 1;; n++) {
        char line[32];
        int k = snprintf(line, sizeof line, "tick %lu\n", n);
        if (write(fd, line, (size_t)k) != k) die("tick");
        usleep(1000);
    }
    return NULL;
}

/* FAKE_WRITER_MIB: W rewritten whole (FAKE_WRITER_HALF: its first half) by launch after launch
 * until writer_stop. */
static uint32_t *writer_buf;
static size_t writer_words, writer_written;
static volatile int writer_stop;
static void *writer(void *ctx) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    int (*set_current)(void *) = lib ? (int (*)(void *))dlsym(lib, "cuCtxSetCurrent") : NULL;
    if (!set_current || set_current(ctx)) die("writer cuCtxSetCurrent");
    for (uint32_t s = 1; !writer_stop; s++) {
        void *args[] = {&writer_buf, &writer_written, &s};
        launch(&fill, args);
        usleep(5000);
    }
    return NULL;
}

/* FAKE_CHURN: stream-ordered allocations and frees, for ever (the async functions are set). */
static void *churn(void *ctx) {
    /* The main thread's context, current here too (as the runtime makes it for every thread). */
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    int (*set_current)(void *) = lib ? (int (*)(void *))dlsym(lib, "cuCtxSetCurrent") : NULL;
    if (!set_current || set_current(ctx)) die("churn cuCtxSetCurrent");
    int (*stream_create)(void **, unsigned) = (int (*)(void **, unsigned))dlsym(lib, "cuStreamCreate");
    void *other = NULL;
    if (!stream_create || stream_create(&other, 0)) die("churn cuStreamCreate");
    for (;;) {
        uint64_t big, small;
        if (drv_alloc_async(&big, (size_t)16 << 20, NULL)) die("churn cuMemAllocAsync");
        if (drv_alloc_async(&small, (size_t)64 << 10, NULL)) die("churn cuMemAllocAsync");
        if (drv_free_async(small, other)) die("churn cuMemFreeAsync");
        if (drv_free_async(big, other)) die("churn cuMemFreeAsync");
    }
    return NULL;
}

/* FAKE_ASYNC: as alloc_filled, from cuMemAllocAsync on the default stream. */
static uint32_t *async_filled(size_t n, uint32_t (*f)(size_t)) {
    if (!drv_alloc_async) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW);
        drv_alloc_async = lib ? (int (*)(uint64_t *, size_t, void *))dlsym(lib, "cuMemAllocAsync") : NULL;
        drv_free_async = lib ? (int (*)(uint64_t, void *))dlsym(lib, "cuMemFreeAsync") : NULL;
        if (!drv_alloc_async || !drv_free_async) die("no cuMemAllocAsync");
    }
    uint64_t p;
    uint32_t *d, *h = malloc(n * 4);
    if (!h) die("malloc");
    if (drv_alloc_async(&p, n * 4, NULL)) die("cuMemAllocAsync");
    d = (uint32_t *)(uintptr_t)p;
    for (size_t i = 0; i < n; i++) h[i] = f(i);
    htod(d, h, n * 4);
    free(h);
    return d;
}

/* B in the job's own virtual memory (FAKE_VMM), filled as alloc_filled fills. */
static uint32_t *vmm_filled(size_t n, uint32_t (*f)(size_t)) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) die("no driver");
    drv_reserve = (int (*)(uint64_t *, size_t, size_t, uint64_t, uint64_t))dlsym(h, "cuMemAddressReserve");
    drv_addr_free = (int (*)(uint64_t, size_t))dlsym(h, "cuMemAddressFree");
    drv_create = (int (*)(uint64_t *, size_t, const void *, uint64_t))dlsym(h, "cuMemCreate");
    drv_release = (int (*)(uint64_t))dlsym(h, "cuMemRelease");
    drv_map = (int (*)(uint64_t, size_t, size_t, uint64_t, uint64_t))dlsym(h, "cuMemMap");
    drv_unmap = (int (*)(uint64_t, size_t))dlsym(h, "cuMemUnmap");
    drv_set_access = (int (*)(uint64_t, size_t, const void *, size_t))dlsym(h, "cuMemSetAccess");
    if (!drv_reserve || !drv_addr_free || !drv_create || !drv_release || !drv_map || !drv_unmap ||
        !drv_set_access)
        die("no virtual-memory functions");
    /* CUmemAllocationProp as PyTorch's expandable segments ask on an H100: pinned (1), a POSIX fd
     * as handle type (1), device (1) 0, allocFlags.gpuDirectRDMACapable (byte 25) 1. */
    uint32_t prop[8] = {1, 1, 1, 0, 0, 0, 0x100, 0};
    /* CUmemAccessDesc: device 0, read-write (3). */
    uint32_t access[3] = {1, 0, 3};
    if (drv_reserve(&vmm_base, 2 * PIECE, 0, 0, 0)) die("cuMemAddressReserve");
    for (int i = 0; i < 2; i++) {
        if (drv_create(&vmm_handles[i], PIECE, prop, 0)) die("cuMemCreate");
        if (drv_map(vmm_base + i * PIECE, PIECE, 0, vmm_handles[i], 0)) die("cuMemMap");
    }
    if (drv_set_access(vmm_base, 2 * PIECE, access, 1)) die("cuMemSetAccess");
    uint32_t *d = (uint32_t *)(uintptr_t)(vmm_base + PIECE * 3 / 4);
    const char *checks = getenv("FAKE_VMM_HANDLE_CHECKS");
    if (checks) {
        int (*retain)(uint64_t *, uint64_t) =
            (int (*)(uint64_t *, uint64_t))dlsym(h, "cuMemRetainAllocationHandle");
        int (*props)(void *, uint64_t) =
            (int (*)(void *, uint64_t))dlsym(h, "cuMemGetAllocationPropertiesFromHandle");
        int (*export)(void *, uint64_t, unsigned, uint64_t) =
            (int (*)(void *, uint64_t, unsigned, uint64_t))dlsym(h, "cuMemExportToShareableHandle");
        uint64_t got = 0;
        uint32_t back[8] = {0};
        int fd = -1;
        if (!retain || !props || !export) die("no handle functions");
        if (retain(&got, (uint64_t)(uintptr_t)d) || got != vmm_handles[0]) die("retain");
        if (drv_release(got)) die("release of the retained handle");
        if (props(back, vmm_handles[1]) || memcmp(back, prop, sizeof prop)) die("properties");
        int r = export(&fd, vmm_handles[0], 1, 0);
        if (!strcmp(checks, "shared")) {
            /* Through the keeper: an fd of the piece's own memory (device memory is host memory
             * in the fake driver, so the job's write through the piece's address shows in the
             * fd's mapping; the word is below B's data). */
            if (r || fd < 0) die("export through the keeper");
            uint32_t *m = mmap(0, PIECE, PROT_READ, MAP_SHARED, fd, 0);
            if (m == MAP_FAILED) die("mmap of the exported fd");
            *(volatile uint32_t *)(uintptr_t)vmm_base = 0x5eed1234u;
            if (m[0] != 0x5eed1234u) die("the exported fd is not the piece's memory");
            munmap(m, PIECE);
            close(fd);
        } else if (r != 801) {
            die("export not refused");
        }
    }
    uint32_t *hbuf = malloc(n * 4);
    if (!hbuf) die("malloc");
    for (size_t i = 0; i < n; i++) hbuf[i] = f(i);
    htod(d, hbuf, n * 4);
    free(hbuf);
    return d;
}

/* The `share` command: B's first piece exported as a POSIX fd (FAKE_VMM). */
static void share_piece(void) {
    if (!vmm_base) die("share: no FAKE_VMM piece");
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    int (*export)(void *, uint64_t, unsigned, uint64_t) =
        h ? (int (*)(void *, uint64_t, unsigned, uint64_t))dlsym(h, "cuMemExportToShareableHandle") : NULL;
    int fd = -1;
    if (!export) die("share: no cuMemExportToShareableHandle");
    if (export(&fd, vmm_handles[0], 1, 0) || fd < 0) die("share: cuMemExportToShareableHandle");
    close(fd);
}

static void vmm_free(void) {
    for (int i = 0; i < 2; i++)
        if (drv_unmap(vmm_base + i * PIECE, PIECE) || drv_release(vmm_handles[i])) die("cuMemUnmap");
    if (drv_addr_free(vmm_base, 2 * PIECE)) die("cuMemAddressFree");
}

static uint32_t init_a(size_t i) { return (uint32_t)(7 * i + 1); }
static uint32_t init_b(size_t i) { return (uint32_t)i ^ 0x5a5a5a5au; }
static uint32_t init_c(size_t i) { (void)i; return 0; }
static uint32_t init_w(size_t i) { return fill_word(i, 0); }
static uint32_t init_d(size_t i) { return 0xd0000000u + (uint32_t)i; }

static void step(uint32_t *a, uint32_t *b, uint32_t *c, uint32_t s) {
    void *args[] = {&a, &b, &s};
    launch(&mix, args);
    if (s % 3 == 0) {
        void *args2[] = {&c, &s};
        launch(&bump, args2);
    }
}

static void dump(const char *path, uint32_t *const *bufs, const size_t *ns, int k) {
    FILE *f = fopen(path, "wb");
    if (!f) die("fopen");
    for (int j = 0; j < k; j++) {
        uint32_t *h = malloc(ns[j] * 4);
        if (!h) die("malloc");
        dtoh(h, bufs[j], ns[j] * 4);
        if (fwrite(h, 4, ns[j], f) != ns[j]) die("fwrite");
        free(h);
    }
    if (fclose(f)) die("fclose");
}

/* FAKE_VIA=entry: the context made current, the driver's functions found. */
static void via_entry(void) {
    typedef int (*gpa_t)(const char *, void **, int, unsigned long long, int *);
    void *h = driver_context();
    gpa_t gpa = (gpa_t)dlsym(h, "cuGetProcAddress_v2");
    void *f1 = NULL, *f2 = NULL;
    int st1 = -1, st2 = -1;
    if (!gpa) die("context");
    if (gpa("cuMemcpyHtoD", &f1, 12000, 0, &st1) || gpa("cuMemcpyDtoH", &f2, 12000, 0, &st2) ||
        st1 || st2)
        die("cuGetProcAddress_v2");
    drv_htod = (int (*)(uint64_t, const void *, size_t))f1;
    drv_dtoh = (int (*)(void *, uint64_t, size_t))f2;
}

/* FAKE_CHILD=1: the job starts a second process of itself (fork + exec, as a CUDA job's helper
 * process is started) that makes its own context and a buffer E and then waits: a process tree
 * with two CUDA processes. On SIGUSR1 the child first bumps E with a kernel, then writes it
 * (a DtoH copy) to $FAKE_CHILD_DUMP (through a temporary name: the file appears complete); it
 * creates $FAKE_CHILD_DUMP.ready once it takes SIGUSR1. The job prints "child PID" before
 * "ready" and kills the child at "exit". */
#define NE NC
static uint32_t init_e(size_t i) { return 0xe0000000u + (uint32_t)(3 * i); }
static volatile sig_atomic_t child_dump_wanted;
static void on_usr1(int sig) { (void)sig; child_dump_wanted = 1; }
static pid_t start_child(void) {
    pid_t c = fork();
    if (c < 0) die("fork");
    if (c == 0) {
        setenv("FAKE_IS_CHILD", "1", 1);
        unsetenv("FAKE_CMDS");
        execl("/proc/self/exe", "fake_session_job", (char *)NULL);
        _exit(127);
    }
    return c;
}

int main(void) {
    if (getenv("FAKE_IS_CHILD")) {
        via_entry();
        uint32_t *e = alloc_filled(NE, init_e);
        uint32_t n = 0;
        signal(SIGUSR1, on_usr1);
        /* Ready for SIGUSR1 (before, it would end the child): $FAKE_CHILD_DUMP.ready. */
        const char *ready = getenv("FAKE_CHILD_DUMP");
        if (ready) {
            char p[4096];
            snprintf(p, sizeof p, "%s.ready", ready);
            FILE *f = fopen(p, "w");
            if (!f || fclose(f)) die("ready file");
        }
        for (;;) {
            /* Polled, not pause(): the signal may be handled on one of possum's threads. */
            usleep(2000);
            if (!child_dump_wanted) continue;
            child_dump_wanted = 0;
            const char *path = getenv("FAKE_CHILD_DUMP");
            if (!path) continue;
            void *args[] = {&e, &n};
            ++n;
            launch(&bump, args);
            char tmp[4096];
            snprintf(tmp, sizeof tmp, "%s.tmp", path);
            size_t ns[] = {NE};
            dump(tmp, &e, ns, 1);
            if (rename(tmp, path)) die("rename");
        }
    }
    pid_t child = getenv("FAKE_CHILD") ? start_child() : 0;
    const char *cmds = getenv("FAKE_CMDS");
    if (cmds && !freopen(cmds, "r+", stdin)) die("FAKE_CMDS");
    const char *via = getenv("FAKE_VIA");
    if (via && !strcmp(via, "entry")) {
        via_entry();
    } else {
        const char *cupti = getenv("POSSUM_CUPTI");
        void *h = cupti ? dlopen(cupti, RTLD_NOW) : NULL;
        fire = h ? (fire_fn)dlsym(h, "fake_cupti_fire") : NULL;
        if (!fire) die("no fake CUPTI");
    }
    int vmm = getenv("FAKE_VMM") != NULL;
    if (vmm && !drv_launch) die("FAKE_VMM needs FAKE_VIA=entry");
    uint32_t *a = alloc_filled(NA, init_a);
    uint32_t *b = vmm ? vmm_filled(NB, init_b) : alloc_filled(NB, init_b);
    int async = getenv("FAKE_ASYNC") != NULL;
    if (async && !drv_launch) die("FAKE_ASYNC needs FAKE_VIA=entry");
    uint32_t *c = async ? async_filled(NC, init_c) : alloc_filled(NC, init_c);
    if (getenv("FAKE_CHURN")) {
        pthread_t t;
        void *lib = dlopen("libcuda.so.1", RTLD_NOW);
        int (*get_current)(void **) = lib ? (int (*)(void **))dlsym(lib, "cuCtxGetCurrent") : NULL;
        void *ctx = NULL;
        if (!async) die("FAKE_CHURN needs FAKE_ASYNC");
        if (!get_current || get_current(&ctx) || !ctx) die("cuCtxGetCurrent");
        if (pthread_create(&t, NULL, churn, ctx)) die("pthread_create");
    }
    size_t heap_words = getenv("FAKE_HEAP_MIB") ? (size_t)atol(getenv("FAKE_HEAP_MIB")) << 18 : 0;
    uint32_t *heap = heap_words ? malloc(heap_words * 4) : NULL;
    if (heap_words && !heap) die("FAKE_HEAP_MIB");
    for (size_t i = 0; i < heap_words; i++) heap[i] = (uint32_t)(i * 2654435761u) ^ 0x9e3779b9u;
    size_t memfd_words = getenv("FAKE_MEMFD_MIB") ? (size_t)atol(getenv("FAKE_MEMFD_MIB")) << 18 : 0;
    uint32_t *shared = NULL;
    if (memfd_words) {
        int fd = memfd_create("fake-job", 0);
        if (fd < 0 || ftruncate(fd, (off_t)(memfd_words * 4))) die("FAKE_MEMFD_MIB");
        shared = mmap(NULL, memfd_words * 4, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (shared == MAP_FAILED) die("FAKE_MEMFD_MIB: mmap");
        close(fd);
        for (size_t i = 0; i < memfd_words; i++) shared[i] = (uint32_t)i * 40503u + 7u;
    }
    pthread_t writer_thread;
    writer_words = getenv("FAKE_WRITER_MIB") ? (size_t)atol(getenv("FAKE_WRITER_MIB")) << 18 : 0;
    writer_written = getenv("FAKE_WRITER_HALF") ? writer_words / 2 : writer_words;
    if (writer_words) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW);
        int (*get_current)(void **) = lib ? (int (*)(void **))dlsym(lib, "cuCtxGetCurrent") : NULL;
        void *ctx = NULL;
        if (!drv_launch) die("FAKE_WRITER_MIB needs FAKE_VIA=entry");
        if (!get_current || get_current(&ctx) || !ctx) die("cuCtxGetCurrent");
        writer_buf = alloc_filled(writer_words, init_w);
        if (pthread_create(&writer_thread, NULL, writer, ctx)) die("pthread_create");
    }
    if (getenv("FAKE_TICKS")) {
        pthread_t t;
        if (pthread_create(&t, NULL, ticker, getenv("FAKE_TICKS"))) die("pthread_create");
    }
    uint32_t *d = NULL;
    uint32_t s = 0;
    if (child) printf("child %d\n", (int)child);
    puts("ready");
    fflush(stdout);
    char line[4096];
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        if (!strncmp(line, "step ", 5)) {
            long n = atol(line + 5);
            for (long k = 0; k < n; k++) step(a, b, c, ++s);
            printf("done %u\n", s);
        } else if (!strcmp(line, "malloc")) {
            if (d) die("D already allocated");
            if (async) {
                uint32_t *t = async_filled(ND, init_d);
                if (drv_free_async((uint64_t)(uintptr_t)t, NULL)) die("cuMemFreeAsync");
                d = async_filled(ND, init_d);
            } else {
                d = alloc_filled(ND, init_d);
            }
            puts("malloced");
        } else if (!strncmp(line, "dump ", 5)) {
            uint32_t *bufs[] = {a, b, c, d};
            size_t ns[] = {NA, NB, NC, ND};
            dump(line + 5, bufs, ns, d ? 4 : 3);
            puts("dumped");
        } else if (!strcmp(line, "share")) {
            share_piece();
            puts("shared");
        } else if (!strcmp(line, "exit")) {
            break;
        } else {
            die("unknown command");
        }
        fflush(stdout);
    }
    if (writer_words) {
        writer_stop = 1;
        if (pthread_join(writer_thread, NULL)) die("pthread_join");
        uint32_t *w = malloc(writer_words * 4);
        if (!w) die("malloc");
        dtoh(w, writer_buf, writer_words * 4);
        for (size_t i = 0; i < writer_words; i++)
            if (w[i] != fill_word(i, i < writer_written ? w[0] : 0)) die("FAKE_WRITER_MIB: W torn");
        free(w);
        if (cudaFree(writer_buf)) die("cudaFree");
    }
    for (size_t i = 0; i < heap_words; i++)
        if (heap[i] != ((uint32_t)(i * 2654435761u) ^ 0x9e3779b9u)) die("FAKE_HEAP_MIB: changed");
    free(heap);
    for (size_t i = 0; i < memfd_words; i++)
        if (shared[i] != (uint32_t)i * 40503u + 7u) die("FAKE_MEMFD_MIB: changed");
    if (child) kill(child, SIGKILL);
    if (vmm)
        vmm_free();
    else if (cudaFree(b))
        die("cudaFree");
    if (async) {
        if (drv_free_async((uint64_t)(uintptr_t)c, NULL) ||
            (d && drv_free_async((uint64_t)(uintptr_t)d, NULL)))
            die("cuMemFreeAsync");
    } else if (cudaFree(c) || (d && cudaFree(d))) {
        die("cudaFree");
    }
    if (cudaFree(a)) die("cudaFree");
    puts("bye");
    return 0;
}
