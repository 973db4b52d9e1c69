// SPDX-License-Identifier: MIT OR Apache-2.0
//! Activations: SwiGLU, and the squared ReLU of Nemotron-H's MLP.

use metrale_core::{DevicePtr, LaunchConfig};

use super::blocks_for;
use super::fp8_gemm::{block_warps_launch, quantize_rows};
use crate::host::{self, HostError, HostMemory, Kernel, kernel_args};
use crate::names;

kernel_args!(
    /// `out[t, i] = bf16(silu(gate[t, i]) * up[t, i])` in f32, gate and up halves of one row.
    SiluMul => names::activation::SILU_MUL_BF16 {
        /// bf16 `[tokens, inter]`.
        out: DevicePtr,
        /// bf16 `[tokens, 2 * inter]`, gate half first.
        gate_up: DevicePtr,
        /// Tokens.
        tokens: u32,
        /// Intermediate width.
        inter: u32,
    }
);

kernel_args!(
    /// [`SiluMul`] with its output as the FP8 library product's activation rows: each
    /// `bf16(silu(gate[t, i]) * up[t, i])` as there, then those bf16 rows quantized as
    /// [`Fp8QuantizeRows`](super::Fp8QuantizeRows) quantizes them (e4m3 with a scale per row and
    /// 128 columns, [`fp8_row_scale`](super::fp8_row_scale)'s layout over `tokens` rounded up to
    /// 16, the rows past `tokens` zero with scale 1): the two launches' bits in one.
    SiluMulFp8Rows => names::activation::SILU_MUL_FP8_ROWS {
        /// e4m3 `[round_up(tokens, 16), inter]`.
        q: DevicePtr,
        /// f32, [`fp8_row_scale`](super::fp8_row_scale)'s layout over `round_up(tokens, 16)` rows.
        scales: DevicePtr,
        /// bf16 `[tokens, 2 * inter]`, gate half first.
        gate_up: DevicePtr,
        /// Tokens.
        tokens: u32,
        /// Intermediate width.
        inter: u32,
    }
);

kernel_args!(
    /// `out[i] = bf16(max(x[i], 0)^2)` in f32 (Nemotron-H's MLP; `out` may be `x`).
    Relu2 => names::activation::RELU2_BF16 {
        /// bf16 `[n]`.
        out: DevicePtr,
        /// bf16 `[n]`.
        x: DevicePtr,
        /// Elements.
        n: u32,
    }
);

impl Kernel for Relu2 {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(blocks_for(u64::from(self.n).max(1), 256), 256)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let x = host::load_bf16(mem, self.x, self.n as usize)?;
        let out: Vec<f32> = x.iter().map(|v| v.max(0.0) * v.max(0.0)).collect();
        host::store_bf16(mem, self.out, &out)
    }
}

/// `x * sigmoid(x)`.
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

impl Kernel for SiluMul {
    fn launch_config(&self) -> LaunchConfig {
        // 8 elements per thread when rows split into 16-byte pieces (activation.cu).
        let per_thread = if self.inter.is_multiple_of(8) { 8 } else { 1 };
        let elements = u64::from(self.tokens) * u64::from(self.inter);
        LaunchConfig::linear(blocks_for(elements.div_ceil(per_thread).max(1), 256), 256)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let out = swiglu_rows(mem, self.gate_up, self.tokens, self.inter)?;
        host::store_bf16(mem, self.out, &out)
    }
}

/// `silu(gate) * up` in f32 of each of `tokens` rows of `gate_up` (`[tokens, 2 * inter]`, gate
/// half first), `[tokens, inter]`: [`SiluMul`]'s values before its bf16 store.
fn swiglu_rows(
    mem: &dyn HostMemory,
    gate_up: DevicePtr,
    tokens: u32,
    inter: u32,
) -> Result<Vec<f32>, HostError> {
    let (t, n) = (tokens as usize, inter as usize);
    let gu = host::load_bf16(mem, gate_up, t * 2 * n)?;
    let mut out = Vec::with_capacity(t * n);
    for row in gu.chunks_exact((2 * n).max(1)) {
        let (gate, up) = row.split_at(n);
        out.extend(gate.iter().zip(up).map(|(g, u)| silu(*g) * u));
    }
    Ok(out)
}

