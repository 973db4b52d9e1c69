# SPDX-License-Identifier: MIT OR Apache-2.0
"""Load test for a running `met serve`: many streaming requests at once, a third cancelled mid-stream.

200 requests (default), 32 at a time, over /v1/completions and /v1/chat/completions with mixed
prompt lengths, max_tokens and temperatures; every third request closes its connection after the
first 1-3 chunks. Checks that the server stays up, that every stream not cancelled ends with a
finish_reason, a usage chunk and `data: [DONE]`, and that afterwards no request is active and no KV
block is in use. Prints p50/p99 time to first token, p50/p99 time per output token and the wall time.

    python tests/server/load_test.py --base-url http://127.0.0.1:8888
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass

import httpx

from common import (
    base_parser,
    describe,
    expect,
    get_metrics,
    percentile,
    preflight,
    server_alive,
    wait_idle,
    write_report,
)

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak tree "
    "near the river bank where children play football every sunny afternoon after school ends and "
    "their parents talk about the weather the garden the news and what to cook for dinner tonight"
).split()
SYSTEM = "Answer in one short sentence."
PROMPT_WORDS = (2, 5, 10, 20, 35)  # mixed prompt lengths, short: the CI server is two CPU cores
MAX_TOKENS = (1, 2, 4, 8, 16)
TEMPERATURES = (0.0, 0.7, 1.0)


@dataclass
class Spec:
    i: int
    route: str  # "chat" | "completion"
    prompt: str
    max_tokens: int
    temperature: float
    cancel_after: int  # 0: read to the end; else close the connection after this many chunks

    def body(self, model: str) -> dict:
        b = {"model": model, "max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.i,
             "stream": True, "stream_options": {"include_usage": True}}
        if self.route == "chat":
            b["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.prompt}]
        else:
            b["prompt"] = self.prompt
        return b

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.route == "chat" else "/v1/completions"


@dataclass
class Outcome:
    spec: Spec
    status: str = "ok"  # ok | cancelled | failed
    problem: str = ""
    chunks: int = 0
    ttft: float | None = None
    tpot: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish: str | None = None


def make_specs(n: int, cancel_every: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        words = rng.choice(PROMPT_WORDS)
        start = rng.randrange(len(WORDS))
        prompt = " ".join(WORDS[(start + k) % len(WORDS)] for k in range(words))
        cancel = rng.randint(1, 3) if cancel_every and i % cancel_every == cancel_every - 1 else 0
        specs.append(Spec(
            i=i,
            route="chat" if rng.random() < 0.3 else "completion",
            prompt=prompt.capitalize(),
            max_tokens=16 if cancel else rng.choice(MAX_TOKENS),
            temperature=rng.choice(TEMPERATURES),
            cancel_after=cancel,
        ))
    return specs


async def stream_one(client: httpx.AsyncClient, spec: Spec, model: str, out: Outcome, t: dict) -> None:
    """Reads one stream into `out` (and timestamps into `t`); returns early to cancel or on a problem."""
    async with client.stream("POST", spec.path, json=spec.body(model)) as r:
        if r.status_code != 200:
            body = (await r.aread()).decode("utf-8", errors="replace")
            out.status, out.problem = "failed", f"HTTP {r.status_code}: {body[:200]}"
            return
        ct = r.headers.get("content-type", "")
        if not ct.startswith("text/event-stream"):
            out.status, out.problem = "failed", f"Content-Type {ct!r}, want text/event-stream"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if t["done"]:
                out.status, out.problem = "failed", f"data after [DONE]: {data[:100]}"
                return
            if data == "[DONE]":
                t["done"] = True
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                out.status, out.problem = "failed", f"chunk is not JSON: {data[:100]!r}"
                return
            if "error" in chunk:
                out.status, out.problem = "failed", f"error in stream: {data[:200]}"
                return
            out.chunks += 1
            now = time.monotonic()
            if chunk.get("usage"):
                t["usage"] = chunk["usage"]
            for ch in chunk.get("choices") or []:
                text = (ch.get("delta") or {}).get("content") if spec.route == "chat" else ch.get("text")
                if text:
                    t["first"] = t["first"] or now
                    t["last"] = now
                if ch.get("finish_reason"):
                    if out.finish:
                        out.status, out.problem = "failed", "two finish_reasons"
                        return
                    out.finish = ch["finish_reason"]
                    t["last"] = t["last"] or now
                    t["first"] = t["first"] or now
            if spec.cancel_after and out.chunks >= spec.cancel_after and not out.finish:
                out.status = "cancelled"
                return  # leaving the block closes the unfinished response, and with it the connection


async def run_one(client: httpx.AsyncClient, spec: Spec, model: str, sem: asyncio.Semaphore,
                  timeout: float) -> Outcome:
    out = Outcome(spec)
    t: dict = {"first": None, "last": None, "done": False, "usage": None}
    async with sem:
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(stream_one(client, spec, model, out, t), timeout)
        except asyncio.TimeoutError:
            out.status, out.problem = "failed", f"no end after {timeout:.0f}s ({out.chunks} chunks)"
        except httpx.HTTPError as e:
            out.status, out.problem = "failed", f"{describe(e)} after {out.chunks} chunks"
    if t["first"] is not None:
        out.ttft = t["first"] - t0
    if out.status != "ok":
        return out
    usage = t["usage"]
    if not t["done"]:
        out.status, out.problem = "failed", f"stream ended without data: [DONE] ({out.chunks} chunks)"
    elif out.finish not in ("stop", "length"):
        out.status, out.problem = "failed", f"finish_reason {out.finish!r}, want stop or length"
    elif usage is None:
        out.status, out.problem = "failed", "no usage chunk (stream_options.include_usage was set)"
    else:
        out.completion_tokens = int(usage.get("completion_tokens", -1))
        out.prompt_tokens = int(usage.get("prompt_tokens", -1))
        if not 0 <= out.completion_tokens <= spec.max_tokens:
            out.status, out.problem = "failed", f"usage.completion_tokens {out.completion_tokens} outside 0..{spec.max_tokens}"
        elif out.finish == "length" and out.completion_tokens != spec.max_tokens:
            out.status, out.problem = "failed", (
                f"finish_reason length but usage.completion_tokens {out.completion_tokens} != max_tokens {spec.max_tokens}")
        elif out.prompt_tokens <= 0:
            out.status, out.problem = "failed", f"usage.prompt_tokens {out.prompt_tokens}"
        elif out.completion_tokens >= 2 and t["first"] is not None and t["last"] > t["first"]:
            out.tpot = (t["last"] - t["first"]) / (out.completion_tokens - 1)
    return out


async def run_all(args, model: str, specs: list[Spec]) -> list[Outcome]:
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    finished = 0

    async with httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=timeout, headers=headers) as client:
        async def tracked(spec: Spec) -> Outcome:
            nonlocal finished
            o = await run_one(client, spec, model, sem, args.timeout)
            finished += 1
            if finished % 25 == 0 or finished == len(specs):
                print(f"   {finished}/{len(specs)} done", flush=True)
            return o

        return await asyncio.gather(*(tracked(s) for s in specs))


def main() -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200, help="requests in all (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (default %(default)s)")
    p.add_argument("--cancel-every", type=int, default=3, help="cancel every Nth request; 0: none (default %(default)s)")
    p.add_argument("--seed", type=int, default=1, help="seed of the request mix (default %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default %(default)s)")
    p.add_argument("--model-name", help="model field to send (default: the first id in /v1/models)")
    args = p.parse_args()
    args.base_url = args.base_url.rstrip("/")
    preflight(args.base_url, args.wait, token=args.api_key)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    problems: list[str] = []

    model = args.model_name
    if not model:
        r = httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=10)
        model = r.json()["data"][0]["id"] if r.status_code == 200 else "default"
    before, _ = get_metrics(args.base_url, headers)
    specs = make_specs(args.requests, args.cancel_every, args.seed)
    print(f"== load_test: {len(specs)} streaming requests, {args.concurrency} at a time, "
          f"{sum(bool(s.cancel_after) for s in specs)} to cancel mid-stream, against {args.base_url}", flush=True)
    t0 = time.monotonic()
    outcomes = asyncio.run(run_all(args, model, specs))
    wall = time.monotonic() - t0

    ok = [o for o in outcomes if o.status == "ok"]
    cancelled = [o for o in outcomes if o.status == "cancelled"]
    failed = [o for o in outcomes if o.status == "failed"]
    for o in failed[:15]:
        problems.append(f"request {o.spec.i} ({o.spec.route}, max_tokens {o.spec.max_tokens}): {o.problem}")
    if len(failed) > 15:
        problems.append(f"... and {len(failed) - 15} more failed requests")

    alive = server_alive(args.base_url, args.api_key)
    if not alive:
        problems.append("the server no longer answers GET /health after the load")
    else:
        try:
            after = wait_idle(args.base_url, timeout=30, headers=headers)

            def delta(name: str) -> float:
                return after.get(name, 0.0) - before.get(name, 0.0)

            gen_tokens = sum(o.completion_tokens for o in ok)
            prompt_tokens = sum(o.prompt_tokens for o in ok)
            checks = [
                ("metrale_requests_total", len(ok)),
                ("metrale_generation_tokens_total", gen_tokens),
                ("metrale_prompt_tokens_total", prompt_tokens),
                ("metrale_time_to_first_token_seconds_count", sum(o.completion_tokens > 0 for o in ok)),
            ]
            for name, least in checks:
                if delta(name) < least:
                    problems.append(f"{name} rose by {delta(name):g}, want at least {least} (the completed streams)")
            expect(after["metrale_kv_blocks_free"] == after["metrale_kv_blocks_total"],
                   f"kv_blocks_free {after['metrale_kv_blocks_free']:g} != kv_blocks_total {after['metrale_kv_blocks_total']:g} when idle")
        except AssertionError as e:
            problems.append(str(e))
        except Exception as e:  # noqa: BLE001
            problems.append(f"reading /metrics after the load: {describe(e)}")
        try:
            r = httpx.post(f"{args.base_url}/v1/completions", headers=headers, timeout=120,
                           json={"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
            if r.status_code != 200 or not r.json().get("choices"):
                problems.append(f"a plain request after the load answered {r.status_code}: {r.text[:200]}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"a plain request after the load failed: {describe(e)}")

    ttft = [o.ttft for o in outcomes if o.ttft is not None]
    tpot = [o.tpot for o in outcomes if o.tpot is not None]
    gen_total = sum(o.completion_tokens for o in ok)
    print(f"   requests: {len(outcomes)} ({len(ok)} completed, {len(cancelled)} cancelled, {len(failed)} failed)")
    print(f"   wall time: {wall:.1f} s; {len(outcomes) / wall:.2f} req/s; "
          f"{gen_total / wall:.1f} generated tok/s (completed streams)")
    print(f"   TTFT:  p50 {percentile(ttft, 50) * 1e3:8.0f} ms   p99 {percentile(ttft, 99) * 1e3:8.0f} ms   (n={len(ttft)})")
    print(f"   TPOT:  p50 {percentile(tpot, 50) * 1e3:8.0f} ms   p99 {percentile(tpot, 99) * 1e3:8.0f} ms   (n={len(tpot)})")
    for prob in problems:
        print(f"FAIL  {prob}")
    status = "passed" if not problems else f"FAILED ({len(problems)} problems)"
    print(f"== load_test: {status} in {wall:.1f}s", flush=True)
    write_report(
        args.report, "load_test", passed=len(ok) + len(cancelled), failed=len(problems), skipped=0, seconds=wall,
        results=[{"problem": p} for p in problems],
        completed=len(ok), cancelled=len(cancelled), failed_requests=len(failed),
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
