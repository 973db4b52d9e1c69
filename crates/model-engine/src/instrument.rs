// SPDX-License-Identifier: MIT OR Apache-2.0
//! Measuring a step from inside: a trace build's timeline, per-launch times (the profile),
//! launches left out to time the step without them, and the MoE layers' expert choices.

use std::sync::atomic::{AtomicUsize, Ordering};

use metrale_core::DevicePtr;
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::trace::{
    TRACE_CAPACITY, TraceRecord, parse_trace, trace_header, trace_words,
};

use crate::model::{Model, ModelError, StepInput};
use crate::plan::{BlockKind, MlpKind};
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
    /// `gemv_norm=off`) to time the parts apart. The add + RMSNorm and SiLU x up launches that
    /// write an FP8 product's e4m3 rows keep their labels and take the quantization with them
    /// (`fp8_fused_quantize=off` times it apart: then it is the `fp8_quantize` launch).
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

/// Where the MoE blocks of a step copy their expert choices while routing capture is on
/// ([`Model::set_routing_capture`]): one slot per sparse layer, in step order, each room for
/// `max_tokens * top_k` ids.
pub(crate) struct RoutingCapture {
    buffer: DevicePtr,
    slot_bytes: usize,
    slots: usize,
    top_k: usize,
    /// Slots the current step has filled.
    filled: AtomicUsize,
}

impl RoutingCapture {
    /// Copies a MoE layer's `bytes` of `topk_ids` into the next slot, on the default stream.
    pub(crate) fn record(
        &self,
        gpu: &dyn GpuBackend,
        ids: DevicePtr,
        bytes: usize,
    ) -> Result<(), ModelError> {
        let slot = self.filled.fetch_add(1, Ordering::Relaxed);
        if slot >= self.slots || bytes > self.slot_bytes {
            return Err(ModelError::InvalidStep(format!(
                "routing capture: slot {slot} of {}, {bytes} bytes of {}",
                self.slots, self.slot_bytes
            )));
        }
        let dst = self.buffer.offset(slot * self.slot_bytes);
        gpu.copy_d2d(ids, dst, bytes, gpu.default_stream())?;
        Ok(())
    }

    /// Starts a step: its layers fill the slots from the first.
    pub(crate) fn begin(&self) {
        self.filled.store(0, Ordering::Relaxed);
    }
}

impl Model {
    /// Routing capture on or off: while on, every MoE layer of a step copies its chosen experts
    /// out ([`Model::captured_routing`] reads them after the step), and decode steps are launched
    /// directly rather than replayed from a graph (a graph holds no copies). For parity
    /// diagnostics: which experts the engine took where its logits differ from a reference's.
    /// A model without MoE layers captures nothing.
    pub fn set_routing_capture(&mut self, on: bool) -> Result<(), ModelError> {
        if let Some(c) = self.routing.take() {
            self.gpu.free(c.buffer)?;
        }
        let top_k = self.plan().blocks().find_map(|(_, b)| match b.kind {
            BlockKind::Mlp(MlpKind::Moe(m)) => Some(m.top_k),
            _ => None,
        });
        let slots = self
            .plan()
            .blocks()
            .filter(|(_, b)| matches!(b.kind, BlockKind::Mlp(MlpKind::Moe(_))))
            .count();
        if let (true, Some(top_k)) = (on, top_k) {
            let slot_bytes = self.options.max_tokens_per_step * top_k * 4;
            self.routing = Some(RoutingCapture {
                buffer: self.gpu.alloc(slot_bytes * slots)?,
                slot_bytes,
                slots,
                top_k,
                filled: AtomicUsize::new(0),
            });
        }
        Ok(())
    }

    /// The last step's expert choices (routing capture on): per sparse layer in order, `rows`
    /// rows of `top_k` expert ids (the step's rows in order). Empty when capture is off.
    pub fn captured_routing(&self, rows: usize) -> Result<Vec<Vec<i32>>, ModelError> {
        let Some(c) = &self.routing else {
            return Ok(Vec::new());
        };
        let (g, s) = (self.gpu.as_ref(), self.gpu.default_stream());
        g.synchronize(s)?;
        let bytes = rows * c.top_k * 4;
        if bytes > c.slot_bytes {
            return Err(ModelError::InvalidStep(format!(
                "{rows} rows of routing asked, {} captured at most",
                c.slot_bytes / (c.top_k * 4)
            )));
        }
        (0..c.filled.load(Ordering::Relaxed).min(c.slots))
            .map(|slot| {
                let mut ids = vec![0i32; rows * c.top_k];
                g.copy_d2h(
                    c.buffer.offset(slot * c.slot_bytes),
                    bytemuck::cast_slice_mut(&mut ids),
                )?;
                Ok(ids)
            })
            .collect()
    }
}
