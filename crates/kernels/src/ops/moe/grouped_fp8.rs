// SPDX-License-Identifier: MIT OR Apache-2.0
//! The grouped products over FP8 (E4M3) expert stacks: the tensor-core weight streams
//! ([`MoeGroupedMmaFp8Swiglu`], [`MoeGroupedMmaFp8Relu2`], [`MoeGroupedMmaFp8Down`]) and the
//! warpgroup-MMA prefill tiles ([`MoeWgmmaFp8Swiglu`], [`MoeWgmmaFp8Relu2`], [`MoeWgmmaFp8Down`]),
//! each its BF16 form's launch with the stack's scales and `row_shift` added (moe.cu).
//!
//! Their values are the BF16 forms' over the stacks dequantised as
//! [`Fp8DequantBf16`](crate::ops::Fp8DequantBf16) writes them, each weight `bf16(e4m3 × scale)`:
//! the kernels turn the e4m3 bytes into those bf16 values on the way to the tensor cores (in
//! registers for the weight streams, in shared memory for the prefill tiles) instead of a pass
//! that writes the whole stack in bf16 first (3 bytes a weight moved, every expert's). The
//! references dequantise each touched expert the same way and run the BF16 forms' references,
//! so they are the dequantise-then-BF16 path's bits; the kernels differ from that path only in
//! the order of the f32 sums where the tensor-core tiles group K differently (the weight
//! streams load 16 weights a lane; the prefill tiles multiply the same tiles in the same order).
//!
//! The stacks are [`fp8`](super::fp8)'s: the gate|up stack `[experts * 2 * inter, hidden]`, the
//! squared-ReLU up stack `[experts * inter, hidden]`, the down stack `[experts * hidden, inter]`,
//! scales `[ceil(rows / 2^row_shift), ceil(cols / 128)]`.

use metrale_core::{DevicePtr, LaunchConfig};

