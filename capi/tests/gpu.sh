#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# The C API on the GPU machine (packed by scripts/device-pack.sh into .device/capi/): a frame's
# CUDA device pointer from a host ring (a gst-launch producer) and from a device ring (the
# device_ring tool).  On that machine: bash .device/capi/gpu.sh
set -u
here=$(cd "$(dirname "$0")/.." && pwd); . "$here/env.sh"
d=$(mktemp -d)
gst-launch-1.0 -q videotestsrc num-buffers=100 pattern=ball ! video/x-raw,format=NV12,width=320,height=240,framerate=30/1 ! gpushmsink socket-path=$d/h.sock wait-for-connection=true &
p1=$!
for _ in $(seq 500); do [ -S $d/h.sock ] && break; sleep 0.02; done
"$here/capi/capi_test" cuda $d/h.sock; r1=$?
kill $p1 2>/dev/null; wait $p1 2>/dev/null
"$here/examples/device_ring" produce --socket $d/d.sock --frames 20 > $d/p.log 2>&1 &
p2=$!
for _ in $(seq 500); do grep -q READY $d/p.log && break; sleep 0.02; done
"$here/capi/capi_test" cuda $d/d.sock device; r2=$?
kill $p2 2>/dev/null; wait $p2 2>/dev/null
rm -rf "$d"
echo "capi gpu: host ring rc=$r1, device ring rc=$r2"
exit $((r1 | r2))
