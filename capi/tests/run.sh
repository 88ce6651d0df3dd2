#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# The C API's tests, as a user builds against it: the C test program, the examples and a C++17
# build of the header are compiled with the system compilers from the *installed* header and
# pkg-config file, then run against real producer processes (gst-launch-1.0 ... ! gpushmsink,
# and the C producer read by gpushmsrc).
#   capi/tests/run.sh PREFIX [asan]
# PREFIX holds a `make install` (lib/, include/, lib/pkgconfig/, lib/gstreamer-1.0/). With
# `asan`, the C programs are built with AddressSanitizer (and UndefinedBehaviorSanitizer).
set -euo pipefail
prefix=$(realpath "$1"); mode=${2:-}
here=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d); pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
export LD_LIBRARY_PATH=$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export GST_PLUGIN_PATH=$prefix/lib/gstreamer-1.0
cflags=(-Wall -Wextra -pedantic -Werror -O1 -g -pthread)
if [ "$mode" = asan ]; then
  cflags+=(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
  # Leaks too: every handle the tests make is destroyed.
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
fi
say() { echo "capi[$mode]: $*"; }
fail() { echo "capi[$mode]: FAIL: $*"; exit 1; }

pkg-config --exists gpushm || fail "pkg-config does not find gpushm in $PKG_CONFIG_PATH"
# Every symbol the library exports is ours, under the gpushm_ prefix; its soname is versioned.
lib=$prefix/lib/libgpushm.so
others=$(nm -D --defined-only "$lib" | awk '{print $3}' | grep -v '^gpushm_' || true)
[ -z "$others" ] || fail "libgpushm.so exports symbols without the gpushm_ prefix: $others"
readelf -d "$lib" | grep -q 'SONAME.*libgpushm.so.0' || fail "libgpushm.so has no soname libgpushm.so.0"
# shellcheck disable=SC2046
cc -std=c11 "${cflags[@]}" "$here/capi/tests/capi_test.c" -o "$work/capi_test" $(pkg-config --cflags --libs gpushm) -ldl
# shellcheck disable=SC2046
cc -std=c11 "${cflags[@]}" "$here/examples/c/consumer.c" -o "$work/consumer" $(pkg-config --cflags --libs gpushm)
# shellcheck disable=SC2046
cc -std=c11 "${cflags[@]}" "$here/examples/c/producer.c" -o "$work/producer" $(pkg-config --cflags --libs gpushm)
# The header as C++17, pedantic.
printf '#include <gpushm.h>\nint main() { return gpushm_version() ? 0 : 1; }\n' > "$work/hdr.cpp"
# shellcheck disable=SC2046
c++ -std=c++17 "${cflags[@]}" "$work/hdr.cpp" -o "$work/hdr" $(pkg-config --cflags --libs gpushm)
"$work/hdr"
# The OpenCV example (OpenCV from the system packages: core and imgcodecs).
ocv=(-I/usr/include/opencv4 -lopencv_imgcodecs -lopencv_core)
pkg-config --exists opencv4 && read -r -a ocv <<< "$(pkg-config --cflags --libs opencv4)"
# shellcheck disable=SC2046
c++ -std=c++17 "${cflags[@]}" "$here/examples/c/opencv_consumer.cpp" -o "$work/opencv_consumer" \
  $(pkg-config --cflags --libs gpushm) "${ocv[@]}"
say "built against $(pkg-config --modversion gpushm) in $prefix"

# Waits up to 60 s (a producer under ASan on a machine whose cores are busy takes its time)
# for command $@ to succeed; false if it never does.
await() {
  local until=$((SECONDS + 60))
  until "$@"; do [ $SECONDS -lt $until ] || return 1; sleep 0.02; done
}
# Starts a gst-launch-1.0 producer ending in gpushmsink at $1, waits for its socket.
gst_producer() {
  local sock=$1; shift
  gst-launch-1.0 -q "$@" ! gpushmsink socket-path="$sock" wait-for-connection=true sync=false &
  pids+=($!)
  await test -S "$sock" || fail "no producer socket at $sock"
}
# Starts the C producer at $1 ($2 frames, eos|hold), waits for READY.
c_producer() {
  # Emptied here, not by the background job's redirection: that runs in the child, maybe
  # after `await` has read the previous producer's READY (seen on busy cores).
  : > "$work/producer.log"
  "$work/capi_test" produce "$1" "$2" "$3" >> "$work/producer.log" 2>&1 &
  pids+=($!)
  await grep -q READY "$work/producer.log" || fail "the C producer did not start: $(cat "$work/producer.log")"
}

# 1. Frame contents: videotestsrc through gpushmsink to the C consumer, byte for byte.
for caps in "video/x-raw,format=I420,width=320,height=240" "video/x-raw,format=RGBA,width=320,height=240" \
            "video/x-raw,format=NV12,width=320,height=240"; do
  sock=$work/frames.sock; rm -f "$sock"
  gst_producer "$sock" videotestsrc num-buffers=20 pattern=ball ! "$caps,framerate=30/1"
  "$work/capi_test" consume "$sock" 20 "$work/got.raw" | tee "$work/out.log"
  grep -q "^OK consume 20" "$work/out.log" || fail "consume $caps"
  gst-launch-1.0 -q videotestsrc num-buffers=20 pattern=ball ! "$caps,framerate=30/1" ! filesink location="$work/want.raw"
  cmp "$work/got.raw" "$work/want.raw" || fail "$caps: the C consumer's frames differ from videotestsrc's"
  say "$caps: 20 frames equal videotestsrc's"
done

# 1b. The low-latency mode (spin_us) on a live producer: the same frames, byte for byte.
sock=$work/spin.sock; rm -f "$sock"
caps=video/x-raw,format=NV12,width=320,height=240
gst_producer "$sock" videotestsrc is-live=true num-buffers=20 pattern=ball ! "$caps,framerate=30/1"
CAPI_TEST_SPIN_US=20000 "$work/capi_test" consume "$sock" 20 "$work/got.raw" | tee "$work/out.log"
grep -q "^OK consume 20" "$work/out.log" || fail "consume with spin_us"
gst-launch-1.0 -q videotestsrc num-buffers=20 pattern=ball ! "$caps,framerate=30/1" ! filesink location="$work/want.raw"
cmp "$work/got.raw" "$work/want.raw" || fail "spin_us: the C consumer's frames differ from videotestsrc's"
say "spin_us=20000: 20 live frames equal videotestsrc's"

# 2. The C producer read by gpushmsrc, byte for byte.
sock=$work/cprod.sock; rm -f "$sock"
c_producer "$sock" 30 eos
gst-launch-1.0 -q gpushmsrc socket-path="$sock" mode=lossless ! filesink location="$work/got.raw"
wait "${pids[-1]}" || fail "the C producer failed: $(cat "$work/producer.log")"
"$work/capi_test" expect 30 > "$work/want.raw"
cmp "$work/got.raw" "$work/want.raw" || fail "gpushmsrc got other bytes than the C producer published"
say "C producer -> gpushmsrc: 30 frames equal"

# 2a. The C producer's low-latency mode (spin_us) with a lossless gpushmsrc: the same frames.
sock=$work/cprodspin.sock; rm -f "$sock"
CAPI_TEST_PUB_SPIN_US=2000 c_producer "$sock" 30 eos
gst-launch-1.0 -q gpushmsrc socket-path="$sock" mode=lossless ! filesink location="$work/got.raw"
wait "${pids[-1]}" || fail "the C producer (spin_us) failed: $(cat "$work/producer.log")"
cmp "$work/got.raw" "$work/want.raw" || fail "spin_us: gpushmsrc got other bytes than the C producer published"
say "C producer spin_us=2000 -> gpushmsrc: 30 frames equal"

# 2b. gpushm_publisher_wake_early: the C producer (a frame every 20 ms) on one CPU wakes a
# lossless gpushmsrc asleep on another ahead of each frame (one asleep on the producer's CPU is
# never woken early): frames woken for (most of them on an idle machine; on busy cores the
# consumer is not always asleep when a frame comes, so the count asserted is only that it
# happens, at most once a frame), every frame the same.
command -v taskset > /dev/null || fail "taskset (util-linux) is needed to pin the wake_early test"
read -r cpu_a cpu_b < <(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0))[:2])')
[ -n "$cpu_b" ] || fail "the wake_early test needs two CPUs, this may use only $cpu_a"
# The C producer (a frame every 20 ms, with the variables given) on cpu_a, a lossless
# gpushmsrc on cpu_b: every frame the same; the producer's DONE line stays in producer.log.
pinned_c_producer() {
    local what=$1 sock=$work/$2.sock; shift 2
    rm -f "$sock"
    : > "$work/producer.log"  # see c_producer
    env CAPI_TEST_WAKE_EARLY_MS=20 "$@" taskset -c "$cpu_a" "$work/capi_test" produce "$sock" 30 eos >> "$work/producer.log" 2>&1 &
    pids+=($!)
    await grep -q READY "$work/producer.log" || fail "the C producer did not start: $(cat "$work/producer.log")"
    taskset -c "$cpu_b" gst-launch-1.0 -q gpushmsrc socket-path="$sock" mode=lossless ! filesink location="$work/got.raw"
    wait "${pids[-1]}" || fail "the C producer ($what) failed: $(cat "$work/producer.log")"
    cmp "$work/got.raw" "$work/want.raw" || fail "$what: gpushmsrc got other bytes than the C producer published"
}
pinned_c_producer wake_early cprodwake
woken=$(sed -n 's/^DONE woken_early=\([0-9]*\).*/\1/p' "$work/producer.log")
[ "${woken:-0}" -ge 1 ] && [ "$woken" -le 30 ] || fail "wake_early: $woken of 30 frames woken for early: $(cat "$work/producer.log")"
say "C producer wake_early -> gpushmsrc: 30 frames equal, $woken woken for early"

