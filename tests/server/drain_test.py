# SPDX-License-Identifier: MIT OR Apache-2.0
"""Graceful shutdown of a running `met serve`: a signal in the middle of a stream must let the stream
finish (finish_reason, usage, `data: [DONE]`), and the server must then stop listening.

Sends the signal itself (to --pid), so run it last; scripts/test-server.sh then checks that the
process exits 0 within 30 s.

    python tests/server/drain_test.py --base-url http://127.0.0.1:8888 --pid 12345 --signal INT
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import httpx

from common import base_parser, describe, preflight, write_report

MAX_TOKENS = 16


def main() -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--pid", type=int, required=True, help="the server's process id")
    p.add_argument("--signal", default="INT", choices=("INT", "TERM"), help="signal to send (default %(default)s)")
    p.add_argument("--exit-timeout", type=float, default=30.0, help="seconds to stop listening (default %(default)s)")
    args = p.parse_args()
    base = args.base_url.rstrip("/")
    preflight(base, args.wait, token=args.api_key)
    sig = getattr(signal, "SIG" + args.signal)
    problems: list[str] = []
    t0 = time.monotonic()
    chunks = 0
    finish = usage = None
    done = signalled = False
    body = {"prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    print(f"== drain_test: SIG{args.signal} to pid {args.pid} in the middle of a {MAX_TOKENS}-token stream", flush=True)

    def send_signal() -> None:
        nonlocal signalled
        if not signalled:
            signalled = True
            try:
                os.kill(args.pid, sig)
            except OSError as e:
                problems.append(f"cannot signal pid {args.pid}: {describe(e)}")

    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {args.api_key}"}) as r:
            if r.status_code != 200:
                problems.append(f"the stream answered HTTP {r.status_code}: {r.read()[:200]!r}")
            else:
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        continue
                    chunk = json.loads(data)
                    chunks += 1
                    usage = chunk.get("usage") or usage
                    for ch in chunk.get("choices") or []:
                        finish = ch.get("finish_reason") or finish
                    if not signalled:
                        send_signal()
                        print(f"   sent SIG{args.signal} after chunk 1", flush=True)
    except (httpx.HTTPError, ValueError) as e:
        problems.append(f"the stream broke after {chunks} chunks: {describe(e)}")
    finally:
        if chunks == 0:
            problems.append("no chunk came before the stream ended; the signal was sent anyway")
        send_signal()  # exactly once, whatever happened: the caller waits for the exit
    if not problems:
        if finish not in ("stop", "length"):
            problems.append(f"the drained stream has finish_reason {finish!r}")
        if not done:
            problems.append(f"the drained stream ended without data: [DONE] ({chunks} chunks)")
        if usage is None:
            problems.append("the drained stream has no usage chunk")
        elif finish == "length" and usage.get("completion_tokens") != MAX_TOKENS:
            problems.append(f"drained stream: finish length but completion_tokens {usage.get('completion_tokens')}")
    # Then the server must stop listening.
    deadline = time.monotonic() + args.exit_timeout
    stopped = False
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{base}/health", timeout=2, headers={"Authorization": f"Bearer {args.api_key}"})
        except httpx.HTTPError:
            stopped = True
            break
        time.sleep(0.2)
    if not stopped:
        problems.append(f"still answering GET /health {args.exit_timeout:.0f}s after SIG{args.signal}")
    took = time.monotonic() - t0
    print(f"   stream: {chunks} chunks, finish_reason {finish!r}, [DONE] {'yes' if done else 'no'}; "
          f"listener {'closed' if stopped else 'still open'} after {took:.1f}s")
    for prob in problems:
        print(f"FAIL  {prob}")
    print(f"== drain_test: {'passed' if not problems else 'FAILED'} in {took:.1f}s", flush=True)
    write_report(args.report, "drain_test", int(not problems), len(problems), 0, took,
                 [{"problem": x} for x in problems])
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
