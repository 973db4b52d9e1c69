// SPDX-License-Identifier: MIT OR Apache-2.0
//! Scripted model outputs fed as text deltas: the streamed chunks, folded the way a client folds
//! them, must give the non-streamed answer, in both APIs and for every chunking.

use super::*;

/// A scripted output and how it is read.
struct Script {
    name: &'static str,
    format: Option<Format>,
    think: Option<ThinkStart>,
    text: &'static str,
}

const SCRIPTS: &[Script] = &[
    Script {
        name: "reasoning, content and two hermes calls",
        format: Some(Format::Hermes),
        think: Some(ThinkStart::Outside),
        text: "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call>",
    },
    Script {
        name: "template-opened reasoning, then a qwen3_coder call",
        format: Some(Format::Qwen3Coder),
        think: Some(ThinkStart::InsideThink),
        text: "Search first.\n</think>\n\n<tool_call>\n<function=search>\n<parameter=query>\nrust async\n</parameter>\n</function>\n</tool_call>",
    },
    Script {
        name: "plain answer with tools offered",
        format: Some(Format::Hermes),
        think: None,
        text: "The capital of France is Paris.",
    },
    Script {
        name: "an unreadable call stays content",
        format: Some(Format::Hermes),
        think: None,
        text: "Sure: <tool_call>not json</tool_call> done.",
    },
    Script {
        name: "llama3_json call",
        format: Some(Format::Llama3Json),
        think: None,
        text: "{\"name\": \"f\", \"parameters\": {\"x\": 1}}",
    },
    Script {
        name: "mistral calls",
        format: Some(Format::Mistral),
        think: None,
        text: "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b\", \"arguments\": {\"k\": [1, 2]}}]",
    },
    Script {
        name: "reasoning only, multi-byte text",
        format: None,
        think: Some(ThinkStart::Outside),
        text: "<think>hmm, é ü 😀</think>\n\nAnswer: 😀 ok  ",
    },
    Script {
        name: "unterminated reasoning",
        format: Some(Format::Hermes),
        think: Some(ThinkStart::InsideThink),
        text: "still thinking about <tool_call> and more",
    },
    Script {
        name: "pass-through",
        format: None,
        think: None,
        text: "  plain <think> text </tool_call>  ",
    },
];

fn shape(s: &Script) -> ReplyShape {
    ReplyShape {
        tool_parser: s.format,
        think: s.think,
        call_id_prefix: "call_abc_".into(),
    }
}

/// Cuts `text` at char boundaries into pieces of 1 to `max` chars (a seeded LCG picks sizes).
fn chunks(text: &str, max: usize, seed: u64) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let (mut at, mut state) = (0, seed);
    while at < chars.len() {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let n = 1 + (state >> 33) as usize % max;
        let end = (at + n).min(chars.len());
        out.push(chars[at..end].iter().collect());
        at = end;
    }
    out
}

/// Every chunking the tests try: whole, char by char, and random cuts.
fn chunkings(text: &str) -> Vec<Vec<String>> {
    let mut all = vec![vec![text.to_owned()], chunks(text, 1, 0)];
    for seed in 1..=24 {
        all.push(chunks(text, 1 + seed as usize % 9, seed));
    }
    all
}

