# SPDX-License-Identifier: MIT OR Apache-2.0
"""Tool calls and reasoning through the official SDKs (part of test_clients.py).

SmolLM2-135M does not call tools or think by itself, but it copies a pattern: a few-shot history
whose assistant turns are `{"name": "get_weather", "parameters": {...}}` (the llama3_json wire
format, the llama family's preset) or `<think>...</think>answer` makes its greedy answer
follow suit. That exercises the server's parsers on a real model's output; the exact parsing
rules are tested on scripted outputs in the Rust unit tests (crates/server/src/serve/reply/).

The reasoning tests need the `<think>` parser on, which SmolLM2's preset does not turn on:
they start a second server (`--reasoning-parser think --tool-max-tokens 5`) with the same met and
model, and stop it when the suite ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from common import Skip, anthropic_prompt_tokens, expect, expect_eq

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                       "required": ["location"], "additionalProperties": False},
        "strict": True,
    },
}
ANTHROPIC_WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
TOOL_MAX = 24  # the call takes 18 tokens (SmolLM2's tokenizer); EOS follows it
THINK_MAX = 16


def call_text(city: str) -> str:
    return '{"name": "get_weather", "parameters": {"location": "%s"}}' % city


def weather_history(question: str = "Weather in Paris?") -> list[dict]:
    """Three worked examples, then the question: SmolLM2 answers with the call."""
    msgs: list[dict] = [{"role": "system", "content": "Answer with a get_weather call."}]
    for city in ("Rome", "Berlin", "Madrid"):
        msgs += [{"role": "user", "content": f"Weather in {city}?"}, {"role": "assistant", "content": call_text(city)}]
    return msgs + [{"role": "user", "content": question}]


def think_history() -> list[dict]:
    msgs: list[dict] = [{"role": "system", "content": "Think first."}]
    for q, a in (("2+2?", "4"), ("3+3?", "6"), ("5+1?", "6")):
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": f"<think>I add the numbers.</think>{a}"}]
    return msgs + [{"role": "user", "content": "1+1?"}]


def anthropic_history(msgs: list[dict]) -> tuple[str, list[dict]]:
    """The same conversation for /v1/messages: the system prompt apart, assistant text as blocks."""
    system = msgs[0]["content"]
    out = []
    for m in msgs[1:]:
        content = [{"type": "text", "text": m["content"]}] if m["role"] == "assistant" else m["content"]
        out.append({"role": m["role"], "content": content})
    return system, out


def fold_chat_stream(chunks: list[Any]) -> dict[str, Any]:
    """Folds chat.completion.chunk objects the way a client does: content, reasoning_content and
    tool calls by index (id, type and name from the first delta of a call, arguments appended)."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": [], "finish": None}
    for c in chunks:
        for ch in c.choices:
            d = ch.delta
            out["content"] += d.content or ""
            out["reasoning"] += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                if tc.index == len(out["calls"]):
                    expect(tc.id and tc.type == "function" and tc.function and tc.function.name,
                           f"the first delta of call {tc.index} lacks id, type or name: {tc}")
                    out["calls"].append({"id": tc.id, "name": tc.function.name, "arguments": ""})
                else:
                    expect(tc.index < len(out["calls"]), f"tool call index {tc.index} skips ahead")
                    expect(tc.id is None, f"a later delta of call {tc.index} repeats the id: {tc}")
                out["calls"][tc.index]["arguments"] += (tc.function.arguments if tc.function else None) or ""
            if ch.finish_reason:
                expect(out["finish"] is None, "two finish_reasons")
                out["finish"] = ch.finish_reason
    return out


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class ReasoningServer:
    """A second `met serve` with the `<think>` parser on, started on first use."""

    def __init__(self, met: str, model_path: str, backend: str, log_dir: Path, api_key: str):
        self.met, self.model_path, self.backend, self.log_dir = met, model_path, backend, log_dir
        self.api_key = api_key
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.error: str | None = None

    def base(self) -> str:
        if self.error:
            raise Skip(self.error)
        if self.url:
            return self.url
        if not Path(self.met).is_file():
            self.error = f"met binary not found at {self.met} (pass --met)"
            raise Skip(self.error)
        if not Path(self.model_path).is_file():
            self.error = f"model not found at {self.model_path} (pass --model-path)"
            raise Skip(self.error)
        port = free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / "server-reasoning.log"
        cmd = [self.met, "serve", "--model-from-path", self.model_path, "--backend", self.backend,
               "--bind", "127.0.0.1", "--port", str(port), "--model-name", "smollm2", "--max-seq-len", "1024",
               "--max-num-seqs", "8", "--reasoning-parser", "think", "--tool-max-tokens", "5"]
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.error = f"`{' '.join(cmd)}` exited {self.proc.returncode}; see {log}"
                raise AssertionError(self.error)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    self.url = url
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.error = f"the reasoning server did not answer /health within 120 s; see {log}"
        raise AssertionError(self.error)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def add_tool_tests(runner, oa, an, model: Callable[[], str], args) -> ReasoningServer:
    """Registers the tests; returns the reasoning server, which the caller stops at the end."""
    import anthropic
    import openai

    log_dir = Path(args.report).resolve().parent if args.report else Path(os.environ.get("TMPDIR", "/tmp"))
    reasoning = ReasoningServer(args.met, args.model_path, args.generate_backend, log_dir, args.api_key)

    def reasoning_clients():
        base = reasoning.base()
        return (openai.OpenAI(base_url=f"{base}/v1", api_key=args.api_key, max_retries=0, timeout=300.0),
                anthropic.Anthropic(base_url=base, api_key=args.api_key, max_retries=0, timeout=300.0))

    def check_weather_call(call_id: str, name: str, arguments: str, what: str) -> None:
        expect(call_id.startswith("call_"), f"{what}: id {call_id!r} does not start with call_")
        expect_eq(name, "get_weather", f"{what}: function name")
        expect_eq(json.loads(arguments), {"location": "Paris"}, f"{what}: arguments")

    # ---------------------------------------------------------------------------------------------
    # OpenAI tool calls

    @runner.test("chat_tool_call_parsed")
    def _():
        r = oa.chat.completions.create(model=model(), messages=weather_history(), tools=[WEATHER_TOOL],
                                       max_tokens=TOOL_MAX, temperature=0)
        c = r.choices[0]
        expect(c.message.tool_calls, f"no tool_calls: SmolLM2 did not follow the few-shot calls ({c.message})")
        expect_eq(c.finish_reason, "tool_calls", "finish_reason")
        expect_eq(c.message.content, None, "content next to the call")
        expect_eq(len(c.message.tool_calls), 1, "number of calls")
        tc = c.message.tool_calls[0]
        expect_eq(tc.type, "function", "tool_calls[0].type")
        check_weather_call(tc.id, tc.function.name, tc.function.arguments, "tool_calls[0]")
        again = oa.chat.completions.create(model=model(), messages=weather_history(), tools=[WEATHER_TOOL],
                                           max_tokens=TOOL_MAX, temperature=0)
        expect(again.choices[0].message.tool_calls[0].id != tc.id, "two responses gave their calls the same id")

    @runner.test("chat_tool_call_stream_equals_non_stream")
    def _():
        kw = dict(model=model(), messages=weather_history(), tools=[WEATHER_TOOL], max_tokens=TOOL_MAX, temperature=0)
        whole = oa.chat.completions.create(**kw).choices[0]
        chunks = list(oa.chat.completions.create(stream=True, **kw))
        s = fold_chat_stream(chunks)
        expect_eq(s["finish"], whole.finish_reason, "streamed finish_reason")
        expect_eq(s["content"] or None, whole.message.content or None, "streamed content")
        want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        expect_eq([(c["name"], c["arguments"]) for c in s["calls"]], want, "streamed tool calls (name, arguments)")
        expect(want, "the answer has no call to compare")
        check_weather_call(s["calls"][0]["id"], s["calls"][0]["name"], s["calls"][0]["arguments"], "streamed call")
        # The SDK's stream helper accumulates the calls itself and parses strict tools' arguments.
        with oa.chat.completions.stream(**kw) as stream:
            final = stream.get_final_completion()
        fc = final.choices[0]
        expect_eq(fc.finish_reason, "tool_calls", "stream helper finish_reason")
        expect_eq([(c.function.name, c.function.arguments) for c in fc.message.tool_calls], want,
                  "stream helper tool calls")
        expect_eq(fc.message.tool_calls[0].function.parsed_arguments, {"location": "Paris"},
                  "stream helper parsed_arguments")

    @runner.test("chat_tool_choice_none_leaves_text")
    def _():
        r = oa.chat.completions.create(model=model(), messages=weather_history(), tools=[WEATHER_TOOL],
                                       tool_choice="none", max_tokens=TOOL_MAX, temperature=0)
        c = r.choices[0]
        expect_eq(c.message.tool_calls, None, "tool_calls with tool_choice none")
        expect_eq(c.message.content, call_text("Paris"), "the call's text stays content with tool_choice none")
        expect(c.finish_reason in ("stop", "length"), f"finish_reason {c.finish_reason!r}")

    @runner.test("chat_tool_results_multi_turn")
    def _():
        first = oa.chat.completions.create(model=model(), messages=weather_history(), tools=[WEATHER_TOOL],
                                           max_tokens=TOOL_MAX, temperature=0)
        calls = first.choices[0].message.tool_calls
        expect(calls, "no call to answer")
        tc = calls[0]
        msgs = weather_history() + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": tc.function.arguments}}]},
            {"role": "tool", "tool_call_id": tc.id, "content": '{"temperature": 15, "condition": "cloudy"}'},
        ]
        r = oa.chat.completions.create(model=model(), messages=msgs, tools=[WEATHER_TOOL], max_tokens=6, temperature=0)
        expect(r.choices[0].finish_reason in ("stop", "length", "tool_calls"), f"finish_reason {r.choices[0].finish_reason!r}")
        expect(r.usage.prompt_tokens > first.usage.prompt_tokens + 10,
               f"the call and its result did not reach the prompt ({r.usage.prompt_tokens} vs {first.usage.prompt_tokens} tokens)")

    # ---------------------------------------------------------------------------------------------
    # Anthropic tool use

    @runner.test("anthropic_tool_use_and_stream")
    def _():
        system, msgs = anthropic_history(weather_history())
        kw = dict(model=model(), max_tokens=TOOL_MAX, system=system, messages=msgs, tools=[ANTHROPIC_WEATHER_TOOL],
                  extra_body={"temperature": 0})
        m = an.messages.create(**kw)
        expect_eq(m.stop_reason, "tool_use", f"stop_reason (content {m.content})")
        uses = [b for b in m.content if b.type == "tool_use"]
        expect_eq(len(uses), 1, f"tool_use blocks in {m.content}")
        expect(uses[0].id.startswith("toolu_"), f"tool_use id {uses[0].id!r}")
        expect_eq((uses[0].name, uses[0].input), ("get_weather", {"location": "Paris"}), "tool_use name and input")
        with an.messages.stream(**kw) as stream:
            events = list(stream)
            final = stream.get_final_message()
        expect_eq(final.stop_reason, "tool_use", "streamed stop_reason")
        strip = lambda blocks: [(b.type, getattr(b, "name", None), getattr(b, "input", None), getattr(b, "text", None))
                                for b in blocks]
        expect_eq(strip(final.content), strip(m.content), "streamed content blocks vs non-streamed")
        starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
        expect_eq(len(starts), 1, "content_block_start events of type tool_use")
        expect_eq(starts[0].content_block.input, {}, "a tool_use block starts with empty input")
        deltas = [e for e in events if e.type == "content_block_delta" and e.index == starts[0].index]
        expect(deltas and all(e.delta.type == "input_json_delta" for e in deltas),
               f"the tool_use block's deltas are not input_json_delta: {deltas}")
        stops = [e for e in events if e.type == "content_block_stop" and e.index == starts[0].index]
        expect_eq(len(stops), 1, "content_block_stop of the tool_use block")

    @runner.test("anthropic_tool_result_multi_turn")
    def _():
        system, msgs = anthropic_history(weather_history())
        msgs += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"location": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": '{"temperature": 15}'}]}]},
        ]
        m = an.messages.create(model=model(), max_tokens=6, system=system, messages=msgs,
                               tools=[ANTHROPIC_WEATHER_TOOL], tool_choice={"type": "auto"},
                               extra_body={"temperature": 0})
        expect(m.stop_reason in ("end_turn", "max_tokens", "tool_use"), f"stop_reason {m.stop_reason!r}")
        n = an.messages.count_tokens(model=model(), system=system, messages=msgs, tools=[ANTHROPIC_WEATHER_TOOL])
        expect_eq(n.input_tokens, anthropic_prompt_tokens(m.usage),
                  "count_tokens vs usage.input_tokens + cache_read_input_tokens with tools and results")

    # ---------------------------------------------------------------------------------------------
    # Reasoning (a second server with --reasoning-parser think --tool-max-tokens 5)

    @runner.test("reasoning_parser_leaves_plain_answers_alone")
    def _():
        roa, _ = reasoning_clients()
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        a = oa.chat.completions.create(model=model(), messages=msgs, max_tokens=8, temperature=0).choices[0].message
        b = roa.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0).choices[0].message
        expect_eq(b.content, a.content, "content with and without the reasoning parser (no <think> in it)")
        expect_eq(getattr(b, "reasoning_content", None), None, "reasoning_content of an answer without <think>")

    @runner.test("reasoning_content_stream_equals_non_stream")
    def _():
        roa, _ = reasoning_clients()
        kw = dict(model="smollm2", messages=think_history(), max_tokens=THINK_MAX, temperature=0)
        whole = roa.chat.completions.create(**kw).choices[0]
        expect_eq(getattr(whole.message, "reasoning_content", None), "I add the numbers.",
                  f"reasoning_content (SmolLM2 did not follow the few-shot <think>?) {whole.message}")
        expect("<think>" not in (whole.message.content or "") and "</think>" not in (whole.message.content or ""),
               f"a think tag leaked into the content: {whole.message.content!r}")
        s = fold_chat_stream(list(roa.chat.completions.create(stream=True, **kw)))
        expect_eq(s["reasoning"], whole.message.reasoning_content, "streamed reasoning_content")
        expect_eq(s["content"], whole.message.content or "", "streamed content")
        expect_eq(s["finish"], whole.finish_reason, "streamed finish_reason")

    @runner.test("thinking_budget_closes_the_block")
    def _():
        roa, ran = reasoning_clients()
        kw = dict(model="smollm2", messages=think_history(), max_tokens=THINK_MAX, temperature=0)
        full = roa.chat.completions.create(**kw).choices[0].message.reasoning_content
        r = roa.chat.completions.create(extra_body={"thinking_budget": 2}, **kw).choices[0].message
        cut = getattr(r, "reasoning_content", None) or ""
        expect(len(cut) < len(full) and full.startswith(cut),
               f"with thinking_budget 2 the reasoning {cut!r} is not a shorter prefix of {full!r}")
        expect(r.content, "no answer after the closed block")
        system, msgs = anthropic_history(think_history())
        m = ran.messages.create(model="smollm2", max_tokens=THINK_MAX, system=system, messages=msgs,
                                thinking={"type": "enabled", "budget_tokens": 2}, extra_body={"temperature": 0})
        types = [b.type for b in m.content]
        expect_eq(types[:1], ["thinking"], f"first block with thinking enabled: {m.content}")
        expect_eq(m.content[0].thinking, cut, "Anthropic thinking with budget_tokens 2 vs OpenAI thinking_budget 2")

    @runner.test("anthropic_thinking_blocks_stream")
    def _():
        _, ran = reasoning_clients()
        system, msgs = anthropic_history(think_history())
        kw = dict(model="smollm2", max_tokens=THINK_MAX, system=system, messages=msgs, extra_body={"temperature": 0})
        m = ran.messages.create(**kw)
        expect_eq([b.type for b in m.content][:2], ["thinking", "text"], f"content blocks: {m.content}")
        expect_eq(m.content[0].thinking, "I add the numbers.", "thinking block")
        with ran.messages.stream(**kw) as stream:
            events = list(stream)
            final = stream.get_final_message()
        expect(any(e.type == "content_block_delta" and e.delta.type == "thinking_delta" for e in events),
               "no thinking_delta event")
        expect_eq([(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in final.content],
                  [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in m.content],
                  "streamed blocks vs non-streamed")

    @runner.test("tool_max_tokens_caps_requests_with_tools")
    def _():
        roa, _ = reasoning_clients()
        msgs = [{"role": "user", "content": "Tell me a long story about a dog."}]
        plain = roa.chat.completions.create(model="smollm2", messages=msgs, max_tokens=10, temperature=0)
        expect(plain.usage.completion_tokens > 5, f"the answer without tools has only {plain.usage.completion_tokens} tokens")
        capped = roa.chat.completions.create(model="smollm2", messages=msgs, max_tokens=10, temperature=0,
                                             tools=[WEATHER_TOOL])
        expect_eq(capped.usage.completion_tokens, 5, "completion tokens with tools on a --tool-max-tokens 5 server")
        expect_eq(capped.choices[0].finish_reason, "length", "finish_reason at the tool cap")

    return reasoning
