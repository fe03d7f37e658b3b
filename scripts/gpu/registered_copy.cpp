// How fast device memory reaches an image's data file on a tmpfs, by two routes:
//   staged:     device -> pinned staging chunks -> writer threads pwrite() them into the file
//               (possum's route today);
//   registered: the file mapped (MAP_SHARED) and registered with the driver
//               (cuMemHostRegister), the device copying straight into its pages; then the
//               writer threads read each chunk once (a stand-in for the fingerprint pass).
// It also times what the registered route costs off the copy's path: mapping and populating the
// file, registering it, unregistering and unmapping it.
//
//   registered_copy DIR GIB [WRITERS...]      (one JSON object per line on stdout)
//
// Built with `nvcc -O2 registered_copy.cpp -lcuda` on the GPU machine
// (scripts/gpu-registered-copy.sh). Without `__CUDACC__` it builds with g++ alone and stands a
// host buffer in for the device, so that the host side can be checked anywhere.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#ifdef __CUDACC__
#include <cuda.h>
#define CK(x)                                                                      \
    do {                                                                           \
        CUresult r_ = (x);                                                         \
        if (r_ != CUDA_SUCCESS) {                                                  \
            const char *s_ = nullptr;                                              \
            cuGetErrorString(r_, &s_);                                             \
            fprintf(stderr, "%s: %s (%d)\n", #x, s_ ? s_ : "?", (int)r_);          \
            return false;                                                          \
        }                                                                          \
    } while (0)
#endif

static const size_t CHUNK = 8ull << 20;   // possum's chunk (POSSUM_CHUNK_MIB)
static const size_t STAGING = 32;         // chunks of pinned staging (256 MiB, possum's)

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The "device": a device buffer, or a host buffer standing in for it.
struct Dev {
    size_t bytes = 0;
#ifdef __CUDACC__
    CUcontext ctx{};
    CUdeviceptr src{};
    std::vector<CUstream> streams;
#else
    char *src = nullptr;
#endif

    bool open(size_t n) {
        bytes = n;
#ifdef __CUDACC__
        CUdevice d;
        CK(cuInit(0));
        CK(cuDeviceGet(&d, 0));
        CK(cuDevicePrimaryCtxRetain(&ctx, d));
        CK(cuCtxSetCurrent(ctx));
        CK(cuMemAlloc(&src, n));
        CK(cuMemsetD32(src, 0x5a5a5a5a, n / 4));
        streams.resize(4);
        for (auto &s : streams) CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        CK(cuCtxSynchronize());
#else
        src = static_cast<char *>(malloc(n));
        if (!src) return false;
        memset(src, 0x5a, n);
#endif
        return true;
    }

    // Copies chunk `i` into `dst` and waits for it (the writer's wait).
    bool copy_chunk(size_t i, void *dst, size_t len) {
#ifdef __CUDACC__
        // (The context current on this thread too: each writer is a thread of its own.)
        CK(cuCtxSetCurrent(ctx));
        CUstream s = streams[i % streams.size()];
        CK(cuMemcpyDtoHAsync(dst, src + i * CHUNK, len, s));
        CK(cuStreamSynchronize(s));
#else
        memcpy(dst, src + i * CHUNK, len);
#endif
        return true;
    }

    bool pin(void *p, size_t n, double *ms) {
        double t = now();
#ifdef __CUDACC__
        CK(cuMemHostRegister(p, n, 0));
#else
        (void)p;
        (void)n;
#endif
        *ms = (now() - t) * 1e3;
        return true;
    }

    bool unpin(void *p, double *ms) {
        double t = now();
#ifdef __CUDACC__
        CK(cuMemHostUnregister(p));
#else
        (void)p;
#endif
        *ms = (now() - t) * 1e3;
        return true;
    }

    void *alloc_pinned(size_t n) {
#ifdef __CUDACC__
        void *p = nullptr;
        if (cuMemHostAlloc(&p, n, 0) != CUDA_SUCCESS) return nullptr;
        return p;
#else
        return malloc(n);
#endif
    }
};

static uint64_t read_sum(const char *p, size_t n) {
    uint64_t s = 0;
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        s += v;
    }
    return s;
}

// Every chunk of the device buffer into `fd` at its offset, by `writers` threads, each taking the
// next chunk: copied into its own staging buffer (of `STAGING` shared in turn) then pwrite()n.
static bool staged(Dev &dev, int fd, int writers, const std::vector<char *> &staging, double *s) {
    size_t chunks = dev.bytes / CHUNK;
    std::atomic<size_t> next{0};
    std::atomic<bool> ok{true};
    std::vector<std::thread> ts;
    double t = now();
    for (int w = 0; w < writers; w++) {
        ts.emplace_back([&, w] {
            char *buf = staging[w % staging.size()];
            for (size_t i; (i = next.fetch_add(1)) < chunks;) {
                if (!dev.copy_chunk(i, buf, CHUNK) ||
                    pwrite(fd, buf, CHUNK, (off_t)(i * CHUNK)) != (ssize_t)CHUNK) {
                    ok = false;
                    return;
                }
            }
        });
    }
    for (auto &x : ts) x.join();
    *s = now() - t;
    return ok;
}

