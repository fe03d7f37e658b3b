/* The job of the NCCL-in-a-local-scope test (fake_nccl_local_job): it loads
 * libfaketorch.so (fake_nccl_local_lib.c, which links libnccl.so.2) with dlopen(RTLD_LOCAL),
 * as Python loads an extension module, and runs its torchlike_run(1). With $FAKE_PAUSE set it
 * then says "ready" and waits for a line on stdin before it exits, so that a test can ask
 * possum about it. Exits with what the init returned. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    void *h = dlopen("libfaketorch.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 100;
    }
    int (*run)(int) = (int (*)(int))dlsym(h, "torchlike_run");
    if (!run) {
        fprintf(stderr, "dlsym: %s\n", dlerror());
        return 101;
    }
    int r = run(1);
    if (getenv("FAKE_PAUSE")) {
        printf("ready\n");
        fflush(stdout);
        char line[16];
        if (!fgets(line, sizeof line, stdin)) return 102;
    }
    return r;
}
