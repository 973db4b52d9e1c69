// SPDX-License-Identifier: MIT OR Apache-2.0
//! One module per kernel family: the typed arguments, launch geometry and host reference of each
//! entry point. All activations are bf16 with f32 arithmetic; rounding points follow the HF
//! reference so that host and CUDA agree with `transformers` to bf16 precision.

mod activation;
mod argmax;
mod attention;
mod elementwise;
mod embedding;
mod fp8_gemm;
pub mod gated_delta;
pub mod gated_norm;
mod gemm;
mod gemv_fp8;
mod gemv_fp8_mma;
mod gemv_fp8_stream;
mod grid_barrier;
mod kv_fp8;
pub mod mamba2;
pub mod moe;
mod qkv_post;
mod rmsnorm;
mod rope;

pub use activation::{Relu2, SiluMul, SiluMulFp8Rows};
pub use argmax::{ArgmaxBf16, ArgmaxF32, argmax_scratch_bytes};
pub(crate) use attention::paged_attention_qkv_wide_reference;
pub use attention::{
    ATTENTION_SPLIT_KEYS, ATTENTION_UNSPLIT_KEYS, AttentionCombine, KvCacheWrite, PagedAttention,
    PagedAttentionQkv, PrefillAttention, PrefillAttentionV2, PrefillAttentionV3, PrefillRow,
    attention_splits, attention_splits_of, paged_attention_block_group, paged_attention_groups,
    paged_attention_smem_bytes, paged_attention_smem_bytes_for, paged_attention_smem_bytes_of,
    prefill_attention_rows, prefill_attention_tiles, prefill_attention_tiles_of,
};
pub use elementwise::Add;
pub use embedding::Embedding;
pub use fp8_gemm::{
    FP8_GEMM_PAD_ROWS, FP8_GEMM_ROW_GROUP, Fp8QuantizeRows, GemmFp8, fp8_row_scale, fp8_rows_bytes,
    fp8_rows_split, gemm_fp8_fits,
};
pub use gated_delta::{
    GDN_CHUNK_MAX, GDN_CHUNK_PREP_SMEM, GDN_CHUNK_SCAN_SMEM, GDN_CHUNK_THREADS, GDN_CONV_CHUNK,
    GDN_CONV_MAX_KERNEL, GDN_MAX_DK, GDN_RECURRENT_COLS, GDN_SCAN_COLS, GdnChunkPrep, GdnChunkScan,
    GdnConv1d, GdnConv1dStep, GdnGating, GdnRecurrent,
};
pub use gated_delta::{
    GDN_CHUNK_PREP_TC_SMEM, GDN_CHUNK_SCAN_TC_SMEM, GDN_CHUNK_SCAN_TC_THREADS, GdnChunkPrepTc,
    GdnChunkScanTc,
};
pub use gated_norm::{GATED_NORM_THREADS, GateOrder, GatedRmsNorm, SigmoidGateMul};
pub use gemm::{
    GEMV_FMA_MAX_ROWS, GEMV_MAX_ROWS, GEMV_RESIDENT_BLOCKS, GEMV_STREAM_BLOCKS, GEMV_STREAM_STAGES,
    Gemm, GemmF32Out, Gemv, GemvF32Out, GemvGridMode, GemvNorm, GemvStaged, GemvStream,
    GemvStreamF32Out, GemvStreamNorm, GemvSwiglu, GemvSwigluNorm, GemvSwigluStaged,
    GemvSwigluStream, GemvSwigluStreamNorm, gemv_balanced_grid, gemv_capped_grid,
    gemv_columns_per_block, gemv_grid_columns, gemv_launch_grid, gemv_norm_fits, gemv_stages,
    gemv_stream_fits,
};
pub use gemv_fp8::{
    FP8_SCALE_COLS, Fp8DequantBf16, GEMV_FP8_MAX_ROWS, GemvFp8, GemvFp8Swiglu, fp8_weight_f32,
};
pub use gemv_fp8_mma::{
    GemvFp8Mma, GemvFp8MmaSwiglu, activation_f16, gemv_fp8_mma_fits, gemv_fp8_mma_smem_bytes,
};
pub use gemv_fp8_stream::{
    GemvFp8Stream, GemvFp8StreamNorm, GemvFp8SwigluStream, GemvFp8SwigluStreamNorm,
    gemv_fp8_stream_fits, gemv_fp8_stream_smem_bytes,
};
pub use grid_barrier::GridBarrier;
pub(crate) use kv_fp8::paged_attention_qkv_wide_fp8_reference;
pub use kv_fp8::{
    KvCacheWriteFp8, PagedAttentionFp8, PagedAttentionQkvFp8, PrefillAttentionV2Fp8,
    QkvRopeKvWriteFp8, e4m3_of_bf16, fp8_attention_takes_head_dim,
};
pub use mamba2::{
    MAMBA2_CHANNELS, MAMBA2_MAX_STATE, MAMBA2_STATE_LANES, MAMBA2_STATE_MULTIPLE, Mamba2ChunkCarry,
    Mamba2ChunkScan, Mamba2ChunkState, Mamba2Recurrent,
};
pub use moe::{
    ExpertActivation, MOE_MAX_EXPERTS, MOE_MAX_TOP_K, MOE_ROUTER_MAX_ROWS, MoeCombine, MoeGemmDown,
    MoeGemmRelu2, MoeGemmSwiglu, MoeGemvDown, MoeGemvFp8Down, MoeGemvFp8Relu2, MoeGemvFp8Swiglu,
    MoeGemvRelu2, MoeGemvSwiglu, MoeGroup, MoeGroupedGemvDown, MoeGroupedGemvRelu2,
    MoeGroupedGemvSwiglu, MoeGroupedMmaDown, MoeGroupedMmaFp8Down, MoeGroupedMmaFp8Relu2,
    MoeGroupedMmaFp8Swiglu, MoeGroupedMmaRelu2, MoeGroupedMmaSwiglu, MoeRoute, MoeRouter,
    MoeScoring, MoeWgmmaDown, MoeWgmmaFp8Down, MoeWgmmaFp8Relu2, MoeWgmmaFp8Swiglu, MoeWgmmaRelu2,
    MoeWgmmaSwiglu, group_by_expert, route_row,
};
pub use qkv_post::{QkNormWhole, QkvRopeKvWrite};
pub use rmsnorm::{AddRmsNorm, AddRmsNormFp8Rows, RmsNorm};
pub use rope::RopeNeox;

