// SPDX-License-Identifier: MIT OR Apache-2.0
//! RoPE cos/sin tables, computed once at load; scaling variants live here and nowhere else.

use metrale_config::{ModelConfig, RopeScaling};

/// Inverse frequencies of the `rotary_dim / 2` rotation pairs (`head_dim / 2` but for partial
/// rotary, whose frequencies run over the rotated elements only), after any scaling, computed in
/// f32 as the HF reference computes them.
pub fn inverse_frequencies(config: &ModelConfig) -> Vec<f32> {
    let half = config.rotary_dim / 2;
    let dim = config.rotary_dim as f32;
    let base: Vec<f32> = (0..half)
        .map(|i| 1.0 / config.rope_theta.powf((2 * i) as f32 / dim))
        .collect();
    match config.rope_scaling {
        RopeScaling::None | RopeScaling::Linear { .. } => base,
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            truncate,
            ..
        } => {
            // transformers' YaRN: the ramp's ends in f64 (Python floats), the blend in f32 over
            // its `base ** (2i / dim)`, interpolated as 1 / (factor * that).
            let theta = config.rope_theta as f64;
            let correction_dim = |rotations: f32| {
                dim as f64
                    * (original_max_position_embeddings as f64
                        / (rotations as f64 * 2.0 * std::f64::consts::PI))
                        .ln()
                    / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
            if truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0) as f32, high.min(dim as f64 - 1.0) as f32);
            if low == high {
                high += 0.001;
            }
            (0..half)
                .map(|i| {
                    let pos_freq = config.rope_theta.powf((2 * i) as f32 / dim);
                    let (extrapolated, interpolated) = (1.0 / pos_freq, 1.0 / (factor * pos_freq));
                    let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                    let keep = 1.0 - ramp;
                    interpolated * (1.0 - keep) + extrapolated * keep
                })
                .collect()
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            // Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
            // between is interpolated smoothly.
            let original = original_max_position_embeddings as f32;
            let (low_wavelen, high_wavelen) =
                (original / low_freq_factor, original / high_freq_factor);
            base.into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (original / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// `(cos, sin)` tables, f32 `[positions, rotary_dim / 2]`, row `p` for position `p`. The angle is
/// the f32 product of position and frequency, as in the HF reference; the values stay f32 (the
/// kernel rotates in f32 and rounds each output once).
pub fn tables(config: &ModelConfig, positions: usize) -> (Vec<f32>, Vec<f32>) {
    let inv = inverse_frequencies(config);
    let scale = match config.rope_scaling {
        RopeScaling::Linear { factor } => 1.0 / factor,
        _ => 1.0,
    };
    // YaRN scales the rotation's output (cos and sin) by its attention factor.
    let magnitude = match config.rope_scaling {
        RopeScaling::Yarn {
            attention_factor, ..
        } => attention_factor,
        _ => 1.0,
    };
    let mut cos = Vec::with_capacity(positions * inv.len());
    let mut sin = Vec::with_capacity(positions * inv.len());
    for p in 0..positions {
        let pos = p as f32 * scale;
        for f in &inv {
            let angle = pos * f;
            cos.push(angle.cos() * magnitude);
            sin.push(angle.sin() * magnitude);
        }
    }
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_config::ModelFamily;

    fn config(scaling: RopeScaling) -> ModelConfig {
        ModelConfig {
            family: ModelFamily::Llama,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_layers: 1,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            vocab_size: 10,
            max_position_embeddings: 131072,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: scaling,
            tie_word_embeddings: false,
            attention_bias: false,
            qk_norm: metrale_config::QkNorm::None,
            rotary_dim: 128,
            bos_token_id: None,
            eos_token_ids: vec![],
            moe: None,
            hybrid: None,
            multipliers: Default::default(),
            nope_layers: Vec::new(),
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_slows_low_frequencies() {
        let plain = inverse_frequencies(&config(RopeScaling::None));
        let scaled = inverse_frequencies(&config(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }));
        assert_eq!(plain[0], scaled[0], "the highest frequency is kept");
        assert!(
            (scaled[63] - plain[63] / 8.0).abs() < 1e-12,
            "the lowest is divided by the factor"
        );
        assert!(scaled.iter().zip(&plain).all(|(s, p)| s <= p));
    }

    /// Qwen3-8B's documented 128k setting (`rope_scaling: {"rope_type": "yarn", "factor": 4.0,
    /// "original_max_position_embeddings": 32768}`, theta 1e6, head_dim 128) against what
    /// transformers 5.17's `ROPE_INIT_FUNCTIONS["yarn"]` returns for it (float32 on the CPU).
    #[test]
    fn yarn_matches_transformers() {
        let c = ModelConfig {
            rope_theta: 1_000_000.0,
            ..config(RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 32768,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: 0.1 * 4f32.ln() + 1.0,
                truncate: true,
            })
        };
        let inv = inverse_frequencies(&c);
        let want = [
            (0, 1.0f32),
            (10, 0.115_478_2),
            (20, 0.013_335_215),
            (30, 0.001_064_361),
            (40, 4.445_698_5e-5),
            (50, 5.133_812_5e-6),
            (63, 3.102_344_4e-7),
        ];
        for (i, f) in want {
            assert!(
                (inv[i] - f).abs() <= 2e-7 * f,
                "{i}: {} against {f}",
                inv[i]
            );
        }
        // cos and sin carry the attention factor, 1.1386294.
        let (cos, sin) = tables(&c, 2);
        assert!((cos[0] - 1.138_629_4).abs() < 1e-6);
        assert!((sin[64 + 1] - 1.138_629_4 * inv[1].sin()).abs() < 1e-6);
    }

    #[test]
    fn partial_rotary_frequencies_run_over_the_rotated_elements() {
        let full = config(RopeScaling::None);
        let partial = ModelConfig {
            rotary_dim: 64,
            ..full.clone()
        };
        let (a, b) = (inverse_frequencies(&full), inverse_frequencies(&partial));
        assert_eq!((a.len(), b.len()), (64, 32));
        // Pair i of 32 turns as pair 2i of 64: theta^(-2i/64) = theta^(-4i/128).
        for (i, f) in b.iter().enumerate() {
            assert!((f - a[2 * i]).abs() <= 1e-6 * a[2 * i], "{i}");
        }
        assert_eq!(tables(&partial, 3).0.len(), 3 * 32);
    }

    #[test]
    fn tables_start_at_identity() {
        let (cos, sin) = tables(&config(RopeScaling::None), 3);
        assert_eq!(cos.len(), 3 * 64);
        assert!(cos[..64].iter().all(|&c| c == 1.0) && sin[..64].iter().all(|&s| s == 0.0));
        assert_eq!(
            sin[64],
            1f32.sin(),
            "position 1, frequency 1: f32, not rounded"
        );
    }
}
