# SPDX-License-Identifier: MPL-2.0
"""On a CUDA machine with PyTorch and CuPy: frames reach the GPU libraries in place.

Marked `gpu` (deselected by `make test`); on the GPU machine: `pytest -m gpu`. Without a GPU,
PyTorch or CuPy they fail, saying why: they never pass vacuously.
"""

import subprocess
import sys
import time

import numpy as np
import pytest

import gpushm
from conftest import gst_env, wait_for

pytestmark = pytest.mark.gpu


def live(launch, sock, fmt, w, h, n=3000, slots=8):
    launch(
        f"videotestsrc is-live=true num-buffers={n} pattern=ball ! video/x-raw,format={fmt},width={w},height={h},framerate=60/1 "
        f"! gpushmsink socket-path={sock} slots={slots}"
    )
    wait_for(sock)


def test_torch_and_cupy_alias_the_registered_ring(launch, sock):
    import cupy
    import torch

    live(launch, sock, "RGBA", 1280, 720)
    before = gpushm.cuda_registrations()
    with gpushm.Subscriber(sock) as sub:
        f = sub.next_frame()
        cpu = int(f.numpy().sum(dtype=np.int64))
        addr = f.__cuda_array_interface__["data"][0]
        t = torch.from_dlpack(f)
        assert t.is_cuda and t.dtype == torch.uint8 and tuple(t.shape) == (720, 1280, 4)
        assert t.data_ptr() == addr, "torch got the ring's device address: no copy"
        assert int(t.sum(dtype=torch.int64)) == cpu
        c = cupy.asarray(f)  # __cuda_array_interface__
        assert c.data.ptr == addr
        assert int(c.sum(dtype=cupy.int64)) == cpu
        d = cupy.from_dlpack(f)
        assert d.data.ptr == addr
        print(f"RGBA 720p: device address {addr:#x}, GPU sum {cpu} = NumPy's")
        for _ in range(30):
            g = sub.next_frame()
            assert int(torch.from_dlpack(g).sum(dtype=torch.int64)) == int(g.numpy().sum(dtype=np.int64))
    assert gpushm.cuda_registrations() == before + 1, "one registration for the ring, none per frame"


def test_planar_frames_go_to_the_gpu_plane_by_plane(launch, sock):
    import torch

    live(launch, sock, "NV12", 1920, 1080)
    with gpushm.Subscriber(sock) as sub:
        f = sub.next_frame()
        with pytest.raises(TypeError, match="cuda_planes"):
            torch.from_dlpack(f)
        for view, plane in zip(f.cuda_planes(), f.planes):
            t = torch.from_dlpack(view)
            assert tuple(t.shape) == plane.shape and t.stride() == tuple(s for s in plane.strides)
            assert int(t.sum(dtype=torch.int64)) == int(plane.sum(dtype=np.int64))


def test_a_frame_held_by_a_tensor_is_not_reused(launch, sock):
    import torch

    live(launch, sock, "GRAY8", 640, 480, slots=6)
    with gpushm.Subscriber(sock) as sub:
        f = sub.next_frame()
        t = torch.from_dlpack(f)
        snapshot = t.cpu().clone()
        del f  # only the tensor holds the frame now
        for _ in range(40):  # far more frames than the 6 slots
            sub.next_frame().release()
        assert torch.equal(t.cpu(), snapshot), "a frame held by a tensor was overwritten"


