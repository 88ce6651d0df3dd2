# SPDX-License-Identifier: MPL-2.0
"""A peer can only hurt itself, from Python: a hostile consumer speaking the protocol by hand
against the Python Publisher (issue 27). The Rust attack tests (tests/hostile.rs) cover the
same core from both sides; this one checks the Python binding keeps publishing."""

import fcntl
import mmap
import os
import socket
import struct
import threading
import time

import numpy as np

import gpushm

PROTOCOL_VERSION = 7
HELLO, WELCOME = 1, 2
# ClientHeader.consumer_waits in client block layout 6 (gpushm/src/layout.rs asserts the
# offset); the test checks the block's version, so a new layout cannot leave it writing elsewhere.
LAYOUT_VERSION = 6
CONSUMER_WAITS = 152


def raw_hello(path: str):
    """Connects, says Hello (leaky), and returns the socket and the Welcome's descriptors."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    name = b"hostile"
    payload = struct.pack("<II", 0, os.getpid()) + struct.pack("<I", len(name)) + name
    s.sendall(b"GSHW" + struct.pack("<HHII", PROTOCOL_VERSION, HELLO, len(payload), 0) + payload)
    s.settimeout(5)
    msg, fds, _, _ = socket.recv_fds(s, 4096, 8)
    assert msg[:4] == b"GSHW", msg
    assert struct.unpack_from("<H", msg, 6)[0] == WELCOME, msg
    assert len(fds) == 3, fds
    return s, fds


def test_a_consumer_cannot_block_the_python_publisher_through_its_wake_up_descriptors(sock):
    """A client that makes its wake-up descriptors blocking (and fills them where it can), asks
    to be woken after every frame and never reads cannot make Publisher.publish() block: 300
    frames go out and an honest subscriber gets them."""
    with gpushm.Publisher(sock, "GRAY8", 64, 48, fps=1000, slots=8) as pub:
        s, (memfd, ready, release) = raw_hello(sock)
        for fd in (ready, release):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            if "eventfd" in os.readlink(f"/proc/self/fd/{fd}"):
                os.write(fd, struct.pack("<Q", 0xFFFF_FFFF_FFFF_FFFE))
        block = mmap.mmap(memfd, os.fstat(memfd).st_size)
        assert struct.unpack_from("<I", block, 8)[0] == LAYOUT_VERSION, "CONSUMER_WAITS is layout 6's"
        struct.pack_into("<I", block, CONSUMER_WAITS, 1)
        honest = gpushm.Subscriber(sock)
        deadline = time.monotonic() + 10
        while pub.num_clients < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        done = threading.Event()

        def publish():
            for v in range(300):
                pub.publish(np.full((48, 64), v % 256, dtype=np.uint8))
                # Paced (about 2 ms a frame) so the honest subscriber is reading while the
                # hostile one is being woken: unpaced, 300 frames can go out before it reads one.
                time.sleep(0.002)
            done.set()

        t = threading.Thread(target=publish, daemon=True)
        t.start()
        got = 0
        deadline = time.monotonic() + 20
        # Reads until publishing is over and what it left in the backlog is drained.
        while time.monotonic() < deadline:
            try:
                frame = honest.next_frame(timeout=0.2)
            except gpushm.Timeout:
                if done.is_set():
                    break
                continue
            pixels = np.asarray(frame)
            assert (pixels == pixels.flat[0]).all(), "a frame mixed two publishes"
            frame.release()
            got += 1
        assert done.is_set(), f"publish() blocked after the honest subscriber got {got} frames"
        assert got >= 10, f"the honest subscriber got only {got} of 300 frames"
        honest.close()
        block.close()
        for fd in (memfd, ready, release):
            os.close(fd)
        s.close()


# The attacked subscriber runs in its own interpreter: if it blocks (with the GIL held, as
# dropping a frame once could), the test fails on its timeout instead of hanging pytest.
ATTACKED_SUBSCRIBER = r"""
import sys, time
import numpy
import gpushm

sub = gpushm.Subscriber(sys.argv[1])
got = 0
deadline = time.monotonic() + 20
while got < 10 and time.monotonic() < deadline:
    try:
        f = sub.next_frame(timeout=1.0)
    except gpushm.Timeout:
        continue
    assert (f.numpy() == got).all(), (got, f.numpy().ravel()[0])
    got += 1
    # The producer asked to be woken by each release: a send on a full, blocking descriptor.
    f.release()
