// SPDX-License-Identifier: MIT OR Apache-2.0
//! The [`GpuBackend`] trait and the handles it deals in.

use metrale_core::{DevicePtr, KernelArg, KernelName, LaunchConfig};
use metrale_kernels::{HostError, Kernel};

/// A stream: launches on one stream run in order. [`GpuBackend::default_stream`] always exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Stream(pub u32);

/// An event recorded on a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Event(pub u32);

/// A captured, instantiated graph of launches and copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Graph(pub u32);

/// A kernel resolved once (at load time) and launched many times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelHandle(pub u32);

/// Everything a backend call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The CUDA driver library is not installed or cannot be loaded.
    #[error(
        "the NVIDIA driver library (libcuda.so.1) cannot be loaded: no NVIDIA driver is installed, or it is not on the loader path"
    )]
    NoDriver,
    /// The driver loads but reports no usable device.
    #[error("no CUDA device is present (the driver reports {0})")]
    NoDevice(String),
    /// A device ordinal past the last device.
    #[error("CUDA device {ordinal} does not exist; this machine has {count}")]
    BadOrdinal {
        /// Requested ordinal.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// A driver call failed.
    #[error("{call} failed: {name} ({code})")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The CUresult name.
        name: String,
        /// The CUresult value.
        code: u32,
    },
    /// The kernel is not in the loaded target.
    #[error("kernel {name} is not available: {reason}")]
    UnknownKernel {
        /// The entry point.
        name: KernelName,
        /// Why (missing module, missing function, no host reference).
        reason: String,
    },
    /// A handle this backend never issued, or already released.
    #[error("invalid {kind} handle {id}")]
    InvalidHandle {
        /// What kind of handle.
        kind: &'static str,
        /// Its value.
        id: u64,
    },
    /// A memory operation outside every allocation, or on a freed pointer.
    #[error("invalid memory operation: {0}")]
    Memory(String),
    /// The device or host pool is out of memory.
    #[error("out of memory allocating {bytes} bytes ({detail})")]
    OutOfMemory {
        /// Requested size.
        bytes: usize,
        /// Backend detail.
        detail: String,
    },
    /// A host reference failed.
    #[error(transparent)]
    Host(#[from] HostError),
    /// The device cannot run the target's binaries.
    #[error("arch preflight failed: {0}")]
    ArchMismatch(String),
    /// A graph capture was misused (nested, unbalanced, or an uncapturable operation inside it).
    #[error("graph capture: {0}")]
    Capture(String),
    /// A GPU library call (cuBLASLt) failed.
    #[error("{0}")]
    Library(String),
    /// A run-time switch (environment variable) of the backend holds a value it does not take.
    #[error("{name}={value}: expected {expected}")]
    BadVariable {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What it takes.
        expected: &'static str,
    },
}

/// GPU memory, kernel launch, streams, events and graphs, with three implementations.
///
/// Copies between host and device (`copy_h2d`, `copy_d2h`) are synchronous with respect to the
/// host and ordered after all work already queued on the default stream. Device-side operations
/// (`launch`, `copy_d2d`, `memset`) are queued on the given stream, and inside a capture they are
/// recorded into the graph instead of running.
pub trait GpuBackend: Send + Sync {
    /// `"cuda"`, `"host"` or `"mock"`.
    fn kind(&self) -> &'static str;

