// SPDX-License-Identifier: MIT OR Apache-2.0
//! Prefix caching through `met serve` on the host backend (SmolLM2-135M): greedy answers with the
//! cache equal the answers without it (`--no-prefix-cache`) for a cold prompt, a prompt that
//! shares its start and diverges mid-block, a prompt cached whole, and two requests with one new
//! prefix at once; and the usage fields (OpenAI `prompt_tokens_details.cached_tokens`, Anthropic
//! `cache_read_input_tokens`) and `/metrics` report what was reused.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::smollm2;
use serde_json::{Value, json};

/// Tokens per KV block, the engine's default.
const BLOCK: u64 = 16;

/// A `met serve` child on a free port, killed when dropped.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let model = smollm2();
        let mut child = Command::new(env!("CARGO_BIN_EXE_met"))
            .args(["serve", "--backend", "host", "--model-from-path"])
            .arg(&model)
            .args(["--port", &port.to_string(), "--max-seq-len", "1024"])
            .args(extra)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("met serve starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut log = String::new();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                log.push_str(&line);
                log.push('\n');
                if line.contains("Listening on") {
                    let _ = tx.send(Ok(()));
                }
            }
            let _ = tx.send(Err(log));
        });
        match rx.recv_timeout(Duration::from_secs(300)) {
            Ok(Ok(())) => Server { child, port },
            Ok(Err(log)) => panic!("met serve exited before listening:\n{log}"),
            Err(_) => panic!("met serve did not listen within 300 s"),
        }
    }

    /// One HTTP/1.1 request; the status and the body (JSON when it parses).
    fn request(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
        let body = body.map(Value::to_string).unwrap_or_default();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        let (head, rest) = raw.split_once("\r\n\r\n").expect("an HTTP response");
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        let rest = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(rest)
        } else {
            rest.to_owned()
        };
        (status, rest)
    }

    fn post(&self, path: &str, body: Value) -> Value {
        let (status, text) = self.request("POST", path, Some(&body));
        assert_eq!(status, 200, "{path}: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"))
    }

    /// A greedy completion of `prompt`: its text and usage.
    fn complete(&self, prompt: &str) -> (String, Value) {
        let r = self.post(
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 12, "temperature": 0}),
        );
        (
            r["choices"][0]["text"].as_str().unwrap().to_owned(),
            r["usage"].clone(),
        )
    }

    fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.request("GET", "/metrics", None);
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /metrics"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

