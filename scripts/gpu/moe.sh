#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# The MoE issue's measurements on the GPU machine, in phases (each fits one device call; run
# several in one call with `moe.sh prep parity bench`). Needs the stripped `met` as
# target/ab/met.gz and the Qwen3 tokenizer as target/ab/tok.tgz (both carried).
#
#   prep     unpack met and the tokenizer
#   parity   MODELS (default "qwen3-30b-a3b-4l qwen1.5-moe-a2.7b-4l"): checkpoint, transformers'
#            f32 and bf16 logits (reference_logits.py), met parity --json, and the expert
#            choices that flip between transformers f32 and bf16 (moe_route_flips.py)
#   families check-kernels attention (query groups split by their largest divisor up to 8), then
#            the parity phase on FAMILIES, the families first checked on the host only (default:
#            Mixtral-8x7B and GLM-4.5-Air at 4 layers, OLMoE-1B-7B; a second call:
#            FAMILIES="granite-3.3-8b-4l phi-4-4l seed-oss-36b-4l smollm3-3b")
#   bench    met bench-model on BENCH_MODEL (default qwen3-30b-a3b-4l) under each tuning of
#            BENCH_VARIANTS (entries `name` or `name:key=value+key=value`, passed as --tune; a
#            `q=fp8` entry passes --quantization fp8 instead), TTFT 128/1024/8192, decode batch
#            1/8/16/32/64 at 1024 keys (BENCH_ARGS replaces those), a per-launch profile, into
#            bench-<BENCH_TAG><name>.md; met check-kernels on moe first (BENCH_CHECK=0: not)
#   full     Qwen3-30B-A3B at full depth (48 layers, 61 GB in /dev/shm): met generate batch 1,
#            met bench-model (TTFT 1024/8192; batch 1/8/32/64), transformers eager and static
#            cache + torch.compile decode at batch 1 (scripts/gpu/transformers_decode_speed.py)
#   serve    met serve on the 4-layer qwen3_moe checkpoint (SERVE_MODEL: another), a concurrency
#            sweep (SERVE_CONCURRENCY, default 1 8 32 64) of distinct 288-token prompts, 128 tokens
#            each, through scripts/gpu/prefix_cache_bench.py's throughput workload
#   table    the MoE rows of the kernel table: met bench-kernels --shape TABLE_SHAPE (default
#            qwen3-30b-a3b; also nemotron-3-nano-30b-a3b, or a dense shape such as qwen3-8b) beside
#            scripts/gpu/torch_kernels.py at the same shape (TABLE_TORCH_ARGS: e.g. --fp8),
#            merged by kernel_table.py
#   newkernels  met check-kernels on the kernels not yet run on a GPU (gemv_fp8, gated_delta,
#            the squared-ReLU experts' moe_*_relu2) at SEEDS (default 1 2 3)
#   unverified  met check-kernels on what changed since its last GPU run (attention with 32/2
#            heads, kv_cache, mamba2, and relu2 / moe on the nemotron_h target)
#   fp8      FP8 weights (--quantization fp8) on FP8_MODELS (default qwen3-0.6b qwen3-8b, random
#            weights): met parity in BF16 and in FP8 against transformers' float32 logits, then
#            met bench-model in both (TTFT 1024/8192, decode batch 1/64 at 1024 keys)
#   fixtures the tiny MoE fixtures of crates/model-engine/tests/fixtures (tiny_moe_fixtures.py)
#   hybrid   HYBRID_MODELS (default "qwen3-next-80b-a3b-4l"; also qwen3.5-35b-a3b-4l,
#            nemotron-h-4l, nemotron-3-nano-30b-a3b-4l): checkpoint, transformers' f32 and bf16 logits (reference_logits.py:
#            prefill, then one token a step through its hybrid cache), met parity --json
#   hybridfull  Qwen3.5-35B-A3B at full depth (40 layers, about 70 GB, in /dev/shm when it fits):
#            met bench-model (TTFT 1024/8192; batch 1/8/32/64 at 1024
#            keys), transformers eager decode at batch 1 (HF_MODES to add others)
#   nemotronfull  Nemotron-H-8B at full depth (52 layers, 16 GB): met bench-model (TTFT 1024/8000;
#            batch 1/8/32/64 at 1024 keys, profile), transformers eager decode at batch 1
#   nanofull  NVIDIA-Nemotron-3-Nano-30B-A3B at full depth (52 layers, about 63 GB, in /dev/shm
#            when it fits): met bench-model (TTFT 1024/8192; batch 1/8/32/64 at 1024 keys,
#            profile), transformers eager decode at batch 1 (HF_MODES to add others)
#   hybridserve  met serve on qwen3-next-80b-a3b-4l (SERVE_MODEL: another): 64 concurrent greedy
#            streams with every third cancelled mid-stream, then /metrics must show nothing held
#            and each uncancelled output is compared with the same request alone
#            (serve_cancel_check.py)
#   cuts     Nemotron-H at real widths cut to 2, 3 and 4 layers (patterns "M*", "M*M", "M*M-", same
#            weights for both): transformers' logits, met parity on the cuda and the host backend
#            (the error bisection begun on this machine's host in
#            docs/results/2026-12-04-nemotron-h200/host-cuts)
#   fp8gemm  the FP8 prefill GEMM (fp8_gemm.cu + cuBLASLt's block-scaled FP8, tuning fp8_gemm):
#            check-kernels fp8_gemm with cuBLASLt's log and _fp8_rows, FP8_GEMM_MODEL (default
#            qwen3-8b) parity with --quantization fp8 and fp8_gemm off / on, bench-model both and
#            on with fp8_fused_quantize=off (TTFT 1024/8192, decode
#            batch 1/8/63/64 at 1024 keys; FP8_GEMM_PROFILE=1: with --profile), and the dense kernel
#            table with torch._scaled_mm beside it (FP8_GEMM_TABLE=0: not)
#   fp8moe   FP8 routed experts: check-kernels moe_gemv_fp8, the grouped FP8 forms (mma_fp8,
#            wgmma_fp8) and fp8_dequant, qwen3-30b-a3b-4l parity in BF16 and with --quantization
#            fp8 (experts FP8: moe_fp8_experts=on), bench-model (TTFT 1024/8192, batch
#            1/8/16/32/64 at 1024 keys) BF16, FP8 linears with BF16 experts, FP8 experts, and FP8
#            experts with every step per assignment (moe_grouped_min_rows never); then
#            Qwen3-30B-A3B at full depth with FP8 experts (TTFT 1024/8192, batch 1/8/64)
#   hybridfixtures  the tiny hybrid fixtures (tiny_hybrid_fixtures.py: tiny-qwen3-next,
#            tiny-qwen3-5-moe, tiny-nemotron-h, tiny-nemotron-h-moe; HYBRID_FIXTURES: a subset) into $RES/fixtures
#
# Everything worth keeping collects in $RES, packed into $OUT/moe-results.tgz at the end (the
# device tool returns at most 8 files).
set -uo pipefail
OUT=${OUT:-/root/out}
RES=${RES:-/root/res}
MET=/root/bin/met
CKPT=${CKPT:-/root/ckpt}
REF=/root/ref
TOK=.cache/test-data/qwen3-tokenizer
mkdir -p "$OUT" "$RES" "$CKPT" "$REF"
export PYTHONUNBUFFERED=1

