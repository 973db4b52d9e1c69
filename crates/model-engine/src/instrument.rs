// SPDX-License-Identifier: MIT OR Apache-2.0
//! Measuring a step from inside: a trace build's timeline, per-launch times (the profile), and
//! launches left out to time the step without them.

use metrale_core::DevicePtr;
use metrale_gpu_runtime::trace::{
    TRACE_CAPACITY, TraceRecord, parse_trace, trace_header, trace_words,
};

use crate::model::{Model, ModelError, StepInput};
use crate::profile::Profiler;
use crate::tuning::LAUNCH_LABELS;

impl Model {
    /// A trace build's timeline of one step of `step` through [`Model::forward_argmax`] (replayed
    /// from its graph when graphs are on): the record of every launch of our kernels in launch
    /// order (block 0 at its programmatic-launch wait: [`metrale_gpu_runtime::trace`]; cuBLASLt's
    /// launches have none), at most [`TRACE_CAPACITY`] of them, or `None` when the loaded
    /// kernels have no trace (a release build, the host or mock backend). The step's outputs are
    /// the untraced step's (the trace only adds stores of its own).
    pub fn trace_step(&mut self, step: &StepInput) -> Result<Option<Vec<TraceRecord>>, ModelError> {
        // The kernels write up to their own bound; the buffer has room for all of it.
        let capacity = TRACE_CAPACITY;
        let g = self.gpu.clone();
        let bytes = trace_words(capacity) * 8;
        let buffer = g.alloc(bytes)?;
        if let Err(e) = g.copy_h2d(&trace_header(capacity), buffer) {
            g.free(buffer)?;
            return Err(e.into());
        }
        let on = g.set_kernel_trace(buffer);
        let ran = match on {
            Ok(true) => Some(self.forward_argmax(step)),
            _ => None,
        };
        // Off on every path, and the buffer freed only once no module points at it any more
        // (otherwise it is left allocated: later kernels would write records into it).
        let off = g.set_kernel_trace(DevicePtr::NULL);
        if let Err(off_error) = off {
            let first = match on {
                Err(e) => e,
                Ok(_) => off_error,
            };
            return Err(first.into());
        }
        let read = match (&on, &ran) {
            (Ok(true), Some(Ok(_))) => {
                let mut raw = vec![0u8; bytes];
                g.copy_d2h(buffer, &mut raw).map(|()| {
                    let words: Vec<u64> = bytemuck::pod_collect_to_vec(&raw);
                    Some(parse_trace(&words))
                })
            }
            _ => Ok(None),
        };
        let freed = g.free(buffer);
        on?;
        if let Some(ran) = ran {
            ran?;
        }
        let records = read?;
        freed?;
        Ok(records)
    }

    /// For timing experiments only: leave out every launch with one of these labels (the
    /// labels of [`Model::profile`]), so that a step's time without them can be measured where
    /// it matters, inside the replayed graph. The step's outputs are then wrong. Captured graphs
    /// are set aside (not freed: this is a measuring tool) so that the next decode steps are
    /// captured without those launches. Where a fused launch stands for two (the one-sequence
    /// decode attention with qkv_post's work, labelled "attention"; the gate|up GEMV with
    /// SiLU x up, labelled "gate_up"; the qkv and gate|up GEMVs that do the residual add +
    /// RMSNorm before them, labelled "qkv" and "gate_up"), "qkv_post", "silu_mul" and
    /// "add_rmsnorm" leave out nothing of them and the fused label leaves out every part: turn
    /// the fusions off (`--tune fused_qkv_attention=false`, `fused_swiglu=false`,
    /// `gemv_norm=off`) to time the parts apart.
    pub fn set_skip(&mut self, labels: &[&str]) -> Result<(), ModelError> {
        self.skip = labels
            .iter()
            .map(|l| {
                LAUNCH_LABELS
                    .iter()
                    .copied()
                    .find(|k| k == l)
                    .ok_or_else(|| {
                        ModelError::InvalidStep(format!(
                            "unknown launch label `{l}`; the labels are {}",
                            LAUNCH_LABELS.join(", ")
                        ))
                    })
            })
            .collect::<Result<_, _>>()?;
        self.graphs.clear();
        Ok(())
    }

    /// When profiling, records the end of the work queued so far under `label`.
    pub(crate) fn mark(&self, label: &'static str) -> Result<(), ModelError> {
        if let Some(p) = &self.profiler {
            p.lock()
                .expect("profiler lock")
                .mark(self.gpu.as_ref(), label)?;
        }
        Ok(())
    }

    /// Times every launch of the following steps (graph replay is off meanwhile); read the last
    /// step's times with [`Model::profile`].
    pub fn set_profile(&mut self, on: bool) {
        self.profiler = on.then(|| std::sync::Mutex::new(Profiler::default()));
    }

    /// The last step's launches in order, with their milliseconds (empty unless profiling).
    pub fn profile(&self) -> Result<Vec<(&'static str, f64)>, ModelError> {
        match &self.profiler {
            Some(p) => Ok(p.lock().expect("profiler lock").times(self.gpu.as_ref())?),
            None => Ok(Vec::new()),
        }
    }
}
