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
lib=$(ldconfig -p | awk '/libgstcheck-1.0.so.0 / {p = $NF} END {print p}')
[ -n "$lib" ] && cp -L "$lib" "$out/lib/"