log() { echo "== $(date -u +%H:%M:%S) $*"; }

prep() {
    mkdir -p /root/bin .cache/test-data
    gunzip -c target/ab/met.gz >"$MET" && chmod +x "$MET"
    tar xzf target/ab/tok.tgz -C .cache/test-data
    "$MET" --version
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
}

checkpoint() {  # name [out-dir]
    python3 scripts/gpu/make_checkpoints.py --out "${2:-$CKPT}" --models "$1" --seed 0 --no-verify \
        --tokenizer qwen3=$TOK 2>&1 | tail -3
}

parity() {
    for m in ${MODELS:-qwen3-30b-a3b-4l qwen1.5-moe-a2.7b-4l}; do
        log "parity $m"
        checkpoint "$m"
        python3 scripts/gpu/reference_logits.py --model "$CKPT/$m" --out "$REF/$m.safetensors" \
            --prompt-tokens 128 --decode-steps 64 --long-prompt-tokens 1024 --seed 0 \
            --dtype float32 --also-bf16 2>&1 | tail -2
        "$MET" parity --backend cuda --model-from-path "$CKPT/$m" --reference "$REF/$m.safetensors" \
            --json "$RES/parity-$m.json" --routing-out "$RES/routing-$m.json" 2>&1 | tee "$RES/parity-$m.txt" | tail -6
        python3 scripts/gpu/moe_route_flips.py --model "$CKPT/$m" --reference "$REF/$m.safetensors" \
            --engine-routing "$RES/routing-$m.json" \
            --parity-json "$RES/parity-$m.json" --out "$RES/flips-$m.json" 2>&1 | tail -25
    done
}

