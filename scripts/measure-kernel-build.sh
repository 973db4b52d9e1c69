#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Measures the kernel build: a clean build of every kernel, then rebuilds after (a) touching a .cu
# (mtime only), (b) editing one .cu, (c) editing the header every source includes. Works in a
# throwaway clone so the checkout is untouched. Prints one line per scenario from the build
# script's own report (distinct compile keys, how many compiled, nvcc wall time) plus cargo's time.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q "$src" "$work/repo"
cd "$work/repo"
NVCC=$(scripts/install-nvcc.sh 2>/dev/null)
export NVCC CARGO_TARGET_DIR="$work/target"
cargo fetch --locked -q
report() { cat "$CARGO_TARGET_DIR"/release/build/metrale-kernels-*/out/kernel-build-report.txt; }
build() {
  local label=$1 start end
  start=$(date +%s.%N)
  cargo build --release --locked -q -p metrale-kernels 2>/dev/null
  end=$(date +%s.%N)
  printf '| %s | %s | %s | %s | %.1f |\n' "$label" \
    "$(report | sed -n 's/^distinct compile keys: //p')" \
    "$(report | sed -n 's/^compiled now: //p')" \
    "$(report | sed -n 's/^compile wall time: \([0-9.]*\)s.*/\1/p')" \
    "$(echo "$end - $start" | bc)"
}
echo "commit $(git -C "$src" rev-parse --short=12 HEAD), $(nproc) cores, $(date -u +%Y-%m-%d)"
echo "| scenario | distinct keys | compiled | nvcc wall s | cargo build s |"
echo "|---|---|---|---|---|"
# Dependencies first, so the clean row measures this crate and its kernels, not crates.io.
METRALE_SKIP_BUILD=1 cargo build --release --locked -q -p metrale-kernels 2>/dev/null
build "clean (no cache)"
touch kernels/hopper/common/rope.cu
build "touch rope.cu (mtime only)"
echo "// edited" >> kernels/hopper/common/rope.cu
build "edit rope.cu"
echo "// edited" >> kernels/hopper/common/common.cuh
build "edit common.cuh (included by all)"