# 2b'. gpushm_publisher_set_wake_ahead: the same, the consumer woken 1 ms before each frame
# is due by the publisher's own thread (no wake_early calls): most frames woken for ahead.
pinned_c_producer set_wake_ahead cprodahead CAPI_TEST_WAKE_AHEAD_US=1000
ahead=$(sed -n 's/^DONE .*woken_ahead=//p' "$work/producer.log")
[ "${ahead:-0}" -ge 1 ] && [ "$ahead" -le 30 ] || fail "set_wake_ahead: $ahead of 30 frames woken for ahead: $(cat "$work/producer.log")"
say "C producer set_wake_ahead(1000) -> gpushmsrc: 30 frames equal, $ahead woken for ahead of their time"

# 2c. Stream names: the C producer as stream c-cam read by gpushmsrc stream=c-cam, and a
# gst-launch producer as stream gl-cam read by the C consumer (both in GPUSHM_RUNTIME_DIR).
export GPUSHM_RUNTIME_DIR=$work/run; mkdir -p "$GPUSHM_RUNTIME_DIR"
c_producer stream:c-cam 30 eos
[ -S "$GPUSHM_RUNTIME_DIR/c-cam" ] || fail "gpushm_publisher_open_stream made no socket c-cam"
gst-launch-1.0 -q gpushmsrc stream=c-cam mode=lossless ! filesink location="$work/got.raw"
wait "${pids[-1]}" || fail "the C producer (stream) failed: $(cat "$work/producer.log")"
cmp "$work/got.raw" "$work/want.raw" || fail "gpushmsrc stream=c-cam got other bytes than the C producer published"
caps=video/x-raw,format=NV12,width=320,height=240
gst-launch-1.0 -q videotestsrc num-buffers=20 pattern=ball ! "$caps,framerate=30/1" ! gpushmsink stream=gl-cam wait-for-connection=true sync=false &
pids+=($!)
"$work/capi_test" consume stream:gl-cam 20 "$work/got.raw" | tee "$work/out.log"
grep -q "^OK consume 20" "$work/out.log" || fail "consume stream:gl-cam"
gst-launch-1.0 -q videotestsrc num-buffers=20 pattern=ball ! "$caps,framerate=30/1" ! filesink location="$work/want2.raw"
cmp "$work/got.raw" "$work/want2.raw" || fail "stream gl-cam: the C consumer's frames differ from videotestsrc's"
unset GPUSHM_RUNTIME_DIR
say "stream names: C producer -> gpushmsrc, gpushmsink -> C consumer, frames equal"

