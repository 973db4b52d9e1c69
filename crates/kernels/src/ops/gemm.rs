// SPDX-License-Identifier: MIT OR Apache-2.0
//! Dense GEMM in HF Linear layout: `C[M, N] = A[M, K] * W[N, K]^T (+ bias)`.

use half::bf16;
use metrale_core::{DevicePtr, LaunchConfig};

use super::blocks_for;
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args, widen};
use crate::names;

kernel_args!(
    /// `C = A * W^T (+ bias)`, bf16 output.
    Gemm => names::gemm::GEMM_BF16 {
        /// bf16 `[m, n]`.
        c: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// bf16 `[n, k]` (a Linear weight).
        w: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C.
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length.
        k: u32,
    }
);

kernel_args!(
    /// `C = A * W^T (+ bias)`, f32 output (the LM head).
    GemmF32Out => names::gemm::GEMM_BF16_F32OUT {
        /// f32 `[m, n]`.
        c: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// bf16 `[n, k]`.
        w: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C.
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length.
        k: u32,
    }
);

kernel_args!(
    /// The same product for decode-sized `m` (at most [`GEMV_MAX_ROWS`]): a weight stream, one
    /// warp per output column.
    Gemv => names::gemv::GEMV_BF16 {
        /// bf16 `[m, n]`.
        c: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// bf16 `[n, k]`.
        w: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C (at most 8).
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length.
        k: u32,
    }
);

kernel_args!(
    /// [`Gemv`] with f32 output (the LM head at decode).
    GemvF32Out => names::gemv::GEMV_BF16_F32OUT {
        /// f32 `[m, n]`.
        c: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// bf16 `[n, k]`.
        w: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C (at most 8).
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length.
        k: u32,
    }
);

/// Most rows [`Gemv`] takes; larger `m` goes to [`Gemm`].
pub const GEMV_MAX_ROWS: u32 = 8;

/// The GEMV reference: the GEMM's, after checking `m`.
#[allow(clippy::too_many_arguments)]
fn gemv_reference(
    name: metrale_core::KernelName,
    mem: &dyn HostMemory,
    a: DevicePtr,
    w: DevicePtr,
    bias: DevicePtr,
    m: u32,
    n: u32,
    k: u32,
) -> Result<Vec<f32>, HostError> {
    if m > GEMV_MAX_ROWS {
        return Err(HostError::BadArgs {
            kernel: name,
            message: format!("m = {m} exceeds {GEMV_MAX_ROWS}"),
        });
    }
    reference(mem, a, w, bias, m as usize, n as usize, k as usize)
}

impl Kernel for Gemv {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(blocks_for(self.n.into(), 8), 256)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let c = gemv_reference(
            Self::NAME,
            mem,
            self.a,
            self.w,
            self.bias,
            self.m,
            self.n,
            self.k,
        )?;
        host::store_bf16(mem, self.c, &c)
    }
}

impl Kernel for GemvF32Out {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(blocks_for(self.n.into(), 8), 256)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let c = gemv_reference(
            Self::NAME,
            mem,
            self.a,
            self.w,
            self.bias,
            self.m,
            self.n,
            self.k,
        )?;
        host::store(mem, self.c, &c)
    }
}

fn launch(m: u32, n: u32) -> LaunchConfig {
    LaunchConfig {
        grid: [blocks_for(n.into(), 64), blocks_for(m.into(), 64), 1],
        block: [128, 1, 1],
        shared_mem_bytes: 0,
    }
}

/// `dot(a, w)` with eight independent accumulators, so the loop vectorises.
fn dot(a: &[f32], w: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for i in 0..8 {
            acc[i] += a[c * 8 + i] * w[c * 8 + i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        sum += a[i] * w[i];
    }
    sum
}

/// The reference: f32 accumulation of bf16 inputs, bias added before the single rounding, rows of
/// W split across threads.
fn reference(
    mem: &dyn HostMemory,
    a: DevicePtr,
    w: DevicePtr,
    bias: DevicePtr,
    m: usize,
    n: usize,
    k: usize,
) -> Result<Vec<f32>, HostError> {
    let a = host::load_bf16(mem, a, m * k)?;
    let w = host::view::<bf16>(mem, w, n * k)?;
    let bias = if bias == DevicePtr::NULL {
        None
    } else {
        Some(host::load_bf16(mem, bias, n)?)
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(n.div_ceil(64))
        .max(1);
    let per = n.div_ceil(threads);
    let mut out = vec![0f32; m * n];
    let columns: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (a, w, bias) = (&a, &w, &bias);
                s.spawn(move || {
                    let (lo, hi) = (t * per, ((t + 1) * per).min(n));
                    let mut part = vec![0f32; m * hi.saturating_sub(lo)];
                    let mut row = vec![0f32; k];
                    for j in lo..hi {
                        for (dst, src) in row.iter_mut().zip(&w[j * k..(j + 1) * k]) {
                            *dst = widen(*src);
                        }
                        let b = bias.as_ref().map_or(0.0, |b| b[j]);
                        for i in 0..m {
                            part[i * (hi - lo) + (j - lo)] = dot(&a[i * k..(i + 1) * k], &row) + b;
                        }
                    }
                    part
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("gemm worker panicked"))
            .collect()
    });
    for (t, part) in columns.iter().enumerate() {
        let (lo, hi) = (t * per, ((t + 1) * per).min(n));
        if hi <= lo {
            continue;
        }
        for i in 0..m {
            out[i * n + lo..i * n + hi].copy_from_slice(&part[i * (hi - lo)..(i + 1) * (hi - lo)]);
        }
    }
    Ok(out)
}

impl Kernel for Gemm {
    fn launch_config(&self) -> LaunchConfig {
        launch(self.m, self.n)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let c = reference(
            mem,
            self.a,
            self.w,
            self.bias,
            self.m as usize,
            self.n as usize,
            self.k as usize,
        )?;
        host::store_bf16(mem, self.c, &c)
    }
}

impl Kernel for GemmF32Out {
    fn launch_config(&self) -> LaunchConfig {
        launch(self.m, self.n)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let c = reference(
            mem,
            self.a,
            self.w,
            self.bias,
            self.m as usize,
            self.n as usize,
            self.k as usize,
        )?;
        host::store(mem, self.c, &c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    #[test]
    fn small_product_with_bias() {
        let mut mem = FlatMemory::new();
        // A = [[1, 2, 3], [4, 5, 6]], W = [[1, 0, 0], [0, 1, 0], [1, 1, 1], [0, 0, 2]]
        let a = mem.put(&bf16s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
        let w = mem.put(&bf16s(&[
            1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 2.0,
        ]));
        let bias = mem.put(&bf16s(&[0.5, 0.0, 0.0, -1.0]));
        let c = mem.put(&[0f32; 8]);
        GemmF32Out {
            c,
            a,
            w,
            bias,
            m: 2,
            n: 4,
            k: 3,
        }
        .reference(&mut mem)
        .unwrap();
        assert_eq!(
            mem.get::<f32>(c, 8),
            vec![1.5, 2.0, 6.0, 5.0, 4.5, 5.0, 15.0, 11.0]
        );
        let cb = mem.put(&bf16s(&[0.0; 8]));
        Gemm {
            c: cb,
            a,
            w,
            bias: DevicePtr::NULL,
            m: 2,
            n: 4,
            k: 3,
        }
        .reference(&mut mem)
        .unwrap();
        assert_eq!(
            f32s(&mem.get(cb, 8)),
            vec![1.0, 2.0, 6.0, 6.0, 4.0, 5.0, 15.0, 12.0]
        );
    }
}