families() {
    # The decode attention now splits any query group wider than 8 (GLM-4.5-Air's 12) by its
    # largest divisor up to 8: its cases first (24/2 heads among them).
    log "check-kernels attention"
    "$MET" check-kernels --kernel attention 2>&1 | tee "$RES/families-check-attention.txt" | \
        grep -E 'cases pass|FAIL' | tail -6
    MODELS="${FAMILIES:-mixtral-8x7b-4l glm-4.5-air-4l olmoe-1b-7b}" parity
}

bench() {
    local m=${BENCH_MODEL:-qwen3-30b-a3b-4l}
    checkpoint "$m"
    if [ "${BENCH_CHECK:-1}" = 1 ]; then
        log "check-kernels moe"
        "$MET" check-kernels --kernel moe 2>&1 | tail -4
    fi
    for v in ${BENCH_VARIANTS:-tree}; do
        local name=${v%%:*} tune=()
        if [[ "$v" == *:* ]]; then
            IFS='+' read -ra kv <<<"${v#*:}"
            for p in "${kv[@]}"; do
                if [ "$p" = q=fp8 ]; then tune+=(--quantization fp8); else tune+=(--tune "$p"); fi
            done
        fi
        log "bench $m $name ${tune[*]:-}"
        # shellcheck disable=SC2086
        "$MET" bench-model --model-from-path "$CKPT/$m" \
            ${BENCH_ARGS:---prefill 128,1024,8192 --batches 1,8,16,32,64} --context 1024 --profile \
            "${tune[@]}" >"$RES/bench-${BENCH_TAG:-}$name.md" 2>&1
        grep "^| " "$RES/bench-${BENCH_TAG:-}$name.md" | grep -v "device time" | head -12
    done
}

full() {
    local m=qwen3-30b-a3b dir=/dev/shm/ckpt
    # 61 GB: /dev/shm when it has the room (memory-backed, so loading is not a disk read), else
    # the disk.
    local free_gb
    free_gb=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)
    [ "${free_gb:-0}" -ge 64 ] || dir=$CKPT
    df -h /dev/shm "$CKPT" | tail -2
    log "checkpoint $m (full depth) in $dir"
    checkpoint "$m" "$dir"
    df -h /dev/shm | tail -1
    log "met generate"
    "$MET" generate --backend cuda --model-from-path "$dir/$m" --prompt "hello x31" --max-tokens 256 \
        --temperature 0 --ignore-eos --max-seq-len 1024 --warm-up 2>&1 | tee "$RES/full-generate.txt" | tail -4
    log "met bench-model"
    "$MET" bench-model --model-from-path "$dir/$m" --prefill 1024,8192 --batches 1,8,32,64 \
        --context 1024 --profile >"$RES/full-bench.md" 2>&1
    grep "^| " "$RES/full-bench.md" | head -14
    log "transformers decode (eager, static cache + compile loop)"
    for mode in ${HF_MODES:-eager static_compile_loop}; do
        timeout "${HF_TIMEOUT:-240}" python3 scripts/gpu/transformers_decode_speed.py --model "$dir/$m" \
            --prompt-tokens 32 --new-tokens 64 --batch 1 --modes "$mode" --warmup 2 --repeats 3 \
            --json "$RES/full-hf-$mode.json" 2>&1 | tail -3
    done
}

