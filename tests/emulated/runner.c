// The guest side of tests/emulated/bochs.py: the init process of a Linux booted in an emulated
// CPU. It runs the calls listed in /cases/spec on buffers read from /cases/blob and prints each
// call's output buffer in hex on the console, where the host compares it with float64.
//
// spec, one item a line:  lib PATH | buf ID BYTES OFFSET (OFFSET -1: zeros) |
//                         call TAG FUNCTION OUT_ID ARG...   (ARG: bID for a buffer, else an integer) |
//                         value TAG FUNCTION                (an int function of no arguments)
// Every argument is passed as a 64-bit integer, which is right for pointers and integers in the
// x86-64 calling convention (an int reads the low half); kernels with float arguments need more.
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/reboot.h>
#include <termios.h>
#include <unistd.h>

#define MAX_BUFS 256
#define MAX_ARGS 12

typedef void (*call12)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t);

static void *bufs[MAX_BUFS];
static size_t sizes[MAX_BUFS];

static void finish(int code) {
    printf("@@END %d\n", code);
    fflush(stdout);
    tcdrain(1);  // the console's driver still holds what was written: halting would drop it
    sleep(1);
    if (getpid() == 1) reboot(RB_POWER_OFF);  // without ACPI the kernel halts; the host stops it
    exit(code);
}

int main(void) {
    FILE *spec = fopen("/cases/spec", "r"), *blob = fopen("/cases/blob", "rb");
    if (!spec || !blob) {
        printf("@@ERROR no /cases/spec or /cases/blob\n");
        finish(2);
    }
    void *lib = NULL;
    char line[4096];
    while (fgets(line, sizeof line, spec)) {
        char *save = NULL, *word = strtok_r(line, " \n", &save);
        if (!word) continue;
        if (!strcmp(word, "lib")) {
            const char *path = strtok_r(NULL, " \n", &save);
            lib = dlopen(path, RTLD_NOW);
            if (!lib) {
                printf("@@ERROR dlopen %s: %s\n", path, dlerror());
                finish(2);
            }
        } else if (!strcmp(word, "buf")) {
            int id = atoi(strtok_r(NULL, " \n", &save));
            size_t bytes = strtoull(strtok_r(NULL, " \n", &save), NULL, 10);
            long long offset = atoll(strtok_r(NULL, " \n", &save));
            free(bufs[id]);
            bufs[id] = aligned_alloc(64, (bytes + 63) / 64 * 64);
            sizes[id] = bytes;
            memset(bufs[id], 0, bytes);
            if (offset >= 0 && (fseek(blob, offset, SEEK_SET) || fread(bufs[id], 1, bytes, blob) != bytes)) {
                printf("@@ERROR blob read for buffer %d\n", id);
                finish(2);
            }
        } else if (!strcmp(word, "value")) {
            const char *tag = strtok_r(NULL, " \n", &save), *name = strtok_r(NULL, " \n", &save);
            int (*fn)(void) = (int (*)(void))dlsym(lib, name);
            if (!fn) {
                printf("@@ERROR no function %s\n", name);
                finish(2);
            }
            printf("@@VALUE %s %d\n", tag, fn());
            fflush(stdout);
        } else if (!strcmp(word, "call")) {
            const char *tag = strtok_r(NULL, " \n", &save), *name = strtok_r(NULL, " \n", &save);
            int out = atoi(strtok_r(NULL, " \n", &save));
            int64_t a[MAX_ARGS] = {0};
            int n = 0;
            for (char *arg; n < MAX_ARGS && (arg = strtok_r(NULL, " \n", &save)); n++)
                a[n] = arg[0] == 'b' ? (int64_t)(intptr_t)bufs[atoi(arg + 1)] : (int64_t)strtoll(arg, NULL, 10);
            call12 fn = (call12)dlsym(lib, name);
            if (!fn) {
                printf("@@ERROR no function %s\n", name);
                finish(2);
            }
            fn(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11]);
            printf("@@OUT %s ", tag);
            const unsigned char *p = bufs[out];
            for (size_t i = 0; i < sizes[out]; i++) printf("%02x", p[i]);
            printf("\n");
            fflush(stdout);
        }
    }
    finish(0);
}
