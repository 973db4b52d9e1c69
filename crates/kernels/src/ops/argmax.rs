// SPDX-License-Identifier: MIT OR Apache-2.0
//! Greedy sampling: the index of each row's largest logit.

use half::bf16;
use metrale_core::{DevicePtr, LaunchConfig};

use crate::host::{self, HostError, HostMemory, Kernel, kernel_args};
use crate::names;

kernel_args!(
    /// `out[r] = argmax(logits[r, :])` over bf16 logits.
    ArgmaxBf16 => names::argmax::ARGMAX_BF16 {
        /// i32 `[rows]`.
        out: DevicePtr,
        /// bf16 `[rows, cols]`.
        logits: DevicePtr,
        /// Rows.
        rows: u32,
        /// Vocabulary size.
        cols: u32,
    }
);

kernel_args!(
    /// `out[r] = argmax(logits[r, :])` over f32 logits.
    ArgmaxF32 => names::argmax::ARGMAX_F32 {
        /// i32 `[rows]`.
        out: DevicePtr,
        /// f32 `[rows, cols]`.
        logits: DevicePtr,
        /// Rows.
        rows: u32,
        /// Vocabulary size.
        cols: u32,
    }
);

/// Index of the largest value; ties go to the lowest index, NaN never wins, all-NaN gives 0.
pub fn argmax(row: &[f32]) -> i32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i as i32)
}

fn rows_argmax(values: &[f32], cols: usize) -> Vec<i32> {
    values.chunks_exact(cols.max(1)).map(argmax).collect()
}

impl Kernel for ArgmaxBf16 {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(self.rows, 1024)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (rows, cols) = (self.rows as usize, self.cols as usize);
        let logits: Vec<f32> = host::load::<bf16>(mem, self.logits, rows * cols)?
            .into_iter()
            .map(f32::from)
            .collect();
        host::store(mem, self.out, &rows_argmax(&logits, cols))
    }
}

impl Kernel for ArgmaxF32 {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(self.rows, 1024)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (rows, cols) = (self.rows as usize, self.cols as usize);
        let logits = host::load::<f32>(mem, self.logits, rows * cols)?;
        host::store(mem, self.out, &rows_argmax(&logits, cols))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    #[test]
    fn ties_nan_and_rows() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -5.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        let mut m = FlatMemory::new();
        let logits = m.put(&[0.0f32, 1.0, -1.0, 9.0, 2.0, 9.0]);
        let out = m.put(&[-1i32; 2]);
        ArgmaxF32 {
            out,
            logits,
            rows: 2,
            cols: 3,
        }
        .reference(&mut m)
        .unwrap();
        assert_eq!(m.get::<i32>(out, 2), vec![1, 0]);
    }
}