print("frames", got, flush=True)
# Nothing is published any more: the wait ends on its timeout.
t = time.monotonic()
try:
    sub.next_frame(timeout=0.3)
    print("a frame?", flush=True)
except gpushm.Timeout:
    print("timed out after", round(time.monotonic() - t, 2), flush=True)
sub.close()
"""


def test_a_producer_cannot_block_the_python_subscriber_through_its_wake_up_descriptors(sock):
    """A fake producer (tests/helpers/fake_producer.rs) that makes the wake-up descriptors it
    sent blocking, fills the one the subscriber rings, asks to be woken after every release
    and never reads cannot block Subscriber.next_frame() or a frame's release: the subscriber
    gets the 10 frames in order, and a wait with nothing published ends on its timeout."""
    import subprocess
    import sys

    from conftest import example

    fake = subprocess.Popen(
        [example("fake_producer"), "--socket", sock, "--frames", "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(sock):
            assert time.monotonic() < deadline and fake.poll() is None, fake.stderr.read()
            time.sleep(0.01)
        child = subprocess.Popen(
            [sys.executable, "-c", ATTACKED_SUBSCRIBER, sock],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = child.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
            raise AssertionError(f"the subscriber blocked; it said {out!r} {err!r}")
        assert child.returncode == 0, err
        assert "frames 10" in out, (out, err)
        assert "timed out after" in out, (out, err)
    finally:
        fake.kill()
        fake.wait()


def test_hoarders_taking_turns_cannot_set_the_pace_of_the_python_publisher(sock):
    """Issue 48, on the Python publisher: three raw clients (tests/helpers/hoarders.rs) keep
    at most 3 frames each, together a whole 8-slot ring, and take turns giving one back every
    400 ms (leaky, then lossless). publish() used to block at their pace (up to 405 ms a
    frame) and a lossless subscriber that keeps up got 2.7 fps. Now no client gets more than
    its share and the publisher's wait for a slot times a cut: the subscriber gets the
    stream's rate. (Asserted with margins a busy machine cannot reach; the figures are
    printed: on an idle machine, at least 20 fps, no gap or publish() over 300 ms.)"""
    from conftest import example
    import subprocess

    for mode in ("leaky", "lossless"):
        with gpushm.Publisher(sock, "GRAY8", 64, 48, fps=30, slots=8) as pub:
            victim = gpushm.Subscriber(sock, mode="lossless")
            hoarders = subprocess.Popen(
                [example("hoarders"), "--socket", sock, "--seconds", "12"]
                + (["--lossless"] if mode == "lossless" else []),
                stdout=subprocess.PIPE,
                text=True,
            )
            assert hoarders.stdout.readline().startswith("CONNECTED 3")
            stop = threading.Event()
            longest_publish = [0.0]

            def publish():
                v, t0 = 0, time.monotonic()
                while not stop.is_set():
                    start = time.monotonic()
                    pub.publish(np.full((48, 64), v % 256, dtype=np.uint8))
                    longest_publish[0] = max(longest_publish[0], time.monotonic() - start)
                    v += 1
                    time.sleep(max(0.0, t0 + v / 30 - time.monotonic()))

            t = threading.Thread(target=publish, daemon=True)
            t.start()
            arrivals = []
            end = time.monotonic() + 12
            while time.monotonic() < end:
                try:
                    frame = victim.next_frame(timeout=0.5)
                except gpushm.Timeout:
                    continue
                arrivals.append(time.monotonic())
                frame.release()
            stop.set()
            t.join(timeout=10)
            out, _ = hoarders.communicate(timeout=20)
            victim.close()
            fps = len(arrivals) / 12
            gap = max(b - a for a, b in zip(arrivals, arrivals[1:]))
            print(
                f"{mode} relay: {out.strip()}; the subscriber got {fps:.1f} fps, longest gap "
                f"{gap * 1000:.0f} ms; longest publish() {longest_publish[0] * 1000:.0f} ms"
            )
            assert fps >= 15, f"{mode} relay: the subscriber got {fps:.1f} fps (the stream has 30)"
            assert gap < 1.0, f"{mode} relay: a gap of {gap * 1000:.0f} ms"
            assert longest_publish[0] < 1.0, f"{mode} relay: publish() took {longest_publish[0]:.2f} s"
