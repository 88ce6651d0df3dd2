# SPDX-License-Identifier: MPL-2.0
"""gpushm: live video frames shared between processes without copies.

Receive frames from a ``gpushmsink`` (GStreamer) or a :class:`Publisher` as read-only NumPy
views into the shared ring, and on a CUDA machine hand them to PyTorch or CuPy in place::

    import gpushm, torch
    with gpushm.Subscriber("/tmp/cam") as sub:
        for frame in sub:
            rgba = torch.from_dlpack(frame)        # CUDA tensor aliasing the ring
            print(frame.pts, rgba.float().mean().item())

No GStreamer or PyGObject is loaded; NumPy is the only dependency.
"""

from ._gpushm import (
    EndOfStream,
    Error,
    Frame,
    FrameView,
    ProducerLost,
    Publisher,
    Slot,
    Subscriber,
    Timeout,
    cuda_registrations,
)

__all__ = [
    "EndOfStream",
    "Error",
    "Frame",
    "FrameView",
    "ProducerLost",
    "Publisher",
    "Slot",
    "Subscriber",
    "Timeout",
    "cuda_registrations",
]
