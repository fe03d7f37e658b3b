/* A job of two ranks doing "collectives" on the fake GPU (fake_ranks_job), as a torchrun job of
 * two NCCL ranks does.
 *
 * The launcher (no FAKE_RANK) creates the shared file $FAKE_RANKS_SHM, starts two ranks (fork +
 * exec of itself with FAKE_RANK=0 and 1: fresh processes, libpossum.so loaded in each), prints
 * "ranks P0 P1" and waits for them; it exits 0 when both did, else 1. It makes a context and a
 * small buffer too, so that possum answers in it (as in torchrun's agent).
 *
 * Each rank makes its context through the driver's entry points and a buffer W of NW words whose
 * first three are a marker, its rank and the collectives it ran; then, for each step s below
 * $FAKE_STEPS: the kernel `work` (W[i] = W[i] * 31 + s + rank for i >= 3), then the collective
 * `ncclDevKernel_AllReduce_Sum_u32_fake`: it publishes this rank's checksum of W for collective k
 * in the shared file and waits until the peer's is there (a real NCCL kernel waits on the GPU for
 * its peer the same way: a rank whose peer never launches the same collective waits for ever),
 * adds it into W[3] and counts it in W[2]. Then the step's line "s k digest" is appended to
 * $FAKE_RANKS_LOG.<rank>, and the rank sleeps $FAKE_STEP_US.
 *
 * $FAKE_IMPORT=1: rank 0 also maps memory through a shareable handle (cuMemCreate with a POSIX fd
 * handle type, exported and imported again, the imported handle mapped), as NCCL maps its peers'
 * buffers.
 *
 * $FAKE_PEER_SHARE=1: the ranks share memory as NCCL's do on one host: rank 0 makes 2 MiB
 * (cuMemCreate with a POSIX fd handle type), maps it, exports it and sends the fd to rank 1 over a
 * Unix socket the launcher made (SCM_RIGHTS); rank 1 imports it and maps it. Every step rank 1
 * reads the first word of that memory through its mapping, sets it to v * 31 + s + 7, and writes
 * v's new value at the end of its line: the memory must be the same bytes across a checkpoint.
 *
 * $FAKE_NCCL_NRANKS=N: each rank first joins an NCCL communicator of N ranks (the same id at
 * every rank) through ncclCommInitRank (the job is linked against an NCCL: fake_nccl.c); with N
 * above 2, ranks the job does not have belong to it, as on another host.
 *
 * $FAKE_STALL_RANK / $FAKE_STALL_AT: that rank stops before the collective of that step (host
 * work that never ends) while its peer goes on into the collective: a cut must not wait for it
 * past its deadline. A collective whose peer never comes fails the rank after 60 s ("error
 * collective K never joined"), so that a deadlock ends a test instead of hanging it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fake_abi.h"
#include "fake_driver.h"

#define NW ((size_t)1 << 16)
#define SLOTS 1024
#define MARKER 0xc011ec71u

struct shared {
    volatile uint64_t seq[2];
    volatile uint32_t val[2][SLOTS];
};
static struct shared *shm;
static int rank;



static uint32_t checksum(const uint32_t *w) {
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < NW; i++) h = (h ^ w[i]) * 16777619u;
    return h;
}

/* work(uint32_t *w, uint32_t s) */
static void run_work(void **p) {
    uint32_t *w = *(uint32_t **)p[0];
    uint32_t s = *(uint32_t *)p[1];
    for (size_t i = 3; i < NW; i++) w[i] = w[i] * 31u + s + (uint32_t)rank;
}
/* allreduce(uint32_t *w): the collective. */
static void run_allreduce(void **p) {
    uint32_t *w = *(uint32_t **)p[0];
    uint64_t k = w[2];
    int peer = 1 - rank;
    shm->val[rank][k % SLOTS] = checksum(w);
    __atomic_store_n(&shm->seq[rank], k + 1, __ATOMIC_RELEASE);
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (__atomic_load_n(&shm->seq[peer], __ATOMIC_ACQUIRE) < k + 1) {
        usleep(100);
        clock_gettime(CLOCK_MONOTONIC, &t);
        if (t.tv_sec - t0.tv_sec > 60) {
            printf("error collective %llu never joined\n", (unsigned long long)k);
            fflush(stdout);
            _exit(3);
        }
    }
    w[3] += shm->val[peer][k % SLOTS];
    w[2] = (uint32_t)(k + 1);
}
static struct fake_kernel work = {FAKE_KERNEL_MAGIC, "work", 2, {0, 8}, {8, 4}, run_work};
static struct fake_kernel allreduce = {FAKE_KERNEL_MAGIC, "ncclDevKernel_AllReduce_Sum_u32_fake", 1,
                                       {0}, {8}, run_allreduce};

