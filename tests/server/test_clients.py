# SPDX-License-Identifier: MIT OR Apache-2.0
"""Black-box suite: the official OpenAI and Anthropic SDKs against a running `met serve`.

Greedy answers are compared with `met generate --temperature 0` (run as a subprocess), 16 clients
at once must each get the text they get alone, stop strings never leak, usage adds up, and the
server is idle afterwards (no active request, no KV block in use). Tool calls and reasoning are
in tool_tests.py, constrained decoding in grammar_tests.py. See tests/server/README.md.

    python tests/server/test_clients.py --base-url http://127.0.0.1:8888
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from typing import Any

import httpx

from common import (
    REPO,
    REQUIRED_METRICS,
    Runner,
    Skip,
    anthropic_prompt_tokens,
    base_parser,
    default_model_path,
    expect,
    expect_eq,
    get_metrics,
    met_generate,
    preflight,
    wait_idle,
)
from grammar_tests import add_grammar_tests
from tool_tests import add_tool_tests

# Prompts are short and max_tokens small: the CI server runs on two CPU cores.
CHAT_PROMPT = "What is the capital of France?"  # SmolLM2 answers in a few tokens, then EOS
CHAT_MAX = 12
RAW_PROMPT = "The quick brown fox"  # runs to max_tokens
RAW_MAX = 12
SYSTEM = "Answer in one short sentence."  # keeps the chat prompt short (no default system prompt)
# The anthropic SDK (2.x) has no `temperature` argument any more; the server takes the field.
GREEDY = {"temperature": 0}

CONCURRENT_CHAT = [
    "Name a color.",
    "What is 2+2?",
    "Say hello in French.",
    "Name a fruit.",
    "What is the opposite of hot?",
    "Name a planet.",
    "What do bees make?",
    "Name an ocean.",
]
CONCURRENT_RAW = [
    "Once upon a time",
    "The sun rises in the",
    "My favourite food is",
    "In 1492, Columbus",
    "Water boils at",
    "The cat sat on the",
    "def fibonacci(n):",
    "Roses are red,",
]
CONCURRENT_MAX = 8


def main() -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--met", default=str(REPO / "target" / "release" / "met"), help="met binary for the reference outputs")
    p.add_argument("--model-path", default=default_model_path(), help="the GGUF the server serves (for met generate)")
    p.add_argument("--generate-backend", default="host", help="backend for met generate (default %(default)s)")
    p.add_argument("--no-generate", action="store_true", help="skip the comparisons with met generate")
    p.add_argument("--model-name", help="the id GET /v1/models must list (default: use the first one listed)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default %(default)s)")
    args = p.parse_args()
    base = args.base_url.rstrip("/")
    preflight(base, args.wait, token=args.api_key)

    import anthropic
    import openai

    auth = {"Authorization": f"Bearer {args.api_key}"}
    http = httpx.Client(base_url=base, headers=auth, timeout=300.0)
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key=args.api_key, max_retries=0, timeout=300.0)
    an = anthropic.Anthropic(base_url=base, api_key=args.api_key, max_retries=0, timeout=300.0)
    runner = Runner("test_clients", base, args.verbose, args.api_key)
    st: dict[str, Any] = {"model": args.model_name or "smollm2"}

    def model() -> str:
        return st["model"]

    def gen(prompt: str, max_tokens: int, chat: bool):
        if args.no_generate:
            raise Skip("--no-generate")
        return met_generate(args.met, args.model_path, prompt, max_tokens, chat, args.generate_backend)

    def greedy_chat(prompt: str, max_tokens: int, **kw):
        return oa.chat.completions.create(
            model=model(), messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0, **kw
        )

    def detok(ids: list[int]) -> str:
        r = http.post("/detokenize", json={"tokens": ids})
        expect(r.status_code == 200, f"POST /detokenize answered {r.status_code}: {r.text[:200]}")
        return r.json()["prompt"]

    def tokenize(payload: dict) -> list[int]:
        r = http.post("/tokenize", json=payload)
        expect(r.status_code == 200, f"POST /tokenize answered {r.status_code}: {r.text[:200]}")
        body = r.json()
        expect(isinstance(body.get("tokens"), list) and all(isinstance(t, int) for t in body["tokens"]),
               f"/tokenize tokens is not a list of ints: {body}")
        expect_eq(body.get("count"), len(body["tokens"]), "/tokenize count vs len(tokens)")
        return body["tokens"]

    def chat_stream(**kw) -> dict[str, Any]:
        """Runs a streaming chat completion; returns texts, finish reasons and usage per index."""
        stream = oa.chat.completions.create(model=model(), stream=True, stream_options={"include_usage": True}, **kw)
        chunks = list(stream)
        expect(chunks, "the stream had no chunks")
        out: dict[str, Any] = {"text": {}, "finish": {}, "usage": None, "roles": {}, "deltas": []}
        expect_eq(len({c.id for c in chunks}), 1, "distinct chunk ids in one stream")
        for i, c in enumerate(chunks):
            expect_eq(c.object, "chat.completion.chunk", "chunk object")
            if c.usage is not None:
                expect(i == len(chunks) - 1, "the usage chunk is not the last chunk")
                expect_eq(c.choices, [], "choices of the usage chunk")
                out["usage"] = c.usage
            for ch in c.choices:
                if ch.delta.role:
                    out["roles"].setdefault(ch.index, ch.delta.role)
                if ch.delta.content:
                    out["text"][ch.index] = out["text"].get(ch.index, "") + ch.delta.content
                    out["deltas"].append(ch.delta.content)
                if ch.finish_reason:
                    expect(ch.index not in out["finish"], f"choice {ch.index} got two finish_reasons")
                    out["finish"][ch.index] = ch.finish_reason
        expect(out["usage"] is not None, "stream_options.include_usage was set but no usage chunk came")
        return out

    def completion_stream(**kw) -> dict[str, Any]:
        stream = oa.completions.create(model=model(), stream=True, stream_options={"include_usage": True}, **kw)
        out: dict[str, Any] = {"text": {}, "finish": {}, "usage": None, "deltas": []}
        chunks = list(stream)
        for i, c in enumerate(chunks):
            if c.usage is not None:
                expect(i == len(chunks) - 1, "the usage chunk is not the last chunk")
                out["usage"] = c.usage
            for ch in c.choices:
                if ch.text:
                    out["text"][ch.index] = out["text"].get(ch.index, "") + ch.text
                    out["deltas"].append(ch.text)
                if ch.finish_reason:
                    expect(ch.index not in out["finish"], f"choice {ch.index} got two finish_reasons")
                    out["finish"][ch.index] = ch.finish_reason
        expect(out["usage"] is not None, "stream_options.include_usage was set but no usage chunk came")
        return out

    def check_usage(usage, g, what: str) -> None:
        expect_eq(usage.prompt_tokens, len(g.prompt_ids), f"{what} usage.prompt_tokens (met generate's prompt ids)")
        expect_eq(usage.completion_tokens, len(g.output_ids),
                  f"{what} usage.completion_tokens (met generate's output ids, EOS not counted)")
        expect_eq(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens, f"{what} usage.total_tokens")

    # -------------------------------------------------------------------------------------------
    # Service routes

    @runner.test("health")
    def _():
        r = http.get("/health")
        expect_eq(r.status_code, 200, "GET /health status")
        expect_eq(r.json(), {"status": "ok"}, "GET /health body")
        expect_eq(http.get("/health/live").status_code, 200, "GET /health/live status")

    @runner.test("models_list_and_retrieve")
    def _():
        models = list(oa.models.list())
        expect(models, "GET /v1/models lists no model")
        ids = [m.id for m in models]
        for m in models:
            expect_eq(m.object, "model", f"object of model {m.id}")
        if args.model_name:
            expect(args.model_name in ids, f"--model-name {args.model_name!r} not in /v1/models {ids}")
        else:
            st["model"] = ids[0]
        got = oa.models.retrieve(model())
        expect_eq(got.id, model(), "GET /v1/models/{id} id")

    @runner.test("openapi_json")
    def _():
        r = http.get("/openapi.json")
        expect_eq(r.status_code, 200, "GET /openapi.json status")
        doc = r.json()
        expect(isinstance(doc.get("openapi"), str), f"no 'openapi' version string: {list(doc)[:10]}")
        paths = doc.get("paths", {})
        for route in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/models"):
            expect(route in paths, f"/openapi.json paths lack {route} (have {sorted(paths)[:20]})")

    @runner.test("metrics_exposition")
    def _():
        m, text = get_metrics(base, auth)
        missing = [k for k in REQUIRED_METRICS if k not in m]
        expect(not missing, f"/metrics lacks {missing}")
        expect(m["metrale_kv_blocks_total"] > 0, "metrale_kv_blocks_total is 0")
        expect_eq(m["metrale_kv_blocks_used"] + m["metrale_kv_blocks_free"], m["metrale_kv_blocks_total"],
                  "kv_blocks_used + kv_blocks_free vs kv_blocks_total")
        expect("# TYPE metrale_time_to_first_token_seconds histogram" in text,
               "metrale_time_to_first_token_seconds is not declared a histogram (# TYPE line)")

    @runner.test("tokenize_detokenize")
    def _():
        ids = tokenize({"prompt": RAW_PROMPT})
        expect(ids, "/tokenize of a non-empty prompt gave no tokens")
        expect(RAW_PROMPT in detok(ids), f"/detokenize(/tokenize(x)) does not contain x: {detok(ids)!r}")
        chat_ids = tokenize({"messages": [{"role": "user", "content": CHAT_PROMPT}]})
        expect(len(chat_ids) > len(tokenize({"prompt": CHAT_PROMPT})), "/tokenize messages adds no chat template")
        if not args.no_generate:
            expect_eq(ids, gen(RAW_PROMPT, RAW_MAX, chat=False).prompt_ids, "/tokenize prompt vs met generate's prompt ids")
            expect_eq(chat_ids, gen(CHAT_PROMPT, CHAT_MAX, chat=True).prompt_ids,
                      "/tokenize messages vs met generate --chat prompt ids (template + generation prompt)")

    # -------------------------------------------------------------------------------------------
    # Greedy answers equal met generate

    @runner.test("chat_greedy_equals_generate")
    def _():
        g = gen(CHAT_PROMPT, CHAT_MAX, chat=True)
        r = greedy_chat(CHAT_PROMPT, CHAT_MAX)
        expect_eq(r.object, "chat.completion", "object")
        expect_eq(len(r.choices), 1, "number of choices")
        c = r.choices[0]
        expect_eq(c.message.role, "assistant", "message.role")
        expect_eq(c.message.content, g.text, "greedy chat content vs met generate --chat")
        expect_eq(c.finish_reason, g.finish_reason, "finish_reason")
        check_usage(r.usage, g, "chat")

    @runner.test("chat_stream_greedy_equals_generate")
    def _():
        g = gen(CHAT_PROMPT, CHAT_MAX, chat=True)
        s = chat_stream(messages=[{"role": "user", "content": CHAT_PROMPT}], max_tokens=CHAT_MAX, temperature=0)
        expect_eq(s["roles"].get(0), "assistant", "delta.role of the stream")
        expect_eq(s["text"].get(0, ""), g.text, "streamed greedy chat content vs met generate --chat")
        expect_eq(s["finish"].get(0), g.finish_reason, "finish_reason")
        check_usage(s["usage"], g, "streamed chat")

    @runner.test("completion_greedy_equals_generate")
    def _():
        g = gen(RAW_PROMPT, RAW_MAX, chat=False)
        r = oa.completions.create(model=model(), prompt=RAW_PROMPT, max_tokens=RAW_MAX, temperature=0)
        expect_eq(r.object, "text_completion", "object")
        expect_eq(r.choices[0].text, g.text, "greedy completion text vs met generate (no --chat)")
        expect_eq(r.choices[0].finish_reason, g.finish_reason, "finish_reason")
        check_usage(r.usage, g, "completion")

    @runner.test("completion_stream_greedy_equals_generate")
    def _():
        g = gen(RAW_PROMPT, RAW_MAX, chat=False)
        s = completion_stream(prompt=RAW_PROMPT, max_tokens=RAW_MAX, temperature=0)
        expect_eq(s["text"].get(0, ""), g.text, "streamed greedy completion vs met generate")
        expect_eq(s["finish"].get(0), g.finish_reason, "finish_reason")
        check_usage(s["usage"], g, "streamed completion")

    @runner.test("anthropic_messages_greedy_equals_generate")
    def _():
        g = gen(CHAT_PROMPT, CHAT_MAX, chat=True)
        m = an.messages.create(model=model(), max_tokens=CHAT_MAX, extra_body=GREEDY,
                               messages=[{"role": "user", "content": CHAT_PROMPT}])
        expect_eq(m.type, "message", "type")
        expect_eq(m.role, "assistant", "role")
        expect_eq([b.type for b in m.content], ["text"], "content block types")
        expect_eq(m.content[0].text, g.text, "greedy Anthropic message vs met generate --chat")
        expect_eq(m.stop_reason, g.stop_reason, "stop_reason")
        expect_eq(anthropic_prompt_tokens(m.usage), len(g.prompt_ids), "usage.input_tokens + cache_read_input_tokens")
        expect_eq(m.usage.output_tokens, len(g.output_ids), "usage.output_tokens")

    @runner.test("anthropic_stream_helper_greedy_equals_generate")
    def _():
        g = gen(CHAT_PROMPT, CHAT_MAX, chat=True)
        with an.messages.stream(model=model(), max_tokens=CHAT_MAX, extra_body=GREEDY,
                                messages=[{"role": "user", "content": CHAT_PROMPT}]) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        expect_eq(text, g.text, "text_stream vs met generate --chat")
        expect_eq(final.content[0].text, g.text, "get_final_message() text")
        expect_eq(final.stop_reason, g.stop_reason, "stop_reason")
        expect_eq(final.usage.output_tokens, len(g.output_ids), "usage.output_tokens")

    @runner.test("anthropic_stream_event_order")
    def _():
        events = list(an.messages.create(model=model(), max_tokens=4, extra_body=GREEDY, stream=True,
                                         messages=[{"role": "user", "content": CHAT_PROMPT}]))
        types = [e.type for e in events if e.type != "ping"]
        expect(types, "no events")
        expect_eq(types[0], "message_start", "first event")
        expect_eq(types[-1], "message_stop", "last event")
        expect_eq(types[-2], "message_delta", "event before message_stop")
        expect_eq(types[1], "content_block_start", "second event")
        expect_eq(types[-3], "content_block_stop", "event before message_delta")
        middle = types[2:-3]
        expect(middle and all(t == "content_block_delta" for t in middle),
               f"between content_block_start and content_block_stop want only content_block_delta: {types}")
        start = events[0].message
        expect_eq(start.role, "assistant", "message_start message.role")
        expect_eq(start.content, [], "message_start message.content")
        delta = [e for e in events if e.type == "message_delta"][0]
        expect_eq(delta.delta.stop_reason, "max_tokens", "message_delta stop_reason (4 tokens asked)")
        expect_eq(delta.usage.output_tokens, 4, "message_delta usage.output_tokens")
        for e in events:
            if e.type == "content_block_delta":
                expect_eq(e.delta.type, "text_delta", "content_block_delta delta.type")
                expect_eq(e.index, 0, "content_block_delta index")

    @runner.test("anthropic_count_tokens")
    def _():
        msgs = [{"role": "user", "content": CHAT_PROMPT}]
        n = an.messages.count_tokens(model=model(), messages=msgs).input_tokens
        blocks = [{"role": "user", "content": [{"type": "text", "text": CHAT_PROMPT}]}]
        expect_eq(an.messages.count_tokens(model=model(), messages=blocks).input_tokens, n,
                  "count_tokens with a text block vs with a string")
        expect_eq(n, len(tokenize({"messages": msgs})), "count_tokens vs /tokenize messages")
        with_system = an.messages.count_tokens(model=model(), messages=msgs, system=SYSTEM).input_tokens
        want = len(tokenize({"messages": [{"role": "system", "content": SYSTEM}] + msgs}))
        expect_eq(with_system, want, "count_tokens with system vs /tokenize with a system message")
        if not args.no_generate:
            expect_eq(n, len(gen(CHAT_PROMPT, CHAT_MAX, chat=True).prompt_ids), "count_tokens vs met generate --chat")

    # -------------------------------------------------------------------------------------------
    # Limits, stop strings, usage

    @runner.test("max_tokens_and_max_completion_tokens_length")
    def _():
        full = chat_baseline()[0]
        for kw in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
            r = oa.chat.completions.create(model=model(), messages=[{"role": "user", "content": CHAT_PROMPT}],
                                           temperature=0, **kw)
            expect_eq(r.choices[0].finish_reason, "length", f"finish_reason with {kw}")
            expect_eq(r.usage.completion_tokens, 3, f"usage.completion_tokens with {kw}")
            expect(full.startswith(r.choices[0].message.content),
                   f"3-token answer {r.choices[0].message.content!r} is not a prefix of the full one {full!r}")
        m = an.messages.create(model=model(), max_tokens=3, extra_body=GREEDY, messages=[{"role": "user", "content": CHAT_PROMPT}])
        expect_eq(m.stop_reason, "max_tokens", "Anthropic stop_reason at max_tokens")
        expect_eq(m.usage.output_tokens, 3, "Anthropic usage.output_tokens")

    def pick_stop(text: str, ids: list[int] | None) -> str:
        """A 4-character stop string that starts inside one token and ends inside the next."""
        bounds: list[int] = []
        if ids and len(ids) > 2 and detok(ids) == text:
            bounds = [len(detok(ids[:k])) for k in range(1, len(ids))]
        if not bounds:
            bounds = [len(text) // 2]
        for b in sorted(bounds, key=lambda b: abs(b - len(text) / 2)):
            s = text[b - 2:b + 2]
            if b >= 3 and len(s) == 4 and text.find(s) == b - 2 and s.strip():
                return s
        raise Skip(f"no usable stop string in {text!r}")

    def chat_baseline() -> tuple[str, list[int] | None]:
        if args.no_generate:
            r = greedy_chat(CHAT_PROMPT, CHAT_MAX)
            return r.choices[0].message.content, None
        g = gen(CHAT_PROMPT, CHAT_MAX, chat=True)
        return g.text, g.output_ids

    @runner.test("stop_string_across_token_boundary")
    def _():
        text, ids = chat_baseline()
        stop = pick_stop(text, ids)
        want = text[: text.find(stop)]
        msgs = [{"role": "user", "content": CHAT_PROMPT}]
        r = oa.chat.completions.create(model=model(), messages=msgs, max_tokens=CHAT_MAX, temperature=0,
                                       stop=["@@never@@", stop])
        c = r.choices[0]
        expect(stop not in c.message.content, f"stop {stop!r} is in the output {c.message.content!r}")
        expect_eq(c.message.content, want, f"content with stop {stop!r} (full answer {text!r})")
        expect_eq(c.finish_reason, "stop", "finish_reason at a stop string")
        s = chat_stream(messages=msgs, max_tokens=CHAT_MAX, temperature=0, stop=stop)
        expect(all(stop not in d for d in s["deltas"]), f"a delta contains the stop {stop!r}: {s['deltas']}")
        expect_eq(s["text"].get(0, ""), want, f"streamed content with stop {stop!r} (full answer {text!r})")
        expect_eq(s["finish"].get(0), "stop", "streamed finish_reason at a stop string")
        m = an.messages.create(model=model(), max_tokens=CHAT_MAX, extra_body=GREEDY, messages=msgs,
                               stop_sequences=[stop])
        expect_eq(m.content[0].text if m.content else "", want, f"Anthropic text with stop_sequences [{stop!r}]")
        expect_eq(m.stop_reason, "stop_sequence", "Anthropic stop_reason")
        expect_eq(m.stop_sequence, stop, "Anthropic stop_sequence")

    @runner.test("stop_string_partial_match_releases_text")
    def _():
        # The stream holds back text that may begin a stop string; when the match fails it must
        # all come out: the answer is unchanged.
        text, ids = chat_baseline()
        stop = pick_stop(text, ids) + "\u2603\u2603"
        s = chat_stream(messages=[{"role": "user", "content": CHAT_PROMPT}], max_tokens=CHAT_MAX, temperature=0,
                        stop=[stop])
        expect_eq(s["text"].get(0, ""), text, f"content with a stop {stop!r} that only partly matches")

    @runner.test("completion_stop_string")
    def _():
        if args.no_generate:
            text = oa.completions.create(model=model(), prompt=RAW_PROMPT, max_tokens=RAW_MAX, temperature=0).choices[0].text
            ids = None
        else:
            g = gen(RAW_PROMPT, RAW_MAX, chat=False)
            text, ids = g.text, g.output_ids
        stop = "\n\n" if text.find("\n\n") > 0 else pick_stop(text, ids)
        want = text[: text.find(stop)]
        r = oa.completions.create(model=model(), prompt=RAW_PROMPT, max_tokens=RAW_MAX, temperature=0, stop=stop)
        expect_eq(r.choices[0].text, want, f"completion with stop {stop!r} (full {text!r})")
        expect_eq(r.choices[0].finish_reason, "stop", "finish_reason")
        s = completion_stream(prompt=RAW_PROMPT, max_tokens=RAW_MAX, temperature=0, stop=[stop])
        expect_eq(s["text"].get(0, ""), want, f"streamed completion with stop {stop!r}")
        expect(all(stop not in d for d in s["deltas"]), f"a delta contains the stop {stop!r}")
        expect_eq(s["finish"].get(0), "stop", "streamed finish_reason")

    @runner.test("n_2_choices")
    def _():
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name an animal."}]
        r = oa.chat.completions.create(model=model(), messages=msgs, n=2, max_tokens=5, temperature=1.0, seed=1234)
        expect_eq(len(r.choices), 2, "number of choices with n=2")
        expect_eq(sorted(c.index for c in r.choices), [0, 1], "choice indices")
        for c in r.choices:
            expect(c.finish_reason in ("stop", "length"), f"choice {c.index} finish_reason {c.finish_reason!r}")
        lengths = [c.finish_reason for c in r.choices]
        if lengths == ["length", "length"]:
            expect_eq(r.usage.completion_tokens, 10, "usage.completion_tokens over 2 choices of 5 tokens")
        else:
            expect(2 <= r.usage.completion_tokens <= 10, f"usage.completion_tokens {r.usage.completion_tokens} not in 2..10")
        s = chat_stream(messages=msgs, n=2, max_tokens=5, temperature=1.0, seed=1234)
        expect_eq(sorted(s["finish"]), [0, 1], "streamed choices that got a finish_reason")
        expect(s["usage"].completion_tokens <= 10, "streamed usage.completion_tokens over 2 choices")

    @runner.test("seed_reproducible")
    def _():
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about dogs."}]
        kw = dict(model=model(), messages=msgs, max_tokens=6, temperature=1.0, top_p=0.95, seed=4242)
        a = oa.chat.completions.create(**kw).choices[0].message.content
        b = oa.chat.completions.create(**kw).choices[0].message.content
        expect_eq(b, a, "second answer with the same seed")

    @runner.test("sampling_parameters_accepted")
    def _():
        r = oa.chat.completions.create(
            model=model(), messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}],
            max_tokens=4, temperature=0.7, top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.5,
            extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
        )
        expect_eq(len(r.choices), 1, "number of choices")
        expect(r.choices[0].finish_reason in ("stop", "length"), "finish_reason")
        expect(1 <= r.usage.completion_tokens <= 4, f"usage.completion_tokens {r.usage.completion_tokens}")

    @runner.test("model_field_accepted_whatever_it_says")
    def _():
        r = oa.chat.completions.create(model="no-such-model/at-all", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=1, temperature=0)
        expect_eq(len(r.choices), 1, "number of choices")

    @runner.test("chat_logprobs")
    def _():
        r = oa.chat.completions.create(
            model=model(), messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": CHAT_PROMPT}],
            max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
        )
        c = r.choices[0]
        expect(c.logprobs is not None and c.logprobs.content is not None, "no logprobs.content with logprobs=true")
        lp = c.logprobs.content
        expect_eq(len(lp), r.usage.completion_tokens, "logprobs entries vs usage.completion_tokens")
        for i, e in enumerate(lp):
            expect(e.logprob <= 1e-6, f"entry {i} logprob {e.logprob} > 0")
            expect_eq(len(e.top_logprobs), 3, f"entry {i} top_logprobs count")
            tops = [t.logprob for t in e.top_logprobs]
            expect(tops == sorted(tops, reverse=True), f"entry {i} top_logprobs not in descending order: {tops}")
            expect_eq(e.token, e.top_logprobs[0].token, f"entry {i}: greedy token vs the most likely one")
            expect(abs(e.logprob - tops[0]) < 1e-4, f"entry {i}: greedy logprob {e.logprob} vs top {tops[0]}")
        if c.message.content.isascii():
            expect_eq("".join(e.token for e in lp), c.message.content, "joined logprobs tokens vs content")

    @runner.test("completion_logprobs")
    def _():
        r = oa.completions.create(model=model(), prompt=RAW_PROMPT, max_tokens=3, temperature=0, logprobs=2)
        lp = r.choices[0].logprobs
        expect(lp is not None and lp.tokens is not None, "no logprobs with logprobs=2")
        expect_eq(len(lp.tokens), r.usage.completion_tokens, "logprobs.tokens vs usage.completion_tokens")
        expect_eq(len(lp.token_logprobs or []), len(lp.tokens), "token_logprobs vs tokens")
        for i, top in enumerate(lp.top_logprobs or []):
            expect(1 <= len(top) <= 3, f"top_logprobs[{i}] has {len(top)} entries for logprobs=2")

    @runner.test("logit_bias_forces_and_bans")
    def _():
        forced = tokenize({"prompt": " hello"})[-1]
        r = oa.completions.create(model=model(), prompt=RAW_PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100})
        expect_eq(r.choices[0].text, detok([forced] * 3), f"text with logit_bias {{{forced}: +100}}")
        first = oa.completions.create(model=model(), prompt=RAW_PROMPT, max_tokens=1, temperature=0).choices[0].text
        ids = tokenize({"prompt": first})
        if len(ids) != 1:
            raise Skip(f"greedy first token {first!r} does not re-tokenize to one id")
        banned = oa.completions.create(model=model(), prompt=RAW_PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(ids[0]): -100}).choices[0].text
        expect(banned != first, f"logit_bias {{{ids[0]}: -100}} did not ban the greedy token {first!r}")

    # -------------------------------------------------------------------------------------------
    # Tool calls and reasoning (tool_tests.py)

    reasoning_server = add_tool_tests(runner, oa, an, model, args)

    # -------------------------------------------------------------------------------------------
    # Constrained decoding (grammar_tests.py)

    add_grammar_tests(runner, oa, an, model, args)

    # -------------------------------------------------------------------------------------------
    # Concurrency

    def concurrent_request(i: int, stream: bool) -> tuple[str, str, int]:
        if i % 2 == 0:
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": CONCURRENT_CHAT[(i // 2) % 8]}]
            if stream:
                s = chat_stream(messages=msgs, max_tokens=CONCURRENT_MAX, temperature=0)
                return s["text"].get(0, ""), s["finish"].get(0), s["usage"].completion_tokens
            r = oa.chat.completions.create(model=model(), messages=msgs, max_tokens=CONCURRENT_MAX, temperature=0)
            return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
        prompt = CONCURRENT_RAW[(i // 2) % 8]
        if stream:
            s = completion_stream(prompt=prompt, max_tokens=CONCURRENT_MAX, temperature=0)
            return s["text"].get(0, ""), s["finish"].get(0), s["usage"].completion_tokens
        r = oa.completions.create(model=model(), prompt=prompt, max_tokens=CONCURRENT_MAX, temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    @runner.test(f"concurrent_{args.clients}_clients_equal_alone")
    def _():
        n = args.clients
        alone = [concurrent_request(i, stream=False) for i in range(n)]
        barrier = threading.Barrier(n)

        def worker(i: int):
            barrier.wait(timeout=60)
            return concurrent_request(i, stream=i % 4 >= 2)

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
            together = list(pool.map(worker, range(n)))
        took = time.monotonic() - t0
        bad = [
            f"#{i} ({'chat' if i % 2 == 0 else 'completion'}, {'stream' if i % 4 >= 2 else 'plain'}): "
            f"alone {alone[i]!r} concurrently {together[i]!r}"
            for i in range(n) if alone[i] != together[i]
        ]
        expect(not bad, f"{len(bad)}/{n} answers differ under concurrency:\n      " + "\n      ".join(bad))
        print(f"      {n} concurrent greedy requests in {took:.1f}s", flush=True)

    # -------------------------------------------------------------------------------------------
    # Prefix caching (on by default): a repeated conversation reports its cached prompt tokens

    CACHED_PROMPT = ("Here are the notes of the lighthouse keeper: the wind was from the west, the sea was "
                     "calm in the morning and rough by the evening, three fishing boats came back before "
                     "dark. What did the keeper see?")

    @runner.test("prefix_cache_usage")
    def _():
        first = greedy_chat(CACHED_PROMPT, 4)
        second = greedy_chat(CACHED_PROMPT, 4)
        expect_eq(second.choices[0].message.content, first.choices[0].message.content,
                  "the answer with its prompt cached")
        u = second.usage
        details = u.prompt_tokens_details
        expect(details is not None, f"usage has no prompt_tokens_details: {u}")
        cached = details.cached_tokens
        expect(0 < cached < u.prompt_tokens and cached % 16 == 0,
               f"second identical chat: cached_tokens {cached} of {u.prompt_tokens} (want whole 16-token blocks, "
               "not the last token)")
        msgs = [{"role": "user", "content": CACHED_PROMPT}]
        r = an.messages.create(model=model(), max_tokens=4, messages=msgs, extra_body=GREEDY)
        count = an.messages.count_tokens(model=model(), messages=msgs).input_tokens
        read = r.usage.cache_read_input_tokens or 0
        expect(read > 0, f"Anthropic usage.cache_read_input_tokens {read} for a conversation seen before")
        expect_eq(r.usage.input_tokens + read, count, "input_tokens + cache_read_input_tokens vs count_tokens")
        m, _ = get_metrics(base, auth)
        expect(m.get("metrale_prefix_cache_hit_tokens_total", 0) >= cached + read,
               f"metrale_prefix_cache_hit_tokens_total {m.get('metrale_prefix_cache_hit_tokens_total')}")

    # -------------------------------------------------------------------------------------------
    # Afterwards

    @runner.test("idle_afterwards_no_leaks")
    def _():
        m = wait_idle(base, timeout=15, headers=auth)
        expect(m["metrale_requests_total"] > 0, "metrale_requests_total is 0 after the suite")
        expect(m["metrale_prompt_tokens_total"] > 0, "metrale_prompt_tokens_total is 0 after the suite")
        expect(m["metrale_generation_tokens_total"] > 0, "metrale_generation_tokens_total is 0 after the suite")
        expect(m["metrale_time_to_first_token_seconds_count"] > 0, "metrale_time_to_first_token_seconds_count is 0")
        expect_eq(m["metrale_kv_blocks_free"], m["metrale_kv_blocks_total"], "kv_blocks_free when idle")

    try:
        return runner.run(args.report)
    finally:
        reasoning_server.stop()


if __name__ == "__main__":
    sys.exit(main())
