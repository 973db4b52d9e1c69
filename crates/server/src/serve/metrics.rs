// SPDX-License-Identifier: MIT OR Apache-2.0
//! Prometheus metrics with the book's names, rendered by hand (text exposition format 0.0.4).

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds (seconds) of the TTFT histogram buckets.
const TTFT_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Every series the server exports.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Requests accepted, by outcome when they end.
    pub requests_total: AtomicU64,
    /// Requests in flight.
    pub requests_active: AtomicU64,
    /// Requests refused with 429.
    pub requests_rejected_total: AtomicU64,
    /// Prompt tokens of accepted requests.
    pub prompt_tokens_total: AtomicU64,
    /// Generated tokens.
    pub generation_tokens_total: AtomicU64,
    /// KV blocks in use.
    pub kv_blocks_used: AtomicU64,
    /// KV blocks free.
    pub kv_blocks_free: AtomicU64,
    /// KV blocks in the pool.
    pub kv_blocks_total: AtomicU64,
    /// Tokens the KV pool holds (blocks times block size), fixed at start-up.
    pub kv_cache_capacity_tokens: AtomicU64,
    /// Bytes one cached token takes over every attention layer, K and V (halved by FP8).
    pub kv_cache_bytes_per_token: AtomicU64,
    /// The KV cache's element type (`bf16`, `fp8_e4m3`), set at start-up.
    pub kv_cache_dtype: std::sync::OnceLock<&'static str>,
    /// Sequences waiting for admission.
    pub sequences_waiting: AtomicU64,
    /// Sequences being prefilled or decoded.
    pub sequences_running: AtomicU64,
    /// Sequences preempted by recompute.
    pub preemptions_total: AtomicU64,
    /// KV blocks holding a cached prefix that no request uses (part of the free blocks).
    pub kv_blocks_cached: AtomicU64,
    /// Tokens looked up in the prefix cache (every prefill token of each admission).
    pub prefix_cache_queried_tokens_total: AtomicU64,
    /// Of those, tokens found cached.
    pub prefix_cache_hit_tokens_total: AtomicU64,
    /// Cached KV blocks evicted to make room.
    pub prefix_cache_evicted_blocks_total: AtomicU64,
    /// Recurrent-state slots held by running sequences (hybrid models; 0 otherwise).
    pub state_slots_used: AtomicU64,
    /// Recurrent-state slots in the pool (hybrid models; 0 otherwise).
    pub state_slots_total: AtomicU64,
    /// Recurrent-state snapshot slots holding a prefix's state or being written (hybrid
    /// models with the prefix cache; 0 otherwise).
    pub state_snapshots_used: AtomicU64,
    /// Recurrent-state snapshot slots in the pool (0 without).
    pub state_snapshots_total: AtomicU64,
    /// Of the used snapshot slots, running sequences' tails (their latest block boundary's
    /// state, a snapshot once they end).
    pub state_snapshots_held: AtomicU64,
    /// Snapshots evicted to make room.
    pub state_snapshot_evictions_total: AtomicU64,
    ttft: Mutex<Histogram>,
}

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; TTFT_BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Metrics {
    /// Records one time-to-first-token observation.
    pub fn observe_ttft(&self, seconds: f64) {
        let mut h = self.ttft.lock().unwrap_or_else(|e| e.into_inner());
        for (i, b) in TTFT_BUCKETS.iter().enumerate() {
            if seconds <= *b {
                h.counts[i] += 1;
            }
        }
        h.count += 1;
        h.sum += seconds;
    }

    /// The exposition text.
    pub fn render(&self, model: &str) -> String {
        let mut s = String::new();
        let mut counter = |name: &str, help: &str, kind: &str, v: &AtomicU64| {
            let _ = writeln!(
                s,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        };
        counter(
            "metrale_requests_total",
            "Requests accepted.",
            "counter",
            &self.requests_total,
        );
        counter(
            "metrale_requests_active",
            "Requests in flight.",
            "gauge",
            &self.requests_active,
        );
        counter(
            "metrale_requests_rejected_total",
            "Requests refused because the queue was full.",
            "counter",
            &self.requests_rejected_total,
        );
        counter(
            "metrale_prompt_tokens_total",
            "Prompt tokens of accepted requests.",
            "counter",
            &self.prompt_tokens_total,
        );
        counter(
            "metrale_generation_tokens_total",
            "Generated tokens.",
            "counter",
            &self.generation_tokens_total,
        );
        counter(
            "metrale_kv_blocks_used",
            "KV cache blocks in use.",
            "gauge",
            &self.kv_blocks_used,
        );
        counter(
            "metrale_kv_blocks_free",
            "KV cache blocks free.",
            "gauge",
            &self.kv_blocks_free,
        );
        counter(
            "metrale_kv_blocks_total",
            "KV cache blocks in the pool.",
            "gauge",
            &self.kv_blocks_total,
        );
        counter(
            "metrale_kv_cache_capacity_tokens",
            "Tokens the KV cache pool holds.",
            "gauge",
            &self.kv_cache_capacity_tokens,
        );
        counter(
            "metrale_kv_cache_bytes_per_token",
            "Bytes one cached token takes (every attention layer, K and V).",
            "gauge",
            &self.kv_cache_bytes_per_token,
        );
        let dtype = self.kv_cache_dtype.get().copied().unwrap_or("bf16");
        let _ = writeln!(
            s,
            "# HELP metrale_kv_cache_info The KV cache's element type.\n# TYPE metrale_kv_cache_info gauge\nmetrale_kv_cache_info{{dtype=\"{dtype}\"}} 1"
        );
        let mut counter = |name: &str, help: &str, kind: &str, v: &AtomicU64| {
            let _ = writeln!(
                s,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        };
        counter(
            "metrale_state_slots_used",
            "Recurrent-state slots held by running sequences (hybrid models).",
            "gauge",
            &self.state_slots_used,
        );
        counter(
            "metrale_state_slots_total",
            "Recurrent-state slots in the pool (hybrid models; 0 without recurrent layers).",
            "gauge",
            &self.state_slots_total,
        );
        counter(
            "metrale_state_snapshots_used",
            "Recurrent-state snapshot slots holding a prefix's state (hybrid models' prefix cache).",
            "gauge",
            &self.state_snapshots_used,
        );
        counter(
            "metrale_state_snapshots_total",
            "Recurrent-state snapshot slots in the pool (0 without recurrent layers or prefix cache).",
            "gauge",
            &self.state_snapshots_total,
        );
        counter(
            "metrale_state_snapshots_held",
            "Of the used snapshot slots, running sequences' tails (the state at their latest block boundary, kept when they end).",
            "gauge",
            &self.state_snapshots_held,
        );
        counter(
            "metrale_state_snapshot_evictions_total",
            "Recurrent-state snapshots evicted to make room.",
            "counter",
            &self.state_snapshot_evictions_total,
        );
        counter(
            "metrale_sequences_waiting",
            "Sequences waiting for admission.",
            "gauge",
            &self.sequences_waiting,
        );
        counter(
            "metrale_sequences_running",
            "Sequences being prefilled or decoded.",
            "gauge",
            &self.sequences_running,
        );
        counter(
            "metrale_preemptions_total",
            "Sequences preempted (recomputed later) when KV blocks ran out.",
            "counter",
            &self.preemptions_total,
        );
        counter(
            "metrale_kv_blocks_cached",
            "KV cache blocks free but holding a cached prefix (evicted when needed).",
            "gauge",
            &self.kv_blocks_cached,
        );
        counter(
            "metrale_prefix_cache_queried_tokens_total",
            "Prefill tokens looked up in the prefix cache at admission.",
            "counter",
            &self.prefix_cache_queried_tokens_total,
        );
        counter(
            "metrale_prefix_cache_hit_tokens_total",
            "Prefill tokens found in the prefix cache (their KV not computed again).",
            "counter",
            &self.prefix_cache_hit_tokens_total,
        );
        counter(
            "metrale_prefix_cache_evicted_blocks_total",
            "Cached KV blocks evicted to make room.",
            "counter",
            &self.prefix_cache_evicted_blocks_total,
        );
        let h = self.ttft.lock().unwrap_or_else(|e| e.into_inner());
        let name = "metrale_time_to_first_token_seconds";
        let _ = writeln!(
            s,
            "# HELP {name} Time from arrival to the first generated token.\n# TYPE {name} histogram"
        );
        for (b, c) in TTFT_BUCKETS.iter().zip(h.counts) {
            let _ = writeln!(s, "{name}_bucket{{model=\"{model}\",le=\"{b}\"}} {c}");
        }
        let _ = writeln!(
            s,
            "{name}_bucket{{model=\"{model}\",le=\"+Inf\"}} {}",
            h.count
        );
        let _ = writeln!(s, "{name}_sum{{model=\"{model}\"}} {}", h.sum);
        let _ = writeln!(s, "{name}_count{{model=\"{model}\"}} {}", h.count);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histogram() {
        let m = Metrics::default();
        m.requests_total.fetch_add(3, Ordering::Relaxed);
        m.prefix_cache_hit_tokens_total.store(48, Ordering::Relaxed);
        m.observe_ttft(0.2);
        m.observe_ttft(3.0);
        m.kv_cache_capacity_tokens.store(4096, Ordering::Relaxed);
        m.kv_cache_dtype.set("fp8_e4m3").unwrap();
        let text = m.render("smol");
        assert!(text.contains("metrale_kv_cache_capacity_tokens 4096"));
        assert!(text.contains("metrale_kv_cache_info{dtype=\"fp8_e4m3\"} 1"));
        assert!(text.contains("metrale_requests_total 3"));
        assert!(text.contains("metrale_prefix_cache_hit_tokens_total 48"));
        assert!(text.contains("# TYPE metrale_prefix_cache_queried_tokens_total counter"));
        assert!(
            text.contains(
                "metrale_time_to_first_token_seconds_bucket{model=\"smol\",le=\"0.25\"} 1"
            )
        );
        assert!(
            text.contains("metrale_time_to_first_token_seconds_bucket{model=\"smol\",le=\"5\"} 2")
        );
        assert!(text.contains("metrale_time_to_first_token_seconds_count{model=\"smol\"} 2"));
    }
}
