#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# Installs what gpushm needs on Debian, Ubuntu or JetPack, only where it is missing:
# GStreamer development files, tools and plugins (apt-get, with sudo when not root),
# and the Rust components used by `make test`.
#   scripts/install-deps.sh          # everything `make test` and the examples use
#   scripts/install-deps.sh demo     # only what `make demo` builds and runs (a few packages)
set -euo pipefail
only_demo=; [ "${1:-}" = demo ] && only_demo=1

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

pkgs=()
pkg-config --version >/dev/null 2>&1 || pkgs+=(pkg-config)
command -v cc >/dev/null 2>&1 || pkgs+=(gcc)
pkg-config --exists gstreamer-1.0 gstreamer-check-1.0 2>/dev/null || pkgs+=(libgstreamer1.0-dev)
pkg-config --exists gstreamer-video-1.0 gstreamer-app-1.0 2>/dev/null || pkgs+=(libgstreamer-plugins-base1.0-dev)
command -v gst-launch-1.0 >/dev/null 2>&1 || pkgs+=(gstreamer1.0-tools)
gst-inspect-1.0 videotestsrc >/dev/null 2>&1 || pkgs+=(gstreamer1.0-plugins-base)
# (The examples, the frame checker too, build with the dev-dependencies: the RTSP server's.)
pkg-config --exists gstreamer-rtsp-server-1.0 2>/dev/null || pkgs+=(libgstrtspserver-1.0-dev)
if [ -z "$only_demo" ]; then
gst-inspect-1.0 shmsink >/dev/null 2>&1 || pkgs+=(gstreamer1.0-plugins-bad)
gst-inspect-1.0 rtpvrawpay >/dev/null 2>&1 && gst-inspect-1.0 mp4mux >/dev/null 2>&1 &&
  gst-inspect-1.0 matroskamux >/dev/null 2>&1 || pkgs+=(gstreamer1.0-plugins-good)
# The recording tests encode with x264enc (plugins-ugly) and parse with h264parse (plugins-bad).
gst-inspect-1.0 x264enc >/dev/null 2>&1 || pkgs+=(gstreamer1.0-plugins-ugly)
# The encoded-stream tests decode H.264 with avdec_h264 (gst-libav).
gst-inspect-1.0 avdec_h264 >/dev/null 2>&1 || pkgs+=(gstreamer1.0-libav)
pkg-config --exists fontconfig freetype2 2>/dev/null || pkgs+=(libfontconfig-dev libfreetype-dev fonts-dejavu-core)
command -v meson >/dev/null 2>&1 || pkgs+=(meson)
command -v ninja >/dev/null 2>&1 || pkgs+=(ninja-build)
# Debian's python3 (PyGObject lives there), even when another python3 comes first on PATH.
py=/usr/bin/python3; [ -x "$py" ] || py=python3
"$py" -c 'import gi; gi.require_version("GstApp", "1.0")' >/dev/null 2>&1 ||
  pkgs+=(python3-gi gir1.2-gstreamer-1.0 gir1.2-gst-plugins-base-1.0)

# make test builds the Python package in a venv.
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || pkgs+=(python3-venv)
gst-inspect-1.0 checksumsink >/dev/null 2>&1 || pkgs+=(gstreamer1.0-plugins-bad)
# Re-exporting over the network (tests/network.rs): srtsink/srtsrc (plugins-bad), rtspsrc
# (plugins-good) and the rtsp_server example, built against gst-rtsp-server.
gst-inspect-1.0 srtsink >/dev/null 2>&1 || pkgs+=(gstreamer1.0-plugins-bad)
# The namespace test runs unshare (util-linux).
command -v unshare >/dev/null 2>&1 || pkgs+=(util-linux)
# The C API: cbindgen writes gpushm.h (CI checks the committed one is current); its tests and
# examples are built with the system's C and C++ compilers, the C++ one against OpenCV.
command -v cbindgen >/dev/null 2>&1 || pkgs+=(cbindgen)
command -v c++ >/dev/null 2>&1 || pkgs+=(g++)
[ -e /usr/include/opencv4/opencv2/imgcodecs.hpp ] || pkgs+=(libopencv-core-dev libopencv-imgcodecs-dev)
fi

if [ ${#pkgs[@]} -gt 0 ]; then
  echo "Installing: ${pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
fi

if ! command -v cargo >/dev/null 2>&1; then
  [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "Rust is not installed. Installing it with rustup (https://rustup.rs) into ~/.cargo..."
  command -v curl >/dev/null 2>&1 || $sudo apt-get install -y -qq curl ca-certificates
  # rustup-init itself, for this machine's architecture (what sh.rustup.rs downloads too).
  # (Named rustup-init: rustup decides what to be by its file name.)
  initdir=$(mktemp -d); init=$initdir/rustup-init
  curl --proto '=https' --tlsv1.2 -sSf -o "$init" \
    "https://static.rust-lang.org/rustup/dist/$(uname -m)-unknown-linux-gnu/rustup-init"
  chmod +x "$init"
  "$init" -y --profile minimal >/dev/null
  rm -rf "$initdir"
  export PATH="$HOME/.cargo/bin:$PATH"
  echo "Rust installed: make finds it in ~/.cargo/bin; for your own shells: . \$HOME/.cargo/env"
fi
if [ -z "$only_demo" ] && command -v rustup >/dev/null 2>&1; then
  for c in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c"
  done
fi
