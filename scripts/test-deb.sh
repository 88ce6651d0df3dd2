#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# The Debian package (scripts/make-deb.sh) on a clean Debian 12 root, as a user would use it:
# `apt install ./gpushm_*.deb`, then gst-inspect-1.0 finds both elements, two gst-launch-1.0
# processes share frames, a C program built with `pkg-config --cflags --libs gpushm` reads a
# producer's frames and they hold the producer's bytes, `gpushm list` runs; `apt purge` leaves
# nothing of the package under /usr or /etc. As root (debootstrap, chroot).
#   scripts/test-deb.sh            # (make package-test)
# The root (GPUSHM_DEB_ROOT, default /var/tmp/gpushm-bookworm-root: minbase, about 300 MB) is
# made once from this machine's Debian mirror (GPUSHM_DEB_MIRROR to override) and reused; the
# package is installed and purged in it each run. Not tried here: arm64 (JetPack's Ubuntu
# 22.04 root and its GStreamer 1.20): the script names no architecture.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "test-deb: run as root (debootstrap, chroot)" >&2; exit 1; }
deb=$(scripts/make-deb.sh)
root=${GPUSHM_DEB_ROOT:-/var/tmp/gpushm-bookworm-root}
fail() { echo "test-deb: FAILED: $*" >&2; exit 1; }
in_root() { env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C DEBIAN_FRONTEND=noninteractive chroot "$root" "$@"; }
if ! command -v debootstrap >/dev/null; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap
fi
if [ ! -x "$root/usr/bin/apt-get" ] || [ -d "$root/debootstrap" ]; then
  rm -rf --one-file-system "$root"
  mirror=${GPUSHM_DEB_MIRROR:-$(apt-get indextargets --format '$(TARGET_OF) $(RELEASE) $(REPO_URI)' 2>/dev/null |
    awk '$1 == "deb" && $2 !~ /[-\/]/ {print $3; exit}')}
  [ -n "$mirror" ] || fail "no Debian mirror in this machine's apt sources: set GPUSHM_DEB_MIRROR"
  debootstrap --variant=minbase bookworm "$root" "$mirror" >/dev/null
  printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d"; chmod +x "$root/usr/sbin/policy-rc.d"
  echo 'Acquire::Languages "none";' > "$root/etc/apt/apt.conf.d/90gpushm"
fi
cp -L /etc/resolv.conf "$root/etc/resolv.conf"
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
mkdir -p "$root/dev/pts"
mountpoint -q "$root/dev/pts" || mount -t devpts devpts "$root/dev/pts"
trap 'umount "$root/dev/pts" "$root/proc" 2>/dev/null || true; rm -rf "$root/tmp/gpushm-test"' EXIT
in_root apt-get update -q >/dev/null
# What the test uses besides the package: gst-launch-1.0 and videotestsrc, a C compiler and
# pkg-config. (A user needs the first two to run pipelines: the package recommends them.)
in_root apt-get install -y -q --no-install-recommends gstreamer1.0-tools gstreamer1.0-plugins-base \
  gcc libc6-dev pkg-config >/dev/null
in_root dpkg -s gpushm >/dev/null 2>&1 && in_root apt-get purge -y -q gpushm >/dev/null
files() { (cd "$root" && find usr etc -xdev \( -type f -o -type l \) | sort); }
before=$(files)
t=$root/tmp/gpushm-test; rm -rf "$t"; mkdir -p "$t"
cp "$deb" "$t/gpushm.deb"
in_root apt-get install -y -q /tmp/gpushm-test/gpushm.deb >/dev/null || fail "apt install"
echo "test-deb: installed $(basename "$deb") with apt on Debian $(cat "$root/etc/debian_version")"
for e in gpushmsink gpushmsrc; do
  out=$(in_root gst-inspect-1.0 "$e") && grep -q "Factory Details" <<<"$out" || fail "gst-inspect-1.0 $e"
done
# Two gst-launch-1.0 processes: 30 frames across.
in_root sh -c 'cd /tmp/gpushm-test
  timeout 60 gst-launch-1.0 -q videotestsrc num-buffers=30 ! video/x-raw,format=NV12,width=320,height=240,framerate=30/1 \
    ! gpushmsink socket-path=/tmp/gpushm-test/a.sock wait-for-connection=true & p=$!
  for i in $(seq 500); do [ -S /tmp/gpushm-test/a.sock ] && break; sleep 0.02; done
  timeout 60 gst-launch-1.0 -q gpushmsrc socket-path=/tmp/gpushm-test/a.sock num-buffers=30 ! video/x-raw,format=NV12 \
    ! fakesink sync=false; c=$?; wait $p; exit $c' || fail "two gst-launch-1.0 processes"
# The C example, built as an app would, reads a white GRAY8 producer: every byte 235
# (videotestsrc's white, studio range).
cp examples/c/consumer.c "$t/"
in_root sh -c 'cd /tmp/gpushm-test && cc consumer.c -o consumer $(pkg-config --cflags --libs gpushm)' ||
  fail "building a C program with pkg-config gpushm"
in_root sh -c 'cd /tmp/gpushm-test
  timeout 60 gst-launch-1.0 -q videotestsrc num-buffers=10 pattern=white ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 \
    ! gpushmsink socket-path=/tmp/gpushm-test/b.sock wait-for-connection=true & p=$!
  for i in $(seq 500); do [ -S /tmp/gpushm-test/b.sock ] && break; sleep 0.02; done
  timeout 60 ./consumer /tmp/gpushm-test/b.sock 10 > c.out; c=$?; wait $p; exit $c' || fail "the C consumer"
n=$(grep -c "GRAY8 64x48 .* plane 0: sum $((64 * 48 * 235))$" "$t/c.out" || true)
[ "$n" = 10 ] || fail "the C consumer read $n of 10 white frames: $(head -3 "$t/c.out")"
in_root gpushm list >/dev/null || fail "gpushm list"
echo "test-deb: gst-inspect-1.0, two processes, a pkg-config C program (10 of 10 frames, every byte right), gpushm list: ok"
in_root apt-get purge -y -q gpushm >/dev/null || fail "apt purge"
after=$(files)
left=$(comm -13 <(echo "$before") <(echo "$after"))
[ -z "$left" ] || fail "left after purge: $left"
echo "test-deb: purged, nothing of it left under /usr or /etc"
