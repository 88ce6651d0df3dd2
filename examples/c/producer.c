/* SPDX-License-Identifier: MPL-2.0 */
/*
 * A C producer: publishes a moving gray gradient (GRAY8 320x240, 30 fps) that gpushmsrc, the
 * Python Subscriber or a C consumer reads.
 *   cc producer.c -o producer $(pkg-config --cflags --libs gpushm)
 *   ./producer /tmp/cgray 300 &
 *   gst-launch-1.0 gpushmsrc socket-path=/tmp/cgray ! videoconvert ! autovideosink
 */
#define _POSIX_C_SOURCE 200809L
#include <gpushm.h>

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s SOCKET [FRAMES]\n", argv[0]);
        return 2;
    }
    int frames = argc > 2 ? atoi(argv[2]) : 300;
    gpushm_publisher_options opts;
    gpushm_publisher_options_init(&opts);
    opts.format = "GRAY8";
    opts.width = 320;
    opts.height = 240;
    gpushm_publisher *pub = NULL;
    if (gpushm_publisher_open(argv[1], &opts, &pub) != GPUSHM_OK) {
        fprintf(stderr, "cannot publish: %s\n", gpushm_last_error());
        return 1;
    }
    struct timespec period = {0, 1000000000 / 30};
    for (int n = 0; n < frames; n++) {
        gpushm_slot *slot = NULL;
        /* Consumers may hold every slot for a while: wait up to 1 s for one. */
        if (gpushm_publisher_acquire(pub, 1000000000ll, &slot) != GPUSHM_OK) {
            fprintf(stderr, "no free slot: %s\n", gpushm_last_error());
            continue;
        }
        gpushm_frame_info info;
        gpushm_slot_get_info(slot, &info);
        for (uint32_t y = 0; y < info.planes[0].rows; y++) {
            uint8_t *row = info.planes[0].data + (size_t)y * info.planes[0].stride;
            for (uint32_t x = 0; x < info.planes[0].row_bytes; x++) {
                row[x] = (uint8_t)(x + y + 4 * n);
            }
        }
        if (gpushm_publisher_publish(pub, slot, 0) != GPUSHM_OK) {
            fprintf(stderr, "publish: %s\n", gpushm_last_error());
        }
        nanosleep(&period, NULL);
    }
    gpushm_publisher_send_eos(pub);
    gpushm_publisher_destroy(pub);
    return 0;
}
