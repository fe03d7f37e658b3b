/* A multi-threaded "GPU job" for the fake driver and runtime *without CUPTI*: possum serves its
 * cudaMalloc but sees none of its work, so a checkpoint must hold it by parking its threads
 * (interposer/src/park.rs). Driven by tests/fake_park.rs.
 *
 * At start: cudaMalloc A and B (1 MiB each; host memory under the fake driver), A[i] = 7i + 1,
 * B[i] = i ^ 0x5a5a5a5a (u32 words), a worker thread started; answers "ready".
 * The worker runs steps until told to stop: step s: B[i] = B[i] * 2654435761 + (A[i] ^ s), then
 * prints "s <s>" and sleeps 1 ms. Touching A or B while possum has released them (unmapped
 * under the fake driver) kills the job with SIGSEGV: a worker that was not parked would.
 * Commands on stdin, each answered with one line:
 *   hold MS     a third thread takes the fake driver's internal lock for MS ms (as a thread stopped
 *               inside a driver call would hold it); answers "holding" once it has it.
 *   masked      starts a thread named "masked" that blocks every signal and sleeps: possum cannot
 *               park it; answers "masking".
 *   stop        stops the worker; answers "stopped S" (S: the last step run).
 *   dump PATH   writes A then B to PATH; answers "dumped".
 *   exit        answers "bye", exits 0. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fake_abi.h"

/* The fake driver's (resolved at run time: the job links only the runtime). */
static void (*fake_driver_hold)(int on);

static const size_t N = 1 << 18; /* u32 words per buffer */
static uint32_t *a, *b;
static atomic_int stop_flag;
static atomic_uint last_step;
static pthread_mutex_t out_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int holding;

static void say(const char *fmt, unsigned v) {
    pthread_mutex_lock(&out_mu);
    printf(fmt, v);
    fflush(stdout);
    pthread_mutex_unlock(&out_mu);
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts)) {}
}

static void *worker(void *arg) {
    (void)arg;
    for (uint32_t s = 1; !atomic_load(&stop_flag); s++) {
        for (size_t i = 0; i < N; i++) b[i] = b[i] * 2654435761u + (a[i] ^ s);
        atomic_store(&last_step, s);
        say("s %u\n", s);
        sleep_ms(1);
    }
    return NULL;
}

static atomic_int masking;

static void *masked(void *arg) {
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    pthread_setname_np(pthread_self(), "masked");
    atomic_store(&masking, 1);
    for (;;) sleep_ms(1000);
    return NULL;
}

static void *holder(void *arg) {
    long ms = (long)(intptr_t)arg;
    fake_driver_hold(1);
    atomic_store(&holding, 1);
    sleep_ms(ms);
    fake_driver_hold(0);
    return NULL;
}

int main(void) {
    fake_driver_hold = (void (*)(int))dlsym(RTLD_DEFAULT, "fake_driver_hold");
    if (!fake_driver_hold) {
        puts("error no fake driver");
        return 1;
    }
    if (cudaMalloc((void **)&a, N * 4) || cudaMalloc((void **)&b, N * 4)) {
        puts("error cudaMalloc");
        return 1;
    }
    for (size_t i = 0; i < N; i++) {
        a[i] = (uint32_t)(7 * i + 1);
        b[i] = (uint32_t)i ^ 0x5a5a5a5au;
    }
    pthread_t w, h;
    pthread_create(&w, NULL, worker, NULL);
    say("ready\n", 0);
    char line[4096];
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        if (!strncmp(line, "hold ", 5)) {
            atomic_store(&holding, 0);
            pthread_create(&h, NULL, holder, (void *)(intptr_t)atol(line + 5));
            pthread_detach(h);
            while (!atomic_load(&holding)) sleep_ms(1);
            say("holding\n", 0);
        } else if (!strcmp(line, "masked")) {
            pthread_create(&h, NULL, masked, NULL);
            pthread_detach(h);
            while (!atomic_load(&masking)) sleep_ms(1);
            say("masking\n", 0);
        } else if (!strcmp(line, "stop")) {
            atomic_store(&stop_flag, 1);
            pthread_join(w, NULL);
            say("stopped %u\n", atomic_load(&last_step));
        } else if (!strncmp(line, "dump ", 5)) {
            FILE *f = fopen(line + 5, "wb");
            if (!f || fwrite(a, 4, N, f) != N || fwrite(b, 4, N, f) != N || fclose(f)) {
                puts("error dump");
                return 1;
            }
            say("dumped\n", 0);
        } else if (!strcmp(line, "exit")) {
            say("bye\n", 0);
            return 0;
        }
    }
    return 0;
}
