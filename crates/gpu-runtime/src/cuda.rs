// SPDX-License-Identifier: MIT OR Apache-2.0
//! The CUDA backend: the driver API through `cudarc`'s dynamically loaded bindings.
//!
//! The driver library is opened at run time, so `met` builds and runs where there is no CUDA at
//! all; [`driver`] checks that the library exists before any binding is called (a binding called
//! without it would panic). All driver handles are kept as integers so the backend is `Send + Sync`;
//! every method makes the backend's context current on the calling thread first.
//!
//! Device-side work goes on non-blocking streams created here (stream 0 is the backend's main
//! stream, not the legacy NULL stream, so it can be captured into graphs). Host copies are staged on
//! the main stream and waited for, which orders them after everything queued there.

use std::ffi::{CStr, CString, c_void};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys;
use metrale_core::{DevicePtr, KernelArg, KernelName, LaunchConfig, SmArch};
use metrale_kernels::TargetKernels;

use crate::backend::{
    Event, GemmOp, GpuBackend, GpuError, Graph, KernelHandle, PinnedHostBuffer, Stream,
};

/// The name of a driver result code (`CUDA_ERROR_OUT_OF_MEMORY`).
pub(crate) fn error_name(code: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or leaves it null; it is called
    // only after `driver()` confirmed the library is present.
    let ok = unsafe { sys::cuGetErrorName(code, &mut name) } == sys::CUresult::CUDA_SUCCESS;
    if ok && !name.is_null() {
        // SAFETY: non-null pointers from cuGetErrorName point to NUL-terminated static strings.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{code:?}")
    }
}

pub(crate) fn check(call: &'static str, code: sys::CUresult) -> Result<(), GpuError> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Driver {
            call,
            name: error_name(code),
            code: code as u32,
        })
    }
}

/// Loads and initialises the driver once per process. No library is [`GpuError::NoDriver`]; a
/// driver without devices is [`GpuError::NoDevice`].
pub(crate) fn driver() -> Result<(), GpuError> {
    static INIT: OnceLock<Result<(), String>> = OnceLock::new();
    let init = INIT.get_or_init(|| {
        // SAFETY: only tries to open the library with dlopen; calls no function in it.
        if !unsafe { sys::is_culib_present() } {
            return Err(String::new());
        }
        // SAFETY: cuInit takes flags only and is safe to call more than once.
        let code = unsafe { sys::cuInit(0) };
        if code == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(error_name(code))
        }
    });
    match init {
        Ok(()) => Ok(()),
        Err(name) if name.is_empty() => Err(GpuError::NoDriver),
        Err(name) => Err(GpuError::NoDevice(name.clone())),
    }
}

/// Host memory behind a [`PinnedHostBuffer`].
pub(crate) enum HostStorage {
    /// Ordinary memory (host and mock backends).
    Plain(Vec<u8>),
    /// Page-locked memory from `cuMemAllocHost`, freed with `cuMemFreeHost` in `ctx`.
    Pinned { ptr: usize, len: usize, ctx: usize },
}

impl HostStorage {
    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            HostStorage::Plain(v) => v,
            // SAFETY: `ptr` is a live cuMemAllocHost allocation of `len` bytes owned by this value.
            HostStorage::Pinned { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts(*ptr as *const u8, *len)
            },
        }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            HostStorage::Plain(v) => v,
            // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
            HostStorage::Pinned { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts_mut(*ptr as *mut u8, *len)
            },
        }
    }
}

impl Drop for HostStorage {
    fn drop(&mut self) {
        if let HostStorage::Pinned { ptr, ctx, .. } = *self {
            // SAFETY: the allocation was made in `ctx`, which the backend keeps retained for the
            // process's lifetime of its primary context; freeing it once here is its only release.
            unsafe {
                sys::cuCtxSetCurrent(ctx as sys::CUcontext);
                sys::cuMemFreeHost(ptr as *mut c_void);
            }
        }
    }
}

