// SPDX-License-Identifier: MIT OR Apache-2.0
//! The decode experts: every selected expert of every row in one gate|up launch and one down
//! launch, each a weight stream in the manner of the GEMV's one-column-a-warp form.
//!
//! Bytes at batch 1 (Qwen3-30B-A3B: hidden 2048, expert width 768, k = 8): gate|up reads
//! 8 x 2 x 768 x 2048 x 2 B = 50.3 MB over 6144 warps of 8 KiB (about two waves of the H200's
//! 3168 resident GEMV warps), down reads 8 x 2048 x 768 x 2 B = 25.2 MB over 2048 warps of
//! 12 KiB (one partial wave: about 15 warps an SM); every warp keeps 4 KiB in flight, as the dense
//! GEMV does, and no weight byte is read twice. 75.5 MB a layer, 3.6 GB over 48 layers: 0.86 ms a
//! token at the H200's 4.19 TB/s.

use half::bf16;
use metrale_core::{DevicePtr, LaunchConfig};

use super::{
    ExpertActivation, add_shared, bad_args, check_experts, expert_act, expert_down, expert_of,
    shared_gates,
};
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;
use crate::ops::blocks_for;

kernel_args!(
    /// The selected experts' gate|up products with SwiGLU: for every assignment `a = r * k + s`
    /// of expert `e = ids[a]`, `act[a, j] = bf16(silu(g) * u)` of `g = x[r] . w[e, j]` and
    /// `u = x[r] . w[e, inter + j]`, each rounded to bf16 first (the bits of
    /// [`GemvSwiglu`](crate::ops::GemvSwiglu) on expert `e`'s slice, up to summation order). An
    /// assignment with no expert gets zeros. With a shared expert (`shared_w` not null) every
    /// row also takes it, in `ceil(shared_inter / inter)` extra slots of at most `inter` columns:
    /// `shared_act[r, c]` the same function of `shared_w`'s rows `c` and `shared_inter + c`.
    MoeGemvSwiglu => names::moe::MOE_GEMV_SWIGLU {
        /// bf16 `[rows * k, inter]`, one row per assignment.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// bf16 `[experts, 2 * inter, hidden]`: each expert's gate rows, then its up rows.
        w: DevicePtr,
        /// i32 `[rows, k]`: the router's choices.
        ids: DevicePtr,
        /// bf16 `[rows, shared_inter]`: the shared expert's activations; unused where `shared_w`
        /// is null.
        shared_act: DevicePtr,
        /// bf16 `[2 * shared_inter, hidden]`: the shared expert's gate rows, then its up rows;
        /// null for none.
        shared_w: DevicePtr,
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
        /// The shared expert's width (any; 0 where `shared_w` is null).
        shared_inter: u32,
    }
);

kernel_args!(
    /// The selected squared-ReLU experts' up products (Nemotron-H): for every assignment
    /// `a = r * k + s` of expert `e = ids[a]`, `act[a, j] = bf16(relu(u)^2)` of
    /// `u = x[r] . w[e, j]` rounded to bf16 first (the bits of a bf16 up product followed by
    /// [`Relu2`](crate::ops::Relu2), up to summation order). An assignment with no expert gets
    /// zeros. The shared expert's slots and [`MoeGemvSwiglu`]'s launch, one weight row a column.
    MoeGemvRelu2 => names::moe::MOE_GEMV_RELU2 {
        /// bf16 `[rows * k, inter]`, one row per assignment.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// bf16 `[experts, inter, hidden]`: each expert's up rows.
        w: DevicePtr,
        /// i32 `[rows, k]`: the router's choices.
        ids: DevicePtr,
        /// bf16 `[rows, shared_inter]`: the shared expert's activations; unused where `shared_w`
        /// is null.
        shared_act: DevicePtr,
        /// bf16 `[shared_inter, hidden]`: the shared expert's up rows (Nemotron-H's, ungated);
        /// null for none.
        shared_w: DevicePtr,
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
        /// The shared expert's width (0 where `shared_w` is null).
        shared_inter: u32,
    }
);

