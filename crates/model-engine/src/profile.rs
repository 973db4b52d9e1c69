// SPDX-License-Identifier: MIT OR Apache-2.0
//! Per-kernel timing of a step (`Model::set_profile`): an event is recorded after every launch,
//! and once the step has run, the time between consecutive events is charged to the launch that
//! ended it. Graph replay is off while profiling (events inside a capture would become graph
//! nodes), so a profiled decode step also pays each launch's gap; the sum over a step is its
//! GPU time, the per-label split says where it went.

use metrale_gpu_runtime::{Event, GpuBackend, GpuError};

#[derive(Default)]
pub(crate) struct Profiler {
    events: Vec<Event>,
    labels: Vec<&'static str>,
}

impl Profiler {
    /// Forgets the previous step's marks and records the starting event.
    pub(crate) fn begin(&mut self, gpu: &dyn GpuBackend) -> Result<(), GpuError> {
        self.labels.clear();
        self.mark(gpu, "start")
    }

    /// Records an event after the work queued so far, charged to `label`.
    pub(crate) fn mark(
        &mut self,
        gpu: &dyn GpuBackend,
        label: &'static str,
    ) -> Result<(), GpuError> {
        let i = self.labels.len();
        if i == self.events.len() {
            self.events.push(gpu.create_event()?);
        }
        gpu.record_event(self.events[i], gpu.default_stream())?;
        self.labels.push(label);
        Ok(())
    }

    /// Milliseconds per launch of the last step, in launch order (call after it has run).
    pub(crate) fn times(&self, gpu: &dyn GpuBackend) -> Result<Vec<(&'static str, f64)>, GpuError> {
        let mut out = Vec::with_capacity(self.labels.len().saturating_sub(1));
        for i in 1..self.labels.len() {
            let ms = gpu.elapsed_ms(self.events[i - 1], self.events[i])?;
            out.push((self.labels[i], f64::from(ms)));
        }
        Ok(out)
    }
}
