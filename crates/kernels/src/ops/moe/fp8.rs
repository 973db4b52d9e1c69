// SPDX-License-Identifier: MIT OR Apache-2.0
//! The decode experts over FP8 (E4M3) expert stacks (`moe_fp8.cu`): [`MoeGemvSwiglu`],
//! [`MoeGemvRelu2`] and [`MoeGemvDown`]'s launches and values with each weight `e4m3 × scale`,
//! dequantised in registers.
//!
//! A stack is one FP8 matrix in [`metrale_model_weights::Fp8Tensor`]'s form: the gate|up stack
//! `[experts * 2 * inter, hidden]` (each expert's gate rows, then its up rows), the squared-ReLU
//! up stack `[experts * inter, hidden]`, the down stack `[experts * hidden, inter]`, e4m3 bytes
//! row-major with f32 scales `[ceil(rows / 2^row_shift), ceil(cols / 128)]`: 128 x 128 blocks
//! (`row_shift` 7, where every expert's rows are whole blocks) or a scale per row and 128
//! columns (`row_shift` 0, any width). FP8 experts take no shared-expert slots: a shared expert
//! runs through the dense products and joins in the down launch's epilogue (`shared`).
//!
//! Bytes at batch 1 (Qwen3-30B-A3B, 128 x 128 blocks): gate|up reads 8 x 1536 x 2048 B = 25.2 MB
//! and 8 x 12 x 16 scales, down 8 x 2048 x 768 B = 12.6 MB and 8 x 16 x 6 scales: 37.8 MB a
//! layer, 1.81 GB over 48 layers, half the BF16 entries' 3.6 GB.
//!
//! The references dequantise each selected expert's rows in f32 (the kernels' register values),
//! take each dot as [`GemvFp8`](crate::ops::GemvFp8)'s reference does, and otherwise compute what
//! the BF16 entries' references compute.

use metrale_core::fp8::e4m3_to_f32;
use metrale_core::{DevicePtr, KernelName, LaunchConfig};

use super::{ExpertActivation, add_shared, bad_args, check_experts, expert_of};
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;
use crate::ops::{FP8_SCALE_COLS, MoeGemvDown, MoeGemvSwiglu};

kernel_args!(
    /// [`MoeGemvSwiglu`] over an e4m3 gate|up stack: for every assignment `a = r * k + s` of
    /// expert `e = ids[a]`, `act[a, j] = bf16(silu(g) * u)` of `g` and `u` the dots of `x[r]`
    /// with the dequantised rows `e * 2 * inter + j` and `e * 2 * inter + inter + j`, each rounded
    /// to bf16 first. An assignment with no expert gets zeros. No shared-expert slots.
    MoeGemvFp8Swiglu => names::moe_fp8::MOE_GEMV_FP8_SWIGLU {
        /// bf16 `[rows * k, inter]`, one row per assignment.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// e4m3 `[experts * 2 * inter, hidden]`: each expert's gate rows, then its up rows.
        w: DevicePtr,
        /// f32 `[ceil(experts * 2 * inter / 2^row_shift), ceil(hidden / 128)]`.
        scales: DevicePtr,
        /// i32 `[rows, k]`: the router's choices.
        ids: DevicePtr,
        /// Rows (tokens).
        rows: u32,
        /// Slots a row.
        k: u32,
        /// Experts in `w`.
        experts: u32,
        /// Each expert's width (its gate rows).
        inter: u32,
        /// The model's width.
        hidden: u32,
        /// log2 of the rows a scale covers: 7 (128 x 128 blocks) or 0 (a scale per row).
        row_shift: u32,
    }
);

kernel_args!(
    /// [`MoeGemvRelu2`](super::MoeGemvRelu2) over an e4m3 up stack (Nemotron-H's squared-ReLU
    /// experts): `act[a, j] = bf16(relu(u)^2)` of `u = x[r] . w[e * inter + j]` (dequantised)
    /// rounded to bf16 first. Otherwise [`MoeGemvFp8Swiglu`], one weight row a column.
    MoeGemvFp8Relu2 => names::moe_fp8::MOE_GEMV_FP8_RELU2 {
        /// bf16 `[rows * k, inter]`, one row per assignment.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// e4m3 `[experts * inter, hidden]`: each expert's up rows.
        w: DevicePtr,
        /// f32 `[ceil(experts * inter / 2^row_shift), ceil(hidden / 128)]`.
        scales: DevicePtr,
        /// i32 `[rows, k]`: the router's choices.
        ids: DevicePtr,
        /// Rows (tokens).
        rows: u32,
        /// Slots a row.
        k: u32,
        /// Experts in `w`.
        experts: u32,
        /// Each expert's width (its up rows).
        inter: u32,
        /// The model's width.
        hidden: u32,
        /// log2 of the rows a scale covers.
        row_shift: u32,
    }
);

