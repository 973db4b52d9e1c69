// SPDX-License-Identifier: MIT OR Apache-2.0
//! Dense bf16 GEMMs through cuBLASLt, for the shapes where NVIDIA's library beats our own kernels
//! (prefill and batched decode; batch-1 decode keeps the GEMV kernel).
//!
//! The product is the engine's Linear layout, row-major `C[M, N] = A[M, K] · W[N, K]^T (+ bias)`
//! with f32 accumulation. cuBLASLt is column-major, so the call computes the same memory as
//! `C'[N, M] = W'^T · A'` where `W'` is `W` read as a column-major `[K, N]` (leading dimension K)
//! and `A'` is `A` read as `[K, M]`: `transa = T`, `transb = N`, `m = N`, `n = M`, `k = K`. The
//! bias is a per-row vector of `C'`, which is cuBLASLt's `EPILOGUE_BIAS`.
//!
//! The FP8 form ([`BlasLt::matmul`] with [`Fp8Operands`]; CUDA 12.9+ on Hopper) has both operands
//! in e4m3 with f32 block scales, bf16 `C`, f32 accumulation. Under the mapping above the weight
//! is cuBLASLt's `A` (transposed: the "TN" form FP8 requires) and takes
//! `CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F`; its scales are `Fp8Tensor`'s
//! `[ceil(N / 128), ceil(K / 128)]` row-major, which is the column-major block grid of `W'`
//! (`[K, N]`) with leading dimension `ceil(K / 128)`. The activations are cuBLASLt's `B` and take
//! `CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F`, a scale per 128 elements of `A'`'s columns (the
//! inner dimension K) stored `[ceil(K / 128), M]` with M fastest (the layout `torch._scaled_mm`
//! requires of its 1x128 operand and hands cuBLASLt). Fast accumulation stays off (the
//! default). GPU-unverified (written without a device): check-kernels' `gemm_fp8` cases compare
//! it with the host reference.
//!
//! A plan (descriptors and the heuristic's first algorithm) is built once per shape and reused.
//! The heuristic is asked with cuBLASLt's default alignment assumptions (256-byte aligned
//! operands): callers pass allocation bases or 256-byte aligned offsets into them. With
//! `METRALE_BLASLT_LOG` set, each new plan's algorithm (id, tile, stages, split-k, ...) goes to
//! stderr, to set against the algorithms other callers of cuBLASLt get on the same shapes.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys;

use crate::GpuError;

/// Workspace cuBLASLt may use per call (its documented recommendation for Hopper is 32 MiB).
const WORKSPACE_BYTES: usize = 32 << 20;

fn check(status: lt::cublasStatus_t, what: &str) -> Result<(), GpuError> {
    if status == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Library(format!("cuBLASLt {what}: {status:?}")))
    }
}

/// The shape key of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    m: u32,
    n: u32,
    k: u32,
    bias: bool,
    f32_out: bool,
    /// Both operands e4m3 with block scales (bf16 out).
    fp8: bool,
}

/// The scales of an FP8 product's operands (device pointers, f32).
#[derive(Clone, Copy, Debug)]
pub struct Fp8Operands {
    /// The activations' scales, `[ceil(k / 128), m]` (VEC128_32F).
    pub a_scales: u64,
    /// The weight's scales, `[ceil(n / 128), ceil(k / 128)]` row-major (BLK128x128_32F).
    pub w_scales: u64,
}

struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    w_layout: lt::cublasLtMatrixLayout_t,
    a_layout: lt::cublasLtMatrixLayout_t,
    c_layout: lt::cublasLtMatrixLayout_t,
    algo: lt::cublasLtMatmulAlgo_t,
}

// SAFETY: the descriptors are plain host-side objects that cuBLASLt only reads during a call;
// they are created and destroyed under the owning BlasLt and used behind its mutex.
unsafe impl Send for Plan {}

/// A cuBLASLt handle, its workspace and the plans built so far.
pub struct BlasLt {
    handle: lt::cublasLtHandle_t,
    /// Products of fewer rows take the algorithm picked for this many ([`heuristic_rows`]).
    heuristic_m: u32,
    /// Each plan's algorithm on stderr (`METRALE_BLASLT_LOG=1`).
    log: bool,
    workspace: sys::CUdeviceptr,
    plans: Mutex<HashMap<Key, Plan>>,
}

// SAFETY: the handle is used from one thread at a time (calls take the plans mutex), and the
// workspace is device memory owned by this value.
unsafe impl Send for BlasLt {}
// SAFETY: as above; every use of the handle happens while holding `plans`.
unsafe impl Sync for BlasLt {}

