// SPDX-License-Identifier: MIT OR Apache-2.0
//! Token embedding gather into the f32 residual stream.

use metrale_core::{DevicePtr, LaunchConfig};

use super::ROW_THREADS;
use crate::host::{self, HostError, HostMemory, Kernel, kernel_args};
use crate::names;

kernel_args!(
    /// `out[t, :] = f32(table[ids[t], :])`; an id outside `[0, vocab)` gives a zero row.
    Embedding => names::embedding::EMBEDDING_F32 {
        /// f32 `[tokens, hidden]`.
        out: DevicePtr,
        /// bf16 `[vocab, hidden]`.
        table: DevicePtr,
        /// i32 `[tokens]`.
        ids: DevicePtr,
        /// Rows to gather.
        tokens: u32,
        /// Row width.
        hidden: u32,
        /// Rows in the table.
        vocab: u32,
    }
);

impl Embedding {
    /// `embedding_f32_vec`: the same arguments, launch and values with 16-byte loads, all of a
    /// thread's issued before its first store (the model takes it under
    /// the tuning's `embedding_vec`, being measured).
    pub const VEC_NAME: metrale_core::KernelName = names::embedding::EMBEDDING_F32_VEC;
}

impl Kernel for Embedding {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(self.tokens, ROW_THREADS)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (t, h) = (self.tokens as usize, self.hidden as usize);
        let ids = host::load::<i32>(mem, self.ids, t)?;
        let mut out = vec![0f32; t * h];
        for (row, &id) in out.chunks_exact_mut(h.max(1)).zip(&ids) {
            if id >= 0 && (id as u32) < self.vocab {
                row.copy_from_slice(&host::load_bf16(
                    mem,
                    self.table.offset(id as usize * h * 2),
                    h,
                )?);
            }
        }
        host::store(mem, self.out, &out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    #[test]
    fn gathers_rows_and_zeroes_bad_ids() {
        let mut m = FlatMemory::new();
        let table = m.put(&bf16s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
        let ids = m.put(&[2i32, 0, 7, -1]);
        let out = m.put(&[9.0f32; 8]);
        Embedding {
            out,
            table,
            ids,
            tokens: 4,
            hidden: 2,
            vocab: 3,
        }
        .reference(&mut m)
        .unwrap();
        assert_eq!(
            m.get::<f32>(out, 8),
            vec![5.0, 6.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0]
        );
    }
}