same_args!(MoeGemvFp8Swiglu <-> MoeGemvFp8Relu2 {
    act, x, w, scales, ids, rows, k, experts, inter, hidden, row_shift
});

kernel_args!(
    /// [`MoeGemvDown`] over an e4m3 down stack: `out[r, h] = bf16(sum over slots s of
    /// weights[r, s] * (act[r * k + s] . w[ids[r, s] * hidden + h]) + g_r * shared[r, h])`, the
    /// weight rows dequantised, f32 throughout and added in that order (the expert outputs are not
    /// rounded; slots with no expert add nothing; a null `shared` adds no term; `g_r =
    /// sigmoid(shared_gate[r])`, 1 where null). bf16 out, as [`MoeGemvDown`].
    MoeGemvFp8Down => names::moe_fp8::MOE_GEMV_FP8_DOWN {
        /// bf16 `[rows, hidden]`.
        out: DevicePtr,
        /// bf16 `[rows * k, inter]`: the first product's output.
        act: DevicePtr,
        /// e4m3 `[experts * hidden, inter]`.
        w: DevicePtr,
        /// f32 `[ceil(experts * hidden / 2^row_shift), ceil(inter / 128)]`.
        scales: DevicePtr,
        /// i32 `[rows, k]`.
        ids: DevicePtr,
        /// f32 `[rows, k]`.
        weights: DevicePtr,
        /// bf16 `[rows, hidden]`: the shared expert's output from the dense products, or null.
        shared: DevicePtr,
        /// f32 `[rows]`: the shared expert's gate logits; null for `g_r = 1`.
        shared_gate: DevicePtr,
        /// Rows (tokens), at most 65535 (grid y).
        rows: u32,
        /// Slots a row.
        k: u32,
        /// Experts in `w`.
        experts: u32,
        /// The model's width.
        hidden: u32,
        /// Each expert's width.
        inter: u32,
        /// log2 of the rows a scale covers.
        row_shift: u32,
    }
);

impl MoeGemvFp8Swiglu {
    /// The BF16 entry's launch of the same shape (no shared slots).
    fn bf16_twin(&self) -> MoeGemvSwiglu {
        let p = DevicePtr::NULL;
        MoeGemvSwiglu {
            act: self.act,
            x: self.x,
            w: p,
            ids: self.ids,
            shared_act: p,
            shared_w: p,
            rows: self.rows,
            k: self.k,
            experts: self.experts,
            inter: self.inter,
            hidden: self.hidden,
            shared_inter: 0,
        }
    }
}

impl Kernel for MoeGemvFp8Swiglu {
    /// [`MoeGemvSwiglu`]'s launch without shared slots: one block per assignment and 8 columns.
    fn launch_config(&self) -> LaunchConfig {
        self.bf16_twin().launch_config()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        first_reference(Self::NAME, self, ExpertActivation::SwiGlu, mem)
    }
}

impl Kernel for MoeGemvFp8Relu2 {
    /// [`MoeGemvFp8Swiglu`]'s launch.
    fn launch_config(&self) -> LaunchConfig {
        MoeGemvFp8Swiglu::from(*self).launch_config()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        first_reference(
            Self::NAME,
            &MoeGemvFp8Swiglu::from(*self),
            ExpertActivation::Relu2,
            mem,
        )
    }
}

