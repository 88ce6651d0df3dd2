#!/usr/bin/env bash
# User-space instructions per frame, counted by callgrind (repeatable whatever else the machine
# does): the bench's producer alone (videotestsrc ! fakesink), gpushmsink's process and
# gpushmsrc's process, each over 64x64 GRAY8 frames flat out. Each figure is the difference of
# a 1000- and a 5000-frame run over the 4000 frames between, so start-up (the registry, caps
# parsing) drops out.
#
#   cargo build --release --example bench
#   scripts/instructions-per-frame.sh target/release/examples/bench [W H FORMAT]
#
# WHICH="prod" runs only the producer's, and so on (none, prod, cons). Needs valgrind.
set -euo pipefail
bench=$(realpath "${1:?the bench binary}")
w=${2:-64} h=${3:-64} format=${4:-GRAY8}
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 2; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
frames_args() { echo --width "$w" --height "$h" --frames "$1" --format "$format"; }
grind() { valgrind --tool=callgrind --callgrind-out-file="$dir/out" "$@" >/dev/null 2>&1; }
total() { awk '/^(summary|totals):/ {print $2; exit}' "$dir/out"; }

# Instructions of one run of $2 frames, $1 being the process counted.
count() {
    local who=$1 n=$2 sock=$dir/s.sock
    rm -f "$sock" "$dir/out"
    case $who in
    none)
        grind "$bench" produce --transport none --socket x $(frames_args "$n") --fps 0
        ;;
    prod)
        "$bench" consume --transport gpushm --socket "$sock" $(frames_args "$n") >/dev/null 2>&1 &
        local c=$!
        grind "$bench" produce --transport gpushm --socket "$sock" $(frames_args "$n") --fps 0
        wait "$c"
        ;;
    cons)
        # gpushmsrc waits a while for the socket; the producer comes once it runs.
        grind "$bench" consume --transport gpushm --socket "$sock" $(frames_args "$n") &
        local c=$!
        sleep 3
        "$bench" produce --transport gpushm --socket "$sock" $(frames_args "$n") --fps 0 >/dev/null 2>&1
        wait "$c"
        ;;
    esac
    local t
    t=$(total)
    [ -n "$t" ] || { echo "callgrind wrote no total for $who ($n frames)" >&2; exit 1; }
    echo "$t"
}

for who in ${WHICH:-none prod cons}; do
    a=$(count "$who" 1000)
    b=$(count "$who" 5000)
    case $who in
    none) label="producer alone (videotestsrc ! fakesink)" ;;
    prod) label="gpushmsink's process" ;;
    cons) label="gpushmsrc's process" ;;
    esac
    echo "$label: $(((b - a) / 4000)) instructions/frame"
done
