/* SPDX-License-Identifier: MPL-2.0 */
/*
 * What taking a frame through the C API costs with cold caches, as after a consumer's sleep:
 * a publisher and a subscriber in this process; per frame, publish, sleep SLEEP_US and write
 * EVICT_MIB MiB (the caches and the TLB lose what the frame's way reads), then time
 * gpushm_subscriber_next_frame_info + gpushm_frame_destroy (the frame is there already: no
 * wait). Prints the median and the mean in ns, and the same with warm caches; `bench cold`
 * measures the Rust subscriber the same way:
 *   c_cold DIR [FRAMES [EVICT_MIB [SLEEP_US]]]
 * Built with: cc -O2 c_cold.c -o c_cold $(pkg-config --cflags --libs gpushm)
 */
#define _POSIX_C_SOURCE 200809L
#include <gpushm.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static int cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}


static void report(const char *what, uint64_t *v, int n)
{
    double sum = 0;
    for (int i = 0; i < n; i++) {
        sum += (double)v[i];
    }
    qsort(v, (size_t)n, sizeof *v, cmp);
    printf("COLD %s frames=%d median_ns=%llu mean_ns=%.0f p90_ns=%llu\n", what, n,
           (unsigned long long)v[n / 2], sum / n, (unsigned long long)v[(n * 9) / 10]);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR [FRAMES [EVICT_MIB [SLEEP_US]]]\n", argv[0]);
        return 2;
    }
    int n = argc > 2 ? atoi(argv[2]) : 500;
    int evict_mib = argc > 3 ? atoi(argv[3]) : 16;
    long sleep_us = argc > 4 ? atol(argv[4]) : 1000;
    if (n < 1 || evict_mib < 0 || sleep_us < 0) {
        fprintf(stderr, "FRAMES must be 1 or more, EVICT_MIB and SLEEP_US 0 or more\n");
        return 2;
    }
    size_t evict_bytes = (size_t)evict_mib << 20;
    struct timespec nap = {sleep_us / 1000000, (sleep_us % 1000000) * 1000};
    char path[4096];
    snprintf(path, sizeof path, "%s/cold.sock", argv[1]);
    /* volatile: writes nobody reads are otherwise the compiler's to drop. */
    volatile unsigned char *evict = malloc(evict_bytes + 1);
    uint64_t *cold = calloc((size_t)n, sizeof *cold), *warm = calloc((size_t)n, sizeof *warm);
    if (!evict || !cold || !warm) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    gpushm_publisher_options po;
    gpushm_publisher_options_init(&po);
    po.format = "GRAY8";
    po.width = 64;
    po.height = 64;
    po.fps_n = 60;
    gpushm_publisher *pub = NULL;
    if (gpushm_publisher_open(path, &po, &pub) != GPUSHM_OK) {
        fprintf(stderr, "publisher: %s\n", gpushm_last_error());
        return 1;
    }
    gpushm_subscriber_options so;
    gpushm_subscriber_options_init(&so);
    so.mode = 1;
    gpushm_subscriber *sub = NULL;
    if (gpushm_subscriber_open(path, &so, &sub) != GPUSHM_OK) {
        fprintf(stderr, "subscriber: %s\n", gpushm_last_error());
        return 1;
    }
    for (int pass = 0; pass < 2; pass++) {
        uint64_t *out = pass ? warm : cold;
        /* The first frames set the subscriber up (caps, ring): not counted. */
        for (int i = -10; i < n; i++) {
            gpushm_slot *slot = NULL;
            if (gpushm_publisher_acquire(pub, 1000000000ll, &slot) != GPUSHM_OK ||
                gpushm_publisher_publish(pub, slot, 0) != GPUSHM_OK) {
                fprintf(stderr, "publish: %s\n", gpushm_last_error());
                return 1;
            }
            if (pass == 0) {
                nanosleep(&nap, NULL);
                for (size_t o = 0; o < evict_bytes; o += 64) {
                    evict[o] = (unsigned char)(o + (size_t)i);
                }
            }
            uint64_t t0 = now_ns();
            gpushm_frame *f = NULL;
            gpushm_frame_info info;
            if (gpushm_subscriber_next_frame_info(sub, 1000000000ll, &f, &info) != GPUSHM_OK) {
                fprintf(stderr, "frame: %s\n", gpushm_last_error());
                return 1;
            }
            gpushm_frame_destroy(f);
            uint64_t t1 = now_ns();
            if (i >= 0) {
                out[i] = t1 - t0;
            }
        }
    }
    report("c cold", cold, n);
    report("c warm", warm, n);
    gpushm_subscriber_destroy(sub);
    gpushm_publisher_destroy(pub);
    free((void *)evict);
    free(cold);
    free(warm);
    return 0;
}