/// Rows `first .. first + n` of the FP8 matrix of `cols` columns at `w` with `scales`
/// (`2^row_shift` rows a scale), dequantised to f32: `e4m3 × scale`.
pub(super) fn fp8_rows(
    name: KernelName,
    mem: &dyn HostMemory,
    (w, scales): (DevicePtr, DevicePtr),
    (first, n, cols): (usize, usize, usize),
    row_shift: u32,
) -> Result<Vec<f32>, HostError> {
    if row_shift > 16 {
        return Err(bad_args(
            name,
            format!("row_shift {row_shift} is not a scale layout (0 or 7)"),
        ));
    }
    if n == 0 || cols == 0 {
        return Ok(Vec::new());
    }
    let kb = cols.div_ceil(FP8_SCALE_COLS as usize);
    let bytes = host::view::<u8>(mem, w.offset(first * cols), n * cols)?;
    let (s0, s1) = (first >> row_shift, (first + n - 1) >> row_shift);
    let s = host::load::<f32>(mem, scales.offset(s0 * kb * 4), (s1 - s0 + 1) * kb)?;
    Ok((0..n * cols)
        .map(|i| {
            let (r, c) = (first + i / cols, i % cols);
            e4m3_to_f32(bytes[i]) * s[((r >> row_shift) - s0) * kb + c / FP8_SCALE_COLS as usize]
        })
        .collect())
}

/// The f32 dot the FP8 GEMV's reference takes (in order, one accumulator).
fn dot(a: &[f32], w: &[f32]) -> f32 {
    a.iter().zip(w).map(|(x, y)| x * y).sum()
}

/// The decode first product's reference for either activation, errors named `name`.
fn first_reference(
    name: KernelName,
    a: &MoeGemvFp8Swiglu,
    activation: ExpertActivation,
    mem: &mut dyn HostMemory,
) -> Result<(), HostError> {
    check_experts(name, a.experts, a.k)?;
    let (rows, k, experts) = (a.rows as usize, a.k as usize, a.experts as usize);
    let (inter, hidden) = (a.inter as usize, a.hidden as usize);
    let per = activation.rows_per_column() * inter;
    let ids = host::load::<i32>(mem, a.ids, rows * k)?;
    let x = host::load_bf16(mem, a.x, rows * hidden)?;
    let mut act = vec![0f32; rows * k * inter];
    for (i, out) in act
        .chunks_exact_mut(inter.max(1))
        .enumerate()
        .take(rows * k)
    {
        let Some(e) = expert_of(ids[i], experts) else {
            continue;
        };
        let w = fp8_rows(
            name,
            mem,
            (a.w, a.scales),
            (e * per, per, hidden),
            a.row_shift,
        )?;
        let xr = &x[i / k * hidden..(i / k + 1) * hidden];
        let product = |r: usize| host::round_bf16(dot(xr, &w[r * hidden..(r + 1) * hidden]));
        for (j, o) in out.iter_mut().enumerate() {
            *o = match activation {
                ExpertActivation::SwiGlu => {
                    super::super::activation::silu(product(j)) * product(inter + j)
                }
                ExpertActivation::Relu2 => product(j).max(0.0).powi(2),
            };
        }
    }
    host::store_bf16(mem, a.act, &act)
}

impl Kernel for MoeGemvFp8Down {
    /// [`MoeGemvDown`]'s launch: one block per 8 output columns of a row, rows in grid y.
    fn launch_config(&self) -> LaunchConfig {
        let p = DevicePtr::NULL;
        MoeGemvDown {
            out: p,
            act: p,
            w: p,
            ids: p,
            weights: p,
            shared: p,
            shared_gate: p,
            shared_act: p,
            shared_w: p,
            rows: self.rows,
            k: self.k,
            experts: self.experts,
            hidden: self.hidden,
            inter: self.inter,
            shared_inter: 0,
        }
        .launch_config()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check_experts(Self::NAME, self.experts, self.k)?;
        if self.rows > u32::from(u16::MAX) {
            return Err(bad_args(
                Self::NAME,
                format!("rows = {} exceeds the grid's 65535", self.rows),
            ));
        }
        let (rows, k, experts) = (self.rows as usize, self.k as usize, self.experts as usize);
        let (hidden, inter) = (self.hidden as usize, self.inter as usize);
        let ids = host::load::<i32>(mem, self.ids, rows * k)?;
        let weights = host::load::<f32>(mem, self.weights, rows * k)?;
        let act = host::load_bf16(mem, self.act, rows * k * inter)?;
        let mut out = vec![0f32; rows * hidden];
        for (r, row) in out.chunks_exact_mut(hidden.max(1)).enumerate().take(rows) {
            for s in 0..k {
                let a = r * k + s;
                let Some(e) = expert_of(ids[a], experts) else {
                    continue;
                };
                let w = fp8_rows(
                    Self::NAME,
                    mem,
                    (self.w, self.scales),
                    (e * hidden, hidden, inter),
                    self.row_shift,
                )?;
                let ar = &act[a * inter..(a + 1) * inter];
                for (h, o) in row.iter_mut().enumerate() {
                    *o += weights[a] * dot(ar, &w[h * inter..(h + 1) * inter]);
                }
            }
        }
        add_shared(mem, &mut out, self.shared, self.shared_gate, hidden)?;
        host::store_bf16(mem, self.out, &out)
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use metrale_core::fp8::f32_to_e4m3;

    use super::*;
    use crate::ops::MoeGemvRelu2;
    use crate::ops::testing::*;

    /// An FP8 stack `[n, cols]` of random codes and its scales (`2^row_shift` rows a scale), and
    /// the same weights dequantised to f32.
    fn stack(seed: u64, n: usize, cols: usize, row_shift: u32) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let codes: Vec<u8> = uniform(seed, n * cols, 300.0)
            .iter()
            .map(|&v| f32_to_e4m3(v))
            .collect();
        let kb = cols.div_ceil(128);
        let scales: Vec<f32> = uniform(seed + 1, n.div_ceil(1 << row_shift) * kb, 1.0)
            .iter()
            .map(|v| (1.5 + v) / (300.0 * (cols as f32).sqrt()))
            .collect();
        let w = (0..n * cols)
            .map(|i| {
                let (r, c) = (i / cols, i % cols);
                e4m3_to_f32(codes[i]) * scales[(r >> row_shift) * kb + c / 128]
            })
            .collect();
        (codes, scales, w)
    }

