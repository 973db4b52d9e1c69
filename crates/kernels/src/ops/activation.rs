// SPDX-License-Identifier: MIT OR Apache-2.0
//! Activations: SwiGLU, and the squared ReLU of Nemotron-H's MLP.

use metrale_core::{DevicePtr, LaunchConfig};

use super::blocks_for;
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
        let (t, n) = (self.tokens as usize, self.inter as usize);
        let gu = host::load_bf16(mem, self.gate_up, t * 2 * n)?;
        let mut out = Vec::with_capacity(t * n);
        for row in gu.chunks_exact((2 * n).max(1)) {
            let (gate, up) = row.split_at(n);
            out.extend(gate.iter().zip(up).map(|(g, u)| silu(*g) * u));
        }
        host::store_bf16(mem, self.out, &out)
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
}
