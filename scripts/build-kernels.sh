#!/bin/sh
# SPDX-License-Identifier: MPL-2.0
# Builds kernels/sum.cu into a fatbin with real code for Jetson Xavier (sm_72, where the
# toolkit still supports it: CUDA 13 dropped it), Jetson Orin (sm_87) and Hopper (sm_90), plus
# PTX for the lowest supported architecture, which the driver JIT-compiles for any other GPU.
# build.rs runs it when nvcc is found; it runs standalone too:
#   scripts/build-kernels.sh [NVCC] [OUT.fatbin]
# Prints the architectures it built for.
set -eu
nvcc=${1:-nvcc}
out=${2:-sum.fatbin}
src=$(dirname "$0")/../kernels/sum.cu
codes=$("$nvcc" --list-gpu-code 2>/dev/null || true)
archs=$("$nvcc" --list-gpu-arch 2>/dev/null || true)
gencode=""
built=""
for sm in 72 87 90; do
  if [ -z "$codes" ] || echo "$codes" | grep -qx "sm_$sm"; then
    gencode="$gencode -gencode arch=compute_$sm,code=sm_$sm"
    built="$built sm_$sm"
  fi
done
ptx=""
for c in 72 75; do
  if [ -z "$archs" ] || echo "$archs" | grep -qx "compute_$c"; then ptx=$c; break; fi
done
[ -n "$ptx" ] || { echo "nvcc supports neither compute_72 nor compute_75" >&2; exit 1; }
gencode="$gencode -gencode arch=compute_$ptx,code=compute_$ptx"
# shellcheck disable=SC2086 # word splitting of $gencode is intended
"$nvcc" -fatbin -O3 $gencode "$src" -o "$out"
echo "$built PTX:compute_$ptx" | sed 's/^ //'