# 3. Timeouts and interrupts: the producer publishes 3 frames, then nothing.
sock=$work/hold.sock; rm -f "$sock"
c_producer "$sock" 3 hold
"$work/capi_test" timeout "$sock" 3 | tee "$work/out.log"
grep -q "^OK timeout" "$work/out.log" || fail "timeout"
"$work/capi_test" threads "$sock" | tee "$work/out.log"
grep -q "^OK threads" "$work/out.log" || fail "threads"

# 3a. A frame looked at from another thread while it is destroyed and its object reused.
sock=$work/race.sock; rm -f "$sock"
c_producer "$sock" 3000 eos
"$work/capi_test" race "$sock" 3000 | tee "$work/out.log"
grep -q "^OK race" "$work/out.log" || fail "race"

# 3b. Reconnect: the producer is killed and another starts at the same path.
sock=$work/again.sock; rm -f "$sock"
c_producer "$sock" 3 hold
coproc R { "$work/capi_test" reconnect "$sock"; }
rpid=$R_PID
read -r line <&"${R[0]}" || true
[ "$line" = GOT3 ] || fail "reconnect: $line"
kill -9 "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true
rm -f "$sock"
c_producer "$sock" 3 hold
out=$(cat <&"${R[0]}"); echo "$out"
# Reaped before the next coproc starts: bash keeps one coproc's variables, and reaping R late
# would unset K's.
wait "$rpid" 2>/dev/null || true
echo "$out" | grep -q "^OK reconnect" || fail "reconnect"

