/* SPDX-License-Identifier: MPL-2.0 */
/*
 * The C API's test program, built from the installed header and pkg-config file as an app
 * would be (capi/tests/run.sh runs its commands against real producer processes):
 *   capi_test produce SOCK N eos|hold   C producer: GRAY8 320x240, frame i's byte (x, y) is
 *                                       (7 i + 3 y + x) & 255; EOS after N frames, or wait
 *   capi_test expect N                  what `produce` publishes, raw, to stdout
 *   capi_test consume SOCK N OUT        N frames (lossless), visible rows of every plane to OUT;
 *                                       every other frame through poll() on the fd; then EOS
 *                                       (CAPI_TEST_SPIN_US: with the low-latency mode, which
 *                                       must catch frames while polling; without: it never does)
 *   capi_test timeout SOCK N            N frames, then a 200 ms wait must time out
 *   capi_test killed SOCK               holds a frame while the producer is killed (-9): its
 *                                       bytes stay the same, then the producer is gone
 *   capi_test misuse SOCK               every misuse is an error code, never a crash
 *   capi_test threads SOCK              a wait ended from another thread: interrupt, destroy
 *   capi_test race SOCK N               N frames (lossless, checked byte for byte), each looked
 *                                       at from another thread while it is destroyed and its
 *                                       object reused: only OK or "gone" answers
 *   capi_test reconnect SOCK            3 frames, then (the producer restarted meanwhile) 3
 *                                       more from the new producer, through reconnect
 *   capi_test cpulat                    gpushm_cpu_latency_request: held and released (device
 *                                       writable, read back), or refused saying why
 *   capi_test cuda SOCK [device]        (GPU machine) a frame's CUDA device pointer: its bytes,
 *                                       copied back with libcuda, equal the host view (host
 *                                       ring); `device`: a device ring's frame, on the GPU
 * Prints "OK ..." on success, "FAIL ..." (and exits 1) otherwise.
 */
#define _POSIX_C_SOURCE 200809L
#include <gpushm.h>

#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define W 320
#define H 240

static int failures = 0;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                    \
            printf(__VA_ARGS__);                                                           \
            printf(" (last error: %s)\n", gpushm_last_error());                            \
            failures++;                                                                    \
        }                                                                                  \
    } while (0)

static uint64_t now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000u + (uint64_t)t.tv_nsec / 1000000u;
}

static uint8_t pattern(uint64_t i, uint32_t x, uint32_t y)
{
    return (uint8_t)((7u * i + 3u * y + x) & 255u);
}

/* FNV-1a over the visible bytes of every plane. */
static uint64_t frame_hash(const gpushm_frame_info *info)
{
    uint64_t h = 1469598103934665603ull;
    for (uint32_t p = 0; p < info->n_planes; p++) {
        for (uint32_t r = 0; r < info->planes[p].rows; r++) {
            const uint8_t *row = info->planes[p].data + (size_t)r * info->planes[p].stride;
            for (uint32_t b = 0; b < info->planes[p].row_bytes; b++) {
                h = (h ^ row[b]) * 1099511628211ull;
            }
        }
    }
    return h;
}

static gpushm_subscriber *open_sub(const char *sock, int mode)
{
    gpushm_subscriber_options o;
    gpushm_subscriber_options_init(&o);
    o.mode = mode;
    o.connect_timeout_ns = 20000000000ll;
    o.name = "capi_test";
    /* CAPI_TEST_SPIN_US: the low-latency mode's budget. */
    const char *spin = getenv("CAPI_TEST_SPIN_US");
    o.spin_us = spin ? (uint32_t)strtoul(spin, NULL, 10) : 0;
    gpushm_subscriber *s = NULL;
    /* "stream:NAME" names a stream instead of a socket path. */
    gpushm_status st = strncmp(sock, "stream:", 7) ? gpushm_subscriber_open(sock, &o, &s)
                                                   : gpushm_subscriber_open_stream(sock + 7, &o, &s);
    CHECK(st == GPUSHM_OK && s, "open %s: %d", sock, st);
    return s;
}

