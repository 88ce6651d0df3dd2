#!/usr/bin/env bash
# SPDX-License-Identifier: MPL-2.0
# Builds the Debian package: target/deb/gpushm_VERSION-1_ARCH.deb holding the GStreamer plugin
# (in GStreamer's plugin directory), the gpushm command, libgpushm with gpushm.h and gpushm.pc
# (`make install` into a staging root, PREFIX=/usr and the multiarch libdir). Its Depends come
# from the binaries themselves (dpkg-shlibdeps): the GStreamer libraries they link, at the
# versions this machine builds against. Nothing here names an architecture: on arm64 (JetPack)
# it makes an arm64 package the same way.
#   scripts/make-deb.sh            # (make deb)
set -euo pipefail
cd "$(dirname "$0")/.."
arch=$(dpkg --print-architecture)
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
target=${CARGO_TARGET_DIR:-$PWD/target}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
root=$work/root
make --no-print-directory install PREFIX=/usr LIBDIR=/usr/lib/$multiarch DESTDIR="$root" >/dev/null
libdir=$root/usr/lib/$multiarch
elves=("$root/usr/bin/gpushm" "$libdir"/libgpushm.so.*.*.* "$libdir/gstreamer-1.0/libgstgpushm.so")
strip --strip-unneeded "${elves[@]}"
doc=$root/usr/share/doc/gpushm
install -D -m 644 README.md "$doc/README.md"
cat > "$doc/copyright" <<COPYRIGHT
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: gpushm

Files: *
Copyright: gpushm developers
License: MPL-2.0
 On Debian systems, the full text of the Mozilla Public License 2.0 is in
 /usr/share/common-licenses/MPL-2.0.
COPYRIGHT
# What the binaries link, as Debian packages (libcuda, NVRTC and GStreamer's CUDA library
# are opened at run time where present, so they are not dependencies).
mkdir -p "$work/shlibs/debian"
printf 'Source: gpushm\n\nPackage: gpushm\nArchitecture: any\n' > "$work/shlibs/debian/control"
depends=$(cd "$work/shlibs" && dpkg-shlibdeps -O -l"$libdir" "${elves[@]}" 2>/dev/null |
  sed -n 's/^shlibs:Depends=//p')
[ -n "$depends" ] || { echo "dpkg-shlibdeps found no dependencies" >&2; exit 1; }
size=$(du -sk "$root" | cut -f1)
mkdir -p "$root/DEBIAN"
cat > "$root/DEBIAN/control" <<CONTROL
Package: gpushm
Version: $version-1
Architecture: $arch
Maintainer: gpushm developers <gpushm@example.invalid>
Installed-Size: $size
Depends: $depends
Recommends: gstreamer1.0-plugins-base, gstreamer1.0-tools
Suggests: gstreamer1.0-plugins-bad
Section: video
Priority: optional
Homepage: https://example.invalid/gpushm
Description: live video shared between processes through shared memory, read in place by CUDA
 gpushmsink (one process) and gpushmsrc (any number of others) share frames through a
 shared-memory ring without copying them; CUDA kernels read them in place (cudasum), and on
 a discrete GPU the ring can live in GPU memory. Also the gpushm command (list, top,
 inspect) and the C API: libgpushm, gpushm.h, pkg-config gpushm. GStreamer's CUDA elements
 (gstreamer1.0-plugins-bad, nvcodec) take frames in CUDA memory where installed.
CONTROL
# The shared library's soname needs ldconfig run after install and remove.
echo "activate-noawait ldconfig" > "$root/DEBIAN/triggers"
mkdir -p "$target/deb"
deb=$target/deb/gpushm_${version}-1_${arch}.deb
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
echo "$deb"