serve() {
    # The 4-layer checkpoint unless SERVE_MODEL names another (the bench phase makes it).
    local model=${SERVE_MODEL:-$CKPT/qwen3-30b-a3b-4l} port=8899 log="$RES/serve.log"
    [ -f "$model/config.json" ] || checkpoint qwen3-30b-a3b-4l
    "$MET" serve --backend cuda --model-from-path "$model" --port $port --max-seq-len 4096 \
        --max-num-seqs 256 >"$log" 2>&1 &
    local pid=$! n=0
    until grep -q "Listening on" "$log"; do
        sleep 1; n=$((n + 1))
        if ! kill -0 $pid 2>/dev/null || [ $n -ge 240 ]; then tail -20 "$log"; kill -INT $pid; return 1; fi
    done
    log "serve sweep on $model"
    for c in ${SERVE_CONCURRENCY:-1 8 32 64}; do
        # Distinct prompts (one prefix each, nothing shared), 2 x c requests of 128 tokens.
        local n_req=$((c * 2 < 8 ? 8 : c * 2))
        timeout 200 python3 scripts/gpu/prefix_cache_bench.py --base-url "http://127.0.0.1:$port" \
            --workload throughput --label "moe-c$c" --concurrency "$c" --requests "$n_req" \
            --prefixes "$n_req" --prefix-len 256 --suffix-len 32 --max-tokens 128 \
            --out "$RES/serve.jsonl" >/dev/null 2>&1 || echo "serve sweep: concurrency $c FAILED"
        python3 - "$RES/serve.jsonl" <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])][-1]
print(f"concurrency {r['concurrency']}: {r['requests']} requests, {r['output_tokens']} tokens, "
      f"{r['output_tok_per_s']:.0f} tok/s, TTFT p50 {r['ttft_p50_ms']:.1f} ms p99 {r['ttft_p99_ms']:.1f} ms")
PY
    done
    curl -s "http://127.0.0.1:$port/metrics" >"$RES/serve-metrics.txt"
    kill -INT $pid; wait $pid
    grep -ci "error" "$log" | sed 's/^/serve log lines with "error": /'
}

table() {
    # The MoE rows of the kernel table: met bench-kernels at TABLE_SHAPE's expert shapes (default
    # Qwen3-30B-A3B's; nemotron-3-nano-30b-a3b for the squared-ReLU experts) beside transformers'
    # routed MLP at the same labels.
    local shape=${TABLE_SHAPE:-qwen3-30b-a3b} sfx=
    [ "$shape" = qwen3-30b-a3b ] || sfx=-$shape
    "$MET" bench-kernels --shape "$shape" --prefill 1024,8192 --json "$RES/bench-kernels-moe$sfx.json" \
        >"$RES/bench-kernels-moe$sfx.md" 2>&1
    # shellcheck disable=SC2086
    python3 scripts/gpu/torch_kernels.py --shape "$shape" --prefill 1024,8192 ${TABLE_TORCH_ARGS:-} \
        --json "$RES/torch-kernels-moe$sfx.json" >"$RES/torch-kernels-moe$sfx.txt" 2>&1 \
        || tail -5 "$RES/torch-kernels-moe$sfx.txt"
    python3 scripts/gpu/kernel_table.py --met "$RES/bench-kernels-moe$sfx.json" \
        --torch "$RES/torch-kernels-moe$sfx.json" --json "$RES/kernel-table-moe$sfx.json" \
        | tee "$RES/kernel-table-moe$sfx.md" | tail -40
}