static int produce(const char *sock, int n, int eos)
{
    gpushm_publisher_options o;
    gpushm_publisher_options_init(&o);
    o.format = "GRAY8";
    o.width = W;
    o.height = H;
    o.slots = 4;
    /* 5 fps in the caps (frames go out as fast as they are made, or every CAPI_TEST_WAKE_EARLY_MS):
     * a lossless consumer is then waited for up to 200 ms (the publisher waits at most a
     * frame's time, 40 ms at 30 fps), which a consumer on busy cores may need now and then. */
    o.fps_n = 5;
    o.fps_d = 1;
    /* CAPI_TEST_PUB_SPIN_US: the low-latency mode of the publisher's wait. */
    const char *spin = getenv("CAPI_TEST_PUB_SPIN_US");
    o.spin_us = spin ? (uint32_t)strtoul(spin, NULL, 10) : 0;
    /* CAPI_TEST_WAKE_EARLY_MS: a frame every that many ms, its consumers woken ahead of it
     * (gpushm_publisher_wake_early) as its slot is acquired. */
    const char *early = getenv("CAPI_TEST_WAKE_EARLY_MS");
    long early_ms = early ? strtol(early, NULL, 10) : 0;
    /* CAPI_TEST_WAKE_AHEAD_US: consumers woken that long before each frame is due
     * (gpushm_publisher_set_wake_ahead) instead. */
    const char *ahead = getenv("CAPI_TEST_WAKE_AHEAD_US");
    gpushm_publisher *p = NULL;
    if ((strncmp(sock, "stream:", 7) ? gpushm_publisher_open(sock, &o, &p)
                                     : gpushm_publisher_open_stream(sock + 7, &o, &p)) != GPUSHM_OK) {
        printf("FAIL publisher_open: %s\n", gpushm_last_error());
        return 1;
    }
    CHECK(gpushm_publisher_set_wake_ahead(p, 1001) == GPUSHM_ERROR_INVALID_ARGUMENT,
          "set_wake_ahead(1001): over the most, 1000 µs");
    if (ahead) {
        CHECK(gpushm_publisher_set_wake_ahead(p, (uint32_t)strtoul(ahead, NULL, 10)) == GPUSHM_OK,
              "set_wake_ahead: %s", gpushm_last_error());
    }
    printf("READY\n");
    fflush(stdout);
    uint32_t clients = 0;
    for (uint64_t t0 = now_ms(); clients == 0 && now_ms() - t0 < 20000;) {
        gpushm_publisher_num_clients(p, &clients);
        struct timespec ms5 = {0, 5000000};
        nanosleep(&ms5, NULL);
    }
    CHECK(clients > 0, "no consumer came");
    for (int i = 0; i < n && !failures; i++) {
        if (early_ms > 0) {
            struct timespec gap = {early_ms / 1000, (early_ms % 1000) * 1000000};
            nanosleep(&gap, NULL);
            CHECK(ahead || gpushm_publisher_wake_early(p) == GPUSHM_OK, "wake_early: %s",
                  gpushm_last_error());
        }
        gpushm_slot *slot = NULL;
        gpushm_status st = gpushm_publisher_acquire(p, 5000000000ll, &slot);
        CHECK(st == GPUSHM_OK, "acquire frame %d: %d", i, st);
        if (st != GPUSHM_OK) {
            break;
        }
        gpushm_frame_info info;
        gpushm_slot_get_info(slot, &info);
        CHECK(strcmp(info.format, "GRAY8") == 0 && info.n_planes == 1, "slot %s", info.format);
        for (uint32_t y = 0; y < info.planes[0].rows; y++) {
            uint8_t *row = info.planes[0].data + (size_t)y * info.planes[0].stride;
            for (uint32_t x = 0; x < info.planes[0].row_bytes; x++) {
                row[x] = pattern((uint64_t)i, x, y);
            }
        }
        st = gpushm_publisher_publish(p, slot, 0);
        CHECK(st == GPUSHM_OK, "publish frame %d: %d", i, st);
    }
    uint64_t woken = 0;
    CHECK(gpushm_publisher_woken_early(p, &woken) == GPUSHM_OK, "woken_early");
    CHECK(gpushm_publisher_woken_early(p, NULL) == GPUSHM_ERROR_INVALID_ARGUMENT, "woken_early(NULL)");
    uint64_t woken_ahead = 0;
    CHECK(gpushm_publisher_woken_ahead(p, &woken_ahead) == GPUSHM_OK, "woken_ahead");
    CHECK(gpushm_publisher_woken_ahead(p, NULL) == GPUSHM_ERROR_INVALID_ARGUMENT, "woken_ahead(NULL)");
    printf("DONE woken_early=%llu woken_ahead=%llu\n", (unsigned long long)woken,
           (unsigned long long)woken_ahead);
    fflush(stdout);
    if (eos) {
        gpushm_publisher_send_eos(p);
        /* Consumers read the last frames and the EOS before the socket goes. */
        sleep(1);
    } else {
        for (;;) {
            pause();
        }
    }
    CHECK(gpushm_publisher_destroy(p) == GPUSHM_OK, "publisher_destroy");
    return failures != 0;
}

static int expect(int n)
{
    static uint8_t row[W];
    for (int i = 0; i < n; i++) {
        for (uint32_t y = 0; y < H; y++) {
            for (uint32_t x = 0; x < W; x++) {
                row[x] = pattern((uint64_t)i, x, y);
            }
            fwrite(row, 1, W, stdout);
        }
    }
    return 0;
}

