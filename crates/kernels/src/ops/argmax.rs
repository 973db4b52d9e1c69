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
        /// u64 `[2 * rows]` ([`argmax_scratch_bytes`]), zero before the launch and zero again
        /// after it: the merge keys and block counts of the blocks that split each row.
        scratch: DevicePtr,
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
        /// u64 `[2 * rows]` ([`argmax_scratch_bytes`]), zero before the launch and zero again
        /// after it: the merge keys and block counts of the blocks that split each row.
        scratch: DevicePtr,
    }
);

/// Threads of an argmax block (argmax.cu).
const THREADS: u32 = 256;
/// 16-byte loads per thread: a block covers `THREADS * LOADS` of them.
const LOADS: u32 = 4;

/// The argmax launch: `splits` blocks per row (a row's values in chunks of 16-byte loads, one per
/// thread `LOADS` times over), rows in grid y.
fn split_launch(rows: u32, cols: u32, value_bytes: u32) -> LaunchConfig {
    let chunk = THREADS * LOADS * (16 / value_bytes);
    LaunchConfig {
        grid: [cols.div_ceil(chunk).max(1), rows.max(1), 1],
        block: [THREADS, 1, 1],
        shared_mem_bytes: 0,
    }
}

/// Bytes of the `scratch` an [`ArgmaxBf16`] or [`ArgmaxF32`] launch over `rows` rows needs: a
/// u64 merge key and a u64 count per row.
pub const fn argmax_scratch_bytes(rows: usize) -> usize {
    rows * 16
}

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
        split_launch(self.rows, self.cols, 2)
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
        split_launch(self.rows, self.cols, 4)
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
        let k = ArgmaxF32 {
            out,
            logits,
            rows: 2,
            cols: 3,
            scratch: DevicePtr::NULL,
        };
        k.reference(&mut m).unwrap();
        assert_eq!(m.get::<i32>(out, 2), vec![1, 0]);
        // One block per 4096 f32 (8192 bf16) of a row, rows in grid y.
        let grid = |cols| ArgmaxF32 { cols, ..k }.launch_config().grid;
        assert_eq!(grid(3), [1, 2, 1]);
        assert_eq!(grid(151_936), [38, 2, 1]);
        assert_eq!(
            ArgmaxBf16 {
                out,
                logits,
                rows: 1,
                cols: 151_936,
                scratch: DevicePtr::NULL,
            }
            .launch_config()
            .grid,
            [19, 1, 1]
        );
    }
}
