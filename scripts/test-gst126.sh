#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# The element, pipeline, encoded, timing, events, metas and ported tests on GStreamer 1.26
# (Debian 13's packages, made relocatable by ../shared/tools/gst126/make-bundle): the test
# binaries, built on this machine's GStreamer, run on the bundle's with `DIR/run`; their child
# processes (gst-launch, the test tools) run on it too (tests/common: GPUSHM_TEST_GST).
#
#   scripts/test-gst126.sh [TEST ...]      # default: the list below; as root (make-bundle)
#
# GST126_DIR (default .gst126) is the bundle; it is made, or updated, first (about 2 minutes
# the first time, seconds after).
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${GST126_DIR:-.gst126}
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(elements pipelines encoded timing events metas ported_shm ported_unixfd ported_inter)
# The bundle maker (the project's shared tool, beside this checkout; GST126_TOOL elsewhere).
tool=${GST126_TOOL:-../shared/tools/gst126/make-bundle}
[ -x "$tool" ] || { echo "test-gst126: no $tool: set GST126_TOOL to ../shared/tools/gst126/make-bundle's path" >&2; exit 1; }
# What the tests' pipelines use beyond make-bundle's defaults.
"$tool" "$bundle" matroska audiotestsrc debug debugutilsbad \
  audioconvert audiorate videorate jpeg rtp libav openh264 mpegtsmux mpegtsdemux >/dev/null
cargo build --locked --lib --examples
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
# The test binaries cargo built, by their JSON build messages; the plugin's unit tests too,
# for the serialized metas test that needs GStreamer 1.24+.
mapfile -t bins < <(cargo test --locked --no-run --message-format=json --lib "${args[@]}" |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] != "gpushm":
        print(m["executable"])')
bundle=$(cd "$bundle" && pwd)   # (GST126_DIR may be relative or absolute)
export GPUSHM_TEST_GST=$bundle GPUSHM_TEST_BUILD_DIR=${CARGO_TARGET_DIR:-$PWD/target}/debug
failed=0
for b in "${bins[@]}"; do
  echo "== $(basename "$b") on $("$bundle/gst-inspect" --version | sed -n 2p)"
  case $(basename "$b") in
    gstgpushm-*) filter=(--include-ignored metas) ;;
    *) filter=() ;;
  esac
  "$bundle/run" "$b" "${filter[@]}" || failed=1
done
exit $failed
