// SPDX-License-Identifier: MIT OR Apache-2.0
//! The generated registry matches the kernel tree it was built from.

use std::collections::BTreeSet;
use std::path::Path;

use metrale_closure::{discover_targets, resolve_target};
use metrale_kernels::{ALL_KERNELS, ModelQuery, TARGETS, names, resolve_target as pick};

fn tree() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels")
}

/// The magic number that opens a CUDA fatbin.
const FATBIN_MAGIC: u32 = 0xBA55_ED50;

#[test]
fn every_target_of_the_tree_is_embedded_with_its_resolved_modules() {
    if TARGETS.is_empty() {
        eprintln!("built with METRALE_SKIP_BUILD=1: no targets to check");
        return;
    }
    let ids = discover_targets(&tree(), "*", "*", "*").unwrap();
    assert_eq!(
        TARGETS.len(),
        ids.len(),
        "a default build embeds every target of the tree"
    );
    for id in &ids {
        let resolved = resolve_target(&tree(), id).unwrap();
        let embedded = TARGETS
            .iter()
            .find(|t| {
                t.target.hardware == id.hardware
                    && t.target.model == id.model
                    && t.target.quant == id.quant
            })
            .unwrap_or_else(|| panic!("{id} not embedded"));
        let want: Vec<&str> = resolved.sources.iter().map(|s| s.module.as_str()).collect();
        let got: Vec<&str> = embedded.modules.iter().map(|m| m.name).collect();
        assert_eq!(got, want, "{id}");
        assert_eq!(embedded.target.arch, resolved.hardware.hardware.arch);
        for m in embedded.modules {
            assert!(m.image.len() > 16, "{id}/{}: empty image", m.name);
            let magic = u32::from_le_bytes(m.image[..4].try_into().unwrap());
            assert_eq!(magic, FATBIN_MAGIC, "{id}/{}: not a fatbin", m.name);
        }
    }
}

#[test]
fn manifests_reach_the_registry() {
    let Some(qwen3) = TARGETS
        .iter()
        .find(|t| t.target.path() == "hopper/qwen3/bf16")
    else {
        return;
    };
    assert_eq!(qwen3.defaults.kv_block_size, Some(16));
    assert_eq!(qwen3.memory.sm_count, Some(132));
    assert_eq!(qwen3.serves.model_types, &["qwen3", "qwen3_moe"]);
    assert_eq!(qwen3.serves.hidden_size, None);
    assert_eq!(qwen3.vendor, "nvidia");
}

#[test]
fn shared_sources_are_compiled_once() {
    // Targets that compile the same closure with the same flags share the same compile key, and
    // the linker keeps one copy of the image.
    let keys: BTreeSet<&str> = TARGETS
        .iter()
        .flat_map(|t| t.modules.iter().map(|m| m.compile_key))
        .collect();
    let instances: usize = TARGETS.iter().map(|t| t.modules.len()).sum();
    if TARGETS.len() > 1 {
        assert!(
            keys.len() < instances,
            "{} keys for {instances} module instances",
            keys.len()
        );
        let a = TARGETS[0].module("rmsnorm").unwrap();
        let b = TARGETS[1].module("rmsnorm").unwrap();
        assert_eq!(a.compile_key, b.compile_key);
        assert_eq!(a.image.as_ptr(), b.image.as_ptr(), "one embedded copy");
    }
}

