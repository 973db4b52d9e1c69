// SPDX-License-Identifier: MIT OR Apache-2.0
//! The engine-side hook without a model: SmolLM2's real vocabulary, random logits, the sampler's
//! masked draw and the grammar state, as the engine thread runs them.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use metrale_model_weights::GgufFile;
use metrale_sampling::rng::Xoshiro256StarStar;
use metrale_sampling::{Sampler, SamplingParams};
use metrale_tokenizer::Tokenizer;
use serde_json::{Value, json};

use super::*;

/// SmolLM2's tokenizer (pinned test data, scripts/fetch-test-data.sh) and an engine over it.
fn smollm2() -> &'static (Tokenizer, Arc<GrammarEngine>) {
    static V: OnceLock<(Tokenizer, Arc<GrammarEngine>)> = OnceLock::new();
    V.get_or_init(|| {
        let dir = std::env::var_os("METRALE_TEST_DATA")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/test-data")
            });
        let path = dir.join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
        let gguf = GgufFile::open(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; run scripts/fetch-test-data.sh", path.display()));
        let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
        let engine = GrammarEngine::new(&tokenizer, tokenizer.vocab_size()).unwrap();
        (tokenizer, Arc::new(engine))
    })
}

fn constraint(spec: GrammarSpec, think: Option<ThinkStart>, think_open: Option<u32>) -> Constraint {
    let (_, engine) = smollm2();
    Constraint {
        engine: engine.clone(),
        grammar: engine.compile(&spec).unwrap(),
        think,
        think_open,
    }
}

fn one_token(text: &str) -> u32 {
    let ids = smollm2().0.encode(text, false).unwrap();
    assert_eq!(ids.len(), 1, "{text:?} is {ids:?}");
    ids[0]
}

fn is_set(allowed: &[u32], id: u32) -> bool {
    allowed[id as usize / 32] & (1 << (id % 32)) != 0
}

/// Runs one sequence the way the engine does: random logits, the masked draw, advance, until the
/// grammar is complete or EOS is drawn; returns the text.
fn generate(state: &mut GrammarState, seed: u64, params: SamplingParams, max: usize) -> String {
    let (tokenizer, engine) = smollm2();
    let mut rng = Xoshiro256StarStar::seed_from_u64(seed);
    let mut sampler = Sampler::new(
        SamplingParams {
            seed: Some(seed),
            ..params
        },
        &[],
    );
    let mut ids = Vec::new();
    for _ in 0..max {
        let mut logits: Vec<f32> = (0..engine.vocab_size())
            .map(|_| (rng.next_f64() as f32) * 8.0)
            .collect();
        let allowed = state.allowed().unwrap().expect("no <think> here");
        let token = sampler.sample_allowed(&mut logits, allowed);
        state.advance(token).unwrap();
        if engine.eos_token_ids().contains(&token) {
            break;
        }
        ids.push(token);
        if state.is_finished() {
            break;
        }
    }
    assert!(
        state.is_finished(),
        "not finished after {max} tokens: {:?}",
        tokenizer.decode(&ids, false)
    );
    tokenizer.decode(&ids, false).unwrap()
}

#[test]
fn random_logits_under_a_schema_give_valid_json() {
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}
        },
        "required": ["name", "age", "color", "tags"],
        "additionalProperties": false
    });
    let c = constraint(
        GrammarSpec::JsonSchema {
            schema,
            strict: true,
        },
        None,
        None,
    );
    for seed in 0..8 {
        let params = if seed % 2 == 0 {
            SamplingParams::default()
        } else {
            SamplingParams {
                temperature: 0.7,
                top_k: Some(20),
                top_p: 0.9,
                logit_bias: vec![(one_token("{"), -100.0)],
                repetition_penalty: 1.3,
                ..SamplingParams::default()
            }
        };
        let text = generate(&mut c.start().unwrap(), seed, params, 400);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(
            v["name"].as_str().is_some_and(|s| s.chars().count() <= 6),
            "{text}"
        );
        assert!(v["age"].as_u64().is_some_and(|a| a <= 120), "{text}");
        assert!(
            ["red", "green", "blue"].contains(&v["color"].as_str().unwrap_or("")),
            "{text}"
        );
        let tags = v["tags"].as_array().unwrap();
        assert!(
            tags.len() <= 2
                && tags
                    .iter()
                    .all(|t| t.as_str().is_some_and(|s| s.chars().count() <= 4))
        );
        assert_eq!(v.as_object().unwrap().len(), 4, "{text}");
    }
}

#[test]
fn each_start_walks_on_its_own() {
    let c = constraint(GrammarSpec::Regex("(yes|no)".into()), None, None);
    let (yes, no, maybe) = (one_token("yes"), one_token("no"), one_token("maybe"));
    let mut a = c.start().unwrap();
    let mut b = c.start().unwrap();
    let allowed = a.allowed().unwrap().unwrap().to_vec();
    assert!(is_set(&allowed, yes) && is_set(&allowed, no) && !is_set(&allowed, maybe));
    a.advance(yes).unwrap();
    assert!(a.is_finished());
    assert!(
        !b.is_finished(),
        "a second choice is not moved by the first"
    );
    assert!(
        b.advance(maybe).is_err(),
        "a token outside the mask is refused"
    );
    b.advance(no).unwrap();
    assert!(b.is_finished());
}