    /// The FP8 decode experts compute the BF16 references' values over the dequantised weights
    /// wherever those are bf16-exact, and stay within f32 rounding of a naive f32 MLP anyway:
    /// 3 rows, 5 experts, 2 slots (one empty), widths that are not multiples of 16 or 128, both
    /// scale layouts, both activations, with and without a gated shared term.
    #[test]
    fn fp8_decode_experts_are_the_weighted_sum_of_the_dequantised_mlps() {
        let (rows, experts, k, hidden, inter) = (3usize, 5usize, 2usize, 136usize, 40usize);
        let ids = [4i32, 0, 2, 5, 1, 4];
        let weights = [0.7f32, 0.3, 1.0, 0.9, 0.25, 0.5];
        let gate_logits = [0.5f32, -2.0, 3.0];
        for (activation, row_shift, shared) in [
            (ExpertActivation::SwiGlu, 0u32, false),
            (ExpertActivation::SwiGlu, 7, true),
            (ExpertActivation::Relu2, 0, true),
        ] {
            let per = activation.rows_per_column();
            let x = f32s(&bf16s(&uniform(1, rows * hidden, 1.0)));
            let (c1, s1, w1) = stack(2, experts * per * inter, hidden, row_shift);
            let (c2, s2, w2) = stack(4, experts * hidden, inter, row_shift);
            let shared_out = f32s(&bf16s(&uniform(6, rows * hidden, 0.5)));
            let mut m = FlatMemory::new();
            let xp = m.put(&bf16s(&x));
            let (c1p, s1p, c2p, s2p) = (m.put(&c1), m.put(&s1), m.put(&c2), m.put(&s2));
            let (idp, wp, gp) = (m.put(&ids), m.put(&weights), m.put(&gate_logits));
            let sp = m.put(&bf16s(&shared_out));
            let act = m.put(&bf16s(&vec![9.0; rows * k * inter]));
            let out = m.put(&bf16s(&vec![9.0; rows * hidden]));
            let first = MoeGemvFp8Swiglu {
                act,
                x: xp,
                w: c1p,
                scales: s1p,
                ids: idp,
                rows: rows as u32,
                k: k as u32,
                experts: experts as u32,
                inter: inter as u32,
                hidden: hidden as u32,
                row_shift,
            };
            match activation {
                ExpertActivation::SwiGlu => first.reference(&mut m).unwrap(),
                ExpertActivation::Relu2 => MoeGemvFp8Relu2::from(first).reference(&mut m).unwrap(),
            }
            MoeGemvFp8Down {
                out,
                act,
                w: c2p,
                scales: s2p,
                ids: idp,
                weights: wp,
                shared: if shared { sp } else { DevicePtr::NULL },
                shared_gate: gp,
                rows: rows as u32,
                k: k as u32,
                experts: experts as u32,
                hidden: hidden as u32,
                inter: inter as u32,
                row_shift,
            }
            .reference(&mut m)
            .unwrap();
            let acts = f32s(&m.get::<bf16>(act, rows * k * inter));
            let got = f32s(&m.get::<bf16>(out, rows * hidden));
            let naive = |w: &[f32], v: &[f32]| w.iter().zip(v).map(|(a, b)| a * b).sum::<f32>();
            for r in 0..rows {
                let xr = &x[r * hidden..(r + 1) * hidden];
                let mut want = vec![0f32; hidden];
                for s in 0..k {
                    let a = r * k + s;
                    let Some(e) = expert_of(ids[a], experts) else {
                        assert!(acts[a * inter..(a + 1) * inter].iter().all(|&v| v == 0.0));
                        continue;
                    };
                    let h: Vec<f32> = (0..inter)
                        .map(|j| {
                            let p = |row: usize| {
                                let at = (e * per * inter + row) * hidden;
                                host::round_bf16(naive(&w1[at..at + hidden], xr))
                            };
                            host::round_bf16(match activation {
                                ExpertActivation::SwiGlu => {
                                    crate::ops::activation::silu(p(j)) * p(inter + j)
                                }
                                ExpertActivation::Relu2 => p(j).max(0.0).powi(2),
                            })
                        })
                        .collect();
                    assert_eq!(acts[a * inter..(a + 1) * inter], h[..], "assignment {a}");
                    for (o, col) in want.iter_mut().zip(0..hidden) {
                        let at = (e * hidden + col) * inter;
                        *o += weights[a] * naive(&w2[at..at + inter], &h);
                    }
                }
                if shared {
                    let g = 1.0 / (1.0 + (-gate_logits[r]).exp());
                    for (o, y) in want.iter_mut().zip(&shared_out[r * hidden..]) {
                        *o += g * y;
                    }
                }
                for h in 0..hidden {
                    let (g, w) = (got[r * hidden + h], want[h]);
                    assert!(
                        (g - w).abs() <= 1e-5 + w.abs() / 128.0,
                        "{activation:?} row_shift {row_shift} row {r} column {h}: {g} vs {w}"
                    );
                }
            }
        }
    }

