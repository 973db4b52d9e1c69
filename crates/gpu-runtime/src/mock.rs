// SPDX-License-Identifier: MIT OR Apache-2.0
//! The mock backend: runs no kernel, records every launch and copy.
//!
//! Memory is real (host buffers), so copies round-trip and a test can check what a loader
//! uploaded; launches are only recorded, so a test checks the number, shape and order of launches
//! without depending on kernels being correct. [`MockBackend::without_module`] makes a module
//! absent, to test how callers report a kernel their target lacks.

use std::sync::Mutex;

use metrale_core::{DevicePtr, KernelArg, KernelName, LaunchConfig};

use crate::backend::{Event, GpuBackend, GpuError, Graph, KernelHandle, PinnedHostBuffer, Stream};
use crate::capture::Recorder;
use crate::cuda::HostStorage;
use crate::pool::HostPool;
use metrale_kernels::HostMemory;

/// One recorded operation.
#[derive(Clone, Debug, PartialEq)]
pub enum Recorded {
    /// A kernel launch (outside a capture, or replayed from a graph).
    Launch {
        /// The entry point.
        kernel: KernelName,
        /// Grid, block, shared memory.
        config: LaunchConfig,
        /// Arguments in C order.
        args: Vec<KernelArg>,
        /// The stream.
        stream: Stream,
        /// The launch's own shared-memory carveout ([`GpuBackend::launch_with_carveout`]).
        carveout: Option<u8>,
    },
    /// Host to device.
    CopyH2D {
        /// Destination.
        dst: DevicePtr,
        /// Bytes.
        bytes: usize,
    },
    /// Device to host.
    CopyD2H {
        /// Source.
        src: DevicePtr,
        /// Bytes.
        bytes: usize,
    },
    /// Device to device.
    CopyD2D {
        /// Source.
        src: DevicePtr,
        /// Destination.
        dst: DevicePtr,
        /// Bytes.
        bytes: usize,
    },
    /// A memset.
    Memset {
        /// Start.
        ptr: DevicePtr,
        /// Byte value.
        value: u8,
        /// Bytes.
        bytes: usize,
    },
    /// A stream synchronisation.
    Synchronize(Stream),
    /// A graph replay; its operations follow as their own records.
    GraphLaunch(Graph),
}

#[derive(Default)]
struct State {
    kernels: Vec<KernelName>,
    streams: u32,
    events: u32,
    capture: Recorder<Recorded>,
    log: Vec<Recorded>,
}

/// Records launches and copies; executes nothing.
pub struct MockBackend {
    state: Mutex<State>,
    pool: Mutex<HostPool>,
    missing_modules: Vec<&'static str>,
}

impl Default for MockBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MockBackend {
    /// A mock with 16 GiB of simulated memory where every kernel resolves.
    pub fn new() -> Self {
        MockBackend {
            state: Mutex::new(State {
                streams: 1,
                ..State::default()
            }),
            pool: Mutex::new(HostPool::new(16 << 30)),
            missing_modules: Vec::new(),
        }
    }

    /// The same mock, but looking up any kernel of `module` fails.
    pub fn without_module(mut self, module: &'static str) -> Self {
        self.missing_modules.push(module);
        self
    }

    /// Everything recorded so far, in order.
    pub fn recorded(&self) -> Vec<Recorded> {
        self.state().log.clone()
    }

    /// Only the launches recorded so far.
    pub fn launches(&self) -> Vec<Recorded> {
        self.recorded()
            .into_iter()
            .filter(|r| matches!(r, Recorded::Launch { .. }))
            .collect()
    }

    /// Forgets the records (not the memory).
    pub fn clear(&self) {
        self.state().log.clear();
    }

    /// Records a launch of `kernel`, with its carveout if it asked for one.
    fn record_launch(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        stream: Stream,
        carveout: Option<u8>,
    ) -> Result<(), GpuError> {
        let name = *self
            .state()
            .kernels
            .get(kernel.0 as usize)
            .ok_or(GpuError::InvalidHandle {
                kind: "kernel",
                id: kernel.0.into(),
            })?;
        self.submit(
            Recorded::Launch {
                kernel: name,
                config: *config,
                args: args.to_vec(),
                stream,
                carveout,
            },
            stream,
        )
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, HostPool> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn submit(&self, record: Recorded, stream: Stream) -> Result<(), GpuError> {
        let mut s = self.state();
        if stream.0 >= s.streams {
            return Err(GpuError::InvalidHandle {
                kind: "stream",
                id: stream.0.into(),
            });
        }
        if let Some(record) = s.capture.record(record, stream) {
            s.log.push(record);
        }
        Ok(())
    }
}

impl GpuBackend for MockBackend {
    fn kind(&self) -> &'static str {
        "mock"
    }