fn cached(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// The workload: each entry is `(prompt, sent together with the next)`.
fn prompts() -> Vec<(String, bool)> {
    let base = "The old lighthouse keeper climbed the spiral stairs every evening at dusk, \
                carrying a lantern, a notebook and a flask of tea. From the gallery he could see \
                the fishing boats returning to the harbour, the gulls circling the cliffs and the \
                first stars over the sea. He wrote down the weather, the ships he saw and";
    let diverged = base.replace("fishing boats", "sailing boats"); // a word mid-prompt
    let shared = format!("{base} the colour of the sky. One night a storm came in from the west");
    vec![
        (base.to_owned(), false),                           // cold
        (format!("{base} the names of the boats."), false), // shares all of base's full blocks
        (diverged, false),                                  // diverges mid-block
        (base.to_owned(), false),                           // cached whole
        (format!("{shared}, and the keeper said"), true),   // a new prefix, twice at once
        (format!("{shared}, and the lamp went out"), false),
    ]
}

/// Runs the workload; returns each prompt's text and usage.
fn run(server: &Server) -> Vec<(String, Value)> {
    let list = prompts();
    let mut out = Vec::new();
    let mut i = 0;
    while i < list.len() {
        if list[i].1 {
            let (a, b) = (list[i].0.clone(), list[i + 1].0.clone());
            std::thread::scope(|s| {
                let first = s.spawn(|| server.complete(&a));
                let second = s.spawn(|| server.complete(&b));
                out.push(first.join().unwrap());
                out.push(second.join().unwrap());
            });
            i += 2;
        } else {
            out.push(server.complete(&list[i].0));
            i += 1;
        }
    }
    out
}

#[test]
fn greedy_answers_are_the_same_with_and_without_the_cache_and_usage_reports_hits() {
    let started = Instant::now();
    let off = Server::start(&["--no-prefix-cache"]);
    let want = run(&off);
    for (_, usage) in &want {
        assert_eq!(cached(usage), 0, "the cache is off: {usage}");
    }
    assert_eq!(off.metric("metrale_prefix_cache_hit_tokens_total"), 0.0);
    drop(off);

    let on = Server::start(&[]);
    let got = run(&on);
    for (i, ((text, usage), (want_text, _))) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            text, want_text,
            "prompt {i}: the answer changed with the cache on"
        );
        let (hit, prompt) = (cached(usage), usage["prompt_tokens"].as_u64().unwrap());
        assert_eq!(hit % BLOCK, 0, "prompt {i}: whole blocks only: {usage}");
        assert!(
            hit < prompt,
            "prompt {i}: the last token is always computed: {usage}"
        );
    }
    let hits: Vec<u64> = got.iter().map(|(_, u)| cached(u)).collect();
    let base_len = got[0].1["prompt_tokens"].as_u64().unwrap();
    assert_eq!(hits[0], 0, "cold");
    assert_eq!(
        hits[1],
        base_len / BLOCK * BLOCK,
        "every full block of the first prompt"
    );
    assert!(
        hits[2] > 0 && hits[2] < hits[1],
        "a mid-prompt change shares the blocks before it: {hits:?}"
    );
    assert_eq!(hits[3], (base_len - 1) / BLOCK * BLOCK, "cached whole");
    // Of two requests with one new prefix sent together, one computes it and the other waits
    // for it: between them they hit the shared blocks once.
    let shared = hits[4].max(hits[5]);
    assert!(
        shared > hits[1],
        "the concurrent pair reused its new prefix: {hits:?}"
    );
    let total: f64 = hits.iter().sum::<u64>() as f64;
    assert_eq!(on.metric("metrale_prefix_cache_hit_tokens_total"), total);
    assert!(on.metric("metrale_prefix_cache_queried_tokens_total") > total);

    // The chat routes: the second identical conversation reports its cached prompt tokens.
    let messages = json!([{"role": "user", "content": prompts()[0].0}]);
    let chat = json!({"messages": messages, "max_tokens": 4, "temperature": 0});
    let first = on.post("/v1/chat/completions", chat.clone());
    let second = on.post("/v1/chat/completions", chat);
    assert_eq!(
        first["choices"][0]["message"],
        second["choices"][0]["message"]
    );
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(cached(&second["usage"]), (prompt - 1) / BLOCK * BLOCK);
    let claude =
        json!({"model": "smollm2", "messages": messages, "max_tokens": 4, "temperature": 0});
    let reply = on.post("/v1/messages", claude);
    let usage = &reply["usage"];
    let read = usage["cache_read_input_tokens"].as_u64().unwrap();
    let input = usage["input_tokens"].as_u64().unwrap();
    assert!(read > 0, "the conversation's start is cached: {usage}");
    assert_eq!(read % BLOCK, 0);
    let count = on.post(
        "/v1/messages/count_tokens",
        json!({"model": "smollm2", "messages": messages}),
    );
    assert_eq!(
        input + read,
        count["input_tokens"].as_u64().unwrap(),
        "input_tokens counts the uncached rest: {usage}"
    );
    assert_eq!(
        on.metric("metrale_kv_blocks_used"),
        0.0,
        "idle: nothing referenced"
    );
    assert!(
        on.metric("metrale_kv_blocks_cached") > 0.0,
        "idle: prefixes kept"
    );
    eprintln!("took {:.1}s", started.elapsed().as_secs_f64());
}

/// An FP8 KV cache (`--kv-cache-dtype fp8`) served: `/metrics` names its element type and its
/// bytes a token (half the bf16 cache's: SmolLM2's 30 layers x 3 kv heads x 64 x K and V, one
/// byte each), the prefix cache reuses FP8 blocks as it does bf16 ones, and a greedy answer
/// computed over cached FP8 blocks equals the one computed cold.
#[test]
fn an_fp8_kv_cache_is_reported_and_its_prefixes_reused() {
    let server = Server::start(&["--kv-cache-dtype", "fp8"]);
    let (_, text) = server.request("GET", "/metrics", None);
    assert!(
        text.contains("metrale_kv_cache_info{dtype=\"fp8_e4m3\"} 1"),
        "{text}"
    );
    assert_eq!(
        server.metric("metrale_kv_cache_bytes_per_token"),
        (30 * 3 * 64 * 2) as f64
    );
    assert!(server.metric("metrale_kv_cache_capacity_tokens") > 0.0);
    let prompt = &prompts()[0].0;
    let (cold, usage) = server.complete(prompt);
    assert_eq!(cached(&usage), 0, "cold: {usage}");
    let (warm, usage) = server.complete(prompt);
    assert!(cached(&usage) > 0, "the FP8 blocks were reused: {usage}");
    assert_eq!(warm, cold, "the answer over cached FP8 blocks");
}
