# SPDX-License-Identifier: MIT OR Apache-2.0
"""Malformed and hostile requests against a running `met serve`: each must get the right status and
error body, the server must stay up, and a normal request must still succeed afterwards.

OpenAI routes must answer {"error": {"message", "type", "param", "code"}}, /v1/messages
{"type": "error", "error": {"type", "message"}}; where a field is at fault the message must name it.
The auth cases need a second server started with `--require-auth --auth-token secret
--max-num-seqs 2` (given with --auth-base-url; skipped without it). See tests/server/README.md.

    python tests/server/bad_inputs.py --base-url http://127.0.0.1:8888 \\
        --auth-base-url http://127.0.0.1:8889 --context-len 2048
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from common import (
    Runner,
    Skip,
    base_parser,
    check_anthropic_error,
    check_openai_error,
    expect,
    expect_eq,
    preflight,
    raw_request,
    server_alive,
    wait_idle,
)

MIB = 1 << 20
DROP = object()  # a field to leave out of the body

Response = Any  # httpx.Response | RawResponse


def chat(**kw: Any) -> dict:
    body: dict = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return _merge(body, kw)


def completion(**kw: Any) -> dict:
    return _merge({"model": "smollm2", "prompt": "Hi", "max_tokens": 2}, kw)


def message(**kw: Any) -> dict:
    return _merge({"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}, kw)


def _merge(body: dict, kw: dict) -> dict:
    for k, v in kw.items():
        if v is DROP:
            body.pop(k, None)
        else:
            body[k] = v
    return body


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


@dataclass
class Case:
    name: str
    method: str
    path: str
    body: Any = None  # bytes are sent as they are; anything else as JSON
    status: tuple[int, ...] = (400,)
    shape: str = "openai"  # openai | anthropic | either | none
    fields: tuple[str, ...] = ()  # the error message must mention one of these
    headers: dict = field(default_factory=dict)
    server: str = "main"  # main | auth
    auth: str | None = "default"  # "default": the suite's bearer token; None: no header; else the header
    raw: str = ""  # "": httpx; "length" / "chunked": raw socket, body sent while the answer is read
    timeout: float = 60.0
    check: Callable[[Response], None] | None = None


def main() -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--auth-base-url", default=os.environ.get("METRALE_AUTH_SERVER_URL"),
                   help="a second server run with --require-auth --auth-token TOKEN --max-num-seqs 2 "
                        "(default: $METRALE_AUTH_SERVER_URL; its cases are skipped without it)")
    p.add_argument("--auth-token", default="secret", help="that server's token (default %(default)s)")
    p.add_argument("--auth-max-num-seqs", type=int, default=2, help="that server's --max-num-seqs (default %(default)s)")
    p.add_argument("--context-len", type=int, default=int(os.environ.get("METRALE_CONTEXT_LEN", "0")),
                   help="the main server's --max-seq-len, checked in the prompt-too-long message (default: "
                        "$METRALE_CONTEXT_LEN; 0: not checked, 12000-word prompts)")
    args = p.parse_args()
    base = args.base_url.rstrip("/")
    auth_base = args.auth_base_url.rstrip("/") if args.auth_base_url else None
    preflight(base, args.wait, token=args.api_key)
    if auth_base:
        preflight(auth_base, args.wait, what="the --require-auth met serve", token=args.auth_token)

    http = httpx.Client(timeout=120.0)
    runner = Runner("bad_inputs", base, args.verbose, args.api_key)
    default_auth = f"Bearer {args.api_key}"

    def send(case: Case) -> Response:
        url = auth_base if case.server == "auth" else base
        if url is None:
            raise Skip("no --auth-base-url")
        headers = dict(case.headers)
        if case.auth == "default":
            headers.setdefault("Authorization", f"Bearer {args.auth_token}" if case.server == "auth" else default_auth)
        elif case.auth is not None:
            headers["Authorization"] = case.auth
        body = case.body
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
            headers.setdefault("Content-Type", "application/json")
        elif body is not None:
            headers.setdefault("Content-Type", "application/json")
        if case.raw:
            chunks = [body[i:i + 65536] for i in range(0, len(body or b""), 65536)]
            if case.raw == "length":
                headers["Content-Length"] = str(len(body or b""))
            r = raw_request(url, case.method, case.path, headers, chunks, chunked=case.raw == "chunked",
                            timeout=case.timeout)
        else:
            r = http.request(case.method, url + case.path, content=body, headers=headers, timeout=case.timeout)
        if not server_alive(url, args.auth_token if case.server == "auth" else args.api_key):
            raise ConnectionError(f"the server at {url} stopped answering GET /health after this request")
        return r

    def run_case(case: Case) -> None:
        r = send(case)
        expect(r.status_code in case.status,
               f"HTTP {r.status_code}, want {' or '.join(map(str, case.status))}: {r.text[:300]!r}")
        expect(r.status_code < 500 or 501 in case.status, f"HTTP {r.status_code}: a server error")
        if r.status_code >= 400:
            shape = case.shape
            if shape == "either":
                try:
                    body = json.loads(r.content)
                except ValueError:
                    body = None
                shape = "anthropic" if isinstance(body, dict) and body.get("type") == "error" else "openai"
            err = None
            if shape == "openai":
                err = check_openai_error(r)
            elif shape == "anthropic":
                err = check_anthropic_error(r)
            if err is not None and case.fields:
                msg = err["message"].lower()
                expect(any(f.lower() in msg for f in case.fields),
                       f"the error message does not name {' or '.join(case.fields)}: {err['message']!r}")
        if case.check:
            case.check(r)

    def add(case: Case) -> None:
        runner.add(case.name, lambda: run_case(case))

    cases: list[Case] = []
    C = "/v1/chat/completions"
    T = "/v1/completions"
    M = "/v1/messages"

    # --- Not JSON, not an object, not UTF-8 -----------------------------------------------------
    cases += [
        Case("broken_json", "POST", C, b'{"model": "m", "messages": ['),
        Case("json_array_not_object", "POST", C, b"[1, 2, 3]"),
        Case("json_string_not_object", "POST", C, b'"hello"'),
        Case("json_null_body", "POST", C, b"null"),
        Case("empty_body", "POST", C, b""),
        Case("nan_literal", "POST", C, b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}'),
        Case("trailing_garbage", "POST", C, json.dumps(chat()).encode() + b" }}}"),
        Case("invalid_utf8_bytes", "POST", C,
             b'{"model": "m", "messages": [{"role": "user", "content": "caf\xc3\x28 \xff\xfe"}], "max_tokens": 2}'),
        Case("lone_surrogate_escape", "POST", C,
             b'{"model": "m", "messages": [{"role": "user", "content": "x\\ud800y"}], "max_tokens": 1}', status=(200, 400)),
        Case("deeply_nested_messages", "POST", C,
             ('{"model": "m", "max_tokens": 1, "messages": ' + nested(100_000) + "}").encode()),
        Case("deeply_nested_unknown_field", "POST", C,
             (json.dumps(chat(max_tokens=1))[:-1] + ', "x_unknown_nested": ' + nested(100_000, '{"a":', "}").replace(
                 '{"a":}', '{"a":1}') + "}").encode(), status=(200, 400)),
        Case("wrong_content_type", "POST", C, json.dumps(chat()).encode(), status=(400, 415),
             headers={"Content-Type": "text/plain"}),
    ]

    # --- Wrong types and values (chat) ------------------------------------------------------------
    def field_case(name: str, fld: str, value: Any, fields: tuple[str, ...] | None = None, status=(400,),
                   path: str = C, make=chat) -> Case:
        return Case(name, "POST", path, make(**{fld: value}), status=status, fields=fields or (fld,))

    cases += [
        field_case("model_is_int", "model", 123),
        field_case("messages_is_string", "messages", "hi"),
        field_case("messages_missing", "messages", DROP),
        field_case("messages_empty", "messages", []),
        field_case("message_not_object", "messages", ["hi"]),
        field_case("unknown_role", "messages", [{"role": "wizard", "content": "Hi"}], ("role", "messages")),
        field_case("message_without_content", "messages", [{"role": "user"}], ("content", "messages")),
        field_case("content_is_int", "messages", [{"role": "user", "content": 42}], ("content", "messages")),
        field_case("content_part_without_text", "messages", [{"role": "user", "content": [{"type": "text"}]}],
                   ("content", "text", "messages")),
        field_case("max_tokens_is_string", "max_tokens", "10"),
        field_case("max_tokens_negative", "max_tokens", -1),
        field_case("max_tokens_zero", "max_tokens", 0),
        field_case("max_tokens_huge", "max_tokens", 10**9),
        field_case("max_tokens_beyond_u64", "max_tokens", 10**30),
        field_case("max_tokens_fractional", "max_tokens", 10.5),
        field_case("max_completion_tokens_negative", "max_completion_tokens", -5),
        field_case("temperature_is_string", "temperature", "hot"),
        field_case("temperature_negative", "temperature", -0.5),
        field_case("temperature_above_2", "temperature", 2.5),
        field_case("top_p_above_1", "top_p", 1.5),
        field_case("top_p_negative", "top_p", -0.1),
        field_case("top_k_is_string", "top_k", "5"),
        field_case("min_p_above_1", "min_p", 1.5),
        field_case("presence_penalty_above_2", "presence_penalty", 3.0),
        field_case("frequency_penalty_below_minus_2", "frequency_penalty", -3.0),
        field_case("repetition_penalty_zero", "repetition_penalty", 0.0),
        field_case("seed_is_string", "seed", "abc"),
        field_case("stream_is_string", "stream", "yes"),
        field_case("stream_options_is_string", "stream_options", "x"),
        field_case("stop_is_int", "stop", 42),
        field_case("stop_list_of_ints", "stop", [1, 2]),
        field_case("stop_50000_strings", "stop", [f"zq{i}x" for i in range(50_000)], status=(200, 400)),
        field_case("stop_one_300k_string", "stop", "z" * 300_000, status=(200, 400)),
        field_case("n_is_string", "n", "two"),
        field_case("n_zero", "n", 0),
        field_case("n_negative", "n", -1),
        field_case("logit_bias_is_list", "logit_bias", [1, 2]),
        field_case("logit_bias_key_not_a_token_id", "logit_bias", {"abc": 1}),
        field_case("logit_bias_token_outside_vocab", "logit_bias", {"999999999": 5}),
        field_case("logit_bias_value_out_of_range", "logit_bias", {"1": 500}),
        field_case("logprobs_is_string", "logprobs", "yes"),
        Case("top_logprobs_above_20", "POST", C, chat(logprobs=True, top_logprobs=21), fields=("top_logprobs",)),
    ]

    # --- Tools and reasoning (chat) -------------------------------------------------------------
    fn = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    cases += [
        field_case("tools_is_object", "tools", {"a": 1}),
        field_case("tool_entry_not_object", "tools", [fn, 3], ("tools[1]",)),
        field_case("tool_without_function", "tools", [{"type": "function"}], ("tools[0].function",)),
        field_case("tool_function_without_name", "tools", [{"type": "function", "function": {}}],
                   ("tools[0].function.name",)),
        field_case("tool_name_is_int", "tools", [{"type": "function", "function": {"name": 7}}],
                   ("tools[0].function.name",)),
        field_case("tool_type_unknown", "tools", [{"type": "code_interpreter"}], ("tools[0].type",)),
        field_case("tool_parameters_not_object", "tools",
                   [{"type": "function", "function": {"name": "f", "parameters": "{}"}}], ("tools[0].function.parameters",)),
        field_case("tools_repeat_a_name", "tools", [fn, fn], ("tools[1].function.name",)),
        Case("tool_choice_names_unknown_function", "POST", C,
             chat(tools=[fn], tool_choice={"type": "function", "function": {"name": "no_such_tool"}}),
             fields=("no_such_tool",)),
        field_case("tool_choice_required_without_tools", "tool_choice", "required"),
        field_case("tool_choice_unknown_string", "tool_choice", "sometimes"),
        field_case("tool_choice_is_int", "tool_choice", 1),
        field_case("assistant_tool_calls_not_array", "messages",
                   [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": "x"}],
                   ("messages[1].tool_calls",)),
        field_case("tool_call_without_name", "messages",
                   [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
                   ("messages[1].tool_calls[0].function.name",)),
        field_case("tool_calls_on_a_user_message", "messages", [{"role": "user", "content": "Hi", "tool_calls": [call]}],
                   ("messages[0].tool_calls",)),
        field_case("tool_call_id_is_int", "messages",
                   [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": 5, "content": "ok"}], ("messages[2].tool_call_id",)),
        field_case("enable_thinking_is_string", "chat_template_kwargs", {"enable_thinking": "yes"}, ("enable_thinking",)),
        field_case("thinking_budget_negative", "thinking_budget", -1),
        field_case("thinking_budget_is_string", "thinking_budget", "lots"),
    ]

    # --- Structured output and grammars (chat, completions) ---------------------------------------
    def param_is(param: str, *reason: str) -> Callable[[Response], None]:
        """The error's `param` is `param`, and its message gives the grammar library's reason."""
        def check(r: Response) -> None:
            err = json.loads(r.content)["error"]
            expect_eq(err.get("param"), param, "error.param")
            for word in reason:
                expect(word in err["message"], f"the message does not give the reason ({word!r}): {err['message']!r}")
        return check

    def grammar_case(name: str, param: str, body: dict, *reason: str, path: str = C, make=chat) -> Case:
        return Case(name, "POST", path, make(**body), fields=(param,), check=param_is(param, *reason))

    def json_schema(schema: Any, **extra: Any) -> dict:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **extra}}}

    rf_schema = "response_format.json_schema.schema"
    cases += [
        grammar_case("response_format_not_object", "response_format", {"response_format": "json"}),
        grammar_case("response_format_type_unknown", "response_format.type", {"response_format": {"type": "yaml"}}),
        grammar_case("response_format_type_missing", "response_format.type", {"response_format": {}}),
        grammar_case("response_format_json_schema_missing", "response_format.json_schema",
                     {"response_format": {"type": "json_schema"}}),
        grammar_case("json_schema_without_schema", rf_schema,
                     {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
        grammar_case("json_schema_schema_is_string", rf_schema, json_schema("{}")),
        grammar_case("json_schema_strict_not_bool", "response_format.json_schema.strict",
                     json_schema({}, strict="yes")),
        grammar_case("json_schema_invalid_type", rf_schema,
                     json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}}), "nonsense"),
        grammar_case("json_schema_dangling_ref", rf_schema, json_schema({"$ref": "#/$defs/missing"}), "missing"),
        grammar_case("json_schema_strict_unsupported_keyword", rf_schema,
                     json_schema({"type": "array", "uniqueItems": True}, strict=True), "uniqueItems"),
        grammar_case("guided_json_unsatisfiable", "guided_json",
                     {"guided_json": {"type": "integer", "minimum": 5, "maximum": 2}}, "minimum"),
        grammar_case("guided_json_not_a_schema", "guided_json", {"guided_json": 5}),
        grammar_case("guided_regex_invalid", "guided_regex", {"guided_regex": "(ab"}, "unclosed group"),
        grammar_case("guided_regex_is_list", "guided_regex", {"guided_regex": ["a"]}),
        grammar_case("guided_grammar_invalid_lark", "guided_grammar", {"guided_grammar": "start: ("}),
        grammar_case("guided_grammar_unknown_rule", "guided_grammar", {"guided_grammar": "start: foo"}, "foo"),
        grammar_case("guided_choice_empty", "guided_choice", {"guided_choice": []}),
        grammar_case("structured_outputs_regex_invalid", "structured_outputs.regex",
                     {"structured_outputs": {"regex": "(ab"}}, "unclosed group"),
        grammar_case("structured_outputs_unknown_key", "structured_outputs.structural_tag",
                     {"structured_outputs": {"structural_tag": {}}}),
        grammar_case("two_grammars_at_once", "guided_regex",
                     {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
        grammar_case("completion_guided_regex_invalid", "guided_regex", {"guided_regex": "[z-a]"}, path=T,
                     make=completion),
        grammar_case("completion_response_format_type_unknown", "response_format.type",
                     {"response_format": {"type": "yaml"}}, path=T, make=completion),
        grammar_case("completion_json_schema_without_schema", rf_schema,
                     {"response_format": {"type": "json_schema", "json_schema": {}}}, path=T, make=completion),
        # --tool-grammar auto: a tool list the grammar cannot express is parsed only, not refused.
        Case("tool_choice_required_with_a_schema_the_grammar_refuses_is_parsed_only", "POST", C,
             chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
                 "type": "object", "properties": {"a": {"type": "nonsense"}}}}}], tool_choice="required"),
             status=(200,)),
    ]

    # --- /v1/completions ------------------------------------------------------------------------
    cases += [
        field_case("completion_prompt_missing", "prompt", DROP, path=T, make=completion),
        field_case("completion_prompt_is_object", "prompt", {"a": 1}, path=T, make=completion),
        field_case("completion_max_tokens_negative", "max_tokens", -3, path=T, make=completion),
        field_case("completion_temperature_is_string", "temperature", "x", path=T, make=completion),
        Case("completion_broken_json", "POST", T, b'{"prompt": "Hi",,}'),
    ]

    # --- Prompt longer than the context -----------------------------------------------------------
    ctx = args.context_len
    words = int(ctx * 1.5) if ctx else 12_000
    long_text = "hello " * words

    def count_for(payload: dict) -> int | None:
        try:
            r = http.post(base + "/tokenize", json=payload, headers={"Authorization": default_auth})
            return int(r.json()["count"]) if r.status_code == 200 else None
        except Exception:  # noqa: BLE001 - the message check then only needs "a larger number"
            return None

    def lengths_check(payload: dict) -> Callable[[Response], None]:
        def check(r: Response) -> None:
            body = json.loads(r.content)
            msg = body["error"]["message"]
            nums = {int(re.sub(r"[,_]", "", n)) for n in re.findall(r"\d[\d,_]*", msg)}
            count = count_for(payload)
            if count is not None:
                expect(count in nums, f"the message does not give the prompt length {count}: {msg!r}")
            else:
                expect(any(n > (ctx or 0) for n in nums), f"the message gives no prompt length: {msg!r}")
            if ctx:
                expect(ctx in nums, f"the message does not give the context length {ctx}: {msg!r}")
            else:
                expect(len(nums) >= 2, f"the message does not give both lengths: {msg!r}")
        return check

    long_msgs = [{"role": "user", "content": long_text}]
    cases += [
        Case("prompt_longer_than_context_chat", "POST", C, chat(messages=long_msgs),
             check=lengths_check({"messages": long_msgs})),
        Case("prompt_longer_than_context_completion", "POST", T, completion(prompt=long_text),
             check=lengths_check({"prompt": long_text})),
        Case("prompt_longer_than_context_messages", "POST", M, message(messages=long_msgs), shape="anthropic",
             check=lengths_check({"messages": long_msgs})),
    ]

    # --- Body size ---------------------------------------------------------------------------------
    big = json.dumps(chat(messages=[{"role": "user", "content": "hello " * (MIB // 6 + 1000)}])).encode()
    assert len(big) > MIB
    under = json.dumps(completion(prompt="hello " * ((MIB - 4096) // 6))).encode()
    assert len(under) < MIB
    cases += [
        Case("body_over_1mib", "POST", C, big, status=(413,), raw="length"),
        Case("body_over_1mib_chunked", "POST", C, big, status=(413,), raw="chunked"),
        Case("messages_body_over_1mib", "POST", M,
             json.dumps(message(messages=[{"role": "user", "content": "hello " * (MIB // 6 + 1000)}])).encode(),
             status=(413,), shape="anthropic", raw="length"),
        # Just under the limit is not 413: it is read, and is a prompt longer than the context.
        Case("body_just_under_1mib_is_not_413", "POST", T, under, status=(400,), raw="length"),
    ]

    # --- Routes the engine does not serve -------------------------------------------------------
    def says_not_supported(r: Response) -> None:
        msg = json.loads(r.content)["error"]["message"].lower()
        expect("not supported" in msg, f"the 501 message does not say 'not supported': {msg!r}")

    def allow_has(method: str) -> Callable[[Response], None]:
        def check(r: Response) -> None:
            allow = r.headers.get("allow", "")
            expect(method in allow.upper(), f"405 without an Allow header naming {method} (RFC 9110): {allow!r}")
        return check

    cases += [
        Case("embeddings_501", "POST", "/v1/embeddings", {"model": "m", "input": "hi"}, status=(501,),
             check=says_not_supported),
        Case("images_generations_501", "POST", "/v1/images/generations", {"prompt": "a cat"}, status=(501,),
             check=says_not_supported),
        Case("audio_speech_501", "POST", "/v1/audio/speech", {"model": "tts-1", "input": "hi", "voice": "alloy"},
             status=(501,), check=says_not_supported),
        Case("unknown_v1_route_404", "GET", "/v1/does-not-exist", status=(404,)),
        Case("unknown_root_route_404", "GET", "/no/such/route", status=(404,), shape="none"),
        Case("get_chat_completions_405", "GET", C, status=(405,), check=allow_has("POST")),
        Case("put_completions_405", "PUT", T, completion(), status=(405,)),
        Case("post_models_405", "POST", "/v1/models", {}, status=(405,), check=allow_has("GET")),
        Case("delete_tokenize_405", "DELETE", "/tokenize", status=(405,), shape="either"),
        Case("get_messages_405", "GET", M, status=(405,), shape="either"),
    ]

    # --- Anthropic /v1/messages ---------------------------------------------------------------------
    def msg_case(name: str, fld: str, value: Any, fields: tuple[str, ...] | None = None, path: str = M) -> Case:
        return Case(name, "POST", path, message(**{fld: value}), shape="anthropic", fields=fields or (fld,))

    cases += [
        msg_case("messages_missing_max_tokens", "max_tokens", DROP),
        msg_case("messages_max_tokens_is_string", "max_tokens", "10"),
        msg_case("messages_max_tokens_zero", "max_tokens", 0),
        msg_case("messages_messages_is_string", "messages", "hi"),
        msg_case("messages_messages_empty", "messages", []),
        msg_case("messages_system_role_inside_messages", "messages", [{"role": "system", "content": "Hi"}],
                 ("role", "messages", "system")),
        msg_case("messages_content_is_int", "messages", [{"role": "user", "content": 42}], ("content", "messages")),
        msg_case("messages_temperature_above_1", "temperature", 1.5),
        msg_case("messages_stop_sequences_is_string", "stop_sequences", "x"),
        msg_case("messages_tool_without_input_schema", "tools", [{"name": "get_weather"}], ("tools[0].input_schema",)),
        msg_case("messages_server_tool_unsupported", "tools", [{"type": "web_search_20250305", "name": "web_search"}],
                 ("tools[0].type",)),
        msg_case("messages_tool_name_missing", "tools", [{"input_schema": {"type": "object"}}], ("tools[0].name",)),
        Case("messages_tool_choice_unknown_tool", "POST", M,
             message(tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
                     tool_choice={"type": "tool", "name": "no_such_tool"}), shape="anthropic", fields=("no_such_tool",)),
        msg_case("messages_tool_choice_any_without_tools", "tool_choice", {"type": "any"}),
        msg_case("messages_tool_choice_bad_type", "tool_choice", {"type": "sometimes"}, ("tool_choice.type",)),
        msg_case("messages_tool_result_without_id", "messages",
                 [{"role": "user", "content": [{"type": "tool_result", "content": "42"}]}], ("tool_use_id",)),
        msg_case("messages_image_block_unsupported", "messages",
                 [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                            "data": "AAAA"}}]}], ("content[0].type",)),
        msg_case("messages_tool_use_input_not_object", "messages",
                 [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}],
                 ("messages[1].content[0].input",)),
        msg_case("messages_thinking_without_budget", "thinking", {"type": "enabled"}, ("budget_tokens",)),
        msg_case("messages_thinking_bad_type", "thinking", {"type": "sometimes"}, ("thinking.type",)),
        Case("messages_broken_json", "POST", M, b'{"model": "m", "max_tokens": 5, "messages": [', shape="anthropic"),
        Case("messages_invalid_utf8", "POST", M,
             b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "\xff\xfe"}]}', shape="anthropic"),
        Case("count_tokens_missing_messages", "POST", "/v1/messages/count_tokens", {"model": "m"}, shape="anthropic",
             fields=("messages",)),
    ]

    # --- /tokenize, /detokenize -------------------------------------------------------------------
    cases += [
        Case("tokenize_prompt_is_int", "POST", "/tokenize", {"prompt": 5}, fields=("prompt",)),
        Case("tokenize_empty_object", "POST", "/tokenize", {}, fields=("prompt", "messages")),
        Case("detokenize_tokens_is_string", "POST", "/detokenize", {"tokens": "abc"}, fields=("tokens",)),
        Case("detokenize_negative_id", "POST", "/detokenize", {"tokens": [-1]}, fields=("tokens",)),
        Case("detokenize_id_outside_vocab", "POST", "/detokenize", {"tokens": [999_999_999]}, fields=("tokens",)),
    ]

    # --- Auth (second server) ---------------------------------------------------------------------
    ok_body = completion(max_tokens=1)
    cases += [
        Case("auth_missing_header_401", "POST", T, ok_body, status=(401,), server="auth", auth=None),
        Case("auth_wrong_token_401", "POST", T, ok_body, status=(401,), server="auth", auth="Bearer not-the-secret"),
        Case("auth_wrong_scheme_401", "POST", T, ok_body, status=(401,), server="auth", auth="Basic c2VjcmV0"),
        # (raw: httpx will not send a header value with trailing whitespace)
        Case("auth_empty_bearer_401", "POST", T, ok_body, status=(401,), server="auth", auth="Bearer ", raw="length"),
        Case("auth_token_with_suffix_401", "POST", T, ok_body, status=(401,), server="auth",
             auth=f"Bearer {args.auth_token}x"),
        Case("auth_wrong_x_api_key_401", "POST", M, message(max_tokens=1), status=(401,), shape="anthropic",
             server="auth", auth=None, headers={"x-api-key": "not-the-secret"}),
        Case("auth_models_missing_header_401", "GET", "/v1/models", status=(401,), server="auth", auth=None),
        Case("auth_messages_missing_header_401", "POST", M, message(max_tokens=1), status=(401,), shape="anthropic",
             server="auth", auth=None),
        Case("auth_correct_token_200", "POST", T, ok_body, status=(200,), server="auth"),
    ]

    for case in cases:
        add(case)

    @runner.test("queue_full_429")
    def _():
        if not auth_base:
            raise Skip("no --auth-base-url")
        n = args.auth_max_num_seqs + 4
        barrier = threading.Barrier(n)
        headers = {"Authorization": f"Bearer {args.auth_token}"}

        def one(i: int) -> httpx.Response:
            barrier.wait(timeout=30)
            return httpx.post(auth_base + T, headers=headers, timeout=300,
                              json=completion(prompt="Once upon a time", max_tokens=24, temperature=0))

        with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
            rs = list(pool.map(one, range(n)))
        statuses = [r.status_code for r in rs]
        expect(set(statuses) <= {200, 429}, f"statuses {statuses}, want only 200 and 429")
        expect(429 in statuses, f"{n} requests at once on a --max-num-seqs {args.auth_max_num_seqs} server: no 429 ({statuses})")
        expect(statuses.count(200) >= 1, f"no request was served: {statuses}")
        for r in rs:
            if r.status_code == 429:
                check_openai_error(r)
        expect(server_alive(auth_base, args.auth_token), "the auth server stopped answering /health")

    # --- Afterwards -----------------------------------------------------------------------------
    @runner.test("normal_request_still_succeeds")
    def _():
        r = http.post(base + C, headers={"Authorization": default_auth},
                      json=chat(messages=[{"role": "user", "content": "Say hi."}], max_tokens=3, temperature=0))
        expect_eq(r.status_code, 200, f"status of a normal chat request ({r.text[:200]})")
        body = r.json()
        expect(body["choices"][0]["finish_reason"] in ("stop", "length"), f"finish_reason: {body}")
        r = http.post(base + M, headers={"Authorization": default_auth}, json=message(max_tokens=2, temperature=0))
        expect_eq(r.status_code, 200, f"status of a normal Anthropic request ({r.text[:200]})")
        if auth_base:
            r = http.post(auth_base + T, headers={"Authorization": f"Bearer {args.auth_token}"}, json=ok_body)
            expect_eq(r.status_code, 200, f"status of a normal request on the auth server ({r.text[:200]})")

    @runner.test("idle_afterwards_no_leaks")
    def _():
        wait_idle(base, timeout=30, headers={"Authorization": default_auth})
        if auth_base:
            wait_idle(auth_base, timeout=30, headers={"Authorization": f"Bearer {args.auth_token}"})

    return runner.run(args.report)


if __name__ == "__main__":
    sys.exit(main())