static void launch(struct fake_kernel *k, void **args) {
    if (drv_launch(k, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL)) die("cuLaunchKernel");
}

static void context(void) { driver_copies(driver_context()); }

static void map_shared(int create) {
    const char *path = getenv("FAKE_RANKS_SHM");
    if (!path) die("FAKE_RANKS_SHM");
    int fd = open(path, O_RDWR | (create ? O_CREAT | O_TRUNC : 0), 0600);
    if (fd < 0 || (create && ftruncate(fd, sizeof(struct shared)))) die("shared file");
    shm = mmap(NULL, sizeof(struct shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (shm == MAP_FAILED) die("mmap");
    close(fd);
}

/* The driver's virtual-memory functions (through possum's wrappers when it is loaded). */
static struct {
    int (*create)(uint64_t *, size_t, const void *, uint64_t);
    int (*export)(void *, uint64_t, int, uint64_t);
    int (*import)(uint64_t *, void *, int);
    int (*reserve)(uint64_t *, size_t, size_t, uint64_t, uint64_t);
    int (*map)(uint64_t, size_t, size_t, uint64_t, uint64_t);
    int (*set_access)(uint64_t, size_t, const void *, size_t);
} vmm;

/* CUmemAllocationProp: pinned device memory on device 0, POSIX fd handles. */
static const int vmm_prop[8] = {1, 1, 1, 0, 0, 0, 0, 0};

static void vmm_functions(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    vmm.create = dlsym(h, "cuMemCreate");
    vmm.export = dlsym(h, "cuMemExportToShareableHandle");
    vmm.import = dlsym(h, "cuMemImportFromShareableHandle");
    vmm.reserve = dlsym(h, "cuMemAddressReserve");
    vmm.map = dlsym(h, "cuMemMap");
    vmm.set_access = dlsym(h, "cuMemSetAccess");
    if (!vmm.create || !vmm.export || !vmm.import || !vmm.reserve || !vmm.map || !vmm.set_access)
        die("vmm functions");
}

static void map_imported(void) {
    uint64_t mine, theirs, va;
    int fd;
    size_t size = 2u << 20;
    vmm_functions();
    if (vmm.create(&mine, size, vmm_prop, 0) || vmm.export(&fd, mine, 1, 0) ||
        vmm.import(&theirs, (void *)(intptr_t)fd, 1) || vmm.reserve(&va, size, 0, 0, 0) ||
        vmm.map(va, size, 0, theirs, 0))
        die("imported memory");
}

/* Sends (rank 0) or receives (rank 1) fd over the launcher's socket $FAKE_PEER_SOCK. */
static int peer_fd(int fd) {
    int sock = atoi(getenv("FAKE_PEER_SOCK") ? getenv("FAKE_PEER_SOCK") : "-1");
    char byte = 'f', ctl[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&byte, 1};
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl;
    m.msg_controllen = sizeof ctl;
    if (fd >= 0) {
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
        if (sendmsg(sock, &m, 0) != 1) die("sendmsg");
        return fd;
    }
    if (recvmsg(sock, &m, 0) != 1) die("recvmsg");
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    if (!c || c->cmsg_type != SCM_RIGHTS) die("no fd from the peer");
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

/* $FAKE_PEER_SHARE: the shared memory's address in this rank. */
static uint64_t share_with_peer(void) {
    int access[3] = {1, 0, 3};
    uint64_t mem, va;
    int fd;
    size_t size = 2u << 20;
    vmm_functions();
    /* As NCCL: made and mapped, then exported to the peer, which imports and maps it. */
    if (rank == 0) {
        if (vmm.create(&mem, size, vmm_prop, 0)) die("cuMemCreate");
    } else {
        fd = peer_fd(-1);
        if (vmm.import(&mem, (void *)(intptr_t)fd, 1)) die("import");
        close(fd);
    }
    if (vmm.reserve(&va, size, 0, 0, 0) || vmm.map(va, size, 0, mem, 0) ||
        vmm.set_access(va, size, access, 1))
        die("mapping the shared memory");
    if (rank == 0) {
        uint32_t zero = 0;
        if (drv_htod(va, &zero, 4) || vmm.export(&fd, mem, 1, 0)) die("export");
        peer_fd(fd);
        close(fd);
    }
    return va;
}

typedef struct { char internal[128]; } ncclUniqueId;
int ncclCommInitRank(void **comm, int nranks, ncclUniqueId id, int rank);

static int run_rank(void) {
    context();
    if (getenv("FAKE_NCCL_NRANKS")) {
        ncclUniqueId id;
        memset(&id, 0x42, sizeof id);
        void *comm;
        if (ncclCommInitRank(&comm, atoi(getenv("FAKE_NCCL_NRANKS")), id, rank))
            die("ncclCommInitRank");
    }
    if (rank == 0 && getenv("FAKE_IMPORT")) map_imported();
    uint64_t peer = getenv("FAKE_PEER_SHARE") ? share_with_peer() : 0;
    map_shared(0);
    uint32_t *w, *h = malloc(NW * 4);
    if (!h) die("malloc");
    if (cudaMalloc((void **)&w, NW * 4)) die("cudaMalloc");
    for (size_t i = 0; i < NW; i++) h[i] = (uint32_t)(i * 2654435761u) ^ (uint32_t)rank;
    h[0] = MARKER;
    h[1] = (uint32_t)rank;
    h[2] = 0;
    if (drv_htod((uint64_t)(uintptr_t)w, h, NW * 4)) die("htod");
    long steps = atol(getenv("FAKE_STEPS") ? getenv("FAKE_STEPS") : "100");
    long step_us = atol(getenv("FAKE_STEP_US") ? getenv("FAKE_STEP_US") : "1000");
    int stall_rank = getenv("FAKE_STALL_RANK") ? atoi(getenv("FAKE_STALL_RANK")) : -1;
    long stall_at = getenv("FAKE_STALL_AT") ? atol(getenv("FAKE_STALL_AT")) : -1;
    char logp[4096];
    snprintf(logp, sizeof logp, "%s.%d", getenv("FAKE_RANKS_LOG") ? getenv("FAKE_RANKS_LOG") : "/dev/null", rank);
    for (long s = 0; s < steps; s++) {
        uint32_t su = (uint32_t)s;
        void *wa[] = {&w, &su};
        launch(&work, wa);
        if (rank == stall_rank && s == stall_at)
            for (;;) pause();
        void *ca[] = {&w};
        launch(&allreduce, ca);
        if (drv_dtoh(h, (uint64_t)(uintptr_t)w, NW * 4)) die("dtoh");
        FILE *f = fopen(logp, "a");
        if (!f) die("log");
        if (peer && rank == 1) {
            uint32_t v;
            if (drv_dtoh(&v, peer, 4)) die("dtoh shared");
            v = v * 31 + su + 7;
            if (drv_htod(peer, &v, 4)) die("htod shared");
            fprintf(f, "%ld %u %08x %08x\n", s, h[2], checksum(h), v);
        } else {
            fprintf(f, "%ld %u %08x\n", s, h[2], checksum(h));
        }
        if (fclose(f)) die("log close");
        usleep((useconds_t)step_us);
    }
    return 0;
}

int main(void) {
    if (getenv("FAKE_RANK")) {
        rank = atoi(getenv("FAKE_RANK"));
        return run_rank();
    }
    context();
    /* A buffer of its own: possum answers in a process once it used CUDA. */
    void *mine;
    if (cudaMalloc(&mine, 4096)) die("cudaMalloc");
    map_shared(1);
    pid_t p[2];
    int sv[2] = {-1, -1};
    if (getenv("FAKE_PEER_SHARE") && socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) die("socketpair");
    for (int r = 0; r < 2; r++) {
        p[r] = fork();
        if (p[r] < 0) die("fork");
        if (p[r] == 0) {
            char v[8];
            snprintf(v, sizeof v, "%d", r);
            setenv("FAKE_RANK", v, 1);
            if (sv[r] >= 0) {
                close(sv[1 - r]);
                snprintf(v, sizeof v, "%d", sv[r]);
                setenv("FAKE_PEER_SOCK", v, 1);
            }
            execl("/proc/self/exe", "fake_ranks_job", (char *)NULL);
            _exit(127);
        }
    }
    if (sv[0] >= 0) {
        close(sv[0]);
        close(sv[1]);
    }
    printf("ranks %d %d\n", (int)p[0], (int)p[1]);
    fflush(stdout);
    int ok = 1;
    for (int r = 0; r < 2; r++) {
        int st;
        if (waitpid(p[r], &st, 0) != p[r] || !WIFEXITED(st) || WEXITSTATUS(st)) ok = 0;
    }
    printf("%s\n", ok ? "done" : "failed");
    fflush(stdout);
    return ok ? 0 : 1;
}