same_args!(MoeGemvSwiglu <-> MoeGemvRelu2 {
    act, x, w, ids, shared_act, shared_w, rows, k, experts, inter, hidden, shared_inter
});

kernel_args!(
    /// The selected experts' down products, weighted and added, and the shared expert's behind
    /// its gate: `out[r, h] = bf16(sum over slots s of weights[r, s] * (act[r * k + s] .
    /// w[ids[r, s], h]) + g_r * (shared_act[r] . shared_w[h]) + g_r * shared[r, h])`, in f32
    /// throughout and added in that order (the expert outputs, the shared one computed here
    /// included, are not rounded before they are weighted and added; slots with no expert add
    /// nothing; a null `shared_w` or `shared` adds no term). The shared expert comes either as
    /// slots of this launch (`shared_w`, after [`MoeGemvSwiglu`]'s shared slots) or as its
    /// output from the dense products (`shared`, bf16). bf16 out, as the dense down product: the
    /// residual add + norm after the MLP takes it as it takes the dense MLP's output.
    MoeGemvDown => names::moe::MOE_GEMV_DOWN {
        /// bf16 `[rows, hidden]`.
        out: DevicePtr,
        /// bf16 `[rows * k, inter]`: [`MoeGemvSwiglu`]'s output.
        act: DevicePtr,
        /// bf16 `[experts, hidden, inter]`.
        w: DevicePtr,
        /// i32 `[rows, k]`.
        ids: DevicePtr,
        /// f32 `[rows, k]`.
        weights: DevicePtr,
        /// bf16 `[rows, hidden]`: the shared expert's output (Qwen2-MoE), or null for none.
        shared: DevicePtr,
        /// f32 `[rows]`: the shared expert's gate logits, `g_r = sigmoid(shared_gate[r])`; null
        /// for `g_r = 1`.
        shared_gate: DevicePtr,
        /// bf16 `[rows, shared_inter]`: the shared expert's activations; unused where `shared_w`
        /// is null.
        shared_act: DevicePtr,
        /// bf16 `[hidden, shared_inter]`: the shared expert's down weight, or null.
        shared_w: DevicePtr,
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
        /// The shared expert's width (0 where `shared_w` is null).
        shared_inter: u32,
    }
);

/// Warps (output columns) of a decode expert block (`WARPS` in moe.cu).
const COLUMNS_PER_BLOCK: u32 = 8;

impl MoeGemvSwiglu {
    /// The shared expert's slots a row: its columns in pieces of `inter` (none without one).
    pub fn shared_slots(&self) -> u32 {
        match self.shared_w.is_null() || self.inter == 0 {
            true => 0,
            false => self.shared_inter.div_ceil(self.inter),
        }
    }
}

impl Kernel for MoeGemvSwiglu {
    /// One block per slot (the assignments, then each row's shared-expert slots) and 8 columns
    /// (grid x: slots, so that the blocks launched together read the same columns of the
    /// experts the rows share).
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                (self.rows * (self.k + self.shared_slots())).max(1),
                self.inter.div_ceil(COLUMNS_PER_BLOCK).max(1),
                1,
            ],
            block: [256, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        first_reference(Self::NAME, self, ExpertActivation::SwiGlu, mem)
    }
}

impl Kernel for MoeGemvRelu2 {
    /// [`MoeGemvSwiglu`]'s launch.
    fn launch_config(&self) -> LaunchConfig {
        MoeGemvSwiglu::from(*self).launch_config()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        first_reference(
            Self::NAME,
            &MoeGemvSwiglu::from(*self),
            ExpertActivation::Relu2,
            mem,
        )
    }
}

