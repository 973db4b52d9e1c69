// SPDX-License-Identifier: MIT OR Apache-2.0
//! The grouped products for few rows an expert on tensor cores:
//! [`MoeGroupedGemvSwiglu`](super::MoeGroupedGemvSwiglu)'s and
//! [`MoeGroupedGemvDown`](super::MoeGroupedGemvDown)'s arguments and values (f32 sums in another order), with each touched
//! expert's weights read once per 32 of its rows and multiplied by `mma.sync` tiles instead of
//! CUDA-core FMAs.
//!
//! The weights are the tiles' A operand (16 output columns), the expert's rows their B operand
//! (8 rows, zeros past the expert's last), so a decode batch's 1 to 32 rows an expert cost the
//! weight bytes and a few tensor-core instructions per 16-byte load; the CUDA-core streams convert
//! and multiply every weight element once per row.

use metrale_core::{DevicePtr, LaunchConfig};

use super::grouped::{down_reference, first_reference};
use super::{ExpertActivation, MoeGemmDown, MoeGemmRelu2, MoeGemmSwiglu};
use crate::host::{HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;
use crate::ops::blocks_for;

kernel_args!(
    /// [`MoeGemmSwiglu`]'s output on tensor cores for few rows an expert (decode batches): a warp
    /// holds 16 columns of one expert (their gate and up rows) and reads them once per 32 of the
    /// expert's rows; experts no row chose read nothing. The same values (f32 sums in another
    /// order).
    MoeGroupedMmaSwiglu => names::moe::MOE_GROUPED_MMA_SWIGLU {
        /// bf16 `[n, inter]`, in expert order.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// bf16 `[experts, 2 * inter, hidden]`.
        w: DevicePtr,
        /// i32 `[experts + 1]` ([`MoeGroup`](super::MoeGroup)).
        offsets: DevicePtr,
        /// i32 `[n]` ([`MoeGroup`](super::MoeGroup)).
        sorted: DevicePtr,
        /// Slots a row (an assignment's row is `a / k`).
        k: u32,
        /// Experts.
        experts: u32,
        /// Each expert's width.
        inter: u32,
        /// The model's width.
        hidden: u32,
    }
);

kernel_args!(
    /// [`MoeGemmDown`]'s output on tensor cores for few rows an expert: a warp holds 32 output
    /// columns of one expert and reads their down rows once per 32 of the expert's rows.
    MoeGroupedMmaDown => names::moe::MOE_GROUPED_MMA_DOWN {
        /// bf16 `[n, hidden]`, in assignment order.
        y: DevicePtr,
        /// bf16 `[n, inter]`: the gate|up output, in expert order.
        act: DevicePtr,
        /// bf16 `[experts, hidden, inter]`.
        w: DevicePtr,
        /// i32 `[experts + 1]` ([`MoeGroup`](super::MoeGroup)).
        offsets: DevicePtr,
        /// i32 `[n]` ([`MoeGroup`](super::MoeGroup)).
        sorted: DevicePtr,
        /// Experts.
        experts: u32,
        /// The model's width.
        hidden: u32,
        /// Each expert's width.
        inter: u32,
    }
);

kernel_args!(
    /// [`MoeGemmRelu2`]'s output on tensor cores for few rows an expert: a warp holds 32 columns
    /// of one expert (two tiles of 16 up rows) and reads them once per 32 of the expert's rows.
    MoeGroupedMmaRelu2 => names::moe::MOE_GROUPED_MMA_RELU2 {
        /// bf16 `[n, inter]`, in expert order.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// bf16 `[experts, inter, hidden]`.
        w: DevicePtr,
        /// i32 `[experts + 1]` ([`MoeGroup`](super::MoeGroup)).
        offsets: DevicePtr,
        /// i32 `[n]` ([`MoeGroup`](super::MoeGroup)).
        sorted: DevicePtr,
        /// Slots a row (an assignment's row is `a / k`).
        k: u32,
        /// Experts.
        experts: u32,
        /// Each expert's width.
        inter: u32,
        /// The model's width.
        hidden: u32,
    }
);

same_args!(MoeGemmRelu2 <-> MoeGroupedMmaRelu2 {
    act, x, w, offsets, sorted, k, experts, inter, hidden
});
same_args!(MoeGemmSwiglu <-> MoeGroupedMmaSwiglu {
    act, x, w, offsets, sorted, k, experts, inter, hidden
});
same_args!(MoeGemmDown <-> MoeGroupedMmaDown {
    y, act, w, offsets, sorted, experts, hidden, inter
});

/// Warps of a block (`MMA_WARPS` in moe.cu).
const WARPS: u32 = 4;
/// Output columns a warp of the SwiGLU form computes (one 16-row gate tile and its up tile).
const SWIGLU_WARP_COLUMNS: u32 = 16;
/// Output columns a warp of the squared-ReLU form computes (two 16-row up tiles).
const RELU2_WARP_COLUMNS: u32 = 32;
/// Output columns a warp of the down form computes (two 16-row tiles).
const DOWN_WARP_COLUMNS: u32 = 32;

impl Kernel for MoeGroupedMmaSwiglu {
    /// One block per expert and 64 columns.
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.inter.into(), WARPS * SWIGLU_WARP_COLUMNS).max(1),
                self.experts.max(1),
                1,
            ],
            block: [WARPS * 32, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        first_reference(
            Self::NAME,
            &MoeGemmSwiglu::from(*self),
            ExpertActivation::SwiGlu,
            mem,
        )
    }
}

impl Kernel for MoeGroupedMmaRelu2 {
    /// One block per expert and 128 columns.
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.inter.into(), WARPS * RELU2_WARP_COLUMNS).max(1),
                self.experts.max(1),
                1,
            ],
            block: [WARPS * 32, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        first_reference(
            Self::NAME,
            &MoeGemmSwiglu::from(MoeGemmRelu2::from(*self)),
            ExpertActivation::Relu2,
            mem,
        )
    }
}

impl Kernel for MoeGroupedMmaDown {
    /// One block per expert and 128 output columns.
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.hidden.into(), WARPS * DOWN_WARP_COLUMNS).max(1),
                self.experts.max(1),
                1,
            ],
            block: [WARPS * 32, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        down_reference(Self::NAME, &MoeGemmDown::from(*self), mem)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_cover_qwen3_30b_a3b_widths() {
        let z = DevicePtr::NULL;
        let swiglu = MoeGroupedMmaSwiglu {
            act: z,
            x: z,
            w: z,
            offsets: z,
            sorted: z,
            k: 8,
            experts: 128,
            inter: 768,
            hidden: 2048,
        };
        assert_eq!(swiglu.launch_config().grid, [12, 128, 1]);
        let down = MoeGroupedMmaDown::from(MoeGemmDown::from(MoeGroupedMmaDown {
            y: z,
            act: z,
            w: z,
            offsets: z,
            sorted: z,
            experts: 128,
            hidden: 2048,
            inter: 768,
        }));
        assert_eq!(down.launch_config().grid, [16, 128, 1]);
        assert_eq!(down.launch_config().block, [128, 1, 1]);
    }
}
