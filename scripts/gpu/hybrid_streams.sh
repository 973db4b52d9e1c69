#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Whether the hybrid products (up, attn_gate, gdn_in/out, mamba_in/out) take the bulk-copy GEMV
# stream at batch 1: met bench-model on Nemotron-H-8B and Qwen3.5-35B-A3B at full depth under the
# kernel tree's tuning and under the previous stream set (qkv, o, gate_up, down), in one call.
# Needs moe.sh's prep (met in /root/bin); results in $RES.
set -uo pipefail
RES=${RES:-/root/res}
CKPT=${CKPT:-/root/ckpt}
MET=/root/bin/met
mkdir -p "$RES"
old=(--tune gemv_stream=qkv+o+gate_up+down)
run() {  # model-dir name prefill...
    local dir=$1 name=$2 prefill=$3
    for v in tree old; do
        local t=()
        [ "$v" = old ] && t=("${old[@]}")
        "$MET" bench-model --model-from-path "$dir" --prefill "$prefill" --batches 1,8,32,64 \
            --context 1024 --profile "${t[@]}" >"$RES/streams-$name-$v.md" 2>&1
        echo "== $name $v"; grep "^| decode step |\|^| prefill" "$RES/streams-$name-$v.md"
    done
}
if [ "${SKIP_NEMOTRON:-0}" != 1 ]; then
    [ -f "$CKPT/nemotron-h-8b/config.json" ] || python3 scripts/gpu/make_checkpoints.py --out "$CKPT" \
        --models nemotron-h-8b --seed 0 --no-verify 2>&1 | tail -1
    run "$CKPT/nemotron-h-8b" nemotron-h-8b 1024,8000
    rm -rf "${CKPT:?}/nemotron-h-8b"
fi
if [ "${SKIP_QWEN35:-0}" != 1 ]; then
    dir=/dev/shm/ckpt
    mkdir -p $dir
    python3 scripts/gpu/make_checkpoints.py --out $dir --models qwen3.5-35b-a3b --seed 0 --no-verify 2>&1 | tail -1
    run "$dir/qwen3.5-35b-a3b" qwen3.5-35b-a3b 1024,8192
fi
