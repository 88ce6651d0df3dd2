#!/usr/bin/env bash
# User-space instructions per frame, counted by callgrind (repeatable whatever else the machine
# does): the bench's producer alone (videotestsrc ! fakesink), gpushmsink's process and
# gpushmsrc's process, each over 64x64 GRAY8 frames flat out. Each figure is the difference of
# a 1000- and a 5000-frame run over the 4000 frames between, so start-up (the registry, caps
# parsing) drops out. The process counted runs many times slower than its peer, so each count
# is of one regime: counting the producer, the consumer always waits for it (a wake-up each
# frame); counting the consumer, the producer is always ahead.
#
#   cargo build --release -p gpushm-bench
#   scripts/instructions-per-frame.sh target/release/bench [W H FORMAT]
#
# WHICH="prod" runs only the producer's, and so on (none, prod, cons). Needs valgrind.
set -euo pipefail
shopt -s inherit_errexit
bench=$(realpath "${1:?the bench binary}")
[ -x "$bench" ] || { echo "$bench: not an executable" >&2; exit 2; }
w=${2:-64} h=${3:-64} format=${4:-GRAY8}
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 2; }
# The bench's own knobs stay out of it.
for v in $(env | sed -n 's/^\(GPUSHM_BENCH_[A-Z_]*\)=.*/\1/p'); do unset "$v"; done
for who in ${WHICH:-none prod cons}; do
    case $who in none | prod | cons) ;; *) echo "WHICH: none, prod or cons, not $who" >&2; exit 2 ;; esac
done
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
frames_args() { echo --width "$w" --height "$h" --frames "$1" --format "$format"; }
grind() { valgrind --tool=callgrind --callgrind-out-file="$dir/out" "$@"; }

# Waits for the producer's socket (the producer waits for its consumer).
wait_socket() {
    for _ in $(seq 600); do [ -S "$1" ] && return 0; sleep 0.1; done
    echo "no socket at $1 after 60 s" >&2
    return 1
}

# Instructions of one run of $2 frames, $1 being the process counted.
count() {
    local who=$1 n=$2 sock=$dir/s.sock p c
    rm -f "$sock" "$dir/out" "$dir/p.txt" "$dir/c.txt"
    case $who in
    none)
        grind "$bench" produce --transport none --socket x $(frames_args "$n") --fps 0 \
            >"$dir/p.txt" 2>"$dir/p.err"
        ;;
    prod)
        grind "$bench" produce --transport gpushm --socket "$sock" $(frames_args "$n") --fps 0 \
            >"$dir/p.txt" 2>"$dir/p.err" &
        p=$!
        wait_socket "$sock"
        "$bench" consume --transport gpushm --socket "$sock" $(frames_args "$n") \
            >"$dir/c.txt" 2>"$dir/c.err"
        wait "$p"
        ;;
    cons)
        "$bench" produce --transport gpushm --socket "$sock" $(frames_args "$n") --fps 0 \
            >"$dir/p.txt" 2>"$dir/p.err" &
        p=$!
        wait_socket "$sock"
        grind "$bench" consume --transport gpushm --socket "$sock" $(frames_args "$n") \
            >"$dir/c.txt" 2>"$dir/c.err"
        wait "$p"
        ;;
    esac
    # Every frame went through, or the count means nothing.
    grep -q "^PRODUCER frames=$n " "$dir/p.txt" ||
        { echo "$who, $n frames: the producer did not send them all" >&2; cat "$dir/p.txt" "$dir/p.err" >&2; return 1; }
    if [ "$who" != none ]; then
        grep -q "^CONSUMER frames=$n " "$dir/c.txt" ||
            { echo "$who, $n frames: the consumer did not get them all" >&2; cat "$dir/c.txt" "$dir/c.err" >&2; return 1; }
    fi
    local t
    t=$(awk '/^(summary|totals):/ {print $2; exit}' "$dir/out")
    [ -n "$t" ] || { echo "callgrind wrote no total for $who ($n frames)" >&2; return 1; }
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