use super::grouped::{Stack, down_reference_of, first_reference_of};
use super::{
    ExpertActivation, MoeGemmDown, MoeGemmSwiglu, MoeGroupedMmaDown, MoeGroupedMmaSwiglu,
    MoeWgmmaSwiglu,
};
use crate::host::{HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;
use crate::registry::hardware::hopper;

kernel_args!(
    /// [`MoeGroupedMmaSwiglu`] over an e4m3 gate|up stack: the same launch and values with each
    /// weight `bf16(e4m3 × scale)` (f32 sums in another order).
    MoeGroupedMmaFp8Swiglu => names::moe::MOE_GROUPED_MMA_FP8_SWIGLU {
        /// bf16 `[n, inter]`, in expert order.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// e4m3 `[experts * 2 * inter, hidden]`: each expert's gate rows, then its up rows.
        w: DevicePtr,
        /// f32 `[ceil(experts * 2 * inter / 2^row_shift), ceil(hidden / 128)]`.
        scales: DevicePtr,
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
        /// log2 of the rows a scale covers: 7 (128 x 128 blocks) or 0 (a scale per row).
        row_shift: u32,
    }
);

kernel_args!(
    /// [`MoeGroupedMmaRelu2`](super::MoeGroupedMmaRelu2) over an e4m3 up stack
    /// (`[experts * inter, hidden]`): the same launch and values with each weight
    /// `bf16(e4m3 × scale)`.
    MoeGroupedMmaFp8Relu2 => names::moe::MOE_GROUPED_MMA_FP8_RELU2 {
        /// bf16 `[n, inter]`, in expert order.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// e4m3 `[experts * inter, hidden]`.
        w: DevicePtr,
        /// f32 `[ceil(experts * inter / 2^row_shift), ceil(hidden / 128)]`.
        scales: DevicePtr,
        /// i32 `[experts + 1]`.
        offsets: DevicePtr,
        /// i32 `[n]`.
        sorted: DevicePtr,
        /// Slots a row.
        k: u32,
        /// Experts.
        experts: u32,
        /// Each expert's width.
        inter: u32,
        /// The model's width.
        hidden: u32,
        /// log2 of the rows a scale covers.
        row_shift: u32,
    }
);

kernel_args!(
    /// [`MoeGroupedMmaDown`] over an e4m3 down stack: the same launch and values with each
    /// weight `bf16(e4m3 × scale)`.
    MoeGroupedMmaFp8Down => names::moe::MOE_GROUPED_MMA_FP8_DOWN {
        /// bf16 `[n, hidden]`, in assignment order.
        y: DevicePtr,
        /// bf16 `[n, inter]`: the first product's output, in expert order.
        act: DevicePtr,
        /// e4m3 `[experts * hidden, inter]`.
        w: DevicePtr,
        /// f32 `[ceil(experts * hidden / 2^row_shift), ceil(inter / 128)]`.
        scales: DevicePtr,
        /// i32 `[experts + 1]`.
        offsets: DevicePtr,
        /// i32 `[n]`.
        sorted: DevicePtr,
        /// Experts.
        experts: u32,
        /// The model's width.
        hidden: u32,
        /// Each expert's width.
        inter: u32,
        /// log2 of the rows a scale covers.
        row_shift: u32,
    }
);

kernel_args!(
    /// [`MoeWgmmaSwiglu`] over an e4m3 gate|up stack (prefill): the same tiles and values with
    /// each weight `bf16(e4m3 × scale)`. Takes widths that are multiples of 16 (see
    /// [`MoeWgmmaFp8Swiglu::fits`]); otherwise it writes nothing.
    MoeWgmmaFp8Swiglu => names::moe::MOE_WGMMA_FP8_SWIGLU {
        /// bf16 `[n, inter]`, in expert order.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// e4m3 `[experts * 2 * inter, hidden]`.
        w: DevicePtr,
        /// f32 `[ceil(experts * 2 * inter / 2^row_shift), ceil(hidden / 128)]`.
        scales: DevicePtr,
        /// i32 `[experts + 1]`.
        offsets: DevicePtr,
        /// i32 `[n]`.
        sorted: DevicePtr,
        /// Slots a row.
        k: u32,
        /// Experts.
        experts: u32,
        /// Each expert's width.
        inter: u32,
        /// The model's width.
        hidden: u32,
        /// log2 of the rows a scale covers.
        row_shift: u32,
    }
);

kernel_args!(
    /// [`MoeWgmmaRelu2`](super::MoeWgmmaRelu2) over an e4m3 up stack (prefill).
    MoeWgmmaFp8Relu2 => names::moe::MOE_WGMMA_FP8_RELU2 {
        /// bf16 `[n, inter]`, in expert order.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// e4m3 `[experts * inter, hidden]`.
        w: DevicePtr,
        /// f32 `[ceil(experts * inter / 2^row_shift), ceil(hidden / 128)]`.
        scales: DevicePtr,
        /// i32 `[experts + 1]`.
        offsets: DevicePtr,
        /// i32 `[n]`.
        sorted: DevicePtr,
        /// Slots a row.
        k: u32,
        /// Experts.
        experts: u32,
        /// Each expert's width.
        inter: u32,
        /// The model's width.
        hidden: u32,
        /// log2 of the rows a scale covers.
        row_shift: u32,
    }
);

kernel_args!(
    /// [`MoeWgmmaDown`](super::MoeWgmmaDown) over an e4m3 down stack (prefill).
    MoeWgmmaFp8Down => names::moe::MOE_WGMMA_FP8_DOWN {
        /// bf16 `[n, hidden]`, in assignment order.
        y: DevicePtr,
        /// bf16 `[n, inter]`, in expert order.
        act: DevicePtr,
        /// e4m3 `[experts * hidden, inter]`.
        w: DevicePtr,
        /// f32 `[ceil(experts * hidden / 2^row_shift), ceil(inter / 128)]`.
        scales: DevicePtr,
        /// i32 `[experts + 1]`.
        offsets: DevicePtr,
        /// i32 `[n]`.
        sorted: DevicePtr,
        /// Experts.
        experts: u32,
        /// The model's width.
        hidden: u32,
        /// Each expert's width.
        inter: u32,
        /// log2 of the rows a scale covers.
        row_shift: u32,
    }
);

same_args!(MoeGroupedMmaFp8Swiglu <-> MoeGroupedMmaFp8Relu2 {
    act, x, w, scales, offsets, sorted, k, experts, inter, hidden, row_shift
});
same_args!(MoeGroupedMmaFp8Swiglu <-> MoeWgmmaFp8Swiglu {
    act, x, w, scales, offsets, sorted, k, experts, inter, hidden, row_shift
});
same_args!(MoeGroupedMmaFp8Swiglu <-> MoeWgmmaFp8Relu2 {
    act, x, w, scales, offsets, sorted, k, experts, inter, hidden, row_shift
});
same_args!(MoeGroupedMmaFp8Down <-> MoeWgmmaFp8Down {
    y, act, w, scales, offsets, sorted, experts, hidden, inter, row_shift
});

impl MoeGroupedMmaFp8Swiglu {
    /// The BF16 form's arguments (its `w` null: the stack is [`Self::stack`]).
    fn bf16(&self) -> MoeGemmSwiglu {
        MoeGemmSwiglu {
            act: self.act,
            x: self.x,
            w: DevicePtr::NULL,
            offsets: self.offsets,
            sorted: self.sorted,
            k: self.k,
            experts: self.experts,
            inter: self.inter,
            hidden: self.hidden,
        }
    }

    fn stack(&self) -> Stack {
        Stack::Fp8 {
            w: self.w,
            scales: self.scales,
            row_shift: self.row_shift,
        }
    }

    fn reference_as(
        &self,
        name: metrale_core::KernelName,
        activation: ExpertActivation,
        mem: &mut dyn HostMemory,
    ) -> Result<(), HostError> {
        first_reference_of(name, &self.bf16(), self.stack(), activation, mem)
    }
}

impl MoeGroupedMmaFp8Down {
    /// The BF16 form's arguments (its `w` null).
    fn bf16(&self) -> MoeGemmDown {
        MoeGemmDown {
            y: self.y,
            act: self.act,
            w: DevicePtr::NULL,
            offsets: self.offsets,
            sorted: self.sorted,
            experts: self.experts,
            hidden: self.hidden,
            inter: self.inter,
        }
    }

    fn reference_as(
        &self,
        name: metrale_core::KernelName,
        mem: &mut dyn HostMemory,
    ) -> Result<(), HostError> {
        let stack = Stack::Fp8 {
            w: self.w,
            scales: self.scales,
            row_shift: self.row_shift,
        };
        down_reference_of(name, &self.bf16(), stack, mem)
    }
}

impl MoeGroupedMmaFp8Relu2 {
    /// [`MoeGemmRelu2::flip_allowance`](super::MoeGemmRelu2::flip_allowance) over the
    /// dequantised stack: extra tolerance where an up product lies at a bf16 rounding boundary.
    pub fn flip_allowance(&self, mem: &dyn HostMemory) -> Result<Vec<f32>, HostError> {
        let a = MoeGroupedMmaFp8Swiglu::from(*self);
        super::MoeGemmRelu2::from(a.bf16()).flip_allowance_of(Self::NAME, a.stack(), mem)
    }
}

impl Kernel for MoeGroupedMmaFp8Swiglu {
    /// [`MoeGroupedMmaSwiglu`]'s launch.
    fn launch_config(&self) -> LaunchConfig {
        MoeGroupedMmaSwiglu::from(self.bf16()).launch_config()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        self.reference_as(Self::NAME, ExpertActivation::SwiGlu, mem)
    }
}

impl Kernel for MoeGroupedMmaFp8Relu2 {
    /// [`MoeGroupedMmaRelu2`](super::MoeGroupedMmaRelu2)'s launch.
    fn launch_config(&self) -> LaunchConfig {
        let a = MoeGroupedMmaFp8Swiglu::from(*self).bf16();
        super::MoeGroupedMmaRelu2::from(super::MoeGemmRelu2::from(a)).launch_config()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        MoeGroupedMmaFp8Swiglu::from(*self).reference_as(Self::NAME, ExpertActivation::Relu2, mem)
    }
}

impl Kernel for MoeGroupedMmaFp8Down {
    /// [`MoeGroupedMmaDown`]'s launch.
    fn launch_config(&self) -> LaunchConfig {
        MoeGroupedMmaDown::from(self.bf16()).launch_config()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        self.reference_as(Self::NAME, mem)
    }
}

/// Threads of a prefill block: two warpgroups (`moe_wg::THREADS`).
const THREADS: u32 = 256;
/// Dynamic shared memory of the FP8 prefill tiles (`moe_wg::Smem<true>::BYTES` + 1024): six
/// stages of A's 16 KiB piece, B's 8 KiB of e4m3 and 2 KiB of scales, then three converted
/// 16 KiB B tiles, plus 1 KiB to align the swizzle atoms.
const SHARED_BYTES: u32 = 6 * (16 + 8 + 2) * 1024 + 3 * 16 * 1024 + 1024;

/// One block an SM of the Hopper class (each takes ~205 KiB of shared memory, so one fits).
fn persistent() -> LaunchConfig {
    LaunchConfig {
        grid: [hopper::SM_COUNT, 1, 1],
        block: [THREADS, 1, 1],
        shared_mem_bytes: SHARED_BYTES,
    }
}

impl MoeWgmmaFp8Swiglu {
    /// Whether the FP8 prefill tiles take these widths and pointers (16-byte aligned operands,
    /// widths a multiple of 16, 1 to [`MOE_MAX_EXPERTS`](super::MOE_MAX_EXPERTS) experts);
    /// otherwise they write nothing.
    pub fn fits(experts: u32, inter: u32, hidden: u32, operands: &[DevicePtr]) -> bool {
        inter.is_multiple_of(16)
            && hidden.is_multiple_of(16)
            && MoeWgmmaSwiglu::fits(experts, inter, hidden, operands)
    }
}

impl Kernel for MoeWgmmaFp8Swiglu {
    fn launch_config(&self) -> LaunchConfig {
        persistent()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        MoeGroupedMmaFp8Swiglu::from(*self).reference_as(Self::NAME, ExpertActivation::SwiGlu, mem)
    }
}

impl Kernel for MoeWgmmaFp8Relu2 {
    fn launch_config(&self) -> LaunchConfig {
        persistent()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        MoeGroupedMmaFp8Swiglu::from(*self).reference_as(Self::NAME, ExpertActivation::Relu2, mem)
    }
}

impl Kernel for MoeWgmmaFp8Down {
    fn launch_config(&self) -> LaunchConfig {
        persistent()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        MoeGroupedMmaFp8Down::from(*self).reference_as(Self::NAME, mem)
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use metrale_core::fp8::f32_to_e4m3;

    use super::*;
    use crate::ops::testing::*;
    use crate::ops::{Fp8DequantBf16, MOE_MAX_EXPERTS, MoeGemmRelu2, group_by_expert};

    /// The FP8 grouped forms' references are the dequantise-then-BF16 path's bits: each of the
    /// six against [`Fp8DequantBf16`] followed by its BF16 form, over 37 rows of 5 experts (k = 2,
    /// one empty slot), widths off 16 and 128, both scale layouts, both activations.
    #[test]
    fn fp8_grouped_forms_are_the_bf16_forms_over_the_dequantised_stacks() {
        let (rows, experts, k, hidden, inter) = (37usize, 5usize, 2usize, 136usize, 40usize);
        let mut ids: Vec<i32> = (0..rows * k)
            .map(|a| ((a * 3 + a / k) % experts) as i32)
            .collect();
        ids[7] = -1;
        let (offsets, sorted) = group_by_expert(&ids, experts);
        for (activation, row_shift) in [
            (ExpertActivation::SwiGlu, 0u32),
            (ExpertActivation::SwiGlu, 7),
            (ExpertActivation::Relu2, 0),
        ] {
            let per = activation.rows_per_column();
            let (n1, n2) = (experts * per * inter, experts * hidden);
            let codes = |seed: u64, n: usize| -> Vec<u8> {
                uniform(seed, n, 300.0)
                    .iter()
                    .map(|&v| f32_to_e4m3(v))
                    .collect()
            };
            let scales = |seed: u64, n: usize, cols: usize| -> Vec<f32> {
                uniform(seed, n.div_ceil(1 << row_shift) * cols.div_ceil(128), 1.0)
                    .iter()
                    .map(|v| (1.5 + v) / (300.0 * (cols as f32).sqrt()))
                    .collect()
            };
            let mut m = FlatMemory::new();
            let x = m.put(&bf16s(&uniform(1, rows * hidden, 1.0)));
            let (c1, s1) = (m.put(&codes(2, n1 * hidden)), m.put(&scales(3, n1, hidden)));
            let (c2, s2) = (m.put(&codes(4, n2 * inter)), m.put(&scales(5, n2, inter)));
            let (op, sp) = (m.put(&offsets), m.put(&sorted));
            let n = rows * k;
            let act = m.put(&vec![bf16::ZERO; n * inter]);
            let act_ref = m.put(&vec![bf16::ZERO; n * inter]);
            let y = m.put(&vec![bf16::ZERO; n * hidden]);
            let y_ref = m.put(&vec![bf16::ZERO; n * hidden]);
            let w1 = m.put(&vec![bf16::ZERO; n1 * hidden]);
            let w2 = m.put(&vec![bf16::ZERO; n2 * inter]);
            let dequant = |w, scales, out, n: usize, cols: usize| Fp8DequantBf16 {
                out,
                w,
                scales,
                n: n as u32,
                k: cols as u32,
                row_shift,
            };
            dequant(c1, s1, w1, n1, hidden).reference(&mut m).unwrap();
            dequant(c2, s2, w2, n2, inter).reference(&mut m).unwrap();
            let bf16_first = MoeGemmSwiglu {
                act: act_ref,
                x,
                w: w1,
                offsets: op,
                sorted: sp,
                k: k as u32,
                experts: experts as u32,
                inter: inter as u32,
                hidden: hidden as u32,
            };
            match activation {
                ExpertActivation::SwiGlu => bf16_first.reference(&mut m).unwrap(),
                ExpertActivation::Relu2 => {
                    MoeGemmRelu2::from(bf16_first).reference(&mut m).unwrap()
                }
            }
            let want_act: Vec<bf16> = m.get(act_ref, n * inter);
            let first = MoeGroupedMmaFp8Swiglu {
                act,
                x,
                w: c1,
                scales: s1,
                offsets: op,
                sorted: sp,
                k: k as u32,
                experts: experts as u32,
                inter: inter as u32,
                hidden: hidden as u32,
                row_shift,
            };
            let forms: [&dyn Fn(&mut FlatMemory); 2] = match activation {
                ExpertActivation::SwiGlu => [&|m| first.reference(m).unwrap(), &|m| {
                    MoeWgmmaFp8Swiglu::from(first).reference(m).unwrap()
                }],
                ExpertActivation::Relu2 => [
                    &|m| MoeGroupedMmaFp8Relu2::from(first).reference(m).unwrap(),
                    &|m| MoeWgmmaFp8Relu2::from(first).reference(m).unwrap(),
                ],
            };
            for form in forms {
                crate::host::store(&mut m, act, &vec![bf16::ZERO; n * inter]).unwrap();
                form(&mut m);
                assert_eq!(m.get::<bf16>(act, n * inter), want_act, "{activation:?}");
            }
            let bf16_down = MoeGemmDown {
                y: y_ref,
                act: act_ref,
                w: w2,
                offsets: op,
                sorted: sp,
                experts: experts as u32,
                hidden: hidden as u32,
                inter: inter as u32,
            };
            bf16_down.reference(&mut m).unwrap();
            let down = MoeGroupedMmaFp8Down {
                y,
                act: act_ref,
                w: c2,
                scales: s2,
                offsets: op,
                sorted: sp,
                experts: experts as u32,
                hidden: hidden as u32,
                inter: inter as u32,
                row_shift,
            };
            let want_y: Vec<bf16> = m.get(y_ref, n * hidden);
            assert!(want_y.iter().any(|v| v.to_f32() != 0.0));
            down.reference(&mut m).unwrap();
            assert_eq!(m.get::<bf16>(y, n * hidden), want_y);
            crate::host::store(&mut m, y, &vec![bf16::ZERO; n * hidden]).unwrap();
            MoeWgmmaFp8Down::from(down).reference(&mut m).unwrap();
            assert_eq!(m.get::<bf16>(y, n * hidden), want_y);
        }
    }

    #[test]
    fn launches_are_the_bf16_forms_and_fit_widths_of_sixteen() {
        let z = DevicePtr::NULL;
        let first = MoeGroupedMmaFp8Swiglu {
            act: z,
            x: z,
            w: z,
            scales: z,
            offsets: z,
            sorted: z,
            k: 8,
            experts: 128,
            inter: 768,
            hidden: 2048,
            row_shift: 7,
        };
        assert_eq!(first.launch_config().grid, [12, 128, 1]);
        assert_eq!(
            MoeGroupedMmaFp8Relu2::from(first).launch_config(),
            crate::ops::MoeGroupedMmaRelu2::from(MoeGemmRelu2::from(first.bf16())).launch_config()
        );
        let a = DevicePtr(4096);
        assert!(MoeWgmmaFp8Swiglu::fits(128, 768, 2048, &[a, a]));
        assert!(!MoeWgmmaFp8Swiglu::fits(128, 72, 2048, &[a]));
        assert!(!MoeWgmmaFp8Swiglu::fits(
            128,
            768,
            2056 - 8,
            &[DevicePtr(4104)]
        ));
        let c = persistent();
        assert!(c.shared_mem_bytes + 2 * 4 * (MOE_MAX_EXPERTS + 1) <= 227 * 1024);
    }
}
