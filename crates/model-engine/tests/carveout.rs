// SPDX-License-Identifier: MIT OR Apache-2.0
//! Which launches of a decode step ask for their own shared-memory carveout (`Model::carveout`'s
//! rule), seen on the mock backend, which records every launch and runs none.

use std::sync::Arc;

use half::bf16;
use metrale_cache::BlockTable;
use metrale_config::ModelConfig;
use metrale_gpu_runtime::{GpuBackend, MockBackend, Recorded};
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{GemvNorm, GemvSwigluNorm};
use metrale_model_engine::{Model, ModelOptions, StepInput, Tuning, expected_shape};
use metrale_model_weights::{HostTensor, WeightError, WeightSource};

/// Zeros of every tensor a config implies (the mock computes nothing, so values do not matter).
struct Zeros(ModelConfig);

impl WeightSource for Zeros {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        expected_shape(&self.0, name)
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let shape = self
            .shape(name)
            .expect("the loader asks only for expected tensors");
        let n = shape.iter().product();
        Ok(HostTensor {
            shape,
            data: vec![bf16::ZERO; n],
        })
    }

    fn describe(&self) -> String {
        "zeros".into()
    }
}

/// A small Qwen3: its products are small enough that the qkv and gate|up GEMVs fold the norm (as
/// Qwen3-0.6B's do).
fn qwen3_small() -> ModelConfig {
    metrale_config::from_config_json(
        r#"{"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "num_hidden_layers": 2, "vocab_size": 512, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 256,
            "tie_word_embeddings": false}"#,
    )
    .expect("a valid config")
}

/// The launches of one batch-1 decode step at position 5 (graphs off: every launch recorded as
/// it is queued), as (kernel name, carveout).
fn decode_launches(mock: &Arc<MockBackend>) -> Vec<(String, Option<u8>)> {
    let config = qwen3_small();
    let gpu: Arc<dyn GpuBackend> = mock.clone();
    let options = ModelOptions {
        kv_cache: Default::default(),
        max_tokens_per_step: 16,
        max_seqs: 1,
        max_logit_rows: 1,
        max_seq_len: 64,
        num_blocks: 4,
        block_size: 16,
        state_slots: 0,
    };
    let mut progress = |_: usize, _: usize, _: u64| {};
    let tuning = Tuning::hopper().expect("the kernel tree's tuning");
    let mut model = Model::load(
        config.clone(),
        &Zeros(config),
        gpu,
        options,
        tuning,
        &mut progress,
    )
    .expect("the model loads on the mock");
    model.set_graphs(false);
    let table = BlockTable { blocks: vec![0] };
    mock.clear();
    model
        .forward(&StepInput {
            tokens: &[7],
            positions: &[5],
            token_seq: &[0],
            block_tables: &[&table],
            logit_rows: &[0],
            state_slots: &[],
        })
        .expect("a decode step runs on the mock");
    mock.launches()
        .into_iter()
        .filter_map(|r| match r {
            Recorded::Launch {
                kernel, carveout, ..
            } => Some((kernel.to_string(), carveout)),
            _ => None,
        })
        .collect()
}

#[test]
fn the_qkv_product_and_o_before_a_folded_norm_ask_for_the_most_shared_memory() {
    // The kernel tree's tuning names the rule.
    let mock = Arc::new(MockBackend::new());
    let launches = decode_launches(&mock);
    let carveouts = |name: &str| -> Vec<Option<u8>> {
        launches
            .iter()
            .filter(|(k, _)| k.as_str() == name)
            .map(|&(_, c)| c)
            .collect()
    };
    // Per layer: the normalising qkv GEMV, then (after the attention) the o GEMV, then the
    // normalising gate|up GEMV, then down.
    let qkv = carveouts(&GemvNorm::NAME.to_string());
    assert_eq!(qkv, vec![Some(100); 2], "{launches:?}");
    let gate_up = carveouts(&GemvSwigluNorm::NAME.to_string());
    assert_eq!(gate_up, vec![None; 2], "{launches:?}");
    // o and down run on the plain or staged GEMV entries: o (before the folded gate|up) at 100,
    // down and the LM head at the driver's choice; the rest of the step likewise.
    let with: Vec<&(String, Option<u8>)> = launches.iter().filter(|(_, c)| c.is_some()).collect();
    assert_eq!(with.len(), 4, "two qkv and two o launches: {launches:?}");
    let o_at: Vec<usize> = launches
        .iter()
        .enumerate()
        .filter(|(_, (k, c))| c.is_some() && *k != GemvNorm::NAME.to_string())
        .map(|(i, _)| i)
        .collect();
    for i in o_at {
        // The launch right after an o product is the normalising gate|up GEMV.
        assert_eq!(
            launches[i + 1].0,
            GemvSwigluNorm::NAME.to_string(),
            "{launches:?}"
        );
    }
}
