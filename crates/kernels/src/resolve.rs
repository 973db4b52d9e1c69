// SPDX-License-Identifier: MIT OR Apache-2.0
//! Which embedded target serves a checkpoint, decided once at start-up.
//!
//! 1. A `--kernel-target` pin wins outright (spelled `hw/model/quant`, `model/quant` or `model`,
//!    and it must name exactly one target).
//! 2. Otherwise targets declaring the checkpoint's `model_type` *and* its exact `hidden_size` are
//!    tried before targets declaring the `model_type` for any width (wildcards).
//! 3. Several candidates in the winning tier are narrowed by their `match_names` against the
//!    model's references (HF id, `--model-name`, model directory); if that does not leave exactly
//!    one, it is an error naming the candidates, never a silent pick.
//! 4. No candidate is an error listing every target and what it serves.

use std::fmt::Write;

use crate::registry::TargetKernels;

/// What start-up knows about the checkpoint.
#[derive(Clone, Debug, Default)]
pub struct ModelQuery<'a> {
    /// `model_type` from `config.json` or GGUF metadata.
    pub model_type: &'a str,
    /// `hidden_size`.
    pub hidden_size: u64,
    /// Strings that name the model: HF id, `--model-name`, directory or file name.
    pub references: Vec<String>,
    /// `--kernel-target`, if given.
    pub pinned: Option<&'a str>,
    /// Only consider targets of this hardware class (the one the device passed the preflight for).
    pub hardware: Option<&'a str>,
}

/// Why no single target was chosen.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// Nothing serves the checkpoint.
    #[error(
        "no embedded kernel target serves model_type `{model_type}` with hidden_size {hidden_size}.\navailable targets:\n{available}"
    )]
    NoMatch {
        /// The checkpoint's model_type.
        model_type: String,
        /// The checkpoint's hidden_size.
        hidden_size: u64,
        /// One line per target: its path and what it serves.
        available: String,
    },
    /// Several targets serve it equally well.
    #[error(
        "kernel targets {candidates:?} all serve model_type `{model_type}` with hidden_size {hidden_size} and their match_names do not single one out; pass --kernel-target with one of them"
    )]
    Tie {
        /// The checkpoint's model_type.
        model_type: String,
        /// The checkpoint's hidden_size.
        hidden_size: u64,
        /// The tied target paths.
        candidates: Vec<String>,
    },
    /// The pin names no target, or several.
    #[error(
        "--kernel-target `{pin}` matches {matched} embedded targets; available targets:\n{available}"
    )]
    BadPin {
        /// The pin as given.
        pin: String,
        /// How many targets it matched.
        matched: usize,
        /// One line per target.
        available: String,
    },
}

fn describe(targets: &[&TargetKernels]) -> String {
    if targets.is_empty() {
        return "  (none: this binary was built without kernels, e.g. with METRALE_SKIP_BUILD=1)"
            .into();
    }
    let mut s = String::new();
    for t in targets {
        let width = t
            .serves
            .hidden_size
            .map_or("any hidden_size".to_string(), |h| {
                format!("hidden_size {h}")
            });
        writeln!(
            s,
            "  {}  serves model_type {:?}, {width}",
            t.target.path(),
            t.serves.model_types
        )
        .unwrap();
    }
    s.trim_end().to_string()
}

fn pin_matches(t: &TargetKernels, pin: &str) -> bool {
    let k = &t.target;
    pin == k.path() || pin == format!("{}/{}", k.model, k.quant) || pin == k.model
}

