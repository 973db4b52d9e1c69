#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Builds `met` at several git revisions for one A/B call on the GPU machine (scripts/gpu/speed.sh
# ab) and packs them to carry: each NAME=REV builds REV in a throwaway worktree (sharing this
# checkout's target directory, so unchanged crates and kernels are not rebuilt), strips the binary
# to .cache/ab/NAME, and the binaries built go into .cache/carry/ab.tgz (carry .cache/carry; unpack
# on the GPU machine with `mkdir -p /root/stash && tar xzf .cache/carry/ab.tgz -C /root/stash`).
# Needs nvcc (scripts/install-nvcc.sh) and strip.
#
#   scripts/ab-build.sh met=main met_n=wip/gemv-norm
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: $0 NAME=REV..." >&2; exit 2; }
NVCC=${NVCC:-$(scripts/install-nvcc.sh)}
export NVCC
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
root=$PWD
names=()
mkdir -p .cache/ab .cache/carry
for spec in "$@"; do
  name=${spec%%=*} rev=${spec#*=}
  [ "$name" != "$spec" ] && [ -n "$name" ] && [ -n "$rev" ] || { echo "bad NAME=REV: $spec" >&2; exit 2; }
  tree=$(mktemp -d /tmp/metrale-ab-XXXXXX)
  git worktree add -q --detach "$tree" "$rev"
  echo "== $name: $(git -C "$tree" log --oneline -1)" >&2
  (cd "$tree" && cargo build --release --locked -p metrale-server --bin met)
  strip -o "$root/.cache/ab/$name" "$CARGO_TARGET_DIR/release/met"
  git worktree remove --force "$tree"
  names+=("$name")
done
tar -C .cache/ab -czf .cache/carry/ab.tgz "${names[@]}"
ls -l .cache/carry/ab.tgz >&2