static int consume(const char *sock, int n, const char *out_path)
{
    FILE *out = fopen(out_path, "wb");
    if (!out) {
        printf("FAIL cannot write %s: %s\n", out_path, strerror(errno));
        return 1;
    }
    gpushm_subscriber *s = open_sub(sock, 1);
    int fd = -1;
    CHECK(gpushm_subscriber_fd(s, &fd) == GPUSHM_OK && fd >= 0, "fd");
    uint64_t last_pts = 0;
    int got = 0, idle = 0;
    while (got < n && !failures) {
        gpushm_frame *f = NULL;
        gpushm_status st;
        if (got % 2) {
            /* The event-loop way: wait on the descriptor, then take without waiting. */
            struct pollfd pfd = {.fd = fd, .events = POLLIN};
            int r = poll(&pfd, 1, 10000);
            CHECK(r == 1, "poll: %d", r);
            st = gpushm_subscriber_next_frame(s, 0, &f);
            if (st == GPUSHM_TIMEOUT) {
                /* Readable for news other than a frame: now and then, never for good. */
                CHECK(++idle < 1000, "the fd stays readable with no frame");
                continue;
            }
            idle = 0;
        } else if (got % 4 == 2) {
            /* The frame and its description in one call: the same description; a NULL info is
             * refused before a frame is taken (none is lost: every frame is written below). */
            CHECK(gpushm_subscriber_next_frame_info(s, 10000000000ll, &f, NULL) ==
                      GPUSHM_ERROR_INVALID_ARGUMENT,
                  "next_frame_info with a NULL info");
            gpushm_frame_info given;
            st = gpushm_subscriber_next_frame_info(s, 10000000000ll, &f, &given);
            if (st == GPUSHM_OK) {
                gpushm_frame_info asked;
                CHECK(gpushm_frame_get_info(f, &asked) == GPUSHM_OK, "info");
                CHECK(given.data == asked.data && given.size == asked.size &&
                          given.pts == asked.pts && given.n_planes == asked.n_planes &&
                          given.planes[0].data == asked.planes[0].data &&
                          given.planes[0].stride == asked.planes[0].stride &&
                          strcmp(given.format, asked.format) == 0,
                      "next_frame_info's description differs from get_info's");
            }
        } else {
            st = gpushm_subscriber_next_frame(s, 10000000000ll, &f);
        }
        CHECK(st == GPUSHM_OK, "frame %d: status %d", got, st);
        if (st != GPUSHM_OK) {
            break;
        }
        gpushm_frame_info info;
        CHECK(gpushm_frame_get_info(f, &info) == GPUSHM_OK, "info");
        CHECK(info.width == W && info.height == H, "%ux%u", info.width, info.height);
        CHECK(info.n_planes >= 1 && info.data != NULL && info.on_device == 0, "planes");
        CHECK(got == 0 || info.pts == GPUSHM_TIME_NONE || info.pts > last_pts, "pts goes back");
        last_pts = info.pts;
        const char *caps = NULL;
        CHECK(gpushm_frame_get_caps(f, &caps) == GPUSHM_OK && strncmp(caps, "video/x-raw", 11) == 0,
              "caps");
        for (uint32_t p = 0; p < info.n_planes; p++) {
            for (uint32_t r = 0; r < info.planes[p].rows; r++) {
                fwrite(info.planes[p].data + (size_t)r * info.planes[p].stride, 1,
                       info.planes[p].row_bytes, out);
            }
        }
        CHECK(gpushm_frame_release(f) == GPUSHM_OK, "release");
        CHECK(gpushm_frame_destroy(f) == GPUSHM_OK, "destroy");
        got++;
    }
    fclose(out);
    /* The low-latency mode engages: with spin_us, frames are caught while polling (a poll at
     * most once a frame); without it, never. */
    uint64_t caught = 0, missed = 0;
    CHECK(gpushm_subscriber_spin_stats(s, &caught, NULL) == GPUSHM_ERROR_INVALID_ARGUMENT,
          "spin_stats with a NULL missed");
    CHECK(gpushm_subscriber_spin_stats(s, &caught, &missed) == GPUSHM_OK, "spin_stats");
    if (getenv("CAPI_TEST_SPIN_US")) {
        CHECK(caught >= 1 && caught + missed <= (uint64_t)n + 1,
              "spin_us: %llu caught, %llu missed of %d frames", (unsigned long long)caught,
              (unsigned long long)missed, n);
        printf("spin_us: %llu of %d frames caught polling, %llu polls missed\n",
               (unsigned long long)caught, n, (unsigned long long)missed);
    } else {
        CHECK(caught == 0 && missed == 0, "no spin_us, yet %llu caught, %llu missed",
              (unsigned long long)caught, (unsigned long long)missed);
    }
    gpushm_frame *f = NULL;
    gpushm_status st = gpushm_subscriber_next_frame(s, 10000000000ll, &f);
    CHECK(st == GPUSHM_EOS, "after %d frames: %d, not EOS", n, st);
    CHECK(gpushm_subscriber_destroy(s) == GPUSHM_OK, "subscriber_destroy");
    if (!failures) {
        printf("OK consume %d frames\n", got);
    }
    return failures != 0;
}

static int timeout_test(const char *sock, int n)
{
    gpushm_subscriber *s = open_sub(sock, 1);
    for (int i = 0; i < n; i++) {
        gpushm_frame *f = NULL;
        CHECK(gpushm_subscriber_next_frame(s, 10000000000ll, &f) == GPUSHM_OK, "frame %d", i);
        gpushm_frame_destroy(f);
    }
    gpushm_frame *f = NULL;
    uint64_t t0 = now_ms();
    gpushm_status st = gpushm_subscriber_next_frame(s, 200000000ll, &f);
    uint64_t dt = now_ms() - t0;
    CHECK(st == GPUSHM_TIMEOUT, "status %d, not GPUSHM_TIMEOUT", st);
    CHECK(dt >= 150 && dt < 3000, "the 200 ms wait took %llu ms", (unsigned long long)dt);
    CHECK(strlen(gpushm_last_error()) > 0, "a timeout says why");
    /* A zero timeout only looks. */
    t0 = now_ms();
    st = gpushm_subscriber_next_frame(s, 0, &f);
    CHECK(st == GPUSHM_TIMEOUT && now_ms() - t0 < 1000, "zero timeout: %d", st);
    /* Interrupted from "another thread" (here: before the wait). */
    CHECK(gpushm_subscriber_interrupt(s) == GPUSHM_OK, "interrupt");
    st = gpushm_subscriber_next_frame(s, -1, &f);
    CHECK(st == GPUSHM_INTERRUPTED, "after interrupt: %d", st);
    gpushm_subscriber_destroy(s);
    if (!failures) {
        printf("OK timeout after %llu ms\n", (unsigned long long)dt);
    }
    return failures != 0;
}