/// Folds streamed `choices[]` entries the way OpenAI's SDK accumulates them: content and
/// reasoning concatenated, tool calls by index (id, type and name from their first delta,
/// arguments concatenated). Returns (content, reasoning, tool_calls, finish_reason).
fn fold_openai(entries: &[Value]) -> (String, String, Vec<Value>, Value) {
    let (mut content, mut reasoning, mut calls, mut finish) = (
        String::new(),
        String::new(),
        Vec::<Value>::new(),
        Value::Null,
    );
    for e in entries {
        assert!(finish.is_null(), "an entry after the finish_reason: {e}");
        let d = &e["delta"];
        if let Some(c) = d["content"].as_str() {
            content.push_str(c);
        }
        if let Some(r) = d["reasoning_content"].as_str() {
            reasoning.push_str(r);
        }
        for tc in d["tool_calls"].as_array().into_iter().flatten() {
            let index = tc["index"].as_u64().unwrap() as usize;
            if index == calls.len() {
                assert!(
                    tc["id"].is_string()
                        && tc["type"] == "function"
                        && tc["function"]["name"].is_string(),
                    "a call's first delta carries id, type and name: {tc}"
                );
                calls.push(json!({"id": tc["id"], "type": "function",
                    "function": {"name": tc["function"]["name"], "arguments": ""}}));
            } else {
                assert!(index < calls.len(), "call index {index} skips ahead: {tc}");
                assert!(
                    tc.get("id").is_none(),
                    "only the first delta carries the id: {tc}"
                );
            }
            let args = tc["function"]["arguments"].as_str().unwrap_or_default();
            let call = &mut calls[index]["function"]["arguments"];
            *call = format!("{}{args}", call.as_str().unwrap()).into();
        }
        finish = e["finish_reason"].clone();
    }
    (content, reasoning, calls, finish)
}

/// Streams `pieces` through one choice; returns its entries.
fn stream_openai(s: &Script, pieces: &[String]) -> Vec<Value> {
    let mut choice = ChatChoiceStream::new(0, &shape(s));
    let mut entries = Vec::new();
    for p in pieces {
        entries.extend(choice.delta(p, Value::Null));
    }
    entries.extend(choice.done("stop".into()));
    entries
}

#[test]
fn openai_stream_folds_to_the_non_streamed_message() {
    for s in SCRIPTS {
        let whole = Reply::whole(&shape(s), s.text);
        let message = whole.openai_message();
        let want_finish = if whole.tool_calls.is_empty() {
            "stop"
        } else {
            "tool_calls"
        };
        for pieces in chunkings(s.text) {
            let entries = stream_openai(s, &pieces);
            for e in &entries {
                assert_eq!(e["index"], 0, "{}", s.name);
            }
            let (content, reasoning, calls, finish) = fold_openai(&entries);
            assert_eq!(
                content,
                message["content"].as_str().unwrap_or_default(),
                "{}: content, chunks {pieces:?}",
                s.name
            );
            assert_eq!(
                reasoning,
                message["reasoning_content"].as_str().unwrap_or_default(),
                "{}: reasoning, chunks {pieces:?}",
                s.name
            );
            assert_eq!(
                Value::from(calls.clone()),
                message.get("tool_calls").cloned().unwrap_or(json!([])),
                "{}: tool calls, chunks {pieces:?}",
                s.name
            );
            assert_eq!(finish, want_finish, "{}: finish_reason", s.name);
            if !calls.is_empty() {
                assert!(
                    content.trim().is_empty() == message["content"].is_null(),
                    "{}: content null exactly when the calls leave none",
                    s.name
                );
            }
        }
    }
}

#[test]
fn the_whole_messages_are_what_the_scripts_say() {
    let m = |i: usize| Reply::whole(&shape(&SCRIPTS[i]), SCRIPTS[i].text).openai_message();
    assert_eq!(
        m(0),
        json!({"role": "assistant", "content": "Let me check.", "reasoning_content": "The user wants the weather.",
            "tool_calls": [
                {"id": "call_abc_0", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "call_abc_1", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\":\"CET\"}"}}]})
    );
    assert_eq!(
        m(1),
        json!({"role": "assistant", "content": null, "reasoning_content": "Search first.",
            "tool_calls": [{"id": "call_abc_0", "type": "function", "function": {"name": "search", "arguments": "{\"query\":\"rust async\"}"}}]})
    );
    assert_eq!(
        m(2),
        json!({"role": "assistant", "content": "The capital of France is Paris."})
    );
    assert_eq!(
        m(3)["content"],
        "Sure: <tool_call>not json</tool_call> done."
    );
    assert_eq!(
        m(7),
        json!({"role": "assistant", "content": "", "reasoning_content": "still thinking about <tool_call> and more"})
    );
    assert_eq!(
        m(8),
        json!({"role": "assistant", "content": SCRIPTS[8].text})
    );
}