    /// Where the dequantised weights are bf16-exact (scales powers of two), the FP8 entries'
    /// values are the BF16 entries' over those weights.
    #[test]
    fn fp8_experts_with_bf16_exact_weights_match_the_bf16_entries() {
        let (rows, experts, k, hidden, inter) = (2usize, 4usize, 2usize, 256usize, 128usize);
        let ids = [1i32, 3, 0, 1];
        let weights = [0.6f32, 0.4, 0.5, 0.5];
        let x = bf16s(&uniform(11, rows * hidden, 1.0));
        let codes = |seed, n| -> Vec<u8> {
            uniform(seed, n, 200.0)
                .iter()
                .map(|&v| f32_to_e4m3(v))
                .collect()
        };
        let (c1, c2) = (
            codes(12, experts * 2 * inter * hidden),
            codes(13, experts * hidden * inter),
        );
        // Powers of two per 128 x 128 block.
        let scale = |i: usize| 2f32.powi(-10 - (i % 3) as i32);
        let s1: Vec<f32> = (0..experts * 2 * inter / 128 * 2).map(scale).collect();
        let s2: Vec<f32> = (0..experts * hidden / 128).map(scale).collect();
        let deq = |c: &[u8], s: &[f32], cols: usize| -> Vec<bf16> {
            let kb = cols.div_ceil(128);
            c.iter()
                .enumerate()
                .map(|(i, &b)| {
                    let v = e4m3_to_f32(b) * s[((i / cols) >> 7) * kb + i % cols / 128];
                    let w = bf16::from_f32(v);
                    assert_eq!(f32::from(w), v, "bf16-exact");
                    w
                })
                .collect()
        };
        let (b1, b2) = (deq(&c1, &s1, hidden), deq(&c2, &s2, inter));
        let mut m = FlatMemory::new();
        let xp = m.put(&x);
        let (c1p, s1p, c2p, s2p) = (m.put(&c1), m.put(&s1), m.put(&c2), m.put(&s2));
        let (b1p, b2p) = (m.put(&b1), m.put(&b2));
        let (idp, wp) = (m.put(&ids), m.put(&weights));
        let zeros = bf16s(&vec![0.0; rows * k * inter]);
        let (act8, act16) = (m.put(&zeros), m.put(&zeros));
        let outs = bf16s(&vec![0.0; rows * hidden]);
        let (out8, out16) = (m.put(&outs), m.put(&outs));
        let p = DevicePtr::NULL;
        let (r, kk, e, i, h) = (
            rows as u32,
            k as u32,
            experts as u32,
            inter as u32,
            hidden as u32,
        );
        for relu2 in [false, true] {
            let fp8 = MoeGemvFp8Swiglu {
                act: act8,
                x: xp,
                w: c1p,
                scales: s1p,
                ids: idp,
                rows: r,
                k: kk,
                experts: e,
                inter: if relu2 { 2 * i } else { i },
                hidden: h,
                row_shift: 7,
            };
            let bf = MoeGemvSwiglu {
                act: act16,
                w: b1p,
                shared_act: p,
                shared_w: p,
                shared_inter: 0,
                ..fp8.bf16_twin()
            };
            if relu2 {
                // The gate|up stack read as squared-ReLU up rows of twice the width.
                let a8 = m.put(&bf16s(&vec![0.0; rows * k * 2 * inter]));
                let a16 = m.put(&bf16s(&vec![0.0; rows * k * 2 * inter]));
                MoeGemvFp8Relu2::from(MoeGemvFp8Swiglu { act: a8, ..fp8 })
                    .reference(&mut m)
                    .unwrap();
                MoeGemvRelu2::from(MoeGemvSwiglu { act: a16, ..bf })
                    .reference(&mut m)
                    .unwrap();
                let n = rows * k * 2 * inter;
                assert_eq!(m.get::<bf16>(a8, n), m.get::<bf16>(a16, n), "relu2");
                continue;
            }
            fp8.reference(&mut m).unwrap();
            bf.reference(&mut m).unwrap();
            let n = rows * k * inter;
            let (a8, a16) = (m.get::<bf16>(act8, n), m.get::<bf16>(act16, n));
            let same = a8.iter().zip(&a16).filter(|(a, b)| a == b).count();
            // Both sum the same exact products in f32, in other orders: a rounding apart at most.
            assert!(same * 10 >= n * 9, "{same} of {n} equal");
        }
        let down8 = MoeGemvFp8Down {
            out: out8,
            act: act16,
            w: c2p,
            scales: s2p,
            ids: idp,
            weights: wp,
            shared: p,
            shared_gate: p,
            rows: r,
            k: kk,
            experts: e,
            hidden: h,
            inter: i,
            row_shift: 7,
        };
        down8.reference(&mut m).unwrap();
        MoeGemvDown {
            out: out16,
            act: act16,
            w: b2p,
            ids: idp,
            weights: wp,
            shared: p,
            shared_gate: p,
            shared_act: p,
            shared_w: p,
            rows: r,
            k: kk,
            experts: e,
            hidden: h,
            inter: i,
            shared_inter: 0,
        }
        .reference(&mut m)
        .unwrap();
        let (o8, o16) = (
            f32s(&m.get::<bf16>(out8, rows * hidden)),
            f32s(&m.get::<bf16>(out16, rows * hidden)),
        );
        for (a, b) in o8.iter().zip(&o16) {
            assert!((a - b).abs() <= b.abs() / 128.0 + 1e-6, "{a} vs {b}");
        }
        assert_eq!(down8.launch_config().grid, [32, 2, 1]);
        assert_eq!(
            MoeGemvFp8Down::from_args(&down8.args()).unwrap(),
            down8,
            "the ABI round trip"
        );
    }

    #[test]
    fn fp8_decode_launches_are_the_bf16_ones() {
        // Qwen3-30B-A3B at batch 1: 8 assignments x 96 column groups, then 256 blocks of 8.
        let p = DevicePtr::NULL;
        let gu = MoeGemvFp8Swiglu {
            act: p,
            x: p,
            w: p,
            scales: p,
            ids: p,
            rows: 1,
            k: 8,
            experts: 128,
            inter: 768,
            hidden: 2048,
            row_shift: 7,
        };
        assert_eq!(gu.launch_config().grid, [8, 96, 1]);
        assert_eq!(
            MoeGemvFp8Relu2::from(gu).launch_config(),
            gu.launch_config()
        );
        let down = MoeGemvFp8Down {
            out: p,
            act: p,
            w: p,
            scales: p,
            ids: p,
            weights: p,
            shared: p,
            shared_gate: p,
            rows: 4,
            k: 8,
            experts: 128,
            hidden: 2048,
            inter: 768,
            row_shift: 7,
        };
        assert_eq!(down.launch_config().grid, [256, 4, 1]);
    }
}