static int killed(const char *sock)
{
    gpushm_subscriber *s = open_sub(sock, 1);
    gpushm_frame *f = NULL;
    CHECK(gpushm_subscriber_next_frame(s, 10000000000ll, &f) == GPUSHM_OK, "a frame");
    gpushm_frame_info info;
    CHECK(gpushm_frame_get_info(f, &info) == GPUSHM_OK, "info");
    uint64_t before = frame_hash(&info);
    printf("HOLDING\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) { /* the producer is killed meanwhile */
        printf("FAIL no go-ahead on stdin\n");
        return 1;
    }
    /* The producer is gone: the frame held is intact and still ours. */
    CHECK(frame_hash(&info) == before, "the held frame changed after the producer died");
    gpushm_frame *g = NULL;
    gpushm_status st;
    do {
        st = gpushm_subscriber_next_frame(s, 5000000000ll, &g);
        if (st == GPUSHM_OK) {
            gpushm_frame_destroy(g);
        }
    } while (st == GPUSHM_OK);
    CHECK(st == GPUSHM_ERROR_DISCONNECTED, "after the producer died: %d", st);
    /* Still valid after the subscriber is gone, until released. */
    CHECK(gpushm_subscriber_destroy(s) == GPUSHM_OK, "destroy");
    CHECK(frame_hash(&info) == before, "the held frame changed after the subscriber went");
    CHECK(gpushm_frame_release(f) == GPUSHM_OK, "release");
    CHECK(gpushm_frame_destroy(f) == GPUSHM_OK, "destroy frame");
    if (!failures) {
        printf("OK killed: held frame intact, then disconnected\n");
    }
    return failures != 0;
}

