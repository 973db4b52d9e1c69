#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# The chunked Gated DeltaNet prefill (gdn_chunk_min_run) on the H200: check-kernels gdn_chunk and
# gated_delta, greedy ids of a 2.6k-token prompt with it off and at 64, TTFT 1024/8192 both ways
# with a profile, on Qwen3.5-35B-A3B cut to 4 layers (random weights). Needs moe.sh prep's carry.
export RES=/root/res; mkdir -p $RES
bash scripts/gpu/moe.sh prep >/dev/null 2>&1
M=/root/bin/met
$M check-kernels --kernel gdn_chunk > $RES/gdn-check.txt 2>&1; tail -n 3 $RES/gdn-check.txt
$M check-kernels --kernel gated_delta > $RES/gdn-check-all.txt 2>&1; tail -n 1 $RES/gdn-check-all.txt
source scripts/gpu/moe.sh
m=qwen3.5-35b-a3b-4l
checkpoint $m >/dev/null
# met generate needs a tokenizer that covers the config's special ids: the Qwen3 one, without
# Qwen3.5's generation_config.json (its eos id is past that vocabulary).
cp .cache/test-data/qwen3-tokenizer/* "$CKPT/$m/" && rm -f "$CKPT/$m/generation_config.json"
P="$(cat crates/server/tests/fixtures/perplexity/*.txt)"
for t in 0 64; do
  $M generate --model-from-path $CKPT/$m --prompt "$P" --max-tokens 32 --ignore-eos \
    --tune gdn_chunk_min_run=$t --print-ids 2> $RES/gen-$t.err > $RES/gen-$t.out
  tail -n 2 $RES/gen-$t.err | cut -c1-400
done
for t in 0 64; do
  $M bench-model --model-from-path $CKPT/$m --prefill 1024,8192 --batches 1 --context 1024 --tune gdn_chunk_min_run=$t --profile > $RES/bench-gdn-$t.md 2>&1
  grep "^| " $RES/bench-gdn-$t.md | grep -v "device time" | head -5
  grep -A12 "profile: prefill 8192" $RES/bench-gdn-$t.md | grep -i "gdn\|between"
done