impl BlasLt {
    /// Loads cuBLASLt and creates a handle and workspace in the current CUDA context, or `None`
    /// when the library is not installed. Products of fewer than `heuristic_m` rows take the
    /// algorithm the heuristic picks for `heuristic_m` rows ([`heuristic_rows`]; 0: their own).
    /// `log`: each plan's algorithm on stderr.
    pub fn new(heuristic_m: u32, log: bool) -> Result<Option<Self>, GpuError> {
        // SAFETY: only probes for the shared library.
        if !unsafe { lt::is_culib_present() } {
            return Ok(None);
        }
        let mut handle: lt::cublasLtHandle_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check(unsafe { lt::cublasLtCreate(&mut handle) }, "create")?;
        let mut workspace: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; the caller made the context current.
        let r = unsafe { sys::cuMemAlloc_v2(&mut workspace, WORKSPACE_BYTES) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(GpuError::Library(format!(
                "cuBLASLt workspace of {WORKSPACE_BYTES} bytes: {r:?}"
            )));
        }
        Ok(Some(BlasLt {
            handle,
            heuristic_m,
            log,
            workspace,
            plans: Mutex::new(HashMap::new()),
        }))
    }

    /// `scales`: the FP8 call's scale pointers, set on the descriptor before the heuristic is
    /// asked (each call sets its own again before its matmul).
    fn plan(&self, key: Key, scales: Option<Fp8Operands>) -> Result<Plan, GpuError> {
        let mut desc: lt::cublasLtMatmulDesc_t = std::ptr::null_mut();
        // SAFETY: all calls below pass pointers to locals that outlive the call and sizes that
        // match the attribute types cuBLASLt documents.
        unsafe {
            check(
                lt::cublasLtMatmulDescCreate(
                    &mut desc,
                    lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    lt::cudaDataType_t::CUDA_R_32F,
                ),
                "matmul descriptor",
            )?;
            let set = |attr, value: &i32| {
                check(
                    lt::cublasLtMatmulDescSetAttribute(
                        desc,
                        attr,
                        value as *const i32 as *const c_void,
                        4,
                    ),
                    "matmul attribute",
                )
            };
            set(
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &1, // CUBLAS_OP_T
            )?;
            set(
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                &0, // CUBLAS_OP_N
            )?;
            if key.bias {
                set(
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    &(lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS as i32),
                )?;
                set(
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    &(lt::cudaDataType_t::CUDA_R_16BF as i32),
                )?;
            }
            if key.fp8 {
                // cuBLASLt's A is the weight (128 x 128 blocks), its B the activations (a scale
                // per row and 128 columns): see the module comment.
                set(
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                    &(lt::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                        as i32),
                )?;
                set(
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                    &(lt::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                        as i32),
                )?;
                if let Some(scales) = scales {
                    set_scale_pointers(desc, scales)?;
                }
            }
            let layout = |dtype, rows: u32, cols: u32, ld: u32| {
                let mut l: lt::cublasLtMatrixLayout_t = std::ptr::null_mut();
                check(
                    lt::cublasLtMatrixLayoutCreate(
                        &mut l,
                        dtype,
                        rows.into(),
                        cols.into(),
                        ld.into(),
                    ),
                    "matrix layout",
                )
                .map(|()| l)
            };
            let bf16 = lt::cudaDataType_t::CUDA_R_16BF;
            let out = if key.f32_out {
                lt::cudaDataType_t::CUDA_R_32F
            } else {
                bf16
            };
            let input = if key.fp8 {
                lt::cudaDataType_t::CUDA_R_8F_E4M3
            } else {
                bf16
            };
            let w_layout = layout(input, key.k, key.n, key.k)?;
            let a_layout = layout(input, key.k, key.m, key.k)?;
            let c_layout = layout(out, key.n, key.m, key.n)?;
            // The rows the heuristic is asked about (heuristic_rows): where they differ from the
            // product's, layouts of that many rows for the question only.
            let asked_m = heuristic_rows(key.m, self.heuristic_m);
            let asked = if asked_m == key.m {
                None
            } else {
                Some((
                    layout(input, key.k, asked_m, key.k)?,
                    layout(out, key.n, asked_m, key.n)?,
                ))
            };

            let mut pref: lt::cublasLtMatmulPreference_t = std::ptr::null_mut();
            check(lt::cublasLtMatmulPreferenceCreate(&mut pref), "preference")?;
            let ws = WORKSPACE_BYTES as u64;
            check(
                lt::cublasLtMatmulPreferenceSetAttribute(
                    pref,
                    lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws as *const u64 as *const c_void,
                    8,
                ),
                "preference attribute",
            )?;
            let first = |a: lt::cublasLtMatrixLayout_t, c: lt::cublasLtMatrixLayout_t| {
                let mut result: lt::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
                let mut found = 0i32;
                let status = lt::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    desc,
                    w_layout,
                    a,
                    c,
                    c,
                    pref,
                    1,
                    &mut result,
                    &mut found,
                );
                check(status, "heuristic").map(|()| (found > 0).then_some(result))
            };
            // The algorithm picked for `asked_m` rows, if cuBLASLt accepts it for the product's
            // own shape within the workspace; otherwise (and by default) the one picked for it.
            let mut borrowed = None;
            if let Some((a, c)) = asked {
                let picked = first(a, c);
                lt::cublasLtMatrixLayoutDestroy(a);
                lt::cublasLtMatrixLayoutDestroy(c);
                if let Ok(Some(picked)) = picked {
                    let mut checked: lt::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
                    let status = lt::cublasLtMatmulAlgoCheck(
                        self.handle,
                        desc,
                        w_layout,
                        a_layout,
                        c_layout,
                        c_layout,
                        &picked.algo,
                        &mut checked,
                    );
                    if status == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                        && checked.workspaceSize <= WORKSPACE_BYTES
                    {
                        // The check reports the workspace and waves for this shape; the algorithm
                        // is the one picked (set here rather than relied on being copied back).
                        checked.algo = picked.algo;
                        borrowed = Some(checked);
                    }
                }
            }
            let result = match borrowed {
                Some(result) => Ok(Some(result)),
                None => first(a_layout, c_layout),
            };
            lt::cublasLtMatmulPreferenceDestroy(pref);
            let Some(result) = result? else {
                return Err(GpuError::Library(format!(
                    "cuBLASLt has no algorithm for m={} n={} k={} fp8={}",
                    key.m, key.n, key.k, key.fp8
                )));
            };
            if self.log {
                let from = if borrowed.is_some() {
                    format!(" (picked for m={asked_m})")
                } else {
                    String::new()
                };
                eprintln!(
                    "met: cuBLASLt m={} n={} k={} bias={} f32_out={} fp8={}: {}{from} (workspace {} bytes, {:.2} waves)",
                    key.m,
                    key.n,
                    key.k,
                    key.bias,
                    key.f32_out,
                    key.fp8,
                    describe(&result.algo),
                    result.workspaceSize,
                    result.wavesCount
                );
            }
            Ok(Plan {
                desc,
                w_layout,
                a_layout,
                c_layout,
                algo: result.algo,
            })
        }
    }

    /// Queues `C = A · W^T (+ bias)` on `stream`; `c` is bf16, or f32 when `f32_out`. With
    /// `fp8`, `a` and `w` are e4m3 with those scales and `c` is bf16.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        c: u64,
        a: u64,
        w: u64,
        bias: u64,
        m: u32,
        n: u32,
        k: u32,
        f32_out: bool,
        fp8: Option<Fp8Operands>,
        stream: sys::CUstream,
    ) -> Result<(), GpuError> {
        if fp8.is_some() && f32_out {
            return Err(GpuError::Library(
                "the FP8 matmul writes bf16; f32_out is not supported".into(),
            ));
        }
        let key = Key {
            m,
            n,
            k,
            bias: bias != 0,
            f32_out,
            fp8: fp8.is_some(),
        };
        let mut plans = self.plans.lock().expect("cuBLASLt plans poisoned");
        let plan = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.plan(key, fp8)?),
        };
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the descriptors belong to this handle; the device pointers are the caller's
        // allocations of the sizes the layouts describe (with `fp8`, the scale tensors of the
        // sizes the module comment gives); the bias and scale pointers are set on the descriptor
        // for this call only (plans are per bias-or-not and fp8-or-not, and used under the mutex).
        unsafe {
            if key.bias {
                check(
                    lt::cublasLtMatmulDescSetAttribute(
                        plan.desc,
                        lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                        &bias as *const u64 as *const c_void,
                        8,
                    ),
                    "bias pointer",
                )?;
            }
            // The scale pointers too are set for this call only (plans are per fp8-or-not).
            if let Some(scales) = fp8 {
                set_scale_pointers(plan.desc, scales)?;
            }
            check(
                lt::cublasLtMatmul(
                    self.handle,
                    plan.desc,
                    &alpha as *const f32 as *const c_void,
                    w as *const c_void,
                    plan.w_layout,
                    a as *const c_void,
                    plan.a_layout,
                    &beta as *const f32 as *const c_void,
                    c as *const c_void,
                    plan.c_layout,
                    c as *mut c_void,
                    plan.c_layout,
                    &plan.algo,
                    self.workspace as *mut c_void,
                    WORKSPACE_BYTES,
                    stream as lt::cudaStream_t,
                ),
                "matmul",
            )
        }
    }
}

