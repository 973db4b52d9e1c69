#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Prefix-cache measurements against a running `met serve` (issue 31's speed points).

Standard library only (the GPU machine has no httpx). Prompts are token ids sent to
/v1/completions (random ids from a fixed seed, so every run sends the same requests and the shared
prefixes are exact); time to first token is the time from sending a streamed request to its first
data chunk that carries text or a finish reason.

Workloads (`--workload`, each prints one JSON object and appends it to `--out`):

  ttft-8k     a cold request over an 8,192-token prefix plus a 16-token suffix, then `--trials`
              requests with the same prefix and fresh suffixes: the warm TTFT (target <= 15 ms on
              Qwen3-8B, H200) and the usage's cached_tokens of each.
  agent       a 10-turn agent conversation: a 4,096-token system prompt (standing for the system
              text and tool schemas), each turn adding the previous answer and a tool result /
              user message; per turn, the TTFT of the whole conversation so far and of a cold
              prompt of only that turn's new tokens (fresh ids, so nothing is cached); the target
              is turn TTFT <= 1.3x the new tokens' alone, for turns 2..10. `--answers made-up`
              (the default) re-sends the answer as ids the client makes up (a client re-sends
              text, whose ids need not be the generated ones); `--answers generated` re-sends the
              ids the model generated (read back with `return_token_ids` from a second,
              unmeasured, non-streamed request for the same prompt), as an agent whose template
              keeps the answer verbatim does. Each turn also reports its reusable tokens (the
              longest common prefix of its prompt with what the previous turn computed: that
              prompt and the answer ids fed back, all but a last one that ended by length) and
              the hit rate cached / reusable; the target on a hybrid model is > 90% (turns 2..10).
  greedy      six prompts that hit the cache whole-block, mid-block, whole-prompt and repeated,
              one at a time, temperature 0: their texts, compared between the cache-on and
              cache-off servers (greedy outputs with the cache must equal those without).
  throughput  many requests over a few long prefixes (`--prefixes` of `--prefix-len` tokens, each
              request the prefix plus a unique suffix), `--concurrency` in flight, `--max-tokens`
              each: output tokens per second over the whole run. Run it against a server with the
              cache and one with --no-prefix-cache (scripts/gpu/prefix_cache.sh does both in one
              call); the target is a ratio >= 2 at 32 concurrent.

  python3 scripts/gpu/prefix_cache_bench.py --base-url http://127.0.0.1:8888 --workload ttft-8k \
      --label cache-on --out results.jsonl
"""

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

# Ids drawn from here: inside any Qwen/Llama vocabulary and clear of the special tokens.
ID_LO, ID_HI = 1000, 30000


class Client:
    def __init__(self, base_url: str, timeout: float):
        u = urllib.parse.urlparse(base_url)
        self.host, self.port, self.timeout = u.hostname, u.port or 80, timeout

    def answer_ids(self, ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        """The greedy answer's token ids (non-streamed, `return_token_ids`) and finish reason."""
        body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                           "return_token_ids": True})
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
        choice = json.loads(data)["choices"][0]
        return choice["token_ids"], choice["finish_reason"]

    def greedy_with_margins(self, ids: list[int], max_tokens: int) -> dict:
        """A non-streamed greedy completion with its token ids, usage and, per generated token,
        the gap between the two most likely tokens' log-probabilities (`logprobs: 2`; None
        where the two decode to the same text and the response keeps one)."""
        body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                           "return_token_ids": True, "logprobs": 2})
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
        reply = json.loads(data)
        choice, usage = reply["choices"][0], reply.get("usage") or {}
        gaps = []
        for top in (choice.get("logprobs") or {}).get("top_logprobs") or []:
            lps = sorted(top.values(), reverse=True)
            gaps.append(lps[0] - lps[1] if len(lps) >= 2 else None)
        return {"token_ids": choice["token_ids"], "text": choice["text"], "top2_gaps": gaps,
                "prompt_tokens": usage.get("prompt_tokens", len(ids)),
                "completion_tokens": usage.get("completion_tokens", 0),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}

    def stream(self, ids: list[int], max_tokens: int) -> dict:
        """One streamed completion; returns ttft_s, total_s, completion_tokens, cached_tokens."""
        body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}})
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        ttft, usage, text = None, None, []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if ttft is None and (c.get("text") or c.get("finish_reason")):
                    ttft = time.perf_counter() - t0
                text.append(c.get("text") or "")
        total = time.perf_counter() - t0
        conn.close()
        usage = usage or {}
        return {"ttft_s": ttft, "total_s": total, "text": "".join(text),
                "prompt_tokens": usage.get("prompt_tokens", len(ids)),
                "completion_tokens": usage.get("completion_tokens", 0),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}

    def metrics(self) -> dict[str, float]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        out = {}
        for line in text.splitlines():
            if line.startswith("metrale_") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(ID_LO, ID_HI) for _ in range(n)]


