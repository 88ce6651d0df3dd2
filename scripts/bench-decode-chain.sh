#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# The decode chain of issue 28 on a discrete GPU: an H.264 file decoded by NVDEC and shared
# with 3 consumers, against decoding in one process, same run. Needs nvcodec (nvh264dec,
# cudadownload, cudaupload), x264enc and the gpushm plugin (on the GPU machine: . .device/env.sh).
#   scripts/bench-decode-chain.sh [WIDTH HEIGHT FRAMES]
# Prints the producer's wall time for each case (startup included):
#   one process:  filesrc ! h264parse ! nvh264dec ! fakesink
#   device ring:  nvh264dec ! gpushmsink (ring=auto: GPU memory) -> 3 x gpushmsrc ! fakesink
#   host ring:    nvh264dec ! cudadownload ! video/x-raw ! gpushmsink ring=host
#                 -> 3 x gpushmsrc ! cudaupload ! fakesink
set -euo pipefail
w=${1:-3840}; h=${2:-2160}; n=${3:-300}
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
file=$dir/in.h264
gst-launch-1.0 -q videotestsrc num-buffers="$n" pattern=ball \
  ! "video/x-raw,format=I420,width=$w,height=$h,framerate=30/1" \
  ! x264enc speed-preset=ultrafast tune=zerolatency key-int-max=30 \
  ! h264parse ! video/x-h264,stream-format=byte-stream,alignment=au ! filesink location="$file"
now() { date +%s.%N; }
secs() { echo "$1 $2" | awk '{printf "%.2f", $2 - $1}'; }

t0=$(now)
gst-launch-1.0 -q filesrc location="$file" ! h264parse ! nvh264dec ! fakesink sync=false
echo "one process: decode $n frames ${w}x$h: $(secs "$t0" "$(now)") s"

chain() { # $1: producer tail, $2: consumer tail, $3: name, $4: socket name
  local sock=$dir/$4.sock pids=()
  t0=$(now)
  gst-launch-1.0 -q filesrc location="$file" ! h264parse ! nvh264dec ! $1 \
    socket-path="$sock" wait-for-connection=true sync=false &
  local prod=$!
  while [ ! -S "$sock" ]; do sleep 0.01; done
  for i in 1 2 3; do
    gst-launch-1.0 -q gpushmsrc socket-path="$sock" mode=lossless num-buffers="$n" ! $2 &
    pids+=($!)
  done
  wait "$prod"
  local t=$(secs "$t0" "$(now)")
  for p in "${pids[@]}"; do wait "$p" || true; done
  echo "$3: decode $n frames ${w}x$h, 3 consumers: $t s (producer wall)"
}
chain "gpushmsink" "fakesink sync=false" "device ring" dev
chain "cudadownload ! video/x-raw ! gpushmsink ring=host" "cudaupload ! fakesink sync=false" "host ring" host
