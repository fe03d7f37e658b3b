// CUDA IPC of VMM memory, as NCCL shares its buffers with the other ranks of a host: memory made
// with cuMemCreate (a POSIX fd as handle type), mapped, filled, exported with
// cuMemExportToShareableHandle, then imported again (cuMemImportFromShareableHandle) and mapped
// at a second address, where it must read the same. Under possum with a keeper (`possum run`),
// the first memory is possum's (served) and the fd is the keeper's; without one the export is
// refused and this program says so (exit 2). One process plays both sides: the import goes to
// the driver whoever made the fd.
//
//   nvcc -O2 -arch=sm_90 -o vmmshare vmmshare.cu -lcuda && ./vmmshare
//
// stdout: {"exported": true, "same": true, "bytes": N} or {"exported": false, "error": "..."}.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <unistd.h>
#include <cuda.h>

#define CHECK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_ = "?"; \
    cuGetErrorName(r_, &s_); fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, s_); exit(1); } } while (0)

static CUdeviceptr reserve_and_map(CUmemGenericAllocationHandle h, size_t size, CUdevice dev) {
    CUdeviceptr va = 0;
    CHECK(cuMemAddressReserve(&va, size, 0, 0, 0));
    CHECK(cuMemMap(va, size, 0, h, 0));
    CUmemAccessDesc access = {};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK(cuMemSetAccess(va, size, &access, 1));
    return va;
}

int main() {
    CHECK(cuInit(0));
    CUdevice dev;
    CHECK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));

    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    size_t gran = 0;
    CHECK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    const size_t size = 8 * gran;

    CUmemGenericAllocationHandle h;
    CHECK(cuMemCreate(&h, size, &prop, 0));
    CUdeviceptr a = reserve_and_map(h, size, dev);
    std::vector<uint32_t> pattern(size / 4), back(size / 4, 0);
    for (size_t i = 0; i < pattern.size(); i++) pattern[i] = (uint32_t)(i * 2654435761u + 7);
    CHECK(cuMemcpyHtoD(a, pattern.data(), size));

    int fd = -1;
    CUresult r = cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS) {
        const char *s = "?";
        cuGetErrorName(r, &s);
        printf("{\"exported\": false, \"error\": \"%s\"}\n", s);
        return 2;
    }
    CUmemGenericAllocationHandle imported;
    CHECK(cuMemImportFromShareableHandle(&imported, (void *)(uintptr_t)fd,
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd);
    CUdeviceptr b = reserve_and_map(imported, size, dev);
    CHECK(cuMemcpyDtoH(back.data(), b, size));
    bool same = memcmp(back.data(), pattern.data(), size) == 0;
    printf("{\"exported\": true, \"same\": %s, \"bytes\": %zu}\n", same ? "true" : "false", size);

    CHECK(cuMemUnmap(b, size));
    CHECK(cuMemAddressFree(b, size));
    CHECK(cuMemRelease(imported));
    CHECK(cuMemUnmap(a, size));
    CHECK(cuMemAddressFree(a, size));
    CHECK(cuMemRelease(h));
    return same ? 0 : 1;
}
