#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Concurrent streams against a running `met serve`, a share of them cancelled mid-stream, then
the server's books and the survivors' outputs checked (the hybrid issue's serving point; any
model works).

    python3 scripts/gpu/serve_cancel_check.py --url http://127.0.0.1:8899 --streams 64

1. `--streams` greedy streaming /v1/completions requests at once, distinct prompts,
   `--max-tokens` each; every `--cancel-every`-th closes its connection after `--cancel-after`
   chunks.
2. Once all are done (and the server has had `--settle` seconds), /metrics must show no running
   sequence, no KV block in use and no state slot held.
3. Each uncancelled request is sent again alone (non-streaming): its text must equal what it
   streamed among the others.

Prints one JSON line with the counts; exits 1 when a check fails.
"""
import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse


def prompt(i):
    return f"Request {i}: list the numbers from {i} to {i + 40}, separated by commas:"


def stream(url, i, args, cancel, out):
    u = urllib.parse.urlparse(url)
    body = json.dumps({"model": "m", "prompt": prompt(i), "max_tokens": args.max_tokens,
                       "temperature": 0, "stream": True})
    text, chunks, error = [], 0, None
    try:
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            error = f"HTTP {r.status}: {r.read()[:200]!r}"
        else:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    error = str(ev["error"])
                    break
                text.append(ev["choices"][0].get("text", ""))
                chunks += 1
                if cancel and chunks >= args.cancel_after:
                    break
        c.close()  # a cancelled stream: the connection drops mid-response
    except Exception as e:  # noqa: BLE001 - every failure is reported
        error = repr(e)
    out[i] = {"text": "".join(text), "chunks": chunks, "error": error, "cancelled": cancel}


def solo(url, i, args):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = json.dumps({"model": "m", "prompt": prompt(i), "max_tokens": args.max_tokens,
                       "temperature": 0})
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    c.close()
    return data["choices"][0]["text"]


def metrics(url):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8899")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cancel-every", type=int, default=3)
    p.add_argument("--cancel-after", type=int, default=8)
    p.add_argument("--settle", type=float, default=2.0)
    args = p.parse_args()

    out = {}
    started = time.time()
    threads = [threading.Thread(target=stream, args=(args.url, i, args, i % args.cancel_every == 0, out))
               for i in range(args.streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - started
    time.sleep(args.settle)
    m = metrics(args.url)
    errors = {i: r["error"] for i, r in out.items() if r["error"]}
    kept = [i for i, r in out.items() if not r["cancelled"] and not r["error"]]
    mismatched = []
    for i in sorted(kept):
        alone = solo(args.url, i, args)
        if alone != out[i]["text"]:
            mismatched.append({"request": i, "together": out[i]["text"][:80], "alone": alone[:80]})
    after = metrics(args.url)
    books = {k: m.get(k) for k in ("metrale_sequences_running", "metrale_kv_blocks_used",
                                   "metrale_state_slots_used", "metrale_state_slots_total",
                                   "metrale_kv_blocks_cached")}
    report = {
        "streams": args.streams,
        "cancelled": sum(r["cancelled"] for r in out.values()),
        "errors": len(errors),
        "error_samples": list(errors.items())[:3],
        "uncancelled_compared": len(kept),
        "equal_to_solo": len(kept) - len(mismatched),
        "mismatch_samples": mismatched[:3],
        "wall_s": round(wall, 2),
        "after_streams": books,
        "after_solo_runs": {k: after.get(k) for k in books},
    }
    print(json.dumps(report))
    ok = (not errors and not mismatched and books["metrale_sequences_running"] == 0
          and books["metrale_kv_blocks_used"] == 0 and books["metrale_state_slots_used"] in (0, None))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