// Every chunk straight into the registered mapping at `map`, then read once by its thread.
static bool registered(Dev &dev, char *map, int writers, double *s, uint64_t *sum) {
    size_t chunks = dev.bytes / CHUNK;
    std::atomic<size_t> next{0};
    std::atomic<bool> ok{true};
    std::atomic<uint64_t> total{0};
    std::vector<std::thread> ts;
    double t = now();
    for (int w = 0; w < writers; w++) {
        ts.emplace_back([&] {
            for (size_t i; (i = next.fetch_add(1)) < chunks;) {
                if (!dev.copy_chunk(i, map + i * CHUNK, CHUNK)) {
                    ok = false;
                    return;
                }
                total += read_sum(map + i * CHUNK, CHUNK);
            }
        });
    }
    for (auto &x : ts) x.join();
    *s = now() - t;
    *sum = total;
    return ok;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s DIR GIB [WRITERS...]\n", argv[0]);
        return 2;
    }
    std::string dir = argv[1];
    size_t bytes = (size_t)atof(argv[2]) * (1ull << 30);
    bytes -= bytes % CHUNK;
    std::vector<int> writers;
    for (int i = 3; i < argc; i++) writers.push_back(atoi(argv[i]));
    if (writers.empty()) writers = {6, 16};
    Dev dev;
    if (!dev.open(bytes)) return 1;
    std::vector<char *> staging;
    for (size_t i = 0; i < STAGING; i++) {
        char *p = static_cast<char *>(dev.alloc_pinned(CHUNK));
        if (!p) {
            fprintf(stderr, "no pinned staging\n");
            return 1;
        }
        staging.push_back(p);
    }
    std::string path = dir + "/registered-copy.data";
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || fallocate(fd, 0, 0, (off_t)bytes) != 0) {
        perror(path.c_str());
        return 1;
    }
    double gb = bytes / 1e9;
    // Staged, into a file whose pages exist (a final copy rewrites a round's chunks in place).
    for (int w : writers) {
        for (int pass = 0; pass < 2; pass++) {
            double s;
            if (!staged(dev, fd, w, staging, &s)) {
                fprintf(stderr, "staged copy failed\n");
                return 1;
            }
            printf("{\"route\": \"staged\", \"dir\": \"%s\", \"gib\": %.2f, \"writers\": %d, \"pass\": %d, "
                   "\"s\": %.4f, \"gb_per_s\": %.2f}\n",
                   dir.c_str(), bytes / double(1ull << 30), w, pass, s, gb / s);
            fflush(stdout);
        }
    }
    // Registered: what it costs to make ready, then the copy, then what it costs to let go.
    double t = now();
    char *map = static_cast<char *>(
        mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0));
    if (map == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    double map_ms = (now() - t) * 1e3, pin_ms = 0, unpin_ms = 0;
    bool pinned = dev.pin(map, bytes, &pin_ms);
    printf("{\"route\": \"registered\", \"dir\": \"%s\", \"map_populate_ms\": %.1f, \"register_ok\": %s, "
           "\"register_ms\": %.1f}\n",
           dir.c_str(), map_ms, pinned ? "true" : "false", pin_ms);
    fflush(stdout);
    if (pinned) {
        for (int w : writers) {
            for (int pass = 0; pass < 2; pass++) {
                double s;
                uint64_t sum = 0;
                if (!registered(dev, map, w, &s, &sum)) {
                    fprintf(stderr, "registered copy failed\n");
                    return 1;
                }
                // Every byte is 0x5a: the sum says the copies landed.
                uint64_t want = (bytes / 8) * 0x5a5a5a5a5a5a5a5aull;
                printf("{\"route\": \"registered\", \"dir\": \"%s\", \"gib\": %.2f, \"writers\": %d, "
                       "\"pass\": %d, \"s\": %.4f, \"gb_per_s\": %.2f, \"bytes_right\": %s}\n",
                       dir.c_str(), bytes / double(1ull << 30), w, pass, s, gb / s,
                       sum == want ? "true" : "false");
                fflush(stdout);
            }
        }
        dev.unpin(map, &unpin_ms);
    }
    t = now();
    munmap(map, bytes);
    printf("{\"route\": \"registered\", \"dir\": \"%s\", \"unregister_ms\": %.1f, \"munmap_ms\": %.1f}\n",
           dir.c_str(), unpin_ms, (now() - t) * 1e3);
    close(fd);
    unlink(path.c_str());
    return 0;
}