/// The decode first product's reference for either activation (`a`'s fields are both entries'),
/// errors named `name`.
fn first_reference(
    name: metrale_core::KernelName,
    a: &MoeGemvSwiglu,
    activation: ExpertActivation,
    mem: &mut dyn HostMemory,
) -> Result<(), HostError> {
    check_experts(name, a.experts, a.k)?;
    let (rows, k, experts) = (a.rows as usize, a.k as usize, a.experts as usize);
    let (inter, hidden) = (a.inter as usize, a.hidden as usize);
    let ids = host::load::<i32>(mem, a.ids, rows * k)?;
    let x = host::load_bf16(mem, a.x, rows * hidden)?;
    let w = host::view::<bf16>(
        mem,
        a.w,
        experts * activation.rows_per_column() * inter * hidden,
    )?;
    let mut act = vec![0f32; rows * k * inter];
    for (i, out) in act
        .chunks_exact_mut(inter.max(1))
        .enumerate()
        .take(rows * k)
    {
        if let Some(e) = expert_of(ids[i], experts) {
            let xr = &x[i / k * hidden..(i / k + 1) * hidden];
            out.copy_from_slice(&expert_act(xr, &w, e, inter, hidden, activation));
        }
    }
    drop(w);
    host::store_bf16(mem, a.act, &act)?;
    if a.shared_w.is_null() {
        return Ok(());
    }
    // The shared expert: one expert of `shared_inter` columns every row takes.
    let si = a.shared_inter as usize;
    let w = host::view::<bf16>(mem, a.shared_w, activation.rows_per_column() * si * hidden)?;
    let shared: Vec<f32> = x
        .chunks_exact(hidden.max(1))
        .take(rows)
        .flat_map(|xr| expert_act(xr, &w, 0, si, hidden, activation))
        .collect();
    drop(w);
    host::store_bf16(mem, a.shared_act, &shared)
}

