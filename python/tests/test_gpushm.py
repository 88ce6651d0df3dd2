# SPDX-License-Identifier: MPL-2.0
"""gpushm's Python package against real gst-launch-1.0 processes (no GStreamer in this one)."""

import hashlib
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import gpushm
from conftest import checksums, gst_env, wait_for, wait_for_client

FORMATS = ["I420", "NV12", "RGBA", "GRAY8"]


def producer_with_checksums(launch, sock, fmt, n, w=320, h=240):
    """videotestsrc → (gpushmsink, checksumsink): the sha1 of every frame published."""
    return launch(
        f"videotestsrc num-buffers={n} pattern=ball ! video/x-raw,format={fmt},width={w},height={h},framerate=30/1 "
        f"! tee name=t ! queue ! gpushmsink socket-path={sock} wait-for-connection=true sync=false "
        f"t. ! queue ! checksumsink"
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_frames_are_byte_exact_against_checksumsink(launch, sock, fmt):
    # The tee makes gpushmsink copy each frame into its ring, visible bytes only: sizes whose
    # rows have no padding, so that checksumsink's hash of the source covers the same bytes.
    p = producer_with_checksums(launch, sock, fmt, 20, w=320, h=240)
    wait_for(sock)
    got = []
    with gpushm.Subscriber(sock, lossless=True) as sub:
        for frame in sub:
            assert frame.format == fmt and (frame.width, frame.height) == (320, 240)
            assert f"format=(string){fmt}" in frame.caps
            got.append(hashlib.sha1(bytes(frame)).hexdigest())
            # The planes are views of the same bytes, with the producer's strides.
            for plane in frame.planes:
                assert plane.dtype == np.uint8 and plane.ndim == 2
    assert got == checksums(p.finish())
    assert len(got) == 20


def test_views_are_read_only_and_not_copies(launch, sock):
    launch(f"videotestsrc is-live=true num-buffers=100 ! video/x-raw,format=RGBA,width=64,height=48,framerate=30/1 ! gpushmsink socket-path={sock}")
    wait_for(sock)
    with gpushm.Subscriber(sock) as sub:
        frame = sub.next_frame()
        a = frame.numpy()
        assert a.shape == (48, 64, 4) and a.strides == (256, 4, 1)
        assert not a.flags.writeable and not a.flags.owndata
        with pytest.raises(ValueError):
            a[0, 0, 0] = 1
        # Every view of the frame is the same memory.
        b = np.asarray(frame)
        p0 = frame.planes[0]
        addr = a.__array_interface__["data"][0]
        assert b.__array_interface__["data"][0] == addr
        assert p0.__array_interface__["data"][0] == addr
        assert isinstance(a.base, gpushm.FrameView)
        assert isinstance(b.base, gpushm.FrameView)
        # np.asarray(frame) keeps the slot like any view: still intact after release().
        snapshot = b.copy()
        frame.release()
        for _ in range(20):
            sub.next_frame().release()
        assert np.array_equal(b, snapshot)


def test_a_held_frame_stays_valid_while_the_producer_goes_on(launch, sock):
    launch(f"videotestsrc is-live=true num-buffers=200 pattern=ball ! video/x-raw,format=GRAY8,width=160,height=120,framerate=60/1 ! gpushmsink socket-path={sock} slots=6")
    wait_for(sock)
    with gpushm.Subscriber(sock) as sub:
        held = sub.next_frame()
        view = held.planes[0]
        snapshot = view.copy()
        for _ in range(40):  # far more frames than the ring's 6 slots
            f = sub.next_frame()
            assert not np.array_equal(f.planes[0], snapshot) or f.offset == held.offset
            f.release()
        assert np.array_equal(view, snapshot), "a held frame was overwritten"
        held.release()
        # Released: the frame refuses new views, the view made before still reads its frame.
        with pytest.raises(gpushm.Error, match="released"):
            held.numpy()
        assert np.array_equal(view, snapshot)


def test_lossless_gets_every_frame_and_leaky_drops(launch, sock):
    launch(f"videotestsrc num-buffers=60 ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 ! gpushmsink socket-path={sock} wait-for-connection=true")
    wait_for(sock)
    with gpushm.Subscriber(sock, lossless=True) as sub:
        offsets = []
        for f in sub:
            offsets.append(f.offset)
            time.sleep(0.005)  # slower than the producer (not live: flat out)
    assert offsets == list(range(60))


def test_spin_us_gets_every_frame_intact_from_a_live_producer(launch, sock):
    """The low-latency mode (spin_us) on a live 30 fps producer: all 45 frames, byte for byte
    (checksums of the producer's own frames), in order, and frames caught while polling
    (without the mode none are), the ring polled once a frame at most."""
    n = 45
    p = launch(
        f"videotestsrc is-live=true num-buffers={n} pattern=ball ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 "
        f"! tee name=t ! queue ! gpushmsink socket-path={sock} wait-for-connection=true sync=false "
        f"t. ! queue ! checksumsink"
    )
    wait_for(sock)
    with gpushm.Subscriber(sock, mode="lossless", spin_us=2000) as sub:
        got, offsets = [], []
        for f in sub:
            got.append(hashlib.sha1(bytes(f)).hexdigest())
            offsets.append(f.offset)
            del f
        caught, missed = sub.spin_stats
    assert got == checksums(p.finish(timeout=20))
    assert offsets == list(range(n))
    assert caught >= n // 10, (caught, missed)
    assert caught + missed <= n + 1, (caught, missed)


def test_a_slow_leaky_subscriber_drops_and_says_so(launch, sock):
    launch(f"videotestsrc is-live=true num-buffers=300 ! video/x-raw,format=GRAY8,width=64,height=48,framerate=100/1 ! gpushmsink socket-path={sock}")
    wait_for(sock)
    with gpushm.Subscriber(sock) as sub:
        offsets = [sub.next_frame().offset]
        for _ in range(10):
            time.sleep(0.1)  # ten frames' time
            offsets.append(sub.next_frame().offset)
        assert sub.dropped > 0
    assert any(b - a > 1 for a, b in zip(offsets, offsets[1:])), offsets


def test_producer_kill9_raises_producer_lost_within_a_second(launch, sock):
    p = launch(f"videotestsrc is-live=true ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 ! gpushmsink socket-path={sock}")
    wait_for(sock)
    with gpushm.Subscriber(sock) as sub:
        sub.next_frame()
        p.p.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(gpushm.ProducerLost, match="went away"):
            while True:
                sub.next_frame(timeout=5)
        assert time.monotonic() - t0 < 1.0


def test_no_producer_is_a_timeout(sock):
    t0 = time.monotonic()
    with pytest.raises(gpushm.Timeout):
        gpushm.Subscriber(sock, timeout=0.3)
    assert time.monotonic() - t0 < 2


def test_eos_ends_iteration_and_next_frame_raises(launch, sock):
    launch(f"videotestsrc num-buffers=5 ! video/x-raw,format=GRAY8,width=64,height=48 ! gpushmsink socket-path={sock} wait-for-connection=true")
    wait_for(sock)
    with gpushm.Subscriber(sock, lossless=True) as sub:
        assert len([f.offset for f in sub]) == 5
        with pytest.raises(gpushm.EndOfStream):
            sub.next_frame(timeout=1)


def test_fileno_works_with_selectors(launch, sock):
    launch(f"videotestsrc is-live=true num-buffers=100 ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 ! gpushmsink socket-path={sock}")
    wait_for(sock)
    with gpushm.Subscriber(sock) as sub, selectors.DefaultSelector() as sel:
        sel.register(sub.fileno(), selectors.EVENT_READ)
        got = 0
        deadline = time.monotonic() + 5
        while got < 5 and time.monotonic() < deadline:
            if sel.select(timeout=1):
                try:
                    sub.next_frame(timeout=0)
                    got += 1
                except gpushm.Timeout:
                    pass  # news on the socket, not a frame
        assert got == 5


@pytest.mark.parametrize("fmt", ["RGBA", "NV12"])
def test_python_publisher_to_gpushmsrc_is_byte_exact(launch, sock, fmt):
    w, h, n = 64, 48, 10
    rng = np.random.default_rng(1)
    with gpushm.Publisher(sock, fmt, w, h, fps=30) as pub:
        c = launch(f"gpushmsrc socket-path={sock} lossless=true num-buffers={n} ! checksumsink")
        wait_for_client(pub, "gpushmsrc")
        size = w * h * 4 if fmt == "RGBA" else w * h * 3 // 2
        sent = []
        for i in range(n):
            if i % 2 == 0:
                data = rng.integers(0, 256, size, dtype=np.uint8)
                pub.publish(data)
            else:
                # Zero-copy: fill a slot in place.
                slot = pub.acquire()
                data = np.empty(0, dtype=np.uint8)
                for plane in slot.planes:
                    plane[...] = rng.integers(0, 256, plane.shape, dtype=np.uint8)
                    data = np.concatenate([data, plane.ravel()])
                del plane  # no view of the slot may outlive its publication
                pub.publish(slot)
            sent.append(hashlib.sha1(data.tobytes()).hexdigest())
        out = c.finish(timeout=20)
    assert checksums(out) == sent


def test_importing_gpushm_loads_no_gstreamer():
    code = (
        "import sys, gpushm; "
        "bad = [m for m in sys.modules if m == 'gi' or m.startswith('gi.') or 'gst' in m.lower()]; "
        "assert not bad, bad; "
        "maps = open('/proc/self/maps').read(); "
        "assert 'libgst' not in maps and 'libglib' not in maps and 'libcuda' not in maps, 'a library was loaded'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_arguments_say_why(sock):
    with pytest.raises(ValueError, match="not one of"):
        gpushm.Publisher(sock, "YUY2", 64, 48)
    with pytest.raises(ValueError, match="timeout"):
        gpushm.Subscriber(sock, timeout=-5)
    with pytest.raises(ValueError, match="auto.*lossless.*leaky"):
        gpushm.Subscriber(sock, mode="sometimes")
    with pytest.raises(ValueError, match="spin_us=100001"):
        gpushm.Subscriber(sock, spin_us=100001)
    with pytest.raises(ValueError, match="spin_us=100001"):
        gpushm.Publisher(sock, "GRAY8", 64, 48, spin_us=100001)
    assert not os.path.exists(sock), "a refused publisher leaves no socket"


def test_publisher_spin_us_flat_out_to_a_lossless_subscriber_loses_nothing(sock):
    """Publisher(spin_us=) polls for a lossless consumer's releases (two slots, flat out; the
    consumer holds each frame 1 ms, so the publisher waits for nearly every one): every frame
    arrives, in order, with its contents, and waits end while the publisher polls."""
    n = 100
    # fps=5: a 200 ms bound on each wait for the consumer (the publisher's max-wait follows
    # the frame duration), so that a loaded machine does not make it lag; frames go flat out.
    # A 20 ms budget: the release comes about 1 ms after the frame, GIL hand-overs included.
    with gpushm.Publisher(sock, "GRAY8", 64, 48, fps=5, slots=2, spin_us=20000) as pub:
        with gpushm.Subscriber(sock, mode="lossless") as sub:
            wait_for_client(pub, "the subscriber")
            got = []

            def take():
                while len(got) < n:
                    with sub.next_frame(timeout=10) as f:
                        got.append(int(np.asarray(f.planes[0])[0, 0]))
                        time.sleep(0.001)

            t = threading.Thread(target=take)
            t.start()
            for i in range(n):
                pub.publish(np.full(64 * 48, i % 251, dtype=np.uint8))
            t.join(timeout=30)
            assert not t.is_alive(), f"took {len(got)} of {n}"
            caught, missed = pub.spin_stats
    assert got == [i % 251 for i in range(n)]
    assert caught >= 1, f"no wait ended while polling ({caught}, {missed})"
    assert caught + missed <= n, "one poll a frame at most"


def test_wake_early_wakes_gpushmsrc_asleep_on_another_cpu_and_loses_nothing(sock):
    """Publisher.wake_early() wakes a gpushmsrc asleep on another CPU ahead of each frame,
    once per frame however often called; every frame still arrives, byte for byte."""
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, f"this test needs two CPUs, it may use {cpus}"
    frames = [np.full(64 * 48, i + 1, dtype=np.uint8) for i in range(4)]
    try:
        os.sched_setaffinity(0, {cpus[1]})
        with gpushm.Publisher(sock, "GRAY8", 64, 48, fps=30) as pub:
            p = subprocess.Popen(
                ["gst-launch-1.0", "-q", *f"gpushmsrc socket-path={sock} mode=lossless ! checksumsink".split()],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=gst_env(),
                preexec_fn=lambda: os.sched_setaffinity(0, {cpus[0]}),
            )
            try:
                wait_for_client(pub, "gpushmsrc")
                for f in frames:
                    # gpushmsrc is asleep waiting for the frame.
                    time.sleep(0.2)
                    pub.wake_early()
                    pub.wake_early()
                    pub.publish(f)
                pub.send_eos()
                out, _ = p.communicate(timeout=30)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
            woken = pub.woken_early
    finally:
        os.sched_setaffinity(0, cpus)
    assert p.returncode == 0, out
    assert checksums(out) == [hashlib.sha1(f.tobytes()).hexdigest() for f in frames], out
    # Each frame once at most; most of them (gpushmsrc asleep 0.2 s after the last).
    assert len(frames) // 2 <= woken <= len(frames), f"{woken} early wake-ups for {len(frames)} frames"


def test_wake_early_wakes_a_python_subscriber_until_its_fileno_is_armed(sock):
    """A Python subscriber asleep in next_frame on another CPU is woken ahead of each frame
    (Publisher.wake_early) and gets every frame in order; once its fileno() is called (an
    event loop's, rung after every frame) it no longer is."""
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, f"this test needs two CPUs, it may use {cpus}"
    n = 6
    try:
        os.sched_setaffinity(0, {cpus[1]})
        with gpushm.Publisher(sock, "GRAY8", 64, 48, fps=30) as pub:
            with gpushm.Subscriber(sock, mode="lossless") as sub:
                wait_for_client(pub, "the subscriber")
                got = []
                armed = threading.Event()

                def take():
                    os.sched_setaffinity(0, {cpus[0]})
                    for i in range(n):
                        if i == n // 2:
                            sub.fileno()
                            armed.set()
                        with sub.next_frame(timeout=10) as f:
                            got.append(int(np.asarray(f.planes[0])[0, 0]))

                t = threading.Thread(target=take)
                t.start()
                woken = []
                for i in range(n):
                    if i == n // 2:
                        assert armed.wait(10)
                    # The subscriber is asleep in next_frame.
                    time.sleep(0.2)
                    pub.wake_early()
                    pub.publish(np.full(64 * 48, i + 1, dtype=np.uint8))
                    woken.append(pub.woken_early)
                t.join(timeout=30)
                assert not t.is_alive(), f"took {len(got)} of {n}"
    finally:
        os.sched_setaffinity(0, cpus)
    assert got == list(range(1, n + 1))
    before, after = woken[n // 2 - 1], woken[-1]
    assert before >= n // 4, f"{before} early wake-ups for {n // 2} frames before fileno()"
    assert after == before, f"woken early after fileno(): {woken}"


def test_wake_ahead_us_wakes_a_python_subscriber_before_each_frame_is_due(sock):
    """Publisher(wake_ahead_us=...) wakes a Python subscriber asleep in next_frame on another
    CPU before each frame is due, from the cadence of the last frames, with no wake_early()
    call: most frames of a steady 25 fps stream are woken for ahead, every frame arrives in
    order. Over the most (1000 µs) it is refused with ValueError."""
    with pytest.raises(ValueError, match="wake_ahead_us=1001"):
        gpushm.Publisher(sock, "GRAY8", 64, 48, wake_ahead_us=1001)
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, f"this test needs two CPUs, it may use {cpus}"
    n = 20
    try:
        os.sched_setaffinity(0, {cpus[1]})
        with gpushm.Publisher(sock, "GRAY8", 64, 48, fps=25, wake_ahead_us=1000) as pub:
            with gpushm.Subscriber(sock, mode="lossless") as sub:
                wait_for_client(pub, "the subscriber")
                got = []

                def take():
                    os.sched_setaffinity(0, {cpus[0]})
                    for _ in range(n):
                        with sub.next_frame(timeout=10) as f:
                            got.append(int(np.asarray(f.planes[0])[0, 0]))

                t = threading.Thread(target=take)
                t.start()
                for i in range(n):
                    time.sleep(0.04)
                    pub.publish(np.full(64 * 48, i + 1, dtype=np.uint8))
                t.join(timeout=30)
                assert not t.is_alive(), f"took {len(got)} of {n}"
                ahead, early = pub.woken_ahead, pub.woken_early
    finally:
        os.sched_setaffinity(0, cpus)
    assert got == list(range(1, n + 1))
    # Three frames to learn the cadence, a few late on a loaded machine.
    assert n // 2 <= ahead <= n, f"{ahead} wake-ups ahead ({early} early) for {n} frames"


def test_a_slot_is_never_written_once_published(sock):
    with gpushm.Publisher(sock, "GRAY8", 64, 48) as pub, gpushm.Publisher(sock + "2", "GRAY8", 64, 48) as other:
        slot = pub.acquire()
        view = slot.planes[0]
        view[...] = 7
        with pytest.raises(gpushm.Error, match="views of this slot are still alive"):
            pub.publish(slot)
        del view
        with pytest.raises(ValueError, match="another Publisher"):
            other.publish(slot)
        pub.publish(slot)
        with pytest.raises(gpushm.Error, match="published"):
            slot.planes
        with pytest.raises(gpushm.Error, match="already published"):
            pub.publish(slot)
        with pytest.raises(TypeError, match="uint8"):
            pub.publish(np.zeros((48, 64), dtype=np.float32))


def test_an_event_loop_on_fileno_sees_eos_without_spinning(launch, sock):
    launch(f"videotestsrc is-live=true num-buffers=20 ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 ! gpushmsink socket-path={sock}")
    wait_for(sock)
    with gpushm.Subscriber(sock) as sub, selectors.DefaultSelector() as sel:
        sel.register(sub.fileno(), selectors.EVENT_READ)
        wakeups = frames = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not sel.select(timeout=1):
                continue
            wakeups += 1
            try:
                sub.next_frame(timeout=0)
                frames += 1
            except gpushm.Timeout:
                pass
            except gpushm.EndOfStream:
                break
        else:
            pytest.fail("EOS never reached the event loop")
    # One wake-up per frame, give or take the socket's news: never a busy loop.
    assert frames >= 10 and wakeups < 3 * frames + 10, (frames, wakeups)


def test_a_publisher_in_gpu_memory_without_a_gpu_says_why(tmp_path):
    """Publisher(cuda_device=0) where no GPU can be used (hidden here, so that this runs the
    same on GPU machines) fails with a clear error, and leaves no socket behind."""
    code = (
        "import gpushm, sys\n"
        "try:\n"
        "    gpushm.Publisher(sys.argv[1], 'GRAY8', 64, 48, cuda_device=0)\n"
        "except ValueError as e:\n"
        "    print('ERROR', e)\n"
    )
    path = str(tmp_path / "dev.sock")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERROR cuda_device=0:"), out.stdout
    assert "CUDA" in out.stdout, out.stdout
    assert not os.path.exists(path)


def test_stream_names_meet_between_a_gst_launch_producer_and_a_python_subscriber(launch, tmp_path, monkeypatch):
    # Names resolve in GPUSHM_RUNTIME_DIR, which both sides get; a gst-launch producer, a
    # Python subscriber, then a Python publisher read by gpushmsrc stream=NAME.
    monkeypatch.setenv("GPUSHM_RUNTIME_DIR", str(tmp_path))
    p = launch(
        "videotestsrc num-buffers=10 pattern=ball ! video/x-raw,format=NV12,width=320,height=240,framerate=30/1 "
        "! tee name=t ! queue ! gpushmsink stream=py-cam wait-for-connection=true sync=false t. ! queue ! checksumsink"
    )
    wait_for(str(tmp_path / "py-cam"))
    with gpushm.Subscriber(stream="py-cam", lossless=True) as sub:
        got = [hashlib.sha1(bytes(f)).hexdigest() for f in sub]
    assert got == checksums(p.finish()) and len(got) == 10

    with gpushm.Publisher(stream="py-out", format="GRAY8", width=64, height=48) as pub:
        assert os.path.exists(tmp_path / "py-out")
        c = launch("gpushmsrc stream=py-out lossless=true num-buffers=3 ! checksumsink")
        wait_for_client(pub, "gpushmsrc stream=py-out")
        sent = []
        for i in range(3):
            data = np.full((48, 64), i + 1, dtype=np.uint8)
            pub.publish(data)
            sent.append(hashlib.sha1(data.tobytes()).hexdigest())
        assert checksums(c.finish()) == sent


def test_stream_names_are_checked_and_path_or_stream_is_required(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSHM_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="stream name .* is not valid"):
        gpushm.Subscriber(stream="../etc")
    with pytest.raises(ValueError, match="stream name"):
        gpushm.Publisher(stream="a b", format="GRAY8", width=64, height=48)
    with pytest.raises(ValueError, match="both path and stream"):
        gpushm.Subscriber(str(tmp_path / "x"), stream="x")
    with pytest.raises(TypeError, match="stream"):
        gpushm.Subscriber()
    with pytest.raises(TypeError, match="format, width and height"):
        gpushm.Publisher(stream="ok")
    with pytest.raises(gpushm.Timeout, match="stream \"absent\""):
        gpushm.Subscriber(stream="absent", timeout=0.2)


def test_streams_and_python_m_gpushm_list_what_is_published(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSHM_RUNTIME_DIR", str(tmp_path))
    assert gpushm.streams() == []
    with gpushm.Publisher(stream="listed", format="GRAY8", width=64, height=48, slots=4) as pub, \
            gpushm.Subscriber(stream="listed", name="reader", lossless=True) as sub:
        for i in range(5):
            pub.publish(np.full((48, 64), i, dtype=np.uint8))
            with sub.next_frame(timeout=5) as f:
                assert f.numpy()[0, 0] == i
        time.sleep(0.15)  # a producer answers with the same report for 100 ms
        (s,) = gpushm.streams()
        assert s["name"] == "listed" and s["state"] == "live" and s["clients"] == 1
        assert "GRAY8" in s["caps"] and s["slots"] == 4 and s["frames_sent"] == 5
        (c,) = s["client_list"]
        assert c["name"] == "reader" and c["delivered"] == 5 and c["dropped"] == 0
        assert c["latency_p50_us"] > 0
        assert gpushm.inspect("listed")["frames_sent"] == 5
        out = subprocess.run([sys.executable, "-m", "gpushm", "list", "--json"], capture_output=True, text=True, check=True)
        import json
        (j,) = json.loads(out.stdout)
        assert j["name"] == "listed" and j["clients"] == 1
        out = subprocess.run([sys.executable, "-m", "gpushm", "inspect", "listed"], capture_output=True, text=True, check=True)
        assert "'reader'" in out.stdout and "4 slots" in out.stdout
    with pytest.raises(gpushm.Error):
        gpushm.inspect("listed")


def test_cpu_latency_holds_until_closed_or_says_why_not():
    """gpushm.CpuLatency: where the device is writable (root, or a udev rule) the kernel keeps
    the CPUs to it (read back) until it is closed; where it is not, gpushm.Error says what
    access it needs; where there is none, it says so."""
    with pytest.raises(ValueError, match="largest"):
        gpushm.CpuLatency(1_000_001)
    dev = "/dev/cpu_dma_latency"
    if not os.path.exists(dev):
        with pytest.raises(gpushm.Error, match="no CPU latency QoS device"):
            gpushm.CpuLatency(0)
    elif not os.access(dev, os.W_OK):
        with pytest.raises(gpushm.Error, match="udev rule"):
            gpushm.CpuLatency(0)
    else:
        before = gpushm.CpuLatency.current()
        assert before > 31, f"another process holds the CPU latency at {before} µs"
        with gpushm.CpuLatency(31) as r:
            assert r.held and r.us == 31
            assert gpushm.CpuLatency.current() == 31
            inner = gpushm.CpuLatency(13)
            assert gpushm.CpuLatency.current() == 13
            inner.close()
            inner.close()
            assert not inner.held
            assert gpushm.CpuLatency.current() == 31
        assert not r.held and "closed" in repr(r)
        assert gpushm.CpuLatency.current() == before