newkernels() {
    # Kernels written without a GPU (FP8 GEMV, Gated DeltaNet): check-kernels at a few seeds.
    for seed in ${SEEDS:-1 2 3}; do
        "$MET" check-kernels --kernel gemv_fp8 --seed "$seed" 2>&1 | tail -2
        "$MET" check-kernels --kernel gated_delta --seed "$seed" 2>&1 | tail -2
        "$MET" check-kernels --kernel gated_norm --seed "$seed" 2>&1 | tail -2
        "$MET" check-kernels --kernel relu2 --seed "$seed" 2>&1 | tail -2
    done | tee "$RES/newkernels.txt"
    # The unit-offset norm cases (norm_offset) live among rmsnorm's and qkv_post's.
    for k in rmsnorm qkv_post mamba2 relu2; do
        "$MET" check-kernels --kernel "$k" 2>&1 | tail -2
    done | tee -a "$RES/newkernels.txt"
}

unverified() {
    # The kernels and cases written or changed since their last GPU run (2026-12-04 evening): the
    # decode attention over query groups of 16 (32/2 heads), the squared-ReLU experts with their
    # rounding allowance (the nemotron_h target), the FP8 KV cache and the chunked Mamba-2 walk.
    for k in attention kv_cache mamba2; do
        log "check-kernels $k"
        "$MET" check-kernels --kernel "$k" 2>&1 | grep -E 'cases pass|FAIL' | tail -6
    done | tee "$RES/unverified.txt"
    log "check-kernels relu2, moe (nemotron_h)"
    for k in relu2 moe; do
        "$MET" check-kernels --kernel-target nemotron_h --kernel "$k" 2>&1 | grep -E 'cases pass|FAIL' | tail -6
    done | tee -a "$RES/unverified.txt"
}

fp8() {
    for m in ${FP8_MODELS:-qwen3-0.6b qwen3-8b}; do
        log "fp8 $m"
        checkpoint "$m"
        python3 scripts/gpu/reference_logits.py --model "$CKPT/$m" --out "$REF/$m.safetensors" \
            --prompt-tokens 128 --decode-steps 64 --long-prompt-tokens 1024 --seed 0 \
            --dtype float32 --also-bf16 2>&1 | tail -2
        for q in bf16 fp8; do
            local qa=()
            [ "$q" = fp8 ] && qa=(--quantization fp8)
            "$MET" parity --backend cuda --model-from-path "$CKPT/$m" --reference "$REF/$m.safetensors" \
                "${qa[@]}" --json "$RES/fp8-parity-$m-$q.json" 2>&1 | tee "$RES/fp8-parity-$m-$q.txt" | tail -6
            "$MET" bench-model --model-from-path "$CKPT/$m" "${qa[@]}" --prefill 1024,8192 --batches 1,64 \
                --context 1024 >"$RES/fp8-bench-$m-$q.md" 2>&1
            grep "^| " "$RES/fp8-bench-$m-$q.md" | head -10
        done
        rm -rf "${CKPT:?}/$m" "$REF/$m.safetensors"
    done
}

fixtures() {
    python3 scripts/gpu/tiny_moe_fixtures.py --out "$RES/fixtures" --only tiny-minimax-m2 2>&1 | tail -8
}

hybrid() {
    for m in ${HYBRID_MODELS:-qwen3-next-80b-a3b-4l}; do
        log "hybrid parity $m"
        checkpoint "$m"
        python3 scripts/gpu/reference_logits.py --model "$CKPT/$m" --out "$REF/$m.safetensors" \
            --prompt-tokens 128 --decode-steps 64 --long-prompt-tokens 1024 --seed 0 \
            --dtype float32 --also-bf16 2>&1 | tail -2
        "$MET" parity --backend cuda --model-from-path "$CKPT/$m" --reference "$REF/$m.safetensors" \
            --json "$RES/parity-$m.json" 2>&1 | tee "$RES/parity-$m.txt" | tail -6
    done
}

