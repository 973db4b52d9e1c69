# SPDX-License-Identifier: MIT OR Apache-2.0
"""Constrained decoding through the official SDKs (part of test_clients.py).

SmolLM2-135M sampled at temperature 1.0 writes JSON only by accident; under a grammar every answer
must parse and follow its schema. So these tests sample many seeds and check every answer:
`response_format` json_schema / json_object, vLLM's `guided_regex` / `guided_choice` /
`guided_grammar` / `structured_outputs`, and `tool_choice` required / named (OpenAI) and
any / tool (Anthropic) on the default `--tool-grammar auto`, which writes calls in the llama3_json
format of SmolLM2's preset. Greedy answers must be the same streamed and not. Schemas are
small (short strings, few items) so that every answer fits a modest max_tokens; answers are
checked with the small validator below (the JSON-schema subset these schemas use).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Any, Callable

from common import expect, expect_eq
from tool_tests import fold_chat_stream

# A person: a string, an integer, an enum and an array, each kept short.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
PERSON_PROMPT = [{"role": "user", "content": "Describe a person as JSON."}]
JSON_MAX = 64  # the longest of 50 sampled answers took 49 tokens (whitespace varies)
# A free-form object (json_object) at temperature 1 has no length bound from its schema: SmolLM2
# once rambled past 64 tokens inside a string value after a change in the engine's rounding
# (2026-11-30), so these requests get room to close the object.
FREE_JSON_MAX = 256
# Sampled answers a request batch checks. 50 took 296 s on the CI machine's 2 cores (host backend),
# against the client's 300 s timeout: 32, and that test's requests get 600 s.
SAMPLES = 32

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 12}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                      "parameters": TIME_PARAMS}},
]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TOOL_PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_MAX = 96  # a call takes 20 to 65 tokens at temperature 1 (the grammar allows whitespace runs)


def schema_problems(value: Any, schema: dict, path: str = "$") -> list[str]:
    """What is wrong with `value` under `schema` (type, enum, const, properties, required,
    additionalProperties, items, min/maxItems, min/maxLength, minimum/maximum); empty when valid."""
    problems: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        problems.append(f"{path}: {value!r} is not {schema['const']!r}")
    kinds = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float),
             "boolean": bool, "null": type(None)}
    kind = schema.get("type")
    if kind is not None:
        ok = isinstance(value, kinds[kind]) and not (kind in ("integer", "number") and isinstance(value, bool))
        if not ok:
            return problems + [f"{path}: {value!r} is not of type {kind}"]
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)):
            problems.append(f"{path}: {value!r} is longer than {schema['maxLength']}")
        if len(value) < schema.get("minLength", 0):
            problems.append(f"{path}: {value!r} is shorter than {schema['minLength']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"{path}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            problems.append(f"{path}: {value} > {schema['maximum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"{path}: {key!r} is missing")
        for key, v in value.items():
            if key in props:
                problems += schema_problems(v, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                problems.append(f"{path}: {key!r} is not allowed")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            problems.append(f"{path}: {len(value)} items, more than {schema['maxItems']}")
        if len(value) < schema.get("minItems", 0):
            problems.append(f"{path}: {len(value)} items, fewer than {schema['minItems']}")
        for i, item in enumerate(value):
            problems += schema_problems(item, schema.get("items", {}), f"{path}[{i}]")
    return problems


def expect_valid_json(text: str | None, schema: dict, what: str) -> Any:
    try:
        value = json.loads(text or "")
    except ValueError as e:
        raise AssertionError(f"{what}: not JSON ({e}): {text!r}") from None
    problems = schema_problems(value, schema)
    expect(not problems, f"{what}: {'; '.join(problems)} in {text!r}")
    return value


def check_calls(calls: list[tuple[str, str]], what: str, only: str | None = None) -> None:
    """Every (name, arguments) names an offered tool (`only`, when given) and its arguments
    follow that tool's schema."""
    expect(calls, f"{what}: no tool call")
    for i, (name, arguments) in enumerate(calls):
        expect(name in TOOL_SCHEMAS, f"{what}: call {i} names {name!r}, not an offered tool")
        if only:
            expect_eq(name, only, f"{what}: call {i}'s function")
        expect_valid_json(arguments, TOOL_SCHEMAS[name], f"{what}: call {i} ({name}) arguments")


