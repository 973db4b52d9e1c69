#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Issue 31's speed points for prefix caching, on the GPU machine, against `met serve`:
#
#   checkpoint  the random-weight Qwen3-8B checkpoint (make_checkpoints.py; with the Qwen3
#               tokenizer when .cache/test-data/qwen3-tokenizer was carried in) into $CKPT,
#               skipped when it is there
#   run         in one call: met serve with the prefix cache (the default), then with
#               --no-prefix-cache, each measured by scripts/gpu/prefix_cache_bench.py:
#                 ttft-8k     the second request sharing an 8,192-token prefix (target TTFT <= 15 ms)
#                 agent       10 turns over a 4,096-token system prompt (target: each turn's TTFT
#                             within 1.3x that of its new tokens alone, turns 2..10)
#                 throughput  256 requests over 4 prefixes of 4,096 tokens, 32 concurrent, 128
#                             output tokens each (target: output tok/s with the cache >= 2x without)
#               then the table of both runs side by side
#   variants    the cache on under each tuning of VARIANTS ("name" or "name:key=value+...", as
#               met serve --tune), labelled cache-on-<name>: the agent turns of each side by side
#   all         checkpoint, then run (if the checkpoint is made in the same call, the run may not
#               fit the device tool's 10 minutes: prefer two calls while the machine stays warm)
#
# A hybrid model (issue 31's hybrid half: hit rate > 90% of the reusable tokens, same TTFT bound):
#   MODEL=qwen3-next-80b-a3b-4l WORKLOADS="greedy agent" BENCH_ARGS="--answers generated" \
#     scripts/gpu/prefix_cache.sh all
# (the full-depth Qwen3.5 checkpoint has no tokenizer met serve accepts; see make_checkpoints.py).
#
# Expects met at $STASH/met (scripts/gpu/first-models.sh stash). $MODEL picks another checkpoint
# under $CKPT; $BENCH_ARGS are passed to every bench run (e.g. "--requests 128"). Results (JSON
# lines, server logs, prefix-cache.md) collect in $RES and are packed into $OUT/prefix-cache.tgz.
set -uo pipefail
STASH=${STASH:-/root/stash}
OUT=${OUT:-gpu-out}
RES=${RES:-/root/results-prefix-cache}
CKPT=${CKPT:-/root/ckpt}
MODEL=${MODEL:-qwen3-8b}
PORT=${PORT:-8888}
BENCH_ARGS=${BENCH_ARGS:-}
mkdir -p "$OUT" "$RES" "$CKPT"
met="$STASH/met"
export PYTHONUNBUFFERED=1
url="http://127.0.0.1:$PORT"

checkpoint() {
  [ -f "$CKPT/$MODEL/config.json" ] && return 0
  local tok=()
  [ -d .cache/test-data/qwen3-tokenizer ] && tok+=(--tokenizer qwen3=.cache/test-data/qwen3-tokenizer)
  python3 scripts/gpu/make_checkpoints.py --out "$CKPT" --models "$MODEL" --seed 0 --no-verify "${tok[@]}" \
    >> "$RES/make_checkpoints.log" 2>&1 || { echo "prefix_cache.sh: make_checkpoints.py failed" >&2; tail "$RES/make_checkpoints.log" >&2; return 1; }
}

# serve_and_measure <label> [met serve args...]: one server, the three workloads, then SIGINT.
serve_and_measure() {
  local label=$1
  shift
  local log="$RES/serve-$label.log"
  "$met" serve --backend cuda --model-from-path "$CKPT/$MODEL" --port "$PORT" --max-seq-len 16384 \
    --max-num-seqs 512 "$@" > "$log" 2>&1 &
  local pid=$!
  local n=0
  until grep -q "Listening on" "$log"; do
    if ! kill -0 $pid 2>/dev/null || [ $n -ge 300 ]; then
      echo "prefix_cache.sh: met serve ($label) did not start; its log:" >&2
      tail -n 30 "$log" >&2
      kill -INT $pid 2>/dev/null
      return 1
    fi
    sleep 1
    n=$((n + 1))
  done
  local w
  for w in ${WORKLOADS:-greedy ttft-8k agent throughput}; do
    echo "== $label: $w"
    # shellcheck disable=SC2086
    timeout 400 python3 scripts/gpu/prefix_cache_bench.py --base-url "$url" --workload "$w" --label "$label" \
      --out "$RES/results.jsonl" $BENCH_ARGS || echo "prefix_cache.sh: $label $w failed (exit $?)" >&2
  done
  curl -s "$url/metrics" > "$RES/metrics-$label.txt" 2>/dev/null || true
  kill -INT $pid
  wait $pid
}

