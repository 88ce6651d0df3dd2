# SPDX-License-Identifier: MPL-2.0
"""Benchmark: live frames into a torchvision model on the GPU, gpushm zero-copy against the
usual copy path.

For each size, a gst-launch-1.0 producer (videotestsrc ! RGBA ! gpushmsink) runs in another
process, and this process feeds every frame it gets to resnet18 (random weights) on a 224×224
resize, all on the GPU:
- zero-copy: torch.from_dlpack(frame), the ring's registered memory read in place by the GPU;
- copy: what an appsink app does, the frame copied into a NumPy array, then
  torch.from_numpy(array).cuda();
- device ring: the producer keeps its ring in GPU memory (gpushmsink ring=device after
  cudaupload, or a Publisher with cuda_device=0), this process subscribes with
  device_memory=True and torch.from_dlpack(frame) aliases the frame in GPU memory.

Two runs per size and path: live at 30 fps (latency from the producer's publish to the model's
output, CPU time of this process per frame) and flat out: a Python gpushm.Publisher in another
process republishes eight pre-rendered frames as fast as it can, so the producer is not the
bottleneck, and the table shows the frames per second this consumer sustains (a leaky
subscriber skips what it cannot take). CPU time includes torch.cuda.synchronize(), which
spins while the GPU works.

    GST_PLUGIN_PATH=target/release python3 python/bench/torch_model.py [--frames 150]

Prints a Markdown table.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
import torchvision

import gpushm

SIZES = {"1080p": (1920, 1080), "4K": (3840, 2160)}


def publish_flat_out(sock, w, h, device):
    """Run in a child process: republish 8 pre-rendered frames forever (from CUDA tensors,
    one device-to-device copy each, into a device ring when `device`)."""
    if device:
        pub = gpushm.Publisher(sock, "RGBA", w, h, fps=1000, slots=8, cuda_device=0)
        g = torch.Generator(device="cuda").manual_seed(0)
        frames = [
            torch.randint(0, 256, (h, w, 4), dtype=torch.uint8, device="cuda", generator=g)
            for _ in range(8)
        ]
        n = 0
        while True:
            try:
                pub.publish(frames[n % 8], timeout=5)
            except (gpushm.Error, gpushm.Timeout):
                continue
            n += 1
    pub = gpushm.Publisher(sock, "RGBA", w, h, fps=1000, slots=8)
    n = 0
    while True:
        try:
            slot = pub.acquire(timeout=5)
        except (gpushm.Error, gpushm.Timeout):
            continue
        if n < 8:  # render once per slot; later frames reuse what the slot holds
            plane = slot.planes[0]
            plane[...] = np.random.default_rng(n).integers(0, 256, plane.shape, dtype=np.uint8)
            del plane  # no view may outlive the slot's publication
        pub.publish(slot)
        n += 1


def producer(sock, w, h, live, device):
    if not live:
        return subprocess.Popen(
            [sys.executable, __file__, "--publish", sock, str(w), str(h), str(int(device))],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    caps = f"video/x-raw,format=RGBA,width={w},height={h},framerate=30/1"
    src = f"videotestsrc is-live={'true' if live else 'false'} pattern=ball"
    upload = "! cudaupload ! video/x-raw(memory:CUDAMemory) " if device else ""
    ring = "device" if device else "host"
    return subprocess.Popen(
        ["gst-launch-1.0", "-q", *f"{src} ! {caps} {upload}! gpushmsink ring={ring} socket-path={sock} slots=8 sync={'true' if live else 'false'}".split()],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def run(model, w, h, path, live, frames):
    with tempfile.TemporaryDirectory() as d:
        sock = os.path.join(d, "cam.sock")
        device = path == "device ring"
        p = producer(sock, w, h, live, device)
        try:
            # The flat-out publisher imports torch before it listens: allow it that.
            with gpushm.Subscriber(sock, timeout=60, device_memory=device) as sub:
                for _ in range(10):  # warm-up: CUDA, cuDNN, registration
                    infer(model, sub.next_frame(), path)
                torch.cuda.synchronize()
                lat = []
                cpu0, t0 = time.process_time(), time.monotonic()
                for _ in range(frames):
                    f = sub.next_frame()
                    infer(model, f, path)
                    torch.cuda.synchronize()
                    lat.append((time.monotonic_ns() - f.publish_time_ns) / 1e6)
                    f.release()
                wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        finally:
            p.kill()
            p.wait()
    return {
        "fps": frames / wall,
        "cpu_ms": cpu / frames * 1e3,
        "p50": statistics.median(lat),
        "p99": float(np.percentile(lat, 99)),
    }


@torch.no_grad()
def infer(model, frame, path):
    if path in ("zero-copy", "device ring"):
        x = torch.from_dlpack(frame)
    else:
        x = torch.from_numpy(np.array(frame.numpy())).cuda()
    x = x[..., :3].permute(2, 0, 1)[None].float().div_(255)
    x = F.interpolate(x, size=(224, 224), mode="bilinear", align_corners=False)
    return model(x).argmax()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=150)
    ap.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: " + ", ".join(SIZES))
    ap.add_argument("--publish", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.publish:
        sock, w, h, device = a.publish
        return publish_flat_out(sock, int(w), int(h), device == "1")
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet18(weights=None).cuda().eval()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} CPUs, {a.frames} frames per run")
    print()
    print("| size | path | live 30 fps: latency p50 / p99 (ms) | CPU per frame (ms) | flat out: fps | CPU per frame (ms) |")
    print("|---|---|---|---|---|---|")
    for name in a.sizes.split(","):
        w, h = SIZES[name]
        for path in ("device ring", "zero-copy", "copy"):
            live = run(model, w, h, path, True, a.frames)
            flat = run(model, w, h, path, False, a.frames)
            print(
                f"| {name} | {path} | {live['p50']:.2f} / {live['p99']:.2f} | {live['cpu_ms']:.2f} "
                f"| {flat['fps']:.0f} | {flat['cpu_ms']:.2f} |",
                flush=True,
            )
    print(f"\ncuMemHostRegister calls in this process: {gpushm.cuda_registrations()} (one per ring)")


if __name__ == "__main__":
    main()