#[test]
fn tool_call_chunks_have_openai_shape() {
    let s = &SCRIPTS[0];
    let entries = stream_openai(s, &[s.text.to_owned()]);
    let deltas: Vec<&Value> = entries.iter().map(|e| &e["delta"]).collect();
    assert_eq!(
        deltas,
        [
            &json!({"reasoning_content": "The user wants the weather."}),
            &json!({"content": "Let me check."}),
            &json!({"tool_calls": [{"index": 0, "id": "call_abc_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}),
            &json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":\"Paris\"}"}}]}),
            &json!({"tool_calls": [{"index": 1, "id": "call_abc_1", "type": "function", "function": {"name": "get_time", "arguments": ""}}]}),
            &json!({"tool_calls": [{"index": 1, "function": {"arguments": "{\"tz\":\"CET\"}"}}]}),
            &json!({}),
        ]
    );
    assert_eq!(entries.last().unwrap()["finish_reason"], "tool_calls");
    for e in &entries[..entries.len() - 1] {
        assert_eq!(e["finish_reason"], Value::Null);
    }
}

#[test]
fn plain_text_passes_through_delta_by_delta() {
    let s = &SCRIPTS[8];
    let pieces = chunks(s.text, 3, 5);
    let mut choice = ChatChoiceStream::new(2, &shape(s));
    for p in &pieces {
        let entries = choice.delta(p, Value::Null);
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0]["delta"], json!({"content": p}));
        assert_eq!(entries[0]["index"], 2);
    }
    let done = choice.done("length".into());
    assert_eq!(done.len(), 1);
    assert_eq!(done[0]["finish_reason"], "length");
}

#[test]
fn logprobs_of_held_back_text_are_not_lost() {
    let mut choice = ChatChoiceStream::new(0, &shape(&SCRIPTS[0]));
    let lp = json!({"content": [{"token": "<", "logprob": -0.1}]});
    let entries = choice.delta("<", lp.clone());
    assert_eq!(
        entries.len(),
        1,
        "`<` may begin a marker: held, but its logprobs go out"
    );
    assert_eq!(entries[0]["delta"], json!({"content": ""}));
    assert_eq!(entries[0]["logprobs"], lp);
    assert!(
        choice
            .delta("x", Value::Null)
            .iter()
            .all(|e| e["logprobs"].is_null())
    );
}

/// Checks the block steps are well formed: indices count up from 0, each block starts once,
/// gets deltas only while open, and stops once; every block is stopped at the end.
fn check_ops(ops: &[BlockOp]) {
    let mut open: Option<usize> = None;
    let mut next = 0;
    for op in ops {
        match op {
            BlockOp::Start { index, .. } => {
                assert_eq!((open, *index), (None, next), "{ops:?}");
                open = Some(*index);
                next += 1;
            }
            BlockOp::Delta { index, .. } => assert_eq!(open, Some(*index), "{ops:?}"),
            BlockOp::Stop { index } => {
                assert_eq!(open, Some(*index), "{ops:?}");
                open = None;
            }
        }
    }
    assert_eq!(open, None, "{ops:?}");
    assert!(next > 0, "an answer has at least one block");
}

fn anthropic_ops(s: &Script, pieces: &[String]) -> (Vec<BlockOp>, bool) {
    let mut reply = ReplyStream::new(&shape(s));
    let mut blocks = BlockWriter::default();
    let mut ops = Vec::new();
    for p in pieces {
        ops.extend(blocks.apply(reply.push(p)));
    }
    ops.extend(blocks.apply(reply.finish()));
    ops.extend(blocks.finish());
    (ops, reply.made_calls())
}