#[derive(Default)]
struct CudaState {
    kernels: Vec<(KernelName, usize)>,
    streams: Vec<usize>,
    events: Vec<usize>,
    graphs: Vec<usize>,
    capturing: Option<Stream>,
}

/// One CUDA device running one embedded kernel target.
pub struct CudaBackend {
    device: sys::CUdevice,
    ctx: usize,
    target: &'static TargetKernels,
    /// (module name, CUmodule)
    modules: Vec<(&'static str, usize)>,
    state: Mutex<CudaState>,
    /// cuBLASLt, created on the first GEMM (None inside: not installed).
    blaslt: std::sync::OnceLock<Option<crate::blaslt::BlasLt>>,
    /// Launch every kernel with programmatic stream serialization (on unless `METRALE_PDL=0`): a
    /// kernel may be scheduled while the one before it drains, and waits in `griddepcontrol.wait`
    /// (every kernel of ours starts with it, common.cuh) until that one's writes are visible.
    /// Measured on the H200 with decode graphs: Qwen3-8B 156.1 -> 158.8 tok/s, Qwen3-0.6B
    /// 706.3 -> 728.9 tok/s, the same greedy ids (docs/results/2026-11-30-speed-h200/launch-ab).
    pdl: bool,
    /// cuBLASLt logs each plan's algorithm (`METRALE_BLASLT_LOG=1`).
    blaslt_log: bool,
}

impl CudaBackend {
    /// Opens device `ordinal`, checks that it can run `target`'s binaries (the arch preflight), and
    /// loads every module of the target. No driver, no device, or a failed preflight is an error.
    pub fn new(ordinal: usize, target: &'static TargetKernels) -> Result<Self, GpuError> {
        driver()?;
        let info = crate::probe::device_info(ordinal)?;
        let arch: SmArch = target
            .target
            .arch
            .parse()
            .map_err(|e: metrale_core::ArchError| GpuError::ArchMismatch(e.to_string()))?;
        let preflight = arch.preflight(info.compute_capability.0, info.compute_capability.1);
        if !preflight.passes {
            return Err(GpuError::ArchMismatch(format!(
                "{} (target {})",
                preflight.reason,
                target.target.path()
            )));
        }
        let mut device: sys::CUdevice = 0;
        // SAFETY: out-pointer to a local; ordinal was validated by device_info.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut device, ordinal as i32)
        })?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; released in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
        })?;
        let mut backend = CudaBackend {
            device,
            ctx: ctx as usize,
            target,
            modules: Vec::new(),
            state: Mutex::new(CudaState::default()),
            blaslt: std::sync::OnceLock::new(),
            pdl: operator_switch("METRALE_PDL")?.unwrap_or(true),
            blaslt_log: operator_switch("METRALE_BLASLT_LOG")?.unwrap_or(false),
        };
        backend.bind()?;
        let main = backend.new_stream()?;
        backend.state().streams.push(main);
        for module in target.modules {
            // cuModuleLoadData wants the fatbin at an 8-byte aligned address; include_bytes! only
            // guarantees 1, so copy into u64 storage first.
            let mut aligned = vec![0u64; module.image.len().div_ceil(8)];
            bytemuck::cast_slice_mut::<u64, u8>(&mut aligned)[..module.image.len()]
                .copy_from_slice(module.image);
            let mut handle: sys::CUmodule = std::ptr::null_mut();
            // SAFETY: `aligned` holds a complete fatbin produced by nvcc and outlives the call (the
            // driver copies the image).
            check("cuModuleLoadData", unsafe {
                sys::cuModuleLoadData(&mut handle, aligned.as_ptr() as *const c_void)
            })?;
            backend.modules.push((module.name, handle as usize));
        }
        Ok(backend)
    }

    /// The target whose modules are loaded.
    pub fn target(&self) -> &'static TargetKernels {
        self.target
    }

    fn state(&self) -> std::sync::MutexGuard<'_, CudaState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bind(&self) -> Result<(), GpuError> {
        // SAFETY: the context is retained for the backend's lifetime.
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.ctx as sys::CUcontext)
        })
    }

    fn new_stream(&self) -> Result<usize, GpuError> {
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the context is current.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(s as usize)
    }

    fn stream(&self, stream: Stream) -> Result<sys::CUstream, GpuError> {
        self.state()
            .streams
            .get(stream.0 as usize)
            .map(|&s| s as sys::CUstream)
            .ok_or(GpuError::InvalidHandle {
                kind: "stream",
                id: stream.0.into(),
            })
    }

    fn event(&self, event: Event) -> Result<sys::CUevent, GpuError> {
        self.state()
            .events
            .get(event.0 as usize)
            .map(|&e| e as sys::CUevent)
            .ok_or(GpuError::InvalidHandle {
                kind: "event",
                id: event.0.into(),
            })
    }

    fn no_capture(&self, what: &str) -> Result<(), GpuError> {
        match self.state().capturing {
            Some(s) => Err(GpuError::Capture(format!(
                "{what} cannot run while stream {} is being captured",
                s.0
            ))),
            None => Ok(()),
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // cuBLASLt's handle and workspace go first, while the context is still held.
        let _ = self.bind();
        drop(self.blaslt.take());
        let state = std::mem::take(&mut *self.state());
        // SAFETY: every handle below was created by this backend in its context and is destroyed
        // exactly once here; errors are ignored because nothing can be done about them in drop.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx as sys::CUcontext);
            for &s in &state.streams {
                sys::cuStreamSynchronize(s as sys::CUstream);
            }
            for g in state.graphs {
                sys::cuGraphExecDestroy(g as sys::CUgraphExec);
            }
            for e in state.events {
                sys::cuEventDestroy_v2(e as sys::CUevent);
            }
            for s in state.streams {
                sys::cuStreamDestroy_v2(s as sys::CUstream);
            }
            for (_, m) in &self.modules {
                sys::cuModuleUnload(*m as sys::CUmodule);
            }
            sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

impl GpuBackend for CudaBackend {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn alloc(&self, bytes: usize) -> Result<DevicePtr, GpuError> {
        self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; the context is current.
        let code = unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) };
        if code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(GpuError::OutOfMemory {
                bytes,
                detail: "cuMemAlloc".into(),
            });
        }
        check("cuMemAlloc", code)?;
        Ok(DevicePtr(ptr))
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: the driver validates the pointer and returns an error for one it did not issue.
        check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr.0) })
    }

    fn copy_h2d(&self, src: &[u8], dst: DevicePtr) -> Result<(), GpuError> {
        self.no_capture("a host-to-device copy")?;
        self.bind()?;
        let main = self.stream(Stream(0))?;
        // SAFETY: `src` is valid for `src.len()` bytes and stays borrowed until the stream is
        // synchronised below; the driver validates the device range.
        unsafe {
            check(
                "cuMemcpyHtoDAsync",
                sys::cuMemcpyHtoDAsync_v2(dst.0, src.as_ptr() as *const c_void, src.len(), main),
            )?;
            check("cuStreamSynchronize", sys::cuStreamSynchronize(main))
        }
    }

    fn set_kernel_trace(&self, buffer: DevicePtr) -> Result<bool, GpuError> {
        self.no_capture("setting the kernel trace")?;
        self.bind()?;
        let mut any = false;
        for &(_, module) in &self.modules {
            let (mut at, mut bytes): (sys::CUdeviceptr, usize) = (0, 0);
            // SAFETY: out-pointers to locals; the module handle is loaded and owned by self; the
            // name is a NUL-terminated literal.
            let found = unsafe {
                sys::cuModuleGetGlobal_v2(
                    &mut at,
                    &mut bytes,
                    module as sys::CUmodule,
                    c"metrale_trace_buffer".as_ptr(),
                )
            };
            if found == sys::CUresult::CUDA_ERROR_NOT_FOUND {
                continue;
            }
            check("cuModuleGetGlobal", found)?;
            if bytes != 8 {
                return Err(GpuError::Memory(format!(
                    "metrale_trace_buffer is {bytes} bytes, not a pointer's 8"
                )));
            }
            // On the main stream and synchronised (copy_h2d), so the step's kernels see it.
            self.copy_h2d(&buffer.0.to_le_bytes(), DevicePtr(at))?;
            any = true;
        }
        Ok(any)
    }

    fn copy_d2h(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), GpuError> {
        self.no_capture("a device-to-host copy")?;
        self.bind()?;
        let main = self.stream(Stream(0))?;
        // SAFETY: `dst` is valid for writes of `dst.len()` bytes and stays borrowed until the
        // stream is synchronised below.
        unsafe {
            check(
                "cuMemcpyDtoHAsync",
                sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src.0, dst.len(), main),
            )?;
            check("cuStreamSynchronize", sys::cuStreamSynchronize(main))
        }
    }

    fn copy_d2h_on(&self, src: DevicePtr, dst: &mut [u8], stream: Stream) -> Result<(), GpuError> {
        self.no_capture("a device-to-host copy")?;
        self.bind()?;
        let s = self.stream(stream)?;
        // SAFETY: `dst` is valid for writes of `dst.len()` bytes and stays borrowed until the
        // stream is synchronised below.
        unsafe {
            check(
                "cuMemcpyDtoHAsync",
                sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src.0, dst.len(), s),
            )?;
            check("cuStreamSynchronize", sys::cuStreamSynchronize(s))
        }
    }

    fn copy_d2d(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        self.bind()?;
        let s = self.stream(stream)?;
        // SAFETY: device addresses only; the driver validates them.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes, s)
        })
    }

    fn memset(
        &self,
        ptr: DevicePtr,
        value: u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        self.bind()?;
        let s = self.stream(stream)?;
        // SAFETY: device addresses only; the driver validates them.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(ptr.0, value, bytes, s)
        })
    }

    fn total_memory(&self) -> Result<u64, GpuError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to locals.
        check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok(total as u64)
    }

    fn free_memory(&self) -> Result<u64, GpuError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to locals.
        check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok(free as u64)
    }

    fn alloc_host_pinned(&self, bytes: usize) -> Result<PinnedHostBuffer, GpuError> {
        self.bind()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; ownership passes to HostStorage, which frees it.
        check("cuMemAllocHost", unsafe {
            sys::cuMemAllocHost_v2(&mut ptr, bytes.max(1))
        })?;
        Ok(PinnedHostBuffer {
            storage: HostStorage::Pinned {
                ptr: ptr as usize,
                len: bytes,
                ctx: self.ctx,
            },
        })
    }

    fn kernel(&self, name: KernelName) -> Result<KernelHandle, GpuError> {
        let mut state = self.state();
        if let Some(i) = state.kernels.iter().position(|(n, _)| *n == name) {
            return Ok(KernelHandle(i as u32));
        }
        let Some(&(_, module)) = self.modules.iter().find(|(m, _)| *m == name.module) else {
            return Err(GpuError::UnknownKernel {
                name,
                reason: format!(
                    "target {} has no module `{}`",
                    self.target.target.path(),
                    name.module
                ),
            });
        };
        self.bind()?;
        let c_name = CString::new(name.function).expect("kernel names have no NUL");
        let mut function: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the module is loaded for the backend's lifetime.
        let code = unsafe {
            sys::cuModuleGetFunction(&mut function, module as sys::CUmodule, c_name.as_ptr())
        };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(GpuError::UnknownKernel {
                name,
                reason: format!("cuModuleGetFunction: {}", error_name(code)),
            });
        }
        opt_in_shared_memory(self.device, function)?;
        state.kernels.push((name, function as usize));
        Ok(KernelHandle(state.kernels.len() as u32 - 1))
    }

    fn gemm(&self, op: &GemmOp, kernel: KernelHandle, stream: Stream) -> Result<(), GpuError> {
        let lib = self.blaslt.get_or_init(|| {
            self.bind().ok()?;
            let rows = crate::blaslt::HEURISTIC_ROWS;
            crate::blaslt::BlasLt::new(rows, self.blaslt_log).unwrap_or_else(|e| {
                eprintln!("met: cuBLASLt unavailable ({e}); GEMMs use the built-in kernel");
                None
            })
        });
        match lib {
            Some(lib) => {
                let s = self.stream(stream)?;
                self.bind()?;
                let Some(scales) = op.fp8 else {
                    return lib.matmul(
                        op.c.0, op.a.0, op.w.0, op.bias.0, op.m, op.n, op.k, op.f32_out, None, s,
                    );
                };
                // cuBLASLt's block-scaled FP8 takes multiples of 16 rows: the first `main` rows
                // in one product, the rest (padded with zero rows by the quantization) in a
                // product into the scratch, whose real rows are then copied out
                // (metrale_kernels::ops::fp8_rows_split, fp8_row_scale's layout).
                let (main, tail) = metrale_kernels::ops::fp8_rows_split(op.m);
                let group = tail.next_multiple_of(metrale_kernels::ops::FP8_GEMM_ROW_GROUP);
                let kb = u64::from(op.k.div_ceil(metrale_kernels::ops::FP8_SCALE_COLS));
                if main > 0 {
                    let fp8 = crate::blaslt::Fp8Operands {
                        a_scales: scales.a.0,
                        w_scales: scales.w.0,
                    };
                    lib.matmul(
                        op.c.0,
                        op.a.0,
                        op.w.0,
                        op.bias.0,
                        main,
                        op.n,
                        op.k,
                        false,
                        Some(fp8),
                        s,
                    )?;
                }
                if tail > 0 {
                    if scales.tail.is_null() {
                        return Err(GpuError::Library(format!(
                            "an FP8 product of {} rows (not a multiple of {}) needs the \
                             tail scratch",
                            op.m,
                            metrale_kernels::ops::FP8_GEMM_ROW_GROUP
                        )));
                    }
                    let fp8 = crate::blaslt::Fp8Operands {
                        a_scales: scales.a.0 + kb * u64::from(main) * 4,
                        w_scales: scales.w.0,
                    };
                    let a = op.a.0 + u64::from(main) * u64::from(op.k);
                    lib.matmul(
                        scales.tail.0,
                        a,
                        op.w.0,
                        op.bias.0,
                        group,
                        op.n,
                        op.k,
                        false,
                        Some(fp8),
                        s,
                    )?;
                    let row_bytes = u64::from(op.n) * 2;
                    // SAFETY: device addresses only; `c` holds `m` rows and the scratch `group`.
                    check("cuMemcpyDtoDAsync", unsafe {
                        sys::cuMemcpyDtoDAsync_v2(
                            op.c.0 + u64::from(main) * row_bytes,
                            scales.tail.0,
                            (u64::from(tail) * row_bytes) as usize,
                            s,
                        )
                    })?;
                }
                Ok(())
            }
            None => {
                let (config, args) = op.kernel_launch();
                self.launch(kernel, &config, &args, stream)
            }
        }
    }

    fn launch(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        stream: Stream,
    ) -> Result<(), GpuError> {
        self.launch_inner(kernel, config, args, stream, None)
    }

    fn launch_with_carveout(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        stream: Stream,
        carveout_percent: u8,
    ) -> Result<(), GpuError> {
        self.launch_inner(
            kernel,
            config,
            args,
            stream,
            Some(carveout_percent.min(100)),
        )
    }

    fn create_stream(&self) -> Result<Stream, GpuError> {
        self.bind()?;
        let s = self.new_stream()?;
        let mut state = self.state();
        state.streams.push(s);
        Ok(Stream(state.streams.len() as u32 - 1))
    }

    fn synchronize(&self, stream: Stream) -> Result<(), GpuError> {
        self.bind()?;
        let s = self.stream(stream)?;
        // SAFETY: a stream created by this backend.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(s)
        })
    }

    fn create_event(&self) -> Result<Event, GpuError> {
        self.bind()?;
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut e, 0) })?;
        let mut state = self.state();
        state.events.push(e as usize);
        Ok(Event(state.events.len() as u32 - 1))
    }

    fn record_event(&self, event: Event, stream: Stream) -> Result<(), GpuError> {
        self.bind()?;
        let (e, s) = (self.event(event)?, self.stream(stream)?);
        // SAFETY: handles created by this backend.
        check("cuEventRecord", unsafe { sys::cuEventRecord(e, s) })
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<(), GpuError> {
        self.bind()?;
        let (e, s) = (self.event(event)?, self.stream(stream)?);
        // SAFETY: handles created by this backend.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(s, e, 0)
        })
    }

    fn elapsed_ms(&self, start: Event, end: Event) -> Result<f32, GpuError> {
        self.bind()?;
        let (a, b) = (self.event(start)?, self.event(end)?);
        let mut ms = 0f32;
        // SAFETY: handles created by this backend; out-pointer to a local.
        unsafe {
            check("cuEventSynchronize", sys::cuEventSynchronize(b))?;
            check(
                "cuEventElapsedTime",
                sys::cuEventElapsedTime_v2(&mut ms, a, b),
            )?;
        }
        Ok(ms)
    }

    fn begin_capture(&self, stream: Stream) -> Result<(), GpuError> {
        self.no_capture("another capture")?;
        self.bind()?;
        let s = self.stream(stream)?;
        // SAFETY: a stream created by this backend; thread-local mode confines the capture's
        // restrictions to this thread.
        check("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(
                s,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        })?;
        self.state().capturing = Some(stream);
        Ok(())
    }

    fn end_capture(&self, stream: Stream) -> Result<Graph, GpuError> {
        if self.state().capturing != Some(stream) {
            return Err(GpuError::Capture(format!(
                "end_capture on stream {} which is not capturing",
                stream.0
            )));
        }
        self.bind()?;
        let s = self.stream(stream)?;
        self.state().capturing = None;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: ends the capture begun on this stream; the template graph is destroyed after
        // instantiation, which copies it.
        unsafe {
            check("cuStreamEndCapture", sys::cuStreamEndCapture(s, &mut graph))?;
            let code = sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0);
            sys::cuGraphDestroy(graph);
            check("cuGraphInstantiate", code)?;
        }
        let mut state = self.state();
        state.graphs.push(exec as usize);
        Ok(Graph(state.graphs.len() as u32 - 1))
    }

    fn launch_graph(&self, graph: Graph, stream: Stream) -> Result<(), GpuError> {
        self.bind()?;
        let exec = self
            .state()
            .graphs
            .get(graph.0 as usize)
            .map(|&g| g as sys::CUgraphExec);
        let exec = exec.ok_or(GpuError::InvalidHandle {
            kind: "graph",
            id: graph.0.into(),
        })?;
        let s = self.stream(stream)?;
        // SAFETY: an executable graph instantiated by this backend.
        check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(exec, s) })
    }
}

