# SPDX-License-Identifier: MPL-2.0
"""Every raw format reaches a Python subscriber: viewed with the shape and element type its
producer's geometry gives, and bytes equal to what the producer sent (checksumsink)."""

import hashlib

import numpy as np
import pytest

import gpushm
from conftest import checksums, wait_for

# (format, width, height, numpy() shape as a function of (h, w), numpy() dtype,
#  [(plane rows, plane elements a row, dtype)]).
# Ids: the format, and the size where a format comes twice.
CASES = [
    ("BGRx", 33, 17, lambda h, w: (h, w, 4), np.uint8, None),
    ("RGBx", 64, 48, lambda h, w: (h, w, 4), np.uint8, None),
    ("BGRA", 31, 9, lambda h, w: (h, w, 4), np.uint8, None),
    ("ARGB", 16, 16, lambda h, w: (h, w, 4), np.uint8, None),
    ("RGB", 33, 17, lambda h, w: (h, w, 3), np.uint8, None),
    ("BGR", 10, 7, lambda h, w: (h, w, 3), np.uint8, None),
    ("GRAY8", 33, 17, lambda h, w: (h, w), np.uint8, None),
    ("GRAY16_LE", 33, 17, lambda h, w: (h, w), np.dtype("<u2"), None),
    ("YUY2", 34, 17, lambda h, w: (h, w, 2), np.uint8, None),
    ("UYVY", 64, 48, lambda h, w: (h, w, 2), np.uint8, None),
    ("YUY2", 33, 9, lambda h, w: (h, w, 2), np.uint8, None),
    ("P010_10LE", 33, 17, None, None,
     [(17, 33, np.dtype("<u2")), (9, 34, np.dtype("<u2"))]),
    ("I420_10LE", 34, 18, None, None,
     [(18, 34, np.dtype("<u2")), (9, 17, np.dtype("<u2")), (9, 17, np.dtype("<u2"))]),
    ("NV12", 33, 17, None, None, [(17, 33, np.uint8), (9, 34, np.uint8)]),
]


@pytest.mark.parametrize("fmt,w,h,shape,dtype,planes", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in CASES])
def test_every_raw_format_is_viewed_with_its_shape_and_bytes(launch, sock, fmt, w, h, shape, dtype, planes):
    n = 5
    p = launch(
        f"videotestsrc num-buffers={n} pattern=smpte ! video/x-raw,format={fmt},width={w},height={h},framerate=30/1 "
        f"! tee name=t ! queue ! gpushmsink socket-path={sock} wait-for-connection=true sync=false "
        f"t. ! queue ! checksumsink"
    )
    wait_for(sock)
    got = []
    with gpushm.Subscriber(sock, lossless=True) as sub:
        for frame in sub:
            assert frame.format == fmt and (frame.width, frame.height) == (w, h)
            raw = bytes(frame)
            got.append(hashlib.sha1(raw).hexdigest())
            a = frame.numpy()
            assert not a.flags.writeable
            if shape is not None:
                assert a.shape == shape(h, w) and a.dtype == dtype, (a.shape, a.dtype)
                # The view is the bytes: rebuilt from bytes(frame) with GStreamer's stride.
                row = (w + (w % 2 if fmt in ("YUY2", "UYVY") else 0)) * a.itemsize * (a.shape[2] if a.ndim == 3 else 1)
                stride = -(-row // 4) * 4
                assert a.strides[0] == stride
                again = np.ndarray(a.shape, a.dtype, buffer=raw, strides=a.strides)
                assert np.array_equal(a, again)
                assert len(frame.planes) == 1
            else:
                assert a.shape == (len(frame),) and a.dtype == np.uint8
                views = frame.planes
                assert [(v.shape, v.dtype) for v in views] == [((r, e), d) for r, e, d in planes]
                for v in views:
                    offset = v.__array_interface__["data"][0] - a.__array_interface__["data"][0]
                    again = np.ndarray(v.shape, v.dtype, buffer=raw, offset=offset, strides=v.strides)
                    assert np.array_equal(v, again)
    assert got == checksums(p.finish())
    assert len(got) == n


def test_streams_that_are_not_raw_video_still_give_their_bytes(launch, sock):
    p = launch(
        f"audiotestsrc num-buffers=10 samplesperbuffer=480 ! audio/x-raw,format=S16LE,rate=48000,channels=2 "
        f"! tee name=t ! queue ! gpushmsink socket-path={sock} wait-for-connection=true sync=false "
        f"t. ! queue ! checksumsink"
    )
    wait_for(sock)
    got = []
    with gpushm.Subscriber(sock, lossless=True) as sub:
        for frame in sub:
            assert frame.format is None
            a = frame.numpy()
            assert a.shape == (len(frame),) == (1920,)
            assert a.tobytes() == bytes(frame)
            with pytest.raises(TypeError, match="not raw video.*numpy\\(\\)"):
                frame.planes
            got.append(hashlib.sha1(bytes(frame)).hexdigest())
    assert got == checksums(p.finish())