    fn alloc(&self, bytes: usize) -> Result<DevicePtr, GpuError> {
        self.pool().alloc(bytes)
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), GpuError> {
        self.pool().free(ptr)
    }

    fn copy_h2d(&self, src: &[u8], dst: DevicePtr) -> Result<(), GpuError> {
        self.pool().bytes_mut(dst, src.len())?.copy_from_slice(src);
        self.state().log.push(Recorded::CopyH2D {
            dst,
            bytes: src.len(),
        });
        Ok(())
    }

    fn copy_d2h(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), GpuError> {
        dst.copy_from_slice(self.pool().bytes(src, dst.len())?);
        self.state().log.push(Recorded::CopyD2H {
            src,
            bytes: dst.len(),
        });
        Ok(())
    }

    fn copy_d2h_on(&self, src: DevicePtr, dst: &mut [u8], _stream: Stream) -> Result<(), GpuError> {
        self.copy_d2h(src, dst)
    }

    fn copy_d2d(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        self.submit(Recorded::CopyD2D { src, dst, bytes }, stream)
    }

    fn memset(
        &self,
        ptr: DevicePtr,
        value: u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        self.submit(Recorded::Memset { ptr, value, bytes }, stream)
    }

    fn total_memory(&self) -> Result<u64, GpuError> {
        Ok(self.pool().capacity())
    }

    fn free_memory(&self) -> Result<u64, GpuError> {
        let p = self.pool();
        Ok(p.capacity() - p.in_use())
    }

    fn alloc_host_pinned(&self, bytes: usize) -> Result<PinnedHostBuffer, GpuError> {
        Ok(PinnedHostBuffer {
            storage: HostStorage::Plain(vec![0; bytes]),
        })
    }

    fn kernel(&self, name: KernelName) -> Result<KernelHandle, GpuError> {
        if self.missing_modules.contains(&name.module) {
            return Err(GpuError::UnknownKernel {
                name,
                reason: format!("module `{}` is not loaded (mock)", name.module),
            });
        }
        let mut s = self.state();
        let index = match s.kernels.iter().position(|n| *n == name) {
            Some(i) => i,
            None => {
                s.kernels.push(name);
                s.kernels.len() - 1
            }
        };
        Ok(KernelHandle(index as u32))
    }

    fn launch(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        stream: Stream,
    ) -> Result<(), GpuError> {
        self.record_launch(kernel, config, args, stream, None)
    }

    fn launch_with_carveout(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        stream: Stream,
        carveout_percent: u8,
    ) -> Result<(), GpuError> {
        self.record_launch(kernel, config, args, stream, Some(carveout_percent))
    }

    fn create_stream(&self) -> Result<Stream, GpuError> {
        let mut s = self.state();
        s.streams += 1;
        Ok(Stream(s.streams - 1))
    }

    fn synchronize(&self, stream: Stream) -> Result<(), GpuError> {
        self.state().log.push(Recorded::Synchronize(stream));
        Ok(())
    }

    fn create_event(&self) -> Result<Event, GpuError> {
        let mut s = self.state();
        s.events += 1;
        Ok(Event(s.events - 1))
    }

    fn record_event(&self, _event: Event, _stream: Stream) -> Result<(), GpuError> {
        Ok(())
    }

    fn stream_wait_event(&self, _stream: Stream, _event: Event) -> Result<(), GpuError> {
        Ok(())
    }

    fn elapsed_ms(&self, _start: Event, _end: Event) -> Result<f32, GpuError> {
        Ok(0.0)
    }

    fn begin_capture(&self, stream: Stream) -> Result<(), GpuError> {
        self.state().capture.begin(stream)
    }

    fn end_capture(&self, stream: Stream) -> Result<Graph, GpuError> {
        self.state().capture.end(stream)
    }

    fn launch_graph(&self, graph: Graph, _stream: Stream) -> Result<(), GpuError> {
        let mut s = self.state();
        let ops = s.capture.graph(graph)?;
        s.log.push(Recorded::GraphLaunch(graph));
        s.log.extend(ops);
        Ok(())
    }
}