/// Sets an FP8 product's scale pointers on `desc`: the weight's as cuBLASLt's A, the
/// activations' as its B (the module comment's mapping).
///
/// # Safety
/// `desc` is a live matmul descriptor of this module's handle.
unsafe fn set_scale_pointers(
    desc: lt::cublasLtMatmulDesc_t,
    scales: Fp8Operands,
) -> Result<(), GpuError> {
    for (attr, ptr, what) in [
        (
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
            scales.w_scales,
            "weight scale pointer",
        ),
        (
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
            scales.a_scales,
            "activation scale pointer",
        ),
    ] {
        // SAFETY: a pointer-sized attribute read from a local that outlives the call.
        let status = unsafe {
            lt::cublasLtMatmulDescSetAttribute(desc, attr, &ptr as *const u64 as *const c_void, 8)
        };
        check(status, what)?;
    }
    Ok(())
}

/// Rows below which a product takes the algorithm cuBLASLt's heuristic picks for this many rows
/// (where cuBLASLt accepts it for the product's own shape). On the H200 the heuristic's pick for 8
/// rows streamed Qwen3-8B's gate|up in 54.78 us and its down projection in 30.90; the pick for 16
/// rows, run on the same 8 rows, took 49.78 and 28.78 (qkv 16.04 -> 15.67, o 11.84 -> 13.25), and
/// the batch-8 decode step at 160 keys went 4.958 -> 4.777 ms (4.970 -> 4.806 in a second call;
/// 5.384 -> 5.244 at 1024 keys). Asking for 32 rows: 4.897 ms
/// (docs/results/2026-12-02-speed-h200/blaslt-rows).
pub const HEURISTIC_ROWS: u32 = 16;

