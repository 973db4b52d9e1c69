// SPDX-License-Identifier: MIT OR Apache-2.0
//! The host backend: every kernel launch runs the kernel's Rust reference on host memory.
//!
//! Work runs synchronously at the call, so every stream is trivially in order and events hold the
//! wall-clock time they were recorded. Graphs are real: work queued on a capturing stream is
//! recorded, not run, and replaying the graph runs the recorded operations with the arguments they
//! were captured with, as a CUDA graph does.

use std::sync::Mutex;
use std::time::Instant;

use metrale_core::{DevicePtr, KernelArg, KernelName, LaunchConfig};
use metrale_kernels::{HostKernelFn, HostMemory, host_reference};

use crate::backend::{Event, GpuBackend, GpuError, Graph, KernelHandle, PinnedHostBuffer, Stream};
use crate::capture::Recorder;
use crate::cuda::HostStorage;
use crate::pool::HostPool;

#[derive(Clone, Debug)]
enum Op {
    Launch {
        kernel: usize,
        config: LaunchConfig,
        args: Vec<KernelArg>,
    },
    Copy {
        src: DevicePtr,
        dst: DevicePtr,
        bytes: usize,
    },
    Memset {
        ptr: DevicePtr,
        value: u8,
        bytes: usize,
    },
}

struct State {
    pool: HostPool,
    kernels: Vec<(KernelName, HostKernelFn)>,
    streams: u32,
    events: Vec<Option<Instant>>,
    capture: Recorder<Op>,
}

/// Runs the engine on the CPU through the kernels' host references.
pub struct HostBackend {
    state: Mutex<State>,
}