def ttft_8k(c: Client, a) -> dict:
    rng = random.Random(a.seed)
    prefix = ids(rng, a.prefix_len)
    cold = c.stream(prefix + ids(rng, 16), 1)
    warm = [c.stream(prefix + ids(rng, 16), 1) for _ in range(a.trials)]
    ttfts = [w["ttft_s"] for w in warm]
    return {"cold_ttft_ms": cold["ttft_s"] * 1e3, "cold_cached_tokens": cold["cached_tokens"],
            "warm_ttft_ms": [t * 1e3 for t in ttfts], "warm_ttft_ms_median": statistics.median(ttfts) * 1e3,
            "warm_cached_tokens": [w["cached_tokens"] for w in warm], "prompt_tokens": cold["prompt_tokens"],
            "target": "warm_ttft_ms_median <= 15 (Qwen3-8B, H200)"}


def common_prefix(x: list[int], y: list[int]) -> int:
    n = 0
    for p, q in zip(x, y):
        if p != q:
            break
        n += 1
    return n


def agent(c: Client, a) -> dict:
    rng = random.Random(a.seed + 1)
    conversation = ids(rng, a.system_len) + ids(rng, a.user_len)
    turns = []
    computed: list[int] = []  # what the previous turn computed: its prompt and fed-back answer
    for turn in range(1, a.turns + 1):
        reusable = common_prefix(conversation, computed)
        new = len(conversation) - reusable
        r = c.stream(conversation, a.max_tokens)
        alone = c.stream(ids(rng, new), a.max_tokens)
        hit = r["cached_tokens"] / reusable if reusable else None
        turns.append({"turn": turn, "prompt_tokens": r["prompt_tokens"], "new_tokens": new,
                      "reusable_tokens": reusable, "cached_tokens": r["cached_tokens"],
                      "hit_rate": hit, "ttft_ms": r["ttft_s"] * 1e3,
                      "new_alone_ttft_ms": alone["ttft_s"] * 1e3,
                      "ratio": r["ttft_s"] / alone["ttft_s"]})
        rate = f", {100 * hit:.1f}% of {reusable} reusable" if hit is not None else ""
        print(f"  turn {turn}: {r['prompt_tokens']} tokens ({r['cached_tokens']} cached{rate}), TTFT "
              f"{r['ttft_s'] * 1e3:.1f} ms; its {new} new tokens alone {alone['ttft_s'] * 1e3:.1f} ms",
              file=sys.stderr)
        if a.answers == "generated":
            # The ids the model generates for this prompt (greedy: the streamed answer's, up to
            # bf16 near-ties between a cached and an uncached run), fed back but for a last one
            # that ended by length (sampled, never computed).
            answer, finish = c.answer_ids(conversation, a.answer_len)
            computed = conversation + (answer[:-1] if finish == "length" else answer)
        else:
            # Made-up ids: only the prompt is reusable (the generated ids were others).
            answer = ids(rng, a.answer_len)
            computed = list(conversation)
        # The answer, then a tool result or the user's next message.
        conversation = conversation + answer + ids(rng, a.tool_len)
    later = [t["ratio"] for t in turns[1:]]
    reusable = sum(t["reusable_tokens"] for t in turns[1:])
    cached = sum(min(t["cached_tokens"], t["reusable_tokens"]) for t in turns[1:])
    return {"turns": turns, "answers": a.answers, "worst_ratio_turns_2_on": max(later) if later else None,
            "hit_rate_turns_2_on": cached / reusable if reusable else None,
            "worst_hit_rate_turns_2_on": min((t["hit_rate"] for t in turns[1:] if t["hit_rate"] is not None),
                                             default=None),
            "target": "ratio <= 1.3 for turns 2..10; on a hybrid model hit rate > 90% of reusable tokens"}


