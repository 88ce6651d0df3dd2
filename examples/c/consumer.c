/* SPDX-License-Identifier: MPL-2.0 */
/*
 * A C consumer: prints each frame's format, time stamp and per-plane byte sums.
 *   cc consumer.c -o consumer $(pkg-config --cflags --libs gpushm)
 *   gst-launch-1.0 videotestsrc ! video/x-raw,format=NV12 ! gpushmsink socket-path=/tmp/cam &
 *   ./consumer /tmp/cam 100
 */
#include <gpushm.h>

#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s SOCKET [FRAMES]\n", argv[0]);
        return 2;
    }
    int frames = argc > 2 ? atoi(argv[2]) : 100;
    gpushm_subscriber_options opts;
    gpushm_subscriber_options_init(&opts);
    opts.mode = 1; /* lossless: this example wants every frame */
    gpushm_subscriber *sub = NULL;
    if (gpushm_subscriber_open(argv[1], &opts, &sub) != GPUSHM_OK) {
        fprintf(stderr, "cannot connect: %s\n", gpushm_last_error());
        return 1;
    }
    for (int n = 0; n < frames; n++) {
        gpushm_frame *frame = NULL;
        gpushm_status st = gpushm_subscriber_next_frame(sub, 5000000000ll, &frame);
        if (st == GPUSHM_EOS) {
            break;
        }
        if (st != GPUSHM_OK) {
            fprintf(stderr, "no frame: %s\n", gpushm_last_error());
            gpushm_subscriber_destroy(sub);
            return 1;
        }
        gpushm_frame_info info;
        gpushm_frame_get_info(frame, &info);
        printf("frame %llu %s %ux%u pts %llu ns:", (unsigned long long)info.offset, info.format,
               info.width, info.height, (unsigned long long)info.pts);
        for (uint32_t p = 0; p < info.n_planes; p++) {
            unsigned long long sum = 0;
            for (uint32_t r = 0; r < info.planes[p].rows; r++) {
                const uint8_t *row = info.planes[p].data + (size_t)r * info.planes[p].stride;
                for (uint32_t b = 0; b < info.planes[p].row_bytes; b++) {
                    sum += row[b];
                }
            }
            printf(" plane %u: sum %llu", p, sum);
        }
        printf("\n");
        /* The slot goes back to the producer; the handle is freed. */
        gpushm_frame_destroy(frame);
    }
    gpushm_subscriber_destroy(sub);
    return 0;
}
