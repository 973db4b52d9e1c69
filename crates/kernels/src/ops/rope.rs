// SPDX-License-Identifier: MIT OR Apache-2.0
//! Rotary position embedding, rotate-half layout, in place.

use metrale_core::{DevicePtr, LaunchConfig};

use crate::host::{self, HostError, HostMemory, Kernel, kernel_args};
use crate::names;

kernel_args!(
    /// Rotates `heads` heads of every token in place: pairs `(i, i + head_dim/2)` by the angle in
    /// row `positions[t]` of the cos/sin tables, in f32 with one rounding to bf16 per output. A
    /// position outside the tables leaves the token unchanged.
    RopeNeox => names::rope::ROPE_NEOX_BF16 {
        /// bf16 `[tokens, token_stride]`, pointing at the first rotated head.
        x: DevicePtr,
        /// i32 `[tokens]`.
        positions: DevicePtr,
        /// f32 `[max_position, head_dim / 2]`.
        cos: DevicePtr,
        /// f32 `[max_position, head_dim / 2]`.
        sin: DevicePtr,
        /// Tokens.
        tokens: u32,
        /// Heads to rotate per token.
        heads: u32,
        /// Elements per head (even).
        head_dim: u32,
        /// Elements between consecutive tokens' rows.
        token_stride: u32,
        /// Rows of the cos/sin tables.
        max_position: u32,
    }
);

impl Kernel for RopeNeox {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [self.tokens, self.heads, 1],
            block: [64, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (tokens, heads, d) = (
            self.tokens as usize,
            self.heads as usize,
            self.head_dim as usize,
        );
        let half = d / 2;
        let positions = host::load::<i32>(mem, self.positions, tokens)?;
        let table = self.max_position as usize * half;
        let cos = host::load::<f32>(mem, self.cos, table)?;
        let sin = host::load::<f32>(mem, self.sin, table)?;
        for (t, &pos) in positions.iter().enumerate() {
            if pos < 0 || pos as u32 >= self.max_position {
                continue;
            }
            let row = self.x.offset(t * self.token_stride as usize * 2);
            let mut x = host::load_bf16(mem, row, heads * d)?;
            let (c, s) = (
                &cos[pos as usize * half..][..half],
                &sin[pos as usize * half..][..half],
            );
            for head in x.chunks_exact_mut(d) {
                rotate_half(head, c, s);
            }
            host::store_bf16(mem, row, &x)?;
        }
        Ok(())
    }
}

/// The reference rotation of one head in f32 (the caller rounds once when storing): pairs
/// `(i, i + d/2)` turned by the angle whose cosines and sines are `c` and `s` (`d/2` each).
pub(crate) fn rotate_half(head: &mut [f32], c: &[f32], s: &[f32]) {
    let half = head.len() / 2;
    for i in 0..half {
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * c[i] - b * s[i];
        head[i + half] = b * c[i] + a * s[i];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    #[test]
    fn quarter_turn_rotates_pairs() {
        let mut m = FlatMemory::new();
        // One token, stride 6: a 2-element prefix we must not touch, then one head of dim 4.
        let x = m.put(&bf16s(&[7.0, 7.0, 1.0, 2.0, 3.0, 4.0]));
        let pos = m.put(&[1i32]);
        // Position 0: identity; position 1: 90 degrees for pair 0, 0 degrees for pair 1.
        let cos = m.put(&[1.0f32, 1.0, 0.0, 1.0]);
        let sin = m.put(&[0.0f32, 0.0, 1.0, 0.0]);
        let k = RopeNeox {
            x: x.offset(4),
            positions: pos,
            cos,
            sin,
            tokens: 1,
            heads: 1,
            head_dim: 4,
            token_stride: 6,
            max_position: 2,
        };
        k.reference(&mut m).unwrap();
        // Pair (1, 3) turns by 90 degrees: (a, b) -> (-b, a); pair (2, 4) stays.
        assert_eq!(f32s(&m.get(x, 6)), vec![7.0, 7.0, -3.0, 2.0, 1.0, 4.0]);
    }
}
