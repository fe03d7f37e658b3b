/* die(what): how the fake jobs report a failure, `error WHAT` on stdout, and exit 1. */
#ifndef FAKE_DIE_H
#define FAKE_DIE_H
#include <stdio.h>
#include <stdlib.h>

static void die(const char *what) {
    printf("error %s\n", what);
    fflush(stdout);
    exit(1);
}
#endif