def test_no_cuda_context_without_gpu_use(launch, sock):
    live(launch, sock, "GRAY8", 640, 480)
    code = (
        "import gpushm, sys\n"
        f"sub = gpushm.Subscriber({sock!r})\n"
        "for _ in range(10): sub.next_frame().numpy().sum()\n"
        "assert 'libcuda' not in open('/proc/self/maps').read(), 'libcuda was loaded'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=gst_env())


def test_tensors_kept_after_close_stay_intact(launch, sock):
    import cupy
    import torch

    launch(
        f"videotestsrc is-live=true pattern=ball motion=sweep num-buffers=600 ! "
        f"video/x-raw,format=RGBA,width=320,height=240,framerate=60/1 ! gpushmsink socket-path={sock} slots=4"
    )
    wait_for(sock)
    sub = gpushm.Subscriber(sock, lossless=True)
    f = sub.next_frame()
    t = torch.from_dlpack(f)
    c = cupy.from_dlpack(f)
    snapshot = f.numpy().copy()
    assert not np.array_equal(sub.next_frame().numpy(), snapshot), "the pattern moves"
    sub.close()
    del f
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert np.array_equal(t.cpu().numpy(), snapshot), "a torch tensor kept after close() changed"
        assert np.array_equal(cupy.asnumpy(c), snapshot), "a CuPy array kept after close() changed"
        time.sleep(0.05)
    print("torch and CuPy views kept 1 s after close(): unchanged")


GPU_EXIT_SCRIPT = """
import sys, gpushm, torch, cupy
sub = gpushm.Subscriber(sys.argv[1], lossless=True)
frame = sub.next_frame()
t = torch.from_dlpack(frame)          # alive at exit: its deleter runs after finalization
c = cupy.from_dlpack(frame.cuda_planes()[0])
print("HELD", tuple(t.shape), t.is_cuda, flush=True)
"""


def test_a_script_ending_with_live_tensors_exits_cleanly(launch, sock):
    live(launch, sock, "RGBA", 320, 240)
    for _ in range(3):
        r = subprocess.run(
            [sys.executable, "-c", GPU_EXIT_SCRIPT, sock],
            capture_output=True, text=True, timeout=60, env=gst_env(),
        )
        assert r.returncode == 0, r.stderr
        assert r.stderr == "", r.stderr
        assert "HELD (240, 320, 4) True" in r.stdout


def test_sixteen_bit_frames_reach_cupy_as_uint16(launch, sock):
    import cupy

    live(launch, sock, "GRAY16_LE", 321, 241)
    with gpushm.Subscriber(sock) as sub:
        f = sub.next_frame()
        a = f.numpy()
        assert a.dtype == np.dtype("<u2") and a.shape == (241, 321)
        c = cupy.from_dlpack(f)
        assert c.dtype == cupy.uint16 and c.shape == (241, 321)
        assert np.array_equal(cupy.asnumpy(c), a)


DEVICE_PRODUCER = r"""
import sys, time
import numpy as np
import torch
import gpushm

with gpushm.Publisher(sys.argv[1], "GRAY8", 640, 480, fps=30, slots=4, cuda_device=0) as pub:
    assert pub.on_device
    print("READY", flush=True)
    deadline = time.monotonic() + 30
    while pub.num_clients < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    for v in range(20):
        if v % 2:
            pub.publish(torch.full((480, 640), v, dtype=torch.uint8, device="cuda"), timeout=10)
        else:
            pub.publish(np.full((480, 640), v, dtype=np.uint8), timeout=10)
    print("SENT", flush=True)
    deadline = time.monotonic() + 30
    while pub.num_clients > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
"""


def test_a_device_ring_reaches_torch_in_place_in_another_process(sock):
    """Issue 28: a Publisher with cuda_device=0 keeps its ring in GPU memory and fills it from
    CUDA tensors (one device-to-device copy) and NumPy arrays; a Subscriber in another process
    with device_memory=True gets frames on the GPU: torch.from_dlpack aliases them, values
    intact; numpy() refuses, bytes() copies; a held tensor stays unchanged while the ring goes
    round; a subscriber that did not ask for GPU memory is turned away, told why."""
    import torch

    producer = subprocess.Popen([sys.executable, "-c", DEVICE_PRODUCER, sock], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Once its ring is in GPU memory (a consumer that connects before is let go when the
        # ring comes, told why).
        assert producer.stdout.readline().strip() == "READY", producer.stderr.read()
        with pytest.raises(Exception, match="GPU memory"):
            gpushm.Subscriber(sock)
        with gpushm.Subscriber(sock, device_memory=True, mode="lossless", timeout=20) as sub:
            held = None
            for v in range(20):
                f = sub.next_frame()
                assert f.on_device
                t = torch.from_dlpack(f)
                assert t.is_cuda and tuple(t.shape) == (480, 640)
                assert bool((t == v).all()), f"frame {v}"
                if v == 3:
                    with pytest.raises(Exception, match="GPU memory"):
                        f.numpy()
                    assert bytes(f) == bytes([v]) * (640 * 480)
                if held is None:
                    held = t
                else:
                    del t
                    f.release()
            assert bool((held == 0).all()), "the held frame was reused"
            del held
        out, err = producer.communicate(timeout=30)
        assert producer.returncode == 0, err
        assert "SENT" in out
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.communicate()
