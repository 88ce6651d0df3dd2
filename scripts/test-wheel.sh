#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# The Python wheel as a user without Rust installs it: `make wheel` builds one abi3 wheel
# (target/wheels/), then this installs it into a fresh venv whose processes see no cargo,
# rustc or C compiler (PATH holds only the venv), and a publisher process sends frames that a
# subscriber process reads back, byte for byte.
#
#   scripts/test-wheel.sh [WHEEL]     # default: the newest target/wheels/gpushm-*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=${1:-$(ls -t "${CARGO_TARGET_DIR:-target}"/wheels/gpushm-*abi3*.whl | head -1)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
# numpy from the package index (the wheel's one dependency), before PATH is cut.
"$work/venv/bin/pip" install -q numpy
PATH=$work/venv/bin "$work/venv/bin/pip" install -q --no-index --no-deps "$wheel"
for tool in cargo rustc cc gcc; do
  if PATH=$work/venv/bin command -v "$tool" >/dev/null; then echo "$tool is reachable"; exit 1; fi
done
PATH=$work/venv/bin "$work/venv/bin/python" - "$work/cam.sock" <<'PY'
import hashlib, subprocess, sys, time
import numpy as np
import gpushm

sock = sys.argv[1]
reader = r'''
import hashlib, sys, gpushm
with gpushm.Subscriber(sys.argv[1], lossless=True, timeout=20) as sub:
    for n, frame in enumerate(sub):
        print(hashlib.sha1(frame.planes[0].tobytes()).hexdigest(), flush=True)
        if n == 9:
            break
'''
with gpushm.Publisher(sock, "GRAY8", 64, 48, fps=30) as pub:
    sub = subprocess.Popen([sys.executable, "-c", reader, sock], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while pub.num_clients == 0:
        assert time.monotonic() < deadline, "the subscriber never connected"
        time.sleep(0.01)
    # In lockstep: each frame is read back before the next goes out.
    sent, got = [], []
    for i in range(10):
        data = np.full(64 * 48, i * 7 % 256, dtype=np.uint8)
        pub.publish(data)
        sent.append(hashlib.sha1(data.tobytes()).hexdigest())
        got.append(sub.stdout.readline().strip())
    sub.wait(timeout=30)
assert sub.returncode == 0 and got == sent, (sub.returncode, got, sent)
print(f"wheel: {len(got)} frames read back byte for byte in a venv without Rust or a compiler")
PY
