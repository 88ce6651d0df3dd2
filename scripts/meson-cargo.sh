#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# Called by meson.build: cargo-builds the plugin and copies it to meson's output path.
#   meson-cargo.sh SOURCE_DIR debug|release OUTPUT
set -euo pipefail
src=$1 profile=$2 out=$(realpath -m "$3")
cd "$src"
if [ "$profile" = release ]; then cargo build --locked --lib --release; else cargo build --locked --lib; fi
cp "${CARGO_TARGET_DIR:-target}/$profile/libgstgpushm.so" "$out"
