// SPDX-License-Identifier: MIT OR Apache-2.0
//! The grouped prefill products on Hopper's warpgroup MMA: [`MoeGemmSwiglu`]'s,
//! [`MoeGemmRelu2`]'s and [`MoeGemmDown`]'s arguments and values (f32 sums in another order), as a
//! persistent loop over 128 x 128 tiles spread evenly across one block an SM whatever the
//! routing.
//!
//! `moe_gemm_*` give each (expert, column group) one block that walks the expert's rows in 64-row
//! tiles of WMMA products without a pipeline, so at prefill sizes a popular expert's rows run on
//! one SM (Qwen3-30B-A3B at 8,192 tokens: 5.6 ms for the gate|up product's 412 GFLOP). Here every
//! block numbers the tiles of all experts from `offsets` itself (a scan in shared memory), takes
//! every `gridDim`-th one, and streams the pieces of its tiles through six stages of cp.async
//! copies into `wgmma.mma_async` (moe.cu's `moe_wg`). Shapes it does not take (a width not a
//! multiple of 8, misaligned operands, more than [`MOE_MAX_EXPERTS`](super::MOE_MAX_EXPERTS)
//! experts) write nothing: [`MoeWgmmaSwiglu::fits`] says which, and callers keep `moe_gemm_*`.

use metrale_core::{DevicePtr, LaunchConfig};

use super::grouped::{down_reference, first_reference};
use super::{ExpertActivation, MOE_MAX_EXPERTS, MoeGemmDown, MoeGemmRelu2, MoeGemmSwiglu};
use crate::host::{HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;
use crate::registry::hardware::hopper;

kernel_args!(
    /// [`MoeGemmSwiglu`] on warpgroup MMA (prefill): the same arguments and values.
    MoeWgmmaSwiglu => names::moe::MOE_WGMMA_SWIGLU {
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
    /// [`MoeGemmRelu2`] on warpgroup MMA (prefill): the same arguments and values.
    MoeWgmmaRelu2 => names::moe::MOE_WGMMA_RELU2 {
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

kernel_args!(
    /// [`MoeGemmDown`] on warpgroup MMA (prefill): the same arguments and values.
    MoeWgmmaDown => names::moe::MOE_WGMMA_DOWN {
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

same_args!(MoeGemmSwiglu <-> MoeWgmmaSwiglu {
    act, x, w, offsets, sorted, k, experts, inter, hidden
});
same_args!(MoeGemmRelu2 <-> MoeWgmmaRelu2 {
    act, x, w, offsets, sorted, k, experts, inter, hidden
});
same_args!(MoeGemmDown <-> MoeWgmmaDown {
    y, act, w, offsets, sorted, experts, hidden, inter
});

/// Threads of a block: two warpgroups (`moe_wg::THREADS`).
const THREADS: u32 = 256;
/// Dynamic shared memory: six stages of two 16 KiB pieces, plus 1 KiB to align the swizzle atoms
/// (`moe_wg::Smem<false>::BYTES` + 1024).
const SHARED_BYTES: u32 = 6 * 2 * 16 * 1024 + 1024;

/// One block an SM of the Hopper class (each takes ~197 KiB of shared memory, so one fits).
fn persistent() -> LaunchConfig {
    LaunchConfig {
        grid: [hopper::SM_COUNT, 1, 1],
        block: [THREADS, 1, 1],
        shared_mem_bytes: SHARED_BYTES,
    }
}

impl MoeWgmmaSwiglu {
    /// Whether the kernel takes these widths and pointers (16-byte aligned operands, widths a
    /// multiple of 8, 1 to [`MOE_MAX_EXPERTS`] experts); otherwise it writes nothing.
    pub fn fits(experts: u32, inter: u32, hidden: u32, operands: &[DevicePtr]) -> bool {
        (1..=MOE_MAX_EXPERTS).contains(&experts)
            && inter.is_multiple_of(8)
            && hidden.is_multiple_of(8)
            && operands.iter().all(|p| p.0.is_multiple_of(16))
    }
}

impl Kernel for MoeWgmmaSwiglu {
    fn launch_config(&self) -> LaunchConfig {
        persistent()
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

impl Kernel for MoeWgmmaRelu2 {
    fn launch_config(&self) -> LaunchConfig {
        persistent()
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

impl Kernel for MoeWgmmaDown {
    fn launch_config(&self) -> LaunchConfig {
        persistent()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        down_reference(Self::NAME, &MoeGemmDown::from(*self), mem)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fits_only_aligned_widths_of_eight() {
        let a = DevicePtr(4096);
        assert!(MoeWgmmaSwiglu::fits(128, 768, 2048, &[a, a]));
        assert!(!MoeWgmmaSwiglu::fits(128, 770, 2048, &[a]));
        assert!(!MoeWgmmaSwiglu::fits(128, 768, 2044, &[a]));
        assert!(!MoeWgmmaSwiglu::fits(0, 768, 2048, &[a]));
        assert!(!MoeWgmmaSwiglu::fits(MOE_MAX_EXPERTS + 1, 768, 2048, &[a]));
        assert!(!MoeWgmmaSwiglu::fits(128, 768, 2048, &[DevicePtr(4098)]));
    }

    #[test]
    fn one_block_an_sm_within_the_shared_memory_limit() {
        let c = persistent();
        assert_eq!(c.grid, [hopper::SM_COUNT, 1, 1]);
        // The kernel's static shared memory (two i32 tables of MOE_MAX_EXPERTS + 1) on top.
        assert!(c.shared_mem_bytes + 2 * 4 * (MOE_MAX_EXPERTS + 1) <= 227 * 1024);
    }
}
