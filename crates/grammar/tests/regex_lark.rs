// SPDX-License-Identifier: MIT OR Apache-2.0
//! Regexes and Lark grammars: random walks end in text the `regex` crate, or a hand-written
//! parser of the same grammar, accepts.

mod common;

use common::{Rng, compile, llama3, qwen3, sample};
use metrale_grammar::GrammarSpec;

const RUNS: u64 = 50;

#[test]
fn regex_samples_match() {
    let rx =
        r"(GET|POST|DELETE) /[a-z]{1,8}(/[a-z0-9_]{1,8}){0,3}(\?q=[^ &]{0,12})? HTTP/1\.[01] (✓|✗)";
    let check = regex::Regex::new(&format!("^(?:{rx})$")).unwrap();
    for v in [qwen3(), llama3()] {
        let g = compile(v, &GrammarSpec::Regex(rx.into()));
        for seed in 0..RUNS {
            let s = sample(v, &g, &mut Rng::new(seed));
            assert!(check.is_match(&s.text), "seed {seed}: {:?}", s.text);
        }
    }
}

/// `key=value` items separated by commas; a value is a number, a quoted word string, or a
/// bracketed list of values.
const ITEMS: &str = r#"
start: item ("," " "? item)*
item: NAME "=" value
value: NUMBER | STRING | list
list: "[" value ("," value)* "]"
NAME: /[a-z][a-z0-9_]{0,7}/
NUMBER: /-?[0-9]{1,5}/
STRING: /"[a-z ]{0,12}"/
"#;

/// A recursive-descent parser of [`ITEMS`], written independently of the Lark text.
struct Items<'a>(&'a [u8]);

impl Items<'_> {
    fn eat(&mut self, c: u8) -> bool {
        let ok = self.0.first() == Some(&c);
        if ok {
            self.0 = &self.0[1..];
        }
        ok
    }

    /// Takes up to `max` bytes satisfying `ok`; at least `min` must be there.
    fn run(&mut self, ok: impl Fn(u8) -> bool, min: usize, max: usize) -> bool {
        let n = self.0.iter().take_while(|&&c| ok(c)).take(max).count();
        self.0 = &self.0[n..];
        n >= min
    }

    fn items(&mut self) -> bool {
        loop {
            let name = self.run(|c| c.is_ascii_lowercase(), 1, 1)
                && self.run(
                    |c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_',
                    0,
                    7,
                );
            if !(name && self.eat(b'=') && self.value()) {
                return false;
            }
            if !self.eat(b',') {
                return self.0.is_empty();
            }
            self.eat(b' ');
        }
    }

    fn value(&mut self) -> bool {
        if self.eat(b'[') {
            loop {
                if !self.value() {
                    return false;
                }
                if !self.eat(b',') {
                    return self.eat(b']');
                }
            }
        }
        if self.eat(b'"') {
            return self.run(|c| c.is_ascii_lowercase() || c == b' ', 0, 12) && self.eat(b'"');
        }
        self.eat(b'-');
        self.run(|c| c.is_ascii_digit(), 1, 5)
    }
}

#[test]
fn lark_samples_parse() {
    assert!(Items(b"a=1, b_2=[\"x y\",-3],c=[[1]]").items());
    assert!(!Items(b"a=1,").items());
    assert!(!Items(b"abcdefghi=1").items());
    let v = qwen3();
    let g = compile(v, &GrammarSpec::Lark(ITEMS.into()));
    for seed in 0..RUNS {
        let s = sample(v, &g, &mut Rng::new(seed));
        assert!(
            Items(s.text.as_bytes()).items(),
            "seed {seed}: {:?}",
            s.text
        );
    }
}

#[test]
fn lark_with_embedded_schema() {
    let lark = r#"
start: "Answer: " answer
answer: %json {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}
"#;
    let v = qwen3();
    let g = compile(v, &GrammarSpec::Lark(lark.into()));
    for seed in 0..RUNS / 5 {
        let s = sample(v, &g, &mut Rng::new(seed));
        let body = s.text.strip_prefix("Answer: ").expect("the fixed prefix");
        let value: serde_json::Value = serde_json::from_str(body).unwrap();
        assert!(value["ok"].is_boolean(), "seed {seed}: {:?}", s.text);
        assert_eq!(value.as_object().unwrap().len(), 1);
    }
}