static int misuse(const char *sock)
{
    char nobody[512], other[512];
    snprintf(nobody, sizeof nobody, "%s.nobody", sock);
    snprintf(other, sizeof other, "%s.pub", sock);
    gpushm_frame_info info;
    gpushm_frame *f = NULL;
    gpushm_subscriber *s = NULL;
    /* NULLs. */
    CHECK(gpushm_subscriber_open(NULL, NULL, &s) == GPUSHM_ERROR_INVALID_ARGUMENT, "NULL path");
    CHECK(gpushm_subscriber_open_stream("a/b", NULL, &s) == GPUSHM_ERROR_INVALID_ARGUMENT &&
              strstr(gpushm_last_error(), "stream name"),
          "a stream name with a slash: %s", gpushm_last_error());
    CHECK(gpushm_subscriber_open_stream(NULL, NULL, &s) == GPUSHM_ERROR_INVALID_ARGUMENT, "NULL name");
    CHECK(gpushm_subscriber_open(sock, NULL, NULL) == GPUSHM_ERROR_INVALID_ARGUMENT, "NULL out");
    CHECK(gpushm_subscriber_options_init(NULL) == GPUSHM_ERROR_INVALID_ARGUMENT, "NULL opts");
    CHECK(gpushm_subscriber_next_frame(NULL, 0, &f) == GPUSHM_ERROR_BAD_HANDLE, "NULL sub");
    CHECK(gpushm_subscriber_next_frame_info(NULL, 0, &f, &info) == GPUSHM_ERROR_BAD_HANDLE,
          "NULL sub (next_frame_info)");
    CHECK(gpushm_subscriber_next_frame_info(NULL, 0, NULL, &info) == GPUSHM_ERROR_INVALID_ARGUMENT,
          "NULL frame (next_frame_info)");
    CHECK(gpushm_frame_get_info(NULL, &info) == GPUSHM_ERROR_BAD_HANDLE, "NULL frame");
    CHECK(gpushm_frame_release(NULL) == GPUSHM_ERROR_BAD_HANDLE, "release NULL");
    CHECK(gpushm_frame_destroy(NULL) == GPUSHM_ERROR_BAD_HANDLE, "destroy NULL");
    CHECK(gpushm_subscriber_destroy(NULL) == GPUSHM_ERROR_BAD_HANDLE, "destroy NULL sub");
    uint64_t caught = 0, missed = 0;
    CHECK(gpushm_subscriber_spin_stats(NULL, &caught, &missed) == GPUSHM_ERROR_BAD_HANDLE,
          "spin_stats of NULL");
    CHECK(strlen(gpushm_last_error()) > 0, "an error says why");
    /* A handle that never was one (a pointer to our own memory). */
    CHECK(gpushm_frame_get_info((gpushm_frame *)&info, &info) == GPUSHM_ERROR_BAD_HANDLE, "forged");
    /* Bad options. */
    gpushm_subscriber_options o;
    gpushm_subscriber_options_init(&o);
    o.mode = 7;
    CHECK(gpushm_subscriber_open(sock, &o, &s) == GPUSHM_ERROR_INVALID_ARGUMENT, "mode 7");
    gpushm_subscriber_options_init(&o);
    o.spin_us = 100001;
    CHECK(gpushm_subscriber_open(sock, &o, &s) == GPUSHM_ERROR_INVALID_ARGUMENT, "spin_us 100001");
    CHECK(strstr(gpushm_last_error(), "spin_us") != NULL, "the error names spin_us");
    o.spin_us = 0;
    gpushm_publisher_options po;
    gpushm_publisher_options_init(&po);
    gpushm_publisher *p = NULL;
    CHECK(gpushm_publisher_open(other, &po, &p) == GPUSHM_ERROR_INVALID_ARGUMENT,
          "publisher without a format");
    po.format = "NOPE";
    po.width = 16;
    po.height = 16;
    CHECK(gpushm_publisher_open(other, &po, &p) == GPUSHM_ERROR_INVALID_ARGUMENT, "unknown format");
    po.format = "GRAY8";
    po.spin_us = 100001;
    CHECK(gpushm_publisher_open(other, &po, &p) == GPUSHM_ERROR_INVALID_ARGUMENT,
          "publisher spin_us 100001");
    CHECK(strstr(gpushm_last_error(), "spin_us") != NULL, "the publisher's error names spin_us");
    CHECK(access(other, F_OK) != 0, "a refused publisher leaves no socket");
    po.spin_us = 0;
    /* Slots: discarded once, published only by their publisher. */
    po.format = "GRAY8";
    gpushm_publisher *p2 = NULL;
    char other2[520];
    snprintf(other2, sizeof other2, "%s2", other);
    CHECK(gpushm_publisher_open(other, &po, &p) == GPUSHM_OK, "publisher");
    CHECK(gpushm_publisher_open(other2, &po, &p2) == GPUSHM_OK, "second publisher");
    gpushm_slot *slot = NULL;
    CHECK(gpushm_publisher_acquire(p, 1000000000ll, &slot) == GPUSHM_OK, "acquire");
    CHECK(gpushm_slot_discard(slot) == GPUSHM_OK, "discard");
    CHECK(gpushm_slot_discard(slot) == GPUSHM_ERROR_BAD_HANDLE, "double discard");
    CHECK(gpushm_publisher_publish(p, slot, 0) == GPUSHM_ERROR_BAD_HANDLE, "publish a discarded slot");
    CHECK(gpushm_publisher_acquire(p, 1000000000ll, &slot) == GPUSHM_OK, "acquire again");
    CHECK(gpushm_publisher_publish(p2, slot, 0) == GPUSHM_ERROR_INVALID_ARGUMENT, "another's slot");
    CHECK(gpushm_slot_get_info(slot, &info) == GPUSHM_ERROR_BAD_HANDLE, "the slot is gone after publish");
    CHECK(gpushm_publisher_publish((gpushm_publisher *)slot, slot, 0) == GPUSHM_ERROR_BAD_HANDLE,
          "a slot as publisher");
    CHECK(gpushm_publisher_destroy(p2) == GPUSHM_OK && gpushm_publisher_destroy(p) == GPUSHM_OK,
          "publisher_destroy");
    CHECK(gpushm_publisher_destroy(p) == GPUSHM_ERROR_BAD_HANDLE, "double publisher_destroy");
    /* No producer: a timeout, quickly. */
    o.mode = 0;
    o.connect_timeout_ns = 100000000ll;
    CHECK(gpushm_subscriber_open(nobody, &o, &s) == GPUSHM_TIMEOUT, "no producer");

    s = open_sub(sock, 1);
    CHECK(gpushm_subscriber_next_frame(s, 10000000000ll, NULL) == GPUSHM_ERROR_INVALID_ARGUMENT,
          "NULL frame out");
    CHECK(gpushm_subscriber_next_frame(s, 10000000000ll, &f) == GPUSHM_OK, "a frame");
    /* A frame handle is not a subscriber. */
    CHECK(gpushm_subscriber_next_frame((gpushm_subscriber *)f, 0, &f) == GPUSHM_ERROR_BAD_HANDLE,
          "frame as subscriber");
    CHECK(gpushm_frame_get_info(f, NULL) == GPUSHM_ERROR_INVALID_ARGUMENT, "NULL info");
    CHECK(gpushm_frame_release(f) == GPUSHM_OK, "release");
    CHECK(gpushm_frame_release(f) == GPUSHM_ERROR_RELEASED, "double release");
    CHECK(gpushm_frame_get_info(f, &info) == GPUSHM_ERROR_RELEASED, "info after release");
    uint64_t dp = 0;
    CHECK(gpushm_frame_cuda_ptr(f, -1, &dp) == GPUSHM_ERROR_RELEASED, "cuda_ptr after release");
    CHECK(gpushm_frame_destroy(f) == GPUSHM_OK, "destroy");
    CHECK(gpushm_frame_destroy(f) == GPUSHM_ERROR_BAD_HANDLE, "double destroy");
    CHECK(gpushm_frame_get_info(f, &info) == GPUSHM_ERROR_BAD_HANDLE, "info after destroy");
    /* A stale handle does not reach the frame that took its place. */
    gpushm_frame *g = NULL;
    CHECK(gpushm_subscriber_next_frame(s, 10000000000ll, &g) == GPUSHM_OK, "another frame");
    CHECK(g != f, "a new frame has a new handle");
    CHECK(gpushm_frame_get_info(f, &info) == GPUSHM_ERROR_BAD_HANDLE, "stale handle");
    CHECK(gpushm_frame_get_info(g, &info) == GPUSHM_OK, "new handle");
    char caps[8];
    size_t needed = 0;
    CHECK(gpushm_subscriber_caps(s, caps, sizeof caps, &needed) == GPUSHM_OK && needed > sizeof caps &&
              strlen(caps) == sizeof caps - 1,
          "caps truncated: needed %zu", needed);
    uint64_t before = frame_hash(&info);
    CHECK(gpushm_subscriber_destroy(s) == GPUSHM_OK, "destroy sub");
    CHECK(gpushm_subscriber_destroy(s) == GPUSHM_ERROR_BAD_HANDLE, "double destroy sub");
    /* The live producer goes on through the ring (30 fps) meanwhile: the held slot is not
     * reused. */
    struct timespec wait = {0, 400000000};
    nanosleep(&wait, NULL);
    int valid = 0;
    CHECK(gpushm_frame_is_valid(g, &valid) == GPUSHM_OK && valid == 1, "valid");
    CHECK(gpushm_frame_get_info(g, &info) == GPUSHM_OK && frame_hash(&info) == before,
          "a frame outlives its subscriber, unchanged");
    CHECK(gpushm_frame_destroy(g) == GPUSHM_OK, "destroy without release");
    if (!failures) {
        printf("OK misuse\n");
    }
    return failures != 0;
}