impl Kernel for SiluMulFp8Rows {
    fn launch_config(&self) -> LaunchConfig {
        block_warps_launch(self.tokens, self.inter)
    }
    /// [`SiluMul`]'s reference, then [`Fp8QuantizeRows`](super::Fp8QuantizeRows)' of its bf16
    /// rows.
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let y: Vec<f32> = swiglu_rows(mem, self.gate_up, self.tokens, self.inter)?
            .into_iter()
            .map(host::round_bf16)
            .collect();
        let (q, scales) = quantize_rows(&y, self.tokens as usize, self.inter as usize);
        host::store(mem, self.q, &q)?;
        host::store(mem, self.scales, &scales)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::round_bf16;
    use crate::ops::testing::*;

    #[test]
    fn relu_squared_zeroes_negatives() {
        let mut m = FlatMemory::new();
        let x = m.put(&bf16s(&[-2.0, 0.0, 3.0, 0.5]));
        Relu2 { out: x, x, n: 4 }.reference(&mut m).unwrap();
        assert_eq!(f32s(&m.get(x, 4)), vec![0.0, 0.0, 9.0, 0.25]);
    }

    #[test]
    fn silu_times_up() {
        let mut m = FlatMemory::new();
        let gu = m.put(&bf16s(&[0.0, 2.0, 5.0, 3.0]));
        let out = m.put(&bf16s(&[9.0; 2]));
        SiluMul {
            out,
            gate_up: gu,
            tokens: 1,
            inter: 2,
        }
        .reference(&mut m)
        .unwrap();
        let want = vec![0.0, round_bf16(silu(2.0) * 3.0)];
        assert_eq!(f32s(&m.get(out, 2)), want);
    }

    /// The FP8-rows form writes what SiluMul then Fp8QuantizeRows write, bit for bit, at token
    /// counts that are and are not multiples of 16 and above 256 (two row groups), a partial last
    /// 128-column block and an odd width; the rows past `tokens` are zero with scale 1.
    #[test]
    fn the_fp8_rows_form_is_silu_mul_then_fp8_quantize_rows() {
        use crate::ops::{FP8_GEMM_ROW_GROUP, Fp8QuantizeRows, fp8_row_scale};
        for (tokens, inter) in [(5u32, 1024u32), (32, 256), (47, 200), (300, 128), (3, 131)] {
            let n = (tokens * inter) as usize;
            let padded = tokens.next_multiple_of(FP8_GEMM_ROW_GROUP) as usize;
            let kb = inter.div_ceil(128) as usize;
            let mut m = FlatMemory::new();
            let gate_up = m.put(&bf16s(&uniform(31, 2 * n, 4.0)));
            let out = m.put(&bf16s(&vec![0.0; n]));
            let q = m.put(&vec![0x55u8; padded * inter as usize]);
            let scales = m.put(&vec![-1f32; padded * kb]);
            let mut two = m.clone();
            SiluMul {
                out,
                gate_up,
                tokens,
                inter,
            }
            .reference(&mut two)
            .unwrap();
            Fp8QuantizeRows {
                q,
                scales,
                a: out,
                m: tokens,
                k: inter,
            }
            .reference(&mut two)
            .unwrap();
            SiluMulFp8Rows {
                q,
                scales,
                gate_up,
                tokens,
                inter,
            }
            .reference(&mut m)
            .unwrap();
            let shape = format!("tokens={tokens} inter={inter}");
            let codes = m.get::<u8>(q, padded * inter as usize);
            assert_eq!(codes, two.get::<u8>(q, padded * inter as usize), "{shape}");
            let s = m.get::<f32>(scales, padded * kb);
            assert_eq!(s, two.get::<f32>(scales, padded * kb), "{shape}");
            assert!(codes[n..].iter().all(|&c| c == 0), "{shape}: pad rows zero");
            for row in tokens as usize..padded {
                for b in 0..kb {
                    assert_eq!(
                        s[fp8_row_scale(row, b, tokens as usize, kb)],
                        1.0,
                        "{shape}"
                    );
                }
            }
            assert!(codes[..n].iter().any(|&c| c != 0), "{shape}");
        }
    }
}