#[test]
fn typed_names_cover_every_module_and_the_real_checkpoints_resolve() {
    assert_eq!(names::rmsnorm::MODULE, "rmsnorm");
    assert_eq!(
        names::rmsnorm::ADD_RMSNORM_F32RES.function,
        "add_rmsnorm_f32res"
    );
    let modules: BTreeSet<&str> = ALL_KERNELS.iter().map(|k| k.module).collect();
    for t in TARGETS {
        for m in t.modules {
            assert!(
                modules.contains(m.name),
                "module {} has no generated names",
                m.name
            );
        }
    }
    if TARGETS.is_empty() {
        return;
    }
    // SmolLM2 (llama, hidden 576) and Qwen3-8B (qwen3, hidden 4096) land on their wildcard leaves.
    let q = |model_type, hidden_size| ModelQuery {
        model_type,
        hidden_size,
        ..Default::default()
    };
    assert_eq!(
        pick(TARGETS, &q("llama", 576)).unwrap().target.path(),
        "hopper/llama/bf16"
    );
    assert_eq!(
        pick(TARGETS, &q("qwen3", 4096)).unwrap().target.path(),
        "hopper/qwen3/bf16"
    );
    // The MoE families land on their dense family's leaf (Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B).
    assert_eq!(
        pick(TARGETS, &q("qwen2_moe", 2048)).unwrap().target.path(),
        "hopper/qwen2/bf16"
    );
    assert_eq!(
        pick(TARGETS, &q("qwen3_moe", 2048)).unwrap().target.path(),
        "hopper/qwen3/bf16"
    );
    // Mistral, Granite (dense and MoE) and Mixtral take Llama's leaf.
    for model_type in [
        "mistral",
        "granite",
        "granitemoe",
        "smollm3",
        "phi3",
        "mixtral",
    ] {
        assert_eq!(
            pick(TARGETS, &q(model_type, 4096)).unwrap().target.path(),
            "hopper/llama/bf16"
        );
    }
    // OLMoE, GLM-4.5 and MiniMax-M2 have leaves of their own.
    assert_eq!(
        pick(TARGETS, &q("olmoe", 2048)).unwrap().target.path(),
        "hopper/olmoe/bf16"
    );
    assert_eq!(
        pick(TARGETS, &q("glm4_moe", 4096)).unwrap().target.path(),
        "hopper/glm4_moe/bf16"
    );
    let granite = pick(TARGETS, &q("granitemoehybrid", 4096)).unwrap();
    assert_eq!(granite.target.path(), "hopper/granitemoehybrid/bf16");
    assert!(granite.module("mamba2").is_some() && granite.module("moe").is_some());
    assert_eq!(
        pick(TARGETS, &q("minimax_m2", 3072)).unwrap().target.path(),
        "hopper/minimax_m2/bf16"
    );
    // So do the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5).
    for model_type in ["qwen3_next", "qwen3_5_moe"] {
        assert_eq!(
            pick(TARGETS, &q(model_type, 2048)).unwrap().target.path(),
            "hopper/qwen3_next/bf16"
        );
    }
    assert_eq!(
        pick(TARGETS, &q("nemotron_h", 4096)).unwrap().target.path(),
        "hopper/nemotron_h/bf16"
    );
    // Nemotron-3-Nano (hidden 2688) too, and its leaf holds what its layers launch: Mamba-2, the
    // squared ReLU, and the experts' module with its squared-ReLU entries.
    let nano = pick(TARGETS, &q("nemotron_h", 2688)).unwrap();
    assert_eq!(nano.target.path(), "hopper/nemotron_h/bf16");
    for module in ["mamba2", "activation", "moe", "gemm", "gemv"] {
        assert!(nano.module(module).is_some(), "nemotron_h lacks {module}");
    }
    for k in [
        names::moe::MOE_ROUTE,
        names::moe::MOE_GEMV_RELU2,
        names::moe::MOE_GROUPED_GEMV_RELU2,
        names::moe::MOE_GROUPED_MMA_RELU2,
        names::moe::MOE_GEMM_RELU2,
        names::moe::MOE_GEMV_DOWN,
        names::moe::MOE_COMBINE,
        names::activation::RELU2_BF16,
    ] {
        assert!(ALL_KERNELS.contains(&k), "{k}");
        assert!(nano.module(k.module).is_some(), "{k}");
    }
    assert!(pick(TARGETS, &q("mamba", 768)).is_err());
}