/// Picks the target that serves the checkpoint described by `query` out of `targets`.
pub fn resolve_target<'t>(
    targets: &'t [TargetKernels],
    query: &ModelQuery<'_>,
) -> Result<&'t TargetKernels, ResolveError> {
    let pool: Vec<&TargetKernels> = targets
        .iter()
        .filter(|t| query.hardware.is_none_or(|hw| t.target.hardware == hw))
        .collect();
    if let Some(pin) = query.pinned {
        let hits: Vec<&TargetKernels> = pool
            .iter()
            .copied()
            .filter(|t| pin_matches(t, pin))
            .collect();
        return match hits.as_slice() {
            [one] => Ok(one),
            _ => Err(ResolveError::BadPin {
                pin: pin.to_string(),
                matched: hits.len(),
                available: describe(&pool),
            }),
        };
    }
    let serves_type = |t: &&TargetKernels| t.serves.model_types.contains(&query.model_type);
    let exact: Vec<&TargetKernels> = pool
        .iter()
        .copied()
        .filter(serves_type)
        .filter(|t| t.serves.hidden_size == Some(query.hidden_size))
        .collect();
    let tier = if exact.is_empty() {
        pool.iter()
            .copied()
            .filter(serves_type)
            .filter(|t| t.serves.hidden_size.is_none())
            .collect()
    } else {
        exact
    };
    match tier.as_slice() {
        [] => Err(ResolveError::NoMatch {
            model_type: query.model_type.to_string(),
            hidden_size: query.hidden_size,
            available: describe(&pool),
        }),
        [one] => Ok(one),
        _ => {
            let refs: Vec<String> = query.references.iter().map(|r| r.to_lowercase()).collect();
            let named: Vec<&TargetKernels> = tier
                .iter()
                .copied()
                .filter(|t| {
                    t.serves
                        .match_names
                        .iter()
                        .any(|n| refs.iter().any(|r| r.contains(&n.to_lowercase())))
                })
                .collect();
            match named.as_slice() {
                [one] => Ok(one),
                _ => Err(ResolveError::Tie {
                    model_type: query.model_type.to_string(),
                    hidden_size: query.hidden_size,
                    candidates: tier.iter().map(|t| t.target.path()).collect(),
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{HardwareMemory, ModelMatch, ServingDefaults};
    use metrale_core::KernelTarget;

    const fn target(
        model: &'static str,
        types: &'static [&'static str],
        hidden: Option<u64>,
        names: &'static [&'static str],
    ) -> TargetKernels {
        TargetKernels {
            target: KernelTarget {
                hardware: "hopper",
                arch: "sm_90a",
                model,
                quant: "bf16",
            },
            hardware_name: "test",
            vendor: "nvidia",
            closure_hash: "",
            modules: &[],
            serves: ModelMatch {
                model_types: types,
                hidden_size: hidden,
                match_names: names,
            },
            defaults: ServingDefaults {
                gpu_memory_utilization: None,
                max_batch_size: None,
                max_prefill_tokens: None,
                kv_block_size: None,
            },
            memory: HardwareMemory {
                capacity_gib: None,
                bandwidth_gbs: None,
                l2_mib: None,
                sm_count: None,
            },
            schedule: crate::registry::HardwareSchedule::HOPPER,
            tuning: &[],
        }
    }

    static TARGETS: [TargetKernels; 5] = [
        target("qwen3", &["qwen3"], None, &["qwen3"]),
        target("qwen3-8b", &["qwen3"], Some(4096), &["qwen3-8b"]),
        target("llama", &["llama"], None, &["llama"]),
        target("smollm2", &["llama"], None, &["smollm"]),
        target("mistral", &["mistral", "llama"], Some(4096), &["mistral"]),
    ];

    fn query(model_type: &'static str, hidden_size: u64, refs: &[&str]) -> ModelQuery<'static> {
        ModelQuery {
            model_type,
            hidden_size,
            references: refs.iter().map(|s| s.to_string()).collect(),
            pinned: None,
            hardware: None,
        }
    }

    #[test]
    fn exact_beats_wildcard() {
        assert_eq!(
            resolve_target(&TARGETS, &query("qwen3", 4096, &[]))
                .unwrap()
                .target
                .model,
            "qwen3-8b"
        );
        assert_eq!(
            resolve_target(&TARGETS, &query("qwen3", 1024, &[]))
                .unwrap()
                .target
                .model,
            "qwen3"
        );
    }

    #[test]
    fn tie_broken_by_match_names_or_reported() {
        let q = query("llama", 576, &["HuggingFaceTB/SmolLM2-135M-Instruct"]);
        assert_eq!(
            resolve_target(&TARGETS, &q).unwrap().target.model,
            "smollm2"
        );
        let err = resolve_target(&TARGETS, &query("llama", 576, &["/models/unnamed"])).unwrap_err();
        match &err {
            ResolveError::Tie { candidates, .. } => {
                assert_eq!(candidates, &["hopper/llama/bf16", "hopper/smollm2/bf16"])
            }
            other => panic!("expected a tie, got {other}"),
        }
        assert!(err.to_string().contains("--kernel-target"));
        // An exact declaration is its own tier: the wildcard llama targets do not tie with it.
        assert_eq!(
            resolve_target(&TARGETS, &query("llama", 4096, &[]))
                .unwrap()
                .target
                .model,
            "mistral"
        );
    }

    #[test]
    fn no_match_lists_targets() {
        let err = resolve_target(&TARGETS, &query("gemma3", 2048, &[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("gemma3"), "{err}");
        for t in &TARGETS {
            assert!(err.contains(&t.target.path()), "{err}");
        }
        let empty = resolve_target(&[], &query("llama", 576, &[]))
            .unwrap_err()
            .to_string();
        assert!(empty.contains("METRALE_SKIP_BUILD"), "{empty}");
    }

    #[test]
    fn pin_overrides() {
        let mut q = query("llama", 576, &[]);
        q.pinned = Some("hopper/llama/bf16");
        assert_eq!(resolve_target(&TARGETS, &q).unwrap().target.model, "llama");
        q.pinned = Some("qwen3-8b");
        assert_eq!(
            resolve_target(&TARGETS, &q).unwrap().target.model,
            "qwen3-8b"
        );
        q.pinned = Some("nope");
        assert!(matches!(
            resolve_target(&TARGETS, &q),
            Err(ResolveError::BadPin { matched: 0, .. })
        ));
    }

    #[test]
    fn hardware_filter() {
        let mut q = query("qwen3", 1024, &[]);
        q.hardware = Some("gb10");
        assert!(matches!(
            resolve_target(&TARGETS, &q),
            Err(ResolveError::NoMatch { .. })
        ));
    }
}
