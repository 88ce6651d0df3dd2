#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# Called by meson.build: cargo-builds the plugin (or the C API, with PACKAGE=gpushm-capi, or
# the gpushm command, with PACKAGE=gpushm-cli) and copies it to meson's output path.
#   meson-cargo.sh SOURCE_DIR debug|release OUTPUT [PACKAGE]
set -euo pipefail
src=$1 profile=$2 out=$(realpath -m "$3") package=${4:-}
cd "$src"
args=(--locked); [ "$profile" = release ] && args+=(--release)
if [ "$package" = gpushm-capi ]; then
  cargo build "${args[@]}" -p gpushm-capi; lib=libgpushm.so
elif [ "$package" = gpushm-cli ]; then
  cargo build "${args[@]}" -p gpushm-cli --bin gpushm; lib=gpushm
else
  cargo build "${args[@]}" --lib; lib=libgstgpushm.so
fi
cp "${CARGO_TARGET_DIR:-target}/$profile/$lib" "$out"
