#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# The decode chain of issue 28 on a discrete GPU: an H.264 file decoded by NVDEC and shared
# with 3 consumers, against decoding in one process, same run. Needs nvcodec (nvh264dec,
# cudadownload, cudaupload), x264enc and the gpushm plugin (on the GPU machine: . .device/env.sh).
#   scripts/bench-decode-chain.sh [WIDTH HEIGHT FRAMES]
# Prints, for each case, the producer's wall time (startup included), frames per second over
# it, and the CPU time of every process of the chain per frame:
#   one process:  filesrc ! h264parse ! nvh264dec ! fakesink
#   device ring, CUDA memory out: nvh264dec ! gpushmsink (ring=auto: GPU memory)
#                 -> 3 x gpushmsrc ! video/x-raw(memory:CUDAMemory) ! fakesink
#                 (each consumer ends with the frame in its own CUDA memory, as cudaupload's)
#   device ring, read in place: the same -> 3 x gpushmsrc ! cudasum ! fakesink
#   host ring:    nvh264dec ! cudadownload ! video/x-raw ! gpushmsink ring=host
#                 -> 3 x gpushmsrc ! cudaupload ! fakesink
# The CPU times come from bash's `times` (each process's own user + system time).
set -euo pipefail
w=${1:-3840}; h=${2:-2160}; n=${3:-300}
# GST_LAUNCH: another gst-launch, e.g. a GStreamer 1.26 bundle's (../shared/tools/gst126).
launch=${GST_LAUNCH:-gst-launch-1.0}
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
file=$dir/in.h264
$launch -q videotestsrc num-buffers="$n" pattern=ball \
  ! "video/x-raw,format=I420,width=$w,height=$h,framerate=30/1" \
  ! x264enc speed-preset=ultrafast tune=zerolatency key-int-max=30 \
  ! h264parse ! video/x-h264,stream-format=byte-stream,alignment=au ! filesink location="$file"
now() { date +%s.%N; }
secs() { echo "$1 $2" | awk '{printf "%.2f", $2 - $1}'; }
# Runs "$@" and appends its user + system CPU seconds to $cpu_log.
timed() { ( "$@"; local_t=$cpu_log.$BASHPID; times > "$local_t"; tail -1 "$local_t" | awk '{
  split($1, u, /[ms]/); split($2, s, /[ms]/); printf "%.3f\n", u[1]*60 + u[2] + s[1]*60 + s[2] }' >> "$cpu_log" ); }
report() { # $1: name, $2: start, $3: end, $4: consumers
  local t; t=$(secs "$2" "$3")
  local cpu; cpu=$(awk '{c += $1} END {printf "%.2f", c}' "$cpu_log")
  echo "$1: decode $n frames ${w}x$h, $4 consumers: $t s, $(echo "$n $t" | awk '{printf "%.0f", $1 / $2}') fps (producer wall); CPU $(echo "$cpu $n" | awk '{printf "%.2f", $1 * 1000 / $2}') ms per frame, all processes"
}

cpu_log=$dir/cpu.one; : > "$cpu_log"
t0=$(now)
timed $launch -q filesrc location="$file" ! h264parse ! nvh264dec ! fakesink sync=false
report "one process" "$t0" "$(now)" 0

chain() { # $1: producer tail, $2: consumer tail, $3: name, $4: socket name
  local sock=$dir/$4.sock pids=()
  cpu_log=$dir/cpu.$4; : > "$cpu_log"
  t0=$(now)
  timed $launch -q filesrc location="$file" ! h264parse ! nvh264dec ! $1 \
    socket-path="$sock" wait-for-connection=true sync=false &
  local prod=$!
  while [ ! -S "$sock" ]; do sleep 0.01; done
  for i in 1 2 3; do
    timed $launch -q gpushmsrc socket-path="$sock" mode=lossless num-buffers="$n" ! $2 &
    pids+=($!)
  done
  wait "$prod"
  local end; end=$(now)
  for p in "${pids[@]}"; do wait "$p" || true; done
  report "$3" "$t0" "$end" 3
}
chain "gpushmsink" "video/x-raw(memory:CUDAMemory) ! fakesink sync=false" "device ring, CUDA memory out" dev
chain "gpushmsink" "cudasum ! fakesink sync=false" "device ring, cudasum in place" devsum
chain "cudadownload ! video/x-raw ! gpushmsink ring=host" "cudaupload ! fakesink sync=false" "host ring" host
