#!/usr/bin/env bash
# Packs the shared libraries a moetrain binary needs that the GPU machine's image
# does not have (Debian's OpenBLAS, Open MPI, PCRE2, utf8proc, zstd, ...) into one
# tarball to carry there with the binary. The C/C++ runtime and the CUDA libraries
# are left out: the GPU machine has its own.
#
#   bench/pack_device_libs.sh build/moetrain .gpurun/lib.tar.xz
#   (there) tar xJf .gpurun/lib.tar.xz -C /tmp
#           export LD_LIBRARY_PATH=/tmp/lib:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
set -euo pipefail
bin="$1"
out="$2"
stage="$(mktemp -d)"
mkdir -p "$stage/lib"
ldd "$bin" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|ld-linux*|libstdc++*|libgcc_s*|libdl.so*|libpthread.so*|librt.so*) ;;
    libcuda*|libcublas*|libcudart*|libnccl*|libcudnn*|libnvrtc*) ;;
    *) cp -L "$lib" "$stage/lib/" ;;
  esac
done
mkdir -p "$(dirname "$out")"
tar cJf "$out" -C "$stage" lib
echo "packed $(ls "$stage/lib" | wc -l) libraries into $out"
rm -rf "$stage"