# 4. The producer killed (-9) while a frame is held.
sock=$work/kill.sock; rm -f "$sock"
gst_producer "$sock" videotestsrc is-live=true pattern=ball ! "video/x-raw,format=I420,width=320,height=240,framerate=30/1"
prod=${pids[-1]}
coproc K { "$work/capi_test" killed "$sock"; }
read -r line <&"${K[0]}" || true
[ "$line" = HOLDING ] || fail "killed: $line"
kill -9 "$prod"; wait "$prod" 2>/dev/null || true
echo go >&"${K[1]}"
out=$(cat <&"${K[0]}"); echo "$out"
echo "$out" | grep -q "^OK killed" || fail "killed"

# 5. Misuse: error codes, never a crash.
sock=$work/misuse.sock; rm -f "$sock"
gst_producer "$sock" videotestsrc is-live=true ! "video/x-raw,format=GRAY8,width=320,height=240,framerate=30/1"
"$work/capi_test" misuse "$sock" | tee "$work/out.log"
grep -q "^OK misuse" "$work/out.log" || fail "misuse"

# 5a. Keeping the CPUs awake: held and released where the device is writable; refused for
# another user (nobody, where root can run one that reaches this build), saying what it needs.
"$work/capi_test" cpulat | tee "$work/out.log"
grep -q "^OK cpulat" "$work/out.log" || fail "cpulat"
if [ "$(id -u)" = 0 ] && command -v setpriv > /dev/null; then
  chmod 755 "$work"
  as_nobody=(setpriv --reuid=65534 --regid=65534 --clear-groups)
  if "${as_nobody[@]}" test -r "$prefix/lib/libgpushm.so" -a -x "$work/capi_test"; then
    "${as_nobody[@]}" "$work/capi_test" cpulat > "$work/out.log" 2>&1 || fail "cpulat as nobody: $(cat "$work/out.log")"
    cat "$work/out.log"
    grep -q "^OK cpulat (refused)" "$work/out.log" || fail "cpulat as nobody"
  else
    say "cpulat as nobody: not run (nobody cannot reach $prefix)"
  fi
fi

# 6. The examples: per-plane sums, a PNG through cv::Mat, the C producer example.
sock=$work/ex.sock; rm -f "$sock"
gst_producer "$sock" videotestsrc num-buffers=5 pattern=white ! "video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1"
"$work/consumer" "$sock" 5 | tee "$work/out.log"
gst-launch-1.0 -q videotestsrc num-buffers=1 pattern=white ! "video/x-raw,format=GRAY8,width=64,height=48" ! filesink location="$work/white.raw"
want=$(od -An -tu1 -v "$work/white.raw" | awk '{for (i = 1; i <= NF; i++) s += $i} END {print s}')
[ "$(grep -c "plane 0: sum $want\b" "$work/out.log")" = 5 ] || fail "the C consumer example's sums (want $want)"
sock=$work/ocv.sock; rm -f "$sock"
gst_producer "$sock" videotestsrc num-buffers=3 pattern=smpte ! "video/x-raw,format=BGRx,width=320,height=240,framerate=30/1"
(cd "$work" && ./opencv_consumer "$sock" frame.png) | tee "$work/out.log"
grep -q "^wrote frame.png" "$work/out.log" && [ -s "$work/frame.png" ] || fail "the OpenCV example"
sock=$work/exprod.sock; rm -f "$sock"
"$work/producer" "$sock" 10 > "$work/exprod.log" 2>&1 &
pids+=($!)
await test -S "$sock" || fail "the C producer example made no socket: $(cat "$work/exprod.log")"
gst-launch-1.0 -q gpushmsrc socket-path="$sock" mode=lossless ! fakesink num-buffers=10 || fail "the C producer example"
say "examples: OK"
say "all passed"
