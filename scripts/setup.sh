#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Sets up a fresh machine and builds `met`: installs the pinned nvcc wheels (no GPU or CUDA install
# needed), then builds the release binary with every kernel compiled and embedded.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=$(scripts/install-nvcc.sh)
export NVCC
cargo build --release --locked -p metrale-server --bin met
echo "built target/release/met: $(target/release/met --version)"