summary() {
  python3 - "$RES/results.jsonl" > "$RES/prefix-cache.md" <<'PY'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {(r["workload"], r["label"]): r for r in rows}
print("| measurement | cache on | cache off | target |\n|---|---|---|---|")


def cell(workload, label, field, fmt):
    r = by.get((workload, label))
    return fmt.format(r[field]) if r and r.get(field) is not None else "-"


def row(name, workload, field, fmt, target):
    on, off = (cell(workload, l, field, fmt) for l in ("cache-on", "cache-off"))
    print(f"| {name} | {on} | {off} | {target} |")


row("2nd request over an 8,192-token prefix: TTFT median, ms", "ttft-8k", "warm_ttft_ms_median", "{:.1f}", "<= 15 ms")
row("the cold request over it: TTFT, ms", "ttft-8k", "cold_ttft_ms", "{:.1f}", "~230 ms today")
row("agent: worst turn TTFT / its new tokens alone (turns 2..10)", "agent", "worst_ratio_turns_2_on", "{:.2f}", "<= 1.3")
row("agent: cached / reusable tokens (turns 2..10)", "agent", "hit_rate_turns_2_on", "{:.3f}", "> 0.9 (hybrid)")
row("agent: worst turn's cached / reusable", "agent", "worst_hit_rate_turns_2_on", "{:.3f}", "> 0.9 (hybrid)")
on, off = by.get(("throughput", "cache-on")), by.get(("throughput", "cache-off"))
ratio = "{:.2f}x".format(on["output_tok_per_s"] / off["output_tok_per_s"]) if on and off else "-"
row(f"shared-prefix serving: output tok/s, 32 concurrent (on/off {ratio})", "throughput", "output_tok_per_s", "{:.0f}", ">= 2x")
g_on, g_off = by.get(("greedy", "cache-on")), by.get(("greedy", "cache-off"))
if g_on and g_off:
    # Equal, or apart from the first step where they differ: a near tie when, at that step, the
    # two best tokens of either run are within TIE_GAP of each other in log-probability (the
    # logit error of the engine against float32 is of that order on random weights).
    tie_gap = float(os.environ.get("TIE_GAP", "0.05"))
    key = lambda r: r.get("token_ids") or r["text"]  # noqa: E731
    same, ties, notes = 0, 0, []
    for a, b in zip(g_on["requests"], g_off["requests"]):
        x, y = key(a), key(b)
        if x == y:
            same += 1
            continue
        i = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        gaps = [g[i] for g in (a.get("top2_gaps") or [], b.get("top2_gaps") or []) if i < len(g) and g[i] is not None]
        gap = min(gaps) if gaps else None
        tie = gap is not None and gap <= tie_gap
        ties += tie
        notes.append(f"cached {a['cached_tokens']}: step {i}, top-2 gap {gap if gap is None else round(gap, 4)}" + (" (near tie)" if tie else ""))
    cached = [a["cached_tokens"] for a in g_on["requests"]]
    n = len(g_on["requests"])
    print(f"| greedy answers with the cache = without (6 prompts; cached tokens {cached}) | "
          f"{same}/{n} equal, {ties} more differ first at a near tie (top-2 gap <= {tie_gap}) | - | all equal up to near ties |")
    for note in notes:
        print(f"|   differs: {note} | | | |")
for label in dict.fromkeys(r["label"] for r in rows):
    r = by.get(("agent", label))
    if not r:
        continue
    print(f"\nagent turns, {label} (answers {r.get('answers', 'made-up')}):\n\n| turn | prompt | reusable | cached | TTFT ms | new tokens | alone ms | ratio |\n|---|---|---|---|---|---|---|---|")
    for t in r["turns"]:
        print(f"| {t['turn']} | {t['prompt_tokens']} | {t.get('reusable_tokens', '-')} | {t['cached_tokens']} | {t['ttft_ms']:.1f} | {t['new_tokens']} "
              f"| {t['new_alone_ttft_ms']:.1f} | {t['ratio']:.2f} |")
PY
  cat "$RES/prefix-cache.md"
}

phase=${1:?phase: checkpoint, run or all}
case "$phase" in
checkpoint) checkpoint ;;
run)
  rm -f "$RES/results.jsonl"
  serve_and_measure cache-on
  serve_and_measure cache-off --no-prefix-cache
  summary
  ;;
variants)
  # The cache on under each entry of VARIANTS ("name" or "name:key=value+key=value", each pair
  # passed to met serve as --tune), labelled cache-on-<name>: the agent table per variant.
  rm -f "$RES/results.jsonl"
  for v in ${VARIANTS:-default}; do
    name=${v%%:*}
    tune=()
    if [[ "$v" == *:* ]]; then
      IFS='+' read -ra kv <<<"${v#*:}"
      for p in "${kv[@]}"; do tune+=(--tune "$p"); done
    fi
    serve_and_measure "cache-on-$name" "${tune[@]}"
  done
  summary
  ;;
all)
  checkpoint && "$0" run
  ;;
*)
  echo "unknown phase $phase" >&2
  exit 2
  ;;
esac
tar czf "$OUT/prefix-cache.tgz" -C "$RES" .