impl HostBackend {
    /// A backend whose simulated device memory holds at most `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        HostBackend {
            state: Mutex::new(State {
                pool: HostPool::new(capacity),
                kernels: Vec::new(),
                streams: 1,
                events: Vec::new(),
                capture: Recorder::default(),
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic inside a reference leaves no half-updated bookkeeping worth refusing; recover.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    fn check_stream(&self, stream: Stream) -> Result<(), GpuError> {
        if stream.0 < self.streams {
            Ok(())
        } else {
            Err(GpuError::InvalidHandle {
                kind: "stream",
                id: stream.0.into(),
            })
        }
    }

    /// Records `op` if `stream` is capturing, else runs it.
    fn submit(&mut self, op: Op, stream: Stream) -> Result<(), GpuError> {
        self.check_stream(stream)?;
        match self.capture.record(op, stream) {
            Some(op) => self.run(&op),
            None => Ok(()),
        }
    }

    fn run(&mut self, op: &Op) -> Result<(), GpuError> {
        match op {
            Op::Launch {
                kernel,
                config,
                args,
            } => {
                let (_, reference) = self.kernels[*kernel];
                reference(&mut self.pool, config, args)?;
            }
            Op::Copy { src, dst, bytes } => {
                let data = self.pool.bytes(*src, *bytes)?.to_vec();
                self.pool.bytes_mut(*dst, *bytes)?.copy_from_slice(&data);
            }
            Op::Memset { ptr, value, bytes } => self.pool.bytes_mut(*ptr, *bytes)?.fill(*value),
        }
        Ok(())
    }

    fn no_capture(&self, what: &str) -> Result<(), GpuError> {
        if self.capture.is_capturing() {
            Err(GpuError::Capture(format!(
                "{what} cannot run while a graph is being captured"
            )))
        } else {
            Ok(())
        }
    }
}

impl GpuBackend for HostBackend {
    fn kind(&self) -> &'static str {
        "host"
    }

    fn alloc(&self, bytes: usize) -> Result<DevicePtr, GpuError> {
        self.state().pool.alloc(bytes)
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), GpuError> {
        self.state().pool.free(ptr)
    }

    fn copy_h2d(&self, src: &[u8], dst: DevicePtr) -> Result<(), GpuError> {
        let mut s = self.state();
        s.no_capture("a host-to-device copy")?;
        s.pool.bytes_mut(dst, src.len())?.copy_from_slice(src);
        Ok(())
    }

    fn copy_d2h(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), GpuError> {
        let s = self.state();
        s.no_capture("a device-to-host copy")?;
        dst.copy_from_slice(s.pool.bytes(src, dst.len())?);
        Ok(())
    }

    fn copy_d2h_on(&self, src: DevicePtr, dst: &mut [u8], stream: Stream) -> Result<(), GpuError> {
        let s = self.state();
        s.check_stream(stream)?;
        s.no_capture("a device-to-host copy")?;
        // Work runs as it is queued here, so every stream is always drained.
        dst.copy_from_slice(s.pool.bytes(src, dst.len())?);
        Ok(())
    }

    fn copy_d2d(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        self.state().submit(Op::Copy { src, dst, bytes }, stream)
    }

    fn memset(
        &self,
        ptr: DevicePtr,
        value: u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        self.state()
            .submit(Op::Memset { ptr, value, bytes }, stream)
    }

    fn total_memory(&self) -> Result<u64, GpuError> {
        Ok(self.state().pool.capacity())
    }

    fn free_memory(&self) -> Result<u64, GpuError> {
        let s = self.state();
        Ok(s.pool.capacity() - s.pool.in_use())
    }

    fn alloc_host_pinned(&self, bytes: usize) -> Result<PinnedHostBuffer, GpuError> {
        Ok(PinnedHostBuffer {
            storage: HostStorage::Plain(vec![0; bytes]),
        })
    }

    fn kernel(&self, name: KernelName) -> Result<KernelHandle, GpuError> {
        let mut s = self.state();
        if let Some(i) = s.kernels.iter().position(|(n, _)| *n == name) {
            return Ok(KernelHandle(i as u32));
        }
        let reference = host_reference(name).ok_or_else(|| GpuError::UnknownKernel {
            name,
            reason: "it has no host reference in metrale-kernels".into(),
        })?;
        s.kernels.push((name, reference));
        Ok(KernelHandle(s.kernels.len() as u32 - 1))
    }

    fn launch(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        stream: Stream,
    ) -> Result<(), GpuError> {
        let mut s = self.state();
        if kernel.0 as usize >= s.kernels.len() {
            return Err(GpuError::InvalidHandle {
                kind: "kernel",
                id: kernel.0.into(),
            });
        }
        s.submit(
            Op::Launch {
                kernel: kernel.0 as usize,
                config: *config,
                args: args.to_vec(),
            },
            stream,
        )
    }

    fn create_stream(&self) -> Result<Stream, GpuError> {
        let mut s = self.state();
        s.streams += 1;
        Ok(Stream(s.streams - 1))
    }

    fn synchronize(&self, stream: Stream) -> Result<(), GpuError> {
        self.state().check_stream(stream)
    }

    fn create_event(&self) -> Result<Event, GpuError> {
        let mut s = self.state();
        s.events.push(None);
        Ok(Event(s.events.len() as u32 - 1))
    }

    fn record_event(&self, event: Event, stream: Stream) -> Result<(), GpuError> {
        let mut s = self.state();
        s.check_stream(stream)?;
        let slot = s
            .events
            .get_mut(event.0 as usize)
            .ok_or(GpuError::InvalidHandle {
                kind: "event",
                id: event.0.into(),
            })?;
        *slot = Some(Instant::now());
        Ok(())
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<(), GpuError> {
        let s = self.state();
        s.check_stream(stream)?;
        s.events
            .get(event.0 as usize)
            .map(|_| ())
            .ok_or(GpuError::InvalidHandle {
                kind: "event",
                id: event.0.into(),
            })
    }

    fn elapsed_ms(&self, start: Event, end: Event) -> Result<f32, GpuError> {
        let s = self.state();
        let get = |e: Event| {
            s.events
                .get(e.0 as usize)
                .copied()
                .flatten()
                .ok_or(GpuError::InvalidHandle {
                    kind: "recorded event",
                    id: e.0.into(),
                })
        };
        Ok(get(end)?
            .saturating_duration_since(get(start)?)
            .as_secs_f32()
            * 1e3)
    }

    fn begin_capture(&self, stream: Stream) -> Result<(), GpuError> {
        let mut s = self.state();
        s.check_stream(stream)?;
        s.capture.begin(stream)
    }

    fn end_capture(&self, stream: Stream) -> Result<Graph, GpuError> {
        self.state().capture.end(stream)
    }

    fn launch_graph(&self, graph: Graph, stream: Stream) -> Result<(), GpuError> {
        let mut s = self.state();
        s.check_stream(stream)?;
        s.no_capture("a graph launch")?;
        for op in &s.capture.graph(graph)? {
            s.run(op)?;
        }
        Ok(())
    }
}
