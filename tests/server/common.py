# SPDX-License-Identifier: MIT OR Apache-2.0
"""Shared pieces of the black-box `met serve` suites (tests/server/README.md).

A tiny test runner (no pytest), the command-line options every suite takes, a preflight that turns
"no server there" into one clear line, Prometheus text parsing, SSE parsing, the error-body shape
checks, a raw-socket HTTP client for requests httpx will not send, and a wrapper around
`met generate` for reference outputs. Only the standard library and httpx are used here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlsplit

import httpx

REPO = Path(__file__).resolve().parents[2]
DEFAULT_URL = "http://127.0.0.1:8888"
SMOLLM2 = "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    data = os.environ.get("METRALE_TEST_DATA") or str(REPO / ".cache" / "test-data")
    return str(Path(data) / SMOLLM2)


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--base-url",
        default=os.environ.get("METRALE_SERVER_URL", DEFAULT_URL),
        help="the server under test, without /v1 (default: $METRALE_SERVER_URL or %(default)s)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("METRALE_API_KEY", "dummy"),
        help="bearer token sent to the server (default: $METRALE_API_KEY or 'dummy')",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep retrying the first connection this long before giving up (default: one try)",
    )
    p.add_argument("--report", metavar="FILE", help="write a JSON summary of the results here")
    p.add_argument("-v", "--verbose", action="store_true", help="print full tracebacks")
    return p


# ---------------------------------------------------------------------------------------------
# Connection preflight


class ServerDown(Exception):
    """The server cannot be reached; the suite stops instead of failing every test."""


CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    httpx.ConnectError,
    httpx.RemoteProtocolError,
    ConnectionError,
    socket.timeout,
)


def connection_error_types() -> tuple[type[BaseException], ...]:
    """httpx's, plus the SDKs' connection errors when they are importable."""
    types: list[type[BaseException]] = list(CONNECTION_ERRORS)
    for mod in ("openai", "anthropic"):
        m = sys.modules.get(mod)
        if m is not None and hasattr(m, "APIConnectionError"):
            types.append(m.APIConnectionError)
    return tuple(types)


def describe(e: BaseException) -> str:
    """One line for an exception, following its causes (SDK errors wrap the socket error)."""
    parts: list[str] = []
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if not parts or text not in parts[-1]:
            parts.append(f"{type(e).__name__}: {text}" if text else type(e).__name__)
        e = e.__cause__ or e.__context__
    return " <- ".join(parts[:3])


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def server_alive(base_url: str, token: str | None = None, timeout: float = 5.0) -> bool:
    """GET /health answers 200 (the token is sent, in case the server guards /health too)."""
    try:
        return httpx.get(f"{base_url}/health", headers=auth_headers(token), timeout=timeout).status_code == 200
    except Exception:  # noqa: BLE001 - any failure means "not alive"
        return False


def preflight(base_url: str, wait: float, what: str = "met serve", token: str | None = None) -> None:
    """Exits with one clear line (status 2) when nothing answers at base_url."""
    deadline = time.monotonic() + wait
    last: BaseException | None = None
    while True:
        try:
            r = httpx.get(f"{base_url}/health", headers=auth_headers(token), timeout=5.0)
            if r.status_code == 200:
                return
            last = RuntimeError(f"GET /health answered {r.status_code}: {r.text[:200]}")
        except Exception as e:  # noqa: BLE001
            last = e
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    print(
        f"error: cannot reach {what} at {base_url} ({describe(last)}).\n"
        f"       Start one (see tests/server/README.md), e.g.\n"
        f"         target/release/met serve --model-from-path {default_model_path()} --backend host --port 8888\n"
        f"       or point the suite at it with --base-url / $METRALE_SERVER_URL.",
        file=sys.stderr,
    )
    sys.exit(2)


# ---------------------------------------------------------------------------------------------
# The runner


class Skip(Exception):
    """Raised by a test that cannot run here (the reason is printed)."""


@dataclass
class Result:
    name: str
    status: str  # PASS | FAIL | ERROR | SKIP | NOT RUN
    seconds: float
    message: str = ""


@dataclass
class Runner:
    suite: str
    base_url: str
    verbose: bool = False
    token: str | None = None
    tests: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)

    def test(self, name: str | None = None):
        def register(fn: Callable[[], None]):
            self.tests.append((name or fn.__name__, fn))
            return fn

        return register

    def add(self, name: str, fn: Callable[[], None]) -> None:
        self.tests.append((name, fn))

    def run(self, report: str | None = None) -> int:
        started = time.monotonic()
        conn_errors = connection_error_types()
        width = max((len(n) for n, _ in self.tests), default=10)
        print(f"== {self.suite}: {len(self.tests)} tests against {self.base_url}", flush=True)
        aborted = False
        for name, fn in self.tests:
            if aborted:
                self.results.append(Result(name, "NOT RUN", 0.0, "server down"))
                continue
            t0 = time.monotonic()
            status, message = "PASS", ""
            try:
                fn()
            except Skip as e:
                status, message = "SKIP", str(e)
            except AssertionError as e:
                status, message = "FAIL", str(e) or "assertion failed"
                if self.verbose:
                    traceback.print_exc()
            except conn_errors as e:
                status, message = "ERROR", f"connection failed: {describe(e)}"
                if not server_alive(self.base_url, self.token):
                    message += " -- the server no longer answers GET /health"
                    aborted = True
            except Exception as e:  # noqa: BLE001 - report, keep going
                status, message = "ERROR", describe(e)
                api_body = getattr(e, "body", None)
                code = getattr(e, "status_code", None)
                if code is not None:
                    message = f"HTTP {code}: {json.dumps(api_body)[:300] if api_body is not None else ''} ({type(e).__name__})"
                if self.verbose:
                    traceback.print_exc()
            dt = time.monotonic() - t0
            self.results.append(Result(name, status, dt, message))
            line = f"{status:<5} {name:<{width}} {dt:6.1f}s"
            if message:
                line += f"  {message}"
            print(line, flush=True)
        total = time.monotonic() - started
        counts = {s: sum(r.status == s for r in self.results) for s in ("PASS", "FAIL", "ERROR", "SKIP", "NOT RUN")}
        failed = counts["FAIL"] + counts["ERROR"] + counts["NOT RUN"]
        print(
            f"== {self.suite}: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['ERROR']} errors, "
            f"{counts['SKIP']} skipped, {counts['NOT RUN']} not run in {total:.1f}s",
            flush=True,
        )
        if aborted:
            print(f"== {self.suite}: stopped early: the server at {self.base_url} went away", flush=True)
        write_report(report, self.suite, counts["PASS"], failed, counts["SKIP"], total,
                     [r.__dict__ for r in self.results])
        return 1 if failed else 0


def write_report(path: str | None, suite: str, passed: int, failed: int, skipped: int, seconds: float,
                 results: list[dict[str, Any]] | None = None, **extra: Any) -> None:
    if not path:
        return
    data = {"suite": suite, "passed": passed, "failed": failed, "skipped": skipped,
            "seconds": round(seconds, 2), "results": results or [], **extra}
    Path(path).write_text(json.dumps(data, indent=2))


def expect(cond: Any, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def expect_eq(got: Any, want: Any, what: str) -> None:
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


# ---------------------------------------------------------------------------------------------
# Prometheus text

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def anthropic_prompt_tokens(usage: Any) -> int:
    """The whole prompt of an Anthropic `usage`: as Anthropic counts, `input_tokens` excludes the
    tokens read from (or written to) the prompt cache, which `met serve`'s prefix cache reports as
    `cache_read_input_tokens`."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def parse_metrics(text: str) -> dict[str, float]:
    """Metric name (labels dropped) -> sum of its samples. Histogram series keep their suffixes."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def get_metrics(base_url: str, headers: dict[str, str] | None = None) -> tuple[dict[str, float], str]:
    r = httpx.get(f"{base_url}/metrics", headers=headers or {}, timeout=10.0)
    expect(r.status_code == 200, f"GET /metrics answered {r.status_code}: {r.text[:200]}")
    return parse_metrics(r.text), r.text


REQUIRED_METRICS = (
    "metrale_requests_total",
    "metrale_requests_active",
    "metrale_time_to_first_token_seconds_bucket",
    "metrale_time_to_first_token_seconds_sum",
    "metrale_time_to_first_token_seconds_count",
    "metrale_prompt_tokens_total",
    "metrale_generation_tokens_total",
    "metrale_kv_blocks_used",
    "metrale_kv_blocks_free",
    "metrale_kv_blocks_total",
)


def wait_idle(base_url: str, timeout: float = 30.0, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Polls /metrics until no request is active and no KV block is in use; fails with the values."""
    deadline = time.monotonic() + timeout
    while True:
        m, _ = get_metrics(base_url, headers)
        missing = [k for k in ("metrale_kv_blocks_used", "metrale_requests_active") if k not in m]
        expect(not missing, f"/metrics lacks {missing}")
        if m["metrale_kv_blocks_used"] == 0 and m["metrale_requests_active"] == 0:
            return m
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"after {timeout:.0f}s idle: metrale_kv_blocks_used={m['metrale_kv_blocks_used']:g} "
                f"metrale_requests_active={m['metrale_requests_active']:g} (want 0 and 0: leaked KV blocks or requests)"
            )
        time.sleep(0.25)