#[test]
fn the_grammar_waits_for_an_open_think_block_to_close() {
    let c = constraint(
        GrammarSpec::Regex("(yes|no)".into()),
        Some(ThinkStart::InsideThink),
        None,
    );
    let mut s = c.start().unwrap();
    assert!(
        s.allowed().unwrap().is_none(),
        "inside the block: unconstrained"
    );
    s.advance(one_token("maybe")).unwrap();
    s.observe("maybe </th");
    assert!(
        s.allowed().unwrap().is_none(),
        "a partial close tag is not a close"
    );
    assert!(!s.is_finished());
    s.observe("ink>");
    let allowed = s.allowed().unwrap().expect("constrained after </think>");
    assert!(is_set(allowed, one_token("yes")) && !is_set(allowed, one_token("maybe")));
    s.advance(one_token("no")).unwrap();
    assert!(s.is_finished());
}

#[test]
fn a_reasoning_model_may_open_a_block_as_its_first_token() {
    // SmolLM2 has no one-token `<think>`; any id the grammar refuses stands in for it.
    let think = one_token("Hello");
    let c = constraint(
        GrammarSpec::Regex("(yes|no)".into()),
        Some(ThinkStart::Outside),
        Some(think),
    );
    let mut s = c.start().unwrap();
    assert!(
        is_set(s.allowed().unwrap().unwrap(), think),
        "allowed first"
    );
    s.advance(think).unwrap();
    s.observe("<think>");
    assert!(
        s.allowed().unwrap().is_none(),
        "inside the block the model opened"
    );
    s.observe("hmm</think>\n\n");
    let allowed = s.allowed().unwrap().unwrap();
    assert!(
        !is_set(allowed, think),
        "only before the grammar's first token"
    );
    assert!(is_set(allowed, one_token("yes")));

    // Once the grammar's first token is out, `<think>` is an ordinary token it refuses.
    let mut s = c.start().unwrap();
    s.allowed().unwrap();
    s.advance(one_token("y")).unwrap();
    assert!(!is_set(s.allowed().unwrap().unwrap(), think));
    // Without the reasoning parser (`think: None`) it is never offered.
    let c = constraint(GrammarSpec::Regex("(yes|no)".into()), None, Some(think));
    assert!(!is_set(
        c.start().unwrap().allowed().unwrap().unwrap(),
        think
    ));
}

#[test]
fn required_tool_calls_in_the_models_wire_parse_back() {
    let tools = [ToolSpec {
        name: "get_weather".into(),
        parameters: json!({"type": "object", "properties": {"location": {"type": "string", "maxLength": 10}},
                           "required": ["location"], "additionalProperties": false}),
    }];
    let spec = GrammarSpec::tool_calls(
        wire_of(Format::Llama3Json),
        &tools,
        ToolChoiceMode::Named("get_weather".into()),
    )
    .unwrap();
    let c = constraint(spec, None, None);
    for seed in 0..4 {
        let text = generate(
            &mut c.start().unwrap(),
            seed,
            SamplingParams::default(),
            300,
        );
        let parsed = metrale_toolcall::parse_whole(Format::Llama3Json, &text);
        assert_eq!(parsed.tool_calls.len(), 1, "{text}");
        assert_eq!(parsed.content, "", "{text}");
        assert_eq!(parsed.tool_calls[0].name, "get_weather", "{text}");
        let args: Value = serde_json::from_str(&parsed.tool_calls[0].arguments).unwrap();
        assert!(
            args["location"]
                .as_str()
                .is_some_and(|l| l.chars().count() <= 10),
            "{text}"
        );
    }
}

#[test]
fn every_parser_format_has_its_wire() {
    for format in Format::ALL {
        assert_eq!(ToolWire::from_str(format.name()).unwrap(), wire_of(format));
    }
}

#[test]
fn only_a_demanded_call_picks_the_tool_grammar() {
    let tools = |choice| Tools {
        defs: vec![json!({"type": "function", "function": {"name": "f"}})],
        choice,
        single_call: false,
    };
    assert_eq!(
        demanded(&tools(ToolChoice::Required)),
        Some(ToolChoiceMode::Required)
    );
    let single = Tools {
        single_call: true,
        ..tools(ToolChoice::Required)
    };
    assert_eq!(demanded(&single), Some(ToolChoiceMode::RequiredOne));
    assert_eq!(
        demanded(&tools(ToolChoice::Named("f".into()))),
        Some(ToolChoiceMode::Named("f".into()))
    );
    assert_eq!(demanded(&tools(ToolChoice::Auto)), None);
    assert_eq!(demanded(&tools(ToolChoice::None)), None);
    let none = Tools {
        defs: vec![],
        choice: ToolChoice::Required,
        single_call: false,
    };
    assert_eq!(demanded(&none), None);
}