hybridfull() {
    local m=qwen3.5-35b-a3b dir=/dev/shm/ckpt free_gb
    free_gb=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)
    [ "${free_gb:-0}" -ge 74 ] || dir=$CKPT
    log "checkpoint $m (full depth) in $dir"
    checkpoint "$m" "$dir"
    # No Qwen3.5 tokenizer on the machine (make_checkpoints.py copies none): bench-model's decode
    # steps are the batch-1 figure.
    log "met bench-model"
    "$MET" bench-model --model-from-path "$dir/$m" --prefill 1024,8192 --batches 1,8,32,64 \
        --context 1024 --profile >"$RES/hybridfull-bench.md" 2>&1
    grep "^| " "$RES/hybridfull-bench.md" | head -14
    for mode in ${HF_MODES:-eager}; do
        timeout "${HF_TIMEOUT:-200}" python3 scripts/gpu/transformers_decode_speed.py --model "$dir/$m" \
            --prompt-tokens 32 --new-tokens 64 --batch 1 --modes "$mode" --warmup 2 --repeats 3 \
            --json "$RES/hybridfull-hf-$mode.json" 2>&1 | tail -3
    done
}

nemotronfull() {
    # Nemotron-H-8B at full depth (16 GB): met bench-model (TTFT 1024/8192, batch 1/8/32/64 at
    # 1024 keys, a profile) and transformers eager decode at batch 1.
    local m=nemotron-h-8b
    log "checkpoint $m"
    checkpoint "$m"
    log "met bench-model"
    # Its max_position_embeddings is 8192, so the long prompt is 8000 tokens.
    "$MET" bench-model --model-from-path "$CKPT/$m" --prefill 1024,8000 --batches 1,8,32,64 \
        --context 1024 --profile >"$RES/nemotronfull-bench.md" 2>&1
    grep "^| " "$RES/nemotronfull-bench.md" | head -14
    for mode in ${HF_MODES:-eager}; do
        timeout "${HF_TIMEOUT:-200}" python3 scripts/gpu/transformers_decode_speed.py --model "$CKPT/$m" \
            --prompt-tokens 32 --new-tokens 64 --batch 1 --modes "$mode" --warmup 2 --repeats 3 \
            --json "$RES/nemotronfull-hf-$mode.json" 2>&1 | tail -3
    done
}

nanofull() {
    # NVIDIA-Nemotron-3-Nano-30B-A3B at full depth (about 63 GB): met bench-model (TTFT 1024/8192,
    # batch 1/8/32/64 at 1024 keys, a profile) and transformers eager decode at batch 1.
    local m=nemotron-3-nano-30b-a3b dir=/dev/shm/ckpt free_gb
    free_gb=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)
    [ "${free_gb:-0}" -ge 68 ] || dir=$CKPT
    log "checkpoint $m (full depth) in $dir"
    checkpoint "$m" "$dir"
    log "met bench-model"
    "$MET" bench-model --model-from-path "$dir/$m" --prefill 1024,8192 --batches 1,8,32,64 \
        --context 1024 --profile >"$RES/nanofull-bench.md" 2>&1
    grep "^| " "$RES/nanofull-bench.md" | head -14
    for mode in ${HF_MODES:-eager}; do
        timeout "${HF_TIMEOUT:-200}" python3 scripts/gpu/transformers_decode_speed.py --model "$dir/$m" \
            --prompt-tokens 32 --new-tokens 64 --batch 1 --modes "$mode" --warmup 2 --repeats 3 \
            --json "$RES/nanofull-hf-$mode.json" 2>&1 | tail -3
    done
}

