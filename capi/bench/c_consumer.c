/* SPDX-License-Identifier: MPL-2.0 */
/*
 * The C consumer of `bench capi`: a lossless subscriber that takes N frames from a bench
 * producer (which stamps CLOCK_MONOTONIC into each frame's first 8 bytes just before its sink)
 * and prints latency and CPU per frame, in bench's CONSUMER line format:
 *   c_consumer SOCKET FRAMES
 * Built with: cc -O2 c_consumer.c -o c_consumer $(pkg-config --cflags --libs gpushm)
 */
#define _POSIX_C_SOURCE 200809L
#include <gpushm.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static uint64_t cpu_us(void)
{
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return (uint64_t)(r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1000000u +
           (uint64_t)(r.ru_utime.tv_usec + r.ru_stime.tv_usec);
}

/* Minor page faults and context switches (voluntary, involuntary) of this process so far. */
static void faults_and_switches(long out[3])
{
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    out[0] = r.ru_minflt;
    out[1] = r.ru_nvcsw;
    out[2] = r.ru_nivcsw;
}

static int cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s SOCKET FRAMES\n", argv[0]);
        return 2;
    }
    int n = atoi(argv[2]);
    uint64_t *lat = calloc((size_t)n, sizeof *lat);
    gpushm_subscriber_options o;
    gpushm_subscriber_options_init(&o);
    o.mode = 1;
    o.connect_timeout_ns = 30000000000ll;
    gpushm_subscriber *s = NULL;
    if (!lat || gpushm_subscriber_open(argv[1], &o, &s) != GPUSHM_OK) {
        fprintf(stderr, "cannot connect: %s\n", gpushm_last_error());
        return 1;
    }
    uint64_t cpu0 = 0, first = 0, last = 0;
    long fs0[3] = {0, 0, 0}, fs[3];
    int got = 0;
    while (got < n) {
        gpushm_frame *f = NULL;
        gpushm_frame_info info;
        gpushm_status st = gpushm_subscriber_next_frame_info(s, 10000000000ll, &f, &info);
        if (st != GPUSHM_OK) {
            fprintf(stderr, "frame %d: %s\n", got, gpushm_last_error());
            break;
        }
        uint64_t t = now_ns();
        uint64_t stamp = 0;
        if (info.data && info.size >= 8) {
            memcpy(&stamp, info.data, 8);
        }
        gpushm_frame_destroy(f);
        if (got == 0) {
            cpu0 = cpu_us();
            faults_and_switches(fs0);
            first = t;
        }
        last = t;
        lat[got++] = t > stamp ? t - stamp : 0;
    }
    uint64_t cpu = cpu_us() - cpu0;
    faults_and_switches(fs);
    gpushm_subscriber_destroy(s);
    /* The first frames waited for the connection: warm-up, not latency. */
    int skip = got > 20 ? 10 : 0;
    qsort(lat + skip, (size_t)(got - skip), sizeof *lat, cmp);
    int m = got - skip;
    double per = got > 1 ? 1.0 / (got - 1) : 0.0;
    printf("CONSUMER frames=%d fps=%.1f p50_us=%.1f p99_us=%.1f max_us=%.1f cpu_us_per_frame=%.1f "
           "minflt_per_frame=%.2f nvcsw_per_frame=%.2f nivcsw_per_frame=%.2f\n",
           got,
           got > 1 ? (got - 1) * 1e9 / (double)(last - first) : 0.0, m ? lat[skip + m / 2] / 1e3 : 0.0,
           m ? lat[skip + (m * 99) / 100] / 1e3 : 0.0, m ? lat[got - 1] / 1e3 : 0.0,
           got > 1 ? (double)cpu / (got - 1) : 0.0, (fs[0] - fs0[0]) * per, (fs[1] - fs0[1]) * per,
           (fs[2] - fs0[2]) * per);
    free(lat);
    return got == n ? 0 : 1;
}
