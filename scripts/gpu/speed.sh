#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# The speed issue's harness on the GPU machine, in phases that fit the device tool's 10-minute
# calls (run `first-models.sh stash <met>` and `MODELS=qwen3-0.6b,qwen3-8b first-models.sh prep`
# first: this script reuses its stash and checkpoints).
#
#   kernels   met bench-kernels and scripts/gpu/torch_kernels.py on the same shapes, merged into
#             the kernel table by scripts/gpu/kernel_table.py (qwen3-8b and qwen3-0.6b)
#   models    met bench-model (TTFT at 128/1024/8192, decode step at batch 1/8/32/64 against its
#             memory floor), met generate batch-1 decode, and transformers eager and
#             static+compile (manual loop) at batch 1, 8 and 32, each in its own process
#
# Results collect in $RES and are packed into $OUT/speed-<phase>.tgz with a summary table.
set -uo pipefail
STASH=${STASH:-/root/stash}
OUT=${OUT:-gpu-out}
RES=${RES:-/root/results-speed}
CKPT=${CKPT:-/root/ckpt}
mkdir -p "$OUT" "$RES"
met="$STASH/met"
export PYTHONUNBUFFERED=1
summary=()
record() { summary+=("| $1 | $2 |"); }
finish() {
  tar czf "$OUT/speed-$phase.tgz" -C "$RES" .
  echo
  echo "| step | result |"
  echo "|---|---|"
  printf '%s\n' "${summary[@]}"
}

phase=${1:?phase}
case "$phase" in
kernels)
  "$met" --version | tee "$RES/met-version.txt"
  for shape in qwen3-8b qwen3-0.6b; do
    timeout 150 "$met" bench-kernels --shape $shape --json "$RES/bench-kernels-$shape.json" > "$RES/bench-kernels-$shape.md" 2>&1
    record "met bench-kernels $shape" "exit $?"
    timeout 150 python3 scripts/gpu/torch_kernels.py --shape $shape --json "$RES/torch-kernels-$shape.json" \
      > "$RES/torch-kernels-$shape.log" 2>&1
    record "torch_kernels.py $shape" "exit $?"
    python3 scripts/gpu/kernel_table.py --met "$RES/bench-kernels-$shape.json" --torch "$RES/torch-kernels-$shape.json" \
      --json "$RES/kernel-table-$shape.json" > "$RES/kernel-table-$shape.md" 2>&1
    record "kernel table $shape" "exit $? ($(grep -c '^- ' "$RES/kernel-table-$shape.md") rows where met is not faster)"
  done
  finish
  ;;
models)
  "$met" --version | tee "$RES/met-version.txt"
  for m in ${SPEED_MODELS:-qwen3-8b qwen3-0.6b}; do
    timeout 200 "$met" bench-model --model-from-path "$CKPT/$m" --json "$RES/bench-model-$m.json" > "$RES/bench-model-$m.md" 2>&1
    record "met bench-model $m" "exit $?"
    prompt=$(python3 -c "print(' '.join(['hello'] * 31))")
    "$met" generate --backend cuda --model-from-path "$CKPT/$m" --prompt "$prompt" --max-tokens 256 --temperature 0 \
      --ignore-eos --max-seq-len 1024 --warm-up > "$RES/met-decode-$m.txt" 2>&1
    record "met generate $m batch 1" "$(grep 'tok/s' "$RES/met-decode-$m.txt")"
    batches=${HF_BATCHES:-1 8 32}
    [ "$m" = qwen3-0.6b ] && batches=1
    for b in $batches; do
      for mode in ${HF_MODES:-static_compile_loop eager}; do
        timeout "${HF_TIMEOUT:-240}" python3 scripts/gpu/transformers_decode_speed.py --model "$CKPT/$m" --prompt-tokens 32 \
          --new-tokens 256 --batch "$b" --modes "$mode" --json "$RES/hf-$m-b$b-$mode.json" > "$RES/hf-$m-b$b-$mode.log" 2>&1
        record "transformers $m batch $b $mode" "exit $? ($(grep -o '"decode_tok_s": [0-9.]*' "$RES/hf-$m-b$b-$mode.log" | head -1))"
      done
    done
  done
  finish
  ;;
*)
  echo "unknown phase $phase" >&2
  exit 2
  ;;
esac
