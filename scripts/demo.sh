#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# Two processes share 1080p60 NV12 live video through gpushm: a gst-launch-1.0 producer
# (videotestsrc ! gpushmsink) and a consumer app (gpushmsrc ! appsink, examples/frame_checker)
# that prints the delivered frame rate and the cross-process latency.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
checker="$here/target/release/examples/frame_checker"
frames=${DEMO_FRAMES:-600}
sock="${XDG_RUNTIME_DIR:-/tmp}/gpushm-demo-$$.sock"
export GST_PLUGIN_PATH="${GST_PLUGIN_PATH:-$here/target/release}"

cleanup() { [ -n "${producer:-}" ] && kill "$producer" 2>/dev/null; rm -f "$sock"; }
trap cleanup EXIT

echo "== producer: videotestsrc is-live=true ! 1920x1080 NV12 @ 60 fps ! gpushmsink socket-path=$sock"
gst-launch-1.0 -q videotestsrc is-live=true num-buffers="$frames" \
  ! video/x-raw,format=NV12,width=1920,height=1080,framerate=60/1 \
  ! gpushmsink socket-path="$sock" wait-for-connection=true &
producer=$!
for _ in $(seq 200); do [ -S "$sock" ] && break; sleep 0.05; done

echo "== consumer: gpushmsrc socket-path=$sock ! appsink (no caps given)"
out=$("$checker" --socket "$sock" --expect "$frames")
echo "$out" | sed -n 's/^CAPS /   caps from the producer: /p'
summary=$(echo "$out" | grep '^SUMMARY')
get() { echo "$summary" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
wait "$producer"
producer=""
echo "== result"
echo "   frames delivered:  $(get frames) of $frames (dropped: $(get dropped))"
echo "   delivered rate:    $(get fps) fps (producer: 60 fps)"
echo "   latency publish->arrival: p50 $(get latency_p50_us) us, p99 $(get latency_p99_us) us, max $(get latency_max_us) us"
echo "   GPU: the CUDA path (cudasum) is not in this build yet; this demo runs on the CPU."
