#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Installs a pinned nvcc (CUDA 13.0, matching the GPU machine's driver) from PyPI wheels into
# .venv/nvcc, with no CUDA toolkit and no GPU needed. Prints the nvcc path on its last line.
# Idempotent: a second run only checks the install.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="${METRALE_NVCC_VENV:-$root/.venv/nvcc}"
pins=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-runtime==13.0.96
)
if ! command -v g++ >/dev/null; then
  echo "install-nvcc: nvcc needs a host C++ compiler; install g++ (apt-get install g++)" >&2
  exit 1
fi
find_nvcc() { ls "$venv"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc 2>/dev/null | head -n1; }
nvcc=$(find_nvcc || true)
if [ -z "$nvcc" ]; then
  echo "install-nvcc: installing ${pins[*]} into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "${pins[@]}"
  nvcc=$(find_nvcc)
fi
"$nvcc" --version | tail -n2 >&2
echo "$nvcc"
