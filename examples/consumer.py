#!/usr/bin/env python3
# SPDX-License-Identifier: MPL-2.0
"""A Python consumer: `gpushmsrc ! appsink` (no caps given), printing for each frame its number,
caps size, bytes and the sum of every byte, read in place from the shared ring.

    GST_PLUGIN_PATH=$PWD/target/release /usr/bin/python3 examples/consumer.py /tmp/cam 100

Add --lossless to receive every frame (the producer then waits for this consumer), and
--timeout SECONDS to wait that long for a producer (default 5).

Needs PyGObject (python3-gi, gir1.2-gstreamer-1.0, gir1.2-gst-plugins-base-1.0).
"""
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstApp", "1.0")
from gi.repository import Gst  # noqa: E402


def main() -> int:
    argv = sys.argv[1:]
    timeout_s = 5.0
    if "--timeout" in argv:
        i = argv.index("--timeout")
        timeout_s = float(argv[i + 1])
        del argv[i:i + 2]
    args = [a for a in argv if a != "--lossless"]
    lossless = "true" if "--lossless" in argv else "false"
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    socket_path = args[0]
    frames = int(args[1]) if len(args) > 1 else 100
    Gst.init(None)
    if Gst.ElementFactory.find("gpushmsrc") is None:
        print("gpushmsrc not found: set GST_PLUGIN_PATH to the folder of libgstgpushm.so", file=sys.stderr)
        return 2
    pipeline = Gst.parse_launch(
        f"gpushmsrc socket-path={socket_path} lossless={lossless} reconnect=false "
        f"timeout={int(timeout_s * 1e9)} "
        "! appsink name=out sync=false max-buffers=2"
    )
    try:
        return consume(pipeline, frames)
    finally:
        # On every path, errors included: a pipeline left PLAYING at exit makes GStreamer
        # print a CRITICAL.
        pipeline.set_state(Gst.State.NULL)


def consume(pipeline, frames: int) -> int:
    sink = pipeline.get_by_name("out")
    bus = pipeline.get_bus()
    if pipeline.set_state(Gst.State.PLAYING) == Gst.StateChangeReturn.FAILURE:
        msg = bus.timed_pop_filtered(Gst.SECOND, Gst.MessageType.ERROR)
        print(f"error: {msg.parse_error()[0].message if msg else 'could not start'}", file=sys.stderr)
        return 1
    got = 0
    while got < frames:
        sample = sink.emit("pull-sample")
        if sample is None:  # EOS or error (e.g. no producer within gpushmsrc's timeout)
            break
        buf = sample.get_buffer()
        caps = sample.get_caps().get_structure(0)
        ok, info = buf.map(Gst.MapFlags.READ)
        if not ok:
            print("could not map a frame", file=sys.stderr)
            return 1
        total = sum(info.data)
        buf.unmap(info)
        print(f"frame n={buf.offset} {caps.get_int('width')[1]}x{caps.get_int('height')[1]} "
              f"bytes={buf.get_size()} sum={total}", flush=True)
        got += 1
    msg = bus.pop_filtered(Gst.MessageType.ERROR)
    if msg:
        print(f"error: {msg.parse_error()[0].message}", file=sys.stderr)
        return 1
    return 0 if got > 0 else 1

if __name__ == "__main__":
    sys.exit(main())