def parallel(fn: Callable[[int], Any], n: int) -> list[Any]:
    """`fn(0..n)` at once (the server batches them); results in order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(fn, range(n)))


def add_grammar_tests(runner, oa, an, model: Callable[[], str], args) -> None:
    """Registers the tests."""

    def chat_calls(kw: dict, stream: bool) -> tuple[list[tuple[str, str]], str | None, str | None]:
        """(calls, content, finish_reason) of one chat request, streamed (folded) or not."""
        if stream:
            s = fold_chat_stream(list(oa.chat.completions.create(stream=True, **kw)))
            return [(c["name"], c["arguments"]) for c in s["calls"]], s["content"] or None, s["finish"]
        c = oa.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return calls, c.message.content, c.finish_reason

    # ---------------------------------------------------------------------------------------------
    # response_format

    @runner.test(f"json_schema_{SAMPLES}_samples_at_temperature_1_validate")
    def _():
        def one(seed: int):
            r = oa.with_options(timeout=600.0).chat.completions.create(
                model=model(), messages=PERSON_PROMPT, response_format=PERSON_FORMAT, max_tokens=JSON_MAX,
                temperature=1.0, seed=seed)
            return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

        answers = parallel(one, SAMPLES)
        bad = []
        for seed, (text, finish, _) in enumerate(answers):
            try:
                expect_eq(finish, "stop", "finish_reason")
                expect_valid_json(text, PERSON_SCHEMA, "answer")
            except AssertionError as e:
                bad.append(f"seed {seed}: {e}")
        expect(not bad, f"{len(bad)}/{SAMPLES} answers are not valid:\n      " + "\n      ".join(bad))
        distinct = len({a[0] for a in answers})
        expect(distinct > SAMPLES // 2, f"only {distinct} distinct answers from {SAMPLES} seeds at temperature 1")
        print(f"      {SAMPLES} valid answers, {distinct} distinct, longest {max(a[2] for a in answers)} tokens",
              flush=True)

    @runner.test("json_schema_greedy_stream_equals_non_stream")
    def _():
        kw = dict(model=model(), messages=PERSON_PROMPT, response_format=PERSON_FORMAT, max_tokens=JSON_MAX,
                  temperature=0)
        whole = oa.chat.completions.create(**kw).choices[0]
        expect_eq(whole.finish_reason, "stop", "finish_reason")
        expect_valid_json(whole.message.content, PERSON_SCHEMA, "greedy answer")
        s = fold_chat_stream(list(oa.chat.completions.create(stream=True, **kw)))
        expect_eq(s["content"], whole.message.content, "streamed content")
        expect_eq(s["finish"], whole.finish_reason, "streamed finish_reason")

    @runner.test("sdk_parse_with_a_pydantic_response_format")
    def _():
        from typing import Annotated, Literal

        from pydantic import BaseModel, Field

        class Person(BaseModel):
            name: str = Field(max_length=10)
            age: int = Field(ge=0, le=120)
            color: Literal["red", "green", "blue"]
            tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=2)

        for seed in (1, 2):
            r = oa.chat.completions.parse(model=model(), messages=PERSON_PROMPT, response_format=Person,
                                          max_tokens=JSON_MAX, temperature=1.0, seed=seed)
            m = r.choices[0].message
            expect(isinstance(m.parsed, Person), f"seed {seed}: message.parsed is {m.parsed!r} ({m.content!r})")
            expect_eq(r.choices[0].finish_reason, "stop", f"seed {seed}: finish_reason")

    @runner.test("json_object_n_2_with_penalties_and_bias")
    def _():
        r = oa.chat.completions.create(
            model=model(), messages=[{"role": "user", "content": "Give me a JSON object about Paris."}],
            response_format={"type": "json_object"}, max_tokens=FREE_JSON_MAX, temperature=1.0, seed=7, n=2,
            presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"28": 5})
        expect_eq(len(r.choices), 2, "choices")
        # A free-form object has no length bound, and penalties push sampling away from the
        # repeated tokens that close it: a choice may run to max_tokens (seen on 2026-11-30 after
        # a rounding change moved the sampled path). Such a choice must have used every token and
        # still be an object's beginning; a choice that stops must be a whole valid object.
        for c in r.choices:
            content = c.message.content or ""
            if c.finish_reason == "length":
                expect(content.lstrip().startswith("{"), f"choice {c.index}: not an object's start: {content[:80]!r}")
                continue
            expect_eq(c.finish_reason, "stop", f"choice {c.index}: finish_reason ({content!r})")
            value = expect_valid_json(content, {"type": "object"}, f"choice {c.index}")
            expect(isinstance(value, dict), f"choice {c.index}: not an object")
        expect_eq(r.usage.completion_tokens <= 2 * FREE_JSON_MAX, True, "usage.completion_tokens within max_tokens")

    # ---------------------------------------------------------------------------------------------
    # vLLM's fields, on both routes

    @runner.test("guided_regex_choice_and_lark_grammar")
    def _():
        chat = dict(model=model(), messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=16)
        for seed in range(3):
            r = oa.chat.completions.create(extra_body={"guided_regex": "(yes|no), [a-z]{1,8}\\."},
                                           temperature=1.0, seed=seed, **chat).choices[0]
            expect(re.fullmatch(r"(yes|no), [a-z]{1,8}\.", r.message.content or ""),
                   f"chat guided_regex: {r.message.content!r}")
            expect_eq(r.finish_reason, "stop", "chat guided_regex finish_reason")
            t = oa.completions.create(model=model(), prompt="The sky is", max_tokens=8, temperature=1.0, seed=seed,
                                      extra_body={"guided_choice": [" blue", " green", " on fire"]}).choices[0]
            expect(t.text in (" blue", " green", " on fire"), f"completions guided_choice: {t.text!r}")
            expect_eq(t.finish_reason, "stop", "completions guided_choice finish_reason")
        lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/\n'
        for body in ({"guided_grammar": lark}, {"structured_outputs": {"grammar": lark}}):
            r = oa.chat.completions.create(extra_body=body, temperature=1.0, seed=3, **chat).choices[0]
            expect(re.fullmatch(r"The answer is [0-9]{1,3}\.", r.message.content or ""),
                   f"{list(body)[0]}: {r.message.content!r}")
        t = oa.completions.create(model=model(), prompt="Count: 1, 2,", max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"regex": " [0-9]+"}}).choices[0]
        expect(re.fullmatch(r" [0-9]+", t.text), f"completions structured_outputs.regex: {t.text!r}")
        j = oa.completions.create(model=model(), prompt="A person:", max_tokens=JSON_MAX, temperature=0,
                                  extra_body={"guided_json": PERSON_SCHEMA}).choices[0]
        expect_valid_json(j.text, PERSON_SCHEMA, "completions guided_json")

    # ---------------------------------------------------------------------------------------------
    # tool_choice (--tool-grammar auto)

    @runner.test("tool_choice_required_always_calls")
    def _():
        def one(i: int):
            kw = dict(model=model(), messages=TOOL_PROMPT, tools=TOOLS, tool_choice="required",
                      max_tokens=TOOL_MAX, temperature=1.0, seed=100 + i)
            return chat_calls(kw, stream=i % 2 == 1)

        for i, (calls, content, finish) in enumerate(parallel(one, 6)):
            what = f"seed {100 + i} ({'streamed' if i % 2 else 'whole'})"
            check_calls(calls, what)
            if finish == "length":
                # Parallel calls may go on until max_tokens cuts one (seed 102 makes two calls
                # and starts a third): the reply says so, and what is left is that call's start.
                expect(content is None or content.lstrip().startswith("{"),
                       f"{what}: cut at max_tokens, content {content!r} is not the start of a call")
            else:
                expect_eq(finish, "tool_calls", f"{what}: finish_reason")
                expect_eq(content, None, f"{what}: content next to the calls")

    @runner.test("tool_choice_required_without_parallel_calls_makes_one")
    def _():
        def one(i: int):
            kw = dict(model=model(), messages=TOOL_PROMPT, tools=TOOLS, tool_choice="required",
                      parallel_tool_calls=False, max_tokens=TOOL_MAX, temperature=1.0, seed=150 + i)
            return chat_calls(kw, stream=i % 2 == 1)

        for i, (calls, content, finish) in enumerate(parallel(one, 4)):
            what = f"seed {150 + i} ({'streamed' if i % 2 else 'whole'}), parallel_tool_calls false"
            check_calls(calls, what)
            expect_eq(len(calls), 1, f"{what}: number of calls")
            expect_eq(finish, "tool_calls", f"{what}: finish_reason")

    @runner.test("tool_choice_named_always_calls_that_tool")
    def _():
        named = {"type": "function", "function": {"name": "get_time"}}

        def one(i: int):
            kw = dict(model=model(), messages=TOOL_PROMPT, tools=TOOLS, tool_choice=named,
                      max_tokens=TOOL_MAX, temperature=1.0, seed=200 + i)
            return chat_calls(kw, stream=i % 2 == 1)

        for i, (calls, content, finish) in enumerate(parallel(one, 4)):
            what = f"seed {200 + i} ({'streamed' if i % 2 else 'whole'})"
            check_calls(calls, what, only="get_time")
            expect_eq(len(calls), 1, f"{what}: calls of a named tool")
            expect_eq(finish, "tool_calls", f"{what}: finish_reason")

    @runner.test("tool_choice_greedy_stream_equals_non_stream")
    def _():
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            kw = dict(model=model(), messages=TOOL_PROMPT, tools=TOOLS, tool_choice=choice, max_tokens=TOOL_MAX,
                      temperature=0)
            whole = chat_calls(kw, stream=False)
            check_calls(whole[0], f"greedy {choice}")
            expect_eq(chat_calls(kw, stream=True), whole, f"greedy {choice}: streamed (calls, content, finish)")
        # The SDK's stream helper accumulates the calls itself.
        with oa.chat.completions.stream(**kw) as stream:
            final = stream.get_final_completion().choices[0]
        expect_eq([(c.function.name, c.function.arguments) for c in final.message.tool_calls], whole[0],
                  "stream helper tool calls")

    @runner.test("tool_choice_auto_is_not_constrained")
    def _():
        kw = dict(model=model(), messages=[{"role": "user", "content": "What is the capital of France?"}],
                  tools=TOOLS, max_tokens=12, temperature=0)
        auto = oa.chat.completions.create(tool_choice="auto", **kw).choices[0].message
        none = oa.chat.completions.create(tool_choice="none", **kw).choices[0].message
        expect_eq(auto.tool_calls, None, f"tool_choice auto made a call: {auto}")
        expect_eq(auto.content, none.content, "tool_choice auto vs none (both unconstrained)")

    @runner.test("anthropic_tool_choice_any_and_tool")
    def _():
        kw = dict(model=model(), max_tokens=TOOL_MAX, messages=TOOL_PROMPT, tools=ANTHROPIC_TOOLS)
        for choice, seed in (({"type": "any"}, 300), ({"type": "any"}, 301), ({"type": "tool", "name": "get_time"}, 302)):
            m = an.messages.create(tool_choice=choice, extra_body={"temperature": 1.0, "seed": seed}, **kw)
            what = f"tool_choice {choice} seed {seed}"
            expect_eq(m.stop_reason, "tool_use", f"{what}: stop_reason ({m.content})")
            uses = [b for b in m.content if b.type == "tool_use"]
            check_calls([(u.name, json.dumps(u.input)) for u in uses], what, only=choice.get("name"))
        named = dict(tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0}, **kw)
        m = an.messages.create(**named)
        with an.messages.stream(**named) as stream:
            final = stream.get_final_message()
        strip = lambda blocks: [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in blocks]
        expect_eq(strip(final.content), strip(m.content), "greedy streamed tool_use blocks vs non-streamed")
        expect_eq(final.stop_reason, "tool_use", "streamed stop_reason")