#[test]
fn anthropic_stream_folds_to_the_non_streamed_content() {
    for s in SCRIPTS {
        let (whole, whole_calls) = anthropic_ops(s, &[s.text.to_owned()]);
        check_ops(&whole);
        let content = fold_blocks(&whole);
        let reply = Reply::whole(&shape(s), s.text);
        assert_eq!(whole_calls, !reply.tool_calls.is_empty(), "{}", s.name);
        // The blocks carry the same reply as the OpenAI message.
        let text: String = content.iter().filter_map(|b| b["text"].as_str()).collect();
        let thinking: String = content
            .iter()
            .filter_map(|b| b["thinking"].as_str())
            .collect();
        assert_eq!(
            (text.as_str(), thinking.as_str()),
            (reply.content.as_str(), reply.reasoning.as_str()),
            "{}",
            s.name
        );
        let uses: Vec<(Value, Value, Value)> = content
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .map(|b| (b["id"].clone(), b["name"].clone(), b["input"].clone()))
            .collect();
        let want: Vec<(Value, Value, Value)> = reply
            .tool_calls
            .iter()
            .map(|c| {
                (
                    c.id.clone().into(),
                    c.name.clone().into(),
                    serde_json::from_str(&c.arguments).unwrap(),
                )
            })
            .collect();
        assert_eq!(uses, want, "{}", s.name);
        for pieces in chunkings(s.text) {
            let (ops, calls) = anthropic_ops(s, &pieces);
            check_ops(&ops);
            assert_eq!(calls, whole_calls, "{}", s.name);
            assert_eq!(fold_blocks(&ops), content, "{}: chunks {pieces:?}", s.name);
        }
    }
}

#[test]
fn anthropic_blocks_have_the_messages_shape() {
    let s = &SCRIPTS[0];
    let (ops, _) = anthropic_ops(s, &[s.text.to_owned()]);
    assert_eq!(
        fold_blocks(&ops),
        vec![
            json!({"type": "thinking", "thinking": "The user wants the weather.", "signature": ""}),
            json!({"type": "text", "text": "Let me check."}),
            json!({"type": "tool_use", "id": "call_abc_0", "name": "get_weather", "input": {"city": "Paris"}}),
            json!({"type": "tool_use", "id": "call_abc_1", "name": "get_time", "input": {"tz": "CET"}}),
        ]
    );
    assert_eq!(
        ops[6..9],
        [
            BlockOp::Start {
                index: 2,
                block: json!({"type": "tool_use", "id": "call_abc_0", "name": "get_weather", "input": {}})
            },
            BlockOp::Delta {
                index: 2,
                delta: json!({"type": "input_json_delta", "partial_json": "{\"city\":\"Paris\"}"})
            },
            BlockOp::Stop { index: 2 },
        ]
    );
    let empty = Script {
        name: "empty",
        format: None,
        think: None,
        text: "",
    };
    let (ops, _) = anthropic_ops(&empty, &[]);
    assert_eq!(fold_blocks(&ops), vec![json!({"type": "text", "text": ""})]);
}

#[test]
fn call_ids_are_unique_per_response() {
    assert_eq!(
        call_id_prefix("call", "chatcmpl-65f0a1000001", 0, 1),
        "call_65f0a1000001_"
    );
    assert_eq!(
        call_id_prefix("call", "chatcmpl-65f0a1000001", 1, 2),
        "call_65f0a1000001_1_"
    );
    assert_eq!(
        call_id_prefix("toolu", "msg_65f0a100000002", 0, 1),
        "toolu_65f0a100000002_"
    );
    assert_ne!(
        call_id_prefix("call", "chatcmpl-a", 0, 2),
        call_id_prefix("call", "chatcmpl-a", 1, 2)
    );
}

#[test]
fn the_template_opened_block_is_detected() {
    assert_eq!(
        think_start("<|im_start|>assistant\n<think>\n"),
        ThinkStart::InsideThink
    );
    assert_eq!(think_start("<|im_start|>assistant\n"), ThinkStart::Outside);
    assert_eq!(
        think_start("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ThinkStart::Outside
    );
}
