# SPDX-License-Identifier: MPL-2.0
"""Held frames stay theirs: views, arrays and DLPack capsules kept after the Subscriber closed
are never overwritten, and nothing a frame leaves behind at interpreter exit touches Python
after it finalized (see "Held frames" in the gpushm crate's client module)."""

import ctypes
import os
import selectors
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import gpushm
from conftest import gst_env, wait_for


def moving_producer(launch, sock, fmt="GRAY8", slots=4):
    """A live producer whose every frame differs from the last (videotestsrc's ball)."""
    return launch(
        f"videotestsrc is-live=true pattern=ball motion=sweep num-buffers=600 ! "
        f"video/x-raw,format={fmt},width=160,height=120,framerate=60/1 ! "
        f"gpushmsink socket-path={sock} slots={slots}"
    )


def capsule_name(cap) -> bytes:
    get = ctypes.pythonapi.PyCapsule_GetName
    get.restype, get.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return get(cap)


def test_views_and_capsules_kept_after_close_stay_intact(launch, sock):
    moving_producer(launch, sock)
    wait_for(sock)
    sub = gpushm.Subscriber(sock, lossless=True)
    frame = sub.next_frame()
    view = frame.numpy()
    plane = frame.planes[0]
    dl = np.from_dlpack(frame.cuda_planes()[0], device="cpu")
    assert dl.__array_interface__["data"][0] == view.__array_interface__["data"][0]
    snapshot = view.copy()
    # The producer keeps going round its 4 slots: a reused slot would show a newer frame.
    assert not np.array_equal(sub.next_frame().numpy(), snapshot)
    sub.close()
    frame.release()
    del frame
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert np.array_equal(view, snapshot), "a view kept after close() changed"
        assert np.array_equal(plane, snapshot)
        assert np.array_equal(dl, snapshot), "a DLPack array kept after close() changed"
        time.sleep(0.05)
    # Our slot is still ours: a new subscriber sees frames go on meanwhile.
    with gpushm.Subscriber(sock) as other:
        seen = {other.next_frame().offset for _ in range(10)}
        assert len(seen) == 10


def test_a_closed_subscriber_keeps_frames_valid_and_refuses_new_ones(launch, sock):
    moving_producer(launch, sock)
    wait_for(sock)
    with gpushm.Subscriber(sock) as sub:
        frame = sub.next_frame()
        sub.fileno()  # armed for an event loop before the close
    assert frame.valid
    # The socket lives on with the frame, but an event loop on fileno() hears no more of it.
    with selectors.DefaultSelector() as sel:
        sel.register(sub.fileno(), selectors.EVENT_READ)
        assert not sel.select(timeout=0.3)
    a = frame.numpy()  # views can still be made from a held frame after close
    assert a.shape == (120, 160)
    with pytest.raises(gpushm.Error, match="closed"):
        sub.next_frame()
    frame.release()
    assert not frame.valid
    with pytest.raises(gpushm.Error, match="released"):
        frame.numpy()


def test_versioned_dlpack_is_read_only_and_the_old_capsule_stays(launch, sock):
    moving_producer(launch, sock)
    wait_for(sock)
    with gpushm.Subscriber(sock) as sub:
        frame = sub.next_frame()
        v = frame.cuda_planes()[0]
        assert capsule_name(v.__dlpack__(dl_device=(1, 0))) == b"dltensor"
        assert capsule_name(v.__dlpack__(max_version=(1, 0), dl_device=(1, 0))) == b"dltensor_versioned"
        assert capsule_name(v.__dlpack__(max_version=(0, 8), dl_device=(1, 0))) == b"dltensor"
        a = np.from_dlpack(v, device="cpu")
        assert not a.flags.writeable
        with pytest.raises(BufferError, match="copy"):
            v.__dlpack__(copy=True)
        with pytest.raises(BufferError, match="copy"):
            v.__dlpack__(dl_device=(13, 0))


EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np, gpushm
    sub = gpushm.Subscriber(sys.argv[1], lossless=True)
    frame = sub.next_frame()
    # Alive at exit: an array from a consumed DLPack capsule, a capsule nobody consumed, a
    # versioned one, a view, and the open subscriber itself.
    kept = np.from_dlpack(frame.cuda_planes()[0], device="cpu")
    unconsumed = frame.cuda_planes()[0].__dlpack__(dl_device=(1, 0))
    versioned = frame.cuda_planes()[0].__dlpack__(max_version=(1, 0), dl_device=(1, 0))
    view = frame.numpy()
    print("HELD", kept.shape, flush=True)
    """
)


def test_a_script_ending_with_live_dlpack_arrays_exits_cleanly(launch, sock):
    moving_producer(launch, sock)
    wait_for(sock)
    for _ in range(3):
        r = subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT, sock],
            capture_output=True,
            text=True,
            timeout=30,
            env=gst_env(),
        )
        assert r.returncode == 0, r.stderr
        assert r.stderr == "", r.stderr
        assert "HELD (120, 160)" in r.stdout


def test_a_subscriber_cut_for_holding_over_its_share_sees_its_frames_revoked(sock):
    """The one exception to held frames: a subscriber holding more than its share of a ring
    whose every slot is held, while the publisher waits for a slot, gets cut; its frames then
    say so, and views refuse to be made."""
    with gpushm.Publisher(sock, "GRAY8", 64, 48, fps=1000, slots=4) as pub:
        a = gpushm.Subscriber(sock, lossless=True)
        b = gpushm.Subscriber(sock, lossless=True)
        deadline = time.monotonic() + 10
        while pub.num_clients < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        def send(v):
            pub.publish(np.full((48, 64), v, dtype=np.uint8))

        # a keeps frames 1 and 2, b frames 3 and 4: every slot held, each at its share.
        send(1), send(2)
        a1, a2 = a.next_frame(), a.next_frame()
        b.next_frame().release(), b.next_frame().release()
        send(3), send(4)
        b3, b4 = b.next_frame(), b.next_frame()
        time.sleep(1.5)
        assert pub.num_clients == 2 and a1.valid and b3.valid, "a subscriber within its share was cut"
        # A third subscriber: a's share is one slot now, and a closes holding two.
        c = gpushm.Subscriber(sock)
        while pub.num_clients < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        b4.release()
        send(5)
        c.next_frame().release()
        b.next_frame().release()
        send(6)
        c6 = c.next_frame()
        b.next_frame().release()
        view = a1.numpy()
        a.close()
        # The publisher waits for a slot: a, closed with two, is cut and they come back.
        send(7)
        deadline = time.monotonic() + 10
        while a1.valid:
            assert time.monotonic() < deadline, "a's frames were never revoked"
            time.sleep(0.02)
        assert not a2.valid
        with pytest.raises(gpushm.FrameRevoked, match="cut so that the producer can go on"):
            a1.numpy()
        with pytest.raises(gpushm.FrameRevoked):
            a2.planes
        assert view.shape == (48, 64)  # made before: still an array (it may show other frames)
        assert b3.valid and c6.valid
        assert (b3.numpy() == 3).all() and (c6.numpy() == 6).all()
        b.close(), c.close()
