#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# Soak test (not in CI): one producer, and 3 consumers that join and leave at random for
# SECONDS (default 600). Consumers are lossless or leaky at random and leave by kill -9 or
# SIGTERM at random; every frame each one receives is checked byte for byte. At the end it
# prints the frames checked, bad frames, joins, and the producer's fds and RSS at the start
# and the end.
#   scripts/soak.sh [SECONDS]        (uses target/release; run `make build` first)
set -euo pipefail
secs=${1:-600}
here=$(cd "$(dirname "$0")/.." && pwd)
bin="$here/target/release/examples"
[ -x "$bin/frame_checker" ] || { echo "build first: make build" >&2; exit 2; }
export GST_PLUGIN_PATH="${GST_PLUGIN_PATH:-$here/target/release}"
work=$(mktemp -d /tmp/gpushm-soak.XXXXXX)
sock="$work/soak.sock"
shm_before=$(ls /dev/shm | sort)
"$bin/pattern_producer" --socket "$sock" --frames 0 --fps 60 --width 640 --height 480 --format I420 > "$work/producer.log" 2>&1 &
producer=$!
cleanup() { kill -9 "$producer" $(jobs -p) 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 200); do [ -S "$sock" ] && break; sleep 0.05; done
stats() { echo "$(ls /proc/"$1"/fd | wc -l) $(awk '/VmRSS/ {print $2}' /proc/"$1"/status)"; }
# Baseline: the producer running, no consumer connected (as at the end).
sleep 1
read -r fd0 rss0 < <(stats "$producer")
declare -a pids=() logs=()
joins=0
start_consumer() {
  local log="$work/consumer-$joins.log" mode=""
  : > "$log"
  [ $((RANDOM % 2)) -eq 0 ] && mode="--lossless"
  "$bin/frame_checker" --socket "$sock" --verify --print --no-reconnect $mode > "$log" 2>&1 &
  pids+=($!); logs+=("$log"); joins=$((joins + 1))
}
for _ in 1 2 3; do start_consumer; done
end=$((SECONDS + secs))
kills=0 terms=0
while [ $SECONDS -lt $end ]; do
  sleep "0.$((RANDOM % 9 + 1))"
  i=$((RANDOM % 3))
  live=()
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && live+=("$p"); done
  if [ ${#live[@]} -gt 0 ]; then
    victim=${live[$((i % ${#live[@]}))]}
    if [ $((RANDOM % 2)) -eq 0 ]; then kill -9 "$victim"; kills=$((kills + 1)); else kill -TERM "$victim"; terms=$((terms + 1)); fi
    wait "$victim" 2>/dev/null || true
  fi
  alive=0
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=$((alive + 1)); done
  while [ $alive -lt 3 ]; do start_consumer; alive=$((alive + 1)); done
  kill -0 "$producer" 2>/dev/null || { echo "the producer died" >&2; exit 1; }
done
# Let the last consumers go, then measure the producer with no client connected.
for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
wait "${pids[@]}" 2>/dev/null || true
sleep 1
read -r fd1 rss1 < <(stats "$producer")
kill -9 "$producer"; wait "$producer" 2>/dev/null || true
checked=$(cat "${logs[@]}" | grep -c '^FRAME .* ok=true' || true)
bad=$(cat "${logs[@]}" | grep -c '^FRAME .* ok=false' || true)
sent=$(grep -c '^CONNECTED' "$work/producer.log" || true)
gone=$(grep -c '^DISCONNECTED' "$work/producer.log" || true)
shm_after=$(ls /dev/shm | sort)
echo "soak: ${secs}s, 640x480 I420 @ 60 fps, 3 consumers at a time"
echo "  consumers started: $joins (producer saw $sent connect, $gone disconnect); left by kill -9: $kills, by SIGTERM: $terms"
echo "  frames checked: $checked, bad frames: $bad"
echo "  producer fds: $fd0 -> $fd1, RSS: $rss0 -> $rss1 KiB"
[ "$shm_before" = "$shm_after" ] && echo "  /dev/shm: unchanged" || echo "  /dev/shm: CHANGED"
[ "$bad" -eq 0 ] && [ "$fd0" -eq "$fd1" ] && [ "$shm_before" = "$shm_after" ] && [ "$checked" -gt 0 ]