impl CudaBackend {
    /// [`GpuBackend::launch`], with the launch's own shared-memory carveout preference when
    /// `carveout` is set (a launch attribute: it travels into captured graphs with the launch).
    fn launch_inner(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        stream: Stream,
        carveout: Option<u8>,
    ) -> Result<(), GpuError> {
        let function = self
            .state()
            .kernels
            .get(kernel.0 as usize)
            .map(|&(_, f)| f as sys::CUfunction)
            .ok_or(GpuError::InvalidHandle {
                kind: "kernel",
                id: kernel.0.into(),
            })?;
        let s = self.stream(stream)?;
        self.bind()?;
        // Each argument lives in its own 8-byte slot; the driver copies the values at launch.
        let mut slots: Vec<[u8; 8]> = args
            .iter()
            .map(|a| {
                let mut slot = [0u8; 8];
                match *a {
                    KernelArg::Ptr(p) => slot.copy_from_slice(&p.0.to_ne_bytes()),
                    KernelArg::U64(v) => slot.copy_from_slice(&v.to_ne_bytes()),
                    KernelArg::I32(v) => slot[..4].copy_from_slice(&v.to_ne_bytes()),
                    KernelArg::U32(v) => slot[..4].copy_from_slice(&v.to_ne_bytes()),
                    KernelArg::F32(v) => slot[..4].copy_from_slice(&v.to_ne_bytes()),
                }
                slot
            })
            .collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s.as_mut_ptr() as *mut c_void)
            .collect();
        let [gx, gy, gz] = config.grid;
        let [bx, by, bz] = config.block;
        // SAFETY: the attributes are plain data; each one's union member is the one its `id` names.
        let mut attributes: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut count = 0;
        if self.pdl {
            attributes[count].id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attributes[count]
                .value
                .programmaticStreamSerializationAllowed = 1;
            count += 1;
        }
        if let Some(percent) = carveout {
            attributes[count].id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT;
            attributes[count].value.sharedMemCarveout = percent.into();
            count += 1;
        }
        if count > 0 {
            let launch = sys::CUlaunchConfig {
                gridDimX: gx,
                gridDimY: gy,
                gridDimZ: gz,
                blockDimX: bx,
                blockDimY: by,
                blockDimZ: bz,
                sharedMemBytes: config.shared_mem_bytes,
                hStream: s,
                attrs: attributes.as_mut_ptr(),
                numAttrs: count as u32,
            };
            // SAFETY: as for cuLaunchKernel below; `launch` and `attributes` outlive the call.
            return check("cuLaunchKernelEx", unsafe {
                sys::cuLaunchKernelEx(&launch, function, params.as_mut_ptr(), std::ptr::null_mut())
            });
        }
        // SAFETY: `params` holds one pointer per argument of the kernel's signature (the typed
        // argument structs in metrale-kernels mirror the C signatures), each to a live slot at
        // least as large as the argument; both outlive the call, which copies the values.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                function,
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                config.shared_mem_bytes,
                s,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

/// Lets `function` launch with as much dynamic shared memory as the device allows a block beyond
/// its static shared memory (the default cap is 48 KiB; the decode attention's key/value rings
/// take more).
fn opt_in_shared_memory(device: sys::CUdevice, function: sys::CUfunction) -> Result<(), GpuError> {
    let (mut optin, mut fixed) = (0i32, 0i32);
    // SAFETY: out-pointers to locals; the device and function are live.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(
            &mut optin,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            device,
        )
    })?;
    // SAFETY: out-pointer to a local; the function is live.
    check("cuFuncGetAttribute", unsafe {
        sys::cuFuncGetAttribute(
            &mut fixed,
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
            function,
        )
    })?;
    // SAFETY: sets a plain attribute of a live function.
    check("cuFuncSetAttribute", unsafe {
        sys::cuFuncSetAttribute(
            function,
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            (optin - fixed).max(0),
        )
    })
}

/// An operator switch of the environment: unset `None`, `0` off, `1` on, anything else an error
/// (every `METRALE_*` switch read at run time takes these two values).
pub fn operator_switch(name: &'static str) -> Result<Option<bool>, GpuError> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) => match v.trim() {
            "0" => Ok(Some(false)),
            "1" => Ok(Some(true)),
            _ => Err(GpuError::BadVariable {
                name,
                value: v,
                expected: "0 (off) or 1 (on)",
            }),
        },
    }
}
