// SPDX-License-Identifier: MIT OR Apache-2.0
//! Element-wise arithmetic.

use metrale_core::{DevicePtr, LaunchConfig};

use super::blocks_for;
use crate::host::{self, HostError, HostMemory, Kernel, kernel_args};
use crate::names;

kernel_args!(
    /// `out = bf16(a + b)`; `out` may alias `a` or `b`.
    Add => names::elementwise::ADD_BF16 {
        /// bf16 `[n]`.
        out: DevicePtr,
        /// bf16 `[n]`.
        a: DevicePtr,
        /// bf16 `[n]`.
        b: DevicePtr,
        /// Elements.
        n: u32,
    }
);

impl Kernel for Add {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(blocks_for(u64::from(self.n), 256), 256)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let n = self.n as usize;
        let a = host::load_bf16(mem, self.a, n)?;
        let b = host::load_bf16(mem, self.b, n)?;
        let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        host::store_bf16(mem, self.out, &sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    #[test]
    fn adds_in_place() {
        let mut m = FlatMemory::new();
        let a = m.put(&bf16s(&[1.0, 2.0, 3.0]));
        let b = m.put(&bf16s(&[0.5, -2.0, 256.0]));
        Add { out: a, a, b, n: 3 }.reference(&mut m).unwrap();
        // 259 is not representable in bf16 (8 mantissa bits): it rounds to 260.
        assert_eq!(f32s(&m.get(a, 3)), vec![1.5, 0.0, 260.0]);
    }
}
