#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# Packs everything for the GPU machine (release plugin, examples, test binaries, GStreamer
# runtime) with ../shared/tools/device-pack, plus the GStreamer check library the Harness
# tests link to, which the shared bundle does not carry.
#   scripts/device-pack.sh [.device]
# then on the GPU machine: . .device/env.sh && .device/run-tests.sh --include-ignored
set -euo pipefail
out=${1:-.device}
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
../shared/tools/device-pack "$out"
# The benchmark program (tools/bench, a workspace member the shared tool's `cargo build
# --examples` leaves out) into examples/, which is on the GPU machine's PATH: `bench ...` there.
# Stripped, for the 64 MiB a run may carry.
cargo build --release --locked -p gpushm-bench
cp "${CARGO_TARGET_DIR:-$here/target}/release/bench" "$out/examples/bench"
strip "$out/examples/bench"
# What the GPU machine does not run, left out to stay under the 64 MiB a run may carry (tree
# included): the network re-export tests and their RTSP server (no SRT, RTSP or libav there),
# and tests with nothing GPU- or machine-specific in them, which CI runs: the gpushm command's,
# stream names, namespaces, the wire fuzzer, and the command's empty test harness.
for t in "$out"/tests/network-* "$out"/tests/cli-* "$out"/tests/names-* "$out"/tests/containers-* \
         "$out"/tests/fuzz-* "$out"/examples/rtsp_server; do rm -f "$t"; done
for t in "$out"/tests/gpushm-*; do
  "$t" --list 2>/dev/null | grep -q '^0 tests' && rm -f "$t"
done
# The plugins the real-pipeline tests use (encoders, muxers, demuxers, decoders), with their
# libraries.
arch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
# libgpushm is packed in capi/ (below), where its programs find it: a copy in lib/ would
# come first on LD_LIBRARY_PATH and go stale.
skip='^(libc|libm|libdl|librt|libpthread|ld-linux[^ ]*|libstdc\+\+|libgcc_s|libcuda|libnvrtc[^ ]*|libgpushm)\.so'
rm -f "$out"/lib/libgpushm.so*
# jpeg, rtp, audiotestsrc, audiorate and openh264 (a small H.264 decoder: gst-libav with FFmpeg is over
# 200 MB) are for the encoded-stream tests; nvcodec (Debian's 1.22: cudaupload, cudadownload,
# nvh264dec) for the CUDA-memory tests.
for p in x264 isomp4 matroska videofilter jpeg rtp audiotestsrc audiorate audioconvert openh264 nvcodec debug; do
  so=/usr/lib/$arch/gstreamer-1.0/libgst$p.so
  [ -e "$so" ] || continue
  cp "$so" "$out/plugins/"
  ldd "$so" | awk '/=>/ && $3 ~ /^\// {print $1, $3}' | while read -r soname path; do
    [[ $soname =~ $skip ]] || [ -e "$out/lib/$soname" ] || cp -L "$path" "$out/lib/$soname"
  done
done
strip "$out"/lib/*.so* 2>/dev/null || true
lib=$(ldconfig -p | awk '/libgstcheck-1.0.so.0 / {p = $NF} END {print p}')
[ -n "$lib" ] && cp -L "$lib" "$out/lib/"
# The examples' own libraries (the bench plot needs fontconfig and freetype), glibc aside, and a
# font with a fontconfig file that finds it.
for e in "$out"/examples/*; do ldd "$e" 2>/dev/null | awk '/=>/ && $3 ~ /^\// {print $1, $3}'; done | sort -u |
  while read -r soname path; do
    [[ $soname =~ $skip ]] || [ -e "$out/lib/$soname" ] || cp -L "$path" "$out/lib/$soname"
  done
mkdir -p "$out/fonts"
cp /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf "$out/fonts/" 2>/dev/null || true
cat > "$out/fonts/fonts.conf" <<'CONF'
<?xml version="1.0"?>
<!DOCTYPE fontconfig SYSTEM "fonts.dtd">
<fontconfig><dir prefix="relative">.</dir><cachedir>/tmp/gpushm-fontcache</cachedir>
<alias><family>sans-serif</family><prefer><family>DejaVu Sans</family></prefer></alias></fontconfig>
CONF
echo 'export FONTCONFIG_FILE=$here/fonts/fonts.conf' >> "$out/env.sh"
# The Python package (an abi3 wheel) and pytest, for the Python tests there (a venv would not
# see that machine's PyTorch and CuPy, so they go into a folder on PYTHONPATH):
#   python3 -m pip install --no-deps --no-index --target /tmp/pkgs .device/wheels/*.whl
#   (cd python/tests && PYTHONPATH=/tmp/pkgs python3 -m pytest -v .)   # GPU tests included
mkdir -p "$out/wheels"
venv=${CARGO_TARGET_DIR:-$here/target}/pyvenv
[ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
"$venv/bin/pip" wheel -q --no-deps -w "$out/wheels" ./python
"$venv/bin/pip" download -q --only-binary=:all: --python-version 3.12 -d "$out/wheels" pytest
# The C API: libgpushm and its test program (capi/tests/capi_test.c, found beside it through
# its rpath), with the GPU script: bash .device/capi/gpu.sh there.
cargo build --release --locked -p gpushm-capi
mkdir -p "$out/capi"
cp -L "${CARGO_TARGET_DIR:-$here/target}/release/libgpushm.so" "$out/capi/libgpushm.so.0"
cc -std=c11 -O1 -g -Wall -Wextra -pedantic -Werror -pthread capi/tests/capi_test.c -o "$out/capi/capi_test" \
  -Icapi/include -L"$out/capi" -l:libgpushm.so.0 -ldl -Wl,-rpath,'$ORIGIN'
cp capi/tests/gpu.sh "$out/capi/"
# The C consumer of `bench capi` and c_cold (`bench cold`'s C side), beside bench (examples/),
# against the same libgpushm.
for c in c_consumer c_cold; do
  cc -std=c11 -O2 -Wall -Wextra capi/bench/$c.c -o "$out/examples/$c" \
    -Icapi/include -L"$out/capi" -l:libgpushm.so.0 -Wl,-rpath,'$ORIGIN/../capi'
done