/// Threads per block of the row-wise kernels (a multiple of 32, at most 1024).
pub const ROW_THREADS: u32 = 256;

/// Blocks of `threads` threads covering `n` elements.
pub(crate) fn blocks_for(n: u64, threads: u32) -> u32 {
    u32::try_from(n.div_ceil(u64::from(threads))).expect("grid larger than u32::MAX blocks")
}

#[cfg(test)]
pub(crate) mod testing {
    //! A flat memory for reference tests: addresses are offsets from a fixed base into one buffer.
    use crate::host::{HostError, HostMemory};
    use metrale_core::DevicePtr;

    pub const BASE: u64 = 0x10_0000;

    #[derive(Clone)]
    pub struct FlatMemory {
        pub bytes: Vec<u8>,
    }

    impl FlatMemory {
        pub fn new() -> Self {
            FlatMemory { bytes: Vec::new() }
        }
        /// Appends `data` (256-byte aligned) and returns its address.
        pub fn put<T: bytemuck::Pod>(&mut self, data: &[T]) -> DevicePtr {
            let at = self.bytes.len().next_multiple_of(256);
            self.bytes.resize(at, 0);
            self.bytes.extend_from_slice(bytemuck::cast_slice(data));
            DevicePtr(BASE + at as u64)
        }
        pub fn get<T: bytemuck::Pod>(&self, ptr: DevicePtr, n: usize) -> Vec<T> {
            crate::host::load(self, ptr, n).unwrap()
        }
    }

    impl HostMemory for FlatMemory {
        fn bytes(&self, ptr: DevicePtr, len: usize) -> Result<&[u8], HostError> {
            let at = ptr
                .0
                .checked_sub(BASE)
                .ok_or(HostError::OutOfBounds { ptr, len })? as usize;
            self.bytes
                .get(at..at + len)
                .ok_or(HostError::OutOfBounds { ptr, len })
        }
        fn bytes_mut(&mut self, ptr: DevicePtr, len: usize) -> Result<&mut [u8], HostError> {
            let at = ptr
                .0
                .checked_sub(BASE)
                .ok_or(HostError::OutOfBounds { ptr, len })? as usize;
            self.bytes
                .get_mut(at..at + len)
                .ok_or(HostError::OutOfBounds { ptr, len })
        }
    }

    pub fn bf16s(v: &[f32]) -> Vec<half::bf16> {
        v.iter().map(|&x| half::bf16::from_f32(x)).collect()
    }

    pub fn f32s(v: &[half::bf16]) -> Vec<f32> {
        v.iter().map(|&x| f32::from(x)).collect()
    }

    /// `n` deterministic values in `[-scale, scale)` from a linear congruential generator.
    pub fn uniform(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }
}
