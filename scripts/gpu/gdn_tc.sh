#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# The chunked Gated DeltaNet prefill on tensor cores (gdn_chunk_tensor_cores) on the H200:
# check-kernels of both chunked pairs, greedy ids of a 2.6k-token prompt and TTFT 1024/8192 with
# a profile, the tensor-core pair against the CUDA-core one (both at gdn_chunk_min_run=64), on
# Qwen3.5-35B-A3B cut to 4 layers (random weights). Needs moe.sh prep's carry, as gdn_chunk_ab.sh.
export RES=/root/res; mkdir -p $RES
bash scripts/gpu/moe.sh prep >/dev/null 2>&1
M=/root/bin/met
$M check-kernels --kernel gated_delta_tc > $RES/gdn-tc-check.txt 2>&1; tail -n 3 $RES/gdn-tc-check.txt
$M check-kernels --kernel gdn_chunk > $RES/gdn-check.txt 2>&1; tail -n 1 $RES/gdn-check.txt
source scripts/gpu/moe.sh
m=qwen3.5-35b-a3b-4l
checkpoint $m >/dev/null
# met generate needs a tokenizer that covers the config's special ids (see gdn_chunk_ab.sh).
cp .cache/test-data/qwen3-tokenizer/* "$CKPT/$m/" && rm -f "$CKPT/$m/generation_config.json"
P="$(cat crates/server/tests/fixtures/perplexity/*.txt)"
for tc in off on; do
  $M generate --model-from-path $CKPT/$m --prompt "$P" --max-tokens 32 --ignore-eos \
    --tune gdn_chunk_min_run=64 --tune gdn_chunk_tensor_cores=$tc --print-ids \
    2> $RES/gen-tc-$tc.err > $RES/gen-tc-$tc.out
  tail -n 2 $RES/gen-tc-$tc.err | cut -c1-400
done
for tc in off on; do
  $M bench-model --model-from-path $CKPT/$m --prefill 1024,8192 --batches 1 --context 1024 \
    --tune gdn_chunk_min_run=64 --tune gdn_chunk_tensor_cores=$tc --profile \
    > $RES/bench-gdn-tc-$tc.md 2>&1
  grep "^| " $RES/bench-gdn-tc-$tc.md | grep -v "device time" | head -5
  grep -A12 "profile: prefill 8192" $RES/bench-gdn-tc-$tc.md | grep -i "gdn\|between"
done
