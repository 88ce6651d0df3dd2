#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# gpushm beside GStreamer's own GPU transport (cudaipcsink/cudaipcsrc, GStreamer 1.24+), same
# run: an H.264 file decoded by NVDEC at its 30 fps (identity sync=true) and shared with 3
# consumer processes that take the frames in CUDA memory, started right after the producer.
# Needs nvcodec (nvh264dec, cudaipcsink), x264enc, nvidia-smi and the gpushm plugin; on the GPU
# machine under GStreamer 1.26 (../shared/tools/gst126):
#   GST_LAUNCH=.gst126/gst-launch GST_INSPECT=.gst126/gst-inspect \
#     GST_PLUGIN_PATH=DIR-WITH-libgstgpushm.so scripts/bench-cuda-ipc.sh
#   scripts/bench-cuda-ipc.sh [WIDTH HEIGHT FRAMES]
# BENCH_ONLY=TEXT runs only the rows whose name contains TEXT.
# BENCH_LOGS=DIR keeps every process's output there (DIR/N.p.log, DIR/N.c1.log, ...: N the
# row's number among those run).
# Prints a row per transport: frames each consumer got, the CPU seconds of the producer and
# of each consumer (bash's `times`: user + system), and the GPU memory in use on the device
# (nvidia-smi), its peak over the run minus what was in use before it.
set -euo pipefail
w=${1:-3840}; h=${2:-2160}; n=${3:-300}
launch=${GST_LAUNCH:-gst-launch-1.0}; inspect=${GST_INSPECT:-gst-inspect-1.0}
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
file=$dir/in.h264
$launch -q videotestsrc num-buffers="$n" pattern=ball \
  ! "video/x-raw,format=I420,width=$w,height=$h,framerate=30/1" \
  ! x264enc speed-preset=ultrafast tune=zerolatency key-int-max=30 \
  ! h264parse ! video/x-h264,stream-format=byte-stream,alignment=au ! filesink location="$file"
gpu_mib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
# Runs "$@" in a subshell and writes its user + system CPU seconds to file $1.
timed() { local out=$1; shift; ( "$@" > "$out.log" 2>&1 || true; times > "$out.t"; tail -1 "$out.t" | awk '{
  split($1, u, /[ms]/); split($2, s, /[ms]/); printf "%.2f\n", u[1]*60 + u[2] + s[1]*60 + s[2] }' > "$out" ); }

# $1: name; $2: the producer's sink; $3: a consumer's source (SOCK: the socket's path);
# $4: what the consumer does with the frames.
chain() {
  local name=$1 sock=$dir/s.$RANDOM pids=() base peak=0 m
  [[ -z ${BENCH_ONLY:-} || $name == *"$BENCH_ONLY"* ]] || return 0
  base=$(gpu_mib)
  timed "$dir/p" $launch filesrc location="$file" ! h264parse ! nvh264dec ! identity sync=true \
    ! ${2//SOCK/$sock} &
  local prod=$!
  for _ in $(seq 500); do [ -S "$sock" ] && break; sleep 0.01; done
  for i in 1 2 3; do
    timed "$dir/c$i" $launch -v ${3//SOCK/$sock} ! $4 ! fakesink silent=false sync=false &
    pids+=($!)
  done
  while kill -0 "$prod" 2>/dev/null; do
    m=$(gpu_mib); [ "$m" -gt "$peak" ] && peak=$m; sleep 0.2
  done
  sleep 2
  pkill -INT -f "gst-launch-1.0.*$sock" 2>/dev/null || true
  for p in "${pids[@]}"; do wait "$p" || true; done
  local frames="" cpu=""
  for i in 1 2 3; do
    frames+="$(grep -c 'last-message = chain' "$dir/c$i.log" || true) "
    cpu+="$(cat "$dir/c$i") "
  done
  if [ -n "${BENCH_LOGS:-}" ]; then
    mkdir -p "$BENCH_LOGS"; row=$((${row:-0} + 1))
    for f in p c1 c2 c3; do cp "$dir/$f.log" "$BENCH_LOGS/$row.$f.log"; done
  fi
  echo "$name | frames ${frames% } of $n | producer CPU $(cat "$dir/p") s | consumer CPU ${cpu% } s | GPU memory +$((peak - base)) MiB"
}

$launch -q filesrc location="$file" ! h264parse ! nvh264dec ! fakesink >/dev/null 2>&1 || true  # warm-up
echo "== ${w}x$h, $n frames at 30 fps, 3 consumers, $($launch --version | sed -n 2p)"
if $inspect cudaipcsink >/dev/null 2>&1; then
  chain "cudaipcsink ipc-mode=legacy -> cudaipcsrc" "cudaipcsink ipc-mode=legacy address=SOCK" \
    "cudaipcsrc address=SOCK" "video/x-raw(memory:CUDAMemory)"
  chain "cudaipcsink ipc-mode=mmap -> cudaipcsrc" "cudaipcsink ipc-mode=mmap address=SOCK" \
    "cudaipcsrc address=SOCK" "video/x-raw(memory:CUDAMemory)"
else
  echo "(no cudaipcsink here: GStreamer 1.24+ with nvcodec has it)"
fi
chain "gpushmsink -> gpushmsrc, CUDA memory" "gpushmsink socket-path=SOCK wait-for-connection=true wait-for-clients=3" \
  "gpushmsrc socket-path=SOCK mode=lossless" "video/x-raw(memory:CUDAMemory)"
# Without wait-for-connection the producer starts at once: the frames a consumer misses are
# the time it took to join (frames missed / 30 = seconds after the stream's start).
chain "gpushmsink (no wait-for-connection) -> gpushmsrc, CUDA memory" "gpushmsink socket-path=SOCK" \
  "gpushmsrc socket-path=SOCK" "video/x-raw(memory:CUDAMemory)"
chain "gpushmsink -> gpushmsrc ! cudasum (in place)" "gpushmsink socket-path=SOCK wait-for-connection=true wait-for-clients=3" \
  "gpushmsrc socket-path=SOCK mode=lossless" "cudasum"
