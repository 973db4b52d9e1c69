#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# The FP8 KV cache and the chunked Mamba-2 prefill on the H200, in phases (moe.sh's prep first:
# met in /root/bin). Results in $RES.
#   checks  met check-kernels on the kernels they add or touch: mamba2 (incl. the chunked
#           passes), attention, qkv_, kv_cache (the FP8 forms and their bf16 twins)
#   ssd     Nemotron-H-8B (52 layers): bench-model TTFT 1024/8000 and batch 1 under the kernel
#           tree's tuning (runs of 128+ tokens chunked) and with ssd_chunk_min_run=0 (token by
#           token); then the 4-layer cut's parity (its 128-token prompt now chunked) under the
#           tree and with prefill_attention v1 and v2 (which kernel adds Nemotron-H's error at
#           some prompt positions?)
#   kvfp8   Qwen3-8B (random weights): bench-model with --kv-cache-dtype bf16 and fp8, batch 1 at
#           32768 keys (TTFT 8192) and batch 64 at 4096 keys
set -uo pipefail
RES=${RES:-/root/res}
CKPT=${CKPT:-/root/ckpt}
REF=/root/ref
MET=/root/bin/met
mkdir -p "$RES" "$CKPT" "$REF"
log() { echo "== $(date -u +%H:%M:%S) $*"; }
ckpt() { [ -f "$CKPT/$1/config.json" ] || python3 scripts/gpu/make_checkpoints.py --out "$CKPT" \
    --models "$1" --seed 0 --no-verify 2>&1 | tail -1; }

checks() {
    for k in mamba2 attention qkv_ kv_cache; do
        log "check-kernels $k"
        "$MET" check-kernels --kernel "$k" 2>&1 | grep -E 'cases pass|FAIL' | tail -6
    done 2>&1 | tee "$RES/checks.txt"
}

ssd() {
    local m=nemotron-h-8b
    ckpt $m
    for v in tree walk; do
        local t=()
        [ "$v" = walk ] && t=(--tune ssd_chunk_min_run=0)
        "$MET" bench-model --model-from-path "$CKPT/$m" --prefill 1024,8000 --batches 1 \
            --context 1024 --profile "${t[@]}" >"$RES/ssd-$m-$v.md" 2>&1
        log "$m $v"; grep '^| prefill\|^| decode step |\|^| mamba_ssd' "$RES/ssd-$m-$v.md"
    done
    rm -rf "${CKPT:?}/$m"
    m=nemotron-h-4l
    ckpt $m
    python3 scripts/gpu/reference_logits.py --model "$CKPT/$m" --out "$REF/$m.safetensors" \
        --prompt-tokens 128 --decode-steps 64 --long-prompt-tokens 1024 --seed 0 \
        --dtype float32 --also-bf16 2>&1 | tail -1 | cut -c1-200
    for v in tree v1 v2; do
        local t=()
        [ "$v" != tree ] && t=(--tune "prefill_attention=$v")
        "$MET" parity --backend cuda --model-from-path "$CKPT/$m" --reference "$REF/$m.safetensors" \
            "${t[@]}" --json "$RES/parity-$m-$v.json" >"$RES/parity-$m-$v.txt" 2>&1
        log "parity $m $v"; grep '^| [pdl]' "$RES/parity-$m-$v.txt"
        python3 - "$RES/parity-$m-$v.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
above = [(x["phase"], x["position"], round(x["rel"] / x["transformers_bf16_rel"], 2)) for x in d
         if x["rel"] > x["transformers_bf16_rel"]]
at = {x["position"]: x["rel"] for x in d if x["phase"] == "prefill"}
print(f"above transformers-bf16: {len(above)} {above[:14]}; prompt 34/73: {at[34]:.4f} {at[73]:.4f}")
PY
    done
}

kvfp8() {
    local m=qwen3-8b
    ckpt $m
    for dt in bf16 fp8; do
        "$MET" bench-model --model-from-path "$CKPT/$m" --kv-cache-dtype $dt --prefill 8192 \
            --batches 1 --context 32768 >"$RES/kvfp8-$m-$dt-32k.md" 2>&1
        "$MET" bench-model --model-from-path "$CKPT/$m" --kv-cache-dtype $dt --prefill 1024 \
            --batches 64 --context 4096 >"$RES/kvfp8-$m-$dt-b64.md" 2>&1
        log "kv $dt"; grep -h '^| prefill\|^| decode step |' "$RES/kvfp8-$m-$dt-32k.md" "$RES/kvfp8-$m-$dt-b64.md"
    done
}

for phase in "$@"; do "$phase"; done