struct later {
    gpushm_subscriber *s;
    int destroy;
};

static void *act_later(void *arg)
{
    struct later *l = arg;
    struct timespec t = {0, 300000000};
    nanosleep(&t, NULL);
    if (l->destroy) {
        gpushm_subscriber_destroy(l->s);
    } else {
        gpushm_subscriber_interrupt(l->s);
    }
    return NULL;
}

/* Waits without a timeout while another thread interrupts, then destroys: both waits end. */
static int threads(const char *sock)
{
    for (int destroy = 0; destroy < 2; destroy++) {
        gpushm_subscriber *s = open_sub(sock, 1);
        gpushm_frame *f = NULL;
        /* Whatever the producer published before: take it. */
        while (gpushm_subscriber_next_frame(s, 0, &f) == GPUSHM_OK) {
            gpushm_frame_destroy(f);
        }
        struct later l = {s, destroy};
        pthread_t t;
        pthread_create(&t, NULL, act_later, &l);
        uint64_t t0 = now_ms();
        gpushm_status st = gpushm_subscriber_next_frame(s, -1, &f);
        uint64_t dt = now_ms() - t0;
        pthread_join(t, NULL);
        CHECK(st == GPUSHM_INTERRUPTED, "%s: status %d", destroy ? "destroy" : "interrupt", st);
        CHECK(dt >= 200 && dt < 5000, "%s after %llu ms", destroy ? "destroy" : "interrupt",
              (unsigned long long)dt);
        if (destroy) {
            CHECK(gpushm_subscriber_next_frame(s, 0, &f) == GPUSHM_ERROR_BAD_HANDLE, "destroyed");
        } else {
            /* The interrupt is taken: the next wait waits again. */
            t0 = now_ms();
            st = gpushm_subscriber_next_frame(s, 300000000ll, &f);
            CHECK(st == GPUSHM_TIMEOUT && now_ms() - t0 >= 250, "after an interrupt: %d", st);
            gpushm_subscriber_destroy(s);
        }
    }
    if (!failures) {
        printf("OK threads\n");
    }
    return failures != 0;
}

/* The frame one thread takes, looked at by another while it is destroyed and its object is
 * reused for the next frame: every call on it answers OK or that it is gone, never anything
 * else, an OK answer describes that handle's own frame (its offset is the producer's frame
 * number), never the next one reusing the object; and nothing touches freed memory (this
 * runs under AddressSanitizer too). `seq` is odd while `cur` and `index` change. */
struct peek {
    atomic_uint seq;
    _Atomic(uintptr_t) cur;
    atomic_long index;
    atomic_int stop;
    long ok, gone, bad;
};

static void *peeker(void *arg)
{
    struct peek *p = arg;
    while (!atomic_load(&p->stop)) {
        unsigned s1 = atomic_load(&p->seq);
        gpushm_frame *f = (gpushm_frame *)atomic_load(&p->cur);
        long index = atomic_load(&p->index);
        if ((s1 & 1) || atomic_load(&p->seq) != s1 || !f) {
            continue;
        }
        gpushm_frame_info info;
        const char *caps = NULL;
        int valid = 0;
        gpushm_status st[3] = {gpushm_frame_get_info(f, &info), gpushm_frame_get_caps(f, &caps),
                               gpushm_frame_is_valid(f, &valid)};
        for (int i = 0; i < 3; i++) {
            if (st[i] == GPUSHM_OK) {
                p->ok++;
            } else if (st[i] == GPUSHM_ERROR_BAD_HANDLE || st[i] == GPUSHM_ERROR_RELEASED) {
                p->gone++;
            } else {
                p->bad++;
            }
        }
        if (st[0] == GPUSHM_OK &&
            (strcmp(info.format, "GRAY8") || info.width != W || info.offset != (uint64_t)index)) {
            p->bad++;
        }
        if (st[1] == GPUSHM_OK && (!caps || strncmp(caps, "video/x-raw", 11))) {
            p->bad++;
        }
    }
    return NULL;
}