# ---------------------------------------------------------------------------------------------
# SSE


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The payload of each `data:` line (event:, id:, comments and blank lines skipped)."""
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].lstrip(" ").rstrip("\r\n")


# ---------------------------------------------------------------------------------------------
# Error bodies


def _json_body(resp: "RawResponse | httpx.Response") -> Any:
    text = resp.content.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        raise AssertionError(f"HTTP {resp.status_code} body is not JSON: {text[:200]!r}") from None


def check_content_type_json(resp: "RawResponse | httpx.Response") -> None:
    ct = resp.headers.get("content-type", "")
    expect(ct.split(";")[0].strip().lower() == "application/json",
           f"HTTP {resp.status_code} error body has Content-Type {ct!r}, want application/json")


def check_openai_error(resp: "RawResponse | httpx.Response") -> dict[str, Any]:
    """{"error": {"message": str, "type": str, "param": str|null, "code": str|null}}; returns error."""
    body = _json_body(resp)
    check_content_type_json(resp)
    expect(isinstance(body, dict) and isinstance(body.get("error"), dict),
           f"not an OpenAI error body (want {{'error': {{...}}}}): {json.dumps(body)[:300]}")
    err = body["error"]
    expect(isinstance(err.get("message"), str) and err["message"].strip(), f"error.message missing or empty: {err}")
    expect(isinstance(err.get("type"), str) and err["type"], f"error.type missing or not a string: {err}")
    for key in ("param", "code"):
        expect(key in err, f"error.{key} missing (must be present, string or null): {err}")
        expect(err[key] is None or isinstance(err[key], str), f"error.{key} must be a string or null: {err}")
    return err


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def check_anthropic_error(resp: "RawResponse | httpx.Response") -> dict[str, Any]:
    """{"type": "error", "error": {"type": str, "message": str}}, error.type as Anthropic names it."""
    body = _json_body(resp)
    check_content_type_json(resp)
    expect(isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict),
           f"not an Anthropic error body (want {{'type': 'error', 'error': {{...}}}}): {json.dumps(body)[:300]}")
    err = body["error"]
    expect(isinstance(err.get("message"), str) and err["message"].strip(), f"error.message missing or empty: {err}")
    expect(isinstance(err.get("type"), str), f"error.type missing: {err}")
    want = ANTHROPIC_ERROR_TYPES.get(resp.status_code)
    if want:
        expect(err["type"] == want, f"HTTP {resp.status_code} error.type is {err['type']!r}, Anthropic says {want!r}")
    return err


# ---------------------------------------------------------------------------------------------
# Raw HTTP over a socket (for bodies that must be sent while the answer is read)


@dataclass
class RawResponse:
    status_code: int
    headers: dict[str, str]
    content: bytes
    send_error: str = ""

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


def raw_request(base_url: str, method: str, path: str, headers: dict[str, str], body_chunks: Iterable[bytes],
                chunked: bool = False, timeout: float = 60.0) -> RawResponse:
    """Sends the request from a writer thread while this thread reads the answer, so a server that
    answers early (413) and closes is still heard even though the body was not all sent."""
    import http.client

    u = urlsplit(base_url)
    sock = socket.create_connection((u.hostname, u.port or 80), timeout=timeout)
    head = [f"{method} {path} HTTP/1.1", f"Host: {u.hostname}:{u.port}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    if chunked:
        head.append("Transfer-Encoding: chunked")
    send_error: list[str] = []

    def writer() -> None:
        try:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
            for chunk in body_chunks:
                if chunked:
                    sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                else:
                    sock.sendall(chunk)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError as e:
            send_error.append(describe(e))

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        resp = http.client.HTTPResponse(sock, method=method)
        resp.begin()
        content = resp.read()
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
        return RawResponse(resp.status, hdrs, content, "; ".join(send_error))
    finally:
        try:
            sock.close()
        except OSError:
            pass
        t.join(timeout=5)


# ---------------------------------------------------------------------------------------------
# met generate as the reference


@dataclass
class Generated:
    text: str
    prompt_ids: list[int]
    output_ids: list[int]
    max_tokens: int

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish_reason: met generate leaves EOS out of its output ids, so fewer ids than
        max_tokens means it stopped at EOS."""
        return "length" if len(self.output_ids) >= self.max_tokens else "stop"

    @property
    def stop_reason(self) -> str:
        """Anthropic's stop_reason for the same answer."""
        return "max_tokens" if self.finish_reason == "length" else "end_turn"


