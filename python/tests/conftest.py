# SPDX-License-Identifier: MPL-2.0
"""Helpers: the plugin built by cargo (GST_PLUGIN_PATH), producer and consumer processes."""

import os
import pathlib
import subprocess
import tempfile
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def plugin_dir():
    """Where libgstgpushm.so is: GPUSHM_PLUGIN_DIR, else the cargo target folder; None when
    the GStreamer runtime packed for the GPU machine (.device/env.sh) already has it."""
    if os.environ.get("GPUSHM_PLUGIN_DIR"):
        return os.environ["GPUSHM_PLUGIN_DIR"]
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    for profile in ("debug", "release"):
        if (target / profile / "libgstgpushm.so").exists():
            return str(target / profile)
    if os.environ.get("GST_PLUGIN_SYSTEM_PATH"):
        return None
    pytest.fail("libgstgpushm.so not found: run `cargo build` first (make test does)")


def example(name: str) -> str:
    """A test tool built as a cargo example (tests/helpers/NAME.rs): in the cargo target
    folder, or in the bundle packed for the GPU machine (.device/examples)."""
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    for d in (target / "debug" / "examples", target / "release" / "examples", REPO / ".device" / "examples"):
        if (d / name).exists():
            return str(d / name)
    pytest.fail(f"{name} not found: run `cargo build --release --examples` first (make test does)")


def gst_env() -> dict:
    env = dict(os.environ)
    d = plugin_dir()
    if d:
        env["GST_PLUGIN_PATH"] = d
    return env


class Launch:
    """A gst-launch-1.0 process, killed when the test ends."""

    def __init__(self, pipeline: str):
        self.p = subprocess.Popen(
            ["gst-launch-1.0", "-q", *pipeline.split()],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=gst_env(),
        )

    def finish(self, timeout: float = 30) -> str:
        out, _ = self.p.communicate(timeout=timeout)
        assert self.p.returncode == 0, out
        return out

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.communicate()


@pytest.fixture
def launch():
    procs = []

    def start(pipeline: str) -> Launch:
        l = Launch(pipeline)
        procs.append(l)
        return l

    yield start
    for l in procs:
        l.kill()


@pytest.fixture
def sock():
    with tempfile.TemporaryDirectory() as d:
        yield os.path.join(d, "cam.sock")


def wait_for(path: str, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def wait_for_client(pub, who: str = "the subscriber", timeout: float = 10):
    """Waits until `pub` (a gpushm.Publisher) has a consumer."""
    deadline = time.monotonic() + timeout
    while pub.num_clients == 0:
        assert time.monotonic() < deadline, f"{who} never connected"
        time.sleep(0.01)


def checksums(out: str) -> list:
    """The sha1 of each buffer, from checksumsink's output."""
    return [l.split()[1] for l in out.splitlines() if len(l.split()) == 2 and len(l.split()[1]) == 40]