static int race(const char *sock, int n)
{
    gpushm_subscriber *s = open_sub(sock, 1);
    struct peek p = {0};
    pthread_t t;
    pthread_create(&t, NULL, peeker, &p);
    int got = 0;
    for (; got < n && !failures; got++) {
        gpushm_frame *f = NULL;
        gpushm_frame_info info;
        gpushm_status st = gpushm_subscriber_next_frame_info(s, 5000000000ll, &f, &info);
        CHECK(st == GPUSHM_OK, "frame %d: %d %s", got, st, gpushm_last_error());
        if (st != GPUSHM_OK) {
            break;
        }
        /* Byte for byte the producer's frame number `got` (lossless, in order). */
        int same = 1;
        for (uint32_t y = 0; y < info.planes[0].rows && same; y++) {
            const uint8_t *row = info.planes[0].data + (size_t)y * info.planes[0].stride;
            for (uint32_t x = 0; x < info.planes[0].row_bytes; x++) {
                same &= row[x] == pattern((uint64_t)got, x, y);
            }
        }
        CHECK(same && info.offset == (uint64_t)got, "frame %d: not the producer's frame", got);
        atomic_fetch_add(&p.seq, 1);
        atomic_store(&p.cur, (uintptr_t)f);
        atomic_store(&p.index, (long)got);
        atomic_fetch_add(&p.seq, 1);
        for (volatile int spin = 0; spin < 2000; spin++) {
        }
        CHECK(gpushm_frame_destroy(f) == GPUSHM_OK, "destroy %d", got);
    }
    atomic_store(&p.stop, 1);
    pthread_join(t, NULL);
    gpushm_subscriber_destroy(s);
    CHECK(p.bad == 0, "%ld unexpected answers", p.bad);
    CHECK(p.ok > 0, "the other thread never saw a frame");
    if (!failures) {
        printf("OK race: %d frames, the other thread's calls: %ld answered, %ld gone\n", got, p.ok,
               p.gone);
    }
    return failures != 0;
}

static int reconnect(const char *sock)
{
    gpushm_subscriber_options o;
    gpushm_subscriber_options_init(&o);
    o.mode = 1;
    o.reconnect = 1;
    o.connect_timeout_ns = 20000000000ll;
    gpushm_subscriber *s = NULL;
    CHECK(gpushm_subscriber_open(sock, &o, &s) == GPUSHM_OK, "open");
    for (int round = 0; round < 2 && !failures; round++) {
        for (int i = 0; i < 3; i++) {
            gpushm_frame *f = NULL;
            gpushm_status st = gpushm_subscriber_next_frame(s, 20000000000ll, &f);
            CHECK(st == GPUSHM_OK, "round %d frame %d: %d", round, i, st);
            if (st != GPUSHM_OK) {
                break;
            }
            gpushm_frame_info info;
            gpushm_frame_get_info(f, &info);
            /* The C producer's frame i: byte (0, 0) is 7 i. */
            CHECK(info.planes[0].data[0] == (uint8_t)(7 * i), "round %d frame %d: %u", round, i,
                  info.planes[0].data[0]);
            gpushm_frame_destroy(f);
        }
        if (round == 0) {
            printf("GOT3\n");
            fflush(stdout);
        }
    }
    gpushm_subscriber_destroy(s);
    if (!failures) {
        printf("OK reconnect\n");
    }
    return failures != 0;
}

/* libcuda, loaded at run time (the test machine without a GPU never gets here). */
typedef int (*cu_init_t)(unsigned);
typedef int (*cu_dtoh_t)(void *, uint64_t, size_t);

static int cuda(const char *sock, int device_ring)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        printf("FAIL no libcuda: %s\n", dlerror());
        return 1;
    }
    cu_init_t cu_init = NULL;
    cu_dtoh_t dtoh = NULL;
    /* POSIX's way from dlsym to a function pointer (ISO C has none). */
    *(void **)(&cu_init) = dlsym(lib, "cuInit");
    *(void **)(&dtoh) = dlsym(lib, "cuMemcpyDtoH_v2");
    CHECK(cu_init && dtoh && cu_init(0) == 0, "cuInit");
    gpushm_subscriber_options o;
    gpushm_subscriber_options_init(&o);
    o.mode = 1;
    o.device_memory = device_ring;
    o.connect_timeout_ns = 20000000000ll;
    gpushm_subscriber *s = NULL;
    CHECK(gpushm_subscriber_open(sock, &o, &s) == GPUSHM_OK, "open");
    for (int i = 0; i < 5 && !failures; i++) {
        gpushm_frame *f = NULL;
        CHECK(gpushm_subscriber_next_frame(s, 20000000000ll, &f) == GPUSHM_OK, "frame %d", i);
        gpushm_frame_info info;
        CHECK(gpushm_frame_get_info(f, &info) == GPUSHM_OK, "info");
        CHECK(info.on_device == device_ring, "on_device %d", info.on_device);
        uint64_t dp = 0;
        gpushm_status st = gpushm_frame_cuda_ptr(f, -1, &dp);
        CHECK(st == GPUSHM_OK && dp != 0, "cuda_ptr: %d", st);
        /* A CUDA context on the device for the copy: the library made the primary one
         * current on this thread. */
        uint8_t *back = malloc(info.size);
        int r = dtoh(back, dp, info.size);
        CHECK(r == 0, "cuMemcpyDtoH: %d", r);
        if (!device_ring && r == 0) {
            CHECK(memcmp(back, info.data, info.size) == 0, "frame %d differs on the GPU", i);
        }
        if (device_ring && r == 0) {
            /* The tool's device ring frames hold a pattern: at least not all zero. */
            size_t nz = 0;
            for (uint64_t b = 0; b < info.size; b++) {
                nz += back[b] != 0;
            }
            CHECK(nz > 0, "frame %d is all zero on the GPU", i);
        }
        free(back);
        gpushm_frame_destroy(f);
    }
    gpushm_subscriber_destroy(s);
    if (!failures) {
        printf("OK cuda %s\n", device_ring ? "device ring" : "host ring");
    }
    return failures != 0;
}