/// The rows cuBLASLt's heuristic is asked about for a product of `m` rows under a setting of
/// `rows` ([`HEURISTIC_ROWS`]; 0: each product its own): `rows` where `m` is below it, else `m`.
fn heuristic_rows(m: u32, rows: u32) -> u32 {
    m.max(rows)
}

/// The configuration cuBLASLt's heuristic picked, as its algorithm attributes (for
/// `METRALE_BLASLT_LOG`, to set against what cuBLASLt's own log shows for another caller).
fn describe(algo: &lt::cublasLtMatmulAlgo_t) -> String {
    use lt::cublasLtMatmulAlgoConfigAttributes_t as A;
    let get = |attr, bytes: usize| {
        let mut value = 0u64;
        let mut written = 0usize;
        // SAFETY: `value` holds at least `bytes` (4 or 2) bytes; cuBLASLt writes at most that many.
        let status = unsafe {
            lt::cublasLtMatmulAlgoConfigGetAttribute(
                algo,
                attr,
                &mut value as *mut u64 as *mut c_void,
                bytes,
                &mut written,
            )
        };
        if status == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            value.to_string()
        } else {
            "?".to_string()
        }
    };
    format!(
        "algo {} tile {} stages {} split-k {} reduction {} swizzle {} custom {} inner {} cluster {}",
        get(A::CUBLASLT_ALGO_CONFIG_ID, 4),
        get(A::CUBLASLT_ALGO_CONFIG_TILE_ID, 4),
        get(A::CUBLASLT_ALGO_CONFIG_STAGES_ID, 4),
        get(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 4),
        get(A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, 4),
        get(A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, 4),
        get(A::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, 4),
        get(A::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, 2),
        get(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 2),
    )
}

impl Drop for BlasLt {
    fn drop(&mut self) {
        let plans = std::mem::take(self.plans.get_mut().expect("cuBLASLt plans poisoned"));
        // SAFETY: every object was created by this value and is destroyed once.
        unsafe {
            for plan in plans.into_values() {
                lt::cublasLtMatrixLayoutDestroy(plan.w_layout);
                lt::cublasLtMatrixLayoutDestroy(plan.a_layout);
                lt::cublasLtMatrixLayoutDestroy(plan.c_layout);
                lt::cublasLtMatmulDescDestroy(plan.desc);
            }
            lt::cublasLtDestroy(self.handle);
            sys::cuMemFree_v2(self.workspace);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::heuristic_rows;

    #[test]
    fn heuristic_rows_only_raise_smaller_products() {
        assert_eq!(heuristic_rows(8, 0), 8);
        assert_eq!(heuristic_rows(8, 16), 16);
        assert_eq!(heuristic_rows(16, 16), 16);
        assert_eq!(heuristic_rows(64, 16), 64);
        assert_eq!(heuristic_rows(1, 16), 16);
    }
}
