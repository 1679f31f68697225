// The guest side of tests/emulated/bochs.py: the init process of a Linux booted in an emulated
// CPU. It runs the calls listed in /cases/spec on buffers read from /cases/blob and prints each
// call's output buffer in hex on the console, where the host compares it with float64.
//
// spec, one item a line:  lib PATH | buf ID BYTES OFFSET (OFFSET -1: zeros) |
//                         copy ID FROM                      (a new buffer ID holding FROM's bytes now) |
//                         ptr ID AT TO                      (buffer TO's address stored at byte AT of ID:
//                                                            a struct's pointer field) |
//                         call TAG FUNCTION OUT_ID ARG...   (ARG: bID a buffer, fNUMBER a float, else an integer) |
//                         value TAG FUNCTION                (an int function of no arguments)
// An argument fNUMBER is a float; every other is passed as a 64-bit integer. That is the x86-64
// calling convention's order for any mix of pointers, integers and floats: integers take their
// registers and stack slots in order (an int reads the low half), floats xmm0 on in order, so a
// call with every integer first and the floats after reaches the same places.
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/reboot.h>
#include <termios.h>
#include <unistd.h>

#define MAX_BUFS 32768
#define MAX_ARGS 24
#define MAX_FLOATS 4

#define I8 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t
typedef void (*call_any)(I8, I8, I8, float, float, float, float);

static void *bufs[MAX_BUFS];
static size_t sizes[MAX_BUFS];

static void finish(int code);

static int buffer_id(char **save) {
    const char *word = strtok_r(NULL, " \n", save);
    const int id = word ? atoi(word) : -1;
    if (id < 0 || id >= MAX_BUFS) {
        printf("@@ERROR buffer %d not in 0..%d\n", id, MAX_BUFS - 1);
        finish(2);
    }
    return id;
}

static void allocate(int id, size_t bytes) {
    free(bufs[id]);
    bufs[id] = aligned_alloc(64, (bytes + 63) / 64 * 64);
    sizes[id] = bytes;
    memset(bufs[id], 0, bytes);
}

static void finish(int code) {
    printf("@@END %d\n", code);
    fflush(stdout);
    tcdrain(1);  // the console's driver still holds what was written: halting would drop it
    sleep(1);
    if (getpid() == 1) reboot(RB_POWER_OFF);  // without ACPI the kernel halts; the host stops it
    exit(code);
}

// RUNNER_ROOT: a folder holding cases/ and k/ instead of / (a run on the host itself). Not
// argv: as init, the runner gets the kernel line's words the kernel did not know.
int main(void) {
    char path[4096];
    const char *root = getenv("RUNNER_ROOT") ? getenv("RUNNER_ROOT") : "";
    snprintf(path, sizeof path, "%s/cases/spec", root);
    FILE *spec = fopen(path, "r");
    snprintf(path, sizeof path, "%s/cases/blob", root);
    FILE *blob = fopen(path, "rb");
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
            snprintf(path, sizeof path, "%s%s", root, strtok_r(NULL, " \n", &save));
            lib = dlopen(path, RTLD_NOW);
            if (!lib) {
                printf("@@ERROR dlopen %s: %s\n", path, dlerror());
                finish(2);
            }
        } else if (!strcmp(word, "buf")) {
            const int id = buffer_id(&save);
            size_t bytes = strtoull(strtok_r(NULL, " \n", &save), NULL, 10);
            long long offset = atoll(strtok_r(NULL, " \n", &save));
            allocate(id, bytes);
            if (offset >= 0 && (fseek(blob, offset, SEEK_SET) || fread(bufs[id], 1, bytes, blob) != bytes)) {
                printf("@@ERROR blob read for buffer %d\n", id);
                finish(2);
            }
        } else if (!strcmp(word, "copy")) {
            const int id = buffer_id(&save), from = buffer_id(&save);
            allocate(id, sizes[from]);
            memcpy(bufs[id], bufs[from], sizes[from]);
        } else if (!strcmp(word, "ptr")) {
            const int id = buffer_id(&save);
            const size_t at = strtoull(strtok_r(NULL, " \n", &save), NULL, 10);
            const int to = buffer_id(&save);
            if (at + sizeof(void *) > sizes[id]) {
                printf("@@ERROR pointer at %zu past buffer %d\n", at, id);
                finish(2);
            }
            memcpy((char *)bufs[id] + at, &bufs[to], sizeof(void *));
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
            float f[MAX_FLOATS] = {0};
            int n = 0, nf = 0;
            for (char *arg; (arg = strtok_r(NULL, " \n", &save));) {
                if (arg[0] == 'f' && nf < MAX_FLOATS) f[nf++] = strtof(arg + 1, NULL);
                else if (n < MAX_ARGS)
                    a[n++] = arg[0] == 'b' ? (int64_t)(intptr_t)bufs[atoi(arg + 1)] : (int64_t)strtoll(arg, NULL, 10);
            }
            call_any fn = (call_any)dlsym(lib, name);
            if (!fn) {
                printf("@@ERROR no function %s\n", name);
                finish(2);
            }
            fn(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14],
               a[15], a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23], f[0], f[1], f[2], f[3]);
            printf("@@OUT %s ", tag);
            const unsigned char *p = bufs[out];
            for (size_t i = 0; i < sizes[out]; i++) printf("%02x", p[i]);
            printf("\n");
            fflush(stdout);
        }
    }
    finish(0);
}