/* gpushm_cpu_latency_request/release/current: misuse answered with codes; where the device is
 * writable (root, or a udev rule) the request holds (read back) until released; where it is
 * not, it is refused saying what access it needs; where there is none, saying so. */
static int cpulat(void)
{
    gpushm_cpu_latency *r = NULL;
    uint32_t before = 0, held = 0, after = 0;
    CHECK(gpushm_cpu_latency_request(1000001, &r) == GPUSHM_ERROR_INVALID_ARGUMENT &&
              strstr(gpushm_last_error(), "largest"),
          "over the largest: %s", gpushm_last_error());
    CHECK(gpushm_cpu_latency_request(0, NULL) == GPUSHM_ERROR_INVALID_ARGUMENT, "NULL out");
    CHECK(gpushm_cpu_latency_current(NULL) == GPUSHM_ERROR_INVALID_ARGUMENT, "NULL us");
    CHECK(gpushm_cpu_latency_release(NULL) == GPUSHM_ERROR_BAD_HANDLE, "release NULL");
    const char *how;
    if (access("/dev/cpu_dma_latency", F_OK) != 0) {
        how = "no device";
        CHECK(gpushm_cpu_latency_request(0, &r) == GPUSHM_ERROR_SYSTEM &&
                  strstr(gpushm_last_error(), "no CPU latency QoS device"),
              "no device, saying so: %s", gpushm_last_error());
    } else if (access("/dev/cpu_dma_latency", W_OK) == 0) {
        how = "held";
        CHECK(gpushm_cpu_latency_current(&before) == GPUSHM_OK, "current: %s", gpushm_last_error());
        CHECK(before > 29, "another process holds the CPU latency at %u µs", before);
        CHECK(gpushm_cpu_latency_request(29, &r) == GPUSHM_OK, "request 29: %s", gpushm_last_error());
        CHECK(gpushm_cpu_latency_current(&held) == GPUSHM_OK && held == 29, "held: %u (before %u)",
              held, before);
        CHECK(gpushm_cpu_latency_release(r) == GPUSHM_OK, "release");
        CHECK(gpushm_cpu_latency_current(&after) == GPUSHM_OK && after == before,
              "after release: %u (before %u)", after, before);
        CHECK(gpushm_cpu_latency_release(r) == GPUSHM_ERROR_BAD_HANDLE, "released twice");
    } else {
        how = "refused";
        CHECK(gpushm_cpu_latency_request(0, &r) == GPUSHM_ERROR_SYSTEM &&
                  strstr(gpushm_last_error(), "/dev/cpu_dma_latency") &&
                  strstr(gpushm_last_error(), "udev rule"),
              "refused without access, saying what it needs: %s", gpushm_last_error());
    }
    if (!failures) {
        printf("OK cpulat (%s)\n", how);
    }
    return failures != 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 5 && !strcmp(argv[1], "produce")) {
        return produce(argv[2], atoi(argv[3]), !strcmp(argv[4], "eos"));
    }
    if (argc >= 3 && !strcmp(argv[1], "expect")) {
        return expect(atoi(argv[2]));
    }
    if (argc >= 5 && !strcmp(argv[1], "consume")) {
        return consume(argv[2], atoi(argv[3]), argv[4]);
    }
    if (argc >= 4 && !strcmp(argv[1], "timeout")) {
        return timeout_test(argv[2], atoi(argv[3]));
    }
    if (argc >= 3 && !strcmp(argv[1], "killed")) {
        return killed(argv[2]);
    }
    if (argc >= 3 && !strcmp(argv[1], "misuse")) {
        return misuse(argv[2]);
    }
    if (argc >= 4 && !strcmp(argv[1], "race")) {
        return race(argv[2], atoi(argv[3]));
    }
    if (argc >= 3 && !strcmp(argv[1], "threads")) {
        return threads(argv[2]);
    }
    if (argc >= 3 && !strcmp(argv[1], "cuda")) {
        return cuda(argv[2], argc >= 4 && !strcmp(argv[3], "device"));
    }
    if (argc >= 3 && !strcmp(argv[1], "reconnect")) {
        return reconnect(argv[2]);
    }
    if (argc >= 2 && !strcmp(argv[1], "cpulat")) {
        return cpulat();
    }
    fprintf(stderr, "usage: see the comment at the top of capi_test.c (gpushm %s)\n", gpushm_version());
    return 2;
}
