/* A stand-in for libnccl.so.2's communicator calls (fake_nccl), for the ranks test job: a
 * communicator is a small record of its size and rank; nothing is communicated. Built as
 * libnccl.so.2 and linked by the job, so that the preloaded libpossum.so's wrappers take the
 * calls first, as they do a PyTorch job's. */
#include <stdlib.h>

typedef struct { char internal[128]; } ncclUniqueId;
struct comm { int nranks, rank; };
typedef struct comm *ncclComm_t;

int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    (void)id;
    if (!comm || nranks < 1 || rank < 0 || rank >= nranks) return 4; /* ncclInvalidArgument */
    struct comm *c = malloc(sizeof *c);
    if (!c) return 1; /* ncclUnhandledCudaError stands in for an allocation failure */
    c->nranks = nranks;
    c->rank = rank;
    *comm = c;
    return 0;
}

int ncclCommCount(const ncclComm_t comm, int *count) {
    if (!comm || !count) return 4;
    *count = comm->nranks;
    return 0;
}

int ncclCommDestroy(ncclComm_t comm) {
    free(comm);
    return 0;
}
