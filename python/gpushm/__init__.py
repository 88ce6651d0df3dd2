# SPDX-License-Identifier: MPL-2.0
"""gpushm: live video frames shared between processes without copies.

Receive frames from a ``gpushmsink`` (GStreamer) or a :class:`Publisher` as read-only NumPy
views into the shared ring, and on a CUDA machine hand them to PyTorch or CuPy in place::

    import gpushm, torch
    with gpushm.Subscriber("/tmp/cam") as sub:
        for frame in sub:
            rgba = torch.from_dlpack(frame)        # CUDA tensor aliasing the ring
            print(frame.pts, rgba.float().mean().item())

Every raw video format GStreamer knows comes through (BGRx and RGB as height × width ×
channels, GRAY16 and 10-bit formats as uint16, planar ones plane by plane); other streams as
their bytes.

A frame, and every view, array or tensor made from it, keeps its slot in the ring until the
last of them is gone, even after the subscriber is closed. The one exception is a subscriber
the producer cuts for holding more than its share of the ring: ``Frame.valid`` turns False and
views made before may show newer frames (the rule is written once, in the gpushm crate's
``client`` module, "Held frames").

No GStreamer or PyGObject is loaded; NumPy is the only dependency.
"""

from ._gpushm import (
    CpuLatency,
    EndOfStream,
    Error,
    Frame,
    FrameRevoked,
    FrameView,
    ProducerLost,
    Publisher,
    Slot,
    Subscriber,
    Timeout,
    cuda_registrations,
    inspect,
    streams,
)

__all__ = [
    "CpuLatency",
    "EndOfStream",
    "Error",
    "Frame",
    "FrameRevoked",
    "FrameView",
    "ProducerLost",
    "Publisher",
    "Slot",
    "Subscriber",
    "Timeout",
    "cuda_registrations",
    "inspect",
    "streams",
]