impl Kernel for MoeGemvDown {
    /// One block per 8 output columns of a row, rows in grid y.
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.hidden.into(), COLUMNS_PER_BLOCK).max(1),
                self.rows.max(1),
                1,
            ],
            block: [256, 1, 1],
            shared_mem_bytes: 0,
        }
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
        let w = host::view::<bf16>(mem, self.w, experts * hidden * inter)?;
        let mut out = vec![0f32; rows * hidden];
        for (r, row) in out.chunks_exact_mut(hidden.max(1)).enumerate().take(rows) {
            for s in 0..k {
                let a = r * k + s;
                let Some(e) = expert_of(ids[a], experts) else {
                    continue;
                };
                let y = expert_down(&act[a * inter..(a + 1) * inter], &w, e, hidden, inter);
                for (o, y) in row.iter_mut().zip(y) {
                    *o += weights[a] * y;
                }
            }
        }
        drop(w);
        if !self.shared_w.is_null() {
            // The shared expert's slots: its down product in f32, unrounded, behind its gate.
            let si = self.shared_inter as usize;
            let gates = shared_gates(mem, self.shared_gate, rows)?;
            let act = host::load_bf16(mem, self.shared_act, rows * si)?;
            let w = host::view::<bf16>(mem, self.shared_w, hidden * si)?;
            for ((row, a), g) in out
                .chunks_exact_mut(hidden.max(1))
                .zip(act.chunks_exact(si.max(1)))
                .zip(gates)
            {
                for (o, y) in row.iter_mut().zip(expert_down(a, &w, 0, hidden, si)) {
                    *o = g.mul_add(y, *o);
                }
            }
        }
        add_shared(mem, &mut out, self.shared, self.shared_gate, hidden)?;
        host::store_bf16(mem, self.out, &out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::round_bf16;
    use crate::ops::activation::silu;
    use crate::ops::testing::*;

    /// Random bf16-exact values.
    fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        f32s(&bf16s(&uniform(seed, n, scale)))
    }

    /// The dense SwiGLU MLP of one expert on one row, naively: f32 sums, gate and up rounded to
    /// bf16, the activation rounded to bf16, the down product in f32.
    fn dense_mlp(x: &[f32], gate_up: &[f32], down: &[f32], inter: usize) -> Vec<f32> {
        let hidden = x.len();
        let dot = |w: &[f32], v: &[f32]| w.iter().zip(v).map(|(a, b)| a * b).sum::<f32>();
        let act: Vec<f32> = (0..inter)
            .map(|j| {
                let g = round_bf16(dot(&gate_up[j * hidden..(j + 1) * hidden], x));
                let u = round_bf16(dot(
                    &gate_up[(inter + j) * hidden..(inter + j + 1) * hidden],
                    x,
                ));
                round_bf16(silu(g) * u)
            })
            .collect();
        (0..hidden)
            .map(|h| dot(&down[h * inter..(h + 1) * inter], &act))
            .collect()
    }

    #[test]
    fn the_decode_experts_are_the_weighted_sum_of_dense_mlps() {
        // 3 rows, 5 experts, 2 slots each (one empty), widths that are not powers of two.
        let (rows, experts, k, hidden, inter) = (3usize, 5usize, 2usize, 24usize, 10usize);
        let x = values(1, rows * hidden, 1.0);
        let gate_up = values(2, experts * 2 * inter * hidden, 0.4);
        let down = values(3, experts * hidden * inter, 0.4);
        let ids = [4i32, 0, 2, 2 + 5, 1, 4];
        let weights = [0.7f32, 0.3, 1.0, 0.9, 0.25, 0.5];
        let mut m = FlatMemory::new();
        let (xp, wgu, wd) = (
            m.put(&bf16s(&x)),
            m.put(&bf16s(&gate_up)),
            m.put(&bf16s(&down)),
        );
        let (idp, wp) = (m.put(&ids), m.put(&weights));
        let act = m.put(&bf16s(&vec![9.0; rows * k * inter]));
        let out = m.put(&bf16s(&vec![9.0; rows * hidden]));
        let (rows_u, k_u) = (rows as u32, k as u32);
        MoeGemvSwiglu {
            shared_act: DevicePtr::NULL,
            shared_w: DevicePtr::NULL,
            shared_inter: 0,
            act,
            x: xp,
            w: wgu,
            ids: idp,
            rows: rows_u,
            k: k_u,
            experts: experts as u32,
            inter: inter as u32,
            hidden: hidden as u32,
        }
        .reference(&mut m)
        .unwrap();
        // The empty slot (an id past the experts) has a zero activation.
        let acts = f32s(&m.get(act, rows * k * inter));
        assert!(acts[3 * inter..4 * inter].iter().all(|&v| v == 0.0));
        MoeGemvDown {
            shared_act: DevicePtr::NULL,
            shared_w: DevicePtr::NULL,
            shared_inter: 0,
            out,
            act,
            w: wd,
            ids: idp,
            weights: wp,
            shared: DevicePtr::NULL,
            shared_gate: DevicePtr::NULL,
            rows: rows_u,
            k: k_u,
            experts: experts as u32,
            hidden: hidden as u32,
            inter: inter as u32,
        }
        .reference(&mut m)
        .unwrap();
        let got = f32s(&m.get(out, rows * hidden));
        for r in 0..rows {
            let xr = &x[r * hidden..(r + 1) * hidden];
            let mut want = vec![0f32; hidden];
            for s in 0..k {
                let Ok(e) = usize::try_from(ids[r * k + s]) else {
                    continue;
                };
                if e >= experts {
                    continue;
                }
                let y = dense_mlp(
                    xr,
                    &gate_up[e * 2 * inter * hidden..(e + 1) * 2 * inter * hidden],
                    &down[e * hidden * inter..(e + 1) * hidden * inter],
                    inter,
                );
                for (w, y) in want.iter_mut().zip(y) {
                    *w += weights[r * k + s] * y;
                }
            }
            for h in 0..hidden {
                let (g, w) = (got[r * hidden + h], want[h]);
                assert!(
                    (g - w).abs() <= 1e-5 + w.abs() / 128.0,
                    "row {r} column {h}: {g} vs {w}"
                );
            }
        }
    }

    #[test]
    fn the_squared_relu_experts_are_the_weighted_sum_of_dense_relu2_mlps() {
        // Nemotron-H's experts: up, relu(.)^2, down, no gate; 2 rows, 4 experts, 3 slots (one
        // empty), negative up values included (relu clears them).
        let (rows, experts, k, hidden, inter) = (2usize, 4usize, 3usize, 24usize, 10usize);
        let x = values(21, rows * hidden, 1.0);
        let up = values(22, experts * inter * hidden, 0.4);
        let down = values(23, experts * hidden * inter, 0.4);
        let ids = [3i32, 0, -1, 1, 3, 2];
        let weights = [0.5f32, 0.25, 0.75, 1.0, 0.125, 0.375];
        let mut m = FlatMemory::new();
        let (xp, wu, wd) = (m.put(&bf16s(&x)), m.put(&bf16s(&up)), m.put(&bf16s(&down)));
        let (idp, wp) = (m.put(&ids), m.put(&weights));
        let act = m.put(&bf16s(&vec![9.0; rows * k * inter]));
        let out = m.put(&bf16s(&vec![9.0; rows * hidden]));
        let first = MoeGemvRelu2 {
            shared_act: DevicePtr::NULL,
            shared_w: DevicePtr::NULL,
            shared_inter: 0,
            act,
            x: xp,
            w: wu,
            ids: idp,
            rows: rows as u32,
            k: k as u32,
            experts: experts as u32,
            inter: inter as u32,
            hidden: hidden as u32,
        };
        first.reference(&mut m).unwrap();
        assert_eq!(
            first.launch_config(),
            MoeGemvSwiglu::from(first).launch_config()
        );
        MoeGemvDown {
            shared_act: DevicePtr::NULL,
            shared_w: DevicePtr::NULL,
            shared_inter: 0,
            out,
            act,
            w: wd,
            ids: idp,
            weights: wp,
            shared: DevicePtr::NULL,
            shared_gate: DevicePtr::NULL,
            rows: rows as u32,
            k: k as u32,
            experts: experts as u32,
            hidden: hidden as u32,
            inter: inter as u32,
        }
        .reference(&mut m)
        .unwrap();
        let dot = |w: &[f32], v: &[f32]| w.iter().zip(v).map(|(a, b)| a * b).sum::<f32>();
        let (acts, got) = (
            f32s(&m.get(act, rows * k * inter)),
            f32s(&m.get(out, rows * hidden)),
        );
        let mut negative = 0;
        for r in 0..rows {
            let xr = &x[r * hidden..(r + 1) * hidden];
            let mut want = vec![0f32; hidden];
            for s in 0..k {
                let a = r * k + s;
                let Ok(e) = usize::try_from(ids[a]) else {
                    assert!(acts[a * inter..(a + 1) * inter].iter().all(|&v| v == 0.0));
                    continue;
                };
                let h: Vec<f32> = (0..inter)
                    .map(|j| {
                        let row = (e * inter + j) * hidden;
                        let u = round_bf16(dot(&up[row..row + hidden], xr));
                        negative += usize::from(u < 0.0);
                        round_bf16(u.max(0.0) * u.max(0.0))
                    })
                    .collect();
                assert_eq!(acts[a * inter..(a + 1) * inter], h[..], "assignment {a}");
                for (o, row) in want.iter_mut().zip(0..hidden) {
                    let d = (e * hidden + row) * inter;
                    *o += weights[a] * dot(&down[d..d + inter], &h);
                }
            }
            for h in 0..hidden {
                let (g, w) = (got[r * hidden + h], want[h]);
                assert!(
                    (g - w).abs() <= 1e-5 + w.abs() / 128.0,
                    "row {r} column {h}: {g} vs {w}"
                );
            }
        }
        assert!(negative > 0, "some up values are negative");
    }

    #[test]
    fn decode_launches_cover_every_assignment_and_column() {
        // Qwen3-30B-A3B at batch 1: 8 assignments x 96 column groups, then 256 blocks of 8 outputs.
        let p = DevicePtr::NULL;
        let gu = MoeGemvSwiglu {
            shared_act: DevicePtr::NULL,
            shared_w: DevicePtr::NULL,
            shared_inter: 0,
            act: p,
            x: p,
            w: p,
            ids: p,
            rows: 1,
            k: 8,
            experts: 128,
            inter: 768,
            hidden: 2048,
        };
        assert_eq!(gu.launch_config().grid, [8, 96, 1]);
        assert_eq!(
            MoeGemvSwiglu { inter: 37, ..gu }.launch_config().grid,
            [8, 5, 1]
        );
        let down = MoeGemvDown {
            shared_act: DevicePtr::NULL,
            shared_w: DevicePtr::NULL,
            shared_inter: 0,
            out: p,
            act: p,
            w: p,
            ids: p,
            weights: p,
            shared: p,
            shared_gate: p,
            rows: 4,
            k: 8,
            experts: 128,
            hidden: 2048,
            inter: 768,
        };
        assert_eq!(down.launch_config().grid, [256, 4, 1]);
        assert_eq!(MoeGemvDown::from_args(&down.args()).unwrap(), down);
        // A shared expert adds its slots a row: Qwen1.5-MoE-A2.7B's 5632 columns are four of
        // 1408, Nemotron-3-Nano's 3712 two of 1856, Qwen3.5's 512 one of 512; a width that is not
        // a multiple of the routed one ends in a partial slot.
        let with = |inter: u32, shared_inter: u32, k: u32| MoeGemvSwiglu {
            shared_w: DevicePtr(256),
            shared_inter,
            inter,
            k,
            ..gu
        };
        assert_eq!(with(1408, 5632, 4).launch_config().grid, [8, 176, 1]);
        assert_eq!(with(1856, 3712, 6).launch_config().grid, [8, 232, 1]);
        assert_eq!(with(512, 512, 8).launch_config().grid, [9, 64, 1]);
        assert_eq!(with(10, 25, 2).shared_slots(), 3);
        assert_eq!(
            MoeGemvSwiglu {
                rows: 3,
                ..with(10, 25, 2)
            }
            .launch_config()
            .grid,
            [15, 2, 1]
        );
        // A null weight means no shared expert, whatever its width says.
        assert_eq!(
            MoeGemvSwiglu {
                shared_w: DevicePtr::NULL,
                ..with(10, 25, 2)
            }
            .shared_slots(),
            0
        );
    }

    #[test]
    fn the_shared_expert_in_the_expert_launches_is_its_dense_mlp_behind_its_gate() {
        // 3 rows, 5 experts, 2 slots each (one empty), and a shared expert of 25 columns (two
        // slots of the routed 10 and a partial one) behind a sigmoid gate (SwiGLU), then ungated
        // (squared ReLU, 15 columns).
        let (rows, experts, k, hidden, inter) = (3usize, 5usize, 2usize, 24usize, 10usize);
        let dot = |w: &[f32], v: &[f32]| w.iter().zip(v).map(|(a, b)| a * b).sum::<f32>();
        for (activation, si) in [
            (ExpertActivation::SwiGlu, 25usize),
            (ExpertActivation::Relu2, 15),
        ] {
            let per = activation.rows_per_column();
            let x = values(31, rows * hidden, 1.0);
            let first = values(32, experts * per * inter * hidden, 0.4);
            let down = values(33, experts * hidden * inter, 0.4);
            let shared_first = values(34, per * si * hidden, 0.4);
            let shared_down = values(35, hidden * si, 0.4);
            let ids = [4i32, 0, 2, -1, 1, 4];
            let weights = [0.7f32, 0.3, 1.0, 0.9, 0.25, 0.5];
            let gate_logits = [0.5f32, -2.0, 3.0];
            let gated = activation == ExpertActivation::SwiGlu;
            let mut m = FlatMemory::new();
            let (xp, wf, wd) = (
                m.put(&bf16s(&x)),
                m.put(&bf16s(&first)),
                m.put(&bf16s(&down)),
            );
            let (sf, sd) = (m.put(&bf16s(&shared_first)), m.put(&bf16s(&shared_down)));
            let (idp, wp, gp) = (m.put(&ids), m.put(&weights), m.put(&gate_logits));
            let act = m.put(&bf16s(&vec![9.0; rows * k * inter]));
            let shared_act = m.put(&bf16s(&vec![9.0; rows * si]));
            let out = m.put(&bf16s(&vec![9.0; rows * hidden]));
            let gate_up = MoeGemvSwiglu {
                act,
                x: xp,
                w: wf,
                ids: idp,
                shared_act,
                shared_w: sf,
                rows: rows as u32,
                k: k as u32,
                experts: experts as u32,
                inter: inter as u32,
                hidden: hidden as u32,
                shared_inter: si as u32,
            };
            match activation {
                ExpertActivation::SwiGlu => gate_up.reference(&mut m).unwrap(),
                ExpertActivation::Relu2 => MoeGemvRelu2::from(gate_up).reference(&mut m).unwrap(),
            }
            MoeGemvDown {
                out,
                act,
                w: wd,
                ids: idp,
                weights: wp,
                shared: DevicePtr::NULL,
                shared_gate: if gated { gp } else { DevicePtr::NULL },
                shared_act,
                shared_w: sd,
                rows: rows as u32,
                k: k as u32,
                experts: experts as u32,
                hidden: hidden as u32,
                inter: inter as u32,
                shared_inter: si as u32,
            }
            .reference(&mut m)
            .unwrap();
            // One expert's MLP on one row: products rounded to bf16, the activation rounded to
            // bf16, the down product in f32.
            let mlp = |xr: &[f32], w1: &[f32], w2: &[f32], width: usize| -> Vec<f32> {
                let h: Vec<f32> = (0..width)
                    .map(|j| {
                        let p = |row: usize| round_bf16(dot(&w1[row * hidden..][..hidden], xr));
                        round_bf16(match activation {
                            ExpertActivation::SwiGlu => silu(p(j)) * p(width + j),
                            ExpertActivation::Relu2 => p(j).max(0.0).powi(2),
                        })
                    })
                    .collect();
                (0..hidden)
                    .map(|o| dot(&w2[o * width..][..width], &h))
                    .collect()
            };
            let got = f32s(&m.get(out, rows * hidden));
            let acts = f32s(&m.get(shared_act, rows * si));
            for r in 0..rows {
                let xr = &x[r * hidden..(r + 1) * hidden];
                let mut want = vec![0f32; hidden];
                for s in 0..k {
                    let Ok(e) = usize::try_from(ids[r * k + s]) else {
                        continue;
                    };
                    let w1 = &first[e * per * inter * hidden..(e + 1) * per * inter * hidden];
                    let w2 = &down[e * hidden * inter..(e + 1) * hidden * inter];
                    for (o, y) in want.iter_mut().zip(mlp(xr, w1, w2, inter)) {
                        *o += weights[r * k + s] * y;
                    }
                }
                let g = match gated {
                    true => 1.0 / (1.0 + (-gate_logits[r]).exp()),
                    false => 1.0,
                };
                for (o, y) in want
                    .iter_mut()
                    .zip(mlp(xr, &shared_first, &shared_down, si))
                {
                    *o += g * y;
                }
                assert!(acts[r * si..(r + 1) * si].iter().all(|&v| v != 9.0));
                for h in 0..hidden {
                    let (g, w) = (got[r * hidden + h], want[h]);
                    assert!(
                        (g - w).abs() <= 1e-5 + w.abs() / 128.0,
                        "{activation:?} row {r} column {h}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
