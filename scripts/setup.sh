#!/usr/bin/env bash
# Installs the Debian packages moetrain builds against. Idempotent and quick when
# everything is present: apt is only touched for packages that are missing.
# The CUDA toolkit (nvcc, cuBLASLt, cuDNN, NCCL) is not a Debian package here; when
# /usr/local/cuda is present the CUDA backend is built, otherwise it is skipped.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libopenblas-dev            # CPU GEMM
  libgtest-dev               # tests
  libopenmpi-dev openmpi-bin # multi-rank runs
  nlohmann-json3-dev         # config.json, safetensors headers, metrics
  libtomlplusplus-dev        # training configs
  libzstd-dev libpcre2-dev libutf8proc-dev  # corpus reading and the tokenizer
  bible-kjv zstd             # the demo corpus (data/make_kjv_corpus.py): KJV text, compressed
  python3 python3-numpy      # fixtures and tools inspect .npy files
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "setup: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