_GEN_CACHE: dict[tuple, Generated] = {}


def met_generate(met: str, model_path: str, prompt: str, max_tokens: int, chat: bool,
                 backend: str = "host", timeout: float = 300.0) -> Generated:
    """`met generate ... --temperature 0 --print-ids`: stdout is the completion plus one newline."""
    key = (met, model_path, prompt, max_tokens, chat, backend)
    if key in _GEN_CACHE:
        return _GEN_CACHE[key]
    if not Path(met).is_file():
        raise AssertionError(f"met binary not found at {met} (build it, or pass --met / --no-generate)")
    if not Path(model_path).is_file():
        raise AssertionError(f"model not found at {model_path} (run scripts/fetch-test-data.sh, or pass --model-path)")
    cmd = [met, "generate", "--backend", backend, "--model-from-path", model_path, "--prompt", prompt,
           "--max-tokens", str(max_tokens), "--temperature", "0", "--print-ids"]
    if chat:
        cmd.append("--chat")
    p = subprocess.run(cmd, capture_output=True, timeout=timeout)
    stderr = p.stderr.decode("utf-8", errors="replace")
    if p.returncode != 0:
        raise AssertionError(f"`{' '.join(cmd)}` exited {p.returncode}: {stderr[-500:]}")
    stdout = p.stdout.decode("utf-8")
    expect(stdout.endswith("\n"), f"met generate stdout does not end with a newline: {stdout!r}")

    def ids(label: str) -> list[int]:
        m = re.search(rf"^{label} ids: (\[[^\]]*\])", stderr, re.M)
        expect(m, f"met generate printed no '{label} ids:' line: {stderr[-300:]}")
        return json.loads(m.group(1))

    g = Generated(stdout[:-1], ids("prompt"), ids("output"), max_tokens)
    _GEN_CACHE[key] = g
    return g


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))
    return s[k]
