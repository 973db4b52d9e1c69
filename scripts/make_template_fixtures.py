#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Renders the chat-template golden fixtures with transformers' own code.

    python3 -m venv .venv/tools && .venv/tools/bin/pip install transformers jinja2 gguf
    scripts/fetch-test-data.sh
    .venv/tools/bin/python scripts/make_template_fixtures.py

Writes crates/tokenizer/tests/fixtures/chat_templates.json: the conversations, the tools, every
template (where its source lives in the test data, and the special tokens it is rendered with) and,
for each (template, conversation, options) case, the string transformers rendered or the error it
raised. crates/tokenizer/tests/chat_templates.rs renders the same cases and compares byte for byte.

Templates that come with a Hugging Face tokenizer directory are rendered with that tokenizer's
`apply_chat_template(..., tokenize=False)`, so its special tokens are the ones transformers passes.
The GGUF template (no tokenizer directory) goes through the function `apply_chat_template` calls,
`render_jinja_template`, after the same message normalization, with the special tokens the GGUF
names. No torch is needed. Templates that print today's date unconditionally are left out (their
output changes daily); the Llama-3.x ones get `date_string`, as callers of them do.
"""

import json
import os
import platform
import sys
from pathlib import Path

import gguf
import jinja2
import transformers
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("METRALE_TEST_DATA", ROOT / ".cache" / "test-data"))
OUT = ROOT / "crates" / "tokenizer" / "tests" / "fixtures" / "chat_templates.json"
LLAMA_CPP_TEMPLATES = "llama.cpp/models/templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city — in °C or °F.",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": 'City and country, e.g. "Paris, France"'},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current local time in an IANA time zone <tz>.",
            "parameters": {
                "type": "object",
                "properties": {
                    "timezone": {"type": "string"},
                    "format_24h": {"type": "boolean", "default": True},
                    "precision_s": {"type": "number", "minimum": 0.5},
                },
                "required": ["timezone"],
            },
        },
    },
]

# name -> (messages, whether the case passes TOOLS)
CONVERSATIONS = {
    "single_user": ([{"role": "user", "content": "What is the capital of France?"}], False),
    "multi_turn": (
        [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name a prime number."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "Another one, with a reason ✨ — en 日本語 aussi."},
        ],
        False,
    ),
    "tools_offered": ([{"role": "user", "content": "What's the weather in Paris and the time in Tokyo?"}], True),
    "tool_call_and_result": (
        [
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": "What's the weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call12345",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call12345",
                "name": "get_weather",
                "content": '{"temperature": 21, "condition": "sunny"}',
            },
        ],
        True,
    ),
    # As OpenAI clients send it: `content: null` next to tool calls, and arguments as a JSON string.
    # transformers drops the null key, which some templates then fail on.
    "tool_call_null_content": (
        [
            {"role": "user", "content": "Time in Tokyo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call67890",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": '{"timezone": "Asia/Tokyo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call67890", "name": "get_time", "content": "09:41"},
        ],
        True,
    ),
    "reasoning_history": (
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "2+2 = 4.", "reasoning_content": "Add two and two.\nThat is four."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n3+3 = 6."},
            {"role": "user", "content": "Thanks!"},
        ],
        False,
    ),
}

LLAMA_DATE = {"date_string": "26 Jul 2024"}

# id -> where the source is, which tokenizer renders it (or which special tokens), extra kwargs,
# and whether it takes enable_thinking.
TEMPLATES = {
    "qwen3-tokenizer_config": dict(file="qwen3-tokenizer/tokenizer_config.json", key="chat_template", tokenizer="qwen3-tokenizer", thinking=True),
    "Qwen-Qwen3-0.6B": dict(file=f"{LLAMA_CPP_TEMPLATES}/Qwen-Qwen3-0.6B.jinja", tokenizer="qwen3-tokenizer", thinking=True),
    "Qwen-Qwen2.5-7B-Instruct": dict(file=f"{LLAMA_CPP_TEMPLATES}/Qwen-Qwen2.5-7B-Instruct.jinja", tokenizer="qwen3-tokenizer"),
    "Qwen-QwQ-32B": dict(file=f"{LLAMA_CPP_TEMPLATES}/Qwen-QwQ-32B.jinja", tokenizer="qwen3-tokenizer"),
    "Qwen3-Coder": dict(file=f"{LLAMA_CPP_TEMPLATES}/Qwen3-Coder.jinja", tokenizer="qwen3-tokenizer"),
    "DeepSeek-R1-Distill-Qwen-32B": dict(file=f"{LLAMA_CPP_TEMPLATES}/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", tokenizer="qwen3-tokenizer"),
    "Llama-3.1-8B-Instruct": dict(file=f"{LLAMA_CPP_TEMPLATES}/meta-llama-Llama-3.1-8B-Instruct.jinja", tokenizer="llama3-tokenizer", extra=LLAMA_DATE),
    "Llama-3.2-3B-Instruct": dict(file=f"{LLAMA_CPP_TEMPLATES}/meta-llama-Llama-3.2-3B-Instruct.jinja", tokenizer="llama3-tokenizer", extra=LLAMA_DATE),
    "Llama-3.3-70B-Instruct": dict(file=f"{LLAMA_CPP_TEMPLATES}/meta-llama-Llama-3.3-70B-Instruct.jinja", tokenizer="llama3-tokenizer", extra=LLAMA_DATE),
    "Hermes-3-Llama-3.1-8B-tool_use": dict(file=f"{LLAMA_CPP_TEMPLATES}/NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", tokenizer="llama3-tokenizer"),
    "smollm2-gguf": dict(file="smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", key="tokenizer.chat_template"),
    "SmolLM3-3B": dict(file=f"{LLAMA_CPP_TEMPLATES}/HuggingFaceTB-SmolLM3-3B.jinja", special_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}),
    "gemma-2-2b-it": dict(file=f"{LLAMA_CPP_TEMPLATES}/google-gemma-2-2b-it.jinja", special_tokens={"bos_token": "<bos>", "eos_token": "<eos>"}),
    "Phi-3.5-mini-instruct": dict(file=f"{LLAMA_CPP_TEMPLATES}/microsoft-Phi-3.5-mini-instruct.jinja", special_tokens={"bos_token": "<s>", "eos_token": "<|endoftext|>"}),
    "Mistral-Nemo-Instruct-2407": dict(file=f"{LLAMA_CPP_TEMPLATES}/mistralai-Mistral-Nemo-Instruct-2407.jinja", special_tokens={"bos_token": "<s>", "eos_token": "</s>"}),
}

GGUF_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def gguf_field(reader, key):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def load_source(spec):
    path = DATA / spec["file"]
    if path.suffix == ".gguf":
        reader = gguf.GGUFReader(path)
        tokens = gguf_field(reader, "tokenizer.ggml.tokens")
        special = {name: tokens[gguf_field(reader, key)] for name, key in GGUF_SPECIAL_IDS.items() if gguf_field(reader, key) is not None}
        return gguf_field(reader, spec["key"]), special
    if "key" in spec:
        return json.loads(path.read_text(encoding="utf-8"))[spec["key"]], None
    return path.read_text(encoding="utf-8"), None


def main():
    if not (DATA / "llama.cpp").is_dir():
        sys.exit(f"no test data at {DATA}: run scripts/fetch-test-data.sh first")
    tokenizers = {}
    templates, cases = {}, []
    for template_id, spec in TEMPLATES.items():
        source, special = load_source(spec)
        tokenizer = None
        if "tokenizer" in spec:
            name = spec["tokenizer"]
            tokenizer = tokenizers.setdefault(name, AutoTokenizer.from_pretrained(str(DATA / name)))
            special = dict(tokenizer.special_tokens_map)
        elif special is None:
            special = spec["special_tokens"]
        entry = {"file": spec["file"], "special_tokens": special}
        if "key" in spec:
            entry["key"] = spec["key"]
        if "tokenizer" in spec:
            entry["rendered_with"] = f"AutoTokenizer.from_pretrained('{spec['tokenizer']}').apply_chat_template"
        else:
            entry["rendered_with"] = "render_jinja_template"
        templates[template_id] = entry

        for conversation, (messages, with_tools) in CONVERSATIONS.items():
            for add_generation_prompt in (False, True):
                for enable_thinking in (None, True, False) if spec.get("thinking") else (None,):
                    kwargs = dict(spec.get("extra", {}))
                    if enable_thinking is not None:
                        kwargs["enable_thinking"] = enable_thinking
                    tools = TOOLS if with_tools else None
                    case = {
                        "template": template_id,
                        "conversation": conversation,
                        "add_generation_prompt": add_generation_prompt,
                        "tools": with_tools,
                        "enable_thinking": enable_thinking,
                        "extra": spec.get("extra", {}),
                    }
                    try:
                        if tokenizer is not None:
                            text = tokenizer.apply_chat_template(
                                messages,
                                tools=tools,
                                add_generation_prompt=add_generation_prompt,
                                tokenize=False,
                                chat_template=source,
                                **kwargs,
                            )
                        else:
                            rendered, _ = render_jinja_template(
                                conversations=[_normalize_chat_messages(messages)],
                                tools=tools,
                                chat_template=source,
                                add_generation_prompt=add_generation_prompt,
                                **special,
                                **kwargs,
                            )
                            text = rendered[0]
                        case["expected"] = text
                    except Exception as e:  # noqa: BLE001 - the failure is the expected result
                        # `raise_exception` raises jinja2's TemplateError itself; UndefinedError and
                        # Python errors (iterating None, ...) are other types.
                        case["expected_error"] = {"type": type(e).__name__, "message": str(e)}
                    cases.append(case)

    fixture = {
        "generated_by": "scripts/make_template_fixtures.py",
        "command": ".venv/tools/bin/python scripts/make_template_fixtures.py",
        "transformers_version": transformers.__version__,
        "jinja2_version": jinja2.__version__,
        "python_version": platform.python_version(),
        "tools": TOOLS,
        "conversations": {name: messages for name, (messages, _) in CONVERSATIONS.items()},
        "templates": templates,
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    errors = sum("expected_error" in c for c in cases)
    print(f"wrote {len(cases)} cases ({errors} expected errors) for {len(templates)} templates to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
