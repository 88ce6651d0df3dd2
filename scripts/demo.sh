#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# Two processes share 1080p60 NV12 live video through gpushm: a gst-launch-1.0 producer
# (videotestsrc ! gpushmsink) and a consumer app (gpushmsrc ! appsink, tests/helpers/frame_checker.rs)
# that prints the delivered frame rate and the cross-process latency. The consumer runs cudasum
# (backend=auto): on a machine with an NVIDIA GPU it sums every frame on the GPU, reading it in
# place from the shared ring, and checks each sum against the CPU; without a GPU it says so and
# sums on the CPU.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
target="${CARGO_TARGET_DIR:-$here/target}"
checker="$target/release/examples/frame_checker"
[ -x "$checker" ] || checker=$(command -v frame_checker)
frames=${DEMO_FRAMES:-600}
sock="${XDG_RUNTIME_DIR:-/tmp}/gpushm-demo-$$.sock"
export GST_PLUGIN_PATH="${GST_PLUGIN_PATH:-$target/release}"

cleanup() { [ -n "${producer:-}" ] && kill "$producer" 2>/dev/null; rm -f "$sock"; }
trap cleanup EXIT

echo "== producer: videotestsrc is-live=true ! 1920x1080 NV12 @ 60 fps ! gpushmsink socket-path=$sock"
gst-launch-1.0 -q videotestsrc is-live=true num-buffers="$frames" \
  ! video/x-raw,format=NV12,width=1920,height=1080,framerate=60/1 \
  ! gpushmsink socket-path="$sock" wait-for-connection=true &
producer=$!
for _ in $(seq 200); do [ -S "$sock" ] && break; sleep 0.05; done

echo "== consumer: gpushmsrc socket-path=$sock ! cudasum ! appsink (no caps given)"
# Its exit status says whether every frame arrived and checked out; the result is shown either
# way (a busy machine may drop frames of this live stream).
status=0
out=$("$checker" --socket "$sock" --expect "$frames" --cudasum auto) || status=$?
echo "$out" | sed -n 's/^CAPS /   caps from the producer: /p'
summary=$(echo "$out" | grep '^SUMMARY' || true)
get() { echo "$summary" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
wait "$producer" || true  # its own error, if any, is on the terminal already
producer=""
echo "== result"
echo "   frames delivered:  $(get frames) of $frames (dropped: $(get dropped))"
echo "   delivered rate:    $(get fps) fps (producer: 60 fps)"
echo "   latency publish->arrival: p50 $(get latency_p50_us) us, p99 $(get latency_p99_us) us, max $(get latency_max_us) us"
cuda=$(echo "$out" | grep '^CUDASTATS' || true)
cget() { echo "$cuda" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
if [ "$(cget device)" = "none" ]; then
  echo "   GPU: none found (no CUDA driver); cudasum summed the frames on the CPU instead"
else
  echo "   GPU: $(cget device | tr _ ' '): cudasum read $(cget zero_copy) frames in place from the ring"
  echo "        ($(cget staged) copied), $(cget gbps_p50) GB/s median per frame, sums equal to the CPU's: $(cget checked) checked, $(cget mismatches) mismatches"
  echo "        cuMemHostRegister calls in the consumer: $(cget host_registrations) (one per ring, none per frame)"
fi
if [ "$status" -ne 0 ]; then
  echo "== the frame checker reported a problem (exit $status):"
  echo "$out" | grep -E '^(WARNING|ERROR)' | head -5 | sed 's/^/   /'
  exit "$status"
fi
