// SPDX-License-Identifier: MPL-2.0
// A C++ consumer: wraps a frame as a cv::Mat without copying it (the Mat points into the
// ring, with the frame's stride) and writes it as a PNG. BGRx/BGRA/RGBA/RGBx (4 bytes a
// pixel) and GRAY8 frames.
//   c++ -std=c++17 opencv_consumer.cpp -o opencv_consumer $(pkg-config --cflags --libs gpushm)
//       -I/usr/include/opencv4 -lopencv_imgcodecs -lopencv_core   (one command line)
//   gst-launch-1.0 videotestsrc ! video/x-raw,format=BGRx ! gpushmsink socket-path=/tmp/cam &
//   ./opencv_consumer /tmp/cam frame.png
#include <gpushm.h>

#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

// Destroys (and so releases) a frame when it goes out of scope.
struct FrameDeleter {
    void operator()(gpushm_frame *f) const { gpushm_frame_destroy(f); }
};
using FramePtr = std::unique_ptr<gpushm_frame, FrameDeleter>;

int main(int argc, char **argv)
{
    if (argc < 3) {
        std::fprintf(stderr, "usage: %s SOCKET OUT.png\n", argv[0]);
        return 2;
    }
    gpushm_subscriber *sub = nullptr;
    if (gpushm_subscriber_open(argv[1], nullptr, &sub) != GPUSHM_OK) {
        std::fprintf(stderr, "cannot connect: %s\n", gpushm_last_error());
        return 1;
    }
    gpushm_frame *raw = nullptr;
    if (gpushm_subscriber_next_frame(sub, 5000000000ll, &raw) != GPUSHM_OK) {
        std::fprintf(stderr, "no frame: %s\n", gpushm_last_error());
        gpushm_subscriber_destroy(sub);
        return 1;
    }
    FramePtr frame(raw);
    gpushm_frame_info info;
    gpushm_frame_get_info(frame.get(), &info);
    const std::string format = info.format;
    int type = -1;
    if (format == "BGRx" || format == "BGRA" || format == "RGBA" || format == "RGBx") {
        type = CV_8UC4;
    } else if (format == "GRAY8") {
        type = CV_8UC1;
    }
    if (type < 0 || info.data == nullptr) {
        std::fprintf(stderr, "%s frames are not wrapped by this example\n", info.format);
        gpushm_subscriber_destroy(sub);
        return 1;
    }
    // No copy: the Mat's data is the frame in the ring, valid until the frame is released.
    cv::Mat mat(static_cast<int>(info.height), static_cast<int>(info.width), type,
                info.planes[0].data, info.planes[0].stride);
    cv::Mat out = mat;
    if (type == CV_8UC4) {
        // imwrite takes BGR: drop the fourth byte (this is the one copy, for the file).
        out.create(mat.rows, mat.cols, CV_8UC3);
        const bool rgb = format.rfind("RGB", 0) == 0;
        const int from_to[] = {0, rgb ? 2 : 0, 1, 1, 2, rgb ? 0 : 2};
        cv::mixChannels(&mat, 1, &out, 1, from_to, 3);
    }
    if (!cv::imwrite(argv[2], out)) {
        std::fprintf(stderr, "cannot write %s\n", argv[2]);
        gpushm_subscriber_destroy(sub);
        return 1;
    }
    // Read back: the PNG holds the frame's pixels.
    cv::Mat back = cv::imread(argv[2], cv::IMREAD_UNCHANGED);
    const bool same = back.size == out.size && back.type() == out.type() &&
                      cv::countNonZero(back.reshape(1) != out.reshape(1)) == 0;
    std::printf("wrote %s: %dx%d %s, %s\n", argv[2], mat.cols, mat.rows, info.format,
                same ? "read back equal" : "READ BACK DIFFERS");
    frame.reset();
    gpushm_subscriber_destroy(sub);
    return same ? 0 : 1;
}