    // Memory.
    /// Allocates `bytes` of device memory, 256-byte aligned, contents unspecified.
    fn alloc(&self, bytes: usize) -> Result<DevicePtr, GpuError>;
    /// Frees an allocation returned by [`GpuBackend::alloc`].
    fn free(&self, ptr: DevicePtr) -> Result<(), GpuError>;
    /// Copies host bytes to device memory.
    fn copy_h2d(&self, src: &[u8], dst: DevicePtr) -> Result<(), GpuError>;
    /// Copies device memory to host bytes.
    fn copy_d2h(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), GpuError>;
    /// Copies device memory to host bytes on `stream`: synchronous with respect to the host and
    /// ordered after the work queued on `stream` only, so that a side stream can read a result
    /// (after [`GpuBackend::stream_wait_event`] on the event that follows it) while later work
    /// stays queued on the default stream.
    fn copy_d2h_on(&self, src: DevicePtr, dst: &mut [u8], stream: Stream) -> Result<(), GpuError>;
    /// Copies device to device on `stream`.
    fn copy_d2d(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<(), GpuError>;
    /// Sets `bytes` bytes to `value` on `stream`.
    fn memset(
        &self,
        ptr: DevicePtr,
        value: u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<(), GpuError>;
    /// Device memory in total, bytes.
    fn total_memory(&self) -> Result<u64, GpuError>;
    /// Device memory free now, bytes.
    fn free_memory(&self) -> Result<u64, GpuError>;
    /// Page-locked host memory for fast transfers (plain memory on backends without a device).
    fn alloc_host_pinned(&self, bytes: usize) -> Result<PinnedHostBuffer, GpuError>;

    // Kernels.
    /// Resolves an entry point of the loaded target; do it once, at load time.
    fn kernel(&self, name: KernelName) -> Result<KernelHandle, GpuError>;
    /// Queues a launch on `stream`.
    fn launch(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        stream: Stream,
    ) -> Result<(), GpuError>;

    /// [`GpuBackend::launch`] with this launch's own preferred shared-memory carveout, percent of
    /// the most shared memory an SM has (0-100; the driver's hint
    /// `CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`). Backends without an L1 / shared
    /// split launch as usual.
    fn launch_with_carveout(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        stream: Stream,
        carveout_percent: u8,
    ) -> Result<(), GpuError> {
        let _ = carveout_percent;
        self.launch(kernel, config, args, stream)
    }

    /// Queues the dense product `C = A · W^T (+ bias)` described by `op`. `kernel` is the handle
    /// of `op`'s own GEMM kernel ([`GemmOp::kernel_name`]), which backends without a better
    /// implementation launch; the CUDA backend uses cuBLASLt when it is installed.
    fn gemm(&self, op: &GemmOp, kernel: KernelHandle, stream: Stream) -> Result<(), GpuError> {
        let (config, args) = op.kernel_launch();
        self.launch(kernel, &config, &args, stream)
    }

    // Streams and events.
    /// The stream every backend starts with.
    fn default_stream(&self) -> Stream {
        Stream(0)
    }
    /// A new stream, independent of the others.
    fn create_stream(&self) -> Result<Stream, GpuError>;
    /// Blocks until everything queued on `stream` has run.
    fn synchronize(&self, stream: Stream) -> Result<(), GpuError>;
    /// A new event.
    fn create_event(&self) -> Result<Event, GpuError>;
    /// Records `event` after the work queued so far on `stream`.
    fn record_event(&self, event: Event, stream: Stream) -> Result<(), GpuError>;
    /// Makes `stream` wait for `event` before running later work.
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<(), GpuError>;
    /// Milliseconds between two recorded, completed events.
    fn elapsed_ms(&self, start: Event, end: Event) -> Result<f32, GpuError>;

    /// Points every loaded module's kernel trace at `buffer` (`DevicePtr::NULL`: off). A trace
    /// build's kernels (`METRALE_EXTRA_NVCC_FLAGS=-DMETRALE_TRACE`) then record, in block 0 of
    /// every launch, when it reached its programmatic-launch wait and when the wait returned
    /// (`metrale_trace_buffer` in kernels/hopper/common/common.cuh; [`crate::TraceRecord`]).
    /// Returns whether any module has the trace: release builds and the host and mock backends
    /// have none.
    fn set_kernel_trace(&self, buffer: DevicePtr) -> Result<bool, GpuError> {
        let _ = buffer;
        Ok(false)
    }

    // Graphs.
    /// Starts recording device-side work queued on `stream` instead of running it.
    fn begin_capture(&self, stream: Stream) -> Result<(), GpuError>;
    /// Ends the capture and returns the replayable graph.
    fn end_capture(&self, stream: Stream) -> Result<Graph, GpuError>;
    /// Replays a graph on `stream`.
    fn launch_graph(&self, graph: Graph, stream: Stream) -> Result<(), GpuError>;
}

/// A dense product in HF Linear layout: `C[m, n] = A[m, k] · W[n, k]^T (+ bias[n])`, bf16 inputs,
/// f32 accumulation, bf16 or f32 output; or, with [`GemmOp::fp8`], both inputs e4m3 with f32 block
/// scales and a bf16 output (cuBLASLt's block-scaled FP8 matmul on CUDA).
#[derive(Clone, Copy, Debug)]
pub struct GemmOp {
    /// Output, bf16 or f32 `[m, n]`.
    pub c: DevicePtr,
    /// bf16 `[m, k]` (e4m3 with `fp8`).
    pub a: DevicePtr,
    /// bf16 `[n, k]` (e4m3 with `fp8`).
    pub w: DevicePtr,
    /// bf16 `[n]`, or null.
    pub bias: DevicePtr,
    /// Rows of A and C.
    pub m: u32,
    /// Rows of W, columns of C.
    pub n: u32,
    /// Reduction length.
    pub k: u32,
    /// Whether `c` is f32 (else bf16). Never with `fp8`.
    pub f32_out: bool,
    /// The operands' scales where both are e4m3 ([`metrale_kernels::ops::GemmFp8`]'s layouts),
    /// or `None` for bf16 operands.
    pub fp8: Option<GemmFp8Scales>,
}

/// The f32 scales of an FP8 [`GemmOp`]'s operands, and the scratch its last rows use.
#[derive(Clone, Copy, Debug)]
pub struct GemmFp8Scales {
    /// A scale per row of A and 128 columns, the row index fastest, in row groups of 16
    /// ([`metrale_kernels::ops::fp8_row_scale`]; [`metrale_kernels::ops::Fp8QuantizeRows`]
    /// writes it; cuBLASLt's VEC128_32F mode). A holds `m` rounded up to 16 rows.
    pub a: DevicePtr,
    /// `[ceil(n / 128), ceil(k / 128)]` row-major: W's 128 x 128 blocks (BLK128x128_32F).
    pub w: DevicePtr,
    /// bf16 `[FP8_GEMM_PAD_ROWS, n]` scratch: where `m` is not a multiple of 16, cuBLASLt's
    /// product of the rows past the last multiple of 16 (all of them up to 256 rows), padded with
    /// zero rows, lands here and its real rows are copied into `c`
    /// ([`metrale_kernels::ops::fp8_rows_split`]).
    pub tail: DevicePtr,
}

impl GemmOp {
    /// The kernel that computes this product on backends without a library.
    pub fn kernel_name(&self) -> KernelName {
        use metrale_kernels::KernelAbi;
        if self.fp8.is_some() {
            metrale_kernels::ops::GemmFp8::NAME
        } else if self.f32_out {
            metrale_kernels::ops::GemmF32Out::NAME
        } else {
            metrale_kernels::ops::Gemm::NAME
        }
    }

    /// That kernel's launch.
    pub fn kernel_launch(&self) -> (LaunchConfig, Vec<KernelArg>) {
        use metrale_kernels::KernelAbi;
        use metrale_kernels::ops::{Gemm, GemmF32Out, GemmFp8};
        let GemmOp {
            c,
            a,
            w,
            bias,
            m,
            n,
            k,
            f32_out,
            fp8,
        } = *self;
        if let Some(scales) = fp8 {
            debug_assert!(!f32_out, "the FP8 product writes bf16");
            let g = GemmFp8 {
                c,
                a,
                a_scales: scales.a,
                w,
                w_scales: scales.w,
                bias,
                m,
                n,
                k,
            };
            (g.launch_config(), g.args())
        } else if f32_out {
            let g = GemmF32Out {
                c,
                a,
                w,
                bias,
                m,
                n,
                k,
            };
            (g.launch_config(), g.args())
        } else {
            let g = Gemm {
                c,
                a,
                w,
                bias,
                m,
                n,
                k,
            };
            (g.launch_config(), g.args())
        }
    }
}

/// Launches a typed kernel: resolves nothing per call beyond the handle it is given.
pub fn launch_kernel<K: Kernel>(
    gpu: &dyn GpuBackend,
    handle: KernelHandle,
    kernel: &K,
    stream: Stream,
) -> Result<(), GpuError> {
    gpu.launch(handle, &kernel.launch_config(), &kernel.args(), stream)
}

/// Host memory returned by [`GpuBackend::alloc_host_pinned`]; freed on drop.
pub struct PinnedHostBuffer {
    pub(crate) storage: crate::cuda::HostStorage,
}

impl std::ops::Deref for PinnedHostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.storage.as_slice()
    }
}

impl std::ops::DerefMut for PinnedHostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.storage.as_mut_slice()
    }
}

impl std::fmt::Debug for PinnedHostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedHostBuffer({} bytes)", self.len())
    }
}
