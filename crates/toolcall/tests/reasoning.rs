// SPDX-License-Identifier: MIT OR Apache-2.0
//! Reasoning-splitter conformance: whole and every chunking agree, and match the expected split.

mod common;

use metrale_toolcall::{ReasoningEvent, ReasoningSplitter, ThinkStart};

struct Case {
    name: &'static str,
    start: ThinkStart,
    input: &'static str,
    reasoning: &'static str,
    content: &'static str,
}

use ThinkStart::{InsideThink, Outside};

const CASES: &[Case] = &[
    Case {
        name: "block then answer",
        start: Outside,
        input: "<think>\nStep 1. 思考\n</think>\n\nThe answer is 42.",
        reasoning: "Step 1. 思考",
        content: "The answer is 42.",
    },
    Case {
        name: "template opened think",
        start: InsideThink,
        input: "Let me think.\n</think>\n\nAnswer.",
        reasoning: "Let me think.",
        content: "Answer.",
    },
    Case {
        name: "empty block is a no-op",
        start: Outside,
        input: "<think>\n\n</think>\n\nHello",
        reasoning: "",
        content: "Hello",
    },
    Case {
        name: "empty block opened by the template",
        start: InsideThink,
        input: "\n\n</think>\n\nHello",
        reasoning: "",
        content: "Hello",
    },
    Case {
        name: "missing </think>: all reasoning",
        start: InsideThink,
        input: "still thinking about 🦀 <thin",
        reasoning: "still thinking about 🦀 <thin",
        content: "",
    },
    Case {
        name: "missing </think> after <think>",
        start: Outside,
        input: "<think>abc é",
        reasoning: "abc é",
        content: "",
    },
    Case {
        name: "no think at all",
        start: Outside,
        input: "Just content < think > </thinx> <thin",
        reasoning: "",
        content: "Just content < think > </thinx> <thin",
    },
    Case {
        name: "spontaneous think mid-stream",
        start: Outside,
        input: "Answer first. <think>wait, 再想</think> Final.",
        reasoning: "wait, 再想",
        content: "Answer first. Final.",
    },
    Case {
        name: "inner whitespace kept",
        start: InsideThink,
        input: "a\n\nb  </think>c\n\nd\n",
        reasoning: "a\n\nb",
        content: "c\n\nd\n",
    },
];

fn stream(start: ThinkStart, chunks: &[&str]) -> (String, String) {
    let mut s = ReasoningSplitter::new(start);
    let (mut reasoning, mut content) = (String::new(), String::new());
    let events: Vec<_> = chunks.iter().flat_map(|c| s.push(c)).collect();
    for event in events.into_iter().chain(s.finish()) {
        match event {
            ReasoningEvent::Reasoning(r) => {
                assert!(!r.is_empty());
                reasoning.push_str(&r)
            }
            ReasoningEvent::Content(c) => {
                assert!(!c.is_empty());
                content.push_str(&c)
            }
        }
    }
    (reasoning, content)
}

#[test]
fn whole_split_matches_expected() {
    for case in CASES {
        let got = ReasoningSplitter::split_whole(case.start, case.input);
        assert_eq!(
            got,
            (case.reasoning.to_owned(), case.content.to_owned()),
            "{}",
            case.name
        );
    }
}

#[test]
fn streamed_split_matches_whole_for_every_chunking() {
    for case in CASES {
        let whole = ReasoningSplitter::split_whole(case.start, case.input);
        for chunks in common::chunkings(case.input) {
            assert_eq!(
                stream(case.start, &chunks),
                whole,
                "{}: {chunks:?}",
                case.name
            );
        }
    }
}

#[test]
fn partial_markers_are_held_back() {
    let mut s = ReasoningSplitter::new(ThinkStart::Outside);
    assert_eq!(s.push("Hi <th"), vec![ReasoningEvent::Content("Hi".into())]);
    assert_eq!(
        s.push("ink>x</thi"),
        vec![ReasoningEvent::Reasoning("x".into())]
    );
    assert!(s.in_reasoning());
    assert_eq!(s.push("nk>y"), vec![ReasoningEvent::Content(" y".into())]);
    assert_eq!(s.finish(), vec![]);
}

/// Random soups of marker pieces and multi-byte text: whole == streamed, from either start.
#[test]
fn random_soups_stream_like_whole() {
    const PIECES: &[&str] = &[
        "<think>", "</think>", "<th", "</thi", "<", "\n", " ", "a", "é", "🦀",
    ];
    for seed in 0..400u64 {
        let mut rng = common::Rng::new(seed);
        let len = 1 + rng.below(20);
        let text: String = (0..len).map(|_| PIECES[rng.below(PIECES.len())]).collect();
        for start in [Outside, InsideThink] {
            let whole = ReasoningSplitter::split_whole(start, &text);
            for chunks in common::chunkings(&text).into_iter().step_by(5) {
                assert_eq!(stream(start, &chunks), whole, "{text:?} as {chunks:?}");
            }
        }
    }
}
