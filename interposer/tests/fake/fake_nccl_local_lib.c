/* A stand-in for libtorch_cuda.so (fake_nccl_local_lib): a library that links NCCL
 * (libnccl.so.2, fake_nccl.c) and the CUDA runtime, and that the job loads with
 * dlopen(RTLD_LOCAL), as Python loads PyTorch. Its NCCL and its libnccl are then in no global
 * scope, while its calls of ncclCommInitRank and ncclCommDestroy still bind to the preloaded
 * libpossum.so's exports, which must find NCCL's functions all the same. */
#include <stdio.h>
#include <string.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef struct comm *ncclComm_t;
int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
int ncclCommCount(const ncclComm_t comm, int *count);
int ncclCommDestroy(ncclComm_t comm);
int cudaMalloc(void **p, size_t size);
int cudaFree(void *p);

/* Makes a buffer (so that possum's state exists), joins a communicator of `nranks` ranks as
 * rank 0 and prints what each call returned. */
int torchlike_run(int nranks) {
    void *buf = 0;
    int m = cudaMalloc(&buf, 1 << 20);
    ncclUniqueId id;
    memset(&id, 7, sizeof id);
    ncclComm_t comm = 0;
    int init = ncclCommInitRank(&comm, nranks, id, 0);
    int count = -1;
    if (init == 0) ncclCommCount(comm, &count);
    printf("malloc %d init %d count %d\n", m, init, count);
    fflush(stdout);
    return init;
}