def greedy(c: Client, a) -> dict:
    """Greedy answers of prompts that hit the cache in every way (whole blocks, a divergence
    inside a block, a prompt cached whole, the same prompt again), one request at a time: compared
    between a server with the cache and one without (prefix_cache.sh's summary), token ids and
    the top-2 log-probability gap of every step, so that a divergence can be told from a near tie
    (random weights put the two best tokens within rounding of each other at some steps)."""
    rng = random.Random(a.seed + 3)
    base = ids(rng, 1000)  # 62.5 blocks of 16: prompts over it diverge inside block 62
    prompts = [base + ids(rng, 40), base + ids(rng, 7), base[:992], base[:992] + ids(rng, 1),
               base + ids(rng, 40)]
    prompts.append(prompts[0])
    out = []
    for p in prompts:
        out.append(c.greedy_with_margins(p, a.max_tokens))
    return {"requests": out}


def throughput(c: Client, a) -> dict:
    rng = random.Random(a.seed + 2)
    prefixes = [ids(rng, a.prefix_len) for _ in range(a.prefixes)]
    prompts = [prefixes[i % a.prefixes] + ids(rng, a.suffix_len) for i in range(a.requests)]
    rng.shuffle(prompts)
    before = c.metrics()
    lock, results = threading.Lock(), []

    def one(p):
        r = c.stream(p, a.max_tokens)
        with lock:
            results.append(r)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as pool:
        list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    after = c.metrics()
    out_tokens = sum(r["completion_tokens"] for r in results)
    ttfts = sorted(r["ttft_s"] for r in results)
    delta = lambda k: after.get(k, 0) - before.get(k, 0)  # noqa: E731
    return {"requests": len(results), "concurrency": a.concurrency, "prefixes": a.prefixes,
            "prefix_len": a.prefix_len, "suffix_len": a.suffix_len, "max_tokens": a.max_tokens,
            "wall_s": wall, "output_tokens": out_tokens, "output_tok_per_s": out_tokens / wall,
            "ttft_p50_ms": ttfts[len(ttfts) // 2] * 1e3, "ttft_p99_ms": ttfts[int(len(ttfts) * 0.99)] * 1e3,
            "cached_tokens": sum(r["cached_tokens"] for r in results),
            "prompt_tokens": sum(r["prompt_tokens"] for r in results),
            "metrics_hit_tokens": delta("metrale_prefix_cache_hit_tokens_total"),
            "metrics_queried_tokens": delta("metrale_prefix_cache_queried_tokens_total"),
            "metrics_evicted_blocks": delta("metrale_prefix_cache_evicted_blocks_total"),
            "target": "output_tok_per_s with the cache >= 2x without, at 32 concurrent"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8888")
    p.add_argument("--workload", choices=["ttft-8k", "agent", "throughput", "greedy"], required=True)
    p.add_argument("--label", default="", help="recorded with the result (e.g. cache-on)")
    p.add_argument("--out", help="append the result as one JSON line to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--prefix-len", type=int, help="ttft-8k: 8192; throughput: 4096")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system-len", type=int, default=4096)
    p.add_argument("--user-len", type=int, default=200)
    p.add_argument("--answer-len", type=int, default=150)
    p.add_argument("--tool-len", type=int, default=300)
    p.add_argument("--answers", choices=["made-up", "generated"], default="made-up",
                   help="agent: re-send made-up answer ids, or the generated ones (see above)")
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, help="agent: 32; throughput: 128")
    a = p.parse_args()
    defaults = {"ttft-8k": (8192, 1), "agent": (0, 32), "throughput": (4096, 128), "greedy": (0, 48)}[a.workload]
    a.prefix_len = a.prefix_len or defaults[0]
    a.max_tokens = a.max_tokens or defaults[1]
    c = Client(a.base_url, a.timeout)
    c.stream(ids(random.Random(12345), 32), 2)  # the first request pays any lazy set-up
    run = {"ttft-8k": ttft_8k, "agent": agent, "throughput": throughput, "greedy": greedy}[a.workload]
    result = {"workload": a.workload, "label": a.label, **run(c, a)}
    line = json.dumps(result)
    print(line)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
