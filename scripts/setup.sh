#!/usr/bin/env bash
# Installs the Debian packages moetrain builds against. Idempotent and quick when
# everything is present: apt is only touched for packages that are missing.
# The CUDA toolkit (nvcc, cuBLASLt, cuDNN, NCCL) is not a Debian package here; when
# /usr/local/cuda is present the CUDA backend is built, otherwise it is skipped.
# With it, CUTLASS's headers are installed from PyPI (pip, at the end), as is, always,
# the tensorboard package.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libopenblas-dev            # CPU GEMM
  libgtest-dev               # tests
  libopenmpi-dev openmpi-bin # multi-rank runs
  nlohmann-json3-dev         # config.json, safetensors headers, metrics
  libtomlplusplus-dev        # training configs
  libzstd-dev libpcre2-dev libutf8proc-dev  # corpus reading and the tokenizer
  libxxhash-dev              # checkpoint files' checksums (XXH3)
  bible-kjv zstd             # the demo corpus (data/make_kjv_corpus.py): KJV text, compressed
  python3 python3-numpy      # fixtures and tools inspect .npy files
  python3-matplotlib         # tools/plot_run.py: a run's plots (make demo, a test)
  python3-pip                # tensorboard, and CUTLASS's headers for the CUDA backend (below)
  clang libomp-dev           # make sanitize: ASan/UBSan builds and the libFuzzer targets (fuzz/)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The tensorboard package reads metrics.tensorboard's event files back in a test (and
# serves them: tensorboard --logdir RUN/tb). Debian has none; it goes to the system
# python3, which has Debian's numpy and matplotlib and runs the tests.
/usr/bin/python3 -c 'import importlib.metadata as m; assert m.version("tensorboard") == "2.20.0"' 2>/dev/null ||
  /usr/bin/python3 -m pip install --quiet --break-system-packages --root-user-action=ignore tensorboard==2.20.0

# CUTLASS's headers (the CUDA backend's Hopper grouped GEMM) come from PyPI; CMake finds
# them through python3's cutlass_library. Headers only, so none of its Python dependencies.
if [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null; then
  python3 -c 'import importlib.metadata as m; assert m.version("nvidia-cutlass") == "4.2.0.0"' 2>/dev/null ||
    python3 -m pip install --quiet --no-deps --break-system-packages --root-user-action=ignore nvidia-cutlass==4.2.0.0
  # The cuDNN frontend's C++ headers (fused attention), found by CMake the same way.
  python3 -c 'import importlib.metadata as m; assert m.version("nvidia-cudnn-frontend") == "1.32.0"' 2>/dev/null ||
    python3 -m pip install --quiet --no-deps --break-system-packages --root-user-action=ignore nvidia-cudnn-frontend==1.32.0
fi