hybridserve() {
    local model=${SERVE_MODEL:-$CKPT/qwen3-next-80b-a3b-4l} port=8899 log="$RES/hybridserve.log"
    [ -f "$model/config.json" ] || checkpoint "$(basename "$model")"
    "$MET" serve --backend cuda --model-from-path "$model" --port $port --max-seq-len 4096 \
        --max-num-seqs 256 >"$log" 2>&1 &
    local pid=$! n=0
    until grep -q "Listening on" "$log"; do
        if ! kill -0 $pid 2>/dev/null || [ $n -ge 300 ]; then
            echo "met serve did not start:"; tail -20 "$log"; kill -INT $pid 2>/dev/null; return 1
        fi
        sleep 1; n=$((n + 1))
    done
    grep -i "recurrent state\|KV cache" "$log" | head -3
    python3 scripts/gpu/serve_cancel_check.py --url "http://127.0.0.1:$port" --streams 64 \
        --max-tokens 64 | tee "$RES/hybridserve.json"
    curl -s "http://127.0.0.1:$port/metrics" >"$RES/hybridserve-metrics.txt"
    kill -INT $pid; wait $pid
    grep -ci "error" "$log" | sed 's/^/serve log lines with "error": /'
}

cuts() {
    # make_checkpoints.py names a checkpoint with overrides `<name>+smoke`. Both backends of met run
    # on the same checkpoint and reference (the host backend on this machine's cores).
    local pats=('M*' 'M*M' 'M*M-') pat n d m
    for pat in "${pats[@]}"; do
        n=${#pat} d=$CKPT/cut-$n m=$CKPT/cut-$n/nemotron-h-4l+smoke
        log "cut $pat"
        python3 scripts/gpu/make_checkpoints.py --out "$d" --models nemotron-h-4l --seed 0 --no-verify \
            --override "hybrid_override_pattern=\"$pat\"" --override num_hidden_layers=$n 2>&1 | tail -1
        python3 scripts/gpu/reference_logits.py --model "$m" --out "$REF/cut-$n.safetensors" \
            --prompt-tokens 128 --decode-steps 4 --seed 0 --dtype float32 --also-bf16 2>&1 | tail -1
        for b in cuda host; do
            "$MET" parity --backend $b --model-from-path "$m" --reference "$REF/cut-$n.safetensors" \
                --json "$RES/cut$n-$b-parity.json" 2>&1 | tee "$RES/cut$n-$b-parity.txt" | tail -4
        done
        rm -rf "$d"
    done
}

fp8moe() {
    local m=qwen3-30b-a3b-4l
    log "check-kernels moe_gemv_fp8, mma_fp8, wgmma_fp8, fp8_dequant"
    { for k in moe_gemv_fp8 mma_fp8 wgmma_fp8 fp8_dequant; do "$MET" check-kernels --kernel $k; done; } \
        >"$RES/fp8moe-check.txt" 2>&1
    grep -E "cases pass|fail" "$RES/fp8moe-check.txt" | grep -v "^checking" | tail -8
    checkpoint "$m"
    python3 scripts/gpu/reference_logits.py --model "$CKPT/$m" --out "$REF/$m.safetensors" \
        --prompt-tokens 128 --decode-steps 64 --long-prompt-tokens 1024 --seed 0 \
        --dtype float32 --also-bf16 2>&1 | tail -1 | cut -c1-200
    for q in bf16 fp8; do
        local qa=()
        [ "$q" = fp8 ] && qa=(--quantization fp8 --tune moe_fp8_experts=on)
        log "parity $m $q"
        "$MET" parity --backend cuda --model-from-path "$CKPT/$m" --reference "$REF/$m.safetensors" \
            "${qa[@]}" --json "$RES/fp8moe-parity-$q.json" 2>&1 | tee "$RES/fp8moe-parity-$q.txt" | tail -5
    done
    BENCH_MODEL=$m BENCH_CHECK=0 BENCH_TAG=fp8moe- \
        BENCH_VARIANTS="bf16 fp8bf16experts:q=fp8 fp8:q=fp8+moe_fp8_experts=on fp8never:q=fp8+moe_fp8_experts=on+moe_grouped_min_rows=1000000" \
        BENCH_ARGS="--prefill 1024,8192 --batches 1,8,16,32,64" bench
    local full=qwen3-30b-a3b dir=/dev/shm/ckpt
    log "checkpoint $full (full depth) in $dir"
    checkpoint "$full" "$dir"
    log "bench-model $full (48 layers) fp8"
    "$MET" bench-model --model-from-path "$dir/$full" --quantization fp8 --tune moe_fp8_experts=on --prefill 1024,8192 \
        --batches 1,8,64 --context 1024 --profile >"$RES/fp8moe-full-bench.md" 2>&1
    grep "^| " "$RES/fp8moe-full-bench.md" | head -9
}

hybridfixtures() {
    local only=()
    [ -n "${HYBRID_FIXTURES:-}" ] && only=(--only "$HYBRID_FIXTURES")
    python3 scripts/gpu/tiny_hybrid_fixtures.py --out "$RES/fixtures" "${only[@]}" 2>&1 | tail -12
}

fp8gemm() {
    local m=${FP8_GEMM_MODEL:-qwen3-8b}
    log "check-kernels fp8_gemm"
    METRALE_BLASLT_LOG=1 "$MET" check-kernels --kernel fp8_gemm >"$RES/fp8gemm-check.txt" 2>&1
    tail -12 "$RES/fp8gemm-check.txt"
    log "check-kernels _fp8_rows (the add + RMSNorm and SiLU x up that write the e4m3 rows)"
    "$MET" check-kernels --kernel _fp8_rows >"$RES/fp8rows-check.txt" 2>&1
    tail -8 "$RES/fp8rows-check.txt"
    checkpoint "$m"
    python3 scripts/gpu/reference_logits.py --model "$CKPT/$m" --out "$REF/$m.safetensors" \
        --prompt-tokens 128 --decode-steps 64 --long-prompt-tokens 1024 --seed 0 \
        --dtype float32 --also-bf16 2>&1 | tail -2
    for g in off on; do
        log "fp8 $m fp8_gemm=$g"
        "$MET" parity --backend cuda --model-from-path "$CKPT/$m" --reference "$REF/$m.safetensors" \
            --quantization fp8 --tune fp8_gemm=$g --json "$RES/fp8gemm-parity-$m-$g.json" 2>&1 \
            | tee "$RES/fp8gemm-parity-$m-$g.txt" | tail -6
        "$MET" bench-model --model-from-path "$CKPT/$m" --quantization fp8 --tune fp8_gemm=$g \
            --prefill 1024,8192 --batches 1,8,63,64 --context 1024 ${FP8_GEMM_PROFILE:+--profile} \
            >"$RES/fp8gemm-bench-$m-$g.md" 2>&1
        grep "^| " "$RES/fp8gemm-bench-$m-$g.md" | head -12
    done
    log "fp8 $m fp8_gemm=on fp8_fused_quantize=off (the separate quantize launches)"
    "$MET" bench-model --model-from-path "$CKPT/$m" --quantization fp8 --tune fp8_gemm=on \
        --tune fp8_fused_quantize=off --prefill 1024,8192 --batches 1,8,63,64 --context 1024 \
        ${FP8_GEMM_PROFILE:+--profile} >"$RES/fp8gemm-bench-$m-unfused.md" 2>&1
    grep "^| " "$RES/fp8gemm-bench-$m-unfused.md" | head -12
    if [ "${FP8_GEMM_TABLE:-1}" = 1 ]; then
        TABLE_SHAPE=$m TABLE_TORCH_ARGS=--fp8 table >/dev/null
        grep -i "fp8" "$RES/kernel-table-moe-$m.md" | head -40
    fi
}
for phase in "$@"; do
    log "phase $phase"
    "$phase"
done
tar czf "$OUT/moe-results.tgz" -C "$RES" .
# (a caller that may be cut off runs `timeout N moe.sh ...; tar czf ...` itself)
